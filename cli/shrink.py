"""`compress shrink` and `compress decode`: flags -> recipe -> one library call -> tables or JSON.

This is where the siblings meet: `distrib`'s training loop is handed to `compressor` as hooks."""

from __future__ import annotations

import time
from pathlib import Path

import click

from compresskit import api
from compresskit.cli import render
from compresskit.cli.main import (
    Interrupted,
    OutPath,
    emit_json,
    input_name,
    json_option,
    log_option,
)
from compresskit.compressor import pipeline
from compresskit.compressor import recipe as recipe_mod
from compresskit.compressor import resume as resume_mod
from compresskit.compressor.shrink import plan as shrink_plan
from compresskit.models import checkpoint, fileio, zoo
from compresskit.models import data as data_mod
from compresskit.models.errors import InputError, MachineError, StageError


class _IntOrAuto(click.ParamType):
    """A whole number, or the word auto (the recipe checks the bounds)."""

    name = "M|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or value == "auto":
            return value
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is not a whole number or auto", param, ctx)


_MICROBATCHES = _IntOrAuto()


@click.command(
    epilog="""\b
Examples:
  compress shrink lenet300.pt --data digits --out lenet300-shrunk/
  compress shrink lenet5.pt --data mnist:~/mnist --recipe recipe.toml --json
  compress shrink lenet5.pt --data mnist:~/mnist --max-drop 0.2  # search within 0.2 points
  compress shrink lenet5.pt --dry-run > recipe.toml   # print the resolved recipe, edit, rerun
  compress shrink lenet5.pt --out lenet5-shrunk/ --resume  # continue a stopped run
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
    type=OutPath(path_type=Path),
    default=None,
    help="Output folder [default: MODEL-shrunk/].",
)
@click.option(
    "--recipe",
    "recipe_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Recipe file (.toml, .yaml or .json); unset keys take defaults.",
)
@click.option(
    "--max-drop",
    type=str,
    default=None,
    metavar="POINTS|off",
    help="Search each layer's sparsity and bits for the smallest archive whose validation "
    "accuracy stays within POINTS of the dense model's; 'off' turns a recipe's budget off "
    "[recipe budget.max_drop].",
)
@click.option("--dry-run", is_flag=True, help="Print the resolved recipe (TOML) and exit.")
@click.option(
    "--fixed-batch",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Also write model.int8.fixed.onnx (student.* with --student) with batch N (NNAPI "
    "needs fixed shapes).",
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
    help="Who runs the INT8 file: mobile (default: nothing timed, so the load of the machine "
    "changes no byte) or host (latency-aware on this machine) [recipe export.target].",
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
@click.option(
    "--trust-model",
    is_flag=True,
    help="Allow importing the code the checkpoint names (your pkg.module:Class), without "
    "typing its name as --model, and a student the recipe names by import path. That code is "
    "imported and called: only for files you trust.",
)
@click.option(
    "--sparsity",
    default=None,
    metavar="F|default|auto",
    help="Fraction of each layer's weights to prune (e.g. 0.9), 'default' (by layer role) or "
    "'auto' (sensitivity analysis) [recipe prune.sparsity].",
)
@click.option(
    "--bits",
    default=None,
    metavar="N|CONV,FC",
    help="Bits per shared weight: N for every layer, or CONV,FC (e.g. 8,5); replaces a "
    "recipe's per-layer table [recipe quantize.conv_bits, fc_bits, bits].",
)
@click.option(
    "--epochs",
    type=click.IntRange(min=0),
    default=None,
    metavar="N",
    help="Training epochs of every stage that trains (distill, channels, prune retraining, "
    "centroid fine-tuning, soft sharing's prior) [recipe *.epochs].",
)
@click.option(
    "--microbatches",
    type=_MICROBATCHES,
    default=None,
    metavar="M|auto",
    help="Retrain every batch as M slices, accumulating their gradients: the same updates "
    "(dropout aside) in about 1/M of the activation memory (not for models with BatchNorm); "
    "auto: as many as keep one slice's activations within 4x the model's bytes "
    "[recipe train.microbatches].",
)
@click.option(
    "--strict",
    is_flag=True,
    default=None,
    help="Fail (exit 1, nothing written) when a guardrail fires: a stage over "
    "guard.max_stage_drop, INT8 under its floor, a student bigger than its teacher.",
)
@click.option("--force", is_flag=True, help="Replace the outputs of an earlier run in --out.")
@click.option(
    "--resume",
    is_flag=True,
    help="Continue a stopped run into --out from the stages it finished (kept beside --out "
    "until a run succeeds), when the model, data and the recipe sections those stages read "
    "are the same; else start from the beginning.",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress on stderr.")
@json_option
@log_option
def shrink(
    model_path: Path,
    data: str | None,
    out: Path | None,
    recipe_path: Path | None,
    max_drop: str | None,
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
    trust_model: bool,
    sparsity: str | None,
    bits: str | None,
    epochs: int | None,
    microbatches: int | str | None,
    strict: bool | None,
    force: bool,
    resume: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Teacher -> distilled student -> Deep Compression -> INT8 ONNX and .ort for mobile.

    Outputs are named for what they hold: model.* (the checkpoint's model, compressed), or
    student.* with --student. Exit codes: 0 ok, 1 a stage failed (or a guardrail, with
    --strict), 2 bad usage or input.
    """
    raw = recipe_mod.read(recipe_path) if recipe_path else {}
    # Flags override the recipe file (--teacher replaces its teachers list); the result is
    # validated as a whole, and its errors name the file and the flags.
    conv_bits, fc_bits = _bits(bits)
    flags = {
        # --epochs 0 leaves distillation's epochs alone: it trains a new model and needs one
        # or more (a recipe with a student and --epochs 0 is refused below)
        **{
            (section, key, "--epochs"): None if epochs == 0 and section == "distill" else epochs
            for section, key in EPOCH_KEYS
        },
        ("prune", "sparsity", "--sparsity"): _sparsity(sparsity),
        ("quantize", "conv_bits", "--bits"): conv_bits,
        ("quantize", "fc_bits", "--bits"): fc_bits,
        ("guard", "strict", "--strict"): strict,
        ("train", "microbatches", "--microbatches"): microbatches,
        ("budget", "max_drop", "--max-drop"): _max_drop(max_drop),
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
    mine = list(raw)
    for (section, key, flag), value in flags.items():
        if value is not None and isinstance(raw.setdefault(section, {}), dict):
            raw[section][key] = value
            given.append(flag)
    raw = _in_pipeline_order(raw, mine)
    if sparsity is not None and isinstance(raw.get("prune"), dict):
        raw["prune"].pop("quality", None)  # --sparsity replaces a recipe's quality threshold
    if bits is not None and isinstance(raw.get("quantize"), dict):
        # --bits sets every layer, as --sparsity does: a recipe's {layer = bits} table kept
        # the layers it named at its own bits, silently
        raw["quantize"].pop("bits", None)
    source = str(recipe_path) if recipe_path else "recipe"
    given = list(dict.fromkeys(given))
    recipe = recipe_mod.resolve(raw, source=source + (f" with {', '.join(given)}" if given else ""))
    export_flags = [
        f for f in ("--fixed-batch", "--opset", "--target", "--calibration") if f in given
    ]
    if export_flags and not recipe.export.enabled:
        # they ask for files this recipe does not write: the run went on without them, exit 0
        raise click.BadParameter(
            f"{source} turns export off ([export] enabled = false), so no ONNX file is written; "
            f"drop {', '.join(export_flags)} or set enabled = true",
            param_hint=export_flags[0],
        )
    searched = recipe_mod.budget_search(recipe.budget.search, recipe.quantize.method)
    if bits is not None and recipe.budget.max_drop != "off" and searched == "layers":
        # the layer search chooses every layer's bits from budget.bits: --bits was ignored
        # without a word (layers came out at 3, 2 and 8 bits for --bits 4)
        raise click.BadParameter(
            f"{bits}: the --max-drop layer search chooses each layer's bits (from "
            "budget.bits); drop --bits, or search only those bits with budget.bits = "
            f"[{bits}] in a recipe",
            param_hint="--bits",
        )
    if epochs == 0 and recipe.distill.student:
        raise click.BadParameter(
            f"0 with a student to distil ({recipe.distill.student}): distillation trains it; "
            "give 1 or more",
            param_hint="--epochs",
        )
    if dry_run:
        pipeline.check_files(recipe)  # what the run would refuse before any work
        pipeline.check_teachers(model_path, recipe)
        if model_path.exists() and not model_path.is_file():
            raise InputError(f"{model_path}: {checkpoint.not_a_file(model_path)}")
        # With the checkpoint at hand, also what the recipe does to each of its layers.
        # the recipe's student code, imported (to check it) only with the run's consent
        named = recipe.distill.student
        consent = trust_model or ":" not in named or student == named
        layers = _plan(model_path, data, recipe, model, model_kwargs, trust_model, consent)
        if layers is None and not model_path.is_file():
            click.echo(
                f"note: {model_path} does not exist yet: the recipe only, no layer plan", err=True
            )
        elif layers is None:
            made = "distillation's student" if recipe.distill.student else "channel pruning"
            click.echo(
                f"note: the layers Deep Compression prunes come from {made}, during the run: the "
                "recipe only, no layer plan (the recipe's checks were made)",
                err=True,
            )
        if as_json:
            emit_json(
                {"recipe": recipe.to_dict(), **({"plan": layers} if layers is not None else {})}
            )
        else:
            click.echo(recipe_mod.dumps(recipe), nl=False)
            if layers is not None:
                click.echo(render.plan_comment(model_path, layers), nl=False)
        return
    out = out or model_path.with_name(model_path.stem + "-shrunk")
    report = run_shrink(
        model_path,
        data,
        out,
        recipe,
        model,
        model_kwargs,
        quiet,
        force,
        trust_model,
        student,
        resume,
    )
    render.int8_warning(report)
    render.guard_warnings(report)
    render.budget_warnings(report)
    if as_json:
        emit_json(json_view(report))
    else:
        render.shrink_summary(report)


# What --epochs sets: the epochs of every stage that trains.
EPOCH_KEYS = (
    ("distill", "epochs"),
    ("channels", "retrain_epochs"),
    ("prune", "retrain_epochs"),
    ("quantize", "finetune_epochs"),
    ("quantize", "prior_epochs"),
    ("distill", "hint_epochs"),
)


def _in_pipeline_order(raw: dict, mine: list[str]) -> dict:
    """`raw` with the sections only flags added placed where the pipeline runs them, and the
    file's own sections in the file's order (whose order the recipe check judges)."""
    order = list(recipe_mod.DEFAULTS)
    added = sorted((k for k in raw if k not in mine), key=order.index)
    out: dict = {}
    for k in mine:
        while added and order.index(added[0]) < order.index(k):
            first = added.pop(0)
            out[first] = raw[first]
        out[k] = raw[k]
    for k in added:
        out[k] = raw[k]
    return out


def _number_or(text: str | None, words: tuple[str, ...], flag: str, example: str):
    """`text` as a float, or one of `words` as it is (None passes through); else a usage
    error naming `flag` with `example`."""
    if text is None or text in words:
        return text
    try:
        return float(text)
    except ValueError:
        raise click.BadParameter(f"{text!r}: give {example}", param_hint=flag) from None


def _sparsity(text: str | None) -> str | float | None:
    return _number_or(
        text, ("default", "auto"), "--sparsity", "a fraction such as 0.9, 'default' or 'auto'"
    )


def _max_drop(text: str | None) -> str | float | None:
    return _number_or(text, ("off",), "--max-drop", "points such as 0.5, or 'off'")


def _bits(text: str | None) -> tuple[int | None, int | None]:
    if text is None:
        return None, None
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) == 1:
        return values[0], values[0]
    if len(values) == 2:
        return values[0], values[1]
    raise click.BadParameter(
        f"{text!r}: give whole bits N, or CONV,FC such as 8,5", param_hint="--bits"
    )


def _plan(
    model_path: Path,
    data: str | None,
    recipe: recipe_mod.Recipe,
    model: str | None,
    kwargs: str | None,
    trust_model: bool = False,
    student_consent: bool = True,
) -> list[dict] | None:
    """The per-layer plan for --dry-run, or None without a checkpoint to read it from.
    Without `student_consent` the recipe's student (an import path) is neither imported nor
    checked."""
    if not model_path.is_file():
        return None
    ck = checkpoint.load(model_path, train_state=False)
    if trust_model and model is None and ck.spec is not None and ck.spec.is_import_path:
        model = ck.spec.name  # the checkpoint's own code, imported with the user's consent
    named = model or (ck.spec.name if ck.spec is not None else None)
    want = input_name(named, model)
    if data:
        ds = data_mod.load(data, want)
    else:
        ds = data_mod.load_recorded(ck.metadata.get("data"), model_path, want)
    spec = ck.spec_for(model, zoo.parse_kwargs(kwargs), ds.in_shape, ds.num_classes)
    teacher = ck.build_model(spec, allow_import=model == spec.name)
    # What the run checks before any work (the student, its hint layer, channels.ignore, a
    # budget against the validation split): a dry run passed recipes the run then refused.
    if student_consent:
        pipeline.preflight(recipe, ds, teacher)
    else:
        click.echo(
            f"note: distill.student = {recipe.distill.student!r} names code to import; it is "
            f"checked with --student {recipe.distill.student} or --trust-model",
            err=True,
        )
    if recipe.distill.student or recipe.channels.enabled:
        return None  # the layers Deep Compression sees do not exist yet
    return shrink_plan(teacher, recipe, ds.x_train[:2])


JSON_KEYS = (
    "out",  # the folder, absolute: report.json's paths are names in it
    "name",
    "deliverables",
    "guard",
    "baseline",
    "stages",
    "archive",
    "onnx",
    "ort",
    "mobile",
    "mobile_fixed_batch",
    "int8_not_written",
    "ort_not_written",
    "data",
    "teacher",
    "student",
    "hint",
    "transfer",
    "channels",
    "layers",
    "uncovered",
    "budget",
    "files",
    "environment",
    "seconds",
    "memory",
    "resumed",
)


def json_view(report: dict) -> dict:
    """What `--json` prints of the report (report.json keeps everything, the recipe too)."""
    return {k: report[k] for k in JSON_KEYS if k in report}


def run_shrink(
    model_path: Path,
    data: str | None,
    out: Path,
    recipe: recipe_mod.Recipe,
    model: str | None = None,
    model_kwargs: str | None = None,
    quiet: bool = False,
    force: bool = False,
    trust_model: bool = False,
    student: str | None = None,
    resume: bool = False,
) -> dict:
    """`compresskit.shrink` with progress on stderr; return the report. `trust_model`: import
    the code the checkpoint (and the recipe's student) names, as if the user had typed it as
    `model`; `student`: the --student the user typed (consent to import it). A run stopped
    (Ctrl-C) or failed after it kept work says what it kept and how to continue from it."""
    progress = render.TrainProgress(quiet=quiet)
    started = time.time()
    try:
        result = api.shrink(
            model_path,
            data,
            recipe,
            out=out,
            spec=model,
            model_kwargs=zoo.parse_kwargs(model_kwargs),
            force=force,
            trust_model=trust_model,
            progress=progress,
            student_code=student,
            resume=resume,
        )
    except KeyboardInterrupt:
        progress.close()
        raise Interrupted("interrupted" + _kept(out, started)) from None
    except StageError as e:
        disk = isinstance(e, MachineError) and "no space left" in str(e)
        if kept := _kept(out, started, disk):
            raise type(e)(f"{e}{kept}") from e
        raise
    except InputError:
        raise  # bad input, or kept work that cannot be resumed from: its own fix, not --resume
    except Exception as e:  # not foreseen: the kept work still stands
        if kept := _kept(out, started, fileio.machine_failure(e) is not None):
            e.add_note(kept)
        raise
    finally:
        progress.close()
    return {"out": str(result.out), **result.report}


def _kept(out: Path, since: float, disk: bool = False) -> str:
    """'; kept: WHAT (...)' when this run kept (or resumed from) work that a rerun with
    --resume continues from; with `disk` (the machine's failure), also the room it takes."""
    what = resume_mod.describe(out, since)
    if not what:
        return ""
    room = ""
    if disk:  # on a full disk, the kept work may be what leaves the run too little room
        room = f"; it takes {resume_mod.kept_bytes(out):,} bytes in {resume_mod.folder_for(out)}"
    return f"; kept: {what} (add --resume to continue from there{room})"


@click.command(
    epilog="""\b
Example:
  compress decode lenet300-shrunk/model.dcz --out lenet300-decoded.pt
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
    help="Also import the pkg.module:Class the archive names (your own model) and check the "
    "tensors build it; without it, the tensors are decoded and the code is not imported.",
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
@click.option("--force", is_flag=True, help="Replace --out if it exists.")
@json_option
@log_option
def decode(
    archive_path: Path,
    out: Path | None,
    model: str | None,
    max_elements: int | None,
    sha256: str | None,
    force: bool,
    as_json: bool,
) -> None:
    """Rebuild a .pt checkpoint from a .dcz archive, bit for bit.

    The archive is checked before anything is built: a damaged or crafted file is refused with
    exit 2. Its CRC32 catches damage, not tampering: pass --expect with the SHA-256 from
    report.json (sent over a channel you trust) to know it is the archive that was written.
    """
    result = pipeline.decode_to_checkpoint(
        archive_path, out, allow_import=model, max_elements=max_elements, sha256=sha256, force=force
    )
    if as_json:
        emit_json(result)
    else:
        click.echo(
            f"decoded {result['archive']} ({result['archive_bytes']:,} bytes) -> "
            f"{result['checkpoint']}: {result['model']}, {result['parameters']:,} parameters"
            + (
                ""
                if result["rebuilt"]
                else " (tensors only: its model is a class of a script or notebook)"
                if str(result["model"]).startswith("__main__:")
                else f" (tensors only: pass --model {result['model']} to check they build it)"
            )
        )
