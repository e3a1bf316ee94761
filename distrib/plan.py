"""A communication planner after the alpha-beta model: predicted step time, speed-up and
efficiency of data-parallel and pipeline training for N = 1..64 workers, and the N past which
another worker no longer pays.

The cost model
--------------
Link (Hockney, "The communication challenge for MPP", Parallel Computing 1994): sending one
message of n bytes takes ``alpha + n / beta`` seconds, alpha the latency and beta the bandwidth
(bytes/s). Each strategy's link is measured on the primitive it uses, between two local ranks
that compute between round trips as training does (see `measure_links` why that matters):
point-to-point send/recv for the parameter server and the pipeline's activations, gloo's own
all-reduce for the ring. On this project's 2-core machine an all-reduce after compute took
1.5-4x a pair of broadcasts of the same bytes (256 kB: 1.63 against 0.42 ms), so one link fitted
to broadcasts had put LeNet-300-100's all-reduce step at a third of what training measured.

Compute: forward and backward of b samples on one worker take ``fixed_s + sample_s * b`` (the
per-step constant is Python and kernel-launch overhead, large for small models on CPUs: a
planner that scales only per-sample time overestimates the speed-up); the optimizer step over
the whole model takes ``update_s``. `measure_compute` fits the three on this process.

Every strategy trains one GLOBAL batch of B samples per step (strong scaling): with N workers a
worker computes B/N samples (fluid: fractional per-worker batches are allowed; N > B is not
applicable). Communication is not overlapped with compute (DDP overlaps buckets with the
backward pass on GPUs; on CPU gloo the same cores do both), so the predictions are upper
bounds where overlap works well. The baseline of every speed-up is one worker without any
communication: ``T1 = fixed_s + sample_s * B + update_s``; speed-up = T1 / T(N),
efficiency = speed-up / N (N counts workers; a parameter server's S servers are extra
machines).

Strategies (M = model bytes, fp32 gradients and weights):
  * all-reduce, ring (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters
    of workstations", JPDC 2009; Thakur, Rabenseifner & Gropp, "Optimization of collective
    communication operations in MPICH", IJHPCA 2005): reduce-scatter then all-gather, 2(N-1)
    steps of M/N bytes each:
        T = fixed + sample * B/N + update + 2(N-1) alpha + 2(N-1)/N * M/beta
  * parameter server, S shards, synchronous (Li et al., "Scaling distributed machine learning
    with the parameter server", OSDI 2014): every worker pushes its M-byte gradient (M/S to
    each server) and pulls M bytes of weights back. An endpoint handles its messages one after
    another: a worker sends S messages of M/S bytes, a server receives N of them, so one
    direction takes
        max(S alpha + M/beta,  N alpha + N*M/(S*beta))
    which with alpha = 0 is the bound t >= max(M/B, N*M/(S*B)) (KNOW-HOW.md,
    "torch.distributed"). Push, the servers' optimizer step over their shard, then pull:
        T = fixed + sample * B/N + 2 max(S alpha + M/beta, N alpha + N*M/(S*beta)) + update/S
    S defaults to ceil(N/2), as `compress train` does; the bandwidth term then meets ring
    all-reduce's 2(N-1)/N * M/beta.
  * pipeline, K stages, m micro-batches (GPipe: Huang et al., NeurIPS 2019): the N workers
    form D = N/K replicas of a K-stage pipeline (K = N when no stage count is given: a pure
    pipeline). A replica trains B/D samples as m micro-batches of b = B/(D m); the schedule
    takes m + K - 1 slots (bubble fraction (K-1)/(m+K-1)), and a slot is one stage's
    forward+backward of a micro-batch plus, when K > 1, one activation and one activation-
    gradient transfer of A*b bytes (A = activation bytes per sample at a stage boundary):
        slot = (fixed + sample * b)/K + [K > 1] * 2 (alpha + A*b/beta)
        T = (m + K - 1) * slot + update/K + ring(D replicas, M/K bytes)
    Stages are taken as perfectly balanced (the ideal partition); K cannot exceed the model's
    layers with weights, and b must be at least one sample.

Saturation: over every N in 1..max_workers, the saturation point is the fewest workers whose
predicted step time is within `eps` (1%) of the best step time on the curve: past it, all the
further workers together gain less than 1%. On a curve that falls and then rises (compute
shrinks as 1/N, latency grows with N) the speed-up rises up to that point; two exceptions,
both tested: S = ceil(N/2) zigzags (an odd N leaves its servers a spare share), and a
one-stage pipeline crosses no boundary, so N = 1 may beat N = 2. `still_gaining` says the
curve, run on to 4x max_workers, saturates past max_workers (more workers would still gain
over 1%);
`limited`, that it is the last N the strategy applies to (N > B, or more stages than layers).
"""

from __future__ import annotations

import functools
import math
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from compresskit._threads import usable_cores
from compresskit.models.errors import InputError

STRATEGIES = ("allreduce", "ps", "pipeline")
LABELS = {"allreduce": "all-reduce (ring)", "ps": "parameter server", "pipeline": "pipeline"}
EPS = 0.01  # saturation: within 1% of the best predicted step time

# ---- units ----------------------------------------------------------------------------------

_PREFIX = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"
_BANDWIDTH = re.compile(_NUMBER + r"(Ki|Mi|Gi|Ti|k|K|M|G|T)?(B|b|bit)(?:/s|ps)\s*")
_SIZE = re.compile(_NUMBER + r"(Ki|Mi|Gi|Ti|k|K|M|G|T)?(B)?\s*")
_TIME = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
_DURATION = re.compile(_NUMBER + r"(ns|us|µs|ms|s)\s*")


def _positive(value: float, text: str, flag: str, what: str) -> float:
    if not (value > 0 and math.isfinite(value)):
        raise InputError(
            f"{flag} {text!r}: the {what} must be positive and finite; e.g. {_EXAMPLE[flag]}"
        )
    return value


_EXAMPLE = {
    "--bandwidth": "--bandwidth 10GB/s",
    "--latency": "--latency 20us",
    "--compute": "--compute 12ms",
    "--model-bytes": "--model-bytes 100MB",
    "--activation-bytes": "--activation-bytes 64kB",
}


def parse_bandwidth(text: str, flag: str = "--bandwidth") -> float:
    """Bytes per second from "10GB/s", "1.5GiB/s", "100Gb/s" (bits: lower-case b or "bit"),
    "400Mbps". Decimal prefixes k/K, M, G, T are powers of 1000; Ki, Mi, Gi, Ti of 1024.
    A bare number is refused: bits or bytes must be said."""
    m = _BANDWIDTH.fullmatch(str(text))
    if m is None:
        raise InputError(
            f"{flag} {text!r}: not a bandwidth; write a number and a unit, e.g. 10GB/s, "
            "1.25GiB/s or 100Gb/s (b: bits, B: bytes)"
        )
    number, prefix, unit = m.groups()
    scale = _BINARY.get(prefix or "") or _PREFIX[prefix or ""]
    value = float(number) * scale / (8 if unit in ("b", "bit") else 1)
    return _positive(value, text, flag, "bandwidth")


def parse_duration(text: str, flag: str = "--latency") -> float:
    """Seconds from "20us" (also µs), "1.5ms", "300ns", "2s". A bare number is refused."""
    m = _DURATION.fullmatch(str(text))
    if m is None:
        raise InputError(
            f"{flag} {text!r}: not a time; write a number and a unit (ns, us, ms, s), "
            f"e.g. {_EXAMPLE.get(flag, flag + ' 20us')}"
        )
    return _positive(float(m.group(1)) * _TIME[m.group(2)], text, flag, "time")


def parse_size(text: str, flag: str = "--model-bytes") -> float:
    """Bytes from "18.7MB", "64KiB", "1e6" (a bare number is bytes)."""
    m = _SIZE.fullmatch(str(text))
    if m is None:
        raise InputError(
            f"{flag} {text!r}: not a size; write bytes with an optional unit, e.g. 100MB, "
            "64KiB or 1e6"
        )
    number, prefix, _ = m.groups()
    value = float(number) * (_BINARY.get(prefix or "") or _PREFIX[prefix or ""])
    return _positive(value, text, flag, "size")


# ---- the model ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """alpha_s: seconds per message (latency); beta_bytes_per_s: bandwidth."""

    alpha_s: float
    beta_bytes_per_s: float

    def __post_init__(self) -> None:
        if not (self.alpha_s >= 0 and math.isfinite(self.alpha_s)):
            raise InputError(f"--latency {self.alpha_s!r} s: give 0 or more, e.g. --latency 20us")
        if not (self.beta_bytes_per_s > 0 and math.isfinite(self.beta_bytes_per_s)):
            raise InputError(
                f"--bandwidth {self.beta_bytes_per_s!r} B/s: give a positive bandwidth, "
                "e.g. --bandwidth 10GB/s"
            )

    def send_s(self, nbytes: float) -> float:
        """One message of `nbytes`: alpha + n/beta."""
        return self.alpha_s + nbytes / self.beta_bytes_per_s


@dataclass(frozen=True)
class Workload:
    """One training step of a global batch of `batch` samples.

    model_bytes: M, gradient (and weight) bytes on the wire per worker and step.
    sample_s, fixed_s: forward+backward of b samples on one worker take fixed_s + sample_s*b.
    update_s: the optimizer step over the whole model on one worker.
    activation_bytes: bytes per sample at a pipeline stage boundary (0: free transfers).
    layers: modules with weights (a pipeline has at most this many stages); None: no limit.
    """

    model_bytes: float
    batch: int
    sample_s: float
    fixed_s: float = 0.0
    update_s: float = 0.0
    activation_bytes: float = 0.0
    layers: int | None = None

    def __post_init__(self) -> None:
        for name in ("model_bytes", "sample_s", "fixed_s", "update_s", "activation_bytes"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise InputError(f"workload {name} {v!r}: give a finite number, 0 or more")
        if self.batch < 1:
            raise InputError(f"--batch-size {self.batch}: give 1 or more")

    def compute_s(self, samples: float) -> float:
        """Forward and backward of `samples` samples on one worker."""
        return self.fixed_s + self.sample_s * samples

    @property
    def single_s(self) -> float:
        """T1: one worker, the whole batch, no communication (every speed-up's baseline)."""
        return self.compute_s(self.batch) + self.update_s


@dataclass(frozen=True)
class Step:
    """A predicted step: compute (the pipeline's includes its bubble), communication and the
    optimizer update on the critical path."""

    workers: int
    compute_s: float
    comm_s: float
    update_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.update_s


def ring_allreduce_s(link: Link, n: int, nbytes: float) -> float:
    """Ring all-reduce of `nbytes` over n ranks: 2(n-1) alpha + 2(n-1)/n * nbytes/beta
    (Patarasuk & Yuan 2009; Thakur et al. 2005); 0 for one rank."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * link.alpha_s + 2 * (n - 1) / n * nbytes / link.beta_bytes_per_s


def ps_comm_s(link: Link, n: int, servers: int, nbytes: float) -> float:
    """Push then pull through S server shards, each direction the busier endpoint's
    max(S alpha + M/beta, N alpha + N*M/(S*beta)): with alpha = 0 the bound
    t >= max(M/B, N*M/(S*B)) (Li et al. OSDI 2014; KNOW-HOW.md)."""
    a, b = link.alpha_s, link.beta_bytes_per_s
    return 2 * max(servers * a + nbytes / b, n * a + n * nbytes / (servers * b))


def allreduce_step(w: Workload, link: Link, n: int) -> Step | None:
    """Data parallel with ring all-reduce; None when n > B (less than a sample each)."""
    if n > w.batch:
        return None
    return Step(n, w.compute_s(w.batch / n), ring_allreduce_s(link, n, w.model_bytes), w.update_s)


def default_servers(n: int) -> int:
    """S = ceil(N/2), `compress train`'s default."""
    return -(-n // 2)


def ps_step(w: Workload, link: Link, n: int, servers: int | None = None) -> Step | None:
    """Synchronous parameter server with `servers` shards (None: ceil(N/2)); None when n > B."""
    if n > w.batch:
        return None
    s = servers or default_servers(n)
    comm = ps_comm_s(link, n, s, w.model_bytes)
    return Step(n, w.compute_s(w.batch / n), comm, w.update_s / s)


def pipeline_step(
    w: Workload,
    link: Link,
    n: int,
    stages: int | None = None,
    microbatches: int = 8,
    ring: Link | None = None,
) -> Step | None:
    """GPipe with K = `stages` (None: K = n) stages and m micro-batches, n/K replicas kept in
    step by ring all-reduce of each stage's M/K bytes (over `ring`, None: `link`; activations
    go over `link`). None where it does not apply: n not a multiple of K, K beyond the model's
    layers, or micro-batches of less than a sample."""
    k = stages or n
    if n % k or (w.layers is not None and k > w.layers):
        return None
    replicas, m = n // k, microbatches
    b = w.batch / (replicas * m)
    if b < 1:
        return None
    transfer = 2 * link.send_s(w.activation_bytes * b) if k > 1 else 0.0
    slots = m + k - 1
    compute = slots * w.compute_s(b) / k
    comm = slots * transfer + ring_allreduce_s(ring or link, replicas, w.model_bytes / k)
    return Step(n, compute, comm, w.update_s / k)


def step(
    strategy: str,
    w: Workload,
    link: Link,
    n: int,
    *,
    servers: int | None = None,
    stages: int | None = None,
    microbatches: int = 8,
    ring: Link | None = None,
) -> Step | None:
    """One strategy's predicted step at N = n. `link`: point-to-point messages (the parameter
    server, pipeline activations); `ring`: all-reduce (None: `link`)."""
    if strategy == "allreduce":
        return allreduce_step(w, ring or link, n)
    if strategy == "ps":
        return ps_step(w, link, n, servers)
    if strategy == "pipeline":
        return pipeline_step(w, link, n, stages, microbatches, ring)
    raise ValueError(f"strategy {strategy!r}: one of {STRATEGIES}")


def saturation(times: Sequence[tuple[int, float]], eps: float = EPS) -> int | None:
    """The saturation point of a curve of (N, step seconds), ascending N: the fewest workers
    whose step time is within `eps` of the curve's best (past it, every further worker
    together gains less than `eps`). None for an empty curve."""
    if not times:
        return None
    best = min(t for _, t in times)
    return next(n for n, t in times if t <= (1 + eps) * best)


@dataclass(frozen=True)
class Curve:
    strategy: str
    steps: tuple[Step | None, ...]  # N = 1..max_workers
    single_s: float

    def speedup(self, n: int) -> float | None:
        s = self.steps[n - 1]
        return None if s is None else self.single_s / s.total_s

    @property
    def saturation(self) -> int | None:
        return saturation([(s.workers, s.total_s) for s in self.steps if s is not None])

    @property
    def last(self) -> int | None:
        """The largest N the strategy applies to (None: none)."""
        return max((s.workers for s in self.steps if s is not None), default=None)


@dataclass(frozen=True)
class Plan:
    workload: Workload
    link: Link
    max_workers: int
    servers: int | None
    stages: int | None
    microbatches: int
    curves: dict[str, Curve]
    measured: dict[str, Any] = field(default_factory=dict)  # how each input was obtained
    ring: Link | None = None  # all-reduce's link where it is not `link`
    # per strategy: whether workers past max_workers (up to GAINING_SPAN times it) would still
    # gain the saturation margin (`plan`)
    gaining: dict[str, bool] = field(default_factory=dict)

    @property
    def allreduce_link(self) -> Link:
        return self.ring or self.link

    def rows(self, workers: Sequence[int]) -> list[dict[str, Any]]:
        """Per N in `workers`, per strategy: step ms, its parts, speed-up, efficiency."""
        out = []
        for n in workers:
            row: dict[str, Any] = {"workers": n}
            for name, curve in self.curves.items():
                s = curve.steps[n - 1]
                if s is None:
                    row[name] = None
                    continue
                sp = curve.single_s / s.total_s
                row[name] = {
                    "step_ms": 1e3 * s.total_s,
                    "compute_ms": 1e3 * s.compute_s,
                    "comm_ms": 1e3 * s.comm_s,
                    "update_ms": 1e3 * s.update_s,
                    "speedup": sp,
                    "efficiency": sp / n,
                }
            out.append(row)
        return out

    def table_workers(self) -> list[int]:
        """N = 1, 2, 4, ... up to max_workers (and max_workers itself)."""
        ns = [2**i for i in range(self.max_workers.bit_length()) if 2**i <= self.max_workers]
        return ns if ns[-1] == self.max_workers else [*ns, self.max_workers]

    def saturation(self) -> dict[str, dict[str, Any] | None]:
        """Per strategy: the saturation N, its step ms, speed-up and efficiency; `last`: the
        largest N it applies to; `still_gaining`: workers past --max-workers would still gain
        the margin (the saturation point of the curve run on lies past the plan's: the one
        within it is not the curve's); `limited`: it is the last N the strategy applies to,
        below --max-workers."""
        out: dict[str, dict[str, Any] | None] = {}
        for name, curve in self.curves.items():
            n = curve.saturation
            if n is None:
                out[name] = None
                continue
            s = curve.steps[n - 1]
            last = curve.last
            out[name] = {
                "workers": n,
                "step_ms": 1e3 * s.total_s,
                "speedup": curve.single_s / s.total_s,
                "efficiency": curve.single_s / s.total_s / n,
                "last": last,
                "still_gaining": self.gaining.get(name, False),
                "limited": n == last and last < self.max_workers and n > 1,
            }
        return out

    def to_dict(self) -> dict[str, Any]:
        """Everything, JSON-ready: inputs, how each was obtained, the saturation points, the
        rows of N = 1, 2, 4, ... and every strategy's whole curve (N = 1..max_workers)."""
        return {
            "workload": asdict(self.workload),
            "link": asdict(self.link),
            "allreduce_link": asdict(self.allreduce_link),
            "single_worker_ms": 1e3 * self.workload.single_s,
            "servers": self.servers,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "max_workers": self.max_workers,
            "saturation_eps": EPS,
            "measured": self.measured,
            "saturation": self.saturation(),
            "rows": self.rows(self.table_workers()),
            "curves": {
                name: {
                    "step_ms": [None if s is None else 1e3 * s.total_s for s in curve.steps],
                    "speedup": [curve.speedup(n) for n in range(1, self.max_workers + 1)],
                }
                for name, curve in self.curves.items()
            },
        }


def plan(
    w: Workload,
    link: Link,
    max_workers: int = 64,
    *,
    servers: int | None = None,
    stages: int | None = None,
    microbatches: int = 8,
    measured: dict[str, Any] | None = None,
    ring: Link | None = None,
) -> Plan:
    """Every strategy's predicted step for N = 1..max_workers. `link`: point-to-point
    messages; `ring`: the all-reduce's link (None: `link`)."""
    for flag, v in (
        ("--max-workers", max_workers),
        ("--servers", servers),
        ("--stages", stages),
        ("--microbatches", microbatches),
    ):
        if v is not None and v < 1:
            raise InputError(f"{flag} {v}: give 1 or more")
    if max_workers > MAX_WORKERS:  # the curves hold every N, and run on past it
        raise InputError(f"--max-workers {max_workers}: give at most {MAX_WORKERS:,}")
    kw = {"servers": servers, "stages": stages, "microbatches": microbatches, "ring": ring}
    curves = {
        name: Curve(
            name,
            tuple(step(name, w, link, n, **kw) for n in range(1, max_workers + 1)),
            w.single_s,
        )
        for name in STRATEGIES
    }
    # Whether more workers would still pay: the curve run on past the plan. Within N <= 64 the
    # ring's N = 59 was within 1% of N = 64, but its minimum lay near N = 136, 5% faster.
    gaining = {}
    for name, curve in curves.items():
        past = (
            step(name, w, link, n, **kw)
            for n in range(max_workers + 1, GAINING_SPAN * max_workers + 1)
        )
        run_on = [(s.workers, s.total_s) for s in (*curve.steps, *past) if s is not None]
        n = saturation(run_on)
        gaining[name] = n is not None and n > max_workers
    return Plan(
        w,
        link,
        max_workers,
        servers,
        stages,
        microbatches,
        curves,
        dict(measured or {}),
        ring,
        gaining,
    )


MAX_WORKERS = 65536  # the largest --max-workers planned
GAINING_SPAN = 4  # how far past --max-workers `plan` looks for a later saturation point


# ---- measuring ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkFit:
    link: Link
    points: tuple[tuple[float, float], ...]  # (bytes per message, mean one-way seconds)


def fit_link(points: Sequence[tuple[float, float]]) -> Link:
    """alpha and beta from (bytes, one-way seconds) by least squares on t = alpha + n/beta,
    each point weighted by 1/t (relative errors: the small messages fix alpha, the large ones
    beta). A negative intercept (noise) is clipped to 0."""
    import numpy as np

    if len(points) < 2:
        raise ValueError("fit_link needs two message sizes or more")
    n = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    a = np.stack([1 / t, n / t], axis=1)
    (alpha, inv_beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if inv_beta <= 0:  # flat or falling with size: take the largest message's rate
        inv_beta = t[-1] / n[-1]
    return Link(max(float(alpha), 0.0), 1.0 / float(inv_beta))


SIZES = (1 << 10, 1 << 16, 1 << 20, 1 << 23)  # 1 KiB .. 8 MiB
# "p2p": send/recv, the parameter server's and the pipeline's path; "allreduce": gloo's own
# all-reduce, the ring strategy's (DDP's).
TRANSPORTS = ("p2p", "allreduce")


def _pingpong(
    sizes: Sequence[int],
    budget_s: float,
    transports: Sequence[str],
    gap_s: float,
    rank: int,
    world: int,
) -> dict[str, list[tuple[float, float]]]:
    """Rank 0 and 1 exchange a message of each size over each transport; rank 0 returns, per
    transport, (bytes per message, mean one-way s) as `fit_link` takes them. An all-reduce
    of n bytes over two ranks is, as the ring formula counts it, two steps of one message of
    n/2 bytes each way: 2 alpha + n/beta, so (n/2, half its time) fits the same alpha and beta.

    A warm-up of a tenth of a second first (the peer may still be starting), then three passes
    over sizes and transports, interleaved, so a burst of load elsewhere hits every point
    alike. Before each timed exchange both ranks compute for `gap_s` (untimed), as training
    computes between its messages.

    The mean, not the median: a training run's step rate pays every exchange's time, tails
    included. On this project's 2-core machine a 200 kB all-reduce after 0.4 ms of compute
    had a median of 0.7-1.1 ms and a mean of 1.5-1.8 ms (a tenth of them took over 3.8 ms)."""
    import torch
    import torch.distributed as dist

    work = torch.ones(64, 64)

    def gap() -> None:
        t = time.perf_counter()
        while time.perf_counter() - t < gap_s:
            work @ work

    bounces = {"p2p": bounce_p2p, "allreduce": _bounce_allreduce}
    tensors = [torch.zeros(max(1, n // 4)) for n in sizes]
    times = {tr: [[] for _ in sizes] for tr in transports}
    start = time.perf_counter()
    go = torch.tensor([1])
    while go[0]:
        for tr in transports:
            bounces[tr](dist, tensors[0], rank)
        if rank == 0:
            go[0] = int(time.perf_counter() - start < 0.1)
        dist.broadcast(go, 0)
    for _ in range(3):
        for i, x in enumerate(tensors):
            for tr in transports:
                bounce, seen = bounces[tr], times[tr][i]
                # Rank 0 decides how many exchanges fit its share of the budget; rank 1 follows.
                t0 = time.perf_counter()
                bounce(dist, x, rank)
                took = time.perf_counter() - t0 + gap_s
                rounds = torch.tensor([int(min(100, max(3, budget_s / 3 / took)))])
                dist.broadcast(rounds, 0)
                for _ in range(int(rounds[0])):
                    gap()
                    t0 = time.perf_counter()
                    bounce(dist, x, rank)
                    seen.append(time.perf_counter() - t0)
    if rank != 0:
        return {}
    out = {}
    for tr in transports:
        per_message = [x.numel() * 4 / (2 if tr == "allreduce" else 1) for x in tensors]
        out[tr] = [
            (n, statistics.fmean(t) / 2) for n, t in zip(per_message, times[tr], strict=True)
        ]
    return out


def bounce_p2p(dist, x, rank: int) -> None:
    """One ping-pong of `x` between ranks 0 and 1 (send/recv), as `benchmarks/strategies.py`
    times it too."""
    if rank == 0:
        dist.send(x, 1)
        dist.recv(x, 1)
    else:
        dist.recv(x, 0)
        dist.send(x, 0)


def _bounce_allreduce(dist, x, rank: int) -> None:
    dist.all_reduce(x)  # of zeros: the values stay what they are


def measure_links(
    transports: Sequence[str] = ("p2p", "allreduce"),
    sizes: Sequence[int] = SIZES,
    budget_s: float = 0.15,
    timeout_s: float = 60.0,
    gap_s: float = 0.0,
) -> dict[str, LinkFit]:
    """alpha and beta of this machine's gloo link, per transport (see TRANSPORTS): two local
    ranks (spawned by `distrib.launch.run`, one launch for all) exchange each message size
    for about `budget_s` per transport; the mean one-way time per size is fitted by
    `fit_link`.

    Why per transport: on a loaded machine they differ. A blocking recv waits for a helper
    thread to be scheduled (measured here on 2 busy cores: p2p round trips of 0.2 ms or 4 ms,
    bimodal; broadcast ones 0.25 ms), and gloo's all-reduce after compute took 1.5-4x a pair
    of broadcasts of the same bytes on this project's 2-core machine.

    `gap_s`: both ranks compute this long (untimed) before each exchange, as training
    computes between its all-reduces. A tight ping-pong keeps gloo's threads awake; after a
    gap a message waits for them to be scheduled again, which on a machine whose cores other
    processes share costs far more than the wire: on this project's shared 2-core machine a
    200 kB all-reduce took 0.47 ms in a tight loop and 2.1 ms after 1 ms of compute."""
    from compresskit.distrib import launch

    for tr in transports:
        if tr not in TRANSPORTS:
            raise ValueError(f"transport {tr!r}: one of {TRANSPORTS}")
    fn = functools.partial(_pingpong, tuple(sizes), budget_s, tuple(transports), gap_s)
    points = launch.run(fn, 2, timeout_s)
    return {tr: LinkFit(fit_link(points[tr]), tuple(points[tr])) for tr in transports}


@dataclass(frozen=True)
class ComputeFit:
    fixed_s: float
    sample_s: float
    update_s: float
    threads: int
    points: tuple[tuple[int, float], ...]  # (batch, mean seconds of a step less update_s)


def measure_compute(
    model,
    x,
    y,
    batches: Sequence[int],
    *,
    threads: int | None = None,
    optimizer: str = "adam",
    budget_s: float = 0.5,
) -> ComputeFit:
    """Time training steps on this process through `distrib.trainer.fit` itself, the loop
    `compress train` runs (a batch gathered by index, the schedule's learning rate, forward,
    cross-entropy, backward, the optimizer step, the running figures): per batch size in
    `batches`, one short epoch of about `budget_s` on (x, y), and the mean time between
    consecutive steps (a step rate pays every step, tails included). The optimizer step is
    timed inside the same epochs (update_s, through torch's global optimizer hooks);
    fixed_s + sample_s * b is fitted to the rest by least squares, so fixed_s holds the loop's
    own per-step cost.

    Why the loop and not a bare forward+backward: on LeNet-300-100 (batch 64, one thread) the
    bare pass plus Adam's step timed alone came to 0.57 ms, the loop's steps to 0.72 ms, and
    Adam's step timed alone, over and over on the same gradients, ran cache-warm (0.07 ms
    against 0.12 ms inside the loop). The model trains while it is measured. `threads`:
    torch's intra-op threads while measuring (None: as they are; a worker on its own machine
    has all of its cores); restored afterwards. One process: refused inside a process group,
    where `fit` would train data-parallel."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    from compresskit.distrib.trainer import Events, TrainConfig, fit
    from compresskit.models.data import Dataset

    if len(batches) < 1:
        raise ValueError("measure_compute needs a batch size")
    if dist.is_available() and dist.is_initialized():
        raise ValueError("measure_compute times one worker: call it outside a process group")
    n = len(y)
    empty = slice(0, 0)
    updates: list[float] = []
    started: list[float] = []

    class Clock(Events):
        def __init__(self) -> None:
            self.times: list[tuple[int, float]] = []

        def step(self, epoch: int, step: int, loss: float) -> None:
            self.times.append((epoch, time.perf_counter()))

    def run(b: int, steps: int) -> list[float]:
        """Seconds between consecutive steps of about `steps` steps at batch b: one epoch on
        the first b * steps samples, or epochs over all of them where there are fewer. An
        epoch's end is not between two steps, unless every epoch is one step."""
        k = min(n, b * steps)
        data = Dataset("plan", x[:k], y[:k], x[:1], y[:1], int(y.max()) + 1, x[empty], y[empty])
        epochs = -(-b * steps // k)
        cfg = TrainConfig(epochs=epochs, batch_size=b, optimizer=optimizer, evaluate="last")
        clock = Clock()
        fit(model, data, cfg, events=clock)
        pairs = list(zip(clock.times, clock.times[1:], strict=False))
        within = [t1 - t0 for (e0, t0), (e1, t1) in pairs if e0 == e1]
        return within or [t1 - t0 for (_, t0), (_, t1) in pairs]

    pre = register_optimizer_step_pre_hook(lambda *_: started.append(time.perf_counter()))
    post = register_optimizer_step_post_hook(
        lambda *_: updates.append(time.perf_counter() - started[-1])
    )
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    used = torch.get_num_threads()
    try:
        points, timed = [], []
        for b in batches:
            warm = run(b, 6)  # a warm-up, and how long a step takes
            steps = int(min(2000, max(10, budget_s / max(statistics.fmean(warm), 1e-6))))
            del updates[:]
            points.append((int(b), statistics.fmean(run(b, steps))))
            timed += updates
        update = statistics.fmean(timed)
    finally:
        pre.remove()
        post.remove()
        torch.set_num_threads(before)
    points = [(b, max(t - update, 0.0)) for b, t in points]
    bs = np.array([p[0] for p in points], dtype=float)
    ts = np.array([p[1] for p in points], dtype=float)
    if len(set(bs)) < 2:
        fixed, per = 0.0, float(ts[0] / bs[0])
    else:
        per, fixed = np.polyfit(bs, ts, 1)
        if fixed < 0 or per < 0:  # noise: a line through the origin and the largest batch
            fixed, per = 0.0, float(ts[-1] / bs[-1])
    return ComputeFit(float(fixed), float(per), float(update), used, tuple(points))


def activation_profile(model, x) -> tuple[float, int]:
    """(mean output bytes per sample of the model's leaf modules with weights, their count)
    from one forward pass on `x` (one sample or more): a stage boundary lands after one of
    them, on average after a typical one."""
    import torch

    sizes: list[float] = []
    hooks = []

    def hook(module, inputs, output) -> None:
        if isinstance(output, torch.Tensor):
            sizes.append(output.numel() * 4 / max(1, len(x)))  # fp32 on the wire

    for m in model.modules():
        if not list(m.children()) and any(True for _ in m.parameters(recurse=False)):
            hooks.append(m.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model.eval()
            model(x)
    finally:
        for h in hooks:
            h.remove()
        model.train()
    return (statistics.mean(sizes) if sizes else 0.0), len(hooks)


# ---- the planner as one call ----------------------------------------------------------------


@dataclass(frozen=True)
class PlanRequest:
    """What `compress plan` asks. Sizes, rates and times are numbers (bytes, bytes/s, s) or
    text with units ("10GB/s", "20us", "18MB"); None: measured on this machine. `compute`,
    when given, is forward+backward+update of the whole global batch on one worker."""

    model: str = "lenet300"
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    data: str = "digits"
    batch: int = 256
    bandwidth: float | str | None = None
    latency: float | str | None = None
    compute: float | str | None = None
    model_bytes: float | str | None = None
    activation_bytes: float | str | None = None
    servers: int | None = None
    stages: int | None = None
    microbatches: int = 8
    max_workers: int = 64
    threads: int = 0  # torch threads of one worker while measuring its compute (0: all)
    optimizer: str = "adam"
    # Compute between the ping-pong's round trips (s); None: a worker's compute at N = 2,
    # at most LINK_GAP_MAX_S (see `measure_links`); 0: a tight ping-pong.
    link_gap: float | None = None
    # An earlier `compress plan --json`'s output: take its links instead of measuring.
    links_from: str | None = None


LINK_GAP_MAX_S = 0.01


def _value(v: float | str | None, parse: Callable[[str, str], float], flag: str) -> float | None:
    if v is None or isinstance(v, str):
        return None if v is None else parse(v, flag)
    return _positive(float(v), str(v), flag, "value")


def fit_batches(batch: int, max_workers: int) -> list[int]:
    """Batch sizes to time compute at: the global batch down to what one of max_workers
    workers computes, so the fit covers every per-worker batch of the plan."""
    return sorted({max(1, batch // d) for d in (1, 4, 16, max_workers)})


def make_plan(req: PlanRequest) -> Plan:
    """Measure what `req` does not give (model bytes and activations from the built model,
    compute by `measure_compute`, the links by `measure_links`), then `plan` every strategy."""
    for flag, v in (("--max-workers", req.max_workers), ("--microbatches", req.microbatches)):
        if v < 1:
            raise InputError(f"{flag} {v}: give 1 or more")
    for flag, v in (("--servers", req.servers), ("--stages", req.stages)):
        if v is not None and v < 1:
            raise InputError(f"{flag} {v}: give 1 or more")
    if req.batch < 1:
        raise InputError(f"--batch-size {req.batch}: give 1 or more")
    if req.threads < 0:
        raise InputError(f"--threads {req.threads}: give 0 (all cores) or more")
    if req.threads > (cores := usable_cores()):  # timed the scheduler: 19.1 ms for 3.4 ms
        raise InputError(
            f"--threads {req.threads}: this machine gives compress {cores} core(s); give "
            f"{cores} or fewer (0 = all of them)"
        )
    bandwidth = _value(req.bandwidth, parse_bandwidth, "--bandwidth")
    latency = _value(req.latency, parse_duration, "--latency")
    compute = _value(req.compute, parse_duration, "--compute")
    model_bytes = _value(req.model_bytes, parse_size, "--model-bytes")
    activation = _value(req.activation_bytes, parse_size, "--activation-bytes")
    measured: dict[str, Any] = {}

    model = ds = None
    layers = None
    if model_bytes is None or compute is None or activation is None:
        # named only when built: with every figure given, the plot and --json named the
        # default --model (lenet300) that nothing measured
        measured |= {"model": req.model, "data": req.data}
        model, ds = build(req)
        measured["parameters"] = sum(p.numel() for p in model.parameters())
    if model_bytes is None:
        model_bytes = 4.0 * sum(p.numel() for p in model.parameters() if p.requires_grad)
        measured["model_bytes"] = "fp32 gradients of the model's trainable parameters"
    else:
        measured["model_bytes"] = "given"
    if activation is None:
        activation, layers = activation_profile(model, ds.x_train[:1])
        measured["activation_bytes"] = (
            f"mean output of the model's {layers} leaf modules with weights, one sample, fp32"
        )
    else:
        measured["activation_bytes"] = "given"
    if compute is None:
        fit = measure_compute(
            model,
            ds.x_train,
            ds.y_train,
            fit_batches(req.batch, req.max_workers),
            threads=req.threads or None,
            optimizer=req.optimizer,
        )
        fixed, per, update = fit.fixed_s, fit.sample_s, fit.update_s
        measured["compute"] = {
            "how": f"forward+backward timed here on {fit.threads} thread(s), "
            f"fitted fixed + per-sample; {req.optimizer} step timed alone",
            "threads": fit.threads,
            "points_ms": {str(b): 1e3 * t for b, t in fit.points},
        }
    else:
        fixed, per, update = 0.0, compute / req.batch, 0.0
        measured["compute"] = {"how": "given (--compute), all of it split across workers"}
    ring = None
    if req.links_from is not None and (bandwidth is not None or latency is not None):
        raise InputError("--links-from with --bandwidth or --latency: give one or the other")
    if req.links_from is not None:
        link, ring, measured["link"] = links_from(req.links_from)
    elif bandwidth is None or latency is None:
        gap = req.link_gap
        if gap is None:
            gap = min(LINK_GAP_MAX_S, fixed + per * req.batch / 2)
        fits = measure_links(("p2p", "allreduce"), gap_s=gap)
        given = [f for f, v in (("bandwidth", bandwidth), ("latency", latency)) if v]
        p2p, ar = (
            Link(
                latency if latency is not None else fits[tr].link.alpha_s,
                bandwidth if bandwidth is not None else fits[tr].link.beta_bytes_per_s,
            )
            for tr in ("p2p", "allreduce")
        )
        measured["link"] = {
            "how": "gloo send/recv (parameter server, pipeline) and all-reduce (ring) between "
            f"2 local ranks, {1e3 * gap:.3g} ms of compute before each exchange, "
            "least-squares alpha + n/beta",
            "gap_s": gap,
            "fitted": asdict(fits["p2p"].link),
            "points_us": {f"{n:.0f}": 1e6 * t for n, t in fits["p2p"].points},
            "allreduce_fitted": asdict(fits["allreduce"].link),
            "allreduce_points_us": {f"{n:.0f}": 1e6 * t for n, t in fits["allreduce"].points},
            "given": given,
        }
        link, ring = p2p, ar
    else:
        link = Link(latency, bandwidth)
        measured["link"] = {"how": "given (--bandwidth, --latency)"}
    workload = Workload(
        model_bytes=model_bytes,
        batch=req.batch,
        sample_s=per,
        fixed_s=fixed,
        update_s=update,
        activation_bytes=activation,
        layers=layers,
    )
    return plan(
        workload,
        link,
        req.max_workers,
        servers=req.servers,
        stages=req.stages,
        microbatches=req.microbatches,
        measured=measured,
        ring=ring,
    )


def links_from(path: str) -> tuple[Link, Link, dict[str, Any]]:
    """The point-to-point and all-reduce links of an earlier `compress plan --json` (its
    "link" and "allreduce_link"), and the "measured" entry that says so."""
    import json
    from pathlib import Path

    from compresskit.models.zoo import huge_number

    where = f"--links-from {path}"
    fix = "give the output of compress plan --json"
    try:
        doc = json.loads(Path(path).read_bytes())
        link = Link(**doc["link"])
        ring = Link(**doc.get("allreduce_link", doc["link"]))
        how = {"how": f"from {path}", "from": doc.get("measured", {}).get("link", {})}
    except OSError as e:
        raise InputError(f"{where}: {e.strerror or e}; {fix}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{where}: not JSON ({e}); {fix}") from None
    except RecursionError:  # json recurses once per level of nesting
        raise InputError(f"{where}: nested too deeply to read; {fix}") from None
    except ValueError as e:  # an integer past Python's 4,300-digit conversion limit
        raise InputError(f"{where}: {huge_number(e)}; {fix}") from None
    except (KeyError, TypeError, AttributeError) as e:
        raise InputError(f"{where}: no link in it ({type(e).__name__}: {e}); {fix}") from None
    except InputError as e:
        raise InputError(f"{where}: {e}") from None
    return link, ring, how


def build(req: PlanRequest):
    """The zoo (or user) model built for the data, as `compress train` builds it."""
    from compresskit.models import data, zoo

    cls = zoo.resolve(req.model)
    data.check_one_input(cls, req.model)
    ds = data.load(req.data, data.forward_input(cls))
    data.check_kind(req.model, ds)
    spec = zoo.resolve_spec(req.model, req.model_kwargs, ds.in_shape, ds.num_classes)
    model = zoo.build(spec, seed=0)
    data.check_fits(model, ds, req.model)
    return model, ds
