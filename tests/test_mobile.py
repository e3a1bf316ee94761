"""compressor.export.mobile: .ort conversion, NNAPI/CoreML usability verdicts, fixing the batch.

Models are exported once per module (the torch exporter takes a second or two each):
LeNet-5 and an MLP in FP32 with a dynamic batch, and LeNet-5 as a QDQ INT8 model (U8S8).
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from compresskit.compressor.export import mobile
from compresskit.models import tiny
from compresskit.models.errors import InputError, StageError

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

SHAPE = (1, 8, 8)


def _export(name: str, path: Path) -> Path:
    model = tiny(name, in_shape=SHAPE).eval()
    x = torch.randn(1, *SHAPE)
    with contextlib.redirect_stdout(io.StringIO()):  # the exporter prints its progress
        torch.onnx.export(
            model,
            (x,),
            path,
            dynamic_shapes={"x": {0: torch.export.Dim("batch")}},
            external_data=False,
            opset_version=17,
        )
    return path


def _quantize(fp32: Path, path: Path, activations: str = "QUInt8") -> Path:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self):
            rng = np.random.default_rng(0)
            self.batches = iter(
                [{"x": rng.standard_normal((8, *SHAPE)).astype(np.float32)} for _ in range(4)]
            )

        def get_next(self):
            return next(self.batches, None)

    pre = path.with_name("pre.onnx")
    quant_pre_process(str(fp32), str(pre))
    quantize_static(
        str(pre),
        str(path),
        Reader(),
        quant_format=QuantFormat.QDQ,
        activation_type=getattr(QuantType, activations),
        weight_type=QuantType.QInt8,
        per_channel=True,
    )
    return path


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("mobile_models")
    _export("lenet5", d / "lenet5.onnx")
    _export("mlp", d / "mlp.onnx")
    _quantize(d / "lenet5.onnx", d / "lenet5.int8.onnx")
    return d


def _run(path: Path, batch: int) -> list[np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(7).standard_normal((batch, *SHAPE)).astype(np.float32)
    return session.run(None, {"x": x})


@pytest.mark.parametrize(
    "model, ops",
    [("lenet5.onnx", ["Conv", "Gemm"]), ("lenet5.int8.onnx", ["QLinearConv", "QuantizeLinear"])],
)
def test_to_ort_writes_a_model_that_answers_like_the_onnx(models_dir, tmp_path, capfd, model, ops):
    out = tmp_path / "m.ort"
    result = mobile.to_ort(models_dir / model, out)

    config = tmp_path / "m.required_operators.config"
    assert result == {
        "path": str(out),
        "bytes": out.stat().st_size,
        "config": str(config),
        "max_abs_diff": result["max_abs_diff"],
        # read back from the file: torch's own export (IR 10, which ONNX Runtime reads from
        # 1.18) at opset 17; ORT format v6 alone would need 1.16
        "ort_format": "6",
        "ir_version": 10,
        "opset": 17,
        "min_ort": "1.18",
        "runs_on": mobile.ORT_RUNS_ON,
    }
    assert 0 <= result["max_abs_diff"] <= 1e-4
    # Only the two outputs: the temporary folder is gone.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([config.name, out.name])
    text = config.read_text()
    for op in ops:
        assert op in text
    # the header names the file, never a folder (the pipeline's staging one is random and gone)
    assert f"# - {out.name}\n" in text and str(tmp_path) not in text
    # Reload independently, at a batch the check did not use.
    got, want = _run(out, 3)[0], _run(models_dir / model, 3)[0]
    assert got.shape == (3, 10)
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert capfd.readouterr() == ("", "")  # the tool's chatter is captured, never shown


def test_to_ort_refuses_a_model_that_answers_differently(models_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(mobile, "MAX_ABS_DIFF", -1.0)
    with pytest.raises(StageError, match="answers differently"):
        mobile.to_ort(models_dir / "mlp.onnx", tmp_path / "m.ort")
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_int8_files_are_checked_against_their_own_tolerance(models_dir, tmp_path, monkeypatch):
    """INT8 kernels round requantizations their own way on each layout: an INT8 .ort is held
    to MAX_REL_DIFF_INT8 of the outputs' scale, an FP32 one to MAX_ABS_DIFF."""
    assert mobile._quantized(models_dir / "lenet5.int8.onnx")
    assert not mobile._quantized(models_dir / "lenet5.onnx")
    monkeypatch.setattr(mobile, "MAX_ABS_DIFF", -1.0)  # the FP32 limit does not apply to INT8
    mobile.to_ort(models_dir / "lenet5.int8.onnx", tmp_path / "a.ort")
    monkeypatch.setattr(mobile, "MAX_REL_DIFF_INT8", -1.0)
    with pytest.raises(StageError, match="answers differently"):
        mobile.to_ort(models_dir / "lenet5.int8.onnx", tmp_path / "b.ort")
    assert not (tmp_path / "b.ort").exists()


def test_to_ort_reports_a_failing_tool(models_dir, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        return subprocess.CompletedProcess(args, 1, "", "Traceback ...\nValueError: boom\n")

    monkeypatch.setattr(mobile.subprocess, "run", fail)
    with pytest.raises(StageError, match="convert_onnx_models_to_ort failed: ValueError: boom"):
        mobile.to_ort(models_dir / "mlp.onnx", tmp_path / "m.ort")
    assert list(tmp_path.iterdir()) == []


def test_usability_verdicts_fp32_int8_dynamic_and_fixed(models_dir, tmp_path, capfd):
    # What ORT 1.31's checker really says: a dynamic batch leaves every node unsupported, so
    # both EPs are "no" until the batch is fixed; Q/DQ ops keep CoreML at "no" even then.
    fp32 = mobile.usability(models_dir / "lenet5.onnx")
    assert (fp32["nnapi"], fp32["coreml"]) == ("no", "no")
    assert "NNAPI NO (0/8 nodes" in fp32["details"]
    assert "YES with fixed shapes" in fp32["details"]

    int8 = mobile.usability(models_dir / "lenet5.int8.onnx")
    assert (int8["nnapi"], int8["coreml"]) == ("no", "no")
    assert "DequantizeLinear,QuantizeLinear" in int8["details"]

    fixed = mobile.fixed_batch(models_dir / "lenet5.onnx", tmp_path / "f.onnx", 1)
    assert mobile.usability(fixed) == {
        "nnapi": "yes",
        "coreml": "yes",
        "details": "NNAPI YES (8/8 nodes in 1 partition(s)); "
        "CoreML NeuralNetwork YES (8/8 nodes in 1 partition(s)); "
        "CoreML MLProgram YES (8/8 nodes in 1 partition(s))",
    }
    fixed8 = mobile.fixed_batch(models_dir / "lenet5.int8.onnx", tmp_path / "f8.onnx", 1)
    int8_fixed = mobile.usability(fixed8)
    assert (int8_fixed["nnapi"], int8_fixed["coreml"]) == ("yes", "no")
    assert capfd.readouterr() == ("", "")


def test_int8_activations_are_no_nnapi_file(models_dir, tmp_path):
    """ORT's checker judges op types only and said NNAPI "yes" (31/31 nodes) for an s8s8 file
    with a fixed batch; ORT's NNAPI EP takes QDQ units with uint8 activations only."""
    s8 = _quantize(models_dir / "lenet5.onnx", tmp_path / "s8.onnx", "QInt8")
    fixed = mobile.fixed_batch(s8, tmp_path / "s8.fixed.onnx", 1)
    verdict = mobile.usability(fixed)
    assert verdict["nnapi"] == "no", verdict
    assert "int8 activations: ORT's NNAPI EP takes uint8 ones" in verdict["details"]
    from compresskit.cli.render import mobile_verdicts

    line = mobile_verdicts({**verdict, "batch": 1})
    assert line.startswith("NNAPI no (int8 activations: ORT's NNAPI EP takes uint8 ones)"), line
    u8 = mobile.fixed_batch(models_dir / "lenet5.int8.onnx", tmp_path / "u8.fixed.onnx", 1)
    assert mobile.usability(u8)["nnapi"] == "yes"  # the same graph with uint8 activations


def test_usability_reports_a_failing_tool(models_dir, monkeypatch):
    from onnxruntime.tools.mobile_helpers import usability_checker

    def fail(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(usability_checker, "analyze_model", fail)
    with pytest.raises(StageError, match="check_onnx_model_mobile_usability failed"):
        mobile.usability(models_dir / "mlp.onnx")


def test_fixed_batch_writes_a_model_that_runs_at_that_batch(models_dir, tmp_path):
    src = models_dir / "mlp.onnx"
    before = src.read_bytes()
    out = mobile.fixed_batch(src, tmp_path / "mlp.b4.onnx", 4)

    assert out == tmp_path / "mlp.b4.onnx"
    assert src.read_bytes() == before
    model = onnx.load(str(out))
    dims = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [4, *SHAPE]
    assert [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim] == [4, 10]
    assert _run(out, 4)[0].shape == (4, 10)
    with pytest.raises(Exception, match="(?i)dimension|shape"):
        _run(out, 2)  # the batch really is fixed

    with pytest.raises(InputError, match="no input has a dynamic batch dimension"):
        mobile.fixed_batch(out, tmp_path / "again.onnx", 2)


@pytest.mark.parametrize("batch", [0, -3, 1.5])
def test_fixed_batch_rejects_a_bad_batch(models_dir, tmp_path, batch):
    with pytest.raises(InputError, match=r"batch .*must be a whole number >= 1"):
        mobile.fixed_batch(models_dir / "mlp.onnx", tmp_path / "x.onnx", batch)
    assert list(tmp_path.iterdir()) == []


def _call(fn, src: Path, tmp_path: Path):
    if fn == "to_ort":
        return mobile.to_ort(src, tmp_path / "x.ort")
    if fn == "usability":
        return mobile.usability(src)
    return mobile.fixed_batch(src, tmp_path / "x.onnx", 1)


@pytest.mark.parametrize("fn", ["to_ort", "usability", "fixed_batch"])
def test_missing_and_non_onnx_files_are_input_errors(tmp_path, fn):
    missing = tmp_path / "nope.onnx"
    with pytest.raises(InputError, match=r"nope\.onnx: does not exist; give the path"):
        _call(fn, missing, tmp_path)
    text = tmp_path / "notes.onnx"
    text.write_text("hello, this is not a model\n")
    with pytest.raises(InputError, match=r"notes\.onnx: not a valid ONNX model \(.+\); export"):
        _call(fn, text, tmp_path)


def test_to_ort_checks_the_names(models_dir, tmp_path):
    with pytest.raises(InputError, match=r"must end in \.ort; use m\.ort"):
        mobile.to_ort(models_dir / "mlp.onnx", tmp_path / "m.onnx")
    renamed = tmp_path / "mlp.bin"
    renamed.write_bytes((models_dir / "mlp.onnx").read_bytes())
    with pytest.raises(InputError, match=r"mlp\.bin: .*only reads files named \*\.onnx"):
        mobile.to_ort(renamed, tmp_path / "m.ort")


def test_import_is_light():
    code = "import sys, compressor.export.mobile; print(any(m in sys.modules for m in ('onnx', 'onnxruntime')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_fixed_batch_writes_hardsigmoid_as_ops_nnapi_runs(tmp_path):
    # MobileNetV3's gates: NNAPI has no HardSigmoid, and its file stayed "no" with fixed shapes.
    from compresskit.models.families import ResNetSE

    kw = {"width": 8, "depth": 2, "expand": 2, "act": "hardswish", "bn_momentum": 0.01}
    model = ResNetSE(in_shape=SHAPE, num_classes=10, **kw).eval()
    src = tmp_path / "mnv3.onnx"
    with contextlib.redirect_stdout(io.StringIO()):
        torch.onnx.export(
            model,
            (torch.randn(1, *SHAPE),),
            src,
            dynamic_shapes={"x": {0: torch.export.Dim("batch")}},
            external_data=False,
            opset_version=17,
        )
    ops = [n.op_type for n in onnx.load(str(src)).graph.node]
    out = mobile.fixed_batch(src, tmp_path / "mnv3.b3.onnx", 3)
    new = [n.op_type for n in onnx.load(str(out)).graph.node]
    hard = ops.count("HardSigmoid") + ops.count("HardSwish")
    assert ops.count("HardSigmoid") == 4 and ops.count("HardSwish") == 9  # gates, activations
    assert "HardSigmoid" not in new and "HardSwish" not in new
    assert new.count("Clip") == ops.count("Clip") + hard
    np.testing.assert_allclose(_run(out, 3)[0], _run(src, 3)[0], rtol=1e-5, atol=1e-6)
    assert "HardSigmoid" in mobile.usability(src)["details"]
    assert "HardSigmoid" not in mobile.usability(out)["details"]


def test_a_rewrite_that_answers_differently_is_refused(tmp_path, monkeypatch):
    src = _export("mlp", tmp_path / "mlp.onnx")

    def wrong(graph):  # a rewrite that changes what the model computes: one weight doubled
        from onnx import numpy_helper

        t = graph.initializer[0]
        t.CopyFrom(numpy_helper.from_array(2 * numpy_helper.to_array(t) + 1, t.name))
        return 1

    monkeypatch.setattr(mobile, "compose_hardsigmoid", wrong)
    with pytest.raises(StageError, match="answers differently"):
        mobile.fixed_batch(src, tmp_path / "out.onnx", 2)
    assert not (tmp_path / "out.onnx").exists()
