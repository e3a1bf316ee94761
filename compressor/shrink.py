"""The Deep Compression pipeline behind `compress shrink` (Han, Mao & Dally, ICLR 2016):
prune with retraining -> k-means weight sharing with centroid fine-tuning -> Huffman archive.

`shrink(model, spec, recipe, hooks, out_dir)` changes the model in place, writes the archive,
decodes it again and checks the decoded weights equal the model's bit for bit, and returns a
plain-data report (the paper's per-layer and per-stage tables, plus entropy bounds).

Training is injected through `Hooks` (the CLI passes `distrib.trainer.fit`), so this package
never imports `distrib`. Byte accounting follows the paper: ratios are against 4 bytes per
parameter of the dense FP32 model and include codebooks and index overhead; the P+Q+H figure is
the archive file itself, header and checksum included.

Each shared layer is stored in the archive the cheaper way, measured by encoding its record
both ways (the dense one only estimated where it is plainly the larger): shared (codebook,
coded positions and indices) or dense (`quantize.dense`, float16 by default). A layer of a
few dozen weights costs more in codebook and framing than its values; there, the
codebook is rounded to float16 in the model too, so the archive still decodes to exactly the
model that was measured, and the report says which and why.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from compresskit.compressor import (
    archive,
    distill,
    huffman,
    kmeans,
    prune,
    resume,
    softshare,
    stats,
)
from compresskit.compressor.recipe import (
    HuffmanSection,
    PruneSection,
    QuantizeSection,
    Recipe,
    budget_search,
)
from compresskit.models.data import shipped_spec
from compresskit.models.errors import InputError, StageError

GAP_BITS_SEARCH = range(1, 13)
_FP16_MAX = torch.finfo(torch.float16).max


@dataclass
class Hooks:
    """What the pipeline needs from the outside world."""

    # Train in place: (model, epochs, lr, loss_fn or None for cross-entropy, data or None for
    # the training set; distillation passes a transfer set). May return, per test sample,
    # whether the retrained model's top-1 is right (what `test_correct` would give, from the
    # loop's own last evaluation): the stage then skips a pass over the test set.
    retrain: Callable[..., torch.Tensor | None]
    test_accuracy: Callable[[nn.Module], float]
    val_accuracy: Callable[[nn.Module], float]  # the validation split (sensitivity analysis)
    info: Callable[[str], None] = lambda message: None
    # Per test sample, whether the model's top-1 is right: when given, each stage's accuracy
    # change carries its paired 95% interval (`stats.paired_accuracy_change`).
    test_correct: Callable[[nn.Module], torch.Tensor] | None = None
    # Samples one retraining epoch sees: soft weight-sharing weighs its prior against them.
    train_samples: int = 0
    # The validation split's (inputs, labels): what an accuracy budget (`compressor.budget`,
    # --max-drop) measures its curves and trials on.
    val_data: tuple[torch.Tensor, torch.Tensor] | None = None
    # What the retraining runs settled on, for the report: {"microbatches": [M, ...]}, the
    # slices per batch each distinct run took (recipe train.microbatches = "auto" measures),
    # and "bn_refreshed_runs", how many re-estimated BatchNorm statistics (train.bn_refresh).
    trained: Callable[[], dict[str, Any]] | None = None
    # Whether the caller allowed importing the code a checkpoint names ("pkg.module:Class"):
    # the recipe's extra distillation teachers are built only with it (a file never picks
    # the code that runs).
    trusts: Callable[[str], bool] = lambda name: False

    def training(self) -> dict[str, Any] | None:
        """What `trained` says so far, or None where no one records it."""
        return self.trained() if self.trained is not None else None


# LSTM/GRU/RNN matrices, like hidden fully connected ones: 90% pruned with retraining lost
# nothing in Narang et al. 2017 ("Exploring Sparsity in Recurrent Neural Networks") and in
# ESE (Han et al. 2017); a row-by-row MNIST LSTM (128 hidden) kept its 96.35% at 0.75 and 0.9.
RECURRENT_SPARSITY = 0.9


def call_order(model: nn.Module, example: torch.Tensor | None) -> list[str]:
    """The names of the modules `model`'s forward calls on `example` (two samples are
    enough), in the order it first calls them. Without an example, or when the forward
    raises, every module in registration order: the order `__init__` built them, which a
    model free to define its head first need not follow."""
    names = [n for n, _ in model.named_modules()]
    if example is None:
        return names
    called: dict[str, None] = {}
    handles = [
        m.register_forward_pre_hook(lambda _m, _a, n=n: called.setdefault(n))
        for n, m in model.named_modules()
    ]
    flags = {m: m.training for m in model.modules()}
    try:
        model.eval()  # BatchNorm statistics stay as they were
        with torch.no_grad():
            model(example)
    except Exception:  # the model's own code; check_fits reports a forward that fails
        return names
    finally:
        for h in handles:
            h.remove()
        for m, training in flags.items():
            m.training = training
    return list(called)


def default_sparsity(
    model: nn.Module, embeddings: bool = False, example: torch.Tensor | None = None
) -> dict[str, float]:
    """Per-layer fraction to prune, by the layer's role, after the paper's LeNet tables
    (LeNet-300-100 kept 8/9/26%, LeNet-5 66/12/8/19%): first conv 0.35, other convs 0.85,
    depthwise convs 0.5, hidden fully connected 0.92, output layer 0.75. Attention projections
    (MultiheadAttention's q/k/v and out_proj) and embeddings 0.5: magnitude pruning of BERT
    lost nothing at 30-40% and degraded it beyond (Gordon et al. 2020), far from the 90% a
    LeNet layer takes. LSTM/GRU/RNN matrices 0.9 (`RECURRENT_SPARSITY`).

    "First" and "output" are in the order the forward calls the layers on `example` (inputs
    of the model, a couple of samples), else in registration order (`call_order`): a model
    that registered its head before its body had its head pruned as a hidden layer. The first
    conv is the first conv the forward runs, whatever its input channels (before, any conv of
    at most 3 input channels counted, and a first Conv1d over 8 features lost 85%). A layer
    the forward never calls takes a hidden layer's fraction."""
    out = {}
    found = kmeans.layers(model, embeddings)
    rank = {n: i for i, n in enumerate(call_order(model, example))}
    # Layers the forward never calls take the hidden layers' fractions.
    ordered = sorted(
        (n for n in found if found[n].module in rank), key=lambda n: rank[found[n].module]
    )
    # The output layer is the last Linear the forward calls, covered or not: with a tied head
    # (left dense) the hidden layer before it had taken the output's gentler 0.75.
    called = [m for m in rank if isinstance(model.get_submodule(m), nn.Linear)]
    output = called[-1] if called else None
    first = next((n for n in ordered if found[n].kind == "conv"), None)
    for name, layer in found.items():
        m = model.get_submodule(layer.module)
        if layer.kind == "linear":
            out[name] = 0.75 if layer.module == output else 0.92
        elif layer.kind == "recurrent":
            out[name] = RECURRENT_SPARSITY
        elif layer.kind in ("attention", "embedding") or (
            m.groups > 1 and m.groups == m.in_channels
        ):
            out[name] = 0.5  # attention, an embedding, or a depthwise conv
        else:
            out[name] = 0.35 if name == first else 0.85
    return out


def shrink(
    model: nn.Module,
    spec: dict[str, Any],
    recipe: Recipe,
    hooks: Hooks,
    out_dir: Path,
    metadata: dict[str, Any] | None = None,
    archive_name: str = "model.dcz",
    marks: resume.Marks | None = None,
) -> dict[str, Any]:
    """Run the recipe on `model` (in place); write `out_dir/archive_name`; return the report.
    With `marks`, each pruning round is kept, and a resumed run starts after the last kept
    one (`compressor.resume`)."""
    check_fits_recipe(model, recipe)
    t0 = time.perf_counter()
    params = sum(p.numel() for p in model.parameters())
    base_correct = hooks.test_correct(model) if hooks.test_correct else None
    baseline = {
        "bytes": 4 * params,
        "parameters": params,
        "test_accuracy": _accuracy(model, hooks, base_correct),
    }

    def _stage(
        name: str, started: float, m: nn.Module, correct: torch.Tensor | None = None, **extra: Any
    ) -> dict[str, Any]:
        # `correct`: the model's per-sample test hits when already known (its retraining's
        # last evaluation, or an identical model's), else measured here.
        nonlocal last_hits
        if correct is None and hooks.test_correct:
            correct = hooks.test_correct(m)
        last_hits = correct
        record = {
            "name": name,
            "seconds": time.perf_counter() - started,
            "test_accuracy": _accuracy(m, hooks, correct),
            **extra,
        }
        if correct is not None:
            record["change"] = stats.paired_accuracy_change(base_correct.numpy(), correct.numpy())
        return record

    last_hits: torch.Tensor | None = None  # the latest stage's per-sample test hits
    stages: list[dict[str, Any]] = []
    report: dict[str, Any] = {"baseline": baseline, "stages": stages, "recipe": recipe.to_dict()}
    hooks.info(
        f"baseline: {params:,} parameters, {baseline['bytes']:,} bytes, "
        f"test accuracy {baseline['test_accuracy']:.4f}"
    )

    t = recipe.train
    base_loss = _cross_entropy
    if t.distill > 0:  # retrain against the dense model's soft targets
        teacher = copy.deepcopy(model)
        base_loss = distill.loss_with_teacher(teacher, t.temperature, t.distill)
        retrain = hooks.retrain
        hooks = dataclasses.replace(
            hooks,
            retrain=lambda m, e, lr, fn=None, data=None: retrain(m, e, lr, fn or base_loss, data),
        )
    p = recipe.prune
    if p.enabled:
        ts = time.perf_counter()
        n_test = len(base_correct) if base_correct is not None else None
        report["sensitivity"], hits = _prune(model, p, hooks, marks, n_test)
        stages.append(_stage("prune", ts, model, hits))
    q = recipe.quantize
    # Records priced once: `prefer_dense_` prices every layer where `_entries` will again.
    prices: dict[bytes, Any] = {}
    if q.enabled:
        ts = time.perf_counter()
        report["histogram"] = _quantize(model, q, recipe.train.seed, hooks, base_loss)
        if recipe.huffman.enabled:
            prefer_dense_(model, recipe, prices)
        stages.append(_stage("quantize", ts, model))

    entries, layer_info = _entries(model, recipe, prices)
    # Named once the records are chosen: `prefer_dense_` rounds a codebook to float16 where
    # dense looked smaller, and the rounded codebook may then code smaller shared.
    encodings = [(i["layer"], i.get("encoding", "shared")) for i in layer_info.values()]
    if dense := [f"{layer} ({e.split()[-1]})" for layer, e in encodings if e != "shared"]:
        hooks.info(f"stored dense, smaller than shared: {', '.join(dense)}")
    _account(stages, entries, layer_info, baseline["bytes"], recipe)
    if recipe.huffman.enabled:
        ts = time.perf_counter()
        path = out_dir / archive_name
        meta = {**(metadata or {}), "test_accuracy": stages[-1]["test_accuracy"]}
        if "data" in meta:  # a shipped file names the data without the build machine's folders
            meta["data"] = shipped_spec(meta["data"])
        written = archive.write(path, entries, spec, meta, _format(recipe))
        decoded = archive.read(path)
        _check_bit_identical(model, decoded.state_dict)
        baked = prune.bake_(model)
        ratio = baseline["bytes"] / written.bytes
        # The decoded weights are the quantized model's, bit for bit (checked above), and
        # baking only drops the masks: its test hits are the quantize stage's.
        stages.append(_stage("huffman", ts, baked, last_hits, bytes=written.bytes, ratio=ratio))
        report["archive"] = _archive_report(path, written, baseline["bytes"])
        report["layers"] = _layer_rows(layer_info, written)
    else:
        prune.bake_(model)
        report["layers"] = _layer_rows(layer_info, None)
    report["seconds"] = time.perf_counter() - t0
    return report


def _accuracy(model: nn.Module, hooks: Hooks, correct: torch.Tensor | None) -> float:
    if correct is None:
        return hooks.test_accuracy(model)
    return int(correct.sum()) / len(correct)  # exact, as `evaluate` counts (not a float32 mean)


def example_inputs(hooks: Hooks) -> torch.Tensor | None:
    """Two validation inputs, for the order a forward calls the layers in (`call_order`)."""
    return hooks.val_data[0][:2] if hooks.val_data is not None else None


def plan(
    model: nn.Module, recipe: Recipe, example: torch.Tensor | None = None
) -> list[dict[str, Any]]:
    """What `recipe` will do to each of `model`'s layers, before any work (`--dry-run`): its
    weights, the fraction pruning will remove and the bits weight sharing will give it. A
    sparsity decided during the run ("auto", `prune.quality`, an accuracy budget) reads as how
    it will be decided. `example`: a couple of the model's inputs, which order the layers'
    roles in the default sparsity (`default_sparsity`), as the run will."""
    check_fits_recipe(model, recipe)
    p, q = recipe.prune, recipe.quantize
    search = (
        budget_search(recipe.budget.search, q.method) if recipe.budget.max_drop != "off" else ""
    )
    searched = search == "layers"  # sparsity and bits per layer; "scale": one factor
    found = kmeans.layers(model, p.embeddings or q.embeddings)
    if p.sparsity == "default":
        fractions: Any = default_sparsity(model, p.embeddings, example)
    else:
        fractions = p.sparsity
    qcfg = kmeans.QuantizeConfig(conv_bits=q.conv_bits, fc_bits=q.fc_bits, bits=dict(q.bits))
    rows = []
    for name, layer in found.items():
        weights = getattr(model.get_submodule(layer.module), layer.param)
        # In a layer search, a layer the recipe's table names keeps that setting (as
        # budget.settings measures it); the plan said "searched" for every layer.
        # (the user's table only: "default" resolves to a table the search replaces)
        fixed = isinstance(p.sparsity, dict) and (
            name in p.sparsity or prune.layer_name(name) in p.sparsity
        )
        if not p.enabled or (layer.kind == "embedding" and not p.embeddings):
            sparsity: Any = 0.0
        elif searched and not fixed:
            sparsity = "searched (max_drop)"
        elif p.quality is not None:
            sparsity = f"|w| < {p.quality:g} std"
        elif fractions == "auto":
            sparsity = "auto (sensitivity)"
        elif isinstance(fractions, dict):
            sparsity = fractions.get(name, fractions.get(prune.layer_name(name), 0.0))
        else:
            sparsity = fractions
        if search == "scale" and isinstance(sparsity, int | float) and sparsity > 0:
            sparsity = f"{sparsity:g}, kept fraction scaled (max_drop)"
        shared = q.enabled and (layer.kind != "embedding" or q.embeddings)
        rows.append(
            {
                "layer": name,
                "kind": layer.kind,
                "weights": int(weights.numel()),
                "sparsity": sparsity,
                "bits": (
                    ("searched" if searched and name not in q.bits else qcfg.bits_for(layer))
                    if shared
                    else None
                ),
            }
        )
    # What no layer above holds is stored dense: said here, before the run, not only in its
    # report (a BERT's 15.9M embedding weights, 38% of it, left the default at 5.7x)
    for u in prune.uncovered_weights(model, p.embeddings or q.embeddings):
        if u["type"] in ("Embedding", "EmbeddingBag"):
            what = f"an {u['type']}; prune.embeddings / quantize.embeddings = true include it"
        elif hasattr(nn, u["type"]):  # a torch layer compress does not prune (ConvTranspose3d)
            what = f"{_article(u['type'])} {u['type']}, not a layer compress prunes"
        else:  # the model's own nn.Parameter (a positional table, a class token)
            what = f"a bare nn.Parameter of {u['type']}, not a layer compress prunes"
        rows.append(
            {
                "layer": u["module"],
                "kind": "dense",
                "weights": u["weights"],
                "sparsity": f"stored dense (float16): {what}",
                "bits": None,
            }
        )
    return rows


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def check_fits_recipe(model: nn.Module, recipe: Recipe) -> None:
    """Refuse, before any work, a recipe that names layers the model lacks, or a model with
    nothing to compress."""
    p, q = recipe.prune, recipe.quantize
    every = kmeans.layers(model, embeddings=True)
    if (p.enabled or q.enabled) and not kmeans.layers(model, p.embeddings or q.embeddings):
        tied = prune.tied_weights(model)
        raise InputError(
            "the model has no prunable layers (Linear, Conv, ConvTranspose, LSTM/GRU/RNN or "
            "MultiheadAttention"
            + (f"; tied weights are kept dense: {', '.join(g[0] for g in tied)}" if tied else "")
            + "): nothing to compress"
        )
    if (p.enabled or q.enabled) and (
        foreign := prune.foreign_weights(model, p.embeddings or q.embeddings)
    ):
        names = ", ".join(f"{n} ({how})" for n, how in list(foreign.items())[:4])
        more = f" and {len(foreign) - 4} more" if len(foreign) > 4 else ""
        raise InputError(
            f"layers {names}{more} compute their weight from other parameters (weight norm or "
            "the like), which compress cannot prune or share; fold it as for inference "
            "(torch.nn.utils.parametrize.remove_parametrizations(layer, 'weight'), or "
            "torch.nn.utils.remove_weight_norm for the old hook) in a model built without it, "
            "and shrink that model (README: weight-normed layers)"
        )
    named = []
    if isinstance(p.sparsity, dict):
        named += [("prune", k if k in every else prune.layer_name(k)) for k in p.sparsity]
    named += [("quantize", k) for k in q.bits]
    tied = {prune.layer_name(k) for k in prune.tied_keys(model)}
    for section, layer in named:
        where = "prune.sparsity" if section == "prune" else "quantize.bits"
        found = kmeans.layers(model, getattr(recipe, section).embeddings)
        if layer in every and layer not in found:
            raise InputError(
                f"recipe {where} names layer {layer!r}, an embedding; set "
                f"{section}.embeddings = true to {section} embeddings"
            )
        if layer not in found and layer in tied:
            raise InputError(
                f"recipe {where} names layer {layer!r}, whose weight is tied to another "
                "layer's and so stays dense (pruning or sharing one layer would untie them); "
                f"drop it from {where}"
            )
        if layer not in found:
            module = dict(model.named_modules()).get(layer)
            what = (
                "which the model lacks"
                if module is None
                else f"a {type(module).__name__}, which is not pruned or shared (its "
                "weights stay dense)"
            )
            raise InputError(
                f"recipe {where} names layer {layer!r}, {what}; layers: {', '.join(found)}"
            )


# --- stages ---------------------------------------------------------------------------------


def _prune(
    model: nn.Module,
    p: PruneSection,
    hooks: Hooks,
    marks: resume.Marks | None = None,
    n_test: int | None = None,
) -> tuple[dict[str, Any] | None, torch.Tensor | None]:
    """Prune in rounds with retraining; returns the sensitivity record (sparsity "auto") and
    the pruned model's per-sample test hits when the last retraining measured them. With
    `marks`, each round is kept, and a resumed run starts after the last kept one
    (`compressor.resume`; the stage's seconds are then this run's, as every timing is)."""
    kept = marks.latest("prune") if marks is not None else None
    if kept is not None:
        kept = resume.read_pruned(kept, marks, p.rounds, p.sparsity == "auto", n_test)
    sens_record = kept.sensitivity if kept is not None else None
    sparsity = p.sparsity
    if sparsity == "default":
        sparsity = default_sparsity(model, p.embeddings, example_inputs(hooks))
    elif sparsity == "auto" and sens_record is not None:
        sparsity = {n: float(s) for n, s in sens_record["proposal"].items()}
        if unknown := sorted(set(sparsity) - set(prune.prunable(model))):
            why = ValueError(f"its sensitivity proposal names {unknown[0]}, not a layer here")
            raise resume.unfit(marks, "prune", why)
    elif sparsity == "auto":
        sens = prune.sensitivity(model, hooks.val_accuracy, p.budget, progress=_every(hooks.info))
        sens_record = sens.to_dict()
        sparsity = sens.proposal
        hooks.info(
            "sensitivity proposal: " + ", ".join(f"{n} {s:.2f}" for n, s in sparsity.items())
        )
    cfg = prune.PruneConfig(
        sparsity=sparsity if p.quality is None else None,
        quality=p.quality,
        scope=p.scope,
        rounds=p.rounds,
        include_bias=p.include_bias,
        embeddings=p.embeddings,
    )
    stds = prune.weight_stds(model, cfg)  # of the unpruned weights, also when resuming
    hits = None
    done = 0
    if kept is not None:
        resume.restore_pruned_(model, kept, marks)
        done, hits = kept.round, kept.hits
        hooks.info(f"resumed after prune round {done}/{cfg.rounds} (kept in {marks.folder})")
    for r, fraction in enumerate(prune.schedule(cfg.rounds), 1):
        if r <= done:
            continue
        prune.prune_(model, cfg, fraction, stds)
        hits = hooks.retrain(model, p.retrain_epochs, p.lr, None) if p.retrain_epochs else None
        total = sum(m.numel() for m in prune.masks_of(model).values())
        nnz = sum(int(m.sum()) for m in prune.masks_of(model).values())
        acc = int(hits.sum()) / len(hits) if hits is not None else hooks.test_accuracy(model)
        hooks.info(
            f"prune round {r}/{cfg.rounds}: {nnz / total:.1%} of prunable weights kept, "
            f"test accuracy {acc:.4f}"
        )
        if marks is not None:
            marks.save(
                "prune",
                f"prune round {r} of {cfg.rounds}",
                resume.pruned_payload(model, r, hits, sens_record),
                hooks.training(),
            )
    return sens_record, hits


PROGRESS_EVERY_S = 10.0  # the sensitivity analysis's progress lines, at most one this often


def _every(info: Callable[[str], None]) -> Callable[[int, int], None]:
    """A `progress(done, total)` for the sensitivity analysis that tells `info` where it is
    every PROGRESS_EVERY_S seconds and when it ends (an EfficientNet-B0's 82 layers take a
    minute of validation passes on 2 cores)."""
    start = last = time.monotonic()

    def progress(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if done < total and now - last < PROGRESS_EVERY_S:
            return
        last = now
        eta = (now - start) / done * (total - done)
        info(
            f"sensitivity analysis: {done}/{total} layers, {now - start:.0f}s"
            + (f", eta {eta:.0f}s" if done < total else "")
        )

    return progress


def _cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    logits = model(x)
    return F.cross_entropy(logits, y), logits


def _quantize(
    model: nn.Module, q: QuantizeSection, seed: int, hooks: Hooks, base_loss: Callable
) -> dict[str, Any]:
    cfg = kmeans.QuantizeConfig(
        conv_bits=q.conv_bits,
        fc_bits=q.fc_bits,
        bits=dict(q.bits),
        mode=q.mode,
        seed=seed,
        embeddings=q.embeddings,
    )
    # The histogram's layer: the largest (sized by its stored tensor, nothing computed). Its
    # values only, without autograd: a weight computed through the pruning mask with a graph
    # keeps every pruned original, and its gradient, alive (ViT-tiny: 41 MiB through
    # fine-tuning).
    found = kmeans.layers(model, cfg.embeddings)
    largest = max(found, key=lambda n: prune._raw(model, found[n].key).numel())
    with torch.no_grad():
        w = _baked_value(model, found[largest].key).flatten()
        w = w[w != 0].numpy()
    if w.size == 0:  # every weight of the largest layer is zero: nothing to share
        raise InputError(
            f"layer {largest}: every weight is zero, nothing to cluster; is the checkpoint "
            "trained? (or leave the layer out: quantize.enabled = false)"
        )
    if q.method == "soft":
        soft = softshare.SoftShareConfig(
            conv_bits=q.conv_bits,
            fc_bits=q.fc_bits,
            bits=dict(q.bits),
            strength=q.prior_strength,
            width=q.prior_width,
            zero_width=q.zero_width,
            zero_mixing=q.zero_mixing,
            epochs=q.prior_epochs,
            lr=q.lr,
            seed=seed,
            embeddings=q.embeddings,
        )
        if not hooks.train_samples:
            raise ValueError("soft weight-sharing needs Hooks.train_samples")
        record = softshare.soft_share_(model, soft, hooks.retrain, base_loss, hooks.train_samples)
        hooks.info(
            "soft weight-sharing: "
            + ", ".join(
                f"{n} {r['means_used']} means, {r['kept_before'] - r['kept_after']:,} more zeros"
                for n, r in record.items()
            )
        )
    else:
        kmeans.share_weights_(model, cfg)
    counts, edges = np.histogram(w, bins=120)
    histogram = {
        "layer": found[largest].key,
        "counts": counts.tolist(),
        "edges": edges.tolist(),
        "centroids_init": kmeans.linear_init(
            w, len(kmeans.shared_of(model)[largest].codebook)
        ).tolist(),
    }
    hooks.info(f"weight sharing: test accuracy before fine-tuning {hooks.test_accuracy(model):.4f}")
    if q.finetune_epochs:
        hooks.retrain(model, q.finetune_epochs, q.lr, None)
    kmeans.freeze_sharing_(model)
    histogram["centroids"] = kmeans.shared_of(model)[largest].codebook.detach().tolist()
    _round_dense(model, q)
    return histogram


def _round_dense(model: nn.Module, q: QuantizeSection) -> None:
    if q.dense == "float16":
        # Biases and norm statistics are stored as float16; round them in the model too, so
        # the archive decodes to exactly the model we measured.
        shared = set(kmeans.shared_params(model))
        with torch.no_grad():
            for name in _baked_state_keys(model):
                t = _baked_value(model, name)
                # Values beyond float16's range stay float32 (the archive stores those so).
                finite16 = (
                    bool(t.abs().max() <= torch.finfo(torch.float16).max) if t.numel() else True
                )
                if name not in shared and t.dtype == torch.float32 and finite16:
                    t.copy_(t.half().float())


def _choose_gap_bits(positions: np.ndarray, numel: int, fixed: int, mode: str) -> int:
    if len(positions) == numel:
        return 0
    if mode == "fixed":
        return fixed

    def cost(b: int) -> int:
        gaps = huffman.encode_gaps(positions, b)
        lengths = huffman.code_lengths(np.bincount(gaps, minlength=2**b))
        return huffman.stream_bits(gaps, lengths) + 8 * 2**b

    return min(GAP_BITS_SEARCH, key=cost)


def prefer_dense_(model: nn.Module, recipe: Recipe, prices: dict | None = None) -> list[str]:
    """Round to float16 the codebook of each shared layer whose dense float16 record would be
    smaller than its shared one, so that the dense record `_entries` then measures as smaller
    is exact and decodes to the model bit for bit. Returns those layers' names.

    Nothing to do with `quantize.dense = "float32"`: float32 storage is exact as it is.
    `prices` (`archive.ArchiveContext`): shared with `_entries`, which then codes nothing twice.
    """
    if recipe.quantize.dense != "float16":
        return []
    h = recipe.huffman
    layers = {layer.key: layer for layer in kmeans.layers(model, embeddings=True).values()}
    shared_params = kmeans.shared_params(model)
    # Priced in archive order, each record after those before it (format 3's byte-plane models
    # learn from them), as `_entries` will price them.
    context = archive.ArchiveContext(_format(recipe), prices)
    rounded = []
    aliases = _aliases(model, recipe)
    for key in _baked_state_keys(model):
        if key in aliases:  # codes nothing
            continue
        s = shared_params.get(key)
        if s is None or key not in layers:
            context.add(archive.Dense(key, _baked_value(model, key).detach(), store_fp16=True))
            continue
        codebook = s.codebook.detach()
        shared = _shared_entry(key, s, _fixed_gap_bits(layers[key], h), _gap_mode(recipe))
        if codebook.numel() and bool(codebook.abs().max() > _FP16_MAX):
            # float16 would overflow: stays shared, or dense float32 where `_entries` finds
            # that smaller; priced the same way here.
            dense32 = archive.Dense(key, _baked_value(model, key).detach(), store_fp16=True)
            s_bytes, d_bytes, _ = archive.sizes(shared, dense32, context.version, context)
            context.add(dense32 if d_bytes < s_bytes else shared)
            continue
        # a layer soft sharing left wholly in its zero component has no codebook: all zeros
        values = codebook.half().float()[s.index] if codebook.numel() else 0.0
        as16 = torch.where(s.mask, values, 0.0)
        dense = archive.Dense(key, as16, store_fp16=True)
        s_bytes, d_bytes, _ = archive.sizes(shared, dense, context.version, context)
        if d_bytes < s_bytes:
            with torch.no_grad():
                s.codebook.copy_(s.codebook.half().float())
            rounded.append(layers[key].name)
            context.add(dense)
        else:
            context.add(shared)
    return rounded


def _format(recipe: Recipe) -> int:
    """The archive format `[huffman] coder` asks for."""
    return archive.VERSION if recipe.huffman.coder == "range" else archive.HUFFMAN_VERSION


def _gap_mode(recipe: Recipe) -> str:
    """Format 3 codes positions as a mask, not gaps: no width search is worth running."""
    return recipe.huffman.gap_bits if recipe.huffman.coder == "huffman" else "fixed"


def _fixed_gap_bits(layer: prune.Layer, h: HuffmanSection) -> int:
    return h.conv_gap_bits if layer.kind == "conv" else h.fc_gap_bits


def _shared_entry(key: str, s: kmeans.SharedWeights, fixed: int, mode: str) -> archive.Shared:
    return _shared_record(key, s.mask, s.codebook.detach(), s.index, fixed, mode)


def _shared_record(
    key: str, mask: torch.Tensor, codebook: torch.Tensor, index: torch.Tensor, fixed: int, mode: str
) -> archive.Shared:
    """The archive's shared record of a weight: `codebook[index]` where `mask`, zeros elsewhere."""
    flat = mask.flatten()
    positions = torch.nonzero(flat).flatten().numpy()
    return archive.Shared(
        key,
        tuple(mask.shape),
        codebook.numpy().astype(np.float32),
        index.flatten()[flat].numpy(),
        positions,
        _choose_gap_bits(positions, flat.numel(), fixed, mode),
    )


def record_bytes(layer: prune.Layer, value: torch.Tensor, recipe: Recipe) -> int:
    """Bytes the archive would spend on `layer`'s weight if it held `value` (a few distinct
    values, zeros pruned): the smaller of its shared and dense records, as `_entries` chooses
    (the dense one as float16 when `quantize.dense` asks for it)."""
    h, dense16 = recipe.huffman, recipe.quantize.dense == "float16"
    value = value.detach().float()
    mask = value != 0
    codebook, kept_index = torch.unique(value[mask], return_inverse=True)
    index = torch.zeros(value.shape, dtype=torch.int64)
    index[mask] = kept_index
    fixed = _fixed_gap_bits(layer, h)
    shared = _shared_record(layer.key, mask, codebook, index, fixed, _gap_mode(recipe))
    if dense16 and (not value.numel() or bool(value.abs().max() <= _FP16_MAX)):
        value = value.half().float()
    dense = archive.Dense(layer.key, value, store_fp16=dense16)
    return min(archive.sizes(shared, dense, _format(recipe))[:2])


def _entries(model: nn.Module, recipe: Recipe, prices: dict | None = None):
    """Archive entries in state_dict order, and for every layer's weight (`kmeans.layers`) the
    facts the report needs (kept, bits, codebook size, gap widths and escapes at the fixed
    width; for a shared layer, both record sizes and which one is stored).

    A shared layer's record is priced both ways and the smaller is kept (shared on a tie); the
    dense one is range-coded unless its estimate is plainly the larger (`archive.sizes`).
    The dense record stores float16 only where that is exact (`prefer_dense_` makes it so), so
    either way the archive decodes to the model's values bit for bit.
    """
    h = recipe.huffman
    dense16 = recipe.quantize.dense == "float16"
    embeddings = recipe.prune.embeddings or recipe.quantize.embeddings
    shared = kmeans.shared_params(model)
    layers = {
        layer.key: layer
        for layer in kmeans.layers(model, embeddings=True).values()
        if layer.kind != "embedding" or embeddings or layer.key in shared
    }
    entries: list[archive.Entry] = []
    info: dict[str, dict[str, Any]] = {}
    # Prices each record where it will sit; `prices` holds what `prefer_dense_` coded.
    context = archive.ArchiveContext(_format(recipe), prices)
    aliases = _aliases(model, recipe)
    for key in _baked_state_keys(model):
        if key in aliases:
            entries.append(archive.Alias(key, aliases[key]))
            continue
        value = _baked_value(model, key).detach()
        dense = archive.Dense(key, value.clone(), store_fp16=dense16)
        layer = layers.get(key)
        if layer is not None:
            positions = torch.nonzero(value.flatten() != 0).flatten().numpy()
            fixed = _fixed_gap_bits(layer, h)
            sparse = len(positions) < value.numel()
            info[key] = {
                "layer": layer.name,
                "kind": layer.kind,
                "weights": value.numel(),
                "kept": len(positions),
                "fixed_gap_bits": fixed if sparse else 0,
                "escapes_fixed": _escapes(positions, fixed) if sparse else 0,
                "bits": 32,
                "codebook": 0,
                "gap_bits": 0,
            }
        if key in shared and layer is not None:
            s = shared[key]
            entry = _shared_entry(key, s, info[key]["fixed_gap_bits"], _gap_mode(recipe))
            k = len(entry.codebook)
            info[key].update(
                bits=math.ceil(math.log2(max(k, 2))), codebook=k, gap_bits=entry.gap_bits
            )
            if h.enabled:
                entry = _smaller(entry, dense, info[key], context)
            entries.append(entry)
        else:
            entries.append(dense)
        if h.enabled:
            context.add(entries[-1])
    # Report rows in model order (a parametrized weight moves to the end of its module's
    # state_dict, after a MultiheadAttention's out_proj for instance).
    order = {key: i for i, key in enumerate(layers)}
    return entries, dict(sorted(info.items(), key=lambda kv: order[kv[0]]))


def _aliases(model: nn.Module, recipe: Recipe) -> dict[str, str]:
    """Each tied weight's key after the first of its group (`prune.tied_weights`, left dense),
    to the first's: format 3 stores the tensor once (`archive.Alias`), as the baseline's
    parameter count and torch.save count it. Formats 1 and 2 store it again."""
    if _format(recipe) < 3:
        return {}
    order = {key: i for i, key in enumerate(_baked_state_keys(model))}
    aliases = {}
    for group in prune.tied_weights(model):
        keys = sorted((k for k in group if k in order), key=order.__getitem__)
        aliases.update((key, keys[0]) for key in keys[1:])
    return aliases


def _smaller(
    shared: archive.Shared,
    dense: archive.Dense,
    info: dict[str, Any],
    context: archive.ArchiveContext,
):
    """The smaller record of the two, noted in `info`. The shared record is always coded;
    the dense one too unless its estimate is plainly larger (`archive.sizes`): then its figure
    is the estimate, marked "≈" and `dense_bytes_estimated`.

    The dense figure reported is float16's whenever `quantize.dense` asks for it, rounded or
    not: what dense storage would cost. Only an exact record is ever chosen, and `prefer_dense_`
    has made the layers where float16 wins exact.
    """
    version = context.version
    s_bytes, d_bytes, guessed = archive.sizes(shared, dense, version, context)
    dtype = "fp16" if archive.stored_dtype(dense) == torch.float16 else "fp32"
    t = dense.tensor
    if dense.store_fp16 and dtype == "fp32" and t.numel() and bool(t.abs().max() <= _FP16_MAX):
        as16 = archive.Dense(dense.name, t.half().float(), store_fp16=True)
        shown, shown_guessed = archive.dense_size(as16, s_bytes, version, context)
        shown_dtype = "fp16"
    else:
        shown, shown_dtype, shown_guessed = d_bytes, dtype, guessed
    if d_bytes < s_bytes:
        why, chosen = f"dense {dtype}: {d_bytes:,} B < shared {s_bytes:,} B", dense
    else:
        about = "≈" if shown_guessed else ""
        why, chosen = f"shared: {s_bytes:,} B <= dense {shown_dtype} {about}{shown:,} B", shared
    info.update(
        encoding="shared" if chosen is shared else f"dense {dtype}",
        encoding_reason=why,
        shared_bytes=s_bytes,
        dense_bytes=d_bytes if chosen is dense else shown,
        dense_bytes_estimated=chosen is shared and shown_guessed,
    )
    return chosen


def _escapes(positions: np.ndarray, b: int) -> int:
    return int(np.sum(huffman.encode_gaps(positions, b) == 2**b - 1)) if len(positions) else 0


def _baked_state_keys(model: nn.Module) -> list[str]:
    keys = []
    for k in model.state_dict():
        if ".parametrizations." in k:
            base, _, rest = k.partition(".parametrizations.")
            name = f"{base}.{rest.split('.')[0]}"
            if rest.endswith(".original") and name not in keys:
                keys.append(name)
        else:
            keys.append(k)
    return keys


def _baked_value(model: nn.Module, key: str) -> torch.Tensor:
    mname, _, pname = key.rpartition(".")
    module = model.get_submodule(mname) if mname else model
    return getattr(module, pname)


def _account(stages, entries, info, base: int, recipe) -> None:
    """Paper-style bytes for the P and P+Q stages: fixed-width codes, no Huffman. A pruned
    layer costs its kept weights (32 bits, or `bits` plus a 32-bit codebook once shared) and
    its relative indices at the fixed gap width, escapes included."""
    dense16 = recipe.quantize.dense == "float16"
    p_bits = q_bits = 0
    for e in entries:
        i = info.get(e.name)
        if isinstance(e, archive.Alias):
            continue  # stored once, under its first name
        if i is not None:
            index_bits = (i["kept"] + i["escapes_fixed"]) * i["fixed_gap_bits"]
            p_bits += 32 * i["kept"] + index_bits
            q_bits += i["bits"] * i["kept"] + index_bits + 32 * i["codebook"]
        else:
            t = e.tensor
            width = t.element_size() * 8
            p_bits += width * t.numel()
            q_bits += (16 if dense16 and t.is_floating_point() else width) * t.numel()
    for st in stages:
        if st["name"] == "prune":
            st["bytes"] = math.ceil(p_bits / 8)
        elif st["name"] == "quantize":
            st["bytes"] = math.ceil(q_bits / 8)
        if "bytes" in st:
            st["ratio"] = base / st["bytes"]


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (so -0.0 != +0.0 and NaN payloads count)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.numel():  # an empty tensor's strides may be 0, which view() refuses
        return True
    return torch.equal(
        a.detach().contiguous().reshape(-1).view(torch.uint8),
        b.detach().contiguous().reshape(-1).view(torch.uint8),
    )


def _check_bit_identical(model: nn.Module, decoded: dict[str, torch.Tensor]) -> None:
    for key in _baked_state_keys(model):
        got = decoded.get(key)
        if got is None or not bits_equal(got, _baked_value(model, key)):
            raise StageError(f"archive check failed: tensor {key} does not decode bit for bit")


def _archive_report(path: Path, stats: archive.Encoded, base: int) -> dict[str, Any]:
    stream_bytes = sum(
        v.get("index_stream_bytes", 0) + v.get("gap_stream_bytes", 0) for v in stats.layers.values()
    )
    entropy_bits = sum(
        v.get("index_entropy_bits", 0) + v.get("gap_entropy_bits", 0) for v in stats.layers.values()
    )
    bound = stats.bytes - stream_bytes + math.ceil(entropy_bits / 8)
    return {
        # the coded streams alone against their order-0 entropy, and the whole file against
        # the entropy of its streams plus everything else it holds verbatim
        "streams_vs_entropy": stream_bytes / max(entropy_bits / 8, 1),
        "path": str(path),
        "bytes": stats.bytes,
        "sha256": stats.sha256,
        "ratio": base / stats.bytes,
        "header_bytes": stats.header_bytes,
        "stream_bytes": stream_bytes,
        "entropy_bound_bytes": bound,
        "vs_entropy_bound": stats.bytes / bound,
    }


def _layer_rows(info, stats: archive.Encoded | None) -> list[dict[str, Any]]:
    rows = []
    for name, i in info.items():
        n = max(i["kept"], 1)
        row = {
            "name": name,
            "layer": i["layer"],
            "kind": i["kind"],
            "weights": i["weights"],
            "kept": i["kept"],
            "kept_fraction": i["kept"] / i["weights"],
            "weight_bits": i["bits"],
            # fixed-width relative index per kept weight, escapes included
            "index_bits": (i["kept"] + i["escapes_fixed"]) * i["fixed_gap_bits"] / n,
            "gap_bits": i["gap_bits"],
            "codebook": i["codebook"],
        }
        for k in (
            "encoding",
            "encoding_reason",
            "shared_bytes",
            "dense_bytes",
            "dense_bytes_estimated",
        ):
            if k in i:
                row[k] = i[k]
        s = stats.layers.get(name) if stats else None
        if s and "index_stream_bits" in s:
            row.update(
                weight_bits_huffman=s["index_stream_bits"] / n,
                index_bits_huffman=s["gap_stream_bits"] / n,
                weight_bits_entropy=s["index_entropy_bits"] / n,
                index_bits_entropy=s["gap_entropy_bits"] / n,
            )
        if s:
            row.update(
                bytes=s["record_bytes"], size_fraction=s["record_bytes"] / (4 * i["weights"])
            )
        rows.append(row)
    return rows
