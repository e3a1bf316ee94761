"""`compress bench` results as a Markdown report and a figure (latency bars with the bootstrap
confidence interval of p50; accuracy against file size), drawn from the plain-data result so
the JSON alone reproduces them."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from compresskit.compressor.report import new_figure, save_figure
from compresskit.models.fileio import atomic_path, check_plot_path, check_writable
from compresskit.models.jsonable import finite

ENV_KEYS = (
    "date",
    "cpu_model",
    "logical_cores",
    "physical_cores",
    "os",
    "python",
    "versions",
    "ort_providers",
    "gpu",
)


def _fmt(v: Any, spec: str = "") -> str:
    if v is None:
        return "–"
    return format(v, spec) if spec else str(v)


def markdown(bench: dict[str, Any], plot: str | Path | None = None) -> str:
    """The bench result as Markdown; `plot`: the figure's path as the report should link
    it (relative to the report's folder), when one is written."""
    env = bench["environment"]
    flags = ", ".join(k for k, on in env.get("cpu_flags", {}).items() if on) or "none found"
    lines = ["# compress bench", "", "## Environment", ""]
    lines += [f"- {k}: {env.get(k)}" for k in ENV_KEYS if k in env]
    lines += [f"- CPU flags: {flags}"]
    lines += [
        f"- measured peak, {t} thread(s): FP32 matmul {p['fp32_gflops']:.1f} GFLOP/s, INT8 "
        f"matmul {p['int8_gops']:.1f} GOP/s"
        for t, p in bench.get("peaks", {}).items()
    ]
    load = env.get("load_average_1min")
    if load is not None:
        lines += [f"- load average (1 min) {load} on {env.get('usable_cores')} usable cores"]
    if bench.get("notes"):
        lines += ["", "## Caveats", "", *(f"- {n}" for n in bench["notes"])]
    lines += [
        "",
        "## Results",
        "",
        "p50 with its 95% bootstrap confidence interval; runs interleaved across variants"
        + (
            f"; top-1 agreement against {bench['agreement_reference']}."
            if bench.get("agreement_reference")
            else "."
        ),
        "",
        "| model | precision | provider | batch | threads | p50 ms [95% CI] | p90 ms | p99 ms "
        "| runs | items/s | cold start ms | bytes | parameters | GFLOP/s (% peak) | test acc "
        "| agreement |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in bench["results"]:
        lo, hi = r["p50_ci_ms"]
        gf = f"{r['gflops']:.2f} ({r['peak_fraction']:.0%})" if r.get("gflops") is not None else "–"
        acc = r.get("test_accuracy")
        agr = r.get("top1_agreement")
        lines.append(
            f"| {r['model']} | {r['precision']} | {r['provider']} | {r['batch']} | "
            f"{r['threads'] or 'all'} | {r['p50_ms']:.4f} [{lo:.4f}, {hi:.4f}] | "
            f"{r['p90_ms']:.4f} | {r['p99_ms']:.4f} | {_fmt(r.get('runs'), ',')} | "
            f"{r['throughput_per_s']:,.0f} | "
            f"{r['cold_start_ms']:.1f} | {r['bytes']:,} | {_fmt(r['parameters'], ',')} | {gf} | "
            f"{f'{acc:.2%}' if acc is not None else '–'} | "
            f"{f'{agr:.2%}' if agr is not None else '–'} |"
        )
    if plot is not None:
        lines += [
            "",
            f"![latency per batch size and accuracy against size]({Path(plot).as_posix()})",
        ]
    notes = [
        f"- {r['model']} ({r['provider']}, batch {r['batch']}): {n}"
        for r in bench["results"]
        for n in r["notes"]
    ]
    if notes:
        lines += ["", "## Notes", "", *notes]
    if bench.get("profiles"):
        lines += ["", "## Operator profiles (share of time)", ""]
        lines += [f"- {name}: {', '.join(p['top'])}" for name, p in bench["profiles"].items()]
    if bench.get("skipped"):
        lines += ["", "## Skipped", ""]
        lines += [
            f"- {s['model']} [{s['precision']}] on {s['provider']}: {s['reason']}"
            for s in bench["skipped"]
        ]
    return "\n".join(lines) + "\n"


def write_markdown(bench: dict[str, Any], path: Path, plot: Path | None = None) -> Path:
    """Write `markdown(bench)` at `path`; `plot`, the figure's path (as given to `plot`),
    is linked relative to the report's folder."""
    check_writable(path, "--report")
    link = None
    if plot is not None:
        here = Path(os.path.abspath(path)).parent
        try:
            link = Path(os.path.relpath(os.path.abspath(plot), here))
        except ValueError:  # another drive (Windows): no relative path exists
            link = Path(os.path.abspath(plot))
    with atomic_path(path) as f:
        f.write_text(markdown(bench, link), encoding="utf-8")
    return path


def write_json(bench: dict[str, Any], path: Path) -> Path:
    """Write the bench result at `path` as the JSON object `--json` prints (NaN as null)."""
    check_writable(path, "--report")
    with atomic_path(path) as f:
        f.write_text(
            json.dumps(finite(bench), indent=2, default=str, allow_nan=False) + "\n",
            encoding="utf-8",
        )
    return path


# One colour per runtime, the same in every panel and every bench figure.
RUNTIME_COLOURS = {
    "CPUExecutionProvider": "tab:blue",
    "pytorch-cpu": "tab:orange",
    "CUDAExecutionProvider": "tab:green",
    "pytorch-cuda": "tab:red",
    "TensorrtExecutionProvider": "tab:purple",
}
_SPARE_COLOURS = ("tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray")
MIXED_COLOUR = "dimgrey"  # an accuracy point several runtimes share


def runtime_name(provider: str) -> str:
    """ "CPUExecutionProvider" -> "ORT CPU"; PyTorch's own ("pytorch-cpu") stay as they are."""
    if provider.endswith("ExecutionProvider"):
        return "ORT " + provider.removesuffix("ExecutionProvider")
    return provider


def _colours(rows: list[dict[str, Any]]) -> dict[str, str]:
    colours, spare = {}, iter(_SPARE_COLOURS * 4)
    for r in rows:
        p = r["provider"]
        if p not in colours:
            colours[p] = RUNTIME_COLOURS.get(p) or next(spare, "black")
    return colours


def _variant(r: dict[str, Any]) -> tuple:
    return (r["model"], r["precision"], r["provider"], r.get("threads"))


def _variant_label(key: tuple) -> str:
    model, precision, provider, threads = key
    return f"{model} {precision} {runtime_name(provider)} t{threads or 'all'}"


def _accuracy_groups(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Accuracy points (one per model, precision and runtime), gathered into groups whose
    markers would overlap: within 4% of the panel's span on both axes (size on a log scale).
    Each group is drawn once, numbered, and named in the key."""
    points, seen = [], set()
    for r in rows:
        key = (r["model"], r["precision"], r["provider"])
        if r.get("test_accuracy") is None or key in seen:
            continue
        seen.add(key)
        points.append(r)
    xs = [math.log10(max(r["bytes"], 1)) for r in points]
    ys = [100 * r["test_accuracy"] for r in points]
    x_span = max(max(xs) - min(xs), 0.3) if xs else 1
    y_span = max(max(ys) - min(ys), 1.0) if ys else 1
    groups: list[list[int]] = []
    for i in range(len(points)):
        for g in groups:
            j = g[0]
            if abs(xs[i] - xs[j]) < 0.04 * x_span and abs(ys[i] - ys[j]) < 0.04 * y_span:
                g.append(i)
                break
        else:
            groups.append([i])
    return [[points[i] for i in g] for g in groups]


def _group_label(n: int, group: list[dict[str, Any]]) -> str:
    """ "1: student.fp32.onnx fp32 (ORT CPU, pytorch-cpu) 245.1 KB, 92.10%", one line per
    file and accuracy."""
    files: dict[tuple, list[str]] = {}
    for r in group:
        key = (r["model"], r["precision"], r["bytes"], r["test_accuracy"])
        files.setdefault(key, []).append(runtime_name(r["provider"]))
    lines = [
        f"{model} {precision} ({', '.join(runtimes)}) {size / 1000:,.1f} KB, {acc:.2%}"
        for (model, precision, size, acc), runtimes in files.items()
    ]
    return f"{n}: " + "\n    ".join(lines)


def _plain_log_ticks(ax: Any, lows: list[float]) -> None:
    """Log-axis tick labels as plain numbers (0.2, 5, 20), never matplotlib's crowded
    2×10^-1 minor labels: 2 and 5 between the powers of ten are labelled only when the data
    span at most about one and a half decades, where they fit."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    _, hi = ax.get_xlim()
    lo = min(x for x in lows if x > 0) if any(x > 0 for x in lows) else hi / 10
    if math.log10(hi / lo) <= 1.5:

        def minor(v: float, _: Any) -> str:
            lead = round(v / 10 ** math.floor(math.log10(v) + 1e-9), 6)
            return f"{v:g}" if lead in (2, 5) else ""

        ax.xaxis.set_minor_formatter(FuncFormatter(minor))
    else:
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.tick_params(axis="x", which="both", labelsize=7)
    ax.tick_params(axis="x", which="minor", pad=5)  # minor ticks are shorter: align labels


def figure(bench: dict[str, Any]) -> Any:
    """The bench figure as a matplotlib Figure. Top row: one latency panel per batch size,
    p50 per variant with its 95% CI (log scale), one colour per runtime, the variants on the
    same rows in every panel. Below, when accuracy was measured: test accuracy against file
    size, one numbered marker per point (points that would overlap share one), the numbers
    explained in a key beside the panel instead of labels on the points."""
    from matplotlib.legend_handler import HandlerTuple
    from matplotlib.patches import Patch

    rows = bench["results"]
    if not rows:  # everything skipped: say so in the figure rather than fail
        fig = new_figure((6, 2))
        ax = fig.subplots()
        ax.axis("off")
        ax.text(0.5, 0.5, "no variant ran (see skipped)", ha="center", va="center")
        return fig
    colours = _colours(rows)
    batches = sorted({r["batch"] for r in rows})
    variants = list(dict.fromkeys(_variant(r) for r in rows))
    groups = _accuracy_groups(rows)
    key_lines = sum(len({(r["model"], r["precision"]) for r in g}) for g in groups)
    top = 1.2 + 0.28 * len(variants)
    bottom = max(3.4, 0.8 + 0.22 * key_lines) if groups else 0
    fig = new_figure((max(9.0, 3.5 + 3.2 * len(batches)), top + bottom))
    grid = fig.add_gridspec(
        2 if groups else 1, len(batches), height_ratios=[top, bottom][: 1 + bool(groups)]
    )
    first = None
    for col, batch in enumerate(batches):
        ax = fig.add_subplot(grid[0, col], sharey=first)
        first = first or ax
        at = {_variant(r): r for r in rows if r["batch"] == batch}
        for i, key in enumerate(variants):
            r = at.get(key)
            if r is None:  # not run at this batch (a fixed-batch file, a skip)
                continue
            lo, hi = r["p50_ci_ms"]
            ax.barh(
                i,
                r["p50_ms"],
                xerr=[[r["p50_ms"] - lo], [hi - r["p50_ms"]]],
                color=colours[r["provider"]],
                capsize=3,
            )
        ax.set(xscale="log", xlabel="p50 latency (ms), 95% CI", title=f"batch {batch}")
        _plain_log_ticks(ax, [r["p50_ci_ms"][0] for r in at.values()] or [1.0])
        ax.grid(axis="x", which="both", alpha=0.3)
        if col == 0:
            ax.set_yticks(range(len(variants)), [_variant_label(k) for k in variants], fontsize=7)
            ax.set_ylim(len(variants) - 0.5, -0.5)
        else:
            ax.tick_params(axis="y", labelleft=False)
    last = fig.axes[-1]
    last.legend(
        handles=[Patch(color=c, label=runtime_name(p)) for p, c in colours.items()],
        title="runtime",
        fontsize=7,
        title_fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.01, 1),
    )
    if groups:
        ax2 = fig.add_subplot(grid[1, :])
        handles, labels = [], []
        for n, g in enumerate(groups, 1):
            x = 10 ** (sum(math.log10(max(r["bytes"], 1)) for r in g) / len(g)) / 1000
            y = sum(100 * r["test_accuracy"] for r in g) / len(g)
            runtimes = {r["provider"] for r in g}
            colour = colours[g[0]["provider"]] if len(runtimes) == 1 else MIXED_COLOUR
            (dot,) = ax2.plot([x], [y], "o", ls="none", ms=15, color=colour, alpha=0.85)
            (num,) = ax2.plot(
                [x], [y], ls="none", marker=f"${n}$", ms=7 + 2 * (n >= 10), color="white"
            )
            handles.append((dot, num))
            labels.append(_group_label(n, g))
        ax2.set(
            xscale="log",
            xlabel="size (KB): the file, or a checkpoint's weights (no optimizer state)",
            ylabel="test accuracy (%)",
            title="Accuracy vs size (numbers: see key; grey: several runtimes)",
        )
        ax2.margins(0.15)
        low, high = ax2.get_ylim()
        ax2.set_ylim(low, min(high, 100.5))  # no accuracy above 100% on the axis
        _plain_log_ticks(ax2, [r["bytes"] / 1000 for g in groups for r in g])
        ax2.grid(which="both", alpha=0.3)
        ax2.legend(
            handles,
            labels,
            handler_map={tuple: HandlerTuple(ndivide=1)},
            markerscale=0.8,
            labelspacing=1.0,
            fontsize=7,
            loc="upper left",
            bbox_to_anchor=(1.01, 1),
            title="key",
            title_fontsize=7,
        )
    return fig


def plot(bench: dict[str, Any], path: Path) -> Path:
    """Write `figure(bench)` at `path`, as the PNG, SVG or PDF its suffix names."""
    fmt = check_plot_path(path)
    check_writable(path, "--plot")
    return save_figure(figure(bench), path, fmt)
