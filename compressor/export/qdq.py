"""ORT's QDQ quantizer calibrated once, and the graph surgery around it: nodes excluded
from INT8 read FP32 tensors (`read_fp32`), Q/DQ pairs that serve no INT8 compute go
(`strip_orphan_qdq`), and a built file gets nodes back in FP32 without running the quantizer
again (`Quantizer.without`). ORT's quantizer is kept quiet (`quiet`).

Part of the INT8 step; `int8` decides which nodes `Quantizer.build` excludes.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from compresskit import _datapass
from compresskit.compressor.export import compat, protos, recurrent, tables
from compresskit.compressor.export.checks import activation_batch

QUANTIZABLE = ("Conv", "Gemm", "MatMul")


@dataclass(frozen=True)
class Scheme:
    """How tensors are quantized: ours (U8S8/U8U8, per-channel) or ORT's defaults."""

    name: str
    activation: str  # "QUInt8" | "QInt8"
    weight: str
    per_channel: bool
    reduce_range: bool = False


ORT_DEFAULT = Scheme("ort-default s8s8 per-tensor", "QInt8", "QInt8", per_channel=False)


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


def reader(x: np.ndarray, input_name: str, batch: int = 32):
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
        self.tick: Callable[[str], None] = lambda message: None  # the INT8 search's progress
        from onnxruntime.quantization import CalibrationMethod
        from onnxruntime.quantization.calibrate import create_calibrator
        from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

        model = _shape_inferred(prepared)
        # samples per ORT run: bounded memory
        self.batch = activation_batch(model, sample=calib.shape[1:])
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
                calibrator.collect_data(reader(calib, name, self.batch))
            self.ranges = calibrator.compute_data()
            del calibrator  # and its session, before the file it maps goes
        self.model = _shape_inferred(prepared)
        self.calib = calib  # bias correction measures on the same inputs
        # FP32 embedding tables left in a built file become int8 rows (`tables`), and LSTM
        # nodes DynamicQuantizeLSTM (`recurrent`); set by `int8.choose` when they hold the
        # floor on their own
        self.tables = False
        self.recurrent = False

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
            drop_unused(out.graph)
        if self.tables:
            tables.quantize_tables(out)
        if self.recurrent:
            recurrent.quantize_lstms_(out)
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
        shipped is then built by the quantizer and checked again (`int8._select`)."""
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
        drop_unused(g)
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
    left without a reader go with `strip_orphan_qdq` and `drop_unused`."""
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
        drop_unused(graph)  # the 8-bit constants and their DequantizeLinear nodes
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


def drop_unused(graph) -> None:
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
