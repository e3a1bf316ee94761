"""The one training loop: every stage that trains (teacher training, retraining after pruning,
centroid fine-tuning, distillation, data-parallel training) runs `fit`.

What varies between those stages is passed in, not forked into copies of the loop:
  * `loss_fn(model, x, y) -> (loss, logits)`: cross-entropy by default; distillation passes
    a teacher-aware loss (Hinton et al. 2015).
  * `checkpointer`: where and how to write resumable checkpoints (None: none are written).
  * `events`: progress callbacks; the library never prints, the CLI renders these.

Determinism: the shuffle of epoch e is `randperm(N, generator=seed + e)`, the rule torch's
`DistributedSampler` uses, so a run resumed mid-epoch replays the same order and a
data-parallel run can shard the same permutation. Together with the optimizer state and torch's
RNG state in the checkpoint, a resumed run ends with the same weights as an uninterrupted one.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from compresskit import _datapass, _mem
from compresskit.models import checkpoint
from compresskit.models.base import batch_statistics, refresh_batchnorm_
from compresskit.models.data import Dataset
from compresskit.models.errors import InputError, StageError, brief
from compresskit.models.jsonable import plain
from compresskit.models.zoo import ModelSpec

OPTIMIZERS = ("sgd", "adam")
PRECISIONS = ("fp32", "bf16")
SCHEDULES = ("cosine", "constant")
DEFAULT_LR = {"sgd": 0.05, "adam": 3e-3}

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class TrainConfig:
    """How to train. `lr=None` takes the optimizer's default (sgd 0.05, adam 3e-3).

    The learning rate follows `schedule` over all steps of all epochs: cosine decay to zero
    (Loshchilov & Hutter 2017) by default, after `warmup_steps` of linear warm-up
    (Goyal et al. 2017).
    """

    epochs: int = 10
    batch_size: int = 32
    lr: float | None = None
    schedule: str = "cosine"
    warmup_steps: int = 0
    optimizer: str = "adam"
    momentum: float = 0.9  # sgd only
    weight_decay: float = 0.0
    seed: int = 0
    precision: str = "fp32"  # bf16: autocast on the forward pass, fp32 master weights
    checkpoint_every: int = 0  # steps between checkpoints; 0: at the end of each epoch only
    grad_compression: str = "none"  # data parallel: none | fp16 | bf16 gradients on the wire
    eval_batch_size: int | None = None  # None: sized to the model's activations (_mem.eval_batch)
    # Gradient accumulation: each batch runs forward and backward as this many micro-batches,
    # one after another, and the optimizer steps once on their summed gradient (each
    # micro-batch's loss weighted by its share of the batch). Same update as the whole batch,
    # up to float rounding, for a loss that is a mean over samples and a forward without
    # randomness (with dropout, the masks are other draws: the same in expectation).
    # Activations held at once shrink by about the factor, at some speed on a CPU (ViT-tiny
    # at batch 32 on 2 cores: 4 micro-batches cost 1.2x the step, 8 cost 1.45x;
    # docs/benchmarks.md). Refused for a model with BatchNorm, whose statistics it would
    # change. The pipeline strategy has its own micro-batches (PipelineConfig).
    # "auto": as many as keep the activations of one slice (what autograd saves for the
    # backward pass, measured on a few samples) within AUTO_ACTIVATIONS times the model's
    # parameter bytes (at least AUTO_FLOOR); 1 for a model with BatchNorm (`auto_microbatches`).
    microbatches: int | str = 1
    # "every": the test pass after each epoch; "last": after the last epoch only (the other
    # epochs' records carry NaN), for callers that read only the final model's figures. The
    # pipeline strategy (distrib/pipeline.py) has its own loop and tests every epoch.
    evaluate: str = "every"
    device: str = "cpu"
    # The same bits from the same seed on a GPU too: deterministic kernels (cuDNN's
    # convolutions pick no algorithm by timing and sum in a fixed order; cuBLAS gets a fixed
    # workspace), and an op that has no deterministic kernel stops the run naming itself. On a
    # CPU torch's kernels already are. On a GPU, without it, two runs of one command (or a
    # resumed run and the uninterrupted one) differ from the first steps on, and training
    # grows the difference: on an H100, VGG with dropout, 2 epochs, twice: weights up to 27
    # apart, 75.0% against 54.4% test accuracy; with it, a resumed run was the same bits.
    deterministic: bool = False
    # After the last epoch, before its test pass: BatchNorm's running statistics re-estimated
    # on this many training samples (a seeded subset) under the final weights
    # (`models.base.refresh_batchnorm_`); 0 keeps the running averages. For slow averages
    # (torchvision's MobileNetV3 and EfficientNet: momentum 0.01). The pipeline's retraining
    # sets it where a run leaves them stale (recipe train.bn_refresh); data-parallel ranks all
    # take the same subset, so their statistics agree; a parameter-server run leaves them.
    bn_refresh: int = 0

    def __post_init__(self) -> None:
        # Types first: a float epoch count or a None seed passed here failed deep inside
        # `fit` with a TypeError, after the data had loaded.
        # NumPy scalars are stored as Python numbers: a checkpoint's config must load with
        # weights_only. (None: eval_batch_size, bn_refresh and lr may be unset.)
        for name, kind, optional in (
            *((n, int, False) for n in ("epochs", "batch_size", "warmup_steps", "seed")),
            ("checkpoint_every", int, False),
            ("bn_refresh", int, True),
            ("eval_batch_size", int, True),
            ("microbatches", int, True),  # or "auto", checked below
            ("lr", float, True),
            ("momentum", float, False),
            ("weight_decay", float, False),
        ):
            value = getattr(self, name)
            abstract = numbers.Integral if kind is int else numbers.Real
            if isinstance(value, abstract) and not isinstance(value, bool):
                if type(value) not in (int, float):
                    object.__setattr__(self, name, kind(value))
            elif not (optional and (value is None or name == "microbatches")):
                _check(False, name, value, f"give a {'whole ' if kind is int else ''}number")
        for name in ("schedule", "optimizer", "precision", "grad_compression", "evaluate"):
            _check(isinstance(getattr(self, name), str), name, getattr(self, name), "give a word")
        _check(
            isinstance(self.device, str) and re.fullmatch(r"cpu|cuda(:\d+)?", self.device),
            "--device",
            self.device,
            "give cpu, cuda or cuda:N",
        )
        _check(
            isinstance(self.deterministic, bool),
            "deterministic",
            self.deterministic,
            "True or False",
        )
        _check(
            0 <= self.momentum < 1,
            "--momentum",
            self.momentum,
            "give a number from 0 up to (not including) 1",
        )
        _check(self.epochs >= 1, "--epochs", self.epochs, "give 1 or more")
        _check(self.batch_size >= 1, "--batch-size", self.batch_size, "give 1 or more")
        _check(self.bn_refresh >= 0, "bn_refresh", self.bn_refresh, "give 0 or more samples")
        # (at most the batch size: checked by `fit`, which a resumed run reaches with the
        # checkpoint's batch size, not the flag's default)
        _check(
            self.microbatches == "auto"
            or (
                isinstance(self.microbatches, int)
                and not isinstance(self.microbatches, bool)
                and self.microbatches >= 1
            ),
            "--microbatches",
            self.microbatches,
            "give 1 or more, or auto",
        )
        _check(
            self.lr is None or (self.lr > 0 and math.isfinite(self.lr)),
            "--lr",
            self.lr,
            "give a positive number",
        )
        _check(self.optimizer in OPTIMIZERS, "--optimizer", self.optimizer, f"one of {OPTIMIZERS}")
        _check(self.schedule in SCHEDULES, "--schedule", self.schedule, f"one of {SCHEDULES}")
        _check(self.warmup_steps >= 0, "--warmup-steps", self.warmup_steps, "give 0 or more")
        _check(self.precision in PRECISIONS, "--precision", self.precision, f"one of {PRECISIONS}")
        _check(
            0 <= self.weight_decay < math.inf, "--weight-decay", self.weight_decay, "give 0 or more"
        )
        _check(
            self.eval_batch_size is None or self.eval_batch_size >= 1,
            "eval_batch_size",
            self.eval_batch_size,
            "give 1 or more, or leave it unset",
        )
        _check(self.evaluate in ("every", "last"), "evaluate", self.evaluate, "every or last")
        _check(self.checkpoint_every >= 0, "--checkpoint-every", self.checkpoint_every, "0 or more")
        _check(
            self.grad_compression in ("none", "fp16", "bf16"),
            "--grad-compression",
            self.grad_compression,
            "one of none, fp16, bf16",
        )

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.optimizer]

    def lr_at(self, step: int, total_steps: int) -> float:
        """Learning rate for 0-based global `step`: a pure function, so resuming needs no state."""
        base = self.learning_rate
        if step < self.warmup_steps:
            return base * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return base
        span = max(total_steps - self.warmup_steps, 1)
        return base * 0.5 * (1.0 + math.cos(math.pi * min(step - self.warmup_steps, span) / span))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], strict: bool = True) -> TrainConfig:
        """A config from a dict; a key that is no field is refused (a misspelled "epoch"
        was dropped, and the run trained for the default), or skipped with `strict=False`
        (a checkpoint's stored config, perhaps written by another version)."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(k for k in d if k not in names)
        if strict and unknown:
            raise InputError(
                f"TrainConfig: unknown key {unknown[0]!r}; the fields are {', '.join(sorted(names))}"
            )
        return cls(**{k: v for k, v in d.items() if k in names})


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # numpy's too


def _check(ok: bool, flag: str, value: Any, fix: str) -> None:
    if not ok:
        raise InputError(f"{flag} {value!r} is invalid; {fix}")


@dataclass
class EpochRecord:
    """One epoch's figures: mean training loss and accuracy over its steps, then test loss
    and accuracy after it, and its wall-clock seconds."""

    epoch: int  # 1-based
    train_loss: float
    train_accuracy: float
    test_loss: float
    test_accuracy: float
    seconds: float


@dataclass
class TrainResult:
    """What a training run did: per-epoch figures, totals, where the checkpoint is, and (from
    `compresskit.distrib.train`) the trained model.

    `to_json()` is the object `compress train --json` prints.
    """

    history: list[EpochRecord]
    test_accuracy: float
    epochs: int
    steps: int
    samples: int
    seconds: float  # time spent training in this call (resumed runs: since the resume)
    checkpoint: Path | None = None
    resumed_from: tuple[int, int] | None = None  # (epoch, step) the run continued from
    workers: int = 1
    comm_bytes: int = 0  # gradient bytes this rank sent to all-reduce (0 in one process)
    strategy: dict[str, Any] = field(default_factory=dict)  # parameter server: its figures
    microbatches: int = 1  # slices per batch the run took (what "auto" resolved to)
    bn_refreshed: int = 0  # BatchNorm layers whose statistics the run re-estimated at its end
    # The trained model (set by `distrib.train`; None from the loop itself and across
    # processes). Not part of `to_json()`.
    model: nn.Module | None = field(default=None, repr=False, compare=False)
    # Per test sample, whether the final model's top-1 is right (the last epoch's evaluation;
    # None when this rank did not evaluate). Lets a caller that needs the samples (`shrink`'s
    # paired accuracy changes) skip a second pass over the test set. Not part of `to_json()`.
    test_correct: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        # absolute: a notebook that changes folder still finds it (ck.shrink(result) failed
        # as "no such checkpoint file" after os.chdir)
        if self.checkpoint is not None:
            self.checkpoint = Path(os.path.abspath(self.checkpoint))

    @property
    def strategy_name(self) -> str:
        """How the run trained: "single" (one process), "allreduce", "ps-sync", "ps-async",
        "ps-ssp" or "pipeline"."""
        s = self.strategy
        if s.get("kind") == "pipeline":
            return "pipeline"
        if s:
            return f"ps-{s['mode']}"
        return "allreduce" if self.workers > 1 else "single"

    def to_json(self) -> dict[str, Any]:
        """The run as JSON values, exactly the object `compress train --json` prints: the
        checkpoint path as a string, rates per second, the strategy's figures, the history as
        a list of dicts; NaN (e.g. the accuracy of a run with no epoch left to train) is None.
        """
        last = self.history[-1] if self.history else None
        return plain(
            {
                "checkpoint": str(self.checkpoint) if self.checkpoint is not None else None,
                "workers": self.workers,
                "strategy": self.strategy_name,
                "steps_per_s": self.steps / self.seconds if self.seconds else None,
                "samples_per_s": self.samples / self.seconds if self.seconds else None,
                "comm_bytes": self.comm_bytes,
                "microbatches": self.microbatches,
                "bn_refreshed": self.bn_refreshed,
                **_ps_json(self.strategy),
                **_pipeline_json(self.strategy),
                "test_accuracy": self.test_accuracy,
                "test_loss": last.test_loss if last else None,
                "epochs": self.epochs,
                "steps": self.steps,
                "samples": self.samples,
                "seconds": round(self.seconds, 3),
                "resumed_from": list(self.resumed_from) if self.resumed_from else None,
                "history": [vars(r) for r in self.history],
            }
        )


def _ps_json(s: dict[str, Any]) -> dict[str, Any]:
    if not s or s.get("kind") == "pipeline":
        return {}
    return {
        "servers": s["servers"],
        "staleness": s["staleness"],
        "bytes_per_step": s["bytes_per_step"],
        # one push and one pull per server a step: the transport's count, as README says
        "messages_per_step": s.get("messages_per_step"),
        "warnings": s.get("warnings", []),
        "staleness_histogram": s.get("staleness_histogram", {}),
        "idle_fraction": s.get("idle_fraction", {}),
        "lost_workers": s.get("lost_workers", []),
        "updates": s.get("updates"),
        "samples_per_worker": s.get("samples_per_worker", {}),
        "max_clock_gap": s.get("max_clock_gap"),
        "straggler": s["straggler"],
    }


def _pipeline_json(s: dict[str, Any]) -> dict[str, Any]:
    if not s or s.get("kind") != "pipeline":
        return {}
    keys = ("stages", "microbatches", "split", "auto_split", "balance", "stage_parameters")
    return {
        **{k: s[k] for k in keys},
        "microbatches_per_step": s.get("microbatches_per_step", {}),
        "pipeline_schedule": s["schedule"],
        "stage_flops": s["stage_flops"],
        "bubble_theory": s["bubble_theory"],
        "bubble_measured": s["bubble_measured"],
        "idle_fraction": s["idle_fraction"],
        "bytes_per_step": s["bytes_per_step"],
    }


class Events:
    """Progress callbacks; override what you render. All default to doing nothing."""

    def epoch_start(self, epoch: int, epochs: int, steps: int, done: int) -> None: ...
    def step(self, epoch: int, step: int, loss: float) -> None: ...
    def epoch_end(self, record: EpochRecord) -> None: ...
    def checkpoint(self, path: Path, epoch: int, step: int) -> None: ...
    def info(self, message: str) -> None: ...


@dataclass
class Checkpointer:
    """Writes resumable checkpoints of the model being trained."""

    path: Path
    spec: ModelSpec
    metadata: dict[str, Any] = field(default_factory=dict)

    def save(self, model: nn.Module, train_state: dict[str, Any], **metadata: Any) -> Path:
        return checkpoint.save(
            self.path, _unwrap(model), self.spec, {**self.metadata, **metadata}, train_state
        )


class Batches:
    """Which samples each step takes on this rank. Data parallel: the global batch is
    batch_size x world; step s of an epoch takes the same global batch as one process with
    that batch would, and rank r takes its r-th part, so N workers with batch b train like 1
    worker with batch N*b (averaged gradients). Every rank runs the same number of steps, so
    no rank waits on a collective another skipped. (A parameter-server worker in an
    asynchronous mode hands out batches as workers come free instead: `paramserver.PSWorker`.)
    """

    def __init__(self, n: int, batch_size: int, world: int = 1, rank: int = 0):
        self.world, self.rank = world, rank
        self.global_batch = batch_size * world
        self.steps_per_epoch = math.ceil(n / self.global_batch)

    def per_epoch(self, epoch: int) -> int:
        return self.steps_per_epoch

    def steps(self, epoch: int, start: int) -> range:
        return range(start, self.steps_per_epoch)

    def indices(self, order: torch.Tensor, epoch: int, step: int) -> torch.Tensor:
        idx = order[step * self.global_batch : (step + 1) * self.global_batch]
        if self.world > 1:
            if len(idx) < self.world:  # a last batch smaller than the world: wrap around
                idx = torch.cat([idx, order[: self.world - len(idx)]])
            idx = torch.tensor_split(idx, self.world)[self.rank]
        return idx

    def weight(self, n: int, step: int) -> float:
        """This rank's loss weight at `step` of an epoch of `n` samples, so that the
        all-reduced mean of the ranks' gradients is one process's over the global batch:
        world x (its real samples) / (the batch's). 1.0 when the batch splits evenly; a last
        batch of 13 over 2 ranks weighs 7/6.5 and 6/6.5 (equal weights gave 2 workers
        weights up to 4e-3 away from one process's), and a wrapped-around duplicate 0."""
        if self.world == 1:
            return 1.0
        real = min(self.global_batch, n - step * self.global_batch)
        if real < self.world:  # one sample each: ranks past `real` hold a duplicate
            return self.world / real if self.rank < real else 0.0
        mine = _split_len(real, self.world, self.rank)
        return self.world * mine / real


def _split_len(n: int, parts: int, i: int) -> int:
    """Length of part i of `torch.tensor_split` of n items into `parts`."""
    return n // parts + (1 if i < n % parts else 0)


def _world() -> tuple[int, int]:
    """(world size, rank) of the default process group; (1, 0) when not distributed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # DistributedDataParallel keeps the model in .module


def cross_entropy_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    logits = model(x)
    return F.cross_entropy(logits, y), logits


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The shuffled sample order of `epoch` (0-based): DistributedSampler's rule."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g)


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    return optimizer_for([p for p in model.parameters() if p.requires_grad], cfg)


def optimizer_for(params: list[nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer `cfg` names over `params` (a parameter server passes its one shard).

    Adam runs torch's fused kernel where it has one for every parameter: one pass over each
    tensor instead of a dozen elementwise ops, the same update to rounding. On CPU an Adam
    step over LeNet-300-100's 266k values takes 0.13 ms fused against 1.15 ms, a cost a
    parameter server pays on every update (benchmarks/optimizer_step.py). SGD keeps torch's
    loop: its fused kernel fails on sparse gradients and when some parameters have a momentum
    buffer and others not yet (a branch used from a later step on), which the loop handles."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.learning_rate, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    return torch.optim.Adam(
        params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, fused=_fusable(params)
    )


def _fusable(params: list[nn.Parameter]) -> bool | None:
    """True when torch's fused Adam takes every tensor (floating point on CPU or CUDA, torch
    >= 2.4); None, torch's default loop, otherwise (e.g. a model on MPS)."""
    ok = bool(params) and all(
        p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params
    )
    return True if ok else None


def evaluate(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int | None = None,
    precision: str = "fp32",
    device: str = "cpu",
) -> tuple[float, float]:
    """Mean cross-entropy and top-1 accuracy of `model` on (x, y)."""
    loss, hits = evaluate_samples(model, x, y, batch_size, precision, device)
    return loss, int(hits.sum()) / len(y)


@_datapass.counted
@torch.no_grad()
def evaluate_samples(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int | None = None,
    precision: str = "fp32",
    device: str = "cpu",
) -> tuple[float, torch.Tensor]:
    """Mean cross-entropy of `model` on (x, y) and, per sample, whether its top-1 class is `y`
    (bool, on the CPU): paired accuracy comparisons between two models need the samples.
    `batch_size` None: `compresskit._mem.eval_batch`, sized to the model's activations."""
    if batch_size is None:
        batch_size = _mem.eval_batch(model, x[:2].to(device))
    was_training = model.training
    model.eval()
    loss_sum, parts = 0.0, []
    try:
        for i in range(0, len(y), batch_size):
            xb, yb = x[i : i + batch_size].to(device), y[i : i + batch_size].to(device)
            with _autocast(precision, device):
                logits = model(xb)
            loss_sum += float(F.cross_entropy(logits.float(), yb, reduction="sum"))
            parts.append((logits.argmax(1) == yb).cpu())
    finally:
        model.train(was_training)
    hits = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)
    return loss_sum / len(y), hits


def correct(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int | None = None
) -> torch.Tensor:
    """Per sample, whether `model`'s top-1 class is `y` (bool, on the CPU)."""
    return evaluate_samples(model, x, y, batch_size)[1]


def _autocast(precision: str, device: str):
    return torch.autocast(
        device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=precision == "bf16"
    )


@contextmanager
def deterministic(on: bool, device: str | torch.device = "cpu") -> Iterator[None]:
    """Within the block, torch uses deterministic kernels only (`TrainConfig.deterministic`);
    torch's own settings come back after it (CUBLAS_WORKSPACE_CONFIG, set for a GPU, stays:
    torch reads it once per process). An op with no deterministic kernel on this device, or a
    cuBLAS workspace setting that allows none, raises InputError in one line (exit 2), not
    torch's paragraph."""
    if not on:
        yield
        return
    was = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark = torch.backends.cudnn.benchmark
    # cuBLAS sums in a fixed order only with a fixed workspace; torch reads the variable when it
    # first makes cuBLAS's workspace, so it must be set before this process's first GPU matmul
    # (a user's own value is kept). A CPU run uses no cuBLAS: its environment is left alone.
    if torch.device(device).type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    except RuntimeError as e:
        text = str(e)
        off = "run without it (--no-deterministic when resuming a run that used it)"
        if "does not have a deterministic implementation" in text:
            op = text.split(" does not have", 1)[0].strip().splitlines()[-1][:120]
            raise InputError(
                f"--deterministic: {op} has no deterministic kernel on this device; {off}, "
                "or change the layer that uses it"
            ) from None
        if "CUBLAS_WORKSPACE_CONFIG" in text:  # a value of the user's that cuBLAS cannot use
            value = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
            raise InputError(
                f"--deterministic: CUBLAS_WORKSPACE_CONFIG={value} lets cuBLAS sum in any "
                f"order; unset it (:4096:8 is then used) or set :4096:8 or :16:8, or {off}"
            ) from None
        raise
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
        torch.backends.cudnn.benchmark = benchmark


def honours_deterministic(loop: Callable[..., Any]) -> Callable[..., Any]:
    """A training loop `loop(model, data, cfg, ...)` run under `deterministic(cfg.deterministic,
    cfg.device)`: this module's `fit` and the pipeline's."""

    @functools.wraps(loop)
    def run(model: nn.Module, data: Dataset, cfg: TrainConfig, *args: Any, **kwargs: Any) -> Any:
        with deterministic(cfg.deterministic, cfg.device):
            return loop(model, data, cfg, *args, **kwargs)

    return run


def _processes(world: int, updater: Any) -> str:
    """The processes whose batches make a step's global batch, in words for messages."""
    if updater is not None:
        return f"{world} parameter-server workers"
    return f"{world} all-reduce workers" if world > 1 else "1 process"


@honours_deterministic
def fit(
    model: nn.Module,
    data: Dataset,
    cfg: TrainConfig,
    *,
    loss_fn: LossFn = cross_entropy_loss,
    checkpointer: Checkpointer | None = None,
    resume: dict[str, Any] | None = None,
    events: Events | None = None,
    updater: Any = None,
    elastic: bool = True,
) -> TrainResult:
    """Train `model` in place on `data.x_train` and evaluate on `data.x_test` after each epoch
    (`cfg.evaluate = "last"`: after the last one only).
    Batches reach the model as the data holds them (float32 images, or int64 token ids, which
    `--precision bf16` leaves alone: autocast casts only inside the model's float operations).

    `resume` is the `train_state` of a checkpoint written by this loop; the caller has already
    loaded the matching weights into `model`. `updater` (a parameter-server worker) replaces
    the local optimizer step (it pushes the gradient and pulls the new weights) and says which
    batches this rank trains (the `Batches` interface). `elastic`: a resumed run may take
    another global batch than its checkpoint's (the caller gave other workers on purpose);
    else that is refused.
    """
    auto = cfg.microbatches == "auto"
    written_to = checkpointer.path if checkpointer is not None else "the checkpoint"
    _check(
        auto or cfg.microbatches <= cfg.batch_size,
        "--microbatches",
        cfg.microbatches,
        f"give 1 to the batch size ({cfg.batch_size})",
    )
    if not auto and cfg.microbatches > 1 and (bn := batch_statistics(model)) is not None:
        raise InputError(
            f"--microbatches {cfg.microbatches}: layer {bn!r} normalises over the batch "
            f"(BatchNorm), so micro-batches would train another model than batches of "
            f"{cfg.batch_size}; drop --microbatches (1)"
        )
    world, rank = (updater.workers, updater.rank) if updater is not None else _world()
    if rank != 0:  # only rank 0 reports progress and writes checkpoints
        events, checkpointer = None, None
    events = events or Events()
    device = cfg.device
    if device == "cuda" and world > 1:  # one GPU per local rank (NCCL)
        local = int(os.environ.get("LOCAL_RANK", rank))  # torchrun: rank on this node
        device = f"cuda:{local % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    model.to(device)
    if auto:  # before DDP wraps it: every rank measures the same model, so picks the same M
        m, per_sample, budget = auto_microbatches(model, loss_fn, data, cfg, device)
        cfg = replace(cfg, microbatches=m)
        if m > 1:
            events.info(
                f"micro-batches: {m} (auto: {per_sample * cfg.batch_size / 2**20:.0f} MiB of "
                f"activations per batch of {cfg.batch_size}, {budget / 2**20:.0f} MiB allowed)"
            )
    comm = None
    if world > 1 and updater is None:
        from compresskit.distrib import allreduce

        model, comm = allreduce.wrap(model, cfg.grad_compression, device)
    optimizer = make_optimizer(model, cfg)
    n = len(data.y_train)
    batches = updater if updater is not None else Batches(n, cfg.batch_size, world, rank)
    total = cfg.epochs * batches.per_epoch(0)
    _check(
        cfg.warmup_steps <= total,
        "--warmup-steps",
        cfg.warmup_steps,
        f"the whole run is {total} steps ({cfg.epochs} epoch(s) of {batches.per_epoch(0)}), so "
        f"the learning rate would never reach its peak: give {total} or fewer",
    )
    state = _initial_state(resume, optimizer, cfg, device)
    history, start = resume_position(state, batches, "--workers, --batch-size or --strategy")
    written = state.get("steps_per_epoch") if resume is not None else None
    here = _processes(world, updater)
    if written is not None and written != batches.per_epoch(state["epoch"]):
        if not elastic:
            # the README's `--resume` alone, after a --workers 2 run, went on as one process
            # with half the global batch: a change to it is made on purpose, never by leaving
            # a flag out
            was = state.get("processes") or "another --workers or --strategy"
            raise InputError(
                f"--resume: {written_to} was trained at {written} steps per epoch ({was}), "
                f"this run takes {batches.per_epoch(state['epoch'])} ({here}): pass the "
                "--workers and --strategy it was trained with, or give other ones on purpose "
                "to change the global batch from here on"
            )
        # allowed at an epoch's end (elastic training), but never silently: the global batch
        # and the schedule's length change from here on
        events.info(
            f"note: the checkpoint's run took {written} steps per epoch, this one takes "
            f"{batches.per_epoch(state['epoch'])} (another --workers or --strategy): the "
            "global batch changes from here on"
        )
    t0 = time.perf_counter()
    steps = samples = refreshed = 0
    test_correct = None

    def save(gathered: dict[str, Any] | None = None, **metadata: Any) -> None:
        if checkpointer is None:
            return
        state.update(rng_state(device))
        state["processes"] = here  # what a resumed run names when its global batch differs
        if updater is None:
            state["optimizer"] = optimizer.state_dict()
        else:  # the servers hold the master weights and the optimizer state: gather them
            state["optimizer"] = gathered or updater.take_master(model, optimizer)
        path = checkpointer.save(model, state, **metadata)
        events.checkpoint(path, state["epoch"], state["step"])

    model.train()
    for epoch in range(state["epoch"], cfg.epochs):
        t_epoch = time.perf_counter()
        order = epoch_order(n, cfg.seed, epoch)
        steps_per_epoch = state["steps_per_epoch"] = batches.per_epoch(epoch)
        events.epoch_start(epoch + 1, cfg.epochs, steps_per_epoch, state["step"])
        for step in batches.steps(epoch, state["step"]):
            idx = batches.indices(order, epoch, step)
            xb, yb = data.x_train[idx].to(device), data.y_train[idx].to(device)
            # The schedule's position: step s of epoch e, as a fraction of the whole run.
            lr = cfg.lr_at(epoch * steps_per_epoch + step, cfg.epochs * steps_per_epoch)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            weight = batches.weight(n, step) if isinstance(batches, Batches) else 1.0
            value, right = _accumulate(model, loss_fn, xb, yb, cfg, device, epoch, step, weight)
            if updater is None:
                optimizer.step()
            else:
                updater.step(model, lr, epoch, step, len(yb))
            # A wrapped-around duplicate (weight 0) trains nothing: not a sample, not a figure.
            real, right = (len(yb), right) if weight else (0, 0)
            due = record_step(state, cfg, step, value, right, real, steps_per_epoch)
            steps += 1
            samples += real
            events.step(epoch + 1, step + 1, value)
            if due:
                save()
        if world > 1 and updater is None:  # the epoch's training figures over all ranks
            totals = torch.tensor(  # on the device: NCCL reduces CUDA tensors only
                [state["loss_sum"], state["correct"], state["seen"]],
                dtype=torch.float64,
                device=device,
            )
            torch.distributed.all_reduce(totals)
            state["loss_sum"], state["correct"], state["seen"] = totals.tolist()
        _mem.trim()  # the epoch's freed memory back to the OS: peak RSS (compresskit._mem)
        if cfg.bn_refresh and updater is None and epoch == cfg.epochs - 1:
            k = min(cfg.bn_refresh, n)
            k -= k % cfg.batch_size if k >= cfg.batch_size else 0  # whole batches, as it uses
            idx = epoch_order(n, cfg.seed, cfg.epochs)[:k]  # a seeded order no epoch took
            refreshed = refresh_batchnorm_(
                _unwrap(model),
                data.x_train[idx],
                cfg.batch_size,
                lambda: _autocast(cfg.precision, device),
            )
            if refreshed:
                events.info(
                    f"BatchNorm: running statistics of {refreshed} layers re-estimated on "
                    f"{len(idx)} training samples"
                )
        gathered = None
        if updater is not None:
            if epoch == cfg.epochs - 1:
                updater.finish()  # rank 0: wait for every worker and take the run's figures
            if rank == 0:  # evaluate and save the servers' weights, not the last ones pulled
                gathered = updater.take_master(model, optimizer)
        if (updater is not None and rank != 0) or (  # only rank 0 reports a PS run
            cfg.evaluate == "last" and epoch < cfg.epochs - 1
        ):
            test_loss, test_acc, test_correct = math.nan, math.nan, None
        else:
            test_loss, test_correct = evaluate_samples(
                _unwrap(model), data.x_test, data.y_test, cfg.eval_batch_size, cfg.precision, device
            )
            test_acc = int(test_correct.sum()) / len(test_correct)
        record = EpochRecord(
            epoch=epoch + 1,
            train_loss=state["loss_sum"] / max(state["seen"], 1),
            train_accuracy=state["correct"] / max(state["seen"], 1),
            test_loss=test_loss,
            test_accuracy=test_acc,
            seconds=time.perf_counter() - t_epoch,
        )
        history.append(record)
        state.update(epoch=epoch + 1, step=0, loss_sum=0.0, correct=0, seen=0)
        state["history"] = [vars(r) for r in history]
        save(gathered, test_accuracy=test_acc, epochs=epoch + 1)
        events.epoch_end(record)

    if updater is not None:
        updater.finish()  # a no-op unless the run had nothing left to train
        updater.close()
    if world > 1 and updater is None:  # every rank's samples: an uneven last batch differs
        counted = torch.tensor([samples], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(counted)
        samples = int(counted.item())
    final_acc = history[-1].test_accuracy if history else float("nan")
    return TrainResult(
        history=history,
        test_accuracy=final_acc,
        epochs=len(history),
        steps=updater.updates if updater is not None else steps,
        samples=updater.samples if updater is not None else samples,
        seconds=time.perf_counter() - t0,
        checkpoint=checkpointer.path if checkpointer else None,
        resumed_from=start if resume else None,
        workers=world,
        comm_bytes=updater.stats.comm_bytes if updater else comm.bytes if comm else 0,
        strategy=updater.report() if updater is not None else {},
        microbatches=cfg.microbatches,
        bn_refreshed=refreshed,
        test_correct=test_correct,
    )


# `microbatches="auto"`: one slice's activations within this many times the model's parameter
# bytes, and never sliced below this many bytes (small models keep their whole batch). ViT-tiny
# (5.4M parameters, 20.5 MiB) saves 9.8 MiB per 3x32x32 sample, 315 MiB per batch of 32: auto
# takes 4 slices of at most 82 MiB (its whole shrink: 818-843 MiB against 1,083-1,094 with 1;
# docs/benchmarks.md, "Peak memory by step").
AUTO_ACTIVATIONS = 4
AUTO_FLOOR = 16 << 20
AUTO_PROBE = 8  # samples of the larger measuring forward pass (the other takes half)


def saved_bytes(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes that autograd keeps for the backward pass of one forward (no backward) over
    `x`, under `saved_tensors_hooks`: each view of a storage once (one tensor saved by two ops
    counts once, a slice its own bytes, not its storage's), the parameters left out. The
    caller's random generators are left as they were, so dropout's masks in training are the
    same as without the measurement."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    views: dict[int, set[tuple[int, int, int]]] = {}
    sizes: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params:
            views.setdefault(ptr, set()).add((t.storage_offset(), t.numel(), t.element_size()))
            sizes[ptr] = storage.nbytes()
        # Detached: the storage stays alive until the graph goes (no later tensor takes its
        # address and gets counted as it), without the tensor's grad_fn. Returning `t` itself
        # made every op that saves its own output (GELU, softmax) a reference cycle through
        # the graph that Python's collector cannot see: each measurement kept its forwards'
        # saved tensors for good (ViT-tiny: 120 MiB a call, one call per retraining run).
        return t.detach()

    devices = [x.device] if x.device.type == "cuda" else []
    with (
        torch.random.fork_rng(devices=devices),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        loss, _ = loss_fn(model, x, y)
    del loss  # the graph, and with it every saved tensor
    return sum(min(sizes[p], sum(n * size for _, n, size in v)) for p, v in views.items())


def saved_bytes_per_sample(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor
) -> float:
    """What one more sample adds to `saved_bytes`: measured on the first half of `x` and on
    all of it, the difference over the samples added. Saved tensors that do not grow with the
    batch (weights a parametrization computes, as weight sharing's codebook lookup; a prior's
    terms; bf16 copies of weights) cancel out: counted per sample, they made a LeNet-5 under
    weight sharing look like it needed 4 slices."""
    half = len(y) // 2
    if half < 1:
        raise ValueError("saved_bytes_per_sample needs 2 samples or more")
    whole = saved_bytes(model, loss_fn, x[: 2 * half], y[: 2 * half])
    part = saved_bytes(model, loss_fn, x[:half], y[:half])
    return max(0.0, (whole - part) / half)


def auto_microbatches(
    model: nn.Module, loss_fn: LossFn, data: Dataset, cfg: TrainConfig, device: str
) -> tuple[int, float, int]:
    """`microbatches="auto"`: the fewest slices of `cfg.batch_size` whose activations each fit
    max(AUTO_FLOOR, AUTO_ACTIVATIONS x the parameter bytes). Returns (M, activation bytes per
    sample, the budget). A model with BatchNorm keeps its batch whole (M = 1, not measured: the
    measuring forward would move its running statistics), as does a data set of one sample."""
    budget = max(
        AUTO_FLOOR,
        AUTO_ACTIVATIONS * sum(p.numel() * p.element_size() for p in model.parameters()),
    )
    k = min(AUTO_PROBE, len(data.y_train))
    if batch_statistics(model) is not None or k < 2:
        return 1, 0.0, budget
    x, y = data.x_train[:k].to(device), data.y_train[:k].to(device)
    was = model.training
    model.train()  # what training saves: dropout's masks included
    try:
        with _autocast(cfg.precision, device):
            per_sample = saved_bytes_per_sample(model, loss_fn, x, y)
    finally:
        model.train(was)
    m = max(1, min(cfg.batch_size, math.ceil(cfg.batch_size * per_sample / budget)))
    return m, per_sample, budget


def _accumulate(
    model: nn.Module,
    loss_fn: LossFn,
    xb: torch.Tensor,
    yb: torch.Tensor,
    cfg: TrainConfig,
    device: str,
    epoch: int,
    step: int,
    weight: float = 1.0,
) -> tuple[float, int]:
    """Forward and backward over `cfg.microbatches` consecutive slices of the batch (1: the
    batch whole), their gradients summing in `.grad`: each slice's loss is weighted by its
    share of the batch, so for a loss that is a mean over samples the sum is the whole batch's
    gradient (a share of 1.0 leaves the one-slice gradient bit for bit). `weight` scales the
    gradient (`Batches.weight`: this rank's share of an unevenly split global batch; 1.0
    leaves it bit for bit). Returns the batch's mean loss and its top-1 hits."""
    n = len(yb)
    # M slices whose sizes differ by at most one (fewer when the batch has fewer samples)
    m = min(cfg.microbatches, n)
    bounds = [n * k // m for k in range(m + 1)]
    value, right = 0.0, 0
    for k in range(m):
        xs, ys = xb[bounds[k] : bounds[k + 1]], yb[bounds[k] : bounds[k + 1]]
        share = len(ys) / n
        # DDP all-reduces the gradients once, in the last micro-batch's backward.
        last = k == m - 1
        quiet = model.no_sync() if not last and hasattr(model, "no_sync") else nullcontext()
        with quiet:
            with _autocast(cfg.precision, device):
                loss, logits = loss_fn(model, xs, ys)
            part = float(loss.detach())
            check_finite(part, epoch, step)  # before any step: no NaN gradient reaches weights
            (loss * (share * weight)).backward()
        value += part * share
        right += int((logits.argmax(1) == ys).sum())
    return value, right


def check_finite(loss: float, epoch: int, step: int) -> None:
    """Stop a run whose loss diverged, before its step reaches the weights."""
    if not math.isfinite(loss):
        raise StageError(
            f"training diverged at epoch {epoch + 1} step {step + 1} (loss {loss}); lower the "
            "learning rate (compress train --lr; under compress shrink, the recipe's lr of the "
            "stage that trains: prune.lr, quantize.lr, distill.lr or channels.lr)"
        )


def record_step(
    state: dict[str, Any], cfg: TrainConfig, step: int, loss: float, right: int, n: int,
    steps_per_epoch: int,
) -> bool:  # fmt: skip
    """Add one step of `n` samples (mean `loss`, `right` correct) to the epoch's running figures
    in `state`; True when a mid-epoch checkpoint is due (the epoch-end save covers the epoch's
    last step)."""
    state["loss_sum"] += loss * n
    state["correct"] += right
    state["seen"] += n
    state["step"] = step + 1
    state["global_step"] += 1
    every = cfg.checkpoint_every
    return bool(every) and state["global_step"] % every == 0 and state["step"] < steps_per_epoch


def resume_position(
    state: dict[str, Any], batches, settings: str
) -> tuple[list[EpochRecord], tuple[int, int]]:
    """The history so far and the (epoch, step) to start from; refuses a mid-epoch checkpoint
    whose steps per epoch differ from this run's (`settings`: the flags that set them), since
    another layout would skip or repeat part of the epoch."""
    written, have = state.get("steps_per_epoch"), batches.per_epoch(state["epoch"])
    if state["step"] and written is not None and written != have:
        raise InputError(
            f"--resume: the checkpoint stopped mid-epoch at step {state['step']} of {written}, "
            f"but this run takes {have} steps per epoch (another {settings}); resume with "
            "the settings it was written with"
        )
    return [EpochRecord(**r) for r in state["history"]], (state["epoch"], state["step"])


def rng_state(device: str | torch.device) -> dict[str, torch.Tensor]:
    """The generators a resumed run must continue: the CPU's (data order is seeded apart), and on
    a GPU that device's own, which dropout there draws from (with the CPU's state alone, a
    resumed CUDA run would draw other dropout masks than the uninterrupted run)."""
    out = {"rng": torch.get_rng_state()}
    if torch.device(device).type == "cuda":
        out["cuda_rng"] = torch.cuda.get_rng_state(device)
    return out


def _restore_rng(resume: dict[str, Any], device: str | torch.device) -> None:
    torch.set_rng_state(resume["rng"])
    # A CPU checkpoint resumed on a GPU (or the reverse) continues from the seed's CUDA state.
    if torch.device(device).type == "cuda" and resume.get("cuda_rng") is not None:
        torch.cuda.set_rng_state(resume["cuda_rng"], device)


def check_events(progress: Any) -> None:
    """InputError unless `progress` is an `Events` (or None): `progress=print` failed mid-run."""
    if progress is not None and not isinstance(progress, Events):
        raise InputError(
            f"progress {brief(progress)}: give a compresskit.distrib.Events (subclass it and "
            "override the callbacks you want), or None"
        )


def check_train_state(resume: Any) -> None:
    """A checkpoint's training state, as `--resume` reads it: InputError unless it has the
    fields a run writes, of their types (a crafted or damaged file: ZeroDivisionError,
    TypeError or AttributeError deep in the loop otherwise)."""
    if not isinstance(resume, dict):
        raise InputError("checkpoint's training state is damaged; drop --resume to start over")
    missing = [k for k in ("epoch", "step", "optimizer", "rng") if k not in resume]
    if missing:
        raise InputError(f"checkpoint's train_state lacks {missing}; drop --resume to start over")
    counts = ("epoch", "step", "global_step", "correct", "seen", "steps_per_epoch")
    bad = [
        k
        for k in counts
        if k in resume
        and (not isinstance(resume[k], int) or isinstance(resume[k], bool) or resume[k] < 0)
    ]
    if not isinstance(resume.get("config", {}), dict):
        bad.append("config")
    processes = resume.get("processes", "")
    if not isinstance(processes, str) or len(processes) > 80 or not processes.isprintable():
        bad.append("processes")  # named in a message: never a crafted file's escape codes
    history = resume.get("history", [])
    if not isinstance(history, list) or not all(isinstance(r, dict) for r in history):
        bad.append("history")
    if not isinstance(resume["optimizer"], dict):
        bad.append("optimizer")
    if not (isinstance(resume["rng"], torch.Tensor) and resume["rng"].dtype == torch.uint8):
        bad.append("rng")
    if bad:
        raise InputError(
            f"checkpoint's training state is damaged ({', '.join(bad)}); drop --resume to "
            "start over"
        )


def _initial_state(
    resume: dict[str, Any] | None,
    optimizer: torch.optim.Optimizer,
    cfg: TrainConfig,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    fresh = {
        "epoch": 0,
        "step": 0,
        "global_step": 0,
        "loss_sum": 0.0,
        "correct": 0,
        "seen": 0,
        "history": [],
        "config": cfg.to_dict(),
    }
    if resume is None:
        return fresh
    check_train_state(resume)
    try:
        optimizer.load_state_dict(resume["optimizer"])
        _restore_rng(resume, device)
    except (TypeError, ValueError, KeyError, IndexError, RuntimeError) as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise InputError(
            f"checkpoint's training state is damaged ({why}); drop --resume to start over"
        ) from None
    kept = {k: v for k, v in resume.items() if k not in ("optimizer", "rng", "cuda_rng")}
    state = {**fresh, **kept}
    state["config"] = cfg.to_dict()
    return state
