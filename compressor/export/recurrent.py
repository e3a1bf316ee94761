"""LSTM layers in 8 bits: ONNX Runtime's dynamic quantization for the nodes QDQ leaves FP32.

ORT's static QDQ quantizer has no LSTM, GRU or RNN operator: a recurrent model's "INT8" file
kept every recurrent matrix in FP32, 99.6% of a keyword-spotting LSTM's weights, and shipped at
the FP32 file's size while ORT's own `quantize_dynamic` of the same file was 3.6x smaller.
ORT's dynamic path does have an LSTM: `DynamicQuantizeLSTM` (com.microsoft), int8 weights with
per-tensor scales, the activations quantized to uint8 on the fly at each step (Jacob et al.,
"Quantization and Training of Neural Networks for Efficient Integer-Arithmetic-Only
Inference", CVPR 2018, for the affine scheme; ORT's kernel for the integer matmuls). GRU and
the plain RNN have no such kernel in ORT and stay FP32.

`quantize_lstms_` rewrites only the LSTM nodes of a model that may already hold QDQ units
(the file `int8.choose` builds), through ORT's own `ONNXQuantizer` in its dynamic mode, as
`quantize_dynamic(op_types_to_quantize=["LSTM"])` does. `int8.choose` keeps the rewrite only
when the file still holds its agreement floor with FP32 (decided before the compute nodes, as
for embedding tables).
"""

from __future__ import annotations

from typing import Any

LSTM = "LSTM"
KERNEL = "DynamicQuantizeLSTM"


def lstm_weights(model: Any) -> dict[str, int]:
    """{LSTM node's first output: weights in its W and R initializers} of a model's main
    graph."""
    inits = {t.name: t for t in model.graph.initializer}
    out = {}
    for n in model.graph.node:
        if n.op_type == LSTM and n.domain in ("", "ai.onnx"):
            count = 0
            for name in n.input[1:3]:  # W, R
                if name in inits:
                    count += _numel(inits[name])
            out[n.output[0]] = count  # by output: the rewrite renames the node
    return out


def _numel(t: Any) -> int:
    n = 1
    for d in t.dims:
        n *= d
    return n


def quantize_lstms_(model: Any) -> dict[str, int]:
    """Rewrite, in place, each LSTM of `model` (a ModelProto) whose weights are initializers as
    a `DynamicQuantizeLSTM` (int8 weights); returns {first output: weights} of those rewritten
    ({} and `model` untouched when it has none), as `tables.quantize_tables` does for tables."""
    import copy

    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization.onnx_quantizer import ONNXQuantizer
    from onnxruntime.quantization.quant_utils import QuantizationMode

    from compresskit.compressor.export.qdq import quiet

    found = {k: v for k, v in lstm_weights(model).items() if v}
    if not found:
        return {}
    # ORT's quantizer works on a copy: it also rewrites every Gemm as MatMul + Add (breaking
    # the QDQ unit of a Gemm already in INT8, which ONNX Runtime 1.17.3 then aborted on when
    # optimizing), so only its LSTM nodes are taken (`_transplant`).
    with quiet():  # "check if the model is already quantized": it holds QDQ units
        quantizer = ONNXQuantizer(
            copy.deepcopy(model),
            False,  # per_channel: ORT's DynamicQuantizeLSTM takes per-tensor scales
            False,  # reduce_range
            QuantizationMode.IntegerOps,
            False,  # static: no calibration, activations quantized at run time
            QuantType.QInt8,
            QuantType.QUInt8,  # the only activation type of ORT's dynamic kernels
            None,
            [],
            [],
            [LSTM],
            {"MatMulConstBOnly": True},
        )
        quantizer.quantize_model()
    quantized = quantizer.model.model
    kernels = {n.output[0]: n for n in quantized.graph.node if n.op_type == KERNEL}
    rewritten = {k: v for k, v in found.items() if k in kernels}
    if rewritten:
        _transplant_(model, quantized, kernels, rewritten)
    return rewritten


def _transplant_(model: Any, quantized: Any, kernels: dict, rewritten: dict[str, int]) -> None:
    """Replace, in `model`, each rewritten LSTM by its DynamicQuantizeLSTM from `quantized`,
    with the int8 weights, scales and zero points it reads; nothing else changes."""
    from compresskit.compressor.export import protos

    g = model.graph
    have = {t.name for t in g.initializer}
    extra = {t.name: t for t in quantized.graph.initializer}
    for n in g.node:
        if n.op_type == LSTM and n.output and n.output[0] in rewritten:
            k = kernels[n.output[0]]
            n.CopyFrom(k)
            for name in k.input:
                if name and name not in have and name in extra:
                    g.initializer.append(extra[name])
                    have.add(name)
    read = {x for n in g.node for x in n.input} | {o.name for o in g.output}
    for sub in (s for n in g.node for s in protos.subgraphs(n)):
        read |= {x for n in sub.node for x in n.input}
    protos.keep_only(g.initializer, lambda t: t.name in read)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.add(domain="com.microsoft", version=1)


def int8_lstms(model: Any, original: Any) -> dict[str, int]:
    """{output: weights} of the DynamicQuantizeLSTM nodes in `model`, weights counted in
    `original` (the FP32 graph) where its LSTM wrote the same output."""
    weights = lstm_weights(original)
    return {
        n.output[0]: weights.get(n.output[0], 0)
        for n in model.graph.node
        if n.op_type == KERNEL and n.domain == "com.microsoft"
    }
