"""The typed recipe (compressor.recipe.Recipe): one frozen dataclass tree, loaded and checked
once, written back in any of the three formats to an equal recipe."""

import dataclasses
import json
import tomllib

import pytest

from compresskit.compressor import (
    ExportSection,
    InputError,
    PruneSection,
    QuantizeSection,
    Recipe,
)
from compresskit.compressor import recipe as recipe_mod

# A recipe that sets something in every kind of field: numbers, strings, booleans, lists,
# tables, a table of per-layer values, the "off"/float budget and the bool/"auto" knob.
RAW = {
    "train": {"batch_size": 16, "distill": 0.5},
    "budget": {"max_drop": 0.5, "bits": [3, 5], "sparsities": [0.0, 0.9]},
    "distill": {"student": "lenet5", "student_kwargs": {"width": 2}, "teachers": ["a.pt"]},
    "channels": {"enabled": True, "ignore": ["fc3"], "round_to": 8},
    "prune": {"sparsity": {"fc1": 0.9}, "include_bias": True},
    "quantize": {"bits": {"fc1": 4}, "dense": "float32"},
    "huffman": {"gap_bits": "fixed"},
    "export": {"opset": 17, "reduce_range": True, "target": "host"},
    "guard": {"strict": True, "max_stage_drop": 1.5},
}


@pytest.mark.parametrize("suffix", [".toml", ".yaml", ".json"])
def test_load_dump_load_is_equal(tmp_path, suffix):
    src = tmp_path / f"src{suffix}"
    text = {
        ".json": json.dumps(RAW),
        ".yaml": Recipe.from_dict(RAW).dumps("yaml"),
        ".toml": Recipe.from_dict(RAW).dumps("toml"),
    }[suffix]
    src.write_text(text)
    first = Recipe.load(src)
    assert first == Recipe.from_dict(RAW)
    again = first.dump(tmp_path / f"again{suffix}")
    assert Recipe.load(again) == first
    # and across formats: each writes what the others read
    for other in (".toml", ".yaml", ".json"):
        assert Recipe.load(first.dump(tmp_path / f"x{other}")) == first


def test_sections_are_typed_and_frozen():
    r = Recipe.from_dict(RAW)
    assert isinstance(r.prune, PruneSection) and r.prune.sparsity == {"fc1": 0.9}
    assert r.budget.max_drop == 0.5 and r.budget.bits == (3, 5)  # lists held as tuples
    assert r.channels.ignore == ("fc3",) and r.distill.teachers == ("a.pt",)
    assert r.export.reduce_range is True and r.export.opset == 17
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.prune.enabled = False  # type: ignore[misc]
    # to_dict is plain data, the same table the file reader resolves to
    d = r.to_dict()
    json.dumps(d)
    assert d["budget"]["bits"] == [3, 5] and recipe_mod.resolve(d) == r


def test_defaults_are_one_source():
    assert Recipe() == Recipe.from_dict({}) == recipe_mod.resolve(None)
    assert Recipe().to_dict() == recipe_mod.DEFAULTS
    # TOML has no null: keys whose default is None are left out of the file
    assert tomllib.loads(Recipe().dumps()) == {
        k: {n: v for n, v in t.items() if v is not None} if isinstance(t, dict) else t
        for k, t in recipe_mod.DEFAULTS.items()
    }


def test_built_in_python_is_checked_like_a_file():
    r = Recipe(prune=PruneSection(sparsity=0.8), quantize=QuantizeSection(fc_bits=4))
    assert r.prune.sparsity == 0.8 and r.quantize.fc_bits == 4
    with pytest.raises(InputError, match=r"prune\.sparsity = 1\.5 is impossible"):
        Recipe(prune=PruneSection(sparsity=1.5))
    with pytest.raises(InputError, match=r"export\.opset = 9 is impossible"):
        Recipe().replace(export=ExportSection(opset=9))
    with pytest.raises(InputError, match="prune is dict, not a PruneSection"):
        Recipe(prune={"sparsity": 0.9})  # type: ignore[arg-type]
    with pytest.raises(InputError, match="huffman codes the shared weights"):
        Recipe(quantize=QuantizeSection(enabled=False))


def test_replace_keeps_the_rest():
    r = Recipe.from_dict(RAW)
    r2 = r.replace(prune=dataclasses.replace(r.prune, rounds=1))
    assert r2.prune.rounds == 1 and r2.quantize == r.quantize and r.prune.rounds == 3


def test_from_dict_refuses_unknown_keys_and_wrong_types():
    with pytest.raises(InputError, match="unknown key prune.sparsty"):
        Recipe.from_dict({"prune": {"sparsty": 0.9}})
    with pytest.raises(InputError, match="a recipe is a table of sections"):
        Recipe.from_dict([1, 2])  # type: ignore[arg-type]
    with pytest.raises(InputError, match="recipe format 'ini'"):
        Recipe().dumps("ini")


def test_numpy_scalars_are_held_as_python_numbers():
    """A notebook's np.int64(4) bits were refused as 'not a whole number' while np.float64
    sparsity passed and stayed a numpy scalar in the recipe."""
    import numpy as np

    r = Recipe(
        quantize=QuantizeSection(fc_bits=np.int64(4)),
        prune=PruneSection(sparsity={"fc1": np.float64(0.8)}),
    )
    assert type(r.quantize.fc_bits) is int and type(r.prune.sparsity["fc1"]) is float
    assert Recipe.from_dict(json.loads(r.dumps("json"))) == r


def test_home_folders_in_recipe_paths_are_expanded(monkeypatch, tmp_path):
    """`calibration_data = "~/c.npy"` was looked for in a folder named `~`."""
    from compresskit.compressor import recipe

    monkeypatch.setenv("HOME", str(tmp_path))
    r = recipe.resolve(
        {"export": {"calibration_data": "~/c.npy"},
         "distill": {"student": "lenet5", "teachers": ["~/t.pt", "rel.pt"]}},
        source="r.toml",
    )  # fmt: skip
    assert r.export.calibration_data == str(tmp_path / "c.npy")
    assert r.distill.teachers == (str(tmp_path / "t.pt"), "rel.pt")


def test_nested_values_print_as_toml_that_loads_back_the_same(tmp_path):
    # Nested kwargs were written as Python text ({'a': 1}, [True]) that TOML refuses, and a
    # backslash in a list came back doubled.
    raw = {
        "distill": {
            "student": "mlp",
            "student_kwargs": {"cfg": {"a": 1, "flags": [True, False], "x": 2.5e-07}},
            "teachers": ["C:\\m\\t.pt", "tab\there"],
        },
        "channels": {"ignore": ["a\\b", 'quote"d']},
        "prune": {"sparsity": {"blocks.0.conv": 0.5, "fc": 0.25}},
    }
    first = Recipe.from_dict(raw)
    text = first.dumps("toml")
    assert "True" not in text and "{'" not in text
    (tmp_path / "r.toml").write_text(text)
    again = Recipe.load(tmp_path / "r.toml")
    assert again == first
    assert tuple(again.distill.teachers) == ("C:\\m\\t.pt", "tab\there")
    assert tuple(again.channels.ignore) == ("a\\b", 'quote"d')


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"prune": {"sparsity": {}}}, "prune.sparsity = {} is impossible; name layers"),
        ({"prune": {"sparsity": None}}, "needs a sparsity or a quality (neither is given)"),
        ({"version": True}, "recipe version True"),
        ({"distill": {"student_kwargs": {"a": {"b": None}}}}, "student_kwargs.a.b is null"),
        # TOML reads an unquoted dotted key as nested tables
        ({"prune": {"sparsity": {"features": {"0": 0.5}}}}, "'features.0' unquoted"),
        ({"quantize": {"bits": {"blocks": {"0": {"conv": 4}}}}}, '{"blocks.0.conv" = 4}'),
        (
            {"prune": {"sparsity": {"features": {"0": 0.5, "3": 0.7}}}},
            '{"features.0" = 0.5, "features.3" = 0.7}',
        ),
        # float32 loss times T^2: negative at 1e5, the student at chance at 1e12 (exit 0)
        ({"distill": {"temperature": 1e5}}, "distill.temperature = 100000.0 is impossible"),
        ({"train": {"temperature": 1000}}, "a temperature in (0, 100]"),
        ({"distill": {"student_kwargs": {"width": 4}}}, "student_kwargs (--student-kwargs) needs"),
        (
            {"distill": {"student": "mlp", "teachers": ["a.pt", "b.pt", "a.pt"]}},
            "distill.teachers names 'a.pt' twice",
        ),
    ],
)
def test_recipe_mistakes_are_named(raw, message):
    with pytest.raises(InputError) as e:
        Recipe.from_dict(raw, source="r.json")
    assert message in str(e.value) and str(e.value).startswith("r.json: ")


def test_yaml_reads_numbers_and_off_as_a_yaml_user_writes_them(tmp_path):
    # YAML 1.1 wants a dot in a float ('3e-4' was text, "not a positive number") and reads
    # `off` as false (refused, by a message that offered "off").
    (tmp_path / "r.yaml").write_text(
        "prune:\n  lr: 3e-4\nquantize:\n  lr: .5E-3\nbudget:\n  max_drop: off\n"
    )
    r = Recipe.load(tmp_path / "r.yaml")
    assert (r.prune.lr, r.quantize.lr, r.budget.max_drop) == (3e-4, 5e-4, "off")
    # "off" in every respect: no budget's retraining distillation either
    assert r == Recipe.from_dict({"prune": {"lr": 3e-4}, "quantize": {"lr": 5e-4}})
    with pytest.raises(InputError, match="budget.max_drop = False is impossible"):
        Recipe(budget=recipe_mod.BudgetSection(max_drop=False))  # in Python, a bool is a slip


def test_a_suffix_in_capitals_names_the_format(tmp_path):
    (tmp_path / "r.JSON").write_text('{"prune": {"rounds": 2}}')
    assert Recipe.load(tmp_path / "r.JSON").prune.rounds == 2
    written = Recipe.from_dict({"prune": {"rounds": 3}}).dump(tmp_path / "w.YAML")
    assert written.read_text().startswith("version: 1")


def test_yaml_strings_that_read_as_numbers_are_quoted(tmp_path):
    # "2e3" went out bare, the float reader read it back as a number, and the file was refused
    r = Recipe.from_dict({"distill": {"student": "2e3", "teachers": ["1e5"]}})
    assert Recipe.load(r.dump(tmp_path / "x.yaml")) == r


def test_a_report_or_dry_run_json_is_read_for_its_recipe(tmp_path):
    (tmp_path / "report.json").write_text(
        json.dumps({"baseline": {"bytes": 1}, "recipe": {"prune": {"rounds": 2}}})
    )
    assert Recipe.load(tmp_path / "report.json").prune.rounds == 2
    # a recipe file's own [recipe] table is not a report's: refused, the rest not dropped
    (tmp_path / "r.toml").write_text("[recipe]\n[prune]\nrounds = 2\n")
    with pytest.raises(InputError, match="unknown key 'recipe'"):
        Recipe.load(tmp_path / "r.toml")
