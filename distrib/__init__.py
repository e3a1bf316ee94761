"""Training: the one training loop (`trainer.fit`) and the `compress train` job (`job.run`).

Data-parallel strategies on torch.distributed (all-reduce, parameter server) build on these.
Depends on `models` only; never on `compressor` or `cli`.

The Python API (what `compress train` is built on)::

    from compresskit.distrib import TrainConfig, train

    result = train("lenet300", "digits", TrainConfig(epochs=5), out="lenet300.pt")
    result.test_accuracy, result.model, result.to_json()

`train` never prints or exits; bad input raises `compresskit.models.errors.InputError`.
The names below are imported on first use, so `import compresskit.distrib` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from compresskit import _lazy

if TYPE_CHECKING:  # for type checkers and editors; at run time `__getattr__` imports them
    from compresskit.distrib.job import train
    from compresskit.distrib.paramserver import PSConfig
    from compresskit.distrib.pipeline import PipelineConfig
    from compresskit.distrib.trainer import EpochRecord, Events, TrainConfig, TrainResult

# Public name -> the module that defines it.
_LAZY = {
    "train": "compresskit.distrib.job",
    "TrainConfig": "compresskit.distrib.trainer",
    "TrainResult": "compresskit.distrib.trainer",
    "EpochRecord": "compresskit.distrib.trainer",
    "Events": "compresskit.distrib.trainer",
    "PSConfig": "compresskit.distrib.paramserver",
    "PipelineConfig": "compresskit.distrib.pipeline",
}

__all__ = [
    "EpochRecord",
    "Events",
    "PSConfig",
    "PipelineConfig",
    "TrainConfig",
    "TrainResult",
    "train",
]


__getattr__, __dir__ = _lazy.exports(__name__, _LAZY, globals())
