"""Training speed on an idle and a busy machine: OpenMP's default spin-wait against the short
spin the `compress` command sets (GOMP_SPINCOUNT=1000) and OMP_WAIT_POLICY=PASSIVE.

    python benchmarks/thread_wait.py                      # lenet300 and vgg on digits
    python benchmarks/thread_wait.py --models lenet300 --reps 5

torch's CPU kernels run on libgomp's thread pool, one thread per core; a thread that finishes
its share spins, waiting for the next parallel region. When another process holds a core, the
spinning threads steal the time the thread on the busy core needs (compresskit/_threads.py).

Each run is a fresh `compress train` process with torch loaded before the command (so the
command sets nothing and each setting comes from the environment; libgomp reads it when torch
loads), the settings alternating, with all cores idle and then with one busy-looping process
per core but one; prints the median epoch seconds of each (epochs after the first). Compare
only figures from one run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# The command with torch loaded first: it then sets nothing, and the environment decides.
COMMAND = [
    sys.executable,
    "-c",
    "import sys, torch; from compresskit.cli.entry import main; sys.argv[0] = 'compress'; main()",
]
SETTINGS = {
    "default": {},
    "spin 1000": {"GOMP_SPINCOUNT": "1000"},  # what the command sets
    "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
}


def _burn() -> None:
    while True:
        pass


def epoch_seconds(model: str, epochs: int, setting: str, out: Path) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(SETTINGS[setting])
    cmd = [*COMMAND, "train", "--model", model, "--epochs", str(epochs), "-q", "--json"]
    done = subprocess.run(
        [*cmd, "--out", str(out), "--force"], env=env, capture_output=True, text=True, check=True
    )
    history = json.loads(done.stdout)["history"]
    return statistics.median(r["seconds"] for r in history[1:] or history)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="lenet300,vgg")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(f"{platform.processor() or platform.machine()}, {cores} usable cores")
    print(f"{'model':10} {'load':>8} " + " ".join(f"{k:>10}" for k in SETTINGS) + "  (seconds)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "m.pt"
        for busy in (0, max(cores - 1, 1)):
            burners = [mp.Process(target=_burn, daemon=True) for _ in range(busy)]
            for b in burners:
                b.start()
            try:
                for model in args.models.split(","):
                    runs: dict[str, list[float]] = {k: [] for k in SETTINGS}
                    for _ in range(args.reps):
                        for setting in runs:
                            runs[setting].append(epoch_seconds(model, args.epochs, setting, out))
                    load = f"{busy} busy" if busy else "idle"
                    cells = " ".join(f"{statistics.median(v):10.3f}" for v in runs.values())
                    print(f"{model:10} {load:>8} {cells}")
            finally:
                for b in burners:
                    b.terminate()


if __name__ == "__main__":
    main()
