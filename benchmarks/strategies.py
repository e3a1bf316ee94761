"""All-reduce against the parameter-server strategies, with and without a straggler.

    python benchmarks/strategies.py                  # about 4 minutes on 2 cores
    python benchmarks/strategies.py --model lenet300 --epochs 10 --repeats 3
    python benchmarks/strategies.py --transport-only --baseline /tmp/paramserver_orig.py
    python benchmarks/strategies.py --model lenet300 --runs ps-sync,ps-ssp:4 \
        --baseline /tmp/paramserver_orig.py             # before/after, interleaved

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
   B measured here as gloo point-to-point bandwidth at the shard's size (target <= 3x), and
   ps-ssp tau=4's throughput with the straggler as a fraction of its ceiling: with N workers
   one of them f times slower, synchronous training runs at the straggler's pace and
   asynchronous at everyone's, ((N-1)*f + 1)/N times faster (1.5x at N = 2, f = 2; target
   >= 0.93 of it);
4b. ps-sync's transport alone: 2 workers and 1 server step with no compute between
   steps, M each way, against the same bound; what part 4's training figure spends beyond it
   is not the wire: waiting for the other worker's compute, and gathering the model's tensors;
5. the transport alone: one worker and one server (`PSWorker.step` against `serve`, 200 kB
   each way, lr 0), the round trip against the bytes' time, 2 x a one-way plain gloo
   send/recv of the same size measured in the same run (target <= 1.5x).

`--baseline PATH` runs another copy of distrib/paramserver.py (e.g. the one before a change)
beside this one, interleaved run by run, and prints its figures too ("before").
`--runs` keeps some configurations (`ps-sync,ps-ssp:4`; all-reduce is kept for the ratios
when listed); `--transport-only` runs part 5 alone.

All-reduce has no --straggler (it is a parameter-server option); ps-sync with the straggler
stands for synchronous training with one.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from compresskit.distrib.plan import bounce_p2p

WORKERS, SERVERS = 2, 1
STRAGGLER = 2.0  # worker 1 slowed this much in the straggler rows
RUNS = [("allreduce", None)] + [
    (s, tau)
    for s, tau in [("ps-sync", None), ("ps-async", None)] + [("ps-ssp", t) for t in (0, 1, 4, 16)]
]


# Loads `distrib.paramserver` from $PS_BASELINE in every process of a run (the CLI's and the
# ranks it spawns): put on PYTHONPATH, as sitecustomize, for the "before" runs only.
SITECUSTOMIZE = """
import importlib.abc, importlib.util, os, sys

class _Baseline(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "distrib.paramserver":
            return importlib.util.spec_from_file_location(name, os.environ["PS_BASELINE"])
        return None

sys.meta_path.insert(0, _Baseline())
"""


def train(
    model: str,
    epochs: int,
    strategy: str,
    tau: int | None,
    straggler: bool,
    baseline: str | None = None,
) -> dict:
    cmd = [sys.executable, "-m", "compresskit.cli", "train", "--model", model, "--data", "digits"]
    cmd += ["--epochs", str(epochs), "--workers", str(WORKERS), "--strategy", strategy]
    if strategy.startswith("ps-"):
        cmd += ["--servers", str(SERVERS)]
    if tau is not None:
        cmd += ["--staleness", str(tau)]
    if straggler:
        cmd += ["--straggler", f"1:{STRAGGLER:g}"]
    cmd += ["--out", f"/tmp/strategies-bench-{os.getpid()}.pt", "--json", "-q"]
    env = dict(os.environ)
    if baseline is not None:
        env["PS_BASELINE"] = baseline
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_site(), env.get("PYTHONPATH")]))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
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
        bounce_p2p(dist, x, rank)
    return (time.perf_counter() - t0) / repeats / 2


@functools.cache
def _site() -> str:
    folder = Path(tempfile.mkdtemp(prefix="strategies-baseline."))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return str(folder)


def _ps_module(path: str | None):
    if path is None:
        from compresskit.distrib import paramserver

        return paramserver
    spec = importlib.util.spec_from_file_location("paramserver_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _serve_at_lr0(psm, ps, rank: int, model: nn.Module) -> None:
    """Serve `model` as server `rank` with SGD at lr 0 (the weights never change) until bye."""

    def sgd(params):
        return torch.optim.SGD(params, lr=0.0)

    psm.serve(ps, rank, model, sgd, "none", psm.Deal.plan(ps, 10**6, 32, 1, (0, 0)))


def _timed_steps(worker, model: nn.Module, count: int, warmup: int = 3) -> list[float]:
    """Seconds of each `worker.step` (push and pull) after `warmup` untimed ones."""
    trips = []
    for i in range(count + warmup):
        worker._start_batch()
        t0 = time.perf_counter()
        worker.step(model, 0.0, 0, i, 32)
        if i >= warmup:
            trips.append(time.perf_counter() - t0)
    return trips


def _roundtrip(path: str | None, nbytes: int, repeats: int, rank: int, world: int) -> dict:
    """Rank 0, in 5 alternating blocks: a plain gloo ping-pong of `nbytes`, then `PSWorker.step`
    round trips against rank 1's `serve` (ps-sync, N = S = 1, SGD at lr 0), `nbytes` each way;
    the medians over all blocks."""
    import torch.distributed as dist

    psm = _ps_module(path)
    torch.manual_seed(0)
    model = nn.Linear(nbytes // 4 // 100, 100, bias=False)
    model.weight.grad = torch.zeros_like(model.weight)
    ps = psm.PSConfig("sync", 1, 1)
    x, pings, trips = torch.ones(nbytes // 4), [], []
    per_block = max(1, repeats // 5)
    for _ in range(5):
        for i in range(per_block + 3):
            t0 = time.perf_counter()
            bounce_p2p(dist, x, rank)
            if i >= 3:
                pings.append(time.perf_counter() - t0)
        if rank == 1:
            _serve_at_lr0(psm, ps, rank, model)
            continue
        worker = psm.PSWorker(ps, 0, model, 10**6, 32, 1, "sgd", "none")
        trips += _timed_steps(worker, model, per_block)
        worker.finish()
        worker.close()
    if rank == 1:
        return {}
    one_way = statistics.median(pings) / 2
    return {"one_way": one_way, "roundtrip": statistics.median(trips), "nbytes": nbytes}


def _sync_trips(nbytes: int, repeats: int, rank: int, world: int) -> dict:
    """ps-sync's transport with nothing else: ranks 0 and 1 are workers that push `nbytes` of
    gradient and pull as many bytes of weights each step with no compute between steps, rank 2
    the one server (SGD at lr 0). Each worker's median step() time; rank 0 returns both."""
    import torch.distributed as dist

    from compresskit.distrib import paramserver as psm

    torch.manual_seed(0)
    model = nn.Linear(nbytes // 4 // 100, 100, bias=False)
    model.weight.grad = torch.zeros_like(model.weight)
    ps = psm.PSConfig("sync", 2, 1)
    if rank == 2:
        _serve_at_lr0(psm, ps, rank, model)
        return {}
    worker = psm.PSWorker(ps, rank, model, 10**6, 32, 1, "sgd", "none")
    trips = _timed_steps(worker, model, repeats)
    mine = torch.tensor([statistics.median(trips)], dtype=torch.float64)
    both = [torch.zeros(1, dtype=torch.float64) for _ in range(2)]
    group = dist.new_group([0, 1], use_local_synchronization=True)  # the server is serving
    dist.all_gather(both, mine, group=group)
    worker.finish()
    worker.close()
    return {"trips": [float(t) for t in both]} if rank == 0 else {}


def sync_transport(nbytes: int, one_way: float, training_s: float | None, runs: int) -> None:
    """Part 4b: ps-sync's push and pull with no compute (2 workers, 1 server), against the bound
    and against the training runs' figure: what is left is waiting for the other worker."""
    from compresskit.distrib import launch

    section(
        f"4b. ps-sync transport alone: {WORKERS} workers, {SERVERS} server, "
        f"{nbytes / 1e3:.0f} kB each way, no compute (medians of 200 steps per run, {runs} runs)"
    )
    got = [
        launch.run(functools.partial(_sync_trips, nbytes, 200), WORKERS + SERVERS, timeout_s=120)
        for _ in range(runs)
    ]
    step = statistics.median(statistics.mean(r["trips"]) for r in got)
    bound = max(nbytes / (nbytes / one_way), WORKERS * one_way / SERVERS)
    print(
        f"push and pull per step, mean of the 2 workers: {1e3 * step:.3f} ms = "
        f"{step / bound:.1f}x the bound {1e3 * bound:.3f} ms (one-way {1e3 * one_way:.3f} ms "
        f"at this size; target <= 3x)"
    )
    if training_s is not None:
        print(
            f"in training (part 4): {1e3 * training_s:.3f} ms per step, of which "
            f"{1e3 * max(training_s - step, 0.0):.3f} ms ({max(training_s - step, 0.0) / training_s:.0%}) "
            "is beyond the transport alone (same bytes, messages and server; what the harness "
            "lacks is compute: the other worker's, which a synchronous step waits for, and the "
            "model's many tensors gathered into the push)"
        )


def transport(baseline: str | None, runs: int, repeats: int = 200, nbytes: int = 200_000) -> None:
    from compresskit.distrib import launch

    print(
        f"\n## 5. transport: one worker, one server, {nbytes / 1e3:.0f} kB each way "
        f"(medians of {repeats} round trips per run, {runs} runs"
        + (", interleaved with the baseline" if baseline else "")
        + ")\n"
    )
    versions = {"after": None, **({"before": baseline} if baseline else {})}
    got: dict[str, list[dict]] = {v: [] for v in versions}
    for _ in range(runs):
        for version, path in versions.items():
            fn = functools.partial(_roundtrip, path, nbytes, repeats)
            got[version].append(launch.run(fn, 2, timeout_s=120))
    print("| version | one-way send/recv | B | bytes' round trip | PS round trip | ratio |")
    print("|---|---|---|---|---|---|")
    for version in reversed(versions):
        rows = got[version]
        one = statistics.median(r["one_way"] for r in rows)
        trip = statistics.median(r["roundtrip"] for r in rows)
        ratio = statistics.median(r["roundtrip"] / (2 * r["one_way"]) for r in rows)
        print(
            f"| {version} | {1e3 * one:.3f} ms | {nbytes / one / 1e9:.2f} GB/s | "
            f"{2e3 * one:.3f} ms | {1e3 * trip:.3f} ms | {ratio:.2f}x (target <= 1.5x) |"
        )


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


def _keep(runs: str | None) -> list[tuple[str, int | None]]:
    if not runs:
        return RUNS
    want = set()
    for item in runs.split(","):
        strategy, _, tau = item.partition(":")
        want.add((strategy, int(tau) if tau else None))
    return [r for r in RUNS if r in want]


def section(title: str) -> None:
    print(f"\n## {title}\n")


def report(table: dict, args, version: str) -> None:
    """Parts 1-4 for one version of the module (`table` keyed (strategy, tau, straggler))."""
    from compresskit.distrib import launch

    tag = f" [{version}]" if args.baseline else ""
    section(f"1. strategies (target accuracy {args.target:.0%}){tag}")
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

    section(f"2. targets{tag}")
    ar, sync = table.get(("allreduce", None, False)), table.get(("ps-sync", None, False))
    if ar and sync:
        step_ratio = ar["steps_per_s"] / sync["steps_per_s"]
        print(
            f"- ps-sync step time / all-reduce step time (S = N/2, no straggler): "
            f"{step_ratio:.2f}x (target <= 1.2x)"
        )
    slow_sync, slow_ssp = table.get(("ps-sync", None, True)), table.get(("ps-ssp", 4, True))
    if slow_sync and slow_ssp:
        gain = slow_ssp["samples_per_s"] / slow_sync["samples_per_s"]
        change = 100 * (slow_ssp["accuracy"] - slow_sync["accuracy"])
        ceiling = ((WORKERS - 1) * STRAGGLER + 1) / WORKERS
        print(
            f"- ps-ssp tau=4 / ps-sync throughput with a {STRAGGLER:g}x straggler: {gain:.2f}x "
            f"= {gain / ceiling:.3f} of the ceiling {ceiling:.2f}x (target >= 0.93); final "
            f"accuracy {change:+.2f} points against ps-sync (target >= -0.5)"
        )
    slow_async = table.get(("ps-async", None, True))
    if slow_sync and slow_async:
        print(
            f"- ps-async / ps-sync throughput with the straggler: "
            f"{slow_async['samples_per_s'] / slow_sync['samples_per_s']:.2f}x"
        )

    if all(("ps-ssp", tau, True) in table for tau in (0, 1, 4, 16)) and slow_async:
        section(f"3. idle time against tau (with the straggler){tag}")
        print("| tau | mean idle | samples/s |\n|---|---|---|")
        for tau in (0, 1, 4, 16):
            r = table[("ps-ssp", tau, True)]
            print(f"| {tau} | {r['idle']:.1%} | {r['samples_per_s']:.0f} |")
        print(f"| inf (ps-async) | {slow_async['idle']:.1%} | {slow_async['samples_per_s']:.0f} |")

    if sync:
        section(f"4. ps-sync communication per step against the bound{tag}")
        m = sync["bytes_per_step"] / 2  # the gradient out (the weights back are as many bytes)
        shard = int(m / SERVERS)
        one_way = launch.run(functools.partial(_p2p, shard, 50), 2, timeout_s=120)
        bandwidth = shard / one_way
        bound = max(m / bandwidth, WORKERS * m / (SERVERS * bandwidth))
        print(
            f"M = {m / 1e3:.0f} kB of fp32 gradient per worker step; point-to-point bandwidth B "
            f"at {shard / 1e3:.0f} kB = {bandwidth / 1e9:.2f} GB/s\n"
            f"bound max(M/B, N*M/(S*B)) = {1e3 * bound:.3f} ms per direction; measured time in "
            f"push and pull per step (rank 0, no straggler) = "
            f"{1e3 * sync['idle_per_step_s']:.3f} ms "
            f"({sync['idle_per_step_s'] / bound:.1f}x the bound; target <= 3x)"
        )
        if version == "after":
            sync_transport(shard, one_way, sync["idle_per_step_s"], runs=3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mobilenet")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--target", type=float, default=0.95, help="test accuracy to reach")
    ap.add_argument("--runs", help="configurations to keep, e.g. ps-sync,ps-ssp:4")
    ap.add_argument("--baseline", help="another paramserver.py to run beside this one")
    ap.add_argument("--transport-only", action="store_true", help="part 5 alone")
    ap.add_argument("--transport-runs", type=int, default=5)
    args = ap.parse_args()
    print(
        f"# strategies benchmark: {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{args.model} on digits, {args.epochs} epochs, N={WORKERS} workers, S={SERVERS} "
        f"server, batch 32 per worker, medians of {args.repeats} interleaved runs"
    )
    if not args.transport_only:
        versions = {"after": None, **({"before": args.baseline} if args.baseline else {})}
        results: dict[str, dict[tuple, list[dict]]] = {v: {} for v in versions}
        for _ in range(args.repeats):
            for straggler in (False, True):
                for strategy, tau in _keep(args.runs):
                    if strategy == "allreduce" and straggler:
                        continue
                    for version, path in versions.items():
                        if strategy == "allreduce" and version != "after":
                            continue  # the same code either way
                        key = (strategy, tau, straggler)
                        results[version].setdefault(key, []).append(
                            train(args.model, args.epochs, strategy, tau, straggler, path)
                        )
        shared = results["after"].get(("allreduce", None, False))
        for version in reversed(versions):
            if shared and version != "after":
                results[version] = {("allreduce", None, False): shared, **results[version]}
            table = {k: summarise(v, args.target) for k, v in results[version].items()}
            report(table, args, version)
    transport(args.baseline, args.transport_runs)


if __name__ == "__main__":
    main()
