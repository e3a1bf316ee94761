"""Adaptive BatchNorm: running statistics re-estimated under the final weights
(`models.base.refresh_batchnorm_`, `TrainConfig.bn_refresh`, recipe `train.bn_refresh`)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import compresskit as ck
from compresskit.compressor import prune
from compresskit.compressor.recipe import Recipe
from compresskit.models.base import batchnorm_memory, refresh_batchnorm_
from compresskit.models.errors import InputError

# MobileNetV3's kind at a few thousand weights: hard swish, a hard-sigmoid gate and
# torchvision's BatchNorm momentum of 0.01, whose running averages lag the weights.
MNV3 = {"width": 8, "depth": 2, "expand": 2, "act": "hardswish", "bn_momentum": 0.01}


def test_the_statistics_are_the_datas_under_the_current_weights():
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    model = nn.Sequential(lin, nn.Dropout(0.9), nn.BatchNorm1d(3, momentum=0.01)).train()
    x = torch.randn(10, 4) * 3 + 5
    assert refresh_batchnorm_(model, x, batch_size=4) == 1
    bn = model[2]
    with torch.no_grad():  # dropout off; 10 samples in batches of 4: the short last one dropped
        h = lin(x[:8]).view(2, 4, 3)
    torch.testing.assert_close(bn.running_mean, h.mean(1).mean(0))
    torch.testing.assert_close(bn.running_var, h.var(1).mean(0))  # torch's unbiased per batch
    assert int(bn.num_batches_tracked) == 2
    assert bn.momentum == 0.01
    assert all(m.training for m in model.modules())  # modes as they were


def test_an_eval_model_stays_in_eval_and_small_inputs_change_nothing():
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).eval()
    refresh_batchnorm_(model, torch.randn(6, 4), batch_size=32)  # one batch of all 6
    assert not any(m.training for m in model.modules())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert refresh_batchnorm_(model, torch.randn(1, 4), batch_size=32) == 0
    assert refresh_batchnorm_(nn.Linear(4, 3), torch.randn(8, 4), batch_size=4) == 0
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_the_sensitivity_analysis_judges_cuts_with_the_dense_models_statistics():
    """`prune.sensitivity` keeps BatchNorm's running statistics while it cuts each layer (its
    docstring gives the measurement: refreshed ones proposed cuts that, together, cost
    MobileNetV2 45.75 points) and hands the model back as it was; so does the validation hook
    `shrink` gives it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).eval()
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []

    def evaluate(m):
        seen.append(
            not m.training and all(torch.equal(m[1].get_buffer(k), before[f"1.{k}"]) for k in STATS)
        )
        return 1.0

    result = prune.sensitivity(model, evaluate, budget=0.02, grid=(0.5, 0.9))
    assert len(seen) == 1 + 2 * 2 and all(seen)  # the baseline, then 2 layers x 2 sparsities
    assert result.proposal == {"0.weight": 0.9, "3.weight": 0.9}
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())

    # The hook `compresskit.shrink` hands the analysis: a plain evaluation on the validation
    # split, no re-estimation in it.
    from compresskit import api
    from compresskit.models.data import load

    digits = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.BatchNorm1d(8), nn.Linear(8, 10))
    with torch.no_grad():
        digits[2].running_mean.uniform_(-1, 1)
    digits.eval()
    kept = {k: v.clone() for k, v in digits.state_dict().items()}
    hooks = api._hooks(load("digits"), Recipe(), None)
    hooks.val_accuracy(digits)
    assert all(torch.equal(v, digits.state_dict()[k]) for k, v in kept.items())


STATS = ("running_mean", "running_var", "num_batches_tracked")


def test_negative_sample_counts_are_refused():
    with pytest.raises(InputError, match="bn_refresh"):
        ck.TrainConfig(bn_refresh=-1)
    with pytest.raises(InputError, match=r"train\.bn_refresh"):
        Recipe.from_dict({"train": {"bn_refresh": -5}})


@pytest.fixture(scope="module")
def slow_bn_checkpoint(tmp_path_factory):
    """The MobileNetV3-like model trained briefly, its statistics refreshed at the end."""
    out = tmp_path_factory.mktemp("bn") / "rse.pt"
    cfg = ck.TrainConfig(epochs=4, bn_refresh=2048)
    run = ck.train("resnet_se", "digits", cfg, out=out, model_kwargs=MNV3)
    return out, run


def test_training_ends_with_refreshed_statistics(slow_bn_checkpoint, tmp_path):
    _, run = slow_bn_checkpoint
    cfg = ck.TrainConfig(epochs=4)
    stale = ck.train("resnet_se", "digits", cfg, out=tmp_path / "stale.pt", model_kwargs=MNV3)
    stale = stale.test_accuracy
    # The same weights (running statistics never enter a training step): only the statistics
    # the test pass uses differ. Measured: 0.886 against 0.097 (one class for every image).
    assert run.test_accuracy >= 0.8
    assert stale <= 0.3
    assert run.test_accuracy == run.history[-1].test_accuracy


def test_shrink_refreshes_after_retraining(slow_bn_checkpoint, tmp_path):
    ckpt, _ = slow_bn_checkpoint
    acc = {}
    for refresh in (0, 2048):
        recipe = Recipe.from_dict(
            {
                "train": {"bn_refresh": refresh},
                "prune": {"retrain_epochs": 1, "rounds": 1},
                "quantize": {"finetune_epochs": 1},
                "export": {"enabled": False},
            }
        )
        rep = ck.shrink(ckpt, recipe=recipe, out=tmp_path / str(refresh))
        acc[refresh] = rep.report["stages"][-1]["test_accuracy"]
    # One retraining epoch moves momentum-0.01 averages a third of the way to the pruned
    # weights' statistics. Measured (one pruning round): 0.369 refreshed, 0.097 without
    # (dense 0.886).
    assert acc[2048] >= acc[0] + 0.2, acc


def test_memory_is_what_the_running_averages_keep_from_before_the_run():
    def net(momentum):
        return nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2, momentum=momentum))

    assert batchnorm_memory(net(0.01), 45) == pytest.approx(0.99**45)  # 0.636
    assert batchnorm_memory(net(0.1), 45) == pytest.approx(0.9**45)  # 0.0087
    assert batchnorm_memory(net(None), 10_000) == 1.0  # a cumulative average never forgets
    assert batchnorm_memory(nn.Linear(2, 2), 1) == 0.0
    mixed = nn.Sequential(net(0.1), net(0.01))
    assert batchnorm_memory(mixed, 45) == pytest.approx(0.99**45)


@pytest.mark.parametrize(("momentum", "refreshed"), [(0.2, False), (0.01, True)])
def test_shrink_refreshes_only_averages_a_run_left_stale(momentum, refreshed):
    # The pipeline's retraining hook: 1 epoch of digits is 41 steps, after which momentum
    # 0.2 keeps 0.8^41 = 0.01% of the averages from before the run (no pass: the same bits
    # as bn_refresh = 0) and 0.01 keeps 0.99^41 = 66% (refreshed).
    from compresskit import api

    ds = ck.load_data("digits")
    kw = {**MNV3, "bn_momentum": momentum}
    states, runs = [], []
    for n in (0, 2048):
        model = _resnet_se(kw, ds)
        hooks = api._hooks(ds, Recipe.from_dict({"train": {"bn_refresh": n}}), None)
        hooks.retrain(model, 1, 1e-3)
        states.append(model.state_dict())
        runs.append(hooks.trained()["bn_refreshed_runs"])
    same = all(torch.equal(v, states[1][k]) for k, v in states[0].items())
    assert runs == [0, int(refreshed)]
    assert same is not refreshed


def _resnet_se(kw, ds):
    from compresskit.models import zoo

    spec = zoo.resolve_spec("resnet_se", dict(kw), ds.in_shape, ds.num_classes)
    return zoo.build(spec, seed=0)


def test_train_cli_refreshes_and_refuses_it_where_no_process_holds_the_statistics(tmp_path):
    from click.testing import CliRunner

    from compresskit.cli.main import cli

    # the effect on accuracy is the library's (above); here the flag reaches it
    args = ["train", "--model", "resnet_se", "--model-kwargs", json.dumps(MNV3), "--epochs", "1"]
    out = tmp_path / "m.pt"
    result = CliRunner().invoke(cli, [*args, "--bn-refresh", "2048", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    assert got["bn_refreshed"] == 13  # every BatchNorm layer of the model
    assert got["test_accuracy"] == got["history"][-1]["test_accuracy"]  # after the refresh
    ps = ["--strategy", "ps-sync", "--workers", "2", "--bn-refresh", "64", "--out", str(out)]
    ps.append("--force")  # over the run above
    refused = CliRunner().invoke(cli, [*args, *ps])
    assert refused.exit_code == 2
    assert "--bn-refresh 64" in refused.output and "drop --bn-refresh" in refused.output
