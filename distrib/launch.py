"""Start N local worker processes on torch.distributed, or join the job torchrun started.

`run(fn, workers, ...)` calls `fn(rank, world)` in every rank with the default process group
initialised: gloo on CPU (NCCL is for GPUs), rendezvous through a `FileStore` in a private
temporary folder (no ports, so parallel runs never collide), and a process-group timeout of
`timeout_s` (torch's default is 30 minutes, which makes a dead peer look like a hang). Under
`torchrun` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) nothing is spawned: this process
joins the job torchrun started, so the same command scales from one machine to many.

A worker that raises or dies ends the whole job: the parent gets `StageError` naming the rank
(or the user's `InputError`, unchanged), and the other workers are terminated.
"""

from __future__ import annotations

import datetime
import multiprocessing.connection as mp_connection
import os
import pickle
import sys
import tempfile
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.errors import CompressError, InputError, StageError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world: int
    local_rank: int

    @classmethod
    def from_torchrun(cls) -> DistEnv | None:
        """The torchrun environment, None when not under torchrun; InputError when partial."""
        present = [v for v in TORCHRUN_VARS if v in os.environ]
        if not present:
            return None
        missing = [v for v in TORCHRUN_VARS if v not in os.environ]
        if missing:
            raise InputError(
                f"torchrun environment incomplete: {', '.join(missing)} unset "
                f"({', '.join(present)} set); launch with torchrun or unset them"
            )
        try:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            local = int(os.environ["LOCAL_RANK"])
        except ValueError:
            raise InputError(
                "torchrun environment: RANK, WORLD_SIZE, LOCAL_RANK must be whole numbers"
            ) from None
        if not 0 <= rank < world:
            raise InputError(f"torchrun environment: RANK {rank} is not in 0..{world - 1}")
        return cls(rank, world, local)


_store = None  # the key-value store this process's process group was made with


def store():
    """The job's key-value store (the FileStore of spawned ranks, or torchrun's): shared
    counters, such as the parameter server's batch dispenser, live in it."""
    if _store is None:
        raise RuntimeError("no process group was started by distrib.launch in this process")
    return _store


def is_rank_zero() -> bool:
    """Whether this process reports results: always, unless it is a non-zero torchrun rank."""
    return os.environ.get("RANK", "0") == "0"


def run(
    fn: Callable[[int, int], Any],
    workers: int,
    timeout_s: float = 300.0,
    backend: str = "gloo",
    *,
    name: Callable[[int], str] | None = None,
    expendable: Collection[int] = (),
    lost: list[int] | None = None,
) -> Any:
    """Run `fn(rank, world)` on `workers` ranks; return rank 0's result.

    `name(rank)` words a rank in messages ("server 1 (rank 3)"). A rank in `expendable` may
    die without stopping the job (asynchronous parameter-server workers); its rank is
    appended to `lost`. Any other failure stops every process and raises, naming the rank
    that failed first.
    """
    name = name or (lambda r: f"worker {r}")
    env = DistEnv.from_torchrun()
    if env is not None:  # torchrun started us: join its job
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        # torchrun --max-restarts keeps one store across restarts; without a per-attempt
        # prefix the new workers can read the dead ones' gloo addresses and time out.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"compress/attempt-{attempt}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        global _store
        _store = store
        try:
            return fn(env.rank, env.world)
        finally:
            dist.destroy_process_group()
    if workers < 1:
        raise InputError(f"--workers {workers}: give 1 or more")
    if workers == 1:
        return fn(0, 1)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="compress-dist.") as tmp:
        ctx = mp.get_context("spawn")
        errors, results = ctx.SimpleQueue(), ctx.SimpleQueue()
        context = mp.start_processes(
            _entry,
            args=(fn, workers, str(Path(tmp) / "store"), timeout_s, backend, results, errors),
            nprocs=workers,
            join=False,
            start_method="spawn",
        )
        got: dict[int, Any] = {}
        reported: dict[int, tuple[str, str]] = {}
        failed = _watch(
            context.processes,
            set(expendable),
            lost if lost is not None else [],
            (results, got),
            (errors, reported),
        )
        if failed is not None:
            _raise(failed, reported, name)
        return got.get(0)


def _watch(processes, expendable, lost, results, errors) -> tuple[int, int] | None:
    """Wait for every process; (rank, exit code) of the first failure that is not an
    expendable rank's death (then the others are stopped), or None when all ended well.
    `results` and `errors` are (queue, dict) pairs, filled as the ranks report."""

    def drain() -> None:
        # Read results as they come: a child blocks on a full pipe until someone reads it.
        # Plain pickle bytes from our own child (multiprocessing pickles the same way): tensors
        # sent as shared-memory handles would vanish with the process that owns them.
        (rq, got), (eq, reported) = results, errors
        while not rq.empty():
            rank, blob = rq.get()
            got[rank] = pickle.loads(blob)
        while not eq.empty():
            rank, kind, message = eq.get()
            reported.setdefault(rank, (kind, message))

    def blame(rank: int, code: int) -> int:
        # Of ranks that ended together, the cause comes first: one killed by a signal, then
        # one that died without a word or failed on its own; one that only saw a peer fail
        # ("peer") is a casualty.
        if code < 0:
            return 0
        return 2 if reported.get(rank, ("",))[0] == "peer" else 1

    reported = errors[1]
    alive = dict(enumerate(processes))
    failed = None
    while alive and failed is None:
        ready = set(mp_connection.wait([p.sentinel for p in alive.values()] + [results[0]._reader]))
        ended = [(r, p) for r, p in alive.items() if p.sentinel in ready]
        for _, proc in ended:
            proc.join()
        drain()  # after the joins: a rank's report is written before it exits
        for rank, proc in sorted(ended, key=lambda rp: (blame(rp[0], rp[1].exitcode), rp[0])):
            del alive[rank]
            if proc.exitcode == 0:
                continue
            # An expendable rank may die (killed, crashed, or cut off from a peer); its own
            # error (bad input, divergence, a bug) would recur, so it stops the job.
            if rank in expendable and reported.get(rank, ("peer",))[0] == "peer":
                lost.append(rank)
            elif failed is None:
                failed = (rank, proc.exitcode)
    if failed is not None:
        # Give the others a moment to exit by themselves with their own report, then stop them.
        deadline = time.monotonic() + 3.0
        for proc in alive.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in alive.values():
            if proc.is_alive():
                proc.terminate()
        for proc in alive.values():
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    drain()
    return failed


def _raise(failed: tuple[int, int], reported: dict, name: Callable[[int], str]) -> None:
    rank, code = failed
    for kind, message in reported.values():
        if kind == "input":  # every rank checks the same input; one line is enough
            raise InputError(message)
    own = reported.get(rank)
    if own is None:  # it died without a word (killed, os._exit): the others' errors follow
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        raise StageError(f"{name(rank)} {how}; the job stopped")
    if own[0] == "peer":  # it only saw a peer fail: a peer's own report says more
        for r, (kind, message) in sorted(reported.items()):
            if kind != "peer" and r != rank:
                raise StageError(f"{name(r)} failed: {message}")
    raise StageError(f"{name(rank)} failed: {own[1]}")


def run_independent(fn: Callable[[int, int], Any], processes: int) -> list[Any]:
    """Run `fn(index, processes)` in `processes` separate processes with no process group
    (independent jobs side by side: an ensemble, a sweep); return every result, in order."""
    import logging

    import torch.multiprocessing as mp

    if processes < 1:
        raise InputError(f"--ensemble {processes}: give 1 or more")
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    ctx = mp.get_context("spawn")
    errors, results = ctx.SimpleQueue(), ctx.SimpleQueue()
    try:
        mp.start_processes(
            _independent,
            args=(fn, processes, results, errors),
            nprocs=processes,
            join=True,
            start_method="spawn",
        )
    except Exception as e:
        reported = []
        while not errors.empty():
            reported.append(errors.get())
        if reported:
            index, kind, message = min(reported)
            if kind == "input":
                raise InputError(message) from None
            raise StageError(f"process {index} failed: {message}") from None
        raise StageError(f"process {getattr(e, 'error_index', '?')} failed") from None
    got = {}
    while not results.empty():
        index, blob = results.get()
        got[index] = pickle.loads(blob)
    return [got[i] for i in range(processes)]


def share_cores(processes: int) -> int:
    """Give this process its part of the machine's cores: `processes` local processes that
    each keep torch's default (every core) thrash; two LeNet-300 workers on 2 cores ran 4x
    slower so. An explicit OMP_NUM_THREADS (torchrun sets 1) wins. Returns the thread count."""
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cores = os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // processes))
    return torch.get_num_threads()


def _independent(index, fn, processes, results, errors) -> None:
    share_cores(processes)
    try:
        results.put((index, pickle.dumps(fn(index, processes))))
    except InputError as e:
        errors.put((index, "input", str(e)))
        raise SystemExit(2) from None
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        errors.put((index, "bug", f"{type(e).__name__}: {first}"))
        raise SystemExit(1) from None


def _entry(rank, fn, world, store_path, timeout_s, backend, results, errors) -> None:
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable()  # a native abort in torch or gloo prints where each thread was
    share_cores(world)

    timeout = datetime.timedelta(seconds=timeout_s)
    global _store
    _store = dist.FileStore(store_path, world)
    dist.init_process_group(backend, store=_store, rank=rank, world_size=world, timeout=timeout)
    code = 0
    try:
        result = fn(rank, world)
        if rank == 0:
            results.put((0, pickle.dumps(result)))
    except InputError as e:
        errors.put((rank, "input", str(e)))
        code = 2
    except CompressError as e:
        errors.put((rank, "stage", str(e)))
        code = 1
    except Exception as e:  # a collective failing because a peer died, or a bug
        first = (str(e).strip().splitlines() or [""])[0][:200]
        kind = "peer" if isinstance(e, RuntimeError) and dist.is_initialized() else "bug"
        errors.put((rank, kind, f"{type(e).__name__}: {first}"))
        code = 1
    finally:
        if dist.is_initialized() and code == 0:
            dist.destroy_process_group()
    # Leave without the interpreter's teardown: gloo's C++ threads (and a parameter server's
    # listeners blocked in recv) destroyed there aborted a finished worker once in about 40
    # runs ("terminate called without an active exception", SIGABRT). Everything this rank
    # owes the parent is already in the queues, which SimpleQueue writes synchronously.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
