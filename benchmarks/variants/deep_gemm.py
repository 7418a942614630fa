"""The deep_gemm backend's extra variant for ``python -m benchmarks --backend deep_gemm`` (``benchmarks/cli.py``).

``gemms``: the two grouped GEMMs alone on the layout the step uses (``experts.plan_layout``: the contiguous layout and
``m_grouped_fp8_gemm_nt_contiguous`` from M = 128, the masked layout and ``m_grouped_fp8_gemm_nt_masked`` below),
with the input quantized and permuted beforehand: what vLLM's Triton figures (GEMM1 + GEMM2 launches) time, and
what the step is measured against (``step / gemms``).
"""

from __future__ import annotations

import torch


def variants(shape, M: int, inp, device):
    from backends.deep_gemm import layout as L
    from backends.deep_gemm.experts import DeepGemmExperts, expected_m_for, plan_layout
    from reference.quant import per_token_group_quant_fp8

    if not shape.scheme.startswith("fp8_block128"):
        return []
    copies, sets = inp.weights.copies, inp.sets
    nw = len(copies)
    E, topk, K, I, N = shape.E, shape.topk, shape.K, shape.I, shape.N  # noqa: E741
    rows, al, slot = plan_layout(M, topk, E, None, DeepGemmExperts.masked_below_m)
    expected_m = expected_m_for(M, topk, E)
    bufs = []
    for i, (x, _, ids) in enumerate(sets):
        qc = copies[i % nw][2]
        xq, xs = per_token_group_quant_fp8(x, 128, use_ue8m0=bool(getattr(qc, "use_ue8m0", False)))
        lay, _ = L.build_contiguous_layout(ids, E, rows, al, slot_rows=slot)
        a1, s1 = L.gather_rows(xq, lay.row_token), L.gather_scales_mn_major(xs, lay.row_token, slot)
        a2 = torch.zeros(rows, I, dtype=torch.float8_e4m3fn, device=device)
        s2 = L.sf_empty(rows, I // 128, device, slot).fill_(1.0)
        bufs.append((a1, s1, a2, s2, lay))
    h = torch.empty(rows, N, dtype=torch.bfloat16, device=device)
    y = torch.empty(rows, K, dtype=torch.bfloat16, device=device)

    class _Gemms(DeepGemmExperts):  # the step's own GEMM dispatch (_gemm), nothing else
        def __init__(self):
            pass

    g = _Gemms()

    def gemms(i):
        w1, w2, qc = copies[i % nw]
        a1, s1, a2, s2, lay = bufs[i]
        disable = not bool(getattr(qc, "use_ue8m0", False))
        g._gemm(lay, a1, s1, w1, qc.w1.scale, h, expected_m, disable)
        g._gemm(lay, a2, s2, w2, qc.w2.scale, y, expected_m, disable)

    return [("gemms", gemms)]
