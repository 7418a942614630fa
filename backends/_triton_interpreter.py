"""Triton-interpreter compatibility shared by the backends that ship Triton kernels (``triton``, ``deep_gemm``).

Only :func:`patch_interpreter_index` lives here: it changes nothing on a GPU and is applied only under
``TRITON_INTERPRET=1`` (the CPU tests run the kernels in Triton's interpreter).
"""

from __future__ import annotations

import os

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def patch_interpreter_index() -> None:
    """Triton 3.6's interpreter implements ``tensor.__index__`` as ``int(array)`` on a 1-element array, which
    numpy >= 2.3 refuses ("only 0-dimensional arrays can be converted"), so every ``for i in range(n)`` with a
    runtime bound fails. Re-register ``__index__`` through ``.item()`` (interpreter mode only; no effect on GPU)."""
    try:
        from triton.runtime import interpreter as _interp
    except ImportError:  # pragma: no cover - other triton layouts
        return
    orig = getattr(_interp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_moe_patched", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._moe_patched = True
    _interp._patch_lang_tensor = patched


if INTERPRET:
    patch_interpreter_index()
