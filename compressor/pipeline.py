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

from torch import nn

from compressor import archive
from compressor import report as report_mod
from compressor import shrink as shrink_mod
from models import checkpoint
from models.errors import InputError
from models.fileio import atomic_path, check_writable, umask
from models.zoo import ModelSpec, build

OUTPUTS = (
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
) -> dict[str, Any]:
    """Run the pipeline and write model.dcz, model.pt, report.json/.md and plots into `out`."""
    check_out_dir(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    os.chmod(tmp, 0o777 & ~umask())
    try:
        report = shrink_mod.shrink(model, spec.to_dict(), recipe, hooks, tmp, metadata)
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
