"""Static INT8 (QDQ) files chosen for the device that runs them, reproducibly.

ONNX Runtime's own quantizer (`onnxruntime.quantization`) writes the Q/DQ nodes; this module
decides which Conv/Gemm/MatMul nodes keep INT8 and cleans what the quantizer leaves behind:

* **Calibrate once.** `Quantizer` runs the calibration pass one time and reuses its ranges for
  every candidate (nodes excluded, another scheme): a candidate then costs one graph rewrite,
  not one calibration (`quantize_static` calibrates on every call; the old chooser paid that
  once per node, which never finished on a 74-node ViT).
* **No orphan Q/DQ.** The quantizer also quantizes the glue around excluded nodes (residual
  Adds, ReduceMean, Reshape): with every Conv/Gemm in FP32 the file still held 8 Q/DQ pairs that
  cost accuracy and compute for nothing. `strip_orphan_qdq` removes every Q/DQ pair whose region
  (the nodes it connects through quantized tensors) holds no INT8 compute node; a file with no
  INT8 compute left is the FP32 graph, and the caller does not ship it as "INT8".
* **Two targets.** `mobile` (default) times nothing: INT8 everywhere the top-1 agreement with
  FP32 holds `min_agreement`, judged on the file's reference semantics (ORT with graph
  optimizations off, which is what onnxruntime-web and other runtimes compute); nodes return to
  FP32 only for accuracy, most harmful first (a fixed, measured order), so two builds write the
  same bytes. `host` is latency-aware for the machine that builds: node groups go back to FP32
  only when repeated interleaved timings put FP32 faster with the whole 95% bootstrap interval
  of the paired ratio below 1 - margin (`fp32_clearly_faster`), so load noise keeps INT8.
* **Bias correction.** Each INT8 Conv/Gemm's bias absorbs the mean shift quantization puts on
  its outputs (`correct_bias`), kept only when the check inputs say the file got closer to FP32.
* **Never worse than ORT's defaults.** The same selection runs for ORT's default static scheme
  (S8S8, per-tensor); the file with more INT8 nodes ships, then the one agreeing more with FP32,
  then the one whose logits are closer to FP32 (mean squared error).

Why reference semantics decide for `mobile`: on an x86 CPU with AVX2 but no VNNI, ORT's fused
u8s8 kernels can saturate (vpmaddubsw) and put INT8 logits far from FP32 (4.07 vs 0.55 as
written; KNOW-HOW); a phone never runs those kernels. `reduce_range` (7-bit weights) avoids the
saturation: `auto` turns it on for `host` builds on such CPUs.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from compressor import stats
from compressor.export import compat
from models.errors import InputError

QUANTIZABLE = ("Conv", "Gemm", "MatMul")
METHODS = ("minmax", "entropy", "percentile")
TARGETS = ("mobile", "host")
SCHEMES = ("u8s8", "u8u8")
# host: FP32 replaces INT8 only when the whole 95% interval of the paired latency ratio
# FP32/INT8 lies below 1 - MARGIN.
MARGIN = 0.05
ROUNDS = 9  # paired timing rounds per decision
ROUND_S = 0.08  # seconds of interleaved runs per round


@dataclass(frozen=True)
class QuantConfig:
    """Static INT8 quantization.

    calibration: samples the ranges come from; method: minmax, entropy or percentile;
    target: "mobile" (nothing timed, reproducible) or "host" (latency-aware for this machine);
    scheme: "u8s8" (uint8 activations, int8 weights) or "u8u8"; reduce_range: 7-bit weights,
    "auto" = on for target host on an x86 CPU without VNNI; min_agreement: top-1 agreement
    with FP32 below which nodes go back to FP32; batch: the batch host timing uses."""

    calibration: int = 256
    method: str = "minmax"
    per_channel: bool = True
    target: str = "mobile"
    scheme: str = "u8s8"
    reduce_range: bool | str = "auto"
    min_agreement: float = 0.995
    batch: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InputError(f"quantization method {self.method!r}: one of {', '.join(METHODS)}")
        if self.target not in TARGETS:
            raise InputError(f"target {self.target!r}: one of {', '.join(TARGETS)}")
        if self.scheme not in SCHEMES:
            raise InputError(f"scheme {self.scheme!r}: one of {', '.join(SCHEMES)}")
        if self.reduce_range not in (True, False, "auto"):
            raise InputError(f'reduce_range {self.reduce_range!r}: true, false or "auto"')
        if self.reduce_range is True and self.scheme != "u8s8":
            raise InputError(
                f"reduce_range = true needs int8 weights (scheme u8s8), not {self.scheme}; "
                "drop reduce_range or use scheme u8s8"
            )
        if self.calibration < 1:
            raise InputError(f"calibration samples {self.calibration}: give 1 or more")
        if not 0 <= self.min_agreement <= 1:
            raise InputError(f"min_agreement {self.min_agreement}: a fraction in [0, 1]")


def saturating_cpu(flags: set[str]) -> bool:
    """x86 with AVX2 but no VNNI: ORT's u8s8 kernels there use vpmaddubsw, whose int16
    intermediate sums can saturate, so results differ from the file's reference semantics."""
    return "avx2" in flags and not ({"avx512_vnni", "avx_vnni"} & flags)


def resolve_reduce_range(cfg: QuantConfig, flags: set[str]) -> bool:
    if cfg.reduce_range == "auto":
        return cfg.target == "host" and cfg.scheme == "u8s8" and saturating_cpu(flags)
    return bool(cfg.reduce_range)


@dataclass(frozen=True)
class Scheme:
    """How tensors are quantized: ours (U8S8/U8U8, per-channel) or ORT's defaults."""

    name: str
    activation: str  # "QUInt8" | "QInt8"
    weight: str
    per_channel: bool
    reduce_range: bool = False


ORT_DEFAULT = Scheme("ort-default s8s8 per-tensor", "QInt8", "QInt8", per_channel=False)


def scheme_for(cfg: QuantConfig, reduce_range: bool) -> Scheme:
    weight = "QInt8" if cfg.scheme == "u8s8" else "QUInt8"
    channel = "per-channel" if cfg.per_channel else "per-tensor"
    rr = ", 7-bit weights" if reduce_range else ""
    return Scheme(f"{cfg.scheme} {channel}{rr}", "QUInt8", weight, cfg.per_channel, reduce_range)


# --- sessions: the file's reference semantics vs this host's kernels -------------------------


def session(model: bytes | str | Path, optimized: bool, threads: int = 1):
    """ORT CPU session. optimized=False runs the graph as written (no fusion into integer
    kernels): the reference semantics; True is what this host's ORT does by default."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    if not optimized:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    src = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])


def outputs(sess, x: np.ndarray, batch: int = 256) -> np.ndarray:
    """The first output of `sess` for inputs `x`, run `batch` samples at a time."""
    name = sess.get_inputs()[0].name
    parts = [sess.run(None, {name: x[i : i + batch]})[0] for i in range(0, len(x), batch)]
    return np.concatenate(parts) if parts else np.zeros((0,))


def agreement(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(a.argmax(1) == b.argmax(1)))


# --- the quantizer, calibrated once ----------------------------------------------------------


def _reader(x: np.ndarray, input_name: str, batch: int = 32):
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([{input_name: x[i : i + batch]} for i in range(0, len(x), batch)])

        def get_next(self):
            return next(self.batches, None)

    return Reader()


class Quantizer:
    """ORT's QDQ quantizer over one `quant_pre_process`ed model, calibrated once."""

    def __init__(self, prepared: Path, calib: np.ndarray, method: str = "minmax") -> None:
        import onnx
        from onnxruntime.quantization import CalibrationMethod
        from onnxruntime.quantization.calibrate import create_calibrator
        from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

        # Sorted: a set's order changes between processes, and the files must not.
        self.op_types = sorted(set(QLinearOpsRegistry) | set(QDQRegistry))
        self.model = onnx.load(str(prepared))
        name = self.model.graph.input[0].name
        with tempfile.TemporaryDirectory() as tmp:
            calibrator = create_calibrator(
                Path(prepared),
                self.op_types,
                augmented_model_path=str(Path(tmp) / "augmented.onnx"),
                calibrate_method={
                    "minmax": CalibrationMethod.MinMax,
                    "entropy": CalibrationMethod.Entropy,
                    "percentile": CalibrationMethod.Percentile,
                }[method],
            )
            calibrator.collect_data(_reader(calib, name))
            self.ranges = calibrator.compute_data()
            del calibrator
        self.calib = calib  # bias correction measures on the same inputs
        self.nodes = [n.name for n in self.model.graph.node if n.op_type in QUANTIZABLE]

    def build(self, scheme: Scheme, exclude: Sequence[str] = (), ir_version: int | None = None):
        """The QDQ model with `exclude` in FP32, orphan Q/DQ removed, only used opsets
        imported, `ir_version` stamped; a new ModelProto (the calibrated model is untouched)."""
        from onnxruntime.quantization import QuantType
        from onnxruntime.quantization.qdq_quantizer import QDQQuantizer

        model = copy.deepcopy(self.model)
        q = QDQQuantizer(
            model,
            scheme.per_channel,
            scheme.reduce_range,
            getattr(QuantType, scheme.weight),
            getattr(QuantType, scheme.activation),
            self.ranges,
            [],
            list(exclude),
            self.op_types,
            {},
        )
        q.quantize_model()
        q.model.topological_sort()  # as quantize_static does before it saves
        for init in q.model.model.graph.initializer:
            q.model._check_init(init, "end")  # the same final check quantize_static makes
        out = q.model.model
        strip_orphan_qdq(out)
        compat.keep_used_opsets(out)
        if ir_version is not None:
            out.ir_version = ir_version
        return out


# --- orphan Q/DQ ------------------------------------------------------------------------------


def int8_compute_nodes(graph) -> list:
    """Conv/Gemm/MatMul nodes whose first two inputs come from DequantizeLinear: they run in
    INT8 (ORT fuses DQ -> op into an integer kernel)."""
    producer = {o: n for n in graph.node for o in n.output}
    out = []
    for n in graph.node:
        if n.op_type in QUANTIZABLE and len(n.input) >= 2:
            src = [producer.get(i) for i in n.input[:2]]
            if all(p is not None and p.op_type == "DequantizeLinear" for p in src):
                out.append(n)
    return out


def strip_orphan_qdq(model) -> int:
    """Remove activation Q -> DQ pairs that serve no INT8 compute node; returns pairs removed.

    Nodes other than Q/DQ are joined into regions through quantized tensors (producer -> Q ->
    DQ -> consumers). A region with no INT8 compute node only ever converts FP32 to INT8 and
    back: every pair in it goes, its consumers read the FP32 tensor again. Weight DQs (fed by an
    initializer) belong to their compute node and stay with it."""
    graph = model.graph
    inits = {t.name for t in graph.initializer}
    nodes = list(graph.node)
    producer = {o: n for n in nodes for o in n.output}
    consumers: dict[str, list] = {}
    for n in nodes:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    outputs = {o.name for o in graph.output}

    parent: dict[int | str, int | str] = {}

    def find(k: int | str) -> int | str:
        while parent.setdefault(k, k) != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    def union(a: int | str, b: int | str) -> None:
        parent[find(a)] = find(b)

    # A graph input or output is an end of its own (keyed by its tensor name), never INT8.
    pairs = []  # (q, [dq...], one end)
    for q in nodes:
        if q.op_type != "QuantizeLinear" or q.input[0] in inits:
            continue
        dqs = [c for c in consumers.get(q.output[0], []) if c.op_type == "DequantizeLinear"]
        if len(dqs) != len(consumers.get(q.output[0], [])) or q.output[0] in outputs:
            continue  # Q output read by something other than DQ: leave it alone
        src = producer.get(q.input[0])
        ends: list[int | str] = [id(src) if src is not None else "in:" + q.input[0]]
        for dq in dqs:
            ends += [id(c) for c in consumers.get(dq.output[0], [])]
            if dq.output[0] in outputs:
                ends.append("out:" + dq.output[0])
        for e in ends[1:]:
            union(ends[0], e)
        pairs.append((q, dqs, ends[0]))
    live = {find(id(n)) for n in int8_compute_nodes(graph)}
    removed = 0
    drop: set[int] = set()
    for q, dqs, end in pairs:
        if find(end) in live:
            continue
        fp32 = q.input[0]
        for dq in dqs:
            for c in consumers.get(dq.output[0], []):
                for k, name in enumerate(c.input):
                    if name == dq.output[0]:
                        c.input[k] = fp32
            if dq.output[0] in outputs:  # keep the graph's output name: the producer takes it
                _rename(graph, fp32, dq.output[0])
                fp32 = dq.output[0]
            drop.add(id(dq))
        drop.add(id(q))
        removed += 1
    if drop:
        keep = [n for n in graph.node if id(n) not in drop]
        del graph.node[:]
        graph.node.extend(keep)
        used = {i for n in graph.node for i in n.input}
        unused = [t for t in graph.initializer if t.name not in used]
        for t in unused:
            graph.initializer.remove(t)
        _drop_value_info(graph)
    return removed


def _rename(graph, old: str, new: str) -> None:
    for n in graph.node:
        for k, name in enumerate(n.output):
            if name == old:
                n.output[k] = new
        for k, name in enumerate(n.input):
            if name == old:
                n.input[k] = new


def _drop_value_info(graph) -> None:
    """value_info entries of tensors that no longer exist (they would fail the checker)."""
    live = {o for n in graph.node for o in n.output}
    keep = [v for v in graph.value_info if v.name in live]
    del graph.value_info[:]
    graph.value_info.extend(keep)


# --- bias correction ---------------------------------------------------------------------------


def correct_bias(model, fp32: bytes, x: np.ndarray, optimized: bool) -> tuple[Any, int]:
    """Empirical bias correction (Nagel et al., "Data-Free Quantization", ICCV 2019, §4.2;
    NNCF's default does the same): quantization shifts the mean output of each channel of an
    INT8 Conv/Gemm; subtract that shift, measured on `x` against the FP32 model, from the
    layer's int32 bias. Layers are corrected in graph order, each measured after the ones
    before it, so a correction never counts an upstream error twice. Returns a new model and
    the number of layers corrected (those with a quantized bias)."""
    import onnx
    from onnx import TensorProto, numpy_helper

    model = copy.deepcopy(model)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    layers = []  # (node name, its output in the INT8 graph, bias initializer, bias scale)
    for n in int8_compute_nodes(graph):
        dq = producer.get(n.input[2]) if len(n.input) > 2 else None
        quantized_bias = (
            dq is not None
            and dq.op_type == "DequantizeLinear"
            and dq.input[0] in inits
            and dq.input[1] in inits
            and inits[dq.input[0]].data_type == TensorProto.INT32
        )
        if quantized_bias:
            layers.append((n.name, n.output[0], inits[dq.input[0]], inits[dq.input[1]]))
    if not layers:
        return model, 0
    ref_model = onnx.load_from_string(fp32)
    ref_out = {n.name: n.output[0] for n in ref_model.graph.node}
    names = [ref_out.get(name) for name, *_ in layers]
    if None in names:  # a node the INT8 graph has and the FP32 graph lacks: leave it be
        return model, 0
    ref = _run_with(ref_model, names, x, optimized)
    for k, (_, out, bias, scale) in enumerate(layers):
        got = _run_with(model, [out], x, optimized)[0]
        axes = tuple(a for a in range(got.ndim) if a != 1)  # channel axis 1 (NCHW, N x C)
        shift = (got.astype(np.float64) - ref[k]).mean(axis=axes)
        s = numpy_helper.to_array(scale).astype(np.float64)
        b = numpy_helper.to_array(bias).astype(np.float64) - np.rint(shift / s)
        b = np.clip(b, np.iinfo(np.int32).min, np.iinfo(np.int32).max).astype(np.int32)
        bias.CopyFrom(numpy_helper.from_array(b, bias.name))
    return model, len(layers)


def _run_with(model, names: list[str], x: np.ndarray, optimized: bool) -> list[np.ndarray]:
    """The values of tensors `names` for inputs `x`, by exposing them as graph outputs."""
    from onnx import TensorProto, helper

    m = copy.deepcopy(model)
    have = {o.name for o in m.graph.output}
    m.graph.output.extend(
        helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names if n not in have
    )
    sess = session(m.SerializeToString(), optimized)
    inp = sess.get_inputs()[0].name
    idx = [[o.name for o in sess.get_outputs()].index(n) for n in names]
    parts = [sess.run(None, {inp: x[i : i + 256]}) for i in range(0, len(x), 256)]
    return [np.concatenate([p[j] for p in parts]).astype(np.float64) for j in idx]


# --- host timing: a decision that does not flip under load ----------------------------------


def fp32_clearly_faster(
    fp32_s: Sequence[float], int8_s: Sequence[float], margin: float = MARGIN
) -> bool:
    """True when FP32 is faster beyond noise: paired per-round ratios FP32/INT8, and the whole
    95% bootstrap interval of their median below 1 - margin. Noisy or equal timings -> False
    (INT8 stays: the smaller file, and the one a phone's INT8 kernels favour)."""
    a, b = np.asarray(fp32_s, dtype=float), np.asarray(int8_s, dtype=float)
    if a.shape != b.shape or a.size < 3:
        raise ValueError("fp32_clearly_faster needs paired samples, 3 rounds or more")
    _, hi = stats.bootstrap_ci(a / b, np.median)
    return hi < 1.0 - margin


def paired_rounds(models: Sequence[bytes], x: np.ndarray, rounds: int | None = None) -> np.ndarray:
    """[rounds, len(models)] median seconds per call, the models interleaved in each round
    (ROUNDS rounds unless given)."""
    from compressor import benchmark

    rounds = rounds or ROUNDS
    sessions = [session(m, optimized=True) for m in models]
    name = sessions[0].get_inputs()[0].name
    calls = [(lambda s=s: s.run(None, {name: x})) for s in sessions]
    out = np.empty((rounds, len(models)))
    for r in range(rounds):
        times = benchmark.interleaved(calls, ROUND_S, min_runs=5, warmup=3 if r == 0 else 1)
        out[r] = [np.median(t) for t in times]
    return out


# --- the choice ----------------------------------------------------------------------------


@dataclass
class Selection:
    scheme: Scheme
    model: Any  # onnx.ModelProto
    fp32_nodes: dict[str, str] = field(default_factory=dict)  # node -> why it stayed FP32
    agreement: float = 1.0  # on the check inputs, in the target's semantics
    mse: float = 0.0  # mean squared logit error against FP32 there: the finer tie-breaker
    int8_nodes: int = 0
    bias_corrected: int = 0  # layers whose bias absorbed their quantization shift
    latency_ms: dict[str, float] | None = None  # host only: {"fp32", "int8"} p50 at cfg.batch


@dataclass
class Choice:
    """What ships: `model` (None when no INT8 compute is worth shipping) and the record."""

    model: Any
    selection: Selection
    candidates: list[dict[str, Any]]
    quantizable: int
    reduce_range: bool
    semantics: str  # "reference" (mobile) or "host"
    reason: str = ""  # why no INT8 file, when model is None


def choose(
    prepared: Path,
    fp32: bytes,
    calib: np.ndarray,
    check_x: np.ndarray,
    cfg: QuantConfig,
    cpu_flags: set[str],
    ir_version: int | None = None,
) -> Choice:
    """Pick the INT8 file for `cfg.target` among our scheme and ORT's default."""
    rr = resolve_reduce_range(cfg, cpu_flags)
    host = cfg.target == "host"
    q = Quantizer(prepared, calib, cfg.method)
    reference = outputs(session(fp32, optimized=host), check_x)
    timing_x = check_x[: cfg.batch] if len(check_x) >= cfg.batch else check_x
    selections = [
        _select(q, s, reference, check_x, timing_x, cfg, fp32, ir_version)
        for s in (scheme_for(cfg, rr), ORT_DEFAULT)
    ]
    candidates = [
        {
            "scheme": s.scheme.name,
            "int8_nodes": s.int8_nodes,
            "agreement": s.agreement,
            "mse": s.mse,
            "bias_corrected": s.bias_corrected,
        }
        for s in selections
    ]
    if host and all(s.latency_ms for s in selections) and selections[1].int8_nodes:
        ours, ort = (s.latency_ms["int8"] for s in selections)  # type: ignore[index]
        best = selections[0] if ours <= ort * (1 + MARGIN) else selections[1]
        closer = (selections[1].agreement, -selections[1].mse) > (best.agreement, -best.mse)
        if closer and ort <= ours * (1 + MARGIN):
            best = selections[1]
    else:  # more INT8 compute first, then agreement, then logits closer to FP32
        best = max(selections, key=lambda s: (s.int8_nodes, s.agreement, -s.mse))
    shipped = best.model if best.int8_nodes else None
    reason = ""
    if shipped is None:
        reason = "; ".join(sorted(set(best.fp32_nodes.values()))[:1]) or "no quantizable node"
    return Choice(
        shipped, best, candidates, len(q.nodes), rr, "host" if host else "reference", reason
    )


def _select(q: Quantizer, scheme, reference, x, timing_x, cfg, fp32, ir_version) -> Selection:
    host = cfg.target == "host"
    excluded: dict[str, str] = {}

    def build(extra: Sequence[str] = ()):
        model = q.build(scheme, [*excluded, *extra], ir_version)
        got = outputs(session(model.SerializeToString(), optimized=host), x)
        return model, got

    def closeness(got) -> tuple[float, float]:
        return agreement(got, reference), -float(np.mean((got - reference) ** 2))

    def finish(model, got):
        """Bias correction, kept only where the check inputs say INT8 got closer to FP32."""
        corrected, n = correct_bias(model, fp32, q.calib, host)
        if n:
            c_out = outputs(session(corrected.SerializeToString(), optimized=host), x)
            if closeness(c_out) > closeness(got):
                return corrected, c_out, n
        return model, got, 0

    model, got = build()
    latency = None
    if host:  # latency first: it does not depend on the bias values
        for group in _groups(q):
            if all(n in excluded for n in group):
                continue
            cand, cand_out = build(group)
            t = paired_rounds([cand.SerializeToString(), model.SerializeToString()], timing_x)
            if fp32_clearly_faster(t[:, 0], t[:, 1]):
                ms = 1000 * np.median(t, axis=0)
                for n in group:
                    excluded[n] = f"INT8 slower: {ms[1]:.3f} ms in INT8, {ms[0]:.3f} ms in FP32"
                model, got = cand, cand_out
    model, got, n_bias = finish(model, got)
    if agreement(got, reference) < cfg.min_agreement:
        model, got, n_bias = _fall_back(q, excluded, build, finish, reference, model, got, cfg)
    agree, mse = agreement(got, reference), float(np.mean((got - reference) ** 2))
    n_int8 = len(int8_compute_nodes(model.graph))
    if host:
        t = paired_rounds([fp32, model.SerializeToString()], timing_x)
        ms = 1000 * np.median(t, axis=0)
        latency = {"fp32": float(ms[0]), "int8": float(ms[1])}
        if n_int8 and fp32_clearly_faster(t[:, 0], t[:, 1]):
            why = f"whole model: INT8 {ms[1]:.3f} ms vs FP32 {ms[0]:.3f} ms"
            excluded.update({n: why for n in q.nodes if n not in excluded})
            model, agree, mse, n_int8 = q.build(scheme, list(excluded), ir_version), 1.0, 0.0, 0
            latency["int8"] = latency["fp32"]
    return Selection(scheme, model, excluded, agree, mse, n_int8, n_bias, latency)


def _fall_back(q, excluded, build, finish, reference, model, got, cfg):
    """Nodes back to FP32 until the agreement floor holds, most harmful first: the node whose
    FP32 copy brings the outputs closest to FP32 (mean squared error, ties in graph order).
    Deterministic: the order depends only on the model and the check inputs."""
    remaining = [n for n in q.nodes if n not in excluded]
    score = {}
    for n in remaining:
        _, out = build([n])
        score[n] = float(np.mean((out - reference) ** 2))
    order = sorted(remaining, key=lambda n: (score[n], q.nodes.index(n)))
    agree, n_bias = agreement(got, reference), 0
    for n in order:
        before = agree
        model, got, n_bias = finish(*build([n]))
        agree = agreement(got, reference)
        excluded[n] = f"accuracy: top-1 agreement {before:.4f} -> {agree:.4f} with it in FP32"
        if agree >= cfg.min_agreement:
            break
    return model, got, n_bias


def _groups(q: Quantizer) -> list[list[str]]:
    """Quantizable nodes grouped by op type and weight shape, in graph order: repeated blocks
    (a ViT's 12 identical layers) are timed once per shape, so host timing grows with the
    number of distinct layer shapes, not quadratically with depth."""
    inits = {t.name: tuple(t.dims) for t in q.model.graph.initializer}
    groups: dict[tuple, list[str]] = {}
    for n in q.model.graph.node:
        if n.op_type in QUANTIZABLE:
            key = (n.op_type, inits.get(n.input[1]) if len(n.input) > 1 else None)
            groups.setdefault(key, []).append(n.name)
    return list(groups.values())
