"""Magnitude pruning with retraining: Han, Pool, Tran & Dally, "Learning both Weights and
Connections for Efficient Neural Networks" (NIPS 2015), stage 1 of Deep Compression
(Han, Mao & Dally, ICLR 2016).

Pure maths (`magnitude_mask`, `threshold_mask`, `global_threshold`) is kept apart from model
plumbing (`prune_`, `masks_of`, `bake_`). A mask is a torch parametrization on the layer's
weight: the layer computes `where(mask, original, 0)` on every forward, so pruned weights are
exactly +0.0 through retraining, centroid fine-tuning and export, whatever the optimizer does
to the hidden original (momentum, weight decay). Masks only ever shrink: a weight pruned in one
round stays pruned in the next. While `shrink` retrains, `zeroed_training` skips that multiply:
the originals' pruned entries are held at +0.0 and their gradients zeroed as they accumulate,
the same values at a dense model's speed.

Layers (`weight_layers`) are (module, parameter) pairs, named as recipes and reports name them:

    Linear, Conv1d/2d/3d (grouped, depthwise)  `weight`           name: the module's, "fc1"
    ConvTranspose1d/2d/3d (kind "conv")        `weight`           "decoder.up1"
    LSTM/GRU/RNN, each layer and direction     `weight_ih_l0`..   "rnn.weight_ih_l0", ..._reverse
    LSTMCell/GRUCell/RNNCell                   `weight_ih`, `_hh` "cell.weight_ih", "cell.weight_hh"
    MultiheadAttention's packed q/k/v          `in_proj_weight`   "encoder.blocks.0.attn.in_proj"
    ... with kdim/vdim != embed_dim            `q_proj_weight`..  "...attn.q_proj", k_proj, v_proj
    MultiheadAttention's out_proj (a Linear)   `weight`           "...attn.out_proj"
    Embedding (only when asked: embeddings)    `weight`           "tokens"

Norms, biases and free Parameters (a class token, learned positions) stay dense. The
parametrization is on the parameter itself, so a module that reads it in its own forward
(MultiheadAttention reads `self.in_proj_weight`) computes with the masked value.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from compresskit.models.errors import InputError

# A ConvTranspose weight is (in, out / groups, k...): magnitude masks and k-means do not care
# which axis is which, and the archive stores any shape.
PRUNABLE = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)
NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)


@dataclass(frozen=True)
class Layer:
    """One weight tensor that pruning and sharing work on: parameter `param` of `module`.

    kind: "conv", "linear", "attention" (MultiheadAttention's projections, out_proj included),
    "recurrent" (an LSTM's, GRU's or RNN's matrices) or "embedding"; it picks default bits,
    gap widths and sparsities.
    """

    name: str
    module: str
    param: str
    kind: str

    @property
    def key(self) -> str:
        """The parameter's state_dict key ("fc1.weight", "attn.in_proj_weight")."""
        return f"{self.module}.{self.param}" if self.module else self.param


def layer_name(key: str) -> str:
    """The layer a parameter key belongs to: "fc1.weight" and "fc1.bias" -> "fc1",
    "attn.in_proj_weight" and "attn.in_proj_bias" -> "attn.in_proj"."""
    module, pname = _split(key)
    if pname in ("weight", "bias"):
        return module
    stem = pname.removesuffix("_weight").removesuffix("_bias")
    return f"{module}.{stem}" if module else stem


def _layers_of(name: str, module: nn.Module, parent: nn.Module | None, embeddings: bool):
    """The Layers module `name` holds (its children are visited on their own)."""

    def layer(param: str, kind: str) -> Layer:
        return Layer(layer_name(f"{name}.{param}" if name else param), name, param, kind)

    if isinstance(module, nn.MultiheadAttention):
        # One packed (3d, d) parameter, or three when key/value widths differ from embed_dim.
        params = (
            ("in_proj_weight",)
            if module._qkv_same_embed_dim
            else ("q_proj_weight", "k_proj_weight", "v_proj_weight")
        )
        return [layer(p, "attention") for p in params if getattr(module, p, None) is not None]
    if isinstance(module, PRUNABLE):
        if isinstance(module, nn.Linear):
            kind = "attention" if isinstance(parent, nn.MultiheadAttention) else "linear"
        else:
            kind = "conv"
        return [layer("weight", kind)]
    if isinstance(module, nn.RNNBase):
        # Each layer's and direction's input, hidden (and an LSTM's projection) matrix, gates
        # packed in rows: one Layer each, "rnn.weight_ih_l0". The module's forward re-reads
        # them when their tensors change, so a mask's or a codebook's value is what it uses.
        return [
            layer(p, "recurrent")
            for p in module._flat_weights_names
            if p.startswith("weight_") and getattr(module, p, None) is not None
        ]
    if isinstance(module, nn.RNNCellBase):  # LSTMCell, GRUCell, RNNCell: read in forward
        return [layer(p, "recurrent") for p in ("weight_ih", "weight_hh")]
    if embeddings and isinstance(module, nn.Embedding):
        return [layer("weight", "embedding")]
    return []


def _walk(model: nn.Module):
    """(name, module, parent) for every module, in model order."""
    parents = {}
    for name, module in model.named_modules():
        for child in module.children():
            parents.setdefault(id(child), module)
        yield name, module, parents.get(id(module))


def weight_layers(model: nn.Module, embeddings: bool = False) -> dict[str, Layer]:
    """The layers pruning and weight sharing apply to, by layer name, in model order.

    A weight tied to another parameter (`tied_weights`) is not one of them."""
    tied = tied_keys(model)
    return {
        layer.name: layer
        for name, module, parent in _walk(model)
        for layer in _layers_of(name, module, parent, embeddings)
        if layer.key not in tied
    }


def tied_weights(model: nn.Module) -> list[list[str]]:
    """Groups of state_dict keys that name one parameter (an output projection tied to the
    input embedding, `b.weight = a.weight`), in model order.

    Pruning and weight sharing leave these dense: each layer gets its own mask and codebook,
    so compressing them would untie them, and the shipped model would compute something the
    user's (still tied) model cannot load. A module used twice (`self.fc2 = self.fc1`) is one
    module with one key, not a tie."""
    keys: dict[int, list[str]] = {}
    for mname, module in model.named_modules():  # a module reachable twice is listed once
        for pname, p in module._parameters.items():
            if p is not None:
                keys.setdefault(id(p), []).append(f"{mname}.{pname}" if mname else pname)
    return [group for group in keys.values() if len(group) > 1]


def uncovered_weights(model: nn.Module, embeddings: bool = False) -> list[dict[str, Any]]:
    """Weight matrices (2 or more dimensions) that no layer of `weight_layers` holds and no
    tie explains, by module in model order: an LSTM's or GRU's gates, a ConvTranspose, a bare
    nn.Parameter, an embedding left out. The pipeline stores them dense, and the report names
    them, so a user whose model is mostly such layers sees why its ratio is small. Each row:
    module ("(model)" for the model's own parameters), its type, its weights, and the
    state_dict keys of those parameters."""
    covered = {layer.key for layer in weight_layers(model, embeddings).values()}
    covered |= tied_keys(model)
    out: dict[str, dict[str, Any]] = {}
    for mname, module in model.named_modules():
        for pname, p in module._parameters.items():
            key = f"{mname}.{pname}" if mname else pname
            if p is None or p.dim() < 2 or key in covered:
                continue
            entry = out.setdefault(
                mname,
                {
                    "module": mname or "(model)",
                    "type": type(module).__name__,
                    "weights": 0,
                    "parameters": [],
                },
            )
            entry["weights"] += p.numel()
            entry["parameters"].append(key)
    return list(out.values())


def foreign_weights(model: nn.Module, embeddings: bool = False) -> dict[str, str]:
    """Layers whose weight is not a plain parameter for compress to mask and share: {layer
    name: what computes it}. A parametrization of the user's own (torch's parametrize-based
    `weight_norm`, `spectral_norm`, `orthogonal`), stacked under a mask, would be folded into
    the baked weight and the checkpoint would no longer load into the user's class; the old
    hook-based `torch.nn.utils.weight_norm` recomputes `weight` from `weight_g` and `weight_v`
    before every forward, so a mask on it would be overwritten. compress's own
    parametrizations (a mask, shared weights) are not foreign."""
    out: dict[str, str] = {}
    for layer in weight_layers(model, embeddings).values():
        module = model.get_submodule(layer.module)
        if parametrize.is_parametrized(module, layer.param):
            theirs = [
                type(p).__name__
                for p in module.parametrizations[layer.param]
                if not getattr(p, "compress_own", False)
            ]
            if theirs:
                out[layer.name] = ", ".join(theirs)
        elif layer.param not in module._parameters:
            hooks = [type(h).__name__ for h in module._forward_pre_hooks.values()]
            out[layer.name] = next((h for h in hooks if h != "function"), "a computed weight")
    return out


def tied_keys(model: nn.Module) -> set[str]:
    """Every state_dict key of `tied_weights`' groups."""
    return {key for group in tied_weights(model) for key in group}


# --- pure maths -----------------------------------------------------------------------------


def magnitude_mask(w: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Keep the largest-|w| entries so that exactly round(sparsity * n) entries are pruned.

    Ties at the threshold are broken by position (the first tied entries go), so the count is
    exact: the mask a stable sort of |w| would give, found by selection (`kthvalue`, linear
    time) rather than a full sort, which on ResNet-18's 11M weights took 0.8 s a round.
    """
    n = w.numel()
    k = min(n, max(0, round(sparsity * n)))
    a = w.detach().abs().flatten()
    if not k:
        return torch.ones_like(a, dtype=torch.bool).view_as(w)
    t = torch.kthvalue(a, k).values
    below = a < t
    mask = ~below
    tied = torch.nonzero(a == t).flatten()  # in position order
    mask[tied[: k - int(below.sum())]] = False
    return mask.view_as(w)


def threshold_mask(w: torch.Tensor, threshold: float) -> torch.Tensor:
    """Keep entries with |w| > threshold (the paper's rule uses quality x std(w))."""
    return w.detach().abs() > threshold


def global_threshold(weights: list[torch.Tensor], sparsity: float) -> float:
    """The |w| below which `sparsity` of all the given weights fall (one threshold for all)."""
    flat = torch.cat([w.detach().abs().flatten() for w in weights])
    k = min(flat.numel(), max(0, round(sparsity * flat.numel())))
    return float(torch.kthvalue(flat, k).values) if k else -1.0


# --- the mask parametrization --------------------------------------------------------------


class Mask(nn.Module):
    """weight = where(mask, original, +0.0): pruned weights are exactly zero on every forward.

    Computed as original x mask + 0.0, the mask cached in the weight's dtype: for finite
    originals bit for bit the same tensor (x1.0 keeps a kept weight; a pruned one's product is
    +0.0 or -0.0, and -0.0 + 0.0 is +0.0 in IEEE arithmetic; a kept -0.0 becomes +0.0), at a
    third of the time, since torch.where over a bool mask is slow on CPU (2.36M weights,
    forward and backward: 7.7 ms against 2.5 ms; it made pruned ResNet-18 train 48% slower
    than dense, measured in the profile that found it). Pruned originals stay finite:
    `set_mask_` zeroes them and their gradient is the mask's zero (a run whose gradients are
    not finite is stopped as diverged). Cost: the cached mask, 4 bytes a weight until `bake_`.
    Inside `zeroed_training`, `passthrough` is set and the forward returns the original itself.
    """

    compress_own = True  # not a parametrization of the user's (`foreign_weights`)

    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mask", mask.to(torch.bool))
        self._cache: tuple | None = None  # (mask, its version counter, the mask as a weight)
        self.passthrough = False  # set only inside `zeroed_training`

    def _scale(self, like: torch.Tensor) -> torch.Tensor:
        """The mask in `like`'s dtype and device, rebuilt when the mask is replaced or changed
        in place (`set_mask_` tightens it with copy_, which bumps its version)."""
        m, c = self.mask, self._cache
        if (
            c is not None
            and c[0] is m
            and not m.is_inference()
            and c[1] == m._version
            and c[2].dtype == like.dtype
            and c[2].device == like.device
        ):
            return c[2]
        scale = m.to(dtype=like.dtype, device=like.device)
        # An inference tensor keeps no version counter, and one made under inference_mode
        # cannot be saved for a later backward: neither is cached.
        if not (m.is_inference() or torch.is_inference_mode_enabled()):
            self._cache = (m, m._version, scale)
        return scale

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.passthrough = False  # a copy is not in its original's `zeroed_training` block

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        if self.passthrough:  # the original's pruned entries are +0.0 (`zeroed_training`)
            return w
        return (w * self._scale(w)).add_(0.0)  # x1.0 or +-0.0, then -0.0 -> +0.0

    def mask_grad_(self, original: torch.Tensor) -> None:
        """Zero the accumulated gradient of `original` at the pruned positions (in place): the
        gradient the masked forward would have given it."""
        if original.grad is not None:
            original.grad.mul_(self._scale(original.grad))


# --- config and plumbing -------------------------------------------------------------------


@dataclass(frozen=True)
class PruneConfig:
    """How much to prune, and how.

    sparsity   target fraction of zeros: one number for every layer (or for all weights when
               scope="global"), or {layer name: fraction}; layers not named keep their weights.
    quality    instead of sparsity: threshold = quality x std(w) per layer (the paper's rule).
    rounds     prune -> retrain cycles; round r prunes to s x (1 - (1 - r/rounds)^3) of the
               target (Zhu & Gupta 2017), so early rounds remove the most and retraining adapts.
    include_bias / include_norm   also prune biases / normalisation weights (off, as the paper).
    embeddings   also prune nn.Embedding tables (off, as the paper, which has none).
    """

    sparsity: float | dict[str, float] | None = None
    quality: float | None = None
    scope: str = "layer"
    rounds: int = 3
    include_bias: bool = False
    include_norm: bool = False
    embeddings: bool = False

    def __post_init__(self) -> None:
        if (self.sparsity is None) == (self.quality is None):
            raise InputError("prune: give either sparsity or quality, not both or neither")
        values = self.sparsity.values() if isinstance(self.sparsity, dict) else [self.sparsity]
        for v in values:
            if v is not None and not (isinstance(v, int | float) and 0 <= v < 1):
                raise InputError(f"prune: sparsity {v!r} is impossible; give a fraction in [0, 1)")
        if self.quality is not None and not (self.quality > 0 and math.isfinite(self.quality)):
            raise InputError(f"prune: quality {self.quality!r} must be a positive number")
        if self.scope not in ("layer", "global"):
            raise InputError(f"prune: scope {self.scope!r} must be 'layer' or 'global'")
        if self.scope == "global" and not isinstance(self.sparsity, int | float):
            raise InputError("prune: scope 'global' needs one sparsity number")
        if not (isinstance(self.rounds, int) and self.rounds >= 1):
            raise InputError(f"prune: rounds {self.rounds!r} must be 1 or more")


def prunable(model: nn.Module, cfg: PruneConfig | None = None) -> dict[str, torch.Tensor]:
    """Parameters pruning may touch, by state_dict key ("fc1.weight", "attn.in_proj_weight"),
    in model order."""
    cfg = cfg or PruneConfig(sparsity=0.0)
    tied = tied_keys(model)
    out: dict[str, torch.Tensor] = {}
    for name, module, parent in _walk(model):
        pnames = [layer.param for layer in _layers_of(name, module, parent, cfg.embeddings)]
        if cfg.include_norm and isinstance(module, NORMS):
            pnames.append("weight")
        if cfg.include_bias and pnames:
            is_mha = isinstance(module, nn.MultiheadAttention)
            pnames.append("in_proj_bias" if is_mha else "bias")
        for pname in pnames:
            key = f"{name}.{pname}" if name else pname
            if getattr(module, pname, None) is not None and key not in tied:
                out[key] = _current(module, pname)
    return out


def _current(module: nn.Module, pname: str) -> torch.Tensor:
    return getattr(module, pname)  # the parametrized (masked) value when a mask is registered


def _split(full: str) -> tuple[str, str]:
    module, _, pname = full.rpartition(".")
    return module, pname


def masks_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """The masks registered on a model, by parameter name."""
    out = {}
    for name, module in model.named_modules():
        if parametrize.is_parametrized(module):
            for pname, plist in module.parametrizations.items():
                for p in plist:
                    if isinstance(p, Mask):
                        out[f"{name}.{pname}" if name else pname] = p.mask
    return out


def set_mask_(model: nn.Module, full: str, mask: torch.Tensor) -> None:
    """Register (or tighten) the mask on one parameter; the original's pruned entries are zeroed."""
    module_name, pname = _split(full)
    module = model.get_submodule(module_name)
    existing = masks_of(model).get(full)
    if existing is not None:
        existing.copy_(existing & mask)
        mask = existing
    else:
        parametrize.register_parametrization(module, pname, Mask(mask), unsafe=True)
    with torch.no_grad():
        original = module.parametrizations[pname].original
        original.masked_fill_(~mask, 0.0)


@contextlib.contextmanager
def zeroed_training(model: nn.Module) -> Iterator[None]:
    """Train a pruned model at a dense model's speed: inside, each mask hands the layer its
    original as it is, whose pruned entries `set_mask_` zeroed, and zeroes those entries'
    gradient as it accumulates (a post-accumulate-grad hook), instead of multiplying the
    weight by the mask on every forward and the gradient on every backward.

    The layer computes with the same values, and the kept weights get the same gradients, as
    under the masked forward, provided the pruned entries stay +0.0: an optimizer whose update
    of a zero weight with zero gradient and zero state is zero keeps them there (SGD with
    momentum and weight decay, Adam and AdamW, each with state created inside the block, as
    `trainer.fit` does). Momentum carried from before a mask tightened would move them, so
    the block is for a training loop that starts its optimizer inside it. On leaving, every
    pruned entry is checked (one pass) and a RuntimeError names a layer whose pruned weights
    moved. On ResNet-18 (70% pruned, batch 32, 2 cores) an epoch took 1.22x a dense one
    masked and 1.05x this way (benchmarks/retrain_overhead.py).

    Masks tightened inside the block (`set_mask_`) keep the rule, their originals zeroed and
    the hook reading the current mask, as long as the optimizer holds no state for the newly
    pruned entries. Left to the masked forward: a frozen original (nothing trains it), one
    original under two masks (a weight tied between layers), a mask stacked with another
    parametrization. A copy made inside the block (`copy.deepcopy`) is an ordinary masked
    model; an original replaced inside the block (`.to()` with torch's overwrite-on-conversion
    flag) lost its hook, and leaving says so."""
    candidates: dict[int, list] = {}
    for mname, module in model.named_modules():
        if not parametrize.is_parametrized(module):
            continue
        for pname, plist in module.parametrizations.items():
            if len(plist) != 1 or not isinstance(plist[0], Mask):
                continue  # stacked with another parametrization: left to its own forward
            original = plist.original
            if original.requires_grad:
                name = f"{mname}.{pname}" if mname else pname
                candidates.setdefault(id(original), []).append((name, plist, original))
    plugs = []
    finished = False
    try:
        for tied in candidates.values():
            if len(tied) > 1:
                continue  # one weight, several masks: each module's forward masks its own use
            name, plist, original = tied[0]
            mask = plist[0]
            with torch.no_grad():
                original.masked_fill_(~mask.mask, 0.0)  # +0.0, as the masked forward gives
            handle = original.register_post_accumulate_grad_hook(mask.mask_grad_)
            mask.passthrough = True
            plugs.append((name, plist, mask, original, handle))
        yield
        finished = True
    finally:
        moved = []
        for name, plist, mask, original, handle in plugs:
            handle.remove()
            mask.passthrough = False
            if plist.original is not original:
                moved.append(f"{name} (its parameter was replaced inside the block)")
                continue
            with torch.no_grad():
                if bool(original.masked_select(~mask.mask).ne(0).any()):
                    moved.append(name)
                    original.masked_fill_(~mask.mask, 0.0)
        if moved and finished:  # an exception on its way out is the one to report
            raise RuntimeError(
                f"prune.zeroed_training: pruned weights of {', '.join(moved)} left zero (an "
                "optimizer must keep a zero weight with zero gradient and state at zero)"
            )


def target_sparsities(
    model: nn.Module, cfg: PruneConfig, fraction: float = 1.0
) -> dict[str, float]:
    """Per-parameter sparsity for this round (`fraction` of the way to the target)."""
    params = prunable(model, cfg)
    if isinstance(cfg.sparsity, dict):
        layers = list(dict.fromkeys(layer_name(n) for n in params))
        unknown = sorted(set(cfg.sparsity) - set(params) - set(layers))
        if unknown:
            raise InputError(
                f"prune: no prunable layer named {', '.join(unknown)}; layers: {', '.join(layers)}"
            )
        out = {}
        for n in params:
            s = cfg.sparsity.get(n, cfg.sparsity.get(layer_name(n)))
            if s is not None:
                out[n] = s * fraction
        return out
    return {n: float(cfg.sparsity) * fraction for n in params}  # type: ignore[arg-type]


def prune_(
    model: nn.Module,
    cfg: PruneConfig,
    fraction: float = 1.0,
    stds: dict[str, float] | None = None,
) -> dict[str, float]:
    """Prune `model` in place to `fraction` of the configured target; returns kept fraction per
    parameter. Existing masks are kept (they only tighten).

    For the quality rule, `stds` holds each layer's std before any pruning (`weight_stds`), so
    later rounds do not measure a std shrunk by the zeros of earlier ones.
    """
    params = prunable(model, cfg)
    if not params:
        raise InputError(
            "prune: the model has no prunable layers (Linear, Conv or MultiheadAttention)"
        )
    if cfg.quality is not None:
        # The paper's rule, applied gradually: threshold = fraction x quality x std(w).
        stds = stds or weight_stds(model, cfg)
        masks = {n: threshold_mask(w, fraction * cfg.quality * stds[n]) for n, w in params.items()}
    elif cfg.scope == "global":
        t = global_threshold(list(params.values()), float(cfg.sparsity) * fraction)  # type: ignore[arg-type]
        masks = {n: threshold_mask(w, t) for n, w in params.items()}
    else:
        masks = {
            n: magnitude_mask(params[n], s)
            for n, s in target_sparsities(model, cfg, fraction).items()
        }
    emptied = [n for n, m in masks.items() if not bool(m.any())]
    if emptied:
        raise InputError(
            f"prune: this would remove every weight of {', '.join(emptied)}; "
            "lower its sparsity or quality"
        )
    for n, m in masks.items():
        set_mask_(model, n, m)
    return {n: float(m.float().mean()) for n, m in masks_of(model).items()}


def weight_stds(model: nn.Module, cfg: PruneConfig | None = None) -> dict[str, float]:
    """Std of each prunable parameter as it is now (call before the first round)."""
    return {n: float(w.detach().std()) for n, w in prunable(model, cfg).items()}


def schedule(rounds: int) -> list[float]:
    """Fraction of the target sparsity reached after each round (cubic, Zhu & Gupta 2017)."""
    return [1.0 - (1.0 - r / rounds) ** 3 for r in range(1, rounds + 1)]


def bake_(model: nn.Module) -> nn.Module:
    """Replace every parametrization by a plain parameter holding its current value (zeros and
    shared values included), for export and checkpoints.

    Not torch's `remove_parametrizations`: it deletes the property from the generated
    `Parametrized<Layer>` class, which a `copy.deepcopy` of the model shares, so baking a copy
    would break the original. Here only the instance is changed.
    """
    for module in model.modules():
        if parametrize.is_parametrized(module):
            values = {n: getattr(module, n).detach().clone() for n in module.parametrizations}
            module.__class__ = module.__class__.__bases__[0]  # the layer's own class
            del module._modules["parametrizations"]
            for name, value in values.items():
                module.register_parameter(name, nn.Parameter(value))
    return model


# --- sensitivity analysis ------------------------------------------------------------------


@dataclass
class Sensitivity:
    """Accuracy with each layer pruned alone (no retraining), and the proposed sparsities.
    `curves` hold the sparsities the bisection measured for each layer, sorted."""

    baseline: float
    curves: dict[str, dict[float, float]] = field(default_factory=dict)
    proposal: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline,
            "curves": {n: {str(s): a for s, a in c.items()} for n, c in self.curves.items()},
            "proposal": self.proposal,
        }


def sensitivity(
    model: nn.Module,
    evaluate: Callable[[nn.Module], float],
    budget: float,
    grid: tuple[float, ...] = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.97),
    progress: Callable[[int, int], None] | None = None,
) -> Sensitivity:
    """Prune each layer alone to sparsities of `grid`, measure accuracy with `evaluate` (use
    held-out training data, not the test set), and propose for each layer the largest sparsity
    whose accuracy drop stays within `budget` (a fraction, e.g. 0.02). `progress(done, total)`
    is called after each layer.

    Found by bisection over the grid: a layer loses accuracy as it loses weights, so at most
    ceil(log2(len(grid) + 1)) evaluations a layer find the edge (3 for the 7 default points;
    an EfficientNet-B0 has 82 layers of 0.3 s passes). The proposal is a measured point within
    the budget with a measured miss (or the grid's end) just above it: never more than the
    whole grid would propose, and maybe less where noise makes a curve pass again above a miss
    it met. Of 74 measured curves (ResNet-18, MobileNetV2) one did: 0.3 proposed where the
    grid gave 0.7.

    BatchNorm keeps the dense model's running statistics while a layer is cut. Re-estimating
    them before each evaluation (adaptive BatchNorm, as retraining runs end) judges each cut
    alone more kindly, and the cuts do not add up that way: on MobileNetV2 those proposals
    pruned further and lost 45.75 test points after full retraining, where these lost 0.5
    or none (ResNet-18: 73.0x at -0.50 points against 47.6x at +0.50; docs/benchmarks.md,
    "The sensitivity analysis"). Stale statistics also charge each cut for the shift it puts
    on the layers after it: a harsher verdict per layer, which leaves room for the cuts' sum."""
    points = sorted(set(grid))
    base = evaluate(model)
    result = Sensitivity(baseline=base)
    layers = prunable(model)
    for done, (name, w) in enumerate(layers.items(), 1):
        original = w.detach().clone()
        target = _raw(model, name)
        curve = {}
        lo, hi = -1, len(points)  # points[lo] within the budget (or none), points[hi] not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            s = points[mid]
            with torch.no_grad():
                target.copy_(torch.where(magnitude_mask(original, s), original, 0.0))
            curve[s] = evaluate(model)
            lo, hi = (mid, hi) if base - curve[s] <= budget else (lo, mid)
        with torch.no_grad():
            target.copy_(original)
        result.curves[name] = dict(sorted(curve.items()))
        result.proposal[name] = points[lo] if lo >= 0 else 0.0
        if progress is not None:
            progress(done, len(layers))
    return result


def _raw(model: nn.Module, full: str) -> torch.Tensor:
    module_name, pname = _split(full)
    module = model.get_submodule(module_name)
    if parametrize.is_parametrized(module, pname):
        return module.parametrizations[pname].original
    return getattr(module, pname)
