"""LeNet-5, the Caffe variant used by Deep Compression (Han, Mao & Dally, ICLR 2016).

conv 5x5x20 -> max-pool 2 -> conv 5x5x50 -> max-pool 2 -> fc 500 -> ReLU -> fc 10:
431,080 parameters on 28x28 MNIST (the paper's "431K weights"). Caffe's LeNet has no ReLU
between the convolutions; we follow it.

Inputs smaller than 28x28 (8x8 digits) get "same" padding in the convolutions so the two
poolings still leave a feature map; 28x28 and larger use Caffe's unpadded convolutions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from compresskit.models.base import ZooModel
from compresskit.models.zoo import register


@register(
    "lenet5", tiny={"channels": [4, 8], "fc": 16}, about="LeNet-5 Caffe CNN (Deep Compression)"
)
class LeNet5(ZooModel):
    """LeNet-5 (Caffe): conv20, pool, conv50, pool, fc500, fc10."""

    def __init__(
        self,
        in_shape: Sequence[int] = (1, 28, 28),
        num_classes: int = 10,
        channels: Sequence[int] = (20, 50),
        fc: int = 500,
    ) -> None:
        super().__init__(in_shape, num_classes)
        c, h, w = self.image_shape
        pad = 2 if min(h, w) < 16 else 0
        c1, c2 = (int(x) for x in channels)
        # Named as in the paper's Table 3 (conv1, conv2, fc1, fc2).
        self.conv1 = nn.Conv2d(c, c1, 5, padding=pad)
        self.conv2 = nn.Conv2d(c1, c2, 5, padding=pad)
        with torch.no_grad():
            flat = self._features(torch.zeros(1, c, h, w)).shape[1]
        self.fc1 = nn.Linear(flat, fc)
        self.fc2 = nn.Linear(fc, num_classes)

    def _features(self, x):
        x = F.max_pool2d(self.conv1(x), 2)
        return F.max_pool2d(self.conv2(x), 2).flatten(1)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(self._features(x))))
