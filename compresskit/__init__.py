"""compresskit: from a big PyTorch model to a tiny INT8 ONNX file a phone runs.

The same operations as the `compress` command, as plain functions that return dataclasses
(each with `.to_json()`), never print and never exit; bad input raises `InputError` with one
line naming the problem and the fix:

    import compresskit as ck

    run = ck.train("lenet300", "digits", ck.TrainConfig(epochs=2), out="lenet300.pt")
    report = ck.shrink(run, "digits", ck.Recipe(), out="lenet300-shrunk")
    print(report.ratio, report.test_accuracy, report.ship)
    result = ck.bench([run.checkpoint, report.out / report.ship], "digits")

`train` is `compresskit.distrib.train` (data-parallel strategies on torch.distributed),
`bench` is `compresskit.compressor.bench` (module `compressor.measure.grid`); `shrink` joins
Deep Compression (`compresskit.compressor`) with the training loop it retrains with
(`compresskit.distrib`), as the CLI does: the two packages never import each other, so the
call that needs both lives here.

Names are imported on first use, so `import compresskit` is instant and loads neither torch
nor ONNX Runtime. Imported before torch, it sets GOMP_SPINCOUNT=1000 unless you chose a wait
policy (`compresskit/_threads.py`): results are the same, a busy machine trains faster.
"""

from __future__ import annotations

from compresskit import _lazy, _threads

# Before torch loads (when it has not yet): OpenMP threads spin briefly, then sleep. On a busy
# 2-core machine `ck.train` of LeNet-300-100 took 18.8 s where the command, which sets the
# same, took 5.3 s (compresskit/_threads.py). The user's own OMP_WAIT_POLICY/GOMP_SPINCOUNT
# stand; with torch imported first, nothing changes.
_threads.short_spin()

# name -> the module that defines it (imported on first access: see __getattr__)
_LAZY = {
    "shrink": "compresskit.api",
    "ShrinkReport": "compresskit.api",
    "decode": "compresskit.api",
    "train": "compresskit.distrib",
    "TrainConfig": "compresskit.distrib",
    "TrainResult": "compresskit.distrib",
    "bench": "compresskit.compressor",
    "BenchResult": "compresskit.compressor",
    "Recipe": "compresskit.compressor",
    # the recipe's sections, for Recipe(prune=ck.PruneSection(sparsity=0.9))
    "TrainSection": "compresskit.compressor",
    "BudgetSection": "compresskit.compressor",
    "DistillSection": "compresskit.compressor",
    "ChannelsSection": "compresskit.compressor",
    "PruneSection": "compresskit.compressor",
    "QuantizeSection": "compresskit.compressor",
    "HuffmanSection": "compresskit.compressor",
    "ExportSection": "compresskit.compressor",
    "GuardSection": "compresskit.compressor",
    "load_data": "compresskit.models",
    "Dataset": "compresskit.models",
    "ModelSpec": "compresskit.models",
    "CompressError": "compresskit.models",
    "InputError": "compresskit.models",
    "StageError": "compresskit.models",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = _lazy.exports(__name__, _LAZY, globals())
