"""Soft weight-sharing (compressor.softshare): the mixture prior's maths against its closed
form, snapping, the stage on a small model, and `compress shrink` with method = "soft"."""

import json
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from compresskit.compressor import kmeans, prune, softshare
from compresskit.models.errors import InputError


def _prior(k=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    means = torch.cat([torch.zeros(1), torch.linspace(-1, 1, k - 1)]) + 0.01 * torch.randn(
        k, generator=g
    )
    means[0] = 0.0
    log_vars = torch.log(torch.rand(k, generator=g) * 0.05 + 0.01)
    log_mixing = torch.log_softmax(torch.randn(k, generator=g), 0)
    return means.double(), log_vars.double(), log_mixing.double()


def test_neg_log_prior_is_the_mixture_density():
    means, log_vars, log_mixing = _prior()
    w = torch.randn(50, dtype=torch.float64)
    density = sum(
        math.exp(float(log_mixing[j]))
        * np.exp(-((w.numpy() - float(means[j])) ** 2) / (2 * math.exp(float(log_vars[j]))))
        / math.sqrt(2 * math.pi * math.exp(float(log_vars[j])))
        for j in range(len(means))
    )
    expected = -np.log(density).sum()
    got = softshare.neg_log_prior(w, means, log_vars, log_mixing)
    assert float(got) == pytest.approx(expected, rel=1e-10)


def test_prior_gradient_matches_the_closed_form():
    means, log_vars, log_mixing = _prior()
    w = torch.randn(40, dtype=torch.float64, requires_grad=True)
    means = means.clone().requires_grad_(True)
    softshare.neg_log_prior(w, means, log_vars, log_mixing).backward()
    # d/dw_i -log p(w_i) = sum_j r_ij (w_i - mu_j) / var_j, and d/dmu_j the negated sum over i.
    r = softshare.responsibilities(w.detach(), means.detach(), log_vars, log_mixing)
    diff = (w.detach()[:, None] - means.detach()) / log_vars.exp()
    assert torch.allclose(w.grad, (r * diff).sum(1), rtol=1e-10, atol=1e-12)
    assert torch.allclose(means.grad, -(r * diff).sum(0), rtol=1e-10, atol=1e-12)
    assert torch.allclose(r.sum(1), torch.ones(40, dtype=torch.float64))


def _autograd_prior(w, means, log_vars, log_mixing):
    return -torch.logsumexp(softshare.log_joint(w, means, log_vars, log_mixing), dim=1).sum()


@pytest.mark.parametrize(
    ("dtype", "n", "k", "tol"), [(torch.float64, 40, 5, 1e-10), (torch.float32, 20_000, 255, 1e-4)]
)
def test_blocked_prior_matches_autograd_of_its_closed_form(dtype, n, k, tol):
    """Every gradient (weights, means, log variances, mixing logits), in blocks of
    PRIOR_CHUNK weights (20,000 is three blocks) and with 255 components, as autograd of
    log_joint gives it."""
    g = torch.Generator().manual_seed(3)
    w0 = 0.05 * torch.randn(n, generator=g, dtype=dtype)
    means0 = torch.cat(
        [torch.zeros(1, dtype=dtype), 0.05 * torch.randn(k - 1, generator=g, dtype=dtype)]
    )
    lv0 = torch.log(0.002 + 0.003 * torch.rand(k, generator=g, dtype=dtype) ** 2)
    logits0 = torch.randn(k, generator=g, dtype=dtype)
    got = []
    for fn in (softshare.neg_log_prior, _autograd_prior):
        w, means, lv, logits = (t.clone().requires_grad_(True) for t in (w0, means0, lv0, logits0))
        loss = fn(w, means, lv, torch.log_softmax(logits, 0))
        loss.backward()
        got.append([loss.detach(), w.grad, means.grad, lv.grad, logits.grad])
    for mine, ref in zip(*got, strict=True):
        scale = ref.abs().max()
        assert (mine - ref).abs().max() <= tol * scale, (mine, ref)
    # weights that need no gradient: only the prior's parameters get one
    means = means0.clone().requires_grad_(True)
    softshare.neg_log_prior(w0, means, lv0, torch.log_softmax(logits0, 0)).backward()
    assert torch.allclose(means.grad, got[1][2], rtol=0, atol=tol * got[1][2].abs().max())
    assert float(softshare.neg_log_prior(w0[:0], means0, lv0, torch.log_softmax(logits0, 0))) == 0


def test_blocked_prior_in_float32_at_the_stage_widths_against_float64():
    """The stage's own widths (0.1 and 0.4 of the weights' sd), 255 components, and weights
    10 sd out: the expanded form [1, w, w^2] cancels large terms in float32, so every gradient
    is checked against float64 autograd of the closed form (measured: <= 1.6e-5 of its
    largest value)."""
    g = torch.Generator().manual_seed(0)
    n, k, sd = 20_000, 255, 0.05
    w = sd * torch.randn(n, generator=g, dtype=torch.float64)
    w[:20] = 10 * sd * torch.sign(torch.randn(20, generator=g, dtype=torch.float64))
    means = torch.cat(
        [
            torch.zeros(1, dtype=torch.float64),
            2 * sd * torch.randn(k - 1, generator=g, dtype=torch.float64),
        ]
    )
    lv = torch.full((k,), 2 * math.log(0.1 * sd), dtype=torch.float64)
    lv[0] = 2 * math.log(0.4 * sd)
    logits = torch.randn(k, generator=g, dtype=torch.float64)

    def grads(fn, dtype):
        ts = [t.to(dtype).clone().requires_grad_(True) for t in (w, means, lv, logits)]
        fn(ts[0], ts[1], ts[2], torch.log_softmax(ts[3], 0)).backward()
        return [t.grad.double() for t in ts]

    ref = grads(_autograd_prior, torch.float64)
    for mine, exact in zip(grads(softshare.neg_log_prior, torch.float32), ref, strict=True):
        assert (mine - exact).abs().max() <= 1e-4 * exact.abs().max()


def test_snap_takes_the_most_responsible_component():
    means = torch.tensor([0.0, 0.5, -0.5, 2.0])  # component 0 is the zero one
    log_vars = torch.log(torch.full((4,), 0.01))
    log_mixing = torch.log(torch.tensor([0.25, 0.25, 0.25, 0.25]))
    w = torch.tensor([0.04, 0.45, -0.6, 0.55, -0.02, 0.3])
    codebook, index, keep = softshare.snap(w, means, log_vars, log_mixing)
    assert codebook.tolist() == [-0.5, 0.5]  # used means only (2.0 is unused), sorted
    assert keep.tolist() == [False, True, True, True, False, True]
    values = torch.where(keep, codebook[index], torch.zeros(()))
    assert values.tolist() == [0.0, 0.5, -0.5, 0.5, 0.0, 0.5]


def _model_and_data(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))
    x = torch.randn(96, 12)
    y = (x[:, :3].argmax(1)).long()
    return model, x, y


def _trainer(x, y, seen):
    def retrain(model, epochs, lr, loss_fn):
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
        seen["params"] = sum(p.numel() for g in opt.param_groups for p in g["params"])
        for _ in range(epochs * 3):
            for i in range(0, len(x), 32):
                loss, _ = loss_fn(model, x[i : i + 32], y[i : i + 32])
                opt.zero_grad()
                loss.backward()
                opt.step()

    return retrain


def _ce(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits, y), logits


def test_soft_share_snaps_every_layer_to_at_most_2_to_the_bits_values():
    model, x, y = _model_and_data()
    prune.set_mask_(model, "0.weight", torch.rand(16, 12) > 0.5)
    mask_before = prune.masks_of(model)["0.weight"].clone()
    before = {n: p.numel() for n, p in model.named_parameters()}
    seen = {}
    cfg = softshare.SoftShareConfig(fc_bits=3, epochs=2, lr=1e-2, zero_width=0.5, zero_mixing=0.3)
    record = softshare.soft_share_(model, cfg, _trainer(x, y, seen), _ce, samples=len(x))
    # The optimizer trained the mixtures (means and logits of 7 components per layer) too.
    assert seen["params"] == sum(before.values()) + 2 * (7 + 7)
    assert not any("_soft_priors" in n for n, _ in model.named_modules())
    shared = kmeans.shared_of(model)
    assert set(shared) == {"0", "2"} == set(record)
    for name, s in shared.items():
        w = model.get_submodule(name).weight.detach()
        distinct = torch.unique(w)
        assert distinct.numel() <= 2**3  # the zero and at most 7 means
        assert not torch.signbit(w[w == 0]).any()  # zeros are +0.0
        assert record[name]["means_used"] == len(s.codebook) <= 7
        assert record[name]["kept_after"] == int(s.mask.sum()) <= record[name]["kept_before"]
    # A pruned weight stays pruned: the mask only tightens.
    assert not (shared["0"].mask & ~mask_before).any()
    assert record["0"]["kept_before"] == int(mask_before.sum())


def test_the_prior_pulls_weights_together():
    """With the prior strong, weights end nearer their component means than without it."""

    def spread(strength):
        model, x, y = _model_and_data(1)
        cfg = softshare.SoftShareConfig(fc_bits=2, epochs=3, lr=1e-2, strength=strength)
        raw = {}

        def retrain(m, epochs, lr, loss_fn):
            _trainer(x, y, {})(m, epochs, lr, loss_fn)
            raw.update({n: m.get_submodule(n).weight.detach().clone() for n in ("0", "2")})

        softshare.soft_share_(model, cfg, retrain, _ce, samples=len(x))
        return sum(
            float((raw[n] - model.get_submodule(n).weight.detach()).abs().mean()) for n in raw
        )

    assert spread(50.0) < 0.5 * spread(1e-4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"zero_mixing": 1.0}, "zero_mixing must lie in"),
        ({"width": 0.0}, "prior width must be > 0"),
        ({"fc_bits": 13}, "give whole bits 1..12"),
    ],
)
def test_config_refuses_impossible_values(kwargs, message):
    with pytest.raises(InputError, match=message):
        softshare.SoftShareConfig(**kwargs)


SOFT = """
[prune]
rounds = 1
retrain_epochs = 1
[quantize]
method = "soft"
prior_epochs = 2
finetune_epochs = 1
[export]
enabled = false
"""


def test_shrink_with_soft_weight_sharing(run, tmp_path):
    ck = tmp_path / "lenet300.pt"
    result = run("train", "--model", "lenet300", "--epochs", "3", "--out", ck, "-q")
    assert result.exit_code == 0, result.stderr
    (tmp_path / "soft.toml").write_text(SOFT)
    out = tmp_path / "soft"
    args = ["--recipe", tmp_path / "soft.toml", "--out", out, "--json", "-q"]
    result = run("shrink", ck, *args)
    assert result.exit_code == 0, result.stderr
    report = result.json()
    assert json.loads((out / "report.json").read_text())["recipe"]["quantize"]["method"] == "soft"
    assert [s["name"] for s in report["stages"]] == ["prune", "quantize", "huffman"]
    # The pipeline decoded the archive and checked it bit for bit against the model; the rows
    # obey the recipe's 5 bits, and the archive is smaller than its Q+P stage.
    for row in report["layers"]:
        assert row["weight_bits"] <= 5
    assert report["archive"]["bytes"] < report["stages"][1]["bytes"]
    assert report["stages"][-1]["test_accuracy"] >= report["baseline"]["test_accuracy"] - 0.1


@pytest.mark.parametrize(
    "text, message",
    [
        ('[quantize]\nmethod = "soft"\nmode = "weights"\n', "drop quantize.mode = 'weights'"),
        ("[quantize]\nzero_mixing = 1.5\n", "quantize.zero_mixing = 1.5 is impossible"),
        ('[quantize]\nmethod = "gmm"\n', "quantize.method = 'gmm' is impossible"),
    ],
)
def test_soft_recipe_bad_input(run, tmp_path, text, message):
    (tmp_path / "r.toml").write_text(text)
    result = run("shrink", "nothing.pt", "--recipe", tmp_path / "r.toml", "--dry-run")
    assert result.exit_code == 2
    assert message in result.stderr


def test_a_layer_left_wholly_in_the_zero_component_is_stored(tmp_path):
    # zero_mixing 0.999 left fc layers with no mean at all: an empty codebook, and the
    # archive's float16 pricing indexed into it (IndexError, exit 1, "unexpected")
    from compresskit.compressor import shrink
    from compresskit.compressor.recipe import Recipe

    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    empty = kmeans.SharedWeights(
        torch.zeros(0),
        torch.zeros(16, 12, dtype=torch.int64),
        torch.zeros(16, 12, dtype=torch.bool),
    )
    kmeans.install_(model[0], "weight", empty)
    assert shrink.prefer_dense_(model, Recipe()) in ([], ["0"])
    assert not model[0].weight.any()
