"""`compress shrink`'s edges with users' own files: which ONNX file to ship, and calibration
inputs laid out as the training npz."""

import numpy as np
import pytest


def test_an_int8_file_larger_than_the_fp32_one_is_not_the_one_to_ship():
    # A 1.5k-weight student's INT8 file (scales, zero points, Q/DQ nodes) outweighed its FP32
    # file and was still labelled "ship this".
    from compresskit.compressor.pipeline import deliverables

    def report(int8_bytes):
        return {
            "baseline": {"bytes": 6000},
            "onnx": {
                "fp32": {"path": "o/model.fp32.onnx", "bytes": 13101},
                "int8": {"path": "o/model.int8.onnx", "bytes": int8_bytes},
            },
        }

    d = deliverables(report(14307))
    assert d["ship"] == "model.fp32.onnx"
    assert "model.int8.onnx (14,307 B) outweighs model.fp32.onnx (13,101 B)" in d["ship_why"]
    d = deliverables(report(5000))
    assert d["ship"] == "model.int8.onnx" and "ship_why" not in d


@pytest.mark.parametrize("shape", [(1, 64), (64,)])
def test_a_calibration_file_cut_from_the_npz_x_takes_its_layout(tmp_path, shape):
    # (N, 1, L) audio reaches the model with the npz's added axis; a calibration file cut from
    # the same x was refused as "(1, 64), the model takes (1, 1, 64)". (N, F) stays as given.
    from torch import nn

    from compresskit.compressor import pipeline, recipe
    from compresskit.models import data

    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, *shape)).astype("float32")
    np.savez(tmp_path / "a.npz", x=x, y=np.arange(60) % 3)
    ds = data.load(f"npz:{tmp_path / 'a.npz'}")
    assert ds.in_shape == ((1, 1, 64) if len(shape) == 2 else (64,))
    np.save(tmp_path / "c.npy", x[:16])
    r = recipe.resolve({"export": {"calibration_data": str(tmp_path / "c.npy")}})
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 3))
    calib = pipeline.preflight(r, ds, model)
    assert calib.shape == (16, *ds.in_shape) and np.array_equal(
        calib.reshape(16, 64), x[:16].reshape(16, 64)
    )
