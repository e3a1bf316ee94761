"""What retraining a pruned or weight-shared model costs over a dense epoch, side by side.

    python benchmarks/retrain_overhead.py                      # LeNet-300-100 and resnet_se
    python benchmarks/retrain_overhead.py --models compresskit.models.hf:resnet18 --reps 3

`shrink` retrains through parametrizations (Han et al. 2015/2016: pruned weights held at zero
while the rest retrain; centroids fine-tuned with the summed gradients of their members), so
every forward recomputes each layer's weight from its mask or codebook, and every backward
routes the gradient back through it. The issue's target is that this costs no more than the
dense model's epoch. For each model, one epoch (`trainer.fit`, Adam, batch 32, 2,000 random
3x32x32 images) of:

  dense      the model as built;
  masked     70% of every prunable weight pruned, trained as `shrink` retrains it: inside
             `prune.zeroed_training` (pruned weights held at +0.0, their gradients masked);
  multiply   the same, with the mask's forward on every step (`prune.Mask`: w x mask + 0.0),
             the previous form;
  where      the same, with the mask applied as torch.where(mask, w, +0.0), the one before;
  shared     pruned, then k-means shared (`kmeans.SharedWeights`, centroid fine-tuning);

after one untimed dense epoch, in alternating runs, medians of `--reps`, and each one's time
over dense.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time

import torch

from compresskit.compressor import kmeans, prune
from compresskit.compressor.measure import envinfo
from compresskit.distrib import trainer
from compresskit.models import zoo
from compresskit.models.data import Dataset

KINDS = ("dense", "masked", "multiply", "where", "shared")


def _where(self: prune.Mask, w: torch.Tensor) -> torch.Tensor:
    return torch.where(self.mask, w, torch.zeros((), dtype=w.dtype, device=w.device))


def build(spec: zoo.ModelSpec, kind: str) -> torch.nn.Module:
    model = zoo.build(spec, seed=0)
    if kind != "dense":
        prune.prune_(model, prune.PruneConfig(sparsity=0.7, rounds=1))
    if kind == "shared":
        kmeans.share_weights_(model, kmeans.QuantizeConfig())
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="lenet300,resnet_se")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--samples", type=int, default=2000)
    args = ap.parse_args()
    flags = sorted(envinfo.cpu_flags() & set(envinfo.CPU_FLAGS))
    print(
        f"retraining overhead: {platform.processor() or platform.machine()} "
        f"({', '.join(flags) or 'no listed flags'}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, one epoch of {args.samples} images, "
        f"medians of {args.reps} alternating runs"
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (args.samples,), generator=g)
    data = Dataset("random", x, y, x[:64], y[:64], 10, x[:64], y[:64])
    cfg = trainer.TrainConfig(epochs=1, optimizer="adam", seed=0)
    print(f"\n{'model':<34} " + " ".join(f"{k:>14}" for k in KINDS))
    fast = prune.Mask.forward
    for name in args.models.split(","):
        spec = zoo.resolve_spec(name, {}, (3, 32, 32), 10)
        times: dict[str, list[float]] = {k: [] for k in KINDS}
        trainer.fit(build(spec, "dense"), data, cfg)  # untimed: first-call set-up, warm caches
        for _ in range(args.reps):
            for kind in KINDS:
                prune.Mask.forward = _where if kind == "where" else fast
                try:
                    model = build(spec, kind)
                    zeroed = prune.zeroed_training if kind == "masked" else contextlib.nullcontext
                    t = time.perf_counter()
                    with zeroed(model):
                        trainer.fit(model, data, cfg)
                    times[kind].append(time.perf_counter() - t)
                finally:
                    prune.Mask.forward = fast
        med = {k: statistics.median(v) for k, v in times.items()}
        cells = [f"{med['dense']:>12.2f} s"] + [
            f"{med[k]:>6.2f} s {med[k] / med['dense']:>4.2f}x" for k in KINDS[1:]
        ]
        print(f"{name:<34} " + " ".join(f"{c:>14}" for c in cells))


if __name__ == "__main__":
    main()
