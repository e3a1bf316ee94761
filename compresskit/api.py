"""`compresskit.shrink`: Deep Compression (Han, Mao & Dally, ICLR 2016), distillation and INT8
ONNX export of one model, as the `compress shrink` command runs them, from Python.

It lives above both library packages because it joins them: the stages are
`compresskit.compressor`'s, and the retraining they need is `compresskit.distrib`'s one
training loop (`trainer.fit`), handed in as hooks, exactly as the CLI does. The CLI's
`compress shrink` is this function plus flags, a progress display and tables.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compresskit.compressor import pipeline, prune
from compresskit.compressor.recipe import Recipe
from compresskit.compressor.shrink import Hooks
from compresskit.distrib.trainer import (
    Batches,
    Events,
    TrainConfig,
    check_events,
    correct,
    cross_entropy_loss,
    evaluate,
    fit,
)
from compresskit.models import checkpoint, zoo
from compresskit.models import data as data_mod
from compresskit.models.base import BN_STALE, batchnorm_memory
from compresskit.models.data import Dataset
from compresskit.models.errors import InputError, brief
from compresskit.models.zoo import ModelSpec

__all__ = ["ShrinkReport", "decode", "shrink"]


@dataclass(frozen=True)
class ShrinkReport:
    """What one shrink run wrote and measured (the full record is `report`, = report.json).

    name            "model", or "student" when the recipe distilled into a new model
    out             the folder holding every file
    files           the files written, sorted (absolute; report.json names them in `out`)
    ship            the file to ship (the INT8 ONNX, or the FP32 one where INT8 was refused);
                    `ship_mobile` the .ort for ONNX Runtime Mobile, when written
    dense_bytes     the dense FP32 weights the ratios are measured against
    archive_bytes   the Huffman-coded .dcz; `ratio` = dense_bytes / archive_bytes
    baseline_accuracy, test_accuracy   the test set before and after (fractions)
    findings        guardrail findings (compressor.guard): one dict per problem, [] when none

    In a notebook: `r.load_model()` is the compressed model (NAME.pt: pruned and shared
    weights, dense layout), `r.archive` / `r.onnx` the files' paths, `r.layers` the per-layer
    table (one dict per layer: kept fraction, bits, bytes), `r.to_json()` the whole record.
    """

    name: str
    out: Path
    files: tuple[Path, ...]
    ship: str | None
    ship_mobile: str | None
    dense_bytes: int
    archive_bytes: int | None
    ratio: float | None
    baseline_accuracy: float
    test_accuracy: float
    findings: tuple[dict[str, Any], ...]
    report: dict[str, Any] = field(repr=False)

    @classmethod
    def from_report(cls, report: dict[str, Any], out: Path) -> ShrinkReport:
        archive = report.get("archive")
        deliverables = report.get("deliverables", {})
        return cls(
            name=report["name"],
            out=out,
            files=tuple(out / Path(f).name for f in report.get("files", [])),
            ship=deliverables.get("ship"),
            ship_mobile=deliverables.get("ship_mobile"),
            dense_bytes=report["baseline"]["bytes"],
            archive_bytes=archive["bytes"] if archive else None,
            ratio=archive["ratio"] if archive else None,
            baseline_accuracy=report["baseline"]["test_accuracy"],
            test_accuracy=report["student"]["test_accuracy"],  # of NAME.pt, after it all
            findings=tuple(report.get("guard", {}).get("findings", [])),
            report=report,
        )

    def to_json(self) -> dict[str, Any]:
        """The whole record, JSON-ready: what report.json in `out` holds (a copy: editing it
        leaves this report as it was)."""
        return copy.deepcopy(self.report)

    @property
    def archive(self) -> Path | None:
        """The .dcz archive (`compresskit.decode` reads it back), or None when not written."""
        a = self.report.get("archive")
        return self.out / Path(a["path"]).name if a else None

    @property
    def onnx(self) -> dict[str, Path]:
        """{"fp32": path, "int8": path} of the ONNX files written ("int8" absent when refused)."""
        return {k: self.out / Path(v["path"]).name for k, v in self.report.get("onnx", {}).items()}

    @property
    def layers(self) -> list[dict[str, Any]]:
        """One dict per compressed layer: name, weights, kept fraction, bits, bytes."""
        return copy.deepcopy(self.report.get("layers", []))

    def load_model(self) -> nn.Module:
        """The compressed model, NAME.pt in `out` rebuilt (its code imported: this run built
        it from the same code) with the pruned and shared weights in a dense layout."""
        ck = checkpoint.load(self.out / f"{self.name}.pt", train_state=False)
        return ck.build_model(allow_import=True)

    def __repr__(self) -> str:
        ratio = f"{self.ratio:.1f}x" if self.ratio else "no archive"
        return (
            f"ShrinkReport({self.name!r} in {os.fspath(self.out)!r}: {ratio}, test accuracy "
            f"{self.baseline_accuracy:.4f} -> {self.test_accuracy:.4f}, ship {self.ship!r}, "
            f"{len(self.findings)} findings)"
        )


def _dataset(data: str | Dataset | None, default: str, input_name: str | None) -> Dataset:
    data = data_mod.as_dataset(data)
    if isinstance(data, Dataset):
        return data
    if data is None:
        data = default
    if isinstance(data, Recipe):
        raise InputError("data is a Recipe: the order is shrink(model, data, recipe)")
    if not isinstance(data, str):
        raise InputError(
            f"data {brief(data)}: give a data spec such as 'digits', 'npz:FILE' or 'mnist:DIR', "
            "in-memory (x, y) arrays, a TensorDataset, or a Dataset (compresskit.load_data, "
            "Dataset.from_arrays)"
        )
    return data_mod.load(data, input_name)


def _recipe(recipe: Recipe | None) -> Recipe:
    if recipe is None:
        return Recipe()
    if isinstance(recipe, Dataset | str | tuple):
        raise InputError(
            f"recipe is {brief(recipe)}, not a compresskit.Recipe: the order is shrink(model, "
            "data, recipe); a recipe file loads with Recipe.load(path)"
        )
    if not isinstance(recipe, Recipe):
        raise InputError(
            f"recipe is {type(recipe).__name__}, not a compresskit.Recipe; build one with "
            "Recipe(...), Recipe.from_dict({...}) or Recipe.load(path)"
        )
    return recipe


def _unwrapped(model: nn.Module) -> nn.Module:
    """The module inside torch.compile's and (Distributed)DataParallel's wrappers: their
    weight names carry `_orig_mod.` / `module.`, and a spec naming the user's class then
    read as 'weights differ'."""
    while True:
        if type(model).__name__ == "OptimizedModule" and isinstance(
            getattr(model, "_orig_mod", None), nn.Module
        ):
            model = model._orig_mod
        elif isinstance(model, nn.DataParallel | nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def _model_name(spec: str | ModelSpec | None) -> str | None:
    return spec.name if isinstance(spec, ModelSpec) else spec


def _load(
    model: Any,
    data: str | Dataset | None,
    spec: str | ModelSpec | None,
    model_kwargs: dict[str, Any] | None,
    trust_model: bool,
) -> tuple[nn.Module, ModelSpec, Dataset, dict[str, Any]]:
    """(the model to compress, its spec, the data, the run's metadata) from what was given."""
    if spec is not None and not isinstance(spec, (str, ModelSpec)):
        raise InputError(
            f"spec must be a zoo name or 'pkg.module:callable' (a string; its arguments go in "
            f"model_kwargs) or a ModelSpec, not {type(spec).__name__}"
        )
    if isinstance(model, nn.Module):
        model = _unwrapped(model)
        floats = {str(p.dtype) for p in model.parameters() if p.is_floating_point()}
        if floats - {"torch.float32"}:
            # the archive, k-means and the ONNX export work in float32; a float64 model on
            # float64 data passed every check, then failed inside the first evaluation
            raise InputError(
                f"the model has {', '.join(sorted(floats))} weights; compress shrinks float32 "
                "models: pass model.float()"
            )
        if spec is None:
            raise InputError(
                "shrink(model=<nn.Module>) needs spec='zoo name' or 'pkg.module:callable' (and "
                "model_kwargs) naming how to build it: the archive and checkpoint record it so "
                "the model can be rebuilt; or pass the checkpoint path"
            )
        ds = _dataset(data, "digits", data_mod.input_name(_model_name(spec), _model_name(spec)))
        if isinstance(spec, ModelSpec):
            resolved = spec
        else:
            resolved = zoo.resolve_spec(spec, dict(model_kwargs or {}), ds.in_shape, ds.num_classes)
        shapes = zoo.state_shapes(resolved)
        if shapes is None:  # not buildable on the meta device: build it, for build's reason
            shapes = {k: tuple(v.shape) for k, v in zoo.build(resolved).state_dict().items()}
        have = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if shapes is not None and shapes != have:
            diff = sorted(set(shapes) ^ set(have)) or sorted(
                k for k in shapes if shapes[k] != have.get(k)
            )
            first = diff[0]
            raise InputError(
                f"spec {resolved.name!r} with {resolved.kwargs} builds a model whose weights "
                f"differ from the one given (first: {first} is {shapes.get(first, 'absent')} "
                f"there, {have.get(first, 'absent')} here); pass the model_kwargs it was "
                "built with"
            )
        # The stages change the model in place; the caller's stays as it was.
        try:
            net = copy.deepcopy(model)
        except RuntimeError as e:  # torch's own words name the old weight_norm hook
            if "weight_norm" not in str(e):
                raise
            raise InputError(
                f"model {resolved.name}: a layer computes its weight with the old "
                "torch.nn.utils.weight_norm hook, which torch cannot copy; fold it as for "
                "inference (torch.nn.utils.remove_weight_norm(layer)) in a model built without "
                "it, and shrink that model (README: weight-normed layers)"
            ) from None
        data_mod.check_fits(net, ds, resolved.name)
        meta = {"data": data_mod.recorded_spec(ds.spec), "source": f"<{type(model).__name__}>"}
        return net, resolved, ds, meta
    path = getattr(model, "checkpoint", model)  # a TrainResult names the file it wrote
    if path is None and hasattr(model, "checkpoint"):
        raise InputError(
            f"this {type(model).__name__} wrote no checkpoint (a module instance trains in "
            "place, without one); pass its model with spec= naming how to build it: "
            "shrink(run.model, data, spec='zoo name' or '__main__:YourClass' or "
            "'pkg.module:callable')"
        )
    if not isinstance(path, str | Path):
        raise InputError(
            f"model {brief(model)}: give a checkpoint path, a TrainResult from compresskit.train, "
            "or an nn.Module with spec="
        )
    path = Path(path)
    ck = checkpoint.load(path, train_state=False)
    named = _model_name(spec)
    if trust_model and named is None and ck.spec is not None and ck.spec.is_import_path:
        named = ck.spec.name
    consent = named  # the code the caller allowed to import
    want = data_mod.input_name(named or (ck.spec.name if ck.spec else None), consent)
    if data is None:
        ds = data_mod.load_recorded(ck.metadata.get("data"), path, want)
    else:
        ds = _dataset(data, "digits", want)
    resolved = ck.spec_for(named, dict(model_kwargs or {}), ds.in_shape, ds.num_classes)
    net = ck.build_model(resolved, allow_import=named == resolved.name)
    del ck  # its weights and optimizer state are copied into `net`
    data_mod.check_fits(net, ds, resolved.name)
    # The file's name, not its path: the metadata travels in the archive and model.pt, which
    # should not carry the build machine's folders, nor change size with them.
    return net, resolved, ds, {"data": data_mod.recorded_spec(ds.spec), "source": path.name}


def shrink(
    model: nn.Module | str | Path | Any,
    data: str | Dataset | None = None,
    recipe: Recipe | None = None,
    *,
    out: str | Path,
    spec: str | ModelSpec | None = None,
    model_kwargs: dict[str, Any] | None = None,
    force: bool = False,
    trust_model: bool = False,
    progress: Events | None = None,
    student_code: str | None = None,
    resume: bool = False,
) -> ShrinkReport:
    """Compress one model as `recipe` says and write every output into the folder `out`.

    model       a checkpoint path (what `compress train` / `compresskit.train` write), the
                `TrainResult` `train` returned, or an `nn.Module` with `spec` (a zoo name or
                "pkg.module:callable", plus `model_kwargs`) naming how to rebuild it; a module
                is copied, never changed
    data        a data spec ("digits", "npz:FILE", "mnist:DIR", "tokens"), a Dataset
                (`compresskit.load_data`, `Dataset.from_arrays`), or in-memory data: an
                (x, y) pair of arrays or tensors, a TensorDataset, a DataLoader over one
                (split as `Dataset.from_arrays` does); default: the data the checkpoint was
                trained on
    recipe      a `compresskit.Recipe` (default: `Recipe()`, the paper's settings)
    out         the folder for NAME.dcz, NAME.pt, NAME.fp32/int8.onnx, NAME.int8.ort,
                report.json/.md and plots: new, empty or holding files of your own; one
                that already holds a run's outputs is refused unless `force`
    spec        for a checkpoint, the model code to import (as `--model`); the checkpoint's
                own import path is imported only with this or `trust_model`
    student_code  the recipe's `distill.student` when it is an import path
                ("pkg.module:callable"): that code is imported only when named here too (as
                `--student`) or with `trust_model`, since a recipe may come from a file
    progress    a `compresskit.distrib.Events` told about each epoch and step (default: silent)
    resume      continue a stopped run into `out` from the work it kept (each pruning round,
                the compressed model: kept in `.OUT.resume` beside `out` until a run succeeds);
                only with the same model, data and recipe sections that work depended on

    Returns a `ShrinkReport`. Raises `InputError` for bad input (before any work) and
    `StageError` when a stage fails its own check (then nothing is left in `out`).
    """
    recipe = _recipe(recipe)
    # A recipe may come from a file, and a file never picks the code that runs.
    student = recipe.distill.student
    if ":" in student and not trust_model and student_code != student:
        raise InputError(
            f"recipe distill.student = {student!r} names code to import; pass "
            f"student_code={student!r} (--student {student}) or trust_model=True "
            "(--trust-model) to allow it"
        )
    if not isinstance(out, str | os.PathLike):
        raise InputError(f"out {brief(out)}: give the output folder's path (a str or Path)")
    if model_kwargs is not None and not isinstance(model_kwargs, dict):
        raise InputError(f"model_kwargs {brief(model_kwargs)}: give a dict of arguments")
    check_events(progress)
    out = Path(out)
    given = getattr(model, "checkpoint", model)  # the input file, when one is given
    inputs = [Path(given)] if isinstance(given, str | Path) else []
    inputs += [Path(t) for t in recipe.distill.teachers]  # replaced or removed under force
    pipeline.check_teachers(Path(given) if isinstance(given, str | Path) else None, recipe)
    pipeline.check_out_dir(out, force, inputs)
    # Building the model draws from torch's generator (its initial weights, replaced by the
    # checkpoint's): on a forked one, so the caller's is left as it was (the pipeline seeds
    # its own draws from the recipe).
    with torch.random.fork_rng(devices=[]):
        net, resolved, ds, meta = _load(model, data, spec, model_kwargs, trust_model)
    _check_finite(net, str(inputs[0]) if inputs else meta["source"])
    hooks = _hooks(ds, recipe, progress)
    allowed = _model_name(spec)  # the code the caller named, or all with trust_model
    hooks = dataclasses.replace(hooks, trusts=lambda name: trust_model or name == allowed)
    report = pipeline.shrink_to_folder(
        net, resolved, recipe, hooks, out, meta, ds, force=force, resume=resume
    )
    # absolute: the report's paths still work after the notebook changes folder
    return ShrinkReport.from_report(report, Path(os.path.abspath(out)))


def _check_finite(net: nn.Module, source: str) -> None:
    """Weights that hold NaN or inf: refused before any work (they made the first retraining
    step stop as 'training diverged', whose fix, a lower learning rate, is not this one)."""
    bad = [
        name
        for name, t in net.state_dict().items()
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise InputError(
            f"{source}: {bad[0]}{more} hold NaN or inf; the run that wrote these weights "
            "diverged: retrain it (or shrink an earlier checkpoint)"
        )


def _hooks(ds: Dataset, recipe: Recipe, events: Events | None) -> Hooks:
    """The pipeline's hooks: `distrib`'s training loop and evaluation on `ds`."""
    train = recipe.train
    x_val, y_val = ds.decision_split()  # held out of training: what stages decide on
    slices: list[int] = []  # micro-batches per batch of each retraining run, for the report
    refreshed: list[bool] = []  # per retraining run: BatchNorm statistics re-estimated at its end

    def retrain(m: nn.Module, epochs: int, lr: float, loss_fn=None, data=None):
        # Statistics re-estimated only where this run leaves the running averages stale.
        steps = epochs * Batches(len((data or ds).y_train), train.batch_size).steps_per_epoch
        stale = batchnorm_memory(m, steps) > BN_STALE
        cfg = TrainConfig(
            epochs=epochs,
            lr=lr,
            batch_size=train.batch_size,
            microbatches=train.microbatches,
            optimizer=train.optimizer,
            seed=train.seed,
            bn_refresh=train.bn_refresh if stale else 0,
            # The stages read the final model's test hits only: the test pass after every
            # other epoch was a forward over the test set for a progress line.
            evaluate="last",
        )
        # Masks skip their multiply while `fit` trains: its SGD and Adam start their state
        # inside the block and keep zero weights at zero (pruned layers at dense speed).
        with prune.zeroed_training(m):
            result = fit(m, data or ds, cfg, events=events, loss_fn=loss_fn or cross_entropy_loss)
        slices.append(result.microbatches)
        refreshed.append(result.bn_refreshed > 0)
        # The loop's last evaluation is the test set's when it trained on `ds`: the pipeline
        # reuses its per-sample hits instead of a second pass (`Hooks.retrain`).
        return result.test_correct if data is None else None

    info: Callable[[str], None] = events.info if events is not None else (lambda message: None)
    return Hooks(
        retrain=retrain,
        test_accuracy=lambda m: evaluate(m, ds.x_test, ds.y_test)[1],
        val_accuracy=lambda m: evaluate(m, x_val, y_val)[1],
        val_data=(x_val, y_val),
        test_correct=lambda m: correct(m, ds.x_test, ds.y_test),
        info=info,
        train_samples=len(ds.y_train),
        trained=lambda: (
            {"microbatches": sorted(set(slices)), "bn_refreshed_runs": sum(refreshed)}
            if slices
            else {}
        ),
    )


def decode(
    archive: str | Path,
    out: str | Path | None = None,
    *,
    model: str | None = None,
    max_elements: int | None = None,
    sha256: str | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Rebuild a .pt checkpoint from a .dcz archive, bit for bit (as `compress decode`); an
    existing `out` is replaced only with `force`.

    `model`: the "pkg.module:callable" the archive names, to import it and check the tensors
    build it (without it the tensors are decoded and no code is imported). `sha256`: refuse
    the archive unless its SHA-256 is this. Returns the record `compress decode --json` prints.
    """
    for what, value in (("archive", archive), ("out", out)):
        if not (isinstance(value, str | os.PathLike) or (what == "out" and value is None)):
            raise InputError(f"{what} {brief(value)}: give a file path (a str or Path)")
    target = Path(out) if out is not None else None
    return pipeline.decode_to_checkpoint(
        Path(archive),
        target,
        allow_import=model,
        max_elements=max_elements,
        sha256=sha256,
        force=force,
    )
