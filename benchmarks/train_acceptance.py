"""Time the acceptance runs of `compress train` and print accuracy and wall time side by side.

    python benchmarks/train_acceptance.py [--mnist DIR]

Runs the real CLI in subprocesses (so import and data-loading time count, as a user sees it):
lenet300 on digits for 10 epochs (target: accuracy >= 0.95 in < 60 s on 2 cores), lenet5 on
MNIST for 5 epochs when --mnist is given (target >= 0.95), and the vgg teacher on digits.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time


def run(args: list[str]) -> tuple[dict, float]:
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "compresskit.cli", "train", *args, "--json", "-q"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout), time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mnist", help="folder with MNIST IDX files (t10k-* at least)")
    opts = parser.parse_args()
    jobs = [("lenet300", "digits", 10), ("vgg", "digits", 3)]
    if opts.mnist:
        jobs.append(("lenet5", f"mnist:{opts.mnist}", 5))
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"python {platform.python_version()}"
    )
    print(f"{'model':10} {'data':28} {'epochs':>6} {'test acc':>9} {'train s':>8} {'wall s':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for model, data, epochs in jobs:
            res, wall = run(
                [
                    "--model",
                    model,
                    "--data",
                    data,
                    "--epochs",
                    str(epochs),
                    "--out",
                    os.path.join(tmp, f"{model}.pt"),
                ]
            )
            print(
                f"{model:10} {data[-28:]:28} {epochs:>6} {res['test_accuracy']:>9.4f} "
                f"{res['seconds']:>8.1f} {wall:>7.1f}"
            )


if __name__ == "__main__":
    main()
