"""NVFP4: E2M1 elements, one E4M3 block scale per 16 elements, one fp32 global scale (vLLM's
encode convention).

With ``gs`` the global scale (an *encode* multiplier, ``gs = 448 * 6 / amax_tensor``):

    SF   = e4m3_satfinite(gs * (amax_b * (1/6)))          # block scale, stored
    mult = 1 / (SF * (1/gs))   (0 if SF == 0)             # element multiplier
    q    = e2m1_rn_satfinite(x * mult)
    x'   = e2m1(q) * (SF / gs)                            # dequantization

This is ``SF = e4m3(gs * amax_b / 6)``, ``mult = 1 / (SF / gs)`` of the facts file, with the
rounding order of vLLM's emulation reference (``tests/kernels/quantization/nvfp4_utils.py::
ref_nvfp4_quant``: multiply by fp32 reciprocals). vLLM's CUDA kernel uses ``rcp.approx.ftz``
for the reciprocals, so a GPU backend can differ from this in the last ulp of ``mult`` and, very
rarely, in a code at an exact E2M1 midpoint. torchao's decode convention (never-zero block
scales) is a different recipe and is not implemented here.

NVFP4 weights with unquantized activations (``nvfp4_w4a16``, vLLM 0.33 ``fused_humming_moe.py`` / ``b12x.py``):
``e2m1(q) * SF`` has at most 6 significant bits, so a kernel that dequantizes it to bf16 and applies ``1 / gs`` to
its fp32 accumulator (per expert) computes the reference's ``e2m1(q) * (SF / gs)`` up to the fp32 rounding of that
product, which the error model's accumulation terms cover (``reference.error_model``).
"""

from __future__ import annotations

import torch

from ._common import (
    FP4_E2M1_MAX,
    FP8_E4M3_MAX,
    check_dtype,
    check_high_precision,
    check_last_dim_multiple,
    scalar_scale,
    to_e4m3_satfinite,
)
from .mx import e2m1_decode, e2m1_encode, pack_fp4, unpack_fp4

__all__ = ["NVFP4_BLOCK_SIZE", "nvfp4_global_scale", "nvfp4_quantize", "nvfp4_dequantize",
           "nvfp4_quantize_per_token", "nvfp4_dequantize_per_token"]

NVFP4_BLOCK_SIZE = 16
_INV_6 = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(FP4_E2M1_MAX, dtype=torch.float32)


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """vLLM's NVFP4 global (encode) scale ``gs = (448 * 6) / amax(|x|)``, fp32, shape ``(1,)``.

    Computed as fp32 ``2688 / fp32(amax)``. Defined edge case: an all-zero (or empty) tensor gives
    ``gs = 1.0`` (any finite value yields the same all-zero codes and scales; vLLM's formula
    would give inf). Raises ValueError if x has NaN or inf (no finite global scale exists).
    """
    check_high_precision(x, "x")
    xf = x.to(torch.float32)
    if not bool(torch.isfinite(xf).all()):
        raise ValueError("nvfp4_global_scale: x contains NaN or inf; the global scale would not be finite")
    amax = xf.abs().amax() if xf.numel() else torch.zeros((), dtype=torch.float32)
    if float(amax) == 0.0:
        return torch.ones(1, dtype=torch.float32)
    return (torch.tensor(FP8_E4M3_MAX * FP4_E2M1_MAX, dtype=torch.float32) / amax).reshape(1)


def nvfp4_quantize(
    x: torch.Tensor, global_scale: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 quantization (vLLM encode convention; see module docstring for the formulas).

    Mirrors ``vllm/_custom_ops.py::scaled_fp4_quant`` (CUDA ``nvfp4_quant_kernels.cu``) in linear
    (un-swizzled) scale layout; swizzle with :func:`reference.quant.layout.swizzle_block_scales`.

    Args:
        x: ``(..., K)`` float16 / bfloat16 / float32, ``K % 16 == 0``.
        global_scale: the encode scale ``gs`` (positive, finite; float or one-element tensor), or
            None to use :func:`nvfp4_global_scale` of x.

    Returns:
        ``(packed, block_scales, global_scale)``: packed uint8 ``(..., K // 2)`` (element 2i in the
        low nibble); block_scales float8_e4m3fn ``(..., K // 16)``; global_scale float32 ``(1,)``.

    Defined edge cases: an all-zero block gets ``SF = 0`` and codes 0 (vLLM emits 0; torchao
    never does); a block containing NaN or inf is poisoned: ``SF = NaN`` (0x7F), codes 0, and it
    dequantizes to NaN.

    Raises:
        TypeError: x dtype.
        ValueError: ``K % 16 != 0``; a non-positive / non-finite global scale; NaN or inf in x
            when ``global_scale`` is None.
    """
    check_high_precision(x, "x")
    check_last_dim_multiple(x, NVFP4_BLOCK_SIZE, "nvfp4_quantize", what="the NVFP4 block size")
    gs = nvfp4_global_scale(x).reshape(()) if global_scale is None else scalar_scale(global_scale, "global_scale")
    packed, sf_e4m3 = _quantize_blocks(x, gs)
    return packed, sf_e4m3, gs.reshape(1)


def _quantize_blocks(x: torch.Tensor, gs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and E4M3 block scales of x under the encode scale ``gs`` (0-d, or ``(..., 1)`` one per row)."""
    k = x.shape[-1]
    xb = x.to(torch.float32).reshape(*x.shape[:-1], k // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)
    amax_b = xb.abs().amax(dim=-1)
    poisoned = ~torch.isfinite(amax_b)
    sf = to_e4m3_satfinite(gs * (amax_b * _INV_6))
    sf = torch.where(poisoned, torch.full_like(sf.to(torch.float32), float("nan")), sf.to(torch.float32))
    sf_e4m3 = sf.to(torch.float8_e4m3fn)  # exact: sf is already an e4m3 value (or NaN)
    denom = sf * (1.0 / gs)
    mult = torch.where(sf == 0, torch.zeros_like(sf), 1.0 / denom)
    y = xb * mult.unsqueeze(-1)
    y = torch.where(poisoned.unsqueeze(-1), torch.zeros_like(y), y)
    # x * mult can reach inf only for inf inputs, which are poisoned above; e2m1_encode saturates
    codes = e2m1_encode(y).reshape(x.shape)
    return pack_fp4(codes), sf_e4m3


def nvfp4_quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 with one dynamic global scale per token (row): the ``kNvfp4DynamicToken`` activations.

    Each row ``r`` gets its own encode scale ``gs_r = (448 * 6) / amax(|x_r|)`` (fp32, as
    :func:`nvfp4_global_scale` of the row; an all-zero row gets 1.0), then block scales and codes follow the
    per-tensor rule with ``gs_r``. vLLM 0.33 (``quantization/utils/flashinfer_utils.py::
    quantize_nvfp4_per_token_input``) calls FlashInfer's ``nvfp4_quantize(x, 1 / (448 * 6),
    per_token_activation=True)`` inside the experts (``experts/trtllm_nvfp4_moe.py``,
    ``experts/flashinfer_cutedsl_moe.py``), which returns the *decode* scale ``1 / gs_r`` per token; FlashInfer's
    own rounding of that scale is not in vLLM's source, so this is the reference's definition: the encode scale
    in fp32 and the multiplications of :func:`nvfp4_quantize`.

    Args: x ``(..., K)`` float16 / bfloat16 / float32, ``K % 16 == 0``.
    Returns: ``(packed uint8 (..., K // 2), block_scales float8_e4m3fn (..., K // 16), gs float32 (..., 1))``.
    Raises: TypeError (dtype); ValueError (``K % 16``, NaN / inf in x: no finite per-token scale).
    """
    check_high_precision(x, "x")
    check_last_dim_multiple(x, NVFP4_BLOCK_SIZE, "nvfp4_quantize_per_token", what="the NVFP4 block size")
    xf = x.to(torch.float32)
    if not bool(torch.isfinite(xf).all()):
        raise ValueError("nvfp4_quantize_per_token: x contains NaN or inf; a per-token scale would not be finite")
    amax = xf.abs().amax(dim=-1, keepdim=True) if xf.shape[-1] else torch.zeros(*xf.shape[:-1], 1)
    gs = torch.where(amax == 0, torch.ones_like(amax),
                     torch.tensor(FP8_E4M3_MAX * FP4_E2M1_MAX, dtype=torch.float32) / amax)
    packed, sf = _quantize_blocks(x, gs)
    return packed, sf, gs


def nvfp4_dequantize_per_token(
    packed: torch.Tensor, block_scales: torch.Tensor, token_gs: torch.Tensor, *, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``e2m1(q) * (SF / gs_r)`` with one encode scale per row (:func:`nvfp4_quantize_per_token`'s output).

    Args: packed uint8 ``(..., K // 2)``; block_scales float8_e4m3fn ``(..., K // 16)``; token_gs float32
        ``(..., 1)`` positive.
    Returns ``(..., K)`` (fp32; one cast to ``out_dtype``). Raises TypeError / ValueError on dtypes or shapes.
    """
    check_dtype(block_scales, "block_scales", (torch.float8_e4m3fn,))
    if tuple(token_gs.shape) != tuple(block_scales.shape[:-1]) + (1,):
        raise ValueError(f"token_gs must be {tuple(block_scales.shape[:-1]) + (1,)}, got {tuple(token_gs.shape)}")
    return _dequantize(packed, block_scales.to(torch.float32) / token_gs.to(torch.float32), out_dtype)


def _dequantize(packed: torch.Tensor, per_block: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    vals = e2m1_decode(unpack_fp4(packed))
    check_last_dim_multiple(vals, NVFP4_BLOCK_SIZE, "nvfp4_dequantize", what="the NVFP4 block size")
    nb = vals.shape[-1] // NVFP4_BLOCK_SIZE
    if tuple(per_block.shape) != tuple(vals.shape[:-1]) + (nb,):
        raise ValueError(
            f"block_scales shape {tuple(per_block.shape)} does not match values {tuple(vals.shape)} (block 16)"
        )
    y = (vals.reshape(*vals.shape[:-1], nb, NVFP4_BLOCK_SIZE) * per_block.unsqueeze(-1)).reshape(vals.shape)
    return y if out_dtype == torch.float32 else y.to(out_dtype)


def nvfp4_dequantize(
    packed: torch.Tensor,
    block_scales: torch.Tensor,
    global_scale: torch.Tensor | float,
    *,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``e2m1(q) * (SF / gs)`` per 16-element block (fp32; one cast to ``out_dtype``).

    Mirrors vLLM's ``dequantize_nvfp4_to_dtype`` test helper. packed uint8 ``(..., K // 2)``;
    block_scales float8_e4m3fn ``(..., K // 16)`` (linear layout); global_scale positive finite.
    Returns ``(..., K)``. Raises TypeError / ValueError on bad dtypes, shapes or scale.
    """
    check_dtype(block_scales, "block_scales", (torch.float8_e4m3fn,))
    gs = scalar_scale(global_scale, "global_scale")
    return _dequantize(packed, block_scales.to(torch.float32) / gs, out_dtype)
