"""The model matrix: real architectures through every stage of `compress`, and what each costs.

    pip install -e ".[zoo]"            # Hugging Face transformers (pure PyTorch models)
    python benchmarks/real_models.py                      # the whole matrix (~1 h on 2 cores)
    python benchmarks/real_models.py --models resnet_se,vit,textcls   # no extra needed

For each model: `compress train` for `--train-epochs` epochs (10), then `compress shrink` with
the default recipe shortened only in epochs (its three prune rounds with one retraining epoch
each, one fine-tuning epoch; `--recipe default` runs it unshortened), then `compress train` again for
`--after` epochs (3), all through the real CLI in subprocesses. The dense epoch every other
figure is compared with is the mean of the two training processes' median epochs.
Printed per model: parameters, each stage's seconds, the seconds spent training, peak RSS,
archive ratio, INT8 nodes against quantizable ones, FP32 ONNX parity with PyTorch (max |dlogit|
relative to the logits' scale), INT8 top-1 agreement with FP32, the `.ort` file and the
NNAPI/CoreML verdicts. Then the two cost ratios the issue asks for:

* growth: non-training seconds per million weights, largest over smallest across the matrix
  (1.0 = perfectly linear in weights);
* shrink vs training: the whole shrink over the training epochs its recipe asks for, each
  costed at the measured dense epoch.

Both are also printed less the fixed cost every shrink pays whatever the model (imports,
exporter set-up, ORT sessions, plots: 4-9 s on 2 cores), measured by a first "floor" run on
a 25k-weight MLP. Peak RSS is printed over the interpreter's (compress imported) and as a
multiple of the FP32 model's bytes; then, for the issue's "4x the FP32 model plus the data",
over the model's own code (transformers' modules imported, nothing allocated) and memory's
fixed cost (the floor run's peak over its code), per FP32 model + data bytes.

Images: scikit-learn's 8x8 digits resized to 3x32x32 (a per-sample colour tint, so the three
channels differ) and cycled with noise to 2,000 samples: a CIFAR-shaped set made on the spot,
nothing downloaded. Text: `--data tokens` (synthetic token sequences, built in).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# Shortened only in epochs: the default's three prune rounds stay. A single round cuts each
# layer to its final sparsity in one step, which a compact network does not survive with one
# retraining epoch (MobileNetV2, 98.8% dense: 57.0% after a one-shot prune, 84.3% after three
# rounds of one epoch, 96.3% after the default three rounds of four epochs), and a damaged
# model's near-tied logits then fail any INT8 agreement floor.
RECIPE = """\
# The default recipe, shortened only in epochs.
[prune]
retrain_epochs = 1
[quantize]
finetune_epochs = 1
"""
# `--recipe default`: the recipe a user gets with no --recipe (three prune rounds of four
# retraining epochs, three fine-tuning epochs), for "the whole shrink within 1.5x of the
# training epochs its recipe asks for" where the epochs are the ones users run.
RECIPES = {"fast": RECIPE, "default": "# The default recipe, unchanged.\n"}


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    kwargs: str
    data: str  # "images" or "tokens"
    extra: bool  # needs the [zoo] extra
    # Dense training's Adam learning rate (None: `compress train`'s default, 3e-3). The two
    # transformers train at 5e-4: at 3e-3 BERT stayed at chance (26.3% after ten epochs, 96.8%
    # at 5e-4) and ViT-tiny reached 45.3% (84.8% at 5e-4). The shrink recipe is untouched.
    lr: float | None = None
    # More `compress train` flags for the dense model. MobileNetV3's BatchNorm momentum of 0.01
    # leaves its running averages trailing the weights after 10 epochs (83.0% tested with them,
    # 96.75% after 12, 98.25% refreshed): it trains with --bn-refresh, as its user would.
    train_flags: tuple[str, ...] = ()


# Not a real model: a 25k-weight MLP whose non-training seconds are the per-run fixed cost
# (imports of torch._dynamo, onnxscript's op registry and scikit-learn, one ONNX export, ORT
# sessions, plots) that every shrink pays whatever the model. Run first; the marginal figures
# below subtract it.
FLOOR = "floor"

MATRIX = [
    Case(FLOOR, "mlp", '{"hidden": [8]}', "images", False),
    Case("lenet300", "lenet300", "{}", "images", False),
    Case("resnet_se", "resnet_se", "{}", "images", False),
    Case("vit", "vit", "{}", "images", False),
    Case("textcls", "textcls", "{}", "tokens", False),
    Case("resnet18", "compresskit.models.hf:resnet18", "{}", "images", True),
    Case("mobilenet_v2", "compresskit.models.hf:mobilenet_v2", "{}", "images", True),
    Case("efficientnet_b0", "compresskit.models.hf:efficientnet_b0", "{}", "images", True),
    # A user's own code, no extra: torchvision's MobileNetV3-small written out with torch's
    # layers (benchmarks/user_mobilenet_v3.py), BatchNorm momentum 0.01 as torchvision's.
    Case(
        "mobilenet_v3_small",
        "benchmarks.user_mobilenet_v3:MobileNetV3Small",
        "{}",
        "images",
        False,
        train_flags=("--bn-refresh", "2048"),
    ),
    Case("vit_tiny", "compresskit.models.hf:vit_tiny", "{}", "images", True, lr=5e-4),
    Case("bert", "compresskit.models.hf:bert", '{"vocab_size": 1000}', "tokens", True, lr=5e-4),
]


def images_npz(path: Path, n: int = 2000, side: int = 32) -> None:
    """Digits as 3 x side x side colour images, n samples (cycled with noise past 1,797)."""
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.from_numpy(d.images.astype(np.float32) / 16.0)[:, None]
    x = F.interpolate(x, size=(side, side), mode="bilinear", align_corners=False).numpy()
    rng = np.random.default_rng(0)
    idx = np.arange(n) % len(x)
    tint = rng.uniform(0.4, 1.0, size=(n, 3, 1, 1)).astype(np.float32)
    img = x[idx] * tint
    img[len(x) :] += rng.normal(0, 0.05, size=img[len(x) :].shape).astype(np.float32)
    np.savez(path, x=np.clip(img, 0, 1).astype(np.float32), y=d.target[idx].astype(np.int64))


# Peak RSS as the measured process sees it: VmHWM, read by the process itself at exit. Not
# wait4's ru_maxrss: Linux carries the parent's RSS at fork across exec into the child's
# ru_maxrss, and this script grows (torch, the models it checks parity on) as the matrix
# runs, so a child whose own peak was lower read the parent's size (a 0.1M-weight model
# "peaked" at 567 MiB, 160 MiB over its real figure).
_HWM = """
import atexit, json, runpy, sys
out, what = sys.argv[1], sys.argv[2]
def hwm():
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    with open(out, "w") as f:
        f.write(str(kb * 1024))
atexit.register(hwm)
if "shrink" in sys.argv[3:6]:
    sys.path.insert(0, __BENCH__)
    import _stage_memory
    atexit.register(_stage_memory.start(out + ".stages"))
if what == "-m":
    sys.argv = [sys.argv[3], *sys.argv[4:]]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:  # -c CODE
    code, sys.argv = sys.argv[3], ["-c"]
    exec(code)
""".replace("__BENCH__", repr(str(Path(__file__).resolve().parent)))


def _run_measured(argv: list[str], **popen) -> tuple[int, int, dict]:
    """Run `python ARGV` (`-m MODULE ...` or `-c CODE`); its exit status, peak RSS, and for a
    `compress shrink` its peak RSS per pipeline step (`_stage_memory`; else {})."""
    by_step = {}
    with tempfile.NamedTemporaryFile("r", suffix=".hwm") as hwm:
        proc = subprocess.Popen([sys.executable, "-c", _HWM, hwm.name, *argv], cwd=ROOT, **popen)
        _, status, usage = os.wait4(proc.pid, 0)
        text = hwm.read().strip()
        stages = Path(hwm.name + ".stages")
        if stages.exists():
            by_step = json.loads(stages.read_text())
            stages.unlink()
    # no /proc (not Linux): wait4's figure, with the caveat above
    return status, int(text) if text else usage.ru_maxrss * 1024, by_step


def peak_rss_of(code: str) -> int:
    """Peak RSS of `python -c CODE` (RuntimeError when CODE fails: a baseline that stopped
    early would read low)."""
    with tempfile.TemporaryFile("w+") as err:
        status, peak, _ = _run_measured(["-c", code], stdout=subprocess.DEVNULL, stderr=err)
        err.seek(0)
        if status:
            raise RuntimeError(f"baseline failed: {err.read().strip().splitlines()[-1:]}")
    return peak


def compress_measured(args: list[str]) -> tuple[dict, float, int, dict]:
    """`compress ARGS --json -q` with wall seconds, the run's own peak RSS and, for a shrink,
    its peak RSS per pipeline step."""
    t = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        status, peak, by_step = _run_measured(
            ["-m", "compresskit.cli", *args, "--json", "-q"], stdout=out, stderr=err
        )
        seconds = time.perf_counter() - t
        out.seek(0)
        err.seek(0)
        text, errors = out.read(), err.read()
    if status:
        lines = errors.strip().splitlines() or [f"exit status {status}"]
        raise RuntimeError(lines[-1])
    return json.loads(text), seconds, peak, by_step


def fp32_parity(folder: Path, data_x: np.ndarray) -> tuple[float, float]:
    """max |dlogit| between model.pt (PyTorch) and model.fp32.onnx, and that over the
    largest |logit| (the relative figure the target is stated in)."""
    import onnxruntime as ort
    import torch

    from compresskit.models import checkpoint

    ck = checkpoint.load(folder / "model.pt")
    model = ck.build_model(allow_import=True).eval()
    x = data_x[:64]
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy()
    sess = ort.InferenceSession(str(folder / "model.fp32.onnx"), providers=["CPUExecutionProvider"])
    got = sess.run(None, {sess.get_inputs()[0].name: x})[0]
    diff = float(np.abs(got - ref).max())
    return diff, diff / max(float(np.abs(ref).max()), 1e-12)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(c.name for c in MATRIX))
    ap.add_argument("--workdir", default=None, help="keep checkpoints and outputs here")
    ap.add_argument("--samples", type=int, default=2000, help="images in the image set")
    ap.add_argument(
        "--train-epochs",
        type=int,
        default=10,
        help="dense training epochs before shrink (three left ViT-tiny and BERT near chance, "
        "with nearly tied logits that make INT8 agreement a coin toss)",
    )
    ap.add_argument(
        "--after",
        type=int,
        default=3,
        help="dense epochs timed again after each shrink, in a new process (0: none; else 3 "
        "or more, as the first epoch carries the warm-up); the dense epoch is the mean of the "
        "two processes' medians",
    )
    ap.add_argument(
        "--recipe",
        choices=sorted(RECIPES),
        default="fast",
        help="fast: the default recipe shortened to one epoch per retraining run (the "
        "matrix's ~1 h); default: the recipe as users get it (about 4x the training)",
    )
    ap.add_argument(
        "--microbatches",
        default="default",
        metavar="M[,M...]",
        help="shrink each model once per entry, from the same dense checkpoint: 'default' is "
        "the recipe as it is (train.microbatches = auto: as many slices as keep one within 4x "
        "the model's bytes), a count M or auto sets train.microbatches (gradient "
        "accumulation: retraining's activations over M); rows 'NAME' and 'NAME M=4', each M "
        "row printed against the default one. Models with BatchNorm refuse M > 1",
    )
    opts = ap.parse_args()
    if opts.after in (1, 2) or opts.after < 0:
        ap.error("--after takes 0 or 3 or more: the median of fewer epochs holds the warm-up")
    wanted = opts.models.split(",")
    unknown = sorted(set(wanted) - {c.name for c in MATRIX})
    if unknown:
        raise SystemExit(
            f"unknown model(s) {', '.join(unknown)}; the matrix has "
            + ", ".join(c.name for c in MATRIX)
        )
    try:
        import transformers  # noqa: F401

        have_extra = True
    except ImportError:
        have_extra = False
    work = Path(opts.workdir or tempfile.mkdtemp(prefix="real-models-"))
    work.mkdir(parents=True, exist_ok=True)
    images = work / "images.npz"
    if not images.exists():
        images_npz(images, opts.samples)
    try:
        counts = tuple(
            dict.fromkeys(
                m if m in ("auto", "default") else int(m) for m in opts.microbatches.split(",")
            )
        )
    except ValueError:
        ap.error(f"--microbatches {opts.microbatches!r}: give entries like default,1,4,auto")
    if not counts or any(isinstance(m, int) and m < 1 for m in counts):
        ap.error("--microbatches: give counts of 1 or more, auto or default")
    recipes = {}
    for m in {"default", *counts}:  # the recipe (the floor's too), and with microbatches = M
        default = m == "default"
        recipes[m] = work / (f"{opts.recipe}.toml" if default else f"{opts.recipe}-m{m}.toml")
        extra = "" if default else f"[train]\nmicrobatches = {json.dumps(m)}\n"
        recipes[m].write_text(RECIPES[opts.recipe] + extra)
    flags = _cpu_flags()
    print(
        f"# Model matrix, {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}"
        f" {os.cpu_count()} cores ({', '.join(flags)}), python {platform.python_version()}"
    )
    base_rss = peak_rss_of(
        "import compresskit.cli.main, compresskit.compressor.pipeline, onnxruntime, sklearn"
    )
    print(f"interpreter with compress imported: {base_rss / 2**20:.0f} MiB peak RSS\n")
    rows = []
    for case in MATRIX:
        if case.name not in wanted:
            continue
        if case.extra and not have_extra:
            print(f"{case.name}: skipped (needs the [zoo] extra: pip install -e '.[zoo]')")
            continue
        data = f"npz:{images}" if case.data == "images" else "tokens"
        try:
            code_rss = peak_rss_of(_IMPORT_MODEL.format(case=case))
            rows += one(
                case, data, work, recipes, base_rss, code_rss, opts.train_epochs, opts.after, counts
            )
        except RuntimeError as e:
            rows.append({"name": case.name, "failed": str(e)})
            print(f"{case.name}: FAILED: {e}")
    table(rows)


# The model's own code imported too (Hugging Face transformers' modelling modules: ~140 MiB
# for ResNet-18), its state_dict shapes built on the meta device (no weights allocated): the
# RSS a shrink of that architecture pays before it holds a single weight.
_IMPORT_MODEL = (
    "import compresskit.cli.main, compresskit.compressor.pipeline, onnxruntime, sklearn, json; "
    "from compresskit.models import zoo; "
    "zoo.state_shapes(zoo.ModelSpec({case.model!r}, json.loads({case.kwargs!r})))"
)


def recipe_epochs(recipe: dict) -> int:
    """The training epochs a shrink's resolved recipe (its report's `recipe`) asks for: one
    retraining run a prune round, then centroid fine-tuning."""
    p, q = recipe["prune"], recipe["quantize"]
    return p["enabled"] * p["rounds"] * p["retrain_epochs"] + q["enabled"] * q["finetune_epochs"]


def one(
    case: Case,
    data: str,
    work: Path,
    recipes: dict[int, Path],
    base_rss: int,
    code_rss: int,
    epochs: int,
    after: int = 0,
    microbatches: tuple[int | str, ...] = ("default",),
) -> list[dict]:
    ck = work / f"{case.name}.pt"
    model_args = ["--model", case.model, "--model-kwargs", case.kwargs]

    def dense_epoch(n: int, out: Path) -> float:
        """The median epoch of `n` epochs of `compress train` (its test pass included)."""
        trained, *_ = compress_measured(
            [
                "train",
                *model_args,
                *("--data", data, "--epochs", str(n)),
                *(["--lr", str(case.lr)] if case.lr else []),
                *case.train_flags,
                *("--out", str(out)),
            ]
        )
        return float(np.median([h["seconds"] for h in trained["history"]]))

    before = dense_epoch(epochs, ck)
    shrunk = []
    for m in microbatches if case.name != FLOOR else ("default",):  # fixed cost: measured once
        default = m == "default"
        variant = case.name if default else f"{case.name} M={m}"
        out = work / f"{case.name}-shrunk" if default else work / f"{case.name}-shrunk-m{m}"
        shrunk.append((m, variant, out, *shrink_measured(ck, data, recipes[m], out, case)))
    # The dense epoch again, in a process after the shrink: back-to-back runs of ResNet-18 saw
    # the first process's median epoch move 2.72-3.47 s while the shrink moved 7%
    # (docs/benchmarks.md); the figure divided by is the mean of both processes' medians.
    again = dense_epoch(after, work / f"{case.name}-again.pt") if after else None
    epoch_s = before if again is None else (before + again) / 2
    ds = _dataset(data)
    test_x = ds.x_test.numpy()
    rows = []
    for m, variant, out, rep, shrink_s, peak, by_step in shrunk:
        params = rep["baseline"]["parameters"]
        # --json prints a summary; the full report (timings included) is the folder's report.json.
        rep = json.loads((out / "report.json").read_text())
        timings = rep.get("timings", {})
        training = timings.get("training", float("nan"))
        total = timings.get("total", rep.get("seconds", float("nan")))
        onnx = rep.get("onnx", {})
        int8 = onnx.get("int8") or rep.get("int8_not_written") or {}
        has_fp32 = (out / "model.fp32.onnx").exists()
        diff, rel = fp32_parity(out, test_x) if has_fp32 else (None, None)
        row = {
            "name": variant,
            "model": case.name,
            "microbatches": m,
            "parameters": params,
            "train_epoch_s": epoch_s,
            "train_epoch_s_before_after": [before, again],
            "shrink_wall_s": shrink_s,
            "total_s": total,
            "training_s": training,
            "recipe_epochs": recipe_epochs(rep["recipe"]),
            "non_training_s": total - recipe_epochs(rep["recipe"]) * epoch_s,
            "stages": {s["name"]: s["seconds"] for s in rep["stages"]},
            "timings": timings,
            "peak_rss": peak,
            "peak_by_step": by_step,
            "base_rss": base_rss,
            "code_rss": code_rss,
            "model_bytes": 4 * params,
            "data_bytes": sum(t.numel() * t.element_size() for t in _tensors(ds)),
            "ratio": rep.get("archive", {}).get("ratio"),
            "int8_nodes": int8.get("int8_nodes"),
            "quantizable": int8.get("quantizable_nodes"),
            "agreement": (onnx.get("int8") or {}).get("top1_agreement_fp32"),
            "int8_written": "int8" in onnx,
            "fp32_max_diff": diff,
            "fp32_rel_diff": rel,
            "ort": "yes" if rep.get("ort") else "no",
            "nnapi": rep.get("mobile", {}).get("nnapi"),
            "coreml": rep.get("mobile", {}).get("coreml"),
            "accuracy": (rep["baseline"]["test_accuracy"], rep["student"]["test_accuracy"]),
        }
        print(f"{variant}: {json.dumps(row)}", flush=True)
        rows.append(row)
    return rows


def shrink_measured(ck: Path, data: str, recipe: Path, out: Path, case: Case):
    """`compress shrink` of checkpoint `ck`: its --json summary, wall seconds, peak RSS and peak
    RSS per pipeline step."""
    return compress_measured(
        [
            "shrink",
            str(ck),
            "--data",
            data,
            "--recipe",
            str(recipe),
            "--out",
            str(out),
            *(["--model", case.model] if ":" in case.model else []),
        ]
    )


def _dataset(data: str):
    from compresskit.models import data as data_mod

    return data_mod.load(data)


def _tensors(ds) -> list:
    """The data set's arrays as a shrink holds them (train, validation and test splits)."""
    return [ds.x_train, ds.y_train, ds.x_val, ds.y_val, ds.x_test, ds.y_test]


def table(rows: list[dict]) -> None:
    ok = [r for r in rows if "failed" not in r]
    floor = next((r for r in ok if r["name"] == FLOOR), None)
    fixed = floor["non_training_s"] if floor else 0.0
    # Memory's fixed cost, as time's: what the floor run's peak holds over its own code
    # (the exporter's tracing stack, scikit-learn, ORT sessions, allocator arenas).
    fixed_rss = floor["peak_rss"] - floor.get("code_rss", floor["base_rss"]) if floor else 0
    print(
        "\n| model | params | stages (s) | training s | non-training s | s/M weights "
        "| of which data passes s | rest s/M weights "
        "| shrink / train epochs | peak RSS (over interpreter / FP32 model) "
        "| over code + fixed / (model + data) | archive "
        "| INT8 nodes | INT8 agree | FP32 max|Δ| rel | .ort | NNAPI / CoreML |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "failed" in r:
            print(f"| {r['name']} | FAILED: {r['failed']} |" + " |" * 15)
            continue
        stages = ", ".join(
            f"{k} {v:.0f}"
            for k, v in r["timings"].items()
            if k not in ("total", "training", "non_training", "data_passes", "per_weight")
        )
        per_m = r["non_training_s"] / (r["parameters"] / 1e6)
        r["per_m"] = per_m
        # The non-training seconds less the passes over data (compresskit._datapass): what
        # k-means, the archive, export and the quantizer's rewrites cost, per million weights.
        # Non-training here is against dense epochs (as the issue counts it), so retraining's
        # overhead over a dense epoch stays in this figure; the report's own
        # `timings.per_weight` is against the measured training loops and leaves it out.
        r["passes_s"] = r["timings"].get("data_passes", float("nan"))
        r["per_weight_s"] = r["non_training_s"] - r["passes_s"]
        r["per_weight_per_m"] = r["per_weight_s"] / (r["parameters"] / 1e6)
        r["marginal_per_m"] = (r["non_training_s"] - fixed) / (r["parameters"] / 1e6)
        epochs_s = r["recipe_epochs"] * r["train_epoch_s"]
        r["vs_train"] = vs_train = r["total_s"] / epochs_s
        r["vs_train_marginal"] = (r["total_s"] - fixed) / epochs_s
        over = r["peak_rss"] - r.get("base_rss", 0)
        r["over_fixed"] = r["peak_rss"] - r.get("code_rss", r.get("base_rss", 0)) - fixed_rss
        r["mem_multiple"] = r["over_fixed"] / (r["model_bytes"] + r.get("data_bytes", 0))
        agree = f"{r['agreement']:.4f}" if r["agreement"] is not None else "no INT8 file"
        rel = f"{r['fp32_rel_diff']:.1e}" if r["fp32_rel_diff"] is not None else "-"
        print(
            f"| {r['name']} | {r['parameters'] / 1e6:.2f}M | {stages} | {r['training_s']:.0f} | "
            f"{r['non_training_s']:.0f} | {per_m:.1f} | {r['passes_s']:.0f} | "
            f"{r['per_weight_per_m']:.1f} | {vs_train:.2f} | "
            f"{r['peak_rss'] / 2**20:.0f} MiB ({over / 2**20:.0f} MiB / "
            f"{over / r['model_bytes']:.1f}x) | {r['over_fixed'] / 2**20:.0f} MiB / "
            f"{r['mem_multiple']:.1f}x | {r['ratio']:.1f}x | "
            f"{r['int8_nodes']}/{r['quantizable']} | {agree} | {rel} | {r['ort']} | "
            f"{r['nnapi']} / {r['coreml']} |"
        )
    # The range: LeNet-300-100 (0.95M weights on 3x32x32) up to ResNet-18 and
    # ViT-tiny. Below ~1M weights the fixed cost dominates seconds per million weights, so
    # those rows are printed but kept out of the ratio, and the all-model figure is shown
    # beside it. The marginal figure subtracts the floor run's non-training seconds: what
    # grows with the model, which is what "linear in weights" is about.
    # A row shrunk with micro-batches is the same model again: not a point of the growth curve.
    real = [r for r in ok if r["name"] != FLOOR and r.get("microbatches") == "default"]
    big = [r for r in real if r["parameters"] >= 900_000]
    if floor:
        print(
            f"\nfixed cost (the {floor['parameters']:,}-weight floor run's non-training "
            f"seconds): {fixed:.1f} s"
        )
    for label, rows_in in (("models of >= 0.9M weights", big), ("all models", real)):
        if len(rows_in) >= 2:
            names = ", ".join(r["name"] for r in rows_in)
            line = f"growth (non-training s per million weights, max/min), {label} ({names}): "
            line += _spread([r["per_m"] for r in rows_in])
            if floor:
                line += ", less the fixed cost: " + _spread([r["marginal_per_m"] for r in rows_in])
            print(line)
            # The same less the passes over data, which cost FLOPs x samples as epochs do.
            line = f"growth without the data passes (s per million weights), {label}: "
            line += _spread([r["per_weight_per_m"] for r in rows_in])
            if floor:
                fixed_w = floor["per_weight_s"]
                line += ", less the floor's: " + _spread(
                    [(r["per_weight_s"] - fixed_w) / (r["parameters"] / 1e6) for r in rows_in]
                )
            print(line)
    if floor:
        print(
            f"memory's fixed cost (the floor run's peak over its code): {fixed_rss / 2**20:.0f} "
            "MiB; peak over the model's code and that, per FP32 model + data bytes: "
            + ", ".join(f"{r['name']} {r['mem_multiple']:.1f}x" for r in ok if r["name"] != FLOOR)
        )
    # Where each run's peak was: the highest RSS sampled while each pipeline step ran.
    for r in ok:
        steps = r.get("peak_by_step") or {}
        if steps:
            print(
                f"{r['name']}: peak RSS by step (sampled every 2 ms; VmHWM "
                f"{r['peak_rss'] / 2**20:.0f} MiB): "
                + ", ".join(
                    f"{k} {v['peak'] / 2**20:.0f}"
                    for k, v in sorted(steps.items(), key=lambda kv: -kv[1]["peak"])
                )
            )
    # Each row with a set train.microbatches against the same model's default-recipe row.
    for r in ok:
        base = next((b for b in ok if b["name"] == r.get("model")), None)
        if r.get("microbatches") == "default" or base is None:
            continue
        print(
            f"{r['name']} against the default recipe: peak RSS {r['peak_rss'] / 2**20:.0f} / "
            f"{base['peak_rss'] / 2**20:.0f} MiB, training s {r['training_s']:.0f} / "
            f"{base['training_s']:.0f} ({r['training_s'] / base['training_s']:.2f}x), whole "
            f"shrink / its training epochs {r['vs_train']:.2f} / {base['vs_train']:.2f}, test "
            f"accuracy after {r['accuracy'][1]:.4f} / {base['accuracy'][1]:.4f}"
        )
    twice = [r for r in ok if r.get("train_epoch_s_before_after", [0, None])[1] is not None]
    if twice:
        print(
            "dense epoch, the first / the second training process's median: "
            + ", ".join(
                f"{r['name']} {r['train_epoch_s_before_after'][0]:.3g} / "
                f"{r['train_epoch_s_before_after'][1]:.3g} s"
                for r in twice
            )
        )
    if len(real) >= 2:
        worst = max(real, key=lambda r: r["vs_train"])
        line = (
            f"whole shrink / its training epochs, worst: {worst['vs_train']:.2f} ({worst['name']})"
        )
        if floor:
            w = max(real, key=lambda r: r["vs_train_marginal"])
            line += f"; less the fixed cost: {w['vs_train_marginal']:.2f} ({w['name']})"
        print(line)


def _spread(values: list[float]) -> str:
    """max/min of positive figures; a figure at or below zero (within noise of the fixed
    cost) has no meaningful ratio."""
    if min(values) <= 0:
        return f"n/a (a figure <= 0: {min(values):.2f})"
    return f"{max(values) / min(values):.2f}"


def _cpu_flags() -> list[str]:
    """The flags that decide the INT8/BF16 kernels (envinfo's list), plus fma and avx_vnni."""
    from compresskit.compressor.measure import envinfo

    return sorted(envinfo.cpu_flags() & {*envinfo.CPU_FLAGS, "avx_vnni", "fma"})


if __name__ == "__main__":
    main()
