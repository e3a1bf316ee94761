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
