"""The error hierarchy every layer raises and the CLI maps to exit codes.

It lives in `models/`, the bottom of the dependency graph (cli -> compressor|distrib -> models),
so `compressor` and `distrib` can both raise the same errors without importing each other.

    CompressError            anything the tool reports as one line      -> exit 1
    ├── InputError           the user's file, flag or data is wrong     -> exit 2
    └── StageError           a stage ran and failed (diverged, a peer died, a check failed) -> exit 1
        └── MachineError     the machine failed it (a full disk, memory)           -> exit 1

Messages are one line that names the file or flag and says how to fix it.
"""

from __future__ import annotations


class CompressError(Exception):
    """Base class: a failure the CLI reports as a one-line message (exit 1)."""

    exit_code = 1


class InputError(CompressError):
    """Bad user input: a file, a flag, a data set or a recipe (exit 2)."""

    exit_code = 2


class StageError(CompressError):
    """A stage ran and failed, through no fault of the input (exit 1)."""

    exit_code = 1


class MachineError(StageError):
    """The machine failed the run (a full disk, memory): never softened into a missing
    deliverable, as a tool's failure on a graph may be (exit 1)."""


def one_line(e: BaseException, limit: int = 300) -> str:
    """A foreign exception's text (torch, ORT, torch-pruning: often many lines) as one line of
    at most about `limit` characters, to quote inside our own one-line messages. A longer text
    keeps its start and its end: ONNX Runtime puts the reason after a long C++ signature or
    path ("... Unsupported model IR version: 99, max supported IR version: 14")."""
    text = " ".join(str(e).split())
    if len(text) <= limit:
        return text
    half = (limit - 5) // 2
    return f"{text[:half]} ... {text[-half:]}"


def brief(value: object, limit: int = 80) -> str:
    """`value` for an error message: its repr when short, else its type ("a Tensor"): a
    tensor's or a module's repr runs to pages."""
    text = repr(value)
    if len(text) <= limit and "\n" not in text:
        return text
    return f"a {type(value).__name__}"
