"""Fuzz the `.dcz` reader: every crafted archive must end as a clean refusal or a faithful decode.

    python benchmarks/fuzz_archive.py [--cases 100000] [--seed 0] [--max-elements 4194304]

Seeds are real archives (a pruned, weight-shared LeNet-5 through the shrink pipeline's own
entry builder, and one record of every kind the format has), each written in format 2 (Huffman)
and format 3 (range-coded), so both readers are fuzzed. Each case mutates one seed:
bit flips and byte overwrites (with and without the CRC recomputed), truncations, extensions,
structure-aware edits of one header or record field (counts, shapes, lengths, dtypes, gap
widths, code lengths, padding bits, set to boundary values), record splices (drop, repeat,
swap), and hostile headers (not an object, wrong types, deep nesting, a zip bomb, trailing
zlib data, other JSON spellings), all with the CRC recomputed so the checksum passes.

A case passes when `archive.decode` raises `InputError` (a refusal) or returns records that
`archive.encode` turns back into the same bytes (no silent reinterpretation), within the time
bound, and when the process's peak RSS stays under the memory bound. Anything else is a crash.
Prints the counts; exit status 1 if any case failed. `tests/test_archive_fuzz.py` runs 2,000
cases of the same generator in the default test run.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import struct
import sys
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from compresskit.compressor import archive, dcz3, kmeans, prune, recipe
from compresskit.compressor.shrink import _entries as shrink_entries
from compresskit.models import InputError, tiny

SPEC = {"name": "lenet5", "kwargs": {"in_shape": [1, 8, 8], "num_classes": 10}}
HEADER_AT = len(archive.MAGIC) + 6  # format 2: magic, u16 version, u32 header length


# --- seeds ----------------------------------------------------------------------------------


def seeds() -> list[bytes]:
    """Real archives: a shrunk LeNet-5 and one record of every kind."""
    model = tiny("lenet5", in_shape=(1, 8, 8))
    prune.prune_(model, prune.PruneConfig(sparsity=0.8))
    kmeans.share_weights_(model, kmeans.QuantizeConfig(conv_bits=4, fc_bits=3))
    entries, _ = shrink_entries(model, recipe.resolve({}))
    meta = {"test_accuracy": 0.97, "data": "digits"}

    g = np.random.default_rng(0)
    positions = np.sort(g.choice(600, 45, replace=False))
    codebook = np.sort(g.normal(size=15)).astype(np.float32)
    kinds = [
        archive.Shared("sparse.weight", (20, 30), codebook, g.integers(0, 15, 45), positions, 4),
        archive.Shared(
            "dense.weight", (3, 4), codebook[:4], g.integers(0, 4, 12), np.arange(12), 0
        ),
        archive.Shared(
            "one.weight", (2, 5), codebook[:1], np.zeros(3, int), np.array([1, 4, 9]), 2
        ),
        archive.Shared("empty.weight", (4, 4), codebook[:2], np.zeros(0, int), np.zeros(0, int), 3),
        archive.Shared("scalar.weight", (), codebook[:2], np.array([1]), np.array([0]), 0),
        archive.Dense("half.bias", torch.tensor([0.5, -0.25, 3.0]), store_fp16=True),
        archive.Dense("odd.bias", torch.tensor([0.1, 1e-8]), store_fp16=True),
        archive.Dense("bn.num_batches_tracked", torch.tensor(7)),
        archive.Dense("flags", torch.tensor([True, False])),
        archive.Dense("bf", torch.tensor([1.5, -2.0], dtype=torch.bfloat16)),
        archive.Dense("zero.size", torch.zeros(0, 3)),
    ]
    out = []
    for version in (2, 3):
        out.append(archive.encode(entries, SPEC, meta, version)[0])
        out.append(
            archive.encode(kinds, {"name": "x", "kwargs": {}}, {"note": "every kind"}, version)[0]
        )
    return out


# --- the archive's fields, for structure-aware mutations -------------------------------------


@dataclass
class Field:
    offset: int
    fmt: str  # struct format of an integer field, "" for a byte range
    size: int
    what: str


@dataclass
class Layout:
    fields: list[Field] = field(default_factory=list)
    records: list[tuple[int, int]] = field(default_factory=list)  # (start, end) of each record
    streams: list[tuple[int, int]] = field(default_factory=list)  # Huffman / range-coded streams
    version: int = 2
    count_at: int = 0  # where the tensor count starts


def layout(data: bytes) -> Layout:
    """Offsets of every field of a well-formed archive (the format in compressor/archive.py)."""
    out = Layout()
    pos = 0

    def num(fmt: str, what: str) -> int:
        nonlocal pos
        size = struct.calcsize("<" + fmt)
        out.fields.append(Field(pos, fmt, size, what))
        (v,) = struct.unpack_from("<" + fmt, data, pos)
        pos += size
        return v

    def span(n: int, what: str) -> None:
        nonlocal pos
        if n:
            out.fields.append(Field(pos, "", n, what))
        pos += n

    pos = len(archive.MAGIC)
    version = num("H", "version")
    if version == 3:
        return _layout_v3(data, out)
    hlen = num("I", "header length")
    span(hlen, "header")
    out.count_at = pos
    count = num("I", "tensor count")
    for _ in range(count):
        start = pos
        if version == 1:  # version 2 keeps the names in the header
            span(num("H", "name length"), "name")
        num("B", "dtype")
        ndim = num("B", "ndim")
        for i in range(ndim):
            num("I", f"dim {i}")
        if num("B", "encoding") == 0:
            num("B", "stored dtype")
            span(num("I", "dense bytes"), "dense values")
        else:
            k = num("H", "codebook size")
            span(4 * k, "codebook")
            b = num("B", "gap bits")
            num("I", "entries")
            num("I", "gap symbols")
            span(k, "index code lengths")
            span(2**b if b else 0, "gap code lengths")
            ib, gb = num("I", "index stream bytes"), num("I", "gap stream bytes")
            for n, what in ((ib, "index stream"), (gb, "gap stream")):
                if n:
                    out.streams.append((pos, pos + n))
                span(n, what)
        out.records.append((start, pos))
    assert pos == len(data) - 4, "seed is not a well-formed archive"
    return out


def _varint_at(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos


def _layout_v3(data: bytes, out: Layout) -> Layout:
    """Format 3 (compressor/dcz3.py): varints are byte ranges here (an overwrite mutates them)."""
    out.version = 3
    pos = len(archive.MAGIC) + 2

    def var(what: str) -> int:
        nonlocal pos
        v, end = _varint_at(data, pos)
        out.fields.append(Field(pos, "", end - pos, what))
        pos = end
        return v

    def num(fmt: str, what: str) -> int:
        nonlocal pos
        (v,) = struct.unpack_from("<" + fmt, data, pos)
        out.fields.append(Field(pos, fmt, struct.calcsize("<" + fmt), what))
        pos += struct.calcsize("<" + fmt)
        return v

    hlen = var("header length")
    out.fields.append(Field(pos, "", hlen, "header"))
    pos += hlen
    out.count_at = pos
    count = var("tensor count")
    for _ in range(count):
        start = pos
        num("B", "dtype")
        for i in range(num("B", "ndim")):
            var(f"dim {i}")
        if num("B", "encoding") == 0:
            num("B", "stored dtype")
            num("B", "plane models")
        else:
            var("codebook size")
            num("B", "codebook plane models")
            var("entries")
            num("B", "mask mode")
            num("B", "index mode")
        out.records.append((start, pos))
    words = var("stream words")
    if words:
        out.streams.append((pos, pos + 4 * words))
        out.fields.append(Field(pos, "", 4 * words, "stream"))
    pos += 4 * words
    assert pos == len(data) - 4, "seed is not a well-formed archive"
    return out


# --- mutations ------------------------------------------------------------------------------


def seal(body: bytes | bytearray) -> bytes:
    """Body plus a correct CRC32: the checksum passes, only the reader's checks remain."""
    return bytes(body) + struct.pack("<I", zlib.crc32(bytes(body)))


def _header_span(data: bytes) -> tuple[int, int, int]:
    """(start of the length field, start of the header, its end) of a well-formed archive."""
    at = len(archive.MAGIC) + 2
    if struct.unpack_from("<H", data, len(archive.MAGIC))[0] == 3:
        hlen, start = _varint_at(data, at)
        return at, start, start + hlen
    (hlen,) = struct.unpack_from("<I", data, at)
    return at, at + 4, at + 4 + hlen


def _names(data: bytes) -> list[str] | None:
    """A well-formed archive's tensor names from its header (version 2), else None."""
    _, start, end = _header_span(data)
    raw = data[start:end]
    text = zlib.decompress(raw, -15) if data[len(archive.MAGIC)] == 3 else zlib.decompress(raw)
    return json.loads(text).get("tensors")


def with_header(data: bytes, compressed: bytes) -> bytes:
    at, _, end = _header_span(data)
    if data[len(archive.MAGIC)] == 3:
        length = dcz3.varint(len(compressed))
    else:
        length = struct.pack("<I", len(compressed))
    return seal(data[:at] + length + compressed + data[end:-4])


def hostile_header(rng: np.random.Generator, names: list[str] | None = None) -> bytes:
    """A header JSON text that must be refused (or, the last, that decodes unchanged).
    `names`: the seed's tensor names (format version 2), None for a version 1 seed."""
    ok = {"model": SPEC, "metadata": {}} | ({"tensors": names} if names is not None else {})
    names = names or ["w"]
    v2 = lambda tensors: json.dumps(  # noqa: E731
        {"model": SPEC, "metadata": {}, "tensors": tensors}, separators=(",", ":")
    ).encode()
    deep = int(rng.integers(33, 200_000))
    makers = [
        lambda: b"[]",
        lambda: b'"model"',
        lambda: b"null",
        lambda: b"42",
        lambda: json.dumps({"model": SPEC, "metadata": []}).encode(),
        lambda: json.dumps({"model": [], "metadata": {}}).encode(),
        lambda: json.dumps({"model": {"name": 7}, "metadata": {}}).encode(),
        lambda: json.dumps({"model": {"name": "x", "kwargs": []}, "metadata": {}}).encode(),
        lambda: json.dumps({"metadata": {}, "model": SPEC}, separators=(",", ":")).encode(),
        lambda: json.dumps({"model": SPEC}).encode(),
        lambda: json.dumps(ok).encode(),  # spaces: not the form compress writes
        lambda: (
            b'{"model":{"name":"x","kwargs":{}},"model":{"name":"y","kwargs":{}},"metadata":{}}'
        ),
        lambda: b'{"model":{"name":"x","kwargs":{"a":1e2}},"metadata":{}}',
        lambda: b"[" * deep + b"]" * deep,
        lambda: b'{"model":{"name":"x","kwargs":{}},"metadata":' + b'{"a":' * 40 + b"1" + b"}" * 41,
        lambda: b"\xff\xfe not utf-8",
        lambda: (
            b'{"model":{"name":"x","kwargs":{}},"metadata":{"pad":"' + b"A" * (2 << 20) + b'"}}'
        ),
        lambda: v2(names[:-1]),  # one name short of the records
        lambda: v2([*names, "extra"]),
        lambda: v2([names[0], *names[:-1]]),  # a name twice
        lambda: v2(["", *names[1:]]),
        lambda: v2([7, *names[1:]]),
        lambda: v2({"w": 1}),
        lambda: json.dumps(ok, separators=(",", ":")).encode(),
    ]
    return makers[int(rng.integers(len(makers)))]()


def mutate(seed: bytes, lay: Layout, rng: np.random.Generator) -> tuple[str, bytes]:
    """One mutated archive and the name of the mutation."""
    kind = str(
        rng.choice(
            [
                "flip",
                "flip+crc",
                "overwrite+crc",
                "truncate",
                "truncate+crc",
                "extend+crc",
                "field+crc",
                "field+crc",
                "field+crc",
                "stream+crc",
                "splice+crc",
                "header+crc",
            ]
        )
    )
    body = bytearray(seed[:-4])
    if kind == "flip":  # damage: the CRC is left as it was
        damaged = bytearray(seed)
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(len(seed) * 8))
            damaged[i // 8] ^= 1 << (i % 8)
        return kind, bytes(damaged)
    if kind == "flip+crc":
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(len(body) * 8))
            body[i // 8] ^= 1 << (i % 8)
        return kind, seal(body)
    if kind == "overwrite+crc":
        for _ in range(int(rng.integers(1, 5))):
            body[int(rng.integers(len(body)))] = int(rng.integers(256))
        return kind, seal(body)
    if kind.startswith("truncate"):
        cut = int(rng.integers(len(seed)))
        return kind, (seed[:cut] if kind == "truncate" else seal(body[: max(cut - 4, 0)]))
    if kind == "extend+crc":
        extra = rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8).tobytes()
        return kind, seal(body + extra)
    if kind == "field+crc":
        f = lay.fields[int(rng.integers(len(lay.fields)))]
        if f.fmt:
            old = struct.unpack_from("<" + f.fmt, body, f.offset)[0]
            top = 2 ** (8 * f.size) - 1
            value = int(
                rng.choice(
                    [
                        0,
                        1,
                        2,
                        3,
                        7,
                        8,
                        15,
                        16,
                        17,
                        24,
                        25,
                        255,
                        256,
                        top,
                        top - 1,
                        min(top, 2**31),
                        min(top, 2**31 - 1),
                        min(top, 2**28),
                        min(top, 2**16),
                        min(top, old + 1),
                        max(old - 1, 0),
                        min(top, old * 2),
                        old // 2,
                        int(rng.integers(0, top + 1, dtype=np.uint64)),
                    ]
                )
            )
            struct.pack_into("<" + f.fmt, body, f.offset, min(value, top))
            return f"field:{f.what}", seal(body)
        # A byte range (name, codebook, code lengths, values): overwrite one byte in it.
        i = f.offset + int(rng.integers(f.size))
        body[i] = int(rng.choice([0, 1, 2, 24, 25, 0x7F, 0x80, 0xFF, int(rng.integers(256))]))
        return f"bytes:{f.what}", seal(body)
    if kind == "stream+crc" and lay.streams:
        start, end = lay.streams[int(rng.integers(len(lay.streams)))]
        if rng.random() < 0.5:
            body[end - 1] |= 1  # a padding bit set (or the last code's bit changed)
        else:
            body[int(rng.integers(start, end))] ^= 1 << int(rng.integers(8))
        return kind, seal(body)
    if kind == "splice+crc" and lay.records:
        recs = [bytes(body[s:e]) for s, e in lay.records]
        head, tail = bytes(body[: lay.count_at]), bytes(body[lay.records[-1][1] :])
        op = rng.integers(3)
        if op == 0 and len(recs) > 1:
            recs.pop(int(rng.integers(len(recs))))
        elif op == 1:
            recs.insert(int(rng.integers(len(recs) + 1)), recs[int(rng.integers(len(recs)))])
        elif len(recs) > 1:
            i, j = rng.choice(len(recs), 2, replace=False)
            recs[i], recs[j] = recs[j], recs[i]
        count = len(recs) if rng.random() < 0.8 else len(recs) + int(rng.integers(-1, 2))
        packed = (
            dcz3.varint(max(count, 0)) if lay.version == 3 else struct.pack("<I", max(count, 0))
        )
        return f"splice:{op}", seal(head + packed + b"".join(recs) + tail)
    text = hostile_header(rng, _names(seed))
    if lay.version == 3:
        c = zlib.compressobj(int(rng.integers(1, 10)), zlib.DEFLATED, -15)
        raw = c.compress(text) + c.flush()
    else:
        raw = zlib.compress(text, int(rng.integers(1, 10)))
    if rng.random() < 0.1:
        raw += b"trailing"
    return "header", with_header(seed, raw)


# --- running cases --------------------------------------------------------------------------


def maxrss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def reencodes_to_itself(data: bytes, d: archive.Decoded) -> bool:
    """`encode` of the decoded records gives the same bytes (the header compared inflated, as
    zlib may spell the same text differently)."""
    again, _ = archive.encode(d.entries, d.spec, d.metadata, d.version, d.modes)
    if d.version == 3:  # whole bytes: format 3's header is deflated by this very writer
        return again == data
    (h1,) = struct.unpack_from("<I", data, HEADER_AT - 4)
    (h2,) = struct.unpack_from("<I", again, HEADER_AT - 4)
    return (
        data[: HEADER_AT - 4] == again[: HEADER_AT - 4]
        and zlib.decompress(data[HEADER_AT : HEADER_AT + h1])
        == zlib.decompress(again[HEADER_AT : HEADER_AT + h2])
        and data[HEADER_AT + h1 : -4] == again[HEADER_AT + h2 : -4]
    )


@dataclass
class Tally:
    cases: int = 0
    refused: int = 0
    decoded: int = 0
    crashes: list[str] = field(default_factory=list)
    slow: list[str] = field(default_factory=list)
    reinterpreted: list[str] = field(default_factory=list)
    by_kind: Counter = field(default_factory=Counter)
    retimed: int = 0  # cases over the time bound, timed again (the lower time counts)
    worst_seconds: float = 0.0
    worst_case: str = ""
    rss_start: int = 0
    rss_peak: int = 0
    rss_peak_case: str = ""

    @property
    def failures(self) -> int:
        return len(self.crashes) + len(self.slow) + len(self.reinterpreted)


def _outcome(data: bytes, max_elements: int) -> archive.Decoded | InputError:
    try:
        return archive.decode(data, "fuzz.dcz", max_elements=max_elements, keep_entries=True)
    except InputError as e:
        return e


def _timed(data: bytes, max_elements: int) -> float:
    started = time.perf_counter()
    _outcome(data, max_elements)
    return time.perf_counter() - started


def _timed_case(t: Tally, name: str, data: bytes, max_elements: int) -> float:
    """Decode one case, file its outcome in the tally, return the seconds it took."""
    started = time.perf_counter()
    try:
        result = _outcome(data, max_elements)
    except Exception as e:  # anything but InputError is a crash
        t.crashes.append(f"{name}: {type(e).__name__}: {e}"[:300])
        return time.perf_counter() - started
    took = time.perf_counter() - started
    if isinstance(result, InputError):
        t.refused += 1
    else:
        t.decoded += 1
        if not reencodes_to_itself(data, result):
            t.reinterpreted.append(name)
    return took


def run(cases: int, seed: int = 0, max_elements: int = 1 << 22, seconds: float = 2.0) -> Tally:
    """Run `cases` mutated archives; count refusals, decodes and failures."""
    rng = np.random.default_rng(seed)
    bases = seeds()
    layouts = [layout(b) for b in bases]
    for b in bases:  # warm up the allocator and imports before RSS is taken
        archive.decode(b, max_elements=max_elements, keep_entries=True)
    t = Tally(rss_start=maxrss_bytes())
    t.rss_peak = t.rss_start
    for case in range(cases):
        which = int(rng.integers(len(bases)))
        kind, data = mutate(bases[which], layouts[which], rng)
        name = f"case {case} ({kind} of seed {which})"
        t.cases += 1
        t.by_kind[kind.split(":")[0]] += 1
        took = _timed_case(t, name, data, max_elements)
        if took > seconds:  # a shared machine stalls now and then: a slow case must repeat
            t.retimed += 1
            took = min(took, _timed(data, max_elements))
        if took > t.worst_seconds:
            t.worst_seconds, t.worst_case = took, name
        if took > seconds:
            t.slow.append(f"{name}: {took:.2f} s")
        rss = maxrss_bytes()
        if rss > t.rss_peak:
            t.rss_peak, t.rss_peak_case = rss, name
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-elements", type=int, default=1 << 22)
    ap.add_argument("--seconds", type=float, default=2.0, help="time bound per case")
    ap.add_argument("--memory-mib", type=float, default=256, help="peak RSS growth bound")
    a = ap.parse_args()
    started = time.perf_counter()
    t = run(a.cases, a.seed, a.max_elements, a.seconds)
    grew = (t.rss_peak - t.rss_start) / 2**20
    print(
        f"fuzz_archive: {platform.processor() or platform.machine()}, python {platform.python_version()}"
    )
    print(f"cases {t.cases:,} in {time.perf_counter() - started:.1f} s (seed {a.seed})")
    print(f"  clean refusals (InputError) {t.refused:,}")
    print(f"  decoded, re-encoded to the same bytes {t.decoded - len(t.reinterpreted):,}")
    print(f"  crashes (any other exception) {len(t.crashes)}")
    print(f"  decoded but re-encoded differently {len(t.reinterpreted)}")
    print(f"  over the {a.seconds:g} s time bound {len(t.slow)} (timed twice: {t.retimed})")
    over = grew > a.memory_mib
    print(f"  over the {a.memory_mib:g} MiB memory bound {int(over)}")
    print(f"slowest case {t.worst_seconds * 1000:.1f} ms: {t.worst_case}")
    print(
        f"peak RSS {t.rss_peak / 2**20:.0f} MiB, {grew:.1f} MiB above the start "
        f"({t.rss_start / 2**20:.0f} MiB){'; highest at ' + t.rss_peak_case if grew else ''}"
    )
    print("mutations: " + ", ".join(f"{k} {v:,}" for k, v in sorted(t.by_kind.items())))
    for line in (t.crashes + t.reinterpreted + t.slow)[:20]:
        print("  FAIL " + line)
    return 1 if t.failures or over else 0


if __name__ == "__main__":
    sys.exit(main())
