"""The shrink report as Markdown in the paper's layout (Han, Mao & Dally 2016, Tables 1-2),
and its plots: a layer's weight histogram with the k-means centroids (the paper's Fig. 4/5)
and the fraction of weights kept per layer. Everything is drawn from the plain-data report,
so `report.json` alone can reproduce the figures."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from compresskit.compressor import recipe as recipe_mod
from compresskit.compressor.guard import recorded_recipe
from compresskit.models.fileio import atomic_path

STAGE_NAMES = {"prune": "P", "quantize": "P+Q", "huffman": "P+Q+H"}
_RANK = {"no": 0, "partial": 1, "yes": 2}


def _fell(points: float) -> str:
    """A change in points as words: "fell 0.16 points", "rose 0.16 points", not "dropped -0.16"."""
    if points == 0:
        return "did not move"
    return f"{'fell' if points > 0 else 'rose'} {abs(points):.2f} points"


def node_counts(counts: dict[str, int]) -> str:
    """{op type: count} in words: "2 ConvTranspose, 1 LSTM"."""
    return ", ".join(f"{n} {op}" for op, n in counts.items())


def table_counts(tables: dict[str, int]) -> str:
    """{initializer: elements} in words: "tokens.weight (64,000)"."""
    return ", ".join(f"{name} ({n:,})" for name, n in tables.items())


def lstm_line(lstms: dict[str, int]) -> str:
    """The INT8 file's LSTMs in 8 bits, for the summary and report.md."""
    weights = sum(lstms.values())
    nodes = "LSTM node" if len(lstms) == 1 else "LSTM nodes"
    return (
        f"{len(lstms)} {nodes} as DynamicQuantizeLSTM, int8 weights ({weights:,}), "
        "activations quantized as they run"
    )


def _kb(n: int) -> str:
    return f"{n / 1000:.1f} KB"


def _cost_lines(report: dict[str, Any]) -> list[str]:
    """What the run cost: seconds (training apart) and the process's peak memory."""
    t = report.get("timings")
    if not t:
        return []
    said = f"{t['total']:.1f} s, of which training {t['training']:.1f} s"
    steps = sorted(
        ((k, v) for k, v in t.items() if k not in _TOTALS and v >= 0.05), key=lambda kv: -kv[1]
    )
    if steps:
        said += "; by step: " + ", ".join(f"{k} {v:.1f} s" for k, v in steps)
    peak = (report.get("memory") or {}).get("peak_rss_bytes")
    if peak:
        said += f". Peak resident memory {peak / 2**20:,.0f} MiB"
    said += "."
    if resumed := report.get("resumed"):  # the seconds are this run's, not the stopped one's
        said += (
            f" This run resumed after {resumed['from']}: these seconds, and the stages', are "
            "its own; the work before it is not counted."
        )
    return ["## Cost", "", said, ""]


_TOTALS = ("training", "non_training", "data_passes", "per_weight", "total")


def markdown(
    report: dict[str, Any],
    title: str = "compress shrink",
    plots: Iterable[str | Path] | None = None,
) -> str:
    """The report as Markdown. `plots`: the plot files to link, relative to report.md's
    folder; by default the ones `plots()` writes for this report (`plot_names`)."""
    base = report["baseline"]
    lines = [f"# {title}", ""]
    env = report.get("environment")
    if env:  # what the bytes may depend on (README, "ONNX and INT8")
        flags = ", ".join(f for f, on in env.get("cpu_flags", {}).items() if on) or "none listed"
        lines += [
            f"Built on {env.get('cpu_model')} ({flags}), {env.get('usable_cores')} of "
            f"{env.get('logical_cores')} cores usable, {env.get('torch_threads')} torch threads; "
            f"torch {env.get('versions', {}).get('torch')}, onnxruntime "
            f"{env.get('versions', {}).get('onnxruntime')}.",
            "",
        ]
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
        params = st.get("distilled_parameters", st["parameters"])
        acc = st.get("distilled_test_accuracy", st["dense_test_accuracy"])
        then = (
            "channel pruning thins it, and Deep Compression starts from the thinned student"
            if report.get("channels")
            else "Deep Compression below starts from that student"
        )
        lines += [
            f"Distilled a {t['parameters']:,}-parameter teacher `{t['name']}` "
            f"({t['test_accuracy']:.2%}, {t['members']} model(s)) into `{st['name']}`, "
            f"{params:,} parameters ({acc:.2%}); {then}.",
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
    if note := no_archive_note(report):
        lines += ["", note[0].upper() + note[1:] + "."]
    # format 2 codes gaps after a header; format 3 a mask of kept positions, in one stream
    gaps = (recorded_recipe(report).get("huffman") or {}).get("coder") == "huffman"
    if "archive" in report:
        a = report["archive"]
        outside = (
            f"header {a['header_bytes']} bytes"
            if gaps
            else f"{a['header_bytes']} of them outside the coded stream (header, directory, "
            "framing)"
        )
        lines += [
            "",
            f"Archive `{Path(a['path']).name}`: {a['bytes']:,} bytes "
            f"({a['ratio']:.1f}×), {outside}; at order-0 entropy it would be "
            f"{a['entropy_bound_bytes']:,} bytes: the archive is {a['vs_entropy_bound']:.4f}× "
            f"that ({_vs_bound(a['vs_entropy_bound'])}). It decodes to the compressed model bit "
            "for bit (checked).",
        ]
    lines += _onnx_lines(report)
    lines += _mobile_lines(report)
    lines += [
        "",
        "## Per layer",
        "",
        "| layer | weights | kept | weight bits (P+Q) | weight bits (P+Q+H) | index bits (P+Q) "
        "| index bits (P+Q+H) | gap width | size (P+Q+H) | stored as |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["layers"]:
        lines.append(_layer_line(r, gaps))
    index_code = (
        "the relative-index (gap) code, escapes included"
        if gaps
        else "the code of which positions are kept (format 3 codes a mask of kept positions: "
        "no gaps, so no gap width)"
    )
    lines += [
        "",
        f"Bits are per kept weight; index bits are {index_code}. Size is the layer's archive "
        "record against its FP32 dense bytes. A shared layer is stored dense where that record is smaller (both priced, each coded alone "
        "with the range coder's final flush, so up to 4 bytes over its share of the archive; "
        "the dense one estimated, marked ≈, where it is plainly the larger).",
        "",
        *([tied_note(report) + ".", ""] if report.get("tied") else []),
        *([uncovered_note(report) + ".", ""] if report.get("uncovered") else []),
        *_sensitivity_lines(report),
        *_plot_lines(report, plots),
        *_cost_lines(report),
        "## Recipe",
        "",
        "```toml",
        recipe_mod.dumps(report["recipe"]).rstrip(),
        "```",
        "",
    ]
    return "\n".join(lines)


def sensitivity_note(report: dict[str, Any]) -> str:
    """One line on what `--sparsity auto` proposed ("" without the analysis): how many layers
    it prunes and at what sparsities, and what to change when it prunes none."""
    sens = report.get("sensitivity")
    if not sens or not sens.get("proposal"):
        return ""
    proposal = sens["proposal"]
    cut = {n: s for n, s in proposal.items() if s > 0}
    budget = report["recipe"]["prune"]["budget"]
    head = (
        f"--sparsity auto (sensitivity analysis, prune.budget {budget:g} of validation "
        f"accuracy per layer cut alone): "
    )
    if not cut:
        return head + (
            f"no layer of {len(proposal)} could lose even the grid's smallest cut within the "
            "budget, so nothing is pruned; raise prune.budget, or give --sparsity"
        )
    lo, hi = min(cut.values()), max(cut.values())
    span = f"{lo:.2f}" if lo == hi else f"{lo:.2f}-{hi:.2f}"
    whole = len(proposal) - len(cut)
    return (
        head
        + f"{len(cut)} of {len(proposal)} layers pruned at {span}"
        + (f", {whole} kept whole" if whole else "")
    )


def _vs_bound(ratio: float) -> str:
    """What the archive's ratio to its streams' order-0 entropy says."""
    if ratio < 1:
        return "below 1: context models beat order 0"
    if round(ratio, 4) == 1:
        return "at the bound"
    return "above 1: what codebooks, dense tensors and framing add to the streams' bound"


def _dense_as(report: dict[str, Any]) -> str:
    """How the recipe stores tensors it does not share: "float16" or "float32"."""
    return (report.get("recipe") or {}).get("quantize", {}).get("dense", "float16")


def _uncovered_label(row: dict[str, Any]) -> str:
    # A layer reads by its module ("rnn (LSTM, 1,536)"); the model's own bare parameters by
    # their names ("pos_embed, cls_token (MyNet, 9)"), not as "(model)".
    keys = row.get("parameters") or []
    name = ", ".join(keys) if row["module"] == "(model)" and keys else row["module"]
    return f"{name} ({row['type']}, {row['weights']:,})"


def uncovered_note(report: dict[str, Any]) -> str:
    """One line naming the weight matrices no stage compresses ("" when none)."""
    rows = report.get("uncovered")
    if not rows:
        return ""
    total = sum(r["weights"] for r in rows)
    share = total / max(report["baseline"]["parameters"], 1)
    names = ", ".join(_uncovered_label(r) for r in rows[:6])
    more = f" and {len(rows) - 6} more" if len(rows) > 6 else ""
    embedding = any(r["type"] == "Embedding" for r in rows)
    # A BERT-Tiny's 30,522-token table is 91% of its weights: shared at the recipe's bits
    # (quantize.embeddings), its archive went from 6.75 MB to 2.28 MB (docs/benchmarks.md).
    how = (
        "; embeddings with quantize.embeddings = true (shared, not pruned) or "
        "prune.embeddings = true (pruned too)"
        if embedding
        else ""
    )
    return (
        f"stored dense ({_dense_as(report)}), {total:,} weights ({share:.0%} of the model) in "
        f"layers pruning and sharing do not cover (Linear, Conv, ConvTranspose, LSTM/GRU/RNN, "
        f"MultiheadAttention{how}): {names}{more}"
    )


def no_archive_note(report: dict[str, Any]) -> str | None:
    """Why a run wrote no .dcz, when its recipe turned Huffman coding off (the other files a
    run leaves out say why too); else None."""
    huffman = recorded_recipe(report).get("huffman") or {}
    if "archive" in report or huffman.get("enabled", True):
        return None
    return (
        "no archive written: [huffman] enabled = false; the compressed weights are in the "
        "checkpoint (and the ONNX files), the per-layer P+Q+H columns stay empty"
    )


def tied_note(report: dict[str, Any]) -> str:
    """One line naming the weights left dense because they are tied ("" when none)."""
    groups = report.get("tied")
    if not groups:
        return ""
    names = "; ".join(" = ".join(g) for g in groups)
    return (
        f"stored dense ({_dense_as(report)}), tied (one tensor under several names, which "
        f"pruning or sharing each layer on its own would untie): {names}"
    )


def _sensitivity_lines(report: dict[str, Any]) -> list[str]:
    note = sensitivity_note(report)
    if not note:
        return []
    proposal = report["sensitivity"]["proposal"]
    return [
        note + ".",
        "",
        "| layer | proposed sparsity |",
        "|---|---|",
        *(f"| {n} | {s:.2f} |" for n, s in proposal.items()),
        "",
    ]


def budget_summary(b: dict[str, Any]) -> tuple[str, str]:
    """(how the kept trial was found, its per-layer settings) of a budget record, one line
    each, for the CLI's and the benchmarks' summaries."""
    won = b["trials"][b["chosen_trial"] - 1]
    how = (
        f"kept fractions ×{won['scale']:.3g} of the recipe's"
        if b.get("search") == "scale"
        else f"{won['predicted_drop']:.2f} predicted before retraining"
    )
    layers = ", ".join(
        f"{n} {r['sparsity']:g}" + (f"/{r['bits']}b" if r["bits"] else "")
        for n, r in b["layers"].items()
    )
    return how, layers


def _budget_lines(report: dict[str, Any]) -> list[str]:
    b = report.get("budget")
    if not b:
        return []
    won = b["trials"][b["chosen_trial"] - 1]
    scale = b.get("search") == "scale"
    verdict = (
        "within the budget"
        if b["met"]
        else "**over the budget: no trial met it; the one whose mean probability of the right "
        "class dropped least is kept**"
    )
    lo, hi = won["val_drop_interval"]
    measured = (
        f"validation drop {b['val_drop']:+.2f} points measured ({won['lost']} samples, paired "
        f"95% interval [{lo:+.2f}, {hi:+.2f}]; "
        + ("" if scale else f"the curves predicted {b['predicted_drop']:.2f} before retraining; ")
        + f"the mean probability of the right class {_fell(b['val_soft_drop'])}), "
        f"{verdict}."
    )
    if scale:
        how = (
            f"The search multiplied every layer's kept fraction of the recipe's sparsities by "
            f"{b['scale_step']:g}^k and bisected k: {len(b['trials'])} full shrink runs (with "
            f"retraining). Kept: trial {b['chosen_trial']} (kept fractions ×{won['scale']:.3g}), "
        )
    else:
        how = (
            f"Each layer's curve ({len(b['grid']['sparsities'])} sparsities × "
            f"{len(b['grid']['bits'])} bit widths, that layer alone, no retraining) fed an "
            f"exact allocation over {b['frontier_points']} frontier points; "
            f"{len(b['trials'])} full shrink runs (with retraining) were tried along it. Kept: "
            f"trial {b['chosen_trial']}, "
        )
    lines = [
        f"## Accuracy budget: at most {b['max_drop']:g} points",
        "",
        f"Validation split: {b['validation_samples']:,} samples, so at most "
        f"{b['allowed_lost']} may be lost. {how}{measured} A trial is within the budget when "
        "both drops "
        "are: top-1 on few samples can pass by luck, its smooth counterpart far less often. An "
        "interval wider than the budget says the validation split cannot resolve it. The "
        "recipe below re-runs the kept trial without the search.",
        "",
        *([f"**Coarse:** {b['coarse']}.", ""] if b.get("coarse") else []),
        *([f"**Note:** {b['method_note']}.", ""] if b.get("method_note") else []),
        f"| trial | {'kept fractions ×' if scale else 'predicted drop (curves)'} | validation "
        "drop (retrained) | paired 95% interval | mean p(right class) drop | archive bytes | "
        "within |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in b["trials"]:
        lo, hi = t["val_drop_interval"]
        first = f"{t['scale']:.3g}" if scale else f"{t['predicted_drop']:.2f}"
        lines.append(
            f"| {t['trial']} | {first} | {t['val_drop']:+.2f} | "
            f"[{lo:+.2f}, {hi:+.2f}] | {t['val_soft_drop']:+.2f} | {t['archive_bytes']:,} | "
            f"{'yes' if t['within_budget'] else 'no'} |"
        )
    if scale:
        lines += ["", "| layer | sparsity | bits |", "|---|---|---|"]
        for name, r in b["layers"].items():
            lines.append(f"| {name} | {r['sparsity']:g} | {r['bits'] or '–'} |")
        return [*lines, ""]
    lines += [
        "",
        "The predicted drop adds each layer's samples lost alone, counting a layer that gained "
        "as 0 (a gain measured on one layer seldom survives the others' losses).",
        "",
        "| layer | sparsity | bits | samples lost alone | record bytes (curve) |",
    ]
    lines.append("|---|---|---|---|---|")
    for name, r in b["layers"].items():
        lines.append(
            f"| {name} | {r['sparsity']:g} | {r['bits']} | {r['lost_alone']} | {r['bytes']:,} |"
        )
    return [*lines, ""]


def _limit(c: dict[str, Any]) -> str:
    """What kept channel pruning short of its target (reports before "limit" was kept)."""
    return c.get("limit") or "channels.max_ratio and the layers kept whole limit the cut"


def _channel_lines(report: dict[str, Any]) -> list[str]:
    c = report.get("channels")
    if not c:
        return []
    (m0, m1), (p0, p1), (a0, a1) = c["macs"], c["parameters"], c["test_accuracy"]
    lines = [
        "## Channels removed (structured pruning)",
        "",
        f"MACs per sample {m0:,} -> {m1:,} ({m1 / m0:.0%}, target {c['target_macs']:.0%}"
        f"{'' if c['reached'] else ', not reached: ' + _limit(c)}); "
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
    sens, fit = c.get("sensitivity"), c.get("latency_model")
    if sens:
        lines += [
            "",
            "Per-layer fractions the sensitivity analysis planned (each layer cut alone and "
            f"measured on the decision data, from {sens['baseline']:.2%}): "
            + ", ".join(f"{n} {f:.0%}" for n, f in sens["ratios"].items() if f > 0)
            + "; the rounds stop at the MACs goal, so a layer may keep more (the widths "
            "above are what the model holds).",
        ]
        short = c["rounds"][-1].get("even_cut_from") if c["rounds"] else None
        if short:
            lines[-1] += (
                f" Those cuts together stopped at {short['macs'] / m0:.0%} of the MACs"
                + (
                    f" and {short['estimated_us'] / fit['estimated_us'][0]:.0%} of the time"
                    if fit
                    else ""
                )
                + " (coupled layers' savings overlap); the last round cut on evenly from there, "
                "up to channels.max_ratio of each layer's width."
            )
    if fit:
        (t0, t1), goal = fit["estimated_us"], fit["target_latency"]
        lines += [
            "",
            f"Time goal (channels.target_latency {goal:.0%}): the {fit['file'].upper()} file at "
            "batch 1 on ORT CPU, 1 thread, profiled per layer before cutting and at half width: "
            f"{t0:.0f} us measured, {t1:.0f} us estimated after ({t1 / t0:.0%}"
            f"{'' if fit['reached'] else ', not reached'}). The cut follows these timings, so "
            "it depends on this machine and its load when measured; channels.target_macs "
            "alone gives the same cut on every run.",
        ]
    lat = c.get("latency")
    if lat and lat.get("rows"):
        lines += [
            "",
            f"Measured ORT CPU latency, p50, {lat['threads']} thread, the four files "
            f"interleaved in one run (CPU flags: {', '.join(lat['cpu_flags']) or 'none listed'}"
            f"; unthinned INT8: {lat['int8_before']}):",
            "",
            "| batch | precision | unthinned ms | thinned ms | speed-up |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['batch']} | {r['precision'].upper()} | {r['before_ms']:.3f} | "
            f"{r['after_ms']:.3f} | {r['speedup']:.2f}× |"
            for r in lat["rows"]
        ]
    elif lat and lat.get("error"):
        lines += ["", f"Latency before and after was not measured: {lat['error']}."]
    heads = [h for h in c.get("heads", []) if h["after"] != h["before"]]
    if heads:
        lines += ["", "| attention | heads before | after |", "|---|---|---|"]
        lines += [f"| {h['name']} | {h['before']} | {h['after']} |" for h in heads]
    cut = [r for r in c["layers"] if r["after"] != r["before"]]
    if cut:
        lines += ["", "| layer | channels before | after |", "|---|---|---|"]
        lines += [f"| {r['name']} | {r['before']} | {r['after']} |" for r in cut]
    return [*lines, ""]


def _layer_line(r: dict[str, Any], gaps: bool = True) -> str:
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
        str(r["gap_bits"]) if huff and gaps else "–",
        num("size_fraction", ".2%"),
        r.get("encoding_reason", "–"),
    ]
    return "| " + " | ".join(cells) + " |"


def sequence_line(inp: dict[str, Any]) -> str:
    """What a token model's ONNX input takes ("" for other models): 1..L tokens on a symbolic
    sequence axis, or a fixed L and why."""
    if "sequence_length" not in inp:
        return ""
    n, name = inp["sequence_length"], inp.get("name", "input")
    if inp.get("sequence") == "dynamic":
        return (
            f"input {name}: 1 to {n} token ids per sequence (a symbolic axis): a short query "
            f"costs its own length, not {n}"
        )
    why = inp.get("fixed_why")
    return f"input {name}: exactly {n} token ids per sequence" + (f" ({why})" if why else "")


def io_lines(o: dict[str, Any]) -> list[str]:
    """What an app feeds every file and reads back: the input's name, type and shape with how
    a raw sample becomes it, and the output's (from the file's metadata; none when unknown)."""
    out = []
    for what, key, about in (("Input", "input", "scaling"), ("Output", "output", "meaning")):
        io = o.get(key)
        if io:
            shape = ", ".join(map(str, io["shape"]))
            text = f"- {what} `{io['name']}`: {io['type']} ({shape})"
            out.append(text + (f": {io[about]}" if io.get(about) else ""))
    return ["", *out] if out else []


def _onnx_lines(report: dict[str, Any]) -> list[str]:
    if "onnx" not in report:
        return []
    lines = [
        "",
        "## ONNX",
        "",
        "| file | bytes | test accuracy | top-1 agreement with PyTorch | max abs Δ logit "
        "| pruned zeros and ≤ 2^bits values per output channel | opset / IR | loads in ONNX "
        "Runtime |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for o in report["onnx"].values():
        lines.append(
            f"| `{Path(o['path']).name}` | {o['bytes']:,} | {o['test_accuracy']:.2%} | "
            f"{o['top1_agreement']:.2%} | {o['max_abs_diff']:.4g} | "
            f"{'yes' if o['weights_ok'] else 'NO'} | "
            f"{o['opsets'].get('ai.onnx')} / {o['ir_version']} | ≥ {o['min_ort']} |"
        )
    lines += io_lines(report["onnx"].get("fp32", {}))
    line = sequence_line(report["onnx"].get("fp32", {}).get("input", {}))
    if line:
        lines += ["", f"{line[0].upper()}{line[1:]}."]
    int8 = report["onnx"].get("int8") or report.get("int8_not_written")
    if int8 and int8.get("failed"):
        fp32 = report["onnx"].get("fp32", {}).get("path", "model.fp32.onnx")
        lines += [
            "",
            f"**No INT8 file was written** ({int8['reason']}): ship `{Path(fp32).name}`.",
        ]
    elif int8:
        lines += [
            "",
            f"INT8 chosen for target `{int8['target']}` ({int8['scheme']}, reduce_range "
            f"{str(int8['reduce_range']).lower()}), decided on the "
            f"{'file as written (reference semantics)' if int8['decided_on'] == 'reference' else 'optimized kernels of this host'}"
            f": {int8['int8_nodes']} of {int8['quantizable_nodes']} nodes in INT8, top-1 "
            f"agreement {int8['check_agreement']:.2%} on {_checked_on(int8)}"
            f"{_expected(int8)} (floor {int8['min_agreement']:.2%} for both).",
        ]
        if rows := int8.get("int8_tables"):
            lines.append(
                f"Embedding tables stored as int8 rows with an FP32 scale each: {table_counts(rows)}."
            )
        if why := int8.get("int8_tables_fp32"):
            lines.append(f"Embedding tables: {why}.")
        if lstms := int8.get("int8_lstms"):
            lines.append(f"{lstm_line(lstms)}.")
        if why := int8.get("int8_lstms_fp32"):
            lines.append(f"{why}.")
        if fixed := int8.get("fp32_only_nodes"):
            lines.append(
                f"FP32 in any INT8 file: {node_counts(fixed)} (GRU, RNN and ConvTranspose have no "
                "INT8 kernel in ONNX Runtime; an LSTM stays FP32 when 8 bits miss the floor)."
            )
        lat = int8.get("latency_ms_batch1")
        if lat and not int8["int8_nodes"]:  # no INT8 file: its "int8" figure is the FP32 one's
            lines.append(f"Batch-1 latency on ORT CPU (1 thread): FP32 {lat['fp32']:.3f} ms.")
        elif lat:
            lines.append(
                f"Batch-1 latency on ORT CPU (1 thread): FP32 {lat['fp32']:.3f} ms, "
                f"shipped INT8 {lat['int8']:.3f} ms."
            )
        if int8["fp32_nodes"]:
            lines += ["Kept in FP32:", *_fp32_node_lines(int8["fp32_nodes"])]
        else:
            lines.append("Every quantizable node runs in INT8.")
        if "reason" in int8:
            fp32 = report["onnx"].get("fp32", {}).get("path", "student.fp32.onnx")
            lines.append(
                f"**No INT8 file was written** ({int8['reason']}): ship `{Path(fp32).name}`."
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
    return lines


def _plot_lines(report: dict[str, Any], plots: Iterable[str | Path] | None) -> list[str]:
    names = plot_names(report) if plots is None else [Path(p).as_posix() for p in plots]
    if not names:
        return []
    lines = ["## Plots", ""]
    for name in names:
        caption = PLOT_CAPTIONS.get(Path(name).name, Path(name).stem.replace("_", " "))
        lines += [f"![{caption}]({name})", ""]
    return lines


_EP_NAMES = ("NNAPI", "CoreML NeuralNetwork", "CoreML MLProgram")
_EP_VERDICT = {"YES": "yes", "MAYBE": "partial", "NO": "no"}


def mobile_reasons(details: str) -> dict[str, dict[str, str]]:
    """`usability`'s `details` string, per execution provider: {"verdict", "nodes",
    "fixed" (the verdict with fixed input shapes), "unsupported" (ops)}, each when given.
    Parts this does not recognise are kept whole under "other"."""
    out: dict[str, dict[str, str]] = {}
    pattern = r"(" + "|".join(_EP_NAMES) + r") (YES|MAYBE|NO) \(((?:[^()]|\([^()]*\))*)\)"
    for m in re.finditer(pattern, details):
        info = {"verdict": _EP_VERDICT[m[2]]}
        for part in filter(None, (x.strip() for x in m[3].split("; "))):
            if f := re.fullmatch(r"(YES|MAYBE|NO) with fixed shapes", part):
                info["fixed"] = _EP_VERDICT[f[1]]
            elif part.startswith("unsupported ops "):
                info["unsupported"] = part.removeprefix("unsupported ops ")
            elif "nodes" in part and "nodes" not in info:
                info["nodes"] = part
            else:
                info["other"] = f"{info['other']}; {part}" if "other" in info else part
        out[m[1]] = info
    return out


def _why(info: dict[str, str]) -> str:
    parts = []
    if "nodes" in info:
        parts.append(f"{info['nodes']} can run on it")
    if "unsupported" in info:
        parts.append(f"unsupported ops {info['unsupported']}")
    if "fixed" in info:
        parts.append(f"{info['fixed']} with fixed shapes")
    if "other" in info:
        parts.append(info["other"])
    return "; ".join(parts)


def _verdict_lines(m: dict[str, Any]) -> list[str]:
    """One bullet per platform: the verdict, then the checker's reason for it."""
    eps = mobile_reasons(m.get("details", ""))
    if not eps:  # nothing parsable: the checker's own words
        details = f" ({m['details']})" if m.get("details") else ""
        return [f"- NNAPI **{m['nnapi']}**, CoreML **{m['coreml']}**{details}"]
    nnapi = _why(eps.get("NNAPI", {}))
    coreml = "; ".join(
        f"{ep.removeprefix('CoreML ')} {eps[ep]['verdict']}"
        + (f" ({_why(eps[ep])})" if _why(eps[ep]) else "")
        for ep in _EP_NAMES[1:]
        if ep in eps
    )
    return [
        f"- NNAPI (Android): **{m['nnapi']}**" + (f": {nnapi}." if nnapi else "."),
        f"- CoreML (iOS): **{m['coreml']}**" + (f": {coreml}." if coreml else "."),
    ]


def _mobile_lines(report: dict[str, Any]) -> list[str]:
    m, fixed = report.get("mobile"), report.get("mobile_fixed_batch")
    if not m and not fixed:
        return []
    lines = ["", "## Mobile", ""]
    o = report.get("ort")
    if o:
        config = (
            f"; operators for a reduced ONNX Runtime build: `{Path(o['config']).name}`"
            if o.get("config")
            else ""
        )
        version = (
            f" ORT format v{o['ort_format']}, opset {o['opset']}: ONNX Runtime ≥ {o['min_ort']}."
            if o.get("ort_format")
            else ""
        )
        runs_on = f" For {o['runs_on']}." if o.get("runs_on") else ""
        lines += [
            f"`{Path(o['path']).name}`: {o['bytes']:,} bytes, answers like the .onnx (max abs "
            f"Δ {o['max_abs_diff']:.2g}){config}.{version}{runs_on}",
            "",
        ]
    if miss := report.get("ort_not_written"):
        lines += [f"**No .ort file was written** ({miss['reason']}); ship the .onnx file.", ""]
    # What the pipeline ships (and checked): the INT8 file, else the FP32 one.
    onnx = report.get("onnx", {})
    kind = "int8" if "int8" in onnx else "fp32"
    shipped = Path(onnx[kind]["path"]).name if kind in onnx else f"student.{kind}.onnx"
    if m:
        lines += [
            f"ONNX Runtime's `check_onnx_model_mobile_usability` on `{shipped}` "
            "(as exported, dynamic batch):",
            "",
            *_verdict_lines(m),
        ]
        eps = mobile_reasons(m.get("details", ""))
        helped = [
            name
            for name, verdict, keys in (
                ("NNAPI", m["nnapi"], _EP_NAMES[:1]),
                ("CoreML", m["coreml"], _EP_NAMES[1:]),
            )
            if verdict != "yes"
            and any(
                _RANK.get(eps.get(k, {}).get("fixed"), -1) > _RANK.get(verdict, 0) for k in keys
            )
        ]
        if helped and fixed:
            lines.append(
                f"- Fix: {' and '.join(helped)} {'needs' if len(helped) == 1 else 'need'} "
                "fixed input shapes: ship "
                f"`{Path(fixed['path']).name}` (batch fixed to {fixed['batch']}), checked below."
            )
        elif helped:
            lines.append(
                f"- Fix: {' and '.join(helped)} would do better with fixed input shapes: run "
                f"again with `--fixed-batch 1` (recipe `[export] fixed_batch = 1`), which also "
                f"writes `{shipped.removesuffix('.onnx')}.fixed.onnx` with the batch fixed to 1."
            )
    if fixed:
        lines += [
            "",
            f"Batch fixed to {fixed['batch']}: `{Path(fixed['path']).name}`, "
            f"{fixed['bytes']:,} bytes:",
            "",
            *_verdict_lines(fixed),
        ]
    return lines


MAX_MARKS = 32  # centroid lines drawn per layer: an 8-bit layer's 256 would be a wall

PLOT_CAPTIONS = {
    "weights_histogram.png": "weights histogram",
    "channels_per_layer.png": "channels kept per layer",
    "kept_per_layer.png": "weights kept per layer",
}


def _figure_plan(report: dict[str, Any]) -> list[tuple[str, Callable[[], Any]]]:
    """The plots this report gets, in order, as (file name, function drawing the Figure):
    the one place that decides which files `plots` writes and `markdown` links."""
    plan: list[tuple[str, Callable[[], Any]]] = []
    if report.get("histogram"):
        plan.append(("weights_histogram.png", lambda: _histogram_figure(report["histogram"])))
    if report.get("channels"):
        plan.append(("channels_per_layer.png", lambda: _channels_figure(report["channels"])))
    if report["layers"]:
        plan.append(("kept_per_layer.png", lambda: _kept_figure(report["layers"])))
    return plan


def plot_names(report: dict[str, Any]) -> list[str]:
    """The file names `plots` writes for this report (what `markdown` links by default)."""
    return [name for name, _ in _figure_plan(report)]


def figures(report: dict[str, Any]) -> dict[str, Any]:
    """The report's figures as matplotlib Figures, by the file name `plots` gives each."""
    return {name: draw() for name, draw in _figure_plan(report)}


def plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write weights_histogram.png, kept_per_layer.png and (after the channels stage)
    channels_per_layer.png; return their paths."""
    return [save_figure(draw(), Path(out_dir) / name) for name, draw in _figure_plan(report)]


def new_figure(figsize: tuple[float, float]) -> Any:
    """A matplotlib Figure, not pyplot's: nothing global to close or leak, and the caller's
    backend untouched (a notebook's inline plots keep working; `savefig` renders a PNG with
    Agg whatever the backend). matplotlib is imported here, on first use, so
    `import compressor` stays light."""
    from matplotlib.figure import Figure

    return Figure(figsize=figsize)


def spread(values: list[float], k: int = MAX_MARKS) -> list[float]:
    """At most k of the sorted values, evenly spaced by rank, both ends kept."""
    values = sorted(values)
    n = len(values)
    if n <= k:
        return values
    return [values[round(i * (n - 1) / (k - 1))] for i in range(k)]


def _histogram_figure(h: dict[str, Any]) -> Any:
    fig = new_figure((7, 3.6))
    ax = fig.subplots()
    edges, counts = h["edges"], h["counts"]
    ax.stairs(counts, edges, fill=True, alpha=0.6, label="non-zero weights before sharing")
    top = max(counts) if counts else 1
    n, n_init = len(h["centroids"]), len(h["centroids_init"])
    shown, init = spread(h["centroids"]), spread(h["centroids_init"])

    def label(what: str, drawn: int, total: int) -> str:
        return what if drawn == total else f"{what} ({drawn} of {total} shown)"

    ax.vlines(init, 0, top * 0.15, colors="grey", label=label("linear init", len(init), n_init))
    ax.vlines(
        shown, 0, top * 0.3, colors="crimson", label=label("fine-tuned centroids", len(shown), n)
    )
    title = f"{h['layer']}: {n} centroids" + (f" ({len(shown)} shown)" if len(shown) < n else "")
    ax.set(title=title, xlabel="weight", ylabel="count")
    ax.legend(fontsize=8)
    return fig


def _channels_figure(c: dict[str, Any]) -> Any:
    rows = c["layers"]
    fig = new_figure((7, 0.5 + 0.3 * len(rows)))
    ax = fig.subplots()
    names = [r["name"] for r in rows]
    ax.barh(names, [r["before"] for r in rows], color="lightgrey", label="before")
    ax.barh(names, [r["after"] for r in rows], color="seagreen", label="kept")
    ax.set(xlabel="output channels", title="Channels kept per layer (structured pruning)")
    ax.invert_yaxis()
    ax.legend(fontsize=8)
    return fig


def _kept_figure(rows: list[dict[str, Any]]) -> Any:
    fig = new_figure((7, 0.5 + 0.4 * len(rows)))
    ax = fig.subplots()
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
    return fig


def save_figure(fig, path: Path, fmt: str = "png") -> Path:
    with warnings.catch_warnings():  # a one-layer model's plot cannot be tightened: harmless
        warnings.simplefilter("ignore", UserWarning)
        fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=fmt, dpi=110)
    return path


def _fp32_node_lines(nodes: dict[str, str]) -> list[str]:
    """One bullet per reason, in the order first met, naming its nodes: the fallback search
    gives every node it returns the same reason, and EfficientNet-B0's report repeated one
    400-character reason on 80 lines."""
    by_reason: dict[str, list[str]] = {}
    for n, why in nodes.items():
        by_reason.setdefault(why, []).append(n)
    lines = []
    for why, names in by_reason.items():
        if len(names) == 1:
            lines.append(f"- `{names[0]}`: {why}")
        else:
            listed = ", ".join(f"`{n}`" for n in names)
            lines.append(f"- {len(names)} nodes: {why}. The nodes: {listed}")
    return lines


def _expected(int8: dict[str, Any]) -> str:
    """The agreement expected on new inputs, for the INT8 sentence (absent in older reports)."""
    e, low = int8.get("check_expected_agreement"), int8.get("check_expected_lower_bound")
    if e is None:
        return ""
    bound = "" if low is None else f", 95% lower bound {low:.2%}"
    return f", {e:.2%} expected on new inputs (every margin x every change{bound})"


def _checked_on(int8: dict[str, Any]) -> str:
    """What the INT8 floor was checked on, for a sentence ("the validation split, 143 ...")."""
    c = int8.get("checked_on")
    if c is None:  # a report written before the validation split
        return "held-out training inputs"
    n = c.get("fp32_ties", 0)
    tied = f", {n} of them an FP32 tie (either top class agrees)" if n else ""
    if c["split"] == "validation":
        return f"{c['samples']:,} validation inputs{tied}"
    return f"{c['samples']:,} inputs ({c['source']}){tied}"
