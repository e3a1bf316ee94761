"""`compress bench` results as a Markdown report and a figure (latency bars with the bootstrap
confidence interval of p50; accuracy against file size), drawn from the plain-data result so
the JSON alone reproduces them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from compressor.report import save_figure
from models.fileio import atomic_path, check_writable

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


def markdown(bench: dict[str, Any]) -> str:
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
    lines += [
        "",
        "## Results",
        "",
        "p50 with its 95% bootstrap confidence interval; runs interleaved across variants.",
        "",
        "| model | precision | provider | batch | threads | p50 ms [95% CI] | p90 ms | p99 ms "
        "| items/s | cold start ms | bytes | parameters | GFLOP/s (% peak) | test acc | agreement |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in bench["results"]:
        lo, hi = r["p50_ci_ms"]
        gf = f"{r['gflops']:.2f} ({r['peak_fraction']:.0%})" if r.get("gflops") is not None else "–"
        acc = r.get("test_accuracy")
        agr = r.get("top1_agreement")
        lines.append(
            f"| {r['model']} | {r['precision']} | {r['provider']} | {r['batch']} | "
            f"{r['threads'] or 'all'} | {r['p50_ms']:.4f} [{lo:.4f}, {hi:.4f}] | "
            f"{r['p90_ms']:.4f} | {r['p99_ms']:.4f} | {r['throughput_per_s']:,.0f} | "
            f"{r['cold_start_ms']:.1f} | {r['bytes']:,} | {_fmt(r['parameters'], ',')} | {gf} | "
            f"{f'{acc:.2%}' if acc is not None else '–'} | "
            f"{f'{agr:.2%}' if agr is not None else '–'} |"
        )
    notes = [
        f"- {r['model']} ({r['provider']}, batch {r['batch']}): {n}"
        for r in bench["results"]
        for n in r["notes"]
    ]
    if notes:
        lines += ["", "## Notes", "", *notes]
    if bench.get("skipped"):
        lines += ["", "## Skipped", ""]
        lines += [
            f"- {s['model']} [{s['precision']}] on {s['provider']}: {s['reason']}"
            for s in bench["skipped"]
        ]
    return "\n".join(lines) + "\n"


def write_markdown(bench: dict[str, Any], path: Path) -> Path:
    check_writable(path, "--report")
    with atomic_path(path) as f:
        f.write_text(markdown(bench))
    return path


def plot(bench: dict[str, Any], path: Path) -> Path:
    """Left: p50 per variant and cell with CI error bars (log scale). Right: test accuracy
    against file size, when accuracy was measured."""
    check_writable(path, "--plot")
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = bench["results"]
    if not rows:  # everything skipped: say so in the figure rather than fail
        fig, ax = plt.subplots(figsize=(6, 2))
        ax.axis("off")
        ax.text(0.5, 0.5, "no variant ran (see skipped)", ha="center", va="center")
        save_figure(fig, path)
        plt.close(fig)
        return path
    with_acc = [r for r in rows if r.get("test_accuracy") is not None]
    fig, axes = plt.subplots(
        1, 2 if with_acc else 1, figsize=(12 if with_acc else 7, 0.8 + 0.35 * len(rows))
    )
    ax = axes[0] if with_acc else axes
    labels = [
        f"{r['model']} {r['precision']} {r['provider'].replace('ExecutionProvider', '')} "
        f"b{r['batch']} t{r['threads'] or 'all'}"
        for r in rows
    ]
    p50 = [r["p50_ms"] for r in rows]
    err = [
        [r["p50_ms"] - r["p50_ci_ms"][0] for r in rows],
        [r["p50_ci_ms"][1] - r["p50_ms"] for r in rows],
    ]
    ax.barh(range(len(rows)), p50, xerr=err, color="steelblue", capsize=3)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set(xscale="log", xlabel="p50 latency (ms), 95% CI", title="Latency")
    if with_acc:
        ax2 = axes[1]
        seen = set()
        for r in with_acc:
            key = (r["model"], r["precision"], r["provider"])
            if key in seen:
                continue
            seen.add(key)
            ax2.scatter(r["bytes"] / 1000, 100 * r["test_accuracy"])
            ax2.annotate(
                f"{r['model']} {r['precision']}",
                (r["bytes"] / 1000, 100 * r["test_accuracy"]),
                fontsize=7,
            )
        ax2.set(
            xscale="log",
            xlabel="file size (KB)",
            ylabel="test accuracy (%)",
            title="Accuracy vs size",
        )
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path
