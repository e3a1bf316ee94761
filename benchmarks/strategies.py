"""All-reduce against the parameter-server strategies, with and without a straggler.

    python benchmarks/strategies.py                  # about 4 minutes on 2 cores
    python benchmarks/strategies.py --model lenet300 --epochs 10 --repeats 3

Every run is `compress train ... --json` on digits with N = 2 workers and S = N/2 = 1 server,
in the order all-reduce, ps-sync, ps-async, ps-ssp tau = 0, 1, 4, 16, first without and then
with worker 1 slowed 2x (`--straggler 1:2`: it sleeps as long as it computed). Each
configuration runs `--repeats` times, interleaved, and the table shows medians. It prints:

1. per strategy: samples/s, server updates/s, mean worker idle fraction, bytes per worker step,
   time to the target test accuracy (whole epochs), final test accuracy;
2. the targets: ps-sync step time against all-reduce (<= 1.2x), ps-ssp tau=4 with the
   straggler against ps-sync with it (>= 1.5x throughput, <= 0.5 points lower accuracy);
3. Li et al.'s finding, idle time falls as tau grows, from the straggler rows;
4. ps-sync's communication time per step against the bound t >= max(M/B, N*M/(S*B)), with
   B measured here as gloo point-to-point bandwidth at the shard's size.

All-reduce has no --straggler (it is a parameter-server option); ps-sync with the straggler
stands for synchronous training with one.
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

WORKERS, SERVERS = 2, 1
RUNS = [("allreduce", None)] + [
    (s, tau)
    for s, tau in [("ps-sync", None), ("ps-async", None)] + [("ps-ssp", t) for t in (0, 1, 4, 16)]
]


def train(model: str, epochs: int, strategy: str, tau: int | None, straggler: bool) -> dict:
    cmd = [sys.executable, "-m", "cli", "train", "--model", model, "--data", "digits"]
    cmd += ["--epochs", str(epochs), "--workers", str(WORKERS), "--strategy", strategy]
    if strategy.startswith("ps-"):
        cmd += ["--servers", str(SERVERS)]
    if tau is not None:
        cmd += ["--staleness", str(tau)]
    if straggler:
        cmd += ["--straggler", "1:2"]
    cmd += ["--out", f"/tmp/strategies-bench-{os.getpid()}.pt", "--json", "-q"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)}\n{done.stderr}")
    return json.loads(done.stdout)


def _p2p(nbytes: int, repeats: int, rank: int, world: int) -> float:
    """Seconds for one one-way transfer of `nbytes` (half a ping-pong's round trip)."""
    import torch.distributed as dist

    x = torch.ones(nbytes // 4)
    for i in range(repeats + 3):
        if i == 3:
            t0 = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)
    return (time.perf_counter() - t0) / repeats / 2


def time_to(history: list[dict], target: float) -> float | None:
    t = 0.0
    for h in history:
        t += h["seconds"]
        if h["test_accuracy"] >= target:
            return t
    return None


def summarise(runs: list[dict], target: float) -> dict:
    def med(f):
        values = [v for v in (f(r) for r in runs) if v is not None]
        return statistics.median(values) if values else None

    return {
        "samples_per_s": med(lambda r: r["samples_per_s"]),
        "steps_per_s": med(lambda r: r["steps_per_s"]),
        "idle": med(lambda r: statistics.mean(r["idle_fraction"].values()))
        if "idle_fraction" in runs[0]
        else None,
        "bytes_per_step": med(lambda r: r.get("bytes_per_step") or r["comm_bytes"] / r["steps"]),
        "to_target": med(lambda r: time_to(r["history"], target)),
        "accuracy": med(lambda r: r["test_accuracy"]),
        "idle_per_step_s": med(
            lambda r: (
                statistics.mean(r["idle_fraction"].values())
                * r["seconds"]
                / (r["comm_bytes"] / r["bytes_per_step"])
                if "idle_fraction" in r
                else None
            )
        ),
    }


def label(strategy: str, tau: int | None) -> str:
    return strategy + (f" tau={tau}" if tau is not None else "")


def fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def main() -> None:
    from distrib import launch

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mobilenet")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--target", type=float, default=0.95, help="test accuracy to reach")
    args = ap.parse_args()
    print(
        f"# strategies benchmark: {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{args.model} on digits, {args.epochs} epochs, N={WORKERS} workers, S={SERVERS} "
        f"server, batch 32 per worker, medians of {args.repeats} interleaved runs"
    )
    results: dict[tuple, list[dict]] = {}
    for _ in range(args.repeats):
        for straggler in (False, True):
            for strategy, tau in RUNS:
                if strategy == "allreduce" and straggler:
                    continue
                key = (strategy, tau, straggler)
                results.setdefault(key, []).append(
                    train(args.model, args.epochs, strategy, tau, straggler)
                )
    table = {k: summarise(v, args.target) for k, v in results.items()}

    print(f"\n## 1. strategies (target accuracy {args.target:.0%})\n")
    print(
        "| strategy | straggler | samples/s | updates/s | idle | bytes/step | "
        f"s to {args.target:.0%} | final acc |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (strategy, tau, straggler), r in table.items():
        print(
            f"| {label(strategy, tau)} | {'1 at 2x' if straggler else 'none'} | "
            f"{r['samples_per_s']:.0f} | {r['steps_per_s']:.1f} | {fmt(r['idle'], '.1%')} | "
            f"{r['bytes_per_step'] / 1e3:.0f} kB | {fmt(r['to_target'], '.2f', 'not reached')} | "
            f"{r['accuracy']:.2%} |"
        )

    print("\n## 2. targets\n")
    ar, sync = table[("allreduce", None, False)], table[("ps-sync", None, False)]
    step_ratio = ar["steps_per_s"] / sync["steps_per_s"]
    print(
        f"- ps-sync step time / all-reduce step time (S = N/2, no straggler): {step_ratio:.2f}x "
        "(target <= 1.2x)"
    )
    slow_sync, slow_ssp = table[("ps-sync", None, True)], table[("ps-ssp", 4, True)]
    gain = slow_ssp["samples_per_s"] / slow_sync["samples_per_s"]
    change = 100 * (slow_ssp["accuracy"] - slow_sync["accuracy"])
    print(
        f"- ps-ssp tau=4 / ps-sync throughput with a 2x straggler: {gain:.2f}x (target >= 1.5x); "
        f"final accuracy {change:+.2f} points against ps-sync (target >= -0.5)"
    )
    slow_async = table[("ps-async", None, True)]
    print(
        f"- ps-async / ps-sync throughput with the straggler: "
        f"{slow_async['samples_per_s'] / slow_sync['samples_per_s']:.2f}x"
    )

    print("\n## 3. idle time against tau (with the straggler)\n")
    print("| tau | mean idle | samples/s |\n|---|---|---|")
    for tau in (0, 1, 4, 16):
        r = table[("ps-ssp", tau, True)]
        print(f"| {tau} | {r['idle']:.1%} | {r['samples_per_s']:.0f} |")
    print(f"| inf (ps-async) | {slow_async['idle']:.1%} | {slow_async['samples_per_s']:.0f} |")

    print("\n## 4. ps-sync communication per step against the bound\n")
    m = sync["bytes_per_step"] / 2  # the gradient out (the weights back are as many bytes)
    shard = int(m / SERVERS)
    one_way = launch.run(functools.partial(_p2p, shard, 50), 2, timeout_s=120)
    bandwidth = shard / one_way
    bound = max(m / bandwidth, WORKERS * m / (SERVERS * bandwidth))
    print(
        f"M = {m / 1e3:.0f} kB of fp32 gradient per worker step; point-to-point bandwidth B at "
        f"{shard / 1e3:.0f} kB = {bandwidth / 1e9:.2f} GB/s\n"
        f"bound max(M/B, N*M/(S*B)) = {1e3 * bound:.3f} ms per direction; measured time in "
        f"push and pull per step (rank 0, no straggler) = {1e3 * sync['idle_per_step_s']:.3f} ms "
        f"({sync['idle_per_step_s'] / bound:.1f}x the bound)"
    )


if __name__ == "__main__":
    main()
