"""The fallback search: the fewest INT8 nodes back in FP32 for which top-1 agreement with
FP32 holds its floor. Prefixes of an order (output layers first, then the largest own error,
or each node's effect on the logits) grow 1, 2, 4, ... until one holds, bisection finds the
shortest, and delta debugging (Zeller and Hildebrandt, "Simplifying and Isolating
Failure-Inducing Input", TSE 2002) shrinks that set where the order missed. Each candidate is
one run over the check inputs, cut short once the floor is out of reach (`outputs_above`).

Part of the INT8 step: `int8._select` makes the candidates and calls `fall_back`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from compresskit import _datapass
from compresskit.compressor.export.biascorr import NodeError
from compresskit.compressor.export.checks import disagrees, floor_agreement, meets, tie_tolerance
from compresskit.compressor.export.qdq import QUANTIZABLE
from compresskit.models.errors import StageError

FIRST_BATCH = 8  # the fallback search's first check batch; later ones double (`outputs_above`)


@_datapass.counted
def outputs_above(sess, x: np.ndarray, reference: np.ndarray, floor: float, batch: int = 64):
    """`outputs`, or None as soon as more samples disagree with `reference` than top-1
    agreement `floor` allows on the whole of `x`: a candidate that fails stops early (most of
    the fallback search's candidates fail, and the runs over the check inputs are its cost).

    Batches grow 8, 16, 32, ... up to `batch`: `int8.choose` sorts the check inputs most fragile
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


def fall_back(order: list[str], candidate, reference, cfg, before: float):
    """The fewest nodes back to FP32, in `fallback_order`, for which the floor holds: prefixes
    of 1, 2, 4, ... nodes until one holds, then bisection between the last that failed and the
    first that held. O(log N) candidates, each one QDQ rewrite and one run over the check
    inputs that stops once the floor is out of reach (agreement is not monotone in the
    prefix: bisection finds a prefix that holds whose one-shorter prefix does not). Returns
    (model, outputs, bias-corrected, the nodes back in FP32) of the candidate kept;
    StageError when even every node back in FP32 misses the floor.

    `candidate(nodes, floor)` builds the file with `nodes` back in FP32 and returns (model,
    outputs on the check inputs or None once they cannot hold `floor`, bias-corrected); the
    model is passed through untouched (`int8._select`'s candidates return None there, to hold no
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
