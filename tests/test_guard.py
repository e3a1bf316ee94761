"""Guardrails and honest outputs (`compressor.guard`, `compress shrink --strict/--force`), and
the CLI's friction points: shortcut flags, decode, completion, a log file, calling from Python."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compresskit.compressor import guard, recipe
from compresskit.models.errors import InputError


def _report(base=0.95, stages=(0.94, 0.94, 0.94), **extra):
    return {
        "baseline": {"test_accuracy": base, "bytes": 4000},
        "stages": [
            {"name": n, "test_accuracy": a}
            for n, a in zip(("prune", "quantize", "huffman"), stages, strict=True)
        ],
        **extra,
    }


def test_each_stage_is_judged_against_the_model_it_was_given():
    cfg = guard.GuardConfig(max_stage_drop=2.0)
    assert guard.findings(_report(), cfg) == []
    # three stages of 1.5 points each: none over the limit on its own
    assert guard.findings(_report(stages=(0.935, 0.92, 0.905)), cfg) == []
    found = guard.findings(_report(stages=(0.90, 0.899, 0.899)), cfg)
    assert [(f["stage"], round(f["drop_points"], 6)) for f in found] == [("prune", 5.0)]
    assert "pruning cost 5.00 points" in found[0]["message"]
    assert "guard.max_stage_drop 2" in found[0]["message"]
    # a later stage that loses on top of an earlier loss is judged on its own loss
    found = guard.findings(_report(stages=(0.94, 0.90, 0.90)), cfg)
    assert [f["stage"] for f in found] == ["quantize"]


def test_distillation_and_channels_are_stages_too():
    cfg = guard.GuardConfig(max_stage_drop=2.0)
    rep = _report(
        base=0.91,
        stages=(0.91, 0.91, 0.91),
        teacher={"name": "vgg", "parameters": 1000, "test_accuracy": 0.99},
        student={
            "name": "lenet5",
            "parameters": 100,
            "distilled": True,
            "dense_test_accuracy": 0.95,
        },
        channels={"test_accuracy": [0.95, 0.91]},
    )
    assert [f["stage"] for f in guard.findings(rep, cfg)] == ["distill", "channels"]


def test_a_student_bigger_than_its_teacher_is_said():
    rep = _report(
        teacher={"name": "mlp", "parameters": 1_000, "test_accuracy": 0.95},
        student={
            "name": "vgg",
            "parameters": 8_600,
            "distilled": True,
            "dense_test_accuracy": 0.95,
        },
    )
    (f,) = guard.findings(rep, guard.GuardConfig())
    assert f["kind"] == "student_size" and "8.6x its teacher mlp" in f["message"]


def test_int8_under_its_floor_on_the_test_set_is_said():
    int8 = {
        "top1_agreement_fp32": 0.9917,
        "min_agreement": 0.995,
        "checked_on": {"split": "validation", "samples": 143},
    }
    (f,) = guard.findings(_report(onnx={"int8": int8}), guard.GuardConfig())
    assert f["kind"] == "int8_floor"
    assert (
        "99.17%" in f["message"] and "99.50%" in f["message"] and "143 validation" in f["message"]
    )
    held = {**int8, "top1_agreement_fp32": 0.996}
    assert guard.findings(_report(onnx={"int8": held}), guard.GuardConfig()) == []
    # more calibration is advised only where more samples were there to take
    recipe = {"export": {"calibration": 512}}
    for samples, fix in ((512, "raise export.calibration or min_agreement"), (143, "raise min")):
        took = {**int8, "calibration": {"source": "training set", "samples": samples}}
        (f,) = guard.findings(_report(onnx={"int8": took}, recipe=recipe), guard.GuardConfig())
        assert f"samples: {fix}" in f["message"]
    missing = {"int8_not_written": {"reason": "only FP32 held the floor"}}
    (f,) = guard.findings(_report(**missing), guard.GuardConfig())
    assert "no INT8 file written: only FP32 held the floor" in f["message"]


@pytest.mark.parametrize(
    ("guard_table", "message"),
    [
        ({"max_stage_drop": -1}, "guard.max_stage_drop = -1 is impossible"),
        ({"max_stage_drop": "2"}, "guard.max_stage_drop = '2' is impossible"),
        ({"strict": "yes"}, "guard.strict = 'yes' is impossible"),
        ({"limit": 2}, "unknown key guard.limit"),
    ],
)
def test_bad_guard_settings_are_refused(guard_table, message):
    with pytest.raises(InputError, match=message):
        recipe.resolve({"guard": guard_table})


# --- through the CLI, on a trained checkpoint --------------------------------------------------

FAST = "[prune]\nrounds = 1\nretrain_epochs = 1\n[quantize]\nfinetune_epochs = 1\n"


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    from click.testing import CliRunner

    from compresskit.cli.main import cli

    folder = tmp_path_factory.mktemp("guard")
    ck = folder / "mlp.pt"
    args = ["train", "--model", "mlp", "--data", "digits", "--epochs", "3", "--out", str(ck), "-q"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.stderr
    (folder / "fast.toml").write_text(FAST)
    return folder, ck


def test_a_stage_over_the_limit_is_loud_and_strict_writes_nothing(run, teacher, tmp_path):
    _folder, ck = teacher
    lossy = tmp_path / "lossy.toml"  # pruning 99.5% of every layer, no retraining: it must lose
    lossy.write_text(
        "[prune]\nsparsity = 0.995\nrounds = 1\nretrain_epochs = 0\n"
        "[quantize]\nfinetune_epochs = 0\n[export]\nenabled = false\n"
    )
    out = tmp_path / "o"
    result = run("shrink", ck, "--recipe", lossy, "--out", out, "--json", "-q")
    assert result.exit_code == 0, result.stderr
    r = result.json()
    stages = [f["stage"] for f in r["guard"]["findings"] if f["kind"] == "stage_drop"]
    assert stages and stages[0] == "prune"
    assert "warning: pruning cost" in result.stderr and "guard.max_stage_drop 2" in result.stderr
    assert (out / "model.dcz").is_file()

    strict = tmp_path / "s"
    result = run("shrink", ck, "--recipe", lossy, "--out", strict, "--strict", "-q")
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and "--strict: nothing written" in result.stderr
    # ...but the work is kept for a rerun with another guard setting and --resume
    assert "; kept: Deep Compression (pruning, weight sharing, Huffman)" in result.stderr
    assert not strict.exists()
    hidden = [p.name for p in tmp_path.iterdir() if p.name.startswith(".s")]
    assert hidden == [".s.resume"]  # no staging folder left
    # the limit is the recipe's to set: a generous one lets the same run through
    (tmp_path / "generous.toml").write_text(lossy.read_text() + "[guard]\nmax_stage_drop = 100\n")
    result = run(
        "shrink", ck, "--recipe", tmp_path / "generous.toml", "--out", strict, "--strict",
        "--resume", "--json", "-q"
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    # [guard] is not what the compressed model depended on: nothing retrained
    assert result.json()["resumed"]["from"].startswith("Deep Compression")


def test_outputs_are_named_for_what_they_hold_and_the_summary_names_each_deliverable(
    run, teacher, tmp_path
):
    folder, ck = teacher
    out = tmp_path / "m"
    result = run("shrink", ck, "--recipe", folder / "fast.toml", "--out", out)
    assert result.exit_code == 0, result.stderr
    names = {p.name for p in out.iterdir()}
    assert {
        "model.pt",
        "model.dcz",
        "model.fp32.onnx",
        "model.int8.onnx",
        "model.int8.ort",
    } <= names
    assert not [n for n in names if n.startswith("student.")]
    first = result.stdout.splitlines()[0]
    assert first.startswith("deliverables") and "dense FP32 weights" in first
    for name in ("model.dcz", "model.fp32.onnx", "model.int8.onnx", "model.int8.ort"):
        assert name in result.stdout
    report = json.loads((out / "report.json").read_text())
    d = report["deliverables"]
    assert d["ship"].endswith("model.int8.onnx") and d["ship_mobile"].endswith("model.int8.ort")
    for f in d["files"]:
        assert f["bytes"] == os.path.getsize(out / f["path"])  # names in the folder
        assert f["ratio"] == pytest.approx(report["baseline"]["bytes"] / f["bytes"])

    student = tmp_path / "st"
    result = run(
        "shrink", ck, "--recipe", folder / "fast.toml", "--out", student, "--student", "mlp",
        "--student-kwargs", '{"hidden": [16]}', "--json", "-q",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    names = {p.name for p in student.iterdir()}
    assert {"student.pt", "student.dcz", "student.int8.onnx"} <= names
    assert not [n for n in names if n.startswith("model.")]
    assert result.json()["name"] == "student"


def test_an_existing_out_is_refused_without_force(run, teacher, tmp_path):
    _folder, ck = teacher
    recipe_path = tmp_path / "dense.toml"
    recipe_path.write_text(
        "[prune]\nenabled = false\n[quantize]\nenabled = false\n[huffman]\nenabled = false\n"
        "[export]\nenabled = false\n"
    )
    out = tmp_path / "o"
    assert run("shrink", ck, "--recipe", recipe_path, "--out", out, "-q").exit_code == 0
    before = (out / "model.pt").read_bytes()
    result = run("shrink", ck, "--recipe", recipe_path, "--out", out, "-q")
    assert result.exit_code == 2
    assert "already holds an earlier run's outputs" in result.stderr and "--force" in result.stderr
    assert (out / "model.pt").read_bytes() == before
    result = run("shrink", ck, "--recipe", recipe_path, "--out", out, "--force", "-q")
    assert result.exit_code == 0, result.stderr
    # the user's own checkpoint saved as model.pt in --out: never replaced, even with --force
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "model.pt").write_bytes(Path(ck).read_bytes())
    for force in ([], ["--force"]):
        result = run("shrink", mine / "model.pt", "--recipe", recipe_path, "--out", mine, *force)
        assert result.exit_code == 2
        assert "model.pt there is this run's input" in result.stderr, result.stderr
        assert (mine / "model.pt").read_bytes() == Path(ck).read_bytes()
        assert sorted(p.name for p in mine.iterdir()) == ["model.pt"]
    # nor a teacher kept there (--force removed the outputs a run does not write again)
    result = run(
        "shrink", ck, "--student", "lenet5", "--teacher", mine / "model.pt", "--out", mine,
        "--force", "-q",
    )  # fmt: skip
    assert result.exit_code == 2 and "model.pt there is this run's input" in result.stderr
    assert (mine / "model.pt").read_bytes() == Path(ck).read_bytes()
    # an empty folder the user made is no earlier run
    (tmp_path / "empty").mkdir()
    result = run("shrink", ck, "--recipe", recipe_path, "--out", tmp_path / "empty", "-q")
    assert result.exit_code == 0, result.stderr
    # A folder of the user's files that only share names with outputs (a training
    # checkpoint student.pt, notes in report.md): named as such, and with --force only what
    # this run writes is replaced. --force had deleted student.pt, which no run here writes.
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "student.pt").write_bytes(Path(ck).read_bytes())
    (theirs / "report.md").write_text("my notes\n")
    result = run("shrink", ck, "--recipe", recipe_path, "--out", theirs, "-q")
    assert result.exit_code == 2
    assert "outputs that no earlier run there lists (student.pt, report.md)" in result.stderr
    result = run("shrink", ck, "--recipe", recipe_path, "--out", theirs, "--force", "-q")
    assert result.exit_code == 0, result.stderr
    assert (theirs / "student.pt").read_bytes() == Path(ck).read_bytes()
    assert (theirs / "model.pt").is_file() and (theirs / "report.md").read_text() != "my notes\n"
    # beside that earlier run's outputs, the refusal names the user's file, not the run's
    result = run("shrink", ck, "--recipe", recipe_path, "--out", theirs, "-q")
    assert result.exit_code == 2 and "no earlier run there lists (student.pt)" in result.stderr


def test_a_signal_while_outputs_replace_an_earlier_runs_waits_until_the_folder_is_whole(
    tmp_path, monkeypatch
):
    import os
    import signal

    from compresskit.compressor import pipeline

    out, tmp = tmp_path / "out", tmp_path / "tmp"
    out.mkdir()
    tmp.mkdir()
    names = ["model.dcz", "model.pt", "model.fp32.onnx", "model.int8.onnx", "report.json"]
    for name in names:
        (out / name).write_text("old")
        (tmp / name).write_text("new")
    (out / "report.json").write_text('{"files": ["model.dcz", "model.int8.ort"]}')
    (out / "model.int8.ort").write_text("old")  # the earlier run's, not written again
    real, calls = os.replace, []

    def replace(a, b):  # a real Ctrl-C arrives after the second rename
        real(a, b)
        calls.append(a)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(pipeline.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):  # delivered, once the folder is whole
        pipeline._move_into(tmp, out)
    assert len(calls) == len(names)
    assert all((out / n).read_text() == "new" for n in names)
    assert not (out / "model.int8.ort").exists()


def test_shortcut_flags_override_the_recipe_and_dry_run_prints_the_layer_plan(run, teacher):
    folder, ck = teacher
    result = run(
        "shrink", ck, "--recipe", folder / "fast.toml", "--sparsity", "0.8", "--bits", "8,4",
        "--epochs", "2", "--dry-run",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    import tomllib

    r = tomllib.loads(result.stdout)  # the plan is TOML comments: the output is still a recipe
    assert r["prune"]["sparsity"] == 0.8 and r["prune"]["rounds"] == 1
    assert (r["quantize"]["conv_bits"], r["quantize"]["fc_bits"]) == (8, 4)
    assert r["prune"]["retrain_epochs"] == r["quantize"]["finetune_epochs"] == 2
    assert r["distill"]["epochs"] == 2
    header, *plan = [line for line in result.stdout.splitlines() if line.startswith("#   ")]
    assert header.split()[1:] == ["layer", "kind", "weights", "bits", "sparsity"]
    assert [line.split()[1] for line in plan] == ["fc1", "fc2"]  # mlp: one hidden layer, a head
    assert all(line.split()[-2:] == ["4", "0.8"] for line in plan)
    result = run("shrink", ck, "--sparsity", "auto", "--bits", "6", "--dry-run", "--json")
    assert result.exit_code == 0, result.stderr
    j = result.json()
    assert [p["sparsity"] for p in j["plan"]] == ["auto (sensitivity)"] * 2
    assert [p["bits"] for p in j["plan"]] == [6, 6]
    assert sum(p["weights"] for p in j["plan"]) > 0


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--sparsity", "lots", "--sparsity"),
        ("--sparsity", "1.5", "prune.sparsity = 1.5 is impossible"),
        ("--bits", "8,5,4", "--bits"),
        ("--bits", "0", "conv_bits = 0 is impossible"),
    ],
)
def test_bad_shortcut_flags_are_one_line(run, flag, value, message):
    result = run("shrink", "nothing.pt", flag, value, "--dry-run")
    assert result.exit_code == 2
    assert message in result.stderr and result.stderr.count("\n") == 1


def test_log_file_keeps_what_stderr_showed(run, teacher, tmp_path):
    folder, ck = teacher
    log = tmp_path / "run.log"
    out = tmp_path / "o"
    result = run(
        "shrink", ck, "--recipe", folder / "fast.toml", "--out", out, "--log-file", log,
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    text = log.read_text()
    assert text.startswith("debug: compress shrink")
    assert "baseline:" in text and "prune round 1/1" in text  # the progress lines stderr showed
    assert "\x1b[" not in text
    # a failure's one line on stderr, and its traceback in the log
    result = run("shrink", tmp_path / "missing.pt", "--out", tmp_path / "x", "--log-file", log)
    assert result.exit_code == 2
    text = log.read_text()
    assert "error: " in text and "Traceback" in text


def test_main_from_python_returns_or_raises_instead_of_exiting(tmp_path):
    from compresskit.cli.main import main

    assert main(["shrink", "nothing.pt", "--dry-run"], standalone_mode=False) == 0
    with pytest.raises(InputError, match="no such checkpoint"):
        main(["shrink", str(tmp_path / "nothing.pt"), "--out", str(tmp_path / "o")], False)


def test_shell_completion_script_and_answers():
    env = {**os.environ, "_COMPRESS_COMPLETE": "bash_source"}
    script = subprocess.run(
        [sys.executable, "-m", "compresskit.cli"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert script.returncode == 0, script.stderr
    assert "_compress_completion" in script.stdout and "complete " in script.stdout
    env = {**os.environ, "_COMPRESS_COMPLETE": "bash_complete", "COMP_WORDS": "compress sh",
           "COMP_CWORD": "1"}  # fmt: skip
    answer = subprocess.run(
        [sys.executable, "-m", "compresskit.cli"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert answer.returncode == 0, answer.stderr
    assert "plain,shrink" in answer.stdout.split()


def test_sparsity_auto_says_what_it_proposed(run, teacher, tmp_path):
    """The proposal was only in report.json; a run that pruned nothing said nothing."""
    folder, ck = teacher
    args = ["shrink", ck, "--recipe", folder / "fast.toml", "--sparsity", "auto"]
    result = run(*args, "--out", tmp_path / "a", "-q")
    assert result.exit_code == 0, result.stderr
    assert "--sparsity auto (sensitivity analysis, prune.budget 0.02" in result.stdout
    report = json.loads((tmp_path / "a" / "report.json").read_text())
    proposal = report["sensitivity"]["proposal"]
    md = (tmp_path / "a" / "report.md").read_text()
    assert all(f"| {n} | {s:.2f} |" in md for n, s in proposal.items())
    # a budget no cut fits: nothing pruned, and the note says what to change
    from compresskit.compressor import report as report_mod

    none = {
        **report,
        "sensitivity": {**report["sensitivity"], "proposal": dict.fromkeys(proposal, 0.0)},
    }
    assert report_mod.sensitivity_note(none).endswith(
        f"no layer of {len(proposal)} could lose even the grid's smallest cut within the "
        "budget, so nothing is pruned; raise prune.budget, or give --sparsity"
    )
    assert report_mod.sensitivity_note({**report, "sensitivity": None}) == ""


def test_a_stage_over_the_limit_is_said_before_export_and_strict_stops_there(
    run, teacher, tmp_path, monkeypatch
):
    """A ResNet-50 whose pruning cost 26 points went on through a 58 s INT8 search before the
    warning came; --strict threw the same work away only at the end."""
    from compresskit.compressor import export

    _folder, ck = teacher
    lossy = tmp_path / "lossy.toml"
    lossy.write_text(
        "[prune]\nsparsity = 0.995\nrounds = 1\nretrain_epochs = 0\n"
        "[quantize]\nfinetune_epochs = 0\n[export]\nint8 = false\nort = false\n"
    )
    result = run("shrink", ck, "--recipe", lossy, "--out", tmp_path / "o")
    assert result.exit_code == 0, result.stderr
    said = result.stderr.splitlines()
    early = next(i for i, s in enumerate(said) if s.startswith("guard: pruning cost"))
    assert said[early].endswith("(found before export; the run goes on)")
    assert early < next(i for i, s in enumerate(said) if s.startswith("export: FP32 ONNX"))

    def never(*args, **kwargs):
        raise AssertionError("exported after a strict guardrail")

    monkeypatch.setattr(export, "export_onnx", never)
    strict = run("shrink", ck, "--recipe", lossy, "--out", tmp_path / "s", "--strict", "-q")
    assert strict.exit_code == 1 and "--strict: nothing written" in strict.stderr


def test_the_plan_names_what_is_stored_dense():
    """A BERT's embedding tables (38% of its weights) were missing from --dry-run's plan, and
    the default's 5.7x came as a surprise after the run."""
    from pathlib import Path

    import torch

    from compresskit.cli import render
    from compresskit.compressor import recipe, shrink
    from compresskit.models import ModelSpec, build

    model = build(ModelSpec("textcls", {"vocab_size": 500, "in_shape": [16], "num_classes": 4}))
    ids = torch.randint(1, 500, (2, 16))
    rows = shrink.plan(model, recipe.resolve({}, source="r"), ids)
    dense = {r["layer"]: r for r in rows if r["kind"] == "dense"}
    table = next(n for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding))
    assert dense[table]["weights"] == model.get_submodule(table).weight.numel()
    assert dense[table]["sparsity"] == (
        "stored dense (float16): an Embedding; prune.embeddings / quantize.embeddings = true "
        "include it"
    )
    # the model's own positional table, an nn.Parameter no layer holds
    assert dense["(model)"]["sparsity"] == (
        "stored dense (float16): a bare nn.Parameter of TextClassifier, not a layer compress prunes"
    )
    total = sum(r["weights"] for r in rows)
    kept = sum(r["weights"] for r in dense.values())
    said = render.plan_comment(Path("m.pt"), rows).splitlines()[-1]
    assert said == (
        f"# stored dense: {kept:,} of these {total:,} weights ({kept / total:.0%}), which "
        "bounds the archive's ratio"
    )
    # with embeddings in, the table is a layer like the others
    rows = shrink.plan(model, recipe.resolve({"prune": {"embeddings": True}}, source="r"), ids)
    assert [r["layer"] for r in rows if r["kind"] == "dense"] == ["(model)"]


def test_a_student_bigger_than_its_teacher_is_said_before_distillation(run, teacher, tmp_path):
    # the size is known before training: a --strict run stopped only after every stage
    folder, ck = teacher
    args = ["shrink", ck, "--recipe", folder / "fast.toml", "--student", "lenet5", "--epochs", "1"]
    strict = run(*args, "--strict", "--out", tmp_path / "s")
    assert strict.exit_code == 1 and not (tmp_path / "s").exists()
    assert "guardrail: the student lenet5 has" in strict.stderr
    assert "epoch" not in strict.stderr  # nothing trained
    said = run(*args, "--out", tmp_path / "o")
    assert said.exit_code == 0, said.stderr
    first = said.stderr.index("(found before distillation; the run goes on)")
    assert first < said.stderr.index("epoch")
    # an ensemble too, summed from its checkpoints (it was said only after every stage)
    other = tmp_path / "second.pt"  # another teacher file (the checkpoint itself is refused)
    other.write_bytes(Path(ck).read_bytes())
    ensemble = run(*args, "--teacher", other, "--strict", "--out", tmp_path / "e")
    assert ensemble.exit_code == 1 and not (tmp_path / "e").exists()
    assert "13.6x its teacher ensemble (mlp + 1 more) (9,620)" in ensemble.stderr
    assert "epoch" not in ensemble.stderr


def test_a_ctrl_c_while_a_rerun_lands_leaves_its_folder_whole_and_no_kept_work(
    teacher, tmp_path, monkeypatch
):
    # Held until the renames were done, the signal still came before the kept work was
    # removed: the run offered a --resume that the whole folder then refused.
    import os
    import signal

    import compresskit as ck_api
    from compresskit.compressor import pipeline, resume

    _folder, ck = teacher
    recipe = ck_api.Recipe.from_dict(
        {"prune": {"rounds": 1, "retrain_epochs": 1}, "quantize": {"finetune_epochs": 1},
         "export": {"enabled": False}}
    )  # fmt: skip
    out = tmp_path / "o"
    ck_api.shrink(ck, "digits", recipe, out=out)
    real = pipeline._move_into

    def move_then_ctrl_c(tmp, folder):
        real(tmp, folder)
        os.kill(os.getpid(), signal.SIGINT)  # as a Ctrl-C between the renames and the marks

    monkeypatch.setattr(pipeline, "_move_into", move_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        ck_api.shrink(ck, "digits", recipe, out=out, force=True)
    assert not resume.folder_for(out).exists()  # nothing offered to resume
    assert json.loads((out / "report.json").read_text())["files"] == sorted(
        p.name for p in out.iterdir() if p.name in pipeline.OUTPUTS
    )
