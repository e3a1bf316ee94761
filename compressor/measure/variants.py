"""What `compress bench` measures: model files turned into runnable variants.

An input is a `.pt` checkpoint (also `.pth`, `.ckpt`, `.bin`, `.safetensors`), an `.onnx` or
`.ort` file, or a `compress shrink` output folder
(then every model in it: `model.pt`, `model.fp32.onnx`, `model.int8.onnx`, `model.int8.ort`,
or `model.fp32.ort` where shrink wrote no INT8 file, and the `--fixed-batch` file, timed at its
batch only; `student.*` where it distilled). Each file
becomes one `Model` (format, precision, bytes, parameters, input shape and kind: float32
images or int64 token ids with the vocabulary they index), and each model on each runtime one
`Variant`: PyTorch eager FP32 (and bf16 where the CPU has native bf16), ONNX Runtime on the CPU provider,
and on CUDA/TensorRT when present.
A runtime that is asked for but missing is returned as a skip with its reason, never an error.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compresskit.compressor.export.protos import SEQUENCE, trained_length
from compresskit.models import checkpoint, safeload
from compresskit.models.errors import InputError, one_line
from compresskit.models.zoo import ModelSpec

# model.* from a shrink of the checkpoint's own model, student.* from one that distilled
SHRINK_FILES = tuple(
    f"{stem}.{f}"
    for stem in ("model", "student")
    for f in (
        "pt", "fp32.onnx", "int8.onnx", "int8.ort", "fp32.ort", "int8.fixed.onnx", "fp32.fixed.onnx"
    )
)  # fmt: skip
SUFFIXES = (".pt", ".onnx", ".ort")
# other spellings of those kinds: torch's .pth, and any case (UP.ONNX)
ALIASES = {".pth": ".pt", ".ckpt": ".pt", ".bin": ".pt", ".safetensors": ".pt"}
# (a Lightning .ckpt, transformers' pytorch_model.bin and model.safetensors: `shrink` read
# them and bench called them "unknown file type")


def file_kind(path: Path) -> str:
    """The model kind a file's suffix names, as one of SUFFIXES (or the suffix, lower-cased,
    when it names none)."""
    suffix = Path(path).suffix.lower()
    return ALIASES.get(suffix, suffix)


# --providers names -> ONNX Runtime execution providers; "torch" runs PyTorch eager.
PROVIDERS = {
    "torch": None,
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
# What `compress bench` asks for without --providers: those absent here come back as skips.
DEFAULT_PROVIDERS = "torch,cpu,cuda,tensorrt"
INPUT_TYPES = ("tensor(float)", "tensor(int64)")  # float32 images, int64 token ids
_QUANT_OPS = {
    "QuantizeLinear",
    "DequantizeLinear",
    "QLinearConv",
    "QLinearMatMul",
    "ConvInteger",
    "MatMulInteger",
    "DynamicQuantizeLinear",
    "DynamicQuantizeLSTM",  # an LSTM with int8 weights (compress's INT8 files, ORT's dynamic)
}


@dataclass
class Model:
    """One model file."""

    path: Path
    format: str  # "pytorch" | "onnx" | "ort"
    precision: str  # "fp32" | "int8"
    bytes: int  # what the model weighs: the file, or a checkpoint's tensors alone
    parameters: int | None
    in_shape: tuple[int, ...] | None  # without the batch axis; None: unknown (dynamic dims)
    label: str  # short name for tables: "student.int8.onnx", "teacher.pt"
    spec: ModelSpec | None = None
    state: Any = None  # the checkpoint, for PyTorch models
    fixed_batch: int | None = None  # a file exported with a fixed batch size runs only at it
    source: Path | None = None  # the FP32 file an INT8 file was made from, when known
    tokens: bool = False  # its one input is int64 token ids (N, L), not float32 (N, C, H, W)
    vocab: int | None = None  # token models: ids 0..vocab-1 are valid, when the file says so
    file_bytes: int | None = None  # the file on disk, when it differs from `bytes`
    # token models: the file takes 1..in_shape[0] tokens (a symbolic sequence axis)
    dynamic_sequence: bool = False

    def __post_init__(self) -> None:
        if self.file_bytes is None:
            self.file_bytes = self.bytes


@dataclass
class Variant:
    """A model on one runtime: what one row of the bench table measures."""

    model: Model
    runtime: str  # "torch" | "cpu" | "cuda" | "tensorrt" (keys of PROVIDERS)
    precision: str  # the model's, or "bf16" for PyTorch autocast
    device: str = "cpu"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def provider(self) -> str:
        if self.runtime == "torch":
            return f"pytorch-{self.device}"
        return PROVIDERS[self.runtime]

    @property
    def name(self) -> str:
        return f"{self.model.label} [{self.precision}, {self.provider}]"


def parse_providers(text: str) -> list[str]:
    """`torch,cpu,cuda` -> the runtime names, refusing unknown ones."""
    names = [p.strip().lower() for p in text.split(",") if p.strip()]
    aliases = {v.lower(): k for k, v in PROVIDERS.items() if v}
    out = []
    for n in names:
        n = aliases.get(n.lower(), n)
        if n not in PROVIDERS:
            raise InputError(
                f"--providers: unknown provider {n!r}; give some of {', '.join(PROVIDERS)}"
            )
        out.append(n)
    if not out:
        raise InputError(f"--providers: empty; give some of {', '.join(PROVIDERS)}")
    return list(dict.fromkeys(out))


def expand(paths: list[Path]) -> list[Path]:
    """Files to measure, folders expanded to the shrink outputs they hold, in a stable order."""
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            found = [p / n for n in SHRINK_FILES if (p / n).is_file()]
            if not found:
                raise InputError(
                    f"{p}: a folder without compress shrink outputs ({', '.join(SHRINK_FILES)})"
                )
            out += found
        elif not p.exists():
            raise InputError(f"{p}: no such file or folder")
        elif file_kind(p) == ".dcz":
            raise InputError(
                f"{p}: a compress archive, which no runtime runs; decode it first "
                f"(compress decode {p}, which writes {p.with_suffix('.decoded.pt')}) and bench "
                "the .pt"
            )
        elif file_kind(p) not in SUFFIXES:
            raise InputError(
                f"{p}: unknown file type {p.suffix or '(none)'}; give a .pt checkpoint, an "
                ".onnx or .ort file, or a compress shrink folder"
            )
        else:
            out.append(p)
    return list(dict.fromkeys(out))


def load(
    path: Path,
    model: str | None = None,
    data=None,
    model_kwargs: dict | None = None,
    trust: bool = False,
) -> Model:
    """Describe one model file (InputError for a file that cannot be benchmarked). `model`
    (and `model_kwargs`) name the class or factory of a bare state_dict (with `data`, a
    Dataset, for its shapes); `trust` allows importing the code a checkpoint names."""
    data_shape = tuple(data.in_shape) if data is not None else None
    size = path.stat().st_size
    label = path.name
    if file_kind(path) == ".pt":
        ck = checkpoint.load(path, train_state=False)
        spec = ck.spec
        if spec is None:
            if not model:
                raise InputError(
                    f"{path}: a bare state_dict does not name its model; pass --model NAME "
                    "(model= in Python)"
                )

            if data is None:
                raise InputError(f"{path}: a bare state_dict with --model also needs --data SPEC")
            spec = ck.spec_for(model, dict(model_kwargs or {}), data_shape, data.num_classes)
        net = ck.build_model(spec, allow_import=trust or model == spec.name)
        shape = tuple(spec.kwargs.get("in_shape") or ()) or (
            tuple(net.in_shape) if hasattr(net, "in_shape") else data_shape
        )
        params = sum(p.numel() for p in net.parameters())
        tokens, vocab = _torch_tokens(spec, net, data)
        kind = {"tokens": tokens, "vocab": vocab}
        if tokens and len(shape) == 1:  # as compress's export of it does, where it can
            kind["dynamic_sequence"] = _takes_shorter(net, shape[0])
        # A checkpoint's file also holds the optimizer state (for --resume: 3x the weights
        # after Adam): its size is the tensors the model needs, as an ONNX file's would be.
        # A tied weight once (two names, one tensor), as shrink counts it: it was counted twice
        # (53,552 B against shrink's 36,648 for a decoder tied to its embedding).
        tensors = {
            (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape): t
            for t in net.state_dict().values()
            if t.numel()
        }
        weights = sum(t.numel() * t.element_size() for t in tensors.values())
        return Model(
            path, "pytorch", "fp32", weights, params, shape, label, spec, net, **kind,
            file_bytes=size,
        )  # fmt: skip
    return _onnx_model(path, size, label)


# Op types only a quantized graph holds (QDQ, or the QLinear/integer kernels ORT fuses them to).
QUANTIZED_OPS = (
    b"QuantizeLinear", b"QLinear", b"QGemm", b"MatMulInteger", b"ConvInteger", b"DynamicQuantizeLSTM"
)  # fmt: skip


def _ort_quantized(path: Path) -> bool:
    """Whether an .ort file's op-type strings name quantized ops (searched on the mapped file,
    not read whole)."""
    import mmap

    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return False
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return any(m.find(op) >= 0 for op in QUANTIZED_OPS)


def _takes_shorter(net, length: int) -> bool:
    """Whether a PyTorch token model answers sequences shorter than the `length` it was built
    for (1 token and half of it): then bench scores it on shorter data, as it does the ONNX
    files compress exports of it ("takes inputs of shape (24,)" refused a folder benched on
    16-token queries, the files of which took them)."""
    import torch

    if length < 2:
        return False
    was = net.training
    try:
        with torch.no_grad():
            net.eval()
            for n in (1, length // 2):
                out = net(torch.ones((1, n), dtype=torch.long))
                if not isinstance(out, torch.Tensor) or out.dim() != 2:
                    return False
        return True
    except Exception:  # a model that reshapes by its length: exactly that length
        return False
    finally:
        net.train(was)


def _torch_tokens(spec: ModelSpec, net, data) -> tuple[bool, int | None]:
    """(reads token ids?, how many ids it embeds) of a PyTorch model: a zoo model says what it
    reads, and so does a class with an `input_kind` attribute ("image" or "tokens"); another
    one reads token ids when the data are token ids, or, without data, when it has an
    nn.Embedding."""
    from compresskit.models import zoo
    from compresskit.models.data import embedding_rows

    rows = embedding_rows(net)
    kind = getattr(net, "input_kind", None)
    if not spec.is_import_path:
        tokens = zoo.input_kind(spec.name) == "tokens"
    elif kind in zoo.INPUT_KINDS:
        tokens = kind == "tokens"
    elif data is not None:
        tokens = data.is_tokens
    else:
        tokens = rows is not None
    return tokens, rows if tokens else None


def disambiguate(models: list[Model]) -> list[Model]:
    """Labels are file names; where two inputs share one (two shrink folders), they become
    paths relative to the inputs' common folder, which are unique."""
    import os

    names = [m.label for m in models]
    if len(set(names)) < len(names):
        try:
            common = os.path.commonpath([str(m.path.resolve().parent) for m in models])
        except ValueError:  # Windows: files on two drives share no folder
            common = None
        for m in models:
            if names.count(m.label) > 1:
                where = m.path.resolve()
                m.label = str(where) if common is None else os.path.relpath(where, common)
    return models


def _onnx_model(path: Path, size: int, label: str) -> Model:
    # Every ONNX/ORT file is loaded in ONNX Runtime once here, so a file it cannot run, or one
    # that does not take a single float32 or int64 tensor, is refused before any timing (exit 2).
    session = _ort_session(path)
    inputs = session.get_inputs()
    if len(inputs) != 1 or inputs[0].type not in INPUT_TYPES:
        got = ", ".join(f"{i.name}: {i.type}" for i in inputs)
        raise InputError(
            f"{path}: takes {got}; compress bench feeds one input tensor: float32 images "
            "(N, C, H, W) or int64 token ids (N, L), the padding mask derived inside the model"
        )
    tokens = inputs[0].type == "tensor(int64)"
    first, *dims = inputs[0].shape
    shape = tuple(dims) if all(isinstance(d, int) for d in dims) else None
    trained = trained_length(session.get_modelmeta().custom_metadata_map)
    dynamic_sequence = tokens and dims == [SEQUENCE] and trained is not None
    if dynamic_sequence:  # compress's export: 1..L tokens, L the length trained on
        shape = (trained,)
    fixed = first if isinstance(first, int) and first > 0 else None
    sibling = path.with_name(path.name.replace(".int8.", ".fp32.").replace(".ort", ".onnx"))
    source = sibling if ".int8." in path.name and sibling.is_file() else None
    if file_kind(path) == ".ort":
        # The ORT format keeps no ONNX graph to inspect; its flatbuffer holds the op types as
        # strings, though. A renamed INT8 file (mobile.ort) was labelled fp32 by its name.
        precision = "int8" if ".int8" in path.name or _ort_quantized(path) else "fp32"
        return Model(
            path, "ort", precision, size, None, shape, label, fixed_batch=fixed, source=source,
            tokens=tokens, dynamic_sequence=dynamic_sequence,
        )  # fmt: skip
    import onnx

    # Shapes and types only: its external data (weights perhaps larger than memory) stays on
    # disk, and counts in the bytes it ships.
    proto = onnx.load(str(path), load_external_data=False)
    size += safeload.external_data_bytes(proto, path.parent)
    precision = onnx_precision(proto)
    params = onnx_parameters(proto)
    vocab = onnx_vocab(proto) if tokens else None
    return Model(
        path, "onnx", precision, size, params, shape, label, fixed_batch=fixed, source=source,
        tokens=tokens, vocab=vocab, dynamic_sequence=dynamic_sequence,
    )  # fmt: skip


def onnx_precision(proto) -> str:
    """The arithmetic an ONNX file's weights are in, read from the graph: "int4" (ORT's
    weight-only MatMulNBits, or QDQ with 4-bit zero points), "int16" (16-bit QDQ), "int8"
    (QDQ or ORT's integer ops), "fp16" (mostly float16 initializers), else "fp32". Only
    "int8" is timed against the INT8 matmul peak and compared with its FP32 file; the label
    was "int8" for every quantized file and "fp32" for float16 and MatMulNBits ones."""
    from onnx import TensorProto

    from compresskit.compressor.export.protos import zero_point_types

    nodes = list(proto.graph.node)
    nbits = [n for n in nodes if n.op_type == "MatMulNBits"]
    if nbits:
        bits = next((a.i for a in nbits[0].attribute if a.name == "bits"), 4)
        return f"int{bits}"
    inits = {i.name for i in proto.graph.initializer}
    qdq = [n for n in nodes if n.op_type in ("QuantizeLinear", "DequantizeLinear")]

    # The weights' width names the file (A16W8 is int8 arithmetic, W4A8 int4 weights): the
    # zero points of the DequantizeLinear nodes that read an initializer, else all of them.
    weights = [n for n in qdq if n.op_type == "DequantizeLinear" and n.input[0] in inits]
    kinds = zero_point_types(proto.graph, weights) or zero_point_types(proto.graph, qdq)
    if kinds & {TensorProto.INT16, TensorProto.UINT16}:
        return "int16"
    if kinds & {TensorProto.INT4, TensorProto.UINT4}:
        return "int4"
    if {n.op_type for n in nodes} & _QUANT_OPS:
        return "int8"
    sizes = {TensorProto.FLOAT: 0, TensorProto.FLOAT16: 0}
    for i in proto.graph.initializer:
        if i.data_type in sizes:
            sizes[i.data_type] += math.prod(i.dims)
    return "fp16" if sizes[TensorProto.FLOAT16] > sizes[TensorProto.FLOAT] else "fp32"


def onnx_vocab(proto) -> int | None:
    """Rows of the embedding table the graph input indexes: the smallest first dimension of an
    initializer that a Gather node looks the input up in (None when no Gather reads it
    directly). A QDQ file's table may sit behind a DequantizeLinear, which is followed back."""
    graph = proto.graph
    inits = {t.name: tuple(t.dims) for t in graph.initializer}
    made_by = {o: n for n in graph.node for o in n.output}
    source = graph.input[0].name
    rows = []
    for n in graph.node:
        if n.op_type != "Gather" or len(n.input) < 2 or n.input[1] != source:
            continue
        table = n.input[0]
        dq = made_by.get(table)
        if dq is not None and dq.op_type == "DequantizeLinear":
            table = dq.input[0]
        if inits.get(table):
            rows.append(inits[table][0])
    return min(rows) if rows else None


def onnx_parameters(proto) -> int:
    """Weights and biases in the file: initializers, less quantization scales and zero points
    (the second and third inputs of Q/DQ nodes) and shape constants (int64)."""
    from onnx import TensorProto

    aux = {
        name
        for n in proto.graph.node
        if n.op_type in ("QuantizeLinear", "DequantizeLinear")
        for name in n.input[1:]
    }
    total = 0
    for t in proto.graph.initializer:
        if t.name in aux or t.data_type == TensorProto.INT64:
            continue
        n = 1
        for d in t.dims:
            n *= d
        total += n
    return total


def _ort_session(path: Path, providers=("CPUExecutionProvider",), threads: int = 1):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 4  # errors come back as exceptions, not log lines
    try:
        return ort.InferenceSession(str(path), opts, providers=list(providers))
    except Exception as e:
        raise InputError(f"{path}: ONNX Runtime cannot load it ({one_line(e)})") from None


def variants(models: list[Model], runtimes: list[str]) -> tuple[list[Variant], list[dict]]:
    """Each model on each requested runtime that can run it; the rest as skips with a reason."""
    import onnxruntime as ort
    import torch

    from compresskit.compressor.measure import envinfo

    available = set(ort.get_available_providers())
    out: list[Variant] = []
    skipped: list[dict] = []

    def skip(m: Model, runtime: str, reason: str, precision: str | None = None) -> None:
        provider = PROVIDERS[runtime] or "pytorch-cpu"
        if runtime == "cuda" and m.format == "pytorch":
            provider = "pytorch-cuda"
        skipped.append(
            {
                "variant": f"{m.label} [{precision or m.precision}, {provider}]",
                "model": m.label,
                "provider": provider,
                "precision": precision or m.precision,
                "reason": reason,
            }
        )

    for m in models:
        runs_on = {"pytorch": ("torch", "cuda")}.get(m.format, ("cpu", "cuda", "tensorrt"))
        if not set(runtimes) & set(runs_on):
            skip(
                m,
                runtimes[0],
                f"{m.format} files run on {', '.join(runs_on)}; add one to --providers",
            )
            continue
        for rt in runtimes:
            if m.format == "pytorch":
                if rt == "torch":
                    out.append(Variant(m, "torch", "fp32"))
                    if envinfo.bf16_supported():
                        out.append(Variant(m, "torch", "bf16"))
                    else:
                        skip(
                            m,
                            rt,
                            "CPU has no native bf16 (avx512_bf16/AMX): it would be emulated",
                            "bf16",
                        )
                elif rt == "cuda":
                    if torch.cuda.is_available():
                        out.append(Variant(m, "torch", "fp32", device="cuda"))
                    else:
                        skip(m, rt, "no CUDA device visible to PyTorch")
                continue  # cpu/tensorrt are ONNX Runtime providers
            if rt == "torch":
                continue
            provider = PROVIDERS[rt]
            if m.format == "ort" and rt in ("cuda", "tensorrt"):
                # An .ort file is ORT Mobile's, laid out for the CPU EP (and NNAPI/CoreML). On a
                # lent H100, ORT 1.31.1 crashed the process (SIGSEGV) building a CUDA session
                # from our INT8 .ort, where the same .onnx was refused with an error. Its .onnx
                # twin is the file to time on a GPU.
                skip(m, rt, "an .ort file is for ORT Mobile's CPU EP; bench its .onnx on a GPU")
                continue
            if provider not in available:
                hint = " (install onnxruntime-gpu)" if rt in ("cuda", "tensorrt") else ""
                skip(m, rt, f"onnxruntime {ort.__version__} has no {provider}{hint}")
                continue
            out.append(Variant(m, rt, m.precision))
    return out, skipped
