"""Plots a person reads: the shrink histogram draws a bounded number of centroid marks, the
bench figure has one latency panel per batch size with one colour per runtime and a key
instead of labels piled on coincident points, and the Markdown reports link their plots and
give each mobile verdict with its reason and fix."""

from __future__ import annotations

import numpy as np

from compresskit.compressor import recipe
from compresskit.compressor import report as report_mod
from compresskit.compressor.measure import benchreport

PNG = b"\x89PNG\r\n\x1a\n"

# What mobile.usability really returns for a dynamic-batch INT8 file and its batch-1 copy
# (tests/test_mobile.py pins the checker's wording).
MOBILE = {
    "nnapi": "no",
    "coreml": "no",
    "details": "NNAPI NO (0/8 nodes in 0 partition(s); YES with fixed shapes); "
    "CoreML NeuralNetwork NO (0/8 nodes in 0 partition(s); NO with fixed shapes; "
    "unsupported ops DequantizeLinear,QuantizeLinear); "
    "CoreML MLProgram NO (0/8 nodes in 0 partition(s); NO with fixed shapes; "
    "unsupported ops DequantizeLinear,QuantizeLinear)",
}
FIXED = {
    "path": "/out/student.int8.fixed.onnx",
    "batch": 1,
    "bytes": 23456,
    "nnapi": "yes",
    "coreml": "no",
    "details": "NNAPI YES (8/8 nodes in 1 partition(s)); "
    "CoreML NeuralNetwork NO (5/8 nodes in 2 partition(s); "
    "unsupported ops DequantizeLinear,QuantizeLinear); "
    "CoreML MLProgram NO (5/8 nodes in 2 partition(s); "
    "unsupported ops DequantizeLinear,QuantizeLinear)",
}


def _shrink_report(**extra) -> dict:
    """A report shaped like compressor.shrink's (the keys markdown() and plots() read), with
    an 8-bit layer: 256 shared values."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal(5000) * 0.05
    counts, edges = np.histogram(w, bins=120)
    report = {
        "baseline": {"bytes": 100_000, "test_accuracy": 0.95},
        "stages": [
            {"name": "prune", "bytes": 40_000, "ratio": 2.5, "test_accuracy": 0.94},
            {"name": "quantize", "bytes": 12_000, "ratio": 8.3, "test_accuracy": 0.94},
        ],
        "layers": [
            {
                "name": "conv2",
                "weights": 5000,
                "kept_fraction": 0.3,
                "weight_bits": 8,
                "index_bits": 4.0,
            },
            {
                "name": "fc",
                "weights": 2000,
                "kept_fraction": 0.1,
                "weight_bits": 5,
                "index_bits": 4.0,
            },
        ],
        "histogram": {
            "layer": "conv2",
            "counts": counts.tolist(),
            "edges": edges.tolist(),
            "centroids_init": np.linspace(w.min(), w.max(), 256).tolist(),
            "centroids": np.sort(rng.standard_normal(256) * 0.05).tolist(),
        },
        "recipe": recipe.resolve(),
    }
    return {**report, **extra}


def _onnx(kind: str) -> dict:
    """report["onnx"][kind] with the keys the ONNX table reads."""
    o = {
        "path": f"/out/student.{kind}.onnx",
        "bytes": 30_000,
        "test_accuracy": 0.94,
        "top1_agreement": 1.0,
        "max_abs_diff": 1e-6,
        "weights_ok": True,
        "opsets": {"ai.onnx": 18},
        "ir_version": 8,
        "min_ort": "1.14",
    }
    if kind == "int8":
        o |= {
            "target": "mobile",
            "scheme": "qdq",
            "reduce_range": False,
            "decided_on": "reference",
            "int8_nodes": 3,
            "quantizable_nodes": 3,
            "check_agreement": 1.0,
            "min_agreement": 0.99,
            "latency_ms_batch1": None,
            "fp32_nodes": {},
            "host_kernels": {
                "top1_agreement_fp32": 1.0,
                "max_abs_diff_fp32": 1e-3,
                "saturating_cpu": False,
            },
        }
    return o


ONNX = {"fp32": _onnx("fp32"), "int8": _onnx("int8")}


def _centroid_marks(ax) -> dict[str, int]:
    """Vertical lines drawn per legend label (vlines makes one LineCollection each)."""
    return {
        c.get_label(): len(c.get_segments())
        for c in ax.collections
        if "centroid" in c.get_label() or "init" in c.get_label()
    }


def test_an_8_bit_layer_draws_at_most_32_centroid_marks_and_says_how_many(tmp_path):
    report = _shrink_report()
    fig = report_mod.figures(report)["weights_histogram.png"]
    (ax,) = fig.axes
    marks = _centroid_marks(ax)
    assert len(marks) == 2 and all(0 < n <= 32 for n in marks.values()), marks
    assert ax.get_title() == "conv2: 256 centroids (32 shown)"
    drawn = next(c for c in ax.collections if "fine-tuned" in c.get_label())
    xs = sorted(seg[0][0] for seg in drawn.get_segments())
    cents = report["histogram"]["centroids"]
    assert xs[0] == min(cents) and xs[-1] == max(cents)  # both ends kept, spread evenly
    assert "32 of 256 shown" in drawn.get_label()

    written = report_mod.plots(report, tmp_path)
    assert [p.name for p in written] == report_mod.plot_names(report)
    assert [p.name for p in written] == ["weights_histogram.png", "kept_per_layer.png"]
    assert all(p.read_bytes()[:8] == PNG for p in written)


def test_a_small_codebook_draws_every_centroid_and_no_shown_note():
    report = _shrink_report()
    report["histogram"]["centroids"] = [-0.1, -0.05, 0.05, 0.1]
    report["histogram"]["centroids_init"] = [-0.12, -0.04, 0.04, 0.12]
    (ax,) = report_mod.figures(report)["weights_histogram.png"].axes
    assert set(_centroid_marks(ax).values()) == {4}
    assert ax.get_title() == "conv2: 4 centroids"


def test_shrink_markdown_links_its_plots_and_explains_mobile_verdicts():
    ort = {
        "path": "/out/student.int8.ort",
        "bytes": 34567,
        "config": "/out/student.int8.required_operators.config",
        "max_abs_diff": 1e-6,
    }
    md = report_mod.markdown(
        _shrink_report(onnx=ONNX, ort=ort, mobile=MOBILE), "compress shrink: lenet5"
    )
    assert "![weights histogram](weights_histogram.png)" in md
    assert "![weights kept per layer](kept_per_layer.png)" in md
    assert "channels_per_layer.png" not in md  # no channels stage: that plot is not written
    nnapi = next(line for line in md.splitlines() if line.startswith("- NNAPI"))
    assert "**no**" in nnapi and "0/8 nodes in 0 partition(s)" in nnapi
    assert "yes with fixed shapes" in nnapi
    coreml = next(line for line in md.splitlines() if line.startswith("- CoreML"))
    assert "unsupported ops DequantizeLinear,QuantizeLinear" in coreml
    assert "NeuralNetwork no" in coreml and "MLProgram no" in coreml
    fix = next(line for line in md.splitlines() if line.startswith("- Fix"))
    assert "`--fixed-batch 1`" in fix and "NNAPI" in fix and "CoreML" not in fix
    assert "student.int8.fixed.onnx" in fix
    assert "`student.int8.ort`: 34,567 bytes" in md

    # with the fixed-batch copy written: ship it, and its own verdicts with their reasons
    md = report_mod.markdown(
        _shrink_report(onnx=ONNX, ort=ort, mobile=MOBILE, mobile_fixed_batch=FIXED)
    )
    fix = next(line for line in md.splitlines() if line.startswith("- Fix"))
    assert "ship `student.int8.fixed.onnx`" in fix and "--fixed-batch" not in fix
    after = md[md.index("Batch fixed to 1") :]
    assert "- NNAPI (Android): **yes**: 8/8 nodes in 1 partition(s) can run on it." in after
    assert "unsupported ops DequantizeLinear,QuantizeLinear" in after


def test_markdown_links_only_the_plots_it_is_given():
    report = _shrink_report(channels=None)
    md = report_mod.markdown(report, plots=["kept_per_layer.png"])
    assert "![weights kept per layer](kept_per_layer.png)" in md
    assert "weights_histogram.png" not in md
    assert "## Plots" not in report_mod.markdown(report, plots=[])


def test_mobile_reasons_parse_the_checkers_details():
    eps = report_mod.mobile_reasons(MOBILE["details"])
    assert eps["NNAPI"] == {
        "verdict": "no",
        "nodes": "0/8 nodes in 0 partition(s)",
        "fixed": "yes",
    }
    assert eps["CoreML MLProgram"]["unsupported"] == "DequantizeLinear,QuantizeLinear"
    assert report_mod.mobile_reasons("something else entirely") == {}


def _row(model, precision, provider, batch, p50, size, acc):
    return {
        "model": model,
        "format": "onnx",
        "precision": precision,
        "provider": provider,
        "batch": batch,
        "threads": 1,
        "p50_ms": p50,
        "p90_ms": p50 * 1.1,
        "p99_ms": p50 * 1.2,
        "p50_ci_ms": [p50 * 0.95, p50 * 1.05],
        "throughput_per_s": batch / (p50 / 1000),
        "cold_start_ms": 10.0,
        "bytes": size,
        "parameters": None,
        "gflops": None,
        "test_accuracy": acc,
        "top1_agreement": 1.0,
        "notes": [],
    }


def _bench() -> dict:
    """Batch 1 and 64; three files of the same size and accuracy on two runtimes."""
    rows = []
    for batch, scale in ((1, 1.0), (64, 40.0)):
        rows += [
            _row("student.pt", "fp32", "pytorch-cpu", batch, 0.5 * scale, 250_000, 0.9),
            _row(
                "student.fp32.onnx",
                "fp32",
                "CPUExecutionProvider",
                batch,
                0.2 * scale,
                250_000,
                0.9,
            ),
            _row(
                "student.fp32.ort",
                "fp32",
                "CPUExecutionProvider",
                batch,
                0.19 * scale,
                250_000,
                0.9,
            ),
            _row(
                "student.int8.onnx",
                "int8",
                "CPUExecutionProvider",
                batch,
                0.1 * scale,
                70_000,
                0.89,
            ),
        ]
    return {
        "environment": {"cpu_model": "test CPU", "cpu_flags": {"avx2": True}},
        "results": rows,
        "skipped": [],
    }


def test_bench_figure_one_panel_per_batch_coloured_by_runtime_with_a_key(tmp_path):
    bench = _bench()
    fig = benchreport.figure(bench)
    latency = [ax for ax in fig.axes if ax.get_title().startswith("batch ")]
    assert [ax.get_title() for ax in latency] == ["batch 1", "batch 64"]
    colours = {benchreport.RUNTIME_COLOURS[p] for p in ("pytorch-cpu", "CPUExecutionProvider")}
    for ax in latency:
        assert len(ax.patches) == 4  # one bar per variant run at this batch
        bars = {tuple(p.get_facecolor()) for p in ax.patches}
        assert len(bars) == 2  # one colour per runtime, not per bar
    from matplotlib.colors import to_rgba

    assert {tuple(to_rgba(c)) for c in colours} == {
        tuple(p.get_facecolor()) for p in latency[0].patches
    }
    # the runtimes' legend names each colour once
    legend = latency[-1].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["pytorch-cpu", "ORT CPU"]

    (acc,) = [ax for ax in fig.axes if ax.get_title().startswith("Accuracy")]
    assert len(acc.texts) == 0  # no free text labels at the points
    key = [t.get_text() for t in acc.get_legend().get_texts()]
    # the three 250 KB / 90% files share one numbered marker; the INT8 file has its own
    assert len(key) == 2 and key[0].startswith("1: ") and key[1].startswith("2: ")
    assert all(name in key[0] for name in ("student.pt", "student.fp32.onnx", "student.fp32.ort"))
    assert "student.int8.onnx" in key[1] and "70.0 KB, 89.00%" in key[1]
    positions = [tuple(line.get_xydata()[0]) for line in acc.lines]
    assert len(positions) == 4  # two markers (a dot and its number) per point
    assert len(set(positions)) == 2

    path = benchreport.plot(bench, tmp_path / "bench.png")
    assert path.read_bytes()[:8] == PNG


def test_bench_markdown_links_its_plot(tmp_path):
    bench = _bench()
    (tmp_path / "plots").mkdir()
    md_path = benchreport.write_markdown(bench, tmp_path / "b.md", tmp_path / "plots" / "b.png")
    assert "](plots/b.png)" in md_path.read_text()
    assert "![" not in benchreport.markdown(bench)  # no plot written: no link


def test_mobile_section_names_the_files_the_report_names():
    """Without distillation the outputs are model.*: the text follows report["onnx"]."""
    onnx = {k: {**o, "path": o["path"].replace("student.", "model.")} for k, o in ONNX.items()}
    md = report_mod.markdown(_shrink_report(onnx=onnx, mobile=MOBILE))
    assert "usability` on `model.int8.onnx`" in md
    fix = next(line for line in md.splitlines() if line.startswith("- Fix"))
    assert "`model.int8.fixed.onnx`" in fix and "student" not in fix


def test_fp32_nodes_with_one_reason_are_listed_once():
    """Nodes the fallback returned for one reason share one bullet that names them all; a
    node with a reason of its own keeps its own bullet."""
    why = "accuracy: with every node in INT8, top-1 agreement 0.9938"
    onnx = {
        **ONNX,
        "int8": {
            **ONNX["int8"],
            "fp32_nodes": {"conv_a": why, "head": "INT8 slower", "conv_b": why, "conv_c": why},
            "int8_nodes": 1,
            "quantizable_nodes": 5,
        },
    }
    md = report_mod.markdown(_shrink_report(onnx=onnx), plots=[])
    kept = md.split("Kept in FP32:\n", 1)[1].split("\n")
    assert kept[0] == f"- 3 nodes: {why}. The nodes: `conv_a`, `conv_b`, `conv_c`"
    assert kept[1] == "- `head`: INT8 slower"
    assert md.count(why) == 1
