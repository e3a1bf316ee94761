"""What structured pruning buys where the model runs: ORT CPU latency of the unthinned and the
thinned model, FP32 and INT8, at batch 1 and 64, measured side by side in one process,
interleaved, on one thread (`compressor.measure.latency`'s harness, as `compress bench` times).

Fewer channels shrink the archive only a little; they exist to make the graph itself cheaper.
MACs say how much work went, not how much time: INT8 kernels, memory traffic and per-node
overhead decide that, differently on every CPU (AVX2 against AVX-512 VNNI). So the shrink
report gives measured milliseconds, with the CPU flags they came from.

The unthinned INT8 file is built here only to be timed: the same calibration inputs and the
same scheme as the shipped file, every quantizable node in INT8 (the fallback search that
chose the shipped file's FP32 nodes is not repeated for a file nobody ships).

    rec = compare(unthinned, thinned_fp32, thinned_int8, x, scheme, calib, tmp, cfg)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from compresskit import _datapass
from compresskit.compressor import export
from compresskit.compressor.export import int8, qdq
from compresskit.compressor.measure import envinfo, latency
from compresskit.models.errors import one_line

BATCHES = (1, 64)
SECONDS = 0.6  # per batch size, all four files interleaved


def all_int8(
    fp32: Path,
    out: Path,
    calib: np.ndarray,
    quant: int8.QuantConfig,
    ort_default: bool = False,
    ir_version: int | None = None,
) -> Path:
    """Write `fp32` with every quantizable node in INT8 at `out`: calibrated on `calib`, in this
    build's scheme for `quant` on this CPU (or ORT's default scheme). A file to time, not to
    ship: the agreement search that chooses the shipped file's FP32 nodes is not run."""
    import onnx

    prepared = out.with_name(out.name + ".prepared.onnx")
    try:
        export.preprocess(fp32, prepared)
        with export.errors_only():
            q = qdq.Quantizer(prepared, calib, quant.method)
            ours = int8.scheme_for(quant, int8.resolve_reduce_range(quant, envinfo.cpu_flags()))
            model = q.build(qdq.ORT_DEFAULT if ort_default else ours, ir_version=ir_version)
    finally:
        prepared.unlink(missing_ok=True)
    onnx.save(model, str(out))
    return out


def compare(
    unthinned: nn.Module,
    fp32: Path,
    int8_file: Path | None,
    x: np.ndarray,
    scheme: str | None,
    calib: np.ndarray,
    tmp: Path,
    export_cfg: export.ExportConfig,
    quant: int8.QuantConfig,
    ir_version: int | None = None,
) -> dict[str, Any]:
    """p50 latency (ms) of the unthinned and thinned FP32 files and, when `int8_file` was
    written, of the unthinned and thinned INT8 files (scheme `scheme`), at each of BATCHES;
    `x` supplies the inputs (repeated up to the largest batch). Plain data."""
    import torch

    files: dict[str, list[Path]] = {"fp32": [], "int8": []}
    made: list[Path] = []
    flags = envinfo.cpu_flags()
    try:
        example = torch.from_numpy(x[:2])
        before = export.export_onnx(unthinned, example, tmp / ".unthinned.fp32.onnx", export_cfg)
        made.append(before)
        files["fp32"] = [before, fp32]
        if int8_file is not None and scheme is not None:
            path = tmp / ".unthinned.int8.onnx"
            made.append(path)
            all_int8(before, path, calib, quant, scheme == qdq.ORT_DEFAULT.name, ir_version)
            files["int8"] = [path, int8_file]
        rows = []
        for b in BATCHES:
            batch = np.resize(x, (b, *x.shape[1:]))
            kinds = [k for k in ("fp32", "int8") if files[k]]
            calls = [latency.onnx_runner(p, batch, threads=1) for k in kinds for p in files[k]]
            with _datapass.data_pass():  # timing runs the files on inputs, as INT8's does
                ms = latency.p50_ms(calls, SECONDS)
            for i, k in enumerate(kinds):
                b0, b1 = ms[2 * i], ms[2 * i + 1]
                row = {"batch": b, "precision": k, "before_ms": b0, "after_ms": b1}
                rows.append({**row, "speedup": b0 / b1})
        return {
            "rows": rows,
            "threads": 1,
            "cpu_flags": sorted(flags & set(envinfo.CPU_FLAGS)),
            "int8_before": "every quantizable node INT8, the shipped file's scheme"
            if files["int8"]
            else "no INT8 file was written",
        }
    except Exception as e:  # timing is a report figure: its failure must not lose the run
        return {"rows": [], "error": f"{type(e).__name__}: {one_line(e, 200)}"}
    finally:
        for p in made:
            p.unlink(missing_ok=True)
