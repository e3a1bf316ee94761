"""`compress shrink` and `compress decode` end to end, on digits, with a short recipe."""

import json
import textwrap
import tomllib
from pathlib import Path

import pytest
import torch

from compresskit.compressor import archive, recipe
from compresskit.compressor.shrink import bits_equal
from compresskit.models import checkpoint

GOLDEN = Path(__file__).parent / "golden"
FAST = textwrap.dedent("""
    [prune]
    rounds = 2
    retrain_epochs = 1
    [quantize]
    finetune_epochs = 1
""")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from click.testing import CliRunner

    from compresskit.cli.main import cli

    folder = tmp_path_factory.mktemp("shrink")
    runner = CliRunner()
    ck = folder / "lenet300.pt"
    result = runner.invoke(
        cli,
        [
            "train",
            "--model",
            "lenet300",
            "--data",
            "digits",
            "--epochs",
            "4",
            "--out",
            str(ck),
            "-q",
        ],
    )
    assert result.exit_code == 0, result.stderr
    (folder / "fast.toml").write_text(FAST)
    out = folder / "shrunk"
    result = runner.invoke(
        cli,
        [
            "shrink",
            str(ck),
            "--recipe",
            str(folder / "fast.toml"),
            "--out",
            str(out),
            "--fixed-batch",
            "2",
            "--json",
            "-q",
        ],
    )
    assert result.exit_code == 0, result.stderr
    return folder, out, json.loads(result.stdout)


def test_shrink_json_and_files(trained):
    folder, out, report = trained
    assert report["out"] == str(out.resolve())  # report.json's paths are names in it
    assert {"bytes", "test_accuracy"} <= report["baseline"].keys()
    assert [s["name"] for s in report["stages"]] == ["prune", "quantize", "huffman"]
    for s in report["stages"]:
        assert {"name", "bytes", "ratio", "test_accuracy"} <= s.keys()
        # the change against the dense model, paired over the same 360 test images
        c, base = s["change"], report["baseline"]["test_accuracy"]
        assert c["samples"] == 360 and c["points"] == pytest.approx(
            100 * (s["test_accuracy"] - base)
        )
        assert c["points"] == pytest.approx(100 * (c["gained"] - c["lost"]) / 360)
        assert c["ci_points"][0] <= c["points"] <= c["ci_points"][1]
    a = report["archive"]
    assert a["path"] == "model.dcz" and a["bytes"] == (out / "model.dcz").stat().st_size
    assert report["data"] == json.loads((out / "report.json").read_text())["data"]  # README
    # The archive names its checkpoint by file name: no folder of the build machine in it.
    from compresskit.compressor import archive

    assert archive.read(out / "model.dcz").metadata["source"] == "lenet300.pt"
    assert a["ratio"] == pytest.approx(report["baseline"]["bytes"] / a["bytes"])
    assert a["bytes"] <= 1.02 * a["entropy_bound_bytes"]
    for s in report["stages"]:  # every stage against the same dense FP32 baseline
        assert s["ratio"] == pytest.approx(report["baseline"]["bytes"] / s["bytes"])
    ratios = [s["ratio"] for s in report["stages"]]
    assert ratios == sorted(ratios) and ratios[-1] > 15
    assert {r["name"] for r in report["layers"]} == {"fc1.weight", "fc2.weight", "fc3.weight"}
    for name in ("model.dcz", "model.pt", "report.json", "report.md"):
        assert (out / name).is_file()
    for png in ("weights_histogram.png", "kept_per_layer.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "report.md").read_text()
    assert "P+Q+H" in md and "## Recipe" in md and "retrain_epochs = 1" in md
    assert "| paired 95% interval | test samples gained / lost |" in md
    assert "1,294 train / 143 validation / 360 test samples" in md
    saved = json.loads((out / "report.json").read_text())
    assert saved["recipe"]["prune"]["rounds"] == 2
    # the default micro-batches ("auto") measured this MLP's activations: its batch stays whole
    assert saved["recipe"]["train"]["microbatches"] == "auto"
    assert saved["training"] == {"microbatches": [1], "bn_refreshed_runs": 0}  # lenet: no BN
    assert not [p for p in folder.iterdir() if p.name.startswith(".shrunk")]  # no temp folder left


def test_timings_split_non_training_seconds_into_data_passes_and_the_rest(trained):
    _, out, _ = trained
    t = json.loads((out / "report.json").read_text())["timings"]
    assert t["data_passes"] > 0 and t["per_weight"] > 0
    # training + data passes + the rest is the whole run, to each figure's rounding
    assert abs(t["training"] + t["data_passes"] + t["per_weight"] - t["total"]) < 0.005
    assert abs(t["data_passes"] + t["per_weight"] - t["non_training"]) < 0.005
    # the peak memory a user could only read from /usr/bin/time, and report.md says both
    import resource

    saved = json.loads((out / "report.json").read_text())
    peak = saved["memory"]["peak_rss_bytes"]
    assert 50 * 2**20 < peak <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cost = (out / "report.md").read_text().split("## Cost\n\n")[1].split("\n")[0]
    assert cost.startswith(f"{t['total']:.1f} s, of which training {t['training']:.1f} s; by")
    assert cost.endswith(f". Peak resident memory {peak / 2**20:,.0f} MiB.")


def test_shrink_exports_fp32_and_int8_onnx_that_answer_like_the_model(trained):
    _, out, report = trained
    onnx = report["onnx"]
    for kind in ("fp32", "int8"):
        o = onnx[kind]
        assert {"path", "bytes", "test_accuracy", "top1_agreement", "max_abs_diff"} <= o.keys()
        assert (out / o["path"]).stat().st_size == o["bytes"]
        assert o["weights_ok"], o["weights"]  # pruned zeros and shared values survive export
    assert onnx["fp32"]["top1_agreement"] == 1.0 and onnx["fp32"]["max_abs_diff"] < 1e-4
    assert onnx["int8"]["top1_agreement"] >= 0.99
    # what an app must feed and reads back, in every file and the report (digits' raw
    # 0..16 pixels, fed unscaled, cost an INT8 file 14 points, and nothing said to scale them)
    import onnxruntime as ort

    scaling = "scikit-learn digits' 8x8 pixels (0..16) divided by 16: float32 in [0, 1]"
    for name in ("model.fp32.onnx", "model.int8.onnx", "model.int8.ort"):
        meta = ort.InferenceSession(str(out / name)).get_modelmeta().custom_metadata_map
        assert meta["compress.input"] == scaling
        assert meta["compress.output"].startswith("logits, one per class 0..9")
    assert onnx["int8"]["input"]["scaling"] == scaling
    assert onnx["int8"]["output"]["shape"] == ["batch", 10]
    md = (out / "report.md").read_text()
    assert f"- Input `x`: float32 (batch, 1, 8, 8): {scaling}" in md
    assert onnx["fp32"]["test_accuracy"] == pytest.approx(report["stages"][-1]["test_accuracy"])
    q = onnx["int8"]
    assert q["target"] == "mobile" and q["latency_ms_batch1"] is None  # nothing timed
    assert q["decided_on"] == "reference" and q["check_agreement"] >= q["min_agreement"]
    assert [c["scheme"] for c in q["candidates"]][1].startswith("ort-default")
    assert isinstance(q["fp32_nodes"], dict)
    assert q["quantizable_nodes"] == 3  # fc1..fc3
    assert q["int8_nodes"] == 3 - len(q["fp32_nodes"])
    # parity twice: the file as written (above) and this CPU's optimized kernels
    assert {"top1_agreement_fp32", "max_abs_diff_fp32", "saturating_cpu"} <= q[
        "host_kernels"
    ].keys()
    # versions read back from each file: the exporter's opset 18 at its lowest IR (8)
    for o in (onnx["fp32"], q, report["mobile_fixed_batch"]):
        assert o["opsets"] == {"ai.onnx": 18} and o["ir_version"] == 8 and o["min_ort"] == "1.14"
    assert report["ort"]["bytes"] == (out / "model.int8.ort").stat().st_size
    # our export is opset 18, IR 8 (ONNX Runtime 1.14); the ORT format v6 file needs 1.16
    assert (report["ort"]["ort_format"], report["ort"]["opset"]) == ("6", 18)
    assert report["ort"]["min_ort"] == "1.16"
    # what the bytes may depend on: retraining's float sums follow the torch thread count
    env = report["environment"]
    assert env["torch_threads"] >= 1 and 1 <= env["usable_cores"] <= env["logical_cores"]
    assert f"{env['torch_threads']} torch threads" in (out / "report.md").read_text()
    assert (out / "model.int8.required_operators.config").is_file()
    assert report["mobile"]["nnapi"] in ("yes", "partial", "no")
    assert "## ONNX" in (out / "report.md").read_text()
    fixed = report["mobile_fixed_batch"]
    assert fixed["batch"] == 2 and fixed["nnapi"] == "yes"  # NNAPI needs the fixed shape
    assert (out / fixed["path"]).is_file()


def _without(
    d,
    keys=(
        "seconds",
        "path",
        "out",
        "files",
        "config",
        "checkpoint",
        "source",
        "date",
        "load_average_1min",
        "peak_rss_bytes",
    ),
):
    """A report without what differs between two runs into two folders: paths, timings, the date."""
    if isinstance(d, dict):
        return {k: _without(v, keys) for k, v in d.items() if k not in keys}
    if isinstance(d, list):
        return [_without(v, keys) for v in d]
    return d


def test_target_mobile_writes_the_same_bytes_on_every_build(run, trained, tmp_path):
    folder, out, first = trained
    again = tmp_path / "again"
    args = ["shrink", folder / "lenet300.pt", "--recipe", folder / "fast.toml", "--out", again]
    result = run(*args, "--fixed-batch", "2", "--json", "-q")
    assert result.exit_code == 0, result.stderr
    # the operator config too: it named the random staging folder the .ort was made in
    names = ("model.int8.onnx", "model.fp32.onnx", "model.int8.fixed.onnx", "model.dcz")
    for name in (*names, "model.int8.required_operators.config"):
        assert (again / name).read_bytes() == (out / name).read_bytes(), name
    assert _without(result.json()) == _without(first)


def test_target_host_may_ship_no_int8_file_and_says_so(run, trained, tmp_path, monkeypatch):
    """On a machine where FP32 is faster, host ships the FP32 graph's .ort, warns, and writes
    no model.int8.onnx (an "INT8" name on an FP32 graph)."""
    from compresskit.compressor.export import int8

    monkeypatch.setattr(int8, "fp32_clearly_faster", lambda a, b, margin=0.05: True)
    monkeypatch.setattr(int8, "ROUNDS", 3)
    folder, _, _ = trained
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        "[prune]\nenabled = false\n[quantize]\nenabled = false\n[huffman]\nenabled = false\n"
    )
    out = tmp_path / "host"
    args = ["shrink", folder / "lenet300.pt", "--recipe", recipe, "--target", "host"]
    result = run(*args, "--out", out, "--json", "-q")
    assert result.exit_code == 0, result.stderr
    assert "warning: no INT8 file written: INT8 slower" in result.stderr
    r = result.json()
    assert "int8" not in r["onnx"] and not (out / "model.int8.onnx").exists()
    miss = r["int8_not_written"]
    assert miss["target"] == "host" and miss["int8_nodes"] == 0
    assert set(miss["latency_ms_batch1"]) == {"fp32", "int8"}
    assert (out / "model.fp32.ort").is_file() and r["ort"]["path"].endswith("model.fp32.ort")
    assert "No INT8 file was written" in (out / "report.md").read_text()
    # nor an archive, which the recipe turned off: said as the other missing files are
    assert "No archive written: [huffman] enabled = false" in (out / "report.md").read_text()


def test_index_bits_count_escapes(trained):
    _, out, report = trained
    from compresskit.compressor import huffman

    state = checkpoint.load(out / "model.pt").state_dict
    for row in report["layers"]:
        positions = torch.nonzero(state[row["name"]].flatten()).flatten().numpy()
        gaps = huffman.encode_gaps(positions, 5)  # the recipe's fixed FC width
        assert row["index_bits"] == pytest.approx(5 * len(gaps) / row["kept"])


def test_prune_stage_bytes_do_not_depend_on_later_stages(run, trained, tmp_path):
    folder, _, report = trained
    (tmp_path / "p.toml").write_text(
        FAST.replace("[quantize]", "[quantize]\nenabled = false") + "[huffman]\nenabled = false\n"
    )
    result = run(
        "shrink",
        folder / "lenet300.pt",
        "--recipe",
        tmp_path / "p.toml",
        "--out",
        tmp_path / "p",
        "--json",
        "-q",
    )
    assert result.exit_code == 0, result.stderr
    only_p = result.json()
    assert [s["name"] for s in only_p["stages"]] == ["prune"]
    assert only_p["stages"][0]["bytes"] == report["stages"][0]["bytes"]


def test_compressed_model_obeys_its_recipe(trained):
    _, out, report = trained
    state = checkpoint.load(out / "model.pt").state_dict
    for row in report["layers"]:
        w = state[row["name"]]
        assert int((w != 0).sum()) == row["kept"]
        assert torch.unique(w).numel() <= 2 ** row["weight_bits"]  # zero included
    acc = report["stages"][-1]["test_accuracy"]
    assert acc >= report["baseline"]["test_accuracy"] - 0.05


def test_decode_reproduces_the_weights_bit_for_bit(run, trained):
    folder, out, _ = trained
    result = run("decode", out / "model.dcz", "--out", folder / "decoded.pt", "--json")
    assert result.exit_code == 0, result.stderr
    a = checkpoint.load(out / "model.pt").state_dict
    b = checkpoint.load(folder / "decoded.pt").state_dict
    assert list(a) == list(b) and all(bits_equal(a[k], b[k]) for k in a)
    assert result.json()["checkpoint"] == str(folder / "decoded.pt")


def test_decode_replaces_only_a_checkpoint_and_only_with_force(run, trained, tmp_path):
    # A user's unrelated file given as --out was silently replaced by a checkpoint.
    _, out, _ = trained
    mine = tmp_path / "notes.txt"
    mine.write_text("my notes")
    result = run("decode", out / "model.dcz", "--out", mine)
    assert result.exit_code == 2 and "exists; pass --force" in result.stderr
    assert mine.read_text() == "my notes"
    # nor with --force: it replaces a checkpoint, never another kind of file
    result = run("decode", out / "model.dcz", "--out", mine, "--force")
    assert result.exit_code == 2 and "exists and is not a PyTorch checkpoint" in result.stderr
    assert mine.read_text() == "my notes"
    again = tmp_path / "d.pt"
    assert run("decode", out / "model.dcz", "--out", again).exit_code == 0
    result = run("decode", out / "model.dcz", "--out", again, "--force")
    assert result.exit_code == 0, result.stderr
    assert (
        checkpoint.load(again).state_dict.keys()
        == checkpoint.load(out / "model.pt").state_dict.keys()
    )


def test_dry_run_prints_the_default_recipe(run):
    result = run("shrink", "nothing.pt", "--dry-run")
    assert result.exit_code == 0
    assert result.stdout == (GOLDEN / "default_recipe.toml").read_text()
    assert recipe.resolve(tomllib.loads(result.stdout)) == recipe.resolve({})
    assert "nothing.pt does not exist yet" in result.stderr  # why there is no layer plan


def test_epochs_0_skips_training_and_is_refused_only_with_a_student(run):
    # --epochs 0 set distill.epochs = 0 too, which the recipe refuses, with no student at all
    result = run("shrink", "nothing.pt", "--epochs", "0", "--dry-run", "--json")
    assert result.exit_code == 0, result.stderr
    r = result.json()["recipe"]
    assert r["prune"]["retrain_epochs"] == r["quantize"]["finetune_epochs"] == 0
    assert r["distill"]["epochs"] == recipe.DEFAULTS["distill"]["epochs"]
    result = run("shrink", "nothing.pt", "--epochs", "0", "--student", "lenet5", "--dry-run")
    assert result.exit_code == 2
    assert "--epochs" in result.stderr and "distillation trains it" in result.stderr


def test_dry_run_resolves_a_recipe_file(run, tmp_path):
    (tmp_path / "r.json").write_text('{"quantize": {"fc_bits": 4, "bits": {"fc1": 6}}}')
    result = run("shrink", "nothing.pt", "--dry-run", "--recipe", tmp_path / "r.json", "--json")
    assert result.exit_code == 0
    r = result.json()["recipe"]
    assert r["quantize"]["fc_bits"] == 4 and r["quantize"]["bits"] == {"fc1": 6}
    assert r["prune"] == recipe.DEFAULTS["prune"]


def test_bits_replaces_a_per_layer_table_as_sparsity_does(run, tmp_path):
    # "--bits N: N for every layer" kept the layers a recipe's table named at their own bits
    (tmp_path / "r.json").write_text(
        '{"quantize": {"bits": {"fc1": 6}}, "prune": {"sparsity": {"fc1": 0.5}}}'
    )
    flags = ("--bits", "3", "--sparsity", "0.9", "--dry-run", "--json")
    result = run("shrink", "nothing.pt", "--recipe", tmp_path / "r.json", *flags)
    assert result.exit_code == 0, result.stderr
    r = result.json()["recipe"]
    assert (r["quantize"]["conv_bits"], r["quantize"]["fc_bits"], r["quantize"]["bits"]) == (
        3,
        3,
        {},
    )
    assert r["prune"]["sparsity"] == 0.9


@pytest.mark.parametrize("flags", [("--opset", "13"), ("--fixed-batch", "1"), ("--target", "host")])
def test_export_flags_on_a_recipe_that_exports_nothing_are_refused(run, tmp_path, flags):
    # the run went on without the files they asked for, exit 0, saying nothing
    (tmp_path / "r.toml").write_text("[export]\nenabled = false\n")
    result = run("shrink", "nothing.pt", "--recipe", tmp_path / "r.toml", *flags, "--dry-run")
    assert result.exit_code == 2
    assert f"drop {flags[0]} or set enabled = true" in result.stderr
    assert result.stderr.count("\n") == 1


def test_dry_run_checks_the_files_a_recipe_names_and_epochs_are_bounded(run, tmp_path):
    (tmp_path / "folder.toml").mkdir()
    result = run("shrink", "nothing.pt", "--recipe", tmp_path / "folder.toml", "--dry-run")
    assert result.exit_code == 2 and "folder.toml: a folder, not a file" in result.stderr
    (tmp_path / "r.toml").write_text('[export]\ncalibration_data = "nope.npy"\n')
    result = run("shrink", "nothing.pt", "--recipe", tmp_path / "r.toml", "--dry-run")
    assert result.exit_code == 2  # as the run itself refuses it, before any work
    assert "export.calibration_data nope.npy: no such file" in result.stderr
    (tmp_path / "t.toml").write_text('[distill]\nstudent = "lenet5"\nteachers = ["gone.pt"]\n')
    result = run("shrink", "nothing.pt", "--recipe", tmp_path / "t.toml", "--dry-run")
    assert result.exit_code == 2 and "distill.teachers" in result.stderr
    result = run("shrink", "nothing.pt", "--epochs", str(10**17), "--dry-run")
    assert result.exit_code == 2 and "a whole number, 0..10000" in result.stderr


def test_yaml_recipe(run, tmp_path):
    (tmp_path / "r.yaml").write_text("quantize:\n  fc_bits: 4\n")
    result = run("shrink", "x.pt", "--dry-run", "--recipe", tmp_path / "r.yaml", "--json")
    assert result.exit_code == 0 and result.json()["recipe"]["quantize"]["fc_bits"] == 4


def test_golden_archive_still_decodes():
    from tests.test_archive import _entries

    entries, w = _entries(seed=0)
    decoded = archive.read(GOLDEN / "v1.dcz")
    assert decoded.metadata == {"golden": 1}
    assert bits_equal(decoded.state_dict["fc.weight"], torch.from_numpy(w))
    assert bits_equal(decoded.state_dict["bf"], entries[-1].tensor)


# --- bad input: one line, exit 2, nothing written ------------------------------------------


def _write_recipe(tmp_path, text):
    (tmp_path / "r.toml").write_text(text)
    return ["--recipe", tmp_path / "r.toml"]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing checkpoint", "no such checkpoint"),
        ("text checkpoint", "not a torch.save file"),
        ("no prunable layers", "no prunable layers"),
        ("unknown recipe key", "unknown key prune.sparsty"),
        ("bits 0", "quantize.fc_bits = 0 is impossible"),
        ("sparsity 1.5", "prune.sparsity = 1.5 is impossible"),
        ("recipe not toml", "not valid TOML"),
        ("out not writable", "/out: folder /sys is not writable"),  # the --out given, no probe
        ("out is a file", "is not a folder"),
        ("recipe names a missing layer", "names layer 'fc9'"),
        ("seed out of range", "train.seed = -1 is impossible"),
        ("include_bias not bool", "prune.include_bias = 'no' is impossible"),
        ("bits 13", "quantize.fc_bits = 13 is impossible"),
        ("out holds a folder named like an output", "report.json there is not a regular file"),
        ("out in a missing folder", "does not exist; create it first"),
        ("opset the exporter and runtime cannot run", "export.opset = 30 is impossible"),
        (
            "calibration of the wrong shape",
            "inputs of shape (1, 28, 28), the model takes (1, 8, 8)",
        ),
        ("calibration empty", "is empty; give at least one input sample"),
        ("calibration not an array", "not a .npy array"),
        ("student of another input shape", "do not fit model fixed:Wide"),
        ("student with another class count", "predicts 3 classes"),
        ("ensemble member of another input shape", "was built for (1, 16, 16)"),
        ("hint layer missing", "has no layer 'nope'"),
        ("hint without teacher layer", "hint_student and distill.hint_teacher go together"),
        ("transfer unknown", "distill.transfer = 'gan' is impossible"),
        ("labels zero", "distill.labels = 0 is impossible"),
        ("unknown target", "Invalid value for '--target'"),
        ("ir_version below the opset's", "opset 19 needs IR 9 or more"),
        ("reduce_range with uint8 weights", "need int8 weights (scheme u8s8), not u8u8"),
        ("old latency_aware key", "export.latency_aware is gone: use export.target"),
        ("opset the exporter cannot write", "opset 13: torch's exporter wrote opset 18"),
        ("microbatches over the batch", "train.microbatches = 64 is impossible"),
        ("microbatches flag zero", "with --microbatches: train.microbatches = 0 is impossible"),
        ("microbatches on a BatchNorm student", "layer 'features.1' normalises over the batch"),
        ("microbatches a word", "train.microbatches = 'most' is impossible"),
        ("microbatches flag a word", "'some' is not a whole number or auto"),
    ],
)
def test_shrink_bad_input(run, tmp_path, trained, monkeypatch, case, message):
    folder, _, _ = trained
    ck = folder / "lenet300.pt"
    out = tmp_path / "out"
    args = [ck]
    if case == "missing checkpoint":
        args = [tmp_path / "nope.pt"]
    elif case == "text checkpoint":
        (tmp_path / "t.pt").write_text("hi")
        args = [tmp_path / "t.pt"]
    elif case == "no prunable layers":
        (tmp_path / "flatnets.py").write_text(
            "import torch\nfrom torch import nn\n"
            "class Scale(nn.Module):\n"
            "    def __init__(self):\n        super().__init__(); self.s = nn.Parameter(torch.ones(10))\n"
            "    def forward(self, x):\n        return x.flatten(1)[:, :10] * self.s\n"
        )
        monkeypatch.syspath_prepend(str(tmp_path))
        from compresskit.models import ModelSpec
        from compresskit.models.zoo import build

        checkpoint.save(
            tmp_path / "flat.pt",
            build(ModelSpec("flatnets:Scale")),
            ModelSpec("flatnets:Scale"),
            {"data": "digits"},
        )
        args = [tmp_path / "flat.pt", "--model", "flatnets:Scale"]
    elif case == "unknown recipe key":
        args += _write_recipe(tmp_path, "[prune]\nsparsty = 0.9\n")
    elif case == "bits 0":
        args += _write_recipe(tmp_path, "[quantize]\nfc_bits = 0\n")
    elif case == "sparsity 1.5":
        args += _write_recipe(tmp_path, "[prune]\nsparsity = 1.5\n")
    elif case == "recipe names a missing layer":
        args += _write_recipe(tmp_path, "[quantize]\nbits = {fc9 = 4}\n")
    elif case == "microbatches over the batch":
        args += _write_recipe(tmp_path, "[train]\nmicrobatches = 64\n")
    elif case == "microbatches flag zero":
        args += ["--microbatches", "0"]
    elif case == "microbatches on a BatchNorm student":
        args += _write_recipe(tmp_path, '[train]\nmicrobatches = 2\n[distill]\nstudent = "vgg"\n')
    elif case == "microbatches a word":
        args += _write_recipe(tmp_path, '[train]\nmicrobatches = "most"\n')
    elif case == "microbatches flag a word":
        args += ["--microbatches", "some"]
    elif case == "seed out of range":
        args += _write_recipe(tmp_path, "[train]\nseed = -1\n")
    elif case == "include_bias not bool":
        args += _write_recipe(tmp_path, "[prune]\ninclude_bias = 'no'\n")
    elif case == "bits 13":
        args += _write_recipe(tmp_path, "[quantize]\nfc_bits = 13\n")
    elif case == "out holds a folder named like an output":
        (out / "report.json").mkdir(parents=True)
    elif case == "recipe not toml":
        args += _write_recipe(tmp_path, "[prune\n")
    elif case == "out not writable":
        import os

        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        out = (ro if os.geteuid() != 0 else Path("/sys")) / "out"
    elif case == "out is a file":
        out.write_text("")
    elif case == "out in a missing folder":
        out = tmp_path / "missing" / "out"
    elif case == "opset the exporter and runtime cannot run":
        args += ["--opset", "30"]
    elif case.startswith("calibration"):
        import numpy as np

        calib = tmp_path / "c.npy"
        if case == "calibration of the wrong shape":
            np.save(calib, np.zeros((4, 1, 28, 28), np.float32))
        elif case == "calibration empty":
            np.save(calib, np.zeros((0, 1, 8, 8), np.float32))
        else:
            calib.write_text("not numpy")
        args += ["--calibration", calib]
    elif case in ("student of another input shape", "student with another class count"):
        (tmp_path / "fixed.py").write_text(
            "from torch import nn\n"
            "class Three(nn.Sequential):  # 8x8 inputs, 3 classes\n"
            "    def __init__(self):\n        super().__init__(nn.Flatten(), nn.Linear(64, 3))\n"
            "class Wide(nn.Sequential):  # 28x28 inputs, 10 classes\n"
            "    def __init__(self):\n        super().__init__(nn.Flatten(), nn.Linear(784, 10))\n"
        )
        monkeypatch.syspath_prepend(str(tmp_path))
        args += ["--student", "fixed:Three" if "class" in case else "fixed:Wide"]
    elif case == "ensemble member of another input shape":
        big = tmp_path / "big.pt"
        r = run("train", "--model", "mlp", "--data", "digits:16", "--epochs", "1", "--out", big)
        assert r.exit_code == 0
        args += ["--student", "mlp", "--teacher", big]
    elif case == "hint layer missing":
        args += _write_recipe(
            tmp_path, '[distill]\nstudent = "mlp"\nhint_student = "nope"\nhint_teacher = "fc1"\n'
        )
    elif case == "hint without teacher layer":
        args += _write_recipe(tmp_path, '[distill]\nstudent = "mlp"\nhint_student = "fc1"\n')
    elif case == "transfer unknown":
        args += _write_recipe(tmp_path, '[distill]\nstudent = "mlp"\ntransfer = "gan"\n')
    elif case == "labels zero":
        args += _write_recipe(tmp_path, '[distill]\nstudent = "mlp"\nlabels = 0\n')
    elif case == "unknown target":
        args += ["--target", "phone"]
    elif case == "ir_version below the opset's":
        args += _write_recipe(tmp_path, "[export]\nopset = 19\nir_version = 8\n")
    elif case == "reduce_range with uint8 weights":
        args += _write_recipe(tmp_path, '[export]\nscheme = "u8u8"\nreduce_range = true\n')
    elif case == "old latency_aware key":
        args += _write_recipe(tmp_path, "[export]\nlatency_aware = false\n")
    elif case == "opset the exporter cannot write":
        from compresskit.compressor.export import onnxfile as export

        real = export._export

        def dynamo_only(model, example, cfg, dynamo, name="x", outputs=None, sequence=0):
            if not dynamo:  # as if torch had dropped its TorchScript exporter
                raise export.StageError("ONNX export failed: gone")
            return real(model, example, cfg, dynamo, sequence=sequence)

        monkeypatch.setattr(export, "_export", dynamo_only)
        monkeypatch.setattr(
            "compresskit.api.fit", lambda *a, **k: pytest.fail("trained before refusing")
        )
        args += ["--opset", "13"]
    before = {p.name for p in tmp_path.iterdir()}
    result = run("shrink", *args, "--out", out, "--json")
    assert result.exit_code == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    assert {p.name for p in tmp_path.iterdir()} == before
    assert json.loads(result.stdout)["exit_code"] == 2


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda b: b[: len(b) // 2], "truncated"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "checksum mismatch"),
        (lambda b: b[:200] + bytes([b[200] ^ 4]) + b[201:], "checksum mismatch"),
        (lambda b: b"\x89PNG\r\n\x1a\n" + b[8:], "not a compress archive"),
        (lambda b: b"", "not a compress archive"),
    ],
)
def test_decode_bad_archives(run, tmp_path, trained, damage, message):
    _, out, _ = trained
    bad = tmp_path / "bad.dcz"
    bad.write_bytes(damage((out / "model.dcz").read_bytes()))
    result = run("decode", bad, "--out", tmp_path / "m.pt")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and message in result.stderr
    assert not (tmp_path / "m.pt").exists()


def test_decode_newer_version(run, tmp_path):
    import struct
    import zlib

    data = bytearray((GOLDEN / "v1.dcz").read_bytes()[:-4])
    struct.pack_into("<H", data, 8, archive.VERSION + 1)
    (tmp_path / "new.dcz").write_bytes(bytes(data) + struct.pack("<I", zlib.crc32(bytes(data))))
    result = run("decode", tmp_path / "new.dcz", "--out", tmp_path / "m.pt")
    assert result.exit_code == 2 and "newer than this compress reads" in result.stderr


def test_shrink_distils_the_teacher_into_an_int8_student(run, trained, tmp_path):
    """The whole pipeline from a teacher checkpoint: every output file and the JSON contract."""
    import onnx
    import onnxruntime as ort

    folder, _, _ = trained
    (tmp_path / "d.toml").write_text(
        '[distill]\nepochs = 3\ntransfer = "mixup"\ntransfer_size = 0.5\n'
        'hint_student = "fc1"\nhint_teacher = "fc2"\nhint_epochs = 1\n' + FAST
    )
    out = tmp_path / "s"
    result = run(
        "shrink",
        folder / "lenet300.pt",
        "--student",
        "mlp",
        "--student-kwargs",
        '{"hidden": [32]}',
        "--recipe",
        tmp_path / "d.toml",
        "--out",
        out,
        "--json",
        "-q",
    )
    assert result.exit_code == 0, result.stderr
    r = result.json()
    for name in (
        "student.pt",
        "student.dcz",
        "student.fp32.onnx",
        "student.int8.onnx",
        "student.int8.ort",
        "student.int8.required_operators.config",
        "report.json",
        "report.md",
        "weights_histogram.png",
        "kept_per_layer.png",
    ):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    for kind in ("fp32", "int8"):
        o = r["onnx"][kind]
        assert o["path"] == f"student.{kind}.onnx"  # names in the folder
        assert o["bytes"] == (out / f"student.{kind}.onnx").stat().st_size
        assert 0.5 < o["test_accuracy"] <= 1
    i8 = r["onnx"]["int8"]
    assert {"top1_agreement", "max_abs_diff", "fp32_nodes", "top1_agreement_fp32"} <= i8.keys()
    assert i8["top1_agreement"] >= 0.95 and i8["bytes"] < r["onnx"]["fp32"]["bytes"]
    assert r["ort"] == {**r["ort"], "path": "student.int8.ort"}
    assert r["ort"]["bytes"] == (out / "student.int8.ort").stat().st_size
    assert {"nnapi", "coreml"} <= r["mobile"].keys()
    st, te = r["student"], r["teacher"]
    assert st["name"] == "mlp" and st["distilled"] and te["name"] == "lenet300"
    assert st["parameters"] * 10 < te["parameters"] and te["members"] == 1
    assert st["test_accuracy"] == r["stages"][-1]["test_accuracy"]
    assert st["dense_test_accuracy"] == r["baseline"]["test_accuracy"] > 0.5
    assert r["hint"]["loss_after"] < r["hint"]["loss_before"]
    n = 1294  # digits training images (the validation split held out)
    assert r["transfer"]["examples"] == n + round(0.5 * n) and r["transfer"]["kind"] == "mixup"
    # The INT8 file passes the checker, runs in a plain session at batch 1 and 7.
    onnx.checker.check_model(onnx.load(str(out / "student.int8.onnx")), full_check=True)
    session = ort.InferenceSession(str(out / "student.int8.onnx"))
    name = session.get_inputs()[0].name
    for batch in (1, 7):
        x = torch.rand(batch, 1, 8, 8).numpy()
        assert session.run(None, {name: x})[0].shape == (batch, 10)
    assert checkpoint.load(out / "student.pt").spec.name == "mlp"
    md = (out / "report.md").read_text()
    assert "Distilled" in md and "FitNets hint" in md and "Transfer set (mixup)" in md


def test_shrink_without_a_student_reports_the_model_as_teacher_and_student(trained):
    _, _, r = trained
    assert r["teacher"]["name"] == r["student"]["name"] == "lenet300"
    assert not r["student"]["distilled"]
    assert r["teacher"]["test_accuracy"] == r["baseline"]["test_accuracy"]
    assert r["student"]["test_accuracy"] == r["stages"][-1]["test_accuracy"]


def test_ensemble_members_must_agree(run, trained, tmp_path):
    folder, _, _ = trained
    other = tmp_path / "five.pt"
    import numpy as np

    x, y = np.random.default_rng(0).random((50, 8, 8)), (np.arange(50) // 5) % 5
    np.savez(tmp_path / "five.npz", x=x, y=y)
    assert (
        run(
            "train",
            "--model",
            "mlp",
            "--data",
            f"npz:{tmp_path / 'five.npz'}",
            "--epochs",
            "1",
            "--out",
            other,
            "-q",
        ).exit_code
        == 0
    )
    (tmp_path / "e.toml").write_text(f'[distill]\nstudent = "mlp"\nteachers = ["{other}"]\n')
    result = run(
        "shrink", folder / "lenet300.pt", "--recipe", tmp_path / "e.toml", "--out", tmp_path / "s"
    )
    assert result.exit_code == 2 and "five.pt predicts 5 classes" in result.stderr
    assert not (tmp_path / "s").exists()


def test_a_killed_runs_staging_folder_is_removed_by_the_next(tmp_path):
    """SIGKILL left `.out.xxxx/` with a partial model.dcz beside --out, for good."""
    import subprocess
    import sys

    from compresskit.compressor import pipeline

    out = tmp_path / "out"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], **_CAPTURE)
    abandoned = tmp_path / f".out.{pipeline._owner(int(dead.stdout))}.abc123"
    running = tmp_path / f".out.{pipeline._owner()}.def456"  # this process: still going
    other = tmp_path / ".out.otherhost-1.ghi789"
    for folder in (abandoned, running, other):
        folder.mkdir()
        (folder / "model.dcz").write_bytes(b"half")
    pipeline._remove_abandoned(out)
    assert not abandoned.exists() and running.exists() and other.exists()
    # holding out's lock, this host's folders are all abandoned, whatever pid they name (a
    # container's next job often has the dead one's pid); another host's are left alone
    pipeline._remove_abandoned(out, locked=True)
    assert not running.exists() and other.exists()


def test_a_second_run_into_the_same_out_is_refused_while_the_first_goes(run, tmp_path, trained):
    from compresskit.models import fileio

    folder, _, _ = trained
    out = tmp_path / "out"
    with fileio.output_lock(out):  # the first run, still going
        result = run("shrink", folder / "lenet300.pt", "--recipe", folder / "fast.toml",
                     "--out", out, "--json", "-q")  # fmt: skip
        assert result.exit_code == 2, result.stderr
        assert "another compress run" in result.json()["error"]
        trained_out = tmp_path / "m.pt"
        with fileio.output_lock(trained_out):
            again = run("train", "--model", "mlp", "--epochs", "1", "--out", trained_out, "-q")
        assert again.exit_code == 2 and "another compress run" in again.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


_CAPTURE = {"capture_output": True, "text": True, "check": True}


def test_an_int8_step_that_fails_ships_the_fp32_file_with_the_reason(
    run, tmp_path, trained, monkeypatch
):
    # ORT's quantization tools crashing on a graph (an STFT front end: a TypeError inside its
    # shape inference) threw away the whole run with exit 1, archive and FP32 file included.
    from compresskit.compressor import export

    folder, _, _ = trained

    def broken(fp32, out):
        raise TypeError("object of type 'NoneType' has no len()")

    monkeypatch.setattr(export, "preprocess", broken)
    out = tmp_path / "out"
    args = ["shrink", folder / "lenet300.pt", "--recipe", folder / "fast.toml", "--out", out]
    result = run(*args, "--json", "-q")
    assert result.exit_code == 0, result.stderr
    why = "the INT8 step failed: TypeError: object of type 'NoneType' has no len()"
    assert result.json()["int8_not_written"] == {"failed": True, "reason": why}
    assert f"warning: no INT8 file written: {why}" in result.stderr
    assert (out / "model.fp32.onnx").is_file() and (out / "model.dcz").is_file()
    assert not (out / "model.int8.onnx").exists()
    assert (
        f"**No INT8 file was written** ({why}): ship `model.fp32.onnx`."
        in (out / "report.md").read_text()
    )
    # --strict fails the run on it, nothing written
    result = run(*args[:-1], tmp_path / "strict", "--strict", "-q")
    assert result.exit_code == 1 and not (tmp_path / "strict").exists()


def test_an_ort_conversion_that_fails_costs_the_ort_file_not_the_run(
    run, tmp_path, trained, monkeypatch
):
    """A ResNet-50's INT8 .ort differed from the .onnx (0.13 > 0.066, the .onnx run on
    x86-only kernels) and the whole run, archive and sound INT8 file included, was thrown away
    after 3 minutes. The .ort goes, the rest ships; --strict fails; a full disk still fails."""
    from compresskit.compressor.export import mobile
    from compresskit.models.errors import MachineError, StageError

    folder, _, _ = trained
    why = "m.int8.onnx: the .ort answers differently from the .onnx (max |diff| 0.13 > 0.066)"

    def differs(onnx_path, out_path):
        raise StageError(why)

    monkeypatch.setattr(mobile, "to_ort", differs)
    out = tmp_path / "out"
    args = ["shrink", folder / "lenet300.pt", "--recipe", folder / "fast.toml", "--out", out]
    result = run(*args, "--json", "-q")
    assert result.exit_code == 0, result.stderr
    r = result.json()
    assert r["ort_not_written"] == {"reason": why} and "ort" not in r
    assert f"warning: no .ort file written: {why}; the .onnx files are written" in result.stderr
    assert (out / "model.dcz").is_file() and (out / "model.fp32.onnx").is_file()
    assert not list(out.glob("*.ort")) and r["mobile"]
    assert f"**No .ort file was written** ({why})" in (out / "report.md").read_text()
    assert run(*args[:-1], tmp_path / "strict", "--strict", "-q").exit_code == 1
    assert not (tmp_path / "strict").exists()

    def full(onnx_path, out_path):
        raise MachineError("cannot write model.int8.ort in X: no space left on device")

    monkeypatch.setattr(mobile, "to_ort", full)
    assert run(*args[:-1], tmp_path / "full", "-q").exit_code == 1
    assert not (tmp_path / "full").exists()


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), MemoryError()])
def test_a_full_disk_in_the_int8_step_fails_the_run_not_the_int8_file(
    run, tmp_path, trained, monkeypatch, failure
):
    """Another job filled the disk during calibration: the run shipped the FP32 file with exit
    0 ("the INT8 step failed: OSError ..."), and a CI job that wanted the INT8 file found out
    later. The machine's failures fail the run, nothing written."""
    from compresskit.compressor import export

    folder, _, _ = trained

    def full(fp32, out):
        raise failure

    monkeypatch.setattr(export, "preprocess", full)
    out = tmp_path / "out"
    result = run("shrink", folder / "lenet300.pt", "--recipe", folder / "fast.toml", "--out",
                 out, "--json", "-q")  # fmt: skip
    assert result.exit_code == 1, result.stderr
    said = "no space left on device" if isinstance(failure, OSError) else "out of memory"
    kept = tmp_path / ".out.resume"
    # on a full disk, the room the kept work takes: it may be what the run lacks
    room = f"; it takes {sum(p.stat().st_size for p in kept.iterdir()):,} bytes in {kept}"
    assert result.json()["error"] == (
        f"the INT8 step: {said} (in {tmp_path}); kept: Deep Compression (pruning, weight "
        f"sharing, Huffman) (add --resume to continue from there{room if 'space' in said else ''})"
    )
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == [".out.resume"]


def test_an_extra_teacher_of_the_users_own_code_is_built_with_consent(tmp_path, user_module):
    # It was always refused ("pass --model mynet:Net"), even with --model naming the code or
    # --trust-model: the consent never reached the recipe's extra teachers.
    import torch
    from torch import nn

    from compresskit.compressor import distill
    from compresskit.models import InputError, ModelSpec, checkpoint

    teachmod = user_module(
        "teachmod",
        """
        from torch import nn

        class Net(nn.Module):
            def __init__(self, in_shape=(1, 8, 8), num_classes=10):
                super().__init__()
                self.fc = nn.Linear(64, num_classes)

            def forward(self, x):
                return self.fc(x.flatten(1))
        """,
    )

    spec = ModelSpec("teachmod:Net", {"in_shape": [1, 8, 8], "num_classes": 10})
    net = teachmod.Net()
    checkpoint.save(tmp_path / "t2.pt", net, spec, {})
    torch.save(net.state_dict(), tmp_path / "bare.pt")
    # the fix named is one that works: --model names the first checkpoint's model
    with pytest.raises(InputError, match="names model code teachmod:Net; add --trust-model"):
        distill._extra_teacher(str(tmp_path / "t2.pt"), None, lambda name: False)
    other = ModelSpec("mlp", {"in_shape": [1, 8, 8], "num_classes": 10})
    with pytest.raises(
        InputError, match=r"bare weights, built as the first teacher's model \(mlp\)"
    ):
        distill._extra_teacher(str(tmp_path / "bare.pt"), other, lambda n: False)
    built = distill._extra_teacher(str(tmp_path / "t2.pt"), None, lambda n: n == spec.name)
    assert torch.equal(built.fc.weight, net.fc.weight)
    # the first teacher's code, already allowed, builds the same class; and weights alone
    # are built as the first teacher's model
    assert isinstance(
        distill._extra_teacher(str(tmp_path / "t2.pt"), spec, lambda n: False), nn.Module
    )
    bare = distill._extra_teacher(str(tmp_path / "bare.pt"), spec, lambda n: False)
    assert torch.equal(bare.fc.weight, net.fc.weight)


@pytest.mark.parametrize(
    ("recipe_text", "message"),
    [
        ('[distill]\nstudent = "nosuch"\nepochs = 1\n', "unknown model 'nosuch'"),
        (
            '[distill]\nstudent = "mlp"\nstudent_kwargs = {nosuch = 3}\nepochs = 1\n',
            "does not take these kwargs",
        ),
        (
            '[distill]\nstudent = "mlp"\nhint_student = "nope"\nhint_teacher = "fc1"\n',
            "the student has no layer 'nope'",
        ),
        ('[channels]\nenabled = true\nignore = ["fc9"]\n', "channels.ignore names 'fc9'"),
        ("[budget]\nmax_drop = 0.1\n", "budget.max_drop 0.1 allows less than one of the 143"),
    ],
)
def test_dry_run_refuses_what_the_run_refuses(run, trained, tmp_path, recipe_text, message):
    # A dry run passed these (exit 0) and the run refused them seconds later.
    folder, _, _ = trained
    (tmp_path / "r.toml").write_text(recipe_text)
    result = run("shrink", folder / "lenet300.pt", "--recipe", tmp_path / "r.toml", "--dry-run")
    assert result.exit_code == 2, result.output
    assert message in result.stderr


def test_dry_run_with_a_student_says_why_there_is_no_layer_plan(run, trained):
    folder, _, _ = trained
    result = run("shrink", folder / "lenet300.pt", "--student", "mlp", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "note: the layers Deep Compression prunes come from distillation's student" in (
        result.stderr
    )


def test_dry_run_plan_shows_the_layers_a_budget_leaves_fixed(run, trained, tmp_path):
    folder, _, _ = trained
    (tmp_path / "b.toml").write_text(
        "[budget]\nmax_drop = 3.0\n[prune]\nsparsity = {fc1 = 0.5, fc2 = 0.6}\n"
        "[quantize]\nbits = {fc1 = 3}\n"
    )
    result = run("shrink", folder / "lenet300.pt", "--recipe", tmp_path / "b.toml", "--dry-run")
    assert result.exit_code == 0, result.output
    rows = {line.split()[1]: line.split()[4:] for line in result.stdout.splitlines()[-3:]}
    # every layer read "searched" although the run keeps fc1 at 0.5 / 3 bits and fc2 at 0.6
    assert rows == {
        "fc1": ["3", "0.5"],
        "fc2": ["searched", "0.6"],
        "fc3": ["searched", "searched", "(max_drop)"],
    }
    # the default sparsities are searched too (they read as fixed)
    result = run("shrink", folder / "lenet300.pt", "--max-drop", "3", "--dry-run")
    rows = {line.split()[1]: line.split()[4:] for line in result.stdout.splitlines()[-3:]}
    assert all(row == ["searched", "searched", "(max_drop)"] for row in rows.values()), rows


def test_a_report_given_as_the_recipe_reruns_its_recipe(run, trained, tmp_path):
    # "unknown key 'baseline'" was all a user passing report.json back got
    folder, out, _ = trained
    result = run("shrink", folder / "lenet300.pt", "--recipe", out / "report.json", "--dry-run")
    assert result.exit_code == 0, result.output
    ran = json.loads((out / "report.json").read_text())["recipe"]
    assert recipe.resolve(tomllib.loads(result.stdout.split("\n#")[0])).to_dict() == ran


def test_a_teacher_given_twice_by_any_path_is_refused(run, trained, tmp_path):
    # the checkpoint itself as --teacher, or one file by two paths, doubled its weight and was
    # reported as an ensemble of two
    folder, _, _ = trained
    ck = folder / "lenet300.pt"
    for extra in (["--teacher", ck], ["--teacher", ck.parent / ".." / ck.parent.name / ck.name]):
        result = run("shrink", ck, "--student", "mlp", *extra, "--dry-run")
        assert result.exit_code == 2, result.output
        assert "the same file as the checkpoint being shrunk" in result.stderr
