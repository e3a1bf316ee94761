"""The `.dcz` archive: a Deep Compression model in one file that decodes back bit for bit
(Han, Mao & Dally, ICLR 2016, stage 3: entropy coding of weight indices and sparse structure).

Every format starts with the magic 89 44 43 5A 0D 0A 1A 0A ("\\x89DCZ\\r\\n\\x1a\\n": binary,
catches newline translation and truncation to 7 bits, as PNG's), a u16 format version, and ends
with the CRC32 (zlib.crc32) of every byte before it. All integers are little-endian.

Format 3 (written by default; `compressor/dcz3.py`, models in `compressor/entropy.py`):

    u16     version = 3
    varint  H, then H bytes: raw-DEFLATE UTF-8 JSON
            {"model": spec, "metadata": {...}, "tensors": [name, ...]}
    varint  T, then T directory records, the i-th named tensors[i]:
              u8 dtype when decoded (DTYPES), u8 ndim, ndim varints shape, u8 encoding
              dense (0):  u8 stored dtype (float16 only when exact), u8 byte-plane models
              shared (1): varint k (codebook size), u8 codebook byte-plane models,
                          varint n (kept weights), u8 mask mode, u8 index mode
              alias (2):  varint j < i, a dense or shared record whose tensor this is (a
                          tied weight, stored once; dtype and shape repeat record j's);
                          it codes nothing, and decodes to record j's very tensor
    varint  W, then W u32 words: one range-coded stream, every record's symbols in order
    u32     CRC32

A dense tensor is coded as byte planes (most significant first) under adaptive models; a shared
one as its codebook (float32 byte planes), its mask (kept positions, column by column: i.i.d.
or in the context of the zeros before each bit in its row) and its cluster indices (order-0, or
in the context of the left neighbour's index, in 8 buckets). No code tables: every model learns
as it codes. Varints are unsigned LEB128. docs/archive-format.md, "Decoding format 3", gives
the range coder's arithmetic and every model's constants: enough to write a decoder without
this code (tests/dcz_reference.py is one, checked against this module in every mode).
Measured against format 2 on the same records: 6.6 % smaller on LeNet-300-100, 2.7 % on LeNet-5
(14.1 % and 7.6 % after soft weight-sharing, whose 2-3-bit alphabets Huffman codes worst), 1.1 % on
ResNet-18, 7.1 % on MobileNetV2, 13.5 % on a 2-layer BERT, 18.0 % on a small residual CNN with SE
blocks (`benchmarks/archive_formats.py`, docs/benchmarks.md).

Format 2 (`[huffman] coder = "huffman"`, the paper's coding; still read and written):

    offset  size  field
    8       2     format version (u16) = 2
    10      4     header length H (u32)
    14      H     header: zlib-compressed UTF-8 JSON, as format 3's
    14+H    4     tensor count T (u32), the length of "tensors"
    ...           T tensor records, the i-th named tensors[i] (below)
    end-4   4     CRC32

Records come in the order of the header's "tensors": the model's state_dict order, except that
a pruned weight follows its module's other tensors (a reader takes any order). DTYPES, by code:
0 float32, 1 float16, 2 bfloat16, 3 float64, 4 int64, 5 int32, 6 int16, 7 int8, 8 uint8, 9 bool.

Format 2 tensor record:

    u8  dtype of the tensor when decoded (DTYPES)
    u8  ndim, then ndim x u32 shape
    u8  encoding: 0 = dense, 1 = shared
    dense:   u8 stored dtype (DTYPES; float16 only when the values are exactly
             representable), u32 byte count, raw little-endian values
    shared:  u16 k, k x f32 codebook (in index order)
             u8  gap bits b (0: no zeros, every position is an entry, no gap stream)
             u32 entries n (non-zero weights), u32 gap symbols g (entries + escapes)
             k bytes: Huffman code length of each codebook index (0 = unused)
             2^b bytes (b > 0): code length of each gap symbol 0..2^b-1
             u32 index stream bytes, u32 gap stream bytes, then the two streams
             (canonical Huffman as DEFLATE's, RFC 1951 3.2.2: used symbols sorted by
             (length, symbol) take consecutive codes; lengths at most 24; codes packed MSB
             first, zero-padded to a byte; the count, not the data's end, ends a stream)

Version 1 (still read, no longer written) kept each name in its record, as u16 length + UTF-8
before the dtype, and had no "tensors" in the header. Version 2 moved the names into the
deflated header: names share long prefixes ("blocks.3.se.expand.bias"), and on a 4,310-parameter
residual CNN with 96 tensors the raw names were 2,504 of the archive's 10,977 bytes.

Entries are the non-zeros in row-major order; gap symbol s < 2^b-1 means "s zeros, then the
next entry", and 2^b-1 is an escape: "2^b-1 zeros, no entry" (in place of the paper's filler
zero, so the index stream carries real weights only). The first gap counts from position 0;
no escape follows the last entry (the zeros after it are implied). The decoded weight is
codebook[index] at each entry's position and +0.0 elsewhere.

A wrong magic, a newer version, a bad checksum, a truncated file or an inconsistent record is
an `InputError` naming the file: a damaged archive never decodes to a wrong model.

Integrity: the CRC32 catches damage (a flipped bit, a cut download), not tampering. Anyone can
write an archive with a valid checksum, and it decodes to the weights its author chose. To know
that an archive is the one you were sent, compare its SHA-256 (`sha256` in `report.json`, the
same as `sha256sum model.dcz`) through a channel you trust: `compress decode --expect SHA`.

Crafted files: the reader trusts no count in the file. Every length, shape and count is checked
against what the remaining bytes can hold before anything is allocated (format 2: a stream of
B bytes codes at most 8B symbols; a dense record's byte count is numel x itemsize; format 3: the
directory's counts against the shapes, the stream's word count against the file), the header
inflates to at most 1 MiB and must be the JSON object above (nesting depth <= 32), all tensors
together declare at most 2^31 elements unless the cap is raised (`--max-elements`,
$COMPRESS_MAX_ELEMENTS), and the file must be in the one form `encode` writes (format 2: optimal
code lengths for its symbols, zero padding bits; format 3: the decoded tensors re-encode to the
very bytes read; both: a stored dtype that is the tensor's own or exact float16, canonical
header JSON): an archive that decodes re-encodes to the same bytes. `compress decode` builds the
model the header names on the meta device first and checks every record's name and shape
against it before decoding the record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compresskit.compressor import dcz3, entropy, huffman
from compresskit.models import limits
from compresskit.models.errors import InputError
from compresskit.models.fileio import atomic_path

MAGIC = b"\x89DCZ\r\n\x1a\n"
VERSION = 3  # the version `encode` writes by default; the reader takes 1, 2 and 3
HUFFMAN_VERSION = 2  # the last format with Huffman-coded streams (`[huffman] coder = "huffman"`)
DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_NP = {
    torch.float32: "<f4",
    torch.float16: "<f2",
    torch.float64: "<f8",
    torch.int64: "<i8",
    torch.int32: "<i4",
    torch.int16: "<i2",
    torch.int8: "i1",
    torch.uint8: "u1",
    torch.bool: "?",
}


@dataclass
class Dense:
    name: str
    tensor: torch.Tensor
    store_fp16: bool = False  # store float32 as float16 when every value is exactly representable


@dataclass
class Shared:
    """A weight-shared layer: codebook, codebook index of each entry, entry positions."""

    name: str
    shape: tuple[int, ...]
    codebook: np.ndarray  # float32 (k,)
    index: np.ndarray  # int (n,) into codebook, entries in row-major order
    positions: np.ndarray  # int (n,) flat positions of the entries
    gap_bits: int  # 0: dense (positions are 0..N-1)

    def weight(self) -> torch.Tensor:
        flat = torch.zeros(int(np.prod(self.shape)), dtype=torch.float32)
        flat[torch.from_numpy(self.positions.astype(np.int64))] = torch.from_numpy(
            self.codebook[self.index]
        )
        return flat.view(self.shape)


@dataclass
class Alias:
    """A tensor that is an earlier record's own tensor under another name (a tied weight:
    `b.weight = a.weight`). Format 3 stores it once and decodes both names to one tensor, as
    torch.save does; formats 1 and 2 store it again, as a copy of the record it names."""

    name: str
    of: str  # the earlier record's name


Entry = Dense | Shared | Alias


@dataclass
class Encoded:
    """What `encode` measured, for the report."""

    bytes: int
    header_bytes: int
    sha256: str = ""  # of the whole file, as `sha256sum` prints it
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)


def _fp16_exact(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and bool(torch.equal(t.half().float(), t))


def stored_dtype(e: Dense) -> torch.dtype:
    """The dtype a dense record stores: float16 when asked and exact, else the tensor's own."""
    t = e.tensor.detach().cpu()
    return torch.float16 if e.store_fp16 and _fp16_exact(t) else t.dtype


def record_size(e: Dense | Shared, version: int = VERSION, context: Any = None) -> int:
    """Bytes of `e`'s record in an archive, framing (dtype, shape) included: what choosing
    between a shared and a dense record compares. (Its name, in the header, costs the same
    either way.) In format 3 a record's stream depends on the records before it (their byte
    planes train shared models): `context`, an `ArchiveContext` holding them, prices `e` as the
    next record; without one, as the archive's first. Format 3's figure counts the range
    coder's 32-bit words (flush included), so it is exact to 4 bytes."""
    if version >= 3:
        return _priced(context, e, b"exact", lambda: _coded_size(e, context))
    out = io.BytesIO()
    _write_record(out, e, version)
    return out.tell()


# A dense record's estimated size (`dense_size_estimate`) this far over its rival's exact one
# cannot be the smaller: the estimate is at most 8 bytes (the coder's flush) over the coded
# size, since every symbol is priced at the coder's quantized floor (`entropy._Model.bits`).
# Twice the flush is margin enough; no share of the size is needed (it was 1 % until the
# estimate was made a bound: ResNet-18's 8-bit convs sit 0.1-1.4 % under dense float16, and
# each was range-coded dense twice in every shrink, 2.9 s of its pricing).
ESTIMATE_SLACK = 0.0
ESTIMATE_BYTES = 16


def _coded_size(e: Dense | Shared, context: Any) -> int:
    w = dcz3.Writer() if context is None else context.writer.fork()
    head = _write_record_v3(w, e)[0]
    return len(head) + (w.bits() + 7) // 8


def dense_size_estimate(e: Dense, context: Any = None) -> float:
    """`record_size(e, 3, context)` estimated from its byte planes' code length under the same
    models (`entropy.Planes.estimate_bits`), without range coding them: for pricing a dense
    record against a shared one that is plainly smaller (a 2.36M-weight ResNet-18 conv: 7.8 MB
    of float32 planes against well under 1 MB shared at 5 bits)."""
    return _priced(context, e, b"estimate", lambda: _estimated_size(e, context))


def _estimated_size(e: Dense, context: Any) -> float:
    t = e.tensor.detach().cpu().contiguous()
    stored = stored_dtype(e)
    w = dcz3.Writer() if context is None else context.writer
    bits = w.dense_bits(_raw(t.to(stored)), stored.itemsize, DTYPES.index(stored))
    head = dcz3.record_head(DTYPES.index(t.dtype), tuple(t.shape), dcz3.DENSE)
    return len(head) + len(dcz3.dense_dir(DTYPES.index(stored), 0)) + bits / 8 + 8


def _priced(context: Any, e: Dense | Shared, kind: bytes, price: Callable[[], Any]) -> Any:
    """`price()`, or the figure a context sharing `context.prices` found for the same record
    after the same records before it."""
    if context is None or context.prices is None:
        return price()
    key = context.key(e, kind)
    if key not in context.prices:
        context.prices[key] = price()
    return context.prices[key]


def digest(e: Dense | Shared) -> bytes:
    """A 16-byte digest of what a record's coded bytes depend on (not its name: the header
    holds names): kind, shape, dtype and storage, values. Cached on the record."""
    cached = e.__dict__.get("_digest")
    if cached is not None:
        return cached
    h = hashlib.blake2b(digest_size=16)
    if isinstance(e, Dense):
        t = e.tensor.detach().cpu().contiguous()
        h.update(f"D{t.dtype}{tuple(t.shape)}{e.store_fp16}".encode())
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    else:
        h.update(f"S{tuple(e.shape)}{e.gap_bits}".encode())
        for a in (e.codebook, e.index, e.positions):
            a = np.ascontiguousarray(a)
            h.update(f"{a.dtype}{a.shape}".encode())
            h.update(memoryview(a).cast("B"))
    e.__dict__["_digest"] = d = h.digest()
    return d


def sizes(shared: Shared, dense: Dense, version: int, context: Any = None) -> tuple[int, int, bool]:
    """(shared bytes, dense bytes, whether the dense figure is an estimate) of one layer's two
    records, priced as the next record of `context`. The shared record is always coded; the
    dense one only where its estimate comes within `ESTIMATE_SLACK` and `ESTIMATE_BYTES` of the
    shared size, so the choice between them is the one exact pricing makes."""
    s = record_size(shared, version, context)
    return (s, *dense_size(dense, s, version, context))


def dense_size(dense: Dense, rival: int, version: int, context: Any = None) -> tuple[int, bool]:
    """Bytes of `dense`'s record against a rival record of `rival` bytes, and whether the figure
    is an estimate (only where the estimate is plainly the larger, so never the one chosen)."""
    if version >= 3:
        guess = dense_size_estimate(dense, context)
        if guess > rival * (1 + ESTIMATE_SLACK) + ESTIMATE_BYTES:
            return round(guess), True
    return record_size(dense, version, context), False


class ArchiveContext:
    """The records written so far, for pricing the next one as the archive will code it
    (`record_size(e, version, context)`); `add` the record chosen.

    `prices`, a dict shared by contexts that price the same records (`shrink`'s choice of
    float16 codebooks, then its choice of records): a record priced after the same records
    before it is looked up, not coded again (keys: `digest`s of those records and of it)."""

    def __init__(self, version: int = VERSION, prices: dict | None = None) -> None:
        self.version = version
        self.writer = dcz3.Writer()
        self.prices = prices
        self._history = hashlib.blake2b(digest_size=16)

    def key(self, e: Dense | Shared, kind: bytes) -> bytes:
        h = self._history.copy()
        h.update(kind + digest(e))
        return h.digest()

    def add(self, e: Entry) -> None:
        if self.version < 3 or isinstance(e, Alias):  # an alias codes nothing
            return
        if self.prices is not None:
            self._history.update(digest(e))
        # Only the byte-plane models carry over to the next record (a shared record's mask and
        # indices are coded with models of their own, so they need not be coded again here),
        # and a fresh stream lets the writer keep its winning trial instead of coding again.
        self.writer.drop_stream()
        if isinstance(e, Dense):
            _write_record_v3(self.writer, e)
            return
        self.writer.codebook(e.codebook)


def encode(
    entries: list[Dense | Shared],
    spec: dict[str, Any],
    metadata: dict[str, Any],
    version: int = VERSION,
    modes: list[Any] | None = None,
) -> tuple[bytes, Encoded]:
    """Serialise entries; return the archive bytes and per-layer stream sizes. `version` 1 and
    2 write the older Huffman layouts, for re-encoding what `decode` read and for
    `[huffman] coder = "huffman"`. `modes` (format 3, `Decoded.modes`): code each record in
    the modes a file named, instead of choosing them."""
    if version not in (1, 2, 3):
        raise ValueError(f"archive format version {version}: compress writes 1, 2 or 3")
    if version == 3:
        return _encode_v3(entries, spec, metadata, modes)
    entries = _copies(entries)
    out = io.BytesIO()
    names = [e.name for e in entries] if version >= 2 else None
    header = zlib.compress(_header_text(spec, metadata, names), 9)
    out.write(MAGIC + struct.pack("<HI", version, len(header)) + header)
    out.write(struct.pack("<I", len(entries)))
    stats = Encoded(bytes=0, header_bytes=len(MAGIC) + 6 + len(header) + 4 + 4)
    for e in entries:
        start = out.tell()
        layer = _write_record(out, e, version)
        if layer is not None:
            stats.layers[e.name] = layer
        stats.layers.setdefault(e.name, {})["record_bytes"] = out.tell() - start
    body = out.getvalue()
    data = body + struct.pack("<I", zlib.crc32(body))
    stats.bytes = len(data)
    stats.sha256 = hashlib.sha256(data).hexdigest()
    return data, stats


def _copies(entries: list[Entry]) -> list[Dense | Shared]:
    """Formats 1 and 2 have no alias record: each alias becomes a copy of the record it names."""
    by_name = {e.name: e for e in entries}
    return [
        dataclasses.replace(by_name[e.of], name=e.name) if isinstance(e, Alias) else e
        for e in entries
    ]


def _write_record(out: io.BytesIO, e: Dense | Shared, version: int) -> dict[str, Any] | None:
    """Write one tensor record; a shared record returns its stream sizes for the report."""
    dtype = e.tensor.dtype if isinstance(e, Dense) else torch.float32
    shape = tuple(e.tensor.shape) if isinstance(e, Dense) else e.shape
    if version == 1:
        name = e.name.encode()
        out.write(struct.pack("<H", len(name)) + name)
    out.write(struct.pack("<BB", DTYPES.index(dtype), len(shape)))
    out.write(struct.pack(f"<{len(shape)}I", *shape))
    if isinstance(e, Dense):
        t = e.tensor.detach().cpu().contiguous()
        stored = stored_dtype(e)
        raw = _raw(t.to(stored))
        out.write(struct.pack("<BBI", 0, DTYPES.index(stored), len(raw)) + raw)
        return None
    out.write(struct.pack("<B", 1))
    return _write_shared(out, e)


def _encode_v3(
    entries: list[Dense | Shared],
    spec: dict[str, Any],
    metadata: dict[str, Any],
    modes: list[Any] | None = None,
) -> tuple[bytes, Encoded]:
    """Format 3; `modes` (one per entry, as a directory names them) forces the encoder's
    choices, so a reader can check a file's streams whatever heuristics wrote it."""
    header = dcz3.deflate(_header_text(spec, metadata, [e.name for e in entries]))
    w = dcz3.Writer()
    directory = io.BytesIO()
    layers: dict[str, dict[str, Any]] = {}
    where = {e.name: i for i, e in enumerate(entries)}
    for i, e in enumerate(entries):
        if isinstance(e, Alias):
            j = where.get(e.of, i)
            if j >= i or isinstance(entries[j], Alias):
                raise ValueError(f"{e.name} aliases {e.of}, which is not an earlier record")
            head = _alias_head(entries[j], j)
            directory.write(head)
            layers[e.name] = {"alias_of": e.of, "record_bytes": len(head)}
            continue
        start = w.bits()
        head, layer = _write_record_v3(w, e, None if modes is None else modes[i])
        directory.write(head)
        # Whole bytes, as format 2 reports them (the coder counts 32-bit words).
        layers[e.name] = {**(layer or {}), "record_bytes": len(head) + (w.bits() - start) // 8}
    words = w.words()
    data = dcz3.assemble(3, header, len(entries), directory.getvalue(), words)
    stats = Encoded(
        bytes=len(data),
        header_bytes=len(data) - 4 * len(words),
        sha256=hashlib.sha256(data).hexdigest(),
        layers=layers,
    )
    return data, stats


def _alias_head(target: Dense | Shared, j: int) -> bytes:
    """An alias's directory record: the dtype and shape of record `j`, which it repeats so
    that a reader checks them like any record's, then `j`."""
    if isinstance(target, Dense):
        dtype, shape = target.tensor.dtype, tuple(target.tensor.shape)
    else:
        dtype, shape = torch.float32, tuple(target.shape)
    return dcz3.record_head(DTYPES.index(dtype), shape, dcz3.ALIAS) + dcz3.varint(j)


def _write_record_v3(
    w: dcz3.Writer, e: Dense | Shared, forced: Any = None
) -> tuple[bytes, dict[str, Any] | None]:
    """Code `e` into `w`'s stream (in the modes `forced` names, else the encoder's choice);
    return its directory bytes and, for a shared record, the bits each part took."""
    if isinstance(e, Dense):
        t = e.tensor.detach().cpu().contiguous()
        stored = stored_dtype(e)
        mode = w.dense(_raw(t.to(stored)), stored.itemsize, forced, DTYPES.index(stored))
        head = dcz3.record_head(DTYPES.index(t.dtype), tuple(t.shape), dcz3.DENSE)
        return head + dcz3.dense_dir(DTYPES.index(stored), mode), None
    index = np.asarray(e.index, np.int64)
    modes, (cb_bits, mask_bits, index_bits) = w.shared(
        e.shape, e.codebook, index, e.positions, forced
    )
    head = dcz3.record_head(DTYPES.index(torch.float32), tuple(e.shape), dcz3.SHARED)
    head += dcz3.shared_dir(len(e.codebook), len(index), modes)
    k, numel = len(e.codebook), math.prod(e.shape)
    counts = np.bincount(index, minlength=k) if k else np.zeros(0)
    return head, {
        "entries": len(index),
        "mask_mode": modes[1],
        "index_mode": modes[2],
        # Named as format 2's, so reports read either: "gap" is the positions' stream.
        "index_stream_bits": index_bits,
        "gap_stream_bits": mask_bits,
        "index_entropy_bits": huffman.entropy_bits(counts) if len(index) else 0.0,
        "gap_entropy_bits": entropy.iid_bits(len(index), numel),
        "index_stream_bytes": index_bits // 8,
        "gap_stream_bytes": mask_bits // 8,
        "table_bytes": len(head) + cb_bits // 8,
    }


def _raw(t: torch.Tensor) -> bytes:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().astype("<i2").tobytes()
    return t.numpy().astype(_NP[t.dtype]).tobytes()


def _write_shared(out: io.BytesIO, e: Shared) -> dict[str, Any]:
    k = len(e.codebook)
    index_counts = np.bincount(e.index, minlength=k)
    index_lengths = huffman.code_lengths(index_counts)
    index_stream = huffman.encode(e.index, index_lengths)
    out.write(struct.pack("<H", k) + np.asarray(e.codebook, "<f4").tobytes())
    if e.gap_bits:
        gaps = huffman.encode_gaps(e.positions, e.gap_bits)
        gap_counts = np.bincount(gaps, minlength=2**e.gap_bits)
        gap_lengths = huffman.code_lengths(gap_counts)
        gap_stream = huffman.encode(gaps, gap_lengths)
    else:
        gaps, gap_counts, gap_lengths, gap_stream = (
            np.zeros(0, np.int64),
            np.zeros(0),
            np.zeros(0, np.uint8),
            b"",
        )
    out.write(struct.pack("<BII", e.gap_bits, len(e.index), len(gaps)))
    out.write(index_lengths.astype(np.uint8).tobytes() + gap_lengths.astype(np.uint8).tobytes())
    out.write(struct.pack("<II", len(index_stream), len(gap_stream)) + index_stream + gap_stream)
    return {
        "entries": len(e.index),
        "gap_symbols": len(gaps),
        "index_stream_bits": huffman.stream_bits(e.index, index_lengths),
        "gap_stream_bits": huffman.stream_bits(gaps, gap_lengths) if len(gaps) else 0,
        "index_entropy_bits": huffman.entropy_bits(index_counts),
        "gap_entropy_bits": huffman.entropy_bits(gap_counts) if len(gaps) else 0.0,
        "index_stream_bytes": len(index_stream),
        "gap_stream_bytes": len(gap_stream),
        "table_bytes": 2 + 4 * k + k + len(gap_lengths) + 1 + 8 + 8,
    }


def write(path: str | os.PathLike, entries, spec, metadata, version: int = VERSION) -> Encoded:
    data, stats = encode(entries, spec, metadata, version)
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return stats


# --- reading --------------------------------------------------------------------------------
#
# The reader trusts nothing in the file: every count, shape and length is checked against what
# the bytes can hold before anything is allocated, the header is inflated under a size limit,
# and the file must be in the one form `encode` writes (optimal code lengths, zero padding,
# canonical header JSON), so a file that decodes re-encodes to the same bytes: nothing is
# silently reinterpreted. CRC32 catches damage, not tampering (docs/archive-format.md).

# The inflated header is a model spec and a little metadata: a few kB in practice.
MAX_HEADER_BYTES = 1 << 20


@dataclass
class Decoded:
    spec: dict[str, Any]
    metadata: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    # The records as `encode` takes them (only with keep_entries=True): encode(entries, spec,
    # metadata) gives back the same bytes.
    entries: list[Dense | Shared] | None = None
    sha256: str = ""  # of the whole file, as `sha256sum` prints it
    version: int = VERSION  # the file's format version (encode(..., version) re-writes it)
    modes: list[Any] | None = None  # format 3: each record's modes (encode(..., modes=...))


UNCHECKED_FLOOR = 1 << 22  # elements any archive may declare unchecked
UNCHECKED_PER_BYTE = 1024  # and per byte of it (LeNet-300-100: 12, ResNet-18: about 10)


class _Reader:
    def __init__(self, data: bytes, path: str, max_elements: int) -> None:
        self.data, self.pos, self.path = data, 0, path
        self.elements_left = max_elements
        self.max_elements = max_elements
        # Elements the archive may declare while no model vouches for its shapes (`expect`
        # None): range coding turns a 116-byte file into a 2^27-element tensor (36 s, 3.1 GB
        # to decode), so there the file's size bounds them too. None: the caller set the cap.
        self.unchecked_left: int | None = None
        self.expect: dict[str, tuple[int, ...]] | None = None
        self.model = ""
        self.names: list[str] | None = None  # version 2: the header's; 1: each record's own

    def fail(self, what: str) -> InputError:
        return InputError(
            f"{self.path}: {what}; the archive is damaged or was not written by compress"
        )

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise InputError(
                f"{self.path}: archive is truncated or damaged (record runs past the end)"
            )
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def left(self) -> int:
        return len(self.data) - self.pos

    def varint(self) -> int:
        """An unsigned LEB128 integer below 2^63."""
        value = 0
        for shift in range(0, 63, 7):
            (b,) = self.take(1)
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
        raise self.fail("a count is longer than 9 bytes")

    def unpack(self, fmt: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt)))


def expected_sha256(text: str) -> str:
    """The hash a user gave (`--expect`): 64 hex digits, as `sha256sum` prints them, alone or
    with the rest of its line ("HASH  model.dcz") or a "sha256:" prefix. Anything else was
    reported as "not the archive you were given", the archive blamed for a pasting slip."""
    words = str(text).split()
    token = words[0] if words else ""
    token = token.lstrip("\\").lower().removeprefix("sha256:")
    if len(token) != 64 or any(c not in "0123456789abcdef" for c in token):
        shown = str(text) if len(str(text)) <= 80 else f"{str(text)[:60]}..."
        raise InputError(
            f"--expect {shown!r}: give the archive's SHA-256 as the 64 hex digits "
            "`sha256sum model.dcz` prints"
        )
    return token


def read(path: str | os.PathLike, **options: Any) -> Decoded:
    """Decode an archive file into a model spec, metadata and a state_dict (see `decode`)."""
    path = Path(path)
    if options.get("sha256") is not None:
        expected_sha256(options["sha256"])  # a malformed --expect, before the file is read
    if path.is_dir():
        raise InputError(f"{path}: a folder, not an archive; give the .dcz file in it")
    if not path.is_file():
        raise InputError(f"{path}: no such archive")
    with open(path, "rb") as f:  # the magic bytes first: a 5 GB file of anything else was
        head = f.read(len(MAGIC))  # read whole (1.8 GB of RSS, or MemoryError) to say so
    if head != MAGIC:
        return decode(head, str(path), **options)  # says what the file is not
    return decode(path.read_bytes(), str(path), **options)


def decode(
    data: bytes,
    path: str = "archive",
    *,
    max_elements: int | None = None,
    keep_entries: bool = False,
    expect: Callable[[dict[str, Any]], dict[str, tuple[int, ...]] | None] | None = None,
    sha256: str | None = None,
) -> Decoded:
    """Decode archive bytes; any malformed or crafted input is an `InputError` naming `path`.

    `max_elements` caps the tensor elements the archive may declare in all (default
    `models.limits.max_elements()`: 2^31, or $COMPRESS_MAX_ELEMENTS). `expect`, given the
    header's model spec, returns the state_dict shapes that model has (or None to skip): each
    record's name and shape is then checked before the record is allocated, so a small file
    cannot make the reader build a large tensor its model does not have. `sha256`, when given,
    must be the file's SHA-256 (hex), checked before anything else.
    """
    want = expected_sha256(sha256) if sha256 is not None else None
    got = hashlib.sha256(data).hexdigest()
    if want is not None and got != want:
        raise InputError(
            f"{path}: SHA-256 is {got}, not the {want} expected: this is not the "
            "archive you were given (or the expected hash is wrong)"
        )
    if not data.startswith(MAGIC):
        raise InputError(f"{path}: not a compress archive (.dcz): wrong magic bytes")
    if len(data) < len(MAGIC) + 10:
        raise InputError(f"{path}: archive is truncated")
    (version,) = struct.unpack_from("<H", data, len(MAGIC))
    if version > VERSION:
        raise InputError(
            f"{path}: archive format version {version} is newer than this compress reads ({VERSION}); upgrade compress"
        )
    if version < 1:
        raise InputError(f"{path}: archive format version {version} does not exist")
    body, (crc,) = data[:-4], struct.unpack("<I", data[-4:])
    if zlib.crc32(body) != crc:
        raise InputError(f"{path}: checksum mismatch: the archive is truncated or corrupted")
    r = _Reader(body, path, limits.max_elements() if max_elements is None else max_elements)
    if max_elements is None:  # legitimate archives hold about 10 elements per byte
        r.unchecked_left = UNCHECKED_FLOOR + UNCHECKED_PER_BYTE * len(data)
    r.take(len(MAGIC) + 2)
    if version == 3:
        return _decode_v3(r, data, expect, keep_entries, got)
    (hlen,) = r.unpack("I")
    spec, metadata, r.names = _read_header(r, r.take(hlen), version)
    r.expect = expect(spec) if expect else None
    r.model = spec["name"]
    (count,) = r.unpack("I")
    if r.names is not None and count != len(r.names):
        raise r.fail(f"header names {len(r.names):,} tensors, the file holds {count:,}")
    # A record takes at least 8 bytes (dtype, ndim, encoding, stored dtype, size), and in
    # version 1 two more for its name's length.
    if count > r.left() // (10 if version == 1 else 8):
        raise r.fail(f"header claims {count:,} tensors in {r.left():,} bytes")
    state: dict[str, torch.Tensor] = {}
    entries: list[Dense | Shared] = []
    for i in range(count):
        entry = _read_record(r, i)
        if entry.name in state:
            raise r.fail(f"tensor {entry.name!r} appears twice")
        state[entry.name] = entry.tensor if isinstance(entry, Dense) else entry.decoded
        if keep_entries:
            entries.append(entry.entry if isinstance(entry, _SharedRecord) else entry)
    if r.pos != len(body):
        raise InputError(f"{path}: {len(body) - r.pos} unexpected bytes after the last record")
    if r.expect is not None and len(state) != len(r.expect):
        missing = next(k for k in r.expect if k not in state)
        raise InputError(
            f"{path}: model {r.model} has tensor {missing!r}, which the archive lacks; "
            "the archive is damaged or names the wrong model"
        )
    return Decoded(spec, metadata, state, entries if keep_entries else None, got, version)


def _read_header(
    r: _Reader, raw: bytes, version: int
) -> tuple[dict[str, Any], dict[str, Any], list[str] | None]:
    """The header's spec, metadata and (version 2) tensor names: inflated under
    MAX_HEADER_BYTES, then checked."""
    inflater = dcz3.inflater() if version >= 3 else zlib.decompressobj()
    try:
        text = inflater.decompress(raw, MAX_HEADER_BYTES)
    except zlib.error:
        raise InputError(f"{r.path}: archive header is damaged (not DEFLATE data)") from None
    if inflater.unconsumed_tail:
        raise r.fail(f"header inflates past the {MAX_HEADER_BYTES:,}-byte limit")
    if not inflater.eof or inflater.unused_data:
        raise InputError(f"{r.path}: archive header is damaged (incomplete or trailing zlib data)")
    try:
        header = json.loads(text)
    except RecursionError:
        raise r.fail("header JSON is nested too deeply") from None
    except ValueError:  # bad UTF-8 or bad JSON
        raise InputError(f"{r.path}: archive header is damaged (not JSON)") from None
    keys = ["model", "metadata"] + (["tensors"] if version >= 2 else [])
    if not isinstance(header, dict) or list(header) != keys:
        raise r.fail(f"header is not a JSON object with keys {', '.join(keys)}")
    spec, metadata = header["model"], header["metadata"]
    names = header.get("tensors")
    if version >= 2 and (
        not isinstance(names, list) or not all(isinstance(n, str) and n for n in names)
    ):
        raise r.fail('header "tensors" is not a list of tensor names')
    if (
        not isinstance(spec, dict)
        or not isinstance(spec.get("name"), str)
        or not isinstance(spec.get("kwargs", {}), dict)
    ):
        raise r.fail('header "model" is not a model spec {"name": str, "kwargs": {...}}')
    if not isinstance(metadata, dict):
        raise r.fail('header "metadata" is not a JSON object')
    if limits.nesting_depth(header) > limits.MAX_NESTING:
        raise r.fail(f"header JSON is nested deeper than {limits.MAX_NESTING} levels")
    # The one text `encode` writes: other spellings (spaces, duplicate keys, 1e2) are refused.
    if _header_text(spec, metadata, names) != text:
        raise r.fail("header JSON is not in the form compress writes")
    return spec, metadata, names


def _decode_v3(
    r: _Reader,
    data: bytes,
    expect: Callable[[dict[str, Any]], dict[str, tuple[int, ...]] | None] | None,
    keep_entries: bool,
    sha: str,
) -> Decoded:
    """Format 3: header, directory (every count checked before anything is allocated), then
    the one range-coded stream, then the byte-for-byte re-encoding check."""
    spec, metadata, r.names = _read_header(r, r.take(r.varint()), 3)
    r.expect = expect(spec) if expect else None
    r.model = spec["name"]
    count = r.varint()
    if count != len(r.names):
        raise r.fail(f"header names {len(r.names):,} tensors, the file holds {count:,}")
    if len(set(r.names)) != len(r.names):
        twice = next(n for i, n in enumerate(r.names) if n in r.names[:i])
        raise r.fail(f"tensor {twice!r} appears twice")
    if count > r.left() // 4:  # dtype, ndim, encoding and an alias's varint at least
        raise r.fail(f"header claims {count:,} tensors in {r.left():,} bytes")
    plan: list[Any] = []
    for i in range(count):
        plan.append(_read_directory_v3(r, i, plan))
    words = r.varint()
    if 4 * words != r.left():
        raise r.fail(f"the stream holds {r.left():,} bytes, not {words:,} words")
    stream = np.frombuffer(r.take(4 * words), "<u4")
    reader = dcz3.Reader(stream)
    state: dict[str, torch.Tensor] = {}
    entries: list[Dense | Shared] = []
    forced = [
        rec[2] if rec[0] == dcz3.DENSE else rec[3] if rec[0] == dcz3.SHARED else None
        for *_, rec in plan
    ]
    for name, dtype, shape, numel, rec in plan:
        if rec[0] == dcz3.ALIAS:  # the very tensor of an earlier record, as torch.save keeps it
            of = r.names[rec[1]]
            state[name] = state[of]
            entries.append(Alias(name, of))
            continue
        try:
            if rec[0] == dcz3.DENSE:
                stored, mode = rec[1], rec[2]
                raw = reader.dense(stored.itemsize, numel, mode, DTYPES.index(stored))
                entry = _dense_from_raw(r, name, dtype, shape, stored, raw)
                value = entry.tensor
            else:
                k, n, modes = rec[1], rec[2], rec[3]
                codebook, index, positions = reader.shared(shape, k, n, modes)
                entry = Shared(name, shape, codebook, index, positions, 0 if n == numel else 8)
                value = entry.weight()
        except InputError:
            raise
        except Exception as e:  # the range decoder on damaged words, a mask that miscounts
            if isinstance(e, MemoryError) or "allocate" in str(e):  # no damage: too big here
                raise InputError(
                    f"{r.path}: tensor {name} of shape {list(shape)} ({numel:,} values) does "
                    "not fit in this machine's memory; decode it on a larger one, or lower "
                    f"the element cap (${limits.ENV_MAX_ELEMENTS}) to refuse such files sooner"
                ) from None
            raise InputError(f"{r.path}: tensor {name}: damaged stream ({e})") from None
        state[name] = value
        entries.append(entry)
    if r.expect is not None and len(state) != len(r.expect):
        missing = next(k for k in r.expect if k not in state)
        raise InputError(
            f"{r.path}: model {r.model} has tensor {missing!r}, which the archive lacks; "
            "the archive is damaged or names the wrong model"
        )
    # What decoded must re-encode to these very bytes, in the modes the directory names (the
    # encoder's choice of modes may improve between releases; the coding of a mode may not).
    if _encode_v3(entries, spec, metadata, forced)[0] != data:
        raise r.fail("its streams are not in the form compress writes")
    return Decoded(spec, metadata, state, entries if keep_entries else None, sha, 3, forced)


def _read_directory_v3(r: _Reader, i: int, before: list[Any]):
    """Record `i`'s directory entry (`before`: the records read so far, for an alias)."""
    name = r.names[i]
    dcode, ndim = r.unpack("BB")
    dtype = _dtype(r, dcode)
    if ndim > 32:
        raise r.fail(f"tensor {name}: {ndim} dimensions")
    shape = tuple(r.varint() for _ in range(ndim))
    if any(d >= 1 << 32 for d in shape):
        raise r.fail(f"tensor {name}: a dimension of 2^32 or more")
    (encoding,) = r.unpack("B")
    if encoding == dcz3.ALIAS:
        j = r.varint()
        if j >= i or before[j][4][0] == dcz3.ALIAS:
            raise r.fail(f"tensor {name}: an alias of record {j:,}, not of an earlier record")
        _, tdtype, tshape, numel, _ = before[j]
        if (tdtype, tshape) != (dtype, shape):
            raise r.fail(f"tensor {name}: an alias of {r.names[j]} with another dtype or shape")
        # Checked against the model like any record; no element counted: nothing is allocated.
        _check_shape(r, name, shape, count=False)
        return name, dtype, shape, numel, (dcz3.ALIAS, j)
    numel = _check_shape(r, name, shape)
    if encoding == dcz3.DENSE:
        scode, mode = r.unpack("BB")
        stored = _dtype(r, scode)
        if stored != dtype and not (stored == torch.float16 and dtype == torch.float32):
            raise r.fail(f"tensor {name}: {dtype} stored as {stored}")
        if mode not in (entropy.SHARED, entropy.OWN):
            raise r.fail(f"tensor {name}: unknown plane model {mode}")
        return name, dtype, shape, numel, (dcz3.DENSE, stored, mode)
    if encoding != dcz3.SHARED:
        raise InputError(
            f"{r.path}: tensor {name}: unknown encoding {encoding} (a newer compress may have "
            "written it: upgrade compress)"
        )
    if dtype != torch.float32:
        raise r.fail(f"tensor {name}: a shared tensor decodes to float32, not {dtype}")
    k = r.varint()
    (cmode,) = r.unpack("B")
    n = r.varint()
    mmode, imode = r.unpack("BB")
    bad = None
    if k >= 1 << 16:
        bad = f"a codebook of {k:,} values (at most 65,535)"
    elif n > numel:
        bad = f"{n:,} entries for {numel:,} positions"
    elif n and k == 0:
        bad = f"{n:,} entries and an empty codebook"
    elif cmode not in (entropy.SHARED, entropy.OWN):
        bad = f"unknown plane model {cmode}"
    elif mmode not in (entropy.MASK_NONE, entropy.MASK_IID, entropy.MASK_RUNS):
        bad = f"unknown mask mode {mmode}"
    elif (mmode == entropy.MASK_NONE) != (n == numel):
        bad = "a mask mode that does not fit the count of entries"
    elif imode not in (entropy.INDEX_ORDER0, entropy.INDEX_LEFT):
        bad = f"unknown index mode {imode}"
    elif (mmode == entropy.MASK_RUNS or imode == entropy.INDEX_LEFT) and dcz3.columns(
        shape
    ) > entropy.MAX_CONTEXT_COLUMNS:
        bad = f"a context mode over more than {entropy.MAX_CONTEXT_COLUMNS:,} columns"
    elif imode == entropy.INDEX_LEFT and k > entropy.MAX_CONTEXT_K:
        bad = f"left-neighbour contexts for a codebook of {k:,} (at most {entropy.MAX_CONTEXT_K})"
    if bad:
        raise InputError(
            f"{r.path}: tensor {name}: record does not fit shape {list(shape)} ({bad})"
        )
    return name, dtype, shape, numel, (dcz3.SHARED, k, n, (cmode, mmode, imode))


def _header_text(
    spec: dict[str, Any], metadata: dict[str, Any], names: list[str] | None = None
) -> bytes:
    header = {"model": spec, "metadata": metadata}
    if names is not None:
        header["tensors"] = names
    return json.dumps(header, separators=(",", ":")).encode()


def _dtype(r: _Reader, code: int) -> torch.dtype:
    if code >= len(DTYPES):
        raise InputError(f"{r.path}: unknown dtype code {code}")
    return DTYPES[code]


@dataclass
class _SharedRecord:
    name: str
    entry: Shared
    decoded: torch.Tensor


def _read_record(r: _Reader, i: int) -> Dense | _SharedRecord:
    if r.names is not None:
        name = r.names[i]
    else:
        (nlen,) = r.unpack("H")
        try:
            name = r.take(nlen).decode("utf-8")
        except UnicodeDecodeError:
            raise r.fail("a tensor name is not UTF-8") from None
        if not name:
            raise r.fail("a tensor has an empty name")
    dcode, ndim = r.unpack("BB")
    dtype = _dtype(r, dcode)
    if ndim > 32:  # as format 3 reads them (a crafted 65-dimension shape was echoed whole)
        raise r.fail(f"tensor {name}: {ndim} dimensions")
    shape = r.unpack(f"{ndim}I")
    numel = _check_shape(r, name, shape)
    (encoding,) = r.unpack("B")
    if encoding == 0:
        return _read_dense(r, name, dtype, shape, numel)
    if encoding != 1:
        raise InputError(f"{r.path}: tensor {name}: unknown encoding {encoding}")
    if dtype != torch.float32:
        raise r.fail(f"tensor {name}: a shared tensor decodes to float32, not {dtype}")
    entry = _read_shared(r, name, shape, numel)
    return _SharedRecord(name, entry, entry.weight())


def _check_shape(r: _Reader, name: str, shape: tuple[int, ...], count: bool = True) -> int:
    """The model's shape for `name` (when known) and, when `count`, the element cap, before
    allocating."""
    if r.expect is not None and r.expect.get(name) != shape:
        what = (
            f"shape {list(shape)}, model {r.model}'s is {list(r.expect[name])}"
            if name in r.expect
            else f"model {r.model} has no such tensor"
        )
        raise InputError(
            f"{r.path}: tensor {name}: {what}; the archive is damaged or names the wrong model"
        )
    numel = math.prod(shape)
    if not count:
        return numel
    # The cap is on all tensors together, checked before this one is allocated. An empty
    # tensor's other dims still set its strides, which must fit too.
    if numel > r.elements_left or math.prod(max(d, 1) for d in shape) > r.max_elements:
        raise InputError(
            f"{r.path}: tensor {name}: shape {list(shape)} takes the archive past "
            f"{r.max_elements:,} elements; if the model really is this large, raise the cap "
            f"(--max-elements, max_elements= in Python, or ${limits.ENV_MAX_ELEMENTS})"
        )
    if r.expect is None and r.unchecked_left is not None:
        if numel > r.unchecked_left:
            raise InputError(
                f"{r.path}: tensor {name}: shape {list(shape)} declares more elements than "
                f"{UNCHECKED_PER_BYTE:,} per byte of the archive while no model checks its "
                "shapes; pass --model NAME (your model's code; model= in Python) to check them, "
                "or --max-elements (max_elements=) to trust the file"
            )
        r.unchecked_left -= numel
    r.elements_left -= numel
    return numel


def _read_dense(r: _Reader, name: str, dtype: torch.dtype, shape, numel: int) -> Dense:
    scode, nbytes = r.unpack("BI")
    stored = _dtype(r, scode)
    # The writer stores a tensor as itself, or float32 as float16 when that is exact.
    as_fp16 = stored == torch.float16 and dtype == torch.float32
    if stored != dtype and not as_fp16:
        raise r.fail(f"tensor {name}: {dtype} stored as {stored}")
    if nbytes != numel * stored.itemsize:
        raise InputError(
            f"{r.path}: tensor {name}: {nbytes:,} bytes for shape {list(shape)} of {stored} "
            f"(needs {numel * stored.itemsize:,}); the archive is damaged"
        )
    return _dense_from_raw(r, name, dtype, shape, stored, r.take(nbytes))


def _dense_from_raw(r: _Reader, name: str, dtype: torch.dtype, shape, stored, raw: bytes) -> Dense:
    """A dense record's tensor from its stored bytes (float16 only where exact, bools 0/1)."""
    as_fp16 = stored == torch.float16 and dtype == torch.float32
    numel = math.prod(shape)
    if stored == torch.bfloat16:
        t = torch.from_numpy(np.frombuffer(raw, "<i2").copy()).view(torch.bfloat16)
    else:
        values = np.frombuffer(raw, _NP[stored])
        if stored == torch.bool and numel and values.view(np.uint8).max() > 1:
            raise r.fail(f"tensor {name}: a bool byte other than 0 or 1")
        t = torch.from_numpy(values.copy())
    t = t.to(dtype).reshape(shape)
    if as_fp16 and not _fp16_exact(t):  # NaN: the writer would have kept float32
        raise r.fail(f"tensor {name}: float16 storage of values that are not exact (NaN)")
    return Dense(name, t, store_fp16=as_fp16)


def _read_shared(r: _Reader, name: str, shape, numel: int) -> Shared:
    (k,) = r.unpack("H")
    codebook = np.frombuffer(r.take(4 * k), "<f4").copy()
    gap_bits, n, g = r.unpack("BII")
    if gap_bits > huffman.MAX_GAP_BITS:
        raise r.fail(f"tensor {name}: gap width {gap_bits} bits (at most {huffman.MAX_GAP_BITS})")
    index_lengths = np.frombuffer(r.take(k), np.uint8)
    gap_lengths = np.frombuffer(r.take(2**gap_bits if gap_bits else 0), np.uint8)
    ib, gb = r.unpack("II")
    index_stream, gap_stream = r.take(ib), r.take(gb)

    # What the streams can hold, before decoding allocates n or g symbols: every code takes at
    # least one bit; gap symbols are the entries plus escapes of 2^b - 1 zeros each.
    bad = None
    if n > numel:
        bad = f"{n:,} entries for {numel:,} positions"
    elif n > 8 * ib:
        bad = f"{n:,} entries coded in {ib:,} bytes"
    elif gap_bits == 0 and (n != numel or g or gb):
        bad = "a dense shared tensor (no gap stream) must have an entry at every position"
    elif gap_bits and not n <= g <= min(8 * gb, n + (numel - n) // (2**gap_bits - 1)):
        bad = f"{g:,} gap symbols for {n:,} entries in {gb:,} bytes and {numel:,} positions"
    elif n and k == 0:
        bad = f"{n:,} entries and an empty codebook"
    if bad:
        raise InputError(f"{r.path}: tensor {name}: streams do not fit shape {list(shape)} ({bad})")
    try:
        index = _decode_canonical(index_stream, index_lengths, n, k)
        if gap_bits:
            gaps = _decode_canonical(gap_stream, gap_lengths, g, 2**gap_bits)
            positions = huffman.decode_gaps(gaps, gap_bits)
        else:
            positions = np.arange(n, dtype=np.int64)
    except ValueError as e:
        raise InputError(f"{r.path}: tensor {name}: damaged stream ({e})") from None
    if len(positions) != n or (n and positions[-1] >= numel):
        raise InputError(f"{r.path}: tensor {name}: streams do not fit shape {list(shape)}")
    return Shared(name, tuple(shape), codebook, index, positions, gap_bits)


def _decode_canonical(stream: bytes, lengths: np.ndarray, n: int, alphabet: int) -> np.ndarray:
    """n symbols from a stream that must be exactly what `encode` writes for them.

    ValueError when the code lengths are not the optimal ones for the decoded symbols' counts,
    or the stream is longer than its codes or pads with anything but zero bits.
    """
    symbols = huffman.decode(stream, lengths, n)
    counts = np.bincount(symbols, minlength=alphabet)
    if not np.array_equal(huffman.code_lengths(counts), lengths):
        raise ValueError("code lengths are not the Huffman code of the symbols they code")
    bits = huffman.stream_bits(symbols, lengths)
    if len(stream) != (bits + 7) // 8:
        raise ValueError(f"{len(stream)} bytes for {bits} bits of codes")
    if bits % 8 and stream[-1] & ((1 << (8 - bits % 8)) - 1):
        raise ValueError("padding bits are not zero")
    return symbols
