"""The Python API of `compress train` and `compress bench`, called only through documented
names (`compresskit.distrib.train`, `compresskit.compressor.bench`, defined in
`compressor.measure.grid`), against the CLI built on them: the same runs, the same JSON."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from compresskit.compressor import BenchResult, bench
from compresskit.distrib import TrainConfig, TrainResult, train
from compresskit.models.errors import InputError

ONE_EPOCH = TrainConfig(epochs=1)
FIVE_EPOCHS = TrainConfig(epochs=5)  # the small factory net needs more than one
FAST = {"batches": (1,), "min_runs": 3, "min_seconds": 0.0}
FAST_FLAGS = ["--batch", "1", "--min-runs", "3", "--min-seconds", "0"]

FACTORY = """\
from torch import nn


def build_net(in_shape, num_classes):
    c, h, w = in_shape
    return nn.Sequential(
        nn.Flatten(), nn.Linear(c * h * w, 32), nn.ReLU(), nn.Linear(32, num_classes)
    )


def not_a_model(in_shape, num_classes):
    return 3
"""

USER_MODELS = """\
from torch import nn


class Net(nn.Module):
    def __init__(self, in_shape=(1, 8, 8), num_classes=10):
        super().__init__()
        c, h, w = in_shape
        self.fc = nn.Linear(c * h * w, num_classes)

    def forward(self, x):
        return self.fc(x.flatten(1))
"""

# Timings differ from run to run; everything else in the JSON must match.
TIMED = {"seconds", "steps_per_s", "samples_per_s"}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """tmp_path as the working folder, for the user's own module files. What they import is
    forgotten afterwards: another test's mynets.py or models.py must not be reused."""
    names = ("mynets", "models")
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    path = list(sys.path)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for n in names:
        sys.modules.pop(n, None)
    sys.modules.update(saved)
    sys.path[:] = path


def _write(folder, name, text):
    (folder / name).write_text(text)
    importlib.invalidate_caches()


def _untimed(obj: dict) -> dict:
    out = {k: v for k, v in obj.items() if k not in TIMED}
    out["history"] = [{k: v for k, v in r.items() if k != "seconds"} for r in obj["history"]]
    return out


def _accuracy(model: nn.Module) -> float:
    from compresskit.models import load_data

    ds = load_data("digits")
    model.eval()
    with torch.no_grad():
        return float((model(ds.x_test).argmax(1) == ds.y_test).float().mean())


def test_exported_names_are_documented():
    import compresskit.compressor
    import compresskit.distrib

    for name in compresskit.distrib.__all__:
        assert (getattr(compresskit.distrib, name).__doc__ or "").strip(), name
    for name in ("bench", "BenchResult"):
        assert name in compresskit.compressor.__all__
        assert (getattr(compresskit.compressor, name).__doc__ or "").strip(), name
    assert callable(bench) and isinstance(BenchResult, type)
    for word in ("Args:", "Returns:", "Raises:"):
        assert word in train.__doc__ and word in bench.__doc__


def test_train_a_zoo_model_by_name(tmp_path):
    out = tmp_path / "t.pt"
    result = train("lenet300", "digits", ONE_EPOCH, out=out)
    assert isinstance(result, TrainResult)
    assert result.test_accuracy > 0.5  # chance is 0.1
    assert out.is_file() and result.checkpoint == out
    assert result.epochs == 1 and len(result.history) == 1
    # the model rank 0 ends with: the weights the checkpoint holds, the accuracy reported
    assert isinstance(result.model, nn.Module)
    assert _accuracy(result.model) == pytest.approx(result.test_accuracy)
    obj = result.to_json()
    assert json.loads(json.dumps(obj, allow_nan=False)) == obj
    assert "model" not in obj and obj["checkpoint"] == str(out)
    assert obj["strategy"] == "single" and obj["epochs"] == 1
    assert obj["history"][0]["test_accuracy"] == result.test_accuracy


def test_train_a_module_instance_in_place():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    before = net[1].weight.detach().clone()
    result = train(net, "digits", ONE_EPOCH)
    assert result.model is net and not torch.equal(before, net[1].weight)
    assert result.checkpoint is None and result.test_accuracy > 0.5
    assert result.to_json()["checkpoint"] is None


def test_a_factory_function_trained_and_benched_by_the_api_and_the_cli(workdir, run):
    _write(workdir, "mynets.py", FACTORY)
    api = train("mynets:build_net", "digits", FIVE_EPOCHS, out="api.pt")
    assert api.test_accuracy > 0.6 and (workdir / "api.pt").is_file()
    assert isinstance(api.model, nn.Sequential)

    cli = run("train", "--model", "mynets:build_net", "--epochs", "5", "--out", "cli.pt", "--json")
    assert cli.exit_code == 0, cli.stderr
    # one seed, one code path: the same weights, the same JSON but for the timings
    # (the checkpoint's path absolute, as TrainResult keeps it)
    want = {**api.to_json(), "checkpoint": str(workdir / "cli.pt")}
    assert _untimed(cli.json()) == _untimed(want)
    from compresskit.models import checkpoint

    written = checkpoint.load(workdir / "cli.pt").state_dict
    assert all(torch.equal(written[k], v) for k, v in api.model.state_dict().items())

    # the checkpoint names the user's code: `model` consents to importing it
    result = bench("api.pt", "digits", model="mynets:build_net", providers="torch", **FAST)
    rows = result.results
    assert rows and {r["model"] for r in rows} == {"api.pt"}
    assert rows[0]["test_accuracy"] == pytest.approx(api.test_accuracy)
    with pytest.raises(InputError, match="pass --model mynets:build_net"):
        bench("api.pt", "digits", providers="torch", **FAST)

    cli = run(
        "bench", "cli.pt", "--data", "digits", "--model", "mynets:build_net",
        "--providers", "torch", *FAST_FLAGS, "--json", "-q",
    )  # fmt: skip
    assert cli.exit_code == 0, cli.stderr
    assert [r["model"] for r in cli.json()["results"]] == ["cli.pt"] * len(rows)


def test_a_users_own_models_py_in_the_working_folder(workdir, run):
    _write(workdir, "models.py", USER_MODELS)
    result = run("train", "--model", "models:Net", "--epochs", "1", "-q")
    assert result.exit_code == 0, result.stderr
    assert (workdir / "net.pt").is_file()

    api = train("models:Net", "digits", ONE_EPOCH, out="api.pt")
    assert type(api.model).__name__ == "Net" and api.test_accuracy > 0.5
    assert sys.modules["models"].__file__ == str(workdir / "models.py")
    import compresskit.models.zoo

    assert compresskit.models.zoo.available()  # ours, untouched by the user's models.py

    # A fresh interpreter in that folder: importing compresskit never picks up ./models.py,
    # and naming it does.
    code = (
        "import sys, compresskit.compressor, compresskit.distrib, compresskit.models;"
        "import compresskit.models.zoo as zoo;"
        "assert 'lenet300' in zoo.available();"
        "print(getattr(sys.modules.get('models'), '__file__', None));"
        "print(zoo.resolve('models:Net').__module__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=workdir, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["None", "models"], out.stderr


def test_bad_input_is_one_input_error(workdir, run):
    _write(workdir, "mynets.py", FACTORY)
    with pytest.raises(InputError, match="returned int, not a torch.nn.Module"):
        train("mynets:not_a_model", "digits", ONE_EPOCH, out="x.pt")
    result = run("train", "--model", "mynets:not_a_model", "--epochs", "1", "--out", "x.pt")
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "returned int, not a torch.nn.Module" in lines[0], result.stderr

    with pytest.raises(
        InputError, match="config must be a compresskit.distrib.TrainConfig, got dict"
    ):
        train("lenet300", "digits", {"epochs": 1}, out="x.pt")
    with pytest.raises(InputError, match="data must be a data spec .* got int"):
        train("lenet300", data=42, out="x.pt")
    with pytest.raises(InputError, match="unknown data spec"):
        train("lenet300", "nonsense", ONE_EPOCH, out="x.pt")
    with pytest.raises(InputError, match="pass the model by name"):
        train(nn.Linear(64, 10), "digits", ONE_EPOCH, workers=2)
    with pytest.raises(InputError, match="pass the model by name"):
        train(nn.Linear(64, 10), "digits", ONE_EPOCH, strategy="ps-sync")
    with pytest.raises(InputError, match="strategy 'ring'"):
        train("lenet300", "digits", ONE_EPOCH, strategy="ring", out="x.pt")
    with pytest.raises(InputError, match="model must be a zoo name"):
        train(3, "digits", ONE_EPOCH)
    assert not (workdir / "x.pt").exists()

    with pytest.raises(InputError, match="trained in place, without a checkpoint"):
        train(nn.Linear(64, 10), "digits", ONE_EPOCH, out="x.pt")
    assert not (workdir / "x.pt").exists()

    # The data spec is read before any model file is.
    (workdir / "m.onnx").write_bytes(b"not read")
    with pytest.raises(InputError, match="digits:x"):
        bench("m.onnx", "digits:x", **FAST)
    with pytest.raises(InputError, match="unknown data spec"):
        bench("m.onnx", "nonsense", **FAST)
    with pytest.raises(InputError, match="data must be a data spec"):
        bench("m.onnx", 42, **FAST)
    with pytest.raises(InputError, match="no such file or folder"):
        bench(workdir / "missing.onnx", **FAST)
    with pytest.raises(InputError, match="--batch 0: give sizes >= 1"):
        bench("m.onnx", batches=(0,), min_runs=3, min_seconds=0.0)


@pytest.fixture
def pt_and_onnx(tmp_path):
    """A small trained checkpoint and its FP32 ONNX export."""
    from compresskit.compressor import export

    result = train("mlp", "digits", ONE_EPOCH, out=tmp_path / "m.pt")
    onnx = export.export_onnx(
        result.model, torch.rand(2, 1, 8, 8), tmp_path / "m.fp32.onnx", export.ExportConfig()
    )
    return tmp_path / "m.pt", onnx


def test_bench_a_checkpoint_and_its_onnx_as_the_cli_does(run, pt_and_onnx):
    pt, onnx = pt_and_onnx
    result = bench([pt, str(onnx)], "digits", providers=["torch", "cpu"], **FAST)
    assert isinstance(result, BenchResult)
    models = {r["model"] for r in result.results}
    assert models == {"m.pt", "m.fp32.onnx"}
    for r in result.results:
        assert r["p50_ms"] > 0 and r["throughput_per_s"] > 0 and r["batch"] == 1
        assert r["test_accuracy"] > 0.5
    onnx_row = next(r for r in result.results if r["model"] == "m.fp32.onnx")
    assert onnx_row["top1_agreement"] == 1.0  # the same model, exported
    api = result.to_json()
    assert json.loads(json.dumps(api, allow_nan=False)) == api
    # the same test split handed in as arrays: the same accuracy
    from compresskit.models.data import Dataset, load

    d = load("digits")
    mine = Dataset.from_arrays(d.x_train, d.y_train, x_test=d.x_test, y_test=d.y_test)
    again = bench(str(onnx), mine, providers=["cpu"], **FAST).results[0]
    assert again["test_accuracy"] == onnx_row["test_accuracy"]
    pair = bench(str(onnx), (d.x_test.numpy(), d.y_test.numpy()), providers=["cpu"], **FAST)
    assert 0.5 < pair.results[0]["test_accuracy"] <= 1.0  # (x, y): every 5th sample is test

    cli = run("bench", pt, onnx, "--data", "digits", "--providers", "torch,cpu", *FAST_FLAGS,
              "--json", "-q")  # fmt: skip
    assert cli.exit_code == 0, cli.stderr
    printed = cli.json()
    assert list(printed) == list(api)  # the same keys in the same order
    assert list(api) == [
        "environment", "peaks", "agreement_reference", "speedup_reference", "runtimes",
        "results", "skipped", "profiles", "notes",
    ]  # fmt: skip
    assert printed["environment"].keys() == api["environment"].keys()
    assert printed["runtimes"] == api["runtimes"] and printed["skipped"] == api["skipped"]
    assert printed["agreement_reference"] == api["agreement_reference"]

    def cells(obj):
        return [(r["model"], r["provider"], r["precision"], r["batch"]) for r in obj["results"]]

    assert cells(printed) == cells(api)
    assert [r.keys() for r in printed["results"]] == [r.keys() for r in api["results"]]
    for a, b in zip(printed["results"], api["results"], strict=True):
        assert a["test_accuracy"] == b["test_accuracy"] and a["bytes"] == b["bytes"]
