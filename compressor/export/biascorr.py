"""Each INT8 node's own quantization error, measured in one ORT session, and empirical bias
correction (Nagel et al., "Data-Free Quantization Through Weight Equalization and Bias
Correction", ICCV 2019, §4.2): the mean shift quantization puts on each output channel,
absorbed by the bias that follows the node.

Part of the INT8 step: `int8` orders its fallback by these errors and keeps the correction
only where the check inputs say the file came closer to FP32.
"""

from __future__ import annotations

import copy
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from compresskit import _datapass
from compresskit.compressor.export import protos
from compresskit.compressor.export.checks import session
from compresskit.compressor.export.qdq import drop_unused, int8_compute_nodes


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
    # 4.0 GB to 0.56 GB, and the pass from 14.5 s to 10.7 s per 256 samples. `int8.choose` now
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
        drop_unused(g)
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
