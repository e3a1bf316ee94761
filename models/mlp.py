"""Multi-layer perceptrons: LeNet-300-100 (LeCun et al. 1998) and a narrow student MLP.

LeNet-300-100 is the fully connected net of the Deep Compression paper (Han, Mao & Dally,
ICLR 2016): 784-300-100-10, 266,610 parameters on 28x28 MNIST.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import nn

from compresskit.models.base import ZooModel
from compresskit.models.zoo import register


class MLP(ZooModel):
    """Fully connected ReLU net on flattened inputs."""

    def __init__(
        self, in_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (64,)
    ) -> None:
        super().__init__(in_shape, num_classes)
        sizes = [math.prod(self.in_shape), *[int(h) for h in hidden], self.num_classes]
        # Named fc1, fc2, ... as in the paper's tables, so reports and recipes read naturally.
        self.fcs = [f"fc{i}" for i in range(1, len(sizes))]
        for name, (a, b) in zip(self.fcs, itertools.pairwise(sizes), strict=True):
            self.add_module(name, nn.Linear(a, b))

    def forward(self, x):
        x = x.flatten(1)
        for name in self.fcs[:-1]:
            x = torch.relu(getattr(self, name)(x))
        return getattr(self, self.fcs[-1])(x)


@register("lenet300", tiny={"hidden": [16, 8]}, about="LeNet-300-100 MLP (Deep Compression)")
class LeNet300(MLP):
    """LeNet-300-100: two hidden layers of 300 and 100 units."""

    def __init__(
        self,
        in_shape: Sequence[int] = (1, 28, 28),
        num_classes: int = 10,
        hidden: Sequence[int] = (300, 100),
    ) -> None:
        super().__init__(in_shape, num_classes, hidden)


@register("mlp", tiny={"hidden": [8]}, about="narrow MLP student (one hidden layer of 64)")
class NarrowMLP(MLP):
    """Narrow MLP student: one small hidden layer."""

    def __init__(
        self,
        in_shape: Sequence[int] = (1, 28, 28),
        num_classes: int = 10,
        hidden: Sequence[int] = (64,),
    ) -> None:
        super().__init__(in_shape, num_classes, hidden)
