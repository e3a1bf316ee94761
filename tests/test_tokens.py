"""Models whose one input is int64 token ids (the zoo's BERT-style `textcls`): `compress train`,
`compress shrink` (prune, share, archive, FP32 and INT8 ONNX) and `compress bench` end to end on
the built-in `tokens` data, and the one-line refusals of what compress cannot feed."""

import json
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

from compresskit.compressor import archive
from compresskit.compressor.measure import latency, variants
from compresskit.compressor.shrink import bits_equal
from compresskit.models import checkpoint, data, zoo
from compresskit.models.errors import InputError

DATA = "tokens:16:64"  # 16 ids per sequence, vocabulary 64: what the tiny textcls embeds
TINY = json.dumps({"vocab_size": 64, "dim": 16, "depth": 1, "heads": 2, "mlp": 32})
# One epoch per stage, big batches, few calibration samples, no .ort file, and no INT8 node
# search against an agreement floor: the plumbing is under test here, not the figures.
FAST = textwrap.dedent("""
    [train]
    batch_size = 128
    [prune]
    rounds = 1
    retrain_epochs = 1
    [quantize]
    finetune_epochs = 1
    [export]
    ort = false
    calibration = 64
    min_agreement = 0.0
""")


@pytest.fixture(scope="module")
def one_thread():
    # A 3.6k-parameter transformer gains nothing from a second thread, and on a busy 2-core
    # machine intra-op threads contend for the cores the other test processes hold.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def shrunk(tmp_path_factory, one_thread):
    from click.testing import CliRunner

    from compresskit.cli.main import cli

    folder = tmp_path_factory.mktemp("tokens")
    runner = CliRunner()
    ck = folder / "textcls.pt"
    args = ["--model", "textcls", "--model-kwargs", TINY, "--data", DATA, "--epochs", "1"]
    result = runner.invoke(cli, ["train", *args, "--batch-size", "64", "--out", str(ck), "-q"])
    assert result.exit_code == 0, result.output
    recipe = folder / "fast.toml"
    recipe.write_text(FAST)
    out = folder / "shrunk"
    args = ["--recipe", str(recipe), "--out", str(out), "--json", "-q"]
    result = runner.invoke(cli, ["shrink", str(ck), *args])
    assert result.exit_code == 0, result.output
    return folder, out, json.loads(result.stdout)


def test_train_writes_a_token_model(shrunk):
    folder, _, _ = shrunk
    ck = checkpoint.load(folder / "textcls.pt")
    assert ck.metadata["data"] == DATA and ck.spec.kwargs["in_shape"] == [16]
    assert ck.metadata["test_accuracy"] > 0.25  # 4 balanced classes: above chance


def test_shrink_archives_and_exports_int64_input(shrunk):
    import onnx

    _, out, report = shrunk
    assert [s["name"] for s in report["stages"]] == ["prune", "quantize", "huffman"]
    # The archive decodes to the shipped weights bit for bit (the pipeline checked it too).
    decoded = archive.read(out / "model.dcz").state_dict
    state = checkpoint.load(out / "model.pt").state_dict
    assert decoded.keys() == state.keys()
    assert all(bits_equal(decoded[k], state[k]) for k in state)
    # Every shared layer is read back from each ONNX file, MultiheadAttention's in_proj_weight
    # and the MLP's weights (stored transposed by the dynamo exporter, as val_N) included.
    full = json.loads((out / "report.json").read_text())
    # Decisions are judged on the validation split: 240 of tokens' 2,400 training sequences.
    assert {k: full["data"][k] for k in ("train", "val", "test")} == {
        "train": 2160,
        "val": 240,
        "test": 600,
    }
    assert full["data"]["decisions"].startswith("validation split, 240 samples")
    assert "2,160 train / 240 validation / 600 test" in (out / "report.md").read_text()
    shared = {r["name"] for r in full["layers"] if r.get("codebook")}
    assert any(k.endswith("in_proj_weight") for k in shared)
    for kind in ("fp32", "int8"):
        if kind in full["onnx"]:
            checks = full["onnx"][kind]["weights"]
            assert shared <= {k for k, c in checks.items() if c["found"]}, kind
            assert full["onnx"][kind]["weights_ok"], kind
    fp32 = report["onnx"]["fp32"]
    (inp,) = onnx.load(out / fp32["path"]).graph.input
    assert inp.type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert fp32["top1_agreement"] == 1.0 and fp32["max_abs_diff"] < 1e-4
    assert fp32["input"] == {
        "name": "ids",
        "type": "int64",
        "shape": ["batch", "sequence"],
        "sequence_length": 16,
        "sequence": "dynamic",
        # the vocabulary an app's tokenizer must keep to: ONNX's Gather checks no id (a
        # negative one wrapped around silently, where PyTorch raises)
        "scaling": "int64 token ids, 0 = padding; ids 0..63: the file does not check them (a "
        "negative id wraps around, -1 reads as 63; 64 or more fails), so map unknown words to "
        "an id the model knows",
    }
    assert "1 to 16 token ids per sequence" in (out / "report.md").read_text()
    # INT8: written and measured against FP32, or the report says why not.
    if "int8" in report["onnx"]:
        q = report["onnx"]["int8"]
        (inp,) = onnx.load(out / q["path"]).graph.input
        assert inp.type.tensor_type.elem_type == onnx.TensorProto.INT64
        assert {"top1_agreement", "check_agreement", "calibration"} <= q.keys()
        assert q["calibration"]["samples"] == 64
        assert q["checked_on"]["samples"] == 240 and "validation" in q["checked_on"]["source"]
        assert q["checked_on"]["split"] == "validation"
        # An attention graph quantizes its compute nodes only: the scores plus the padding mask
        # (0 or -3.4e38) stay FP32. With every op type quantized this model kept 0.756 top-1
        # agreement with all 7 nodes in INT8; with compute nodes only, 0.99.
        assert q["int8_nodes"] == q["quantizable_nodes"] == 7
        assert q["check_agreement"] >= 0.95
    else:
        assert report["int8_not_written"]["reason"]


def test_bench_runs_the_token_models(shrunk, run):
    _, out, _ = shrunk
    result = run(
        "bench", out, "--data", DATA, "--batch", "2", "--min-runs", "3", "--min-seconds", "0",
        "--providers", "torch,cpu", "--json", "-q",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = {r["model"]: r for r in result.json()["results"]}
    assert {"model.pt", "model.fp32.onnx"} <= rows.keys()
    for r in rows.values():
        assert r["test_accuracy"] is not None and r["p50_ms"] > 0
    # MACs of the PyTorch model (MultiheadAttention included) match the exported graph's.
    assert rows["model.pt"]["macs"] == rows["model.fp32.onnx"]["macs"] > 0
    assert rows["model.fp32.onnx"]["top1_agreement"] == 1.0


def test_bench_inputs_without_data_are_ids_the_model_embeds(shrunk):
    _, out, _ = shrunk
    rng = np.random.default_rng(0)
    for name in ("model.pt", "model.fp32.onnx"):
        m = variants.load(out / name)
        assert m.tokens and m.vocab == 64 and m.in_shape == (16,)
        x = latency.inputs(m, 500, None, rng)
        assert x.dtype == np.int64 and x.shape == (500, 16)
        assert x.min() >= 1 and x.max() == 63  # 0 is padding


def test_onnx_files_take_any_sequence_length_up_to_the_trained_one(shrunk):
    # A symbolic sequence axis: an app runs a 5-token query at the cost of 5 tokens, not 16.
    # The reference is the PyTorch model on the same ids cut to each length.
    import onnx

    from compresskit.compressor.export import checks

    _, out, report = shrunk
    model = checkpoint.load(out / "model.pt").build_model().eval()
    ids = data.load(DATA).x_test[:64]
    files = [out / "model.fp32.onnx"] + (
        [out / "model.int8.onnx"] if "int8" in report["onnx"] else []
    )
    for path in files:
        proto = onnx.load(str(path))
        (inp,) = proto.graph.input
        assert [d.dim_param or d.dim_value for d in inp.type.tensor_type.shape.dim] == [
            "batch",
            "sequence",
        ], path.name
        assert {p.key: p.value for p in proto.metadata_props}["sequence_length"] == "16"
    fp32 = checks.session(out / "model.fp32.onnx", optimized=True, threads=1)
    for length in (1, 5, 16):
        x = ids[:, :length]
        with torch.no_grad():
            want = model(x).numpy()
        got = fp32.run(None, {fp32.get_inputs()[0].name: x.numpy()})[0]
        assert got.shape == want.shape and np.abs(got - want).max() < 1e-4, length
    if "int8" in report["onnx"]:
        q = checks.session(out / "model.int8.onnx", optimized=True, threads=1)
        x = ids[:, :8].numpy()
        got = q.run(None, {q.get_inputs()[0].name: x})[0]
        ref = fp32.run(None, {fp32.get_inputs()[0].name: x})[0]
        assert got.shape == ref.shape and checks.agreement(got, ref) >= 0.9


def test_fixed_batch_file_fixes_the_sequence_too(shrunk, tmp_path):
    # NNAPI needs every shape fixed: the batch and the sequence, at the length trained on.
    import onnx

    from compresskit.compressor.export import mobile

    _, out, _ = shrunk
    fixed = mobile.fixed_batch(out / "model.fp32.onnx", tmp_path / "f.onnx", 2)
    (inp,) = onnx.load(str(fixed)).graph.input
    assert [d.dim_value for d in inp.type.tensor_type.shape.dim] == [2, 16]


def test_bench_feeds_shorter_sequences_and_refuses_longer_ones(shrunk, run):
    _, out, _ = shrunk
    args = ["--batch", "2", "--min-runs", "2", "--min-seconds", "0", "--json", "-q"]
    result = run("bench", out / "model.fp32.onnx", "--data", "tokens:12:64", *args)
    assert result.exit_code == 0, result.output
    (row,) = result.json()["results"]
    assert row["test_accuracy"] is not None and row["p50_ms"] > 0
    result = run("bench", out / "model.fp32.onnx", "--data", "tokens:32:64", *args)
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert "\n" not in line and "1 to 16 token ids" in line and "at most 16" in line
    # the checkpoint too, and so the whole folder: model.pt was refused as "takes inputs of
    # shape (16,)" where its ONNX files took the 12-token queries
    result = run("bench", out, "--data", "tokens:12:64", *args)
    assert result.exit_code == 0, result.stderr
    rows = {r["model"]: r for r in result.json()["results"] if r["precision"] != "bf16"}
    assert rows["model.pt"]["test_accuracy"] == rows["model.fp32.onnx"]["test_accuracy"]


def test_a_checkpoint_that_takes_only_its_own_length_is_benched_at_it():
    from compresskit.compressor.measure.variants import _takes_shorter

    assert not _takes_shorter(FlatHead(), 12)
    assert _takes_shorter(TracedLength(), 12)


class FlatHead(nn.Module):
    """Token ids whose embeddings are flattened into one Linear: only length 12 fits."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 4)
        self.head = nn.Linear(12 * 4, 3)

    def forward(self, ids):
        return self.head(self.emb(ids).flatten(1))


class TracedLength(nn.Module):
    """A forward that answers differently under export (as a traced constant would): the file
    is right at 12 tokens only."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, ids):
        scale = 12.0 if torch.compiler.is_exporting() else float(ids.shape[1])
        return self.head(self.emb(ids).sum(1) / scale)


@pytest.mark.parametrize(
    ("net", "why"),
    [(FlatHead, "takes no other length"), (TracedLength, "answers differently from the model")],
)
def test_a_model_fixed_to_its_length_exports_at_it_saying_why(net, why, tmp_path):
    import onnx

    from compresskit.compressor.export import onnxfile

    torch.manual_seed(0)
    model, ids = net().eval(), torch.randint(1, 40, (2, 12))
    path = onnxfile.export_onnx(model, ids, tmp_path / "m.onnx", onnxfile.ExportConfig())
    proto = onnx.load(str(path))
    (inp,) = proto.graph.input
    assert [d.dim_param or d.dim_value for d in inp.type.tensor_type.shape.dim] == ["batch", 12]
    assert "sequence length fixed at 12" in proto.doc_string
    info = onnxfile.input_info(proto)
    assert info["sequence"] == "fixed" and info["sequence_length"] == 12
    assert why in info["fixed_why"]
    got = onnxfile.predict(path, ids.numpy())
    with torch.no_grad():
        assert np.abs(got - model(ids).numpy()).max() < 1e-5


def test_symbolic_dimensions_are_evaluated_never_executed():
    from compresskit.compressor.export.checks import _evaluate

    names = {"sequence": 16, "batch": 1}
    assert _evaluate("sequence", names) == 16
    assert _evaluate("Min(33, sequence + 1)", names) == 17
    assert _evaluate("4*batch", names) == 4
    assert _evaluate("floor(sequence/3)", names) == 5
    for bad in ("unk__55", "__import__('os').getpid()", "sequence.real", "", "9" * 300):
        assert _evaluate(bad, names) is None, bad


def test_npz_named_after_the_forward_argument_reaches_shrink_and_bench(shrunk, run, tmp_path):
    # textcls's forward takes `ids`: an npz holding `ids` (not `x` or `input_ids`) is its input
    # under train, shrink and bench alike. Before, shrink and bench read it as "lacks array x".
    folder, _, _ = shrunk
    ids, y = data.token_sequences(200, 16, 64)
    npz = tmp_path / "mine.npz"
    np.savez(npz, ids=ids, y=y)
    recipe = tmp_path / "dense.toml"  # the data path is under test: no compression stages
    recipe.write_text(
        "[prune]\nenabled = false\n[quantize]\nenabled = false\n[huffman]\nenabled = false\n"
        "[export]\nint8 = false\nort = false\n"
    )
    out = tmp_path / "out"
    result = run(
        "shrink", folder / "textcls.pt", "--data", f"npz:{npz}", "--recipe", recipe,
        "--out", out, "--json", "-q",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.json()["baseline"]["test_accuracy"] > 0.25  # 4 classes: the ids were read
    result = run(
        "bench", folder / "textcls.pt", "--data", f"npz:{npz}", "--batch", "2",
        "--min-runs", "2", "--min-seconds", "0", "--providers", "torch", "--json", "-q",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    # fp32 (and bf16 autocast where the CPU has native bf16: this one may)
    rows = result.json()["results"]
    assert [r["precision"] for r in rows][:1] == ["fp32"] and len(rows) <= 2
    assert all(r["test_accuracy"] > 0.25 for r in rows)
    # the ONNX file alone: its input is named `ids` too, and that names the array
    result = run(
        "bench", out / "model.fp32.onnx", "--data", f"npz:{npz}", "--batch", "2",
        "--min-runs", "2", "--min-seconds", "0", "--json", "-q",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert all(r["test_accuracy"] > 0.25 for r in result.json()["results"])


# --- refusals: one line each ------------------------------------------------------------------


def test_npz_second_input_array_is_refused(tmp_path):
    ids, y = data.token_sequences(20, 12, 40)
    path = tmp_path / "bert.npz"
    np.savez(path, input_ids=ids, attention_mask=(ids != 0).astype(np.float32), y=y)
    with pytest.raises(InputError) as e:
        data.load(f"npz:{path}")
    msg = str(e.value)
    assert "\n" not in msg and "attention_mask" in msg and "one input tensor" in msg
    assert "padding id" in msg
    np.savez(path, input_ids=ids, y=y)  # the ids alone load, unscaled
    d = data.load(f"npz:{path}")
    assert d.is_tokens and d.x_train.dtype == torch.int64 and d.vocab == int(ids.max()) + 1
    np.savez(path, ids=ids, y=y)  # named after the model's forward argument
    assert data.load(f"npz:{path}", input_name="ids").is_tokens
    with pytest.raises(InputError, match="lacks array"):
        data.load(f"npz:{path}")


class TwoInputs(nn.Module):
    """A model whose forward needs ids and a mask: compress cannot feed it."""

    def __init__(self, in_shape=(16,), num_classes=4) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 8)
        self.head = nn.Linear(8, num_classes)

    def forward(self, input_ids, attention_mask):
        return self.head((self.emb(input_ids) * attention_mask[..., None]).mean(1))


def test_two_argument_forward_is_refused(run, tmp_path):
    result = run(
        "train", "--model", "tests.test_tokens:TwoInputs", "--data", DATA, "--epochs", "1",
        "--out", tmp_path / "two.pt", "-q",
    )  # fmt: skip
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert "\n" not in line and "input_ids, attention_mask" in line and "one input" in line
    with pytest.raises(InputError, match="input_ids, attention_mask"):
        data.check_fits(TwoInputs(), data.load(DATA), "TwoInputs")


def test_mixup_on_token_ids_is_refused(shrunk, run):
    folder, _, _ = shrunk
    recipe = folder / "mixup.toml"
    recipe.write_text('[distill]\nstudent = "textcls"\ntransfer = "mixup"\n')
    result = run("shrink", folder / "textcls.pt", "--recipe", recipe, "--out", folder / "mx", "-q")
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert "\n" not in line and "mixup" in line and "token ids" in line
    assert not (folder / "mx").exists()


def test_calibration_file_of_token_ids(tmp_path):
    from compresskit.compressor import pipeline, recipe

    ds = data.load(DATA)
    model = zoo.tiny("textcls", num_classes=4)  # embeds ids 0..63
    r = recipe.resolve({"export": {"calibration_data": str(tmp_path / "c.npy")}})
    np.save(tmp_path / "c.npy", ds.x_train[:8].numpy().astype(np.int32))
    calib = pipeline.preflight(r, ds, model)
    assert calib.dtype == np.int64 and np.array_equal(calib, ds.x_train[:8].numpy())
    np.save(tmp_path / "c.npy", ds.x_train[:8].numpy().astype(np.float32))  # ids as floats
    with pytest.raises(InputError, match="reads token ids: needs an integer array"):
        pipeline.preflight(r, ds, model)
    np.save(tmp_path / "c.npy", np.full((8, 16), 99))
    with pytest.raises(InputError, match="token ids reach 99, the model embeds 64 ids"):
        pipeline.preflight(r, ds, model)


def test_quantization_preprocessing_leaves_nothing_in_the_working_folder(tmp_path, monkeypatch):
    # ORT's symbolic shape inference gives up on the dynamic-sequence graph before it merges
    # symbols, and saved sym_shape_infer_temp.onnx and a UUID .data file where it ran.
    from compresskit.compressor.export import onnxfile

    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    model = zoo.tiny("textcls", num_classes=4).eval()
    ids = torch.randint(1, 64, (2, 16))
    fp32 = onnxfile.export_onnx(model, ids, tmp_path / "m.onnx", onnxfile.ExportConfig())
    onnxfile.preprocess(fp32, tmp_path / "p.onnx")
    assert (tmp_path / "p.onnx").is_file() and list(work.iterdir()) == []
