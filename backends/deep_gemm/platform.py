"""Where the ``deep_gemm`` backend can run: the package, the GPU, its compute capability.

Everything the backend asks of the machine goes through the three functions below, so tests replace them
(``monkeypatch.setattr(platform, "current_capability", lambda: (9, 0))``) and every predicate is checked on a CPU
machine. Nothing here imports ``deep_gemm`` at module import time: the import initialises CUDA and JIT state, and
on a machine without a GPU it is never attempted.

Why availability actually *calls* DeepGEMM (:func:`deep_gemm_abi_error`): ``sgl-deep-gemm 0.2.0`` imports fine on
the project's GPU machine (torch 2.11.0+cu130) but every entry point that takes a tensor fails with
``Assertion error (.../utils/layout.hpp:16): dim == 2 or dim == 3`` - even
``get_mn_major_tma_aligned_tensor`` of a plain 2-D fp32 tensor, and whatever the argument layout. Its ``_C.so`` was
compiled against newer torch headers (the ``TensorImpl.h`` assertion lines embedded in it match torch >= 2.12),
so the inline ``at::Tensor::dim()`` it calls reads the wrong field of torch 2.11's ``TensorImpl``; tvm-ffi itself
sees the right shape. An import test cannot tell, so the probe runs one tiny layout call and reports the error.
"""

from __future__ import annotations

import functools
import importlib.util

__all__ = [
    "PACKAGE",
    "PIP_HINT",
    "KNOWN_GOOD",
    "current_capability",
    "device_name",
    "deep_gemm_installed",
    "deep_gemm_abi_error",
    "import_deep_gemm",
    "deep_gemm_version",
    "is_sm90",
    "capability_family",
]

#: Importable module name (provided by several distributions: sgl-deep-gemm, tokenspeed-deepgemm, source builds).
PACKAGE = "deep_gemm"
#: What to install on the project's GPU machine (torch 2.11.0+cu130, Python 3.12): a build whose ``_C`` matches
#: torch 2.11's ABI. Checked on an H200 (2026-11-21): tokenspeed-deepgemm 2.5.0.post20260424 and .post20260604 work;
#: sgl-deep-gemm 0.2.0 loads but is ABI-broken (see the module docstring); tokenspeed-deepgemm
#: 2.5.0.post20260810 / 2.8.2 and sgl-deep-gemm >= 0.2.2 fail to load (undefined c10 symbols of newer torch).
KNOWN_GOOD = "tokenspeed-deepgemm==2.5.0.post20260604"
PIP_HINT = f"pip install -e '.[deep_gemm]' (on torch 2.11: {KNOWN_GOOD})"


def current_capability() -> tuple[int, int] | None:
    """``torch.cuda.get_device_capability()`` of the current device, or None without a usable CUDA GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())  # type: ignore[return-value]


def device_name() -> str:
    """Name of the current CUDA device ("cpu" without one)."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def deep_gemm_installed() -> bool:
    """Whether ``import deep_gemm`` can find a module (does not import it)."""
    return importlib.util.find_spec(PACKAGE) is not None


def capability_family(cap: tuple[int, int] | None) -> int | None:
    """vLLM's ``is_device_capability_family``: ``major * 10`` (SM90 -> 90, SM100/SM103 -> 100, SM120 -> 120)."""
    return None if cap is None else cap[0] * 10


def is_sm90(cap: tuple[int, int] | None) -> bool:
    """Hopper (compute capability 9.x): the only family whose FP8 path this backend implements and verified."""
    return cap is not None and cap[0] == 9


def import_deep_gemm():
    """``import deep_gemm`` with a clear error.

    Raises:
        RuntimeError: the package is missing, or importing it failed (the message carries the cause and the
            install hint).
    """
    if not deep_gemm_installed():
        raise RuntimeError(f"{PACKAGE} is not installed ({PIP_HINT})")
    try:
        import deep_gemm  # noqa: PLC0415
    except Exception as exc:  # undefined symbols of another torch build show up here
        raise RuntimeError(
            f"import {PACKAGE} failed: {type(exc).__name__}: {exc}. The installed build does not match this "
            f"torch; {PIP_HINT}"
        ) from exc
    return deep_gemm


def deep_gemm_version() -> str:
    """Distribution and version that provides ``deep_gemm`` (package metadata only: never imports the module,
    whose import initialises CUDA). "not installed" when absent."""
    if not deep_gemm_installed():
        return "not installed"
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("tokenspeed-deepgemm", "sgl-deep-gemm", "deep-gemm", "deep_gemm"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "installed (distribution unknown)"


@functools.lru_cache(maxsize=1)
def deep_gemm_abi_error() -> str | None:
    """None if the installed ``deep_gemm`` handles torch tensors correctly here, else why not (cached).

    Imports ``deep_gemm`` and transposes a ``(5, 4)`` fp32 CUDA tensor into the MN-major TMA-aligned layout with
    ``deep_gemm.get_mn_major_tma_aligned_tensor`` - the first thing every FP8 GEMM does with its scales - and checks
    the values. Call only when a CUDA GPU is present.
    """
    import torch

    try:
        dg = import_deep_gemm()
    except RuntimeError as exc:
        return str(exc)
    try:
        sf = torch.arange(20, dtype=torch.float32, device="cuda").reshape(5, 4)
        out = dg.get_mn_major_tma_aligned_tensor(sf)
        if not isinstance(out, torch.Tensor):
            out = torch.from_dlpack(out)
        if tuple(out.shape) != (5, 4) or not torch.equal(out, sf):
            return (f"deep_gemm {getattr(dg, '__version__', '?')}: get_mn_major_tma_aligned_tensor returned wrong "
                    f"values; {PIP_HINT}")
    except Exception as exc:
        return (
            f"deep_gemm {getattr(dg, '__version__', '?')} is installed but unusable with torch {torch.__version__}: "
            f"{type(exc).__name__}: {str(exc).strip()[:200]} (its compiled _C does not match this torch's ABI; "
            f"{PIP_HINT})"
        )
    return None
