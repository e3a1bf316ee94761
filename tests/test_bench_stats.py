"""compressor.stats against numpy references and the known sampling error of the median/mean."""

from __future__ import annotations

import math

import numpy as np
import pytest

from compresskit.compressor.stats import (
    bootstrap_ci,
    paired_accuracy_change,
    percentiles,
    relative_change,
    summarize,
)
from compresskit.models.errors import InputError


def test_percentiles_match_numpy_linear_interpolation():
    x = np.random.default_rng(1).lognormal(mean=-5, sigma=0.5, size=257)
    got = percentiles(x, qs=(50, 90, 99, 99.9))
    assert list(got) == ["p50_ms", "p90_ms", "p99_ms", "p99.9_ms"]
    for q in (50, 90, 99, 99.9):
        assert got[f"p{q:g}_ms"] == pytest.approx(np.percentile(x, q) * 1e3, rel=1e-12)


def test_percentiles_interpolate_between_order_statistics():
    # 0, 1, 2, 3 s: the linear method puts p50 half-way between 1 and 2, p90 at 2.7.
    got = percentiles([3.0, 0.0, 2.0, 1.0], qs=(50, 90))
    assert got == pytest.approx({"p50_ms": 1500.0, "p90_ms": 2700.0})


@pytest.mark.parametrize("n", [100, 10_000])
def test_median_ci_covers_true_median_with_textbook_width(n):
    sigma = 2.0
    x = np.random.default_rng(n).normal(loc=5.0, scale=sigma, size=n)
    lo, hi = bootstrap_ci(x, np.median, confidence=0.95, resamples=2000, seed=0)
    assert lo < 5.0 < hi
    # Asymptotic std error of a normal sample's median: sqrt(pi/2) * sigma / sqrt(n).
    expected = 2 * 1.959964 * math.sqrt(math.pi / 2) * sigma / math.sqrt(n)
    assert hi - lo == pytest.approx(expected, rel=0.3)


def test_ci_width_shrinks_with_n():
    rng = np.random.default_rng(7)
    small = bootstrap_ci(rng.normal(size=100))
    large = bootstrap_ci(rng.normal(size=10_000))
    # Width scales as 1/sqrt(n): a factor 10 between these sizes; demand at least 4.
    assert (large[1] - large[0]) * 4 < small[1] - small[0]


def test_mean_ci_matches_normal_theory():
    x = np.random.default_rng(3).exponential(scale=1.0, size=4000)
    lo, hi = bootstrap_ci(x, np.mean, confidence=0.9, resamples=3000, seed=5)
    se = x.std(ddof=1) / math.sqrt(x.size)
    assert lo == pytest.approx(x.mean() - 1.644854 * se, abs=0.25 * se)
    assert hi == pytest.approx(x.mean() + 1.644854 * se, abs=0.25 * se)


def test_bootstrap_is_deterministic_per_seed_and_varies_across_seeds():
    x = np.random.default_rng(0).normal(size=300)
    assert bootstrap_ci(x, seed=11) == bootstrap_ci(x, seed=11)
    assert bootstrap_ci(x, seed=11) != bootstrap_ci(x, seed=12)


def test_bootstrap_chunking_handles_large_n():
    # n * resamples = 2e7 indices, ten chunks: the result must still be a sane, narrow CI.
    x = np.random.default_rng(2).normal(loc=1.0, scale=1.0, size=100_000)
    lo, hi = bootstrap_ci(x, resamples=200)
    assert lo < np.median(x) < hi
    assert 0 < hi - lo < 0.03


def test_constant_sample_gives_degenerate_ci():
    assert bootstrap_ci(np.full(50, 0.0125)) == (0.0125, 0.0125)
    assert bootstrap_ci([0.003]) == (0.003, 0.003)


def test_summarize_arithmetic():
    samples = np.array([0.010, 0.012, 0.011, 0.020, 0.009])
    s = summarize(samples, batch=8)
    assert s["runs"] == 5
    assert s["seconds"] == pytest.approx(0.062)
    assert s["p50_ms"] == pytest.approx(11.0)
    assert s["mean_ms"] == pytest.approx(12.4)
    assert s["std_ms"] == pytest.approx(np.std(samples, ddof=1) * 1e3)
    assert s["p99_ms"] == pytest.approx(np.percentile(samples, 99) * 1e3)
    assert s["throughput_per_s"] == pytest.approx(8 / 0.011)
    lo, hi = s["p50_ci_ms"]
    assert 9.0 <= lo <= 11.0 <= hi <= 20.0


def test_summarize_single_run():
    s = summarize([0.004], batch=1)
    assert s["std_ms"] == 0.0
    assert s["p50_ci_ms"] == [pytest.approx(4.0), pytest.approx(4.0)]
    assert s["throughput_per_s"] == pytest.approx(250.0)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: percentiles([]), "no latency samples"),
        (lambda: percentiles([0.1, float("nan")]), "NaN or inf"),
        (lambda: percentiles([0.1], qs=(50, 101)), r"\[0, 100\]"),
        (lambda: bootstrap_ci([0.1, float("inf")]), "NaN or inf"),
        (lambda: bootstrap_ci([0.1, 0.2], confidence=1.0), "confidence"),
        (lambda: bootstrap_ci([0.1, 0.2], resamples=0), "resamples"),
        (lambda: summarize(np.array([]), batch=1), "no latency samples"),
        (lambda: summarize([0.1], batch=0), "batch size"),
        (lambda: summarize([0.1], batch=2.5), "batch size"),
        (lambda: summarize([0.0, 0.0], batch=1), "median latency"),
        (lambda: relative_change(0.0, 1.0), "baseline"),
    ],
)
def test_bad_input_is_refused(call, match):
    with pytest.raises(InputError, match=match):
        call()


def test_relative_change():
    assert relative_change(10.0, 12.0) == pytest.approx(0.2)
    assert relative_change(10.0, 5.0) == pytest.approx(-0.5)


def test_paired_accuracy_change_counts_and_interval():
    rng = np.random.default_rng(1)
    before = rng.random(2000) < 0.95
    after = before.copy()
    flip = rng.choice(2000, 60, replace=False)  # 60 samples change their verdict
    after[flip] = ~after[flip]
    c = paired_accuracy_change(before, after)
    gained, lost = int(np.sum(after & ~before)), int(np.sum(before & ~after))
    assert (c["gained"], c["lost"], c["samples"]) == (gained, lost, 2000)
    assert c["points"] == pytest.approx(100 * (after.mean() - before.mean()))
    lo, hi = c["ci_points"]
    assert lo < c["points"] < hi
    # the paired interval: normal theory for the mean of d in {-1, 0, 1}, within 10% of width
    d = after.astype(float) - before.astype(float)
    half = 100 * 1.96 * d.std() / math.sqrt(len(d))
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.1)
    # an unpaired interval would be far wider: what the two models share cancels
    assert hi - lo < 100 * 2 * 1.96 * math.sqrt(2 * 0.95 * 0.05 / 2000)


def test_paired_accuracy_change_without_discordant_samples_is_exactly_zero():
    same = np.arange(50) % 3 == 0
    c = paired_accuracy_change(same, same)
    assert c["points"] == 0.0 and c["ci_points"] == [0.0, 0.0] and c["gained"] == c["lost"] == 0


@pytest.mark.parametrize("a, b", [([True, False], [True]), ([], []), ([[True]], [[True]])])
def test_paired_accuracy_change_refuses_unpaired_vectors(a, b):
    with pytest.raises(InputError, match="correctness vectors"):
        paired_accuracy_change(a, b)
