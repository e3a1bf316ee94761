import gc
import os
import zipfile
from pathlib import Path

import pytest
import torch

from compresskit.models import InputError, ModelSpec, checkpoint, tiny
from compresskit.models.fileio import atomic_path, check_writable

SPEC = ModelSpec("lenet5", {"in_shape": [1, 8, 8], "num_classes": 10, "channels": [4, 8], "fc": 16})


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_round_trip_keeps_spec_weights_and_metadata(tmp_path):
    model = tiny("lenet5")
    path = checkpoint.save(tmp_path / "m.pt", model, SPEC, {"test_accuracy": 0.9, "data": "digits"})
    ck = checkpoint.load(path)
    assert ck.spec == SPEC
    assert ck.metadata["test_accuracy"] == 0.9 and ck.metadata["data"] == "digits"
    assert set(ck.metadata["versions"]) == {"compress", "torch", "python"}
    assert "T" in ck.metadata["created"]
    assert ck.metadata["torch_threads"] == torch.get_num_threads()  # float sums depend on it
    assert _same(ck.build_model().state_dict(), model.state_dict())
    # The file itself is loadable by plain torch with weights_only=True.
    raw = torch.load(path, weights_only=True)
    assert raw["format"] == "compress.checkpoint" and raw["format_version"] == 1


@pytest.mark.parametrize("zipped, alignment", [(True, 64), (True, 1), (False, 64)])
def test_loading_without_the_training_state_reads_only_the_weights(tmp_path, zipped, alignment):
    from torch.utils.serialization import config

    # alignment 1: records at odd offsets, as zip files written before torch 2.1 lay them out
    with config.patch({"save.storage_alignment": alignment}):
        _lean_load(tmp_path, zipped, alignment)


def _lean_load(tmp_path, zipped, alignment):
    model = tiny("lenet5")
    moments = {"exp_avg": torch.randn(1000, 100)}  # the size of Adam's state, never read
    path = tmp_path / "m.pt"
    obj = {"format": "compress.checkpoint", "format_version": 1, "model": SPEC.to_dict()}
    obj |= {"state_dict": model.state_dict(), "metadata": {}, "train_state": moments}
    torch.save(obj, path, _use_new_zipfile_serialization=zipped)
    if zipped:  # the layout asked for
        names = zipfile.ZipFile(path).namelist()
        record = next(n for n in names if n.endswith("/.storage_alignment"))
        assert zipfile.ZipFile(path).read(record) == str(alignment).encode()
    full, lean = checkpoint.load(path), checkpoint.load(path, train_state=False)
    assert torch.equal(full.train_state["exp_avg"], moments["exp_avg"])
    assert lean.train_state is None and lean.spec == SPEC
    assert _same(lean.build_model().state_dict(), model.state_dict())
    torch.save(model.state_dict(), tmp_path / "sd.pt", _use_new_zipfile_serialization=zipped)
    bare = checkpoint.load(tmp_path / "sd.pt", train_state=False)
    assert _same(bare.state_dict, model.state_dict())
    maps = Path("/proc/self/maps")
    if maps.exists():  # copied out of the mapping: neither file is mapped once load returns
        gc.collect()
        assert str(path) not in maps.read_text() and "sd.pt" not in maps.read_text()


def test_bare_state_dict_loads_when_model_is_named(tmp_path):
    model = tiny("lenet5")
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    ck = checkpoint.load(tmp_path / "sd.pt")
    assert ck.spec is None
    with pytest.raises(InputError, match="does not name its model; pass --model"):
        ck.build_model()
    assert _same(ck.build_model(SPEC).state_dict(), model.state_dict())


def test_weights_that_do_not_fit_the_model(tmp_path):
    torch.save(tiny("mlp").state_dict(), tmp_path / "sd.pt")
    with pytest.raises(InputError, match="weights do not fit model lenet5"):
        checkpoint.load(tmp_path / "sd.pt").build_model(SPEC)


class _Payload:
    """Unpickling this calls open(marker, 'w'): code a malicious checkpoint would run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_checkpoint_with_pickled_code_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "code-ran"
    torch.save({"state_dict": {}, "payload": _Payload(marker)}, tmp_path / "evil.pt")
    # The payload is real: plain unpickling runs it.
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.exists()
    marker.unlink()
    with pytest.raises(InputError, match=r"refused: it holds pickled code \((io|builtins)\.open\)"):
        checkpoint.load(tmp_path / "evil.pt")
    assert not marker.exists()


def test_whole_pickled_module_is_refused(tmp_path):
    torch.save(tiny("mlp"), tmp_path / "whole.pt")
    with pytest.raises(InputError, match="pickled code.*state_dict"):
        checkpoint.load(tmp_path / "whole.pt")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"not a checkpoint\n", "not a torch.save file"),
        (b"", "empty"),
        ("truncate", "zip archive that is truncated"),
    ],
)
def test_files_that_are_not_checkpoints(tmp_path, content, message):
    path = tmp_path / "x.pt"
    if content == "truncate":
        good = checkpoint.save(tmp_path / "good.pt", tiny("mlp"), ModelSpec("mlp", {})).read_bytes()
        content = good[: len(good) // 2]
    path.write_bytes(content)
    with pytest.raises(InputError, match=message):
        checkpoint.load(path)


def test_torch_file_that_is_not_a_checkpoint(tmp_path):
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(InputError, match="not a checkpoint"):
        checkpoint.load(tmp_path / "list.pt")


def test_newer_format_version_is_refused(tmp_path):
    path = checkpoint.save(tmp_path / "m.pt", tiny("mlp"), ModelSpec("mlp", {}))
    obj = torch.load(path, weights_only=True)
    obj["format_version"] = 99
    torch.save(obj, path)
    with pytest.raises(InputError, match="newer than this compress reads"):
        checkpoint.load(path)


def test_interrupted_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "m.pt"
    path.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt), atomic_path(path) as tmp:
        tmp.write_bytes(b"half")
        raise KeyboardInterrupt
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]


def test_a_full_disk_names_the_file_and_the_folder_and_leaves_no_temp(tmp_path, monkeypatch):
    """torch.save on a full tmpfs said "RuntimeError: [enforce fail at inline_container.cc]
    unexpected pos 368704 vs 368596 (unexpected)": nothing about a disk, or which file."""
    import shutil

    from compresskit.models import StageError, fileio

    staged = tmp_path / ".out.host-1.x1y2"  # shrink's hidden staging folder beside --out
    staged.mkdir()
    path = staged / "model.pt"
    with pytest.raises(StageError) as info, atomic_path(path):
        raise OSError(28, "No space left on device")
    assert str(info.value) == (
        f"cannot write model.pt in {tmp_path}: no space left on device; free space there or "
        "write elsewhere"
    )
    # a library's own words for it: read from the free space where the write went
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=4096))
    with pytest.raises(StageError, match="no space left on device"), atomic_path(path):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 368704")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1 << 30))
    with pytest.raises(RuntimeError, match="unexpected pos"), atomic_path(path):
        raise RuntimeError("unexpected pos 368704")  # room enough: not the disk, as it was
    assert list(staged.iterdir()) == []
    assert fileio.machine_failure(MemoryError()) == "out of memory"
    assert fileio.machine_failure(OSError(2, "No such file or directory")) is None


def test_an_output_is_held_by_one_run_at_a_time(tmp_path):
    """Two runs into one --out both finished with exit 0, and the second replaced the first's
    files unasked; now the second is refused at once, naming the first."""
    import socket

    from compresskit.models import fileio

    out = tmp_path / "out"
    lock = tmp_path / ".out.lock"
    lock.write_text("a killed run's")  # left by SIGKILL: the kernel let its lock go
    with fileio.output_lock(out) as held:
        assert held and lock.read_text() == f"{socket.gethostname()}-{os.getpid()}"
        with pytest.raises(InputError) as info, fileio.output_lock(out):
            pass
        assert str(info.value) == (
            f"{out}: another compress run ({socket.gethostname()}-{os.getpid()}) is writing "
            "it; wait for it to end or write elsewhere"
        )
        with fileio.output_lock(tmp_path / "other"):  # another output: its own lock
            pass
    assert list(tmp_path.iterdir()) == []  # the lock file goes with the run
    with fileio.output_lock(out) as held:  # and the next run takes it
        assert held


def test_long_names_alike_to_their_end_do_not_share_a_lock(tmp_path):
    """A sweep's `<118 r>_seed1.pt` and `..._seed2.pt` shared one hidden lock name, and the
    second run was refused for a file nobody was writing."""
    from compresskit.models import fileio

    a, b = ("r" * 118 + f"_seed{i}.pt" for i in (1, 2))
    assert fileio.hidden(a) != fileio.hidden(b)
    assert all(len(os.fsencode(fileio.hidden(n) + ".lock")) < 160 for n in (a, b))
    assert fileio.hidden("é" * 70).startswith("." + "é" * 60 + "~")  # whole characters
    assert fileio.hidden("short.pt") == ".short.pt"
    with fileio.output_lock(tmp_path / a), fileio.output_lock(tmp_path / b) as held:
        assert held


def test_another_users_lock_file_still_locks(tmp_path, monkeypatch):
    """A lock file another user made (0644) could not be opened for writing, and the run went
    on unlocked into the same output; flock needs only a read."""
    from compresskit.models import fileio

    out = tmp_path / "out"
    with fileio.output_lock(out):
        real = os.open

        def not_ours(path, flags, *args):
            if str(path).endswith(".lock") and flags & os.O_RDWR:
                raise PermissionError(13, "Permission denied")
            return real(path, flags, *args)

        monkeypatch.setattr(os, "open", not_ours)
        with pytest.raises(InputError, match="another compress run"), fileio.output_lock(out):
            pass


def test_check_writable(tmp_path):
    assert check_writable(tmp_path / "a.pt") == tmp_path / "a.pt"
    with pytest.raises(InputError, match="does not exist"):
        check_writable(tmp_path / "missing" / "a.pt")
    with pytest.raises(InputError, match="is a folder"):
        check_writable(tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(InputError, match="not a folder"):
        check_writable(tmp_path / "file" / "a.pt")
    assert list(tmp_path.iterdir()) == [tmp_path / "file"]  # the probe file is gone


def test_a_tied_weight_is_saved_once_and_loads_tied(tmp_path):
    # Each tensor used to be copied on its own, so a tie took its bytes twice in the file.
    tied = torch.nn.Sequential(torch.nn.Linear(200, 200), torch.nn.Linear(200, 200))
    tied[1].weight = tied[0].weight
    untied = torch.nn.Sequential(torch.nn.Linear(200, 200), torch.nn.Linear(200, 200))
    a = checkpoint.save_state(tmp_path / "a.pt", tied.state_dict(), SPEC)
    b = checkpoint.save_state(tmp_path / "b.pt", untied.state_dict(), SPEC)
    assert b.stat().st_size - a.stat().st_size > 4 * 200 * 200 * 0.99
    state = torch.load(a, weights_only=True)["state_dict"]
    assert state["0.weight"].untyped_storage().data_ptr() == (
        state["1.weight"].untyped_storage().data_ptr()
    )
    assert torch.equal(state["1.weight"], tied[0].weight)
    # Views of one storage at other offsets or shapes are not merged.
    base = torch.arange(12.0)
    views = {"x": base[:6], "y": base[6:], "z": base.view(3, 4), "e": base[:0], "f": base[6:6]}
    got = torch.load(checkpoint.save_state(tmp_path / "v.pt", views, SPEC), weights_only=True)
    for k, v in views.items():
        assert torch.equal(got["state_dict"][k], v), k


def test_a_training_loops_checkpoint_is_read_for_its_state_dict(tmp_path):
    # {"state_dict", "optimizer", "epoch"}, Lightning's .ckpt, {"model_state_dict": ...}: they
    # were refused as "a PyTorch file but not a checkpoint" with no fix
    net = tiny("mlp")
    sd = net.state_dict()
    for key in ("state_dict", "model_state_dict", "model"):
        path = tmp_path / f"{key}.ckpt"
        torch.save({key: sd, "optimizer": {"lr": 0.1}, "epoch": 3}, path)
        ck = checkpoint.load(path)
        assert ck.spec is None and all(torch.equal(ck.state_dict[k], v) for k, v in sd.items())
    torch.save({"epoch": 3, "optimizer": {}}, tmp_path / "none.pt")
    with pytest.raises(InputError, match=r"nor a dict holding one under state_dict, .*torch\.save"):
        checkpoint.load(tmp_path / "none.pt")


def test_safetensors_names_are_read_by_that_library_and_never_written(tmp_path):
    # torch reads a .safetensors name with the safetensors library: `train --out
    # x.safetensors` wrote a torch file nothing could read back, and a damaged one failed as
    # "unexpected" (exit 1)
    with pytest.raises(InputError, match="compress writes PyTorch checkpoints"):
        checkpoint.check_out_name(tmp_path / "m.safetensors")
    checkpoint.check_out_name(tmp_path / "m.pt")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(os.urandom(100))
    try:
        import safetensors  # noqa: F401

        message = "not a readable safetensors file"
    except ImportError:
        message = "needs the safetensors package"
    with pytest.raises(InputError, match=message):
        checkpoint.load(bad)


@pytest.mark.filterwarnings("ignore:.*torch.jit.*:DeprecationWarning")  # what users still save
def test_a_compiled_program_is_named_for_what_it_is(tmp_path):
    # TorchScript's compressed code records read as "a crafted or damaged file"
    m = torch.nn.Linear(3, 2)
    torch.jit.save(torch.jit.script(m), tmp_path / "ts.pt")
    torch.export.save(torch.export.export(m, (torch.randn(1, 3),)), tmp_path / "ep.pt2")
    for name, what in (("ts.pt", "a TorchScript file"), ("ep.pt2", "a torch.export program")):
        with pytest.raises(InputError, match=f"{what} .*, a compiled program, not a checkpoint"):
            checkpoint.load(tmp_path / name)


def test_a_pipe_is_named_as_one(tmp_path):
    # `compress shrink <(...)` was "a folder, not a checkpoint", bench's "no such file"
    fifo = tmp_path / "w.pt"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="not a regular file \\(a pipe or device"):
        checkpoint.load(fifo)
    with pytest.raises(InputError, match="a folder, not a checkpoint"):
        checkpoint.load(tmp_path)
    with pytest.raises(InputError, match="no such checkpoint file"):
        checkpoint.load(tmp_path / "gone.pt")
