import itertools
import math
import os

import pytest
import torch

from compresskit.distrib.job import TrainJob, run
from compresskit.distrib.trainer import (
    Checkpointer,
    Events,
    TrainConfig,
    epoch_order,
    evaluate,
    fit,
)
from compresskit.models import InputError, ModelSpec, StageError, checkpoint, tiny
from compresskit.models.data import load
from compresskit.models.zoo import build, resolve_spec


@pytest.fixture(scope="module")
def digits():
    return load("digits")


def _model(data, seed=0, name="mlp"):
    spec = resolve_spec(name, {}, data.in_shape, data.num_classes)
    return spec, build(spec, seed=seed)


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_training_improves_accuracy(digits):
    _, model = _model(digits)
    before = evaluate(model, digits.x_test, digits.y_test)[1]
    result = fit(model, digits, TrainConfig(epochs=3))
    assert before < 0.3 and result.test_accuracy > 0.85
    assert result.history[-1].train_loss < result.history[0].train_loss
    n = len(digits.y_train)  # 1,294: the validation split is held out of training
    assert n == 1294 and result.steps == 3 * math.ceil(n / 32) and result.samples == 3 * n
    assert result.test_accuracy == pytest.approx(evaluate(model, digits.x_test, digits.y_test)[1])


def test_lenet300_reaches_095_on_digits_in_10_epochs(digits):
    # The acceptance run of `compress train --model lenet300 --data digits --epochs 10`.
    _, model = _model(digits, name="lenet300")
    assert fit(model, digits, TrainConfig(epochs=10)).test_accuracy >= 0.95


def test_same_seed_same_weights(digits):
    runs = []
    for _ in range(2):
        _, model = _model(digits, seed=5)
        fit(model, digits, TrainConfig(epochs=1, seed=5))
        runs.append(_weights(model))
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_epoch_order_matches_distributed_sampler_rule():
    from torch.utils.data.distributed import DistributedSampler

    sampler = DistributedSampler(range(10), num_replicas=1, rank=0, shuffle=True, seed=7)
    sampler.set_epoch(3)
    assert list(sampler) == epoch_order(10, 7, 3).tolist()


@pytest.mark.parametrize("every", [0, 7])  # epoch boundaries, and mid-epoch checkpoints
def test_resume_equals_uninterrupted(digits, tmp_path, every):
    # A tiny VGG: BatchNorm buffers and SGD momentum must resume too.
    cfg = TrainConfig(epochs=3, checkpoint_every=every, optimizer="sgd")
    straight = tiny("vgg", in_shape=digits.in_shape)
    fit(straight, digits, cfg)

    class Stop(Exception):
        pass

    class Crash(Checkpointer):
        saves = 0

        def save(self, model, train_state, **meta):
            path = super().save(model, train_state, **meta)
            Crash.saves += 1
            if Crash.saves == (3 if every else 2):
                raise Stop
            return path

    interrupted = tiny("vgg", in_shape=digits.in_shape)
    ck_path = tmp_path / "run.pt"
    spec = ModelSpec("vgg", {"in_shape": list(digits.in_shape), "num_classes": 10, "width": 4})
    with pytest.raises(Stop):
        fit(interrupted, digits, cfg, checkpointer=Crash(ck_path, spec))
    ck = checkpoint.load(ck_path)
    resumed = ck.build_model()
    if every:
        assert 0 < ck.train_state["step"] < 45  # the crash hit mid-epoch
    result = fit(resumed, digits, cfg, resume=ck.train_state)
    a, b = straight.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed run differs from uninterrupted"
    assert [r.epoch for r in result.history] == [1, 2, 3]


def test_bf16_autocast_trains(digits):
    _, model = _model(digits)
    assert fit(model, digits, TrainConfig(epochs=2, precision="bf16")).test_accuracy > 0.8


def test_divergence_is_a_stage_error(digits):
    _, model = _model(digits)
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    with pytest.raises(StageError, match="diverged at epoch 1 step 1"):
        fit(model, digits, TrainConfig(epochs=1))


def test_cosine_schedule_with_warmup():
    cfg = TrainConfig(lr=1.0, warmup_steps=2)
    lrs = [cfg.lr_at(s, 12) for s in range(12)]
    assert lrs[:3] == [0.5, 1.0, 1.0]
    assert all(a >= b for a, b in itertools.pairwise(lrs[2:])) and lrs[-1] < 0.05
    assert TrainConfig(lr=0.1, schedule="constant").lr_at(99, 100) == 0.1


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"epochs": 0}, "--epochs"),
        ({"batch_size": -1}, "--batch-size"),
        ({"lr": -1.0}, "--lr"),
        ({"optimizer": "lion"}, "--optimizer"),
        ({"precision": "fp8"}, "--precision"),
        ({"microbatches": 0}, "--microbatches"),
    ],
)
def test_config_validation_names_the_flag(kwargs, flag):
    with pytest.raises(InputError, match=flag):
        TrainConfig(**kwargs)


def test_job_resume_refuses_changed_settings(tmp_path):
    out = tmp_path / "m.pt"
    run(TrainJob(model="mlp", out=out, config=TrainConfig(epochs=1)))
    job = TrainJob(
        model="mlp",
        out=out,
        resume=True,
        config=TrainConfig(epochs=2, lr=0.5),
        explicit=frozenset({"lr", "epochs"}),
    )
    with pytest.raises(InputError, match="--lr 0.5 differs"):
        run(job)
    job = TrainJob(model="lenet5", out=out, resume=True, explicit=frozenset({"model"}))
    with pytest.raises(InputError, match="--model 'lenet5' differs"):
        run(job)
    # Unchanged settings come from the checkpoint; --epochs may extend the run.
    result = run(
        TrainJob(out=out, resume=True, config=TrainConfig(epochs=2), explicit=frozenset({"epochs"}))
    )
    assert result.resumed_from == (1, 0) and [r.epoch for r in result.history] == [1, 2]
    assert checkpoint.load(out).spec.name == "mlp"


def test_resume_refuses_other_samples_under_the_same_data_spec(tmp_path):
    # Train's resume compared the --data string only: an npz changed in place (or split
    # another way by a newer compress) resumed silently on test samples it had trained on.
    import numpy as np

    rng = np.random.default_rng(0)
    path, out = tmp_path / "d.npz", tmp_path / "m.pt"
    x, y = rng.random((120, 8, 8), dtype=np.float32), np.arange(120) % 3
    np.savez(path, x=x, y=y)
    run(TrainJob(model="mlp", data=f"npz:{path}", out=out, config=TrainConfig(epochs=1)))
    assert len(checkpoint.load(out).metadata["data_fingerprint"]) == 64
    again = TrainJob(
        data=f"npz:{path}", out=out, resume=True, config=TrainConfig(epochs=2),
        explicit=frozenset({"epochs"}),
    )  # fmt: skip
    np.savez(path, x=x[::-1].copy(), y=y[::-1].copy())
    with pytest.raises(InputError, match="gives other samples or splits than .* trained on"):
        run(again)
    np.savez(path, x=x, y=y)  # the same samples: it continues
    result = run(again)
    assert result.resumed_from == (1, 0)
    assert result.checkpoint == out and result.checkpoint.is_absolute()  # after a chdir too
    # a checkpoint written before the fingerprint was kept, on an npz: refused (its split
    # rule changed then); on built-in data: taken as it is
    ck = checkpoint.load(out)
    del ck.metadata["data_fingerprint"]
    from compresskit.distrib import job as job_mod

    with pytest.raises(InputError, match="written before compress recorded which samples"):
        job_mod._check_same_data(again, ck, load(f"npz:{path}"))
    job_mod._check_same_data(again, ck, load("digits"))
    # nor on an npz that brings its own test and validation arrays (no split rule applies)
    own = tmp_path / "own.npz"
    np.savez(own, x=x, y=y, x_test=x[:9], y_test=y[:9], x_val=x[:9], y_val=y[:9])
    job_mod._check_same_data(again, ck, load(f"npz:{own}"))


def test_resume_takes_when_to_test_from_the_caller(tmp_path):
    # evaluate changes no weight: a resumed run tests as its caller asks, whatever the
    # checkpoint's run did, and is never refused for it.
    out = tmp_path / "m.pt"
    first = run(TrainJob(model="mlp", out=out, config=TrainConfig(epochs=1, evaluate="last")))
    assert not math.isnan(first.history[0].test_accuracy)  # the last epoch is always tested

    def resume(epochs, evaluate):
        config = TrainConfig(epochs=epochs, evaluate=evaluate)
        job = TrainJob(out=out, resume=True, config=config, explicit=frozenset(config.to_dict()))
        return [math.isnan(r.test_accuracy) for r in run(job).history]

    assert resume(3, "every") == [False, False, False]
    assert resume(5, "last")[3:] == [True, False]


def test_fit_returns_the_final_models_per_sample_test_hits(digits):
    # shrink reuses these instead of a second pass over the test set: they must be exactly
    # what evaluating the trained model gives.
    from compresskit.distrib.trainer import correct

    _, model = _model(digits)
    result = fit(model, digits, TrainConfig(epochs=2, batch_size=64))
    want = correct(model, digits.x_test, digits.y_test)
    assert result.test_correct is not None and torch.equal(result.test_correct, want)
    assert result.test_accuracy == int(want.sum()) / len(want)


def test_evaluate_last_trains_the_same_and_tests_only_the_final_model(digits, monkeypatch):
    # shrink's retraining reads only the final model's test hits: the passes after the other
    # epochs are skipped, and the training itself is unchanged.
    from compresskit.distrib import trainer

    passes = []
    real = trainer.evaluate_samples
    monkeypatch.setattr(
        trainer, "evaluate_samples", lambda *a, **k: passes.append(len(a[2])) or real(*a, **k)
    )
    runs = {}
    for mode in ("every", "last"):
        passes.clear()
        _, model = _model(digits, seed=3)
        result = fit(model, digits, TrainConfig(epochs=3, seed=3, evaluate=mode))
        runs[mode] = (result, _weights(model), len(passes))
    every, last = runs["every"], runs["last"]
    assert every[2] == 3 and last[2] == 1
    assert all(torch.equal(every[1][k], last[1][k]) for k in every[1])
    assert torch.equal(every[0].test_correct, last[0].test_correct)
    assert last[0].test_accuracy == every[0].test_accuracy
    assert [math.isnan(r.test_accuracy) for r in last[0].history] == [True, True, False]
    assert [r.train_loss for r in last[0].history] == [r.train_loss for r in every[0].history]
    with pytest.raises(InputError, match="evaluate"):
        TrainConfig(evaluate="never")


def test_adam_is_fused_on_cpu_and_takes_the_default_loops_steps():
    """The fused kernel is asked for where torch has it, and moves the weights as the default
    loop does (to rounding): checkpoints and the parameter server's shard agree either way."""
    from compresskit.distrib.trainer import optimizer_for

    cfg = TrainConfig(optimizer="adam", lr=0.05, weight_decay=1e-3)
    start = torch.randn(300, generator=torch.Generator().manual_seed(0))
    grads = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    out = {}
    for fused in (True, None):
        p = torch.nn.Parameter(start.clone())
        opt = optimizer_for([p], cfg)
        assert opt.param_groups[0]["fused"] is True
        opt.param_groups[0]["fused"] = fused
        for g in grads:
            p.grad = g.clone()
            opt.step()
        out[fused] = p.detach()
    assert not torch.equal(out[True], start)
    torch.testing.assert_close(out[True], out[None], rtol=1e-6, atol=1e-6)
    meta = torch.nn.Parameter(torch.empty(3, device="meta"))
    assert optimizer_for([meta], cfg).param_groups[0]["fused"] is None


def test_sgd_with_momentum_takes_a_parameter_that_starts_late():
    """A branch first used at step 2 gets its momentum buffer then; torch's fused SGD fails on
    such a half-made state, so SGD keeps the loop."""
    from compresskit.distrib.trainer import optimizer_for

    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    opt = optimizer_for([*a.parameters(), *b.parameters()], TrainConfig(optimizer="sgd"))
    x = torch.randn(2, 4)
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        (b(a(x)) if step else a(x)).sum().backward()
        opt.step()
    assert all("momentum_buffer" in opt.state[p] for p in b.parameters())


def test_a_cuda_runs_generator_is_saved_and_put_back(monkeypatch):
    """Dropout on a GPU draws from the device's generator: a checkpoint of a CUDA run keeps it
    and --resume on CUDA restores it; CPU runs, and CPU checkpoints resumed on a GPU, leave it
    alone. (torch.cuda's calls are stood in for here; tests/test_gpu.py runs them for real.)"""
    from compresskit.distrib import trainer

    saved, restored = torch.tensor([7, 8, 9], dtype=torch.uint8), []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": saved.clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": restored.append(s))
    cpu = trainer.rng_state("cpu")
    assert cpu.keys() == {"rng"} and torch.equal(cpu["rng"], torch.get_rng_state())
    gpu = trainer.rng_state("cuda:0")
    assert gpu.keys() == {"rng", "cuda_rng"} and torch.equal(gpu["cuda_rng"], saved)
    trainer._restore_rng(gpu, "cpu")  # a GPU checkpoint resumed on the CPU
    assert restored == []
    trainer._restore_rng(cpu, torch.device("cuda", 0))  # a CPU checkpoint resumed on a GPU
    assert restored == []
    trainer._restore_rng(gpu, "cuda:0")
    assert len(restored) == 1 and torch.equal(restored[0], saved)
    # the resume path itself: _initial_state restores both and keeps neither in the run's state
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    resume = {"epoch": 1, "step": 0, "optimizer": opt.state_dict(), **gpu}
    state = trainer._initial_state(resume, opt, TrainConfig(device="cuda"), "cuda:0")
    assert len(restored) == 2 and torch.equal(restored[1], saved)
    assert state["epoch"] == 1 and not {"rng", "cuda_rng"} & state.keys()


# --- gradient accumulation (--microbatches) -----------------------------------------------


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_microbatches_train_like_the_whole_batch(digits, optimizer):
    # 32 as 4 slices of 8 and as 5 uneven slices (6, 6, 7, 6, 7); the epoch's last batch of
    # 14 too: each slice's loss weighted by its share gives the whole batch's gradient.
    runs = {}
    for m in (1, 4, 5):
        _, model = _model(digits, name="lenet300")
        cfg = TrainConfig(epochs=2, microbatches=m, optimizer=optimizer, evaluate="last")
        result = fit(model, digits, cfg)
        runs[m] = (_weights(model), result)
    ref, ref_result = runs[1]
    moved = any(
        not torch.equal(v, _model(digits, name="lenet300")[1].state_dict()[k])
        for k, v in ref.items()
    )
    assert moved
    for m in (4, 5):
        weights, result = runs[m]
        for k in ref:
            assert torch.allclose(weights[k], ref[k], atol=2e-5), (m, k)
        assert result.steps == ref_result.steps  # one optimizer step per batch, not per slice
        assert result.history[-1].train_loss == pytest.approx(
            ref_result.history[-1].train_loss, rel=1e-5
        )
        assert result.history[-1].train_accuracy == ref_result.history[-1].train_accuracy


def test_microbatches_run_slices_of_the_batch(digits):
    sizes = []
    _, model = _model(digits)
    model.register_forward_pre_hook(lambda mod, args: sizes.append(len(args[0])))
    fit(model, digits, TrainConfig(epochs=1, microbatches=4, evaluate="last"))
    n = len(digits.y_train)  # 1,294 = 40 batches of 32 and one of 14
    trained = sizes[: -(-n // 32) * 4]
    assert trained[:4] == [8, 8, 8, 8]
    assert sum(trained) == n and max(trained) == 8
    assert trained[-4:] == [3, 4, 3, 4]  # the last batch of 14: four slices, within one


def test_microbatches_are_refused_for_a_batchnorm_model(digits):
    _, model = _model(digits, name="vgg")
    with pytest.raises(InputError, match=r"--microbatches 4: layer '.*' normalises over the batch"):
        fit(model, digits, TrainConfig(epochs=1, microbatches=4))


def test_a_resumed_run_may_change_microbatches(tmp_path):
    out = tmp_path / "m.pt"
    run(TrainJob(model="mlp", out=out, config=TrainConfig(epochs=1)))
    result = run(
        TrainJob(
            model="mlp",
            out=out,
            resume=True,
            config=TrainConfig(epochs=2, microbatches=2),
            explicit=frozenset({"epochs", "microbatches"}),
        )
    )
    assert result.epochs == 2


def test_compress_train_accumulates_micro_batches(run, tmp_path):
    out = tmp_path / "m.pt"
    args = ["train", "--model", "mlp", "--epochs", "1", "--json", "-q"]
    result = run(*args, "--out", out, "--microbatches", "4")
    assert result.exit_code == 0, result.stderr
    assert checkpoint.load(out).train_state["config"]["microbatches"] == 4
    bad = run(*args, "--out", tmp_path / "b.pt", "--microbatches", "0")
    assert bad.exit_code == 2 and "--microbatches 0 is invalid; give 1 or more" in bad.stderr
    assert not (tmp_path / "b.pt").exists()
    bn = run(*args[:2], "vgg", *args[3:], "--out", tmp_path / "v.pt", "--microbatches", "2")
    assert bn.exit_code == 2 and "normalises over the batch (BatchNorm)" in bn.stderr
    assert not (tmp_path / "v.pt").exists()


def test_microbatches_over_the_batch_are_refused_by_the_loop(digits):
    _, model = _model(digits)
    with pytest.raises(InputError, match=r"--microbatches 33 is invalid; give 1 to the batch size"):
        fit(model, digits, TrainConfig(epochs=1, microbatches=33))


def test_a_resumed_run_takes_microbatches_up_to_the_checkpoints_batch(run, tmp_path):
    # The flag's default batch is 32; the checkpoint's is 64, so 40 slices fit it.
    out = tmp_path / "m.pt"
    args = ["train", "--model", "mlp", "--out", out, "-q"]
    assert run(*args, "--epochs", "1", "--batch-size", "64").exit_code == 0
    result = run(*args, "--epochs", "2", "--resume", "--microbatches", "40")
    assert result.exit_code == 0, result.stderr
    assert checkpoint.load(out).train_state["config"]["microbatches"] == 40


class _NeedsADeterministicKernel(torch.nn.Module):
    """Raises what torch raises for an op without a deterministic kernel (on a GPU, e.g.
    AdaptiveAvgPool2d's backward), but only while deterministic algorithms are on."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 10)

    def forward(self, x):
        if torch.are_deterministic_algorithms_enabled():
            raise RuntimeError(
                "adaptive_avg_pool2d_backward_cuda does not have a deterministic implementation, "
                "but you set 'torch.use_deterministic_algorithms(True)'. You can turn off ..."
            )
        return self.fc(x.flatten(1))


def test_deterministic_training_is_on_for_the_run_only(digits, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "x")  # recorded, so restored after the test
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    seen = []

    class Spy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(64, 10)

        def forward(self, x):
            seen.append(
                (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark)
            )
            return self.fc(x.flatten(1))

    torch.backends.cudnn.benchmark = True  # a caller's own setting: restored after the run
    try:
        assert not torch.are_deterministic_algorithms_enabled()
        fit(Spy(), digits, TrainConfig(epochs=1, deterministic=True))
        assert seen and set(seen) == {(True, False)}
        assert not torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.benchmark is True
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ  # a CPU run uses no cuBLAS
        seen.clear()
        fit(Spy(), digits, TrainConfig(epochs=1))
        assert set(seen) == {(False, True)}
    finally:
        torch.backends.cudnn.benchmark = False


def test_deterministic_sets_cublas_workspace_for_a_gpu_and_keeps_a_users(monkeypatch):
    from compresskit.distrib.trainer import deterministic

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "x")  # recorded, so restored after the test
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    with deterministic(True, "cuda"):  # sets the variable only: no GPU is touched here
        assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    with deterministic(True, "cuda:0"):
        pass
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert not torch.are_deterministic_algorithms_enabled()


def test_an_op_without_a_deterministic_kernel_is_named_in_one_line(digits):
    with pytest.raises(InputError) as e:
        fit(_NeedsADeterministicKernel(), digits, TrainConfig(epochs=1, deterministic=True))
    assert str(e.value) == (
        "--deterministic: adaptive_avg_pool2d_backward_cuda has no deterministic kernel on this "
        "device; run without it (--no-deterministic when resuming a run that used it), or "
        "change the layer that uses it"
    )
    assert not torch.are_deterministic_algorithms_enabled()
    # Without the flag the same model trains.
    assert fit(_NeedsADeterministicKernel(), digits, TrainConfig(epochs=1)).steps > 0


def test_compress_train_deterministic_gives_the_cpus_bits_and_is_kept_on_resume(run, tmp_path):
    # On a CPU torch's kernels are deterministic already: the flag changes no bit.
    args = ["train", "--model", "mlp", "--epochs", "1", "--json", "-q"]
    plain, det = tmp_path / "p.pt", tmp_path / "d.pt"
    assert run(*args, "--out", plain).exit_code == 0
    result = run(*args, "--out", det, "--deterministic")
    assert result.exit_code == 0, result.stderr
    a, b = checkpoint.load(plain), checkpoint.load(det)
    assert all(torch.equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)
    assert b.train_state["config"]["deterministic"] is True
    assert a.train_state["config"]["deterministic"] is False
    # A resume may turn it on (it picks kernels, not the update); a deterministic run resumed
    # without the flag stays deterministic.
    on = run(
        "train",
        "--model",
        "mlp",
        "--epochs",
        "2",
        "--out",
        plain,
        "-q",
        "--resume",
        "--deterministic",
    )
    assert on.exit_code == 0, on.stderr
    assert checkpoint.load(plain).train_state["config"]["deterministic"] is True
    kept = run("train", "--model", "mlp", "--epochs", "2", "--out", det, "-q", "--resume")
    assert kept.exit_code == 0, kept.stderr
    assert checkpoint.load(det).train_state["config"]["deterministic"] is True
    # ... unless told otherwise
    args = ["train", "--model", "mlp", "--epochs", "3", "--out", det, "-q", "--resume"]
    off = run(*args, "--no-deterministic")
    assert off.exit_code == 0, off.stderr
    assert checkpoint.load(det).train_state["config"]["deterministic"] is False


def test_saved_bytes_per_sample_grow_with_the_activations_not_the_weights(digits):
    from compresskit.distrib.trainer import cross_entropy_loss, saved_bytes_per_sample

    x, y = digits.x_train[:8], digits.y_train[:8]

    def net(width):
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(64, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 10),
        )

    narrow, wide = net(32), net(512)
    state = torch.get_rng_state()
    a = saved_bytes_per_sample(narrow, cross_entropy_loss, x, y)
    b = saved_bytes_per_sample(wide, cross_entropy_loss, x, y)
    assert torch.equal(torch.get_rng_state(), state)  # dropout's later draws are unchanged
    # Per sample: the input (64 floats), the hidden activations (ReLU's output, which the
    # second Linear saves too: one storage), the logits' softmax and the label; never the
    # weights (64 x 512 floats = 128 KiB, far above any of these).
    assert 4 * (64 + 32) <= a <= 4 * (64 + 32 + 10) + 8
    assert 4 * (64 + 512) <= b <= 4 * (64 + 512 + 10) + 8
    # the same per sample from 4 samples as from 8
    assert saved_bytes_per_sample(wide, cross_entropy_loss, x[:4], y[:4]) == b
    assert not any(p.grad is not None for p in wide.parameters())


def test_saved_bytes_keeps_nothing_after_it_returns(digits):
    """GELU and softmax save their own outputs: a pack hook that returned the tensor itself
    made each a reference cycle through the graph that gc cannot see, and every measurement
    kept its forward's saved tensors for good (ViT-tiny: 120 MiB per retraining run)."""
    import gc
    import weakref

    from compresskit.distrib.trainer import cross_entropy_loss, saved_bytes

    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.GELU(), torch.nn.Linear(32, 10)
    )
    outputs: list = []
    model[2].register_forward_hook(lambda m, i, out: outputs.append(weakref.ref(out)))
    x, y = digits.x_train[:8], digits.y_train[:8]
    assert saved_bytes(model, cross_entropy_loss, x, y) >= 4 * 8 * (64 + 32 + 32)
    gc.collect()
    assert len(outputs) == 1 and outputs[0]() is None  # GELU's saved output is gone


class _ComputedWeight(torch.nn.Module):
    """A second layer whose weight is computed in the forward pass (as weight sharing's
    codebook lookup is): its matmul saves that weight for the first layer's gradient, and the
    weight does not grow with the batch."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(64, 32)
        self.base = torch.nn.Parameter(torch.randn(10, 32))

    def forward(self, x):
        h = torch.relu(self.first(x.flatten(1)))
        return torch.nn.functional.linear(h, self.base * 2.0)


def test_saved_bytes_per_sample_leave_out_what_the_batch_does_not_grow(digits):
    from compresskit.distrib.trainer import cross_entropy_loss, saved_bytes, saved_bytes_per_sample

    model = _ComputedWeight()
    x, y = digits.x_train[:32], digits.y_train[:32]
    # the computed weight (320 floats) is among what is saved...
    assert saved_bytes(model, cross_entropy_loss, x[:4], y[:4]) >= 4 * (320 + 4 * (64 + 32))
    # ...but not per sample: 4 samples give what 32 give (input, hidden, softmax, label)
    few = saved_bytes_per_sample(model, cross_entropy_loss, x[:4], y[:4])
    many = saved_bytes_per_sample(model, cross_entropy_loss, x, y)
    assert few == many and 4 * (64 + 32) <= few <= 4 * (64 + 32 + 10) + 8


def test_auto_microbatches_keep_a_shared_weight_lenet5_whole():
    # Weight sharing computes every layer's weight from its codebook: counted per sample, those
    # weights asked for 4 slices of a LeNet-5 on 28x28 digits.
    from compresskit.compressor import kmeans
    from compresskit.distrib import trainer

    data = load("digits:28")
    _, model = _model(data, name="lenet5")
    kmeans.share_weights_(model, kmeans.QuantizeConfig())
    cfg = TrainConfig(microbatches="auto")
    m, per, _ = trainer.auto_microbatches(model, trainer.cross_entropy_loss, data, cfg, "cpu")
    assert m == 1 and 0 < per < 200_000


def test_auto_microbatches_slice_to_the_budget_and_train_as_that_many(digits, monkeypatch):
    from compresskit.distrib import trainer

    _, model = _model(digits)
    per = trainer.saved_bytes_per_sample(
        model, trainer.cross_entropy_loss, digits.x_train[:4], digits.y_train[:4]
    )
    # A budget of 5 samples' activations: a batch of 32 in ceil(32 / 5) = 7 slices.
    monkeypatch.setattr(trainer, "AUTO_FLOOR", int(5 * per))
    monkeypatch.setattr(trainer, "AUTO_ACTIVATIONS", 0)
    m, measured, budget = trainer.auto_microbatches(
        model, trainer.cross_entropy_loss, digits, TrainConfig(microbatches="auto"), "cpu"
    )
    assert (m, budget) == (7, int(5 * per)) and measured == pytest.approx(per)
    said = []

    class Listen(trainer.Events):
        def info(self, message):
            said.append(message)

    auto = fit(model, digits, TrainConfig(epochs=1, microbatches="auto"), events=Listen())
    _, same = _model(digits)
    fixed = fit(same, digits, TrainConfig(epochs=1, microbatches=7))
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), same.state_dict().values(), strict=True)
    )
    assert auto.steps == fixed.steps
    assert auto.microbatches == fixed.microbatches == 7 and auto.to_json()["microbatches"] == 7
    assert len(said) == 1 and said[0].startswith("micro-batches: 7 (auto: ")


def test_auto_microbatches_keep_small_and_batchnorm_models_whole(digits):
    from compresskit.distrib import trainer

    cfg = TrainConfig(microbatches="auto")
    _, mlp = _model(digits)
    assert trainer.auto_microbatches(mlp, trainer.cross_entropy_loss, digits, cfg, "cpu")[0] == 1
    _, vgg = _model(digits, name="vgg")
    stats = {k: v.clone() for k, v in vgg.state_dict().items() if "running" in k}
    m, per, _ = trainer.auto_microbatches(vgg, trainer.cross_entropy_loss, digits, cfg, "cpu")
    assert (m, per) == (1, 0.0)  # not even measured: a forward would move the statistics
    assert all(torch.equal(vgg.state_dict()[k], v) for k, v in stats.items())
    fit(vgg, digits, TrainConfig(epochs=1, microbatches="auto"))  # trains, no refusal
    with pytest.raises(
        InputError, match=r"--microbatches 'some' is invalid; give 1 or more, or auto"
    ):
        TrainConfig(microbatches="some")


def test_a_resume_with_another_layout_says_the_global_batch_changes(digits, tmp_path):
    """Resumed at an epoch's end under --workers 2, a 1-process run went on at twice the
    global batch (21 steps an epoch instead of 41) without a word."""
    spec = ModelSpec("lenet300", {"in_shape": list(digits.in_shape), "num_classes": 10})
    path = tmp_path / "one.pt"
    fit(
        build(spec),
        digits,
        TrainConfig(epochs=1),
        checkpointer=Checkpointer(path, spec),
    )
    state = checkpoint.load(path).train_state

    class Heard(Events):
        def __init__(self) -> None:
            self.said: list[str] = []

        def info(self, message: str) -> None:
            self.said.append(message)

    for written, note in ((41, False), (21, True)):  # 41: this run's own layout
        heard = Heard()
        fit(
            checkpoint.load(path).build_model(),
            digits,
            TrainConfig(epochs=2),
            resume={**state, "steps_per_epoch": written},
            events=heard,
        )
        assert any("took 21 steps per epoch, this one takes 41" in m for m in heard.said) == note


def test_resume_keeps_the_global_batch_unless_the_processes_are_given(run, tmp_path):
    """The README's `compress train --out X --resume` after a `--workers 2` run went on as one
    process at half the global batch, exit 0, and `-q` hid the only note."""
    out = tmp_path / "t.pt"
    args = ["train", "--model", "lenet300", "--data", "digits", "--out", out]
    assert run(*args, "--epochs", "1", "-q").exit_code == 0
    ck = checkpoint.load(out)
    # as a 2-worker all-reduce run writes it: 21 steps an epoch of 1,294 images at 2 x 32
    state = {**ck.train_state, "steps_per_epoch": 21, "processes": "2 all-reduce workers"}
    checkpoint.save_state(out, ck.state_dict, ck.spec, ck.metadata, state)
    refused = run(*args, "--epochs", "2", "--resume", "-q")
    assert refused.exit_code == 2
    assert refused.stderr.strip().splitlines() == [
        f"error: --resume: {out} was trained at 21 steps per epoch (2 all-reduce workers), this "
        "run takes 41 (1 process): pass the --workers and --strategy it was trained with, or "
        "give other ones on purpose to change the global batch from here on"
    ]
    on_purpose = run(*args, "--epochs", "2", "--resume", "--workers", "1", "-q")
    assert on_purpose.exit_code == 0, on_purpose.stderr
    # said under -q too: -q drops progress, not the note that the global batch changed
    assert "took 21 steps per epoch, this one takes 41" in on_purpose.stderr
    state["processes"] = "\x1b[31m"  # named in a message: a crafted file's escape codes refused
    checkpoint.save_state(out, ck.state_dict, ck.spec, ck.metadata, state)
    crafted = run(*args, "--epochs", "3", "--resume", "-q")
    assert crafted.exit_code == 2 and "damaged (processes)" in crafted.stderr


def test_force_never_replaces_a_torch_file_compress_did_not_write(run, tmp_path):
    # "--force: never over a file that is not a checkpoint": any torch.save file was replaced
    data = tmp_path / "mydata.pt"
    for content in ({"x": torch.randn(10, 8), "y": torch.arange(10)}, torch.randn(5)):
        torch.save(content, data)
        before = data.read_bytes()
        for flags in (("--force",), ()):
            result = run("train", "--model", "mlp", "--epochs", "1", "--out", data, *flags)
            assert result.exit_code == 2 and data.read_bytes() == before
            assert "holds tensors compress did not write" in result.stderr
            assert "--force never replaces" in result.stderr


def test_a_train_results_checkpoint_is_absolute():
    # ck.shrink(result) after os.chdir failed as "no such checkpoint file"
    from pathlib import Path

    from compresskit.distrib.trainer import TrainResult

    r = TrainResult([], 0.5, 1, 1, 1, 0.1, checkpoint=Path("rel.pt"))
    assert r.checkpoint == Path(os.path.abspath("rel.pt"))


def test_a_run_on_arrays_resumed_without_them_asks_for_them_again(tmp_path):
    # "--data 'arrays': unknown data spec" named a spec no one can pass
    import numpy as np

    import compresskit as ck

    x, y = np.random.default_rng(0).random((60, 6), dtype=np.float32), np.arange(60) % 2
    out = tmp_path / "m.pt"
    ck.train("mlp", (x, y), TrainConfig(epochs=1), out=out)
    with pytest.raises(InputError, match="trained on arrays given in Python; pass the same"):
        ck.train("mlp", config=TrainConfig(epochs=2), out=out, resume=True)
    assert ck.train("mlp", (x, y), TrainConfig(epochs=2), out=out, resume=True).resumed_from
