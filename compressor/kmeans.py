"""Trained quantization by weight sharing: stage 2 of Deep Compression (Han, Mao & Dally,
ICLR 2016, section 3).

Per layer, scikit-learn's `KMeans` clusters the non-zero weights with the paper's *linear*
initialisation (centroids evenly spaced between min and max, `n_init=1`; KMeans' own default,
k-means++, loses the rare large weights that matter most). A pruned layer gets 2^bits - 1
centroids, so with its zeros it holds at most 2^bits distinct values; a dense layer gets 2^bits.

`SharedWeights` is a parametrization that computes the layer's weight as
`where(mask, codebook[index], +0.0)`. Its backward gives each centroid the sum of its members'
gradients, which is exactly the paper's centroid update; the assignment and the zeros stay
fixed. With `mode="weights"`, the float weights train instead, and every forward snaps them to
their nearest centroid (straight-through), so sharing is held throughout.

Cost: the kept positions and their indices are found once, not on every step; a forward
scatters codebook[index] of the kept weights into zeros, so forward and backward touch only the
kept weights, in native ops. Against `where(mask, codebook[index], 0)` (a gather over every
weight, then autograd's accumulating index_put backward) this cut forward + backward on a
2.4M-weight, 85%-pruned 8-bit layer from ~70 ms to ~12 ms (1 thread). With autograd off
(evaluation) the weight is computed once and reused until the codebook, index or mask change.

Layers are those of `compressor.prune.weight_layers`: Linear, Conv, MultiheadAttention's
projections and, when asked (`embeddings`), Embedding tables.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parametrize

from compresskit.compressor.prune import Layer, layer_name, masks_of, weight_layers
from compresskit.models.errors import InputError

# --- pure maths -----------------------------------------------------------------------------

SMALL_KMEANS = 1 << 16  # weights below which one thread clusters faster than several


def linear_init(w: np.ndarray, k: int) -> np.ndarray:
    """k centroids evenly spaced between min(w) and max(w) (the paper's best initialisation)."""
    return np.linspace(float(w.min()), float(w.max()), k, dtype=np.float64)


def kmeans_1d(
    w: np.ndarray, k: int, seed: int = 0, max_iter: int = 300, tol: float = 1e-4
) -> tuple[np.ndarray, np.ndarray]:
    """Cluster 1-D values into at most k centroids, linear init; returns (centroids, labels).

    Centroids come back sorted ascending, labels index into them. Fewer distinct values than
    k gives one centroid per value. `tol` is scikit-learn's (relative to the data's variance);
    0 runs Lloyd to its fixed point. Measured: 1M weights at 5 bits in ~7 s on 2 cores.
    """
    from sklearn.cluster import KMeans
    from threadpoolctl import threadpool_limits

    w = np.asarray(w, dtype=np.float64).ravel()
    if w.size == 0:
        return np.zeros(0, np.float32), np.zeros(0, np.int64)
    distinct = np.unique(w)
    if distinct.size <= k:
        return distinct.astype(np.float32), np.searchsorted(distinct, w).astype(np.int64)
    km = KMeans(
        n_clusters=k,
        init=linear_init(w, k).reshape(-1, 1),
        n_init=1,
        max_iter=max_iter,
        tol=tol,
        random_state=seed,
        algorithm="lloyd",
    )
    # A small layer's k-means is over before OpenMP's threads are of use: on a busy 2-core
    # machine 500 weights took ~650 ms with scikit-learn's default threads and ~20 ms with one.
    threads = 1 if w.size < SMALL_KMEANS else None
    with warnings.catch_warnings(), threadpool_limits(threads, user_api="openmp"):
        warnings.simplefilter("ignore")  # ConvergenceWarning on duplicate points is expected
        km.fit(w.reshape(-1, 1))
    centroids = km.cluster_centers_.ravel()
    order = np.argsort(centroids, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return centroids[order].astype(np.float32), rank[km.labels_].astype(np.int64)


def nearest(values: torch.Tensor, sorted_centroids: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centroid for each value (centroids sorted ascending)."""
    mids = (sorted_centroids[1:] + sorted_centroids[:-1]) / 2
    return torch.bucketize(values, mids)


# --- the sharing parametrization ------------------------------------------------------------


class SharedWeights(nn.Module):
    """weight = where(mask, codebook[index], +0.0). `mode` chooses what fine-tuning trains:
    "centroids" (the paper: the codebook; `original` is unused) or "weights" (the originals,
    snapped to their nearest centroid on every forward, straight-through).

    `index` and `mask` are the state; the kept positions (`_plan`) and the weight computed with
    autograd off (`_evaluated`) are caches, rebuilt whenever what they came from changes:
    `index` and `mask` by identity and version counter, the codebook by value (fused optimizers
    update a parameter without bumping its version; it has at most 4,096 entries).
    """

    compress_own = True  # not a parametrization of the user's (`prune.foreign_weights`)

    def __init__(
        self,
        codebook: torch.Tensor,
        index: torch.Tensor,
        mask: torch.Tensor,
        mode: str = "centroids",
    ) -> None:
        super().__init__()
        self.codebook = nn.Parameter(codebook.to(torch.float32), requires_grad=mode == "centroids")
        # int32: half of int64's memory (ResNet-18: 43 MiB less while fine-tuning), and still an
        # index that index_select, index_add_ and advanced indexing take (gather, scatter and
        # one_hot want int64: convert first)
        self.register_buffer("index", index.to(torch.int32))
        self.register_buffer("mask", mask.to(torch.bool))
        self.mode = mode
        self._plan_cache: tuple | None = None
        self._eval_cache: tuple | None = None

    def _plan(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(kept, kept_index): flat positions of the kept weights and their codebook index.
        Cached on the mask and the index (held here, so their identity cannot pass to another
        tensor) and their version counters; weights mode re-assigns the index every step."""
        c = self._plan_cache
        if c is None or c[0] is not self.mask or c[1] != self.mask._version:
            c = (self.mask, self.mask._version, torch.nonzero(self.mask.flatten()).flatten())
            c += (None, None, None)
        if c[3] is not self.index or c[4] != self.index._version:
            plan = (c[2], self.index.flatten().index_select(0, c[2]))
            c = (*c[:3], self.index, self.index._version, plan)
        self._plan_cache = c
        return c[5]

    def _scatter(self, codebook: torch.Tensor) -> torch.Tensor:
        """+0.0 everywhere, codebook[index] at the kept positions. Autograd sums the output's
        gradient into each centroid over its kept members only (index_select's backward)."""
        kept, kept_index = self._plan()
        out = torch.zeros(self.mask.numel(), dtype=codebook.dtype, device=codebook.device)
        return out.scatter_(0, kept, codebook.index_select(0, kept_index)).view(self.mask.shape)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        if self.mode == "weights":
            with torch.no_grad():
                self.index.copy_(nearest(w, self.codebook))
            snapped = self._scatter(self.codebook.detach())
            # The centroid's value exactly (w - w.detach() is +0.0), the weight's gradient
            # where it is kept.
            zero = torch.zeros((), dtype=w.dtype, device=w.device)
            return snapped + torch.where(self.mask, w - w.detach(), zero)
        if torch.is_grad_enabled():
            self._eval_cache = None
            return self._scatter(self.codebook)
        return self._evaluated()

    def _evaluated(self) -> torch.Tensor:
        plan = self._plan()
        c = self._eval_cache
        if (
            c is not None
            and c[0] is plan
            and c[2]._version == c[3]
            and torch.equal(c[1], self.codebook)
        ):
            return c[2]
        out = self._scatter(self.codebook)
        if not torch.is_inference_mode_enabled():  # inference tensors keep no version counter
            self._eval_cache = (plan, self.codebook.detach().clone(), out, out._version)
        return out


@dataclass(frozen=True)
class QuantizeConfig:
    """Bits per layer: conv_bits for convolutions, fc_bits for linear layers, attention
    projections and embeddings (the paper's 8 and 5), overridden per layer by `bits`
    {layer name: bits}. `mode` is what fine-tuning trains; `embeddings` also shares the weights
    of nn.Embedding tables."""

    conv_bits: int = 8
    fc_bits: int = 5
    bits: dict[str, int] = field(default_factory=dict)
    mode: str = "centroids"
    seed: int = 0
    embeddings: bool = False

    def __post_init__(self) -> None:
        for name, b in [
            ("conv_bits", self.conv_bits),
            ("fc_bits", self.fc_bits),
            *self.bits.items(),
        ]:
            if not (isinstance(b, int) and 1 <= b <= 12):
                raise InputError(f"quantize: {name} = {b!r} is impossible; give whole bits 1..12")
        if self.mode not in ("centroids", "weights"):
            raise InputError(f"quantize: mode {self.mode!r} must be 'centroids' or 'weights'")

    def bits_for(self, layer: Layer) -> int:
        if layer.name in self.bits:
            return self.bits[layer.name]
        return self.conv_bits if layer.kind == "conv" else self.fc_bits


def layers(model: nn.Module, embeddings: bool = False) -> dict[str, Layer]:
    """The layers weight sharing applies to, by layer name (see `prune.weight_layers`)."""
    return weight_layers(model, embeddings)


def share_weights_(model: nn.Module, cfg: QuantizeConfig) -> dict[str, int]:
    """Cluster each layer's non-zero weights and replace the weight by a SharedWeights
    parametrization (an existing pruning mask is kept). Returns the bits used per layer."""
    found = layers(model, cfg.embeddings)
    unknown = sorted(set(cfg.bits) - set(found))
    if unknown:
        raise InputError(
            f"quantize: no layer named {', '.join(unknown)}; layers: {', '.join(found)}"
        )
    if not found:
        raise InputError(
            "quantize: the model has no Linear, Conv or MultiheadAttention layers to share "
            "weights in"
        )
    masks = masks_of(model)
    used = {}
    for name, layer in found.items():
        bits = cfg.bits_for(layer)
        module = model.get_submodule(layer.module)
        with torch.no_grad():
            w = getattr(module, layer.param).detach().clone()
        mask = masks.get(layer.key, torch.ones_like(w, dtype=torch.bool))
        k = 2**bits - 1 if not bool(mask.all()) else 2**bits  # zero counts as one of 2^bits values
        centroids, labels = kmeans_1d(w[mask].numpy(), k, seed=cfg.seed)
        index = torch.zeros(w.shape, dtype=torch.int64)
        index[mask] = torch.from_numpy(labels)
        install_(
            module, layer.param, SharedWeights(torch.from_numpy(centroids), index, mask, cfg.mode)
        )
        used[name] = bits
    return used


def install_(module: nn.Module, param: str, shared: SharedWeights) -> None:
    """Make `shared` the parametrization of `module.param`, in place of any before it (a
    pruning mask, which `shared` holds itself); the original trains only in weights mode."""
    if parametrize.is_parametrized(module, param):
        parametrize.remove_parametrizations(module, param, leave_parametrized=True)
    parametrize.register_parametrization(module, param, shared, unsafe=True)
    module.parametrizations[param].original.requires_grad_(shared.mode == "weights")
    if shared.mode == "centroids":
        _drop_original_(module.parametrizations[param])


def _drop_original_(plist: nn.Module) -> None:
    """Centroids mode never reads the original weight: keep its shape, dtype and device, not
    its bytes (a zero-strided view of one +0.0). ViT-tiny's fine-tuning held 20 MiB of such
    originals, a fifth of what its 4x-the-model memory target allows over the model."""
    o = plist.original
    empty = torch.zeros((), dtype=o.dtype, device=o.device).expand(o.shape)
    plist.original = nn.Parameter(empty, requires_grad=False)
    # A state_dict loaded into the model skips what it would copy into the view (which
    # refuses writes): the loaded original is as unused as this one.
    plist.register_load_state_dict_pre_hook(_skip_original)
    plist.register_load_state_dict_post_hook(_not_missing_original)


def _skip_original(module, state_dict, prefix, *_) -> None:
    if state_dict.pop(prefix + "original", None) is not None:
        module._skipped_original = prefix + "original"


def _not_missing_original(module, incompatible) -> None:
    key = module.__dict__.pop("_skipped_original", None)
    if key in incompatible.missing_keys:
        incompatible.missing_keys.remove(key)


def shared_params(model: nn.Module) -> dict[str, SharedWeights]:
    """The SharedWeights parametrization of each shared parameter, by state_dict key
    ("fc1.weight", "encoder.blocks.0.attn.in_proj_weight")."""
    return {key: p for key, _, p in _shared_lists(model)}


def _shared_lists(model: nn.Module) -> Iterator[tuple[str, nn.Module, SharedWeights]]:
    """(state_dict key, its ParametrizationList, the SharedWeights in it) per shared parameter."""
    for name, module in model.named_modules():
        if parametrize.is_parametrized(module):
            for pname, plist in module.parametrizations.items():
                for p in plist:
                    if isinstance(p, SharedWeights):
                        yield (f"{name}.{pname}" if name else pname), plist, p


def shared_of(model: nn.Module) -> dict[str, SharedWeights]:
    """The SharedWeights parametrization of each shared layer, by layer name ("fc1",
    "encoder.blocks.0.attn.in_proj")."""
    return {layer_name(key): p for key, p in shared_params(model).items()}


def freeze_sharing_(model: nn.Module) -> None:
    """After weight-mode fine-tuning: keep the last assignment and stop training originals
    (and holding them)."""
    for _, plist, p in _shared_lists(model):
        if p.mode != "centroids":
            p.mode = "centroids"
            _drop_original_(plist)


def distinct_values(w: torch.Tensor) -> int:
    return int(torch.unique(w.detach()).numel())


__all__ = [
    "QuantizeConfig",
    "SharedWeights",
    "distinct_values",
    "install_",
    "kmeans_1d",
    "layers",
    "linear_init",
    "share_weights_",
    "shared_of",
    "shared_params",
]
