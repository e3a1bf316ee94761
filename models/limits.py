"""Limits on what a file from outside may make `compress` allocate or parse.

Every reader (`.dcz` archives, checkpoints, `.npz` data, recipes) checks the sizes a file
declares against these limits and against the file's own length *before* allocating: a crafted
file is refused with one line, it never crashes, hangs or balloons memory.

`max_elements()` is the cap on the total number of tensor elements one file may declare (all
tensors together): 2^31 by default (8 GiB of float32, far above any model `compress` ships to a
phone), raised for a huge model with the environment variable ``COMPRESS_MAX_ELEMENTS`` or the
``--max-elements`` flag of the commands that read archives and checkpoints.
"""

from __future__ import annotations

import os

from compresskit.models.errors import InputError

DEFAULT_MAX_ELEMENTS = 2**31
ENV_MAX_ELEMENTS = "COMPRESS_MAX_ELEMENTS"

# Nesting of any JSON/TOML/YAML document we parse (recipes, archive headers): a recipe is
# three levels deep, a model spec's kwargs a few more.
MAX_NESTING = 32


def max_elements() -> int:
    """The element cap in force: ``COMPRESS_MAX_ELEMENTS`` if set, else 2^31."""
    raw = os.environ.get(ENV_MAX_ELEMENTS)
    if raw is None or raw == "":
        return DEFAULT_MAX_ELEMENTS
    try:
        value = int(raw.replace("_", ""))
    except ValueError:
        value = 0
    if value <= 0:
        raise InputError(
            f"{ENV_MAX_ELEMENTS}={raw!r}: give a positive whole number, e.g. 8589934592 (2^33)"
        )
    return value


def nesting_depth(obj: object, limit: int = MAX_NESTING) -> int:
    """Depth of nested dicts/lists in a parsed tree (JSON, TOML), counted without recursion.

    Stops counting past ``limit``, so a hostile document costs no more than its size. A YAML
    document with aliases is a graph whose paths can be exponentially many: refuse aliases
    before calling this (`compressor.recipe` does).
    """
    deepest = 0
    stack: list[tuple[object, int]] = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((c, depth + 1) for c in children)
    return deepest
