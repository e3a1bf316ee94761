"""`compress plan`'s predicted step times against real `compress train` runs on this machine.

    python benchmarks/plan_check.py                       # lenet300 and vgg, about 4 minutes
    python benchmarks/plan_check.py --models lenet300 --workers 1,2,4 --repeats 3

For each model, strategy (all-reduce, ps-sync) and N in --workers, it runs

    compress train --model M --data npz:DIGITS-xR --workers N --batch-size G/N
                   --strategy allreduce|ps-sync [--servers S] --epochs E --json

with the GLOBAL batch G fixed (strong scaling, as the planner assumes), and takes the measured
step time from the epochs after the first (warm-up): epoch seconds / steps per epoch. The data
is sklearn's digits repeated R times (the test split kept as is), so an epoch has enough steps
that its fixed costs (a checkpoint write and a test-set evaluation) stay a few percent of it;
with plain `--data digits` (21 steps of 64) they were a quarter of a LeNet-300 epoch.

Threads: by default every process runs 1 thread (OMP_NUM_THREADS=1 for the runs, which
`distrib.launch.share_cores` honours, and `--threads 1` for the planner), so N workers are N
one-core machines and a single process is not penalised by a busy neighbour's core. With
--threads auto each process gets what `share_cores` gives it (cores // processes, at least 1;
a single process keeps all cores) and the planner measures compute on as many. The
prediction for each configuration comes from `compress plan --json` with --servers S as the
run, and the links (send/recv for the parameter server, all-reduce for the ring) measured
once by the first call and passed to every later one (`--links-from`). A parameter server with S servers runs N + S processes.

The planner predicts for one machine per worker; here N workers share one machine, and they
slow each other down even where each has a core of its own (on the 2-core cloud VM of this
project two concurrent one-thread workers each computed LeNet-300-100's step 1.6-2.2x slower
than one alone: its two "cores" do not deliver two cores' work). So the harness measures that
too: the model's forward+backward at the per-worker batch and its optimizer step, timed by the
planner's own `measure_compute` in N concurrent processes (started together)
and in one, and prints a second prediction, "co-located", with the compute and update parts
multiplied by the measured slow-downs. That is the prediction a run on this machine is judged
against; the planner's own (one machine per worker) is printed beside it.

Prints a Markdown table: predicted ms (compute + comm + update) for one machine per worker,
the co-location slow-downs and the prediction for this machine, measured ms (median of
--repeats interleaved runs), measured / predicted here, whether it is within 25%, measured /
the planner's own prediction, and the 1-minute load average as each run started (other
processes on the machine slow the runs, not the prediction); then the link and compute the
planner measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 0.25


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def compress(*args: str) -> dict:
    cmd = [sys.executable, "-m", "compresskit.cli", *args, "--json"]
    env = dict(os.environ)
    if THREADS["mode"] != "auto":
        env["OMP_NUM_THREADS"] = THREADS["mode"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)}\n{done.stderr}")
    return json.loads(done.stdout)


def write_data(path: Path, repeat: int) -> int:
    """sklearn digits, the training split repeated `repeat` times; returns the training
    samples the trainer will see (after its validation hold-out)."""
    from compresskit.models import data

    ds = data.load("digits")
    x = np.concatenate([ds.x_train.numpy()] * repeat)
    y = np.concatenate([ds.y_train.numpy()] * repeat)
    np.savez(path, x=x, y=y, x_test=ds.x_test.numpy(), y_test=ds.y_test.numpy())
    return len(data.load(f"npz:{path}").y_train)


def runs(workers: list[int], strategies: list[str]) -> list[tuple[str, int, int]]:
    """(strategy, N, S): all-reduce and ps-sync with S = ceil(N/2) servers."""
    return [(s, n, -(-n // 2) if s == "ps" else 0) for s in strategies for n in workers]


def processes(strategy: str, n: int, s: int) -> int:
    return n + s if strategy == "ps" else n


THREADS = {"mode": "1"}


def threads(strategy: str, n: int, s: int) -> int:
    if THREADS["mode"] != "auto":
        return int(THREADS["mode"])
    p = processes(strategy, n, s)
    return cores() if p == 1 else max(1, cores() // p)


def train(model: str, spec: str, strategy: str, n: int, s: int, global_batch: int, epochs: int):
    args = ["train", "--model", model, "--data", spec, "--epochs", str(epochs), "-q"]
    args += ["--workers", str(n), "--batch-size", str(global_batch // n)]
    args += ["--out", f"{tempfile.gettempdir()}/plan-check-{os.getpid()}.pt"]
    if strategy == "ps":
        args += ["--strategy", "ps-sync", "--servers", str(s)]
    return compress(*args)


def _concurrent_compute(
    model: str, spec: str, batch: int, nthreads: int, gate: str, index: int, processes: int
) -> tuple[float, float]:
    """(forward+backward s at `batch`, optimizer step s) in this process, timed by the
    planner's `measure_compute` once all `processes` are ready (a file each under `gate`), so
    that they run at the same time."""
    from compresskit.distrib import plan as P

    m, ds = P.build(P.PlanRequest(model=model, data=spec))
    Path(gate, str(index)).touch()
    while len(os.listdir(gate)) < processes:
        time.sleep(0.001)
    fit = P.measure_compute(m, ds.x_train, ds.y_train, [batch], threads=nthreads, budget_s=1.5)
    return fit.points[0][1], fit.update_s


def colocation(model: str, spec: str, n: int, batch: int, nthreads: int) -> tuple[float, float]:
    """How much slower N concurrent workers of `nthreads` threads compute (forward+backward at
    `batch`, the optimizer step) than one alone here: (compute factor, update factor), each
    the mean over the N workers of their time over the lone worker's. A parameter server's
    servers are not among them: they mostly wait."""
    import functools

    from compresskit.distrib import launch

    def timed(k: int) -> list[tuple[float, float]]:
        with tempfile.TemporaryDirectory(prefix="plan-check-gate.") as gate:
            fn = functools.partial(_concurrent_compute, model, spec, batch, nthreads, gate)
            return launch.run_independent(fn, k)

    (alone_c, alone_u), *_ = timed(1)
    together = timed(n) if n > 1 else [(alone_c, alone_u)]
    return (
        statistics.fmean(c for c, _ in together) / alone_c,
        statistics.fmean(u for _, u in together) / alone_u,
    )


def measured_step_s(result: dict, n_train: int, global_batch: int) -> float:
    per_epoch = math.ceil(n_train / global_batch)  # Batches and ps-sync: global batches
    later = [h["seconds"] for h in result["history"][1:]] or [result["history"][0]["seconds"]]
    return statistics.median(later) / per_epoch


def predict(model: str, spec: str, strategy: str, n: int, s: int, batch: int, links) -> dict:
    args = ["plan", "--model", model, "--data", spec, "--batch-size", str(batch)]
    args += ["--threads", str(threads(strategy, n, s)), "--max-workers", str(max(n, 1))]
    if strategy == "ps":
        args += ["--servers", str(s)]
    if links is not None:
        args += ["--links-from", str(links)]
    return compress(*args)


def link_words(link: dict) -> str:
    return f"alpha {1e6 * link['alpha_s']:.0f} us, beta {link['beta_bytes_per_s'] / 1e9:.2f} GB/s"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="lenet300,vgg")
    ap.add_argument("--workers", default="1,2", help="N values, e.g. 1,2,4")
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=3, help="the first is warm-up")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", default="1", help="threads per process, or auto")
    ap.add_argument("--strategies", default="allreduce,ps", help="allreduce, ps or both")
    ap.add_argument(
        "--repeat-data",
        default="lenet300=16,vgg=4",
        help="MODEL=R: digits' training split repeated R times (others: 8)",
    )
    args = ap.parse_args()
    THREADS["mode"] = args.threads
    workers = [int(v) for v in args.workers.split(",")]
    repeat = {k: int(v) for k, v in (p.split("=") for p in args.repeat_data.split(",") if p)}
    import torch

    print(
        f"# plan check: {cores()} cores, torch {torch.__version__}, global batch "
        f"{args.global_batch}, threads per process: {args.threads}, {args.epochs} epochs (first dropped), medians of "
        f"{args.repeats} interleaved runs; load average before: {os.getloadavg()[0]:.2f}"
    )
    rows = []
    links = None  # the first plan's JSON: its links serve every later prediction
    with tempfile.TemporaryDirectory(prefix="plan-check.") as tmp:
        for model in args.models.split(","):
            path = Path(tmp) / f"digits-{model}.npz"
            n_train = write_data(path, repeat.get(model, 8))
            spec = f"npz:{path}"
            configs = runs(workers, args.strategies.split(","))
            predicted = {}
            for strategy, n, s in configs:
                p = predict(model, spec, strategy, n, s, args.global_batch, links)
                if links is None:
                    links = Path(tmp) / "links.json"
                    links.write_text(json.dumps(p))
                    how = p["measured"]["link"]
                    for name, key, pts in (
                        ("send/recv", "link", "points_us"),
                        ("all-reduce", "allreduce_link", "allreduce_points_us"),
                    ):
                        print(
                            f"link, {name} (gloo, 2 ranks, {1e3 * how['gap_s']:.2g} ms compute "
                            f"between exchanges): {link_words(p[key])}; points (bytes per "
                            "message: one-way us) "
                            + ", ".join(f"{k}: {v:.0f}" for k, v in how[pts].items())
                        )
                row = next(r for r in p["rows"] if r["workers"] == n)[strategy]
                predicted[(strategy, n, s)] = (row, p["workload"])
            measured: dict[tuple, list[float]] = {c: [] for c in configs}
            loads: dict[tuple, list[float]] = {c: [] for c in configs}
            for _ in range(args.repeats):
                for c in configs:
                    loads[c].append(os.getloadavg()[0])
                    t0 = time.perf_counter()
                    r = train(model, spec, *c, args.global_batch, args.epochs)
                    measured[c].append(measured_step_s(r, n_train, args.global_batch))
                    print(
                        f"  ran {model} {c[0]} N={c[1]} S={c[2]}: "
                        f"{1e3 * measured[c][-1]:.2f} ms/step ({time.perf_counter() - t0:.0f} s)",
                        file=sys.stderr,
                    )
            factors = {}
            for c in configs:
                key = (c[1], threads(*c))
                if key not in factors:
                    factors[key] = colocation(model, spec, c[1], args.global_batch // c[1], key[1])
            for c in configs:
                row, w = predicted[c]
                strategy, n, s = c
                fc, fu = factors[(n, threads(*c))]
                here = fc * row["compute_ms"] + row["comm_ms"] + fu * row["update_ms"]
                rows.append(
                    {
                        "model": model,
                        "samples": n_train,
                        "strategy": "all-reduce" if strategy == "allreduce" else "ps-sync",
                        "N": n,
                        "S": s or "-",
                        "threads": threads(*c),
                        "pred": row,
                        "factors": (fc, fu),
                        "here_ms": here,
                        "fixed_ms": 1e3 * w["fixed_s"],
                        "sample_ms": 1e3 * w["sample_s"],
                        "measured_ms": 1e3 * statistics.median(measured[c]),
                        "all_ms": [round(1e3 * v, 3) for v in measured[c]],
                        "load": statistics.median(loads[c]),
                    }
                )
    print(f"load average after: {os.getloadavg()[0]:.2f}\n")
    print(
        "| model | strategy | N | S | threads | predicted ms, one machine per worker (compute + "
        "comm + update) | co-located here: compute, update slowed | predicted here ms | "
        "measured ms | measured / predicted here | within 25% | measured / one machine each "
        "| load avg |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p = r["pred"]
        ratio = r["measured_ms"] / r["here_ms"]
        fc, fu = r["factors"]
        print(
            f"| {r['model']} | {r['strategy']} | {r['N']} | {r['S']} | {r['threads']} | "
            f"{p['step_ms']:.2f} ({p['compute_ms']:.2f} + {p['comm_ms']:.2f} + "
            f"{p['update_ms']:.2f}) | ×{fc:.2f}, ×{fu:.2f} | {r['here_ms']:.2f} | "
            f"{r['measured_ms']:.2f} {r['all_ms']} | {ratio:.2f} | "
            f"{'yes' if abs(ratio - 1) <= TOLERANCE else 'no'} | "
            f"{r['measured_ms'] / p['step_ms']:.2f} | {r['load']:.1f} |"
        )
    print("\nper-step compute fits (fixed + per sample, per thread count):")
    seen = set()
    for r in rows:
        key = (r["model"], r["threads"])
        if key not in seen:
            seen.add(key)
            print(
                f"- {r['model']}, {r['threads']} thread(s): {r['fixed_ms']:.3f} ms + "
                f"{r['sample_ms']:.4f} ms/sample ({r['samples']} training samples)"
            )


if __name__ == "__main__":
    main()
