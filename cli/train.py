"""`compress train`: flags -> `compresskit.distrib.train` -> a table or one JSON object."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import click

from compresskit.cli import render
from compresskit.cli.main import (
    Interrupted,
    OutPath,
    emit_json,
    json_option,
    log_option,
    log_path,
)
from compresskit.distrib import launch
from compresskit.distrib import train as run_train
from compresskit.distrib.job import (
    CLI_NAMES,
    TrainJob,
    check_fresh,
    default_out,
    run_ensemble,
)
from compresskit.distrib.paramserver import PSConfig
from compresskit.distrib.pipeline import BALANCES, PipelineConfig
from compresskit.distrib.pipeline import SCHEDULES as PIPELINE_SCHEDULES
from compresskit.distrib.trainer import DEFAULT_LR, OPTIMIZERS, PRECISIONS, SCHEDULES, TrainConfig
from compresskit.models.data import SPECS_HELP
from compresskit.models.errors import InputError
from compresskit.models.zoo import available, parse_kwargs

PS_STRATEGIES = ("ps-sync", "ps-async", "ps-ssp")

# Settings whose explicit use is checked against the checkpoint on --resume.
_SETTINGS = (
    "model",
    "model_kwargs",
    "data",
    "epochs",
    "batch_size",
    "lr",
    "schedule",
    "warmup_steps",
    "optimizer",
    "weight_decay",
    "seed",
    "precision",
    "checkpoint_every",
    "grad_compression",
    "device",
    "deterministic",
    "microbatches",
    "bn_refresh",
)


@click.command(
    epilog="""\b
Examples:
  compress train --model lenet300 --data digits --epochs 10
  compress train --model lenet5 --data mnist:~/mnist --epochs 5 --out lenet5.pt
  compress train --model mypkg.nets:Net --model-kwargs '{"width": 64}' --data npz:my.npz
  compress train --out lenet5.pt --resume      # continue an interrupted run
  compress train --model vgg --strategy pipeline --stages 2
  compress train --model lenet300 --strategy pipeline --stages 2 --microbatches 4
  compress train --model mypkg.nets:ViT --batch-size 64 --microbatches 4   # 1/4 the memory
"""
)
@click.option(
    "--model",
    default="lenet300",
    show_default=True,
    help=f"Zoo name ({', '.join(available())}) or pkg.module:Class (a class or a factory).",
)
@click.option(
    "--model-kwargs",
    default=None,
    metavar="JSON",
    help="""Constructor kwargs as a JSON object, e.g. '{"width": 64}'.""",
)
@click.option("--data", default="digits", show_default=True, metavar="SPEC", help=SPECS_HELP + ".")
@click.option("--epochs", type=click.IntRange(min=1, max=10_000), default=10, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True)
@click.option(
    "--lr",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Peak learning rate [default: sgd 0.05, adam 0.003].",
)
@click.option(
    "--schedule",
    type=click.Choice(SCHEDULES),
    default="cosine",
    show_default=True,
    help="Learning-rate schedule over all steps.",
)
@click.option(
    "--warmup-steps",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Linear learning-rate warm-up steps.",
)
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default="adam", show_default=True)
@click.option("--weight-decay", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=0, show_default=True)
@click.option(
    "--precision",
    type=click.Choice(PRECISIONS),
    default="fp32",
    show_default=True,
    help="bf16 runs the forward pass under autocast.",
)
@click.option(
    "--out",
    type=OutPath(dir_okay=False, path_type=Path),
    default=None,
    help="Checkpoint to write [default: MODEL.pt].",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Continue from --out's checkpoint (with its settings) if it exists.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Train afresh over an earlier checkpoint at --out (without it, an existing --out is "
    "refused: --resume continues it).",
)
@click.option(
    "--checkpoint-every",
    type=click.IntRange(min=0),
    default=0,
    metavar="STEPS",
    help="Also checkpoint every STEPS steps (0: at each epoch's end only).",
)
@click.option(
    "--workers",
    type=int,
    default=1,
    show_default=True,
    help="Data-parallel worker processes (all-reduce on gloo); batch size is per worker.",
)
@click.option(
    "--ensemble",
    type=int,
    default=1,
    show_default=True,
    metavar="K",
    help="Train K independent models (seeds seed..seed+K-1) side by side: OUT-0.pt ...",
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="Train on the CPU or on GPUs (one per worker, NCCL).",
)
@click.option(
    "--scale-lr",
    is_flag=True,
    help="Multiply the learning rate by --workers (Goyal et al. 2017; pair with --warmup-steps).",
)
@click.option(
    "--strategy",
    type=click.Choice(["allreduce", *PS_STRATEGIES, "pipeline"]),
    default="allreduce",
    show_default=True,
    help="Data-parallel strategy: all-reduce (DDP), or a parameter server that is "
    "synchronous, asynchronous (Downpour) or stale-synchronous (bounded staleness); or "
    "pipeline model parallelism (one process per stage, see --stages).",
)
@click.option(
    "--stages",
    type=int,
    default=None,
    metavar="K",
    help="Pipeline: cut the model into K stages, one process each (balanced by --balance, "
    "or at --split) [default: from --split, or --workers].",
)
@click.option(
    "--microbatches",
    type=int,
    default=None,
    metavar="M",
    help="Micro-batches per batch. Pipeline: M must divide --batch-size (the whole batch) "
    "[default: the most up to 4 that divide it, keeping 32 samples per micro-batch in a "
    "model with BatchNorm]. Other strategies: run each batch as M slices one after another "
    "and step once on their summed gradients (gradient accumulation: the same update, dropout aside, in "
    "about 1/M of the activation memory; not for models with BatchNorm) [default: 1].",
)
@click.option(
    "--split",
    default=None,
    metavar="LAYER,...",
    help="Pipeline: begin a stage at each of these layers (module names, e.g. layer2,layer4).",
)
@click.option(
    "--pipeline-schedule",
    type=click.Choice(PIPELINE_SCHEDULES),
    default="gpipe",
    show_default=True,
    help="Pipeline: GPipe (all forwards, then all backwards) or 1F1B (needs M >= K).",
)
@click.option(
    "--balance",
    type=click.Choice(BALANCES),
    default="flops",
    show_default=True,
    help="Pipeline: what the automatic cut evens out between the stages.",
)
@click.option(
    "--servers",
    type=int,
    default=None,
    metavar="S",
    help="Parameter-server processes, each holding a shard of the weights "
    "[default: half of --workers, rounded up].",
)
@click.option(
    "--staleness",
    type=int,
    default=4,
    show_default=True,
    metavar="TAU",
    help="ps-ssp: clocks a worker may run ahead of the slowest batch still being computed; "
    "a clock is a round of --workers batches (0: bulk-synchronous rounds).",
)
@click.option(
    "--sync-warmup-epochs",
    type=int,
    default=0,
    show_default=True,
    help="ps-async: train synchronously for this many epochs first (as DistBelief did).",
)
@click.option(
    "--straggler",
    default=None,
    metavar="RANK:FACTOR",
    help="Parameter server: slow worker RANK down FACTOR times (after each step's compute "
    "it sleeps FACTOR-1 times as long), to compare the strategies with a straggler.",
)
@click.option(
    "--grad-compression",
    type=click.Choice(["none", "fp16", "bf16"]),
    default="none",
    show_default=True,
    help="Gradients on the wire (DDP communication hook; bf16 works on gloo too).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=1),
    default=300,
    show_default=True,
    metavar="SECONDS",
    help="Process-group timeout: a dead or stuck worker ends the job after at most this.",
)
@click.option(
    "--deterministic/--no-deterministic",
    default=False,
    help="Deterministic kernels only: the same seed gives the same bits on a GPU too, and a "
    "resumed run ends where the uninterrupted one does (a CPU already does; a GPU runs slower). "
    "An op with no such kernel stops the run, naming it. A resumed run keeps the checkpoint's "
    "choice unless given either flag.  [default: no-deterministic]",
)
@click.option(
    "--bn-refresh",
    type=click.IntRange(min=0),
    default=0,
    metavar="N",
    help="After the last epoch, re-estimate BatchNorm's running statistics on N training "
    "samples under the final weights (for slow averages: torchvision's MobileNetV3 and "
    "EfficientNet use momentum 0.01). Refused with a parameter server or the pipeline "
    "strategy.  [default: 0, off]",
)
@click.option("-q", "--quiet", is_flag=True, help="No per-epoch lines on stderr.")
@json_option
@log_option
@click.pass_context
def train(
    ctx: click.Context,
    model: str,
    model_kwargs: str | None,
    data: str,
    epochs: int,
    batch_size: int,
    lr: float | None,
    schedule: str,
    warmup_steps: int,
    optimizer: str,
    weight_decay: float,
    seed: int,
    precision: str,
    out: Path | None,
    resume: bool,
    force: bool,
    checkpoint_every: int,
    workers: int,
    ensemble: int,
    device: str,
    scale_lr: bool,
    strategy: str,
    stages: int | None,
    microbatches: int | None,
    split: str | None,
    pipeline_schedule: str,
    balance: str,
    servers: int | None,
    staleness: int,
    sync_warmup_epochs: int,
    straggler: str | None,
    grad_compression: str,
    timeout: float,
    deterministic: bool,
    bn_refresh: int,
    quiet: bool,
    as_json: bool,
) -> None:
    """Train a model on a data set and write a checkpoint: one process, or data-parallel
    (--workers N, a parameter server, pipeline stages, or under torchrun)."""
    explicit = frozenset(
        name
        for name in (*_SETTINGS, "workers", "strategy")  # the last two: the global batch
        if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE
    )
    given = {
        name
        for name in ctx.params
        if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE
    }
    _check_flags(strategy, given, workers)
    torchrun = launch.DistEnv.from_torchrun()
    # the data-parallel replicas: torchrun's processes under it (all-reduce), else --workers
    processes = torchrun.world if torchrun is not None and strategy == "allreduce" else workers
    pipe = _pipeline_config(
        strategy, given, stages, microbatches, split, pipeline_schedule, balance, workers
    )
    if pipe is not None and scale_lr:
        raise InputError(
            "--scale-lr: pipeline stages share one batch (it does not grow with the processes); "
            "drop --scale-lr"
        )
    if scale_lr and processes == 1:
        raise InputError(
            "--scale-lr multiplies the learning rate by the processes, and one changes nothing; "
            "give --workers 2 or more, or drop it"
        )
    if scale_lr and processes > 1:  # the global batch grew N-fold: so does the step size
        lr = (lr or DEFAULT_LR[optimizer]) * processes
    config = TrainConfig(
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        schedule=schedule,
        warmup_steps=warmup_steps,
        optimizer=optimizer,
        weight_decay=weight_decay,
        seed=seed,
        precision=precision,
        checkpoint_every=checkpoint_every,
        grad_compression=grad_compression,
        device=device,
        deterministic=deterministic,
        bn_refresh=bn_refresh,
        # the pipeline's micro-batches are its own (PipelineConfig); elsewhere they accumulate
        microbatches=microbatches if pipe is None and microbatches is not None else 1,
    )
    kwargs = parse_kwargs(model_kwargs)
    out = out or default_out(model)
    log = log_path()
    if log is not None and os.path.abspath(log) == os.path.abspath(out):  # the default --out
        raise InputError(f"--log-file {log} is the checkpoint --out writes; log to another path")
    check_fresh(out, ensemble, resume, force, CLI_NAMES)
    ps = _ps_config(strategy, workers, servers, staleness, sync_warmup_epochs, straggler)
    if ps is not None and ps.mode == "async" and not resume and sync_warmup_epochs >= epochs:
        raise InputError(
            f"--sync-warmup-epochs {sync_warmup_epochs} of --epochs {epochs}: the whole run "
            "would be synchronous (use --strategy ps-sync for that); give fewer"
        )
    factory = functools.partial(render.rank0_progress, quiet, log)
    if ensemble != 1:
        job = TrainJob(
            model=model,
            model_kwargs=kwargs,
            data=data,
            config=config,
            out=out,
            resume=resume,
            explicit=explicit,
            workers=workers,
            timeout_s=timeout,
            ps=ps,
            pipeline=pipe,
        )
        _ensemble(job, ensemble, factory, as_json)
        return
    progress = render.TrainProgress(quiet=quiet)
    started = time.time()
    try:
        result = run_train(
            model,
            data,
            config,
            model_kwargs=kwargs,
            out=out,
            strategy=ps or pipe or strategy,
            workers=workers,
            resume=resume,
            force=force,
            timeout_s=timeout,
            progress=progress,
            progress_factory=factory,
            explicit=explicit,
            return_model=False,
        )
    except KeyboardInterrupt:
        progress.close()
        kept = ""
        # written by this run, not an older file (spawned ranks report to their own progress)
        written = Path(out).is_file() and Path(out).stat().st_mtime >= started
        # or the checkpoint a --resume started from, untouched: it still continues
        if progress.last_checkpoint is not None or written or (resume and Path(out).is_file()):
            kept = f"; last good checkpoint: {out} (continue with --resume)"
        raise Interrupted(f"interrupted{kept}") from None
    finally:
        progress.close()
    if not launch.is_rank_zero():  # under torchrun, rank 0 alone reports
        return
    for warning in (result.strategy or {}).get("warnings", []):
        render.stderr.print(f"warning: {warning}", style="bold yellow")
    if as_json:
        emit_json(result.to_json())
    else:
        render.train_summary(result, out)


def _check_flags(strategy: str, given: set[str], workers: int) -> None:
    """Flags that would be silently ignored, refused in one line: --staleness outside ps-ssp,
    --sync-warmup-epochs outside ps-async, --grad-compression in one process, --workers
    under torchrun. (--timeout's bound is the library's: distrib.job.)"""
    for name, owner in (("staleness", "ps-ssp"), ("sync_warmup_epochs", "ps-async")):
        if name in given and strategy != owner and strategy != "pipeline":
            raise InputError(f"{_flag(name)} belongs to {owner}; drop it for --strategy {strategy}")
    env = launch.DistEnv.from_torchrun()
    # all-reduce only: a parameter server's processes are workers + servers (its own check)
    if env is not None and strategy == "allreduce" and "workers" in given and workers != env.world:
        raise InputError(
            f"--workers {workers}: under torchrun the processes are torchrun's ({env.world}: "
            "--nproc-per-node x nodes); drop --workers"
        )
    one = workers == 1 and env is None and strategy == "allreduce"  # a PS worker sends too
    if "grad_compression" in given and one:
        raise InputError(
            "--grad-compression: one process sends no gradients; give --workers 2 or more, or "
            "drop it"
        )


def _ps_config(strategy, workers, servers, staleness, warmup, straggler) -> PSConfig | None:
    if strategy not in PS_STRATEGIES:
        for flag, value in (("--servers", servers), ("--straggler", straggler)):
            if value is not None:
                raise InputError(
                    f"{flag} belongs to the parameter-server strategies; "
                    "add --strategy ps-sync|ps-async|ps-ssp or drop it"
                )
        return None
    if servers is None:
        env = launch.DistEnv.from_torchrun()
        if env is not None and 1 < workers < env.world:  # the other ranks serve
            servers = env.world - workers
        elif env is not None:  # torchrun's processes split into workers and servers as told
            n = env.world
            raise InputError(
                f"--strategy {strategy} under torchrun ({n} processes): give --workers W and "
                f"--servers S with W + S = {n}, e.g. --workers {max(n - 1, 1)} --servers 1"
            )
        elif workers == 1:
            raise InputError(
                f"--strategy {strategy} with --workers 1 and no --servers: give --servers S "
                "(1 or more) or more workers"
            )
        else:
            servers = -(-workers // 2)
    lag = None
    if straggler is not None:
        rank, _, factor = straggler.partition(":")
        try:
            lag = (int(rank), float(factor))
        except ValueError:
            raise InputError(
                f"--straggler {straggler!r}: write RANK:FACTOR, e.g. 1:2 (worker 1, twice slower)"
            ) from None
    return PSConfig(
        mode=strategy.removeprefix("ps-"),
        workers=workers,
        servers=servers,
        staleness=staleness,
        sync_warmup_epochs=warmup,
        straggler=lag,
    )


_PIPELINE_FLAGS = ("stages", "microbatches", "split", "pipeline_schedule", "balance")
_PS_FLAGS = ("servers", "staleness", "sync_warmup_epochs", "straggler")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _pipeline_config(
    strategy, given, stages, microbatches, split, schedule, balance, workers
) -> PipelineConfig | None:
    if strategy != "pipeline":
        for name in _PIPELINE_FLAGS:
            if name == "microbatches":  # gradient accumulation outside a pipeline
                continue
            if name in given:
                raise InputError(
                    f"{_flag(name)} belongs to pipeline parallelism; add --strategy pipeline "
                    "or drop it"
                )
        return None
    for name in (*_PS_FLAGS, "grad_compression"):
        if name in given:
            raise InputError(
                f"{_flag(name)} does not apply to --strategy pipeline (stages send activations, "
                "not gradients to servers); drop it"
            )
    names = tuple(n.strip() for n in split.split(",")) if split is not None else ()
    if split is not None and (not names or not all(names)):
        raise InputError(f"--split {split!r}: give layer names separated by commas, e.g. a,b")
    if stages is None:
        if names:
            stages = len(names) + 1
        elif workers > 1:
            stages = workers
        else:
            raise InputError(
                "--strategy pipeline: give --stages K (2 or more) or --split LAYER,... "
                "to say where to cut"
            )
    return PipelineConfig(
        stages=stages, microbatches=microbatches, schedule=schedule, split=names, balance=balance
    )


def _ensemble(job: TrainJob, members: int, factory, as_json: bool) -> None:
    if members < 1:
        raise InputError(f"--ensemble {members}: give 1 or more")
    if job.pipeline is not None:
        raise InputError("--ensemble trains one process per member; drop --strategy pipeline")
    if job.workers > 1 or job.resume:
        raise InputError("--ensemble trains one process per member; drop --workers/--resume")
    trained = run_ensemble(job, members, factory)
    rows = [
        {
            "checkpoint": str(path),
            "seed": job.config.seed + k,
            "test_accuracy": r.test_accuracy,
            "seconds": round(r.seconds, 3),
        }
        for k, (path, r) in enumerate(trained)
    ]
    if as_json:
        emit_json({"ensemble": rows})
    else:
        for row in rows:
            click.echo(
                f"{row['checkpoint']}: seed {row['seed']}, test accuracy "
                f"{row['test_accuracy']:.2%} ({row['seconds']:.1f}s)"
            )
        teachers = " ".join(f"--teacher {row['checkpoint']}" for row in rows[1:])
        click.echo(
            f"distil the ensemble: compress shrink {rows[0]['checkpoint']} {teachers} --student NAME"
        )
