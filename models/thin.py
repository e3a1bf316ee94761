"""Channel plans: how a thinned model (whole channels removed by `compressor.channels`) is
rebuilt from its spec.

A checkpoint or archive of a thinned model records the spec it was built from plus a plan:
the example input's shape and dtype, and torch-pruning's pruning history, a list of
`[layer name, out-channel pruning?, [indices]]` applied in order (Fang et al., DepGraph, CVPR
2023). `apply_` builds the dependency graph of a freshly constructed model and replays the
history, so the model takes exactly the thinned shapes and the weights load strictly. The plan
is plain JSON data: nothing in a file decides which code runs, and every entry is checked
against the model before torch-pruning sees it (a crafted plan gets one InputError line).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any

import torch
from torch import nn

from compresskit.models.errors import InputError, one_line

DTYPES = {"float32": torch.float32, "int64": torch.int64}
# Attention with separate query/key/value projections and a head size fixed in code (Hugging
# Face's ViT, BERT, ...): its forward views a projection as (-1 heads, head size), so only whole
# heads may go, never head dimensions (cutting those would shift channels between heads).
QKV = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"))
HEAD_SIZE = ("head_dim", "attention_head_size")
MAX_ENTRIES = 100_000  # a plan holds one entry per pruned group per increment: hundreds


@contextlib.contextmanager
def tracing(model: nn.Module):
    """How torch-pruning may trace `model`: in eval mode (the trace runs a forward pass, and
    BatchNorm statistics must not move), its warnings about free nn.Parameters (a class token,
    positions: it cuts their last dim with the embedding, as wanted) silenced."""
    was = model.training
    model.eval()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        model.train(was)


def attention(model: nn.Module) -> dict[str, tuple[tuple[str, str, str], int]]:
    """The model's attention modules with separate q/k/v `nn.Linear` projections and a fixed
    head size: {module name: ((q, k, v) full names, head size)}."""
    found = {}
    for name, m in model.named_modules():
        size = next((getattr(m, a) for a in HEAD_SIZE if isinstance(getattr(m, a, None), int)), 0)
        if size < 1:
            continue
        for qkv in QKV:
            projs = [getattr(m, p, None) for p in qkv]
            if all(isinstance(p, nn.Linear) and p.out_features % size == 0 for p in projs):
                found[name] = (tuple(f"{name}.{p}" if name else p for p in qkv), size)
                break
    return found


def sync_heads_(model: nn.Module) -> None:
    """After whole heads went: each attention module's head count (and `all_head_size`, where
    it has one) read from its query projection's width, so the module describes itself."""
    for name, (qkv, size) in attention(model).items():
        m = model.get_submodule(name)
        width = model.get_submodule(qkv[0]).out_features
        if isinstance(getattr(m, "num_attention_heads", None), int):
            m.num_attention_heads = width // size
        if isinstance(getattr(m, "all_head_size", None), int):
            m.all_head_size = width


def entry(name: str, out_channels: bool, idxs: Any) -> list[Any]:
    """One history entry as plain data (torch-pruning may hold indices as a tensor)."""
    return [str(name), bool(out_channels), [int(i) for i in idxs]]


def describe_example(example: torch.Tensor) -> dict[str, Any]:
    dtype = {v: k for k, v in DTYPES.items()}.get(example.dtype)
    if dtype is None:
        raise InputError(f"channels: inputs of dtype {example.dtype} are not supported")
    return {"shape": [2, *example.shape[1:]], "dtype": dtype}


def check(plan: Any, where: str = "channel plan") -> dict[str, Any]:
    """The plan's structure, checked: one InputError line for anything malformed."""
    if not isinstance(plan, dict) or set(plan) != {"example", "history"}:
        raise InputError(f"{where}: must be a mapping with 'example' and 'history'")
    ex, history = plan["example"], plan["history"]
    if (
        not isinstance(ex, dict)
        or ex.get("dtype") not in DTYPES
        or not isinstance(ex.get("shape"), list)
        or not 1 <= len(ex["shape"]) <= 5
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in ex["shape"])
        or math.prod(ex["shape"]) > 2**24
    ):
        raise InputError(f"{where}: 'example' must be {{shape: [2, ...], dtype: float32|int64}}")
    if not isinstance(history, list) or len(history) > MAX_ENTRIES:
        raise InputError(f"{where}: 'history' must be a list of at most {MAX_ENTRIES} entries")
    for e in history:
        if not (
            isinstance(e, list)
            and len(e) == 3
            and isinstance(e[0], str)
            and isinstance(e[1], bool)
            and isinstance(e[2], list)
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in e[2])
        ):
            raise InputError(f"{where}: each history entry must be [layer, bool, [indices]]")
    return plan


def apply_(model: nn.Module, plan: Any, name: str = "model") -> nn.Module:
    """Cut `model` (freshly built from its spec) to the plan's shapes, in place."""
    plan = check(plan, f"model {name}: channel plan")
    modules = dict(model.named_modules())
    for layer, _, idxs in plan["history"]:
        if layer not in modules or not layer:
            raise InputError(f"model {name}: channel plan names layer {layer!r}, which it lacks")
        if len(set(idxs)) != len(idxs):
            raise InputError(f"model {name}: channel plan repeats an index of layer {layer!r}")
    import torch_pruning as tp

    ex = plan["example"]
    example = torch.ones(ex["shape"], dtype=DTYPES[ex["dtype"]])
    try:
        with tracing(model):
            graph = tp.DependencyGraph().build_dependency(model, example_inputs=example)
            for layer, out, idxs in plan["history"]:
                if not idxs:
                    continue
                module = modules[layer]
                width = graph.get_out_channels(module) if out else graph.get_in_channels(module)
                if width is not None and (max(idxs) >= width or len(idxs) >= width):
                    raise InputError(
                        f"model {name}: channel plan cuts {len(idxs)} of {width} channels of "
                        f"layer {layer!r}, or an index past them"
                    )
                graph.load_pruning_history([[layer, out, idxs]])
        sync_heads_(model)
    except InputError:
        raise
    except Exception as e:
        detail = one_line(e, 160)
        raise InputError(
            f"model {name}: its channel plan does not fit the model ({type(e).__name__}: {detail})"
        ) from None
    return model
