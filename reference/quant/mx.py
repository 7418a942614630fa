"""OCP Microscaling formats: E8M0 scales, MXFP8 (E4M3 elements) and MXFP4 (E2M1 elements), one
scale per 32 consecutive elements along the last dimension; E2M1 encode / decode and nibble packing.

Scale rules (``amax = 2^E * m``, ``1 <= m < 2``, ``emax`` = exponent of the element's largest
normal: 8 for E4M3, 2 for E2M1), all computed on the fp32 bits of amax:

- ``"floor"`` (OCP MX v1.0): ``X = 2^(E - emax)``. Elements may exceed the element max and
  saturate (E4M3 up to 511.9 -> 448).
- ``"ceil"``: ``E + [m != 1] - emax`` (torchao CEIL).
- ``"even"``: round amax's mantissa to ``mbits`` (3 for E4M3, 1 for E2M1) by adding
  ``1 << (22 - mbits)`` to the bits, then FLOOR (torchao EVEN; vLLM CUTLASS MXFP4 since #43557).
  E4M3: ``FLOOR + [m >= 1.9375]``; E2M1: ``FLOOR + [m >= 1.75]``.
- ``"rceil"``: ``ceil(log2(amax / elem_max))`` exactly (cuDNN / DeepGEMM / TensorRT-LLM):
  E4M3 (448 = 1.75 * 2^8): ``FLOOR + [m > 1.75]``; E2M1 (6 = 1.5 * 2^2): ``FLOOR + [m > 1.5]``.

The unbiased exponent is clamped to ``[-127, 127]`` and stored as the byte ``e + 127``.

Defined edge cases:
- all-zero block: amax 0 -> byte 0 (``2^-127``) under every rule, all codes +0.
- block containing NaN or +-inf: byte 0xFF (E8M0 NaN); MXFP8 codes NaN (0x7F), MXFP4 codes 0
  (E2M1 has no NaN); dequantization gives NaN for the whole block.
- subnormal amax: FLOOR clamps to byte 0.
"""

from __future__ import annotations

import torch

from ._common import (
    FP4_E2M1_MAX,
    check_dtype,
    check_high_precision,
    check_last_dim_multiple,
    check_tensor,
    e8m0_to_fp32,
    f32_bits,
    to_e4m3_satfinite,
)

__all__ = [
    "MX_BLOCK_SIZE",
    "FP4_E2M1_MAX",
    "MX_SCALE_RULES",
    "E2M1_VALUES",
    "e8m0_to_fp32",
    "mx_scale_e8m0",
    "mxfp8_quantize",
    "mxfp8_dequantize",
    "e2m1_encode",
    "e2m1_decode",
    "pack_fp4",
    "unpack_fp4",
    "mxfp4_quantize",
    "mxfp4_dequantize",
]

MX_BLOCK_SIZE = 32
MX_SCALE_RULES = ("floor", "ceil", "even", "rceil")

#: E2M1 value of each code 0..15 (bit 3 is the sign; code 8 is -0.0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# element name -> (emax, mantissa bits, fp32 mantissa field of the element's max normal)
_ELEMENTS = {
    "e4m3": (8, 3, 0x600000),  # 448 = 1.75 * 2^8
    "e2m1": (2, 1, 0x400000),  # 6 = 1.5 * 2^2
}

# Midpoints between consecutive E2M1 magnitudes, and whether a tie there rounds up (to the even
# code): 0.25 -> 0 (code 0), 0.75 -> 1.0 (code 2), 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0,
# 3.5 -> 4.0, 5.0 -> 4.0. Everything above 5 (including +inf) saturates to 6.
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def mx_scale_e8m0(amax: torch.Tensor, *, element: str, scale_rule: str = "floor") -> torch.Tensor:
    """E8M0 scale byte for each block amax under an MX scale rule (see module docstring).

    Args:
        amax: any shape, floating (its absolute value is used; converted to fp32).
        element: ``"e4m3"`` (MXFP8) or ``"e2m1"`` (MXFP4).
        scale_rule: ``"floor"`` (OCP), ``"ceil"``, ``"even"``, ``"rceil"``.

    Returns: uint8, same shape: ``clamp(e, -127, 127) + 127``; 0xFF where amax is NaN or inf.

    Mirrors torchao ``mx_formats/mx_tensor.py::to_mx`` (FLOOR / CEIL / EVEN) and the RCEIL rule of
    cuDNN / DeepGEMM (exact: never rounds amax/elem_max before the ceiling).

    Raises ValueError for an unknown element or rule, TypeError for a non-floating amax.
    """
    check_tensor(amax, "amax")
    if not amax.dtype.is_floating_point:
        raise TypeError(f"amax must be floating, got {amax.dtype}")
    if element not in _ELEMENTS:
        raise ValueError(f"element must be one of {sorted(_ELEMENTS)}, got {element!r}")
    if scale_rule not in MX_SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {list(MX_SCALE_RULES)}, got {scale_rule!r}")
    emax, mbits, max_mant = _ELEMENTS[element]
    a = amax.to(torch.float32).abs()
    bits = f32_bits(a)
    expf = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    if scale_rule == "floor":
        e = expf - 127
    elif scale_rule == "ceil":
        e = expf - 127 + (mant != 0).to(torch.int32)
    elif scale_rule == "even":
        # bits <= 0x7F7FFFFF for finite amax, so the add cannot reach the sign bit
        rounded = (bits + (1 << (22 - mbits))) & 0x7F800000
        e = (rounded >> 23) - 127
    else:  # rceil
        e = expf - 127 + (mant > max_mant).to(torch.int32)
    e = torch.clamp(e - emax, -127, 127)
    byte = e + 127
    byte = torch.where(torch.isfinite(a), byte, torch.full_like(byte, 255))
    return byte.to(torch.uint8)


def _blocks(x: torch.Tensor, fn: str) -> torch.Tensor:
    check_high_precision(x, "x")
    check_last_dim_multiple(x, MX_BLOCK_SIZE, fn, what="the MX block size")
    return x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK_SIZE, MX_BLOCK_SIZE)


def mxfp8_quantize(x: torch.Tensor, *, scale_rule: str = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8: E4M3 elements with one E8M0 scale per 32 elements of the last dimension.

    ``amax`` per block -> byte (:func:`mx_scale_e8m0`, element ``"e4m3"``) -> ``X = 2^(byte-127)``;
    ``q = e4m3_satfinite(x / X)`` (RNE, +-448 saturation). Mirrors the OCP MX v1.0 conversion and
    torchao ``to_mx``; vLLM's MXFP8 keys (kMxfp8Static / kMxfp8Dynamic, seed 001).

    Args:
        x: ``(..., K)`` float16 / bfloat16 / float32, ``K % 32 == 0``, any strides.
        scale_rule: ``"floor"`` (default, OCP), ``"ceil"``, ``"even"``, ``"rceil"``.

    Returns: ``(q, scales)``: q float8_e4m3fn ``(..., K)``; scales uint8 E8M0 bytes ``(..., K // 32)``.

    Raises TypeError (dtype) and ValueError (``K % 32 != 0``, unknown rule).
    """
    xb = _blocks(x, "mxfp8_quantize")
    byte = mx_scale_e8m0(xb.abs().amax(dim=-1), element="e4m3", scale_rule=scale_rule)
    scale = e8m0_to_fp32(byte).unsqueeze(-1)
    y = xb / scale  # exact division by a power of two (NaN for a poisoned block)
    poisoned = (byte == 255).unsqueeze(-1)
    y = torch.where(poisoned, torch.full_like(y, float("nan")), y)
    return to_e4m3_satfinite(y).reshape(x.shape), byte


def mxfp8_dequantize(q: torch.Tensor, scales: torch.Tensor, *, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * 2^(byte-127)`` per 32-element block (fp32 product, exact; one cast to ``out_dtype``).

    q float8_e4m3fn ``(..., K)``; scales uint8 ``(..., K // 32)``. Mirrors torchao
    ``to_dtype`` / the OCP MX v1.0 decode. Raises TypeError / ValueError on bad dtypes or shapes.
    """
    check_dtype(q, "q", (torch.float8_e4m3fn,))
    return _dequant_blocks(q.to(torch.float32), scales, out_dtype)


def _dequant_blocks(vals: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    check_dtype(scales, "scales", (torch.uint8, torch.float8_e8m0fnu))
    check_last_dim_multiple(vals, MX_BLOCK_SIZE, "MX dequantize", what="the MX block size")
    nb = vals.shape[-1] // MX_BLOCK_SIZE
    if tuple(scales.shape) != tuple(vals.shape[:-1]) + (nb,):
        raise ValueError(f"scales shape {tuple(scales.shape)} does not match values {tuple(vals.shape)} (block 32)")
    y = vals.reshape(*vals.shape[:-1], nb, MX_BLOCK_SIZE) * e8m0_to_fp32(scales).unsqueeze(-1)
    y = y.reshape(vals.shape)
    return y if out_dtype == torch.float32 else y.to(out_dtype)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round to E2M1 (FP4) codes: round-to-nearest-even, saturating to +-6.

    Matches ml_dtypes ``float4_e2m1fn``, torchao, vLLM's emulation and PTX
    ``cvt.rn.satfinite.e2m1x2.f32``. Magnitudes by code 0..7: ``{0, .5, 1, 1.5, 2, 3, 4, 6}``;
    bit 3 is the sign (taken from the sign bit, so ``-0.0`` and negatives that round to zero
    give code 8). ``+-inf`` -> code 7 / 15.

    Args: x any shape, floating (converted to fp32; exact from fp16 / bf16).
    Returns: uint8 codes 0..15, same shape, unpacked (see :func:`pack_fp4`).
    Raises: TypeError for a non-floating tensor; ValueError if x contains NaN (E2M1 has no NaN).
    """
    check_tensor(x, "x")
    if not x.dtype.is_floating_point:
        raise TypeError(f"e2m1_encode expects a floating tensor, got {x.dtype}")
    xf = x.to(torch.float32)
    if bool(torch.isnan(xf).any()):
        raise ValueError("e2m1_encode: E2M1 has no NaN encoding; input contains NaN")
    a = xf.abs()
    code = torch.zeros(xf.shape, dtype=torch.uint8, device=xf.device)
    for mid, tie_up in _E2M1_MIDPOINTS:
        code += (a >= mid if tie_up else a > mid).to(torch.uint8)
    return code | (torch.signbit(xf).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15) -> float32 values (code 8 -> -0.0). Same shape.

    Mirrors vLLM's ``E2M1_TO_FLOAT32`` table (``nvfp4_utils.py``) and ml_dtypes ``float4_e2m1fn``.

    Raises TypeError if not uint8, ValueError for a code above 15.
    """
    check_dtype(codes, "codes", (torch.uint8,))
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"E2M1 codes must be in 0..15, got max {int(codes.max())}")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.to(torch.int64)]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes two per byte along the last dim: element ``2i`` in the LOW nibble.

    ``(..., K)`` uint8 codes -> ``(..., K // 2)`` uint8 ``codes[2i] | codes[2i+1] << 4`` (PTX,
    vLLM, DeepGEMM, torchao after #3123). Raises TypeError if not uint8, ValueError for odd K or a
    code above 15.
    """
    check_dtype(codes, "codes", (torch.uint8,))
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dimension, got shape {tuple(codes.shape)}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"E2M1 codes must be in 0..15, got max {int(codes.max())}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: ``(..., K // 2)`` uint8 -> ``(..., K)`` uint8 codes."""
    check_dtype(packed, "packed", (torch.uint8,))
    if packed.dim() == 0:
        raise ValueError("unpack_fp4 needs at least one dimension")
    out = torch.stack((packed & 0xF, packed >> 4), dim=-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def mxfp4_quantize(x: torch.Tensor, *, scale_rule: str = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4: E2M1 elements (packed two per byte) with one E8M0 scale per 32 elements.

    ``amax`` per block -> byte (:func:`mx_scale_e8m0`, element ``"e2m1"``) -> ``X``;
    ``codes = e2m1_encode(x / X)`` (RNE, saturating to +-6). Mirrors the OCP MX v1.0 conversion,
    torchao ``to_mx`` and vLLM ``mxfp4_utils`` (vLLM's CUTLASS MXFP4 MoE uses ``scale_rule="even"``,
    DeepGEMM's tests ``"rceil"``).

    Args:
        x: ``(..., K)`` float16 / bfloat16 / float32, ``K % 32 == 0``.
        scale_rule: ``"floor"`` (default, OCP), ``"ceil"``, ``"even"``, ``"rceil"``.

    Returns: ``(packed, scales)``: packed uint8 ``(..., K // 2)`` (element 2i in the low nibble);
    scales uint8 E8M0 bytes ``(..., K // 32)``. Poisoned (non-finite) blocks: byte 0xFF, codes 0.

    Raises TypeError (dtype) and ValueError (``K % 32 != 0``, unknown rule).
    """
    xb = _blocks(x, "mxfp4_quantize")
    byte = mx_scale_e8m0(xb.abs().amax(dim=-1), element="e2m1", scale_rule=scale_rule)
    scale = e8m0_to_fp32(byte).unsqueeze(-1)
    poisoned = (byte == 255).unsqueeze(-1)
    y = torch.where(poisoned, torch.zeros_like(xb), xb / torch.where(poisoned, torch.ones_like(scale), scale))
    codes = e2m1_encode(y).reshape(x.shape)
    return pack_fp4(codes), byte


def mxfp4_dequantize(
    packed: torch.Tensor, scales: torch.Tensor, *, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``e2m1(code) * 2^(byte-127)`` per 32-element block (fp32, exact; one cast to ``out_dtype``).

    packed uint8 ``(..., K // 2)``; scales uint8 ``(..., K // 32)``. Returns ``(..., K)``.
    Mirrors vLLM ``mxfp4_utils.py::dequant_mxfp4`` emulation / torchao ``to_dtype``. Raises
    TypeError / ValueError on bad dtypes or shapes.
    """
    vals = e2m1_decode(unpack_fp4(packed))
    return _dequant_blocks(vals, scales, out_dtype)
