"""`compress train` as a library call: build the model for the data, resume if asked, fit.

`run(TrainJob)` is what the CLI calls; the data-parallel launcher will call it once per rank.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compresskit.distrib import launch, paramserver, pipeline
from compresskit.distrib.paramserver import PSConfig
from compresskit.distrib.pipeline import PipelineConfig
from compresskit.distrib.trainer import (
    Checkpointer,
    Events,
    TrainConfig,
    TrainResult,
    fit,
    optimizer_for,
)
from compresskit.models import checkpoint, data, zoo
from compresskit.models.errors import InputError
from compresskit.models.fileio import check_writable

# Settings a resumed run may change: the rest must match the checkpoint's.
_RESUME_MAY_CHANGE = {"epochs", "eval_batch_size", "device", "checkpoint_every", "grad_compression"}


@dataclass(frozen=True)
class TrainJob:
    model: str = "lenet300"
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    data: str = "digits"
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
    check_writable(job.out)
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
    if job.pipeline is not None:
        return _run_pipeline(job, events_factory)
    if job.ps is not None:
        return _run_ps(job, events_factory)
    if job.workers > 1 or launch.DistEnv.from_torchrun() is not None:
        fn = functools.partial(_rank_main, job, events_factory)
        backend = "nccl" if gpu else "gloo"  # NCCL on GPUs, gloo on CPUs
        return launch.run(fn, job.workers, job.timeout_s, backend=backend)
    return _run(job, events)


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
        raise InputError(
            f"--stages {k} with --device cuda: this machine has {torch.cuda.device_count()} "
            f"GPU(s), one per stage is needed; give --stages {torch.cuda.device_count()} or fewer"
        )
    pp.check_batch(job.config.batch_size)
    # A bad cut (too many stages, an unknown --split layer, an untraceable model) fails here,
    # in one process, before the K processes start; every rank plans the same cut again.
    resumed, ds, model, spec, _ = _prepare(job, Events())
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
            out=job.out.with_name(f"{job.out.stem}-{k}{job.out.suffix}"),
            config=dataclasses.replace(job.config, seed=job.config.seed + k),
            workers=1,
        )
        for k in range(members)
    ]
    for j in jobs:
        check_writable(j.out)
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


def _run(job: TrainJob, events: Events | None, rank: int = 0) -> TrainResult | None:
    events = events or Events()
    job, ds, model, spec, resume = _prepare(job, events)
    events.info(
        f"data {ds.describe()}; model {spec.name}, {zoo.count_parameters(model):,} parameters"
    )
    meta = {"data": job.data, "seed": job.config.seed, "parameters": zoo.count_parameters(model)}
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
    return fit(
        model,
        ds,
        job.config,
        checkpointer=Checkpointer(job.out, spec, meta),
        resume=resume,
        events=events,
        updater=updater,
    )


def _prepare(job: TrainJob, events: Events):
    """(job as resumed, data, model with its weights, spec, train_state or None)."""
    stored = _stored_run(job)
    if stored is not None:
        job, ck = stored
        # Built first: building checks the consent to import code the checkpoint names.
        model = ck.build_model(allow_import="model" in job.explicit)
        ds = data.load(job.data, data.forward_input(model))
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
        ds = data.load(job.data, _input_name(job.model))
        data.check_kind(job.model, ds)
        spec = zoo.resolve_spec(job.model, job.model_kwargs, ds.in_shape, ds.num_classes)
        model = zoo.build(spec, seed=job.config.seed)
        data.check_fits(model, ds, job.model)
        resume = None
    return job, ds, model, spec, resume


def _input_name(model: str) -> str | None:
    """The model class's forward argument: an npz array of that name is its input (e.g. `ids`
    token ids for textcls). A model with two required arguments is refused here, before the
    data is read."""
    cls = zoo.resolve(model)
    data.check_one_input(cls, model)
    return data.forward_input(cls)


def _stored_run(job: TrainJob) -> tuple[TrainJob, checkpoint.Checkpoint] | None:
    """With --resume and an existing --out: the job as the checkpoint recorded it."""
    if not job.resume or not job.out.exists():
        return None
    ck = checkpoint.load(job.out)
    if ck.spec is None or ck.train_state is None or "config" not in ck.train_state:
        raise InputError(
            f"{job.out}: holds no training state to resume from; drop --resume to start over"
        )
    stored_cfg = TrainConfig.from_dict(ck.train_state["config"])
    stored = {
        "model": ck.spec.name,
        "data": ck.metadata.get("data", job.data),
        **{f.name: getattr(stored_cfg, f.name) for f in dataclasses.fields(TrainConfig)},
    }
    stored["model_kwargs"] = {
        k: v for k, v in ck.spec.kwargs.items() if k not in ("in_shape", "num_classes")
    }
    stored["lr"] = stored_cfg.learning_rate  # compare what trains, not how it was written
    given = {
        "model": job.model,
        "data": job.data,
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
    config = dataclasses.replace(stored_cfg, **keep)
    if ck.train_state["epoch"] > config.epochs:
        raise InputError(
            f"--resume: {job.out} has already trained {ck.train_state['epoch']} epochs, "
            f"more than --epochs {config.epochs}"
        )
    torch.manual_seed(config.seed)
    return dataclasses.replace(job, model=ck.spec.name, data=stored["data"], config=config), ck
