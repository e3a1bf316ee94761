"""`compress demo`: the whole tool on the bundled digits, no arguments, no network.

Trains a VGG teacher (4.7M parameters, 3 epochs), distils it into LeNet-5 (131K parameters at
8x8), compresses the student (prune, k-means sharing, Huffman archive), exports FP32 and INT8
ONNX plus the .ort file for mobile, then benchmarks the teacher in PyTorch against the student's
ONNX files in ONNX Runtime (`compress bench`'s method) at batch 1. About 35 s on 2 cores.
"""

from __future__ import annotations

from pathlib import Path

import click

from compresskit.cli import render
from compresskit.cli.main import Interrupted, OutPath, emit_json, json_option, log_option
from compresskit.cli.shrink import json_view, run_shrink
from compresskit.compressor import pipeline
from compresskit.compressor import recipe as recipe_mod
from compresskit.compressor.measure import envinfo, latency, variants
from compresskit.distrib.job import TrainJob, run
from compresskit.distrib.trainer import TrainConfig
from compresskit.models import data as data_mod
from compresskit.models.errors import InputError

TEACHER = {"model": "vgg", "epochs": 3}
# Chosen by measurement (docs/benchmarks.md): LeNet-5 distilled for 20 epochs at T=4, alpha=0.7
# beat LeNet-5 trained alone on 3 of 3 seeds.
RECIPE = {"distill": {"student": "lenet5", "epochs": 20, "temperature": 4.0, "alpha": 0.7}}


@click.command(
    epilog="""\b
Example:
  compress demo                      # writes compress-demo/
  compress demo --out /tmp/demo --json
"""
)
@click.option(
    "--out",
    type=OutPath(file_okay=False, path_type=Path),
    default=Path("compress-demo"),
    show_default=True,
    help="Folder for teacher.pt and the student/ outputs.",
)
@click.option("--force", is_flag=True, help="Replace the outputs of an earlier demo in --out.")
@click.option("-q", "--quiet", is_flag=True, help="No progress on stderr.")
@json_option
@log_option
def demo(out: Path, force: bool, quiet: bool, as_json: bool) -> None:
    """Train a teacher on digits, shrink it to an INT8 ONNX student, compare them."""
    try:
        _demo(out, force, quiet, as_json)
    except (KeyboardInterrupt, Interrupted):  # shrink's own note offered a --resume demo lacks
        raise Interrupted(
            f"interrupted; the demo does not resume: `compress demo --out {out} --force` "
            "starts it again"
        ) from None


def _demo(out: Path, force: bool, quiet: bool, as_json: bool) -> None:
    # before any training: a folder we can create or fill (it writes no shrink output names
    # at its top, so files of those names there are not in the way)
    pipeline.check_out_dir(out, force=True)
    if (out / "teacher.pt").exists() and not force:
        raise InputError(
            f"--out {out}: already holds an earlier demo (teacher.pt); pass --force to replace "
            "it, or give another folder"
        )
    out.mkdir(exist_ok=True)
    pipeline.check_out_dir(out / "student", force)
    teacher_path = out / "teacher.pt"
    progress = render.TrainProgress(quiet=quiet)
    try:
        progress.info(f"1/3 training the teacher: {TEACHER['model']} on digits")
        job = TrainJob(
            model=TEACHER["model"],
            data="digits",
            config=TrainConfig(epochs=TEACHER["epochs"]),
            out=teacher_path,
        )
        run(job, progress)
    finally:
        progress.close()
    if not quiet:
        render.stderr.print("2/3 distilling into LeNet-5, then Deep Compression and INT8 export")
    report = run_shrink(
        teacher_path,
        "digits",
        out / "student",
        recipe_mod.resolve(RECIPE),
        quiet=quiet,
        force=force,
    )
    if not quiet:
        render.stderr.print(
            "3/3 compress bench: teacher (PyTorch) against student (ONNX Runtime), batch 1"
        )
    bench = _bench(teacher_path, report, quiet)
    by = {r["model"]: r["p50_ms"] for r in bench["results"]}
    report["latency_ms_batch1"] = {
        "teacher_pytorch": by.get("teacher.pt"),
        "student_onnx_fp32": by.get("student.fp32.onnx"),
        "student_onnx_int8": by.get("student.int8.onnx"),
    }
    report["teacher"]["path"] = str(teacher_path.resolve())
    report["teacher"]["bytes"] = 4 * report["teacher"]["parameters"]  # FP32 weights (the .pt
    # file also holds the optimizer state, for --resume)
    if as_json:
        emit_json(
            {**json_view(report), "latency_ms_batch1": report["latency_ms_batch1"], "bench": bench}
        )
    else:
        render.shrink_summary(report)
        render.bench_table(bench)


def _bench(teacher_path: Path, report: dict, quiet: bool) -> dict:
    """`compress bench` of teacher (PyTorch), student FP32 ONNX and INT8 ONNX: batch 1, one
    thread, interleaved, with accuracy and agreement on the digits test set."""
    folder = teacher_path.parent.resolve() / "student"  # rows' paths hold from any folder
    files = [teacher_path.resolve()] + [folder / f"student.{k}.onnx" for k in ("fp32", "int8")]
    ds = data_mod.load("digits")
    models = [variants.load(p, data=ds) for p in files if p.is_file()]
    runnable = [v for v in variants.variants(models, ["torch", "cpu"])[0] if v.precision != "bf16"]
    info = (lambda m: None) if quiet else render.stderr.print
    results, _, extra = latency.measure(
        runnable, latency.BenchConfig(batches=(1,), threads=(1,), min_seconds=2.0), ds, info
    )
    return {"environment": envinfo.environment(), **extra, "results": results, "skipped": []}
