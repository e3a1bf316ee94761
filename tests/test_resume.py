"""`compress shrink --resume`: a stopped run continues from the work it kept (each pruning
round, the compressed model) and writes what an uninterrupted run writes (compressor.resume)."""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

import compresskit as ck
from compresskit import api
from compresskit.compressor import (
    BudgetSection,
    ChannelsSection,
    DistillSection,
    ExportSection,
    PruneSection,
    QuantizeSection,
    pipeline,
    resume,
)
from compresskit.distrib import Events
from compresskit.models.errors import InputError, StageError

RECIPE = ck.Recipe(
    prune=PruneSection(sparsity=0.6, rounds=3, retrain_epochs=1),
    quantize=QuantizeSection(finetune_epochs=1),
    export=ExportSection(ort=False),  # the .ort is not what these tests look at
)
# Bytes that name the run's folder, the time or the machine's load: not the work's.
VOLATILE = ("timings", "memory", "environment", "resumed", "files", "seconds")


@pytest.fixture(scope="module")
def net(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("resume")
    ck.train("lenet300", "digits", ck.TrainConfig(epochs=1), out=folder / "net.pt")
    return folder / "net.pt"


@pytest.fixture(scope="module")
def uninterrupted(net) -> Path:
    out = net.parent / "whole"
    ck.shrink(net, "digits", RECIPE, out=out)
    assert not resume.folder_for(out).exists()  # a run that succeeded keeps no marks
    return out


@pytest.fixture(scope="module")
def stopped(net) -> Path:
    """The --out of a run stopped in its third pruning round: rounds 1 and 2 kept."""
    out = net.parent / "stopped"
    with pytest.MonkeyPatch.context() as monkeypatch:
        _stop_at_retrain(monkeypatch, 3)
        with pytest.raises(KeyboardInterrupt):
            ck.shrink(net, "digits", RECIPE, out=out)
    return out


class Said(Events):
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, message: str) -> None:
        self.lines.append(message)


def _stop_at_retrain(monkeypatch, call: int) -> None:
    """Ctrl-C at the start of the `call`-th retraining run (1: the first pruning round's)."""
    made = api._hooks

    def hooks(*args, **kwargs):
        h = made(*args, **kwargs)
        calls = [0]

        def retrain(*a, **k):
            calls[0] += 1
            if calls[0] == call:
                raise KeyboardInterrupt
            return h.retrain(*a, **k)

        return dataclasses.replace(h, retrain=retrain)

    monkeypatch.setattr(api, "_hooks", hooks)


def _mark_file(out: Path, kind: str) -> Path:
    folder = resume.folder_for(out)
    index = json.loads((folder / resume.INDEX).read_text(encoding="utf-8"))
    return folder / index["marks"][kind]["file"]


def _work(report: dict) -> dict:
    """The report without what depends on the folder, the clock or the machine."""
    report = {k: v for k, v in report.items() if k not in VOLATILE}
    report["stages"] = [{k: v for k, v in s.items() if k != "seconds"} for s in report["stages"]]
    return json.loads(json.dumps(report).replace("/whole/", "/OUT/").replace("/again/", "/OUT/"))


def _same_outputs(a: Path, b: Path) -> None:
    for name in ("model.dcz", "model.fp32.onnx", "model.int8.onnx"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    sa = torch.load(a / "model.pt", weights_only=True)["state_dict"]
    sb = torch.load(b / "model.pt", weights_only=True)["state_dict"]
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    ra = json.loads((a / "report.json").read_text(encoding="utf-8"))
    rb = json.loads((b / "report.json").read_text(encoding="utf-8"))
    assert _work(ra) == _work(rb)


def test_a_run_stopped_in_its_last_pruning_round_resumes_to_the_same_bytes(
    net, uninterrupted, monkeypatch
):
    out = net.parent / "again"
    _stop_at_retrain(monkeypatch, 3)  # rounds 1 and 2 are done
    with pytest.raises(KeyboardInterrupt):
        ck.shrink(net, "digits", RECIPE, out=out)
    assert not out.exists()
    assert resume.describe(out) == "prune round 2 of 3"
    monkeypatch.undo()

    said = Said()
    report = ck.shrink(net, "digits", RECIPE, out=out, resume=True, progress=said).report
    assert report["resumed"]["from"] == "prune round 2 of 3"
    assert "This run resumed after prune round 2 of 3" in (out / "report.md").read_text("utf-8")
    assert any(line.startswith("resumed after prune round 2/3") for line in said.lines)
    assert not any(line.startswith("prune round 1/") for line in said.lines)  # not redone
    assert any(line.startswith("prune round 3/3") for line in said.lines)
    _same_outputs(uninterrupted, out)
    assert not resume.folder_for(out).exists()


def _failing_export(*args, **kwargs):
    raise StageError("export: the exporter failed")


def test_a_failed_export_resumes_from_the_compressed_model_with_a_new_export_section(
    net, uninterrupted, monkeypatch
):
    out = net.parent / "export-failed"
    monkeypatch.setattr(pipeline, "_export", _failing_export)
    with pytest.raises(StageError):
        ck.shrink(net, "digits", RECIPE, out=out)
    monkeypatch.undo()
    kept = json.loads((resume.folder_for(out) / resume.INDEX).read_text(encoding="utf-8"))
    assert set(kept["marks"]) == {"prune", "compressed"}

    # The usual fix after a failed export: another export setting. Nothing retrains.
    fixed = dataclasses.replace(RECIPE, export=ExportSection(opset=17))
    report = ck.shrink(net, "digits", fixed, out=out, resume=True).report
    assert report["resumed"]["from"].startswith("Deep Compression")
    assert report["timings"]["training"] == 0.0
    assert (
        report["training"] == json.loads((uninterrupted / "report.json").read_bytes())["training"]
    )
    assert (out / "model.dcz").read_bytes() == (uninterrupted / "model.dcz").read_bytes()
    assert report["onnx"]["fp32"]["opsets"]["ai.onnx"] == 17
    assert report["recipe"] == fixed.to_dict()  # the recipe this run ran, not the stopped one's
    assert not resume.folder_for(out).exists()


def test_a_changed_quantize_section_resumes_from_the_last_pruning_round(net, monkeypatch):
    out = net.parent / "requantized"
    monkeypatch.setattr(pipeline, "_export", lambda *a, **k: (_ for _ in ()).throw(KeyError))
    with pytest.raises(KeyError):
        ck.shrink(net, "digits", RECIPE, out=out)
    monkeypatch.undo()
    other = dataclasses.replace(RECIPE, quantize=QuantizeSection(finetune_epochs=1, fc_bits=4))
    said = Said()
    report = ck.shrink(net, "digits", other, out=out, resume=True, progress=said).report
    assert report["resumed"]["from"] == "prune round 3 of 3"
    assert not any(line.startswith("prune round") for line in said.lines)
    assert {layer["weight_bits"] for layer in report["layers"]} == {4}


def test_other_data_starts_from_the_beginning_and_replaces_the_kept_work(net, monkeypatch):
    out = net.parent / "fresh"
    _stop_at_retrain(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        ck.shrink(net, "digits", RECIPE, out=out)
    assert resume.describe(out) == "prune round 1 of 3"
    # Other data: the kept round is not this run's.
    _stop_at_retrain(monkeypatch, 2)
    said = Said()
    x, y = torch.randn(200, 1, 8, 8), torch.randint(0, 10, (200,))
    with pytest.raises(KeyboardInterrupt):
        ck.shrink(net, (x, y), RECIPE, out=out, resume=True, progress=said)
    assert any(
        line.startswith("nothing to resume for")
        and "the kept work is from another model, data or checkpoint file name" in line
        for line in said.lines
    )
    # ...and its own first round replaced the old one: the marks hold one run's work only.
    monkeypatch.undo()
    said = Said()
    report = ck.shrink(net, "digits", RECIPE, out=out, resume=True, progress=said).report
    assert "resumed" not in report
    assert any(line.startswith("nothing to resume for") for line in said.lines)


def test_without_resume_the_kept_work_is_not_used(net, monkeypatch):
    out = net.parent / "not-resumed"
    _stop_at_retrain(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        ck.shrink(net, "digits", RECIPE, out=out)
    monkeypatch.undo()
    said = Said()
    report = ck.shrink(net, "digits", RECIPE, out=out, progress=said).report
    assert "resumed" not in report
    assert any(line.startswith("prune round 1/3") for line in said.lines)


class _Boom:
    def __reduce__(self):
        return (print, ("executed",))


@pytest.mark.parametrize(
    "damage",
    [
        "pickle",
        "truncated",
        "index",
        "index-list",
        "index-deep",
        "shapes",
        "round",
        "hits",
        "trained",
        "trained-deep",
        "nan",
    ],
)
def test_a_damaged_or_crafted_mark_is_refused_in_one_line(net, stopped, damage, capsys):
    out = net.parent / f"damaged-{damage}"
    folder = resume.folder_for(out)
    shutil.copytree(resume.folder_for(stopped), folder)  # the folder's name is not in a mark
    mark = _mark_file(out, "prune")
    if damage == "pickle":  # code in a pickle: refused by weights_only, never run
        mark.write_bytes(pickle.dumps({"kind": "prune", "x": _Boom()}, protocol=2))
    elif damage == "truncated":
        mark.write_bytes(mark.read_bytes()[:1000])
    elif damage == "index":
        (folder / resume.INDEX).write_text("{not json", encoding="utf-8")
    elif damage == "index-list":  # the right fingerprint, marks of the wrong type
        index = json.loads((folder / resume.INDEX).read_text(encoding="utf-8"))
        (folder / resume.INDEX).write_text(json.dumps({**index, "marks": [1, 2]}), encoding="utf-8")
    elif damage == "index-deep":  # Python's JSON reader raised RecursionError: "unexpected"
        (folder / resume.INDEX).write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    else:  # a mark of the right kind whose fields do not fit the run
        payload = torch.load(mark, weights_only=True)
        if damage == "shapes":
            payload["masks"] = {"fc1.weight": torch.ones(3, 3, dtype=torch.bool)}
        elif damage == "round":  # it resumed "after round 1000000/3", redoing no round
            payload["round"] = 10**6
        elif damage == "hits":  # it failed after the whole run, naming no file
            payload["hits"] = torch.ones(5, dtype=torch.bool)
        elif damage == "trained":
            payload["trained"] = "{bad"
        elif damage == "trained-deep":
            payload["trained"] = "[" * 100_000 + "]" * 100_000
        else:  # a flipped exponent bit: retrained on, it failed as "lower the learning rate"
            payload["state"]["fc1.bias"][0] = float("nan")
        torch.save(payload, mark)
    with pytest.raises(InputError) as e:
        ck.shrink(net, "digits", RECIPE, out=out, resume=True)
    message = str(e.value)
    assert "\n" not in message and str(folder) in message and "without --resume" in message
    assert "weights_only" not in message  # torch's advice to turn it off is not relayed
    assert "executed" not in capsys.readouterr().out


def test_a_kept_archive_that_is_not_the_one_recorded_is_refused(net, monkeypatch):
    """The archive kept with the compressed model is checked against its recorded digest: a
    damaged one would have shipped as model.dcz, exit 0, with the report describing another."""
    out = net.parent / "damaged-archive"
    monkeypatch.setattr(pipeline, "_export", lambda *a, **k: (_ for _ in ()).throw(KeyError))
    with pytest.raises(KeyError):
        ck.shrink(net, "digits", RECIPE, out=out)
    monkeypatch.undo()
    mark = _mark_file(out, "compressed")
    payload = torch.load(mark, weights_only=True)
    payload["archive"][50] ^= 1
    torch.save(payload, mark)
    with pytest.raises(InputError, match="its archive is not the one its record describes"):
        ck.shrink(net, "digits", RECIPE, out=out, resume=True)
    assert not out.exists()


def test_the_cli_says_what_a_stopped_run_kept_and_resume_continues(net, run, monkeypatch):
    out = net.parent / "cli"
    _stop_at_retrain(monkeypatch, 3)
    r = run("shrink", net, "--out", out, "--epochs", "1", "-q")
    assert r.exit_code == 130
    assert r.stderr.strip().splitlines()[-1] == (
        "error: interrupted; kept: prune round 2 of 3 (add --resume to continue from there)"
    )
    # Stopped again before it keeps anything new: what it resumed from is still kept.
    monkeypatch.undo()
    _stop_at_retrain(monkeypatch, 1)
    r = run("shrink", net, "--out", out, "--epochs", "1", "--resume", "-q")
    assert r.exit_code == 130
    assert "kept: prune round 2 of 3 (add --resume" in r.stderr
    monkeypatch.undo()
    r = run("shrink", net, "--out", out, "--epochs", "1", "--resume", "--json")
    assert r.exit_code == 0, r.stderr
    assert r.json()["resumed"]["from"] == "prune round 2 of 3"


def test_a_full_disk_costs_the_marks_not_the_run(net, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(resume.Marks, "_save", full)
    said = Said()
    report = ck.shrink(net, "digits", RECIPE, out=net.parent / "full", progress=said).report
    assert "archive" in report
    warned = [line for line in said.lines if "cannot be kept" in line]
    assert len(warned) == 1 and "No space left" in warned[0]


def test_distillation_and_channel_pruning_resume_twice_to_the_same_bytes(net, monkeypatch):
    """A student distilled on a transfer set with half its labels (the rest the teacher's),
    thinned, then Deep Compression: stopped during channel pruning, resumed, stopped again in
    the pruning rounds, resumed again."""
    recipe = dataclasses.replace(
        RECIPE,
        distill=DistillSection(student="lenet300", epochs=1, labels=0.5),
        channels=ChannelsSection(enabled=True, rounds=2, target_macs=0.6, latency=False),
    )
    whole = net.parent / "s-whole"
    ck.shrink(net, "digits", recipe, out=whole)

    out = net.parent / "s-again"
    # retraining runs: 1 distillation, 2-3 channel rounds, 4-6 pruning rounds, 7 fine-tuning
    _stop_at_retrain(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        ck.shrink(net, "digits", recipe, out=out)
    assert resume.describe(out) == "the distilled student (lenet300)"
    monkeypatch.undo()
    _stop_at_retrain(monkeypatch, 4)  # resumed: 1-2 channel rounds, 3-5 pruning rounds
    said = Said()
    with pytest.raises(KeyboardInterrupt):
        ck.shrink(net, "digits", recipe, out=out, resume=True, progress=said)
    assert any(line.startswith("resumed after distillation") for line in said.lines)
    assert resume.describe(out) == "prune round 1 of 3"
    monkeypatch.undo()
    said = Said()
    report = ck.shrink(net, "digits", recipe, out=out, resume=True, progress=said).report
    assert report["resumed"]["from"] == "prune round 1 of 3"
    resumed = [line.split(" (")[0] for line in said.lines if line.startswith("resumed after")]
    assert resumed == [
        "resumed after distillation",
        "resumed after channel pruning",
        "resumed after prune round 1/3",
    ]
    redone = ("channels: removing", "channels: round", "prune round 1/")
    assert not any(line.startswith(redone) for line in said.lines), said.lines
    for name in ("student.dcz", "student.fp32.onnx", "student.int8.onnx"):
        assert (whole / name).read_bytes() == (out / name).read_bytes(), name
    a = json.loads((whole / "report.json").read_text(encoding="utf-8"))
    b = json.loads((out / "report.json").read_text(encoding="utf-8"))
    for key in ("teacher", "student", "transfer", "layers", "archive"):
        assert json.dumps(a.get(key)).replace("s-whole", "OUT") == json.dumps(b.get(key)).replace(
            "s-again", "OUT"
        ), key
    assert a["channels"] == b["channels"]


@pytest.mark.parametrize("kind", ["link", "file", "foreign"])
def test_a_kept_work_folder_that_is_a_link_or_a_file_is_refused_before_any_work(
    net, tmp_path, kind
):
    out = tmp_path / "out"
    folder = resume.folder_for(out)
    if kind == "link":
        (tmp_path / "elsewhere").mkdir()
        folder.symlink_to(tmp_path / "elsewhere")
    elif kind == "file":
        folder.write_text("mine", encoding="utf-8")
    else:  # a folder of that name holding the user's own files: never removed
        folder.mkdir()
        (folder / "notes.txt").write_text("mine", encoding="utf-8")
    said = Said()
    with pytest.raises(InputError) as e:
        ck.shrink(net, "digits", RECIPE, out=out, progress=said)
    assert str(folder) in str(e.value) and "\n" not in str(e.value)
    assert not any(line.startswith("prune round") for line in said.lines)  # before any work
    assert not out.exists()
    if kind == "link":
        assert not list((tmp_path / "elsewhere").iterdir())  # nothing written through it
    if kind == "foreign":
        assert "notes.txt" in str(e.value) and (folder / "notes.txt").is_file()


def test_another_teachers_file_is_another_run_and_another_name_for_it_is_not(net, monkeypatch):
    """An ensemble's extra teachers count by their bytes: the same file named by an absolute
    or a relative path resumes; a retrained one starts again (it resumed the old student)."""
    folder = net.parent
    other = folder / "teacher2.pt"
    ck.train("lenet300", "digits", ck.TrainConfig(epochs=1, seed=1), out=other)
    monkeypatch.chdir(folder)

    def recipe(teacher: str) -> ck.Recipe:
        return dataclasses.replace(
            RECIPE, distill=DistillSection(student="mlp", epochs=1, teachers=(teacher,))
        )

    out = folder / "ensemble"
    _stop_at_retrain(monkeypatch, 2)  # distillation done
    with pytest.raises(KeyboardInterrupt):
        ck.shrink(net, "digits", recipe(str(other)), out=out)
    _stop_at_retrain(monkeypatch, 1)  # whatever it resumes, stop at its first retraining
    said = Said()
    with pytest.raises(KeyboardInterrupt):
        ck.shrink(net, "digits", recipe("teacher2.pt"), out=out, resume=True, progress=said)
    assert any(line.startswith("resumed after distillation") for line in said.lines)

    ck.train("lenet300", "digits", ck.TrainConfig(epochs=1, seed=2), out=other, force=True)
    said = Said()
    with pytest.raises(KeyboardInterrupt):
        ck.shrink(net, "digits", recipe("teacher2.pt"), out=out, resume=True, progress=said)
    assert any(line.startswith("nothing to resume for") for line in said.lines)


def test_a_stop_while_a_round_is_being_kept_leaves_the_round_before_it(net, monkeypatch):
    """Each mark is a new file, the index switched to it in one rename: a kill inside the
    write of round 2 (seconds on a big model) lost round 1 too when prune.pt was rewritten."""
    out = net.parent / "mid-save"
    save, calls = torch.save, [0]

    def stopped(obj, path, *args, **kwargs):
        calls[0] += 1
        save(obj, path, *args, **kwargs)
        if calls[0] == 2:  # the file is half there: the rename never happens
            raise KeyboardInterrupt

    monkeypatch.setattr(resume.torch, "save", stopped)
    with pytest.raises(KeyboardInterrupt):
        ck.shrink(net, "digits", RECIPE, out=out)
    monkeypatch.undo()
    assert resume.describe(out) == "prune round 1 of 3"
    assert [p.suffix for p in resume.folder_for(out).iterdir()].count(".pt") == 1
    report = ck.shrink(net, "digits", RECIPE, out=out, resume=True).report
    assert report["resumed"]["from"] == "prune round 1 of 3"


def test_the_first_versions_file_names_are_its_own(net, tmp_path):
    """Marks kept as prune.pt / compressed.pt (before each mark had a file of its own) are
    this tool's: a run replaces them, it does not refuse them as someone else's."""
    out = tmp_path / "out"
    folder = resume.folder_for(out)
    folder.mkdir()
    for name in ("prune.pt", "compressed.pt"):
        (folder / name).write_bytes(b"kept by an earlier version")
    ck.shrink(net, "digits", RECIPE, out=out)
    assert (out / "model.dcz").is_file() and not folder.exists()


def test_a_stopped_max_drop_search_replays_its_kept_trials_to_the_same_bytes(net, monkeypatch):
    """Each trial of a --max-drop search is a full shrink: a stop in the last one kept the
    others, which the resumed search replays (same recipes asked, in order) without running."""
    recipe = dataclasses.replace(
        RECIPE,
        prune=PruneSection(rounds=1, retrain_epochs=1),
        budget=BudgetSection(max_drop=2.0, trials=2, sparsities=(0.0, 0.8), bits=(4, 8)),
    )
    whole = ck.shrink(net, "digits", recipe, out=net.parent / "b-whole").report
    n = len(whole["budget"]["trials"])
    assert n >= 2
    out = net.parent / "b-again"
    _stop_at_retrain(monkeypatch, 2 * (n - 1) + 1)  # each trial retrains twice: prune, share
    with pytest.raises(KeyboardInterrupt):
        ck.shrink(net, "digits", recipe, out=out)
    assert resume.describe(out) == f"budget trial {n - 1} of at most 2"
    monkeypatch.undo()
    # A crafted or damaged trials mark is refused in one line, before the search's work.
    for n_copy, (damage, said) in enumerate(
        [
            ("archive", "its archive is not the one its record describes"),
            ("verdict", "trial 1 has no verdict"),
            ("generators", "generator state is not torch's"),
            ("best", "best trial 9 is not one of"),
        ]
    ):
        damaged = net.parent / f"b-damaged-{n_copy}"
        shutil.copytree(resume.folder_for(out), resume.folder_for(damaged))
        mark = _mark_file(damaged, "trials")
        payload = torch.load(mark, weights_only=True)
        if damage == "archive":
            payload["archive"][50] ^= 1
        elif damage == "verdict":
            trials = json.loads(payload["trials"])
            del trials[0]["record"]["within_budget"]
            payload["trials"] = json.dumps(trials)
        elif damage == "generators":
            payload["generators_after"][0] = {"torch": "not a state"}
        else:
            payload["best"] = 9
        torch.save(payload, mark)
        with pytest.raises(InputError, match=said) as e:
            ck.shrink(net, "digits", recipe, out=damaged, resume=True)
        assert str(mark) in str(e.value) and "\n" not in str(e.value)
    # Another [export] section: the trials never read it, so they replay all the same.
    other = net.parent / "b-export"
    shutil.copytree(resume.folder_for(out), resume.folder_for(other))
    said = Said()
    opset = dataclasses.replace(recipe, export=ExportSection(opset=17))
    ck.shrink(net, "digits", opset, out=other, resume=True, progress=said)
    assert sum("(kept by the stopped run)" in line for line in said.lines) == n - 1
    assert (net.parent / "b-whole" / "model.dcz").read_bytes() == (other / "model.dcz").read_bytes()
    said = Said()
    report = ck.shrink(net, "digits", recipe, out=out, resume=True, progress=said).report
    assert report["resumed"]["from"] == f"budget trial {n - 1} of at most 2"
    assert sum("(kept by the stopped run)" in line for line in said.lines) == n - 1
    for name in ("model.dcz", "model.fp32.onnx", "model.int8.onnx"):
        assert (net.parent / "b-whole" / name).read_bytes() == (out / name).read_bytes(), name
    assert json.dumps(whole["budget"]["trials"]) == json.dumps(report["budget"]["trials"])


def test_which_recipe_sections_each_kept_stage_depends_on(tmp_path):
    """[export] and [guard] come after the compressed model: changing them keeps every mark.
    Channel pruning to a target latency profiles the model as [export] writes it (and on its
    calibration file's bytes): then [export] counts from the channels mark on."""

    def digests(recipe: ck.Recipe, calibration: str | None = None) -> dict[str, str]:
        return {k: resume._sections(recipe, k, (), calibration) for k in resume.ORDER}

    base = digests(RECIPE)
    opset = dataclasses.replace(RECIPE, export=ExportSection(opset=17))
    assert digests(opset) == base
    bits = digests(dataclasses.replace(RECIPE, quantize=QuantizeSection(fc_bits=4)))
    changed = {k for k in resume.ORDER if bits[k] != base[k]}
    assert changed == {"trials", "compressed"}

    timed = dataclasses.replace(RECIPE, channels=ChannelsSection(enabled=True, target_latency=0.5))
    timed_opset = dataclasses.replace(timed, export=ExportSection(opset=17))
    a, b = digests(timed), digests(timed_opset)
    assert {k for k in resume.ORDER if a[k] != b[k]} == {
        "channels",
        "prune",
        "trials",
        "compressed",
    }
    assert digests(timed, "one file") != digests(timed, "another file")


EVIL = """
from pathlib import Path

def build(**kwargs):
    Path(__file__).with_name("ran").write_text("code from a crafted mark ran")
"""


def test_a_kept_student_naming_other_code_is_refused_and_never_imported(net, tmp_path, monkeypatch):
    """The model is built from the spec this run resolves (whose code the user consented to),
    the mark's spec only compared with it: a crafted one naming importable code is refused."""
    (tmp_path / "evilmod.py").write_text(EVIL, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = dataclasses.replace(RECIPE, distill=DistillSection(student="mlp", epochs=1))
    out = tmp_path / "out"
    _stop_at_retrain(monkeypatch, 2)  # distillation done
    with pytest.raises(KeyboardInterrupt):
        ck.shrink(net, "digits", recipe, out=out)
    monkeypatch.undo()
    monkeypatch.syspath_prepend(str(tmp_path))
    mark = _mark_file(out, "student")
    payload = torch.load(mark, weights_only=True)
    payload["spec"] = json.dumps({"name": "evilmod:build", "kwargs": {}})
    torch.save(payload, mark)
    with pytest.raises(InputError, match="it holds model 'evilmod:build', this run builds 'mlp'"):
        ck.shrink(net, "digits", recipe, out=out, resume=True)
    assert not (tmp_path / "ran").exists()


def test_an_unforeseen_failure_after_kept_work_still_says_what_is_kept(net, run, monkeypatch):
    out = net.parent / "unforeseen"

    def fails(*args, **kwargs):
        raise KeyError("a bug of ours")

    monkeypatch.setattr(pipeline, "_export", fails)
    r = run("shrink", net, "--out", out, "--epochs", "1", "-q")
    assert r.exit_code == 1
    assert r.stderr.strip().splitlines()[-1] == (
        "error: KeyError: 'a bug of ours' (unexpected; COMPRESS_DEBUG=1 shows the traceback); "
        "kept: Deep Compression (pruning, weight sharing, Huffman) (add --resume to continue "
        "from there)"
    )


@pytest.mark.parametrize("field", ["baseline", "stages", "layers", "archive"])
def test_a_kept_report_is_checked_in_the_fields_read_from_it(net, monkeypatch, field):
    """The compressed mark's report, its archive's digest intact: a crafted figure failed
    deep in the pipeline as an "unexpected" KeyError or TypeError, with --resume's hint."""
    out = net.parent / f"report-{field}"
    monkeypatch.setattr(pipeline, "_export", _failing_export)
    with pytest.raises(StageError):
        ck.shrink(net, "digits", RECIPE, out=out)
    mark = _mark_file(out, "compressed")
    payload = torch.load(mark, weights_only=True)
    report = json.loads(payload["report"])
    report[field] = (
        {**report["archive"], "bytes": "many"} if field == "archive" else [1] if field else None
    )
    payload["report"] = json.dumps(report)
    torch.save(payload, mark)
    with pytest.raises(InputError, match=r"cannot be resumed from \(its report"):
        ck.shrink(net, "digits", RECIPE, out=out, resume=True)


def test_only_regular_files_of_its_names_are_its_own(net, tmp_path):
    """The kept-work folder is removed whole: a folder named like a mark, and the user's files
    in it, went with it."""
    out = tmp_path / "out"
    folder = resume.folder_for(out)
    (folder / "prune-0a.pt").mkdir(parents=True)
    (folder / "prune-0a.pt" / "thesis.tex").write_text("mine", encoding="utf-8")
    with pytest.raises(InputError, match=r"files this tool did not write \(prune-0a.pt\)"):
        ck.shrink(net, "digits", RECIPE, out=out)
    assert (folder / "prune-0a.pt" / "thesis.tex").read_text(encoding="utf-8") == "mine"


def test_a_killed_saves_temporary_file_goes_with_the_next_save(net, stopped, monkeypatch):
    out = net.parent / "leftover"
    folder = resume.folder_for(out)
    shutil.copytree(resume.folder_for(stopped), folder)
    (folder / ".prune-0123456789ab.pt.xyz.tmp").write_bytes(b"half a mark")
    _stop_at_retrain(monkeypatch, 2)  # round 3 of 3 is kept first
    with pytest.raises(KeyboardInterrupt):
        ck.shrink(net, "digits", RECIPE, out=out, resume=True)
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted([resume.INDEX, _mark_file(out, "prune").name])


def test_a_stop_names_the_work_this_run_continued_from_not_the_furthest_kept(net, monkeypatch):
    """A failed export keeps the compressed model; rerun with another [quantize] it resumes
    from the last pruning round, and a stop there said "kept: Deep Compression" (which the
    next --resume would not use)."""
    out = net.parent / "furthest"
    monkeypatch.setattr(pipeline, "_export", _failing_export)
    with pytest.raises(StageError):
        ck.shrink(net, "digits", RECIPE, out=out)
    monkeypatch.undo()
    assert resume.describe(out) == "Deep Compression (pruning, weight sharing, Huffman)"
    other = dataclasses.replace(RECIPE, quantize=QuantizeSection(fc_bits=4, finetune_epochs=1))
    _stop_at_retrain(monkeypatch, 1)  # centroid fine-tuning
    with pytest.raises(KeyboardInterrupt):
        ck.shrink(net, "digits", other, out=out, resume=True)
    assert resume.describe(out) == "prune round 3 of 3"
    index = json.loads((resume.folder_for(out) / resume.INDEX).read_text(encoding="utf-8"))
    index["last"] = "\x1b[31mred\nline"  # a crafted index's text never reaches the terminal
    (resume.folder_for(out) / resume.INDEX).write_text(json.dumps(index), encoding="utf-8")
    assert resume.describe(out) is None


def test_sections_a_recipe_never_reads_keep_its_marks():
    def digests(recipe: ck.Recipe) -> dict[str, str]:
        return {k: resume._sections(recipe, k) for k in resume.ORDER}

    base = digests(RECIPE)
    unread = dataclasses.replace(
        RECIPE, budget=BudgetSection(trials=4), distill=DistillSection(epochs=3)
    )
    assert digests(unread) == base  # no accuracy budget, no student
    budget = dataclasses.replace(RECIPE, budget=BudgetSection(max_drop=1.0, search="scale"))
    more = dataclasses.replace(RECIPE, budget=BudgetSection(max_drop=1.0, search="scale", trials=9))
    changed = {k for k in resume.ORDER if digests(budget)[k] != digests(more)[k]}
    assert "trials" not in changed  # trials replay by their own recipes' digests
    assert "compressed" in changed


def test_nothing_to_resume_names_the_version_that_changed(net, stopped, monkeypatch):
    out = net.parent / "versions"
    shutil.copytree(resume.folder_for(stopped), resume.folder_for(out))
    real = resume.checkpoint.versions
    monkeypatch.setattr(resume.checkpoint, "versions", lambda: {**real(), "torch": "9.9.9"})
    said = Said()
    _stop_at_retrain(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        ck.shrink(net, "digits", RECIPE, out=out, resume=True, progress=said)
    line = next(x for x in said.lines if x.startswith("nothing to resume"))
    assert f"another version (torch {real()['torch']} then, 9.9.9 now)" in line
