"""The bench table fits the terminal: golden outputs at 80 and 200 columns, numbers never cut,
and the runtimes that are not installed named once, not once per cell.

Regenerate the golden files after an intended change of the table with
`UPDATE_GOLDEN=1 python -m pytest tests/test_bench_render.py`, and read the diff.
"""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from rich.cells import cell_len

from compresskit.cli import render
from compresskit.compressor.measure import envinfo

GOLDEN = Path(__file__).parent / "golden"
HEADERS = (
    "model", "prec", "runtime", "batch", "thr", "p50 ms", "95% CI", "p99 ms", "items/s",
    "speed-up", "cold ms", "bytes", "G(FL)OP/s", "% peak", "acc", "agree",
)  # fmt: skip
BASELINE = "student.fp32.onnx → ort-static-default"  # a long label, as --baselines makes


def _row(model, precision, provider, batch, p50, size, acc, agree, speedup, gflops, peak, fmt):
    """One result row with the keys `compressor.measure.latency.measure` gives it."""
    return {
        "model": model,
        "path": f"/runs/{model}",
        "source": None,
        "format": fmt,
        "precision": precision,
        "provider": provider,
        "batch": batch,
        "threads": 1,
        "threads_requested": 1,
        "p50_ms": p50,
        "p90_ms": p50 * 1.1,
        "p99_ms": p50 * 1.4,
        "p50_ci_ms": [p50 * 0.98, p50 * 1.03],
        "mean_ms": p50 * 1.02,
        "std_ms": p50 * 0.05,
        "runs": 50,
        "seconds": 1.0,
        "throughput_per_s": batch / (p50 / 1000),
        "cold_start_ms": 12.3 + 2 * p50,
        "bytes": size,
        "parameters": 266_610,
        "test_accuracy": acc,
        "top1_agreement": agree,
        "macs": 1_000_000 * batch,
        "speedup_vs_first": speedup,
        "gflops": gflops,
        "peak_fraction": peak,
        "notes": [],
    }


def _bench() -> dict:
    """A `compress bench` result as the CLI builds it: default providers on a CPU-only
    machine, teacher and student files, batches 1 and 64, one thread."""
    rows = []
    for batch, scale in ((1, 1.0), (64, 41.0)):
        rows += [
            _row("teacher.pt", "fp32", "pytorch-cpu", batch, 0.412 * scale, 1_070_123,
                 0.9811, 1.0, 1.0, 4.9, 0.05, "pytorch"),
            _row("student.pt", "bf16", "pytorch-cpu", batch, 0.231 * scale, 254_123,
                 0.9755, 0.9902, 0.412 / 0.231, 2.5, 0.03, "pytorch"),
            _row("student.fp32.onnx", "fp32", "CPUExecutionProvider", batch, 0.0523 * scale,
                 251_234, 0.9755, 0.9902, 0.412 / 0.0523, 38.2, 0.41, "onnx"),
            _row("student.int8.onnx", "int8", "CPUExecutionProvider", batch, 0.0141 * scale,
                 68_123, 0.9733, 0.9880, 0.412 / 0.0141, 141.8, 0.62, "onnx"),
            _row(BASELINE, "int8", "CPUExecutionProvider", batch, 0.0179 * scale, 69_871,
                 0.9711, 0.9861, 0.412 / 0.0179, 111.7, 0.49, "onnx"),
        ]  # fmt: skip
    rows[-1]["notes"].append("INT8 1.27x slower than its FP32 file: time in INT8 QLinearConv 71%")
    skipped = []
    for model in ("teacher.pt", "student.pt"):
        skipped.append(_skip(model, "pytorch-cuda", "no CUDA device visible to PyTorch"))
    for model in ("student.fp32.onnx", "student.int8.onnx", BASELINE):
        for p in ("CUDAExecutionProvider", "TensorrtExecutionProvider"):
            why = f"onnxruntime 1.32.0 has no {p} (install onnxruntime-gpu)"
            skipped.append(_skip(model, p, why))
    return {
        "environment": {
            "cpu_model": "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz",
            "logical_cores": 2,
            "versions": {"torch": "2.13.0+cpu", "onnxruntime": "1.32.0"},
            "date": "2026-11-24T14:43:28+00:00",
        },
        "peaks": {"1": {"fp32_gflops": 93.4, "int8_gops": 228.7}},
        "agreement_reference": "teacher.pt [fp32, pytorch-cpu]",
        "speedup_reference": "teacher.pt [fp32, pytorch-cpu]",
        "runtimes": {
            "requested": ["torch", "cpu", "cuda", "tensorrt"],
            "default": True,
            "absent": {
                "pytorch-cuda": "a CPU-only torch build",
                "CUDAExecutionProvider": "pip install onnxruntime-gpu",
                "TensorrtExecutionProvider": "pip install onnxruntime-gpu",
            },
        },
        "results": rows,
        "skipped": skipped,
        "profiles": {"student.int8.onnx": {"top": ["QLinearConv 71%", "QLinearMatMul 12%"]}},
    }


def _skip(model: str, provider: str, reason: str) -> dict:
    return {
        "variant": f"{model} [fp32, {provider}]",
        "model": model,
        "provider": provider,
        "precision": "fp32",
        "reason": reason,
    }


@click.command()
@click.option("--wide", is_flag=True)
@click.option("--explicit", is_flag=True)
def show(wide: bool, explicit: bool) -> None:
    bench = _bench()
    bench["runtimes"]["default"] = not explicit
    render.bench_table(bench, wide=wide)


def _render(width: int, *args: str) -> str:
    """The table as `compress bench` prints it on a terminal of `width` columns ($COLUMNS)."""
    result = CliRunner().invoke(show, list(args), env={"COLUMNS": str(width)})
    assert result.exit_code == 0, result.output
    return result.stdout


def _plain(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"


@pytest.mark.parametrize("width", [80, 200])
def test_golden(width):
    got = _plain(_render(width))
    path = GOLDEN / f"bench_{width}.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(got)
    assert got == path.read_text(), f"bench table at {width} columns changed; see {path}"


def _numbers(bench: dict) -> list[str]:
    """Numbers every table shows whole: p50 and batch of each row."""
    return [f"{r['p50_ms']:.3f}" for r in bench["results"]]


@pytest.mark.parametrize("width", [60, 80, 100, 120, 160, 200])
def test_every_line_fits_and_no_number_is_cut(width):
    out = _render(width)
    lines = out.splitlines()
    assert all(cell_len(line) <= width for line in lines), max(lines, key=cell_len)
    assert "…" not in out
    for number in _numbers(_bench()):
        assert re.search(rf"(?<![\d.,]){re.escape(number)}(?![\d.,])", out), number
    for name in ("teacher.pt", "student.pt", "student.fp32.onnx", "student.int8.onnx"):
        assert name in out  # short names are never folded
    assert "p50 ms" in out and "runtime" in out and "batch" in out


def test_more_columns_as_the_width_allows():
    columns = render._bench_columns(_bench()["results"])
    shown = []
    for width in (60, 80, 100, 120, 160, 200):
        chosen, widths = render._fit(columns, width, wide=False)
        assert sum(widths) + render.GAP * (len(widths) - 1) <= width
        shown.append([c.header for c in chosen])
    assert shown[0] == ["model", "prec", "runtime", "batch", "p50 ms"]  # the key columns
    # at 80: file size, accuracy and speed-up too, by rank
    assert set(shown[1]) - set(shown[0]) == {"bytes", "acc", "speed-up"}
    assert all(set(a) <= set(b) for a, b in itertools.pairwise(shown)) and shown[2] != shown[1]
    assert shown[-1] == list(HEADERS)  # in display order, whatever their rank
    everything, _ = render._fit(columns, 80, wide=True)
    assert [c.header for c in everything] == list(HEADERS)


def test_hidden_columns_are_named_in_one_statement():
    out = _render(80)
    assert out.count("not shown at 80 columns (--wide shows all):") == 1
    assert "thr (1 in every row)" in out


def test_wide_shows_all_sixteen_columns_whole():
    out = _render(80, "--wide")
    for header in HEADERS:
        assert header in out, header
    assert "…" not in out and "not shown at" not in out
    for number in _numbers(_bench()):
        assert number in out


def test_a_long_model_name_folds_and_stays_readable():
    def table(width):
        lines = _render(width).splitlines()
        return lines[lines.index(next(x for x in lines if x.startswith("───"))) :][:13]

    narrow = table(80)
    assert not any(BASELINE in line for line in narrow)  # folded at 80 columns...
    i = next(i for i, line in enumerate(narrow) if line.startswith("student.fp32.onnx →"))
    assert narrow[i + 1].strip() == "ort-static-default"  # ...at its space, onto the next line
    assert any(line.startswith(BASELINE) for line in table(200))


def test_absent_runtimes_are_one_line_by_default_and_one_per_runtime_when_asked():
    default = _render(200)
    assert default.count("not installed:") == 1 and "skipped" not in default
    line = next(line for line in default.splitlines() if line.startswith("not installed:"))
    assert "ORT-CUDA, TensorRT (pip install onnxruntime-gpu)" in line and "torch-cuda" in line
    explicit = _render(200, "--explicit")
    skipped = [line for line in explicit.splitlines() if line.startswith("skipped")]
    assert len(skipped) == 3 and "not installed" not in explicit
    assert skipped[0].startswith("skipped on torch-cuda (teacher.pt, student.pt): no CUDA")
    assert skipped[1].startswith(
        f"skipped on ORT-CUDA (student.fp32.onnx, student.int8.onnx, {BASELINE}): "
    )


def test_the_environment_line_folds_between_its_parts():
    lines = _render(80).splitlines()
    assert lines[0] == "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz, 2 logical cores;"
    assert lines[1] == "torch 2.13.0+cpu, onnxruntime 1.32.0; 2026-11-24T14:43:28+00:00"


def test_console_width_off_a_terminal(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert render.out_console().width == render.WIDTH_OFF_TERMINAL  # pytest captures stdout
    monkeypatch.setenv("COLUMNS", "93")
    assert render.out_console().width == 93
    assert render.out_console(70).width == 70


# --- the real command on a tiny model --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    import torch

    from compresskit.compressor import export
    from compresskit.models import ModelSpec, checkpoint, tiny, zoo

    folder = tmp_path_factory.mktemp("bench_render")
    net = tiny("lenet5", in_shape=(1, 8, 8), num_classes=10, seed=0)
    spec = ModelSpec("lenet5", {**zoo._TINY["lenet5"], "in_shape": [1, 8, 8], "num_classes": 10})
    checkpoint.save(folder / "student.pt", net, spec, {"data": "digits"})
    x = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    export.export_onnx(net, x, folder / "student.fp32.onnx", export.ExportConfig())
    return [folder / "student.pt", folder / "student.fp32.onnx"]


def _gpu_runtimes_present() -> bool:
    import onnxruntime as ort
    import torch

    gpu = {"CUDAExecutionProvider", "TensorrtExecutionProvider"}
    return torch.cuda.is_available() or bool(gpu & set(ort.get_available_providers()))


CPU_ONLY = pytest.mark.skipif(_gpu_runtimes_present(), reason="asserts a CPU-only machine")
QUICK = ["--batch", "1", "--min-runs", "3", "--min-seconds", "0.01", "-q"]


@CPU_ONLY
@pytest.mark.parametrize("bf16", [True, False])
def test_default_providers_run_what_is_installed_and_name_the_rest_once(
    run, tiny_models, monkeypatch, bf16
):
    # Whether the CPU has native bf16 decides the torch bf16 variant (skipped, with a reason,
    # where it would only emulate it): pinned both ways, so no CI CPU changes the output.
    monkeypatch.setattr(envinfo, "bf16_supported", lambda: bf16)
    monkeypatch.setenv("COLUMNS", "80")
    result = run("bench", *tiny_models, *QUICK)
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    skips = [line for line in out.splitlines() if line.startswith("skipped")]
    if bf16:
        assert not skips
    else:
        assert len(skips) == 1 and skips[0].startswith("skipped on torch-cpu (student.pt)")
        assert "bf16" in out
    assert out.count("not installed:") == 1
    assert "ORT-CUDA, TensorRT (pip install onnxruntime-gpu)" in out and "torch-cuda" in out
    assert all(cell_len(line) <= 80 for line in out.splitlines())
    assert "…" not in out and "student.fp32.onnx" in out and "torch-cpu" in out


@CPU_ONLY
def test_the_json_keeps_every_skip(run, tiny_models):
    r = run("bench", *tiny_models, *QUICK, "--json").json()
    assert r["runtimes"]["default"] is True
    assert r["runtimes"]["requested"] == ["torch", "cpu", "cuda", "tensorrt"]
    assert {"pytorch-cuda", "CUDAExecutionProvider", "TensorrtExecutionProvider"} <= set(
        r["runtimes"]["absent"]
    )
    skipped = {(s["model"], s["provider"]) for s in r["skipped"]}
    assert ("student.pt", "pytorch-cuda") in skipped
    for p in ("CUDAExecutionProvider", "TensorrtExecutionProvider"):
        assert ("student.fp32.onnx", p) in skipped
    assert {row["provider"] for row in r["results"]} == {"pytorch-cpu", "CPUExecutionProvider"}


@CPU_ONLY
def test_providers_asked_for_but_missing_are_one_line_each(run, tiny_models, monkeypatch):
    monkeypatch.setattr(envinfo, "bf16_supported", lambda: True)  # no CPU-dependent skip
    monkeypatch.setenv("COLUMNS", "80")
    args = ["--providers", "torch,cpu,cuda,tensorrt", "--wide"]
    result = run("bench", *tiny_models, *QUICK, *args)
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    skipped = [line for line in out.splitlines() if line.startswith("skipped on")]
    assert [s.split(" (")[0] for s in skipped] == [
        "skipped on torch-cuda",
        "skipped on ORT-CUDA",
        "skipped on TensorRT",
    ]
    assert "not installed" not in out
    for header in HEADERS:  # --wide
        assert header in out, header


def test_a_busy_machine_is_named_beside_the_timings_and_saved_with_them(capsys, tmp_path):
    """A CPU hog halved the measured 2-thread peak (188 -> 96 GFLOP/s) with no word said; then
    the word was said on the terminal only, not in the JSON or report.md that get shared."""
    from compresskit.compressor.measure import benchreport, grid

    bench = _bench()
    env = {**bench["environment"], "load_average_1min": 3.2, "usable_cores": 2}
    bench["environment"], bench["notes"] = env, grid.notes(env, bench["results"])
    render.bench_table(bench, width=200)
    assert "note: load average 3.2 on 2 usable cores: other work ran" in capsys.readouterr().err
    report = benchreport.markdown(bench)
    assert "## Caveats\n\n- load average 3.2 on 2 usable cores" in report
    assert "- load average (1 min) 3.2 on 2 usable cores" in report
    env["load_average_1min"] = 1.1  # bench's own thread: not a note
    assert not any("load average" in n for n in grid.notes(env, bench["results"]))


def test_sub_tenth_ms_onnx_rows_beside_pytorch_are_flagged():
    """An FP32 ONNX file read 0.026 ms beside a checkpoint and 0.009 ms beside its INT8 twin
    alone: the INT8-vs-FP32 ratio flipped with no hint."""
    from compresskit.compressor.measure import grid

    rows = [
        {"model": "t.pt", "provider": "pytorch-cpu", "p50_ms": 0.05},
        {"model": "m.fp32.onnx", "provider": "CPUExecutionProvider", "p50_ms": 0.026},
    ]
    (note,) = grid.notes({}, rows)
    assert note.startswith("ONNX rows under 0.1 ms were timed interleaved with PyTorch (t.pt)")
    assert grid.notes({}, rows[1:]) == []  # ONNX files alone
    assert grid.notes({}, [rows[0], {**rows[1], "p50_ms": 0.5}]) == []  # large enough
