"""What every zoo model shares: its input shape, class count and `example_inputs()`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn


def check_shape(in_shape: Sequence[int], num_classes: int) -> tuple[int, ...]:
    """Validate (C, H, W) images or (F,) features and the class count; return the shape.

    (F,) stays (F,): `models.data` gives (N, F) features as (N, F), and a model built for
    (1, 1, F) was refused on them ("built for (1, 1, 8)") on a fresh run."""
    try:
        shape = tuple(int(s) for s in in_shape)
    except (TypeError, ValueError):
        raise ValueError(f"in_shape must be a list like [C, H, W], got {in_shape!r}") from None
    if len(shape) not in (1, 3) or min(shape) < 1:
        raise ValueError(f"in_shape must be (C, H, W) or (F,) of positive sizes, got {in_shape}")
    if not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes must be at least 2, got {num_classes}")
    return shape


def image_shape(shape: Sequence[int], model: str) -> tuple[int, int, int]:
    """(C, H, W) of a model that convolves images; ValueError for (F,) features."""
    if len(shape) != 3:
        raise ValueError(
            f"{model} convolves images (C, H, W), but the inputs are features of shape "
            f"{tuple(shape)}; give them to a model that flattens (mlp, lenet300)"
        )
    c, h, w = shape
    return c, h, w


class ZooModel(nn.Module):
    """Base class: records `in_shape` and `num_classes`, makes example inputs."""

    def __init__(self, in_shape: Sequence[int], num_classes: int) -> None:
        super().__init__()
        self.in_shape = check_shape(in_shape, num_classes)
        self.num_classes = int(num_classes)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W), for a model that convolves images (ValueError for (F,) features)."""
        return image_shape(self.in_shape, type(self).__name__)

    def example_inputs(self, batch: int = 2, seed: int = 0) -> tuple[torch.Tensor]:
        """A seeded batch in [0, 1) of this model's input shape (the layout `models.data` gives)."""
        g = torch.Generator().manual_seed(seed)
        return (torch.rand((batch, *self.in_shape), generator=g),)


def batch_statistics(model: nn.Module) -> str | None:
    """The name of the first module that normalises over the batch (BatchNorm in any of its
    forms), or None. Such a model trains differently when a batch is split into micro-batches:
    each is normalised on its own statistics."""
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            return name or type(m).__name__
    return None


# A retraining run re-estimates BatchNorm statistics (`refresh_batchnorm_`) where its running
# averages still give more than this share to batches from before it. Momentum 0.1 (torch's
# default) forgets within ~45 steps; refreshing such models anyway (ResNet-18, MobileNetV2,
# EfficientNet-B0 of the matrix, one retraining epoch a run) moved test accuracy by -1 to +1 of
# 400 samples and cost EfficientNet-B0 16 s of its 32 s of retraining (docs/benchmarks.md,
# "Adaptive BatchNorm"); momentum 0.01 over 45 steps keeps 64%.
BN_STALE = 0.01


def batchnorm_memory(model: nn.Module, steps: int) -> float:
    """The largest share that any BatchNorm's running statistics still give to batches from
    before their last `steps` updates: (1 - momentum)^steps for torch's exponential average, 1
    for a cumulative one (momentum None), 0 for a model without BatchNorm. What a retraining
    run of `steps` steps left of the statistics of the weights it started from."""
    shares = [
        1.0 if m.momentum is None else (1.0 - m.momentum) ** max(steps, 0)
        for m in _running_norms(model)
    ]
    return max(shares, default=0.0)


def _running_norms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The BatchNorm layers that keep running statistics."""
    return [
        m
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    ]


def refresh_batchnorm_(
    model: nn.Module,
    x: torch.Tensor,
    batch_size: int,
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> int:
    """Replace every BatchNorm's running mean and variance by the statistics of `x` under the
    model's weights as they are now; returns how many layers it refreshed (0: none, or fewer
    than 2 samples). Adaptive BatchNorm (Li et al., "EagleEye", ECCV 2020): after pruning or
    weight sharing the running averages describe the weights before the change, and a model
    whose BatchNorm momentum is small lags far behind them (torchvision's MobileNetV3 and
    EfficientNet use 0.01: a MobileNetV3-small shrunk with one retraining epoch tested at 36.5%
    with its running averages and 96.25% with refreshed ones; docs/benchmarks.md).

    Forward passes only, no gradients, every other module in eval mode (dropout off); batches
    of `batch_size` (the last, shorter one dropped so that every batch weighs the same in
    torch's cumulative average, unless it is the only one), each under `context()` (autocast
    for bf16 training). Momenta and training modes are left as they were."""
    norms = _running_norms(model)
    if not norms or len(x) < 2:
        return 0
    device = next((t.device for t in [*model.parameters(), *model.buffers()]), x.device)
    step = max(2, min(batch_size, len(x)))
    stop = len(x) - len(x) % step
    modes = [(m, m.training) for m in model.modules()]
    momenta = [m.momentum for m in norms]
    model.eval()
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average over the batches, not an exponential one
        m.train()
    try:
        with torch.no_grad():
            for i in range(0, stop, step):
                with context():
                    model(x[i : i + step].to(device))
    finally:
        for m, momentum in zip(norms, momenta, strict=True):
            m.momentum = momentum
        for m, training in modes:
            m.training = training
    return len(norms)
