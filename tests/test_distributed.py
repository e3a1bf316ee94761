"""Data-parallel training on torch.distributed (gloo, spawned local workers): N workers with
batch b must train like one process with batch N*b; a dying worker must end the job."""

import dataclasses
import os
import time

import pytest
import torch

from distrib import launch
from distrib.trainer import TrainConfig, fit
from models import data as data_mod
from models import tiny
from models.errors import InputError, StageError

pytestmark = pytest.mark.distributed


def _data():
    ds = data_mod.load("digits")
    n = 1408  # 22 global batches of 64: every step splits evenly across 2 workers
    return dataclasses.replace(ds, x_train=ds.x_train[:n], y_train=ds.y_train[:n])


def _train(rank, world, batch):
    model = tiny("mlp", seed=0)
    fit(model, _data(), TrainConfig(epochs=2, batch_size=batch, optimizer="sgd", lr=0.05, seed=0))
    return {k: v.clone() for k, v in model.state_dict().items()}


def _train_two(rank, world):
    return _train(rank, world, 32)


def test_two_workers_train_like_one_with_the_global_batch():
    one = _train(0, 1, 64)
    two = launch.run(_train_two, workers=2, timeout_s=60)
    assert one.keys() == two.keys()
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-5), k
    assert any(not torch.equal(v, tiny("mlp", seed=0).state_dict()[k]) for k, v in one.items())


def _dies(rank, world):
    if rank == 1:
        time.sleep(0.5)
        os._exit(3)  # a crash, not an exception: no message, no cleanup
    return _train(rank, world, 32)


def test_a_dead_worker_ends_the_job_naming_it():
    t0 = time.perf_counter()
    with pytest.raises(StageError, match="worker 1"):
        launch.run(_dies, workers=2, timeout_s=20)
    assert time.perf_counter() - t0 < 20 + 10


def _bad_input(rank, world):
    raise InputError("--data nope: no such data set")


def test_a_user_error_in_a_worker_stays_a_user_error():
    with pytest.raises(InputError, match="no such data set"):
        launch.run(_bad_input, workers=2, timeout_s=20)


def test_incomplete_torchrun_environment(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(InputError, match="torchrun environment incomplete: WORLD_SIZE"):
        launch.DistEnv.from_torchrun()


def test_compress_train_with_two_workers(run, tmp_path):
    out = tmp_path / "w2.pt"
    result = run(
        "train",
        "--model",
        "lenet300",
        "--data",
        "digits",
        "--workers",
        "2",
        "--epochs",
        "3",
        "--out",
        out,
        "--json",
        "-q",
    )
    assert result.exit_code == 0, result.stderr
    r = result.json()
    assert r["workers"] == 2 and r["test_accuracy"] > 0.85 and out.is_file()
    from models import checkpoint

    assert checkpoint.load(out).metadata["epochs"] == 3


def test_workers_zero_is_refused(run, tmp_path):
    result = run("train", "--workers", "0", "--out", tmp_path / "x.pt")
    assert result.exit_code == 2 and "--workers 0: give 1 or more" in result.stderr
