"""What runs off Linux: Windows' drives (commonpath raises across them) and code pages."""

from __future__ import annotations

import os
from pathlib import Path

from compresskit.compressor.measure import variants
from compresskit.models import safeload


def _model(path: Path) -> variants.Model:
    return variants.Model(path, "onnx", "fp32", 1, None, None, path.name)


def test_same_names_on_two_drives_keep_their_whole_paths(tmp_path, monkeypatch):
    """C:\\a\\model.onnx and D:\\b\\model.onnx: commonpath raised ValueError, an unexpected
    error for `compress bench`."""
    a, b = tmp_path / "a" / "model.onnx", tmp_path / "b" / "model.onnx"

    def two_drives(paths):
        raise ValueError("Paths don't have the same drive")

    monkeypatch.setattr(os.path, "commonpath", two_drives)
    labels = [m.label for m in variants.disambiguate([_model(a), _model(b)])]
    assert labels == [str(a.resolve()), str(b.resolve())]


def test_a_location_on_another_drive_is_outside_the_folder(monkeypatch):
    def two_drives(paths):
        raise ValueError("Paths don't have the same drive")

    monkeypatch.setattr(os.path, "commonpath", two_drives)
    assert not safeload._within("C:\\models", "D:\\weights.bin")
