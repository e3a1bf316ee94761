"""The `.dcz` formats side by side on the same weights, and against generic compressors.

    python benchmarks/archive_formats.py A.dcz [B.dcz ...]

For each archive (any format): its records re-encoded as format 2 (Huffman, the paper's, each
layer's gap width searched as `shrink` does) and
format 3 (range coding under adaptive context models), both decoded back and checked bit for
bit against the file's own tensors; xz -9e, brotli -11 and zstd -19 of the plain serialisation
of the same information (`deep_compression.plain_serialisation`: float32 codebooks, dense
tensors as stored, uint8 indices and gaps); format 3's encode and decode seconds; the mask and
index modes its encoder chose. Sizes are deterministic; seconds are this machine's.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from deep_compression import generic_compressors

from compresskit.compressor import archive
from compresskit.compressor.shrink import _choose_gap_bits, bits_equal


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(bits_equal(a[k], b[k]) for k in a)


def _best_gaps(entries: list) -> list:
    """Format 2 at its best: each shared record's gap width chosen as `shrink` chooses it
    (format 3 stores no gap width, so records read from it carry a placeholder)."""
    out = []
    for e in entries:
        if isinstance(e, archive.Shared):
            numel = int(np.prod(e.shape))
            e = replace(e, gap_bits=_choose_gap_bits(e.positions, numel, 8, "auto"))
        out.append(e)
    return out


def measure(path: Path) -> dict:
    d = archive.read(path, keep_entries=True)
    v2, _ = archive.encode(_best_gaps(d.entries), d.spec, d.metadata, 2)
    t = time.perf_counter()
    v3, stats = archive.encode(d.entries, d.spec, d.metadata, 3)
    enc = time.perf_counter() - t
    t = time.perf_counter()
    back = archive.decode(v3, str(path))
    dec = time.perf_counter() - t
    if not (
        _same(back.state_dict, d.state_dict) and _same(archive.decode(v2).state_dict, d.state_dict)
    ):
        raise SystemExit(f"{path}: a re-encoding does not decode to the file's tensors")
    modes = Counter(
        (s.get("mask_mode"), s.get("index_mode")) for s in stats.layers.values() if "mask_mode" in s
    )
    return {
        "v2": len(v2),
        "v3": len(v3),
        "generic": generic_compressors(path),
        "encode_s": enc,
        "decode_s": dec,
        "modes": dict(modes),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("archives", nargs="+", type=Path)
    args = ap.parse_args()
    print(
        "| archive | format 2 (Huffman) | format 3 (range) | 3 vs 2 | xz -9e | brotli -11 |"
        " zstd -19 | 3 vs best generic | encode / decode s | (mask, index) modes |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path in args.archives:
        m = measure(path)
        g = m["generic"]
        best = min(g.values())
        cells = [
            str(path.parent.name or path.name),
            f"{m['v2']:,}",
            f"{m['v3']:,}",
            f"{m['v3'] / m['v2'] - 1:+.1%}",
            *(f"{g[k]:,}" if k in g else "–" for k in ("xz -9e", "brotli -11", "zstd -19")),
            f"{m['v3'] / best - 1:+.1%}",
            f"{m['encode_s']:.2f} / {m['decode_s']:.2f}",
            ", ".join(f"{k}: {v}" for k, v in sorted(m["modes"].items())),
        ]
        print("| " + " | ".join(cells) + " |", flush=True)
    print(
        "\nmodes: mask 0 none (all kept), 1 i.i.d., 2 zero-run contexts; index 0 order-0, 1 left"
        " neighbour's index"
    )
    missing = [k for k, m in (("brotli -11", "brotli"), ("zstd -19", "zstandard")) if not _has(m)]
    if missing:
        print(
            f"\n{' and '.join(missing)}: not measured (–), their packages are not installed; "
            'pip install -e ".[bench]" adds them, so "3 vs best generic" compares against xz alone'
        )


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    main()
