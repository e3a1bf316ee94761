"""Pipeline model parallelism on `torch.distributed.pipelining`: K processes each hold one
stage (a contiguous slice of the model) and a batch flows through them in M micro-batches,
GPipe (Huang et al. 2019: all forwards, then all backwards) or 1F1B (Narayanan et al. 2019,
PipeDream-flush: one forward, one backward in the steady state, at most K micro-batches of
activations in flight).

Cutting: the model is traced (`torch.distributed.pipelining.pipeline`, torch.export) and split
at the beginning of named modules. `--split a,b` names them (any module the forward calls, in
any traceable model: residual blocks too); otherwise the cut points are chosen among the
layers with weights, in the order the forward calls them, so that the stages' forward FLOPs
(or parameter counts) are as even as possible (the largest stage is as small as it can be).

Training matches one process on the same batch: the global batch is `--batch-size` (there is
no data parallelism), each micro-batch's loss is its summed cross-entropy divided by the
whole batch's size, so the gradients the stages accumulate over the micro-batches are the
full batch's mean-loss gradients; every stage steps its own optimizer over its own weights
with the learning rate the one-process loop would use at that step. The last batch of an
epoch, when smaller, runs with the largest micro-batch count up to M that divides it.

Rank 0 gathers the stages' weights (and their optimizer state, re-keyed to the whole model's
parameter order) at each checkpoint and epoch end, evaluates the whole model and writes the
usual checkpoint: `compress shrink` and a one-process `--resume` read it unchanged, and a
pipeline `--resume` re-cuts the model and hands each stage its part of the optimizer state.

The bubble: each stage times its forward and backward computations (`forward_one_chunk`,
`backward_one_chunk`) against the wall time of the schedule's steps; the idle fraction is the
rest (waiting for a neighbour, or its send). GPipe's theoretical bubble is (K-1)/(M+K-1).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import re
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from compresskit.distrib.trainer import honours_deterministic
from compresskit.models.base import batch_statistics
from compresskit.models.data import Dataset
from compresskit.models.errors import InputError, StageError

SCHEDULES = ("gpipe", "1f1b")
BALANCES = ("flops", "params")


@dataclass(frozen=True)
class PipelineConfig:
    """K stages, M micro-batches per batch, the schedule, and where to cut (names: stage
    i+1 begins at `split[i]`; empty: cut automatically, balancing `balance`)."""

    stages: int = 2
    microbatches: int | None = None  # None: `auto_microbatches` picks M for the model and batch
    schedule: str = "gpipe"
    split: tuple[str, ...] = ()
    balance: str = "flops"

    def __post_init__(self) -> None:
        if self.stages < 2:
            raise InputError(f"--stages {self.stages}: a pipeline needs 2 or more stages")
        if self.microbatches is not None and self.microbatches < 1:
            raise InputError(f"--microbatches {self.microbatches}: give 1 or more")
        if self.schedule not in SCHEDULES:
            raise InputError(
                f"--pipeline-schedule {self.schedule!r}: one of {', '.join(SCHEDULES)}"
            )
        if self.balance not in BALANCES:
            raise InputError(f"--balance {self.balance!r}: one of {', '.join(BALANCES)}")
        if self.split and len(self.split) + 1 != self.stages:
            raise InputError(
                f"--split {','.join(self.split)} cuts {len(self.split) + 1} stages but --stages "
                f"is {self.stages}; give {self.stages - 1} names for --stages {self.stages} "
                "or drop --stages"
            )
        if len(set(self.split)) != len(self.split):
            raise InputError(f"--split {','.join(self.split)}: a layer is named twice")
        if (
            self.schedule == "1f1b"
            and self.microbatches is not None
            and self.microbatches < self.stages
        ):
            raise InputError(
                f"--pipeline-schedule 1f1b needs --microbatches {self.stages} or more "
                f"(--stages {self.stages}); give more micro-batches or --pipeline-schedule gpipe"
            )

    def resolved(self, model: nn.Module, batch_size: int) -> PipelineConfig:
        """This config with M chosen (`auto_microbatches`) when it was left to the run."""
        if self.microbatches is not None:
            return self
        m = auto_microbatches(model, batch_size, self.stages, self.schedule)
        return dataclasses.replace(self, microbatches=m)

    def check_batch(self, batch_size: int) -> None:
        """The batch must split into M equal micro-batches (their shapes are fixed per run)."""
        if self.microbatches is None:
            raise ValueError("PipelineConfig.resolved(model, batch) first: M is not chosen yet")
        if batch_size % self.microbatches:
            divisors = [d for d in range(1, min(batch_size, 64) + 1) if batch_size % d == 0]
            raise InputError(
                f"--microbatches {self.microbatches} does not divide --batch-size {batch_size} "
                f"into equal micro-batches; give one of {', '.join(map(str, divisors))}"
            )

    def bubble(self) -> float:
        """The GPipe / 1F1B bubble with equal stages: (K-1)/(M+K-1) of each stage's time."""
        if self.microbatches is None:
            raise ValueError("PipelineConfig.resolved(model, batch) first: M is not chosen yet")
        return bubble(self.stages, self.microbatches)


def bubble(k: int, m: int) -> float:
    """GPipe's (and 1F1B's) idle share of each of `k` equal stages over `m` micro-batches."""
    return (k - 1) / (m + k - 1)


@dataclass(frozen=True)
class Plan:
    """Where the stages begin (module names) and what each holds."""

    split: tuple[str, ...]
    parameters: tuple[int, ...]  # per stage
    flops: tuple[int, ...]  # forward FLOPs per sample, per stage (matmul and convolution)
    auto: bool  # chosen by balancing (not named by --split)


def stage_name(rank: int) -> str:
    """How the launcher words a rank of a pipeline job: rank r holds stage r."""
    return f"stage {rank}"


# ---- planning: where to cut ----------------------------------------------------------------


def plan(model: nn.Module, example: torch.Tensor, cfg: PipelineConfig, label: str = "") -> Plan:
    """Cut `model` into `cfg.stages` stages: at `cfg.split`, or balanced automatically.
    `example` is a small batch of real inputs (the forward is run once, in eval mode)."""
    label = label or type(model).__name__
    calls, flops = _profile(model, example)
    order = list(dict.fromkeys(calls))
    modules = dict(model.named_modules())
    leaves = [n for n in order if not any(True for _ in modules[n].children())]
    own = {n: sum(p.numel() for p in modules[n].parameters()) for n in leaves}
    # where a stage may begin, and what no stage may lack: weights the optimizer trains (a
    # frozen first layer made a stage of nothing to train: "optimizer got an empty parameter
    # list" after the processes started)
    trains = {n: sum(p.numel() for p in modules[n].parameters() if p.requires_grad) for n in leaves}
    apart = _kept_together(modules, leaves, calls)
    per_sample = max(len(example), 1)
    if cfg.split:
        for name in cfg.split:
            if name not in modules or name == "":
                known = ", ".join(n for n in order if "." not in n)
                raise InputError(
                    f"--split {name}: {label} has no layer of that name; top-level layers: "
                    f"{known} (nested ones as parent.child)"
                )
            if name not in order:
                raise InputError(
                    f"--split {name}: {label}'s forward never calls that layer; name one it runs"
                )
            why = apart(name)
            if why:
                raise InputError(f"--split {name}: {why}; cut elsewhere")
        split = tuple(sorted(cfg.split, key=order.index))
        starts = [order.index(n) for n in split]
        stage_of = {n: sum(order.index(n) >= s for s in starts) for n in leaves}
        auto = False
    else:
        # layers with weights to train, where a cut separates no weight from its other users
        units = [n for n in leaves if trains[n] > 0]
        if not units:
            raise InputError(f"--strategy pipeline: {label} has no weights to train")
        units = [units[0], *(n for n in units[1:] if not apart(n))]  # stage 0 begins anyway
        if cfg.stages > len(units):
            raise InputError(
                f"--stages {cfg.stages}: {label} has {len(units)} layers with weights to train "
                "that a stage may begin at (a layer the forward calls twice, or one whose "
                f"weights another layer shares, is kept in one stage); give --stages "
                f"{len(units)} or fewer"
            )
        unit_of: dict[str, int] = {}
        u = 0
        for n in leaves:
            if u + 1 < len(units) and n == units[u + 1]:
                u += 1
            unit_of[n] = u
        key = flops if cfg.balance == "flops" and any(flops.values()) else own
        cost = [0] * len(units)
        for n in leaves:
            cost[unit_of[n]] += key.get(n, 0)
        firsts = _partition(cost, cfg.stages)
        split = tuple(units[i] for i in firsts)
        stage_of = {n: sum(unit_of[n] >= i for i in firsts) for n in leaves}
        auto = True
    params, fl, trained = [0] * cfg.stages, [0] * cfg.stages, [0] * cfg.stages
    for n in leaves:
        params[stage_of[n]] += own[n]
        trained[stage_of[n]] += trains[n]
        fl[stage_of[n]] += flops.get(n, 0) // per_sample
    empty = [i for i, p in enumerate(trained) if p == 0]
    if empty:
        what = "weights" if params[empty[0]] == 0 else "weights to train (its layers are frozen)"
        raise InputError(
            f"--split {','.join(split)}: stage {empty[0]} would hold no {what}; cut elsewhere"
        )
    return Plan(split, tuple(params), tuple(fl), auto)


# torch's tracer names a layer's second call within one stage `mid@1` (`mid@1.weight`)
_ALIAS = re.compile(r"@\d+(?=\.|$)")


def _unaliased(name: str) -> str:
    """A stage module's parameter name as the model has it: `mid@1.weight` -> `mid.weight`."""
    return _ALIAS.sub("", name)


def _kept_together(
    modules: dict[str, nn.Module], leaves: list[str], calls: list[str]
) -> Callable[[str], str]:
    """A function telling why a stage may not begin at a module (or "" when it may): the cut
    would fall between two calls of a layer with weights, or between two layers sharing a
    weight (tied weights). Each stage would train its own copy of the weight with part of its
    gradient; rank 0 then kept whichever copy it read last (a model with fc3.weight tied to
    fc1.weight tested 38.9% piped against 52.5% in one process)."""
    at: dict[str, list[int]] = {}
    for i, n in enumerate(calls):
        at.setdefault(n, []).append(i)
    users: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    for n in leaves:
        for pname, p in modules[n].named_parameters():
            users.setdefault(id(p), []).append(n)
            names.setdefault(id(p), f"{n}.{pname}")
    groups = [(names[k], sorted(set(v), key=leaves.index)) for k, v in users.items()]

    def why(name: str) -> str:
        if len(at[name]) > 1:
            return (
                f"the forward calls it {len(at[name])} times; a stage begins at a layer called once"
            )
        start = at[name][0]
        for weight, used_by in groups:
            pos = [i for n in used_by for i in at[n]]
            if min(pos) < start <= max(pos):
                shared = (
                    f"{used_by[0]} runs before and after it (the forward calls it twice)"
                    if len(used_by) == 1
                    else f"{weight} is shared by {' and '.join(used_by)}, on both sides of it"
                )
                return f"{shared}: each stage would train its own copy of the weight"
        return ""

    return why


def _profile(model: nn.Module, example: torch.Tensor) -> tuple[list[str], dict[str, int]]:
    """Every module call of one forward, in order (a module called twice appears twice), and
    each module's forward FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    order: list[str] = []
    hooks = []
    for name, module in model.named_modules():
        if name:

            def pre(_m, _args, name=name):
                order.append(name)

            hooks.append(module.register_forward_pre_hook(pre))
    was_training = model.training
    model.eval()  # no BatchNorm statistics move, no dropout
    counter = FlopCounterMode(display=False)
    try:
        with torch.no_grad(), counter:
            model(example)
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    prefix = type(model).__name__ + "."
    flops = {
        k.removeprefix(prefix): int(sum(v.values()))
        for k, v in counter.get_flop_counts().items()
        if k.startswith(prefix)
    }
    return order, flops


def _partition(cost: Sequence[int], k: int) -> list[int]:
    """Cut `cost` into `k` non-empty contiguous parts whose largest sum is as small as it can
    be (ties: the earliest cuts); the first index of parts 1..k-1."""
    n = len(cost)
    prefix = [0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    inf = math.inf
    # best[j][i]: the smallest largest part when the first i units form j parts
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            for s in range(j - 1, i):
                v = max(best[j - 1][s], prefix[i] - prefix[s])
                if v < best[j][i]:
                    best[j][i], cut[j][i] = v, s
    firsts, i = [], n
    for j in range(k, 1, -1):
        i = cut[j][i]
        firsts.append(i)
    return sorted(firsts)


def trace(model: nn.Module, split: Sequence[str], microbatch: torch.Tensor, label: str = ""):
    """The `Pipe` of `model` cut at `split`, traced with one micro-batch of inputs (its size is
    baked into the stages' message buffers). Its stage modules share `model`'s parameters."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    label = label or type(model).__name__
    # `pipeline` marks the split points by replacing those modules' `forward` in place, for
    # good: put them back, or the next trace (another micro-batch size) recurses forever.
    marked = [model.get_submodule(name) for name in split]
    saved = [
        {k: m.__dict__[k] for k in ("forward", "_orig_forward") if k in m.__dict__} for m in marked
    ]
    try:
        with warnings.catch_warnings():  # torch.export's deprecation chatter
            warnings.simplefilter("ignore")
            pipe = pipeline(
                model,
                mb_args=(microbatch,),
                split_spec={name: SplitPoint.BEGINNING for name in split},
            )
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise InputError(
            f"--strategy pipeline: {label} cannot be traced for splitting ({first}); "
            "use --strategy allreduce"
        ) from None
    finally:
        for m, before in zip(marked, saved, strict=True):
            for k in ("forward", "_orig_forward"):
                m.__dict__.pop(k, None)
            m.__dict__.update(before)
    if pipe.num_stages != len(split) + 1:
        raise InputError(
            f"--split {','.join(split)}: tracing {label} made {pipe.num_stages} stages, not "
            f"{len(split) + 1}; name layers the forward calls once, outside loops"
        )
    # A weight the forward uses outside its own layer (F.linear(x, self.b.weight), a tied LM
    # head) lands in every stage that uses it, each training its own copy (24% piped against
    # 38% in one process): what `plan` cannot see from the layers, the traced stages show.
    # (by name: the tracer may hand each stage its own tensor for it)
    where: dict[str, int] = {}
    for i in range(pipe.num_stages):
        for n, _ in pipe.get_stage_module(i).named_parameters(remove_duplicate=False):
            name = _unaliased(n)
            first = where.setdefault(name, i)
            if first != i:
                raise InputError(
                    f"stages beginning at {','.join(split)}: {label}'s weight {name} is used "
                    f"in stage {first} and stage {i}; each would train its own copy: cut "
                    "(--split) where one stage holds every use of it, or use --strategy "
                    "allreduce"
                )
    return pipe


# ---- training --------------------------------------------------------------------------------


class _Timed:
    """Times a stage's computations (forward and backward of its micro-batches) and counts the
    activation bytes it sends forward (the next stage sends as many gradient bytes back)."""

    def __init__(self) -> None:
        self.busy = 0.0
        self.sent = 0

    def wrap(self, stage) -> None:
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

        def timed_forward(*args, **kwargs):
            t = time.perf_counter()
            try:
                out = forward(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - t
            if not stage.is_last:
                self.sent += sum(x.numel() * x.element_size() for x in _tensors(out))
            return out

        def timed_backward(*args, **kwargs):
            t = time.perf_counter()
            try:
                return backward(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - t

        stage.forward_one_chunk = timed_forward
        stage.backward_one_chunk = timed_backward


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    return []


class _Runner:
    """One rank's stage: a traced pipe, stage and schedule per micro-batch shape."""

    def __init__(self, model, split, cfg: PipelineConfig, rank: int, device, loss_fn, x0, label):
        self.model, self.split, self.cfg = model, tuple(split), cfg
        self.rank, self.device, self.loss_fn = rank, device, loss_fn
        self.x0, self.label = x0, label  # a sample of inputs, for tracing
        self.timer = _Timed()
        self.cache: dict[tuple[int, int], Any] = {}
        self.module: nn.Module | None = None  # the first traced stage module (for names)

    def schedule(self, batch: int):
        """The schedule for a batch of `batch` samples: M micro-batches, or (a smaller last
        batch) the largest count up to M that divides it."""
        m = most_dividing(batch, self.cfg.microbatches)
        key = (batch // m, m)
        if key not in self.cache:
            from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, build_stage

            mb = self.x0[:1].expand(batch // m, *self.x0.shape[1:]).contiguous()
            pipe = trace(self.model, self.split, mb, self.label)
            module = pipe.get_stage_module(self.rank)
            if self.module is None:
                self.module = module
            stage = build_stage(module, self.rank, pipe.info(), self.device)
            self.timer.wrap(stage)
            kind = ScheduleGPipe
            if self.cfg.schedule == "1f1b" and m >= self.cfg.stages:
                kind = Schedule1F1B
            self.cache[key] = kind(stage, n_microbatches=m, loss_fn=self.loss_fn, scale_grads=False)
        return self.cache[key]


@honours_deterministic
def fit(
    model: nn.Module,
    data: Dataset,
    cfg,
    pcfg: PipelineConfig,
    *,
    checkpointer=None,
    resume: dict[str, Any] | None = None,
    events=None,
    split: Sequence[str] | None = None,
    label: str = "",
) -> Any:
    """Train `model` as stage `rank` of a `pcfg.stages`-process pipeline (the default process
    group: rank r holds stage r). Every rank builds the same model (same seed or checkpoint);
    rank 0 ends with the whole trained model in `model`, reports through `events`, writes
    checkpoints and returns the `TrainResult`; the other ranks return None.

    `cfg` is the `TrainConfig` (its batch size is the pipeline's whole batch); `split` the cut
    points (`plan`'s, made once before the processes start; None: planned here); `resume` a
    checkpoint's train_state, its weights already in `model`."""
    import torch.distributed as dist

    from compresskit.distrib.trainer import (
        Batches,
        EpochRecord,
        Events,
        TrainResult,
        _initial_state,
        check_finite,
        epoch_order,
        evaluate,
        optimizer_for,
        record_step,
        resume_position,
        rng_state,
    )

    if not (dist.is_available() and dist.is_initialized()):
        raise InputError("--strategy pipeline runs in a process group of --stages processes")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != pcfg.stages:
        raise InputError(
            f"--stages {pcfg.stages} needs {pcfg.stages} processes; this job has {world} "
            f"(give --workers {pcfg.stages} or 1, or torchrun --nproc-per-node {pcfg.stages})"
        )
    pcfg = pcfg.resolved(model, cfg.batch_size)
    pcfg.check_batch(cfg.batch_size)
    if cfg.precision != "fp32":
        raise InputError(
            f"--precision {cfg.precision} is not supported with --strategy pipeline; use fp32"
        )
    label = label or type(model).__name__
    _thread_lock_for_tqdm()
    if rank != 0:
        events, checkpointer = None, None
    events = events or Events()
    device = torch.device(cfg.device)
    if device.type == "cuda":  # one GPU per local rank (NCCL)
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device(f"cuda:{local % torch.cuda.device_count()}")
        torch.cuda.set_device(device)
    # Each rank keeps the whole model (the stages share its tensors): rank 0 evaluates it.
    model.to(device)
    sample = data.x_train[:2].to(device)
    layout = plan(
        model, sample, dataclasses.replace(pcfg, split=tuple(split)) if split else pcfg, label
    )
    first, last = rank == 0, rank == world - 1
    model.train()

    size = {"batch": 1}  # the current batch's size: each micro-batch's loss is its share

    def loss_fn(logits, y):
        return F.cross_entropy(_first(logits), y, reduction="sum") / size["batch"]

    runner = _Runner(model, layout.split, pcfg, rank, device, loss_fn, sample, label)
    runner.schedule(cfg.batch_size)  # traced now: the stage module names its parameters
    module = runner.module
    full_names = [n for n, p in model.named_parameters() if p.requires_grad]
    mine = {id(p) for p in module.parameters()}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad and id(p) in mine]
    by_name = dict(model.named_parameters())
    optimizer = optimizer_for([by_name[n] for n in trainable], cfg)
    if resume is not None and "optimizer" in resume:
        cut = _stage_optimizer(resume["optimizer"], full_names, trainable)
        resume = {**resume, "optimizer": cut}
    n = len(data.y_train)
    batches = Batches(n, cfg.batch_size)
    state = _initial_state(resume, optimizer, cfg, device)
    history, start = resume_position(state, batches, "--batch-size")
    t0 = time.perf_counter()
    steps = samples = 0
    step_s = 0.0
    # M per step: a short batch takes fewer
    m_used: collections.Counter[int] = collections.Counter()

    def gather() -> dict[str, Any] | None:
        """Rank 0 loads every stage's weights into `model` and returns the optimizer state of
        the whole model (None on the other ranks)."""
        opt = optimizer.state_dict()
        part = {
            "weights": {k: v.detach().cpu() for k, v in module.state_dict().items()},
            "optimizer": {trainable[i]: _to_cpu(s) for i, s in opt["state"].items()},
            "hyper": {k: v for k, v in opt["param_groups"][0].items() if k != "params"},
        }
        parts = [None] * world if first else None
        dist.gather_object(part, parts, dst=0)
        if not first:
            return None
        weights, per_param = {}, {}
        for p in parts:
            for k, v in p["weights"].items():
                # a layer's second call in one stage: the same tensor as the first's (a strict
                # load refused `mid@1.weight` after a whole epoch)
                weights.setdefault(_unaliased(k), v)
            per_param.update(p["optimizer"])
        missing = set(model.state_dict()) - set(weights)
        if missing:
            raise StageError(f"the pipeline stages hold no value for {sorted(missing)[:3]}")
        model.load_state_dict(weights)
        index = {name: i for i, name in enumerate(full_names)}
        return {
            "state": {index[name]: s for name, s in per_param.items()},
            "param_groups": [{**parts[0]["hyper"], "params": list(range(len(full_names)))}],
        }

    def save(full_opt, **metadata: Any) -> None:
        if checkpointer is None:
            return
        state.update(rng_state(device))
        state["optimizer"] = full_opt
        path = checkpointer.save(model, state, **metadata)
        events.checkpoint(path, state["epoch"], state["step"])

    for epoch in range(state["epoch"], cfg.epochs):
        t_epoch = time.perf_counter()
        order = epoch_order(n, cfg.seed, epoch)
        steps_per_epoch = state["steps_per_epoch"] = batches.per_epoch(epoch)
        events.epoch_start(epoch + 1, cfg.epochs, steps_per_epoch, state["step"])
        for step in batches.steps(epoch, state["step"]):
            idx = batches.indices(order, epoch, step)
            size["batch"] = len(idx)
            lr = cfg.lr_at(epoch * steps_per_epoch + step, cfg.epochs * steps_per_epoch)
            for group in optimizer.param_groups:
                group["lr"] = lr
            schedule = runner.schedule(len(idx))
            m_used[most_dividing(len(idx), pcfg.microbatches)] += 1
            optimizer.zero_grad(set_to_none=True)
            losses: list[torch.Tensor] = []
            figures = torch.zeros(2, dtype=torch.float64, device=device)
            t = time.perf_counter()
            if first:
                schedule.step(data.x_train[idx].to(device))
            elif last:
                yb = data.y_train[idx].to(device)
                logits = _first(schedule.step(target=yb, losses=losses))
            else:
                schedule.step()
            step_s += time.perf_counter() - t
            if last:
                figures[0] = float(sum(float(x.detach()) for x in losses))
                figures[1] = float((logits.argmax(1) == yb).sum())
            dist.all_reduce(figures)  # every stage learns the loss: all stop if it diverged
            value, right = figures.tolist()
            check_finite(value, epoch, step)  # before the step: no NaN gradient reaches a weight
            optimizer.step()
            due = record_step(state, cfg, step, value, int(right), len(idx), steps_per_epoch)
            steps += 1
            samples += len(idx)
            events.step(epoch + 1, step + 1, value)
            if due:
                save(gather())
        full_opt = gather()  # rank 0 now holds the whole trained model
        if first:
            test_loss, test_acc = evaluate(
                model, data.x_test, data.y_test, cfg.eval_batch_size, "fp32", str(device)
            )
            history.append(
                EpochRecord(
                    epoch=epoch + 1,
                    train_loss=state["loss_sum"] / max(state["seen"], 1),
                    train_accuracy=state["correct"] / max(state["seen"], 1),
                    test_loss=test_loss,
                    test_accuracy=test_acc,
                    seconds=time.perf_counter() - t_epoch,
                )
            )
        state.update(epoch=epoch + 1, step=0, loss_sum=0.0, correct=0, seen=0)
        state["history"] = [vars(r) for r in history]
        save(full_opt, test_accuracy=history[-1].test_accuracy if first else None, epochs=epoch + 1)
        if first:
            events.epoch_end(history[-1])
    if start[0] >= cfg.epochs:  # nothing left to train: rank 0 still reports the whole model
        gather()

    # The bubble: every stage's busy and step seconds, summed into one tensor.
    timing = torch.zeros(world, 3, dtype=torch.float64, device=device)
    timing[rank] = torch.tensor(
        [runner.timer.busy, step_s, runner.timer.sent], dtype=torch.float64, device=device
    )
    dist.all_reduce(timing)
    if not first:
        return None
    busy, wall, forward = (timing[:, i].tolist() for i in range(3))
    # A stage sends its activations forward and, but the first, its input gradients back.
    sent = [forward[s] + (forward[s - 1] if s else 0.0) for s in range(world)]
    idle = {
        s: (max(0.0, 1 - b / w) if w > 0 else 0.0)
        for s, (b, w) in enumerate(zip(busy, wall, strict=True))
    }
    # The M the steps took (a batch the data cannot fill, or a short last batch, takes the
    # largest M up to --microbatches that divides it): the summary said 4 and 20% where every
    # step ran 2 and 33%.
    taken = m_used.most_common(1)[0][0] if m_used else pcfg.microbatches
    theory = (
        sum(c * bubble(pcfg.stages, m) for m, c in m_used.items()) / m_used.total()
        if m_used
        else pcfg.bubble()
    )
    report = {
        "kind": "pipeline",
        "stages": pcfg.stages,
        "microbatches": taken,
        "microbatches_asked": pcfg.microbatches,
        "microbatches_per_step": dict(sorted(m_used.items())),
        "schedule": pcfg.schedule,
        "split": list(layout.split),
        "auto_split": layout.auto,
        "balance": pcfg.balance,
        "stage_parameters": list(layout.parameters),
        "stage_flops": list(layout.flops),
        "bubble_theory": theory,  # averaged over the steps, each at its own M
        "bubble_measured": sum(idle.values()) / world,
        "idle_fraction": idle,
        "busy_s": dict(enumerate(busy)),
        "step_s": dict(enumerate(wall)),
        "bytes_per_step": {s: int(b / max(steps, 1)) for s, b in enumerate(sent)},
        "warnings": batchnorm_warnings(
            model, cfg.batch_size, pcfg.microbatches, pcfg.schedule, pcfg.stages
        ),
    }
    final_acc = history[-1].test_accuracy if history else float("nan")
    return TrainResult(
        history=history,
        test_accuracy=final_acc,
        epochs=len(history),
        steps=steps,
        samples=samples,
        seconds=time.perf_counter() - t0,
        checkpoint=checkpointer.path if checkpointer else None,
        resumed_from=start if resume else None,
        workers=world,
        comm_bytes=int(sent[0]),
        strategy=report,
    )


# Below it, BatchNorm's per-micro-batch statistics drift from the batch's: VGG on digits (batch
# 32, 2 epochs, 5 seeds) lost 0.67 points against one process at micro-batches of 16 and 3.2 at
# 8; one micro-batch of 32 ended +0.28 (docs/benchmarks.md).
BN_MIN_MICROBATCH = 32
DEFAULT_MICROBATCHES = 4  # M when the run chooses: a bubble of (K-1)/(K+3), 20% at K = 2


def most_dividing(batch: int, cap: int) -> int:
    """The most micro-batches, at most `cap` (at least 1), that split `batch` equally."""
    return max(d for d in range(1, max(1, min(cap, batch)) + 1) if batch % d == 0)


def auto_microbatches(model: nn.Module, batch: int, stages: int, schedule: str = "gpipe") -> int:
    """M when `--microbatches` is not given: the most micro-batches up to DEFAULT_MICROBATCHES
    that divide the batch, and, for a model with BatchNorm, keep BN_MIN_MICROBATCH samples in
    each (1 if none does: the stages then split the model's memory, not its time). Why:
    BatchNorm normalises each micro-batch on its own, and smaller micro-batches trained VGG
    on digits measurably worse than one process (BN_MIN_MICROBATCH); a smaller bubble is not
    worth that. 1F1B needs M >= K, which overrides the BatchNorm rule: then the fewest
    micro-batches from K up that divide the batch (and the run warns about BatchNorm)."""
    cap = DEFAULT_MICROBATCHES
    if batch_statistics(model) is not None:
        cap = min(cap, batch // BN_MIN_MICROBATCH)
    m = most_dividing(batch, cap)
    if schedule == "1f1b" and m < stages:
        m = min((d for d in range(stages, batch + 1) if batch % d == 0), default=0)
        if not m:
            raise InputError(
                f"--pipeline-schedule 1f1b needs at least --stages {stages} micro-batches, and "
                f"--batch-size {batch} cannot be split into that many: give a larger batch or "
                "--pipeline-schedule gpipe"
            )
    return m


def batchnorm_warnings(
    model: nn.Module, batch: int, microbatches: int, schedule: str = "gpipe", stages: int = 2
) -> list[str]:
    """A model with BatchNorm normalises each micro-batch on its own, not the whole batch: with
    micro-batches under BN_MIN_MICROBATCH samples it trains differently from one process."""
    size = batch // max(microbatches, 1)
    if microbatches <= 1 or size >= BN_MIN_MICROBATCH:
        return []
    if batch_statistics(model) is None:
        return []
    fewer = most_dividing(batch, batch // BN_MIN_MICROBATCH)  # each of 32 samples or more
    fix = f"--microbatches {fewer} (micro-batches of {batch // fewer}) or a larger --batch-size"
    if schedule == "1f1b" and fewer < stages:  # 1F1B needs M >= K: it cannot take fewer
        fix = f"--pipeline-schedule gpipe {fix}"
    return [
        f"the model has BatchNorm, which normalises each micro-batch of {size} samples on its "
        f"own, not the batch of {batch}: it trains differently from one process; {fix} "
        "keeps closer"
    ]


def _thread_lock_for_tqdm() -> None:
    """The traced stages run in torch.fx's Interpreter, which makes a (disabled) tqdm bar per
    call; tqdm's first bar makes a multiprocessing lock, a semaphore that a rank leaving with
    os._exit leaks ("leaked semaphore objects" from the launcher's resource tracker). A
    thread lock does: the ranks have no child processes of their own."""
    with contextlib.suppress(ImportError):
        from tqdm import tqdm

        if not hasattr(tqdm, "_lock"):
            tqdm.set_lock(threading.RLock())


def _first(x):
    """A stage's output: the tensor, or the first of a tuple."""
    return x[0] if isinstance(x, (tuple, list)) else x


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    return x


def _stage_optimizer(full: dict[str, Any], full_names: list[str], mine: list[str]) -> dict:
    """A whole-model optimizer state_dict (one param group, the model's parameter order: what
    one process and rank 0 of a pipeline write) cut down to this stage's parameters."""
    groups = full.get("param_groups", [])
    if len(groups) != 1 or len(groups[0]["params"]) != len(full_names):
        raise InputError(
            "--resume: the checkpoint's optimizer state does not match this model's "
            "parameters; start over without --resume"
        )
    ids = groups[0]["params"]
    by_name = {
        full_names[k]: full["state"][pid] for k, pid in enumerate(ids) if pid in full["state"]
    }
    hyper = {k: v for k, v in groups[0].items() if k != "params"}
    return {
        "state": {i: by_name[n] for i, n in enumerate(mine) if n in by_name},
        "param_groups": [{**hyper, "params": list(range(len(mine)))}],
    }
