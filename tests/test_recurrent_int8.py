"""LSTM layers in the INT8 file: ONNX Runtime's DynamicQuantizeLSTM (int8 weights) where the
static QDQ quantizer leaves them FP32, kept only where the file holds its agreement floor."""

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from compresskit.compressor.export import checks as C
from compresskit.compressor.export import int8 as I
from compresskit.compressor.export import onnxfile as E
from compresskit.compressor.export import qdq as Q
from compresskit.compressor.export import recurrent as R


class _Seq(nn.Module):
    """A 2-layer LSTM (or GRU) over (N, 1, T, F), its last step into a Linear head."""

    def __init__(self, cell: str = "LSTM"):
        super().__init__()
        self.rnn = getattr(nn, cell)(6, 24, num_layers=2, batch_first=True)
        self.head = nn.Linear(24, 3)

    def forward(self, x):
        h, _ = self.rnn(x[:, 0])
        return self.head(h[:, -1])


def _prepared(tmp_path, cell: str = "LSTM"):
    torch.manual_seed(0)
    model = _Seq(cell).eval()
    x = torch.rand(96, 1, 10, 6)
    fp32 = E.export_onnx(model, x[:2], tmp_path / f"{cell}.onnx", E.ExportConfig())
    prep = E.preprocess(fp32, tmp_path / f"{cell}.prep.onnx")
    return fp32, prep, x.numpy()


def _ops(model) -> list[str]:
    return [n.op_type for n in model.graph.node]


@pytest.fixture(scope="module")
def lstm(tmp_path_factory):
    return _prepared(tmp_path_factory.mktemp("lstm"))


def test_lstm_nodes_become_int8_and_nothing_else_changes(lstm):
    _, prep, x = lstm
    q = Q.Quantizer(prep, x[:32])
    scheme = I.scheme_for(I.QuantConfig(), False)
    plain = q.build(scheme)
    q.recurrent = True
    both = q.build(scheme)
    assert _ops(plain).count("LSTM") == 2 and R.KERNEL not in _ops(plain)
    assert _ops(both).count(R.KERNEL) == 2 and "LSTM" not in _ops(both)
    # Only the LSTMs changed: ORT's own dynamic quantizer also rewrote the QDQ Gemm as
    # MatMul + Add, a graph ONNX Runtime 1.17.3 aborted on when optimizing.
    assert [o for o in _ops(both) if o != R.KERNEL] == [o for o in _ops(plain) if o != "LSTM"]
    assert {"domain": "com.microsoft", "version": 1} in [
        {"domain": o.domain, "version": o.version} for o in both.opset_import
    ]
    onnx.checker.check_model(both, full_check=True)
    # Weights: 4 gates x 24 units x (6 + 24) inputs, then 4 x 24 x (24 + 24), as int8.
    done = R.int8_lstms(both, q.model)
    assert sorted(done.values()) == [4 * 24 * 30, 4 * 24 * 48]
    assert len(both.SerializeToString()) < 0.45 * len(plain.SerializeToString())
    # It answers as the FP32 graph does, as written and on this host's fused kernels.
    ref = C.outputs(C.session(str(prep), optimized=False), x)
    for optimized in (False, True):
        got = C.outputs(C.session(both.SerializeToString(), optimized), x)
        assert C.agreement(got, ref) >= 0.95
        assert np.abs(got - ref).max() < 0.1 * np.abs(ref).max()


def test_choose_ships_the_lstms_in_int8_when_they_hold_the_floor(lstm):
    fp32, prep, x = lstm
    cfg = I.QuantConfig(calibration=32, min_agreement=0.9)
    choice = I.choose(prep, fp32, x[:32], x[32:], cfg, set())
    assert choice.model is not None and not choice.lstms_fp32
    assert len(choice.lstms) == 2 and R.KERNEL in _ops(choice.model)


def test_lstms_that_miss_the_floor_stay_fp32_saying_why(lstm, monkeypatch):
    # A rewrite that answers differently (its weights zeroed) misses the floor: the LSTMs
    # stay FP32 and the record says why.
    fp32, prep, x = lstm
    real = R.quantize_lstms_

    def broken(model):
        done = real(model)
        for t in model.graph.initializer:
            if t.name.endswith("_quantized") and t.data_type == onnx.TensorProto.INT8:
                t.raw_data = bytes(len(t.raw_data))
        return done

    monkeypatch.setattr(R, "quantize_lstms_", broken)
    cfg = I.QuantConfig(calibration=32, min_agreement=0.99)
    choice = I.choose(prep, fp32, x[:32], x[32:], cfg, set())
    assert choice.lstms == {}
    assert choice.lstms_fp32.startswith("2 LSTM node(s) stay FP32: with only them in INT8")
    assert choice.model is None or R.KERNEL not in _ops(choice.model)


def test_a_gru_has_no_int8_kernel_and_is_left_alone(tmp_path):
    _, prep, _ = _prepared(tmp_path, "GRU")
    model = onnx.load(str(prep))
    before = model.SerializeToString()
    done = R.quantize_lstms_(model)
    assert done == {} and model.SerializeToString() == before


def test_bench_reads_an_int8_lstm_file_as_int8_and_counts_its_macs(lstm, tmp_path):
    # DynamicQuantizeLSTM is a com.microsoft op ONNX's shape inference does not know: the
    # layers after it had no shapes and bench showed no MACs, and the file was labelled fp32.
    from compresskit.compressor import flops
    from compresskit.compressor.measure import variants

    fp32, prep, x = lstm
    q = Q.Quantizer(prep, x[:32])
    q.recurrent = True
    path = tmp_path / "int8.onnx"
    onnx.save(q.build(I.scheme_for(I.QuantConfig(), False)), str(path))
    assert variants.onnx_precision(onnx.load(str(path))) == "int8"
    for batch in (1, 3):
        assert flops.onnx_macs(path, batch) == flops.onnx_macs(fp32, batch) > 0


class _CellLoop(nn.Module):
    """A GRUCell stepped in Python over 10 steps: 20 Gemm nodes reading 2 weights, then a head."""

    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = x.new_zeros(x.shape[0], 8)
        for t in range(x.shape[2]):
            h = self.cell(x[:, 0, t], h)
        return self.head(h)


def test_nodes_that_read_one_weight_fall_back_together(tmp_path, monkeypatch):
    # A cell stepped in a loop is one Gemm per step on the same weight: the fallback search
    # took them one by one (a GRUCell over 50 steps: 101 nodes, 144 s, none kept in INT8).
    torch.manual_seed(0)
    model = _CellLoop().eval()
    x = torch.rand(200, 1, 10, 6)
    fp32 = E.export_onnx(model, x[:2], tmp_path / "cell.onnx", E.ExportConfig())
    prep = E.preprocess(fp32, tmp_path / "cell.prep.onnx")
    q = Q.Quantizer(prep, x[:32].numpy())
    groups = I.weight_groups(q.model, q.nodes)
    units = {tuple(g) for g in groups.values()}
    assert len(q.nodes) == 21 and sorted(len(u) for u in units) == [1, 10, 10]
    # This model holds any floor in INT8: say the all-INT8 file missed it, so the search runs.
    orders = []
    real = I.fall_back
    monkeypatch.setattr(I, "floor_agreement", lambda got, ref: 0.0)
    monkeypatch.setattr(I, "fall_back", lambda order, *a: orders.append(order) or real(order, *a))
    cfg = I.QuantConfig(calibration=32, min_agreement=0.9)
    choice = I.choose(prep, fp32, x[:32].numpy(), x[32:].numpy(), cfg, set())
    assert orders and all(len(o) == len(units) for o in orders)  # units, not 21 nodes
    back = set(choice.selection.fp32_nodes)
    assert back and any(back == set(u) for u in units)  # one whole unit went back
