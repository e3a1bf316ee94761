"""The only place that formats output for people: progress on stderr, tables on stdout."""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich import box
from rich.cells import cell_len
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

from compresskit.compressor import report as report_mod
from compresskit.distrib.trainer import EpochRecord, Events, TrainResult

LINE_EVERY_S = 15.0  # progress lines off a terminal

# markup=False: paths and labels such as "[fp32]" are text, never rich markup.
stderr = Console(stderr=True, highlight=False, soft_wrap=True, markup=False)
# Off a terminal (pipes, CI logs) rich assumes 80 columns; tables read better wider.
stdout = Console(
    highlight=False,
    soft_wrap=True,
    markup=False,
    width=None if sys.stdout is not None and sys.stdout.isatty() else 200,
)


def rank0_progress(quiet: bool, log: str | None) -> TrainProgress:
    """Rank 0's progress, made inside its own process when a run spawns several: what it says
    goes to the terminal and to --log-file, as a one-process run's does."""
    from compresskit.cli.main import child_log  # here: a spawned rank unpickles this module

    child_log(log)
    return TrainProgress(quiet=quiet)


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
        # -q drops progress, not notes: a resume that changes the global batch said so only
        # without -q
        if not self.quiet or message.startswith(("note:", "warning:")):
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
            # NaN: an epoch with no test pass (TrainConfig.evaluate = "last", PS ranks)
            acc = record.test_accuracy
            test = "     –" if math.isnan(acc) else f"{acc:6.2%}"
            stderr.print(
                f"epoch {record.epoch:>3}  loss {record.train_loss:.4f}  "
                f"train {record.train_accuracy:6.2%}  test {test}  {record.seconds:.1f}s"
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
            "–" if math.isnan(r.test_loss) else f"{r.test_loss:.4f}",
            "–" if math.isnan(r.test_accuracy) else f"{r.test_accuracy:.2%}",
            f"{r.seconds:.2f}",
        )
    stdout.print(table)
    stdout.print(
        f"test accuracy {result.test_accuracy:.2%} after {result.epochs} epoch{'s' * (result.epochs != 1)}, "
        f"{result.seconds:.1f}s training; checkpoint: {out}"
    )
    ps = result.strategy
    if ps.get("kind") == "pipeline":
        how = "cut automatically by " + ps["balance"] if ps["auto_split"] else "cut at --split"
        cuts = ", ".join(ps["split"])
        stages = ", ".join(f"{s}: {p:,} params" for s, p in enumerate(ps["stage_parameters"]))
        idle = ", ".join(f"stage {s} {f:.0%}" for s, f in ps["idle_fraction"].items())
        stdout.print(
            f"pipeline {ps['schedule']}: {ps['stages']} stages ({how}; stages begin at {cuts}), "
            f"{ps['microbatches']} micro-batches{_other_m(ps)}; {stages}"
        )
        stdout.print(
            f"bubble: {ps['bubble_measured']:.0%} measured (idle: {idle}); "
            f"{ps['bubble_theory']:.0%} in theory, (K-1)/(M+K-1) over the steps"
        )
    elif ps:
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
        why = "" if miss.get("failed") else " (it is what an INT8 file here would compute)"
        stderr.print(
            f"warning: no INT8 file written: {miss['reason']}; ship "
            f"{report.get('name', 'model')}.fp32.onnx{why}",
            style="bold yellow",
        )


def guard_warnings(report: dict) -> None:
    """Each guardrail the run crossed, one loud line each on stderr (even under --json). The
    missing INT8 file has its own line (`int8_warning`)."""
    for f in report.get("guard", {}).get("findings", []):
        if f["kind"] == "int8_floor" and "int8_not_written" in report:
            continue
        stderr.print(f"warning: {f['message']}", style="bold red")


def plan_comment(model_path: Path, rows: list[dict]) -> str:
    """--dry-run's per-layer plan, as TOML comments under the recipe (it stays a recipe)."""
    width = max([len(r["layer"]) for r in rows] + [5])
    lines = [f"\n# plan for {model_path}: what the recipe does to each layer", "#"]
    lines.append(f"#   {'layer':<{width}}  {'kind':<9}  {'weights':>10}  {'bits':>4}  sparsity")
    for r in rows:
        bits = "-" if r["bits"] is None else str(r["bits"])
        sparsity = r["sparsity"] if isinstance(r["sparsity"], str) else f"{r['sparsity']:g}"
        lines.append(
            f"#   {r['layer']:<{width}}  {r['kind']:<9}  {r['weights']:>10,}  {bits:>4}  {sparsity}"
        )
    dense = sum(r["weights"] for r in rows if r["kind"] == "dense")
    if dense:
        total = sum(r["weights"] for r in rows)
        lines += [
            "#",
            f"# stored dense: {dense:,} of these {total:,} weights ({dense / total:.0%}), which "
            "bounds the archive's ratio",
        ]
    return "\n".join(lines) + "\n"


# The shrink tables: a header rule and two spaces between columns, as bench's, so that a
# LeNet's stage and layer tables fit 80 columns without folding a name.
_LIGHT = {"title_justify": "left", "box": box.SIMPLE_HEAD, "show_edge": False, "pad_edge": False}

DELIVERABLE_NOTES = {
    "archive": "storage (compress decode)",
    "fixed-batch onnx": "fixed batch, for NNAPI",
}


def deliverables(report: dict, out: Console) -> None:
    """The summary's first lines: each file written, its bytes against the dense FP32
    weights, and which one to ship."""
    d = report.get("deliverables")
    if not d or not d["files"]:
        return
    base = report["baseline"]
    out.print(
        f"deliverables against {d['dense_fp32_bytes']:,} B of dense FP32 weights "
        f"({base.get('parameters', 0):,} parameters):"
    )
    width = max(len(Path(f["path"]).name) for f in d["files"])
    for f in d["files"]:
        note = DELIVERABLE_NOTES.get(f["kind"], "")
        if Path(f["path"]).name == d["ship"]:
            note = "ship this (ONNX Runtime)"
        elif Path(f["path"]).name == d["ship_mobile"]:
            note = "ship this with ORT Mobile (CPU)"
        line = f"  {Path(f['path']).name:<{width}}  {f['bytes']:>11,} B  {f['ratio']:>6.1f}×"
        out.print(f"{line}  {note}" if note else line)
    if d.get("ship_why"):
        out.print(f"  ship the FP32 file: {d['ship_why']}")


def budget_warnings(report: dict) -> None:
    """The budget search's notes and a missed budget, on stderr: with --json too (they were in
    the summary, which --json skips, so a script saw only `budget.met: false`)."""
    b = report.get("budget")
    if not b:
        return
    for key in ("coarse", "method_note"):
        if b.get(key):
            stderr.print(f"note: {b[key]}")
    if not b["met"]:
        stderr.print(
            f"warning: no trial stayed within --max-drop {b['max_drop']:g}; kept the one "
            "whose mean probability of the right class dropped least. Raise budget.trials, "
            "or the budget."
        )


def shrink_summary(report: dict, width: int | None = None) -> None:
    out = out_console(width)
    deliverables(report, out)
    if report.get("student", {}).get("distilled"):
        t, st = report["teacher"], report["student"]
        # an ensemble's figures are the whole ensemble's: never under one member's name
        # (it read "312,770-parameter teacher lenet300 (96.11%)" for a 50,610 lenet300)
        who = (
            f"an ensemble of {t['members']} teachers ({t['name']} and {t['members'] - 1} more; "
            f"{t['parameters']:,} parameters in all, {t['test_accuracy']:.2%} averaged)"
            if t.get("members", 1) > 1
            else f"{t['parameters']:,}-parameter teacher {t['name']} ({t['test_accuracy']:.2%})"
        )
        # the student as distillation left it: channel pruning's line below thins it (the
        # thinned size was shown beside the unthinned student's accuracy)
        params = st.get("distilled_parameters", st["parameters"])
        acc = st.get("distilled_test_accuracy", st["dense_test_accuracy"])
        when = "" if report.get("channels") else " before Deep Compression"
        out.print(f"distilled {who} into {st['name']} with {params:,} parameters ({acc:.2%}{when})")
        if "hint" in report:
            h = report["hint"]
            out.print(
                f"FitNets hint {h['student_layer']} -> teacher {h['teacher_layer']}: "
                f"loss {h['loss_before']:.4f} -> {h['loss_after']:.4f}"
            )
        if "transfer" in report:
            tr = report["transfer"]
            out.print(
                f"transfer set ({tr['kind']}): {tr['examples']:,} examples, "
                f"{tr['labelled']:,} with their labels, {tr['teacher_labelled']:,} labelled by "
                "the teacher"
            )
    if "channels" in report:
        c = report["channels"]
        (m0, m1), (p0, p1), (a0, a1) = c["macs"], c["parameters"], c["test_accuracy"]
        out.print(
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
        how, layers = report_mod.budget_summary(b)
        out.print(
            f"budget {b['max_drop']:g} points ({b['allowed_lost']} of {b['validation_samples']:,} "
            f"validation samples): kept trial {b['chosen_trial']} of {len(b['trials'])}, "
            f"validation drop {b['val_drop']:+.2f} measured ({how}); {layers}"
        )
    if note := report_mod.sensitivity_note(report):
        out.print(note)
    if note := report_mod.tied_note(report):
        out.print(f"note: {note}")
    if note := report_mod.uncovered_note(report):
        out.print(f"note: {note}")
    base = report["baseline"]
    table = Table(title="compress shrink", **_LIGHT)
    for col in ("stage", "bytes", "ratio", "test acc", "Δ points", "95% CI (paired)"):
        table.add_column(col, justify="left" if col == "stage" else "right", no_wrap=True)
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
    out.print(table)
    layers = Table(
        title="per layer: bits per kept weight and per index, before and after entropy coding (H)",
        **_LIGHT,
    )
    for col in ("layer", "weights", "kept", "bits", "bits H", "idx bits", "idx bits H", "size"):
        if col == "layer":  # a long name folds; numbers never do
            layers.add_column(col, overflow="fold", min_width=12)
        else:
            layers.add_column(col, justify="right", no_wrap=True)
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
    out.print(layers)
    if note := report_mod.no_archive_note(report):
        out.print(note)
    if "archive" in report:
        a = report["archive"]
        out.print(
            f"archive {Path(a['path']).name}: {a['bytes']:,} bytes, {a['ratio']:.1f}× smaller; "
            f"{a['vs_entropy_bound']:.3f}× its order-0 entropy "
            f"({a['entropy_bound_bytes']:,} bytes)"
        )
        over = a.get("over_pq")
        if over:
            out.print(
                f"  larger than its P+Q figure ({over['pq_bytes']:,} bytes): the archive's fixed "
                f"bytes (header, codebooks, dense tensors, framing: {over['fixed_bytes']:,}) "
                "outweigh what entropy coding saves on a model this small"
            )
    for kind, o in report.get("onnx", {}).items():
        out.print(
            f"onnx {kind}: {o['bytes']:,} bytes, test acc {o['test_accuracy']:.2%}, top-1 "
            f"agreement {o['top1_agreement']:.2%}, max |Δ| {o['max_abs_diff']:.3g}; opset "
            f"{o['opsets'].get('ai.onnx')}, IR {o['ir_version']}, ONNX Runtime ≥ {o['min_ort']}"
        )
        if kind == "fp32" and (line := report_mod.sequence_line(o.get("input", {}))):
            out.print(f"  {line}")
        if kind == "fp32" and (scaling := o.get("input", {}).get("scaling")):
            i = o["input"]
            out.print(f"  input {i['name']} ({', '.join(map(str, i['shape']))}): {scaling}")
        if kind == "int8":
            lat = o.get("latency_ms_batch1")
            timed = f"; batch 1 {lat['int8']:.3f} ms vs FP32 {lat['fp32']:.3f} ms" if lat else ""
            out.print(
                f"  {o['int8_nodes']} of {o['quantizable_nodes']} nodes in INT8, {o['scheme']}, "
                f"target {o['target']}; agreement with FP32 {o['top1_agreement_fp32']:.2%} "
                f"(floor {o['min_agreement']:.2%}){timed}"
            )
            if rows := o.get("int8_tables"):
                out.print(
                    f"  embedding tables as int8 rows (a scale each): {report_mod.table_counts(rows)}"
                )
            if why := o.get("int8_tables_fp32"):
                out.print(f"  embedding tables: {why}")
            if lstms := o.get("int8_lstms"):
                out.print(f"  {report_mod.lstm_line(lstms)}")
            if why := o.get("int8_lstms_fp32"):
                out.print(f"  {why}")
            if fixed := o.get("fp32_only_nodes"):
                nodes = "nodes stay" if sum(fixed.values()) > 1 else "node stays"
                out.print(
                    f"  {report_mod.node_counts(fixed)} {nodes} FP32 (no INT8 kernel in ONNX "
                    "Runtime)"
                )
            h = o["host_kernels"]
            out.print(
                f"  on this CPU's optimized kernels: top-1 agreement with FP32 "
                f"{h['top1_agreement_fp32']:.2%}, max |Δ| {h['max_abs_diff_fp32']:.3g}"
                + (
                    " (AVX2 without VNNI: u8s8 kernels can saturate here, not on a phone)"
                    if h["saturating_cpu"]
                    else ""
                )
            )
    if report.get("ort", {}).get("ort_format"):
        o = report["ort"]
        out.print(
            f"ort {Path(o['path']).name}: ORT format v{o['ort_format']}, opset {o['opset']}, "
            f"ONNX Runtime ≥ {o['min_ort']}; for {o['runs_on']}"
        )
    if "mobile" in report:
        out.print("mobile: " + mobile_verdicts(report["mobile"]))
    if "mobile_fixed_batch" in report:
        f = report["mobile_fixed_batch"]
        out.print(f"mobile, batch fixed to {f['batch']}: " + mobile_verdicts(f))
    if report.get("files"):
        out.print("wrote " + ", ".join(Path(f).name for f in report["files"]))


def mobile_verdicts(m: dict) -> str:
    """ "NNAPI no (yes with fixed shapes: --fixed-batch 1), CoreML no (unsupported ops ...)":
    each verdict with its reason and the fix, from the usability checker's details."""
    from compresskit.compressor.report import mobile_reasons

    eps = mobile_reasons(m.get("details", ""))
    out = []
    for key, name, names in (
        ("nnapi", "NNAPI", ("NNAPI",)),
        ("coreml", "CoreML", ("CoreML NeuralNetwork", "CoreML MLProgram")),
    ):
        why = []
        infos = [eps[n] for n in names if n in eps]
        if m[key] != "yes" and any(i.get("fixed") == "yes" for i in infos):
            why.append("yes with fixed shapes: --fixed-batch 1" if "batch" not in m else "")
        unsupported = sorted(
            {op for i in infos for op in i.get("unsupported", "").split(",") if op}
        )
        if m[key] != "yes" and unsupported:
            why.append(f"unsupported ops {', '.join(unsupported)}")
        if m[key] != "yes":  # what the checker's op list misses (int8 activations on NNAPI)
            why += sorted({i["other"] for i in infos if "other" in i})
        why = [w for w in why if w]
        out.append(f"{name} {m[key]}" + (f" ({'; '.join(why)})" if why else ""))
    return ", ".join(out)


# --- compress bench -------------------------------------------------------------------------

WIDTH_OFF_TERMINAL = 200  # columns when stdout is not a terminal and $COLUMNS is unset
MODEL_MIN = 20  # a longer model name folds onto a second line before a column is dropped
GAP = 2  # columns between two table columns (one of padding, one of the box's divider)
RUNTIME_LABELS = {
    "pytorch-cpu": "torch-cpu",
    "pytorch-cuda": "torch-cuda",
    "CPUExecutionProvider": "ORT-CPU",
    "CUDAExecutionProvider": "ORT-CUDA",
    "TensorrtExecutionProvider": "TensorRT",
}


def out_console(width: int | None = None) -> Console:
    """A console on stdout `width` columns wide: the given width, else $COLUMNS, else the
    terminal's, else (off a terminal: a pipe, a log) WIDTH_OFF_TERMINAL. Made per call, so the
    width is the one at the time of printing; text longer than it folds at spaces."""
    if width is None:
        columns = os.environ.get("COLUMNS", "").strip()
        if columns.isdigit() and int(columns) > 0:
            width = int(columns)
        elif not (hasattr(sys.stdout, "isatty") and sys.stdout.isatty()):
            width = WIDTH_OFF_TERMINAL
    return Console(file=sys.stdout, width=width, highlight=False, markup=False, emoji=False)


def runtime_label(provider: str) -> str:
    return RUNTIME_LABELS.get(provider, provider.replace("ExecutionProvider", ""))


@dataclass
class _Column:
    header: str
    cells: list[str]
    priority: int  # 0: always shown; the others by rank while the width lasts
    left: bool = False  # text, left-aligned; else a number, right-aligned and never cut

    @property
    def full(self) -> int:  # header on one line
        return max([cell_len(self.header), *(cell_len(c) for c in self.cells)])

    @property
    def least(self) -> int:  # headers and model names wrapped at their spaces
        header = max(cell_len(w) for w in self.header.split())
        if self.header == "model":  # a word longer than MODEL_MIN folds inside
            words = [cell_len(w) for c in self.cells for w in c.split()]
            return max(header, min(max([0, *words]), MODEL_MIN))
        return max([header, *(cell_len(c) for c in self.cells)])

    @property
    def empty(self) -> bool:
        return all(c == "–" for c in self.cells)


def _bench_columns(rows: list[dict]) -> list[_Column]:
    """Every column of the bench table, in display order, with its rank: the key columns (0),
    then file size, accuracy, speed-up, agreement, throughput, and the details last."""

    def col(header, priority, cell, left=False) -> _Column:
        return _Column(header, [cell(r) for r in rows], priority, left)

    def opt(fmt, key):
        return lambda r: fmt.format(r[key]) if r.get(key) is not None else "–"

    threads = {r["threads"] for r in rows}
    return [
        col("model", 0, lambda r: r["model"], left=True),
        col("prec", 0, lambda r: r["precision"]),
        col("runtime", 0, lambda r: runtime_label(r["provider"]), left=True),
        col("batch", 0, lambda r: str(r["batch"])),
        # one thread count for every row: a detail (said in the hidden-columns line)
        col("thr", 0 if len(threads) > 1 else 8, lambda r: str(r["threads"] or "all")),
        col("p50 ms", 0, lambda r: f"{r['p50_ms']:.3f}"),
        col("95% CI", 6, lambda r: "{:.3f}-{:.3f}".format(*r["p50_ci_ms"])),
        col("p99 ms", 7, lambda r: f"{r['p99_ms']:.3f}"),
        col("items/s", 5, lambda r: f"{r['throughput_per_s']:,.0f}"),
        col("speed-up", 3, lambda r: f"{r['speedup_vs_first']:.1f}×"),
        col("cold ms", 9, lambda r: f"{r['cold_start_ms']:.0f}"),
        col("bytes", 1, lambda r: f"{r['bytes']:,}"),
        col("G(FL)OP/s", 10, opt("{:.1f}", "gflops")),
        col("% peak", 11, opt("{:.0%}", "peak_fraction")),
        col("acc", 2, opt("{:.2%}", "test_accuracy")),
        col("agree", 4, opt("{:.2%}", "top1_agreement")),
    ]


def _fit(columns: list[_Column], width: int, wide: bool) -> tuple[list[_Column], list[int]]:
    """The columns shown and their widths. --wide: all, headers on one line. Else the key
    columns, then the others by rank until the next one does not fit in `width` (a column of
    only "–" is left out), and the room left widens a folded model name, then headers. Numbers
    are never narrower than their widest cell: when even the key columns do not fit, the
    table is wider than `width` rather than cut."""
    if wide:
        return columns, [c.full for c in columns]
    shown = {id(c) for c in columns if c.priority == 0}
    used = sum(c.least for c in columns if id(c) in shown) + GAP * (len(shown) - 1)
    for c in sorted(columns, key=lambda c: c.priority):
        if id(c) in shown or c.empty:
            continue
        if used + GAP + c.least > width:
            break  # the next in rank does not fit: none after it is shown in its place
        shown.add(id(c))
        used += GAP + c.least
    chosen = [c for c in columns if id(c) in shown]
    widths = [c.least for c in chosen]
    spare = width - used
    for i in sorted(range(len(chosen)), key=lambda i: (chosen[i].header != "model", i)):
        grow = min(max(spare, 0), chosen[i].full - widths[i])
        widths[i] += grow
        spare -= grow
    return chosen, widths


def _fold(parts: list[str], sep: str, width: int, indent: str = "") -> str:
    """`parts` joined by `sep`, with a line break (and `indent`) instead wherever the next part
    would pass `width`: a long line folds between its parts, not inside one (rich folds a part
    that is longer than the width by itself)."""
    mark = sep.rstrip()  # what ends a line that goes on below
    lines = [parts[0]]
    for i, part in enumerate(parts[1:], 2):
        end = mark if i < len(parts) else ""
        if cell_len(lines[-1] + sep + part + end) <= width:
            lines[-1] += sep + part
        else:
            lines[-1] += mark
            lines.append(indent + part)
    return "\n".join(lines)


def _skip_lines(bench: dict, width: int) -> list[str]:
    """Skipped variants, one line per runtime and reason (not one per model and cell). Without
    --providers, the runtimes not installed here are one line; the JSON keeps every skip."""
    runtimes = bench.get("runtimes", {})
    absent = runtimes.get("absent", {}) if runtimes.get("default") else {}
    groups: dict[tuple[str, str], list[str]] = {}
    missing: dict[str, list[str]] = {}  # what would bring them -> runtimes
    for s in bench.get("skipped", []):
        provider = s["provider"]
        if provider in absent:
            names = missing.setdefault(absent[provider], [])
            if runtime_label(provider) not in names:
                names.append(runtime_label(provider))
            continue
        models = groups.setdefault((provider, s["reason"]), [])
        if s["model"] not in models:
            models.append(s["model"])
    lines = []
    if missing:
        parts = [f"{', '.join(names)} ({why})" for why, names in missing.items()]
        lines.append(_fold(["not installed: " + parts[0], *parts[1:]], "; ", width, "  "))
    for (provider, reason), models in groups.items():
        named = ", ".join(models[:3]) + (f" and {len(models) - 3} more" if len(models) > 3 else "")
        lines.append(f"skipped on {runtime_label(provider)} ({named}): {reason}")
    return lines


def bench_notes(bench: dict) -> None:
    """The result's notes on stderr (and so in --log-file), one line each."""
    for note in bench.get("notes", []):
        stderr.print(f"note: {note}")


def bench_table(bench: dict, *, width: int | None = None, wide: bool = False) -> None:
    """The bench result as a table that fits `width` columns (see `out_console`): the key
    columns and as many others as fit, by priority, the rest named in one line; `wide`: all
    sixteen. Numbers are never cut; a long model name folds. The JSON keeps everything."""
    out = out_console(width)
    width = out.width
    env = bench["environment"]
    versions = env.get("versions", {})
    machine = f"{env.get('cpu_model')}, {env.get('logical_cores')} logical cores"
    software = f"torch {versions.get('torch')}, onnxruntime {versions.get('onnxruntime')}"
    out.print(_fold([machine, software, str(env.get("date"))], "; ", width))
    bench_notes(bench)
    rows = bench["results"]
    columns = _bench_columns(rows)
    shown, widths = _fit(columns, width, wide) if rows else ([], [])
    headers = {c.header for c in shown}
    if rows:
        ci = "95% CI" in headers
        table = Table(
            title="compress bench" + (": p50 with its 95% bootstrap CI" if ci else ""),
            title_justify="left",
            box=box.SIMPLE_HEAD,
            show_edge=False,
            pad_edge=False,
            padding=(0, 1, 0, 0),
        )
        for c, w in zip(shown, widths, strict=True):
            justify = "left" if c.left else "right"
            table.add_column(c.header, justify=justify, width=w, overflow="fold")
        for i in range(len(rows)):
            table.add_row(*(c.cells[i] for c in shown))
        needed = sum(widths) + GAP * (len(widths) - 1)
        # a table wider than the terminal (--wide, or key columns that do not fit) is printed
        # whole, never squeezed into cut numbers
        wider = out_console(needed) if needed > width else out
        wider.print(table)
    else:
        out.print("compress bench: nothing was measured")
    if "speed-up" in headers:
        out.print("speed-up: against the first row of the same batch and threads")
    if headers & {"G(FL)OP/s", "% peak"}:
        for t, p in bench.get("peaks", {}).items():
            out.print(
                f"peak, {t} thread(s): FP32 matmul {p['fp32_gflops']:.0f} GFLOP/s, INT8 matmul "
                f"{p['int8_gops']:.0f} GOP/s (% peak: INT8 rows against INT8, others FP32)"
            )
    hidden = [
        c.header + (f" ({c.cells[0]} in every row)" if c.header == "thr" else "")
        for c in columns
        if c.header not in headers and not c.empty
    ]
    if hidden:
        lead = f"not shown at {width} columns (--wide shows all):"
        out.print(_fold([lead + " " + hidden[0], *hidden[1:]], ", ", width, "  "))
    for r in rows:
        for note in r["notes"]:
            out.print(f"note: {r['model']} batch {r['batch']}: {note}")
    for name, p in bench.get("profiles", {}).items():
        out.print(f"profile {name}: " + ", ".join(p["top"]))
    for line in _skip_lines(bench, width):
        out.print(line)


def _other_m(ps: dict) -> str:
    """The steps a pipeline ran at another M (a short batch takes fewer micro-batches)."""
    per_step = {int(m): c for m, c in (ps.get("microbatches_per_step") or {}).items()}
    other = {m: c for m, c in per_step.items() if m != ps["microbatches"]}
    if not other:
        return ""
    return " (" + ", ".join(f"{m} on {c:,} short step(s)" for m, c in sorted(other.items())) + ")"
