"""Static INT8 (QDQ) files chosen for the device that runs them, reproducibly.

ONNX Runtime's own quantizer (`onnxruntime.quantization`) writes the Q/DQ nodes; this module
decides which Conv/Gemm/MatMul nodes keep INT8 (`choose`). The parts it joins live beside it:

    qdq        ORT's quantizer calibrated once; graph surgery (FP32 reads, orphan Q/DQ)
    checks     sessions, and top-1 agreement with FP32: ties, the bound on new inputs
    biascorr   each node's own error in one session; empirical bias correction
    fallback   the fewest nodes back in FP32 for the floor: prefixes, bisection, ddmin

What the step does, and why:

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
  holds, then delta debugging within that prefix (`fallback._shrink_set`, about 2 log2 N more
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

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from compresskit import _datapass
from compresskit.compressor import stats
from compresskit.compressor.export import recurrent, tables
from compresskit.compressor.export.biascorr import (
    apply_bias_shifts,
    apply_bias_shifts_,
    node_errors,
)
from compresskit.compressor.export.checks import (
    agreement,
    expected_agreement,
    floor_agreement,
    meets,
    outputs,
    session,
    ties,
    top2_gap,
)
from compresskit.compressor.export.fallback import (
    effect_order,
    fall_back,
    fallback_order,
    output_layers,
    outputs_above,
)
from compresskit.compressor.export.qdq import (
    ORT_DEFAULT,
    QUANTIZABLE,
    Quantizer,
    Scheme,
    int8_compute_nodes,
)
from compresskit.models.errors import InputError

METHODS = ("minmax", "entropy", "percentile")
TARGETS = ("mobile", "host")
SCHEMES = ("u8s8", "u8u8")
# host: FP32 replaces INT8 only when the whole 95% interval of the paired latency ratio
# FP32/INT8 lies below 1 - MARGIN.
MARGIN = 0.05
ROUNDS = 9  # paired timing rounds per decision
ROUND_S = 0.08  # seconds of interleaved runs per round
# A fallback that left fewer than half the nodes in INT8 searches again in an order measured
# on the logits (`effect_order`), each node alone in INT8 on this many most fragile check inputs.
EFFECT_SAMPLES = 32


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


def scheme_for(cfg: QuantConfig, reduce_range: bool) -> Scheme:
    weight = "QInt8" if cfg.scheme == "u8s8" else "QUInt8"
    channel = "per-channel" if cfg.per_channel else "per-tensor"
    rr = ", 7-bit weights" if reduce_range else ""
    return Scheme(f"{cfg.scheme} {channel}{rr}", "QUInt8", weight, cfg.per_channel, reduce_range)


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
    # embedding tables stored as int8 rows (`tables`): {initializer: elements}
    tables: dict[str, int] = field(default_factory=dict)
    tables_fp32: str = ""  # why tables that could be 8-bit stay FP32, when they do
    # LSTM nodes as DynamicQuantizeLSTM, int8 weights (`recurrent`): {output: weights}
    lstms: dict[str, int] = field(default_factory=dict)
    lstms_fp32: str = ""  # why LSTMs that could be 8-bit stay FP32, when they do


PROGRESS_EVERY_S = 10.0  # a line at most this often while the INT8 search goes on


class _Ticker:
    """`say(message)` passed on at most every `PROGRESS_EVERY_S` seconds: the fallback
    search and the host timing run for a minute or more on a big model (98 s silent on a
    41M-weight BERT)."""

    def __init__(self, progress: Callable[[str], None] | None):
        self.progress = progress
        self.last = time.monotonic()

    def __call__(self, message: str) -> None:
        now = time.monotonic()
        if self.progress is not None and now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            self.progress(message)


def choose(
    prepared: Path,
    fp32: bytes | Path,
    calib: np.ndarray,
    check_x: np.ndarray,
    cfg: QuantConfig,
    cpu_flags: set[str],
    ir_version: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> Choice:
    """Pick the INT8 file for `cfg.target` among our scheme and ORT's default.

    The file shipped holds top-1 agreement >= cfg.min_agreement with FP32 on `check_x` (nodes
    go back to FP32 until it does; with none left in INT8 no file ships). StageError when even
    the all-FP32 graph misses the floor: the check itself is then broken (NaN, a runtime that
    answers differently from run to run). `progress` hears how the search goes, at most every
    `PROGRESS_EVERY_S` seconds."""
    rr = resolve_reduce_range(cfg, cpu_flags)
    host = cfg.target == "host"
    q = Quantizer(prepared, calib, cfg.method)
    q.tick = _Ticker(progress)
    # Every check run at the calibration's activation-sized batch: at 64 samples a run,
    # EfficientNet-B0's fallback search (unfused Q/DQ graphs) peaked ~150 MiB over its
    # start. Outputs do not depend on the batch (compared bit for bit on four models).
    reference = outputs(session(fp32, optimized=host), check_x, q.batch)
    timing_x = check_x[: cfg.batch] if len(check_x) >= cfg.batch else check_x
    # The check inputs nearest a tie first (smallest gap between FP32's top two logits): a
    # fallback candidate that misses the floor then meets the disagreements that rule it out
    # early and stops (`outputs_above`); agreement and MSE do not depend on the order.
    fragile = np.argsort(top2_gap(reference), kind="stable")
    check_x, reference = check_x[fragile], reference[fragile]
    rows_fp32 = _table_rows(q, reference, check_x, cfg)
    lstms_fp32 = _lstms_fp32(q, reference, check_x, cfg)
    started = [
        _select(q, s, reference, check_x, timing_x, cfg, fp32, ir_version)
        for s in (scheme_for(cfg, rr), ORT_DEFAULT)
    ]
    tie = 0.0 if host else 1 / max(len(check_x), 1)
    whys = _searched(started, tie)
    selections = [st.finish(why) for st, why in zip(started, whys, strict=True)]
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
    else:
        best = max(selections, key=preference)
    # A file whose compute all went back to FP32 still ships when its tables or its LSTMs
    # are 8-bit.
    rows = tables.int8_rows(best.model) if best.model is not None else {}
    lstms = recurrent.int8_lstms(best.model, q.model) if best.model is not None else {}
    shipped = best.model if best.int8_nodes or rows or lstms else None
    reason = "" if shipped is not None else no_int8_reason(best, cfg.min_agreement, len(check_x))
    return Choice(
        shipped,
        best,
        candidates,
        len(q.nodes),
        rr,
        "host" if host else "reference",
        reason,
        ties(reference),
        rows,
        rows_fp32,
        lstms,
        lstms_fp32,
    )


def _table_rows(q: Quantizer, reference, x, cfg: QuantConfig) -> str:
    """Whether the FP32 embedding tables go into every candidate as int8 rows (`tables`):
    yes ("") when the FP32 graph with only its tables in 8 bits holds the floor, else why
    not. A table the quantizer stores in 8 bits itself (inside an INT8 region) stays so.
    Decided before the compute nodes, so the fallback search judges them with the tables as
    shipped: decided after, a textcls file whose search had stopped at the floor's edge
    missed it (its 95% lower bound) and kept its 64,000-weight table FP32."""
    probe = copy.deepcopy(q.model)
    rows = tables.quantize_tables(probe)
    if not rows:
        return ""
    missed = _misses(probe, reference, x, q, cfg)
    q.tables = not missed
    return f"{', '.join(rows)} stay FP32: with only them as int8 rows, {missed}" if missed else ""


def _lstms_fp32(q: Quantizer, reference, x, cfg: QuantConfig) -> str:
    """Whether LSTM nodes go into every candidate as DynamicQuantizeLSTM (`recurrent`): yes
    ("") when the FP32 graph with only them in 8 bits (and the tables, when they are) holds
    the floor, else why not. Decided before the compute nodes, as the tables are."""
    if not any(recurrent.lstm_weights(q.model).values()):
        return ""  # no copy of a model without LSTMs (every CNN's INT8 step)
    probe = copy.deepcopy(q.model)
    if q.tables:
        tables.quantize_tables(probe)
    done = recurrent.quantize_lstms_(probe)
    if not done:
        return ""
    missed = _misses(probe, reference, x, q, cfg)
    q.recurrent = not missed
    return f"{len(done)} LSTM node(s) stay FP32: with only them in INT8, {missed}" if missed else ""


def weight_groups(model, nodes: Sequence[str]) -> dict[str, list[str]]:
    """{node: the nodes of `nodes` that read the same weight initializer, first in `nodes`'
    order first} for each node of `nodes`; a node whose weight no other reads is alone. The
    weight: the node's initializer inputs in the FP32 graph `model` (a Gemm's or Conv's
    weight and bias, a MatMul's constant side)."""
    inits = {t.name for t in model.graph.initializer}
    by_name = {n.name: n for n in model.graph.node}
    key = {}
    for name in nodes:
        n = by_name.get(name)
        weights = tuple(sorted(i for i in n.input if i in inits)) if n is not None else ()
        key[name] = weights or (name,)
    together: dict[tuple, list[str]] = {}
    for name in nodes:
        together.setdefault(key[name], []).append(name)
    return {name: together[key[name]] for name in nodes}


def _misses(probe, reference, x, q: Quantizer, cfg: QuantConfig) -> str:
    """ "" when `probe` (a model) holds the agreement floor on `x`, else which figure missed."""
    got = outputs(session(probe.SerializeToString(), optimized=cfg.target == "host"), x, q.batch)
    if meets(got, reference, cfg.min_agreement):
        return ""
    return missed_floor(
        agreement(got, reference), *expected_agreement(got, reference), cfg.min_agreement
    )


WHOLE_MODEL = "whole model: "  # the reason given when host timing found all of INT8 slower


def no_int8_reason(best: Selection, floor: float, samples: int | None = None) -> str:
    """One line on why `best` ships no INT8 file. It names the figure that missed: the
    agreement counted on the check inputs can be 1.0000 while the 95% lower bound of the one
    expected on new inputs misses the floor (a small ViT on 160 validation samples). Host
    timing that found the INT8 file slower decides last, so it is named first. With fewer
    check `samples` than one disagreement's worth of the floor, it says so: on 40 validation
    samples a floor of 0.995 allows none, and a ResNet-50's 93%-agreeing, 2.6x faster file
    was searched for a minute and not shipped without a word of why."""
    reasons = sorted(set(best.fp32_nodes.values()))
    slower = [r for r in reasons if r.startswith(WHOLE_MODEL)]
    if slower:
        return slower[0]
    if not best.fallen_back:
        return reasons[0] if reasons else "no quantizable node"
    missed = missed_floor(
        best.agreement_before_fallback,
        best.expected_before_fallback,
        best.expected_low_before_fallback,
        floor,
    )
    few = ""
    if samples and (samples - 1) / samples < floor:  # one disagreement already misses it
        few = (
            f" ({samples} check samples: one disagreement is {1 / samples:.1%}, more than the "
            f"{1 - floor:.1%} the floor allows; give more validation data, e.g. an npz x_val, "
            "or lower export.min_agreement)"
        )
    return (
        f"with every node in INT8, {missed}; it held only with all {best.fallen_back} INT8 "
        f"nodes back in FP32{few}"
    )


def missed_floor(counted: float, expected: float, low: float, floor: float) -> str:
    """Which figure missed the floor, in words: the agreement counted on the check inputs, or
    the 95% lower bound of the one expected on new inputs while the counted one held."""
    if counted < floor:
        return f"top-1 agreement with FP32 {counted:.4f}, below min_agreement {floor}"
    return (
        f"top-1 agreement with FP32 {counted:.4f} on the check inputs, but on new inputs "
        f"{expected:.4f} expected with a 95% lower bound of {low:.4f}, below min_agreement "
        f"{floor} (more validation samples narrow the bound)"
    )


def preference(s: Selection) -> tuple:
    """Which selection ships off the host target: more INT8 compute first, then agreement,
    then uint8 activations (ORT's NNAPI EP runs QDQ units with uint8 activations only: an
    s8s8 file won a tie on its logits' error and then ran on the CPU on Android), then logits
    closer to FP32."""
    return (s.int8_nodes, s.agreement, s.scheme.activation == "QUInt8", -s.mse)


def _searched(started: list[_Started], tie: float = 0.0) -> list[str]:
    """Which schemes' fallback is searched: "" for those, else why not. The search dominates
    the INT8 step (ViT-tiny: 27 candidates a scheme, each a full run over the check inputs),
    and with two schemes it ran twice. A scheme that holds the floor with every node in INT8
    needs none, and one that misses it cannot then win (it can only end with fewer INT8
    nodes); when both miss, only the one whose all-INT8 file stands closer to the floor is
    searched. Within `tie` of each other (the mobile target: one check sample's worth) they
    stand equally close, and uint8 activations go first, as in `preference`: a KWS model's
    s8s8 file shipped NNAPI "no", chosen by 0.0002 on 60 samples. Other ties: the recipe's
    own scheme. On the real-models matrix this kept every model's INT8 node count but one (a
    32-node SE-ResNet: 1 node instead of 2)."""
    held = [st for st in started if st.holds]
    if held:
        return [
            ""
            if st.holds
            else f"it misses the floor with every node in INT8 "
            f"({st.floor:.4f}) while {held[0].scheme.name} holds it"
            for st in started
        ]
    top = max(st.floor for st in started)
    near = [st for st in started if st.floor >= top - tie]
    # the first on ties: ours
    best = max(near, key=lambda st: (tie > 0 and st.scheme.activation == "QUInt8", st.floor))
    if len(near) > 1 and tie > 0:
        return [
            ""
            if st is best
            else f"both schemes miss the floor with every node in INT8, within one check "
            f"sample of each other ({best.floor:.4f} vs {st.floor:.4f}), and "
            f"{best.scheme.name} has uint8 activations, which ORT's NNAPI EP takes"
            for st in started
        ]
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
        return outputs_above(
            session(model.SerializeToString(), optimized=host), x, reference, floor, q.batch
        )

    model = build()
    latency = None
    if host:  # latency first: it does not depend on the bias values
        for group in _groups(q):
            if all(n in excluded for n in group):
                continue
            cand = build(group)
            q.tick(f"INT8 ({scheme.name}): timing each node in INT8 against FP32, {builds} built")
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
                if not exact:  # the file for the nodes found, made once at the end
                    q.tick(
                        f"INT8 ({scheme.name}): finding the nodes that go back to FP32 for the "
                        f"floor: candidate {searched}, {len(back)} of {len(int8)} nodes back"
                    )
                return (m if exact else None), out, nb

            int8 = [n.name for n in int8_compute_nodes(model.graph)]
            # a node without a measured error (no FP32 twin found) goes last
            order = fallback_order(
                {n: e for n, e in errors.items() if n in int8}, q.nodes, output_layers(q.model)
            )
            order += [n for n in int8 if n not in order]
            # Nodes that read one weight go back together (a cell stepped in a loop: one Gemm
            # per step): a GRUCell over 50 steps searched 101 nodes one by one, 144 s.
            group = weight_groups(q.model, list(dict.fromkeys([*order, *int8])))

            def members(units: Sequence[str]) -> list[str]:
                return [n for u in units for n in group[u]]

            def grouped(units: Sequence[str], floor: float | None, exact: bool = False):
                return candidate(members(units), floor, exact)

            def units(nodes: Sequence[str]) -> list[str]:
                return list(dict.fromkeys(group[n][0] for n in nodes))

            model = None  # the search starts from `uncorrected`
            _, got, n_bias, fallen = fall_back(units(order), grouped, reference, cfg, floor)
            fallen = members(fallen)
            how = "the output layers, then the nodes of largest own error (normalised MSE)"
            if 2 * len(fallen) > len(int8) >= 4:
                # Own error is not what reaches the logits: an EfficientNet-B0 file kept 0 of
                # 82 nodes in INT8 in that order and 26 in the order of each node's effect
                # alone (2 and 9 in the matrix's shrink; docs/benchmarks.md).
                few = x[:EFFECT_SAMPLES]

                def alone(u: str) -> float:  # the unit's nodes alone in INT8
                    mine = set(group[u])
                    out = run(make([o for o in int8 if o not in mine])[0], few)
                    return float(np.mean((out - reference[: len(few)]) ** 2))

                effects = {}
                every = units(int8)
                for i, u in enumerate(every, 1):
                    q.tick(
                        f"INT8 ({scheme.name}): each node's effect alone on the logits, "
                        f"{i} of {len(every)}"
                    )
                    effects[u] = alone(u)
                searched += len(effects)
                second = fall_back(effect_order(effects, q.nodes), grouped, reference, cfg, floor)
                if len(members(second[3])) < len(fallen):
                    _, got, n_bias, fallen = second
                    fallen = members(fallen)
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


def _closeness(got: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    return agreement(got, reference), -float(np.mean((got - reference) ** 2))


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
