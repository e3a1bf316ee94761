"""`.dcz` format 3: the records of `compressor.archive` range-coded under adaptive models.

Byte layout (after the 8-byte magic; varints are unsigned LEB128):

    u16     format version = 3
    varint  H, then H bytes: the header JSON (as format 2: model, metadata, tensor names),
            raw DEFLATE (no zlib wrapper: 6 bytes the CRC below already covers)
    varint  T, then T directory records, in state_dict order:
              u8 dtype (archive.DTYPES), u8 ndim, ndim varints shape, u8 encoding
              dense (0):  u8 stored dtype, u8 plane models (entropy.SHARED / OWN)
              shared (1): varint k, u8 codebook plane models, varint n (kept weights),
                          u8 mask mode (entropy.MASK_*), u8 index mode (entropy.INDEX_*)
              alias (2):  varint j, an earlier dense or shared record (a tied weight)
    varint  W, then W little-endian u32 words: one range-coded stream holding every record's
            symbols in directory order (a dense tensor's byte planes; a shared tensor's
            codebook planes, its mask, its cluster indices)
    u32     CRC32 of every byte before it

Everything a decoder must know before it allocates (shapes, counts, modes) is in the directory,
checked against the file's size and the element cap first. Models and modes are in
`compressor.entropy`. The reader re-encodes what it decoded in the modes the directory names and
refuses a file that does not come out byte for byte the same: no stream is read two ways. Modes
are the encoder's choice (from float code-length estimates, so two machines may pick
differently near a margin; both files are valid), and a mode that codes nothing (an index mode
for k < 2) is not checked.

Decoding time scales with the elements a file declares, at most the element cap, not with its
size: a range coder spends far under a bit on a near-certain symbol, so a 100-byte file can
declare a 16M-position mask (0.4 s to decode). The cap bounds it, as it bounds memory.
"""

from __future__ import annotations

import math
import struct
import zlib
from typing import Any

import numpy as np

from compresskit.compressor import entropy

DENSE, SHARED, ALIAS = 0, 1, 2


def varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def deflate(text: bytes) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, -15, 9)
    return c.compress(text) + c.flush()


def inflater() -> Any:
    return zlib.decompressobj(-15)


def columns(shape: tuple[int, ...]) -> int:
    """Inputs per output unit: the columns a mask or index context model steps through."""
    return _grid(tuple(shape))[1]


def _grid(shape: tuple[int, ...]) -> tuple[int, int]:
    """Rows x columns of a weight: output units x everything they read."""
    numel = math.prod(shape)
    if not numel:
        return 0, 0
    rows = shape[0] if shape else 1
    return rows, numel // rows


def mask_of(shape: tuple[int, ...], positions: np.ndarray) -> np.ndarray:
    rows, cols = _grid(shape)
    m = np.zeros(rows * cols, bool)
    m[positions] = True
    return m.reshape(rows, cols)


class Writer:
    """Codes records into one range-coded stream, the byte-plane models carried from record to
    record (`fork` prices a record without changing them)."""

    def __init__(self) -> None:
        self.enc = entropy.RangeEncoder()
        self.planes = entropy.Planes()

    def bits(self) -> int:
        return int(self.enc.num_bits())

    def fork(self) -> Writer:
        """A writer in this one's model state with an empty stream: what a record would cost
        next in this archive, without changing it."""
        twin = Writer()
        twin.planes.models = {k: [m.copy() for m in ms] for k, ms in self.planes.models.items()}
        return twin

    def dense(self, raw: bytes, itemsize: int, mode: int | None = None, dtype: int = 0) -> int:
        """Code a dense tensor's bytes; `dtype` (its stored dtype's code) keys the shared models,
        so float32 and int32 tensors never train each other's."""
        return self._planes(entropy.planes_of(raw, itemsize), f"dense:{dtype}", mode)

    def _planes(self, planes: np.ndarray, family: str, mode: int | None) -> int:
        if mode is None and self.bits() == 0:  # nothing coded yet: keep the winning trial
            mode, self.enc = self.planes.encode_first(planes, family)
            return mode
        return self.planes.encode(self.enc, planes, family, mode)

    def drop_stream(self) -> None:
        """Forget what was coded, keep the models: all a pricing context needs of its records
        (`archive.ArchiveContext`; `fork` copies only the models)."""
        self.enc = entropy.RangeEncoder()

    def dense_bits(self, raw: bytes, itemsize: int, dtype: int = 0) -> float:
        """`dense`'s bits estimated, not coded: nothing changes (`Planes.estimate_bits`)."""
        return self.planes.estimate_bits(entropy.planes_of(raw, itemsize), f"dense:{dtype}")

    def codebook(self, codebook: np.ndarray, mode: int | None = None) -> int:
        """Code a codebook's float32 byte planes; return their plane-model mode."""
        planes = entropy.planes_of(np.asarray(codebook, "<f4").tobytes(), 4)
        return self._planes(planes, "codebook", mode)

    def shared(self, shape, codebook, index, positions, modes: tuple[int, int, int] | None = None):
        """Code one shared record; return (codebook mode, mask mode, index mode) and the bits
        each part took. `modes` forces the modes (a reader re-encoding what a file names);
        otherwise the encoder picks them."""
        k = len(codebook)
        b0 = self.bits()
        cmode = self.codebook(codebook, None if modes is None else modes[0])
        b1 = self.bits()
        mask = mask_of(shape, positions)
        mmode = entropy.choose_mask(mask) if modes is None else modes[1]
        entropy.encode_mask(self.enc, mask, mmode)
        b2 = self.bits()
        index = np.asarray(index, np.int64)
        imode = entropy.choose_index(mask, index, k) if modes is None else modes[2]
        entropy.encode_index(self.enc, mask, index, k, imode)
        b3 = self.bits()
        return (cmode, mmode, imode), (b1 - b0, b2 - b1, b3 - b2)

    def words(self) -> np.ndarray:
        return np.asarray(self.enc.get_compressed(), "<u4")


def record_head(dtype_code: int, shape: tuple[int, ...], encoding: int) -> bytes:
    return (
        struct.pack("<BB", dtype_code, len(shape))
        + b"".join(map(varint, shape))
        + bytes([encoding])
    )


def dense_dir(stored_code: int, mode: int) -> bytes:
    return bytes([stored_code, mode])


def shared_dir(k: int, n: int, modes: tuple[int, int, int]) -> bytes:
    cmode, mmode, imode = modes
    return varint(k) + bytes([cmode]) + varint(n) + bytes([mmode, imode])


def stream_bytes(words: np.ndarray) -> bytes:
    return varint(len(words)) + words.astype("<u4").tobytes()


def assemble(version: int, header: bytes, count: int, directory: bytes, words: np.ndarray) -> bytes:
    from compresskit.compressor.archive import MAGIC

    body = (
        MAGIC
        + struct.pack("<H", version)
        + varint(len(header))
        + header
        + varint(count)
        + directory
        + stream_bytes(words)
    )
    return body + struct.pack("<I", zlib.crc32(body))


class Reader:
    """Decodes the stream record by record, in directory order."""

    def __init__(self, words: np.ndarray) -> None:
        self.dec = entropy.RangeDecoder(np.asarray(words, np.uint32))
        self.planes = entropy.Planes()

    def dense(self, itemsize: int, n: int, mode: int, dtype: int = 0) -> bytes:
        planes = self.planes.decode(self.dec, itemsize, n, f"dense:{dtype}", mode)
        return entropy.bytes_of(planes)

    def shared(self, shape, k: int, n: int, modes: tuple[int, int, int]):
        cmode, mmode, imode = modes
        raw = entropy.bytes_of(self.planes.decode(self.dec, 4, k, "codebook", cmode))
        codebook = np.frombuffer(raw, "<f4").copy()
        rows, cols = _grid(shape)
        mask = entropy.decode_mask(self.dec, rows, cols, n, mmode)
        if int(mask.sum()) != n:
            raise ValueError(f"the mask keeps {int(mask.sum()):,} weights, not {n:,}")
        index = entropy.decode_index(self.dec, mask, n, k, imode)
        positions = np.flatnonzero(mask.ravel())
        return codebook, index, positions
