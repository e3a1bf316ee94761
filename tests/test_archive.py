import struct
import zlib

import numpy as np
import pytest
import torch

from compresskit.compressor import archive, kmeans, prune, recipe
from compresskit.compressor.shrink import _check_bit_identical, bits_equal
from compresskit.compressor.shrink import _entries as entries_of
from compresskit.models import InputError, tiny

SPEC = {"name": "lenet5", "kwargs": {"in_shape": [1, 8, 8], "num_classes": 10}}


def _entries(seed=0):
    g = np.random.default_rng(seed)
    w = np.zeros(600, np.float32)
    positions = np.sort(g.choice(600, 45, replace=False))
    codebook = np.sort(g.normal(size=15)).astype(np.float32)
    index = g.integers(0, 15, 45)
    w[positions] = codebook[index]
    return [
        archive.Shared("fc.weight", (20, 30), codebook, index, positions, 4),
        archive.Shared(
            "dense_shared.weight", (3, 4), codebook[:4], g.integers(0, 4, 12), np.arange(12), 0
        ),
        archive.Dense(
            "fc.bias", torch.tensor([0.5, -0.25, 3.0], dtype=torch.float32), store_fp16=True
        ),
        archive.Dense("odd.bias", torch.tensor([0.1, 1e-8]), store_fp16=True),  # not fp16-exact
        archive.Dense("bn.num_batches_tracked", torch.tensor(7)),
        archive.Dense("flags", torch.tensor([True, False])),
        archive.Dense("bf", torch.tensor([1.5, -2.0], dtype=torch.bfloat16)),
    ], w.reshape(20, 30)


def test_encode_decode_is_bit_identical():
    entries, w = _entries()
    data, stats = archive.encode(entries, SPEC, {"note": "x"})
    out = archive.decode(data)
    assert out.spec == SPEC and out.metadata == {"note": "x"}
    assert list(out.state_dict) == [e.name for e in entries]
    assert bits_equal(out.state_dict["fc.weight"], torch.from_numpy(w))
    for e in entries[2:]:
        assert bits_equal(out.state_dict[e.name], e.tensor)
    assert out.state_dict["fc.bias"].dtype == torch.float32
    assert stats.bytes == len(data)


def test_fp16_storage_only_when_exact():
    entries, _ = _entries()
    small, _ = archive.encode(entries[2:3], SPEC, {}, version=2)
    exact32 = [archive.Dense("fc.bias", entries[2].tensor)]
    large, _ = archive.encode(exact32, SPEC, {}, version=2)
    assert len(large) - len(small) == 3 * 2  # three values stored in 2 bytes instead of 4
    # Format 3 records the stored dtype too, and reads it back the same way.
    got = archive.decode(archive.encode(entries, SPEC, {})[0], keep_entries=True).entries
    assert [archive.stored_dtype(e) for e in got[2:4]] == [torch.float16, torch.float32]
    assert got[2].store_fp16 and not got[3].store_fp16


def test_any_flipped_byte_is_detected():
    entries, _ = _entries()
    data, _ = archive.encode(entries, SPEC, {})
    for i in range(len(data)):
        damaged = bytearray(data)
        damaged[i] ^= 0x20
        with pytest.raises(InputError):
            archive.decode(bytes(damaged), "x.dcz")


@pytest.mark.parametrize("cut", [0, 5, 13, 100, -5, -1])
def test_truncated_archive(cut):
    data, _ = archive.encode(_entries()[0], SPEC, {})
    with pytest.raises(InputError, match="x.dcz: .*(truncated|magic)"):
        archive.decode(data[:cut], "x.dcz")


def test_newer_version_and_foreign_file():
    data, _ = archive.encode(_entries()[0], SPEC, {})
    body = bytearray(data[:-4])
    struct.pack_into("<H", body, len(archive.MAGIC), 9)
    newer = bytes(body) + struct.pack("<I", zlib.crc32(bytes(body)))
    with pytest.raises(InputError, match="version 9 is newer"):
        archive.decode(newer, "x.dcz")
    with pytest.raises(InputError, match="not a compress archive"):
        archive.decode(b"PK\x03\x04 a zip file", "x.dcz")


def test_a_consistent_but_wrong_record_is_refused():
    # Valid checksum over a record whose streams claim more entries than the tensor has room for.
    e = archive.Shared("w", (2, 2), np.array([1.0], np.float32), np.zeros(6, int), np.arange(6), 2)
    with pytest.raises(InputError, match="do not fit shape"):
        archive.decode(archive.encode([e], SPEC, {}, version=2)[0], "x.dcz")


def test_names_live_in_the_deflated_header_and_version_1_still_reads():
    entries, _ = _entries()
    v2, _ = archive.encode(entries, SPEC, {}, version=2)
    v1, _ = archive.encode(entries, SPEC, {}, version=1)
    assert struct.unpack_from("<H", v2, 8) == (2,) and struct.unpack_from("<H", v1, 8) == (1,)
    assert b"fc.weight" in v1 and b"fc.weight" not in v2  # deflated in v2's header
    a, b = archive.decode(v2, keep_entries=True), archive.decode(v1, keep_entries=True)
    assert (a.version, b.version) == (2, 1) and list(a.state_dict) == list(b.state_dict)
    assert all(bits_equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)
    # each re-encodes to its own bytes
    assert archive.encode(b.entries, b.spec, b.metadata, b.version)[0] == v1
    assert archive.encode(a.entries, a.spec, a.metadata, a.version)[0] == v2
    v3, _ = archive.encode(entries, SPEC, {})
    assert struct.unpack_from("<H", v3, 8) == (3,) and b"fc.weight" not in v3
    c = archive.decode(v3, keep_entries=True)
    assert c.version == 3 and all(
        bits_equal(a.state_dict[k], c.state_dict[k]) for k in a.state_dict
    )
    assert archive.encode(c.entries, c.spec, c.metadata, c.version)[0] == v3


def test_a_version_2_header_must_name_each_record_once():
    entries, _ = _entries()
    data, _ = archive.encode(entries, SPEC, {}, version=2)
    names = [e.name for e in entries]

    def with_names(tensors):
        header = zlib.compress(
            archive._header_text(SPEC, {}, tensors) if tensors is not None else b"{}", 9
        )
        (hlen,) = struct.unpack_from("<I", data, 10)
        body = data[:10] + struct.pack("<I", len(header)) + header + data[14 + hlen : -4]
        return body + struct.pack("<I", zlib.crc32(body))

    assert archive.decode(with_names(names)).state_dict.keys() == set(names)
    for bad, message in [
        (names[:-1], "header names 6 tensors, the file holds 7"),
        ([*names, "x"], "header names 8 tensors"),
        ([names[0], *names[:-1]], "appears twice"),
        (["", *names[1:]], "not a list of tensor names"),
    ]:
        with pytest.raises(InputError, match=message):
            archive.decode(with_names(bad), "crafted.dcz")


def test_model_round_trip_through_sharing():
    model = tiny("lenet5", in_shape=(1, 8, 8))
    prune.prune_(model, prune.PruneConfig(sparsity=0.7))
    kmeans.share_weights_(model, kmeans.QuantizeConfig(conv_bits=4, fc_bits=3))
    entries, _ = entries_of(model, recipe.resolve({"quantize": {"dense": "float32"}}))
    decoded = archive.decode(archive.encode(entries, SPEC, {})[0])
    _check_bit_identical(model, decoded.state_dict)  # raises on any difference
    fresh = tiny("lenet5", in_shape=(1, 8, 8))
    fresh.load_state_dict(decoded.state_dict)
    prune.bake_(model)
    x = torch.rand(3, 1, 8, 8)
    assert torch.equal(fresh(x), model(x))


def test_record_size_is_the_bytes_encode_writes():
    entries, _ = _entries()
    _, stats = archive.encode(entries, SPEC, {}, version=2)
    for e in entries:
        assert archive.record_size(e, version=2) == stats.layers[e.name]["record_bytes"], e.name
    # Format 3: a record's directory bytes plus its share of the one stream, coded alone.
    for e in entries:
        alone = archive.encode([e], SPEC, {})[1].layers[e.name]["record_bytes"]
        assert archive.record_size(e) == pytest.approx(alone, abs=1), e.name
    assert archive.stored_dtype(entries[2]) == torch.float16  # exact in float16
    assert archive.stored_dtype(entries[3]) == torch.float32  # 1e-8 is not


def test_a_tensor_too_big_for_this_machine_is_not_called_damaged(monkeypatch):
    """A decode that runs out of memory said 'damaged stream ([enforce fail at
    alloc_cpu.cpp] ... tried to allocate ...)': the file was fine, the machine too small."""
    entries, _ = _entries()
    data, _ = archive.encode(entries, SPEC, {})

    def no_memory(self):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB")

    monkeypatch.setattr(archive.Shared, "weight", no_memory)
    with pytest.raises(InputError, match=r"fc.weight of shape \[20, 30\] \(600 values\) does not "):
        archive.decode(data, "big.dcz")


def _v3(names, directory):
    """A format-3 file from its parts, with a valid checksum (crafted records)."""
    from compresskit.compressor import dcz3

    header = dcz3.deflate(archive._header_text(SPEC, {}, names))
    return dcz3.assemble(3, header, len(names), directory, np.zeros(0, np.uint32))


def test_a_tied_tensor_is_stored_once_and_decodes_to_the_one_tensor():
    entries, w = _entries()
    tied = [*entries, archive.Alias("fc2.weight", "fc.weight"), archive.Alias("b2", "fc.bias")]
    data, stats = archive.encode(tied, SPEC, {})
    out = archive.decode(data, keep_entries=True)
    assert out.state_dict["fc2.weight"] is out.state_dict["fc.weight"]
    assert out.state_dict["b2"] is out.state_dict["fc.bias"]
    assert bits_equal(out.state_dict["fc2.weight"], torch.from_numpy(w))
    assert out.entries[-2:] == tied[-2:]
    # Each alias is its directory record alone (dtype, ndim, shape, encoding, the record
    # index) and its name in the header; a copy is its whole record again.
    assert len(data) - len(archive.encode(entries, SPEC, {})[0]) < 24
    assert len(archive.encode(archive._copies(tied), SPEC, {})[0]) - len(data) > 40
    assert stats.layers["fc2.weight"] == {"alias_of": "fc.weight", "record_bytes": 6}
    # Format 2 has no alias record: a copy, which decodes equal but not shared.
    old = archive.decode(archive.encode(tied, SPEC, {}, version=2)[0])
    assert bits_equal(old.state_dict["fc2.weight"], torch.from_numpy(w))
    assert old.state_dict["fc2.weight"] is not old.state_dict["fc.weight"]


@pytest.mark.parametrize(
    "directory, message",
    [
        # tensor 0 an alias of itself, then of a later record
        (bytes([0, 1, 2, 2, 0]) + bytes([0, 1, 2, 0, 0, 0]), "not of an earlier record"),
        (bytes([0, 1, 2, 2, 1]) + bytes([0, 1, 2, 0, 0, 0]), "not of an earlier record"),
        # another shape, then another dtype, than the record it names
        (bytes([0, 1, 2, 0, 0, 0]) + bytes([0, 1, 3, 2, 0]), "another dtype or shape"),
        (bytes([0, 1, 2, 0, 0, 0]) + bytes([1, 1, 2, 2, 0]), "another dtype or shape"),
        (bytes([0, 1, 2, 0, 0, 0]) + bytes([0, 1, 2, 7, 0]), "unknown encoding 7 .*upgrade"),
    ],
)
def test_a_crafted_alias_is_refused(directory, message):
    with pytest.raises(InputError, match=message):
        archive.decode(_v3(["a", "b"], directory), "x.dcz")


def test_an_alias_of_an_alias_is_refused():
    directory = bytes([0, 1, 2, 0, 0, 0]) + bytes([0, 1, 2, 2, 0]) + bytes([0, 1, 2, 2, 1])
    with pytest.raises(InputError, match="not of an earlier record"):
        archive.decode(_v3(["a", "b", "c"], directory), "x.dcz")
    with pytest.raises(ValueError, match="not an earlier record"):
        archive.encode([archive.Alias("b", "a"), archive.Dense("a", torch.ones(2))], SPEC, {})
