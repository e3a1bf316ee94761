"""`compress shrink` and `compress decode`: flags -> recipe -> one library call -> tables or JSON.

This is where the siblings meet: `distrib`'s training loop is handed to `compressor` as hooks."""

from __future__ import annotations

from pathlib import Path

import click

from cli import render
from cli.main import OutPath, emit_json, input_name, json_option
from compressor import pipeline
from compressor import recipe as recipe_mod
from compressor.shrink import Hooks
from distrib.trainer import TrainConfig, correct, cross_entropy_loss, evaluate, fit
from models import checkpoint, zoo
from models import data as data_mod


@click.command(
    epilog="""\b
Examples:
  compress shrink lenet300.pt --data digits --out lenet300-shrunk/
  compress shrink lenet5.pt --data mnist:~/mnist --recipe recipe.toml --json
  compress shrink lenet5.pt --data mnist:~/mnist --max-drop 0.2  # search within 0.2 points
  compress shrink lenet5.pt --dry-run > recipe.toml   # print the resolved recipe, edit, rerun
  compress shrink weights.pt --model mypkg.nets:build_net --model-kwargs '{"width": 64}' \\
      --data npz:train.npz                             # your own state_dict and model code
"""
)
@click.argument("model_path", metavar="MODEL.pt", type=click.Path(path_type=Path))
@click.option(
    "--data",
    default=None,
    metavar="SPEC",
    help="Data for retraining and accuracy [default: the checkpoint's, else digits].",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="Output folder [default: MODEL-shrunk/].",
)
@click.option(
    "--recipe",
    "recipe_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Recipe file (.toml or .json); unset keys take defaults.",
)
@click.option(
    "--max-drop",
    type=float,
    default=None,
    metavar="POINTS",
    help="Search each layer's sparsity and bits for the smallest archive whose validation "
    "accuracy stays within POINTS of the dense model's [recipe budget.max_drop].",
)
@click.option("--dry-run", is_flag=True, help="Print the resolved recipe (TOML) and exit.")
@click.option(
    "--fixed-batch",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Also write student.int8.fixed.onnx with batch N (NNAPI needs fixed shapes).",
)
@click.option(
    "--student",
    default=None,
    metavar="NAME",
    help="Distil into this zoo model or pkg.module:Class first (recipe distill.student).",
)
@click.option("--student-kwargs", default=None, metavar="JSON", help="Kwargs for --student.")
@click.option(
    "--teacher",
    "teachers",
    multiple=True,
    type=click.Path(path_type=Path),
    metavar="PATH",
    help="Another teacher checkpoint: with MODEL.pt, an ensemble (repeatable).",
)
@click.option(
    "--calibration",
    type=click.Path(path_type=Path),
    default=None,
    metavar="FILE.npy",
    help="INT8 calibration inputs [default: drawn from the training set].",
)
@click.option(
    "--opset",
    type=int,
    default=None,
    help="ONNX opset of the exported files [default: 18; 13..23].",
)
@click.option(
    "--target",
    type=click.Choice(["mobile", "host"]),
    default=None,
    help="Who runs the INT8 file: mobile (default: nothing timed, the same bytes on every "
    "build) or host (latency-aware on this machine) [recipe export.target].",
)
@click.option(
    "--model",
    default=None,
    metavar="NAME",
    help="For a bare state_dict (your own weights): a zoo name, or pkg.module:Class or "
    "pkg.module:function for your own code; for a checkpoint naming its own code, allows "
    "importing it.",
)
@click.option(
    "--model-kwargs",
    default=None,
    metavar="JSON",
    help="Constructor kwargs for --model with a bare state_dict (in_shape and num_classes "
    "come from --data where the constructor takes them).",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress on stderr.")
@json_option
def shrink(
    model_path: Path,
    data: str | None,
    out: Path | None,
    recipe_path: Path | None,
    max_drop: float | None,
    dry_run: bool,
    fixed_batch: int | None,
    student: str | None,
    student_kwargs: str | None,
    teachers: tuple[Path, ...],
    calibration: Path | None,
    opset: int | None,
    target: str | None,
    model: str | None,
    model_kwargs: str | None,
    quiet: bool,
    as_json: bool,
) -> None:
    """Teacher -> distilled student -> Deep Compression -> INT8 ONNX and .ort for mobile."""
    raw = recipe_mod.read(recipe_path) if recipe_path else {}
    # Flags override the recipe file (--teacher replaces its teachers list); the result is
    # validated as a whole, and its errors name the file and the flags.
    flags = {
        ("budget", "max_drop", "--max-drop"): max_drop,
        ("export", "fixed_batch", "--fixed-batch"): fixed_batch,
        ("distill", "student", "--student"): student,
        ("distill", "student_kwargs", "--student-kwargs"): zoo.parse_kwargs(
            student_kwargs, "--student-kwargs"
        )
        if student_kwargs
        else None,
        ("distill", "teachers", "--teacher"): [str(t) for t in teachers] or None,
        ("export", "calibration_data", "--calibration"): str(calibration) if calibration else None,
        ("export", "opset", "--opset"): opset,
        ("export", "target", "--target"): target,
    }
    given = []
    for (section, key, flag), value in flags.items():
        if value is not None and isinstance(raw.setdefault(section, {}), dict):
            raw[section][key] = value
            given.append(flag)
    source = str(recipe_path) if recipe_path else "recipe"
    recipe = recipe_mod.resolve(raw, source=source + (f" with {', '.join(given)}" if given else ""))
    if dry_run:
        if as_json:
            emit_json({"recipe": recipe})
        else:
            click.echo(recipe_mod.dumps(recipe), nl=False)
        return
    out = out or model_path.with_name(model_path.stem + "-shrunk")
    report = run_shrink(model_path, data, out, recipe, model, model_kwargs, quiet)
    render.int8_warning(report)
    if as_json:
        emit_json(json_view(report))
    else:
        render.shrink_summary(report)


JSON_KEYS = (
    "baseline",
    "stages",
    "archive",
    "onnx",
    "ort",
    "mobile",
    "mobile_fixed_batch",
    "int8_not_written",
    "teacher",
    "student",
    "hint",
    "transfer",
    "channels",
    "layers",
    "budget",
    "files",
    "seconds",
)


def json_view(report: dict) -> dict:
    """What `--json` prints of the report (report.json keeps everything, the recipe too)."""
    return {k: report[k] for k in JSON_KEYS if k in report}


def run_shrink(
    model_path: Path,
    data: str | None,
    out: Path,
    recipe: dict,
    model: str | None = None,
    model_kwargs: str | None = None,
    quiet: bool = False,
) -> dict:
    """Load the checkpoint and data, hand `distrib`'s training loop to the pipeline as hooks,
    run it with progress on stderr; return the report."""
    pipeline.check_out_dir(out)
    ck = checkpoint.load(model_path)
    named = model or (ck.spec.name if ck.spec is not None else None)
    ds = data_mod.load(data or ck.metadata.get("data") or "digits", input_name(named, model))
    spec = ck.spec_for(model, zoo.parse_kwargs(model_kwargs), ds.in_shape, ds.num_classes)
    net = ck.build_model(spec, allow_import=model == spec.name)
    # The loaded weights and optimizer state (3x the model after Adam) are copied into `net`:
    # let them go rather than hold them through every stage.
    del ck
    data_mod.check_fits(net, ds, spec.name)

    progress = render.TrainProgress(quiet=quiet)
    train = recipe["train"]
    x_val, y_val = ds.decision_split()  # held out of training: what stages decide on

    def retrain(m, epochs: int, lr: float, loss_fn=None, data=None) -> None:
        cfg = TrainConfig(
            epochs=epochs,
            lr=lr,
            batch_size=train["batch_size"],
            optimizer=train["optimizer"],
            seed=train["seed"],
        )
        fit(m, data or ds, cfg, events=progress, loss_fn=loss_fn or cross_entropy_loss)

    hooks = Hooks(
        retrain=retrain,
        test_accuracy=lambda m: evaluate(m, ds.x_test, ds.y_test)[1],
        val_accuracy=lambda m: evaluate(m, x_val, y_val)[1],
        val_data=(x_val, y_val),
        test_correct=lambda m: correct(m, ds.x_test, ds.y_test),
        info=progress.info,
        train_samples=len(ds.y_train),
    )
    meta = {"data": ds.spec, "source": str(model_path)}
    try:
        return pipeline.shrink_to_folder(net, spec, recipe, hooks, out, meta, ds)
    finally:
        progress.close()


@click.command(
    epilog="""\b
Example:
  compress decode lenet300-shrunk/student.dcz --out lenet300-decoded.pt
"""
)
@click.argument("archive_path", metavar="MODEL.dcz", type=click.Path(path_type=Path))
@click.option(
    "--out",
    type=OutPath(dir_okay=False, path_type=Path),
    default=None,
    help="Checkpoint to write [default: MODEL.decoded.pt].",
)
@click.option(
    "--model",
    default=None,
    help="Allow importing the pkg.module:Class the archive names (your own model).",
)
@click.option(
    "--max-elements",
    type=click.IntRange(min=1),
    default=None,
    help="Refuse archives declaring more tensor elements than this "
    "[default: $COMPRESS_MAX_ELEMENTS or 2^31].",
)
@click.option(
    "--expect",
    "sha256",
    metavar="SHA256",
    default=None,
    help="Refuse the archive unless its SHA-256 is this (the sha256 in report.json).",
)
@json_option
def decode(
    archive_path: Path,
    out: Path | None,
    model: str | None,
    max_elements: int | None,
    sha256: str | None,
    as_json: bool,
) -> None:
    """Rebuild a .pt checkpoint from a .dcz archive, bit for bit.

    The archive is checked before anything is built: a damaged or crafted file is refused with
    exit 2. Its CRC32 catches damage, not tampering: pass --expect with the SHA-256 from
    report.json (sent over a channel you trust) to know it is the archive that was written.
    """
    out = out or archive_path.with_suffix(".decoded.pt")
    result = pipeline.decode_to_checkpoint(
        archive_path, out, allow_import=model, max_elements=max_elements, sha256=sha256
    )
    if as_json:
        emit_json(result)
    else:
        click.echo(
            f"decoded {result['archive']} ({result['archive_bytes']:,} bytes) -> "
            f"{result['checkpoint']}: {result['model']}, {result['parameters']:,} parameters"
        )
