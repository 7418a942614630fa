"""Host-side helpers of the triton backend: activation codes, recipe parameters, small integer helpers.

Imports triton only through ``_jit`` (the kernels' constants); everything else is plain Python / torch.
"""

from __future__ import annotations

import functools

import torch

from reference.activation import (
    SWIGLUOAI_DEFAULT_ALPHA,
    SWIGLUOAI_DEFAULT_LIMIT,
    SWIGLUSTEP_LIMIT,
    MoEActivation,
)

from . import _jit

__all__ = [
    "INTERPRET", "cdiv", "next_pow2", "round_up", "activation_code", "act_params", "recipe_params",
    "check_device", "fp8_capable",
]

INTERPRET = _jit.INTERPRET

_ACT_CODES = {
    MoEActivation.SILU: _jit.ACT_SILU,
    MoEActivation.GELU: _jit.ACT_GELU,
    MoEActivation.GELU_TANH: _jit.ACT_GELU_TANH,
    MoEActivation.SWIGLUOAI: _jit.ACT_SWIGLUOAI,
    MoEActivation.SWIGLUOAI_UNINTERLEAVE: _jit.ACT_SWIGLUOAI_UNINTERLEAVE,
    MoEActivation.SWIGLUSTEP: _jit.ACT_SWIGLUSTEP,
    MoEActivation.SILU_NO_MUL: _jit.ACT_SILU_NO_MUL,
    MoEActivation.GELU_NO_MUL: _jit.ACT_GELU_NO_MUL,
    MoEActivation.RELU2_NO_MUL: _jit.ACT_RELU2_NO_MUL,
}

SUPPORTED_ACTIVATIONS = frozenset(_ACT_CODES)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def activation_code(activation: MoEActivation) -> int:
    """The kernels' ``ACT`` code of a ``MoEActivation``.

    Raises:
        ValueError: gated RELU2 (undefined, as in the reference) or an activation the kernels do not implement.
    """
    try:
        return _ACT_CODES[activation]
    except KeyError:
        raise ValueError(f"the triton backend does not implement activation {activation} "
                         f"(supported: {sorted(a.value for a in _ACT_CODES)})") from None


def act_params(activation: MoEActivation, alpha, beta, limit) -> tuple[float, float, float, bool]:
    """Resolve ``(alpha, beta, limit, has_limit)`` with the reference's defaults per activation."""
    A = MoEActivation
    if activation is A.SWIGLUOAI:
        return (SWIGLUOAI_DEFAULT_ALPHA if alpha is None else float(alpha), 0.0,
                SWIGLUOAI_DEFAULT_LIMIT if limit is None else float(limit), True)
    if activation is A.SWIGLUOAI_UNINTERLEAVE:
        return (1.0 if alpha is None else float(alpha), 0.0 if beta is None else float(beta),
                0.0 if limit is None else float(limit), limit is not None)
    if activation is A.SWIGLUSTEP:
        return 1.0, 0.0, SWIGLUSTEP_LIMIT if limit is None else float(limit), True
    if activation is A.SILU:
        return 1.0, 0.0, 0.0 if limit is None else float(limit), limit is not None
    return 1.0, 0.0, 0.0, False


def recipe_params(recipe) -> dict:
    """Kernel parameters of a ``reference.quant`` recipe (name or ``QuantRecipe``).

    Returns ``amax_floor``, ``ue8m0_floor`` (floats) and the constexprs ``UE8M0_EXACT`` (``ceil_to_ue8m0`` vs
    vLLM's ``exp2(ceil(log2))``), ``RECIP_MUL`` (``x * (1/s)`` vs ``x / s``), ``SCALE_INV`` (``1/(448/amax)``).

    Raises:
        ValueError: unknown recipe name or an overflow mode other than saturate.
    """
    from reference.quant.recipes import get_recipe

    r = get_recipe(recipe)
    if r.overflow != "saturate":
        raise ValueError(f"recipe {r.name!r}: only saturating FP8 overflow is implemented, got {r.overflow!r}")
    return dict(
        amax_floor=float(r.amax_floor),
        ue8m0_floor=float(r.ue8m0_scale_floor),
        UE8M0_EXACT=r.ue8m0_rounding == "ceil_to_ue8m0",
        RECIP_MUL=r.quant_op == "reciprocal_multiply",
        SCALE_INV=r.scale_computation == "1/(max/amax)",
    )


def check_device(*tensors: torch.Tensor, what: str = "operands") -> torch.device:
    """All tensors on one device, and that device usable by the kernels (CUDA, or CPU under the interpreter).

    Raises:
        ValueError: mixed devices, or a CPU tensor without ``TRITON_INTERPRET=1`` / a CUDA tensor under it.
    """
    devs = {t.device for t in tensors if t is not None}
    if len(devs) != 1:
        raise ValueError(f"triton backend: {what} must be on one device, got {sorted(map(str, devs))}")
    dev = devs.pop()
    if INTERPRET and dev.type != "cpu":
        raise ValueError(f"triton backend: TRITON_INTERPRET=1 runs kernels on CPU tensors, got {what} on {dev}")
    if not INTERPRET and dev.type != "cuda":
        raise ValueError(f"triton backend: {what} must be CUDA tensors (or set TRITON_INTERPRET=1 for CPU), "
                         f"got {dev}")
    return dev


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def fp8_capable(device: torch.device | None = None) -> bool:
    """FP8 ``tl.dot`` needs sm_89+ (true under the interpreter)."""
    if INTERPRET:
        return True
    if not torch.cuda.is_available():
        return False
    idx = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    return _capability(idx) >= (8, 9)
