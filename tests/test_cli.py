"""The CLI as a user meets it: help, JSON output, exit codes, and one-line errors."""

import json
import os
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from compresskit.models import checkpoint
from tests.conftest import blobs

COMMANDS = ["train", "shrink", "bench", "decode", "demo"]


def test_help_lists_every_command(run):
    result = run("--help")
    assert result.exit_code == 0
    for name in COMMANDS:
        assert f"  {name} " in result.stdout
    assert "Exit codes" in result.stdout


@pytest.mark.parametrize("name", COMMANDS)
def test_each_command_help_has_an_example(run, name):
    result = run(name, "--help")
    assert result.exit_code == 0 and "Example" in result.stdout
    assert f"compress {name}" in result.stdout


def test_version(run):
    result = run("--version")
    assert result.exit_code == 0 and "compress" in result.stdout


def test_train_json_is_one_object_on_stdout(run, tmp_path, npz_file):
    out = tmp_path / "m.pt"
    result = run(
        "train",
        "--model",
        "mlp",
        "--data",
        f"npz:{npz_file}",
        "--epochs",
        "3",
        "--out",
        out,
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    obj = json.loads(result.stdout)  # the whole stdout is exactly one JSON document
    assert {"checkpoint", "test_accuracy", "epochs", "seconds"} <= obj.keys()
    assert obj["checkpoint"] == str(out) and obj["epochs"] == 3 and obj["test_accuracy"] > 0.9
    assert "epoch   3" in result.stderr  # progress and logs go to stderr
    ck = checkpoint.load(out)
    assert ck.spec.name == "mlp" and ck.metadata["test_accuracy"] == obj["test_accuracy"]
    assert ck.metadata["data"] == f"npz:{npz_file}" and ck.metadata["epochs"] == 3


def test_train_table_without_json(run, tmp_path, npz_file):
    result = run(
        "train",
        "--model",
        "mlp",
        "--data",
        f"npz:{npz_file}",
        "--epochs",
        "1",
        "--out",
        tmp_path / "m.pt",
        "--quiet",
    )
    assert result.exit_code == 0
    assert "test acc" in result.stdout and "checkpoint:" in result.stdout
    assert result.stderr == ""


def test_default_out_is_named_after_the_model(run, tmp_path, npz_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run("train", "--model", "mlp", "--data", f"npz:{npz_file}", "--epochs", "1", "-q")
    assert result.exit_code == 0 and (tmp_path / "mlp.pt").is_file()


def test_ctrl_c_keeps_last_checkpoint_and_resume_equals_one_run(
    run, tmp_path, npz_file, monkeypatch
):
    from compresskit.distrib import trainer

    args = ["train", "--model", "mlp", "--data", f"npz:{npz_file}", "--epochs", "4", "-q"]
    assert run(*args, "--out", tmp_path / "straight.pt").exit_code == 0

    real = trainer.Checkpointer.save
    calls = []

    def save_then_interrupt(self, model, state, **meta):
        path = real(self, model, state, **meta)
        calls.append(1)
        if len(calls) == 2:  # Ctrl-C right after the epoch-2 checkpoint
            raise KeyboardInterrupt
        return path

    out = tmp_path / "m.pt"
    with monkeypatch.context() as m:
        m.setattr(trainer.Checkpointer, "save", save_then_interrupt)
        result = run(*args, "--out", out)
    assert result.exit_code == 130
    assert "last good checkpoint" in result.stderr and "--resume" in result.stderr
    assert checkpoint.load(out).train_state["epoch"] == 2

    result = run(*args, "--out", out, "--resume", "--json")
    assert result.exit_code == 0 and result.json()["resumed_from"] == [2, 0]
    a, b = checkpoint.load(tmp_path / "straight.pt"), checkpoint.load(out)
    assert all(torch.equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)


# --- bad input: each a one-line error, exit 2, no output file left behind -------------------


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    (tmp_path / "fixednets.py").write_text(
        textwrap.dedent("""
        from torch import nn
        class Fixed64(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(64, 10)
            def forward(self, x):
                return self.fc(x.flatten(1))
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))


def _files(folder: Path) -> set[str]:
    return {p.name for p in folder.rglob("*")}


def _bad_cases(tmp: Path):
    d = tmp / "data"
    d.mkdir()
    # IDX with the wrong magic, and a truncated one
    x, y = blobs(10, side=28)
    from tests.conftest import write_idx

    (d / "magic").mkdir()
    write_idx(d / "magic" / "t10k-images-idx3-ubyte", x)
    (d / "magic" / "t10k-labels-idx1-ubyte").write_bytes(b"\x00\x00\x08\x03" + bytes(20))
    (d / "trunc").mkdir()
    raw = write_idx(d / "trunc" / "t10k-images-idx3-ubyte", x).read_bytes()
    (d / "trunc" / "t10k-images-idx3-ubyte").write_bytes(raw[: len(raw) - 100])
    write_idx(d / "trunc" / "t10k-labels-idx1-ubyte", y)
    np.savez(d / "nox.npz", images=x, y=y)
    np.savez(d / "labels.npz", x=x, y=np.arange(10) + 5)
    np.savez(d / "ok.npz", x=x[:, :8, :8], y=y)
    (d / "text.pt").write_text("hello\n")
    ck = checkpoint.save(
        d / "real.pt", torch.nn.Linear(2, 2), __import__("models").ModelSpec("mlp")
    )
    (d / "trunc.pt").write_bytes(ck.read_bytes()[:300])
    ck.unlink()

    class Payload:
        def __reduce__(self):
            return (open, (str(tmp / "code-ran"), "w"))

    torch.save({"state_dict": {}, "p": Payload()}, d / "evil.pt")
    ro = tmp / "readonly"
    ro.mkdir()
    ro.chmod(0o500)
    readonly = ro if os.geteuid() != 0 else Path("/sys")  # root writes anywhere but /sys
    ok = f"npz:{d / 'ok.npz'}"
    out = tmp / "out" / "m.pt"
    return (
        {
            "missing data dir": (["--data", f"mnist:{tmp / 'nowhere'}"], "does not exist"),
            "IDX wrong magic": (["--data", f"mnist:{d / 'magic'}"], "not an IDX file"),
            "IDX truncated": (["--data", f"mnist:{d / 'trunc'}"], "truncated"),
            "npz without x": (["--data", f"npz:{d / 'nox.npz'}"], "lacks array"),
            "labels out of range": (["--data", f"npz:{d / 'labels.npz'}"], "labels out of range"),
            "shape vs fixed model": (
                ["--model", "fixednets:Fixed64", "--data", "digits:28"],
                "do not fit model",
            ),
            "in_shape vs data": (["--model-kwargs", '{"in_shape": [1, 28, 28]}'], "in_shape"),
            "unknown model": (["--model", "lenet7"], "unknown model"),
            "import path missing": (["--model", "nosuch.module:Net"], "cannot import"),
            "kwargs not JSON": (["--model-kwargs", "{width: 3}"], "not JSON"),
            "checkpoint is text": (["--out", d / "text.pt", "--resume"], "not a torch.save file"),
            "checkpoint truncated zip": (["--out", d / "trunc.pt", "--resume"], "truncated"),
            "checkpoint with code": (["--out", d / "evil.pt", "--resume"], "pickled code"),
            "out folder missing": (["--out", tmp / "nowhere" / "m.pt"], "does not exist"),
            "out folder not writable": (["--out", readonly / "m.pt"], "not writable"),
            "epochs 0": (["--epochs", "0"], "--epochs"),
            "epochs negative": (["--epochs", "-3"], "--epochs"),
        },
        ok,
        out,
    )


BAD = [
    "missing data dir",
    "IDX wrong magic",
    "IDX truncated",
    "npz without x",
    "labels out of range",
    "shape vs fixed model",
    "in_shape vs data",
    "unknown model",
    "import path missing",
    "kwargs not JSON",
    "checkpoint is text",
    "checkpoint truncated zip",
    "checkpoint with code",
    "out folder missing",
    "out folder not writable",
    "epochs 0",
    "epochs negative",
]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(run, tmp_path, user_models, case):
    cases, ok_data, out = _bad_cases(tmp_path)
    args, message = cases[case]
    out.parent.mkdir()
    if "--data" not in args:
        args = [*args, "--data", ok_data]
    if "--out" not in args:
        args = [*args, "--out", out]
    before = _files(tmp_path)
    result = (
        run("train", "--epochs", "1", *args, "--json")
        if "--epochs" not in args
        else run("train", *args, "--json")
    )
    assert result.exit_code == 2, (case, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message in lines[0], lines[0]
    assert "Traceback" not in result.stderr
    assert json.loads(result.stdout) == {"error": lines[0][len("error: ") :], "exit_code": 2}
    assert _files(tmp_path) == before, "a bad run left a file behind"
    assert not (tmp_path / "code-ran").exists()


def test_demo_end_to_end_small(run, tmp_path, monkeypatch):
    """The demo's wiring with a smaller teacher and fewer epochs (the full run is -m slow)."""
    from compresskit.cli import demo

    monkeypatch.setitem(demo.TEACHER, "model", "mlp")
    monkeypatch.setitem(demo.TEACHER, "epochs", 2)
    monkeypatch.setattr(
        demo,
        "RECIPE",
        {
            "distill": {"student": "mlp", "student_kwargs": {"hidden": [16]}, "epochs": 2},
            "prune": {"rounds": 1, "retrain_epochs": 1},
            "quantize": {"finetune_epochs": 1},
        },
    )
    result = run("demo", "--out", tmp_path / "d", "--json", "-q")
    assert result.exit_code == 0, result.stderr
    r = result.json()
    assert (tmp_path / "d" / "teacher.pt").is_file()
    for name in ("student.pt", "student.dcz", "student.int8.onnx", "student.int8.ort"):
        assert (tmp_path / "d" / "student" / name).is_file()
    lat = r["latency_ms_batch1"]
    assert set(lat) == {"teacher_pytorch", "student_onnx_fp32", "student_onnx_int8"}
    assert all(v > 0 for v in lat.values())
    rows = r["bench"]["results"]
    assert [(x["model"], x["provider"]) for x in rows] == [
        ("teacher.pt", "pytorch-cpu"),
        ("student.fp32.onnx", "CPUExecutionProvider"),
        ("student.int8.onnx", "CPUExecutionProvider"),
    ]
    assert rows[0]["top1_agreement"] == 1.0 and rows[0]["speedup_vs_first"] == 1.0
    assert r["student"]["distilled"] and r["teacher"]["name"] == "mlp"


def test_demo_out_must_be_a_folder(run, tmp_path):
    (tmp_path / "f").write_text("")
    result = run("demo", "--out", tmp_path / "f")
    assert result.exit_code == 2 and "is a file" in result.stderr
