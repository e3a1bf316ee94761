"""The GPU paths of `compress train` and `compress bench`, run for real on a CUDA machine.

    python benchmarks/gpu_check.py --out DIR [--mnist DIR] [--shrunk DIR] [--resnet18] [--epochs 3]
    python benchmarks/gpu_check.py --out DIR --rehearse   # no GPU: every step on the CPU

CI has no GPU, so the code behind `--device cuda` (NCCL, one GPU per rank) and the CUDA rows of
`compress bench` (PyTorch on CUDA, ONNX Runtime's CUDA provider where `onnxruntime-gpu` is
installed) is exercised only where a GPU is lent. This script runs them as a user would, each
command in its own process through the real CLI, and prints one table:

- `train` on CPU and on CUDA, side by side on this machine (fp32, and bf16 autocast on CUDA);
- `--resume` of a CUDA run, compared with the uninterrupted run;
- the CUDA checkpoint read back where no GPU is visible (`CUDA_VISIBLE_DEVICES=""`): `bench`
  of the GPU-trained teacher on the CPU (a checkpoint must travel from a GPU box to a laptop);
- `torchrun --nproc-per-node N` with `--device cuda`: NCCL, N = the GPUs here;
- what a one-GPU machine must refuse (`--workers 2`, `--stages 2` with `--device cuda`);
- `bench --providers torch,cpu,cuda` of a shrink folder (PyTorch and ONNX Runtime, CPU and GPU),
  with the CUDA rows' accuracy against the CPU rows'.

Every step is bounded (`--step-timeout`); a failed step is reported and the rest still run.
Logs of every command land in `--out`. Exit 0 when every step passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CLI = [sys.executable, "-m", "compresskit.cli"]


def _gap(a: Path, b: Path) -> float:
    """The largest difference between two checkpoints' weights."""
    from compresskit.models import checkpoint

    x, y = checkpoint.load(a).state_dict, checkpoint.load(b).state_dict
    return max(float((x[k].double() - y[k].double()).abs().max()) for k in x)


class Steps:
    def __init__(self, out: Path, timeout: float) -> None:
        self.out, self.timeout = out, timeout
        self.rows: list[dict] = []

    def run(self, name: str, cmd: list[str], env: dict | None = None, expect: int = 0) -> dict:
        """Run one command; keep its output in OUT/NAME.log; parse stdout as JSON if it is."""
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=self.timeout,
                env={**os.environ, **(env or {})},
            )
            code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as e:
            code, stdout, stderr = 124, e.stdout or "", (e.stderr or "") + "\n[timed out]"
            stdout = stdout if isinstance(stdout, str) else stdout.decode(errors="replace")
            stderr = stderr if isinstance(stderr, str) else stderr.decode(errors="replace")
        wall = time.perf_counter() - t0
        (self.out / f"{name}.log").write_text(
            f"$ {' '.join(map(str, cmd))}\n# exit {code}, {wall:.1f} s\n"
            f"--- stdout\n{stdout}\n--- stderr\n{stderr}\n"
        )
        try:
            data = json.loads(stdout)
        except ValueError:
            data = None
        last = (stderr.strip().splitlines() or [""])[-1][:160]
        row = {"step": name, "ok": code == expect, "exit": code, "wall_s": round(wall, 1)}
        row.update({"json": data, "last_stderr": last})
        self.rows.append(row)
        flag = "ok " if row["ok"] else "FAIL"
        print(f"[{flag}] {name}: exit {code} in {wall:.1f} s  {'' if row['ok'] else last}")
        sys.stdout.flush()
        return row

    def note(self, name: str, ok: bool, detail: str) -> None:
        self.rows.append({"step": name, "ok": ok, "detail": detail})
        print(f"[{'ok ' if ok else 'FAIL'}] {name}: {detail}")
        sys.stdout.flush()


def environment() -> dict:
    """`compress bench`'s environment block (CPU model and flags, versions, providers, GPU and
    driver), plus NCCL's version where a GPU is visible."""
    import torch

    from compresskit.compressor.measure.envinfo import environment as bench_environment

    env = bench_environment()
    if env["gpu"]:
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


def train_args(model: str, data: str, epochs: int, out: Path, *extra: str) -> list[str]:
    return [
        *CLI, "train", "--model", model, "--data", data, "--epochs", str(epochs),
        "--out", str(out), "--json", "-q", *extra,
    ]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for logs and files")
    parser.add_argument("--mnist", help="MNIST IDX folder (t10k-*): a second, larger data set")
    parser.add_argument("--shrunk", type=Path, help="a `compress shrink` output folder to bench")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--resnet18",
        action="store_true",
        help="also train transformers' ResNet-18 on 2,000 3x32x32 images, CPU against CUDA",
    )
    parser.add_argument("--step-timeout", type=float, default=240.0)
    parser.add_argument("--skip", default="", help="comma-separated step prefixes to leave out")
    parser.add_argument(
        "--rehearse",
        action="store_true",
        help="no GPU: run every step on the CPU (checks this script)",
    )
    opts = parser.parse_args()
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    skip = tuple(s for s in opts.skip.split(",") if s)
    env = environment()
    print(json.dumps(env))
    (out / "environment.json").write_text(json.dumps(env, indent=1))
    steps = Steps(out, opts.step_timeout)
    gpus = (env["gpu"] or {}).get("count", 0)
    gpu = "cuda"
    if opts.rehearse:
        gpu, gpus = "cpu", 1
    elif not gpus:
        print("no CUDA device visible: nothing to check here (the GPU paths need a GPU)")
        return 0

    def want(name: str) -> bool:
        return not name.startswith(skip)  # an empty tuple matches nothing

    e = opts.epochs
    # 1. train, CPU against CUDA, same command otherwise
    jobs = [("vgg", "digits")]
    if opts.mnist:
        jobs.append(("lenet5", f"mnist:{opts.mnist}"))
    if opts.resnet18:
        sys.path.insert(0, str(Path(__file__).parent))
        from real_models import images_npz  # the real-models matrix's images

        images_npz(out / "images.npz")
        jobs.append(("compresskit.models.hf:resnet18", f"npz:{out / 'images.npz'}"))
    for model, data in jobs:
        for device, extra in (("cpu", []), ("cuda", []), ("cuda-bf16", ["--precision", "bf16"])):
            name = f"train-{model.rsplit(':', 1)[-1]}-{device}"
            if want(name):
                dev = gpu if device.startswith("cuda") else "cpu"
                pt = out / f"{model.rsplit(':', 1)[-1]}-{device}.pt"
                steps.run(name, train_args(model, data, e, pt, "--device", dev, *extra))
    # 2. resume a CUDA run: 1 epoch, then on to e, against the uninterrupted e-epoch run, with
    # dropout drawing from the GPU's generator and a constant schedule (a cosine schedule over
    # 1 epoch is another run than one over e: the first H100 run compared those, wrongly).
    # With --deterministic the weights must be the same bits; without it, the same command run
    # twice shows how far apart cuDNN's own choices land (the second H100 run: past 1e-4).
    if want("resume") and e >= 2:
        same = ["--device", gpu, "--model-kwargs", '{"dropout": 0.5}', "--schedule", "constant"]
        det = [*same, "--deterministic"]
        full, part = out / "vgg-resume-full.pt", out / "vgg-resume-part.pt"
        steps.run("resume-full", train_args("vgg", "digits", e, full, *det))
        steps.run("resume-first", train_args("vgg", "digits", 1, part, *det))
        steps.run("resume-rest", train_args("vgg", "digits", e, part, *det, "--resume"))
        if full.exists() and part.exists():
            gap = _gap(full, part)
            steps.note(
                "resume-vs-full",
                gap == 0.0,
                f"--deterministic: max |w_resumed - w_full| = {gap:.2e}",
            )
        twice = [out / f"vgg-nondeterministic-{k}.pt" for k in "ab"]
        for k, pt in zip("ab", twice, strict=True):
            steps.run(f"resume-nondeterministic-{k}", train_args("vgg", "digits", e, pt, *same))
        if all(pt.exists() for pt in twice):
            gap = _gap(*twice)
            steps.note(
                "resume-nondeterministic",
                True,
                f"without --deterministic: max |w_a - w_b| = {gap:.2e}",
            )
    # 3. the GPU-trained checkpoint on a machine without a GPU
    teacher = out / "vgg-cuda.pt"
    if want("cpu-reads") and teacher.exists():
        steps.run(
            "cpu-reads-cuda-checkpoint",
            [
                *CLI,
                "bench",
                str(teacher),
                "--data",
                "digits",
                "--providers",
                "torch",
                "--batch",
                "1",
                "--min-runs",
                "20",
                "--min-seconds",
                "0.2",
                "--json",
                "-q",
            ],
            env={"CUDA_VISIBLE_DEVICES": ""},
        )
        # a user's own script: a plain torch.load, no map_location, on a machine without CUDA
        load = f"import torch; torch.load({str(teacher)!r}, weights_only=True)"
        steps.run(
            "plain-torch-load-without-cuda",
            [sys.executable, "-c", load],
            env={"CUDA_VISIBLE_DEVICES": ""},
        )
    # 4. NCCL through torchrun, one rank per GPU
    if want("torchrun"):
        steps.run(
            f"torchrun-nccl-{gpus}",
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(gpus),
                "-m",
                "compresskit.cli",
                *train_args("vgg", "digits", e, out / "vgg-torchrun.pt", "--device", gpu)[3:],
            ],
        )
    # 5. refusals on a machine with fewer GPUs than asked
    if want("refuse") and gpus == 1 and gpu == "cuda":
        for name, extra in (
            ("refuse-workers-2", ["--workers", "2"]),
            ("refuse-stages-2", ["--strategy", "pipeline", "--stages", "2"]),
        ):
            steps.run(
                name,
                train_args("vgg", "digits", 1, out / "x.pt", "--device", gpu, *extra),
                expect=2,
            )
    # 6. bench a shrink folder on every runtime
    if want("bench") and opts.shrunk:
        data = f"mnist:{opts.mnist}" if opts.mnist else "digits"
        row = steps.run(
            "bench-shrunk",
            [
                *CLI,
                "bench",
                str(opts.shrunk),
                "--data",
                data,
                "--providers",
                "torch,cpu,cuda",
                "--batch",
                "1,64",
                "--json",
                "-q",
                "--report",
                str(out / "bench.md"),
            ],
        )
        if row["json"]:
            (out / "bench.json").write_text(json.dumps(row["json"], indent=1))
            results = row["json"]["results"]
            provs = sorted({r["provider"] for r in results})
            steps.note("bench-providers", "pytorch-cuda" in provs, ", ".join(provs))
            for model in sorted({r["model"] for r in results}):
                accs = {
                    (r["provider"], r["batch"]): r.get("test_accuracy")
                    for r in results
                    if r["model"] == model
                }
                cpu = [a for (p, _), a in accs.items() if "cpu" in p.lower() and a is not None]
                gpu = [a for (p, _), a in accs.items() if "cuda" in p.lower() and a is not None]
                if cpu and gpu:
                    gap = max(abs(g - cpu[0]) for g in gpu)
                    detail = ", ".join(
                        f"{p} b{b} {a:.4f}" for (p, b), a in accs.items() if a is not None
                    )
                    steps.note(f"bench-acc-{model}", gap <= 0.002, f"{detail} (max gap {gap:.4f})")
            for s in row["json"].get("skipped", []):
                print(f"  skipped: {s['model']} on {s['provider']}: {s['reason']}")
    # summary
    print()
    print(f"{'step':34} {'ok':4} {'wall s':>7}  figures")
    for r in steps.rows:
        j = r.get("json") or {}
        fig = ""
        if "test_accuracy" in j:
            fig = (
                f"acc {j['test_accuracy']:.4f}  {j['seconds']:.1f} s training  "
                f"{j['samples_per_s']:.0f} samples/s"
            )
        fig = fig or r.get("detail", "")
        print(f"{r['step']:34} {'yes' if r['ok'] else 'NO':4} {r.get('wall_s', ''):>7}  {fig}")

    def slim(row: dict) -> dict:  # a run's per-epoch history is in its log
        j = row.get("json")
        if isinstance(j, dict) and "history" in j:
            row = {**row, "json": {k: v for k, v in j.items() if k != "history"}}
        return row

    rows = [slim(r) for r in steps.rows]
    (out / "steps.json").write_text(json.dumps({"environment": env, "steps": rows}, indent=1))
    return 0 if all(r["ok"] for r in steps.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
