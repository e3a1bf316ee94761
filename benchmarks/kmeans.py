"""Time the weight-sharing k-means (scikit-learn KMeans, linear init) on 1-D weight sets.

    python benchmarks/kmeans.py [--sizes 30000,300000,1000000] [--bits 5,8]

Prints seconds per run and Lloyd iterations, for Gaussian weights (the shape pruned layers'
survivors have, minus the middle). Target: 1M weights at 5 bits in seconds, not minutes.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from compresskit.compressor.kmeans import kmeans_1d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="30000,300000,1000000")
    ap.add_argument("--bits", default="5,8")
    opts = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"# {os.cpu_count()} cores; weights ~ N(0, 0.1) with |w| < 0.05 pruned away")
    print(f"{'weights':>10} {'bits':>5} {'seconds':>8} {'distinct values':>16}")
    for n in (int(s) for s in opts.sizes.split(",")):
        w = rng.normal(0, 0.1, 3 * n)
        w = w[np.abs(w) > 0.05][:n].astype(np.float32)
        for bits in (int(b) for b in opts.bits.split(",")):
            t = time.perf_counter()
            centroids, labels = kmeans_1d(w, 2**bits - 1)
            dt = time.perf_counter() - t
            print(f"{len(w):>10,} {bits:>5} {dt:>8.2f} {len(np.unique(centroids[labels])):>16}")


if __name__ == "__main__":
    main()
