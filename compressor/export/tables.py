"""Embedding tables in 8 bits: row-wise INT8 for the FP32 tables an INT8 file still holds.

ORT's QDQ quantizer stores a table read by Gather in 8 bits only when the Gather sits inside an
INT8 region; a text model's token table feeds a LayerNorm (FP32 glue, `qdq.op_types_for`), so
it stayed FP32 and dominated the "INT8" file: `textcls`'s 64,000-weight table left the file at
460 KB of FP32's 573 KB, and in a BERT with a 30,522-token vocabulary the table is most of the
weights. Here each such table becomes int8 rows with one FP32 scale per row (symmetric,
scale = max |row| / 127), the layout of FBGEMM's row-wise 8-bit embeddings (Guan et al., "Post-
Training 4-bit Quantization on Embedding Tables", 2019, measured row-wise 8 bits as lossless
on recommendation models):

    ids -> Gather(table int8 [V, D]) -> Cast(float) -> Mul -> the old output
    ids -> Gather(scales [V, 1]) ----------------------^

Per row, not per tensor: rows differ in norm (a padding row of zeros, rare tokens near zero),
and one scale for all would round a small row to nothing. Only opset-1 ops (Gather, Cast, Mul):
every ONNX Runtime build, mobile and web, runs them; a gathered row is dequantized on the fly,
so the FP32 table never exists at run time. Pruned zeros stay exactly zero. `int8.choose`
keeps the rewrite only when the file still holds its agreement floor with FP32.
"""

from __future__ import annotations

import numpy as np

from compresskit.compressor.export import protos

# Tables smaller than this stay FP32: the three nodes and the scales outweigh the bytes saved.
MIN_ELEMENTS = 1024


def quantize_tables(model, min_elements: int = MIN_ELEMENTS) -> dict[str, int]:
    """Rewrite, in place, every Gather (axis 0) of a 2-D FP32 initializer of at least
    `min_elements` values that nothing but such Gathers reads, into int8 rows with per-row
    scales. Returns {initializer: elements} of the tables rewritten."""
    import onnx
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    readers: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    # Graph outputs, overridable initializers (also graph inputs) and names read inside
    # If/Loop bodies keep their FP32 tensor: rewriting those would change what they see.
    outputs = {o.name for o in graph.output} | {i.name for i in graph.input}
    outputs |= _names_in_subgraphs(graph)

    def row_gather(n) -> bool:
        axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
        return n.op_type == "Gather" and n.domain in ("", "ai.onnx") and axis == 0

    taken = set(inits) | {o for n in graph.node for o in n.output} | {i.name for i in graph.input}

    def fresh(name: str) -> str:
        while name in taken:
            name += "_"
        taken.add(name)
        return name

    done: dict[str, int] = {}
    after: dict[int, list] = {}  # node index -> the nodes that follow it
    for name, t in inits.items():
        users = readers.get(name, [])
        if (
            t.data_type != onnx.TensorProto.FLOAT
            or len(t.dims) != 2
            or int(np.prod(t.dims)) < min_elements
            or name in outputs
            or not users
            or not all(row_gather(n) and name not in n.input[1:] for n in users)
        ):
            continue
        table = numpy_helper.to_array(t).astype(np.float32)
        scale = np.abs(table).max(axis=1, keepdims=True) / 127.0
        scale[scale == 0] = 1.0  # an all-zero row: any scale, its codes are 0
        q = np.clip(np.rint(table / scale), -127, 127).astype(np.int8)
        q_name, s_name = fresh(f"{name}_quantized"), fresh(f"{name}_row_scale")
        graph.initializer.append(numpy_helper.from_array(q, q_name))
        graph.initializer.append(numpy_helper.from_array(scale.astype(np.float32), s_name))
        for i, g in enumerate(graph.node):
            if not (row_gather(g) and g.input[0] == name):
                continue
            out, ids, tag = g.output[0], g.input[1], g.name or g.output[0]
            rows, fl, scales = fresh(f"{out}_int8"), fresh(f"{out}_float"), fresh(f"{out}_scale")
            g.input[0], g.output[0] = q_name, rows
            after[i] = [
                helper.make_node("Gather", [s_name, ids], [scales], name=fresh(f"{tag}_scales")),
                helper.make_node(
                    "Cast", [rows], [fl], name=fresh(f"{tag}_cast"), to=onnx.TensorProto.FLOAT
                ),
                helper.make_node("Mul", [fl, scales], [out], name=fresh(f"{tag}_dequantize")),
            ]
        done[name] = int(table.size)
    if done:
        # each Gather's three nodes right after it: the graph stays topologically sorted
        nodes = []
        for i, n in enumerate(graph.node):
            nodes.append(n)
            nodes += after.get(i, [])
        nodes = [_copy(n) for n in nodes]
        del graph.node[:]
        graph.node.extend(nodes)
        protos.keep_only(graph.initializer, lambda t: t.name not in done)
        live = {o for n in graph.node for o in n.output}
        protos.keep_only(graph.value_info, lambda v: v.name in live)
    return done


def _names_in_subgraphs(graph) -> set[str]:
    names: set[str] = set()
    for n in graph.node:
        for g in protos.subgraphs(n):
            for m in g.node:
                names.update(m.input)
            names |= _names_in_subgraphs(g)
    return names


def int8_rows(model) -> dict[str, int]:
    """{table: elements} of the tables `quantize_tables` rewrote in `model`."""
    inits = {t.name: t for t in model.graph.initializer}
    return {
        name.removesuffix("_quantized"): int(np.prod(t.dims))
        for name, t in inits.items()
        if name.endswith("_quantized") and name.removesuffix("_quantized") + "_row_scale" in inits
    }


def _copy(node):
    import onnx

    c = onnx.NodeProto()
    c.CopyFrom(node)
    return c
