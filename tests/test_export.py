"""ONNX export and INT8 quantization against their references: PyTorch outputs, FP32 ONNX."""

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from compresskit.compressor import kmeans, prune
from compresskit.compressor.export import int8
from compresskit.compressor.export import onnxfile as E
from compresskit.models import available, tiny
from compresskit.models.errors import InputError
from compresskit.models.zoo import input_kind


def _export(model, tmp_path: Path, shape=(1, 8, 8), **cfg) -> Path:
    path = tmp_path / "m.onnx"
    E.export_onnx(model, torch.rand(2, *shape), path, E.ExportConfig(**cfg))
    return path


@pytest.mark.parametrize("name", sorted(available()))
def test_every_zoo_model_exports_and_answers_like_pytorch(zoo_onnx, name):
    tokens = input_kind(name) == "tokens"  # int64 ids (N, 16) in [1, 64), else 1x8x8 images
    model, path = zoo_onnx[name]  # exported once for this and test_flops
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # one self-contained file
    session = E._session(path)
    for batch in (1, 7):  # the batch axis is dynamic
        x = model.example_inputs(batch, seed=batch)[0] if tokens else torch.rand(batch, 1, 8, 8)
        with torch.no_grad():
            ref = model(x).numpy()
        np.testing.assert_allclose(E.run(session, x.numpy()), ref, rtol=1e-4, atol=1e-5)


class Residual(nn.Module):
    """A user's class with BatchNorm and a residual add."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4 * 8 * 8, 3)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        return self.head((h + self.conv2(h)).flatten(1))


def test_user_class_with_batchnorm_and_residual(tmp_path):
    model = Residual()
    model.train()(torch.rand(16, 1, 8, 8))  # non-trivial running statistics
    model.eval()
    x = torch.rand(5, 1, 8, 8)
    got = E.run(E._session(_export(model, tmp_path)), x.numpy())
    np.testing.assert_allclose(got, model(x).detach().numpy(), rtol=1e-4, atol=1e-5)


def test_the_file_holds_no_source_location_of_the_exporting_machine(tmp_path):
    """The exporter writes each node's Python stack (this file's absolute path, its source
    lines) and FX node into the file; an app ships it, and two checkouts gave two files. The
    module path of each node stays: per-layer timing maps nodes to layers through it."""
    import onnx

    path = _export(Residual().eval(), tmp_path)
    raw = path.read_bytes()
    assert str(Path(__file__).resolve().parent).encode() not in raw
    assert b"def forward" not in raw and b"self.head" not in raw
    keys = {p.key for n in onnx.load(str(path)).graph.node for p in n.metadata_props}
    assert keys == {"pkg.torch.onnx.name_scopes"}  # not namespace, class_hierarchy, rules
    # the function itself, on a graph with the entries and a subgraph (If branches)
    from onnx import helper

    def node(name):
        n = helper.make_node("Identity", ["x"], [name], name=name)
        for key in [*E.SOURCE_LOCATIONS, "namespace", *E.KEPT_METADATA]:
            prop = n.metadata_props.add()
            prop.key, prop.value = key, "/home/me/src/net.py"
        return n

    branch = helper.make_graph([node("b")], "b", [], [])
    top = helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)
    model = helper.make_model(helper.make_graph([node("a"), top], "g", [], []))
    assert E.drop_source_locations(model) == 9
    kept = list(E.KEPT_METADATA)
    assert [p.key for p in model.graph.node[0].metadata_props] == kept
    assert [p.key for p in model.graph.node[1].attribute[0].g.node[0].metadata_props] == kept


def test_ir9_for_older_runtimes(tmp_path):
    import onnx

    path = _export(tiny("mlp"), tmp_path, opset=17, ir_version=9)
    proto = onnx.load(str(path))
    assert proto.ir_version == 9 and proto.opset_import[0].version == 17


def test_ir7_is_what_opset_13_writes_and_may_be_asked_for(tmp_path):
    """--opset 13 wrote IR 7 by itself, yet ir_version = 7 was refused as impossible."""
    import onnx

    from compresskit.compressor.recipe import Recipe

    Recipe.from_dict({"export": {"opset": 13, "ir_version": 7}})
    with pytest.raises(InputError, match="opset 15 needs IR 8 or more"):
        Recipe.from_dict({"export": {"opset": 15, "ir_version": 7}})
    path = _export(tiny("mlp"), tmp_path, opset=13, ir_version=7)
    proto = onnx.load(str(path))
    assert proto.ir_version == 7 and proto.opset_import[0].version == 13


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"opset": 30}, "out of range"),
        ({"opset": 21, "ir_version": 9}, "ir_version 9 cannot declare opset 21"),
    ],
)
def test_bad_export_settings(cfg, message):
    with pytest.raises(E.InputError, match=message):
        E.ExportConfig(**cfg)


def test_onnx_path_in_a_missing_folder(tmp_path):
    with pytest.raises((FileNotFoundError, E.InputError)):
        E.export_onnx(
            tiny("mlp"), torch.rand(2, 1, 8, 8), tmp_path / "missing" / "m.onnx", E.ExportConfig()
        )
    assert not (tmp_path / "missing").exists()


@pytest.fixture(scope="module")
def int8_file(tmp_path_factory):
    import onnx

    tmp = tmp_path_factory.mktemp("int8")
    g = torch.Generator().manual_seed(0)
    model = tiny("lenet5", in_shape=(1, 8, 8)).eval()
    prune.prune_(model, prune.PruneConfig(sparsity=0.5))
    kmeans.share_weights_(model, kmeans.QuantizeConfig(conv_bits=4, fc_bits=3))
    fp32 = tmp / "fp32.onnx"
    E.export_onnx(model, torch.rand(2, 1, 8, 8), fp32, E.ExportConfig())
    calib = torch.rand(64, 1, 8, 8, generator=g).numpy()
    cfg = E.QuantConfig(min_agreement=0.9)  # target mobile: nothing timed
    choice = int8.choose(
        E.preprocess(fp32, tmp / "prep.onnx"), fp32.read_bytes(), calib, calib, cfg, set()
    )
    choice.path = tmp / "int8.onnx"
    onnx.save(choice.model or onnx.load(str(fp32)), str(choice.path))
    return model, fp32, choice, calib


def test_int8_answers_like_fp32_on_calibration_data(int8_file):
    import onnx

    _, fp32, choice, calib = int8_file
    ref = E.run(E._session(fp32), calib)
    got = E.run(E._session(choice.path), calib)
    sel = choice.selection
    assert E.agreement(got, ref) >= 0.9 and sel.agreement >= 0.9
    ops = {n.op_type for n in onnx.load(str(choice.path)).graph.node}
    if sel.int8_nodes:  # some node is INT8: QDQ pairs are in the graph
        assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    else:  # none: the FP32 graph, not a fake-quantized one
        assert not {"QuantizeLinear", "DequantizeLinear"} & ops
    assert sel.latency_ms is None  # target mobile times nothing
    assert all(isinstance(v, str) and v for v in sel.fp32_nodes.values())


def test_compression_survives_export(int8_file):
    model, fp32, choice, _ = int8_file
    bits = {"conv1": 4, "conv2": 4, "fc1": 3, "fc2": 3}
    assert choice.selection.int8_nodes, "the check below needs int8 weights in the file"
    for path in (fp32, choice.path):
        checks = E.weight_invariants(path, model, bits)
        assert set(checks) == {"conv1.weight", "conv2.weight", "fc1.weight", "fc2.weight"}
        assert all(c["ok"] for c in checks.values()), checks


def test_calibration_data_must_fit(int8_file, tmp_path):
    _, fp32, _, calib = int8_file
    prepared = E.preprocess(fp32, tmp_path / "p.onnx")
    with pytest.raises(E.InputError, match="does not fit"):
        E.quantize_int8(prepared, tmp_path / "q.onnx", calib[:, :, :4], E.QuantConfig())
    with pytest.raises(E.InputError, match="empty"):
        E.quantize_int8(prepared, tmp_path / "q.onnx", calib[:0], E.QuantConfig())
    assert not (tmp_path / "q.onnx").exists()


def test_parity_against_pytorch(int8_file):
    model, fp32, _, calib = int8_file
    x = torch.from_numpy(calib)
    with torch.no_grad():
        y = prune.bake_(copy.deepcopy(model))(x).argmax(1)
    p = E.parity(model, fp32, x, y)
    assert p["top1_agreement"] == 1.0 and p["test_accuracy"] == 1.0 and p["max_abs_diff"] < 1e-4


def test_small_latency_differences_are_ties():
    assert E.clearly_faster(0.050, 0.100)
    assert not E.clearly_faster(0.007, 0.008)  # 1 us on a 10 us model is noise
    assert not E.clearly_faster(0.95, 1.0)  # within 10%


def test_shared_conv_with_folded_batchnorm_keeps_its_values_per_channel(tmp_path):
    model = Residual()
    model.train()(torch.rand(16, 1, 8, 8))
    model.eval()
    kmeans.share_weights_(model, kmeans.QuantizeConfig(conv_bits=2, fc_bits=2))
    path = _export(model, tmp_path)
    checks = E.weight_invariants(path, model, {"conv": 2, "conv2": 2, "head": 2})
    assert checks["conv.weight"]["ok"], checks["conv.weight"]
    assert checks["conv.weight"]["distinct_values_per_channel"] <= 4
    # BatchNorm folding scales each channel: the whole tensor has more values than one channel.
    assert checks["conv.weight"]["distinct_values"] > 4


def test_a_uint8_table_with_a_zero_point_keeps_its_zeros(tmp_path):
    # ORT quantized a text model's embedding table as uint8 with zero point 123: its padding
    # row's zeros read as 123 and the file's weight check said NO for a table kept intact.
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    emb = nn.Embedding(6, 4, padding_idx=0)
    model = nn.Sequential(emb)
    w = emb.weight.detach().numpy()
    scale = float(np.abs(w).max()) / 100
    q = np.clip(np.round(w / scale) + 123, 0, 255).astype(np.uint8)
    inits = [
        numpy_helper.from_array(q, "0.weight_quantized"),
        numpy_helper.from_array(np.array(scale, np.float32), "0.weight_scale"),
        numpy_helper.from_array(np.array(123, np.uint8), "0.weight_zero_point"),
    ]
    dq = helper.make_node(
        "DequantizeLinear", ["0.weight_quantized", "0.weight_scale", "0.weight_zero_point"], ["t"]
    )
    gather = helper.make_node("Gather", ["t", "ids"], ["y"])
    graph = helper.make_graph(
        [dq, gather],
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, 4])],
        inits,
    )
    path = tmp_path / "t.onnx"
    onnx.save(helper.make_model(graph), str(path))
    check = E.weight_invariants(path, model, {})["0.weight"]
    assert check["int8"] and check["zeros_kept"] and check["ok"], check


def test_an_opset_the_runtime_cannot_load_is_refused_before_any_work():
    E.runtime_runs(18)  # what we export by default loads
    with pytest.raises(E.InputError, match="opset 99: ONNX Runtime .* cannot run it"):
        E.runtime_runs(99)
    with pytest.raises(E.InputError, match="opset 30 is out of range"):
        E.check_runtime_opset(30)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        (b"hello", "not a .npy array"),
        ("object", "holds Python objects"),  # pickles are refused (allow_pickle=False)
        ("empty", "is empty"),
        ("strings", "needs a float array"),
        ("1d", "needs a float array"),
        ("uint8", "needs a float array of inputs scaled as in training"),
        ("nan", "holds NaN or infinite values"),
    ],
)
def test_calibration_files(tmp_path, content, message):
    path = tmp_path / "c.npy"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content == "object":
        np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    elif content == "empty":
        np.save(path, np.zeros((0, 1, 8, 8), np.float32))
    elif content == "strings":
        np.save(path, np.array([["a", "b"]]))
    elif content == "1d":
        np.save(path, np.zeros(5, np.float32))
    elif content == "uint8":
        np.save(path, np.zeros((2, 1, 8, 8), np.uint8))
    elif content == "nan":
        np.save(path, np.full((2, 1, 8, 8), np.nan, np.float32))
    with pytest.raises(E.InputError, match=message):
        E.load_calibration(path)


def test_calibration_file_loads_as_float32(tmp_path):
    np.save(tmp_path / "c.npy", np.ones((3, 1, 8, 8), np.float64))
    x = E.load_calibration(tmp_path / "c.npy")
    assert x.dtype == np.float32 and x.shape == (3, 1, 8, 8)


def test_an_export_keeps_no_copy_of_the_model_alive(tmp_path):
    """export_onnx bakes a copy of the model; once the file is written nothing may hold that
    copy. onnxscript's module-level rewrite rules kept the last graph they matched, and with
    it every exported weight (twice ResNet-18's weights); `_release_rewriter_graph` clears
    them."""
    import gc

    def tensors() -> list[torch.Tensor]:
        # real ones: the exporter's fake tensors (its shape caches) hold no memory
        gc.collect()
        return [o for o in gc.get_objects() if type(o) in (torch.Tensor, nn.Parameter)]

    model = Residual().eval()
    before = {id(t) for t in tensors()}
    _export(model, tmp_path)
    new = [t for t in tensors() if id(t) not in before and not t.is_meta and t.numel() > 1]
    assert not any(t.shape == model.head.weight.shape for t in new), "a copy of head.weight"
    assert sum(t.numel() for t in new) < sum(p.numel() for p in model.parameters())


def test_every_opset_names_inputs_and_outputs_alike(tmp_path):
    """Opsets below 18 go through TorchScript, which named the output "16" where dynamo wrote
    "linear_1": app code that names the output broke when the opset changed."""
    import onnx

    names = {}
    for opset in (13, 18):
        (tmp_path / str(opset)).mkdir()
        proto = onnx.load(str(_export(tiny("lenet5"), tmp_path / str(opset), opset=opset)))
        assert proto.opset_import[0].version == opset
        names[opset] = ([i.name for i in proto.graph.input], [o.name for o in proto.graph.output])
    assert names[13] == names[18] and names[18][0] == ["x"]


class _Tokens3d(nn.Module):
    """A square Linear on (N, T, F) inputs: the exporter stores its weight transposed, under
    a generated name (a MatMul's right-hand side), as BERT's 128 x 128 query weight."""

    def __init__(self):
        super().__init__()
        self.query = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):  # (N, 1, T, F)
        return self.head(torch.relu(self.query(x[:, 0])).mean(1))


def test_a_square_weight_stored_transposed_is_found(tmp_path):
    import onnx

    torch.manual_seed(0)
    model = _Tokens3d().eval()
    kmeans.share_weights_(model, kmeans.QuantizeConfig(fc_bits=2))
    path = E.export_onnx(model, torch.rand(2, 1, 4, 16), tmp_path / "m.onnx", E.ExportConfig())
    names = {i.name for i in onnx.load(str(path)).graph.initializer}
    check = E.weight_invariants(path, model, {"query": 2, "head": 2})["query.weight"]
    assert "query.weight" not in names  # stored transposed, under a generated name
    assert check["found"] and check["ok"] and check["transposed"], (check, names)


def test_a_square_weight_stored_transposed_keeps_its_zeros_in_the_int8_file(tmp_path):
    # Read by the FP32 file's name, the INT8 file's square matrix was compared as it stood:
    # every HF BERT and ViT report said its q/k/v/o "lost" their pruned zeros.
    torch.manual_seed(0)
    model = _Tokens3d().eval()
    prune.prune_(model, prune.PruneConfig(sparsity=0.6))
    kmeans.share_weights_(model, kmeans.QuantizeConfig(fc_bits=2))
    fp32 = E.export_onnx(model, torch.rand(2, 1, 4, 16), tmp_path / "m.onnx", E.ExportConfig())
    calib = torch.rand(32, 1, 4, 16).numpy()
    prepared = E.preprocess(fp32, tmp_path / "p.onnx")
    int8 = E.quantize_int8(prepared, tmp_path / "q.onnx", calib, E.QuantConfig())
    bits = {"query": 2, "head": 2}
    first = E.weight_invariants(fp32, model, bits)
    aliases = {k: (c["initializer"], c["transposed"]) for k, c in first.items()}
    check = E.weight_invariants(int8, model, bits, aliases)["query.weight"]
    assert check["int8"] and check["transposed"] and check["zeros_kept"] and check["ok"], check


def test_a_model_too_big_for_one_onnx_file_is_refused_before_any_work():
    """A 559M-weight MLP failed in onnx.save ("EncodeError: Failed to serialize proto") after
    the whole run; the archive alone is still open to it."""
    from compresskit.compressor import pipeline, recipe

    with torch.device("meta"):  # 2.15 GiB of FP32 weights, nothing allocated
        big = torch.nn.Sequential(torch.nn.Linear(24000, 24000))
    with pytest.raises(InputError, match=r"FP32 weights take 2\.15 GiB, more than one ONNX file"):
        pipeline.preflight(recipe.resolve({}, source="r"), None, big)
    pipeline.preflight(recipe.resolve({"export": {"enabled": False}}, source="r"), None, big)
