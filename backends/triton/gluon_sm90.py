"""Block-FP8 grouped expert GEMM for sm_90, written in Gluon: the weight-scale promotion overlapped with the MMAs.

Why a second kernel: with 128x128 block scales the dot of every K tile must be scaled before it is summed
(``acc += dot(a, b) * a_s[:, None] * b_s``). Triton's ``tl.dot`` pipeliner makes a wgmma asynchronous only when its
result is the next wgmma's accumulator; here the result is scaled first, so every K tile ends in
``wgmma.wait_group 0`` and the tensor cores idle while the warpgroup scales and issues the next tile (checked in the
sm_90 PTX with ``tools/triton/sm90.py``, also when the scaling is moved one iteration later by hand). Gluon
exposes the wgmma groups: K tile ``k``'s MMA is issued into its own registers, then K tile ``k - 1``'s result is
waited for (``warpgroup_mma_wait(1)``: one group may stay in flight) and promoted into the fp32 accumulator while
tile ``k`` runs on the tensor cores: the per-block promotion of DeepGEMM's SM90 FP8 GEMMs, overlapped here by two
register sets within one warpgroup rather than by warp specialization.

Numerics are those of ``fused_moe_kernel``'s block-FP8 path (``A_SCALE = B_SCALE = 3``, ``B_SCALAR``): per K tile of
128, the fp32 wgmma result times ``a_s[row, kb] * w_s[e, nb, kb]`` added to an fp32 accumulator, in K order; one
rounding to the output dtype (bitwise equal to it on the H200 for every variant the tuner tried, docs/notes/
triton.md). What it covers (the rest stays with ``fused_moe_kernel``, see :func:`supported`): contiguous A rows
(GEMM2, or GEMM1 after ``PERMUTE_A``); a plain epilogue, or SiLU-and-mul of gate / up halves (no bias, no clamp, the
FP8 requantization left to ``act_quant_kernel``); 128x128 weight blocks with ``BLOCK_K = 128``; one tile height
(no ``HALF_TAIL``); TMA-able operands; an sm_90 GPU. A grid smaller than the tile count makes it persistent.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .host import Fusion, GemmEpilogue, GemmOperands, GemmScales, GemmShape, ScaleMode
from .jit import ACT_SILU, FP_FUSION  # (ACT_SILU: the one activation the GATED epilogue implements)

#: TMA tile load: ``tma.async_load`` from Triton 3.7 on (3.9 removed the old name), ``async_copy_global_to_shared``
#: in the image's 3.6; the same operation
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
#: cp.async tile copy (``GATHER_A``'s row gather): renamed the same way, ``async_copy.async_load`` in 3.9 (whose old
#: name raises), ``async_copy_global_to_shared`` in 3.6
cp_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

__all__ = ["fp8_block_moe_gemm_kernel", "supported", "launch"]

GROUP = 128  # the weight block (GROUP_N = GROUP_K) and the K tile this kernel is written for


@gluon.jit
def fp8_block_moe_gemm_kernel(
    a_desc, b_desc, c_ptr, a_scale_ptr, b_scale_ptr,
    sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
    N, K, num_valid_tokens, NW, UP_OFF,
    stride_cm, stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    C_SORTED: gl.constexpr, GATED: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    """``C[rows, n] = sum_kb (A[rows, kb] @ W[e, n, kb]^T) * a_s[rows, kb] * w_s[e, n // 128, kb]`` over the route
    layout's ``BLOCK_M`` blocks (one expert each), rounded once to C's dtype.

    ``a_desc``: TMA descriptor of A ``(EM, K)`` fp8 in sorted-row order, boxes ``[BLOCK_M, BLOCK_K]``;
    ``b_desc``: of W viewed ``(E * NW, K)`` fp8, boxes ``[BLOCK_N, BLOCK_K]``; ``a_scale`` ``(EM, K / 128)`` fp32;
    ``b_scale`` ``(E, NW / 128, K / 128)`` fp32. ``C_SORTED``: C row = sorted position (GEMM1), else the route id
    from ``sorted_token_ids`` (GEMM2; padding rows are not stored). Tiles (block, N tile) are ordered as
    ``fused_moe_kernel``'s programs (``GROUP_M`` blocks share the N sweep, for L2 reuse of the weight tiles); blocks
    past ``num_tokens_post_padded`` and of non-local experts (id -1) are skipped. Program ``p`` of ``P`` computes
    tiles ``p, p + P, ...``: with one program per tile that is one tile; with fewer (persistent), the next tile's
    first ``STAGES`` K tiles are loaded while this tile's epilogue runs.
    ``GATED`` (GEMM1 with SiLU-and-mul, ``fused_moe_kernel``'s ``FUSE`` 1): an N tile's gate rows ``n`` and up rows
    ``UP_OFF + n`` are loaded as one ``[2 * BLOCK_N, BLOCK_K]`` weight tile (two TMA boxes, one MMA chain of
    ``2 * BLOCK_N`` columns); the epilogue rounds gate and up to C's dtype (the GEMM1 rounding point), computes
    ``silu(g) * u`` in fp32 as ``fused_moe_kernel`` does and rounds it: C has ``N`` = I columns.
    """
    ntpp = gl.load(num_tokens_post_padded_ptr)
    num_pid_m = gl.cdiv(ntpp, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    nprog = gl.num_programs(0)
    nk = gl.cdiv(K, BLOCK_K)
    BN_MMA: gl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N  # columns of the MMA chain (gate | up when GATED)

    # one warpgroup per 64 rows; the wgmma instruction spans the tile's N
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                          instr_shape=[16, BN_MMA, 32])
    out_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 * 8 // BLOCK_N,
                                                BLOCK_N // 8], warps_per_cta=[num_warps, 1], order=[1, 0])
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN_MMA, BLOCK_K], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    # GATED: which MMA columns are gate columns (scaled by the gate rows' block scale), the rest are up columns
    is_gate = gl.arange(0, BN_MMA, layout=gl.SliceLayout(0, acc_layout)) < BLOCK_N

    # The K tiles of a program's tiles go through the STAGES-deep TMA ring in one sequence: K tile j of the program's
    # t-th tile is the ring's (t * nk + j)-th load (stage and mbarrier phase from that index, `base` = t * nk).
    tile = _next_tile(gl.program_id(0), num_tiles, nprog, expert_ids_ptr, num_pid_m, num_pid_n, GROUP_M)
    if tile < num_tiles:
        row0, n0, e = _tile_coords(tile, expert_ids_ptr, num_pid_m, num_pid_n, BLOCK_M, BLOCK_N, GROUP_M)
        for i in gl.static_range(STAGES):
            _load_k_tile(i, 0, i < nk, a_desc, b_desc, a_smem, b_smem, ready, row0, e * NW + n0, UP_OFF, STAGES,
                         BLOCK_N, BLOCK_K, GATED)
    base = 0
    while tile < num_tiles:
        row0, n0, e = _tile_coords(tile, expert_ids_ptr, num_pid_m, num_pid_n, BLOCK_M, BLOCK_N, GROUP_M)
        acc = _tile_mainloop(base, nk, a_desc, b_desc, a_smem, b_smem, ready, row0, e * NW + n0, UP_OFF,
                             a_scale_ptr + (row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
                                            ).to(gl.int64) * stride_asm,
                             b_scale_ptr + e.to(gl.int64) * stride_bse + (n0 // 128) * stride_bsn,
                             b_scale_ptr + e.to(gl.int64) * stride_bse + ((UP_OFF + n0) // 128) * stride_bsn,
                             stride_ask, stride_bsk, is_gate, acc_layout, BLOCK_M, BN_MMA, STAGES, BLOCK_N, BLOCK_K,
                             GATED, num_warps)
        # every stage is free (all MMAs of the tile waited for): start the next tile's loads, then the epilogue
        nxt = _next_tile(tile + nprog, num_tiles, nprog, expert_ids_ptr, num_pid_m, num_pid_n, GROUP_M)
        if num_warps > 4:
            gl.thread_barrier()
        if nxt < num_tiles:
            nrow0, nn0, ne = _tile_coords(nxt, expert_ids_ptr, num_pid_m, num_pid_n, BLOCK_M, BLOCK_N, GROUP_M)
            for i in gl.static_range(STAGES):
                _load_k_tile(i, base + nk, i < nk, a_desc, b_desc, a_smem, b_smem, ready, nrow0, ne * NW + nn0,
                             UP_OFF, STAGES, BLOCK_N, BLOCK_K, GATED)
        _epilogue(acc, c_ptr, sorted_token_ids_ptr, row0, n0, N, num_valid_tokens, stride_cm, out_layout, BLOCK_M,
                  BLOCK_N, BN_MMA, C_SORTED, GATED)
        base += nk
        tile = nxt
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


@gluon.jit
def _tile_pids(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """``(pid_m, pid_n)`` of a tile: ``fused_moe_kernel``'s program order (``GROUP_M`` blocks share the N sweep)."""
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (tile // num_pid_in_group) * GROUP_M
    group_size_m = gl.minimum(num_pid_m - first_pid_m, GROUP_M)
    return first_pid_m + ((tile % num_pid_in_group) % group_size_m), (tile % num_pid_in_group) // group_size_m


@gluon.jit
def _tile_coords(tile, expert_ids_ptr, num_pid_m, num_pid_n, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 GROUP_M: gl.constexpr):
    """``(row0, n0, expert)`` of a tile."""
    pid_m, pid_n = _tile_pids(tile, num_pid_m, num_pid_n, GROUP_M)
    return pid_m * BLOCK_M, pid_n * BLOCK_N, gl.load(expert_ids_ptr + pid_m)


@gluon.jit
def _next_tile(tile, num_tiles, nprog, expert_ids_ptr, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """The first of ``tile, tile + nprog, ...`` whose block belongs to a local expert, or ``>= num_tiles``."""
    searching = tile < num_tiles
    while searching:
        pid_m, _ = _tile_pids(tile, num_pid_m, num_pid_n, GROUP_M)
        skip = gl.load(expert_ids_ptr + pid_m) < 0
        tile += nprog * skip.to(gl.int32)
        searching = skip & (tile < num_tiles)
    return tile


@gluon.jit
def _tile_mainloop(base, nk, a_desc, b_desc, a_smem, b_smem, ready, row0, b_row0, UP_OFF, a_s_ptrs, b_s_ptr,
                   bu_s_ptr, stride_ask, stride_bsk, is_gate, acc_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                   BN_MMA: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                   GATED: gl.constexpr, num_warps: gl.constexpr):
    """The fp32 accumulator of one tile; its first ``STAGES`` K tiles are already loading (ring index ``base``).

    Two register sets take turns (unrolled by two so that neither changes role: a loop-carried swap would make the
    compiler copy registers between the wgmmas of a tile, and ptxas then serializes every wgmma): x holds the K
    tile in flight, y is free to be issued into."""
    acc = gl.zeros([BLOCK_M, BN_MMA], gl.float32, acc_layout)
    mbarrier.wait(ready.index(base % STAGES), (base // STAGES) & 1)
    x = warpgroup_mma(a_smem.index(base % STAGES), b_smem.index(base % STAGES).permute((1, 0)), acc, use_acc=False,
                      is_async=True)
    s_x = _k_tile_scales(0, a_s_ptrs, b_s_ptr, bu_s_ptr, stride_ask, stride_bsk, is_gate, GATED)
    y = gl.zeros([BLOCK_M, BN_MMA], gl.float32, acc_layout)
    for k in range(1, nk - 1, 2):
        y, x, acc, s_y = _promote_step(k, base, nk, x, y, acc, s_x, a_desc, b_desc, a_smem, b_smem, ready, row0,
                                       b_row0, UP_OFF, a_s_ptrs, b_s_ptr, bu_s_ptr, stride_ask, stride_bsk, is_gate,
                                       STAGES, BLOCK_N, BLOCK_K, GATED, num_warps)
        x, y, acc, s_x = _promote_step(k + 1, base, nk, y, x, acc, s_y, a_desc, b_desc, a_smem, b_smem, ready, row0,
                                       b_row0, UP_OFF, a_s_ptrs, b_s_ptr, bu_s_ptr, stride_ask, stride_bsk, is_gate,
                                       STAGES, BLOCK_N, BLOCK_K, GATED, num_warps)
    if nk % 2 == 0:  # one K tile left: issue it into y, promote x, then y
        last, _, acc, s_last = _promote_step(nk - 1, base, nk, x, y, acc, s_x, a_desc, b_desc, a_smem, b_smem, ready,
                                             row0, b_row0, UP_OFF, a_s_ptrs, b_s_ptr, bu_s_ptr, stride_ask,
                                             stride_bsk, is_gate, STAGES, BLOCK_N, BLOCK_K, GATED, num_warps)
        done = warpgroup_mma_wait(num_outstanding=0, deps=(last, ))
        acc += done * s_last
    else:
        done = warpgroup_mma_wait(num_outstanding=0, deps=(x, ))
        acc += done * s_x
    return acc


@gluon.jit
def _epilogue(acc, c_ptr, sorted_token_ids_ptr, row0, n0, N, num_valid_tokens, stride_cm, out_layout: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BN_MMA: gl.constexpr, C_SORTED: gl.constexpr,
              GATED: gl.constexpr):
    """One rounding (GATED: h, then the activation and its rounding) and 16-byte row-contiguous stores."""
    h = acc.to(c_ptr.dtype.element_ty)
    if GATED:  # split gate | up through shared memory, as two [BLOCK_M, BLOCK_N] halves in the store layout
        h_smem = gl.allocate_shared_memory(h.dtype, [BLOCK_M, BN_MMA],
                                           gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0]))
        h_smem.store(h)
        g = h_smem.slice(0, BLOCK_N, dim=1).load(out_layout).to(gl.float32)
        u = h_smem.slice(BLOCK_N, BLOCK_N, dim=1).load(out_layout).to(gl.float32)
        out = (g * (1.0 / (1.0 + gl.exp(-g))) * u).to(c_ptr.dtype.element_ty)  # jit.apply_act, SILU
    else:
        out = gl.convert_layout(h, out_layout)
    _store_rows(out, c_ptr, sorted_token_ids_ptr, row0, n0, N, num_valid_tokens, stride_cm, BLOCK_M, BLOCK_N, C_SORTED)


@gluon.jit
def _store_rows(out, c_ptr, sorted_token_ids_ptr, row0, n0, N, num_valid_tokens, stride_cm, ROWS: gl.constexpr,
                BLOCK_N: gl.constexpr, C_SORTED: gl.constexpr):
    """Store a ``[ROWS, BLOCK_N]`` output tile (in its blocked store layout) at sorted rows ``row0..`` (``C_SORTED``)
    or at their route ids (padding rows, ids ``>= num_valid_tokens``, not stored); columns past ``N`` masked."""
    offs_cm = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, out.type.layout))
    offs_cn = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, out.type.layout))
    if C_SORTED:
        c_rows = offs_cm
        row_mask = offs_cm >= 0
    else:
        c_rows = gl.load(sorted_token_ids_ptr + offs_cm)
        row_mask = c_rows < num_valid_tokens
    c_ptrs = c_ptr + c_rows.to(gl.int64)[:, None] * stride_cm + offs_cn[None, :]
    gl.store(c_ptrs, out, mask=row_mask[:, None] & (offs_cn < N)[None, :])


@gluon.jit
def _load_k_tile(k, base, ok, a_desc, b_desc, a_smem, b_smem, ready, row0, b_row0, UP_OFF, STAGES: gl.constexpr,
                 BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GATED: gl.constexpr):
    """TMA loads of a tile's K tile ``k`` (A rows, weight rows; GATED: gate rows, then up rows) into stage
    ``(base + k) % STAGES`` of the ring."""
    st = (base + k) % STAGES
    if GATED:
        mbarrier.expect(ready.index(st), a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes, pred=ok)
    else:
        mbarrier.expect(ready.index(st), a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=ok)
    tma_load(a_desc, [row0, k * BLOCK_K], ready.index(st), a_smem.index(st), pred=ok)
    if GATED:
        b_st = b_smem.index(st)
        tma_load(b_desc, [b_row0, k * BLOCK_K], ready.index(st), b_st.slice(0, BLOCK_N), pred=ok)
        tma_load(b_desc, [b_row0 + UP_OFF, k * BLOCK_K], ready.index(st), b_st.slice(BLOCK_N, BLOCK_N), pred=ok)
    else:
        tma_load(b_desc, [b_row0, k * BLOCK_K], ready.index(st), b_smem.index(st), pred=ok)


@gluon.jit
def _k_tile_scales(k, a_s_ptrs, b_s_ptr, bu_s_ptr, stride_ask, stride_bsk, is_gate, GATED: gl.constexpr):
    """K tile ``k``'s dequantization factors ``a_s[row, k] * w_s[block, k]`` as a ``[BLOCK_M, BN_MMA]`` tensor
    (``fused_moe_kernel``'s B_SCALAR order: the two scales multiplied first; GATED: the gate block's scale on the
    gate columns, the up block's on the up columns)."""
    a_s = gl.load(a_s_ptrs + k * stride_ask)
    s = a_s * gl.load(b_s_ptr + k * stride_bsk)
    if GATED:
        su = a_s * gl.load(bu_s_ptr + k * stride_bsk)
        return gl.where(is_gate[None, :], s[:, None], su[:, None])
    else:
        return s[:, None]


@gluon.jit
def _promote_step(k, base, nk, busy, free, acc, s_busy, a_desc, b_desc, a_smem, b_smem, ready, row0, b_row0, UP_OFF,
                  a_s_ptrs, b_s_ptr, bu_s_ptr, stride_ask, stride_bsk, is_gate, STAGES: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GATED: gl.constexpr, num_warps: gl.constexpr):
    """Issue K tile ``k``'s MMA into ``free`` (use_acc=False), wait for K tile ``k - 1``'s (``busy``), refill its
    stage with K tile ``k - 1 + STAGES``, and promote it: ``acc += busy * s_busy``. Returns ``(k's MMA in flight,
    the promoted register set (now free), acc, k's scales)``."""
    st = (base + k) % STAGES
    mbarrier.wait(ready.index(st), ((base + k) // STAGES) & 1)
    issued = warpgroup_mma(a_smem.index(st), b_smem.index(st).permute((1, 0)), free, use_acc=False, is_async=True)
    done = warpgroup_mma_wait(num_outstanding=1, deps=(busy, ))
    if num_warps > 4:  # every warpgroup's MMA k - 1 must be done before its stage is overwritten
        gl.thread_barrier()
    _load_k_tile(k - 1 + STAGES, base, k - 1 + STAGES < nk, a_desc, b_desc, a_smem, b_smem, ready, row0, b_row0, UP_OFF,
                 STAGES, BLOCK_N, BLOCK_K, GATED)
    s_k = _k_tile_scales(k, a_s_ptrs, b_s_ptr, bu_s_ptr, stride_ask, stride_bsk, is_gate, GATED)
    acc += done * s_busy
    # pin the promotion here: LLVM would otherwise sink it past the next step's MMA, which is issued into `done`'s
    # registers (a copy, and ptxas then serializes the wgmmas); a wait for <= 1 group is a no-op at this point
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
    return issued, done, acc, s_k


def supported(ops: GemmOperands, shape: GemmShape, scales: GemmScales, epi: GemmEpilogue, cfg: dict) -> str | None:
    """``None`` when :func:`launch` computes this GEMM (arguments as ``experts.launch_gemm``'s), else why not (a
    table entry's ``GLUON`` key then falls back to ``fused_moe_kernel``). Looks at the tensors' dtypes, shapes,
    strides and devices only (meta tensors will do)."""
    a, w, c = ops.a, ops.w, ops.c
    K, n_out, fuse = w.shape[2], shape.n_out, epi.fuse
    group_n, group_k = scales.group_n, scales.group_k
    BM, BN, BK = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]
    gated = fuse == Fusion.GATED
    checks = [
        (scales.a_mode == ScaleMode.GROUP and scales.b_mode == ScaleMode.GROUP,
         "block-FP8 scales (1x128 activations, 128x128 weights) only"),
        (not shape.a_gather, "A rows must be contiguous (GEMM2, or GEMM1 with PERMUTE_A)"),
        (fuse == Fusion.NONE or (gated and epi.act == ACT_SILU and not epi.has_limit),
         "plain epilogue, or gate / up halves with SiLU (no clamp) only"),
        (ops.bias is None and not epi.out_quant, "no bias, no fused requantization (FUSE_QUANT 0)"),
        (not shape.half_tail, "one tile height only (no HALF_TAIL)"),
        (group_n == GROUP and group_k == GROUP and BK == GROUP, "128x128 weight blocks and BLOCK_K = 128 only"),
        (K % GROUP == 0 and n_out % BN == 0 and BM in (64, 128),
         "K % 128 == 0, N % BLOCK_N == 0, BLOCK_M in (64, 128)"),
        (BN in ((32, 64) if gated else (64, 128)), "BLOCK_N in (64, 128), or in (32, 64) with gate / up halves"),
        (not gated or n_out % GROUP == 0, "gate / up halves need I % 128 == 0 (one weight block per half tile)"),
        (cfg.get("num_warps", 4) * 16 == BM, "num_warps must be BLOCK_M / 16 (one warpgroup per 64 rows)"),
        (a.is_contiguous() and w.is_contiguous() and c.stride(1) == 1 and a.data_ptr() % 16 == 0
         and w.data_ptr() % 16 == 0, "TMA needs contiguous, 16-byte aligned A and W"),
        (a.device.type != "cuda" or torch.cuda.get_device_capability(a.device)[0] == 9, "sm_90 (Hopper) GPUs only"),
    ]
    return next((why for ok, why in checks if not ok), None)


def launch(ops: GemmOperands, shape: GemmShape, scales: GemmScales, epi: GemmEpilogue, cfg: dict,
           w_strides=None):
    """Launch :func:`fp8_block_moe_gemm_kernel` for one GEMM (arguments as ``experts.launch_gemm``'s, ``ops.w_scale``
    as ``experts._scale_strides`` returns it; ``w_strides`` unused: its strides are read here; call
    :func:`supported` first)."""
    a, w, c, a_scale, w_scale = ops.a, ops.w, ops.c, ops.a_scale, ops.w_scale
    layout, n_out, gated = shape.layout, shape.n_out, epi.fuse == Fusion.GATED
    E, NW, K = w.shape
    BM, BN, BK = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]
    a8 = a.view(torch.float8_e4m3fn) if a.dtype != torch.float8_e4m3fn else a
    a_desc = TensorDescriptor.from_tensor(a8, [BM, BK], gl.NVMMASharedLayout.get_default_for([BM, BK], gl.float8e4nv))
    b_desc = TensorDescriptor.from_tensor(w.view(E * NW, K), [BN, BK],
                                          gl.NVMMASharedLayout.get_default_for([BN, BK], gl.float8e4nv))
    tiles = triton.cdiv(shape.rows, BM) * triton.cdiv(n_out, BN)  # an upper bound: the kernel reads the layout's count
    if cfg.get("PERSISTENT", 0):  # one program per resident CTA (one per SM at 8 warps, two at 4: registers)
        tiles = min(tiles, _num_sms(a.device) * (2 if cfg.get("num_warps", 4) == 4 else 1))
    fp8_block_moe_gemm_kernel[(tiles,)](
        a_desc, b_desc, c, a_scale, w_scale,
        layout.sorted_token_ids, layout.expert_ids, layout.num_tokens_post_padded,
        n_out, K, shape.num_valid, NW, n_out if gated else 0,
        c.stride(0), a_scale.stride(0), a_scale.stride(1), w_scale.stride(0), w_scale.stride(1), w_scale.stride(2),
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=cfg.get("GROUP_SIZE_M", 1), C_SORTED=shape.c_sorted,
        GATED=gated, STAGES=cfg.get("num_stages", 4), num_warps=cfg.get("num_warps", 4),
        num_stages=cfg.get("num_stages", 4),  # not used by Gluon; recorded in the kernel's metadata (sm90.py)
        **FP_FUSION,
    )


def _num_sms(device) -> int:
    if device.type != "cuda":  # compile-only runs (sm90.py): the H100 / H200's 132
        return triton.runtime.driver.active.utils.get_device_properties(0)["multiprocessor_count"]
    return torch.cuda.get_device_properties(device).multi_processor_count
