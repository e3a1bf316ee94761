"""The parameter-server strategy: sharded servers hold the weights and the optimizer, workers
push gradients and pull weights (Li et al., "Scaling Distributed Machine Learning with the
Parameter Server", OSDI 2014; Dean et al., "Large Scale Distributed Deep Networks", NIPS 2012).

Three consistency models, one server loop:
  * sync:  every worker takes its part of each global batch, as in all-reduce; a server waits
           for the step's gradient from every worker, averages them and steps once, so N
           workers train exactly like all-reduce data parallelism (tested allclose);
  * async: batches are handed out as workers come free, and each gradient is applied as it
           arrives (Downpour SGD), optionally after `sync_warmup_epochs` of synchronous
           training, as DistBelief started. A fast worker takes more batches than a slow one,
           so a straggler no longer sets the pace;
  * ssp:   bounded delay (Li et al. section 3.3; stale synchronous parallel, Ho et al., NIPS
           2013): as async, but a worker may start batch t only while the slowest batch still
           being computed is at most `staleness` clocks older. A clock is one round of N
           batches, the data of one synchronous step: 0 is bulk-synchronous, inf is async.

Batches are dealt from a counter in the job's c10d store (`launch.store()`), batch t being
batch t mod K of epoch t div K (K batches of `batch_size` per epoch). A worker takes its next
batch before it pushes, and the push tells the servers which batch that is, so each server
knows how far every worker has got and holds back the weights of a worker that is too far
ahead.

Transport: torch.distributed point-to-point messages (send/recv with tags) in the same process
group machinery as all-reduce; never torch.distributed.rpc (maintenance mode, and its shutdown
hangs once a peer has died) and never sockets of our own. Ranks 0..N-1 are workers (rank 0
reports and checkpoints), ranks N..N+S-1 servers. The model's parameters are one flat fp32
vector cut into S contiguous shards balanced by size (large tensors are split across servers).

One message per push and one per pull: a push is the header's float64 fields (kind, clock or
batch, lr, ...) followed by the gradient shard's bytes in one uint8 buffer; a pull is the
weight shard alone. A worker posts its S pull receives, then sends its S pushes at once, and
waits for all of them together. A server keeps a receive posted for its workers at all times,
so a message lands while the server is busy with another, and it waits on those receives
itself (no listener thread and no queue between a message and the update it causes):
  * sync: every live worker must push each step, so the server waits on one worker's posted
    receive after another; a receive from one peer fails within a fraction of a second when
    that peer dies, so a lost worker is noticed and named at once;
  * async, SSP: whoever pushes first is served first, from one receive posted for any source.
    A receive from any source would wait for ever on a dead peer, so a watchdog thread per
    worker waits, on a second process group of its own, for the worker's farewell message:
    it fails at once when that worker dies, and then leaves it behind (only then, off the
    hot path, does a second thread touch the server's state, under its lock).
gloo cannot test a posted receive without waiting on it (`is_completed()` stays False until
`wait()`), and a wait with a timeout of its own closes the pair when it expires: hence the
ordered waits and the any-source receive, never polling.

Every send and recv waits at most the process group's timeout (`--timeout`); one that fails
because a rank stopped answering (its heartbeat went silent, `launch.silent_peer`) names that
rank and ends the job in every mode: a stopped process is not a dead one, and would hold
its shard or its batch for ever.
"""

from __future__ import annotations

import datetime
import inspect
import math
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import optimizer as torch_optimizer
from torch.optim.adam import adam as adam_update
from torch.optim.sgd import sgd as sgd_update

from compresskit.distrib import launch
from compresskit.distrib.trainer import Batches
from compresskit.models.errors import InputError, StageError

MODES = ("sync", "async", "ssp")
WIRE = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# Message kinds (the first field of every header), and the tags of the two directions: a
# worker's messages to a server (header and payload in one) and a server's replies.
PUSH, STATE, DONE, STATS, BYE = 1, 3, 4, 5, 6
ASK, REPLY = 1, 2
HEADER = 6  # float64 fields: kind and five that depend on the kind
HEAD_BYTES = 8 * HEADER
FAREWELL_WAIT_S = 5.0  # how long a server leaving waits for its watchdogs' last messages
# A straggler's factor: 1e308 overflowed time.sleep; past 1000x a worker does no step at all.
MAX_STRAGGLER = 1000.0
HIST_BINS = 64  # staleness histogram bins 0..62, and 63 for "63 or more"
SLOTS = {"sgd": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq")}  # optimizer state
TASKS_KEY = "ps/batches"  # the store counter that deals batches in the asynchronous modes


@dataclass(frozen=True)
class PSConfig:
    """How the parameter server runs. `staleness` only matters for `ssp`;
    `sync_warmup_epochs` only for `async`; `straggler` = (worker rank, slow-down factor)."""

    mode: str = "sync"
    workers: int = 2
    servers: int = 1
    staleness: int = 4
    sync_warmup_epochs: int = 0
    straggler: tuple[int, float] | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InputError(f"parameter-server mode {self.mode!r}: use one of {MODES}")
        if self.servers < 1:
            raise InputError(f"--servers {self.servers}: give 1 or more")
        if self.workers < 1:
            raise InputError(f"--workers {self.workers}: give 1 or more")
        if self.staleness < 0:
            raise InputError(f"--staleness {self.staleness}: give 0 or more clocks")
        if self.sync_warmup_epochs < 0:
            raise InputError(f"--sync-warmup-epochs {self.sync_warmup_epochs}: give 0 or more")
        if self.sync_warmup_epochs and self.mode != "async":
            raise InputError(
                f"--sync-warmup-epochs belongs to ps-async; drop it for ps-{self.mode}"
            )
        if self.straggler is not None:
            rank, factor = self.straggler
            if not 0 <= rank < self.workers:
                raise InputError(
                    f"--straggler {rank}:{factor:g}: there is no worker {rank} "
                    f"(workers are 0..{self.workers - 1})"
                )
            if not 1 <= factor <= MAX_STRAGGLER:  # NaN fails both
                raise InputError(
                    f"--straggler {rank}:{factor:g}: the factor must be 1..{MAX_STRAGGLER:g} "
                    "(how many times slower the worker runs)"
                )

    @property
    def bound(self) -> float:
        """Clocks a worker may run ahead of the slowest: 0 in sync, inf in async."""
        return {"sync": 0, "ssp": self.staleness, "async": math.inf}[self.mode]

    def server_rank(self, s: int) -> int:
        return self.workers + s

    def name(self, rank: int) -> str:
        if rank < self.workers:
            return f"worker {rank}"
        return f"server {rank - self.workers} (rank {rank})"

    def synchronous(self, epoch: int) -> bool:
        """Whether `epoch` trains synchronously (static global batches, averaged gradients)."""
        return self.mode == "sync" or epoch < self.sync_warmup_epochs


# ---- pure tensor plumbing: flatten, shard, rejoin ------------------------------------------


ALIGN = 64  # elements; a multiple of every CPU's float32 and float64 vector width


def shard_bounds(numel: int, servers: int) -> list[tuple[int, int]]:
    """Cut a flat vector of `numel` elements into `servers` contiguous [start, end) ranges,
    balanced by bytes (every element is fp32).

    Boundaries fall on multiples of ALIGN wherever the vector holds ALIGN elements a server
    (sizes then differ by less than 2 x ALIGN): torch's fused Adam runs a vectorised body and
    a scalar tail per tensor, which round differently, so only shards cut on vector blocks
    update every value as any other shard count does, and a checkpoint resumes bit for bit
    under another --servers. Smaller vectors are cut to within one element."""
    if servers < 1:
        raise InputError(f"--servers {servers}: give 1 or more")
    if servers > numel:
        raise InputError(
            f"--servers {servers}: the model has only {numel} parameter values to shard; "
            f"give --servers {numel} or fewer"
        )
    unit = ALIGN if numel >= ALIGN * servers else 1
    base, extra = divmod(numel // unit, servers)
    bounds, start = [], 0
    for s in range(servers):
        end = start + unit * (base + (s < extra)) if s < servers - 1 else numel
        bounds.append((start, end))
        start = end
    return bounds


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Split `flat` back into tensors shaped and typed like `like`."""
    if flat.numel() != sum(t.numel() for t in like):
        raise ValueError(f"{flat.numel()} values for tensors of {sum(t.numel() for t in like)}")
    out, start = [], 0
    for t in like:
        out.append(flat[start : start + t.numel()].reshape(t.shape).to(t.dtype))
        start += t.numel()
    return out


def shard(flat: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    return [flat[a:b] for a, b in bounds]


def join(chunks: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat(list(chunks))


def _params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _header(kind: int, *fields: float) -> torch.Tensor:
    """kind and up to five numbers: PUSH (clock, lr, next batch, synchronous, samples),
    DONE (steps, idle s, training s), STATE reply (optimizer step, slots)."""
    return torch.tensor([kind, *fields] + [0] * (HEADER - 1 - len(fields)), dtype=torch.float64)


def _message(kind: int, *fields: float) -> torch.Tensor:
    """A message of a header alone, as bytes (the receiver's buffer may be longer)."""
    return _header(kind, *fields).view(torch.uint8)


def _fields(msg: torch.Tensor) -> list[float]:
    return msg[:HEAD_BYTES].view(torch.float64).tolist()


def _watch_group() -> Any:
    """The asynchronous modes' second process group, on which a server's watchdogs wait for
    each worker's farewell; every rank creates it once, at the start (a collective). Its
    timeout is long: its receives are meant to wait all run, and fail when a peer dies."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(days=7))


# ---- the batch schedule of the asynchronous modes -------------------------------------------


@dataclass(frozen=True)
class Deal:
    """Batches dealt one at a time: batch t is batch t % per_epoch of epoch t // per_epoch."""

    per_epoch: int  # batches of `batch_size` in one epoch
    total: int  # batches in the whole run
    first: int  # the first batch dealt in this run (after a warm-up or a resume)

    @classmethod
    def plan(
        cls, ps: PSConfig, n: int, batch_size: int, epochs: int, resume_at: tuple[int, int]
    ) -> Deal:
        per_epoch = math.ceil(n / batch_size)
        epoch, step = resume_at
        first = per_epoch * ps.sync_warmup_epochs  # where the asynchronous epochs begin
        if not ps.synchronous(epoch):  # a resume inside them: go on from there
            first = per_epoch * epoch + step
        return cls(per_epoch, per_epoch * epochs, first)


# ---- the worker side ------------------------------------------------------------------------


@dataclass
class WorkerStats:
    comm_bytes: int = 0  # payload bytes pushed and pulled by this worker
    idle_s: float = 0.0  # time spent in push/pull: on the wire or waiting for the servers
    straggle_s: float = 0.0  # simulated slow-down (--straggler)
    steps: int = 0
    samples: int = 0
    push_messages: int = 0  # messages sent by `step` (one per server per step)
    pull_messages: int = 0  # messages received by `step` (one per server per step)


class PSWorker:
    """What the training loop calls on a worker rank: which batches to train (`per_epoch`,
    `steps`, `indices`, as `trainer.Batches`) and, instead of `optimizer.step()`, `step`."""

    def __init__(
        self,
        ps: PSConfig,
        rank: int,
        model: nn.Module,
        n: int,
        batch_size: int,
        epochs: int,
        optimizer: str = "adam",
        compression: str = "none",
        resume_at: tuple[int, int] = (0, 0),
        store: Any = None,
    ):
        self.ps, self.rank, self.optimizer = ps, rank, optimizer
        self.workers = ps.workers
        self.wire = WIRE[compression]
        self.bounds = shard_bounds(sum(p.numel() for p in _params(model)), ps.servers)
        self.static = Batches(n, batch_size, ps.workers, rank)
        self.batch_size = batch_size
        self.deal = Deal.plan(ps, n, batch_size, epochs, resume_at)
        self.store = store
        self._next: int | None = None  # the batch dealt to this worker and not yet started
        self._batch = -1  # the batch being computed
        self.stats = WorkerStats()
        self._began = 0.0  # when this step's batch was handed to the training loop
        self._first = self._end = 0.0  # when the first batch was handed out, the last step ended
        self._finished = False
        self.summary: dict[str, Any] = {}
        # Buffers reused every step: per server the header, then the gradient shard (the
        # pieces of the parameters that fall into it are copied there directly); the weights
        # pulled land side by side in one flat vector.
        size = torch.empty(0, dtype=self.wire).element_size()
        self._out = [
            torch.empty(HEAD_BYTES + (b - a) * size, dtype=torch.uint8) for a, b in self.bounds
        ]
        self._heads = [out[:HEAD_BYTES].numpy().view("float64") for out in self._out]
        self._in = torch.empty(self.bounds[-1][1], dtype=self.wire)
        params = _params(model)
        self._model, self._params = model, params  # `step` is called with this model
        sizes = [p.numel() for p in params]
        self._offsets = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
        self._pieces = [
            [
                (k, max(a, o) - o, min(b, o + n) - o)
                for k, (o, n) in enumerate(zip(self._offsets, sizes, strict=False))
                if o < b and o + n > a
            ]
            for a, b in self.bounds
        ]
        self._watch = _watch_group() if ps.mode != "sync" else None
        # The pulled weights can land in the parameters themselves: where the wire carries
        # float32 and every parameter is a float32 CPU tensor, each becomes a view of the
        # receive buffer (no copy after every pull: 50-70 us of a 0.46 ms round trip for 200 kB
        # on 2 cores). The worker runs no optimizer of its own; its parameters change only here.
        self._in_place = self.wire == torch.float32 and all(
            p.dtype == torch.float32 and p.device.type == "cpu" for p in params
        )
        if self._in_place:
            with torch.no_grad():
                for p, a, b in zip(params, self._offsets, self._offsets[1:], strict=False):
                    view = self._in[a:b].view(p.shape)
                    view.copy_(p)
                    p.data = view

    # -- the batch schedule (the interface of trainer.Batches)
    def per_epoch(self, epoch: int) -> int:
        return self.static.per_epoch(epoch) if self.ps.synchronous(epoch) else self.deal.per_epoch

    def steps(self, epoch: int, start: int) -> Iterator[int]:
        if self.ps.synchronous(epoch):
            for step in self.static.steps(epoch, start):
                self._start_batch()
                yield step
            return
        while True:
            t = self._peek()
            if t >= self.deal.total or t // self.deal.per_epoch > epoch:
                return  # none left, or the next batch belongs to a later epoch
            self._next, self._batch = None, t
            self._start_batch()
            yield t % self.deal.per_epoch

    def _start_batch(self) -> None:
        self._began = time.perf_counter()
        self._first = self._first or self._began

    def indices(self, order: torch.Tensor, epoch: int, step: int) -> torch.Tensor:
        if self.ps.synchronous(epoch):
            return self.static.indices(order, epoch, step)
        return order[step * self.batch_size : (step + 1) * self.batch_size]

    def _peek(self) -> int:
        if self._next is None:
            self._next = self.deal.first + int(self.store.add(TASKS_KEY, 1)) - 1
        return self._next

    # -- one training step: push the gradient shards, pull the new weight shards
    def step(self, model: nn.Module, lr: float, epoch: int, step: int, samples: int) -> None:
        t0 = time.perf_counter()
        if self.ps.straggler is not None and self.ps.straggler[0] == self.rank:
            # This step's compute (batch gather, forward, backward) took t0 - began: sleep
            # (factor - 1) times as long, so the step computes `factor` times slower.
            pause = (self.ps.straggler[1] - 1.0) * (t0 - self._began)
            time.sleep(pause)
            self.stats.straggle_s += pause
            t0 = time.perf_counter()
        if self.ps.synchronous(epoch):  # the servers group gradients by global step
            head = (PUSH, epoch * self.static.steps_per_epoch + step, lr, -1, 1, samples)
        else:  # say which batch comes next, so the servers can bound how far ahead it is
            nxt = self._peek()
            nxt = nxt if nxt < self.deal.total else -1
            head = (PUSH, self._batch, lr, nxt, 0, samples)
        params = self._params if model is self._model else _params(model)
        grads = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
            for p in params
        ]
        # Post the S pulls first, then send the S pushes at once: one message each way and
        # server, every transfer in flight together.
        pulls, pushes = [], []
        for s, (a, b) in enumerate(self.bounds):
            pulls.append(dist.irecv(self._in[a:b], self.ps.server_rank(s), tag=REPLY))
        for s, (out, pieces) in enumerate(zip(self._out, self._pieces, strict=True)):
            self._heads[s][:] = head  # numpy's view of the header: no tensor made per step
            parts = [grads[k][i:j] for k, i, j in pieces]
            payload = out[HEAD_BYTES:].view(self.wire)
            if all(t.dtype == self.wire for t in parts):
                torch.cat(parts, out=payload)
            else:
                payload.copy_(torch.cat([t.float() for t in parts]))
            pushes.append(dist.isend(out, self.ps.server_rank(s), tag=ASK))
        self.stats.push_messages += len(pushes)
        self.stats.pull_messages += len(pulls)
        self._wait(pushes + pulls)
        if not self._in_place:
            with torch.no_grad():
                for p, a, b in zip(params, self._offsets, self._offsets[1:], strict=False):
                    p.copy_(self._in[a:b].view(p.shape))
        self.stats.comm_bytes += 2 * self._in.numel() * self._in.element_size()
        self.stats.steps += 1
        self.stats.samples += samples
        self._end = time.perf_counter()
        self.stats.idle_s += self._end - t0

    def _wait(self, works) -> None:
        try:
            for w in works:
                w.wait()
        except RuntimeError as e:
            silence = launch.silent_peer()
            if silence is not None:
                raise _hung(silence, f"worker {self.rank}") from None
            raise StageError(
                f"a parameter server stopped answering worker {self.rank}: {launch.gloo_line(e)}"
            ) from None

    # -- rank 0 only: the servers' master state, for evaluation and checkpoints
    def take_master(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any] | None:
        """Copy the servers' weights into `model` and return their optimizer state in torch's
        one-process format (so a checkpoint resumes under any strategy and shard count).
        Asynchronous modes go on while the shards are read one after another, so a shard may
        be a few updates newer than the one before it."""
        params = _params(model)
        weights, slots, steps = [], {}, []
        names = SLOTS[self.optimizer]
        for s, (a, b) in enumerate(self.bounds):
            src = self.ps.server_rank(s)
            # One reply: header (optimizer step, slots sent), weights, then every slot.
            reply = torch.empty(HEAD_BYTES + 4 * (b - a) * (1 + len(names)), dtype=torch.uint8)
            got = dist.irecv(reply, src, tag=REPLY)
            self._wait([dist.isend(_message(STATE), src, tag=ASK), got])
            head = _fields(reply)
            steps.append(int(head[1]))
            values = reply[HEAD_BYTES:].view(torch.float32).view(1 + len(names), b - a)
            weights.append(values[0])
            for k, name in enumerate(names[: int(head[2])]):
                slots.setdefault(name, []).append(values[1 + k])
        with torch.no_grad():
            for p, w in zip(params, unflatten(join(weights), params), strict=True):
                p.copy_(w)
        state: dict[int, dict[str, Any]] = {}
        if slots and all(len(parts) == len(self.bounds) for parts in slots.values()):
            full = {name: unflatten(join(parts), params) for name, parts in slots.items()}
            for i in range(len(params)):
                state[i] = {name: full[name][i] for name in full}
                if self.optimizer == "adam":
                    state[i]["step"] = torch.tensor(float(min(steps)))
        return {"state": state, "param_groups": optimizer.state_dict()["param_groups"]}

    # -- the end: say done; rank 0 also waits for everyone and takes the run's figures
    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        st = self.stats
        total = self._end - self._first  # training time: first batch to last step
        done = _message(DONE, st.steps, st.idle_s, total)
        self._wait([dist.isend(done, r, tag=ASK) for r in self._servers()])
        if self.rank != 0:
            self._farewell()
            return
        n = self.workers
        hist, idle, lost, gap, updates, per_worker = Counter(), {}, set(), 0, 0, {}
        for s in range(self.ps.servers):
            src = self.ps.server_rank(s)
            buf = torch.empty(HIST_BINS + 4 * n + 2, dtype=torch.float64)
            got = dist.irecv(buf, src, tag=REPLY)
            self._wait([dist.isend(_message(STATS), src, tag=ASK), got])
            rest = buf[HIST_BINS:].tolist()
            gap = max(gap, int(rest[-2]))
            lost |= {w for w in range(n) if rest[3 * n + w]}
            if s == 0:  # every server sees every gradient: count each once, as server 0 saw it
                hist.update({k: int(v) for k, v in enumerate(buf[:HIST_BINS].tolist()) if v})
                updates = int(rest[-1])
                per_worker = {str(w): int(rest[2 * n + w]) for w in range(n)}
                for w in range(n):
                    if rest[n + w] > 0 and not rest[3 * n + w]:
                        idle[w] = rest[w] / rest[n + w]
        self.summary = {
            "staleness_histogram": {str(k): v for k, v in sorted(hist.items())},
            "idle_fraction": {str(w): round(f, 4) for w, f in sorted(idle.items())},
            "lost_workers": sorted(lost),
            "max_clock_gap": gap,
            "updates": updates,
            "samples": sum(per_worker.values()),
            "samples_per_worker": per_worker,
        }

    @property
    def updates(self) -> int:
        """Optimizer steps the servers took (rank 0, after `finish`): one per synchronous step,
        one per gradient in the asynchronous modes."""
        return self.summary.get("updates", self.stats.steps)

    @property
    def samples(self) -> int:
        """Samples all workers trained on (rank 0, after `finish`; its own before)."""
        return self.summary.get("samples", self.stats.samples)

    def report(self) -> dict[str, Any]:
        """The run's figures: rank 0's hold the servers' view of every worker."""
        steps = max(self.stats.steps, 1)
        return {
            "mode": self.ps.mode,
            "workers": self.ps.workers,
            "servers": self.ps.servers,
            "staleness": self.ps.staleness if self.ps.mode == "ssp" else None,
            "bytes_per_step": self.stats.comm_bytes / steps,
            "messages_per_step": {  # this worker's, per step: one per server each way
                "push": self.stats.push_messages / steps,
                "pull": self.stats.pull_messages / steps,
            },
            "straggler": list(self.ps.straggler) if self.ps.straggler else None,
            "straggle_seconds": round(self.stats.straggle_s, 3),
            **self.summary,
        }

    def close(self) -> None:
        """Rank 0: let the servers go (after `finish`)."""
        if self.rank == 0:
            self._farewell()
            self._wait([dist.isend(_message(BYE), r, tag=ASK) for r in self._servers()])

    def _servers(self) -> range:
        return range(self.ps.workers, self.ps.workers + self.ps.servers)

    def _farewell(self) -> None:
        """Asynchronous modes: end the servers' watch on this worker (it leaves, not dies)."""
        if self._watch is None:
            return
        one = torch.zeros(1)
        self._wait([dist.isend(one, r, group=self._watch) for r in self._servers()])


# ---- the server side ------------------------------------------------------------------------


@dataclass
class _Server:
    ps: PSConfig
    index: int
    param: nn.Parameter
    optimizer: torch.optim.Optimizer
    wire: torch.dtype
    ahead: dict[int, float]  # worker -> the batch it works on next (inf: it has no more)
    version: int = 0  # updates applied to this shard
    sent: dict[int, int] = field(default_factory=dict)  # worker -> version it last pulled
    done: dict[int, tuple[float, float]] = field(default_factory=dict)  # idle s, training s
    samples: Counter = field(default_factory=Counter)  # worker -> samples of applied gradients
    lost: set[int] = field(default_factory=set)
    hist: Counter = field(default_factory=Counter)
    max_gap: int = 0
    # step -> worker -> (gradient, lr, samples)
    sync_group: dict[int, dict[int, tuple[torch.Tensor, float, float]]] = field(
        default_factory=dict
    )
    waiting: list[int] = field(default_factory=list)  # workers held back (bounded delay)
    stats_asked: bool = False
    finished: bool = False  # rank 0 said goodbye
    fatal: BaseException | None = None  # a watchdog's error, for the server loop to raise
    lock: threading.Lock = field(default_factory=threading.Lock)  # the watchdogs vs the loop
    direct: Any = None  # the optimizer's update as one functional call, or None (`_direct_step`)

    def live(self) -> list[int]:
        return [w for w in range(self.ps.workers) if w not in self.lost and w not in self.done]

    def clock(self, batch: float) -> float:
        """A batch's clock: one clock is one round of N batches (one synchronous step's data)."""
        return batch // self.ps.workers if math.isfinite(batch) else math.inf

    def apply(self, grad: torch.Tensor, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.direct is None or not self.direct(grad):
            self.param.grad = grad
            self.optimizer.step()
            self.param.grad = None  # not the receive buffer's owner for the rest of the run
        self.version += 1

    def reply(self, workers: Sequence[int]) -> None:
        """Send `workers` the shard's weights, all at once (one message each)."""
        if not workers:
            return
        weights = self.param.detach().to(self.wire)
        works = []
        for w in workers:
            self.sent[w] = self.version
            works.append((w, dist.isend(weights, w, tag=REPLY)))
        for w, work in works:
            try:
                work.wait()
            except RuntimeError as e:  # it died after its push: its receive will say so too
                self.lose(w, launch.gloo_line(e))

    def lose(self, w: int, why: str) -> None:
        _lose(self, w, why)
        for group in self.sync_group.values():
            group.pop(w, None)

    def handle(self, w: int, head: list[float], payload: torch.Tensor) -> bool:
        """Take one message of worker `w`; True when it is rank 0's goodbye."""
        kind = int(head[0])
        if kind == PUSH:
            clock, lr, nxt, synchronous, n = int(head[1]), *head[2:]
            grad = payload.view(self.wire).float()  # a fresh buffer per message: no copy
            if synchronous:
                self.sync_group.setdefault(clock, {})[w] = (grad, lr, n)
            else:
                self.hist[min(self.version - self.sent.get(w, 0), HIST_BINS - 1)] += 1
                self.apply(grad, lr)
                self.samples[w] += int(n)
                self.ahead[w] = nxt if nxt >= 0 else math.inf
                self.waiting.append(w)
        elif kind == STATE:
            _send_state(self, w)
        elif kind == DONE:
            self.done[w] = (head[2], head[3])
        elif kind == STATS:
            self.stats_asked = True
        elif kind == BYE:
            return True
        return False

    def progress(self) -> None:
        """Whatever the last message (or loss) allows: complete synchronous steps, let held
        workers go, answer rank 0's request for the figures."""
        # A synchronous step completes once every live worker has pushed it.
        for clock in sorted(self.sync_group):
            group = self.sync_group[clock]
            if group and set(group) >= set(self.live()):
                grads = [g for g, _, _ in group.values()]
                self.hist[0] += len(grads)
                mean = grads[0] if len(grads) == 1 else torch.stack(grads).mean(0)
                self.apply(mean, next(iter(group.values()))[1])
                for x, (_, _, n) in group.items():
                    self.samples[x] += int(n)
                self.reply([x for x in sorted(group) if x not in self.lost])
                del self.sync_group[clock]
        # Bounded delay: a worker gets its weights back, and so starts its next batch, once
        # that batch is at most `bound` clocks ahead of the oldest batch still being computed
        # (Li et al.'s bounded delay; 0 is bulk-synchronous, inf is Downpour). The slowest
        # worker is always within the bound, so someone can always go on.
        if self.waiting:
            going = [x for x in self.live() if math.isfinite(self.ahead[x])]
            slowest = min((self.clock(self.ahead[x]) for x in going), default=math.inf)
            still, go = [], []
            for x in self.waiting:
                if x in self.lost:
                    continue
                gap = self.clock(self.ahead[x]) - slowest
                if not math.isfinite(self.ahead[x]) or gap <= self.ps.bound:
                    if math.isfinite(gap):
                        self.max_gap = max(self.max_gap, int(gap))
                    go.append(x)
                else:
                    still.append(x)
            self.waiting = still
            self.reply(go)
        if self.stats_asked and not self.live():
            _send_stats(self)
            self.stats_asked = False


def serve(
    ps: PSConfig,
    rank: int,
    model: nn.Module,
    make_optimizer,
    compression: str,
    deal: Deal,
    resume: dict[str, Any] | None = None,
) -> None:
    """Run server `rank - workers` until rank 0 says goodbye: hold its shard of `model`'s
    weights and of the optimizer's state, apply pushed gradients as `ps.mode` says."""
    index = rank - ps.workers
    watch = _watch_group() if ps.mode != "sync" else None  # first: every rank creates it
    params = _params(model)
    bounds = shard_bounds(sum(p.numel() for p in params), ps.servers)
    param = nn.Parameter(shard(flatten(params), bounds)[index].clone())
    optimizer = make_optimizer([param])
    if resume is not None and resume.get("optimizer", {}).get("state"):
        _load_slots(optimizer, param, resume["optimizer"], params, bounds, index)
    ahead = dict.fromkeys(range(ps.workers), float(deal.first))
    srv = _Server(ps, index, param, optimizer, WIRE[compression], ahead)
    srv.direct = _direct_step(optimizer, param)
    nbytes = HEAD_BYTES + param.numel() * torch.empty(0, dtype=srv.wire).element_size()
    inbox = _InOrder(srv, nbytes) if watch is None else _FirstCome(srv, nbytes, watch)
    while True:
        w, head, payload = inbox.next()
        with srv.lock:
            if srv.fatal is not None:
                raise srv.fatal
            if head is None:  # worker w's connection failed: it died, or stopped answering
                srv.lose(w, payload)
            elif srv.handle(w, head, payload):
                srv.finished = True
                break
            srv.progress()
        inbox.after(w, head)
    inbox.close()


def _direct_step(optimizer: torch.optim.Optimizer, param: nn.Parameter):
    """The update `optimizer.step()` makes on the server's one tensor, as one call of torch's
    functional form (`torch.optim.sgd.sgd`, `torch.optim.adam.adam`) with the optimizer's own
    hyperparameters and state: the same kernels and arguments, so the same bits, without
    step()'s per-call Python (profiler scope, hook chains, the group scan). On 2 cores that
    Python cost 60-90 us of a 0.5 ms round trip, on every update.

    Returns `fn(grad) -> bool`: False when the state is not made yet (the first step, or
    SGD's first with momentum), a hook is registered or the group is differentiable or
    capturable (checked on every call), so the caller steps the usual way. None for any other
    optimizer or more than this one tensor: always step()."""
    groups = optimizer.param_groups
    kind = type(optimizer)
    if (
        kind not in (torch.optim.SGD, torch.optim.Adam)
        or len(groups) != 1
        or len(groups[0]["params"]) != 1
        or groups[0]["params"][0] is not param
    ):
        return None
    # torch >= 2.7 passes AdamW's flag to the shared functional; older ones have no such
    # argument (and no such group key): pass exactly what this version's step() passes.
    decoupled = "decoupled_weight_decay" in inspect.signature(adam_update).parameters

    def needs_step() -> bool:  # hooks step() would call, or settings only step() honours
        group = optimizer.param_groups[0]
        return bool(
            group.get("differentiable")
            or group.get("capturable")
            or optimizer._optimizer_step_pre_hooks
            or optimizer._optimizer_step_post_hooks
            or torch_optimizer._global_optimizer_pre_hooks
            or torch_optimizer._global_optimizer_post_hooks
        )

    def scaled() -> dict[str, Any]:  # AMP's scaler sets these on the optimizer
        return {
            "grad_scale": getattr(optimizer, "grad_scale", None),
            "found_inf": getattr(optimizer, "found_inf", None),
        }

    # The group and the state are looked up on every call: load_state_dict replaces both.
    def sgd(grad: torch.Tensor) -> bool:
        group, state = optimizer.param_groups[0], optimizer.state
        buf = state[param].get("momentum_buffer") if param in state else None
        if grad.is_sparse or (group["momentum"] != 0 and buf is None) or needs_step():
            return False
        with torch.no_grad():
            sgd_update(
                [param],
                [grad],
                [buf],
                weight_decay=group["weight_decay"],
                momentum=group["momentum"],
                lr=group["lr"],
                dampening=group["dampening"],
                nesterov=group["nesterov"],
                maximize=group["maximize"],
                has_sparse_grad=False,
                foreach=group["foreach"],
                fused=group["fused"],
                **scaled(),
            )
        return True  # a momentum buffer is updated in place: the state holds it already

    def adam(grad: torch.Tensor) -> bool:
        group, st = optimizer.param_groups[0], optimizer.state.get(param)
        if not st or "step" not in st or grad.is_sparse or needs_step():
            return False
        beta1, beta2 = group["betas"]
        flag = {"decoupled_weight_decay": group["decoupled_weight_decay"]} if decoupled else {}
        with torch.no_grad():
            adam_update(
                [param],
                [grad],
                [st["exp_avg"]],
                [st["exp_avg_sq"]],
                [st["max_exp_avg_sq"]] if group["amsgrad"] else [],
                [st["step"]],
                amsgrad=group["amsgrad"],
                has_complex=torch.is_complex(param),
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
                foreach=group["foreach"],
                capturable=group["capturable"],
                differentiable=group["differentiable"],
                fused=group["fused"],
                **flag,
                **scaled(),
            )
        return True

    return sgd if kind is torch.optim.SGD else adam


class _InOrder:
    """sync: one receive posted per worker at all times; the server waits on the worker whose
    push the oldest open step still lacks (every live worker pushes every step, so waiting in
    order costs nothing), and a dead worker's receive fails at once."""

    def __init__(self, srv: _Server, nbytes: int):
        self.srv, self.nbytes = srv, nbytes
        self.posted = {w: self._post(w) for w in range(srv.ps.workers)}

    def _post(self, w: int) -> tuple[Any, torch.Tensor]:
        buf = torch.empty(self.nbytes, dtype=torch.uint8)
        return dist.irecv(buf, w, tag=ASK), buf

    def next(self) -> tuple[int, list[float] | None, Any]:
        srv = self.srv
        group = srv.sync_group[min(srv.sync_group)] if srv.sync_group else {}
        # Nobody left training: rank 0 asks for the figures and the state, and says goodbye.
        w = next((x for x in srv.live() if x not in group), 0)
        work, buf = self.posted.pop(w)
        try:
            work.wait()
        except RuntimeError as e:
            return w, None, launch.gloo_line(e)
        return w, _fields(buf), buf[HEAD_BYTES:]

    def after(self, w: int, head: list[float] | None) -> None:
        """Post worker `w`'s next receive once its message is dealt with (in sync it sends
        the next one only after its reply, so nothing waits for this), unless it was its
        last: a worker leaves after DONE, rank 0 after BYE (it asks for the figures after
        DONE)."""
        kind = int(head[0]) if head is not None else BYE
        if not (kind == BYE or (kind == DONE and w != 0)):
            self.posted[w] = self._post(w)

    def close(self) -> None:
        pass


class _FirstCome:
    """async, SSP: whoever pushes first is served first, from one receive posted for any
    source. A receive from any source would wait for ever on a dead peer: a watchdog per
    worker waits on the watch group for that worker's farewell, and leaves the worker behind
    (or, when the run cannot go on without it, hands the loop the error) once it dies."""

    def __init__(self, srv: _Server, nbytes: int, watch: Any):
        self.srv, self.nbytes = srv, nbytes
        self.posted = self._post()
        self.checked = time.monotonic()
        self.dogs = [
            threading.Thread(target=_watchdog, args=(srv, w, watch), daemon=True)
            for w in range(srv.ps.workers)
        ]
        for dog in self.dogs:
            dog.start()

    def _post(self) -> tuple[Any, torch.Tensor]:
        buf = torch.empty(self.nbytes, dtype=torch.uint8)
        return dist.irecv(buf, None, tag=ASK), buf

    def next(self) -> tuple[int, list[float] | None, Any]:
        srv, me = self.srv, f"server {self.srv.index}"
        while True:
            known = len(srv.lost)
            work, buf = self.posted
            try:
                work.wait()
            except RuntimeError as e:
                # A worker that died while its message was on the wire fails the receive
                # too: its watchdog says so within moments, and the rest carry on.
                deadline = time.monotonic() + 2 * launch.HEARTBEAT_S
                while time.monotonic() < deadline and srv.fatal is None and len(srv.lost) == known:
                    time.sleep(0.02)
                if srv.fatal is None and len(srv.lost) > known:
                    self.posted = self._post()
                    continue
                silence = launch.silent_peer()
                if silence is not None:
                    raise _hung(silence, me) from None
                raise srv.fatal or StageError(
                    f"{me} heard from no worker: {launch.gloo_line(e)}"
                ) from None
            w = work._source_rank()
            head = _fields(buf)
            if int(head[0]) != BYE:  # rank 0's goodbye is the last message of the run
                self.posted = self._post()
            self._check_silence()
            return w, head, buf[HEAD_BYTES:]

    def after(self, w: int, head: list[float] | None) -> None:
        pass  # the next receive is posted before the message is dealt with

    def _check_silence(self) -> None:
        """Once a second: a live worker that stopped answering would hold its batch for ever
        (an ordered receive from it would time out; the any-source one never does)."""
        now = time.monotonic()
        if now - self.checked < 1.0:
            return
        self.checked = now
        for w in self.srv.live():
            silence = launch.silent_peer(w)
            if silence is not None:
                raise _hung(silence, f"server {self.srv.index}")

    def close(self) -> None:
        """Wait (a little) for the last farewells, so no receive is left posted at exit."""
        deadline = time.monotonic() + FAREWELL_WAIT_S
        for dog in self.dogs:
            dog.join(max(0.0, deadline - time.monotonic()))


def _watchdog(srv: _Server, w: int, watch: Any) -> None:
    """Wait for worker `w`'s farewell; when it dies instead, act on its loss."""
    try:
        dist.recv(torch.zeros(1), w, group=watch)
        return  # it finished and left
    except RuntimeError as e:
        why = launch.gloo_line(e)
    with srv.lock:
        if srv.finished or w in srv.lost:
            return
        try:
            srv.lose(w, why)
            srv.progress()  # held workers may go on without it; the figures may be due
        except BaseException as e:  # the server loop raises it
            srv.fatal = e


def _hung(silence: launch.Silence, me: str) -> StageError:
    return StageError(f"{launch.describe(silence)}; {me} gave up waiting for it")


def _lose(srv: _Server, w: int, why: str) -> None:
    """Worker `w`'s connection failed (`why`): leave it behind (async, SSP) or raise."""
    ps, me = srv.ps, f"server {srv.index}"
    silence = launch.silent_peer(w)  # it stopped answering: it would hold its batch for ever
    needed = w == 0 or ps.mode == "sync"
    if silence is None and needed:  # another rank's silence may have cut this one off
        silence = launch.silent_peer()
    if silence is not None:
        raise _hung(silence, me)
    if needed:
        raise StageError(
            f"{me} lost {ps.name(w)} ({why}); "
            + ("rank 0 reports the run" if w == 0 else "synchronous training needs all")
        )
    srv.lost.add(w)


def _send_state(srv: _Server, w: int) -> None:
    """One message: header (optimizer step, slots present), weights, every slot (zeros for
    one not yet made), as `PSWorker.take_master` expects."""
    st = srv.optimizer.state.get(srv.param, {})
    slots = _slots(srv.optimizer)
    names = [n for n in slots if st.get(n) is not None]
    step = float(st["step"]) if "step" in st else float(srv.version)
    size = srv.param.numel()
    msg = torch.zeros(HEAD_BYTES + 4 * size * (1 + len(slots)), dtype=torch.uint8)
    msg[:HEAD_BYTES].view(torch.float64).copy_(_header(STATE, step, len(names)))
    values = msg[HEAD_BYTES:].view(torch.float32).view(1 + len(slots), size)
    values[0].copy_(srv.param.detach())
    for k, name in enumerate(names):
        values[1 + k].copy_(st[name].detach().reshape(-1).float())
    dist.send(msg, w, tag=REPLY)


def _slots(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    return SLOTS["adam" if isinstance(optimizer, torch.optim.Adam) else "sgd"]


def _send_stats(srv: _Server) -> None:
    """Histogram, then per worker: idle seconds, training seconds, samples of its applied
    gradients, lost; max gap, updates."""
    n = srv.ps.workers
    buf = torch.zeros(HIST_BINS + 4 * n + 2, dtype=torch.float64)
    for k, v in srv.hist.items():
        buf[k] = v
    for w, (idle, total) in srv.done.items():
        buf[HIST_BINS + w], buf[HIST_BINS + n + w] = idle, total
    for w, samples in srv.samples.items():
        buf[HIST_BINS + 2 * n + w] = samples
    for w in srv.lost:
        buf[HIST_BINS + 3 * n + w] = 1
    buf[-2], buf[-1] = srv.max_gap, srv.version
    dist.send(buf, 0, tag=REPLY)


def _load_slots(optimizer, param, saved, params, bounds, index) -> None:
    """Take shard `index` of a one-process optimizer state (any strategy wrote it)."""
    state = saved["state"]
    names = _slots(optimizer)
    if len(state) != len(params) or not all(n in state[i] for i in state for n in names):
        return  # nothing to take (e.g. SGD without momentum): a fresh state is the same
    st = optimizer.state[param]
    for name in names:
        full = flatten([state[i][name] for i in range(len(params))])
        st[name] = shard(full, bounds)[index].clone()
    if "step" in state[0]:
        st["step"] = torch.tensor(float(state[0]["step"]))
