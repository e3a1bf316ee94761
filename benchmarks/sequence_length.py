"""Text models: the cost of a short query on a file with a symbolic sequence axis (what
`compress shrink` writes for token models) against the same model exported at a fixed length,
where an app pads every query to it.

    python benchmarks/sequence_length.py                   # textcls, 32 tokens
    python benchmarks/sequence_length.py --models textcls,bert --length 128

Both files come from one model (random init: latency does not depend on the weights) through
`compresskit.compressor.export.onnxfile.export_onnx`, with `dynamic_sequence` on and off. For
each query length the fixed file runs the query padded to the full length (id 0, the padding
the model masks), the dynamic file runs it as it is; batch 1, one ORT thread, graph
optimizations on, runs interleaved, the median of `--runs`. It also prints the dynamic file's
max |difference| from the PyTorch model at that length, and whether the padded query gives the
same class as the short one (it should: padding is masked). Compare only figures from one run.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch


def build(name: str, length: int) -> torch.nn.Module:
    if name == "bert":
        from compresskit.models import hf

        return hf.bert(in_shape=(length,), num_classes=2).eval()
    from compresskit.models import zoo

    spec = zoo.ModelSpec(name, {"in_shape": [length], "num_classes": 2})
    return zoo.build(spec, seed=0).eval()


def cpu_flags() -> str:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split("flags\t\t:")[1].split("\n")[0].split())
    except (OSError, IndexError):
        return platform.processor() or "unknown CPU"
    return ", ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "fma") if f in flags)


def timed(session, feed: dict, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        session.run(None, feed)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="textcls", help="textcls, bert (needs [zoo])")
    parser.add_argument("--length", type=int, default=32, help="the length trained on")
    parser.add_argument("--queries", default="4,8,16", help="query lengths below --length")
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()

    import onnxruntime as ort

    from compresskit.compressor.export import onnxfile

    warnings.simplefilter("ignore")
    print(
        f"# {platform.machine()} ({cpu_flags()}), torch {torch.__version__}, ORT {ort.__version__}"
    )
    print("| model | query tokens | fixed file, padded to L ms | dynamic file ms | speed-up "
          "| max abs diff vs PyTorch | same class padded |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 4
    queries = [int(q) for q in args.queries.split(",")] + [args.length]
    for name in args.models.split(","):
        torch.manual_seed(0)
        model = build(name, args.length)
        example = model.example_inputs(2)[0]
        with tempfile.TemporaryDirectory() as tmp:
            files = {}
            for dynamic in (False, True):
                cfg = onnxfile.ExportConfig(dynamic_sequence=dynamic)
                path = Path(tmp) / f"{name}.{dynamic}.onnx"
                onnxfile.export_onnx(model, example, path, cfg)
                files[dynamic] = ort.InferenceSession(
                    str(path), options, providers=["CPUExecutionProvider"]
                )
            fixed, dynamic = files[False], files[True]
            key = fixed.get_inputs()[0].name
            g = torch.Generator().manual_seed(1)
            for q in queries:
                ids = torch.randint(1, 50, (1, q), generator=g)
                padded = torch.zeros(1, args.length, dtype=torch.int64)
                padded[:, :q] = ids
                with torch.no_grad():
                    want = model(ids).numpy()
                got = dynamic.run(None, {key: ids.numpy()})[0]
                same = int(np.argmax(fixed.run(None, {key: padded.numpy()})[0])) == int(
                    np.argmax(got)
                )
                a, b = [], []
                for _ in range(3):  # interleaved rounds: drift hits both files alike
                    a += timed(fixed, {key: padded.numpy()}, args.runs // 3)
                    b += timed(dynamic, {key: ids.numpy()}, args.runs // 3)
                fa, fb = statistics.median(a), statistics.median(b)
                print(
                    f"| {name} | {q} of {args.length} | {fa:.3f} | {fb:.3f} | {fa / fb:.2f}x "
                    f"| {np.abs(got - want).max():.2e} | {'yes' if same else 'NO'} |"
                )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
