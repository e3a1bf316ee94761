"""Edge cases a demanding user hits: odd --out paths, misbehaving models, resume details."""

import json
import os
import textwrap

import pytest
import torch

from compresskit.models import ModelSpec, build, checkpoint
from compresskit.models.errors import InputError
from compresskit.models.fileio import umask


@pytest.fixture
def usermod(tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / "odd_models.py").write_text(
        textwrap.dedent(f"""
        import pathlib
        import torch
        from torch import nn
        pathlib.Path({str(marker)!r}).write_text("imported")

        class Net(nn.Module):
            def __init__(self, in_shape=(1, 8, 8), num_classes=10):
                super().__init__()
                self.fc = nn.Linear(64, num_classes)
            def forward(self, x):
                return self.fc(x.flatten(1))

        class ReturnsTuple(Net):
            def forward(self, x):
                return (self.fc(x.flatten(1)),)

        class ForwardRaises(Net):
            def forward(self, x):
                raise ValueError("bad input in my model")

        class Squeezes(Net):  # an (N, C, 1, 1) head squeezed: (C,) at batch 1
            def forward(self, x):
                return self.fc(x.flatten(1))[:, :, None, None].squeeze()

        class AuxInTraining(Net):  # GoogLeNet's auxiliary logits, in training mode only
            def forward(self, x):
                out = self.fc(x.flatten(1))
                return (out, out) if self.training else out

        class Softmax(Net):
            def forward(self, x):
                return self.fc(x.flatten(1)).softmax(1)

        class FailsInTraining(Net):
            def forward(self, x):
                if self.training and x.shape[0] > 2:
                    raise IndexError("index 7 is out of bounds")
                return self.fc(x.flatten(1))
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import sys

    monkeypatch.delitem(sys.modules, "odd_models", raising=False)
    yield marker
    sys.modules.pop("odd_models", None)


def _one_line(result, code, message):
    assert result.exit_code == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (
            ["--model", "odd_models:ReturnsTuple"],
            2,
            "returns tuple for a batch of 2; compress trains single-label classifiers: one "
            "tensor of shape (batch, classes); train and shrink need the logits alone",
        ),
        (
            ["--model", "odd_models:Squeezes"],
            2,
            "returns (10,) for a batch of 1 but (2, 10) for a batch of 2: its forward drops "
            "the batch axis (a .squeeze() of an (N, C, 1, 1) head does at batch 1); use "
            ".flatten(1)",
        ),
        (
            ["--model", "odd_models:AuxInTraining"],
            2,
            "returns tuple for a batch of 2 in training mode; compress trains single-label "
            "classifiers",
        ),
        (
            ["--model", "odd_models:Softmax"],
            2,
            "returns probabilities (each row is >= 0 and sums to 1): train and shrink need logits",
        ),
        (["--model", "odd_models:ForwardRaises"], 2, "ValueError: bad input in my model"),
        (["--model", "odd_models:FailsInTraining"], 1, "IndexError: index 7 is out of bounds"),
        (["--model", "vgg", "--model-kwargs", '{"width": -1}'], 2, "could not be built"),
        (["--model", "lenet300", "--model-kwargs", '{"in_shape": 5}'], 2, "in_shape"),
        (["--seed", "99999999999999999999"], 2, "--seed"),
        (["--bogus"], 2, "No such option"),
    ],
)
def test_user_mistakes_and_model_failures_are_one_line(run, tmp_path, usermod, args, code, message):
    result = run("train", "--epochs", "1", "--out", tmp_path / "m.pt", *args, "--json", "-q")
    _one_line(result, code, message)
    assert json.loads(result.stdout)["exit_code"] == code
    assert not (tmp_path / "m.pt").exists()


def test_bare_compress_shows_help(run):
    result = run()
    assert result.exit_code == 0 and "Commands:" in result.stdout


def test_outputs_get_the_usual_file_mode(run, tmp_path):
    result = run("train", "--model", "mlp", "--epochs", "1", "--out", tmp_path / "m.pt", "-q")
    assert result.exit_code == 0, result.stderr
    assert oct((tmp_path / "m.pt").stat().st_mode & 0o777) == oct(0o666 & ~umask())


@pytest.fixture
def teacher_pt(tmp_path):
    from compresskit.models import ModelSpec, build

    spec = ModelSpec("mlp", {"in_shape": [1, 8, 8], "num_classes": 10, "hidden": [8]})
    return checkpoint.save(tmp_path / "teacher.pt", build(spec), spec)


@pytest.mark.parametrize(
    "command",
    [
        ["train", "--model", "mlp", "--epochs", "1", "-q", "--out", "{link}"],
        ["shrink", "{teacher}", "-q", "--out", "{link}"],
        ["decode", "{archive}", "--out", "{link}"],
        ["bench", "{teacher}", "--report", "{link}"],
        ["bench", "{teacher}", "--plot", "{link}"],
        ["demo", "-q", "--out", "{link}"],
    ],
    ids=["train", "shrink", "decode", "bench-report", "bench-plot", "demo"],
)
@pytest.mark.parametrize("target", ["file", "folder", "dangling"])
def test_out_that_is_a_symlink_is_refused_and_its_target_untouched(
    run, tmp_path, teacher_pt, command, target
):
    from compresskit.compressor import archive

    victim = tmp_path / "victim"
    if target == "file":
        victim.write_text("precious")
    elif target == "folder":
        victim.mkdir()
        (victim / "report.json").write_text("precious")
    link = tmp_path / "link"
    link.symlink_to(victim)
    dcz = tmp_path / "m.dcz"
    archive.write(dcz, [], {"name": "mlp", "kwargs": {}}, {})
    args = [a.format(link=link, teacher=teacher_pt, archive=dcz) for a in command]
    result = run(*args)
    _one_line(result, 2, "is a symbolic link")
    assert link.is_symlink()
    if target == "file":
        assert victim.read_text() == "precious"
    elif target == "folder":
        assert [p.name for p in victim.iterdir()] == ["report.json"]
        assert (victim / "report.json").read_text() == "precious"
    else:
        assert not victim.exists()


def test_out_that_is_not_a_regular_file_is_refused(run, tmp_path):
    fifo = tmp_path / "pipe.pt"
    os.mkfifo(fifo)
    result = run("train", "--epochs", "1", "--out", fifo)
    _one_line(result, 2, "not a regular file")


def test_checkpoint_naming_user_code_needs_consent(run, tmp_path, usermod):
    out = tmp_path / "m.pt"
    assert (
        run("train", "--model", "odd_models:Net", "--epochs", "1", "--out", out, "-q").exit_code
        == 0
    )
    usermod.unlink()
    import sys

    sys.modules.pop("odd_models", None)
    result = run("train", "--epochs", "2", "--out", out, "--resume")
    _one_line(result, 2, "pass --model odd_models:Net to allow importing it")
    assert not usermod.exists()  # the module named by the file was not imported
    result = run(
        "train", "--model", "odd_models:Net", "--epochs", "2", "--out", out, "--resume", "-q"
    )
    assert result.exit_code == 0, result.stderr


def test_resume_checks_model_kwargs_and_resolves_lr(run, tmp_path):
    out = tmp_path / "m.pt"
    base = ["train", "--model", "mlp", "--epochs", "1", "--out", out, "-q"]
    assert run(*base, "--model-kwargs", '{"hidden": [8]}').exit_code == 0
    result = run(*base, "--model-kwargs", '{"hidden": [256]}', "--resume", "--epochs", "2")
    _one_line(result, 2, "--model-kwargs")
    # An explicit --lr equal to the default it was trained with is the same setting.
    result = run(*base, "--lr", "0.003", "--resume", "--epochs", "2")
    assert result.exit_code == 0, result.stderr


def test_ctrl_c_does_not_point_at_an_older_file(run, tmp_path, monkeypatch):
    from compresskit.distrib import trainer
    from compresskit.models import ModelSpec, checkpoint, tiny

    out = tmp_path / "m.pt"  # an older run's checkpoint (train replaces no other kind of file)
    checkpoint.save(out, tiny("mlp", in_shape=(1, 8, 8)), ModelSpec("mlp", {"hidden": [8]}))
    older = out.read_bytes()

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    # Ctrl-C before the first checkpoint (in the epoch's evaluation, which fit calls)
    monkeypatch.setattr(trainer, "evaluate_samples", interrupt)
    result = run("train", "--model", "mlp", "--epochs", "1", "--out", out, "-q", "--force")
    assert result.exit_code == 130
    assert "last good checkpoint" not in result.stderr
    assert out.read_bytes() == older


def test_json_has_no_nan():
    from compresskit.models.jsonable import finite as _finite  # what emit_json uses

    assert (
        json.dumps(_finite({"a": float("nan"), "b": [1.0, float("inf")]}))
        == '{"a": null, "b": [1.0, null]}'
    )


def test_decode_of_a_user_model_archive_needs_no_model_and_imports_nothing(run, tmp_path, usermod):
    ck = tmp_path / "u.pt"
    assert (
        run("train", "--model", "odd_models:Net", "--epochs", "1", "--out", ck, "-q").exit_code == 0
    )
    (tmp_path / "fast.toml").write_text(
        "[prune]\nrounds = 1\nretrain_epochs = 0\n[quantize]\nfinetune_epochs = 0\n"
        "[export]\nenabled = false\n"
    )
    result = run(
        "shrink",
        ck,
        "--model",
        "odd_models:Net",
        "--recipe",
        tmp_path / "fast.toml",
        "--out",
        tmp_path / "s",
        "-q",
    )
    assert result.exit_code == 0, result.stderr
    import sys

    marker = tmp_path / "imported"
    marker.unlink()
    sys.modules.pop("odd_models", None)
    dcz = tmp_path / "s" / "model.dcz"
    result = run("decode", dcz, "--out", tmp_path / "d.pt", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json()["rebuilt"] is False
    assert not marker.exists()  # the tensors were decoded; the user's code was not imported
    shrunk = checkpoint.load(tmp_path / "s" / "model.pt").state_dict
    decoded = checkpoint.load(tmp_path / "d.pt")
    assert decoded.spec.name == "odd_models:Net"
    assert decoded.state_dict.keys() == shrunk.keys()
    for k, v in shrunk.items():  # bit for bit
        assert torch.equal(
            decoded.state_dict[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)
        )
    with pytest.raises(InputError, match="pass --model odd_models:Net"):
        decoded.build_model()  # loading it is where consent is asked, as for any checkpoint
    for wrong in ("odd_models:Other", "lenet5"):  # another model than the archive's: refused
        result = run("decode", dcz, "--out", tmp_path / "w.pt", "--model", wrong)
        _one_line(result, 2, f"holds model odd_models:Net, not {wrong}")
        assert not (tmp_path / "w.pt").exists()
    result = run("decode", dcz, "--out", tmp_path / "e.pt", "--model", "odd_models:Net", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json()["rebuilt"] is True and marker.exists()


def test_trust_model_consents_to_the_code_a_checkpoint_names(run, tmp_path, usermod):
    ck = tmp_path / "u.pt"
    assert (
        run("train", "--model", "odd_models:Net", "--epochs", "1", "--out", ck, "-q").exit_code == 0
    )
    (tmp_path / "fast.toml").write_text(
        "[prune]\nrounds = 1\nretrain_epochs = 0\n[quantize]\nfinetune_epochs = 0\n"
        "[export]\nenabled = false\n"
    )
    args = ["shrink", ck, "--recipe", tmp_path / "fast.toml", "-q"]
    result = run(*args, "--out", tmp_path / "a")
    _one_line(result, 2, "pass --model odd_models:Net to allow importing it")
    result = run(*args, "--out", tmp_path / "b", "--trust-model")
    assert result.exit_code == 0, result.stderr
    # --dry-run takes the same consent (it ignored it: "pass --model ...", exit 2)
    _one_line(run(*args, "--dry-run"), 2, "pass --model odd_models:Net to allow importing it")
    result = run(*args, "--dry-run", "--trust-model")
    assert result.exit_code == 0, result.stderr
    assert "fc" in result.stdout  # the layer plan, read from the user's model
    bench = ["bench", ck, "--batch", "1", "--min-runs", "2", "--min-seconds", "0", "--json", "-q"]
    _one_line(run(*bench), 2, "pass --model odd_models:Net")
    result = run(*bench, "--trust-model")
    assert result.exit_code == 0, result.stderr
    assert {r["model"] for r in result.json()["results"]} == {"u.pt"}


def test_a_recipe_file_never_picks_the_students_code_on_its_own(run, tmp_path, usermod):
    """distill.student = "pkg.module:callable" in a recipe file imported and called that code
    (a crafted recipe ran "os:system" with its student_kwargs): now only with --student naming
    it too, or --trust-model, as for the code a checkpoint names."""
    import sys

    ck = tmp_path / "t.pt"
    assert run("train", "--model", "lenet300", "--epochs", "1", "--out", ck, "-q").exit_code == 0
    usermod.unlink(missing_ok=True)
    sys.modules.pop("odd_models", None)
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        '[distill]\nstudent = "odd_models:Net"\nepochs = 1\n[prune]\nenabled = false\n'
        "[quantize]\nenabled = false\n[huffman]\nenabled = false\n[export]\nenabled = false\n"
    )
    args = ["shrink", ck, "--recipe", recipe, "-q"]
    result = run(*args, "--out", tmp_path / "a")
    _one_line(result, 2, "distill.student = 'odd_models:Net' names code to import")
    assert "--student odd_models:Net" in result.stderr
    assert not usermod.exists() and not (tmp_path / "a").exists()  # nothing imported, no output
    assert run(*args, "--dry-run").exit_code == 0 and not usermod.exists()  # prints, imports not
    for consent in (["--student", "odd_models:Net"], ["--trust-model"]):
        usermod.unlink(missing_ok=True)
        sys.modules.pop("odd_models", None)
        result = run(*args, *consent, "--out", tmp_path / consent[0].strip("-"))
        assert result.exit_code == 0, result.stderr
        assert usermod.exists()  # imported with consent


def test_an_output_flag_naming_an_input_file_is_refused(run, tmp_path, npz_file):
    """decode --out the archive, bench --report or --plot the checkpoint, train --out its npz,
    --log-file an input: each replaced or truncated the file the command was about to read."""
    ck = tmp_path / "t.pt"
    assert run("train", "--model", "lenet300", "--epochs", "1", "--out", ck, "-q").exit_code == 0
    data = npz_file.read_bytes()
    before = ck.read_bytes()
    dcz = tmp_path / "a.dcz"
    dcz.write_bytes(b"an archive")  # refused before it is read
    cases = [
        ("decode", dcz, "--out", dcz),
        ("train", "--model", "lenet300", "--data", f"npz:{npz_file}", "--out", npz_file),
        ("bench", ck, "--report", ck),
        ("bench", ck, "--plot", ck),
        ("bench", ck, "--log-file", ck),
        ("bench", f"--log-file={ck}", ck),
    ]
    for args in cases:
        result = run(*args)
        assert result.exit_code == 2, (args, result.stderr)
        assert "on this command line (an input" in result.stderr, (args, result.stderr)
        assert ck.read_bytes() == before and npz_file.read_bytes() == data
        assert dcz.read_bytes() == b"an archive"
    # --resume reads and writes its own --out: one file, one flag, still fine
    result = run("train", "--model", "lenet300", "--epochs", "2", "--out", ck, "--resume", "-q")
    assert result.exit_code == 0, result.stderr


def test_a_checkpoint_of_zeros_is_one_line(run, tmp_path):
    """Every weight zero: k-means had no value to start from (ValueError, "unexpected")."""
    spec = ModelSpec("mlp", {"in_shape": [1, 8, 8], "num_classes": 10, "hidden": [16]})
    model = build(spec, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    checkpoint.save(tmp_path / "zeros.pt", model, spec)
    recipe = tmp_path / "r.toml"
    recipe.write_text("[prune]\nretrain_epochs = 0\n[quantize]\nfinetune_epochs = 0\n")
    result = run("shrink", tmp_path / "zeros.pt", "--recipe", recipe, "--out", tmp_path / "o", "-q")
    _one_line(result, 2, "every weight is zero, nothing to cluster")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("epoch", "x"),
        ("epoch", -5),
        ("rng", torch.zeros(3)),
        ("optimizer", {"param_groups": "x"}),
        ("config", "x"),
        ("history", 3),
        ("history", [1]),
    ],
)
def test_a_damaged_training_state_is_one_line_on_resume(run, tmp_path, field, value):
    """Each of these crashed --resume deep in the loop (TypeError, ZeroDivisionError,
    AttributeError: exit 1, "unexpected")."""
    ck = tmp_path / "t.pt"
    assert run("train", "--model", "lenet300", "--epochs", "1", "--out", ck, "-q").exit_code == 0
    obj = torch.load(ck, weights_only=True)
    obj["train_state"][field] = value
    torch.save(obj, ck)
    result = run("train", "--model", "lenet300", "--epochs", "2", "--out", ck, "--resume", "-q")
    _one_line(result, 2, "training state")


def test_weights_holding_nan_are_refused_before_any_work(run, tmp_path):
    spec = ModelSpec("mlp", {"in_shape": [1, 8, 8], "num_classes": 10, "hidden": [16]})
    model = build(spec, seed=0)
    with torch.no_grad():
        model.fc1.weight[0, 0] = float("nan")
    checkpoint.save(tmp_path / "nan.pt", model, spec)
    result = run("shrink", tmp_path / "nan.pt", "--out", tmp_path / "o", "-q")
    _one_line(result, 2, "fc1.weight hold NaN or inf")
    assert not (tmp_path / "o").exists()


def test_an_archive_given_as_a_checkpoint_points_to_decode(run, tmp_path):
    from compresskit.compressor import archive

    for name in ("model.dcz", "renamed.bin"):
        (tmp_path / name).write_bytes(archive.MAGIC + bytes(32))
        result = run("shrink", tmp_path / name, "--out", tmp_path / "o", "-q")
        _one_line(result, 2, "a compress archive (.dcz), not a checkpoint; rebuild one with")


def test_an_onnx_file_given_as_a_checkpoint_points_to_its_pt(run, tmp_path):
    # "not a torch.save file (wrong format)" left a user to guess that shrink wants the .pt.
    (tmp_path / "model.fp32.onnx").write_bytes(b"\x08\x08\x12\x07pytorch")
    result = run("shrink", tmp_path / "model.fp32.onnx", "--out", tmp_path / "o", "-q")
    _one_line(result, 2, "an ONNX Runtime model, not a checkpoint; pass the .pt it was exported")
    result = run("train", "--model", "lenet30", "--epochs", "1", "--out", tmp_path / "m.pt")
    _one_line(result, 2, "unknown model 'lenet30' (did you mean lenet300?)")


@pytest.mark.parametrize(
    "args, message",
    [
        # gloo's millisecond timeout: 1e11 s hung the job, 1e10 and nan failed it inside gloo
        (["--workers", "2", "--timeout", "1e11"], "--timeout 1e+11: give seconds from 1 to 1e+06"),
        (["--workers", "2", "--timeout", "nan"], "--timeout nan: give seconds from 1 to 1e+06"),
        # silently ignored before
        (["--staleness", "2"], "--staleness belongs to ps-ssp; drop it for --strategy allreduce"),
        (["--sync-warmup-epochs", "1"], "--sync-warmup-epochs belongs to ps-async; drop it"),
        (
            ["--strategy", "ps-sync", "--workers", "2", "--staleness", "2"],
            "--staleness belongs to ps-ssp; drop it for --strategy ps-sync",
        ),
        (["--grad-compression", "fp16"], "--grad-compression: one process sends no gradients"),
    ],
)
def test_train_flags_that_would_hang_or_be_ignored_are_refused(run, tmp_path, args, message):
    result = run("train", "--epochs", "1", "--out", tmp_path / "m.pt", *args)
    assert result.exit_code == 2, result.stderr
    assert message in result.stderr
    assert not (tmp_path / "m.pt").exists()


def test_workers_under_torchrun_must_agree_with_its_processes(run, tmp_path, monkeypatch):
    for var, value in dict(
        RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1"
    ).items():
        monkeypatch.setenv(var, value)
    result = run("train", "--workers", "4", "--scale-lr", "--out", tmp_path / "m.pt")
    assert result.exit_code == 2 and "under torchrun the processes are torchrun's (2" in (
        result.stderr
    )


def test_a_log_file_named_as_the_output_is_refused_before_it_is_created(run, tmp_path):
    result = run("train", "--out", tmp_path / "m.pt", "--log-file", tmp_path / "m.pt")
    assert result.exit_code == 2 and "also given elsewhere on this command line" in result.stderr
    assert not (tmp_path / "m.pt").exists()


def test_a_killed_ranks_partial_checkpoint_is_removed(tmp_path):
    from compresskit.distrib import job

    out = tmp_path / "m.pt"
    old = tmp_path / ".m.pt.old.tmp"
    old.write_bytes(b"an older run's")
    os.utime(old, (1, 1))
    since = os.path.getmtime(old) + 100
    fresh = tmp_path / ".m.pt.abc123.tmp"
    fresh.write_bytes(b"half a zip")
    other = tmp_path / ".n.pt.abc123.tmp"
    other.write_bytes(b"another output's")
    job._remove_partial_writes(out, since)
    assert not fresh.exists() and old.exists() and other.exists()


def test_parameter_server_flags_under_torchrun_are_left_to_its_own_check(monkeypatch):
    from compresskit.cli import train as train_cli

    for var, value in dict(
        RANK="0", WORLD_SIZE="4", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1"
    ).items():
        monkeypatch.setenv(var, value)
    # 2 workers + 2 servers are torchrun's 4 processes; a PS worker sends gradients too
    train_cli._check_flags("ps-sync", {"workers", "servers", "grad_compression"}, 2)
    with pytest.raises(InputError, match="under torchrun the processes are torchrun's"):
        train_cli._check_flags("allreduce", {"workers"}, 2)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.delenv("MASTER_ADDR")
    monkeypatch.delenv("MASTER_PORT")
    train_cli._check_flags("ps-sync", {"grad_compression"}, 1)  # 1 worker + 1 server


def test_a_log_file_is_any_path_but_the_default_output(run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ok = run("train", "--epochs", "1", "--data", "digits", "--log-file", "digits", "-q")
    assert ok.exit_code == 0, ok.stderr  # a word on the command line, not a file it names
    bad = run("train", "--model", "lenet300", "--log-file", "lenet300.pt")
    assert bad.exit_code == 2 and "lenet300.pt exists and is not a compress log" in bad.stderr


def test_a_log_file_holds_what_a_spawned_rank_says(run, tmp_path):
    """The data and per-epoch lines of a 2-process run come from rank 0's own process: they
    reached the terminal but not --log-file, which only the launching process wrote."""
    log = tmp_path / "train.log"
    result = run(
        "train", "--model", "lenet300", "--data", "digits", "--epochs", "2", "--workers", "2",
        "--out", tmp_path / "m.pt", "--log-file", log,
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    lines = log.read_text().splitlines()
    assert lines[0].startswith("debug: compress train --model lenet300")  # the parent's first
    assert any(line.startswith("data digits: 1294 train") for line in lines)
    assert [line.split()[:2] for line in lines if line.startswith("epoch ")] == [
        ["epoch", "1"],
        ["epoch", "2"],
    ]


def test_a_checkpoint_finds_its_npz_from_another_folder(run, npz_file, tmp_path, monkeypatch):
    """train recorded npz:blobs.npz as typed: shrink, --dry-run or --resume from another folder
    looked for ./blobs.npz there, and said "--data ... does not exist" to a user who gave none."""
    monkeypatch.chdir(tmp_path)
    trained = run("train", "--model", "lenet300", "--data", "npz:blobs.npz", "--epochs", "1", "-q")
    assert trained.exit_code == 0, trained.stderr
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    resumed = run("train", "--resume", "--epochs", "2", "--out", "../lenet300.pt", "-q")
    assert resumed.exit_code == 0, resumed.stderr
    plan = run("shrink", "../lenet300.pt", "--dry-run")
    assert plan.exit_code == 0, plan.stderr
    npz_file.rename(tmp_path / "moved.npz")
    gone = run("shrink", "../lenet300.pt", "--out", "s", "-q")
    _one_line(gone, 2, f"file {npz_file} does not exist (the data ../lenet300.pt records; pass")
    assert not (tmp_path / "elsewhere" / "s").exists()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[" * 50_000 + "]" * 50_000, "nested too deeply to read"),
        ('{"a": ' + "9" * 5000 + "}", "an integer of more than 4,300 digits"),
    ],
)
def test_json_a_parser_cannot_take_is_bad_input(run, tmp_path, text, message):
    """RecursionError and Python's integer-digit limit were exit 1, 'unexpected'."""
    kwargs = run("train", "--model", "lenet300", "--model-kwargs", text, "--out", tmp_path / "m.pt")
    _one_line(kwargs, 2, f"--model-kwargs: {message}")
    (tmp_path / "links.json").write_text(text)
    links = run("plan", "--links-from", tmp_path / "links.json", "--compute", "10ms")
    _one_line(links, 2, f"--links-from {tmp_path / 'links.json'}: {message}")


def test_train_replaces_a_checkpoint_but_no_other_file(run, tmp_path):
    """--out student/model.dcz replaced the archive with a checkpoint, exit 0."""
    from compresskit.compressor import archive

    dcz, text = tmp_path / "model.dcz", tmp_path / "notes.txt"
    dcz.write_bytes(archive.MAGIC + bytes(32))
    text.write_text("mine")
    result = run("train", "--model", "lenet300", "--epochs", "1", "-q", "--out", dcz)
    _one_line(result, 2, f"--out {dcz}: a .dcz file holds a compress archive")
    result = run("train", "--model", "lenet300", "--epochs", "1", "-q", "--out", text)
    _one_line(result, 2, f"--out {text} exists and is not a PyTorch checkpoint; a checkpoint")
    assert dcz.read_bytes() == archive.MAGIC + bytes(32) and text.read_text() == "mine"
    ck = tmp_path / "m.pt"
    for again in ((), ("--force",)):  # training again over its own checkpoint, when told
        result = run("train", "--model", "lenet300", "--epochs", "1", "-q", "--out", ck, *again)
        assert result.exit_code == 0, result.stderr
    for path in (dcz, text):  # --force replaces checkpoints only
        result = run("train", "--epochs", "1", "-q", "--out", path, "--force")
        assert result.exit_code == 2


def test_crafted_inputs_get_messages_that_say_what_is_wrong(run, tmp_path):
    """Each said something untrue or echoed a crafted value whole."""
    folder = tmp_path / "d"
    folder.mkdir()
    # "file d does not exist" for a folder
    _one_line(run("train", "--data", f"npz:{folder}"), 2, f"{folder} is a folder; give the .npz")
    # "note: d does not exist yet", exit 0
    _one_line(run("shrink", folder, "--dry-run"), 2, f"{folder}: a folder, not a checkpoint")
    # "the time must be positive" for 1e400 ms (infinite)
    result = run("plan", "--model", "mlp", "--compute", "1e400ms", "--bandwidth", "1GB/s")
    _one_line(result, 2, "must be positive and finite")
    # a 4,000-digit integer echoed whole
    (tmp_path / "r.toml").write_text(f"[train]\nseed = {'9' * 4000}\n")
    result = run("shrink", tmp_path / "m.pt", "--recipe", tmp_path / "r.toml", "--dry-run")
    _one_line(result, 2, "train.seed = 9999999999")
    assert "(4,000 characters) is impossible" in result.stderr and len(result.stderr) < 300


def test_compress_own_model_builders_need_no_consent(run, tmp_path, monkeypatch):
    # A checkpoint of the README's own zoo code (compresskit.models.hf:bert) was refused
    # without --model; only that module is exempt, never another callable of the package.
    from compresskit.models import zoo

    assert not zoo.ModelSpec("compresskit.models.hf:bert", {}).needs_consent
    for name in ("compresskit.cli.main:main", "compresskit.models.fileio:atomic_path", "a.b:C"):
        assert zoo.ModelSpec(name, {}).needs_consent
    assert not zoo.ModelSpec("lenet5", {}).needs_consent
    pytest.importorskip("transformers")
    out = tmp_path / "bert.pt"
    args = ("--data", "tokens:16:64", "--epochs", "1", "--out", out, "-q")
    assert run("train", "--model", "compresskit.models.hf:bert", *args).exit_code == 0
    result = run("train", "--data", "tokens:16:64", "--epochs", "2", "--out", out, "--resume", "-q")
    assert result.exit_code == 0, result.stderr


def test_train_keeps_an_earlier_checkpoint_unless_told(run, tmp_path):
    """A re-run of last week's command had trained afresh over the teacher, exit 0."""
    out = tmp_path / "teacher.pt"
    args = ("train", "--model", "lenet300", "--epochs", "1", "--out", out, "-q")
    assert run(*args).exit_code == 0
    before = out.read_bytes()
    _one_line(run(*args), 2, "holds an earlier training checkpoint; --resume continues it, --force")
    assert out.read_bytes() == before
    _one_line(run(*args, "--force", "--resume"), 2, "give one")
    assert run(*args, "--force", "--seed", "1").exit_code == 0
    assert out.read_bytes() != before  # trained afresh with another seed
    # an ensemble checks every member it would write
    (tmp_path / "teacher-1.pt").write_bytes(before)
    _one_line(
        run(*args, "--ensemble", "2"), 2, "teacher-1.pt: holds an earlier training checkpoint"
    )
    assert not (tmp_path / "teacher-0.pt").exists()  # refused before any training


def test_train_out_that_is_not_a_training_checkpoint_says_what_it_holds(run, tmp_path):
    """A text file was called 'an earlier checkpoint', and a state_dict sent the user in a
    circle: --resume said 'drop --resume', dropping it said 'use --resume'."""
    text, weights = tmp_path / "notes.txt", tmp_path / "sd.pt"
    text.write_text("hello")
    torch.save({"fc.weight": torch.zeros(2, 2)}, weights)
    args = ("train", "--epochs", "1", "-q", "--out")
    _one_line(run(*args, text), 2, "exists and is not a PyTorch checkpoint")
    _one_line(run(*args, text, "--force"), 2, "exists and is not a PyTorch checkpoint")
    # a bare state_dict is the user's (their weights, or data saved as a dict of tensors):
    # --force, which replaced any of them, never replaces it
    foreign = "holds tensors compress did not write"
    _one_line(run(*args, weights), 2, foreign)
    _one_line(run(*args, weights, "--resume"), 2, foreign + " (a state_dict or other data), with")
    _one_line(run(*args, weights, "--force"), 2, foreign)
    shrunk = tmp_path / "shrunk.pt"  # weights compress wrote, without training state
    checkpoint.save_state(shrunk, {"fc.weight": torch.zeros(2, 2)}, ModelSpec("mlp", {}))
    _one_line(run(*args, shrunk), 2, "holds weights without training state (nothing to resume)")
    _one_line(run(*args, shrunk, "--resume"), 2, "drop --resume and pass --force")
    assert run(*args, shrunk, "--force").exit_code == 0
    assert text.read_text() == "hello"


def test_train_refuses_what_would_go_wrong_silently(run, tmp_path, monkeypatch):
    from compresskit.distrib import launch

    # a folder-looking --out had written a file named like the folder
    _one_line(run("train", "--out", f"{tmp_path}/newdir/"), 2, "ends in a separator (a folder)")
    assert not (tmp_path / "newdir").exists()
    # a warm-up longer than the run: the learning rate never reached its peak, exit 0
    result = run(
        "train", "--epochs", "1", "--warmup-steps", "1000", "-q", "--out", tmp_path / "w.pt"
    )
    _one_line(result, 2, "the whole run is 41 steps (1 epoch(s) of 41)")
    # flags that did nothing, accepted without a word
    for args, message in [
        (["--bn-refresh", "10"], "model lenet300 has no BatchNorm layer"),
        (["--scale-lr"], "one changes nothing; give --workers 2 or more"),
        (
            ["--strategy", "ps-async", "--workers", "2", "--sync-warmup-epochs", "1"],
            "--sync-warmup-epochs 1 of --epochs 1: the whole run would be synchronous",
        ),
    ]:
        _one_line(
            run("train", "--epochs", "1", "-q", *args, "--out", tmp_path / "f.pt"), 2, message
        )
    # --workers 100000 spawned until the machine's load average reached 56
    monkeypatch.setattr(launch, "usable_cores", lambda: 2)
    result = run("train", "--workers", "9", "--out", tmp_path / "p.pt")
    _one_line(result, 2, "9 processes on this machine's 2 usable core(s): at most 8 run here")
    result = run("train", "--strategy", "ps-sync", "--workers", "6", "--servers", "3")
    _one_line(result, 2, "9 processes on this machine's 2 usable core(s)")


def test_a_killed_runs_temporary_checkpoint_is_removed_by_the_next_run(run, tmp_path):
    out = tmp_path / "k.pt"
    stale, live = tmp_path / ".k.pt.old1.tmp", tmp_path / ".k.pt.new1.tmp"
    for f in (stale, live):
        f.write_bytes(b"x" * 100)
    os.utime(stale, (1, 1))  # untouched for long: a run killed mid-write left it
    assert run("train", "--epochs", "1", "-q", "--out", out).exit_code == 0
    assert not stale.exists() and live.exists()  # a file being written now is left alone


def test_a_log_file_replaces_only_an_earlier_log(run, tmp_path):
    """`bench FOLDER --log-file FOLDER/model.int8.onnx` truncated the model it was about to
    read, then blamed the model; any existing file was truncated."""
    model = tmp_path / "model.int8.onnx"
    model.write_bytes(b"not a log")
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for path in (model, notes, tmp_path / "new.pt"):
        result = run("train", "--epochs", "1", "-q", "--out", tmp_path / "m.pt", "--log-file", path)
        assert result.exit_code == 2 and "--log-file" in result.stderr, result.stderr
    assert model.read_bytes() == b"not a log" and notes.read_text() == "mine"
    log = tmp_path / "train.log"
    for force in ((), ("--force",)):  # the second run replaces the first run's log
        args = ("train", "--epochs", "1", "-q", "--out", tmp_path / "m.pt", *force)
        assert run(*args, "--log-file", log).exit_code == 0
    assert log.read_text().startswith("debug: compress train")


class _FullDisk:
    """A log file on a disk that fills after `room` writes (ENOSPC, as a quota or tmpfs)."""

    def __init__(self, room: int) -> None:
        self.room, self.lines = room, []

    def write(self, text):
        if self.room <= 0:
            raise OSError(28, "No space left on device")
        self.room -= 1
        self.lines.append(text)

    def flush(self):
        if self.room <= 0:
            raise OSError(28, "No space left on device")

    def close(self):
        self.flush()


@pytest.mark.parametrize("room", [0, 3])
def test_a_log_file_on_a_full_disk_is_one_line_not_a_traceback(run, tmp_path, monkeypatch, room):
    """A 400 kB tmpfs: a 30-line traceback, exit 1 and no JSON on stdout. Full before the run
    starts: refused, exit 2. Full during it: one warning, the log stops, the command finishes."""
    from compresskit.cli import main

    real = main._Log.__init__
    disks = []

    def on_a_full_disk(self, path, stream, append=False):
        real(self, path, stream, append)
        self.file.close()
        self.file = _FullDisk(room)
        disks.append(self.file)

    monkeypatch.setattr(main._Log, "__init__", on_a_full_disk)
    log = tmp_path / "x.log"
    out = tmp_path / "m.pt"
    result = run("train", "--model", "mlp", "--epochs", "1", "--out", out, "--log-file", log,
                 "--json")  # fmt: skip
    assert "Traceback" not in result.stderr
    if room == 0:
        _one_line(result, 2, f"{log}: cannot write it (No space left on device)")
        assert result.json()["exit_code"] == 2 and not out.exists()
        return
    assert result.exit_code == 0, result.stderr
    warned = [line for line in result.stderr.splitlines() if "--log-file" in line]
    assert warned == [
        f"warning: --log-file {log}: cannot write it (No space left on device); the log stops "
        "here, the command goes on"
    ]
    assert result.json()["test_accuracy"] > 0 and out.exists()
    assert len(disks[0].lines) == 3 and disks[0].lines[0].startswith("debug: compress train")


@pytest.mark.parametrize(
    ("failure", "said"),
    [
        (OSError(28, "No space left on device", "/data/x.bin"),
         "error: no space left on device writing /data/x.bin; free space (or memory) and run "
         "it again"),
        (MemoryError(), "error: out of memory; free space (or memory) and run it again"),
        (OSError(2, "No such file or directory"),
         "error: FileNotFoundError: [Errno 2] No such file or directory (unexpected; "),
    ],
)  # fmt: skip
def test_the_machines_failures_are_said_as_such(run, monkeypatch, failure, said):
    """A full disk outside an output write (30 kB left) read "OSError: [Errno 28] No space
    left on device (unexpected; COMPRESS_DEBUG=1 shows the traceback)"."""
    import click

    from compresskit.cli.main import cli

    @click.command("fill")
    def fill():
        raise failure

    monkeypatch.setitem(cli.commands, "fill", fill)
    result = run("fill")
    assert result.exit_code == 1
    assert result.stderr.strip().startswith(said), result.stderr


def test_resume_with_no_checkpoint_yet_says_it_starts_afresh(run, tmp_path):
    """A requeued job runs the same `--resume` command from its first run on; a mistyped path
    trained from scratch without a word."""
    out = tmp_path / "m.pt"
    result = run("train", "--model", "mlp", "--epochs", "1", "--out", out, "--resume")
    assert result.exit_code == 0, result.stderr
    assert f"nothing to resume at {out} yet: training from the start" in result.stderr
    again = run("train", "--model", "mlp", "--epochs", "2", "--out", out, "--resume")
    assert again.exit_code == 0 and "nothing to resume" not in again.stderr


@pytest.mark.skipif(os.name != "posix", reason="POSIX file names are bytes")
def test_names_that_are_not_utf8_are_refused_before_any_work(run, tmp_path, teacher_pt):
    """A checkpoint named caf\\xe9.pt (Latin-1) was "truncated, corrupt" to shrink and bench,
    and a shrink --out of such a name failed in ONNX's checker after the whole run."""
    from compresskit.models import checkpoint

    odd = tmp_path / "caf\udce9.pt"  # the byte 0xE9 as Python holds it
    odd.write_bytes(teacher_pt.read_bytes())
    fix = "is not UTF-8: torch, ONNX and ONNX Runtime read file names as UTF-8; rename it"
    for args in (["shrink", odd, "--out", tmp_path / "o"], ["bench", odd],
                 ["shrink", teacher_pt, "--out", tmp_path / "out\udcff"]):  # fmt: skip
        _one_line(run(*args), 2, fix)
    with pytest.raises(InputError, match=fix):
        checkpoint.load(odd)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["caf\udce9.pt", "teacher.pt"])


def test_an_out_under_a_file_is_said_to_be_under_a_file(run, tmp_path, teacher_pt):
    (tmp_path / "afile").write_text("x")
    result = run("shrink", teacher_pt, "--out", tmp_path / "afile" / "out")
    _one_line(result, 2, f"{tmp_path / 'afile'} is a file, not a folder; give a folder path")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_json_result_stdout_cannot_take_is_one_line(tmp_path):
    """`--json > /dev/full`: two chained tracebacks after the training had finished."""
    import shutil
    import subprocess
    import sys

    exe = shutil.which("compress", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("needs the installed console script")
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [exe, "train", "--model", "mlp", "--epochs", "1", "--out", tmp_path / "m.pt",
             "--json", "-q"],
            stdout=full, stderr=subprocess.PIPE, text=True, timeout=300,
        )  # fmt: skip
    assert (tmp_path / "m.pt").is_file()
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: stdout: cannot write the JSON result (No space left on device); the "
        "command's files are written"
    ]


def test_long_legal_names_are_written(run, tmp_path, teacher_pt):
    """A 243-byte --out was refused as "folder is not writable (File name too long)": the
    hidden names compress makes beside it added up to 30 bytes."""
    out = tmp_path / ("L" * 240 + ".pt")
    result = run("train", "--model", "mlp", "--epochs", "1", "--out", out, "-q")
    assert result.exit_code == 0, result.stderr
    assert out.is_file()
    recipe = tmp_path / "fast.toml"
    recipe.write_text("[prune]\nrounds = 1\nretrain_epochs = 0\n[quantize]\nfinetune_epochs = 0\n"
                      "[export]\nenabled = false\n")  # fmt: skip
    folder = tmp_path / ("M" * 250)
    result = run("shrink", teacher_pt, "--recipe", recipe, "--out", folder, "-q")
    assert result.exit_code == 0, result.stderr
    assert (folder / "model.dcz").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [out.name, folder.name, "fast.toml", "teacher.pt"]
    )


@pytest.mark.parametrize("command", ["shrink", "train", "decode"])
def test_an_empty_out_is_refused_not_the_working_folder(run, command, tmp_path, monkeypatch):
    # Path("") is ".": shrink --out "" had filled the working folder with its outputs
    monkeypatch.chdir(tmp_path)
    first = {"shrink": ["m.pt"], "train": [], "decode": ["m.dcz"]}[command]
    result = run(command, *first, "--out", "")
    assert result.exit_code == 2 and "an empty path" in result.stderr
    assert list(tmp_path.iterdir()) == []
