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
equal steps with retraining between them. Within a round torch-pruning removes channels in
small increments until the round's MACs target is met: the same fraction of each layer's
channels ("layer" scope), channels ranked across layers ("global"), or per-layer fractions
from a sensitivity analysis ("sensitivity": each layer cut alone on a copy, accuracy measured
on held-out data, then the MACs bought where they cost the least accuracy; the rule
`prune.sparsity = "auto"` follows for single weights). The output layer (the last Conv or
Linear the forward runs) is never cut: its width is the class count.

Attention: nn.MultiheadAttention loses head dimensions with its embedding width (its heads
keep their count). Attention with separate q/k/v projections and a head size fixed in code
(Hugging Face's ViT, BERT) loses whole heads only, `heads` of each layer's heads over the
rounds, ranked by the importance of their q/k/v rows and output columns (Michel et al.,
"Are Sixteen Heads Really Better than One?", NeurIPS 2019, remove heads by importance too);
its head dimensions are never cut, since its forward views a projection as (heads, head size).

Nothing here prints or exits; a bad setting raises InputError, a model the tracer cannot
follow raises InputError naming the fix (`channels.ignore`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from compresskit.compressor.flops import module_macs, torch_macs
from compresskit.models import thin
from compresskit.models.errors import InputError, one_line

IMPORTANCE = ("l1", "l2", "taylor")
SCOPES = ("layer", "global", "sensitivity")
GRID = (0.2, 0.4, 0.6, 0.8)  # fractions of a layer's channels tried alone (sensitivity scope)
HEADROOM = 1.25  # the allocation buys this much more than the goal: coupled cuts overlap
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
    heads: float = 0.0  # fraction of each q/k/v attention layer's heads removed (whole heads)
    # keep at most this fraction of the measured batch-1 ORT time too (None: MACs alone)
    target_latency: float | None = None

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


def _pruner(
    model: nn.Module,
    example: torch.Tensor,
    cfg: ChannelsConfig,
    ignored: list[str],
    ratios: dict[str, float] | None = None,
    steps: int = STEPS,
    cap: float = 1.0,
):
    """torch-pruning's MetaPruner over `steps` increments up to `cfg.max_ratio` of each layer
    (or `ratios[layer]`, the sensitivity scope's; layers it leaves out are not cut), no layer
    cut past `cap` of the width it starts from."""
    import torch_pruning as tp

    modules = dict(model.named_modules())
    heads = {m: m.num_heads for m in modules.values() if isinstance(m, nn.MultiheadAttention)}
    # q/k/v projections with a fixed head size: never cut their width here (whole heads go
    # in _remove_heads); their inputs still follow the embedding width.
    qkv = [modules[n] for projs, _ in thin.attention(model).values() for n in projs]
    # Recurrent layers keep their hidden width: torch-pruning's handler assumes an LSTM's four
    # gates (a GRU's three made it index past the weight) and one layer, one direction.
    recurrent = [m for m in modules.values() if isinstance(m, nn.RNNBase | nn.RNNCellBase)]
    try:
        with thin.tracing(model):
            return tp.pruner.MetaPruner(
                model,
                example,
                importance=_importance(cfg),
                global_pruning=cfg.scope == "global",
                # the cap in the ratio too: torch-pruning's own max_pruning_ratio binds only
                # its global scope, and int(20 x (1 - 0.9)) kept 1 of 20 channels
                pruning_ratio=min(cfg.max_ratio, cap) if ratios is None else 0.0,
                pruning_ratio_dict=None
                if ratios is None
                else {modules[n]: r for n, r in ratios.items() if r > 0},
                iterative_steps=steps,
                max_pruning_ratio=cap,
                ignored_layers=[modules[n] for n in ignored] + qkv + recurrent,
                round_to=cfg.round_to or None,
                num_heads=heads,
            )
    except InputError:
        raise
    except Exception as e:
        detail = one_line(e)
        names = {m: n for n, m in modules.items()}
        fix = (
            f"recurrent layers ({', '.join(names[m] for m in recurrent)}) keep their width, and "
            "torch-pruning cuts a GRU's or RNN's inputs in no model: keep the layer that feeds "
            "them whole with channels.ignore = ['name'], or set channels.enabled = false"
            if recurrent
            else "exclude the module it stops at with channels.ignore = ['name']"
        )
        raise InputError(
            f"channels: torch-pruning cannot follow this model's graph ({type(e).__name__}: "
            f"{detail}); {fix}"
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
    evaluate: Callable[[nn.Module], float] | None = None,
    layer_times: Callable[[nn.Module], Any] | None = None,
) -> dict[str, Any]:
    """Remove channels from `model` in place until its MACs are at most `cfg.target_macs` of
    what they were (and, with `cfg.target_latency`, its estimated time at most that fraction
    of its measured time), in `cfg.rounds` rounds with `retrain(model, epochs, lr)` after each.

    `example`: a small batch of real inputs (shapes and dtype; 2 samples suffice).
    `gradients(model)`: fills each parameter's .grad from a few training batches; needed by
    Taylor importance, called before every increment.
    `evaluate(model)`: accuracy on held-out data; needed by the sensitivity scope.
    `layer_times(model)`: a batch-1 profile where the model will run
    (`compressor.measure.layertime`: `.run_us` whole run, `.layers` {module: us}, `.file`);
    needed by `cfg.target_latency`.

    Returns a plain-data record: MACs and parameters before and after, per-layer widths,
    per-round figures, and `plan`, the replayable channel plan (`models.thin`).
    """
    if cfg.importance == "taylor" and gradients is None:
        raise InputError("channels.importance = 'taylor' needs gradients from training data")
    if cfg.scope == "sensitivity" and evaluate is None:
        raise InputError("channels.scope = 'sensitivity' needs held-out data to evaluate on")
    if cfg.target_latency is not None and layer_times is None:
        raise InputError("channels.target_latency needs the model profiled where it runs")
    one = example[:1]
    check_ignore(model, cfg.ignore)
    head = output_layer(model, one)
    if head is None:
        raise InputError("channels: the model runs no Conv or Linear layer; nothing to cut")
    ignored = sorted({head, *cfg.ignore})
    macs0, params0 = torch_macs(model, one), _params(model)
    widths0 = widths(model)
    heads0 = head_counts(model)
    plan: list[list[Any]] = []
    rounds = []
    ratios = sens = fit = shortfall = None
    if cfg.target_latency is not None:
        info("channels: profiling the model and a half-width copy (ORT CPU, batch 1)")
        fit = latency_fit(model, example, cfg, ignored, layer_times)
    time0 = fit.measured_us[0] if fit else 0.0  # the fit reproduces the measured run
    if fit:
        _check_reachable(model, example, cfg, ignored, fit, time0)
    if cfg.scope == "sensitivity":
        sens = sensitivity(model, example, cfg, ignored, evaluate, gradients, fit)
        need = (1 - cfg.target_macs) * macs0
        time_need = (1 - cfg.target_latency) * time0 if fit else 0.0
        ratios = allocate(
            sens["baseline"], sens["curves"], sens["macs_saved"], need,
            sens.get("time_saved"), time_need,
        )  # fmt: skip
        sens["ratios"] = ratios
        info(
            "channels: sensitivity plans (of each layer's width; the rounds stop at the goal): "
            + ", ".join(f"{n} {f:.0%}" for n, f in ratios.items() if f > 0)
        )
    macs, est = macs0, time0

    def short(goal: float, time_goal: float) -> bool:
        return macs > goal or est > time_goal * (1 + 1e-9)

    def cut_until_goals(pruner, goal: float, time_goal: float) -> None:
        nonlocal macs, est
        steps = 0
        while short(goal, time_goal) and steps < STEPS:
            if gradients is not None and cfg.importance == "taylor":
                model.zero_grad(set_to_none=True)
                gradients(model)
            try:
                pruner.step()
            except Exception as e:  # a graph torch-pruning follows but mis-cuts (a grouped
                # conv in a concat raised IndexError, exit 1 "unexpected")
                raise InputError(
                    f"channels: torch-pruning failed cutting this model's graph "
                    f"({type(e).__name__}: {one_line(e)}); keep the layers it cannot cut whole "
                    "(a grouped convolution and what feeds it) with channels.ignore = "
                    "['name', ...], or set channels.enabled = false"
                ) from None
            steps += 1
            macs, est = _cost(model, one, fit)
        plan.extend(thin.entry(*h) for h in pruner.DG.pruning_history())

    for r in range(1, cfg.rounds + 1):
        goal = macs0 * (1 - (1 - cfg.target_macs) * r / cfg.rounds)
        time_goal = time0 * (1 - (1 - (cfg.target_latency or 1.0)) * r / cfg.rounds)
        if cfg.heads > 0:
            plan += _remove_heads(model, example, cfg, heads0, ignored, r, gradients)
            macs, est = _cost(model, one, fit)
        # The allocation's fractions are of each layer's original width; a pruner cuts
        # fractions of the width it starts from, so each round converts them.
        now = None if ratios is None else _ratios_now(model, widths0, ignored, ratios, cfg.round_to)
        cap = 1.0
        if ratios is None:
            # Each round's pruner takes max_ratio of the width it starts from: the rounds went
            # past it (LeNet-5's conv1 20 -> 1 channel at target_macs 0.01). Capped at what the
            # layer closest to its limit may still lose (every layer is cut alike).
            left = _ratios_now(
                model, widths0, ignored, dict.fromkeys(prunable(model), cfg.max_ratio), cfg.round_to
            )
            cap = min(left.values(), default=0.0)
        if cap > 0:
            cut_until_goals(_pruner(model, example, cfg, ignored, now, cap=cap), goal, time_goal)
        if ratios is not None and r == cfg.rounds and short(goal, time_goal):
            # The allocation adds layers' savings as if independent, but coupled layers'
            # overlap (conv1's outputs are conv2's inputs) and the time fit's fixed costs can
            # leave the combined cut short of a goal, by how much depends on the machine's
            # profile: cut on evenly toward max_ratio of each layer's original width, first
            # the layers the analysis found cheap to cut, then, if still short, every layer.
            shortfall = {"macs": macs, "estimated_us": est}
            info("channels: the allocated cuts fell short of a goal; cutting on evenly")
            for only in ({n for n, f in ratios.items() if f > 0}, set(prunable(model))):
                targets = dict.fromkeys(only, cfg.max_ratio)
                rest = _ratios_now(model, widths0, ignored, targets, cfg.round_to)
                if rest and short(goal, time_goal):
                    cut_until_goals(_pruner(model, example, cfg, ignored, rest), goal, time_goal)
        model.zero_grad(set_to_none=True)
        timed = f", {est / time0:.0%} of the estimated time" if fit else ""
        info(
            f"channels: round {r}/{cfg.rounds}: {macs / macs0:.0%} of the MACs "
            f"(goal {goal / macs0:.0%}){timed}, {_params(model):,} parameters"
        )
        if retrain is not None and cfg.retrain_epochs > 0:
            retrain(model, cfg.retrain_epochs, cfg.lr)
        rounds.append({"round": r, "macs": macs, "goal": goal, "parameters": _params(model)})
        if shortfall is not None and r == cfg.rounds:
            rounds[-1]["even_cut_from"] = shortfall  # where the allocated cuts stopped
        if fit:
            rounds[-1] |= {"estimated_us": est, "time_goal_us": time_goal}
    reached = macs <= macs0 * cfg.target_macs * (1 + 1e-9)
    after = widths(model)
    limit = None
    if not reached:
        # round_to at or above a layer's width keeps all of it: raising max_ratio (the cause
        # the message gave) cannot help there
        whole = [n for n, w in widths0.items() if n not in ignored and cfg.round_to >= w]
        if whole:
            shown = ", ".join(f"{n} ({widths0[n]})" for n in whole[:4])
            more = f" and {len(whole) - 4} more" if len(whole) > 4 else ""
            limit = (
                f"channels.round_to {cfg.round_to} is no smaller than the width of {shown}{more}, "
                "which keep every channel: lower round_to"
            )
        elif cfg.round_to:  # widths kept in multiples of round_to stop cuts short too
            limit = (
                f"channels.round_to {cfg.round_to} (widths kept in multiples of it), "
                f"max_ratio {cfg.max_ratio:g} and the layers kept whole limit the cut: lower "
                "round_to, raise max_ratio, or set target_macs to what was reached"
            )
        else:
            limit = (
                f"channels.max_ratio {cfg.max_ratio:g} and the layers kept whole limit the cut: "
                "raise max_ratio, or set target_macs to what was reached"
            )
        info(
            f"channels: target_macs {cfg.target_macs:g} not reached: {macs / macs0:.1%} of the "
            f"MACs; {limit}"
        )
    heads1 = head_counts(model)
    return {
        "macs": [macs0, macs],
        "macs_ratio": macs / macs0,
        "parameters": [params0, _params(model)],
        "target_macs": cfg.target_macs,
        "reached": reached,
        "limit": limit,  # what kept the cut short of target_macs; None when reached
        "ignored": ignored,
        "layers": [{"name": n, "before": w, "after": after.get(n, w)} for n, w in widths0.items()],
        "heads": [{"name": n, "before": h, "after": heads1.get(n, h)} for n, h in heads0.items()],
        "sensitivity": sens,
        "latency_model": None
        if fit is None
        else {
            **fit.to_dict(),
            "target_latency": cfg.target_latency,
            "estimated_us": [time0, est],
            "reached": est <= time0 * cfg.target_latency * (1 + 1e-9),
        },
        "rounds": rounds,
        "plan": {"example": thin.describe_example(example), "history": plan},
    }


def head_counts(model: nn.Module) -> dict[str, int]:
    """Heads of every attention module with q/k/v projections and a fixed head size."""
    return {
        name: model.get_submodule(qkv[0]).out_features // size
        for name, (qkv, size) in thin.attention(model).items()
    }


def _remove_heads(
    model: nn.Module,
    example: torch.Tensor,
    cfg: ChannelsConfig,
    heads0: dict[str, int],
    ignored: list[str],
    round_no: int,
    gradients: Callable[[nn.Module], None] | None,
) -> list[list[Any]]:
    """Round `round_no`'s share of whole-head removal: each attention layer loses its least
    important heads until `cfg.heads x round_no / rounds` of its original heads are gone (at
    least one head always stays). A head's importance is the group importance (L1/L2/Taylor
    over its q/k/v rows and output-projection columns, every coupled layer summed) of its
    channels, summed. Returns the plan entries."""
    import torch_pruning as tp

    skip = set(ignored)
    found = {
        n: v for n, v in thin.attention(model).items() if n not in skip and not skip & set(v[0])
    }
    if not found:
        return []
    if cfg.importance == "taylor" and gradients is not None:
        model.zero_grad(set_to_none=True)
        gradients(model)
    imp = _importance(cfg)
    with thin.tracing(model):
        graph = tp.DependencyGraph().build_dependency(model, example_inputs=example)
        for name, (qkv, size) in found.items():
            q = model.get_submodule(qkv[0])
            n_now = q.out_features // size
            want = min(
                heads0[name] - 1,
                math.floor(cfg.heads * heads0[name] * round_no / cfg.rounds + 1e-9),
            )
            cut = want - (heads0[name] - n_now)
            if cut <= 0:
                continue
            whole = graph.get_pruning_group(
                q, tp.prune_linear_out_channels, list(range(q.out_features))
            )
            scores = imp(whole).detach().reshape(n_now, size).sum(1)
            drop = torch.topk(scores, cut, largest=False).indices.tolist()
            idxs = [h * size + i for h in sorted(drop) for i in range(size)]
            graph.get_pruning_group(q, tp.prune_linear_out_channels, idxs).prune()
        thin.sync_heads_(model)
    model.zero_grad(set_to_none=True)
    return [thin.entry(*h) for h in graph.pruning_history()]


# --- measured time ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LatencyFit:
    """Each layer's batch-1 time as a + c x its MACs, from two profiles: the model and a copy
    with half of every layer's channels. `a` is what the node costs whatever its width (ORT's
    per-node work: a 1x1 shortcut conv took 7.3 us at 0.13M MACs and 5.5 us at 0.05M), `c` what
    each MAC costs there: 5x more in a convolution on a 1x1 feature map than on an 8x8 one.
    The rest of a whole run (adds, pooling, quantize/dequantize, the executor) is
    `fixed_us + other_us_per_mac x the model's MACs`, fitted so that the estimate equals both
    runs as timed without the profiler."""

    fixed_us: float
    other_us_per_mac: float
    layers: dict[str, tuple[float, float]]  # module -> (a us, c us per MAC)
    measured_us: tuple[float, float]  # whole runs, no profiler: the model, the half-width copy
    file: str  # which file was profiled: "int8" or "fp32"

    def estimate(self, macs: dict[str, int]) -> float:
        """Estimated us per batch-1 run of a cut model whose modules do `macs`."""
        layers = sum(a + c * macs.get(n, 0) for n, (a, c) in self.layers.items())
        return max(0.0, self.fixed_us + self.other_us_per_mac * sum(macs.values()) + layers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "fixed_us": self.fixed_us,
            "other_us_per_mac": self.other_us_per_mac,
            "measured_us": list(self.measured_us),
            "file": self.file,
            "layers": {n: {"fixed_us": a, "us_per_mac": c} for n, (a, c) in self.layers.items()},
        }


def fit_layers(
    macs: dict[str, int], times: Any, half_macs: dict[str, int], half_times: Any
) -> LatencyFit:
    """The two-point fit of `LatencyFit` from profiles (`.run_us`, `.layers`, `.file`) and
    per-module MACs of the model and its half-width copy. A layer whose time did not fall when
    its MACs did is all fixed cost (c = 0); one that fell more than in proportion (noise) is
    all per-MAC cost (a = 0); a layer without MACs, or only in one profile, is proportional.
    What the layers do not explain is the rest of the run, linear in the model's MACs (never
    rising as they fall)."""
    layers = {}
    for n, t in times.layers.items():
        m, m_half, t_half = macs.get(n, 0), half_macs.get(n), half_times.layers.get(n)
        if m <= 0:
            continue  # no MACs to scale by: its time stays in the rest of the run
        a, c = 0.0, t / m
        if t_half is not None and m_half is not None and m_half < 0.9 * m:
            slope = (t - t_half) / (m - m_half)
            if slope <= 0:
                a, c = t, 0.0
            elif slope < t / m:
                a, c = t - slope * m, slope
        layers[n] = (a, c)

    def rest(run_us: float, per: dict[str, int]) -> float:
        return run_us - sum(a + c * per.get(n, 0) for n, (a, c) in layers.items())

    # The profiler's own per-node cost can make the kernels add up to more than a plain run:
    # scale them down to it, so the rest of the run is never negative.
    spent = times.run_us - rest(times.run_us, macs)
    if spent > times.run_us > 0:
        k = times.run_us / spent
        layers = {n: (a * k, c * k) for n, (a, c) in layers.items()}
    m0, m1 = sum(macs.values()), sum(half_macs.values())
    r0, r1 = rest(times.run_us, macs), rest(half_times.run_us, half_macs)
    slope = max(0.0, (r0 - r1) / (m0 - m1)) if m0 > m1 else 0.0
    fixed = r0 - slope * m0
    if fixed < 0:  # a rest that would turn negative when cut further: proportional instead
        fixed, slope = 0.0, r0 / m0
    return LatencyFit(fixed, slope, layers, (times.run_us, half_times.run_us), times.file)


def latency_fit(
    model: nn.Module,
    example: torch.Tensor,
    cfg: ChannelsConfig,
    ignored: list[str],
    layer_times: Callable[[nn.Module], Any],
) -> LatencyFit:
    """Profile `model` and a copy with half of each layer's channels cut (the same layers this
    stage may cut), and fit each layer's time (`fit_layers`)."""
    one = example[:1]
    times, macs = layer_times(model), module_macs(model, one)
    twin = _cut_copy(model, example, cfg, ignored, 0.5)
    return fit_layers(macs, times, module_macs(twin, one), layer_times(twin))


def check_ignore(model: nn.Module, ignore: tuple[str, ...] | list[str]) -> None:
    """channels.ignore names layers of `model` (the one thinned: a student when distilling),
    checked before any work (a typo was found after the whole distillation)."""
    modules = dict(model.named_modules())
    if "" in ignore:  # the model itself: every layer kept whole, then "raise max_ratio"
        raise InputError(
            "channels.ignore names '' (the whole model), which keeps every layer whole; name "
            "layers, or set channels.enabled = false"
        )
    unknown = [n for n in ignore if n not in modules]
    if unknown:
        raise InputError(
            f"channels.ignore names {', '.join(repr(n) for n in unknown)}, which the model "
            f"lacks; layers: {', '.join(prunable(model))}"
        )


def _cut_copy(
    model: nn.Module, example: torch.Tensor, cfg: ChannelsConfig, ignored: list[str], ratio: float
) -> nn.Module:
    """A copy with `ratio` of every cuttable layer's channels removed (least L1 first)."""
    twin = copy.deepcopy(model)
    same = replace(cfg, scope="layer", importance="l1", max_ratio=ratio)
    _pruner(twin, example, same, ignored, steps=1).step()
    return twin


def _check_reachable(
    model: nn.Module,
    example: torch.Tensor,
    cfg: ChannelsConfig,
    ignored: list[str],
    fit: LatencyFit,
    time0: float,
) -> None:
    """Refuse a time goal that even the deepest cut misses (every layer by `cfg.max_ratio`, or
    by the sensitivity grid's largest fraction under that scope):
    per-node and executor time does not shrink with channels, and cutting on towards an
    unreachable goal would only cost accuracy (LeNet-5 on 8x8 digits: 24 us, of which the
    deepest cut saves 35%; before this check a goal of 0.6 cut it to 4% of its MACs and 64%
    accuracy)."""
    ratio = min(cfg.max_ratio, max(GRID)) if cfg.scope == "sensitivity" else cfg.max_ratio
    deepest = fit.estimate(module_macs(_cut_copy(model, example, cfg, ignored, ratio), example[:1]))
    if deepest > cfg.target_latency * time0:
        least = math.ceil(100 * deepest / time0) / 100
        raise InputError(
            f"channels.target_latency {cfg.target_latency} is out of reach for this model: with "
            f"every layer cut by {ratio:.0%} its estimated batch-1 time is "
            f"{deepest:.0f} us of {time0:.0f} us measured ({deepest / time0:.0%}; per-node and "
            f"executor time does not shrink with channels); set target_latency >= {least:.2f} "
            "or leave it unset"
        )


# --- sensitivity scope ------------------------------------------------------------------------


def sensitivity(
    model: nn.Module,
    example: torch.Tensor,
    cfg: ChannelsConfig,
    ignored: list[str],
    evaluate: Callable[[nn.Module], float],
    gradients: Callable[[nn.Module], None] | None = None,
    fit: LatencyFit | None = None,
) -> dict[str, Any]:
    """Cut each prunable layer alone (with every channel coupled to it) by each fraction of
    `GRID` up to `cfg.max_ratio`, on a copy, least important channels first; measure the copy
    with `evaluate` (held-out data: never the test set), its MACs and, given a latency `fit`,
    its estimated time. Layers whose coupled group cannot be cut by a fraction
    (MultiheadAttention's head-multiple widths) are left out. Returns {"baseline", "curves":
    {layer: {fraction: accuracy}}, "macs_saved"} and, with `fit`, "time_saved" (us)."""
    import torch_pruning as tp

    one = example[:1]
    modules = dict(model.named_modules())
    names = {m: n for n, m in modules.items()}
    skip = {modules[n] for n in ignored}
    skip |= {modules[n] for projs, _ in thin.attention(model).values() for n in projs}
    per0 = module_macs(model, one)
    macs0 = sum(per0.values())
    time0 = fit.estimate(per0) if fit else 0.0
    base = evaluate(model)
    if cfg.importance == "taylor" and gradients is not None:
        model.zero_grad(set_to_none=True)
        gradients(model)
    imp = _importance(cfg)
    curves: dict[str, dict[float, float]] = {}
    saved: dict[str, dict[float, int]] = {}
    timed: dict[str, dict[float, float]] = {}
    with thin.tracing(model):
        graph = tp.DependencyGraph().build_dependency(model, example_inputs=example)
        roots = []
        for group in graph.get_all_groups(
            ignored_layers=list(skip), root_module_types=[nn.Conv1d, nn.Conv2d, nn.Linear]
        ):
            root = group[0].dep.target.module
            scores = None if root in skip else imp(group)
            if scores is not None and names[root] not in {r[0] for r in roots}:
                roots.append((names[root], scores.detach()))
        for name, scores in roots:
            # One copy per layer, cut deeper at each fraction: removed channels renumber the
            # rest, so each cut names the survivors' current positions.
            width = len(scores)
            order = torch.argsort(scores).tolist()
            twin = copy.deepcopy(model)
            twin_graph = tp.DependencyGraph().build_dependency(twin, example_inputs=example)
            target = twin.get_submodule(name)
            fn = twin_graph.get_pruner_of_module(target).prune_out_channels
            curves[name], saved[name], timed[name], gone = {}, {}, {}, []
            for f in (g for g in GRID if g <= cfg.max_ratio):
                k = int(width * f)
                if k <= len(gone) or k >= width:
                    continue
                removed = set(gone)
                position = {c: i for i, c in enumerate(c for c in range(width) if c not in removed)}
                cut = order[len(gone) : k]
                try:
                    twin_graph.get_pruning_group(target, fn, [position[c] for c in cut]).prune()
                except Exception:  # a width that must stay a multiple (MHA heads): leave it
                    curves[name] = {}
                    break
                gone += cut
                curves[name][f] = evaluate(twin)
                per = module_macs(twin, one)
                saved[name][f] = macs0 - sum(per.values())
                if fit:
                    timed[name][f] = time0 - fit.estimate(per)
    model.zero_grad(set_to_none=True)
    curves = {n: c for n, c in curves.items() if c}
    out = {"baseline": base, "curves": curves, "macs_saved": {n: saved[n] for n in curves}}
    if fit:
        out["time_saved"] = {n: timed[n] for n in curves}
    return out


def allocate(
    baseline: float,
    curves: dict[str, dict[float, float]],
    saved: dict[str, dict[float, int]],
    need: float,
    time_saved: dict[str, dict[float, float]] | None = None,
    time_need: float = 0.0,
    buckets: int | None = None,
) -> dict[str, float]:
    """Per-layer fractions to cut that save at least HEADROOM x `need` MACs (coupled layers'
    savings overlap; the pruning loop stops at the real goal) and, given `time_saved`, at
    least HEADROOM x `time_need` of estimated time, at the least total accuracy lost, treating
    layers' losses as additive: a multiple-choice knapsack, solved exactly by dynamic
    programming over `buckets` steps of each saving (2,000 for one saving, 200 x 200 for
    two; each option's savings rounded down, so the savings promised are met). A layer's loss
    at a fraction is its drop below `baseline`, made monotone along its curve. If every
    layer's largest cut together saves less than the goal with its headroom, the goal alone is
    bought; if less than the goal itself, each layer's largest cut. Layers left whole get 0."""
    names = list(curves)
    dims = [(saved, HEADROOM * need)]
    if time_saved is not None:
        dims.append((time_saved, HEADROOM * time_need))
    dims = [(d, goal) for d, goal in dims if goal > 0]
    if not dims or not names:
        return {n: 0.0 for n in names}
    most = {n: max(curves[n], default=0.0) for n in names}
    available = [sum(d[n].get(f, 0) for n, f in most.items()) for d, _ in dims]
    if any(a < goal / HEADROOM for a, (_, goal) in zip(available, dims, strict=True)):
        return {n: float(f) for n, f in most.items()}  # not even the goal itself: all in
    # short of the headroom only: aim at the goal itself, still at the least accuracy lost
    dims = [
        (d, goal if a >= goal else goal / HEADROOM)
        for a, (d, goal) in zip(available, dims, strict=True)
    ]
    size = buckets or (2000 if len(dims) == 1 else 200)
    shape = (size + 1,) * len(dims)
    grid = np.indices(shape).reshape(len(dims), -1)  # each flat state's bucket per saving
    cost = np.full(grid.shape[1], np.inf)
    cost[0] = 0.0
    trail = []  # per layer: (fraction chosen, state it came from), at each state
    for n in names:
        opts, worst = [(0.0, (0,) * len(dims), 0.0)], 0.0
        for f in sorted(curves[n]):
            worst = max(worst, baseline - curves[n][f])
            gains = tuple(
                min(size, max(0, int(d[n].get(f, 0) / (goal / size) + 1e-9))) for d, goal in dims
            )
            opts.append((f, gains, worst))
        best = np.full_like(cost, np.inf)
        frac = np.zeros_like(cost)
        came = np.zeros(cost.shape, dtype=np.int64)
        for f, gains, loss in opts:
            # from each state to the one `gains` further (capped at the goal), at `loss` more:
            # the cheapest source per target state wins
            target = np.ravel_multi_index(
                tuple(np.minimum(grid[i] + g, size) for i, g in enumerate(gains)), shape
            )
            value = cost + loss
            order = np.lexsort((value, target))
            first = np.ones(len(order), dtype=bool)
            first[1:] = target[order][1:] != target[order][:-1]
            src = order[first]
            tgt = target[src]
            better = value[src] < best[tgt] - 1e-12
            best[tgt[better]] = value[src[better]]
            frac[tgt[better]] = f
            came[tgt[better]] = src[better]
        trail.append((frac, came))
        cost = best
    end = cost.size - 1  # every saving at its goal
    if not np.isfinite(cost[end]):  # rounding down left the goal out of reach: the most saved
        reach = np.flatnonzero(np.isfinite(cost))
        score = grid[:, reach].min(axis=0)
        best = reach[score == score.max()]
        end = int(best[np.argmin(cost[best])])  # and of those, the cheapest
    chosen = {}
    for n, (frac, came) in zip(reversed(names), reversed(trail), strict=True):
        chosen[n] = float(frac[end])
        end = int(came[end])
    return {n: chosen[n] for n in names}


def _ratios_now(
    model: nn.Module,
    widths0: dict[str, int],
    ignored: list[str],
    targets: dict[str, float],
    round_to: int = 0,
) -> dict[str, float]:
    """Per layer of `targets` ({layer: fraction of its ORIGINAL width to remove}), the fraction
    of its current width a pruner built now must remove to get there and no further (layers
    already there, kept whole, or q/k/v projections: none). torch-pruning keeps
    int(width x (1 - r)) channels, rounded down to `round_to`: the count kept is rounded up to
    `round_to` here and r aims half a channel above it (1 - 0.9 is 0.0999..., and int() alone
    would drop one channel more)."""
    skip = set(ignored) | {n for projs, _ in thin.attention(model).values() for n in projs}
    now = widths(model)
    out = {}
    for name, frac in targets.items():
        if frac <= 0 or name in skip or name not in widths0 or now.get(name, 0) <= 0:
            continue
        keep = math.ceil((1 - frac) * widths0[name] - 1e-9)
        if round_to:
            keep = math.ceil(keep / round_to) * round_to
        if now[name] > keep:
            out[name] = 1 - (keep + 0.5) / now[name]
    return out


def _cost(model: nn.Module, one: torch.Tensor, fit: LatencyFit | None) -> tuple[int, float]:
    """MACs of the cut model and, given a latency fit, its estimated batch-1 time (us). Its
    forward must still run: a model that reshapes by a width fixed in its code (attention
    heads as `view(b, n, heads, 64)`) breaks when that width is cut, and the user must keep
    those layers whole."""
    try:
        per = module_macs(model, one)
    except Exception as e:
        detail = one_line(e, 160)
        raise InputError(
            f"channels: after cutting channels the model no longer runs ({type(e).__name__}: "
            f"{detail}); its forward likely uses a fixed width (e.g. attention heads): keep "
            "those layers whole with channels.ignore = ['name', ...]"
        ) from None
    return sum(per.values()), fit.estimate(per) if fit else 0.0


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
