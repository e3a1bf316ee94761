"""Latency-aware structured pruning (`compressor.measure.layertime`, `channels.target_latency`):
each layer's measured time on ONNX Runtime mapped back to its module, the two-point fit of a
layer's time against its MACs, the two-resource allocation against a brute-force optimum, and
the channels stage reaching a time goal as well as a MACs goal."""

import itertools
import math
from types import SimpleNamespace

import onnx
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn

from compresskit.compressor import channels, export, recipe, report
from compresskit.compressor.export import int8
from compresskit.compressor.flops import module_macs, torch_macs
from compresskit.compressor.measure import layertime
from compresskit.models import thin, zoo
from compresskit.models.errors import InputError


def tiny(name="resnet_se", shape=(3, 16, 16)):
    model = zoo.tiny(name, in_shape=shape, seed=0).eval()
    return model, torch.randn(8, *shape, generator=torch.Generator().manual_seed(1))


def test_module_macs_sum_to_the_model_macs():
    model, x = tiny()
    per = module_macs(model, x[:1])
    assert sum(per.values()) == torch_macs(model, x[:1])
    layers = {
        n for n, m in model.named_modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))
    }
    assert set(per) == layers and all(v > 0 for v in per.values())


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("name", ["resnet_se", "vit", "textcls"])
def test_every_layer_the_forward_runs_gets_its_kernel_time(name, quantized, tmp_path):
    # A CNN with depthwise convs and squeeze-excite; a ViT and a text classifier (int64 token
    # ids), whose Linears on (N, L, D) inputs export as MatMuls reading a transposed copy of
    # the weight: found by the FP32 file's name scopes, which the INT8 file no longer has
    if name == "textcls":
        model = zoo.tiny(name, seed=0).eval()
        x = torch.randint(0, 10, (8, 16), generator=torch.Generator().manual_seed(1))
    else:
        model, x = tiny(name, (3, 16, 16))
    quant = int8.QuantConfig() if quantized else None
    calib = x.numpy() if quantized else None
    got = layertime.measure(model, x[:2], tmp_path, export.ExportConfig(), quant, calib, runs=20)
    assert got.file == ("int8" if quantized else "fp32")
    # Every Conv and Linear is found through the weight its node reads, whatever ORT fused
    # (MultiheadAttention's out_proj too, though its MACs count under the attention module)
    counted = set(module_macs(model, x[:1]))
    assert counted <= set(got.layers)
    assert {n.rsplit(".", 1)[0] for n in set(got.layers) - counted} <= counted
    assert all(t > 0 for t in got.layers.values())
    assert got.total_us > sum(got.layers.values()) > 0 and got.other_us >= 0
    assert got.run_us > 0
    assert not list(tmp_path.iterdir())  # the exported and quantized files are removed


def _graph():
    """conv1 (INT8 through a DequantizeLinear), then Relu; conv12 reads its FP32 weight."""
    w1 = helper.make_tensor("conv1.weight_quantized", TensorProto.INT8, [2, 1, 1, 1], [1, 1])
    w2 = helper.make_tensor("conv12.weight", TensorProto.FLOAT, [2, 2, 1, 1], [1.0] * 4)
    s = helper.make_tensor("s", TensorProto.FLOAT, [], [1.0])
    nodes = [
        helper.make_node("DequantizeLinear", ["conv1.weight_quantized", "s"], ["w1"], name="dq"),
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="node_Conv_1"),
        helper.make_node("Relu", ["c1"], ["relu_1"], name="node_Relu_2"),
        helper.make_node("Conv", ["relu_1", "conv12.weight"], ["y"], name="node_Conv_12"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 2, 2])],
        [w1, w2, s],
    )
    return helper.make_model(graph)


def test_kernel_names_map_to_modules_by_hand(tmp_path):
    path = tmp_path / "g.onnx"
    onnx.save(_graph(), str(path))
    kernels = {
        "node_Conv_12/MatMulAddFusion": "QLinearConv",
        "node_Conv_1_token_3": "QLinearConv",
        "relu_1_nchwc": "Conv",
        "fused node_Conv_12": "FusedGemm",
        "node_Conv_1_DequantizeLinear": "DequantizeLinear",
        "dq": "DequantizeLinear",
        "other": "Add",
    }
    got = layertime.kernel_owners(path, kernels, {"conv1", "conv12"})
    # The longest node name wins (node_Conv_12 is not node_Conv_1's), an NCHWc kernel named
    # after the Relu it absorbed belongs to the Conv before it, and glue belongs to nobody,
    # whatever its name starts with.
    assert got == {
        "node_Conv_12/MatMulAddFusion": "conv12",
        "node_Conv_1_token_3": "conv1",
        "relu_1_nchwc": "conv1",
        "fused node_Conv_12": "conv12",
    }
    # A module the model lacks owns nothing
    assert layertime.kernel_owners(path, kernels, {"conv12"}) == {
        "node_Conv_12/MatMulAddFusion": "conv12",
        "fused node_Conv_12": "conv12",
    }


def _times(run, layers, file="int8"):
    return SimpleNamespace(run_us=run, layers=layers, file=file)


def test_the_two_point_fit_against_a_hand_computation():
    macs = {"a": 1000, "b": 1000, "c": 1000, "d": 1000, "e": 0}
    half = {"a": 250, "b": 250, "c": 250, "d": 1000}
    # a: 5 us + 0.02 us/MAC; b: did not get faster (all fixed); c: fell more than in
    # proportion (noise: all per-MAC); d: not cut in the copy (proportional); e: no MACs.
    full = _times(200.0, {"a": 25.0, "b": 10.0, "c": 40.0, "d": 30.0, "e": 3.0})
    halved = _times(150.0, {"a": 10.0, "b": 11.0, "c": 4.0, "d": 30.0})
    fit = channels.fit_layers(macs, full, half, halved)
    assert fit.layers["a"] == pytest.approx((5.0, 0.02))
    assert fit.layers["b"] == (10.0, 0.0)
    assert fit.layers["c"] == (0.0, 0.04)
    assert fit.layers["d"] == (0.0, 0.03)
    assert "e" not in fit.layers
    # The rest of the run: 200 - 105 us at 4,000 MACs, 150 - 60 at 1,750
    assert fit.other_us_per_mac == pytest.approx(5 / 2250)
    assert fit.fixed_us == pytest.approx(95 - 4000 * 5 / 2250)
    # The fit reproduces both timed runs, and predicts a cut model from its MACs
    assert fit.estimate(macs) == pytest.approx(200.0)
    assert fit.estimate(half) == pytest.approx(150.0)
    cut = {"a": 500, "b": 500, "c": 500, "d": 500}
    rest = fit.fixed_us + 2000 * 5 / 2250
    assert fit.estimate(cut) == pytest.approx(rest + (5 + 10) + 10 + 20 + 15)
    assert fit.measured_us == (200.0, 150.0) and fit.to_dict()["layers"]["a"]["fixed_us"] == 5.0
    # A rest that grew as the MACs fell (noise) is held constant, never extrapolated upwards
    flat = channels.fit_layers(macs, full, half, _times(250.0, halved.layers))
    assert flat.other_us_per_mac == 0.0 and flat.estimate(cut) < flat.estimate(macs)


def test_two_resource_allocation_against_a_brute_force_optimum():
    base = 0.9
    curves = {
        "a": {0.2: 0.9, 0.4: 0.89, 0.6: 0.85, 0.8: 0.7},
        "b": {0.2: 0.88, 0.4: 0.8, 0.6: 0.7, 0.8: 0.5},
        "c": {0.2: 0.9, 0.4: 0.9, 0.6: 0.899, 0.8: 0.89},
    }
    macs = {
        "a": {0.2: 100, 0.4: 200, 0.6: 300, 0.8: 400},
        "b": {0.2: 300, 0.4: 600, 0.6: 900, 0.8: 1200},
        "c": {0.2: 50, 0.4: 100, 0.6: 150, 0.8: 200},
    }
    # c's MACs are few but slow: most of the time is there
    time = {
        "a": {0.2: 5.0, 0.4: 10.0, 0.6: 15.0, 0.8: 20.0},
        "b": {0.2: 10.0, 0.4: 20.0, 0.6: 30.0, 0.8: 40.0},
        "c": {0.2: 25.0, 0.4: 50.0, 0.6: 75.0, 0.8: 100.0},
    }
    cost = lambda pick: sum(base - curves[n][f] for n, f in pick.items() if f)  # noqa: E731
    gain = lambda d, pick: sum(d[n][f] for n, f in pick.items() if f)  # noqa: E731
    options = [0.0, *channels.GRID]
    picks = [dict(zip(curves, fs, strict=True)) for fs in itertools.product(options, repeat=3)]
    H = channels.HEADROOM
    # Savings are counted in 200 buckets per goal, rounded down (what is promised is met), so
    # the answer is optimal up to one bucket per layer: never cheaper than the exact optimum,
    # never dearer than the optimum with goals raised by three buckets.
    slack = 1 + 3 / 200
    for need, time_need in [(400, 60), (400, 110), (700, 30), (300, 120), (350, 95)]:
        got = channels.allocate(base, curves, macs, need / H, time, time_need / H)
        assert gain(macs, got) >= need and gain(time, got) >= time_need, (need, time_need)
        exact = [p for p in picks if gain(macs, p) >= need and gain(time, p) >= time_need]
        tight = [
            p for p in exact if gain(macs, p) >= need * slack and gain(time, p) >= time_need * slack
        ]
        assert min(map(cost, exact)) - 1e-9 <= cost(got) <= min(map(cost, tight)) + 1e-9
    # The time goal changes the answer: MACs alone leave c's time where it is
    macs_only = channels.allocate(base, curves, macs, 400 / H)
    with_time = channels.allocate(base, curves, macs, 400 / H, time, 110 / H)
    assert gain(time, macs_only) < 110 <= gain(time, with_time)
    # A time goal no choice reaches: every layer at its largest cut
    assert channels.allocate(base, curves, macs, 400 / H, time, 10**6) == dict.fromkeys(curves, 0.8)


def _synthetic_times(slow: str):
    """A deterministic 'profile': each layer 2 us + its MACs x 1e-4 us, `slow` 50x per MAC."""

    def layer_times(model):
        per = module_macs(model, torch.zeros(1, 3, 16, 16))
        layers = {n: 2.0 + m * (5e-3 if n == slow else 1e-4) for n, m in per.items()}
        return _times(10.0 + sum(layers.values()), layers)

    return layer_times


@pytest.mark.parametrize("scope", ["layer", "sensitivity"])
def test_thin_reaches_the_time_goal_as_well_as_the_macs_goal(scope):
    model, x = tiny()
    slow = "blocks.0.block.0"
    kept0 = sum(channels.widths(model).values())

    def evaluate(m):
        # "accuracy" falls alike with every channel removed: the time per channel decides
        return sum(channels.widths(m).values()) / kept0

    cfg = channels.ChannelsConfig(
        target_macs=0.8, target_latency=0.5, rounds=2, retrain_epochs=0, scope=scope
    )
    with pytest.raises(InputError, match="target_latency"):
        channels.thin_(tiny()[0], x[:2], cfg, evaluate=evaluate)
    record = channels.thin_(
        model, x[:2], cfg, evaluate=evaluate, layer_times=_synthetic_times(slow)
    )
    lat = record["latency_model"]
    before, after = lat["estimated_us"]
    truth = _synthetic_times(slow)(model).run_us  # the same formula on the thinned model
    assert lat["reached"] and after <= 0.5 * before * (1 + 1e-9)
    assert after == pytest.approx(truth, rel=1e-6) and before == pytest.approx(
        lat["measured_us"][0]
    )
    assert record["reached"] and record["macs_ratio"] <= 0.8
    # The MACs goal alone was met long before: the time goal cut further
    assert record["macs_ratio"] < 0.7
    widths = {r["name"]: r for r in record["layers"]}
    if scope == "sensitivity":  # the slow layer's channels are where the time is
        assert (
            record["sensitivity"]["time_saved"] and widths[slow]["after"] < widths[slow]["before"]
        )
    assert [r.get("estimated_us") is not None for r in record["rounds"]] == [True, True]


def test_allocated_cuts_that_fall_short_are_finished_evenly(monkeypatch):
    """The allocation adds layers' savings as if independent; when the combined cut falls
    short (coupled layers overlap; on another machine's profile by another amount), the last
    round cuts on evenly until both goals hold, never past max_ratio of a layer."""
    model, x = tiny()
    slow = "blocks.0.block.0"
    kept0 = sum(channels.widths(model).values())

    def evaluate(m):
        return sum(channels.widths(m).values()) / kept0

    # an allocation far short of both goals: every layer 5%
    monkeypatch.setattr(
        channels, "allocate", lambda _b, curves, *a, **k: dict.fromkeys(curves, 0.05)
    )
    messages = []
    cfg = channels.ChannelsConfig(
        target_macs=0.7, target_latency=0.6, rounds=2, retrain_epochs=0, scope="sensitivity"
    )
    record = channels.thin_(
        model, x[:2], cfg, evaluate=evaluate, layer_times=_synthetic_times(slow),
        info=messages.append,
    )  # fmt: skip
    lat = record["latency_model"]
    before, after = lat["estimated_us"]
    assert record["reached"] and record["macs_ratio"] <= 0.7
    assert lat["reached"] and after <= 0.6 * before * (1 + 1e-9)
    assert after == pytest.approx(_synthetic_times(slow)(model).run_us, rel=1e-6)
    short = record["rounds"][-1]["even_cut_from"]
    assert short["estimated_us"] > 0.6 * before or short["macs"] > 0.7 * record["macs"][0]
    assert "even_cut_from" not in record["rounds"][0]
    assert any("fell short" in m for m in messages)
    md = "\n".join(report._channel_lines({"channels": record | {"test_accuracy": [0.9, 0.9]}}))
    assert "stopped at" in md and "the last round cut on evenly from there" in md
    for row in record["layers"]:  # max_ratio (0.9) of each layer's original width at most
        assert row["after"] >= math.floor(0.1 * row["before"])
    # The replayable plan reproduces the thinned model from a fresh copy
    again = tiny()[0]
    thin.apply_(again, record["plan"])
    assert {k: v.shape for k, v in again.state_dict().items()} == {
        k: v.shape for k, v in model.state_dict().items()
    }


class _Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 200), nn.Linear(200, 200), nn.Linear(200, 10)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def test_ratios_now_aim_at_a_fraction_of_the_original_width():
    model, _ = tiny()
    widths0 = channels.widths(model)
    name = channels.prunable(model)[0]
    w = widths0[name]
    doubled = {n: 2 * v for n, v in widths0.items()}  # as if half of every layer were cut
    now = channels._ratios_now(model, doubled, [], {name: 0.9})
    keep = math.ceil(0.1 * 2 * w - 1e-9)
    assert int(w * (1 - now[name])) == keep  # what torch-pruning keeps: no channel less
    assert channels._ratios_now(model, doubled, [name], {name: 0.9}) == {}  # kept whole
    tenfold = {n: 10 * v for n, v in widths0.items()}  # already cut to 10%: nothing left
    assert channels._ratios_now(model, tenfold, [], dict.fromkeys(widths0, 0.9)) == {}
    wide = _Wide()  # 200 wide: 10% is 20 channels, rounded up to 24 for round_to = 8
    rounded = channels._ratios_now(wide, channels.widths(wide), [], {"a": 0.9}, round_to=8)
    assert int(200 * (1 - rounded["a"])) == 24


@pytest.mark.parametrize("alloc", [0.9, 0.5])
def test_the_allocation_holds_over_rounds_and_max_ratio_over_the_even_cut(alloc, monkeypatch):
    """Each round's pruner starts from a thinner model: the allocation's fractions (of the
    original width) must not compound, and the even cut stops at max_ratio of the original."""
    torch.manual_seed(0)
    model, x = _Wide(), torch.randn(8, 16)
    monkeypatch.setattr(
        channels, "allocate", lambda _b, curves, *a, **k: dict.fromkeys(curves, alloc)
    )
    cfg = channels.ChannelsConfig(
        target_macs=0.02, rounds=3, retrain_epochs=0, scope="sensitivity", max_ratio=0.9
    )
    record = channels.thin_(model, x[:2], cfg, evaluate=lambda m: 1.0)
    after = {r["name"]: r["after"] for r in record["layers"]}
    assert after["a"] == after["b"] == 20  # 10% of 200 kept, not 19, not 10
    assert not record["reached"]  # 2% of the MACs is past what max_ratio allows
    assert "even_cut_from" in record["rounds"][-1]


@pytest.mark.parametrize("value", [0, 1.5, "fast", True])
def test_a_bad_target_latency_is_refused(value):
    with pytest.raises(InputError, match="channels.target_latency"):
        recipe.resolve({"channels": {"target_latency": value}})
    assert recipe.resolve({"channels": {"target_latency": 0.6}}).channels.target_latency == 0.6
    assert recipe.resolve({}).channels.target_latency is None


def test_allocation_keeps_its_macs_only_answer_without_a_time_goal():
    curves = {"a": {0.2: 0.9, 0.4: 0.8}, "b": {0.2: 0.85, 0.4: 0.7}}
    saved = {"a": {0.2: 10, 0.4: 20}, "b": {0.2: 10, 0.4: 20}}
    one = channels.allocate(0.9, curves, saved, 16 / channels.HEADROOM)
    two = channels.allocate(0.9, curves, saved, 16 / channels.HEADROOM, None, 0.0)
    # a's first cut is free and b's costs 0.05: both, not a's second cut (0.1)
    assert one == two == {"a": 0.2, "b": 0.2}


def test_an_unreachable_time_goal_is_refused_before_any_cut():
    model, x = tiny()
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    # 10 us of the synthetic run never shrinks, and every node keeps its 2 us
    cfg = channels.ChannelsConfig(target_macs=0.9, target_latency=0.05, rounds=1, retrain_epochs=0)
    with pytest.raises(InputError, match=r"out of reach.*set target_latency >= 0\.\d\d"):
        channels.thin_(model, x[:2], cfg, layer_times=_synthetic_times("blocks.0.block.0"))
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes


def test_a_fit_whose_kernels_outrun_the_plain_run_is_scaled_to_it():
    # Profiled kernels (a us of profiler cost each) adding up to more than the plain run: the
    # layers are scaled down to it and the rest of the run is never negative.
    macs, half = {"a": 1000, "b": 1000}, {"a": 250, "b": 250}
    fit = channels.fit_layers(
        macs, _times(40.0, {"a": 30.0, "b": 30.0}), half, _times(15.0, {"a": 10.0, "b": 10.0})
    )
    assert fit.estimate(macs) == pytest.approx(40.0)
    assert fit.fixed_us >= 0 and fit.other_us_per_mac >= 0
    assert fit.estimate({"a": 1, "b": 1}) >= 0


def test_two_resource_allocation_when_rounding_leaves_the_goal_cell_out_of_reach():
    # With 4 buckets each option's savings round down below the goal, though the real savings
    # of both cuts meet it: the state that saves the most on both is taken.
    H, unit = channels.HEADROOM, 100.0
    curves = {"a": {0.2: 0.6}, "b": {0.2: 0.9}}
    macs = {"a": {0.2: 1.999 * unit}, "b": {0.2: 2.5 * unit}}
    time = {"a": {0.2: 2.5 * unit}, "b": {0.2: 1.999 * unit}}
    got = channels.allocate(0.9, curves, macs, 4 * unit / H, time, 4 * unit / H, buckets=4)
    assert got == {"a": 0.2, "b": 0.2}
    # Short of the headroom only (600 saved at most, 625 asked): the goal itself (500) is
    # bought where it is cheapest, not every largest cut
    curves = {"a": {0.2: 0.9, 0.4: 0.5}, "b": {0.2: 0.9, 0.4: 0.89}, "c": {0.2: 0.9, 0.4: 0.89}}
    saved = {n: {0.2: 100, 0.4: 200} for n in curves}
    assert channels.allocate(0.9, curves, saved, 500) == {"a": 0.2, "b": 0.4, "c": 0.4}


def test_an_int8_file_borrows_its_fp32_source_names(tmp_path):
    # A Linear on (N, L, D) inputs: its MatMul reads a transposed copy of the weight ("val_3");
    # only the FP32 file's name scopes say whose it is, and the quantizer drops them.
    def graph(weight, dtype, scoped):
        w = helper.make_tensor(weight, dtype, [2, 2], [1, 1, 1, 1])
        node = helper.make_node("MatMul", ["x", weight], ["y"], name="node_MatMul_4")
        if scoped:
            prop = node.metadata_props.add()
            prop.key, prop.value = "pkg.torch.onnx.name_scopes", "['', 'mlp', 'mlp.0', 'linear']"
        io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 2]) for n in ("x", "y")]
        return helper.make_model(helper.make_graph([node], "g", io[:1], io[1:], [w]))

    fp32, q = tmp_path / "fp32.onnx", tmp_path / "int8.onnx"
    onnx.save(graph("val_3", TensorProto.FLOAT, True), str(fp32))
    onnx.save(graph("val_3_quantized", TensorProto.INT8, False), str(q))
    kernels = {"node_MatMul_4": "QLinearMatMul"}
    assert layertime.kernel_owners(q, kernels, {"mlp.0"}) == {}
    assert layertime.kernel_owners(q, kernels, {"mlp.0"}, fp32) == {"node_MatMul_4": "mlp.0"}
    assert layertime.kernel_owners(fp32, kernels, {"mlp.0"}) == {"node_MatMul_4": "mlp.0"}
