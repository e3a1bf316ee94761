"""`compress bench` as a library call: model files in, the measured grid out.

`bench(paths, data)` turns model files (`.pt` checkpoints, `.onnx` / `.ort` files, `compress
shrink` folders) into runnable variants (`compressor.measure.variants`), measures them alike
on every runtime asked for (`compressor.measure.latency.measure`) and returns a `BenchResult`,
whose `to_json()` is the object `compress bench --json` prints. The CLI parses its flags,
calls this, and writes the table, `--report` and `--plot` from the result.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compresskit.compressor.measure import contention, envinfo, latency, variants
from compresskit.compressor.measure.variants import DEFAULT_PROVIDERS
from compresskit.models import data as data_mod
from compresskit.models import safeload, zoo
from compresskit.models.data import SPECS_HELP, Dataset
from compresskit.models.errors import InputError, brief
from compresskit.models.jsonable import plain


@dataclass
class BenchResult:
    """What `bench` measured: one row per (model, runtime, precision, batch, threads) cell.

    environment          CPU model and flags, cores, OS, package versions, GPU, date
    peaks                per thread count (a string key), the measured FP32 matmul GFLOP/s and
                         INT8 GOP/s the rows' `peak_fraction` is relative to
    agreement_reference  the variant top-1 agreement is measured against (the first that
                         ran on the data), or None without data
    speedup_reference    the variant `speedup_vs_first` is relative to
    runtimes             {"requested": [...], "default": bool, "absent": {provider: reason}}
    results              the rows: p50/p90/p99 latency and its bootstrap CI (ms), throughput,
                         cold start, bytes, parameters, MACs, GFLOP/s, accuracy, agreement
    skipped              variants not measured, each with its reason
    profiles             with `profile=True`, per ONNX model the per-operator time shares
    notes                what makes the figures less telling than they look (a busy machine,
                         sub-0.1 ms rows timed beside PyTorch), one line each
    """

    environment: dict[str, Any]
    peaks: dict[str, dict[str, float]]
    agreement_reference: str | None
    speedup_reference: str | None
    runtimes: dict[str, Any]
    results: list[dict[str, Any]]
    skipped: list[dict[str, Any]]
    profiles: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The result as JSON values, exactly the object `compress bench --json` prints (and
        what `compressor.measure.benchreport.markdown` / `plot` take): NaN is None, paths are
        strings.
        """
        return plain(
            {
                "environment": self.environment,
                "peaks": self.peaks,
                "agreement_reference": self.agreement_reference,
                "speedup_reference": self.speedup_reference,
                "runtimes": self.runtimes,
                "results": self.results,
                "skipped": self.skipped,
                "profiles": self.profiles,
                "notes": self.notes,
            }
        )


def bench(
    models: str | os.PathLike | Sequence[str | os.PathLike],
    data: str | Dataset | None = None,
    *,
    batches: int | Sequence[int] = (1,),
    threads: int | Sequence[int] = (1,),
    providers: str | Sequence[str] | None = None,
    min_runs: int = 50,
    min_seconds: float = 1.0,
    baselines: bool = False,
    profile: bool = False,
    model: str | None = None,
    model_kwargs: dict[str, Any] | str | None = None,
    trust_model: bool = False,
    progress: Callable[[str], None] | None = None,
) -> BenchResult:
    """Measure latency, throughput, size and accuracy of models across runtimes, alike: the
    runners of one (batch, threads) cell run interleaved after warm-up, until both `min_runs`
    and `min_seconds` are reached. What `compress bench` does; never prints or exits.

    Args:
        models: a path, or a list of paths: `.pt` checkpoints, `.onnx` or `.ort` files, or
            `compress shrink` output folders (every model file in them).
        data: a data spec ("digits", "npz:FILE", "tokens", ...), a loaded
            `compresskit.models.data.Dataset`, or in-memory (x, y) arrays, a TensorDataset
            or a DataLoader over one (`Dataset.from_arrays`): each variant's test accuracy and top-1
            agreement with the first one are measured on its test split, and the timed
            inputs are its first test inputs. None: latency only, on random inputs.
        batches: batch sizes to time (an int or a sequence), e.g. (1, 64); the CLI's
            `--batch` defaults to 1,64, this to (1,).
        threads: thread counts (0: all cores), at most the cores this process may use.
        providers: runtimes, as a list or "torch,cpu": torch (PyTorch eager), cpu, cuda,
            tensorrt (ONNX Runtime providers). Default: all of them; those absent here are
            returned as skips with their reason.
        min_runs: timed runs per cell, at least.
        min_seconds: timed seconds per cell, at least.
        baselines: also measure ONNX Runtime's quantize_dynamic and quantize_static of each
            FP32 ONNX input (calibrated on `data`'s training images).
        profile: add a per-operator profile of each ONNX model (ONNX Runtime's profiler).
        model: for a bare state_dict, the model to build (a zoo name or
            "pkg.module:callable"); naming a checkpoint's own import path also allows
            importing that code.
        model_kwargs: constructor arguments for `model` (a dict, or its JSON text).
        trust_model: allow importing the code every checkpoint names.
        progress: called with one line per step of the measurement (default: silent).

    Returns:
        A `BenchResult`; `to_json()` is what `compress bench --json` prints.

    Raises:
        InputError: a path that is missing or not a model, an unknown provider, a batch
            size below 1, a data spec that cannot be read or does not fit the models, a
            checkpoint that names code without consent (`model` or `trust_model`).
    """
    cfg = latency.BenchConfig(
        batches=_ints(batches, "--batch"),
        threads=_ints(threads, "--threads"),
        min_runs=min_runs,
        min_seconds=min_seconds,
    )
    # Without `providers` every runtime is asked for: the absent ones come back as skips
    # without being tried, and the table names them in one line.
    runtimes = variants.parse_providers(_providers(providers))
    paths = _once(variants.expand(_paths(models)))
    named = _model_name(paths, model)
    consent = named if trust_model else model  # may the model's code be imported
    ds = _data(data, named, consent, paths)
    info = progress or (lambda message: None)
    with tempfile.TemporaryDirectory(prefix="compress-bench.") as tmp:
        for p in paths:  # before onnx or ONNX Runtime reads any external data
            if variants.file_kind(p) == ".onnx":
                safeload.check_onnx_external_data(p)
        kwargs = _kwargs(model_kwargs)
        described = variants.disambiguate(
            [variants.load(p, model, ds, kwargs, trust=trust_model) for p in paths]
        )
        torch_models = [m for m in described if m.format == "pytorch"]
        if model and torch_models and not any(m.spec.name == model for m in torch_models):
            # full checkpoints name their model: a --model naming another was silently ignored
            named = ", ".join(f"{m.path.name} ({m.spec.name})" for m in torch_models)
            raise InputError(
                f"--model {model}: no checkpoint here is a bare state_dict or that model "
                f"({named}); drop --model"
            )
        said = []  # what --baselines did, when it is not what a user would assume
        if baselines:
            added = _baselines(described, ds, Path(tmp), info)
            if not added:
                said.append("--baselines: no FP32 ONNX file among the inputs, so none was added")
            elif ds is None:
                said.append(
                    "--baselines: ORT's quantize_static was calibrated on random inputs (no "
                    "--data); pass --data for a calibration on real samples"
                )
            described += added
        runnable, skipped = variants.variants(described, runtimes)
        if not runnable:  # an empty table and report, exit 0, read as a pass in a script
            first = skipped[0] if skipped else {"model": paths[0].name, "reason": "nothing runs"}
            raise InputError(
                f"nothing to measure on --providers {','.join(runtimes)}: {first['model']}: "
                f"{first['reason']}"
            )
        results, more, extra = latency.measure(runnable, cfg, ds, info)
        profiles = _profiles(described, cfg, ds) if profile else {}
        for r in results:  # a baseline's path names a folder removed on return
            if str(r.get("path", "")).startswith(tmp):
                r["notes"].append(
                    "made by ONNX Runtime's quantizer in a temporary folder, removed after "
                    "the run (make it with onnxruntime.quantization to keep it)"
                )
    environment = envinfo.environment()
    return BenchResult(
        environment=environment,
        **extra,
        runtimes={
            "requested": runtimes,
            "default": providers is None,
            "absent": latency.absent_runtimes(),
        },
        results=results,
        skipped=skipped + more,
        profiles=profiles,
        notes=notes(environment, results) + said,
    )


# Below this p50 a row's figure moves with what runs between its calls (caches, branch
# predictors): an FP32 ONNX file read 0.026 ms timed beside a PyTorch checkpoint and 0.009 ms
# beside its INT8 twin alone, and the INT8-vs-FP32 ratio flipped.
SMALL_MS = 0.1


def notes(environment: dict[str, Any], results: list[dict[str, Any]]) -> list[str]:
    """One line for each reason the figures tell less than they look; saved with them (the
    JSON, report.md), not only printed."""
    out = []
    load = environment.get("load_average_1min")
    cores = environment.get("usable_cores") or environment.get("logical_cores")
    measured = [r for r in results if r.get("other_cores") is not None]
    if measured and cores:  # measured over each cell's timing window (Linux)
        cells: dict[tuple[int, int], float] = {}
        for r in measured:
            if contention.contended(r["other_cores"], cores, r["threads"]):
                cells[r["batch"], r["threads"]] = r["other_cores"]
        if cells:
            where = ", ".join(
                f"batch {b} at {t} thread{'s' * (t > 1)} ({o:.1f} cores busy)"
                for (b, t), o in sorted(cells.items())
            )
            out.append(
                f"other processes kept cores busy while these were timed, on {cores} usable "
                f"cores: {where}; their latencies read high, and % peak, taken against a peak "
                "measured on the same busy cores, is unreliable (it can pass 100%)"
            )
    elif load is not None and cores and load > cores:  # more runnable work than cores
        out.append(
            f"load average {load:.1f} on {cores} usable cores: other work ran beside the "
            "timings, so latencies read high, and % peak, taken against a peak measured on "
            "the same busy cores, is unreliable (it can pass 100%)"
        )
    torch_rows = {r["model"] for r in results if str(r.get("provider")).startswith("pytorch")}
    small = [
        r
        for r in results
        if not str(r.get("provider")).startswith("pytorch") and r["p50_ms"] < SMALL_MS
    ]
    if torch_rows and small:
        out.append(
            f"ONNX rows under {SMALL_MS} ms were timed interleaved with PyTorch "
            f"({', '.join(sorted(torch_rows))}): at that scale a row moves with what runs "
            "between its calls; to choose between ONNX files, bench them without the checkpoint"
        )
    return out


def _ints(value: int | Sequence[int], flag: str) -> tuple[int, ...]:
    if latency.whole(value):
        return (int(value),)
    if (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and all(map(latency.whole, value))
    ):
        return tuple(int(v) for v in value)
    name = "batches" if flag == "--batch" else "threads"
    raise InputError(f"{name} {brief(value)}: give a whole number or a list of them, e.g. (1, 64)")


def _providers(providers: str | Sequence[str] | None) -> str:
    if providers is None:
        return DEFAULT_PROVIDERS
    if isinstance(providers, str):
        return providers
    if isinstance(providers, Sequence) and all(isinstance(p, str) for p in providers):
        return ",".join(providers)
    raise InputError(
        f"providers {brief(providers)}: give runtime names, e.g. ['torch', 'cpu'] or 'torch,cpu'"
    )


def _once(paths: list[Path]) -> list[Path]:
    """Each file once, in the order given: a file named twice (relative and absolute, or in
    its folder and alone) was measured twice under one label."""
    seen: set[str] = set()
    out = []
    for p in paths:
        key = os.path.realpath(p)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def _paths(models: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    items = [models] if isinstance(models, str | os.PathLike) else models
    if not isinstance(items, Sequence) or not all(isinstance(m, str | os.PathLike) for m in items):
        raise InputError(
            f"models {brief(models)}: give a path, or a list of paths, to .pt, .onnx or .ort files "
            "or compress shrink folders"
        )
    if not items:
        raise InputError(
            "models: give one or more .pt, .onnx or .ort files or compress shrink folders"
        )
    return [Path(m) for m in items]


def _data(
    data: str | Dataset | None, named: str | None, consent: str | None, paths: list[Path] = ()
) -> Dataset | None:
    """The data set, read for the model being measured: an npz array named after its forward
    argument is its input, or, with no checkpoint to read that from, after the ONNX files'
    input (`ids` for a model whose forward takes `ids`)."""
    data = data_mod.as_dataset(data)  # (x, y) arrays, a TensorDataset or a DataLoader
    if isinstance(data, Dataset):
        return data
    if data is not None and not isinstance(data, str):
        raise InputError(
            f"data must be a data spec ({SPECS_HELP}), in-memory (x, y) arrays, a "
            f"TensorDataset, a compresskit.models.data.Dataset or None, got {type(data).__name__}"
        )
    if not data:
        return None
    name = data_mod.input_name(named, consent)
    if name is None and data.startswith("npz:"):  # only an npz names arrays after inputs
        name = _graph_input(paths)
    return data_mod.load(data, name)


def _graph_input(paths: list[Path]) -> str | None:
    """The input name the ONNX and .ort files among `paths` share (None if they differ or
    there are none). Read without external data: nothing outside the file is opened here."""
    names = set()
    for p in paths:
        try:
            if variants.file_kind(p) == ".onnx":
                import onnx

                names.add(onnx.load(str(p), load_external_data=False).graph.input[0].name)
            elif variants.file_kind(p) == ".ort":
                names.add(variants._ort_session(p).get_inputs()[0].name)
        except Exception:  # not readable: loading it next says why, naming the file
            continue
    return names.pop() if len(names) == 1 else None


def _kwargs(model_kwargs: dict[str, Any] | str | None) -> dict[str, Any]:
    if isinstance(model_kwargs, dict):
        return model_kwargs
    if model_kwargs is None or isinstance(model_kwargs, str):
        return zoo.parse_kwargs(model_kwargs)
    raise InputError(
        f"model_kwargs must be a dict (or a JSON object as text), got {type(model_kwargs).__name__}"
    )


def _baselines(described, ds, tmp: Path, info) -> list:
    """ORT's own quantizers on each FP32 ONNX input, calibrated on training images."""
    import numpy as np

    from compresskit.compressor import export as export_mod

    out = []
    for m in described:
        if m.format != "onnx" or m.precision != "fp32":
            continue
        if ds is not None:
            pick = np.random.default_rng(0).permutation(len(ds.y_train))[:256]
            calib = ds.x_train.numpy()[pick]
        elif m.in_shape is not None:  # float32 images, or int64 ids the model embeds
            calib = latency.inputs(m, 64, None, np.random.default_rng(0))
        else:
            raise InputError(f"--baselines: {m.path} has no fixed input shape; pass --data SPEC")
        info(f"baselines: ORT quantize_dynamic and default quantize_static of {m.label}")
        folder = tmp / str(len(out))  # one folder per input: equal names never overwrite
        folder.mkdir()
        for path in export_mod.ort_baselines(m.path, folder, calib, m.fixed_batch):
            b = variants.load(path)
            b.label = f"{m.label} → {path.name.split('.')[-2]}"
            b.source = m.path  # its INT8 is compared with the FP32 file it came from
            out.append(b)
    return out


def _profiles(described, cfg, ds) -> dict:
    import numpy as np

    from compresskit.compressor.measure import ortprofile

    out = {}
    for m in described:
        if m.format != "onnx":
            continue
        x = latency.inputs(m, cfg.batches[0], ds, np.random.default_rng(0))
        p = ortprofile.profile_ops(m.path, x, threads=latency.resolve_threads(cfg.threads[0]))
        out[m.label] = {**p, "top": ortprofile.top_ops(p, 5)}
    return out


def _model_name(paths: list[Path], model: str | None) -> str | None:
    """The PyTorch model being measured: `model`, else the first checkpoint's recorded one."""
    if model is not None:
        return model
    from compresskit.models import checkpoint

    first = next((p for p in paths if variants.file_kind(p) == ".pt"), None)
    spec = checkpoint.load(first, train_state=False).spec if first is not None else None
    return spec.name if spec is not None else None
