"""Every layer type users have: pruning and weight sharing on (module, parameter) pairs, the
per-layer choice between a shared and a dense record, and the fast shared-weight forward."""

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from compresskit.compressor import archive, kmeans, prune, recipe, shrink
from compresskit.compressor import report as report_mod
from compresskit.models import InputError, tiny

ATTN = "encoder.blocks.0.attn"
# The layers of each tiny family, with embeddings asked for (textcls' tokens and positions).
EXPECTED = {
    "resnet_se": {
        "stem.0": ("weight", "conv"),
        **{
            f"blocks.{b}.block.{i}": ("weight", "conv")
            for b in range(4)
            for i in ("0", "3", "6.reduce", "6.expand", "7")
        },
        "head": ("weight", "linear"),
    },
    "vit": {
        "patch": ("weight", "conv"),
        f"{ATTN}.in_proj": ("in_proj_weight", "attention"),
        f"{ATTN}.out_proj": ("weight", "attention"),
        "encoder.blocks.0.mlp.0": ("weight", "linear"),
        "encoder.blocks.0.mlp.2": ("weight", "linear"),
        "head": ("weight", "linear"),
    },
    "textcls": {
        "tokens": ("weight", "embedding"),
        "positions": ("weight", "embedding"),
        f"{ATTN}.in_proj": ("in_proj_weight", "attention"),
        f"{ATTN}.out_proj": ("weight", "attention"),
        "encoder.blocks.0.mlp.0": ("weight", "linear"),
        "encoder.blocks.0.mlp.2": ("weight", "linear"),
        "head": ("weight", "linear"),
    },
}


def _inputs(model):
    if hasattr(model, "example_inputs"):
        return model.example_inputs(batch=3)[0]
    return torch.rand(3, *model.in_shape, generator=torch.Generator().manual_seed(0))


def _layer_keys(name, embeddings):
    return {
        f"{layer.rpartition('.')[0]}.{p}" if p != "weight" else f"{layer}.weight"
        for layer, (p, kind) in EXPECTED[name].items()
        if embeddings or kind != "embedding"
    }


def test_layer_names_and_kinds():
    for name, expected in EXPECTED.items():
        found = kmeans.layers(tiny(name), embeddings=True)
        assert {n: (la.param, la.kind) for n, la in found.items()} == expected
    model = tiny("resnet_se")
    depthwise = model.get_submodule("blocks.0.block.3")
    assert depthwise.groups == depthwise.in_channels > 1  # a depthwise conv is a layer
    assert model.get_submodule("blocks.0.block.6.reduce").bias is not None  # SE conv, with bias
    assert prune.layer_name(f"{ATTN}.in_proj_weight") == f"{ATTN}.in_proj"
    assert prune.layer_name(f"{ATTN}.in_proj_bias") == f"{ATTN}.in_proj"
    assert prune.layer_name("fc1.weight") == prune.layer_name("fc1.bias") == "fc1"
    assert "tokens" not in kmeans.layers(tiny("textcls"))  # embeddings only when asked


@pytest.mark.parametrize(
    ("name", "embeddings"), [("resnet_se", False), ("vit", False), ("textcls", True)]
)
def test_prune_and_share_every_layer_and_bake_back(name, embeddings):
    model = tiny(name).eval()
    x = _inputs(model)
    before = copy.deepcopy(model.state_dict())
    keys = _layer_keys(name, embeddings)
    prune.prune_(model, prune.PruneConfig(sparsity=0.5, embeddings=embeddings))
    assert set(prune.masks_of(model)) == keys
    bits = kmeans.share_weights_(
        model, kmeans.QuantizeConfig(conv_bits=3, fc_bits=2, embeddings=embeddings)
    )
    assert set(kmeans.shared_params(model)) == keys
    for key, s in kmeans.shared_params(model).items():
        w = shrink._baked_value(model, key)
        assert kmeans.distinct_values(w) <= 2 ** bits[prune.layer_name(key)]
        assert torch.all(w[~s.mask] == 0) and not torch.signbit(w[~s.mask]).any()
        assert 0.45 <= float(s.mask.float().mean()) <= 0.55
    ref = model(x)
    plain = prune.bake_(copy.deepcopy(model))
    assert not any(parametrize.is_parametrized(m) for m in plain.modules())
    assert all(type(m).__name__ != "ParametrizedMultiheadAttention" for m in plain.modules())
    state = plain.state_dict()
    assert set(state) == set(before)
    for k, v in before.items():  # norms, biases, class token, positions: untouched
        if k not in keys:
            assert torch.equal(state[k], v), k
    assert torch.equal(plain(x), ref)
    with torch.no_grad():  # MultiheadAttention's fast path reads the parametrized weight too
        assert torch.allclose(model(x), ref, atol=1e-5)


def test_embeddings_stay_dense_unless_asked():
    model = tiny("textcls")
    prune.prune_(model, prune.PruneConfig(sparsity=0.5))
    kmeans.share_weights_(model, kmeans.QuantizeConfig())
    touched = set(prune.masks_of(model)) | set(kmeans.shared_params(model))
    assert touched and not touched & {"tokens.weight", "positions.weight"}
    r = recipe.resolve({"prune": {"sparsity": {"tokens": 0.5}}})
    with pytest.raises(InputError, match="'tokens', an embedding; set prune.embeddings = true"):
        shrink.check_fits_recipe(tiny("textcls"), r)
    r = recipe.resolve({"prune": {"sparsity": {"tokens": 0.5}, "embeddings": True}})
    shrink.check_fits_recipe(tiny("textcls"), r)
    with pytest.raises(InputError, match="prune.embeddings = 'yes' is impossible"):
        recipe.resolve({"prune": {"embeddings": "yes"}})


class SeparateQKV(nn.Module):
    """MultiheadAttention with key/value widths of their own: three projection parameters."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, kdim=6, vdim=4, batch_first=True)

    def forward(self, x):
        return self.attn(x, x[..., :6], x[..., :4], need_weights=False)[0]


def test_separate_q_k_v_projections():
    model = SeparateQKV().eval()
    found = kmeans.layers(model)
    assert {n: la.param for n, la in found.items()} == {
        "attn.q_proj": "q_proj_weight",
        "attn.k_proj": "k_proj_weight",
        "attn.v_proj": "v_proj_weight",
        "attn.out_proj": "weight",
    }
    cfg = prune.PruneConfig(sparsity={"attn.q_proj": 0.75, "attn.k_proj_weight": 0.5})
    kept = prune.prune_(model, cfg)
    assert kept == pytest.approx({"attn.q_proj_weight": 0.25, "attn.k_proj_weight": 0.5})
    kmeans.share_weights_(model, kmeans.QuantizeConfig(fc_bits=2, bits={"attn.v_proj": 1}))
    assert kmeans.distinct_values(model.attn.v_proj_weight) <= 2
    x = torch.rand(2, 5, 8, generator=torch.Generator().manual_seed(0))
    ref = model(x)
    assert torch.equal(prune.bake_(copy.deepcopy(model))(x), ref)


def test_recipe_names_attention_projections():
    model = tiny("vit")
    cfg = prune.PruneConfig(sparsity={f"{ATTN}.in_proj": 0.75, "head": 0.5})
    kept = prune.prune_(model, cfg)
    assert kept == pytest.approx({f"{ATTN}.in_proj_weight": 0.25, "head.weight": 0.5})
    bits = kmeans.share_weights_(model, kmeans.QuantizeConfig(bits={f"{ATTN}.in_proj": 2}))
    assert (
        bits[f"{ATTN}.in_proj"] == 2
        and kmeans.distinct_values(model.get_submodule(ATTN).in_proj_weight) <= 4
    )
    with pytest.raises(InputError, match="no prunable layer named encoder.blocks.0.attn;"):
        prune.prune_(tiny("vit"), prune.PruneConfig(sparsity={ATTN: 0.5}))
    r = recipe.resolve({"quantize": {"bits": {f"{ATTN}.in_proj": 4}}})
    shrink.check_fits_recipe(tiny("vit"), r)


# --- shared or dense, per layer -------------------------------------------------------------


class BigAndTiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.big = nn.Linear(300, 100)
        self.tiny = nn.Linear(4, 8)

    def forward(self, x):
        return self.tiny(self.big(x)[:, :4])


@pytest.mark.parametrize("dense", ["float16", "float32"])
def test_each_layer_is_stored_the_smaller_way(dense):
    torch.manual_seed(0)
    model = BigAndTiny()
    prune.prune_(model, prune.PruneConfig(sparsity={"big": 0.9}))
    kmeans.share_weights_(model, kmeans.QuantizeConfig(fc_bits=8, bits={"big": 3}))
    r = recipe.resolve({"quantize": {"dense": dense}})
    x = torch.rand(2, 300)
    y = model(x)
    assert shrink.prefer_dense_(model, r) == (["tiny"] if dense == "float16" else [])
    entries, info = shrink._entries(model, r)
    by_name = {e.name: e for e in entries}
    assert isinstance(by_name["big.weight"], archive.Shared)
    assert isinstance(by_name["tiny.weight"], archive.Dense)
    big, small = info["big.weight"], info["tiny.weight"]
    assert big["encoding"] == "shared" and big["shared_bytes"] < big["dense_bytes"]
    dtype = "fp16" if dense == "float16" else "fp32"
    assert small["encoding"] == f"dense {dtype}" and small["dense_bytes"] < small["shared_bytes"]
    assert small["encoding_reason"] == (
        f"dense {dtype}: {small['dense_bytes']:,} B < shared {small['shared_bytes']:,} B"
    )
    # Each record priced where it sits in the archive, after the records before it.
    context, priced = archive.ArchiveContext(), {}
    for e in entries:
        priced[e.name] = archive.record_size(e, context=context)
        context.add(e)
    assert small["dense_bytes"] == priced["tiny.weight"]
    assert big["shared_bytes"] == priced["big.weight"]
    w = model.tiny.weight.detach()
    if dense == "float16":  # the model computes with the values the archive stores
        assert torch.equal(w, w.half().float())
        assert torch.allclose(model(x), y, atol=1e-2)
    decoded = archive.decode(archive.encode(entries, {"name": "x"}, {})[0])
    shrink._check_bit_identical(model, decoded.state_dict)  # raises on any difference
    assert kmeans.distinct_values(model.tiny.weight) <= 2**8


@pytest.mark.parametrize("dense", ["float16", "float32"])
def test_estimated_dense_prices_choose_what_coding_both_chooses(dense, monkeypatch):
    """A dense record whose estimate is plainly larger is not coded (`archive.sizes`): the
    records chosen, and so the archive, are byte for byte those of coding both ways."""

    def archive_of(slack):
        monkeypatch.setattr(archive, "ESTIMATE_SLACK", slack)
        torch.manual_seed(0)
        model = BigAndTiny()
        prune.prune_(model, prune.PruneConfig(sparsity={"big": 0.9}))
        kmeans.share_weights_(model, kmeans.QuantizeConfig(fc_bits=8, bits={"big": 3}))
        r = recipe.resolve({"quantize": {"dense": dense}})
        rounded = shrink.prefer_dense_(model, r)
        entries, info = shrink._entries(model, r)
        return rounded, archive.encode(entries, {"name": "x"}, {})[0], info

    rounded, data, info = archive_of(archive.ESTIMATE_SLACK)
    exact_rounded, exact_data, exact_info = archive_of(math.inf)  # never trust an estimate
    assert rounded == exact_rounded and data == exact_data
    big, exact_big = info["big.weight"], exact_info["big.weight"]
    assert big["dense_bytes_estimated"] and not exact_big["dense_bytes_estimated"]
    assert abs(big["dense_bytes"] - exact_big["dense_bytes"]) <= 8
    assert "≈" in big["encoding_reason"] and "≈" not in exact_big["encoding_reason"]
    assert not info["tiny.weight"].get("dense_bytes_estimated")  # chosen: always coded


def test_entries_reuse_what_prefer_dense_priced_and_choose_the_same(monkeypatch):
    """`prefer_dense_` and `_entries` price the same records after the same records: with a
    shared `prices` dict the second codes only what changed in between (a codebook rounded to
    float16), and the records, the archive and the report are those of pricing twice."""
    coded: list[str] = []
    code = archive._coded_size
    monkeypatch.setattr(archive, "_coded_size", lambda e, c: coded.append(e.name) or code(e, c))

    def run(prices):
        torch.manual_seed(0)
        model = BigAndTiny()
        prune.prune_(model, prune.PruneConfig(sparsity={"big": 0.9}))
        kmeans.share_weights_(model, kmeans.QuantizeConfig(fc_bits=8, bits={"big": 3}))
        r = recipe.resolve({})
        rounded = shrink.prefer_dense_(model, r, prices)
        coded.clear()
        entries, info = shrink._entries(model, r, prices)
        return rounded, archive.encode(entries, {"name": "x"}, {})[0], info, list(coded)

    twice, once = run(None), run({})
    assert twice[0] == once[0] == ["tiny"]  # tiny's codebook rounded: stored dense
    assert twice[1] == once[1] and twice[2] == once[2]
    assert "big.weight" in twice[3] and "big.weight" not in once[3]
    assert "tiny.weight" in once[3]  # its shared record changed when its codebook was rounded
    # A context whose records before differ finds nothing of another's.
    prices: dict = {}
    e = archive.Dense("w", torch.randn(1000))
    a, b = archive.ArchiveContext(3, prices), archive.ArchiveContext(3, prices)
    b.add(archive.Dense("before", torch.randn(10)))
    assert a.key(e, b"exact") != b.key(e, b"exact")
    assert archive.record_size(e, 3, a) == archive.record_size(e, 3, archive.ArchiveContext(3))
    assert len(prices) == 1


def test_shrink_stores_no_layer_worse_than_dense_fp16(tmp_path):
    """A tiny residual CNN through the whole pipeline (no training): every layer's record is at
    most its dense float16 record, and the report says which and why."""
    model = tiny("resnet_se")
    hooks = shrink.Hooks(
        retrain=lambda *a, **k: None, test_accuracy=lambda m: 0.5, val_accuracy=lambda m: 0.5
    )
    r = recipe.resolve(
        {"prune": {"rounds": 1, "retrain_epochs": 0}, "quantize": {"finetune_epochs": 0}}
    )
    rep = shrink.shrink(model, {"name": "resnet_se", "kwargs": {}}, r, hooks, tmp_path)
    rows = {row["layer"]: row for row in rep["layers"]}
    assert set(rows) == set(EXPECTED["resnet_se"])
    for row in rows.values():
        # Format 3 codes byte planes with models shared across the archive where that is
        # cheaper, so a record takes at most what it costs coded alone (the figures compared).
        assert row["bytes"] <= min(row["shared_bytes"], row["dense_bytes"]) + 1, row
        assert row["encoding"] in ("shared", "dense fp16")
    encodings = {row["encoding"] for row in rows.values()}
    # Format 2 stored both ways here; format 3 codes this 4.5k-weight net's layers (54 to 576
    # weights) dense in float16 planes for less than any codebook and mask.
    assert "dense fp16" in encodings
    # The whole archive is at most the same model stored dense float16 (the other 74 records,
    # BatchNorm statistics and biases, are the same both ways: the pipeline rounded them).
    decoded = archive.read(tmp_path / "model.dcz")
    as16 = [
        archive.Dense(k, v.half().float() if v.is_floating_point() else v, store_fp16=True)
        for k, v in decoded.state_dict.items()
    ]
    dense16 = len(archive.encode(as16, decoded.spec, decoded.metadata)[0])
    assert rep["archive"]["bytes"] <= dense16
    # Against FP32, the floor for any model: ~2x is what dense fp16 gives, so framing
    # must be small. Format version 1 (names in the records) made this 4.5k-weight net 1.57x.
    assert rep["archive"]["ratio"] >= 1.9
    md = report_mod.markdown(rep)
    assert "| blocks.0.block.3 |" in md and "dense fp16: " in md


# --- the shared-weight forward --------------------------------------------------------------


def _shared(n=5000, k=15, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(50, n // 50, generator=g) > 0.8
    index = torch.randint(0, k, mask.shape, generator=g)
    return kmeans.SharedWeights(torch.randn(k, generator=g), index, mask)


def test_shared_forward_is_one_gather_with_the_papers_gradient():
    s = _shared()
    grad = torch.randn(s.mask.shape, generator=torch.Generator().manual_seed(1))
    w = s(None)
    reference = torch.where(s.mask, s.codebook.detach()[s.index], 0.0)
    assert torch.equal(w.detach(), reference) and not torch.signbit(w[~s.mask]).any()
    w.backward(grad)
    expected = torch.zeros(len(s.codebook)).index_add_(0, s.index[s.mask], grad[s.mask])
    assert torch.allclose(s.codebook.grad, expected, atol=1e-5)


def test_evaluation_cache_follows_every_change():
    s = _shared()
    with torch.no_grad():
        first = s(None)
        assert s(None) is first  # reused while nothing changed
        s.codebook.data.mul_(2)  # as a fused optimizer does: no version bump on the parameter
        assert torch.equal(s(None), torch.where(s.mask, s.codebook[s.index], 0.0))
        s.mask[0, :] = False  # tighter mask, in place
        assert torch.all(s(None)[0] == 0)
        s.index.fill_(0)
        assert set(s(None).unique().tolist()) == {0.0, float(s.codebook[0])}
    with torch.inference_mode():
        assert torch.equal(s(None), torch.where(s.mask, s.codebook[s.index], 0.0))


def test_fine_tuning_step_changes_only_kept_weights():
    s = _shared()
    for _ in range(3):
        s.codebook.grad = None
        s(None).square().sum().backward()
        with torch.no_grad():  # an SGD step, in place (a torch.optim import costs seconds)
            s.codebook -= 0.1 * s.codebook.grad
            w = s(None)
        assert torch.equal(w, torch.where(s.mask, s.codebook.detach()[s.index], 0.0))
        assert not torch.signbit(w[~s.mask]).any()
    assert np.isfinite(s.codebook.detach().numpy()).all()


class _HeadFirst(nn.Module):
    """Registers its classifier before its body, and its first conv reads 8 channels."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, 3)
        self.hidden = nn.Linear(32, 16)
        self.conv2 = nn.Conv1d(8, 8, 3, padding=1)
        self.conv1 = nn.Conv1d(8, 8, 3, padding=1)
        self.side = nn.Linear(4, 4)  # never called

    def forward(self, x):  # (N, 8, 4)
        h = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.head(torch.relu(self.hidden(h.flatten(1))))


def test_default_sparsity_takes_roles_from_the_forward_order():
    # By registration order the head was pruned as a hidden layer (0.92) and the hidden layer
    # as the output (0.75); the first conv, of 8 input channels, lost 85% as a later conv.
    model = _HeadFirst()
    x = torch.rand(2, 8, 4)
    assert shrink.call_order(model, x) == ["", "conv1", "conv2", "hidden", "head"]
    want = {
        "head": 0.75,
        "hidden": 0.92,
        "conv2": 0.85,
        "conv1": 0.35,
        "side": 0.92,
    }
    assert shrink.default_sparsity(model, example=x) == want
    # Without inputs, registration order: documented, and what --dry-run without data shows.
    blind = shrink.default_sparsity(model)
    assert blind["conv2"] == 0.35 and blind["side"] == 0.75
    # A forward that fails on the example falls back to registration order.
    assert shrink.default_sparsity(model, example=torch.rand(2, 3)) == blind
    # The dry-run plan and the pruning stage read the same order.
    r = recipe.resolve({})
    rows = {row["layer"]: row["sparsity"] for row in shrink.plan(model, r, x)}
    assert rows == want
    assert model.training  # the forward left the model's mode alone


class _TiedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.hidden = nn.Linear(8, 16), nn.Linear(16, 16)
        self.out, self.out2 = nn.Linear(16, 3), nn.Linear(16, 3)
        self.out2.weight = self.out.weight  # tied: both stay dense

    def forward(self, x):
        h = torch.relu(self.hidden(torch.relu(self.inp(x))))
        return self.out(h) + self.out2(h)


def test_a_tied_head_leaves_the_hidden_layers_hidden():
    """The tied head is left dense; the hidden layer before it had taken the output layer's
    0.75 instead of a hidden layer's 0.92."""
    got = shrink.default_sparsity(_TiedHead(), example=torch.rand(2, 8))
    assert got == {"inp": 0.92, "hidden": 0.92}


def test_default_sparsity_of_zoo_models_is_unchanged_by_the_order():
    for name in ("lenet5", "mlp"):
        model = tiny(name)
        x = torch.rand(2, *model.in_shape)
        assert shrink.default_sparsity(model, example=x) == shrink.default_sparsity(model)


def _shrink_untrained(model, x, name, out, metadata=None):
    """The whole pipeline with no training: one prune round, no fine-tuning, `x` as the
    validation inputs (which order the layers' roles)."""
    hooks = shrink.Hooks(
        retrain=lambda *a, **k: None,
        test_accuracy=lambda m: 0.5,
        val_accuracy=lambda m: 0.5,
        val_data=(x, torch.zeros(len(x), dtype=torch.int64)),
    )
    r = recipe.resolve(
        {"prune": {"rounds": 1, "retrain_epochs": 0}, "quantize": {"finetune_epochs": 0}}
    )
    return shrink.shrink(model, {"name": name, "kwargs": {}}, r, hooks, out, metadata)


class _Decoder(nn.Module):
    """Transposed convolutions, 1-d, 2-d and grouped, between a conv and a head."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Conv2d(1, 8, 3, stride=2, padding=1)  # 8x8 -> 4x4
        self.up = nn.ConvTranspose2d(8, 12, 4, stride=2, padding=1, groups=2)  # -> 8x8
        self.up1d = nn.ConvTranspose1d(12, 4, 3, stride=2, padding=1)  # 64 -> 127
        self.head = nn.Linear(4 * 127, 3)

    def forward(self, x):
        h = torch.relu(self.up(torch.relu(self.enc(x))))
        return self.head(torch.relu(self.up1d(h.flatten(2))).flatten(1))


def test_transposed_convolutions_are_pruned_shared_and_stored(tmp_path):
    # A decoder's ConvTranspose layers were stored dense as "uncovered": an encoder-decoder
    # classifier whose decoder held 44% of the weights came out at 4.3x; pruned and shared,
    # 13.3x.
    torch.manual_seed(0)
    model = _Decoder()
    x = torch.rand(4, 1, 8, 8)
    assert {n: la.kind for n, la in kmeans.layers(model).items()} == {
        "enc": "conv",
        "up": "conv",
        "up1d": "conv",
        "head": "linear",
    }
    assert prune.uncovered_weights(model) == []
    meta = {"data": f"npz:{tmp_path / 'parts' / 'x.npz'}"}
    rep = _shrink_untrained(model, x, "mine:Decoder", tmp_path, meta)
    # the shipped file names the data by file name, no folder of the build machine
    assert archive.read(tmp_path / "model.dcz").metadata["data"] == "npz:x.npz"
    rows = {row["layer"]: row for row in rep["layers"]}
    # default sparsity by role: the first conv 35%, the transposed ones as later convs 85%
    assert rows["up"]["kept"] == round(0.15 * 8 * 6 * 16)
    assert rows["up1d"]["kept"] == round(0.15 * 12 * 4 * 3)
    assert "uncovered" not in rep or not rep["uncovered"]
    decoded = archive.read(tmp_path / "model.dcz").state_dict
    for key, value in prune.bake_(copy.deepcopy(model)).state_dict().items():
        assert torch.equal(decoded[key], value), key
    up = decoded["up.weight"]
    assert up.shape == (8, 6, 4, 4) and kmeans.distinct_values(up) <= 2**8
    assert float((up == 0).float().mean()) == pytest.approx(0.85, abs=0.01)


class _Recurrent(nn.Module):
    """A 2-layer bidirectional LSTM with a projection, then a GRU, then a head."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(6, 16, num_layers=2, bidirectional=True, proj_size=8, batch_first=True)
        self.gru = nn.GRU(16, 12, batch_first=True)
        self.cell = nn.GRUCell(12, 12)  # stepped in Python over the GRU's outputs
        self.head = nn.Linear(12, 3)

    def forward(self, x):  # (N, 1, T, F)
        h, _ = self.lstm(x[:, 0])
        h, _ = self.gru(h)
        state = h[:, 0]
        for t in range(h.shape[1]):
            state = self.cell(h[:, t], state)
        return self.head(state)


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
def test_recurrent_layers_are_pruned_shared_and_stored(tmp_path):
    # An LSTM classifier whose LSTM held 97% of the weights came out at 2.4x: its matrices
    # were stored dense. Each layer's and direction's matrix is now a layer of its own.
    torch.manual_seed(0)
    model = _Recurrent()
    x = torch.rand(4, 1, 5, 6)
    found = kmeans.layers(model)
    lstm = [
        f"lstm.weight_{m}_l{i}{d}"
        for i in (0, 1)
        for d in ("", "_reverse")
        for m in ("ih", "hh", "hr")
    ]
    cells = ["cell.weight_ih", "cell.weight_hh"]
    assert sorted(found) == sorted([*lstm, "gru.weight_ih_l0", "gru.weight_hh_l0", *cells, "head"])
    assert {found[n].kind for n in found if n != "head"} == {"recurrent"}
    assert prune.uncovered_weights(model) == []
    assert shrink.default_sparsity(model, example=x) == {
        **dict.fromkeys([*lstm, "gru.weight_ih_l0", "gru.weight_hh_l0", *cells], 0.9),
        "head": 0.75,
    }
    # The masked and shared values are what the LSTM computes with (it re-reads its weights
    # when their tensors change), and baking keeps that.
    prune.prune_(model, prune.PruneConfig(sparsity=0.5))
    kmeans.share_weights_(model, kmeans.QuantizeConfig(fc_bits=3))
    for w in (model.lstm.weight_hh_l0_reverse, model.cell.weight_hh):
        assert float((w == 0).float().mean()) == pytest.approx(0.5, abs=0.02)
        assert kmeans.distinct_values(w) <= 8
    with torch.no_grad():
        ref = model(x)
        plain = prune.bake_(copy.deepcopy(model))
        assert torch.equal(plain(x), ref)
        dense = _Recurrent()
        dense.load_state_dict(plain.state_dict())
        assert torch.equal(dense(x), ref)  # nothing but the stored values
    # Through the pipeline: the archive decodes to the model it measured.
    model = _Recurrent()
    rep = _shrink_untrained(model, x, "mine:Recurrent", tmp_path)
    rows = {row["layer"]: row for row in rep["layers"]}
    assert rows["lstm.weight_ih_l1_reverse"]["kept"] == round(0.1 * 4 * 16 * 16)
    assert not rep.get("uncovered")
    decoded = archive.read(tmp_path / "model.dcz").state_dict
    for key, value in prune.bake_(copy.deepcopy(model)).state_dict().items():
        assert torch.equal(decoded[key], value), key
