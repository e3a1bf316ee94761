"""INT8 files for the runtimes apps pin: versions read back, no orphan Q/DQ, choices that do
not depend on the build machine's load, parity of the file as written against plain numpy."""

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from torch import nn

from compressor.export import compat as onnxcompat
from compressor.export import int8 as I
from compressor.export import mobile
from compressor.export import onnxfile as E
from models import tiny
from tests.test_export import Residual  # BatchNorm, ReLU, a residual Add, a head


def _residual() -> nn.Module:
    torch.manual_seed(0)
    m = Residual()
    m.train()(torch.rand(16, 1, 8, 8))
    return m.eval()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("q")
    fp32 = E.export_onnx(_residual(), torch.rand(2, 1, 8, 8), tmp / "fp32.onnx", E.ExportConfig())
    calib = np.random.default_rng(0).random((64, 1, 8, 8), dtype=np.float32)
    return fp32, E.preprocess(fp32, tmp / "prep.onnx"), calib


def _ops(model) -> list[str]:
    return [n.op_type for n in model.graph.node]


# --- versions and the ORT compatibility table -------------------------------------------------


@pytest.mark.parametrize(
    ("ir", "opsets", "release"),
    [
        (7, {"ai.onnx": 13}, "1.10"),
        (8, {"ai.onnx": 18}, "1.14"),
        (9, {"ai.onnx": 18}, "1.16"),
        (9, {"ai.onnx": 20}, "1.17"),
        (10, {"ai.onnx": 18}, "1.18"),
        (9, {"ai.onnx": 18, "com.microsoft": 1}, "1.16"),
        (9, {"ai.onnx": 18, "ai.onnx.ml": 5}, onnxcompat.NEWER),  # the quantizer's leftover
        (11, {"ai.onnx": 23}, onnxcompat.NEWER),
    ],
)
def test_min_ort_from_the_table(ir, opsets, release):
    assert onnxcompat.min_ort({"ir_version": ir, "opsets": opsets}) == release


def test_unused_opset_imports_are_removed():
    from onnx import helper

    model = helper.make_model(
        helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [], []),
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.onnx.ml", 5)],
    )
    assert onnxcompat.versions(onnxcompat.keep_used_opsets(model))["opsets"] == {"ai.onnx": 18}


@pytest.mark.parametrize(("opset", "ir"), [(13, None), (17, 9), (18, 9), (18, None)])
def test_every_file_is_written_at_the_opset_and_ir_asked(tmp_path, opset, ir):
    model = _residual()
    cfg = E.ExportConfig(opset=opset, ir_version=ir)
    fp32 = E.export_onnx(model, torch.rand(2, 1, 8, 8), tmp_path / "m.fp32.onnx", cfg)
    calib = np.random.default_rng(0).random((32, 1, 8, 8), dtype=np.float32)
    prepared = E.preprocess(fp32, tmp_path / "prep.onnx")
    q = E.quantize_int8(
        prepared, tmp_path / "m.int8.onnx", calib, I.QuantConfig(), ir_version=cfg.ir_version
    )
    fixed = mobile.fixed_batch(q, tmp_path / "m.int8.fixed.onnx", 1)
    want_ir = ir or onnxcompat.min_ir_for(opset)
    x = torch.rand(3, 1, 8, 8)
    for path in (fp32, q, fixed):
        v = onnxcompat.describe(onnx.load(str(path)))
        assert v["opsets"] == {"ai.onnx": opset}, path.name  # no other domain imported
        assert v["ir_version"] == want_ir, path.name
        E.check(path)  # onnx.checker full_check and a load in this ORT
    got = E.run(E._session(fp32), x.numpy())
    np.testing.assert_allclose(got, model(x).detach().numpy(), rtol=1e-4, atol=1e-5)


def test_an_opset_no_route_can_write_is_refused(monkeypatch, tmp_path):
    real = E._export

    def dynamo_only(model, example, cfg, dynamo, name="x"):
        if not dynamo:
            raise E.StageError("ONNX export failed: the TorchScript exporter is gone")
        return real(model, example, cfg, dynamo)

    monkeypatch.setattr(E, "_export", dynamo_only)
    out = tmp_path / "m.onnx"
    # Relu has no 14 -> 13 adapter in onnx's converter, and torch's dynamo exporter keeps 18.
    with pytest.raises(E.InputError, match="opset 13: torch's exporter wrote opset 18"):
        E.probe_opset(_residual(), torch.rand(2, 1, 8, 8), E.ExportConfig(opset=13))
    assert not out.exists()


# --- orphan Q/DQ ------------------------------------------------------------------------------


def test_every_node_in_fp32_leaves_no_qdq(prepared):
    fp32, prep, calib = prepared
    q = I.Quantizer(prep, calib)
    model = q.build(I.scheme_for(I.QuantConfig(), False), q.nodes)
    assert not {"QuantizeLinear", "DequantizeLinear"} & set(_ops(model))
    x = calib[:8]
    ref = I.outputs(I.session(str(fp32), optimized=False), x)
    got = I.outputs(I.session(model.SerializeToString(), optimized=False), x)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)  # the FP32 graph, nothing else


def test_nodes_kept_in_int8_keep_their_qdq(prepared):
    _, prep, calib = prepared
    q = I.Quantizer(prep, calib)
    scheme = I.scheme_for(I.QuantConfig(), False)
    full = q.build(scheme)
    assert len(I.int8_compute_nodes(full.graph)) == 3
    mixed = q.build(scheme, q.nodes[:1])  # the first conv back to FP32
    assert [n.name for n in I.int8_compute_nodes(mixed.graph)] == q.nodes[1:]
    onnx.checker.check_model(mixed, full_check=True)


def test_strip_is_needed_the_quantizer_alone_leaves_orphans(prepared):
    """The reason strip_orphan_qdq exists: ORT's quantizer wraps the glue of excluded nodes."""
    from onnxruntime.quantization import QuantFormat, quantize_static

    _, prep, calib = prepared
    out = Path(str(prep).replace("prep", "raw"))
    quantize_static(
        str(prep),
        str(out),
        I._reader(calib, "x"),
        quant_format=QuantFormat.QDQ,
        nodes_to_exclude=E.quantizable_nodes(prep),
    )
    raw = onnx.load(str(out))
    assert "QuantizeLinear" in _ops(raw) and not I.int8_compute_nodes(raw.graph)
    assert I.strip_orphan_qdq(raw) > 0
    assert not {"QuantizeLinear", "DequantizeLinear"} & set(_ops(raw))


# --- reference semantics: the file as written --------------------------------------------------


def _numpy_qdq(model, x: np.ndarray) -> np.ndarray:
    """Evaluate a QuantizeLinear / DequantizeLinear / Gemm graph with numpy, per the ONNX spec
    (round half to even, saturate, per-axis scales)."""
    env = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    env[model.graph.input[0].name] = x
    for n in model.graph.node:
        a = {at.name: onnx.helper.get_attribute_value(at) for at in n.attribute}
        ins = [env[i] for i in n.input]
        if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            v, scale, zp = ins[0], ins[1], ins[2] if len(ins) > 2 else np.uint8(0)
            shape = [1] * v.ndim
            if scale.size > 1:  # per-axis
                shape[a.get("axis", 1)] = -1
            s, z = scale.reshape(shape), zp.reshape(shape).astype(np.float64)
            if n.op_type == "QuantizeLinear":
                info = np.iinfo(zp.dtype)
                q = np.clip(np.rint(v.astype(np.float64) / s) + z, info.min, info.max)
                env[n.output[0]] = q.astype(zp.dtype)
            else:
                env[n.output[0]] = ((v.astype(np.float64) - z) * s).astype(np.float32)
        elif n.op_type == "Gemm":
            A, B = ins[0], ins[1]
            A = A.T if a.get("transA") else A
            B = B.T if a.get("transB") else B
            y = a.get("alpha", 1.0) * (A.astype(np.float64) @ B.astype(np.float64))
            if len(ins) > 2:
                y = y + a.get("beta", 1.0) * ins[2]
            env[n.output[0]] = y.astype(np.float32)
        else:
            raise AssertionError(f"unexpected op {n.op_type}")
    return env[model.graph.output[0].name]


@pytest.mark.parametrize("scheme", ["ours", "ort-default"])
def test_reference_semantics_equal_a_numpy_qdq_computation(tmp_path, scheme):
    torch.manual_seed(0)
    model = nn.Linear(6, 3).eval()
    fp32 = E.export_onnx(model, torch.rand(2, 6), tmp_path / "g.onnx", E.ExportConfig())
    x = np.random.default_rng(1).standard_normal((50, 6)).astype(np.float32)
    q = I.Quantizer(E.preprocess(fp32, tmp_path / "p.onnx"), x)
    s = I.scheme_for(I.QuantConfig(), False) if scheme == "ours" else I.ORT_DEFAULT
    qdq = q.build(s)
    assert [n.name for n in I.int8_compute_nodes(qdq.graph)] == q.nodes
    got = I.outputs(I.session(qdq.SerializeToString(), optimized=False), x)
    np.testing.assert_allclose(got, _numpy_qdq(qdq, x), rtol=1e-5, atol=1e-5)


# --- the choice -----------------------------------------------------------------------------


def _lenet(tmp_path: Path):
    torch.manual_seed(0)
    model = tiny("lenet5", in_shape=(1, 8, 8)).eval()
    fp32 = E.export_onnx(model, torch.rand(2, 1, 8, 8), tmp_path / "f.onnx", E.ExportConfig())
    x = np.random.default_rng(0).random((200, 1, 8, 8), dtype=np.float32)
    return fp32, E.preprocess(fp32, tmp_path / "p.onnx"), x


def test_mobile_holds_the_floor_deterministically_and_beats_ort_default(tmp_path):
    fp32, prep, x = _lenet(tmp_path)
    cfg = I.QuantConfig(min_agreement=1.0, target="mobile")
    a = I.choose(prep, fp32.read_bytes(), x[:64], x[64:], cfg, {"avx2"})
    b = I.choose(prep, fp32.read_bytes(), x[:64], x[64:], cfg, {"avx2"})
    assert a.selection.agreement >= 1.0
    assert all(why.startswith("accuracy") for why in a.selection.fp32_nodes.values())
    assert a.reduce_range is False and a.semantics == "reference"  # auto: off for mobile
    assert a.selection.latency_ms is None  # nothing timed
    bytes_a = a.model.SerializeToString() if a.model else b""
    assert bytes_a == (b.model.SerializeToString() if b.model else b"")
    ours, ort = a.candidates
    assert ort["scheme"].startswith("ort-default")
    if ours["int8_nodes"] == ort["int8_nodes"]:
        assert a.selection.agreement >= ort["agreement"]


def test_host_ships_no_int8_file_when_fp32_is_faster(tmp_path, monkeypatch):
    fp32, prep, x = _lenet(tmp_path)
    monkeypatch.setattr(I, "fp32_clearly_faster", lambda a, b, margin=I.MARGIN: True)
    monkeypatch.setattr(I, "ROUNDS", 3)
    cfg = I.QuantConfig(min_agreement=0.5, target="host")
    choice = I.choose(prep, fp32.read_bytes(), x[:32], x[32:], cfg, {"avx2"})
    assert choice.model is None and choice.selection.int8_nodes == 0
    assert choice.reason.startswith("INT8 slower")
    assert choice.reduce_range is True  # auto on an AVX2 CPU without VNNI, for host
    assert set(choice.selection.latency_ms) == {"fp32", "int8"}


def test_host_rule_does_not_flip_under_noise():
    rng = np.random.default_rng(0)
    int8 = 1.0 + 0.3 * rng.random(9)  # a loaded machine: +-30% jitter
    same = 1.0 + 0.3 * rng.random(9)
    assert not I.fp32_clearly_faster(same, int8)  # equal speed under noise: INT8 stays
    assert not I.fp32_clearly_faster(0.97 * int8, int8)  # 3% is inside the margin
    assert I.fp32_clearly_faster(0.5 * int8, int8)  # twice as fast every round
    spiky = 0.5 * int8
    spiky[[1, 4, 6, 8]] = 3.0  # one noisy half of the rounds: the interval widens
    assert not I.fp32_clearly_faster(spiky, int8)
    with pytest.raises(ValueError, match="paired samples"):
        I.fp32_clearly_faster([1.0, 2.0], [1.0, 2.0])


def test_reduce_range_auto_and_cpu_flags():
    assert I.saturating_cpu({"avx2", "fma"})
    assert not I.saturating_cpu({"avx2", "avx512_vnni"}) and not I.saturating_cpu({"avx_vnni"})
    assert not I.saturating_cpu(set())  # ARM or unknown: not this x86 case
    host, mobile_ = I.QuantConfig(target="host"), I.QuantConfig()
    assert I.resolve_reduce_range(host, {"avx2"}) is True
    assert I.resolve_reduce_range(host, {"avx2", "avx512_vnni"}) is False
    assert I.resolve_reduce_range(mobile_, {"avx2"}) is False
    assert I.resolve_reduce_range(I.QuantConfig(reduce_range=True), set()) is True


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"target": "phone"}, "target 'phone'"),
        ({"scheme": "s8s8"}, "scheme 's8s8'"),
        ({"reduce_range": True, "scheme": "u8u8"}, "needs int8 weights"),
        ({"reduce_range": "yes"}, "reduce_range 'yes'"),
    ],
)
def test_bad_quantization_settings(cfg, message):
    with pytest.raises(E.InputError, match=message):
        I.QuantConfig(**cfg)


@pytest.mark.parametrize("bias", [True, False])
def test_bias_correction_removes_the_mean_shift(tmp_path, bias):
    torch.manual_seed(0)
    model = nn.Linear(16, 4, bias=bias).eval()
    fp32 = E.export_onnx(model, torch.rand(2, 16), tmp_path / "g.onnx", E.ExportConfig())
    x = (np.random.default_rng(1).standard_normal((128, 16)) + 2.0).astype(np.float32)
    q = I.Quantizer(E.preprocess(fp32, tmp_path / "p.onnx"), x)
    qdq = q.build(I.ORT_DEFAULT)  # per-tensor: a visible shift per channel
    fixed, n = I.correct_bias(qdq, fp32.read_bytes(), x, optimized=False)
    assert n == (1 if bias else 0)
    # The Gemm's own output (before the output Q/DQ, whose rounding is not the bias's).
    gemm = next(n.output[0] for n in qdq.graph.node if n.op_type == "Gemm")
    ref = I._run_with(onnx.load(str(fp32)), [onnx.load(str(fp32)).graph.output[0].name], x, False)
    shift = [np.abs((I._run_with(m, [gemm], x, False)[0] - ref[0]).mean(0)) for m in (qdq, fixed)]
    if not bias:  # nothing to correct: the model comes back unchanged
        assert fixed.SerializeToString() == qdq.SerializeToString()
        return
    scale = next(
        numpy_helper.to_array(t)
        for t in fixed.graph.initializer
        if t.name.endswith("bias_quantized_scale")
    )
    assert np.all(shift[1] <= scale / 2 + 1e-6), (shift, scale)  # within one bias step
    assert shift[1].sum() < shift[0].sum()
