"""Every file `compress shrink` writes, loaded in clients nobody here wrote, and our INT8 file
against the quantizers a user would pick instead. Measured side by side in one run.

1. Clients: onnxruntime 1.17.3 (its own venv, built here from the package index), this
   environment's onnxruntime, onnxruntime-node and onnxruntime-web (wasm, under node; npm, when
   `node` is present) load each FP32, INT8, fixed-batch and `.ort` file of
   - the `compress demo` output (LeNet-5 distilled from VGG on digits; default recipe), and
   - the same student built with `--target host` (on an AVX2-without-VNNI CPU: 7-bit weights),
   - a user's residual/depthwise network (inverted residuals, BatchNorm, ReLU6, global average
     pool) trained here, exported with `ir_version = 9` (Deep Compression off).
   Each cell: loads, max |delta| and top-1 agreement against the FP32 ONNX file on this
   environment's ORT (the reference), and whether it holds the floor (FP32: |delta| <= 1e-3;
   INT8: agreement >= the recipe's min_agreement).
2. Quantizers on the same FP32 ONNX file, interleaved at 1 thread: our student.int8.onnx,
   ORT's `quantize_static` with its defaults (S8S8, per-tensor) and NNCF's `nncf.quantize`
   (when installed; skipped with the reason otherwise), on LeNet-5 from an MNIST shrink and a
   VGG on digits: agreement with FP32 (as written and on this CPU's kernels), bytes, p50.

    python benchmarks/edge_clients.py [--mnist ../shared/data/mnist] [--work DIR]

About 10 minutes on 2 cores, most of it training and the side installs (cached in --work).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compresskit.compressor import export  # noqa: E402
from compresskit.compressor.export import checks, int8, mobile  # noqa: E402
from compresskit.compressor.measure import envinfo, latency  # noqa: E402
from compresskit.models import data as data_mod  # noqa: E402

USER_NET = '''
import torch
from torch import nn


class Block(nn.Module):
    """MobileNetV2's inverted residual: expand 1x1, depthwise 3x3, project 1x1, add."""

    def __init__(self, c, expand=4):
        super().__init__()
        h = c * expand
        self.body = nn.Sequential(
            nn.Conv2d(c, h, 1, bias=False), nn.BatchNorm2d(h), nn.ReLU6(),
            nn.Conv2d(h, h, 3, padding=1, groups=h, bias=False), nn.BatchNorm2d(h), nn.ReLU6(),
            nn.Conv2d(h, c, 1, bias=False), nn.BatchNorm2d(c),
        )

    def forward(self, x):
        return x + self.body(x)


class InvRes(nn.Module):
    def __init__(self, in_channels=1, num_classes=10, width=16):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU6()
        )
        self.blocks = nn.Sequential(Block(width), Block(width))
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))
'''

EXPORT_ONLY = """
[prune]
enabled = false
[quantize]
enabled = false
[huffman]
enabled = false
"""
# The user net goes to ONNX without Deep Compression: this benchmark is about the files (a
# 1-round prune of a 6-epoch BatchNorm net costs it 30 points, which is the prune stage's story).
RECIPE_IR9 = EXPORT_ONLY + "[export]\nir_version = 9\n"

CLIENT_PY = """
import json, sys, numpy as np, onnxruntime as ort
spec = json.load(open(sys.argv[1]))
x = np.load(spec["input"])
out = {}
for path, batch in spec["files"]:
    try:
        s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        name = s.get_inputs()[0].name
        step = batch or len(x)
        y = np.concatenate([s.run(None, {name: x[i:i + step]})[0] for i in range(0, len(x), step)])
        np.save(path + ".client.npy", y)
        out[path] = "ok"
    except Exception as e:
        out[path] = " ".join(str(e).split())[:160]
print(json.dumps({"version": ort.__version__, "results": out}))
"""

CLIENT_JS = """
const fs = require('fs');
const which = process.argv[2];
const ort = require(which === 'web' ? 'onnxruntime-web' : 'onnxruntime-node');
if (which === 'web') { ort.env.wasm.numThreads = 1; }
const spec = JSON.parse(fs.readFileSync(process.argv[3]));
const raw = fs.readFileSync(spec.input_raw);
const x = new Float32Array(raw.buffer, raw.byteOffset, raw.byteLength / 4);
const [n, ...dims] = spec.shape;
const per = dims.reduce((a, b) => a * b, 1);
(async () => {
  const out = {};
  for (const [path, batch] of spec.files) {
    try {
      const s = await ort.InferenceSession.create(fs.readFileSync(path));
      const step = batch || n;
      const chunks = [];
      for (let i = 0; i < n; i += step) {
        const b = Math.min(step, n - i);
        const t = new ort.Tensor('float32', x.slice(i * per, (i + b) * per), [b, ...dims]);
        const r = await s.run({[s.inputNames[0]]: t});
        chunks.push(Buffer.from(r[s.outputNames[0]].data.buffer));
      }
      fs.writeFileSync(path + '.' + which + '.bin', Buffer.concat(chunks));
      out[path] = 'ok';
    } catch (e) { out[path] = String(e.message || e).split('\\n')[0].slice(0, 160); }
  }
  const name = which === 'web' ? 'onnxruntime-web' : 'onnxruntime-node';
  const pkg = JSON.parse(fs.readFileSync(__dirname + '/node_modules/' + name + '/package.json'));
  console.log(JSON.stringify({version: pkg.version, results: out}));
})();
"""


def sh(cmd: list, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)


def compress(*args, env=None) -> dict:
    cmd = [sys.executable, "-m", "compresskit.cli", *args, "--json", "-q"]
    done = sh(cmd, cwd=ROOT, env=env)
    if done.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed:\n{done.stderr}")
    return json.loads(done.stdout)


def shrink_folders(work: Path) -> dict[str, Path]:
    folders = {}
    demo = work / "demo"
    if not (demo / "student" / "report.json").is_file():
        compress("demo", "--out", demo)
    folders["demo (LeNet-5 student)"] = demo / "student"
    host = work / "demo-host"
    if not (host / "report.json").is_file():
        recipe = json.loads((demo / "student" / "report.json").read_text())["recipe"]
        recipe["export"]["target"] = "host"  # the demo's own recipe, built for this machine
        (work / "host.json").write_text(json.dumps(recipe))
        compress("shrink", demo / "teacher.pt", "--recipe", work / "host.json", "--out", host)
    folders["demo student, --target host"] = host
    user = work / "invres"
    if not (user / "report.json").is_file():
        (work / "usernets.py").write_text(USER_NET)
        env = {**os.environ, "PYTHONPATH": f"{work}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        ck = work / "invres.pt"
        compress("train", "--model", "usernets:InvRes", "--epochs", "6", "--out", ck, env=env)
        (work / "ir9.toml").write_text(RECIPE_IR9)
        compress(
            "shrink", ck, "--model", "usernets:InvRes", "--recipe", work / "ir9.toml",
            "--fixed-batch", "1", "--out", user, env=env,
        )  # fmt: skip
    folders["user residual/depthwise net (IR 9)"] = user
    for folder in folders.values():  # the demo writes no fixed-batch copy: make it as shrink does
        for kind in ("int8", "fp32"):
            name = stem(folder)
            src, fixed = folder / f"{name}.{kind}.onnx", folder / f"{name}.{kind}.fixed.onnx"
            if kind == "int8" and src.is_file() and not fixed.is_file():
                mobile.fixed_batch(src, fixed, 1)
    return folders


def stem(folder: Path) -> str:
    """What a shrink folder's files are called: student.* after distillation, else model.*."""
    return json.loads((folder / "report.json").read_text()).get("name", "student")


def model_files(folder: Path) -> list[tuple[Path, int]]:
    kinds = ["fp32.onnx", "int8.onnx", "int8.fixed.onnx", "fp32.fixed.onnx", "int8.ort", "fp32.ort"]
    names = [f"{stem(folder)}.{k}" for k in kinds]
    return [(folder / n, 1 if ".fixed." in n else 0) for n in names if (folder / n).is_file()]


def side_clients(work: Path, spec_path: Path) -> dict[str, dict]:
    """{client label: {"version", "results": {path: "ok" | error}}} (or {"skipped": why})."""
    clients: dict[str, dict] = {}
    venv = work / "ort117"
    py = venv / "bin" / "python"
    if not py.is_file():
        sh([sys.executable, "-m", "venv", venv])
        done = sh([py, "-m", "pip", "install", "-q", "onnxruntime==1.17.3", "numpy<2"])
        if done.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
    if py.is_file():
        (work / "client.py").write_text(CLIENT_PY)
        done = sh([py, work / "client.py", spec_path])
        clients["onnxruntime 1.17.3 (venv)"] = (
            json.loads(done.stdout) if done.returncode == 0 else {"skipped": done.stderr[-200:]}
        )
    else:
        clients["onnxruntime 1.17.3 (venv)"] = {"skipped": "pip could not install it here"}
    node = shutil.which("node")
    npm_dir = work / "node"
    for which in ("node", "web"):
        label = f"onnxruntime-{which}" + (" (wasm, under node)" if which == "web" else "")
        if node is None:
            clients[label] = {"skipped": "no node on this machine"}
            continue
        if not (npm_dir / "node_modules" / "onnxruntime-web").is_dir():
            npm_dir.mkdir(exist_ok=True)
            sh(["npm", "init", "-y"], cwd=npm_dir)
            env = {**os.environ, "ONNXRUNTIME_NODE_INSTALL": "skip"}  # no CUDA download
            sh(["npm", "install", "--no-audit", "--no-fund", "onnxruntime-node", "onnxruntime-web"],
               cwd=npm_dir, env=env)  # fmt: skip
        (npm_dir / "client.js").write_text(CLIENT_JS)
        done = sh([node, npm_dir / "client.js", which, spec_path], cwd=npm_dir)
        try:
            clients[label] = json.loads(done.stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            clients[label] = {"skipped": (done.stderr or "npm install failed")[-200:]}
    return clients


def client_table(work: Path, folders: dict[str, Path]) -> list[dict]:
    rows = []
    for title, folder in folders.items():
        report = json.loads((folder / "report.json").read_text())
        floor = report["recipe"]["export"]["min_agreement"]
        ds = data_mod.load(report["baseline"].get("data") or "digits")
        x = ds.x_test[:256].numpy().astype(np.float32)
        files = model_files(folder)
        np.save(folder / "input.npy", x)
        (folder / "input.bin").write_bytes(x.tobytes())
        spec = {
            "input": str(folder / "input.npy"),
            "input_raw": str(folder / "input.bin"),
            "shape": list(x.shape),
            "files": [[str(p), b] for p, b in files],
        }
        spec_path = folder / "clients.json"
        spec_path.write_text(json.dumps(spec))
        ref = checks.outputs(checks.session(folder / f"{stem(folder)}.fp32.onnx", True), x)
        import onnxruntime as ort

        here = {"version": ort.__version__, "results": {}}
        for path, batch in files:
            y = checks.outputs(checks.session(path, True), x, batch=batch or len(x))
            np.save(str(path) + ".here.npy", y)
            here["results"][str(path)] = "ok"
        clients = {
            f"onnxruntime {ort.__version__} (this env)": here,
            **side_clients(work, spec_path),
        }
        print(f"\n### {title}: `{folder}`\n")
        print("| client | file | loads | max abs Δ vs FP32 | top-1 agreement | within floor |")
        print("|---|---|---|---|---|---|")
        for label, c in clients.items():
            if "skipped" in c:
                print(f"| {label} | all | skipped: {c['skipped'].strip()} | | | |")
                continue
            label = f"{label.split(' (')[0].rsplit(' ', 1)[0]} {c['version']}" + (
                " (wasm)" if "web" in label else ""
            )
            for path, _ in files:
                status = c["results"].get(str(path), "not run")
                row = {"model": title, "client": label, "file": path.name, "loads": status == "ok"}
                if status == "ok":
                    suffix = {"onnxruntime-node": ".node.bin", "onnxruntime-web": ".web.bin"}
                    key = next((k for k in suffix if label.startswith(k)), None)
                    if key:
                        raw = np.frombuffer(Path(str(path) + suffix[key]).read_bytes(), np.float32)
                        y = raw.reshape(ref.shape)
                    else:
                        tag = (
                            ".here.npy"
                            if "this env" in label
                            or label.startswith(f"onnxruntime {ort.__version__}")
                            else ".client.npy"
                        )
                        y = np.load(str(path) + tag)
                    diff = float(np.abs(y - ref).max())
                    agree = checks.agreement(y, ref)
                    is_int8 = ".int8." in path.name
                    ok = agree >= floor if is_int8 else diff <= 1e-3
                    row.update(max_abs_diff=diff, agreement=agree, within_floor=ok)
                    print(
                        f"| {label} | {path.name} | yes | {diff:.3g} | {agree:.2%} | "
                        f"{'yes' if ok else 'NO'} |"
                    )
                else:
                    print(f"| {label} | {path.name} | NO: {status} | | | |")
                rows.append(row)
    return rows


def quantizer_table(work: Path, mnist: Path | None) -> list[dict]:
    cases = {}
    vgg = work / "vgg-digits"
    if not (vgg / "report.json").is_file():
        compress(
            "train", "--model", "vgg", "--data", "digits", "--epochs", "3", "--out", work / "vgg.pt"
        )
        (work / "export.toml").write_text(EXPORT_ONLY)
        compress("shrink", work / "vgg.pt", "--recipe", work / "export.toml", "--out", vgg)
    cases["VGG / digits (export only)"] = (vgg, "digits")
    if mnist is not None and mnist.is_dir():
        lenet = work / "lenet5-mnist"
        spec = f"mnist:{mnist}"
        if not (lenet / "report.json").is_file():
            ck = work / "lenet5-mnist.pt"
            compress("train", "--model", "lenet5", "--data", spec, "--epochs", "5", "--out", ck)
            compress("shrink", ck, "--data", spec, "--out", lenet)  # the default recipe
        cases["LeNet-5 / MNIST (default recipe)"] = (lenet, spec)
    else:
        print(f"\n(LeNet-5 / MNIST skipped: no MNIST folder at {mnist})")
    rows = []
    for title, (folder, spec) in cases.items():
        ds = data_mod.load(spec)
        fp32 = folder / f"{stem(folder)}.fp32.onnx"
        pick = torch.randperm(len(ds.y_train), generator=torch.Generator().manual_seed(0))
        calib = ds.x_train[pick[:256]].numpy()  # the samples our file was calibrated on
        _, ort_default = export.ort_baselines(fp32, work, calib)
        files = {"compress INT8 file": folder / f"{stem(folder)}.int8.onnx"}
        files["ORT quantize_static defaults (S8S8 per-tensor)"] = ort_default
        nncf_note = nncf_file(fp32, calib, work / f"{folder.name}.nncf.onnx")
        if isinstance(nncf_note, Path):
            files["NNCF nncf.quantize"] = nncf_note
        x = ds.x_test.numpy()
        ref = {o: checks.outputs(checks.session(fp32, o), x) for o in (False, True)}
        lat = {}
        for batch in (1, 64):
            xb = x[:batch]
            sessions = [checks.session(p, True) for p in files.values()]
            name = sessions[0].get_inputs()[0].name
            calls = [(lambda s=s, f={name: xb}: s.run(None, f)) for s in sessions]
            times = latency.interleaved(calls, seconds=4.0, min_runs=50)
            lat[batch] = [1000 * float(np.median(t)) for t in times]
        print(f"\n### {title}: `{fp32}`\n")
        print(
            "| quantizer | bytes | agreement with FP32, as written | on this CPU's kernels "
            "| p50 ms batch 1 (vs ours) | p50 ms batch 64 (vs ours) |"
        )
        print("|---|---|---|---|---|---|")
        for k, (label, path) in enumerate(files.items()):
            a = {
                o: checks.agreement(checks.outputs(checks.session(path, o), x), ref[o]) for o in ref
            }
            r1, r64 = lat[1][k] / lat[1][0], lat[64][k] / lat[64][0]
            print(
                f"| {label} | {path.stat().st_size:,} | {a[False]:.2%} | {a[True]:.2%} | "
                f"{lat[1][k]:.3f} ({r1:.2f}×) | {lat[64][k]:.3f} ({r64:.2f}×) |"
            )
            rows.append(
                {"model": title, "quantizer": label, "bytes": path.stat().st_size,
                 "agreement_reference": a[False], "agreement_host": a[True],
                 "p50_ms_batch1": lat[1][k], "p50_ms_batch64": lat[64][k]}
            )  # fmt: skip
        if not isinstance(nncf_note, Path):
            print(f"| NNCF nncf.quantize | skipped: {nncf_note} | | | | |")
    return rows


def nncf_file(fp32: Path, calib: np.ndarray, out: Path) -> Path | str:
    """NNCF's default post-training INT8 of the same FP32 file, or why it is skipped."""
    try:
        import nncf
        import onnx
    except ImportError as e:
        return f"nncf is not installed ({e.name}); pip install nncf"
    try:
        model = onnx.load(str(fp32))
        name = model.graph.input[0].name
        dataset = nncf.Dataset([{name: calib[i : i + 1]} for i in range(len(calib))])
        onnx.save(nncf.quantize(model, dataset), str(out))
    except Exception as e:
        return f"nncf.quantize failed: {' '.join(str(e).split())[:120]}"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=None, help="work folder (reused between runs)")
    p.add_argument("--mnist", type=Path, default=ROOT.parent / "shared" / "data" / "mnist")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="edge_clients."))
    work.mkdir(parents=True, exist_ok=True)
    flags = envinfo.cpu_flags()
    shown = sorted(flags & {"avx2", "avx512f", "avx512_vnni", "avx_vnni"})
    print(f"# edge clients, work folder {work}")
    print(f"CPU: {envinfo.environment()['cpu_model']}, flags {' '.join(shown)}")
    if int8.saturating_cpu(flags):
        print("(AVX2 without VNNI: this ORT's optimized u8s8 kernels can saturate here)")
    print("\n## 1. Clients × files\n")
    clients = client_table(work, shrink_folders(work))
    print("\n## 2. Quantizers on the same FP32 file (1 thread, interleaved)\n")
    quant = quantizer_table(work, args.mnist)
    if args.json:
        args.json.write_text(json.dumps({"clients": clients, "quantizers": quant}, indent=1))


if __name__ == "__main__":
    main()
