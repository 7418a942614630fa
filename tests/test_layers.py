"""The layers depend one way (DESIGN.md, Layout; README.md, Architecture):
``specs <- reference <- backends <- conformance, benchmarks <- tools``; ``examples`` (clients) import anything but
``tools``; nothing imports ``tools`` (the laboratory, on top) or ``tests``.

Every module under the layers below is parsed with ``ast`` (nothing is imported, so GPU-only modules are checked on
any machine); each import of a project package, including function-local imports and
``importlib.import_module("...")`` with a literal name, is checked against the rules below. A failure names the
file, the line, the imported module and the rule it breaks. ``tests/`` is not a layer: a test may import anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("specs", "reference", "backends", "benchmarks", "conformance", "examples", "tools")
PROJECT = set(LAYERS) | {"tests"}

RULES = {
    "specs": (PROJECT - {"specs"}, "specs is data plus a loader: it imports nothing of the project"),
    "reference": ({"backends", "benchmarks", "conformance", "examples", "tools", "tests"},
                  "reference imports only specs"),
    "backends": ({"benchmarks", "conformance", "examples", "tools", "tests"},
                 "backends import reference and specs only, never benchmarks, conformance, examples, tools or tests"),
    "benchmarks": ({"conformance", "examples", "tools", "tests"},
                   "benchmarks import specs, reference and backends only (never conformance, examples, tools or "
                   "tests)"),
    "conformance": ({"examples", "tools", "tests"}, "conformance never imports examples, tools or tests"),
    "examples": ({"tools", "tests"}, "examples import anything but tools (and tests)"),
    "tools": ({"examples", "tests"}, "tools import the layers below them, never examples or tests"),
}
# nothing imports tools: every layer but tools itself forbids it (checked by test_nothing_imports_tools)

# Explicit exceptions, each with its reason; remove an entry when its reason goes away.
ALLOWED: dict[tuple[str, str], str] = {
    # (file relative to the repository root, imported top-level module): reason
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, source: str | None = None):
    """``(line, absolute dotted module)`` for every import in ``path`` (relative imports resolved); ``source``
    replaces the file's text."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield node.lineno, mod
            if not node.module:  # `from . import x`: x may be a sub-module
                for alias in node.names:
                    yield node.lineno, f"{mod}.{alias.name}"
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) == "import_module" or getattr(node.func, "id", None) in
                   ("import_module", "__import__"))):
            yield node.lineno, node.args[0].value


def _violation(path: Path, module: str) -> str | None:
    rel = path.relative_to(ROOT).as_posix()
    parts = rel.split("/")
    layer, top = parts[0], module.split(".")[0]
    if top not in PROJECT:
        return None
    if (rel, top) in ALLOWED:
        return None
    forbidden, why = RULES[layer]
    if top in forbidden:
        return why
    if layer == "backends" and top == "backends":
        own = parts[1] if len(parts) > 2 else None  # backends/__init__.py (the registry) is no backend
        mod = module.split(".")
        # backends/_*.py are shared helpers of the backends (no backend: nothing registers them)
        if own is not None and len(mod) > 1 and mod[1] != own and not mod[1].startswith("_"):
            return f"a backend never imports another backend (backends/{own} imports {module})"
    return None


def _files():
    for layer in LAYERS:
        yield from sorted((ROOT / layer).rglob("*.py"))


@pytest.mark.parametrize("layer", LAYERS)
def test_imports_point_one_way(layer):
    problems = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        for line, module in _imports(path):
            why = _violation(path, module)
            if why:
                problems.append(f"{path.relative_to(ROOT)}:{line}: imports {module}: {why}")
    assert not problems, "imports against the layer order:\n  " + "\n  ".join(problems)


def test_allow_list_is_current():
    """Every allow-list entry still matches an import (a fixed violation must leave the list)."""
    seen = {(p.relative_to(ROOT).as_posix(), m.split(".")[0]) for p in _files() for _, m in _imports(p)}
    stale = [k for k in ALLOWED if k not in seen]
    assert not stale, f"allow-list entries without a matching import (remove them): {stale}"


def test_nothing_imports_tools():
    """The laboratory is on top: every layer but ``tools`` itself forbids importing it."""
    assert all("tools" in RULES[layer][0] for layer in LAYERS if layer != "tools")
    assert set(RULES) == set(LAYERS)


def test_checker_sees_violations():
    """The checker itself: relative, function-local and importlib imports are resolved and judged."""
    src = ("import torch\nfrom .keys import QuantKey\nfrom .. import schemes\n"
           "def f():\n    from conformance.metrics import assert_close\n"
           "    importlib.import_module('backends.cuda')\n")
    got = [m for _, m in _imports(ROOT / "reference" / "quant" / "probe.py", src)]
    assert got == ["torch", "reference.quant.keys", "reference", "reference.schemes", "conformance.metrics",
                   "backends.cuda"], got
    assert _violation(ROOT / "reference" / "x.py", "conformance.metrics")
    assert _violation(ROOT / "specs" / "__init__.py", "reference")
    # a backend: reference, specs, its own modules and the shared backends/_*.py; no other backend, no layer above
    assert _violation(ROOT / "backends" / "triton" / "experts.py", "backends.cuda.experts")
    assert not _violation(ROOT / "backends" / "triton" / "experts.py", "backends.triton.quant")
    assert not _violation(ROOT / "backends" / "cuda" / "gate.py", "backends.cuda.build")
    assert not _violation(ROOT / "backends" / "triton" / "experts.py", "backends._validation")
    for above in ("benchmarks.timing", "conformance.metrics", "tools.triton.common", "examples.my_backend",
                  "tests.test_harness"):
        assert _violation(ROOT / "backends" / "triton" / "experts.py", above), above
    # benchmarks and conformance: one floor, neither imports tools
    assert _violation(ROOT / "benchmarks" / "harness.py", "conformance.schemes")
    assert _violation(ROOT / "benchmarks" / "variants" / "triton.py", "tools.triton.common")
    assert not _violation(ROOT / "benchmarks" / "variants" / "triton.py", "backends.triton.experts")
    assert not _violation(ROOT / "conformance" / "inputs.py", "reference.schemes")
    assert _violation(ROOT / "conformance" / "test_experts.py", "tools.diag.rebound")
    # tools on top: anything below, never examples or tests
    for below in ("specs", "reference.gate", "backends.triton.experts", "benchmarks.timing", "conformance.metrics",
                  "tools.triton.common"):
        assert not _violation(ROOT / "tools" / "triton" / "tune.py", below), below
    assert _violation(ROOT / "tools" / "triton" / "tune.py", "examples.my_backend")
    assert _violation(ROOT / "tools" / "diag" / "rebound.py", "tests.test_harness")
    # examples: anything but tools
    assert not _violation(ROOT / "examples" / "my_backend.py", "conformance.metrics")
    assert not _violation(ROOT / "examples" / "my_backend.py", "backends.torch")
    assert _violation(ROOT / "examples" / "my_backend.py", "tools.triton.tune")


# ------------------------------------------------------------------------------------------------------------
# Library code never lives in a test module, and packages talk through public names (DESIGN.md, Layout: "A module
# never imports a test_* module, nor a private name of another package").
# ------------------------------------------------------------------------------------------------------------

TOP_LEVEL_PACKAGES = PROJECT | {"tools", "examples", "scripts"}


def _imported_names(path: Path, source: str | None = None):
    """``(line, module, name)`` for every ``from module import name`` (``name`` None for ``import module``), relative
    imports resolved as in ``_imports``."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                yield node.lineno, mod, alias.name


def _test_module_or_private_import(path: Path, module: str, name: str | None) -> str | None:
    """Why ``path`` may not import ``name`` from ``module`` (None: it may). Test modules (``test_*.py``) are white-box
    tests of what they import, so the private-name rule binds library modules only; nothing imports a test module."""
    parts = module.split(".")
    if parts[0] not in TOP_LEVEL_PACKAGES:
        return None
    dotted = parts + ([name] if name else [])
    if any(p.startswith("test_") for p in dotted):
        return "a test module is no library: move what others use into a non-test module"
    if path.name.startswith("test_"):
        return None
    own = path.relative_to(ROOT).parts[0]
    if parts[0] != own and any(p.startswith("_") and not p.startswith("__") for p in dotted):
        return f"a private name of another package ({own}/ imports {'.'.join(dotted)}): make it public there"
    return None


def test_no_test_module_or_foreign_private_name_is_imported():
    problems = []
    for top in sorted(TOP_LEVEL_PACKAGES):
        for path in sorted((ROOT / top).rglob("*.py")) if (ROOT / top).is_dir() else []:
            for line, module, name in _imported_names(path):
                why = _test_module_or_private_import(path, module, name)
                if why:
                    problems.append(f"{path.relative_to(ROOT)}:{line}: {module} {name or ''}: {why}")
    assert not problems, "imports of test modules or of other packages' private names:\n  " + "\n  ".join(problems)


def test_test_module_and_private_checker_sees_violations():
    src = "from conformance.test_experts import moe_config_for\nfrom reference.experts import _x\nfrom . import _y\n"
    got = [_test_module_or_private_import(ROOT / "conformance" / "fuzz.py", m, n)
           for _, m, n in _imported_names(ROOT / "conformance" / "fuzz.py", src)]
    assert got[0] and got[1] and got[2] is None, got
    # a test module may test another package's private names, never import another test module
    assert _test_module_or_private_import(ROOT / "tests" / "test_x.py", "reference.experts", "_x") is None
    assert _test_module_or_private_import(ROOT / "tests" / "test_x.py", "tests.test_harness", "run_conformance")
    assert _test_module_or_private_import(ROOT / "tests" / "util.py", "backends.cuda._host", "f")
    assert _test_module_or_private_import(ROOT / "backends" / "cuda" / "x.py", "backends._common", "f") is None
