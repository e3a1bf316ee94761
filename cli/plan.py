"""`compress plan`: flags -> PlanRequest -> distrib.plan.make_plan -> a table, JSON, a plot."""

from __future__ import annotations

import math
from pathlib import Path

import click
from rich import box
from rich.table import Table

from compresskit.cli import render
from compresskit.cli.main import OutPath, emit_json, json_option, log_option
from compresskit.distrib.plan import LABELS, STRATEGIES, Plan, PlanRequest, make_plan
from compresskit.distrib.trainer import OPTIMIZERS
from compresskit.models.data import SPECS_HELP
from compresskit.models.zoo import available, parse_kwargs

SHORT = {"allreduce": "all-reduce", "ps": "param server", "pipeline": "pipeline"}


@click.command(
    epilog="""\b
Examples:
  compress plan --model vgg                         # measure compute and the link here
  compress plan --model vgg --bandwidth 10GB/s --latency 20us    # a cluster's link
  compress plan --model lenet300 --servers 4 --stages 4 --json > plan.json
  compress plan --model vgg --links-from plan.json  # the links plan.json measured
  compress plan --model-bytes 100MB --compute 200ms --bandwidth 100Gb/s --latency 5us \\
      --plot plan.png                               # nothing measured
"""
)
@click.option(
    "--model",
    default="lenet300",
    show_default=True,
    help=f"Zoo name ({', '.join(available())}) or pkg.module:Class (a class or a factory).",
)
@click.option("--model-kwargs", default=None, metavar="JSON", help="Constructor kwargs (JSON).")
@click.option("--data", default="digits", show_default=True, metavar="SPEC", help=SPECS_HELP + ".")
@click.option(
    "--batch-size",
    type=int,
    default=256,
    show_default=True,
    help="GLOBAL batch of one step, split across the N workers (train's --batch-size is per "
    "worker: the global batch is --workers times it).",
)
@click.option(
    "--bandwidth",
    default=None,
    metavar="RATE",
    help="Link bandwidth, e.g. 10GB/s, 1.25GiB/s, 100Gb/s (bits) [default: measured].",
)
@click.option(
    "--latency",
    default=None,
    metavar="TIME",
    help="Link latency per message, e.g. 20us, 1.5ms [default: measured].",
)
@click.option(
    "--links-from",
    default=None,
    metavar="PLAN.json",
    help="Take the links an earlier `compress plan --json` measured instead of measuring.",
)
@click.option(
    "--compute",
    default=None,
    metavar="TIME",
    help="Forward+backward+update of the global batch on one worker, e.g. 120ms "
    "[default: measured here, per-step constant and per-sample time apart].",
)
@click.option(
    "--model-bytes",
    default=None,
    metavar="SIZE",
    help="Gradient bytes per step, e.g. 100MB [default: 4 x the model's parameters].",
)
@click.option(
    "--activation-bytes",
    default=None,
    metavar="SIZE",
    help="Pipeline: bytes per sample at a stage boundary [default: from one forward pass].",
)
@click.option(
    "--servers",
    type=int,
    default=None,
    metavar="S",
    help="Parameter-server shards [default: ceil(N/2), as compress train].",
)
@click.option(
    "--stages",
    type=int,
    default=None,
    metavar="K",
    help="Pipeline stages; N/K replicas [default: K = N, a pure pipeline].",
)
@click.option(
    "--microbatches",
    type=int,
    default=8,
    show_default=True,
    metavar="M",
    help="Pipeline: micro-batches per step (GPipe bubble (K-1)/(M+K-1)).",
)
@click.option("--max-workers", type=int, default=64, show_default=True, help="Plan N = 1 to this.")
@click.option(
    "--threads",
    type=int,
    default=0,
    show_default=True,
    help="Threads of one worker while its compute is measured (0: all cores).",
)
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default="adam", show_default=True)
@click.option(
    "--plot",
    "plot_path",
    type=OutPath(dir_okay=False, path_type=Path),
    default=None,
    help="Write speed-up against N per strategy: a .png, .svg or .pdf file.",
)
@click.option("--force", is_flag=True, help="Replace an existing --plot file.")
@json_option
@log_option
def plan(
    model: str,
    model_kwargs: str | None,
    data: str,
    batch_size: int,
    bandwidth: str | None,
    latency: str | None,
    links_from: str | None,
    compute: str | None,
    model_bytes: str | None,
    activation_bytes: str | None,
    servers: int | None,
    stages: int | None,
    microbatches: int,
    max_workers: int,
    threads: int,
    optimizer: str,
    plot_path: Path | None,
    force: bool,
    as_json: bool,
) -> None:
    """Predict step time, speed-up and efficiency for N = 1..64 workers (alpha-beta model)."""
    if plot_path is not None:
        from compresskit.models.fileio import check_plot_path, check_writable

        check_plot_path(plot_path)
        check_writable(plot_path, "--plot", replace=force)  # a .pt named by mistake was lost
    result = make_plan(
        PlanRequest(
            model=model,
            model_kwargs=parse_kwargs(model_kwargs),
            data=data,
            batch=batch_size,
            bandwidth=bandwidth,
            latency=latency,
            links_from=links_from,
            compute=compute,
            model_bytes=model_bytes,
            activation_bytes=activation_bytes,
            servers=servers,
            stages=stages,
            microbatches=microbatches,
            max_workers=max_workers,
            threads=threads,
            optimizer=optimizer,
        )
    )
    if plot_path is not None:
        write_plot(result, plot_path)
    if as_json:
        emit_json({**result.to_dict(), "plot": str(plot_path) if plot_path else None})
    else:
        show(result)
        if plot_path is not None:
            click.echo(f"plot: {plot_path}")


# ---- rendering ------------------------------------------------------------------------------


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _ms(s: float) -> str:
    ms = 1e3 * s
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def _time(s: float) -> str:
    if s < 1e-3:
        return f"{1e6 * s:.3g} us"
    return f"{1e3 * s:.3g} ms"


def header_lines(p: Plan) -> list[str]:
    w, m = p.workload, p.measured
    threads = m.get("compute", {}).get("threads")
    total = _ms(w.compute_s(w.batch))
    if threads:
        compute = (
            f"compute, batch {w.batch} on 1 worker ({threads} thread(s)): {total} ms = "
            f"{_ms(w.fixed_s)} ms + {1e3 * w.sample_s:.3g} ms/sample; "
            f"update {_ms(w.update_s)} ms"
        )
    else:
        compute = f"compute, batch {w.batch} on 1 worker: {total} ms (given)"
    how = m.get("link", {})
    if how.get("how", "").startswith("given"):
        source = "given"
    elif how.get("how", "").startswith("from "):
        source = how["how"]
    else:
        source = "measured: gloo, 2 ranks"
        if how.get("gap_s"):
            source += f", {1e3 * how['gap_s']:.2g} ms compute between exchanges"
        if how.get("given"):
            source += f"; {', '.join(how['given'])} given"
    model = f"model {m.get('model')}" if "parameters" in m else "model"
    if "parameters" in m:
        model += f" ({m['parameters']:,} parameters)"
    return [
        f"{model}: {_bytes(w.model_bytes)} of gradients per step; "
        f"activations {_bytes(w.activation_bytes)} per sample",
        compute,
        *link_lines(p, source),
        "parameter server: "
        + (f"S = {p.servers} shards" if p.servers else "S = ceil(N/2) shards")
        + "; pipeline: "
        + (f"K = {p.stages} stages, N/K replicas" if p.stages else "K = N stages")
        + f", {p.microbatches} micro-batches",
    ]


def link_lines(p: Plan, source: str) -> list[str]:
    """One line for a single link; two where the all-reduce has its own."""

    def words(link) -> str:
        return f"latency {_time(link.alpha_s)}, bandwidth {_bytes(link.beta_bytes_per_s)}/s"

    if p.allreduce_link == p.link:
        return [f"link: {words(p.link)} ({source})"]
    return [
        f"link, send/recv (parameter server, pipeline): {words(p.link)} ({source})",
        f"link, all-reduce (ring): {words(p.allreduce_link)}",
    ]


def table(p: Plan) -> Table:
    """Rows N = 1, 2, 4, ...; per strategy the step in ms and speed-up with efficiency."""
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    t.add_column("N", justify="right")
    for name in STRATEGIES:
        t.add_column("\nms", justify="right")
        t.add_column(f"{SHORT[name]}\nspeed-up eff", justify="right")
    sat = p.saturation()
    for row in p.rows(p.table_workers()):
        cells = [str(row["workers"])]
        for name in STRATEGIES:
            r = row[name]
            if r is None:
                cells += ["-", "n/a "]
                continue
            mark = "*" if sat[name] and sat[name]["workers"] == row["workers"] else " "
            cells += [_ms(r["step_ms"] / 1e3), f"{r['speedup']:.2f}x {r['efficiency']:>4.0%}{mark}"]
        t.add_row(*cells)
    return t


def saturation_lines(p: Plan) -> list[str]:
    out = []
    for name, s in p.saturation().items():
        label = LABELS[name]
        if s is None:
            out.append(f"{label}: applies at no N (see --stages, --microbatches, --batch-size)")
            continue
        line = (
            f"{label}: saturates at N = {s['workers']} ({_ms(s['step_ms'] / 1e3)} ms, "
            f"{s['speedup']:.2f}x, {s['efficiency']:.0%} efficient)"
        )
        if s["still_gaining"]:
            line += (
                f" within N <= {p.max_workers}, and still gaining at N = {p.max_workers}: "
                "try a larger --max-workers"
            )
        elif s["limited"]:
            line += "; the most workers it applies to here"
        elif s["workers"] < p.max_workers:
            line += "; more workers gain < 1%"
        out.append(line)
    return out


def show(p: Plan) -> None:
    console = render.out_console()
    for line in header_lines(p):
        console.print(line)
    console.print(table(p))
    console.print(
        "ms: predicted time of one step of the global batch; speed-up against 1 worker "
        "without communication; eff = speed-up / N; * the saturation point (the fewest "
        "workers within 1% of the best step); n/a: the strategy does not apply (fewer "
        "samples than workers, N not a multiple of K, more stages than layers)."
    )
    for line in saturation_lines(p):
        console.print(line)


def _figure(p: Plan):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2), dpi=120)
    ax = fig.subplots()
    ns = list(range(1, p.max_workers + 1))
    ax.plot(ns, ns, color="0.7", linestyle="--", linewidth=1, label="ideal (speed-up = N)")
    sat = p.saturation()
    for name in STRATEGIES:
        curve = p.curves[name]
        ys = [curve.speedup(n) for n in ns]
        ys = [math.nan if y is None else y for y in ys]
        (line,) = ax.plot(ns, ys, marker=".", markersize=3, label=LABELS[name])
        s = sat[name]
        if s is not None:
            ax.plot(
                [s["workers"]],
                [s["speedup"]],
                marker="o",
                markersize=9,
                fillstyle="none",
                color=line.get_color(),
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers N")
    ax.set_ylabel("predicted speed-up")
    top = max(
        (y for c in p.curves.values() for y in map(c.speedup, ns) if y is not None), default=1
    )
    ax.set_ylim(0, max(2.0, 1.15 * top))
    ax.set_title(f"{p.measured.get('model', 'model')}: speed-up vs N (circles: saturation)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def write_plot(p: Plan, path: Path) -> Path:
    """The speed-up curves as the PNG, SVG or PDF the path's suffix names, written atomically."""
    from compresskit.models.fileio import atomic_path, check_plot_path

    fig = _figure(p)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=check_plot_path(path))
    return path
