"""Where an ONNX model spends its time: per-operator kernel time from ONNX Runtime's profiler.

A benchmark says how fast a file runs; this says why, e.g. that an INT8 file spends 41% of
its time in QLinearConv and 20% in QuantizeLinear/DequantizeLinear around nodes left in FP32.

The profile describes the graph ORT actually runs, after its optimisations, so operator names
are ORT's and not always the file's: on CPU a QDQ file's DequantizeLinear -> Conv ->
QuantizeLinear groups run as QLinearConv (Gemm as QGemm, MatMul as QLinearMatMul or
MatMulIntegerToFloat), with Transpose nodes for the NHWC layout they use; only Q/DQ pairs that
could not be fused stay. FP32 Conv runs as the NCHWc Conv plus ReorderInput/ReorderOutput, and
Gemm followed by an activation as FusedGemm.

Times are the kernels' own (`<node>_kernel_time` events); the executor's overhead between
kernels is not in `total_us_per_run` but is in `session_us_per_run` (ORT's `model_run` spans).
The profiler's JSON trace goes to a temporary folder, deleted before returning: nothing is
written beside the model or in the working directory.

onnxruntime is imported inside functions, so `import compressor.measure.ortprofile` stays light.
"""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from compresskit.models.errors import InputError, StageError, one_line


def _session(path: Path, threads: int, providers: Sequence[str], prefix: str):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.enable_profiling = True
    opts.profile_file_prefix = prefix  # the trace lands in our temporary folder, not the cwd
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 4  # errors come back as exceptions, not log lines
    try:
        # no retry on the CPU EP inside ORT's class (see latency._session)
        return ort.InferenceSession(str(path), opts, providers=list(providers), enable_fallback=0)
    except Exception as e:
        msg = one_line(e)
        raise InputError(
            f"{path}: ONNX Runtime cannot load it ({msg}); give an .onnx model"
        ) from None


def _trace(path, x, runs, threads, providers, warmup) -> list[dict]:
    """The profiler's events of `warmup + runs` inferences of the file at `path` on `x`."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file; give an .onnx model")
    for name, value, low in (("runs", runs, 1), ("threads", threads, 1), ("warmup", warmup, 0)):
        if not isinstance(value, int) or value < low:
            raise InputError(f"{path}: {name} {value!r} must be a whole number >= {low}")
    x = np.ascontiguousarray(x)
    with tempfile.TemporaryDirectory(prefix="ortprofile-") as tmp:
        session = _session(path, threads, providers, str(Path(tmp) / "profile"))
        inputs = session.get_inputs()
        if len(inputs) != 1:
            session.end_profiling()
            raise InputError(f"{path}: has {len(inputs)} inputs; profile_ops feeds exactly one")
        feed = {inputs[0].name: x}
        try:
            for _ in range(warmup + runs):
                session.run(None, feed)
        except Exception as e:
            msg = one_line(e, 160)
            raise InputError(
                f"{path}: input of shape {x.shape} and dtype {x.dtype} does not fit "
                f"{inputs[0].name} {inputs[0].shape} {inputs[0].type} ({msg})"
            ) from None
        finally:
            trace = Path(session.end_profiling())  # written now, inside tmp
        return json.loads(trace.read_text(encoding="utf-8"))


def profile_ops(
    path: Path | str,
    x: np.ndarray,
    runs: int = 50,
    threads: int = 1,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    warmup: int = 5,
) -> dict[str, Any]:
    """Per-operator-type time of `runs` inferences of the file at `path` on input `x`.

    Returns {"runs", "total_us_per_run" (sum of kernel times), "session_us_per_run" (whole
    runs, executor included), "ops": [{"op_type", "us_per_run", "share", "nodes"}, ...]},
    slowest operator type first; `share` is of `total_us_per_run`, `nodes` the number of
    distinct nodes of that type that ran. The `warmup` runs before are left out.
    """
    return _summarise(_trace(path, x, runs, threads, providers, warmup), warmup, runs, Path(path))


def _summarise(events: list[dict], warmup: int, runs: int, path: Path) -> dict[str, Any]:
    nodes = _nodes(events, warmup, runs, path)
    us: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for node in nodes["nodes"].values():
        us[node["op_type"]] += node["us_per_run"]
        count[node["op_type"]] += 1
    total = sum(us.values())
    ops = [
        {"op_type": op, "us_per_run": t, "share": t / total if total else 0.0, "nodes": count[op]}
        for op, t in sorted(us.items(), key=lambda kv: (-kv[1], kv[0]))
    ]
    return {
        "runs": runs,
        "total_us_per_run": total,
        "session_us_per_run": nodes["session_us_per_run"],
        "ops": ops,
    }


def profile_nodes(
    path: Path | str,
    x: np.ndarray,
    runs: int = 50,
    threads: int = 1,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    warmup: int = 5,
) -> dict[str, Any]:
    """Per-node time of `runs` inferences: {"runs", "session_us_per_run", "nodes": {name:
    {"op_type", "us_per_run"}}}. Names are those of the graph ORT ran, after its fusions
    (a QDQ Conv runs as a QLinearConv named after the Conv node, plus a suffix)."""
    events = _trace(path, x, runs, threads, providers, warmup)
    return {"runs": runs, **_nodes(events, warmup, runs, Path(path))}


def _nodes(events: list[dict], warmup: int, runs: int, path: Path) -> dict[str, Any]:
    # Each inference is one Session "model_run" span; the warm-up runs come first, so kernel
    # events starting before the first measured run belong to them.
    spans = sorted(
        (e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
        key=lambda e: e["ts"],
    )
    if len(spans) != warmup + runs:
        # The profiler stops recording at its event limit; a partial trace would under-count.
        raise StageError(
            f"{path}: the profiler recorded {len(spans)} of {warmup + runs} runs; use fewer runs"
        )
    measured = spans[warmup:]
    start = measured[0]["ts"]
    us: dict[str, float] = defaultdict(float)
    op: dict[str, str] = {}
    for e in events:
        if (
            e.get("cat") == "Node"
            and e.get("name", "").endswith("_kernel_time")
            and e["ts"] >= start
        ):
            name = e["name"].removesuffix("_kernel_time")
            us[name] += e["dur"]
            op[name] = e.get("args", {}).get("op_name", "?")
    return {
        "session_us_per_run": sum(e["dur"] for e in measured) / runs,
        "nodes": {n: {"op_type": op[n], "us_per_run": t / runs} for n, t in us.items()},
    }


def top_ops(profile: dict[str, Any], k: int = 3) -> list[str]:
    """The `k` slowest operator types of a `profile_ops` result, as "QLinearConv 41%"."""
    return [f"{op['op_type']} {op['share']:.0%}" for op in profile["ops"][:k]]
