"""The shrink report as Markdown in the paper's layout (Han, Mao & Dally 2016, Tables 1-2),
and its plots: a layer's weight histogram with the k-means centroids (the paper's Fig. 4/5)
and the fraction of weights kept per layer. Everything is drawn from the plain-data report,
so `report.json` alone can reproduce the figures."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from compressor import recipe as recipe_mod
from models.fileio import atomic_path

STAGE_NAMES = {"prune": "P", "quantize": "P+Q", "huffman": "P+Q+H"}


def _kb(n: int) -> str:
    return f"{n / 1000:.1f} KB"


def markdown(report: dict[str, Any], title: str = "compress shrink") -> str:
    base = report["baseline"]
    lines = [f"# {title}", ""]
    if "data" in report:
        d = report["data"]
        lines += [
            f"Data `{d['spec']}`: {d['train']:,} train / {d['val']:,} validation / "
            f"{d['test']:,} test samples. Decisions (sensitivity, the INT8 floor) are judged on "
            f"the {d['decisions']}; accuracy below is on the test split.",
            "",
        ]
    if report.get("student", {}).get("distilled"):
        t, st = report["teacher"], report["student"]
        lines += [
            f"Distilled a {t['parameters']:,}-parameter teacher `{t['name']}` "
            f"({t['test_accuracy']:.2%}, {t['members']} model(s)) into `{st['name']}`, "
            f"{st['parameters']:,} parameters ({st['dense_test_accuracy']:.2%}); Deep "
            "Compression below starts from that student.",
            "",
        ]
        if "hint" in report:
            h = report["hint"]
            lines += [
                f"FitNets hint: student `{h['student_layer']}` regressed onto teacher "
                f"`{h['teacher_layer']}` for {h['epochs']} epoch(s), hint loss "
                f"{h['loss_before']:.4f} -> {h['loss_after']:.4f}.",
                "",
            ]
        if "transfer" in report:
            tr = report["transfer"]
            lines += [
                f"Transfer set ({tr['kind']}): {tr['examples']:,} examples; {tr['labelled']:,} "
                f"kept their labels, {tr['teacher_labelled']:,} ({tr['synthetic']:,} synthetic) "
                "were labelled by the teacher.",
                "",
            ]
    lines += _channel_lines(report)
    lines += _budget_lines(report)
    lines += [
        "| stage | bytes | compression | test accuracy | Δ accuracy (points) "
        "| paired 95% interval | test samples gained / lost |",
        "|---|---|---|---|---|---|---|",
        f"| FP32 dense | {_kb(base['bytes'])} | 1× | {base['test_accuracy']:.2%} | | | |",
    ]
    for st in report["stages"]:
        delta = 100 * (st["test_accuracy"] - base["test_accuracy"])
        size = f"{_kb(st['bytes'])} | {st['ratio']:.1f}×" if "bytes" in st else "– | –"
        c = st.get("change")
        paired = (
            f"[{c['ci_points'][0]:+.2f}, {c['ci_points'][1]:+.2f}] | {c['gained']} / {c['lost']}"
            if c
            else "| "
        )
        lines.append(
            f"| {STAGE_NAMES.get(st['name'], st['name'])} | {size} | "
            f"{st['test_accuracy']:.2%} | {delta:+.2f} | {paired} |"
        )
    if any("change" in st for st in report["stages"]):
        lines += [
            "",
            "The interval is a paired bootstrap over the test samples (2,000 resamples); gained "
            "/ lost count the samples only the stage / only the dense model gets right "
            "(McNemar's discordant pairs). An interval holding 0 is a change the test set cannot "
            "tell from noise.",
        ]
    if "archive" in report:
        a = report["archive"]
        lines += [
            "",
            f"Archive `{Path(a['path']).name}`: {a['bytes']:,} bytes "
            f"({a['ratio']:.1f}×), header {a['header_bytes']} bytes; order-0 entropy bound "
            f"{a['entropy_bound_bytes']:,} bytes: the archive is {a['vs_entropy_bound']:.4f}× "
            "the bound. It decodes to the compressed model bit for bit (checked).",
        ]
    lines += _onnx_lines(report)
    lines += [
        "",
        "## Per layer",
        "",
        "| layer | weights | kept | weight bits (P+Q) | weight bits (P+Q+H) | index bits (P+Q) "
        "| index bits (P+Q+H) | gap width | size (P+Q+H) | stored as |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["layers"]:
        lines.append(_layer_line(r))
    lines += [
        "",
        "Bits are per kept weight; index bits are the relative-index (gap) code, escapes "
        "included. Size is the layer's archive record against its FP32 dense bytes. A shared "
        "layer is stored dense where that record is smaller (both are encoded and measured).",
        "",
        "## Recipe",
        "",
        "```toml",
        recipe_mod.dumps(report["recipe"]).rstrip(),
        "```",
        "",
    ]
    return "\n".join(lines)


def _budget_lines(report: dict[str, Any]) -> list[str]:
    b = report.get("budget")
    if not b:
        return []
    won = b["trials"][b["chosen_trial"] - 1]
    verdict = (
        "within the budget"
        if b["met"]
        else "**over the budget: no trial met it; the one whose mean probability of the right "
        "class dropped least is kept**"
    )
    lines = [
        f"## Accuracy budget: at most {b['max_drop']:g} points",
        "",
        f"Validation split: {b['validation_samples']:,} samples, so at most "
        f"{b['allowed_lost']} may be lost. Each layer's curve ({len(b['grid']['sparsities'])} "
        f"sparsities × {len(b['grid']['bits'])} bit widths, that layer alone, no retraining) "
        f"fed an exact allocation over {b['frontier_points']} frontier points; "
        f"{len(b['trials'])} full shrink runs (with retraining) were tried along it. Kept: "
        f"trial {b['chosen_trial']}, validation drop {b['val_drop']:+.2f} points measured "
        f"({won['lost']} samples, paired 95% interval [{won['val_drop_interval'][0]:+.2f}, "
        f"{won['val_drop_interval'][1]:+.2f}]; the curves predicted "
        f"{b['predicted_drop']:.2f} before retraining; the mean probability of the right class "
        f"dropped {b['val_soft_drop']:+.2f} points), {verdict}. A trial is within the budget "
        "when both drops are: top-1 on few samples can pass by luck, its smooth counterpart "
        "far less often. An interval wider than the budget says the validation split cannot "
        "resolve it. The recipe below re-runs the kept trial without the search.",
        "",
        "| trial | predicted drop (curves) | validation drop (retrained) | paired 95% interval "
        "| mean p(right class) drop | archive bytes | within |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in b["trials"]:
        lo, hi = t["val_drop_interval"]
        lines.append(
            f"| {t['trial']} | {t['predicted_drop']:.2f} | {t['val_drop']:+.2f} | "
            f"[{lo:+.2f}, {hi:+.2f}] | {t['val_soft_drop']:+.2f} | {t['archive_bytes']:,} | "
            f"{'yes' if t['within_budget'] else 'no'} |"
        )
    lines += ["", "| layer | sparsity | bits | samples lost alone | record bytes (curve) |"]
    lines.append("|---|---|---|---|---|")
    for name, r in b["layers"].items():
        lines.append(
            f"| {name} | {r['sparsity']:g} | {r['bits']} | {r['lost_alone']} | {r['bytes']:,} |"
        )
    return [*lines, ""]


def _channel_lines(report: dict[str, Any]) -> list[str]:
    c = report.get("channels")
    if not c:
        return []
    (m0, m1), (p0, p1), (a0, a1) = c["macs"], c["parameters"], c["test_accuracy"]
    lines = [
        "## Channels removed (structured pruning)",
        "",
        f"MACs per sample {m0:,} -> {m1:,} ({m1 / m0:.0%}, target {c['target_macs']:.0%}"
        f"{'' if c['reached'] else ', not reached: channels.max_ratio and the layers kept whole limit the cut'}); "
        f"parameters {p0:,} -> {p1:,}; test accuracy {a0:.2%} -> {a1:.2%} after "
        f"{len(c['rounds'])} round(s) with retraining. Kept whole: {', '.join(c['ignored'])}. "
        "The tables below start from the thinned model",
    ]
    if "archive_ratio_vs_original" in c:
        lines[-1] += (
            f"; against the original FP32 model the archive is "
            f"{c['archive_ratio_vs_original']:.1f}× smaller"
        )
    lines[-1] += "."
    cut = [r for r in c["layers"] if r["after"] != r["before"]]
    if cut:
        lines += ["", "| layer | channels before | after |", "|---|---|---|"]
        lines += [f"| {r['name']} | {r['before']} | {r['after']} |" for r in cut]
    return [*lines, ""]


def _layer_line(r: dict[str, Any]) -> str:
    def num(key: str, fmt: str) -> str:
        return format(r[key], fmt) if key in r else "–"

    huff = "weight_bits_huffman" in r
    cells = [
        r.get("layer", r["name"]),
        f"{r['weights']:,}",
        f"{r['kept_fraction']:.1%}",
        str(r["weight_bits"]),
        num("weight_bits_huffman", ".2f"),
        f"{r['index_bits']:.2f}",
        num("index_bits_huffman", ".2f"),
        str(r["gap_bits"]) if huff else "–",
        num("size_fraction", ".2%"),
        r.get("encoding_reason", "–"),
    ]
    return "| " + " | ".join(cells) + " |"


def _onnx_lines(report: dict[str, Any]) -> list[str]:
    if "onnx" not in report:
        return []
    lines = [
        "",
        "## ONNX",
        "",
        "| file | bytes | test accuracy | top-1 agreement with PyTorch | max abs Δ logit "
        "| pruned zeros and ≤ 2^bits values kept | opset / IR | loads in ONNX Runtime |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for o in report["onnx"].values():
        lines.append(
            f"| `{Path(o['path']).name}` | {o['bytes']:,} | {o['test_accuracy']:.2%} | "
            f"{o['top1_agreement']:.2%} | {o['max_abs_diff']:.4g} | "
            f"{'yes' if o['weights_ok'] else 'NO'} | "
            f"{o['opsets'].get('ai.onnx')} / {o['ir_version']} | ≥ {o['min_ort']} |"
        )
    int8 = report["onnx"].get("int8") or report.get("int8_not_written")
    if int8:
        lines += [
            "",
            f"INT8 chosen for target `{int8['target']}` ({int8['scheme']}, reduce_range "
            f"{str(int8['reduce_range']).lower()}), decided on the "
            f"{'file as written (reference semantics)' if int8['decided_on'] == 'reference' else 'optimized kernels of this host'}"
            f": {int8['int8_nodes']} of {int8['quantizable_nodes']} nodes in INT8, top-1 "
            f"agreement {int8['check_agreement']:.2%} on {_checked_on(int8)} "
            f"(floor {int8['min_agreement']:.2%}).",
        ]
        lat = int8.get("latency_ms_batch1")
        if lat:
            lines.append(
                f"Batch-1 latency on ORT CPU (1 thread): FP32 {lat['fp32']:.3f} ms, "
                f"shipped INT8 {lat['int8']:.3f} ms."
            )
        if int8["fp32_nodes"]:
            lines += ["Kept in FP32:"] + [
                f"- `{n}`: {why}" for n, why in int8["fp32_nodes"].items()
            ]
        else:
            lines.append("Every quantizable node runs in INT8.")
        if "reason" in int8:
            lines.append(
                f"**No INT8 file was written** ({int8['reason']}): ship `student.fp32.onnx`."
            )
        else:
            h = int8["host_kernels"]
            lines.append(
                "Figures above are the file as written (ONNX Runtime with graph optimizations "
                "off, what onnxruntime-web computes). On this CPU's optimized kernels: top-1 "
                f"agreement with FP32 {h['top1_agreement_fp32']:.2%}, max abs Δ "
                f"{h['max_abs_diff_fp32']:.4g}"
                + (
                    " — an x86 CPU with AVX2 but no VNNI, whose u8s8 kernels can saturate; "
                    "a phone's kernels do not."
                    if h["saturating_cpu"]
                    else "."
                )
            )
    if "mobile" in report:
        m, o = report["mobile"], report["ort"]
        lines += [
            "",
            f"Mobile (`check_onnx_model_mobile_usability`): NNAPI {m['nnapi']}, CoreML "
            f"{m['coreml']}. `{Path(o['path']).name}`: {o['bytes']:,} bytes, answers like "
            f"the .onnx (max abs Δ {o['max_abs_diff']:.2g}).",
        ]
    return lines


def plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write weights_histogram.png, kept_per_layer.png and (after the channels stage)
    channels_per_layer.png; return their paths."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    h = report.get("histogram")
    if h:
        fig, ax = plt.subplots(figsize=(7, 3.6))
        edges, counts = h["edges"], h["counts"]
        ax.stairs(counts, edges, fill=True, alpha=0.6, label="non-zero weights before sharing")
        top = max(counts) if counts else 1
        ax.vlines(h["centroids_init"], 0, top * 0.15, colors="grey", label="linear init")
        ax.vlines(h["centroids"], 0, top * 0.3, colors="crimson", label="fine-tuned centroids")
        ax.set(title=f"{h['layer']}: weights and shared values", xlabel="weight", ylabel="count")
        ax.legend(fontsize=8)
        written.append(save_figure(fig, out_dir / "weights_histogram.png"))
        plt.close(fig)
    c = report.get("channels")
    if c:
        rows = c["layers"]
        fig, ax = plt.subplots(figsize=(7, 0.5 + 0.3 * len(rows)))
        names = [r["name"] for r in rows]
        ax.barh(names, [r["before"] for r in rows], color="lightgrey", label="before")
        ax.barh(names, [r["after"] for r in rows], color="seagreen", label="kept")
        ax.set(xlabel="output channels", title="Channels kept per layer (structured pruning)")
        ax.invert_yaxis()
        ax.legend(fontsize=8)
        written.append(save_figure(fig, out_dir / "channels_per_layer.png"))
        plt.close(fig)
    rows = report["layers"]
    if rows:
        fig, ax = plt.subplots(figsize=(7, 0.5 + 0.4 * len(rows)))
        names = [r["name"] for r in rows]
        ax.barh(names, [100 * r["kept_fraction"] for r in rows], color="steelblue")
        for i, r in enumerate(rows):
            ax.text(
                100 * r["kept_fraction"] + 1,
                i,
                f"{r['kept_fraction']:.0%}",
                va="center",
                fontsize=8,
            )
        ax.set(xlim=(0, 110), xlabel="weights kept (%)", title="Weights kept per layer")
        ax.invert_yaxis()
        written.append(save_figure(fig, out_dir / "kept_per_layer.png"))
        plt.close(fig)
    return written


def save_figure(fig, path: Path) -> Path:
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    return path


def _checked_on(int8: dict[str, Any]) -> str:
    """What the INT8 floor was checked on, for a sentence ("the validation split, 143 ...")."""
    c = int8.get("checked_on")
    if c is None:  # a report written before the validation split
        return "held-out training inputs"
    if c["split"] == "validation":
        return f"{c['samples']:,} validation inputs"
    return f"{c['samples']:,} inputs ({c['source']})"
