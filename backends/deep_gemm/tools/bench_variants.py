"""The deep_gemm backend's extra variant for ``python -m benchmarks --backend deep_gemm`` (``benchmarks/cli.py``).

``gemms``: the two grouped GEMMs alone (``m_grouped_fp8_gemm_nt_contiguous``) on the step's contiguous layout, with
the input quantized and gathered beforehand: what vLLM's Triton figures (GEMM1 + GEMM2 launches) time.
"""

from __future__ import annotations

import torch


def variants(shape, M: int, inp, device):
    from backends.deep_gemm import layout as L
    from backends.deep_gemm.experts import deep_gemm_m_grouped_fp8_gemm_nt_contiguous as gemm
    from reference.align import compute_aligned_M_and_alignment
    from reference.quant import per_token_group_quant_fp8

    if not shape.scheme.startswith("fp8_block128"):
        return []
    copies, sets = inp.weights.copies, inp.sets
    nw = len(copies)
    E, topk, K, I, N = shape.E, shape.topk, shape.K, shape.I, shape.N  # noqa: E741
    M_sum, al = compute_aligned_M_and_alignment(M, topk, E, 128)
    bufs = []
    for i, (x, _, ids) in enumerate(sets):
        qc = copies[i % nw][2]
        xq, xs = per_token_group_quant_fp8(x, 128, use_ue8m0=bool(getattr(qc, "use_ue8m0", False)))
        lay, _ = L.build_contiguous_layout(ids, E, M_sum, al)
        a1, s1 = L.gather_rows(xq, lay.row_token), L.gather_scales_mn_major(xs, lay.row_token)
        a2 = torch.zeros(M_sum, I, dtype=torch.float8_e4m3fn, device=device)
        s2 = L.mn_major_tma_aligned_empty(M_sum, I // 128, device).fill_(1.0)
        bufs.append((a1, s1, a2, s2, lay.m_indices))
    h = torch.empty(M_sum, N, dtype=torch.bfloat16, device=device)
    y = torch.empty(M_sum, K, dtype=torch.bfloat16, device=device)

    def gemms(i):
        w1, w2, qc = copies[i % nw]
        a1, s1, a2, s2, m_indices = bufs[i]
        gemm(a1, s1, w1, qc.w1.scale, h, m_indices)
        gemm(a2, s2, w2, qc.w2.scale, y, m_indices)

    return [("gemms", gemms)]
