"""What every zoo model shares: its input shape, class count and `example_inputs()`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def check_shape(in_shape: Sequence[int], num_classes: int) -> tuple[int, int, int]:
    """Validate (C, H, W) or (F,) and the class count; return (C, H, W)."""
    try:
        shape = tuple(int(s) for s in in_shape)
    except (TypeError, ValueError):
        raise ValueError(f"in_shape must be a list like [C, H, W], got {in_shape!r}") from None
    if len(shape) == 1:
        shape = (1, 1, shape[0])
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"in_shape must be (C, H, W) or (F,) of positive sizes, got {in_shape}")
    if not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes must be at least 2, got {num_classes}")
    return shape  # type: ignore[return-value]


class ZooModel(nn.Module):
    """Base class: records `in_shape` and `num_classes`, makes example inputs."""

    def __init__(self, in_shape: Sequence[int], num_classes: int) -> None:
        super().__init__()
        self.in_shape = check_shape(in_shape, num_classes)
        self.num_classes = int(num_classes)

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
