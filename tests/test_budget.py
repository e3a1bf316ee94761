"""The accuracy budget (compressor.budget, `compress shrink --max-drop`): the allocation against
a brute-force optimum, the frontier, the curves' bytes against the archive's, the search on a
small model, and the CLI's bad input."""

import dataclasses
import itertools
import json
import random

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from compresskit.compressor import budget, kmeans, report, shrink
from compresskit.compressor import recipe as recipe_mod
from compresskit.models.errors import InputError


def _brute(sizes, costs, limit):
    best = None
    for picks in itertools.product(*[range(len(s)) for s in sizes]):
        cost = sum(costs[i][k] for i, k in enumerate(picks))
        size = sum(sizes[i][k] for i, k in enumerate(picks))
        if cost <= limit and (best is None or size < best):
            best = size
    return best


def _instance(rng):
    layers = rng.randint(1, 4)
    sizes = [[rng.randint(1, 60) for _ in range(rng.randint(1, 5))] for _ in range(layers)]
    costs = [[rng.randint(0, 9) for _ in s] for s in sizes]
    return sizes, costs


def test_allocation_matches_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        sizes, costs = _instance(rng)
        for limit in range(0, sum(max(c) for c in costs) + 2):
            got = budget.allocate(sizes, costs, limit)
            want = _brute(sizes, costs, limit)
            if want is None:
                assert got is None
                continue
            assert sum(costs[i][k] for i, k in enumerate(got)) <= limit
            assert sum(sizes[i][k] for i, k in enumerate(got)) == want


def test_a_budget_of_zero_only_takes_options_that_cost_nothing():
    sizes = [[100, 40, 10], [50, 20], [9, 3]]
    costs = [[0, 0, 4], [0, 1], [2, 0]]
    picks = budget.allocate(sizes, costs, 0)
    assert picks == [1, 0, 1]  # the smallest of the free options, per layer
    assert budget.allocate([[5, 1]], [[1, 2]], 0) is None  # nothing is free: infeasible


def test_frontier_is_every_budgets_optimum():
    rng = random.Random(1)
    for _ in range(100):
        sizes, costs = _instance(rng)
        front = budget.frontier(sizes, costs)
        assert front, "some allocation always exists"
        for a, b in itertools.pairwise(front):
            assert b.bytes < a.bytes and b.cost > a.cost
        for point in front:
            assert _brute(sizes, costs, point.cost) == point.bytes
            assert sum(sizes[i][k] for i, k in enumerate(point.picks)) == point.bytes
        # the last point is the smallest allocation of all
        assert front[-1].bytes == _brute(sizes, costs, 10**6)


def _points(bytes_):
    return [budget.Point(i, b, ()) for i, b in enumerate(bytes_)]


def test_next_trial_bisects_on_bytes():
    front = _points([1000, 800, 500, 300, 200, 120, 100])
    # nothing tried yet beyond the start: between it and the smallest point
    assert budget.next_trial(front, passed=0, failed=None) == 3  # sqrt(1000*100) ~ 316
    assert budget.next_trial(front, passed=3, failed=None) == 4  # sqrt(300*100) ~ 173
    assert budget.next_trial(front, passed=4, failed=None) == 5  # sqrt(200*100) ~ 141
    assert budget.next_trial(front, passed=3, failed=5) == 4
    assert budget.next_trial(front, passed=3, failed=4) is None
    # the start failed: step back toward the cautious end
    assert budget.next_trial(front, passed=None, failed=3) in (1, 2)
    assert budget.next_trial(front, passed=None, failed=0) is None


def test_allowed_loss_and_the_validation_split_it_needs():
    assert budget.allowed_loss(0.2, 800) == 1
    assert budget.allowed_loss(0.2, 2000) == 4
    assert budget.allowed_loss(0.0, 800) == 0
    budget.check_validation(0.2, 500, "data")
    budget.check_validation(0.0, 100, "data")
    with pytest.raises(InputError, match="it needs 500 validation samples"):
        budget.check_validation(0.2, 143, "digits")
    with pytest.raises(InputError, match="at least 100 validation samples; digits has 40"):
        budget.check_validation(1.0, 40, "digits")


# --- on a model ------------------------------------------------------------------------------


def _data(n=600, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].argmax(1)).long()
    return x, y


def _model(x, y, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 32), nn.ReLU())
    model.append(nn.Linear(32, 4))
    _fit(model, x, y, epochs=30, lr=1e-2)
    return model


def _fit(model, x, y, epochs, lr, loss_fn=None):
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=g)
        for i in range(0, len(y), 64):
            j = order[i : i + 64]
            if loss_fn is None:
                loss = F.cross_entropy(model(x[j]), y[j])
            else:
                loss, _ = loss_fn(model, x[j], y[j])
            opt.zero_grad()
            loss.backward()
            opt.step()


SPEC = {"name": "mlp", "kwargs": {}}


def _hooks(x, y, xv, yv):
    def acc(m, xs, ys):
        with torch.no_grad():
            return float((m.eval()(xs).argmax(1) == ys).float().mean())

    return shrink.Hooks(
        retrain=lambda m, e, lr, fn=None, data=None: _fit(m, x, y, e, lr, fn),
        test_accuracy=lambda m: acc(m, xv, yv),
        val_accuracy=lambda m: acc(m, xv, yv),
        val_data=(xv, yv),
        train_samples=len(y),
    )


def test_curves_restore_the_model_and_price_records_as_the_archive_does(tmp_path):
    x, y = _data()
    model = _model(x, y)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    r = recipe_mod.resolve({"budget": {"max_drop": 1.0}})
    cfg = budget.BudgetConfig(max_drop=1.0, sparsities=(0.0, 0.8), bits=(2, 8))
    grid = budget.settings(model, r, cfg)
    options = budget.measure(
        model, grid, (x[:200], y[:200]), lambda layer, w: shrink.record_bytes(layer, w, r)
    )
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # every layer put back
    assert list(options) == ["0", "2", "4"]
    for opts in options.values():
        assert [(o.sparsity, o.bits) for o in opts] == [(0.0, 2), (0.0, 8), (0.8, 2), (0.8, 8)]
        by = {(o.sparsity, o.bits): o for o in opts}
        # 8 bits unpruned barely moves the outputs; 2 bits at 80% sparsity moves them most.
        assert by[0.0, 8].kl < by[0.8, 2].kl and by[0.0, 8].kl < 1e-3
        assert by[0.8, 2].bytes < by[0.0, 2].bytes < by[0.0, 8].bytes
        assert by[0.0, 8].lost <= 2
    # The bytes the curves price a layer at are the bytes its archive record takes coded alone
    # (format 3), an upper bound on its share of the archive's one stream: later records code
    # their byte planes with models the earlier ones trained.
    rep = shrink.shrink(
        model,
        SPEC,
        recipe_mod.resolve(
            {
                "prune": {"sparsity": {"0": 0.8, "2": 0.5}, "rounds": 1, "retrain_epochs": 0},
                "quantize": {"bits": {"0": 3, "2": 4, "4": 8}, "finetune_epochs": 0},
                "export": {"enabled": False},
            }
        ),
        _hooks(x, y, x[:200], y[:200]),
        tmp_path,
    )
    rows = {row["layer"]: row for row in rep["layers"]}
    assert rows["4"]["encoding"].startswith("dense")  # 128 weights: dense is smaller
    for name, layer in kmeans.layers(model).items():
        w = model.get_submodule(layer.module).weight
        priced = shrink.record_bytes(layer, w, r)
        assert rows[name]["bytes"] <= priced + 4, name  # 4: the coder's 32-bit words


def _search(tmp_path, max_drop, said=False, prune=None, **budget_keys):
    x, y = _data()
    xv, yv = _data(300, seed=1)
    model = _model(x, y)
    r = recipe_mod.resolve(
        {
            "budget": {
                "max_drop": max_drop,
                "trials": 3,
                "sparsities": [0.0, 0.5, 0.9],
                "bits": [2, 4, 8],
                **budget_keys,
            },
            "prune": {"rounds": 1, "retrain_epochs": 2, **(prune or {})},
            "quantize": {"finetune_epochs": 1},
            "export": {"enabled": False},
        }
    )
    base = int((model(xv).argmax(1) == yv).sum())
    lines: list[str] = []
    hooks = dataclasses.replace(_hooks(x, y, xv, yv), info=lines.append)
    m, rep = budget.search(model, SPEC, r, hooks, tmp_path)
    return (base, m, rep, xv, yv, lines) if said else (base, m, rep, xv, yv)


@pytest.mark.parametrize("max_drop", [0.0, 2.0])
def test_search_keeps_the_smallest_archive_within_the_budget(tmp_path, max_drop):
    base, m, rep, xv, yv = _search(tmp_path, max_drop)
    b = rep["budget"]
    assert b["allowed_lost"] == budget.allowed_loss(max_drop, 300)
    assert 1 <= len(b["trials"]) <= 3
    won = b["trials"][b["chosen_trial"] - 1]
    # What the report says the kept model lost is what it loses, measured again here.
    lost = base - int((m(xv).argmax(1) == yv).sum())
    assert won["lost"] == lost
    within = [t for t in b["trials"] if t["within_budget"]]
    assert b["met"] == bool(within)
    for t in b["trials"]:
        assert t["within_budget"] == (
            t["lost"] <= b["allowed_lost"] and t["val_soft_drop"] <= max_drop
        )
    if within:  # the smallest archive of those within the budget; with 0, nothing lost
        assert won["archive_bytes"] == min(t["archive_bytes"] for t in within)
        assert lost <= b["allowed_lost"]
    # The archive left in the folder is the kept trial's, and no trial folder is left over.
    assert (tmp_path / "model.dcz").stat().st_size == won["archive_bytes"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.dcz"]
    # The kept model obeys the settings the report gives, and the recipe re-runs them.
    for name, s in b["layers"].items():
        w = m.get_submodule(name).weight.detach()
        assert torch.unique(w[w != 0]).numel() <= 2 ** s["bits"]
        assert rep["recipe"]["quantize"]["bits"][name] == s["bits"]
        assert rep["recipe"]["prune"]["sparsity"][name] == s["sparsity"]
    assert rep["recipe"]["budget"]["max_drop"] == "off"
    assert b["asked_recipe"]["budget"]["max_drop"] == max_drop


def test_search_respects_layers_the_recipe_fixes(tmp_path):
    x, y = _data()
    model = _model(x, y)
    r = recipe_mod.resolve(
        {
            "budget": {"max_drop": 5.0},
            "prune": {"sparsity": {"0": 0.6}},
            "quantize": {"bits": {"4": 6}},
        }
    )
    grid = budget.settings(model, r, budget.BudgetConfig.from_recipe(r.budget))
    assert {s for s, _ in grid["0"][1]} == {0.6}
    assert {b for _, b in grid["4"][1]} == {6}
    assert len(grid["2"][1]) == 9 * 6
    fixed = recipe_mod.resolve(
        {
            "budget": {"max_drop": 5.0},
            "prune": {"sparsity": {"0": 0.6, "2": 0.5, "4": 0.1}},
            "quantize": {"bits": {"0": 4, "2": 4, "4": 6}},
        }
    )
    with pytest.raises(InputError, match="fix both for every layer"):
        budget.settings(model, fixed, budget.BudgetConfig.from_recipe(fixed.budget))


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"budget": {"max_drop": -1}}, "budget.max_drop = -1 is impossible"),
        ({"budget": {"max_drop": 100}}, "budget.max_drop = 100 is impossible"),
        ({"budget": {"max_drop": "0.2"}}, "budget.max_drop = '0.2' is impossible"),
        ({"budget": {"sparsities": [0.5, 1.0]}}, "budget.sparsities"),
        ({"budget": {"bits": [0]}}, "budget.bits"),
        ({"budget": {"max_drop": 1, "trials": 0}}, "budget.trials"),
        (
            {"budget": {"max_drop": 1}, "prune": {"sparsity": 0.9}},
            "prune.sparsity = 0.9 sets them all",
        ),
        ({"budget": {"max_drop": 1}, "prune": {"quality": 1.0}}, "prune.quality = 1.0"),
        ({"budget": {"max_drop": 1}, "huffman": {"enabled": False}}, "needs quantize and huffman"),
    ],
)
def test_recipe_refuses_an_impossible_budget(raw, message):
    with pytest.raises(InputError, match=message.replace(".", r"\.").replace("(", r"\(")):
        recipe_mod.resolve(raw)


def test_a_budget_retrains_with_distillation_unless_told():
    assert recipe_mod.resolve({}).train.distill == 0.0
    assert recipe_mod.resolve({"budget": {"max_drop": 1}}).train.distill == 0.7
    told = recipe_mod.resolve({"budget": {"max_drop": 1}, "train": {"distill": 0.0}})
    assert told.train.distill == 0.0
    # dry-run's TOML reads back to the same recipe
    r = recipe_mod.resolve({"budget": {"max_drop": 0.5, "bits": [3, 5]}})
    import tomllib

    assert recipe_mod.resolve(tomllib.loads(recipe_mod.dumps(r))) == r


# --- the CLI ---------------------------------------------------------------------------------

FAST = """
[budget]
trials = 2
sparsities = [0.0, 0.8, 0.9]
bits = [3, 5]
[prune]
rounds = 1
retrain_epochs = 1
[quantize]
finetune_epochs = 1
[export]
enabled = false
"""


@pytest.mark.parametrize("search", ["layers", "scale"])
def test_shrink_max_drop_end_to_end(run, tmp_path, search):
    ck = tmp_path / "lenet300.pt"
    assert run("train", "--model", "lenet300", "--epochs", "3", "--out", ck, "-q").exit_code == 0
    (tmp_path / "fast.toml").write_text(
        FAST.replace("[budget]\n", f'[budget]\nsearch = "{search}"\n')
    )
    out = tmp_path / "shrunk"
    args = ["--recipe", tmp_path / "fast.toml", "--max-drop", "1", "--out", out, "-q"]
    result = run("shrink", ck, *args, *(["--json"] if search == "layers" else []))
    assert result.exit_code == 0, result.stderr
    report = json.loads((out / "report.json").read_text())
    b = report["budget"]
    if search == "layers":
        assert result.json()["budget"] == b
    else:  # the summary line names the factor the kept trial scaled the recipe's sparsities by
        won = b["trials"][b["chosen_trial"] - 1]
        assert f"kept fractions ×{won['scale']:.3g} of the recipe's" in result.stdout
    assert b["search"] == search
    assert b["validation_samples"] == 143 and b["allowed_lost"] == 1
    assert len(b["trials"]) <= 2 and set(b["layers"]) == {"fc1", "fc2", "fc3"}
    assert report["recipe"]["budget"]["max_drop"] == "off"
    md = (out / "report.md").read_text()
    assert "## Accuracy budget: at most 1 points" in md
    # 1 of 143 samples decides the budget: the report says so and what would resolve it.
    assert "**Coarse:** --max-drop 1 allows 1 of 143 validation samples" in md
    assert "500 or more validation samples" in md
    # The kept recipe re-runs without the search, from the report.
    (tmp_path / "kept.toml").write_text(
        md.split("## Recipe")[1].split("```toml\n")[1].split("```")[0]
    )
    again = run("shrink", ck, "--recipe", tmp_path / "kept.toml", "--out", tmp_path / "b", "-q")
    assert again.exit_code == 0, again.stderr
    assert (tmp_path / "b" / "model.dcz").read_bytes() == (out / "model.dcz").read_bytes()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-drop", "-1"], "budget.max_drop = -1.0 is impossible"),
        (["--max-drop", "100"], "budget.max_drop = 100.0 is impossible"),
        (["--max-drop", "0.2"], "it needs 500 validation samples"),
        (["--max-drop", "1", "--data", "npz"], "at least 100 validation samples; npz:"),
        (["--max-drop", "lots"], "give points such as 0.5, or 'off'"),
    ],
)
def test_shrink_max_drop_bad_input(run, tmp_path, npz_file, args, message):
    args = [f"npz:{npz_file}" if a == "npz" else a for a in args]
    data = args[args.index("--data") + 1] if "--data" in args else "digits"
    ck = tmp_path / "lenet300.pt"
    trained = run("train", "--model", "lenet300", "--data", data, "--epochs", "1", "--out", ck)
    assert trained.exit_code == 0, trained.stderr
    result = run("shrink", ck, *args, "--out", tmp_path / "o", "-q")
    assert result.exit_code == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "o").exists()


def test_a_budget_of_one_or_two_samples_is_called_coarse():
    note = budget.coarseness(0.2, 800)  # MNIST t10k's split: 1 sample
    assert note.startswith("--max-drop 0.2 allows 1 of 800 validation samples")
    assert "2,500 or more validation samples" in note  # 5 samples at 0.2 points
    assert budget.coarseness(0.25, 800) is not None  # 2 samples: still coarse
    assert budget.coarseness(0.375, 800) is None  # 3 samples
    assert budget.coarseness(0.2, 6000) is None  # MNIST's train files: 12 samples
    assert budget.coarseness(0.0, 800) is None  # lose none: nothing to resolve


def test_soft_trials_are_noted_as_outside_the_curves_model():
    note = budget.method_note("soft")
    assert note.startswith('quantize.method = "soft": the search prices settings with k-means')
    assert budget.method_note("kmeans") is None
    trial = {
        "trial": 1, "lost": 3, "val_drop": 0.375, "val_drop_interval": [-0.375, 1.125],
        "predicted_drop": 0.0, "val_soft_drop": 0.23, "archive_bytes": 36_652,
        "within_budget": False,
    }  # fmt: skip
    b = {
        "max_drop": 0.2, "validation_samples": 800, "allowed_lost": 1, "grid":
        {"sparsities": [0.0], "bits": [5]}, "frontier_points": 1, "trials": [trial],
        "chosen_trial": 1, "met": False, "val_drop": 0.375, "predicted_drop": 0.0,
        "val_soft_drop": 0.23, "coarse": None, "method_note": note,
        "layers": {"fc1": {"sparsity": 0.0, "bits": 5, "lost_alone": 0, "bytes": 102_074}},
    }  # fmt: skip
    assert f"**Note:** {note}." in "\n".join(report._budget_lines({"budget": b}))
    b["method_note"] = None
    assert "**Note:**" not in "\n".join(report._budget_lines({"budget": b}))


# --- the scale search ------------------------------------------------------------------------


def test_scaled_multiplies_kept_fractions():
    base = {"fc1": 0.92, "fc2": 0.5, "out": 0.0}
    assert budget.scaled(base, 0) == base
    one = budget.scaled(base, 1)  # kept fractions x0.7; a layer the recipe leaves whole stays so
    assert one == {"fc1": 0.944, "fc2": 0.65, "out": 0.0}
    assert budget.scaled(base, -3) == {"fc1": round(1 - 0.08 / 0.343, 4), "fc2": 0.0, "out": 0.0}
    assert budget.scaled(base, 40)["fc1"] == 0.9999  # never every weight
    assert budget.scaled(0.9, 1) == 0.93  # one number stays one (prune.scope "global")


def test_base_sparsity_is_the_recipes_own():
    x, y = _data()
    model = _model(x, y)

    def base(prune):
        r = recipe_mod.resolve({"budget": {"max_drop": 1, "search": "scale"}, "prune": prune})
        return budget.base_sparsity(model, r)

    assert base({}) == shrink.default_sparsity(model) == {"0": 0.92, "2": 0.92, "4": 0.75}
    assert base({"sparsity": 0.8}) == 0.8
    assert base({"sparsity": {"2": 0.5}}) == {"2": 0.5}  # the layers left out stay unpruned
    # A number under prune.scope "global" scales as one number: each trial's recipe is valid.
    r = recipe_mod.resolve(
        {
            "budget": {"max_drop": 1, "search": "scale"},
            "prune": {"sparsity": 0.8, "scope": "global"},
        }
    )
    budget.check(model, r)
    assert budget._scaled_recipe(r, budget.scaled(0.8, 1)).prune.sparsity == 0.86


def _walk(edge: float, noise: dict[float, bool] | None = None, limit: int = 20):
    """The steps the scale search tries against an oracle: within the budget below `edge`
    (a step's verdict flipped where `noise` says)."""
    verdicts: list[tuple[float, bool]] = []
    k = budget.next_step(None, None)
    while k is not None and len(verdicts) < limit:
        verdicts.append((k, (noise or {}).get(k, k < edge)))
        k = budget.next_step(*budget.edges(verdicts))
        if any(k == v for v, _ in verdicts):
            k = None
    return verdicts


@pytest.mark.parametrize("edge", [2.6, 0.3, -1.4])
def test_scale_search_brackets_the_edge(edge):
    steps = _walk(edge)
    assert steps[0] == (0.0, edge > 0.0)  # the recipe as written first
    passed, failed = budget.edges(steps)
    # It ends with the last pass and the first fail within the resolution of each other,
    # around the edge, having only stepped outward until both sides were found.
    assert passed < edge <= failed
    assert failed - passed <= budget.SCALE_RESOLUTION
    assert len(steps) <= 2 + abs(round(edge)) + 3


def test_scale_search_ignores_a_fail_below_a_pass_and_gives_up_at_its_bounds():
    # Step 1 fails by luck: the search bisects below it, not knowing that 2 would pass.
    steps = _walk(2.6, noise={1.0: False})
    assert [k for k, _ in steps[:3]] == [0.0, 1.0, 0.5]
    # Had 2 passed beyond that fail, the edge moves past the pass and the fail is ignored.
    assert budget.edges([(0.0, True), (1.0, False), (2.0, True)]) == (2.0, None)
    # Nothing passes: it steps back to the most cautious step and stops there.
    steps = _walk(-10)
    assert [k for k, _ in steps] == [0.0, -1.0, -2.0, -3.0]
    # Everything passes: it steps on until the most aggressive step.
    assert _walk(99, limit=99)[-1][0] == budget.SCALE_AGGRESSIVE


def test_recipe_resolves_and_checks_the_search():
    def search(raw):
        r = recipe_mod.resolve(raw)
        return budget.BudgetConfig.from_recipe(r.budget, r.quantize.method).search

    assert search({"budget": {"max_drop": 1}}) == "layers"
    assert search({"budget": {"max_drop": 1}, "quantize": {"method": "soft"}}) == "scale"
    assert search({"budget": {"max_drop": 1, "search": "scale"}}) == "scale"
    soft_layers = {"budget": {"max_drop": 1, "search": "layers"}, "quantize": {"method": "soft"}}
    assert search(soft_layers) == "layers"
    # A single sparsity is what the scale search scales; the layer search refuses it.
    assert search({"budget": {"max_drop": 1, "search": "scale"}, "prune": {"sparsity": 0.9}})
    with pytest.raises(InputError, match='or set budget.search = "scale"'):
        recipe_mod.resolve({"budget": {"max_drop": 1}, "prune": {"sparsity": 0.9}})
    for raw, message in [
        ({"budget": {"search": "grid"}}, "budget.search = 'grid' is impossible"),
        (
            {"budget": {"max_drop": 1, "search": "scale"}, "prune": {"sparsity": "auto"}},
            "prune.sparsity = 'auto' sets none before the run",
        ),
        (
            {"budget": {"max_drop": 1, "search": "scale"}, "prune": {"quality": 1.0}},
            "prune.quality = 1.0 sets none",
        ),
        (
            {"budget": {"max_drop": 1, "search": "scale"}, "prune": {"enabled": False}},
            "prune is disabled",
        ),
    ]:
        with pytest.raises(InputError, match=message.replace(".", r"\.")):
            recipe_mod.resolve(raw)


def test_scale_search_keeps_the_smallest_archive_within_the_budget(tmp_path):
    base, m, rep, xv, yv, said = _search(tmp_path, 2.0, search="scale", trials=4, said=True)
    b = rep["budget"]
    # Each trial's progress lines, its verdict included, carry its own number.
    for t in b["trials"]:
        n = t["trial"]
        verdict = [line for line in said if line.startswith(f"budget trial {n}/4: archive")]
        assert len(verdict) == 1 and f"{t['archive_bytes']:,} bytes" in verdict[0]
    assert b["search"] == "scale" and "curves" not in b
    steps = [t["step"] for t in b["trials"]]
    assert steps[0] == 0.0 and len(steps) == len(set(steps)) <= 4
    default = shrink.default_sparsity(m)
    for t in b["trials"]:  # each trial ran the recipe's sparsities scaled by its factor
        assert t["sparsity"] == budget.scaled(default, t["step"])
        assert t["scale"] == pytest.approx(budget.SCALE_STEP ** t["step"])
    won = b["trials"][b["chosen_trial"] - 1]
    assert won["lost"] == base - int((m(xv).argmax(1) == yv).sum())
    within = [t for t in b["trials"] if t["within_budget"]]
    assert b["met"] == bool(within)
    if within:
        assert won["archive_bytes"] == min(t["archive_bytes"] for t in within)
    assert (tmp_path / "model.dcz").stat().st_size == won["archive_bytes"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.dcz"]
    # The recipe re-runs the kept trial; the report's layers are its sparsities and bits.
    assert rep["recipe"]["prune"]["sparsity"] == won["sparsity"]
    assert rep["recipe"]["budget"]["max_drop"] == "off"
    assert {n: r["sparsity"] for n, r in b["layers"].items()} == won["sparsity"]
    assert {r["bits"] for r in b["layers"].values()} == {5}  # fc_bits, as the recipe sets
    text = "\n".join(report._budget_lines(rep))
    assert "multiplied every layer's kept fraction" in text
    assert f"| {won['trial']} | {won['scale']:.3g} |" in text


def test_scale_search_scales_one_global_sparsity_as_one_number(tmp_path):
    prune = {"sparsity": 0.8, "scope": "global"}
    _, m, rep, *_ = _search(tmp_path, 2.0, search="scale", trials=2, prune=prune)
    b = rep["budget"]
    for t in b["trials"]:
        assert t["sparsity"] == budget.scaled(0.8, t["step"])
    won = b["trials"][b["chosen_trial"] - 1]
    # One threshold over all layers: the kept model's zeros are that fraction of them all.
    ws = [m.get_submodule(n).weight.detach() for n in ("0", "2", "4")]
    zeros = sum(int((w == 0).sum()) for w in ws) / sum(w.numel() for w in ws)
    assert zeros == pytest.approx(won["sparsity"], abs=0.01)
    assert rep["recipe"]["prune"]["sparsity"] == won["sparsity"]
    assert rep["recipe"]["prune"]["scope"] == "global"
    assert {n: r["sparsity"] for n, r in b["layers"].items()} == dict.fromkeys(
        ["0", "2", "4"], won["sparsity"]
    )
    assert b["scale_step"] == budget.SCALE_STEP


def test_max_drop_off_turns_a_recipes_budget_off(run, tmp_path):
    (tmp_path / "b.toml").write_text("[budget]\nmax_drop = 0.5\n")
    result = run("shrink", "nothing.pt", "--recipe", tmp_path / "b.toml", "--dry-run", "--json")
    assert result.json()["recipe"]["budget"]["max_drop"] == 0.5
    result = run(
        "shrink", "nothing.pt", "--recipe", tmp_path / "b.toml", "--max-drop", "off",
        "--dry-run", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert result.json()["recipe"]["budget"]["max_drop"] == "off"


@pytest.mark.parametrize("n_val", [143, 800, 1350])
def test_the_max_drop_suggested_for_a_small_split_is_accepted(n_val):
    # 100/1350 = 0.074 was rounded to 0.07, which the same check then refused
    from compresskit.compressor import budget as budget_mod

    with pytest.raises(InputError) as e:
        budget_mod.check_validation(0.01, n_val, "npz:x")
    suggested = float(str(e.value).split("a max_drop of ")[1].split()[0])
    budget_mod.check_validation(suggested, n_val, "npz:x")
