"""The shrink summary at 80 and 200 columns: golden files (UPDATE_GOLDEN=1 rewrites them), every
line within the width, no number cut. The report is the demo's (distilled LeNet-5 on digits)."""

import json
import os
from pathlib import Path

import pytest

from compresskit.cli import render

GOLDEN = Path(__file__).parent / "golden"
REPORT = json.loads((GOLDEN / "shrink_report.json").read_text())


def _summary(capsys, width: int) -> str:
    render.shrink_summary(REPORT, width=width)
    return capsys.readouterr().out


@pytest.mark.parametrize("width", [80, 200])
def test_shrink_summary_golden_and_within_the_width(capsys, width):
    text = _summary(capsys, width)
    golden = GOLDEN / f"shrink_{width}.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()
    assert max(len(line.rstrip()) for line in text.splitlines()) <= width
    assert "…" not in text


def test_the_summary_opens_with_each_deliverable_and_what_to_ship(capsys):
    lines = _summary(capsys, 80).splitlines()
    assert lines[0] == "deliverables against 524,320 B of dense FP32 weights (131,080 parameters):"
    rows = {line.split()[0]: line for line in lines[1:5]}
    assert set(rows) == {
        "student.dcz",
        "student.fp32.onnx",
        "student.int8.onnx",
        "student.int8.ort",
    }
    assert rows["student.int8.onnx"].endswith("ship this (ONNX Runtime)")
    assert "25.8×" in rows["student.dcz"] and "3.4×" in rows["student.int8.onnx"]


def test_mobile_verdicts_say_why_and_the_fix(capsys):
    text = " ".join(_summary(capsys, 200).split())
    assert "NNAPI no (yes with fixed shapes: --fixed-batch 1)" in text
    assert "CoreML no (unsupported ops DequantizeLinear, QuantizeLinear)" in text


def test_an_archive_larger_than_its_pq_figure_says_why(capsys):
    report = json.loads(json.dumps(REPORT))
    report["archive"]["over_pq"] = {"pq_bytes": 8_797, "fixed_bytes": 4_100}
    render.shrink_summary(report, width=200)
    text = capsys.readouterr().out
    assert "larger than its P+Q figure (8,797 bytes)" in text and "4,100" in text


@pytest.mark.parametrize("coder", ["range", "huffman"])
def test_report_md_describes_the_archive_in_its_own_formats_terms(coder):
    # a format-3 archive's non-stream bytes were called its "header", and its index bits a
    # gap code with a gap width it does not have
    from compresskit.compressor import recipe
    from compresskit.compressor import report as report_mod

    report = {**REPORT, "recipe": recipe.Recipe.from_dict({"huffman": {"coder": coder}}).to_dict()}
    md = report_mod.markdown(report, "t")
    archive = next(line for line in md.splitlines() if line.startswith("Archive"))
    bits = next(line for line in md.splitlines() if line.startswith("Bits are"))
    if coder == "range":
        assert "outside the coded stream" in archive and "no gap width" in bits
    else:
        assert "header 199 bytes" in archive and "relative-index (gap) code" in bits


def test_an_ensembles_figures_are_never_one_members(capsys):
    # "distilled 312,770-parameter teacher lenet300 (96.11%)": the whole ensemble's figures
    # under its first member's name
    report = json.loads(json.dumps(REPORT))
    report["teacher"] |= {"name": "lenet300", "parameters": 312_770, "members": 3}
    report["teacher"]["test_accuracy"] = 0.9611
    render.shrink_summary(report, width=200)
    text = " ".join(capsys.readouterr().out.split())
    assert "distilled an ensemble of 3 teachers (lenet300 and 2 more; 312,770 parameters" in text
    assert "96.11% averaged)" in text and "teacher lenet300 (96.11%)" not in text


def test_a_thinned_students_figures_come_from_one_model_each():
    # "into mobilenet with 5,684 parameters (59.17% before Deep Compression)": the thinned
    # size beside the unthinned student's accuracy; Deep Compression started from 70.00%
    import torch

    from compresskit.compressor import pipeline

    report = {
        "baseline": {"parameters": 74_354, "test_accuracy": 0.9444},
        "channels": {"test_accuracy": [0.5917, 0.70]},
    }
    distilled = {
        "teacher": {"parameters": 74_354, "test_accuracy": 0.9444, "members": 1},
        "student": {"name": "mobilenet", "parameters": 10_634, "test_accuracy": 0.5917},
    }
    thinned = torch.nn.Linear(10, 10)
    pipeline._teacher_student(report, distilled, "vgg", "mobilenet", thinned, 0.69)
    st = report["student"]
    assert st["parameters"] == 110 and st["dense_test_accuracy"] == 0.70
    assert (st["distilled_parameters"], st["distilled_test_accuracy"]) == (10_634, 0.5917)
