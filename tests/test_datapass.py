"""compresskit._datapass: seconds spent running a model over data, counted once when nested
(the shrink report's split: tests/test_shrink_cli.py)."""

import time

import pytest

from compresskit import _datapass


def test_nested_passes_count_once_and_only_inside():
    start = _datapass.seconds()
    time.sleep(0.02)  # outside any pass: not counted
    assert _datapass.seconds() == start

    @_datapass.counted
    def inner():
        time.sleep(0.05)
        return 7

    t = time.perf_counter()
    with _datapass.data_pass():
        assert inner() == 7  # nested in the outer block: the outer one counts the time
        time.sleep(0.05)
    wall = time.perf_counter() - t
    counted = _datapass.seconds() - start
    assert 0.1 <= counted <= wall  # once: twice would be >= 0.15 and above the wall time


def test_counted_still_counts_when_the_call_raises():
    start = _datapass.seconds()

    @_datapass.counted
    def broken():
        time.sleep(0.02)
        raise ValueError("x")

    with pytest.raises(ValueError):
        broken()
    assert _datapass.seconds() - start >= 0.02
    with _datapass.data_pass():  # depth went back to 0: a new outer block counts again
        time.sleep(0.02)
    assert _datapass.seconds() - start >= 0.04


def test_clock_counts_passes_outside_training_only():
    from compresskit.compressor import pipeline
    from compresskit.compressor.shrink import Hooks

    def retrain(*args):  # a training loop whose own test evaluation is a data pass
        time.sleep(0.05)
        with _datapass.data_pass():
            time.sleep(0.1)

    clock = pipeline._Clock(lambda message: None)
    hooks = clock.timed_retrain(Hooks(retrain, lambda m: 0.0, lambda m: 0.0))
    hooks.retrain(None, 1, 0.1, None)
    with _datapass.data_pass():  # an evaluation outside training
        time.sleep(0.05)
    time.sleep(0.05)  # per-weight work
    t = clock.record()
    assert t["training"] >= 0.15  # the loop's evaluation is training time
    # the outside pass only: counting the loop's 0.1 s too would give >= 0.15 (the margin
    # absorbs a busy machine's sleep overshoot)
    assert 0.05 <= t["data_passes"] < 0.15
    assert t["per_weight"] >= 0.05
    assert abs(t["training"] + t["data_passes"] + t["per_weight"] - t["total"]) < 0.005
