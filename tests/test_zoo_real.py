"""The networks users bring: models by factory function (torchvision's way), their own weights
as a plain state_dict, and the real architectures of `models.hf` (Hugging Face transformers,
the `[zoo]` extra; those tests skip when it is not installed)."""

import json
import textwrap
from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn

from compresskit.models import (
    InputError,
    ModelSpec,
    build,
    checkpoint,
    count_parameters,
    resolve_spec,
)
from compresskit.models.zoo import input_kind, state_shapes

USER = textwrap.dedent("""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self, in_shape=(1, 8, 8), num_classes=10, width=16):
            super().__init__()
            c, h, w = in_shape
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, width), nn.ReLU(),
                                      nn.Linear(width, num_classes))
        def forward(self, x):
            return self.body(x)

    def build_net(in_shape, num_classes, width=16):
        return Net(in_shape, num_classes, width)

    def build_tokens(num_classes=2):
        return nn.Linear(4, num_classes)
    build_tokens.input_kind = "tokens"

    def not_a_model(width=3):
        return {"width": width}

    def broken(width=3):
        raise ValueError("width must be even\\nsecond line")

    INSTANCE = Net()
""")

# torchvision's factories take keyword-only `weights` and `progress` and hand **kwargs to the
# class (torchvision does not import on this CPU torch, so its shape is copied here).
VISION = textwrap.dedent("""
    from torch import nn

    class ResNet(nn.Module):
        def __init__(self, width=8, num_classes=1000):
            super().__init__()
            self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.fc = nn.Linear(width, num_classes)
        def forward(self, x):
            return self.fc(self.bn1(self.conv1(x)).relu().mean((2, 3)))

    def resnet18(*, weights=None, progress=True, **kwargs):
        if weights is not None:
            raise ValueError("no downloads in tests")
        return ResNet(**kwargs)
""")


@pytest.fixture
def user(tmp_path, monkeypatch):
    (tmp_path / "zoonets.py").write_text(USER)
    pkg = tmp_path / "fakevision"
    (pkg / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "__init__.py").write_text(VISION)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_factory_function_is_a_model(user):
    spec = resolve_spec("zoonets:build_net", {"width": 5}, (1, 8, 8), 4)
    assert spec.kwargs == {"width": 5, "in_shape": [1, 8, 8], "num_classes": 4}
    model = build(spec, seed=1)
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 4)
    same = build(spec, seed=1)
    assert all(torch.equal(v, same.state_dict()[k]) for k, v in model.state_dict().items())
    assert state_shapes(spec) == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    # Classes still work, and a factory says what it reads through an attribute.
    assert build(resolve_spec("zoonets:Net", {}, (1, 8, 8), 3))(torch.zeros(1, 1, 8, 8)).shape
    assert input_kind("zoonets:build_net") == "image"
    assert input_kind("zoonets:build_tokens") == "tokens"


def test_torchvision_style_factory_gets_only_the_kwargs_it_names(user):
    # **kwargs is not taken as accepting in_shape: ResNet would refuse it.
    spec = resolve_spec("fakevision.models:resnet18", {"num_classes": 10}, (3, 32, 32), 10)
    assert spec.kwargs == {"num_classes": 10}
    model = build(spec)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert state_shapes(spec)["fc.weight"] == (10, 8)


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("zoonets:not_a_model", {}, "returned dict, not a torch.nn.Module"),
        ("zoonets:INSTANCE", {}, "INSTANCE is a model instance, not a torch.nn.Module class"),
        ("zoonets:build_net", {"depth": 3}, "does not take these kwargs: .*depth"),
        ("zoonets:broken", {}, "could not be built .* ValueError: width must be even"),
        ("fakevision.models:resnet18", {"depth": 3}, "does not take these kwargs"),
    ],
)
def test_factory_errors_are_one_line(user, name, kwargs, message):
    with pytest.raises(InputError, match=message) as info:
        build(resolve_spec(name, kwargs, (1, 8, 8), 4))
    assert "\n" not in str(info.value)
    if name == "zoonets:not_a_model":
        assert state_shapes(ModelSpec(name, kwargs)) is None  # the check is left to build


# -- your own weights: a plain state_dict -------------------------------------------------


def _weights(tmp_path, state, name="sd.pt"):
    torch.save(state, tmp_path / name)
    return checkpoint.load(tmp_path / name)


SPEC = ModelSpec("mlp", {"in_shape": [1, 8, 8], "num_classes": 10, "hidden": [16]})  # fc1, fc2


def _state():
    return build(SPEC, seed=0).state_dict()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("drop", r"keys 1 missing \(fc2\.bias\); pass the --model"),
        ("add", r"keys 1 unexpected \(extra\.weight\)"),
        ("both", r"keys 1 missing \(fc2\.bias\); 1 unexpected \(extra\.weight\)"),
        ("shape", r"fc1\.weight is \(16, 32\) in the file but \(16, 64\) in the model"),
    ],
)
def test_weights_that_do_not_fit_say_which_keys_in_one_line(tmp_path, change, message):
    state = _state()
    if change in ("drop", "both"):
        del state["fc2.bias"]
    if change in ("add", "both"):
        state["extra.weight"] = torch.zeros(2)
    if change == "shape":
        state["fc1.weight"] = torch.zeros(16, 32)
    with pytest.raises(InputError, match="weights do not fit model mlp: " + message) as info:
        _weights(tmp_path, state).build_model(SPEC)
    assert "\n" not in str(info.value)


def test_weights_of_another_class_count_name_the_data(tmp_path):
    # The class count of a bare state_dict's model comes from the data (digits, when --data is
    # not given): the fix named was --model and --model-kwargs, which were right.
    state = _state()
    spec = ModelSpec("mlp", {**SPEC.kwargs, "num_classes": 4})
    with pytest.raises(InputError) as info:
        _weights(tmp_path, state).build_model(spec)
    assert str(info.value).endswith(
        "fc2.weight is (10, 16) in the file but (4, 16) in the model; the model was built for "
        "the data's 4 classes: pass the --data the weights were trained on (data=, in Python)"
    )


def test_a_notebooks_class_names_where_its_files_load(tmp_path):
    # spec="__main__:Net" is how a notebook names its own class; on the command line the
    # hint "pass --model __main__:Net" led to "module '__main__' has no attribute 'Net'".
    spec = ModelSpec("__main__:Net", {})
    checkpoint.save_state(tmp_path / "m.pt", _state(), spec)
    for call in (
        lambda: checkpoint.load(tmp_path / "m.pt").build_model(),
        lambda: build(spec),
    ):
        with pytest.raises(InputError) as info:
            call()
        message = str(info.value)
        assert "a class of a script or notebook, which only that program can build" in message
        assert "spec='mynets:Net'" in message and "has no attribute" not in message


def test_many_missing_keys_are_counted_not_listed(tmp_path):
    state = {"other.weight": torch.zeros(1)}
    with pytest.raises(
        InputError, match=r"4 missing \(fc1\.weight, fc1\.bias, fc2\.weight, \.\.\. 1 more\)"
    ):
        _weights(tmp_path, state).build_model(SPEC)


def test_torchvision_style_weights_load_with_weights_only(tmp_path, user):
    """An OrderedDict from state_dict() (with its _metadata), in both torch.save formats; a
    DistributedDataParallel prefix and BatchNorm counters from before torch 0.4.1 are fine."""
    spec = resolve_spec("fakevision.models:resnet18", {"num_classes": 10}, (3, 32, 32), 10)
    model = build(spec, seed=3)
    state = model.state_dict()
    assert isinstance(state, OrderedDict) and hasattr(state, "_metadata")
    for legacy in (False, True):
        path = tmp_path / f"vision{legacy}.pt"
        torch.save(state, path, _use_new_zipfile_serialization=not legacy)
        got = checkpoint.load(path).build_model(spec, allow_import=True)
        assert all(torch.equal(v, got.state_dict()[k]) for k, v in state.items())
    ddp = {f"module.{k}": v for k, v in state.items() if "num_batches_tracked" not in k}
    old = {k: v for k, v in state.items() if "num_batches_tracked" not in k}
    for variant in (ddp, old):
        got = _weights(tmp_path, variant).build_model(spec)
        assert torch.equal(got.fc.weight, model.fc.weight)


def test_a_plain_state_dict_and_a_factory_go_through_shrink(run, user, tmp_path):
    """The user's training script saved model.state_dict(); shrink builds the model by import
    path and kwargs, and the student records that spec."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = torch.tensor(digits.images[:, None] / 16.0, dtype=torch.float32), digits.target
    spec = resolve_spec("zoonets:build_net", {"width": 24}, (1, 8, 8), 10)
    model = build(spec, seed=0)
    opt = torch.optim.Adam(model.parameters(), 0.03)
    for _ in range(25):  # the user's own training script, in miniature
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), torch.as_tensor(y)).backward()
        opt.step()
    torch.save(model.state_dict(), tmp_path / "mine.pt")
    (tmp_path / "fast.toml").write_text(
        # Every stage runs, without retraining epochs or the ONNX files: the plumbing is
        # under test here (test_shrink_cli covers the stages).
        "[prune]\nrounds = 1\nretrain_epochs = 0\n[quantize]\nfinetune_epochs = 0\n"
        "[export]\nenabled = false\n"
    )
    base = ["shrink", tmp_path / "mine.pt", "--data", "digits", "--recipe", tmp_path / "fast.toml"]
    kwargs = ["--model", "zoonets:build_net", "--model-kwargs", '{"width": 24}']
    result = run(*base, *kwargs, "--out", tmp_path / "out", "--json", "-q")
    assert result.exit_code == 0, result.stderr
    report = result.json()
    assert report["baseline"]["test_accuracy"] > 0.7  # the weights are the file's
    student = checkpoint.load(tmp_path / "out" / "model.pt")
    assert student.spec == ModelSpec("zoonets:build_net", spec.kwargs)
    with pytest.raises(InputError, match="pass --model zoonets:build_net"):
        student.build_model()  # a file alone never picks the code
    assert student.build_model(allow_import=True)(x[:2]).shape == (2, 10)
    # Kwargs that do not match the weights: one line, exit 2, naming the first shape.
    wrong = run(*base, "--model", "zoonets:build_net", "--model-kwargs", '{"width": 8}')
    assert wrong.exit_code == 2 and len(wrong.stderr.strip().splitlines()) == 1
    assert "body.1.weight is (24, 64) in the file but (8, 64) in the model" in wrong.stderr
    # A compress checkpoint records its kwargs: others are refused, not ignored.
    student_pt = tmp_path / "out" / "model.pt"
    again = run("shrink", student_pt, "--model-kwargs", '{"width": 8}')
    assert again.exit_code == 2 and "drop --model-kwargs" in again.stderr
    other = run("shrink", student_pt, "--model", "mlp")
    assert other.exit_code == 2 and "checkpoint of model zoonets:build_net" in other.stderr
    # bench takes the same bare file with the same --model and --model-kwargs.
    bench = ["bench", tmp_path / "mine.pt", "--data", "digits", "--providers", "torch"]
    fast = ["--batch", "1", "--min-runs", "3", "--min-seconds", "0.01", "--json", "-q"]
    measured = run(*bench, *kwargs, *fast)
    assert measured.exit_code == 0, measured.stderr
    rows = [r for r in measured.json()["results"] if "p50_ms" in r]
    assert rows and rows[0]["parameters"] == count_parameters(model)
    bad = run(*bench, "--model", "zoonets:build_net", "--model-kwargs", '{"width": 8}', *fast)
    assert bad.exit_code == 2 and "body.1.weight is (24, 64)" in bad.stderr


def test_train_takes_a_factory_by_import_path(run, user, tmp_path):
    out = tmp_path / "net.pt"
    args = ["--model", "zoonets:build_net", "--model-kwargs", '{"width": 8}', "--data", "digits"]
    result = run("train", *args, "--epochs", "1", "--out", out, "-q")
    assert result.exit_code == 0, result.stderr
    spec = checkpoint.load(out).spec
    assert spec == ModelSpec(
        "zoonets:build_net", {"width": 8, "in_shape": [1, 8, 8], "num_classes": 10}
    )
    refused = run(
        "train", "--model", "zoonets:not_a_model", "--data", "digits", "--out", out, "--force"
    )
    assert refused.exit_code == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "returned dict, not a torch.nn.Module" in refused.stderr


def test_missing_transformers_is_one_line_naming_the_extra(monkeypatch):
    import sys

    from compresskit.models import hf

    monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ImportError
    assert input_kind("compresskit.models.hf:bert") == "tokens"  # known without transformers
    with pytest.raises(
        InputError, match=r'transformers, which is not installed; pip install -e "\.\[zoo\]"'
    ):
        build(ModelSpec("compresskit.models.hf:resnet18", {}))
    assert hf.resnet18.input_kind == "image"


# -- real architectures (Hugging Face transformers, the [zoo] extra) ---------------------

TINY = {
    "resnet18": {"hidden_sizes": [8, 16], "depths": [1, 1], "embedding_size": 8},
    "resnet50": {"hidden_sizes": [16, 32], "depths": [1, 1], "embedding_size": 8},
    "mobilenet_v2": {"depth_multiplier": 0.25, "finegrained_output": False},
    "efficientnet_b0": {"width_coefficient": 0.1, "depth_coefficient": 0.1},
    "vit_tiny": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "mlp_size": 32},
    "bert": {
        "vocab_size": 64,
        "hidden_size": 16,
        "num_layers": 1,
        "num_heads": 2,
        "intermediate_size": 32,
        "max_positions": 32,
    },
}
# Full sizes at 10 classes (2 for BERT), counted on the meta device: nothing is allocated.
PARAMETERS = {
    "resnet18": 11_181_642,
    "resnet50": 23_528_522,
    "mobilenet_v2": 2_236_682,
    "efficientnet_b0": 4_020_358,
    "vit_tiny": 5_362_762,
    "bert": 4_386_178,
}


def _inputs(name, batch=3):
    g = torch.Generator().manual_seed(0)
    if name != "bert":
        return torch.rand(batch, 3, 32, 32, generator=g)
    ids = torch.randint(1, 64, (batch, 16), generator=g)
    ids[1, 9:] = 0  # padded
    ids[2] = 0  # all padding: masked, never NaN
    return ids


def _tiny(name):
    shape, classes = ((16,), 2) if name == "bert" else ((3, 32, 32), 10)
    spec = resolve_spec(f"compresskit.models.hf:{name}", TINY[name], shape, classes)
    model = build(spec, seed=0)
    if name != "bert":  # running statistics from a few batches, so eval logits are not ~0
        model.train()
        with torch.no_grad():
            for i in range(3):
                model(torch.rand(8, 3, 32, 32, generator=torch.Generator().manual_seed(i)))
    return spec, model.eval()


@pytest.mark.parametrize("name", sorted(TINY))
def test_hf_wrappers_return_logits_and_have_the_real_sizes(name):
    pytest.importorskip("transformers", reason="needs the [zoo] extra")
    spec, model = _tiny(name)
    assert input_kind(spec.name) == ("tokens" if name == "bert" else "image")
    with torch.no_grad():
        out = model(_inputs(name))
    assert isinstance(out, torch.Tensor) and out.shape == (3, 2 if name == "bert" else 10)
    assert torch.isfinite(out).all()
    shape, classes = ((32,), 2) if name == "bert" else ((3, 32, 32), 10)
    full = resolve_spec(f"compresskit.models.hf:{name}", {}, shape, classes)
    with torch.device("meta"):  # full size, nothing allocated
        assert count_parameters(build(full)) == PARAMETERS[name]
    assert state_shapes(spec).keys() == build(spec).state_dict().keys()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TINY))
def test_hf_wrappers_export_to_onnx_and_match(name, tmp_path):
    pytest.importorskip("transformers", reason="needs the [zoo] extra")
    ort = pytest.importorskip("onnxruntime")
    _, model = _tiny(name)
    x = _inputs(name, batch=4)
    with torch.no_grad():
        ref = model(x).numpy()
    path = tmp_path / f"{name}.onnx"
    batch = torch.export.Dim("batch")
    torch.onnx.export(
        model,
        (x[:2],),
        str(path),
        dynamo=True,
        external_data=False,
        dynamic_shapes=({0: batch},),
    )
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    assert np.abs(got - ref).max() <= 1e-4 * max(np.abs(ref).max(), 1e-6)


def test_hf_model_trains_through_the_cli(run, tmp_path):
    """compress train with a models.hf factory by import path: the spec and weights round-trip,
    and shrink's bare-state_dict path takes a bare transformers model's weights (`net.` added)."""
    pytest.importorskip("transformers", reason="needs the [zoo] extra")
    kwargs = json.dumps(TINY["vit_tiny"] | {"patch_size": 4})
    out = tmp_path / "vit.pt"
    result = run(
        "train",
        "--model",
        "compresskit.models.hf:vit_tiny",
        "--model-kwargs",
        kwargs,
        "--data",
        "digits",
        "--epochs",
        "1",
        "--out",
        out,
        "-q",
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    ck = checkpoint.load(out)
    assert ck.spec.name == "compresskit.models.hf:vit_tiny" and ck.spec.kwargs["in_shape"] == [
        1,
        8,
        8,
    ]
    model = ck.build_model(allow_import=True)
    bare = {k.removeprefix("net."): v for k, v in model.state_dict().items()}
    torch.save(bare, tmp_path / "bare.pt")
    again = checkpoint.load(tmp_path / "bare.pt").build_model(ck.spec)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())
