"""How long each layer of a PyTorch model takes where it will run: ONNX Runtime's CPU provider,
batch 1, one thread, as the INT8 (or FP32) file the export stage would write.

MACs say how much work a layer does, not how long it takes. On ResNet-18 at 32x32 (VNNI CPU,
INT8, batch 1) the last stage's 3x3 convolutions run on a 1x1 feature map: ORT's QLinearConv
does a matrix-vector product per image, bound by reading 2.4 MB of weights, and took 82 us for
2.36M MACs where a first-stage convolution took 17 us for the same MACs. Every node also has a
fixed cost (a 1x1 shortcut of 0.13M MACs took 7 us, and 5.5 us at 38% of its channels). So
structured pruning that cuts MACs evenly does not cut time evenly: the channels stage asks
this module for each layer's measured time and cuts where the time is (`compressor.channels`).

    times = measure(model, example, tmp, export_cfg, quant, calib)
    times.run_us            # one whole run, the executor included, no profiler
    times.layers            # {module name: us per run of the kernel that computes it}

Kernels are matched to modules through the weight each ONNX node reads: the exporter keeps
the parameter's name ("stages.3.layers.0.conv.weight"), the INT8 file's DequantizeLinear reads
it under a suffix, and ORT names a fused kernel after the node it replaced plus a suffix
("node_Conv_330_token_66", "node_MatMul_95/MatMulAddFusion"), or, for FP32 convolutions in its NCHWc layout, after the tensor
the fused node writes ("relu_11_nchwc"). Only compute kernels (Conv, Gemm, MatMul and their
fused and quantized forms) are matched; the rest (adds, pooling, quantize/dequantize) is
`other_us`, which the channels stage models as a whole, with the executor's time.

The file profiled has every quantizable node in INT8 with this build's own scheme, as the
unthinned file `compressor.measure.speedup` times: the shipped file may use ORT's default scheme or
keep a few nodes in FP32 after the agreement search.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from compresskit import _datapass
from compresskit.compressor import export
from compresskit.compressor.export import int8
from compresskit.compressor.measure import latency, ortprofile, speedup

RUNS = 200  # batch-1 runs profiled (~0.2 s on ResNet-18); the mean per kernel is kept
RUN_SECONDS = 0.3  # then whole runs timed without the profiler, the p50 kept
WEIGHT_OPS = {"Conv": 1, "ConvInteger": 1, "QLinearConv": 3, "Gemm": 1, "MatMul": 1}
WEIGHTED = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, nn.MultiheadAttention)
# Nodes between a weight initializer and the compute node that reads it.
PASS_THROUGH = {"DequantizeLinear", "Transpose", "Cast", "Reshape", "Identity"}
# Elementwise nodes ORT fuses into the Conv before it (the fused node writes their output).
FUSED_AFTER = {"Relu", "Clip", "LeakyRelu", "Sigmoid", "HardSigmoid", "Add", "Mul", "Sum"}
# Kernels (ORT's op names after its fusions) that compute a Conv, Gemm or MatMul.
COMPUTE = {
    "Conv", "FusedConv", "NchwcConv", "QLinearConv", "ConvInteger", "Gemm", "FusedGemm", "QGemm",
    "MatMul", "FusedMatMul", "QLinearMatMul", "MatMulInteger", "MatMulIntegerToFloat",
    "DynamicQuantizeMatMul",
}  # fmt: skip


@dataclass(frozen=True)
class LayerTimes:
    """One profile: microseconds per batch-1 run."""

    total_us: float  # whole profiled runs (ORT's model_run spans, profiler overhead included)
    layers: dict[str, float]  # module name -> its kernel's time, profiled
    other_us: float  # profiled kernels no module owns
    file: str  # "int8" or "fp32": which file was profiled
    run_us: float  # p50 of whole runs without the profiler: what an app waits for


def measure(
    model: nn.Module,
    example: torch.Tensor,
    tmp: Path,
    export_cfg: export.ExportConfig,
    quant: int8.QuantConfig | None,
    calib: np.ndarray | None,
    runs: int = RUNS,
) -> LayerTimes:
    """Export `model` (and quantize it with `quant`'s scheme, calibrated on `calib`, every
    quantizable node INT8, as the unthinned file `compressor.measure.speedup` times), profile `runs`
    batch-1 runs, and give each module its kernel's time; then time whole runs without the
    profiler (it adds about a microsecond per node: on a thinned ResNet-18 the profiled run
    took 380 us and the plain one 215). Files go to `tmp` and are removed."""
    fp32, quantized = tmp / ".layertime.fp32.onnx", tmp / ".layertime.int8.onnx"
    made = [fp32, quantized]  # removed whatever happens, a half-written file included
    x = example[:1]
    # Exported from two samples: torch.export fixes a batch dimension of size 1, and the file
    # must take the calibration batches too.
    pair = torch.cat([x, x]) if len(example) < 2 else example[:2]
    try:
        path = export.export_onnx(model, pair, fp32, export_cfg)  # exports an eval-mode copy
        kind = "fp32"
        if quant is not None and calib is not None:
            path = speedup.all_int8(path, quantized, calib, quant)
            kind = "int8"
        with _datapass.data_pass():  # the model runs on inputs, as INT8 timing does
            prof = ortprofile.profile_nodes(path, x.numpy(), runs=runs)
            call = latency.onnx_runner(path, x.numpy(), threads=1)
            run_us = 1000 * latency.p50_ms([call], RUN_SECONDS)[0]
        kernels = {k: rec["op_type"] for k, rec in prof["nodes"].items()}
        weighted = {n for n, m in model.named_modules() if isinstance(m, WEIGHTED)}
        owners = kernel_owners(path, kernels, weighted, fp32 if kind == "int8" else None)
    finally:
        for p in made:
            p.unlink(missing_ok=True)
    layers: dict[str, float] = {}
    other = 0.0
    for kernel, rec in prof["nodes"].items():
        owner = owners.get(kernel)
        if owner is None:
            other += rec["us_per_run"]
        else:
            layers[owner] = layers.get(owner, 0.0) + rec["us_per_run"]
    return LayerTimes(prof["session_us_per_run"], layers, other, kind, run_us)


def node_owners(graph, modules: set[str]) -> dict[str, str]:
    """ONNX node name -> the module whose weight it reads, for Conv/Gemm/MatMul nodes."""
    producer = {out: n for n in graph.node for out in n.output}
    inits = {i.name for i in graph.initializer}
    owners = {}
    for node in graph.node:
        at = WEIGHT_OPS.get(node.op_type)
        if at is None or len(node.input) <= at:
            continue
        name = node.input[at]
        for _ in range(4):  # back through DequantizeLinear / Transpose to the initializer
            if name in inits or name not in producer:
                break
            up = producer[name]
            if up.op_type not in PASS_THROUGH or not up.input:
                break
            name = up.input[0]
        if name not in inits:
            continue  # an activation: QK^T, or a matmul of two computed tensors
        owner = _module_of(name, modules) or _scoped(node, modules)
        if owner is not None:
            owners[node.name] = owner
    return owners


def _scoped(node, modules: set[str]) -> str | None:
    """The deepest module in the node's name scopes (torch's exporter records them): for a
    Linear on 3-D inputs, exported as a MatMul whose weight was transposed into a constant
    named after nothing ("val_31")."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                return None
            return next((m for m in reversed(scopes) if m in modules and m), None)
    return None


def _module_of(weight: str, modules: set[str]) -> str | None:
    """'a.b.conv.weight_quantized' -> 'a.b.conv' when the model has that module."""
    base = weight.split("_quantized")[0]
    for suffix in (".weight", ".in_proj_weight", ".weight_orig"):
        if base.endswith(suffix) and base[: -len(suffix)] in modules:
            return base[: -len(suffix)]
    return None


def kernel_owners(
    path: Path, kernels: dict[str, str], modules: set[str], source: Path | None = None
) -> dict[str, str]:
    """Kernel name -> module name, for the compute kernels (`kernels`: name -> ORT op type, as
    the profiler reports them) that compute a module's Conv/Gemm/MatMul. `source`: the FP32
    file an INT8 `path` was quantized from; the quantizer keeps node names but drops the name
    scopes and renames transposed weights, so its nodes' owners fill in."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    owners = node_owners(graph, modules)
    if source is not None:
        fp32 = node_owners(onnx.load(str(source), load_external_data=False).graph, modules)
        owners = fp32 | owners
    producer = {out: n for n in graph.node for out in n.output}
    names = sorted(owners, key=len, reverse=True)  # longest first: node_Conv_330 before _33
    found = {}
    for k, op in kernels.items():
        if op not in COMPUTE:
            continue
        node = k.removeprefix("fused ")  # ORT's FusedGemm: "fused node_linear_12"
        if node in owners:
            found[k] = owners[node]
            continue
        hit = next((n for n in names if node.startswith((n + "_", n + "/"))), None)
        if hit is None and node.endswith("_nchwc"):
            hit = _fused_into(node.removesuffix("_nchwc"), producer, owners, set(kernels))
        if hit is not None:
            found[k] = owners[hit]
    return found


def _fused_into(
    tensor: str, producer: dict, owners: dict[str, str], kernels: set[str]
) -> str | None:
    """The Conv node whose fused kernel writes `tensor`: its producer, or the Conv behind the
    activation/add ORT fused into it."""
    for _ in range(3):
        node = producer.get(tensor)
        if node is None:
            return None
        if node.name in owners:
            return node.name
        if node.op_type not in FUSED_AFTER or not node.input:
            return None
        # An Add fused into a Conv reads that Conv's output; when both inputs come from Convs
        # (a downsampling block), the other one has a kernel of its own
        convs = [i for i in node.input if i in producer and producer[i].name in owners]
        alone = [i for i in convs if f"{i}_nchwc" not in kernels]
        tensor = (alone or convs or list(node.input))[0]
    return None
