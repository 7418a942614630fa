"""DeepGEMM's grouped GEMMs emulated in fp32 on the CPU, with the layout checks DeepGEMM makes on SM90, and the
backend's experts classes running on them (tests/test_deep_gemm_backend.py, and its interpreter subprocess).
"""

from __future__ import annotations

import torch

from backends.deep_gemm import layout
from backends.deep_gemm.experts import BatchedDeepGemmExperts, DeepGemmExperts
from reference import quant as rq
from reference.config import FusedMoEConfig, fp8_w8a8_moe_quant_config

__all__ = ["EmulatedBatchedDeepGemmExperts", "EmulatedDeepGemmExperts", "emulated_grouped_gemm",
           "emulated_grouped_gemm_masked", "small_problem"]


def emulated_grouped_gemm(a, sfa, b, sfb, d, m_indices, *, disable_ue8m0_cast=False):
    """fp32 emulation of m_grouped_fp8_gemm_nt_contiguous with the layout checks DeepGEMM makes on SM90."""
    assert a.dtype == b.dtype == torch.float8_e4m3fn and d.dtype == torch.bfloat16
    assert m_indices.dtype == torch.int32 and m_indices.dim() == 1 and m_indices.is_contiguous()
    assert sfa.dtype == sfb.dtype == torch.float32 and sfb.is_contiguous() and b.is_contiguous()
    assert sfa.stride() == (1, layout.tma_aligned_size(a.size(0)))  # what the backend promises to pass
    G, N, K = b.shape
    assert a.size(1) == K and tuple(d.shape) == (a.size(0), N) and tuple(sfb.shape) == (G, N // 128, K // 128)
    # Each 128-row block belongs to the expert of its first row (DeepGEMM's scheduler).
    firsts = m_indices.view(-1, 128)
    blk = firsts[:, :1].expand_as(firsts)
    assert bool(((firsts == blk) | (firsts < 0)).all()), "an M block mixes experts"
    A = a.float() * sfa.repeat_interleave(128, dim=1)
    for e in range(G):
        rows = (m_indices == e).nonzero().flatten()
        if rows.numel():
            B = b[e].float() * sfb[e].repeat_interleave(128, 0).repeat_interleave(128, 1)
            d[rows] = (A[rows] @ B.T).to(d.dtype)  # rows of -1 are left as they were (poisoned NaN)


def emulated_grouped_gemm_masked(a, sfa, b, sfb, d, masked_m, expected_m, *, disable_ue8m0_cast=False):
    """fp32 emulation of m_grouped_fp8_gemm_nt_masked with the layout checks of DeepGEMM's SM90 path
    (csrc/apis/gemm.hpp, csrc/utils/layout.hpp::check_sf_layout with the TMA stride check)."""
    G, max_m, K = a.shape
    assert a.dtype == b.dtype == torch.float8_e4m3fn and d.dtype == torch.bfloat16 and a.is_contiguous()
    assert masked_m.dtype == torch.int32 and masked_m.is_contiguous() and tuple(masked_m.shape) == (G,)
    assert isinstance(expected_m, int) and expected_m > 0
    assert tuple(sfa.shape) == (G, max_m, K // 128) and sfa.dtype == torch.float32
    assert sfa.stride(1) == 1 and sfa.stride(2) == layout.tma_aligned_size(max_m)
    assert sfa.stride(0) == sfa.stride(2) * sfa.size(2)
    N = b.size(1)
    assert tuple(d.shape) == (G, max_m, N) and tuple(sfb.shape) == (G, N // 128, K // 128)
    assert max_m % 128 == 0  # BLOCK_M 64 or 128 never runs into the next group
    for e in range(G):
        m = int(masked_m[e])
        assert 0 <= m <= max_m
        if m:
            A = a[e, :m].float() * sfa[e, :m].repeat_interleave(128, dim=1)
            B = b[e].float() * sfb[e].repeat_interleave(128, 0).repeat_interleave(128, 1)
            d[e, :m] = (A @ B.T).to(d.dtype)  # rows past masked_m are left as they were (poisoned NaN)


class EmulatedDeepGemmExperts(DeepGemmExperts):
    """``DeepGemmExperts`` with its grouped GEMMs emulated in fp32 (runs on the CPU)."""

    grouped_gemm = staticmethod(emulated_grouped_gemm)
    grouped_gemm_masked = staticmethod(emulated_grouped_gemm_masked)

    @staticmethod
    def _supports_current_device() -> bool:
        return True


class EmulatedBatchedDeepGemmExperts(BatchedDeepGemmExperts):
    """``BatchedDeepGemmExperts`` with its masked grouped GEMM emulated in fp32 (runs on the CPU)."""

    grouped_gemm_masked = staticmethod(emulated_grouped_gemm_masked)

    @staticmethod
    def _supports_current_device() -> bool:
        return True


def small_problem(M, topk, E, seed=0):
    """``(x, w1q, w2q, quant_config, moe_config)``: M bf16 tokens, E experts of K = I = 128 in 128x128-block FP8
    (UE8M0 scales), top-``topk``."""
    g = torch.Generator().manual_seed(seed)
    K, I = 128, 128
    w1q, w1s = rq.per_block_quant_fp8(torch.randn(E, 2 * I, K, generator=g) / 11, (128, 128))
    w2q, w2s = rq.per_block_quant_fp8(torch.randn(E, K, I, generator=g) / 11, (128, 128))
    qc = fp8_w8a8_moe_quant_config(w1s, w2s, block_shape=[128, 128], use_ue8m0=True)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    return x, w1q, w2q, qc, FusedMoEConfig(E, topk, K, I, E)
