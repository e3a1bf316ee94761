"""The `.dcz` archive: a Deep Compression model in one file that decodes back bit for bit
(Han, Mao & Dally, ICLR 2016, stage 3: Huffman coding of weight indices and sparse structure).

Byte layout (all integers little-endian):

    offset  size  field
    0       8     magic  89 44 43 5A 0D 0A 1A 0A  ("\\x89DCZ\\r\\n\\x1a\\n": binary, catches
                  newline translation and truncation to 7 bits, as PNG's)
    8       2     format version (u16) = 1
    10      4     header length H (u32)
    14      H     header: zlib-compressed UTF-8 JSON {"model": spec, "metadata": {...}}
    14+H    4     tensor count T (u32)
    ...           T tensor records, in state_dict order (below)
    end-4   4     CRC32 (zlib.crc32) of every byte before it

Tensor record:

    u16 name length, name (UTF-8)
    u8  dtype of the tensor when decoded (see DTYPES)
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
             (canonical Huffman, MSB first, zero-padded to a byte; see compressor.huffman)

Entries are the non-zeros in row-major order; gap symbol s < 2^b-1 means "s zeros, then the
next entry", and 2^b-1 is an escape: "2^b-1 zeros, no entry" (in place of the paper's filler
zero, so the index stream carries real weights only). The decoded weight is codebook[index] at
each entry's position and +0.0 elsewhere.

A wrong magic, a newer version, a bad checksum, a truncated file or an inconsistent record is
an `InputError` naming the file: a damaged archive never decodes to a wrong model.
"""

from __future__ import annotations

import io
import json
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compressor import huffman
from models.errors import InputError
from models.fileio import atomic_path

MAGIC = b"\x89DCZ\r\n\x1a\n"
VERSION = 1
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
class Encoded:
    """What `encode` measured, for the report."""

    bytes: int
    header_bytes: int
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)


def _fp16_exact(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and bool(torch.equal(t.half().float(), t))


def encode(
    entries: list[Dense | Shared], spec: dict[str, Any], metadata: dict[str, Any]
) -> tuple[bytes, Encoded]:
    """Serialise entries; return the archive bytes and per-layer stream sizes."""
    out = io.BytesIO()
    header = zlib.compress(
        json.dumps({"model": spec, "metadata": metadata}, separators=(",", ":")).encode(), 9
    )
    out.write(MAGIC + struct.pack("<HI", VERSION, len(header)) + header)
    out.write(struct.pack("<I", len(entries)))
    stats = Encoded(bytes=0, header_bytes=len(MAGIC) + 6 + len(header) + 4 + 4)
    for e in entries:
        start = out.tell()
        name = e.name.encode()
        dtype = e.tensor.dtype if isinstance(e, Dense) else torch.float32
        shape = tuple(e.tensor.shape) if isinstance(e, Dense) else e.shape
        out.write(struct.pack("<H", len(name)) + name)
        out.write(struct.pack("<BB", DTYPES.index(dtype), len(shape)))
        out.write(struct.pack(f"<{len(shape)}I", *shape))
        if isinstance(e, Dense):
            t = e.tensor.detach().cpu().contiguous()
            stored = torch.float16 if e.store_fp16 and _fp16_exact(t) else t.dtype
            raw = _raw(t.to(stored))
            out.write(struct.pack("<BBI", 0, DTYPES.index(stored), len(raw)) + raw)
        else:
            out.write(struct.pack("<B", 1))
            stats.layers[e.name] = _write_shared(out, e)
        stats.layers.setdefault(e.name, {})["record_bytes"] = out.tell() - start
    body = out.getvalue()
    data = body + struct.pack("<I", zlib.crc32(body))
    stats.bytes = len(data)
    return data, stats


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


def write(path: str | os.PathLike, entries, spec, metadata) -> Encoded:
    data, stats = encode(entries, spec, metadata)
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return stats


# --- reading --------------------------------------------------------------------------------


@dataclass
class Decoded:
    spec: dict[str, Any]
    metadata: dict[str, Any]
    state_dict: dict[str, torch.Tensor]


class _Reader:
    def __init__(self, data: bytes, path: str) -> None:
        self.data, self.pos, self.path = data, 0, path

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise InputError(
                f"{self.path}: archive is truncated or damaged (record runs past the end)"
            )
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def unpack(self, fmt: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt)))


def read(path: str | os.PathLike) -> Decoded:
    """Decode an archive into a model spec, metadata and a state_dict."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such archive")
    return decode(path.read_bytes(), str(path))


def decode(data: bytes, path: str = "archive") -> Decoded:
    if not data.startswith(MAGIC):
        raise InputError(f"{path}: not a compress archive (.dcz): wrong magic bytes")
    if len(data) < len(MAGIC) + 10:
        raise InputError(f"{path}: archive is truncated")
    (version,) = struct.unpack_from("<H", data, len(MAGIC))
    if version > VERSION:
        raise InputError(
            f"{path}: archive format version {version} is newer than this compress reads ({VERSION}); upgrade compress"
        )
    body, (crc,) = data[:-4], struct.unpack("<I", data[-4:])
    if zlib.crc32(body) != crc:
        raise InputError(f"{path}: checksum mismatch: the archive is truncated or corrupted")
    r = _Reader(body, path)
    r.take(len(MAGIC) + 2)
    (hlen,) = r.unpack("I")
    try:
        header = json.loads(zlib.decompress(r.take(hlen)))
    except (zlib.error, ValueError):
        raise InputError(f"{path}: archive header is damaged") from None
    (count,) = r.unpack("I")
    state: dict[str, torch.Tensor] = {}
    for _ in range(count):
        name, tensor = _read_record(r)
        state[name] = tensor
    if r.pos != len(body):
        raise InputError(f"{path}: {len(body) - r.pos} unexpected bytes after the last record")
    return Decoded(header.get("model", {}), header.get("metadata", {}), state)


def _dtype(r: _Reader, code: int) -> torch.dtype:
    if code >= len(DTYPES):
        raise InputError(f"{r.path}: unknown dtype code {code}")
    return DTYPES[code]


def _read_record(r: _Reader) -> tuple[str, torch.Tensor]:
    (nlen,) = r.unpack("H")
    name = r.take(nlen).decode("utf-8", errors="replace")
    dcode, ndim = r.unpack("BB")
    dtype = _dtype(r, dcode)
    shape = r.unpack(f"{ndim}I")
    numel = int(np.prod(shape, dtype=np.int64))
    (encoding,) = r.unpack("B")
    if encoding == 0:
        scode, nbytes = r.unpack("BI")
        stored = _dtype(r, scode)
        raw = r.take(nbytes)
        if stored == torch.bfloat16:
            t = torch.from_numpy(np.frombuffer(raw, "<i2").copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.frombuffer(raw, _NP[stored]).copy())
        if t.numel() != numel:
            raise InputError(f"{r.path}: tensor {name}: {t.numel()} values for shape {shape}")
        return name, t.to(dtype).reshape(shape)
    if encoding != 1:
        raise InputError(f"{r.path}: tensor {name}: unknown encoding {encoding}")
    (k,) = r.unpack("H")
    codebook = np.frombuffer(r.take(4 * k), "<f4").copy()
    gap_bits, n, g = r.unpack("BII")
    index_lengths = np.frombuffer(r.take(k), np.uint8)
    gap_lengths = np.frombuffer(r.take(2**gap_bits if gap_bits else 0), np.uint8)
    ib, gb = r.unpack("II")
    index_stream, gap_stream = r.take(ib), r.take(gb)
    try:
        index = huffman.decode(index_stream, index_lengths, n)
        if gap_bits:
            positions = huffman.decode_gaps(huffman.decode(gap_stream, gap_lengths, g), gap_bits)
        else:
            positions = np.arange(n, dtype=np.int64)
    except ValueError as e:
        raise InputError(f"{r.path}: tensor {name}: damaged stream ({e})") from None
    if len(positions) != n or (n and (positions[-1] >= numel or index.max() >= k)):
        raise InputError(f"{r.path}: tensor {name}: streams do not fit shape {shape}")
    weight = Shared(name, shape, codebook, index, positions, gap_bits).weight()
    return name, weight.to(dtype)
