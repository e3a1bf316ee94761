"""The only place that formats output for people: progress on stderr, tables on stdout."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from distrib.trainer import EpochRecord, Events, TrainResult

stderr = Console(stderr=True, highlight=False, soft_wrap=True)
# Off a terminal (pipes, CI logs) rich assumes 80 columns; tables read better wider.
stdout = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 130)


class TrainProgress(Events):
    """A progress bar per epoch on a terminal; one line per epoch otherwise (logs, CI)."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self.live = stderr.is_terminal and not quiet
        self.progress: Progress | None = None
        self.task = None
        self.last_checkpoint: Path | None = None

    def checkpoint(self, path: Path, epoch: int, step: int) -> None:
        self.last_checkpoint = path

    def info(self, message: str) -> None:
        if not self.quiet:
            stderr.print(message)

    def epoch_start(self, epoch: int, epochs: int, steps: int, done: int) -> None:
        if not self.live:
            return
        self.progress = Progress(
            TextColumn(f"epoch {epoch}/{epochs}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TimeElapsedColumn(),
            console=stderr,
            transient=True,
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=steps, completed=done, loss="-")

    def step(self, epoch: int, step: int, loss: float) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step, loss=f"{loss:.4f}")

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


STAGE_LABELS = {
    "prune": "P (pruned)",
    "quantize": "P+Q (shared weights)",
    "huffman": "P+Q+H (archive)",
}


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
    base = report["baseline"]
    table = Table(title="compress shrink", title_justify="left")
    for col in ("stage", "bytes", "ratio", "test acc", "Δ points"):
        table.add_column(col, justify="right")
    table.add_row("FP32 dense", f"{base['bytes']:,}", "1.0×", f"{base['test_accuracy']:.2%}", "")
    for st in report["stages"]:
        delta = 100 * (st["test_accuracy"] - base["test_accuracy"])
        table.add_row(
            STAGE_LABELS.get(st["name"], st["name"]),
            f"{st['bytes']:,}" if "bytes" in st else "–",
            f"{st['ratio']:.1f}×" if "ratio" in st else "–",
            f"{st['test_accuracy']:.2%}",
            f"{delta:+.2f}",
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
            lat = o["latency_ms_batch1"]
            extra = (
                f", batch-1 {lat['int8']:.3f} ms vs FP32 {lat['fp32']:.3f} ms, "
                f"{o['int8_nodes']} of {o['quantizable_nodes']} nodes in INT8"
            )
        stdout.print(
            f"onnx {kind}: {o['bytes']:,} bytes, test acc {o['test_accuracy']:.2%}, "
            f"top-1 agreement {o['top1_agreement']:.2%}, max |Δ| {o['max_abs_diff']:.3g}{extra}"
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


def demo_summary(report: dict) -> None:
    """Teacher against shipped student: size, accuracy, batch-1 latency."""
    t, st = report["teacher"], report["student"]
    lat = report["latency_ms_batch1"]
    table = Table(title="compress demo: teacher vs student", title_justify="left")
    for col in (
        "model",
        "runtime",
        "parameters",
        "bytes",
        "test acc",
        "batch-1 ms",
        "speed-up",
    ):
        table.add_column(col, justify="right")
    base = lat["teacher_pytorch"]
    table.add_row(
        f"teacher {t['name']}",
        "PyTorch FP32",
        f"{t['parameters']:,}",
        f"{t['bytes']:,}",
        f"{t['test_accuracy']:.2%}",
        f"{base:.3f}",
        "1.0×",
    )
    rows = [("student_pytorch", "PyTorch FP32", None)]
    rows += [(f"student_onnx_{k}", f"ORT {k.upper()}", k) for k in ("fp32", "int8")]
    for key, runtime, kind in rows:
        if key not in lat:
            continue
        o = report["onnx"][kind] if kind else None
        table.add_row(
            f"student {st['name']}",
            runtime,
            f"{st['parameters']:,}",
            f"{o['bytes']:,}"
            if o
            else f"{report['archive']['bytes']:,} (.dcz)"
            if "archive" in report
            else "–",
            f"{(o or st)['test_accuracy']:.2%}",
            f"{lat[key]:.3f}",
            f"{base / lat[key]:.1f}×",
        )
    stdout.print(table)
