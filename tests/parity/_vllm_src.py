"""Load pure functions out of an unpacked vLLM source tree without installing or importing vLLM.

``load(tree, "vllm/.../file.py", ["fn", ...], extra={...})`` parses the file, takes the named top-level functions
and classes (at any nesting under ``if`` blocks, e.g. the ``if current_platform.is_cuda_alike():`` branch), drops
their decorators (``@torch.compile``, ``@triton.jit``, ``@CustomOp.register``) and executes their source in a
namespace of torch, ``torch.nn.functional as F``, ``IntEnum`` and the caller's stubs (``envs``, ``current_platform``,
...). Missing names fail when the function runs, so a test skips with the reason rather than guessing.
"""

from __future__ import annotations

import ast
import enum
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

ENV_SRC = "MOE_VLLM_SRC"


def tree() -> Path:
    """The unpacked sdist from ``$MOE_VLLM_SRC`` (set by ``nox -s parity``); skips the test without it."""
    src = os.environ.get(ENV_SRC)
    if not src and os.environ.get(ENV_SRC + "_ERROR"):
        pytest.skip(os.environ[ENV_SRC + "_ERROR"])
    if not src:
        pytest.skip(f"no vLLM source tree: run `nox -s parity -- --vllm 0.33.0` (sets ${ENV_SRC})")
    p = Path(src)
    if not (p / "vllm").is_dir():
        pytest.skip(f"${ENV_SRC}={src} is not an unpacked vLLM sdist")
    return p


def version(root: Path) -> str:
    for line in (root / "PKG-INFO").read_text().splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return root.name.removeprefix("vllm-")


def _find(nodes, names):
    found = {}
    for node in nodes:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names and node.name not in found:
            found[node.name] = node
        elif isinstance(node, ast.If):
            for k, v in _find(node.body + node.orelse, names).items():
                found.setdefault(k, v)
    return found


def load(root: Path, relpath: str, names: list[str], extra: dict | None = None) -> SimpleNamespace:
    """The named functions/classes of ``root/relpath`` as attributes; skips naming what is missing."""
    path = root / relpath
    if not path.exists():
        pytest.skip(f"{relpath} is not in vLLM {version(root)}")
    mod = ast.parse(path.read_text())
    found = _find(mod.body, set(names))
    missing = [n for n in names if n not in found]
    if missing:
        pytest.skip(f"{relpath} of vLLM {version(root)} has no {', '.join(missing)}")
    ns = {"torch": torch, "F": F, "IntEnum": enum.IntEnum, "Enum": enum.Enum, "__name__": f"vllm_src.{path.stem}"}
    ns.update(extra or {})
    for n in names:
        node = found[n]
        node.decorator_list = []
        code = compile(ast.Module(body=[node], type_ignores=[]), f"{path}::{n}", "exec")
        exec(code, ns)  # noqa: S102 - vLLM's own source, read from its sdist
    return SimpleNamespace(**{n: ns[n] for n in names}, namespace=ns)


def stub_envs(**overrides):
    base = dict(VLLM_BATCH_INVARIANT=True, VLLM_USE_FUSED_MOE_GROUPED_TOPK=False, VLLM_MOE_SKIP_PADDING=True,
                VLLM_MOE_ROUTING_SIMULATION_STRATEGY="")
    base.update(overrides)
    return SimpleNamespace(**base)


def stub_platform(cuda: bool = False, cpu: bool = False):
    return SimpleNamespace(is_cuda=lambda: cuda, is_cuda_alike=lambda: cuda, is_xpu=lambda: False,
                           is_cpu=lambda: cpu, is_rocm=lambda: False, simple_compile_backend="eager")
