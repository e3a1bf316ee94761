"""Mobile deployment of an ONNX model with ONNX Runtime's own tools (ORT 1.31).

    to_ort(onnx_path, out_path)          .onnx -> .ort + required_operators.config, checked
    usability(onnx_path)                 NNAPI / CoreML verdicts of check_onnx_model_mobile_usability
    fixed_batch(onnx_path, out, batch)   a copy with the dynamic batch dimension fixed, and
                                         HardSigmoid/HardSwish as Mul, Add, Clip (NNAPI)

How each tool is driven, and why:
- `convert_onnx_models_to_ort` runs in a subprocess. Its function API prints to stdout, and
  importing it calls `logging.basicConfig`, which would give the host process (the CLI) a root
  log handler that prints; ORT's native logger also writes to stderr. A child process keeps all of
  that captured and away from the caller.
- `check_onnx_model_mobile_usability` runs in-process through
  `mobile_helpers.usability_checker.analyze_model`, which takes a logger: we hand it a private
  one whose records we collect and parse (nothing reaches stderr).
- Fixing the batch uses `onnx_model_utils.make_dim_param_fixed` and `fix_output_shapes`, the
  functions behind `make_dynamic_shape_fixed`.

onnx and onnxruntime are imported inside the functions so that `import compressor.export.mobile` stays
light. Nothing here prints or exits; a bad file or argument raises `InputError`, a tool that
fails or a converted model that answers differently raises `StageError`.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from compresskit.compressor.export import protos
from compresskit.compressor.export.protos import SEQUENCE
from compresskit.models import fileio
from compresskit.models.errors import InputError, StageError
from compresskit.models.fileio import atomic_path, check_writable

TOOL_TIMEOUT_S = 600  # conversion of a mobile-sized model takes seconds; this only catches hangs
MAX_ABS_DIFF = 1e-4  # .ort vs .onnx on the same inputs, FP32: per unit of the outputs' scale
# INT8 graphs: the .onnx reference may run this CPU's own layouts (NCHWc), which the portable
# .ort leaves out, and integer kernels round each requantization their own way: a step of an
# inner tensor's scale reaches the logits amplified. A 47k-weight residual CNN's INT8 file
# differed by 4.5e-4 on random inputs; a real conversion defect is off by the whole output.
MAX_REL_DIFF_INT8 = 1e-2  # of the outputs' scale (max |output| of the .onnx)
CHECK_ROUNDS = 3  # random inputs tried when checking the .ort
DYNAMIC_BATCH = (
    2  # batch used for a dynamic first dimension: 2 catches batch-mixing bugs that 1 hides
)

# check_onnx_model_mobile_usability's verdicts (PartitioningInfo.TryWithEP) -> ours.
_VERDICTS = {"YES": "yes", "MAYBE": "partial", "NO": "no"}
_RANK = {"no": 0, "partial": 1, "yes": 2}
_EPS = ("NNAPI", "CoreML NeuralNetwork", "CoreML MLProgram")


def _validated(path: Path) -> Path:
    """The model file, checked to exist and to be a well-formed ONNX model (else InputError)."""
    import onnx

    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise InputError(f"{path}: {what}; give the path of an .onnx model file")
    try:
        # Checking by path (not a loaded proto) also works for models over 2 GB.
        onnx.checker.check_model(str(path))
    except Exception as e:  # DecodeError for non-protobuf bytes, ValidationError for the rest
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(
            f"{path}: not a valid ONNX model ({reason}); export it again, e.g. torch.onnx.export"
        ) from None
    return path


def _random_inputs(session: Any, seed: int) -> dict[str, np.ndarray]:
    """Random feeds shaped like the session's inputs: a dynamic first dimension becomes
    DYNAMIC_BATCH, any other dynamic dimension 1 (we cannot guess a sequence length)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for arg in session.get_inputs():
        shape = [
            d if isinstance(d, int) and d > 0 else (DYNAMIC_BATCH if i == 0 else 1)
            for i, d in enumerate(arg.shape)
        ]
        kind = arg.type.removeprefix("tensor(").removesuffix(")")
        if kind in {"float", "float16", "double"}:
            dtype = {"float": np.float32, "float16": np.float16, "double": np.float64}[kind]
            feeds[arg.name] = rng.standard_normal(shape).astype(dtype)
        elif kind in {"int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"}:
            # 0 and 1 are valid for indices, token ids and quantized values alike.
            feeds[arg.name] = rng.integers(0, 2, shape).astype(kind)
        elif kind == "bool":
            feeds[arg.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            raise StageError(
                f"input {arg.name!r} has type {arg.type}; cannot make a random check input"
            )
    return feeds


def _max_abs_diff(onnx_path: Path, ort_path: Path) -> tuple[float, float]:
    """Largest |difference| between the outputs of the .onnx and the .ort on random inputs,
    and the outputs' scale (largest |output| of the .onnx, at least 1).

    The reference runs the .onnx with the optimizations the converter bakes into the .ort
    (ORT_ENABLE_EXTENDED: the QDQ fusions into integer kernels, no x86-only NCHWc layout), so
    the check sees the conversion alone: the two then agree to the bit on every model measured.
    Against ORT's default level (NCHWc kernels, which round each requantization their own
    way) a ResNet-50's INT8 file differed by 0.13 on outputs of 6, from run to run, and the
    check threw away a whole run whose file was sound (top-1 identical).
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4  # fatal only: the library never writes to stderr itself
    cpu = ["CPUExecutionProvider"]
    baked = ort.SessionOptions()
    baked.log_severity_level = 4
    baked.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    try:
        reference = ort.InferenceSession(str(onnx_path), baked, providers=cpu)
        converted = ort.InferenceSession(str(ort_path), options, providers=cpu)
    except Exception as e:
        raise StageError(f"{ort_path}: ONNX Runtime cannot load the converted model ({e})") from e
    worst, scale = _compare(reference, converted, ort_path)
    return worst, max(scale, 1.0)


def _compare(
    reference: Any, candidate: Any, where: Path, shaped_as: Any = None
) -> tuple[float, float]:
    """Largest |difference| between two ORT sessions' outputs on CHECK_ROUNDS random inputs
    shaped like `shaped_as`'s inputs (default: `reference`'s), and the largest |output| of
    `reference` (StageError naming `where` if `candidate` fails to run or gives other shapes)."""
    worst, scale = 0.0, 0.0
    for seed in range(CHECK_ROUNDS):
        feeds = _random_inputs(reference if shaped_as is None else shaped_as, seed)
        try:
            expected = reference.run(None, feeds)
            got = candidate.run(None, feeds)
        except Exception as e:
            raise StageError(f"{where}: running the converted model failed ({e})") from e
        for name, a, b in zip(
            [o.name for o in reference.get_outputs()], expected, got, strict=True
        ):
            a, b = np.asarray(a), np.asarray(b)
            if a.shape != b.shape:
                raise StageError(
                    f"{where}: output {name!r} has shape {b.shape}, the .onnx gives {a.shape}"
                )
            if a.size:
                diff = np.abs(a.astype(np.float64) - b.astype(np.float64)).max()
                worst = max(worst, float(diff))
                scale = max(scale, float(np.abs(a.astype(np.float64)).max()))
    return worst, scale


def _quantized(path: Path) -> bool:
    """Whether the graph holds INT8 compute (QDQ pairs or QLinear/integer ops)."""
    import onnx

    ops = {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}
    return bool(ops & {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"}) or any(
        op.startswith("QLinear") or op.endswith("Integer") for op in ops
    )


def _replace_from(src: Path, dst: Path) -> None:
    """Move `src` onto `dst` atomically (both in one folder), flushed to disk first."""
    with open(src, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(src, dst)


# `python -m onnxruntime.tools.convert_onnx_models_to_ort`, minus torch: the tools package's
# __init__ imports torch whenever it is installed (for an export helper the converter never
# uses), which was 2 of the child's 2.6 s. A None entry in sys.modules makes its
# `find_spec("torch")` answer "not installed".
_CONVERT = (
    "import runpy, sys; sys.modules['torch'] = None; sys.argv[0] = 'convert_onnx_models_to_ort'; "
    "runpy.run_module('onnxruntime.tools.convert_onnx_models_to_ort', run_name='__main__')"
)


def to_ort(onnx_path: Path, out_path: Path) -> dict:
    """Convert an ONNX model to ORT format for ONNX Runtime Mobile and check the result.

    Runs `python -m onnxruntime.tools.convert_onnx_models_to_ort MODEL --optimization_style
    Fixed` (without importing torch, see `_CONVERT`) into a temporary folder beside `out_path`. Fixed style bakes the CPU graph
    optimizations into the file (ORT's advice when not using NNAPI/CoreML); the NCHWc layout,
    which only x86 can run, is left out by the tool, so the file is portable to ARM.

    Writes `out_path` (must end in `.ort`, as ORT picks the format by extension) and, beside it,
    the operator list for a reduced-operator ORT build as
    `out_path.with_suffix(".required_operators.config")` (for `model.ort`:
    `model.required_operators.config`, the tool's own naming). The config is moved into place
    first and the .ort last, each with an atomic rename, so a present .ort always has its config.

    Before anything is moved, the .ort is loaded in `onnxruntime.InferenceSession` and run
    against the .onnx on CHECK_ROUNDS random inputs shaped like the model's inputs (batch
    DYNAMIC_BATCH where it is dynamic); a max |diff| above MAX_ABS_DIFF raises StageError.

    Returns {"path", "bytes", "config", "max_abs_diff"}.
    """
    onnx_path = _validated(onnx_path)
    name = onnx_path.name.lower()
    if not name.endswith(".onnx") or name.endswith(".optimized.onnx"):
        # The converter silently skips other names (it reads *.optimized.onnx as its own output).
        raise InputError(
            f"{onnx_path}: ONNX Runtime's converter only reads files named *.onnx "
            "(not *.optimized.onnx); rename or copy it"
        )
    out_path = Path(out_path)
    if out_path.suffix.lower() != ".ort":
        raise InputError(f"{out_path}: an ORT model must end in .ort; use {out_path.stem}.ort")
    out = check_writable(out_path)  # resolves a symlink to its target, like atomic_path
    config = out.with_suffix(".required_operators.config")

    with tempfile.TemporaryDirectory(prefix=f"{fileio.hidden(out.name)}.", dir=out.parent) as tmp:
        command = [
            sys.executable,
            "-c",
            _CONVERT,
            str(onnx_path.resolve()),  # first: --optimization_style takes several values
            "--optimization_style",
            "Fixed",
            "--output_dir",
            tmp,
        ]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise StageError(
                f"{onnx_path}: convert_onnx_models_to_ort did not finish in {TOOL_TIMEOUT_S} s"
            ) from None
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
            if fileio.nearly_full(tmp):  # ORT's "Failed to save ORT format model"
                raise fileio.cannot_write(out, "no space left on device")
            raise StageError(f"{onnx_path}: convert_onnx_models_to_ort failed: {lines[-1]}")
        # Glob rather than predict names: ORT_CONVERT_ONNX_MODELS_TO_ORT_OPTIMIZATION_LEVEL
        # in the environment adds the level to both names (model.basic.ort).
        orts, configs = sorted(Path(tmp).glob("*.ort")), sorted(Path(tmp).glob("*.config"))
        if len(orts) != 1 or len(configs) != 1:
            raise StageError(
                f"{onnx_path}: convert_onnx_models_to_ort wrote {[p.name for p in orts + configs]},"
                " expected one .ort and one .config"
            )
        max_abs_diff, scale = _max_abs_diff(onnx_path, orts[0])
        limit = scale * (MAX_REL_DIFF_INT8 if _quantized(onnx_path) else MAX_ABS_DIFF)
        if not max_abs_diff <= limit:  # `not <=` also catches NaN
            raise StageError(
                f"{onnx_path}: the .ort answers differently from the .onnx "
                f"(max |diff| {max_abs_diff:.3g} > {limit:.3g}); not written"
            )
        # The config's header names the model it came from: point it at the final file, not
        # at the temporary folder that is about to disappear.
        # Its file name only: `out` may itself be a staging path (the pipeline writes into a
        # temporary folder and renames it), which left a random, vanished folder in the file.
        text = configs[0].read_text(encoding="utf-8")
        configs[0].write_text(text.replace(str(orts[0]), out.name), encoding="utf-8")
        versions = ort_versions(orts[0])  # read before the file is in place: a failure
        size = orts[0].stat().st_size  # leaves no .ort behind a report that says none
        _replace_from(configs[0], config)
        _replace_from(orts[0], out)
    return {
        "path": str(out),
        "bytes": size,
        "config": str(config),
        "max_abs_diff": max_abs_diff,
        **versions,
        "runs_on": ORT_RUNS_ON,
    }


# Fixed style bakes in ORT's CPU kernels (QLinearConv, QGemm, NhwcMaxPool: com.microsoft),
# which NNAPI and CoreML do not take; ORT's converter advises its Runtime style for those.
ORT_RUNS_ON = (
    "ORT Mobile's CPU execution provider; for NNAPI or CoreML ship the .onnx file "
    "(with --fixed-batch, its fixed-batch copy)"
)
# ORT format version -> the first ONNX Runtime release that reads it (ORT's "ORT model
# format" page; v6 came with 1.16.0, as a maintainer put it in microsoft/onnxruntime#20670).
ORT_FORMAT_SINCE = {"5": "1.13", "6": "1.16"}


def ort_versions(path: Path) -> dict[str, Any]:
    """{"ort_format", "ir_version", "opset", "min_ort"} read back from an .ort file: the ORT
    format version and the model's ai.onnx opset and IR version, and the oldest release that
    reads that format and implements that opset (other domains' stamps are left out: the
    ORT-format loader does not check them, and 1.17.3 loads these files)."""
    from onnxruntime.tools.ort_format_model.ort_flatbuffers_py.fbs import InferenceSession

    from compresskit.compressor.export import compat

    try:
        root = InferenceSession.InferenceSession.GetRootAsInferenceSession(
            Path(path).read_bytes(), 0
        )
        fmt = (root.OrtVersion() or b"").decode()
        model = root.Model()
        opsets = [model.OpsetImport(i) for i in range(model.OpsetImportLength())]
        opset = next(int(o.Version()) for o in opsets if (o.Domain() or b"") in (b"", b"ai.onnx"))
        ir = int(model.IrVersion())
    except Exception as e:  # a file this reader does not understand: say so, do not guess
        raise StageError(f"{path}: cannot read its ORT format header ({e})") from None
    release = compat.min_ort({"ir_version": ir, "opsets": {"ai.onnx": opset}})
    since = ORT_FORMAT_SINCE.get(fmt, compat.NEWER)
    return {
        "ort_format": fmt,
        "ir_version": ir,
        "opset": opset,
        "min_ort": compat.later(release, since),
    }


class _Collect(logging.Handler):
    """Keeps the messages logged to it."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def usability(onnx_path: Path) -> dict:
    """How well NNAPI (Android) and CoreML (iOS) could run the model, per ORT's checker.

    Runs `check_onnx_model_mobile_usability`'s analysis (model optimized to the BASIC level
    first, as the CLI does) and parses its log lines, per EP section `Checking <EP>`:

        Model should perform well with <EP> as is: YES|MAYBE|NO
        <p> partitions with a total of <n>/<total> nodes can be handled by the <EP> EP.
        \tUnsupported ops: ai.onnx:DequantizeLinear,...
        Model should perform well with <EP> if modified to have fixed input shapes: YES|...

    The verdict is the "as is" line, mapped YES -> "yes", MAYBE -> "partial", NO -> "no". The
    tool says YES for one partition with > 75% of nodes, MAYBE for one with > 50% or two with
    > 75%, NO otherwise. A dynamic batch dimension alone makes every node unsupported
    (NNAPI needs fixed shapes, and the checker demands them of CoreML too), so such a model gets
    "no" here and `details` tells whether fixing shapes (see `fixed_batch`) would give "yes".
    CoreML has two model formats (NeuralNetwork, MLProgram): "coreml" is the better of the two.

    Returns {"nnapi", "coreml", "details"}; a "no" is an answer, not an error. StageError only
    when the tool itself fails or prints something this parser does not recognise.
    """
    onnx_path = _validated(onnx_path)
    from onnxruntime.tools.mobile_helpers import usability_checker

    # A Logger made directly (not via getLogger) has no parent, so nothing propagates to the
    # root logger and no global logging state changes.
    logger = logging.Logger("compressor.export.mobile.usability", logging.INFO)
    collect = _Collect()
    logger.addHandler(collect)
    try:
        usability_checker.analyze_model(onnx_path.resolve(), skip_optimize=False, logger=logger)
    except Exception as e:
        raise StageError(f"{onnx_path}: check_onnx_model_mobile_usability failed ({e})") from e

    found: dict[str, dict[str, str]] = {}
    section = None
    for message in collect.messages:
        if message.startswith("Checking ") and message[len("Checking ") :] in _EPS:
            section = found.setdefault(message[len("Checking ") :], {})
        elif section is None:
            continue
        elif m := re.match(
            r"(\d+) partitions with a total of (\d+/\d+) nodes can be handled", message
        ):
            section.setdefault("nodes", f"{m[2]} nodes in {m[1]} partition(s)")  # first: as is
        elif m := re.match(r"\s*Unsupported ops: (.+)", message):
            section["unsupported"] = m[1].replace("ai.onnx:", "")
        elif m := re.match(r"Model should perform well with .+ as is: (\w+)", message):
            section["as_is"] = m[1]
        elif m := re.match(r"Model should perform well with .+ fixed input shapes: (\w+)", message):
            section["fixed"] = m[1]
    missing = [ep for ep in _EPS if found.get(ep, {}).get("as_is") not in _VERDICTS]
    if missing:
        raise StageError(
            f"{onnx_path}: check_onnx_model_mobile_usability printed no verdict for "
            f"{', '.join(missing)}; its output format may have changed"
        )

    if _int8_activations(onnx_path):
        # The checker judges op types only; ORT's NNAPI EP takes QDQ units with uint8
        # activations (int8 only as Conv/MatMul/Gemm weights), so an s8s8 file's quantized
        # nodes would run on the CPU, with fixed shapes or without.
        info = found["NNAPI"]
        info["as_is"] = "NO"
        if "fixed" in info:
            info["fixed"] = "NO"
        info["why"] = "int8 activations: ORT's NNAPI EP takes uint8 ones"
    parts = []
    for ep in _EPS:
        info = found[ep]
        extra = [info.get("nodes", "")]
        if "fixed" in info:
            extra.append(f"{info['fixed']} with fixed shapes")
        if "unsupported" in info:
            extra.append(f"unsupported ops {info['unsupported']}")
        if "why" in info:
            extra.append(info["why"])
        parts.append(f"{ep} {info['as_is']} ({'; '.join(e for e in extra if e)})")
    coreml = max(
        (_VERDICTS[found[ep]["as_is"]] for ep in _EPS[1:]),
        key=_RANK.__getitem__,
    )
    return {
        "nnapi": _VERDICTS[found["NNAPI"]["as_is"]],
        "coreml": coreml,
        "details": "; ".join(parts),
    }


def _int8_activations(onnx_path: Path) -> bool:
    """Whether a QDQ file quantizes activations to int8: a QuantizeLinear whose zero point is
    an int8 initializer (weights are stored quantized and only dequantized)."""
    import onnx

    from compresskit.compressor.export.protos import zero_point_types

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    quantize = [n for n in graph.node if n.op_type == "QuantizeLinear"]
    return onnx.TensorProto.INT8 in zero_point_types(graph, quantize)


def compose_hardsigmoid(graph: Any) -> int:
    """Rewrite each HardSigmoid and HardSwish node of `graph` (in place) as the ops they are
    made of: clip(alpha * x + beta, 0, 1) as Mul, Add, Clip, times x for HardSwish (alpha 1/6,
    beta 1/2), which NNAPI runs. ORT's NNAPI EP has no HardSigmoid (HardSwish is expanded into
    one), and each such node splits the graph: a MobileNetV3-small's INT8 file (28 of them)
    stayed NNAPI "no" with fixed shapes, and was "yes", 286 of 286 nodes in one partition, once
    rewritten. Returns how many nodes it rewrote. Float32 graphs (what `compress` exports);
    ORT computes the fused nodes as the same multiply, add and clamp."""
    from onnx import helper, numpy_helper

    nodes, count = [], 0
    for node in graph.node:
        if node.op_type not in ("HardSigmoid", "HardSwish") or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        swish = node.op_type == "HardSwish"
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        x, y = node.input[0], node.output[0]
        n = {part: f"{y}/hard_{part}" for part in ("alpha", "beta", "lo", "hi", "ax", "axb")}
        alpha, beta = (1 / 6, 0.5) if swish else (attrs.get("alpha", 0.2), attrs.get("beta", 0.5))
        for part, value in (("alpha", alpha), ("beta", beta), ("lo", 0.0), ("hi", 1.0)):
            graph.initializer.append(numpy_helper.from_array(np.float32(value), n[part]))
        stem, gate = node.name or y, f"{y}/hard_gate" if swish else y
        nodes += [
            helper.make_node("Mul", [x, n["alpha"]], [n["ax"]], name=f"{stem}/mul"),
            helper.make_node("Add", [n["ax"], n["beta"]], [n["axb"]], name=f"{stem}/add"),
            helper.make_node("Clip", [n["axb"], n["lo"], n["hi"]], [gate], name=f"{stem}/clip"),
        ]
        if swish:
            nodes.append(helper.make_node("Mul", [x, gate], [y], name=f"{stem}/times_x"))
        count += 1
    if count:
        del graph.node[:]
        graph.node.extend(nodes)
    return count


def fixed_batch(onnx_path: Path, out_path: Path, batch: int) -> Path:
    """Write a copy of the model whose inputs have their first (batch) dimension fixed to `batch`
    (the file for NNAPI, which needs fixed shapes), its HardSigmoid and HardSwish nodes written
    as Mul, Add, Clip (`compose_hardsigmoid`; checked against the source on random inputs when
    any were).

    A named dimension (`batch` from torch.export.Dim) is replaced everywhere in the graph with
    `onnx_model_utils.make_dim_param_fixed`, as `make_dynamic_shape_fixed --dim_param` does; an
    unnamed one is set on the input itself. A token model's symbolic sequence axis
    (`export_onnx`'s `sequence`) is fixed to the length in its metadata (`sequence_length`).
    Output shapes are then re-inferred (`fix_output_shapes`). The copy is written atomically and must pass
    `onnx.checker.check_model(full_check=True)` (else StageError, nothing written).

    InputError if `batch` < 1 or no input has a dynamic first dimension. Returns the path.
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InputError(f"batch {batch!r}: must be a whole number >= 1, e.g. 1")
    onnx_path = _validated(onnx_path)
    out = check_writable(out_path)

    import onnx
    from onnxruntime.tools.onnx_model_utils import fix_output_shapes, make_dim_param_fixed

    model = onnx.load(str(onnx_path))
    initializers = {t.name for t in model.graph.initializer}  # IR < 4 lists them as inputs
    changed = []
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim if value.type.HasField("tensor_type") else []
        if value.name in initializers or not dims:
            continue
        first = dims[0]
        if first.HasField("dim_param"):
            make_dim_param_fixed(model.graph, first.dim_param, batch)
            changed.append(value.name)
        elif not (first.HasField("dim_value") and first.dim_value > 0):
            first.Clear()  # unknown or an exporter's -1: only this input carries it
            first.dim_value = batch
            changed.append(value.name)
    # a token model's sequence too: NNAPI needs every shape (replaced everywhere, once)
    length = protos.trained_length(protos.metadata(model))
    symbolic = (
        d.dim_param
        for value in model.graph.input
        if value.type.HasField("tensor_type")
        for d in value.type.tensor_type.shape.dim[1:]
    )
    if length is not None and SEQUENCE in symbolic:
        make_dim_param_fixed(model.graph, SEQUENCE, length)
    if not changed:
        shapes = ", ".join(
            f"{v.name}{[d.dim_value or d.dim_param or '?' for d in v.type.tensor_type.shape.dim]}"
            for v in model.graph.input
            if v.name not in initializers
        )
        raise InputError(
            f"{onnx_path}: no input has a dynamic batch dimension ({shapes}); "
            "its batch is already fixed, use the model as it is"
        )
    composed = compose_hardsigmoid(model.graph)
    try:
        fix_output_shapes(model)
    except Exception as e:
        raise StageError(f"{onnx_path}: shape inference failed after fixing the batch ({e})") from e

    with atomic_path(out) as tmp:
        onnx.save(model, str(tmp))
        try:
            onnx.checker.check_model(str(tmp), full_check=True)
        except Exception as e:
            raise StageError(f"{out}: the batch-{batch} model fails onnx.checker ({e})") from e
        if composed:
            _check_same_outputs(onnx_path, tmp)
    return out


def _check_same_outputs(source: Path, rewritten: Path) -> None:
    """The rewritten file answers as `source` on random inputs of its shapes (StageError if
    not), both on ORT's CPU provider with optimizations off: the graphs as written."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 4  # errors come back as exceptions, not log lines
    new = ort.InferenceSession(str(rewritten), opts, providers=["CPUExecutionProvider"])
    old = ort.InferenceSession(str(source), opts, providers=["CPUExecutionProvider"])
    worst, scale = _compare(old, new, rewritten, shaped_as=new)  # the batch it fixed
    if not worst <= MAX_ABS_DIFF * max(scale, 1e-12):  # `not <=` also catches NaN
        raise StageError(
            f"{source}: HardSigmoid/HardSwish written as Mul, Add, Clip answers "
            "differently; leave fixed_batch unset"
        )
