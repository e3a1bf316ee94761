"""Small members of the architecture families users bring, built from torch's own layers.

The model matrix (`benchmarks/real_models.py`) runs the real networks from Hugging Face
`transformers` or torchvision (`models/hf.py`, the `[zoo]` extra). These are the same families
in a few thousand parameters, with no extra installed, so the default test run takes each one
through every stage:

* `resnet_se` -- inverted residual blocks (Sandler et al., MobileNetV2, 2018): 1x1 expand,
  depthwise 3x3, squeeze-and-excitation (Hu et al. 2018, as in MobileNetV3 and EfficientNet),
  1x1 project, identity shortcut where shapes allow. Grouped and depthwise convs, BatchNorm,
  residual adds and a sigmoid gate: what trips pruning, sharing and INT8 in real CNNs. With
  `act="hardswish", bn_momentum=0.01` it is MobileNetV3's kind (hard swish, a hard-sigmoid
  gate, torchvision's slow BatchNorm averages).
* `vit` -- a Vision Transformer (Dosovitskiy et al. 2021): patch embedding (a strided conv),
  a class token, learned positions, pre-norm blocks of `nn.MultiheadAttention` (its packed
  q/k/v projection is one (3d, d) parameter, not a Linear) and a GELU MLP.
* `textcls` -- a BERT-style text classifier (Devlin et al. 2019): token and position
  embeddings, the same encoder blocks, the class token's state to a linear head. Its input is
  int64 token ids (N, L); id `pad_id` is padding, masked out of attention inside the model, so
  the one input tensor carries the attention mask too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from compresskit.models.base import ZooModel
from compresskit.models.zoo import register


class SqueezeExcite(nn.Module):
    """Channel gate: global pool -> 1x1 reduce -> ReLU -> 1x1 expand -> sigmoid -> scale
    (`hard`: MobileNetV3's hard sigmoid)."""

    def __init__(self, channels: int, reduced: int, hard: bool = False) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, reduced, 1)
        self.expand = nn.Conv2d(reduced, channels, 1)
        self.hard = hard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.expand(torch.relu(self.reduce(x.mean((2, 3), keepdim=True))))
        return x * (nn.functional.hardsigmoid(s) if self.hard else torch.sigmoid(s))


# act: the blocks' activation; "hardswish" with bn_momentum 0.01 is MobileNetV3 as torchvision
# builds it (Howard et al. 2019), whose slow BatchNorm averages `train.bn_refresh` is for.
ACTIVATIONS = {"relu6": nn.ReLU6, "hardswish": nn.Hardswish}


class InvertedResidual(nn.Module):
    def __init__(
        self,
        cin: int,
        cout: int,
        stride: int,
        expand: int,
        act: str = "relu6",
        bn_momentum: float = 0.1,
    ) -> None:
        super().__init__()
        mid = cin * expand
        act_layer, hard = ACTIVATIONS[act], act == "hardswish"
        self.block = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False),
            nn.BatchNorm2d(mid, momentum=bn_momentum),
            act_layer(),
            nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False),  # depthwise
            nn.BatchNorm2d(mid, momentum=bn_momentum),
            act_layer(),
            SqueezeExcite(mid, max(4, mid // 4), hard),
            nn.Conv2d(mid, cout, 1, bias=False),
            nn.BatchNorm2d(cout, momentum=bn_momentum),
        )
        self.shortcut = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.shortcut else y


@register(
    "resnet_se",
    tiny={"width": 8, "depth": 2, "expand": 2},
    about="residual CNN: inverted residuals, depthwise convs, squeeze-excite (MobileNetV2/V3 family)",
)
class ResNetSE(ZooModel):
    """Residual CNN of inverted-residual blocks with depthwise convs and squeeze-excite."""

    def __init__(
        self,
        in_shape: Sequence[int] = (3, 32, 32),
        num_classes: int = 10,
        width: int = 16,
        depth: int = 3,
        expand: int = 4,
        act: str = "relu6",
        bn_momentum: float = 0.1,
    ) -> None:
        super().__init__(in_shape, num_classes)
        if act not in ACTIVATIONS:
            raise ValueError(f"act must be one of {sorted(ACTIVATIONS)}, got {act!r}")
        if not 0 < bn_momentum <= 1:
            raise ValueError(f"bn_momentum must be in (0, 1], got {bn_momentum!r}")
        c, h, w = self.image_shape
        self.stem = nn.Sequential(
            nn.Conv2d(c, width, 3, 1, 1, bias=False),
            nn.BatchNorm2d(width, momentum=bn_momentum),
            ACTIVATIONS[act](),
        )
        blocks, c = [], width
        for stage in range(depth):
            out = width * 2**stage
            stride = 2 if stage and min(h, w) >= 4 else 1
            h, w = -(-h // stride), -(-w // stride)
            blocks += [
                InvertedResidual(c, out, stride, expand, act, bn_momentum),
                InvertedResidual(out, out, 1, expand, act, bn_momentum),
            ]
            c = out
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class EncoderBlock(nn.Module):
    """Pre-norm transformer block: x + MHA(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, dim: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp), nn.GELU(), nn.Linear(mlp, dim))

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, key_padding_mask=pad, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class _Encoder(nn.Module):
    def __init__(self, dim: int, depth: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(EncoderBlock(dim, heads, mlp) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        for b in self.blocks:
            x = b(x, pad)
        return self.norm(x)


@register(
    "vit",
    tiny={"patch": 4, "dim": 16, "depth": 1, "heads": 2, "mlp": 32},
    about="Vision Transformer: patch embedding, class token, MultiheadAttention, GELU MLP",
)
class ViT(ZooModel):
    """Vision Transformer (patch embedding, class token, pre-norm encoder blocks)."""

    def __init__(
        self,
        in_shape: Sequence[int] = (3, 32, 32),
        num_classes: int = 10,
        patch: int = 4,
        dim: int = 64,
        depth: int = 4,
        heads: int = 4,
        mlp: int = 128,
    ) -> None:
        super().__init__(in_shape, num_classes)
        c, h, w = self.image_shape
        if h % patch or w % patch:
            raise ValueError(f"image {h}x{w} is not a whole number of {patch}x{patch} patches")
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.patch = nn.Conv2d(c, dim, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, 1 + (h // patch) * (w // patch), dim) * 0.02)
        self.encoder = _Encoder(dim, depth, heads, mlp)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.patch(x).flatten(2).transpose(1, 2)
        t = torch.cat([self.cls.expand(t.shape[0], -1, -1), t], 1) + self.pos
        return self.head(self.encoder(t)[:, 0])


@register(
    "textcls",
    tiny={"vocab_size": 64, "dim": 16, "depth": 1, "heads": 2, "mlp": 32},
    about="BERT-style text classifier on int64 token ids (id 0 = padding)",
    inputs="tokens",
)
class TextClassifier(nn.Module):
    """BERT-style encoder over token ids; the class token's final state feeds the head."""

    def __init__(
        self,
        in_shape: Sequence[int] = (32,),
        num_classes: int = 2,
        vocab_size: int = 1000,
        dim: int = 64,
        depth: int = 2,
        heads: int = 4,
        mlp: int = 128,
        pad_id: int = 0,
    ) -> None:
        super().__init__()
        shape = tuple(int(s) for s in in_shape)
        if len(shape) != 1 or shape[0] < 1:
            raise ValueError(f"in_shape must be [sequence length], got {list(in_shape)}")
        if num_classes < 2 or vocab_size < 2 or dim % heads:
            raise ValueError("need num_classes >= 2, vocab_size >= 2 and dim divisible by heads")
        self.in_shape = shape
        self.num_classes = int(num_classes)
        self.vocab_size = int(vocab_size)
        self.pad_id = int(pad_id)
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Embedding(shape[0] + 1, dim)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.encoder = _Encoder(dim, depth, heads, mlp)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n, length = ids.shape
        t = torch.cat([self.cls.expand(n, -1, -1), self.tokens(ids)], 1)
        t = t + self.positions.weight[: length + 1]
        # The class token is never padding, so no row of the attention is fully masked.
        pad = torch.cat([torch.zeros_like(ids[:, :1], dtype=torch.bool), ids == self.pad_id], 1)
        return self.head(self.encoder(t, pad)[:, 0])

    def example_inputs(self, batch: int = 2, seed: int = 0) -> tuple[torch.Tensor]:
        """Seeded token ids in [1, vocab_size) of this model's sequence length."""
        g = torch.Generator().manual_seed(seed)
        return (torch.randint(1, self.vocab_size, (batch, *self.in_shape), generator=g),)
