"""Gated activation + FP8 per-token-group (1x128) requantization between the two grouped GEMMs, in torch ops.

Replaces seed 001's ``DeepGemmExperts._act_mul_quant`` (vLLM's ``silu_mul_per_token_group_quant_fp8_colmajor``
for SILU / SWIGLUOAI_UNINTERLEAVE, activation + ``per_token_group_quant_fp8(column_major_scales=True)`` for
SWIGLUSTEP) on SM90, where ``DeepGemmQuantScaleFMT`` is FLOAT32_CEIL_UE8M0 (fp32 scales rounded up to powers of
two; ``use_ue8m0=True``) or FLOAT32 (E8M0 off; ``use_ue8m0=False``). Output scales are MN-major and TMA-aligned,
the layout DeepGEMM's SM90 kernel reads for A.

Numerics follow the reference's rounding points (``reference.experts``): the activation is computed in fp32 from
the bf16 GEMM1 output and **rounded once to the activation dtype**, then quantized; vLLM's fused kernel quantizes
the fp32 activation without that rounding (a difference of at most one FP8 step on a few codes, inside the fp8
experts tolerance). The quantizer implements a ``reference.quant`` recipe's choices with the same torch ops, so for
the same input it is bit-exact with ``reference.quant.per_token_group_quant_fp8(..., use_ue8m0, recipe)``:

    amax = max(max|x| over the group, recipe.amax_floor)
    s    = amax / 448                     (scale_computation "amax/max"; "1/(max/amax)": 1 / (448 / amax))
    s    = round_up_pow2(s)               if use_ue8m0 ("ceil_to_ue8m0": DeepGEMM's exponent-bit formula;
                                          "exp2_ceil_log2": exp2(ceil(log2(max(s, ue8m0_scale_floor)))))
    q    = e4m3(clamp(x / s, +-448))      (quant_op "divide"; "reciprocal_multiply": x * (1 / s))

A group holding NaN or +-inf gets a NaN scale and NaN codes (the reference's poisoning rule). Other recipe
choices raise NotImplementedError.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from reference.activation import MoEActivation

__all__ = ["SUPPORTED_ACTIVATIONS", "gated_activation", "per_token_group_quant_fp8_mn_major", "act_mul_quant"]

FP8_MAX = 448.0
SWIGLUSTEP_DEFAULT_LIMIT = 7.0
#: The activations of seed 001's ``_supports_activation``.
SUPPORTED_ACTIVATIONS = (MoEActivation.SILU, MoEActivation.SWIGLUSTEP, MoEActivation.SWIGLUOAI_UNINTERLEAVE)


def gated_activation(x: torch.Tensor, activation: MoEActivation, *, alpha: float | None = None,
                     beta: float | None = None, limit: float | None = None) -> torch.Tensor:
    """``(R, 2I)`` GEMM1 output (gate = first half, up = second half) -> ``(R, I)`` in ``x.dtype``, fp32 math,
    one rounding. The formulas of ``reference.activation.apply_moe_activation``:

    - SILU: ``silu(g) * u``; with ``limit``: ``g = min(g, L)``, ``u = clamp(u, -L, L)`` first (alpha/beta unused,
      as in the reference; vLLM's fused kernel would apply a configured alpha/beta to SILU too).
    - SWIGLUOAI_UNINTERLEAVE: ``g * sigmoid(alpha * g) * (u + beta)``, alpha default 1, beta default 0, the clamps
      only when ``limit`` is given.
    - SWIGLUSTEP: ``min(silu(g), L) * clamp(u, -L, L)``, ``L = limit or 7``.

    Raises:
        NotImplementedError: any other activation (seed 001 supports only these three).
        ValueError: odd last dimension.
    """
    if activation not in SUPPORTED_ACTIVATIONS:
        raise NotImplementedError(f"DeepGemmExperts supports {[a.name for a in SUPPORTED_ACTIVATIONS]}, "
                                  f"not {activation.name}")
    if x.shape[-1] % 2:
        raise ValueError(f"a gated activation needs an even width, got {tuple(x.shape)}")
    d = x.shape[-1] // 2
    xf = x.float()
    g, u = xf[..., :d], xf[..., d:]
    if activation is MoEActivation.SWIGLUSTEP:
        L = SWIGLUSTEP_DEFAULT_LIMIT if limit is None else limit
        y = F.silu(g).clamp(max=L) * u.clamp(-L, L)
    else:
        if limit is not None:
            g = g.clamp(max=limit)
            u = u.clamp(-limit, limit)
        if activation is MoEActivation.SILU:
            y = F.silu(g) * u
        else:
            a = 1.0 if alpha is None else alpha
            b = 0.0 if beta is None else beta
            y = g * torch.sigmoid(a * g) * (u + b)
    return y.to(x.dtype)


def _ceil_to_ue8m0(s: torch.Tensor) -> torch.Tensor:
    bits = s.abs().float().contiguous().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp.clamp(1, 254) << 23).view(torch.float32)


def _recipe_fields(recipe):
    from reference.quant import get_recipe

    r = get_recipe(recipe)
    if r.quant_op not in ("divide", "reciprocal_multiply"):
        raise NotImplementedError(f"recipe {r.name!r}: quant_op={r.quant_op!r} is not implemented by the deep_gemm "
                                  "backend (divide / reciprocal_multiply are)")
    if r.scale_computation not in ("amax/max", "1/(max/amax)"):
        raise NotImplementedError(f"recipe {r.name!r}: scale_computation={r.scale_computation!r} not implemented")
    if r.ue8m0_rounding not in ("ceil_to_ue8m0", "exp2_ceil_log2"):
        raise NotImplementedError(f"recipe {r.name!r}: ue8m0_rounding={r.ue8m0_rounding!r} not implemented")
    return r


def per_token_group_quant_fp8_mn_major(
    x: torch.Tensor,
    group_size: int = 128,
    *,
    use_ue8m0: bool = True,
    recipe="vllm",
    out_q: torch.Tensor | None = None,
    out_s: torch.Tensor | None = None,
    rows_per_chunk: int = 8192,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 quantization of ``x (R, C)`` with one fp32 scale per ``group_size`` columns (module docstring).

    Args:
        x: ``(R, C)`` fp16 / bf16 / fp32, ``C % group_size == 0``.
        use_ue8m0: power-of-two scales (DeepGEMM FLOAT32_CEIL_UE8M0 on SM90).
        recipe: a ``reference.quant`` recipe name or ``QuantRecipe`` (its floor / rounding / divide choices).
        out_q: optional ``(R, C)`` float8_e4m3fn buffer (a workspace view); out_s: optional ``(R, C // group_size)``
            fp32 buffer of any strides (default: MN-major TMA-aligned, see ``layout.mn_major_tma_aligned_empty``).
        rows_per_chunk: rows processed per step (bounds the fp32 temporaries).

    Returns:
        ``(q, s)``: q float8_e4m3fn ``(R, C)``; s fp32 ``(R, C // group_size)``, MN-major TMA-aligned unless
        ``out_s`` was given.

    Raises:
        ValueError: bad rank / width / buffer shapes; NotImplementedError: a recipe choice not implemented.
    """
    from backends.deep_gemm.layout import mn_major_tma_aligned_empty

    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be a 2-D fp16/bf16/fp32 tensor, got {tuple(x.shape)} {x.dtype}")
    R, C = x.shape
    if group_size <= 0 or C % group_size:
        raise ValueError(f"width {C} is not a multiple of group_size={group_size}")
    G = C // group_size
    r = _recipe_fields(recipe)
    if out_q is None:
        out_q = torch.empty((R, C), dtype=torch.float8_e4m3fn, device=x.device)
    if out_s is None:
        out_s = mn_major_tma_aligned_empty(R, G, x.device)
    if tuple(out_q.shape) != (R, C) or out_q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"out_q must be ({R}, {C}) float8_e4m3fn, got {tuple(out_q.shape)} {out_q.dtype}")
    if tuple(out_s.shape) != (R, G) or out_s.dtype != torch.float32:
        raise ValueError(f"out_s must be ({R}, {G}) float32, got {tuple(out_s.shape)} {out_s.dtype}")
    for r0 in range(0, R, max(rows_per_chunk, 1)):
        r1 = min(R, r0 + rows_per_chunk)
        xf = x[r0:r1].float().reshape(r1 - r0, G, group_size)
        amax = xf.abs().amax(dim=-1)
        poisoned = ~torch.isfinite(amax)
        a = torch.clamp_min(amax, r.amax_floor)
        if r.scale_computation == "amax/max":
            # tensor / tensor: torch's CUDA `tensor / python_scalar` multiplies by the fp32 reciprocal instead
            # (not IEEE division; it changes ~half of the fp32 scales), its CPU kernel divides
            s = a / torch.full_like(a, FP8_MAX)
        else:
            s = 1.0 / (torch.full_like(a, FP8_MAX) / a)
        if use_ue8m0:
            if r.ue8m0_rounding == "ceil_to_ue8m0":
                s = _ceil_to_ue8m0(torch.clamp_min(s.abs(), r.ue8m0_scale_floor))
            else:
                s = torch.exp2(torch.ceil(torch.log2(torch.clamp_min(s.abs(), r.ue8m0_scale_floor))))
        nan = torch.full((), float("nan"), dtype=torch.float32, device=x.device)
        s = torch.where(poisoned, nan, s)
        y = xf / s[..., None] if r.quant_op == "divide" else xf * (1.0 / s[..., None])
        y = torch.where(poisoned[..., None], nan, y)
        out_q[r0:r1] = y.reshape(r1 - r0, C).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out_s[r0:r1] = s
    return out_q, out_s


def act_mul_quant(
    x: torch.Tensor,
    activation: MoEActivation,
    *,
    alpha: float | None,
    beta: float | None,
    limit: float | None,
    group_size: int = 128,
    use_ue8m0: bool = True,
    recipe="vllm",
    out_q: torch.Tensor | None = None,
    out_s: torch.Tensor | None = None,
    rows_per_chunk: int = 8192,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM1 output ``(R, 2I)`` -> ``(a2q (R, I) fp8, a2_scale (R, I // group_size) fp32 MN-major TMA-aligned)``:
    :func:`gated_activation` (rounded to ``x.dtype``) then :func:`per_token_group_quant_fp8_mn_major`, chunked over
    rows so the fp32 temporaries stay bounded. ``out_q`` is an optional ``(R, I)`` fp8 workspace view; ``out_s`` an
    optional scales tensor from ``layout.sf_empty`` (the masked layout's 3-D scales), returned instead."""
    from backends.deep_gemm.layout import mn_major_tma_aligned_empty

    R, N = x.shape
    I = N // 2
    if I % group_size:
        raise ValueError(f"the activation width I={I} must be a multiple of the quantization group {group_size}")
    q = torch.empty((R, I), dtype=torch.float8_e4m3fn, device=x.device) if out_q is None else out_q
    s = mn_major_tma_aligned_empty(R, I // group_size, x.device)
    for r0 in range(0, R, max(rows_per_chunk, 1)):
        r1 = min(R, r0 + rows_per_chunk)
        act = gated_activation(x[r0:r1], activation, alpha=alpha, beta=beta, limit=limit)
        per_token_group_quant_fp8_mn_major(act, group_size, use_ue8m0=use_ue8m0, recipe=recipe,
                                           out_q=q[r0:r1], out_s=s[r0:r1], rows_per_chunk=rows_per_chunk)
    if out_s is not None:
        out_s.copy_(s.reshape(out_s.shape))
        return q, out_s
    return q, s
