"""OCP Microscaling formats: E8M0 scales, MXFP8 (E4M3 elements), MXFP6 (E3M2 / E2M3 elements) and MXFP4
(E2M1 elements), one scale per 32 consecutive elements along the last dimension; E2M1 encode / decode and nibble
packing; FP6 encode / decode and the 4-in-3-bytes packing of vLLM's OCP MX checkpoints (see the FP6 section below).

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
    "FP6_ELEMENTS",
    "fp6_encode",
    "fp6_decode",
    "pack_fp6",
    "unpack_fp6",
    "mxfp6_quantize",
    "mxfp6_dequantize",
]

MX_BLOCK_SIZE = 32
MX_SCALE_RULES = ("floor", "ceil", "even", "rceil")

#: E2M1 value of each code 0..15 (bit 3 is the sign; code 8 is -0.0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# element name -> (emax, mantissa bits, fp32 mantissa field of the element's max normal)
_ELEMENTS = {
    "e4m3": (8, 3, 0x600000),  # 448 = 1.75 * 2^8
    "e2m1": (2, 1, 0x400000),  # 6 = 1.5 * 2^2
    "e3m2": (4, 2, 0x600000),  # 28 = 1.75 * 2^4 (MXFP6 E3M2)
    "e2m3": (2, 3, 0x700000),  # 7.5 = 1.875 * 2^2 (MXFP6 E2M3)
}

# Midpoints between consecutive E2M1 magnitudes, and whether a tie there rounds up (to the even
# code): 0.25 -> 0 (code 0), 0.75 -> 1.0 (code 2), 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0,
# 3.5 -> 4.0, 5.0 -> 4.0. Everything above 5 (including +inf) saturates to 6.
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def mx_scale_e8m0(amax: torch.Tensor, *, element: str, scale_rule: str = "floor") -> torch.Tensor:
    """E8M0 scale byte for each block amax under an MX scale rule (see module docstring).

    Args:
        amax: any shape, floating (its absolute value is used; converted to fp32).
        element: ``"e4m3"`` (MXFP8), ``"e3m2"`` / ``"e2m3"`` (MXFP6) or ``"e2m1"`` (MXFP4).
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


# ----------------------------------------------------------------------------------------------
# MXFP6 (OCP MX v1.0 FP6 elements: E3M2 and E2M3), as vLLM 0.33's OCP MX emulation runs them
# ----------------------------------------------------------------------------------------------
#
# Element formats (OCP MX v1.0 section 5.3.2; ml_dtypes ``float6_e3m2fn`` / ``float6_e2m3fn``; vLLM
# ``scalar_types.float6_e3m2f`` / ``float6_e2m3f``): a 6-bit code ``s eee mm`` (E3M2, bias 3, largest 28 =
# 1.75 * 2^4, smallest subnormal 2^-4) or ``s ee mmm`` (E2M3, bias 1, largest 7.5 = 1.875 * 2^2, smallest subnormal
# 2^-3); no inf, no NaN. Bit 5 is the sign, so code 32 is -0.0.
#
# vLLM 0.33 (``quantization/utils/mxfp6_utils.py``) calls AMD Quark: the E8M0 scale per 32 is Quark's
# ``even_round`` (``quark/torch/quantization/utils.py``: add ``1 << (22 - mbits)`` to amax's fp32 bits, keep sign and
# exponent, ``floor(log2) - emax``, clamp to [-127, 127]), i.e. this module's ``"even"`` rule; the elements are
# ``x / X`` rounded by Quark's ``fake_quantize_to_low_precision_fp`` (``hw_emulation/csrc/mx/funcs.cuh``
# ``fake_quantize_element``: round-to-nearest-even on the fp32 mantissa, subnormals included, then saturation to
# the largest finite value). Defined here, and where Quark differs:
# - +-inf saturates to +-max (ml_dtypes does the same; Quark passes inf through, which only an inf input makes);
# - NaN has no encoding: :func:`fp6_encode` raises; a block holding NaN or inf is poisoned as in MXFP8 / MXFP4
#   (scale byte 0xFF, codes 0, dequantized to NaN; Quark's ``even_round`` gives 2^127 for an inf block);
# - a negative value that rounds to zero keeps its sign (code 32, -0.0, as OCP and ml_dtypes); Quark's emulation
#   returns +0.0 (``if (mantissa == 0) return 0.0``): the same value.
# Storage: vLLM's checkpoints pack four 6-bit codes in three bytes (Quark ``utils/pack.py::Pack_fp6``:
# ``v0 | v1 << 6 | v2 << 12 | v3 << 18`` stored little-endian), :func:`pack_fp6` / :func:`unpack_fp6`. The MoE
# formats of ``reference.quant.moe`` keep one code per byte (unpacked), which a kernel receives as is.

#: element name -> (exponent bits, mantissa bits, exponent bias, largest finite value)
FP6_ELEMENTS = {"e3m2": (3, 2, 3, 28.0), "e2m3": (2, 3, 1, 7.5)}


def _fp6_params(element: str) -> tuple[int, int, int, float]:
    if element not in FP6_ELEMENTS:
        raise ValueError(f"FP6 element must be one of {sorted(FP6_ELEMENTS)}, got {element!r}")
    return FP6_ELEMENTS[element]


def fp6_encode(x: torch.Tensor, element: str) -> torch.Tensor:
    """Round to FP6 codes (``"e3m2"`` or ``"e2m3"``): round-to-nearest-even, subnormals, saturation to +-max.

    Computed on the fp32 bits: the magnitude's exponent ``e`` (``e < 1 - bias`` is the FP6 subnormal range, where
    the quantum is ``2^(1 - bias - mbits)``), the quantum ``2^(max(e, 1 - bias) - mbits)``, and ``|x| / quantum``
    (exact: a power-of-two division) rounded half-to-even by ``torch.round``; a result past the largest finite
    value saturates. Mirrors Quark's ``fake_quantize_element`` (vLLM 0.33 ``mxfp6_utils.py``) and matches ml_dtypes
    ``float6_e3m2fn`` / ``float6_e2m3fn`` on every finite fp32 (tests/test_quant_mx.py).

    Args: x any shape, floating (converted to fp32; exact from fp16 / bf16); element ``"e3m2"`` / ``"e2m3"``.
    Returns: uint8 codes 0..63, same shape (bit 5 the sign; code 32 = -0.0).
    Raises: TypeError for a non-floating tensor; ValueError for an unknown element or NaN in x.
    """
    ebits, mbits, bias, vmax = _fp6_params(element)
    check_tensor(x, "x")
    if not x.dtype.is_floating_point:
        raise TypeError(f"fp6_encode expects a floating tensor, got {x.dtype}")
    xf = x.to(torch.float32)
    if bool(torch.isnan(xf).any()):
        raise ValueError("fp6_encode: FP6 has no NaN encoding; input contains NaN")
    a = xf.abs().clamp(max=vmax)  # +-inf and everything past the largest value saturate
    e = ((f32_bits(a) >> 23) & 0xFF) - 127  # fp32 exponent field (a <= 28: never 255)
    e_q = torch.clamp(e, min=1 - bias) - mbits  # exponent of the FP6 quantum at a's binade
    quantum = torch.pow(torch.tensor(2.0), e_q.to(torch.float32))
    n = torch.round(a / quantum)  # integer multiple of the quantum, half to even
    v = torch.clamp(n * quantum, max=vmax)  # a rounding up past the largest value saturates
    # code of the (exact) FP6 value v: normal values 2^E (1 + m / 2^mbits), subnormals m * 2^(1 - bias - mbits)
    ev = ((f32_bits(v) >> 23) & 0xFF) - 127
    normal = ev >= 1 - bias
    sub_m = torch.round(v / 2.0 ** (1 - bias - mbits)).to(torch.int32)
    mant = (f32_bits(v) >> (23 - mbits)) & ((1 << mbits) - 1)
    code = torch.where(normal & (v > 0), ((ev + bias) << mbits) | mant, sub_m)
    return (code | (torch.signbit(xf).to(torch.int32) << 5)).to(torch.uint8)


def fp6_decode(codes: torch.Tensor, element: str) -> torch.Tensor:
    """FP6 codes (uint8 0..63) -> float32 values (same shape; code 32 -> -0.0). Mirrors ml_dtypes
    ``float6_e3m2fn`` / ``float6_e2m3fn`` and Quark's ``Pack_fp6.unpack`` value decode.

    Raises TypeError if not uint8, ValueError for a code above 63 or an unknown element."""
    ebits, mbits, bias, _ = _fp6_params(element)
    check_dtype(codes, "codes", (torch.uint8,))
    if codes.numel() and int(codes.max()) > 63:
        raise ValueError(f"FP6 codes must be in 0..63, got max {int(codes.max())}")
    c = codes.to(torch.int32)
    ef = (c >> mbits) & ((1 << ebits) - 1)
    m = (c & ((1 << mbits) - 1)).to(torch.float32)
    mag = torch.where(ef == 0, m * 2.0 ** (1 - bias - mbits),
                      (1.0 + m / (1 << mbits)) * torch.pow(torch.tensor(2.0), (ef - bias).to(torch.float32)))
    return torch.where((c & 0x20) != 0, -mag, mag)


def pack_fp6(codes: torch.Tensor) -> torch.Tensor:
    """Pack FP6 codes four into three bytes along the last dim (Quark ``Pack_fp6.pack``, vLLM 0.33's OCP MX
    checkpoints): ``w = c0 | c1 << 6 | c2 << 12 | c3 << 18`` stored as bytes ``w & 0xFF, w >> 8 & 0xFF, w >> 16``.

    ``(..., K)`` uint8 codes -> ``(..., 3 K / 4)`` uint8. Raises TypeError if not uint8, ValueError when K is not a
    multiple of 4 or a code exceeds 63."""
    check_dtype(codes, "codes", (torch.uint8,))
    if codes.dim() == 0 or codes.shape[-1] % 4:
        raise ValueError(f"pack_fp6 needs a last dimension divisible by 4, got shape {tuple(codes.shape)}")
    if codes.numel() and int(codes.max()) > 63:
        raise ValueError(f"FP6 codes must be in 0..63, got max {int(codes.max())}")
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], -1, 4)
    w = c[..., 0] | (c[..., 1] << 6) | (c[..., 2] << 12) | (c[..., 3] << 18)
    out = torch.stack((w & 0xFF, (w >> 8) & 0xFF, (w >> 16) & 0xFF), dim=-1).to(torch.uint8)
    return out.reshape(*codes.shape[:-1], codes.shape[-1] // 4 * 3)


def unpack_fp6(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp6`: ``(..., 3 K / 4)`` uint8 -> ``(..., K)`` uint8 codes (Quark ``Pack_fp6.unpack``).

    Raises TypeError if not uint8, ValueError when the last dimension is not a multiple of 3."""
    check_dtype(packed, "packed", (torch.uint8,))
    if packed.dim() == 0 or packed.shape[-1] % 3:
        raise ValueError(f"unpack_fp6 needs a last dimension divisible by 3, got shape {tuple(packed.shape)}")
    b = packed.to(torch.int32).reshape(*packed.shape[:-1], -1, 3)
    w = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    out = torch.stack([(w >> s) & 0x3F for s in (0, 6, 12, 18)], dim=-1).to(torch.uint8)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] // 3 * 4)


def mxfp6_quantize(x: torch.Tensor, element: str, *, scale_rule: str = "even") -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP6: FP6 elements (``"e3m2"`` / ``"e2m3"``) with one E8M0 scale per 32 elements of the last dimension.

    ``amax`` per block -> byte (:func:`mx_scale_e8m0` with the FP6 element; default ``"even"``: Quark's
    ``even_round``, the only mode vLLM 0.33 accepts, ``mxfp6_utils.py::_quant_dequant_mxfp6``) -> ``X``;
    ``codes = fp6_encode(x / X)``. vLLM's emulation (``fused_moe/utils.py::_mxfp6_e3m2_quantize`` /
    ``_mxfp6_e2m3_quantize``) returns ``fp6_decode(codes) * X`` cast to the activation dtype, which is
    :func:`mxfp6_dequantize` of this output: exact in bf16 (at most 4 significant bits) unless the value falls
    below bf16's subnormal range (``X <= 2^-127``).

    Args:
        x: ``(..., K)`` float16 / bfloat16 / float32, ``K % 32 == 0``.
        element: ``"e3m2"`` or ``"e2m3"``. scale_rule: one of ``MX_SCALE_RULES``.

    Returns: ``(codes, scales)``: codes uint8 ``(..., K)`` (one code per byte; :func:`pack_fp6` gives the
    checkpoint layout); scales uint8 E8M0 bytes ``(..., K // 32)``. Poisoned (NaN / inf) blocks: byte 0xFF, codes 0.

    Raises TypeError (dtype) and ValueError (``K % 32 != 0``, unknown element or rule).
    """
    _fp6_params(element)
    xb = _blocks(x, "mxfp6_quantize")
    byte = mx_scale_e8m0(xb.abs().amax(dim=-1), element=element, scale_rule=scale_rule)
    scale = e8m0_to_fp32(byte).unsqueeze(-1)
    poisoned = (byte == 255).unsqueeze(-1)
    y = torch.where(poisoned, torch.zeros_like(xb), xb / torch.where(poisoned, torch.ones_like(scale), scale))
    return fp6_encode(y, element).reshape(x.shape), byte


def mxfp6_dequantize(codes: torch.Tensor, scales: torch.Tensor, element: str, *,
                     out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``fp6(code) * 2^(byte-127)`` per 32-element block (fp32, exact; one cast to ``out_dtype``).

    codes uint8 ``(..., K)`` (unpacked); scales uint8 ``(..., K // 32)``. Mirrors vLLM 0.33
    ``mxfp6_utils.py::_dequant_mxfp6`` (Quark ``dequantize_fp4_fp6_per_group`` in fp32, then ``.to(float_dtype)``:
    the OCP emulation experts dequantize the weights to the activation dtype before the bf16 GEMM,
    ``fused_moe/experts/ocp_mx_emulation_moe.py``). Raises TypeError / ValueError on bad dtypes or shapes.
    """
    return _dequant_blocks(fp6_decode(codes, element), scales, out_dtype)
