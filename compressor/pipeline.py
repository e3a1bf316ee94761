"""`compress shrink` and `compress decode` as library calls that write their output folder
or file whole: everything is built in a temporary folder beside `--out` and moved into place
at the end, so a failed or interrupted run leaves nothing half-written."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from compresskit import _datapass, _mem
from compresskit.compressor import archive, budget, channels, distill, export, guard, prune
from compresskit.compressor import report as report_mod
from compresskit.compressor import resume as resume_mod
from compresskit.compressor import shrink as shrink_mod
from compresskit.compressor.export import checks, compat, int8, mobile, protos
from compresskit.compressor.measure import envinfo, layertime, speedup
from compresskit.compressor.recipe import ExportSection, Recipe
from compresskit.models import checkpoint, zoo
from compresskit.models.base import batch_statistics
from compresskit.models.data import Dataset, check_kind, embedding_rows, npz_layout
from compresskit.models.errors import InputError, MachineError, StageError, one_line
from compresskit.models.fileio import (
    atomic_path,
    check_folder_writable,
    check_writable,
    hidden,
    machine_failure,
    output_lock,
    refuse_link,
    same_file,
    signals_deferred,
    umask,
    utf8_path,
)
from compresskit.models.zoo import ModelSpec, build, state_shapes

TAYLOR_SAMPLES = 256  # training samples whose gradients rank channels (Taylor importance)
CHECK_SAMPLES = 1000  # validation inputs the INT8 agreement floor is checked on
# Outputs are named for what they hold: MODEL.* compressed from the checkpoint's own model,
# student.* when distillation made a new one (see `stem`).
STEMS = ("model", "student")
MODEL_FILES = (
    "fp32.onnx",
    "int8.onnx",
    "int8.ort",
    "int8.required_operators.config",
    "int8.fixed.onnx",
    # where no INT8 compute is worth shipping, the mobile files are made from the FP32 graph
    "fp32.ort",
    "fp32.required_operators.config",
    "fp32.fixed.onnx",
    "dcz",
    "pt",
)
OUTPUTS = (
    *(f"{stem}.{f}" for stem in STEMS for f in MODEL_FILES),
    "report.json",
    "report.md",
    "weights_histogram.png",
    "kept_per_layer.png",
    "channels_per_layer.png",
)


def stem(recipe: Recipe) -> str:
    """The outputs' name: "student" when the recipe distils into a new model, else "model"."""
    return "student" if recipe.distill.student else "model"


class _Clock:
    """Seconds per pipeline step, and the seconds spent in training loops (every retrain call,
    whichever stage made it): the report's `timings`, from which a user sees what a run cost
    beyond the epochs its recipe asks for. Of the non-training seconds, `data_passes` were spent
    running the model over data (evaluation, calibration, INT8 checks and timing, parity:
    `compresskit._datapass`), which costs the model's FLOPs per sample as an epoch does; the
    rest, `per_weight`, is what k-means, the archive, export and the quantizer's rewrites cost."""

    def __init__(self, info) -> None:
        self.info = info
        self.steps: dict[str, float] = {}
        self.training = 0.0
        self.passes_in_training = 0.0  # data passes a training loop made (its test evaluation)
        self.started = time.perf_counter()
        self.passes_at_start = _datapass.seconds()

    @contextlib.contextmanager
    def step(self, name: str, what: str = ""):
        if what:
            self.info(what)
        t = time.perf_counter()
        try:
            yield
        finally:
            _mem.trim()  # what the step freed goes back to the OS (compresskit._mem)
            self.steps[name] = self.steps.get(name, 0.0) + time.perf_counter() - t

    def timed_retrain(self, hooks: shrink_mod.Hooks) -> shrink_mod.Hooks:
        retrain = hooks.retrain

        def timed(*args, **kwargs):
            t, passes = time.perf_counter(), _datapass.seconds()
            try:
                return retrain(*args, **kwargs)
            finally:
                self.training += time.perf_counter() - t
                self.passes_in_training += _datapass.seconds() - passes

        return dataclasses.replace(hooks, retrain=timed)

    def record(self) -> dict[str, float]:
        total = time.perf_counter() - self.started
        passes = _datapass.seconds() - self.passes_at_start - self.passes_in_training
        return {
            **{k: round(v, 3) for k, v in self.steps.items()},
            "training": round(self.training, 3),
            "non_training": round(total - self.training, 3),
            "data_passes": round(passes, 3),
            "per_weight": round(total - self.training - passes, 3),
            "total": round(total, 3),
        }


def _guard_now(report: dict[str, Any], recipe: Recipe, out: Path, info) -> None:
    """The stages' guardrails as soon as the stages are done, before export and the INT8 step
    (a minute or more on a big model): a strict run stops here, nothing written; another says
    so now, so its user can stop a run they will not ship (the summary says it again)."""
    cfg = guard.GuardConfig.from_recipe(recipe.guard)
    found = guard.findings(report, cfg)
    if cfg.strict and found:
        raise _strict(found, out)
    for f in found:
        info(f"guard: {f['message']} (found before export; the run goes on)")


def _student_size_now(
    teacher: nn.Module, name: str, recipe: Recipe, data: Dataset, out: Path, info
) -> None:
    """A student bigger than its teacher, said before distillation trains it (a --strict run
    stopped only after every stage). An ensemble is summed from its checkpoints' recorded
    parameter counts (bare weights: the first teacher's model); without them, distillation
    says it once every member is built."""
    first = sum(p.numel() for p in teacher.parameters())
    total, teachers = first, name
    for path in recipe.distill.teachers:
        ck = checkpoint.load(path, train_state=False)
        recorded = ck.metadata.get("parameters") if ck.spec is not None else first
        if type(recorded) is not int or recorded < 1:
            return
        total += recorded
    if recipe.distill.teachers:
        teachers = f"ensemble ({name} + {len(recipe.distill.teachers)} more)"
    count = sum(p.numel() for p in _student(recipe, data).parameters())
    found = guard.student_size(
        {"name": recipe.distill.student, "parameters": count},
        {"name": teachers, "parameters": total},
    )
    if found is None:
        return
    if guard.GuardConfig.from_recipe(recipe.guard).strict:
        raise _strict([found], out)
    info(f"guard: {found['message']} (found before distillation; the run goes on)")


def _strict(found: list[dict[str, Any]], out: Path) -> StageError:
    """--strict's failure: the first guardrail crossed, and how many more."""
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return StageError(f"guardrail: {found[0]['message']}{more}; --strict: nothing written to {out}")


def check_out_dir(out: Path, force: bool = False, inputs: Sequence[Path] = ()) -> Path:
    """--out must be a folder we can create or fill; fail before any work. A folder that
    already holds outputs of an earlier run is refused unless `force` (they would be replaced).
    A file there that is one of the run's `inputs` (the user's checkpoint saved as model.pt) is
    refused even with `force`: replacing it would lose the user's weights."""
    refuse_link(out, "--out")
    utf8_path(out, "--out")
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out}: exists and is not a folder; give a folder path")
    if out.parent.exists() and not out.parent.is_dir():
        raise InputError(f"--out {out}: {out.parent} is a file, not a folder; give a folder path")
    if not out.parent.is_dir():
        raise InputError(f"--out {out}: folder {out.parent} does not exist; create it first")
    check_folder_writable(out.parent, f"--out {out}")
    if out.is_dir():  # we replace our files inside it: each must be replaceable
        check_folder_writable(out, f"--out {out}")
        for name in OUTPUTS:
            refuse_link(out / name, f"--out {out}:")
            if (out / name).exists() and not (out / name).is_file():
                raise InputError(f"--out {out}: {name} there is not a regular file; remove it")
        held = [name for name in OUTPUTS if (out / name).is_file()]
        for name in held:
            if any(same_file(out / name, p) for p in inputs):
                raise InputError(
                    f"--out {out}: {name} there is this run's input, and the run writes its "
                    f"own {name}; give another --out folder (or move the input)"
                )
        if held and not force:
            recorded = recorded_outputs(out)
            foreign = [name for name in held if name not in recorded]

            def listed(names: list[str]) -> str:
                return f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"

            if not foreign:
                raise InputError(
                    f"--out {out}: already holds an earlier run's outputs ({listed(held)}); "
                    "pass --force (force=True) to replace them, or give another folder"
                )
            raise InputError(
                f"--out {out}: holds files named as compress's outputs that no earlier run "
                f"there lists ({listed(foreign)}); pass --force (force=True) to replace those "
                "this run writes, or give another folder"
            )
    return out


def _seeded(fn):
    """`fn(model, spec, recipe, ...)` run on a forked torch generator seeded from
    `recipe.train.seed`. Dropout draws from the global generator: seeded, a rerun gives the
    same model (BERT, MobileNetV2 and EfficientNet-B0 came out different on every run), and
    the caller's generator state is put back afterwards."""

    @functools.wraps(fn)
    def run(model, spec, recipe, *args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(recipe.train.seed)
            return fn(model, spec, recipe, *args, **kwargs)

    return run


def shrink_to_folder(
    model: nn.Module,
    spec: ModelSpec,
    recipe: Recipe,
    hooks: shrink_mod.Hooks,
    out: Path,
    metadata: dict[str, Any],
    data: Dataset | None = None,
    force: bool = False,
    resume: bool = False,
) -> dict[str, Any]:
    """Run the pipeline and write NAME.dcz, NAME.pt, the ONNX files, report.json/.md and plots
    into `out` (NAME: `stem(recipe)`). `force` replaces an earlier run's outputs there.

    The finished work (each pruning round, the compressed model) is kept beside `out` until
    the run succeeds; `resume` continues from it (`compressor.resume`).

    The guardrails (`compressor.guard`) are checked on the finished report: their findings go
    in `report["guard"]`, and under `guard.strict` any finding fails the run (StageError)
    before anything is written. A second run into the same `out` while this one goes is
    refused (InputError), before its checks."""
    with output_lock(out) as locked:  # unlocked where --out's folder cannot hold the lock
        return _shrink_to_folder(
            model, spec, recipe, hooks, out, metadata, data, force, locked, resume
        )


@_seeded
def _shrink_to_folder(
    model: nn.Module,
    spec: ModelSpec,
    recipe: Recipe,
    hooks: shrink_mod.Hooks,
    out: Path,
    metadata: dict[str, Any],
    data: Dataset | None,
    force: bool,
    locked: bool,
    resume: bool,
) -> dict[str, Any]:
    check_out_dir(out, force)  # under the lock: no other run writes there meanwhile
    name = stem(recipe)
    clock = _Clock(hooks.info)
    hooks = clock.timed_retrain(hooks)
    calib = preflight(recipe, data, model)
    if recipe.export.enabled and data is not None:
        _probe_opset(model, recipe, data)
    marks = _marks(out, model, spec, data, metadata, recipe, resume, hooks.info)
    _remove_abandoned(out, locked)
    tmp = Path(tempfile.mkdtemp(prefix=f"{hidden(out.name)}.{_owner()}.", dir=out.parent))
    os.chmod(tmp, 0o777 & ~umask())
    try:
        distilled = None
        teacher_name = spec.name
        if recipe.distill.student:
            if data is None:
                raise InputError("distillation needs the data set")
            with clock.step("distill"):
                if (kept := marks.latest("student")) is not None:
                    expected = distill.student_spec(
                        recipe.distill, data, distill.teacher_classes(model, data)
                    )
                    model, spec, distilled, train_on = resume_mod.restore_student(
                        kept, data, marks, expected
                    )
                    clock.info(f"resumed after distillation (kept in {marks.folder})")
                else:
                    _student_size_now(model, teacher_name, recipe, data, out, clock.info)
                    model, spec, distilled, train_on = distill.distill_student(
                        model,
                        recipe.distill,
                        data,
                        hooks.retrain,
                        hooks.test_accuracy,
                        seed=recipe.train.seed,
                        teacher_spec=spec,
                        trusts=hooks.trusts,
                    )
                    marks.save(
                        "student",
                        f"the distilled student ({spec.name})",
                        resume_mod.student_payload(model, spec, distilled, train_on, data),
                        hooks.training(),
                    )
            if train_on is not data:
                hooks = _keep_to(hooks, train_on)
        thinned = unthinned = None
        if recipe.channels.enabled:
            if data is None:
                raise InputError("channel pruning needs the data set")
            if recipe.channels.latency and recipe.export.enabled:
                unthinned = copy.deepcopy(model).eval()  # timed against the thinned files
            if (kept := marks.latest("channels")) is not None:
                model, spec, thinned = resume_mod.restore_channels(kept, marks, spec)
                clock.info(f"resumed after channel pruning (kept in {marks.folder})")
            else:
                with clock.step("channels", "channels: removing whole channels"):
                    spec, thinned = _thin(model, spec, recipe, data, hooks, tmp, calib)
                marks.save(
                    "channels",
                    "channel pruning",
                    resume_mod.channels_payload(model, spec, thinned),
                    hooks.training(),
                )
        with clock.step("deep_compression"):
            kept = marks.latest("compressed")
            if kept is not None:
                report = resume_mod.restore_compressed_(model, kept, marks, tmp / f"{name}.dcz")
                clock.info(f"resumed after Deep Compression (kept in {marks.folder})")
            else:
                args = (spec.to_dict(), recipe, hooks, tmp, metadata)
                if recipe.budget.max_drop != "off":
                    model, report = budget.search(
                        model, *args, archive_name=f"{name}.dcz", marks=marks
                    )
                else:
                    report = shrink_mod.shrink(
                        model, *args, archive_name=f"{name}.dcz", marks=marks
                    )
            if kept is None:
                marks.save(
                    "compressed",
                    "Deep Compression (pruning, weight sharing, Huffman)",
                    resume_mod.compressed_payload(model, report, tmp / f"{name}.dcz"),
                    hooks.training(),
                )
        _explain_archive(report)
        if tied := prune.tied_weights(model):  # left dense: see prune.tied_weights
            report["tied"] = tied
        embeddings = recipe.prune.embeddings or recipe.quantize.embeddings
        if uncovered := prune.uncovered_weights(model, embeddings):
            report["uncovered"] = uncovered
        if data is not None:
            report["data"] = {
                "spec": data.spec,
                "train": len(data.y_train),
                "val": len(data.y_val),
                "test": len(data.y_test),
                "decisions": data.split_note,
            }
        if thinned is not None:
            report["channels"] = thinned
            if "archive" in report:  # against the model the user brought, not the thinned one
                original = 4 * thinned["parameters"][0]
                thinned["archive_ratio_vs_original"] = original / report["archive"]["bytes"]
        final_acc = (
            report["stages"][-1]["test_accuracy"]
            if report["stages"]
            else report["baseline"]["test_accuracy"]
        )
        _teacher_student(report, distilled, teacher_name, spec.name, model, final_acc)
        _guard_now(report, recipe, out, clock.info)
        if recipe.export.enabled:
            if data is None:
                raise InputError("export needs the data set (calibration and parity)")
            report["onnx"] = _export(
                model, recipe.export, report, data, calib, tmp, out, clock, name
            )
            if unthinned is not None and thinned is not None:
                what = "channels: timing the unthinned and thinned files (ORT CPU, 1 thread)"
                with clock.step("channels_latency", what):
                    thinned["latency"] = _channel_latency(
                        unthinned, recipe.export, report, data, calib, tmp, name
                    )
                del unthinned
            # What an app ships: the INT8 file, or the FP32 one where no INT8 file is written.
            kind = "int8" if "int8" in report["onnx"] else "fp32"
            shipped = tmp / f"{name}.{kind}.onnx"
            if recipe.export.ort:
                with clock.step("ort", f"mobile: writing {name}.{kind}.ort, checking NNAPI/CoreML"):
                    try:
                        ort_file = mobile.to_ort(shipped, tmp / f"{name}.{kind}.ort")
                    except StageError as e:
                        if isinstance(e, MachineError) or machine_failure(e.__cause__ or e):
                            raise  # a full disk, or memory while checking it: the machine's
                        # The archive and the ONNX files stand: a conversion ORT's tool fails
                        # (or that answers differently) costs the .ort, not the whole run that
                        # made them. --strict fails on it (guard's "ort" finding).
                        report["ort_not_written"] = {"reason": one_line(e)}
                    else:
                        report["ort"] = {
                            **ort_file,
                            "path": f"{name}.{kind}.ort",
                            "config": Path(ort_file["config"]).name,
                        }
                    report["mobile"] = mobile.usability(shipped)
            n = recipe.export.fixed_batch
            if n:
                fixed = mobile.fixed_batch(shipped, tmp / f"{name}.{kind}.fixed.onnx", n)
                report["mobile_fixed_batch"] = {
                    "path": fixed.name,
                    "batch": n,
                    "bytes": fixed.stat().st_size,
                    **compat.describe(_load(fixed)),
                    **mobile.usability(fixed),
                }
        # Save through a freshly built model so the checkpoint's keys are in the order a plain
        # model has (removing parametrizations re-registers weights last).
        plain = build(spec)
        plain.load_state_dict(model.state_dict())
        checkpoint.save(
            tmp / f"{name}.pt",
            plain,
            spec,
            {**metadata, "test_accuracy": final_acc, "compressed": True},
        )
        if "archive" in report:
            report["archive"]["path"] = f"{name}.dcz"
        report["name"] = name
        if trained := marks.trained(hooks.training()):
            report["training"] = trained
        if marks.resumed:  # the furthest point it continued from
            report["resumed"] = {"from": marks.resumed[-1], "marks": str(marks.folder)}
        report["deliverables"] = deliverables(report)
        cfg = guard.GuardConfig.from_recipe(recipe.guard)
        report["guard"] = {"max_stage_drop": cfg.max_stage_drop, "strict": cfg.strict}
        report["guard"]["findings"] = guard.findings(report, cfg)
        if cfg.strict and report["guard"]["findings"]:
            raise _strict(report["guard"]["findings"], out)
        with clock.step("report"):
            report_mod.plots(report, tmp)
        report["timings"] = clock.record()
        report["memory"] = {"peak_rss_bytes": _mem.peak_rss()}
        # What the bytes may depend on: retraining's float sums follow the torch thread count
        # (a one-core container writes other bits), and --target host times this CPU.
        report["environment"] = envinfo.environment()
        # Paths in the report are names in its folder: they hold wherever the folder goes.
        written = {p.name for p in tmp.iterdir() if p.name in OUTPUTS}
        report["files"] = sorted(written | {"report.json", "report.md"})
        with atomic_path(tmp / "report.json") as f:
            f.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        with atomic_path(tmp / "report.md") as f:
            f.write_text(
                report_mod.markdown(report, f"compress shrink: {spec.name}"), encoding="utf-8"
            )
        # A Ctrl-C here waits until the outputs are in place and the kept work is gone: it
        # arrived between them once and offered a --resume that the whole folder then refused.
        with signals_deferred():
            _move_into(tmp, out)
            marks.finish()  # the outputs are in place: nothing left to resume
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def _marks(out, model, spec, data, metadata, recipe, resume, info) -> resume_mod.Marks:
    """The run's marks; on --resume with none to use, says it starts from the beginning."""
    marks = resume_mod.Marks.open(out, model, spec.to_dict(), data, metadata, recipe, resume, info)
    if resume and not marks.readable():  # else each stage it skips says so
        info(f"nothing to resume for {out} ({marks.why_none()}): starting from the beginning")
    return marks


# A protobuf message, and so an ONNX file without external data, holds at most 2 GiB; the
# graph's own bytes and float32 constants beside the weights come on top.
ONNX_MAX_WEIGHT_BYTES = (2 << 30) - (64 << 20)


def _check_onnx_size(model: nn.Module) -> None:
    """A model whose FP32 weights do not fit one ONNX file fails before any work: a 559M-weight
    MLP failed in onnx.save ("EncodeError: Failed to serialize proto") after the whole run."""
    fp32 = 4 * sum(p.numel() for p in model.parameters() if p.is_floating_point())
    if fp32 > ONNX_MAX_WEIGHT_BYTES:
        raise InputError(
            f"the model's FP32 weights take {fp32 / 2**30:.2f} GiB, more than one ONNX file "
            "holds (2 GiB; larger ones need external data, which compress does not write "
            "yet): set [export] enabled = false for the archive and model.pt alone"
        )


def preflight(
    recipe: Recipe, data: Dataset | None, model: nn.Module | None = None
) -> np.ndarray | None:
    """Checks that would otherwise fail late, after minutes of training: the opset this ONNX
    Runtime runs, the calibration file's shape and dtype (int64 token ids within the model's
    vocabulary for a text model), a synthetic transfer set on token ids, a student for the
    other kind of input, the ensemble's checkpoints. Returns the calibration inputs when the
    recipe names a file."""
    e = recipe.export
    calib = None
    max_drop = recipe.budget.max_drop
    if max_drop != "off":
        if data is None:
            raise InputError("--max-drop needs the data set (a validation split)")
        if not data.has_val:
            raise InputError(f"--max-drop needs a validation split: {data.split_note}")
        budget.check_validation(max_drop, len(data.y_val), data.spec)
        if model is not None and not recipe.distill.student:
            budget.check(model, recipe)
    retrained = model  # the model retraining and channel pruning will see: the student's
    if data is not None:
        distill.check_transfer(recipe.distill, data)
        if recipe.distill.student:
            check_kind(recipe.distill.student, data, "distill.student")
            # built once, its kwargs against the data and its hint layer, before the teacher's
            # baseline (and by --dry-run: a kwarg the model's constructor refuses passed it)
            retrained = _student(recipe, data)
            if model is not None:
                distill.check_hints(recipe.distill, retrained, model, data.x_train[:2])
    _check_microbatches(recipe, retrained)
    if recipe.channels.enabled and recipe.channels.ignore and retrained is not None:
        channels.check_ignore(retrained, recipe.channels.ignore)
    if e.enabled:
        export.check_runtime_opset(e.opset, e.ir_version or None)
        if model is not None and not recipe.distill.student and not recipe.channels.enabled:
            _check_onnx_size(model)  # a student or a thinned model: checked before export
        if e.calibration_data:
            flag = "--calibration / export.calibration_data"
            tokens = data is not None and data.is_tokens
            calib = export.load_calibration(Path(e.calibration_data), flag, tokens)
            if data is not None and not tokens:
                calib = _as_npz_layout(calib, tuple(data.in_shape))
            if data is not None and tuple(calib.shape[1:]) != tuple(data.in_shape):
                raise InputError(
                    f"{flag} {e.calibration_data}: inputs of shape "
                    f"{tuple(calib.shape[1:])}, the model takes {tuple(data.in_shape)}; "
                    "give samples shaped like the training data"
                )
            # The exported model is the student when distilling: its vocabulary is not known yet.
            rows = embedding_rows(model) if model is not None and tokens else None
            if rows is not None and not recipe.distill.student and calib.max() >= rows:
                raise InputError(
                    f"{flag} {e.calibration_data}: token ids reach {calib.max()}, the model "
                    f"embeds {rows} ids (0..{rows - 1}); give ids the model was trained on"
                )
    check_files(recipe)
    return calib


def check_teachers(checkpoint_path: Path | None, recipe: Recipe) -> None:
    """Each teacher once: the checkpoint itself as a --teacher, or one file by two paths,
    doubled that model's weight in the soft targets (and an ensemble of one model was
    reported as two)."""
    seen: dict[str, str] = {}
    named = ([str(checkpoint_path)] if checkpoint_path is not None else []) + list(
        recipe.distill.teachers
    )
    for given in named:
        key = os.path.realpath(given)
        if key in seen:
            first = seen[key]
            what = "the checkpoint being shrunk" if first == str(checkpoint_path) else first
            raise InputError(
                f"--teacher / distill.teachers {given}: the same file as {what}; give each "
                "teacher once (a repeat would double its weight in the soft targets)"
            )
        seen[key] = given


def check_files(recipe: Recipe) -> None:
    """The files a recipe names, checked before any work and by --dry-run (which passed a
    recipe whose run then refused it): the teachers are checkpoints that hold no code, the
    calibration file exists (its contents are checked against the data by `preflight`)."""
    e = recipe.export
    if e.enabled and e.calibration_data and not Path(e.calibration_data).is_file():
        what = "a folder" if Path(e.calibration_data).is_dir() else "no such file"
        raise InputError(
            f"--calibration / export.calibration_data {e.calibration_data}: {what}; give a "
            ".npy array of inputs"
        )
    for path in recipe.distill.teachers:
        try:  # exists, is a checkpoint, holds no code; shapes are checked later
            checkpoint.load(path, train_state=False)
        except InputError as err:
            raise InputError(f"--teacher / distill.teachers: {err}") from None


def _check_microbatches(recipe: Recipe, model: nn.Module | None) -> None:
    """train.microbatches > 1 splits every retraining batch: refused now, not after the
    baseline, for the model that retrains (`model`: the student when distilling) if it has
    BatchNorm."""
    m = recipe.train.microbatches
    if m in (1, "auto"):  # auto keeps a BatchNorm model's batch whole
        return
    bn = batch_statistics(model) if model is not None else None
    if bn is not None:
        raise InputError(
            f"recipe train.microbatches = {m}: layer {bn!r} normalises over the batch "
            "(BatchNorm), so micro-batches would retrain another model; set it to 1"
        )


def _probe_opset(model: nn.Module, recipe: Recipe, data: Dataset) -> None:
    """An opset the exporter cannot write for this model is refused now, not after training.
    Opset 18 is the exporter's own: nothing to convert, nothing to probe."""
    e = recipe.export
    if e.opset == 18:
        return
    if recipe.distill.student:  # the model that will be exported is the student, not the teacher
        model = _student(recipe, data)
    export.probe_opset(model, data.x_train[:2], export_config(e))


def _student(recipe: Recipe, data: Dataset) -> nn.Module:
    """The recipe's distillation student as built before training (for checks made up front)."""
    return zoo.build(distill.student_spec(recipe.distill, data, data.num_classes), seed=0)


def _thin(
    model: nn.Module,
    spec: ModelSpec,
    recipe: Recipe,
    data: Dataset,
    hooks: shrink_mod.Hooks,
    tmp: Path,
    calib: np.ndarray | None,
) -> tuple[ModelSpec, dict[str, Any]]:
    """The channels stage: cut `model` in place; the spec gains the replayable plan."""
    cfg = channels.ChannelsConfig.from_recipe(recipe.channels)
    t = recipe.train
    retrain = hooks.retrain
    if t.distill > 0:  # retrain against the unthinned model's soft targets
        loss = distill.loss_with_teacher(copy.deepcopy(model), t.temperature, t.distill)

        def retrain(m, epochs, lr):
            hooks.retrain(m, epochs, lr, loss)

    x, y = data.x_train, data.y_train

    def gradients(m: nn.Module) -> None:
        # Taylor importance: |w x dL/dw| summed over a few training batches, BatchNorm
        # statistics left alone (eval mode).
        was = m.training
        m.eval()
        try:
            for i in range(0, min(len(y), TAYLOR_SAMPLES), 64):
                nn.functional.cross_entropy(m(x[i : i + 64]), y[i : i + 64]).backward()
        finally:
            m.train(was)

    layer_times = None
    if cfg.target_latency is not None:
        # Profiled as INT8 when the export writes an INT8 file, else as FP32.
        e = recipe.export
        quant = quant_config(e) if e.enabled and e.int8 else None
        calib_x = _calibration(quant, data, calib) if quant else None

        def layer_times(m: nn.Module) -> layertime.LayerTimes:
            try:
                return layertime.measure(m, x[:2], tmp, export_config(e), quant, calib_x)
            except Exception as err:  # its messages name our temporary files, not the user's
                raise StageError(
                    f"channels.target_latency: the model could not be profiled on ONNX Runtime "
                    f"({one_line(err)}); leave target_latency unset"
                ) from None

    before = hooks.test_accuracy(model)
    record = channels.thin_(
        model,
        x[:2],
        cfg,
        retrain=retrain,
        gradients=gradients,
        info=hooks.info,
        evaluate=hooks.val_accuracy,
        layer_times=layer_times,
    )
    record["test_accuracy"] = [before, hooks.test_accuracy(model)]
    # The plan must rebuild this very shape from the spec: checked here, not at decode time.
    spec = dataclasses.replace(spec, thinned=record["plan"])
    rebuilt = build(spec)
    got = {k: tuple(v.shape) for k, v in rebuilt.state_dict().items()}
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if got != want:
        raise StageError("channels: the recorded plan does not rebuild the thinned model")
    return spec, record


def _keep_to(hooks: shrink_mod.Hooks, train_on: Dataset) -> shrink_mod.Hooks:
    """Hooks whose retraining and validation use the transfer set (its kept labels and the
    teacher's), not the full labelled training and validation sets."""
    retrain = hooks.retrain
    x_val, y_val = train_on.decision_split()

    def retrain_on(m, epochs, lr, loss_fn=None, data=None):
        retrain(m, epochs, lr, loss_fn, data if data is not None else train_on)

    def val_accuracy(m: nn.Module) -> float:
        was = m.training
        with torch.no_grad():
            acc = float((m.eval()(x_val).argmax(1) == y_val).float().mean())
        m.train(was)
        return acc

    return dataclasses.replace(
        hooks,
        retrain=retrain_on,
        val_accuracy=val_accuracy,
        val_data=(x_val, y_val),
        train_samples=len(train_on.y_train),
    )


def _teacher_student(report, distilled, teacher_name, student_name, model, final_acc) -> None:
    """The `teacher` and `student` records: who taught, and what ships (after compression)."""
    base = report["baseline"]
    if distilled:
        report["teacher"] = {"name": teacher_name, **distilled["teacher"]}
        dense_acc = distilled["student"]["test_accuracy"]
        if "channels" in report:  # Deep Compression starts from the thinned student
            dense_acc = report["channels"]["test_accuracy"][1]
    else:  # no distillation: the checkpoint is both the reference and what gets compressed
        report["teacher"] = {
            "name": teacher_name,
            "parameters": base["parameters"],
            "test_accuracy": base["test_accuracy"],
            "members": 1,
        }
        dense_acc = base["test_accuracy"]
    report["student"] = {
        "name": student_name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "nonzero_parameters": int(sum((p != 0).sum().item() for p in model.parameters())),
        "test_accuracy": final_acc,  # of student.pt, after Deep Compression
        "dense_test_accuracy": dense_acc,  # before it (after distillation, when distilled)
        "distilled": bool(distilled),
    }
    if distilled:
        # the student as distillation left it (channel pruning may thin it after)
        report["student"]["distilled_parameters"] = distilled["student"]["parameters"]
        report["student"]["distilled_test_accuracy"] = distilled["student"]["test_accuracy"]
        report.update({k: distilled[k] for k in ("hint", "transfer") if k in distilled})
        report["student"].update(
            {k: v for k, v in distilled["student"].items() if k not in report["student"]}
        )


def _explain_archive(report: dict[str, Any]) -> None:
    """An archive larger than its own P+Q figure (fixed-width codes, no tables) says why: on a
    small model, what the file holds besides its coded streams (header, codebooks, code
    tables, dense tensors, framing) outweighs what Huffman coding saves."""
    a = report.get("archive")
    pq = next((st.get("bytes") for st in report["stages"] if st["name"] == "quantize"), None)
    if a and pq and a["bytes"] > pq:
        a["over_pq"] = {"pq_bytes": pq, "fixed_bytes": a["bytes"] - a["stream_bytes"]}


def _as_npz_layout(calib: np.ndarray, want: tuple[int, ...]) -> np.ndarray:
    """Calibration inputs laid out as an npz's `x` is (`models.data.npz_layout`), where that
    gives the model's input shape. A file cut from the npz's own `x` was refused as "inputs of
    shape (1, 8000), the model takes (1, 1, 8000)"."""
    laid = npz_layout(calib)
    return laid if tuple(laid.shape[1:]) == want else calib


def deliverables(report: dict[str, Any]) -> dict[str, Any]:
    """Each file an app or a user ships, with its bytes against the dense FP32 weights of the
    model compressed (`baseline.bytes`), and which of them a runtime runs: the INT8 file, else
    the FP32 one (the archive is storage, decoded back to a checkpoint, not run)."""
    dense = report["baseline"]["bytes"]
    files = []

    def add(kind: str, record: dict[str, Any] | None) -> None:
        if record and "bytes" in record:
            b = record["bytes"]
            files.append({"kind": kind, "path": record["path"], "bytes": b, "ratio": dense / b})

    add("archive", report.get("archive"))
    onnx = report.get("onnx", {})
    add("fp32 onnx", onnx.get("fp32"))
    add("int8 onnx", onnx.get("int8"))
    add("ort", report.get("ort"))
    add("fixed-batch onnx", report.get("mobile_fixed_batch"))
    int8, fp32 = onnx.get("int8"), onnx.get("fp32")
    # The INT8 file, unless it outweighs the FP32 one: in a model of a few thousand weights
    # the scales, zero points and Q/DQ nodes cost more than int8 weights save (a 1.5k-weight
    # KWS student: 14,307 B against 13,101), and the mobile target times nothing to say it
    # runs faster.
    bigger = bool(int8 and fp32 and int8["bytes"] > fp32["bytes"])
    runs = fp32 if bigger else int8 or fp32
    out = {
        "dense_fp32_bytes": dense,
        "files": files,
        # file names in the output folder (paths are in `files`)
        "ship": Path(runs["path"]).name if runs else None,
        "ship_mobile": Path(report["ort"]["path"]).name if "ort" in report else None,
    }
    if bigger:
        out["ship_why"] = (
            f"{Path(int8['path']).name} ({int8['bytes']:,} B) outweighs "
            f"{Path(fp32['path']).name} ({fp32['bytes']:,} B): its scales and Q/DQ nodes cost "
            "more than 8-bit weights save in a model this small"
        )
    return out


def app_metadata(model: nn.Module, data: Dataset) -> dict[str, str]:
    """What an app must know to use the files, written into their metadata_props: how a raw
    sample becomes the input (the data's scaling) and what the output is. The class count is
    the model's output width: a 10-class model shrunk on 5-class data still answers 10."""
    k = distill.teacher_classes(model, data)  # its output's width, in eval mode
    meta = {
        protos.OUTPUT_KEY: (
            f"logits, one per class 0..{k - 1}: the largest is the prediction; softmax gives "
            "probabilities"
        )
    }
    if k > data.num_classes:
        meta[protos.OUTPUT_KEY] += f" (the data used here has classes 0..{data.num_classes - 1})"
    rows = embedding_rows(model) if data.is_tokens else None
    if rows is not None:  # what an app's tokenizer must keep to: ONNX's Gather checks nothing
        meta[protos.INPUT_KEY] = (
            f"{data.scaling or 'token ids (int64)'}; ids 0..{rows - 1}: the file does not check "
            f"them (a negative id wraps around, -1 reads as {rows - 1}; {rows} or more fails), "
            "so map unknown words to an id the model knows"
        )
    elif data.scaling:
        meta[protos.INPUT_KEY] = data.scaling
    return meta


def _export(
    model,
    e: ExportSection,
    report,
    data: Dataset,
    calib,
    tmp: Path,
    out: Path,
    clock: _Clock,
    name: str,
) -> dict:
    """FP32 ONNX, then INT8 ONNX chosen for `export.target`; parity, invariants and the
    versions read back from each file written."""
    import onnx

    cfg = export_config(e)
    with clock.step("export_fp32", f"export: FP32 ONNX (opset {cfg.opset})"):
        _check_onnx_size(model)
        fp32 = export.export_onnx(
            model, data.x_train[:2], tmp / f"{name}.fp32.onnx", cfg, app_metadata(model, data)
        )
    bits = {r["layer"]: r["weight_bits"] for r in report["layers"] if r.get("codebook")}
    fp32_names: dict[str, tuple[str, bool]] = {}  # key -> (the FP32 file's initializer, transposed)

    # The PyTorch logits every parity figure is measured against: one forward pass.
    torch_ref = export.torch_logits(model, data.x_test)

    # Each file's outputs on the test set, per ORT optimization setting, computed once: an INT8
    # graph with optimizations off runs every Q/DQ pair unfused (ViT-tiny: ~20 s a pass).
    runs: dict[tuple[str, bool], np.ndarray] = {}
    batches: dict[str, int] = {}

    def outputs(path: Path, optimized: bool) -> np.ndarray:
        key = (str(path), optimized)
        if key not in runs:
            # Samples per run sized to the graph's activations, as the INT8 checks are:
            # ViT-tiny's runs over the test set held 130-207 MiB over their start at 64
            # samples a run, 43-80 MiB at the 4 this gives, in about the same time.
            if str(path) not in batches:
                batches[str(path)] = checks.activation_batch(
                    onnx.load(str(path)), cap=64, sample=tuple(data.x_test.shape[1:])
                )
            batch = batches[str(path)]
            runs[key] = checks.outputs(checks.session(path, optimized), data.x_test.numpy(), batch)
        return runs[key]

    def parity(path: Path, optimized: bool = True) -> dict[str, float]:
        got = outputs(path, optimized)
        return export.parity(model, path, data.x_test, data.y_test, optimized, torch_ref, got)

    def int8_vs_fp32(path: Path, optimized: bool) -> dict[str, float]:
        a, b = outputs(fp32, optimized), outputs(path, optimized)
        return {
            "top1_agreement_fp32": export.agreement(b, a),
            "max_abs_diff_fp32": float(np.abs(a - b).max()),
        }

    def describe(path: Path, optimized: bool = True) -> dict[str, Any]:
        checks = export.weight_invariants(path, model, bits, fp32_names)
        if not fp32_names:
            fp32_names.update(
                {k: (c["initializer"], c["transposed"]) for k, c in checks.items() if c["found"]}
            )
        return {
            "path": path.name,
            "bytes": path.stat().st_size,
            **compat.describe(proto := onnx.load(str(path))),
            "input": export.input_info(proto),
            "output": export.output_info(proto),
            **parity(path, optimized),
            "weights_ok": all(c["ok"] for c in checks.values()),
            "weights": checks,
        }

    parity_what = f"parity: the FP32 file against PyTorch on the {len(data.x_test):,} test samples"
    with clock.step("parity", parity_what):
        result = {"fp32": describe(fp32)}
    if not e.int8:
        return result
    q = quant_config(e)
    # Calibration: a seeded random draw from the training set. Precision is chosen on the
    # validation split (up to CHECK_SAMPLES of it): inputs no model trained on, where a model
    # is as unsure as on new data, and never the test set the parity figures come from.
    pick = _calibration_order(data)
    source = e.calibration_data or "training set"
    calib = _calibration(q, data, calib)
    check_from, split = data.split_note, "validation" if data.has_val else "training"
    if data.has_val:
        take = torch.randperm(len(data.y_val), generator=torch.Generator().manual_seed(0))
        check_x = data.x_val[take[:CHECK_SAMPLES]].numpy()
    else:  # too little data to hold any out: training images the calibration did not use
        skip = 0 if e.calibration_data else q.calibration
        check_x = data.x_train[pick[skip : skip + CHECK_SAMPLES]].numpy()
    if len(check_x) == 0:
        check_x, check_from = calib, "the calibration inputs (no other data left)"
        split = "calibration"
    flags = envinfo.cpu_flags()
    what = (
        f"INT8: calibrating on {len(calib)} samples, choosing nodes for target {q.target} "
        f"(floor: top-1 agreement {q.min_agreement} on {len(check_x)} samples)"
    )
    with clock.step("int8", what):
        prepared = tmp / ".prepared.onnx"
        try:
            export.preprocess(fp32, prepared)
            export.check_calibration(prepared, calib)
            with export.errors_only():
                # the FP32 file by path: its bytes are read only where host timing needs them
                choice = int8.choose(
                    prepared, fp32, calib, check_x, q, flags, cfg.ir_version, clock.info
                )
        except InputError:
            raise
        except Exception as e:
            if (reason := machine_failure(e, tmp)) is not None:
                # a full disk or memory is the machine's, not a graph ORT cannot take:
                # shipping FP32 with exit 0 hid it from the job that wanted the INT8 file
                raise MachineError(f"the INT8 step: {reason} (in {tmp.resolve().parent})") from e
            # Everything before (the archive, the FP32 file, its parity) stands: an INT8 step
            # that ONNX Runtime's tools cannot take (an STFT front end crashed its shape
            # inference) ships the FP32 file with the reason, not an exit 1 that threw the
            # whole run away. --strict still fails the run on it (guard's int8 finding).
            why = f"the INT8 step failed: {_why(e)}"
            report["int8_not_written"] = {"failed": True, "reason": why}
            return result
        finally:
            prepared.unlink(missing_ok=True)
    sel = choice.selection
    record = {
        "target": q.target,
        "scheme": sel.scheme.name,
        "reduce_range": choice.reduce_range,
        "decided_on": choice.semantics,
        "candidates": choice.candidates,
        "check_agreement": sel.agreement,
        # every check sample's FP32 margin paired with every sample's INT8 change of it: the
        # agreement to expect on new inputs; its 95% lower bound must hold the floor too
        "check_expected_agreement": sel.expected,
        "check_expected_lower_bound": sel.expected_low,
        "bias_corrected": sel.bias_corrected,
        "min_agreement": q.min_agreement,
        "calibration": {"source": source, "samples": len(calib), "method": q.method},
        "checked_on": {
            "split": split,
            "source": check_from,
            "samples": len(check_x),
            # top two FP32 logits within 1e-4 of the logit scale: either class agrees
            "fp32_ties": choice.ties,
        },
        "fp32_nodes": sel.fp32_nodes,
        "int8_nodes": sel.int8_nodes,
        "quantizable_nodes": choice.quantizable,
        # GRU/RNN and ConvTranspose nodes (and LSTMs not in 8 bits): FP32 in any INT8 file
        # (no QDQ INT8 kernel)
        "fp32_only_nodes": _still_fp32(export.fp32_only_nodes(fp32), choice.lstms),
        # embedding tables stored as int8 rows with a scale each: {initializer: elements}
        "int8_tables": choice.tables,
        **({"int8_tables_fp32": choice.tables_fp32} if choice.tables_fp32 else {}),
        # LSTMs as DynamicQuantizeLSTM (int8 weights): {node output: weights}
        "int8_lstms": choice.lstms,
        **({"int8_lstms_fp32": choice.lstms_fp32} if choice.lstms_fp32 else {}),
        "latency_ms_batch1": sel.latency_ms,
    }
    if choice.model is None:
        # No INT8 compute survives: that file would be the FP32 graph under an INT8 name.
        report["int8_not_written"] = {**record, "reason": choice.reason}
        return result
    path = tmp / f"{name}.int8.onnx"
    with atomic_path(path) as dst:
        onnx.save(choice.model, str(dst))
        export.check(dst)
    with clock.step("parity"):
        host = parity(path, optimized=True)
        result["int8"] = {
            # As written (ORT, graph optimizations off): what wasm and other runtimes compute.
            **describe(path, optimized=False),
            # against the FP32 ONNX file (the other figures are against PyTorch)
            **int8_vs_fp32(path, optimized=False),
            **record,
            "host_kernels": {
                **host,
                **int8_vs_fp32(path, optimized=True),
                "cpu_flags": sorted(flags & set(envinfo.CPU_FLAGS) | flags & {"avx_vnni"}),
                "saturating_cpu": int8.saturating_cpu(flags),
            },
        }
    return result


def _why(e: BaseException) -> str:
    """One line for an exception: its message, or its type when that is all it says."""
    text = one_line(e)
    if isinstance(e, StageError | InputError):
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _still_fp32(counts: dict[str, int], lstms: dict[str, int]) -> dict[str, int]:
    """The FP32 file's FP32-only node counts less the LSTMs the INT8 file holds in 8 bits."""
    out = dict(counts)
    if lstms and "LSTM" in out:
        out["LSTM"] -= len(lstms)
        if out["LSTM"] <= 0:
            del out["LSTM"]
    return out


def _calibration_order(data: Dataset) -> torch.Tensor:
    return torch.randperm(len(data.y_train), generator=torch.Generator().manual_seed(0))


def _calibration(q: int8.QuantConfig, data: Dataset, calib: np.ndarray | None) -> np.ndarray:
    """The user's own calibration inputs, or a seeded draw of training samples."""
    if calib is not None:
        return calib[: q.calibration]
    return data.x_train[_calibration_order(data)[: q.calibration]].numpy()


def _channel_latency(
    unthinned: nn.Module, e: ExportSection, report, data: Dataset, calib, tmp: Path, name: str
) -> dict[str, Any]:
    """The unthinned model's FP32 and INT8 files against the thinned ones, timed side by side
    (`compressor.measure.speedup`)."""
    q = quant_config(e)
    has_int8 = "int8" in report["onnx"]
    return speedup.compare(
        unthinned,
        tmp / f"{name}.fp32.onnx",
        tmp / f"{name}.int8.onnx" if has_int8 else None,
        data.x_test[: speedup.BATCHES[-1]].numpy(),
        report["onnx"]["int8"]["scheme"] if has_int8 else None,
        _calibration(q, data, calib),
        tmp,
        export_config(e),
        q,
        e.ir_version or None,
    )


def _load(path: Path):
    import onnx

    return onnx.load(str(path))


def export_config(e: ExportSection) -> export.ExportConfig:
    return export.ExportConfig(opset=e.opset, ir_version=e.ir_version or None)


def quant_config(e: ExportSection) -> int8.QuantConfig:
    return int8.QuantConfig(
        calibration=e.calibration,
        method=e.method,
        target=e.target,
        scheme=e.scheme,
        reduce_range=e.reduce_range,
        min_agreement=e.min_agreement,
    )


def _owner(pid: int | None = None) -> str:
    """Who stages outputs in a folder: "host-pid", part of the staging folder's name."""
    return f"{socket.gethostname()}-{os.getpid() if pid is None else pid}"


def _remove_abandoned(out: Path, locked: bool = False) -> None:
    """Staging folders of earlier runs into `out` on this host whose process ended without
    cleaning up (killed by SIGKILL or the OOM killer: SIGTERM and Ctrl-C clean up). Holding
    `out`'s lock (`locked`), every one of this host's is abandoned whatever pid it names (in
    a container the next job often gets the dead one's pid); without it, those whose process
    is gone. Another host's run, or a folder named otherwise, is left alone."""
    import glob as glob_mod

    head = f"{hidden(out.name)}.{socket.gethostname()}-"
    for folder in out.parent.glob(glob_mod.escape(head) + "*"):
        pid = folder.name[len(head) :].split(".", 1)[0]
        if not pid.isdigit() or not folder.is_dir() or folder.is_symlink():
            continue
        if locked:
            shutil.rmtree(folder, ignore_errors=True)
            continue
        if os.name == "nt":  # os.kill(pid, 0) sends Ctrl+C there: no liveness to ask
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:  # gone: its half-written files are ours to remove
            shutil.rmtree(folder, ignore_errors=True)
        except (PermissionError, OverflowError):  # alive under another user, or nonsense
            continue


def _move_into(tmp: Path, out: Path) -> None:
    if not out.exists():
        os.replace(tmp, out)  # one atomic rename when the folder is new
        tmp.mkdir()  # so the caller's cleanup finds a folder
        return
    earlier = recorded_outputs(out)
    # A rerun into an existing folder replaces our files one by one; a Ctrl-C between two
    # renames left the new ONNX files beside the old archive and a report of the old run, so
    # the signals wait until the folder is whole (the caller holds them on to its marks).
    with signals_deferred():
        for name in OUTPUTS:
            if (tmp / name).exists():
                os.replace(tmp / name, out / name)
            elif name in earlier and (out / name).is_file():
                # an earlier run's file this one did not write (its INT8 file, say); a file
                # of the user's that only shares a name (a training checkpoint student.pt)
                # stays: --force had deleted it
                (out / name).unlink()


MAX_REPORT_BYTES = 64 * 2**20  # a report.json bigger than this is not one compress wrote


def recorded_outputs(out: Path) -> set[str]:
    """The output names an earlier run's report.json in `out` says that run wrote (its
    `files`, deliverables and the report itself); empty when there is none or it is not one
    of ours."""
    path = out / "report.json"
    try:
        if not path.is_file() or path.stat().st_size > MAX_REPORT_BYTES:
            return set()
        report = json.loads(path.read_text(encoding="utf-8"))
        names = [*report.get("files", [])]
        names += [f["path"] for f in report.get("deliverables", {}).get("files", [])]
        if not names:
            return set()
        found = {Path(str(n)).name for n in names} | {"report.json", "report.md"}
        return found & set(OUTPUTS)
    except (OSError, ValueError, TypeError, AttributeError, KeyError, RecursionError):
        return set()


BN_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def decode_to_checkpoint(
    path: Path,
    out: Path | None,
    allow_import: str | None = None,
    max_elements: int | None = None,
    sha256: str | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Rebuild a checkpoint from a .dcz archive, bit for bit. An existing `out` is replaced
    only with `force` (a user's unrelated file was silently overwritten).

    A zoo model, or a user's model whose code `allow_import` names, is first built on the meta
    device (which allocates nothing); every record must have one of its names and shapes
    before the record is decoded, and the real model is built (and loads the tensors) only
    after all records check out: a small file cannot make us build a huge model or a huge
    tensor. A user's model without `allow_import` is not imported (a file never picks the
    code): its tensors are decoded within the archive's own bounds (`max_elements`, sizes
    checked against the file) and written as a checkpoint naming the same code, which builds
    when it is loaded with consent (`rebuilt` False in the result). `out` None: beside the
    archive, as NAME.decoded.pt.
    """
    if out is None:
        if path.is_dir() or not path.name:  # ".", "/" or "": no name to derive one from
            raise InputError(f"{path}: a folder, not an archive; give the .dcz file in it")
        out = path.with_suffix(".decoded.pt")
    check_writable(out, inputs=[path], replace=force)
    checkpoint.check_out_name(out)
    checkpoint.check_replaceable(Path(out))  # --force replaces a checkpoint, nothing else
    rebuilt = True

    def expect(header_spec: dict[str, Any]) -> dict[str, tuple[int, ...]] | None:
        nonlocal rebuilt
        try:
            spec = ModelSpec.from_dict(header_spec)
        except InputError as e:
            raise InputError(f"{path}: {e}") from None
        if allow_import is not None and allow_import != spec.name:
            raise InputError(
                f"{path}: the archive holds model {spec.name}, not {allow_import}; pass "
                f"--model {spec.name}, or leave --model out to decode its tensors"
            )
        if spec.needs_consent and allow_import != spec.name:
            rebuilt = False
            return None
        try:
            return state_shapes(spec)
        except InputError as e:
            raise InputError(f"{path}: {e}") from None

    decoded = archive.read(path, max_elements=max_elements, expect=expect, sha256=sha256)
    spec = ModelSpec.from_dict(decoded.spec)
    meta = {**decoded.metadata, "decoded_from": str(path)}
    if rebuilt:
        ck = checkpoint.Checkpoint(spec, decoded.state_dict, decoded.metadata, path=path)
        model = ck.build_model(allow_import=allow_import == spec.name)
        checkpoint.save(out, model, spec, meta)
        parameters = sum(p.numel() for p in model.parameters())
    else:
        checkpoint.save_state(out, decoded.state_dict, spec, meta)
        # the model's parameters as train and shrink count them: not BatchNorm's running
        # statistics, which a state_dict holds beside them (a KWS net: 11,108 for 10,596);
        # a tied weight once, as parameters() counts it (the archive decodes its names to one
        # tensor)
        tensors = {
            t.data_ptr(): t
            for k, t in decoded.state_dict.items()
            if t.is_floating_point() and not k.endswith(BN_BUFFERS)
        }
        parameters = sum(t.numel() for t in tensors.values())
    return {
        "checkpoint": str(out),
        "archive": str(path),
        "model": spec.name,
        "rebuilt": rebuilt,
        "tensors": len(decoded.state_dict),
        "archive_bytes": path.stat().st_size,
        "sha256": decoded.sha256,
        "parameters": parameters,
    }
