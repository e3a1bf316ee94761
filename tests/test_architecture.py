"""The dependency rules of DESIGN.md, held by a test rather than by good intentions.

cli -> compressor | distrib -> models;  compressor x distrib;  nothing -> cli
the library (compressor, distrib, models) never prints, exits, or imports click
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["cli", "compressor", "distrib", "models"]
FORBIDDEN = {
    "models": {"cli", "compressor", "distrib", "click", "rich"},
    "compressor": {"cli", "distrib", "click", "rich"},
    "distrib": {"cli", "compressor", "click", "rich"},
    "cli": set(),
    # the Python API (compresskit/api.py) joins compressor and distrib as the CLI does, but is
    # library code: no click, no printing
    "compresskit": {"cli", "click", "rich"},
}


def _modules(package):
    return sorted((ROOT / package).rglob("*.py"))


def _imported(path):
    """(line, dotted name) of every absolute import in a file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module


def _imports(path):
    """(line, package) per import: our own as cli/compressor/distrib/models, others' top level."""
    for line, name in _imported(path):
        parts = name.split(".")
        yield line, parts[1] if parts[0] == "compresskit" and len(parts) > 1 else parts[0]


@pytest.mark.parametrize("package", [*PACKAGES, "compresskit"])
def test_dependency_direction(package):
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in _modules(package)
        for line, name in _imports(path)
        if name in FORBIDDEN[package]
    ]
    assert not bad, bad


def test_own_packages_are_imported_under_compresskit_only():
    """A bare `import models` would pick up the user's models.py (or another project's `models`
    package) instead of ours: every import of our own code names the `compresskit` root."""
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for folder in [*PACKAGES, "compresskit", "tests", "benchmarks"]
        for path in _modules(folder)
        for line, name in _imported(path)
        if name.split(".")[0] in PACKAGES
    ]
    assert not bad, bad


# The main function of a process the library spawns ends that process, not its caller's:
# launch._entry leaves with os._exit once the rank has reported (see there why), and its
# _leave_with_launcher thread when the launcher that started the rank is gone.
PROCESS_MAINS = {("distrib/launch.py", "_entry"), ("distrib/launch.py", "_leave_with_launcher")}


def _calls(tree, path):
    """Call nodes of `tree`, leaving out the bodies of the spawned processes' main functions."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and (path, node.name) in PROCESS_MAINS:
            skip |= {id(n) for n in ast.walk(node)}
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and id(n) not in skip]


@pytest.mark.parametrize("package", ["compressor", "distrib", "models", "compresskit"])
def test_library_never_prints_or_exits(package):
    bad = []
    for path in _modules(package):
        rel = str(path.relative_to(ROOT))
        for node in _calls(ast.parse(path.read_text()), rel):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")
            if name in {"print", "exit", "_exit", "quit"}:
                bad.append(f"{rel}:{node.lineno} calls {name}")
    assert not bad, bad


@pytest.mark.parametrize("package", [*PACKAGES, "compresskit"])
def test_every_text_file_names_its_encoding(package):
    """report.md says Δ: written in Windows' local code page (cp1252) it raised
    UnicodeEncodeError after the whole run, and the staging folder went with it."""
    bad = []
    for path in _modules(package):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")
            kw = {k.arg: k.value for k in node.keywords}
            if isinstance(f, ast.Name) and name == "open":  # open(path, mode)
                mode = kw.get("mode", node.args[1] if len(node.args) > 1 else None)
            elif name == "open" and not (isinstance(f.value, ast.Name) and f.value.id == "os"):
                mode = kw.get("mode", node.args[0] if node.args else None)  # Path.open(mode)
                if mode is not None and not isinstance(mode, ast.Constant):
                    continue  # a zip member, z.open(info): bytes
            elif name in {"read_text", "write_text"}:
                mode = None
            else:
                continue
            binary = isinstance(mode, ast.Constant) and "b" in str(mode.value)
            if not binary and "encoding" not in kw:
                bad.append(f"{rel}:{node.lineno} {name} without encoding=")
    assert not bad, bad


def test_light_imports_do_not_load_onnx_or_sklearn():
    code = (
        "import sys; from compresskit import compressor, distrib, models;"
        "import compresskit.models.zoo, compresskit.models.checkpoint, compresskit.distrib.trainer;"
        "heavy = [m for m in ('onnx', 'onnxruntime', 'sklearn', 'click') if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_import_compresskit_is_instant():
    """The API's names load on first use: `import compresskit` alone loads no torch."""
    code = (
        "import sys, compresskit; assert sorted(compresskit.__all__) == compresskit.__all__;"
        "print(','.join(m for m in ('torch', 'onnx', 'onnxruntime', 'sklearn') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
