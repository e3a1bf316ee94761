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
    "InputError",
    "ModelSpec",
    "StageError",
    "available",
    "build",
    "count_parameters",
    "input_kind",
    "resolve",
    "resolve_spec",
    "state_shapes",
    "tiny",
]
