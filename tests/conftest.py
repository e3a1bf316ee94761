"""Shared fixtures: small data files the tests make themselves, and a CLI runner."""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path

from compresskit._threads import short_spin

short_spin()  # before torch loads, as the `compress` command does: see compresskit/_threads.py

import numpy as np
import pytest
from click.testing import CliRunner

from compresskit.cli.main import cli


def write_idx(path: Path, array: np.ndarray, *, gz: bool = False) -> Path:
    """Write a uint8 array as an IDX file (the MNIST format), optionally gzipped."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)
    return path


def blobs(n: int, side: int = 8, classes: int = 3, seed: int = 0):
    """Easily separable images: class k lights up the k-th horizontal band, plus noise."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    x = rng.integers(0, 40, (n, side, side)).astype(np.uint8)
    band = side // classes
    for i, k in enumerate(y):
        x[i, k * band : (k + 1) * band] = 220
    return x, y


@pytest.fixture
def mnist_dir(tmp_path: Path) -> Path:
    """A folder with only t10k files (gzipped), 50 images of 28x28, like ../shared/data/mnist."""
    x, y = blobs(50, side=28, classes=10)
    write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", x, gz=True)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", y, gz=True)
    return tmp_path


@pytest.fixture
def npz_file(tmp_path: Path) -> Path:
    x, y = blobs(300)
    path = tmp_path / "blobs.npz"
    np.savez(path, x=x, y=y)
    return path


class Run:
    """CliRunner wrapper: result with stdout/stderr split and a parsed JSON helper."""

    def __init__(self) -> None:
        self.runner = CliRunner()

    def __call__(self, *args: str):
        result = self.runner.invoke(cli, [str(a) for a in args], catch_exceptions=False)
        result.json = lambda: json.loads(result.stdout)  # type: ignore[attr-defined]
        return result


@pytest.fixture
def run() -> Run:
    return Run()


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """`user_module(name, source)`: a user's own model code, written to tmp_path and imported
    as `name` (what --model name:Class imports); removed from sys.modules afterwards."""
    import importlib
    import sys
    import textwrap

    def make(name: str, source: str):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, name, raising=False)
        return importlib.import_module(name)

    return make


@pytest.fixture(scope="session")
def zoo_onnx(tmp_path_factory) -> dict:
    """Every zoo model's tiny instance (1x8x8 images, or 16 token ids), exported once with the
    default settings, as {name: (model, path)}: test_export checks each against PyTorch,
    test_flops counts its MACs (each had exported all of them itself)."""
    import torch

    from compresskit.compressor import export
    from compresskit.models import available, tiny
    from compresskit.models.zoo import input_kind

    folder = tmp_path_factory.mktemp("zoo-onnx")
    files = {}
    for name in sorted(available()):
        tokens = input_kind(name) == "tokens"
        model = tiny(name, in_shape=None if tokens else (1, 8, 8)).eval()
        x = torch.ones(2, 16, dtype=torch.int64) if tokens else torch.rand(2, 1, 8, 8)
        (folder / name).mkdir()
        path = folder / name / f"{name}.onnx"
        files[name] = model, export.export_onnx(model, x, path, export.ExportConfig())
    return files
