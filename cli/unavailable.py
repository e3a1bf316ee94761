"""Commands whose stages have not landed yet: they say so and exit 2."""

from __future__ import annotations

import click

from models.errors import InputError

_PLANNED = {
    "bench": (
        "Latency, throughput, size and accuracy of PyTorch FP32, ONNX FP32 and ONNX INT8.",
        "compress bench shrunk/ --data digits",
    ),
}


def _make(name: str, about: str, example: str) -> click.Command:
    @click.command(
        name,
        help=f"{about} (not yet available)\n\n\b\nExample:\n  {example}",
        context_settings={"ignore_unknown_options": True},
    )
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def command(args: tuple[str, ...]) -> None:
        raise InputError(f"'compress {name}' is not yet available in this version")

    return command


COMMANDS = [_make(name, about, example) for name, (about, example) in _PLANNED.items()]
