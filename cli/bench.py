"""`compress bench`: flags -> `compresskit.compressor.bench` -> a table, JSON, report, plot."""

from __future__ import annotations

import os
from pathlib import Path

import click

from compresskit.cli import render
from compresskit.cli.main import MODEL_SUFFIXES, OutPath, emit_json, json_option, log_option
from compresskit.compressor import bench as run_bench
from compresskit.compressor.measure import benchreport, latency, variants
from compresskit.compressor.measure.variants import DEFAULT_PROVIDERS
from compresskit.models.errors import InputError


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise InputError(
            f"{flag} {text!r}: give whole numbers separated by commas, e.g. 1,64"
        ) from None


@click.command(
    epilog="""\b
Examples:
  compress bench student/ --data digits                  # every model in a shrink folder
  compress bench textcls-shrunk/ --data tokens           # a model of int64 token ids
  compress bench teacher.pt student/ --batch 1,64 --threads 1,0 --json
  compress bench model.fp32.onnx --baselines --data digits --report bench.md --plot bench.png
"""
)
@click.argument(
    "models", nargs=-1, required=True, metavar="MODEL...", type=click.Path(path_type=Path)
)
@click.option("--data", default=None, metavar="SPEC", help="Test set for accuracy and agreement.")
@click.option("--batch", "batch_text", default="1,64", show_default=True, help="Batch sizes.")
@click.option(
    "--threads",
    "threads_text",
    default="1",
    show_default=True,
    help="Thread counts (0 = all cores).",
)
@click.option(
    "--providers",
    default=None,
    help="Runtimes: torch (PyTorch eager), cpu, cuda, tensorrt (ONNX Runtime providers). "
    f"[default: those of {DEFAULT_PROVIDERS} installed here; the others named in one line]",
)
@click.option("--min-runs", type=int, default=50, show_default=True, help="Timed runs per cell.")
@click.option(
    "--min-seconds", type=float, default=1.0, show_default=True, help="Timed seconds per cell."
)
@click.option("--baselines", is_flag=True, help="Add ORT's quantize_dynamic/quantize_static.")
@click.option("--profile", is_flag=True, help="Per-operator profile of each ONNX model.")
@click.option(
    "--model",
    default=None,
    help="For a bare state_dict: a zoo name, pkg.module:Class or a function returning a module.",
)
@click.option(
    "--trust-model",
    is_flag=True,
    help="Allow importing the code each checkpoint names (your pkg.module:Class); it is "
    "imported and called: only for files you trust.",
)
@click.option(
    "--model-kwargs",
    default=None,
    metavar="JSON",
    help="Constructor arguments for --model, a JSON object.",
)
@click.option(
    "--report",
    "report_path",
    type=OutPath(dir_okay=False, path_type=Path),
    default=None,
    help="Write a report: the --json object for a .json file, else Markdown.",
)
@click.option(
    "--plot",
    "plot_path",
    type=OutPath(dir_okay=False, path_type=Path),
    default=None,
    help="Write the figure: PNG, SVG or PDF by the file suffix.",
)
@click.option("--force", is_flag=True, help="Replace an existing --report or --plot file.")
@click.option(
    "--wide", is_flag=True, help="Every column, however wide; else those the terminal fits."
)
@click.option("-q", "--quiet", is_flag=True, help="No progress on stderr.")
@json_option
@log_option
def bench(
    models: tuple[Path, ...],
    data: str | None,
    batch_text: str,
    threads_text: str,
    providers: str,
    min_runs: int,
    min_seconds: float,
    baselines: bool,
    profile: bool,
    model: str | None,
    trust_model: bool,
    model_kwargs: str | None,
    report_path: Path | None,
    plot_path: Path | None,
    force: bool,
    wide: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Latency, throughput, size and accuracy of models across runtimes, measured alike."""
    batches, threads = _ints(batch_text, "--batch"), _ints(threads_text, "--threads")
    # The flags are checked before the output paths, and those before any model is read.
    latency.BenchConfig(
        batches=batches, threads=threads, min_runs=min_runs, min_seconds=min_seconds
    )
    variants.parse_providers(providers or DEFAULT_PROVIDERS)
    from compresskit.models.fileio import check_writable

    # The files a folder argument expands to are inputs too: `--report s/model.int8.onnx`
    # with folder `s` replaced the model it had just measured with Markdown, exit 0.
    outputs = [p for p in (report_path, plot_path) if p is not None]
    inputs = variants.expand(list(models)) if outputs else []
    if report_path is not None and report_path.suffix.lower() in MODEL_SUFFIXES:
        raise InputError(
            f"--report {report_path}: a report is a .md (Markdown) or .json file, not "
            f"{report_path.suffix}; give another name"
        )
    for path, flag in ((report_path, "--report"), (plot_path, "--plot")):
        if path is not None:
            check_writable(path, flag, inputs=inputs, replace=force)
    both = report_path is not None and plot_path is not None
    if both and os.path.abspath(report_path) == os.path.abspath(plot_path):  # new files both
        raise InputError(f"--report and --plot both name {plot_path}; give two paths")
    if plot_path is not None:
        benchreport.check_plot_path(plot_path)
    result = run_bench(
        list(models),
        data,
        batches=batches,
        threads=threads,
        providers=providers,
        min_runs=min_runs,
        min_seconds=min_seconds,
        baselines=baselines,
        profile=profile,
        model=model,
        model_kwargs=model_kwargs,
        trust_model=trust_model,
        progress=(lambda m: None) if quiet else (lambda m: render.stderr.print(m)),
    ).to_json()
    # Both or neither: the plot first, then the report; a report that cannot be written takes
    # the new plot with it (a full disk had left a report of a failed run for CI to find).
    if plot_path:
        benchreport.plot(result, plot_path)
    try:
        if report_path and report_path.suffix.lower() == ".json":
            benchreport.write_json(result, report_path)
        elif report_path:
            benchreport.write_markdown(result, report_path, plot=plot_path)
    except BaseException:
        if plot_path:
            plot_path.unlink(missing_ok=True)
        raise
    if as_json:
        render.bench_notes(result)  # stderr: the JSON on stdout carries them too
        emit_json(result)
    else:
        render.bench_table(result, wide=wide)
