"""Per-operator profiles: a hand-made trace summed by hand, and real FP32 and INT8 files."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from compresskit.compressor import export as E
from compresskit.compressor.measure import ortprofile as P
from compresskit.models import tiny
from compresskit.models.errors import InputError, StageError

X = np.random.default_rng(0).random((2, 1, 8, 8), dtype=np.float32)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """lenet5 (Conv, Gemm) as FP32 and QDQ INT8, alone in their folder."""
    folder = tmp_path_factory.mktemp("models")
    work = tmp_path_factory.mktemp("work")
    fp32 = E.export_onnx(
        tiny("lenet5").eval(), torch.rand(2, 1, 8, 8), folder / "fp32.onnx", E.ExportConfig()
    )
    prepared = E.preprocess(fp32, work / "prepared.onnx")
    int8 = E.quantize_int8(prepared, folder / "int8.onnx", X, E.QuantConfig(calibration=2))
    return fp32, int8


def _listing(*folders: Path) -> dict[Path, list[str]]:
    return {f: sorted(os.listdir(f)) for f in folders}


def _check_profile(profile: dict, runs: int) -> None:
    assert profile["runs"] == runs
    ops = profile["ops"]
    assert ops and profile["total_us_per_run"] > 0
    assert sum(o["share"] for o in ops) == pytest.approx(1.0)
    assert sum(o["us_per_run"] for o in ops) == pytest.approx(profile["total_us_per_run"])
    assert [o["us_per_run"] for o in ops] == sorted((o["us_per_run"] for o in ops), reverse=True)
    assert all(o["nodes"] >= 1 for o in ops)
    assert profile["session_us_per_run"] >= profile["total_us_per_run"]


def test_fp32_profile_and_no_files_left(files, tmp_path, monkeypatch):
    fp32, _ = files
    monkeypatch.chdir(tmp_path)
    before = _listing(tmp_path, fp32.parent)
    profile = P.profile_ops(fp32, X, runs=7)
    assert _listing(tmp_path, fp32.parent) == before
    _check_profile(profile, 7)
    types = {o["op_type"] for o in profile["ops"]}
    assert "Conv" in types and types & {"Gemm", "FusedGemm", "MatMul"}, types
    assert len(P.top_ops(profile, k=2)) == 2


def test_int8_profile_shows_quantized_kernels(files, tmp_path, monkeypatch):
    _, int8 = files
    monkeypatch.chdir(tmp_path)
    before = _listing(tmp_path, int8.parent)
    profile = P.profile_ops(int8, X, runs=5, threads=2)
    assert _listing(tmp_path, int8.parent) == before
    _check_profile(profile, 5)
    types = {o["op_type"] for o in profile["ops"]}
    quantized = {t for t in types if t.startswith("QLinear") or t.endswith("Integer")}
    quantized |= types & {"QuantizeLinear", "DequantizeLinear", "QGemm"}
    assert quantized, types


def _event(cat, name, ts, dur, op=None):
    e = {"cat": cat, "name": name, "ts": ts, "dur": dur, "ph": "X", "args": {}}
    if op:
        e["args"]["op_name"] = op
    return e


def _trace():
    """One warm-up run and two measured runs of a graph with two Conv nodes and one Gemm."""
    events = [_event("Session", "session_initialization", 0, 50)]
    kernels = ((999, 999, 999), (30, 10, 20), (50, 10, 30))  # conv1, conv2, fc per run
    for ts, (c1, c2, g) in zip((100, 200, 300), kernels, strict=True):
        events += [
            _event("Session", "model_run", ts, 90),
            _event("Session", "SequentialExecutor::Execute", ts + 1, 85),
            _event("Node", "conv1_fence_before", ts + 2, 0, "Conv"),
            _event("Node", "conv1_kernel_time", ts + 2, c1, "Conv"),
            _event("Node", "conv2_kernel_time", ts + 40, c2, "Conv"),
            _event("Node", "fc_kernel_time", ts + 60, g, "Gemm"),
        ]
    return events


def test_summary_of_a_trace_by_hand():
    got = P._summarise(_trace(), warmup=1, runs=2, path=Path("m.onnx"))
    # Measured: Conv 30 + 10 + 50 + 10 = 100 us, Gemm 20 + 30 = 50 us, over 2 runs.
    assert got["runs"] == 2
    assert got["total_us_per_run"] == 75
    assert got["session_us_per_run"] == 90
    assert got["ops"] == [
        {"op_type": "Conv", "us_per_run": 50, "share": 100 / 150, "nodes": 2},
        {"op_type": "Gemm", "us_per_run": 25, "share": 50 / 150, "nodes": 1},
    ]
    assert P.top_ops(got) == ["Conv 67%", "Gemm 33%"]
    assert P.top_ops(got, k=1) == ["Conv 67%"]


def test_a_trace_missing_runs_is_refused():
    with pytest.raises(StageError, match="recorded 3 of 4 runs"):
        P._summarise(_trace(), warmup=1, runs=3, path=Path("m.onnx"))


def test_bad_input_is_refused(files, tmp_path):
    fp32, _ = files
    with pytest.raises(InputError, match="no such file"):
        P.profile_ops(tmp_path / "missing.onnx", X)
    with pytest.raises(InputError, match="runs 0"):
        P.profile_ops(fp32, X, runs=0)
    with pytest.raises(InputError, match="fp32.onnx: input of shape"):
        P.profile_ops(fp32, X[:, :, :4], runs=1)
