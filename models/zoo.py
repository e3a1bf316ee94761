"""One registry for model constructors: zoo names and the user's own `pkg.module:Class` (or a
factory function, `pkg.module:build_net`, that returns an `nn.Module`).

Every model `compress` builds goes through `build(ModelSpec)`, and every checkpoint records the
`ModelSpec` it was built from, so a checkpoint names its architecture without pickling code.

Zoo models take `in_shape` (C, H, W), or (F,) features for the ones that flatten, and
`num_classes`; `resolve_spec` fills both in from the
data for zoo models and for user classes and factories that name them as parameters.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from compresskit.models.errors import InputError

# Our model modules under the names they had before the `compresskit` import root (0.1.0
# pre-releases), so checkpoints and scripts that name `models.hf:resnet18` keep working. Only
# these exact modules: a user's own `models.py` (`--model models:Net`) is the user's.
_RENAMED_MODULES = {"models.hf": "compresskit.models.hf"}
_ZOO: dict[str, type[nn.Module]] = {}
_TINY: dict[str, dict[str, Any]] = {}
_ABOUT: dict[str, str] = {}
_INPUTS: dict[str, str] = {}
INPUT_KINDS = ("image", "tokens")


def register(
    name: str, *, tiny: dict[str, Any] | None = None, about: str = "", inputs: str = "image"
) -> Callable:
    """Class decorator: add a model to the zoo under `name`.

    `tiny` holds the constructor kwargs of a small, fast instance for tests; `inputs` is what
    the model reads: "image" (float32 N, C, H, W) or "tokens" (int64 token ids N, L).
    """
    if inputs not in INPUT_KINDS:
        raise ValueError(f"inputs {inputs!r}: one of {INPUT_KINDS}")

    def deco(cls: type[nn.Module]) -> type[nn.Module]:
        if name in _ZOO:
            raise ValueError(f"model name {name!r} registered twice")
        _ZOO[name] = cls
        _TINY[name] = dict(tiny or {})
        _ABOUT[name] = about or (cls.__doc__ or "").strip().splitlines()[0]
        _INPUTS[name] = inputs
        return cls

    return deco


def _load_zoo() -> None:
    # Importing the modules runs their @register decorators.
    from compresskit.models import cnn, families, lenet, mlp, mobilenet  # noqa: F401


def available() -> dict[str, str]:
    """Zoo names with a one-line description each."""
    _load_zoo()
    return dict(sorted(_ABOUT.items()))


# Import paths a checkpoint may name without the user's consent: compress's own builders.
TRUSTED_BUILDERS = "compresskit.models.hf:"


@dataclass(frozen=True)
class ModelSpec:
    """What to build: a zoo name or an import path `pkg.module:Class` (or `:function`), plus the
    constructor's kwargs."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    # Whole channels removed after construction (`compressor.channels`): the plan that
    # `models.thin.apply_` replays on the freshly built model. None for an unthinned model.
    thinned: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "kwargs": _jsonable(self.kwargs)}
        if self.thinned is not None:  # absent otherwise: older files keep their exact bytes
            d["thinned"] = self.thinned
        return d

    @classmethod
    def from_dict(cls, d: Any) -> ModelSpec:
        if not isinstance(d, dict) or not isinstance(d.get("name"), str):
            raise InputError("model spec must be a mapping with a string 'name'")
        kwargs = d.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise InputError(f"model spec for {d['name']}: 'kwargs' must be a mapping")
        if len(d["name"]) > 500 or _values(kwargs) > MAX_SPEC_VALUES:
            # A constructor takes a few arguments; a file that names lenet300 with
            # hidden=[1] * 250000 held the meta-device build for 34 s and 1.5 GB.
            raise InputError(
                f"model spec for {d['name'][:80]}: its name or kwargs are larger than any "
                f"model's constructor takes (over {MAX_SPEC_VALUES:,} values); the file is "
                "damaged or crafted"
            )
        thinned = d.get("thinned")
        if thinned is not None:
            from compresskit.models import thin

            thin.check(thinned, f"model spec for {d['name']}: thinned")
        return cls(d["name"], dict(kwargs), thinned)

    @property
    def is_import_path(self) -> bool:
        return ":" in self.name

    @property
    def needs_consent(self) -> bool:
        """Whether building it imports code a file named: a user's import path, not a zoo
        name and not compress's own model builders (`compresskit.models.hf:bert`). Only that
        module is exempt: another callable of the package, named by a crafted file, could be
        one that is not a model builder."""
        return self.is_import_path and not self.name.startswith(TRUSTED_BUILDERS)


MAX_SPEC_VALUES = 10_000  # values in a model spec's kwargs, nested ones counted


def from_script(name: str) -> str | None:
    """For a spec naming a class of a script or notebook (`__main__:Net`, what a notebook
    passes as spec=), how to use its files elsewhere; else None. Only the program that defines
    the class can import it: on the command line `__main__` is compress itself."""
    module, _, attr = name.partition(":")
    if module != "__main__":
        return None
    return (
        "a class of a script or notebook, which only that program can build: "
        f"load its files there (spec='{name}'), or move the class into a module (mynets.py "
        f"beside your script) and shrink with spec='mynets:{attr}' to use them from the "
        "command line; the .onnx files need no Python code"
    )


def _values(v: Any, budget: int = MAX_SPEC_VALUES + 1) -> int:
    """How many values `v` holds, counting nested lists and mappings (stops past `budget`)."""
    count, stack = 0, [v]
    while stack and count <= budget:
        x = stack.pop()
        count += 1
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return count


def _jsonable(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return v


def parse_kwargs(text: str | None, flag: str = "--model-kwargs") -> dict[str, Any]:
    """Parse the JSON object given to --model-kwargs."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(
            f"{flag} is not JSON ({e.msg} at char {e.pos}); e.g. {flag} '{{\"width\": 64}}'"
        ) from None
    except RecursionError:  # json recurses once per level of nesting
        raise InputError(f"{flag}: nested too deeply to read; give a flat JSON object") from None
    except ValueError as e:  # an integer past Python's 4,300-digit conversion limit
        raise InputError(f"{flag}: {huge_number(e)}; give numbers a model can take") from None
    if not isinstance(value, dict):
        raise InputError(f"{flag} must be a JSON object, e.g. '{{\"width\": 64}}'")
    return value


def huge_number(e: ValueError) -> str:
    """A ValueError from json.loads other than a syntax error, in a few words."""
    if "digits" in str(e):
        return "an integer of more than 4,300 digits"
    return (str(e).splitlines() or ["unreadable"])[0][:100]


def resolve(name: str) -> Callable[..., nn.Module]:
    """The constructor behind a zoo name or an import path `pkg.module:attr`.

    An import path names an `nn.Module` class or any other callable that returns a module (a
    factory function such as `torchvision.models:resnet18`); `build` checks what it returns.
    """
    if ":" not in name:
        _load_zoo()
        if name not in _ZOO:
            import difflib

            known = ", ".join(sorted(_ZOO))
            close = difflib.get_close_matches(name, _ZOO, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise InputError(
                f"unknown model {name!r}{hint}; zoo models: {known}; or give your own as "
                "pkg.module:Class"
            )
        return _ZOO[name]
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise InputError(
            f"model {name!r}: an import path reads pkg.module:Class or pkg.module:function"
        )
    module_name = _RENAMED_MODULES.get(module_name, module_name)
    if module_name.split(".")[0] in (*sys.stdlib_module_names, "builtins"):
        # No model lives there, and with --trust-model a file naming os:system ran it.
        raise InputError(
            f"model {name!r}: {module_name} is Python's standard library, which builds no "
            "models; name your model's class or factory (a file naming it is damaged or crafted)"
        )
    try:
        module = _import_user_module(module_name)
    except ModuleNotFoundError as e:
        raise InputError(
            f"model {name!r}: cannot import {module_name!r} ({e}); "
            "install it or run from the folder that holds it"
        ) from None
    except Exception as e:  # the user's module raised while importing
        detail = (str(e).strip().splitlines() or [""])[0]
        raise InputError(
            f"model {name!r}: importing {module_name!r} failed: {type(e).__name__}: {detail}"
        ) from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            if hint := from_script(name):
                raise InputError(f"model {name!r} is {hint}")
            raise InputError(f"model {name!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    what = "a torch.nn.Module class or a function that returns one"
    if isinstance(obj, nn.Module):
        # Callable, but calling it runs forward(): a checkpoint records how to build a model.
        raise InputError(
            f"model {name!r}: {attr} is a model instance, not {what}; name its class or a "
            "function that builds it"
        )
    if inspect.isclass(obj) and not issubclass(obj, nn.Module):
        raise InputError(f"model {name!r}: {attr} is a class but not a torch.nn.Module subclass")
    if not callable(obj):
        raise InputError(f"model {name!r}: {attr} is {type(obj).__name__}, not {what}")
    if inspect.isbuiltin(obj):  # C code (numpy's, torch's own functions): builds no model
        raise InputError(f"model {name!r}: {attr} is a built-in function, not {what}")
    return obj


def _import_user_module(module_name: str) -> Any:
    """Import `module_name` as it would import from `python -c` in the working folder: a
    module file (or package) there comes first, even where another folder on sys.path holds
    one of the same name (a project's own `models/` package, say, when the user's is
    ./models.py). The working folder stays on sys.path, last, for what the module imports
    later."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)
    sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    finally:
        sys.path.remove(cwd)  # the first entry: the one inserted above


def _signature(ctor: Callable) -> inspect.Signature | None:
    try:
        # A class is described by its __init__ (the metaclass's __call__ says nothing).
        return inspect.signature(ctor.__init__ if inspect.isclass(ctor) else ctor)
    except (TypeError, ValueError):
        return None


def _accepts(ctor: Callable, param: str) -> bool:
    """Whether `ctor` names `param` as a keyword parameter of its own.

    A bare **kwargs does not count: a factory such as torchvision's `resnet18(**kwargs)` hands
    them on to a class that takes no `in_shape`, so guessing would break it.
    """
    sig = _signature(ctor)
    if sig is None:
        return False
    p = sig.parameters.get(param)
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


def resolve_spec(
    name: str,
    kwargs: dict[str, Any],
    in_shape: tuple[int, ...],
    num_classes: int,
    flag: str = "--model-kwargs",
) -> ModelSpec:
    """Complete a spec with the data's input shape and class count where the constructor (a
    class's `__init__`, or the factory function) names them as parameters.

    A value the user gave that contradicts the data is an error, not silently overridden;
    it names `flag`, where the kwargs came from (a student's: --student-kwargs).
    """
    ctor = resolve(name)
    kwargs = dict(kwargs)
    for key, value in (("in_shape", list(in_shape)), ("num_classes", num_classes)):
        if not _accepts(ctor, key):
            continue
        if key in kwargs:
            given = kwargs[key]
            if key == "in_shape" and isinstance(given, list | tuple):
                given = list(given)
            if given != value:
                raise InputError(
                    f"{flag} {key}={kwargs[key]!r} but the data gives {value!r}; "
                    f"drop {key} from {flag}"
                )
        kwargs[key] = value
    return ModelSpec(name, kwargs)


def _call(ctor: Callable, spec: ModelSpec) -> Any:
    """ctor(**kwargs), with kwargs it does not take told apart from errors inside it."""
    sig = _signature(ctor)
    if sig is not None:
        try:
            if inspect.isclass(ctor):  # __init__'s signature starts with `self`
                sig.bind(None, **spec.kwargs)
            else:
                sig.bind(**spec.kwargs)
        except TypeError as e:
            raise InputError(f"model {spec.name!r} does not take these kwargs: {e}") from None
    return ctor(**spec.kwargs)


def _check_module(obj: Any, spec: ModelSpec) -> nn.Module:
    if not isinstance(obj, nn.Module):
        raise InputError(
            f"model {spec.name!r} returned {type(obj).__name__}, not a torch.nn.Module; "
            "name a module class or a function that returns a module"
        )
    return obj


def build(spec: ModelSpec, *, seed: int | None = None) -> nn.Module:
    """Construct the model a spec names (weights freshly initialised; seeded when asked)."""
    ctor = resolve(spec.name)
    if seed is not None:
        torch.manual_seed(seed)
    try:
        model = _call(ctor, spec)
    except InputError:
        raise
    except Exception as e:  # bad kwargs values surface as anything from the constructor
        # A TypeError with no signature to bind the kwargs against, or from a **kwargs factory
        # passing them on to a class that refuses them (torchvision's resnet18): the kwargs
        # are the problem. Any other failure is the constructor's own, on their values.
        kwargs_refused = isinstance(e, TypeError) and (
            _signature(ctor) is None or "unexpected keyword argument" in str(e)
        )
        if kwargs_refused:
            raise InputError(f"model {spec.name!r} does not take these kwargs: {e}") from None
        detail = (str(e).strip().splitlines() or [""])[0]
        raise InputError(
            f"model {spec.name!r} could not be built with {_jsonable(spec.kwargs)}: "
            f"{type(e).__name__}: {detail}"
        ) from None
    model = _check_module(model, spec)
    if spec.thinned is not None:
        from compresskit.models import thin

        thin.apply_(model, spec.thinned, spec.name)
    return model


def state_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]] | None:
    """The state_dict shapes the spec's model would have, built on the meta device (no memory).

    Lets a caller check weights against a model before building it for real, so a file that
    names a huge model costs nothing until its weights are known to fit. None when the model
    cannot be built on the meta device (it computes with its weights while being built) or the
    constructor fails: `build` then reports why.
    """
    ctor = resolve(spec.name)
    try:
        with torch.device("meta"):
            model = _call(ctor, spec)
    except Exception:  # bad kwargs are reported by `build`; meta-hostile models skip the check
        return None
    if not isinstance(model, nn.Module):
        return None
    if spec.thinned is not None:  # the channel plan replays on meta tensors too
        from compresskit.models import limits, thin

        unthinned = sum(v.numel() for v in model.state_dict().values())
        try:
            with torch.device("meta"):
                thin.apply_(model, spec.thinned, spec.name)  # a plan that does not fit: InputError
        except InputError:
            # torch-pruning's LayerNorm path fails on meta tensors: every thinned model with a
            # LayerNorm (a ViT) was refused when read back ("expected TensorOptions(...
            # device=meta)"). Replayed on real tensors, the model is bounded as a file's
            # tensors are; a plan that does not fit is still refused there.
            if unthinned > limits.max_elements():
                raise
            model = _call(ctor, spec)
            thin.apply_(model, spec.thinned, spec.name)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def input_kind(name: str) -> str:
    """What a model reads: "image" or "tokens".

    A zoo model says so when registered; an import path through an `input_kind` attribute of
    the class or factory (`compresskit.models.hf` marks its factories), else "image". An import path is
    imported: call this only for a model the user named.
    """
    ctor = resolve(name)
    if ":" not in name:
        return _INPUTS[name]
    kind = getattr(ctor, "input_kind", "image")
    if kind not in INPUT_KINDS:
        raise InputError(f"model {name!r}: input_kind {kind!r} is not one of {INPUT_KINDS}")
    return kind


def tiny(name: str, *, in_shape=None, num_classes: int = 10, seed: int = 0) -> nn.Module:
    """A small seeded instance of a zoo model, for tests and examples (default input: 1x8x8
    images, or 16 tokens for a token model)."""
    resolve(name)
    if in_shape is None:
        in_shape = (16,) if _INPUTS[name] == "tokens" else (1, 8, 8)
    kwargs = {**_TINY[name], "in_shape": list(in_shape), "num_classes": num_classes}
    return build(ModelSpec(name, kwargs), seed=seed)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
