"""Knowledge distillation: Hinton, Vinyals & Dean, "Distilling the Knowledge in a Neural
Network" (2015).

`kd_loss` is the pure loss: soft targets at temperature T (the KL term scaled by T^2, so its
gradients keep their size as T changes) mixed with the hard-label cross-entropy by alpha.
`shrink` uses it to retrain a pruned or weight-shared model against the dense model it came
from (`[train] distill = alpha`): the dense model's soft targets carry what pruning removed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models import checkpoint, zoo
from models import data as data_mod
from models.data import Dataset
from models.errors import InputError
from models.zoo import ModelSpec


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


def distill_student(
    teacher: nn.Module,
    d: dict[str, Any],
    data: Dataset,
    retrain: Callable[[nn.Module, int, float, Callable | None], None],
    accuracy: Callable[[nn.Module], float],
) -> tuple[nn.Module, ModelSpec, dict[str, Any]]:
    """Train the recipe's student against `teacher` (plus the recipe's extra `teachers`, as an
    ensemble); return the student, its spec, and the teacher/student record for the report."""
    members = [teacher] + [checkpoint.load(p).build_model() for p in d["teachers"]]
    x = data.x_train[:2]
    classes = []
    for i, m in enumerate(members):
        data_mod.check_fits(m, data, "teacher" if i == 0 else str(d["teachers"][i - 1]))
        with torch.no_grad():
            classes.append(m.eval()(x).shape[1])
    if len(set(classes)) > 1:
        raise InputError(
            f"distill: the ensemble's teachers predict {classes} classes; they must agree"
        )
    spec = zoo.resolve_spec(d["student"], dict(d["student_kwargs"]), data.in_shape, classes[0])
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
    student.train()
    retrain(
        student, d["epochs"], d["lr"], loss_with_teacher(ensemble, d["temperature"], d["alpha"])
    )
    record["student"] = {
        "name": spec.name,
        "parameters": sum(p.numel() for p in student.parameters()),
        "test_accuracy": accuracy(student),
    }
    return student, spec, record
