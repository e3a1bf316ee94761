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


@pytest.mark.slow
def test_demo_meets_the_distillation_targets_on_digits(run, tmp_path):
    """`compress demo` as the README runs it (about 35 s on 2 cores): a student >= 10x smaller
    within 0.5 points of the teacher, INT8 agreeing with FP32 ONNX and at most 30% of its size,
    and faster than the FP32 ONNX at batch 1 (or a tie within the precision chooser's noise)."""
    result = run("demo", "--out", tmp_path / "demo", "--json", "-q")
    assert result.exit_code == 0, result.stderr
    r = result.json()
    t, s, o = r["teacher"], r["student"], r["onnx"]
    assert t["parameters"] >= 10 * s["parameters"]
    assert s["dense_test_accuracy"] >= t["test_accuracy"] - 0.005
    assert o["int8"]["top1_agreement_fp32"] >= 0.995
    assert o["int8"]["bytes"] <= 0.30 * o["fp32"]["bytes"]
    lat = r["latency_ms_batch1"]
    assert lat["teacher_pytorch"] >= 10 * lat["student_onnx_int8"]  # 34x measured; slack for noise
