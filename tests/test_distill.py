import pytest
import torch
import torch.nn.functional as F

from compressor.distill import kd_loss, loss_with_teacher
from models import tiny


def test_kd_loss_against_its_definition():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    y = torch.tensor([0, 1, 2, 3, 4, 0])
    T, alpha = 3.0, 0.7
    p_t = F.softmax(t / T, 1)
    kl = (p_t * (p_t.log() - F.log_softmax(s / T, 1))).sum(1).mean()
    expected = (1 - alpha) * F.cross_entropy(s, y) + alpha * T * T * kl
    assert kd_loss(s, t, y, T, alpha).item() == pytest.approx(expected.item(), rel=1e-5)
    assert kd_loss(s, t, y, T, 0.0).item() == pytest.approx(F.cross_entropy(s, y).item(), rel=1e-6)
    assert kd_loss(t, t, y, T, 1.0).item() == pytest.approx(0.0, abs=1e-6)  # matching the teacher


def test_loss_with_teacher_trains_the_student_only():
    teacher, student = tiny("mlp", seed=1), tiny("mlp", seed=2)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    loss_fn = loss_with_teacher(teacher, 4.0, 0.5)
    x, y = torch.rand(4, 1, 8, 8), torch.tensor([1, 2, 3, 4])
    loss, logits = loss_fn(student, x, y)
    loss.backward()
    assert logits.shape == (4, 10)
    assert all(p.grad is None for p in teacher.parameters())
    assert all(p.grad is not None for p in student.parameters())
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())


def test_ensemble_averages_soft_targets():
    from compressor.distill import Ensemble

    g = torch.Generator().manual_seed(1)
    s = torch.randn(4, 3, generator=g)
    t1, t2 = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    y = torch.tensor([0, 1, 2, 0])
    T = 2.0
    p = (F.softmax(t1 / T, 1) + F.softmax(t2 / T, 1)) / 2
    kl = (p * (p.log() - F.log_softmax(s / T, 1))).sum(1).mean()
    got = kd_loss(s, torch.stack([t1, t2]), y, T, 1.0)
    assert got.item() == pytest.approx((T * T * kl).item(), rel=1e-5)
    a, b = tiny("mlp", seed=1), tiny("mlp", seed=2)
    x = torch.rand(2, 1, 8, 8)
    assert Ensemble([a, b])(x).shape == (2, 2, 10)


def test_averaged_ensemble_classifies_by_mean_probability():
    from compressor.distill import AveragedEnsemble

    a, b = tiny("mlp", seed=1), tiny("mlp", seed=2)
    x = torch.rand(5, 1, 8, 8)
    mean = (F.softmax(a(x), 1) + F.softmax(b(x), 1)) / 2
    assert torch.allclose(AveragedEnsemble([a, b])(x).exp(), mean, atol=1e-6)
