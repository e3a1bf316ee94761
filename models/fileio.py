"""Atomic file writes: an interrupted write never leaves a half-written output behind.

Everything `compress` writes (checkpoints, archives, ONNX files, reports) goes through
`atomic_path`: the caller writes a temporary file in the destination folder, which is renamed
over the destination only when the block finishes without an exception (`os.replace` is atomic
on POSIX and Windows when both paths are on one file system, hence the same folder).

An output path that is a symbolic link is refused, never written through: a link planted at
`--out` would otherwise make `compress` replace whatever file it points to. (Links among the
parent folders are the user's own layout and are followed.)
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import socket
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from compresskit.models.errors import InputError, MachineError, StageError

# The machine's failures, not the input's: a full disk or quota, a read-only remount, an I/O
# error. They fail the run (exit 1) with what happened, never read as a model problem.
MACHINE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})
# torch.save and ONNX Runtime report a full disk as their own C++ errors ("unexpected pos
# 368704 vs 368596", "basic_ios::clear", "Failed to save"): less than this free where the
# failed write went is read as the disk being full.
NEARLY_FULL_BYTES = 1 << 20


def machine_failure(e: BaseException, folder: str | os.PathLike | None = None) -> str | None:
    """What went wrong when `e` is the machine's (out of memory, disk full, I/O), else None.
    `folder`: where the failed write went, to recognise a full disk behind a library's own
    error text."""
    if isinstance(e, MemoryError):
        return "out of memory"
    if isinstance(e, OSError) and e.errno in MACHINE_ERRNOS:
        return (e.strerror or os.strerror(e.errno)).lower()
    if folder is not None and isinstance(e, Exception) and nearly_full(folder):
        return "no space left on device"
    return None


def nearly_full(folder: str | os.PathLike) -> bool:
    """Less than `NEARLY_FULL_BYTES` free where `folder` lies (False where that cannot be
    read): what a library's own words for a failed write mean there."""
    try:
        return shutil.disk_usage(folder).free < NEARLY_FULL_BYTES
    except OSError:
        return False


def cannot_write(path: str | os.PathLike, reason: str) -> MachineError:
    """The machine's failure to write `path`, named by the folder the user knows it by."""
    return MachineError(
        f"cannot write {Path(path).name} in {visible_folder(path)}: {reason}; free space there "
        "or write elsewhere"
    )


def visible_folder(path: str | os.PathLike) -> Path:
    """The folder a user knows `path` by: above the hidden staging folders (`.out.host-pid.x`)
    that outputs are written in before they are renamed into place."""
    folder = Path(os.path.abspath(path)).parent
    while folder.name.startswith(".") and folder.parent != folder:
        folder = folder.parent
    return folder


# Hidden names made from an output's name (`.NAME.xxxx.tmp`, `.NAME.lock`, shrink's staging
# folder) add up to 30 bytes: a legal 243-byte name was refused as "not writable". They carry
# the name's first bytes only.
HIDDEN_NAME_BYTES = 120


def hidden(name: str) -> str:
    """`.NAME` for temporary files and folders beside NAME; a longer name keeps its first
    `HIDDEN_NAME_BYTES` bytes (whole UTF-8 characters) and a digest of the whole, so that the
    suffixes fit the file system's 255 bytes and two long names that differ only at their
    ends (a sweep's `..._seed1.pt`, `..._seed2.pt`) never share a lock or a staging folder."""
    raw = os.fsencode(name)
    if len(raw) <= HIDDEN_NAME_BYTES:
        return f".{name}"
    cut = os.fsdecode(raw[:HIDDEN_NAME_BYTES]).encode("utf-8", "ignore").decode("utf-8")
    return f".{cut}~{hashlib.sha1(raw).hexdigest()[:10]}"


def is_utf8(name: str | os.PathLike) -> bool:
    """Whether a name (a path, a command-line word) is valid UTF-8: on POSIX, undecodable bytes
    in a file name reach Python as lone surrogates, which torch, ONNX and ONNX Runtime cannot
    pass to their C++ file functions."""
    try:
        os.fspath(name).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def utf8_path(path: str | os.PathLike, flag: str = "") -> None:
    """Refuse a path that is not UTF-8, naming it (with `flag`) and the fix."""
    if not is_utf8(path):
        where = f"{flag} " if flag else ""
        raise InputError(
            f"{where}{os.fspath(path)!r} is not UTF-8: torch, ONNX and ONNX Runtime read file "
            "names as UTF-8; rename it"
        )


def check_writable(
    path: str | os.PathLike,
    flag: str = "--out",
    inputs: Iterable[str | os.PathLike] = (),
    replace: bool = True,
) -> Path:
    """Fail early, before any long work, when `path` cannot be written, or is one of the
    files the same call reads (`inputs`: writing there would replace it), or exists and
    `replace` is False (the command's --force not given).

    Probes by creating a file rather than with `os.access`, which says yes to root for
    read-only mounts and no for ACL-granted users.
    """
    refuse_link(path, flag)
    utf8_path(path, flag)
    path = Path(os.path.abspath(path))
    for given in inputs:
        if path.is_file() and same_file(path, given):
            raise InputError(
                f"{flag} {path}: is the input {os.fspath(given)} this call reads; writing "
                "there would replace it: give another path"
            )
    parent = path.parent
    if path.exists() and not path.is_file() and not path.is_dir():
        raise InputError(f"{flag} {path}: exists and is not a regular file; choose another path")
    if path.is_dir():
        raise InputError(f"{flag} {path}: is a folder; give a file name, e.g. {path / 'model.pt'}")
    if path.exists() and not replace:
        raise InputError(
            f"{flag} {path}: exists; pass --force (force=True) to replace it, or another path"
        )
    if not parent.exists():
        raise InputError(f"{flag} {path}: folder {parent} does not exist; create it first")
    if not parent.is_dir():
        raise InputError(f"{flag} {path}: {parent} is not a folder")
    check_folder_writable(parent, f"{flag} {path}")
    return path


def check_folder_writable(folder: Path, what: str) -> None:
    """Fail unless a file can be created in `folder` (probed, then removed); `what` starts the
    message: the flag and the path the user gave."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".compress.", suffix=".probe", dir=folder)
    except OSError as e:
        raise InputError(
            f"{what}: folder {folder} is not writable ({e.strerror}); choose another"
        ) from None
    os.close(fd)
    os.unlink(probe)


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether `a` and `b` are one existing file (through links and different spellings)."""
    try:
        return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)
    except OSError:
        return False


def link_problem(path: str | os.PathLike) -> str | None:
    """Why `path` may not be written, when it is itself a symbolic link; else None."""
    if not os.path.islink(path):
        return None
    return (
        f"is a symbolic link (to {os.readlink(path)}); compress never writes through a link: "
        "remove it or give another path"
    )


def refuse_link(path: str | os.PathLike, flag: str = "") -> None:
    """InputError if `path` itself is a symbolic link (to a file, a folder, or nothing)."""
    problem = link_problem(path)
    if problem:
        raise InputError(f"{flag} {path}: {problem}" if flag else f"{path}: {problem}")


def umask() -> int:
    """The process umask (read without changing it for longer than a call)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; rename it onto `path` if the block succeeds.

    On any exception (KeyboardInterrupt included) the temporary file is removed and `path`
    keeps whatever it held before.
    """
    refuse_link(path)
    path = Path(os.path.abspath(path))
    if path.exists() and not path.is_file():
        raise InputError(f"{path}: exists and is not a regular file; refusing to replace it")
    fd, tmp = tempfile.mkstemp(prefix=f"{hidden(path.name)}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:  # flush to disk before the rename makes it visible
            os.fsync(f.fileno())
        os.chmod(tmp_path, 0o666 & ~umask())  # mkstemp makes 0600; give the usual mode
        os.replace(tmp_path, path)
    except BaseException as e:
        reason = machine_failure(e, path.parent)  # before the temporary file frees its room
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        if reason is not None and not isinstance(e, StageError | InputError):
            raise cannot_write(path, reason) from e
        raise


@contextlib.contextmanager
def output_lock(out: str | os.PathLike) -> Iterator[bool]:
    """Hold `out` for this run: a second run writing the same output (a checkpoint, a shrink
    folder) is refused at once, not left to replace the first one's files unasked when both
    finish. The lock is `flock` on a hidden `.NAME.lock` beside `out`, which holds the owner
    (host-pid) and is removed at the end; the kernel drops a lock whose process died, so a
    file left by a killed run locks nothing. Where `flock` is missing (Windows) or refused
    (some network file systems), the block runs unlocked, as before. Yields whether it holds
    the lock."""
    try:
        import fcntl
    except ImportError:
        yield False
        return
    out = Path(os.path.abspath(out))
    lock = out.parent / f"{hidden(out.name)}.lock"
    fd = _take_lock(fcntl, lock, out)
    if fd is None:  # no flock here, or no way to open the file: unlocked, as before
        yield False
        return
    try:
        with contextlib.suppress(OSError):  # who holds it: only for the other run's message
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{socket.gethostname()}-{os.getpid()}".encode(), 0)
        yield True
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)  # before the lock is let go, so no one locks a removed file
        os.close(fd)


def _take_lock(fcntl, lock: Path, out: Path) -> int | None:
    """The locked descriptor of `lock`, None where it cannot be had (no flock, no right to
    open it); InputError naming the holder when another run holds it."""
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | nofollow, 0o666 & ~umask())
        except PermissionError:  # another user's lock file: flock needs only a read
            try:
                fd = os.open(lock, os.O_RDONLY | nofollow)
            except OSError:
                return None
        except OSError:  # a link planted there, a read-only folder
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
                raise InputError(
                    f"{out}: another compress run ({holder}) is writing it; wait for it to end "
                    "or write elsewhere"
                ) from None
            except OSError:  # a file system without flock
                os.close(fd)
                return None
            try:  # still the file at that path, not one a finishing run has just removed
                if os.fstat(fd).st_ino == os.stat(lock, follow_symlinks=False).st_ino:
                    return fd
            except FileNotFoundError:
                pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


@contextlib.contextmanager
def scratch_cwd() -> Iterator[None]:
    """Run the block in a fresh temporary working folder, then return and delete it. For third-
    party code that writes into the working folder: ONNX Runtime's symbolic shape inference,
    when it gives up on a graph, saves `sym_shape_infer_temp.onnx` and a UUID-named `.data`
    file there, which littered the user's folder (and a checkout) on every such model. Paths
    given to the block must be absolute."""
    old = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="compress-", ignore_cleanup_errors=True) as tmp:
        os.chdir(tmp)
        try:
            yield
        finally:
            os.chdir(old)


PLOT_FORMATS = ("png", "svg", "pdf")


def check_plot_path(path: str | os.PathLike) -> str:
    """The image format a --plot path names by its suffix (png, svg or pdf); InputError for
    another (a .jpg or .xyz path received PNG bytes)."""
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in PLOT_FORMATS:
        raise InputError(
            f"--plot {path}: give a .png, .svg or .pdf file name (the suffix picks the format)"
        )
    return suffix


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block ends, then arrive as they would have: for a few
    renames that must all happen or none. Held by Python handlers, not a signal mask: a
    process-directed signal goes to any thread that does not mask it (torch's pools), and
    Python still runs its handler in the main thread at once. A no-op off the main thread."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    wanted = [signal.SIGINT, signal.SIGTERM]
    before = {s: signal.signal(s, lambda signum, frame: pending.append(signum)) for s in wanted}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        if pending:
            signal.raise_signal(pending[0])
