"""Which ONNX Runtime releases load a file: versions read back from the file, never assumed.

    versions(model)          {"ir_version", "opsets": {domain: version}} as written
    min_ort(versions)        the oldest ONNX Runtime release that loads it, from ORT_RELEASES
    keep_used_opsets(model)  drop opset imports no node uses (in place)
    min_ir_for(opset)        the lowest IR version that can declare an ai.onnx opset

Why `keep_used_opsets`: ORT's quantizer leaves every domain it knows imported (ai.onnx.ml 5,
ai.onnx.training, com.microsoft.nchwc, ...) even when no node uses it. ONNX Runtime 1.17 refuses
such a file outright ("Opset 5 is under development ... ai.onnx.ml is till opset 4") although
every node in it is one 1.17 runs; a copy with only the used imports loads and answers
identically (KNOW-HOW, measured with onnxruntime 1.17.3).

Pure functions on `onnx.ModelProto`s; `onnx` is imported by the caller.
"""

from __future__ import annotations

from typing import Any

# ONNX Runtime release -> (ONNX IR version, ai.onnx opset, ai.onnx.ml opset) it implements.
# Source: ONNX Runtime's "Compatibility" page (docs/reference/compatibility.md, the ONNX opset
# support table, rows 1.10-1.20). A release loads a model whose IR version and per-domain
# opsets are at most these (an older opset stamp always loads: ORT keeps every opset >= 7).
# Releases after 1.20 are not in that table: a file that needs more than 1.20 reports
# min_ort = "> 1.20".
ORT_RELEASES: tuple[tuple[str, int, int, int], ...] = (
    ("1.10", 8, 15, 2),
    ("1.11", 8, 16, 2),
    ("1.12", 8, 17, 3),
    ("1.13", 8, 17, 3),
    ("1.14", 8, 18, 3),
    ("1.15", 9, 19, 3),  # IR 9: an IR-9 file runs in ORT 1.15.1 (checked 2026-11-29)
    ("1.16", 9, 19, 3),
    ("1.17", 9, 20, 4),
    ("1.18", 10, 21, 4),
    ("1.19", 10, 21, 4),
    ("1.20", 10, 21, 4),
)
NEWER = "> " + ORT_RELEASES[-1][0]
# Domains every listed release implements at version 1 (ORT's own contrib operators). A node
# of these domains may still need a newer release for that operator; QDQ files use none.
_ALWAYS = {"com.microsoft": 1}


def _domain(name: str) -> str:
    return name or "ai.onnx"


def versions(model: Any) -> dict[str, Any]:
    """The IR version and the opset of each imported domain, as the file declares them."""
    return {
        "ir_version": int(model.ir_version),
        "opsets": {_domain(o.domain): int(o.version) for o in model.opset_import},
    }


def min_ort(v: dict[str, Any]) -> str:
    """The oldest ONNX Runtime release (of ORT_RELEASES) that loads a file of versions `v`."""
    opsets = v["opsets"]
    for release, ir, onnx_opset, ml_opset in ORT_RELEASES:
        limits = {"ai.onnx": onnx_opset, "ai.onnx.ml": ml_opset, **_ALWAYS}
        fits = v["ir_version"] <= ir and all(
            domain in limits and version <= limits[domain] for domain, version in opsets.items()
        )
        if fits:
            return release
    return NEWER


def later(*releases: str) -> str:
    """The latest of `min_ort`-style releases ("1.16", "> 1.20")."""

    def key(r: str) -> tuple:
        return (r.startswith(">"), tuple(int(x) for x in r.lstrip("> ").split(".")))

    return max(releases, key=key)


def used_domains(model: Any) -> set[str]:
    """Domains of the nodes in the graph, its subgraphs and its local functions."""
    found: set[str] = set()

    def walk(graph: Any) -> None:
        for node in graph.node:
            found.add(node.domain)
            for attr in node.attribute:
                if attr.g.node:
                    walk(attr.g)
                for g in attr.graphs:
                    walk(g)

    walk(model.graph)
    for fn in model.functions:
        found.add(fn.domain)
        for node in fn.node:
            found.add(node.domain)
    return found


def keep_used_opsets(model: Any) -> Any:
    """Remove opset imports that no node uses (the default domain always stays)."""
    used = used_domains(model) | {""}
    keep = [o for o in model.opset_import if o.domain in used]
    del model.opset_import[:]
    model.opset_import.extend(keep)
    return model


def min_ir_for(opset: int) -> int:
    """The lowest IR version able to declare ai.onnx `opset` (onnx's own version table)."""
    from onnx import helper

    return helper.find_min_ir_version_for([helper.make_opsetid("", opset)])


def describe(model: Any) -> dict[str, Any]:
    """{"ir_version", "opsets", "min_ort"} of a loaded model: the report's compatibility line."""
    v = versions(model)
    return {**v, "min_ort": min_ort(v)}
