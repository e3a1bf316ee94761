import pytest
import torch
import torch.nn.functional as F

from compresskit.compressor.distill import kd_loss, loss_with_teacher
from compresskit.models import tiny


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
    from compresskit.compressor.distill import Ensemble

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
    from compresskit.compressor.distill import AveragedEnsemble

    a, b = tiny("mlp", seed=1), tiny("mlp", seed=2)
    x = torch.rand(5, 1, 8, 8)
    mean = (F.softmax(a(x), 1) + F.softmax(b(x), 1)) / 2
    assert torch.allclose(AveragedEnsemble([a, b])(x).exp(), mean, atol=1e-6)


# --- transfer sets ---------------------------------------------------------------------------


def test_munge_keeps_or_redraws_around_the_neighbour():
    import numpy as np

    from compresskit.compressor.distill import munge

    rng = np.random.default_rng(0)
    x = rng.random((6, 1, 2, 3)).astype(np.float32)
    neighbour = np.array([1, 0, 3, 2, 5, 4])
    # p = 0: nothing swapped
    assert np.array_equal(munge(x, neighbour, 0.0, 1.0, rng), x)
    # p = 1 and a huge s (no spread): every attribute becomes the neighbour's
    assert np.allclose(munge(x, neighbour, 1.0, 1e12, rng), x[neighbour])
    # p = 0.5, s = 1: each attribute is either kept or within a few spreads of the neighbour's
    out = munge(x, neighbour, 0.5, 1.0, np.random.default_rng(1)).reshape(6, -1)
    flat, other = x.reshape(6, -1), x[neighbour].reshape(6, -1)
    kept = out == flat
    z = np.abs(out - other) / np.maximum(np.abs(flat - other), 1e-12)
    assert 0.2 < kept.mean() < 0.8 and (z[~kept] < 6).all()


def test_mixup_is_a_convex_combination():
    import numpy as np

    from compresskit.compressor.distill import mixup

    x = np.random.default_rng(0).random((10, 1, 4, 4)).astype(np.float32)
    out, lam = mixup(x, 25, np.random.default_rng(2))
    assert out.shape == (25, 1, 4, 4) and ((lam >= 0) & (lam <= 1)).all()
    assert out.min() >= x.min() - 1e-6 and out.max() <= x.max() + 1e-6


def _blob_data(n=240, classes=3, seed=0):
    import numpy as np

    from compresskit.models.data import Dataset

    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    x = rng.random((n, 1, 8, 8)).astype(np.float32) * 0.3
    for i, k in enumerate(y):
        x[i, 0, 2 * k : 2 * k + 2] += 0.7
    t = torch.from_numpy
    cut = n * 3 // 4
    none = (t(x[:0]), t(y[:0]))  # no validation split
    return Dataset("blobs", t(x[:cut]), t(y[:cut]), t(x[cut:]), t(y[cut:]), classes, *none)


def test_transfer_set_keeps_a_fraction_of_labels_and_labels_the_rest_by_the_teacher():
    from compresskit.compressor.distill import teacher_labels, transfer_set

    data = _blob_data()
    teacher = tiny("mlp", num_classes=3, seed=3)
    n = len(data.y_train)
    ds, rec = transfer_set(teacher, data, "munge", 0.5, 0.25, seed=0)
    assert rec == {
        "kind": "munge",
        "labelled": round(0.25 * n),
        "teacher_labelled": n - round(0.25 * n) + round(0.5 * n),
        "synthetic": round(0.5 * n),
        "examples": n + round(0.5 * n),
    }
    assert torch.equal(ds.x_train[:n], data.x_train)  # the real inputs come first, unchanged
    by_teacher = teacher_labels(teacher, ds.x_train)
    y, truth = ds.y_train[:n], data.y_train
    # every label is either the true one or the teacher's
    assert bool(((y == truth) | (y == by_teacher[:n])).all())
    # where the (untrained) teacher is wrong, the true label survives only where it was kept
    wrong = by_teacher[:n] != truth
    assert int(wrong.sum()) > 2 * rec["labelled"]  # so the next line can fail
    assert 0 < int((y[wrong] == truth[wrong]).sum()) <= rec["labelled"]
    assert torch.equal(ds.y_train[n:], by_teacher[n:])  # synthetic: the teacher's labels
    assert ds.x_train.min() >= data.x_train.min() and ds.x_train.max() <= data.x_train.max()


def test_distillation_on_scarce_labels_beats_the_student_alone():
    """12 labels: a teacher trained on all of them passes its knowledge on through the
    teacher-labelled transfer set; the same student on the 12 labels alone (given 10x the epochs,
    so as many steps) learns far less."""
    import dataclasses

    import numpy as np

    from compresskit.compressor.distill import loss_with_teacher, transfer_set
    from compresskit.distrib.trainer import TrainConfig, evaluate, fit
    from compresskit.models.data import Dataset

    rng = np.random.default_rng(0)
    y = rng.integers(0, 6, 600)
    x = rng.random((600, 1, 8, 8)).astype(np.float32)
    for i, k in enumerate(y):  # class k: a brighter half-row
        x[i, 0, k % 8, (k // 8) * 4 : (k // 8) * 4 + 4] += 0.8
    t = torch.from_numpy
    data = Dataset("rows", t(x[:450]), t(y[:450]), t(x[450:]), t(y[450:]), 6, t(x[:0]), t(y[:0]))
    teacher = tiny("mlp", num_classes=6, seed=0)
    fit(teacher, data, TrainConfig(epochs=15, lr=1e-2, seed=0))
    few = torch.randperm(450, generator=torch.Generator().manual_seed(0))[:12]
    scarce = dataclasses.replace(data, x_train=data.x_train[few], y_train=data.y_train[few])
    alone = tiny("mlp", num_classes=6, seed=5)
    fit(alone, scarce, TrainConfig(epochs=150, lr=1e-2, seed=0))
    ds, rec = transfer_set(teacher, data, "mixup", 1.0, 12 / 450, seed=0)
    assert rec["labelled"] == 12
    student = tiny("mlp", num_classes=6, seed=5)
    kd = loss_with_teacher(teacher, 4.0, 0.7)
    fit(student, ds, TrainConfig(epochs=15, lr=1e-2, seed=0), loss_fn=kd)
    acc = {
        m: evaluate(net, data.x_test, data.y_test)[1]
        for m, net in (("teacher", teacher), ("alone", alone), ("kd", student))
    }
    assert acc["teacher"] > 0.95 and acc["kd"] > acc["alone"] + 0.2, acc


# --- FitNets hints ---------------------------------------------------------------------------


def test_hint_training_regresses_the_student_layer_onto_the_teacher_layer():
    from compresskit.compressor.distill import hint_train
    from compresskit.distrib.trainer import TrainConfig, fit

    data = _blob_data()
    teacher = tiny("vgg", num_classes=3, seed=0)
    student = tiny("mobilenet", num_classes=3, seed=1)
    after_hint = dict(student.named_parameters())
    before = {k: v.detach().clone() for k, v in after_hint.items()}

    def retrain(m, epochs, lr, loss_fn=None, data=None):
        fit(m, data or _blob_data(), TrainConfig(epochs=epochs, lr=lr, seed=0), loss_fn=loss_fn)

    rec = hint_train(student, teacher, "features.5", "features.8", data, retrain, 3, 1e-2)
    assert rec["loss_after"] < 0.7 * rec["loss_before"], rec
    assert not hasattr(student, "_hint_adapter")  # the adapter is gone after the phase
    changed = {k for k, v in student.named_parameters() if not torch.equal(v, before[k])}
    assert changed and all(k.startswith("features.") for k in changed)  # classifier untouched
    assert "classifier.1.weight" not in changed


def test_hint_adapter_shapes():
    from compresskit.compressor.distill import hint_adapter

    a = hint_adapter(torch.zeros(2, 8, 4, 4), torch.zeros(2, 16, 2, 2))
    assert a(torch.zeros(2, 8, 4, 4)).shape == (2, 16, 2, 2)
    b = hint_adapter(torch.zeros(2, 30), torch.zeros(2, 8, 2, 2))
    assert b(torch.zeros(2, 30)).shape == (2, 8, 2, 2)


def test_hint_layer_must_exist():
    from compresskit.compressor.distill import hint_train
    from compresskit.models.errors import InputError

    with pytest.raises(InputError, match="no layer 'nope'.*its layers: features.0"):
        hint_train(
            tiny("mobilenet", num_classes=3),
            tiny("vgg", num_classes=3),
            "nope",
            "features.0",
            _blob_data(),
            lambda *a, **k: None,
            1,
            1e-3,
        )


def test_hint_training_on_a_sequential_student_leaves_later_layers_alone():
    """A user's nn.Sequential student: the adapter must not become one of its layers, and
    layers after the hint layer (BatchNorm statistics included) must not change."""
    from torch import nn

    from compresskit.compressor.distill import hint_train
    from compresskit.distrib.trainer import TrainConfig, fit

    torch.manual_seed(0)
    student = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),  # 0: hint layer
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.BatchNorm2d(4),  # 3: after the hint layer
        nn.Flatten(),
        nn.Linear(4 * 64, 3),
    )
    later = {k: v.clone() for k, v in student.state_dict().items() if not k.startswith("0.")}
    data = _blob_data()

    def retrain(m, epochs, lr, loss_fn=None, data=None):
        fit(m, data or _blob_data(), TrainConfig(epochs=epochs, lr=lr, seed=0), loss_fn=loss_fn)

    rec = hint_train(student, tiny("vgg", num_classes=3), "0", "features.2", data, retrain, 2, 1e-2)
    assert rec["loss_after"] < rec["loss_before"]
    assert len(student) == 6  # nothing added to the user's model
    assert all(torch.equal(student.state_dict()[k], v) for k, v in later.items())
    assert not student[0]._forward_hooks  # hooks removed


def test_scarce_labels_stay_scarce_in_every_later_stage(tmp_path):
    """With a transfer set, pruning retraining and centroid fine-tuning train on it too."""
    from compresskit.compressor import pipeline, recipe
    from compresskit.compressor.shrink import Hooks
    from compresskit.distrib.trainer import TrainConfig, cross_entropy_loss, evaluate, fit
    from compresskit.models import ModelSpec

    data = _blob_data()
    teacher = tiny("mlp", num_classes=3, seed=0)
    fit(teacher, data, TrainConfig(epochs=3, lr=1e-2, seed=0))
    seen = []

    def retrain(m, epochs, lr, loss_fn=None, data_=None):
        seen.append(data_.spec if data_ is not None else data.spec)
        cfg = TrainConfig(epochs=epochs, lr=lr, seed=0)
        fit(m, data_ or data, cfg, loss_fn=loss_fn or cross_entropy_loss)

    hooks = Hooks(
        retrain=lambda m, e, lr, loss_fn=None, data=None: retrain(m, e, lr, loss_fn, data),
        test_accuracy=lambda m: evaluate(m, data.x_test, data.y_test)[1],
        val_accuracy=lambda m: evaluate(m, data.x_train, data.y_train)[1],
    )
    r = recipe.resolve(
        {
            "distill": {"student": "mlp", "epochs": 1, "labels": 0.2},
            "prune": {"rounds": 1, "retrain_epochs": 1},
            "quantize": {"finetune_epochs": 1},
            "export": {"enabled": False},
        }
    )
    spec = ModelSpec("mlp", {"in_shape": [1, 8, 8], "num_classes": 3})
    report = pipeline.shrink_to_folder(teacher, spec, r, hooks, tmp_path / "o", {}, data)
    assert report["transfer"]["labelled"] == round(0.2 * len(data.y_train))
    assert len(seen) >= 3 and all(s == "blobs+transfer" for s in seen), seen


def test_a_hint_layer_must_run_and_give_one_tensor():
    # an unused layer or a GRU's (output, h) failed as "'NoneType'/'tuple' object has no
    # attribute 'ndim'", exit 1
    from types import SimpleNamespace

    from torch import nn

    from compresskit.compressor.distill import check_hints
    from compresskit.models.errors import InputError

    class Student(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.spare, self.fc = (
                nn.GRU(8, 8, batch_first=True),
                nn.Linear(8, 8),
                nn.Linear(8, 3),
            )

        def forward(self, x):
            return self.fc(self.rnn(x.reshape(len(x), 8, 8))[0][:, -1])

    teacher = tiny("vgg", num_classes=3)
    x = torch.rand(2, 1, 8, 8)
    for layer, message in (("spare", "forward never calls it"), ("rnn", "gives tuple, not one")):
        d = SimpleNamespace(hint_student=layer, hint_teacher="features.0")
        with pytest.raises(InputError, match=f"distill.hint_student '{layer}'.*{message}"):
            check_hints(d, Student(), teacher, x)
    check_hints(
        SimpleNamespace(hint_student="fc", hint_teacher="features.0"), Student(), teacher, x
    )
