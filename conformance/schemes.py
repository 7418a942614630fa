"""Build a scheme's quantized weights and ``FusedMoEQuantConfig`` from a case's bf16 weights (``specs/schemes.toml``).

The weights are quantized with the reference quantizers: the backend receives exactly these codes and scales, so
the only quantization it performs itself is the activations' (a1 in prepare, a2 between the GEMMs).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from reference import quant as q
from reference.config import (
    FUSED_MOE_UNQUANTIZED_CONFIG,
    FusedMoEQuantConfig,
    biased_moe_quant_config,
    fp8_w8a8_moe_quant_config,
    int8_w8a8_moe_quant_config,
    mxfp4_moe_quant_config,
    nvfp4_moe_quant_config,
    w4a8_moe_quant_config,
)
from specs import load_schemes

__all__ = ["quantize_weights", "scheme_tolerance_key", "UNQUANTIZED"]

UNQUANTIZED = {"bf16", "fp16", "fp32"}
# NVFP4 activations use fixed global encode scales (vLLM calibrates them): 448*6 / expected amax.
NVFP4_A1_GSCALE = torch.tensor([448.0 * 6.0 / 8.0])
NVFP4_A2_GSCALE = torch.tensor([448.0 * 6.0 / 16.0])


def scheme_tolerance_key(scheme: str, dtype: torch.dtype) -> str:
    if scheme in UNQUANTIZED:
        return str(dtype).removeprefix("torch.")
    return load_schemes()[scheme]["tolerance"]


def _stack(pairs):
    return tuple(torch.stack(t) for t in zip(*pairs))


def quantize_weights(scheme: str, w1: torch.Tensor, w2: torch.Tensor, *, w1_bias=None, w2_bias=None,
                     gemm1_alpha=None, gemm1_clamp_limit=None):
    """``(w1q, w2q, quant_config)`` for ``scheme`` from bf16 ``w1 (E, N, K)`` and ``w2 (E, K, I)``.

    Raises:
        ValueError: unknown scheme (lists the known ones).
    """
    extra = dict(gemm1_alpha=gemm1_alpha, gemm1_clamp_limit=gemm1_clamp_limit)
    if scheme in UNQUANTIZED:
        qc = FUSED_MOE_UNQUANTIZED_CONFIG if w1_bias is None else biased_moe_quant_config(w1_bias, w2_bias)
        if gemm1_alpha is not None or gemm1_clamp_limit is not None:
            qc = FusedMoEQuantConfig(a1=qc.a1, a2=qc.a2, w1=qc.w1, w2=qc.w2, **extra)
        return w1, w2, qc
    if scheme == "fp8_tensor":
        (w1q, s1), (w2q, s2) = (_stack([q.scaled_fp8_quant(w[e]) for e in range(w.shape[0])]) for w in (w1, w2))
        return w1q, w2q, fp8_w8a8_moe_quant_config(s1.reshape(-1), s2.reshape(-1), **extra)
    if scheme == "fp8_channel_token":
        (w1q, s1), (w2q, s2) = (_stack([q.scaled_fp8_quant(w[e], use_per_token_if_dynamic=True)
                                        for e in range(w.shape[0])]) for w in (w1, w2))
        return w1q, w2q, fp8_w8a8_moe_quant_config(s1, s2, per_act_token_quant=True, per_out_ch_quant=True, **extra)
    if scheme in ("fp8_block128", "fp8_block128_ue8m0"):
        ue8m0 = scheme.endswith("ue8m0")
        w1q, s1 = q.per_block_quant_fp8(w1, (128, 128), use_ue8m0=ue8m0)
        w2q, s2 = q.per_block_quant_fp8(w2, (128, 128), use_ue8m0=ue8m0)
        return w1q, w2q, fp8_w8a8_moe_quant_config(s1, s2, block_shape=[128, 128], use_ue8m0=ue8m0, **extra)
    if scheme == "int8_channel_token":
        (w1q, s1), (w2q, s2) = q.int8_quant_per_channel(w1), q.int8_quant_per_channel(w2)
        return w1q, w2q, int8_w8a8_moe_quant_config(s1, s2)
    if scheme in ("mxfp4_w4a16", "mxfp4_mxfp8"):
        (w1q, s1), (w2q, s2) = q.mxfp4_quantize(w1), q.mxfp4_quantize(w2)
        act = None if scheme == "mxfp4_w4a16" else "mxfp8"
        return w1q, w2q, mxfp4_moe_quant_config(s1, s2, activation=act, w1_bias=w1_bias, w2_bias=w2_bias, **extra)
    if scheme == "nvfp4":
        (w1q, s1, g1), (w2q, s2, g2) = (_stack([q.nvfp4_quantize(w[e]) for e in range(w.shape[0])])
                                        for w in (w1, w2))
        return w1q, w2q, nvfp4_moe_quant_config(s1, s2, g1.reshape(-1), g2.reshape(-1),
                                                 NVFP4_A1_GSCALE, NVFP4_A2_GSCALE)
    if scheme == "w4a8":
        def one(w):
            chan = w.float().abs().amax(dim=-1).clamp(min=1e-6)  # normalise rows so group scales fit in E4M3
            packed, gs = q.w4a8_quantize_weight(w.float() / chan.unsqueeze(-1), 128)
            return packed, gs, chan
        (w1q, s1, c1), (w2q, s2, c2) = one(w1), one(w2)
        return w1q, w2q, w4a8_moe_quant_config(s1, s2, c1, c2)
    raise ValueError(f"unknown scheme {scheme!r}; known: {', '.join(load_schemes())}")
