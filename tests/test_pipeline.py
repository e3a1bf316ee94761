"""Pipeline model parallelism (torch.distributed.pipelining, gloo, one process per stage): K
stages with M micro-batches must train like one process on the same batch; a dead stage must
end the job naming it; bad pipeline flags are refused before any process starts."""

import dataclasses
import functools
import os
import signal
import threading
import time

import pytest
import torch
from torch import nn

from compresskit.distrib import launch, pipeline
from compresskit.distrib.pipeline import PipelineConfig
from compresskit.distrib.trainer import TrainConfig, fit
from compresskit.models import checkpoint, zoo
from compresskit.models import data as data_mod
from compresskit.models.errors import InputError, StageError

# 198 samples in batches of 32: 7 steps an epoch, the last of 6 samples (3 micro-batches of 2)
CFG = TrainConfig(epochs=2, batch_size=32, optimizer="adam", seed=0)


def _data(n=198):
    ds = data_mod.load("digits")
    return dataclasses.replace(ds, x_train=ds.x_train[:n], y_train=ds.y_train[:n])


def _sequential():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10)
    )


class Residual(nn.Module):
    """Skip connections around two blocks: not a chain of its children."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(64, 24)
        self.block1 = nn.Linear(24, 24)
        self.block2 = nn.Linear(24, 24)
        self.head = nn.Linear(24, 10)

    def forward(self, x):
        x = torch.relu(self.stem(x.flatten(1)))
        x = x + torch.relu(self.block1(x))
        x = x + torch.relu(self.block2(x))
        return self.head(x)


def _one_process(make):
    model = make()
    fit(model, _data(), CFG)
    return model.state_dict()


def _stage(make, pcfg, rank, world):
    model = make()
    result = pipeline.fit(model, _data(), CFG, pcfg)
    return {k: v.clone() for k, v in model.state_dict().items()}, result


def _pipelined(make, pcfg):
    fn = functools.partial(_stage, make, pcfg)
    return launch.run(fn, pcfg.stages, timeout_s=60, name=pipeline.stage_name)


def _assert_close(one, two):
    assert one.keys() == two.keys()
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-5), k


@pytest.mark.distributed
def test_two_stage_sequential_trains_like_one_process():
    pcfg = PipelineConfig(stages=2, microbatches=4, schedule="gpipe")
    two, result = _pipelined(_sequential, pcfg)
    _assert_close(_one_process(_sequential), two)
    s = result.strategy
    assert s["kind"] == "pipeline" and s["auto_split"] and s["split"] == ["3"]
    assert s["stage_parameters"] == [64 * 32 + 32, 32 * 32 + 32 + 32 * 10 + 10]
    # (K-1)/(M+K-1) over the steps: 12 of 4 micro-batches, 2 short ones (6 samples) of 3
    assert s["microbatches"] == 4 and s["microbatches_per_step"] == {3: 2, 4: 12}
    assert s["bubble_theory"] == pytest.approx((12 / 5 + 2 / 4) / 14)
    assert set(s["idle_fraction"]) == {0, 1}
    assert all(0.0 <= f <= 1.0 for f in s["idle_fraction"].values())
    assert result.steps == 2 * 7 and result.samples == 2 * 198 and result.workers == 2
    assert len(result.history) == 2 and 0.0 <= result.test_accuracy <= 1.0


@pytest.mark.distributed
def test_residual_model_split_at_a_named_layer_trains_like_one_process():
    pcfg = PipelineConfig(stages=2, microbatches=4, schedule="1f1b", split=("block2",))
    two, result = _pipelined(Residual, pcfg)
    _assert_close(_one_process(Residual), two)
    assert result.strategy["split"] == ["block2"] and not result.strategy["auto_split"]


def _vgg_stage(rank, world):
    torch.set_num_threads(1)
    model = zoo.tiny("vgg")  # BatchNorm: one micro-batch normalises as the whole batch does
    # M left to the run: BatchNorm at batch 32 must get one micro-batch, as one process.
    result = pipeline.fit(model, _data(192), dataclasses.replace(CFG, epochs=1), PipelineConfig(2))
    if rank == 0:
        assert result.strategy["microbatches"] == 1 and not result.strategy["warnings"]
    return model.state_dict()


@pytest.mark.distributed
def test_batchnorm_with_one_microbatch_trains_like_one_process():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each of the 2 ranks on 2 cores: the same summation order
    try:
        one = zoo.tiny("vgg")
        fit(one, _data(192), dataclasses.replace(CFG, epochs=1))
    finally:
        torch.set_num_threads(threads)
    two = launch.run(_vgg_stage, 2, timeout_s=60, name=pipeline.stage_name)
    _assert_close(one.state_dict(), two)


def _killed(rank, world):
    if rank == 1:  # a crash mid-training: no message, no cleanup
        threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
    cfg = dataclasses.replace(CFG, epochs=500)
    pipeline.fit(_sequential(), _data(), cfg, PipelineConfig(stages=2, microbatches=2))


@pytest.mark.distributed
def test_a_killed_stage_ends_the_job_naming_it():
    t0 = time.perf_counter()
    with pytest.raises(StageError, match=r"^stage 1 .*killed by signal 9"):
        launch.run(_killed, 2, timeout_s=20, name=pipeline.stage_name)
    assert time.perf_counter() - t0 < 20 + 10


# ---- planning and refusals: no processes ---------------------------------------------------


def test_automatic_cut_balances_parameters_or_flops():
    x = _data().x_train[:2]
    # conv FLOPs pile up at the front, parameters at the back: the two balances cut apart
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.Flatten(),
        nn.Linear(16 * 64, 64),
        nn.Linear(64, 10),
    )
    by_params = pipeline.plan(model, x, PipelineConfig(2, balance="params"))
    by_flops = pipeline.plan(model, x, PipelineConfig(2, balance="flops"))
    assert by_params.split == ("4",) and by_flops.split == ("2",)
    assert sum(by_params.parameters) == sum(p.numel() for p in model.parameters())
    assert max(by_flops.flops) < max(by_params.flops)
    assert pipeline._partition([5, 1, 1, 1, 5], 3) == [1, 4]


def test_the_zoo_vgg_cuts_into_balanced_stages():
    model = zoo.tiny("vgg")
    layout = pipeline.plan(model, torch.rand(2, 1, 8, 8), PipelineConfig(4))
    assert len(layout.split) == 3 and all(layout.parameters)
    assert max(layout.flops) <= 0.5 * sum(layout.flops)


def test_more_stages_than_layers_with_weights_is_refused():
    with pytest.raises(InputError, match=r"--stages 4: .* 3 layers with weights.*--stages 3"):
        pipeline.plan(_sequential(), _data().x_train[:2], PipelineConfig(4, microbatches=4))


def test_an_unknown_split_layer_is_refused():
    with pytest.raises(InputError, match=r"--split block9: Residual has no layer of that name"):
        pipeline.plan(Residual(), _data().x_train[:2], PipelineConfig(2, split=("block9",)))


class Tied(nn.Module):
    """fc3 reuses fc1's weight (as a language model ties its decoder to its embedding)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.fc3 = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)
        self.out = nn.Linear(64, 10)
        self.fc3.weight = self.fc1.weight

    def forward(self, x):
        x = torch.relu(self.fc1(x.flatten(1)))
        return self.out(torch.relu(self.fc3(torch.relu(self.fc2(x)))))


class Twice(nn.Module):
    """A layer the forward calls twice."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.mid, self.fc2 = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 10)

    def forward(self, x):
        x = torch.relu(self.fc1(x.flatten(1)))
        return self.fc2(torch.relu(self.mid(torch.relu(self.mid(x)))))


class FuncTied(nn.Module):
    """b's weight used again outside b (F.linear), as a tied projection is."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(64, 32), nn.Linear(32, 32), nn.Linear(32, 32)
        self.d = nn.Linear(32, 10)

    def forward(self, x):
        x = torch.relu(self.b(torch.relu(self.a(x.flatten(1)))))
        x = torch.relu(nn.functional.linear(torch.relu(self.c(x)), self.b.weight))
        return self.d(x)


def _frozen_front():
    model = _sequential()
    model[1].requires_grad_(False)  # a frozen backbone's first layer
    return model


def test_a_cut_never_parts_a_weight_from_its_other_users():
    # Tied weights cut apart trained two copies (38.9% against 52.5% in one process, no
    # word); a layer called twice was picked by the automatic cut, then refused as a --split
    # the user never gave.
    x = _data().x_train[:2]
    with pytest.raises(InputError, match=r"--split fc3: fc1.weight is shared by fc1 and fc3"):
        pipeline.plan(Tied(), x, PipelineConfig(2, split=("fc3",)))
    assert pipeline.plan(Tied(), x, PipelineConfig(2)).split == ("out",)
    with pytest.raises(InputError, match=r"--split mid: the forward calls it 2 times"):
        pipeline.plan(Twice(), x, PipelineConfig(2, split=("mid",)))
    assert pipeline.plan(Twice(), x, PipelineConfig(2)).split == ("fc2",)
    # a weight used outside its layer shows in the traced stages
    with pytest.raises(InputError, match=r"weight b.weight is used in stage 0 and stage 1"):
        pipeline.trace(FuncTied(), ("c",), x[:1])
    layout = pipeline.plan(_frozen_front(), x, PipelineConfig(2))
    assert layout.split == ("5",)  # the frozen layer goes with the next, not a stage alone
    with pytest.raises(InputError, match=r"stage 0 would hold no weights to train \(its layers"):
        pipeline.plan(_frozen_front(), x, PipelineConfig(2, split=("3",)))


@pytest.mark.distributed
def test_a_layer_called_twice_in_one_stage_trains_like_one_process():
    # torch names its second call `mid@1` in the stage: the gathered weights were refused
    # by a strict load after the whole epoch, exit 1, no checkpoint
    # one micro-batch: with two, Adam turns rounding into 2.5e-5 apart (SGD: 7e-9)
    pcfg = PipelineConfig(stages=2, microbatches=1, split=("fc2",))
    two, _ = _pipelined(Twice, pcfg)
    _assert_close(_one_process(Twice), two)


def test_bad_pipeline_settings_are_refused():
    with pytest.raises(InputError, match=r"--microbatches 0: give 1 or more"):
        PipelineConfig(2, microbatches=0)
    with pytest.raises(InputError, match=r"--microbatches 3 does not divide --batch-size 32"):
        PipelineConfig(2, microbatches=3).check_batch(32)
    with pytest.raises(InputError, match=r"1f1b needs --microbatches 4 or more"):
        PipelineConfig(4, microbatches=2, schedule="1f1b")
    with pytest.raises(InputError, match=r"--stages 1: a pipeline needs 2 or more"):
        PipelineConfig(1)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--stages", "2", "--microbatches", "3"], "--microbatches 3 does not divide --batch-size"),
        (["--stages", "2", "--microbatches", "0"], "--microbatches 0: give 1 or more"),
        (["--split", "fc9"], "--split fc9: lenet300 has no layer of that name"),
        (["--stages", "4"], "--stages 4: lenet300 has 3 layers with weights"),
        (["--stages", "2", "--workers", "3"], "--workers 3 with --stages 2"),
        (["--stages", "2", "--grad-compression", "fp16"], "--grad-compression does not apply"),
        (["--stages", "2", "--servers", "1"], "--servers does not apply to --strategy pipeline"),
        ([], "--strategy pipeline: give --stages K"),
    ],
    ids=["indivisible", "zero", "unknown-split", "too-many", "workers", "compress", "ps", "none"],
)
def test_bad_pipeline_flags_exit_2(run, tmp_path, flags, message):
    out = tmp_path / "x.pt"
    result = run("train", "--model", "lenet300", "--strategy", "pipeline", *flags, "--out", out)
    assert result.exit_code == 2, result.stderr
    assert message in result.stderr and not out.exists()


def test_pipeline_flags_need_the_pipeline_strategy(run, tmp_path):
    result = run("train", "--stages", "2", "--out", tmp_path / "x.pt")
    assert result.exit_code == 2
    assert "--stages belongs to pipeline parallelism; add --strategy pipeline" in result.stderr


# ---- the command: bubble in --json, one checkpoint, --resume --------------------------------


@pytest.mark.distributed
def test_compress_train_pipeline_resumes_and_matches_one_process(run, tmp_path):
    out = tmp_path / "pp.pt"
    base = ["train", "--model", "lenet300", "--data", "digits", "--strategy", "pipeline"]
    base += ["--stages", "2", "--schedule", "constant", "--out", out, "--json", "-q"]
    first = run(*base, "--epochs", "1")
    assert first.exit_code == 0, first.stderr
    r = first.json()
    assert r["strategy"] == "pipeline" and r["workers"] == 2 and r["stages"] == 2
    assert r["microbatches"] == 4  # no BatchNorm: the default M
    # 40 steps of 4 micro-batches (0.2) and the last, of 14 samples, of 2 (1/3)
    per_step = {int(m): c for m, c in r["microbatches_per_step"].items()}
    assert per_step == {2: 1, 4: 40}
    assert r["bubble_theory"] == pytest.approx((40 * 0.2 + 1 / 3) / 41)
    assert 0 <= r["bubble_measured"] <= 1
    assert set(r["idle_fraction"]) == {"0", "1"} and r["split"] == ["fc2"]
    ck = checkpoint.load(out)  # the usual checkpoint: the whole model, as one process writes
    assert ck.metadata["epochs"] == 1 and ck.metadata["strategy"] == "pipeline"
    assert ck.build_model().state_dict().keys() == zoo.build(ck.spec).state_dict().keys()

    second = run(*base, "--epochs", "2", "--resume")
    assert second.exit_code == 0, second.stderr
    assert second.json()["resumed_from"] == [1, 0] and second.json()["epochs"] == 2

    # Weights and the per-stage Adam state resumed: it ends where one process ends.
    ds = data_mod.load("digits")
    model = zoo.build(ck.spec, seed=0)
    fit(model, ds, TrainConfig(epochs=2, schedule="constant"))
    _assert_close(model.state_dict(), checkpoint.load(out).build_model().state_dict())


def test_batchnorm_on_small_microbatches_is_warned_about():
    from torch import nn

    from compresskit.distrib.pipeline import batchnorm_warnings

    bn = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(3))
    plain = nn.Sequential(nn.Flatten(), nn.Linear(64, 3))
    (w,) = batchnorm_warnings(bn, 32, 4)
    assert "micro-batch of 8 samples" in w and "--microbatches 1 (micro-batches of 32)" in w
    (w,) = batchnorm_warnings(bn, 64, 4)
    assert "micro-batch of 16 samples" in w and "--microbatches 2 (micro-batches of 32)" in w
    (w,) = batchnorm_warnings(bn, 100, 4)  # the M it suggests divides the batch
    assert "--microbatches 2 (micro-batches of 50)" in w
    (w,) = batchnorm_warnings(bn, 32, 2, "1f1b", 2)  # 1F1B cannot take M=1: suggest GPipe
    assert "--pipeline-schedule gpipe --microbatches 1" in w
    assert batchnorm_warnings(bn, 64, 2) == []  # micro-batches of 32
    assert batchnorm_warnings(bn, 32, 1) == []
    assert batchnorm_warnings(plain, 32, 8) == []


def test_microbatches_left_to_the_run_keep_batchnorm_on_32_samples():
    from compresskit.distrib.pipeline import auto_microbatches

    bn = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(3))
    plain = nn.Sequential(nn.Flatten(), nn.Linear(64, 3))
    assert auto_microbatches(plain, 32, 2) == 4  # the default M where nothing argues against it
    assert auto_microbatches(plain, 30, 2) == 3  # the most up to 4 that divide the batch
    assert auto_microbatches(plain, 7, 2) == 1
    assert auto_microbatches(bn, 32, 2) == 1  # one micro-batch of 32, not 4 of 8
    assert auto_microbatches(bn, 64, 2) == 2
    assert auto_microbatches(bn, 256, 2) == 4  # 64 each: the cap of 4 binds
    assert auto_microbatches(bn, 96, 2) == 3
    assert auto_microbatches(bn, 8, 2) == 1  # fewer than 32 in all: one micro-batch
    assert auto_microbatches(bn, 32, 4, "1f1b") == 4  # 1F1B needs M >= K
    assert auto_microbatches(plain, 30, 4, "1f1b") == 5  # the fewest from K up that divide
    # Every choice divides its batch, is at most 4, and keeps 32 samples under BatchNorm.
    for batch in range(1, 300):
        for model in (bn, plain):
            m = auto_microbatches(model, batch, 2)
            assert batch % m == 0 and 1 <= m <= 4
            assert model is plain or m == 1 or batch // m >= 32
    with pytest.raises(InputError, match=r"1f1b needs at least --stages 4 .* --batch-size 2"):
        auto_microbatches(plain, 2, 4, "1f1b")
    cfg = PipelineConfig(stages=2).resolved(bn, 64)
    assert cfg.microbatches == 2 and cfg.bubble() == pytest.approx(1 / 3)
    assert PipelineConfig(stages=2, microbatches=8).resolved(bn, 32).microbatches == 8  # given
    cfg.check_batch(64)
    for unresolved in (lambda c: c.check_batch(32), lambda c: c.bubble()):
        with pytest.raises(ValueError, match="resolved"):
            unresolved(PipelineConfig(stages=2))


@pytest.mark.distributed
def test_a_resumed_pipeline_checks_microbatches_against_the_checkpoints_batch(run, tmp_path):
    out = tmp_path / "pp.pt"
    base = ["train", "--model", "lenet300", "--data", "digits", "--strategy", "pipeline"]
    base += ["--stages", "2", "--microbatches", "3", "--out", out, "--json", "-q"]
    first = run(*base, "--batch-size", "48", "--epochs", "1")
    assert first.exit_code == 0, first.stderr
    # No --batch-size: the run takes the checkpoint's 48, which 3 divides (32 would not).
    second = run(*base, "--epochs", "2", "--resume")
    assert second.exit_code == 0, second.stderr
    assert second.json()["microbatches"] == 3 and second.json()["epochs"] == 2


def _deterministic_stage(make, pcfg, rank, world):
    from compresskit.distrib import trainer

    model = make()
    inner, during = trainer.epoch_order, []

    def spy(*args):  # called by the pipeline's loop once per epoch
        during.append(torch.are_deterministic_algorithms_enabled())
        return inner(*args)

    trainer.epoch_order = spy
    try:
        pipeline.fit(model, _data(), dataclasses.replace(CFG, deterministic=True), pcfg)
    finally:
        trainer.epoch_order = inner
    after = torch.are_deterministic_algorithms_enabled()
    return {k: v.clone() for k, v in model.state_dict().items()}, (during, after)


@pytest.mark.distributed
def test_a_deterministic_pipeline_trains_the_same_bits_and_restores_torchs_setting():
    # On a CPU the kernels are deterministic already: --deterministic changes no bit; each
    # stage runs its loop with deterministic algorithms on and has torch's setting back after.
    pcfg = PipelineConfig(stages=2, microbatches=4, schedule="gpipe")
    plain, _ = _pipelined(_sequential, pcfg)
    fn = functools.partial(_deterministic_stage, _sequential, pcfg)
    det, (during, after) = launch.run(fn, pcfg.stages, timeout_s=60, name=pipeline.stage_name)
    assert all(torch.equal(plain[k], det[k]) for k in plain)
    assert during == [True] * CFG.epochs and after is False
