"""A hung peer is named, in time: a rank that stops answering (SIGSTOP) ends an all-reduce or
parameter-server job within --timeout + 10 s, exit 1, and the one-line error names that rank,
not the healthy one whose collective timed out waiting for it; no process is left behind."""

import multiprocessing
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

# --timeout: short, so that these cases stay cheap, but it also bounds start-up (every rank
# must reach the gloo rendezvous within it) and each healthy collective: 4 s left a busy
# 2-core runner, importing torch in 3 processes, little slack.
TIMEOUT = 8
PS = ["--workers", "2", "--servers", "1"]


def _gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie nobody reaped counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def _stop_one(run, tmp_path, monkeypatch, npz_file, flags, ranks, victim):
    """`compress train` with `flags` (in this process: no second torch import to wait for);
    once every rank is up and an epoch is trained, SIGSTOP rank `victim`.
    Returns (CLI result, seconds from SIGSTOP to the CLI's exit, {rank: pid})."""
    # The launcher's temporary folder lands in tmp_path: each rank's heartbeat file there
    # holds its pid.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = tmp_path / "h.pt"
    pids: dict[int, int] = {}
    stopped: list[float] = []
    done = threading.Event()

    def stop_when_training() -> None:
        deadline = time.monotonic() + 120
        while not done.is_set() and time.monotonic() < deadline:
            for beat in tmp_path.glob("compress-dist.*/beats/[0-9]*"):
                pids.setdefault(int(beat.name), int(beat.read_text()))
            if len(pids) == ranks and out.exists():  # all up, and an epoch is checkpointed
                os.kill(pids[victim], signal.SIGSTOP)
                stopped.append(time.monotonic())
                return
            time.sleep(0.05)

    stopper = threading.Thread(target=stop_when_training, daemon=True)
    stopper.start()
    try:
        result = run(
            "train",
            *("--model", "mlp", "--data", f"npz:{npz_file}", "--epochs", "10000"),
            *("--timeout", TIMEOUT, *flags, "--out", out, "-q"),
        )
        ended = time.monotonic()
    finally:
        done.set()
        stopper.join()
        for pid in pids.values():  # a failed test leaves nothing behind either
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
    assert stopped, f"rank {victim} was never stopped: {result.exit_code} {result.stderr}"
    return result, ended - stopped[0], pids


@pytest.mark.parametrize(
    ("flags", "ranks", "victim", "named"),
    [
        (["--workers", "2"], 2, 1, "worker 1 (pid {})"),
        (["--strategy", "ps-sync", *PS], 3, 1, "worker 1 (pid {})"),
        pytest.param(
            ["--strategy", "ps-async", *PS], 3, 1, "worker 1 (pid {})", marks=pytest.mark.slow
        ),
        pytest.param(
            ["--strategy", "ps-ssp", *PS], 3, 1, "worker 1 (pid {})", marks=pytest.mark.slow
        ),
        pytest.param(
            ["--strategy", "ps-sync", *PS],
            3,
            2,
            "server 0 (rank 2, pid {})",
            marks=pytest.mark.slow,
        ),
    ],
    ids=["allreduce", "ps-sync", "ps-async", "ps-ssp", "ps-sync-server"],
)
def test_a_stopped_rank_ends_the_job_in_time_naming_it(
    run, tmp_path, monkeypatch, npz_file, flags, ranks, victim, named
):
    result, seconds, pids = _stop_one(run, tmp_path, monkeypatch, npz_file, flags, ranks, victim)
    assert result.exit_code == 1, result.stderr
    assert seconds <= TIMEOUT + 10, f"{seconds:.1f} s after SIGSTOP: {result.stderr}"
    lines = result.stderr.strip().splitlines()
    who = named.format(pids[victim])
    assert len(lines) == 1, result.stderr  # one line, not a truncated gloo message
    assert lines[0].startswith(f"error: {who} stopped answering: no heartbeat for "), lines
    assert "stopped, by SIGSTOP" in lines[0], lines
    # Every rank has ended: killed (the stopped one) or stopped, and reaped.
    assert multiprocessing.active_children() == []
    assert [pid for pid in pids.values() if not _gone(pid)] == []
    assert list(tmp_path.glob("compress-dist.*")) == []  # the launcher's folder is gone


TORCHRUN_RANK = """
import os, signal, sys, time

import torch
import torch.distributed as dist

from compresskit.distrib import launch
from compresskit.models.errors import CompressError


def loop(rank, world):
    x = torch.ones(8)
    for step in range(100000):
        if rank == 1 and step == 20:
            os.kill(os.getpid(), signal.SIGSTOP)  # rank 1 stops answering mid-run
        dist.all_reduce(x)
        time.sleep(0.01)


try:
    launch.run(loop, 2, timeout_s=float(sys.argv[1]))
except CompressError as e:
    print(e, flush=True)
    sys.exit(e.exit_code)
"""


@pytest.mark.slow
def test_under_torchrun_the_healthy_rank_names_the_stopped_one(tmp_path):
    """No launcher of ours watches torchrun's ranks: the healthy rank whose all-reduce timed
    out reads the heartbeats in the job's store and names the silent rank, not itself, and
    kills it (the ranks here are started by hand, as torchrun starts them: RANK, WORLD_SIZE,
    MASTER_ADDR...)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "rank.py"
    script.write_text(TORCHRUN_RANK)
    root = Path(__file__).resolve().parents[1]
    ranks = []
    for rank in range(2):
        env = {
            **os.environ,
            **{"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"},
            **{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"},
            "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        cmd = [sys.executable, str(script), str(TIMEOUT)]
        ranks.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env))
    try:
        out, _ = ranks[0].communicate(timeout=120)
        assert ranks[0].returncode == 1, out
        pid = ranks[1].pid
        assert out.strip().startswith(f"worker 1 (pid {pid}) stopped answering: no heartbeat "), out
        assert out.strip().endswith("; worker 0 gave up waiting for it"), out
        # ... and kills it: torchrun's SIGTERM would wait for a SIGCONT, then 30 s for SIGKILL
        assert ranks[1].wait(timeout=10) == -signal.SIGKILL
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
