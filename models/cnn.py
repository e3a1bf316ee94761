"""A large VGG-style teacher (Simonyan & Zisserman 2015) with BatchNorm (Ioffe & Szegedy 2015).

Four stages of two 3x3 conv-BN-ReLU layers (64, 128, 256, 512 channels at width 64), a 2x2
max-pool between stages while the feature map is at least 2x2, global average pooling and one
linear classifier: about 4.7M parameters whatever the input size, so one teacher recipe fits
8x8 digits, 28x28 MNIST and 32x32x3 images.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from compresskit.models.base import ZooModel
from compresskit.models.zoo import register


@register("vgg", tiny={"width": 4}, about="VGG-style teacher with BatchNorm (~4.7M params)")
class VGG(ZooModel):
    """VGG-style CNN with BatchNorm and global average pooling."""

    def __init__(
        self,
        in_shape: Sequence[int] = (3, 32, 32),
        num_classes: int = 10,
        width: int = 64,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(in_shape, num_classes)
        c, h, w = self.image_shape
        layers: list[nn.Module] = []
        for stage in range(4):
            out = int(width) * 2**stage
            if stage > 0 and min(h, w) >= 2:
                layers.append(nn.MaxPool2d(2))
                h, w = h // 2, w // 2
            for _ in range(2):
                layers += [
                    nn.Conv2d(c, out, 3, padding=1, bias=False),
                    nn.BatchNorm2d(out),
                    nn.ReLU(),
                ]
                c = out
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Dropout(dropout), nn.Linear(c, num_classes)
        )

    def forward(self, x):
        return self.classifier(self.pool(self.features(x)))
