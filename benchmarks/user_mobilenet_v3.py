"""A user's own model: MobileNetV3-small as torchvision builds it (Howard et al., "Searching for
MobileNetV3", ICCV 2019), written out with torch's layers because torchvision's wheel does not
import on our CPU torch. 1.53M parameters at 10 classes; BatchNorm with eps 0.001 and momentum
0.01, hard swish, hard-sigmoid squeeze-and-excite, as torchvision's.

    PYTHONPATH=benchmarks compress train --model user_mobilenet_v3:MobileNetV3Small \
        --data npz:W/images.npz --epochs 12 --out W/mnv3.pt
    PYTHONPATH=benchmarks compress shrink W/mnv3.pt --model user_mobilenet_v3:MobileNetV3Small \
        --data npz:W/images.npz --recipe W/fast.toml --out W/mnv3-shrunk

(W/images.npz and W/fast.toml as `benchmarks/real_models.py` writes them.) Its slow BatchNorm
averages are why `shrink` refreshes BatchNorm statistics after retraining (recipe
`train.bn_refresh`; docs/benchmarks.md, "Adaptive BatchNorm")."""

import torch
from torch import nn


def _div(v, d=8):
    n = max(d, int(v + d / 2) // d * d)
    return n + d if n < 0.9 * v else n


class SE(nn.Module):
    def __init__(self, c):
        super().__init__()
        s = _div(c // 4)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1, self.fc2 = nn.Conv2d(c, s, 1), nn.Conv2d(s, c, 1)
        self.relu, self.scale = nn.ReLU(), nn.Hardsigmoid()

    def forward(self, x):
        return x * self.scale(self.fc2(self.relu(self.fc1(self.avgpool(x)))))


def cba(cin, cout, k, s=1, groups=1, act=nn.Hardswish):
    layers = [
        nn.Conv2d(cin, cout, k, s, (k - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout, eps=0.001, momentum=0.01),
    ]
    if act is not None:
        layers.append(act())
    return nn.Sequential(*layers)


class Block(nn.Module):
    def __init__(self, cin, k, exp, cout, se, act, stride):
        super().__init__()
        act = nn.Hardswish if act == "HS" else nn.ReLU
        layers = []
        if exp != cin:
            layers.append(cba(cin, exp, 1, act=act))
        layers.append(cba(exp, exp, k, stride, groups=exp, act=act))
        if se:
            layers.append(SE(exp))
        layers.append(cba(exp, cout, 1, act=None))
        self.block = nn.Sequential(*layers)
        self.res = stride == 1 and cin == cout

    def forward(self, x):
        y = self.block(x)
        return x + y if self.res else y


SMALL = [
    (16, 3, 16, 16, True, "RE", 2),
    (16, 3, 72, 24, False, "RE", 2),
    (24, 3, 88, 24, False, "RE", 1),
    (24, 5, 96, 40, True, "HS", 2),
    (40, 5, 240, 40, True, "HS", 1),
    (40, 5, 240, 40, True, "HS", 1),
    (40, 5, 120, 48, True, "HS", 1),
    (48, 5, 144, 48, True, "HS", 1),
    (48, 5, 288, 96, True, "HS", 2),
    (96, 5, 576, 96, True, "HS", 1),
    (96, 5, 576, 96, True, "HS", 1),
]


class MobileNetV3Small(nn.Module):
    def __init__(self, in_shape=(3, 32, 32), num_classes=10):
        super().__init__()
        layers = [cba(in_shape[0], 16, 3, 2)]
        layers += [Block(*c) for c in SMALL]
        layers.append(cba(96, 576, 1))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Linear(576, 1024), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(1024, num_classes)
        )

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))
