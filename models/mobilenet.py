"""A MobileNet-style student: depthwise-separable convolutions (Howard et al. 2017).

A 3x3 stem, then blocks of depthwise 3x3 + pointwise 1x1 convolution, each with BatchNorm and
ReLU6; strides of 2 halve the map while it is at least 4x4 (so 8x8 inputs keep a 2x2 map);
global average pooling and a linear classifier. `width` scales every layer, as MobileNet's alpha.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from compresskit.models.base import ZooModel
from compresskit.models.zoo import register

# (output channels relative to width, stride) per depthwise-separable block.
_BLOCKS = ((2, 1), (4, 2), (4, 1), (8, 2), (8, 1))


def _conv_bn(cin: int, cout: int, k: int, stride: int, groups: int = 1) -> list[nn.Module]:
    return [
        nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU6(),
    ]


@register("mobilenet", tiny={"width": 4}, about="MobileNet-style depthwise-separable student")
class MobileNet(ZooModel):
    """MobileNet-style CNN of depthwise-separable blocks."""

    def __init__(
        self, in_shape: Sequence[int] = (3, 32, 32), num_classes: int = 10, width: int = 16
    ) -> None:
        super().__init__(in_shape, num_classes)
        c, h, w = self.image_shape
        layers = _conv_bn(c, width, 3, 1)
        c = width
        for mult, stride in _BLOCKS:
            out = width * mult
            s = stride if min(h, w) >= 4 else 1
            h, w = -(-h // s), -(-w // s)
            layers += _conv_bn(c, c, 3, s, groups=c)  # depthwise
            layers += _conv_bn(c, out, 1, 1)  # pointwise
            c = out
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(c, num_classes))

    def forward(self, x):
        return self.classifier(self.pool(self.features(x)))
