"""The `compress` command: a click group, error -> exit-code mapping and `--json` plumbing.

Exit codes: 0 ok, 1 failure (a stage failed, a peer died), 2 bad usage or bad input,
130 interrupted (Ctrl-C). Every error is one line on stderr; with --json the same error is
also the one JSON object on stdout: {"error": "...", "exit_code": N}.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from compresskit.cli import entry
from compresskit.models import fileio
from compresskit.models.errors import CompressError, StageError
from compresskit.models.jsonable import finite

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class Interrupted(click.ClickException):
    """Ctrl-C, with a message saying what was kept."""

    exit_code = EXIT_INTERRUPTED


class OutPath(click.Path):
    """An output path: a symbolic link there is refused before click's own file/folder checks,
    so the message says what is wrong (compress never writes through a link)."""

    def convert(self, value, param, ctx):  # type: ignore[override]
        from compresskit.models.fileio import link_problem

        problem = link_problem(os.fsdecode(value))
        if problem:
            self.fail(f"{os.fsdecode(value)} {problem}", param, ctx)
        text = os.fsdecode(value)
        if not text.strip():  # Path("") is the working folder: shrink filled it
            self.fail("an empty path; give a file or folder name", param, ctx)
        if not self.dir_okay and text.endswith((os.sep, "/")):
            # Path("newdir/") is "newdir": a file of that name had been written
            self.fail(
                f"{text} ends in a separator (a folder); give a file name, e.g. "
                f"{text.rstrip(os.sep + '/')}/model.pt",
                param,
                ctx,
            )
        given = _also_given(text, param.opts if param is not None else [])
        if given is not None:
            # decode --out the archive, bench --report the checkpoint, --log-file an input:
            # each replaced (or truncated) the very file the command was about to read
            self.fail(
                f"{os.fsdecode(value)} is also given as {given!r} on this command line (an "
                "input, or another output); write to another path",
                param,
                ctx,
            )
        return super().convert(value, param, ctx)


def log_path() -> str | None:
    """The --log-file this command writes, if any."""
    return _State.log.path if _State.log is not None else None


def _other_paths(opts: list[str]) -> Iterator[tuple[str, str]]:
    """(token, path it may name) for each token of the command line other than the value of
    option `opts`: the token, its value after `--flag=`, and the path in a data spec such as
    npz:FILE or mnist:DIR (expanded as data specs are)."""
    argv = _State.argv
    for i, token in enumerate(argv):
        if (i > 0 and argv[i - 1] in opts) or any(token.startswith(f"{o}=") for o in opts):
            continue  # this option's own value
        value = token.split("=", 1)[-1] if token.startswith("--") else token
        spec = value.split(":", 1)
        for candidate in {token, value, *([spec[1]] if spec[0] in ("npz", "mnist") else [])}:
            if candidate:
                yield token, candidate


def _named_again(path: Path, opts: list[str]) -> bool:
    """Whether another token of the command line names `path`, whether or not the file exists
    yet: a path (a folder or a suffix), not a word such as the command, a zoo model or the
    digits data (--log-file train names a file no other option does)."""
    target = os.path.abspath(os.path.expanduser(path))
    return any(
        (os.sep in candidate or "." in os.path.basename(candidate))
        and not candidate.startswith("-")
        and os.path.abspath(os.path.expanduser(candidate)) == target
        for _, candidate in _other_paths(opts)
    )


def _also_given(out: str, opts: list[str]) -> str | None:
    """The command-line token, other than this option's own value, that names the existing
    file `out`, or None."""
    target = Path(out)
    if not target.is_file():
        return None
    for token, candidate in _other_paths(opts):
        try:
            path = Path(candidate).expanduser()
            if path.is_file() and target.samefile(path):
                return token
        except OSError:
            continue
    return None


class _State:
    json = False
    log: _Log | None = None
    argv: list[str] = []  # noqa: RUF012  (the command line, for the log's first line)


# Colour and cursor codes, and the redraws of a live progress bar: on the terminal, not in a log.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_REDRAW = ("\r", "\x1b[2K", "\x1b[1A", "\x1b[?25")


class _Log:
    """--log-file: stands in for sys.stderr, so everything a command says there (rich's
    console, click's errors) also goes to the file, without colour codes or progress-bar
    redraws; plus what only a debug run shows: library warnings and a failure's traceback."""

    def __init__(self, path: str, stream, append: bool = False) -> None:
        self.stream = stream
        self.path = path
        if not append:
            open(path, "w", encoding="utf-8").close()  # a fresh log per command
        # Appending: the ranks a multi-process run spawns write to this file too (child_log),
        # and each line lands at its end instead of over another process's.
        self.file = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    def write(self, text: str) -> int:
        n = self.stream.write(text)
        if not any(code in text for code in _REDRAW):
            self._put(_ANSI.sub("", text))
        return n

    def flush(self) -> None:
        self.stream.flush()
        if self.file is not None:
            try:
                self.file.flush()
            except OSError as e:
                self._broken(e)

    def _put(self, text: str) -> None:
        if self.file is None:
            return
        try:
            self.file.write(text)
        except OSError as e:  # a full disk, a quota: the log is a copy, the command goes on
            self._broken(e)

    def _broken(self, e: OSError) -> None:
        f, self.file = self.file, None
        with contextlib.suppress(OSError):
            f.close()
        self.stream.write(
            f"warning: --log-file {self.path}: cannot write it ({e.strerror or e}); the log "
            "stops here, the command goes on\n"
        )

    def close(self) -> None:
        f, self.file = self.file, None
        if f is not None:
            try:
                f.close()
            except OSError as e:  # the last buffered lines did not fit
                self.stream.write(
                    f"warning: --log-file {self.path}: its end could not be written "
                    f"({e.strerror or e})\n"
                )

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.stream, "encoding", "utf-8")

    def debug(self, text: str) -> None:
        self._put(f"debug: {text.rstrip()}\n")

    def warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        self.debug(warnings.formatwarning(message, category, filename, lineno, line))


def child_log(path: str | None) -> None:
    """In a process the command spawned (a training rank): send what it says on stderr, and
    its warnings, to the command's --log-file `path` as well."""
    if path is None or isinstance(sys.stderr, _Log):
        return
    try:
        _State.log = _Log(path, sys.stderr, append=True)
    except OSError:  # the parent could write it a moment ago; the terminal still shows all
        return
    sys.stderr = _State.log
    if not os.environ.get("COMPRESS_DEBUG"):
        warnings.simplefilter("default")
        warnings.showwarning = _State.log.warning


def _close_log() -> None:
    log, _State.log = _State.log, None
    if log is not None:
        if sys.stderr is log:
            sys.stderr = log.stream
        log.close()


# Names of models, archives and data: never a log's or a report's (writing there replaces them).
MODEL_SUFFIXES = (
    *(".pt", ".pth", ".onnx", ".ort", ".dcz", ".npz", ".npy"),
    *(".ckpt", ".bin", ".safetensors"),  # checkpoints bench and shrink read too
)
LOG_HEAD = "debug: compress "  # the first line every --log-file starts with


def _is_log(path: Path) -> bool:
    """An empty file, or one a --log-file wrote (its first line is the command)."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(LOG_HEAD))
    except OSError:
        return False
    return head in (b"", LOG_HEAD.encode())


def log_option(f):
    """--log-file PATH: a copy of everything stderr shows, plus warnings and tracebacks."""

    def start(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
        if value is not None and _State.log is None:
            if value.exists() and not value.is_file():
                raise click.BadParameter(f"{value} is not a regular file", ctx, param)
            if _named_again(value, param.opts):  # before the log creates it (--out LOG)
                raise click.BadParameter(
                    f"{value} is also given elsewhere on this command line; log to another path",
                    ctx,
                    param,
                )
            # `bench FOLDER --log-file FOLDER/model.int8.onnx` truncated the model it was about
            # to read, then blamed the model: a log replaces only an earlier log (or nothing).
            if value.suffix.lower() in MODEL_SUFFIXES or (value.is_file() and not _is_log(value)):
                raise click.BadParameter(
                    f"{value} exists and is not a compress log"
                    if value.is_file()
                    else f"{value} is named like a model or data file, not a log",
                    ctx,
                    param,
                )
            log = None
            try:
                log = _Log(os.fsdecode(value), sys.stderr)
                # the first line written now: a disk too full for it is refused before any work
                log.file.write(f"debug: compress {' '.join(_State.argv)}\n")
            except OSError as e:
                if log is not None:
                    with contextlib.suppress(OSError):  # its buffer cannot be written either
                        log.file.close()
                raise click.BadParameter(f"{value}: cannot write it ({e.strerror})") from None
            _State.log = log
            sys.stderr = _State.log
            if not os.environ.get("COMPRESS_DEBUG"):  # warnings: to the log, not the terminal
                warnings.simplefilter("default")
                warnings.showwarning = _State.log.warning
        return value

    return click.option(
        "--log-file",
        type=OutPath(dir_okay=False, path_type=Path),
        default=None,
        is_eager=True,
        expose_value=False,
        callback=start,
        help="Also write everything shown on stderr, plus warnings and tracebacks, to this file.",
    )(f)


def json_option(f):
    """--json: print exactly one JSON object on stdout; logs and progress stay on stderr."""

    def remember(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
        _State.json = _State.json or value
        return value

    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        is_eager=True,
        callback=remember,
        help="Print one JSON object on stdout (logs and progress go to stderr).",
    )(f)


def input_name(name: str | None, model_flag: str | None) -> str | None:
    """The model's forward argument, as `compresskit.models.data.input_name` (see there)."""
    from compresskit.models import data

    return data.input_name(name, model_flag)


def emit_json(obj: dict[str, Any]) -> None:
    # NaN and infinity are not JSON: they become null.
    text = json.dumps(finite(obj), indent=2, sort_keys=False, default=str, allow_nan=False)
    try:
        click.echo(text)
    except BrokenPipeError:
        raise  # the reader left early (`| head`): exit 1 quietly, as click does
    except OSError as e:  # `> /dev/full`, a full disk: said once, not two chained tracebacks
        _drop_stdout()
        raise StageError(
            f"stdout: cannot write the JSON result ({e.strerror or e}); the command's files "
            "are written"
        ) from None


def _drop_stdout() -> None:
    """Point stdout at the null device: what is left in its buffer cannot be written, and the
    interpreter's last flush would print an "Exception ignored" traceback for it."""
    with contextlib.suppress(OSError):
        sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115  (for the rest of the process)


class CompressGroup(click.Group):
    """A click group whose errors are one line and whose exit codes are documented.

    `main(args, standalone_mode=False)` is the way to call a command from Python: it returns
    the command's exit code (0) and lets errors propagate as exceptions (`CompressError` with
    its `exit_code`, click's usage errors) instead of printing them and exiting.
    """

    # The commands, each imported when first asked for: registered at import, `import
    # compresskit.cli.bench` on its own failed (bench imports this module, which imported
    # bench back half-made).
    LAZY = {  # noqa: RUF012
        "train": ("train", "train"),
        "shrink": ("shrink", "shrink"),
        "decode": ("shrink", "decode"),
        "demo": ("demo", "demo"),
        "bench": ("bench", "bench"),
        "plan": ("plan", "plan"),
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(self.commands) | set(self.LAZY))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.commands and name in self.LAZY:
            import importlib

            module, attr = self.LAZY[name]
            found = getattr(importlib.import_module(f"compresskit.cli.{module}"), attr)
            self.add_command(found, name)
        return self.commands.get(name)

    def main(self, args=None, prog_name=None, complete_var=None, **extra):  # type: ignore[override]
        argv = list(sys.argv[1:] if args is None else args)
        _State.argv = argv
        prog_name = prog_name or "compress"
        standalone = extra.pop("standalone_mode", True)
        # Shell completion (_COMPRESS_COMPLETE=bash_source compress): click answers and exits.
        self._main_shell_completion(extra, prog_name, complete_var)
        try:
            return self._run(argv, prog_name, standalone, **extra)
        finally:
            _close_log()

    def _run(self, argv, prog_name, standalone, **extra):
        if not standalone:
            with warnings.catch_warnings():
                if not os.environ.get("COMPRESS_DEBUG"):
                    warnings.simplefilter("ignore")
                rv = super().main(argv, prog_name, standalone_mode=False, **extra)
            return rv if isinstance(rv, int) else EXIT_OK
        # Known before parsing, so a parse error also comes back as JSON.
        _State.json = "--json" in argv
        if not argv:  # bare `compress`: the help, not an error
            click.echo(self.get_help(click.Context(self, info_name=prog_name)))
            sys.exit(EXIT_OK)
        for token in argv:
            if not fileio.is_utf8(token):
                # torch.load, ONNX's checker and ONNX Runtime take paths as UTF-8: such a name
                # was "truncated, corrupt" to shrink, or failed after the whole run
                _fail(
                    f"{token!r} is not UTF-8: torch, ONNX and ONNX Runtime read file names as "
                    "UTF-8; rename it",
                    EXIT_USAGE,
                )
        try:
            with warnings.catch_warnings():
                # Library warnings (torch's among them) would break the one-line contract
                # (--log-file, parsed inside, keeps them in its file: see log_option).
                if not os.environ.get("COMPRESS_DEBUG"):
                    warnings.simplefilter("ignore")
                rv = super().main(argv, prog_name, standalone_mode=False, **extra)
        except click.UsageError as e:  # bad flag or value: one line, with the fix
            where = f"{e.ctx.command_path}: " if e.ctx else ""
            hint = f" (see '{e.ctx.command_path} --help')" if e.ctx else ""
            _fail(f"{where}{e.format_message()}{hint}", EXIT_USAGE)
        except click.ClickException as e:
            _fail(e.format_message(), e.exit_code)
        except CompressError as e:
            _fail(str(e), e.exit_code)
        except (click.Abort, KeyboardInterrupt):
            _fail("interrupted", EXIT_INTERRUPTED)
        except Exception as e:  # not foreseen: still one line and a JSON object, exit 1
            if entry.INTERRUPTED:  # a library swallowed the Ctrl-C and then failed
                _fail("interrupted", EXIT_INTERRUPTED)
            if os.environ.get("COMPRESS_DEBUG"):
                raise
            # what a command added on the way out (shrink: the work it kept for --resume)
            notes = "".join(n for n in getattr(e, "__notes__", ()) if isinstance(n, str))
            if (reason := fileio.machine_failure(e)) is not None:  # the machine's, not ours
                where = f" writing {e.filename}" if getattr(e, "filename", None) else ""
                _fail(
                    f"{reason}{where}; free space (or memory) and run it again{notes}",
                    EXIT_FAILURE,
                )
            detail = (str(e).strip().splitlines() or [""])[0]
            _fail(
                f"{type(e).__name__}: {detail} (unexpected; COMPRESS_DEBUG=1 shows the traceback)"
                + notes,
                EXIT_FAILURE,
            )
        if entry.INTERRUPTED:  # a library swallowed the Ctrl-C and the command went on
            _fail("interrupted", EXIT_INTERRUPTED)
        _exit(rv if isinstance(rv, int) else EXIT_OK)


def _fail(message: str, code: int) -> None:
    message = " ".join(message.split())  # one line, whatever the library wrapped
    if _State.log is not None and sys.exc_info()[0] is not None:
        _State.log.debug(traceback.format_exc())  # the log keeps what COMPRESS_DEBUG shows
    click.echo(f"error: {message}", err=True)
    if _State.json:
        with contextlib.suppress(CompressError):  # stdout cannot take it: the line above
            emit_json({"error": message, "exit_code": code})  # said it
    _exit(code)


def _exit(code: int) -> None:
    """Leave with `code`. A rank that torchrun started leaves without the interpreter's
    teardown, as the ranks `distrib.launch` spawns do: gloo's C++ threads destroyed there
    abort a finished process now and then (SIGABRT, "terminate called without an active
    exception"), and torchrun then counts a rank that finished its work as failed while the
    other machines' agents wait out their 300 s exit barrier for it. Everything this command
    writes is written (atomically) and flushed by now."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    sys.exit(code)


@click.group(cls=CompressGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="compresskit", prog_name="compress")
def cli() -> None:
    """compress: train a big model, shrink it (Deep Compression + distillation), ship INT8 ONNX.

    \b
    Quick start:
      compress train --model lenet300 --data digits --epochs 10

    Exit codes: 0 ok, 1 failure, 2 bad usage or input, 130 interrupted.
    COMPRESS_DEBUG=1 shows tracebacks and warnings.
    """


def main(args: list[str] | None = None, standalone_mode: bool = True) -> int | None:
    """The console script; from Python, `main([...], standalone_mode=False)` returns the exit
    code and raises errors instead of printing them and exiting."""
    return cli.main(args, prog_name="compress", standalone_mode=standalone_mode)
