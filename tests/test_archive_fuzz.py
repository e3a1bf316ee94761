"""Crafted `.dcz` archives: the seeded fuzzer, and one regression test per crash class found.

Each crafted file carries a correct CRC32, so only the reader's own checks stand between it
and the decoder's allocations.
"""

from __future__ import annotations

import importlib.util
import json
import resource
import struct
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from compresskit.compressor import archive, pipeline
from compresskit.models import InputError, ModelSpec, build

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("fuzz_archive", ROOT / "benchmarks/fuzz_archive.py")
fuzz = importlib.util.module_from_spec(_spec)
sys.modules["fuzz_archive"] = fuzz  # dataclasses look their module up by name
_spec.loader.exec_module(fuzz)

SPEC = {"name": "x", "kwargs": {}}


def _report(t) -> str:
    return "; ".join((t.crashes + t.reinterpreted + t.slow)[:5])


def test_2000_fuzzed_archives_are_refused_cleanly_or_decode_faithfully():
    t = fuzz.run(2000, seed=1)
    assert t.cases == 2000
    assert not t.crashes, _report(t)
    assert not t.reinterpreted, _report(t)
    assert not t.slow, _report(t)
    # Peak RSS growth over the run bounds every case's memory.
    assert t.rss_peak - t.rss_start < 256 * 2**20, t.rss_peak_case
    # The generator reaches both outcomes, and every kind of mutation ran.
    assert t.refused > 1000 and t.decoded > 50
    assert set(t.by_kind) >= {"flip", "field", "header", "splice", "stream+crc", "truncate"}


@pytest.mark.slow
def test_100000_fuzzed_archives():
    t = fuzz.run(100_000, seed=2)
    assert t.failures == 0, _report(t)
    assert t.rss_peak - t.rss_start < 256 * 2**20, t.rss_peak_case


# --- one regression test per crash class found on landed main -------------------------------


def _record(name: str, shape: tuple[int, ...], tail: bytes, dtype: int = 0) -> bytes:
    """A raw tensor record: name, dtype, shape, then the encoding-specific tail."""
    return (
        struct.pack("<H", len(name))
        + name.encode()
        + struct.pack("<BB", dtype, len(shape))
        + struct.pack(f"<{len(shape)}I", *shape)
        + tail
    )


def _archive(records: list[bytes], header: bytes | None = None) -> bytes:
    if header is None:
        header = json.dumps({"model": SPEC, "metadata": {}}, separators=(",", ":")).encode()
    h = zlib.compress(header, 9)
    body = archive.MAGIC + struct.pack("<HI", 1, len(h)) + h
    body += struct.pack("<I", len(records)) + b"".join(records)
    return fuzz.seal(body)


def _shared_tail(k: int, gap_bits: int, n: int, g: int, index: bytes, gaps: bytes = b"") -> bytes:
    lengths = bytes([1] * min(k, 2)) + bytes(max(k - 2, 0))
    gap_lengths = bytes([1, 1] + [0] * (2**gap_bits - 2)) if gap_bits else b""
    return (
        struct.pack("<BH", 1, k)
        + np.arange(k, dtype="<f4").tobytes()
        + struct.pack("<BII", gap_bits, n, g)
        + lengths
        + gap_lengths
        + struct.pack("<II", len(index), len(gaps))
        + index
        + gaps
    )


def _refused(data: bytes, match: str, **kw) -> None:
    start = time.perf_counter()
    with pytest.raises(InputError, match=match):
        archive.decode(data, "crafted.dcz", **kw)
    assert time.perf_counter() - start < 1.0


def test_a_shape_of_2_to_the_31_elements_is_refused_before_allocating():
    # Was RuntimeError from torch.zeros(numel) in the record reader.
    tail = _shared_tail(2, 8, 1, 1, b"\x00", b"\x00")
    _refused(_archive([_record("w", (2**16, 2**15 + 1), tail)]), "past 2,147,483,648 elements")
    _refused(
        _archive([_record("w", (2**16, 2**15 + 1), tail)]), "past 1,000 elements", max_elements=1000
    )


def test_an_empty_tensor_with_huge_other_dims_is_refused():
    # Found by the 100,000-case fuzzer: RuntimeError "Stride calculation overflowed".
    tail = struct.pack("<BBI", 0, 0, 0)
    _refused(_archive([_record("e", (0, 2**32 - 1, 2**32 - 1), tail)]), "past")


def test_a_huge_entry_count_is_refused_before_decoding():
    # Was MemoryError from np.fromiter(count=n) with n from the file.
    tail = _shared_tail(2, 0, 2**31, 0, b"\x00")
    crafted = _archive([_record("w", (2**31,), tail)])
    # refused first for its elements per byte (no model checks this archive's shapes) ...
    _refused(crafted, "more elements than 1,024 per byte of the archive")
    # ... and, with the caller's own cap, by the count
    _refused(crafted, "entries coded in 1 bytes|past", max_elements=2**31)
    tail = _shared_tail(2, 2, 3, 2**30, b"\x00", b"\x00")
    _refused(_archive([_record("w", (1000,), tail)]), "gap symbols")


def test_an_odd_dense_byte_count_is_refused():
    # Was ValueError "buffer size must be a multiple of element size".
    tail = struct.pack("<BBI", 0, 0, 7) + bytes(7)
    _refused(_archive([_record("b", (2,), tail)]), r"7 bytes for shape \[2\].*needs 8")


@pytest.mark.parametrize("header", [b"[1, 2]", b'"text"', b"null", b"3.5"])
def test_a_header_that_is_not_an_object_is_refused(header):
    # Was AttributeError ('list' object has no attribute 'get').
    _refused(_archive([], header), "header is not a JSON object")


def test_metadata_that_is_a_list_is_refused():
    # Was TypeError when the metadata was used as a mapping.
    header = json.dumps({"model": SPEC, "metadata": [1]}, separators=(",", ":")).encode()
    _refused(_archive([], header), '"metadata" is not a JSON object')


def test_deeply_nested_header_json_is_refused():
    # Was RecursionError from json.loads.
    _refused(_archive([], b"[" * 100_000 + b"]" * 100_000), "nested too deeply")
    deep = b'{"model":{"name":"x","kwargs":{}},"metadata":' + b'{"a":' * 40 + b"1" + b"}" * 41
    _refused(_archive([], deep), "nested deeper than 32")


def test_a_header_that_inflates_to_a_gigabyte_is_refused_quickly():
    # Was: a 1 MB header inflated to 1 GiB before anything was checked.
    # 1 GiB of zeros: after a full flush the compressor starts afresh, so the deflate bytes of
    # one MiB repeat; the trailer is the true Adler-32 of the whole text.
    co = zlib.compressobj(9)
    head = co.compress(b'{"a":"') + co.flush(zlib.Z_FULL_FLUSH)
    mib = co.compress(bytes(1 << 20)) + co.flush(zlib.Z_FULL_FLUSH)
    assert co.compress(bytes(1 << 20)) + co.flush(zlib.Z_FULL_FLUSH) == mib
    adler = zlib.adler32(b'{"a":"')
    for _ in range(1024):
        adler = zlib.adler32(bytes(1 << 20), adler)
    raw = head + mib * 1024 + co.flush()[:-4] + struct.pack(">I", adler)
    assert len(raw) < 1.1e6
    body = archive.MAGIC + struct.pack("<HI", 1, len(raw)) + raw + struct.pack("<I", 0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _refused(fuzz.seal(body), "inflates past the 1,048,576-byte limit")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 64 * 1024  # KiB


def test_a_header_naming_a_huge_model_builds_nothing(tmp_path):
    # Was: the header's model (3.6 GB) was built before any weight was checked.
    spec = {
        "name": "mlp",
        "kwargs": {"in_shape": [1, 8, 8], "num_classes": 10, "hidden": [30000, 30000]},
    }
    header = json.dumps({"model": spec, "metadata": {}}, separators=(",", ":")).encode()
    tail = struct.pack("<BBI", 0, 0, 8) + bytes(8)
    path = tmp_path / "huge.dcz"
    path.write_bytes(_archive([_record("fc1.weight", (2,), tail)], header))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with pytest.raises(InputError, match=r"fc1\.weight: shape \[2\], model mlp's is \[30000, 64\]"):
        pipeline.decode_to_checkpoint(path, tmp_path / "out.pt")
    assert time.perf_counter() - start < 1.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 64 * 1024  # KiB
    assert not (tmp_path / "out.pt").exists()


def test_an_archive_must_hold_every_tensor_of_its_model(tmp_path):
    spec = {"name": "mlp", "kwargs": {"in_shape": [1, 8, 8], "num_classes": 10, "hidden": [32]}}
    model = build(ModelSpec.from_dict(spec))
    entries = [archive.Dense(k, v) for k, v in model.state_dict().items()]
    path = tmp_path / "partial.dcz"
    archive.write(path, entries[:-1], spec, {})
    with pytest.raises(InputError, match="has tensor 'fc2.bias', which the archive lacks"):
        pipeline.decode_to_checkpoint(path, tmp_path / "out.pt")
    archive.write(path, entries, spec, {})
    pipeline.decode_to_checkpoint(path, tmp_path / "out.pt")
    assert (tmp_path / "out.pt").exists()


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda b: b.replace(b'"metadata":{}', b'"metadata": {}'), "not in the form"),
        (lambda b: b.replace(b'"kwargs":{}', b'"kwargs":{},"kwargs":{}'), "not in the form"),
        (lambda b: b.replace(b"{}}", b"{},}"), "not JSON"),
    ],
)
def test_other_spellings_of_the_header_are_refused(edit, match):
    header = json.dumps({"model": SPEC, "metadata": {}}, separators=(",", ":")).encode()
    _refused(_archive([], edit(header)), match)


def test_non_canonical_streams_are_refused():
    # Padding bits, a longer stream, non-optimal code lengths: each would decode to the same
    # weights but re-encode differently, so the file is not what compress writes.
    e = archive.Shared(
        "w", (10,), np.array([1.0, 2.0], np.float32), np.array([0, 1, 1]), np.array([0, 4, 9]), 3
    )
    data, _ = archive.encode([e], SPEC, {}, version=2)
    lay = fuzz.layout(data)
    _, end = lay.streams[0]  # index stream: 3 bits, 5 padding bits
    padded = bytearray(data[:-4])
    padded[end - 1] |= 1
    _refused(fuzz.seal(padded), "padding bits are not zero")
    assert archive.decode(data).state_dict["w"].tolist() == [1, 0, 0, 0, 2, 0, 0, 0, 0, 2]


def test_dense_records_are_stored_as_the_writer_stores_them():
    int8, bool_ = archive.DTYPES.index(torch.int8), archive.DTYPES.index(torch.bool)
    tail = struct.pack("<BBI", 0, int8, 2) + b"\x01\x02"
    _refused(_archive([_record("b", (2,), tail, dtype=0)]), "stored as torch.int8")
    flags = struct.pack("<BBI", 0, bool_, 2) + b"\x01\x02"
    _refused(_archive([_record("f", (2,), flags, dtype=bool_)]), "bool byte")
    nan16 = struct.pack("<BBI", 0, 1, 2) + np.array([np.nan], "<f2").tobytes()
    _refused(_archive([_record("h", (1,), nan16, dtype=0)]), "not exact")


def test_names_must_be_utf8_and_unique():
    tail = struct.pack("<BBI", 0, 0, 4) + bytes(4)
    _refused(_archive([_record("a", (1,), tail)] * 2), "appears twice")
    bad = (
        struct.pack("<H", 2)
        + b"\xff\xfe"
        + struct.pack("<BBI", 0, 1, 1)
        + struct.pack("<BBI", 0, 0, 4)
        + bytes(4)
    )
    _refused(_archive([bad]), "not UTF-8")


def test_a_tensor_count_beyond_the_file_is_refused_at_once():
    data = _archive([])
    body = bytearray(data[:-4])
    struct.pack_into("<I", body, len(body) - 4, 2**32 - 1)
    _refused(fuzz.seal(body), "claims 4,294,967,295 tensors")


def test_a_decoded_archive_re_encodes_to_the_same_bytes():
    for data in fuzz.seeds():
        d = archive.decode(data, keep_entries=True)
        assert archive.encode(d.entries, d.spec, d.metadata, d.version, d.modes)[0] == data


# --- through the CLI: exit 2, one line, nothing written -------------------------------------


def _crafted_files(tmp_path: Path) -> dict[str, bytes]:
    co = zlib.compressobj(9)
    bomb = co.compress(b'{"a":"' + bytes(8 << 20)) + co.flush()
    return {
        "huge-shape": _archive(
            [_record("w", (2**16, 2**15 + 1), _shared_tail(2, 8, 1, 1, b"\0", b"\0"))]
        ),
        "huge-count": _archive([_record("w", (2**31,), _shared_tail(2, 0, 2**31, 0, b"\0"))]),
        "odd-bytes": _archive([_record("b", (2,), struct.pack("<BBI", 0, 0, 7) + bytes(7))]),
        "list-header": _archive([], b"[1]"),
        "list-metadata": _archive([], b'{"model":{"name":"x","kwargs":{}},"metadata":[]}'),
        "deep-header": _archive([], b"[" * 50_000 + b"]" * 50_000),
        "bomb-header": fuzz.seal(
            archive.MAGIC + struct.pack("<HI", 1, len(bomb)) + bomb + struct.pack("<I", 0)
        ),
    }


def test_every_crash_class_is_exit_2_and_one_line_through_the_cli(run, tmp_path):
    for name, data in _crafted_files(tmp_path).items():
        path = tmp_path / f"{name}.dcz"
        path.write_bytes(data)
        out = tmp_path / f"{name}.pt"
        start = time.perf_counter()
        result = run("decode", path, "--out", out)
        assert result.exit_code == 2, (name, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {path}: "), (name, lines)
        assert "unexpected" not in lines[0]
        assert time.perf_counter() - start < 3, name
        assert not out.exists()
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".dcz"] * 7


def test_decode_expect_checks_the_sha256(run, tmp_path):
    spec = {"name": "mlp", "kwargs": {"in_shape": [1, 8, 8], "num_classes": 10, "hidden": [4]}}
    model = build(ModelSpec.from_dict(spec))
    path = tmp_path / "m.dcz"
    stats = archive.write(
        path, [archive.Dense(k, v) for k, v in model.state_dict().items()], spec, {}
    )
    wrong = "0" * 64
    result = run("decode", path, "--out", tmp_path / "m.pt", "--expect", wrong)
    assert result.exit_code == 2 and f"SHA-256 is {stats.sha256}, not the {wrong}" in result.stderr
    assert not (tmp_path / "m.pt").exists()
    result = run(
        "decode", path, "--out", tmp_path / "m.pt", "--expect", stats.sha256.upper(), "--json"
    )
    assert result.exit_code == 0 and result.json()["sha256"] == stats.sha256
    # sha256sum's whole line, or a prefix, is the same hash; a malformed one is said to be
    # (it was "not the archive you were given")
    for given in (f"{stats.sha256}  {path}", f"sha256:{stats.sha256}"):
        result = run("decode", path, "--out", tmp_path / "k.pt", "--expect", given, "--force")
        assert result.exit_code == 0, result.stderr
    for given in ("abc", "", stats.sha256[:-1] + "g"):
        result = run("decode", path, "--out", tmp_path / "j.pt", "--expect", given)
        assert result.exit_code == 2 and "give the archive's SHA-256 as the 64 hex" in result.stderr
        assert not (tmp_path / "j.pt").exists()
    # --force replaces a checkpoint, never another kind of file; no checkpoint under a .onnx
    # or .dcz name (decode --force had replaced an archive and an ONNX file, exit 0)
    other = tmp_path / "notes.txt"
    other.write_text("mine")
    result = run("decode", path, "--out", other, "--force")
    assert result.exit_code == 2 and "exists and is not a PyTorch checkpoint" in result.stderr
    assert other.read_text() == "mine"
    result = run("decode", path, "--out", tmp_path / "x.onnx")
    assert result.exit_code == 2 and "a .onnx file holds an ONNX model" in result.stderr
    result = run("decode", path, "--out", tmp_path / "n.pt", "--max-elements", "100")
    assert result.exit_code == 2 and "raise the cap (--max-elements" in result.stderr


def test_decoding_without_the_model_counts_its_parameters_as_shrink_does(tmp_path, user_module):
    # Tensors only (the model's code not imported): BatchNorm's running statistics are not
    # parameters. They were counted in, so one archive decoded to two parameter counts.
    bnmod = user_module(
        "bnmod",
        """
        from torch import nn

        class Net(nn.Module):
            def __init__(self, in_shape=(1, 8, 8), num_classes=10):
                super().__init__()
                self.conv = nn.Conv2d(1, 4, 3)
                self.bn = nn.BatchNorm2d(4)
                self.fc = nn.Linear(4, num_classes)

            def forward(self, x):
                return self.fc(self.bn(self.conv(x)).mean((2, 3)))
        """,
    )

    model = bnmod.Net()
    spec = {"name": "bnmod:Net", "kwargs": {"in_shape": [1, 8, 8], "num_classes": 10}}
    entries = [archive.Dense(k, v) for k, v in model.state_dict().items()]
    path = tmp_path / "bn.dcz"
    archive.write(path, entries, spec, {})
    alone = pipeline.decode_to_checkpoint(path, tmp_path / "a.pt")
    built = pipeline.decode_to_checkpoint(path, tmp_path / "b.pt", allow_import="bnmod:Net")
    assert built["rebuilt"] and not alone["rebuilt"]
    assert built["parameters"] == alone["parameters"] == sum(p.numel() for p in model.parameters())

    # A tied weight (one tensor under two names, an Alias in the archive) is one parameter
    # tensor, as parameters() counts it: it was counted once per name (8,970 for 4,874).
    tied = {**model.state_dict(), "fc2.weight": model.fc.weight}
    entries = [archive.Dense(k, v) for k, v in tied.items() if k != "fc2.weight"]
    path = tmp_path / "tied.dcz"
    archive.write(path, [*entries, archive.Alias("fc2.weight", "fc.weight")], spec, {})
    tied_alone = pipeline.decode_to_checkpoint(path, tmp_path / "t.pt")
    assert tied_alone["tensors"] == len(tied) and tied_alone["parameters"] == alone["parameters"]
    assert pipeline.decode_to_checkpoint(path, None)["checkpoint"] == str(
        path.with_suffix(".decoded.pt")
    )
    for folder in (tmp_path, Path(".")):  # no name to derive the default from: one line
        with pytest.raises(InputError, match="a folder, not an archive"):
            pipeline.decode_to_checkpoint(folder, None)
