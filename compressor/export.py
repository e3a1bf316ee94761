"""PyTorch -> ONNX FP32 -> INT8 ONNX, with ONNX Runtime's own quantizer, and the checks that
say the files still answer like the model.

* `export_onnx`: `torch.onnx.export` (the dynamo exporter) to one self-contained file (no
  external data), a dynamic batch axis, a chosen opset; optionally IR 9 so ONNX Runtime <= 1.17
  loads it. Every file passes `onnx.checker.check_model(full_check=True)` and loads in ORT.
* `quantize_int8`: `quant_pre_process`, then static QDQ quantization calibrated on training
  inputs: uint8 activations, int8 per-channel weights (U8S8, `reduce_range=False`), MinMax by
  default, Entropy or Percentile on request.
* `choose_precision`: latency- and accuracy-aware mixed precision. INT8 is not always faster:
  a 1->6-channel first conv runs 2.4x slower in INT8 on our CPU (KNOW-HOW). Each quantizable
  node is tried in FP32, measured against the current best, and kept in FP32 when that is
  clearly faster (beyond `clearly_faster`'s noise margin) or answers closer to FP32; if the
  result is still clearly slower than the FP32 model, every node stays FP32. What is returned
  is not slower than FP32 beyond measurement noise, at the measured batch size.
* `parity`: accuracy, top-1 agreement and max |delta logit| of a file against the model.
* `weight_invariants`: pruned zeros stay zero and shared layers keep <= 2^bits values, read
  back from the exported file.

onnx and onnxruntime are imported inside functions, so `import compressor` stays light.
"""

from __future__ import annotations

import contextlib
import copy
import io
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from compressor import benchmark, prune
from models.errors import InputError, StageError
from models.fileio import atomic_path

QUANTIZABLE = ("Conv", "Gemm", "MatMul")
METHODS = ("minmax", "entropy", "percentile")


@dataclass(frozen=True)
class ExportConfig:
    """opset: ONNX opset of the file; ir_version: 9 for ONNX Runtime <= 1.17 (None: the
    exporter's); dynamic_batch: a symbolic batch axis (else the example's batch is fixed)."""

    opset: int = 18
    ir_version: int | None = None
    dynamic_batch: bool = True

    def __post_init__(self) -> None:
        if not 13 <= self.opset <= 23:
            raise InputError(f"opset {self.opset} is out of range; give 13..23 (default 18)")
        if self.ir_version is not None and self.ir_version not in (8, 9, 10, 11):
            raise InputError(f"ir_version {self.ir_version} is not one of 8, 9, 10, 11")
        if self.ir_version == 9 and self.opset > 20:
            raise InputError(f"IR 9 (ONNX Runtime <= 1.17) reads opsets up to 20, not {self.opset}")


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


def load_calibration(path: Path, flag: str = "--calibration") -> np.ndarray:
    """Calibration inputs from a .npy file: a finite float array, samples first, non-empty.
    Integer arrays are refused: the model sees inputs scaled as in training (pixels / 255
    for MNIST), which only the user knows how to reproduce."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{flag} {path}: no such file; give a .npy array of inputs")
    with path.open("rb") as f:
        if f.read(6) != b"\x93NUMPY":  # numpy would take any other file for a pickle
            raise InputError(f"{flag} {path}: not a .npy array; save one with numpy.save")
    try:
        x = np.load(path, allow_pickle=False)
    except ValueError:
        raise InputError(
            f"{flag} {path}: holds Python objects; save a float array with numpy.save"
        ) from None
    except Exception as e:
        raise InputError(
            f"{flag} {path}: not a .npy array ({type(e).__name__}); save one with numpy.save"
        ) from None
    if not isinstance(x, np.ndarray) or x.dtype.kind != "f" or x.ndim < 2:
        raise InputError(
            f"{flag} {path}: needs a float array of inputs scaled as in training, samples "
            f"first (got {getattr(x, 'dtype', type(x))} of shape {getattr(x, 'shape', '?')})"
        )
    if len(x) == 0:
        raise InputError(f"{flag} {path}: is empty; give at least one input sample")
    if not np.isfinite(x).all():
        raise InputError(f"{flag} {path}: holds NaN or infinite values; clean the inputs")
    return x.astype(np.float32)


def _session(path: Path | str, threads: int = 1):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def run(session, x: np.ndarray, batch: int = 256) -> np.ndarray:
    name = session.get_inputs()[0].name
    outs = [session.run(None, {name: x[i : i + batch]})[0] for i in range(0, len(x), batch)]
    return np.concatenate(outs) if outs else np.zeros((0,))


def predict(path: Path, x: np.ndarray) -> np.ndarray:
    """The ONNX file's outputs for `x` on ORT's CPU provider (one thread)."""
    return run(_session(path), x)


def export_onnx(model: nn.Module, example: torch.Tensor, path: Path, cfg: ExportConfig) -> Path:
    """Write `model` (masks and shared weights baked in) as one ONNX file at `path`."""
    import onnx

    model = prune.bake_(copy.deepcopy(model)).eval()
    dynamic = ({0: torch.export.Dim("batch")},) if cfg.dynamic_batch else None
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "model.onnx"
        try:
            # The exporter reports progress on stdout/stderr and through torch's loggers; the
            # library stays silent.
            with (
                _quiet(),
                contextlib.redirect_stdout(io.StringIO()),
                contextlib.redirect_stderr(io.StringIO()),
            ):
                torch.onnx.export(
                    model,
                    (example,),
                    str(raw),
                    dynamic_shapes=dynamic,
                    external_data=False,
                    opset_version=cfg.opset,
                )
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise StageError(f"ONNX export failed: {type(e).__name__}: {first}") from None
        proto = onnx.load(str(raw))
        if cfg.ir_version is not None:
            proto.ir_version = cfg.ir_version
        with atomic_path(path) as out:
            onnx.save(proto, str(out))
            check(out)
    return path


@contextlib.contextmanager
def _quiet():
    import logging

    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def check(path: Path) -> None:
    """onnx.checker with full_check, and a load in ONNX Runtime; StageError otherwise."""
    import onnx

    try:
        onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    except Exception as e:
        raise StageError(f"{path}: fails onnx.checker: {' '.join(str(e).split())[:300]}") from None
    try:
        _session(path)
    except Exception as e:
        raise InputError(
            f"{path}: ONNX Runtime cannot load it ({' '.join(str(e).split())[:200]}); "
            "choose a lower opset"
        ) from None


# --- INT8 -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantConfig:
    """Static INT8 quantization. `calibration`: samples from the training set; `method`:
    minmax, entropy or percentile; `latency_aware`: keep slower or harmful nodes in FP32;
    `min_agreement`: top-1 agreement with FP32 below which nodes go back to FP32;
    `batch`: the batch size latency is measured at."""

    calibration: int = 256
    method: str = "minmax"
    per_channel: bool = True
    latency_aware: bool = True
    min_agreement: float = 0.995
    batch: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InputError(f"quantization method {self.method!r}: one of {', '.join(METHODS)}")
        if self.calibration < 1:
            raise InputError(f"calibration samples {self.calibration}: give 1 or more")
        if not 0 <= self.min_agreement <= 1:
            raise InputError(f"min_agreement {self.min_agreement}: a fraction in [0, 1]")


def _reader(x: np.ndarray, input_name: str, batch: int = 32):
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([{input_name: x[i : i + batch]} for i in range(0, len(x), batch)])

        def get_next(self):
            return next(self.batches, None)

    return Reader()


def _check_calibration(path: Path, calib: np.ndarray) -> str:
    session = _session(path)
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
    return inp.name


def preprocess(fp32: Path, out: Path) -> Path:
    """ORT's quant_pre_process (shape inference + graph optimisation) before quantizing."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        quant_pre_process(str(fp32), str(out), skip_symbolic_shape=False)
    return out


def quantizable_nodes(path: Path) -> list[str]:
    import onnx

    return [n.name for n in onnx.load(str(path)).graph.node if n.op_type in QUANTIZABLE]


def quantize_int8(
    prepared: Path, out: Path, calib: np.ndarray, cfg: QuantConfig, exclude: Iterable[str] = ()
) -> Path:
    """Static QDQ U8S8 quantization of a `preprocess`ed model; `exclude` nodes stay FP32."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    name = _check_calibration(prepared, calib)
    method = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }[cfg.method]
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        q = Path(tmp) / "int8.onnx"
        quantize_static(
            str(prepared),
            str(q),
            _reader(calib, name),
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            per_channel=cfg.per_channel,
            reduce_range=False,
            calibrate_method=method,
            nodes_to_exclude=list(exclude),
        )
        with atomic_path(out) as dst:
            dst.write_bytes(q.read_bytes())
            check(dst)
    return out


def latency_ms(
    paths: list[Path], batch: int, shape: tuple[int, ...], seconds: float = 0.6
) -> list[float]:
    """p50 latency (ms) of each model at `batch`, measured interleaved, one thread each."""
    x = np.random.default_rng(0).random((batch, *shape), dtype=np.float32)
    return benchmark.p50_ms([benchmark.onnx_runner(p, x) for p in paths], seconds)


def agreement(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(a.argmax(1) == b.argmax(1)))


@dataclass
class PrecisionChoice:
    path: Path
    fp32_nodes: dict[str, str] = field(default_factory=dict)  # node -> why it stayed FP32
    latency_ms: dict[str, float] = field(default_factory=dict)
    agreement: float = 1.0
    int8_nodes: int = 0  # quantizable nodes that run in INT8 in the shipped file
    quantizable: int = 0


def choose_precision(
    fp32: Path, out: Path, calib: np.ndarray, check_x: np.ndarray, cfg: QuantConfig
) -> PrecisionChoice:
    """Quantize, then keep in FP32 each node where INT8 is slower or less faithful."""
    shape = tuple(check_x.shape[1:])
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prepared = preprocess(fp32, tmp / "prepared.onnx")
        nodes = quantizable_nodes(prepared)
        reference = run(_session(fp32), check_x)
        best = quantize_int8(prepared, tmp / "best.onnx", calib, cfg)
        best_agree = agreement(run(_session(best), check_x), reference)
        excluded: dict[str, str] = {}
        if cfg.latency_aware:
            for i, node in enumerate(nodes):
                cand = quantize_int8(prepared, tmp / f"c{i}.onnx", calib, cfg, [*excluded, node])
                t_best, t_cand = latency_ms([best, cand], cfg.batch, shape)
                cand_agree = agreement(run(_session(cand), check_x), reference)
                if clearly_faster(t_cand, t_best):
                    why = f"INT8 slower: {t_best:.3f} ms with it in INT8, {t_cand:.3f} ms in FP32"
                elif best_agree < cfg.min_agreement and cand_agree > best_agree:
                    why = f"accuracy: top-1 agreement {best_agree:.4f} -> {cand_agree:.4f} in FP32"
                else:
                    continue
                excluded[node] = why
                best, best_agree = cand, cand_agree
        t_fp32, t_best = latency_ms([fp32, best], cfg.batch, shape)
        if cfg.latency_aware and clearly_faster(t_fp32, t_best) and len(excluded) < len(nodes):
            # Mixed precision still loses to FP32: ship FP32 weights in the "INT8" file.
            excluded = {
                n: f"whole model: INT8 {t_best:.3f} ms vs FP32 {t_fp32:.3f} ms" for n in nodes
            }
            best = quantize_int8(prepared, tmp / "all_fp32.onnx", calib, cfg, nodes)
            best_agree = 1.0
            t_fp32, t_best = latency_ms([fp32, best], cfg.batch, shape)
        with atomic_path(out) as dst:
            dst.write_bytes(best.read_bytes())
        return PrecisionChoice(
            out,
            excluded,
            {"fp32": t_fp32, "int8": t_best},
            best_agree,
            int8_nodes=len(nodes) - len(excluded),
            quantizable=len(nodes),
        )


# Below these, two medians are a tie: one ORT call from Python costs ~7 us and its jitter is a
# few us, so a 1 us "win" on a 10 us model is noise. Ties keep INT8 (the smaller file).
TIE_RATIO = 0.90
TIE_MS = 0.005


def clearly_faster(a_ms: float, b_ms: float) -> bool:
    """Is latency `a` faster than `b` beyond measurement noise?"""
    return a_ms < TIE_RATIO * b_ms and b_ms - a_ms > TIE_MS


# --- parity and invariants --------------------------------------------------------------------


def parity(model: nn.Module, path: Path, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """The file's test accuracy, its top-1 agreement with the PyTorch model, max |delta logit|."""
    model = prune.bake_(copy.deepcopy(model)).eval()
    with torch.no_grad():
        ref = torch.cat([model(x[i : i + 512]) for i in range(0, len(x), 512)]).numpy()
    got = run(_session(path), x.numpy())
    return {
        "test_accuracy": float(np.mean(got.argmax(1) == y.numpy())),
        "top1_agreement": agreement(got, ref),
        "max_abs_diff": float(np.abs(got - ref).max()),
    }


def weight_invariants(path: Path, model: nn.Module, bits: dict[str, int]) -> dict[str, Any]:
    """Read each Linear/Conv weight back from the file: its zeros must be where the model's
    are, and a shared layer (named in `bits`) must hold <= 2^bits distinct values in each
    output channel (INT8 scales and folded BatchNorm multiply each channel by its own factor)."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(path)).graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    state = prune.bake_(copy.deepcopy(model)).state_dict()
    out: dict[str, Any] = {}
    for name, w in state.items():
        if not name.endswith(".weight") or w.ndim < 2:
            continue
        found = _find_weight(inits, name, w)
        if found is None:
            continue
        arr, quantized = found
        # Pruned weights must stay exactly zero (INT8 may also round tiny survivors to zero).
        zeros_ok = bool(np.all(arr.reshape(w.shape)[(w == 0).numpy()] == 0))
        layer = name.removesuffix(".weight")
        # Per output channel: INT8 scales each channel, and the exporter folds BatchNorm into
        # the preceding conv's weights, which also scales each channel.
        distinct = max(len(np.unique(r)) for r in arr.reshape(w.shape[0], -1))
        limit = 2 ** bits[layer] if layer in bits else None
        out[name] = {
            "zeros_kept": zeros_ok,
            "distinct_values_per_channel": int(distinct),
            "distinct_values": len(np.unique(arr)),
            "limit": limit,
            "ok": zeros_ok and (limit is None or distinct <= limit),
            "int8": quantized,
        }
    return out


def _find_weight(inits: dict[str, np.ndarray], name: str, w: torch.Tensor):
    """The initializer holding `name`: by name (FP32 export keeps parameter names), else by
    shape among int8 initializers (QDQ renames them `<name>_quantized`)."""
    for key, arr in inits.items():
        if key == name or key.startswith(name + "_quantized"):
            return arr, arr.dtype == np.int8
        if key.replace("/", ".").endswith(name) and arr.shape == tuple(w.shape):
            return arr, arr.dtype == np.int8
    return None


def ort_baselines(fp32: Path, out_dir: Path, calib: np.ndarray) -> list[Path]:
    """What ONNX Runtime gives without compress: `quantize_dynamic` (int8 weights, activations
    quantized at run time) and `quantize_static` with all its defaults (QDQ, int8 activations
    and weights, per-tensor, MinMax), calibrated on `calib`, both after `quant_pre_process`."""
    from onnxruntime.quantization import QuantType, quantize_dynamic, quantize_static

    stem = Path(fp32).name.removesuffix(".onnx").removesuffix(".fp32")
    dynamic = out_dir / f"{stem}.ort-dynamic.onnx"
    static = out_dir / f"{stem}.ort-static-default.onnx"
    name = _check_calibration(fp32, calib)
    with tempfile.TemporaryDirectory() as tmp, _root_log_quiet():
        # ORT's shape pre-processing first, as its docs ask (the dynamo exporter's shape
        # annotations otherwise trip its shape inference); the quantizers then run on defaults.
        prepared = preprocess(fp32, Path(tmp) / "prepared.onnx")
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            quantize_dynamic(str(prepared), str(dynamic), weight_type=QuantType.QInt8)
            quantize_static(str(prepared), str(static), _reader(calib, name))
    return [dynamic, static]


@contextlib.contextmanager
def _root_log_quiet():
    """ORT's quantizer warns through the root logger, which Python prints to stderr when no
    handler is configured; the library stays silent."""
    import logging

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)
