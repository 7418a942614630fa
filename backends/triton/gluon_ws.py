"""Warp-specialized, persistent grouped expert GEMM for sm_90 in Gluon: one TMA producer warp (``GATHER_A``: a
warpgroup that also gathers GEMM1's rows by route) feeds two MMA consumer warpgroups, in CUTLASS's two schedules.

Why: ``fused_moe_kernel`` (and the block-FP8 Gluon kernel of ``gluon_sm90``) run the loads, the MMAs and the epilogue
of a tile in the same warps, so the first loads of a tile and its epilogue (rounding, activation, row-scattered
stores) are exposed; with a short K (GEMM2 of Qwen3: K = I = 768; of DeepSeek-V3 TP8: K = 256, two K tiles) they are
a large part of a tile's life (docs/notes/triton.md). Here each CTA stays resident (one per SM) and splits into
three partitions (``gl.warp_specialize``):

* the producer (one warp) walks the program's tiles and streams their A / W K tiles into a ``STAGES``-deep TMA ring
  (``ready[s]``: loaded; ``empty[s]``: released by the consumers), running ahead across tile boundaries, so a tile's
  first loads overlap the previous tile's epilogue;
* ping-pong (``COOP`` 0): consumer 0 (the default partition, one warpgroup) computes the program's even tiles,
  consumer 1 (a worker warpgroup) its odd tiles, each a whole ``BLOCK_M x BLOCK_N`` tile. A consumer's mainloop
  starts once the other has taken every K tile of the previous tile from the ring (``order[c]``: CUTLASS's ping-pong
  order barrier), so the mainloops alternate on the tensor cores and each epilogue overlaps the other's MMAs. The
  order is also what keeps the ring's phase parity unambiguous: no consumer waits on a stage two fills ahead of the
  last one it saw;
* cooperative (``COOP`` 1): both consumers compute every tile, consumer ``c`` its rows ``[c BLOCK_M / 2, (c + 1)
  BLOCK_M / 2)`` (a stage is released when both are done with it): twice the tile area of one warpgroup's registers
  (128 x 256), so half the operand traffic per FLOP of a 128 x 128 tile, with the epilogue exposed;
* ``N_HALVES`` (FP8 with promotion, either schedule): a consumer computes its MMA columns as two halves (GEMM1: gate,
  then up) through one MMA register set, waiting for each half's MMAs and promoting them before the next (DeepGEMM's
  serialized promotion, the other consumer's MMAs filling the gap): the two-set promotion below limits a consumer to
  64 x 128 columns (three register sets), the halves reach 64 x 256 in the same 192 registers (see
  :func:`_tile_halves`).

Numerics are ``fused_moe_kernel``'s: unquantized, the fp32 accumulator of wgmmas over K tiles in K order, rounded
once to C's dtype; block FP8 (``SCALED``: 1x128 activation and 128x128 weight scales, ``BLOCK_K = 128``), each K
tile's wgmma result times ``a_s[row, kb] * w_s[e, nb, kb]`` added to the fp32 accumulator in K order, the promotion of
K tile ``k - 1`` overlapping K tile ``k``'s wgmma (two register sets, as ``gluon_sm90``). ``GATED`` (GEMM1 with
SiLU-and-mul: the gate rows ``n`` and up rows ``UP_OFF + n`` of an N tile as one ``[2 * BLOCK_N, BLOCK_K]`` weight
tile) then rounds gate and up to C's dtype, computes ``silu(g) * u`` in fp32 and rounds again, as ``fused_moe_kernel``'s
``FUSE`` 1 / 4 epilogue. What it covers (see :func:`supported`): bf16 / fp16 or block-FP8 operands; contiguous A rows
(GEMM2, or GEMM1 after ``PERMUTE_A``); a plain or SiLU-gated epilogue without clamp or fused requantization, or
(unscaled operands) gpt-oss's interleaved SWIGLUOAI with its clamp, and expert biases;
``HALF_TAIL`` tile lists (128-row tiles, 64-row tails: ping-pong runs them as 64-row MMAs; cooperative on consumer 0
alone); an sm_90 GPU. The layout's bookkeeping (``sorted_token_ids``,
``expert_ids``, ``num_tokens_post_padded``, the tile list) is ``reference.align``'s / ``align.align_routes``'.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import configs as _configs
from .host import OUT_AMAX_SLOTS, Fusion, GemmEpilogue, GemmOperands, GemmScales, GemmShape, ScaleMode
from .jit import ACT_SILU, ACT_SWIGLUOAI, BF16X2_ROUND_ASM, FP_FUSION
from .gluon_sm90 import GROUP, _k_tile_scales, _store_rows, _tile_pids, cp_async_load, tma_load

GROUP_C = gl.constexpr(GROUP)  # the 128x128 weight block, inside kernels
SWIGLUOAI_C = gl.constexpr(ACT_SWIGLUOAI)

__all__ = ["ws_moe_gemm_kernel", "supported", "launch"]

CONSUMER_WARPS = gl.constexpr(4)  # one warpgroup per consumer
PRODUCER_REGS = gl.constexpr(24)  # the producer only issues TMA: the fewest registers setmaxnreg allows
# GATHER_A: the producer is a warpgroup that gathers A's rows by route (cp.async, 16 bytes a thread and copy) and
# issues W's TMA; its registers come out of the consumers' (the default consumer is given what the workers leave:
# 128 x (256 + 232 + 24) = 128 x (232 + 232 + 48) = 64K)
GATHER_WARPS = gl.constexpr(4)
GATHER_REGS = gl.constexpr(48)
CONSUMER_REGS = gl.constexpr(232)  # the worker consumer's share of the SM's 64K registers (the default gets 256)
# launch-time registers per thread: 12 warps (two consumer warpgroups, the producer's warp rounded up to a warpgroup)
# must fit the SM's 64K; the partitions then move them to the consumers (setmaxnreg)
LAUNCH_MAXNREG = 168


@gluon.jit
def ws_moe_gemm_kernel(
    a_desc, a_desc_h, b_desc, c_ptr, a_scale_ptr, b_scale_ptr,
    sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr, tiles_ptr, num_tiles_ptr,
    N, K, num_valid_tokens, NW, UP_OFF,
    stride_cm, stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    HALF_TAIL: gl.constexpr, C_SORTED: gl.constexpr, GATED: gl.constexpr, SCALED: gl.constexpr,
    COOP: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr, A_EPI: gl.constexpr = 0,
    B_EPI: gl.constexpr = 0, amax_ptr=None, AMAX: gl.constexpr = False, N_HALVES: gl.constexpr = False,
    a_ptr=None, stride_am=0, TOP_K: gl.constexpr = 1, GATHER_A: gl.constexpr = False,
    bias_ptr=None, stride_biase=0, bias_step=0, bias_up=0, HAS_BIAS: gl.constexpr = False,
    ACT: gl.constexpr = ACT_SILU, alpha=1.0, limit=0.0, UP_KOFF=0,
):
    """``C[rows, n] = epilogue(sum_k A[rows, k] W[e, n, k] (x scales))`` over the route layout's tiles (one expert
    each).

    ``a_desc``: TMA descriptor of A ``(EM, K)`` in sorted-row order, boxes ``[BLOCK_M, BLOCK_K]`` (``a_desc_h``:
    ``[BLOCK_M / 2, BLOCK_K]`` boxes, for ``HALF_TAIL``); ``b_desc``: of W viewed ``(E * NW, K)``, boxes
    ``[BLOCK_N, BLOCK_K]``. ``SCALED``: ``a_scale (EM, K / 128)`` and ``b_scale (E, NW / 128, K / 128)`` fp32 (else
    unused). ``A_EPI`` / ``B_EPI`` (FP8 per-tensor / per-channel operands, not ``SCALED``): 1 = one scale (``a_scale[0]``;
    ``b_scale[e * stride_bse]``), 2 = per row of A in sorted order (``a_scale[row * stride_asm]``) / per weight row
    (``b_scale[e * stride_bse + n * stride_bsn]``); each K tile's wgmma promoted into the fp32 accumulator, the scales
    applied once in the epilogue; 0 = none. Row tiles: the layout's ``BLOCK_M`` blocks, or with ``HALF_TAIL`` the tile list (``tiles[t] =
    first_block * 2 + full`` over ``BLOCK_M / 2``-row blocks, ``num_tiles`` entries: full tiles of ``BLOCK_M`` rows, an
    expert's odd last block as a ``BLOCK_M / 2``-row tile). ``C_SORTED``: C row = sorted position (GEMM1), else the
    route id from ``sorted_token_ids`` (GEMM2; padding rows are not stored). ``GATED``: gate rows ``n`` and up rows
    ``UP_OFF + n`` of an N tile as one MMA of ``2 * BLOCK_N`` columns, SiLU-and-mul in the epilogue (C has ``N`` = I
    columns). Tiles (row tile, N tile) are in ``fused_moe_kernel``'s program order (``GROUP_M`` row tiles share the N
    sweep); program ``p`` of ``P`` takes tiles ``p, p + P, ...`` (row tiles of non-local experts and past the layout's
    end skipped); ``COOP`` picks the schedule (module docstring). ``AMAX`` (GEMM1 before a dynamic per-tensor
    requantization, ``host.OUT_AMAX_SLOTS``): each consumer folds the largest |value| it stores (after the
    epilogue's rounding; NaN / inf as inf) over all its tiles and writes it once, at its end, to slot ``2 p + c`` of
    ``amax_ptr`` (``[amax...][flags...]`` over the ``2 P`` slots: the largest finite |value|, or 0 and the flag 1.0
    when one was NaN / inf; every slot written, no zeros before the launch); ``act_quant_kernel``'s ``SLOTS`` pass
    reduces them. ``N_HALVES`` (FP8 with promotion; see :func:`_tile_halves`): 0, or the K tiles per promotion of
    the halves schedule, whose consumers compute their MMA columns as two halves through one register set.
    ``GATHER_A`` (GEMM1 without ``PERMUTE_A``): A is ``a_ptr`` ``(M, K)`` (row stride ``stride_am``), the hidden
    states in token order, and the producer warpgroup gathers a tile's rows by route (sorted row ``r`` holds route
    ``sorted_token_ids[r]``, token ``route // TOP_K``; padding rows zero-filled) with asynchronous copies into the
    same swizzled stages TMA fills (``a_desc`` then only names their layout); per-token / block scales ``a_scale``
    are then in token order too, read by each row's token. ``UP_KOFF``: the up rows' K offset in W's view (0; the
    interleaved SWIGLUOAI rows ``2n`` / ``2n + 1`` are viewed ``(E * I, 2 K)``, gate row ``n`` in columns ``[0, K)``
    and its up row in ``[K, 2 K)``, ``UP_OFF`` 0). ``ACT`` (``GATED``): ``jit.ACT_SILU``, or ``jit.ACT_SWIGLUOAI``
    (gate clamped to ``<= limit``, up to ``[-limit, limit]``, ``(u + 1) g sigmoid(alpha g)``: ``jit.apply_act``'s
    formula, operation for operation). ``HAS_BIAS`` (unscaled GEMMs): ``bias[e, .]`` added to the fp32 accumulator
    before the rounding, MMA column ``c`` of N tile ``n0`` reading ``bias_ptr + e stride_biase + (n0 + c) bias_step``
    (``GATED``: the up columns ``c - BLOCK_N`` plus ``bias_up``; both offsets in elements, strides folded in).
    Padding rows count too: GEMM1 runs here only on zero padding rows (``PERMUTE_A``'s copy, or the gather's zero
    fill), so without bias they store act(0, 0) = 0 (with bias, act(bias); GEMM2 stores no padding row)."""
    BN_MMA: gl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN_MMA, BLOCK_K], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        # GATHER_A: W's expected bytes (one arrival) and each producer thread's copies (an arrival each, once they
        # have landed: cp.async.mbarrier.arrive.noinc)
        mbarrier.init(ready.index(i), count=1 + GATHER_WARPS * 32 if GATHER_A else 1)
        mbarrier.init(empty.index(i), count=2 if COOP else 1)  # cooperative: both consumers release each stage
    for i in gl.static_range(2):
        mbarrier.init(order.index(i), count=1)

    # worker partitions take scalars, descriptors and shared memory (no distributed tensors)
    gl.warp_specialize([
        (_consumer, (c_ptr, a_scale_ptr, b_scale_ptr, sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
                     tiles_ptr, num_tiles_ptr, N, K, num_valid_tokens, UP_OFF, stride_cm, stride_asm, stride_ask,
                     stride_bse, stride_bsn, stride_bsk, a_smem, b_smem, ready, empty, order, BLOCK_M, BLOCK_N, BLOCK_K,
                     GROUP_M, HALF_TAIL, C_SORTED, GATED, SCALED, COOP, STAGES, 0, A_EPI, B_EPI, amax_ptr, AMAX,
                     N_HALVES, TOP_K if GATHER_A else 0, bias_ptr, stride_biase, bias_step, bias_up, HAS_BIAS, ACT,
                     alpha, limit)),
        (_consumer, (c_ptr, a_scale_ptr, b_scale_ptr, sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
                     tiles_ptr, num_tiles_ptr, N, K, num_valid_tokens, UP_OFF, stride_cm, stride_asm, stride_ask,
                     stride_bse, stride_bsn, stride_bsk, a_smem, b_smem, ready, empty, order, BLOCK_M, BLOCK_N, BLOCK_K,
                     GROUP_M, HALF_TAIL, C_SORTED, GATED, SCALED, COOP, STAGES, 1, A_EPI, B_EPI, amax_ptr, AMAX,
                     N_HALVES, TOP_K if GATHER_A else 0, bias_ptr, stride_biase, bias_step, bias_up, HAS_BIAS, ACT,
                     alpha, limit)),
        (_producer, (a_desc, a_desc_h, b_desc, expert_ids_ptr, num_tokens_post_padded_ptr, tiles_ptr, num_tiles_ptr,
                     N, K, NW, UP_OFF, a_smem, b_smem, ready, empty, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, HALF_TAIL,
                     GATED, STAGES, a_ptr, stride_am, sorted_token_ids_ptr, num_valid_tokens, TOP_K, GATHER_A,
                     UP_KOFF)),
    ], [CONSUMER_WARPS, GATHER_WARPS if GATHER_A else 1], [CONSUMER_REGS, GATHER_REGS if GATHER_A else PRODUCER_REGS])


# ---- the tile schedule (every partition walks it alike) ----------------------------------------------------------


@gluon.jit
def _schedule(expert_ids_ptr, num_tokens_post_padded_ptr, tiles_ptr, num_tiles_ptr, N, K, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, HALF_TAIL: gl.constexpr):
    """``(row tiles, N tiles, tiles, K tiles, programs, this program's first tile)`` of the launch."""
    if HALF_TAIL:
        num_pid_m = gl.load(num_tiles_ptr)
    else:
        num_pid_m = gl.cdiv(gl.load(num_tokens_post_padded_ptr), BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    nprog = gl.num_programs(0)
    first = _next(gl.program_id(0), num_tiles, nprog, expert_ids_ptr, tiles_ptr, num_pid_m, num_pid_n, BLOCK_M,
                  BLOCK_N, GROUP_M, HALF_TAIL)
    return num_pid_m, num_pid_n, num_tiles, gl.cdiv(K, BLOCK_K), nprog, first


@gluon.jit
def _tile_at(tile, expert_ids_ptr, tiles_ptr, num_pid_m, num_pid_n, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             GROUP_M: gl.constexpr, HALF_TAIL: gl.constexpr):
    """``(row0, n0, expert, full)`` of a tile: its first sorted row and column, its expert (-1: not local) and
    whether it has ``BLOCK_M`` rows (else ``BLOCK_M / 2``: a ``HALF_TAIL`` tail; always True without)."""
    pid_m, pid_n = _tile_pids(tile, num_pid_m, num_pid_n, GROUP_M)
    if HALF_TAIL:
        t = gl.load(tiles_ptr + pid_m)
        block = t // 2
        return block * (BLOCK_M // 2), pid_n * BLOCK_N, gl.load(expert_ids_ptr + block), t % 2 == 1
    else:
        return pid_m * BLOCK_M, pid_n * BLOCK_N, gl.load(expert_ids_ptr + pid_m), True


@gluon.jit
def _next(tile, num_tiles, nprog, expert_ids_ptr, tiles_ptr, num_pid_m, num_pid_n, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, HALF_TAIL: gl.constexpr):
    """The first of ``tile, tile + nprog, ...`` of a local expert, or ``>= num_tiles``."""
    searching = tile < num_tiles
    while searching:
        _, _, e, _ = _tile_at(tile, expert_ids_ptr, tiles_ptr, num_pid_m, num_pid_n, BLOCK_M, BLOCK_N, GROUP_M,
                              HALF_TAIL)
        skip = e < 0
        tile += nprog * skip.to(gl.int32)
        searching = skip & (tile < num_tiles)
    return tile


# ---- producer ------------------------------------------------------------------------------------------------------


@gluon.jit
def _producer(a_desc, a_desc_h, b_desc, expert_ids_ptr, num_tokens_post_padded_ptr, tiles_ptr, num_tiles_ptr, N, K,
              NW, UP_OFF, a_smem, b_smem, ready, empty, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, HALF_TAIL: gl.constexpr, GATED: gl.constexpr,
              STAGES: gl.constexpr, a_ptr, stride_am, sorted_token_ids_ptr, num_valid_tokens, TOP_K: gl.constexpr,
              GATHER_A: gl.constexpr, UP_KOFF):
    """The TMA warp: the program's tiles' K tiles, in order, into the ring: load ``j`` into stage ``j % STAGES``
    once its previous occupant, load ``j - STAGES``, has been released (a tail tile loads ``BLOCK_M / 2`` rows of A
    into the stage's first half). ``GATHER_A``: a warpgroup; each thread copies its 16-byte pieces of the tile's A
    rows from their tokens' rows (the route ids loaded once a tile; the rows past a tail's half and padding rows
    zero-filled) and arrives on the stage once they have landed; W by TMA as without."""
    num_pid_m, num_pid_n, num_tiles, nk, nprog, tile = _schedule(
        expert_ids_ptr, num_tokens_post_padded_ptr, tiles_ptr, num_tiles_ptr, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
        HALF_TAIL)
    B_BYTES: gl.constexpr = 2 * b_desc.block_type.nbytes if GATED else b_desc.block_type.nbytes
    if GATHER_A:
        g_layout: gl.constexpr = _gather_layout(BLOCK_M, BLOCK_K, a_desc.dtype.primitive_bitwidth)
        g_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, g_layout))
        g_cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, g_layout))
    j = 0
    while tile < num_tiles:
        row0, n0, e, full = _tile_at(tile, expert_ids_ptr, tiles_ptr, num_pid_m, num_pid_n, BLOCK_M, BLOCK_N,
                                     GROUP_M, HALF_TAIL)
        b_row0 = e * NW + n0
        if GATHER_A:
            if HALF_TAIL:
                in_tile = g_rows < gl.where(full, BLOCK_M, BLOCK_M // 2)
            else:
                in_tile = g_rows < BLOCK_M
            route = gl.load(sorted_token_ids_ptr + row0 + g_rows, mask=in_tile, other=num_valid_tokens)
            valid = route < num_valid_tokens
            a_rows = a_ptr + gl.where(valid, route // TOP_K, 0).to(gl.int64) * stride_am
            a_ptrs = a_rows[:, None] + g_cols[None, :]
            a_mask = valid[:, None] & (g_cols < BLOCK_K)[None, :]  # (all columns: the row mask as a 2-D tile)
        for k in range(nk):
            s = j % STAGES
            # the ring's first pass waits on the phase before the first (complete from the start)
            mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            if GATHER_A:
                cp_async_load(a_smem.index(s), a_ptrs + k * BLOCK_K, mask=a_mask, cache_modifier=".cg")
                # noinc: each thread's arrival is one of the barrier's 1 + 128 counted at init, so the elected
                # thread's expect below needs no ordering against the other warps' copies
                async_copy.mbarrier_arrive(bar, increment_count=False)
                mbarrier.expect(bar, B_BYTES)
            elif HALF_TAIL:
                mbarrier.expect(bar, a_desc.block_type.nbytes + B_BYTES, pred=full)
                mbarrier.expect(bar, a_desc_h.block_type.nbytes + B_BYTES, pred=not full)
                tma_load(a_desc, [row0, k * BLOCK_K], bar, a_smem.index(s), pred=full)
                tma_load(a_desc_h, [row0, k * BLOCK_K], bar, a_smem.index(s).slice(0, BLOCK_M // 2), pred=not full)
            else:
                mbarrier.expect(bar, a_desc.block_type.nbytes + B_BYTES)
                tma_load(a_desc, [row0, k * BLOCK_K], bar, a_smem.index(s))
            if GATED:
                b_st = b_smem.index(s)
                tma_load(b_desc, [b_row0, k * BLOCK_K], bar, b_st.slice(0, BLOCK_N))
                tma_load(b_desc, [b_row0 + UP_OFF, UP_KOFF + k * BLOCK_K], bar, b_st.slice(BLOCK_N, BLOCK_N))
            else:
                tma_load(b_desc, [b_row0, k * BLOCK_K], bar, b_smem.index(s))
            j += 1
        tile = _next(tile + nprog, num_tiles, nprog, expert_ids_ptr, tiles_ptr, num_pid_m, num_pid_n, BLOCK_M,
                     BLOCK_N, GROUP_M, HALF_TAIL)


# ---- consumers -----------------------------------------------------------------------------------------------------


@gluon.jit
def _consumer(c_ptr, a_scale_ptr, b_scale_ptr, sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
              tiles_ptr, num_tiles_ptr, N, K, num_valid_tokens, UP_OFF, stride_cm, stride_asm, stride_ask, stride_bse,
              stride_bsn, stride_bsk, a_smem, b_smem, ready, empty, order, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, HALF_TAIL: gl.constexpr,
              C_SORTED: gl.constexpr, GATED: gl.constexpr, SCALED: gl.constexpr, COOP: gl.constexpr,
              STAGES: gl.constexpr, C: gl.constexpr, A_EPI: gl.constexpr, B_EPI: gl.constexpr, amax_ptr,
              AMAX: gl.constexpr, N_HALVES: gl.constexpr, A_TOP_K: gl.constexpr, bias_ptr, stride_biase, bias_step,
              bias_up, HAS_BIAS: gl.constexpr, ACT: gl.constexpr, alpha, limit):
    """Consumer ``C`` (0 or 1). Ping-pong: the program's tiles ``i`` with ``i % 2 == C``, the mainloop of tile ``i``
    after the other consumer's of tile ``i - 1`` (its ``(i - 1) // 2``-th arrival on ``order[1 - C]``).
    Cooperative: rows ``[C BLOCK_M / 2, (C + 1) BLOCK_M / 2)`` of every tile. ``AMAX``: its amax slot at the end."""
    num_pid_m, num_pid_n, num_tiles, nk, nprog, tile = _schedule(
        expert_ids_ptr, num_tokens_post_padded_ptr, tiles_ptr, num_tiles_ptr, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
        HALF_TAIL)
    i = 0
    # AMAX: the consumer's running largest |value| per row of its tiles (inf: a NaN / inf was stored), reduced
    # across its warps once, at its end (a row's max over the columns is one warp's shuffles). Reduced to one value
    # per tile instead (shared memory and a barrier of the partition each tile), GEMM1 took 5.5% longer than
    # without AMAX at Mixtral TP2 M = 4096 on the H100; this form, 2.5%
    if AMAX:
        RUN_ROWS: gl.constexpr = BLOCK_M // 2 if COOP else BLOCK_M
        amax = gl.zeros([RUN_ROWS], gl.float32, gl.SliceLayout(1, _out_layout(_out_n(BLOCK_N, GATED, N_HALVES))))
    else:
        amax = gl.to_tensor(0.0)
    while tile < num_tiles:
        row0, n0, e, full = _tile_at(tile, expert_ids_ptr, tiles_ptr, num_pid_m, num_pid_n, BLOCK_M, BLOCK_N,
                                     GROUP_M, HALF_TAIL)
        base = i * nk  # the ring index of this tile's first K tile
        if COOP:
            if HALF_TAIL and C == 1 and not full:  # a tail's rows are consumer 0's half: only release the stages
                _release(base, nk, ready, empty, STAGES)
            else:
                t_amax = _tile(base, nk, a_smem, b_smem, ready, empty, order, c_ptr, a_scale_ptr, b_scale_ptr,
                               sorted_token_ids_ptr, row0, n0, e, N, num_valid_tokens, UP_OFF, stride_cm, stride_asm,
                               stride_ask, stride_bse, stride_bsn, stride_bsk, C * (BLOCK_M // 2), BLOCK_M // 2,
                               BLOCK_M, BLOCK_N, C_SORTED, GATED, SCALED, False, STAGES, C, A_EPI, B_EPI, AMAX,
                               N_HALVES, A_TOP_K, bias_ptr, stride_biase, bias_step, bias_up, HAS_BIAS, ACT, alpha,
                               limit)
                if AMAX:
                    amax = gl.maximum(amax, t_amax)
        elif i % 2 == C:
            if i > 0:
                mbarrier.wait(order.index(1 - C), ((i - 1) // 2) & 1)
            if HALF_TAIL and not full:  # a tail: BLOCK_M / 2 rows (the first half of each A stage)
                # (its own name: a value assigned in both arms of this runtime branch must have one type, and the
                # tail's per-row maxima are half as many)
                h_amax = _tile(base, nk, a_smem, b_smem, ready, empty, order, c_ptr, a_scale_ptr, b_scale_ptr,
                               sorted_token_ids_ptr, row0, n0, e, N, num_valid_tokens, UP_OFF, stride_cm, stride_asm,
                               stride_ask, stride_bse, stride_bsn, stride_bsk, 0, BLOCK_M // 2, BLOCK_M, BLOCK_N,
                               C_SORTED, GATED, SCALED, True, STAGES, C, A_EPI, B_EPI, AMAX, N_HALVES,
                               A_TOP_K, bias_ptr, stride_biase, bias_step, bias_up, HAS_BIAS, ACT, alpha, limit)
                if AMAX:  # half the running rows: folded as one value (a reduction across warps, tails only)
                    amax = gl.maximum(amax, gl.max(h_amax, axis=0))
            else:
                t_amax = _tile(base, nk, a_smem, b_smem, ready, empty, order, c_ptr, a_scale_ptr, b_scale_ptr,
                               sorted_token_ids_ptr, row0, n0, e, N, num_valid_tokens, UP_OFF, stride_cm, stride_asm,
                               stride_ask, stride_bse, stride_bsn, stride_bsk, 0, BLOCK_M, BLOCK_M, BLOCK_N, C_SORTED,
                               GATED, SCALED, True, STAGES, C, A_EPI, B_EPI, AMAX, N_HALVES, A_TOP_K, bias_ptr,
                               stride_biase, bias_step, bias_up, HAS_BIAS, ACT, alpha, limit)
                if AMAX:
                    amax = gl.maximum(amax, t_amax)
        tile = _next(tile + nprog, num_tiles, nprog, expert_ids_ptr, tiles_ptr, num_pid_m, num_pid_n, BLOCK_M,
                     BLOCK_N, GROUP_M, HALF_TAIL)
        i += 1
    if AMAX:  # slot 2 p + C of the 2 P: the largest finite |value| at [slot] (0 if flagged), the flag at [2 P + slot]
        slot = 2 * gl.program_id(0) + C
        m = gl.max(amax, axis=0)
        bad = m == float("inf")
        gl.store(amax_ptr + slot, gl.where(bad, 0.0, m))
        gl.store(amax_ptr + 2 * nprog + slot, gl.where(bad, 1.0, 0.0))


@gluon.jit
def _release(base, nk, ready, empty, STAGES: gl.constexpr):
    """Cooperative consumer 1 on a ``HALF_TAIL`` tail tile (no rows of its own): take each K tile once it has
    landed and release it (the stage is refilled when consumer 0 has released it too; waiting for it to land first
    keeps this consumer from releasing a later fill of the same stage early)."""
    for k in range(nk):
        j = base + k
        mbarrier.wait(ready.index(j % STAGES), (j // STAGES) & 1)
        mbarrier.arrive(empty.index(j % STAGES))


@gluon.jit
def _tile(base, nk, a_smem, b_smem, ready, empty, order, c_ptr, a_scale_ptr, b_scale_ptr, sorted_token_ids_ptr, row0,
          n0, e, N, num_valid_tokens, UP_OFF, stride_cm, stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
          ROW_OFF: gl.constexpr, ROWS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
          C_SORTED: gl.constexpr, GATED: gl.constexpr, SCALED: gl.constexpr, ORDERED: gl.constexpr,
          STAGES: gl.constexpr, C: gl.constexpr, A_EPI: gl.constexpr, B_EPI: gl.constexpr, AMAX: gl.constexpr,
          N_HALVES: gl.constexpr, A_TOP_K: gl.constexpr, bias_ptr, stride_biase, bias_step, bias_up,
          HAS_BIAS: gl.constexpr, ACT: gl.constexpr, alpha, limit):
    """This consumer's ``ROWS x BLOCK_N`` output rows ``[row0 + ROW_OFF, + ROWS)`` of a tile: mainloop, epilogue;
    returns with ``AMAX`` the largest |value| stored in each of its ``ROWS`` rows (see :func:`_epilogue`), else 0.
    ``A_TOP_K``: 0, or (``GATHER_A``) the top-k: A's row scales are then read by token (:func:`_scale_rows`)."""
    if N_HALVES:
        return _tile_halves(base, nk, a_smem, b_smem, ready, empty, order, c_ptr, a_scale_ptr, b_scale_ptr,
                            sorted_token_ids_ptr, row0 + ROW_OFF, n0, e, N, num_valid_tokens, UP_OFF, stride_cm,
                            stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk, ROW_OFF, ROWS, BLOCK_M, BLOCK_N,
                            C_SORTED, GATED, ORDERED, STAGES, C, A_EPI, B_EPI, AMAX, N_HALVES, A_TOP_K)
    if SCALED or A_EPI > 0:
        BN_MMA: gl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
        rows_layout: gl.constexpr = gl.SliceLayout(1, _acc_layout(BN_MMA, 32))
        s_rows = _scale_rows(sorted_token_ids_ptr, row0 + ROW_OFF + gl.arange(0, ROWS, layout=rows_layout),
                             num_valid_tokens, A_TOP_K)
        a_s_ptrs = a_scale_ptr + s_rows.to(gl.int64) * stride_asm
        b_s_ptr = b_scale_ptr + e.to(gl.int64) * stride_bse + (n0 // GROUP_C) * stride_bsn
        bu_s_ptr = b_scale_ptr + e.to(gl.int64) * stride_bse + ((UP_OFF + n0) // GROUP_C) * stride_bsn
        # A_EPI: the same promotion per K tile with unit factors (the scales do not vary along K)
        acc = _mainloop_scaled(base, nk, a_smem, b_smem, ready, empty, order, a_s_ptrs, b_s_ptr, bu_s_ptr, stride_ask,
                               stride_bsk, ROW_OFF, ROWS, BLOCK_M, BLOCK_N, GATED, ORDERED, STAGES, C, A_EPI > 0)
        if A_EPI > 0:
            acc = _dequantize(acc, a_scale_ptr, b_scale_ptr, s_rows, n0, e, UP_OFF, stride_asm, stride_bse,
                              stride_bsn, ROWS, BLOCK_N, GATED, A_EPI, B_EPI)
    else:
        acc = _mainloop(base, nk, a_smem, b_smem, ready, empty, order, ROW_OFF, ROWS, BLOCK_M, BLOCK_N, GATED, ORDERED,
                        STAGES, C)
    if HAS_BIAS:
        acc = _add_bias(acc, bias_ptr, e, n0, N, stride_biase, bias_step, bias_up, BLOCK_N, GATED)
    return _epilogue(acc, c_ptr, sorted_token_ids_ptr, row0 + ROW_OFF, n0, N, num_valid_tokens, stride_cm, ROWS,
                     BLOCK_N, C_SORTED, GATED, AMAX, ACT, alpha, limit)


# ---- N_HALVES: a consumer's MMA columns as two halves, one MMA register set, the promotion serialized ----------


@gluon.jit
def _tile_halves(base, nk, a_smem, b_smem, ready, empty, order, c_ptr, a_scale_ptr, b_scale_ptr, sorted_token_ids_ptr,
                 row0, n0, e, N, num_valid_tokens, UP_OFF, stride_cm, stride_asm, stride_ask, stride_bse, stride_bsn,
                 stride_bsk, ROW_OFF: gl.constexpr, ROWS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 C_SORTED: gl.constexpr, GATED: gl.constexpr, ORDERED: gl.constexpr, STAGES: gl.constexpr,
                 C: gl.constexpr, A_EPI: gl.constexpr, B_EPI: gl.constexpr, AMAX: gl.constexpr, KP: gl.constexpr,
                 A_TOP_K: gl.constexpr):
    """An FP8 promoted tile (block scales, or per-tensor / per-channel ones applied in the epilogue) whose MMA
    columns are two halves of ``HALF`` columns each, ``row0`` being this consumer's first row: half 0 the gate rows and
    half 1 the up rows of the weight stage (``GATED``), else its first and last ``BLOCK_N / 2`` rows. Numerics as
    :func:`_tile`'s: each K tile's MMA of a half started afresh and added to that half's fp32 accumulator times the K
    tile's factors, in K order (every ``KP`` K tiles: per-tensor / per-channel scales, whose MMA partials may run
    over ``PROMOTE_K`` K elements as ``fused_moe_kernel``'s do); the same dequantization and epilogue roundings."""
    HALF: gl.constexpr = BLOCK_N if GATED else BLOCK_N // 2
    acc_layout: gl.constexpr = _acc_layout(HALF, 32)
    rows = _scale_rows(sorted_token_ids_ptr, row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout)),
                       num_valid_tokens, A_TOP_K)
    a_s_ptrs = a_scale_ptr + rows.to(gl.int64) * stride_asm
    n1 = UP_OFF + n0 if GATED else n0 + HALF  # half 1's first weight row (within the expert)
    w_s = b_scale_ptr + e.to(gl.int64) * stride_bse
    acc0, acc1 = _mainloop_halves(base, nk, a_smem, b_smem, ready, empty, order, a_s_ptrs,
                                  w_s + (n0 // GROUP_C) * stride_bsn, w_s + (n1 // GROUP_C) * stride_bsn, stride_ask,
                                  stride_bsk, ROW_OFF, ROWS, BLOCK_M, HALF, ORDERED, STAGES, C, A_EPI > 0, KP)
    if A_EPI > 0:
        cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, acc_layout))
        acc0 = _apply_scales(acc0, a_scale_ptr, rows, w_s, n0 + cols, stride_asm, stride_bsn, A_EPI, B_EPI)
        acc1 = _apply_scales(acc1, a_scale_ptr, rows, w_s, n1 + cols, stride_asm, stride_bsn, A_EPI, B_EPI)
    if GATED:  # gate and up in separate accumulators: rounded each, SiLU-and-mul in fp32, rounded again
        dt: gl.constexpr = c_ptr.dtype.element_ty
        out = gl.convert_layout(_silu_mul(_rounded(acc0, dt), _rounded(acc1, dt), dt), _out_layout(BLOCK_N))
        _store_rows(out, c_ptr, sorted_token_ids_ptr, row0, n0, N, num_valid_tokens, stride_cm, ROWS, BLOCK_N,
                    C_SORTED)
        return _stored_amax(out, AMAX)
    else:
        t0 = _epilogue(acc0, c_ptr, sorted_token_ids_ptr, row0, n0, N, num_valid_tokens, stride_cm, ROWS, HALF,
                       C_SORTED, False, AMAX)
        t1 = _epilogue(acc1, c_ptr, sorted_token_ids_ptr, row0, n0 + HALF, N, num_valid_tokens, stride_cm, ROWS,
                       HALF, C_SORTED, False, AMAX)
        return gl.maximum(t0, t1)


@gluon.jit
def _mainloop_halves(base, nk, a_smem, b_smem, ready, empty, order, a_s_ptrs, b0_s_ptr, b1_s_ptr, stride_ask,
                     stride_bsk, ROW_OFF: gl.constexpr, ROWS: gl.constexpr, BLOCK_M: gl.constexpr, HALF: gl.constexpr,
                     ORDERED: gl.constexpr, STAGES: gl.constexpr, C: gl.constexpr, UNIT: gl.constexpr,
                     KP: gl.constexpr):
    """The two halves' fp32 accumulators ``[ROWS, HALF]`` over ring loads ``base .. base + nk``, promoted every ``KP``
    K tiles (``nk % KP == 0``; block scales: 1). Per group of ``KP`` K tiles: half 0's MMAs chained into the one
    register set (the first afresh), wait, promote; half 1's likewise; release the group's stages. This consumer's
    tensor-core work stops while it promotes, and the other consumer's MMAs fill that time (DeepGEMM's schedule): the
    register sets saved go to wider tiles (a 64 x 256 consumer tile in 192 registers a thread, against 64 x 128 with
    two sets), which read fewer operand bytes from shared memory and L2 per FLOP. ``UNIT``: every factor 1
    (per-tensor / per-channel, the scales come in the epilogue; the add is the FFMA with 1.0 exactly)."""
    acc_layout: gl.constexpr = _acc_layout(HALF, 32)
    acc0 = gl.zeros([ROWS, HALF], gl.float32, acc_layout)
    acc1 = gl.zeros([ROWS, HALF], gl.float32, acc_layout)
    y = gl.zeros([ROWS, HALF], gl.float32, acc_layout)
    for k in range(0, nk, KP):
        if not UNIT:  # (KP = 1) loaded before the wait: their latency under the MMA
            a_s = gl.load(a_s_ptrs + k * stride_ask)
            s0 = (a_s * gl.load(b0_s_ptr + k * stride_bsk))[:, None]  # fused_moe_kernel's order: scales first
            s1 = (a_s * gl.load(b1_s_ptr + k * stride_bsk))[:, None]
        for t in gl.static_range(KP):
            j = base + k + t
            s = j % STAGES
            mbarrier.wait(ready.index(s), (j // STAGES) & 1)
            y = warpgroup_mma(_a_stage(a_smem, s, ROW_OFF, ROWS, BLOCK_M), b_smem.index(s).slice(0, HALF).permute(
                (1, 0)), y, use_acc=t > 0, is_async=True)
        y = warpgroup_mma_wait(num_outstanding=0, deps=(y, ))
        if UNIT:
            acc0 += y
        else:
            acc0 += y * s0
        # pin the promotion before the next MMA, which is issued into y's registers: LLVM would otherwise sink it
        # past that MMA and keep a copy of y (64 registers: spills); nothing is in flight, so the wait is a no-op
        acc0 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, ))
        for t in gl.static_range(KP):  # (the stages have landed: waited for above)
            s = (base + k + t) % STAGES
            y = warpgroup_mma(_a_stage(a_smem, s, ROW_OFF, ROWS, BLOCK_M), b_smem.index(s).slice(HALF, HALF).permute(
                (1, 0)), y, use_acc=t > 0, is_async=True)
        if ORDERED:  # every K tile of this tile taken: the other consumer may start
            mbarrier.arrive(order.index(C), pred=k + KP == nk)
        y = warpgroup_mma_wait(num_outstanding=0, deps=(y, ))
        for t in gl.static_range(KP):
            mbarrier.arrive(empty.index((base + k + t) % STAGES))
        if UNIT:
            acc1 += y
        else:
            acc1 += y * s1
        acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, ))  # as acc0's: before the next group's MMA
    return acc0, acc1


@gluon.constexpr_function
def _out_n(block_n, gated, halves):
    """Columns of one epilogue store: ``BLOCK_N``, or half of it for a plain ``N_HALVES`` tile (a store per half)."""
    return block_n // 2 if halves and not gated else block_n


@gluon.constexpr_function
def _acc_layout(bn_mma, k_instr):
    """A warpgroup's wgmma accumulator layout (64-row instructions, repeated down the tile's rows)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, bn_mma, k_instr])


@gluon.jit
def _a_stage(a_smem, s, ROW_OFF: gl.constexpr, ROWS: gl.constexpr, BLOCK_M: gl.constexpr):
    """This consumer's rows of A stage ``s``."""
    a_st = a_smem.index(s)
    if ROWS != BLOCK_M:
        a_st = a_st.slice(ROW_OFF, ROWS)
    return a_st


@gluon.jit
def _mainloop(base, nk, a_smem, b_smem, ready, empty, order, ROW_OFF: gl.constexpr, ROWS: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GATED: gl.constexpr, ORDERED: gl.constexpr,
              STAGES: gl.constexpr, C: gl.constexpr):
    """Unscaled: the fp32 accumulator ``[ROWS, MMA columns]`` over ring loads ``base .. base + nk``. One wgmma group
    stays in flight while the next stage is waited for; a stage is released once its MMA is done; ``ORDERED``
    (ping-pong): ``order[C]`` is announced once the last K tile is taken, before the last MMA drains."""
    BN_MMA: gl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    acc = gl.zeros([ROWS, BN_MMA], gl.float32, _acc_layout(BN_MMA, 16))
    for k in range(nk):
        j = base + k
        s = j % STAGES
        mbarrier.wait(ready.index(s), (j // STAGES) & 1)
        acc = warpgroup_mma(_a_stage(a_smem, s, ROW_OFF, ROWS, BLOCK_M), b_smem.index(s).permute((1, 0)), acc,
                            is_async=True)
        # K tile k - 1's MMA is done (one group stays in flight): its stage goes back to the producer
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        mbarrier.arrive(empty.index((j + STAGES - 1) % STAGES), pred=k > 0)
    if ORDERED:
        mbarrier.arrive(order.index(C))  # every K tile of this tile taken: the other consumer may start
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(empty.index((base + nk - 1) % STAGES))
    return acc


@gluon.jit
def _mainloop_scaled(base, nk, a_smem, b_smem, ready, empty, order, a_s_ptrs, b_s_ptr, bu_s_ptr, stride_ask,
                     stride_bsk, ROW_OFF: gl.constexpr, ROWS: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, GATED: gl.constexpr, ORDERED: gl.constexpr, STAGES: gl.constexpr,
                     C: gl.constexpr, UNIT: gl.constexpr):
    """Block FP8: the fp32 accumulator ``[ROWS, MMA columns]``, each K tile's wgmma result scaled before it is added.
    Two register sets take turns (unrolled by two so that neither changes role: a loop-carried swap makes the
    compiler copy registers between a tile's wgmmas, and ptxas then serializes them): x holds the K tile in flight,
    y is free to be issued into (``gluon_sm90._tile_mainloop``'s schedule over this ring). ``UNIT``: every factor 1
    (FP8 per-tensor / per-channel: the promotion alone; the scales come in the epilogue)."""
    BN_MMA: gl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    acc_layout: gl.constexpr = _acc_layout(BN_MMA, 32)
    # GATED: which MMA columns are gate columns (scaled by the gate rows' block scale), the rest are up columns
    is_gate = gl.arange(0, BN_MMA, layout=gl.SliceLayout(0, acc_layout)) < BLOCK_N
    acc = gl.zeros([ROWS, BN_MMA], gl.float32, acc_layout)
    s0 = base % STAGES
    mbarrier.wait(ready.index(s0), (base // STAGES) & 1)
    x = warpgroup_mma(_a_stage(a_smem, s0, ROW_OFF, ROWS, BLOCK_M), b_smem.index(s0).permute((1, 0)), acc,
                      use_acc=False, is_async=True)
    s_x = _scales(0, a_s_ptrs, b_s_ptr, bu_s_ptr, stride_ask, stride_bsk, is_gate, ROWS, GATED, UNIT, acc_layout)
    y = gl.zeros([ROWS, BN_MMA], gl.float32, acc_layout)
    for k in range(1, nk - 1, 2):
        y, x, acc, s_y = _promote_step(k, base, x, y, acc, s_x, a_smem, b_smem, ready, empty, a_s_ptrs, b_s_ptr,
                                       bu_s_ptr, stride_ask, stride_bsk, is_gate, ROW_OFF, ROWS, BLOCK_M, GATED, STAGES,
                                       UNIT, acc_layout)
        x, y, acc, s_x = _promote_step(k + 1, base, y, x, acc, s_y, a_smem, b_smem, ready, empty, a_s_ptrs, b_s_ptr,
                                       bu_s_ptr, stride_ask, stride_bsk, is_gate, ROW_OFF, ROWS, BLOCK_M, GATED, STAGES,
                                       UNIT, acc_layout)
    if nk % 2 == 0:  # one K tile left: issue it into y, promote x, then it
        last, _, acc, s_last = _promote_step(nk - 1, base, x, y, acc, s_x, a_smem, b_smem, ready, empty, a_s_ptrs,
                                             b_s_ptr, bu_s_ptr, stride_ask, stride_bsk, is_gate, ROW_OFF, ROWS, BLOCK_M,
                                             GATED, STAGES, UNIT, acc_layout)
        if ORDERED:
            mbarrier.arrive(order.index(C))
        done = warpgroup_mma_wait(num_outstanding=0, deps=(last, ))
        mbarrier.arrive(empty.index((base + nk - 1) % STAGES))
        acc += done * s_last
    else:
        if ORDERED:
            mbarrier.arrive(order.index(C))
        done = warpgroup_mma_wait(num_outstanding=0, deps=(x, ))
        mbarrier.arrive(empty.index((base + nk - 1) % STAGES))
        acc += done * s_x
    return acc


@gluon.jit
def _promote_step(k, base, busy, free, acc, s_busy, a_smem, b_smem, ready, empty, a_s_ptrs, b_s_ptr, bu_s_ptr,
                  stride_ask, stride_bsk, is_gate, ROW_OFF: gl.constexpr, ROWS: gl.constexpr, BLOCK_M: gl.constexpr,
                  GATED: gl.constexpr, STAGES: gl.constexpr, UNIT: gl.constexpr, acc_layout: gl.constexpr):
    """Issue K tile ``k``'s MMA into ``free`` (use_acc=False), wait for K tile ``k - 1``'s (``busy``), release its
    stage and promote it: ``acc += busy * s_busy``. Returns ``(k's MMA in flight, the promoted register set (now
    free), acc, k's scales)``."""
    j = base + k
    s = j % STAGES
    mbarrier.wait(ready.index(s), (j // STAGES) & 1)
    issued = warpgroup_mma(_a_stage(a_smem, s, ROW_OFF, ROWS, BLOCK_M), b_smem.index(s).permute((1, 0)), free,
                           use_acc=False, is_async=True)
    done = warpgroup_mma_wait(num_outstanding=1, deps=(busy, ))
    mbarrier.arrive(empty.index((j + STAGES - 1) % STAGES))
    s_k = _scales(k, a_s_ptrs, b_s_ptr, bu_s_ptr, stride_ask, stride_bsk, is_gate, ROWS, GATED, UNIT, acc_layout)
    acc += done * s_busy
    # pin the promotion here: LLVM would otherwise sink it past the next step's MMA, which is issued into `done`'s
    # registers (a copy, and ptxas then serializes the wgmmas); a wait for <= 1 group is a no-op at this point
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
    return issued, done, acc, s_k


@gluon.jit
def _scales(k, a_s_ptrs, b_s_ptr, bu_s_ptr, stride_ask, stride_bsk, is_gate, ROWS: gl.constexpr, GATED: gl.constexpr,
            UNIT: gl.constexpr, acc_layout: gl.constexpr):
    """K tile ``k``'s promotion factors: block FP8's ``gluon_sm90._k_tile_scales``, or ones (``UNIT``: no load; the
    FFMA with 1.0 adds the MMA result to the fp32 accumulator exactly as an add would)."""
    if UNIT:
        return gl.full([ROWS], 1.0, gl.float32, gl.SliceLayout(1, acc_layout))[:, None]
    else:
        return _k_tile_scales(k, a_s_ptrs, b_s_ptr, bu_s_ptr, stride_ask, stride_bsk, is_gate, GATED)


@gluon.jit
def _scale_rows(sorted_token_ids_ptr, rows, num_valid_tokens, A_TOP_K: gl.constexpr):
    """The rows of A's per-row (per-token, block) scales for sorted rows ``rows``: the rows themselves (A in sorted
    order, ``PERMUTE_A``'s scales with it), or (``A_TOP_K`` > 0: ``GATHER_A``) each route's token; a padding row
    reads token 0's scale, which multiplies its zero-filled A (``PERMUTE_A``'s padding rows have zero scales: both
    give +0 wherever token 0's scale is finite, and the padding rows' outputs are never read as routes)."""
    if A_TOP_K > 0:
        route = gl.load(sorted_token_ids_ptr + rows)
        return gl.where(route < num_valid_tokens, route // A_TOP_K, 0)
    else:
        return rows


@gluon.jit
def _dequantize(acc, a_scale_ptr, b_scale_ptr, rows, n0, e, UP_OFF, stride_asm, stride_bse, stride_bsn,
                ROWS: gl.constexpr, BLOCK_N: gl.constexpr, GATED: gl.constexpr, A_EPI: gl.constexpr,
                B_EPI: gl.constexpr):
    """FP8 per-tensor / per-channel: the promoted fp32 accumulator times the activation scale, then the weight scale
    (``fused_moe_kernel``'s ``A_SCALE`` / ``B_SCALE`` 1, 2 epilogue order; GATED: the gate rows' scales on the gate
    columns, the up rows' on the up columns; ``rows``: the rows of A's per-row scales, :func:`_scale_rows`)."""
    BN_MMA: gl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    acc_layout: gl.constexpr = _acc_layout(BN_MMA, 32)
    cols = gl.arange(0, BN_MMA, layout=gl.SliceLayout(0, acc_layout))
    if GATED:
        wrow = gl.where(cols < BLOCK_N, n0 + cols, UP_OFF + n0 + cols - BLOCK_N)
    else:
        wrow = n0 + cols
    return _apply_scales(acc, a_scale_ptr, rows, b_scale_ptr + e.to(gl.int64) * stride_bse, wrow, stride_asm,
                         stride_bsn, A_EPI, B_EPI)


@gluon.jit
def _apply_scales(acc, a_scale_ptr, rows, w_s, wrow, stride_asm, stride_bsn, A_EPI: gl.constexpr,
                  B_EPI: gl.constexpr):
    """``acc`` times the activation scale (1: ``a_scale[0]``; 2: per row, ``rows``), then the weight scale (1: the
    expert's ``w_s[0]``; 2: per column, of weight rows ``wrow``)."""
    if A_EPI == 1:
        acc = acc * gl.load(a_scale_ptr)
    else:
        acc = acc * gl.load(a_scale_ptr + rows.to(gl.int64) * stride_asm)[:, None]
    if B_EPI == 1:
        acc = acc * gl.load(w_s)
    else:
        acc = acc * gl.load(w_s + wrow.to(gl.int64) * stride_bsn)[None, :]
    return acc


@gluon.jit
def _epilogue(acc, c_ptr, sorted_token_ids_ptr, row0, n0, N, num_valid_tokens, stride_cm, ROWS: gl.constexpr,
              BLOCK_N: gl.constexpr, C_SORTED: gl.constexpr, GATED: gl.constexpr, AMAX: gl.constexpr = False,
              ACT: gl.constexpr = ACT_SILU, alpha=1.0, limit=0.0):
    """One rounding (GATED: h, then the gated activation ``ACT`` in fp32 and its rounding) and 16-byte
    row-contiguous stores.
    Returns, with ``AMAX``, the largest |value| stored in each row (``[ROWS]``; NaN / inf counted as inf: no load of
    the route ids in the epilogue; see the kernel's docstring for why padding rows may count), else 0."""
    out_layout: gl.constexpr = _out_layout(BLOCK_N)
    if GATED:  # columns [0, BLOCK_N) are gate, [BLOCK_N, 2 BLOCK_N) up: a thread holds both of a pair
        g, u = _rounded(acc, c_ptr.dtype.element_ty).reshape([ROWS, 2, BLOCK_N]).permute(0, 2, 1).split()
        if ACT == SWIGLUOAI_C:
            out = gl.convert_layout(_swigluoai(g, u, alpha, limit, c_ptr.dtype.element_ty), out_layout)
        else:
            out = gl.convert_layout(_silu_mul(g, u, c_ptr.dtype.element_ty), out_layout)
    else:
        out = gl.convert_layout(acc.to(c_ptr.dtype.element_ty), out_layout)
    _store_rows(out, c_ptr, sorted_token_ids_ptr, row0, n0, N, num_valid_tokens, stride_cm, ROWS, BLOCK_N, C_SORTED)
    return _stored_amax(out, AMAX)


@gluon.jit
def _add_bias(acc, bias_ptr, e, n0, N, stride_biase, bias_step, bias_up, BLOCK_N: gl.constexpr,
              GATED: gl.constexpr):
    """``acc + bias[e, .]`` in fp32 (``fused_moe_kernel``'s ``HAS_BIAS``: after the MMAs, before the rounding), MMA
    column ``c`` reading ``(n0 + c) bias_step`` (``GATED``: the up columns ``c >= BLOCK_N`` read ``(n0 + c - BLOCK_N)
    bias_step + bias_up``); see the kernel's docstring. Output columns past ``N`` (a last, partial N tile) add 0:
    they are not stored."""
    BN_MMA: gl.constexpr = acc.shape[1]
    cols = gl.arange(0, BN_MMA, layout=gl.SliceLayout(0, acc.type.layout))
    n = n0 + (cols % BLOCK_N if GATED else cols)
    off = n * bias_step
    if GATED:
        off += gl.where(cols >= BLOCK_N, bias_up, 0)
    b = gl.load(bias_ptr + e.to(gl.int64) * stride_biase + off, mask=n < N, other=0.0)
    return acc + b.to(gl.float32)[None, :]


@gluon.jit
def _rounded(x, dt: gl.constexpr):
    """``x.to(dt).to(float32)``: fp32 ``x`` rounded to nearest even in C's dtype, as fp32. bf16: two values per
    conversion (``jit.BF16X2_ROUND_ASM``: ``cvt.rn.bf16x2.f32``, whose halves are ``cvt.rn.bf16.f32``'s bits, NaN
    canonical alike), widened by a shift and a mask (``jit.act_rounded``, the same for ``fused_moe_kernel``). Why:
    the per-value form compiles to one ``F2F.BF16.F32`` a value, on sm_90's slow conversion pipe beside SiLU's two
    ``MUFU``, in an epilogue the tensor cores idle through; packed, the FP8 prefill GEMM1s ran
    2-3.6% faster on the H200, bit for bit the same (docs/notes/triton.md, twenty-sixth session)."""
    if dt == gl.bfloat16:
        return gl.inline_asm_elementwise(BF16X2_ROUND_ASM, "=r,=r,r,r", [x], dtype=gl.float32, is_pure=True, pack=2)
    else:
        return x.to(dt).to(gl.float32)


@gluon.jit
def _silu_mul(g, u, dt: gl.constexpr):
    """``silu(g) * u`` in fp32 (gate and up already rounded to C's dtype), rounded to ``dt`` (``jit.apply_act``,
    SILU)."""
    return (g * (1.0 / (1.0 + gl.exp(-g))) * u).to(dt)


@gluon.jit
def _swigluoai(g, u, alpha, limit, dt: gl.constexpr):
    """gpt-oss's SwiGLU (``jit.apply_act``, ACT 4, the same operations in the same order): the gate clamped to
    ``<= limit``, up to ``[-limit, limit]``, ``(u + 1) * g * sigmoid(alpha g)`` in fp32 (gate and up already rounded
    to C's dtype), rounded to ``dt``."""
    g = gl.minimum(g, limit)
    u = gl.minimum(gl.maximum(u, -limit), limit)
    return ((u + 1.0) * g * (1.0 / (1.0 + gl.exp(-(alpha * g))))).to(dt)


@gluon.jit
def _stored_amax(out, AMAX: gl.constexpr):
    """With ``AMAX``, the largest |value| of each row of a stored tile (NaN / inf as inf; over the columns, within a
    warp: ``_out_layout`` spreads a row over one warp's lanes), else 0."""
    t_amax = gl.to_tensor(0.0)
    if AMAX:
        y = out.to(gl.float32)
        ay = gl.abs(y)
        t_amax = gl.max(gl.where((y != y) | (ay == float("inf")), float("inf"), ay), axis=1)
    return t_amax


@gluon.constexpr_function
def _gather_layout(block_m, block_k, bits):
    """``GATHER_A``'s copy layout over ``[BLOCK_M, BLOCK_K]``: 16 bytes a thread and copy, a row's pieces over
    consecutive lanes, the producer's warps down the rows."""
    vec = 128 // bits
    per_row = block_k // vec
    return gl.BlockedLayout(size_per_thread=[1, vec], threads_per_warp=[32 // per_row, per_row],
                            warps_per_cta=[GATHER_WARPS.value, 1], order=[1, 0])


@gluon.constexpr_function
def _out_layout(block_n):
    """The epilogue's store layout: 8 consecutive columns (16 bytes) a thread, a row over ``block_n / 8`` lanes of
    one warp, the warpgroup's 4 warps down the rows."""
    return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 * 8 // block_n, block_n // 8],
                            warps_per_cta=[4, 1], order=[1, 0])


# ---- host ----------------------------------------------------------------------------------------------------------

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv}


def supported(ops: GemmOperands, shape: GemmShape, scales: GemmScales, epi: GemmEpilogue, cfg: dict) -> str | None:
    """``None`` when :func:`launch` computes this GEMM, else why not (a table entry's ``PINGPONG`` / ``COOPERATIVE``
    key then falls back to ``fused_moe_kernel``). Arguments as ``gluon_sm90.supported``."""
    a, w, c, bias = ops.a, ops.w, ops.c, ops.bias
    K, n_out, fuse, half_tail = w.shape[2], shape.n_out, epi.fuse, shape.half_tail
    a_mode, b_mode, group_n, group_k = scales.a_mode, scales.b_mode, scales.group_n, scales.group_k
    BM, BN, BK = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]
    coop = bool(cfg.get("COOPERATIVE", 0))
    halves = bool(cfg.get("N_HALVES", 0))
    gather = bool(cfg.get("GATHER_A", 0))
    block = a_mode == ScaleMode.GROUP
    # FP8 per-tensor / per-channel: promoted, scales in the epilogue
    per_tensor_or_row = (ScaleMode.TENSOR, ScaleMode.ROW)
    epi_scales = a_mode in per_tensor_or_row and b_mode in per_tensor_or_row
    scaled = block or epi_scales
    interleaved = fuse == Fusion.INTERLEAVED  # SWIGLUOAI's rows 2n / 2n + 1: W viewed (E * I, 2 K)
    gated = fuse.halves or interleaved
    bn_mma = 2 * BN if gated else BN
    rows = BM // 2 if coop else BM  # a consumer's rows
    mma_cols = bn_mma // 2 if halves else bn_mma  # one MMA's columns
    # accumulator registers per thread: one set; FP8 with promotion, the accumulator and two MMA register sets, or
    # (N_HALVES) the two halves' accumulators and one MMA set
    acc_regs = rows * (bn_mma + mma_cols if halves else bn_mma * (3 if scaled else 1)) // 128
    elt = a.element_size()
    out_n = BN // 2 if halves and not gated else BN  # columns of one epilogue store
    # the ring, and the epilogue's layout conversion of a consumer's tile (163904 B compiled at 3 stages of 128 x 256
    # FP8 with N_HALVES: 147456 + 16384 + barriers)
    smem = cfg.get("num_stages", 4) * (BM + bn_mma) * BK * elt + rows * out_n * c.element_size()
    a8 = a.dtype == torch.float8_e4m3fn or (scaled and a.dtype == torch.uint8)
    checks = [
        ((a_mode, b_mode) == (ScaleMode.NONE, ScaleMode.NONE) and a.dtype in (torch.bfloat16, torch.float16)
         and w.dtype == a.dtype
         or (block and b_mode == ScaleMode.GROUP or epi_scales) and a8 and w.dtype == torch.float8_e4m3fn,
         "bf16 / fp16 operands, or FP8 e4m3 with block (1x128 activation, 128x128 weight), per-tensor or per-token "
         "activation and per-tensor or per-channel weight scales"),
        (not (epi_scales and cfg.get("FAST_ACCUM", 0)), "FAST_ACCUM (in-place FP8 accumulation) is fused_moe_kernel's"),
        (c.dtype in (torch.bfloat16, torch.float16), "bf16 / fp16 output"),
        (not halves or scaled, "N_HALVES: FP8 GEMMs with promotion only (block, per-tensor or per-channel scales)"),
        (not halves or gated or BN >= 64, "N_HALVES: BLOCK_N >= 64 (halves of at least 32 columns)"),
        (not block or (group_n == GROUP and group_k == GROUP and BK == GROUP
                       and (BN // 2 if halves and not gated else BN) <= GROUP),
         "block FP8: 128x128 weight blocks, BLOCK_K = 128 and BLOCK_N <= 128 (with N_HALVES, halves <= 128: one "
         "weight scale per MMA and K tile)"),
        (not epi_scales or BK in (64, 128),
         "FP8 per-tensor / per-channel: BLOCK_K 64 or 128 (promoted every K tile; N_HALVES: every PROMOTE_K)"),
        (not shape.a_gather or gather,
         "A rows must be contiguous (GEMM2, or GEMM1 with PERMUTE_A) or gathered by the producer (GATHER_A)"),
        (not gather or shape.a_gather and shape.c_sorted, "GATHER_A: GEMM1 without PERMUTE_A only"),
        (fuse == Fusion.NONE or (fuse.halves and epi.act == ACT_SILU and not epi.has_limit)
         or (interleaved and epi.act == ACT_SWIGLUOAI and not scaled),
         "plain epilogue, gate / up halves with SiLU (no clamp), or interleaved gate / up with SWIGLUOAI (unscaled "
         "operands) only"),
        (bias is None or not scaled and bias.dim() == 2 and tuple(bias.shape) == tuple(w.shape[:2]),
         "bias only with unscaled (bf16 / fp16) operands, shaped (E, weight rows)"),
        (not epi.out_quant or epi.out_quant == OUT_AMAX_SLOTS and shape.c_sorted,
         "no fused requantization (only GEMM1's amax slots, OUT_AMAX_SLOTS)"),
        (not half_tail or BM == 128, "HALF_TAIL needs BLOCK_M = 128 (64-row tail MMAs)"),
        (BM in (64, 128) and rows >= 64 and bn_mma <= 256 and BN >= 32 and BK in (32, 64, 128),
         "BLOCK_M in (64, 128) (a consumer's rows >= 64), MMA columns <= 256, BLOCK_K in (32, 64, 128)"),
        (acc_regs <= (192 if scaled else 128), f"a consumer's accumulators ({acc_regs} registers per thread) must fit "
         "its warpgroup: at most 128 x 128 MMA columns x rows (FP8 with promotion: 64 x 128, or 64 x 256 with "
         "N_HALVES)"),
        (K % BK == 0 and (n_out % BN == 0 or not scaled and not epi.out_quant)
         and (not gated or w.shape[1] == 2 * n_out) and (not interleaved or (2 * K * w.element_size()) % 16 == 0),
         "K % BLOCK_K == 0, N % BLOCK_N == 0 unless unscaled without fused quantization (a last, partial N tile: its "
         "columns past N are not stored; the amax slots would count them) (gated: w1 rows = 2 I; interleaved: 2 K "
         "rows 16-byte aligned)"),
        (not (block and gated) or n_out % GROUP == 0, "block-FP8 gate / up halves need I % 128 == 0"),
        (not halves or cfg.get("num_stages", 4) >= _halves_k_tiles(cfg, K, epi_scales),
         "N_HALVES: num_stages >= the K tiles per promotion (PROMOTE_K / BLOCK_K: a consumer holds them all)"),
        (smem <= 220 * 1024, f"shared memory {smem} B over the SM's 227 KiB: fewer stages"),
        (a.is_contiguous() and w.is_contiguous() and c.stride(1) == 1 and a.data_ptr() % 16 == 0
         and w.data_ptr() % 16 == 0, "TMA needs contiguous, 16-byte aligned A and W"),
        (a.device.type != "cuda" or torch.cuda.get_device_capability(a.device)[0] == 9, "sm_90 (Hopper) GPUs only"),
    ]
    return next((why for ok, why in checks if not ok), None)


def launch(ops: GemmOperands, shape: GemmShape, scales: GemmScales, epi: GemmEpilogue, cfg: dict,
           w_strides=(0, 0, 0)):
    """Launch :func:`ws_moe_gemm_kernel` for one GEMM, one CTA per SM (arguments as ``experts.launch_gemm``'s;
    ``scales.a_mode`` / ``b_mode``: ``GROUP`` block FP8; ``TENSOR`` / ``ROW``: per-tensor / per-row or per-channel,
    applied in the epilogue; ``ops.w_scale`` as ``experts._scale_strides`` returns it, ``w_strides``: its
    ``(expert, row, K block)`` strides; ``layout.tiles`` set: ``HALF_TAIL``; ``shape.a_gather``: ``ops.a`` is the
    hidden states ``(M, K)``, gathered by the producer (``GATHER_A``); call :func:`supported` first)."""
    a, w, c, a_scale, w_scale = ops.a, ops.w, ops.c, ops.a_scale, ops.w_scale
    a_mode, b_mode, layout, n_out = scales.a_mode, scales.b_mode, shape.layout, shape.n_out
    E, NW, K = w.shape
    BM, BN, BK = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]
    scaled = a_mode == ScaleMode.GROUP
    epi_scales = a_mode in (ScaleMode.TENSOR, ScaleMode.ROW)
    half_tail = shape.half_tail
    a = a.view(torch.float8_e4m3fn) if a.dtype == torch.uint8 else a
    dt = _GL_DTYPES[a.dtype]
    a_layout = gl.NVMMASharedLayout.get_default_for([BM, BK], dt)
    a_desc = TensorDescriptor.from_tensor(a, [BM, BK], a_layout)
    a_desc_h = TensorDescriptor.from_tensor(a, [BM // 2, BK], a_layout) if half_tail else a_desc
    interleaved = epi.fuse == Fusion.INTERLEAVED
    # interleaved gate / up (SWIGLUOAI, rows 2n / 2n + 1): W viewed (E * I, 2 K), gate row n in columns [0, K), its up
    # row in [K, 2 K): the halves' two TMA boxes a tile, as for rows n / I + n
    w_rows, nw = (w.view(E * NW // 2, 2 * K), NW // 2) if interleaved else (w.view(E * NW, K), NW)
    b_desc = TensorDescriptor.from_tensor(w_rows, [BN, BK], gl.NVMMASharedLayout.get_default_for([BN, BK], dt))
    bias = ops.bias
    # bias offsets in elements: MMA column c of N tile n0 reads (n0 + c) * step (+ up for the up columns)
    sb_e, sb_n = bias.stride() if bias is not None else (0, 0)
    b_step, b_up = (2, 1) if interleaved else (1, n_out if epi.fuse.halves else 0)
    grid = (_grid(shape, cfg, a.device), )
    amax = epi.out_quant == OUT_AMAX_SLOTS
    if amax and (ops.cs is None or tuple(ops.cs.shape) != (2 * grid[0], 2) or ops.cs.stride() != (1, 2 * grid[0])
                 or ops.cs.dtype != torch.float32):
        raise ValueError(f"OUT_AMAX_SLOTS on gluon_ws needs cs of shape ({2 * grid[0]}, 2) fp32 with strides (1, "
                         f"{2 * grid[0]}) (amax_slot_count), got "
                         f"{None if ops.cs is None else (tuple(ops.cs.shape), ops.cs.dtype, ops.cs.stride())}")
    sa = (a_scale.stride(0), a_scale.stride(1)) if scaled else (
        (a_scale.stride(0), 0) if a_mode == ScaleMode.ROW else (0, 0))
    sw = tuple(w_strides) if scaled or epi_scales else (0, 0, 0)
    ws_moe_gemm_kernel[grid](
        a_desc, a_desc_h, b_desc, c, a_scale if scaled or epi_scales else c, w_scale if scaled or epi_scales else c,
        layout.sorted_token_ids, layout.expert_ids, layout.num_tokens_post_padded,
        layout.tiles if half_tail else layout.expert_ids,
        layout.num_tiles if half_tail else layout.num_tokens_post_padded,
        n_out, K, shape.num_valid, nw, n_out if epi.fuse.halves else 0, c.stride(0), *sa, *sw,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=cfg.get("GROUP_SIZE_M", 1), HALF_TAIL=half_tail,
        C_SORTED=shape.c_sorted, GATED=epi.fuse.halves or interleaved, SCALED=scaled,
        COOP=bool(cfg.get("COOPERATIVE", 0)),
        STAGES=cfg.get("num_stages", 4), num_warps=CONSUMER_WARPS, A_EPI=int(a_mode) if epi_scales else 0,
        B_EPI=int(b_mode) if epi_scales else 0, amax_ptr=ops.cs if amax else c, AMAX=amax,
        N_HALVES=_halves_k_tiles(cfg, K, epi_scales),
        a_ptr=a, stride_am=a.stride(0), TOP_K=shape.top_k, GATHER_A=shape.a_gather,
        bias_ptr=bias if bias is not None else c, stride_biase=sb_e, bias_step=b_step * sb_n, bias_up=b_up * sb_n,
        HAS_BIAS=bias is not None,
        ACT=epi.act if epi.fuse else ACT_SILU, alpha=float(epi.alpha), limit=float(epi.limit),
        UP_KOFF=K if interleaved else 0,
        num_stages=cfg.get("num_stages", 4),  # not used by Gluon; recorded in the kernel's metadata (sm90.py)
        maxnreg=LAUNCH_MAXNREG, **FP_FUSION,
    )


def _halves_k_tiles(cfg: dict, K: int, epi_scales: bool) -> int:
    """The kernel's ``N_HALVES``: 0 (the two-set schedule), or the K tiles per promotion of the halves schedule:
    ``PROMOTE_K / BLOCK_K`` for per-tensor / per-channel scales where ``K`` is a multiple of ``PROMOTE_K``, else 1
    (block scales change every K tile)."""
    if not cfg.get("N_HALVES", 0):
        return 0
    pk, bk = cfg.get("PROMOTE_K", _configs.DEFAULT_PROMOTE_K), cfg["BLOCK_SIZE_K"]
    return pk // bk if epi_scales and pk >= bk and K % pk == 0 else 1


def _grid(shape: GemmShape, cfg: dict, device) -> int:
    """Programs of a launch: one per SM, no more than an upper bound of the tiles (the kernel reads the layout's
    count; programs beyond it would find no work)."""
    row_tiles = shape.layout.tiles.numel() if shape.half_tail else triton.cdiv(shape.rows, cfg["BLOCK_SIZE_M"])
    return min(row_tiles * triton.cdiv(shape.n_out, cfg["BLOCK_SIZE_N"]), _num_sms(device))


def amax_slot_count(shape: GemmShape, cfg: dict, device) -> int:
    """The amax slots a GEMM1 launch with ``OUT_AMAX_SLOTS`` writes: two per program (one per consumer)."""
    return 2 * _grid(shape, cfg, device)


def _num_sms(device) -> int:
    if device.type != "cuda":  # compile-only runs (sm90.py): the H100 / H200's 132
        return triton.runtime.driver.active.utils.get_device_properties(0)["multiprocessor_count"]
    return torch.cuda.get_device_properties(device).multi_processor_count
