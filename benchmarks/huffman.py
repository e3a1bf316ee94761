"""Throughput and coding efficiency of compressor/huffman.py on 1M-symbol streams.

    python benchmarks/huffman.py [--n 1000000] [--repeat 7]

Two streams shaped like Deep Compression's: a 32-symbol skewed one (5-bit cluster indices of a
pruned layer, geometric-like) and a 256-symbol one (8-bit indices of a bell-shaped weight
distribution). For each: encode and decode throughput in M symbols/s (best of --repeat), the
same encode through bitarray's own encoder for comparison, and coded bits per symbol against
the order-0 entropy bound.
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
from bitarray import bitarray

from compresskit.compressor.huffman import (
    canonical_codes,
    code_lengths,
    decode,
    encode,
    entropy_bits,
    stream_bits,
)


def best_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bitarray_encode(x: np.ndarray, lengths: np.ndarray) -> bytes:
    """The alternative engine: bitarray.encode with a code dict built from our codes."""
    codes = canonical_codes(lengths)
    codedict = {
        int(s): bitarray(format(int(codes[s]), f"0{lengths[s]}b")) for s in np.flatnonzero(lengths)
    }
    out = bitarray(endian="big")
    out.encode(codedict, x.tolist())
    return out.tobytes()


def streams(n: int):
    rng = np.random.default_rng(0)
    p = 0.8 ** np.arange(32)
    yield "32-symbol skewed", rng.choice(32, size=n, p=p / p.sum())
    weights = rng.normal(0, 1, n)
    yield "256-symbol bell", np.clip(np.round(weights * 40 + 128), 0, 255).astype(np.int64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="symbols per stream")
    parser.add_argument("--repeat", type=int, default=7, help="timing runs; the best counts")
    opts = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, numpy {np.__version__}, n={opts.n:,}")
    header = (
        f"{'stream':<18} {'encode':>8} {'bitarray':>9} {'decode':>8} "
        f"{'bits/sym':>9} {'entropy':>8} {'ratio':>7}"
    )
    print(header + "\n" + "-" * len(header))
    for name, x in streams(opts.n):
        counts = np.bincount(x)
        lengths = code_lengths(counts)
        data = encode(x, lengths)
        assert np.array_equal(decode(data, lengths, x.size), x), "round trip failed"
        assert bitarray_encode(x, lengths) == data, "engines disagree"
        mps = opts.n / 1e6
        t_enc = best_seconds(lambda: encode(x, lengths), opts.repeat)  # noqa: B023
        t_bit = best_seconds(lambda: bitarray_encode(x, lengths), opts.repeat)  # noqa: B023
        t_dec = best_seconds(lambda: decode(data, lengths, x.size), opts.repeat)  # noqa: B023
        coded = stream_bits(x, lengths) / x.size
        bound = entropy_bits(counts) / x.size
        print(
            f"{name:<18} {mps / t_enc:>8.1f} {mps / t_bit:>9.1f} {mps / t_dec:>8.1f} "
            f"{coded:>9.3f} {bound:>8.3f} {coded / bound:>7.4f}"
        )
    print("throughput in M symbols/s; bitarray = bitarray.encode engine; ratio = bits/entropy")
    t0 = time.perf_counter()
    code_lengths(np.random.default_rng(1).integers(1, 10**6, 65536))
    print(f"code_lengths of a 65,536-symbol alphabet: {1e3 * (time.perf_counter() - t0):.0f} ms")


if __name__ == "__main__":
    main()
