"""The environment block of a benchmark report: CPU, ISA flags, threads, library versions, GPU.

Latency numbers mean little without the machine they came from: the same INT8 model is several
times faster on a CPU with VNNI or AMX than on one without, and thread counts change everything.
This module collects that context, plus two short probes (FP32 matmul GFLOP/s, INT8 matmul
GOP/s) that put a model's latency next to what the machine can do at best.

Linux-first: CPU details come from /proc/cpuinfo; elsewhere they fall back to `platform`, and
the flags to NumPy's own cpuid dispatch (`numpy_flags`; what it does not name reads False, "not
known to be there"). torch and onnxruntime are imported inside
the functions, so `parse_cpuinfo` stays usable (and importable) without them.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

from compresskit.models.errors import InputError

# The flags that decide which INT8/BF16 kernels oneDNN, MLAS and FBGEMM can use.
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
_PACKAGES = ("torch", "onnxruntime", "onnx", "numpy", "compresskit")


def parse_cpuinfo(text: str) -> dict:
    """Parse /proc/cpuinfo text into model_name, flags, logical_cores and physical_cores.

    `flags` is the set of flags *every* processor lists (the intersection), since on hybrid
    CPUs a kernel may run on any core. `physical_cores` counts distinct (physical id, core id)
    pairs, or is None when the file has no core ids (VMs, ARM). Pure: no file access.
    """
    blocks = [b for b in text.split("\n\n") if b.strip()]
    model_name = None
    flags: set[str] | None = None
    cores: set[tuple[str, str]] = set()
    logical = 0
    for block in blocks:
        fields: dict[str, str] = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        if "processor" not in fields:
            continue
        logical += 1
        model_name = model_name or fields.get("model name")
        # x86 says "flags"; arm64 says "Features".
        own = set((fields.get("flags") or fields.get("Features") or "").split())
        flags = own if flags is None else flags & own
        if "core id" in fields:
            cores.add((fields.get("physical id", "0"), fields["core id"]))
    return {
        "model_name": model_name,
        "flags": flags or set(),
        "logical_cores": logical,
        "physical_cores": len(cores) or None,
    }


def _cpuinfo() -> dict:
    try:
        info = parse_cpuinfo(Path("/proc/cpuinfo").read_text(encoding="utf-8"))
    except OSError:  # not Linux, or /proc not mounted (some sandboxes)
        info = parse_cpuinfo("")
    if not info["flags"]:
        info["flags"] = numpy_flags()
    return info


# NumPy's own CPU dispatch reads cpuid on every OS: its names, and /proc/cpuinfo's for them.
_NUMPY_FLAGS = {
    "AVX2": "avx2",
    "AVX512F": "avx512f",
    "AVX512VNNI": "avx512_vnni",
    "AVX512BF16": "avx512_bf16",
}


def numpy_flags() -> set[str]:
    """The flags of `CPU_FLAGS` NumPy's CPU dispatch found, named as /proc/cpuinfo names them:
    off Linux (an Intel Mac, Windows) there is no /proc/cpuinfo, and `reduce_range = "auto"`
    never saw a CPU with AVX2 but no VNNI, the one it exists for. Empty where NumPy does not
    say (AMX it never does)."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as found
    except ImportError:
        try:
            from numpy.core._multiarray_umath import __cpu_features__ as found
        except ImportError:
            return set()
    return {ours for theirs, ours in _NUMPY_FLAGS.items() if found.get(theirs)}


def cpu_flags() -> set[str]:
    """The CPU flags every core of this machine lists (empty where /proc/cpuinfo is absent)."""
    return set(_cpuinfo()["flags"])


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _nvidia_driver() -> str | None:
    """The driver version from nvidia-smi, or None if it is absent, hangs or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if lines else None


def _gpu() -> dict | None:
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return {
        "name": props.name,
        "count": torch.cuda.device_count(),
        "memory_gib": round(props.total_memory / 2**30, 1),
        "driver": _nvidia_driver(),
        "cuda": torch.version.cuda,
    }


def environment() -> dict:
    """The environment block for a benchmark report (JSON-serialisable)."""
    import torch

    try:
        import onnxruntime as ort

        providers = list(ort.get_available_providers())
    except ImportError:
        providers = []
    info = _cpuinfo()
    return {
        "cpu_model": info["model_name"] or platform.processor() or None,
        "cpu_flags": {flag: flag in info["flags"] for flag in CPU_FLAGS},
        "physical_cores": info["physical_cores"],
        "logical_cores": os.cpu_count(),
        # the cores this process may run on (taskset, a container's cpuset): torch's default
        # thread count follows them, and retraining's float sums follow that count
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        # other work on the machine: timings and measured peaks shrink under it
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "os": platform.platform(),
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in _PACKAGES},
        "ort_providers": providers,
        "gpu": _gpu(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def bf16_supported() -> bool:
    """Whether offering PyTorch CPU bf16 makes sense: the CPU has native bf16 (AVX512-BF16 or AMX).

    Other CPUs run bf16 by converting to FP32 and back, which is usually slower than FP32 itself,
    so a bf16 variant there would only be a slower copy of the FP32 one.
    """
    flags = _cpuinfo()["flags"]
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _check_probe(seconds: float, threads: int, n: int) -> None:
    if not seconds > 0:
        raise InputError(f"probe seconds {seconds} must be positive; pass e.g. 0.5")
    if threads < 1 or n < 1:
        raise InputError(f"probe threads={threads}, n={n} must be at least 1; pass e.g. 1, 512")


def _best_rate(call, ops: float, seconds: float) -> float:
    """Best ops/s of `call` over ~5 timed repetitions that share `seconds` between them.

    The best, not the mean, because a peak probe asks what the machine can do; interruptions
    by other load only ever make a repetition slower.
    """
    call()  # warm-up: first-call allocation, kernel selection, thread-pool start
    start = time.perf_counter()
    call()
    one = max(time.perf_counter() - start, 1e-9)
    per_rep = max(1, int(seconds / 5 / one))
    best = 0.0
    deadline = time.perf_counter() + seconds
    reps = 0
    while reps < 3 or (time.perf_counter() < deadline and reps < 50):
        start = time.perf_counter()
        for _ in range(per_rep):
            call()
        elapsed = max(time.perf_counter() - start, 1e-9)
        best = max(best, per_rep * ops / elapsed)
        reps += 1
    return best


def matmul_peak_gflops(seconds: float = 0.5, threads: int = 1, n: int = 512) -> float:
    """Achieved FP32 GFLOP/s of torch.matmul on n x n matrices (2 n^3 flops each) on `threads`.

    torch's intra-op thread count is restored afterwards, even if the probe fails.
    """
    _check_probe(seconds, threads, n)
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, generator=gen)
        b = torch.randn(n, n, generator=gen)
        out = torch.empty(n, n)
        with torch.inference_mode():
            rate = _best_rate(lambda: torch.matmul(a, b, out=out), 2.0 * n**3, seconds)
    finally:
        torch.set_num_threads(before)
    return rate / 1e9


def int8_peak_gops(seconds: float = 0.5, threads: int = 1, n: int = 512) -> float:
    """Achieved INT8 GOP/s of ONNX Runtime's MatMulInteger (uint8 x int8, n x n) on `threads`.

    uint8 activations times int8 weights is what ORT's quantized models run (the u8s8 MLAS
    kernels, VNNI/AMX where present); the weight is an initializer, as in a real model. The
    time includes session.run's per-call overhead, which at n=512 is a few percent.
    """
    _check_probe(seconds, threads, n)
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weight = rng.integers(-128, 128, size=(n, n), dtype=np.int8)
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "w"], ["y"])],
        "int8_probe",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [n, n])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [n, n])],
        initializer=[numpy_helper.from_array(weight, "w")],
    )
    # Pin the IR version: a newer onnx writes IRs an older onnxruntime refuses to load, and
    # opset 13 needs only IR 7.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7)
    onnx.checker.check_model(model)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 4  # errors come back as exceptions, not log lines
    session = ort.InferenceSession(
        model.SerializeToString(), opts, providers=["CPUExecutionProvider"]
    )
    feed = {"a": rng.integers(0, 256, size=(n, n), dtype=np.uint8)}
    rate = _best_rate(lambda: session.run(None, feed), 2.0 * n**3, seconds)
    return rate / 1e9
