"""The backends' extra timed variants for ``python -m benchmarks`` and ``python -m benchmarks.breakdown --gemms``:
one module per built-in backend, named in ``VARIANTS`` (a static table; nothing is imported by a built name).

A module offers any of ``variants(shape, M, inputs, device) -> [(name, call(i))]`` (the GEMM stage alone, which the
peers' figures time), ``extra(shape, inputs) -> {column: text}`` and ``gate_variants(gate_shape, M, sets) ->
[(name, call(i))]``. The modules import only torch at import time; the backend is imported when a variant is built.
"""

from __future__ import annotations

from types import ModuleType

from benchmarks.variants import cuda, deep_gemm, triton

__all__ = ["VARIANTS", "for_backend"]

VARIANTS: dict[str, ModuleType] = {"triton": triton, "cuda": cuda, "deep_gemm": deep_gemm}


def for_backend(name: str) -> ModuleType | None:
    """The variants module of backend ``name``, or None when it has none (``torch``, out-of-tree backends)."""
    return VARIANTS.get(name)
