"""Latency statistics for `compress bench`: percentiles, a bootstrap CI of the median, a summary.

Pure numpy, so reports can be recomputed from the raw samples without the runtimes installed.
Samples are per-run wall times in seconds; everything reported is in milliseconds, except
`seconds` (the total measured time) and `throughput_per_s`.

Bad input (no samples, NaN/inf, a non-positive batch) raises `models.errors.InputError`, not
ValueError: an empty sample set usually comes from a flag such as `--runs 0`, and the CLI turns
InputError into a one-line message instead of a traceback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from compresskit.models.errors import InputError

# Bound on index-matrix elements per bootstrap chunk: 2M int64 indices plus the gathered float64
# values is ~32 MB, whatever n is, so n ~ 1e5 samples x 2000 resamples stays well under 100 MB.
_CHUNK_ELEMENTS = 2_000_000


def _check(samples: Sequence[float] | np.ndarray, what: str = "samples") -> np.ndarray:
    """Return `samples` as a 1-D float64 array, refusing empty or non-finite input."""
    x = np.asarray(samples, dtype=np.float64).ravel()
    if x.size == 0:
        raise InputError(f"no latency {what} to summarise; run the benchmark at least once")
    if not np.all(np.isfinite(x)):
        raise InputError(f"latency {what} contain NaN or inf; re-run the benchmark")
    return x


def percentiles(
    samples_s: Sequence[float] | np.ndarray, qs: Sequence[float] = (50, 90, 99)
) -> dict[str, float]:
    """Percentiles of latency samples (seconds), in milliseconds, keyed "p50_ms", "p90_ms", ...

    Uses numpy's default "linear" method (type 7 of Hyndman & Fan: interpolate between the two
    nearest order statistics), so values match `np.percentile` and spreadsheets' PERCENTILE.
    Keys format q with `:g`, so 99.9 gives "p99.9_ms".
    """
    x = _check(samples_s)
    q = np.asarray(qs, dtype=np.float64)
    if q.size == 0 or np.any((q < 0) | (q > 100)):
        raise InputError(f"percentiles {list(qs)} must be in [0, 100]; pass e.g. (50, 90, 99)")
    values = np.percentile(x, q) * 1e3
    return {f"p{qi:g}_ms": float(v) for qi, v in zip(q, values, strict=True)}


def bootstrap_ci(
    samples: Sequence[float] | np.ndarray,
    stat: Callable[..., np.ndarray] = np.median,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile-bootstrap confidence interval of `stat` over `samples` (same units as input).

    Draws `resamples` resamples with replacement, computes `stat(..., axis=1)` on each and
    returns the (1-c)/2 and (1+c)/2 quantiles of those statistics. `stat` must accept `axis`
    (np.median, np.mean, np.percentile via functools.partial ... do). Resamples are drawn in
    chunks of rows so memory stays bounded for large n; the same seed gives the same interval.
    A constant sample gives the degenerate interval (c, c).
    """
    x = _check(samples)
    if not 0.0 < confidence < 1.0:
        raise InputError(f"confidence {confidence} must be in (0, 1); pass e.g. 0.95")
    if resamples < 1:
        raise InputError(f"resamples {resamples} must be at least 1; pass e.g. 2000")
    n = x.size
    rng = np.random.default_rng(seed)
    rows = max(1, _CHUNK_ELEMENTS // n)
    stats = np.empty(resamples, dtype=np.float64)
    for start in range(0, resamples, rows):
        stop = min(start + rows, resamples)
        idx = rng.integers(0, n, size=(stop - start, n))
        stats[start:stop] = stat(x[idx], axis=1)
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(stats, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def summarize(
    samples_s: Sequence[float] | np.ndarray,
    batch: int,
    *,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> dict:
    """The latency block of a benchmark report, from per-run times in seconds.

    Keys: p50_ms, p90_ms, p99_ms, p50_ci_ms ([lo, hi], bootstrap CI of the median), mean_ms,
    std_ms (sample std, ddof=1; 0.0 for a single run), runs, seconds (sum of samples) and
    throughput_per_s = batch / median seconds (the median, not the mean, so one stall in a
    run does not move the throughput).
    """
    x = _check(samples_s)
    if int(batch) != batch or batch < 1:
        raise InputError(f"batch size {batch} must be a positive integer; pass e.g. --batch 1")
    median = float(np.median(x))
    if median <= 0.0:
        raise InputError("median latency is not positive; the clock or the samples are wrong")
    lo, hi = bootstrap_ci(x, np.median, confidence=confidence, resamples=resamples, seed=seed)
    out: dict = percentiles(x)
    out["p50_ci_ms"] = [lo * 1e3, hi * 1e3]
    out["mean_ms"] = float(np.mean(x)) * 1e3
    out["std_ms"] = float(np.std(x, ddof=1)) * 1e3 if x.size > 1 else 0.0
    out["runs"] = int(x.size)
    out["seconds"] = float(np.sum(x))
    out["throughput_per_s"] = int(batch) / median
    return out


def relative_change(a: float, b: float) -> float:
    """(b - a) / a: the change from baseline `a` to `b` (e.g. two p50s); +0.1 means b is 10% slower."""
    if not (np.isfinite(a) and np.isfinite(b)) or a == 0:
        raise InputError(
            f"cannot compare {b} to baseline {a}; the baseline must be finite, non-zero"
        )
    return (b - a) / a


def paired_accuracy_change(
    before: Sequence[bool] | np.ndarray,
    after: Sequence[bool] | np.ndarray,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> dict[str, float | int | list[float]]:
    """How top-1 accuracy changed from `before` to `after`, per-sample correctness of two
    models on the same test samples: the change in points, its paired percentile-bootstrap
    interval (the same samples resampled for both, so what they share cancels), and McNemar's
    discordant counts (samples only `after` gets right, samples only `before` gets right).

    At 2,000 test images a point is 20 images; the interval says whether a -0.2 is a loss or
    noise. No discordant samples gives the interval (0, 0): the two agree on every sample."""
    b, a = np.asarray(before, dtype=bool), np.asarray(after, dtype=bool)
    if b.shape != a.shape or b.ndim != 1 or b.size == 0:
        raise InputError(
            f"paired accuracy: {b.shape} and {a.shape} correctness vectors; give two of the "
            "same length, one entry per test sample"
        )
    diff = a.astype(np.float64) - b.astype(np.float64)
    gained, lost = int(np.sum(a & ~b)), int(np.sum(b & ~a))
    if gained == lost == 0:
        lo = hi = 0.0
    else:
        lo, hi = bootstrap_ci(diff, np.mean, confidence, resamples, seed)
    return {
        "points": 100.0 * float(diff.mean()),
        "ci_points": [100.0 * lo, 100.0 * hi],
        "gained": gained,
        "lost": lost,
        "samples": int(b.size),
    }
