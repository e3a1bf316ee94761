"""Acceptance runs on real MNIST: `pytest -m slow` (skipped when the data is not there).

Point COMPRESS_MNIST at a folder of MNIST IDX files; by default ../shared/data/mnist.
"""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MNIST = Path(os.environ.get("COMPRESS_MNIST", ROOT.parent / "shared" / "data" / "mnist"))


@pytest.mark.slow
@pytest.mark.skipif(not MNIST.is_dir(), reason=f"no MNIST IDX files at {MNIST}")
def test_lenet5_reaches_095_on_mnist_in_5_epochs(run, tmp_path):
    result = run(
        "train",
        "--model",
        "lenet5",
        "--data",
        f"mnist:{MNIST}",
        "--epochs",
        "5",
        "--out",
        tmp_path / "lenet5.pt",
        "--json",
        "-q",
    )
    assert result.exit_code == 0, result.stderr
    assert result.json()["test_accuracy"] >= 0.95
