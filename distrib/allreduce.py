"""The all-reduce strategy: DistributedDataParallel (Li et al., VLDB 2020) over the one
training loop, with gradient compression through DDP communication hooks.

`wrap(model, compression)` returns the DDP module and a `CommStats` that counts the bytes each
rank puts on the wire. Every compression goes through a hook of ours, so the count is the same
for all of them:
  * none: all-reduce the fp32 bucket (what DDP does without a hook), divided by the world size;
  * fp16 / bf16: cast the bucket, all-reduce, divide, cast back (Agarwal et al. 2021's
    "gradient compression" baseline). torch's own bf16 hook refuses non-NCCL backends by name,
    while gloo reduces bf16 tensors fine, so both casts are written here, for gloo and NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from compresskit.models.errors import InputError

COMPRESSIONS = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class CommStats:
    bytes: int = 0  # this rank's all-reduce payload
    calls: int = 0


def _hook(dtype: torch.dtype | None):
    # No annotations: DDP compares the `bucket` annotation with dist.GradBucket itself, and
    # this module's postponed annotations would be strings.
    def hook(stats, bucket):
        buf = bucket.buffer()
        world = dist.get_world_size()
        wire = buf if dtype is None else buf.to(dtype)
        wire.div_(world)
        stats.bytes += wire.numel() * wire.element_size()
        stats.calls += 1
        fut = dist.all_reduce(wire, async_op=True).get_future()

        def back(f: torch.futures.Future) -> torch.Tensor:
            out = f.value()[0]
            if dtype is not None:
                buf.copy_(out)
                return buf
            return out

        return fut.then(back)

    return hook


def wrap(
    model: nn.Module, compression: str = "none", device: str = "cpu"
) -> tuple[nn.Module, CommStats]:
    """DDP around `model` (broadcasting rank 0's weights) with the gradient hook."""
    if compression not in COMPRESSIONS:
        raise InputError(
            f"--grad-compression {compression!r}: give one of {', '.join(COMPRESSIONS)}"
        )
    from torch.nn.parallel import DistributedDataParallel

    on_gpu = torch.device(device).type == "cuda"
    ddp = DistributedDataParallel(model, device_ids=[torch.device(device)] if on_gpu else None)
    stats = CommStats()
    ddp.register_comm_hook(stats, _hook(COMPRESSIONS[compression]))
    return ddp, stats
