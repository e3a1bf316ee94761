"""Checks that run on a file from outside *before* a parser or loader is allowed to allocate.

The readers (`models.data` for `.npz`, `models.checkpoint` for `.pt`, `compress bench` for
`.onnx`) call these first; each refuses a crafted file with one `InputError` line that names the
file and the fix, using only what the file declares (a zip directory, a pickle's opcodes, an ONNX
proto without its external data) and never the data itself.

    zip_directory           members of a zip (.npz, torch.save): names, declared sizes, layout
    pickle_storages         the storages a torch pickle declares (type, element count), read
                            by an unpickler that never imports or calls anything
    check_onnx_external_data  ONNX external-data locations must stay inside the model's folder
"""

from __future__ import annotations

import io
import ntpath
import os
import pickle
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from compresskit.models.errors import InputError


def _size(n: int) -> str:
    """Bytes for a message: 3,221,225,472 bytes (3.0 GiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n:,} bytes ({n / scale:.1f} {unit})"
    return f"{n:,} bytes"


# --- zip directories (.npz, torch.save) ----------------------------------------------------


def zip_directory(
    path: Path, label: str, fix: str, unreadable: str | None = None
) -> list[zipfile.ZipInfo]:
    """The members of the zip at `path`, after checking what the directory declares.

    Refused before any member is read: a member whose compressed data would lie outside the
    file, a stored member whose two sizes differ, and members whose data overlap (their
    compressed sizes add up to more than the file: one stretch of data counted many times, the
    "non-recursive" zip bomb). `label` starts each message (e.g. "--data 'npz:f.npz': f.npz"),
    `fix` ends it; `unreadable` replaces the message when the directory cannot be read at all.
    """
    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise InputError(
            unreadable or f"{label}: not a readable zip archive ({e}); {fix}"
        ) from None
    total = 0
    for info in infos:
        if info.header_offset < 0 or info.header_offset + info.compress_size > size:
            raise InputError(
                f"{label}: member {info.filename} claims {_size(info.compress_size)} of data "
                f"that lie outside the {size:,}-byte file: it is truncated or crafted; {fix}"
            )
        if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
            raise InputError(
                f"{label}: stored member {info.filename} declares {_size(info.file_size)} "
                f"but holds {_size(info.compress_size)}: the zip directory is damaged or "
                f"crafted; {fix}"
            )
        total += info.compress_size
    if total > size:
        raise InputError(
            f"{label}: its members' data add up to {_size(total)}, more than the whole "
            f"{size:,}-byte file: members overlap (a zip bomb) or the file is cut short; {fix}"
        )
    return infos


# --- pickles (torch.save, zip and legacy) --------------------------------------------------


@dataclass(frozen=True)
class Storage:
    """One storage a torch pickle declares: its key, type name, element size and count."""

    key: str
    type_name: str
    itemsize: int  # 1 when the type is unknown: the smallest a declared element can take
    numel: int

    @property
    def nbytes(self) -> int:
        return self.itemsize * self.numel


class _Stub:
    """What every global of a scanned pickle becomes: accepts any arguments, does nothing."""

    _where = ("", "")

    def __new__(cls, *args: Any, **kwargs: Any) -> _Stub:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Stub:
        return _Stub()

    # What the unpickler calls to fill a container that is not a plain dict, list or set
    # (an OrderedDict state_dict, for one): accepted and dropped.
    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass

    def add(self, item: Any) -> None:
        pass


class _Scanner(pickle.Unpickler):
    """An unpickler that imports nothing and calls nothing: each global is a fresh `_Stub`
    subclass, each persistent id is recorded. Its work and memory are linear in the pickle."""

    def __init__(self, file: BinaryIO) -> None:
        super().__init__(file)
        self.pids: list[tuple] = []
        self._types: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> type:
        key = (str(module), str(name))
        if key not in self._types:
            self._types[key] = type("Stub", (_Stub,), {"_where": key})
        return self._types[key]

    def persistent_load(self, pid: Any) -> _Stub:
        if isinstance(pid, tuple):
            self.pids.append(pid)
        return _Stub()


class _Bounded(io.RawIOBase):
    """A read-only view of an open file that never asks for more than is left of it: a
    pickle opcode declaring a 2^60-byte string costs a short read, not a 2^60-byte buffer."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f, self.left = f, size

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        n = self.left if n is None or n < 0 else min(n, self.left)
        data = self.f.read(n)
        self.left -= len(data)
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def readline(self, limit: int = -1) -> bytes:
        limit = self.left if limit is None or limit < 0 else min(limit, self.left)
        line = self.f.readline(limit)
        self.left -= len(line)
        return line


# Bytes per element of the storage classes torch.save names in its pickles.
_ITEMSIZE = {
    "DoubleStorage": 8,
    "FloatStorage": 4,
    "HalfStorage": 2,
    "BFloat16Storage": 2,
    "LongStorage": 8,
    "IntStorage": 4,
    "ShortStorage": 2,
    "CharStorage": 1,
    "ByteStorage": 1,
    "BoolStorage": 1,
    "ComplexDoubleStorage": 16,
    "ComplexFloatStorage": 8,
    "QInt32Storage": 4,
}


def _itemsize(module: str, name: str) -> int:
    return _ITEMSIZE.get(name, 1) if module == "torch" else 1


def scan_pickles(f: BinaryIO, size: int, count: int) -> list[tuple[Any, list[Storage]]]:
    """Scan `count` consecutive pickles in `f` (at most `size` bytes from here): for each, the
    value it unpickles to (every global a stub) and the storages it declares as persistent ids
    ('storage', type, key, location, numel, ...).

    Raises `pickle.UnpicklingError` (or another exception) when the bytes are not pickles: the
    caller then leaves the diagnosis to the real loader.
    """
    src = _Bounded(f, size)
    out: list[tuple[Any, list[Storage]]] = []
    for _ in range(count):
        scanner = _Scanner(src)
        value = scanner.load()
        storages = []
        for pid in scanner.pids:
            if len(pid) >= 5 and pid[0] == "storage" and isinstance(pid[4], int):
                module, name = getattr(pid[1], "_where", ("", ""))
                storages.append(
                    Storage(str(pid[2]), f"{module}.{name}", _itemsize(module, name), pid[4])
                )
        out.append((value, storages))
    return out


# --- ONNX external data --------------------------------------------------------------------


def _tensors_with_external_data(model: Any) -> Iterator[Any]:
    """Every TensorProto in the model (initializers, sparse initializers, attribute tensors,
    subgraphs, functions, training graphs) whose data lives in an external file. Walks the
    message tree without recursion and never touches a tensor's own bytes."""
    from onnx import TensorProto

    stack = [model]
    while stack:
        msg = stack.pop()
        if isinstance(msg, TensorProto):
            if msg.data_location == TensorProto.EXTERNAL:
                yield msg
            continue
        for fd in msg.DESCRIPTOR.fields:
            if fd.message_type is None:
                continue
            repeated = getattr(fd, "is_repeated", None)  # protobuf >= 5.29; `label` before
            if repeated is None:
                repeated = fd.label == fd.LABEL_REPEATED
            if repeated:
                stack.extend(getattr(msg, fd.name))
            elif msg.HasField(fd.name):
                stack.append(getattr(msg, fd.name))


def external_data_bytes(model: Any, folder: str | os.PathLike) -> int:
    """Bytes of the external data files an ONNX model (loaded without them) keeps its tensors
    in, each file counted once: with the model file, what an app ships.
    (`check_onnx_external_data` has refused locations outside the model's folder.)"""
    locations = {
        e.value
        for tensor in _tensors_with_external_data(model)
        for e in tensor.external_data
        if e.key == "location"
    }
    files = [Path(folder) / location for location in locations]
    return sum(f.stat().st_size for f in files if f.is_file())


def check_onnx_external_data(path: str | os.PathLike) -> None:
    """Refuse an ONNX file whose external data would be read from outside its own folder.

    Reads the model proto without its external data, then every tensor stored externally
    must name a relative `location` that resolves (symlinks followed) inside the folder that
    holds the model. A file that does not parse is left to the loader that follows, which
    reports it in its own words.
    """
    import onnx

    path = Path(path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # not ONNX, or damaged: the real loader says so
        return
    folder = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    fix = (
        "keep the external data files beside the model and name them by relative paths, "
        "e.g. onnx.save(model, path, save_as_external_data=True, location='weights.bin')"
    )
    for tensor in _tensors_with_external_data(model):
        entries = {e.key: e.value for e in tensor.external_data}
        location = entries.get("location", "")
        where = f"{path}: tensor {tensor.name!r} keeps its data in external file {location!r}"
        if not location:
            raise InputError(
                f"{path}: tensor {tensor.name!r} is stored externally but names no location; "
                f"the model is damaged; {fix}"
            )
        if (
            os.path.isabs(location)
            or ntpath.isabs(location)
            or ntpath.splitdrive(location)[0]
            or location.startswith(("\\", "/"))
        ):
            raise InputError(f"{where}, an absolute path; refused: {fix}")
        try:
            target = os.path.realpath(os.path.join(folder, location))
        except (ValueError, OSError):  # a NUL byte, a name too long
            raise InputError(f"{where}, which is not a usable path; refused: {fix}") from None
        inside = _within(folder, target) and target != folder
        if not inside:
            lexical = os.path.normpath(os.path.join(folder, location))
            how = (
                f"a link to {target}, outside the model's folder {folder}"
                if _within(folder, lexical)
                else f"outside the model's folder {folder}"
            )
            raise InputError(f"{where}, {how}; refused: {fix}")


def _within(folder: str, path: str) -> bool:
    """Whether `path` lies in `folder` (on Windows, another drive does not: commonpath raises
    ValueError there, which was an unexpected error for a crafted file)."""
    try:
        return os.path.commonpath([folder, path]) == folder
    except ValueError:
        return False
