"""Knowledge distillation: Hinton, Vinyals & Dean, "Distilling the Knowledge in a Neural
Network" (2015).

`kd_loss` is the pure loss: soft targets at temperature T (the KL term scaled by T^2, so its
gradients keep their size as T changes) mixed with the hard-label cross-entropy by alpha.
`shrink` uses it to retrain a pruned or weight-shared model against the dense model it came
from (`[train] distill = alpha`): the dense model's soft targets carry what pruning removed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 4.0,
    alpha: float = 0.5,
) -> torch.Tensor:
    """(1 - alpha) * CE(student, labels) + alpha * T^2 * KL(teacher_T || student_T)."""
    t = temperature
    soft = F.kl_div(
        F.log_softmax(student_logits.float() / t, dim=1),
        F.log_softmax(teacher_logits.float() / t, dim=1),
        reduction="batchmean",
        log_target=True,
    )
    hard = F.cross_entropy(student_logits.float(), labels)
    return (1 - alpha) * hard + alpha * t * t * soft


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
