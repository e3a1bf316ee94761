"""The only place that formats output for people: progress on stderr, tables on stdout."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from distrib.trainer import EpochRecord, Events, TrainResult

LINE_EVERY_S = 15.0  # progress lines off a terminal

# markup=False: paths and labels such as "[fp32]" are text, never rich markup.
stderr = Console(stderr=True, highlight=False, soft_wrap=True, markup=False)
# Off a terminal (pipes, CI logs) rich assumes 80 columns; tables read better wider.
stdout = Console(
    highlight=False, soft_wrap=True, markup=False, width=None if sys.stdout.isatty() else 200
)


class TrainProgress(Events):
    """A progress bar per epoch on a terminal; one line per epoch otherwise (logs, CI)."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self.live = stderr.is_terminal and not quiet
        self.progress: Progress | None = None
        self.task = None
        self.last_checkpoint: Path | None = None
        self.epoch: tuple[int, int, int, int, float] | None = None
        self.last_line = 0.0

    def checkpoint(self, path: Path, epoch: int, step: int) -> None:
        self.last_checkpoint = path

    def info(self, message: str) -> None:
        if not self.quiet:
            stderr.print(message)

    def epoch_start(self, epoch: int, epochs: int, steps: int, done: int) -> None:
        # Off a terminal (a log, CI, a pipe) a long epoch still says where it is: one line
        # every LINE_EVERY_S seconds with the step and an ETA, instead of a live bar.
        self.epoch = (epoch, epochs, steps, done, time.monotonic())
        self.last_line = time.monotonic()
        if not self.live:
            return
        self.progress = Progress(
            TextColumn(f"epoch {epoch}/{epochs}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=stderr,
            transient=True,
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=steps, completed=done, loss="-")

    def step(self, epoch: int, step: int, loss: float) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step, loss=f"{loss:.4f}")
        elif not self.quiet and self.epoch is not None:
            now = time.monotonic()
            if now - self.last_line >= LINE_EVERY_S:
                self.last_line = now
                e, epochs, steps, done, started = self.epoch
                rate = (step - done) / max(now - started, 1e-9)
                eta = (steps - step) / rate if rate > 0 else float("nan")
                stderr.print(
                    f"epoch {e}/{epochs}: step {step}/{steps}  loss {loss:.4f}  "
                    f"{now - started:.0f}s, eta {eta:.0f}s"
                )

    def epoch_end(self, record: EpochRecord) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        if not self.quiet:
            stderr.print(
                f"epoch {record.epoch:>3}  loss {record.train_loss:.4f}  "
                f"train {record.train_accuracy:6.2%}  test {record.test_accuracy:6.2%}  "
                f"{record.seconds:.1f}s"
            )

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def train_summary(result: TrainResult, out: Path) -> None:
    table = Table(title="compress train", title_justify="left")
    for col in ("epoch", "train loss", "train acc", "test loss", "test acc", "seconds"):
        table.add_column(col, justify="right")
    for r in result.history:
        table.add_row(
            str(r.epoch),
            f"{r.train_loss:.4f}",
            f"{r.train_accuracy:.2%}",
            f"{r.test_loss:.4f}",
            f"{r.test_accuracy:.2%}",
            f"{r.seconds:.2f}",
        )
    stdout.print(table)
    stdout.print(
        f"test accuracy {result.test_accuracy:.2%} after {result.epochs} epochs, "
        f"{result.seconds:.1f}s training; checkpoint: {out}"
    )
    ps = result.strategy
    if ps:
        hist = ps.get("staleness_histogram", {})
        total = sum(hist.values()) or 1
        bars = ", ".join(f"{k}: {v} ({v / total:.0%})" for k, v in hist.items())
        idle = ", ".join(f"worker {w} {f:.0%}" for w, f in ps.get("idle_fraction", {}).items())
        shares = ", ".join(f"worker {w} {n:,}" for w, n in ps.get("samples_per_worker", {}).items())
        stdout.print(
            f"parameter server ps-{ps['mode']}: {ps['workers']} workers, {ps['servers']} "
            f"servers, {result.steps / max(result.seconds, 1e-9):.1f} updates/s, "
            f"{ps['bytes_per_step'] / 1e3:.1f} kB per step per worker"
        )
        stdout.print(f"staleness (updates between pull and push): {bars}")
        stdout.print(f"idle (waiting on the servers): {idle}")
        stdout.print(f"samples trained: {shares}")
        if ps.get("lost_workers"):
            lost = ", ".join(str(w) for w in ps["lost_workers"])
            stdout.print(f"lost workers: {lost}; the others finished the run")


STAGE_LABELS = {
    "prune": "P (pruned)",
    "quantize": "P+Q (shared weights)",
    "huffman": "P+Q+H (archive)",
}


def int8_warning(report: dict) -> None:
    """Say loudly on stderr when no INT8 file was written (even under --json)."""
    miss = report.get("int8_not_written")
    if miss:
        stderr.print(
            f"warning: no INT8 file written: {miss['reason']}; "
            f"ship student.fp32.onnx (it is what an INT8 file here would compute)",
            style="bold yellow",
        )


def shrink_summary(report: dict) -> None:
    if report.get("student", {}).get("distilled"):
        t, st = report["teacher"], report["student"]
        stdout.print(
            f"distilled {t['parameters']:,}-parameter teacher {t['name']} "
            f"({t['test_accuracy']:.2%}) into {st['name']} with {st['parameters']:,} "
            f"parameters ({st['dense_test_accuracy']:.2%} before Deep Compression)"
        )
        if "hint" in report:
            h = report["hint"]
            stdout.print(
                f"FitNets hint {h['student_layer']} -> teacher {h['teacher_layer']}: "
                f"loss {h['loss_before']:.4f} -> {h['loss_after']:.4f}"
            )
        if "transfer" in report:
            tr = report["transfer"]
            stdout.print(
                f"transfer set ({tr['kind']}): {tr['examples']:,} examples, "
                f"{tr['labelled']:,} with their labels, {tr['teacher_labelled']:,} labelled by "
                "the teacher"
            )
    if "channels" in report:
        c = report["channels"]
        (m0, m1), (p0, p1), (a0, a1) = c["macs"], c["parameters"], c["test_accuracy"]
        stdout.print(
            f"channels: MACs {m0:,} -> {m1:,} ({m1 / m0:.0%}), parameters {p0:,} -> {p1:,}, "
            f"test accuracy {a0:.2%} -> {a1:.2%}; the table starts from the thinned model"
            + (
                f" (archive {c['archive_ratio_vs_original']:.1f}× smaller than the original)"
                if "archive_ratio_vs_original" in c
                else ""
            )
        )
    if "budget" in report:
        b = report["budget"]
        won = b["trials"][b["chosen_trial"] - 1]
        stdout.print(
            f"budget {b['max_drop']:g} points ({b['allowed_lost']} of {b['validation_samples']:,} "
            f"validation samples): kept trial {b['chosen_trial']} of {len(b['trials'])}, "
            f"validation drop {b['val_drop']:+.2f} measured ({won['predicted_drop']:.2f} "
            "predicted before retraining); "
            + ", ".join(f"{n} {r['sparsity']:g}/{r['bits']}b" for n, r in b["layers"].items())
        )
        if not b["met"]:
            stderr.print(
                f"warning: no trial stayed within --max-drop {b['max_drop']:g}; kept the one "
                "whose mean probability of the right class dropped least. Raise budget.trials, "
                "or the budget."
            )
    base = report["baseline"]
    table = Table(title="compress shrink", title_justify="left")
    for col in ("stage", "bytes", "ratio", "test acc", "Δ points", "95% CI (paired)"):
        table.add_column(col, justify="right")
    table.add_row(
        "FP32 dense", f"{base['bytes']:,}", "1.0×", f"{base['test_accuracy']:.2%}", "", ""
    )
    for st in report["stages"]:
        delta = 100 * (st["test_accuracy"] - base["test_accuracy"])
        c = st.get("change")
        table.add_row(
            STAGE_LABELS.get(st["name"], st["name"]),
            f"{st['bytes']:,}" if "bytes" in st else "–",
            f"{st['ratio']:.1f}×" if "ratio" in st else "–",
            f"{st['test_accuracy']:.2%}",
            f"{delta:+.2f}",
            f"{c['ci_points'][0]:+.2f} to {c['ci_points'][1]:+.2f}" if c else "",
        )
    stdout.print(table)
    layers = Table(title="per layer", title_justify="left")
    for col in ("layer", "weights", "kept", "w bits", "w bits H", "idx bits", "idx bits H", "size"):
        layers.add_column(col, justify="right")
    for r in report["layers"]:
        h = r.get("weight_bits_huffman")
        layers.add_row(
            r["name"],
            f"{r['weights']:,}",
            f"{r['kept_fraction']:.1%}",
            str(r["weight_bits"]),
            f"{h:.2f}" if h is not None else "–",
            f"{r['index_bits']:.2f}",
            f"{r['index_bits_huffman']:.2f}" if h is not None else "–",
            f"{r['size_fraction']:.2%}" if h is not None else "–",
        )
    stdout.print(layers)
    if "archive" in report:
        a = report["archive"]
        stdout.print(
            f"archive {a['path']}: {a['bytes']:,} bytes, {a['ratio']:.1f}× smaller; "
            f"{a['vs_entropy_bound']:.3f}× the order-0 entropy bound ({a['entropy_bound_bytes']:,} bytes)"
        )
    for kind, o in report.get("onnx", {}).items():
        extra = ""
        if kind == "int8":
            lat = o.get("latency_ms_batch1")
            timed = f", batch-1 {lat['int8']:.3f} ms vs FP32 {lat['fp32']:.3f} ms" if lat else ""
            extra = (
                f"{timed}, {o['int8_nodes']} of {o['quantizable_nodes']} nodes in INT8, "
                f"{o['scheme']}, target {o['target']}"
            )
        stdout.print(
            f"onnx {kind}: {o['bytes']:,} bytes, test acc {o['test_accuracy']:.2%}, "
            f"top-1 agreement {o['top1_agreement']:.2%}, max |Δ| {o['max_abs_diff']:.3g}{extra}; "
            f"opset {o['opsets'].get('ai.onnx')}, IR {o['ir_version']}, "
            f"ONNX Runtime ≥ {o['min_ort']}"
        )
        if kind == "int8":
            h = o["host_kernels"]
            stdout.print(
                f"  on this CPU's optimized kernels: top-1 agreement with FP32 "
                f"{h['top1_agreement_fp32']:.2%}, max |Δ| {h['max_abs_diff_fp32']:.3g}"
                + (
                    " (AVX2 without VNNI: u8s8 kernels can saturate here, not on a phone)"
                    if h["saturating_cpu"]
                    else ""
                )
            )
    if "mobile" in report:
        stdout.print(
            f"mobile: NNAPI {report['mobile']['nnapi']}, CoreML {report['mobile']['coreml']}"
        )
    if "mobile_fixed_batch" in report:
        f = report["mobile_fixed_batch"]
        stdout.print(
            f"mobile, batch fixed to {f['batch']}: NNAPI {f['nnapi']}, CoreML {f['coreml']}"
        )
    stdout.print("wrote " + ", ".join(Path(f).name for f in report.get("files", [])))


def bench_table(bench: dict) -> None:
    env = bench["environment"]
    versions = env.get("versions", {})
    stdout.print(
        f"{env.get('cpu_model')}, {env.get('logical_cores')} logical cores; torch "
        f"{versions.get('torch')}, onnxruntime {versions.get('onnxruntime')}; {env.get('date')}"
    )
    table = Table(title="compress bench: p50 with its 95% bootstrap CI", title_justify="left")
    cols = ("model", "prec", "runtime", "batch", "thr", "p50 ms", "95% CI", "p99 ms", "items/s")
    cols += ("speed-up", "cold ms", "file bytes", "G(FL)OP/s", "% peak", "acc", "agree")
    for col in cols:
        table.add_column(col, justify="left" if col in ("model", "runtime") else "right")
    for r in bench["results"]:
        lo, hi = r["p50_ci_ms"]
        acc, agr = r.get("test_accuracy"), r.get("top1_agreement")
        table.add_row(
            r["model"],
            r["precision"],
            r["provider"].replace("ExecutionProvider", "").replace("CPU", "ORT-CPU"),
            str(r["batch"]),
            str(r["threads"] or "all"),
            f"{r['p50_ms']:.3f}",
            f"{lo:.3f}-{hi:.3f}",
            f"{r['p99_ms']:.3f}",
            f"{r['throughput_per_s']:,.0f}",
            f"{r['speedup_vs_first']:.1f}×",
            f"{r['cold_start_ms']:.0f}",
            f"{r['bytes']:,}",
            f"{r['gflops']:.1f}" if r.get("gflops") is not None else "–",
            f"{r['peak_fraction']:.0%}" if r.get("peak_fraction") is not None else "–",
            f"{acc:.2%}" if acc is not None else "–",
            f"{agr:.2%}" if agr is not None else "–",
        )
    stdout.print(table)
    stdout.print("speed-up: against the first row of the same batch and threads")
    peaks = bench.get("peaks", {})
    for t, p in peaks.items():
        stdout.print(
            f"peak, {t} thread(s): FP32 matmul {p['fp32_gflops']:.0f} GFLOP/s, INT8 matmul "
            f"{p['int8_gops']:.0f} GOP/s (% peak: INT8 rows against INT8, others FP32)"
        )
    for r in bench["results"]:
        for note in r["notes"]:
            stdout.print(f"note: {r['model']} batch {r['batch']}: {note}")
    for name, p in bench.get("profiles", {}).items():
        stdout.print(f"profile {name}: " + ", ".join(p["top"]))
    for s in bench.get("skipped", []):
        stdout.print(f"skipped: {s['model']} [{s['precision']}] on {s['provider']}: {s['reason']}")
