"""compressor.measure.envinfo: the cpuinfo parser on fixed text, the report block, and the peak
probes."""

from __future__ import annotations

import json
import math
from datetime import datetime

import pytest
import torch

from compresskit.compressor.measure import envinfo
from compresskit.compressor.measure.envinfo import (
    CPU_FLAGS,
    bf16_supported,
    environment,
    int8_peak_gops,
    matmul_peak_gflops,
    parse_cpuinfo,
)
from compresskit.models.errors import InputError

# Two logical CPUs on one physical core (hyper-threads), the second lacking avx512_bf16.
CPUINFO = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
physical id\t: 0
core id\t\t: 0
flags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 amx_tile amx_int8

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
physical id\t: 0
core id\t\t: 0
flags\t\t: fpu sse2 avx2 avx512f avx512_vnni amx_tile amx_int8

"""


def test_parse_cpuinfo_two_processors():
    info = parse_cpuinfo(CPUINFO)
    assert info["model_name"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert info["logical_cores"] == 2
    assert info["physical_cores"] == 1
    # Intersection: avx512_bf16 is on processor 0 only, so it does not count.
    assert info["flags"] == {
        "fpu",
        "sse2",
        "avx2",
        "avx512f",
        "avx512_vnni",
        "amx_tile",
        "amx_int8",
    }


def test_parse_cpuinfo_counts_cores_per_socket():
    # Same core id 0, but on two sockets: two physical cores.
    first, second = CPUINFO.split("\n\n", 1)
    two_sockets = first + "\n\n" + second.replace("physical id\t: 0", "physical id\t: 1")
    assert parse_cpuinfo(two_sockets)["physical_cores"] == 2


def test_parse_cpuinfo_without_core_ids_or_text():
    arm = "processor\t: 0\nFeatures\t: fp asimd\n\nprocessor\t: 1\nFeatures\t: fp asimd\n"
    info = parse_cpuinfo(arm)
    assert info == {
        "model_name": None,
        "flags": {"fp", "asimd"},
        "logical_cores": 2,
        "physical_cores": None,
    }
    assert parse_cpuinfo("") == {
        "model_name": None,
        "flags": set(),
        "logical_cores": 0,
        "physical_cores": None,
    }


def test_environment_keys_and_types():
    env = environment()
    json.dumps(env)  # goes into a JSON report as is
    assert isinstance(env["cpu_model"], str | None)
    assert list(env["cpu_flags"]) == list(CPU_FLAGS)
    assert all(isinstance(v, bool) for v in env["cpu_flags"].values())
    assert env["physical_cores"] is None or 1 <= env["physical_cores"] <= env["logical_cores"]
    assert env["logical_cores"] >= 1
    assert env["torch_threads"] == torch.get_num_threads()
    assert isinstance(env["os"], str) and env["os"]
    assert env["python"].count(".") == 2
    assert env["versions"]["torch"] == torch.__version__
    assert env["versions"]["numpy"] is not None
    assert set(env["versions"]) == {"torch", "onnxruntime", "onnx", "numpy", "compresskit"}
    assert "CPUExecutionProvider" in env["ort_providers"]
    assert datetime.fromisoformat(env["date"]).utcoffset().total_seconds() == 0


def test_environment_flags_follow_cpuinfo(monkeypatch):
    monkeypatch.setattr(envinfo, "_cpuinfo", lambda: parse_cpuinfo(CPUINFO))
    env = environment()
    assert env["cpu_model"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert env["physical_cores"] == 1
    assert env["cpu_flags"] == {
        "avx2": True,
        "avx512f": True,
        "avx512_vnni": True,
        "avx512_bf16": False,
        "amx_tile": True,
        "amx_int8": True,
        "amx_bf16": False,
    }
    assert bf16_supported() is False
    monkeypatch.setattr(
        envinfo, "_cpuinfo", lambda: parse_cpuinfo(CPUINFO.replace("amx_int8", "amx_int8 amx_bf16"))
    )
    assert bf16_supported() is True


def test_gpu_is_none_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present; gpu is a dict here")
    assert environment()["gpu"] is None


def test_nvidia_driver_tolerates_absence(monkeypatch):
    monkeypatch.setattr(envinfo.shutil, "which", lambda name: None)
    assert envinfo._nvidia_driver() is None


@pytest.mark.parametrize("probe", [matmul_peak_gflops, int8_peak_gops])
def test_peak_probe_is_positive_and_restores_threads(probe):
    before = torch.get_num_threads()
    other = 1 if before > 1 else 2
    rate = probe(seconds=0.05, threads=other, n=128)
    assert math.isfinite(rate) and rate > 0
    assert torch.get_num_threads() == before


def test_matmul_probe_restores_threads_on_failure(monkeypatch):
    before = torch.get_num_threads()

    def broken(*args, **kwargs):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(torch, "matmul", broken)
    with pytest.raises(RuntimeError, match="kernel failed"):
        matmul_peak_gflops(seconds=0.05, threads=1 if before > 1 else 2, n=8)
    assert torch.get_num_threads() == before


def test_probe_arithmetic_counts_two_n_cubed_flops(monkeypatch):
    # A fake clock that advances 1 ms per reading; each repetition reads it twice, so with
    # per_rep matmuls per repetition the rate must be per_rep * 2 n^3 / 1 ms exactly.
    ticks = iter(range(10**6))
    monkeypatch.setattr(envinfo.time, "perf_counter", lambda: next(ticks) * 1e-3)
    n = 16
    gflops = matmul_peak_gflops(seconds=0.005, threads=1, n=n)
    # Warm-up timing reads 1 ms for one call, so per_rep = int(0.005 / 5 / 0.001) = 1.
    assert gflops == pytest.approx(2 * n**3 / 1e-3 / 1e9)


@pytest.mark.parametrize("kwargs", [{"seconds": 0}, {"threads": 0}, {"n": 0}])
def test_probe_refuses_bad_arguments(kwargs):
    with pytest.raises(InputError):
        matmul_peak_gflops(**kwargs)


def test_without_proc_cpuinfo_the_flags_come_from_numpy(monkeypatch):
    """An Intel Mac or Windows has no /proc/cpuinfo: every flag read False, so reduce_range
    "auto" never turned on for AVX2 without VNNI, the CPU it exists for."""
    from pathlib import Path

    from compresskit.compressor.measure import envinfo

    real = Path.read_text

    def no_proc(self, *args, **kwargs):
        if str(self) == "/proc/cpuinfo":
            raise FileNotFoundError(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", no_proc)
    assert envinfo.cpu_flags() == envinfo.numpy_flags() <= set(envinfo.CPU_FLAGS)
    env = envinfo.environment()["cpu_flags"]
    assert {k for k, v in env.items() if v} == envinfo.numpy_flags()
