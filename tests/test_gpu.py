"""The GPU paths of `train` and `bench`, on a machine with a CUDA GPU.

CI has none, so every test here skips with the reason; they ran on a lent H100 (see
docs/benchmarks.md, "On a GPU"), where `benchmarks/gpu_check.py` also runs the same paths
through the real CLI at larger sizes.
"""

import numpy as np
import pytest
import torch

from compresskit.models import checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)"),
]


def _train(run, out, device, *extra):
    result = run(
        "train", "--model", "lenet300", "--data", "digits", "--epochs", "1", "--device", device,
        "--out", out, "--json", "-q", *extra,
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    return result.json()


def test_cuda_training_follows_cpu_training(run, tmp_path):
    """Linear layers only: fp32 matmuls on CUDA (TF32 off, torch's default) differ from the
    CPU's by summation order alone, so one epoch ends at nearly the same weights."""
    cpu = _train(run, tmp_path / "cpu.pt", "cpu")
    gpu = _train(run, tmp_path / "cuda.pt", "cuda")
    a = checkpoint.load(tmp_path / "cpu.pt").state_dict
    b = checkpoint.load(tmp_path / "cuda.pt").state_dict
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=2e-3, rtol=1e-2, msg=k)
    assert abs(cpu["test_accuracy"] - gpu["test_accuracy"]) <= 2 / 360  # two test images


def test_a_checkpoint_written_on_the_gpu_holds_cpu_tensors(run, tmp_path):
    """A plain torch.load on a machine without CUDA must read it: nothing inside is a CUDA
    tensor, the optimizer's moments included; --resume puts them back on the GPU."""
    out = tmp_path / "t.pt"
    _train(run, out, "cuda")
    obj = torch.load(out, weights_only=True)  # no map_location: devices as saved
    tensors = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            tensors.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list | tuple):
            for v in x:
                walk(v)

    walk(obj)
    assert len(tensors) > len(obj["state_dict"])  # the optimizer's state was walked too
    assert {t.device.type for t in tensors} == {"cpu"}
    resumed = run(
        "train", "--model", "lenet300", "--data", "digits", "--epochs", "2", "--device", "cuda",
        "--out", out, "--resume", "--json", "-q",
    )  # fmt: skip
    assert resumed.exit_code == 0, resumed.stderr
    assert resumed.json()["epochs"] == 2 and resumed.json()["resumed_from"] is not None


def test_bench_times_torch_on_cuda_and_agrees_with_the_cpu(run, tmp_path):
    _train(run, tmp_path / "m.pt", "cpu")
    result = run(
        "bench", tmp_path / "m.pt", "--data", "digits", "--providers", "torch,cuda",
        "--batch", "1,64", "--min-runs", "5", "--min-seconds", "0", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    rows = result.json()["results"]
    by = {(r["provider"], r["batch"]): r for r in rows}
    assert {("pytorch-cpu", 1), ("pytorch-cuda", 1), ("pytorch-cuda", 64)} <= by.keys()
    for batch in (1, 64):
        gpu, cpu = by[("pytorch-cuda", batch)], by[("pytorch-cpu", batch)]
        assert gpu["test_accuracy"] == pytest.approx(cpu["test_accuracy"], abs=1 / 360)
        assert gpu["top1_agreement"] >= 0.99 and gpu["p50_ms"] > 0


def test_ort_cuda_provider_runs_the_fp32_file_on_the_gpu(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip(
            f"onnxruntime {ort.__version__} has no CUDA provider (pip install onnxruntime-gpu)"
        )
    from compresskit.compressor import export
    from compresskit.models import tiny

    net = tiny("lenet5", in_shape=(1, 8, 8), num_classes=10, seed=0).eval()
    x = torch.rand(16, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    path = export.export_onnx(net, x[:2], tmp_path / "m.onnx", export.ExportConfig())
    sess = ort.InferenceSession(str(path), providers=["CUDAExecutionProvider"])
    assert sess.get_providers()[0] == "CUDAExecutionProvider"
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        want = net(x).numpy()
    # ORT's CUDA EP runs fp32 convolutions and matmuls in TF32 by default (use_tf32=1): 10
    # mantissa bits, so errors up to ~1e-3 of the logits' scale (1.3e-4 seen on an H100 with a
    # LeNet-5), where the CPU EP agrees to ~1e-6
    assert np.abs(got - want).max() <= 2e-3 * max(1.0, float(np.abs(want).max()))


def test_a_resumed_cuda_run_with_dropout_ends_where_the_uninterrupted_one_does(run, tmp_path):
    """Dropout on a GPU draws from the GPU's generator, which --resume restores with the CPU's.
    A constant schedule, as a cosine one over 1 epoch differs from one over 2 by design.
    --deterministic: without it cuDNN picks and sums as it likes, and two runs of the same
    command end apart (past 1e-4 on an H100), so only the same bits show the resume is right."""
    common = ["--model", "vgg", "--model-kwargs", '{"dropout": 0.5}', "--data", "digits"]
    common += ["--device", "cuda", "--schedule", "constant", "--deterministic", "--json", "-q"]
    full, part = tmp_path / "full.pt", tmp_path / "part.pt"
    assert run("train", *common, "--epochs", "2", "--out", full).exit_code == 0
    assert run("train", *common, "--epochs", "1", "--out", part).exit_code == 0
    resumed = run("train", *common, "--epochs", "2", "--out", part, "--resume")
    assert resumed.exit_code == 0, resumed.stderr
    a = checkpoint.load(full).state_dict
    b = checkpoint.load(part).state_dict
    for k in a:
        assert torch.equal(b[k], a[k]), (k, float((b[k].double() - a[k].double()).abs().max()))
