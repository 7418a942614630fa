"""FP8 E4M3 quantizers and dequantizers: per-tensor, per-token, per-token-group (1x128 / 1x64) and
per-block (128x128) scales, fp32 or UE8M0.

Conventions (all quantizers):
  * ``s`` is the dequantization multiplier: ``x ~= q * s``. Scales are float32.
  * Arithmetic is fp32: the input is converted to fp32 first (exact for fp16 / bf16).
  * Every value is clamped to +-448 before the cast to float8_e4m3fn (RNE), so finite overflow and
    +-inf saturate regardless of torch's own cast (which changed between 2.11 and 2.14).
  * A group (token, block, tensor) that contains NaN or +-inf is *poisoned*: its scale is NaN and
    all its codes are NaN (0x7F). Kernels differ here (vLLM's fmaxf/fminf turn NaN into +-448);
    the reference makes the failure loud instead of picking one kernel's accident.
  * Group scales follow a :class:`~reference.quant.recipes.QuantRecipe` (default ``"vllm"``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from ._common import (
    FP8_E4M3_MAX,
    cdiv,
    check_block_weight,
    check_contiguous,
    check_dtype,
    check_high_precision,
    check_last_dim_multiple,
    check_positive_int,
    rdiv,
    scalar_scale,
    to_e4m3_satfinite,
)
from .layout import get_tma_aligned_size, mn_major_scales
from .recipes import QuantRecipe, get_recipe
from .ue8m0 import ceil_to_ue8m0, pack_ue8m0

__all__ = [
    "FP8_E4M3_MAX",
    "FP8_DTYPE",
    "to_e4m3_satfinite",
    "round_scale_to_ue8m0",
    "scaled_fp8_quant",
    "per_token_group_quant_fp8",
    "per_token_group_quant_fp8_packed_for_deepgemm",
    "per_block_quant_fp8",
    "dequant_fp8_per_tensor",
    "dequant_fp8_per_token",
    "dequant_fp8_per_token_group",
    "dequant_fp8_block",
]

FP8_DTYPE = torch.float8_e4m3fn
_NAN = float("nan")
# vLLM dynamic per-token: min_scaling_factor = 1 / (FP8_E4M3_MAX * 512), an fp32 constant.
_MIN_PER_TOKEN_SCALE = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(FP8_E4M3_MAX * 512.0, dtype=torch.float32)


def round_scale_to_ue8m0(s: torch.Tensor, recipe: str | QuantRecipe = "vllm") -> torch.Tensor:
    """Round fp32 scales up to powers of two with the recipe's UE8M0 rule.

    ``"exp2_ceil_log2"`` (vLLM): ``exp2(ceil(log2(max(|s|, ue8m0_scale_floor))))`` in fp32 with
    torch's log2 / exp2. ``"ceil_to_ue8m0"`` (DeepGEMM): :func:`ceil_to_ue8m0` of
    ``max(s, ue8m0_scale_floor)``. Same shape, float32. NaN stays NaN.

    Mirrors the UE8M0 branch of vLLM's ``per_token_group_quant_8bit`` kernel
    (``exp2f(ceilf(log2f(fmaxf(s, 1e-10))))``) and DeepGEMM's ``ceil_to_ue8m0``.
    Raises ValueError for an unknown recipe name.
    """
    r = get_recipe(recipe)
    s = s.to(torch.float32)
    nan = torch.isnan(s)
    floored = torch.clamp_min(s.abs(), r.ue8m0_scale_floor)
    if r.ue8m0_rounding == "exp2_ceil_log2":
        out = torch.exp2(torch.ceil(torch.log2(floored)))
    else:
        out = ceil_to_ue8m0(floored)
    return torch.where(nan, torch.full_like(out, _NAN), out)


def _scale_from_amax(
    amax: torch.Tensor, r: QuantRecipe, use_ue8m0: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 group scales from fp32 amax under recipe ``r``.

    Returns (scales, 448 / floored amax, poisoned mask); the second is the element multiplier of
    ``quant_op="max_over_amax_multiply"`` and unused otherwise.
    """
    if use_ue8m0 and r.quant_op == "max_over_amax_multiply":
        raise ValueError(
            f"recipe {r.name!r}: quant_op='max_over_amax_multiply' is defined for fp32 scales only "
            "(with UE8M0 scales the element multiplier must come from the rounded scale)"
        )
    poisoned = ~torch.isfinite(amax)
    a = torch.clamp_min(amax, r.amax_floor)
    if r.scale_computation == "amax/max":
        s = a / torch.full_like(a, FP8_E4M3_MAX)  # IEEE division on every device (see _common.rdiv)
    else:
        s = 1.0 / rdiv(FP8_E4M3_MAX, a)
    if use_ue8m0:
        s = round_scale_to_ue8m0(s, r)
    s = torch.where(poisoned, torch.full_like(s, _NAN), s)
    return s, rdiv(FP8_E4M3_MAX, a), poisoned


def _quantize_with_scale(
    xf: torch.Tensor, s: torch.Tensor, quant_op: str, poisoned: torch.Tensor, mult: torch.Tensor | None = None
) -> torch.Tensor:
    """q = e4m3_satfinite(x / s), (x * (1/s)) or (x * (448/amax)); poisoned entries -> NaN code."""
    if quant_op == "divide":
        y = xf / s
    elif quant_op == "reciprocal_multiply":
        y = xf * (1.0 / s)
    else:
        assert mult is not None
        y = xf * mult
    y = torch.where(poisoned, torch.full_like(y, _NAN), y)
    return to_e4m3_satfinite(y)


def scaled_fp8_quant(
    x: torch.Tensor,
    scale: torch.Tensor | float | None = None,
    *,
    use_per_token_if_dynamic: bool = False,
    scale_ub: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 quantization with one per-tensor scale (static or dynamic) or per-token scales.

    Mirrors ``vllm/_custom_ops.py::scaled_fp8_quant`` and its CUDA kernels
    (``csrc/quantization/w8a8/fp8/common.cu``):

    - static (``scale`` given, one element): ``q = sat(x * (1 / s))``; the kernel inverts the scale
      once and multiplies.
    - dynamic per-tensor: ``s = amax / 448`` (no floor), ``q = sat(x * (1 / s))``.
    - dynamic per-token (``use_per_token_if_dynamic=True``): per row of the last dim,
      ``s = max(min(amax, scale_ub) / 448, 1 / (448 * 512))``, ``q = sat(x / s)`` (division).

    Args:
        x: ``(..., K)`` float16 / bfloat16 / float32. Must be contiguous for dynamic per-token
            (the kernel checks it).
        scale: static per-tensor scale (positive, finite; float or one-element tensor) or None.
        use_per_token_if_dynamic: per-token scales when ``scale`` is None.
        scale_ub: upper bound on the per-token amax (dynamic per-token only).

    Returns:
        ``(q, s)``: q float8_e4m3fn with x's shape; s float32 of shape ``(1,)`` (per-tensor) or
        ``(..., 1)`` (per-token).

    Defined edge cases: an all-zero (or empty) tensor in dynamic per-tensor mode gives ``s = 0``
    and ``q = 0`` (vLLM's kernel would compute ``0 * (1/0)``); an all-zero row in per-token mode
    gets the minimum scale ``1/(448*512)`` and codes 0; in the dynamic modes non-finite values
    poison the tensor / row (scale NaN, codes NaN); in static mode the scale is given, so each
    element follows the cast: +-inf saturates to +-448, NaN gives a NaN code.

    Raises:
        TypeError: x not fp16/bf16/fp32, or a badly typed scale.
        ValueError: non-positive / non-finite / multi-element static scale, ``scale_ub`` outside
            dynamic per-token mode, non-contiguous x in per-token mode, 0-d x.
    """
    check_high_precision(x, "x")
    if x.dim() == 0:
        raise ValueError("scaled_fp8_quant: x must have at least one dimension")
    xf = x.to(torch.float32)

    if scale is not None:
        if scale_ub is not None:
            raise ValueError("scaled_fp8_quant: scale_ub is only valid for dynamic per-token quantization")
        s = scalar_scale(scale, "scale")
        q = to_e4m3_satfinite(xf * (1.0 / s))
        return q, s.reshape(1)

    if not use_per_token_if_dynamic:
        if scale_ub is not None:
            raise ValueError("scaled_fp8_quant: scale_ub is only valid for dynamic per-token quantization")
        amax = xf.abs().amax() if xf.numel() else torch.zeros((), dtype=torch.float32)
        s = amax / torch.full_like(amax, FP8_E4M3_MAX)
        poisoned = ~torch.isfinite(amax)
        zero = s == 0
        inv = torch.where(zero, torch.zeros_like(s), 1.0 / s)
        y = xf * inv
        y = torch.where(poisoned, torch.full_like(y, _NAN), y)
        s = torch.where(poisoned, torch.full_like(s, _NAN), s)
        return to_e4m3_satfinite(y), s.reshape(1)

    check_contiguous(x, "x", "scaled_fp8_quant (dynamic per-token)")
    amax = xf.abs().amax(dim=-1, keepdim=True) if xf.shape[-1] else torch.zeros(*xf.shape[:-1], 1)
    poisoned = ~torch.isfinite(amax)
    a = amax
    if scale_ub is not None:
        a = torch.minimum(a, scalar_scale(scale_ub, "scale_ub"))
    s = torch.maximum(a / torch.full_like(a, FP8_E4M3_MAX), _MIN_PER_TOKEN_SCALE)
    s = torch.where(poisoned, torch.full_like(s, _NAN), s)
    q = _quantize_with_scale(xf, s, "divide", poisoned)
    return q, s


def per_token_group_quant_fp8(
    x: torch.Tensor,
    group_size: int = 128,
    *,
    eps: float | None = None,
    dtype: torch.dtype | None = None,
    column_major_scales: bool = False,
    tma_aligned_scales: bool = False,
    out_q: torch.Tensor | None = None,
    use_ue8m0: bool = False,
    recipe: str | QuantRecipe = "vllm",
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 quantization with one fp32 scale per ``group_size`` consecutive elements of K.

    Mirrors ``vllm/model_executor/layers/quantization/utils/fp8_utils.py::per_token_group_quant_fp8``
    (CUDA ``per_token_group_quant_8bit``) with ``recipe="vllm"``, and
    ``deep_gemm/utils/math.py::per_token_cast_to_fp8`` with ``recipe="deepgemm"``.

    Per group: ``amax = max(max|x|, amax_floor)``; ``s = amax / 448``; with ``use_ue8m0`` ``s`` is
    rounded up to a power of two by the recipe's rule; ``q = sat(x / s)`` or ``sat(x * (1/s))`` by the recipe's
    ``quant_op`` (``"vllm"``: division under semantics 0.17, the reciprocal multiply under 0.33; semantics point
    ``quant.per_token_group_quant_op``).

    Args:
        x: ``(..., K)`` float16 / bfloat16 / float32, contiguous (the kernel requires it).
            ``column_major_scales`` requires x to be 2-D ``(M, K)`` or 3-D ``(B, M, K)``.
        group_size: elements per group along K (128 and 64 are the ones vLLM uses).
        column_major_scales: return MN-major scales: shape ``(M, G)`` with strides ``(1, M)``.
        tma_aligned_scales: with ``column_major_scales``, strides ``(1, align(M, 4))`` (DeepGEMM
            SM90 layout; batched ``(G * align(M, 4), 1, align(M, 4))``).
        use_ue8m0: power-of-two scales (still stored as fp32; DeepGEMM FLOAT32_CEIL_UE8M0).
        recipe: ``"vllm"`` (default), ``"deepgemm"`` or a :class:`QuantRecipe`.
        eps: vLLM's amax floor ("the minimum to avoid dividing zero"; vLLM's default 1e-10 is the ``"vllm"``
            recipe's ``amax_floor``); None keeps the recipe's floor, a float replaces it.
        dtype: the codes' dtype: None or ``torch.float8_e4m3fn`` (vLLM: "only torch.float8_e4m3fn is supported
            for now"; None is the platform's FP8 type there, e4m3fn on CUDA).
        out_q: a preallocated ``float8_e4m3fn`` tensor of x's shape the codes are written into and returned as
            ``q`` (vLLM asserts ``out_q.shape == x.shape``).

    Returns:
        ``(q, scales)``: q float8_e4m3fn with x's shape; scales float32 ``(..., K // group_size)``
        (row-major unless column-major was asked for).

    Defined edge cases: an all-zero group gets ``s = amax_floor / 448`` (UE8M0: byte 94 under
    ``vllm``, byte 105 under ``deepgemm``) and codes 0; a non-finite value poisons its group (scale
    NaN, codes NaN); ``M = 0`` returns empty tensors of the right shapes.

    Raises:
        TypeError: x not fp16/bf16/fp32.
        ValueError: ``K % group_size != 0``; non-contiguous x; ``tma_aligned_scales`` without
            ``column_major_scales``; column-major scales for x not 2-D/3-D; unknown recipe;
            ``use_ue8m0`` with a ``max_over_amax_multiply`` recipe; ``dtype`` other than float8_e4m3fn;
            ``out_q`` of another shape or dtype; a negative ``eps``.
    """
    fn = "per_token_group_quant_fp8"
    if dtype is not None and dtype != torch.float8_e4m3fn:
        raise ValueError(f"{fn}: dtype must be torch.float8_e4m3fn (vLLM supports only it), got {dtype}")
    if out_q is not None and (tuple(out_q.shape) != tuple(x.shape) or out_q.dtype != torch.float8_e4m3fn):
        raise ValueError(f"{fn}: out_q must be float8_e4m3fn of x's shape {tuple(x.shape)}, got {out_q.dtype} "
                         f"{tuple(out_q.shape)}")
    check_high_precision(x, "x")
    check_positive_int(group_size, "group_size")
    check_last_dim_multiple(x, group_size, fn)
    check_contiguous(x, "x", fn)
    if tma_aligned_scales and not column_major_scales:
        raise ValueError(f"{fn}: tma_aligned_scales=True requires column_major_scales=True")
    if column_major_scales and x.dim() not in (2, 3):
        raise ValueError(f"{fn}: column-major scales need x of shape (M, K) or (B, M, K), got {tuple(x.shape)}")
    r = get_recipe(recipe)
    if eps is not None:
        r = dataclasses.replace(r, amax_floor=eps)  # __post_init__ rejects a negative floor

    k = x.shape[-1]
    g = k // group_size
    xf = x.to(torch.float32).reshape(*x.shape[:-1], g, group_size)
    amax = xf.abs().amax(dim=-1)
    s, mult, poisoned = _scale_from_amax(amax, r, use_ue8m0)
    q = _quantize_with_scale(xf, s.unsqueeze(-1), r.quant_op, poisoned.unsqueeze(-1), mult.unsqueeze(-1))
    q = q.reshape(x.shape)

    if column_major_scales:
        m = x.shape[-2]
        stride = get_tma_aligned_size(m, 4) if tma_aligned_scales else m
        s = mn_major_scales(s, stride)
    if out_q is not None:
        out_q.copy_(q)
        q = out_q
    return q, s


def per_token_group_quant_fp8_packed_for_deepgemm(
    x: torch.Tensor,
    group_size: int = 128,
    *,
    recipe: str | QuantRecipe = "vllm",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group FP8 quantization with packed UE8M0 scales for DeepGEMM on SM100.

    Mirrors ``vllm/model_executor/layers/quantization/utils/fp8_utils.py::
    per_token_group_quant_fp8_packed_for_deepgemm`` (DeepGemmQuantScaleFMT.UE8M0, seed 001):
    the codes and power-of-two scales of :func:`per_token_group_quant_fp8` with
    ``use_ue8m0=True``, the scales packed by :func:`reference.quant.ue8m0.pack_ue8m0`.

    Args:
        x: ``(M, K)`` float16 / bfloat16 / float32, contiguous, ``K % group_size == 0``.

    Returns:
        ``(q, packed)``: q float8_e4m3fn ``(M, K)``; packed int32 ``(M, ceil(G/4))`` with strides
        ``(1, align(M, 4))``, ``G = K // group_size``. A poisoned group's byte is 0xFF.

    Raises: as :func:`per_token_group_quant_fp8`, plus ValueError if x is not 2-D.
    """
    check_high_precision(x, "x")
    if x.dim() != 2:
        raise ValueError(
            f"per_token_group_quant_fp8_packed_for_deepgemm: x must be 2-D (M, K), got {tuple(x.shape)}"
        )
    q, s = per_token_group_quant_fp8(x, group_size, use_ue8m0=True, recipe=recipe)
    return q, pack_ue8m0(s)


def per_block_quant_fp8(
    w: torch.Tensor,
    block_shape: Sequence[int] = (128, 128),
    *,
    use_ue8m0: bool = False,
    recipe: str | QuantRecipe = "vllm",
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 quantization of weights with one fp32 scale per ``bn x bk`` block.

    Mirrors ``deep_gemm/utils/math.py::per_block_cast_to_fp8`` (also vendored in
    ``vllm/utils/deep_gemm.py`` and used by vLLM's ``requant_weight_ue8m0_inplace``) with
    ``recipe="deepgemm"``; ``recipe="vllm"`` applies vLLM's per-token-group rule (floor 1e-10,
    division, exp2(ceil(log2)) UE8M0) to 2-D blocks. Partial blocks at the N / K edges are
    zero-padded for the amax, as DeepGEMM does (zeros never raise an amax).

    Args:
        w: ``(N, K)`` or ``(E, N, K)`` float16 / bfloat16 / float32, any strides.
        block_shape: ``(bn, bk)``, positive ints.
        use_ue8m0: power-of-two scales (recipe's rounding rule).
        recipe: ``"vllm"`` (default), ``"deepgemm"`` or a :class:`QuantRecipe`.

    Returns:
        ``(q, scales)``: q float8_e4m3fn with w's shape; scales float32
        ``(..., ceil(N / bn), ceil(K / bk))`` row-major.

    Defined edge cases: all-zero block -> ``s = amax_floor / 448`` and codes 0; a non-finite value
    poisons its block (scale NaN, codes NaN).

    Raises: TypeError (dtype), ValueError (rank not 2/3, bad block_shape, unknown recipe).
    """
    fn = "per_block_quant_fp8"
    bn, bk = check_block_weight(w, block_shape, fn)
    r = get_recipe(recipe)

    n, k = w.shape[-2], w.shape[-1]
    nb, kb = cdiv(n, bn), cdiv(k, bk)
    batch = w.shape[:-2]
    padded = torch.zeros(*batch, nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = w.to(torch.float32)
    view = padded.reshape(*batch, nb, bn, kb, bk)
    amax = view.abs().amax(dim=(-3, -1))  # (..., nb, kb)
    s, mult, poisoned = _scale_from_amax(amax, r, use_ue8m0)

    def _b(t: torch.Tensor) -> torch.Tensor:  # (..., nb, kb) -> (..., nb, 1, kb, 1)
        return t.unsqueeze(-1).unsqueeze(-3)

    q = _quantize_with_scale(view, _b(s), r.quant_op, _b(poisoned), _b(mult))
    q = q.reshape(*batch, nb * bn, kb * bk)[..., :n, :k].contiguous()
    return q, s


def _check_fp8_codes(q: torch.Tensor) -> None:
    check_dtype(q, "q", (torch.float8_e4m3fn,))


def _finish(y: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    # one rounding: the fp32 product is cast once to out_dtype
    return y if out_dtype == torch.float32 else y.to(out_dtype)


def dequant_fp8_per_tensor(
    q: torch.Tensor, scale: torch.Tensor | float, *, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q.float() * s`` (fp32 product, one cast to ``out_dtype``) for one per-tensor scale.

    Inverse of static / dynamic per-tensor :func:`scaled_fp8_quant`. q float8_e4m3fn of any shape;
    ``scale`` one element (NaN allowed: poisoned tensor). Raises TypeError / ValueError on bad
    dtype or a multi-element scale.
    """
    _check_fp8_codes(q)
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"scale must have one element, got shape {tuple(scale.shape)}")
        s = scale.reshape(()).to(torch.float32)
    else:
        s = torch.tensor(float(scale), dtype=torch.float32)
    return _finish(q.to(torch.float32) * s, out_dtype)


def dequant_fp8_per_token(
    q: torch.Tensor, scale: torch.Tensor, *, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q.float() * s[..., None]`` for per-token scales of shape ``(..., 1)`` (or ``(...)``).

    Inverse of dynamic per-token :func:`scaled_fp8_quant`. Raises TypeError on bad dtypes and
    ValueError if the scale shape does not match ``q.shape[:-1]``.
    """
    _check_fp8_codes(q)
    check_dtype(scale, "scale", (torch.float32,))
    if tuple(scale.shape) == tuple(q.shape[:-1]):
        scale = scale.unsqueeze(-1)
    if tuple(scale.shape) != tuple(q.shape[:-1]) + (1,):
        raise ValueError(f"per-token scale shape {tuple(scale.shape)} does not match q {tuple(q.shape)}")
    return _finish(q.to(torch.float32) * scale, out_dtype)


def dequant_fp8_per_token_group(
    q: torch.Tensor,
    scales: torch.Tensor,
    group_size: int = 128,
    *,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``q * s`` with one fp32 scale per ``group_size`` elements of K (fp32 product, one cast).

    Inverse of :func:`per_token_group_quant_fp8`. ``q`` ``(..., K)`` float8_e4m3fn; ``scales``
    float32 ``(..., K // group_size)`` in any strides (row- or column-major). For packed UE8M0
    scales call :func:`reference.quant.ue8m0.unpack_ue8m0` first.

    Raises TypeError on bad dtypes, ValueError on shape mismatch.
    """
    _check_fp8_codes(q)
    check_dtype(scales, "scales", (torch.float32,))
    check_positive_int(group_size, "group_size")
    check_last_dim_multiple(q, group_size, "dequant_fp8_per_token_group")
    g = q.shape[-1] // group_size
    if tuple(scales.shape) != tuple(q.shape[:-1]) + (g,):
        raise ValueError(
            f"scales shape {tuple(scales.shape)} does not match q {tuple(q.shape)} with group_size={group_size}"
        )
    y = q.to(torch.float32).reshape(*q.shape[:-1], g, group_size) * scales.unsqueeze(-1)
    return _finish(y.reshape(q.shape), out_dtype)


def dequant_fp8_block(
    q: torch.Tensor,
    scales: torch.Tensor,
    block_shape: Sequence[int] = (128, 128),
    *,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``q * s`` with one fp32 scale per ``bn x bk`` block (fp32 product, one cast).

    Inverse of :func:`per_block_quant_fp8`. ``q`` ``(N, K)`` or ``(E, N, K)`` float8_e4m3fn;
    ``scales`` float32 ``(..., ceil(N/bn), ceil(K/bk))``. Raises TypeError / ValueError on bad
    dtypes or shapes.
    """
    _check_fp8_codes(q)
    check_dtype(scales, "scales", (torch.float32,))
    if q.dim() not in (2, 3) or len(block_shape) != 2:
        raise ValueError(
            f"q must be (N, K) or (E, N, K) and block_shape (bn, bk); got {tuple(q.shape)}, {block_shape!r}"
        )
    bn, bk = check_positive_int(block_shape[0], "bn"), check_positive_int(block_shape[1], "bk")
    n, k = q.shape[-2], q.shape[-1]
    want = tuple(q.shape[:-2]) + (cdiv(n, bn), cdiv(k, bk))
    if tuple(scales.shape) != want:
        raise ValueError(f"scales shape {tuple(scales.shape)} != expected {want} for q {tuple(q.shape)}")
    full = scales.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)[..., :n, :k]
    return _finish(q.to(torch.float32) * full, out_dtype)
