"""`compress bench`: flags -> variants -> the measured grid -> a table, JSON, report, plot."""

from __future__ import annotations

import tempfile
from pathlib import Path

import click

from compresskit.cli import render
from compresskit.cli.main import emit_json, input_name, json_option, log_option
from compresskit.compressor import benchmark, benchreport, envinfo, variants
from compresskit.compressor import export as export_mod
from compresskit.models import data as data_mod
from compresskit.models import safeload, zoo
from compresskit.models.errors import InputError

DEFAULT_PROVIDERS = "torch,cpu,cuda,tensorrt"


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
    help="Allow importing the code each checkpoint names (your pkg.module:Class).",
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
    type=click.Path(path_type=Path),
    default=None,
    help="Write a Markdown report.",
)
@click.option(
    "--plot", "plot_path", type=click.Path(path_type=Path), default=None, help="Write a PNG figure."
)
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
    wide: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Latency, throughput, size and accuracy of models across runtimes, measured alike."""
    cfg = benchmark.BenchConfig(
        batches=_ints(batch_text, "--batch"),
        threads=_ints(threads_text, "--threads"),
        min_runs=min_runs,
        min_seconds=min_seconds,
    )
    # Without --providers every runtime is asked for: the absent ones come back as skips
    # without being tried, kept in the JSON, and the table names them in one line.
    runtimes = variants.parse_providers(providers or DEFAULT_PROVIDERS)
    for path, flag in ((report_path, "--report"), (plot_path, "--plot")):
        if path is not None:
            from compresskit.models.fileio import check_writable

            check_writable(path, flag)
    paths = variants.expand(list(models))
    named = _model_name(paths, model)
    consent = named if trust_model else model  # may the model's code be imported
    ds = data_mod.load(data, input_name(named, consent)) if data else None
    info = (lambda m: None) if quiet else (lambda m: render.stderr.print(m))
    with tempfile.TemporaryDirectory(prefix="compress-bench.") as tmp:
        for p in paths:  # before onnx or ONNX Runtime reads any external data
            if p.suffix == ".onnx":
                safeload.check_onnx_external_data(p)
        described = variants.disambiguate(
            [
                variants.load(p, model, ds, zoo.parse_kwargs(model_kwargs), trust=trust_model)
                for p in paths
            ]
        )
        if baselines:
            described += _baselines(described, ds, Path(tmp), info)
        runnable, skipped = variants.variants(described, runtimes)
        results, more, extra = benchmark.measure(runnable, cfg, ds, info)
        profiles = _profiles(described, cfg, ds) if profile else {}
    result = {
        "environment": envinfo.environment(),
        **extra,
        "runtimes": {
            "requested": runtimes,
            "default": providers is None,
            "absent": benchmark.absent_runtimes(),
        },
        "results": results,
        "skipped": skipped + more,
        "profiles": profiles,
    }
    if report_path:
        benchreport.write_markdown(result, report_path, plot=plot_path)
    if plot_path:
        benchreport.plot(result, plot_path)
    if as_json:
        emit_json(result)
    else:
        render.bench_table(result, wide=wide)


def _baselines(described, ds, tmp: Path, info) -> list:
    """ORT's own quantizers on each FP32 ONNX input, calibrated on training images."""
    import numpy as np

    out = []
    for m in described:
        if m.format != "onnx" or m.precision != "fp32":
            continue
        if ds is not None:
            pick = np.random.default_rng(0).permutation(len(ds.y_train))[:256]
            calib = ds.x_train.numpy()[pick]
        elif m.in_shape is not None:  # float32 images, or int64 ids the model embeds
            calib = benchmark.inputs(m, 64, None, np.random.default_rng(0))
        else:
            raise InputError(f"--baselines: {m.path} has no fixed input shape; pass --data SPEC")
        info(f"baselines: ORT quantize_dynamic and default quantize_static of {m.label}")
        folder = tmp / str(len(out))  # one folder per input: equal names never overwrite
        folder.mkdir()
        for path in export_mod.ort_baselines(m.path, folder, calib):
            b = variants.load(path)
            b.label = f"{m.label} → {path.name.split('.')[-2]}"
            b.source = m.path  # its INT8 is compared with the FP32 file it came from
            out.append(b)
    return out


def _profiles(described, cfg, ds) -> dict:
    import numpy as np

    from compresskit.compressor import ortprofile

    out = {}
    for m in described:
        if m.format != "onnx":
            continue
        x = benchmark.inputs(m, cfg.batches[0], ds, np.random.default_rng(0))
        p = ortprofile.profile_ops(m.path, x, threads=benchmark.resolve_threads(cfg.threads[0]))
        out[m.label] = {**p, "top": ortprofile.top_ops(p, 5)}
    return out


def _model_name(paths: list[Path], model: str | None) -> str | None:
    """The PyTorch model being measured: --model, else the first checkpoint's recorded one."""
    if model is not None:
        return model
    from compresskit.models import checkpoint

    first = next((p for p in paths if p.suffix == ".pt"), None)
    spec = checkpoint.load(first).spec if first is not None else None
    return spec.name if spec is not None else None
