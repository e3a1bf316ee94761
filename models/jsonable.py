"""Results as plain JSON values: what `compress ... --json` prints, as Python objects.

The `to_json()` of the API's result dataclasses (`distrib.TrainResult`, `compressor.BenchResult`)
go through `plain`, so a notebook gets exactly the object the CLI prints, parsed back.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(v: Any) -> Any:
    """`v` with every NaN or infinite float replaced by None (JSON has neither), recursively
    through dicts, lists and tuples (tuples become lists)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: finite(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [finite(x) for x in v]
    return v


def plain(obj: Any) -> Any:
    """`obj` as JSON values only (dict, list, str, int, float, bool, None): NaN and infinity
    become None, other values JSON cannot hold (paths, NumPy integers) their `str`, and keys
    strings, exactly as `json.dumps(obj, default=str)` would write them."""
    return json.loads(json.dumps(finite(obj), default=str, allow_nan=False))
