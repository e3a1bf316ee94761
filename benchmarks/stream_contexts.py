"""How far below the coded streams richer context models could go: a bound on what modelling
alone can still save in a `.dcz` (issue 16 item 5: every archive 5% under brotli -11, xz -9e and
zstd -19 on the same weights).

    python benchmarks/stream_contexts.py A.dcz [B.dcz ...]

For each shared record: the bits of its position mask and of its cluster indices under adaptive
models (Krichevsky-Trofimov counts updated after every symbol, `entropy.adaptive_bits`, and
ideal code lengths for the mixed models), the format's own models beside models it does not
use. Masks are coded column by column (one input feature across every output row):

  iid        one density for the whole mask (format 3's MASK_IID)
  runs       zero-run contexts in the row (MASK_RUNS)
  row        the row's kept rate over the columns before (each output unit's own density)
  col        the column's kept rate over the rows before, coded row by row (dead inputs)
  row+col    both, combined as independent evidence (naive Bayes on the odds)

Indices: order-0 (INDEX_ORDER0), the left neighbour's index (INDEX_LEFT), the last kept index
in the row or in the column, the upper neighbour, the mean sign of the column's or the row's
kept weights so far. Mixed models are priced at their ideal code length, without the cost of
the one mode byte, so the figures are bounds on what a new mode would save, not coded sizes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from compresskit.compressor import archive, dcz3, entropy

PRIOR = 4.0  # pseudo-samples of the layer's density in a row's or column's running rate


def _ideal(bits: np.ndarray, p: np.ndarray) -> float:
    p = np.clip(p, 1e-9, 1 - 1e-9)
    return float(-(np.log2(p[bits]).sum() + np.log2(1 - p[~bits]).sum()))


def mask_bits(mask: np.ndarray) -> dict[str, float]:
    rows, cols = mask.shape
    g = mask.mean()
    before_in_row = np.cumsum(mask, axis=1) - mask
    before_in_col = np.cumsum(mask, axis=0) - mask
    row = (before_in_row + PRIOR * g) / (np.arange(cols)[None, :] + PRIOR)
    col = (before_in_col + PRIOR * g) / (np.arange(rows)[:, None] + PRIOR)
    odds = (row / (1 - row)) * (col / (1 - col)) / (g / (1 - g))
    return {
        "iid": entropy.iid_bits(int(mask.sum()), mask.size),
        "runs": entropy.adaptive_bits(entropy._run_contexts_all(mask), mask, 2),
        "row": _ideal(mask, row),
        "col": _ideal(mask, col),
        "row+col": _ideal(mask, odds / (1 + odds)),
    }


def _last_kept(grid: np.ndarray, axis: int) -> np.ndarray:
    """Each position's last kept index before it along `axis` (-1: none)."""
    g = np.moveaxis(grid, axis, 0)
    out, cur = np.full(g.shape, -1), np.full(g.shape[1:], -1)
    for i in range(g.shape[0]):
        out[i] = cur
        cur = np.where(g[i] >= 0, g[i], cur)
    return np.moveaxis(out, 0, axis)


def _sign_trend(value: np.ndarray, kept: np.ndarray, axis: int) -> np.ndarray:
    s = np.cumsum(np.sign(value), axis=axis) - np.sign(value)
    n = np.cumsum(kept, axis=axis) - kept
    return np.digitize(np.where(n > 0, s / np.maximum(n, 1), 0), [-0.6, -0.2, 0.2, 0.6])


def index_bits(e: archive.Shared, mask: np.ndarray) -> dict[str, float]:
    k, idx = len(e.codebook), np.asarray(e.index, np.int64)
    grid = np.full(mask.shape, -1)
    grid[mask] = idx
    value = np.zeros(mask.shape)
    value[mask] = e.codebook[idx]
    left = np.concatenate([np.full((mask.shape[0], 1), -1), grid[:, :-1]], axis=1)
    up = np.concatenate([np.full((1, mask.shape[1]), -1), grid[:-1]], axis=0)

    def under(ctx: np.ndarray) -> float:
        return entropy.adaptive_bits(ctx, idx, k)

    bucket = entropy._left_bucket
    return {
        "order-0": under(np.zeros_like(idx)),
        "left": under(bucket(left[mask], k)),
        "last in row": under(bucket(_last_kept(grid, 1)[mask], k)),
        "up": under(bucket(up[mask], k)),
        "last in col": under(bucket(_last_kept(grid, 0)[mask], k)),
        "col sign": under(_sign_trend(value, mask, 0)[mask]),
        "row sign": under(_sign_trend(value, mask, 1)[mask]),
    }


def report(path: Path) -> None:
    d = archive.read(path, keep_entries=True)
    size = path.stat().st_size
    own = {"mask": ("iid", "runs"), "index": ("order-0", "left")}  # the format's modes
    saved = {"mask": [0.0, 0.0], "index": [0.0, 0.0]}  # per record: the format's best, any best
    print(f"\n## {path} ({size:,} B)\n")
    print("| record | shape | kept | k | mask bytes by model | index bytes by model |")
    print("|---|---|---|---|---|---|")
    for e in d.entries or []:
        if not isinstance(e, archive.Shared) or not len(e.index):
            continue
        mask = dcz3.mask_of(e.shape, e.positions)
        got = {
            "mask": mask_bits(mask) if not mask.all() else {},
            "index": index_bits(e, mask) if len(e.codebook) >= 2 else {},
        }
        for part, bits in got.items():
            if bits:
                saved[part][0] += min(bits[n] for n in own[part]) / 8
                saved[part][1] += min(bits.values()) / 8
        cells = [", ".join(f"{n} {b / 8:,.0f}" for n, b in got[p].items()) or "-" for p in got]
        print(
            f"| {e.name} | {mask.shape[0]}x{mask.shape[1]} | {int(mask.sum()):,} | "
            f"{len(e.codebook)} | {cells[0]} | {cells[1]} |"
        )
    for part, (theirs, best) in saved.items():
        print(
            f"\n{part} streams, each record at its best: {theirs:,.0f} B under the format's "
            f"models ({' or '.join(own[part])}), {best:,.0f} B under any model above: "
            f"{theirs - best:,.0f} B, {(theirs - best) / size:.2%} of the archive"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("archives", nargs="+", type=Path)
    for path in ap.parse_args().archives:
        report(path)


if __name__ == "__main__":
    main()
