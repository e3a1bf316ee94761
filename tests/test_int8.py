"""INT8 files for the runtimes apps pin: versions read back, no orphan Q/DQ, choices that do
not depend on the build machine's load, parity of the file as written against plain numpy."""

import copy
import itertools
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from torch import nn

from compresskit.compressor.export import biascorr as B
from compresskit.compressor.export import checks as C
from compresskit.compressor.export import compat as onnxcompat
from compresskit.compressor.export import fallback as F
from compresskit.compressor.export import int8 as I
from compresskit.compressor.export import mobile, protos
from compresskit.compressor.export import onnxfile as E
from compresskit.compressor.export import qdq as Q
from compresskit.models import tiny
from compresskit.models.errors import StageError
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
        (9, {"ai.onnx": 18}, "1.15"),  # an IR-9 file runs in ORT 1.15.1 (said 1.16)
        (9, {"ai.onnx": 20}, "1.17"),
        (10, {"ai.onnx": 18}, "1.18"),
        (9, {"ai.onnx": 18, "com.microsoft": 1}, "1.15"),
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

    def dynamo_only(model, example, cfg, dynamo, name="x", outputs=None, sequence=0):
        if not dynamo:
            raise E.StageError("ONNX export failed: the TorchScript exporter is gone")
        return real(model, example, cfg, dynamo, sequence=sequence)

    monkeypatch.setattr(E, "_export", dynamo_only)
    out = tmp_path / "m.onnx"
    # Relu has no 14 -> 13 adapter in onnx's converter, and torch's dynamo exporter keeps 18.
    with pytest.raises(E.InputError, match="opset 13: torch's exporter wrote opset 18"):
        E.probe_opset(_residual(), torch.rand(2, 1, 8, 8), E.ExportConfig(opset=13))
    assert not out.exists()


# --- orphan Q/DQ ------------------------------------------------------------------------------


def test_every_node_in_fp32_leaves_no_qdq(prepared):
    fp32, prep, calib = prepared
    q = Q.Quantizer(prep, calib)
    model = q.build(I.scheme_for(I.QuantConfig(), False), q.nodes)
    assert not {"QuantizeLinear", "DequantizeLinear"} & set(_ops(model))
    x = calib[:8]
    ref = C.outputs(C.session(str(fp32), optimized=False), x)
    got = C.outputs(C.session(model.SerializeToString(), optimized=False), x)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)  # the FP32 graph, nothing else


def test_nodes_kept_in_int8_keep_their_qdq(prepared):
    _, prep, calib = prepared
    q = Q.Quantizer(prep, calib)
    scheme = I.scheme_for(I.QuantConfig(), False)
    full = q.build(scheme)
    assert len(Q.int8_compute_nodes(full.graph)) == 3
    mixed = q.build(scheme, q.nodes[:1])  # the first conv back to FP32
    assert [n.name for n in Q.int8_compute_nodes(mixed.graph)] == q.nodes[1:]
    onnx.checker.check_model(mixed, full_check=True)


def test_strip_is_needed_the_quantizer_alone_leaves_orphans(prepared):
    """The reason strip_orphan_qdq exists: ORT's quantizer wraps the glue of excluded nodes."""
    from onnxruntime.quantization import QuantFormat, quantize_static

    _, prep, calib = prepared
    out = Path(str(prep).replace("prep", "raw"))
    quantize_static(
        str(prep),
        str(out),
        Q.reader(calib, "x"),
        quant_format=QuantFormat.QDQ,
        nodes_to_exclude=E.quantizable_nodes(prep),
    )
    raw = onnx.load(str(out))
    assert "QuantizeLinear" in _ops(raw) and not Q.int8_compute_nodes(raw.graph)
    assert Q.strip_orphan_qdq(raw) > 0
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
    q = Q.Quantizer(E.preprocess(fp32, tmp_path / "p.onnx"), x)
    s = I.scheme_for(I.QuantConfig(), False) if scheme == "ours" else Q.ORT_DEFAULT
    qdq = q.build(s)
    assert [n.name for n in Q.int8_compute_nodes(qdq.graph)] == q.nodes
    got = C.outputs(C.session(qdq.SerializeToString(), optimized=False), x)
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
    q = Q.Quantizer(E.preprocess(fp32, tmp_path / "p.onnx"), x)
    qdq = q.build(Q.ORT_DEFAULT)  # per-tensor: a visible shift per channel
    fixed, n = B.correct_bias(qdq, fp32.read_bytes(), x, optimized=False)
    assert n == (1 if bias else 0)
    # The Gemm's own output (before the output Q/DQ, whose rounding is not the bias's).
    gemm = next(n.output[0] for n in qdq.graph.node if n.op_type == "Gemm")
    ref = B._run_with(onnx.load(str(fp32)), [onnx.load(str(fp32)).graph.output[0].name], x, False)
    shift = [np.abs((B._run_with(m, [gemm], x, False)[0] - ref[0]).mean(0)) for m in (qdq, fixed)]
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


# --- the agreement floor: few builds, recorded, silent ---------------------------------------


def _fake_search(n: int, needed: set[str] | int):
    """A `candidate` for `fallback.fall_back` over nodes n0..n{n-1}: it holds when the nodes back in
    FP32 include `needed` (a set) or number at least `needed` (an int); calls are counted."""
    reference = np.eye(4)[np.arange(100) % 4]
    calls = []

    def candidate(back, floor):
        calls.append(len(back))
        ok = needed <= set(back) if isinstance(needed, set) else len(back) >= needed
        out = reference if ok else np.roll(reference, 1, axis=1)
        if floor is not None and not ok:
            return "model", None, 0  # stopped early
        return f"model-{len(back)}", out, 0

    return [f"n{i}" for i in range(n)], candidate, reference, calls


def test_fallback_bisects_to_the_fewest_nodes_in_log_builds():
    cfg = I.QuantConfig()
    order, candidate, reference, calls = _fake_search(74, 21)  # a 12-block ViT's 74 nodes
    model, out, _, back = F.fall_back(order, candidate, reference, cfg, before=0.5)
    assert back == order[:21] and model == "model-21"
    assert C.agreement(out, reference) >= cfg.min_agreement
    # 1, 2, 4, ..., 32, then bisection in (16, 32], then the shrink's budget: not 74 builds
    assert len(calls) <= 2 * 7 + F._budget(74)
    # Every node needed: the whole list, the all-FP32 graph, holds.
    order, candidate, reference, calls = _fake_search(5, 5)
    assert F.fall_back(order, candidate, reference, cfg, before=0.5)[3] == order


def test_fallback_finds_one_culprit_the_order_puts_last():
    # A ViT's patch embedding: the smallest own error (last in the order), yet the one node
    # whose INT8 error flips a check sample. The prefix search needs all 26; the shrink finds it.
    cfg = I.QuantConfig()
    order, candidate, reference, calls = _fake_search(26, {"n25"})
    model, out, _, back = F.fall_back(order, candidate, reference, cfg, before=0.5)
    assert back == ["n25"] and model == "model-1"
    assert C.agreement(out, reference) >= cfg.min_agreement
    # prefixes 1, 2, 4, 8, 16 fail and 26 holds, bisection tries 21, 23, 24, 25 (fail); then
    # the shrink, tail chunk first, holds at every halving: 13, 6, 3, 1 nodes
    assert calls == [1, 2, 4, 8, 16, 26, 21, 23, 24, 25, 13, 6, 3, 1]
    # Two culprits far apart in the order: the prefix that holds is n0..n20; within its budget
    # the shrink drops part of it and keeps both culprits.
    order, candidate, reference, _ = _fake_search(26, {"n3", "n20"})
    back = F.fall_back(order, candidate, reference, cfg, before=0.5)[3]
    assert {"n3", "n20"} <= set(back) and len(back) < 21


def test_shrink_set_stays_within_its_budget():
    order, candidate, reference, calls = _fake_search(64, 40)  # no subset of 40 holds
    back, found = F._shrink_set(order[:40], candidate, reference, I.QuantConfig(), budget=5)
    assert back == order[:40] and found is None and len(calls) == 5


def test_agreement_counts_fp32_ties_as_agreeing_and_nothing_else():
    # Sample 0: the reference's top two 1e-5 apart on a logit scale of 10 (a tie, tolerance
    # 1e-3); sample 1: 0.5 apart. Picking the runner-up agrees on the tie only.
    reference = np.array([[10.0, 9.99999, 0.0], [10.0, 9.5, 0.0], [0.0, 1.0, 2.0]])
    got = np.array([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert C.tie_tolerance(reference) == pytest.approx(1e-3)
    assert C.disagrees(got, reference, C.tie_tolerance(reference)).tolist() == [False, True, False]
    assert C.agreement(got, reference) == pytest.approx(2 / 3)
    assert C.ties(reference) == 1
    # Exact argmax agreement where nothing ties; the third class of a tie still disagrees.
    assert C.agreement(reference, reference) == 1.0
    assert C.agreement(np.array([[0.0, 0.0, 1.0]]), reference[:1]) == 0.0

    # The early-stopping run counts the same disagreements as `agreement`.
    class Sess:
        def get_inputs(self):
            return [type("I", (), {"name": "x"})()]

        def run(self, _, feed):
            return [got[feed["x"]]]

    idx = np.arange(3)
    assert F.outputs_above(Sess(), idx, reference, floor=0.6, batch=1) is not None
    assert F.outputs_above(Sess(), idx, reference, floor=0.7, batch=1) is None


def test_expected_agreement_pairs_every_gap_with_every_change_by_hand():
    # Relative top-two gaps (gap / largest |logit|): 1/4, 1/2, 1. Under `got` sample 1's gap
    # shrinks by 0.3 of its scale (0.5 -> 0.2, still no flip), the others do not move. Every
    # sample keeps its class, but paired with sample 0's gap of 0.25 that change flips it:
    # 1 flip in 3 x 3 pairs.
    reference = np.array([[4.0, 3.0, 0.0], [2.0, 0.0, 1.0], [0.0, 5.0, 0.0]])
    got = np.array([[4.0, 3.0, 0.0], [2.0, 0.0, 1.6], [0.0, 5.0, 0.0]])
    assert C.agreement(got, reference) == 1.0
    estimate, low = C.expected_agreement(got, reference)
    assert estimate == pytest.approx(8 / 9)
    # The bound: a_i (share of changes that flip margin i) = 1/3, 0, 0; b_j (share of margins
    # change j flips) = 0, 1/3, 0; var(a + b) = 1/27 (n - 1 in the denominator); se =
    # sqrt(1/27 / 3) = 1/9.
    assert low == pytest.approx(8 / 9 - C.Z95 / 9)
    assert not C.meets(got, reference, 0.71) and C.meets(got, reference, 0.70)
    # against the pairs counted one by one, on random logits
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((50, 4))
    out = ref + 0.3 * rng.standard_normal((50, 4))
    scale = np.abs(ref).max(1)
    first, second = ref.argmax(1), np.argsort(ref, 1)[:, -2]
    rows = np.arange(50)
    gap = (ref[rows, first] - ref[rows, second]) / scale
    margin = [out[i, first[i]] - np.delete(out[i], first[i]).max() for i in rows]
    change = margin / scale - gap
    assert sum(change + gap < 0) == round(50 * (1 - C.agreement(out, ref))) > 0  # own flips
    flips = sum(g + c < 0 for g in gap for c in change)
    estimate, low = C.expected_agreement(out, ref)
    assert estimate == pytest.approx(1 - flips / 2500)
    # the standard error against a bootstrap over the 50 samples
    draws = [C.expected_agreement(out[i], ref[i])[0] for i in rng.integers(0, 50, (400, 50))]
    assert (estimate - low) / C.Z95 == pytest.approx(np.std(draws), rel=0.2)
    assert C.expected_agreement(ref, ref) == (1.0, 1.0)  # no change, no flip
    # FP32 ties agree whatever the change; a flip to the third class counts (sample 1's margin
    # falls from 1 to -1: paired with its own gap it flips, with the tie's change of 0 not);
    # one class cannot flip; no outputs: NaN
    tied = np.array([[1.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    assert C.expected_agreement(tied[:, [1, 0, 2]], tied)[0] == pytest.approx(1 - 1 / 4)
    assert C.expected_agreement(np.ones((3, 1)), np.zeros((3, 1))) == (1.0, 1.0)
    assert np.isnan(C.expected_agreement(np.zeros((0, 3)), np.zeros((0, 3)))).all()


def test_fallback_that_cannot_reach_the_floor_is_a_stage_error():
    order, candidate, reference, _ = _fake_search(6, {"nowhere"})
    with pytest.raises(StageError, match=r"min_agreement 0.995: best 0.5000, even with all 6"):
        F.fall_back(order, candidate, reference, I.QuantConfig(), before=0.5)


def _onnx(tmp: Path, name: str, nodes, inits: dict[str, np.ndarray], x_shape) -> tuple:
    """A hand-written FP32 graph x -> ... -> y (no exporter: a fraction of a second), saved
    and `preprocess`ed: (fp32 path, prepared path)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", *x_shape])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    onnx.save(model, str(tmp / f"{name}.onnx"))
    return tmp / f"{name}.onnx", E.preprocess(tmp / f"{name}.onnx", tmp / f"{name}.prep.onnx")


def _outlier_mlp(tmp: Path) -> tuple:
    """A deep narrow ReLU MLP (6 Gemms, variance-preserving weights so the logits depend on the
    input) whose first input feature is unused: when that feature is huge in a few calibration
    samples, the input's INT8 scale rounds every other feature away, in the first Gemm only."""
    from onnx import helper

    rng = np.random.default_rng(0)
    dims = [12, 24, 24, 24, 24, 24, 6]
    nodes, inits, t = [], {}, "x"
    for k, (a, b) in enumerate(itertools.pairwise(dims)):
        inits[f"w{k}"] = rng.standard_normal((b, a)) * np.sqrt(2 / a)
        inits[f"b{k}"] = 0.1 * rng.standard_normal(b)
        out = "y" if k == len(dims) - 2 else f"h{k}"
        nodes.append(helper.make_node("Gemm", [t, f"w{k}", f"b{k}"], [out], f"fc{k}", transB=1))
        if out != "y":
            nodes.append(helper.make_node("Relu", [out], [f"r{k}"], f"relu{k}"))
            t = f"r{k}"
    inits["w0"][:, 0] = 0.0
    return _onnx(tmp, "outlier", nodes, inits, [12])


def test_the_fallback_search_says_how_it_goes(tmp_path, monkeypatch):
    """A 41M-weight BERT's INT8 step ran 98 s without a line; a ResNet-50's search 58 s."""
    fp32, prep = _outlier_mlp(tmp_path)
    x = np.random.default_rng(0).standard_normal((400, 12)).astype(np.float32)
    x[:4, 0] = 3000.0
    said = []
    monkeypatch.setattr(I, "PROGRESS_EVERY_S", 0.0)  # every candidate, for the test
    cfg = I.QuantConfig(min_agreement=0.97)
    I.choose(prep, fp32.read_bytes(), x[:100], x[100:], cfg, {"avx2"}, progress=said.append)
    head = "INT8 (u8s8 per-channel): finding the nodes that go back to FP32 for the floor: "
    assert said[0] == head + "candidate 1, 1 of 6 nodes back"
    assert said[-1] == head + "candidate 4, 1 of 6 nodes back"  # [fc5] alone, as the search
    assert len(said) == 4  # one per candidate searched (the record's "searched")
    said.clear()
    monkeypatch.setattr(I, "PROGRESS_EVERY_S", 3600.0)  # a short search: nothing to say
    I.choose(prep, fp32.read_bytes(), x[:100], x[100:], cfg, {"avx2"}, progress=said.append)
    assert said == []


def test_floor_holds_with_the_harmful_node_back_in_fp32_few_builds_silently(
    tmp_path, monkeypatch, capfd, caplog
):
    import logging

    fp32, prep = _outlier_mlp(tmp_path)
    x = np.random.default_rng(0).standard_normal((400, 12)).astype(np.float32)
    x[:4, 0] = 3000.0  # in the calibration inputs only
    cfg = I.QuantConfig(min_agreement=0.97)  # logits near ties: INT8 elsewhere flips a few
    builds = []
    real = Q.Quantizer.build
    monkeypatch.setattr(Q.Quantizer, "build", lambda *a, **k: builds.append(1) or real(*a, **k))
    capfd.readouterr()
    with caplog.at_level(logging.DEBUG):
        choice = I.choose(prep, fp32.read_bytes(), x[:100], x[100:], cfg, {"avx2"})
    out, err = capfd.readouterr()
    assert out == "" and err == ""  # neither ORT's Python warnings nor its C++ log
    assert not [r for r in caplog.records if "onnxruntime" in r.pathname]
    sel = choice.selection
    assert sel.agreement_before_fallback < 0.97 <= sel.agreement
    # the output layer goes first, then the harmful one (the largest own error): the prefix
    # [fc5, fc0] holds. fc0 alone holds 0.97 on these 300 samples but not the agreement
    # expected on new inputs (the head's INT8 noise still reaches the logits): both stay FP32.
    assert list(sel.fp32_nodes) == ["fc5", "fc0"]
    assert sel.fp32_nodes["fc0"].startswith("accuracy: with every node in INT8, top-1 agreement")
    assert sel.int8_nodes == 4 and choice.model is not None
    assert min(sel.agreement, sel.expected_low) >= 0.97 > sel.expected_low_before_fallback
    assert sel.expected >= sel.expected_low
    record = choice.candidates[[c["scheme"] for c in choice.candidates].index(sel.scheme.name)]
    # ours: all INT8, prefixes of 1 (fails) and 2 (holds), then [fc0] and [fc5] alone (the
    # tail first; both fail), made by surgery; then the file for the nodes found built by the
    # quantizer. The old search built 6 models to score the nodes and 1 a node fallen back.
    assert record["builds"] == 2 and record["searched"] == 4
    assert len(builds) == sum(c["builds"] for c in choice.candidates)
    # Both schemes miss the floor with every node in INT8: only one is searched (the search is
    # the step's cost), the other is reported and never ships. They stand equally close here,
    # so under the mobile target the one with uint8 activations (ours) is searched.
    other = next(c for c in choice.candidates if c is not record)
    assert other["searched"] == 0 and "within one check sample" in other["not_searched"]
    assert "not_searched" not in record
    assert all(
        c["builds"] <= 2 and c["searched"] <= 2 * 3 + F._budget(6) for c in choice.candidates
    )
    assert record["min_agreement"] == 0.97 and record["fallen_back"] == 2
    assert record["agreement_before_fallback"] < 0.97 and record["check_samples"] == 300
    assert record["expected_agreement"] == sel.expected
    got = C.outputs(C.session(choice.model.SerializeToString(), optimized=False), x[100:])
    ref = C.outputs(C.session(fp32.read_bytes(), optimized=False), x[100:])
    assert C.meets(got, ref, 0.97)  # the file as shipped holds the floor, both ways


def test_fp32_readers_get_back_the_relu_the_quantizer_folded_into_a_q(tmp_path):
    """ORT's quantizer drops a Relu after a quantized tensor (the Q's range clamps instead):
    a node back in FP32 reading that tensor must get the Relu back, or it reads negatives."""
    fp32, prep = _outlier_mlp(tmp_path)
    x = np.random.default_rng(0).standard_normal((64, 12)).astype(np.float32)
    q = Q.Quantizer(prep, x)
    scheme = I.scheme_for(I.QuantConfig(), False)
    assert "Relu" not in _ops(q.build(scheme))  # all INT8: every Relu folded into a Q
    only_first = q.build(scheme, q.nodes[1:])
    assert [n.name for n in Q.int8_compute_nodes(only_first.graph)] == ["fc0"]
    assert _ops(only_first).count("Relu") == 5
    onnx.checker.check_model(only_first, full_check=True)  # each Relu after its producer
    ref = C.outputs(C.session(fp32.read_bytes(), optimized=False), x)
    got = C.outputs(C.session(only_first.SerializeToString(), optimized=False), x)
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def test_a_second_rewrite_names_its_activation_copies_apart(tmp_path):
    """Two rewrites of one graph (rewiring FP32 readers, then stripping orphan Q/DQ pairs) each
    put activations back: the second must not reuse a node name the first gave. ORT refuses a
    graph with two nodes of one name; ResNet-18 under target host failed that way."""
    _, prep = _outlier_mlp(tmp_path)
    x = np.random.default_rng(0).standard_normal((64, 12)).astype(np.float32)
    q = Q.Quantizer(prep, x)
    model = q.build(I.scheme_for(I.QuantConfig(), False), q.nodes[1:])
    copies = [n for n in model.graph.node if n.op_type == "Relu" and n.name.endswith("_fp32")]
    assert copies  # the first rewrite put Relus back under "<relu>_fp32"
    original = onnx.load(str(prep))
    relu_out = {n.name: n.output[0] for n in original.graph.node if n.op_type == "Relu"}
    # A later rewrite asked for the same FP32 tensors (as if its readers had changed again).
    reads = Q._Fp32Reads(model.graph, original)
    reads.producer = {o: n for n in q.build(I.scheme_for(I.QuantConfig(), False)).graph.node
                      for o in n.output}  # fmt: skip
    for relu in copies:
        reads.name(relu_out[relu.name.removesuffix("_fp32")])
    names = [n.name for n in model.graph.node]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_the_quantizer_warns_through_logging_and_quiet_hides_it(tmp_path, caplog, monkeypatch):
    """ORT's quantizer logs 'Axis 1 is out-of-range ...' for per-channel LayerNorm weights;
    without `quiet` Python would print that on stderr."""
    import contextlib
    import logging

    from onnx import helper

    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], "fc1", transB=1),
        # one bias shared by a Gemm and a LayerNorm, as an exporter's deduplication leaves it
        helper.make_node("LayerNormalization", ["h", "g", "b1"], ["n"], "norm"),
        helper.make_node("Gemm", ["n", "w2", "b2"], ["y"], "fc2", transB=1),
    ]
    shapes = {"w1": (16, 8), "b1": (16,), "g": (16,), "w2": (4, 16), "b2": (4,)}
    inits = {k: rng.standard_normal(v) for k, v in shapes.items()}
    _, prep = _onnx(tmp_path, "norm", nodes, inits, [8])
    q = Q.Quantizer(prep, rng.standard_normal((16, 8)).astype(np.float32))
    scheme = I.scheme_for(I.QuantConfig(), False)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        q.build(scheme)
    assert not [r for r in caplog.records if "onnxruntime" in r.pathname]
    monkeypatch.setattr(Q, "quiet", lambda stdout=False: contextlib.nullcontext())
    with caplog.at_level(logging.WARNING):
        q.build(scheme)
    assert any("out-of-range" in r.getMessage() for r in caplog.records)  # what quiet hides
    # The quantizer names the shared bias's DequantizeLinear output "b1": with every node in
    # FP32 the FP32 bias comes back under another name, and the file loads.
    fp32 = q.build(scheme, q.nodes)
    assert not {"QuantizeLinear", "DequantizeLinear"} & set(_ops(fp32))
    C.session(fp32.SerializeToString(), optimized=False)


# --- (N, L, D) tensors and int64 token inputs ------------------------------------------------


class _Tokens(nn.Module):
    """Token ids -> embedding -> Linear on (N, L, D) (MatMul + Add) -> attention-like
    scaled MatMul between activations -> mean -> head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.qk, self.head = nn.Embedding(40, 8), nn.Linear(8, 16), nn.Linear(8, 4)

    def forward(self, ids):
        q, k = self.qk(self.emb(ids)).chunk(2, -1)
        a = torch.softmax((q * 0.5) @ k.transpose(1, 2), -1)
        return self.head((a @ k).mean(1))


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tok")
    ids = torch.randint(0, 40, (2, 6))
    fp32 = E.export_onnx(_Tokens().eval(), ids, tmp / "f.onnx", E.ExportConfig())
    x = np.random.default_rng(0).integers(0, 40, (200, 6)).astype(np.int64)
    return fp32, E.preprocess(fp32, tmp / "p.onnx"), x


def test_int64_token_inputs_go_through_the_choice(tokens):
    fp32, prep, x = tokens
    cfg = I.QuantConfig(min_agreement=1.0)
    a = I.choose(prep, fp32.read_bytes(), x[:64], x[64:], cfg, {"avx2"})
    b = I.choose(prep, fp32.read_bytes(), x[:64], x[64:], cfg, {"avx2"})
    assert a.selection.agreement == 1.0
    to_bytes = [c.model.SerializeToString() if c.model else b"" for c in (a, b)]
    assert to_bytes[0] == to_bytes[1]  # deterministic with token inputs too


def test_every_node_excluded_is_the_fp32_graph_even_after_quantized_glue(tokens):
    """The attention MatMul reads a scaling Mul's output: ORT's quantizer quantizes that Mul
    even when the MatMul is excluded, which left the MatMul reading Q/DQ (INT8 after all)."""
    _, prep, x = tokens
    q = Q.Quantizer(prep, x[:32])
    model = q.build(I.scheme_for(I.QuantConfig(), False), q.nodes)
    assert not Q.int8_compute_nodes(model.graph)
    assert not {"QuantizeLinear", "DequantizeLinear"} & set(_ops(model))


def test_bias_correction_of_a_matmul_on_n_l_d_tensors_uses_the_last_axis(tokens, tmp_path):
    _, prep, ids = tokens
    q = Q.Quantizer(prep, ids[:128])
    qdq = q.build(Q.ORT_DEFAULT)
    errors = B.node_errors(qdq, q.model, ids[:128], optimized=False)
    linear = next(n for n in q.model.graph.node if n.op_type == "MatMul")  # (N, L, 8) x (8, 16)
    assert errors[linear.name].shift.shape == (16,)  # one per output feature, not per token
    fixed, n = B.correct_bias(qdq, q.model, ids[:128], optimized=False)
    assert n == 2  # the Linear's MatMul + Add and the head's Gemm; not the activation MatMuls
    onnx.checker.check_model(fixed, full_check=True)

    # A Linear on (N, L, D) exports as MatMul + Add: the Add's bias absorbs the shift.
    from onnx import helper

    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"], "matmul"),
        helper.make_node("Add", ["m", "b"], ["y"], "add"),
    ]
    inits = {"w": rng.standard_normal((16, 4)) / 4, "b": rng.standard_normal(4) / 4}
    _, prep = _onnx(tmp_path, "linear3d", nodes, inits, [5, 16])
    x = (rng.standard_normal((128, 5, 16)) + 2.0).astype(np.float32)
    q = Q.Quantizer(prep, x)
    assert [n.op_type for n in q.model.graph.node] == ["MatMul", "Add"]
    qdq = q.build(Q.ORT_DEFAULT)  # per-tensor: a visible shift per channel
    fixed, n = B.correct_bias(qdq, q.model, x, optimized=False)
    assert n == 1
    add = q.model.graph.node[1].output[0]
    ref = B._run_with(q.model, [add], x, False)[0]
    shift = [np.abs((B._run_with(m, [add], x, False)[0] - ref).mean((0, 1))) for m in (qdq, fixed)]
    assert shift[1].sum() < 0.5 * shift[0].sum(), shift


def test_check_sessions_run_at_torchs_thread_count(prepared, monkeypatch):
    """The last bits of ORT's outputs can depend on its thread count (LeNet-300-100's INT8
    file: 1.9e-6 between 1 and 2 threads), so check and decision sessions run at torch's
    count, the one the README names as the condition for the same files."""
    import torch

    fp32, _, _ = prepared
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            s = C.session(fp32.read_bytes(), optimized=False)
            assert s.get_session_options().intra_op_num_threads == n
        assert (
            C.session(fp32.read_bytes(), False, threads=1)
            .get_session_options()
            .intra_op_num_threads
            == 1
        )
    finally:
        torch.set_num_threads(before)


def test_node_errors_are_the_same_whatever_the_batch(prepared):
    """node_errors reduces in the graph, 64 samples a run, twins placed after their originals:
    the sums must not depend on how the samples were cut."""
    _, prep, calib = prepared
    q = Q.Quantizer(prep, calib)
    m = q.build(I.scheme_for(I.QuantConfig(), False))
    x = np.random.default_rng(2).random((130, 1, 8, 8), dtype=np.float32)
    whole = B.node_errors(m, q.model, x, optimized=False)
    parts = [B.node_errors(m, q.model, x[i : i + 10], optimized=False) for i in range(0, 130, 10)]
    assert whole and set(whole) == set(parts[0])
    for name, e in whole.items():
        assert e.nmse > 0
        if e.shift is not None:
            mean = sum(p[name].shift * 10 for p in parts) / 130
            np.testing.assert_allclose(e.shift, mean, rtol=1e-5, atol=1e-7)


def test_surgery_candidates_equal_the_quantizers_own_files(prepared):
    """`Quantizer.without` (the fallback search's candidates) against `build` with the same
    nodes excluded, for every subset of the residual model's nodes: same INT8 nodes, same
    outputs. Subsets that exclude the head (it feeds the graph output) and a conv whose ReLU the
    quantizer folded (put back for its FP32 reader) once left a Q/DQ pair beside its renamed
    producer: "Duplicate definition of name"."""
    _, prep, calib = prepared
    q = Q.Quantizer(prep, calib)
    scheme = I.scheme_for(I.QuantConfig(), False)
    full = q.build(scheme)
    x = np.random.default_rng(3).random((64, 1, 8, 8), dtype=np.float32)
    for k in range(1, len(q.nodes) + 1):
        for ex in itertools.combinations(q.nodes, k):
            a, b = q.build(scheme, ex), q.without(full, ex)
            onnx.checker.check_model(b)
            assert len(Q.int8_compute_nodes(b.graph)) == len(Q.int8_compute_nodes(a.graph))
            got = C.outputs(C.session(b.SerializeToString(), optimized=False), x)
            want = C.outputs(C.session(a.SerializeToString(), optimized=False), x)
            np.testing.assert_array_equal(got, want)


def test_only_a_scheme_that_can_still_win_is_searched():
    def st(name, floor, holds):
        return I._Started(Q.Scheme(name, "QInt8", "QInt8", False), floor, holds, lambda why: None)

    ours, ort = "u8s8 per-channel", "ort-default"
    # both hold: neither needs a search
    assert I._searched([st(ours, 0.999, True), st(ort, 0.998, True)]) == ["", ""]
    # one holds with every node INT8: the other could only end with fewer
    why = I._searched([st(ours, 0.97, False), st(ort, 0.996, True)])
    assert why[1] == "" and "while ort-default holds it" in why[0] and "0.9700" in why[0]
    # both miss: the closer one is searched; ties go to the recipe's own scheme (first)
    why = I._searched([st(ours, 0.95, False), st(ort, 0.98, False)])
    assert why[1] == "" and "(0.9800 vs 0.9500)" in why[0]
    assert I._searched([st(ours, 0.98, False), st(ort, 0.98, False)])[0] == ""


def test_within_one_check_sample_the_uint8_scheme_is_searched_for_mobile():
    # A KWS model's s8s8 file stood 0.0002 closer to the floor on 60 samples and shipped
    # NNAPI "no" under the mobile target; one sample's worth apart is a tie there.
    def st(name, activation, floor):
        return I._Started(Q.Scheme(name, activation, "QInt8", False), floor, False, lambda w: None)

    s8 = st("ort-default s8s8 per-tensor", "QInt8", 0.9827)
    u8 = st("u8s8 per-channel", "QUInt8", 0.9825)
    why = I._searched([s8, u8], tie=1 / 60)
    assert why[1] == "" and "within one check sample" in why[0] and "uint8 activations" in why[0]
    # without the tie (the host target) the closer one is searched, as before
    why = I._searched([s8, u8])
    assert why[0] == "" and "stands closer to it (0.9827 vs 0.9825)" in why[1]
    # further apart than one sample: the closer one, whatever its activations
    why = I._searched([st("s8", "QInt8", 0.99), st("u8", "QUInt8", 0.95)], tie=1 / 60)
    assert why[0] == "" and "stands closer" in why[1]


def test_activation_batch_sums_every_tensor_per_sample():
    from onnx import TensorProto, helper

    # x [N, 100] -> MatMul [N, 1000] -> Relu [N, 1000]: 2,000 floats per sample, twice for
    # headroom = 16,000 bytes.
    w = numpy_helper.from_array(np.zeros((100, 1000), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 100])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1000])],
        [w],
    )
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph))
    assert [v.name for v in model.graph.value_info] == ["h"]
    assert C.activation_batch(model, cap=64, budget=160_000) == 10
    assert C.activation_batch(model, cap=64, budget=1 << 30) == 64
    assert C.activation_batch(model, cap=64, budget=1) == 4  # never below `least`
    assert C.activation_batch(model, cap=2, budget=1) == 2  # nor above `cap`
    # A size shape inference left open is unknown: the cap (the fixed batch used before).
    model.graph.value_info[0].type.tensor_type.shape.dim[1].dim_param = "hidden"
    assert C.activation_batch(model, cap=64, budget=1) == 64
    model.graph.value_info[0].type.tensor_type.ClearField("shape")
    assert C.activation_batch(model, cap=64, budget=1) == 64
    assert C.activation_batch(model) == 32  # the default cap: calibration's old batch


def test_quantizer_calibrates_in_activation_sized_batches(prepared, monkeypatch):
    _, prep, calib = prepared
    seen = []
    reader = Q.reader
    monkeypatch.setattr(Q, "reader", lambda x, name, b: seen.append(b) or reader(x, name, b))
    assert C.activation_batch(onnx.load(str(prep))) == 32  # a tiny model: the cap
    sized = C.activation_batch
    monkeypatch.setattr(
        Q, "activation_batch", lambda model, sample=(): sized(model, budget=1, sample=sample)
    )
    q = Q.Quantizer(prep, calib)
    assert seen == [q.batch] == [4]
    # The same ranges whatever the batch: min and max over the same samples.
    monkeypatch.setattr(Q, "activation_batch", lambda model, sample=(): len(calib))
    whole = Q.Quantizer(prep, calib)
    assert seen[-1] == len(calib)
    assert whole.ranges.keys() == q.ranges.keys()
    for name in q.ranges:
        assert np.array_equal(whole.ranges[name].range_value, q.ranges[name].range_value), name


def _no_file(**figures):
    """A selection that ships no INT8 file, with the figures `no_int8_reason` reads."""
    return I.Selection(scheme=None, model=None, **figures)


def test_the_no_int8_reason_names_the_figure_that_missed_the_floor():
    # Counted agreement held (160 of 160) but the bound on new inputs did not: say so, not
    # "agreement 1.0000 below 0.995".
    bound = _no_file(
        fallen_back=26,
        agreement_before_fallback=1.0,
        expected_before_fallback=0.9955,
        expected_low_before_fallback=0.9905,
    )
    line = I.no_int8_reason(bound, 0.995)
    assert "1.0000 on the check inputs" in line
    assert "lower bound of 0.9905, below min_agreement 0.995" in line
    assert "all 26 INT8 nodes back in FP32" in line
    counted = _no_file(
        fallen_back=3,
        agreement_before_fallback=0.98,
        expected_low_before_fallback=0.97,
    )
    line = I.no_int8_reason(counted, 0.995)
    assert "top-1 agreement with FP32 0.9800, below min_agreement 0.995" in line
    assert "lower bound" not in line
    # The floor held with 3 nodes back, then host timing found the whole INT8 file slower:
    # that is the reason, not the floor.
    timed = "whole model: INT8 1.200 ms vs FP32 1.000 ms"
    slower = _no_file(
        fallen_back=3,
        agreement_before_fallback=0.99,
        fp32_nodes={"a": "accuracy: ...", "b": timed},
    )
    assert I.no_int8_reason(slower, 0.995) == timed
    one = I.Selection(scheme=None, model=None, fp32_nodes={"a": "INT8 slower", "b": "INT8 slower"})
    assert I.no_int8_reason(one, 0.995) == "INT8 slower"
    assert I.no_int8_reason(I.Selection(scheme=None, model=None), 0.995) == "no quantizable node"
    # Too few check samples for the floor to allow one disagreement: said, with the fix
    assert I.no_int8_reason(counted, 0.995, samples=200).endswith("back in FP32")
    assert I.no_int8_reason(counted, 0.9, samples=10).endswith("back in FP32")  # 9/10 holds
    assert I.no_int8_reason(counted, 0.995, samples=40).endswith(
        "back in FP32 (40 check samples: one disagreement is 2.5%, more than the 0.5% the floor "
        "allows; give more validation data, e.g. an npz x_val, or lower export.min_agreement)"
    )


def test_the_error_graphs_fp32_weights_go_beside_it_unchanged(tmp_path, prepared, monkeypatch):
    """`node_errors` writes the FP32 model's weights as external data from the model itself
    (no deep copy): the shell holds every other field, and the file saved reads back as the
    model, every initializer's values byte for byte."""
    import onnx
    from onnx import numpy_helper

    _, prep, calib = prepared
    ref = Q.Quantizer(prep, calib).model
    shell = protos.shell(ref)
    assert not shell.graph.initializer and shell.graph.node
    monkeypatch.setattr(protos, "_SMALL", 16)  # this model's weights are small: most go external
    path = tmp_path / "m.onnx"
    protos.save_beside(shell, ref.graph.initializer, path)
    stubs = onnx.load(str(path), load_external_data=False).graph.initializer
    external = [t.name for t in stubs if t.data_location == onnx.TensorProto.EXTERNAL]
    assert len(external) >= 3 and all(not t.raw_data for t in stubs if t.name in external)
    back = onnx.load(str(path))  # reads the external data in
    assert protos.shell(back).SerializeToString() == protos.shell(ref).SerializeToString()
    assert [t.name for t in back.graph.initializer] == [t.name for t in ref.graph.initializer]
    for got, want in zip(back.graph.initializer, ref.graph.initializer, strict=True):
        a, b = numpy_helper.to_array(got), numpy_helper.to_array(want)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_a_search_that_kept_under_half_in_int8_searches_again_by_effect(tmp_path, monkeypatch):
    """When the own-error order leaves fewer than half the nodes in INT8, each node's effect
    on the logits alone in INT8 orders a second search, whose result ships when it keeps more
    nodes in INT8. Here the first order is made useless (the harmful fc0 last, no delta
    debugging), so it puts all six nodes back; by effect, the head and fc0 go first and the
    other four stay INT8, as the own-error search finds on its own (test above)."""
    fp32, prep = _outlier_mlp(tmp_path)
    x = np.random.default_rng(0).standard_normal((400, 12)).astype(np.float32)
    x[:4, 0] = 3000.0
    cfg = I.QuantConfig(min_agreement=0.97)
    monkeypatch.setattr(I, "fallback_order", lambda errors, *a: sorted(errors, reverse=True))
    monkeypatch.setattr(F, "_budget", lambda n: 0)
    orders = []
    real = F.effect_order
    monkeypatch.setattr(I, "effect_order", lambda *a: orders.append(real(*a)) or orders[-1])
    choice = I.choose(prep, fp32.read_bytes(), x[:100], x[100:], cfg, {"avx2"})
    sel = choice.selection
    assert len(orders) == 1 and set(orders[0][:2]) == {"fc0", "fc5"}
    assert set(sel.fp32_nodes) == {"fc0", "fc5"} and sel.int8_nodes == 4
    assert all("largest effect on the logits alone in INT8" in w for w in sel.fp32_nodes.values())
    assert min(sel.agreement, sel.expected_low) >= 0.97
    record = choice.candidates[[c["scheme"] for c in choice.candidates].index(sel.scheme.name)]
    assert record["searched"] >= 6  # the six nodes alone, then the second search


def test_effect_order_puts_the_largest_effect_first_ties_in_graph_order():
    effects = {"c": 0.5, "a": 0.1, "b": 0.5, "d": 0.0}
    assert F.effect_order(effects, ["a", "b", "c", "d"]) == ["b", "c", "a", "d"]


def test_keep_only_deletes_in_place_in_order(prepared):
    """`protos.keep_only` drops the elements its predicate refuses, keeps the rest in order,
    and writes the bytes the copy-and-extend it replaced wrote (it deletes by index, so the
    arena holds no second copy of the kept weights)."""
    _, prep, calib = prepared
    a = Q.Quantizer(prep, calib).model
    b = copy.deepcopy(a)
    names = [t.name for t in a.graph.initializer]
    drop = set(names[::2])
    assert protos.keep_only(a.graph.initializer, lambda t: t.name not in drop) == len(drop)
    keep = [t for t in b.graph.initializer if t.name not in drop]
    del b.graph.initializer[:]
    b.graph.initializer.extend(keep)
    assert [t.name for t in a.graph.initializer] == [n for n in names if n not in drop]
    assert a.SerializeToString() == b.SerializeToString()
    assert protos.keep_only(a.graph.initializer, lambda t: True) == 0


def test_bias_shifts_in_place_match_the_copy(prepared):
    """`apply_bias_shifts_` (the fallback search's, in place) makes the file the copying
    `apply_bias_shifts` makes, and leaves the copy's source untouched."""
    _, prep, calib = prepared
    q = Q.Quantizer(prep, calib)
    built = q.build(I.scheme_for(I.QuantConfig(), False))
    errors = B.node_errors(built, q.model, calib, False, q.batch)
    before = built.SerializeToString()
    copied, n = B.apply_bias_shifts(built, errors)
    assert n > 0 and built.SerializeToString() == before
    assert B.apply_bias_shifts_(built, errors) == n
    assert built.SerializeToString() == copied.SerializeToString()


def test_preprocess_writes_what_orts_quant_pre_process_writes(
    tmp_path, monkeypatch, prepared, tokens
):
    """The lean pre-processing (weights beside the graph from the first step on) writes ORT's
    `quant_pre_process` file byte for byte, on a residual CNN and on a token model (an
    embedding read by Gather, MatMul weights), with its weights outside (the threshold
    lowered: these models are small), and without falling back to ORT's function."""
    from onnxruntime.quantization import shape_inference

    want = {}
    for fp32 in (prepared[0], tokens[0]):
        ref = tmp_path / f"{fp32.stem}-{fp32.parent.name}.ref.onnx"
        with E.errors_only():
            shape_inference.quant_pre_process(str(fp32), str(ref), skip_symbolic_shape=False)
        want[fp32] = ref.read_bytes()

    def refused(*args, **kwargs):
        raise AssertionError("fell back to ORT's quant_pre_process")

    monkeypatch.setattr(shape_inference, "quant_pre_process", refused)
    monkeypatch.setattr(protos, "_SMALL", 4)
    outside = []
    save = protos.save_beside
    monkeypatch.setattr(
        protos,
        "save_beside",
        lambda m, inits, path, only=None: (
            outside.append(len(only or ())) or save(m, inits, path, only)
        ),
    )
    for fp32, expected in want.items():
        got = E.preprocess(fp32, tmp_path / "lean.onnx").read_bytes()
        assert got == expected
    assert len(outside) == 2 and all(n >= 2 for n in outside)


def test_preprocess_falls_back_to_orts_function_where_the_lean_steps_fail(
    tmp_path, monkeypatch, prepared
):
    """A graph the lean steps cannot take (here: ORT's optimiser refuses it) goes through ORT's
    `quant_pre_process` instead, and the file is still ORT's."""
    import onnxruntime as ort
    from onnxruntime.quantization import shape_inference

    fp32 = prepared[0]
    ref = tmp_path / "ref.onnx"
    with E.errors_only():
        shape_inference.quant_pre_process(str(fp32), str(ref), skip_symbolic_shape=False)
    real = ort.InferenceSession

    def refusing(path, options=None, *args, **kwargs):
        target = str(getattr(options, "optimized_model_filepath", "") or "")
        if target and "pre.quant" not in target:  # ours, not ORT's own function's
            raise RuntimeError("optimiser refused the graph")
        return real(path, options, *args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", refusing)
    assert E.preprocess(fp32, tmp_path / "p.onnx").read_bytes() == ref.read_bytes()


def test_a_build_marks_tensors_as_orts_own_reload_did(prepared):
    """ORT's quantizer re-inferred (saved with external data and read back) every model it was
    given without its inference mark; `_shape_inferred` marks the model so that it does not,
    and `build` marks its copy's tensors as that reload did (`data_location` set where onnx
    read a tensor from outside), so an INT8 file that keeps FP32 weights has the same bytes."""
    import copy

    from onnxruntime.quantization.quant_utils import save_and_reload_model_with_shape_infer

    _, prep, calib = prepared
    q = Q.Quantizer(prep, calib)
    reloaded = save_and_reload_model_with_shape_infer(copy.deepcopy(q.model))
    mine = copy.deepcopy(q.model)
    Q._as_reloaded(mine)
    marked = [t.name for t in mine.graph.initializer if t.HasField("data_location")]
    assert marked  # the head's 3 x 256 weight at least
    assert [t.SerializeToString() for t in mine.graph.initializer] == [
        t.SerializeToString() for t in reloaded.graph.initializer
    ]


def test_a_tie_ships_uint8_activations():
    """The same INT8 nodes and agreement: the s8s8 file won on its logits' error (0.00395 vs
    0.00422 on a LeNet-5) and then ran on the CPU under NNAPI, which takes uint8 activations."""
    from compresskit.compressor.export.qdq import ORT_DEFAULT

    ours = I.Selection(I.scheme_for(I.QuantConfig(), False), None, agreement=0.99, mse=0.00422)
    ort = I.Selection(ORT_DEFAULT, None, agreement=0.99, mse=0.00395)
    ours.int8_nodes = ort.int8_nodes = 4
    assert max([ort, ours], key=I.preference) is ours
    assert max([ours, ort], key=I.preference) is ours
    ort.agreement = 0.995  # agreement still comes first
    assert max([ours, ort], key=I.preference) is ort
