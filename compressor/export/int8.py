"""Static INT8 (QDQ) files chosen for the device that runs them, reproducibly.

ONNX Runtime's own quantizer (`onnxruntime.quantization`) writes the Q/DQ nodes; this module
decides which Conv/Gemm/MatMul nodes keep INT8 and cleans what the quantizer leaves behind:

* **Calibrate once.** `Quantizer` runs the calibration pass one time and reuses its ranges for
  every candidate (nodes excluded, another scheme): a candidate then costs one graph rewrite,
  not one calibration (`quantize_static` calibrates on every call; the old chooser paid that
  once per node, which never finished on a 74-node ViT).
* **No orphan Q/DQ, and excluded means FP32.** The quantizer also quantizes the glue around
  excluded nodes (residual Adds, ReduceMean, Reshape, a ViT's scaling Mul): with every Conv/Gemm
  in FP32 the file still held 8 Q/DQ pairs, and a ViT's "excluded" attention MatMuls read Q/DQ
  and ran in INT8 after all. Excluded nodes read FP32 tensors (`read_fp32`), `strip_orphan_qdq`
  removes every Q/DQ pair whose region (the nodes it connects through quantized tensors) holds
  no INT8 compute node, and nodes outside every INT8 region read their FP32 constants again
  (an embedding table); a file with no INT8 compute left is the FP32 graph, and the caller does
  not ship it as "INT8".
* **Two targets.** `mobile` (default) times nothing: INT8 everywhere the top-1 agreement with
  FP32 holds `min_agreement`, judged on the file's reference semantics (ORT with graph
  optimizations off, which is what onnxruntime-web and other runtimes compute). `host` is
  latency-aware for the machine that builds: node groups go back to FP32 only when repeated
  interleaved timings put FP32 faster with the whole 95% bootstrap interval of the paired
  ratio below 1 - margin (`fp32_clearly_faster`), so load noise keeps INT8.
* **The floor holds, in O(log N) candidates and two quantizer runs.** One session measures
  every INT8 node's own error (`node_errors`: a quantized twin of each node beside its FP32
  original, fed FP32 inputs); nodes return to FP32 in that order, largest error first, in
  prefixes of 1, 2, 4, ... until the floor holds, then bisection to the shortest prefix that
  holds, then delta debugging within that prefix (`_shrink_set`, about 2 log2 N more
  candidates) for the few nodes that matter when the order missed them: own error is not the
  error that reaches the logits. Each candidate is made from the all-INT8 file by graph
  surgery (`Quantizer.without`, ~0.05 s; the quantizer's rewrite took 2 s on EfficientNet-B0)
  and costs one run over the check inputs, cut short once the floor is out of reach; the file
  for the nodes found is then built by the quantizer and checked once more. A search that
  left fewer than half the nodes in INT8 runs again in the order of each node's effect on the
  logits with it alone in INT8 (N more runs, on the 32 most fragile check inputs;
  `effect_order`), and the result keeping more nodes in INT8 ships: EfficientNet-B0 kept 0
  of 82 nodes in own-error order and 26 in effect order at the same floor.
  The old chooser built and ran one model per node to score it, then one per node fallen back:
  138 builds and 139 sessions on a 4-block ViT, which then shipped at 0.965 < 0.995.
  Nothing depends on timing or on the order of a set: two builds write the same bytes. If even
  the all-FP32 graph misses the floor, the check itself is broken: StageError.
* **Ties are not disagreements.** A check sample whose FP32 top two logits lie within the FP32
  file's own tolerance (1e-4 of the logit scale) agrees whichever of the two INT8 picks
  (`disagrees`); the report counts such samples (`checked_on.fp32_ties`).
* **The floor holds on new inputs, not only on the check's.** The search stops at the first
  node set whose flips on the check inputs fit the floor, and so fits them: MobileNetV2's file
  held 1.0 on 160 validation inputs and 0.9875 on the test set. A candidate holds the floor
  when both the agreement counted on the check inputs and the one-sided 95% lower bound of
  the agreement expected on new ones do (`meets`); the expected one pairs every check
  sample's FP32 margin with every sample's INT8 change of its margin (`expected_agreement`,
  n^2 pairs for n samples), and tracked the test set on the model matrix (MobileNetV2 0.9908
  vs 0.9875, ViT-tiny 0.9930 vs 0.9925). The bound, because 160 validation samples hold few
  small margins: a rerun's EfficientNet-B0 estimated 0.9959 and agreed on 0.985 of test.
  Fewer check samples, a wider bound: more validation data keeps more nodes in INT8.
* **Bias correction.** Each INT8 Conv/Gemm's bias, or the bias Add after an INT8 MatMul (a
  Linear on (N, L, D) tensors), absorbs the mean shift quantization puts on its output channels
  (`correct_bias`; the channel is axis 1 for Conv/Gemm, the last axis for MatMul), kept only when
  the check inputs say the file got closer to FP32.
* **Quiet.** ORT's quantizer logs warnings through the root logger (which Python prints on
  stderr) and its calibrators print; `quiet` keeps that from the user, errors excepted.
* **Never worse than ORT's defaults.** The same selection runs for ORT's default static scheme
  (S8S8, per-tensor); the file with more INT8 nodes ships, then the one agreeing more with FP32,
  then the one whose logits are closer to FP32 (mean squared error).

Why reference semantics decide for `mobile`: on an x86 CPU with AVX2 but no VNNI, ORT's fused
u8s8 kernels can saturate (vpmaddubsw) and put INT8 logits far from FP32 (4.07 vs 0.55 as
written; KNOW-HOW); a phone never runs those kernels. `reduce_range` (7-bit weights) avoids the
saturation: `auto` turns it on for `host` builds on such CPUs.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from compresskit import _datapass
from compresskit.compressor import stats
from compresskit.compressor.export import compat, protos
from compresskit.models.errors import InputError, StageError

QUANTIZABLE = ("Conv", "Gemm", "MatMul")
METHODS = ("minmax", "entropy", "percentile")
TARGETS = ("mobile", "host")
SCHEMES = ("u8s8", "u8u8")
# host: FP32 replaces INT8 only when the whole 95% interval of the paired latency ratio
# FP32/INT8 lies below 1 - MARGIN.
MARGIN = 0.05
ROUNDS = 9  # paired timing rounds per decision
ROUND_S = 0.08  # seconds of interleaved runs per round
# Two classes whose reference logits are closer than TIE x the largest |logit| are a tie:
# the FP32 ONNX file's own tolerance against PyTorch (1e-4 of the logit scale).
TIE = 1e-4
Z95 = 1.6449  # one-sided 95%: the expected agreement's lower bound (`expected_agreement`)
FIRST_BATCH = 8  # the fallback search's first check batch; later ones double (`_outputs_above`)
# A fallback that left fewer than half the nodes in INT8 searches again in an order measured
# on the logits (`effect_order`), each node alone in INT8 on this many most fragile check inputs.
EFFECT_SAMPLES = 32
# Activation bytes one ORT run over calibration or check inputs may hold (`activation_batch`).
ORT_BUDGET = 32 << 20


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


def session(model: bytes | str | Path, optimized: bool, threads: int = 0, lean: bool = False):
    """ORT CPU session. optimized=False runs the graph as written (no fusion into integer
    kernels): the reference semantics; True is what this host's ORT does by default.
    `threads` 0 is ORT's default, one per physical core: outputs are bit-identical whatever
    the count (ORT's CPU kernels split work by output element, never a sum;
    tests/test_int8.py checks it), so only timing pins one thread (`paired_rounds`). `lean`:
    ORT's priority-based node order, which runs a node as soon as its inputs are ready and so
    frees them early (for graphs with many side branches, as `node_errors` builds)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if lean:
        opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    if not optimized:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    src = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])


def activation_batch(model, cap: int = 32, budget: int = ORT_BUDGET, least: int = 4) -> int:
    """Samples per ORT run over `model` (a shape-inferred ModelProto: `quant_pre_process`'s
    output) for its activations to stay within `budget`: twice the bytes per sample of every
    tensor the graph computes, `least` to `cap`. Why the sum and not the largest tensor: the
    calibration session (optimizations off, every tensor reduced) keeps them all. Measured on
    a 0.13M-weight residual CNN at 3x32x32 (5.0 MB of tensors per sample), calibration at 32
    samples a run peaked 338 MB over its start, at 8 samples 88 MB, and took no longer; on
    ViT-tiny (2 cores) 32 samples peaked 962 MB over in 2.6 s, 4 samples 205 MB in 2.4 s, and
    1 sample 176 MB in 3.1 s: below a few samples ORT's per-run cost shows, hence `least`.
    Where shape inference left a tensor's shape or a non-batch dimension open, the size is
    unknown: `cap`, the fixed batch used before (32 samples a calibration run)."""
    from onnx import helper

    per_sample = 0
    for v in [*model.graph.value_info, *model.graph.output]:
        t = v.type.tensor_type
        if not t.HasField("shape"):
            return cap
        size = 1
        for d in t.shape.dim[1:]:  # the first is the batch
            if d.dim_value <= 0:
                return cap
            size *= d.dim_value
        per_sample += size * helper.tensor_dtype_to_np_dtype(t.elem_type).itemsize
    if per_sample == 0:
        return cap
    return max(min(least, cap), min(cap, budget // (2 * per_sample)))


@_datapass.counted
def outputs(sess, x: np.ndarray, batch: int = 64) -> np.ndarray:
    """The first output of `sess` for inputs `x`, run `batch` samples at a time."""
    name = sess.get_inputs()[0].name
    parts = [sess.run(None, {name: x[i : i + batch]})[0] for i in range(0, len(x), batch)]
    return np.concatenate(parts) if parts else np.zeros((0,))


def tie_tolerance(reference: np.ndarray) -> float:
    """The logit gap below which the reference's top two classes are a tie: TIE x the
    reference's largest |logit|, the FP32 export's own parity tolerance (0 for no logits)."""
    return TIE * float(np.abs(reference).max()) if reference.size else 0.0


def disagrees(got: np.ndarray, reference: np.ndarray, tol: float) -> np.ndarray:
    """Per sample (class axis last): True where `got`'s top class is not the reference's.

    A class the reference scores within `tol` of its own top counts as the reference's top:
    such a sample is a tie that FP32 itself does not break (the FP32 file may differ from
    PyTorch by that much), so whichever of the tied classes INT8 picks says nothing about
    INT8. Why: a 90%-accurate ViT's check set held one sample with its top two logits 1.9e-4
    apart (the median gap was 4.3); 14 of its 26 nodes alone in INT8 flipped it, and with a
    160-sample check (a 0.995 floor allows no flip) no INT8 file could ship."""
    top = np.take_along_axis(reference, got.argmax(-1)[..., None], -1)[..., 0]
    return top < reference.max(-1) - tol


def agreement(got: np.ndarray, reference: np.ndarray) -> float:
    """Top-1 agreement of `got` with `reference` (class axis last), FP32 ties excepted
    (`disagrees`, with the tolerance `tie_tolerance(reference)`)."""
    if got.size == 0:
        return float("nan")
    return 1.0 - float(np.mean(disagrees(got, reference, tie_tolerance(reference))))


def expected_agreement(got: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """Top-1 agreement of `got` with `reference` expected on new inputs, and its one-sided 95%
    lower bound. Every sample's FP32 top-two gap is paired with every sample's change of its
    margin under `got` (FP32's top class over the closest other class), both relative to the
    sample's largest |logit|: the flip rate if the error did not depend on the margin.

    Why: a check of n samples counts the flips that happened to land on it, and the fallback
    search, which stops at the first node set whose count fits the floor, fits that count. On
    MobileNetV2 the file chosen held 1.0 on its 160 validation samples and 0.9875 on the 400
    test images; this estimate, n x n pairs instead of n samples, gave 0.9908 on the same 160
    (ViT-tiny 0.9930 vs 0.9925 on test, EfficientNet-B0 0.9963 vs 0.9975). Why the bound: the
    160 samples' few small margins are themselves a draw. An EfficientNet-B0 whose estimate was
    0.9959 agreed on 0.985 of the test set, whose margins under 0.05 were twice as frequent.
    The bound is the estimate less Z95 standard errors, from its first-order (Hoeffding)
    expansion: the variance of (a_i + b_i) / n, a_i the share of changes that flip margin i and
    b_i the share of margins change i flips; it matched a 400-draw bootstrap within 15% on seven
    shipped files. FP32 ties (`disagrees`) agree, as in `agreement`."""
    if got.size == 0:
        return float("nan"), float("nan")
    classes = reference.shape[-1]
    if classes < 2:
        return 1.0, 1.0
    ref, out = reference.reshape(-1, classes), got.reshape(-1, classes)
    n, rows = len(ref), np.arange(len(ref))
    second, first = np.argsort(ref, axis=1, kind="stable")[:, -2:].T
    scale = np.abs(ref).max(axis=1)
    scale = np.where(scale > 0, scale, 1.0)
    gap = (ref[rows, first] - ref[rows, second]) / scale
    # the margin of FP32's top class over its closest rival under `got` (any class, not only
    # FP32's runner-up): negative exactly where this sample flipped
    rival = out.copy()
    rival[rows, first] = -np.inf
    change = (out[rows, first] - rival.max(axis=1)) / scale - gap
    tie = gap * scale <= tie_tolerance(reference)  # ties agree whatever INT8 picks
    # pair (i, j) flips when gap_i + change_j < 0
    a = np.where(tie, 0.0, np.searchsorted(np.sort(change), -gap, side="left") / n)
    b = np.searchsorted(np.sort(gap[~tie]), -change, side="left") / n
    estimate = 1.0 - float(a.mean())
    se = float(np.sqrt(np.var(a + b, ddof=1) / n)) if n > 1 else 0.0
    return estimate, estimate - Z95 * se


def floor_agreement(got: np.ndarray, reference: np.ndarray) -> float:
    """The agreement the floor is judged on: the lower of the agreement counted on these
    samples and the 95% lower bound of the one expected on new inputs (`expected_agreement`)."""
    return min(agreement(got, reference), expected_agreement(got, reference)[1])


def meets(got: np.ndarray, reference: np.ndarray, floor: float) -> bool:
    """Whether `got` holds top-1 agreement `floor` with `reference` (`floor_agreement`)."""
    return floor_agreement(got, reference) >= floor


def ties(reference: np.ndarray) -> int:
    """How many samples of `reference` have their top two classes tied (`disagrees`)."""
    if reference.size == 0 or reference.shape[-1] < 2:  # one class: nothing to tie with
        return 0
    return int(np.sum(_top2_gap(reference) <= tie_tolerance(reference)))


# --- ORT's quantizer, kept quiet ---------------------------------------------------------------


class _OrtWarnings(logging.Filter):
    """Drops records below ERROR that onnxruntime's Python code logs through the root logger
    (the quantizer calls `logging.warning(...)`: 29 "Axis 1 is out-of-range for weight
    ...layernorm_before.weight" on a 4-block ViT), which Python prints on stderr when no
    handler is configured. Records from anywhere else pass untouched."""

    def __init__(self, package: str) -> None:
        super().__init__()
        self.package = package

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not record.pathname.startswith(self.package)


@contextlib.contextmanager
def quiet(stdout: bool = False) -> Iterator[None]:
    """ONNX Runtime's quantization stays silent but for errors while the block runs: its
    warnings through the root logger (filtered by origin, so the host's own records pass),
    its named loggers ("onnxruntime.*") raised to ERROR, and, with `stdout`, what its entropy
    and percentile calibrators print. ORT's C++ log is quiet through each session's
    log_severity_level (`session`, and the calibrator's session in `Quantizer`)."""
    import onnxruntime

    root, named = logging.getLogger(), logging.getLogger("onnxruntime")
    filt, level = _OrtWarnings(str(Path(onnxruntime.__file__).parent)), named.level
    root.addFilter(filt)
    named.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()) if stdout else contextlib.nullcontext():
            yield
    finally:
        root.removeFilter(filt)
        named.setLevel(level)


# --- the quantizer, calibrated once ----------------------------------------------------------


def _reader(x: np.ndarray, input_name: str, batch: int = 32):
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([{input_name: x[i : i + batch]} for i in range(0, len(x), batch)])

        def get_next(self):
            return next(self.batches, None)

    return Reader()


def op_types_for(model, registry: set[str]) -> list[str]:
    """The op types ORT may quantize in `model`: all it knows, or in an attention graph (one
    with a Softmax) only the compute nodes, Conv/Gemm/MatMul.

    Why: an attention block adds its padding mask (0 or about -3.4e38) to the scores before
    the Softmax; quantizing that Add's output spreads 256 levels over [-3.4e38, max] and every
    real score lands on zero. With every op type quantized, a trained 2-block `textcls` kept
    0.267 top-1 agreement with FP32 and needed 6 of 13 nodes back in FP32 to reach 0.995;
    with only the compute nodes it held the floor with all 13 in INT8. The compute nodes are
    where INT8 pays; the glue between them (Add, Mul, Softmax, LayerNorm) stays FP32, as
    ORT's own transformer recipes quantize MatMul/Gemm only. Sorted: a set's order changes
    between processes, and the files must not."""
    if any(n.op_type == "Softmax" for n in model.graph.node):
        return sorted(set(QUANTIZABLE) & registry)
    return sorted(registry)


def _as_reloaded(model) -> None:
    """Mark `model`'s tensors as ORT's quantizer's own re-inference left them, which it skips for
    a model `_shape_inferred` marked: it saved the model with every initializer of 1 KiB or more
    of raw data as external data (onnx's default threshold, `sys.getsizeof` of the bytes) and
    read it back, and onnx marks a tensor it read from outside as stored inline. The mark is 2
    bytes in the file for each FP32 tensor the INT8 file keeps; so marked, its bytes are the
    ones the quantizer wrote before."""
    import onnx

    def tensors(graph):
        yield from graph.initializer
        for n in graph.node:
            for g in protos.subgraphs(n):
                yield from tensors(g)

    for t in tensors(model.graph):
        if t.HasField("raw_data") and sys.getsizeof(t.raw_data) >= 1024:
            t.data_location = onnx.TensorProto.DEFAULT


def _shape_inferred(prepared: Path):
    """`prepared` after ONNX shape inference, marked as ORT's quantizer marks a model it has
    inferred (ORT's own `load_model_with_shape_infer`, which its calibrator uses too).
    Unmarked, ORT's quantizer deep-copies the model, saves it, infers and reloads it on every
    build: ResNet-18's builds peaked ~90 MiB higher that way. `build` marks its copy as that
    reload did (`_as_reloaded`), so the files are the same byte for byte."""
    from onnxruntime.quantization.quant_utils import load_model_with_shape_infer

    return load_model_with_shape_infer(Path(prepared))


class Quantizer:
    """ORT's QDQ quantizer over one `quant_pre_process`ed model, calibrated once."""

    def __init__(self, prepared: Path, calib: np.ndarray, method: str = "minmax") -> None:
        from onnxruntime.quantization import CalibrationMethod
        from onnxruntime.quantization.calibrate import create_calibrator
        from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

        model = _shape_inferred(prepared)
        self.batch = activation_batch(model)  # samples per ORT run: bounded memory
        self.op_types = op_types_for(model, set(QLinearOpsRegistry) | set(QDQRegistry))
        self.nodes = [n.name for n in model.graph.node if n.op_type in QUANTIZABLE]
        name = model.graph.input[0].name
        # Read again after calibrating: ORT's calibrator loads a copy of its own, and the two
        # alive together made this step ResNet-18's peak.
        del model
        with (
            tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp,
            quiet(stdout=method != "minmax"),
        ):
            calibrator = create_calibrator(
                Path(prepared),
                self.op_types,
                augmented_model_path=str(Path(tmp) / "augmented.onnx"),
                # its weights saved beside the augmented graph, which ORT then maps: serialized
                # whole, the model's bytes and ORT's copy came on top of the calibrator's model
                use_external_data_format=True,
                calibrate_method={
                    "minmax": CalibrationMethod.MinMax,
                    "entropy": CalibrationMethod.Entropy,
                    "percentile": CalibrationMethod.Percentile,
                }[method],
            )
            with _datapass.data_pass():
                calibrator.collect_data(_reader(calib, name, self.batch))
            self.ranges = calibrator.compute_data()
            del calibrator  # and its session, before the file it maps goes
        self.model = _shape_inferred(prepared)
        self.calib = calib  # bias correction measures on the same inputs

    def build(self, scheme: Scheme, exclude: Sequence[str] = (), ir_version: int | None = None):
        """The QDQ model with `exclude` in FP32 (reading FP32 tensors, `read_fp32`), orphan
        Q/DQ removed and FP32 constants back outside INT8 regions (`strip_orphan_qdq`), only
        used opsets imported, `ir_version` stamped; a new ModelProto (the calibrated model is
        untouched)."""
        from onnxruntime.quantization import QuantType
        from onnxruntime.quantization.qdq_quantizer import QDQQuantizer

        model = copy.deepcopy(self.model)  # ~1% of a build: ORT's rewrite is the cost
        _as_reloaded(model)
        with quiet():
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
        if exclude:
            read_fp32(out.graph, exclude, self.model)
        strip_orphan_qdq(out, self.model)
        if exclude:
            _drop_unused(out.graph)
        compat.keep_used_opsets(out)
        if ir_version is not None:
            out.ir_version = ir_version
        return protos.compact(out)

    def without(self, built, exclude: Sequence[str], ir_version: int | None = None):
        """A copy of `built` (a `build` output) with the nodes in `exclude` back in FP32 by
        graph surgery, without running the quantizer: each reads its FP32 inputs (`read_fp32`)
        and the FP32 model's weight and bias where it read dequantized constants, then Q/DQ
        left serving no INT8 compute go (`strip_orphan_qdq`). ~0.05 s where `build` takes
        2 s (EfficientNet-B0). On the real-models matrix its outputs equal `build(exclude)`'s
        bit for bit but for a ViT candidate where the quantizer leaves glue around excluded
        nodes unquantized (max |dlogit| 0.008): the fallback search runs on these, and the file
        shipped is then built by the quantizer and checked again (`_select`)."""
        out = copy.deepcopy(built)
        g = out.graph
        read_fp32(g, exclude, self.model)
        names = set(exclude)
        inits = {t.name for t in g.initializer}
        fp32_inits = {t.name: t for t in self.model.graph.initializer}
        fp32_nodes = {n.name: n for n in self.model.graph.node}
        producer = {o: n for n in g.node for o in n.output}
        taken = inits | set(producer) | {i.name for i in g.input}
        have = {name: name for name in inits}  # FP32 constant -> its name in this graph
        for n in g.node:
            f = fp32_nodes.get(n.name)
            if n.name not in names or f is None or len(f.input) != len(n.input):
                continue
            for k, name in enumerate(n.input):
                dq = producer.get(name)
                const = f.input[k]
                if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
                    continue
                if const in fp32_inits:
                    n.input[k] = _fp32_constant(g, const, fp32_inits, have, taken)
        strip_orphan_qdq(out, self.model)
        _drop_unused(g)
        compat.keep_used_opsets(out)
        if ir_version is not None:
            out.ir_version = ir_version
        return out


class _Fp32Reads:
    """The tensor a node reads to see `t` in FP32, where it read DQ(Q(t)) before.

    ORT's quantizer removes a Relu or Clip whose input it quantizes and renames the producer's
    output after the activation's: the Q's range then does the clamping. A node rewired to
    read `t` itself, without that Q, would miss the clamp (MobileNetV2's ReLU6: one INT8 conv
    among 52 FP32 ones gave 0.28 top-1 agreement until the activations came back, 0.996
    after). `name(t)` puts the activation back, a copy of the FP32 model's node, for FP32
    readers only; `finish` places the copies after their producers. Without the FP32 model
    (`original` None) names pass through unchanged."""

    REMOVABLE = ("Relu", "Clip")  # ORT's QDQRemovableActivation ops

    def __init__(self, graph, original) -> None:
        self.graph = graph
        self.fp32_producer = (
            {o: n for n in original.graph.node for o in n.output} if original else {}
        )
        self.fp32_inits = {t.name: t for t in original.graph.initializer} if original else {}
        self.producer = {o: n for n in graph.node for o in n.output}
        self.inits = {t.name for t in graph.initializer}
        # Names in use, tensors and nodes alike: a graph that went through a rewrite before
        # already holds "<relu>_fp32" nodes (ResNet-18 under target host: "two nodes with same
        # node name" from ORT when a second rewrite named its copy the same).
        self.taken = (
            self.inits
            | set(self.producer)
            | {i.name for i in graph.input}
            | {n.name for n in graph.node}
        )
        self.cache: dict[str, str] = {}
        self.after: dict[int, list] = {}  # id(producer) -> activation copies to place after it

    def _fresh(self, name: str) -> str:
        while name in self.taken:
            name += "_fp32"
        self.taken.add(name)
        return name

    def name(self, t: str) -> str:
        if t in self.cache:
            return self.cache[t]
        act, now = self.fp32_producer.get(t), self.producer.get(t)
        out = t
        removed = (
            act is not None
            and now is not None
            and act.op_type in self.REMOVABLE
            and act.name != now.name
            and all(not i or i in self.inits or i in self.fp32_inits for i in act.input[1:])
        )
        if removed:
            for i in act.input[1:]:  # Clip's min and max
                if i and i not in self.inits:
                    self.graph.initializer.append(copy.deepcopy(self.fp32_inits[i]))
                    self.inits.add(i)
            node = copy.deepcopy(act)
            node.name = self._fresh(act.name + "_fp32")
            node.input[0] = t
            del node.output[:]
            out = self._fresh(t + "_fp32")
            node.output.append(out)
            self.graph.node.append(node)
            self.after.setdefault(id(now), []).append(self.graph.node[-1])
        self.cache[t] = out
        return out

    def finish(self) -> None:
        if not self.after:
            return
        placed = {id(n) for nodes in self.after.values() for n in nodes}
        order = []
        for n in self.graph.node:
            if id(n) not in placed:
                order += [n, *self.after.get(id(n), [])]
        del self.graph.node[:]
        self.graph.node.extend(order)


def read_fp32(graph, exclude: Sequence[str], original=None) -> int:
    """Excluded nodes read FP32 tensors; returns the inputs rewired. The quantizer still
    quantizes the outputs of quantizable glue before an excluded node (a ViT's scaling Mul
    before the attention MatMul, a Reshape, an Add), so the excluded node read two
    DequantizeLinear outputs and counted, and ran once ORT fused it, as INT8: with every node
    excluded a 4-block ViT kept 4 INT8 MatMuls and shipped at 0.965 top-1 agreement under a
    0.995 floor. Each such input now reads the tensor its QuantizeLinear quantized (with a
    removed activation put back, `_Fp32Reads`; `original` is the FP32 model quantized); pairs
    left without a reader go with `strip_orphan_qdq` and `_drop_unused`."""
    names = set(exclude)
    producer = {o: n for n in graph.node for o in n.output}
    reads = _Fp32Reads(graph, original)
    rewired = 0
    for n in list(graph.node):
        if n.name not in names:
            continue
        for k, name in enumerate(n.input):
            dq = producer.get(name)
            if dq is None or dq.op_type != "DequantizeLinear":
                continue
            q = producer.get(dq.input[0])
            if q is not None and q.op_type == "QuantizeLinear":
                n.input[k] = reads.name(q.input[0])
                rewired += 1
    reads.finish()
    return rewired


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


def strip_orphan_qdq(model, original=None) -> int:
    """Remove activation Q -> DQ pairs that serve no INT8 compute node; returns pairs removed.

    Nodes other than Q/DQ are joined into regions through quantized tensors (producer -> Q ->
    DQ -> consumers). A region with no INT8 compute node only ever converts FP32 to INT8 and
    back: every pair in it goes, its consumers read the FP32 tensor again. Weight DQs (fed by an
    initializer) belong to their compute node and stay with it.

    With `original` (the FP32 model quantized, same node names), a node outside every INT8 region also
    reads its FP32 constants again where the quantizer had stored them in 8 bits: an embedding
    table (Gather), a position embedding (Add), a scale (Mul). Without that, a file with every
    compute node excluded still held an 8-bit embedding table and missed top-1 agreement 1.0
    with FP32."""
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
    # Q/DQ nodes to remove, by (op, name, output): `reads.finish()` may rebuild the node list,
    # after which the Python objects, and so their ids, are new (a pair dropped in the same
    # call as an activation put back stayed in the graph, beside its producer renamed to the
    # graph output it fed: "Duplicate definition of name").
    drop: set[tuple[str, str, str]] = set()

    def key(n) -> tuple[str, str, str]:
        return n.op_type, n.name, n.output[0]

    reads = _Fp32Reads(graph, original)
    for q, dqs, end in pairs:
        if find(end) in live:
            continue
        fp32 = reads.name(q.input[0])
        for dq in dqs:
            for c in consumers.get(dq.output[0], []):
                for k, name in enumerate(c.input):
                    if name == dq.output[0]:
                        c.input[k] = fp32
            if dq.output[0] in outputs:  # keep the graph's output name: the producer takes it
                _rename(graph, fp32, dq.output[0])
                fp32 = dq.output[0]
            drop.add(key(dq))
        drop.add(key(q))
        removed += 1
    restored = _restore_constants(graph, original, inits, consumers, live, find) if original else 0
    reads.finish()
    if drop:
        protos.keep_only(graph.node, lambda n: key(n) not in drop)
        _drop_unused_initializers(graph)
        _drop_value_info(graph)
    if restored:
        _drop_unused(graph)  # the 8-bit constants and their DequantizeLinear nodes
    return removed


def _restore_constants(graph, fp32, inits, consumers, live, find) -> int:
    """Point nodes outside every INT8 region back at their FP32 constants (see
    `strip_orphan_qdq`); returns the inputs changed."""
    ref_nodes = {n.name: n for n in fp32.graph.node}
    ref_inits = {t.name: t for t in fp32.graph.initializer}
    have = {name: name for name in inits}  # FP32 constant -> its name in this graph
    # The quantizer may name a DequantizeLinear output after the constant it dequantizes (a
    # bias shared by a Gemm and a LayerNorm): such a constant comes back under a new name.
    taken = set(inits) | {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    restored = 0
    for dq in list(graph.node):
        if dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
            continue
        for c in consumers.get(dq.output[0], []):
            ref = ref_nodes.get(c.name)
            if find(id(c)) in live or ref is None or len(ref.input) != len(c.input):
                continue  # an INT8 region's constant, or a node the FP32 model lacks
            for k, name in enumerate(c.input):
                if name != dq.output[0] or ref.input[k] not in ref_inits:
                    continue
                c.input[k] = _fp32_constant(graph, ref.input[k], ref_inits, have, taken)
                restored += 1
    return restored


def _fp32_constant(graph, const: str, ref_inits, have: dict[str, str], taken: set[str]) -> str:
    """The name under which `graph` holds the FP32 model's constant `const` (`have` maps the
    ones it holds already), a copy added where missing: under a new name where a tensor took
    the old one (the quantizer may name a DequantizeLinear output after the constant it
    dequantizes, a bias shared by a Gemm and a LayerNorm)."""
    if const not in have:
        fresh = const
        while fresh in taken:
            fresh += "_fp32"
        # copied once, straight into the graph (append copies its argument: a deep copy
        # appended was two copies)
        t = graph.initializer.add()
        t.CopyFrom(ref_inits[const])
        t.name = fresh
        have[const] = fresh
        taken.add(fresh)
    return have[const]


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
    protos.keep_only(graph.value_info, lambda v: v.name in live)


# --- per-node quantization error and bias correction: one run -------------------------------


@dataclass
class NodeError:
    """What one INT8 compute node's own quantization does to its output, on the inputs the
    FP32 model gives it (`node_errors`): `nmse` = sum of squared differences from the FP32
    node's output / its sum of squares; `shift` = the mean difference per output channel (None
    when the node has no bias that could absorb it)."""

    nmse: float
    shift: np.ndarray | None = None


def _opset(model) -> int:
    return next((int(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _channel_axis(op_type: str) -> int:
    """Conv: NC... (axis 1). Gemm: N x C (axis 1, the last). MatMul: the last axis, whatever
    the rank ((N, L, D) in a transformer)."""
    return 1 if op_type in ("Conv", "Gemm") else -1


def _bias_site(node, inits, producer, consumers) -> tuple[str, Any, int] | None:
    """Where `node`'s per-channel bias lives in the QDQ graph, and its channel count, or None:
    ("int32", dq, C) for a Conv/Gemm bias input dequantized from an int32 initializer;
    ("add", (add, k), C) for a MatMul with a constant weight whose output, directly or through
    one Q -> DQ pair, feeds exactly one Add whose input k is a C-vector: an FP32 initializer or
    a per-tensor DequantizeLinear of one (transformers' Linear on (N, L, D) tensors exports as
    MatMul + Add, the channel the last axis)."""
    from onnx import TensorProto

    if node.op_type in ("Conv", "Gemm"):
        dq = producer.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        ok = (
            dq is not None
            and dq.op_type == "DequantizeLinear"
            and dq.input[0] in inits
            and dq.input[1] in inits
            and inits[dq.input[0]].data_type == TensorProto.INT32
        )
        return ("int32", dq, int(np.prod(inits[dq.input[0]].dims))) if ok else None
    wdq = producer.get(node.input[1])
    if wdq is None or wdq.op_type != "DequantizeLinear" or wdq.input[0] not in inits:
        return None
    channels = int(inits[wdq.input[0]].dims[-1])  # MatMul weight (K, C): C output channels
    out = node.output[0]
    users = consumers.get(out, [])
    if len(users) == 1 and users[0].op_type == "QuantizeLinear":
        dqs = consumers.get(users[0].output[0], [])
        if len(dqs) != 1 or dqs[0].op_type != "DequantizeLinear":
            return None
        out = dqs[0].output[0]
        users = consumers.get(out, [])
    if len(users) != 1 or users[0].op_type != "Add" or len(users[0].input) != 2:
        return None
    add = users[0]
    k = 1 if add.input[0] == out else 0
    if add.input[1 - k] != out:
        return None
    src = add.input[k]
    if src in inits:
        t = inits[src]
    else:
        dq = producer.get(src)
        if (
            dq is None
            or dq.op_type != "DequantizeLinear"
            or len(dq.input) < 3
            or not all(i in inits for i in dq.input[:3])
            or int(np.prod(inits[dq.input[1]].dims)) != 1  # per-tensor: re-quantizable here
        ):
            return None
        t = inits[dq.input[0]]
    dims = list(t.dims)
    if not dims or dims[-1] != channels or int(np.prod(dims)) != channels:
        return None  # not one value per output channel: no bias of this node
    if src in inits and t.data_type != TensorProto.FLOAT:
        return None
    return "add", (add, k), channels


def _graph_maps(graph):
    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    return inits, producer, consumers


def node_errors(
    model, reference, x: np.ndarray, optimized: bool, batch: int = 64
) -> dict[str, NodeError]:
    """Every INT8 compute node's own error, from ONE session over `x`, in the FP32 model:
    each INT8 node of `model` gets a quantized twin beside its FP32 original in `reference`
    (the twin quantizes the original's FP32 input tensors with the INT8 graph's scales and
    zero points, and reads the INT8 graph's quantized weights and bias), so a node is judged
    on the inputs FP32 gives it, not on what upstream INT8 error (and the clipping it causes
    against calibrated ranges) makes of them. The graph itself reduces the differences (sums
    of squares; per-channel means where a bias can absorb them), so memory does not grow
    with the number of nodes.

    `reference` is the FP32 model the INT8 graph was quantized from (`Quantizer.model`, the
    same node names), as a ModelProto or its bytes."""
    import onnx

    ref = onnx.load_from_string(reference) if isinstance(reference, bytes) else reference
    built = _error_graph(model, ref)
    if built is None:
        return {}
    m, outs, names = built
    # Through a file, the twin graph let go before ORT builds its session, and the FP32
    # weights written from `ref` one tensor at a time as external data (`protos.save_beside`),
    # never copied whole: on ResNet-18's model the pass peaked 128 MiB over its start with a
    # deep copy of the FP32 model saved in one piece, ~80 with this (ORT maps the weights).
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        path = Path(tmp) / "errors.onnx"
        protos.save_beside(m, ref.graph.initializer, path)
        del m, built  # nothing else holds the twin graph (see `_error_graph`)
        sess = session(path, optimized, lean=True)
        try:
            inp = sess.get_inputs()[0].name
            sums = {t: 0.0 for t in names}
            total = 0
            with _datapass.data_pass():
                for i in range(0, len(x), batch):
                    part = x[i : i + batch]
                    for t, v in zip(names, sess.run(names, {inp: part}), strict=True):
                        # sums of squares add up over batches; channel means by batch size
                        w = len(part) if t.endswith("/shift") else 1
                        sums[t] = sums[t] + v.astype(np.float64) * w
                    total += len(part)
        finally:
            del sess  # before the file it maps goes
    result = {}
    for node, (sse, ss, shift) in outs.items():
        err, sig = float(sums[sse]), float(sums[ss])
        nmse = err / sig if sig > 0 else (0.0 if err == 0 else float("inf"))
        result[node] = NodeError(nmse, None if shift is None else sums[shift] / max(total, 1))
    return result


def _error_graph(model, ref):
    """`node_errors`' graph: (the FP32 model `ref` with each INT8 node's twin and the
    reductions of its error placed right after its original, but without `ref`'s initializers,
    which `node_errors` adds as external data; {node: (sse, ss, shift) output names}, the
    output names), or None when no INT8 node has an FP32 original. Built in a function of
    its own so that nothing but the returned model refers to it (protobuf sub-messages keep
    their whole message alive)."""
    import onnx
    from onnx import helper, numpy_helper

    m = protos.shell(ref)
    g = m.graph
    q_inits, producer, consumers = _graph_maps(model.graph)
    base = {n.name: n for n in g.node}
    new18 = _opset(m) >= 18  # ReduceMean's axes: an input from opset 18, an attribute before
    added_nodes: list = []
    added_inits: list = []
    after: dict[str, list] = {}  # FP32 node name -> its twin and reductions, placed right after it
    outs: dict[str, tuple[str, str, str | None]] = {}  # node -> (sse, ss, shift) tensor names

    def const(name: str, value: np.ndarray) -> str:
        added_inits.append(numpy_helper.from_array(value, name))
        return name

    def copied(name: str, new: str) -> str:
        if not name:
            return name
        t = copy.deepcopy(q_inits[name])
        t.name = new
        added_inits.append(t)
        return new

    def qdq_node(op: str, src: list[str], like, out: str):
        node = helper.make_node(op, src, [out], name=out)
        node.attribute.extend(like.attribute)
        added_nodes.append(node)
        return out

    for n in int8_compute_nodes(model.graph):
        f = base.get(n.name)
        if f is None or f.op_type != n.op_type or len(f.input) != len(n.input):
            continue
        tag = f"__err/{n.name}"
        added_nodes = after.setdefault(f.name, [])
        ins = []
        for k, name in enumerate(n.input):
            dq = producer.get(name)
            if not name or dq is None or dq.op_type != "DequantizeLinear":
                ins.append(f.input[k])  # not quantized in the INT8 graph either
                continue
            params = [copied(i, f"{tag}/in{k}/{j}") for j, i in enumerate(dq.input[1:], 1)]
            if dq.input[0] in q_inits:  # a quantized weight or bias, as the INT8 graph holds it
                src = [copied(dq.input[0], f"{tag}/in{k}/0"), *params]
                ins.append(qdq_node("DequantizeLinear", src, dq, f"{tag}/in{k}/dq"))
                continue
            q = producer.get(dq.input[0])
            if q is None or q.op_type != "QuantizeLinear":
                ins.append(f.input[k])
                continue
            qparams = [copied(i, f"{tag}/in{k}/q{j}") for j, i in enumerate(q.input[1:], 1)]
            quantized = qdq_node("QuantizeLinear", [f.input[k], *qparams], q, f"{tag}/in{k}/q")
            ins.append(qdq_node("DequantizeLinear", [quantized, *params], dq, f"{tag}/in{k}/dq"))
        y = f"{tag}/y"
        twin = helper.make_node(n.op_type, ins, [y], name=tag, domain=n.domain)
        twin.attribute.extend(n.attribute)
        added_nodes.append(twin)
        d = f"{tag}/d"
        added_nodes.append(helper.make_node("Sub", [y, f.output[0]], [d], name=d))
        sse, ss = f"{tag}/sse", f"{tag}/ss"
        added_nodes.append(helper.make_node("ReduceSumSquare", [d], [sse], keepdims=0, name=sse))
        added_nodes.append(
            helper.make_node("ReduceSumSquare", [f.output[0]], [ss], keepdims=0, name=ss)
        )
        shift = None
        site = _bias_site(n, q_inits, producer, consumers)
        if site is not None:
            channels = site[2]
            axis = _channel_axis(n.op_type)
            shape = [0, channels, -1] if axis == 1 else [-1, channels]
            axes = [0, 2] if axis == 1 else [0]
            r, shift = f"{tag}/r", f"{tag}/shift"
            added_nodes.append(
                helper.make_node(
                    "Reshape", [d, const(f"{tag}/shape", np.array(shape, np.int64))], [r], name=r
                )
            )
            if new18:
                ax = const(f"{tag}/axes", np.array(axes, np.int64))
                added_nodes.append(
                    helper.make_node("ReduceMean", [r, ax], [shift], keepdims=0, name=shift)
                )
            else:
                added_nodes.append(
                    helper.make_node("ReduceMean", [r], [shift], axes=axes, keepdims=0, name=shift)
                )
        outs[n.name] = (sse, ss, shift)
    if not outs:
        return None
    # Each twin right after its original, so ORT runs it while the original's input and output
    # are fresh and frees them: appended at the end, every FP32 activation a twin reads stayed
    # alive to the end of the graph. With ORT's priority-based order (it honours this
    # placement; its default order did not) and 64 samples a run, ViT-tiny's peak went from
    # 4.0 GB to 0.56 GB, and the pass from 14.5 s to 10.7 s per 256 samples. `choose` now
    # passes the calibration's activation-sized batch (`activation_batch`).
    nodes = list(g.node)
    del g.node[:]
    for node in nodes:
        g.node.append(node)
        g.node.extend(after.get(node.name, []))
    g.initializer.extend(added_inits)
    names = [t for v in outs.values() for t in v if t is not None]
    del g.output[:]  # only the reductions: the logits are not needed here
    g.output.extend(helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None) for t in names)
    return m, outs, names


def apply_bias_shifts(model, errors: dict[str, NodeError]) -> tuple[Any, int]:
    """A copy of `model` whose INT8 nodes' biases absorb their measured mean shift; returns
    the copy and the number of nodes corrected (`apply_bias_shifts_`)."""
    model = copy.deepcopy(model)
    return model, apply_bias_shifts_(model, errors)


def apply_bias_shifts_(model, errors: dict[str, NodeError]) -> int:
    """`model`'s INT8 nodes' biases absorb their measured mean shift, in place; returns the
    number of nodes corrected. An int32 Conv/Gemm bias moves by whole steps of its scale; a
    bias Add's constant is re-quantized with its own range (or, in FP32, moved). A bias tensor
    shared with other nodes is copied first, so only this node changes. In place because the
    fallback search corrects each fresh candidate: a copy there was one more model alive at the
    INT8 step's peak."""
    from onnx import helper, numpy_helper

    g = model.graph
    inits, producer, consumers = _graph_maps(g)
    corrected = 0
    before: dict[int, list] = {}  # id(node) -> DequantizeLinear nodes to insert before it
    for n in int8_compute_nodes(g):
        e = errors.get(n.name)
        if e is None or e.shift is None:
            continue
        site = _bias_site(n, inits, producer, consumers)
        if site is None:
            continue
        kind, where, _ = site
        shift = np.asarray(e.shift, np.float64)
        if kind == "int32":
            dq = where
            bias, scale = inits[dq.input[0]], inits[dq.input[1]]
            b = numpy_helper.to_array(bias).astype(np.float64)
            if b.size != shift.size:
                continue
            s = numpy_helper.to_array(scale).astype(np.float64)
            b = b - np.rint(shift.reshape(b.shape) / s)
            b = np.clip(b, np.iinfo(np.int32).min, np.iinfo(np.int32).max).astype(np.int32)
            new = numpy_helper.from_array(b, f"{n.name}/bias_corrected")
            g.initializer.append(new)
            # a private DequantizeLinear: the original may serve other nodes too
            priv = helper.make_node(
                "DequantizeLinear",
                [new.name, *dq.input[1:]],
                [f"{n.name}/bias_corrected_dq"],
                name=f"{n.name}/bias_corrected_dq",
            )
            priv.attribute.extend(dq.attribute)
            before.setdefault(id(n), []).append(priv)
            n.input[2] = priv.output[0]
        else:
            add, k = where
            name = add.input[k]
            if name in inits:  # an FP32 constant
                b = numpy_helper.to_array(inits[name]).astype(np.float64)
                if b.size != shift.size:
                    continue
                b = (b - shift.reshape(b.shape)).astype(np.float32)
                new = numpy_helper.from_array(b, f"{n.name}/bias_corrected")
                g.initializer.append(new)
                add.input[k] = new.name
            else:
                dq = producer[name]
                q, s, z = (numpy_helper.to_array(inits[i]) for i in dq.input[:3])
                b = (q.astype(np.float64) - float(z.reshape(-1)[0])) * float(s.reshape(-1)[0])
                if b.size != shift.size:
                    continue
                b = b - shift.reshape(b.shape)
                qv, sv, zv = _quantize_vector(b, z.dtype)
                names = [f"{n.name}/bias_corrected{sfx}" for sfx in ("", "_scale", "_zero_point")]
                g.initializer.extend(
                    [
                        numpy_helper.from_array(qv, names[0]),
                        numpy_helper.from_array(sv.astype(s.dtype).reshape(s.shape), names[1]),
                        numpy_helper.from_array(zv.reshape(z.shape), names[2]),
                    ]
                )
                priv = helper.make_node(
                    "DequantizeLinear",
                    names,
                    [f"{n.name}/bias_corrected_dq"],
                    name=f"{n.name}/bias_corrected_dq",
                )
                priv.attribute.extend(dq.attribute)
                before.setdefault(id(add), []).append(priv)
                add.input[k] = priv.output[0]
        corrected += 1
    if before:
        nodes = [m for n in g.node for m in [*before.get(id(n), []), n]]
        del g.node[:]
        g.node.extend(nodes)
    if corrected:
        _drop_unused(g)
    return corrected


def _quantize_vector(b: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric per-tensor quantization of a small float vector into `dtype` (uint8/int8),
    its range widened to hold 0 (ONNX's Q/DQ convention)."""
    info = np.iinfo(dtype)
    lo, hi = min(0.0, float(b.min())), max(0.0, float(b.max()))
    scale = (hi - lo) / (info.max - info.min) if hi > lo else 1.0
    zp = np.clip(np.rint(info.min - lo / scale), info.min, info.max)
    q = np.clip(np.rint(b / scale) + zp, info.min, info.max).astype(dtype)
    return q, np.array(scale, np.float32), np.array(zp, dtype)


def _drop_unused(graph) -> None:
    """Remove nodes whose outputs nothing reads (and that are no graph output), then unused
    initializers."""
    while True:
        used = _used_names(graph)
        dead = [n for n in graph.node if not any(o in used for o in n.output)]
        if not dead:
            break
        ids = {id(n) for n in dead}
        protos.keep_only(graph.node, lambda n, ids=ids: id(n) not in ids)
    _drop_unused_initializers(graph)
    _drop_value_info(graph)


def _used_names(graph) -> set[str]:
    """Tensor names the nodes read, subgraphs (If/Loop bodies read outer names) included."""
    used = {o.name for o in graph.output}
    for n in graph.node:
        used.update(n.input)
        for attr in n.attribute:
            for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                used |= _used_names(g)
    return used


def _drop_unused_initializers(graph) -> None:
    """One pass, by index (RepeatedField.remove compares whole tensors, once per removal)."""
    used = _used_names(graph)
    protos.keep_only(graph.initializer, lambda t: t.name in used)


def correct_bias(model, reference, x: np.ndarray, optimized: bool) -> tuple[Any, int]:
    """Empirical bias correction (Nagel et al., "Data-Free Quantization", ICCV 2019, §4.2;
    NNCF's default does the same): quantization shifts the mean output of each channel of an
    INT8 Conv/Gemm/MatMul; subtract that shift, measured on `x`, from the bias that follows
    it (a Conv/Gemm's int32 bias, the bias Add after a MatMul). Each node's shift is its own,
    measured by a quantized twin beside the FP32 node on the FP32 model's inputs
    (`node_errors`): an upstream error is never counted twice, and one session measures every
    node. `reference` is the FP32 model quantized (same node names). Returns a new model and
    the number of nodes corrected."""
    errors = node_errors(model, reference, x, optimized)
    if not any(e.shift is not None for e in errors.values()):
        return copy.deepcopy(model), 0
    return apply_bias_shifts(model, errors)


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
    with _datapass.data_pass():
        parts = [sess.run(names, {inp: x[i : i + 256]}) for i in range(0, len(x), 256)]
    return [np.concatenate([p[j] for p in parts]).astype(np.float64) for j in range(len(names))]


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


def paired_rounds(
    models: Sequence[bytes | Path], x: np.ndarray, rounds: int | None = None
) -> np.ndarray:
    """[rounds, len(models)] median seconds per call, the models interleaved in each round
    (ROUNDS rounds unless given)."""
    from compresskit.compressor.measure import latency

    rounds = rounds or ROUNDS
    sessions = [session(m, optimized=True, threads=1) for m in models]
    name = sessions[0].get_inputs()[0].name
    calls = [(lambda s=s: s.run(None, {name: x})) for s in sessions]
    out = np.empty((rounds, len(models)))
    with _datapass.data_pass():  # timing runs the model on inputs too
        for r in range(rounds):
            times = latency.interleaved(calls, ROUND_S, min_runs=5, warmup=3 if r == 0 else 1)
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
    agreement_before_fallback: float = 1.0  # every node INT8 that timing kept, bias corrected
    fallen_back: int = 0  # nodes returned to FP32 to hold min_agreement
    builds: int = 0  # quantized models built (Quantizer.build calls) for this scheme
    searched: int = 0  # fallback candidates made by surgery (Quantizer.without) and checked
    expected: float = 1.0  # agreement expected on new inputs (`expected_agreement`)
    expected_low: float = 1.0  # its one-sided 95% lower bound, which the floor must hold
    expected_before_fallback: float = 1.0
    expected_low_before_fallback: float = 1.0
    # Why this scheme's fallback was not searched ("" when it was, or needed none): it missed
    # the floor while the other scheme held it, or stood further from it. Never shipped then.
    unsearched: str = ""


@dataclass
class _Started:
    """A scheme's all-INT8 file, bias decided, before any fallback: how close it stands to
    the floor, and `finish(why)` to run its fallback and time it ("") or to skip it (why)."""

    scheme: Scheme
    floor: float  # `floor_agreement` of the all-INT8 file
    holds: bool  # it meets the floor as it is
    finish: Callable[[str], Selection]  # "" to search; else why it is not searched


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
    ties: int = 0  # check samples whose FP32 top two classes tie (either counts as agreeing)


def choose(
    prepared: Path,
    fp32: bytes | Path,
    calib: np.ndarray,
    check_x: np.ndarray,
    cfg: QuantConfig,
    cpu_flags: set[str],
    ir_version: int | None = None,
) -> Choice:
    """Pick the INT8 file for `cfg.target` among our scheme and ORT's default.

    The file shipped holds top-1 agreement >= cfg.min_agreement with FP32 on `check_x` (nodes
    go back to FP32 until it does; with none left in INT8 no file ships). StageError when even
    the all-FP32 graph misses the floor: the check itself is then broken (NaN, a runtime that
    answers differently from run to run)."""
    rr = resolve_reduce_range(cfg, cpu_flags)
    host = cfg.target == "host"
    q = Quantizer(prepared, calib, cfg.method)
    # Every check run at the calibration's activation-sized batch: at 64 samples a run,
    # EfficientNet-B0's fallback search (unfused Q/DQ graphs) peaked ~150 MiB over its
    # start. Outputs do not depend on the batch (compared bit for bit on four models).
    reference = outputs(session(fp32, optimized=host), check_x, q.batch)
    timing_x = check_x[: cfg.batch] if len(check_x) >= cfg.batch else check_x
    # The check inputs nearest a tie first (smallest gap between FP32's top two logits): a
    # fallback candidate that misses the floor then meets the disagreements that rule it out
    # early and stops (`_outputs_above`); agreement and MSE do not depend on the order.
    fragile = np.argsort(_top2_gap(reference), kind="stable")
    check_x, reference = check_x[fragile], reference[fragile]
    started = [
        _select(q, s, reference, check_x, timing_x, cfg, fp32, ir_version)
        for s in (scheme_for(cfg, rr), ORT_DEFAULT)
    ]
    selections = [st.finish(why) for st, why in zip(started, _searched(started), strict=True)]
    candidates = [
        {
            "scheme": s.scheme.name,
            "int8_nodes": s.int8_nodes,
            "agreement": s.agreement,
            "mse": s.mse,
            "bias_corrected": s.bias_corrected,
            "agreement_before_fallback": s.agreement_before_fallback,
            "expected_agreement": s.expected,
            "expected_lower_bound": s.expected_low,
            "expected_before_fallback": s.expected_before_fallback,
            "expected_lower_bound_before_fallback": s.expected_low_before_fallback,
            "fallen_back": s.fallen_back,
            "min_agreement": cfg.min_agreement,
            "check_samples": len(check_x),
            "builds": s.builds,
            "searched": s.searched,
            **({"not_searched": s.unsearched} if s.unsearched else {}),
        }
        for s in selections
    ]
    if any(s.unsearched for s in selections):  # only the other scheme can ship
        best = next(s for s in selections if not s.unsearched)
    elif host and all(s.latency_ms for s in selections) and selections[1].int8_nodes:
        ours, ort = (s.latency_ms["int8"] for s in selections)  # type: ignore[index]
        best = selections[0] if ours <= ort * (1 + MARGIN) else selections[1]
        closer = (selections[1].agreement, -selections[1].mse) > (best.agreement, -best.mse)
        if closer and ort <= ours * (1 + MARGIN):
            best = selections[1]
    else:  # more INT8 compute first, then agreement, then logits closer to FP32
        best = max(selections, key=lambda s: (s.int8_nodes, s.agreement, -s.mse))
    shipped = best.model if best.int8_nodes else None
    reason = "" if shipped is not None else no_int8_reason(best, cfg.min_agreement)
    return Choice(
        shipped,
        best,
        candidates,
        len(q.nodes),
        rr,
        "host" if host else "reference",
        reason,
        ties(reference),
    )


WHOLE_MODEL = "whole model: "  # the reason given when host timing found all of INT8 slower


def no_int8_reason(best: Selection, floor: float) -> str:
    """One line on why `best` ships no INT8 file. It names the figure that missed: the
    agreement counted on the check inputs can be 1.0000 while the 95% lower bound of the one
    expected on new inputs misses the floor (a small ViT on 160 validation samples). Host
    timing that found the INT8 file slower decides last, so it is named first."""
    reasons = sorted(set(best.fp32_nodes.values()))
    slower = [r for r in reasons if r.startswith(WHOLE_MODEL)]
    if slower:
        return slower[0]
    if not best.fallen_back:
        return reasons[0] if reasons else "no quantizable node"
    counted, low = best.agreement_before_fallback, best.expected_low_before_fallback
    if counted < floor:
        missed = f"top-1 agreement with FP32 {counted:.4f}, below min_agreement {floor}"
    else:
        missed = (
            f"top-1 agreement with FP32 {counted:.4f} on the check inputs, but on new inputs "
            f"{best.expected_before_fallback:.4f} expected with a 95% lower bound of {low:.4f}, "
            f"below min_agreement {floor} (more validation samples narrow the bound)"
        )
    return (
        f"with every node in INT8, {missed}; it held only with all {best.fallen_back} INT8 "
        f"nodes back in FP32"
    )


def _searched(started: list[_Started]) -> list[str]:
    """Which schemes' fallback is searched: "" for those, else why not. The search dominates
    the INT8 step (ViT-tiny: 27 candidates a scheme, each a full run over the check inputs),
    and with two schemes it ran twice. A scheme that holds the floor with every node in INT8
    needs none, and one that misses it cannot then win (it can only end with fewer INT8
    nodes); when both miss, only the one whose all-INT8 file stands closer to the floor is
    searched (ties: the recipe's own scheme). On the real-models matrix this kept every
    model's INT8 node count but one (a 32-node SE-ResNet: 1 node instead of 2)."""
    held = [st for st in started if st.holds]
    if held:
        return [
            ""
            if st.holds
            else f"it misses the floor with every node in INT8 "
            f"({st.floor:.4f}) while {held[0].scheme.name} holds it"
            for st in started
        ]
    best = max(started, key=lambda st: st.floor)  # the first on ties: ours
    return [
        ""
        if st is best
        else f"both schemes miss the floor with every node in INT8 and "
        f"{best.scheme.name} stands closer to it ({best.floor:.4f} vs {st.floor:.4f})"
        for st in started
    ]


def _select(q: Quantizer, scheme, reference, x, timing_x, cfg, fp32, ir_version) -> _Started:
    """A scheme's all-INT8 file (nodes INT8 makes slower kept FP32 on the host target) with
    its bias correction decided; `finish` then runs the fallback and the final timing."""
    host = cfg.target == "host"
    excluded: dict[str, str] = {}
    builds = searched = 0

    def build(extra: Sequence[str] = ()):
        nonlocal builds
        builds += 1
        return q.build(scheme, [*excluded, *extra], ir_version)

    def run(model, inputs: np.ndarray | None = None) -> np.ndarray:
        xs = x if inputs is None else inputs
        return outputs(session(model.SerializeToString(), optimized=host), xs, q.batch)

    def run_within(model, floor: float | None) -> np.ndarray | None:
        if floor is None:
            return run(model)
        return _outputs_above(
            session(model.SerializeToString(), optimized=host), x, reference, floor, q.batch
        )

    model = build()
    latency = None
    if host:  # latency first: it does not depend on the bias values
        for group in _groups(q):
            if all(n in excluded for n in group):
                continue
            cand = build(group)
            t = paired_rounds([cand.SerializeToString(), model.SerializeToString()], timing_x)
            if fp32_clearly_faster(t[:, 0], t[:, 1]):
                ms = 1000 * np.median(t, axis=0)
                for n in group:
                    excluded[n] = f"INT8 slower: {ms[1]:.3f} ms in INT8, {ms[0]:.3f} ms in FP32"
                model = cand
    # Each node's own error and bias shift, measured once (one session over the calibration
    # inputs) on the graph with every remaining node in INT8; reused by every candidate below.
    errors = (
        node_errors(model, q.model, q.calib, host, q.batch)
        if int8_compute_nodes(model.graph)
        else {}
    )
    got = run(model)
    # Bias correction, kept only where the check inputs say INT8 got closer to FP32; decided
    # once here, every fallback candidate then follows the same decision.
    use_bias, n_bias, uncorrected = False, 0, model
    corrected, n = apply_bias_shifts(model, errors)
    if n:
        c_out = run(corrected)
        if _closeness(c_out, reference) > _closeness(got, reference):
            model, got, n_bias, use_bias = corrected, c_out, n, True
    before, before_expected = agreement(got, reference), expected_agreement(got, reference)
    floor = floor_agreement(got, reference)  # what `meets` judges; the fallback starts there
    holds = floor >= cfg.min_agreement

    def finish(unsearched: str) -> Selection:
        nonlocal model, uncorrected, got, n_bias, latency, searched
        if unsearched:  # reported, never shipped: the other scheme's search decides
            n_int8 = len(int8_compute_nodes(model.graph))
            model = uncorrected = None  # not alive through the other scheme's search
            return Selection(
                scheme,
                None,
                agreement=before,
                mse=float(np.mean((got - reference) ** 2)),
                int8_nodes=n_int8,
                bias_corrected=n_bias,
                agreement_before_fallback=before,
                builds=builds,
                expected=before_expected[0],
                expected_low=before_expected[1],
                expected_before_fallback=before_expected[0],
                expected_low_before_fallback=before_expected[1],
                unsearched=unsearched,
            )
        after = before_expected  # re-measured below when nodes fall back
        fallen: list[str] = []
        if not holds:

            def make(back: Sequence[str], exact: bool = False):
                m = build(back) if exact else q.without(uncorrected, back, ir_version)
                return m, (apply_bias_shifts_(m, errors) if use_bias else 0)

            def candidate(back: Sequence[str], floor: float | None, exact: bool = False):
                # Surgery-made candidates come back without their model: the search keeps the
                # outputs of the one that held, and the model is made again only if it ships.
                # A held model alive beside the next candidate, plus a corrected copy of each,
                # were the INT8 step's peak on EfficientNet-B0.
                nonlocal searched
                searched += 0 if exact else 1
                m, nb = make(back, exact)
                out = run_within(m, floor)
                return (m if exact else None), out, nb

            int8 = [n.name for n in int8_compute_nodes(model.graph)]
            # a node without a measured error (no FP32 twin found) goes last
            order = fallback_order(
                {n: e for n, e in errors.items() if n in int8}, q.nodes, output_layers(q.model)
            )
            order += [n for n in int8 if n not in order]
            model = None  # the search starts from `uncorrected`
            _, got, n_bias, fallen = _fall_back(order, candidate, reference, cfg, floor)
            how = "the output layers, then the nodes of largest own error (normalised MSE)"
            if 2 * len(fallen) > len(int8) >= 4:
                # Own error is not what reaches the logits: an EfficientNet-B0 file kept 0 of
                # 82 nodes in INT8 in that order and 26 in the order of each node's effect
                # alone (2 and 9 in the matrix's shrink; docs/benchmarks.md).
                few = x[:EFFECT_SAMPLES]

                def alone(n: str) -> float:
                    out = run(make([o for o in int8 if o != n])[0], few)
                    return float(np.mean((out - reference[: len(few)]) ** 2))

                effects = {n: alone(n) for n in int8}
                searched += len(int8)
                second = _fall_back(
                    effect_order(effects, q.nodes), candidate, reference, cfg, floor
                )
                if len(second[3]) < len(fallen):
                    _, got, n_bias, fallen = second
                    how = (
                        "the nodes of largest effect on the logits alone in INT8 (mean squared "
                        f"change on the {len(few)} most fragile check inputs) first"
                    )
            # The search ran on surgery-made candidates; the quantizer's own file for the nodes
            # found ships when it holds the floor too (it did on every model measured), else the
            # candidate that held, made again by the same surgery (deterministic), as checked.
            exact, out, nb = candidate(fallen, None, exact=True)
            if meets(out, reference, cfg.min_agreement):
                model, got, n_bias = exact, out, nb
            else:
                del exact
                model, n_bias = make(fallen)
            after = expected_agreement(got, reference)
            why = (
                f"accuracy: with every node in INT8, top-1 agreement {before:.4f}, expected on new "
                f"inputs {before_expected[0]:.4f} (95% lower bound {before_expected[1]:.4f}), "
                f"against min_agreement {cfg.min_agreement}; {how}, narrowed to {len(fallen)} "
                f"by delta debugging, back in FP32 give {agreement(got, reference):.4f}, expected "
                f"{after[0]:.4f} (bound {after[1]:.4f})"
            )
            excluded.update({n: why for n in fallen})
        agree, mse = agreement(got, reference), float(np.mean((got - reference) ** 2))
        n_int8 = len(int8_compute_nodes(model.graph))
        if host:
            t = paired_rounds([fp32, model.SerializeToString()], timing_x)
            ms = 1000 * np.median(t, axis=0)
            latency = {"fp32": float(ms[0]), "int8": float(ms[1])}
            if n_int8 and fp32_clearly_faster(t[:, 0], t[:, 1]):
                why = f"{WHOLE_MODEL}INT8 {ms[1]:.3f} ms vs FP32 {ms[0]:.3f} ms"
                excluded.update({n: why for n in q.nodes if n not in excluded})
                model, agree, mse, n_int8, n_bias = build(), 1.0, 0.0, 0, 0
                latency["int8"] = latency["fp32"]
        return Selection(
            scheme,
            model,
            excluded,
            agree,
            mse,
            n_int8,
            n_bias,
            latency,
            before,
            len(fallen),
            builds,
            searched,
            *(after if n_int8 else (1.0, 1.0)),
            *before_expected,
        )

    return _Started(scheme, floor, holds, finish)


@_datapass.counted
def _outputs_above(sess, x: np.ndarray, reference: np.ndarray, floor: float, batch: int = 64):
    """`outputs`, or None as soon as more samples disagree with `reference` than top-1
    agreement `floor` allows on the whole of `x`: a candidate that fails stops early (most of
    the fallback search's candidates fail, and the runs over the check inputs are its cost).

    Batches grow 8, 16, 32, ... up to `batch`: `choose` sorts the check inputs most fragile
    first, so a failing candidate usually fails within the first few, and a first batch of 64
    made each failure cost 64 samples' inference (ViT-tiny: 0.35 s a batch, 112 batches)."""
    allowed = int(np.floor(len(x) * (1.0 - floor) + 1e-9))
    name = sess.get_inputs()[0].name
    parts, wrong, tol = [], 0, tie_tolerance(reference)
    i, step = 0, min(FIRST_BATCH, batch)
    while i < len(x):
        parts.append(sess.run(None, {name: x[i : i + step]})[0])
        wrong += int(np.sum(disagrees(parts[-1], reference[i : i + step], tol)))
        if wrong > allowed:
            return None
        i, step = i + step, min(2 * step, batch)
    return np.concatenate(parts) if parts else np.zeros((0,))


def _top2_gap(logits: np.ndarray) -> np.ndarray:
    """Per sample, the largest logit minus the second largest (0 with a single class)."""
    flat = logits.reshape(len(logits), -1)
    if flat.shape[1] < 2:
        return np.zeros(len(flat))
    top = np.partition(flat, -2, axis=1)[:, -2:]
    return top[:, 1] - top[:, 0]


def _closeness(got: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    return agreement(got, reference), -float(np.mean((got - reference) ** 2))


def fallback_order(
    errors: dict[str, NodeError], graph_order: Sequence[str], first: Sequence[str] = ()
) -> list[str]:
    """INT8 nodes in the order they go back to FP32: the output layers (`first`) ahead, then
    the largest own error (normalised MSE on the FP32 model's inputs) first; ties in graph
    order. Depends only on the model and the calibration inputs: deterministic.

    Why output layers first: their error reaches the logits unattenuated, while a conv's
    error is averaged down by the layers and the pooling after it. On MobileNetV2 the head
    Gemm had the smallest own error (1e-5, against 4e-4 for the worst conv) yet alone cost
    2.1% top-1 agreement where that conv cost 0.9%; and a head is little compute to give up."""
    index = {n: i for i, n in enumerate(graph_order)}
    head = set(first)
    return sorted(
        errors, key=lambda n: (n not in head, -errors[n].nmse, index.get(n, len(index)), n)
    )


def effect_order(effects: dict[str, float], graph_order: Sequence[str]) -> list[str]:
    """INT8 nodes in the order they go back to FP32 when ranked by `effects` (each node's mean
    squared change of the logits with it alone in INT8): the largest first, ties in graph
    order. Deterministic for given effects."""
    index = {n: i for i, n in enumerate(graph_order)}
    return sorted(effects, key=lambda n: (-effects[n], index.get(n, len(index)), n))


def output_layers(model) -> list[str]:
    """The Conv/Gemm/MatMul nodes nearest each graph output: walking back from the outputs
    through other ops (a LayerNorm, a Gather, a Flatten), the compute nodes met first."""
    producer = {o: n for n in model.graph.node for o in n.output}
    found, seen = [], set()
    todo = [o.name for o in model.graph.output]
    while todo:
        t = todo.pop()
        n = producer.get(t)
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        if n.op_type in QUANTIZABLE:
            found.append(n.name)
        else:
            todo.extend(n.input)
    return sorted(found)


def _fall_back(order: list[str], candidate, reference, cfg, before: float):
    """The fewest nodes back to FP32, in `fallback_order`, for which the floor holds: prefixes
    of 1, 2, 4, ... nodes until one holds, then bisection between the last that failed and the
    first that held. O(log N) candidates, each one QDQ rewrite and one run over the check
    inputs that stops once the floor is out of reach (agreement is not monotone in the
    prefix: bisection finds a prefix that holds whose one-shorter prefix does not). Returns
    (model, outputs, bias-corrected, the nodes back in FP32) of the candidate kept;
    StageError when even every node back in FP32 misses the floor.

    `candidate(nodes, floor)` builds the file with `nodes` back in FP32 and returns (model,
    outputs on the check inputs or None once they cannot hold `floor`, bias-corrected); the
    model is passed through untouched (`_select`'s candidates return None there, to hold no
    model between candidates)."""
    # The shortest prefix that held so far, and only it: every prefix that holds later is
    # shorter, and each candidate is a whole model (all of them were kept alive before).
    held: tuple | None = None
    full_agreement: float | None = None  # all nodes back in FP32: the error message's figure

    def holds(k: int) -> bool:
        nonlocal held, full_agreement
        last = k == len(order)  # run in full: its agreement is the error message's figure
        m, out, nb = candidate(order[:k], None if last else cfg.min_agreement)
        if out is None or not meets(out, reference, cfg.min_agreement):
            if last and out is not None:
                full_agreement = floor_agreement(out, reference)
            return False
        held = (m, out, nb)
        return True

    lo, hi, k = 0, None, 1
    while order:
        k = min(k, len(order))
        if holds(k):
            hi = k
            break
        lo = k
        if k == len(order):
            break
        k *= 2
    if hi is None:
        best = max(before, full_agreement) if full_agreement is not None else before
        where = f"all {len(order)} INT8 nodes back in FP32" if order else "no node in INT8"
        raise StageError(
            f"INT8: top-1 agreement with FP32 cannot reach min_agreement {cfg.min_agreement}: "
            f"best {best:.4f}, even with {where} (the check outputs hold NaN or differ from "
            "run to run); lower export.min_agreement"
        )
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid
        else:
            lo = mid
    m, out, nb = held
    back, found = _shrink_set(order[:hi], candidate, reference, cfg, _budget(len(order)))
    if found is not None:
        m, out, nb = found
    return m, out, nb, back


def _budget(n: int) -> int:
    """Candidates `_shrink_set` may spend after the prefix search: about two per halving of
    the node count, what it takes to isolate one culprit among n."""
    return 2 * max(1, int(np.ceil(np.log2(n + 1))))


def _shrink_set(back: list[str], candidate, reference, cfg, budget: int):
    """Fewer nodes back in FP32 than the prefix that held: delta debugging (Zeller and
    Hildebrandt, "Simplifying and Isolating Failure-Inducing Input", TSE 2002) over `back`,
    split into n chunks: a chunk alone that holds replaces `back`, else a complement that holds
    does, else the chunks halve; at most `budget` candidates. Chunks are tried from the tail:
    the bisection left `back` one node longer than a prefix that fails, so its last node
    matters, and a lone culprit is then found in about log2 N candidates.

    Why: the order ranks nodes by their own error, not by how much of it reaches the logits.
    A 4-block ViT's patch-embedding Conv had the smallest own error of its 26 nodes (1e-5)
    and alone flipped a check sample: the prefix search put all 26 back in FP32 to reach it,
    and the shrink finds that one. Returns (nodes, (model, outputs, bias-corrected) or None
    when `back` could not be shrunk)."""
    found, n = None, 2

    def holds(nodes: list[str]):
        m, out, nb = candidate(nodes, cfg.min_agreement)
        if out is None or not meets(out, reference, cfg.min_agreement):
            return None
        return m, out, nb

    while len(back) >= 2 and budget > 0:
        size = -(-len(back) // n)
        # the tail first: `back` ends with the node whose return made the prefix hold
        chunks = [back[i : i + size] for i in range(0, len(back), size)][::-1]
        trials = chunks + ([[x for x in back if x not in c] for c in chunks] if n > 2 else [])
        for i, trial in enumerate(trials):
            if budget <= 0:
                break
            budget -= 1
            got = holds(trial)
            if got is not None:
                back, found = trial, got
                n = 2 if i < len(chunks) else max(n - 1, 2)
                break
        else:
            if n >= len(back):
                break
            n = min(2 * n, len(back))
    return back, found


def _groups(q: Quantizer) -> list[list[str]]:
    """Quantizable nodes grouped by op type and weight shape, in graph order: repeated blocks
    (a ViT's 12 identical layers) are timed once per shape, so host timing costs one build per
    distinct layer shape, not one per node."""
    inits = {t.name: tuple(t.dims) for t in q.model.graph.initializer}
    groups: dict[tuple, list[str]] = {}
    for n in q.model.graph.node:
        if n.op_type in QUANTIZABLE:
            key = (n.op_type, inits.get(n.input[1]) if len(n.input) > 1 else None)
            groups.setdefault(key, []).append(n.name)
    return list(groups.values())
