"""Soft weight-sharing: a Gaussian-mixture prior learned with the weights, then snapped to its
component means (Ullrich, Meeds & Welling, "Soft Weight-Sharing for Neural Network
Compression", ICLR 2017), as an alternative to stage 2 of Deep Compression (k-means, then
centroid fine-tuning).

Per layer, the kept (unpruned) weights w get the prior

    p(w) = pi_0 N(w | 0, s_0^2) + (1 - pi_0) sum_j softmax(a)_j N(w | mu_j, s^2),  j = 1..K

with K = 2^bits - 1 learned means mu_j (initialised at the k-means centroids), learned mixing
logits a, a component pinned at zero with a fixed share pi_0 (`zero_mixing`), and fixed widths:
s = `width` and s_0 = `zero_width`, as fractions of the layer's kept-weight standard deviation.
Retraining minimises

    loss(batch) + strength * sum_layers -log p(w) / N            (N = training samples)

so `strength` = 1 is the Bayesian posterior's weighting (the paper's tau, which it tunes). The
mixture pulls weights together around few means and the zero component pulls small weights to
zero; unused components lose their share. Then each weight is snapped to its most responsible
component: the zero component prunes it (+0.0, masked), any other replaces it by that mean, and
the used means become the layer's codebook (at most 2^bits values with the zero). The result is
an ordinary `kmeans.SharedWeights` layer, so centroid fine-tuning, the archive and the export
work unchanged.

Where this departs from the paper, and why: the paper trains one mixture of 17 components for
the whole network from a dense model, with Gamma hyperpriors on the precisions and separate
learning rates per parameter group. Here it runs after magnitude pruning (the prune stage has
already removed most weights) with a mixture per layer (our archive has a codebook per layer)
and fixed widths: with learned widths the zero component widened until it took 99.7% of fc1's
kept weights on LeNet-300-100 (accuracy 33%); fixed widths do the hyperprior's job in one knob.
Measured on MNIST LeNet-300-100 (3 seeds, after the default pruning, the defaults below;
`benchmarks/deep_compression.py`, docs/benchmarks.md): 63.1x at -0.70 points against k-means'
42.8x at -0.50, and 62.5x at -0.47 with `train.distill = 0.7`. The mixture keeps 3-7 of its 31
means per layer, so a centroid index costs ~1.5 bits after Huffman instead of ~4.4.
Known limit: `zero_mixing` is the zero component's share against all others together, so a
layer with 255 components (8-bit convs) gives the zero 64x a single mean's share: on LeNet-5
that pruned conv2 from 15% to 0.9% kept and lost 3.25 points (0.02 gave 55.8x at -0.75).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from compresskit.compressor import kmeans
from compresskit.compressor.prune import masks_of
from compresskit.models.errors import InputError, StageError

# --- pure maths -----------------------------------------------------------------------------

LOG_2PI = math.log(2 * math.pi)


def log_joint(
    w: torch.Tensor, means: torch.Tensor, log_vars: torch.Tensor, log_mixing: torch.Tensor
) -> torch.Tensor:
    """log(pi_j N(w_i | mu_j, var_j)) for every weight i (rows) and component j (columns)."""
    w = w.reshape(-1, 1)
    return log_mixing - 0.5 * (LOG_2PI + log_vars + (w - means) ** 2 / log_vars.exp())


def neg_log_prior(
    w: torch.Tensor, means: torch.Tensor, log_vars: torch.Tensor, log_mixing: torch.Tensor
) -> torch.Tensor:
    """-sum_i log sum_j pi_j N(w_i | mu_j, var_j): the mixture prior's negative log density,
    with its gradients (to w, the means, the log variances and the log mixing proportions)
    computed in the same pass; `log_joint` and autograd give the same figures (tested)."""
    return _NegLogPrior.apply(w.reshape(-1), means, log_vars, log_mixing)


PRIOR_CHUNK = 8192  # weights per block: a block's 8192 x K responsibilities stay in cache


class _NegLogPrior(torch.autograd.Function):
    """The prior in blocks of weights, never holding the n x K responsibilities at once.

    Autograd of `log_joint` keeps several n x K tensors for the backward pass: a layer of 235k
    kept weights under 255 components (an 8-bit setting) is 60M entries each, ~2-3 s a step
    on 2 cores, minutes an epoch. Here log(pi_j N(w_i | mu_j, var_j)) is the product of the
    basis [1, w_i, w_i^2] with three coefficients per component (one small matrix product per
    block), and what the backward pass needs is summed as the block goes: per weight
    sum_j r_ij (w_i - mu_j) / var_j, per component sum_i r_ij [1, w_i, w_i^2] (in float64: the
    backward pass takes differences of those sums). Measured on that layer side by side
    (2-core EPYC, `benchmarks/softshare_prior.py`): 3.6 s -> 0.37 s a step; 31 components
    156 -> 50 ms. First-order only: nothing here trains through the prior's gradient."""

    @staticmethod
    def forward(ctx, w, means, log_vars, log_mixing):
        # The expanded form cancels large terms: never in bfloat16 under an autocast region.
        with torch.autocast(w.device.type, enabled=False):
            return _NegLogPrior._forward(ctx, w, means, log_vars, log_mixing)

    @staticmethod
    def _forward(ctx, w, means, log_vars, log_mixing):
        dtype = w.dtype
        ctx.dtypes = [t.dtype for t in (means, log_vars, log_mixing)]
        means, log_vars, log_mixing = (t.detach().to(dtype) for t in (means, log_vars, log_mixing))
        inv = torch.exp(-log_vars)
        coef = torch.stack(
            [
                log_mixing - 0.5 * (LOG_2PI + log_vars) - 0.5 * means**2 * inv,
                means * inv,
                -0.5 * inv,
            ]
        )  # (3, K): log(pi_j N(w | mu_j, var_j)) = [1, w, w^2] @ coef
        per_weight = torch.stack([inv, means * inv], 1)  # (K, 2)
        w = w.detach()
        grad_w = torch.empty_like(w) if ctx.needs_input_grad[0] else None
        # sum_i r_ij [1, w_i, w_i^2]
        sums = torch.zeros(3, len(means), dtype=torch.float64, device=w.device)
        total = torch.zeros((), dtype=torch.float64, device=w.device)
        for start in range(0, w.numel(), PRIOR_CHUNK):
            part = w[start : start + PRIOR_CHUNK]
            basis = torch.stack([torch.ones_like(part), part, part * part], 1)  # (c, 3)
            a = basis @ coef
            top = a.amax(1, keepdim=True)
            a.sub_(top).exp_()
            z = a.sum(1, keepdim=True)
            total -= (top + z.log()).sum(dtype=torch.float64)
            a.div_(z)  # responsibilities r_ij
            if grad_w is not None:
                t = a @ per_weight
                grad_w[start : start + PRIOR_CHUNK] = part * t[:, 0] - t[:, 1]
            sums += (basis.T @ a).double()
        ctx.save_for_backward(
            grad_w if grad_w is not None else torch.empty(0), sums, means.double(), inv.double()
        )
        ctx.has_w = grad_w is not None
        return total.to(dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        grad_w, (r, rw, rw2), means, inv = ctx.saved_tensors
        # dL/da_ij = -r_ij, with a_ij = log pi_j - (log 2 pi + log var_j + (w_i - mu_j)^2/var_j)/2
        sq = rw2 - 2 * means * rw + means**2 * r  # sum_i r_ij (w_i - mu_j)^2
        grads = (-(rw - means * r) * inv, 0.5 * (r - sq * inv), -r)
        rest = [(g.double() * x).to(d) for x, d in zip(grads, ctx.dtypes, strict=True)]
        return g * grad_w if ctx.has_w else None, *rest


def responsibilities(
    w: torch.Tensor, means: torch.Tensor, log_vars: torch.Tensor, log_mixing: torch.Tensor
) -> torch.Tensor:
    """Posterior probability of each component for each weight (rows sum to 1)."""
    return torch.softmax(log_joint(w, means, log_vars, log_mixing), dim=1)


def snap(
    w: torch.Tensor, means: torch.Tensor, log_vars: torch.Tensor, log_mixing: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each weight to its most responsible component; component 0 must be the zero one.

    Returns (codebook, index, keep): the used non-zero means sorted ascending (float32), each
    weight's index into them (0 where not kept) and whether it is kept (not snapped to zero).
    Ties go to the lower component, so the snapping is deterministic.
    """
    component = log_joint(w, means, log_vars, log_mixing).argmax(dim=1)
    keep = component > 0
    used = torch.unique(component[keep])  # sorted ascending component numbers
    values = means.detach()[used].to(torch.float32)
    order = torch.argsort(values, stable=True)
    codebook = values[order]
    # component number -> position of its mean in the sorted codebook
    rank = torch.zeros(len(means), dtype=torch.int64)
    rank[used[order]] = torch.arange(len(used))
    index = torch.where(keep, rank[component], torch.zeros_like(component))
    return codebook, index.reshape(w.shape), keep.reshape(w.shape)


# --- the stage ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SoftShareConfig:
    """Bits per layer as `kmeans.QuantizeConfig` (at most 2^bits - 1 non-zero means); the
    prior: `strength` (tau), `width` and `zero_width` (component standard deviations as
    fractions of the layer's kept-weight standard deviation), `zero_mixing` (pi_0, the zero
    component's fixed share); `epochs` and `lr` of the retraining under the prior."""

    conv_bits: int = 8
    fc_bits: int = 5
    bits: dict[str, int] = field(default_factory=dict)
    strength: float = 1.0
    width: float = 0.1
    zero_width: float = 0.4
    zero_mixing: float = 0.2
    epochs: int = 6
    lr: float = 1e-3
    seed: int = 0
    embeddings: bool = False

    def __post_init__(self) -> None:
        kmeans.QuantizeConfig(self.conv_bits, self.fc_bits, dict(self.bits))  # checks the bits
        for name in ("strength", "width", "zero_width"):
            if not getattr(self, name) > 0:
                raise InputError(f"quantize: prior {name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.zero_mixing < 1:
            raise InputError(f"quantize: zero_mixing must lie in (0, 1), got {self.zero_mixing}")

    def bits_for(self, layer) -> int:
        return kmeans.QuantizeConfig(self.conv_bits, self.fc_bits, dict(self.bits)).bits_for(layer)


class Mixture(nn.Module):
    """One layer's prior: learned means and mixing logits, fixed widths, a pinned zero."""

    def __init__(self, w: np.ndarray, k: int, cfg: SoftShareConfig) -> None:
        super().__init__()
        centroids, _ = kmeans.kmeans_1d(w, k, seed=cfg.seed)
        sd = float(w.std()) if w.size > 1 else float(abs(w).max(initial=1.0))
        sd = sd if sd > 0 else 1.0
        self.means = nn.Parameter(torch.tensor(centroids, dtype=torch.float32))
        self.logits = nn.Parameter(torch.zeros(len(centroids)))
        self.register_buffer("zero", torch.zeros(1))
        self.register_buffer(
            "log_vars",
            torch.tensor(
                [2 * math.log(cfg.zero_width * sd)]
                + [2 * math.log(cfg.width * sd)] * len(centroids)
            ),
        )
        self.log_zero = math.log(cfg.zero_mixing)
        self.log_rest = math.log1p(-cfg.zero_mixing)

    def parameters_of_prior(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(means, log variances, log mixing), component 0 the zero one."""
        log_mixing = torch.cat(
            [torch.tensor([self.log_zero]), torch.log_softmax(self.logits, 0) + self.log_rest]
        )
        return torch.cat([self.zero, self.means]), self.log_vars, log_mixing


def _kept(model: nn.Module, layer) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's current weight (differentiable) and its pruning mask (all True if none)."""
    module = model.get_submodule(layer.module)
    w = getattr(module, layer.param)
    mask = masks_of(model).get(layer.key)
    return w, (mask if mask is not None else torch.ones_like(w, dtype=torch.bool))


def _key(layer_name: str) -> str:
    return layer_name.replace(".", "/")


def soft_share_(
    model: nn.Module,
    cfg: SoftShareConfig,
    retrain: Callable[[nn.Module, int, float, Callable], None],
    base_loss: Callable,
    samples: int,
) -> dict[str, dict[str, Any]]:
    """Retrain `model` under the mixture prior, then snap every layer to a SharedWeights
    parametrization (in place). `retrain(model, epochs, lr, loss_fn)` trains with a loss
    `(model, x, y) -> (loss, logits)`; the prior is added to `base_loss`, scaled by
    strength / samples. Returns per layer: weights kept before and after, means used."""
    found = kmeans.layers(model, cfg.embeddings)
    unknown = sorted(set(cfg.bits) - set(found))
    if unknown:
        raise InputError(
            f"quantize: no layer named {', '.join(unknown)}; layers: {', '.join(found)}"
        )
    priors = nn.ModuleDict()  # keyed by layer name ("." is not allowed in a module name)
    for name, layer in found.items():
        w, mask = _kept(model, layer)
        kept = w.detach()[mask].numpy()
        if kept.size:
            priors[_key(name)] = Mixture(kept, 2 ** cfg.bits_for(layer) - 1, cfg)
    tracked = {name: layer for name, layer in found.items() if _key(name) in priors}
    # The masks hold still while the prior trains: find the kept positions once, not per step.
    kept_at = {
        name: _kept(model, layer)[1].flatten().nonzero().flatten()
        for name, layer in tracked.items()
    }
    # Registered for the retraining only, so that the optimizer the retraining builds over
    # model.parameters() trains them too. They hang off a weight layer, not the model: a child
    # of an nn.Sequential would become one of its steps.
    host = model.get_submodule(next(iter(tracked.values())).module) if tracked else nn.Module()
    host.add_module("_soft_priors", priors)
    scale = cfg.strength / max(samples, 1)

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor):
        loss, logits = base_loss(m, x, y)
        for name, layer in tracked.items():
            w = getattr(m.get_submodule(layer.module), layer.param).flatten()
            prior = priors[_key(name)].parameters_of_prior()
            loss = loss + scale * neg_log_prior(w.index_select(0, kept_at[name]), *prior)
        return loss, logits

    try:
        if cfg.epochs:
            try:
                retrain(model, cfg.epochs, cfg.lr, loss_fn)
            except StageError as e:
                if "diverged" not in str(e):
                    raise
                # the prior's terms, not only the learning rate, take a loss to inf or NaN: a
                # zero_width of 1e-30 did at the first step, and the message said "lower the
                # learning rate"
                raise StageError(
                    f"soft weight-sharing: {e}; or the prior is degenerate: raise "
                    "quantize.zero_width / prior_width, or lower prior_strength"
                ) from None
    finally:
        del host._soft_priors
    record = {}
    for name, layer in found.items():
        module = model.get_submodule(layer.module)
        with torch.no_grad():
            w, mask = _kept(model, layer)
            w = w.detach().clone()
            if name in tracked:
                prior = priors[_key(name)].parameters_of_prior()
                codebook, index_kept, keep = snap(w[mask], *prior)
            else:  # nothing kept: an empty codebook
                codebook = torch.zeros(0)
                index_kept, keep = (
                    torch.zeros(0, dtype=torch.int64),
                    torch.zeros(0, dtype=torch.bool),
                )
            new_mask = mask.clone()
            new_mask[mask] = keep
            index = torch.zeros(w.shape, dtype=torch.int64)
            index[mask] = index_kept
        kmeans.install_(module, layer.param, kmeans.SharedWeights(codebook, index, new_mask))
        record[name] = {
            "kept_before": int(mask.sum()),
            "kept_after": int(new_mask.sum()),
            "means_used": len(codebook),
            "bits": cfg.bits_for(layer),
        }
    return record


__all__ = [
    "Mixture",
    "SoftShareConfig",
    "log_joint",
    "neg_log_prior",
    "responsibilities",
    "snap",
    "soft_share_",
]
