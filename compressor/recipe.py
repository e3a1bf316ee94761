"""Recipes: the stages of `compress shrink` and their parameters, as TOML or JSON.

A recipe (TOML, YAML or JSON, by the file's suffix) has one section per stage, run in the
pipeline's only valid order (distill -> channels -> prune -> quantize -> huffman -> export): each stage works
on the weights the previous one left, and the Huffman archive is emitted from the final weights. Every key has a default, so an empty recipe
is a complete one; an unknown key or an impossible value is refused, naming the key, before
any work starts. `--dry-run` prints the resolved recipe; the report embeds it.

    version = 1
    [train]     batch_size, microbatches, optimizer, seed, distill (alpha), temperature,
                bn_refresh = 2048 (samples; 0 = off)                # retraining
    [budget]    max_drop = "off" | points, trials, search = "auto" | "layers" | "scale",
                sparsities, bits                                    # --max-drop: the search
    [distill]   student ("" = off), student_kwargs, teachers, epochs, lr, temperature, alpha,
                hint_student, hint_teacher, hint_epochs, transfer, transfer_size, labels
    [channels]  enabled = false, target_macs = 0.5, importance ("l1" | "l2" | "taylor"), scope,
                rounds, retrain_epochs, lr, ignore = [layer, ...], round_to, max_ratio, heads,
                latency = true, target_latency (a fraction of the measured batch-1 time)
    [prune]     enabled, sparsity ("default" | "auto" | 0.9 | {layer = 0.9}) or quality,
                scope, rounds, retrain_epochs, lr, budget, include_bias, embeddings = false
    [quantize]  enabled, method = "kmeans" | "soft", conv_bits = 8, fc_bits = 5,
                bits = {layer = n}, mode, finetune_epochs, lr, dense = "float16" | "float32",
                embeddings = false; soft: prior_epochs, prior_strength, prior_width,
                zero_width, zero_mixing
    [huffman]   enabled, coder = "range" | "huffman", fc_gap_bits = 5, conv_gap_bits = 8,
                gap_bits = "auto" | "fixed" (the gap widths: coder = "huffman" only)
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
import dataclasses
import functools
import json
import math
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from compresskit.compressor.guard import GuardConfig
from compresskit.models.errors import InputError
from compresskit.models.fileio import atomic_path
from compresskit.models.limits import MAX_NESTING, nesting_depth

VERSION = 1
MAX_BITS = 12  # 4,096 shared values per layer; more is no longer weight *sharing*
BUDGET_DISTILL = 0.7  # train.distill's default when budget.max_drop is set
MAX_RECIPE_BYTES = 2**20  # a recipe is a few hundred bytes; this bounds the parsers' work

# One frozen dataclass per [section], fields named and ordered as the file's keys. They are the
# only place defaults live (DEFAULTS below is derived from them). Lists are held as tuples;
# tables ({layer = value}) as dicts that the stages read and never change.


@dataclass(frozen=True)
class TrainSection:
    """[train]: retraining and fine-tuning inside the stages (not `compress train`)."""

    batch_size: int = 32
    # Gradient accumulation: each batch as this many micro-batches, one after another (the
    # same update, dropout's draws aside, in about 1/M of the activation memory; refused for
    # BatchNorm models). "auto": as many as keep one slice's activations within 4x the model's
    # bytes, measured on the model that retrains (1 with BatchNorm, or when they fit already:
    # every zoo model but the ViT, which takes 4 at batch 32: its whole shrink peaked at 818-843
    # MiB with 4 slices against 1,083-1,094 with 1 once the measurement stopped leaking;
    # docs/benchmarks.md, "Peak memory by step").
    microbatches: int | str = "auto"
    optimizer: str = "adam"  # "adam" | "sgd"
    seed: int = 0
    # alpha of the soft-target loss against the dense model while retraining and fine-tuning
    # (0 = plain cross-entropy, as the paper); temperature: Hinton's T.
    distill: float = 0.0
    temperature: float = 4.0
    # After each retraining run, BatchNorm's running statistics re-estimated on this many
    # training samples under the retrained weights (adaptive BatchNorm; 0: keep the running
    # averages), where the run left them more than 1% from before it: a small momentum
    # (torchvision's MobileNetV3 and EfficientNet: 0.01) or a short run. Such a model
    # otherwise tests with statistics of weights that pruning already changed: a
    # MobileNetV3-small shrunk with one retraining epoch per stage, 36.5% against 96.25%.
    # Momentum 0.1 (torch's default) forgets them within ~45 steps: no pass is made.
    bn_refresh: int = 2048


@dataclass(frozen=True)
class BudgetSection:
    """[budget]: an accuracy budget (compressor.budget). max_drop = points of validation
    accuracy the result may lose; "off": the prune and quantize settings as written. Two
    searches try `trials` full shrink runs for the smallest archive within it:
    "layers" picks each layer's sparsity (of `sparsities`) and bits (of `bits`) from per-layer
    curves; "scale" multiplies every layer's kept fraction of the recipe's own sparsities
    (prune.sparsity: "default", a number or a table) by one factor and bisects it, the bits as
    the recipe sets them. "auto": "scale" under quantize.method = "soft" (whose prior prunes
    and shares by itself, which the curves' k-means cannot price), else "layers"."""

    max_drop: float | str = "off"
    trials: int = 6
    search: str = "auto"  # "auto" | "layers" | "scale"
    sparsities: tuple[float, ...] = (0.0, 0.5, 0.7, 0.8, 0.9, 0.93, 0.95, 0.97, 0.98)
    bits: tuple[int, ...] = (2, 3, 4, 5, 6, 8)


@dataclass(frozen=True)
class DistillSection:
    """[distill]: distil the checkpoint (the teacher, with `teachers` as an ensemble) into
    `student` before Deep Compression; student = "" compresses the checkpoint's own model."""

    student: str = ""
    student_kwargs: dict[str, Any] = field(default_factory=dict)
    teachers: tuple[str, ...] = ()
    epochs: int = 10
    lr: float = 3e-3
    temperature: float = 4.0
    alpha: float = 0.7
    # FitNets: first regress layer hint_student onto the teacher's hint_teacher ("" = off).
    hint_student: str = ""
    hint_teacher: str = ""
    hint_epochs: int = 3
    # Transfer set: keep a `labels` fraction of the training labels, label the rest and
    # transfer_size x N synthetic inputs ("mixup" or "munge") with the teacher.
    transfer: str = "none"
    transfer_size: float = 1.0
    labels: float = 1.0


@dataclass(frozen=True)
class ChannelsSection:
    """[channels]: structured pruning before Deep Compression: whole channels, neurons and
    embedding dimensions removed until the model's MACs are target_macs of the original's
    (see compressor.channels). Off by default: it changes the architecture."""

    enabled: bool = False
    target_macs: float = 0.5
    importance: str = "l1"  # "l1" | "l2" | "taylor"
    # "layer": one fraction for every layer; "global": channels ranked across layers;
    # "sensitivity": per-layer fractions from each layer cut alone on the validation split
    scope: str = "layer"
    rounds: int = 3
    retrain_epochs: int = 1
    lr: float = 3e-3
    ignore: tuple[str, ...] = ()
    round_to: int = 0
    max_ratio: float = 0.9
    # fraction of each attention layer's heads removed whole (q/k/v attention with a fixed
    # head size: Hugging Face ViT/BERT); 0 keeps every head
    heads: float = 0.0
    # also keep at most this fraction of the model's batch-1 time on ONNX Runtime's CPU provider
    # (the INT8 file when [export] writes one), measured per layer before cutting; unset: MACs
    # alone decide, which on ResNet-18 left INT8 time at 0.66 for 0.48 of the MACs
    target_latency: float | None = None
    # with [export]: time the unthinned and thinned ONNX files (FP32, INT8; batch 1 and 64)
    # side by side into the report (costs one more export and quantization)
    latency: bool = True


@dataclass(frozen=True)
class PruneSection:
    """[prune]: magnitude pruning with retraining (Han et al. 2015). Give `sparsity` or
    `quality` (threshold = quality x each layer's weight std), not both: set the other None."""

    enabled: bool = True
    # "default": per-layer fractions by role (see compressor.shrink.default_sparsity);
    # "auto": the sensitivity analysis proposes them within `budget`; a fraction; or a table
    # {layer = fraction} (layers it does not name stay unpruned, as the dry-run plan shows).
    sparsity: str | float | dict[str, float] | None = "default"
    quality: float | None = None
    scope: str = "layer"  # "layer" | "global" (one threshold over all layers)
    rounds: int = 3
    # Retrain at the teacher's peak learning rate: on digits/LeNet-300 this recovered the
    # baseline accuracy on 3 of 3 seeds, where 1e-3 lost 0.3-0.8 points.
    retrain_epochs: int = 4
    lr: float = 3e-3
    budget: float = 0.02
    include_bias: bool = False
    # nn.Embedding tables too (off: the paper prunes Linear and Conv layers only)
    embeddings: bool = False


@dataclass(frozen=True)
class QuantizeSection:
    """[quantize]: weight sharing. "kmeans": the paper's k-means then centroid fine-tuning;
    "soft": soft weight-sharing (Ullrich et al. 2017, compressor.softshare), retraining under
    a Gaussian-mixture prior with the prior_* keys, snapped to its means, then the same
    fine-tuning."""

    enabled: bool = True
    method: str = "kmeans"
    conv_bits: int = 8
    fc_bits: int = 5
    bits: dict[str, int] = field(default_factory=dict)  # {layer = bits} overrides
    mode: str = "centroids"  # "centroids" | "weights" (what fine-tuning trains)
    prior_epochs: int = 6
    prior_strength: float = 1.0
    prior_width: float = 0.1
    zero_width: float = 0.4
    zero_mixing: float = 0.2
    finetune_epochs: int = 3
    lr: float = 1e-3
    # How tensors that are not shared are stored: biases, norms, and any shared layer whose
    # dense record is smaller than its shared one (measured per layer).
    dense: str = "float16"
    embeddings: bool = False  # share the weights of nn.Embedding tables too


@dataclass(frozen=True)
class HuffmanSection:
    """[huffman]: the .dcz archive of cluster indices and positions.

    `coder = "range"` (format 3): range coding under adaptive context models, smaller on every
    model measured (docs/archive-format.md); `"huffman"` (format 2): the paper's Huffman-coded
    indices and relative (gap) positions, with the gap widths below."""

    enabled: bool = True
    coder: str = "range"
    fc_gap_bits: int = 5
    conv_gap_bits: int = 8
    # "auto": per layer, the gap width whose Huffman-coded size (with its code table) is
    # smallest; "fixed": the fc/conv widths above, as the paper.
    gap_bits: str = "auto"


@dataclass(frozen=True)
class ExportSection:
    """[export]: ONNX FP32, INT8 (ONNX Runtime static quantization) and the mobile .ort."""

    enabled: bool = True
    opset: int = 18
    # 0: the lowest IR that declares the opset (8 for opset 18: ONNX Runtime >= 1.14);
    # 9 for ONNX Runtime 1.15-1.17
    ir_version: int = 0
    int8: bool = True
    method: str = "minmax"  # calibration: "minmax" | "entropy" | "percentile"
    calibration: int = 256  # samples drawn from the training set...
    calibration_data: str = ""  # ...or a .npy file of inputs (samples first) to draw from
    # "mobile": nothing is timed on the build machine, INT8 wherever min_agreement holds,
    # the same bytes on every build; "host": also keep node groups in FP32 where timings on
    # this machine say INT8 is slower beyond a 95% confidence interval
    target: str = "mobile"
    scheme: str = "u8s8"  # uint8 activations with int8 ("u8s8") or uint8 ("u8u8") weights
    # 7-bit weights: "auto" turns them on for target host on an x86 CPU without VNNI
    reduce_range: bool | str = "auto"
    min_agreement: float = 0.995
    ort: bool = True  # also the .ort file for mobile ORT builds, and the NNAPI/CoreML verdicts
    fixed_batch: int = 0  # N > 0: also MODEL.int8.fixed.onnx with batch N (NNAPI needs it)


@dataclass(frozen=True)
class GuardSection:
    """[guard]: guardrails (compressor.guard). A stage that costs more than max_stage_drop
    points of test accuracy, an INT8 file under its agreement floor, a student bigger than its
    teacher are said on stderr; strict = true (or --strict) fails the run, nothing written."""

    max_stage_drop: float = 2.0
    strict: bool = False


_SECTIONS: dict[str, type] = {
    "train": TrainSection,
    "budget": BudgetSection,
    "distill": DistillSection,
    "channels": ChannelsSection,
    "prune": PruneSection,
    "quantize": QuantizeSection,
    "huffman": HuffmanSection,
    "export": ExportSection,
    "guard": GuardSection,
}


def _plain(v: Any) -> Any:
    """A field's value as the file holds it: tuples as lists, tables copied."""
    if isinstance(v, tuple | list):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _native(v: Any) -> Any:
    """`v` with numpy scalars as Python numbers; `v` itself when it holds none."""
    if type(v).__module__ == "numpy" and getattr(v, "ndim", None) == 0:
        return v.item()
    if isinstance(v, list | tuple):
        items = [_native(x) for x in v]
        return type(v)(items) if any(a is not b for a, b in zip(items, v, strict=True)) else v
    if isinstance(v, dict):
        items = {k: _native(x) for k, x in v.items()}
        return items if any(items[k] is not v[k] for k in v) else v
    return v


def _held(v: Any) -> Any:
    """A file's value as a section holds it: lists as tuples, tables copied."""
    if isinstance(v, list | tuple):
        return tuple(_held(x) for x in v)
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _section_dict(section: Any) -> dict[str, Any]:
    return {f.name: _plain(getattr(section, f.name)) for f in fields(section)}


@dataclass(frozen=True)
class Recipe:
    """What `compress shrink` does: one frozen section per stage, validated as a whole.

    Build one from a file (`Recipe.load("recipe.toml")`, TOML, YAML or JSON by suffix), from
    the file's table (`Recipe.from_dict({"prune": {"sparsity": 0.9}})`), or from sections
    (`Recipe(prune=PruneSection(sparsity=0.9))`); change one with `recipe.replace(prune=...)`.
    Each way checks every key and value before any work starts (`InputError` naming the key
    and the fix). `dumps()` / `dump(path)` write it back; loading that gives an equal Recipe.

    One difference between the two ways: a table that sets `budget.max_drop` and leaves
    `train.distill` out gets distill = 0.7 (retraining against the dense model's outputs,
    which a tight budget needs); sections built in Python take the field as written.
    """

    version: int = VERSION
    train: TrainSection = field(default_factory=TrainSection)
    budget: BudgetSection = field(default_factory=BudgetSection)
    distill: DistillSection = field(default_factory=DistillSection)
    channels: ChannelsSection = field(default_factory=ChannelsSection)
    prune: PruneSection = field(default_factory=PruneSection)
    quantize: QuantizeSection = field(default_factory=QuantizeSection)
    huffman: HuffmanSection = field(default_factory=HuffmanSection)
    export: ExportSection = field(default_factory=ExportSection)
    guard: GuardSection = field(default_factory=GuardSection)

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            value = getattr(self, name)
            if not isinstance(value, cls):
                raise InputError(
                    f"recipe: {name} is {type(value).__name__}, not a {cls.__name__}; build it "
                    f"as {cls.__name__}(...) or the whole recipe with Recipe.from_dict({{...}})"
                )
            # numpy scalars (a notebook's np.int64(4) bits) as the Python numbers they hold:
            # np.int64 was refused as "not a whole number" while np.float64 passed
            native = {f.name: _native(getattr(value, f.name)) for f in fields(value)}
            if any(native[k] is not getattr(value, k) for k in native):
                object.__setattr__(self, name, dataclasses.replace(value, **native))
        if self.version != VERSION:
            raise InputError(
                f"recipe: version {self.version!r}; this compress reads version {VERSION}"
            )
        _validate(self.to_dict(), "recipe")

    @classmethod
    def load(cls, path: str | Path) -> Recipe:
        """Read a recipe file (.toml, .yaml/.yml or .json by suffix), resolved and checked."""
        return load(path)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None = None, source: str = "recipe") -> Recipe:
        """A recipe from a file's table: defaults overlaid with `raw`, checked as a whole."""
        return resolve(raw, source)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (dicts, lists, numbers, strings), as JSON and the report hold it."""
        out: dict[str, Any] = {"version": self.version}
        for name in _SECTIONS:
            out[name] = _section_dict(getattr(self, name))
        return out

    def dumps(self, format: str = "toml") -> str:
        """The recipe as "toml" (what --dry-run prints), "json" or "yaml" text."""
        if format == "toml":
            return dumps(self)
        if format == "json":
            return json.dumps(self.to_dict(), indent=2) + "\n"
        if format == "yaml":
            import yaml

            # quoted wherever `load` would read a number: a string such as "2e3" went out
            # bare, came back a float, and the file was refused
            return yaml.dump(self.to_dict(), Dumper=_yaml_dumper(), sort_keys=False)
        raise InputError(f"recipe format {format!r}: one of toml, json, yaml")

    def dump(self, path: str | Path) -> Path:
        """Write the recipe to `path` (format by suffix, as `load` reads it), atomically."""
        path = Path(path)
        fmt = _format_of(path)
        with atomic_path(path) as tmp:
            Path(tmp).write_text(self.dumps(fmt), encoding="utf-8")
        return path

    def replace(self, **sections: Any) -> Recipe:
        """A copy with whole sections replaced (`recipe.replace(prune=PruneSection(...))`),
        checked again."""
        names = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(k for k in sections if k not in names)
        if unknown:
            raise InputError(
                f"Recipe.replace: {unknown[0]!r} is no section; give whole sections by name "
                f"({', '.join(names)}), e.g. recipe.replace(prune=PruneSection(sparsity=0.8))"
            )
        return dataclasses.replace(self, **sections)


def _build(resolved: dict[str, Any]) -> Recipe:
    """The Recipe of a resolved, validated table."""
    sections = {
        name: cls(**{k: _held(v) for k, v in resolved[name].items()})
        for name, cls in _SECTIONS.items()
    }
    return Recipe(version=resolved["version"], **sections)


# The defaults as a file's table (what an empty recipe resolves to).
DEFAULTS: dict[str, Any] = {"version": VERSION} | {
    name: _section_dict(cls()) for name, cls in _SECTIONS.items()
}


_CHOICES = {
    ("train", "optimizer"): ("adam", "sgd"),
    ("prune", "scope"): ("layer", "global"),
    ("channels", "importance"): ("l1", "l2", "taylor"),
    ("channels", "scope"): ("layer", "global", "sensitivity"),
    ("quantize", "method"): ("kmeans", "soft"),
    ("quantize", "mode"): ("centroids", "weights"),
    ("quantize", "dense"): ("float16", "float32"),
    ("huffman", "coder"): ("range", "huffman"),
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


def load(path: str | Path) -> Recipe:
    """Read a recipe file (.toml, .yaml or .json) and resolve it against the defaults."""
    return resolve(read(path), source=str(path))


def _format_of(path: Path) -> str:
    """A recipe file's format by its suffix, in any case (.JSON was read as TOML)."""
    return {".json": "json", ".yaml": "yaml", ".yml": "yaml"}.get(path.suffix.lower(), "toml")


def read(path: str | Path) -> dict[str, Any]:
    """A recipe file's raw table, not yet resolved (so flags can be laid over it first).

    Checked before any work: at most `MAX_RECIPE_BYTES`, no YAML aliases (a few hundred bytes
    of nested aliases expand to billions of values), and at most `limits.MAX_NESTING` levels
    of tables and lists.
    """
    path = Path(path)
    if path.is_dir():
        raise InputError(f"recipe file {path}: a folder, not a file; give the recipe's file")
    if not path.is_file():
        raise InputError(f"recipe file {path}: no such file")
    kind = _format_of(path).upper()
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_RECIPE_BYTES + 1)
    except OSError as e:
        raise InputError(f"recipe file {path}: cannot read it ({e.strerror})") from None
    if len(data) > MAX_RECIPE_BYTES:
        raise InputError(
            f"recipe file {path}: over {MAX_RECIPE_BYTES // 2**20} MiB, far more than any recipe "
            "(a few hundred bytes); is it the right file?"
        )
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):  # Notepad's "Unicode": UTF-16 with its mark
        raise InputError(f"recipe file {path}: saved as UTF-16; save it as UTF-8")
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark, as Windows editors write, is no key
    except UnicodeDecodeError as e:
        raise InputError(
            f"recipe file {path}: not UTF-8 (byte {data[e.start]:#04x} at {e.start}); save it "
            "as UTF-8"
        ) from None
    try:
        if kind == "JSON":
            raw = json.loads(text, object_pairs_hook=_unique_keys)
        elif kind == "YAML":
            raw = _yaml(text, path)
            raw = {} if raw is None else raw  # an empty file, as an empty TOML or JSON {}
        else:
            raw = tomllib.loads(text)
    except InputError:
        raise
    except RecursionError:  # json and tomllib recurse once per level of nesting
        raise _too_deep(path) from None
    except Exception as e:  # each parser raises its own error types
        detail = " ".join(str(e).split())
        raise InputError(f"recipe file {path}: not valid {kind}: {detail}") from None
    if nesting_depth(raw) > MAX_NESTING:
        raise _too_deep(path)
    if not isinstance(raw, dict):
        raise InputError(f"recipe file {path}: a recipe is a table of sections")
    if isinstance(raw.get("recipe"), dict) and (
        "baseline" in raw or set(raw) <= {"recipe", "plan"}
    ):
        # A report.json, or `--dry-run --json`'s output: the recipe it holds. Passing the
        # report back was refused as "unknown key 'baseline'". (A recipe file with a [recipe]
        # table is refused below as the unknown key it is.)
        return raw["recipe"]
    return raw


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different (json keeps the last of a repeated key
    silently, as TOML refuses and archives refuse): ValueError naming the repeated key."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} given twice in one table")
        out[k] = v
    return out


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
                    f"recipe file {path}: YAML alias *{event.anchor} (line {line}); compress "
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
    _yaml_unique_keys(yaml.compose(text, Loader=loader), path)
    return yaml.load(text, Loader=_yaml_loader(loader))  # a SafeLoader: plain data only


@functools.cache
def _yaml_dumper() -> Any:
    """SafeDumper with the float resolver `_yaml_loader` reads by, so it quotes such strings."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    Dumper.yaml_implicit_resolvers = _yaml_loader(yaml.SafeLoader).yaml_implicit_resolvers
    return Dumper


@functools.cache
def _yaml_loader(base: Any) -> Any:
    """`base` reading floats as YAML 1.2 and JSON do: YAML 1.1 wants a dot in every float, so
    `lr: 3e-4` was the string '3e-4' and refused as "not a positive number"."""
    import re

    class Loader(base):
        pass

    Loader.yaml_implicit_resolvers = {
        k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:float"]
        for k, v in base.yaml_implicit_resolvers.items()
    }
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(
            r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
            |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
            |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
            |[-+]?\.(?:inf|Inf|INF)
            |\.(?:nan|NaN|NAN))$""",
            re.X,
        ),
        list("-+0123456789."),
    )
    return Loader


def _yaml_unique_keys(node: Any, path: Path) -> None:
    """Refuse a YAML mapping that repeats a key (PyYAML keeps the last one silently)."""
    import yaml

    todo = [node]
    while todo:
        n = todo.pop()
        if isinstance(n, yaml.MappingNode):
            seen: set[str] = set()
            for key, value in n.value:
                if isinstance(key, yaml.ScalarNode):
                    if key.value in seen:
                        line = key.start_mark.line + 1 if key.start_mark else "?"
                        raise InputError(
                            f"recipe file {path}: not valid YAML: key {key.value!r} given twice in "
                            f"one table (line {line})"
                        )
                    seen.add(key.value)
                todo.append(value)
        elif isinstance(n, yaml.SequenceNode):
            todo.extend(n.value)


def _too_deep(path: Path) -> InputError:
    return InputError(
        f"recipe file {path}: nested more than {MAX_NESTING} levels deep; a recipe is sections of "
        "key = value, a value a table or list at most a few levels deep"
    )


def resolve(raw: dict[str, Any] | None = None, source: str = "recipe") -> Recipe:
    """Defaults overlaid with `raw` (a file's table), validated as a whole."""
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
            if type(value) is not int or value != VERSION:  # true == 1 == 1.0 in Python
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
    if "sparsity" in raw.get("prune", {}) and "quality" not in raw.get("prune", {}):
        out["prune"]["quality"] = None
    if raw.get("prune", {}).get("quality") is not None and "sparsity" not in raw.get("prune", {}):
        out["prune"]["sparsity"] = None
    if out["budget"]["max_drop"] is False:
        # a file's `max_drop = false`, and YAML's `max_drop: off` (YAML 1.1 reads it as false):
        # "off" in every respect, the train.distill default below included
        out["budget"]["max_drop"] = "off"
    if out["budget"]["max_drop"] != "off" and "distill" not in raw.get("train", {}):
        # A budget's trials retrain against the dense model's outputs unless told otherwise:
        # plain retraining drifts the model by more than a tight budget (docs/benchmarks.md).
        out["train"]["distill"] = BUDGET_DISTILL
    _validate(out, source)
    return _build(out)


def _bad(source: str, key: str, value: Any, fix: str) -> InputError:
    shown = repr(value)
    if len(shown) > 60:  # a 4,000-digit integer was echoed whole
        shown = f"{shown[:40]}... ({len(shown):,} characters)"
    return InputError(f"{source}: {key} = {shown} is impossible; {fix}")


def _validate(r: dict[str, Any], source: str) -> None:
    for (section, key), choices in _CHOICES.items():
        if r[section][key] not in choices:
            raise _bad(source, f"{section}.{key}", r[section][key], f"one of {', '.join(choices)}")
    for section, key in (
        ("channels", "enabled"),
        ("prune", "enabled"),
        ("quantize", "enabled"),
        ("huffman", "enabled"),
        ("channels", "latency"),
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
    tl = c["target_latency"]
    if tl is not None and not (_number(tl) and 0 < tl <= 1):
        raise _bad(source, "channels.target_latency", tl, "a fraction in (0, 1]")
    if not (_number(c["max_ratio"]) and 0 < c["max_ratio"] < 1):
        raise _bad(source, "channels.max_ratio", c["max_ratio"], "a fraction in (0, 1)")
    if not (_number(c["heads"]) and 0 <= c["heads"] < 1):
        raise _bad(source, "channels.heads", c["heads"], "a fraction in [0, 1)")
    _int(r, source, "channels", "rounds", 1, 100)
    _int(r, source, "channels", "retrain_epochs", 0, MAX_EPOCHS)
    _int(r, source, "channels", "round_to", 0, 1024)
    _positive(r, source, "channels", "lr")
    if not (isinstance(c["ignore"], list) and all(isinstance(n, str) for n in c["ignore"])):
        raise _bad(source, "channels.ignore", c["ignore"], "a list of layer names")
    _int(r, source, "train", "batch_size", 1)
    if r["train"]["microbatches"] != "auto":
        _int(r, source, "train", "microbatches", 1, r["train"]["batch_size"])
    _int(r, source, "train", "seed", 0, 2**32 - 1)
    _int(r, source, "train", "bn_refresh", 0)
    if not (_number(r["train"]["distill"]) and 0 <= r["train"]["distill"] <= 1):
        raise _bad(source, "train.distill", r["train"]["distill"], "an alpha in [0, 1]")
    _temperature(r, source, "train")
    p = r["prune"]
    s, q = p["sparsity"], p["quality"]
    if s is None and q is None:
        raise InputError(f"{source}: prune needs a sparsity or a quality (neither is given)")
    if s is not None and q is not None:
        raise InputError(f"{source}: prune needs sparsity or quality, not both")
    if isinstance(s, dict):
        if not s:
            raise _bad(
                source,
                "prune.sparsity",
                s,
                "name layers, {fc1 = 0.9}, or give one fraction (0.0, or prune.enabled = false, "
                "prunes nothing)",
            )
        for layer, v in s.items():
            _dotted_name(source, "prune.sparsity", layer, v, 0.5)
            _fraction(source, f"prune.sparsity.{layer}", v)
    elif s is not None and s not in ("default", "auto"):
        _fraction(source, "prune.sparsity", s)
    if q is not None and not (_number(q) and q > 0):
        raise _bad(source, "prune.quality", q, "a positive number (threshold = quality x std)")
    if p["scope"] == "global" and not _number(s):
        raise InputError(f"{source}: prune.scope = 'global' needs one sparsity number")
    _int(r, source, "prune", "rounds", 1, 100)
    _int(r, source, "prune", "retrain_epochs", 0, MAX_EPOCHS)
    _positive(r, source, "prune", "lr")
    if not (_number(p["budget"]) and 0 <= p["budget"] < 1):
        raise _bad(source, "prune.budget", p["budget"], "an accuracy drop in [0, 1), e.g. 0.02")
    qz = r["quantize"]
    for key in ("conv_bits", "fc_bits"):
        _int(r, source, "quantize", key, 1, MAX_BITS)
    if not isinstance(qz["bits"], dict):
        raise _bad(source, "quantize.bits", qz["bits"], "a table {layer = bits}")
    for layer, b in qz["bits"].items():
        _dotted_name(source, "quantize.bits", layer, b, 4)
        if not (isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= MAX_BITS):
            raise _bad(source, f"quantize.bits.{layer}", b, f"whole bits 1..{MAX_BITS}")
    _int(r, source, "quantize", "finetune_epochs", 0, MAX_EPOCHS)
    _positive(r, source, "quantize", "lr")
    _int(r, source, "quantize", "prior_epochs", 0, MAX_EPOCHS)
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
    null = _null_at(dd["student_kwargs"])
    if null is not None:
        raise InputError(
            f"{source}: distill.student_kwargs.{null} is null; leave the key out for the "
            "model's default (a recipe prints as TOML, which has no null)"
        )
    if not (isinstance(dd["teachers"], list) and all(isinstance(t, str) for t in dd["teachers"])):
        raise _bad(source, "distill.teachers", dd["teachers"], "a list of checkpoint paths")
    if dd["student_kwargs"] and not dd["student"]:
        raise InputError(
            f"{source}: distill.student_kwargs (--student-kwargs) needs a distill.student "
            "(--student NAME) to build"
        )
    twice = sorted({t for t in dd["teachers"] if dd["teachers"].count(t) > 1})
    if twice:
        raise InputError(
            f"{source}: distill.teachers names {twice[0]!r} twice (--teacher given twice?); "
            "each teacher once: a repeat would double its weight in the soft targets"
        )
    if dd["teachers"] and not dd["student"]:
        raise InputError(f"{source}: distill.teachers needs a distill.student to teach")
    # `~` as a shell would expand it (a stored recipe names files in a home folder); relative
    # paths stay relative to the folder compress runs in, as on the command line
    dd["teachers"] = [os.path.expanduser(t) for t in dd["teachers"]]
    _int(r, source, "distill", "epochs", 1, MAX_EPOCHS)
    _positive(r, source, "distill", "lr")
    _temperature(r, source, "distill")
    if not (_number(dd["alpha"]) and 0 <= dd["alpha"] <= 1):
        raise _bad(source, "distill.alpha", dd["alpha"], "a weight in [0, 1]")
    for key in ("hint_student", "hint_teacher"):
        if not isinstance(dd[key], str):
            raise _bad(source, f"distill.{key}", dd[key], "a layer name, e.g. 'features.3'")
    if bool(dd["hint_student"]) != bool(dd["hint_teacher"]):
        raise InputError(f"{source}: distill.hint_student and distill.hint_teacher go together")
    if dd["hint_student"] and not dd["student"]:
        raise InputError(f"{source}: distill.hint_student needs a distill.student")
    _int(r, source, "distill", "hint_epochs", 1, MAX_EPOCHS)
    if not (_number(dd["transfer_size"]) and 0 <= dd["transfer_size"] <= 100):
        raise _bad(source, "distill.transfer_size", dd["transfer_size"], "a multiple 0..100 of N")
    if not (_number(dd["labels"]) and 0 < dd["labels"] <= 1):
        raise _bad(source, "distill.labels", dd["labels"], "a fraction in (0, 1]")
    _int(r, source, "export", "opset", 13, 23)
    if r["export"]["ir_version"] not in (0, 7, 8, 9, 10, 11):
        raise _bad(
            source, "export.ir_version", r["export"]["ir_version"], "0 (default), 7, 8, 9, 10 or 11"
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
    r["export"]["calibration_data"] = os.path.expanduser(r["export"]["calibration_data"])
    _int(r, source, "export", "fixed_batch", 0, 1 << 20)
    if not (_number(r["export"]["min_agreement"]) and 0 <= r["export"]["min_agreement"] <= 1):
        raise _bad(
            source, "export.min_agreement", r["export"]["min_agreement"], "a fraction in [0, 1]"
        )
    if r["huffman"]["enabled"] and not qz["enabled"]:
        raise InputError(f"{source}: huffman codes the shared weights; enable quantize too")
    _validate_budget(r, source)
    try:
        GuardConfig(**r["guard"])
    except InputError as e:
        raise InputError(f"{source}: {e}") from None


def _validate_budget(r: dict[str, Any], source: str) -> None:
    b = r["budget"]
    if b["max_drop"] != "off" and not (_number(b["max_drop"]) and 0 <= b["max_drop"] < 100):
        raise _bad(
            source, "budget.max_drop", b["max_drop"], 'points of accuracy in [0, 100), or "off"'
        )
    _int(r, source, "budget", "trials", 1, 100)
    if b["search"] not in SEARCHES:
        raise _bad(source, "budget.search", b["search"], '"auto", "layers" or "scale"')
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
    given = (
        f"prune.quality = {p['quality']!r}"
        if p["quality"] is not None
        else f"prune.sparsity = {p['sparsity']!r}"
    )
    if budget_search(b["search"], r["quantize"]["method"]) == "scale":
        how = 'budget.search = "scale"' + (
            ' (the default under quantize.method = "soft")' if b["search"] == "auto" else ""
        )
        if not p["enabled"]:
            raise InputError(
                f"{source}: {how} scales prune.sparsity, and prune is disabled; enable it, "
                'or set budget.search = "layers"'
            )
        if p["quality"] is not None or p["sparsity"] == "auto":
            raise InputError(
                f"{source}: {how} scales each layer's prune.sparsity, and {given} sets none "
                'before the run; give "default", a number or a table, or set budget.search = '
                '"layers"'
            )
    elif p["enabled"] and (
        p["quality"] is not None or p["sparsity"] == "auto" or _number(p["sparsity"])
    ):
        raise InputError(
            f"{source}: budget.max_drop chooses each layer's sparsity, and {given} sets them "
            "all; drop one of the two (a table {layer = s} fixes only the layers it names), "
            'or set budget.search = "scale" to search one factor on them'
        )
    if not (r["quantize"]["enabled"] and r["huffman"]["enabled"]):
        raise InputError(
            f"{source}: budget.max_drop searches for the smallest archive: it needs quantize "
            "and huffman enabled"
        )


SEARCHES = ("auto", "layers", "scale")


def budget_search(search: str, method: str) -> str:
    """The search a budget runs: budget.search, with "auto" resolved by quantize.method."""
    if search != "auto":
        return search
    return "scale" if method == "soft" else "layers"


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _dotted_name(source: str, table: str, layer: str, v: Any, example: Any) -> None:
    """A per-layer table's value that is itself a table: TOML read unquoted dotted layer names
    (features.0 = 0.5, features.3 = 0.7) as nested keys; say so rather than
    "features = {'0': 0.5, '3': 0.7} is impossible"."""
    if not isinstance(v, dict) or not v:
        return
    names: list[tuple[str, Any]] = []
    todo = [(layer, v)]
    while todo:
        prefix, value = todo.pop(0)
        if isinstance(value, dict) and value:
            todo.extend((f"{prefix}.{k}", x) for k, x in value.items())
        else:
            names.append((prefix, value))
    quoted = ", ".join(f'"{n}" = {x if _number(x) else example}' for n, x in names[:3]) + (
        ", ..." if len(names) > 3 else ""
    )
    raise InputError(
        f"{source}: {table} names layer {names[0][0]!r} unquoted; quote dotted names: {{{quoted}}}"
    )


def _fraction(source: str, key: str, v: Any) -> None:
    if not (_number(v) and 0 <= v < 1):
        raise _bad(source, key, v, "a fraction of weights to prune in [0, 1)")


# Epochs of one stage: a hundred billion was accepted and trained "forever" (rounds and batch
# sizes had bounds); ten thousand is past any recipe's need and still a finite run.
MAX_EPOCHS = 10_000


def _int(r, source, section, key, lo, hi=None) -> None:
    v = r[section][key]
    ok = isinstance(v, int) and not isinstance(v, bool) and (lo is None or v >= lo)
    if not ok or (hi is not None and v > hi):
        rng = f"{lo}..{hi}" if hi is not None else f"{lo} or more" if lo is not None else "whole"
        raise _bad(source, f"{section}.{key}", v, f"a whole number, {rng}")


# Hinton's T: 1-20 in the paper. The loss is float32 times T^2: at T = 1e5 it went negative, at
# 1e12 the student stayed at chance (exit 0), at 1e20 it diverged, blamed on the learning rate.
MAX_TEMPERATURE = 100.0


def _temperature(r, source, section) -> None:
    v = r[section]["temperature"]
    if not (_number(v) and 0 < v <= MAX_TEMPERATURE):
        raise _bad(
            source, f"{section}.temperature", v, f"a temperature in (0, {MAX_TEMPERATURE:g}]"
        )


def _positive(r, source, section, key) -> None:
    v = r[section][key]
    if not (_number(v) and v > 0):
        raise _bad(source, f"{section}.{key}", v, "a positive number")


def dumps(recipe: Recipe | dict[str, Any]) -> str:
    """The recipe (or a report's copy of one) as TOML: what --dry-run prints; loads back to
    the same recipe."""
    if isinstance(recipe, Recipe):
        recipe = recipe.to_dict()
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
            lines.append(f"{key} = {_toml(value)}")
    return "\n".join(lines) + "\n"


def _toml_key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else json.dumps(k)


def _toml(v: Any) -> str:
    """One TOML value, nested lists and tables included (a Python repr, as nested values were
    written, is no TOML: {'a': 1}, [True], None)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string: the same escapes as JSON
    if isinstance(v, int | float):
        return repr(v)  # TOML writes inf, -inf and nan as Python does
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml(x)}" for k, x in v.items()) + "}"
    raise InputError(f"recipe value {v!r}: TOML has no such value")


def _null_at(v: Any, where: str = "") -> str | None:
    """The dotted key of the first null in nested tables and lists, or None."""
    if v is None:
        return where or "(value)"
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, x in items:
        found = _null_at(x, f"{where}.{k}" if where else str(k))
        if found is not None:
            return found
    return None
