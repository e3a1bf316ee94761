"""PyTorch -> ONNX FP32 -> INT8 ONNX, with ONNX Runtime's own quantizer, and the checks that
say the files still answer like the model.

* `export_onnx`: `torch.onnx.export` to one self-contained file (no external data), a dynamic
  batch axis (and for token ids a dynamic sequence axis, checked), exactly the opset asked for
  (read back; converted, or refused before any work by `probe_opset`), the lowest IR version that declares it unless one is given (9 for ONNX
  Runtime 1.15-1.17), and only the opset imports its nodes use. Every file passes
  `onnx.checker.check_model(full_check=True)` and loads in ORT.
* `quantize_int8`: static QDQ quantization of a `preprocess`ed model through
  `compressor.export.int8` (which also chooses the nodes that stay FP32 for a target).
* `parity`: accuracy, top-1 agreement and max |delta logit| of a file against the model, as
  written (reference semantics) or on this host's optimized kernels.
* `weight_invariants`: pruned zeros stay zero and shared layers keep <= 2^bits values, read
  back from the exported file.

onnx and onnxruntime are imported inside functions, so `import compressor` stays light.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import math
import tempfile
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from compresskit import _datapass, _mem
from compresskit.compressor import prune
from compresskit.compressor.export import checks, compat, int8, protos, qdq
from compresskit.compressor.export.protos import SEQUENCE, SEQUENCE_KEY
from compresskit.models.errors import InputError, StageError, one_line
from compresskit.models.fileio import atomic_path, scratch_cwd

QUANTIZABLE = qdq.QUANTIZABLE
QuantConfig = int8.QuantConfig
agreement = checks.agreement


@dataclass(frozen=True)
class ExportConfig:
    """opset: ONNX opset of every file written (read back and checked, never assumed);
    ir_version: 9 for ONNX Runtime 1.15-1.17, 8 for 1.10-1.14 (None: the lowest IR that can
    declare the opset, as the exporter writes); dynamic_batch: a symbolic batch axis;
    dynamic_sequence: for int64 token ids (N, L), a symbolic sequence axis of 1..L tokens
    (`SEQUENCE`), kept only where the file answers as the model at a shorter length."""

    opset: int = 18
    ir_version: int | None = None
    dynamic_batch: bool = True
    dynamic_sequence: bool = True

    def __post_init__(self) -> None:
        if not 13 <= self.opset <= 23:
            raise InputError(f"opset {self.opset} is out of range; give 13..23 (default 18)")
        if self.ir_version is not None and self.ir_version not in (7, 8, 9, 10, 11):
            raise InputError(f"ir_version {self.ir_version} is not one of 7, 8, 9, 10, 11")
        need = compat.min_ir_for(self.opset)
        if self.ir_version is not None and self.ir_version < need:
            raise InputError(
                f"ir_version {self.ir_version} cannot declare opset {self.opset} (it needs IR "
                f"{need} or more); raise ir_version or lower the opset"
            )


def check_runtime_opset(opset: int, ir_version: int | None = None) -> None:
    """Fail before any work when this ONNX Runtime cannot run `opset` (or `ir_version`): load a
    one-node model declaring them, which takes milliseconds."""
    ExportConfig(opset=opset, ir_version=ir_version)  # the exporter's own range first
    runtime_runs(opset, ir_version)


def runtime_runs(opset: int, ir_version: int | None = None) -> None:
    """InputError unless this ONNX Runtime loads a model of `opset` (and `ir_version`)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    value = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "probe",
        [value],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    opsets = [helper.make_opsetid("", opset)]
    if ir_version is None:
        try:  # the lowest IR that can declare the opset, as the exporter writes
            ir_version = helper.find_min_ir_version_for(opsets)
        except ValueError:  # an opset newer than this onnx package knows
            ir_version = onnx.IR_VERSION
    probe = helper.make_model(graph, opset_imports=opsets, ir_version=ir_version)
    try:
        ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as e:
        raise InputError(
            f"opset {opset}: ONNX Runtime {ort.__version__} cannot run it "
            f"({' '.join(str(e).split())[-120:]}); choose a lower opset, e.g. 18"
        ) from None


def _check_npy_size(path: Path, flag: str) -> None:
    """The .npy header against the file: a header declaring more data than the file holds was
    read as "holds Python objects" (truncated) or a MemoryError (10^12 elements)."""
    from compresskit.models.data import read_npy_header

    try:
        with path.open("rb") as f:
            shape, dtype, start = read_npy_header(f)
    except Exception as e:  # numpy raises ValueError, struct.error, SyntaxError...
        raise InputError(f"{flag} {path}: not a readable .npy array ({e})") from None
    if dtype.hasobject:
        raise InputError(f"{flag} {path}: holds Python objects; save a float array with numpy.save")
    need = start + math.prod(shape) * dtype.itemsize
    size = path.stat().st_size
    if size < need:
        raise InputError(
            f"{flag} {path}: its header declares {dtype} of shape {tuple(shape)} ({need:,} "
            f"bytes) but the file holds {size:,}; it is truncated or damaged: save it again"
        )


def load_calibration(path: Path, flag: str = "--calibration", tokens: bool = False) -> np.ndarray:
    """Calibration inputs from a .npy file, samples first, non-empty: for an image model
    (`tokens` False) a finite float array, returned as float32; integer arrays are refused,
    since the model sees inputs scaled as in training (pixels / 255 for MNIST), which only the
    user knows how to reproduce. For a token model, integer token ids >= 0, returned as int64
    (never cast to float: ids index an embedding)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{flag} {path}: no such file; give a .npy array of inputs")
    with path.open("rb") as f:
        if f.read(6) != b"\x93NUMPY":  # numpy would take any other file for a pickle
            raise InputError(f"{flag} {path}: not a .npy array; save one with numpy.save")
    _check_npy_size(path, flag)
    try:
        x = np.load(path, allow_pickle=False)
    except ValueError as e:
        if "pickle" not in str(e).lower() and "object" not in str(e).lower():
            raise InputError(f"{flag} {path}: not a readable .npy array ({e})") from None
        raise InputError(
            f"{flag} {path}: holds Python objects; save a float array with numpy.save"
        ) from None
    except Exception as e:
        raise InputError(
            f"{flag} {path}: not a .npy array ({type(e).__name__}); save one with numpy.save"
        ) from None
    got = f"got {getattr(x, 'dtype', type(x))} of shape {getattr(x, 'shape', '?')}"
    if tokens:
        if not isinstance(x, np.ndarray) or x.dtype.kind not in "iu" or x.ndim != 2:
            raise InputError(
                f"{flag} {path}: the model reads token ids: needs an integer array (N, L) of "
                f"ids, padded as in training ({got})"
            )
        if len(x) == 0:
            raise InputError(f"{flag} {path}: is empty; give at least one input sample")
        if x.min() < 0 or x.max() > np.iinfo(np.int64).max:
            raise InputError(f"{flag} {path}: token ids reach [{x.min()}, {x.max()}]; ids are >= 0")
        return x.astype(np.int64)
    if not isinstance(x, np.ndarray) or x.dtype.kind != "f" or x.ndim < 2:
        raise InputError(
            f"{flag} {path}: needs a float array of inputs scaled as in training, samples "
            f"first ({got})"
        )
    if len(x) == 0:
        raise InputError(f"{flag} {path}: is empty; give at least one input sample")
    if not np.isfinite(x).all():
        raise InputError(f"{flag} {path}: holds NaN or infinite values; clean the inputs")
    return x.astype(np.float32)


def _session(path: Path | str, threads: int = 1):
    """ORT CPU session with this host's default optimizations."""
    return checks.session(path, optimized=True, threads=threads)


run = checks.outputs


def predict(path: Path, x: np.ndarray) -> np.ndarray:
    """The ONNX file's outputs for `x` on ORT's CPU provider (one thread)."""
    return run(_session(path), x)


def export_onnx(
    model: nn.Module,
    example: torch.Tensor,
    path: Path,
    cfg: ExportConfig,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write `model` (masks and shared weights baked in) as one ONNX file at `path`, at exactly
    `cfg.opset` and `cfg.ir_version`, only used opsets imported; returns the path. The file's
    one input has `example`'s dtype: float32 images, or int64 token ids for a text model.

    torch's dynamo exporter writes opset 18 and converts to other opsets itself; where that
    conversion fails it keeps 18 without an error. So the opset is read back: a mismatch goes
    through onnx's version converter, then torch's TorchScript exporter (which writes low
    opsets natively); a file that still is not at `cfg.opset` is refused (InputError, nothing
    written).

    Token ids (N, L): the sequence axis is symbolic (`SEQUENCE`, 1..L tokens), so an app runs a
    7-token query at the cost of 7 tokens, not L. The file must answer as the model on
    `example` cut to a shorter length; where the exporter cannot make the axis symbolic (a
    model that reshapes by L) or the file answers differently, it is exported at L, and the
    file's doc string says why. Either way the file's metadata holds `sequence_length` = L.
    `metadata`: more metadata_props to write (what the input and output mean, for an app)."""
    import onnx

    model = prune.bake_(copy.deepcopy(model)).eval()
    length = sequence_length(example) if cfg.dynamic_sequence else None
    fixed_why = ""
    if length is not None:
        try:
            proto, how = _to_opset(model, example, cfg, sequence=length)
            fixed_why = _shorter_differs(model, example, proto)
        except StageError as e:
            fixed_why = f"the exporter could not make it symbolic ({e})"
        if fixed_why:
            proto = None
    if length is None or fixed_why:
        proto, how = _to_opset(model, example, cfg)
    # Nothing may keep the baked copy once the file is written: onnxscript's rewrite rules
    # hold the last graph they matched (`_release_rewriter_graph`), and the copy and the
    # exporter's graphs sit in reference cycles that only a full collection frees (ResNet-18:
    # ~96 and ~86 MiB kept through the checks and the INT8 step).
    del model
    _release_rewriter_graph()
    gc.collect()
    compat.keep_used_opsets(proto)
    drop_source_locations(proto)
    proto.ir_version = cfg.ir_version or compat.min_ir_for(cfg.opset)
    proto.doc_string = f"compress: torch {how} exporter, opset {cfg.opset}"
    for key, value in (metadata or {}).items():
        protos.set_metadata(proto, key, value)
    if example.dtype in INTEGER_INPUTS and example.dim() == 2:
        protos.set_metadata(proto, SEQUENCE_KEY, str(example.shape[1]))
        if fixed_why:
            proto.doc_string += FIXED_AT.format(example.shape[1]) + fixed_why
    with atomic_path(path) as out:
        onnx.save(proto, str(out))
        del proto  # not beside the checker's and ORT's copies
        check(out)
    return path


INTEGER_INPUTS = (torch.int64, torch.int32)
# how a file's doc string says why its sequence axis is not symbolic (`input_info` reads it)
FIXED_AT = "; sequence length fixed at {}: "


def sequence_length(example: torch.Tensor) -> int | None:
    """L of token ids (N, L) with L >= 2 (the axis a file can leave symbolic), else None."""
    if example.dtype in INTEGER_INPUTS and example.dim() == 2 and example.shape[1] >= 2:
        return int(example.shape[1])
    return None


def input_info(proto) -> dict[str, Any]:
    """The file's one input for the report: {"name", "type", "shape"} (a symbolic dimension by
    its name), "scaling" (how a raw sample becomes it, from the metadata `export_onnx` wrote,
    when there), and for token ids "sequence_length" (the length trained on, from the metadata)
    and "sequence": "dynamic" (1..L tokens) or "fixed" with "fixed_why"."""
    inits = {t.name for t in proto.graph.initializer}
    info = _value_info(next(i for i in proto.graph.input if i.name not in inits))
    meta = protos.metadata(proto)
    if protos.INPUT_KEY in meta:
        info["scaling"] = meta[protos.INPUT_KEY]
    length = protos.trained_length(meta)
    if length is not None and len(info["shape"]) == 2:
        info["sequence_length"] = length
        info["sequence"] = "dynamic" if info["shape"][1] == SEQUENCE else "fixed"
        mark = FIXED_AT.format(length)
        if mark in proto.doc_string:
            info["fixed_why"] = proto.doc_string.split(mark, 1)[1]
    return info


def _value_info(v) -> dict[str, Any]:
    """A graph input's or output's {"name", "type", "shape"} (a symbolic dimension by name)."""
    import onnx

    t = v.type.tensor_type
    return {
        "name": v.name,
        "type": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name,
        "shape": [d.dim_param or d.dim_value for d in t.shape.dim],
    }


def output_info(proto) -> dict[str, Any]:
    """The file's first output for the report: {"name", "type", "shape"}, and "meaning" from
    the metadata `export_onnx` wrote (logits over the classes), when there."""
    info = _value_info(proto.graph.output[0])
    if meaning := protos.metadata(proto).get(protos.OUTPUT_KEY):
        info["meaning"] = meaning
    return info


def _shorter_differs(model: nn.Module, example: torch.Tensor, proto) -> str:
    """Why the dynamic-sequence `proto` cannot ship ("" when it can): run on `example` cut to
    half its length (and to 1 token), it must load in ORT and answer as the model does, within
    the FP32 export's tolerance (`checks.TIE` of the outputs' scale). Why check: an exporter
    that traced a length-dependent branch writes a file that runs at any length and is wrong
    at all but one."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        session = ort.InferenceSession(
            proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
    except Exception as e:
        return f"ONNX Runtime cannot load it ({one_line(e)})"
    name = session.get_inputs()[0].name
    for cut in dict.fromkeys((example.shape[1] // 2, 1)):
        x = example[:, :cut]
        try:
            with torch.no_grad():
                want = model(x)
        except Exception:
            return f"the model itself takes no other length (it fails at {cut} tokens)"
        if not isinstance(want, torch.Tensor):
            return ""  # outputs the parity checks judge later; nothing to compare here
        want = want.float().numpy()
        try:
            got = session.run(None, {name: x.numpy()})[0]
        except Exception as e:
            return f"it fails at {cut} tokens ({one_line(e)})"
        scale = max(float(np.abs(want).max()), 1.0)
        if got.shape != want.shape or not np.abs(got - want).max() <= 10 * checks.TIE * scale:
            return f"it answers differently from the model at {cut} tokens"
    return ""


# Node metadata the exporter writes: the Python stack of each op (absolute file paths of the
# machine that exported, and source lines), the FX node it came from, the module path as
# "namespace" and "pkg.torch.onnx.class_hierarchy", and onnxscript's rewrite rules. Kept: only
# "pkg.torch.onnx.name_scopes", the module path per-layer timing and bench's attribution read.
KEPT_METADATA = ("pkg.torch.onnx.name_scopes",)
SOURCE_LOCATIONS = ("pkg.torch.onnx.stack_trace", "pkg.torch.onnx.fx_node")


def drop_source_locations(proto) -> int:
    """Remove every node's metadata but `KEPT_METADATA` (subgraphs included); returns the
    entries removed. Why: a file that ships inside an app carried the exporting machine's
    paths and lines of its source (LeNet-5: 11 absolute paths, 3% of its INT8 file), and the
    same model exported from two checkouts gave two different files; the module path written
    three times over was 31% of a small text transformer's INT8 file (29 of 94 kB)."""
    removed = 0

    def clean(graph) -> None:
        nonlocal removed
        for node in graph.node:
            removed += protos.keep_only(node.metadata_props, lambda p: p.key in KEPT_METADATA)
            for g in protos.subgraphs(node):
                clean(g)

    clean(proto.graph)
    for function in proto.functions:  # model-local functions hold nodes too
        clean(function)
    return removed


def _release_rewriter_graph() -> None:
    """Let go of the graph onnxscript's rewrite rules keep after an export. The rules are
    module-level objects whose pattern matchers hold the last graph they matched (`_graph`,
    `_current_node`, `_match`, `_tracer`) until their next match: after exporting ResNet-18,
    the exported IR graph and through it every weight of the model exported (~96 MiB, twice
    its weights) stayed alive through the INT8 step. A matcher resets these at the start of
    each match, so clearing them changes nothing; attributes another onnxscript version does
    not have are left alone."""
    import sys

    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("onnxscript.rewriter"):
            continue
        for value in list(vars(module).values()):
            try:
                rules = getattr(value, "rules", None)
                for rule in rules if isinstance(rules, (list, tuple)) else [value]:
                    state = getattr(getattr(rule, "_matcher", None), "__dict__", {})
                    for attr in ("_graph", "_current_node", "_match", "_tracer"):
                        if attr in state:
                            state[attr] = None
            except Exception:  # an object of another onnxscript version: left as it is
                continue


def _opset(proto) -> int:
    return next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))


def _to_opset(model: nn.Module, example: torch.Tensor, cfg: ExportConfig, sequence: int = 0):
    """The exported ModelProto at cfg.opset and which route made it; `sequence` > 0: axis 1 of
    the input symbolic, of at most `sequence`."""
    import onnx
    from onnx import version_converter

    proto = _export(model, example, cfg, dynamo=True, sequence=sequence)
    if _opset(proto) == cfg.opset:
        return proto, "dynamo"
    wrote = _opset(proto)
    try:
        with _quiet_stdio():
            converted = version_converter.convert_version(proto, cfg.opset)
        onnx.checker.check_model(converted)
        if _opset(converted) == cfg.opset:
            return converted, "dynamo + onnx version converter"
    except Exception as e:
        why = " ".join(str(e).split())[-120:]
    else:
        why = f"the converter wrote opset {_opset(converted)}"
    try:  # deprecated in torch, but the one exporter that writes opsets below 18 natively
        # The dynamo graph's input and output names, so an app that names them finds the
        # same ones at every opset (TorchScript named the output "16" where dynamo wrote
        # "linear_1").
        outputs = [o.name for o in proto.graph.output]
        legacy = _export(
            model, example, cfg, dynamo=False, name=proto.graph.input[0].name, outputs=outputs,
            sequence=sequence,
        )  # fmt: skip
        if _opset(legacy) == cfg.opset:
            return legacy, "TorchScript"
    except StageError as e:
        why += f"; TorchScript exporter: {e}"
    raise InputError(
        f"opset {cfg.opset}: torch's exporter wrote opset {wrote} and it could not be converted "
        f"({why}); choose opset {wrote} or higher"
    )


def _export(
    model,
    example,
    cfg: ExportConfig,
    dynamo: bool,
    name: str = "x",
    outputs: list | None = None,
    sequence: int = 0,
):
    import onnx

    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "model.onnx"
        axes = {0: "batch"} if cfg.dynamic_batch else {}
        if sequence:
            axes[1] = SEQUENCE
        if dynamo:
            # The sequence's bound is the length trained on: a model whose positions stop at L
            # (a sliced position table) exports without a guard on longer inputs.
            dims = {
                k: torch.export.Dim(v, min=1, max=sequence) if k else torch.export.Dim(v)
                for k, v in axes.items()
            }
            kwargs: dict[str, Any] = {
                "dynamic_shapes": (dims,) if dims else None,
                "external_data": False,
            }
        else:
            kwargs = {"dynamo": False, "input_names": [name], "dynamic_axes": {name: axes}}
            if outputs:
                kwargs["output_names"] = outputs
        try:
            # The exporter reports progress on stdout/stderr and through torch's loggers; the
            # library stays silent.
            with errors_only("torch.onnx"), _quiet_stdio(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(model, (example,), str(raw), opset_version=cfg.opset, **kwargs)
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise StageError(f"ONNX export failed: {type(e).__name__}: {first}") from None
        return onnx.load(str(raw))


@contextlib.contextmanager
def _quiet_stdio():
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def probe_opset(model: nn.Module, example: torch.Tensor, cfg: ExportConfig) -> None:
    """Before any training: export `model` as it is now at cfg.opset into a temporary file, so
    an opset the exporter cannot write is refused in seconds, not after the pipeline."""
    # An export failure unrelated to the opset (StageError) surfaces at the export stage.
    with tempfile.TemporaryDirectory() as tmp, contextlib.suppress(StageError):
        export_onnx(model, example, Path(tmp) / "probe.onnx", cfg)


@contextlib.contextmanager
def errors_only(logger: str | None = None):
    """Only errors from `logger` while the block runs (None: the root logger, through which
    ORT's quantizer warns and which Python prints to stderr when no handler is configured;
    "torch.onnx": the exporter's progress). The library stays silent."""
    import logging

    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def check(path: Path) -> None:
    """onnx.checker with full_check, and a load in ONNX Runtime; StageError otherwise."""
    import onnx

    try:
        # by path: onnx's C++ side reads the file, with no Python copy of the model beside it
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as e:
        raise StageError(f"{path}: fails onnx.checker: {' '.join(str(e).split())[:300]}") from None
    try:
        _session(path)
    except Exception as e:
        raise InputError(
            f"{path}: ONNX Runtime cannot load it ({one_line(e)}); choose a lower opset"
        ) from None


# --- INT8 -----------------------------------------------------------------------------------
# The choice of which nodes run in INT8 lives in compressor.int8; these are the file-level steps.


def check_calibration(path: Path, calib: np.ndarray) -> str:
    # Only the input is read: a session without graph optimizations holds the weights once
    # (ResNet-18: ~56 MiB, against ~150 MiB with this host's fused and prepacked kernels).
    session = checks.session(path, optimized=False, threads=1)
    inp = session.get_inputs()[0]
    want = [d if isinstance(d, int) else None for d in inp.shape[1:]]
    if len(calib) == 0:
        raise InputError("calibration data is empty; give at least one training sample")
    got = list(calib.shape[1:])
    if len(want) != len(got) or any(
        w is not None and w != g for w, g in zip(want, got, strict=False)
    ):
        raise InputError(
            f"calibration data of shape {tuple(calib.shape)} does not fit the model "
            f"input {inp.shape}"
        )
    kind = {"tensor(float)": "f", "tensor(int64)": "iu"}.get(inp.type)
    if kind is not None and calib.dtype.kind not in kind:
        raise InputError(
            f"calibration data of dtype {calib.dtype} does not fit the model input "
            f"{inp.name}: {inp.type} (float32 images, or int64 token ids)"
        )
    return inp.name


def preprocess(fp32: Path, out: Path) -> Path:
    """ORT's quantization pre-processing before quantizing: symbolic shape inference, ORT's
    basic graph optimisations, ONNX shape inference (`quant_pre_process`'s steps, in its order,
    with its settings). Run here with the weights in a file beside the graph from the first
    step on, so that no step holds a Python copy of them: ORT's own function peaked 223 MiB
    over its start on ResNet-18 (45 MB of weights), this ~110 MiB, for the same file byte for
    byte (tests/test_int8.py). A model that the lean steps cannot take (opset 10 or lower,
    which ORT's function converts first; a graph symbolic inference or the optimiser refuses)
    goes through ORT's function."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    fp32, out = Path(fp32).resolve(), Path(out).resolve()
    with _quiet_stdio(), errors_only(), scratch_cwd():
        try:
            _lean_preprocess(fp32, out)
        except _NotLean:
            try:
                quant_pre_process(str(fp32), str(out), skip_symbolic_shape=False)
            except Exception:
                # ORT's symbolic shape inference has no rule for some ops (STFT: "object of
                # type 'NoneType' has no len()" after every other stage had run); ONNX's own
                # shape inference then does, as quant_pre_process documents for such models.
                try:
                    quant_pre_process(str(fp32), str(out), skip_symbolic_shape=True)
                except Exception as e:
                    raise StageError(
                        f"{fp32.name}: ONNX Runtime's quantization pre-processing failed "
                        f"({one_line(e)}); set [export] int8 = false to ship the FP32 file"
                    ) from None
    return out


def _weights(model) -> set[str]:
    """Initializers that only Conv, ConvTranspose, Gemm and MatMul nodes read, as weight or
    bias: never one a subgraph (If, Loop, Scan) reads, whatever its node."""
    heavy, other = set(), set()

    def walk(graph, top: bool) -> None:
        for n in graph.node:
            for k, name in enumerate(n.input):
                compute = top and n.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul")
                (heavy if compute and k >= 1 else other).add(name)
            for g in protos.subgraphs(n):
                walk(g, top=False)

    walk(model.graph, top=True)
    return heavy - other


class _NotLean(Exception):
    """A model the lean pre-processing leaves to ORT's `quant_pre_process`."""


def _lean_preprocess(fp32: Path, out: Path) -> None:
    import onnx
    import onnxruntime as ort
    from onnxruntime.quantization.quant_utils import add_pre_process_metadata
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        graph, optimized, inferred = (Path(tmp) / n for n in ("g.onnx", "opt.onnx", "inf.onnx"))
        model = onnx.load(str(fp32))
        defaults = [o for o in model.opset_import if o.domain in ("", "ai.onnx")]
        if len(defaults) != 1 or defaults[0].version <= 10:
            raise _NotLean
        # Outside only the weights the compute nodes read: symbolic inference reads the
        # values of what feeds its sympy arithmetic (a ViT's position embedding, shapes)
        outside = set(
            protos.save_beside(protos.shell(model), model.graph.initializer, graph, _weights(model))
        )
        del model
        # Any failure from here on goes to ORT's own function, which then gives its own answer
        # (its error included) for the graph as it is.
        try:
            model = onnx.load(str(graph), load_external_data=False)
            try:
                model = SymbolicShapeInference.infer_shapes(model, 2**31 - 1, False)
            except Exception:
                # A symbolic sequence axis: the position table sliced to it gives
                # Min(L + 1, sequence + 1), which inference cannot prove equal to sequence + 1
                # and refuses to broadcast. auto_merge takes them as one, which they are for
                # every length the file accepts (1..L); shapes only size buffers and guide the
                # quantizer, no node depends on them.
                model = SymbolicShapeInference.infer_shapes(model, 2**31 - 1, True)
            if model is None:  # it gave up on the graph
                raise _NotLean
            onnx.save(model, str(graph))
            del model
            opts = ort.SessionOptions()
            opts.optimized_model_filepath = str(optimized)
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
            opts.log_severity_level = 4  # errors come back as exceptions, not log lines
            ort.InferenceSession(str(graph), opts, providers=["CPUExecutionProvider"])
            onnx.shape_inference.infer_shapes_path(str(optimized), str(inferred))
            model = onnx.load(str(inferred))
        except Exception:
            raise _NotLean from None
    # onnx.load marks each tensor it read from outside as stored inline (2 bytes each in the
    # file); ORT's function never had them outside
    for t in model.graph.initializer:
        if t.name in outside and t.data_location == onnx.TensorProto.DEFAULT:
            t.ClearField("data_location")
    add_pre_process_metadata(model)
    onnx.save(model, str(out))


# Compute nodes the INT8 file keeps in FP32 whatever the chooser decides: ORT's QDQ quantizer
# leaves LSTM/GRU/RNN alone, and ORT's CPU provider has no INT8 ConvTranspose kernel (a QDQ
# one runs dequantize -> FP32 -> quantize, slower than FP32 alone).
FP32_ONLY = ("ConvTranspose", "LSTM", "GRU", "RNN")


def fp32_only_nodes(path: Path) -> dict[str, int]:
    """{op type: count} of the file's `FP32_ONLY` nodes (main graph), for the report."""
    import onnx

    counts: dict[str, int] = {}
    for n in onnx.load(str(path)).graph.node:
        if n.op_type in FP32_ONLY and n.domain in ("", "ai.onnx"):
            counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts


def quantizable_nodes(path: Path) -> list[str]:
    import onnx

    return [n.name for n in onnx.load(str(path)).graph.node if n.op_type in QUANTIZABLE]


def quantize_int8(
    prepared: Path,
    out: Path,
    calib: np.ndarray,
    cfg: QuantConfig,
    exclude: Iterable[str] = (),
    ir_version: int | None = None,
) -> Path:
    """Static QDQ quantization of a `preprocess`ed model with our scheme (`cfg.scheme`,
    per-channel, reduce_range as set; "auto" is off), `exclude` nodes in FP32, orphan Q/DQ
    removed and only used opsets imported. Writes `out` atomically and checks it."""
    import onnx

    check_calibration(prepared, calib)
    with errors_only():
        q = qdq.Quantizer(prepared, calib, cfg.method)
        model = q.build(int8.scheme_for(cfg, cfg.reduce_range is True), list(exclude), ir_version)
    with atomic_path(out) as dst:
        onnx.save(model, str(dst))
        check(dst)
    return out


# Below these, two medians are a tie: one ORT call from Python costs ~7 us and its jitter is a
# few us, so a 1 us "win" on a 10 us model is noise. Ties keep INT8 (the smaller file).
TIE_RATIO = 0.90
TIE_MS = 0.005


def clearly_faster(a_ms: float, b_ms: float) -> bool:
    """Is latency `a` faster than `b` beyond measurement noise?"""
    return a_ms < TIE_RATIO * b_ms and b_ms - a_ms > TIE_MS


# --- parity and invariants --------------------------------------------------------------------


def parity(
    model: nn.Module,
    path: Path,
    x: torch.Tensor,
    y: torch.Tensor,
    optimized: bool = True,
    reference: np.ndarray | None = None,
    outputs: np.ndarray | None = None,
) -> dict[str, float]:
    """The file's test accuracy, its top-1 agreement with the PyTorch model, max |delta logit|.
    optimized=False: the file as written (ORT with graph optimizations off, the reference
    semantics); True: this host's ORT with its default fused kernels. `reference`: the
    model's logits for `x` (`torch_logits`), when the caller already has them; `outputs`: the
    file's own outputs for `x` with `optimized`, likewise."""
    ref = torch_logits(model, x) if reference is None else reference
    got = checks.outputs(checks.session(path, optimized), x.numpy()) if outputs is None else outputs
    return {
        "test_accuracy": float(np.mean(got.argmax(1) == y.numpy())),
        "top1_agreement": agreement(got, ref),
        "max_abs_diff": float(np.abs(got - ref).max()),
    }


def torch_logits(model: nn.Module, x: torch.Tensor) -> np.ndarray:
    """The model's outputs for `x` with masks and shared weights baked in, as numpy."""
    model = prune.bake_(copy.deepcopy(model)).eval()
    batch = _mem.eval_batch(model, x[:2])  # bounded activations, not a fixed 512 samples
    with torch.no_grad(), _datapass.data_pass():  # the copy and bake above are per-weight work
        return torch.cat([model(x[i : i + batch]) for i in range(0, len(x), batch)]).numpy()


def weight_invariants(
    path: Path,
    model: nn.Module,
    bits: dict[str, int],
    aliases: dict[str, tuple[str, bool]] | None = None,
) -> dict[str, Any]:
    """Read each weight matrix back from the file (Linear/Conv `.weight`, MultiheadAttention's
    `in_proj_weight`): its zeros must be where the model's are, and a shared layer (named in
    `bits`, by layer) must hold <= 2^bits distinct values in each output channel (INT8 scales
    and folded BatchNorm multiply each channel by its own factor). Each check names the
    initializer it read (`initializer`, and whether it holds the weight `transposed`); pass the
    FP32 file's as `aliases` ({name: (initializer, transposed)}) when checking the INT8 file
    made from it, whose initializers carry those names plus `_quantized`. A shared
    layer found nowhere in the file gets a check with `found` and `ok` False: a weight the
    checks miss cannot pass for a checked one."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(path)).graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    state = prune.bake_(copy.deepcopy(model)).state_dict()
    out: dict[str, Any] = {}
    claimed: set[str] = set()
    for name, w in state.items():
        if not name.endswith((".weight", "_weight")) or w.ndim < 2:
            continue
        layer = name.removesuffix(".weight").removesuffix("_weight")
        limit = 2 ** bits[layer] if layer in bits else None
        found = _find_weight(inits, name, w, (aliases or {}).get(name), claimed)
        if found is None:
            if limit is not None:  # a shared layer the file should hold
                out[name] = {"found": False, "limit": limit, "ok": False}
            continue
        arr, quantized, init, flipped = found
        claimed.add(init)
        # Pruned weights must stay exactly zero (INT8 may also round tiny survivors to zero).
        zeros_ok = bool(np.all(arr[(w == 0).numpy()] == 0))
        # Per output channel: INT8 scales each channel, and the exporter folds BatchNorm into
        # the preceding conv's weights, which also scales each channel.
        distinct = max(len(np.unique(r)) for r in arr.reshape(w.shape[0], -1))
        out[name] = {
            "found": True,
            "initializer": init,
            "transposed": flipped,
            "zeros_kept": zeros_ok,
            "distinct_values_per_channel": int(distinct),
            "distinct_values": len(np.unique(arr)),
            "limit": limit,
            "ok": zeros_ok and (limit is None or distinct <= limit),
            "int8": quantized,
        }
    return out


def _find_weight(
    inits: dict[str, np.ndarray],
    name: str,
    w: torch.Tensor,
    alias: tuple[str, bool] | None = None,
    claimed: frozenset[str] | set[str] = frozenset(),
):
    """(values in `w`'s layout, int8?, initializer name, transposed?) of the initializer
    holding `name`: by name (FP32 export keeps parameter names; QDQ appends `_quantized`), by
    `alias` (the FP32 file's name for it, and whether it held it transposed), else, in an FP32
    file, the unclaimed initializer equal to `w` or to its transpose (torch's dynamo exporter
    stores a Linear before a MatMul transposed, as `val_14`)."""
    shape, t_shape = tuple(w.shape), tuple(w.shape[::-1])

    def fit(key: str, arr: np.ndarray, flipped: bool | None = None):
        quantized = arr.dtype in (np.int8, np.uint8)
        if quantized:
            arr = _less_zero_point(inits, key, arr)
        if flipped is not None and w.ndim == 2 and arr.shape == shape == t_shape:
            # a square matrix fits both ways: the orientation the FP32 file held it in (HF
            # BERT's and ViT's q/k/v/o, read as they stood in the INT8 file, "lost" their zeros)
            return (arr.T if flipped else arr), quantized, key, flipped
        if arr.shape == shape:
            return arr, quantized, key, False
        if w.ndim == 2 and arr.shape == t_shape:
            return arr.T, quantized, key, True
        return None

    named, flipped = alias if alias is not None else (None, None)
    for base, flip in ((name, None), (named, flipped)):
        if base is None:
            continue
        for key in (base, base + "_quantized"):
            if key in inits and (hit := fit(key, inits[key], flip)):
                return hit
    for key, arr in inits.items():
        if key.replace("/", ".").endswith(name) and arr.shape == shape:
            return fit(key, arr)
    ref = w.numpy()
    for key, arr in inits.items():
        if key in claimed or arr.dtype != ref.dtype:
            continue
        hit = fit(key, arr)
        if hit is not None and np.array_equal(hit[0], ref):
            return hit
        # A square matrix fits both ways: BERT's 128 x 128 query weight, stored transposed,
        # was compared as it stood and read "not found" in every file.
        if w.ndim == 2 and arr.shape == shape == t_shape and np.array_equal(arr.T, ref):
            return arr.T, False, key, True
    return None


def _less_zero_point(inits: dict[str, np.ndarray], key: str, q: np.ndarray) -> np.ndarray:
    """A quantized initializer as integers whose 0 is the real 0: less its zero point. ORT
    quantizes an embedding table that feeds INT8 compute as uint8 with a zero point (123 on a
    text model's), and its pruned zeros read as 123 until the point is taken off."""
    zp = inits.get(key.removesuffix("_quantized") + "_zero_point")
    if zp is None or not np.any(zp):
        return q
    values = q.astype(np.int32)
    if zp.size == 1:
        return values - int(zp.reshape(-1)[0])
    if zp.shape[0] == q.shape[0]:  # per output channel, along axis 0
        return values - zp.astype(np.int32).reshape(-1, *([1] * (q.ndim - 1)))
    return q  # another axis: left as it is, the check then reads the raw integers


def ort_baselines(
    fp32: Path, out_dir: Path, calib: np.ndarray, fixed_batch: int | None = None
) -> list[Path]:
    """What ONNX Runtime gives without compress: `quantize_dynamic` (int8 weights, activations
    quantized at run time) and `quantize_static` with all its defaults (QDQ, int8 activations
    and weights, per-tensor, MinMax), calibrated on `calib`, both after `quant_pre_process`.
    A file of a fixed batch is calibrated in batches of that size (batches of 32 failed in
    ORT on a batch-1 file)."""
    if fixed_batch:  # whole batches: cut to a multiple, or repeat up to one batch
        n = max(fixed_batch, len(calib) // fixed_batch * fixed_batch)
        calib = np.resize(calib, (n, *calib.shape[1:]))
    from onnxruntime.quantization import QuantType, quantize_dynamic, quantize_static

    stem = Path(fp32).name.removesuffix(".onnx").removesuffix(".fp32")
    dynamic = out_dir / f"{stem}.ort-dynamic.onnx"
    static = out_dir / f"{stem}.ort-static-default.onnx"
    name = check_calibration(fp32, calib)
    with tempfile.TemporaryDirectory() as tmp, errors_only():
        # ORT's shape pre-processing first, as its docs ask (the dynamo exporter's shape
        # annotations otherwise trip its shape inference); the quantizers then run on defaults.
        prepared = preprocess(fp32, Path(tmp) / "prepared.onnx")
        with _quiet_stdio():
            quantize_dynamic(str(prepared), str(dynamic), weight_type=QuantType.QInt8)
            reader = qdq.reader(calib, name, fixed_batch or 32)
            quantize_static(str(prepared), str(static), reader)
    return [dynamic, static]
