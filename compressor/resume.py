"""Resumable shrink: the finished work of a run, kept beside `--out` until the run succeeds, so
that a run stopped by Ctrl-C, a killed job or a failing late stage continues where it stopped
(`compress shrink --resume`, `compresskit.shrink(..., resume=True)`).

Retraining is most of a shrink's time (the default recipe: three pruning rounds of four epochs,
then three epochs of centroid fine-tuning), and before this a stop at the INT8 step threw it
all away. Five kinds of mark are kept, each the latest of its kind, in the pipeline's order:

  student      after distillation: the student, its spec and record, the transfer set's
               synthetic inputs and teacher labels (the rest is the run's own data)
  channels     after channel pruning: the thinned model and its spec (the replayable plan)
  prune        after each pruning round: the masked weights, the masks, the per-sample test
               hits of the round's retraining
  trials       after each trial of a --max-drop search (a full shrink each): every finished
               trial's report and verdict, the best one's model and archive; a resumed search
               replays them while it asks for the same recipes, in order
  compressed   after Deep Compression (pruning, weight sharing, Huffman): the baked weights,
               the archive and the stages' record; export, the INT8 step and the mobile files
               start from here

Each holds the random generators' states, so a resumed run writes the same bytes as an
uninterrupted one on the same machine. A mark is used only by a run from the same model, data
and metadata (one digest of their bytes) and the same recipe sections the mark depends on
(`DEPENDS`): a run whose `export` or `guard` section changed (the usual fix after a failed
INT8 step) still resumes from its compressed model; one whose `quantize` section changed
resumes from its last pruning round. Not marked (they run again): the epochs inside one
retraining run or one search trial, and a search's per-layer curves.

The marks live in a hidden folder `.OUT.resume` beside `--out`, written atomically (each file,
then the index naming it), read back with `torch.load(weights_only=True)`: a tampered file is
refused, never executed. They are removed when the run succeeds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compresskit.compressor import prune
from compresskit.compressor.recipe import Recipe
from compresskit.models import checkpoint
from compresskit.models.errors import InputError, MachineError, one_line
from compresskit.models.fileio import atomic_path, hidden, refuse_link
from compresskit.models.zoo import ModelSpec, build

FORMAT = 1
INDEX = "marks.json"
HEX = frozenset("0123456789abcdef")
MAX_INDEX_BYTES = 1 << 20  # the index names four files: a bigger one is not ours
# The recipe sections each mark depends on: a change anywhere else keeps the mark usable.
_DEEP = ("train", "budget", "distill", "channels", "prune", "quantize", "huffman")
DEPENDS = {
    "student": ("train", "distill"),
    "channels": ("train", "distill", "channels"),
    "prune": ("train", "budget", "distill", "channels", "prune"),
    "trials": _DEEP,  # a --max-drop search's trials: full shrinks, judged on the budget
    "compressed": _DEEP,
}
ORDER = ("student", "channels", "prune", "trials", "compressed")


def folder_for(out: Path) -> Path:
    """Where a run into `out` keeps its marks."""
    out = Path(os.path.abspath(out))
    return out.parent / f"{hidden(out.name)}.resume"


def _digest_tensor(h, t: torch.Tensor) -> None:
    t = t.detach().cpu().contiguous()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():  # the tensor's own buffer, not a copy (a data split may be gigabytes)
        h.update(t.reshape(-1).view(torch.uint8).numpy())


def fingerprint(model: nn.Module, spec: dict[str, Any], data: Any, metadata: dict) -> str:
    """One digest of what a run starts from: compress's and torch's versions, the model's
    weights and spec, the data's tensors (every split) and the run's metadata. A second's
    work on MNIST-sized data. Not in it: the model's code (a forward edited with the same
    weights resumes from work done with the old one) and the torch thread count (the kept
    work stays usable; the bits after it follow this run's count)."""
    h = hashlib.sha256(f"compress-resume-{FORMAT}".encode())
    h.update(json.dumps(_versions(), sort_keys=True).encode())
    h.update(json.dumps(spec, sort_keys=True, default=str).encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        _digest_tensor(h, t)
    if data is not None:
        for name in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test"):
            _digest_tensor(h, getattr(data, name))
        h.update(str(data.num_classes).encode())
    h.update(json.dumps(metadata, sort_keys=True, default=str).encode())
    return h.hexdigest()


def _versions() -> dict[str, str]:
    """The versions a mark's bits depend on: another compress or torch computes other bits
    (Python's version does not)."""
    return {k: v for k, v in checkpoint.versions().items() if k != "python"}


def _foreign(folder: Path) -> list[str]:
    """Names in a marks folder that no run wrote (the index, the marks, their temporary files).
    Only regular files count as ours: a folder or a link named like a mark is someone else's
    (the marks folder is removed whole, which took a folder `prune-0a.pt/` and its files)."""

    def ours(name: str) -> bool:
        if name == INDEX or (name.startswith(".") and name.endswith(".tmp")):
            return True
        kind, _, rest = name.partition("-")
        if name.endswith(".pt") and name[:-3] in ORDER:  # the first version's names
            return True
        token = rest[:-3].replace("-", "")
        return kind in ORDER and name.endswith(".pt") and all(c in HEX for c in token)

    with os.scandir(folder) as entries:
        return sorted(
            e.name for e in entries if not (e.is_file(follow_symlinks=False) and ours(e.name))
        )


def _json(text: Any) -> Any:
    """JSON kept by a run, read: anything that is not (nested too deep to read among them) is
    a ValueError, which the callers turn into their one-line refusal."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to be a record this tool wrote") from None


def _plain(what: Any) -> str | None:
    """A mark's description as this tool writes it ("prune round 2 of 3"), or None: a crafted
    index's text never reaches the terminal or the report (escape sequences, lines)."""
    if isinstance(what, str) and 0 < len(what) <= 120 and what.isprintable():
        return what
    return None


def _finite(state: dict[str, Any], what: str = "its weights") -> None:
    """Kept floating-point tensors hold numbers: a NaN (a flipped bit on disk) was retrained
    on and failed as "training diverged; lower the learning rate", which --resume repeated."""
    for name, t in state.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.isfinite().all():
            raise ValueError(f"{what} hold NaN or infinity ({name})")


def _table(value: Any, what: str) -> dict[str, Any] | None:
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{what} is not a table")
    return value


def _file_digest(path: str) -> str:
    """A teacher file's bytes, digested: the same file named another way (absolute, relative)
    is the same teacher, and a retrained one another."""
    h = hashlib.sha256()
    try:
        with open(Path(path).expanduser(), "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError:
        return f"unreadable:{path}"  # the run itself says what is wrong with it
    return h.hexdigest()


def _sections(
    recipe: Recipe, kind: str, teachers: tuple[str, ...] = (), calibration: str | None = None
) -> str:
    """One digest of the recipe sections a `kind` mark depends on, the extra teachers by
    their files' digests (`teachers`) rather than the paths naming them. Channel pruning to a
    target latency profiles the model as [export] would write it (its INT8 settings and
    calibration file): then [export] counts from the channels mark on."""
    d = recipe.to_dict()
    part = {k: d.get(k) for k in DEPENDS[kind]}
    # Sections this run never reads count for nothing: a changed [budget] of a recipe without
    # an accuracy budget threw the kept pruning rounds away.
    unread = {
        "budget": recipe.budget.max_drop == "off",
        "distill": not recipe.distill.student,
        "channels": not recipe.channels.enabled,
    }
    part = {k: v for k, v in part.items() if not unread.get(k)}
    if kind == "trials" and isinstance(part.get("budget"), dict):
        # each kept trial is replayed only where its own recipe's digest matches (`_replay`):
        # more or fewer trials asked for keeps the ones that match
        part["budget"] = {k: v for k, v in part["budget"].items() if k != "trials"}
    if "distill" in part and isinstance(part["distill"], dict) and teachers:
        part["distill"] = {**part["distill"], "teachers": list(teachers)}
    if "channels" in part and recipe.channels.enabled and recipe.channels.target_latency:
        part["export"] = d.get("export")
        part["calibration_bytes"] = calibration
    return _digest(part)


def _digest(part: dict[str, Any]) -> str:
    """One digest of recipe sections (a table of tables)."""
    return hashlib.sha256(json.dumps(part, sort_keys=True, default=str).encode()).hexdigest()


def generators() -> dict[str, Any]:
    """The state of the generator the stages draw from (dropout: torch's, which the pipeline
    forks and seeds; numpy's and Python's global ones are the caller's and are not touched)."""
    return {"torch": torch.get_rng_state()}


def set_generators(g: dict[str, Any]) -> None:
    state = g["torch"]
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
        raise ValueError("its generator state is not torch's")
    torch.set_rng_state(state)


@dataclass
class Marks:
    """The marks of one run into `out`: `latest(kind)` reads what a resumed run may use,
    `save(kind, payload)` keeps this run's, `finish()` removes them when the run succeeded."""

    folder: Path
    fingerprint: str
    recipe: Recipe
    resume: bool
    _fresh: bool = True  # nothing of this run written yet: an older run's marks still there
    resumed: list[str] = field(default_factory=list)  # the marks this run started from
    # What the retraining runs before the mark recorded (`Hooks.trained`), for the report.
    trained_before: dict[str, Any] | None = None
    info: Callable[[str], None] = lambda message: None
    failed: str | None = None  # why this run keeps no more marks (a full disk)
    _teachers: tuple[str, ...] | None = None  # the extra teachers' file digests
    _calibration: str | None = None  # the calibration file's digest, when one is named
    read: dict[str, Path] = field(default_factory=dict)  # the mark files read, by kind

    @classmethod
    def open(
        cls,
        out: Path,
        model: nn.Module,
        spec: dict[str, Any],
        data: Any,
        metadata: dict[str, Any],
        recipe: Recipe,
        resume: bool,
        info: Callable[[str], None] = lambda message: None,
    ) -> Marks:
        """The run's marks (their digest of the inputs computed now)."""
        folder = folder_for(out)
        refuse_link(folder)  # written into, replaced and removed: never through a link
        if folder.exists() and not folder.is_dir():
            raise InputError(
                f"{folder}: where a shrink into {out} keeps its finished work, but not a "
                "folder; remove it"
            )
        if folder.is_dir() and (foreign := _foreign(folder)):
            # the folder is replaced and removed whole: never with someone else's files in it
            raise InputError(
                f"{folder}: where a shrink into {out} keeps its finished work, but it holds "
                f"files this tool did not write ({', '.join(foreign[:3])}); move them"
            )
        return cls(folder, fingerprint(model, spec, data, metadata), recipe, resume, info=info)

    def _sections(self, kind: str) -> str:
        if self._teachers is None:  # read once: a teacher may be hundreds of megabytes
            self._teachers = tuple(_file_digest(t) for t in self.recipe.distill.teachers)
            calib = self.recipe.export.calibration_data
            self._calibration = _file_digest(calib) if calib else None
        return _sections(self.recipe, kind, self._teachers, self._calibration)

    def _index(self) -> dict[str, Any]:
        path = self.folder / INDEX
        refuse_link(path)
        if not path.is_file():
            return {}
        try:
            if (size := path.stat().st_size) > MAX_INDEX_BYTES:
                raise ValueError(f"{size:,} bytes, more than an index holds")
            index = _json(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise InputError(
                f"{path}: unreadable ({one_line(e)}); remove {self.folder} (the kept work is "
                "lost) or run without --resume"
            ) from None
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            return {}  # another version's marks: not ours to read
        if not isinstance(index.get("fingerprint"), str) or not isinstance(
            index.get("marks"), dict
        ):
            raise InputError(
                f"{path}: not an index this tool wrote; remove {self.folder} (the kept work is "
                "lost) or run without --resume"
            )
        return index

    def kept(self) -> dict[str, dict[str, Any]]:
        """This run's usable marks by kind (same inputs, same recipe sections)."""
        index = self._index()
        if index.get("fingerprint") != self.fingerprint:
            return {}
        return {  # `_index` checked that a fingerprinted index holds a table of marks
            k: m
            for k, m in index["marks"].items()
            if k in DEPENDS
            and isinstance(m, dict)
            and m.get("recipe") == self._sections(k)
            and _plain(m.get("what"))
        }

    def readable(self) -> dict[str, dict[str, Any]]:
        """`kept()` less the kinds no stage of this run's recipe reads (a student mark for a
        recipe without a student)."""
        r = self.recipe
        reads = {
            "student": bool(r.distill.student),
            "channels": r.channels.enabled,
            "prune": r.prune.enabled and r.budget.max_drop == "off",
            "trials": r.budget.max_drop != "off",
            "compressed": True,
        }
        return {k: m for k, m in self.kept().items() if reads[k]}

    def why_none(self) -> str:
        """Why `readable()` is empty, in a few words for the user."""
        index = self._index()
        if not index.get("marks"):
            return "no work kept"
        if index.get("fingerprint") != self.fingerprint:
            if (then := index.get("versions")) != (now := _versions()) and isinstance(then, dict):
                changed = ", ".join(
                    f"{k} {then.get(k)!s:.20} then, {v} now"
                    for k, v in now.items()
                    if then.get(k) != v
                )
                return f"the kept work is from another version ({_plain(changed) or '?'})"
            return "the kept work is from another model, data or checkpoint file name"
        return "the kept work is from another recipe or --teacher file"

    def latest(self, kind: str, claim: bool = True) -> dict[str, Any] | None:
        """The payload of this kind's mark, when resuming and it fits this run; else None.
        `claim`: the run continues from it now (else `claim` once it does: a search's kept
        trials count only when replayed)."""
        if not self.resume:
            return None
        mark = self.kept().get(kind)
        if mark is None:
            return None
        path = self.folder / str(mark.get("file"))
        if Path(str(mark.get("file"))).name != mark.get("file"):
            return None  # a name with folders in it is not one this tool wrote
        refuse_link(path)  # what is read is the folder's own file
        if not path.is_file():
            return None
        fix = f"remove {self.folder} or run without --resume"
        self.read[kind] = path
        try:
            checkpoint.check_sizes(path)  # the sizes it declares fit the file, before reading
            payload = torch.load(path, weights_only=True, map_location="cpu")
        except InputError as e:
            raise InputError(f"{e}; {fix}") from None
        except Exception as e:  # a truncated or tampered file: refused, never executed
            why = checkpoint.why_unreadable(path, e)
            raise InputError(f"{path}: not a mark this tool wrote ({why}); {fix}") from None
        if not isinstance(payload, dict) or payload.get("kind") != kind:
            raise InputError(f"{path}: not a {kind} mark; {fix}")
        try:
            trained = _table(_json(payload["trained"]), "its training record")
        except (KeyError, TypeError, ValueError) as e:
            raise unfit(self, kind, e) from None
        if claim:
            self.claim(mark["what"], trained)
        return payload

    def claim(self, what: str, trained: dict[str, Any] | None) -> None:
        """The run continues from kept work `what`, whose retraining runs recorded `trained`."""
        self.trained_before = trained
        self.resumed.append(what)
        # A stop from here on names this mark (`describe`), not the furthest one kept, which
        # may not fit this run's recipe.
        with contextlib.suppress(OSError, InputError):
            index = self._index()
            if index.get("fingerprint") == self.fingerprint:
                self._write_index({**index, "last": what})

    def trained(self, now: dict[str, Any] | None) -> dict[str, Any]:
        """`Hooks.trained` of this run (`now`) with the runs before the kept work it resumed."""
        return merge_trained(self.trained_before, now)

    def save(
        self, kind: str, what: str, payload: dict[str, Any], trained: dict[str, Any] | None
    ) -> None:
        """Keep `payload` as this run's `kind` mark, described by `what` ("prune round 2 of
        3"), with torch's generator state and what this run's retraining recorded so far
        (`trained`, `Hooks.trained`). Marks of later kinds are dropped (they describe another
        continuation of the run). A mark that cannot be written (a full disk) costs the
        marks, not the run: it goes on, saying so once."""
        if self.failed is not None:
            return
        payload = {
            **payload,
            "generators": generators(),
            "trained": json.dumps(self.trained(trained)),
        }
        try:
            self._save(kind, what, payload)
        except (OSError, MachineError) as e:
            self.failed = one_line(e)
            shutil.rmtree(self.folder, ignore_errors=True)  # its room may be what the run needs
            left = f"; {self.folder} is left as it was" if self.folder.exists() else ""
            self.info(
                f"warning: this run's finished work cannot be kept ({self.failed}); going on "
                f"without keeping it (stopped from here on, it starts again){left}"
            )

    def _save(self, kind: str, what: str, payload: dict[str, Any]) -> None:
        if self._fresh:
            self._fresh = False
            if not self.resume or self._index().get("fingerprint") != self.fingerprint:
                shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(exist_ok=True)
        index = self._index()
        if index.get("fingerprint") != self.fingerprint:
            index = {"format": FORMAT, "fingerprint": self.fingerprint, "marks": {}}
        index["versions"] = _versions()
        index["last"] = what
        marks = index["marks"]
        # A new file each time, the index switched to it in one rename, then the files it no
        # longer names removed: a kill at any moment leaves the last whole mark usable (over-
        # writing prune.pt in place lost the previous round with the one being written).
        name = f"{kind}-{secrets.token_hex(6)}.pt"  # not a pid: a container reuses those
        with atomic_path(self.folder / name) as tmp:
            torch.save({"kind": kind, **payload}, tmp)
        for later in ORDER[ORDER.index(kind) :]:  # another continuation of the run
            marks.pop(later, None)
        marks[kind] = {
            "file": name,
            "what": what,
            "recipe": self._sections(kind),
            "written": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        self._write_index(index)
        # Every other file goes, a killed save's temporary file among them (`_foreign` let
        # only regular files of our names in, and this run holds --out's lock).
        named = {m.get("file") for m in marks.values() if isinstance(m, dict)} | {INDEX}
        for p in self.folder.iterdir():
            if p.name not in named and p.is_file() and not p.is_symlink():
                with contextlib.suppress(OSError):
                    p.unlink()

    def _write_index(self, index: dict[str, Any]) -> None:
        with atomic_path(self.folder / INDEX) as tmp:
            tmp.write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")

    def finish(self) -> None:
        """The run succeeded: its marks are no longer needed."""
        shutil.rmtree(self.folder, ignore_errors=True)


def describe(out: Path, since: float | None = None) -> str | None:
    """What a stopped run into `out` kept, for its error message ("prune round 2 of 3"), or
    None. With `since` (a time.time()), only marks written from then on."""
    folder = folder_for(out)
    path = folder / INDEX
    try:
        if since is not None and path.stat().st_mtime < since:
            return None
        if path.is_symlink() or path.stat().st_size > MAX_INDEX_BYTES:
            return None
        index = _json(path.read_text(encoding="utf-8"))
        if "last" in index:  # what the run last kept or continued from
            return _plain(index["last"])
        marks = index["marks"]
        latest = [marks[k]["what"] for k in ORDER if k in marks]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return _plain(latest[-1]) if latest else None


def _model_state(model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
    return {"spec": json.dumps(spec.to_dict()), "state": model.state_dict()}


def _rebuilt(kept: dict[str, Any], expected: ModelSpec) -> tuple[nn.Module, ModelSpec]:
    """The kept model, built from the spec this run resolves itself (`expected`), with only
    the channel plan taken from the mark: a spec read from a file would name code to import
    and call, which needs the user's consent (the run asked for it when it resolved its own)."""
    spec = ModelSpec.from_dict(_json(kept["spec"]))
    if (spec.name, spec.kwargs) != (expected.name, expected.kwargs):
        raise ValueError(f"it holds model {spec.name!r}, this run builds {expected.name!r}")
    spec = dataclasses.replace(expected, thinned=spec.thinned)
    _finite(kept["state"])
    model = build(spec)
    model.load_state_dict(kept["state"])
    _order_like_(model, list(kept["state"]))
    return model, spec


def student_payload(
    student: nn.Module,
    spec: ModelSpec,
    record: dict[str, Any],
    train_on: Any,
    data: Any,
) -> dict[str, Any]:
    """A student mark: the distilled student, its spec and record, and the transfer set it
    trained on where the recipe asked for one (its synthetic inputs and the labels the
    teachers gave; the rest is the run's own data)."""
    transfer = None
    if train_on is not data:
        n = len(data.x_train)
        transfer = {
            "spec": train_on.spec,
            "x_extra": train_on.x_train[n:].clone(),
            "y_train": train_on.y_train,
            "y_val": train_on.y_val,
        }
    return {
        **_model_state(student, spec),
        "record": json.dumps(record),
        "transfer": transfer,
    }


def restore_student(
    kept: dict[str, Any], data: Any, marks: Marks, expected: ModelSpec
) -> tuple[nn.Module, ModelSpec, dict[str, Any], Any]:
    """(student, spec, record, the data it trained on) as distillation left them; `expected`:
    the student's spec as this run resolves it."""
    try:
        model, spec = _rebuilt(kept, expected)
        train_on = data
        if (t := kept["transfer"]) is not None:
            _finite({"x_extra": t["x_extra"]}, "its synthetic inputs")
            train_on = dataclasses.replace(
                data,
                spec=t["spec"],
                x_train=torch.cat([data.x_train, t["x_extra"]]),
                y_train=t["y_train"],
                y_val=t["y_val"],
            )
        set_generators(kept["generators"])
        return model, spec, _json(kept["record"]), train_on
    except Exception as e:
        raise unfit(marks, "student", e) from None


def channels_payload(model: nn.Module, spec: ModelSpec, record: dict[str, Any]) -> dict[str, Any]:
    """A channels mark: the thinned model, its spec (with the replayable plan), its record."""
    return {**_model_state(model, spec), "record": json.dumps(record)}


def restore_channels(
    kept: dict[str, Any], marks: Marks, expected: ModelSpec
) -> tuple[nn.Module, ModelSpec, dict[str, Any]]:
    """(thinned model, its spec, the channels record) as channel pruning left them; `expected`:
    the spec of the model this run thins."""
    try:
        model, spec = _rebuilt(kept, expected)
        set_generators(kept["generators"])
        return model, spec, _json(kept["record"])
    except Exception as e:
        raise unfit(marks, "channels", e) from None


def unfit(marks: Marks, kind: str, e: BaseException) -> InputError:
    """The one-line refusal of a `kind` mark that cannot be resumed from (why: `e`)."""
    return InputError(
        f"{marks.read.get(kind, marks.folder)}: cannot be resumed from ({one_line(e)}); "
        f"remove {marks.folder} or run without --resume"
    )


def pruned_payload(
    model: nn.Module,
    round_: int,
    hits: torch.Tensor | None,
    sensitivity: dict[str, Any] | None,
) -> dict[str, Any]:
    """A prune mark: the model as the round left it (masked originals and masks), the round's
    test hits, the sensitivity record."""
    return {
        "round": round_,
        "state": model.state_dict(),
        "masks": prune.masks_of(model),
        "hits": hits,
        "sensitivity": json.dumps(sensitivity),
    }


@dataclass(frozen=True)
class Pruned:
    """A prune mark, read and checked (`read_pruned`)."""

    round: int  # the rounds done
    hits: torch.Tensor | None  # the last round's per-sample test hits
    sensitivity: dict[str, Any] | None  # the sensitivity record (sparsity "auto")
    payload: dict[str, Any]


def read_pruned(
    kept: dict[str, Any], marks: Marks, rounds: int, auto: bool, n_test: int | None
) -> Pruned:
    """A prune mark's fields, checked against the run: 1..`rounds` rounds done, a sensitivity
    record with its proposal when the sparsity is `auto`, `n_test` test hits."""
    try:
        done, hits = kept["round"], kept["hits"]
        sens = _json(kept["sensitivity"])
        if not isinstance(done, int) or not 1 <= done <= rounds:
            raise ValueError(f"round {done!r} is not one of 1..{rounds}")
        if hits is not None and (
            not isinstance(hits, torch.Tensor)
            or hits.dtype != torch.bool
            or hits.ndim != 1
            or (n_test is not None and len(hits) != n_test)
        ):
            raise ValueError(f"its test hits are not {n_test} yes/no answers")
        if sens is not None and not isinstance(sens, dict):
            raise ValueError("its sensitivity record is not a table")
        if auto:
            proposal = (sens or {}).get("proposal")
            if not isinstance(proposal, dict) or not all(
                _number(v) and 0 <= v < 1 for v in proposal.values()
            ):
                raise ValueError("no sensitivity proposal of sparsities in [0, 1)")
        return Pruned(done, hits, sens, kept)
    except (KeyError, TypeError, ValueError) as e:
        raise unfit(marks, "prune", e) from None


def restore_pruned_(model: nn.Module, pruned: Pruned, marks: Marks) -> None:
    """Put the unpruned `model` where a prune mark left it (in place). A mark that does not
    fit the model is refused."""
    try:
        _finite(pruned.payload["state"])
        for full, mask in pruned.payload["masks"].items():
            prune.set_mask_(model, full, mask)
        model.load_state_dict(pruned.payload["state"])
        set_generators(pruned.payload["generators"])
    except Exception as e:
        raise unfit(marks, "prune", e) from None


def recipe_digest(recipe: Recipe) -> str:
    """One digest of a --max-drop trial's recipe, in the sections a trial depends on (its
    [export] and [guard] are the asked recipe's, which the trials never read)."""
    d = recipe.to_dict()
    return _digest({k: d.get(k) for k in _DEEP})


def trials_payload(
    done: list[dict[str, Any]],
    best: int,
    model: nn.Module,
    archive: Path,
) -> dict[str, Any]:
    """A trials mark: every finished trial of a --max-drop search (its recipe's digest, report
    and record, the generators after it) and the best one's model and archive."""
    return {
        "trials": json.dumps(
            [{k: e[k] for k in ("recipe", "report", "record", "trained")} for e in done]
        ),
        "generators_after": [e["generators"] for e in done],
        "best": best,
        "state": model.state_dict(),
        "archive": _held(archive),
    }


@dataclass(frozen=True)
class Trials:
    """A trials mark, read and checked (`read_trials`)."""

    trials: list[dict[str, Any]]  # each: recipe (digest), report, record, generators
    best: int  # the trial whose model and archive are kept (1-based)
    state: dict[str, torch.Tensor]
    archive: bytes


def read_trials(marks: Marks) -> Trials | None:
    """The kept trials of a stopped --max-drop search, when resuming and they fit this run;
    every field a replay reads checked (a crafted mark is one line, never a traceback)."""
    kept = marks.latest("trials", claim=False)
    if kept is None:
        return None
    try:
        trials = _json(kept["trials"])
        generators_after = kept["generators_after"]
        if not isinstance(trials, list) or not trials or len(trials) != len(generators_after):
            raise ValueError("no trials, or not one generator state per trial")
        for t, (entry, g) in enumerate(zip(trials, generators_after, strict=True), 1):
            _check_trial(t, entry)
            if not isinstance(g, dict) or not isinstance(g.get("torch"), torch.Tensor):
                raise ValueError(f"trial {t}'s generator state is not torch's")
            entry["generators"] = g
        best = kept["best"]
        if not isinstance(best, int) or not 1 <= best <= len(trials):
            raise ValueError(f"best trial {best!r} is not one of 1..{len(trials)}")
        archive = _archive(kept["archive"], trials[best - 1]["report"])
        return Trials(trials, best, kept["state"], archive)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise unfit(marks, "trials", e) from None


def _check_trial(t: int, entry: Any) -> None:
    """One kept trial: its recipe digest, record (verdict) and report as a replay reads them."""
    if not isinstance(entry, dict) or not isinstance(entry.get("recipe"), str):
        raise ValueError(f"trial {t} is not a table with a recipe digest")
    record, report = entry.get("record"), entry.get("report")
    if not isinstance(record, dict) or record.get("trial") != t:
        raise ValueError(f"trial {t} is out of order")
    if not isinstance(record.get("within_budget"), bool):
        raise ValueError(f"trial {t} has no verdict")
    for key in ("archive_bytes", "val_drop", "val_soft_drop"):
        if not _number(record.get(key)):
            raise ValueError(f"trial {t}'s {key} is not a number")
    _check_report(report, f"trial {t}'s report")
    if "archive" not in report:
        raise ValueError(f"trial {t}'s report names no archive")
    _table(entry.get("trained"), f"trial {t}'s training record")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_report(report: Any, what: str) -> dict[str, Any]:
    """A kept Deep Compression report, in the fields the pipeline, the search and the report's
    pages read from it; returns it. An archive's bytes are checked against its digest
    (`_archive`): these are the figures around them."""
    if not isinstance(report, dict):
        raise ValueError(f"{what} is not a table")
    base = report.get("baseline")
    if not isinstance(base, dict) or not all(
        _number(base.get(k)) or (k == "test_accuracy" and base.get(k) is None)
        for k in ("bytes", "parameters", "test_accuracy")
    ):
        raise ValueError(f"{what} has no baseline figures")
    stages = report.get("stages")
    if not isinstance(stages, list) or not all(
        isinstance(st, dict)
        and isinstance(st.get("name"), str)
        and (st.get("test_accuracy") is None or _number(st.get("test_accuracy")))
        for st in stages
    ):
        raise ValueError(f"{what}'s stages are not records of stages")
    if not isinstance(report.get("recipe"), dict):
        raise ValueError(f"{what} has no recipe")
    layers = report.get("layers", [])
    if not isinstance(layers, list) or not all(
        isinstance(r, dict) and isinstance(r.get("name"), str) for r in layers
    ):
        raise ValueError(f"{what}'s layers are not records of layers")
    if "archive" in report:
        a = report["archive"]
        if not isinstance(a, dict) or not isinstance(a.get("sha256"), str):
            raise ValueError(f"{what} names no archive digest")
        if not all(_number(a.get(k)) and a[k] >= 0 for k in ("bytes", "stream_bytes")):
            raise ValueError(f"{what}'s archive sizes are not numbers")
    return report


def restore_trial_(model: nn.Module, cached: Trials, marks: Marks, archive: Path) -> None:
    """Put the unpruned `model` where the kept best trial left it (in place), and its archive
    at `archive`."""
    try:
        _finite(cached.state)
        model.load_state_dict(cached.state)
        _order_like_(model, list(cached.state))
        with atomic_path(archive) as tmp:
            tmp.write_bytes(cached.archive)
    except InputError:
        raise
    except Exception as e:
        raise unfit(marks, "trials", e) from None


def _held(archive: Path) -> torch.Tensor:
    """An archive's bytes inside a mark: one file, read back as a tensor."""
    return torch.frombuffer(bytearray(archive.read_bytes()), dtype=torch.uint8)


def _archive(held: torch.Tensor, report: dict[str, Any]) -> bytes:
    """A kept archive's bytes, checked against the digest its report records."""
    data = held.numpy().tobytes()
    if hashlib.sha256(data).hexdigest() != report["archive"]["sha256"]:
        raise ValueError("its archive is not the one its record describes")
    return data


def compressed_payload(model: nn.Module, report: dict[str, Any], archive: Path) -> dict[str, Any]:
    """A compressed mark: the baked weights, the stages' record, the archive's bytes (checked
    against the record's digest when read back)."""
    return {
        "state": model.state_dict(),
        "report": json.dumps(report),
        "archive": _held(archive) if "archive" in report else None,
    }


def no_seconds_(report: dict[str, Any]) -> dict[str, Any]:
    """A kept report's stages as this run spent them: no seconds (a resumed run's timings are
    its own); returns `report`."""
    for stage in report.get("stages", []):
        if isinstance(stage, dict) and "seconds" in stage:
            stage["seconds"] = 0.0
    if "seconds" in report:
        report["seconds"] = 0.0
    return report


def restore_compressed_(
    model: nn.Module, kept: dict[str, Any], marks: Marks, archive: Path
) -> dict[str, Any]:
    """Put the unpruned `model` where Deep Compression left it (in place) and its archive at
    `archive`; return its report, whose recipe records are this run's in the sections the mark
    did not depend on (a resumed run with another [export] section reports that one)."""
    try:
        report = no_seconds_(_check_report(_json(kept["report"]), "its report"))
        _finite(kept["state"])
        if "archive" in report:
            data = _archive(kept["archive"], report)
            with atomic_path(archive) as tmp:
                tmp.write_bytes(data)
        model.load_state_dict(kept["state"])
        _order_like_(model, list(kept["state"]))
        set_generators(kept["generators"])
        now = marks.recipe.to_dict()
        for recorded in (report.get("recipe"), (report.get("budget") or {}).get("asked_recipe")):
            for section in set(now) - set(DEPENDS["compressed"]):
                if isinstance(recorded, dict) and section in recorded:
                    recorded[section] = now[section]
        return report
    except Exception as e:
        raise unfit(marks, "compressed", e) from None


def _order_like_(model: nn.Module, keys: list[str]) -> None:
    """Each module's tensors registered in the order of `keys`: baking re-registers a layer's
    weight after its bias, and the exported file lists initializers in registration order,
    so without this a resumed run's ONNX files would hold the same tensors in another order."""
    rank = {k: i for i, k in enumerate(keys)}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        own = module._parameters  # baking re-registers parameters only; buffers keep order
        order = sorted(own, key=lambda n: rank.get(prefix + n, len(rank)))
        if order != list(own):
            module._parameters = {n: own[n] for n in order}


def merge_trained(before: dict[str, Any] | None, now: dict[str, Any] | None) -> dict[str, Any]:
    """`Hooks.trained` of a resumed run: the retraining runs before its mark and its own
    (lists as their sorted union, counts summed, anything else this run's)."""
    before, now = before or {}, now or {}
    merged = {**before, **now}
    for k in before.keys() & now.keys():
        a, b = before[k], now[k]
        if isinstance(a, list) and isinstance(b, list):
            merged[k] = sorted(set(a) | set(b))
        elif isinstance(a, int) and isinstance(b, int):
            merged[k] = a + b
    return merged


def kept_bytes(out: Path) -> int:
    """The bytes the kept work of a run into `out` takes on disk."""
    folder = folder_for(out)
    try:
        return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    except OSError:
        return 0
