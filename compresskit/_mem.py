"""Memory: give freed heap memory back to the operating system between long steps (glibc
only), and size evaluation batches to the model's activations (`eval_batch`).

glibc gives threads malloc arenas of their own, and what training (torch's intra-op threads)
and ONNX Runtime free in an arena stays with that process. ViT-tiny's shrink (5.4M parameters,
2 cores) grew stage by stage to a 3.17 GB peak RSS. With `malloc_trim` every second it peaked
at 1.70 GB, and with MALLOC_ARENA_MAX=1 at 1.76 GB, in the same time. `trim()` is called where
a stage or a training epoch ends: a few milliseconds, nothing on other C libraries."""

from __future__ import annotations

import ctypes
import sys
import weakref
from functools import lru_cache
from typing import Any

import torch
from torch import nn


@lru_cache(maxsize=1)
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # musl and others: no libc.so.6 or no malloc_trim
        return None


def trim() -> bool:
    """Return free heap pages to the OS (glibc `malloc_trim(0)`); True when memory came back."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False


# Activations one evaluation batch may hold. ViT-tiny on 2,000 3x32x32 images (2 cores): a
# fixed batch of 1,024 peaked 610 MiB over its start and took 19.3 s; a batch of 64, 102 MiB
# and 12.9 s. Past a few dozen samples a bigger batch buys nothing on a CPU, and it costs
# memory in proportion (benchmarks/real_models.py measures the peak).
EVAL_BUDGET = 32 << 20
EVAL_MAX_BATCH = 1024
_eval_batches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tensor_bytes(value: Any, n: int) -> int:
    """Bytes of the tensors in `value` that carry the batch (first dimension `n`)."""
    if isinstance(value, torch.Tensor):
        batched = value.dim() > 0 and value.shape[0] == n
        return value.numel() * value.element_size() if batched else 0
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(v, n) for v in value)
    if isinstance(value, dict):
        return sum(_tensor_bytes(v, n) for v in value.values())
    return 0


@torch.no_grad()
def eval_batch(model: nn.Module, x: torch.Tensor, budget: int = EVAL_BUDGET) -> int:
    """The evaluation batch for `model` on samples like `x`: as many samples as fit in
    `budget` bytes of activations, 1 to EVAL_MAX_BATCH (1 for no samples). A probe forward on two samples
    measures the largest input plus output of any one module per sample (the tensors that
    carry the batch: a weight a parametrization computes is none); a layer's input and output
    are what is live at once in an inference pass (twice that for headroom: a residual keeps
    one more). What a module computes inside its forward is not seen: an attention
    module's L x L scores per head, which on long sequences can outweigh its input and output.
    Cached per model, sample shape and the model's parameter and module counts (a model
    thinned in place by the channels stage is measured again)."""
    if len(x) == 0:
        return 1
    key = (
        tuple(x.shape[1:]),
        x.dtype,
        budget,
        sum(p.numel() for p in model.parameters()),
        sum(1 for _ in model.modules()),
    )
    cached = _eval_batches.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    largest = [0]
    probe = x[:2]
    n = len(probe)

    def hook(_module, inputs, output) -> None:
        largest[0] = max(largest[0], _tensor_bytes(inputs, n) + _tensor_bytes(output, n))

    # Not the parametrizations (pruning masks, shared weights): their input and output are a
    # weight, not activations. Counted, ResNet-18's 512x512x3x3 mask sized batches of one
    # sample, and its evaluations took 5 s instead of 0.2 s.
    handles = [
        m.register_forward_hook(hook)
        for name, m in model.named_modules()
        if "parametrizations" not in name.split(".")
    ]
    was_training = model.training
    model.eval()
    try:
        model(probe)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    per_sample = max(2 * largest[0] // max(n, 1), 1)
    batch = max(1, min(EVAL_MAX_BATCH, budget // per_sample))
    _eval_batches[model] = (key, batch)
    return batch


def peak_rss() -> int | None:
    """This process's peak resident memory so far, in bytes (None where the OS does not say):
    a shrink's own peak when run from the command line; in a notebook, the session's."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS says bytes, Linux KiB
