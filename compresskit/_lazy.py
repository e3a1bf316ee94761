"""Names a package imports on first use (PEP 562): `import compresskit` (or `.compressor`,
`.distrib`) stays instant and loads no torch or ONNX Runtime until a name is asked for.

    _LAZY = {"train": "compresskit.distrib.job", ...}   # name -> the module defining it
    __getattr__, __dir__ = _lazy.exports(__name__, _LAZY, globals())
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def exports(
    package: str, table: dict[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The package's `__getattr__` (imports `table[name]` once, then keeps the value in
    `namespace` so later lookups skip it) and its `__dir__`."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *table})

    return __getattr__, __dir__
