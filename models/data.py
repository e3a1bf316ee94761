"""Data sets behind `--data SPEC`, loaded into memory as float32 tensors in [0, 1].

Specs
    digits          scikit-learn's bundled 8x8 digits (1,797 images; nothing is downloaded)
    digits:28       the same, resized to 28x28 (bilinear), e.g. for LeNet-5's Caffe geometry
    mnist:DIR       MNIST IDX files in DIR, gzipped or raw
    npz:FILE        a NumPy .npz with arrays x, y and optionally x_test, y_test

Splits are fixed so every run and every stage sees the same test set, whatever `--seed` says:
    digits          stratified 80/20 split with scikit-learn, random_state=0 (1,437 / 360)
    mnist           train-* files for training and t10k-* for test; when only the t10k files
                    exist, image i is a test image when i % 5 == 4 (8,000 train / 2,000 test,
                    drawn evenly from both halves of t10k, which differ in writers)
    npz             x_test/y_test when present, else every 5th sample (i % 5 == 4) is test

Images are (N, C, H, W); (N, H, W) gains a channel and (N, F) features become (N, 1, 1, F).
Unsigned integer pixels are scaled by their type's maximum (uint8 / 255), signed ones (0..255)
by 255, digits by 16; float arrays are used as given. npz labels are classes 0..K-1, each
present in the training split.
"""

from __future__ import annotations

import gzip
import io
import math
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from models.errors import InputError

SPECS_HELP = "digits, digits:28, mnist:DIR or npz:FILE"
MAX_CLASSES = 100_000


@dataclass(frozen=True)
class Dataset:
    """An in-memory classification data set with a fixed train/test split."""

    spec: str
    x_train: torch.Tensor  # float32 (N, C, H, W)
    y_train: torch.Tensor  # int64 (N,)
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    @property
    def in_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    def describe(self) -> str:
        c, h, w = self.in_shape
        return (
            f"{self.spec}: {len(self.y_train)} train / {len(self.y_test)} test, "
            f"{c}x{h}x{w}, {self.num_classes} classes"
        )


def load(spec: str) -> Dataset:
    """Load the data set a `--data` spec names; errors name the spec and the problem."""
    kind, sep, arg = spec.partition(":")
    if kind == "digits":
        side = _parse_side(spec, arg) if sep else 8
        return _digits(spec, side)
    if kind in ("mnist", "npz") and not arg:
        raise InputError(
            f"--data {spec!r}: {kind} needs a path, e.g. {kind}:{'DIR' if kind == 'mnist' else 'FILE.npz'}"
        )
    if kind == "mnist":
        return _mnist(spec, Path(arg).expanduser())
    if kind == "npz":
        return _npz(spec, Path(arg).expanduser())
    raise InputError(f"--data {spec!r}: unknown data spec; use {SPECS_HELP}")


def _parse_side(spec: str, arg: str) -> int:
    if not arg.isdigit() or not 8 <= int(arg) <= 256:
        raise InputError(f"--data {spec!r}: digits takes a side length 8..256, e.g. digits:28")
    return int(arg)


def _digits(spec: str, side: int) -> Dataset:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = bunch.images.astype(np.float32) / 16.0
    y = bunch.target.astype(np.int64)
    idx_train, idx_test = train_test_split(
        np.arange(len(y)), test_size=0.2, random_state=0, stratify=y
    )
    xt = torch.from_numpy(x).unsqueeze(1)
    if side != 8:
        xt = torch.nn.functional.interpolate(
            xt, size=(side, side), mode="bilinear", align_corners=False
        ).clamp_(0.0, 1.0)
    yt = torch.from_numpy(y)
    i_tr, i_te = torch.from_numpy(idx_train), torch.from_numpy(idx_test)
    return _checked(spec, xt[i_tr], yt[i_tr], xt[i_te], yt[i_te])


# --- MNIST IDX ------------------------------------------------------------------------------
# IDX: 2 zero bytes, a type byte (0x08 = uint8), a rank byte, rank big-endian uint32 sizes,
# then the data (http://yann.lecun.com/exdb/mnist/). Images are rank 3, labels rank 1.


def read_idx(path: Path, rank: int) -> np.ndarray:
    """Read one IDX file (gzip detected by its magic bytes) as a uint8 array."""
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise InputError(f"{path}: cannot read ({e}); is it a complete IDX(.gz) file?") from None
    if len(raw) < 4 or raw[:2] != b"\0\0" or raw[2] != 0x08 or raw[3] != rank:
        want = f"00 00 08 {rank:02x}"
        raise InputError(
            f"{path}: not an IDX file of rank {rank} (magic {raw[:4].hex(' ')}, want {want})"
        )
    header = 4 + 4 * rank
    if len(raw) < header:
        raise InputError(f"{path}: truncated IDX header")
    dims = struct.unpack(f">{rank}I", raw[4:header])
    expected = header + math.prod(dims)
    if len(raw) != expected:
        raise InputError(
            f"{path}: truncated or padded IDX file ({len(raw)} bytes, header says {expected})"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _find(folder: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def _mnist_pair(spec: str, folder: Path, prefix: str) -> tuple[np.ndarray, np.ndarray] | None:
    img = _find(folder, f"{prefix}-images-idx3-ubyte")
    lab = _find(folder, f"{prefix}-labels-idx1-ubyte")
    if img is None and lab is None:
        return None
    if img is None or lab is None:
        missing = f"{prefix}-{'images-idx3' if img is None else 'labels-idx1'}-ubyte[.gz]"
        raise InputError(f"--data {spec!r}: {missing} is missing in {folder}")
    x, y = read_idx(img, 3), read_idx(lab, 1)
    if len(x) != len(y):
        raise InputError(
            f"--data {spec!r}: {img.name} has {len(x)} images, {lab.name} {len(y)} labels"
        )
    return x, y


def _mnist(spec: str, folder: Path) -> Dataset:
    if not folder.is_dir():
        raise InputError(f"--data {spec!r}: folder {folder} does not exist")
    train = _mnist_pair(spec, folder, "train")
    test = _mnist_pair(spec, folder, "t10k")
    if test is None:
        raise InputError(
            f"--data {spec!r}: no t10k-images-idx3-ubyte[.gz] / t10k-labels-idx1-ubyte[.gz] in {folder}"
        )
    if train is None:  # only the 10,000-image test set: the documented i % 5 == 4 split
        x, y = test
        is_test = np.arange(len(y)) % 5 == 4
        train, test = (x[~is_test], y[~is_test]), (x[is_test], y[is_test])
    return _checked(spec, *_tensors(*train), *_tensors(*test), num_classes=10)


def _tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.from_numpy(x.astype(np.float32) / 255.0).unsqueeze(1)
    return images, torch.from_numpy(y.astype(np.int64))


# --- npz ------------------------------------------------------------------------------------


# A compressed .npz may expand this many times its file size; beyond it (and past
# NPZ_FREE_BYTES, so small files full of zeros still load) it is refused unread. Image data
# deflates 2-10x; a 100x file is mostly one value, and np.savez (uncompressed) stores it safely.
NPZ_MAX_EXPANSION = 100
NPZ_FREE_BYTES = 64 * 2**20
NPY_MAX_HEADER = 10_000  # numpy's own limit on a .npy header (the dict of shape and dtype)
NPZ_ARRAYS = ("x", "y", "x_test", "y_test")


def _npz(spec: str, path: Path) -> Dataset:
    if not path.is_file():
        raise InputError(f"--data {spec!r}: file {path} does not exist")
    with open(path, "rb") as f:
        if f.read(2) != b"PK":
            raise InputError(f"--data {spec!r}: {path} is not an .npz file (a zip of .npy arrays)")
    names, arrays = _npz_arrays(spec, path)
    missing = [k for k in ("x", "y") if k not in arrays]
    if missing:
        raise InputError(
            f"--data {spec!r}: {path.name} lacks array(s) {', '.join(missing)} "
            f"(has: {', '.join(sorted(names)) or 'none'}); save with np.savez(f, x=..., y=...)"
        )
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise InputError(f"--data {spec!r}: {path.name} needs both x_test and y_test, or neither")
    x, y = _npz_x(spec, "x", arrays["x"]()), _npz_y(spec, "y", arrays["y"]())
    if len(x) != len(y):
        raise InputError(f"--data {spec!r}: x has {len(x)} images but y has {len(y)} labels")
    if "x_test" in arrays:
        xt = _npz_x(spec, "x_test", arrays["x_test"]())
        yt = _npz_y(spec, "y_test", arrays["y_test"]())
    else:
        is_test = torch.arange(len(y)) % 5 == 4
        x, xt, y, yt = x[~is_test], x[is_test], y[~is_test], y[is_test]
    return _checked(spec, x, y, xt, yt)


def _npz_arrays(spec: str, path: Path) -> tuple[list[str], dict[str, Callable[[], np.ndarray]]]:
    """The names in an .npz, and a reader for each array compress uses (NPZ_ARRAYS), after
    checking what the zip directory and each .npy header declare, before anything is
    decompressed: sizes against the file, the expansion of compressed members, the element
    cap, and dtypes (object arrays need pickle: refused)."""
    from models import limits, safeload

    where = f"--data {spec!r}: {path.name}"
    fix = "save the data again with np.savez(f, x=..., y=...)"
    infos = safeload.zip_directory(path, where, fix)
    for info in infos:
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise InputError(
                f"{where}: member {info.filename} uses zip compression method "
                f"{info.compress_type}, which numpy never writes; {fix}"
            )
    size = path.stat().st_size
    declared = sum(i.file_size for i in infos)
    cap = limits.max_elements()
    raise_cap = f"if the data really is this large, raise the cap (${limits.ENV_MAX_ELEMENTS})"
    biggest = max(infos, key=lambda i: i.file_size, default=None)
    if biggest is not None and declared > cap * 8:
        raise InputError(
            f"{where}: members declare {declared:,} bytes uncompressed ({biggest.filename}: "
            f"{biggest.file_size:,}), more than {cap:,} elements of 8 bytes; {raise_cap}"
        )
    if biggest is not None and declared > max(NPZ_FREE_BYTES, NPZ_MAX_EXPANSION * size):
        raise InputError(
            f"{where}: would expand from {size:,} bytes to {declared:,} "
            f"({declared / max(size, 1):,.0f}x; {biggest.filename} declares "
            f"{biggest.file_size:,}): a zip bomb, or data of mostly one value; refused before "
            "decompressing; save real data uncompressed, with np.savez"
        )
    by_name = {i.filename.removesuffix(".npy"): i for i in infos if not i.is_dir()}
    readers: dict[str, Callable[[], np.ndarray]] = {}
    elements = 0
    with zipfile.ZipFile(path) as z:
        for name in NPZ_ARRAYS:
            info = by_name.get(name)
            if info is None:
                continue
            shape, dtype, header = _npy_header(z, info, f"{where}: array {name}", fix)
            count = math.prod(shape)
            available = info.file_size - header
            if count * dtype.itemsize > available:
                raise InputError(
                    f"{where}: array {name} declares shape {shape} of {dtype} ({count:,} "
                    f"elements, {count * dtype.itemsize:,} bytes) but member {info.filename} "
                    f"holds {max(available, 0):,} bytes of data: the file is damaged or "
                    f"crafted; {fix}"
                )
            elements += count
            if elements > cap:
                raise InputError(
                    f"{where}: arrays declare {elements:,} elements in all (array {name}: "
                    f"shape {shape}), more than the cap of {cap:,}; {raise_cap}"
                )
            readers[name] = _npy_reader(path, info, f"{where}: array {name}", fix)
    return list(by_name), readers


def _npy_header(
    z: zipfile.ZipFile, info: zipfile.ZipInfo, where: str, fix: str
) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, header length) of one .npy member, reading only its header bytes."""
    fmt = np.lib.format
    try:
        with z.open(info) as f:
            version = fmt.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f"unsupported .npy format version {version}")
            width = 2 if version == (1, 0) else 4
            length = f.read(width)
            n = int.from_bytes(length, "little")
            if len(length) < width or n > NPY_MAX_HEADER:
                raise ValueError(f"a header of {n:,} bytes (numpy writes at most a few hundred)")
            text = f.read(n)
            if len(text) < n:
                raise ValueError("the header is truncated")
            read_header = fmt.read_array_header_1_0 if width == 2 else fmt.read_array_header_2_0
            shape, _fortran, dtype = read_header(io.BytesIO(length + text))
    except Exception as e:  # zipfile, zlib and numpy each raise their own kinds
        detail = " ".join(str(e).split())[:200]
        raise InputError(f"{where}: not a readable .npy member ({detail}); {fix}") from None
    if dtype.hasobject:
        raise InputError(
            f"{where} holds pickled objects (dtype {dtype}), which compress never loads; "
            "store plain numeric arrays"
        )
    if any(d < 0 for d in shape):
        raise InputError(f"{where}: negative size in shape {shape}; the file is damaged; {fix}")
    return tuple(shape), dtype, 6 + 2 + width + n


def _npy_reader(
    path: Path, info: zipfile.ZipInfo, where: str, fix: str
) -> Callable[[], np.ndarray]:
    """A call reading one checked member; zipfile never yields more than its declared size."""

    def read() -> np.ndarray:
        try:
            with zipfile.ZipFile(path) as z, z.open(info) as f:
                return np.lib.format.read_array(f, allow_pickle=False)
        except Exception as e:
            detail = " ".join(str(e).split())[:200]
            raise InputError(f"{where}: not a readable .npy member ({detail}); {fix}") from None

    return read


def _npz_x(spec: str, name: str, a: np.ndarray) -> torch.Tensor:
    if a.dtype.kind not in "fiub":
        raise InputError(f"--data {spec!r}: array {name} has dtype {a.dtype}; use numbers")
    if a.ndim == 2:
        a = a[:, None, None, :]
    elif a.ndim == 3:
        a = a[:, None]
    elif a.ndim != 4:
        raise InputError(
            f"--data {spec!r}: array {name} has shape {a.shape}; use (N, F), (N, H, W) or (N, C, H, W)"
        )
    elif a.shape[-1] in (1, 3, 4) and a.shape[1] not in (1, 3, 4):
        raise InputError(
            f"--data {spec!r}: array {name} of shape {a.shape} looks channels-last (N, H, W, C); "
            "store it as (N, C, H, W), e.g. x.transpose(0, 3, 1, 2)"
        )
    if a.dtype.kind == "u":
        a = a.astype(np.float32) / np.iinfo(a.dtype).max
    elif a.dtype.kind in "ib":
        if a.size and (a.min() < 0 or a.max() > 255):
            raise InputError(
                f"--data {spec!r}: integer pixels of {name} must be 0..255; store uint8 or floats"
            )
        a = a.astype(np.float32) / 255.0
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def _npz_y(spec: str, name: str, a: np.ndarray) -> torch.Tensor:
    if a.ndim != 1:
        raise InputError(f"--data {spec!r}: labels {name} must be 1-D, got shape {a.shape}")
    if a.dtype.kind == "f":
        if not np.all(np.isfinite(a)) or not np.all(a == np.round(a)):
            raise InputError(f"--data {spec!r}: labels {name} must be whole numbers")
    elif a.dtype.kind not in "iub":
        raise InputError(f"--data {spec!r}: labels {name} have dtype {a.dtype}; use integers")
    return torch.from_numpy(a.astype(np.int64))


# --- validation -----------------------------------------------------------------------------


def _checked(
    spec: str,
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_test: torch.Tensor,
    y_test: torch.Tensor,
    num_classes: int | None = None,
) -> Dataset:
    for part, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        if len(x) == 0:
            raise InputError(f"--data {spec!r}: the {part} split is empty")
        if len(x) != len(y):
            raise InputError(f"--data {spec!r}: {part} has {len(x)} images but {len(y)} labels")
        if not torch.isfinite(x).all():
            raise InputError(f"--data {spec!r}: {part} images contain NaN or infinity")
    if x_train.shape[1:] != x_test.shape[1:]:
        raise InputError(
            f"--data {spec!r}: train images are {tuple(x_train.shape[1:])} "
            f"but test images {tuple(x_test.shape[1:])}"
        )
    if num_classes is None:  # npz: classes are 0..K-1, every one present in training
        lo, hi = int(y_train.min()), int(y_train.max())
        if lo < 0 or hi >= MAX_CLASSES:
            raise InputError(
                f"--data {spec!r}: train labels out of range [{lo}, {hi}]; "
                f"number classes 0..K-1 (K <= {MAX_CLASSES})"
            )
        num_classes = max(hi + 1, 2)
        present = torch.bincount(y_train, minlength=num_classes) > 0
        if not bool(present.all()):
            missing = torch.nonzero(~present).flatten().tolist()
            shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
            raise InputError(
                f"--data {spec!r}: labels out of range: classes must be 0..{num_classes - 1} with "
                f"every class in training, but class {shown} never occurs; renumber the labels"
            )
    for part, y in (("train", y_train), ("test", y_test)):
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or hi >= num_classes:
            raise InputError(
                f"--data {spec!r}: {part} labels out of range [{lo}, {hi}]; "
                f"expected 0..{num_classes - 1} (classes are numbered from 0)"
            )
    return Dataset(spec, x_train.contiguous(), y_train, x_test.contiguous(), y_test, num_classes)


def check_labels(data: Dataset, num_classes: int, model_name: str) -> None:
    """Fail when the data has more classes than a (loaded) model can predict."""
    if data.num_classes > num_classes:
        raise InputError(
            f"--data {data.spec!r}: labels reach {data.num_classes - 1} but model {model_name} "
            f"predicts {num_classes} classes (0..{num_classes - 1})"
        )


def check_fits(model: torch.nn.Module, data: Dataset, model_name: str) -> None:
    """Fail with one line when `data` cannot go through `model` (shape or class count).

    Runs one forward pass on two training images, in eval mode so BatchNorm statistics stay
    untouched.
    """
    want = getattr(model, "in_shape", None)
    if want is not None and tuple(want) != tuple(data.in_shape):
        raise InputError(
            f"--data {data.spec!r} gives images of shape {tuple(data.in_shape)} but model "
            f"{model_name} was built for {tuple(want)}"
        )
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(data.x_train[:2])
    except Exception as e:  # the model's own code decides what it raises
        detail = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InputError(
            f"--data {data.spec!r}: images of shape {tuple(data.in_shape)} do not fit model "
            f"{model_name} ({type(e).__name__}: {detail})"
        ) from None
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor) or out.ndim != 2 or out.shape[0] != 2:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise InputError(
            f"model {model_name} returns {got} for a batch of 2; "
            "a classifier returns one tensor of shape (batch, classes)"
        )
    check_labels(data, out.shape[1], model_name)
