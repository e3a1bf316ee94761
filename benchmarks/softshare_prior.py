"""Soft weight-sharing's prior step: the blocked pass against autograd of its closed form.

    python benchmarks/softshare_prior.py [--repeats 5] [--threads 2]

One retraining step under the mixture prior (`compressor.softshare`, Ullrich et al. 2017)
evaluates -log p(w) and its gradients for every kept weight of every layer. For each
(kept weights, components) pair below, this times forward + backward of
`softshare.neg_log_prior` (blocks of PRIOR_CHUNK weights, gradients summed as it goes) and of
autograd through `log_joint` + logsumexp (the n x K tensors held for the backward pass),
interleaved (A B A B ...), and prints the medians, their ratio and the largest relative
difference of the gradients. The sizes are LeNet-300-100's fc1 (235,200 weights) fully kept at
8 bits (255 components), as the budget search's unpruned settings leave it, at 5 bits, and a
pruned fc1 (8%) at 5 bits.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from compresskit.compressor import softshare

CASES = ((235_200, 255), (235_200, 31), (18_816, 31), (18_816, 255))


def _autograd(w, means, log_vars, log_mixing):
    return -torch.logsumexp(softshare.log_joint(w, means, log_vars, log_mixing), dim=1).sum()


def _inputs(n: int, k: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = 0.05 * torch.randn(n, generator=g)
    means = torch.cat([torch.zeros(1), 0.05 * torch.randn(k - 1, generator=g)])
    log_vars = torch.full((k,), 2 * math.log(0.005))
    log_vars[0] = 2 * math.log(0.02)
    logits = torch.zeros(k)
    return [w, means, log_vars, logits]


def _step(fn, inputs) -> tuple[float, list[torch.Tensor]]:
    w, means, log_vars, logits = (t.clone().requires_grad_(True) for t in inputs)
    start = time.perf_counter()
    fn(w, means, log_vars, torch.log_softmax(logits, 0)).backward()
    return time.perf_counter() - start, [w.grad, means.grad, logits.grad]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, medians of {args.repeats}")
    print("| kept weights | components | blocked ms | autograd ms | speed-up | max grad rel diff |")
    print("|---|---|---|---|---|---|")
    for n, k in CASES:
        inputs = _inputs(n, k)
        times: dict[str, list[float]] = {"blocked": [], "autograd": []}
        grads = {}
        for _ in range(args.repeats):
            for name, fn in (("blocked", softshare.neg_log_prior), ("autograd", _autograd)):
                dt, grads[name] = _step(fn, inputs)
                times[name].append(dt)
        diff = max(
            float((a - b).abs().max() / b.abs().max())
            for a, b in zip(grads["blocked"], grads["autograd"], strict=True)
        )
        blocked, auto = (1e3 * statistics.median(times[x]) for x in ("blocked", "autograd"))
        print(f"| {n:,} | {k} | {blocked:.1f} | {auto:.1f} | {auto / blocked:.1f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
