"""`compress shrink` and `compress decode` as library calls that write their output folder
or file whole: everything is built in a temporary folder beside `--out` and moved into place
at the end, so a failed or interrupted run leaves nothing half-written."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compressor import archive, distill, export, mobile
from compressor import report as report_mod
from compressor import shrink as shrink_mod
from models import checkpoint
from models.data import Dataset
from models.errors import InputError
from models.fileio import atomic_path, check_writable, umask
from models.zoo import ModelSpec, build

OUTPUTS = (
    "model.fp32.onnx",
    "model.int8.onnx",
    "model.int8.ort",
    "model.int8.required_operators.config",
    "model.int8.fixed.onnx",
    "model.dcz",
    "model.pt",
    "report.json",
    "report.md",
    "weights_histogram.png",
    "kept_per_layer.png",
)


def check_out_dir(out: Path) -> Path:
    """--out must be a folder we can create or fill; fail before any work."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out}: exists and is not a folder; give a folder path")
    check_writable(out.parent / f"{out.name}.probe")
    if out.is_dir():  # we replace our files inside it: each must be replaceable
        check_writable(out / ".compress.probe")
        for name in OUTPUTS:
            if (out / name).exists() and not (out / name).is_file():
                raise InputError(f"--out {out}: {name} there is not a regular file; remove it")
    return out


def shrink_to_folder(
    model: nn.Module,
    spec: ModelSpec,
    recipe: dict[str, Any],
    hooks: shrink_mod.Hooks,
    out: Path,
    metadata: dict[str, Any],
    data: Dataset | None = None,
) -> dict[str, Any]:
    """Run the pipeline and write model.dcz, model.pt, report.json/.md and plots into `out`."""
    check_out_dir(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    os.chmod(tmp, 0o777 & ~umask())
    try:
        distilled = None
        if recipe["distill"]["student"]:
            if data is None:
                raise InputError("distillation needs the data set")
            model, spec, distilled = distill.distill_student(
                model, recipe["distill"], data, hooks.retrain, hooks.test_accuracy
            )
        report = shrink_mod.shrink(model, spec.to_dict(), recipe, hooks, tmp, metadata)
        if distilled:
            report.update(distilled)
        if recipe["export"]["enabled"]:
            if data is None:
                raise InputError("export needs the data set (calibration and parity)")
            report["onnx"] = _export(model, recipe["export"], report, data, tmp, out)
            if recipe["export"]["ort"] and "int8" in report["onnx"]:
                int8 = tmp / "model.int8.onnx"
                ort_file = mobile.to_ort(int8, tmp / "model.int8.ort")
                report["ort"] = {
                    **ort_file,
                    "path": str(out / "model.int8.ort"),
                    "config": str(out / Path(ort_file["config"]).name),
                }
                report["mobile"] = mobile.usability(int8)
            n = recipe["export"]["fixed_batch"]
            if n and "int8" in report["onnx"]:
                fixed = mobile.fixed_batch(
                    tmp / "model.int8.onnx", tmp / "model.int8.fixed.onnx", n
                )
                report["mobile_fixed_batch"] = {
                    "path": str(out / fixed.name),
                    "batch": n,
                    "bytes": fixed.stat().st_size,
                    **mobile.usability(fixed),
                }
        final_acc = report["stages"][-1]["test_accuracy"] if report["stages"] else None
        # Save through a freshly built model so the checkpoint's keys are in the order a plain
        # model has (removing parametrizations re-registers weights last).
        plain = build(spec)
        plain.load_state_dict(model.state_dict())
        checkpoint.save(
            tmp / "model.pt",
            plain,
            spec,
            {**metadata, "test_accuracy": final_acc, "compressed": True},
        )
        if "archive" in report:
            report["archive"]["path"] = str(out / "model.dcz")
        with atomic_path(tmp / "report.json") as f:
            f.write_text(json.dumps(report, indent=2) + "\n")
        with atomic_path(tmp / "report.md") as f:
            f.write_text(report_mod.markdown(report, f"compress shrink: {spec.name}"))
        report_mod.plots(report, tmp)
        _move_into(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report["files"] = sorted(str(out / p.name) for p in out.iterdir() if p.name in OUTPUTS)
    return report


def _export(model, e: dict[str, Any], report, data: Dataset, tmp: Path, out: Path) -> dict:
    """FP32 ONNX, then INT8 ONNX (ORT static QDQ, latency-aware); parity and invariants."""
    cfg = export.ExportConfig(opset=e["opset"], ir_version=e["ir_version"] or None)
    fp32 = export.export_onnx(model, data.x_train[:2], tmp / "model.fp32.onnx", cfg)
    bits = {
        r["name"].removesuffix(".weight"): r["weight_bits"]
        for r in report["layers"]
        if r.get("codebook")
    }

    def describe(path: Path) -> dict[str, Any]:
        checks = export.weight_invariants(path, model, bits)
        return {
            "path": str(out / path.name),
            "bytes": path.stat().st_size,
            **export.parity(model, path, data.x_test, data.y_test),
            "weights_ok": all(c["ok"] for c in checks.values()),
            "weights": checks,
        }

    result = {"fp32": describe(fp32)}
    if e["int8"]:
        q = export.QuantConfig(
            calibration=e["calibration"],
            method=e["method"],
            latency_aware=e["latency_aware"],
            min_agreement=e["min_agreement"],
        )
        # Calibration: a seeded random draw from the training set. Precision is chosen on other
        # training images, never on the test set the parity figures come from.
        pick = torch.randperm(len(data.y_train), generator=torch.Generator().manual_seed(0))
        calib = data.x_train[pick[: q.calibration]].numpy()
        check_x = data.x_train[pick[q.calibration : q.calibration + 1000]].numpy()
        if len(check_x) == 0:
            check_x = calib
        choice = export.choose_precision(fp32, tmp / "model.int8.onnx", calib, check_x, q)
        result["int8"] = {
            **describe(choice.path),
            "fp32_nodes": choice.fp32_nodes,
            "int8_nodes": choice.int8_nodes,
            "quantizable_nodes": choice.quantizable,
            "latency_ms_batch1": choice.latency_ms,
        }
    return result


def _move_into(tmp: Path, out: Path) -> None:
    if not out.exists():
        os.replace(tmp, out)  # one atomic rename when the folder is new
        tmp.mkdir()  # so the caller's cleanup finds a folder
        return
    for name in OUTPUTS:  # a rerun into an existing folder replaces our files one by one
        if (tmp / name).exists():
            os.replace(tmp / name, out / name)
        elif (out / name).exists():
            (out / name).unlink()


def decode_to_checkpoint(path: Path, out: Path, allow_import: str | None = None) -> dict[str, Any]:
    """Rebuild a checkpoint from a .dcz archive; the model spec inside must build and fit."""
    check_writable(out)
    decoded = archive.read(path)
    spec = ModelSpec.from_dict(decoded.spec)
    ck = checkpoint.Checkpoint(spec, decoded.state_dict, decoded.metadata, path=path)
    model = ck.build_model(allow_import=allow_import == spec.name)
    checkpoint.save(out, model, spec, {**decoded.metadata, "decoded_from": str(path)})
    return {
        "checkpoint": str(out),
        "archive": str(path),
        "model": spec.name,
        "tensors": len(decoded.state_dict),
        "archive_bytes": path.stat().st_size,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
