"""Multiply-accumulate (MAC) counts of one forward pass, from a PyTorch model or an ONNX file,
so a benchmark can report MACs, FLOPs and the GFLOP/s a runtime achieves.

Only the layers that dominate inference count: convolutions and matrix products (Conv,
ConvTranspose, Linear, MultiheadAttention's projections and its two attention products,
LSTM/GRU/RNN gates at every step; in ONNX Conv, ConvTranspose, ConvInteger, QLinearConv, Gemm,
MatMul, MatMulInteger, QLinearMatMul, LSTM, GRU, RNN). A transposed convolution counts what it
computes: every input element times every weight of its group, (in / groups) x out x kernel per
input position, whatever its stride, padding or output padding crop or add. Elementwise work (bias
adds, BatchNorm, LayerNorm, activations, softmax, pooling, quantize/dequantize) and embedding
look-ups (a Gather, no arithmetic) are not MACs and are left out on both sides, so
`torch_macs(model) == onnx_macs(exported file)`; a QDQ INT8 file counts the same as its FP32
source, since its Conv/MatMul nodes keep their shapes.

FLOPs = 2 x MACs (one multiply and one add per MAC), the convention of most papers.

Limits: `torch_macs` sees layers through their `forward` (hooks), so a bare `torch.matmul` in a
user's `forward`, or a layer whose weight is used without calling it, is not counted
(nn.MultiheadAttention is counted as a whole: its out_proj is such a layer); attention over
padded keys counts every key, as the exported graph computes them; `onnx_macs` reads the main graph only (no If/Loop bodies).

onnx is imported inside functions, so `import compressor.flops` stays light.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from compresskit.models.errors import InputError, one_line

# ONNX op -> index of its weight input (the tensor whose shape gives the work per output).
CONV_OPS = {"Conv": 1, "ConvInteger": 1, "QLinearConv": 3}
# ConvTranspose's weight is (C, M / group, k1, ...): each input element scatters into
# prod(W.shape[1:]) outputs, so its MACs follow the input, not the output.
TRANSPOSED_OPS = {"ConvTranspose": 1}
RNN_OPS = ("LSTM", "GRU", "RNN")
# ONNX Runtime's LSTM with int8 weights (com.microsoft): the same inputs, W and R transposed
QUANT_LSTM = "DynamicQuantizeLSTM"
# ONNX op -> index of its right-hand input.
MATMUL_OPS = {"MatMul": 1, "MatMulInteger": 1, "QLinearMatMul": 3}


def flops(macs: int) -> int:
    """FLOPs of `macs` multiply-accumulates: one multiply and one add each."""
    return 2 * macs


# --- PyTorch --------------------------------------------------------------------------------


def _conv_macs(module: nn.Module, output: torch.Tensor) -> int:
    # Each output element sums over (in_channels / groups) x kernel products.
    per_out = module.in_channels // module.groups * math.prod(module.kernel_size)
    return output.numel() * per_out


def _transposed_macs(module: nn.Module, x: torch.Tensor) -> int:
    # Each input element is multiplied by out_channels / groups x kernel weights (the weight
    # is (in, out / groups, k...)); an unbatched input (C, ...) is one sample.
    per_in = module.out_channels // module.groups * math.prod(module.kernel_size)
    return x.numel() * per_in


def _linear_macs(module: nn.Module, output: torch.Tensor) -> int:
    # output.numel() = rows x out_features, each a dot product of length in_features.
    return output.numel() * module.in_features


def _attention_macs(module: nn.MultiheadAttention, args: tuple, kwargs: dict) -> int:
    """q/k/v projections, Q K^T and A V over all heads, and the output projection."""
    q, k = (args[i] if i < len(args) else kwargs[n] for i, n in enumerate(("query", "key")))
    e = module.embed_dim
    if q.dim() == 2:  # unbatched (L, E)
        batch, lq, lk = 1, q.shape[0], k.shape[0]
    elif module.batch_first:
        batch, lq, lk = q.shape[0], q.shape[1], k.shape[1]
    else:
        batch, lq, lk = q.shape[1], q.shape[0], k.shape[0]
    # bias_k/bias_v and add_zero_attn each append one key to attend to after the projections.
    keys = lk + (module.bias_k is not None) + bool(module.add_zero_attn)
    project = batch * (lq * e * e + lk * module.kdim * e + lk * module.vdim * e)
    attend = 2 * batch * lq * keys * e  # Q K^T and A V: head_dim x heads = e per pair
    return project + attend + batch * lq * e * e


def _rnn_macs(module: nn.RNNBase, x: torch.Tensor) -> int:
    """An LSTM's, GRU's or RNN's MACs: every step of every sequence multiplies the input and
    the hidden state by each layer's and direction's matrices (weight_ih, weight_hh and an
    LSTM's projection weight_hr), whose sizes already hold the gates. A PackedSequence counts
    its real steps."""
    if isinstance(x, nn.utils.rnn.PackedSequence):
        steps = int(x.batch_sizes.sum())
    elif x.dim() == 2:  # unbatched (T, F)
        steps = x.shape[0]
    else:
        steps = x.shape[0] * x.shape[1]
    per_step = sum(p.numel() for n, p in module.named_parameters() if n.startswith("weight_"))
    return steps * per_step


def torch_macs(model: nn.Module, example: torch.Tensor) -> int:
    """MACs of one forward pass of `model` on `example` (at the example's batch size;
    float images or int64 token ids, whatever the model reads).

    Counted with forward hooks on Conv1d/2d/3d, ConvTranspose1d/2d/3d, Linear,
    MultiheadAttention and LSTM/GRU/RNN modules,
    parametrized ones included (a parametrization subclasses the layer's class). A module
    called twice counts twice. The model runs once without autograd in eval mode; its
    train/eval flags are restored after, so BatchNorm statistics are left as they were.
    """
    return int(sum(module_macs(model, example).values()))


def module_macs(model: nn.Module, example: torch.Tensor) -> dict[str, int]:
    """`torch_macs` per module: {module name: its MACs} for every counted module the forward
    ran (a module called twice sums both calls)."""
    counts: dict[str, int] = {}
    names = {m: n for n, m in model.named_modules()}

    def add(module: nn.Module, macs: int) -> None:
        counts[names[module]] = counts.get(names[module], 0) + macs

    def hook(module, _inputs, output):
        linear = isinstance(module, nn.Linear)
        add(module, (_linear_macs if linear else _conv_macs)(module, output))

    def transposed_hook(module, args, _output):
        add(module, _transposed_macs(module, args[0]))

    def rnn_hook(module, args, _output):
        add(module, _rnn_macs(module, args[0]))

    def attention_hook(module, args, kwargs, _output):
        add(module, _attention_macs(module, args, kwargs))

    handles = []
    flags = {m: m.training for m in model.modules()}
    try:
        for m in model.modules():
            is_conv = isinstance(m, nn.modules.conv._ConvNd)
            if is_conv and m.transposed:
                handles.append(m.register_forward_hook(transposed_hook))
            elif is_conv or isinstance(m, nn.Linear):
                handles.append(m.register_forward_hook(hook))
            elif isinstance(m, nn.MultiheadAttention):
                handles.append(m.register_forward_hook(attention_hook, with_kwargs=True))
            elif isinstance(m, nn.RNNBase):
                handles.append(m.register_forward_hook(rnn_hook))
        model.eval()
        with torch.no_grad():
            model(example)
    finally:
        for h in handles:
            h.remove()
        for m, training in flags.items():
            m.training = training
    return {n: int(c) for n, c in counts.items()}


# --- ONNX -----------------------------------------------------------------------------------


def _fix_batch(model, batch: int, sample: tuple[int, ...] | None = None) -> None:
    """Make a symbolic (or 0) input dim concrete: the first `batch`, the others the sample
    shape's (`sample`, without the batch, when it has as many dims), else `batch` too; and
    forget the exporter's symbolic shapes so inference recomputes every intermediate from
    concrete inputs. (Taking the batch for a height or a sequence length counted 830M MACs
    for a 13M-MAC pass at batch 64: `bench` passes the data's sample shape.)"""
    from compresskit.compressor.export.protos import SEQUENCE, metadata, trained_length

    inits = {i.name for i in model.graph.initializer}
    # a token model's symbolic sequence axis: without a sample, the length it was trained on
    trained = trained_length(metadata(model))
    for value in model.graph.input:
        if value.name in inits:  # old IRs list initializers as inputs; they have real shapes
            continue
        dims = value.type.tensor_type.shape.dim
        per_sample = sample is not None and len(sample) == len(dims) - 1
        for i, dim in enumerate(dims):
            if dim.HasField("dim_param") or dim.dim_value == 0:
                # setting the value clears the dim_param (a oneof)
                if per_sample and i:
                    dim.dim_value = int(sample[i - 1])
                elif i and dim.dim_param == SEQUENCE and trained is not None:
                    dim.dim_value = trained
                else:
                    dim.dim_value = batch
    del model.graph.value_info[:]
    for value in model.graph.output:
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param"):
                dim.Clear()  # unknown: inference fills it in without a symbolic conflict


def _shapes(model) -> dict[str, tuple[int, ...]]:
    """Concrete shape of every value whose dims are all known."""
    graph = model.graph
    out: dict[str, tuple[int, ...]] = {i.name: tuple(i.dims) for i in graph.initializer}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        tt = value.type.tensor_type
        if not tt.HasField("shape"):
            continue
        dims = tt.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            out.setdefault(value.name, tuple(d.dim_value for d in dims))
    for node in graph.node:  # Constant nodes: their value's shape
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    out.setdefault(node.output[0], tuple(a.t.dims))
    return out


def _node_macs(node, shapes: dict[str, tuple[int, ...]], path: Path) -> int:
    op = node.op_type

    def shape(name: str) -> tuple[int, ...]:
        if name not in shapes:
            raise InputError(
                f"{path}: the shape of {name!r} (input/output of {op} node {node.name!r}) is "
                "unknown after shape inference; export the model with static shapes"
            )
        return shapes[name]

    if op in RNN_OPS or op == QUANT_LSTM:
        # X is (seq, batch, input), or (batch, seq, input) with layout = 1; W and R hold every
        # direction's gates: each step multiplies by both. Steps from X, or from Y, (seq,
        # directions, batch, hidden) or with layout = 1 (batch, seq, directions, hidden), when
        # inference leaves X's shape open (a Reshape the exporter computes).
        w, r = shape(node.input[1]), shape(node.input[2])
        layout = next((at.i for at in node.attribute if at.name == "layout"), 0)
        if node.input[0] in shapes:
            steps = math.prod(shapes[node.input[0]][:2])
        else:
            y = shape(node.output[0])
            steps = y[0] * (y[1] if layout else y[2])
        return steps * (math.prod(w) + math.prod(r))
    if op in TRANSPOSED_OPS:
        return math.prod(shape(node.input[0])) * math.prod(
            shape(node.input[TRANSPOSED_OPS[op]])[1:]
        )
    out = shape(node.output[0])
    if op in CONV_OPS:
        # W is (M, C/group, k1, k2, ...): each output element costs prod(W.shape[1:]) MACs,
        # which already accounts for groups (depthwise: C/group = 1).
        w = shape(node.input[CONV_OPS[op]])
        return math.prod(out) * math.prod(w[1:])
    if op == "Gemm":
        # K from B, a weight whose shape is always known (A's may not be: a Gather inference
        # leaves open), (K, N) or with transB (N, K).
        b = shape(node.input[1])
        trans_b = any(at.name == "transB" and at.i for at in node.attribute)
        return math.prod(out) * (b[1] if trans_b else b[0])  # Y is (M, N)
    # MatMul family: Y holds the broadcast batch dims and (M, N); each element is a length-K
    # dot product, K being A's last dim (a 1-D A is a vector of length K).
    a = shape(node.input[0])
    return math.prod(out) * a[-1]


def onnx_macs(path: Path | str, batch: int, sample: tuple[int, ...] | None = None) -> int:
    """MACs of one forward pass of the ONNX file at `path` for inputs of batch size `batch`
    (and, where the file leaves them symbolic, of `sample` shape after the batch).

    Symbolic (or 0) input dims become `batch` (the first) or `sample`'s, then `onnx.shape_inference` (with data
    propagation, for exporters that compute Reshape targets from Shape) gives every shape, and
    ONNX Runtime's symbolic shape inference the ones it leaves open.
    Counts Conv, ConvTranspose, ConvInteger, QLinearConv, Gemm, MatMul, MatMulInteger and QLinearMatMul nodes
    of the main graph; in a QDQ file DequantizeLinear -> Conv is still one Conv, counted once.
    """
    import onnx

    path = Path(path)
    if not isinstance(batch, int) or batch < 1:
        raise InputError(f"{path}: batch {batch!r} must be a whole number >= 1")
    if not path.is_file():
        raise InputError(f"{path}: no such file; give an .onnx model")
    try:
        model = onnx.load(str(path))
    except Exception as e:
        raise InputError(
            f"{path}: not an ONNX model ({type(e).__name__}); give an .onnx file"
        ) from None
    _fix_batch(model, batch, sample)
    fixed = model
    try:
        model = _infer_shapes(model)
    except Exception as e:
        msg = one_line(e, 160)
        raise InputError(f"{path}: shape inference failed at batch {batch} ({msg})") from None
    shapes = _shapes(model)
    counted = {*CONV_OPS, *TRANSPOSED_OPS, "Gemm", *MATMUL_OPS, *RNN_OPS}

    def counts(n) -> bool:
        if n.op_type == QUANT_LSTM:
            return n.domain == "com.microsoft"
        return n.op_type in counted and n.domain in ("", "ai.onnx")

    nodes = [n for n in model.graph.node if counts(n)]
    if any(name and name not in shapes for n in nodes for name in (*n.input, *n.output)):
        shapes = {**_symbolic_shapes(fixed), **shapes}
    return int(sum(_node_macs(node, shapes, path) for node in nodes))


def _infer_shapes(model):
    """ONNX shape inference (with data propagation), each DynamicQuantizeLSTM (a com.microsoft
    op ONNX cannot infer) first written back as the LSTM it is: FP32 zeros of W's and R's
    shapes, the same attributes, so the layers after it (Reshapes computed from its output's
    shape) resolve too and it counts as the LSTM's MACs. `model` is changed in place: it is
    the caller's copy, read for shapes only."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type != QUANT_LSTM or n.domain != "com.microsoft":
            continue
        inputs = list(n.input[:8])
        for k in (1, 2):  # int8 W [dirs, input, 4 hidden] and R [dirs, hidden, 4 hidden]
            t = inits.get(inputs[k])
            if t is None:
                break
            d, i, g = t.dims
            name = f"{inputs[k]}__as_float"
            model.graph.initializer.append(
                numpy_helper.from_array(np.zeros((d, g, i), np.float32), name)
            )
            inputs[k] = name
        else:
            del n.input[:]
            n.input.extend(inputs)
            n.op_type, n.domain = "LSTM", ""
    return onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)


def _symbolic_shapes(model) -> dict[str, tuple[int, ...]]:
    """Shapes from ONNX Runtime's symbolic shape inference, where ONNX's own leaves some open
    (a Hugging Face BERT's attention MatMuls, after Reshapes it computes from Shape ops: bench
    showed no MACs for its ONNX files). {} when it fails too; the caller then names the value
    it lacks."""
    import contextlib
    import io

    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        with contextlib.redirect_stdout(io.StringIO()):  # it prints what it cannot infer
            from compresskit.models.fileio import scratch_cwd

            with scratch_cwd():  # where it saves its debug file when it gives up
                return _shapes(SymbolicShapeInference.infer_shapes(model, auto_merge=True))
    except Exception:  # another exporter's graph it cannot follow
        return {}
