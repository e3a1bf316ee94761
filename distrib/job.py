"""`compress train` as a library call: build the model for the data, resume if asked, fit.

`train(...)` is the documented entry point (`compresskit.distrib.train`): plain arguments in, a
`TrainResult` out. It builds a `TrainJob` and runs it with `run(TrainJob)`, which the
data-parallel launcher calls once per rank; `compress train` calls `train` too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import math
import os
import random
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from compresskit.distrib import launch, paramserver, pipeline
from compresskit.distrib.paramserver import PSConfig
from compresskit.distrib.pipeline import PipelineConfig
from compresskit.distrib.trainer import (
    Checkpointer,
    Events,
    TrainConfig,
    TrainResult,
    check_events,
    check_train_state,
    fit,
    optimizer_for,
)
from compresskit.models import checkpoint, data, zoo
from compresskit.models.base import batch_statistics
from compresskit.models.data import SPECS_HELP, Dataset, as_dataset, spec_files
from compresskit.models.errors import InputError, brief
from compresskit.models.fileio import check_writable, hidden, output_lock

# Settings a resumed run may change: the rest must match the checkpoint's.
_RESUME_MAY_CHANGE = {
    "epochs",
    "microbatches",  # memory: the same update up to rounding (dropout: other mask draws)
    "eval_batch_size",
    "evaluate",
    "device",
    "deterministic",  # which kernels, not which update
    "bn_refresh",  # after the last epoch only: no update depends on it
    "checkpoint_every",
    "grad_compression",
}
# What `train(strategy=...)` takes by name.
STRATEGIES = ("allreduce", "ps-sync", "ps-async", "ps-ssp", "pipeline")
_DEFAULT_CONFIG = TrainConfig()


@dataclass(frozen=True)
class TrainJob:
    model: str = "lenet300"
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    data: str | Dataset = "digits"  # a --data spec, or a data set already loaded
    config: TrainConfig = field(default_factory=TrainConfig)
    out: Path = Path("lenet300.pt")
    resume: bool = False
    workers: int = 1  # data-parallel processes on this machine (all-reduce, gloo)
    timeout_s: float = 300.0  # process-group timeout: a dead peer ends the job, never a hang
    ps: PSConfig | None = None  # the parameter-server strategy (None: all-reduce)
    pipeline: PipelineConfig | None = None  # pipeline model parallelism: one process per stage
    # Names of the settings the user gave explicitly (CLI flags); a resumed run checks them
    # against the checkpoint and takes every other setting from it.
    explicit: frozenset[str] = frozenset()


def default_out(model: str) -> Path:
    """The checkpoint a run of `model` writes when no `out` is given: NAME.pt in the working
    folder, NAME being the zoo name or, for an import path, the class or function name in
    lower case (`mypkg.nets:Net` -> net.pt), as `compress train` names it."""
    return Path(f"{model.rsplit(':', 1)[-1].rsplit('.', 1)[-1].lower()}.pt")


def ensemble_out(out: Path, k: int) -> Path:
    """Member `k`'s checkpoint in an ensemble written to `out`: teacher.pt -> teacher-0.pt."""
    return out.with_name(f"{out.stem}-{k}{out.suffix}")


def train(
    model: str | nn.Module,
    data: str | Dataset = "digits",
    config: TrainConfig = _DEFAULT_CONFIG,
    *,
    model_kwargs: dict[str, Any] | None = None,
    out: str | os.PathLike | None = None,
    strategy: str | PSConfig | PipelineConfig = "allreduce",
    workers: int | None = None,
    resume: bool = False,
    force: bool = False,
    timeout_s: float = 300.0,
    progress: Events | None = None,
    progress_factory: Callable[[], Events] | None = None,
    explicit: Collection[str] | None = None,
    return_model: bool = True,
) -> TrainResult:
    """Train a model on a data set, as `compress train` does, and return what the run did.

    Never prints or exits: progress goes to `progress` (silent by default), failures are
    exceptions (`compresskit.models.errors.InputError` for bad input, one line saying how to
    fix it; `StageError` for a run that failed, e.g. diverged or lost a worker).

    Args:
        model: what to train. A zoo name ("lenet300", "lenet5", "mlp", ...; see
            `compresskit.models.available()`), an import path "pkg.module:attr" naming an
            `nn.Module` class or a function that returns a module (the working folder is
            searched first, so "mynets:build_net" finds ./mynets.py), or an `nn.Module`
            instance. A name is built for the data (its `in_shape` and `num_classes`
            parameters filled in), trained, and checkpointed to `out`. An instance is trained
            in place, in this process, and no checkpoint is written: it cannot be rebuilt in
            other processes or from a file, so `out`, `resume`, `model_kwargs`, workers > 1
            and the other strategies need the model by name.
        data: a data spec as `--data` takes it ("digits", "digits:28", "mnist:DIR",
            "npz:FILE", "tokens[:L[:V]]"), a `compresskit.models.data.Dataset` already
            loaded, or in-memory data: (x, y) arrays or tensors, a TensorDataset, a
            DataLoader over one (split by `Dataset.from_arrays`'s rules).
        config: how to train (epochs, batch size, optimizer, learning rate, seed, ...): a
            `TrainConfig`; the default trains 10 epochs with Adam.
        model_kwargs: constructor keyword arguments for a model given by name.
        out: the checkpoint to write (resumable; written at each epoch's end and every
            `config.checkpoint_every` steps). Default: `default_out(model)`, NAME.pt in the
            working folder.
        strategy: "allreduce" (data parallel with all-reduce; one process when workers is 1),
            "ps-sync", "ps-async" or "ps-ssp" (a parameter server: `workers` workers and
            half as many servers, rounded up), "pipeline" (`workers` stages), or a
            `PSConfig` / `PipelineConfig` for every setting of those strategies.
        workers: data-parallel processes (the batch size is per worker); default 1, or the
            PSConfig's workers, or the PipelineConfig's stages.
        resume: continue from `out` if it exists, with the settings stored there. Settings
            counted as given (`explicit`) must match the stored ones, except epochs, device,
            checkpoint_every, grad_compression, eval_batch_size, microbatches and
            deterministic, which may change.
        force: replace an earlier checkpoint at `out`. Without it (or `resume`) an existing
            checkpoint there is refused (InputError), as `compress train` refuses it.
        timeout_s: process-group timeout: a dead or stuck worker ends the run after at most
            this many seconds.
        progress: an `Events` whose callbacks see the epochs, steps and checkpoints of this
            process's run. With several processes, rank 0 reports from its own process: it
            gets `progress_factory()` there, or a pickled copy of `progress`.
        progress_factory: makes rank 0's `Events` inside its process (several processes).
        explicit: with `resume`, the settings to check against the checkpoint ("model",
            "model_kwargs", "data" and `TrainConfig` field names); the others are taken from
            it. Default: the model, the model_kwargs and data when given, and every
            `config` field that differs from `TrainConfig()`'s.
        return_model: put the trained model in `result.model` (for a run in several
            processes, rank 0's weights are read back from the checkpoint). False leaves
            it None.

    Returns:
        The `TrainResult`: history, test accuracy, steps, samples, seconds, checkpoint path,
        the strategy's figures, and `model`, the trained model. `to_json()` is what
        `compress train --json` prints. Under torchrun every rank returns its own result;
        rank 0's is the one that reports.

    Raises:
        InputError: a model, data spec, config, strategy or file that cannot work, e.g.
            `config` not a `TrainConfig`, an import path that does not build an `nn.Module`,
            data that does not fit the model, `out` not writable, or an instance with
            workers > 1.
        StageError: the run failed (diverged, a worker died or timed out).
    """
    if not isinstance(config, TrainConfig):
        raise InputError(
            f"config must be a compresskit.distrib.TrainConfig, got {type(config).__name__}; "
            "e.g. TrainConfig(epochs=5, batch_size=64)"
        )
    data = as_dataset(data)  # (x, y) arrays, a TensorDataset or a DataLoader over one
    if not isinstance(data, str | Dataset):
        raise InputError(
            f"data must be a data spec ({SPECS_HELP}), in-memory (x, y) arrays, a "
            f"TensorDataset, or a compresskit Dataset (Dataset.from_arrays), got "
            f"{type(data).__name__}"
        )
    if model_kwargs is not None and not isinstance(model_kwargs, dict):
        raise InputError(
            f"model_kwargs must be a dict of constructor arguments, got "
            f"{type(model_kwargs).__name__}"
        )
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool)):
        raise InputError(f"workers must be a whole number, got {type(workers).__name__}")
    check_events(progress)
    if isinstance(model, nn.Module):
        with _callers_rng():
            return _train_instance(
                model, data, config, model_kwargs, out, strategy, workers, resume, progress
            )
    if not isinstance(model, str):
        raise InputError(
            "model must be a zoo name (e.g. 'lenet300'), an import path 'pkg.module:callable' "
            f"or a torch.nn.Module instance, got {type(model).__name__}"
        )
    given_processes = {"workers"} if workers is not None else set()
    if strategy != "allreduce":
        given_processes.add("strategy")
    workers, ps, pipe = _strategy(strategy, workers)
    check_fresh(Path(out) if out is not None else default_out(model), 1, resume, force)
    if explicit is None:
        explicit = (
            given_processes
            | {"model"}
            | {
                f.name
                for f in dataclasses.fields(TrainConfig)
                if getattr(config, f.name) != getattr(_DEFAULT_CONFIG, f.name)
            }
        )
        if model_kwargs is not None:
            explicit.add("model_kwargs")
        if not isinstance(data, str) or data != "digits":
            explicit.add("data")
    job = TrainJob(
        model=model,
        model_kwargs=dict(model_kwargs or {}),
        data=data,
        config=config,
        out=Path(out) if out is not None else default_out(model),
        resume=resume,
        workers=workers,
        timeout_s=timeout_s,
        ps=ps,
        pipeline=pipe,
        explicit=frozenset(explicit),
    )
    if progress_factory is None and progress is not None:
        progress_factory = functools.partial(_same, progress)
    with _callers_rng():
        result = run(job, progress, progress_factory)
    if (
        return_model
        and result is not None
        and result.model is None
        and launch.is_rank_zero()
        and result.checkpoint is not None
        and Path(result.checkpoint).is_file()
    ):
        # Trained in other processes: rank 0's weights, from the checkpoint it wrote.
        with _callers_rng():  # building draws initial weights, replaced by the checkpoint's
            result.model = checkpoint.load(result.checkpoint, train_state=False).build_model(
                allow_import=True
            )
    if not return_model and result is not None:
        result.model = None
    return result


MAX_TIMEOUT_S = 1e6  # 11.6 days; gloo's timeout in milliseconds overflowed past ~1e10 s


def _check_timeout(timeout_s: float) -> None:
    """A process-group timeout gloo can hold (1e11 s hung the job; 1e10, inf and nan failed
    it inside gloo)."""
    if not (isinstance(timeout_s, int | float) and 1 <= timeout_s <= MAX_TIMEOUT_S):
        shown = f"{timeout_s:g}" if isinstance(timeout_s, int | float) else brief(timeout_s)
        raise InputError(f"--timeout {shown}: give seconds from 1 to {MAX_TIMEOUT_S:g}")


@contextlib.contextmanager
def _callers_rng() -> Iterator[None]:
    """Training seeds torch's generator from the config (and draws from Python's and
    NumPy's); the caller's three generators are as they were afterwards, as after
    `compresskit.shrink`. (A GPU's generators are not restored.)"""
    py, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(np_state)


def _same(events: Events) -> Events:
    """`progress` in rank 0's process (a pickled copy: its callbacks run there)."""
    return events


def _strategy(
    strategy: str | PSConfig | PipelineConfig, workers: int | None
) -> tuple[int, PSConfig | None, PipelineConfig | None]:
    """(workers, parameter-server config, pipeline config) for `train(strategy=...)`."""
    if isinstance(strategy, PSConfig):
        return (strategy.workers if workers is None else workers), strategy, None
    if isinstance(strategy, PipelineConfig):
        return (strategy.stages if workers is None else workers), None, strategy
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise InputError(
            f"strategy {brief(strategy)}: give one of {', '.join(STRATEGIES)}, a "
            "compresskit.distrib.paramserver.PSConfig or a compresskit.distrib.pipeline."
            "PipelineConfig"
        )
    workers = 1 if workers is None else workers
    if strategy.startswith("ps-"):
        mode = strategy.removeprefix("ps-")
        if workers < 2:
            raise InputError(
                f"strategy {strategy!r} with workers={workers}: give workers=2 or more (with "
                f"half as many servers), or strategy=PSConfig(mode={mode!r}, workers=..., "
                "servers=...)"
            )
        return workers, PSConfig(mode=mode, workers=workers, servers=-(-workers // 2)), None
    if strategy == "pipeline":
        if workers < 2:
            raise InputError(
                f"strategy 'pipeline' with workers={workers}: give workers=K for K stages (one "
                "process each), or strategy=PipelineConfig(stages=K, ...)"
            )
        return workers, None, PipelineConfig(stages=workers)
    return workers, None, None


def _train_instance(
    model: nn.Module,
    spec: str | Dataset,
    config: TrainConfig,
    model_kwargs,
    out,
    strategy,
    workers: int | None,
    resume: bool,
    progress: Events | None,
) -> TrainResult:
    """`train` of an nn.Module instance: in place, in this process, no checkpoint."""
    name = type(model).__name__
    fix = (
        "pass the model by name (a zoo name or 'pkg.module:callable' that builds it) so "
        "that each process can build it"
    )
    if (workers or 1) > 1 or strategy != "allreduce":
        what = f"workers={workers}" if (workers or 1) > 1 else f"strategy={strategy!r}"
        raise InputError(f"{what}: a model instance ({name}) trains in this process only; {fix}")
    if launch.DistEnv.from_torchrun() is not None:
        raise InputError(f"torchrun: a model instance ({name}) trains in one process; {fix}")
    for given, what in (
        (out is not None, "out"),
        (resume, "resume"),
        (model_kwargs is not None, "model_kwargs"),
    ):
        if given:
            raise InputError(
                f"{what}: a model instance ({name}) is trained in place, without a checkpoint "
                "(a checkpoint records how to build its model); pass the model by name, or "
                "save result.model.state_dict() yourself"
            )
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"device {config.device!r}: no CUDA device is visible; use cpu")
    ds = _load(spec, data.forward_input(model))
    data.check_fits(model, ds, name)
    result = fit(model, ds, config, events=progress)
    result.model = model
    return result


def run(
    job: TrainJob,
    events: Events | None = None,
    events_factory: Callable[[], Events] | None = None,
) -> TrainResult:
    """Train as `job` says. With `workers` > 1 (or under torchrun) every rank runs the same
    loop data-parallel; rank 0 reports through `events_factory()` (events cannot cross
    processes) and writes the checkpoint."""
    if job.workers < 1:
        raise InputError(f"--workers {job.workers}: give 1 or more")
    _check_timeout(job.timeout_s)
    check_writable(job.out, inputs=spec_files(job.data))
    checkpoint.check_out_name(job.out)
    if not job.resume:  # --resume reads the file and says what is wrong with it
        checkpoint.check_replaceable(Path(job.out))
    _remove_stale_writes(job.out)
    gpu = job.config.device.startswith("cuda")
    if gpu:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InputError("--device cuda: no CUDA device is visible; use --device cpu")
        if job.workers > count:
            raise InputError(
                f"--workers {job.workers} with --device cuda: this machine has {count} GPU(s); "
                f"give --workers {count} or fewer"
            )
    if launch.DistEnv.from_torchrun() is not None:  # ranks on several hosts: torchrun's job
        return _dispatch(job, events_factory, gpu)
    # A second run writing this checkpoint (its epoch checkpoints too) is refused while this
    # one goes: both finished with exit 0 and the file held whichever wrote last.
    with output_lock(job.out):
        return _run_here(job, events, events_factory, gpu)


def _run_here(job: TrainJob, events, events_factory, gpu: bool) -> TrainResult:
    # more local processes than the machine runs: refused before anything loads
    if job.ps is not None:
        launch.check_processes(job.ps.workers + job.ps.servers)
    elif job.pipeline is not None:
        launch.check_processes(job.pipeline.stages)
    else:
        launch.check_processes(job.workers)
    if job.pipeline is None and job.ps is None and job.workers == 1:
        return _run(job, events, keep_model=True)
    # Spawned ranks are killed outright when the job stops (Ctrl-C, a dead peer): a
    # checkpoint rank 0 was writing stays behind as .OUT.xxxx.tmp unless removed here.
    started = time.time()
    try:
        return _dispatch(job, events_factory, gpu)
    except BaseException:
        _remove_partial_writes(job.out, started)
        raise


def _dispatch(job: TrainJob, events_factory, gpu: bool) -> TrainResult:
    if job.pipeline is not None:
        return _run_pipeline(job, events_factory)
    if job.ps is not None:
        return _run_ps(job, events_factory)
    fn = functools.partial(_rank_main, job, events_factory)
    backend = "nccl" if gpu else "gloo"  # NCCL on GPUs, gloo on CPUs
    return launch.run(fn, job.workers, job.timeout_s, backend=backend)


def _remove_partial_writes(out: Path, since: float, before: float = math.inf) -> None:
    """The temporary files `atomic_path` made for `out` since `since` (a killed rank's), last
    written before `before`."""
    for tmp in Path(out).parent.glob(f"{glob.escape(hidden(Path(out).name))}.*.tmp"):
        with contextlib.suppress(OSError):
            if since - 1 <= tmp.stat().st_mtime < before:
                tmp.unlink()


STALE_WRITE_S = 60.0  # a checkpoint being written updates its temporary file's mtime


def _remove_stale_writes(out: Path) -> None:
    """Temporary files of `out` left by a run killed outright (SIGKILL, the OOM killer)
    mid-write: nothing else removes them, and each is checkpoint-sized (a VGG's 56 MB piled
    up over kill-and-resume cycles). Untouched for a minute, no live write owns them."""
    _remove_partial_writes(out, 0.0, before=time.time() - STALE_WRITE_S)


def _run_ps(job: TrainJob, events_factory) -> TrainResult:
    """N workers and S servers: N + S processes, or the torchrun job's ranks."""
    ps = job.ps
    if job.config.device != "cpu":
        raise InputError(
            "--device cuda: the parameter-server strategies run on the CPU (gloo point-to-point); "
            "use --strategy allreduce on GPUs"
        )
    if job.workers != ps.workers:
        raise InputError(f"--workers {job.workers} and the parameter server's {ps.workers} differ")
    if job.config.bn_refresh:
        raise InputError(
            f"--bn-refresh {job.config.bn_refresh}: the parameter servers hold the weights, not "
            "the workers' BatchNorm statistics; drop --bn-refresh"
        )
    env = launch.DistEnv.from_torchrun()
    if env is not None and env.world != ps.workers + ps.servers:
        raise InputError(
            f"torchrun started {env.world} processes; --workers {ps.workers} + --servers "
            f"{ps.servers} need {ps.workers + ps.servers} (set --nproc-per-node and --nnodes)"
        )
    # Bad model, data or shard counts fail here, in one process, before N + S start.
    model = _prepare(job, Events())[2]
    paramserver.shard_bounds(
        sum(p.numel() for p in model.parameters() if p.requires_grad), ps.servers
    )
    # Asynchronous modes carry on without a dead worker (not rank 0: it reports the run).
    expendable = range(1, ps.workers) if ps.mode != "sync" else ()
    lost: list[int] = []
    fn = functools.partial(_rank_main, job, events_factory)
    result = launch.run(
        fn, ps.workers + ps.servers, job.timeout_s, name=ps.name, expendable=expendable, lost=lost
    )
    if lost and result is not None:
        known = set(result.strategy.get("lost_workers", []))
        result.strategy["lost_workers"] = sorted(known | set(lost))
    return result


def _run_pipeline(job: TrainJob, events_factory) -> TrainResult:
    """K stages: K processes (spawned here, or the torchrun job's ranks), rank r is stage r."""
    pp = job.pipeline
    k = pp.stages
    if job.ps is not None:
        raise InputError(
            f"--strategy ps-{job.ps.mode} and a pipeline do not combine; drop the pipeline flags"
        )
    if job.config.grad_compression != "none":
        raise InputError(
            f"--grad-compression {job.config.grad_compression} compresses data-parallel "
            "gradients; pipeline stages send activations: drop --grad-compression"
        )
    if job.config.bn_refresh:
        raise InputError(
            f"--bn-refresh {job.config.bn_refresh}: the pipeline's stages do not re-estimate "
            "BatchNorm statistics; drop --bn-refresh"
        )
    if job.config.microbatches != 1:
        raise InputError(
            f"TrainConfig(microbatches={job.config.microbatches}) accumulates gradients in one "
            "process; a pipeline's micro-batches are PipelineConfig(microbatches=M): give them there"
        )
    if job.workers not in (1, k):
        raise InputError(
            f"--workers {job.workers} with --stages {k}: the pipeline runs one process per stage "
            f"(no data parallelism across pipelines yet); give --workers {k} or leave it out"
        )
    env = launch.DistEnv.from_torchrun()
    if env is not None and env.world != k:
        raise InputError(
            f"torchrun started {env.world} processes; --stages {k} needs {k} "
            "(set --nproc-per-node and --nnodes)"
        )
    gpu = job.config.device.startswith("cuda")
    if gpu and env is None and torch.cuda.device_count() < k:
        count = torch.cuda.device_count()
        # NCCL refuses two ranks on one GPU, so the stages cannot share one.
        fix = (
            f"give --stages {count} or fewer"
            if count >= 2
            else "run the pipeline with --device cpu, or train on the one GPU without a pipeline"
        )
        raise InputError(
            f"--stages {k} with --device cuda: this machine has {count} GPU(s) and each stage "
            f"needs its own (NCCL); {fix}"
        )
    if pp.microbatches is not None and not job.resume:  # a given M, before anything loads
        pp.check_batch(job.config.batch_size)  # (a resumed run's batch is the checkpoint's)
    # A bad cut (too many stages, an unknown --split layer, an untraceable model) fails here,
    # in one process, before the K processes start; every rank plans the same cut again.
    resumed, ds, model, spec, _ = _prepare(job, Events())
    # M left to the run: chosen once here, from the model (BatchNorm) and the batch, and
    # handed to every rank in the job (torchrun ranks each choose the same).
    pp = pp.resolved(model, resumed.config.batch_size)
    pp.check_batch(resumed.config.batch_size)
    job = dataclasses.replace(job, pipeline=pp)
    layout = pipeline.plan(model, ds.x_train[:2], pp, spec.name)
    micro = resumed.config.batch_size // pp.microbatches
    pipeline.trace(model, layout.split, ds.x_train[:1].expand(micro, *ds.in_shape), spec.name)
    fn = functools.partial(_rank_main, job, events_factory)
    backend = "nccl" if gpu else "gloo"
    return launch.run(fn, k, job.timeout_s, backend=backend, name=pipeline.stage_name)


def run_ensemble(
    job: TrainJob, members: int, events_factory: Callable[[], Events] | None = None
) -> list[tuple[Path, TrainResult]]:
    """Train `members` independent models side by side, seeds seed..seed+K-1, one process
    each; checkpoints are `--out` with `-0`, `-1`, ... before the suffix."""
    if job.ps is not None or job.pipeline is not None:
        name = f"ps-{job.ps.mode}" if job.ps is not None else "pipeline"
        raise InputError(
            f"--ensemble trains independent one-process members; drop --strategy {name}"
        )
    jobs = [
        dataclasses.replace(
            job,
            out=ensemble_out(job.out, k),
            config=dataclasses.replace(job.config, seed=job.config.seed + k),
            workers=1,
        )
        for k in range(members)
    ]
    _check_timeout(job.timeout_s)
    for j in jobs:
        check_writable(j.out, inputs=spec_files(j.data))
        checkpoint.check_out_name(j.out)
        checkpoint.check_replaceable(Path(j.out))
    results = launch.run_independent(functools.partial(_member, jobs, events_factory), members)
    return [(j.out, r) for j, r in zip(jobs, results, strict=True)]


def _member(jobs, events_factory, index: int, count: int) -> TrainResult:
    # Member 0 reports progress; the others train quietly beside it.
    return _rank_main(jobs[index], events_factory, index, count)


def _rank_main(job: TrainJob, events_factory, rank: int, world: int) -> TrainResult:
    events = events_factory() if events_factory is not None and rank == 0 else None
    try:
        return _run(job, events, rank)
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()


def _run(
    job: TrainJob, events: Events | None, rank: int = 0, keep_model: bool = False
) -> TrainResult | None:
    """One rank's run. `keep_model`: put the trained model in the result (in this process
    only: a result that crosses processes leaves it out)."""
    events = events or Events()
    job, ds, model, spec, resume = _prepare(job, events)
    events.info(
        f"data {ds.describe()}; model {spec.name}, {zoo.count_parameters(model):,} parameters"
    )
    meta = {
        "data": _spec(job.data),
        "data_fingerprint": data.fingerprint(ds),
        "seed": job.config.seed,
        "parameters": zoo.count_parameters(model),
    }
    if job.pipeline is not None:
        meta["strategy"] = "pipeline"
        return pipeline.fit(
            model,
            ds,
            job.config,
            job.pipeline,
            checkpointer=Checkpointer(job.out, spec, meta),
            resume=resume,
            events=events,
            label=spec.name,
        )
    updater = None
    if job.ps is not None:
        cfg, ps = job.config, job.ps
        at = (resume["epoch"], resume["step"]) if resume else (0, 0)
        n = len(ds.y_train)
        if rank >= ps.workers:  # a server: hold a shard until rank 0 says goodbye
            deal = paramserver.Deal.plan(ps, n, cfg.batch_size, cfg.epochs, at)
            optimizer = functools.partial(optimizer_for, cfg=cfg)
            paramserver.serve(ps, rank, model, optimizer, cfg.grad_compression, deal, resume)
            return None
        meta["strategy"] = f"ps-{ps.mode}"
        updater = paramserver.PSWorker(
            ps,
            rank,
            model,
            n,
            cfg.batch_size,
            cfg.epochs,
            cfg.optimizer,
            cfg.grad_compression,
            resume_at=at,
            store=launch.store(),
        )
        if ps.workers > 1:  # a workers-only all-reduce would hold the asynchronous ones back
            events.info(
                f"per epoch, train loss and accuracy are worker 0's batches (1 of {ps.workers} "
                "workers, each training apart); test accuracy is the servers' weights"
            )
    result = fit(
        model,
        ds,
        job.config,
        checkpointer=Checkpointer(job.out, spec, meta),
        resume=resume,
        events=events,
        updater=updater,
        # a resumed run's global batch changes only where the processes were given on purpose
        elastic=bool({"workers", "strategy"} & job.explicit),
    )
    if keep_model:
        result.model = model
    return result


def _prepare(job: TrainJob, events: Events):
    """(job as resumed, data, model with its weights, spec, train_state or None)."""
    stored = _stored_run(job)
    if stored is not None:
        job, ck = stored
        # Built first: building checks the consent to import code the checkpoint names.
        model = ck.build_model(allow_import="model" in job.explicit)
        ds = _load(job.data, data.forward_input(model))
        _check_same_data(job, ck, ds)
        data.check_fits(model, ds, job.model)
        spec, resume = ck.spec, ck.train_state
        if resume["epoch"] >= job.config.epochs:
            events.info(f"{job.out} has finished its {job.config.epochs} epochs; nothing to train")
        else:
            events.info(
                f"resuming {job.out} at epoch {resume['epoch'] + 1}, step {resume['step']} "
                f"of {job.config.epochs} epochs"
            )
    else:
        if job.resume:  # a requeued job's first run; a mistyped path would say so here too
            events.info(f"nothing to resume at {job.out} yet: training from the start")
        ds = _load(job.data, _input_name(job.model))
        data.check_kind(job.model, ds)
        spec = zoo.resolve_spec(job.model, job.model_kwargs, ds.in_shape, ds.num_classes)
        model = zoo.build(spec, seed=job.config.seed)
        data.check_fits(model, ds, job.model)
        resume = None
    if job.config.bn_refresh and batch_statistics(model) is None:
        raise InputError(
            f"--bn-refresh {job.config.bn_refresh}: model {spec.name} has no BatchNorm layer "
            "whose statistics it could refresh; drop --bn-refresh"
        )
    return job, ds, model, spec, resume


def _check_same_data(job: TrainJob, ck, ds: Dataset) -> None:
    """--resume continues on the samples and splits it trained on, not only the same --data
    string. A checkpoint from before the fingerprint was kept is taken as it is, except on an
    npz or arrays, whose split changed then (a fifth of each class to test, 2026-11-29)."""
    kept = ck.metadata.get("data_fingerprint")
    if kept is None:
        if str(ds.spec).startswith(("npz:", "arrays")) and not data.splits_given(ds.spec):
            raise InputError(
                f"--resume (resume=True): {job.out} was written before compress recorded which "
                "samples it trained on, and the split of an npz without test arrays changed "
                "since (a fifth of each class is test): drop --resume and pass --force "
                "(force=True) to train afresh"
            )
        return
    if kept != data.fingerprint(ds):
        raise InputError(
            f"--resume (resume=True): the data ({ds.spec}) gives other samples or splits than "
            f"{job.out} trained on; resume with the same data, or drop --resume and pass "
            "--force (force=True) to train afresh"
        )


def _load(spec: str | Dataset, input_name: str | None) -> Dataset:
    """The data set a --data spec names, or the one given already loaded."""
    if isinstance(spec, str) and spec.startswith("arrays"):  # a resume's recorded "spec"
        raise InputError(
            "the checkpoint was trained on arrays given in Python; pass the same arrays again "
            "(data=(x, y), or a Dataset)"
        )
    return spec if isinstance(spec, Dataset) else data.load(spec, input_name)


def _spec(d: str | Dataset) -> str:
    """The data spec as a checkpoint records it (npz and mnist paths absolute)."""
    return data.recorded_spec(d.spec if isinstance(d, Dataset) else d)


def _input_name(model: str) -> str | None:
    """The model class's forward argument: an npz array of that name is its input (e.g. `ids`
    token ids for textcls). A model with two required arguments is refused here, before the
    data is read."""
    cls = zoo.resolve(model)
    data.check_one_input(cls, model)
    return data.forward_input(cls)


# How errors name the settings: the Python API's arguments, or compress train's flags.
API_NAMES = {"out": "out", "resume": "resume=True", "force": "force=True"}
CLI_NAMES = {"out": "--out", "resume": "--resume", "force": "--force"}


def check_fresh(
    out: Path, ensemble: int = 1, resume: bool = False, force: bool = False, names=API_NAMES
) -> None:
    """An earlier checkpoint at `out` (each ensemble member's) is replaced only on purpose
    (`force`) or continued (`resume`): a re-run of last week's command had silently trained
    the teacher afresh over hours of work. Files that are not torch checkpoints are left to
    the writer's own check, which says what they are."""
    if resume and force:
        raise InputError(
            f"{names['resume']} continues {names['out']}'s checkpoint, {names['force']} starts "
            "over it: give one"
        )
    if resume:
        return
    out = Path(out)
    paths = [out] if ensemble == 1 else [ensemble_out(out, k) for k in range(max(ensemble, 0))]
    found = [_ours(path, names, train_state=not force) for path in paths]  # each read once
    if force:
        return
    for path, ck in zip(paths, found, strict=True):
        if ck is None:
            continue
        if resumable(ck):
            what = "an earlier training checkpoint; " + (
                f"{names['resume']} continues it, " if ensemble == 1 else ""
            )
        else:  # a shrink output: nothing to resume
            what = "weights without training state (nothing to resume); "
        raise InputError(
            f"{names['out']} {path}: holds {what}{names['force']} trains afresh over it, or "
            f"give another {names['out']}"
        )


def _ours(path: Path, names: dict[str, str], train_state: bool) -> checkpoint.Checkpoint | None:
    """The checkpoint compress wrote at `path`, read once (None: no torch file there, which
    the writer's own check names). Another torch file is refused: --force replaced any
    `torch.save` file, a user's data {x, y} among them."""
    if not path.is_file() or not path.stat().st_size or not checkpoint.is_torch_file(path):
        return None
    try:
        ck = checkpoint.load(path, train_state=train_state)
    except InputError:  # a bare tensor, a list: not a checkpoint at all
        ck = None
    if ck is None or ck.spec is None:
        raise InputError(
            f"{names['out']} {path}: holds tensors compress did not write (a state_dict or "
            f"other data), which {names['force']} never replaces; give another {names['out']} "
            "or remove the file yourself"
        )
    return ck


def resumable(ck: checkpoint.Checkpoint) -> bool:
    """Whether a checkpoint holds what --resume continues: a named model and its training
    state (a bare state_dict or a shrink output holds weights only)."""
    return ck.spec is not None and isinstance(ck.train_state, dict) and "config" in ck.train_state


def _stored_run(job: TrainJob) -> tuple[TrainJob, checkpoint.Checkpoint] | None:
    """With --resume and an existing --out: the job as the checkpoint recorded it."""
    if not job.resume or not job.out.exists():
        return None
    ck = checkpoint.load(job.out)
    if ck.spec is None:  # --force would not replace it either (`_ours`)
        raise InputError(
            f"{job.out}: holds tensors compress did not write (a state_dict or other data), "
            "with no training state to resume from; give another --out"
        )
    if not resumable(ck):
        raise InputError(
            f"{job.out}: holds no training state to resume from; drop --resume and pass "
            "--force to train afresh over it, or give another --out"
        )
    try:
        check_train_state(ck.train_state)
    except InputError as e:
        raise InputError(f"{job.out}: {e}") from None
    stored_cfg = TrainConfig.from_dict(ck.train_state["config"], strict=False)
    stored = {
        "model": ck.spec.name,
        "data": _spec(ck.metadata.get("data", _spec(job.data))),
        **{f.name: getattr(stored_cfg, f.name) for f in dataclasses.fields(TrainConfig)},
    }
    stored["model_kwargs"] = {
        k: v for k, v in ck.spec.kwargs.items() if k not in ("in_shape", "num_classes")
    }
    stored["lr"] = stored_cfg.learning_rate  # compare what trains, not how it was written
    given = {
        "model": job.model,
        "data": _spec(job.data),
        "model_kwargs": job.model_kwargs,
        **dataclasses.asdict(job.config),
        "lr": job.config.learning_rate,
    }
    for name in sorted(job.explicit & stored.keys()):
        if name not in _RESUME_MAY_CHANGE and given[name] != stored[name]:
            flag = "--" + name.replace("_", "-")
            raise InputError(
                f"--resume: {flag} {given[name]!r} differs from {job.out}'s {stored[name]!r}; "
                f"drop {flag} or start over without --resume"
            )
    keep = {k: getattr(job.config, k) for k in _RESUME_MAY_CHANGE if k in job.explicit}
    # When to test is the caller's, not the checkpoint's: it changes no weight.
    keep["evaluate"] = job.config.evaluate
    config = dataclasses.replace(stored_cfg, **keep)
    if ck.train_state["epoch"] > config.epochs:
        raise InputError(
            f"--resume: {job.out} has already trained {ck.train_state['epoch']} epochs, "
            f"more than --epochs {config.epochs}"
        )
    torch.manual_seed(config.seed)
    # A data set given already loaded stays the one trained on (its spec is what was checked).
    ds = job.data if isinstance(job.data, Dataset) else stored["data"]
    return dataclasses.replace(job, model=ck.spec.name, data=ds, config=config), ck
