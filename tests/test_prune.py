import pytest
import torch
from torch import nn

from compresskit.compressor import prune
from compresskit.distrib.trainer import TrainConfig, fit
from compresskit.models import InputError, tiny
from compresskit.models.data import load


def test_magnitude_mask_prunes_exactly_the_smallest():
    w = torch.tensor([[0.5, -0.1, 0.3], [-0.9, 0.05, 0.2]])
    mask = prune.magnitude_mask(w, 0.5)
    assert mask.tolist() == [[True, False, True], [True, False, False]]
    g = torch.Generator().manual_seed(0)
    w = torch.randn(100, 37, generator=g)
    for s in (0.0, 0.3, 0.91, 0.99):
        m = prune.magnitude_mask(w, s)
        assert int((~m).sum()) == round(s * w.numel())
        if s:
            assert w[~m].abs().max() <= w[m].abs().min()


def test_magnitude_mask_breaks_ties_by_position_as_a_stable_sort_does():
    # The mask is found by selection, not sorting: it must still be the stable sort's mask,
    # ties at the threshold included (quantized-looking weights tie a lot), at every sparsity.
    def by_sort(w, s):
        k = round(s * w.numel())
        mask = torch.ones(w.numel(), dtype=torch.bool)
        mask[torch.argsort(w.abs().flatten(), stable=True)[:k]] = False
        return mask.view_as(w)

    g = torch.Generator().manual_seed(1)
    tied = torch.randint(-3, 4, (23, 17), generator=g).float() * 0.5  # 7 values, many ties
    w = torch.randn(31, 5, generator=g)
    w[3] = 0.0  # a row of exact zeros ties too
    for x in (tied, w):
        for s in (0.0, 0.1, 0.37, 0.5, 0.9, 1.0):
            assert torch.equal(prune.magnitude_mask(x, s), by_sort(x, s)), s


def test_threshold_and_global_rules():
    w = torch.tensor([1.0, -2.0, 3.0, -4.0])
    assert prune.threshold_mask(w, 2.0).tolist() == [False, False, True, True]
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 0.5])
    t = prune.global_threshold([a, b], 0.4)  # 2 of 5 values pruned: 0.5 and 1.0
    assert t == 1.0


def test_mask_keeps_pruned_weights_at_exact_positive_zero_through_retraining():
    data = load("digits")
    model = tiny("lenet300", in_shape=data.in_shape)
    prune.prune_(model, prune.PruneConfig(sparsity=0.8))
    before = {n: m.clone() for n, m in prune.masks_of(model).items()}
    # SGD with momentum and weight decay would move pruned weights if anything leaked.
    fit(model, data, TrainConfig(epochs=2, optimizer="sgd", weight_decay=1e-3))
    for name, mask in prune.masks_of(model).items():
        assert torch.equal(mask, before[name])
        w = model.get_submodule(name.rsplit(".", 1)[0]).weight
        assert torch.all(w[~mask] == 0) and not torch.signbit(w[~mask]).any()
        assert torch.all(w[mask] != 0)


def test_mask_is_where_bit_for_bit_and_follows_a_tightened_mask():
    """The multiply-and-add form gives where(mask, w, +0.0) exactly: the same bits (no -0.0
    from negative pruned originals), the same gradient, and a new mask as soon as it changes."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4096, generator=g, dtype=torch.float64).requires_grad_()
    keep = torch.rand(4096, generator=g) > 0.5
    m = prune.Mask(keep)
    for dtype in (torch.float64, torch.float32):
        x = w.to(dtype)
        got, ref = m(x), torch.where(keep, x, torch.zeros((), dtype=dtype))
        assert torch.equal(got, ref) and torch.equal(torch.signbit(got), torch.signbit(ref))
    assert torch.signbit(w[~keep]).any()  # negative originals where pruned: -0.0 was possible
    up = torch.randn(4096, generator=g, dtype=torch.float64)
    (gw,) = torch.autograd.grad(m(w), w, up)
    assert torch.equal(gw, torch.where(keep, up, 0.0))
    m.mask.copy_(m.mask & (torch.arange(4096) % 2 == 0))  # set_mask_ tightens in place
    assert torch.equal(m(w), torch.where(m.mask, w, 0.0))
    m.mask = torch.ones(4096, dtype=torch.bool)  # a new tensor: the cache is not reused
    assert torch.equal(m(w), w)


def test_a_masked_layer_still_trains_after_an_inference_mode_forward():
    layer = nn.Linear(8, 4)
    prune.set_mask_(layer, "weight", torch.rand(4, 8) > 0.5)
    x = torch.randn(3, 8)
    with torch.inference_mode():
        layer(x)
    layer(x).sum().backward()  # a mask cached under inference_mode could not be saved for this
    assert layer.parametrizations.weight.original.grad is not None


def test_iterative_rounds_reach_the_target_and_masks_only_tighten():
    model = tiny("lenet300", in_shape=(1, 8, 8))
    cfg = prune.PruneConfig(sparsity={"fc1": 0.9, "fc2.weight": 0.5})
    previous = None
    fractions = prune.schedule(3)
    assert fractions[-1] == 1.0 and fractions == sorted(fractions)
    for f in fractions:
        kept = prune.prune_(model, cfg, f)
        masks = prune.masks_of(model)
        if previous:
            assert all(torch.all(masks[n] <= previous[n]) for n in previous)
        previous = {n: m.clone() for n, m in masks.items()}
    assert kept == pytest.approx({"fc1.weight": 0.1, "fc2.weight": 0.5}, abs=0.01)
    assert "fc3.weight" not in kept  # layers the recipe does not name keep their weights


def test_quality_rule_uses_std():
    model = tiny("mlp", in_shape=(1, 8, 8))
    w = model.fc1.weight.detach().clone()
    prune.prune_(model, prune.PruneConfig(quality=1.0))
    expected = w.abs() > w.std()
    assert torch.equal(prune.masks_of(model)["fc1.weight"], expected)


def test_bias_and_norm_are_not_pruned_unless_asked():
    model = tiny("vgg", in_shape=(1, 8, 8))
    names = set(prune.prunable(model))
    assert names and all(n.endswith(".weight") for n in names)
    assert not any(
        isinstance(model.get_submodule(n.rsplit(".", 1)[0]), nn.BatchNorm2d) for n in names
    )
    with_bias = prune.prunable(model, prune.PruneConfig(sparsity=0.5, include_bias=True))
    assert any(n.endswith(".bias") for n in with_bias)


GRID = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.97)


def _zeros(m, name):
    return float((prune.prunable(m)[name] == 0).float().mean())


def test_sensitivity_bisects_to_the_full_grids_edge():
    """On curves that fall as a layer loses weights, bisection proposes what measuring every
    grid point would (a middle edge, nothing within the budget, the grid's top), in 3
    evaluations a layer for 7 points, whatever the grid's order or repeats."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 30), nn.Linear(30, 20), nn.Linear(20, 10))
    limit = {"0.weight": 0.85, "1.weight": 0.2, "2.weight": 1.0}  # accuracy holds up to this
    calls = []

    def accuracy(m):
        calls.append(m)
        return 1.0 - sum(0.1 for n in limit if _zeros(m, n) > limit[n] + 1e-3)

    ticks = []
    sens = prune.sensitivity(
        model, accuracy, budget=0.02, grid=GRID, progress=lambda *a: ticks.append(a)
    )
    assert sens.proposal == {"0.weight": 0.8, "1.weight": 0.0, "2.weight": 0.97}
    assert len(calls) == 1 + 3 * 3
    assert ticks == [(1, 3), (2, 3), (3, 3)]
    for name, curve in sens.curves.items():
        assert list(curve) == sorted(curve) and set(curve) <= set(GRID)
        assert all(
            (sens.baseline - a <= 0.02) == (s <= sens.proposal[name]) for s, a in curve.items()
        )
    shuffled = prune.sensitivity(model, accuracy, 0.02, grid=(0.97, 0.3, 0.8, 0.5, 0.8, 0.95))
    assert shuffled.proposal == {"0.weight": 0.8, "1.weight": 0.0, "2.weight": 0.97}
    assert not prune.masks_of(model) and all(
        bool((w != 0).all()) for w in prune.prunable(model).values()
    )


def test_sensitivity_on_a_noisy_curve_proposes_a_measured_edge_never_above_the_grids():
    """Where a curve passes again above a miss, the proposal is a measured pass with a measured
    miss (or the grid's end) just above it, and never more than the whole grid's proposal."""
    model = nn.Sequential(nn.Linear(40, 30))
    rng = torch.Generator().manual_seed(0)
    below = 0
    for _ in range(40):
        passes = {s: bool(torch.rand(1, generator=rng) < 0.6) for s in GRID}

        def bumpy(m, passes=passes):
            z = _zeros(m, "0.weight")  # the grid point cut now (0 for the dense baseline)
            return (
                1.0 if z == 0 or next(ok for g, ok in passes.items() if abs(z - g) < 5e-3) else 0.9
            )

        sens = prune.sensitivity(model, bumpy, 0.02, GRID)
        s, curve = sens.proposal["0.weight"], sens.curves["0.weight"]
        whole = max((g for g, ok in passes.items() if ok), default=0.0)
        assert s <= whole
        assert s == 0.0 or passes[s]
        above = [g for g in curve if g > s]  # the measured points above the proposal
        if s == GRID[-1]:
            assert above == []
        else:
            assert above and not passes[above[0]]
        below += s < whole
    assert below > 0  # the draws include curves where it stopped below the grid's best


def test_sensitivity_progress_lines_are_spaced_and_end_with_the_total(monkeypatch):
    from compresskit.compressor import shrink

    clock = iter([0.0, 1.0, 4.0, 12.0, 13.0, 14.0])  # the start, then one reading per layer
    monkeypatch.setattr(shrink.time, "monotonic", lambda: next(clock))
    lines = []
    progress = shrink._every(lines.append)
    for done in range(1, 6):
        progress(done, 5)
    assert lines == [
        "sensitivity analysis: 3/5 layers, 12s, eta 8s",  # 10 s after the start
        "sensitivity analysis: 5/5 layers, 14s",  # the end, however soon
    ]


def test_sensitivity_proposes_within_budget():
    data = load("digits")
    model = tiny("lenet300", in_shape=data.in_shape)
    fit(model, data, TrainConfig(epochs=3))
    from compresskit.distrib.trainer import evaluate

    acc = lambda m: evaluate(m, data.x_test, data.y_test)[1]  # noqa: E731
    sens = prune.sensitivity(model, acc, budget=0.02, grid=(0.2, 0.5, 0.9))
    for name, s in sens.proposal.items():
        assert sens.baseline - sens.curves[name].get(s, sens.baseline) <= 0.02
        worse = [g for g in sens.curves[name] if g > s]
        assert all(sens.baseline - sens.curves[name][g] > 0.02 for g in worse)
    assert acc(model) == sens.baseline  # the analysis restored the weights
    assert not prune.masks_of(model)


def test_model_without_prunable_layers_is_an_input_error():
    with pytest.raises(InputError, match="no prunable layers"):
        prune.prune_(nn.Sequential(nn.ReLU()), prune.PruneConfig(sparsity=0.5))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sparsity": 1.5}, "impossible"),
        ({"sparsity": 0.5, "quality": 1.0}, "not both"),
        ({"sparsity": {"a": 0.5}, "scope": "global"}, "one sparsity number"),
        ({"quality": -1}, "positive"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(InputError, match=message):
        prune.PruneConfig(**kwargs)


def test_a_layer_pruned_away_entirely_is_refused():
    model = tiny("lenet300", in_shape=(1, 8, 8))
    with pytest.raises(InputError, match="remove every weight of fc3.weight"):
        prune.prune_(model, prune.PruneConfig(sparsity={"fc3": 0.9999}))
    with pytest.raises(InputError, match="remove every weight"):
        prune.prune_(model, prune.PruneConfig(quality=100.0))


def test_quality_rounds_use_the_dense_std():
    model = tiny("mlp", in_shape=(1, 8, 8))
    w = model.fc1.weight.detach().clone()
    cfg = prune.PruneConfig(quality=1.0, rounds=3)
    stds = prune.weight_stds(model, cfg)
    for f in prune.schedule(3):
        prune.prune_(model, cfg, f, stds)
    assert torch.equal(prune.masks_of(model)["fc1.weight"], w.abs() > w.std())


def test_include_bias_with_per_layer_sparsity():
    model = tiny("mlp", in_shape=(1, 8, 8))
    cfg = prune.PruneConfig(sparsity={"fc1": 0.5}, include_bias=True)
    kept = prune.prune_(model, cfg)
    assert kept["fc1.bias"] == pytest.approx(0.5) and kept["fc1.weight"] == pytest.approx(0.5)


def test_baking_a_copy_leaves_the_original_working():
    import copy

    model = tiny("lenet5", in_shape=(1, 8, 8)).eval()
    prune.prune_(model, prune.PruneConfig(sparsity=0.5))
    x = torch.rand(3, 1, 8, 8)
    ref = model(x)
    for _ in range(2):
        plain = prune.bake_(copy.deepcopy(model))
        assert type(plain.conv1) is nn.Conv2d and torch.equal(plain(x), ref)
        assert "conv1.weight" in plain.state_dict()
    assert prune.masks_of(model) and torch.equal(model(x), ref)


def test_attention_projections_are_prunable_embeddings_only_when_asked():
    model = tiny("textcls")
    names = set(prune.prunable(model))
    assert "encoder.blocks.0.attn.in_proj_weight" in names
    assert "encoder.blocks.0.attn.out_proj.weight" in names
    assert "tokens.weight" not in names and not any("norm" in n for n in names)
    cfg = prune.PruneConfig(sparsity=0.5, include_bias=True, embeddings=True)
    with_bias = set(prune.prunable(model, cfg))
    assert {"encoder.blocks.0.attn.in_proj_bias", "tokens.weight", "positions.weight"} <= with_bias
    kept = prune.prune_(model, prune.PruneConfig(sparsity={"encoder.blocks.0.attn.in_proj": 0.5}))
    assert kept == pytest.approx({"encoder.blocks.0.attn.in_proj_weight": 0.5})


def _pruned(model_name, seed=0):
    torch.manual_seed(seed)
    m = tiny(model_name, in_shape=(1, 8, 8))
    prune.prune_(m, prune.PruneConfig(sparsity=0.6, rounds=1))
    return m


@pytest.mark.parametrize(
    "opt",
    [
        dict(optimizer="adam", weight_decay=1e-3),
        dict(optimizer="sgd", momentum=0.9, weight_decay=1e-3),
    ],
)
def test_zeroed_training_trains_exactly_as_the_masked_forward(opt):
    """Inside zeroed_training the masks hand the layers their originals and zero the pruned
    gradients as they accumulate: the same losses and weights, bit for bit, as the masked
    forward, for the trainer's Adam (fused) and SGD with momentum and decay, and the mask is
    back in place afterwards."""
    data = load("digits")
    cfg = TrainConfig(epochs=2, batch_size=32, lr=3e-3, seed=0, **opt)
    ref, fast = _pruned("lenet5"), _pruned("lenet5")
    a = fit(ref, data, cfg)
    with prune.zeroed_training(fast):
        assert all(p.passthrough for p in fast.modules() if isinstance(p, prune.Mask))
        b = fit(fast, data, cfg)
    assert [(h.train_loss, h.test_loss) for h in a.history] == [
        (h.train_loss, h.test_loss) for h in b.history
    ]
    masks = prune.masks_of(fast)
    assert masks and not any(p.passthrough for p in fast.modules() if isinstance(p, prune.Mask))
    for name, w in ref.state_dict().items():
        assert torch.equal(w, fast.state_dict()[name]), name
    for name, mask in masks.items():
        got = prune._raw(fast, name)
        assert torch.all(got[~mask] == 0) and not torch.signbit(got[~mask]).any()
        assert torch.equal(prune._current(*_module_and_param(fast, name)), got * mask)


def _module_and_param(model, full):
    module, pname = prune._split(full)
    return model.get_submodule(module), pname


def test_zeroed_training_follows_a_mask_tightened_inside_it():
    m = _pruned("lenet300")
    x = torch.randn(5, 1, 8, 8)
    with prune.zeroed_training(m):
        tighter = prune.masks_of(m)["fc1.weight"] & (torch.rand(m.fc1.weight.shape) > 0.5)
        prune.set_mask_(m, "fc1.weight", tighter)
        m(x).sum().backward()
        grad = m.fc1.parametrizations.weight.original.grad
        assert torch.all(grad[~tighter] == 0) and bool(grad[tighter].ne(0).any())
        assert torch.all(m.fc1.weight[~tighter] == 0)


def test_zeroed_training_names_a_layer_whose_pruned_weights_an_optimizer_moved():
    """Momentum from before a mask tightened moves the newly pruned weights: the block checks
    on leaving, says which layer, and puts the zeros back; an exception already on its way
    out is left to propagate."""
    m = _pruned("lenet300")
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(5, 1, 8, 8)
    m(x).sum().backward()
    opt.step()  # momentum buffers everywhere the first mask kept
    opt.zero_grad()
    tighter = prune.masks_of(m)["fc2.weight"] & (
        torch.arange(m.fc2.weight.numel()).view_as(m.fc2.weight) % 2 == 0
    )
    prune.set_mask_(m, "fc2.weight", tighter)
    moved = pytest.raises(RuntimeError, match=r"pruned weights of fc2\.weight left zero")
    with moved, prune.zeroed_training(m):
        m(x).sum().backward()
        opt.step()
    assert torch.all(prune._raw(m, "fc2.weight")[~tighter] == 0)
    with pytest.raises(ValueError, match="boom"), prune.zeroed_training(m):
        m(x).sum().backward()
        opt.step()
        raise ValueError("boom")
    assert not any(p.passthrough for p in m.modules() if isinstance(p, prune.Mask))


def test_zeroed_training_leaves_frozen_tied_and_copied_masks_to_the_masked_forward():
    """A frozen original (no hook can be registered on it), one weight tied between two
    layers under two masks, a copy made inside the block: each keeps the masked forward. A
    parameter replaced inside the block lost its hook, and leaving says which."""
    import copy

    frozen = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 3))
    for layer in frozen:
        prune.set_mask_(layer, "weight", torch.rand(layer.weight.shape) > 0.5)
    frozen[1].parametrizations.weight.original.requires_grad_(False)
    with prune.zeroed_training(frozen):
        assert frozen[0].parametrizations.weight[0].passthrough
        assert not frozen[1].parametrizations.weight[0].passthrough
        twin = copy.deepcopy(frozen)
        assert not twin[0].parametrizations.weight[0].passthrough
    assert not frozen[0].parametrizations.weight[0].passthrough

    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    prune.set_mask_(tied[0], "weight", torch.rand(4, 4) > 0.3)
    prune.set_mask_(tied[1], "weight", torch.rand(4, 4) > 0.6)
    assert tied[0].parametrizations.weight.original is tied[1].parametrizations.weight.original
    with prune.zeroed_training(tied):
        assert not any(p.passthrough for p in tied.modules() if isinstance(p, prune.Mask))

    m = _pruned("lenet300")
    swapped = pytest.raises(RuntimeError, match=r"fc1\.weight \(its parameter was replaced")
    with swapped, prune.zeroed_training(m):
        plist = m.fc1.parametrizations.weight
        plist.original = nn.Parameter(plist.original.detach().clone())


def test_tied_weights_are_found_and_left_out_of_the_layers():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 8)
            self.proj = nn.Linear(8, 50, bias=False)
            self.proj.weight = self.emb.weight  # output projection tied to the embedding
            self.fc1 = nn.Linear(8, 8)
            self.fc2 = self.fc1  # one module used twice: one key, no tie
            self.head = nn.Linear(8, 3)

    net = Net()
    assert prune.tied_weights(net) == [["emb.weight", "proj.weight"]]
    assert list(prune.weight_layers(net, embeddings=True)) == ["fc1", "head"]
    assert list(prune.prunable(net)) == ["fc1.weight", "head.weight"]
    assert prune.tied_weights(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))) == []


def test_weights_no_layer_covers_are_named_for_the_report():
    # An LSTM classifier came out at 2.4x with no word that 97% of it was never pruned (LSTMs
    # are covered now; a Bilinear layer, a bare parameter and an embedding left out are not).
    from compresskit.compressor import report as report_mod

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 8)
            self.rnn = nn.LSTM(8, 16, batch_first=True)
            self.pair = nn.Bilinear(16, 8, 12)
            self.up = nn.ConvTranspose2d(4, 4, 3)
            self.scale = nn.Parameter(torch.ones(3, 3))
            self.head = nn.Linear(16, 50)
            self.tied = nn.Linear(8, 50)
            self.tied.weight = self.emb.weight
            self.norm = nn.LayerNorm(16)

    net = Net()
    got = prune.uncovered_weights(net)
    assert got == [
        {"module": "(model)", "type": "Net", "weights": 9, "parameters": ["scale"]},
        {
            "module": "pair",
            "type": "Bilinear",
            "weights": 12 * 16 * 8,
            "parameters": ["pair.weight"],
        },
    ]  # the embedding is tied (its own note); the head, the LSTM, the transposed conv and the
    # norm are covered or 1-D
    assert net.up.weight.shape == (4, 4, 3, 3) and "up" in prune.weight_layers(net)
    assert {"rnn.weight_ih_l0", "rnn.weight_hh_l0"} <= set(prune.weight_layers(net))
    del net.tied
    emb = {"module": "emb", "type": "Embedding", "weights": 400, "parameters": ["emb.weight"]}
    assert emb in prune.uncovered_weights(net)
    assert "emb" not in {r["module"] for r in prune.uncovered_weights(net, embeddings=True)}
    note = report_mod.uncovered_note(
        {"uncovered": prune.uncovered_weights(net), "baseline": {"parameters": 10_000}}
    )
    assert note.startswith("stored dense (float16), 1,945 weights (19% of the model)")
    assert (
        "embeddings with quantize.embeddings = true (shared, not pruned) or prune.embeddings"
        in note
        and "pair (Bilinear, 1,536)" in note
    )
    assert ": scale (Net, 9), emb" in note  # the model's own parameter by its name
    as32 = {"recipe": {"quantize": {"dense": "float32"}}}
    assert report_mod.uncovered_note(
        {"uncovered": prune.uncovered_weights(net), "baseline": {"parameters": 10_000}, **as32}
    ).startswith("stored dense (float32), 1,945")
    assert report_mod.uncovered_note({"baseline": {"parameters": 1}}) == ""


def test_a_recipe_naming_a_layer_that_is_not_pruned_says_so():
    """'which the model lacks' had been said of a BatchNorm the model has."""
    from compresskit.compressor.recipe import PruneSection, Recipe
    from compresskit.compressor.shrink import check_fits_recipe

    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(144, 2))
    for layer, message in [
        ("1", "names layer '1', a BatchNorm2d, which is not pruned or shared"),
        ("9", "names layer '9', which the model lacks; layers: 0, 3"),
    ]:
        recipe = Recipe(prune=PruneSection(sparsity={layer: 0.5}))
        with pytest.raises(InputError, match=message):
            check_fits_recipe(model, recipe)
