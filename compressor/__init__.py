"""Deep Compression (Han, Mao & Dally, ICLR 2016), distillation (Hinton et al. 2015), INT8 ONNX
export and benchmarking: the stages behind `compress shrink` and `compress bench`.

Three concerns, three places:
- this folder: Deep Compression and what drives it (e.g. prune, kmeans, softshare, huffman,
  archive, distill, budget, channels; shrink and pipeline run them as stages from a `Recipe`);
- `export/`: what an app ships (ONNX at an opset, the INT8 choice, `.ort`, mobile checks);
- `measure/`: what a file costs where it runs (`compress bench`'s grid, the timing harness,
  ORT's profiler, the machine's description, per-layer latency for structured pruning).

Depends on `models` only; never on `distrib` (the CLI, and `compresskit.shrink`, pass the
training loop in as hooks) or `cli`. Heavy imports (onnx, onnxruntime) are made inside the
functions that need them, and the names below are imported on first use, so
`import compresskit.compressor` stays fast.

The documented surface: `Recipe` and its sections (what `compress shrink` does), `bench` /
`BenchResult` (what `compress bench` measures), and the errors. `compresskit.shrink` runs a
recipe on a model.
"""

from __future__ import annotations

from compresskit import _lazy

_RECIPE = "compresskit.compressor.recipe"
# name -> the module that defines it (imported on first access: see __getattr__)
_LAZY = {
    "Recipe": _RECIPE,
    "TrainSection": _RECIPE,
    "BudgetSection": _RECIPE,
    "DistillSection": _RECIPE,
    "ChannelsSection": _RECIPE,
    "PruneSection": _RECIPE,
    "QuantizeSection": _RECIPE,
    "HuffmanSection": _RECIPE,
    "ExportSection": _RECIPE,
    "GuardSection": _RECIPE,
    "bench": "compresskit.compressor.measure.grid",
    "BenchResult": "compresskit.compressor.measure.grid",
    "CompressError": "compresskit.models.errors",
    "InputError": "compresskit.models.errors",
    "StageError": "compresskit.models.errors",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = _lazy.exports(__name__, _LAZY, globals())
