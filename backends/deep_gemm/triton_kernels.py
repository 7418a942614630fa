"""Two small Triton kernels that replace the torch-op paths of the experts step on CUDA (same results; the torch
paths in :mod:`act_quant` / :mod:`layout` stay the definition and the CPU implementation).

- :func:`act_mul_quant`: one program per (16 rows, 128-column group): loads gate and up, computes the activation in
  fp32, rounds it to the activation dtype, computes the group's amax / scale / FP8 codes with the recipe's choices,
  stores the codes and the fp32 scale into MN-major TMA-aligned storage. One read of the GEMM1 output, one write of
  the codes (the torch path makes ~15 passes).
- :func:`build_contiguous_layout`: the contiguous layout in two kernels (count per expert, then place routes in
  increasing flat index with a block cumsum), replacing ~20 small torch ops and a sort (host-bound at decode).
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

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the machine
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "available", "act_mul_quant", "unpermute_and_reduce", "build_contiguous_layout"]

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
    def _act_quant_kernel(x_ptr, q_ptr, s_ptr, R, I, stride_xr, stride_qr, s_col_stride,
                          alpha, beta, limit, amax_floor, ue8m0_floor,
                          ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, ACT_DTYPE: tl.constexpr,
                          USE_UE8M0: tl.constexpr, DIVIDE: tl.constexpr, AMAX_OVER_MAX: tl.constexpr,
                          EXACT: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        rmask = rows < R
        grp = tl.program_id(1)
        cols = grp * GROUP + tl.arange(0, GROUP)
        xp = x_ptr + rows[:, None] * stride_xr + cols[None, :]
        g = tl.load(xp, mask=rmask[:, None], other=0.0).to(tl.float32)
        u = tl.load(xp + I, mask=rmask[:, None], other=0.0).to(tl.float32)
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
        tl.store(q_ptr + rows[:, None] * stride_qr + cols[None, :], qf.to(tl.float8e4nv), mask=rmask[:, None])
        tl.store(s_ptr + grp.to(tl.int64) * s_col_stride + rows, s, mask=rmask)

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
        for k in tl.static_range(TOPK):
            r = tl.load(inv_ptr + t * TOPK + k)
            w = tl.load(w_ptr + t * TOPK + k).to(tl.float32)
            if r >= 0:
                v = tl.load(a_ptr + r.to(tl.int64) * stride_a + cols, mask=mask, other=0.0).to(tl.float32)
                acc = acc + _mul_rn(v, w, EXACT)
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
        key = tl.where(valid & (loc >= 0), loc, E)
        return key, oor

    @triton.jit
    def _layout_count_kernel(ids_ptr, map_ptr, counts_ptr, n, n_ids, E, HAS_MAP: tl.constexpr,
                             BLOCK: tl.constexpr):
        # program e < E counts the routes of local expert e; program E counts the out-of-range ids
        e = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            key, oor = _route_keys(ids_ptr, map_ptr, offs, n, n_ids, E, HAS_MAP)
            hit = tl.where(e < E, (key == e) & (offs < n), oor)
            acc += hit.to(tl.int64)
        tl.store(counts_ptr + e, tl.sum(acc, axis=0))

    @triton.jit
    def _layout_place_kernel(ids_ptr, map_ptr, starts_ptr, inv_ptr, mind_ptr, tok_ptr, n, n_ids, E, topk, M_sum,
                             HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):
        # program e writes the rows of expert e in increasing flat route index
        e = tl.program_id(0)
        base = tl.load(starts_ptr + e)
        running = tl.zeros([1], dtype=tl.int64)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            key, oor = _route_keys(ids_ptr, map_ptr, offs, n, n_ids, E, HAS_MAP)
            hit = (key == e) & (offs < n)
            c = tl.cumsum(hit.to(tl.int64), axis=0)
            rows = base + running + c - 1
            ok = hit & (rows < M_sum)
            tl.store(inv_ptr + offs, rows, mask=ok)
            tl.store(mind_ptr + rows, e.to(tl.int32), mask=ok)
            tl.store(tok_ptr + rows, offs // topk, mask=ok)
            running += tl.sum(hit.to(tl.int64), axis=0)


_TL_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def build_contiguous_layout(topk_ids: torch.Tensor, local_num_experts: int, M_sum: int, alignment: int,
                            expert_map: torch.Tensor | None = None):
    """Triton version of :func:`backends.deep_gemm.layout.build_contiguous_layout` (same arguments; the same
    layout). Returns ``(layout, counts_all)`` where ``counts_all`` is int64 ``(E_local + 1,)``: the routes per local
    expert, then the number of ids outside the id space (instead of a per-route mask). Two kernels of E_local + 1
    programs each (count, then place) and four small torch ops; no host synchronisation."""
    from backends.deep_gemm.layout import ContiguousLayout

    if topk_ids.dim() != 2 or topk_ids.is_floating_point():
        raise ValueError(f"topk_ids must be a 2-D integer tensor, got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    device = topk_ids.device
    M, topk = topk_ids.shape
    E = local_num_experts
    n = M * topk
    ids = topk_ids.contiguous()
    emap = expert_map.to(device=device).contiguous() if expert_map is not None else ids
    n_ids = expert_map.numel() if expert_map is not None else E
    counts_all = torch.empty(E + 1, dtype=torch.int64, device=device)
    BLOCK = 1024
    _layout_count_kernel[(E + 1,)](ids, emap, counts_all, n, n_ids, E, HAS_MAP=expert_map is not None,
                                   BLOCK=BLOCK, num_warps=4)
    counts = counts_all[:E]
    aligned = (counts + alignment - 1) // alignment * alignment
    starts = torch.cumsum(aligned, 0) - aligned
    inv = torch.full((n,), -1, dtype=torch.int64, device=device)
    m_indices = torch.full((M_sum,), -1, dtype=torch.int32, device=device)
    row_token = torch.zeros(M_sum, dtype=torch.int64, device=device)
    if n:
        _layout_place_kernel[(E,)](ids, emap, starts, inv, m_indices, row_token, n, n_ids, E, max(topk, 1), M_sum,
                                   HAS_MAP=expert_map is not None, BLOCK=BLOCK, num_warps=4)
    layout = ContiguousLayout(row_token=row_token, m_indices=m_indices, inv_perm=inv.reshape(M, topk),
                              counts=counts, M_sum=M_sum, alignment=alignment)
    return layout, counts_all


def act_mul_quant(x: torch.Tensor, activation: MoEActivation, *, alpha, beta, limit, group_size: int,
                  use_ue8m0: bool, recipe, out_q: torch.Tensor | None = None):
    """Triton version of :func:`backends.deep_gemm.act_quant.act_mul_quant` (same arguments and results).

    Raises NotImplementedError when a configuration is outside the kernel (fp32 activations with the
    ``exp2_ceil_log2`` rule, other recipes, group sizes other than a power of two): the caller falls back to torch.
    """
    from backends.deep_gemm.act_quant import _recipe_fields
    from backends.deep_gemm.layout import mn_major_tma_aligned_empty

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
    s = mn_major_tma_aligned_empty(R, I // group_size, x.device)
    if R == 0:
        return q, s
    if activation is MoEActivation.SWIGLUSTEP:
        lim, has_lim = (7.0 if limit is None else float(limit)), True
    else:
        lim, has_lim = (0.0 if limit is None else float(limit)), limit is not None
    act_dtype = tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16
    ROWS = 16
    _act_quant_kernel[(triton.cdiv(R, ROWS), I // group_size)](
        x, q, s, R, I, x.stride(0), q.stride(0), s.stride(1),
        1.0 if alpha is None else float(alpha), 0.0 if beta is None else float(beta), lim,
        float(r.amax_floor), float(r.ue8m0_scale_floor),
        ACT=_ACT_CODE[activation], HAS_LIMIT=has_lim, ACT_DTYPE=act_dtype, USE_UE8M0=use_ue8m0,
        DIVIDE=r.quant_op == "divide", AMAX_OVER_MAX=r.scale_computation == "amax/max", EXACT=not _INTERPRET,
        GROUP=group_size, ROWS=ROWS, num_warps=4)
    return q, s


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
                                                         num_warps=4)
    return output
