"""Latency measurement: the same method for every runtime, so numbers compare side by side.

Each variant becomes a runner: a zero-argument call that runs one inference and returns its own
duration in seconds (wall clock on CPU; CUDA events after synchronisation on GPU, with inputs
already on the device). After warm-up, the runners of one grid cell run interleaved
(A B C A B C ...) until both `min_seconds` and `min_runs` are reached, so drift of the machine
(frequency, other load) hits all alike. `shrink`'s latency-aware precision choice and
`compress demo` use the same loop through `p50_ms`.

`measure` is `compress bench`: the (threads x batch) grid over the variants of
`compressor.measure.variants`, each cell summarised by `compressor.stats` (p50/p90/p99, bootstrap CI
of p50, throughput), with session cold-start time, MACs and achieved GFLOP/s against the
CPU's measured matmul peak, and accuracy / top-1 agreement with the first model on a data set.
Timed inputs are random: float32 in [0, 1) for image models, int64 token ids in [1, vocab) for
token models (`models.data.random_inputs`; the data's vocabulary when --data is given, else the
model's embedding rows, else all ids 1).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from compresskit._threads import usable_cores
from compresskit.models.errors import InputError, one_line


def resolve_threads(n: int) -> int:
    """0 means every core this process may run on (its CPU affinity); the same number then
    goes to PyTorch, ONNX Runtime and the peak probes, and into the results."""
    return n or usable_cores()


def whole(v: Any) -> bool:
    """An integer, not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run PyTorch on `n` intra-op threads inside the block (restored after); 0: all cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(resolve_threads(n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def torch_runner(model: nn.Module, x: torch.Tensor) -> Callable[[], object]:
    """One eager FP32 forward pass of `model` on `x`, without autograd."""
    model = model.eval()

    def call():
        with torch.inference_mode():
            return model(x)

    return call


def onnx_runner(path: Path, x: np.ndarray, threads: int = 1) -> Callable[[], object]:
    """One `session.run` of the ONNX (or .ort) file on ORT's CPU provider."""
    session = _session(path, ["CPUExecutionProvider"], threads)
    feed = {session.get_inputs()[0].name: x}
    return lambda: session.run(None, feed)


def _session(path: Path, providers: list[str], threads: int):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = resolve_threads(threads)
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 4  # errors come back as exceptions, not log lines
    if resolve_threads(threads) > 1:
        # Idle ORT workers spin after each run by default, stealing cores from the next
        # variant of an interleaved cell.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if providers[0] != "CPUExecutionProvider":
        # A GPU row must run on the GPU: no silent per-node fallback to the CPU.
        opts.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    # enable_fallback=0: when a GPU provider cannot take the graph, ONNX Runtime's Python class
    # otherwise prints a banner on stdout (inside our --json) and retries on the CPU EP, in
    # session creation and again in run(). We want the first error: it becomes the row's skip
    # reason. (Every ORT since 1.18, our floor, reads the key from its **kwargs.)
    return ort.InferenceSession(str(path), opts, providers=providers, enable_fallback=0)


def _timed(call: Callable[[], object]) -> Callable[[], float]:
    def run() -> float:
        t0 = time.perf_counter()
        call()
        return time.perf_counter() - t0

    return run


def interleaved_timed(
    runners: list[Callable[[], float]],
    min_seconds: float = 0.6,
    min_runs: int = 30,
    warmup: int = 10,
) -> list[np.ndarray]:
    """Seconds per call of each runner (each returns its own duration), interleaved after
    `warmup` calls each, until `min_seconds` of wall time and `min_runs` runs each."""
    for run in runners:
        for _ in range(warmup):
            run()
    times: list[list[float]] = [[] for _ in runners]
    end = time.perf_counter() + min_seconds
    while time.perf_counter() < end or len(times[0]) < min_runs:
        for t, run in zip(times, runners, strict=True):
            t.append(run())
    return [np.asarray(t) for t in times]


def interleaved(
    calls: list[Callable[[], object]], seconds: float = 0.6, min_runs: int = 30, warmup: int = 10
) -> list[np.ndarray]:
    """`interleaved_timed` for plain calls, timed by wall clock."""
    return interleaved_timed([_timed(c) for c in calls], seconds, min_runs, warmup)


def p50_ms(calls: list[Callable[[], object]], seconds: float = 0.6) -> list[float]:
    """Median latency (ms) of each call, measured interleaved."""
    return [1000 * float(np.median(t)) for t in interleaved(calls, seconds)]


# --- compress bench -------------------------------------------------------------------------


class Skip(Exception):
    """A variant that cannot run here (e.g. CUDA fell back to CPU); the message says why."""


def absent_runtimes() -> dict[str, str]:
    """The GPU runtimes this machine lacks, by provider name ("pytorch-cuda",
    "CUDAExecutionProvider", "TensorrtExecutionProvider"), each with what is missing, in a few
    words. `compressor.measure.variants.variants` skips them without trying; a provider ONNX Runtime
    lists but cannot start (no GPU) is not absent here: it is tried, and skipped with ORT's
    reason."""
    import onnxruntime as ort

    out: dict[str, str] = {}
    if not torch.cuda.is_available():
        cpu_build = torch.version.cuda is None
        out["pytorch-cuda"] = "a CPU-only torch build" if cpu_build else "no CUDA device"
    available = set(ort.get_available_providers())
    for provider in ("CUDAExecutionProvider", "TensorrtExecutionProvider"):
        if provider not in available:
            out[provider] = "pip install onnxruntime-gpu"
    return out


@dataclass
class Prepared:
    run: Callable[[], float]  # one timed inference at the cell's batch
    predict: Callable[[np.ndarray], np.ndarray]  # logits for any batch
    cold_start_ms: float  # load + first inference


def prepare(variant, batch: int, threads: int, x: np.ndarray) -> Prepared:
    """A runner for `variant` at `batch` (input `x`) and `threads` (0 = all cores)."""
    if variant.runtime == "torch":
        return _prepare_torch(variant, x)
    return _prepare_ort(variant, threads, x)


def _prepare_torch(variant, x: np.ndarray) -> Prepared:
    from compresskit.models import checkpoint

    t0 = time.perf_counter()
    net = checkpoint.load(variant.model.path, train_state=False).build_model(
        variant.model.spec,
        allow_import=True,  # already allowed when the model was described
    )
    device = variant.device
    if device == "cuda":  # FP32 means FP32: no TF32 tensor-core math in the "fp32" rows
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    net = net.to(device).eval()
    xt = torch.from_numpy(x).to(device)
    autocast = (
        torch.autocast(device, dtype=torch.bfloat16)
        if variant.precision == "bf16"
        else contextlib.nullcontext()
    )

    def forward(inp: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode(), autocast:
            return net(inp)

    forward(xt)
    if device == "cuda":
        torch.cuda.synchronize()
    cold = 1000 * (time.perf_counter() - t0)
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def run() -> float:
            start.record()
            forward(xt)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000

    else:
        run = _timed(lambda: forward(xt))

    def predict(a: np.ndarray) -> np.ndarray:
        chunks = []
        for i in range(0, len(a), 256):
            out = forward(torch.from_numpy(a[i : i + 256]).to(device))
            if isinstance(out, dict):  # a Hugging Face ModelOutput too
                named = [(str(k), v) for k, v in out.items()]
            elif isinstance(out, tuple | list):
                named = [(f"output {j}", v) for j, v in enumerate(out)]
            else:
                named = [("output", out)]
            out = named[scored_output([n for n, _ in named], variant.model.path)][1]
            if not isinstance(out, torch.Tensor):
                raise InputError(
                    f"{variant.model.path}: its forward returns {type(out).__name__}, not "
                    "logits; compress bench scores a tensor of shape (batch, classes)"
                )
            chunks.append(out.float().cpu().numpy())
        return np.concatenate(chunks)

    return Prepared(run, predict, cold)


def _prepare_ort(variant, threads: int, x: np.ndarray) -> Prepared:
    from compresskit.compressor.measure.variants import PROVIDERS

    provider = PROVIDERS[variant.runtime]
    providers = {
        "CPUExecutionProvider": ["CPUExecutionProvider"],
        # No CPU EP on GPU rows: with CPU fallback disabled, ORT refuses a listed CPU EP.
        "CUDAExecutionProvider": ["CUDAExecutionProvider"],
        "TensorrtExecutionProvider": ["TensorrtExecutionProvider", "CUDAExecutionProvider"],
    }[provider]
    t0 = time.perf_counter()
    try:
        session = _session(variant.model.path, providers, threads)
    except Exception as e:
        first = one_line(e)
        if provider == "CPUExecutionProvider":
            raise InputError(
                f"{variant.model.path}: ONNX Runtime cannot run it ({first})"
            ) from None
        raise Skip(f"{provider} cannot run it: {first}") from None
    got = session.get_providers()[0]
    if got != provider:  # a failed CUDA/TensorRT load falls back to CPU without an error
        raise Skip(f"{provider} failed to load and ONNX Runtime fell back to {got}")
    name = session.get_inputs()[0].name
    try:
        session.run(None, {name: x})
    except Exception as e:  # a GPU provider failing at run time: that row is a skip
        if provider == "CPUExecutionProvider":
            raise _cannot_run(variant, x, e) from None
        raise Skip(f"{provider} failed running it: {one_line(e, 160)}") from None
    cold = 1000 * (time.perf_counter() - t0)
    if provider == "CPUExecutionProvider":
        feed = {name: x}
        run = _timed(lambda: session.run(None, feed))
    else:  # inputs and outputs bound on the device, so the copy is not timed
        import onnxruntime as ort

        binding = session.io_binding()
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0))
        binding.bind_output(session.get_outputs()[0].name, "cuda")

        def call() -> None:
            session.run_with_iobinding(binding)
            binding.synchronize_outputs()

        run = _timed(call)

    step = variant.model.fixed_batch or 256
    outputs = [o.name for o in session.get_outputs()]

    def predict(a: np.ndarray) -> np.ndarray:
        scored = [outputs[scored_output(outputs, variant.model.path)]]
        out = []
        for i in range(0, len(a), step):
            chunk = a[i : i + step]
            if len(chunk) < step and variant.model.fixed_batch:  # pad to the file's batch
                pad = np.zeros((step - len(chunk), *chunk.shape[1:]), chunk.dtype)
                chunk = np.concatenate([chunk, pad])
            try:
                out.append(session.run(scored, {name: chunk})[0][: len(a[i : i + step])])
            except Exception as e:  # the data's values (token ids past the vocabulary)
                if provider == "CPUExecutionProvider":
                    raise _cannot_run(variant, chunk, e) from None
                raise Skip(f"{provider} failed running it: {one_line(e, 160)}") from None
        return np.concatenate(out)

    return Prepared(run, predict, cold)


def _cannot_run(variant, x: np.ndarray, e: Exception) -> InputError:
    """ONNX Runtime's CPU provider failing on our inputs: the file and the data disagree (a
    Reshape to another size, token ids past an .ort file's vocabulary), which the checks
    before could not see. One line, exit 2, where it was an 'unexpected' traceback."""
    text = one_line(e)
    memory = any(w in text.lower() for w in ("alloc", "memory"))
    fix = "give a smaller --batch" if memory else "give --data the file was made for"
    return InputError(
        f"{variant.model.path}: ONNX Runtime cannot run it on inputs of shape {list(x.shape)} "
        f"({text}); {fix}"
    )


def scored_output(names: list[str], path) -> int:
    """Which of a model's outputs accuracy is scored on: its only one, or the one named
    "logits". Taking the first of several scored an auxiliary output (9.7% for a model
    whose logits, its second output, score 95.8%)."""
    if len(names) == 1:
        return 0
    for i, n in enumerate(names):
        if n.lower() == "logits":
            return i
    onnx = str(path).endswith((".onnx", ".ort"))
    how = "export with output_names naming it" if onnx else "return a dict with that key"
    raise InputError(
        f"{path}: {len(names)} outputs ({', '.join(names)}) and none named 'logits'; "
        "compress bench scores a model's only output or the one named logits: "
        f"{how}{_alone(path)}"
    )


def _alone(path) -> str:
    """How to time a file whose outputs cannot be scored: an ONNX file runs without data (a
    checkpoint needs data for its input shape)."""
    return (
        ", or bench without --data to time it alone"
        if str(path).endswith((".onnx", ".ort"))
        else ""
    )


def scored_logits(logits: np.ndarray, path, data) -> np.ndarray:
    """`logits` as (batch, classes), trailing 1-sized dimensions dropped ((N, 10, 1, 1) from
    a 1x1-conv head); refused when that is not a classifier's output for `data`'s labels
    (a regression's (N, 1) scored the share of class 0; an (N,) output failed in argmax)."""
    a = np.asarray(logits)
    while a.ndim > 2 and a.shape[-1] == 1:
        a = a.reshape(a.shape[:-1])
    if a.ndim == 2 and 2 <= a.shape[1] < data.num_classes:  # a classifier of fewer classes
        raise InputError(
            f"{path}: answers {a.shape[1]} classes but --data {data.spec!r} has "
            f"{data.num_classes} (labels 0..{data.num_classes - 1}); give the data it was "
            f"trained on{_alone(path)}"
        )
    if a.ndim != 2 or a.shape[1] < max(2, data.num_classes):
        shape = ("batch", *a.shape[1:])
        raise InputError(
            f"{path}: its output has shape {shape}, not (batch, classes) for the "
            f"{data.num_classes} classes of --data {data.spec!r}; compress bench scores "
            f"classifiers{_alone(path)}"
        )
    return a


MAX_RUNS = 10_000_000
MAX_SECONDS = 3600.0


@dataclass(frozen=True)
class BenchConfig:
    batches: tuple[int, ...] = (1,)
    threads: tuple[int, ...] = (1,)
    min_runs: int = 50
    min_seconds: float = 1.0
    warmup: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        for name, ok in (
            ("min_runs", whole(self.min_runs)),
            (
                "min_seconds",
                isinstance(self.min_seconds, numbers.Real)
                and not isinstance(self.min_seconds, bool),
            ),
        ):
            if not ok:
                value = getattr(self, name)
                raise InputError(f"{name} {value!r}: give a number, e.g. {name}=5")
        # each size once, in the order given: --batch 1,1 measured two rows of one cell
        object.__setattr__(self, "batches", tuple(dict.fromkeys(self.batches)))
        # by the count each runs on: 0 is every core, so --threads 2,0 on 2 cores is one count
        seen: dict[int, int] = {}
        for t in self.threads:
            seen.setdefault(resolve_threads(t) if whole(t) and t >= 0 else t, t)
        object.__setattr__(self, "threads", tuple(seen.values()))
        if not self.batches or any(b < 1 for b in self.batches):
            raise InputError(
                f"--batch {','.join(map(str, self.batches))}: give sizes >= 1, e.g. 1,64"
            )
        if not self.threads or any(t < 0 for t in self.threads):
            raise InputError(
                f"--threads {','.join(map(str, self.threads))}: give counts >= 0 (0 = all cores)"
            )
        cores = usable_cores()
        if any(t > cores for t in self.threads):
            # more threads than cores time the scheduler, not the model: 100 threads on 2
            # cores read 3,470% of the machine's peak
            raise InputError(
                f"--threads {','.join(map(str, self.threads))}: this machine gives compress "
                f"{cores} core(s); give {cores} or fewer (0 = all of them)"
            )
        # Bounded: --min-seconds inf (or nan) timed forever, and so did --min-runs 1e11.
        if not 1 <= self.min_runs <= MAX_RUNS or not 0 <= self.min_seconds <= MAX_SECONDS:
            raise InputError(
                f"--min-runs {self.min_runs} / --min-seconds {self.min_seconds}: give runs "
                f"from 1 to {MAX_RUNS:,} and seconds from 0 to {MAX_SECONDS:g} per cell"
            )


def measure(
    variants: list,
    cfg: BenchConfig,
    data=None,
    progress: Callable[[str], None] = lambda message: None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """Run the grid. Returns (results, skipped, extra): `extra` holds the peak probes and which
    variant the agreement and speed-up columns are measured against."""
    from compresskit.compressor import stats
    from compresskit.compressor.measure import contention, envinfo

    results: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    peaks: dict[int, dict[str, float]] = {}
    rng = np.random.default_rng(cfg.seed)
    for v in variants:  # every input shape and batch checked before any work
        _check_batch_memory(v, _shape(v, data), max(cfg.batches))
        _check_kind(v, data)
        fixed = v.model.fixed_batch
        # shrink's own fixed-batch file (NNAPI's) in a folder: timed at its batch, the other
        # batches skipped with the reason; a file given alone is refused as before
        shrink_made = v.model.path.name.endswith(FIXED_SUFFIX)
        if fixed and any(b != fixed for b in cfg.batches) and not shrink_made:
            raise InputError(
                f"{v.model.path}: exported with a fixed batch of {fixed}; pass --batch {fixed} "
                "or re-export it with a dynamic batch axis"
            )
    accuracy, reference = (
        _accuracy(variants, data, skipped, progress) if data is not None else ({}, None)
    )
    gone = {s["variant"] for s in skipped}
    live = [v for v in variants if v.name not in gone]
    speed_reference = live[0].name if live else None
    for requested in cfg.threads:
        threads = resolve_threads(requested)
        peaks[threads] = {
            "fp32_gflops": envinfo.matmul_peak_gflops(seconds=0.3, threads=threads),
            "int8_gops": envinfo.int8_peak_gops(seconds=0.3, threads=threads),
        }
        with torch_threads(threads):
            for batch in cfg.batches:
                progress(f"batch {batch}, threads {threads}: {len(live)} variants")
                cell, ready = [], []
                for v in list(live):
                    if v.model.fixed_batch and batch != v.model.fixed_batch:
                        why = (
                            f"exported with a fixed batch of {v.model.fixed_batch}: not timed "
                            f"at batch {batch}"
                        )
                        if (skip := _skip(v, why)) not in skipped:  # once, whatever the threads
                            skipped.append(skip)
                        continue
                    x = inputs(v.model, batch, data, rng)
                    try:
                        ready.append(prepare(v, batch, threads, x))
                        cell.append(v)
                    except Skip as e:  # reported once; not retried in later cells
                        skipped.append(_skip(v, str(e)))
                        live.remove(v)
                before = contention.sample()
                times = (
                    interleaved_timed(
                        [p.run for p in ready], cfg.min_seconds, cfg.min_runs, cfg.warmup
                    )
                    if ready
                    else []
                )
                # what other processes took of the cores while this cell was timed
                other = contention.other_cores(before, contention.sample())
                first = None
                for v, p, t in zip(cell, ready, times, strict=True):
                    row = _row(v, batch, threads, stats.summarize(t, batch), p, accuracy)
                    row["threads_requested"] = requested
                    row["other_cores"] = None if other is None else round(other, 2)
                    macs = _macs(v, batch, data)
                    row["macs"] = macs
                    if v.name == speed_reference or first is None:
                        first = first or row["p50_ms"]
                    row["speedup_vs_first"] = first / row["p50_ms"]
                    row["gflops"] = row["peak_fraction"] = None  # every row has each key
                    if macs:
                        row["gflops"] = 2 * macs / (row["p50_ms"] / 1000) / 1e9
                        # INT8 against the INT8 matmul peak; FP32 (and bf16) against FP32's
                        peak = peaks[threads][
                            "int8_gops" if v.precision == "int8" else "fp32_gflops"
                        ]
                        row["peak_fraction"] = row["gflops"] / peak
                    results.append(row)
    _explain(results, data, variants)
    extra = {
        "peaks": {str(k): v for k, v in peaks.items()},
        "agreement_reference": reference,
        "speedup_reference": speed_reference,
    }
    return results, skipped, extra


FIXED_SUFFIX = ".fixed.onnx"  # shrink's fixed-batch files: MODEL.int8.fixed.onnx


def _check_batch_memory(v, shape: tuple[int, ...], batch: int) -> None:
    """A batch of inputs that cannot fit in memory, refused before anything runs:
    --batch 99999999999 ended in an 'unexpected' MemoryError for 23.3 TiB."""
    need = batch * math.prod(shape) * 8  # float32 inputs, or int64 token ids at worst
    have = available_memory()
    if have is not None and need > have // 2:
        raise InputError(
            f"--batch {batch}: one batch of {v.model.path.name}'s inputs takes "
            f"{need / 2**30:.1f} GiB, over half this machine's {have / 2**30:.1f} GiB available; "
            "give a smaller batch"
        )


def available_memory() -> int | None:
    """Bytes of memory available to start new work (Linux MemAvailable), None elsewhere."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _shape(v, data) -> tuple[int, ...]:
    shape = v.model.in_shape
    if data is not None:
        given = tuple(data.in_shape)
        if v.model.dynamic_sequence and shape is not None:
            if len(given) != 1 or given[0] > shape[0]:
                raise InputError(
                    f"{v.model.path}: takes sequences of 1 to {shape[0]} token ids, --data "
                    f"{data.spec} gives shape {given}; give sequences of at most {shape[0]}"
                )
        elif shape is not None and tuple(shape) != given and not _same_samples(shape, given):
            raise InputError(
                f"{v.model.path}: takes inputs of shape {tuple(shape)}, --data {data.spec} gives "
                f"{given}; give matching data"
            )
        return _shape_of(v.model, data)
    if shape is None:
        raise InputError(
            f"{v.model.path}: its input shape is not fixed in the file; pass --data SPEC"
        )
    return tuple(shape)


def _check_kind(v, data) -> None:
    """Data of the kind the model reads (images or token ids), with ids it can look up."""
    if data is None:
        return
    m = v.model
    if data.is_tokens != m.tokens:
        reads, gives = ("int64 token ids", "images") if m.tokens else ("images", "token ids")
        raise InputError(
            f"{m.path}: reads {reads} but --data {data.spec} gives {gives}; give matching data"
        )
    if m.tokens and m.vocab is not None and data.vocab > m.vocab:
        raise InputError(
            f"{m.path}: embeds {m.vocab} token ids, --data {data.spec} reaches id "
            f"{data.vocab - 1}; give data of its vocabulary"
        )


def inputs(m, batch: int, data, rng: np.random.Generator) -> np.ndarray:
    """Inputs for model `m` (a `variants.Model`) at `batch`: with data, its first `batch`
    test inputs (repeated when the split is smaller), since some kernels' time depends on the
    values (LeNet-5's max-pooling ran 6x faster on digits than on noise); without, random
    float32 images or int64 token ids valid for the model's vocabulary."""
    from compresskit.models.data import random_inputs

    if data is not None and len(data.x_test):
        x = data.x_test.numpy()
        return fitted(m, data, np.ascontiguousarray(x[np.arange(batch) % len(x)]))
    shape = (batch, *_shape_of(m, data))
    vocab = data.vocab if data is not None and data.is_tokens else m.vocab
    return random_inputs(shape, m.tokens, vocab, rng)


def _same_samples(want, given) -> bool:
    """Whether a file taking samples of shape `want` reads `given` ones once axes of size 1 go:
    a file exported outside compress takes (N, 1, L) signals as they are, where compress's data
    gives them as (N, 1, 1, L) (an npz's 3-D array gains a channel axis)."""
    return [d for d in want if d != 1] == [d for d in given if d != 1]


def _shape_of(m, data) -> tuple[int, ...]:
    if data is not None:
        given = tuple(data.in_shape)
        want = getattr(m, "in_shape", None)  # None: no file's shape to fit (the data's own)
        if want is not None and not m.dynamic_sequence and _same_samples(want, given):
            return tuple(want)
        return given
    if m.in_shape is None:
        raise InputError(f"{m.path}: its input shape is not fixed in the file; pass --data SPEC")
    return tuple(m.in_shape)


def fitted(m, data, x: np.ndarray) -> np.ndarray:
    """Data inputs `x` laid out as model `m` takes its samples (`_shape_of`)."""
    shape = _shape_of(m, data)
    return x if tuple(x.shape[1:]) == shape else x.reshape(len(x), *shape)


def _skip(v, reason: str) -> dict[str, Any]:
    return {
        "variant": v.name,
        "model": v.model.label,
        "provider": v.provider,
        "precision": v.precision,
        "reason": reason,
    }


def _accuracy(variants, data, skipped, progress) -> tuple[dict[int, dict[str, float]], str]:
    """Test accuracy of each variant on its own runtime, and its top-1 agreement with the first
    variant that ran (named in the result, since a skipped first one moves it)."""
    progress(
        f"accuracy on {data.spec} ({len(data.y_test)} test "
        f"{'sequences' if data.is_tokens else 'images'})"
    )
    x, y = data.x_test.numpy(), data.y_test.numpy()
    out: dict[int, dict[str, float]] = {}
    reference = reference_name = None
    for v in variants:
        batch = v.model.fixed_batch or 1
        xv = fitted(v.model, data, x)
        try:
            logits = prepare(v, batch, 0, xv[:batch]).predict(xv)
        except Skip as e:
            skipped.append(_skip(v, str(e)))
            continue
        pred = scored_logits(logits, v.model.path, data).argmax(1)
        if reference is None:
            reference, reference_name = pred, v.name
        out[id(v)] = {
            "test_accuracy": float(np.mean(pred == y)),
            "top1_agreement": float(np.mean(pred == reference)),
        }
    return out, reference_name


def _row(v, batch, threads, summary, p: Prepared, accuracy) -> dict[str, Any]:
    m = v.model
    return {
        "model": m.label,
        "path": str(m.path),
        "source": str(m.source) if m.source else None,
        "format": m.format,
        "precision": v.precision,
        "provider": v.provider,
        "batch": batch,
        "threads": threads,
        **summary,
        "cold_start_ms": p.cold_start_ms,
        "bytes": m.bytes,  # a checkpoint's weights, not its file (optimizer state too)
        "file_bytes": m.file_bytes,
        "parameters": m.parameters,
        "test_accuracy": accuracy.get(id(v), {}).get("test_accuracy"),
        "top1_agreement": accuracy.get(id(v), {}).get("top1_agreement"),
        "notes": [],
    }


def _macs(v, batch: int, data) -> int | None:
    from compresskit.compressor import flops

    m = v.model
    try:
        if m.format == "pytorch":
            # Token models: id 1, which any embedding holds (0 is padding in compress's data).
            shape = (batch, *_shape(v, data))
            x = torch.ones(shape, dtype=torch.int64) if m.tokens else torch.zeros(shape)
            net = m.state
            return flops.torch_macs(net, x)
        if m.format == "onnx":
            sample = _shape_of(m, data) if data is not None else m.in_shape
            return flops.onnx_macs(m.path, batch, sample)
    except Exception:  # counting is informative only; a model it cannot count gets none
        return None
    return None  # .ort files keep no ONNX graph to count


def _explain(results: list[dict[str, Any]], data, variants: list = ()) -> None:
    """Compare each INT8 row with the FP32 file it was made from (same provider, batch and
    threads); when INT8 is slower, say so and name the operators that dominate both (ORT's
    profiler). `variants`: the measured ones, whose models say what input each file takes
    (a file not among them is read again)."""
    from compresskit.compressor.export import clearly_faster
    from compresskit.compressor.measure import ortprofile
    from compresskit.compressor.measure import variants as variants_mod

    models = {str(v.model.path): v.model for v in variants}
    rows = {(r["path"], r["provider"], r["batch"], r["threads"]): r for r in results}
    for r in results:
        if r["precision"] != "int8" or not r.get("source"):
            continue
        fp32 = rows.get((r["source"], r["provider"], r["batch"], r["threads"]))
        if fp32 is None:
            continue
        r["vs_fp32"] = fp32["p50_ms"] / r["p50_ms"]
        if not clearly_faster(fp32["p50_ms"], r["p50_ms"]):
            continue
        note = f"INT8 {r['p50_ms'] / fp32['p50_ms']:.2f}x slower than its FP32 file"
        if r["provider"] == "CPUExecutionProvider" and r["format"] == "onnx":
            try:
                m = models.get(r["path"]) or variants_mod.load(Path(r["path"]))
                x = inputs(m, r["batch"], data, np.random.default_rng(0))
                tops = [
                    ortprofile.top_ops(ortprofile.profile_ops(Path(f), x, threads=r["threads"]))
                    for f in (r["path"], fp32["path"])
                ]
                note += f": time in INT8 {', '.join(tops[0])}; in FP32 {', '.join(tops[1])}"
            except Exception as e:  # the explanation is a bonus; the measurement stands
                note += f" (profile failed: {type(e).__name__})"
        r["notes"].append(note)
