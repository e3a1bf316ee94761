"""Real architectures from Hugging Face `transformers`, wrapped to take one tensor and return logits.

Wraps (never vendors) `ResNetForImageClassification`, `MobileNetV2ForImageClassification`,
`EfficientNetForImageClassification`, `ViTForImageClassification` and
`BertForSequenceClassification`, each built from a config with fresh weights (nothing is
downloaded). transformers defines them in plain PyTorch, so every stage of `compress` sees
ordinary `nn.Conv2d`/`nn.Linear` layers. Name them by import path, like any model of your own:

    pip install -e ".[zoo]"
    compress train --model compresskit.models.hf:resnet18 --data npz:cifar.npz --out resnet18.pt
    compress train --model compresskit.models.hf:bert --model-kwargs '{"vocab_size": 1000}' --data tokens

Every factory takes `in_shape` and `num_classes` (filled in from the data) and size kwargs, so
tests build tiny instances. The returned module's forward takes the tensor the data gives --
float32 images (N, C, H, W), or int64 token ids (N, L) for `bert` -- and returns the logits
tensor, not transformers' output object. transformers is imported when a factory is called,
so `import compresskit.models.hf` (and reading a factory's `input_kind`) works without it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from compresskit.models.base import ZooModel, check_shape, image_shape
from compresskit.models.errors import InputError

# The fix every "transformers is missing" error names: the extra that pins a tested range.
INSTALL = 'pip install -e ".[zoo]"'
# Attention as plain matmul + softmax, not transformers' default fused SDPA: with SDPA, a BERT
# row that is all padding came out of the ONNX file 12% of the logit scale away from PyTorch
# (torch 2.13, transformers 5.23); eager attention matches to ~1e-6 on every row.
ATTENTION = "eager"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise InputError(
            f"compresskit.models.hf needs Hugging Face transformers, which is not installed; {INSTALL}"
        ) from None
    return transformers


def _reads(kind: str) -> Callable:
    """Mark a factory with the input it reads, which `models.zoo.input_kind` looks up (the
    factory is not called, so no model is built to find out)."""

    def deco(fn: Callable) -> Callable:
        fn.input_kind = kind  # type: ignore[attr-defined]
        return fn

    return deco


class ImageClassifier(ZooModel):
    """A transformers image classifier behind `forward(images) -> logits`."""

    input_kind = "image"

    def __init__(self, net: nn.Module, in_shape: Sequence[int], num_classes: int) -> None:
        super().__init__(in_shape, num_classes)
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(pixel_values=x, return_dict=True).logits


class TokenClassifier(nn.Module):
    """A transformers sequence classifier behind `forward(token_ids) -> logits`.

    The attention mask is derived inside (`ids != pad_token_id`), so the model has one input,
    which is what the data, the pipeline and the ONNX file all carry."""

    input_kind = "tokens"

    def __init__(
        self, net: nn.Module, in_shape: Sequence[int], num_classes: int, vocab_size: int
    ) -> None:
        super().__init__()
        self.net = net
        self.in_shape = tuple(int(s) for s in in_shape)
        self.num_classes = int(num_classes)
        self.vocab_size = int(vocab_size)
        self.pad_token_id = int(net.config.pad_token_id)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = (ids != self.pad_token_id).long()
        return self.net(input_ids=ids, attention_mask=mask, return_dict=True).logits

    def example_inputs(self, batch: int = 2, seed: int = 0) -> tuple[torch.Tensor]:
        """Seeded token ids in [1, vocab_size) of this model's sequence length."""
        g = torch.Generator().manual_seed(seed)
        return (torch.randint(1, self.vocab_size, (batch, *self.in_shape), generator=g),)


def _for_scratch_training(net: nn.Module) -> nn.Module:
    """torchvision's initialisation and PyTorch's BatchNorm momentum, for training from scratch.

    transformers initialises these models for loading pretrained weights over them: EfficientNet
    draws BatchNorm scales from N(0, 0.02), so a fresh B0's activations shrink ~50x per layer
    (its logits start near 1e-32 and nothing trains). Both models also carry TensorFlow's
    decay (0.99, 0.997) as PyTorch momentum, which weighs the newest batch 99%: evaluation would
    use the last training batch's statistics alone.
    """
    for m in net.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
            m.momentum = 0.1
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.01)
            nn.init.zeros_(m.bias)
    return net


def _image(in_shape: Sequence[int], num_classes: int) -> tuple[int, int, int]:
    # the zoo's own checks and messages
    return image_shape(check_shape(in_shape, num_classes), "this Hugging Face model")


@_reads("image")
def resnet18(
    in_shape: Sequence[int] = (3, 32, 32),
    num_classes: int = 10,
    hidden_sizes: Sequence[int] = (64, 128, 256, 512),
    depths: Sequence[int] = (2, 2, 2, 2),
    embedding_size: int = 64,
) -> ImageClassifier:
    """ResNet-18 (He et al. 2016): basic blocks, 2-2-2-2, 64..512 channels; 11.2M parameters at
    10 classes. The 7x7 stride-2 stem and max-pool are ImageNet's, as in torchvision's."""
    return _resnet(in_shape, num_classes, hidden_sizes, depths, embedding_size, "basic")


@_reads("image")
def resnet50(
    in_shape: Sequence[int] = (3, 32, 32),
    num_classes: int = 10,
    hidden_sizes: Sequence[int] = (256, 512, 1024, 2048),
    depths: Sequence[int] = (3, 4, 6, 3),
    embedding_size: int = 64,
) -> ImageClassifier:
    """ResNet-50 (He et al. 2016): bottleneck blocks, 3-4-6-3, 256..2048 output channels;
    23.5M parameters at 10 classes. resnet18's builder fixes basic blocks, so a user with
    a ResNet-50 had to write this wrapper."""
    return _resnet(in_shape, num_classes, hidden_sizes, depths, embedding_size, "bottleneck")


def _resnet(in_shape, num_classes, hidden_sizes, depths, embedding_size, blocks: str):
    t = _transformers()
    c, _, _ = _image(in_shape, num_classes)
    config = t.ResNetConfig(
        num_channels=c,
        embedding_size=embedding_size,
        hidden_sizes=list(hidden_sizes),
        depths=list(depths),
        layer_type=blocks,
        num_labels=num_classes,
    )
    return ImageClassifier(t.ResNetForImageClassification(config), in_shape, num_classes)


@_reads("image")
def mobilenet_v2(
    in_shape: Sequence[int] = (3, 32, 32),
    num_classes: int = 10,
    depth_multiplier: float = 1.0,
    min_depth: int = 8,
    finegrained_output: bool = True,
) -> ImageClassifier:
    """MobileNetV2 (Sandler et al. 2018): inverted residuals, depthwise convolutions, ReLU6;
    2.2M parameters at 10 classes. Below depth_multiplier 1 the last convolution keeps 1280
    channels, as in the paper, unless finegrained_output is false."""
    t = _transformers()
    c, h, _ = _image(in_shape, num_classes)
    config = t.MobileNetV2Config(
        num_channels=c,
        image_size=h,
        depth_multiplier=depth_multiplier,
        min_depth=min_depth,
        finegrained_output=finegrained_output,
        num_labels=num_classes,
        # transformers' default pads like TensorFlow ("same", asymmetric), computed from the
        # input size in every forward; False pads inside the convolutions, as torchvision's
        # MobileNetV2 does: no separate Pad nodes in the ONNX graph. Pretrained TF weights
        # would want True; these models start from scratch.
        tf_padding=False,
    )
    net = _for_scratch_training(t.MobileNetV2ForImageClassification(config))
    return ImageClassifier(net, in_shape, num_classes)


@_reads("image")
def efficientnet_b0(
    in_shape: Sequence[int] = (3, 32, 32),
    num_classes: int = 10,
    width_coefficient: float = 1.0,
    depth_coefficient: float = 1.0,
) -> ImageClassifier:
    """EfficientNet-B0 (Tan & Le 2019): MBConv blocks with squeeze-excite, SiLU; 4.0M parameters
    at 10 classes. Smaller coefficients give tiny instances."""
    t = _transformers()
    from transformers.models.efficientnet import modeling_efficientnet as hf_effnet

    c, h, _ = _image(in_shape, num_classes)
    config = t.EfficientNetConfig(
        num_channels=c,
        image_size=h,
        num_labels=num_classes,
        width_coefficient=width_coefficient,
        depth_coefficient=depth_coefficient,
        dropout_rate=0.2,  # B0's; the config's default 0.5 is B7's
    )
    # The head's width must be the top convolution's, round_filters(1280) at this width; the
    # config's default (2560) is B7's and a B0 built with it fails in its first forward.
    config.hidden_dim = hf_effnet.round_filters(config, 1280)
    net = _for_scratch_training(t.EfficientNetForImageClassification(config))
    return ImageClassifier(net, in_shape, num_classes)


@_reads("image")
def vit_tiny(
    in_shape: Sequence[int] = (3, 32, 32),
    num_classes: int = 10,
    patch_size: int = 4,
    hidden_size: int = 192,
    num_layers: int = 12,
    num_heads: int = 3,
    mlp_size: int = 768,
) -> ImageClassifier:
    """ViT-Tiny (Dosovitskiy et al. 2021; DeiT-Ti's sizes): 4x4 patches of a 32x32 image, 12
    layers of width 192, 3 heads; 5.4M parameters at 10 classes."""
    t = _transformers()
    c, h, w = _image(in_shape, num_classes)
    if h != w or h % patch_size:
        raise ValueError(f"ViT needs a square image of whole {patch_size}x{patch_size} patches")
    config = t.ViTConfig(
        num_channels=c,
        image_size=h,
        patch_size=patch_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=mlp_size,
        num_labels=num_classes,
        attn_implementation=ATTENTION,
    )
    net = t.ViTForImageClassification(config)
    return ImageClassifier(net, in_shape, num_classes)


@_reads("tokens")
def bert(
    in_shape: Sequence[int] = (32,),
    num_classes: int = 2,
    vocab_size: int = 30522,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 512,
    max_positions: int = 512,
    pad_token_id: int = 0,
) -> TokenClassifier:
    """BERT (Devlin et al. 2019) for sequence classification on int64 token ids; the defaults are
    BERT-Tiny's (2 layers, width 128, 2 heads, BERT's 30,522-token vocabulary): 4.4M parameters.
    Id `pad_token_id` is padding, masked out of attention inside the model."""
    t = _transformers()
    shape = tuple(int(s) for s in in_shape)
    if len(shape) != 1 or not 1 <= shape[0] <= max_positions:
        raise ValueError(
            f"in_shape must be [sequence length] of 1..{max_positions}, got {list(in_shape)} "
            "(max_positions sets the longest)"
        )
    if num_classes < 2:
        raise ValueError(f"num_classes must be at least 2, got {num_classes}")
    config = t.BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_positions,
        pad_token_id=pad_token_id,
        num_labels=num_classes,
        attn_implementation=ATTENTION,
    )
    net = t.BertForSequenceClassification(config)
    return TokenClassifier(net, shape, num_classes, vocab_size)


# BERT-Tiny's sizes are `bert`'s defaults: the name says what it builds.
bert_tiny = bert
