"""Hostile inputs: recipes, .npz data, .pt checkpoints and .onnx models crafted to hang, balloon
memory or read outside their folder are refused before any work, with one line and exit 2.

Every file is made here, in tmp_path. The bombs are real: without the checks, the YAML alias
bomb keeps `--dry-run` busy for minutes, and the npz and .pt bombs inflate to 3 GiB.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import pickle
import re
import resource
import struct
import time
import tracemalloc
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml  # noqa: F401 - imported here, so no bound below times its import

from compresskit.compressor import recipe
from compresskit.models import InputError, ModelSpec, checkpoint, limits, safeload, tiny
from compresskit.models import data as data_mod

GiB = 2**30
MiB = 2**20


# --- measuring ------------------------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def bounded(seconds: float = 1.0, traced_mib: int = 64, rss_mib: int = 256):
    """The block runs within `seconds`, allocates under `traced_mib` through Python and numpy
    (tracemalloc), and raises the process's peak RSS by under `rss_mib` (torch's C++ and
    zlib buffers, which tracemalloc does not see). A 3 GiB bomb fails all three."""
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    base = _rss()
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - t0
        traced = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert elapsed < seconds, f"took {elapsed:.2f} s"
    assert traced < traced_mib * MiB, f"allocated {traced / MiB:.0f} MiB"
    assert peak <= max(peak_before, base + rss_mib * MiB), f"peak RSS {peak / MiB:.0f} MiB"


# --- crafting files -------------------------------------------------------------------------


def deflate_zeros(nbytes: int, prefix: bytes = b"") -> bytes:
    """A raw deflate stream of `prefix` then `nbytes` zeros (~1,000:1), made in milliseconds:
    one fully flushed block of zeros repeated."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = c.compress(prefix) + c.flush(zlib.Z_FULL_FLUSH)
    chunk = 1 << 22
    block = c.compress(b"\0" * chunk) + c.flush(zlib.Z_FULL_FLUSH)
    n, rest = divmod(nbytes, chunk)
    return head + block * n + c.compress(b"\0" * rest) + c.flush(zlib.Z_FINISH)


def raw_zip(path: Path, members: list[dict]) -> Path:
    """A zip written byte by byte, declaring whatever each member says: name, payload (the
    bytes as stored), method (0 stored, 8 deflated), size (declared uncompressed), crc, and
    same_as (the index of an earlier member whose data this entry points at too)."""
    out, central, where = bytearray(), bytearray(), []
    for m in members:
        name = m["name"].encode()
        payload, method = m.get("payload", b""), m.get("method", 0)
        size = m.get("size", len(payload))
        crc = m.get("crc", zlib.crc32(payload) if method == 0 else 0)
        if "same_as" in m:
            offset, csize = where[m["same_as"]]
        else:
            offset, csize = len(out), len(payload)
            out += struct.pack(
                "<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0x21, crc, csize, size, len(name), 0
            )
            out += name + payload
        where.append((offset, csize))
        central += struct.pack(
            "<IHHHHHHIIIHHHHHII",
            *(0x02014B50, 20, 20, 0, method, 0, 0x21, crc, csize, size),
            *(len(name), 0, 0, 0, 0, 0, offset),
        )
        central += name
    n = len(members)
    out += central + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, len(central), len(out), 0)
    path.write_bytes(bytes(out))
    return path


def npy_header(shape: tuple[int, ...], descr: str = "<f4") -> bytes:
    f = io.BytesIO()
    d = {"descr": descr, "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(f, d)
    return f.getvalue()


def npy(a: np.ndarray) -> bytes:
    f = io.BytesIO()
    np.save(f, a)
    return f.getvalue()


LABELS = {"name": "y.npy", "payload": npy(np.arange(10) % 2)}


def npz_bomb(tmp_path: Path, nbytes: int = 3 * GiB) -> Path:
    """3 MB that inflates to a 3 GiB float32 x of shape (N, 1, 8, 8), declared honestly."""
    n = nbytes // 256
    header = npy_header((n, 1, 8, 8))
    x = {"name": "x.npy", "payload": deflate_zeros(n * 256, header), "method": 8}
    return raw_zip(tmp_path / "bomb.npz", [{**x, "size": len(header) + n * 256}, LABELS])


class _StorageRef:
    def __init__(self, key: str, numel: int) -> None:
        self.key, self.numel = key, numel


class _Tensor:
    """Pickles as torch.save writes a float32 tensor of `numel` elements."""

    def __init__(self, key: str, numel: int) -> None:
        self.storage, self.numel = _StorageRef(key, numel), numel

    def __reduce__(self):
        args = (self.storage, 0, (self.numel,), (1,), False, collections.OrderedDict())
        return (torch._utils._rebuild_tensor_v2, args)


def torch_pickle(numel: int, legacy: bool = False) -> bytes:
    """The pickle of {"w": float32 tensor of `numel` elements}, as torch.save writes it."""

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, _StorageRef):
                pid = ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel)
                return (*pid, None) if legacy else pid
            return None

    f = io.BytesIO()
    Pickler(f, protocol=2).dump({"w": _Tensor("0", numel)})
    return f.getvalue()


def torch_zip(tmp_path: Path, name: str, numel: int, record: bytes, **data) -> Path:
    """A torch.save zip of {"w": ...}: the pickle declares `numel` float32 elements, record
    data/0 holds `record` (declared and stored as `data` says)."""
    real = tmp_path / "real.pt"
    torch.save({"w": torch.zeros(4)}, real)
    with zipfile.ZipFile(real) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    prefix = next(iter(members)).split("/")[0]
    members[f"{prefix}/data.pkl"] = torch_pickle(numel)
    out = [
        {"name": k, "payload": record, **data}
        if k == f"{prefix}/data/0"
        else {"name": k, "payload": v}
        for k, v in members.items()
    ]
    return raw_zip(tmp_path / name, out)


def legacy_pt(path: Path, numel: int, real: int = 4) -> Path:
    """A pre-zip torch.save file (four pickles, then the storage's bytes) whose pickle declares
    `numel` float32 elements and whose data holds `real`."""
    f = io.BytesIO()
    sys_info = {"protocol_version": 1001, "little_endian": True, "type_sizes": {"int": 4}}
    for obj in (checkpoint.LEGACY_MAGIC, 1001, sys_info):
        pickle.dump(obj, f, protocol=2)
    f.write(torch_pickle(numel, legacy=True))
    pickle.dump(["0"], f, protocol=2)
    f.write(struct.pack("<q", numel) + b"\0" * 4 * real)
    path.write_bytes(f.getvalue())
    return path


# --- recipes --------------------------------------------------------------------------------


def alias_bomb(path: Path) -> Path:
    """~600 bytes of YAML whose nested aliases stand for 9^10 (3.5 billion) strings."""
    lines = ["distill:", "  student_kwargs:", "    a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 10):
        lines.append(f"    a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_yaml_alias_bomb_is_refused_within_a_second_and_a_memory_bound(tmp_path):
    bomb = alias_bomb(tmp_path / "bomb.yaml")
    assert bomb.stat().st_size < 700
    with bounded(), pytest.raises(InputError, match=r"YAML alias \*a0 \(line 4\)") as info:
        recipe.read(bomb)
    assert str(bomb) in str(info.value) and "write the value out in full" in str(info.value)


def test_any_yaml_alias_is_refused(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("prune:\n  lr: &lr 0.001\nquantize:\n  lr: *lr\n")
    with pytest.raises(InputError, match=r"r.yaml: YAML alias \*lr \(line 4\)"):
        recipe.read(p)
    p.write_text("prune:\n  lr: 0.001\nquantize:\n  lr: 0.001\n")  # written out: fine
    assert recipe.read(p)["quantize"]["lr"] == 0.001


@pytest.mark.parametrize("levels", [33, 100_000])
@pytest.mark.parametrize(
    ("suffix", "make"),
    [
        (".json", lambda n: '{"distill": {"student_kwargs": {"a": ' + "[" * n + "]" * n + "}}}"),
        (".toml", lambda n: "[distill.student_kwargs]\na = " + "[" * n + "]" * n + "\n"),
        (".yaml", lambda n: "distill:\n  student_kwargs:\n    a: " + "[" * n + "]" * n + "\n"),
    ],
)
def test_deep_nesting_is_refused_before_work(tmp_path, suffix, make, levels):
    p = tmp_path / f"r{suffix}"
    p.write_text(make(levels))
    with bounded(), pytest.raises(InputError, match="nested more than 32 levels deep"):
        recipe.read(p)


def test_deep_toml_tables_are_refused(tmp_path):
    p = tmp_path / "r.toml"
    p.write_text("[distill.student_kwargs" + ".a" * 40 + "]\nx = 1\n")
    with pytest.raises(InputError, match="nested more than 32 levels deep"):
        recipe.read(p)
    p.write_text("[distill.student_kwargs" + ".a" * 20 + "]\nx = 1\n")  # 23 levels: fine
    assert recipe.read(p)["distill"]["student_kwargs"]["a"]


def test_recipe_over_a_mebibyte_is_refused_unparsed(tmp_path):
    p = tmp_path / "r.toml"
    p.write_text("# padding\n" * (recipe.MAX_RECIPE_BYTES // 10 + 1))
    with bounded(), pytest.raises(InputError, match="r.toml: over 1 MiB.*right file"):
        recipe.read(p)


@pytest.mark.parametrize(
    ("encode", "message"),
    [
        (lambda t: t.encode("utf-16"), "saved as UTF-16; save it as UTF-8"),
        (lambda t: t.encode("latin-1"), r"not UTF-8 \(byte 0xe9 at 13\); save it as UTF-8"),
        (lambda t: b"\xef\xbb\xbf" + t.replace("\n", "\r\n").encode(), None),  # BOM + CRLF
    ],
)
def test_recipe_encodings_are_named_with_the_fix(tmp_path, encode, message):
    """A Notepad "Unicode" recipe read "not valid TOML: 'utf-8' codec can't decode byte
    0xff in position 0", with no word of what to do."""
    from compresskit.compressor import recipe

    path = tmp_path / "r.toml"
    path.write_bytes(encode("# recipe: caf\u00e9\n[prune]\nsparsity = 0.5\n"))
    if message is None:
        assert recipe.load(path).prune.sparsity == 0.5
        return
    with pytest.raises(InputError, match=message):
        recipe.load(path)


def test_cli_dry_run_refuses_the_alias_bomb(tmp_path, run):
    bomb = alias_bomb(tmp_path / "bomb.yaml")
    with bounded(seconds=2):
        r = run("shrink", tmp_path / "m.pt", "--recipe", bomb, "--dry-run", "--out", tmp_path / "o")
    _one_line(r, f"error: recipe file {bomb}: YAML alias", "write the value out in full")
    assert r.stdout == "" and not (tmp_path / "o").exists()


# --- .npz -----------------------------------------------------------------------------------


def test_npz_zip_bomb_is_refused_unread_within_a_second_and_a_memory_bound(tmp_path):
    bomb = npz_bomb(tmp_path)
    assert bomb.stat().st_size < 4 * MiB
    with bounded(), pytest.raises(InputError) as info:
        data_mod.load(f"npz:{bomb}")
    message = str(info.value)
    assert "bomb.npz: would expand from" in message and " to 3,221,225," in message
    assert "x.npy declares" in message and "zip bomb" in message and "np.savez" in message


def test_npz_claiming_a_billion_elements_is_refused_for_its_size_not_for_pickles(tmp_path):
    raw = npy_header((10**9,), "<f8") + b"\0" * 64
    p = raw_zip(tmp_path / "claims.npz", [{"name": "x.npy", "payload": raw}, LABELS])
    with bounded(), pytest.raises(InputError) as info:
        data_mod.load(f"npz:{p}")
    message = str(info.value)
    assert "array x declares shape (1000000000,) of float64" in message
    assert "8,000,000,000 bytes) but member x.npy holds 64 bytes" in message
    assert "pickled" not in message


def test_npz_object_array_is_refused_as_pickled_objects(tmp_path):
    f = io.BytesIO()
    np.save(f, np.array([{"a": 1}] * 10, dtype=object), allow_pickle=True)
    p = raw_zip(tmp_path / "obj.npz", [{"name": "x.npy", "payload": f.getvalue()}, LABELS])
    with pytest.raises(InputError, match=r"array x holds pickled objects \(dtype object\)"):
        data_mod.load(f"npz:{p}")


def test_npz_overlapping_members_are_refused(tmp_path):
    x = {"name": "x.npy", "payload": deflate_zeros(MiB, npy_header((4096, 1, 8, 8))), "method": 8}
    members = [{**x, "size": MiB + 128}, LABELS]
    members += [{**x, "name": f"x{i}.npy", "size": MiB + 128, "same_as": 0} for i in range(50)]
    p = raw_zip(tmp_path / "overlap.npz", members)
    with pytest.raises(InputError, match="more than the whole .*-byte file: members overlap"):
        data_mod.load(f"npz:{p}")


def test_npz_member_past_the_end_of_the_file(tmp_path):
    p = raw_zip(tmp_path / "cut.npz", [{"name": "x.npy", "payload": npy(np.zeros((10, 8, 8)))}])
    p.write_bytes(p.read_bytes()[:100] + p.read_bytes()[-100:])  # keep the directory
    with pytest.raises(InputError, match="cut.npz: member x.npy claims .* outside the 200-byte"):
        data_mod.load(f"npz:{p}")
    good = npy(np.zeros((10, 8, 8)))
    p = raw_zip(tmp_path / "lie.npz", [{"name": "x.npy", "payload": good[:200], "size": len(good)}])
    with pytest.raises(InputError, match="stored member x.npy declares .* but holds 200 bytes"):
        data_mod.load(f"npz:{p}")


@pytest.mark.parametrize("crc_of_prefix", [True, False])
def test_npz_lying_sizes_cannot_make_it_inflate_more(tmp_path, crc_of_prefix):
    # x declares 10 images (768 bytes) but its deflate stream holds 3 GiB: zipfile stops at
    # the declared size, then checks the CRC of what it read.
    header = npy_header((10, 8, 8), "|u1")
    declared = header + b"\0" * 640
    x = {"name": "x.npy", "payload": deflate_zeros(3 * GiB, header), "method": 8}
    x |= {"size": len(declared), "crc": zlib.crc32(declared) if crc_of_prefix else 0}
    p = raw_zip(tmp_path / "lying.npz", [x, LABELS])
    with bounded():
        if crc_of_prefix:  # the 768 bytes it declares, and nothing more
            d = data_mod.load(f"npz:{p}")
            assert len(d.y_train) + len(d.y_test) == 10
        else:
            with pytest.raises(InputError, match=r"array x: not a readable .npy member \(Bad CRC"):
                data_mod.load(f"npz:{p}")


def test_npz_over_the_element_cap(tmp_path, monkeypatch):
    p = tmp_path / "ok.npz"
    np.savez(p, x=np.zeros((10, 8, 8), np.uint8), y=np.arange(10) % 2)
    assert len(data_mod.load(f"npz:{p}").y_train) == 8
    monkeypatch.setenv(limits.ENV_MAX_ELEMENTS, "600")
    with pytest.raises(InputError, match=r"arrays declare 640 elements .* cap of 600.*\$COMPRESS"):
        data_mod.load(f"npz:{p}")
    monkeypatch.setenv(limits.ENV_MAX_ELEMENTS, "50")  # 50 x 8 bytes < the members' sizes
    with pytest.raises(InputError, match=r"members declare .* bytes uncompressed .* 50 elements"):
        data_mod.load(f"npz:{p}")


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\x93NUMPY\x02\x00" + struct.pack("<I", 2**31), "a header of 2,147,483,648 bytes"),
        (b"\x93NUMPY\x01\x00\x10\x00{'descr': '<f4'", "header is truncated"),
        (b"\x93NUMPY\x07\x00", r"format version \(7, 0\)"),
        (b"not numpy", "the magic string is not correct"),
    ],
)
def test_npz_bad_npy_headers(tmp_path, payload, message):
    p = raw_zip(tmp_path / "h.npz", [{"name": "x.npy", "payload": payload}, LABELS])
    with (
        bounded(),
        pytest.raises(InputError, match=f"array x: not a readable .npy member.*{message}"),
    ):
        data_mod.load(f"npz:{p}")


def test_npz_with_a_compression_numpy_never_writes(tmp_path):
    p = tmp_path / "bz.npz"
    with zipfile.ZipFile(p, "w", zipfile.ZIP_BZIP2) as z:
        z.writestr("x.npy", npy(np.zeros((10, 8, 8))))
    with pytest.raises(InputError, match="x.npy uses zip compression method 12"):
        data_mod.load(f"npz:{p}")


def test_compressed_npz_still_loads(tmp_path):
    p = tmp_path / "c.npz"
    np.savez_compressed(p, x=np.zeros((10, 8, 8), np.uint8), y=np.arange(10) % 2)
    assert len(data_mod.load(f"npz:{p}").y_test) == 2


def test_cli_refuses_the_npz_bomb_and_writes_nothing(tmp_path, run):
    model = checkpoint.save(tmp_path / "m.pt", tiny("mlp"), ModelSpec("mlp", {}))
    bomb = npz_bomb(tmp_path)
    with bounded(seconds=2):
        r = run("shrink", model, "--data", f"npz:{bomb}", "--out", tmp_path / "out", "-q")
    _one_line(r, f"error: --data 'npz:{bomb}': bomb.npz: would expand", "np.savez")
    assert not (tmp_path / "out").exists()


# --- .pt ------------------------------------------------------------------------------------


def test_crafted_pt_files_are_faithful(tmp_path):
    # The writers below make files torch itself loads when they tell the truth.
    honest = torch_zip(tmp_path, "honest.pt", 4, b"\0" * 16)
    assert checkpoint.load(honest).state_dict["w"].shape == (4,)
    old = legacy_pt(tmp_path / "legacy.pt", 4)
    assert checkpoint.load(old).state_dict["w"].shape == (4,)
    real = tmp_path / "real_legacy.pt"
    torch.save({"w": torch.ones(3)}, real, _use_new_zipfile_serialization=False)
    assert checkpoint.load(real).state_dict["w"].sum() == 3


def test_pt_zip_bomb_is_refused_unread_within_a_second_and_a_memory_bound(tmp_path):
    n = 3 * GiB
    bomb = torch_zip(tmp_path, "bomb.pt", n // 4, deflate_zeros(n), method=8, size=n)
    assert bomb.stat().st_size < 4 * MiB
    with bounded(), pytest.raises(InputError) as info:
        checkpoint.load(bomb)
    message = str(info.value)
    assert f"{bomb}: record " in message and "/data/0 declares 3,221,225,472 bytes" in message
    assert "more than the whole" in message and "torch.save(model.state_dict(), path)" in message


def test_pt_storage_larger_than_the_file_is_refused(tmp_path):
    p = torch_zip(tmp_path, "numel.pt", 10**10, b"\0" * 16)
    with bounded(), pytest.raises(InputError) as info:
        checkpoint.load(p)
    assert "storage 0 declares 10,000,000,000 elements of torch.FloatStorage" in str(info.value)
    assert "(40,000,000,000 bytes), more than the whole" in str(info.value)


def test_legacy_pt_storage_larger_than_the_file_is_refused(tmp_path):
    p = legacy_pt(tmp_path / "legacy.pt", 3 * GiB // 4)
    with bounded(), pytest.raises(InputError, match="storage 0 declares 805,306,368 elements"):
        checkpoint.load(p)


def test_pt_over_the_element_cap(tmp_path, monkeypatch):
    p = checkpoint.save(tmp_path / "m.pt", tiny("mlp"), ModelSpec("mlp", {}))
    n = sum(t.numel() for t in checkpoint.load(p).state_dict.values())
    with pytest.raises(
        InputError, match=f"declares {n:,} tensor elements, more than the cap of 10"
    ):
        checkpoint.load(p, max_elements=10)
    monkeypatch.setenv(limits.ENV_MAX_ELEMENTS, str(n - 1))
    with pytest.raises(InputError, match=r"cap of .*raise the cap \(\$COMPRESS_MAX_ELEMENTS\)"):
        checkpoint.load(p)
    monkeypatch.setenv(limits.ENV_MAX_ELEMENTS, str(n))
    assert checkpoint.load(p).state_dict
    # A bare OrderedDict state_dict, in both torch.save formats.
    for legacy in (False, True):
        bare = tmp_path / f"bare{legacy}.pt"
        state = tiny("mlp").state_dict()
        torch.save(state, bare, _use_new_zipfile_serialization=not legacy)
        assert set(checkpoint.load(bare).state_dict) == set(state)
        with pytest.raises(InputError, match=f"{bare}: declares {n:,} tensor elements"):
            checkpoint.load(bare, max_elements=n - 1)


def test_pt_records_that_overlap(tmp_path):
    real = checkpoint.save(tmp_path / "m.pt", tiny("mlp"), ModelSpec("mlp", {}))
    with zipfile.ZipFile(real) as z:
        members = [{"name": i.filename, "payload": z.read(i)} for i in z.infolist()]
    members += [{**members[0], "name": f"m/extra{i}", "same_as": 0} for i in range(100)]
    p = raw_zip(tmp_path / "overlap.pt", members)
    with pytest.raises(InputError, match="overlap.pt: its members' data add up to"):
        checkpoint.load(p)


def test_cli_refuses_the_pt_bomb_and_writes_nothing(tmp_path, run):
    n = 3 * GiB
    bomb = torch_zip(tmp_path, "bomb.pt", n // 4, deflate_zeros(n), method=8, size=n)
    with bounded(seconds=2):
        r = run("shrink", bomb, "--data", "digits", "--out", tmp_path / "out", "-q")
    _one_line(r, f"error: {bomb}: record", "torch.save(model.state_dict(), path)")
    assert not (tmp_path / "out").exists()


# --- .onnx given to compress bench ----------------------------------------------------------


def _external(name: str, location: str):
    from onnx import TensorProto, numpy_helper

    t = numpy_helper.from_array(np.ones((4, 3), np.float32), name)
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", "48")):
        e = t.external_data.add()
        e.key, e.value = k, v
    return t


def onnx_model(path: Path, location: str, in_subgraph: bool = False) -> Path:
    """x @ W with W's data in external file `location`; or W a Constant inside an If."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])
    if in_subgraph:
        w = helper.make_tensor_value_info("W", TensorProto.FLOAT, [4, 3])
        const = helper.make_node("Constant", [], ["W"], value=_external("W", location))
        branch = helper.make_graph([const], "branch", [], [w])
        cond = helper.make_tensor("c", TensorProto.BOOL, [], [True])
        nodes = [
            helper.make_node("If", ["c"], ["W"], then_branch=branch, else_branch=branch),
            helper.make_node("MatMul", ["x", "W"], ["y"]),
        ]
        graph = helper.make_graph(nodes, "g", [x], [y], [cond])
    else:
        nodes = [helper.make_node("MatMul", ["x", "W"], ["y"])]
        graph = helper.make_graph(nodes, "g", [x], [y], [_external("W", location)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    onnx.save(model, path)
    return path


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "secret.bin").write_bytes(np.ones(12, np.float32).tobytes())
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(np.ones(12, np.float32).tobytes())
    (folder / "sub").mkdir()
    (folder / "sub" / "w.bin").write_bytes(np.ones(12, np.float32).tobytes())
    (folder / "link.bin").symlink_to(tmp_path / "secret.bin")
    return folder


@pytest.mark.parametrize("in_subgraph", [False, True])
@pytest.mark.parametrize(
    ("location", "message"),
    [
        ("../secret.bin", "'../secret.bin', outside the model's folder"),
        ("sub/../../secret.bin", "'sub/../../secret.bin', outside the model's folder"),
        ("ABSOLUTE", "an absolute path"),
        ("link.bin", "'link.bin', a link to .*secret.bin, outside the model's folder"),
        ("", "is stored externally but names no location"),
    ],
)
def test_onnx_external_data_outside_the_folder_is_refused(
    model_dir, location, message, in_subgraph
):
    if location == "ABSOLUTE":
        location = str(model_dir.parent / "secret.bin")
    p = onnx_model(model_dir / "m.onnx", location, in_subgraph)
    with bounded(), pytest.raises(InputError, match=message) as info:
        safeload.check_onnx_external_data(p)
    assert str(info.value).startswith(f"{p}: tensor 'W'") and "relative paths" in str(info.value)


@pytest.mark.parametrize("location", ["weights.bin", "sub/w.bin", "./sub/../weights.bin"])
def test_onnx_external_data_beside_the_model_is_fine(model_dir, location):
    safeload.check_onnx_external_data(onnx_model(model_dir / "m.onnx", location))
    safeload.check_onnx_external_data(onnx_model(model_dir / "s.onnx", location, True))


def test_cli_bench_refuses_external_data_outside_and_writes_nothing(model_dir, tmp_path, run):
    p = onnx_model(model_dir / "m.onnx", "../secret.bin")
    report, plot = tmp_path / "r.md", tmp_path / "p.png"
    r = run("bench", p, "--providers", "cpu", "--report", report, "--plot", plot, "-q")
    _one_line(
        r, f"error: {p}: tensor 'W' keeps its data in external file '../secret.bin'", "relative"
    )
    assert not report.exists() and not plot.exists() and r.stdout == ""


def _one_line(result, start: str, fix: str) -> None:
    assert result.exit_code == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(start) and fix in lines[0], result.stderr


def test_a_gzip_bomb_in_an_idx_file_is_refused_at_the_cap(tmp_path, monkeypatch):
    """A valid IDX header then a long run of zeros, gzipped: it inflated whole (6 GB from
    26 MB) before any check. Now at most the element cap is inflated, and the header's
    dimensions are checked against it too."""
    import gzip

    monkeypatch.setenv(limits.ENV_MAX_ELEMENTS, str(1 << 20))
    header = b"\0\0\x08\x03" + struct.pack(">3I", 64, 512, 512)  # 16.8M values
    bomb = tmp_path / "t10k-images-idx3-ubyte.gz"
    with gzip.open(bomb, "wb") as f:
        f.write(header)
        for _ in range(16):
            f.write(bytes(1 << 20))
    assert bomb.stat().st_size < 100_000
    with pytest.raises(InputError, match="inflates to more than 1,048,576 values"):
        data_mod.read_idx(bomb, 3)
    plain = tmp_path / "plain-idx3-ubyte"
    plain.write_bytes(header)  # no data at all: the header alone is over the cap
    with pytest.raises(InputError, match="header declares 16,777,216 values, above the cap"):
        data_mod.read_idx(plain, 3)


def test_checkpoint_metadata_that_is_not_a_table_is_refused(tmp_path):
    spec = ModelSpec("mlp", {"in_shape": [1, 8, 8], "num_classes": 10, "hidden": [8]})
    path = tmp_path / "m.pt"
    checkpoint.save(path, tiny("mlp", in_shape=(1, 8, 8)), spec)
    obj = torch.load(path, weights_only=True)
    for bad in (5, "x", [1, 2]):
        torch.save({**obj, "metadata": bad}, path)
        with pytest.raises(InputError, match="metadata is not a table"):
            checkpoint.load(path)


def test_a_model_spec_larger_than_any_constructor_takes_is_refused_unbuilt(tmp_path, run):
    """hidden=[1] * 250000 in a checkpoint or archive header held the meta-device build (which
    was to cost nothing) for 34 s and 1.5 GB; a spec that is not a mapping did not name the file."""
    spec = ModelSpec("mlp", {"in_shape": [1, 8, 8], "num_classes": 10, "hidden": [8]})
    path = tmp_path / "m.pt"
    checkpoint.save(path, tiny("mlp", in_shape=(1, 8, 8)), spec)
    obj = torch.load(path, weights_only=True)
    torch.save({**obj, "model": {"name": "lenet300", "kwargs": {"hidden": [1] * 20_000}}}, path)
    message = f"{path}: model spec for lenet300: .*over 10,000"
    with bounded(seconds=1.0), pytest.raises(InputError, match=message):
        checkpoint.load(path)
    torch.save({**obj, "model": "lenet300"}, path)
    result = run("shrink", path, "--dry-run")
    assert result.exit_code == 2 and result.stderr.startswith(f"error: {path}: model spec must")


@pytest.mark.parametrize(("key", "value"), [("rounds", 101), ("rounds", 10**40)])
def test_prune_rounds_are_bounded(key, value):
    with pytest.raises(InputError, match=f"prune.{key} = {value} is impossible"):
        recipe.resolve({"prune": {key: value}})
    with pytest.raises(InputError, match="export.fixed_batch"):
        recipe.resolve({"export": {"fixed_batch": 10**23}})


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("r.json", '{"prune": {"sparsity": 0.5, "sparsity": 0.9}}', "key 'sparsity' given twice"),
        ("r.yaml", "prune:\n  sparsity: 0.5\n  sparsity: 0.9\n", "key 'sparsity' given twice"),
        ("r.yaml", "prune: {}\nprune: {}\n", "key 'prune' given twice in one table (line 2)"),
    ],
)
def test_a_key_given_twice_is_refused_in_every_recipe_format(tmp_path, name, text, message):
    """JSON and YAML kept the last of a repeated key silently (TOML refuses it)."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(InputError, match=re.escape(message)):
        recipe.read(path)


def test_a_byte_order_mark_and_an_empty_yaml_file_are_read(tmp_path):
    for name, text in (
        ("r.toml", "[prune]\nsparsity = 0.5\n"),
        ("r.json", '{"prune": {"sparsity": 0.5}}'),
    ):
        path = tmp_path / name
        path.write_bytes(b"\xef\xbb\xbf" + text.encode())  # as Windows editors save
        assert recipe.read(path) == {"prune": {"sparsity": 0.5}}
    (tmp_path / "empty.yaml").write_text("")
    assert recipe.read(tmp_path / "empty.yaml") == {}  # as an empty TOML file


def test_a_large_file_that_is_no_archive_is_refused_unread(tmp_path):
    """The .dcz reader read the whole file before its magic-byte check: 1.8 GB of RSS for a
    sparse 1.5 GB file, MemoryError for 5 GB under a memory limit."""
    from compresskit.compressor import archive

    big = tmp_path / "big.dcz"
    with open(big, "wb") as f:
        f.truncate(2 * GiB)  # sparse: no disk used
    with bounded(seconds=1.0), pytest.raises(InputError, match="wrong magic bytes"):
        archive.read(big)
    with pytest.raises(InputError, match="a folder, not an archive"):
        archive.read(tmp_path)


@pytest.mark.parametrize("rows", [2**25, 10**12])
def test_a_calibration_file_declaring_more_than_it_holds(tmp_path, rows):
    """A truncated .npy was "holds Python objects"; 10^12 declared rows a MemoryError."""
    from compresskit.compressor.export.onnxfile import load_calibration

    path = tmp_path / "cal.npy"
    path.write_bytes(npy_header((rows, 1, 8, 8)))
    with bounded(seconds=1.0), pytest.raises(InputError, match="its header declares float32"):
        load_calibration(path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.to(torch.complex64), "is torch.complex64 in the file but torch.float32"),
        (lambda t: t > 0, "is torch.bool in the file but torch.float32"),
        (lambda t: t.long(), "is torch.int64 in the file but torch.float32"),
        (lambda t: torch.empty(t.shape, device="meta"), "is a meta tensor, which holds no values"),
        (lambda t: t.to_sparse(), "is a torch.sparse_coo tensor; save t.to_dense()"),
    ],
)
def test_weights_of_a_kind_no_model_takes_are_refused(tmp_path, change, message):
    """load_state_dict cast them silently (complex lost its imaginary part, bool became 0/1)
    or failed with torch's own words (meta, sparse)."""
    spec = ModelSpec("mlp", {"in_shape": [1, 8, 8], "num_classes": 10, "hidden": [8]})
    path = tmp_path / "m.pt"
    checkpoint.save(path, tiny("mlp", in_shape=(1, 8, 8)), spec)
    obj = torch.load(path, weights_only=True)
    key = next(iter(obj["state_dict"]))
    obj["state_dict"][key] = change(obj["state_dict"][key])
    torch.save(obj, path)
    with pytest.raises(InputError, match=re.escape(f"{key} {message}")):
        checkpoint.load(path).build_model()
    obj["state_dict"][key] = torch.zeros(obj["state_dict"][key].shape, dtype=torch.float64)
    torch.save(obj, path)
    checkpoint.load(path).build_model()  # another float precision is cast, as before


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("os:system", "os is Python's standard library, which builds no models"),
        ("subprocess:run", "subprocess is Python's standard library"),
        ("builtins:eval", "builtins is Python's standard library"),
        ("torch:zeros", "zeros is a built-in function"),
    ],
)
def test_trusted_code_is_still_a_model_constructor(tmp_path, name, message):
    """--trust-model consents to the user's model code; a checkpoint naming os:system with
    {"command": ...} ran the command, then failed on what it returned."""
    from compresskit.models.zoo import resolve

    marker = tmp_path / "ran"
    with pytest.raises(InputError, match=re.escape(message)):
        resolve(name)
    spec = ModelSpec(name, {"command": f"touch {marker}"})
    path = tmp_path / "m.pt"
    checkpoint.save(path, tiny("mlp", in_shape=(1, 8, 8)), spec)
    with pytest.raises(InputError, match=re.escape(message)):
        checkpoint.load(path).build_model(allow_import=True)
    assert not marker.exists()
