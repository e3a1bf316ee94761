"""The one `.pt` checkpoint format, saved atomically and loaded without running pickled code.

A checkpoint is a plain dict that `torch.load(..., weights_only=True)` accepts:

    {
      "format": "compress.checkpoint",  "format_version": 1,
      "model": {"name": "lenet300" | "pkg.module:Class", "kwargs": {...}},
      "state_dict": {name: tensor},
      "metadata": {"data": spec, "test_accuracy": float, "seed": int, "epochs": int,
                   "created": ISO-8601 UTC, "versions": {"compress", "torch", "python"}, ...},
      "train_state": {...}            # optional: what `--resume` needs (optimizer, step, RNG)
    }

A file that holds pickled code (a whole `torch.save(model)`, or a crafted payload) is refused
before anything in it runs: `weights_only=True` allows tensors and plain containers only.
A bare `state_dict` (`torch.save(model.state_dict(), path)` from the user's own training
script, or a torchvision-style weights file) also loads when the caller names the model.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import platform
import zipfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compresskit.models import fileio
from compresskit.models.errors import InputError, one_line
from compresskit.models.fileio import atomic_path
from compresskit.models.zoo import ModelSpec, build, from_script, resolve_spec, state_shapes

FORMAT = "compress.checkpoint"
FORMAT_VERSION = 1


@dataclass
class Checkpoint:
    """A loaded checkpoint: what to build, its weights, and what made it."""

    spec: ModelSpec | None  # None for a bare state_dict whose model the caller must name
    state_dict: dict[str, torch.Tensor]
    metadata: dict[str, Any] = field(default_factory=dict)
    train_state: dict[str, Any] | None = None
    path: Path | None = None

    def spec_for(
        self,
        model: str | None,
        model_kwargs: dict[str, Any] | None,
        in_shape: tuple[int, ...],
        num_classes: int,
    ) -> ModelSpec:
        """The spec to build, given the --model and --model-kwargs the user passed.

        A bare state_dict (the user's own weights) is built as --model names it, with the data's
        input shape and class count where the constructor takes them. A compress checkpoint
        records its spec: a different --model, or any --model-kwargs, is refused rather than
        ignored (--model naming the checkpoint's own model only consents to importing it).
        """
        if self.spec is None:
            if not model:
                raise InputError(
                    f"{self.path}: a bare state_dict does not name its model; pass --model NAME "
                    "(spec= in Python: a zoo name, or pkg.module:Class for your own code)"
                )
            return resolve_spec(model, dict(model_kwargs or {}), in_shape, num_classes)
        if model and model != self.spec.name:
            raise InputError(
                f"--model {model}: {self.path} is a compress checkpoint of model "
                f"{self.spec.name}; drop --model (or pass --model {self.spec.name} to allow "
                "importing its code)"
            )
        if model_kwargs:
            # The weights were trained with the recorded kwargs; others would not fit them.
            raise InputError(
                f"--model-kwargs: {self.path} is a compress checkpoint that records its model "
                f"({self.spec.name}, {self.spec.kwargs}); drop --model-kwargs"
            )
        return self.spec

    def build_model(self, spec: ModelSpec | None = None, allow_import: bool = False) -> nn.Module:
        """Build the model and load the weights (strictly: every key and shape must match).

        A checkpoint that names the user's own code (`pkg.module:Class`) is only imported when
        the caller allows it (the user named the same class with --model): a file alone never
        decides which code runs. The weights are checked against the model built on the meta
        device first (nothing allocated), so weights that do not fit fail before a big model is
        built; a mismatch is one line naming the first keys or the first shape that differ.
        """
        spec = spec or self.spec
        if spec is None:
            raise InputError(
                f"{self.path}: a bare state_dict does not name its model; pass --model NAME "
                "(spec= in Python)"
            )
        if spec is self.spec and spec.needs_consent and not allow_import:
            if hint := from_script(spec.name):
                raise InputError(f"{self.path}: its model {spec.name} is {hint}")
            raise InputError(
                f"{self.path}: names model code {spec.name}; pass --model {spec.name} "
                "to allow importing it (in Python: the same name as shrink's spec= or bench's "
                "model=, or trust_model=True)"
            )
        shapes = state_shapes(spec)
        state = self.state_dict if shapes is None else self._fitted(shapes, spec)
        model = build(spec)
        if shapes is None:  # no meta build: check against the real one
            state = self._fitted({k: tuple(v.shape) for k, v in model.state_dict().items()}, spec)
        self._check_kinds(state, model.state_dict(), spec)
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as e:  # what our checks do not foresee (a module's own hooks)
            first = str(e).strip().splitlines()
            detail = " ".join(s.strip() for s in first[:2])
            raise InputError(
                f"{self.path}: weights do not fit model {spec.name}: {detail}"
            ) from None
        return model

    def _check_kinds(
        self, state: dict[str, torch.Tensor], model: dict[str, torch.Tensor], spec: ModelSpec
    ) -> None:
        """Weights a model can take: load_state_dict casts silently (complex lost its imaginary
        part, bool became 0/1) and fails on a meta or sparse tensor with torch's own words."""
        where = f"{self.path}: weights do not fit model {spec.name}"
        for k, t in state.items():
            if t.is_meta:
                raise InputError(f"{where}: {k} is a meta tensor, which holds no values; save "
                                 "the trained weights")  # fmt: skip
            if t.layout != torch.strided:
                raise InputError(f"{where}: {k} is a {t.layout} tensor; save t.to_dense()")
            want = model[k].dtype
            floating = want.is_floating_point
            if t.is_complex() or (floating and not t.is_floating_point()):
                raise InputError(
                    f"{where}: {k} is {t.dtype} in the file but {want} in the model; save the "
                    "model's real-valued weights (model.float())"
                )

    def _fitted(self, want: dict[str, tuple[int, ...]], spec: ModelSpec) -> dict[str, torch.Tensor]:
        """The weights keyed as the model wants them, or a one-line InputError."""
        state = _renamed(self.state_dict, want)
        # BatchNorm's step counter is only read with momentum=None; files written before torch
        # 0.4.1 (torchvision's first ImageNet weights among them) lack it.
        for k in want.keys() - state.keys():
            if _is_counter(k):
                state[k] = torch.tensor(0, dtype=torch.long)
        missing = [k for k in want if k not in state]
        unexpected = [k for k in state if k not in want]
        where = f"{self.path}: weights do not fit model {spec.name}"
        fix = "pass the --model (and --model-kwargs) the weights were trained with"
        if missing or unexpected:
            parts = []
            if missing:
                parts.append(f"{len(missing)} missing ({_first(missing)})")
            if unexpected:
                parts.append(f"{len(unexpected)} unexpected ({_first(unexpected)})")
            raise InputError(f"{where}: keys {'; '.join(parts)}; {fix}")
        classes = spec.kwargs.get("num_classes") if self.spec is None else None
        for k, shape in want.items():
            got = tuple(state[k].shape)
            if got != shape:
                if classes is not None and _only_classes_differ(got, shape, classes):
                    # a bare state_dict's model takes its class count from the data: data of
                    # another task (or the default digits, --data not given) is the mistake
                    fix = (
                        f"the model was built for the data's {classes} classes: pass the "
                        "--data the weights were trained on (data=, in Python)"
                    )
                raise InputError(
                    f"{where}: {k} is {got} in the file but {shape} in the model; {fix}"
                )
        return state


def _only_classes_differ(got: tuple[int, ...], want: tuple[int, ...], classes: int) -> bool:
    """Whether a tensor differs from the model's only where the model has `classes`."""
    return len(got) == len(want) and all(
        g == w or w == classes for g, w in zip(got, want, strict=True)
    )


def _first(keys: list[str], n: int = 3) -> str:
    more = f", ... {len(keys) - n} more" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def _renamed(state: dict[str, torch.Tensor], want: Any) -> dict[str, torch.Tensor]:
    """`state` with a leading name added or dropped, when exactly that makes its keys the
    model's: `module.` from a DistributedDataParallel or DataParallel wrapper, or `net.` for a
    bare transformers model's weights loaded into a `compresskit.models.hf` wrapper. Any other difference is
    left for the caller to report."""
    have, want = set(state), set(want)

    def same(file_keys: set[str], model_keys: set[str]) -> bool:
        # BatchNorm counters the file lacks are filled in by the caller.
        rest = model_keys - file_keys
        return file_keys <= model_keys and all(_is_counter(k) for k in rest)

    if same(have, want) or not have or not want:
        return copy.copy(state)  # keeps an OrderedDict's _metadata (module versions)
    for keys, add in ((have, False), (want, True)):
        heads = {k.split(".", 1)[0] for k in keys}
        if len(heads) != 1 or any("." not in k for k in keys):
            continue
        prefix = heads.pop() + "."
        stripped = {k[len(prefix) :] for k in keys}
        if add and same(have, stripped):
            return {prefix + k: v for k, v in state.items()}
        if not add and same(stripped, want):
            return {k[len(prefix) :]: v for k, v in state.items()}
    return dict(state)


def _is_counter(key: str) -> bool:
    return key.rsplit(".", 1)[-1] == "num_batches_tracked"


def versions() -> dict[str, str]:
    try:
        ours = importlib_metadata.version("compresskit")
    except importlib_metadata.PackageNotFoundError:
        ours = "unknown"
    return {"compress": ours, "torch": str(torch.__version__), "python": platform.python_version()}


def save(
    path: str | os.PathLike,
    model: nn.Module,
    spec: ModelSpec,
    metadata: dict[str, Any] | None = None,
    train_state: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint atomically: the old file survives an interrupted write."""
    return save_state(path, model.state_dict(), spec, metadata, train_state)


def save_state(
    path: str | os.PathLike,
    state_dict: dict[str, torch.Tensor],
    spec: ModelSpec,
    metadata: dict[str, Any] | None = None,
    train_state: dict[str, Any] | None = None,
) -> Path:
    """`save` from the tensors alone, for a model whose code is not imported (`compress
    decode` of a user's model without --model); loading it builds the model as usual."""
    obj: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model": spec.to_dict(),
        # On the CPU whatever device trained it: a checkpoint written on a GPU box must load with
        # a plain torch.load on a laptop (torch refuses CUDA storages where CUDA is absent).
        "state_dict": _cpu_copies(state_dict),
        "metadata": {
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "versions": versions(),
            # float sums, and so the last bits of the weights, depend on it (OMP_NUM_THREADS, a
            # container's cores): two runs of one command can be told apart by it
            "torch_threads": torch.get_num_threads(),
            **(metadata or {}),
        },
    }
    if train_state is not None:  # the optimizer's moments too (load_state_dict moves them back)
        obj["train_state"] = _on_cpu(train_state)
    path = Path(path)
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)
    return path


def _cpu_copies(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU copies of the tensors, one per view: tensors that are one view of one storage (a
    tied weight under two names) stay one tensor, so torch.save stores it once and a model
    loaded from the file keeps the tie's values (a copy each had doubled its bytes)."""
    copies: dict[tuple, torch.Tensor] = {}
    out = {}
    for k, v in state_dict.items():
        v = v.detach()
        view = (
            v.device,
            v.untyped_storage().data_ptr(),
            v.storage_offset(),
            v.dtype,
            tuple(v.shape),
            v.stride(),
        )
        if not v.numel() or view not in copies:  # empty tensors may all point at 0
            copies[view] = v.to("cpu", copy=True)
        out[k] = copies[view]
    return out


def _on_cpu(obj: Any) -> Any:
    """`obj` with every tensor inside its dicts, lists and tuples moved to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_on_cpu(v) for v in obj)
    return obj


def not_a_file(path: Path) -> str:
    """Why `path` cannot be read as a checkpoint file, in a few words (it is not a regular
    file): a folder, a pipe or device (`<(...)` was called a folder), or nothing."""
    if path.is_dir():
        return "a folder, not a checkpoint; give the .pt file in it"
    if path.exists():
        return (
            "not a regular file (a pipe or device: compress reads a checkpoint twice); save "
            "it to a file and pass that"
        )
    return "no such checkpoint file"


# Names of files that are never checkpoints: a checkpoint written as model.dcz or model.onnx
# was read back by every other command as a broken archive or model.
OTHER_KINDS = {".dcz": "a compress archive", ".onnx": "an ONNX model", ".ort": "an ORT model"}
OTHER_KINDS |= {".npz": "arrays", ".npy": "an array"}


def check_out_name(path: str | os.PathLike, flag: str = "--out") -> None:
    """A checkpoint is written in torch's format; torch reads a .safetensors name with the
    safetensors library, so `train --out model.safetensors` wrote a file nothing could read
    back (its --resume failed as "unexpected"). A name another kind of file has is refused."""
    suffix = Path(path).suffix.lower()
    if suffix == ".safetensors":
        raise InputError(
            f"{flag} {path}: compress writes PyTorch checkpoints, which torch would read as "
            "safetensors under this name; give a .pt name"
        )
    if suffix in OTHER_KINDS:
        raise InputError(
            f"{flag} {path}: a {suffix} file holds {OTHER_KINDS[suffix]}, and compress would "
            "write a PyTorch checkpoint there; give a .pt name"
        )


def check_replaceable(out: Path, flag: str = "--out") -> None:
    """A checkpoint `out` replaces an earlier checkpoint, never another kind of file, --force
    or not: `train --out student/model.dcz` and `decode --out x --force` replaced archives,
    ONNX files and a user's text with a checkpoint, exit 0."""
    out = Path(out)
    if not out.is_file() or out.stat().st_size == 0 or is_torch_file(out):
        return
    with open(out, "rb") as f:
        archive = f.read(4) == b"\x89DCZ"  # compressor.archive.MAGIC's first bytes
    what = "a compress archive" if archive else "not a PyTorch checkpoint"
    raise InputError(
        f"{flag} {out} exists and is {what}; a checkpoint would replace it: give another "
        f"{flag}, or move the file away"
    )


def load(
    path: str | os.PathLike, max_elements: int | None = None, train_state: bool = True
) -> Checkpoint:
    """Load a checkpoint or a bare state_dict; refuse pickled code; one-line errors.

    Before torch reads anything, the sizes the file declares are checked against the file's
    own size and `max_elements` (default `models.limits.max_elements()`): see `check_sizes`.
    `train_state=False` (every caller but `--resume`) never reads the training state: the
    file is mapped, the state_dict copied out and the optimizer's moments left on disk. Why:
    Adam's two moments are twice the weights, and read in full they were 85 of ResNet-18's
    130 MiB at load, for a `shrink` that never looks at them.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: {not_a_file(path)}")
    fileio.utf8_path(path)  # torch.load's C++ reader called such a file "truncated, corrupt"
    if path.suffix.lower() == ".safetensors":  # torch hands this name to the safetensors library
        try:
            import safetensors.torch  # noqa: F401
        except ImportError:
            raise InputError(
                f"{path}: a safetensors file; reading it needs the safetensors package "
                "(pip install safetensors)"
            ) from None
    check_sizes(path, max_elements)
    mapped = not train_state and _is_zip(path)  # mmap needs torch's zip format
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
        if not train_state:
            obj = _without_train_state(obj, mapped)
    except pickle.UnpicklingError as e:
        # weights_only refuses any global it does not allow-list, before calling it.
        what = _refused_global(str(e))
        if not what:  # no callable named: corrupt or unsupported data, not code
            raise InputError(
                f"{path}: not a readable PyTorch checkpoint: {_diagnose(path)}"
            ) from None
        raise InputError(
            f"{path}: refused: it holds pickled code{what}, which compress never runs; "
            "re-save the weights with torch.save(model.state_dict(), path)"
        ) from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError, KeyError):
        raise InputError(f"{path}: not a readable PyTorch checkpoint: {_diagnose(path)}") from None
    except Exception as e:
        # torch reads a .safetensors name with the safetensors library, whose own error type
        # reached the user as "unexpected" (exit 1) for a damaged file
        if type(e).__name__ != "SafetensorError":
            raise
        raise InputError(
            f"{path}: not a readable safetensors file ({one_line(e)}); save the weights again "
            "(safetensors.torch.save_file, or torch.save(model.state_dict(), 'model.pt'))"
        ) from None
    return _interpret(path, obj)


def _without_train_state(obj: Any, mapped: bool) -> Any:
    """`obj` without its training state; with `mapped`, the tensors left copied into memory
    so that nothing refers to the file's mapping once `load` returns."""
    if isinstance(obj, dict) and obj.get("format") == FORMAT:
        obj = {k: v for k, v in obj.items() if k != "train_state"}
        if mapped and isinstance(obj.get("state_dict"), dict):
            obj["state_dict"] = _copied(obj["state_dict"])
    elif isinstance(obj, dict) and not _is_state_dict(obj) and (key := _nested_key(obj)):
        # a training loop's checkpoint: its weights alone (not its optimizer's moments)
        obj = {key: _copied(obj[key]) if mapped else obj[key]}
    elif mapped and isinstance(obj, dict):
        obj = _copied(obj)
    return obj


def _copied(state: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _is_zip(path: Path) -> bool:
    """torch.load's own test for its zip format: the file starts with a zip local header."""
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # the first pickle of a pre-zip torch.save file


def is_torch_file(path: Path) -> bool:
    """Whether `path` looks like torch.save's output: its zip with a data.pkl record (an .npz
    is a zip too), or a legacy file, which starts with a protocol-2 pickle."""
    with open(path, "rb") as f:
        if f.read(2) == b"\x80\x02":
            return True
    if not _is_zip(path):
        return False
    try:
        with zipfile.ZipFile(path) as z:
            return any(n == "data.pkl" or n.endswith("/data.pkl") for n in z.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def check_sizes(path: Path, max_elements: int | None = None) -> None:
    """Refuse a .pt whose declared sizes cannot be honest, before torch allocates them.

    A torch.save zip stores its records uncompressed: a record declaring more bytes than the
    whole file is a lie or a zip bomb, and so are records that add up to more than the file.
    The storages the pickle declares (read by an unpickler that calls nothing) must fit in the
    file and stay under the element cap; in a legacy (pre-zip) file their bytes follow the
    pickle, so they too are bounded by the file's size. Files that are neither are left to
    torch.load, whose errors `load` turns into one line.
    """
    from compresskit.models import limits, safeload

    cap = limits.max_elements() if max_elements is None else max_elements
    size = path.stat().st_size
    fix = "re-save it with torch.save(model.state_dict(), path)"
    if _is_zip(path):
        infos = safeload.zip_directory(
            path, str(path), fix, f"{path}: not a readable PyTorch checkpoint: {_diagnose(path)}"
        )
        if program := _program_kind([i.filename for i in infos]):
            # their code records are compressed, and read as "a crafted or damaged file"
            raise InputError(
                f"{path}: {program}, a compiled program, not a checkpoint: compress reads "
                "a model's weights; save them with torch.save(model.state_dict(), path) and "
                "pass --model naming its class"
            )
        for info in infos:
            if info.file_size > size:
                raise InputError(
                    f"{path}: record {info.filename} declares {info.file_size:,} bytes, more "
                    f"than the whole {size:,}-byte file (torch.save never compresses): a zip "
                    f"bomb or a damaged file; refused before reading; {fix}"
                )
        declared = sum(i.file_size for i in infos)
        if declared > size:
            raise InputError(
                f"{path}: records declare {declared:,} bytes in all, more than the whole "
                f"{size:,}-byte file: a crafted or damaged file; refused before reading; {fix}"
            )
        # torch reads records under the folder of the archive's first one.
        prefix = infos[0].filename.split("/")[0] if infos else ""
        pkl = [i for i in infos if i.filename == f"{prefix}/data.pkl"]
        if len(pkl) != 1:
            return  # torch says what is wrong
        try:
            with zipfile.ZipFile(path) as z:
                data = z.read(pkl[0])
            ((_, storages),) = safeload.scan_pickles(io.BytesIO(data), len(data), 1)
        except Exception:  # not a pickle torch can read either: its error says so
            return
    else:
        # A legacy file: four pickles (magic number, protocol, sys info, the object), then
        # the storages' bytes.
        try:
            with open(path, "rb") as f:
                scanned = safeload.scan_pickles(f, size, 4)
        except Exception:
            return
        if scanned[0][0] != LEGACY_MAGIC:
            return
        storages = scanned[3][1]
    _check_storages(path, storages, size, cap, fix)


def _program_kind(names: list[str]) -> str | None:
    """What a torch zip that holds a program rather than a pickled object is, by its record
    names (TorchScript's code/ and constants.pkl, torch.export's models/model.json)."""
    if any("/code/__torch__/" in n for n in names) or any(
        n.endswith("/constants.pkl") for n in names
    ):
        return "a TorchScript file (torch.jit.save)"
    if any(n.endswith("/models/model.json") for n in names):
        return "a torch.export program (torch.export.save)"
    return None


def _check_storages(path: Path, storages: list, size: int, cap: int, fix: str) -> None:
    from compresskit.models import limits

    seen: dict[str, Any] = {}
    for s in storages:
        seen.setdefault(s.key, s)  # tensors sharing one storage name its key again
    unique = list(seen.values())
    for s in unique:
        if s.nbytes > size:
            raise InputError(
                f"{path}: storage {s.key} declares {s.numel:,} elements of {s.type_name} "
                f"({s.nbytes:,} bytes), more than the whole {size:,}-byte file: a crafted or "
                f"damaged file; refused before loading; {fix}"
            )
    total_bytes = sum(s.nbytes for s in unique)
    if total_bytes > size:
        raise InputError(
            f"{path}: its storages declare {total_bytes:,} bytes in all, more than the whole "
            f"{size:,}-byte file: a crafted or damaged file; refused before loading; {fix}"
        )
    elements = sum(s.numel for s in unique)
    if elements > cap:
        raise InputError(
            f"{path}: declares {elements:,} tensor elements, more than the cap of {cap:,}; "
            f"if the model really is this large, raise the cap (${limits.ENV_MAX_ELEMENTS})"
        )


def why_unreadable(path: Path, e: BaseException) -> str:
    """Why `torch.load(path, weights_only=True)` failed, in a few words: not torch's own
    message, which ends by suggesting weights_only=False for a file of unknown origin."""
    if isinstance(e, pickle.UnpicklingError) and (what := _refused_global(str(e))):
        return f"it holds pickled code{what}, which compress never runs"
    return _diagnose(path)


def _diagnose(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(4)
    if head.startswith(b"PK"):
        return "a zip archive that is truncated, corrupt or not written by torch.save"
    if head.startswith(b"\x80"):
        return "pickle data that is corrupt or holds more than tensors and plain containers"
    if not head:
        return "the file is empty"
    if head == b"\x89DCZ" or path.suffix == ".dcz":  # compressor.archive.MAGIC's first bytes
        return "a compress archive (.dcz), not a checkpoint; rebuild one with `compress decode`"
    if path.suffix in (".onnx", ".ort"):  # bench runs these; shrink and train need weights
        return (
            "an ONNX Runtime model, not a checkpoint; pass the .pt it was exported from "
            "(compress bench runs ONNX files)"
        )
    return "not a torch.save file (wrong format); pass a .pt written by torch.save"


def _refused_global(message: str) -> str:
    # torch says e.g. "Unsupported global: GLOBAL builtins.open was not an allowed global".
    for line in message.splitlines():
        if "GLOBAL " in line:
            name = line.split("GLOBAL ", 1)[1].split()[0]
            return f" ({name})"
    return ""


def _interpret(path: Path, obj: Any) -> Checkpoint:
    if isinstance(obj, dict) and obj.get("format") == FORMAT:
        version = obj.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise InputError(
                f"{path}: checkpoint format version {version!r} is newer than this compress "
                f"reads ({FORMAT_VERSION}); upgrade compress"
            )
        state = obj.get("state_dict")
        if not _is_state_dict(state):
            raise InputError(f"{path}: checkpoint has no valid state_dict")
        if not isinstance(obj.get("metadata") or {}, dict):
            raise InputError(f"{path}: checkpoint's metadata is not a table; the file is damaged")
        try:
            spec = ModelSpec.from_dict(obj.get("model"))
        except InputError as e:
            raise InputError(f"{path}: {e}") from None
        return Checkpoint(
            spec=spec,
            state_dict=state,
            metadata=dict(obj.get("metadata") or {}),
            train_state=obj.get("train_state"),
            path=path,
        )
    if _is_state_dict(obj):
        return Checkpoint(spec=None, state_dict=obj, path=path)
    # A training loop's checkpoint ({"state_dict", "optimizer", "epoch"}), Lightning's .ckpt
    # ("state_dict", keys prefixed "model."), {"model_state_dict": ...}: the weights are one
    # entry of it. They were refused as "not a checkpoint" with no fix.
    if isinstance(obj, dict) and (key := _nested_key(obj)):
        return Checkpoint(spec=None, state_dict=obj[key], path=path)
    raise InputError(
        f"{path}: a PyTorch file but not a checkpoint (neither a compress checkpoint nor a "
        f"state_dict of tensors, nor a dict holding one under {', '.join(NESTED_STATE_KEYS)}); "
        "save the weights with torch.save(model.state_dict(), path)"
    )


# where a training loop's checkpoint keeps the model's weights, in the order they are tried
NESTED_STATE_KEYS = ("state_dict", "model_state_dict", "model", "net")


def _nested_key(obj: dict) -> str | None:
    """The key under which a training loop's checkpoint holds a state_dict, or None."""
    return next((k for k in NESTED_STATE_KEYS if _is_state_dict(obj.get(k))), None)


def _is_state_dict(obj: Any) -> bool:
    return (
        isinstance(obj, dict)
        and len(obj) > 0
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())
    )
