"""MAC counts against hand-computed references, and PyTorch against the exported ONNX files."""

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from compresskit.compressor import export as E
from compresskit.compressor import flops as F
from compresskit.models import available
from compresskit.models.errors import InputError
from compresskit.models.zoo import input_kind


def _export(model: nn.Module, path: Path, shape: tuple[int, ...]) -> Path:
    return E.export_onnx(model.eval(), torch.rand(2, *shape), path, E.ExportConfig())


def _zoo_input(name: str, batch: int) -> torch.Tensor:
    """1x8x8 images, or 16 token ids (id 1) for a token model."""
    if input_kind(name) == "tokens":
        return torch.ones(batch, 16, dtype=torch.int64)
    return torch.rand(batch, 1, 8, 8)


class ConvLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.fc = nn.Linear(2 * 5 * 5, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


# Per sample: conv 2 x 5 x 5 outputs x (1 x 3 x 3) = 450; fc 50 x 4 = 200.
CONV_LINEAR_MACS = 450 + 200


def test_conv_and_linear_by_hand(tmp_path):
    model = ConvLinear()
    assert F.torch_macs(model, torch.rand(1, 1, 5, 5)) == 650
    assert F.torch_macs(model, torch.rand(2, 1, 5, 5)) == 1300
    path = _export(model, tmp_path / "m.onnx", (1, 5, 5))
    assert F.onnx_macs(path, 1) == CONV_LINEAR_MACS
    assert F.onnx_macs(path, 2) == 1300
    assert F.flops(650) == 1300


def test_depthwise_groups_by_hand(tmp_path):
    model = nn.Sequential(
        nn.Conv2d(4, 4, 3, padding=1, groups=4),  # 4 x 6 x 6 outputs x (1 x 3 x 3) = 1296
        nn.Conv2d(4, 8, 1),  # 8 x 6 x 6 outputs x 4 = 1152
        nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2),  # 8 x 3 x 3 outputs x (4 x 9) = 2592
    )
    assert F.torch_macs(model, torch.rand(1, 4, 6, 6)) == 1296 + 1152 + 2592
    path = _export(model, tmp_path / "dw.onnx", (4, 6, 6))
    assert F.onnx_macs(path, 1) == 1296 + 1152 + 2592
    assert F.onnx_macs(path, 3) == 3 * (1296 + 1152 + 2592)


def test_symbolic_height_and_width_take_the_samples_not_the_batch(tmp_path):
    import onnx

    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.Conv2d(8, 8, 1))
    path = _export(model, tmp_path / "fcn.onnx", (4, 6, 6))
    proto = onnx.load(str(path))
    for i, name in ((2, "H"), (3, "W")):
        proto.graph.input[0].type.tensor_type.shape.dim[i].dim_param = name
    onnx.save(proto, str(tmp_path / "dyn.onnx"))
    per_sample = 8 * 36 * (4 * 9) + 8 * 36 * 8
    # the batch (64) was taken for H and W too: 64 x 64 images, 114x too many MACs
    assert F.onnx_macs(tmp_path / "dyn.onnx", 64, (4, 6, 6)) == 64 * per_sample
    assert F.onnx_macs(tmp_path / "dyn.onnx", 1, (4, 6, 6)) == per_sample


class Double(nn.Module):
    def forward(self, w):
        return 2 * w


def test_parametrized_layers_and_modes_are_kept():
    model = nn.Sequential(ConvLinear(), nn.BatchNorm1d(4))
    parametrize.register_parametrization(model[0].conv, "weight", Double())
    parametrize.register_parametrization(model[0].fc, "weight", Double())
    model.train()
    before = model[1].running_mean.clone()
    assert F.torch_macs(model, torch.rand(2, 1, 5, 5)) == 1300
    assert model.training and model[0].conv.training
    assert torch.equal(model[1].running_mean, before)  # ran in eval mode


def test_a_layer_called_twice_counts_twice():
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return self.fc(self.fc(x))

    assert F.torch_macs(Twice(), torch.rand(5, 3)) == 2 * 5 * 3 * 3


@pytest.fixture(scope="module")
def zoo_files(zoo_onnx):
    return zoo_onnx


@pytest.mark.parametrize("name", sorted(available()))
@pytest.mark.parametrize("batch", [1, 3])
def test_zoo_torch_matches_onnx(zoo_files, name, batch):
    model, path = zoo_files[name]
    got = F.onnx_macs(path, batch)
    assert got > 0
    assert got == F.torch_macs(model, _zoo_input(name, batch))
    assert got == batch * F.onnx_macs(path, 1)


def test_int8_qdq_counts_like_fp32(zoo_files, tmp_path):
    import onnx

    _, fp32 = zoo_files["mobilenet"]  # depthwise convolutions too
    prepared = E.preprocess(fp32, tmp_path / "prepared.onnx")
    calib = np.random.default_rng(0).random((16, 1, 8, 8), dtype=np.float32)
    int8 = E.quantize_int8(prepared, tmp_path / "int8.onnx", calib, E.QuantConfig(calibration=16))
    ops = [n.op_type for n in onnx.load(str(int8)).graph.node]
    assert "DequantizeLinear" in ops and "Conv" in ops  # really a QDQ file
    for batch in (1, 2):
        assert F.onnx_macs(int8, batch) == F.onnx_macs(fp32, batch)


def _onnx_file(path: Path, node, inputs, output, inits=()):
    """A one-node model; the output's dims are left for shape inference to find."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(output[0], TensorProto.FLOAT, [None] * output[1])],
        [numpy_helper.from_array(np.zeros(s, np.float32), n) for n, s in inits],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def test_matmul_broadcasts_batch_dims(tmp_path):
    from onnx import helper

    node = helper.make_node("MatMul", ["a", "b"], ["y"])
    # (N, 3, 4, 5) @ (5, 6): B broadcasts over N x 3; N x 3 x 4 x 6 outputs, 5 MACs each.
    path = _onnx_file(
        tmp_path / "mm.onnx", node, [("a", ["N", 3, 4, 5])], ("y", 4), [("b", (5, 6))]
    )
    assert F.onnx_macs(path, 1) == 3 * 4 * 6 * 5
    assert F.onnx_macs(path, 2) == 2 * 3 * 4 * 6 * 5
    node = helper.make_node("MatMul", ["a", "b"], ["y"])
    path = _onnx_file(
        tmp_path / "bmm.onnx", node, [("a", ["N", 1, 4, 5]), ("b", [3, 5, 6])], ("y", 4)
    )  # (N, 1, 4, 5) @ (3, 5, 6) -> (N, 3, 4, 6)
    assert F.onnx_macs(path, 2) == 2 * 3 * 4 * 6 * 5


@pytest.mark.parametrize("trans_a", [0, 1])
def test_gemm_transposes(tmp_path, trans_a):
    from onnx import helper

    node = helper.make_node("Gemm", ["a", "b", "c"], ["y"], transA=trans_a, transB=1)
    a = [5, "N"] if trans_a else ["N", 5]  # K = 5, M = N
    path = _onnx_file(
        tmp_path / "gemm.onnx", node, [("a", a)], ("y", 2), [("b", (7, 5)), ("c", (7,))]
    )  # B is (N=7, K=5) with transB
    assert F.onnx_macs(path, 3) == 3 * 5 * 7


def test_onnx_macs_refuses_bad_input(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        F.onnx_macs(tmp_path / "missing.onnx", 1)
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model")
    with pytest.raises(InputError, match="junk.onnx"):
        F.onnx_macs(junk, 1)
    with pytest.raises(InputError, match="batch"):
        F.onnx_macs(junk, 0)


class _Recurrent(nn.Module):
    """A 2-layer bidirectional LSTM (or GRU) over (N, 1, T, F) inputs, then a Linear head on
    the last step (the Gather before the Gemm leaves its input's shape open in ONNX)."""

    def __init__(self, cell=nn.LSTM, batch_first=True):
        super().__init__()
        self.batch_first = batch_first
        self.rnn = cell(6, 5, num_layers=2, bidirectional=True, batch_first=batch_first)
        self.head = nn.Linear(10, 3)

    def forward(self, x):
        x = x.flatten(1, 2)  # (N, T, F)
        out, _ = self.rnn(x if self.batch_first else x.transpose(0, 1))
        return self.head(out[:, -1] if self.batch_first else out[-1])


@pytest.mark.parametrize("cell, gates", [(nn.LSTM, 4), (nn.GRU, 3)])
@pytest.mark.parametrize("batch_first", [True, False])
def test_recurrent_layers_by_hand(tmp_path, cell, gates, batch_first):
    # An LSTM classifier counted its head alone: bench said 0.0 GFLOP/s, 0% of the peak.
    steps, hidden = 7, 5
    per_step = 2 * gates * hidden * (6 + hidden) + 2 * gates * hidden * (2 * hidden + hidden)
    want = 3 * steps * per_step + 3 * 10 * 3  # 3 sequences, then the head
    model = _Recurrent(cell, batch_first)
    assert F.torch_macs(model, torch.rand(3, 1, steps, 6)) == want
    path = _export(model, tmp_path / "r.onnx", (1, steps, 6))
    assert F.onnx_macs(path, 3) == want


class _EncDec(nn.Module):
    """Conv down, ConvTranspose up (stride 2, padding, output padding, groups), then a head."""

    def __init__(self):
        super().__init__()
        self.down = nn.Conv2d(1, 4, 3, stride=2, padding=1)  # 8x8 -> 4x4
        self.up = nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2)
        self.up1d = nn.ConvTranspose1d(6, 2, 2, stride=2)  # over the flattened 8x8 map
        self.head = nn.Linear(2 * 128, 3)

    def forward(self, x):
        y = self.up(torch.relu(self.down(x)))  # (N, 6, 8, 8)
        z = self.up1d(y.flatten(2))  # (N, 2, 128)
        return self.head(z.flatten(1))


def test_transposed_convolutions_by_hand(tmp_path):
    # A decoder's ConvTranspose layers read 0 MACs: an encoder-decoder classifier's 353,280
    # MACs came out as 91,136 in bench.
    down = (4 * 4 * 4) * (1 * 9)  # outputs x (in x k)
    up = (4 * 4 * 4) * (6 // 2 * 9)  # inputs (4 ch x 4 x 4) x (out / groups x k)
    up1d = (6 * 64) * (2 * 2)  # inputs (6 ch x 64) x (out x k)
    head = 256 * 3
    want = down + up + up1d + head
    model = _EncDec()
    assert F.module_macs(model, torch.rand(1, 1, 8, 8)) == {
        "down": down,
        "up": up,
        "up1d": up1d,
        "head": head,
    }
    assert F.torch_macs(model, torch.rand(2, 1, 8, 8)) == 2 * want
    path = _export(model, tmp_path / "ed.onnx", (1, 8, 8))
    assert F.onnx_macs(path, 1) == want
    assert F.onnx_macs(path, 5) == 5 * want


class _HeadsByShape(nn.Module):
    """Attention as Hugging Face writes it: heads split by a view whose sizes come from the
    input's shape, then bare matmuls (which torch_macs cannot see, a documented limit)."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.heads, self.q, self.k = heads, nn.Linear(d, d), nn.Linear(d, d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):  # (N, 1, T, d)
        x = x[:, 0]
        b, t, d = x.shape
        split = (b, t, self.heads, d // self.heads)
        q = self.q(x).view(split).permute(0, 2, 1, 3)
        k = self.k(x).view(split).permute(0, 2, 1, 3)
        att = torch.softmax(q @ k.transpose(-1, -2), -1)  # (N, heads, T, T)
        mixed = (att @ q).permute(0, 2, 1, 3).reshape(b, t, d)
        return self.head(mixed.mean(1))


def test_matmuls_behind_computed_reshapes_are_counted(tmp_path):
    # bench showed no MACs for a Hugging Face BERT's ONNX files: ONNX's shape inference left
    # its attention MatMuls open, and ONNX Runtime's symbolic inference now fills them in.
    t, d = 5, 8
    projections = 2 * t * d * d  # q and k
    attention = 2 * t * t * d  # Q K^T and A V over both heads: head_dim x heads = d
    want = projections + attention + d * 3
    model = _HeadsByShape()
    assert F.torch_macs(model, torch.rand(1, 1, t, d)) == want - attention  # bare matmuls unseen
    path = _export(model, tmp_path / "h.onnx", (1, t, d))
    assert F.onnx_macs(path, 1, (1, t, d)) == want
    assert F.onnx_macs(path, 4, (1, t, d)) == 4 * want


def test_shapes_onnx_leaves_open_come_from_onnx_runtime(tmp_path, monkeypatch):
    # A Hugging Face BERT's padding mask (Expand, GatherND) stops ONNX's shape inference
    # before its attention MatMuls, and bench showed no MACs for its ONNX files. ONNX
    # Runtime's symbolic shape inference fills in what ONNX's leaves open.
    model = _HeadsByShape()
    path = _export(model, tmp_path / "h.onnx", (1, 5, 8))
    want = F.onnx_macs(path, 2, (1, 5, 8))
    import onnx

    real, calls = onnx.shape_inference.infer_shapes, []

    def shapes_lost(proto, *args, **kwargs):
        # flops' own call gets what ONNX gives on BERT: no intermediate shapes; ONNX
        # Runtime's inference, which calls it too, gets the real one
        calls.append(1)
        return proto if len(calls) == 1 else real(proto, *args, **kwargs)

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", shapes_lost)
    assert F.onnx_macs(path, 2, (1, 5, 8)) == want
    calls.clear()
    monkeypatch.setattr(F, "_symbolic_shapes", lambda proto: {})
    with pytest.raises(InputError, match="unknown after shape inference"):
        F.onnx_macs(path, 2, (1, 5, 8))


def test_hugging_face_bert_counts_its_attention_in_onnx(tmp_path):
    pytest.importorskip("transformers")
    from compresskit.models import hf

    model = hf.bert().eval()
    path = E.export_onnx(
        model, torch.ones(2, 16, dtype=torch.int64), tmp_path / "b.onnx", E.ExportConfig()
    )
    seen = F.torch_macs(model, torch.ones(1, 16, dtype=torch.int64))
    layers, heads_dim = model.net.config.num_hidden_layers, model.net.config.hidden_size
    attention = layers * 2 * 16 * 16 * heads_dim  # Q K^T and A V: bare matmuls torch misses
    assert F.onnx_macs(path, 1, (16,)) == seen + attention
