"""Latency measurement: the same method for every runtime, so numbers compare side by side.

Each variant is a zero-argument callable that runs one inference. After warm-up, the variants
run interleaved (A B C A B C ...) until both a time budget and a minimum number of runs are
reached, so drift of the machine (frequency, other load) hits all of them alike. Used by
`shrink`'s latency-aware precision choice and by `compress demo`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run PyTorch on `n` intra-op threads inside the block (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def torch_runner(model: nn.Module, x: torch.Tensor) -> Callable[[], object]:
    """One eager FP32 forward pass of `model` on `x`, without autograd."""
    model = model.eval()

    def call():
        with torch.inference_mode():
            return model(x)

    return call


def onnx_runner(path: Path, x: np.ndarray, threads: int = 1) -> Callable[[], object]:
    """One `session.run` of the ONNX (or .ort) file on ORT's CPU provider."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: x}
    return lambda: session.run(None, feed)


def interleaved(
    runners: list[Callable[[], object]],
    seconds: float = 0.6,
    min_runs: int = 30,
    warmup: int = 10,
) -> list[np.ndarray]:
    """Per-call seconds of each runner, measured interleaved after `warmup` calls each."""
    for run in runners:
        for _ in range(warmup):
            run()
    times: list[list[float]] = [[] for _ in runners]
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times[0]) < min_runs:
        for t, run in zip(times, runners, strict=True):
            t0 = time.perf_counter()
            run()
            t.append(time.perf_counter() - t0)
    return [np.asarray(t) for t in times]


def p50_ms(runners: list[Callable[[], object]], seconds: float = 0.6) -> list[float]:
    """Median latency (ms) of each runner, measured interleaved."""
    return [1000 * float(np.median(t)) for t in interleaved(runners, seconds)]
