"""One optimizer step, torch's default loop against its fused kernel, side by side.

    python benchmarks/optimizer_step.py               # about 20 s on 2 cores
    python benchmarks/optimizer_step.py --sizes 266610 --threads 1
    python benchmarks/optimizer_step.py --epochs-of lenet300,compresskit.models.hf:resnet18

A parameter server runs one step per update on its shard, a flat tensor (distrib/paramserver.py),
and every training stage runs one per batch; `trainer.optimizer_for` asks for torch's fused
Adam where torch has it (SGD keeps the loop: its fused kernel fails on a half-made momentum
state, so its rows are for reference). For each size (MobileNet on digits, LeNet-300-100,
ResNet-18 as one tensor) and each optimizer as `compress train` configures it, this prints the
median step time of the two,
taken in alternating blocks, their ratio, and the largest difference between the weights after
the same 50 steps from the same start (the two round differently; the update is the same).

`--epochs-of MODELS` then times whole training epochs (`trainer.fit`, Adam, batch 32, 2,000
random 3x32x32 images, `--reps` alternating runs each) with the fused kernel and with torch's
default loop: what `compress train` and every retraining stage of `shrink` gain.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from compresskit.distrib import trainer
from compresskit.models import zoo
from compresskit.models.data import Dataset

SIZES = (37_000, 266_610, 11_200_000)


def make(kind: str, param: torch.Tensor, fused: bool | None) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD([param], lr=0.05, momentum=0.9, weight_decay=5e-4, fused=fused)
    return torch.optim.Adam([param], lr=3e-3, weight_decay=5e-4, fused=fused)


def step_time(opt: torch.optim.Optimizer, steps: int) -> float:
    t = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - t) / steps


def drift(kind: str, n: int, steps: int = 50) -> float:
    """Largest |w_default - w_fused| after `steps` identical steps from the same start."""
    g = torch.Generator().manual_seed(0)
    start = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g) for _ in range(4)]
    out = []
    for fused in (None, True):
        p = torch.nn.Parameter(start.clone())
        opt = make(kind, p, fused)
        for s in range(steps):
            p.grad = grads[s % len(grads)]
            opt.step()
        out.append(p.detach())
    return float((out[0] - out[1]).abs().max())


def epochs(names: str, reps: int, n: int = 2000) -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
    data = Dataset("random", x, y, x[:64], y[:64], 10, x[:64], y[:64])
    fused = trainer._fusable
    print(f"\none epoch, {n} images 3x32x32, Adam, medians of {reps} alternating runs")
    print(f"{'model':<34} {'params':>7} {'default':>9} {'fused':>9} {'ratio':>7}")
    for name in names.split(","):
        spec = zoo.resolve_spec(name, {}, (3, 32, 32), 10)
        times: dict[str, list[float]] = {"default": [], "fused": []}
        trainer.fit(zoo.build(spec, seed=0), data, trainer.TrainConfig(epochs=1, seed=0))  # warm
        try:
            for _ in range(reps):
                for mode in times:
                    trainer._fusable = fused if mode == "fused" else (lambda params: None)
                    model = zoo.build(spec, seed=0)
                    t = time.perf_counter()
                    trainer.fit(model, data, trainer.TrainConfig(epochs=1, seed=0))
                    times[mode].append(time.perf_counter() - t)
        finally:
            trainer._fusable = fused
        a, b = statistics.median(times["default"]), statistics.median(times["fused"])
        params = sum(p.numel() for p in model.parameters()) / 1e6
        print(f"{name:<34} {params:>6.2f}M {a:>7.2f} s {b:>7.2f} s {a / b:>6.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--blocks", type=int, default=7, help="alternating blocks per figure")
    ap.add_argument("--epochs-of", help="models to time whole epochs of, comma-separated")
    ap.add_argument("--reps", type=int, default=3, help="alternating epoch runs per mode")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"optimizer step: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{args.threads} threads, medians of {args.blocks} alternating blocks"
    )
    print(
        f"{'optimizer':<9} {'values':>11} {'default':>11} {'fused':>11} {'ratio':>7} {'max |dw|':>9}"
    )
    for n in (int(s) for s in args.sizes.split(",")):
        steps = max(3, min(500, int(2e7 / n)))  # about 0.1-0.5 s a block
        for kind in ("adam", "sgd"):
            opts = {}
            for fused in (None, True):
                p = torch.nn.Parameter(torch.randn(n))
                p.grad = torch.randn(n)
                opts[fused] = make(kind, p, fused)
                step_time(opts[fused], 3)  # make the state, warm the caches
            times = {None: [], True: []}
            for _ in range(args.blocks):
                for fused, opt in opts.items():
                    times[fused].append(step_time(opt, steps))
            a, b = statistics.median(times[None]), statistics.median(times[True])
            print(
                f"{kind:<9} {n:>11,} {a * 1e6:>8.0f} us {b * 1e6:>8.0f} us {a / b:>6.2f}x "
                f"{drift(kind, min(n, 300_000)):>9.1e}"
            )

    if args.epochs_of:
        epochs(args.epochs_of, args.reps)


if __name__ == "__main__":
    main()
