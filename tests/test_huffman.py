"""Canonical Huffman and gap coding (compressor/huffman.py) against independent oracles.

Oracles: a heapq Huffman for the optimal cost, brute force over all length assignments for the
length-limited optimum, bitarray's own encoder for the bit stream, RFC 1951's worked example
for canonical codes, and a per-element Python loop for the gap symbols.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np
import pytest
from bitarray import bitarray

from compresskit.compressor.huffman import (
    MAX_CODE_LENGTH,
    canonical_codes,
    code_lengths,
    decode,
    decode_gaps,
    encode,
    encode_gaps,
    entropy_bits,
    stream_bits,
)


def kraft(lengths):
    lengths = np.asarray(lengths, dtype=np.int64)
    return float(np.sum(2.0 ** -lengths[lengths > 0]))


def huffman_cost(counts):
    """Total coded bits of an optimal prefix code: the sum of the weights of all merges."""
    heap = [int(c) for c in counts if c > 0]
    if len(heap) == 1:
        return heap[0]
    heapq.heapify(heap)
    cost = 0
    while len(heap) > 1:
        merged = heapq.heappop(heap) + heapq.heappop(heap)
        cost += merged
        heapq.heappush(heap, merged)
    return cost


def round_trip(x, alphabet=None):
    x = np.asarray(x)
    counts = np.bincount(x, minlength=alphabet or 0)
    lengths = code_lengths(counts)
    data = encode(x, lengths)
    np.testing.assert_array_equal(decode(data, lengths, x.size), x)
    return counts, lengths, data


def streams():
    rng = np.random.default_rng(0)
    weights = rng.normal(0, 1, 20_000)
    yield "uniform-256", rng.integers(0, 256, 20_000)
    yield "geometric", np.minimum(rng.geometric(0.4, 20_000) - 1, 63)
    # Quantized weights look like a peaked bell over the cluster indices.
    yield "5-bit weights", np.clip(np.round(weights * 4 + 16), 0, 31).astype(np.int64)
    yield "8-bit weights", np.clip(np.round(weights * 30 + 128), 0, 255).astype(np.int64)


@pytest.mark.parametrize(("name", "x"), list(streams()), ids=[name for name, _ in streams()])
def test_round_trip_and_bitarray_agrees(name, x):
    counts, lengths, data = round_trip(x)
    # An independent encoder fed our canonical codes must produce the same bytes.
    codes = canonical_codes(lengths)
    codedict = {
        s: bitarray(format(int(codes[s]), f"0{lengths[s]}b")) for s in np.flatnonzero(lengths)
    }
    reference = bitarray(endian="big")
    reference.encode(codedict, x.tolist())
    assert data == reference.tobytes()
    assert stream_bits(x, lengths) == huffman_cost(counts)
    assert entropy_bits(counts) <= stream_bits(x, lengths) < entropy_bits(counts) + x.size


def test_empty_stream():
    lengths = code_lengths(np.array([3, 1, 0]))
    assert encode(np.array([], dtype=np.int64), lengths) == b""
    out = decode(b"", lengths, 0)
    assert out.dtype == np.int64 and out.size == 0
    assert stream_bits(np.array([], dtype=np.int64), lengths) == 0
    np.testing.assert_array_equal(code_lengths(np.zeros(5, dtype=np.int64)), np.zeros(5))
    assert decode(b"", np.zeros(4, dtype=np.uint8), 0).size == 0


@pytest.mark.parametrize("n", [1, 1000])
def test_single_used_symbol(n):
    x = np.full(n, 3)
    _, lengths, data = round_trip(x, alphabet=8)
    np.testing.assert_array_equal(lengths, [0, 0, 0, 1, 0, 0, 0, 0])
    assert len(data) == (n + 7) // 8


def test_lengths_match_heapq_huffman_on_random_alphabets():
    rng = np.random.default_rng(1)
    for trial in range(300):
        size = int(rng.integers(1, 40))
        counts = rng.integers(0, [2, 10, 1000][trial % 3] + 1, size)
        if trial % 4 == 0:
            counts = (rng.pareto(1.0, size) * 10).astype(np.int64)
        lengths = code_lengths(counts)
        assert lengths.dtype == np.uint8 and lengths.shape == counts.shape
        assert np.array_equal(lengths == 0, counts == 0)
        assert int(np.sum(counts * lengths.astype(np.int64))) == huffman_cost(counts)
        if np.count_nonzero(counts) >= 2:
            assert kraft(lengths) == 1.0


def test_canonical_codes_rfc1951_example():
    # RFC 1951, 3.2.2: lengths (3, 3, 3, 3, 3, 2, 4, 4) for A..H.
    codes = canonical_codes(np.array([3, 3, 3, 3, 3, 2, 4, 4]))
    assert codes.dtype == np.uint32
    expected = ["010", "011", "100", "101", "110", "00", "1110", "1111"]
    assert [int(e, 2) for e in expected] == codes.tolist()


def test_codes_are_prefix_free():
    rng = np.random.default_rng(2)
    for _ in range(50):
        lengths = code_lengths(rng.integers(0, 50, int(rng.integers(2, 30))))
        codes = canonical_codes(lengths)
        words = [format(int(codes[s]), f"0{lengths[s]}b") for s in np.flatnonzero(lengths)]
        for a, b in itertools.permutations(words, 2):
            assert not b.startswith(a)


def test_over_subscribed_lengths_are_rejected():
    with pytest.raises(ValueError, match="over-subscribed"):
        canonical_codes(np.array([1, 1, 1]))
    with pytest.raises(ValueError, match="over-subscribed"):
        encode(np.array([0]), np.array([1, 2, 2, 2]))
    with pytest.raises(ValueError, match="0..24"):
        canonical_codes(np.array([25, 1]))


def fibonacci(n):
    fib = [1, 1]
    while len(fib) < n:
        fib.append(fib[-1] + fib[-2])
    return np.array(fib[:n], dtype=np.int64)


def test_length_limit_binds_on_fibonacci_counts():
    counts = fibonacci(40)  # unlimited Huffman would need 39-bit codes
    lengths = code_lengths(counts)
    assert lengths.max() == MAX_CODE_LENGTH
    assert kraft(lengths) == 1.0
    rng = np.random.default_rng(3)
    x = rng.choice(40, size=5000, p=counts / counts.sum())
    x[:40] = np.arange(40)  # every symbol, the rarest ones included
    data = encode(x, lengths)
    np.testing.assert_array_equal(decode(data, lengths, x.size), x)


@pytest.mark.parametrize("max_length", [3, 4, 5])
def test_length_limited_lengths_are_optimal(max_length):
    counts = fibonacci(8)
    lengths = code_lengths(counts, max_length=max_length)
    assert lengths.max() <= max_length
    assert kraft(lengths) <= 1.0
    # Brute force: every assignment of lengths 1..max_length that satisfies Kraft.
    grid = np.array(list(itertools.product(range(1, max_length + 1), repeat=counts.size)))
    feasible = grid[np.sum(2.0**-grid, axis=1) <= 1.0]
    best = int((feasible @ counts).min())
    assert int(counts @ lengths.astype(np.int64)) == best


def test_too_many_symbols_for_the_limit():
    with pytest.raises(ValueError, match="do not fit"):
        code_lengths(np.ones(9), max_length=3)
    with pytest.raises(ValueError, match="max_length"):
        code_lengths(np.ones(3), max_length=MAX_CODE_LENGTH + 1)


def test_encode_rejects_bad_symbols():
    lengths = np.array([1, 1, 0])
    with pytest.raises(ValueError, match="outside the alphabet"):
        encode(np.array([0, 3]), lengths)
    with pytest.raises(ValueError, match="outside the alphabet"):
        encode(np.array([-1]), lengths)
    with pytest.raises(ValueError, match="symbol 2 has code length 0"):
        encode(np.array([0, 2]), lengths)


def test_truncated_data_raises():
    rng = np.random.default_rng(4)
    x = rng.integers(0, 20, 1000)
    _, lengths, data = round_trip(x)
    for cut in (data[:-1], data[: len(data) // 2], b""):
        with pytest.raises(ValueError, match="truncated"):
            decode(cut, lengths, x.size)


def test_n_larger_than_stream_raises():
    x = np.array([0, 1, 2, 1, 0, 2, 2, 1, 0, 0, 3])
    _, lengths, data = round_trip(x)
    # Up to 7 padding bits may parse as codes; 8 more symbols cannot come from padding.
    with pytest.raises(ValueError, match="corrupt Huffman stream"):
        decode(data, lengths, x.size + 8)


def test_bit_pattern_that_is_no_code_raises():
    # Under-subscribed code {0: "0", 1: "10"}: "11" starts no code.
    lengths = np.array([1, 2])
    with pytest.raises(ValueError, match="no code"):
        decode(b"\xff" * 8, lengths, 10)
    with pytest.raises(ValueError, match="corrupt"):
        decode(b"\xc0", lengths, 2)


def test_trailing_padding_yields_no_extra_symbols():
    x = np.array([0, 0, 0])  # 3 bits of "0" codes, then 5 zero bits of padding
    lengths = np.array([1, 1])
    data = encode(x, lengths)
    assert data == b"\x00"
    assert decode(data, lengths, 3).tolist() == [0, 0, 0]


def test_entropy_bits_by_hand():
    # p = (1/2, 1/4, 1/4): 8 * 1 + 4 * 2 + 4 * 2 = 24 bits.
    assert entropy_bits(np.array([8, 4, 0, 4])) == pytest.approx(24.0)
    # p = (3/4, 1/4): 3 * log2(4/3) + 1 * 2.
    assert entropy_bits(np.array([3, 1])) == pytest.approx(3 * np.log2(4 / 3) + 2)
    assert entropy_bits(np.array([5])) == 0.0
    assert entropy_bits(np.array([], dtype=np.int64)) == 0.0


def test_stream_bits_is_the_stream_without_padding():
    rng = np.random.default_rng(5)
    for size in (1, 7, 8, 9, 1001):
        x = rng.integers(0, 12, size)
        _, lengths, data = round_trip(x)
        bits = stream_bits(x, lengths)
        assert 0 <= 8 * len(data) - bits < 8
        assert bits == int(lengths[x].astype(np.int64).sum())


# --- relative (gap) indices -------------------------------------------------------------------


def gaps_by_loop(positions, gap_bits):
    """The definition, one entry at a time."""
    escape = 2**gap_bits - 1
    out, previous = [], -1
    for p in positions:
        skipped = int(p) - previous - 1
        while skipped >= escape:
            out.append(escape)
            skipped -= escape
        out.append(skipped)
        previous = int(p)
    return out


@pytest.mark.parametrize("gap_bits", range(2, 9))
@pytest.mark.parametrize("density", [0.001, 0.05, 0.3, 0.9, 1.0])
def test_gaps_round_trip_random_masks(gap_bits, density):
    rng = np.random.default_rng(gap_bits * 100 + int(density * 1000))
    mask = rng.random(3000) < density
    mask[-1] = True  # the last element of the tensor
    positions = np.flatnonzero(mask)
    gaps = encode_gaps(positions, gap_bits)
    assert gaps.max() <= 2**gap_bits - 1
    assert gaps.tolist() == gaps_by_loop(positions, gap_bits)
    decoded = decode_gaps(gaps, gap_bits)
    assert decoded.dtype == np.int64
    np.testing.assert_array_equal(decoded, positions)


@pytest.mark.parametrize("gap_bits", range(1, 9))
def test_gap_edge_runs(gap_bits):
    m = 2**gap_bits - 1
    cases = {
        "first at 0": [0, 1, 2],
        "first far away": [5 * m + 3, 5 * m + 4],
        "run of exactly M": [0, m + 1],
        "run of M - 1": [0, m],
        "run of M + 1": [0, m + 2],
        "run of 2M": [0, 2 * m + 1],
        "first run of exactly M": [m],
        "first run of 2M": [2 * m],
    }
    for name, positions in cases.items():
        gaps = encode_gaps(np.array(positions), gap_bits)
        assert gaps.tolist() == gaps_by_loop(positions, gap_bits), name
        assert decode_gaps(gaps, gap_bits).tolist() == positions, name
    # A run of exactly M zeros is one escape and then a zero gap.
    assert encode_gaps(np.array([0, m + 1]), gap_bits).tolist() == [0, m, 0]


def test_gaps_empty_and_invalid():
    assert encode_gaps(np.array([], dtype=np.int64), 4).size == 0
    assert decode_gaps(np.array([], dtype=np.uint16), 4).size == 0
    with pytest.raises(ValueError, match="strictly increasing"):
        encode_gaps(np.array([3, 3]), 4)
    with pytest.raises(ValueError, match="strictly increasing"):
        encode_gaps(np.array([5, 2]), 4)
    with pytest.raises(ValueError, match=">= 0"):
        encode_gaps(np.array([-1, 2]), 4)
    with pytest.raises(ValueError, match="ends with ESCAPE"):
        decode_gaps(np.array([2, 15]), 4)
    with pytest.raises(ValueError, match="0..15"):
        decode_gaps(np.array([16]), 4)
    with pytest.raises(ValueError, match="gap_bits"):
        encode_gaps(np.array([1]), 0)


def test_gaps_then_huffman_round_trip():
    """The full relative-index path: mask -> gaps -> Huffman bytes -> gaps -> mask."""
    rng = np.random.default_rng(6)
    mask = rng.random(50_000) < 0.08
    positions = np.flatnonzero(mask)
    gaps = encode_gaps(positions, 5)
    _, lengths, data = round_trip(gaps, alphabet=32)
    restored = np.zeros_like(mask)
    restored[decode_gaps(decode(data, lengths, gaps.size), 5)] = True
    np.testing.assert_array_equal(restored, mask)
    # Huffman beats the fixed 5 bits per gap on this geometric-like gap distribution.
    assert 8 * len(data) < 5 * gaps.size
