"""A second `.dcz` decoder, written from docs/archive-format.md alone: no compresskit, no
constriction, symbol by symbol in plain Python. `tests/test_archive_reference.py` checks that it
decodes what `compressor.archive` writes to the same bits. It keeps the spec complete (an
implementer in another language has only the spec) and the format fixed: a new release of the
range coder library that quantizes probabilities another way would change the bytes, and this
decoder, which does its own arithmetic, would then disagree.

It checks structure only (no element caps, no re-encoding): a reference, not a hardened reader.
"""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np

MAGIC = b"\x89DCZ\r\n\x1a\n"
DTYPES = ["<f4", "<f2", "bf16", "<f8", "<i8", "<i4", "<i2", "i1", "u1", "?"]  # by code
SIZES = [4, 2, 2, 8, 8, 4, 2, 1, 1, 1]


class Bad(ValueError):
    pass


class _Bytes:
    def __init__(self, data: bytes, pos: int) -> None:
        self.data, self.pos, self.end = data, pos, len(data) - 4  # the CRC32 last

    def take(self, n: int) -> bytes:
        if self.pos + n > self.end:
            raise Bad("truncated")
        self.pos += n
        return self.data[self.pos - n : self.pos]

    def u(self, fmt: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def varint(self) -> int:  # unsigned LEB128
        value = shift = 0
        while True:
            byte = self.u("B")
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7


def _values(raw: bytes, code: int) -> np.ndarray:
    """Little-endian values of dtype `code`; bfloat16 as float32 (its bits are the top half)."""
    if DTYPES[code] == "bf16":
        return (np.frombuffer(raw, "<u2").astype("<u4") << 16).view("<f4")
    return np.frombuffer(raw, DTYPES[code])


def _as(values: np.ndarray, code: int) -> np.ndarray:
    """Stored values as the tensor's dtype (bfloat16 as float32, as `_values` gives it)."""
    return values.astype("<f4" if DTYPES[code] == "bf16" else DTYPES[code])


def decode(data: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """(header, {name: array}) of a .dcz file's bytes."""
    if data[:8] != MAGIC or len(data) < 14:
        raise Bad("not a .dcz")
    if zlib.crc32(data[:-4]) != struct.unpack("<I", data[-4:])[0]:
        raise Bad("checksum")
    version = struct.unpack_from("<H", data, 8)[0]
    if version not in (2, 3):
        raise Bad(f"version {version}")
    return (_decode_v2 if version == 2 else _decode_v3)(_Bytes(data, 10))


# --- format 2: canonical Huffman ------------------------------------------------------------


def _huffman(stream: bytes, lengths: list[int], count: int) -> list[int]:
    """`count` symbols of a canonical Huffman code (RFC 1951 3.2.2 order), MSB first."""
    codes, code, prev = {}, 0, 0
    for length, sym in sorted((n, s) for s, n in enumerate(lengths) if n):
        code <<= length - prev
        codes[(length, code)] = sym
        code, prev = code + 1, length
    bits = np.unpackbits(np.frombuffer(stream, np.uint8)).tolist()
    out, pos = [], 0
    for _ in range(count):
        code = length = 0
        while (length, code) not in codes:
            if pos >= len(bits) or length > 24:
                raise Bad("Huffman stream")
            code, length, pos = code << 1 | bits[pos], length + 1, pos + 1
        out.append(codes[(length, code)])
    return out


def _decode_v2(r: _Bytes) -> tuple[dict, dict[str, np.ndarray]]:
    header = json.loads(zlib.decompress(r.take(r.u("I"))))
    tensors = {}
    for name in header["tensors"][: r.u("I")]:
        dtype, ndim = r.u("B"), r.u("B")
        shape = tuple(r.u("I") for _ in range(ndim))
        numel = int(np.prod(shape))
        if r.u("B") == 0:
            stored = r.u("B")
            tensors[name] = _as(_values(r.take(r.u("I")), stored), dtype).reshape(shape)
            continue
        k = r.u("H")
        codebook = np.frombuffer(r.take(4 * k), "<f4")
        b, n, g = r.u("B"), r.u("I"), r.u("I")
        index_lengths = list(r.take(k))
        gap_lengths = list(r.take(1 << b)) if b else []
        index_bytes, gap_bytes = r.u("I"), r.u("I")
        index = _huffman(r.take(index_bytes), index_lengths, n)
        gaps = _huffman(r.take(gap_bytes), gap_lengths, g) if b else []
        positions, pos = [], 0
        for s in gaps:  # s zeros then an entry; the escape 2^b - 1: that many zeros, no entry
            pos += s
            if s != (1 << b) - 1:
                positions.append(pos)
                pos += 1
        flat = np.zeros(numel, "<f4")
        flat[positions if b else slice(None)] = codebook[index]
        tensors[name] = _as(flat, dtype).reshape(shape)
    return header, tensors


# --- format 3: the range coder and its models ----------------------------------------------

PRECISION = 24  # bits of every quantized probability


def _cdf(weights: list[int]) -> list[int]:
    """The quantized cumulative distribution of integer weights (the spec's formula)."""
    k, total = len(weights), float(sum(weights))
    scale = float((1 << PRECISION) - k) / total
    cdf, below = [], 0.0
    for i, w in enumerate(weights):
        cdf.append(int(below * scale) + i)
        below += float(w)
    return [*cdf, 1 << PRECISION]


class _RangeDecoder:
    """64-bit state, 32-bit words, as the spec describes."""

    def __init__(self, words: list[int]) -> None:
        self.words, self.next = words, 2
        padded = words[:2] + [0] * (2 - len(words[:2]))
        self.point, self.lower, self.range = padded[0] << 32 | padded[1], 0, (1 << 64) - 1

    def symbol(self, cdf: list[int]) -> int:
        scale = self.range >> PRECISION
        quantile = ((self.point - self.lower) % (1 << 64)) // scale
        lo, hi = 0, len(cdf) - 1  # the s with cdf[s] <= quantile < cdf[s + 1]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if cdf[mid] <= quantile else (lo, mid)
        self.lower = (self.lower + scale * cdf[lo]) % (1 << 64)
        self.range = scale * (cdf[lo + 1] - cdf[lo])
        if self.range < 1 << 32:
            word = self.words[self.next] if self.next < len(self.words) else 0
            self.next += 1
            self.lower = (self.lower << 32) % (1 << 64)
            self.range <<= 32
            self.point = ((self.point << 32) | word) % (1 << 64)
        return lo


class _Model:
    """Counts per context; a step's symbols decode grouped by context, then update."""

    def __init__(self, k: int, contexts: int = 1) -> None:
        self.counts = np.zeros((contexts, k), np.int64)

    def step(self, dec: _RangeDecoder, n: int, ctx: np.ndarray | None = None) -> np.ndarray:
        ctx = np.zeros(n, np.int64) if ctx is None else ctx
        sym = np.zeros(n, np.int64)
        for c in sorted(set(ctx.tolist())):
            cdf = _cdf((2 * self.counts[c] + 1).tolist())
            for i in np.flatnonzero(ctx == c):
                sym[i] = dec.symbol(cdf)
        np.add.at(self.counts, (ctx, sym), 1)
        return sym


def _planes(dec, models: list[_Model], n: int) -> bytes:
    planes = np.zeros((len(models), n), np.int64)
    for j, model in enumerate(models):
        start, seen = 0, int(model.counts.sum())
        while start < n:
            end = min(n, start + max(64, seen // 4))
            above = planes[0, start:end] if j == 1 else None
            planes[j, start:end] = model.step(dec, end - start, above)
            seen, start = seen + end - start, end
    return planes.T[:, ::-1].astype(np.uint8).tobytes()  # plane 0 is the most significant


def _fresh(itemsize: int) -> list[_Model]:
    return [_Model(256, 256 if j == 1 else 1) for j in range(itemsize)]


def _mask(dec, rows: int, cols: int, n: int, mode: int) -> np.ndarray:
    total = rows * cols
    if mode == 0:  # every position kept
        return np.ones((rows, cols), bool)
    if mode == 1:  # i.i.d.: nothing coded when the count alone says it all
        if n in (0, total):
            return np.full((rows, cols), n == total)
        cdf = _cdf([total - n, n])
        return np.array([dec.symbol(cdf) for _ in range(total)], bool).reshape(rows, cols)
    counts = np.zeros((13, 2), np.int64)
    counts[:, 1] = n * 16 // total
    counts[:, 0] = 16 - counts[:, 1]
    mask = np.zeros((rows, cols), bool)
    left, zeros = np.zeros(rows, bool), np.ones(rows, np.int64)
    for c in range(cols):  # row by row within a column, each bit under its row's context
        runs = np.floor(np.log2(np.maximum(zeros, 1))).astype(np.int64) + 1
        ctx = np.where(left, 0, np.minimum(runs, 12))
        cdfs = [_cdf((2 * counts[x] + 1).tolist()) for x in range(13)]
        bits = np.array([dec.symbol(cdfs[x]) for x in ctx.tolist()], np.int64)
        np.add.at(counts, (ctx, bits), 1)
        mask[:, c] = left = bits.astype(bool)
        zeros = np.where(left, 0, zeros + 1)
    return mask


def _indices(dec, mask: np.ndarray, n: int, k: int, mode: int) -> np.ndarray:
    if k < 2 or n == 0:
        return np.zeros(n, np.int64)
    if mode == 0:
        model, out, start, size = _Model(k), [], 0, 64.0
        while start < n:
            end = min(n, start + int(size))
            out.append(model.step(dec, end - start))
            start, size = end, size * 1.25
        return np.concatenate(out)
    grid = np.full(mask.shape, -1, np.int64)
    model, left = _Model(k, 9), np.full(mask.shape[0], -1, np.int64)
    for c in range(mask.shape[1]):
        kept = mask[:, c]
        ctx = np.where(left[kept] < 0, 8, np.maximum(left[kept], 0) * 8 // k)
        grid[kept, c] = model.step(dec, int(kept.sum()), ctx)
        left = grid[:, c]
    return grid[mask]


def _decode_v3(r: _Bytes) -> tuple[dict, dict[str, np.ndarray]]:
    header = json.loads(zlib.decompress(r.take(r.varint()), -15))
    names, records = header["tensors"], []
    for _ in range(r.varint()):
        dtype, ndim = r.u("B"), r.u("B")
        shape = tuple(r.varint() for _ in range(ndim))
        encoding = r.u("B")
        if encoding == 0:
            fields = (r.u("B"), r.u("B"))  # stored dtype, plane mode
        elif encoding == 1:
            fields = (r.varint(), r.u("B"), r.varint(), r.u("B"), r.u("B"))  # k, c, n, m, i
        elif encoding == 2:
            fields = (r.varint(),)  # the earlier record
        else:
            raise Bad(f"encoding {encoding}")
        records.append((dtype, shape, encoding, fields))
    words = np.frombuffer(r.take(4 * r.varint()), "<u4").tolist()
    dec, shared, tensors = _RangeDecoder(words), {}, {}

    def models(family: str, itemsize: int, mode: int) -> list[_Model]:
        if mode == 1:  # this tensor's own
            return _fresh(itemsize)
        return shared.setdefault((family, itemsize), _fresh(itemsize))  # the archive's

    for name, (dtype, shape, encoding, fields) in zip(names, records, strict=True):
        numel = int(np.prod(shape))
        if encoding == 2:
            tensors[name] = tensors[names[fields[0]]]
            continue
        if encoding == 0:
            stored, mode = fields
            raw = _planes(dec, models(f"dense:{stored}", SIZES[stored], mode), numel)
            tensors[name] = _as(_values(raw, stored), dtype).reshape(shape)
            continue
        k, cmode, n, mmode, imode = fields
        codebook = np.frombuffer(_planes(dec, models("codebook", 4, cmode), k), "<f4")
        rows = (shape[0] if shape else 1) if numel else 0
        mask = _mask(dec, rows, numel // rows if rows else 0, n, mmode)
        flat = np.zeros(numel, "<f4")
        flat[np.flatnonzero(mask)] = codebook[_indices(dec, mask, n, k, imode)]
        tensors[name] = _as(flat, dtype).reshape(shape)
    return header, tensors
