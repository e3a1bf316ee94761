import numpy as np
import pytest
import torch

from compresskit.compressor import kmeans, prune
from compresskit.distrib.trainer import TrainConfig, fit
from compresskit.models import InputError, tiny
from compresskit.models.data import load


def lloyd_1d(w, centroids, iters=1000):
    """Brute-force Lloyd: assign to the nearest centroid, move centroids to their means."""
    c = np.array(centroids, dtype=np.float64)
    for _ in range(iters):
        labels = np.argmin(np.abs(w[:, None] - c[None, :]), axis=1)
        new = np.array(
            [w[labels == j].mean() if np.any(labels == j) else c[j] for j in range(len(c))]
        )
        if np.allclose(new, c, rtol=0, atol=0):
            break
        c = new
    return c, labels


@pytest.mark.parametrize("seed", range(5))
def test_linear_init_kmeans_equals_brute_force_lloyd(seed):
    rng = np.random.default_rng(seed)
    w = np.concatenate(
        [rng.normal(-0.5, 0.1, 60), rng.normal(0.3, 0.05, 40), rng.normal(1.0, 0.2, 20)]
    )
    centroids, labels = kmeans.kmeans_1d(w, 4, tol=0)
    ref, ref_labels = lloyd_1d(w, kmeans.linear_init(w, 4))
    order = np.argsort(ref)
    assert np.allclose(centroids, ref[order], atol=1e-6)
    assert np.array_equal(labels, np.argsort(order)[ref_labels])


def test_linear_init_spans_min_to_max():
    assert kmeans.linear_init(np.array([-1.0, 0.2, 3.0]), 5).tolist() == [-1.0, 0.0, 1.0, 2.0, 3.0]


def test_fewer_distinct_values_than_clusters():
    c, labels = kmeans.kmeans_1d(np.array([0.5, -0.5, 0.5]), 8)
    assert c.tolist() == [-0.5, 0.5] and labels.tolist() == [1, 0, 1]


def test_centroid_gradient_is_the_sum_of_member_gradients():
    model = tiny("mlp", in_shape=(1, 8, 8))
    layer = model.fc1
    w0 = layer.weight.detach().clone()
    kmeans.share_weights_(model, kmeans.QuantizeConfig(fc_bits=3))
    shared = kmeans.shared_of(model)["fc1"]
    x = torch.rand(5, 1, 8, 8)
    model(x).square().sum().backward()
    # Reference: the gradient wrt a plain weight tensor holding the shared values.
    plain = tiny("mlp", in_shape=(1, 8, 8))
    plain.load_state_dict(
        {
            **plain.state_dict(),
            "fc1.weight": layer.weight.detach(),
            "fc1.bias": layer.bias.detach(),
            "fc2.weight": model.fc2.weight.detach(),
            "fc2.bias": model.fc2.bias.detach(),
        }
    )
    plain(x).square().sum().backward()
    g = plain.fc1.weight.grad
    expected = torch.zeros_like(shared.codebook).index_add_(0, shared.index.flatten(), g.flatten())
    assert torch.allclose(shared.codebook.grad, expected, atol=1e-5)
    assert not torch.equal(w0, layer.weight)


def test_fine_tuning_keeps_sharing_zeros_and_assignment():
    data = load("digits")
    model = tiny("lenet5", in_shape=data.in_shape)
    prune.prune_(model, prune.PruneConfig(sparsity=0.6))
    bits = kmeans.share_weights_(model, kmeans.QuantizeConfig(conv_bits=3, fc_bits=2))
    index = {n: s.index.clone() for n, s in kmeans.shared_of(model).items()}
    codebooks = {n: s.codebook.detach().clone() for n, s in kmeans.shared_of(model).items()}
    fit(model, data, TrainConfig(epochs=2))
    for name, s in kmeans.shared_of(model).items():
        w = model.get_submodule(name).weight
        assert kmeans.distinct_values(w) <= 2 ** bits[name]
        assert torch.all(w[~s.mask] == 0)
        assert torch.equal(s.index, index[name])
        assert not torch.equal(s.codebook.detach(), codebooks[name])  # the centroids trained


def test_weights_mode_holds_sharing_while_weights_train():
    data = load("digits")
    model = tiny("mlp", in_shape=data.in_shape)
    prune.prune_(model, prune.PruneConfig(sparsity=0.5))
    kmeans.share_weights_(model, kmeans.QuantizeConfig(fc_bits=3, mode="weights"))
    fit(model, data, TrainConfig(epochs=1))
    kmeans.freeze_sharing_(model)
    for name, s in kmeans.shared_of(model).items():
        w = model.get_submodule(name).weight
        assert kmeans.distinct_values(w) <= 8 and torch.all(w[~s.mask] == 0)
        assert set(w[s.mask].unique().tolist()) <= set(s.codebook.detach().tolist())


def _original_bytes(model) -> dict[str, int]:
    from torch.nn.utils import parametrize

    return {
        f"{mname}.{pname}": plist.original.untyped_storage().nbytes()
        for mname, m in model.named_modules()
        if parametrize.is_parametrized(m)
        for pname, plist in m.parametrizations.items()
    }


def test_centroids_mode_holds_no_original_weights():
    """Fine-tuning centroids never reads the float originals: they keep their shape, not their
    bytes; the shared weights, their training and a state_dict round trip are unchanged."""
    data = load("digits")
    model = tiny("lenet5", in_shape=data.in_shape)
    prune.prune_(model, prune.PruneConfig(sparsity=0.6))
    dense = {k: v.clone() for k, v in model.state_dict().items()}
    kmeans.share_weights_(model, kmeans.QuantizeConfig(conv_bits=3, fc_bits=2))
    held = _original_bytes(model)
    assert held and all(n <= 4 for n in held.values()), held
    for name, s in kmeans.shared_of(model).items():
        w = model.get_submodule(name).weight
        original = model.get_submodule(name).parametrizations.weight.original
        assert original.shape == w.shape and not original.requires_grad
        expect = torch.where(s.mask, s.codebook.detach()[s.index.long()], 0.0)
        assert torch.equal(w.detach(), expect)
        assert dense[f"{name}.parametrizations.weight.original"].ne(0).any()  # it had bytes
    fit(model, data, TrainConfig(epochs=1))
    assert all(n <= 4 for n in _original_bytes(model).values())
    twin = tiny("lenet5", in_shape=data.in_shape)
    prune.prune_(twin, prune.PruneConfig(sparsity=0.6))
    kmeans.share_weights_(twin, kmeans.QuantizeConfig(conv_bits=3, fc_bits=2))
    twin.load_state_dict(model.state_dict())
    x = data.x_test[:8]
    assert torch.equal(twin.eval()(x), model.eval()(x))


def test_weights_mode_drops_the_originals_once_frozen():
    model = tiny("mlp")
    kmeans.share_weights_(model, kmeans.QuantizeConfig(fc_bits=3, mode="weights"))
    assert all(n > 4 for n in _original_bytes(model).values())  # they train
    before = {n: model.get_submodule(n).weight.detach().clone() for n in kmeans.shared_of(model)}
    kmeans.freeze_sharing_(model)
    assert all(n <= 4 for n in _original_bytes(model).values())
    for n, w in before.items():
        assert torch.equal(model.get_submodule(n).weight.detach(), w)


def test_unknown_layer_and_bad_bits():
    with pytest.raises(InputError, match="no layer named fc9"):
        kmeans.share_weights_(tiny("mlp"), kmeans.QuantizeConfig(bits={"fc9": 4}))
    with pytest.raises(InputError, match="impossible"):
        kmeans.QuantizeConfig(fc_bits=0)


def test_weights_mode_forward_is_exactly_the_centroids():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 30, generator=g, requires_grad=True)
    mask = torch.rand(40, 30, generator=g) > 0.5
    start = torch.zeros(40, 30, dtype=torch.int64)
    s = kmeans.SharedWeights(torch.linspace(-2, 2, 7), start, mask, mode="weights")
    out = s(w)
    nearest = kmeans.nearest(w.detach(), s.codebook.detach())
    assert torch.equal(out.detach(), torch.where(mask, s.codebook.detach()[nearest], 0.0))
    assert not torch.signbit(out[~mask]).any()
    out.sum().backward()  # straight-through: the kept originals get the weight's gradient
    assert torch.equal(w.grad, mask.float())


def test_fine_tuning_keeps_no_pruned_originals_alive(tmp_path):
    """Through the whole shrink: while the centroids fine-tune, no float weight of the pruned
    model is left alive (the histogram's weights, computed through the pruning mask with a
    graph, once kept every pruned original and its gradient: 2x the model's bytes)."""
    import gc

    from compresskit.compressor import recipe, shrink

    def plain(o) -> bool:
        return type(o) in (torch.Tensor, torch.nn.Parameter) and not o.is_meta  # not fakes

    model = tiny("lenet300", in_shape=(1, 8, 8))
    gc.collect()
    before = {id(o) for o in gc.get_objects() if plain(o)}  # other tests' tensors
    seen: list[list[tuple]] = []

    def retrain(m, epochs, lr, loss_fn=None, data=None):
        for p in m.parameters():  # a retraining run leaves gradients, as fit does
            if p.requires_grad:
                p.grad = torch.ones_like(p)
        gc.collect()
        inside = {p.untyped_storage().data_ptr() for p in m.parameters()}
        weights = {tuple(p.shape) for p in m.parameters() if p.dim() == 2}
        seen.append(
            [
                (type(o).__name__, tuple(o.shape))
                for o in gc.get_objects()
                if plain(o)
                and id(o) not in before
                and tuple(o.shape) in weights
                and o.untyped_storage().nbytes() > 4
                and o.untyped_storage().data_ptr() not in inside
                and o.is_floating_point()
            ]
        )

    hooks = shrink.Hooks(retrain=retrain, test_accuracy=lambda m: 0.5, val_accuracy=lambda m: 0.5)
    r = recipe.resolve(
        {"prune": {"rounds": 1, "retrain_epochs": 1}, "quantize": {"finetune_epochs": 1}}
    )
    shrink.shrink(model, {"name": "lenet300", "kwargs": {}}, r, hooks, tmp_path)
    _, fine_tuning = seen
    assert fine_tuning == []
