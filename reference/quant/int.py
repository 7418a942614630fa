"""Integer formats: INT8 W8A8 (per-token / per-channel / static per-tensor) and INT4 group
quantization (W4A16, and the W4A8 scheme of ``cutlass_moe_w4a8_fp8``, seed 004).

Integers have no NaN: every quantizer here raises ValueError on NaN or inf input rather than
invent a code. Rounding is round-half-to-even (``torch.round``, like CUDA ``nearbyint``).
"""

from __future__ import annotations

import torch

from ._common import (
    check_dtype,
    check_high_precision,
    check_last_dim_multiple,
    check_positive_int,
    rdiv,
    scalar_scale,
    to_e4m3_satfinite,
)

__all__ = [
    "INT8_MAX",
    "INT8_MIN",
    "INT4_MAX",
    "INT4_MIN",
    "int8_quant_per_token",
    "int8_quant_per_channel",
    "int8_quant_static",
    "int8_quant_per_tensor",
    "dequant_int8",
    "int4_group_quant",
    "dequant_int4_group",
    "pack_int4",
    "unpack_int4",
    "w4a8_quantize_weight",
    "w4a8_dequantize_weight",
]

INT8_MAX, INT8_MIN = 127, -128
INT4_MAX, INT4_MIN = 7, -8


def _check_finite(xf: torch.Tensor, fn: str) -> None:
    if not bool(torch.isfinite(xf).all()):
        raise ValueError(f"{fn}: input contains NaN or inf; integer formats cannot represent them")


def _int8_rows(x: torch.Tensor, fn: str) -> tuple[torch.Tensor, torch.Tensor]:
    check_high_precision(x, "x")
    if x.dim() == 0:
        raise ValueError(f"{fn}: x must have at least one dimension")
    xf = x.to(torch.float32)
    _check_finite(xf, fn)
    absmax = xf.abs().amax(dim=-1, keepdim=True) if xf.shape[-1] else torch.zeros(*xf.shape[:-1], 1)
    s = absmax / torch.full_like(absmax, 127.0)
    # the kernel multiplies by tmp_scale = 127 / absmax (computed once per row)
    mult = torch.where(absmax == 0, torch.zeros_like(absmax), rdiv(127.0, absmax))
    q = torch.round(xf * mult).clamp(INT8_MIN, INT8_MAX).to(torch.int8)
    return q, s


def int8_quant_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric INT8 per token (row of the last dim).

    Mirrors ``vllm/_custom_ops.py::scaled_int8_quant`` with ``scale=None, symmetric`` (CUDA
    ``dynamic_scaled_int8_quant_kernel``): ``s = absmax / 127`` (no floor),
    ``q = clamp(round_half_even(x * (127 / absmax)), -128, 127)``.

    Args: x ``(..., K)`` float16 / bfloat16 / float32.
    Returns: ``(q int8 (..., K), s float32 (..., 1))``. A zero row gives ``s = 0`` and ``q = 0``.
    Raises: TypeError (dtype); ValueError (NaN / inf, 0-d input).
    """
    return _int8_rows(x, "int8_quant_per_token")


def int8_quant_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 weight quantization, one scale per output channel.

    ``w`` is ``(N, K)`` or ``(E, N, K)`` (output channel n, reduction over the last dim K); same
    rule as :func:`int8_quant_per_token`: ``s = absmax_n / 127``, ``q = rne(w * (127/absmax_n))``.
    Mirrors the per-channel weight scales of vLLM's W8A8 INT8 (compressed-tensors channel scheme).

    Returns: ``(q int8 like w, s float32 (..., N, 1))``; an all-zero channel gives ``s = 0, q = 0``.
    Raises: TypeError (dtype); ValueError (rank not 2/3, NaN / inf).
    """
    check_high_precision(w, "w")
    if w.dim() not in (2, 3):
        raise ValueError(f"int8_quant_per_channel: w must be (N, K) or (E, N, K), got {tuple(w.shape)}")
    return _int8_rows(w, "int8_quant_per_channel")


def int8_quant_static(x: torch.Tensor, scale: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """Static symmetric INT8 with one per-tensor scale: ``q = clamp(rne(x / s), -128, 127)``.

    Mirrors ``vllm/_custom_ops.py::scaled_int8_quant`` with a given scale (facts: ``x / s``).

    Returns ``(q int8 like x, s float32 (1,))``. Raises TypeError (dtype), ValueError (non-positive
    or non-finite or multi-element scale, NaN / inf in x).
    """
    check_high_precision(x, "x")
    s = scalar_scale(scale, "scale")
    xf = x.to(torch.float32)
    _check_finite(xf, "int8_quant_static")
    q = torch.round(xf / s).clamp(INT8_MIN, INT8_MAX).to(torch.int8)
    return q, s.reshape(1)


def int8_quant_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric INT8 with one scale for the whole tensor (the ``kInt8DynamicTensorSym`` activations).

    Mirrors vLLM 0.33 ``fused_moe/utils.py::_int8_quantize`` (dynamic per-tensor branch): ``A_scale =
    torch.clamp(A.abs().max() / 127.0, min=1e-10)`` computed *in x's dtype* (for bf16 x: the fp32 quotient rounded
    to bf16, as torch's bf16 division does), then the static kernel ``scaled_int8_quant(A, scale=A_scale)``:
    ``q = clamp(rne(x / s), -128, 127)`` with ``s`` widened to fp32. Because the bf16 scale may round below
    ``amax / 127``, the largest elements can clamp at +-127 / -128.

    Args: x ``(..., K)`` float16 / bfloat16 / float32.
    Returns: ``(q int8 like x, s float32 (1,))``.
    Raises: TypeError (dtype); ValueError (NaN / inf).
    """
    check_high_precision(x, "x")
    _check_finite(x.to(torch.float32), "int8_quant_per_tensor")
    amax = x.abs().amax() if x.numel() else torch.zeros((), dtype=x.dtype)
    s = torch.clamp(amax / 127.0, min=1e-10).to(torch.float32).reshape(1)
    return int8_quant_static(x, s)


def dequant_int8(
    q: torch.Tensor, scale: torch.Tensor | float, *, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q.float() * s`` with ``s`` broadcastable to q (per-tensor ``(1,)``, per-token / per-channel
    ``(..., 1)``); fp32 product, one cast to ``out_dtype``.

    Mirrors the W8A8 epilogue ``acc * a_scale * b_scale`` applied to one operand (vLLM
    ``cutlass_scaled_mm`` reference ``(a.float() * scale_a)``). Raises TypeError if q is not int8.
    """
    check_dtype(q, "q", (torch.int8,))
    s = scale.to(torch.float32) if isinstance(scale, torch.Tensor) else torch.tensor(float(scale))
    y = q.to(torch.float32) * s
    return y if out_dtype == torch.float32 else y.to(out_dtype)


def int4_group_quant(w: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4 group quantization along the last dim (K), range ``[-8, 7]``.

    Per group: ``s = max(|max(w)| / 7, |min(w)| / 8)`` (fp32), ``q = clamp(rne(w / s), -8, 7)``.
    Mirrors ``vllm/model_executor/layers/quantization/utils/quant_utils.py::quantize_weights``
    (symmetric, no zero point) as the W4A16 / W4A8 tests use it, but computed in fp32 (vLLM's test
    helper divides in the weight dtype).

    Args: w ``(..., K)`` float16 / bfloat16 / float32; ``group_size`` positive, ``K % group_size == 0``.
    Returns: ``(q int8 in [-8, 7] (..., K), s float32 (..., K // group_size))``. An all-zero group
    gives ``s = 0`` and ``q = 0``.
    Raises: TypeError (dtype); ValueError (``K % group_size``, NaN / inf).
    """
    check_high_precision(w, "w")
    check_positive_int(group_size, "group_size")
    check_last_dim_multiple(w, group_size, "int4_group_quant")
    wf = w.to(torch.float32)
    _check_finite(wf, "int4_group_quant")
    g = w.shape[-1] // group_size
    wg = wf.reshape(*w.shape[:-1], g, group_size)
    mx, mn = wg.amax(dim=-1), wg.amin(dim=-1)
    s = torch.maximum(mx.abs() / 7.0, mn.abs() / 8.0)
    safe = torch.where(s == 0, torch.ones_like(s), s).unsqueeze(-1)
    q = torch.round(wg / safe).clamp(INT4_MIN, INT4_MAX)
    q = torch.where((s == 0).unsqueeze(-1), torch.zeros_like(q), q)
    return q.to(torch.int8).reshape(w.shape), s


def dequant_int4_group(
    q: torch.Tensor, s: torch.Tensor, group_size: int = 128, *, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """W4A16 dequantization ``q * s`` per group of ``group_size`` along K (fp32; one cast).

    q int8 (or int32) values in [-8, 7] ``(..., K)``; s float ``(..., K // group_size)``.
    Mirrors the ``w_ref = w_q * w_s`` of vLLM's ``quantize_weights`` (symmetric, no zero point).
    Raises TypeError / ValueError on bad dtypes or shapes.
    """
    check_dtype(q, "q", (torch.int8, torch.int32))
    check_positive_int(group_size, "group_size")
    check_last_dim_multiple(q, group_size, "dequant_int4_group")
    g = q.shape[-1] // group_size
    if tuple(s.shape) != tuple(q.shape[:-1]) + (g,):
        raise ValueError(f"scales shape {tuple(s.shape)} does not match q {tuple(q.shape)} / group {group_size}")
    y = q.to(torch.float32).reshape(*q.shape[:-1], g, group_size) * s.to(torch.float32).unsqueeze(-1)
    y = y.reshape(q.shape)
    return y if out_dtype == torch.float32 else y.to(out_dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack signed INT4 values eight per int32 along the last dim, LSB first.

    Word ``j`` holds element ``8j + i`` in bits ``[4i, 4i+4)`` as a two's-complement nibble
    (``q & 0xF``). Mirrors vLLM ``pack_rows`` / ``pack_quantized_values_into_int32`` as used by
    ``cutlass_moe_w4a8_fp8`` (before CUTLASS's own reorder).

    Args: q int8 / int32 / int64 ``(..., K)`` with values in [-8, 7], ``K % 8 == 0``.
    Returns: int32 ``(..., K // 8)``.
    Raises: TypeError (dtype); ValueError (``K % 8``, value out of range).
    """
    check_dtype(q, "q", (torch.int8, torch.int32, torch.int64))
    check_last_dim_multiple(q, 8, "pack_int4", what="8 (nibbles per int32)")
    if q.numel() and (int(q.min()) < INT4_MIN or int(q.max()) > INT4_MAX):
        raise ValueError(f"pack_int4: values must be in [-8, 7], got [{int(q.min())}, {int(q.max())}]")
    nib = (q.to(torch.int64) & 0xF).reshape(*q.shape[:-1], q.shape[-1] // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    words = (nib << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int32 ``(..., Kp)`` -> int8 ``(..., 8 * Kp)`` in [-8, 7]."""
    check_dtype(packed, "packed", (torch.int32,))
    if packed.dim() == 0:
        raise ValueError("unpack_int4 needs at least one dimension")
    w = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=packed.device)
    nib = (w.unsqueeze(-1) >> shifts) & 0xF
    val = torch.where(nib >= 8, nib - 16, nib)  # sign-extend the nibble
    return val.reshape(*packed.shape[:-1], packed.shape[-1] * 8).to(torch.int8)


def w4a8_quantize_weight(w: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """INT4 weights with FP8 E4M3 group scales, the weight format of ``cutlass_moe_w4a8_fp8``.

    ``q, s = int4_group_quant(w, group_size)`` (fp32 ``s``), then the group scale is stored as
    ``e4m3_satfinite(s)``: q is computed with the unrounded fp32 ``s`` and the scale rounded
    afterwards, as vLLM's W4A8 tests do (``quantize_weights`` then ``w_s.to(float8_e4m3fn)``).
    Callers should normalise per output channel first (the kernel's epilogue multiplies
    ``acc * token_scale[m] * channel_scale[n]``) so group scales land in E4M3's range: a scale
    below 2^-10 rounds to 0 and one above 448 saturates.

    Args: w ``(..., N, K)`` float16 / bfloat16 / float32, ``K % group_size == 0``, ``K % 8 == 0``.
    Returns: ``(packed int32 (..., N, K // 8), scales float8_e4m3fn (..., N, K // group_size))``.
    Raises: as :func:`int4_group_quant` and :func:`pack_int4`.
    """
    q, s = int4_group_quant(w, group_size)
    return pack_int4(q), to_e4m3_satfinite(s)


def w4a8_dequantize_weight(
    packed: torch.Tensor, scales: torch.Tensor, group_size: int = 128
) -> torch.Tensor:
    """The weight the W4A8 CUTLASS kernel multiplies: ``e4m3_satfinite(q * s_e4m3)``, as float32.

    Mirrors vLLM's W4A8 test reference (``w_ref = (w_q * w_s.to(fp8).float()).to(fp8)``): the
    product of an int4 value and an E4M3 scale is exact in fp32 and is then rounded (RNE) to E4M3.
    Returns float32 ``(..., N, K)`` whose values are all E4M3-representable.

    Args: packed int32 ``(..., N, K // 8)``; scales float8_e4m3fn ``(..., N, K // group_size)``.
    Raises TypeError / ValueError on bad dtypes or shapes.
    """
    check_dtype(scales, "scales", (torch.float8_e4m3fn,))
    q = unpack_int4(packed)
    prod = dequant_int4_group(q, scales.to(torch.float32), group_size)
    return to_e4m3_satfinite(prod).to(torch.float32)
