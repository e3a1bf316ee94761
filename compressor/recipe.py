"""Recipes: the stages of `compress shrink` and their parameters, as TOML or JSON.

A recipe (TOML, YAML or JSON, by the file's suffix) has one section per stage, run in the
pipeline's only valid order (distill -> channels -> prune -> quantize -> huffman -> export): each stage works
on the weights the previous one left, and the Huffman archive is emitted from the final weights. Every key has a default, so an empty recipe
is a complete one; an unknown key or an impossible value is refused, naming the key, before
any work starts. `--dry-run` prints the resolved recipe; the report embeds it.

    version = 1
    [train]     batch_size, optimizer, seed, distill (alpha), temperature  # retraining
    [budget]    max_drop = "off" | points, trials, sparsities, bits  # --max-drop: the search
    [distill]   student ("" = off), student_kwargs, teachers, epochs, lr, temperature, alpha,
                hint_student, hint_teacher, hint_epochs, transfer, transfer_size, labels
    [channels]  enabled = false, target_macs = 0.5, importance ("l1" | "l2" | "taylor"), scope,
                rounds, retrain_epochs, lr, ignore = [layer, ...], round_to, max_ratio
    [prune]     enabled, sparsity ("default" | "auto" | 0.9 | {layer = 0.9}) or quality,
                scope, rounds, retrain_epochs, lr, budget, include_bias, embeddings = false
    [quantize]  enabled, method = "kmeans" | "soft", conv_bits = 8, fc_bits = 5,
                bits = {layer = n}, mode, finetune_epochs, lr, dense = "float16" | "float32",
                embeddings = false; soft: prior_epochs, prior_strength, prior_width,
                zero_width, zero_mixing
    [huffman]   enabled, fc_gap_bits = 5, conv_gap_bits = 8, gap_bits = "auto" | "fixed"
    [export]    enabled, opset = 18, ir_version, int8, method, calibration, calibration_data,
                target = "mobile" | "host", scheme = "u8s8" | "u8u8", reduce_range,
                min_agreement, ort, fixed_batch                     # ONNX FP32, INT8, .ort
    [guard]     max_stage_drop = 2.0 (points a stage may cost), strict = false

Layers are named as `compressor.prune.weight_layers` names them: a Linear or Conv by its module
("fc1", "blocks.0.block.3"), MultiheadAttention's packed q/k/v projection as
"<module>.in_proj" (or "<module>.q_proj", k_proj, v_proj when key/value widths differ) and its
output projection "<module>.out_proj". `embeddings = true` adds nn.Embedding tables (by module
name) to pruning or weight sharing; they are left dense by default.
"""

from __future__ import annotations

import copy
import json
import math
import tomllib
from pathlib import Path
from typing import Any

from compresskit.compressor.guard import GuardConfig
from compresskit.models.errors import InputError
from compresskit.models.limits import MAX_NESTING, nesting_depth

VERSION = 1
MAX_BITS = 12  # 4,096 shared values per layer; more is no longer weight *sharing*
BUDGET_DISTILL = 0.7  # train.distill's default when budget.max_drop is set
MAX_RECIPE_BYTES = 2**20  # a recipe is a few hundred bytes; this bounds the parsers' work

DEFAULTS: dict[str, Any] = {
    "version": VERSION,
    # distill: alpha of the soft-target loss against the dense model while retraining and
    # fine-tuning (0 = plain cross-entropy, as the paper); temperature: Hinton's T.
    "train": {"batch_size": 32, "optimizer": "adam", "seed": 0, "distill": 0.0, "temperature": 4.0},
    # An accuracy budget (compressor.budget): max_drop = points of validation accuracy the
    # result may lose; the search picks each layer's sparsity (of `sparsities`) and bits (of
    # `bits`) for the smallest archive within it, trying `trials` full shrink runs. "off":
    # the prune and quantize settings as written.
    "budget": {
        "max_drop": "off",
        "trials": 6,
        "sparsities": [0.0, 0.5, 0.7, 0.8, 0.9, 0.93, 0.95, 0.97, 0.98],
        "bits": [2, 3, 4, 5, 6, 8],
    },
    # Distil the checkpoint (the teacher, with `teachers` as an ensemble) into `student` before
    # Deep Compression; student = "" compresses the checkpoint's own model.
    "distill": {
        "student": "",
        "student_kwargs": {},
        "teachers": [],
        "epochs": 10,
        "lr": 3e-3,
        "temperature": 4.0,
        "alpha": 0.7,
        # FitNets: first regress layer hint_student onto the teacher's hint_teacher ("" = off).
        "hint_student": "",
        "hint_teacher": "",
        "hint_epochs": 3,
        # Transfer set: keep a `labels` fraction of the training labels, label the rest and
        # transfer_size x N synthetic inputs ("mixup" or "munge") with the teacher.
        "transfer": "none",
        "transfer_size": 1.0,
        "labels": 1.0,
    },
    # Structured pruning before Deep Compression: whole channels, neurons and embedding
    # dimensions removed until the model's MACs are target_macs of the original's (see
    # compressor.channels). Off by default: it changes the architecture.
    "channels": {
        "enabled": False,
        "target_macs": 0.5,
        "importance": "l1",
        "scope": "layer",
        "rounds": 3,
        "retrain_epochs": 1,
        "lr": 3e-3,
        "ignore": [],
        "round_to": 0,
        "max_ratio": 0.9,
    },
    "prune": {
        "enabled": True,
        # "default": per-layer fractions by role (see compressor.shrink.default_sparsity);
        # "auto": the sensitivity analysis proposes them within `budget`.
        "sparsity": "default",
        "quality": None,
        "scope": "layer",
        "rounds": 3,
        # Retrain at the teacher's peak learning rate: on digits/LeNet-300 this recovered the
        # baseline accuracy on 3 of 3 seeds, where 1e-3 lost 0.3-0.8 points.
        "retrain_epochs": 4,
        "lr": 3e-3,
        "budget": 0.02,
        "include_bias": False,
        # nn.Embedding tables too (off: the paper prunes Linear and Conv layers only)
        "embeddings": False,
    },
    "quantize": {
        "enabled": True,
        # "kmeans": the paper's k-means then centroid fine-tuning; "soft": soft weight-sharing
        # (Ullrich et al. 2017, compressor.softshare), retraining under a Gaussian-mixture
        # prior with the prior_* keys below, snapped to its means, then the same fine-tuning.
        "method": "kmeans",
        "conv_bits": 8,
        "fc_bits": 5,
        "bits": {},
        "mode": "centroids",
        "prior_epochs": 6,
        "prior_strength": 1.0,
        "prior_width": 0.1,
        "zero_width": 0.4,
        "zero_mixing": 0.2,
        "finetune_epochs": 3,
        "lr": 1e-3,
        # How tensors that are not shared are stored: biases, norms, and any shared layer whose
        # dense record is smaller than its shared one (measured per layer).
        "dense": "float16",
        "embeddings": False,  # share the weights of nn.Embedding tables too
    },
    "huffman": {
        "enabled": True,
        "fc_gap_bits": 5,
        "conv_gap_bits": 8,
        # "auto": per layer, the gap width whose Huffman-coded size (with its code table) is
        # smallest; "fixed": the fc/conv widths above, as the paper.
        "gap_bits": "auto",
    },
    "export": {
        "enabled": True,
        "opset": 18,
        # 0: the lowest IR that declares the opset (8 for opset 18: ONNX Runtime >= 1.14);
        # 9 for ONNX Runtime 1.16-1.17
        "ir_version": 0,
        "int8": True,
        "method": "minmax",
        "calibration": 256,  # samples drawn from the training set...
        "calibration_data": "",  # ...or a .npy file of inputs (samples first) to draw from
        # "mobile": nothing is timed on the build machine, INT8 wherever min_agreement holds,
        # the same bytes on every build; "host": also keep node groups in FP32 where timings on
        # this machine say INT8 is slower beyond a 95% confidence interval
        "target": "mobile",
        "scheme": "u8s8",  # uint8 activations with int8 ("u8s8") or uint8 ("u8u8") weights
        # 7-bit weights: "auto" turns them on for target host on an x86 CPU without VNNI
        "reduce_range": "auto",
        "min_agreement": 0.995,
        "ort": True,  # also the .ort file for mobile ORT builds, and the NNAPI/CoreML verdicts
        "fixed_batch": 0,  # N > 0: also MODEL.int8.fixed.onnx with batch N (NNAPI needs it)
    },
    # Guardrails (compressor.guard): a stage that costs more than max_stage_drop points of
    # test accuracy, an INT8 file under its agreement floor, a student bigger than its
    # teacher are said on stderr; strict = true (or --strict) fails the run, nothing written.
    "guard": {"max_stage_drop": 2.0, "strict": False},
}

_CHOICES = {
    ("train", "optimizer"): ("adam", "sgd"),
    ("prune", "scope"): ("layer", "global"),
    ("channels", "importance"): ("l1", "l2", "taylor"),
    ("channels", "scope"): ("layer", "global"),
    ("quantize", "method"): ("kmeans", "soft"),
    ("quantize", "mode"): ("centroids", "weights"),
    ("quantize", "dense"): ("float16", "float32"),
    ("huffman", "gap_bits"): ("auto", "fixed"),
    ("export", "method"): ("minmax", "entropy", "percentile"),
    ("export", "target"): ("mobile", "host"),
    ("export", "scheme"): ("u8s8", "u8u8"),
    ("distill", "transfer"): ("none", "mixup", "munge"),
}


_REPLACED = {
    ("export", "latency_aware"): (
        'is gone: use export.target = "host" (latency-aware on this machine) or '
        '"mobile" (the default: nothing timed, the same file on every build)'
    ),
}


def load(path: str | Path) -> dict[str, Any]:
    """Read a recipe file (.toml, .yaml or .json) and resolve it against the defaults."""
    return resolve(read(path), source=str(path))


def read(path: str | Path) -> dict[str, Any]:
    """A recipe file's raw table, not yet resolved (so flags can be laid over it first).

    Checked before any work: at most `MAX_RECIPE_BYTES`, no YAML aliases (a few hundred bytes
    of nested aliases expand to billions of values), and at most `limits.MAX_NESTING` levels
    of tables and lists.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--recipe {path}: no such file")
    kind = {".json": "JSON", ".yaml": "YAML", ".yml": "YAML"}.get(path.suffix, "TOML")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_RECIPE_BYTES + 1)
    except OSError as e:
        raise InputError(f"--recipe {path}: cannot read it ({e.strerror})") from None
    if len(data) > MAX_RECIPE_BYTES:
        raise InputError(
            f"--recipe {path}: over {MAX_RECIPE_BYTES // 2**20} MiB, far more than any recipe "
            "(a few hundred bytes); is it the right file?"
        )
    try:
        text = data.decode()
        if kind == "JSON":
            raw = json.loads(text)
        elif kind == "YAML":
            raw = _yaml(text, path)
        else:
            raw = tomllib.loads(text)
    except InputError:
        raise
    except RecursionError:  # json and tomllib recurse once per level of nesting
        raise _too_deep(path) from None
    except Exception as e:  # each parser raises its own error types
        detail = " ".join(str(e).split())
        raise InputError(f"--recipe {path}: not valid {kind}: {detail}") from None
    if nesting_depth(raw) > MAX_NESTING:
        raise _too_deep(path)
    if not isinstance(raw, dict):
        raise InputError(f"--recipe {path}: a recipe is a table of sections")
    return raw


def _yaml(text: str, path: Path) -> Any:
    """safe_load, after the event stream showed no alias and no nesting beyond MAX_NESTING.

    Aliases are refused outright, not bounded: a recipe never needs one, and a value that
    repeats can be written twice.
    """
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    depth = 0
    try:
        for event in yaml.parse(text, Loader=loader):
            if isinstance(event, yaml.AliasEvent):
                line = event.start_mark.line + 1 if event.start_mark else "?"
                raise InputError(
                    f"--recipe {path}: YAML alias *{event.anchor} (line {line}); compress "
                    "refuses aliases, which can expand a small file without bound: write the "
                    "value out in full instead of &anchor / *alias"
                )
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_NESTING:
                    raise _too_deep(path)
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.YAMLError as e:
        # PyYAML >= 6.0.4 has a nesting limit of its own, met while it scans ahead of the
        # events counted above: the same refusal, in our words.
        if "nesting depth" in str(e):
            raise _too_deep(path) from None
        raise
    return yaml.load(text, Loader=loader)  # a SafeLoader: plain data only


def _too_deep(path: Path) -> InputError:
    return InputError(
        f"--recipe {path}: nested more than {MAX_NESTING} levels deep; a recipe is sections of "
        "key = value, a value a table or list at most a few levels deep"
    )


def resolve(raw: dict[str, Any] | None = None, source: str = "recipe") -> dict[str, Any]:
    """Defaults overlaid with `raw`, validated as a whole."""
    raw = raw or {}
    if not isinstance(raw, dict):
        raise InputError(f"{source}: a recipe is a table of sections")
    out = copy.deepcopy(DEFAULTS)
    for key, value in raw.items():
        if key not in DEFAULTS:
            raise InputError(
                f"{source}: unknown key {key!r}; sections: {', '.join(list(DEFAULTS)[1:])}"
            )
        if key == "version":
            if value != VERSION:
                raise InputError(
                    f"{source}: recipe version {value!r}; this compress reads version {VERSION}"
                )
            continue
        if not isinstance(value, dict):
            raise InputError(f"{source}: [{key}] must be a table")
        for k, v in value.items():
            if (key, k) in _REPLACED:
                raise InputError(f"{source}: {key}.{k} {_REPLACED[key, k]}")
            if k not in DEFAULTS[key]:
                raise InputError(
                    f"{source}: unknown key {key}.{k}; [{key}] takes {', '.join(DEFAULTS[key])}"
                )
            out[key][k] = v
    sections = list(raw)
    if {"channels", "prune"} <= set(sections) and sections.index("channels") > sections.index(
        "prune"
    ):
        raise InputError(
            f"{source}: [channels] comes after [prune]; channel pruning runs first (it "
            "changes the layers that prune then thins): move [channels] above [prune]"
        )
    if "sparsity" in raw.get("prune", {}) and "quality" not in raw.get("prune", {}):
        out["prune"]["quality"] = None
    if raw.get("prune", {}).get("quality") is not None and "sparsity" not in raw.get("prune", {}):
        out["prune"]["sparsity"] = None
    if out["budget"]["max_drop"] != "off" and "distill" not in raw.get("train", {}):
        # A budget's trials retrain against the dense model's outputs unless told otherwise:
        # plain retraining drifts the model by more than a tight budget (docs/benchmarks.md).
        out["train"]["distill"] = BUDGET_DISTILL
    _validate(out, source)
    return out


def _bad(source: str, key: str, value: Any, fix: str) -> InputError:
    return InputError(f"{source}: {key} = {value!r} is impossible; {fix}")


def _validate(r: dict[str, Any], source: str) -> None:
    for (section, key), choices in _CHOICES.items():
        if r[section][key] not in choices:
            raise _bad(source, f"{section}.{key}", r[section][key], f"one of {', '.join(choices)}")
    for section, key in (
        ("channels", "enabled"),
        ("prune", "enabled"),
        ("quantize", "enabled"),
        ("huffman", "enabled"),
        ("prune", "include_bias"),
        ("prune", "embeddings"),
        ("quantize", "embeddings"),
        ("export", "enabled"),
        ("export", "int8"),
        ("export", "ort"),
    ):
        if not isinstance(r[section][key], bool):
            raise _bad(source, f"{section}.{key}", r[section][key], "true or false")
    c = r["channels"]
    if not (_number(c["target_macs"]) and 0 < c["target_macs"] <= 1):
        raise _bad(source, "channels.target_macs", c["target_macs"], "a fraction in (0, 1]")
    if not (_number(c["max_ratio"]) and 0 < c["max_ratio"] < 1):
        raise _bad(source, "channels.max_ratio", c["max_ratio"], "a fraction in (0, 1)")
    _int(r, source, "channels", "rounds", 1, 100)
    _int(r, source, "channels", "retrain_epochs", 0)
    _int(r, source, "channels", "round_to", 0, 1024)
    _positive(r, source, "channels", "lr")
    if not (isinstance(c["ignore"], list) and all(isinstance(n, str) for n in c["ignore"])):
        raise _bad(source, "channels.ignore", c["ignore"], "a list of layer names")
    _int(r, source, "train", "batch_size", 1)
    _int(r, source, "train", "seed", 0, 2**32 - 1)
    if not (_number(r["train"]["distill"]) and 0 <= r["train"]["distill"] <= 1):
        raise _bad(source, "train.distill", r["train"]["distill"], "an alpha in [0, 1]")
    _positive(r, source, "train", "temperature")
    p = r["prune"]
    s, q = p["sparsity"], p["quality"]
    if (s is None) == (q is None):
        raise InputError(f"{source}: prune needs sparsity or quality, not both")
    if isinstance(s, dict):
        for layer, v in s.items():
            _fraction(source, f"prune.sparsity.{layer}", v)
    elif s is not None and s not in ("default", "auto"):
        _fraction(source, "prune.sparsity", s)
    if q is not None and not (_number(q) and q > 0):
        raise _bad(source, "prune.quality", q, "a positive number (threshold = quality x std)")
    if p["scope"] == "global" and not _number(s):
        raise InputError(f"{source}: prune.scope = 'global' needs one sparsity number")
    _int(r, source, "prune", "rounds", 1)
    _int(r, source, "prune", "retrain_epochs", 0)
    _positive(r, source, "prune", "lr")
    if not (_number(p["budget"]) and 0 <= p["budget"] < 1):
        raise _bad(source, "prune.budget", p["budget"], "an accuracy drop in [0, 1), e.g. 0.02")
    qz = r["quantize"]
    for key in ("conv_bits", "fc_bits"):
        _int(r, source, "quantize", key, 1, MAX_BITS)
    if not isinstance(qz["bits"], dict):
        raise _bad(source, "quantize.bits", qz["bits"], "a table {layer = bits}")
    for layer, b in qz["bits"].items():
        if not (isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= MAX_BITS):
            raise _bad(source, f"quantize.bits.{layer}", b, f"whole bits 1..{MAX_BITS}")
    _int(r, source, "quantize", "finetune_epochs", 0)
    _positive(r, source, "quantize", "lr")
    _int(r, source, "quantize", "prior_epochs", 0)
    for key in ("prior_strength", "prior_width", "zero_width"):
        _positive(r, source, "quantize", key)
    if qz["method"] == "soft" and qz["mode"] == "weights":
        raise InputError(
            f"{source}: quantize.method = 'soft' fine-tunes the centroids it snapped to; "
            "drop quantize.mode = 'weights'"
        )
    if not (_number(qz["zero_mixing"]) and 0 < qz["zero_mixing"] < 1):
        raise _bad(source, "quantize.zero_mixing", qz["zero_mixing"], "a share in (0, 1), e.g. 0.2")
    for key in ("fc_gap_bits", "conv_gap_bits"):
        _int(r, source, "huffman", key, 1, 16)
    dd = r["distill"]
    if not isinstance(dd["student"], str):
        raise _bad(source, "distill.student", dd["student"], "a zoo name or pkg.module:Class")
    if not isinstance(dd["student_kwargs"], dict):
        raise _bad(source, "distill.student_kwargs", dd["student_kwargs"], "a table of kwargs")
    if not (isinstance(dd["teachers"], list) and all(isinstance(t, str) for t in dd["teachers"])):
        raise _bad(source, "distill.teachers", dd["teachers"], "a list of checkpoint paths")
    if dd["teachers"] and not dd["student"]:
        raise InputError(f"{source}: distill.teachers needs a distill.student to teach")
    _int(r, source, "distill", "epochs", 1)
    _positive(r, source, "distill", "lr")
    _positive(r, source, "distill", "temperature")
    if not (_number(dd["alpha"]) and 0 <= dd["alpha"] <= 1):
        raise _bad(source, "distill.alpha", dd["alpha"], "a weight in [0, 1]")
    for key in ("hint_student", "hint_teacher"):
        if not isinstance(dd[key], str):
            raise _bad(source, f"distill.{key}", dd[key], "a layer name, e.g. 'features.3'")
    if bool(dd["hint_student"]) != bool(dd["hint_teacher"]):
        raise InputError(f"{source}: distill.hint_student and distill.hint_teacher go together")
    if dd["hint_student"] and not dd["student"]:
        raise InputError(f"{source}: distill.hint_student needs a distill.student")
    _int(r, source, "distill", "hint_epochs", 1)
    if not (_number(dd["transfer_size"]) and 0 <= dd["transfer_size"] <= 100):
        raise _bad(source, "distill.transfer_size", dd["transfer_size"], "a multiple 0..100 of N")
    if not (_number(dd["labels"]) and 0 < dd["labels"] <= 1):
        raise _bad(source, "distill.labels", dd["labels"], "a fraction in (0, 1]")
    _int(r, source, "export", "opset", 13, 23)
    if r["export"]["ir_version"] not in (0, 8, 9, 10, 11):
        raise _bad(
            source, "export.ir_version", r["export"]["ir_version"], "0 (default), 8, 9, 10 or 11"
        )
    ir, opset = r["export"]["ir_version"], r["export"]["opset"]
    if ir:
        from compresskit.compressor.export.compat import min_ir_for

        if ir < min_ir_for(opset):
            raise _bad(
                source,
                "export.ir_version",
                ir,
                f"opset {opset} needs IR {min_ir_for(opset)} or more; raise it or lower the opset",
            )
    rr = r["export"]["reduce_range"]
    if not (isinstance(rr, bool) or rr == "auto"):
        raise _bad(source, "export.reduce_range", rr, 'true, false or "auto"')
    if r["export"]["reduce_range"] is True and r["export"]["scheme"] != "u8s8":
        raise _bad(
            source,
            "export.reduce_range",
            True,
            f"7-bit weights need int8 weights (scheme u8s8), not {r['export']['scheme']}",
        )
    _int(r, source, "export", "calibration", 1)
    if not isinstance(r["export"]["calibration_data"], str):
        raise _bad(
            source, "export.calibration_data", r["export"]["calibration_data"], "a .npy path"
        )
    _int(r, source, "export", "fixed_batch", 0)
    if not (_number(r["export"]["min_agreement"]) and 0 <= r["export"]["min_agreement"] <= 1):
        raise _bad(
            source, "export.min_agreement", r["export"]["min_agreement"], "a fraction in [0, 1]"
        )
    if r["huffman"]["enabled"] and not qz["enabled"]:
        raise InputError(f"{source}: huffman codes the shared weights; enable quantize too")
    _validate_budget(r, source)
    try:
        GuardConfig.from_recipe(r["guard"])
    except InputError as e:
        raise InputError(f"{source}: {e}") from None


def _validate_budget(r: dict[str, Any], source: str) -> None:
    b = r["budget"]
    if b["max_drop"] != "off" and not (_number(b["max_drop"]) and 0 <= b["max_drop"] < 100):
        raise _bad(
            source, "budget.max_drop", b["max_drop"], 'points of accuracy in [0, 100), or "off"'
        )
    _int(r, source, "budget", "trials", 1, 100)
    s = b["sparsities"]
    if not (isinstance(s, list) and s and all(_number(v) and 0 <= v < 1 for v in s)):
        raise _bad(source, "budget.sparsities", s, "a list of fractions in [0, 1)")
    bits = b["bits"]
    if not (
        isinstance(bits, list)
        and bits
        and all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_BITS for v in bits)
    ):
        raise _bad(source, "budget.bits", bits, f"a list of whole bits 1..{MAX_BITS}")
    if b["max_drop"] == "off":
        return
    p = r["prune"]
    if p["enabled"] and (
        p["quality"] is not None or p["sparsity"] == "auto" or _number(p["sparsity"])
    ):
        given = (
            f"prune.quality = {p['quality']!r}"
            if p["quality"] is not None
            else f"prune.sparsity = {p['sparsity']!r}"
        )
        raise InputError(
            f"{source}: budget.max_drop chooses each layer's sparsity, and {given} sets them "
            "all; drop one of the two (a table {layer = s} fixes only the layers it names)"
        )
    if not (r["quantize"]["enabled"] and r["huffman"]["enabled"]):
        raise InputError(
            f"{source}: budget.max_drop searches for the smallest archive: it needs quantize "
            "and huffman enabled"
        )


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _fraction(source: str, key: str, v: Any) -> None:
    if not (_number(v) and 0 <= v < 1):
        raise _bad(source, key, v, "a fraction of weights to prune in [0, 1)")


def _int(r, source, section, key, lo, hi=None) -> None:
    v = r[section][key]
    ok = isinstance(v, int) and not isinstance(v, bool) and (lo is None or v >= lo)
    if not ok or (hi is not None and v > hi):
        rng = f"{lo}..{hi}" if hi is not None else f"{lo} or more" if lo is not None else "whole"
        raise _bad(source, f"{section}.{key}", v, f"a whole number, {rng}")


def _positive(r, source, section, key) -> None:
    v = r[section][key]
    if not (_number(v) and v > 0):
        raise _bad(source, f"{section}.{key}", v, "a positive number")


def dumps(recipe: dict[str, Any]) -> str:
    """The recipe as TOML (what --dry-run prints; loads back to the same recipe)."""
    lines = [f"version = {recipe['version']}"]
    for section in list(DEFAULTS)[1:]:  # the sections, in DEFAULTS' order
        lines.append(f"\n[{section}]")
        tables = []
        for key, value in recipe[section].items():
            if value is None:
                continue
            if isinstance(value, dict):
                tables.append((key, value))
            else:
                lines.append(f"{key} = {_toml(value)}")
        for key, value in tables:
            inner = ", ".join(f"{_toml_key(k)} = {_toml(v)}" for k, v in value.items())
            lines.append(f"{key} = {{{inner}}}")
    return "\n".join(lines) + "\n"


def _toml_key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else json.dumps(k)


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return repr(v)
