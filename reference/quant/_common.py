"""Shared constants, argument checks and bit-level helpers for ``reference.quant``.

Private module: the public names are re-exported by the format modules and by
``reference.quant``. Everything here is pure torch and CPU-runnable.
"""

from __future__ import annotations

import math

import torch

# Largest finite float8_e4m3fn value (0x7E / 0xFE). 0x7F / 0xFF are NaN, there is no inf.
FP8_E4M3_MAX = 448.0
# Largest E2M1 magnitude (code 7 / 15).
FP4_E2M1_MAX = 6.0

# The quantizers accept the activation / weight dtypes the kernels take. float64 is refused on
# purpose: a kernel never sees it, and converting it to fp32 would add a rounding the kernels do
# not have.
HIGH_PRECISION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# fp32 bit fields.
_F32_EXP_MASK = 0x7F800000
_F32_MANT_MASK = 0x007FFFFF
# 2^-127 is an fp32 subnormal: exponent field 0, mantissa 0x400000.
_F32_BITS_2_POW_M127 = 0x00400000


def check_tensor(x: object, name: str) -> torch.Tensor:
    """Raise TypeError unless ``x`` is a torch.Tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_high_precision(x: object, name: str = "x") -> torch.Tensor:
    """Raise TypeError unless ``x`` is a float16 / bfloat16 / float32 tensor."""
    check_tensor(x, name)
    assert isinstance(x, torch.Tensor)
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"{name} must be a floating tensor of dtype float16, bfloat16 or float32 "
            f"(the dtypes the kernels quantize), got {x.dtype}"
        )
    return x


def check_dtype(x: object, name: str, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """Raise TypeError unless ``x`` is a tensor whose dtype is one of ``dtypes``."""
    check_tensor(x, name)
    assert isinstance(x, torch.Tensor)
    if x.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {x.dtype}")
    return x


def check_contiguous(x: torch.Tensor, name: str, fn: str) -> None:
    """Raise ValueError if ``x`` is not contiguous (the kernel ``fn`` mirrors requires it)."""
    if not x.is_contiguous():
        raise ValueError(
            f"{fn}: {name} must be contiguous (the kernel it mirrors requires it); "
            f"got shape {tuple(x.shape)} with strides {tuple(x.stride())}. Call .contiguous() first."
        )


def check_positive_int(v: object, name: str) -> int:
    """Raise ValueError unless ``v`` is a positive int (bool excluded)."""
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v



def check_block_weight(w: object, block_shape, fn: str) -> tuple[int, int]:
    """A block-quantized weight's arguments: ``w`` high precision ``(N, K)`` or ``(E, N, K)`` and ``block_shape``
    ``(bn, bk)`` of positive ints; returns ``(bn, bk)``. Raises TypeError (dtype) or ValueError naming ``fn``."""
    check_high_precision(w, "w")
    if w.dim() not in (2, 3):
        raise ValueError(f"{fn}: w must be (N, K) or (E, N, K), got shape {tuple(w.shape)}")
    if len(block_shape) != 2:
        raise ValueError(f"{fn}: block_shape must be (bn, bk), got {block_shape!r}")
    return check_positive_int(block_shape[0], "block_shape[0]"), check_positive_int(block_shape[1], "block_shape[1]")

def check_last_dim_multiple(x: torch.Tensor, group: int, fn: str, what: str = "group_size") -> None:
    """Raise ValueError unless x.shape[-1] is a multiple of ``group``."""
    if x.dim() == 0:
        raise ValueError(f"{fn}: input must have at least one dimension, got a 0-d tensor")
    k = x.shape[-1]
    if k % group != 0:
        raise ValueError(
            f"{fn}: the last dimension K={k} is not a multiple of {what}={group}; "
            f"pad K to a multiple of {group} (K % {group} = {k % group})"
        )


def scalar_scale(scale: object, name: str) -> torch.Tensor:
    """A single positive finite scale as a 0-d fp32 tensor; ValueError / TypeError otherwise."""
    if isinstance(scale, bool):
        raise TypeError(f"{name} must be a float or a one-element tensor, got bool")
    if isinstance(scale, (int, float)):
        t = torch.tensor(float(scale), dtype=torch.float32)
    elif isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(
                f"{name} must have exactly one element (per-tensor), got shape {tuple(scale.shape)}"
            )
        if not (scale.dtype.is_floating_point and scale.dtype in HIGH_PRECISION_DTYPES):
            raise TypeError(f"{name} must be a floating tensor (fp16/bf16/fp32), got {scale.dtype}")
        t = scale.detach().reshape(()).to(torch.float32)
    else:
        raise TypeError(f"{name} must be a float or a one-element tensor, got {type(scale).__name__}")
    v = float(t)
    if not math.isfinite(v) or v <= 0.0:
        raise ValueError(f"{name} must be positive and finite, got {v!r}")
    return t


def rdiv(numerator: float, t: torch.Tensor) -> torch.Tensor:
    """IEEE fp32 ``numerator / t`` elementwise.

    Needed because torch evaluates ``python_scalar / tensor`` as ``tensor.reciprocal() *
    scalar`` (two roundings; it differs from true division in ~25 % of fp32 cases for
    ``448 / amax``). ``1.0 / t`` is exact either way, other numerators are not.
    """
    return torch.full_like(t, numerator) / t


# The same trap the other way round: on CUDA, ``tensor / python_scalar`` is computed as ``tensor * (1 / scalar)``
# (observed on an H200: 55% of ``amax / 448`` results differ from IEEE division), while the CPU kernel divides.
# The reference divides by a full tensor (``t / torch.full_like(t, d)``) wherever the divisor is a constant, so it
# gives the same bits on every device.


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints."""
    return -(-a // b)


def align(x: int, y: int) -> int:
    """Round ``x`` up to a multiple of ``y`` (DeepGEMM ``align``)."""
    return cdiv(x, y) * y


def f32_bits(x: torch.Tensor) -> torch.Tensor:
    """The IEEE-754 bit pattern of ``x`` converted to fp32, as int32 (same shape)."""
    return x.to(torch.float32).contiguous().view(torch.int32)


def bits_f32(bits: torch.Tensor) -> torch.Tensor:
    """Reinterpret int32 bit patterns as fp32 (same shape)."""
    return bits.to(torch.int32).contiguous().view(torch.float32)


def to_e4m3_satfinite(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` (any float dtype, via fp32) to float8_e4m3fn, RNE, saturating finite overflow
    and +-inf to +-448. Same shape, dtype float8_e4m3fn.

    Mirrors the kernels' ``__nv_fp8_e4m3`` / ``__NV_SATFINITE`` conversion and vLLM's
    ``fminf(fmaxf(v, -448), 448)`` before the cast.

    The clamp happens *before* the cast so the result does not depend on the torch version:
    torch 2.11 turns |x| > 464 into NaN on CPU, torch 2.14 saturates (pytorch #178817); GPU
    kernels saturate (``__NV_SATFINITE``). NaN stays NaN (torch.clamp propagates NaN).
    """
    return x.to(torch.float32).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def e8m0_to_fp32(b: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 bytes to fp32: byte b -> 2^(b-127); byte 0 -> 2^-127 (subnormal); 255 -> NaN.

    Accepts uint8 or torch.float8_e8m0fnu (viewed as its byte). Same shape, dtype float32.
    Mirrors the OCP MX v1.0 E8M0 definition (ml_dtypes ``float8_e8m0fnu``, torch
    ``float8_e8m0fnu``, torchao ``get_fp_scale``). Raises TypeError for other dtypes.
    """
    check_tensor(b, "scales")
    if b.dtype == torch.float8_e8m0fnu:
        b = b.contiguous().view(torch.uint8)
    if b.dtype != torch.uint8:
        raise TypeError(f"E8M0 scales must be uint8 bytes (or float8_e8m0fnu), got {b.dtype}")
    bi = b.to(torch.int32)
    bits = torch.where(bi == 0, torch.full_like(bi, _F32_BITS_2_POW_M127), bi << 23)
    out = bits_f32(bits)
    return torch.where(bi == 255, torch.full_like(out, float("nan")), out)


def fp32_pow2_to_e8m0(x: torch.Tensor, name: str = "scales") -> torch.Tensor:
    """Exponent byte of fp32 powers of two: 2^e -> e + 127 (e in [-127, 127]); NaN -> 255.

    Raises ValueError for anything else (zero, negative, inf, non-power-of-two, 2^-128 or
    smaller): such a value has no E8M0 encoding, and writing its exponent field anyway would
    silently leak or drop mantissa bits (DeepGEMM #337).
    """
    x = x.to(torch.float32)
    bits = f32_bits(x)
    expf = (bits >> 23) & 0xFF
    mant = bits & _F32_MANT_MASK
    nan = torch.isnan(x)
    normal_pow2 = (bits > 0) & (expf >= 1) & (expf <= 254) & (mant == 0)
    sub_pow2 = bits == _F32_BITS_2_POW_M127
    ok = nan | normal_pow2 | sub_pow2
    if not bool(ok.all()):
        bad = x[~ok].flatten()[:4].tolist()
        raise ValueError(
            f"{name}: every value must be a power of two in [2^-127, 2^127] (or NaN) to have a "
            f"UE8M0 encoding; offending values include {bad}"
        )
    byte = torch.where(sub_pow2, torch.zeros_like(expf), expf)
    byte = torch.where(nan, torch.full_like(byte, 255), byte)
    return byte.to(torch.uint8)
