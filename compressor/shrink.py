"""The Deep Compression pipeline behind `compress shrink` (Han, Mao & Dally, ICLR 2016):
prune with retraining -> k-means weight sharing with centroid fine-tuning -> Huffman archive.

`shrink(model, spec, recipe, hooks, out_dir)` changes the model in place, writes the archive,
decodes it again and checks the decoded weights equal the model's bit for bit, and returns a
plain-data report (the paper's per-layer and per-stage tables, plus entropy bounds).

Training is injected through `Hooks` (the CLI passes `distrib.trainer.fit`), so this package
never imports `distrib`. Byte accounting follows the paper: ratios are against 4 bytes per
parameter of the dense FP32 model and include codebooks and index overhead; the P+Q+H figure is
the archive file itself, header and checksum included.
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

from compressor import archive, distill, huffman, kmeans, prune
from models.errors import InputError, StageError

GAP_BITS_SEARCH = range(1, 13)


@dataclass
class Hooks:
    """What the pipeline needs from the outside world."""

    # Train in place: (model, epochs, lr, loss_fn or None for cross-entropy, data or None for
    # the training set; distillation passes a transfer set).
    retrain: Callable[..., None]
    test_accuracy: Callable[[nn.Module], float]
    val_accuracy: Callable[[nn.Module], float]  # held-out training data (sensitivity analysis)
    info: Callable[[str], None] = lambda message: None


def default_sparsity(model: nn.Module) -> dict[str, float]:
    """Per-layer fraction to prune, by the layer's role, after the paper's LeNet tables
    (LeNet-300-100 kept 8/9/26%, LeNet-5 66/12/8/19%): first conv 0.35, other convs 0.85,
    depthwise convs 0.5, hidden fully connected 0.92, output layer 0.75."""
    out = {}
    found = kmeans.layers(model)
    linears = [n for n, m in found.items() if isinstance(m, nn.Linear)]
    for name, m in found.items():
        if isinstance(m, nn.Linear):
            out[name] = 0.75 if linears and name == linears[-1] else 0.92
        elif m.groups > 1 and m.groups == m.in_channels:
            out[name] = 0.5
        else:
            out[name] = 0.35 if m.in_channels <= 3 else 0.85
    return out


def shrink(
    model: nn.Module,
    spec: dict[str, Any],
    recipe: dict[str, Any],
    hooks: Hooks,
    out_dir: Path,
    metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the recipe on `model` (in place); write `out_dir/student.dcz`; return the report."""
    check_fits_recipe(model, recipe)
    t0 = time.perf_counter()
    params = sum(p.numel() for p in model.parameters())
    baseline = {
        "bytes": 4 * params,
        "parameters": params,
        "test_accuracy": hooks.test_accuracy(model),
    }
    stages: list[dict[str, Any]] = []
    report: dict[str, Any] = {"baseline": baseline, "stages": stages, "recipe": recipe}
    hooks.info(
        f"baseline: {params:,} parameters, {baseline['bytes']:,} bytes, "
        f"test accuracy {baseline['test_accuracy']:.4f}"
    )

    t = recipe["train"]
    if t["distill"] > 0:  # retrain against the dense model's soft targets
        teacher = copy.deepcopy(model)
        loss_fn = distill.loss_with_teacher(teacher, t["temperature"], t["distill"])
        retrain = hooks.retrain
        hooks = dataclasses.replace(
            hooks, retrain=lambda m, e, lr, _=None, data=None: retrain(m, e, lr, loss_fn, data)
        )
    p = recipe["prune"]
    if p["enabled"]:
        ts = time.perf_counter()
        report["sensitivity"] = _prune(model, p, hooks)
        stages.append(_stage("prune", ts, hooks.test_accuracy(model)))
    q = recipe["quantize"]
    if q["enabled"]:
        ts = time.perf_counter()
        report["histogram"] = _quantize(model, q, recipe["train"]["seed"], hooks)
        stages.append(_stage("quantize", ts, hooks.test_accuracy(model)))

    entries, layer_info = _entries(model, recipe)
    _account(stages, entries, layer_info, baseline["bytes"], recipe)
    if recipe["huffman"]["enabled"]:
        ts = time.perf_counter()
        path = out_dir / "student.dcz"
        meta = {**(metadata or {}), "test_accuracy": stages[-1]["test_accuracy"]}
        stats = archive.write(path, entries, spec, meta)
        decoded = archive.read(path)
        _check_bit_identical(model, decoded.state_dict)
        baked = prune.bake_(model)
        acc = hooks.test_accuracy(baked)
        stages.append(
            _stage("huffman", ts, acc, bytes=stats.bytes, ratio=baseline["bytes"] / stats.bytes)
        )
        report["archive"] = _archive_report(path, stats, baseline["bytes"])
        report["layers"] = _layer_rows(layer_info, stats)
    else:
        prune.bake_(model)
        report["layers"] = _layer_rows(layer_info, None)
    report["seconds"] = time.perf_counter() - t0
    return report


def _stage(name: str, started: float, accuracy: float, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "seconds": time.perf_counter() - started,
        "test_accuracy": accuracy,
        **extra,
    }


def check_fits_recipe(model: nn.Module, recipe: dict[str, Any]) -> None:
    """Refuse, before any work, a recipe that names layers the model lacks, or a model with
    nothing to compress."""
    found = kmeans.layers(model)
    if (recipe["prune"]["enabled"] or recipe["quantize"]["enabled"]) and not found:
        raise InputError("the model has no prunable layers (Linear or Conv): nothing to compress")
    named = []
    if isinstance(recipe["prune"]["sparsity"], dict):
        named += [
            ("prune.sparsity", k.removesuffix(".weight").removesuffix(".bias"))
            for k in recipe["prune"]["sparsity"]
        ]
    named += [("quantize.bits", k) for k in recipe["quantize"]["bits"]]
    for where, layer in named:
        if layer not in found:
            raise InputError(
                f"recipe {where} names layer {layer!r}, which the model lacks; "
                f"layers: {', '.join(found)}"
            )


# --- stages ---------------------------------------------------------------------------------


def _prune(model: nn.Module, p: dict[str, Any], hooks: Hooks) -> dict[str, Any] | None:
    sens = None
    sparsity = p["sparsity"]
    if sparsity == "default":
        sparsity = default_sparsity(model)
    elif sparsity == "auto":
        sens = prune.sensitivity(model, hooks.val_accuracy, p["budget"])
        sparsity = sens.proposal
        hooks.info(
            "sensitivity proposal: " + ", ".join(f"{n} {s:.2f}" for n, s in sparsity.items())
        )
    cfg = prune.PruneConfig(
        sparsity=sparsity if p["quality"] is None else None,
        quality=p["quality"],
        scope=p["scope"],
        rounds=p["rounds"],
        include_bias=p["include_bias"],
    )
    stds = prune.weight_stds(model, cfg)
    for r, fraction in enumerate(prune.schedule(cfg.rounds), 1):
        prune.prune_(model, cfg, fraction, stds)
        if p["retrain_epochs"]:
            hooks.retrain(model, p["retrain_epochs"], p["lr"], None)
        total = sum(m.numel() for m in prune.masks_of(model).values())
        nnz = sum(int(m.sum()) for m in prune.masks_of(model).values())
        hooks.info(
            f"prune round {r}/{cfg.rounds}: {nnz / total:.1%} of prunable weights kept, "
            f"test accuracy {hooks.test_accuracy(model):.4f}"
        )
    return sens.to_dict() if sens else None


def _quantize(model: nn.Module, q: dict[str, Any], seed: int, hooks: Hooks) -> dict[str, Any]:
    cfg = kmeans.QuantizeConfig(
        conv_bits=q["conv_bits"],
        fc_bits=q["fc_bits"],
        bits=dict(q["bits"]),
        mode=q["mode"],
        seed=seed,
    )
    largest = max(kmeans.layers(model).items(), key=lambda kv: kv[1].weight.numel())
    w = largest[1].weight.detach().flatten()
    w = w[w != 0].numpy()
    kmeans.share_weights_(model, cfg)
    counts, edges = np.histogram(w, bins=120)
    histogram = {
        "layer": f"{largest[0]}.weight",
        "counts": counts.tolist(),
        "edges": edges.tolist(),
        "centroids_init": kmeans.linear_init(
            w, len(kmeans.shared_of(model)[largest[0]].codebook)
        ).tolist(),
    }
    hooks.info(f"weight sharing: test accuracy before fine-tuning {hooks.test_accuracy(model):.4f}")
    if q["finetune_epochs"]:
        hooks.retrain(model, q["finetune_epochs"], q["lr"], None)
    kmeans.freeze_sharing_(model)
    histogram["centroids"] = kmeans.shared_of(model)[largest[0]].codebook.detach().tolist()
    _round_dense(model, q)
    return histogram


def _round_dense(model: nn.Module, q: dict[str, Any]) -> None:
    if q["dense"] == "float16":
        # Biases and norm statistics are stored as float16; round them in the model too, so
        # the archive decodes to exactly the model we measured.
        shared = {f"{n}.weight" for n in kmeans.shared_of(model)}
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


def _entries(model: nn.Module, recipe: dict[str, Any]):
    """Archive entries in state_dict order, and for every Linear/Conv weight the facts the
    report needs (kept, bits, codebook size, gap widths and escapes at the fixed width)."""
    h = recipe["huffman"]
    shared = kmeans.shared_of(model)
    entries: list[archive.Dense | archive.Shared] = []
    info: dict[str, dict[str, Any]] = {}
    modules = dict(model.named_modules())
    for key in _baked_state_keys(model):
        mname, _, pname = key.rpartition(".")
        layer = modules.get(mname)
        value = _baked_value(model, key).detach()
        if pname == "weight" and isinstance(layer, prune.PRUNABLE):
            positions = torch.nonzero(value.flatten() != 0).flatten().numpy()
            fixed = h["fc_gap_bits"] if isinstance(layer, nn.Linear) else h["conv_gap_bits"]
            sparse = len(positions) < value.numel()
            info[key] = {
                "weights": value.numel(),
                "kept": len(positions),
                "fixed_gap_bits": fixed if sparse else 0,
                "escapes_fixed": _escapes(positions, fixed) if sparse else 0,
                "bits": 32,
                "codebook": 0,
                "gap_bits": 0,
            }
        if pname == "weight" and mname in shared:
            s = shared[mname]
            mask = s.mask.flatten()
            positions = torch.nonzero(mask).flatten().numpy()
            codebook = s.codebook.detach().numpy().astype(np.float32)
            b = _choose_gap_bits(
                positions, mask.numel(), info[key]["fixed_gap_bits"], h["gap_bits"]
            )
            info[key].update(
                bits=math.ceil(math.log2(max(len(codebook), 2))), codebook=len(codebook), gap_bits=b
            )
            entries.append(
                archive.Shared(
                    key,
                    tuple(s.mask.shape),
                    codebook,
                    s.index.flatten()[mask].numpy(),
                    positions,
                    b,
                )
            )
        else:
            entries.append(
                archive.Dense(
                    key, value.clone(), store_fp16=recipe["quantize"]["dense"] == "float16"
                )
            )
    return entries, info


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
    dense16 = recipe["quantize"]["dense"] == "float16"
    p_bits = q_bits = 0
    for e in entries:
        i = info.get(e.name)
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
            "weights": i["weights"],
            "kept": i["kept"],
            "kept_fraction": i["kept"] / i["weights"],
            "weight_bits": i["bits"],
            # fixed-width relative index per kept weight, escapes included
            "index_bits": (i["kept"] + i["escapes_fixed"]) * i["fixed_gap_bits"] / n,
            "gap_bits": i["gap_bits"],
            "codebook": i["codebook"],
        }
        s = stats.layers.get(name) if stats else None
        if s and "index_stream_bits" in s:
            row.update(
                weight_bits_huffman=s["index_stream_bits"] / n,
                index_bits_huffman=s["gap_stream_bits"] / n,
                weight_bits_entropy=s["index_entropy_bits"] / n,
                index_bits_entropy=s["gap_entropy_bits"] / n,
                bytes=s["record_bytes"],
                size_fraction=s["record_bytes"] / (4 * i["weights"]),
            )
        rows.append(row)
    return rows
