"""Embedding tables as int8 rows (`compressor/export/tables.py`): checked against numpy, and
through the INT8 choice, where the file must still hold its floor."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from compresskit.compressor.export import int8 as I
from compresskit.compressor.export import onnxfile as E
from compresskit.compressor.export import tables as T


def _gather_model(table: np.ndarray, *, tied: bool = False, axis: int = 0):
    """ids (N, L) -> Gather(table) -> out; with `tied`, also out2 = ids-free MatMul on it."""
    nodes = [helper.make_node("Gather", ["table", "ids"], ["out"], name="emb", axis=axis)]
    d = table.shape[1]
    shape = ["N", "L", d] if axis == 0 else [table.shape[0], "N", "L"]
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, shape)]
    inits = [numpy_helper.from_array(table, "table")]
    inputs = [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", "L"])]
    if tied:  # the table read again as a weight: an LM head tied to its embedding
        inputs.append(helper.make_tensor_value_info("h", TensorProto.FLOAT, ["N", table.shape[1]]))
        nodes += [
            helper.make_node("Transpose", ["table"], ["tt"], name="t"),
            helper.make_node("MatMul", ["h", "tt"], ["logits"], name="head"),
        ]
        outputs.append(
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", table.shape[0]])
        )
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _run(model, **feeds):
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def test_rows_decode_within_half_a_step_zeros_exact_and_the_file_shrinks():
    rng = np.random.default_rng(0)
    table = rng.normal(size=(256, 16)).astype(np.float32)
    table[3] *= 1e-3  # a rare token's small row: per-tensor scaling would round it to 0
    table[0] = 0  # padding
    table[rng.random(table.shape) < 0.5] = 0  # pruned weights
    model = _gather_model(table)
    before = len(model.SerializeToString())
    assert T.quantize_tables(model) == {"table": 4096}
    onnx.checker.check_model(model, full_check=True)
    assert [n.op_type for n in model.graph.node] == ["Gather", "Gather", "Cast", "Mul"]
    ids = np.array([[0, 3, 255, -1], [7, 3, 3, 0]], dtype=np.int64)  # -1: the last row
    (got,) = _run(model, ids=ids)
    want = table[ids]
    step = np.abs(table).max(axis=1) / 127
    assert np.all(np.abs(got - want) <= step[ids][..., None] / 2 + 1e-7)
    assert np.all(got[want == 0] == 0)  # padding and pruned weights stay exactly zero
    assert np.abs(got[0, 1]).max() > 0  # the small row survived
    assert len(model.SerializeToString()) < 0.35 * before  # 1 byte a weight + a scale a row
    q = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert q["table_quantized"].dtype == np.int8 and q["table_row_scale"].shape == (256, 1)


@pytest.mark.parametrize(
    "model",
    [
        _gather_model(np.ones((256, 16), np.float32), tied=True),  # also a weight elsewhere
        _gather_model(np.ones((16, 16), np.float32)),  # too small to pay
        _gather_model(np.ones((256, 16), np.float32), axis=1),  # columns, not rows
    ],
    ids=["tied", "small", "axis1"],
)
def test_tables_that_are_not_only_row_lookups_or_too_small_stay(model):
    before = model.SerializeToString()
    assert T.quantize_tables(model) == {}
    assert model.SerializeToString() == before


class _Text(nn.Module):
    """Token ids -> embedding -> LayerNorm -> attention-like mixing -> Linear -> mean -> head:
    in a graph with a Softmax only compute nodes are quantized (`qdq.op_types_for`), and the
    LayerNorm between them keeps ORT's quantizer off the table, as in `textcls`."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.ln = nn.Embedding(300, 16), nn.LayerNorm(16)
        self.fc, self.head = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, ids):
        h = self.ln(self.emb(ids))
        h = torch.softmax(h @ h.transpose(1, 2), -1) @ h
        return self.head(torch.relu(self.fc(h)).mean(1))


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("text")
    fp32 = E.export_onnx(
        _Text().eval(), torch.randint(0, 300, (2, 8)), tmp / "f.onnx", E.ExportConfig()
    )
    x = np.random.default_rng(0).integers(0, 300, (400, 8)).astype(np.int64)
    return fp32, E.preprocess(fp32, tmp / "p.onnx"), x


def test_the_choice_ships_int8_rows_and_judges_the_file_with_them(text):
    fp32, prep, x = text
    cfg = I.QuantConfig(min_agreement=0.9)
    choice = I.choose(prep, fp32, x[:100], x[100:], cfg, {"avx2"})
    assert choice.tables == {"emb.weight": 4800}, choice.tables_fp32
    inits = {t.name: t for t in choice.model.graph.initializer}
    assert inits["emb.weight_quantized"].data_type == TensorProto.INT8
    assert "emb.weight" not in inits
    # the agreement recorded is the shipped file's, tables included
    s = ort.InferenceSession(choice.model.SerializeToString(), providers=["CPUExecutionProvider"])
    f = ort.InferenceSession(str(fp32), providers=["CPUExecutionProvider"])
    a, b = (m.run(None, {"ids": x[100:]})[0].argmax(1) for m in (s, f))
    assert choice.selection.agreement == pytest.approx(np.mean(a == b))


def test_tables_that_break_the_floor_stay_fp32_and_say_why(text, monkeypatch):
    fp32, prep, x = text
    real = T.quantize_tables

    def broken(model, *args):  # every row's scale negated: the logits go wrong
        done = real(model, *args)
        for t in model.graph.initializer:
            if t.name.endswith("_row_scale"):
                t.CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(t), t.name))
        return done

    monkeypatch.setattr(T, "quantize_tables", broken)
    choice = I.choose(prep, fp32, x[:100], x[100:], I.QuantConfig(min_agreement=0.9), {"avx2"})
    assert choice.tables == {} and choice.model is not None
    assert choice.tables_fp32.startswith("emb.weight stay FP32: with only them as int8 rows")
    assert "below min_agreement 0.9" in choice.tables_fp32
    assert "emb.weight" in {t.name for t in choice.model.graph.initializer}
    assert choice.selection.int8_nodes > 0  # the compute nodes were chosen without them


def test_a_file_of_fp32_compute_ships_when_its_tables_are_int8(text, monkeypatch):
    """Every compute node back in FP32 (here: host timing found INT8 slower) once meant no
    INT8 file; with the table in 8 bits that file is still far smaller than the FP32 one."""
    fp32, prep, x = text
    monkeypatch.setattr(I, "fp32_clearly_faster", lambda *a, **k: True)
    choice = I.choose(prep, fp32, x[:100], x[100:], I.QuantConfig(target="host"), {"avx2"})
    assert choice.selection.int8_nodes == 0
    assert choice.model is not None and choice.tables == {"emb.weight": 4800}
    assert len(choice.model.SerializeToString()) < 0.5 * fp32.stat().st_size


def test_a_table_that_is_also_a_graph_input_stays():
    """An overridable initializer (also a graph input): the caller may feed another table."""
    model = _gather_model(np.ones((256, 16), np.float32))
    model.graph.input.append(helper.make_tensor_value_info("table", TensorProto.FLOAT, [256, 16]))
    assert T.quantize_tables(model) == {}
