"""Peak RSS per pipeline step of one `compress shrink`, for `benchmarks/real_models.py`.

Imported into the measured process by real_models.py's wrapper, before the CLI runs: a daemon
thread samples the process's RSS (/proc/self/statm) every 2 ms, and the pipeline's steps
(`pipeline._Clock.step`), the Deep Compression stages inside `deep_compression` (pruning,
weight sharing, the archive's entries and shared-vs-dense choice) and every training loop
(`Hooks.retrain`, wrapped by `_Clock.timed_retrain`) are wrapped to mark when they ran. At
exit, per mark: the highest RSS sampled while it ran. Nothing of the pipeline changes but the
wrappers' bookkeeping; VmHWM (the whole run's exact peak) stays the benchmark's figure, these
samples say where it was. A spike shorter than 2 ms can be missed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def start(path: str):
    """Start sampling and wrap the pipeline; returns the function that writes the per-step
    peaks to `path` (register it with atexit)."""
    samples: list[tuple[float, int]] = []
    marks: list[tuple[str, float, float]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.perf_counter(), _rss()))
            time.sleep(0.002)

    threading.Thread(target=sample, daemon=True, name="stage-memory").start()

    from compresskit.compressor import pipeline, shrink

    def marked(name: str, fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                marks.append((name, t, time.perf_counter()))

        return run

    for name in ("_prune", "_quantize", "prefer_dense_", "_entries"):
        setattr(shrink, name, marked(name.strip("_"), getattr(shrink, name)))

    step = pipeline._Clock.step

    @contextlib.contextmanager
    def marked_step(self, name: str, what: str = ""):
        t = time.perf_counter()
        try:
            with step(self, name, what):
                yield
        finally:
            marks.append((name, t, time.perf_counter()))

    pipeline._Clock.step = marked_step
    timed_retrain = pipeline._Clock.timed_retrain

    def marked_retrain(self, hooks):
        hooks = timed_retrain(self, hooks)
        return dataclasses.replace(hooks, retrain=marked("training", hooks.retrain))

    pipeline._Clock.timed_retrain = marked_retrain

    def write() -> None:
        stop.set()
        out: dict[str, dict[str, float]] = {}
        for name, t0, t1 in marks:
            inside = [r for t, r in samples if t0 <= t <= t1]
            if not inside:
                continue
            o = out.setdefault(name, {"peak": 0, "seconds": 0.0, "calls": 0})
            o["peak"] = max(o["peak"], max(inside))
            o["seconds"] += t1 - t0
            o["calls"] += 1
        covered = [(t0, t1) for _, t0, t1 in marks]
        rest = [r for t, r in samples if not any(a <= t <= b for a, b in covered)]
        if rest:
            out["outside any step"] = {"peak": max(rest), "seconds": 0.0, "calls": 0}
        if samples:
            out["whole run (sampled)"] = {"peak": max(r for _, r in samples), "seconds": 0.0}
        with open(path, "w") as f:
            json.dump(out, f)

    return write
