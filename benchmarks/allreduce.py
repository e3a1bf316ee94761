"""All-reduce on torch.distributed (gloo, local processes) and data-parallel training speed.

    python benchmarks/allreduce.py                 # about 3 minutes on 2 cores
    python benchmarks/allreduce.py --workers 1,2,4,8 --model vgg   # on a bigger machine

1. All-reduce bandwidth against message size for N = 2 and 4, with nccl-tests' definitions:
   algbw = bytes / t, busbw = algbw * 2(N-1)/N (the bytes each link carries in a ring).
2. `compress train` step time and throughput for 1, 2, 4 workers and each --grad-compression.
3. Our training step against a bare DDP loop on the same model and data (target <= 1.05x):
   the median step of each, alternating in the same two processes.

With more workers than cores, processes share cores: the numbers then measure contention, which
the output says.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

import torch


def _allreduce_rank(sizes, repeats, rank, world):
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        for _ in range(3):
            dist.all_reduce(x)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(x)
        t = (time.perf_counter() - t0) / repeats
        out.append((nbytes, t))
    return out


def _bare_ddp(model_name, batch, steps, rank, world):
    """A plain DDP loop: the same model, data, batch and optimizer, nothing else.
    Returns each step's seconds."""
    from torch.nn.parallel import DistributedDataParallel

    from compresskit.models import data, zoo

    ds = data.load("digits")
    spec = zoo.resolve_spec(model_name, {}, ds.in_shape, ds.num_classes)
    model = DistributedDataParallel(zoo.build(spec, seed=0))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    x, y = ds.x_train[:batch], ds.y_train[:batch]
    times = []
    for i in range(steps + 5):  # 5 warm-up steps
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if i >= 5:
            times.append(time.perf_counter() - t0)
    return times


class _StepClock:
    """Events that time rank 0's steps of `fit`: the gaps between consecutive steps of one
    epoch, so the per-epoch evaluation and checkpoint fall outside."""

    def __init__(self):
        self.times, self._last = [], None

    def epoch_start(self, *args):
        self._last = None

    def step(self, *args):
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now

    def __getattr__(self, name):  # every other event: ignored
        return lambda *args, **kwargs: None


def _our_loop(model_name, batch, epochs, rank, world):
    """`compress train`'s own loop (DDP through `distrib.allreduce`, data indexing, lr
    schedule, loss/accuracy bookkeeping). Returns rank 0's step seconds."""
    from compresskit.distrib.trainer import TrainConfig, fit
    from compresskit.models import data, zoo

    ds = data.load("digits")
    spec = zoo.resolve_spec(model_name, {}, ds.in_shape, ds.num_classes)
    clock = _StepClock()
    fit(zoo.build(spec, seed=0), ds, TrainConfig(epochs=epochs, batch_size=batch), events=clock)
    return clock.times


def _side_by_side(model_name, rounds, rank, world):
    """Bare loop and ours alternately in the same two processes: (bare, ours) median step
    seconds per round. Separate launches differed by up to 2x from run to run here."""
    out = []
    for _ in range(rounds):
        bare = _bare_ddp(model_name, 32, 150, rank, world)
        ours = _our_loop(model_name, 32, 5, rank, world)
        if rank == 0:  # only rank 0's loop reports its steps
            out.append((statistics.median(bare), statistics.median(ours)))
    return out


def train(model, workers, compression, epochs) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "cli",
        "train",
        "--model",
        model,
        "--data",
        "digits",
        "--epochs",
        str(epochs),
        "--workers",
        str(workers),
        "--grad-compression",
        compression,
        "--out",
        f"/tmp/allreduce-bench-{os.getpid()}.pt",
        "--json",
        "-q",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(done.stderr)
    return json.loads(done.stdout)


def main() -> None:
    from compresskit.distrib import launch

    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--model", default="lenet300")
    ap.add_argument("--epochs", type=int, default=3)
    args = ap.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    cores = os.cpu_count()
    print(f"# allreduce benchmark: {cores} cores, torch {torch.__version__}, gloo, 1 thread/rank")

    print("\n## 1. all-reduce bandwidth (gloo, one process per rank)\n")
    sizes = [2**k for k in range(12, 27, 2)]  # 4 KiB .. 64 MiB
    print("| N | bytes | time ms | algbw GB/s | busbw GB/s |\n|---|---|---|---|---|")
    for n in (2, 4):
        rows = launch.run(functools.partial(_allreduce_rank, sizes, 10), workers=n, timeout_s=300)
        for nbytes, t in rows:
            algbw = nbytes / t / 1e9
            print(
                f"| {n} | {nbytes:,} | {1000 * t:.3f} | {algbw:.3f} | "
                f"{algbw * 2 * (n - 1) / n:.3f} |"
            )

    print(
        f"\n## 2. compress train --model {args.model} on digits, {args.epochs} epochs, "
        "batch 32 per worker\n"
    )
    print("| workers | compression | steps/s | samples/s | comm MB (rank 0) | test acc |")
    print("|---|---|---|---|---|---|")
    for n in counts:
        for c in ("none", "fp16", "bf16") if n > 1 else ("none",):
            r = train(args.model, n, c, args.epochs)
            note = " (more workers than cores)" if n > cores else ""
            print(
                f"| {n}{note} | {c} | {r['steps_per_s']:.1f} | {r['samples_per_s']:.0f} | "
                f"{r['comm_bytes'] / 1e6:.1f} | {r['test_accuracy']:.2%} |"
            )

    print("\n## 3. our training step against a bare DDP loop (2 workers, batch 32 per worker)\n")
    rounds = launch.run(functools.partial(_side_by_side, args.model, 10), 2, timeout_s=600)
    print("| round | bare DDP ms (median) | compress loop ms (median) | ratio |\n|---|---|---|---|")
    for i, (b, o) in enumerate(rounds):
        print(f"| {i + 1} | {1000 * b:.3f} | {1000 * o:.3f} | {o / b:.3f}x |")
    ratio = statistics.median(o / b for b, o in rounds)
    best = min(o for _, o in rounds) / min(b for b, _ in rounds)
    print(
        f"\nmedian of the rounds' ratios {ratio:.3f}x; fastest round against fastest round "
        f"{best:.3f}x (target <= 1.05x)"
    )


if __name__ == "__main__":
    main()
