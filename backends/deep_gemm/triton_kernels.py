"""The Triton kernels that replace the torch-op paths of the experts step on CUDA (same results; the torch paths in
:mod:`act_quant` / :mod:`layout` stay the definition and the CPU implementation).

- :func:`act_mul_quant`: one program per (rows, 1x128 groups) tile (``ACT_QUANT_CONFIG``; with ``routes``, the
  rows of the routes only): loads gate and up, computes the activation in
  fp32, rounds it to the activation dtype, computes the group's amax / scale / FP8 codes with the recipe's choices,
  stores the codes and the fp32 scale into MN-major TMA-aligned storage. One read of the GEMM1 output, one write of
  the codes (the torch path makes ~15 passes).
- :func:`quantize_scatter`: the prepare step's 1x128 input quantization fused with the permutation: each token's
  group is read once, quantized, and written to the row of each of its routes (replacing a quantization pass, a row
  gather and a scale gather).
- :func:`build_contiguous_layout`: the contiguous layout in three kernels over blocks of 1024 routes (histograms,
  a one-program prefix, placement by a sort within each block), or the masked layout in one (a program per expert),
  replacing ~20 small torch ops and a global sort (host-bound at decode).
- :func:`unpermute_and_reduce`: one program per (token, 1024 columns): ``sum_k w[t, k] * a[inv_perm[t, k]]`` in
  fp32, k ascending, one cast.

Numerics vs the torch paths: ``exp`` is libdevice's ``expf`` and divisions are IEEE (``div_rn``), as in torch's CUDA
kernels; power-of-two scales use the exponent-bit formula, which equals ``exp2(ceil(log2(s)))`` for every scale
``amax / 448`` of a 16-bit amax (the activation is rounded to bf16/fp16 before its amax is taken), so the codes and
scales are those of ``reference.quant.per_token_group_quant_fp8`` for the same activation values. The reduction's
product is an explicit ``mul.rn.f32`` so it is not contracted into an FMA with the sum (the reference rounds the
product). Under ``TRITON_INTERPRET=1`` (CPU tests) ``exp`` falls back to ``tl.exp`` and the product to ``*``; the
interpreter's own float conversions truncate (fp32 -> bf16), so only GPU runs are bit-exact.
"""

from __future__ import annotations

import os

import torch

from reference.activation import MoEActivation

try:  # triton is optional: the torch paths are used without it
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    import backends._triton_interpreter  # noqa: F401  (runtime loop bounds under TRITON_INTERPRET=1)
    from backends._triton_launch import FP_FUSION  # FMA contraction pinned on at the floating-point launches

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the machine
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "available", "act_mul_quant", "quantize_scatter", "unpermute_and_reduce",
           "build_contiguous_layout"]

_ACT_CODE = {MoEActivation.SILU: 0, MoEActivation.SWIGLUOAI_UNINTERLEAVE: 1, MoEActivation.SWIGLUSTEP: 2}
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(t: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on ``t``'s device (CUDA, or any device under TRITON_INTERPRET=1)."""
    return HAVE_TRITON and (t.is_cuda or _INTERPRET)


if HAVE_TRITON:

    @triton.jit
    def _exp(x, EXACT: tl.constexpr):
        if EXACT:
            return libdevice.exp(x)
        else:
            return tl.exp(x)

    @triton.jit
    def _group_quant(act, amax_floor, ue8m0_floor, USE_UE8M0: tl.constexpr, DIVIDE: tl.constexpr,
                     AMAX_OVER_MAX: tl.constexpr):
        """``(codes fp8 (ROWS, GROUP), scales fp32 (ROWS,))`` of one 1 x GROUP group per row: the recipe's amax
        floor, scale rule, UE8M0 rounding and divide / reciprocal-multiply; a NaN / inf in a group poisons it."""
        # amax with NaN -> inf so that a NaN poisons its group (tl.max may drop NaN)
        mag = tl.where(act != act, float("inf"), tl.abs(act))
        amax = tl.max(mag, axis=1)
        poisoned = amax == float("inf")
        a = tl.maximum(amax, amax_floor)
        if AMAX_OVER_MAX:
            s = tl.math.div_rn(a, 448.0)
        else:
            s = tl.math.div_rn(1.0, tl.math.div_rn(448.0, a))
        if USE_UE8M0:
            s = tl.maximum(tl.abs(s), ue8m0_floor)
            bits = s.to(tl.int32, bitcast=True)
            e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
            e = tl.minimum(tl.maximum(e, 1), 254)
            s = (e << 23).to(tl.float32, bitcast=True)
        s = tl.where(poisoned, float("nan"), s)
        if DIVIDE:
            qf = tl.math.div_rn(act, s[:, None])
        else:
            qf = act * tl.math.div_rn(1.0, s)[:, None]
        qf = tl.where(poisoned[:, None], float("nan"), qf)
        qf = tl.minimum(tl.maximum(qf, -448.0), 448.0)
        return qf.to(tl.float8e4nv), s

    @triton.jit
    def _sf_offset(rows, grp, s_R0, s_S0, s_S1):
        # layout.sf_empty's addressing: contiguous (R0 >= rows, S0 = 0) or masked (R0 = slot rows)
        return (rows // s_R0) * s_S0 + grp.to(tl.int64) * s_S1 + rows % s_R0

    @triton.jit
    def _act_quant_kernel(x_ptr, q_ptr, s_ptr, route_ptr, R, I, stride_xr, stride_qr, s_R0, s_S0, s_S1,
                          alpha, beta, limit, amax_floor, ue8m0_floor,
                          ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, ACT_DTYPE: tl.constexpr,
                          USE_UE8M0: tl.constexpr, DIVIDE: tl.constexpr, AMAX_OVER_MAX: tl.constexpr,
                          EXACT: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, ROUTES: tl.constexpr,
                          GPP: tl.constexpr):
        # one program: ROWS rows x GPP consecutive 1 x GROUP groups (the row indices loaded once)
        if ROUTES:  # R routes: the rows are the layout rows of the routes (negative: none), nothing else is touched
            idx = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
            rows = tl.load(route_ptr + idx, mask=idx < R, other=-1)
            rmask = rows >= 0
        else:
            rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
            rmask = rows < R
        for gi in range(GPP):
            grp = tl.program_id(1) * GPP + gi
            gmask = rmask & (grp * GROUP < I)
            cols = grp * GROUP + tl.arange(0, GROUP)
            xp = x_ptr + rows[:, None] * stride_xr + cols[None, :]
            g = tl.load(xp, mask=gmask[:, None], other=0.0).to(tl.float32)
            u = tl.load(xp + I, mask=gmask[:, None], other=0.0).to(tl.float32)
            if ACT == 2:  # SWIGLUSTEP: min(silu(g), L) * clamp(u, -L, L)
                silu = tl.math.div_rn(g, 1.0 + _exp(-g, EXACT))
                y = tl.minimum(silu, limit) * tl.minimum(tl.maximum(u, -limit), limit)
            else:
                if HAS_LIMIT:
                    g = tl.minimum(g, limit)
                    u = tl.minimum(tl.maximum(u, -limit), limit)
                if ACT == 0:  # SILU: silu(g) * u
                    y = tl.math.div_rn(g, 1.0 + _exp(-g, EXACT)) * u
                else:  # SWIGLUOAI_UNINTERLEAVE: g * sigmoid(alpha * g) * (u + beta)
                    sig = tl.math.div_rn(1.0, 1.0 + _exp(-(alpha * g), EXACT))
                    y = g * sig * (u + beta)
            act = y.to(ACT_DTYPE).to(tl.float32)  # the reference's rounding point
            q, s = _group_quant(act, amax_floor, ue8m0_floor, USE_UE8M0, DIVIDE, AMAX_OVER_MAX)
            tl.store(q_ptr + rows[:, None] * stride_qr + cols[None, :], q, mask=gmask[:, None])
            tl.store(s_ptr + _sf_offset(rows, grp, s_R0, s_S0, s_S1), s, mask=gmask)

    @triton.jit
    def _quant_scatter_kernel(x_ptr, inv_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qr, s_R0, s_S0, s_S1,
                              amax_floor, ue8m0_floor, TOPK: tl.constexpr, USE_UE8M0: tl.constexpr,
                              DIVIDE: tl.constexpr, AMAX_OVER_MAX: tl.constexpr, GROUP: tl.constexpr,
                              ROWS: tl.constexpr, GPP: tl.constexpr):
        # one read of each token's group, quantized once, written to the row of each of its routes; a program
        # covers ROWS tokens x GPP consecutive groups
        toks = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        tmask = toks < M
        for gi in range(GPP):
            grp = tl.program_id(1) * GPP + gi
            gmask = tmask & (grp * GROUP < K)
            cols = grp * GROUP + tl.arange(0, GROUP)
            x = tl.load(x_ptr + toks[:, None] * stride_xm + cols[None, :], mask=gmask[:, None], other=0.0)
            q, s = _group_quant(x.to(tl.float32), amax_floor, ue8m0_floor, USE_UE8M0, DIVIDE, AMAX_OVER_MAX)
            for k in tl.static_range(TOPK):
                r = tl.load(inv_ptr + toks * TOPK + k, mask=gmask, other=-1)
                ok = gmask & (r >= 0)
                tl.store(q_ptr + r[:, None] * stride_qr + cols[None, :], q, mask=ok[:, None])
                tl.store(s_ptr + _sf_offset(r, grp, s_R0, s_S0, s_S1), s, mask=ok)

    @triton.jit
    def _mul_rn(a, b, EXACT: tl.constexpr):
        # mul.rn is never contracted with the following add into an FMA (the reference rounds the product)
        if EXACT:
            return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                             is_pure=True, pack=1)
        else:
            return a * b

    @triton.jit
    def _gather_reduce_kernel(a_ptr, inv_ptr, w_ptr, out_ptr, K, stride_a, stride_out,
                              TOPK: tl.constexpr, BLOCK_K: tl.constexpr, EXACT: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = cols < K
        acc = tl.zeros([BLOCK_K], dtype=tl.float32)
        poison = 0
        for k in tl.static_range(TOPK):
            # branch-free, so the TOPK row loads are independent and overlap (a decode step is latency-bound here)
            r = tl.load(inv_ptr + t * TOPK + k)
            w = tl.load(w_ptr + t * TOPK + k).to(tl.float32)
            poison += (r == -2).to(tl.int32)  # layout.POISON_ROW: a bad id / no row: the token's output is NaN
            valid = r >= 0
            v = tl.load(a_ptr + tl.maximum(r, 0).to(tl.int64) * stride_a + cols, mask=mask & valid,
                        other=0.0).to(tl.float32)
            acc = tl.where(valid, acc + _mul_rn(v, w, EXACT), acc)
        acc = tl.where(poison > 0, float("nan"), acc)
        tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


    @triton.jit
    def _route_keys(ids_ptr, map_ptr, offs, n, n_ids, E, HAS_MAP: tl.constexpr):
        """Local expert of each route in ``offs`` (E for dropped routes) and the out-of-range mask."""
        inb = offs < n
        ids = tl.load(ids_ptr + offs, mask=inb, other=-1).to(tl.int64)
        oor = inb & ((ids < -1) | (ids >= n_ids))
        valid = inb & (ids >= 0) & (ids < n_ids)
        if HAS_MAP:
            loc = tl.load(map_ptr + tl.where(valid, ids, 0), mask=valid, other=-1).to(tl.int64)
        else:
            loc = ids
        key = tl.where(valid & (loc >= 0) & (loc < E), loc, E)  # a map entry past E_local: not here
        return key, oor

    @triton.jit
    def _block_keys(ids_ptr, map_ptr, b, n, n_ids, E, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):
        """Keys of route block ``b``: the local expert, E for a dropped route (and past n), E + 1 out of range."""
        offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        key, oor = _route_keys(ids_ptr, map_ptr, offs, n, n_ids, E, HAS_MAP)
        return tl.where(oor, E + 1, key).to(tl.int32), offs

    @triton.jit
    def _layout_hist_kernel(ids_ptr, map_ptr, cnt_ptr, n, n_ids, E, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr,
                            BINS: tl.constexpr):
        # the contiguous layout, 1/3: program b writes the histogram of route block b's keys: cnt[b, 0 .. E + 1]
        b = tl.program_id(0)
        key, _ = _block_keys(ids_ptr, map_ptr, b, n, n_ids, E, HAS_MAP, BLOCK)
        h = tl.histogram(key, BINS)
        bins = tl.arange(0, BINS)
        tl.store(cnt_ptr + b.to(tl.int64) * (E + 2) + bins, h.to(tl.int64), mask=bins < E + 2)

    @triton.jit
    def _layout_starts_kernel(cnt_ptr, counts_ptr, starts_ptr, NB, E, alignment, BE: tl.constexpr,
                              BB: tl.constexpr):
        # 2/3, one program: per-expert totals (counts_all: E experts + the out-of-range count), aligned starts, and
        # cnt[b, e] rewritten as the exclusive prefix over the blocks (where block b's routes of e begin)
        carry = tl.zeros([1], dtype=tl.int64).sum(axis=0)
        for e0 in range(0, E + 2, BE):
            e = e0 + tl.arange(0, BE)
            em = e < E + 2
            run = tl.zeros([BE], dtype=tl.int64)
            for b0 in range(0, NB, BB):
                bb = b0 + tl.arange(0, BB)
                m2 = (bb < NB)[:, None] & em[None, :]
                ptr = cnt_ptr + bb[:, None].to(tl.int64) * (E + 2) + e[None, :]
                c = tl.load(ptr, mask=m2, other=0)
                tl.store(ptr, run[None, :] + tl.cumsum(c, axis=0) - c, mask=m2)
                run += tl.sum(c, axis=0)
            tl.store(counts_ptr + e, run, mask=e < E)
            tl.store(counts_ptr + E + (e - E - 1), run, mask=e == E + 1)  # the out-of-range ids
            aligned = tl.where(e < E, (run + alignment - 1) // alignment * alignment, 0)
            tl.store(starts_ptr + e, carry + tl.cumsum(aligned, axis=0) - aligned, mask=e < E)
            carry += tl.sum(aligned, axis=0)

    @triton.jit
    def _layout_scatter_kernel(ids_ptr, map_ptr, cnt_ptr, starts_ptr, inv_ptr, mind_ptr, tok_ptr, n, n_ids, E,
                               topk, M_sum, HAS_MAP: tl.constexpr, WRITE_TOK: tl.constexpr, BLOCK: tl.constexpr,
                               BINS: tl.constexpr):
        # 3/3: program b places route block b. Its routes sorted by (key, flat index); a route's rank among the
        # block's routes of its expert = sorted position - routes of smaller keys in the block (histogram prefix);
        # its row = start of the expert + routes of the expert in earlier blocks + rank (increasing flat index).
        b = tl.program_id(0)
        key, _ = _block_keys(ids_ptr, map_ptr, b, n, n_ids, E, HAS_MAP, BLOCK)
        p = tl.arange(0, BLOCK)
        h = tl.histogram(key, BINS)
        before = tl.cumsum(h, axis=0) - h
        srt = tl.sort(key * BLOCK + p)
        ks = srt // BLOCK
        route = b.to(tl.int64) * BLOCK + srt % BLOCK
        rank = p - tl.gather(before, ks, 0)
        local = ks < E
        base = tl.load(starts_ptr + ks, mask=local, other=0) + tl.load(cnt_ptr + b.to(tl.int64) * (E + 2) + ks)
        rows = base + rank
        ok = local & (rows < M_sum)
        live = route < n
        tl.store(inv_ptr + route, tl.where(ok, rows, tl.where(ks == E, -1, -2)).to(tl.int64), mask=live)
        tl.store(mind_ptr + rows, ks, mask=ok & live)
        if WRITE_TOK:
            tl.store(tok_ptr + rows, route // topk, mask=ok & live)

    @triton.jit
    def _layout_masked_kernel(ids_ptr, map_ptr, counts_ptr, masked_m_ptr, inv_ptr, tok_ptr, n, n_ids, E, topk, slot,
                              HAS_MAP: tl.constexpr, WRITE_TOK: tl.constexpr, BLOCK: tl.constexpr):
        # The masked layout in one launch (a decode batch: a few blocks of routes). Program e < E writes the rows of
        # expert e, e * slot + (its routes before, in flat index order), at most slot of them (a route without a row
        # is poisoned, -2), then its count and masked_m; program E writes the dropped routes (-1), the out-of-range
        # ids (-2) and their count.
        e = tl.program_id(0)
        base = e.to(tl.int64) * slot
        running = tl.zeros([1], dtype=tl.int64)
        n_oor = tl.zeros([1], dtype=tl.int64)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            key, oor = _route_keys(ids_ptr, map_ptr, offs, n, n_ids, E, HAS_MAP)
            if e < E:
                hit = (key == e) & (offs < n)
                within = running + tl.cumsum(hit.to(tl.int64), axis=0) - 1
                rows = base + within
                ok = hit & (within < slot)
                tl.store(inv_ptr + offs, tl.where(ok, rows, -2), mask=hit)
                if WRITE_TOK:
                    tl.store(tok_ptr + rows, offs // topk, mask=ok)
                running += tl.sum(hit.to(tl.int64), axis=0)
            else:
                dropped = (key == E) & (offs < n)
                tl.store(inv_ptr + offs, tl.where(oor, -2, -1).to(tl.int64), mask=dropped)
                n_oor += tl.sum(oor.to(tl.int64), axis=0)
        one = tl.arange(0, 1)
        if e < E:
            tl.store(counts_ptr + e + one, running)
            tl.store(masked_m_ptr + e + one, tl.minimum(running, slot).to(tl.int32))
        else:
            tl.store(counts_ptr + E + one, n_oor)


_TL_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16"}

#: Launch shape of the act+quant kernel: rows (routes) per program, 1x128 groups per program, warps. ``config=`` of
#: :func:`act_mul_quant` overrides it (``tools/probe.py --sections tune`` times the candidates).
ACT_QUANT_CONFIG = {"rows": 16, "groups": 1, "num_warps": 4}
#: The same for the fused input quantization + permutation (tokens per program).
QUANT_SCATTER_CONFIG = {"rows": 16, "groups": 1, "num_warps": 4}


def build_contiguous_layout(topk_ids: torch.Tensor, local_num_experts: int, M_sum: int, alignment: int,
                            expert_map: torch.Tensor | None = None, *, slot_rows: int | None = None,
                            with_row_token: bool = True):
    """Triton version of :func:`backends.deep_gemm.layout.build_contiguous_layout` (same arguments, the masked
    layout with ``slot_rows`` included; the same layout). Returns ``(layout, counts_all)`` where ``counts_all`` is
    int64 ``(E_local + 1,)``: the routes per local expert, then the number of ids outside the id space (instead of a
    per-route mask). No host synchronisation.

    Contiguous: three kernels over blocks of 1024 routes (histograms; totals, aligned starts and per-block offsets;
    placement by a sort within each block) and the ``m_indices`` fill. Masked (a decode batch): one kernel, a program
    per expert, which also writes ``masked_m``; ``m_indices`` is not built (None: the masked GEMM reads ``masked_m``).
    ``with_row_token=False`` leaves ``row_token`` None (only the gather of pre-quantized FP8 inputs reads it).
    """
    from backends.deep_gemm.layout import ContiguousLayout

    if topk_ids.dim() != 2 or topk_ids.is_floating_point():
        raise ValueError(f"topk_ids must be a 2-D integer tensor, got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    device = topk_ids.device
    M, topk = topk_ids.shape
    E = local_num_experts
    n = M * topk
    masked = slot_rows is not None
    if masked and (slot_rows <= 0 or M_sum != E * slot_rows or alignment != slot_rows):
        raise ValueError(f"the masked layout needs M_sum = local_num_experts * slot_rows and alignment = "
                         f"slot_rows, got M_sum={M_sum}, E={E}, slot_rows={slot_rows}, alignment={alignment}")
    ids = topk_ids.contiguous()
    emap = expert_map.to(device=device).contiguous() if expert_map is not None else ids
    n_ids = expert_map.numel() if expert_map is not None else E
    counts_all = torch.zeros(E + 1, dtype=torch.int64, device=device) if not n else \
        torch.empty(E + 1, dtype=torch.int64, device=device)
    BLOCK = 1024
    inv = torch.empty((n,), dtype=torch.int64, device=device)
    m_indices = None if masked else torch.full((M_sum,), -1, dtype=torch.int32, device=device)
    row_token = torch.zeros(M_sum, dtype=torch.int64, device=device) if with_row_token else None
    masked_m = (torch.empty if n else torch.zeros)(E, dtype=torch.int32, device=device) if masked else None
    if n and not masked:
        # route blocks in parallel: histograms, then totals / starts / per-block offsets, then the placement
        NB = triton.cdiv(n, BLOCK)
        bins = triton.next_power_of_2(E + 2)
        cnt = torch.empty((NB, E + 2), dtype=torch.int64, device=device)
        starts = torch.empty(E, dtype=torch.int64, device=device)
        _layout_hist_kernel[(NB,)](ids, emap, cnt, n, n_ids, E, HAS_MAP=expert_map is not None, BLOCK=BLOCK,
                                   BINS=bins, num_warps=4)
        _layout_starts_kernel[(1,)](cnt, counts_all, starts, NB, E, alignment, BE=min(bins, 128), BB=16,
                                    num_warps=8)
        _layout_scatter_kernel[(NB,)](ids, emap, cnt, starts, inv, m_indices,
                                      row_token if with_row_token else inv, n, n_ids, E, max(topk, 1), M_sum,
                                      HAS_MAP=expert_map is not None, WRITE_TOK=with_row_token, BLOCK=BLOCK,
                                      BINS=bins, num_warps=8)
    elif n:
        _layout_masked_kernel[(E + 1,)](ids, emap, counts_all, masked_m, inv, row_token if with_row_token else inv,
                                        n, n_ids, E, max(topk, 1), slot_rows, HAS_MAP=expert_map is not None,
                                        WRITE_TOK=with_row_token, BLOCK=BLOCK, num_warps=4)
    layout = ContiguousLayout(row_token=row_token, m_indices=m_indices, inv_perm=inv.reshape(M, topk),
                              counts=counts_all[:E], M_sum=M_sum, alignment=alignment, slot_rows=slot_rows,
                              masked_m_buf=masked_m)
    return layout, counts_all


def act_mul_quant(x: torch.Tensor, activation: MoEActivation, *, alpha, beta, limit, group_size: int,
                  use_ue8m0: bool, recipe, out_q: torch.Tensor | None = None, out_s: torch.Tensor | None = None,
                  routes: torch.Tensor | None = None, config: dict | None = None):
    """Triton version of :func:`backends.deep_gemm.act_quant.act_mul_quant` (same arguments and results).

    With ``routes`` (the layout's ``inv_perm``: the row of each route, negative for none) only the routes' rows are
    computed (programs of ``ACT_QUANT_CONFIG["rows"]`` routes): the work follows the routes, not the layout's rows (a
    decode batch in the masked layout uses a few of ``E_local * 128`` rows; the contiguous layout's worst-case ``M_sum``
    holds padding). Other rows are neither read nor written (they keep what the buffers held; the step never reads their
    results). ``out_s``: scales from ``layout.sf_empty`` (2-D, or the masked layout's 3-D ones).

    Raises NotImplementedError when a configuration is outside the kernel (fp32 activations with the
    ``exp2_ceil_log2`` rule, other recipes, group sizes other than a power of two): the caller falls back to torch.
    """
    from backends.deep_gemm.act_quant import _recipe_fields
    from backends.deep_gemm.layout import mn_major_tma_aligned_empty, sf_addressing

    if activation not in _ACT_CODE:
        raise NotImplementedError(f"no Triton act+quant for {activation}")
    if x.dtype not in _TL_DTYPE:
        raise NotImplementedError("the Triton act+quant rounds the activation to bf16/fp16 only")
    if x.dim() != 2 or x.stride(1) != 1 or group_size & (group_size - 1):
        raise NotImplementedError("the Triton act+quant needs a row-major 2-D input and a power-of-two group")
    r = _recipe_fields(recipe)
    R, N = x.shape
    I = N // 2
    if I % group_size:
        raise ValueError(f"the activation width I={I} must be a multiple of the quantization group {group_size}")
    q = torch.empty((R, I), dtype=torch.float8_e4m3fn, device=x.device) if out_q is None else out_q
    if q.stride(1) != 1:
        raise NotImplementedError("out_q must be row-major")
    s = mn_major_tma_aligned_empty(R, I // group_size, x.device) if out_s is None else out_s
    if R == 0:
        return q, s
    s_R0, s_S0, s_S1 = sf_addressing(s)
    if activation is MoEActivation.SWIGLUSTEP:
        lim, has_lim = (7.0 if limit is None else float(limit)), True
    else:
        lim, has_lim = (0.0 if limit is None else float(limit)), limit is not None
    act_dtype = tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16
    n_work = routes.numel() if routes is not None else R
    if n_work == 0:
        return q, s
    route_rows = routes.reshape(-1).to(torch.int64) if routes is not None else q
    cfg = dict(ACT_QUANT_CONFIG, **(config or {}))
    ROWS, GPP = cfg["rows"], min(cfg["groups"], I // group_size)
    _act_quant_kernel[(triton.cdiv(n_work, ROWS), triton.cdiv(I // group_size, GPP))](
        x, q, s, route_rows, n_work, I, x.stride(0), q.stride(0), s_R0, s_S0, s_S1,
        1.0 if alpha is None else float(alpha), 0.0 if beta is None else float(beta), lim,
        float(r.amax_floor), float(r.ue8m0_scale_floor),
        ACT=_ACT_CODE[activation], HAS_LIMIT=has_lim, ACT_DTYPE=act_dtype, USE_UE8M0=use_ue8m0,
        DIVIDE=r.quant_op == "divide", AMAX_OVER_MAX=r.scale_computation == "amax/max", EXACT=not _INTERPRET,
        GROUP=group_size, ROWS=ROWS, ROUTES=routes is not None, GPP=GPP, num_warps=cfg["num_warps"], **FP_FUSION)
    return q, s


def quantize_scatter(x: torch.Tensor, inv_perm: torch.Tensor, out_q: torch.Tensor, out_s: torch.Tensor, *,
                     group_size: int = 128, use_ue8m0: bool = True, recipe="vllm", config: dict | None = None) -> None:
    """Triton version of :func:`backends.deep_gemm.layout.quantize_scatter` (same arguments and results): one
    program per (16 tokens, group) reads the group once, quantizes it and writes it to the row of each route.

    Raises NotImplementedError outside the kernel (fp32 input, a non-power-of-two group, strided rows): the caller
    falls back to the torch path.
    """
    from backends.deep_gemm.act_quant import _recipe_fields
    from backends.deep_gemm.layout import sf_addressing

    if x.dtype not in _TL_DTYPE or x.dim() != 2 or x.stride(1) != 1 or group_size & (group_size - 1):
        raise NotImplementedError("the Triton quantize_scatter needs row-major bf16/fp16 (M, K) and a power-of-two "
                                  "group")
    if out_q.stride(1) != 1:
        raise NotImplementedError("out_q must be row-major")
    r = _recipe_fields(recipe)
    M, K = x.shape
    topk = inv_perm.size(1)
    if K % group_size:
        raise ValueError(f"K={K} must be a multiple of the quantization group {group_size}")
    if M == 0 or topk == 0:
        return
    s_R0, s_S0, s_S1 = sf_addressing(out_s)
    inv = inv_perm.to(torch.int64).contiguous()
    cfg = dict(QUANT_SCATTER_CONFIG, **(config or {}))
    ROWS, GPP = cfg["rows"], min(cfg["groups"], K // group_size)
    _quant_scatter_kernel[(triton.cdiv(M, ROWS), triton.cdiv(K // group_size, GPP))](
        x, inv, out_q, out_s, M, K, x.stride(0), out_q.stride(0), s_R0, s_S0, s_S1,
        float(r.amax_floor), float(r.ue8m0_scale_floor), TOPK=topk, USE_UE8M0=use_ue8m0,
        DIVIDE=r.quant_op == "divide", AMAX_OVER_MAX=r.scale_computation == "amax/max", GROUP=group_size,
        ROWS=ROWS, GPP=GPP, num_warps=cfg["num_warps"], **FP_FUSION)


def unpermute_and_reduce(a: torch.Tensor, inv_perm: torch.Tensor, topk_weights: torch.Tensor,
                         output: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`backends.deep_gemm.layout.unpermute_and_reduce` (same arguments and results)."""
    M, topk = inv_perm.shape
    K = a.size(1)
    if tuple(output.shape) != (M, K) or a.stride(1) != 1 or output.stride(1) != 1:
        raise NotImplementedError("the Triton reduction needs row-major (M_sum, K) input and (M, K) output")
    if M == 0:
        return output
    inv = inv_perm.to(torch.int64).contiguous()
    w = topk_weights.to(torch.float32).contiguous()
    BLOCK_K = 1024
    _gather_reduce_kernel[(M, triton.cdiv(K, BLOCK_K))](a, inv, w, output, K, a.stride(0), output.stride(0),
                                                         TOPK=topk, BLOCK_K=BLOCK_K, EXACT=not _INTERPRET,
                                                         num_warps=4, **FP_FUSION)
    return output
