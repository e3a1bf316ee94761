"""compresskit._mem: freed heap memory goes back to the OS between stages (glibc)."""

import platform

import pytest

from compresskit import _mem


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_trim_finds_glibc_malloc_trim_and_returns_freed_pages():
    assert _mem._malloc_trim() is not None
    # 64 KiB blocks (below the mmap threshold, so they live on the heap), every other one
    # freed: holes inside the heap, which free() keeps and malloc_trim hands back.
    blocks = [bytearray(65536) for _ in range(1000)]
    del blocks[::2]
    assert _mem.trim() is True
    del blocks


def test_trim_is_a_bool_everywhere(monkeypatch):
    monkeypatch.setattr(_mem, "_malloc_trim", lambda: None)  # another C library
    assert _mem.trim() is False


def test_eval_batch_fits_the_largest_layer_in_the_budget():
    import torch
    from torch import nn

    # One layer: per sample 100 inputs + 1,000 outputs, float32, twice for headroom = 8,800 B.
    model = nn.Linear(100, 1000)
    x = torch.randn(8, 100)
    assert _mem.eval_batch(model, x, budget=88_000) == 10
    assert _mem.eval_batch(model, x, budget=8_799) == 1  # never below one sample
    assert _mem.eval_batch(model, x, budget=1 << 40) == _mem.EVAL_MAX_BATCH
    # Cached per model and sample shape; another sample shape is measured again.
    conv = nn.Conv2d(3, 64, 3, padding=1)
    small, large = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 32, 32)
    b_small = _mem.eval_batch(conv, small, budget=1 << 24)
    b_large = _mem.eval_batch(conv, large, budget=1 << 24)
    assert b_small == (1 << 24) // (2 * 4 * (3 + 64) * 64)
    assert b_large == (1 << 24) // (2 * 4 * (3 + 64) * 1024)
    assert model.training is True  # the probe restores the mode it found
    # The largest module counts: a ReLU after the Linear holds 1,000 in + 1,000 out.
    assert _mem.eval_batch(nn.Sequential(nn.Linear(100, 1000), nn.ReLU()), x, 88_000) == 5


def test_evaluation_with_the_sized_batch_equals_a_fixed_batch():
    import torch
    from torch import nn

    from compresskit.distrib.trainer import evaluate_samples

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 30 * 30, 5))
    x, y = torch.randn(300, 3, 32, 32), torch.randint(0, 5, (300,))
    assert _mem.eval_batch(model, x) < 300  # several batches: the sized path is exercised
    loss_auto, hits_auto = evaluate_samples(model, x, y)
    loss_one, hits_one = evaluate_samples(model, x, y, batch_size=300)
    assert torch.equal(hits_auto, hits_one)
    assert abs(loss_auto - loss_one) < 1e-5


def test_eval_batch_probes_once_per_model_and_again_after_thinning():
    import torch
    from torch import nn

    calls = []
    model = nn.Sequential(nn.Linear(10, 20), nn.BatchNorm1d(20), nn.Linear(20, 3))
    model.register_forward_hook(lambda *a: calls.append(1))
    running = model[1].running_mean.clone()
    x = torch.randn(4, 10)
    first = _mem.eval_batch(model, x, budget=1 << 20)
    assert _mem.eval_batch(model, x, budget=1 << 20) == first and calls == [1]  # cached
    # The probe runs in eval mode: BatchNorm's running statistics are untouched.
    assert torch.equal(model[1].running_mean, running)
    assert int(model[1].num_batches_tracked) == 0 and model.training
    model[0] = nn.Linear(10, 2000)  # the model changed in place (as the channels stage does)
    model[1] = nn.BatchNorm1d(2000)
    model[2] = nn.Linear(2000, 3)
    assert _mem.eval_batch(model, x, budget=1 << 20) < first and calls == [1, 1]


def test_eval_batch_counts_activations_not_parametrized_weights():
    import torch
    from torch import nn
    from torch.nn.utils import parametrize

    class Masked(nn.Module):  # as pruning's mask: weight in, weight out
        def forward(self, w):
            return w * (w.abs() > 0.01)

    # A 2x2000 weight: its first dimension matches the 2-sample probe's batch, so only
    # leaving the parametrization modules out keeps it from counting.
    big = nn.Linear(2000, 2)
    plain = _mem.eval_batch(big, torch.randn(4, 2000), budget=1 << 22)
    parametrize.register_parametrization(big, "weight", Masked())
    # The same batch: the mask's 16 kB in and out are not per-sample activations (the cache
    # key changed with the module count, so this is a fresh probe).
    assert _mem.eval_batch(big, torch.randn(4, 2000), budget=1 << 22) == plain
    assert plain == (1 << 22) // (2 * 4 * (2000 + 2))
