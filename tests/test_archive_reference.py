"""The `.dcz` reader against a second decoder written from docs/archive-format.md alone
(`dcz_reference.py`: its own range-coder arithmetic, no constriction), in every mode."""

import itertools

import dcz_reference
import numpy as np
import pytest
import torch

import compresskit as ck
from compresskit.compressor import ExportSection, PruneSection, QuantizeSection, archive

SPEC = {"name": "lenet5", "kwargs": {"in_shape": [1, 8, 8], "num_classes": 10}}


def _same(state: dict[str, torch.Tensor], ref: dict[str, np.ndarray]) -> None:
    assert list(ref) == list(state)
    for name, t in state.items():
        want = (t.float() if t.dtype == torch.bfloat16 else t).numpy()
        assert ref[name].dtype == want.dtype and ref[name].shape == want.shape, name
        assert ref[name].tobytes() == want.tobytes(), name


def _layer(seed: int, rows: int = 24, cols: int = 40, k: int = 12):
    """A pruned layer with structure the context modes use: whole input columns pruned, and
    each kept index near its left neighbour's."""
    g = np.random.default_rng(seed)
    mask = (g.random((rows, cols)) < 0.3) & (g.random(cols) < 0.8)[None, :]
    walk = np.clip(np.cumsum(g.integers(-1, 2, (rows, cols)), 1) + k // 2, 0, k - 1)
    codebook = np.sort(g.normal(size=k)).astype(np.float32)
    positions = np.flatnonzero(mask)
    index = walk.ravel()[positions]
    return archive.Shared(f"l{seed}.weight", (rows, cols), codebook, index, positions, 4)


DENSE = [
    archive.Dense("f32", torch.randn(50, generator=torch.Generator().manual_seed(0))),
    archive.Dense("f16", torch.tensor([0.5, -0.25, 3.0, 1024.0]), store_fp16=True),
    archive.Dense("bf16", torch.tensor([1.5, -2.0, 0.0], dtype=torch.bfloat16)),
    archive.Dense("f64", torch.tensor([1e-300, 2.5], dtype=torch.float64)),
    archive.Dense("i64", torch.tensor(7)),
    archive.Dense("i8", torch.tensor([-3, 4], dtype=torch.int8)),
    archive.Dense("flags", torch.tensor([True, False, True])),
    archive.Dense("empty", torch.zeros(0, 3)),
]


@pytest.mark.parametrize("cmode, mmode, imode", list(itertools.product((0, 1), (1, 2), (0, 1))))
def test_every_mode_decodes_the_same_in_both_decoders(cmode, mmode, imode):
    shared = [_layer(0), _layer(1, k=200), _layer(2, rows=3, cols=500, k=2)]
    full = archive.Shared(
        "full.weight", (4, 5), np.float32([-1, 1]), np.arange(20) % 2, np.arange(20), 0
    )
    entries = [*DENSE, *shared, full, archive.Alias("tied.weight", "l0.weight")]
    modes = [cmode % 2 if i % 2 else 1 - cmode for i in range(len(DENSE))]
    modes += [(cmode, mmode, imode)] * len(shared) + [(cmode, 0, imode), None]
    data, _ = archive.encode(entries, SPEC, {"note": "é"}, 3, modes)
    decoded = archive.decode(data)
    header, ref = dcz_reference.decode(data)
    assert header == {"model": SPEC, "metadata": {"note": "é"}, "tensors": list(ref)}
    _same(decoded.state_dict, ref)
    assert ref["tied.weight"] is ref["l0.weight"]


def test_format_2_decodes_the_same_in_both_decoders():
    entries = [*DENSE, _layer(0), _layer(1, k=200)]
    entries += [
        archive.Shared(
            "gaps.weight",
            (3, 300),
            np.float32([2.0]),
            np.zeros(4, int),
            np.array([0, 5, 299, 899]),
            3,
        )
    ]
    data, _ = archive.encode(entries, SPEC, {}, 2)
    _same(archive.decode(data).state_dict, dcz_reference.decode(data)[1])


def test_a_shrunk_model_decodes_the_same_in_both_decoders(tmp_path):
    torch.manual_seed(0)
    recipe = ck.Recipe(
        prune=PruneSection(sparsity=0.7, rounds=1, retrain_epochs=1),
        quantize=QuantizeSection(finetune_epochs=1),
        export=ExportSection(enabled=False),
    )
    run = ck.train("lenet5", "digits", ck.TrainConfig(epochs=1), out=tmp_path / "t.pt")
    report = ck.shrink(run, "digits", recipe, out=tmp_path / "o")
    data = (report.out / "model.dcz").read_bytes()
    _same(archive.decode(data).state_dict, dcz_reference.decode(data)[1])
