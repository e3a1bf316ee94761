import textwrap

import pytest
import torch
from torch import nn

from compresskit.models import (
    InputError,
    ModelSpec,
    available,
    build,
    count_parameters,
    resolve,
    tiny,
)
from compresskit.models.zoo import input_kind, parse_kwargs, resolve_spec

ZOO = sorted(available())
IMAGE_ZOO = [n for n in ZOO if input_kind(n) == "image"]
SHAPES = [(1, 8, 8), (1, 28, 28), (3, 32, 32)]


def test_zoo_lists_the_design_card_models():
    assert {"lenet300", "lenet5", "vgg", "mobilenet", "mlp"} <= set(ZOO)


@pytest.mark.parametrize("name", IMAGE_ZOO)
@pytest.mark.parametrize("shape", SHAPES)
def test_every_model_fits_every_input_shape(name, shape):
    model = build(ModelSpec(name, {"in_shape": shape, "num_classes": 7}))
    (x,) = model.example_inputs(batch=3)
    assert x.shape == (3, *shape)
    assert model(x).shape == (3, 7)


@pytest.mark.parametrize("length", [1, 16, 40])
def test_token_models_take_int64_ids_of_any_length(length):
    model = build(ModelSpec("textcls", {"in_shape": [length], "num_classes": 3}))
    (ids,) = model.example_inputs(batch=3)
    assert ids.dtype == torch.int64 and ids.shape == (3, length)
    assert model(ids).shape == (3, 3)
    padded = ids.clone()
    padded[:, length // 2 + 1 :] = 0  # padding is masked out, never NaN
    assert torch.isfinite(model(padded)).all()


def test_paper_parameter_counts():
    # Deep Compression (Han et al. 2016): LeNet-300-100 266,610 and LeNet-5 (Caffe) 431K.
    assert count_parameters(build(ModelSpec("lenet300", {"in_shape": [1, 28, 28]}))) == 266_610
    assert count_parameters(build(ModelSpec("lenet5", {"in_shape": [1, 28, 28]}))) == 431_080


def test_teacher_is_large_and_students_small():
    shape = {"in_shape": [1, 28, 28], "num_classes": 10}
    teacher = count_parameters(build(ModelSpec("vgg", shape)))
    assert 3_000_000 < teacher < 10_000_000
    assert any(isinstance(m, nn.BatchNorm2d) for m in build(ModelSpec("vgg", shape)).modules())
    for student in ("mobilenet", "mlp"):
        assert count_parameters(build(ModelSpec(student, shape))) < teacher / 50
    mobile = build(ModelSpec("mobilenet", shape))
    depthwise = [m for m in mobile.modules() if isinstance(m, nn.Conv2d) and m.groups > 1]
    assert depthwise and all(m.groups == m.in_channels for m in depthwise)


@pytest.mark.parametrize("name", ZOO)
def test_tiny_instances_are_seeded_and_small(name):
    a, b = tiny(name, seed=3), tiny(name, seed=3)
    c = tiny(name, seed=4)
    assert count_parameters(a) < 20_000
    sa, sc = a.state_dict(), c.state_dict()
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in sa.items())
    assert any(not torch.equal(v, sc[k]) for k, v in sa.items() if v.is_floating_point())


def test_unknown_zoo_name_lists_the_zoo():
    with pytest.raises(InputError, match="unknown model 'lenet7'.*lenet300"):
        resolve("lenet7")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "usernets.py").write_text(
        textwrap.dedent("""
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

        class Bare(nn.Module):
            def __init__(self, hidden=4):
                super().__init__()
                self.fc = nn.Linear(64, 10)
            def forward(self, x):
                return self.fc(x.flatten(1))

        class Picky(nn.Module):
            def __init__(self, width=16):
                super().__init__()
                self.fc = nn.Linear(64, int("%d" % width))  # TypeError for a string width

        NOT_A_MODULE = 3
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "usernets"


def test_user_model_by_import_path(user_module):
    spec = resolve_spec(f"{user_module}:Net", {"width": 5}, (1, 8, 8), 4)
    assert spec.kwargs == {"width": 5, "in_shape": [1, 8, 8], "num_classes": 4}
    model = build(spec)
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 4)
    assert model.body[1].out_features == 5


def test_user_model_without_shape_arguments_is_built_as_given(user_module):
    spec = resolve_spec(f"{user_module}:Bare", {}, (1, 8, 8), 10)
    assert spec.kwargs == {}
    assert build(spec)(torch.zeros(1, 1, 8, 8)).shape == (1, 10)


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("nosuchpkg.nets:Net", {}, "cannot import 'nosuchpkg.nets'"),
        ("usernets:Missing", {}, "has no attribute 'Missing'"),
        ("usernets:NOT_A_MODULE", {}, "not a torch.nn.Module"),
        ("usernets:Net", {"depth": 3}, "does not take these kwargs"),
        # a TypeError inside the constructor is its failure, not a signature mismatch
        ("usernets:Picky", {"width": "abc"}, r"could not be built with .*TypeError: %d format"),
        ("usernets:Net", {"num_classes": 3}, "num_classes=3 but the data gives 4"),
        ("usernets:", {}, "pkg.module:Class"),
    ],
)
def test_user_model_errors_are_one_line(user_module, name, kwargs, message):
    with pytest.raises(InputError, match=message) as info:
        build(resolve_spec(name, kwargs, (1, 8, 8), 4))
    assert "\n" not in str(info.value)


def test_model_kwargs_must_be_a_json_object():
    assert parse_kwargs('{"width": 64}') == {"width": 64}
    with pytest.raises(InputError, match="not JSON"):
        parse_kwargs("{width: 64}")
    with pytest.raises(InputError, match="JSON object"):
        parse_kwargs("[1, 2]")
