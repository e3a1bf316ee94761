"""The `compress` console script: Ctrl-C at any moment, imports included, is exit 130 (and so
is SIGTERM once the command runs).

`cli.main` imports click, torch and the whole library, which takes seconds; a Ctrl-C in that
window used to print a multi-line traceback from deep inside an import, or worse: a library
that swallows the KeyboardInterrupt mid-import (numpy, then scipy) leaves modules half-built
and the command fails later with an unrelated RecursionError. So this module, which imports
nothing heavy, handles SIGINT in two phases:

* while the command's modules import, Ctrl-C ends the process at once (nothing is being
  written yet): `error: interrupted`, exit 130;
* while the command runs, Ctrl-C raises KeyboardInterrupt as usual (so `finally` blocks and
  atomic writes clean up) and is also remembered in `INTERRUPTED`: `cli.main` reports any
  failure that follows an interrupt, or a command that finishes after one, as the interrupt.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

EXIT_INTERRUPTED = 130

# Set by the SIGINT handler while a command runs (see the module docstring).
INTERRUPTED = False


def interrupted(message: str | None = "interrupted") -> None:
    """Report an interrupt in one line (unless already reported) and leave with exit 130.

    Further Ctrl-C are ignored from here on, and the process ends with `os._exit` after
    flushing: interpreter shutdown (atexit hooks of half-imported modules, worker pools) is
    where a second traceback would otherwise come from. Outputs are written atomically
    (models.fileio.atomic_path), so nothing half-written is left to clean up.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        if message:
            sys.stderr.write(f"error: {message}\n")
            if "--json" in sys.argv[1:]:  # the one JSON object a script reads, even here
                import json

                sys.stdout.write(json.dumps({"error": message, "exit_code": EXIT_INTERRUPTED}))
                sys.stdout.write("\n")
        sys.stderr.flush()
        sys.stdout.flush()
    except Exception:  # a closed pipe: the exit code still says it
        pass
    os._exit(EXIT_INTERRUPTED)


def _while_importing(signum, frame) -> None:
    interrupted()


def _while_running(signum, frame) -> None:
    global INTERRUPTED
    INTERRUPTED = True
    raise KeyboardInterrupt


def main() -> None:
    from compresskit._threads import short_spin

    short_spin()  # before torch loads: OpenMP threads spin briefly, then sleep
    # Tables say Δ and ≥: on Windows a redirected stdout or stderr takes the local code page
    # (cp1252), which cannot encode them, and the command failed after writing its files.
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and hasattr(stream, "reconfigure"):
            with contextlib.suppress(ValueError, OSError):
                stream.reconfigure(errors="replace")
    if "TORCH_CPP_LOG_LEVEL" not in os.environ and not os.environ.get("COMPRESS_DEBUG"):
        # torch's C++ log printed a rank's failed rendezvous as 41 lines of stack frames
        # before compress's one-line error; the errors reach Python as exceptions, which
        # compress reports (COMPRESS_DEBUG=1 keeps the C++ log, and shows tracebacks).
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    # A process started with SIGINT ignored (nohup, a shell's background job) keeps it so.
    ours = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if ours:
        signal.signal(signal.SIGINT, _while_importing)
    # SIGTERM too (a scheduler's timeout in the first half second): killed by the signal
    # before, with no line and exit -15; not under torchrun, which stops ranks with it.
    term = (
        signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        and "TORCHELASTIC_RUN_ID" not in os.environ
    )
    if term:
        signal.signal(signal.SIGTERM, _while_importing)
    try:
        from compresskit.cli.main import main as run
    except KeyboardInterrupt:  # a SIGINT that arrived before the handler was set
        interrupted()
    if ours:
        signal.signal(signal.SIGINT, _while_running)
    # SIGTERM (timeout, a job scheduler, `kill`) as Ctrl-C while the command runs: its
    # `finally` blocks remove the temporary output folder it was filling. Killed outright,
    # `shrink` left `.OUT.xxxx/` with half its files beside --out.
    # Not under torchrun: it stops the surviving ranks with SIGTERM when one fails, and
    # each would report that as its own interrupt.
    if term:
        signal.signal(signal.SIGTERM, _while_running)
    try:
        run()
    except KeyboardInterrupt:  # a second Ctrl-C while the first was being reported
        interrupted()
    except SystemExit:
        # The command has said its result (or its error) and written its files: a signal in
        # the second or so of interpreter teardown that follows (torch, ONNX Runtime) killed
        # the process by that signal (exit -15 after a complete --json result), and a second
        # Ctrl-C after an interrupt printed a traceback. The teardown's cleanup (queues, temp
        # folders of worker pools) still runs; only the signals wait for it. Ignored, not
        # handled: finalization puts Python-level handlers back to the default, which kills.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise


if __name__ == "__main__":
    main()
