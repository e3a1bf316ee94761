"""The smallest archive within an accuracy budget: `compress shrink --max-drop P`.

Deep Compression (Han, Mao & Dally, ICLR 2016) leaves each layer's sparsity and bit width to
the user; the paper's own were found by hand from per-layer sensitivity curves (Han et al.,
NIPS 2015, section 4). This module makes that search a function of one number: the points of
validation accuracy the user will give up.

1. Curves. Each layer alone is pruned to each sparsity of a grid and k-means quantized to each
   bit width (no retraining). Per setting: the validation samples it loses, how far its
   outputs move from the dense model's (mean KL divergence of the softmax outputs), and the
   bytes its archive record would take (shared or dense, whichever is smaller: the choice the
   archive makes).
2. Allocation. Choosing one option per layer to minimise total bytes with the summed costs
   within a budget is a multiple-choice knapsack; on whole-number costs a dynamic programme
   solves it exactly (`allocate`), where a greedy or Lagrangian pass (bytes saved per point
   lost) reaches only the convex hull's corners. One pass gives the optimum at every budget
   (`frontier`): allocations from the cautious to the aggressive, each smaller than the last.
   The cost is the KL divergence, in 2^16 steps of the curves' range, not the samples lost:
   most settings lose no sample alone (400 of 800 on LeNet-300-100) yet lose several
   together, and the divergence tells them apart where a count of samples cannot.
3. Verification. The curves model no retraining, and retraining recovers much of what they
   predict lost, so the budget the curves are given is not the user's: full shrink runs
   (pruning rounds with retraining, sharing, fine-tuning) are tried along the frontier,
   bisecting on archive bytes, each measured on the validation split; the smallest archive
   within the budget is kept. Within means top-1 accuracy within it, as asked, and the mean
   probability of the right class too: top-1 on a few hundred samples lets a trial through by
   luck, and a search that keeps the smallest survivor finds that luck (measured in `search`).
   The report gives, per trial, the predicted (curves) and the measured (retrained) drop.

The other search, `budget.search = "scale"` (the default under soft weight-sharing, whose
prior prunes and shares on its own, which the curves' k-means cannot price), has no curves: it
multiplies every layer's kept fraction of the recipe's own sparsities by SCALE_STEP**k and
bisects k on the same verdicts, from k = 0 (the recipe as written) toward the smallest archive
within the budget (`next_step`).

The test split is never looked at: it is reported once, for the model that was chosen.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from compresskit import _datapass, _mem
from compresskit.compressor import kmeans, prune, resume, stats
from compresskit.compressor import recipe as recipe_mod
from compresskit.compressor import shrink as shrink_mod
from compresskit.compressor.recipe import Recipe
from compresskit.models.errors import InputError

MIN_VAL_SAMPLES = 100  # fewer: one validation sample is more than a point of accuracy
SAMPLE = 1 << 15  # kept weights a curve's k-means is fitted on (all are then assigned)
COST_STEPS = 1 << 16  # the dynamic programme's width: the curves' summed worst KL in steps


# --- pure maths -----------------------------------------------------------------------------


def allowed_loss(max_drop: float, n_val: int) -> int:
    """Validation samples that may be lost within `max_drop` points (rounded down)."""
    return math.floor(max_drop * n_val / 100 + 1e-9)


COARSE_SAMPLES = 2  # a budget of this many validation samples or fewer: verdicts are coarse
RESOLVING_SAMPLES = 5  # what the coarseness note asks for: a budget of this many samples


def coarseness(max_drop: float, n_val: int) -> str | None:
    """A note when the validation split decides the budget by one or two samples (None
    otherwise). Each trial's verdict then turns on a sample or two, and every verdict shares
    the dense model's own luck on those samples, so the kept size varies from run to run: on
    MNIST LeNet-300-100 (800 samples, --max-drop 0.2) seeds kept 7x to 106x (docs/benchmarks.md)."""
    allowed = allowed_loss(max_drop, n_val)
    if max_drop <= 0 or allowed > COARSE_SAMPLES:
        return None
    need = math.ceil(RESOLVING_SAMPLES * 100 / max_drop)
    return (
        f"--max-drop {max_drop:g} allows {allowed} of {n_val:,} validation samples: a sample or "
        "two decides each trial, so the size kept varies from run to run; "
        f"{need:,} or more validation samples (an npz with x_val/y_val, or input_ids_val) resolve "
        f"{RESOLVING_SAMPLES} samples"
    )


def method_note(method: str) -> str | None:
    """A note when the layer search's trials share weights by a method its curves do not model
    (None for k-means; the scale search has no curves). Soft weight-sharing's zero component
    prunes on its own: on MNIST LeNet-300-100 trials that asked for no pruning kept 20.6% of
    fc1 all the same, and the archive sizes did not follow the frontier the bisection walks
    (docs/benchmarks.md)."""
    if method != "soft":
        return None
    return (
        'quantize.method = "soft": the search prices settings with k-means, but soft '
        "weight-sharing prunes by its own zero component, so trials' sizes need not follow "
        'the frontier; budget.search = "scale" (the default under soft sharing) scales the '
        "recipe's own sparsities instead"
    )


def check_validation(max_drop: float, n_val: int, where: str) -> None:
    """Refuse a validation split too small to tell `max_drop` points apart from nothing."""
    if n_val < MIN_VAL_SAMPLES:
        raise InputError(
            f"--max-drop / budget.max_drop needs at least {MIN_VAL_SAMPLES} validation samples; "
            f"{where} has "
            f"{n_val} (an npz's own x_val/y_val, else every 10th training sample held out): give "
            f"{MIN_VAL_SAMPLES} or more in x_val/y_val (or input_ids_val), or "
            f"{10 * MIN_VAL_SAMPLES} or more training samples without them"
        )
    if max_drop > 0 and allowed_loss(max_drop, n_val) < 1:
        need = math.ceil(100 / max_drop)
        raise InputError(
            f"--max-drop / budget.max_drop {max_drop:g} allows less than one of the {n_val} "
            f"validation samples of {where}: it needs {need} validation samples, or a max_drop "
            f"of {math.ceil(10_000 / n_val) / 100:.2f} or more (or 0: lose none)"
        )


def _table(sizes: list[list[int]], costs: list[list[int]], limit: int):
    """f[c]: fewest bytes with summed cost <= c, for c = 0..limit; and per layer, the option
    that reaches it (-1: none)."""
    f = np.zeros(limit + 1)
    picks = np.empty((len(sizes), limit + 1), dtype=np.int32)
    for i, (size, cost) in enumerate(zip(sizes, costs, strict=True)):
        g = np.full(limit + 1, np.inf)
        pick = np.full(limit + 1, -1, dtype=np.int32)
        for k, (s, c) in enumerate(zip(size, cost, strict=True)):
            if c > limit:
                continue
            cand = np.full(limit + 1, np.inf)
            cand[c:] = f[: limit + 1 - c] + s
            better = cand < g  # strict: among equal totals the earlier option stays
            g[better] = cand[better]
            pick[better] = k
        f, picks[i] = g, pick
    return f, picks


def _back(picks: np.ndarray, costs: list[list[int]], budget: int) -> list[int]:
    out = []
    for i in range(len(costs) - 1, -1, -1):
        k = int(picks[i, budget])
        out.append(k)
        budget -= costs[i][k]
    return out[::-1]


def _check(sizes: list[list[int]], costs: list[list[int]]) -> None:
    if len(sizes) != len(costs) or any(
        len(s) != len(c) or not s for s, c in zip(sizes, costs, strict=True)
    ):
        raise ValueError("every layer needs one cost per size, and at least one option")
    if any(c < 0 for cost in costs for c in cost):
        raise ValueError("costs are samples lost: 0 or more")


def allocate(sizes: list[list[int]], costs: list[list[int]], budget: int) -> list[int] | None:
    """One option per layer (its index) with the fewest total bytes whose summed cost is at
    most `budget`; None when even the cheapest options exceed it. Costs are whole numbers."""
    _check(sizes, costs)
    if budget < 0:
        return None
    f, picks = _table(sizes, costs, budget)
    return None if not np.isfinite(f[budget]) else _back(picks, costs, budget)


@dataclass(frozen=True)
class Point:
    """One allocation on the frontier: its summed cost, total bytes and option per layer."""

    cost: int
    bytes: int
    picks: tuple[int, ...]


def frontier(sizes: list[list[int]], costs: list[list[int]]) -> list[Point]:
    """Every budget's optimal allocation, from the least cost to the fewest bytes: each point
    is `allocate` at its own cost, and strictly smaller than the point before it."""
    _check(sizes, costs)
    limit = sum(max(c) for c in costs)
    f, picks = _table(sizes, costs, limit)
    finite = np.isfinite(f)
    first = int(np.argmax(finite))  # the least cost any allocation has
    steps = np.flatnonzero(finite[1:] & (f[1:] < f[:-1])) + 1
    out: list[Point] = []
    for b in [first, *steps[steps > first].tolist()]:
        chosen = _back(picks, costs, b)
        cost = sum(costs[i][k] for i, k in enumerate(chosen))
        out.append(Point(cost, int(f[b]), tuple(chosen)))
    return out


def next_trial(front: list[Point], passed: int | None, failed: int | None) -> int | None:
    """The frontier point to try next, bisecting on log-bytes between the most aggressive point
    that passed (the most cautious point when none has) and the most cautious that failed (the
    most aggressive point when none has); None when no untried point lies between them."""
    lo = passed if passed is not None else -1
    hi = failed if failed is not None else len(front)
    pool = range(lo + 1, hi)
    if not pool:
        return None
    top = front[passed].bytes if passed is not None else front[0].bytes
    bottom = front[failed].bytes if failed is not None else front[-1].bytes
    target = math.sqrt(top * bottom)
    return min(pool, key=lambda i: (abs(math.log(front[i].bytes / target)), i))


SCALE_STEP = 0.7  # one step of the scale search: every layer's kept fraction times this
SCALE_RESOLUTION = 0.25  # steps: bisection stops once a pass and a fail are this close
SCALE_CAUTIOUS = -3  # the most cautious step: kept fractions 0.7**-3 = 2.9x the recipe's
SCALE_AGGRESSIVE = 12  # the most aggressive: kept fractions 0.7**12 = 1.4% of the recipe's


def _scaled_one(s: float, f: float) -> float:
    if s == 0:
        return 0.0  # a layer the recipe leaves unpruned stays so
    return round(min(max(1 - (1 - s) * f, 0.0), 0.9999), 4)


def scaled(sparsity: dict[str, float] | float, k: float) -> dict[str, float] | float:
    """The sparsity (one number, or per layer) with its kept fraction times SCALE_STEP**k,
    within 0 and 0.9999; a 0 stays 0."""
    f = SCALE_STEP**k
    if isinstance(sparsity, dict):
        return {n: _scaled_one(s, f) for n, s in sparsity.items()}
    return _scaled_one(sparsity, f)


def next_step(passed: float | None, failed: float | None) -> float | None:
    """The scale search's next step: from 0 (the recipe as written) one step further than the
    most aggressive pass while none has failed, one step back from the most cautious fail
    while none has passed, then halving the gap between them; None when the gap is within
    SCALE_RESOLUTION or the step would leave [SCALE_CAUTIOUS, SCALE_AGGRESSIVE]. `failed` is
    the most cautious fail above `passed` (fails below a pass are noise the search ignores)."""
    if passed is None and failed is None:
        return 0.0
    if failed is None:
        k = passed + 1
        return k if k <= SCALE_AGGRESSIVE else None
    if passed is None:
        k = failed - 1
        return k if k >= SCALE_CAUTIOUS else None
    if failed - passed <= SCALE_RESOLUTION:
        return None
    return (passed + failed) / 2


def edges(verdicts: list[tuple[float, bool]]) -> tuple[float | None, float | None]:
    """(passed, failed) for `next_step` from (step, within budget) verdicts: the most
    aggressive pass, and the most cautious fail beyond it (a fail at or below a pass is the
    validation split's noise, and a pass beyond a fail moves the edge past it)."""
    passes = [k for k, ok in verdicts if ok]
    passed = max(passes) if passes else None
    fails = [k for k, ok in verdicts if not ok and (passed is None or k > passed)]
    return passed, (min(fails) if fails else None)


def base_sparsity(
    model: nn.Module, recipe: Recipe, example: torch.Tensor | None = None
) -> dict[str, float] | float:
    """The sparsity the scale search scales: the recipe's prune.sparsity, "default" resolved on
    `model` by layer role; a number stays one (prune.scope "global" needs one), a table as
    given (the layers it leaves out stay unpruned)."""
    p = recipe.prune
    if p.sparsity == "default":
        return shrink_mod.default_sparsity(model, p.embeddings, example)
    if isinstance(p.sparsity, dict):
        return {k: float(v) for k, v in p.sparsity.items()}
    return float(p.sparsity)


# --- config ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class BudgetConfig:
    """max_drop   points of validation accuracy the result may lose against the dense model
    trials      full shrink runs (with retraining) the search tries
    search      "layers": along the curves' frontier; "scale": one factor on the recipe's
                sparsities (module docstring)
    sparsities  per-layer sparsities the layer search's curves measure (0: not pruned)
    bits        per-layer bit widths the layer search's curves measure"""

    max_drop: float
    trials: int = 6
    search: str = "layers"  # "layers" (per-layer curves) | "scale" (one factor, bisected)
    sparsities: tuple[float, ...] = (0.0, 0.5, 0.7, 0.8, 0.9, 0.93, 0.95, 0.97, 0.98)
    bits: tuple[int, ...] = (2, 3, 4, 5, 6, 8)

    @classmethod
    def from_recipe(cls, b: Any, method: str = "kmeans") -> BudgetConfig:
        """From the recipe's [budget] section (compressor.recipe.BudgetSection), its search
        "auto" resolved by `method` (quantize.method)."""
        return cls(
            max_drop=float(b.max_drop),
            trials=b.trials,
            search=recipe_mod.budget_search(b.search, method),
            sparsities=tuple(sorted(set(b.sparsities))),
            bits=tuple(sorted(set(b.bits))),
        )


@dataclass(frozen=True)
class Option:
    """One setting of one layer, measured alone: validation samples lost (negative: gained),
    mean KL divergence from the dense model's outputs (nats), and record bytes."""

    sparsity: float
    bits: int
    lost: int
    kl: float
    bytes: int


def settings(model: nn.Module, recipe: Recipe, cfg: BudgetConfig):
    """Per shared layer, the (sparsity, bits) pairs to measure: the grid, except where the
    recipe fixes a layer's sparsity (prune.sparsity = {layer = s}) or bits (quantize.bits)."""
    p, q = recipe.prune, recipe.quantize
    prunable = prune.weight_layers(model, p.embeddings) if p.enabled else {}
    given = p.sparsity if isinstance(p.sparsity, dict) else {}
    fixed_s = {(k if k in prunable else prune.layer_name(k)): v for k, v in given.items()}
    out = {}
    for name, layer in kmeans.layers(model, q.embeddings).items():
        if name not in prunable:
            ss: tuple[float, ...] = (0.0,)
        elif name in fixed_s:
            ss = (float(fixed_s[name]),)
        else:
            ss = cfg.sparsities
        bs = (q.bits[name],) if name in q.bits else cfg.bits
        out[name] = (layer, [(s, b) for s in ss for b in bs])
    if out and all(len(v[1]) == 1 for v in out.values()):
        raise InputError(
            "--max-drop / budget.max_drop searches per-layer sparsity and bits, but prune.sparsity "
            "and quantize.bits fix both for every layer; drop budget.max_drop, or leave some "
            "layers to the search"
        )
    return out


# --- curves ---------------------------------------------------------------------------------


def _quantized(kept: torch.Tensor, k: int, seed: int) -> torch.Tensor:
    """`kept` replaced by its nearest of k k-means centroids, fitted on at most SAMPLE of them
    (a curve point estimates; the shrink run clusters every weight)."""
    w = kept.detach().double()
    fit = w
    if w.numel() > SAMPLE:
        g = torch.Generator().manual_seed(seed)
        fit = w[torch.randperm(w.numel(), generator=g)[:SAMPLE]]
    centroids, _ = kmeans.kmeans_1d(fit.numpy(), k, seed=seed, max_iter=50)
    c = torch.from_numpy(centroids).double()
    return c[kmeans.nearest(w, c)].to(kept.dtype)


@_datapass.counted
@torch.no_grad()
def outputs(model: nn.Module, x: torch.Tensor, batch: int | None = None) -> torch.Tensor:
    """The model's log-softmax outputs on `x` (eval mode, restored after); `batch` None: sized
    to the model's activations (`compresskit._mem.eval_batch`)."""
    batch = batch or _mem.eval_batch(model, x[:2])
    was = model.training
    model.eval()
    try:
        parts = [model(x[i : i + batch]).float().log_softmax(-1) for i in range(0, len(x), batch)]
    finally:
        model.train(was)
    return torch.cat(parts)


def divergence(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Mean KL(ref || got) over samples, both log-probabilities."""
    return float((ref.exp() * (ref - got)).sum(-1).mean().clamp_min(0))


def measure(
    model: nn.Module,
    grid: dict[str, tuple[prune.Layer, list[tuple[float, int]]]],
    val: tuple[torch.Tensor, torch.Tensor],
    record_bytes: Callable[[prune.Layer, torch.Tensor], int],
    seed: int = 0,
    info: Callable[[str], None] = lambda message: None,
) -> dict[str, list[Option]]:
    """Each layer alone set to each of its (sparsity, bits), on `model` (restored after):
    validation samples lost and KL divergence against the model as given, record bytes."""
    x, y = val
    ref = outputs(model, x)
    base = int((ref.argmax(-1) == y).sum())
    out: dict[str, list[Option]] = {}
    for n, (name, (layer, pairs)) in enumerate(grid.items(), 1):
        target = prune._raw(model, layer.key)
        original = target.detach().clone()
        options = []
        try:
            for s in dict.fromkeys(s for s, _ in pairs):
                mask = prune.magnitude_mask(original, s)
                kept = original[mask]
                for b in [b for s2, b in pairs if s2 == s]:
                    k = 2**b if bool(mask.all()) else 2**b - 1  # as kmeans.share_weights_
                    w = torch.zeros_like(original)
                    w[mask] = _quantized(kept, k, seed)
                    with torch.no_grad():
                        target.copy_(w)
                    got = outputs(model, x)
                    lost = base - int((got.argmax(-1) == y).sum())
                    kl = divergence(ref, got)
                    options.append(Option(s, b, lost, kl, record_bytes(layer, w)))
        finally:
            with torch.no_grad():
                target.copy_(original)
        out[name] = options
        info(f"budget: curves {n}/{len(grid)}, {name}: {len(options)} settings measured")
    return out


# --- the search -----------------------------------------------------------------------------


def trial_recipe(recipe: Recipe, chosen: dict[str, Option], prunable: set[str]) -> Recipe:
    """The recipe a trial runs: the chosen per-layer sparsities (of the layers pruning may
    touch; entries the recipe gave, such as a bias's, kept) and bits, no search."""
    p = recipe.prune
    if p.enabled:
        given = p.sparsity if isinstance(p.sparsity, dict) else {}
        sparsity = {**given, **{n: o.sparsity for n, o in chosen.items() if n in prunable}}
        p = dataclasses.replace(p, sparsity=sparsity, quality=None)
    return recipe.replace(
        prune=p,
        quantize=dataclasses.replace(recipe.quantize, bits={n: o.bits for n, o in chosen.items()}),
        budget=dataclasses.replace(recipe.budget, max_drop="off"),
    )


@dataclass(frozen=True)
class Plan:
    """The curves and their frontier: what each frontier point sets per layer, and what the
    curves predict of it."""

    options: dict[str, list[Option]]
    front: list[Point]

    @classmethod
    def of(cls, options: dict[str, list[Option]]) -> Plan:
        sizes = [[o.bytes for o in opts] for opts in options.values()]
        # The cost is the KL divergence in COST_STEPS steps of the curves' summed worst.
        worst = sum(max(o.kl for o in opts) for opts in options.values())
        unit = worst / COST_STEPS if worst > 0 else 1.0
        costs = [[math.ceil(o.kl / unit) for o in opts] for opts in options.values()]
        return cls(options, frontier(sizes, costs))

    def chosen(self, i: int) -> dict[str, Option]:
        return {
            n: opts[k]
            for (n, opts), k in zip(self.options.items(), self.front[i].picks, strict=True)
        }

    def predicted_lost(self, i: int) -> int:
        """Samples the curves say point i loses before retraining: the layers' sum (a layer
        that gains alone counts as losing none)."""
        return sum(max(o.lost, 0) for o in self.chosen(i).values())


class Judge:
    """A trial's verdict on the validation split against the dense model.

    Within the budget: top-1 accuracy, as asked, and the mean probability of the right class
    too. Top-1 on a few hundred samples lets a trial through by luck, and the search keeps the
    smallest that got through: on MNIST LeNet-300-100 (800 validation samples) two kept trials
    lost 0.00 and 0.13 points of validation top-1 but 1.75 and 1.05 on the test split; their
    mean probability of the right class had dropped 0.58 and 0.42 points on validation (1.71
    and 1.09 on test)."""

    def __init__(self, dense: nn.Module, val: tuple[torch.Tensor, torch.Tensor], max_drop: float):
        self.x, self.y = val
        self.max_drop = max_drop
        self.n = len(self.y)
        self.allowed = allowed_loss(max_drop, self.n)
        self.right, self.soft = self._look(dense)
        self.correct = int(self.right.sum())

    def _look(self, m: nn.Module) -> tuple[np.ndarray, float]:
        logp = outputs(m, self.x)
        p_right = logp.exp().gather(1, self.y.view(-1, 1)).mean()
        return (logp.argmax(-1) == self.y).numpy(), 100 * float(p_right)

    def __call__(self, m: nn.Module) -> dict[str, Any]:
        right, soft = self._look(m)
        lost = self.correct - int(right.sum())
        soft_drop = self.soft - soft
        # The drop's paired interval: at a few hundred samples a budget of 0.2 points often
        # lies inside the noise of retraining itself, and the user should see so.
        change = stats.paired_accuracy_change(self.right, right)
        return {
            "lost": lost,
            "val_drop": _points(lost, self.n),
            "val_drop_interval": [-change["ci_points"][1], -change["ci_points"][0]],
            "val_gained_lost": [change["gained"], change["lost"]],
            "val_soft_drop": soft_drop,
            "within_budget": lost <= self.allowed and soft_drop <= self.max_drop,
        }


def check(model: nn.Module, recipe: Recipe) -> None:
    """Refuse, before any work, a budget the search cannot run on `model` (InputError)."""
    cfg = BudgetConfig.from_recipe(recipe.budget, recipe.quantize.method)
    shrink_mod.check_fits_recipe(model, recipe)
    if cfg.search == "layers":
        settings(model, recipe, cfg)


class _Trials:
    """Full shrink runs judged on the validation split, one kept at a time: the smallest
    within the budget so far (`_best`), its model, report and folder; the rest deleted.

    With `marks`, each finished trial is kept (`compressor.resume`): a resumed search replays
    the kept trials whose recipes it asks for again, in order, without running them."""

    def __init__(
        self, model, spec, hooks, out_dir, metadata, archive_name, judge, trials, marks=None
    ):
        self.model, self.spec, self.hooks, self.out_dir = model, spec, hooks, out_dir
        self.metadata, self.archive_name, self.judge = metadata, archive_name, judge
        self.limit = trials
        self.records: list[dict[str, Any]] = []
        self.kept: dict[int, tuple[nn.Module | None, dict[str, Any], Path]] = {}
        self.marks = marks
        self.cached = resume.read_trials(marks) if marks is not None else None
        if self.cached and self.cached.best != _best([e["record"] for e in self.cached.trials]):
            raise resume.unfit(marks, "trials", ValueError("its kept model is not its best"))
        self.done: list[dict[str, Any]] = []  # each trial as a mark keeps it

    def tell(self, message: str, t: int | None = None) -> None:
        """A progress line for trial `t` (None: the next one)."""
        t = t or len(self.records) + 1
        self.hooks.info(f"budget trial {t}/{self.limit}: {message}")

    def run(self, recipe: Recipe, fields: dict[str, Any]) -> bool:
        """Shrink a copy of the model by `recipe`; record `fields` and the verdict; True when
        within the budget."""
        t = len(self.records) + 1
        d = self.out_dir / f".trial-{t}"
        d.mkdir()
        replayed = self._replay(t, recipe, d)
        if replayed is not None:
            m, rep, record = replayed
            self.records.append(record)
        else:
            m = copy.deepcopy(self.model)
            hooks = dataclasses.replace(self.hooks, info=lambda message: self.tell(message, t))
            rep = shrink_mod.shrink(
                m, self.spec, recipe, hooks, d, self.metadata, self.archive_name
            )
            verdict = self.judge(m)
            self.records.append(
                {"trial": t, **fields, "archive_bytes": rep["archive"]["bytes"], **verdict}
            )
        verdict = self.records[-1]
        ok = verdict["within_budget"]
        self.tell(
            f"archive {rep['archive']['bytes']:,} bytes, validation drop "
            f"{verdict['val_drop']:+.2f} points (mean probability of the right class "
            f"{verdict['val_soft_drop']:+.2f}): {'within' if ok else 'over'} the budget"
            + (" (kept by the stopped run)" if replayed is not None else ""),
            t,
        )
        self.kept[t] = (m, rep, d)
        best = _best(self.records)
        for other in [k for k in self.kept if k != best]:  # one model and archive at a time
            shutil.rmtree(self.kept.pop(other)[2], ignore_errors=True)
        if replayed is None:
            self._keep(t, recipe, rep)
        return ok

    def _replay(self, t: int, recipe: Recipe, d: Path):
        """Trial `t` as a stopped run kept it, when its recipe is the one asked for now:
        (its model, or None where a later kept trial beat it; its report; its record)."""
        if not self.cached or t > len(self.cached.trials):
            return None
        entry = self.cached.trials[t - 1]
        if entry["recipe"] != resume.recipe_digest(recipe):
            # The search went another way (a search is deterministic given its trials, so
            # only another version of it does): nothing from here on is the kept run's.
            if self.records and self.kept[_best(self.records)][0] is None:
                raise InputError(
                    f"{self.marks.folder}: its --max-drop trials are not this search's; remove "
                    "it or run without --resume"
                )
            self.cached = None
            return None
        m = None
        if t == self.cached.best:  # the kept model: later trials are judged against it
            m = copy.deepcopy(self.model)
            resume.restore_trial_(m, self.cached, self.marks, d / self.archive_name)
        try:
            resume.set_generators(entry["generators"])
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise resume.unfit(self.marks, "trials", e) from None
        self.marks.claim(f"budget trial {t} of at most {self.limit}", entry["trained"])
        self.done.append(entry)
        return m, resume.no_seconds_(entry["report"]), entry["record"]

    def _keep(self, t: int, recipe: Recipe, rep: dict[str, Any]) -> None:
        """Keep every trial so far, and the best one's model and archive, as one mark."""
        if self.marks is None:
            return
        self.done.append(
            {
                "recipe": resume.recipe_digest(recipe),
                "report": rep,
                "record": self.records[-1],
                "trained": self.marks.trained(self.hooks.training()),
                "generators": resume.generators(),
            }
        )
        best = _best(self.records)
        m, _, d = self.kept[best]
        self.marks.save(
            "trials",
            f"budget trial {t} of at most {self.limit}",
            resume.trials_payload(self.done, best, m, d / self.archive_name),
            self.hooks.training(),
        )

    def result(self) -> tuple[nn.Module, dict[str, Any], dict[str, Any]]:
        """The kept trial's model and report (its archive moved into `out_dir`), and its record."""
        won = self.records[_best(self.records) - 1]
        m, rep, d = self.kept[won["trial"]]
        (d / self.archive_name).replace(self.out_dir / self.archive_name)
        shutil.rmtree(d, ignore_errors=True)
        rep["archive"]["path"] = self.archive_name  # a name in the output folder
        return m, rep, won


def search(
    model: nn.Module,
    spec: dict[str, Any],
    recipe: Recipe,
    hooks: shrink_mod.Hooks,
    out_dir: Path,
    metadata: dict[str, Any] | None = None,
    archive_name: str = "model.dcz",
    marks: resume.Marks | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """Shrink `model` to the smallest archive found within `budget.max_drop`: returns the
    chosen trial's model and report (its `recipe` the one to re-run without a search, and a
    `budget` record of the search and every trial), its archive in `out_dir`. With `marks`,
    each finished trial is kept and a resumed search replays them (`compressor.resume`)."""
    cfg = BudgetConfig.from_recipe(recipe.budget, recipe.quantize.method)
    if hooks.val_data is None:
        raise InputError("--max-drop needs a validation split (Hooks.val_data)")
    check_validation(cfg.max_drop, len(hooks.val_data[1]), "the data")
    check(model, recipe)
    judge = Judge(model, hooks.val_data, cfg.max_drop)
    trials = _Trials(model, spec, hooks, out_dir, metadata, archive_name, judge, cfg.trials, marks)
    if cfg.search == "scale":
        record = _search_scale(model, recipe, cfg, trials)
    else:
        record = _search_layers(model, recipe, cfg, trials)
    m, rep, won = trials.result()
    rep["budget"] = {**_common(cfg, judge, trials.records, won, recipe), **record(won)}
    return m, rep


def _search_layers(model: nn.Module, recipe: Recipe, cfg: BudgetConfig, trials: _Trials):
    """Bisect the curves' frontier (module docstring, 1-3); returns the record's maker."""
    hooks, judge = trials.hooks, trials.judge
    p = recipe.prune
    prunable = set(prune.weight_layers(model, p.embeddings)) if p.enabled else set()
    note = method_note(recipe.quantize.method)
    if note:  # said again in the record; here before the trials' minutes
        hooks.info(f"budget: {note}")
    plan = Plan.of(
        measure(
            model,
            settings(model, recipe, cfg),
            hooks.val_data,
            lambda layer, w: shrink_mod.record_bytes(layer, w, recipe),
            seed=recipe.train.seed,
            info=hooks.info,
        )
    )
    front = plan.front
    hooks.info(
        f"budget: {len(front)} allocations on the frontier, {front[0].bytes:,} to "
        f"{front[-1].bytes:,} bytes of weights; {judge.allowed} of {judge.n} validation "
        "samples may go"
    )
    # Start where the curves alone say the budget holds: retraining only recovers from there.
    i: int | None = max(
        (i for i in range(len(front)) if plan.predicted_lost(i) <= judge.allowed), default=0
    )
    passed = failed = None
    tried: set[int] = set()
    while i is not None and len(trials.records) < cfg.trials:
        predicted = plan.predicted_lost(i)
        trials.tell(
            f"curves predict {front[i].bytes:,} bytes of weights, "
            f"{_points(predicted, judge.n):.2f} points lost before retraining"
        )
        ok = trials.run(
            trial_recipe(recipe, plan.chosen(i), prunable),
            {
                "frontier_point": i,
                "settings": {n: [o.sparsity, o.bits] for n, o in plan.chosen(i).items()},
                "predicted_lost": predicted,
                "predicted_drop": _points(predicted, judge.n),
                "predicted_kl": sum(o.kl for o in plan.chosen(i).values()),
                "predicted_weight_bytes": front[i].bytes,
            },
        )
        tried.add(i)
        if ok:
            passed = i if passed is None or i > passed else passed
        else:
            failed = i if failed is None or i < failed else failed
        i = next_trial(front, passed, failed)
        if i in tried:
            i = None

    def record(won: dict[str, Any]) -> dict[str, Any]:
        return {
            "predicted_drop": won["predicted_drop"],
            "method_note": note,
            "frontier_points": len(front),
            "grid": {"sparsities": list(cfg.sparsities), "bits": list(cfg.bits)},
            "layers": {
                n: {
                    "sparsity": o.sparsity,
                    "bits": o.bits,
                    "lost_alone": o.lost,
                    "kl_alone": o.kl,
                    "bytes": o.bytes,
                }
                for n, o in plan.chosen(won["frontier_point"]).items()
            },
            "curves": {
                n: [[o.sparsity, o.bits, o.lost, o.kl, o.bytes] for o in opts]
                for n, opts in plan.options.items()
            },
        }

    return record


def _search_scale(model: nn.Module, recipe: Recipe, cfg: BudgetConfig, trials: _Trials):
    """Bisect one factor on every layer's kept fraction (module docstring); returns the
    record's maker."""
    hooks, judge = trials.hooks, trials.judge
    example = shrink_mod.example_inputs(hooks)
    base = base_sparsity(model, recipe, example)
    layers = list(prune.weight_layers(model, recipe.prune.embeddings))

    def per_layer(sparsity: dict[str, float] | float) -> dict[str, float]:
        """One number as every prunable layer's (the layers prune.scope "global" covers)."""
        return sparsity if isinstance(sparsity, dict) else dict.fromkeys(layers, sparsity)

    hooks.info(
        f"budget: scaling the kept fractions of {len(per_layer(base))} layers' sparsities by "
        f"{SCALE_STEP:g}**k from k = 0 (the recipe's); {judge.allowed} of {judge.n} validation "
        "samples may go"
    )
    k = next_step(None, None)
    while k is not None and len(trials.records) < cfg.trials:
        sparsity = scaled(base, k)
        if any(t["sparsity"] == sparsity for t in trials.records):
            break  # a step tried, or clamped at 0 or 0.9999: the settings of a trial run
        shown = sparsity.items() if isinstance(sparsity, dict) else [("every layer", sparsity)]
        trials.tell(
            f"kept fractions x{SCALE_STEP**k:.3g} (k = {k:g}): "
            + ", ".join(f"{n} {s:g}" for n, s in shown)
        )
        trials.run(
            _scaled_recipe(recipe, sparsity),
            {"step": k, "scale": SCALE_STEP**k, "sparsity": sparsity},
        )
        k = next_step(*edges([(t["step"], t["within_budget"]) for t in trials.records]))
    rows = {
        row["layer"]: row for row in shrink_mod.plan(model, _scaled_recipe(recipe, base), example)
    }

    def record(won: dict[str, Any]) -> dict[str, Any]:
        kept = per_layer(won["sparsity"])
        return {
            "scale_step": SCALE_STEP,
            "layers": {
                n: {
                    "sparsity": s,
                    "bits": (rows.get(n) or rows.get(prune.layer_name(n)) or {}).get("bits"),
                }
                for n, s in kept.items()
            },
        }

    return record


def _scaled_recipe(recipe: Recipe, sparsity: dict[str, float] | float) -> Recipe:
    return recipe.replace(
        prune=dataclasses.replace(recipe.prune, sparsity=sparsity, quality=None),
        budget=dataclasses.replace(recipe.budget, max_drop="off"),
    )


def _common(cfg, judge: Judge, trials, won, recipe) -> dict[str, Any]:
    return {
        "search": cfg.search,
        "max_drop": cfg.max_drop,
        "validation_samples": judge.n,
        "allowed_lost": judge.allowed,
        "baseline_val_correct": judge.correct,
        "met": won["within_budget"],
        "chosen_trial": won["trial"],
        "val_drop": won["val_drop"],
        "val_drop_interval": won["val_drop_interval"],
        "val_soft_drop": won["val_soft_drop"],
        "coarse": coarseness(cfg.max_drop, judge.n),  # None, or the note renderers print
        "trials": trials,
        "asked_recipe": recipe.to_dict(),
    }


def _points(lost: int, n: int) -> float:
    return 100 * lost / n


def _best(trials: list[dict[str, Any]]) -> int:
    """The trial kept: the smallest archive within the budget; with none within it, the one
    whose mean probability of the right class dropped least (then top-1, then the smaller)."""
    ok = [t for t in trials if t["within_budget"]]
    if ok:
        return min(ok, key=lambda t: (t["archive_bytes"], t["trial"]))["trial"]
    return min(
        trials, key=lambda t: (t["val_soft_drop"], t["lost"], t["archive_bytes"], t["trial"])
    )["trial"]
