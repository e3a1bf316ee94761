"""`compress bench`: the measuring loop, every input kind, the JSON contract, skips, bad input."""

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from compresskit.compressor import export
from compresskit.compressor.export import mobile
from compresskit.compressor.measure import latency, variants
from compresskit.models import InputError, ModelSpec, checkpoint, tiny

RESULT_KEYS = {
    "model",
    "format",
    "precision",
    "provider",
    "batch",
    "threads",
    "p50_ms",
    "p90_ms",
    "p99_ms",
    "p50_ci_ms",
    "throughput_per_s",
    "bytes",
    "parameters",
    "test_accuracy",
    "top1_agreement",
    "runs",
    "seconds",
    "cold_start_ms",
    "macs",
    "gflops",  # every row, None where unknown (an .ort row had neither key)
    "peak_fraction",
    "speedup_vs_first",
    "other_cores",
}
FAST = ["--min-runs", "5", "--min-seconds", "0", "--providers", "torch,cpu,cuda,tensorrt"]


def test_runs_are_interleaved_after_warmup():
    calls = []

    def runner(name):
        def run():
            calls.append(name)
            return 0.001

        return run

    times = latency.interleaved_timed(
        [runner("A"), runner("B"), runner("C")], min_seconds=0, min_runs=3, warmup=2
    )
    assert calls == ["A", "A", "B", "B", "C", "C"] + ["A", "B", "C"] * 3
    assert [len(t) for t in times] == [3, 3, 3] and all(np.all(t == 0.001) for t in times)


@pytest.fixture(scope="module")
def shrunk(tmp_path_factory):
    """A folder shaped like compress shrink's output: model.pt, FP32/INT8 ONNX, .ort."""
    folder = tmp_path_factory.mktemp("bench") / "student"
    folder.mkdir()
    net = tiny("lenet5", in_shape=(1, 8, 8), num_classes=10, seed=0)
    from compresskit.models import zoo

    spec = ModelSpec("lenet5", {**zoo._TINY["lenet5"], "in_shape": [1, 8, 8], "num_classes": 10})
    checkpoint.save(folder / "model.pt", net, spec, {"data": "digits"})
    x = torch.rand(64, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    fp32 = export.export_onnx(net, x[:2], folder / "model.fp32.onnx", export.ExportConfig())
    prepared = export.preprocess(fp32, folder.parent / "prepared.onnx")
    int8 = export.quantize_int8(
        prepared, folder / "model.int8.onnx", x.numpy(), export.QuantConfig()
    )
    mobile.to_ort(int8, folder / "model.int8.ort")
    return folder


def test_bench_a_shrink_folder_json_report_and_plot(run, shrunk, tmp_path):
    plot, report = tmp_path / "b.png", tmp_path / "b.md"
    result = run(
        "bench",
        shrunk,
        "--data",
        "digits",
        "--batch",
        "1,3",
        *FAST,
        "--json",
        "--plot",
        plot,
        "--report",
        report,
        "-q",
    )
    assert result.exit_code == 0, result.stderr
    r = result.json()
    assert {"cpu_model", "cpu_flags", "versions", "ort_providers", "date"} <= r[
        "environment"
    ].keys()
    rows = r["results"]
    for row in rows:
        assert row.keys() >= RESULT_KEYS, RESULT_KEYS - row.keys()
        lo, hi = row["p50_ci_ms"]
        assert lo <= row["p50_ms"] <= hi and row["p50_ms"] <= row["p90_ms"] <= row["p99_ms"]
        assert row["throughput_per_s"] == pytest.approx(row["batch"] / (row["p50_ms"] / 1000))
        assert row["runs"] >= 5 and row["file_bytes"] == Path(row["path"]).stat().st_size
        if row["format"] == "pytorch":  # the weights, not the optimizer state in the file
            assert row["bytes"] == 4 * row["parameters"] < row["file_bytes"]
        else:
            assert row["bytes"] == row["file_bytes"]
    kinds = {(row["model"], row["provider"]) for row in rows}
    for name in ("model.fp32.onnx", "model.int8.onnx", "model.int8.ort"):
        assert (name, "CPUExecutionProvider") in kinds
    assert ("model.pt", "pytorch-cpu") in kinds
    assert {row["batch"] for row in rows} == {1, 3}
    # accuracy is measured per variant; agreement against the first model (model.pt)
    first = [row for row in rows if row["model"] == "model.pt" and row["precision"] == "fp32"]
    assert first[0]["top1_agreement"] == 1.0
    fp32 = next(row for row in rows if row["model"] == "model.fp32.onnx")
    assert fp32["top1_agreement"] == 1.0  # the same model, exported
    assert fp32["macs"] == next(row for row in rows if row["model"] == "model.pt")["macs"]
    # no GPU here: the GPU runtimes are listed as skipped with a reason, not errors
    skipped = {(s["model"], s["provider"]) for s in r["skipped"]}
    if not torch.cuda.is_available():
        assert ("model.pt", "pytorch-cuda") in skipped
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 5000
    md = report.read_text()
    assert "## Environment" in md and "model.int8.onnx" in md and "p50" in md


def test_bench_table_without_json(run, shrunk):
    result = run("bench", shrunk / "model.fp32.onnx", "--batch", "1", *FAST)
    assert result.exit_code == 0, result.stderr
    assert "model.fp32.onnx" in result.stdout and "p50 ms" in result.stdout


@pytest.mark.skipif(
    "CUDAExecutionProvider" in ort.get_available_providers(),
    reason="fakes a CUDA provider that fails to load; this machine has a real one",
)
def test_a_provider_that_falls_back_to_cpu_is_reported_as_skipped(run, shrunk, monkeypatch):
    """ORT silently runs on CPU when CUDA fails to load: that must be a skip, not a CUDA row."""
    import onnxruntime as ort

    real = ort.get_available_providers()
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", *real])
    result = run(
        "bench",
        shrunk / "model.fp32.onnx",
        "--batch",
        "1",
        "--min-runs",
        "3",
        "--min-seconds",
        "0",
        "--providers",
        "cpu,cuda",
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    r = result.json()
    assert {row["provider"] for row in r["results"]} == {"CPUExecutionProvider"}
    reasons = [s["reason"] for s in r["skipped"] if s["provider"] == "CUDAExecutionProvider"]
    # ORT either falls back silently (caught by get_providers) or, with CPU fallback disabled
    # as we ask, refuses to place nodes on the CPU: a skip naming the CPU either way
    assert reasons and ("fell back to CPUExecutionProvider" in reasons[0] or "CPU EP" in reasons[0])


def test_an_ort_file_is_never_offered_to_a_gpu_provider(run, shrunk, monkeypatch):
    """ORT 1.31.1 crashed the process (SIGSEGV) building a CUDA session from an INT8 .ort on an
    H100: .ort files are ORT Mobile's, so a GPU row of one is a skip, decided before any
    session is made."""
    real = ort.get_available_providers()
    fake = ["TensorrtExecutionProvider", "CUDAExecutionProvider", *real]
    monkeypatch.setattr(ort, "get_available_providers", lambda: fake)
    models = [variants.load(shrunk / "model.int8.ort")]
    out, skipped = variants.variants(models, ["cuda", "tensorrt"])
    assert out == []  # no variant, so no session is ever built
    assert {s["provider"] for s in skipped} == {
        "CUDAExecutionProvider",
        "TensorrtExecutionProvider",
    }
    assert all("ORT Mobile" in s["reason"] for s in skipped)


def test_a_gpu_provider_failing_at_run_time_is_a_skip(shrunk, monkeypatch):
    """With ORT's own retry on the CPU EP off, a CUDA session that builds but fails on its
    first run raises: that row is a skip naming the error, not a crash of the whole bench."""

    class Failing:
        def get_providers(self):
            return ["CUDAExecutionProvider"]

        def get_inputs(self):
            return [type("I", (), {"name": "x"})()]

        def run(self, *a):
            raise RuntimeError("CUDA failure 700: an illegal memory access\nmore")

    monkeypatch.setattr(latency, "_session", lambda *a: Failing())
    v = variants.Variant(variants.load(shrunk / "model.fp32.onnx"), "cuda", "fp32")
    with pytest.raises(latency.Skip, match="CUDAExecutionProvider failed running it: CUDA fail"):
        latency._prepare_ort(v, 1, np.zeros((1, 1, 8, 8), np.float32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")
def test_gpu_variants_run_on_the_gpu(run, shrunk):
    result = run("bench", shrunk / "model.pt", "--batch", "1", *FAST, "--json")
    rows = result.json()["results"]
    assert any(row["provider"] == "pytorch-cuda" for row in rows)


def test_baselines_add_ort_quantizers(run, shrunk):
    result = run(
        "bench",
        shrunk / "model.fp32.onnx",
        "--baselines",
        "--data",
        "digits",
        "--batch",
        "1",
        *FAST,
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    rows = result.json()["results"]
    names = [row["model"] for row in rows]
    assert any("ort-dynamic" in n for n in names) and any("ort-static-default" in n for n in names)
    for row in rows:  # a baseline's path names a folder gone by now: said so
        gone = not Path(row["path"]).exists()
        assert gone == any("removed after the run" in n for n in row["notes"]), row


def test_profile_names_operators(run, shrunk):
    result = run("bench", shrunk / "model.int8.onnx", "--batch", "1", *FAST, "--profile", "--json")
    assert result.exit_code == 0, result.stderr
    prof = result.json()["profiles"]["model.int8.onnx"]
    assert prof["top"] and abs(sum(op["share"] for op in prof["ops"]) - 1) < 1e-6
    from compresskit.compressor.measure import benchreport

    md = benchreport.markdown(result.json())  # the report carries the profile too
    assert f"- model.int8.onnx: {', '.join(prof['top'])}" in md


def _bare_state_dict(tmp_path):
    torch.save(tiny("mlp").state_dict(), tmp_path / "bare.pt")
    return tmp_path / "bare.pt"


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("unknown file type", "unknown file type .txt"),
        (
            "onnx shape vs data",
            "takes inputs of shape (1, 8, 8), --data digits:28 gives (1, 28, 28)",
        ),
        ("batch 0", "--batch 0: give sizes >= 1"),
        ("batch not a number", "give whole numbers separated by commas"),
        ("bare state_dict", "a bare state_dict does not name its model; pass --model NAME"),
        ("unknown provider", "unknown provider 'tpu'"),
        ("missing file", "no such file or folder"),
        ("folder without models", "a folder without compress shrink outputs"),
        ("plot in a missing folder", "does not exist"),
        ("seconds inf", "give runs from 1 to 10,000,000 and seconds from 0 to 3600"),
        ("plot as jpg", "give a .png, .svg or .pdf file name"),
        ("report is the plot", "--report and --plot both name"),
        # an empty table and report, exit 0, before
        ("no runtime runs it", "nothing to measure on --providers torch: model.fp32.onnx: onnx"),
    ],
)
def test_bench_bad_input(run, shrunk, tmp_path, case, message):
    args = [shrunk / "model.fp32.onnx"]
    extra = ["--batch", "1", "--min-runs", "3", "--min-seconds", "0"]
    if case == "unknown file type":
        (tmp_path / "m.txt").write_text("x")
        args = [tmp_path / "m.txt"]
    elif case == "onnx shape vs data":
        extra += ["--data", "digits:28"]
    elif case == "batch 0":
        extra = ["--batch", "0"]
    elif case == "batch not a number":
        extra = ["--batch", "one"]
    elif case == "bare state_dict":
        args = [_bare_state_dict(tmp_path)]
    elif case == "unknown provider":
        extra += ["--providers", "cpu,tpu"]
    elif case == "missing file":
        args = [tmp_path / "nope.onnx"]
    elif case == "folder without models":
        (tmp_path / "empty").mkdir()
        args = [tmp_path / "empty"]
    elif case == "plot in a missing folder":
        extra += ["--plot", tmp_path / "no" / "b.png"]
    elif case == "seconds inf":
        extra = ["--batch", "1", "--min-seconds", "inf"]
    elif case == "plot as jpg":
        extra += ["--plot", tmp_path / "b.jpg"]
    elif case == "report is the plot":
        extra += ["--plot", tmp_path / "b.png", "--report", tmp_path / "b.png"]
    elif case == "no runtime runs it":
        extra += ["--providers", "torch", "--report", tmp_path / "r.md"]
    result = run("bench", *args, *extra, "--json")
    assert not (tmp_path / "r.md").exists()
    assert result.exit_code == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert json.loads(result.stdout)["exit_code"] == 2


def test_a_json_report_is_the_json_object(run, shrunk, tmp_path):
    """--report r.json wrote Markdown into it: the suffix now picks JSON, as --plot's does."""
    report = tmp_path / "r.json"
    args = [shrunk / "model.int8.onnx", "--batch", "1", *FAST, "--providers", "cpu", "-q"]
    result = run("bench", *args, "--json", "--report", report)
    assert result.exit_code == 0, result.stderr
    written = json.loads(report.read_text())
    assert written == result.json() and len(written["results"]) == 1  # one run, one object
    assert written["results"][0]["model"] == "model.int8.onnx"


def test_variant_parsing():
    assert variants.parse_providers("CPU, cuda,CPUExecutionProvider") == ["cpu", "cuda"]
    with pytest.raises(Exception, match="unknown provider"):
        variants.parse_providers("npu")


def test_fixed_batch_onnx_runs_at_its_batch_and_refuses_others(run, tmp_path):
    net = tiny("mlp")
    cfg = export.ExportConfig(dynamic_batch=False)
    path = export.export_onnx(net, torch.rand(1, 1, 8, 8), tmp_path / "b1.onnx", cfg)
    ok = run("bench", path, "--batch", "1", "--data", "digits", *FAST, "--json")
    assert ok.exit_code == 0, ok.stderr
    assert ok.json()["results"][0]["test_accuracy"] is not None  # predicted one image at a time
    bad = run("bench", path, "--batch", "1,64", *FAST)
    assert bad.exit_code == 2 and "fixed batch of 1; pass --batch 1" in bad.stderr
    # ORT's own quantizers calibrate it at its batch (batches of 32 failed: exit 1)
    base = run("bench", path, "--batch", "1", "--data", "digits", "--baselines", *FAST, "--json")
    assert base.exit_code == 0, base.stderr
    rows = base.json()["results"]
    assert len(rows) == 3 and all(r["test_accuracy"] is not None for r in rows)


def test_a_shrink_folders_fixed_batch_file_is_timed_at_its_batch(run, tmp_path):
    # `bench FOLDER` left out MODEL.int8.fixed.onnx (the file NNAPI takes) without a word.
    from compresskit.compressor.export import mobile

    folder = tmp_path / "shrunk"
    folder.mkdir()
    fp32 = export.export_onnx(
        tiny("mlp"), torch.rand(2, 1, 8, 8), folder / "model.fp32.onnx", export.ExportConfig()
    )
    mobile.fixed_batch(fp32, folder / "model.int8.fixed.onnx", 1)
    result = run("bench", folder, "--batch", "1,4", *FAST, "--json")
    assert result.exit_code == 0, result.stderr
    got = result.json()
    rows = {(r["model"], r["batch"]) for r in got["results"]}
    assert rows == {("model.fp32.onnx", 1), ("model.fp32.onnx", 4), ("model.int8.fixed.onnx", 1)}
    (skip,) = [s for s in got["skipped"] if "fixed batch" in s["reason"]]
    assert skip["model"] == "model.int8.fixed.onnx"
    assert skip["reason"].endswith("fixed batch of 1: not timed at batch 4")
    # two thread counts: the skip is listed once, not once per count
    result = run("bench", folder, "--batch", "1,4", "--threads", "1,2", *FAST, "--json")
    assert result.exit_code == 0, result.stderr
    assert [s["reason"] for s in result.json()["skipped"] if "fixed batch" in s["reason"]] == [
        skip["reason"]
    ]


def test_an_onnx_without_a_float_or_int64_input_is_refused(run, tmp_path):
    from onnx import TensorProto, helper, save

    g = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.INT32, [1, 3])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [1, 3])],
    )
    save(
        helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9),
        str(tmp_path / "ints.onnx"),
    )
    result = run("bench", tmp_path / "ints.onnx", *FAST)
    assert result.exit_code == 2 and "feeds one input tensor: float32 images" in result.stderr


def test_two_folders_with_equal_file_names_get_distinct_labels(run, shrunk, tmp_path):
    import shutil

    other = tmp_path / "b" / "student"
    shutil.copytree(shrunk, other)
    result = run(
        "bench",
        shrunk / "model.fp32.onnx",
        other / "model.fp32.onnx",
        "--data",
        "digits",
        "--batch",
        "1",
        *FAST,
        "--json",
    )
    rows = result.json()["results"]
    assert len({r["model"] for r in rows}) == 2
    assert all(r["top1_agreement"] == 1.0 for r in rows)  # the same weights in both


def test_threads_zero_means_all_cores_everywhere(run, shrunk):
    result = run(
        "bench",
        shrunk / "model.int8.onnx",
        "--threads",
        "0",
        "--batch",
        "1",
        *FAST,
        "--profile",
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    row = result.json()["results"][0]
    assert row["threads_requested"] == 0 and row["threads"] >= 1


def test_int8_slower_than_its_fp32_file_is_explained(monkeypatch, shrunk):
    """`_explain` pairs an INT8 row with the FP32 file it came from and names the operators."""
    rows = [
        {
            "path": str(shrunk / "model.fp32.onnx"),
            "source": None,
            "precision": "fp32",
            "provider": "CPUExecutionProvider",
            "format": "onnx",
            "batch": 1,
            "threads": 1,
            "p50_ms": 0.10,
            "notes": [],
        },
        {
            "path": str(shrunk / "model.int8.onnx"),
            "source": str(shrunk / "model.fp32.onnx"),
            "precision": "int8",
            "provider": "CPUExecutionProvider",
            "format": "onnx",
            "batch": 1,
            "threads": 1,
            "p50_ms": 0.30,
            "notes": [],
        },
    ]
    latency._explain(rows, None)
    note = rows[1]["notes"][0]
    assert note.startswith("INT8 3.00x slower than its FP32 file: time in INT8 ")
    assert "%" in note and rows[1]["vs_fp32"] == pytest.approx(1 / 3)
    rows[1]["p50_ms"], rows[1]["notes"] = 0.05, []
    latency._explain(rows, None)
    assert rows[1]["notes"] == []  # faster INT8: nothing to explain


def test_plot_with_no_results_is_still_written(tmp_path):
    from compresskit.compressor.measure import benchreport

    path = benchreport.plot({"results": []}, tmp_path / "empty.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_cell_times_all_its_variants_in_one_interleaved_loop(run, shrunk, monkeypatch):
    calls = []
    real = latency.interleaved_timed

    def spy(runners, *args, **kwargs):
        calls.append(len(runners))
        return real(runners, *args, **kwargs)

    monkeypatch.setattr(latency, "interleaved_timed", spy)
    result = run("bench", shrunk, "--batch", "1,2", "--providers", "torch,cpu", *FAST[:4])
    assert result.exit_code == 0, result.stderr
    n = 3 + (2 if benchmark_bf16() else 1)  # three ONNX/ORT files, model.pt fp32 (+ bf16)
    assert calls == [n, n]  # one loop per cell (batch 1, batch 2), every variant in it


def benchmark_bf16():
    from compresskit.compressor.measure import envinfo

    return envinfo.bf16_supported()


def _linear_onnx(path, weight, bias, outputs):
    """A Flatten + Gemm classifier as a hand-made ONNX file; `outputs` lists (name, kind):
    "logits" (N, 10), "aux" (N, 3), "column" (N, 1), "4d" (N, 10, 1, 1)."""
    from onnx import TensorProto, helper, numpy_helper, save

    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(weight.astype(np.float32), "w"),
        numpy_helper.from_array(bias.astype(np.float32), "b"),
        numpy_helper.from_array(rng.normal(size=(3, 64)).astype(np.float32), "w3"),
        numpy_helper.from_array(rng.normal(size=(1, 64)).astype(np.float32), "w1"),
        numpy_helper.from_array(np.array([-1, 10, 1, 1], np.int64), "shape4"),
    ]
    nodes = [
        helper.make_node("Flatten", ["x"], ["f"]),
        helper.make_node("Gemm", ["f", "w", "b"], ["z"], transB=1),
    ]
    outs = []
    for name, kind in outputs:
        if kind == "logits":
            nodes.append(helper.make_node("Identity", ["z"], [name]))
            outs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["N", 10]))
        elif kind == "4d":
            nodes.append(helper.make_node("Reshape", ["z", "shape4"], [name]))
            outs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["N", 10, 1, 1]))
        else:
            w, k = ("w3", 3) if kind == "aux" else ("w1", 1)
            nodes.append(helper.make_node("Gemm", ["f", w], [name], transB=1))
            outs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["N", k]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 8, 8])
    g = helper.make_graph(nodes, "g", [x], outs, inits)
    save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9), path)
    return path


def test_accuracy_is_scored_on_the_logits_output_and_non_classifiers_are_refused(run, tmp_path):
    # The first output was scored whatever it was: an auxiliary output gave 9.7% for a model
    # whose logits score 95.8%, and an (N, 10, 1, 1) output compared N x N pairs.
    from compresskit.models.data import load

    torch.manual_seed(0)
    data = load("digits")
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    opt = torch.optim.Adam(net.parameters(), 1e-2)
    for _ in range(100):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(data.x_train), data.y_train).backward()
        opt.step()
    with torch.no_grad():
        want = (net(data.x_test).argmax(1) == data.y_test).double().mean().item()
    assert want > 0.85
    w, b = net[1].weight.detach().numpy(), net[1].bias.detach().numpy()
    files = {
        "two": _linear_onnx(tmp_path / "two.onnx", w, b, [("aux", "aux"), ("logits", "logits")]),
        "4d": _linear_onnx(tmp_path / "4d.onnx", w, b, [("out", "4d")]),
    }
    result = run("bench", *files.values(), "--data", "digits", "--batch", "1", *FAST, "--json")
    assert result.exit_code == 0, result.stderr
    accs = [r["test_accuracy"] for r in result.json()["results"]]
    assert accs == [pytest.approx(want, abs=1e-9)] * 2
    bad = {
        "column": ([("y", "column")], "its output has shape ('batch', 1), not (batch, classes)"),
        "unnamed": (
            [("aux", "aux"), ("z2", "logits")],
            "2 outputs (aux, z2) and none named 'logits'",
        ),
    }
    for name, (outputs, message) in bad.items():
        path = _linear_onnx(tmp_path / f"{name}.onnx", w, b, outputs)
        result = run("bench", path, "--data", "digits", "--batch", "1", *FAST)
        assert result.exit_code == 2 and message in result.stderr, result.stderr
        assert "bench without --data to time it alone" in result.stderr
        if name == "unnamed":  # the fix an ONNX file can take, not a checkpoint's
            assert "export with output_names naming it" in result.stderr


def test_an_onnx_files_bytes_include_its_external_data(tmp_path):
    import onnx

    rng = np.random.default_rng(0)
    w, b = rng.normal(size=(10, 64)), rng.normal(size=10)
    inline = _linear_onnx(tmp_path / "inline.onnx", w, b, [("logits", "logits")])
    (tmp_path / "ext").mkdir()
    proto = onnx.load(str(inline))
    onnx.save(
        proto,
        str(tmp_path / "ext" / "model.onnx"),
        save_as_external_data=True,
        location="model.onnx.data",
        size_threshold=0,
    )
    files = list((tmp_path / "ext").iterdir())
    assert len(files) == 2
    m = variants.load(tmp_path / "ext" / "model.onnx")
    assert m.bytes == sum(f.stat().st_size for f in files)  # was the 700-byte graph alone
    assert m.bytes > 0.9 * inline.stat().st_size


def test_the_precision_is_read_from_the_graph():
    # Every quantized file was "int8" and every other one "fp32": a 16-bit QDQ file was timed
    # against the INT8 peak, and float16 or MatMulNBits files against nothing they compute in.
    from onnx import TensorProto, helper

    def proto(nodes, inits):
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
        return helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits))

    def zero(dtype):
        return helper.make_tensor("zp", dtype, [], [0])

    scale = helper.make_tensor("s", TensorProto.FLOAT, [], [0.1])
    q = helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"])
    dq = helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"])
    weights = {
        dtype: helper.make_tensor("w", dtype, [4, 4], [0.0] * 16)
        for dtype in (TensorProto.FLOAT, TensorProto.FLOAT16)
    }
    mm = helper.make_node("MatMul", ["x", "w"], ["y"])
    nbits = helper.make_node("MatMulNBits", ["x", "w"], ["y"], domain="com.microsoft", bits=4)
    cases = {
        "int8": proto([q, dq], [scale, zero(TensorProto.INT8)]),
        "int16": proto([q, dq], [scale, zero(TensorProto.UINT16)]),
        "int4": proto([nbits], [weights[TensorProto.FLOAT]]),
        # the weights' zero points name it: 4-bit weights with 8-bit activations are int4
        "int4 weights": proto(
            [helper.make_node("DequantizeLinear", ["w4", "s", "zp4"], ["wd"]), q, dq],
            [
                scale,
                zero(TensorProto.INT8),
                helper.make_tensor("zp4", TensorProto.INT4, [], [0]),
                helper.make_tensor("w4", TensorProto.INT4, [2], [1, 2]),
            ],
        ),
        "fp16": proto([mm], [weights[TensorProto.FLOAT16]]),
        "fp32": proto([mm], [weights[TensorProto.FLOAT]]),
    }
    want = {k: k.split()[0] for k in cases}
    assert {k: variants.onnx_precision(p) for k, p in cases.items()} == want


def test_a_file_that_fails_on_the_datas_inputs_is_one_line_exit_2(run, tmp_path):
    # Symbolic input dims pass the shape checks; the Reshape fails inside ONNX Runtime, which
    # was an "unexpected" exit 1 with ORT's own error line on stderr.
    from onnx import TensorProto, helper, numpy_helper, save

    shape = numpy_helper.from_array(np.array([-1, 64], np.int64), "shape")
    w = numpy_helper.from_array(np.zeros((64, 10), np.float32), "w")
    g = helper.make_graph(
        [
            helper.make_node("Reshape", ["x", "shape"], ["f"]),
            helper.make_node("MatMul", ["f", "w"], ["logits"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "C", "H", "W"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        [shape, w],
    )
    path = tmp_path / "sym.onnx"
    save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9), path)
    result = run("bench", path, "--data", "digits:28", "--batch", "1", "-q", *FAST)
    assert result.exit_code == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot run it on inputs of shape [1, 1, 28, 28]" in lines[0]
    assert "give --data the file was made for" in lines[0]


def test_a_file_given_twice_is_measured_once(run, shrunk, monkeypatch):
    monkeypatch.chdir(shrunk.parent)
    relative = Path(shrunk.name) / "model.fp32.onnx"
    result = run("bench", relative, shrunk / "model.fp32.onnx", "--batch", "1", *FAST, "--json")
    assert result.exit_code == 0, result.stderr
    assert [r["model"] for r in result.json()["results"]] == ["model.fp32.onnx"]


def test_timing_inputs_are_the_datas_test_inputs_when_given():
    # Random noise had timed LeNet-5's max-pooling 6x slower than digits do.
    from compresskit.models import load_data

    data = load_data("digits")
    x = latency.inputs(None, 5, data, np.random.default_rng(0))
    assert np.array_equal(x, data.x_test[:5].numpy())
    big = latency.inputs(None, len(data.x_test) + 3, data, np.random.default_rng(0))
    assert np.array_equal(big[-3:], data.x_test[:3].numpy()) and big.flags["C_CONTIGUOUS"]


def test_bench_settings_that_cannot_give_a_figure_are_one_line(monkeypatch):
    monkeypatch.setattr(latency, "usable_cores", lambda: 2)
    with pytest.raises(InputError, match="--threads 0,3: this machine gives compress 2 core"):
        latency.BenchConfig(threads=(0, 3))
    with pytest.raises(InputError, match="min_runs '5': give a number"):
        latency.BenchConfig(min_runs="5")
    assert latency.BenchConfig(batches=(1, 64, 1), threads=(1, 1)).batches == (1, 64)
    assert latency.BenchConfig(threads=(2, 0, 1)).threads == (2, 1)  # 0: both cores, as 2
    monkeypatch.setattr(latency, "available_memory", lambda: 2**30)

    class M:  # a variant's model, as _check_batch_memory reads it
        path = Path("m.onnx")

    class V:
        model = M()

    with pytest.raises(InputError, match="--batch 99999999: one batch of m.onnx's inputs takes"):
        latency._check_batch_memory(V(), (1, 8, 8), 99_999_999)
    latency._check_batch_memory(V(), (1, 8, 8), 64)  # 32 KiB: fine


def test_a_report_never_replaces_what_the_folder_holds(run, shrunk, tmp_path):
    """`--report s/model.int8.onnx` with folder `s` replaced the model it had just measured
    with Markdown, exit 0; an existing report was replaced without a word."""
    import shutil

    folder = tmp_path / "s"
    shutil.copytree(shrunk, folder)
    (folder / "report.json").write_text("{}")  # shrink's own report
    model = folder / "model.int8.onnx"
    before = model.read_bytes()
    fast = ("--batch", "1", "--min-runs", "3", "--min-seconds", "0", "-q")
    for out, message in [
        (model, "a report is a .md (Markdown) or .json file, not .onnx"),
        (folder / "report.json", "exists; pass --force (force=True) to replace it"),
    ]:
        result = run("bench", folder, "--report", out, *fast)
        assert result.exit_code == 2 and message in result.stderr, result.stderr
    assert model.read_bytes() == before
    old = tmp_path / "old.md"
    old.write_text("mine")
    assert run("bench", model, "--report", old, *fast).exit_code == 2
    assert old.read_text() == "mine"
    assert run("bench", model, "--report", old, "--force", *fast).exit_code == 0
    assert old.read_text().startswith("# compress bench")
    # nor a checkpoint of the other spellings bench reads (a .ckpt became Markdown)
    ckpt = tmp_path / "teacher.ckpt"
    ckpt.write_bytes(b"weights")
    result = run("bench", model, "--report", ckpt, "--force", *fast)
    assert result.exit_code == 2 and "not .ckpt" in result.stderr
    assert ckpt.read_bytes() == b"weights"


def test_a_model_flag_no_checkpoint_uses_is_refused(run, shrunk):
    """`--model lenet300` beside a lenet5 checkpoint was silently ignored."""
    args = ("bench", shrunk / "model.pt", "--batch", "1", "--min-runs", "3", "--min-seconds", "0")
    result = run(*args, "--model", "lenet300", "-q")
    assert result.exit_code == 2
    assert (
        "--model lenet300: no checkpoint here is a bare state_dict or that model" in result.stderr
    )
    assert run(*args, "--model", "lenet5", "-q").exit_code == 0  # its own: consent, as before


def test_a_renamed_int8_ort_file_is_read_as_int8(shrunk, tmp_path):
    """A mobile engineer's `mobile.ort` (the shipped model.int8.ort, renamed) read fp32."""
    import shutil

    shutil.copyfile(shrunk / "model.int8.ort", tmp_path / "mobile.ort")
    assert variants.load(tmp_path / "mobile.ort").precision == "int8"
    mobile.to_ort(shrunk / "model.fp32.onnx", tmp_path / "app.ort")
    assert variants.load(tmp_path / "app.ort").precision == "fp32"


def test_other_spellings_of_model_files_and_an_archive(shrunk, tmp_path):
    """`t.pth` and `UP.ONNX` were 'unknown file type'; a .dcz got no hint to decode it."""
    import shutil

    shutil.copyfile(shrunk / "model.pt", tmp_path / "t.pth")
    shutil.copyfile(shrunk / "model.int8.onnx", tmp_path / "UP.ONNX")
    got = variants.expand([tmp_path / "t.pth", tmp_path / "UP.ONNX"])
    assert [variants.load(p).format for p in got] == ["pytorch", "onnx"]
    (tmp_path / "m.dcz").write_bytes(b"\x89DCZ")
    with pytest.raises(
        InputError,
        match=r"a compress archive, .*compress decode .*m.dcz, which writes .*m.decoded.pt",
    ):
        variants.expand([tmp_path / "m.dcz"])


def test_baselines_that_add_nothing_or_calibrate_on_noise_say_so(run, shrunk):
    fast = ("--batch", "1", "--min-runs", "3", "--min-seconds", "0", "--json", "-q")
    none = run("bench", shrunk / "model.int8.onnx", "--baselines", *fast)
    assert none.exit_code == 0, none.stderr
    assert any("no FP32 ONNX file among the inputs" in n for n in none.json()["notes"])
    noise = run("bench", shrunk / "model.fp32.onnx", "--baselines", *fast)
    assert any("calibrated on random inputs" in n for n in noise.json()["notes"])


@pytest.mark.parametrize("fails", ["write_markdown", "plot"])
def test_a_report_and_a_plot_are_written_both_or_neither(run, shrunk, tmp_path, monkeypatch, fails):
    """The disk filled while the plot was written: the report of the failed run stayed, for a
    CI step to pick up, and the rerun then needed --force."""
    from compresskit.compressor.measure import benchreport

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(benchreport, fails, full)
    plot, report = tmp_path / "b.png", tmp_path / "b.md"
    result = run("bench", shrunk / "model.fp32.onnx", "--batch", "1", *FAST, "--plot", plot,
                 "--report", report, "-q")  # fmt: skip
    assert result.exit_code == 1
    assert result.stderr.startswith("error: no space left on device"), result.stderr
    assert not plot.exists() and not report.exists()


class _Signal(torch.nn.Module):
    """A Conv1d over (N, 1, L) signals, written as a user writes it (no x[:, 0])."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(1, 4, 5)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.conv(x).mean(-1))


@pytest.mark.parametrize("sample", [(1, 64), (20,)])
def test_a_users_own_onnx_of_signals_or_features_is_scored_on_its_npz(run, tmp_path, sample):
    # compress reads an npz's (N, 1, L) signals as (N, 1, 1, L) and its (N, F) features went
    # in as (N, 1, 1, F): a file the user exported from such a model, benched on the npz it was
    # trained on, was refused as "takes (1, 64), --data gives (1, 1, 64); give matching data".
    import contextlib
    import io

    torch.manual_seed(0)
    net = (_Signal() if len(sample) == 2 else torch.nn.Linear(20, 3)).eval()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, *sample)).astype(np.float32)
    y = np.arange(50) % 3
    np.savez(tmp_path / "d.npz", x=x, y=y)
    path = tmp_path / "mine.onnx"
    with contextlib.redirect_stdout(io.StringIO()):
        torch.onnx.export(
            net,
            (torch.from_numpy(x[:1]),),
            path,
            dynamic_shapes=({0: torch.export.Dim("batch")},),
            external_data=False,
        )
    from compresskit.models.data import every_of_class  # its rule is tested in test_data

    test = every_of_class(y, 5)  # the npz's test split: a fifth of each class
    session = ort.InferenceSession(path)
    feed = {session.get_inputs()[0].name: x[test]}
    want = float(np.mean(session.run(None, feed)[0].argmax(1) == y[test]))
    result = run(
        "bench", path, "--data", f"npz:{tmp_path / 'd.npz'}", "--batch", "1,4", *FAST, "--json"
    )
    assert result.exit_code == 0, result.stderr
    rows = result.json()["results"]
    assert [r["batch"] for r in rows] == [1, 4]
    assert [r["test_accuracy"] for r in rows] == [pytest.approx(want, abs=1e-12)] * 2


def test_a_classifier_of_fewer_classes_than_the_data_is_told_so():
    # a 3-class model on 4-class data read as "its output has shape ('batch', 3), not
    # (batch, classes)": the class counts differ, and the data is the fix
    from types import SimpleNamespace

    from compresskit.compressor.measure.latency import scored_logits

    data = SimpleNamespace(num_classes=4, spec="tokens:24:200")
    with pytest.raises(InputError, match=r"m\.onnx: answers 3 classes but --data .* has 4"):
        scored_logits(np.zeros((5, 3)), "m.onnx", data)
    assert scored_logits(np.zeros((5, 4, 1, 1)), "m.onnx", data).shape == (5, 4)


def test_checkpoint_spellings_shrink_reads_are_benched_as_checkpoints():
    # a Lightning .ckpt, transformers' pytorch_model.bin and model.safetensors: shrink read
    # them, bench called them "unknown file type"
    for name in ("m.pth", "m.ckpt", "pytorch_model.bin", "model.safetensors", "M.PT"):
        assert variants.file_kind(Path(name)) == ".pt"


def test_a_tied_weight_is_counted_once_as_shrink_counts_it(tmp_path, user_module):
    tiedmod = user_module(
        "tiedmod",
        """
        from torch import nn

        class Net(nn.Module):
            def __init__(self, in_shape=(1, 8, 8), num_classes=10):
                super().__init__()
                self.a = nn.Linear(64, 64, bias=False)
                self.b = nn.Linear(64, 64, bias=False)
                self.b.weight = self.a.weight
                self.out = nn.Linear(64, num_classes)

            def forward(self, x):
                return self.out(self.b(self.a(x.flatten(1))))
        """,
    )

    net = tiedmod.Net()
    checkpoint.save(tmp_path / "t.pt", net, ModelSpec("tiedmod:Net", {}), {})
    m = variants.load(tmp_path / "t.pt", trust=True)
    assert m.parameters == 64 * 64 + 64 * 10 + 10
    assert m.bytes == 4 * m.parameters  # it was 4 x (2 x 4,096 + 650)
