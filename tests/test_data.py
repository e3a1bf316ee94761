import re

import numpy as np
import pytest
import torch

from compresskit.models import InputError, ModelSpec, build
from compresskit.models import data as D
from compresskit.models.data import check_fits, load, read_idx
from tests.conftest import blobs, write_idx


def test_digits_default_split_is_fixed_and_scaled():
    a, b = load("digits"), load("digits")
    assert a.in_shape == (1, 8, 8) and a.num_classes == 10
    # 1,437 training images by the stratified split; every 10th of them held out for validation
    assert (len(a.y_train), len(a.y_val), len(a.y_test)) == (1294, 143, 360)
    assert torch.equal(a.x_test, b.x_test) and torch.equal(a.y_train, b.y_train)
    assert a.x_train.dtype == torch.float32 and a.x_train.min() >= 0.0 and a.x_train.max() <= 1.0
    # Stratified: every class is in the test split in about its share.
    assert torch.bincount(a.y_test, minlength=10).min() >= 30


def test_digits_resized_for_lenet5():
    d = load("digits:28")
    assert d.in_shape == (1, 28, 28) and len(d.y_test) == 360
    assert torch.equal(d.y_test, load("digits").y_test)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_round_trip(tmp_path, gz):
    x = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    path = write_idx(tmp_path / "a-idx3-ubyte", x, gz=gz)
    assert np.array_equal(read_idx(path, 3), x)


def test_mnist_t10k_only_uses_documented_split(mnist_dir):
    d = load(f"mnist:{mnist_dir}")
    x = read_idx(mnist_dir / "t10k-images-idx3-ubyte.gz", 3)
    y = read_idx(mnist_dir / "t10k-labels-idx1-ubyte.gz", 1)
    # image i is a test image when i % 5 == 4
    assert (len(d.y_train), len(d.y_val), len(d.y_test)) == (36, 4, 10)
    assert torch.equal(d.y_test, torch.from_numpy(y[4::5].astype(np.int64)))
    assert torch.allclose(d.x_test[:, 0], torch.from_numpy(x[4::5] / 255.0).float())
    assert d.in_shape == (1, 28, 28) and d.num_classes == 10


def test_mnist_with_train_files_uses_them(mnist_dir):
    x, y = blobs(20, side=28, classes=10, seed=1)
    write_idx(mnist_dir / "train-images-idx3-ubyte", x)  # raw, next to gzipped t10k
    write_idx(mnist_dir / "train-labels-idx1-ubyte", y)
    d = load(f"mnist:{mnist_dir}")
    assert (len(d.y_train), len(d.y_val), len(d.y_test)) == (18, 2, 50)


def test_npz_with_and_without_test_arrays(tmp_path, npz_file):
    d = load(f"npz:{npz_file}")
    assert (len(d.y_train), len(d.y_val), len(d.y_test)) == (216, 24, 60) and d.num_classes == 3
    x, y = blobs(30)
    p = tmp_path / "split.npz"
    np.savez(
        p, x=x.astype(np.float32) / 255, y=y, x_test=x[:5].astype(np.float32) / 255, y_test=y[:5]
    )
    d = load(f"npz:{p}")
    assert (len(d.y_train), len(d.y_val), len(d.y_test)) == (27, 3, 5)
    flat = tmp_path / "flat.npz"
    np.savez(flat, x=np.random.rand(20, 6).astype(np.float32), y=np.arange(20) % 2)
    assert load(f"npz:{flat}").in_shape == (6,)


def _npz(tmp_path, **arrays):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    return f"npz:{path}"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda t: "mnist:" + str(t / "nowhere"), "does not exist"),
        (lambda t: "mnist:~nosuchuser-compress/x", "no such user"),
        (lambda t: "npz:" + str(t / "nothing.npz"), "does not exist"),
        (lambda t: "imagenet", "unknown data spec"),
        (lambda t: "digits:3", "side length"),
        (
            lambda t: _npz(t, images=np.zeros((4, 8, 8)), y=np.zeros(4)),
            "lacks array.*x.*has: images, y",
        ),
        (
            lambda t: _npz(t, x=np.zeros((10, 8, 8)), y=np.array([0, 1] * 4 + [2, -1])),
            "labels out of range",
        ),
        (
            lambda t: _npz(
                t,
                x=np.zeros((10, 8, 8)),
                y=np.arange(10) % 2,
                x_test=np.zeros((5, 8, 8)),
                y_test=np.full(5, 7),
            ),
            "test labels out of range",
        ),
        (
            lambda t: _npz(t, x=np.zeros((10, 8, 8)), y=np.arange(10) % 3 * 2),
            "class 1, 3 never occurs",
        ),
        (lambda t: _npz(t, x=np.zeros((10, 8, 8)), y=np.arange(10) + 2**40), "K <= 100000"),
        (lambda t: _npz(t, x=np.zeros((10, 8, 8, 3)), y=np.arange(10) % 2), "channels-last"),
        (
            lambda t: _npz(t, x=np.full((10, 8, 8), -5, np.int16), y=np.arange(10) % 2),
            r"int16 values in \[-5, -5\]; signed integers are read as 8-bit pixels.*x / 32768",
        ),
        (lambda t: "mnist:", "needs a path"),
        (lambda t: _npz(t, x=np.full((10, 8, 8), np.nan), y=np.zeros(10)), "NaN"),
        (lambda t: _npz(t, x=np.zeros((0, 8, 8)), y=np.zeros(0)), "empty"),
        (lambda t: _npz(t, x=np.zeros((10,)), y=np.zeros(10)), r"shape \(10,\)"),
        (
            lambda t: _npz(t, x=np.zeros((10, 8, 8)), y=np.zeros(9)),
            "x has 10 images but y has 9 labels",
        ),
        (
            # a regression target reads as a task compress does not do, not as "round them"
            lambda t: _npz(t, x=np.zeros((10, 8, 8)), y=np.full(10, 0.5)),
            "whole numbers, one class id per sample; compress trains single-label classifiers "
            r"\(regression, multi-label and per-pixel targets are not supported\)",
        ),
        (
            lambda t: _npz(t, x=np.zeros((10, 8, 8)), y=np.zeros((10, 8, 8), np.int64)),
            r"labels y must be 1-D, one class id per sample, got shape \(10, 8, 8\); compress "
            "trains single-label classifiers",
        ),
        (
            lambda t: _npz(t, x=np.zeros((10, 8, 8)), y=np.zeros(10), x_test=np.zeros((3, 8, 8))),
            "both x_test and y_test",
        ),
    ],
)
def test_bad_data_gives_one_line_naming_the_problem(tmp_path, make, message):
    with pytest.raises(InputError, match=message) as info:
        load(make(tmp_path))
    assert "\n" not in str(info.value)


def test_npz_that_is_not_a_zip(tmp_path):
    (tmp_path / "t.npz").write_text("hello")
    with pytest.raises(InputError, match="not an .npz file"):
        load(f"npz:{tmp_path / 't.npz'}")


def test_idx_wrong_magic(mnist_dir):
    (mnist_dir / "t10k-labels-idx1-ubyte.gz").write_bytes(b"\x00\x00\x08\x03" + bytes(16))
    with pytest.raises(InputError, match="not an IDX file of rank 1"):
        load(f"mnist:{mnist_dir}")


@pytest.mark.parametrize("cut", [3, 10, 1000])
def test_idx_truncated(tmp_path, cut):
    x, y = blobs(5, side=28)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", y)
    raw = write_idx(tmp_path / "full", x).read_bytes()
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(raw[:cut])
    with pytest.raises(InputError, match="t10k-images-idx3-ubyte: (truncated|not an IDX)"):
        load(f"mnist:{tmp_path}")


def test_truncated_gzip(mnist_dir):
    p = mnist_dir / "t10k-images-idx3-ubyte.gz"
    p.write_bytes(p.read_bytes()[:200])
    with pytest.raises(InputError, match="cannot read"):
        load(f"mnist:{mnist_dir}")


def test_mnist_missing_labels_file(mnist_dir):
    (mnist_dir / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(InputError, match="t10k-labels-idx1-ubyte.*missing"):
        load(f"mnist:{mnist_dir}")


def test_mnist_count_mismatch(mnist_dir):
    write_idx(mnist_dir / "t10k-labels-idx1-ubyte.gz", np.zeros(7, np.uint8), gz=True)
    with pytest.raises(InputError, match="50 images.*7 labels"):
        load(f"mnist:{mnist_dir}")


def test_images_of_wrong_shape_for_model(mnist_dir):
    data = load(f"mnist:{mnist_dir}")  # 28x28
    model = build(ModelSpec("lenet5", {"in_shape": [1, 8, 8]}))
    with pytest.raises(InputError, match=r"shape \(1, 28, 28\).*built for \(1, 8, 8\)"):
        check_fits(model, data, "lenet5")


def test_more_classes_than_the_model_predicts(mnist_dir):
    data = load(f"mnist:{mnist_dir}")
    model = build(ModelSpec("mlp", {"in_shape": [1, 28, 28], "num_classes": 5}))
    with pytest.raises(InputError, match="labels reach 9 but model mlp predicts 5"):
        check_fits(model, data, "mlp")


def test_the_training_mode_probe_leaves_statistics_and_the_generator_as_they_were():
    """check_fits runs the model in training mode (an auxiliary head shows only there): a
    BatchNorm's running averages and torch's generator (dropout) are as before, and so is the
    mode the model came in."""
    data = load("digits")
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(64, 16), torch.nn.BatchNorm1d(16),
        torch.nn.Dropout(0.5), torch.nn.Linear(16, 10),
    )  # fmt: skip
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    check_fits(model, data, "net")
    assert torch.equal(torch.rand(3), expected)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert int(model[2].num_batches_tracked) == 0 and model.training
    model.eval()
    check_fits(model, data, "net")
    assert not model.training


def test_flat_features_reach_the_model_as_given(tmp_path):
    """(N, F) features reach a model as (N, F): they went in as (N, 1, 1, F) before, so a
    model whose first layer is a Linear returned (2, 1, 1, classes) and the exported file took
    a rank-4 input an app's feature vector did not fit."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 20)).astype("float32")
    np.savez(tmp_path / "f.npz", x=x, y=np.arange(40) % 3)
    data = load(f"npz:{tmp_path / 'f.npz'}")
    assert data.in_shape == (20,) and torch.equal(data.x_train[0], torch.from_numpy(x[0]))
    check_fits(torch.nn.Sequential(torch.nn.Linear(20, 3)), data, "mine")
    check_fits(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(20, 3)), data, "mine")
    from compresskit.models import zoo

    before = zoo.build(zoo.resolve_spec("mlp", {}, (1, 1, 20), 3))  # trained on the old layout
    with pytest.raises(InputError, match=r"as \(N, 1, 1, F\) before .* train the model again"):
        check_fits(before, data, "mlp")
    # A zoo model built for the data fits it (it was built for (1, 1, 20), then refused as
    # "trained on the old layout" on a fresh run), and one that convolves says it cannot.
    for name in ("mlp", "lenet300"):
        fresh = zoo.build(zoo.resolve_spec(name, {}, data.in_shape, 3))
        assert fresh.in_shape == (20,)
        check_fits(fresh, data, name)
    with pytest.raises(InputError, match=r"LeNet5 convolves images .* \(mlp, lenet300\)"):
        zoo.build(zoo.resolve_spec("lenet5", {}, data.in_shape, 3))


def test_the_files_metadata_counts_the_models_classes_not_the_datas():
    # a 10-class model shrunk on 5-class data answers 10 logits: the files said "0..4"
    from compresskit.compressor import pipeline

    data = D.Dataset.from_arrays(np.zeros((50, 6), np.float32), np.arange(50) % 5)
    model = torch.nn.Linear(6, 10).train()
    meta = pipeline.app_metadata(model, data)
    assert meta["compress.output"].startswith("logits, one per class 0..9")
    assert "(the data used here has classes 0..4)" in meta["compress.output"]
    assert meta["compress.input"] == "the values as stored (float32, no scaling)"
    assert model.training  # left as it was


def test_a_test_split_of_single_sample_classes_says_why_it_is_empty():
    x, y = np.zeros((40, 3), np.float32), np.arange(40)
    with pytest.raises(InputError, match="no class has a second sample to hold out"):
        D.Dataset.from_arrays(x, y)


class _LastStep(torch.nn.Module):
    """An LSTM classifier over (N, T, F), reading x[:, 0] when told its input is (N, 1, T, F)."""

    def __init__(self, squeeze: bool):
        super().__init__()
        self.squeeze = squeeze
        self.rnn = torch.nn.LSTM(5, 4, batch_first=True)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        out, _ = self.rnn(x[:, 0] if self.squeeze else x)
        return self.head(out[:, -1])


def test_a_model_of_sequences_is_told_how_they_arrive(tmp_path):
    """A 3-D npz x (N, T, F) reaches a model as (N, 1, T, F); an LSTM failed on it with
    torch's "input.size(-1) must be equal to input_size" and no word on the layout."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 7, 5)).astype("float32")
    np.savez(tmp_path / "s.npz", x=x, y=np.arange(40) % 3)
    data = load(f"npz:{tmp_path / 's.npz'}")
    assert data.in_shape == (1, 7, 5)
    with pytest.raises(InputError, match=r"as \(N, 1, 7, 5\): a model of sequences begins"):
        check_fits(_LastStep(squeeze=False), data, "mine")
    check_fits(_LastStep(squeeze=True), data, "mine")


class _Conv1d(torch.nn.Module):
    """A keyword-spotting style Conv1d over (N, 1, L) audio."""

    def __init__(self, squeeze: bool):
        super().__init__()
        self.squeeze = squeeze
        self.conv = torch.nn.Conv1d(1, 4, 5)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.conv(x[:, 0] if self.squeeze else x).mean(-1))


def test_a_conv1d_model_of_signals_and_arrays_from_python_are_told_how_they_arrive(tmp_path):
    # (N, 1, L) audio arrives as (N, 1, 1, L): a hint naming only x.flatten(1) broke a
    # Conv1d; arrays given in Python got no hint at all.
    from compresskit.models.data import from_arrays

    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 1, 64)).astype("float32")
    np.savez(tmp_path / "a.npz", x=x, y=np.arange(40) % 3)
    for data in (load(f"npz:{tmp_path / 'a.npz'}"), from_arrays(x, np.arange(40) % 3)):
        assert data.in_shape == (1, 1, 64)
        with pytest.raises(InputError) as e:
            check_fits(_Conv1d(squeeze=False), data, "kws")
        msg = str(e.value)
        assert "inputs of shape (1, 1, 64)" in msg and "images" not in msg
        assert "a Conv1d or recurrent model begins forward with x = x[:, 0]" in msg
        assert "\n" not in msg
        check_fits(_Conv1d(squeeze=True), data, "kws")
    seqs = from_arrays(rng.normal(size=(40, 7, 5)).astype("float32"), np.arange(40) % 3)
    with pytest.raises(InputError, match="a model of sequences begins forward with x = x"):
        check_fits(_LastStep(squeeze=False), seqs, "mine")


def test_built_in_images_get_no_sequence_hint(tmp_path):
    data = load("digits")
    with pytest.raises(InputError) as e:
        check_fits(torch.nn.Sequential(torch.nn.Linear(3, 2)), data, "mine")
    assert "sequences" not in str(e.value)


def test_integer_features_given_in_python_are_told_how_they_read():
    # an npz's integer x is pixels, Python's integer (N, L) x token ids: a features model got
    # "mat1 and mat2 must have the same dtype" and "give it float inputs", not how
    from compresskit.models.data import from_arrays

    counts = np.random.default_rng(0).integers(0, 20, size=(40, 20))
    with pytest.raises(InputError, match=r"pass x\.astype\(numpy\.float32\) for features"):
        check_fits(torch.nn.Linear(20, 3), from_arrays(counts, np.arange(40) % 3), "mine")


def test_float_token_ids_from_python_are_told_to_be_integers():
    # "reads token ids but --data arrays gives images": a float (N, 24) array is not images
    from compresskit.models.data import check_kind, from_arrays

    ids = from_arrays(np.ones((40, 24), np.float32), np.arange(40) % 2)
    with pytest.raises(InputError, match=r"gives float arrays .* pass x\.astype\(numpy\.int64\)"):
        check_kind("textcls", ids)


def test_token_ids_stored_as_an_npzs_x_are_told_to_go_in_input_ids(tmp_path):
    # they were told to store them as int64, which they already were
    from compresskit.models.data import check_kind

    np.savez(tmp_path / "t.npz", x=np.ones((40, 24), np.int64), y=np.arange(40) % 2)
    with pytest.raises(InputError, match=r"integers as 8-bit pixels; store token ids .* input_ids"):
        check_kind("textcls", load(f"npz:{tmp_path / 't.npz'}"))
    np.savez(tmp_path / "big.npz", x=np.full((40, 24), 300, np.int64), y=np.arange(40) % 2)
    with pytest.raises(InputError, match="token ids as int64 in an array named input_ids"):
        load(f"npz:{tmp_path / 'big.npz'}")


def test_a_one_by_one_convolution_head_is_told_to_flatten():
    # bench scores an (N, C, 1, 1) head's files; shrink said only "(batch, classes)"
    data = load("digits")
    head = torch.nn.Sequential(torch.nn.Conv2d(1, 10, 8))  # 8x8 digits -> (N, 10, 1, 1)
    with pytest.raises(InputError, match=r"returns \(2, 10, 1, 1\).* end forward with \.flatten"):
        check_fits(head, data, "mine")
    check_fits(torch.nn.Sequential(torch.nn.Conv2d(1, 10, 8), torch.nn.Flatten()), data, "mine")


# --- token ids ------------------------------------------------------------------------------


def test_tokens_spec_is_fixed_padded_and_labelled_by_keywords():
    a, b = load("tokens"), load("tokens")
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert a.is_tokens and a.x_train.dtype == torch.int64 and a.in_shape == (32,)
    assert (len(a.y_train), len(a.y_val), len(a.y_test)) == (2160, 240, 600) and a.num_classes == 4
    assert a.vocab == 1000 and a.describe().endswith("32 token ids (< 1000), 4 classes")
    x = torch.cat([a.x_train, a.x_val, a.x_test])
    pad = x == 0  # padding only at the end, after at least half of the sequence
    assert torch.equal(pad, pad.cummax(1).values) and int(pad.sum(1).max()) <= 16
    # A sequence's class is the keyword group (ids 1+4k .. 4+4k) it holds most often.
    counts = torch.stack([((x >= 1 + 4 * k) & (x <= 4 + 4 * k)).sum(1) for k in range(4)], 1)
    assert torch.equal(counts.argmax(1), torch.cat([a.y_train, a.y_val, a.y_test]))
    assert torch.bincount(a.y_train).min() > 450  # balanced
    short = load("tokens:12:32")
    assert short.in_shape == (12,) and short.vocab <= 32 and not load("digits").is_tokens


@pytest.mark.parametrize("spec", ["tokens:8", "tokens:16:20", "tokens:x", "tokens:16:64:3"])
def test_tokens_spec_out_of_range(spec):
    with pytest.raises(InputError, match=r"tokens\[:L\[:V\]\].*e\.g\. tokens:16:64"):
        load(spec)


def test_npz_input_ids_are_token_ids_not_pixels(tmp_path):
    ids = np.array([[5, 7, 0, 0], [9, 3, 2, 0]] * 10, dtype=np.int32)
    y = np.arange(20) % 2
    p = tmp_path / "ids.npz"
    np.savez(p, input_ids=ids, y=y, input_ids_test=ids[:4], y_test=y[:4])
    d = load(f"npz:{p}")
    assert d.is_tokens and d.x_train.dtype == torch.int64 and d.in_shape == (4,)
    assert torch.equal(d.x_test, torch.from_numpy(ids[:4]).long()) and d.vocab == 10
    assert "4 token ids (< 10)" in d.describe()
    # x keeps the image rule: integer pixels scaled to [0, 1]
    np.savez(p, x=ids.astype(np.uint8), y=y)
    assert load(f"npz:{p}").x_train.dtype == torch.float32


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"input_ids": np.zeros((10, 4), np.float32)}, "input_ids holds integer token ids"),
        ({"input_ids": np.zeros((10, 2, 2), np.int64)}, r"use \(N, L\)"),
        ({"input_ids": np.full((10, 4), -1, np.int64)}, "ids are 0 or more"),
        ({"x": np.zeros((10, 4)), "input_ids": np.zeros((10, 4), int)}, "one input tensor"),
        ({"input_ids": np.ones((10, 4), int), "token_type_ids": np.zeros((10, 4), int)}, "token_"),
    ],
)
def test_npz_token_arrays_refused(tmp_path, arrays, message):
    p = tmp_path / "bad.npz"
    np.savez(p, y=np.arange(10) % 2, **arrays)
    with pytest.raises(InputError, match=message) as info:
        load(f"npz:{p}")
    assert "\n" not in str(info.value)


def test_token_ids_beyond_the_models_vocabulary():
    data = load("tokens:16:64")
    small = build(ModelSpec("textcls", {"in_shape": [16], "num_classes": 4, "vocab_size": 32}))
    with pytest.raises(InputError, match="token ids reach 63 but model textcls embeds 32 ids"):
        check_fits(small, data, "textcls")
    with pytest.raises(InputError, match="build it with vocab_size >= 64"):
        check_fits(small, data, "textcls")

    class Mine(torch.nn.Module):  # a user's model names its argument its own way
        def __init__(self, vocab=32):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, 4)
            self.head = torch.nn.Linear(4, 4)

        def forward(self, ids):
            return self.head(self.emb(ids).mean(1))

    with pytest.raises(InputError, match="build it with vocab >= 64"):
        check_fits(Mine(), data, "mine:Mine")
    images = build(ModelSpec("mlp", {"in_shape": [1, 1, 16], "num_classes": 4}))
    with pytest.raises(InputError, match="no nn.Embedding"):
        check_fits(images, data, "mlp")


# --- the validation split ---------------------------------------------------------------------


def test_validation_split_never_overlaps_train_or_test(tmp_path):
    # Each sample's features hold its own index, so every split says which samples it got.
    n = 500
    x = np.repeat(np.arange(n, dtype=np.float32)[:, None], 3, axis=1)
    d = load(_npz(tmp_path, x=x, y=np.arange(n) % 4))
    ids = {k: set(getattr(d, f"x_{k}")[:, 0].long().tolist()) for k in ("train", "val", "test")}
    assert not ids["val"] & ids["train"] and not ids["val"] & ids["test"]
    assert not ids["train"] & ids["test"] and set().union(*ids.values()) == set(range(n))
    y = [i % 4 for i in range(n)]
    assert ids["test"] == _every_by_class(list(range(n)), y, 5)
    train_order = [i for i in range(n) if i not in ids["test"]]  # the training split, in order
    assert ids["val"] == _every_by_class(train_order, [y[i] for i in train_order], 10)
    assert d.has_val and d.decision_split()[0] is d.x_val


def _every_by_class(items, labels, every):
    """The documented rule, spelled out: order the samples by class (each class's in data
    order), take every `every`-th, a class's second in place of its first."""
    ranked = sorted(range(len(items)), key=lambda i: (labels[i], i))
    picked = set()
    for p in range(every - 1, len(ranked), every):
        if p > 0 and labels[ranked[p]] == labels[ranked[p - 1]]:
            picked.add(items[ranked[p]])
        elif p + 1 < len(ranked) and labels[ranked[p + 1]] == labels[ranked[p]]:
            picked.add(items[ranked[p + 1]])  # a class's first stays; its second goes instead
    return picked


def test_each_data_spec_says_how_a_raw_sample_became_the_input(tmp_path):
    # the exported files carry this, so an app feeds what the model was trained on
    assert "divided by 16" in load("digits").scaling
    assert "resized to 28x28" in load("digits:28").scaling
    assert load("tokens").scaling == "int64 token ids, 0 = padding"
    y = np.arange(40) % 2
    cases = [
        (np.zeros((40, 4, 4), np.uint8), "uint8 values divided by 255: float32 in [0, 1]"),
        (np.zeros((40, 4, 4), np.uint16), "uint16 values divided by 65535"),
        (np.zeros((40, 6), np.float64), "the values as stored (float32, no scaling)"),
        (np.zeros((40, 4, 4), np.int32), "8-bit pixel values (0..255) divided by 255"),
    ]
    for x, want in cases:
        assert want in load(_npz(tmp_path, x=x, y=y)).scaling
        assert want in D.Dataset.from_arrays(x, y).scaling
    ids = np.ones((40, 5), np.int64)
    assert load(_npz(tmp_path, input_ids=ids, y=y)).scaling == "token ids as stored (int64)"
    assert D.Dataset.from_arrays(ids, y).scaling == "token ids as stored (int64)"


def test_a_users_data_whose_labels_cycle_trains_and_tests_on_every_class(tmp_path):
    # Labels 0..9 in turn: by position alone, every 5th sample would put all of classes 4
    # and 9 in test, none in training ("class 4 never occurs"), or, with num_classes=10,
    # silently test a model only on classes it never saw.
    x, y = np.random.default_rng(0).random((100, 6), dtype=np.float32), np.arange(100) % 10
    for d in (
        D.Dataset.from_arrays(x, y),
        D.Dataset.from_arrays(x, y, num_classes=10),
        load(_npz(tmp_path, x=x, y=y)),
    ):
        assert np.bincount(d.y_test.numpy()).tolist() == [2] * 10
        assert np.bincount(d.y_train.numpy(), minlength=10).min() >= 7
        assert len(d.y_val) == 8  # a tenth of the 80 training samples, across classes
    # a class with a single sample stays in training
    y1 = np.r_[np.zeros(9, dtype=np.int64), [1]]
    d = D.Dataset.from_arrays(np.ones((10, 2), dtype=np.float32), y1)
    assert 1 in d.y_train.tolist() and d.y_test.tolist() == [0]


def test_digits_validation_split_is_every_tenth_stratified_training_image():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    y = load_digits().target
    idx_train, idx_test = train_test_split(
        np.arange(len(y)), test_size=0.2, random_state=0, stratify=y
    )
    d = load("digits")
    assert torch.equal(d.y_val, torch.from_numpy(y[idx_train[9::10]]))
    assert torch.equal(d.y_train, torch.from_numpy(np.delete(y[idx_train], np.s_[9::10])))
    assert not set(idx_train[9::10]) & set(idx_test)
    assert torch.bincount(d.y_val, minlength=10).min() >= 10  # every class validated


def test_npz_validation_arrays_are_used_as_given(tmp_path):
    x, y = blobs(40)
    d = load(_npz(tmp_path, x=x, y=y, x_val=x[:7], y_val=y[:7], x_test=x[:5], y_test=y[:5]))
    assert (len(d.y_train), len(d.y_val), len(d.y_test)) == (40, 7, 5)  # all of x trains
    assert torch.equal(d.y_val, torch.from_numpy(y[:7].astype(np.int64)))
    ids = np.arange(30)
    p = _npz(
        tmp_path,
        input_ids=ids.reshape(10, 3) + 1,
        y=ids[:10] % 2,
        input_ids_val=[[9, 99, 5]],
        y_val=[1],
    )
    assert load(p).vocab == 100  # the validation ids count toward the vocabulary


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({"x_val": "x"}, "needs both x_val and y_val"),
        ({"y_val": "y"}, "needs both x_val and y_val"),
        ({"x_val": "small", "y_val": "y"}, r"but val images \(1, 4, 4\)"),
        ({"x_val": "x", "y_val": "bad"}, "val labels out of range"),
    ],
)
def test_npz_bad_validation_arrays(tmp_path, arrays, message):
    x, y = blobs(30)
    given = {"x": x, "y": y, "small": x[:, :4, :4], "bad": y + 7}
    p = _npz(tmp_path, x=x, y=y, **{k: given[v] for k, v in arrays.items()})
    with pytest.raises(InputError, match=message):
        load(p)


def test_too_little_data_keeps_no_validation_split_and_says_so(tmp_path):
    x, y = blobs(20)  # 16 training samples after every 5th goes to test
    d = load(_npz(tmp_path, x=x, y=y))
    assert (len(d.y_train), len(d.y_val), len(d.y_test)) == (16, 0, 4) and not d.has_val
    assert d.decision_split()[0] is d.x_train
    assert "too few to hold out a validation split (needs 20)" in d.split_note
    assert "16 train / 0 val / 4 test" in d.describe()


def test_an_archive_records_data_by_name(tmp_path):
    from compresskit.models.data import shipped_spec

    assert shipped_spec(f"npz:{tmp_path / 'a' / 'train.npz'}") == "npz:train.npz"
    assert shipped_spec(f"mnist:{tmp_path / 'mnist'}/") == "mnist:mnist"
    assert shipped_spec("digits") == "digits" and shipped_spec("tokens:16:64") == "tokens:16:64"
    assert shipped_spec(None) is None


def _parts(n=300, classes=10):
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(n, 1, 8, 8, generator=g), torch.arange(n) % classes
    return x, y


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"y_train": torch.arange(150) % 10}, "train split: 200 inputs but 150 labels"),
        ({"y_train": (torch.arange(200) % 10).float()}, "labels are int64 (N,) class numbers"),
        ({"x_train": np.zeros((200, 1, 8, 8), np.float32)}, "not a torch.Tensor; build it with"),
        ({"num_classes": 5}, "labels reach [0, 9] but num_classes is 5"),
        ({"x_test": torch.rand(100, 1, 4, 4)}, "x_test is torch.float32 (1, 4, 4) per sample"),
        ({"x_train": torch.rand(200, 1, 8, 8).double()}, "x_train is torch.float64"),
        ({"num_classes": True}, "give a whole number"),
    ],
)
def test_a_dataset_built_by_hand_is_checked(change, message):
    """200 images with 150 labels had trained to the end; numpy fields and float labels
    failed deep inside training, and a label beyond num_classes blamed model_kwargs."""
    x, y = _parts()
    fields = dict(
        spec="mine",
        x_train=x[:200],
        y_train=y[:200],
        x_test=x[200:],
        y_test=y[200:],
        num_classes=10,
        x_val=x[:0],
        y_val=y[:0],
    )
    D.Dataset(**fields)  # as given: fine
    with pytest.raises(InputError, match=re.escape(message)):
        D.Dataset(**{**fields, **change})


def test_from_arrays_splits_converts_and_names_itself_in_errors():
    x, y = _parts(classes=7)  # 7: every class in training (every 5th sample is test)
    d = D.Dataset.from_arrays(x.numpy().astype(np.float64), y.numpy().astype(np.int32))
    assert (len(d.y_train), len(d.y_val), len(d.y_test)) == (216, 24, 60)
    assert d.x_train.dtype == torch.float32 and d.num_classes == 7
    picked = sorted(_every_by_class(list(range(300)), y.tolist(), 5))
    assert torch.equal(d.x_test, x[picked])  # a fifth of each class, as an npz without x_test
    given = D.Dataset.from_arrays(x[:200], y[:200], x_test=x[200:], y_test=y[200:], num_classes=12)
    assert len(given.y_test) == 100 and given.num_classes == 12
    ids = torch.randint(1, 50, (100, 6))
    assert D.Dataset.from_arrays(ids, torch.arange(100) % 2).is_tokens  # signed (N, L): ids
    assert not D.Dataset.from_arrays(ids.numpy().astype(np.uint8), torch.arange(100) % 2).is_tokens
    for args, kwargs, message in [
        ((x, y[:10]), {}, "Dataset.from_arrays: x has 300 images but y has 10 labels"),
        ((x, y), {"x_test": x}, "give both x_test and y_test, or neither"),
        ((x, y * 0.5), {}, "Dataset.from_arrays: labels y must be whole numbers"),
        ((x, y), {"num_classes": 0}, "num_classes 0: give a whole number, 1 or more"),
        ((None, y), {}, "x is None"),
    ]:
        with pytest.raises(InputError, match=re.escape(message)):
            D.Dataset.from_arrays(*args, **kwargs)
    # and the other in-memory forms a notebook has
    from torch.utils.data import DataLoader, TensorDataset

    for form in ((x, y), TensorDataset(x, y), DataLoader(TensorDataset(x, y), batch_size=8)):
        assert torch.equal(D.as_dataset(form).x_test, d.x_test)
    with pytest.raises(InputError, match="a TensorDataset of 3 tensors"):
        D.as_dataset(TensorDataset(x, y, y))


def test_bfloat16_arrays_are_converted_and_an_arrays_run_asks_for_them_again():
    # numpy has no bfloat16: "TypeError: Got unsupported ScalarType BFloat16"
    x = torch.rand(40, 6).to(torch.bfloat16)
    d = D.Dataset.from_arrays(x, torch.arange(40) % 2)
    assert d.x_train.dtype == torch.float32
    # a checkpoint trained on arrays records no spec string that could load them
    with pytest.raises(InputError, match=r"m\.pt was trained on arrays given in Python; pass"):
        D.load_recorded("arrays", "m.pt")
