"""Start N local worker processes on torch.distributed, or join the job torchrun started.

`run(fn, workers, ...)` calls `fn(rank, world)` in every rank with the default process group
initialised: gloo on CPU (NCCL is for GPUs), rendezvous through a `FileStore` in a private
temporary folder (no ports, so parallel runs never collide), and a process-group timeout of
`timeout_s` (torch's default is 30 minutes, which makes a dead peer look like a hang). Under
`torchrun` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) nothing is spawned: this process
joins the job torchrun started, so the same command scales from one machine to many.

A worker that raises or dies ends the whole job: the parent gets `StageError` naming the rank
(or the user's `InputError`, unchanged), and the other workers are terminated.

A rank that stops answering (stopped by SIGSTOP, hung) is named too, not the healthy peer whose
collective timed out waiting for it. Every rank runs a heartbeat thread that beats every
`HEARTBEAT_S` (a file in the launcher's folder, or a key in torchrun's store); a stopped
process stops all its threads, so its heartbeat goes stale. The parent ends the job once an
alive rank has been silent for `timeout_s`, or as soon as another rank fails while one is
silent or stopped, killing the silent one with SIGKILL (SIGTERM waits for SIGCONT). Under
torchrun there is no parent of ours: a rank whose collective fails reads its peers'
heartbeats from the store and names the silent one.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import math
import multiprocessing.connection as mp_connection
import os
import pickle
import re
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compresskit._threads import short_spin_children, usable_cores
from compresskit.models.errors import CompressError, InputError, StageError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
HEARTBEAT_S = 0.5  # every rank says it is alive this often
SILENT_S = 2.0  # a heartbeat this old: the rank is not running (4 beats missed)


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
        if world < 1:
            raise InputError(f"torchrun environment: WORLD_SIZE {world}; give 1 or more")
        if not 0 <= rank < world:
            raise InputError(f"torchrun environment: RANK {rank} is not in 0..{world - 1}")
        port = os.environ["MASTER_PORT"]
        if not (port.isdigit() and 0 < int(port) < 65536):
            raise InputError(f"torchrun environment: MASTER_PORT {port!r} is no port (1..65535)")
        return cls(rank, world, local)


_store = None  # the key-value store this process's process group was made with
_beats: _Beats | None = None  # where this job's ranks beat (None: not in a launched job)
_name: Callable[[int], str] | None = None  # how this job words a rank
_rank = 0  # this process's rank in the job


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
    name = name or _worker
    env = DistEnv.from_torchrun()
    if env is not None:  # torchrun started us: join its job
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        store, rank, world = _rendezvous(env, timeout_s)
        # torchrun --max-restarts keeps one store across restarts; without a per-attempt
        # prefix the new workers can read the dead ones' gloo addresses and time out.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"compress/attempt-{attempt}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        global _store
        _store = store
        stop = _join_job(_StoreBeats(store, world), rank, name)
        try:
            return fn(env.rank, env.world)
        except CompressError:
            _kill_stopped_peer()
            raise
        except RuntimeError as e:  # a collective failed: name the peer that stopped answering
            error = _torchrun_peer_error(e) if dist.is_initialized() else None
            if error is None:
                raise
            _kill_stopped_peer()
            raise error from None
        finally:
            stop.set()
            dist.destroy_process_group()
    if workers < 1:
        raise InputError(f"--workers {workers}: give 1 or more")
    if workers == 1:
        return fn(0, 1)
    check_processes(workers)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="compress-dist.") as tmp:
        beats = Path(tmp) / "beats"
        beats.mkdir()
        ctx = mp.get_context("spawn")
        errors, results = ctx.SimpleQueue(), ctx.SimpleQueue()
        store_path = str(Path(tmp) / "store")
        with short_spin_children():  # their OpenMP threads spin briefly, then sleep
            context = mp.start_processes(
                _entry,
                args=(
                    fn,
                    workers,
                    store_path,
                    timeout_s,
                    backend,
                    results,
                    errors,
                    str(beats),
                    name,
                ),
                nprocs=workers,
                join=False,
                start_method="spawn",
            )
        got: dict[int, Any] = {}
        reported: dict[int, tuple[str, str]] = {}
        try:
            failed = _watch(
                context.processes,
                set(expendable),
                lost if lost is not None else [],
                (results, got),
                (errors, reported),
                _FileBeats(beats),
                max(timeout_s, SILENT_S),
            )
        except BaseException:  # Ctrl-C in the parent: no rank may outlive it
            _kill_all(context.processes)
            raise
        if failed is not None:
            _raise(failed, reported, name)
        return got.get(0)


@dataclass(frozen=True)
class _Failure:
    rank: int
    code: int | None  # exit code; None: still running when it was found silent
    silence: Silence | None = None  # the rank stopped answering


def _watch(
    processes, expendable, lost, results, errors, beats=None, silent_after=math.inf
) -> _Failure | None:
    """Wait for every process; the first failure that is not an expendable rank's death (then
    the others are stopped), or None when all ended well. `results` and `errors` are (queue,
    dict) pairs, filled as the ranks report. A rank whose heartbeat in `beats` is
    `silent_after` seconds old has failed too; so has a silent or stopped rank when another
    fails (it is the cause: the other's collective timed out waiting for it)."""

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

    def silent(threshold: float) -> Silence | None:
        """The alive rank silent longest, if `threshold` s or more, or stopped by a signal."""
        if beats is None:
            return None
        seen = beats.seen()
        found = []
        for rank, proc in alive.items():
            beat = seen.get(rank)
            age = beat.age if beat is not None else None
            state = _state(proc.pid)
            stopped = state in ("T", "t")
            if state in ("Z", "X", "gone"):  # it died just now: its sentinel will say so
                continue
            if stopped or (age is not None and age >= threshold):
                found.append(Silence(rank, age, proc.pid, None, stopped))
        return max(found, key=lambda s: (s.age or 0.0, s.stopped), default=None)

    reported = errors[1]
    alive = dict(enumerate(processes))
    failed: _Failure | None = None
    while alive and failed is None:
        waitables = [p.sentinel for p in alive.values()] + [results[0]._reader]
        ready = set(mp_connection.wait(waitables, timeout=HEARTBEAT_S))
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
                failed = _Failure(rank, proc.exitcode)
        own = reported.get(failed.rank, ("died",))[0] if failed is not None else None
        if own in ("peer", "stage", "bug"):
            # A rank that reported a failure while another was silent most likely timed out
            # waiting for it: the silent one is the cause. (One that died without a word, or
            # was killed, is a cause itself; bad input is the user's.) A rank merely stopped
            # counts too: a --timeout under SILENT_S ends before its heartbeat looks stale.
            hung = silent(SILENT_S)
            if hung is not None:
                failed = _Failure(hung.rank, None, hung)
        elif failed is None:
            hung = silent(silent_after)
            if hung is not None and hung.age is not None and hung.age >= silent_after:
                failed = _Failure(hung.rank, None, hung)
    if failed is not None:
        grace = 3.0  # for the others to exit by themselves with their own report
        if failed.silence is not None:  # the cause is known: no report will say more
            alive[failed.rank].kill()  # SIGKILL: a stopped process holds SIGTERM until SIGCONT
            grace = 0.0
        deadline = time.monotonic() + grace
        for proc in alive.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in alive.values():
            if proc.is_alive():
                if _stopped(proc.pid):
                    proc.kill()
                else:
                    proc.terminate()
        for proc in alive.values():
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    drain()
    return failed


def _raise(failed: _Failure, reported: dict, name: Callable[[int], str]) -> None:
    rank, code = failed.rank, failed.code
    for kind, message in reported.values():
        if kind == "input":  # every rank checks the same input; one line is enough
            raise InputError(message)
    if failed.silence is not None:
        raise StageError(f"{describe(failed.silence, name)}; the job stopped")
    own = reported.get(rank)
    if own is None:  # it died without a word (killed, os._exit): the others' errors follow
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        raise StageError(f"{name(rank)} {how}; the job stopped")
    if own[0] == "peer":  # it only saw a peer fail: a peer's own report says more
        for r, (kind, message) in sorted(reported.items()):
            if kind != "peer" and r != rank:
                raise StageError(f"{name(r)} failed: {message}")
    raise StageError(f"{name(rank)} failed: {own[1]}")


# ---- heartbeats: naming the rank that stopped answering ---------------------------------------


def _worker(rank: int) -> str:
    return f"worker {rank}"


@dataclass(frozen=True)
class Beat:
    age: float  # seconds since the rank last beat
    pid: int | None
    host: str | None  # None: this machine


@dataclass(frozen=True)
class Silence:
    """A rank that stopped answering: silent for `age` s (None: it never beat), or `stopped`
    by a signal (seen in /proc on this machine)."""

    rank: int
    age: float | None
    pid: int | None
    host: str | None
    stopped: bool


class _Beats:
    """Where a job's ranks beat."""

    def beat(self, rank: int) -> None:
        raise NotImplementedError

    def seen(self) -> dict[int, Beat]:
        raise NotImplementedError


class _FileBeats(_Beats):
    """A file per rank in the launcher's folder (its mtime is the last beat): the parent
    reads them without joining the job's store, and a stopped rank can hold no lock on them."""

    def __init__(self, folder: Path):
        self.folder = folder

    def beat(self, rank: int) -> None:
        path = self.folder / str(rank)
        try:
            os.utime(path)
        except FileNotFoundError:
            tmp = self.folder / f".{rank}"
            tmp.write_text(str(os.getpid()), encoding="ascii")
            tmp.replace(path)

    def seen(self) -> dict[int, Beat]:
        now, out = time.time(), {}
        try:
            paths = [p for p in self.folder.iterdir() if p.name.isdigit()]
        except OSError:
            return out
        for path in paths:
            try:
                age = now - path.stat().st_mtime
                pid = int(path.read_text(encoding="ascii") or 0) or None
            except (OSError, ValueError):
                continue
            out[int(path.name)] = Beat(max(0.0, age), pid, None)
        return out


class _StoreBeats(_Beats):
    """A key per rank in torchrun's store: the time (this rank's clock: ranks on different
    machines assume clocks that agree within a second), the pid and the host."""

    def __init__(self, store, world: int):
        self.store, self.world = store, world

    @staticmethod
    def key(rank: int) -> str:
        return f"heartbeat/{rank}"

    def beat(self, rank: int) -> None:
        self.store.set(self.key(rank), f"{time.time():.3f} {os.getpid()} {socket.gethostname()}")

    def seen(self) -> dict[int, Beat]:
        now, out = time.time(), {}
        for rank in range(self.world):
            try:
                if not self.store.check([self.key(rank)]):
                    continue
                stamp, pid, host = self.store.get(self.key(rank)).decode().split(" ", 2)
                here = host == socket.gethostname()
                out[rank] = Beat(max(0.0, now - float(stamp)), int(pid), None if here else host)
            except Exception:  # the store is gone or the value torn: no news of that rank
                continue
        return out


def _join_job(beats: _Beats, rank: int, name: Callable[[int], str]) -> threading.Event:
    """Remember this process's place in the job and start its heartbeat (a daemon thread;
    set the returned event to stop it)."""
    global _beats, _name, _rank
    _beats, _name, _rank = beats, name, rank
    stop = threading.Event()
    if isinstance(beats, _StoreBeats):
        with contextlib.suppress(Exception):  # a connection of its own, if the store gives one
            beats = _StoreBeats(beats.store.clone(), beats.world)

    def loop() -> None:
        while not stop.is_set():
            # A failed beat: the job is ending and its store with it; nothing to say.
            with contextlib.suppress(Exception):
                beats.beat(rank)
            stop.wait(HEARTBEAT_S)

    with contextlib.suppress(Exception):
        beats.beat(rank)
    threading.Thread(target=loop, name="compress-heartbeat", daemon=True).start()
    return stop


def _state(pid: int | None) -> str:
    """Process `pid`'s state on this machine, from /proc (Linux): "R", "S", "T" (stopped by a
    signal), "t" (by a tracer), "Z" (ended, not yet reaped)...; "gone" once it has ended and
    been reaped; "" when unknown (no /proc)."""
    if pid is None:
        return ""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone" if os.path.isdir("/proc/self") else ""
    except (OSError, IndexError):
        return ""


def _stopped(pid: int | None) -> bool:
    return _state(pid) in ("T", "t")


def _kill_stopped_peer() -> None:
    """Under torchrun, as this rank fails: SIGKILL a peer on this machine that is stopped by a
    signal. torchrun ends the other ranks with SIGTERM, which a stopped process holds until
    SIGCONT, and waits 30 s before its SIGKILL; the job is over for that rank either way.
    Not at once: torchrun would stop this rank too before it has said why it failed; when
    this process exits, or a second from now, whichever comes first."""
    silence = silent_peer()
    if silence is None or not silence.stopped or not silence.pid:
        return
    pid, done = silence.pid, threading.Event()

    def kill() -> None:
        if not done.is_set():
            done.set()
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    atexit.register(kill)
    timer = threading.Timer(1.0, kill)
    timer.daemon = True
    timer.start()


def silent_peer(rank: int | None = None) -> Silence | None:
    """The peer of this rank that stopped answering (its heartbeat is `SILENT_S` old or it is
    stopped), the one silent longest; or only `rank`'s silence when given. None when every
    peer beats, or outside a launched job."""
    if _beats is None:
        return None
    found = []
    for r, beat in _beats.seen().items():
        if r == _rank or (rank is not None and r != rank):
            continue
        state = _state(beat.pid) if beat.host is None else ""
        if state in ("Z", "X", "gone"):  # it died: it is lost, not silent
            continue
        stopped = state in ("T", "t")
        if stopped or beat.age >= SILENT_S:
            found.append(Silence(r, beat.age, beat.pid, beat.host, stopped))
    return max(found, key=lambda s: (s.age or 0.0, s.stopped), default=None)


def describe(silence: Silence, name: Callable[[int], str] | None = None) -> str:
    """One line: "worker 1 (pid 123) stopped answering: no heartbeat for 21 s (...)"."""
    where = ", ".join(
        x
        for x in (silence.pid and f"pid {silence.pid}", silence.host and f"on {silence.host}")
        if x
    )
    words = _with((name or _name or _worker)(silence.rank), where)
    if silence.age is None:
        how = "it never sent a heartbeat"
    else:
        how = f"no heartbeat for {silence.age:.0f} s"
    why = "it is stopped, by SIGSTOP or a debugger" if silence.stopped else "hung or stopped?"
    return f"{words} stopped answering: {how} ({why})"


def _with(words: str, where: str) -> str:
    """`words` naming a rank, with `where` inside its parentheses: "worker 1 (pid 9)",
    "server 0 (rank 2, pid 9)"."""
    if not where:
        return words
    return f"{words[:-1]}, {where})" if words.endswith(")") else f"{words} ({where})"


def gloo_line(e: BaseException) -> str:
    """The gist of a torch.distributed error in one short line: the first line, without the
    callback wrapping and the C++ source location gloo puts in front."""
    line = (str(e).strip().splitlines() or [""])[0]
    line = line.rsplit("when running the callback: ", 1)[-1]
    line = re.sub(r"\[[^\]]*:\d+\]\s*", "", line)
    line = re.sub(r"^(RuntimeError|DistBackendError|DistError): ", "", line)
    return line[:160]


def silent_peer_error() -> StageError | None:
    """For a rank whose collective or message failed: the error that names the peer that
    stopped answering, or None when every peer beats (then the failure is its own)."""
    silence = silent_peer()
    if silence is None:
        return None
    return StageError(f"{describe(silence)}; {(_name or _worker)(_rank)} gave up waiting for it")


def _torchrun_peer_error(e: BaseException) -> StageError | None:
    """Under torchrun, for a rank whose collective failed: the peer to blame. No launcher of
    ours watches the ranks there, so a peer that died (killed, crashed) was never named: its
    heartbeat is not stale yet when the connection drops. A peer on this machine whose process
    is gone is named at once; another peer once its heartbeat goes stale (a few seconds); a
    dropped connection alone still says a peer ended, not that compress failed."""
    dropped = re.search(r"Connection (reset|closed) by peer|Broken pipe|EOF", str(e)) is not None
    deadline = time.monotonic() + (SILENT_S + 2 * HEARTBEAT_S if dropped else 0.0)
    while True:
        error = _dead_peer_error() or silent_peer_error()
        if error is not None or time.monotonic() >= deadline:
            break
        time.sleep(HEARTBEAT_S / 2)
    if error is None and dropped:
        error = StageError(
            f"a peer of {(_name or _worker)(_rank)} ended ({gloo_line(e)}); torchrun's summary "
            "names its rank and exit code"
        )
    return error


def _dead_peer_error() -> StageError | None:
    """A peer on this machine whose process has ended, as the error of this rank."""
    if _beats is None:
        return None
    here = socket.gethostname()
    for r, beat in sorted(_beats.seen().items()):
        if r == _rank or beat.pid is None or beat.host not in (None, here):
            continue
        if _state(beat.pid) in ("Z", "X", "gone"):
            who = _with((_name or _worker)(r), f"pid {beat.pid}")
            return StageError(f"{who} ended; {(_name or _worker)(_rank)} gave up waiting for it")
    return None


RENDEZVOUS_GRACE_S = 5.0  # past --timeout, for torch's own rendezvous timeout to speak first


def _rendezvous(env: DistEnv, timeout_s: float) -> tuple[Any, int, int]:
    """torch's env:// rendezvous, bounded by `timeout_s` whatever is on MASTER_PORT: a rank
    whose port another program held (no store behind it) waited in the handshake for as long
    as that program lived, deaf to SIGTERM. The call runs in a thread (it releases the GIL)
    that is left behind if it does not return."""
    import torch.distributed as dist

    box: dict[str, Any] = {}

    def rendezvous() -> None:
        try:
            timeout = datetime.timedelta(seconds=timeout_s)
            box["got"] = next(dist.rendezvous("env://", timeout=timeout))
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    who = f"rank {env.rank} of {env.world}"
    absent = StageError(
        f"{who}: no rendezvous at {where} within {timeout_s:g} s (--timeout); start every rank "
        "with the same MASTER_ADDR and MASTER_PORT, rank 0 among them"
    )
    thread = threading.Thread(target=rendezvous, name="compress-rendezvous", daemon=True)
    thread.start()
    thread.join(timeout_s + RENDEZVOUS_GRACE_S)
    if thread.is_alive():
        if not _listening(os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]):
            raise absent
        raise StageError(
            f"{who}: no rendezvous at {where} within {timeout_s:g} s (--timeout): something "
            "there takes connections but never answers as rank 0's store (another program on "
            "MASTER_PORT?); give every rank a free MASTER_PORT"
        )
    error = box.get("error")
    joined = re.search(r"(\d+)/(\d+) clients joined", str(error)) if error is not None else None
    if isinstance(error, dist.DistError) and joined:  # rank 0, its store up, the others absent
        raise StageError(
            f"{who}: {joined[1]} of {joined[2]} ranks joined at {where} within {timeout_s:g} s "
            "(--timeout); start every rank with the same MASTER_ADDR and MASTER_PORT"
        ) from None
    if isinstance(error, dist.DistNetworkError):
        if "EADDRINUSE" in str(error) or "address already in use" in str(error):
            raise InputError(
                f"{who}: MASTER_PORT {os.environ['MASTER_PORT']} is already in use on this "
                "machine (another program or job holds it); give every rank another "
                "MASTER_PORT (torchrun --master-port)"
            ) from None
        raise absent from None
    if error is not None:
        raise error
    return box["got"]


def _kill_all(processes) -> None:
    """Kill every process still alive, then reap them (5 s each at most)."""
    for proc in processes:
        if proc.is_alive():
            proc.kill()
    for proc in processes:
        proc.join(5)


def _listening(host: str, port: str) -> bool:
    """Whether something accepts connections at host:port (a quick connect, 1 s at most)."""
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except (OSError, ValueError):
        return False


def run_independent(fn: Callable[[int, int], Any], processes: int) -> list[Any]:
    """Run `fn(index, processes)` in `processes` separate processes with no process group
    (independent jobs side by side: an ensemble, a sweep); return every result, in order."""
    import logging

    import torch.multiprocessing as mp

    if processes < 1:
        raise InputError(f"--ensemble {processes}: give 1 or more")
    check_processes(processes)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    ctx = mp.get_context("spawn")
    errors, results = ctx.SimpleQueue(), ctx.SimpleQueue()
    got: dict[int, Any] = {}

    def drain() -> None:
        # Read results as they come: a member whose result outgrows the pipe's buffer (64 KiB;
        # a TrainResult keeps one flag per test sample) blocks in `put` until someone reads it,
        # and would never exit for a join that waited on it first.
        while not results.empty():
            index, blob = results.get()
            got[index] = pickle.loads(blob)

    with short_spin_children():
        context = mp.start_processes(
            _independent,
            args=(fn, processes, results, errors),
            nprocs=processes,
            join=False,
            start_method="spawn",
        )
    try:
        while True:
            # The members not yet joined (an ended one's sentinel stays ready), or a result.
            mp_connection.wait([*context.sentinels, results._reader], timeout=HEARTBEAT_S)
            drain()
            if context.join(timeout=0):
                break
    except KeyboardInterrupt:  # Ctrl-C in the parent: no member may outlive it
        _kill_all(context.processes)
        raise
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
    drain()
    return [got[i] for i in range(processes)]


# Local processes allowed per usable core (and at least MIN_PROCESSES): beyond that each gets
# a sliver of a core and its own copy of the model and data.
PROCESSES_PER_CORE = 4
MIN_PROCESSES = 8


def check_processes(processes: int) -> None:
    """Refuse to start more local processes than this machine can run: `--workers 100000`
    spawned until the load average reached 56 and the job never answered."""
    cores = usable_cores()
    limit = max(MIN_PROCESSES, PROCESSES_PER_CORE * cores)
    if processes > limit:
        raise InputError(
            f"{processes} processes on this machine's {cores} usable core(s): at most {limit} "
            f"run here ({PROCESSES_PER_CORE} a core); give fewer --workers/--servers/--stages, "
            "or run across machines under torchrun"
        )


def share_cores(processes: int) -> int:
    """Give this process its part of the machine's cores: `processes` local processes that
    each keep torch's default (every core) thrash; two LeNet-300 workers on 2 cores ran 4x
    slower so. An explicit OMP_NUM_THREADS (torchrun sets 1) wins. Returns the thread count."""
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, usable_cores() // processes))
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


def _leave_with_launcher(parent: int) -> None:
    """A rank's thread: once its launcher is gone (killed, not interrupted), nobody reads this
    rank's result, so it leaves rather than train on as an orphan (torchrun's agent does the
    same for its ranks)."""
    while os.getppid() == parent:
        time.sleep(HEARTBEAT_S)
    os._exit(1)


def _entry(rank, fn, world, store_path, timeout_s, backend, results, errors, beats, name) -> None:
    import faulthandler

    import torch.distributed as dist

    _join_job(_FileBeats(Path(beats)), rank, name)  # first: the parent watches from now on
    threading.Thread(target=_leave_with_launcher, args=(os.getppid(),), daemon=True).start()
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
    except KeyboardInterrupt:  # Ctrl-C reaches every rank; the parent reports it, once
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        code = 130
    except InputError as e:
        errors.put((rank, "input", str(e)))
        code = 2
    except CompressError as e:
        errors.put((rank, "stage", str(e)))
        code = 1
    except Exception as e:  # a collective failing because a peer died, or a bug
        if isinstance(e, RuntimeError) and dist.is_initialized():
            error = silent_peer_error()
            errors.put((rank, "peer", str(error or f"{type(e).__name__}: {gloo_line(e)}")))
        else:
            first = (str(e).strip().splitlines() or [""])[0][:200]
            errors.put((rank, "bug", f"{type(e).__name__}: {first}"))
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
