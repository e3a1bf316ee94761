"""Seconds spent running a model over data outside its training loop: test and validation
passes, sensitivity sweeps, INT8 calibration, the fallback search's agreement checks, node
error measurements, parity and INT8 timing.

Such a pass costs what training does per sample, the model's FLOPs times the samples, not what
its weights cost: ViT-tiny makes 68 multiply-adds per weight for a 32x32 image, ResNet-18 3.3,
so the same pass costs ~20x more per weight on the ViT. The pipeline reports these seconds
apart (`timings.data_passes`), and what is left of the non-training time (k-means, archive,
export, the quantizer's graph rewrites, sessions built) is the part that should grow with the
weights. Nested passes count once (the outermost), and passes made inside a training loop are
the pipeline's to subtract (`compressor.pipeline._Clock`). The total is per process: two
shrinks run at once in threads of one process would each count the other's passes.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator

_lock = threading.Lock()
_state = threading.local()
_seconds = 0.0


def seconds() -> float:
    """Seconds spent in outermost `data_pass` blocks so far, in this process."""
    return _seconds


@contextlib.contextmanager
def data_pass() -> Iterator[None]:
    """Count the block's wall time as a pass over data (once, however deeply nested)."""
    global _seconds
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    t = time.perf_counter()
    try:
        yield
    finally:
        _state.depth = depth
        if depth == 0:
            with _lock:
                _seconds += time.perf_counter() - t


def counted(fn):
    """`fn` with its whole call counted as a pass over data (`data_pass`)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with data_pass():
            return fn(*args, **kwargs)

    return wrapper
