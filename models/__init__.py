"""Model zoo, data loading and checkpoints: the layer every other `compress` package builds on.

Depends on torch, numpy and scikit-learn only; never on `compressor`, `distrib` or `cli`.
"""

from compresskit.models.errors import CompressError, InputError, StageError
from compresskit.models.zoo import (
    ModelSpec,
    available,
    build,
    count_parameters,
    input_kind,
    resolve,
    resolve_spec,
    state_shapes,
    tiny,
)

__all__ = [
    "CompressError",
    "Dataset",
    "InputError",
    "ModelSpec",
    "StageError",
    "available",
    "build",
    "count_parameters",
    "input_kind",
    "load_data",
    "resolve",
    "resolve_spec",
    "state_shapes",
    "tiny",
]


def __getattr__(name: str):
    # Data loading imports scikit-learn: only when asked for.
    if name in ("load_data", "Dataset"):
        from compresskit.models import data

        return data.load if name == "load_data" else data.Dataset
    raise AttributeError(f"module 'compresskit.models' has no attribute {name!r}")
