"""How an INT8 file is judged against FP32: ONNX Runtime sessions in the file's reference
semantics or this host's kernels, and top-1 agreement with FP32 that ties do not count against
and that must hold on new inputs too (`expected_agreement`'s one-sided bound).

Part of the INT8 step (`int8` chooses; this module measures). Pure numpy but for `session`
and `outputs`, which run ORT.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from compresskit import _datapass

# Two classes whose reference logits are closer than TIE x the largest |logit| are a tie:
# the FP32 ONNX file's own tolerance against PyTorch (1e-4 of the logit scale).
TIE = 1e-4
Z95 = 1.6449  # one-sided 95%: the expected agreement's lower bound (`expected_agreement`)
# Activation bytes one ORT run over calibration or check inputs may hold (`activation_batch`).
ORT_BUDGET = 32 << 20


def decision_threads() -> int:
    """The ORT threads of every check and decision run: torch's intra-op count (its default is
    one per usable core; `OMP_NUM_THREADS` sets it), recorded as the report's `torch_threads`."""
    import torch

    return max(1, torch.get_num_threads())


def session(model: bytes | str | Path, optimized: bool, threads: int = 0, lean: bool = False):
    """ORT CPU session. optimized=False runs the graph as written (no fusion into integer
    kernels): the reference semantics; True is what this host's ORT does by default.
    `threads` 0: torch's intra-op thread count (`decision_threads`), not ORT's default of one
    per physical core. Why: the last bits of some outputs depend on the count (LeNet-300-100's
    INT8 file: up to 1.9e-6 apart between 1 and 2 threads, as written and fused), and the
    INT8 choice, its agreement and error figures are computed from them; at torch's count,
    `OMP_NUM_THREADS` or a container's cores move both alike, so "the same number of torch
    threads" is the whole condition for the same files and figures. Timing pins one thread
    (`int8.paired_rounds`). `lean`:
    ORT's priority-based node order, which runs a node as soon as its inputs are ready and so
    frees them early (for graphs with many side branches, as `biascorr.node_errors` builds)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if lean:
        opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    opts.intra_op_num_threads = threads or decision_threads()
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 4  # errors come back as exceptions, not log lines
    if not optimized:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    src = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])


def activation_batch(
    model, cap: int = 32, budget: int = ORT_BUDGET, least: int = 4, sample: tuple = ()
) -> int:
    """Samples per ORT run over `model` (a shape-inferred ModelProto: `quant_pre_process`'s
    output) for its activations to stay within `budget`: twice the bytes per sample of every
    tensor the graph computes, `least` to `cap`. Why the sum and not the largest tensor: the
    calibration session (optimizations off, every tensor reduced) keeps them all. Measured on
    a 0.13M-weight residual CNN at 3x32x32 (5.0 MB of tensors per sample), calibration at 32
    samples a run peaked 338 MB over its start, at 8 samples 88 MB, and took no longer; on
    ViT-tiny (2 cores) 32 samples peaked 962 MB over in 2.6 s, 4 samples 205 MB in 2.4 s, and
    1 sample 176 MB in 3.1 s: below a few samples ORT's per-run cost shows, hence `least`.
    `sample`: the shape of one input sample the runs feed (no batch axis), which gives the
    input's symbolic dimensions (a token model's `sequence`) their values, and through them
    shape inference's expressions of them ("sequence + 1", "Min(33, sequence + 1)").
    Where a tensor's shape or a non-batch dimension stays open, the size is unknown: `cap`,
    the fixed batch used before (32 samples a calibration run)."""
    from onnx import helper

    names: dict[str, int] = {}
    batch = None  # the input's symbolic batch dimension
    if model.graph.input and model.graph.input[0].type.tensor_type.HasField("shape"):
        first, *dims = model.graph.input[0].type.tensor_type.shape.dim
        if first.dim_param:  # one sample: a tensor laid out (L, 4 * batch, d) holds 4 L d
            batch = first.dim_param
            names[batch] = 1
        for d, n in zip(dims, sample, strict=False):
            if d.dim_param and d.dim_param != batch:
                names[d.dim_param] = int(n)
    per_sample = 0
    for v in [*model.graph.value_info, *model.graph.output]:
        t = v.type.tensor_type
        if not t.HasField("shape"):
            return cap
        dims = list(t.shape.dim)
        if dims and (batch is None or dims[0].dim_param == batch):
            dims = dims[1:]  # the batch (in a graph of a fixed batch, the first dimension)
        size = 1
        for d in dims:
            n = d.dim_value if d.dim_value > 0 else _evaluate(d.dim_param, names)
            if n is None or n <= 0:
                return cap
            size *= n
        per_sample += size * helper.tensor_dtype_to_np_dtype(t.elem_type).itemsize
    if per_sample == 0:
        return cap
    return max(min(least, cap), min(cap, budget // (2 * per_sample)))


def _evaluate(expression: str, names: dict[str, int]) -> int | None:
    """The value of a symbolic dimension ("sequence", "sequence + 1", "Min(33, sequence + 1)",
    "2*sequence", "floor(sequence/2)") given `names`' values; None for anything else. Parsed,
    never eval'ed: integers, names, + - * / // %, Min, Max, floor, ceiling."""
    import ast
    import math

    calls = {"Min": min, "Max": max, "floor": math.floor, "ceiling": math.ceil}
    ops = {
        ast.Add: lambda a, b: a + b,
        ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b,
        ast.FloorDiv: lambda a, b: a // b,
        ast.Mod: lambda a, b: a % b,
    }

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name) and node.id in names:
            return names[node.id]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left), value(node.right))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in calls
            and node.args
            and not node.keywords
        ):
            return calls[node.func.id](*(value(a) for a in node.args))
        raise ValueError(node)

    if not expression or len(expression) > 200:
        return None
    try:
        n = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, TypeError, ZeroDivisionError, RecursionError):
        return None
    return int(n) if n == int(n) else None


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
    return int(np.sum(top2_gap(reference) <= tie_tolerance(reference)))


def top2_gap(logits: np.ndarray) -> np.ndarray:
    """Per sample, the largest logit minus the second largest (0 with a single class)."""
    flat = logits.reshape(len(logits), -1)
    if flat.shape[1] < 2:
        return np.zeros(len(flat))
    top = np.partition(flat, -2, axis=1)[:, -2:]
    return top[:, 1] - top[:, 0]
