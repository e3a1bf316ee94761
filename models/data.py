"""Data sets behind `--data SPEC`, loaded into memory: float32 images in [0, 1], or int64
token ids for text models.

Specs
    digits          scikit-learn's bundled 8x8 digits (1,797 images; nothing is downloaded)
    digits:28       the same, resized to 28x28 (bilinear), e.g. for LeNet-5's Caffe geometry
    mnist:DIR       MNIST IDX files in DIR, gzipped or raw
    npz:FILE        a NumPy .npz with arrays x (or input_ids), y and optionally x_test, y_test
    tokens          synthetic text, generated here (nothing is downloaded; ~0.1 s): 3,000
                    sequences of 32 int64 token ids, vocabulary 1,000, id 0 = padding, 4 classes
    tokens:L        the same with sequences of L tokens (12..1024)
    tokens:L:V      ... and a vocabulary of V ids (32..250000), e.g. tokens:16:64 (a zoo text
                    model keeps its own vocab_size unless --model-kwargs sets it: textcls
                    embeds 1,000 ids by default)

Splits are fixed so every run and every stage sees the same test set, whatever `--seed` says:
    digits          stratified 80/20 split with scikit-learn, random_state=0 (1,437 / 360)
    mnist           train-* files for training and t10k-* for test; when only the t10k files
                    exist, image i is a test image when i % 5 == 4 (8,000 train / 2,000 test,
                    drawn evenly from both halves of t10k, which differ in writers)
    npz             x_test/y_test when present, else every 5th sample with the samples
                    ordered by class (`every_of_class`): a fifth of each class, in the file's
                    order, so labels that cycle through the classes still train and test on
                    every class
    tokens          sample i is a test sample when i % 5 == 4 (2,400 / 600)

A validation split is then held out of the training split, so that the decisions a stage makes
(pruning sensitivity, the INT8 agreement floor) are judged on data no model was trained on
and the test set stays for the figures reported: the training sample at position j of the
split above is a validation sample when j % 10 == 9 (digits 1,294 train / 143 val, tokens
2,160 / 240, MNIST t10k only 7,200 / 800, MNIST train files 54,000 / 6,000); for an npz or
arrays, every 10th with the samples ordered by class (`every_of_class`). An npz with
x_val/y_val (input_ids_val, or NAME_val, with y_val) uses those instead and trains on all of
x. A training split of fewer than 20 samples keeps no validation split: stages then decide on
training data and the report says so (`Dataset.split_note`).

Images are (N, C, H, W) and (N, H, W) gains a channel; (N, F) features reach the model as
given, so its exported file takes (batch, F) too.
Unsigned integer pixels are scaled by their type's maximum (uint8 / 255), signed ones (0..255)
by 255, digits by 16; float arrays are used as given. npz labels are classes 0..K-1, each
present in the training split.

Token ids are int64 (N, L), never scaled, and the model masks its own padding (`textcls` masks
id 0): compress feeds a model exactly one input tensor. In an npz, the input array is
    x               images or features, as above (integer arrays are pixels, scaled)
    input_ids       integer token ids (N, L), kept as int64 (the argument name of BERT-style
                    models); input_ids_test pairs with y_test
    NAME            an array named after the model's forward argument (e.g. `ids` for
                    textcls), when the caller names it (`load(spec, input_name=...)`; the
                    CLI's train, shrink and bench do, from the model they build): integer
                    arrays are token ids, float arrays are used as x would be
A second input array (x with input_ids, or attention_mask / token_type_ids / position_ids) is
refused: derive the mask inside the model from a padding id instead. The tokens spec labels a
sequence by which of 4 groups of 4 "keyword" ids (ids 1..16) occurs most often in it; the
other ids are random filler, and sequences are 1/2 to all of L tokens long, padded with 0.
"""

from __future__ import annotations

import functools
import gzip
import inspect
import io
import math
import os
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from compresskit.models.errors import InputError, one_line

SPECS_HELP = "digits, digits:28, mnist:DIR, npz:FILE or tokens[:L[:V]]"
MAX_CLASSES = 100_000
TEST_EVERY = 5  # a user's data without test arrays: a fifth of each class is test
VAL_EVERY = 10  # training position j is a validation sample when j % VAL_EVERY == VAL_EVERY - 1
VAL_MIN_TRAIN = 20  # fewer training samples: no validation split


@dataclass(frozen=True)
class Dataset:
    """An in-memory classification data set with a fixed train/test split."""

    spec: str
    x_train: torch.Tensor  # float32 (N, C, H, W), or int64 token ids (N, L)
    y_train: torch.Tensor  # int64 (N,)
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    x_val: torch.Tensor  # held out of training: what stages decide on (may be empty)
    y_val: torch.Tensor
    # How a raw sample became the model's input ("" when not known): an app must feed the
    # exported file the same, and the report and the ONNX metadata say so (26 points of
    # INT8 accuracy went when digits' raw 0..16 pixels were fed unscaled).
    scaling: str = ""

    def __post_init__(self) -> None:
        _check_fields(self)

    @property
    def in_shape(self) -> tuple[int, ...]:
        """One sample's shape: (C, H, W) for images, (L,) for token ids."""
        return tuple(self.x_train.shape[1:])

    @property
    def is_tokens(self) -> bool:
        """Inputs are int64 token ids (N, L), not float images."""
        return not self.x_train.is_floating_point()

    @functools.cached_property  # a pass over every id: computed once per data set
    def vocab(self) -> int | None:
        """Token data: the highest id in any split + 1 (what an embedding must hold)."""
        if not self.is_tokens:
            return None
        parts = (self.x_train, self.x_val, self.x_test)
        return max(int(x.max()) for x in parts if len(x)) + 1

    def describe(self) -> str:
        """One line: spec, split sizes, input shape and class count."""
        if self.is_tokens:
            (length,) = self.in_shape
            shape = f"{length} token ids (< {self.vocab})"
        else:
            shape = "x".join(map(str, self.in_shape))
        return (
            f"{self.spec}: {len(self.y_train)} train / {len(self.y_val)} val / "
            f"{len(self.y_test)} test, {shape}, {self.num_classes} classes"
        )

    @property
    def has_val(self) -> bool:
        return len(self.y_val) > 0

    def decision_split(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) that stages decide on: the validation split, or the training split when the
        data is too small to hold one out (`split_note` says so)."""
        return (self.x_val, self.y_val) if self.has_val else (self.x_train, self.y_train)

    @property
    def split_note(self) -> str:
        """Where decisions are judged, for reports: one line."""
        if self.has_val:
            return f"validation split, {len(self.y_val)} samples held out of training"
        return (
            f"training data: {len(self.y_train)} training samples are too few to hold out a "
            f"validation split (needs {VAL_MIN_TRAIN})"
        )

    def random_inputs(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """n random inputs shaped like this data: uniform [0, 1) float32 for images, int64 ids
        in [1, vocab) for tokens (0 is padding in the specs compress generates)."""
        return random_inputs((n, *self.in_shape), self.is_tokens, self.vocab, rng)


def random_inputs(
    shape: tuple[int, ...], tokens: bool, vocab: int | None, rng: np.random.Generator
) -> np.ndarray:
    """Random model inputs of `shape`: float32 in [0, 1), or for a token model int64 ids in
    [1, vocab) (every id a valid embedding row; with no vocabulary known, all ids are 1, which
    any embedding of two or more rows holds)."""
    if not tokens:
        return rng.random(shape, dtype=np.float32)
    if vocab is None or vocab <= 2:
        return np.ones(shape, np.int64)
    return rng.integers(1, vocab, shape, dtype=np.int64)


def load(spec: str, input_name: str | None = None) -> Dataset:
    """Load the data set a `--data` spec names; errors name the spec and the problem.

    `input_name`: the model's forward argument (`forward_input`), when the caller knows the
    model; an npz array of that name is then taken as the input too (see the module doc).
    """
    if not isinstance(spec, str):
        raise InputError(f"data {spec!r}: give a data spec string; use {SPECS_HELP}")
    kind, sep, arg = spec.partition(":")
    if kind == "digits":
        side = _parse_side(spec, arg) if sep else 8
        return _digits(spec, side)
    if kind == "tokens":
        return _tokens(spec, *_parse_tokens(spec, arg if sep else ""))
    if kind in ("mnist", "npz") and not arg:
        raise InputError(
            f"--data {spec!r}: {kind} needs a path, e.g. {kind}:{'DIR' if kind == 'mnist' else 'FILE.npz'}"
        )
    if kind == "mnist":
        return _mnist(spec, _expanded(spec, arg))
    if kind == "npz":
        return _npz(spec, _expanded(spec, arg), input_name)
    raise InputError(f"--data {spec!r}: unknown data spec; use {SPECS_HELP}")


def _spec_path(spec: object) -> tuple[str, Path] | None:
    """("npz" or "mnist", its expanded path) for a spec that names a file or folder; None for
    built-in data, anything that is not a spec string, or an unknown ~user (`load` says so)."""
    kind, _, arg = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if kind not in ("npz", "mnist") or not arg:
        return None
    try:
        return kind, _expanded(spec, arg)
    except InputError:
        return None


def recorded_spec(spec: str) -> str:
    """`spec` as a checkpoint records it: the path of npz:FILE or mnist:DIR made absolute, so
    `shrink`, `bench` and `--resume` run from another folder find the same data. Built-in
    data, and a spec that does not parse, stay as given."""
    named = _spec_path(spec)
    return spec if named is None else f"{named[0]}:{os.path.abspath(named[1])}"


def splits_given(spec: str) -> bool:
    """Whether an npz spec's file holds its own test and validation arrays (no split rule of
    compress's applies to it); False for anything else or a file that cannot be read."""
    named = _spec_path(spec)
    if named is None or named[0] != "npz":
        return False
    try:
        with zipfile.ZipFile(named[1]) as z:
            names = {n.removesuffix(".npy") for n in z.namelist()}
    except (OSError, zipfile.BadZipFile):
        return False
    return {"y_test", "y_val"} <= names


def fingerprint(d: Dataset) -> str:
    """A SHA-256 over every split's inputs and labels, in order: the same spec string can give
    other samples or other splits (the file changed, or the npz split rule did: a training run
    resumed on a new split trained on 297 of its 359 test samples)."""
    import hashlib

    h = hashlib.sha256()
    for t in (d.x_train, d.y_train, d.x_val, d.y_val, d.x_test, d.y_test):
        a = t.detach().cpu().contiguous().numpy()
        h.update(f"{a.dtype}{a.shape};".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def shipped_spec(spec: object) -> object:
    """`spec` as an archive records it: npz:FILE and mnist:DIR by the file's or folder's name
    alone (`npz:train.npz`), so a shipped file carries no folder of the build machine; built-in
    data, and anything that does not parse, as given."""
    named = _spec_path(spec)
    return spec if named is None else f"{named[0]}:{named[1].name}"


def load_recorded(spec: object, source: object, input_name: str | None = None) -> Dataset:
    """`load` the data spec a checkpoint `source` records (digits when it records none);
    failing, say where the spec came from (the user gave no --data) and how to give other
    data."""
    if not spec:
        return load("digits", input_name)
    if str(spec).startswith("arrays"):  # no spec string names them: only the caller has them
        raise InputError(
            f"{source} was trained on arrays given in Python; pass the same arrays again "
            "(data=(x, y), or a Dataset), or --data SPEC"
        )
    try:
        return load(spec, input_name)
    except InputError as e:
        raise InputError(f"{e} (the data {source} records; pass --data SPEC)") from None


def spec_files(spec: object) -> list[Path]:
    """The files a data spec reads (npz:FILE, the files of mnist:DIR); [] for built-in data
    or anything that is not a spec string. For refusing an output path that would replace
    them."""
    named = _spec_path(spec)
    if named is None:
        return []
    kind, path = named
    if kind == "npz":
        return [path]
    return sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else []


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
    scaling = "scikit-learn digits' 8x8 pixels (0..16) divided by 16: float32 in [0, 1]"
    if side != 8:
        scaling += f", resized to {side}x{side} (bilinear, align_corners=False)"
    return _checked(spec, xt[i_tr], yt[i_tr], xt[i_te], yt[i_te], scaling=scaling)


# --- synthetic token sequences ---------------------------------------------------------------

TOKENS_LENGTH, TOKENS_VOCAB = 32, 1000  # `tokens` without arguments
TOKENS_SAMPLES, TOKENS_CLASSES, TOKENS_KEYWORDS = 3000, 4, 4  # samples, classes, ids per class
TOKENS_LENGTHS, TOKENS_VOCABS = (12, 1024), (32, 250_000)
TOKENS_SEED = 0  # fixed: the data set is the same on every run, whatever --seed says


def _parse_tokens(spec: str, arg: str) -> tuple[int, int]:
    parts = arg.split(":") if arg else []
    (lo, hi), (vlo, vhi) = TOKENS_LENGTHS, TOKENS_VOCABS
    ok = len(parts) <= 2 and all(p.isdigit() for p in parts)
    length = int(parts[0]) if ok and parts else TOKENS_LENGTH
    vocab = int(parts[1]) if ok and len(parts) == 2 else TOKENS_VOCAB
    if not ok or not lo <= length <= hi or not vlo <= vocab <= vhi:
        raise InputError(
            f"--data {spec!r}: tokens takes tokens[:L[:V]] with sequence length L {lo}..{hi} "
            f"and vocabulary V {vlo}..{vhi}, e.g. tokens:16:64"
        )
    return length, vocab


def token_sequences(
    n: int, length: int, vocab: int, seed: int = TOKENS_SEED
) -> tuple[np.ndarray, np.ndarray]:
    """n labelled int64 sequences (n, length), padded with id 0 after a random length of
    length/2..length. Class k owns keyword ids 1 + 4k .. 4 + 4k; a sequence of class y holds
    1-3 of y's keywords and fewer of every other class's, at random places among filler ids
    drawn from the rest of the vocabulary. Classes are balanced."""
    rng = np.random.default_rng(seed)
    k, g = TOKENS_CLASSES, TOKENS_KEYWORDS
    y = rng.permutation(np.arange(n) % k)
    most = rng.integers(1, 4, n)  # the winning class's keyword count
    counts = (rng.random((n, k)) * most[:, None]).astype(np.int64)  # others: 0 .. most-1
    counts[np.arange(n), y] = most
    total = counts.sum(1)  # <= 3 + 3 * 2 = 9 < 12, the shortest L allowed
    lengths = rng.integers(np.maximum(total, length // 2), length + 1)
    pos = np.arange(length)
    ids = rng.integers(1 + k * g, vocab, (n, length), dtype=np.int64)
    ids[pos >= lengths[:, None]] = 0
    # Keyword slots: the first `total` places of a random order of each sequence's places.
    keys = rng.random((n, length)) + (pos >= lengths[:, None])  # padding sorts last
    places = np.argsort(keys, axis=1)[:, : int(total.max())]
    slot = np.arange(places.shape[1])
    cls = (slot[None, :, None] >= counts.cumsum(1)[:, None, :]).sum(2)  # class of each slot
    word = 1 + cls * g + rng.integers(0, g, cls.shape)
    rows = np.broadcast_to(np.arange(n)[:, None], places.shape)
    used = slot[None, :] < total[:, None]
    ids[rows[used], places[used]] = word[used]
    return ids, y.astype(np.int64)


def _tokens(spec: str, length: int, vocab: int) -> Dataset:
    x, y = token_sequences(TOKENS_SAMPLES, length, vocab)
    is_test = np.arange(len(y)) % 5 == 4
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    train, test = torch.from_numpy(~is_test), torch.from_numpy(is_test)
    return _checked(
        spec,
        xt[train],
        yt[train],
        xt[test],
        yt[test],
        TOKENS_CLASSES,
        scaling="int64 token ids, 0 = padding",
    )


# --- MNIST IDX ------------------------------------------------------------------------------
# IDX: 2 zero bytes, a type byte (0x08 = uint8), a rank byte, rank big-endian uint32 sizes,
# then the data (http://yann.lecun.com/exdb/mnist/). Images are rank 3, labels rank 1.


def read_idx(path: Path, rank: int) -> np.ndarray:
    """Read one IDX file (gzip detected by its magic bytes) as a uint8 array."""
    from compresskit.models import limits

    cap = limits.max_elements()
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            # inflated at most to the element cap plus the largest header: a few kB of gzip
            # can inflate to gigabytes of zeros
            with gzip.GzipFile(fileobj=io.BytesIO(raw)) as f:
                raw = f.read(cap + 4 + 4 * 3 + 1)
            if len(raw) > cap + 4 + 4 * rank:
                raise InputError(
                    f"{path}: inflates to more than {cap:,} values; if the data really is this "
                    f"large, raise the cap (${limits.ENV_MAX_ELEMENTS})"
                )
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
    if math.prod(dims) > cap:
        raise InputError(
            f"{path}: header declares {math.prod(dims):,} values, above the cap of {cap:,}; "
            f"if the data really is this large, raise the cap (${limits.ENV_MAX_ELEMENTS})"
        )
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
    return _checked(
        spec,
        *_tensors(*train),
        *_tensors(*test),
        num_classes=10,
        scaling="MNIST's 28x28 pixels (uint8) divided by 255: float32 in [0, 1]",
    )


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
TOKEN_ARRAY = "input_ids"  # the forward argument of BERT-style models (Hugging Face's name)
# Arrays that would be a model's second input: compress feeds one tensor, so they are refused.
SECOND_INPUTS = ("attention_mask", "token_type_ids", "position_ids")
ONE_INPUT = (
    "compress feeds the model one input tensor: keep one input array (x for images or "
    "features, input_ids for int token ids) and let the model derive its attention mask from "
    "a padding id, as zoo model textcls does with id 0"
)


def _expanded(spec: str, arg: str) -> Path:
    """`arg` with a leading ~ or ~user expanded; one line when the user is unknown."""
    try:
        return Path(arg).expanduser()
    except RuntimeError:  # "Could not determine home directory"
        raise InputError(f"--data {spec!r}: cannot expand {arg!r}: no such user") from None


def _npz(spec: str, path: Path, input_name: str | None = None) -> Dataset:
    if path.is_dir():
        raise InputError(f"--data {spec!r}: {path} is a folder; give the .npz file in it")
    if not path.is_file():
        raise InputError(f"--data {spec!r}: file {path} does not exist")
    with open(path, "rb") as f:
        if f.read(2) != b"PK":
            raise InputError(f"--data {spec!r}: {path} is not an .npz file (a zip of .npy arrays)")
    candidates = list(dict.fromkeys(["x", TOKEN_ARRAY, *([input_name] if input_name else [])]))
    candidates = [c for c in candidates if c not in ("y", "y_test", "y_val")]
    wanted = [
        *candidates,
        *(f"{c}_{part}" for part in ("test", "val") for c in candidates),
        *("y", "y_test", "y_val"),
    ]
    names, arrays = _npz_arrays(spec, path, wanted)
    where = f"--data {spec!r}: {path.name}"
    inputs = [c for c in candidates if c in arrays]
    second = [
        n for n in sorted(names) if n.removesuffix("_test").removesuffix("_val") in SECOND_INPUTS
    ]
    if len(inputs) > 1 or second:
        also = f" besides input array {inputs[0]}" if inputs else ""
        raise InputError(f"{where} holds {' and '.join(inputs[1:] + second)}{also}; {ONE_INPUT}")
    missing = [k for k in (inputs or ["x"]) + ["y"] if k not in arrays]
    if missing:
        raise InputError(
            f"{where} lacks array(s) {', '.join(missing)} "
            f"(has: {', '.join(sorted(names)) or 'none'}); save with np.savez(f, x=..., y=...), "
            f"or input_ids=... for int token ids"
        )
    name = inputs[0]
    test, val = f"{name}_test", f"{name}_val"
    for part, xs in (("test", test), ("val", val)):
        if (xs in arrays) != (f"y_{part}" in arrays):
            raise InputError(f"{where} needs both {xs} and y_{part}, or neither")
    raw = arrays[name]()
    x, y = _npz_input(spec, name, raw), _npz_y(spec, "y", arrays["y"]())
    scaling = input_scaling(raw, not x.is_floating_point())
    del raw
    if len(x) != len(y):
        what = "images" if x.is_floating_point() else "token sequences"
        raise InputError(f"--data {spec!r}: {name} has {len(x)} {what} but y has {len(y)} labels")
    if test in arrays:
        xt = _npz_input(spec, test, arrays[test]())
        yt = _npz_y(spec, "y_test", arrays["y_test"]())
    else:
        is_test = torch.from_numpy(every_of_class(y.numpy(), TEST_EVERY))
        x, xt, y, yt = x[~is_test], x[is_test], y[~is_test], y[is_test]
    given = None
    if val in arrays:
        given = (_npz_input(spec, val, arrays[val]()), _npz_y(spec, "y_val", arrays["y_val"]()))
    return _checked(spec, x, y, xt, yt, val=given, per_class=True, scaling=scaling)


def _npz_arrays(
    spec: str, path: Path, wanted: list[str]
) -> tuple[list[str], dict[str, Callable[[], np.ndarray]]]:
    """The names in an .npz, and a reader for each `wanted` array it holds, after
    checking what the zip directory and each .npy header declare, before anything is
    decompressed: sizes against the file, the expansion of compressed members, the element
    cap, and dtypes (object arrays need pickle: refused)."""
    from compresskit.models import limits, safeload

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
        for name in wanted:
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
    try:
        with z.open(info) as f:
            shape, dtype, header = read_npy_header(f)
    except Exception as e:  # zipfile, zlib and numpy each raise their own kinds
        detail = one_line(e)
        raise InputError(f"{where}: not a readable .npy member ({detail}); {fix}") from None
    if dtype.hasobject:
        raise InputError(
            f"{where} holds pickled objects (dtype {dtype}), which compress never loads; "
            "store plain numeric arrays"
        )
    if any(d < 0 for d in shape):
        raise InputError(f"{where}: negative size in shape {shape}; the file is damaged; {fix}")
    return tuple(shape), dtype, header


def read_npy_header(f) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, header length) of the .npy stream `f`, reading only its header bytes
    (at most NPY_MAX_HEADER of them); ValueError (or numpy's own) when malformed."""
    fmt = np.lib.format
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
            detail = one_line(e)
            raise InputError(f"{where}: not a readable .npy member ({detail}); {fix}") from None

    return read


def _npz_input(spec: str, name: str, a: np.ndarray) -> torch.Tensor:
    """An input array: integer token ids under any name but x (int64, unscaled), else images."""
    base = name.removesuffix("_test").removesuffix("_val")
    if base == "x" or a.dtype.kind not in "iu":
        if base == TOKEN_ARRAY:
            raise InputError(
                f"--data {spec!r}: array {name} has dtype {a.dtype}; input_ids holds integer "
                "token ids (store int64), images go in x"
            )
        return _npz_x(spec, name, a)
    if a.ndim != 2 or a.shape[1] < 1:
        raise InputError(
            f"--data {spec!r}: token ids {name} have shape {a.shape}; use (N, L), one row of "
            "L ids per sample, padded with the model's padding id"
        )
    if a.size and (a.min() < 0 or a.max() > np.iinfo(np.int64).max):
        raise InputError(
            f"--data {spec!r}: token ids {name} reach [{a.min()}, {a.max()}]; ids are 0 or more"
        )
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))


def npz_layout(a: np.ndarray) -> np.ndarray:
    """Input arrays as every stage sees them: (N, H, W), and (N, 1, L) signals with them, gain
    a channel axis; (N, F) features and 4-D arrays stay as given (features went in as
    (N, 1, 1, F) before, and the exported file took them so: an app's (1, F) vector failed on
    its rank)."""
    if a.ndim == 3:
        return a[:, None]
    return a


def _npz_x(spec: str, name: str, a: np.ndarray) -> torch.Tensor:
    if a.dtype.kind not in "fiub":
        raise InputError(f"--data {spec!r}: array {name} has dtype {a.dtype}; use numbers")
    if a.ndim == 3:
        a = npz_layout(a)
    elif a.ndim not in (2, 4):
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
                f"--data {spec!r}: {name} holds {a.dtype} values in [{a.min()}, {a.max()}]; "
                "signed integers are read as 8-bit pixels (0..255, scaled by 1/255): store "
                "other signals as float32 scaled as your model expects (16-bit PCM audio: "
                "x / 32768), and token ids as int64 in an array named input_ids"
            )
        a = a.astype(np.float32) / 255.0
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


SINGLE_LABEL = (
    "compress trains single-label classifiers (regression, multi-label and per-pixel targets "
    "are not supported)"
)


def _npz_y(spec: str, name: str, a: np.ndarray) -> torch.Tensor:
    if a.ndim != 1:
        raise InputError(
            f"--data {spec!r}: labels {name} must be 1-D, one class id per sample, got shape "
            f"{a.shape}; {SINGLE_LABEL}"
        )
    if a.dtype.kind == "f":
        if not np.all(np.isfinite(a)) or not np.all(a == np.round(a)):
            raise InputError(
                f"--data {spec!r}: labels {name} must be whole numbers, one class id per "
                f"sample; {SINGLE_LABEL}"
            )
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
    val: tuple[torch.Tensor, torch.Tensor] | None = None,
    per_class: bool = False,
    scaling: str = "",
) -> Dataset:
    """The data set after checks, with its validation split: `val` as given (an npz's x_val,
    y_val) or held out of the training split (`val_positions`, of each class when `per_class`:
    a user's data)."""
    what = "images" if x_train.is_floating_point() else "token sequences"
    if num_classes is None and len(y_train):  # labels 2**40: one sample a class, none to test
        lo, hi = int(y_train.min()), int(y_train.max())
        if lo < 0 or hi >= MAX_CLASSES:
            raise InputError(
                f"--data {spec!r}: train labels out of range [{lo}, {hi}]; "
                f"number classes 0..K-1 (K <= {MAX_CLASSES})"
            )
    parts = [("train", x_train, y_train), ("test", x_test, y_test)]
    if val is not None:
        parts.append(("val", *val))
    no_test = per_class and len(x_test) == 0  # said after the labels, which may be the fix
    for part, x, y in parts:
        if len(x) == 0 and not (part == "test" and no_test):
            raise InputError(f"--data {spec!r}: the {part} split is empty")
        if len(x) != len(y):
            raise InputError(f"--data {spec!r}: {part} has {len(x)} {what} but {len(y)} labels")
        if not torch.isfinite(x).all():
            raise InputError(f"--data {spec!r}: {part} images contain NaN or infinity")
    for part, x, _ in parts[1:]:
        if x_train.shape[1:] != x.shape[1:]:
            raise InputError(
                f"--data {spec!r}: train {what} are {tuple(x_train.shape[1:])} "
                f"but {part} {what} {tuple(x.shape[1:])}"
            )
        if x_train.dtype != x.dtype:
            raise InputError(
                f"--data {spec!r}: train inputs are {x_train.dtype} but {part} inputs "
                f"{x.dtype}; store all as token ids, or all as images"
            )
    if num_classes is None:  # npz: classes are 0..K-1, every one present in training
        lo, hi = int(y_train.min()), int(y_train.max())
        num_classes = max(hi + 1, 2)
        present = torch.bincount(y_train, minlength=num_classes) > 0
        if not bool(present.all()):
            missing = torch.nonzero(~present).flatten().tolist()
            shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
            raise InputError(
                f"--data {spec!r}: labels out of range: classes must be 0..{num_classes - 1} with "
                f"every class in training, but class {shown} never occurs; renumber the labels"
            )
    if no_test:  # a class's first sample stays in training
        raise InputError(
            f"--data {spec!r}: the test split is empty: no class has a second sample to hold "
            "out (a fifth of each class is test, its first always in training); give "
            "x_test/y_test, or more samples"
        )
    for part, _, y in parts:
        if not len(y):
            continue
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or hi >= num_classes:
            raise InputError(
                f"--data {spec!r}: {part} labels out of range [{lo}, {hi}]; "
                f"expected 0..{num_classes - 1} (classes are numbered from 0)"
            )
    if val is None:
        labels = y_train.numpy() if per_class else None
        is_val = torch.from_numpy(val_positions(len(y_train), labels))
        val = (x_train[is_val], y_train[is_val])
        x_train, y_train = x_train[~is_val], y_train[~is_val]
    return Dataset(
        spec,
        x_train.contiguous(),
        y_train,
        x_test.contiguous(),
        y_test,
        num_classes,
        val[0].contiguous(),
        val[1],
        scaling,
    )


def input_scaling(a: np.ndarray, tokens: bool) -> str:
    """How `_npz_input` turns an array of this dtype into model inputs, in a few words."""
    if tokens:
        return "token ids as stored (int64)"
    if a.dtype.kind == "f":
        return "the values as stored (float32, no scaling)"
    if a.dtype.kind == "u":
        return f"{a.dtype} values divided by {np.iinfo(a.dtype).max}: float32 in [0, 1]"
    return "8-bit pixel values (0..255) divided by 255: float32 in [0, 1]"


def from_arrays(
    x,
    y,
    *,
    x_test=None,
    y_test=None,
    x_val=None,
    y_val=None,
    num_classes: int | None = None,
    name: str = "arrays",
) -> Dataset:
    """A Dataset from in-memory arrays (numpy, torch or nested lists), converted, split and
    checked by the rules an npz follows (the module doc); also `Dataset.from_arrays`.

    x_test/y_test when given, else a fifth of each class is test; x_val/y_val when given, else
    a tenth of each class's training samples is held out for validation (`every_of_class`).
    Inputs: float arrays as given (float32; bfloat16 and float16 widened), unsigned integers
    scaled by their type's maximum (uint8 / 255, uint16 / 65535), signed integer (N, L) arrays
    as token ids, other signed integer and bool arrays as 8-bit pixels (/ 255: digits' 0..16
    pixels stored as int64 would become 0..0.063, so scale such data to float yourself);
    `Dataset.scaling` says which. Labels are classes 0..K-1, K = `num_classes` or the
    largest label + 1 (then every class must occur in training). Errors name the argument."""
    where = "Dataset.from_arrays"
    for arg, value in (("x", x), ("y", y)):
        if value is None:
            raise InputError(f"{where}: {arg} is None; give arrays of inputs and labels")
    for a, b, part in ((x_test, y_test, "test"), (x_val, y_val, "val")):
        if (a is None) != (b is None):
            raise InputError(f"{where}: give both x_{part} and y_{part}, or neither")
    if num_classes is not None and (
        isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1
    ):
        raise InputError(f"{where}: num_classes {num_classes!r}: give a whole number, 1 or more")
    x = _array(where, "x", x)  # converted once: its dtype and shape say what the inputs are
    tokens = x.dtype.kind == "i" and x.ndim == 2

    def inputs(arg: str, value) -> torch.Tensor:
        a = _array(where, arg, value)
        if tokens and a.dtype.kind == "i":
            return _npz_input(name, TOKEN_ARRAY, a)
        return _npz_x(name, "x", a)

    try:
        xs, ys = inputs("x", x), _npz_y(name, "y", _array(where, "y", y))
        if len(xs) != len(ys):
            what = "images" if xs.is_floating_point() else "token sequences"
            raise InputError(f"x has {len(xs)} {what} but y has {len(ys)} labels")
        if x_test is not None:
            xt, yt = (
                inputs("x_test", x_test),
                _npz_y(name, "y_test", _array(where, "y_test", y_test)),
            )
        else:
            is_test = torch.from_numpy(every_of_class(ys.numpy(), TEST_EVERY))
            xs, xt, ys, yt = xs[~is_test], xs[is_test], ys[~is_test], ys[is_test]
        val = None
        if x_val is not None:
            val = (inputs("x_val", x_val), _npz_y(name, "y_val", _array(where, "y_val", y_val)))
        scaling = input_scaling(x, not xs.is_floating_point())
        return _checked(name, xs, ys, xt, yt, num_classes, val=val, per_class=True, scaling=scaling)
    except InputError as e:  # the npz rules speak of --data SPEC; here the call is the source
        raise InputError(f"{where}: {str(e).removeprefix(f'--data {name!r}: ')}") from None


Dataset.from_arrays = staticmethod(from_arrays)  # type: ignore[attr-defined]


def as_dataset(data: object) -> object:
    """In-memory data as a Dataset: an (x, y) pair of arrays, a TensorDataset of two tensors,
    or a DataLoader over one (`from_arrays`'s split rules). Anything else is returned as it
    is, for the caller's own checks."""
    from torch.utils.data import DataLoader, TensorDataset

    if isinstance(data, DataLoader):
        data = data.dataset
    if isinstance(data, TensorDataset):
        if len(data.tensors) != 2:
            raise InputError(
                f"data: a TensorDataset of {len(data.tensors)} tensors; give (inputs, labels): "
                f"{ONE_INPUT}"
            )
        return from_arrays(*data.tensors)
    if isinstance(data, tuple | list) and len(data) == 2:
        return from_arrays(*data)
    return data


def _array(where: str, arg: str, value) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:  # numpy has no bfloat16: "unsupported ScalarType"
            value = value.float()
        return value.numpy()
    try:
        a = np.asarray(value)
    except (ValueError, TypeError) as e:
        raise InputError(f"{where}: {arg} is not an array ({one_line(e)})") from None
    if a.dtype == object:
        raise InputError(f"{where}: {arg} holds {type(value).__name__} of mixed or ragged items")
    return a


def _check_fields(d: Dataset) -> None:
    """A Dataset built by hand holds what every stage assumes: tensors, int64 labels in
    0..num_classes-1, one label per input, the same sample shape and dtype in every split.
    Without this, 200 images with 150 labels trained to the end, and numpy arrays or float
    labels failed deep inside training."""
    parts = [
        ("train", "x_train", "y_train"),
        ("test", "x_test", "y_test"),
        ("val", "x_val", "y_val"),
    ]
    fix = "build it with Dataset.from_arrays(x, y, ...), which converts and checks"
    for name in (n for _, xn, yn in parts for n in (xn, yn)):
        v = getattr(d, name)
        if not isinstance(v, torch.Tensor):
            raise InputError(f"Dataset {name} is {type(v).__name__}, not a torch.Tensor; {fix}")
    if isinstance(d.num_classes, bool) or not isinstance(d.num_classes, int | np.integer):
        raise InputError(f"Dataset num_classes {d.num_classes!r}: give a whole number")
    if d.num_classes < 1:
        raise InputError(f"Dataset num_classes {d.num_classes}: give 1 or more")
    if d.x_train.dtype not in (torch.float32, torch.int64):
        raise InputError(
            f"Dataset x_train is {d.x_train.dtype}; inputs are float32 images or int64 token "
            f"ids; {fix}"
        )
    for part, xn, yn in parts:
        x, y = getattr(d, xn), getattr(d, yn)
        if len(x) != len(y):
            raise InputError(f"Dataset {part} split: {len(x)} inputs but {len(y)} labels")
        if y.dtype != torch.int64 or y.ndim != 1:
            raise InputError(
                f"Dataset {yn} is {y.dtype} of shape {tuple(y.shape)}; labels are int64 (N,) "
                f"class numbers: {SINGLE_LABEL}"
            )
        if len(x) == 0:
            if part == "val":
                continue
            raise InputError(f"Dataset {part} split is empty")
        if x.dtype != d.x_train.dtype or x.shape[1:] != d.x_train.shape[1:]:
            raise InputError(
                f"Dataset {xn} is {x.dtype} {tuple(x.shape[1:])} per sample but x_train "
                f"{d.x_train.dtype} {tuple(d.x_train.shape[1:])}; give every split alike"
            )
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or hi >= d.num_classes:
            raise InputError(
                f"Dataset {part} labels reach [{lo}, {hi}] but num_classes is {d.num_classes}: "
                f"labels are classes 0..{d.num_classes - 1}"
            )


def val_positions(n_train: int, labels: np.ndarray | None = None) -> np.ndarray:
    """Which of n_train training samples (by position) are held out for validation: every
    VAL_EVERY-th (j % 10 == 9), or stratified by class when `labels` are given (a user's data,
    whose order may cycle through the classes: `every_of_class`), none when n_train <
    VAL_MIN_TRAIN. Positions, not a random draw: the split is the same on every run and
    machine, and for digits (already a stratified shuffle) and the other specs (interleaved)
    it spreads over classes and sources."""
    if n_train < VAL_MIN_TRAIN:
        return np.zeros(n_train, dtype=bool)
    if labels is not None:
        return every_of_class(labels, VAL_EVERY)
    return np.arange(n_train) % VAL_EVERY == VAL_EVERY - 1


def every_of_class(labels: np.ndarray, every: int) -> np.ndarray:
    """Every every-th sample with the samples ordered by class (each class's in the data's
    order), a class's second in place of its first: a fixed split that keeps each class's
    share and keeps every class in what is left, whatever order the samples come in. By position alone, labels that
    cycle 0..9 would put all of classes 4 and 9 in an every-5th test split and none in
    training."""
    y = np.asarray(labels).reshape(-1)
    order = np.argsort(y, kind="stable")  # each class's samples together, in data order
    ys = y[order]
    first = np.r_[True, ys[1:] != ys[:-1]] if len(ys) else np.zeros(0, dtype=bool)
    hit = np.arange(len(ys)) % every == every - 1
    # A class's first sample stays; its second goes in its place (when it has one), so the
    # share stays a fixed 1/every of the samples.
    moved = np.flatnonzero(hit & first)
    moved = moved[(moved + 1 < len(ys)) & ~np.r_[first, True][moved + 1]]
    hit &= ~first
    hit[moved + 1] = True
    picked = np.zeros(len(y), dtype=bool)
    picked[order] = hit
    return picked


def check_labels(data: Dataset, num_classes: int, model_name: str) -> None:
    """Fail when the data has more classes than a (loaded) model can predict."""
    if data.num_classes > num_classes:
        raise InputError(
            f"--data {data.spec!r}: labels reach {data.num_classes - 1} but model {model_name} "
            f"predicts {num_classes} classes (0..{num_classes - 1})"
        )


def _forward_params(model: torch.nn.Module | type) -> list[inspect.Parameter]:
    """The parameters of a model's (or model class's) forward, `self` left out; none when it
    has no forward to read (a factory function that builds the model)."""
    forward = getattr(model, "forward", None)
    if forward is None:
        return []
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):  # a C-implemented or wrapped forward: nothing to read
        return []
    if isinstance(model, type) and params and params[0].name == "self":
        params = params[1:]
    return params


def _vocab_argument(model: torch.nn.Module) -> str:
    """The constructor argument that sets the vocabulary size, as the model's class names it
    (`vocab_size` for the zoo's and Hugging Face's, `vocab` or `n_tokens` in a user's), or
    "a vocabulary size" when no argument's name says so."""
    import inspect

    try:
        params = list(inspect.signature(type(model).__init__).parameters)
    except (TypeError, ValueError):
        params = []
    named = [p for p in params if "vocab" in p.lower() or p.lower() in ("n_tokens", "num_tokens")]
    return named[0] if named else "a vocabulary size"


def input_name(name: str | None, consent: str | None) -> str | None:
    """The forward argument of model `name` (e.g. `ids` for textcls): an npz array of that name
    is the model's input, under every command alike. Code named by import path is imported
    only with the user's consent (`consent`, the --model the user gave, naming it); without it
    None, and building the model refuses next with the reason."""
    if name is None or (":" in name and name != consent):
        return None
    from compresskit.models import zoo

    return forward_input(zoo.resolve(name))


def forward_input(model: torch.nn.Module | type) -> str | None:
    """The name of the first positional argument of the model's forward (e.g. `ids` for
    textcls, `input_ids` for BERT-style models): the npz array `load` may take as input."""
    for p in _forward_params(model):
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return p.name
    return None


def check_one_input(model: torch.nn.Module | type, model_name: str) -> None:
    """Refuse a model whose forward needs two or more arguments: compress feeds one tensor."""
    required = [
        p.name
        for p in _forward_params(model)
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.default is p.empty
    ]
    if len(required) > 1:
        raise InputError(
            f"model {model_name}: forward needs {len(required)} arguments ({', '.join(required)}) "
            "but compress feeds one input tensor (images, or int64 token ids); give the others "
            "defaults, or wrap the model so it derives them from the one input (a mask from a "
            "padding id, as zoo model textcls does)"
        )


def check_kind(model_name: str, data: Dataset, flag: str = "--model") -> None:
    """Before building a model for `data`: refuse a zoo model (or a class with an `input_kind`
    attribute) that reads images when the data are token ids, or the other way round."""
    from compresskit.models import zoo

    cls = zoo.resolve(model_name)
    kind = zoo.input_kind(model_name) if ":" not in model_name else None
    kind = kind or getattr(cls, "input_kind", None)
    if kind not in zoo.INPUT_KINDS or (kind == "tokens") == data.is_tokens:
        return
    gives = "int64 token ids" if data.is_tokens else "images"
    others = sorted(n for n in zoo.available() if zoo.input_kind(n) != kind)
    if kind == "tokens" and _user_arrays(data):  # float arrays of ids, not images
        if str(data.spec).startswith("npz:"):  # x is pixels or features, integers included
            raise InputError(
                f"{flag} {model_name} reads token ids but --data {data.spec} gives images or "
                "features: an npz's x is read as such, integers as 8-bit pixels; store token "
                "ids as int64 in an array named input_ids (input_ids_test for the test split)"
            )
        raise InputError(
            f"{flag} {model_name} reads token ids but --data {data.spec} gives float arrays "
            "(read as images or features); token ids are integers: pass "
            "x.astype(numpy.int64)"
        )
    raise InputError(
        f"{flag} {model_name} reads {'token ids' if kind == 'tokens' else 'images'} but --data "
        f"{data.spec} gives {gives}; use a model for {gives} ({', '.join(others)}) or other data"
    )


def embedding_rows(model: torch.nn.Module) -> int | None:
    """How many token ids the model can look up: its `vocab_size`, else the rows of its first
    nn.Embedding; None when it has neither."""
    size = getattr(model, "vocab_size", None)
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            return m.num_embeddings
    return None


def _user_arrays(data: Dataset) -> bool:
    """Whether the inputs are the user's own arrays (an npz, or arrays given in Python), not
    built-in images."""
    return str(data.spec).split(":")[0] not in ("digits", "mnist", "tokens")


def _layout_hint(data: Dataset) -> str:
    """How float arrays reach a model, for a model that did not take them: a 3-D array gains a
    channel axis, so (N, 1, L) signals arrive as (N, 1, 1, L) and (N, T, F) sequences, read
    like (N, H, W) images, as (N, 1, T, F)."""
    shape = tuple(data.in_shape)
    if data.is_tokens or len(shape) != 3 or shape[0] != 1:
        return ""
    if not _user_arrays(data):
        return ""  # built-in images: nothing to say beyond their shape
    if shape[1] == 1:
        return (
            f"; --data gives (N, 1, L) signals as (N, 1, 1, {shape[2]}): a Conv1d or recurrent "
            "model begins forward with x = x[:, 0] (or store them as (N, L) features, which "
            "reach the model as given)"
        )
    return (
        f"; --data gives 3-D arrays (N, T, F) as (N, 1, {shape[1]}, {shape[2]}): a model of "
        "sequences begins forward with x = x[:, 0]"
    )


def check_fits(model: torch.nn.Module, data: Dataset, model_name: str, trains: bool = True) -> None:
    """Fail with one line when `data` cannot go through `model` (arguments, shape, token ids
    beyond its vocabulary, class count), or when its output is not one (batch, classes) tensor
    of logits.

    Runs forward passes on one and two training samples in eval mode and, for a model that
    `trains`, on two in training mode (an auxiliary head returns a tuple there only). The
    training-mode pass leaves the model as it found it: buffers (BatchNorm statistics) are put
    back and torch's generator (dropout) is forked.
    """
    check_one_input(model, model_name)
    what = "token ids" if data.is_tokens else "inputs" if _user_arrays(data) else "images"
    rows = embedding_rows(model)
    hint = ""  # when the data and the model look like different kinds of input
    if not data.is_tokens and rows is not None:
        hint = (
            "; the model looks up token ids (it has an nn.Embedding): store them in the npz "
            "as int64 input_ids (input_ids_test), not x, which holds images"
        )
    elif data.is_tokens and rows is None:
        hint = "; it has no nn.Embedding to look token ids up in: give it float inputs"
        if str(data.spec).startswith("arrays"):  # Python's integer (N, L) x reads as ids
            hint += (
                " (integer (N, L) arrays given in Python are token ids: pass "
                "x.astype(numpy.float32) for features)"
            )
    want = getattr(model, "in_shape", None)
    if want is not None and tuple(want) == (1, 1, *data.in_shape) and not data.is_tokens:
        hint = (
            "; compress gave (N, F) features as (N, 1, 1, F) before 2026-11-29 and gives them "
            "as (N, F) now: train the model again on them (or store x as (N, 1, 1, F))"
        )
    if want is not None and tuple(want) != tuple(data.in_shape):
        raise InputError(
            f"--data {data.spec!r} gives {what} of shape {tuple(data.in_shape)} but model "
            f"{model_name} was built for {tuple(want)}{hint}"
        )
    if data.is_tokens and rows is not None and data.vocab > rows:
        raise InputError(
            f"--data {data.spec!r}: token ids reach {data.vocab - 1} but model {model_name} "
            f"embeds {rows} ids (0..{rows - 1}); build it with "
            f"{_vocab_argument(model)} >= {data.vocab} (--model-kwargs), or give data of a "
            "smaller vocabulary"
        )
    floats = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if not data.is_tokens and floats and data.x_train.dtype not in floats:
        # "Input type (FloatTensor) and weight type (DoubleTensor)" read as a shape problem
        raise InputError(
            f"model {model_name} has {', '.join(sorted(str(d) for d in floats))} weights and "
            f"--data {data.spec!r} gives {data.x_train.dtype} inputs; compress works in "
            "float32: pass model.float()"
        )
    was_training = model.training
    try:
        model.eval()
        out = _forward(model, data, 2, what, hint, model_name)
        _check_output(out, 2, model_name, data, hint)
        one = _forward(model, data, 1, what, hint, model_name)
        if not isinstance(one, torch.Tensor) or tuple(one.shape) != (1, out.shape[1]):
            got = tuple(one.shape) if isinstance(one, torch.Tensor) else type(one).__name__
            raise InputError(
                f"model {model_name} returns {got} for a batch of 1 but "
                f"{tuple(out.shape)} for a batch of 2: its forward drops the batch axis "
                "(a .squeeze() of an (N, C, 1, 1) head does at batch 1); use .flatten(1)"
            )
        if trains:
            kept = [b.detach().clone() for b in model.buffers()]
            model.train()
            try:
                with torch.random.fork_rng(devices=[]):
                    out = _forward(model, data, 2, what, hint, model_name, " in training mode")
            finally:
                with torch.no_grad():
                    for b, k in zip(model.buffers(), kept, strict=True):
                        b.copy_(k)
            _check_output(out, 2, model_name, data, hint, " in training mode")
    finally:
        model.train(was_training)
    if out.shape[1] >= 2 and _probabilities(out):
        raise InputError(
            f"model {model_name} returns probabilities (each row is >= 0 and sums to 1): "
            "train and shrink need logits, as cross-entropy takes them; end forward before "
            "the softmax and apply it in your app (log_softmax may stay)"
        )
    check_labels(data, out.shape[1], model_name)


def _forward(model, data: Dataset, n: int, what: str, hint: str, model_name: str, mode=""):
    try:
        with torch.no_grad():
            return model(data.x_train[:n])
    except Exception as e:  # the model's own code decides what it raises
        detail = (str(e).strip().splitlines() or [type(e).__name__])[0]
        hint = hint or _layout_hint(data)
        raise InputError(
            f"--data {data.spec!r}: {what} of shape {tuple(data.in_shape)} do not fit model "
            f"{model_name}{mode} ({type(e).__name__}: {detail[:200]}){hint}"
        ) from None


def _check_output(out, n: int, model_name: str, data: Dataset, hint: str, mode="") -> None:
    if not isinstance(out, torch.Tensor) or out.ndim != 2 or out.shape[0] != n:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        if isinstance(out, dict | tuple | list):
            # bench scores a "logits" entry of several outputs; training needs the one tensor
            hint = (
                "; train and shrink need the logits alone: return them from forward (a "
                "Hugging Face model: .logits), keeping other outputs for your own code"
                if not mode
                else "; train and shrink need the logits alone in training mode too: build it "
                "without its auxiliary heads (torchvision's GoogLeNet: aux_logits=False)"
            )
        if (
            isinstance(out, torch.Tensor)
            and out.ndim > 2
            and out.shape[0] == n
            and all(d == 1 for d in out.shape[2:])
        ):
            # bench scores such a head's files; training needs the one (batch, classes) tensor
            hint = "; a 1x1-convolution head returns (N, C, 1, 1): end forward with .flatten(1)"
        hint = hint or _layout_hint(data)
        raise InputError(
            f"model {model_name} returns {got} for a batch of {n}{mode}; "
            "compress trains single-label classifiers: one tensor of shape (batch, classes)"
            f"{hint}"
        )


def _probabilities(out: torch.Tensor) -> bool:
    """Every row non-negative and summing to 1: a softmax output, not logits."""
    out = out.detach().float()
    return bool((out >= -1e-6).all() and ((out.sum(1) - 1).abs() < 1e-4).all())
