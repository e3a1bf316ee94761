"""Guardrails: what a finished `shrink` run must say out loud before anyone ships its files.

A stage that costs accuracy beyond a limit, an INT8 file that misses its agreement floor (or
was not written for it), a "student" bigger than its teacher: each is a finding with one line
of text. The runner puts them in the report (`report["guard"]`), the CLI prints them on
stderr, and a strict run refuses to write anything when there is one
(`compressor.pipeline.shrink_to_folder`).

Each stage is judged on its own cost: the test accuracy it left against the accuracy of the
model it was given (distillation against the teacher, channel pruning against the model before
it, pruning against the dense model that Deep Compression starts from, and so on), so a
pipeline that loses 1.5 points in each of three stages is not excused by none of them being
large. The figures are test-set points, the same ones the report's stage table shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from compresskit.models.errors import InputError

STAGE_WORDS = {
    "distill": "distillation",
    "channels": "channel pruning",
    "prune": "pruning",
    "quantize": "weight sharing",
    "huffman": "the Huffman archive",
}


@dataclass(frozen=True)
class GuardConfig:
    """max_stage_drop: test-accuracy points one stage may cost before it is reported (and,
    with strict, before the run fails with nothing written)."""

    max_stage_drop: float = 2.0
    strict: bool = False

    def __post_init__(self) -> None:
        drop = self.max_stage_drop
        if isinstance(drop, bool) or not isinstance(drop, int | float) or not 0 <= drop <= 100:
            raise InputError(
                f"guard.max_stage_drop = {drop!r} is impossible; points of accuracy in "
                "[0, 100], e.g. 2.0"
            )
        if not isinstance(self.strict, bool):
            raise InputError(f"guard.strict = {self.strict!r} is impossible; true or false")

    @classmethod
    def from_recipe(cls, g: Any) -> GuardConfig:
        """From the recipe's [guard] section (compressor.recipe.GuardSection)."""
        return cls(max_stage_drop=g.max_stage_drop, strict=g.strict)


def findings(report: dict[str, Any], cfg: GuardConfig) -> list[dict[str, Any]]:
    """Every guardrail the finished run's report crosses, in pipeline order; [] when none."""
    out = [_stage(name, before, after, cfg) for name, before, after in stage_steps(report)]
    out = [f for f in out if f is not None]
    student, teacher = report.get("student", {}), report.get("teacher", {})
    if student.get("distilled") and (f := student_size(student, teacher)):
        out.append(f)
    out += _int8(report)
    if miss := report.get("ort_not_written"):
        out.append(
            {
                "kind": "ort",
                "message": (
                    f"no .ort file written: {miss['reason']}; the .onnx files are written "
                    "(ONNX Runtime Mobile also loads .onnx)"
                ),
            }
        )
    return out


def stage_steps(report: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(stage, test accuracy of the model it was given, test accuracy it left), in order."""
    steps: list[tuple[str, float, float]] = []
    student, teacher = report.get("student", {}), report.get("teacher", {})
    if student.get("distilled") and "test_accuracy" in teacher:
        steps.append(("distill", teacher["test_accuracy"], student["dense_test_accuracy"]))
    if "channels" in report:
        before, after = report["channels"]["test_accuracy"]
        steps.append(("channels", before, after))
    acc = report["baseline"]["test_accuracy"]
    for st in report.get("stages", []):
        steps.append((st["name"], acc, st["test_accuracy"]))
        acc = st["test_accuracy"]
    return steps


def _stage(name: str, before: float, after: float, cfg: GuardConfig) -> dict[str, Any] | None:
    drop = 100 * (before - after)
    if drop <= cfg.max_stage_drop + 1e-9:
        return None
    return {
        "kind": "stage_drop",
        "stage": name,
        "drop_points": drop,
        "limit_points": cfg.max_stage_drop,
        "message": (
            f"{STAGE_WORDS.get(name, name)} cost {drop:.2f} points of test accuracy "
            f"({before:.2%} -> {after:.2%}), over guard.max_stage_drop {cfg.max_stage_drop:g}"
        ),
    }


def student_size(student: dict[str, Any], teacher: dict[str, Any]) -> dict[str, Any] | None:
    """The finding of a student ({name, parameters}) bigger than its teacher, or None. Known
    before distillation: the pipeline says it then (a --strict run stops before training)."""
    if student["parameters"] <= teacher.get("parameters", 0):
        return None
    return {
        "kind": "student_size",
        "student_parameters": student["parameters"],
        "teacher_parameters": teacher["parameters"],
        "message": (
            f"the student {student['name']} has {student['parameters']:,} parameters, "
            f"{student['parameters'] / teacher['parameters']:.1f}x its teacher "
            f"{teacher['name']} ({teacher['parameters']:,}): distillation is for a "
            "smaller model; check --student and --student-kwargs"
        ),
    }


def recorded_recipe(report: dict[str, Any]) -> dict[str, Any]:
    """The recipe a report records, as a table (a report being built holds the Recipe)."""
    r = report.get("recipe")
    if hasattr(r, "to_dict"):
        return r.to_dict()
    return r if isinstance(r, dict) else {}


def _int8(report: dict[str, Any]) -> list[dict[str, Any]]:
    miss = report.get("int8_not_written")
    if miss:
        return [
            {
                "kind": "int8_floor",
                "message": (f"no INT8 file written: {miss['reason']}; the FP32 file is what ships"),
            }
        ]
    int8 = report.get("onnx", {}).get("int8")
    if not int8 or int8.get("min_agreement") is None:
        return []
    agree, floor = int8["top1_agreement_fp32"], int8["min_agreement"]
    if agree >= floor:
        return []
    checked = int8.get("checked_on", {})
    calib = int8.get("calibration") or {}
    asked = (recorded_recipe(report).get("export") or {}).get("calibration")
    # More calibration samples help only where more were there to take: a request past the
    # training set (or a calibration file, taken whole) was told to raise it further.
    more = (
        calib.get("source") == "training set"
        and isinstance(asked, int)
        and calib.get("samples") == asked
    )
    fix = "raise export.calibration or min_agreement" if more else "raise min_agreement"
    return [
        {
            "kind": "int8_floor",
            "agreement": agree,
            "floor": floor,
            "message": (
                f"the INT8 file agrees with FP32 on {agree:.2%} of the test set, under the "
                f"floor export.min_agreement {floor:.2%} that held on "
                f"{checked.get('samples', '?')} {checked.get('split', 'check')} samples: "
                f"{fix}, or ship the FP32 file"
            ),
        }
    ]
