"""Structured pruning: remove whole output channels of Conv layers, neurons of Linear layers and
embedding dimensions (attention head dimensions included), together with the input channels
of every layer that reads them, so the result is an ordinary, smaller `nn.Module` and the
exported graph itself is smaller and faster. Deep Compression's pruning zeroes single weights:
that shrinks the archive, but a runtime still executes the dense Conv/Gemm.

The dependency graph (which layers must lose the same channels: across residual adds,
concatenations, depthwise convs, BatchNorm, LayerNorm and MultiheadAttention) comes from
torch-pruning, Fang et al., "DepGraph: Towards Any Structural Pruning" (CVPR 2023). Chosen over
torch's own tracing (torch.fx/torch.export give the graph, not which tensors share a channel
axis, nor how to cut an MHA's packed projection) and over hand-written surgery, which is where
structured pruning usually breaks: torch-pruning is maintained, pure Python, and follows a
model through autograd, so a user's own architecture needs no annotations. Importance:
the L1 or L2 norm of each channel's weights across its coupled group (Li et al., "Pruning
Filters for Efficient ConvNets", ICLR 2017), or first-order Taylor, |weight x gradient|
(Molchanov et al., "Importance Estimation for Neural Network Pruning", CVPR 2019).

    cfg = ChannelsConfig.from_recipe(recipe.channels)
    record = thin_(model, example, cfg, retrain=..., gradients=...)   # model changed in place
    record["plan"]     # replayable: models.thin.apply_ rebuilds this shape from the spec
    remove_(model, example, "conv1", [0, 3])   # by hand: these channels and all coupled ones

How much to cut: a global MACs target (`target_macs` of the original's), reached in `rounds`
equal steps with retraining between them. Within a round torch-pruning removes the same
fraction of each layer's channels ("layer" scope) or ranks channels across layers ("global"),
in small increments until the round's MACs target is met. The output layer (the last Conv or
Linear the forward runs) is never cut: its width is the class count.

Nothing here prints or exits; a bad setting raises InputError, a model the tracer cannot
follow raises InputError naming the fix (`channels.ignore`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from compresskit.compressor.flops import torch_macs
from compresskit.models import thin
from compresskit.models.errors import InputError, one_line

IMPORTANCE = ("l1", "l2", "taylor")
SCOPES = ("layer", "global")
STEPS = 50  # increments per round: each removes ~max_ratio/STEPS of a layer's channels


@dataclass(frozen=True)
class ChannelsConfig:
    """The `[channels]` recipe section, checked (see `compressor.recipe`)."""

    target_macs: float = 0.5  # keep this fraction of the original's MACs
    importance: str = "l1"
    scope: str = "layer"
    rounds: int = 3
    retrain_epochs: int = 1
    lr: float = 3e-3
    ignore: tuple[str, ...] = ()  # modules whose output channels are kept
    round_to: int = 0  # keep channel counts multiples of this (8 suits SIMD kernels); 0 = off
    max_ratio: float = 0.9  # never remove more than this fraction of one layer's channels

    @classmethod
    def from_recipe(cls, section: Any) -> ChannelsConfig:
        """From the recipe's [channels] section (compressor.recipe.ChannelsSection)."""
        keys = {f.name: getattr(section, f.name) for f in fields(cls)}
        keys["ignore"] = tuple(keys["ignore"])
        return cls(**keys)


def prunable(model: nn.Module) -> list[str]:
    """Names of the layers whose output channels this stage can cut (Conv and Linear)."""
    return [n for n, m in model.named_modules() if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Linear))]


def output_layer(model: nn.Module, example: torch.Tensor) -> str | None:
    """The last Conv or Linear the forward pass runs: its width is the output's."""
    order: list[nn.Module] = []
    hooks = [
        m.register_forward_hook(lambda mod, _i, _o: order.append(mod))
        for m in model.modules()
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Linear))
    ]
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(example)
    finally:
        model.train(was)
        for h in hooks:
            h.remove()
    if not order:
        return None
    names = {m: n for n, m in model.named_modules()}
    return names[order[-1]]


def widths(model: nn.Module) -> dict[str, int]:
    """Output channels of every Conv and Linear (MultiheadAttention: its embedding width)."""
    out = {}
    for n, m in model.named_modules():
        if isinstance(m, (nn.Conv1d, nn.Conv2d)):
            out[n] = m.out_channels
        elif isinstance(m, nn.Linear):
            out[n] = m.out_features
        elif isinstance(m, nn.MultiheadAttention):
            out[n] = m.embed_dim
    return out


def _importance(cfg: ChannelsConfig):
    import torch_pruning as tp

    if cfg.importance == "taylor":
        return tp.importance.GroupTaylorImportance()
    return tp.importance.GroupMagnitudeImportance(p=1 if cfg.importance == "l1" else 2)


def _pruner(model: nn.Module, example: torch.Tensor, cfg: ChannelsConfig, ignored: list[str]):
    import torch_pruning as tp

    modules = dict(model.named_modules())
    heads = {m: m.num_heads for m in modules.values() if isinstance(m, nn.MultiheadAttention)}
    try:
        with thin.tracing(model):
            return tp.pruner.MetaPruner(
                model,
                example,
                importance=_importance(cfg),
                global_pruning=cfg.scope == "global",
                pruning_ratio=cfg.max_ratio,
                iterative_steps=STEPS,
                ignored_layers=[modules[n] for n in ignored],
                round_to=cfg.round_to or None,
                num_heads=heads,
            )
    except InputError:
        raise
    except Exception as e:
        detail = one_line(e)
        raise InputError(
            f"channels: torch-pruning cannot follow this model's graph ({type(e).__name__}: "
            f"{detail}); exclude the module it stops at with channels.ignore = ['name']"
        ) from None


def remove_(model: nn.Module, example: torch.Tensor, layer: str, idxs: list[int]) -> list[list]:
    """Remove output channels `idxs` of `layer` and every channel coupled to them (the
    consumers' inputs, BatchNorm, the other side of a residual add), in place. Returns the plan
    entries that replay it (`models.thin`)."""
    import torch_pruning as tp

    modules = dict(model.named_modules())
    if layer not in modules:
        raise InputError(f"channels: the model has no layer {layer!r}")
    with thin.tracing(model):
        graph = tp.DependencyGraph().build_dependency(model, example_inputs=example)
        module = modules[layer]
        fn = graph.get_pruner_of_module(module).prune_out_channels
        graph.get_pruning_group(module, fn, [int(i) for i in idxs]).prune()
    return [thin.entry(*h) for h in graph.pruning_history()]


def thin_(
    model: nn.Module,
    example: torch.Tensor,
    cfg: ChannelsConfig,
    retrain: Callable[[nn.Module, int, float], None] | None = None,
    gradients: Callable[[nn.Module], None] | None = None,
    info: Callable[[str], None] = lambda message: None,
) -> dict[str, Any]:
    """Remove channels from `model` in place until its MACs are at most `cfg.target_macs` of
    what they were, in `cfg.rounds` rounds with `retrain(model, epochs, lr)` after each.

    `example`: a small batch of real inputs (shapes and dtype; 2 samples suffice).
    `gradients(model)`: fills each parameter's .grad from a few training batches; needed by
    Taylor importance, called before every increment.

    Returns a plain-data record: MACs and parameters before and after, per-layer widths,
    per-round figures, and `plan`, the replayable channel plan (`models.thin`).
    """
    if cfg.importance == "taylor" and gradients is None:
        raise InputError("channels.importance = 'taylor' needs gradients from training data")
    one = example[:1]
    modules = dict(model.named_modules())
    unknown = [n for n in cfg.ignore if n not in modules]
    if unknown:
        raise InputError(
            f"channels.ignore names {', '.join(repr(n) for n in unknown)}, which the model "
            f"lacks; layers: {', '.join(prunable(model))}"
        )
    head = output_layer(model, one)
    if head is None:
        raise InputError("channels: the model runs no Conv or Linear layer; nothing to cut")
    ignored = sorted({head, *cfg.ignore})
    macs0, params0 = torch_macs(model, one), _params(model)
    widths0 = widths(model)
    plan: list[list[Any]] = []
    rounds = []
    macs = macs0
    for r in range(1, cfg.rounds + 1):
        goal = macs0 * (1 - (1 - cfg.target_macs) * r / cfg.rounds)
        pruner = _pruner(model, example, cfg, ignored)
        steps = 0
        while macs > goal and steps < STEPS:
            if gradients is not None and cfg.importance == "taylor":
                model.zero_grad(set_to_none=True)
                gradients(model)
            pruner.step()
            steps += 1
            macs = _macs_after_cut(model, one)
        plan += [thin.entry(*h) for h in pruner.DG.pruning_history()]
        model.zero_grad(set_to_none=True)
        info(
            f"channels: round {r}/{cfg.rounds}: {macs / macs0:.0%} of the MACs "
            f"(goal {goal / macs0:.0%}), {_params(model):,} parameters"
        )
        if retrain is not None and cfg.retrain_epochs > 0:
            retrain(model, cfg.retrain_epochs, cfg.lr)
        rounds.append({"round": r, "macs": macs, "goal": goal, "parameters": _params(model)})
    after = widths(model)
    return {
        "macs": [macs0, macs],
        "macs_ratio": macs / macs0,
        "parameters": [params0, _params(model)],
        "target_macs": cfg.target_macs,
        "reached": macs <= macs0 * cfg.target_macs * (1 + 1e-9),
        "ignored": ignored,
        "layers": [{"name": n, "before": w, "after": after.get(n, w)} for n, w in widths0.items()],
        "rounds": rounds,
        "plan": {"example": thin.describe_example(example), "history": plan},
    }


def _macs_after_cut(model: nn.Module, one: torch.Tensor) -> int:
    """MACs of the cut model, whose forward must still run: a model that reshapes by a width
    fixed in its code (attention heads as `view(b, n, heads, 64)`) breaks when that width is
    cut, and the user must keep those layers whole."""
    try:
        return torch_macs(model, one)
    except Exception as e:
        detail = one_line(e, 160)
        raise InputError(
            f"channels: after cutting channels the model no longer runs ({type(e).__name__}: "
            f"{detail}); its forward likely uses a fixed width (e.g. attention heads): keep "
            "those layers whole with channels.ignore = ['name', ...]"
        ) from None


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
