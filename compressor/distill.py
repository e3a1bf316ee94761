"""Knowledge distillation: Hinton, Vinyals & Dean, "Distilling the Knowledge in a Neural
Network" (2015), with the ensemble teacher and transfer set of Bucilua, Caruana &
Niculescu-Mizil, "Model Compression" (KDD 2006) and the hint training of Romero et al.,
"FitNets: Hints for Thin Deep Nets" (ICLR 2015, arXiv 1412.6550).

`kd_loss` is the pure loss: soft targets at temperature T (the KL term scaled by T^2, so its
gradients keep their size as T changes) mixed with the hard-label cross-entropy by alpha.
`shrink` uses it to retrain a pruned or weight-shared model against the dense model it came
from (`[train] distill = alpha`): the dense model's soft targets carry what pruning removed.

`distill_student` is the `[distill]` stage: optionally a FitNets hint phase (a student layer
regressed onto a teacher layer through a learned adapter), then KD on the training set or on a
transfer set. The transfer set is for scarce labels: the training inputs whose labels are kept
(`labels`, a fraction) keep them, the rest and `transfer_size` x N synthetic inputs are labelled
by the teacher. Synthetic inputs are either MUNGE (Bucilua 2006, Algorithm 1: swap each feature
with the nearest neighbour's, plus Gaussian noise of the pair's local spread) or mixup
(Zhang et al. 2018: convex combinations of two random training inputs). Both blend or perturb
input values, which token ids are not (id 412.5 means nothing): on token data only the
`labels` fraction and `transfer = "none"` apply; hints and plain KD work on any input.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from compresskit import _datapass, _mem
from compresskit.models import checkpoint, zoo
from compresskit.models import data as data_mod
from compresskit.models.data import Dataset
from compresskit.models.errors import InputError, StageError
from compresskit.models.zoo import ModelSpec


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 4.0,
    alpha: float = 0.5,
) -> torch.Tensor:
    """(1 - alpha) * CE(student, labels) + alpha * T^2 * KL(teacher_T || student_T).

    `teacher_logits` of shape (members, batch, classes) is an ensemble: its soft target is the
    average of the members' softmax at T (Bucilua et al. 2006), not the softmax of averaged logits.
    """
    t = temperature
    teacher = teacher_logits.float()
    if teacher.ndim == 3:
        target = F.softmax(teacher / t, dim=-1).mean(0).clamp_min(1e-12).log()
    else:
        target = F.log_softmax(teacher / t, dim=1)
    soft = F.kl_div(
        F.log_softmax(student_logits.float() / t, dim=1),
        target,
        reduction="batchmean",
        log_target=True,
    )
    hard = F.cross_entropy(student_logits.float(), labels)
    return (1 - alpha) * hard + alpha * t * t * soft


class Ensemble(nn.Module):
    """Teachers side by side: forward stacks their logits (members, batch, classes)."""

    def __init__(self, members: list[nn.Module]) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([m(x) for m in self.members])


class AveragedEnsemble(Ensemble):
    """The ensemble as one classifier: log of the members' averaged softmax (for accuracy)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(super().forward(x), dim=-1).mean(0).log()


def loss_with_teacher(teacher: nn.Module, temperature: float, alpha: float):
    """A training-loop loss `(model, x, y) -> (loss, logits)` that distils from `teacher`."""
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
        with torch.no_grad():
            target = teacher(x)
        logits = model(x)
        return kd_loss(logits, target, y, temperature, alpha), logits

    return loss_fn


# --- transfer sets --------------------------------------------------------------------------

TRANSFER = ("none", "mixup", "munge")


def munge(
    x: np.ndarray, neighbour: np.ndarray, p: float, s: float, rng: np.random.Generator
) -> np.ndarray:
    """One MUNGE pass (Bucilua et al. 2006, continuous attributes): for each example e and its
    nearest neighbour e' = x[neighbour], each attribute a is, with probability p, replaced by a
    draw from N(e'_a, |e_a - e'_a| / s); otherwise kept. Returns len(x) new examples."""
    flat = x.reshape(len(x), -1)
    other = flat[neighbour]
    swap = rng.random(flat.shape) < p
    sd = np.abs(flat - other) / s
    drawn = other + sd * rng.standard_normal(flat.shape)
    return np.where(swap, drawn, flat).astype(x.dtype).reshape(x.shape)


def mixup(x: np.ndarray, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n convex combinations lam * x_i + (1 - lam) * x_j of random pairs, lam ~ U(0, 1).
    Returns the inputs and their lambdas."""
    i, j = rng.integers(0, len(x), n), rng.integers(0, len(x), n)
    lam = rng.random(n).astype(x.dtype)
    shape = (n,) + (1,) * (x.ndim - 1)
    return lam.reshape(shape) * x[i] + (1 - lam.reshape(shape)) * x[j], lam


def synthetic_inputs(x: np.ndarray, kind: str, size: float, seed: int) -> np.ndarray:
    """round(size * len(x)) synthetic inputs of `kind` (mixup or munge), clipped to the
    training inputs' range."""
    n = round(size * len(x))
    rng = np.random.default_rng(seed)
    if kind == "none" or n == 0:
        return x[:0]
    if kind == "mixup":
        out = mixup(x, n, rng)[0]
    else:
        from sklearn.neighbors import NearestNeighbors

        flat = x.reshape(len(x), -1)
        # The nearest neighbour other than the example itself.
        neighbour = NearestNeighbors(n_neighbors=2).fit(flat).kneighbors(flat)[1][:, 1]
        passes = [munge(x, neighbour, p=0.5, s=1.0, rng=rng) for _ in range(math.ceil(n / len(x)))]
        out = np.concatenate(passes)[rng.permutation(len(x) * len(passes))[:n]]
    return np.clip(out, x.min(), x.max())


def check_transfer(d: Any, data: Dataset) -> None:
    """Refuse a synthetic transfer set (mixup, MUNGE) on int64 token ids: both make inputs by
    blending or perturbing values, which ids are not."""
    if data.is_tokens and d.transfer != "none":
        raise InputError(
            f"distill.transfer = {d.transfer!r}: synthetic inputs blend or perturb input "
            f'values, but --data {data.spec} is int64 token ids; use transfer = "none" '
            "(distill.labels still makes labels scarce)"
        )


@_datapass.counted
@torch.no_grad()
def teacher_labels(teacher: nn.Module, x: torch.Tensor, batch: int | None = None) -> torch.Tensor:
    """The teacher's top-1 class for each input (an Ensemble: of its averaged probabilities);
    `batch` None: sized to the teacher's activations (`compresskit._mem.eval_batch`)."""
    teacher.eval()
    batch = batch or _mem.eval_batch(teacher, x[:2])
    out = []
    for i in range(0, len(x), batch):
        logits = teacher(x[i : i + batch])
        out.append((logits.softmax(-1).mean(0) if logits.ndim == 3 else logits).argmax(-1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def transfer_set(
    teacher: nn.Module, data: Dataset, kind: str, size: float, labels: float, seed: int
) -> tuple[Dataset, dict[str, Any]]:
    """The training set with only a `labels` fraction of its labels kept (a seeded draw), the
    rest labelled by the teacher, plus `size` x N synthetic inputs labelled by the teacher
    (none on token data, where `kind` must be "none"). The validation split keeps the same
    fraction of its labels, the teacher's elsewhere: a user with few labels has few there too."""
    check_transfer({"transfer": kind}, data)
    g = torch.Generator().manual_seed(seed)

    def kept(y: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keep = torch.zeros(len(y), dtype=torch.bool)
        if len(y):
            keep[torch.randperm(len(y), generator=g)[: max(1, round(labels * len(y)))]] = True
        return torch.where(keep, y, teacher_labels(teacher, x)), keep

    y, keep = kept(data.y_train, data.x_train)
    y_val, _ = kept(data.y_val, data.x_val)
    extra = torch.from_numpy(synthetic_inputs(data.x_train.numpy(), kind, size, seed))
    x = torch.cat([data.x_train, extra])
    y = torch.cat([y, teacher_labels(teacher, extra)])
    ds = dataclasses.replace(data, spec=f"{data.spec}+transfer", x_train=x, y_train=y, y_val=y_val)
    record = {
        "kind": kind,
        "labelled": int(keep.sum()),
        "teacher_labelled": int((~keep).sum()) + len(extra),
        "synthetic": len(extra),
        "examples": len(y),
    }
    return ds, record


# --- FitNets hints --------------------------------------------------------------------------


def _module(model: nn.Module, name: str, who: str) -> nn.Module:
    found = dict(model.named_modules())
    if name not in found or not name:
        names = [n for n, m in found.items() if n and not list(m.children())]
        raise InputError(
            f"distill: the {who} has no layer {name!r}; its layers: {', '.join(names)}"
        )
    return found[name]


class _StopForward(Exception):
    """Raised by the student's hint hook to end its forward pass at the hint layer."""


class _Capture:
    """A forward hook keeping a module's latest output; with `stop`, it also ends the forward
    pass there while training (layers after the hint layer neither run nor update BatchNorm
    statistics in the hint phase)."""

    def __init__(self, module: nn.Module, stop: bool = False) -> None:
        self.value: torch.Tensor | None = None
        self.stop = stop
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        self.value = output
        if self.stop and module.training:
            raise _StopForward


class _HintModel(nn.Module):
    """The student and FitNets' adapter as one module for the training loop, so its optimizer
    trains both; the student itself is not modified. In training the forward pass stops at the
    hint layer (logits are not computed: placeholder zeros); in eval it runs the whole student,
    so the loop's test accuracy is the student's."""

    def __init__(self, student: nn.Module, adapter: nn.Module, num_classes: int) -> None:
        super().__init__()
        self.student, self.adapter, self.num_classes = student, adapter, num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return self.student(x)
        except _StopForward:  # float logits, whatever the input's dtype (token ids are int64)
            return torch.zeros(len(x), self.num_classes, device=x.device)


def hint_adapter(student_feat: torch.Tensor, teacher_feat: torch.Tensor) -> nn.Module:
    """FitNets' regressor from the student's hint layer to the teacher's: a 1x1 convolution
    for feature maps (average-pooled to the teacher's map size first), else a linear map."""
    if student_feat.ndim == 4 and teacher_feat.ndim == 4:
        size = tuple(teacher_feat.shape[2:])
        return nn.Sequential(
            nn.AdaptiveAvgPool2d(size), nn.Conv2d(student_feat.shape[1], teacher_feat.shape[1], 1)
        )
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(student_feat[0].numel(), teacher_feat[0].numel()),
        nn.Unflatten(1, tuple(teacher_feat.shape[1:])),
    )


def check_hints(d: Any, student: nn.Module, teacher: nn.Module, x: torch.Tensor) -> None:
    """The recipe's hint layers (its [distill] section `d`) exist in the student and the
    teacher, the forward on `x` (two inputs) reaches them, and each gives one tensor: refused
    before the teacher's baseline and by --dry-run, not when hints train."""
    if d.hint_student:
        s_cap = _Capture(_module(student, d.hint_student, "student"))
        t_cap = _Capture(_module(teacher, d.hint_teacher, "teacher"))
        was = student.training, teacher.training
        try:
            _hint_features(student, teacher, s_cap, t_cap, x, d.hint_student, d.hint_teacher)
        finally:
            s_cap.handle.remove()
            t_cap.handle.remove()
            student.train(was[0])
            teacher.train(was[1])


def _hint_features(student, teacher, s_cap, t_cap, x, s_layer: str, t_layer: str) -> int:
    """Run both models on `x` in eval mode; check the hint layers' outputs;
    return the student's class count. A layer the forward never calls, or one returning a
    tuple (a GRU's (output, h)), failed as "'NoneType' object has no attribute 'ndim'"."""
    with torch.no_grad():  # both left in eval mode, as hint training wants the teacher
        classes = student.eval()(x).shape[1]
        teacher.eval()(x)
    for who, name, cap in (("student", s_layer, s_cap), ("teacher", t_layer, t_cap)):
        if cap.value is None:
            raise InputError(
                f"distill.hint_{who} {name!r}: the {who}'s forward never calls it; name a "
                "layer it runs"
            )
        if not isinstance(cap.value, torch.Tensor):
            raise InputError(
                f"distill.hint_{who} {name!r} gives {type(cap.value).__name__}, not one "
                "tensor; name a layer whose output is a tensor"
            )
    return int(classes)


def hint_train(
    student: nn.Module,
    teacher: nn.Module,
    student_layer: str,
    teacher_layer: str,
    data: Dataset,
    retrain: Callable[..., None],
    epochs: int,
    lr: float,
) -> dict[str, Any]:
    """FitNets stage 1: train the student up to `student_layer` so that a learned adapter of
    its output regresses the teacher's `teacher_layer` output (MSE). Returns the hint loss
    before (student at its initialisation, adapter untrained) and after the phase."""
    s_mod = _module(student, student_layer, "student")
    t_mod = _module(teacher, teacher_layer, "teacher")
    s_cap, t_cap = _Capture(s_mod, stop=True), _Capture(t_mod)
    try:
        x = data.x_train[:2]
        classes = _hint_features(student, teacher, s_cap, t_cap, x, student_layer, teacher_layer)
        adapter = hint_adapter(s_cap.value, t_cap.value)
        wrapped = _HintModel(student, adapter, classes)

        def hint_loss(model: nn.Module, xb: torch.Tensor, yb: torch.Tensor):
            with torch.no_grad():
                teacher(xb)
            logits = model(xb)
            return 0.5 * F.mse_loss(adapter(s_cap.value), t_cap.value.float()), logits

        probe = data.x_train[:512]

        def measure() -> float:
            with torch.no_grad():
                return float(hint_loss(wrapped.eval(), probe, None)[0])

        before = measure()
        wrapped.train()
        retrain(wrapped, epochs, lr, hint_loss)
        after = measure()
    finally:
        s_cap.handle.remove()
        t_cap.handle.remove()
    if not math.isfinite(after):
        raise StageError(f"distill: hint training diverged (loss {after}); lower distill.lr")
    return {
        "student_layer": student_layer,
        "teacher_layer": teacher_layer,
        "epochs": epochs,
        "loss_before": before,
        "loss_after": after,
    }


def student_spec(d: Any, data: Dataset, classes: int) -> ModelSpec:
    """The recipe's student (its [distill] section `d`) for `data`, predicting `classes`."""
    where = "--student-kwargs / distill.student_kwargs"
    return zoo.resolve_spec(d.student, dict(d.student_kwargs), data.in_shape, classes, where)


def _extra_teacher(path: str, first: ModelSpec | None, trusts: Callable[[str], bool]) -> nn.Module:
    """One of the recipe's extra teachers, built (it was always refused when its checkpoint
    named the user's own code, even with --model naming it or --trust-model)."""
    ck = checkpoint.load(path, train_state=False)
    if ck.spec is None and first is not None:  # weights alone: the first teacher's model
        try:
            return ck.build_model(first, allow_import=True)  # its code was already allowed
        except InputError:
            # the message said to pass --model, which names the first checkpoint's model
            raise InputError(
                f"--teacher {path}: bare weights, built as the first teacher's model "
                f"({first.name}), which they do not fit; give a compress checkpoint of this "
                "teacher (compress train ... --out), which names its model"
            ) from None
    name = ck.spec.name if ck.spec is not None else ""
    allowed = trusts(name) or (first is not None and name == first.name)
    if not allowed and ck.spec is not None and ck.spec.needs_consent:
        # not "pass --model X": --model names the first checkpoint's model
        raise InputError(
            f"--teacher {path}: names model code {name}; add --trust-model to import it "
            "(in Python: trust_model=True)"
        )
    return ck.build_model(allow_import=allowed)


def teacher_classes(teacher: nn.Module, data: Dataset) -> int:
    """How many classes `teacher` predicts (its output's width on two training inputs)."""
    was = teacher.training
    try:
        with torch.no_grad():
            return int(teacher.eval()(data.x_train[:2]).shape[1])
    finally:
        teacher.train(was)


def distill_student(
    teacher: nn.Module,
    d: Any,  # the recipe's [distill] section (compressor.recipe.DistillSection)
    data: Dataset,
    retrain: Callable[..., None],
    accuracy: Callable[[nn.Module], float],
    seed: int = 0,
    teacher_spec: ModelSpec | None = None,
    trusts: Callable[[str], bool] = lambda name: False,
) -> tuple[nn.Module, ModelSpec, dict[str, Any], Dataset]:
    """Train the recipe's student against `teacher` (plus the recipe's extra `teachers`, as an
    ensemble); return the student, its spec, the teacher/student record for the report, and
    the data it trained on (the transfer set, when the recipe asks for one: later stages must
    keep to it, or scarce labels would not stay scarce). Hints use the first teacher.

    An extra teacher whose checkpoint names code ("pkg.module:Class") is built when the
    caller `trusts` that name (--model naming it, or --trust-model); a bare state_dict is
    built as the first teacher's model (`teacher_spec`), an ensemble's usual case."""
    check_transfer(d, data)
    members = [teacher] + [_extra_teacher(p, teacher_spec, trusts) for p in d.teachers]
    x = data.x_train[:2]
    classes = []
    for i, m in enumerate(members):
        name = "teacher" if i == 0 else str(d.teachers[i - 1])
        data_mod.check_fits(m, data, name, trains=False)  # teachers run in eval mode only
        with torch.no_grad():
            classes.append(m.eval()(x).shape[1])
    if len(set(classes)) > 1:
        raise InputError(
            "distill: the ensemble's teachers must predict the same classes: "
            + ", ".join(
                f"{'the teacher' if i == 0 else d.teachers[i - 1]} {c}"
                for i, c in enumerate(classes)
            )
        )
    data_mod.check_kind(d.student, data, "distill.student")
    spec = student_spec(d, data, classes[0])
    student = zoo.build(spec, seed=0)
    data_mod.check_fits(student, data, spec.name)
    with torch.no_grad():
        got = student.eval()(x).shape[1]
    if got != classes[0]:
        raise InputError(
            f"distill: student {spec.name} predicts {got} classes, the teacher {classes[0]}"
        )
    ensemble = members[0] if len(members) == 1 else Ensemble(members)
    sizes = [sum(p.numel() for p in m.parameters()) for m in members]
    record = {
        "teacher": {
            "parameters": sum(sizes),  # the ensemble as a whole; member_parameters each
            "member_parameters": sizes,
            "test_accuracy": accuracy(
                members[0] if len(members) == 1 else AveragedEnsemble(members)
            ),
            "members": len(members),
        }
    }
    if d.hint_student:
        record["hint"] = hint_train(
            student,
            members[0],
            d.hint_student,
            d.hint_teacher,
            data,
            retrain,
            d.hint_epochs,
            d.lr,
        )
    train_on = data
    if d.transfer != "none" or d.labels < 1:
        train_on, record["transfer"] = transfer_set(
            ensemble, data, d.transfer, d.transfer_size, d.labels, seed=seed
        )
    student.train()
    retrain(
        student,
        d.epochs,
        d.lr,
        loss_with_teacher(ensemble, d.temperature, d.alpha),
        train_on,
    )
    record["student"] = {
        "name": spec.name,
        "parameters": sum(p.numel() for p in student.parameters()),
        "test_accuracy": accuracy(student),
    }
    return student, spec, record, train_on
