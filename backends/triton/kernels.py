"""The fused-MoE Triton kernels: the grouped expert GEMM, the activation(+quantize) pass, and the top-k sum.

Written from ``reference.experts`` (the per-expert loop and its rounding points) and ``reference.align`` (the
block layout); the kernel structure is the classic grouped-GEMM over an expert-sorted route list (as vLLM's
``fused_moe_kernel``), extended with:

* a fused gated-activation epilogue (``FUSE``): one program computes the gate and the up tile of the same output
  columns (w1 rows ``n`` and ``n + I``, or ``2n`` and ``2n + 1`` for interleaved SWIGLUOAI), rounds them to the
  activation dtype (the reference's GEMM1 rounding point), applies the activation in fp32 and rounds again, so
  GEMM1 writes ``I`` columns instead of ``2I`` and no separate activation kernel runs;
* an optional fused FP8 1x``BLOCK_N`` group quantization of that output (``OUT_QUANT``) for the block-FP8 scheme:
  GEMM2's input codes and scales come straight out of GEMM1;
* sorted intermediate rows: GEMM1 writes its output at the *sorted position* of each route (``C_SORTED``), so
  GEMM2 reads contiguous row tiles (no gather; TMA-able) and scatters only its final rows back to route order;
* TMA tensor descriptors for weight tiles (and GEMM2's contiguous activation tiles) when ``TMA_A`` / ``TMA_B``;
* int64 row/expert offsets everywhere (``M * topk * N`` may exceed 2^31: vLLM #5938 / #34279);
* programmatic dependent launch (``PDL_TRIGGER`` / ``PDL_WAIT``, sm_90): GEMM2's programs are launched while GEMM1's
  last wave runs and wait for its output (``griddepcontrol.wait``), hiding GEMM2's launch at decode.

Numerics (all schemes): fp32 accumulation (int32 for INT8), scales applied in fp32 (per K tile for 128x128
blocks, in the epilogue otherwise), bias added in fp32, one rounding to the output dtype per rounding point of the
reference. Quantized activations use the exact encoders of ``jit`` (recipe-exact, bit-identical to
``reference.quant``).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .jit import (act_rounded, apply_act, div_rn_by_scale, finite_abs, fp8_quant_rows, fp8e4m3_code, int8_code, mul_rn,
                  route_local_experts, tile_amax, to_act)

__all__ = ["fused_moe_kernel", "act_quant_kernel", "moe_sum_kernel", "permute_rows_kernel",
           "QMODE_NONE", "QMODE_FP8_GROUP", "QMODE_FP8_TOKEN", "QMODE_INT8_TOKEN", "QMODE_FP8_STATIC",
           "QMODE_INT8_STATIC", "QMODE_FP8_TENSOR_AMAX", "QMODE_FP8_TENSOR_QUANT"]

# act_quant_kernel output modes
QMODE_NONE = 0  # activation dtype
QMODE_FP8_GROUP = 1  # fp8, dynamic 1xBLOCK_C groups (BLOCK_C == group size)
QMODE_FP8_TOKEN = 2  # fp8, dynamic per row (scaled_fp8_quant per-token rule)
QMODE_INT8_TOKEN = 3  # int8, dynamic per row
QMODE_FP8_STATIC = 4  # fp8, static per-tensor scale (x * (1/s))
QMODE_INT8_STATIC = 5  # int8, static per-tensor scale (x / s)
QMODE_FP8_TENSOR_AMAX = 6  # pass 1 of dynamic per-tensor fp8: amax over all routed rows (atomic max)
QMODE_FP8_TENSOR_QUANT = 7  # pass 2: quantize with amax / 448


@triton.jit
def _mma(a, b, acc, SWAP_AB: tl.constexpr, DOT_PREC: tl.constexpr):
    """``acc + a @ b`` on the tensor cores; ``SWAP_AB``: ``acc + b^T @ a^T`` (``acc`` transposed: the weight tile's
    rows on the MMA's M)."""
    if SWAP_AB:
        return tl.dot(tl.trans(b), tl.trans(a), acc, input_precision=DOT_PREC)
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PREC)


@triton.jit
def _moe_tile(
    # operands, split-K scratch, TMA descriptors
    a_ptr, b_ptr, c_ptr, cs_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, part_ptr, cnt_ptr,
    a_desc, b_desc,
    # this program's tile: the layout's route ids, its first sorted row, expert, N tile group, row tile, K split
    sorted_token_ids_ptr, row0, e, pid_ng, tile_id, pid_k,
    # sizes
    N, K, num_valid_tokens, UP_OFF, NW, num_a_slots,
    # strides
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk, stride_biase, stride_biasn,
    stride_csm, stride_csg,
    # epilogue scalars
    alpha, beta, limit, amax_floor, ue8m0_floor,
    # constexprs (groups as fused_moe_kernel's): tiling
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, N_TILES: tl.constexpr,
    FLATTEN: tl.constexpr, SPLIT_K: tl.constexpr,
    # rows
    TOP_K: tl.constexpr, A_GATHER: tl.constexpr, C_SORTED: tl.constexpr,
    # operands and accumulation
    A_SCALE: tl.constexpr, B_SCALE: tl.constexpr, B_SCALAR: tl.constexpr, GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr, INT8: tl.constexpr, PROMOTE: tl.constexpr, SWAP_AB: tl.constexpr, DOT_PREC: tl.constexpr,
    EVEN_K: tl.constexpr, TMA_A: tl.constexpr, TMA_B: tl.constexpr, EMU: tl.constexpr,
    # epilogue
    HAS_BIAS: tl.constexpr, FUSE: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, ACT_DT: tl.constexpr,
    OUT_QUANT: tl.constexpr, USE_UE8M0: tl.constexpr, UE8M0_EXACT: tl.constexpr, SCALE_INV: tl.constexpr,
    RECIP_MUL: tl.constexpr, ROUTE_TILES: tl.constexpr = 0, PACK_ROUND: tl.constexpr = 0,
):
    """``N_TILES`` ``BLOCK_M x BLOCK_N`` output tiles of expert ``e``: sorted rows ``[row0, row0 + BLOCK_M)``,
    output columns of N tiles ``pid_ng * N_TILES + j`` (see :func:`fused_moe_kernel` for the modes); with
    ``SPLIT_K`` > 1 only the K tiles of split ``pid_k``, ``tile_id`` naming the row tile for the split's partial
    sums."""
    e64 = e.to(tl.int64)

    offs_m = row0 + tl.arange(0, BLOCK_M)
    if ROUTE_TILES:  # the tile is route row0 // BLOCK_M alone, in its first row
        offs_token = tl.where(tl.arange(0, BLOCK_M) == 0, row0 // BLOCK_M, num_valid_tokens)
    else:
        offs_token = tl.load(sorted_token_ids_ptr + offs_m)
    token_mask = offs_token < num_valid_tokens
    if A_GATHER:
        a_rows = offs_token // TOP_K
    else:
        a_rows = offs_m

    offs_k = tl.arange(0, BLOCK_K)
    if A_SCALE == 4:  # A in the activation dtype, quantized here with the per-tensor scale of GEMM1's amax slots
        if EMU:  # 2 slots a step: the interpreter's few slots still take several
            a_s, a_inv = _slots_tensor_scale(a_scale_ptr, num_a_slots, stride_asm, stride_ask, 2)
        else:
            a_s, a_inv = _slots_tensor_scale(a_scale_ptr, num_a_slots, stride_asm, stride_ask, 1024)
    # N_TILES consecutive N tiles per program: the rows and their bookkeeping are loaded once, and with FLATTEN the
    # compiler pipelines the flattened (tile, K) loop, so the next tile's loads overlap this tile's epilogue
    for j in tl.range(0, N_TILES, flatten=FLATTEN):
        pid_n = pid_ng * N_TILES + j
        # weight rows of this tile (wrapped into range: columns past N are computed on valid rows, never stored)
        if FUSE == 2:
            offs_bn = (pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)) % (2 * N)
        elif FUSE == 4:  # the tile's gate rows, then its up rows: one [2 * BLOCK_N] weight tile
            offs_j = tl.arange(0, 2 * BLOCK_N)
            offs_bn = (pid_n * BLOCK_N + offs_j % BLOCK_N) % N + (offs_j // BLOCK_N) * UP_OFF
        else:
            offs_bn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        a_ptrs = a_ptr + a_rows[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
        b_base = b_ptr + e64 * stride_be
        b_ptrs = b_base + offs_k[:, None] * stride_bk + offs_bn[None, :].to(tl.int64) * stride_bn
        bu_ptrs = b_base + offs_k[:, None] * stride_bk + (offs_bn + UP_OFF)[None, :].to(tl.int64) * stride_bn
        if FUSE == 2:
            b_row0 = (e * NW + pid_n * 2 * BLOCK_N).to(tl.int32)
        elif FUSE == 4:  # b_desc: the weights viewed as (E * 2, N, K) halves, boxes of [2, BLOCK_N, BLOCK_K]
            b_row0 = (pid_n * BLOCK_N).to(tl.int32)
        else:
            b_row0 = (e * NW + pid_n * BLOCK_N).to(tl.int32)

        if SWAP_AB:  # FP8: the accumulator transposed (weight rows on the MMA's M, the tile's rows on its N)
            if FUSE == 2 or FUSE == 4:
                acc = tl.zeros((2 * BLOCK_N, BLOCK_M), dtype=tl.float32)
            else:
                acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        elif FUSE == 2 or FUSE == 4:
            if INT8:
                acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.int32)
            else:
                acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        else:
            if INT8:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = acc
        # PROMOTE > 1: partial accumulators of one promotion interval (FP8 per-tensor / per-channel, see below)
        part = acc
        part_u = acc

        if A_SCALE == 3:
            a_s_ptrs = a_scale_ptr + a_rows.to(tl.int64) * stride_asm
            if B_SCALAR:  # the tile's weight rows lie in one GROUP_N block: one weight scale per K tile
                b_s_ptrs = b_scale_ptr + e64 * stride_bse + ((b_row0 - e * NW) // GROUP_N) * stride_bsn
                bu_s_ptrs = b_scale_ptr + e64 * stride_bse + ((b_row0 - e * NW + UP_OFF) // GROUP_N) * stride_bsn
            else:
                b_s_ptrs = b_scale_ptr + e64 * stride_bse + (offs_bn // GROUP_N) * stride_bsn
                bu_s_ptrs = b_scale_ptr + e64 * stride_bse + ((offs_bn + UP_OFF) // GROUP_N) * stride_bsn

        # SPLIT_K: this program's share of the K tiles (whole promotion intervals: the split is in K tiles of
        # PROMOTE, so an interval never straddles two programs)
        kt = tl.cdiv(K, BLOCK_K)
        k_lo = 0
        k_hi = kt
        if SPLIT_K > 1:
            if PROMOTE > 1:
                per = tl.cdiv(tl.cdiv(kt, SPLIT_K), PROMOTE) * PROMOTE
            else:
                per = tl.cdiv(kt, SPLIT_K)
            k_lo = tl.minimum(pid_k * per, kt)
            k_hi = tl.minimum(k_lo + per, kt)
            a_ptrs += k_lo * BLOCK_K * stride_ak
            b_ptrs += k_lo * BLOCK_K * stride_bk
            bu_ptrs += k_lo * BLOCK_K * stride_bk
        for kk in range(k_lo, k_hi):
            k0 = kk * BLOCK_K
            # ---- A tile [BM, BK]
            if TMA_A:
                a = a_desc.load([row0.to(tl.int32), k0])
            elif A_GATHER:
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=token_mask[:, None], other=0.0)
                else:
                    a = tl.load(a_ptrs, mask=token_mask[:, None] & (offs_k[None, :] < K - k0), other=0.0)
            else:
                if EVEN_K:
                    a = tl.load(a_ptrs)
                else:
                    a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
            # ---- B tile(s) [BK, BN]
            if TMA_B:
                if FUSE == 4:
                    b = tl.reshape(b_desc.load([(e * 2).to(tl.int32), b_row0, k0]), (2 * BLOCK_N, BLOCK_K)).T
                else:
                    b = b_desc.load([b_row0, k0]).T
                if FUSE == 1:
                    bu = b_desc.load([b_row0 + UP_OFF, k0]).T
                else:
                    bu = b
            else:
                if EVEN_K:
                    b = tl.load(b_ptrs)
                    if FUSE == 1:
                        bu = tl.load(bu_ptrs)
                    else:
                        bu = b
                else:
                    kmask = offs_k[:, None] < K - k0
                    b = tl.load(b_ptrs, mask=kmask, other=0.0)
                    if FUSE == 1:
                        bu = tl.load(bu_ptrs, mask=kmask, other=0.0)
                    else:
                        bu = b
            if A_SCALE == 4:
                # act_quant_kernel's QMODE 7 codes, sat(y * (1 / s)); a poisoned tensor's codes need no NaN: its
                # scale is NaN, so is every output (FINITE skips the NaN select)
                a = fp8e4m3_code(mul_rn(a.to(tl.float32), a_inv, EMU), EMU, FINITE=True).to(tl.float8e4nv,
                                                                                             bitcast=True)
            if EMU:
                if not INT8:
                    if a.dtype != tl.float8e4nv:
                        a = a.to(tl.float32)
                        b = b.to(tl.float32)
                        bu = bu.to(tl.float32)
            # ---- MMA
            if A_SCALE == 3:
                kg = k0 // GROUP_K
                a_s = tl.load(a_s_ptrs + kg * stride_ask, mask=token_mask, other=0.0)
                if SWAP_AB:
                    # W_tile @ A_tile^T: the same products and scale factors, in the same order ((dot * a_s) * b_s)
                    if B_SCALAR:
                        b_s = tl.load(b_s_ptrs + kg * stride_bsk)
                        acc += tl.dot(tl.trans(b), tl.trans(a)) * (a_s * b_s)[None, :]
                        if FUSE == 1:
                            bu_s = tl.load(bu_s_ptrs + kg * stride_bsk)
                            acc_u += tl.dot(tl.trans(bu), tl.trans(a)) * (a_s * bu_s)[None, :]
                    else:
                        b_s = tl.load(b_s_ptrs + kg * stride_bsk)
                        acc += tl.dot(tl.trans(b), tl.trans(a)) * a_s[None, :] * b_s[:, None]
                        if FUSE == 1:
                            bu_s = tl.load(bu_s_ptrs + kg * stride_bsk)
                            acc_u += tl.dot(tl.trans(bu), tl.trans(a)) * a_s[None, :] * bu_s[:, None]
                elif B_SCALAR:
                    b_s = tl.load(b_s_ptrs + kg * stride_bsk)
                    acc += tl.dot(a, b) * (a_s * b_s)[:, None]
                    if FUSE == 1:
                        bu_s = tl.load(bu_s_ptrs + kg * stride_bsk)
                        acc_u += tl.dot(a, bu) * (a_s * bu_s)[:, None]
                else:
                    b_s = tl.load(b_s_ptrs + kg * stride_bsk)
                    acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
                    if FUSE == 1:
                        bu_s = tl.load(bu_s_ptrs + kg * stride_bsk)
                        acc_u += tl.dot(a, bu) * a_s[:, None] * bu_s[None, :]
            else:
                if INT8:
                    acc = tl.dot(a, b, acc, out_dtype=tl.int32)
                    if FUSE == 1:
                        acc_u = tl.dot(a, bu, acc_u, out_dtype=tl.int32)
                elif PROMOTE == 0:  # in place (bf16 / fp16 / fp32; FP8 only as the FAST_ACCUM opt-in)
                    acc = _mma(a, b, acc, SWAP_AB, DOT_PREC)
                    if FUSE == 1:
                        acc_u = _mma(a, bu, acc_u, SWAP_AB, DOT_PREC)
                elif PROMOTE == 1:  # FP8, one K tile per promotion interval
                    acc += _mma(a, b, tl.zeros_like(acc), SWAP_AB, DOT_PREC)
                    if FUSE == 1:
                        acc_u += _mma(a, bu, tl.zeros_like(acc_u), SWAP_AB, DOT_PREC)
                else:
                    # FP8: the sm_90 wgmma accumulator keeps ~14 mantissa bits, so PROMOTE K tiles are chained in a
                    # partial accumulator (one asynchronous wgmma chain: its only reader is the next dot or the
                    # `if`, which Triton's wgmma pipeliner allows) and added to the fp32 accumulator at the
                    # interval's end (the wait for the chain happens there, once per interval)
                    part = _mma(a, b, part, SWAP_AB, DOT_PREC)
                    if FUSE == 1:
                        part_u = _mma(a, bu, part_u, SWAP_AB, DOT_PREC)
                    if kk % PROMOTE == PROMOTE - 1:
                        acc += part
                        part = tl.zeros_like(part)
                        if FUSE == 1:
                            acc_u += part_u
                            part_u = tl.zeros_like(part_u)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
            bu_ptrs += BLOCK_K * stride_bk

        if PROMOTE > 1:  # the last, partial interval (zeros when the K tiles fill whole intervals)
            acc += part
            if FUSE == 1:
                acc_u += part_u
        is_last = True
        if SPLIT_K > 1:
            # one slot per (row tile, N tile); N_TILES may run past the last N tile (wrapped, never stored), so a
            # row tile's slots span whole groups of N_TILES
            slots_per_row = tl.cdiv(tl.cdiv(N, BLOCK_N), N_TILES) * N_TILES
            acc, is_last = _split_k_reduce(acc, part_ptr, cnt_ptr, tile_id * slots_per_row + pid_n, pid_k, SPLIT_K)
        if SWAP_AB:  # back to [rows, columns] for the epilogue
            acc = tl.trans(acc)
            if FUSE == 1:
                acc_u = tl.trans(acc_u)
            else:
                acc_u = acc

        # ---- epilogue: dequantize, bias, (activation), round, (quantize), store
        accf = acc.to(tl.float32)
        accu = acc_u.to(tl.float32)
        if A_SCALE == 1:
            sa = tl.load(a_scale_ptr)
            accf = accf * sa
            accu = accu * sa
        elif A_SCALE == 4:
            accf = accf * a_s
            accu = accu * a_s
        elif A_SCALE == 2:
            sa = tl.load(a_scale_ptr + a_rows.to(tl.int64) * stride_asm, mask=token_mask, other=0.0)
            accf = accf * sa[:, None]
            accu = accu * sa[:, None]
        if B_SCALE == 1:
            sb = tl.load(b_scale_ptr + e64 * stride_bse)
            accf = accf * sb
            accu = accu * sb
        elif B_SCALE == 2:
            sb = tl.load(b_scale_ptr + e64 * stride_bse + offs_bn * stride_bsn)
            accf = accf * sb[None, :]
            if FUSE == 1:
                sbu = tl.load(b_scale_ptr + e64 * stride_bse + (offs_bn + UP_OFF) * stride_bsn)
                accu = accu * sbu[None, :]
        if HAS_BIAS:
            accf = accf + tl.load(bias_ptr + e64 * stride_biase + offs_bn * stride_biasn).to(tl.float32)[None, :]
            if FUSE == 1:
                accu = accu + tl.load(bias_ptr + e64 * stride_biase + (offs_bn + UP_OFF) * stride_biasn
                                      ).to(tl.float32)[None, :]

        if FUSE == 0:
            y = to_act(accf, ACT_DT, EMU)
        else:
            if FUSE == 2:
                g, u = tl.split(tl.reshape(accf, (BLOCK_M, BLOCK_N, 2)))
            elif FUSE == 4:
                g, u = tl.split(tl.permute(tl.reshape(accf, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
            elif FUSE == 1:
                g = accf
                u = accu
            else:
                g = accf
                u = accf
            # GEMM1 rounding point (h), then the activation in fp32 and its rounding point (g)
            g = act_rounded(g, ACT_DT, EMU, PACK_ROUND)
            u = act_rounded(u, ACT_DT, EMU, PACK_ROUND)
            y = to_act(apply_act(g, u, ACT, alpha, beta, limit, HAS_LIMIT), ACT_DT, EMU)

        offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_cn < N
        if C_SORTED:
            c_rows = offs_m
            row_mask = offs_m >= 0
        else:
            c_rows = offs_token
            row_mask = token_mask
        if SPLIT_K > 1:  # only the program that summed the partials stores
            row_mask = row_mask & is_last
        c_ptrs = c_ptr + c_rows[:, None].to(tl.int64) * stride_cm + offs_cn[None, :] * stride_cn
        if OUT_QUANT == 2:
            # the dynamic per-tensor requantization's first pass (act_quant_kernel QMODE 6) on the values stored:
            # the largest finite |y| of the tile's routed rows and whether any is NaN / inf, folded by atomic max
            # (one per program; the zeros were written before the launch)
            tl.store(c_ptrs, y, mask=row_mask[:, None] & n_mask[None, :])
            ok = (token_mask & row_mask)[:, None] & n_mask[None, :]
            amax, nbad = tile_amax(tl.where(ok, y.to(tl.float32), 0.0))
            tl.atomic_max(cs_ptr, tl.max(amax, axis=0))
            tl.atomic_max(cs_ptr + stride_csg, (tl.max(nbad, axis=0) > 0).to(tl.float32))
        elif OUT_QUANT == 3:
            # the same amax and flag, stored in this tile's own slot (row tile, N tile): no atomics, no zeros
            # before the launch (every slot is written by its tile, or by fused_moe_kernel for a tile it skips)
            tl.store(c_ptrs, y, mask=row_mask[:, None] & n_mask[None, :])
            ok = (token_mask & row_mask)[:, None] & n_mask[None, :]
            amax, nbad = tile_amax(tl.where(ok, y.to(tl.float32), 0.0))
            slot = tile_id.to(tl.int64) * (tl.cdiv(tl.cdiv(N, BLOCK_N), N_TILES) * N_TILES) + pid_n
            bad = (tl.max(nbad, axis=0) > 0).to(tl.float32)
            if SPLIT_K > 1:  # one store per tile: by the program that summed the partials
                tl.store(cs_ptr + slot * stride_csm, tl.max(amax, axis=0), mask=is_last)
                tl.store(cs_ptr + slot * stride_csm + stride_csg, bad, mask=is_last)
            else:
                tl.store(cs_ptr + slot * stride_csm, tl.max(amax, axis=0))
                tl.store(cs_ptr + slot * stride_csm + stride_csg, bad)
        elif OUT_QUANT:
            yq = tl.where(n_mask[None, :], y.to(tl.float32), 0.0)
            codes, s = fp8_quant_rows(yq, amax_floor, ue8m0_floor, USE_UE8M0, UE8M0_EXACT, SCALE_INV, RECIP_MUL, EMU)
            tl.store(c_ptrs, codes, mask=row_mask[:, None] & n_mask[None, :])
            tl.store(cs_ptr + c_rows.to(tl.int64) * stride_csm + pid_n * stride_csg, s,
                     mask=row_mask & (pid_n * BLOCK_N < N))
        else:
            tl.store(c_ptrs, y, mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _slots_amax(slots_ptr, num_slots, stride_slot, stride_flag, BLOCK: tl.constexpr):
    """GEMM1's amax slots (``OUT_QUANT`` 3: ``[amax, non-finite flag]`` per tile) reduced: ``(amax, flag)``, the
    largest finite |value| of the routed rows and whether any was NaN / inf (the values ``act_quant_kernel``'s
    QMODE 6 pass folds into its ``stat``)."""
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    bad = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, num_slots, BLOCK):
        offs = (i + tl.arange(0, BLOCK)).to(tl.int64)
        m = offs < num_slots
        amax = tl.maximum(amax, tl.load(slots_ptr + offs * stride_slot, mask=m, other=0.0))
        bad = tl.maximum(bad, tl.load(slots_ptr + offs * stride_slot + stride_flag, mask=m, other=0.0))
    return tl.max(amax, axis=0), tl.max(bad, axis=0)


@triton.jit
def _slots_tensor_scale(slots_ptr, num_slots, stride_slot, stride_flag, BLOCK: tl.constexpr):
    """The dynamic per-tensor FP8 scale from GEMM1's amax slots (see :func:`_slots_amax`): ``(s, 1 / s)`` with
    ``s = amax / 448`` (``1 / s`` = 0 when ``s`` = 0; ``s`` NaN when a value was NaN / inf), as
    ``act_quant_kernel``'s QMODE 7 finds them from its ``stat``."""
    amax_all, bad = _slots_amax(slots_ptr, num_slots, stride_slot, stride_flag, BLOCK)
    s = tl.math.div_rn(amax_all, 448.0)
    inv = tl.where(s == 0, 0.0, tl.math.div_rn(1.0, s))
    s = tl.where(bad > 0, float("nan"), s)
    return s, inv


@triton.jit
def _split_k_reduce(acc, part_ptr, cnt_ptr, slot, pid_k, SPLIT_K: tl.constexpr):
    """``SPLIT_K``: store this program's fp32 partial ``acc`` of output tile ``slot`` in ``part[slot, pid_k]``;
    the last of the tile's ``SPLIT_K`` programs to arrive (counted in ``cnt[slot]``, int32, zero before the
    launch and set back to zero by that program) sums the partials in split order (the same bits whichever program
    is last) and returns ``(sum, True)``; the others return ``(acc, False)`` and store nothing after."""
    R: tl.constexpr = acc.shape[0]
    C: tl.constexpr = acc.shape[1]
    offs = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    base = part_ptr + slot.to(tl.int64) * (SPLIT_K * R * C)
    tl.store(base + pid_k * (R * C) + offs, acc)
    # every thread's part of the partial is stored before the release (a CTA barrier, then one thread's gpu-scope
    # acq_rel atomic: CUTLASS's semaphore pattern); its result reaches the other threads through shared memory
    # behind a barrier, so the loads below see the other programs' partials
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr + slot, 1, sem="acq_rel", scope="gpu")
    is_last = done == SPLIT_K - 1
    if is_last:
        tl.store(cnt_ptr + slot, 0)
        acc = tl.load(base + offs, cache_modifier=".cg")  # at L2, where the other programs' partials are
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.load(base + s * (R * C) + offs, cache_modifier=".cg")
    return acc, is_last


@triton.jit
def _zero_slots(cs_ptr, pid_m, pid_ng, pid_k, N, stride_csm, stride_csg, BLOCK_N: tl.constexpr,
                N_TILES: tl.constexpr, OUT_QUANT: tl.constexpr):
    """``OUT_QUANT`` 3: the amax slots of the tiles a program skips (no routes here) are zeros (one split writes)."""
    if OUT_QUANT == 3:
        if pid_k == 0:
            base = pid_m.to(tl.int64) * (tl.cdiv(tl.cdiv(N, BLOCK_N), N_TILES) * N_TILES) + pid_ng * N_TILES
            for j in tl.static_range(N_TILES):
                tl.store(cs_ptr + (base + j) * stride_csm, 0.0)
                tl.store(cs_ptr + (base + j) * stride_csm + stride_csg, 0.0)


@triton.jit(do_not_specialize=["EM", "num_valid_tokens", "num_a_slots"])
def fused_moe_kernel(
    # operands (experts.launch_gemm's GemmOperands), split-K scratch (part, cnt), TMA descriptors (or None)
    a_ptr, b_ptr, c_ptr, cs_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, part_ptr, cnt_ptr,
    a_desc, a_desc_h, b_desc,
    # the route layout (align.RouteLayout; tiles / num_tiles used with HALF_TAIL)
    sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr, tiles_ptr, num_tiles_ptr,
    # sizes (num_a_slots: A's amax slots with A_SCALE 4)
    N, K, EM, num_valid_tokens, UP_OFF, NW, num_a_slots,
    # strides: A, W, C; A's scales, W's scales, bias; C's scales
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk, stride_biase, stride_biasn,
    stride_csm, stride_csg,
    # epilogue scalars: the activation's parameters, the output quantization's floors
    alpha, beta, limit, amax_floor, ue8m0_floor,
    # constexprs: tiling and scheduling
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HALF_TAIL: tl.constexpr, N_TILES: tl.constexpr, FLATTEN: tl.constexpr, SPLIT_K: tl.constexpr,
    # rows (GemmShape)
    TOP_K: tl.constexpr, A_GATHER: tl.constexpr, C_SORTED: tl.constexpr,
    # operands and accumulation (GemmScales: A_SCALE / B_SCALE are host.ScaleMode values)
    A_SCALE: tl.constexpr, B_SCALE: tl.constexpr, B_SCALAR: tl.constexpr, GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr, INT8: tl.constexpr, PROMOTE: tl.constexpr, SWAP_AB: tl.constexpr, DOT_PREC: tl.constexpr,
    EVEN_K: tl.constexpr, TMA_A: tl.constexpr, TMA_B: tl.constexpr, EMU: tl.constexpr,
    # epilogue (GemmEpilogue: FUSE is a host.Fusion value)
    HAS_BIAS: tl.constexpr, FUSE: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, ACT_DT: tl.constexpr,
    OUT_QUANT: tl.constexpr, USE_UE8M0: tl.constexpr, UE8M0_EXACT: tl.constexpr, SCALE_INV: tl.constexpr,
    RECIP_MUL: tl.constexpr,
    # programmatic dependent launch
    PDL_TRIGGER: tl.constexpr, PDL_WAIT: tl.constexpr,
    # decode without a route layout (ROUTE_TILES): the local expert of each route out (GEMM1), the id space
    local_ptr=None, num_ids=0, ROUTE_TILES: tl.constexpr = 0,
    # the gated epilogue's bf16 roundings two values an instruction (jit.act_rounded; the same bits)
    PACK_ROUND: tl.constexpr = 0,
):
    """The grouped expert GEMM: ``C[rows, n] = epilogue(A[rows] @ W[e, n, :]^T)`` over the route layout.

    Rows: ``sorted_token_ids`` (flat route ids, ``>= num_valid_tokens`` = padding), cut into tiles of one expert.
    Without ``HALF_TAIL`` the tiles are the layout's ``BLOCK_M`` blocks (``EM`` rows at most,
    ``num_tokens_post_padded`` used). With ``HALF_TAIL`` the layout's blocks are ``BLOCK_M / 2`` rows and the tiles
    come from ``tiles`` (``align_routes(..., tiles=True)``: ``first_block * 2 + full``; ``EM`` = its length,
    ``num_tiles`` used): a full tile is ``BLOCK_M`` rows, an expert's odd last block a ``BLOCK_M / 2``-row tile, so
    an expert pads to ``BLOCK_M / 2`` rows while its other tiles keep the larger MMA shape (one launch, the tail
    next to its expert's full tiles so their weight tiles are still in L2). ``a_desc_h``: A's TMA descriptor of
    ``BLOCK_M / 2``-row boxes.
    ``A_GATHER``: A row = route // TOP_K (GEMM1 reads hidden states), else A row = sorted position (GEMM2 reads
    GEMM1's sorted output). ``C_SORTED``: C row = sorted position (GEMM1), else the route id (GEMM2).
    ``N`` = output columns; ``NW`` = weight rows per expert (``2N`` when the gated activation is fused).
    ``FUSE`` (``host.Fusion``): 0 ``NONE`` plain; 1 ``GATED`` gate / up halves (gate row n, up row ``UP_OFF + n``;
    two MMA chains); 2 ``INTERLEAVED`` gated interleaved (rows 2n, 2n+1); 3 ``ACT`` non-gated activation on the
    tile; 4 ``GATED_JOINT`` gated halves as one ``[2 * BLOCK_N]`` weight tile (the N tile's gate rows, then its up
    rows: one MMA chain twice as wide, split in the epilogue; ``b_desc`` is then a rank-3 descriptor over the
    ``(E * 2, N, K)`` halves).
    ``A_SCALE`` (``host.ScaleMode``): 0 none, 1 per-tensor scalar, 2 per row, 3 per row and ``GROUP_K`` group of K;
    4 (``TENSOR_SLOTS``) A in the activation dtype, quantized to FP8 as each tile is loaded with one dynamic
    per-tensor scale reduced from ``num_a_slots`` amax slots at ``a_scale`` (GEMM1's ``OUT_QUANT`` 3; strides
    ``stride_asm`` per slot, ``stride_ask`` to the flag): the requantization between the GEMMs without a kernel.
    ``B_SCALE``: 0 none, 1 per expert, 2 per expert and output channel, 3 per ``GROUP_N x GROUP_K`` block
    (``B_SCALAR``: the tile's weight rows, and its up rows, lie inside one ``GROUP_N`` block).
    ``OUT_QUANT``: 1 quantize the output tile to FP8 with one scale per row (group = ``BLOCK_N`` columns); 2
    (``host.OUT_AMAX``) store it and fold its routed rows' amax and non-finite flag into ``cs[0, 0:2]``; 3
    (``host.OUT_AMAX_SLOTS``) store it and write that amax and flag to the tile's own slot ``cs[slot, 0:2]``, slot =
    row tile * (N tiles per row tile, wrapped ones included) + N tile (``num_a_slots`` of GEMM2 = their count;
    skipped tiles write zeros, so nothing is zeroed before the launch).
    ``N_TILES``: a program computes that many consecutive N tiles of its rows in turn (``FLATTEN``: as one
    flattened, software-pipelined loop); N tiles past ``N`` are computed on wrapped columns and not stored.
    ``PROMOTE`` (FP8 per-tensor / per-channel operands, ``A_SCALE`` 1 or 2, not ``INT8``): K tiles accumulated in
    the MMA accumulator before it is added to the fp32 accumulator (``PROMOTE * BLOCK_K`` K elements per promotion
    interval, as DeepGEMM / CUTLASS promote every 128 K elements: on sm_90 the FP8 wgmma accumulator keeps about 14
    mantissa bits, DeepSeek-V3 technical report 3.3.2); 0 = every K tile accumulated in place, the fast-accumulation
    form of vLLM's ``fused_moe_kernel`` (only the ``FAST_ACCUM`` opt-in, and every non-FP8 GEMM, launch it). Block
    FP8 (``A_SCALE`` 3) is promoted per K tile with its scales, INT8 accumulates exactly in int32.
    ``SWAP_AB`` (FP8 only, not ``INT8``): each K tile computed as ``W_tile @ A_tile^T`` (the weight rows on the MMA's M, the
    tile's few token rows on its N, as vLLM 0.33's ``SWAP_AB`` for ``BLOCK_M < 64``): a 16-row decode tile then runs
    on FP8 wgmma instead of mma.sync on FP8 converted to fp16; the accumulator is transposed back for the epilogue.
    ``SPLIT_K`` (not with ``FUSE`` 1 nor ``INT8``): ``SPLIT_K`` programs per output tile, each over a contiguous
    share of the K tiles (whole ``PROMOTE`` intervals); each stores its fp32 partial in ``part`` and the last one to
    finish (counted in ``cnt``: one int32 per (row tile, N tile), zeros) sums them in split order and runs the
    epilogue (see :func:`_split_k_reduce`). For decode GEMMs with few (expert, N tile) programs and a long K.
    ``PDL_TRIGGER``: let the next kernel (launched with programmatic dependent launch) start once every program has
    started. ``PDL_WAIT`` (this kernel launched so): wait for the previous kernel before reading anything it wrote
    (A, A's scales; the layout was written before it).
    ``ROUTE_TILES`` (decode, ``M * topk <= E``; 1, or 2 with an expert map): no route layout: row tile ``t`` is route
    ``t`` alone (its first row; ``EM = M * topk * BLOCK_M``), ``sorted_token_ids`` is ``topk_ids`` (flat) and
    ``expert_ids`` the expert map (2), the tile's expert read from them (ids outside ``[0, num_ids)`` and those the map
    drops: -1, the tile skipped); GEMM1 (``C_SORTED``) writes each route's local expert to ``local``.
    """
    if PDL_TRIGGER:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    # SPLIT_K programs per output tile, adjacent in the grid (dispatched together)
    pid_k = pid % SPLIT_K
    pid = pid // SPLIT_K
    if HALF_TAIL:
        num_pid_m = EM
    else:
        num_pid_m = tl.cdiv(EM, BLOCK_M)
    num_pid_n = tl.cdiv(tl.cdiv(N, BLOCK_N), N_TILES)  # groups of N_TILES N tiles
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    # the bookkeeping loads are issued together, before the branches that use them (at decode the dependent chain
    # of global loads is a visible part of a program's life)
    if HALF_TAIL:
        num_tiles = tl.load(num_tiles_ptr)
        tile = tl.load(tiles_ptr + pid_m)  # pid_m < EM = the list's length; entries past num_tiles are not used
        if pid_m >= num_tiles:
            _zero_slots(cs_ptr, pid_m, pid_n, pid_k, N, stride_csm, stride_csg, BLOCK_N, N_TILES, OUT_QUANT)
            return
        block = tile // 2
        row0 = block * (BLOCK_M // 2)
        e = tl.load(expert_ids_ptr + block)
        half = 1 - tile % 2  # the list's entries are first_block * 2 + full: 1 = a BLOCK_M / 2-row tail tile
    elif ROUTE_TILES:
        # pid_m < M * topk (the grid's row tiles): route pid_m's local expert (sorted_token_ids: topk_ids, expert_ids:
        # the map)
        _, le = route_local_experts(sorted_token_ids_ptr, expert_ids_ptr, pid_m + tl.arange(0, 1), num_valid_tokens,
                                    num_ids, ROUTE_TILES == 2)
        e = tl.max(le, axis=0)
        if PDL_WAIT:
            # a skipped program waits too (GEMM2: if every route is dropped here, expert parallelism at M = 1, no
            # program would, GEMM2 could finish before GEMM1, and the top-k sum, which waits for GEMM2 only, would
            # read local ids GEMM1 has not written yet); and GEMM1 (launched so after the input quantizer under
            # STEP_PDL) writes nothing before its wait
            gdc_wait()
        if C_SORTED:  # GEMM1: the route's local expert, for the requantization and the top-k sum after it
            tl.store(local_ptr + pid_m, e, mask=(pid_n == 0) & (pid_k == 0))
        if e < 0:
            _zero_slots(cs_ptr, pid_m, pid_n, pid_k, N, stride_csm, stride_csg, BLOCK_N, N_TILES, OUT_QUANT)
            return
        row0 = pid_m * BLOCK_M
        half = 0
    else:
        ntpp = tl.load(num_tokens_post_padded_ptr)
        e = tl.load(expert_ids_ptr + pid_m)  # pid_m < cdiv(EM, BLOCK_M) = the layout's block count
        if pid_m * BLOCK_M >= ntpp or e < 0:
            _zero_slots(cs_ptr, pid_m, pid_n, pid_k, N, stride_csm, stride_csg, BLOCK_N, N_TILES, OUT_QUANT)
            return
        row0 = pid_m * BLOCK_M
        half = 0
    if PDL_WAIT:
        gdc_wait()
    # one call site, instantiated per tile height: BLOCK_M rows (HALF 0), and with HALF_TAIL the BLOCK_M / 2-row
    # tails (HALF 1, A's descriptor of half-height boxes)
    for HALF in tl.static_range(2 if HALF_TAIL else 1):
        if half == HALF:
            _moe_tile(a_ptr, b_ptr, c_ptr, cs_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, part_ptr, cnt_ptr,
                      a_desc_h if HALF else a_desc, b_desc,
                      sorted_token_ids_ptr, row0, e, pid_n, pid_m, pid_k,
                      N, K, num_valid_tokens, UP_OFF, NW, num_a_slots,
                      stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                      stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk, stride_biase, stride_biasn,
                      stride_csm, stride_csg,
                      alpha, beta, limit, amax_floor, ue8m0_floor,
                      BLOCK_M // (1 + HALF), BLOCK_N, BLOCK_K, N_TILES, FLATTEN, SPLIT_K,
                      TOP_K, A_GATHER, C_SORTED,
                      A_SCALE, B_SCALE, B_SCALAR, GROUP_N, GROUP_K, INT8, PROMOTE, SWAP_AB, DOT_PREC,
                      EVEN_K, TMA_A, TMA_B, EMU,
                      HAS_BIAS, FUSE, ACT, HAS_LIMIT, ACT_DT, OUT_QUANT, USE_UE8M0, UE8M0_EXACT, SCALE_INV, RECIP_MUL,
                      ROUTE_TILES, PACK_ROUND)


@triton.jit
def _act_load(x_ptr, row64, cols, mask, stride_xm, UP_OFF, alpha, beta, limit,
              SPLIT: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, ACT_DT: tl.constexpr,
              EMU: tl.constexpr):
    return _act_load_at(x_ptr + row64[:, None] * stride_xm, cols[None, :], mask, UP_OFF, alpha, beta, limit,
                        SPLIT, ACT, HAS_LIMIT, ACT_DT, EMU)


@triton.jit
def _act_load_at(base, cols, mask, UP_OFF, alpha, beta, limit,
                 SPLIT: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, ACT_DT: tl.constexpr,
                 EMU: tl.constexpr):
    """The activation (rounded to ``ACT_DT``, as fp32; 0 where masked) of the output columns ``cols`` at the row
    pointers ``base`` (any broadcastable shapes), reading gate / up as ``SPLIT`` says."""
    if SPLIT == 1:
        g = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(base + (UP_OFF + cols), mask=mask, other=0.0).to(tl.float32)
    elif SPLIT == 2:
        g = tl.load(base + 2 * cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(base + (2 * cols + 1), mask=mask, other=0.0).to(tl.float32)
    else:
        g = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        u = g
    y = to_act(apply_act(g, u, ACT, alpha, beta, limit, HAS_LIMIT), ACT_DT, EMU).to(tl.float32)
    return tl.where(mask, y, 0.0)


@triton.jit
def _tile_amax3(y):
    """Per row of a ``[rows, chunks, cols]`` tile: (largest finite |y|, count of NaN / inf)."""
    ay, bad = finite_abs(y)
    return tl.max(tl.max(ay, axis=2), axis=1), tl.sum(tl.sum(bad, axis=2), axis=1)


@triton.jit
def _row_scale(amax, nbad, min_token_scale, QMODE: tl.constexpr):
    """Per row of ``act_quant_kernel``'s row modes: ``(scale, multiplier)``. FP8 (``QMODE`` 2): ``max(amax / 448,
    1 / (448 * 512))``, NaN for a row holding NaN / inf, and its reciprocal; INT8 (3): ``amax / 127`` and the
    kernel's ``127 / amax``."""
    if QMODE == 2:
        s = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), min_token_scale)
        s = tl.where(nbad > 0, float("nan"), s)
        mult = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)  # the reciprocal (FAST_DIV's)
    else:  # QMODE == 3
        s = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
        # the kernel's tmp_scale = 127 / absmax, one IEEE division (reference: rdiv(127.0, absmax))
        mult = tl.where(amax == 0, 0.0, tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32), amax))
    return s, mult


@triton.jit
def _row_codes(y, s, mult, bad, QMODE: tl.constexpr, EMU: tl.constexpr, FAST_DIV: tl.constexpr = False):
    """The per-row codes of ``act_quant_kernel``'s row modes (``s`` / ``mult`` / ``bad``: the row's scale,
    multiplier (FP8: the reciprocal) and poisoned flag, broadcastable to ``y``): FP8 ``sat(y / s)`` with a poisoned
    row's NaN codes (``QMODE`` 2; ``FAST_DIV``: ``jit.div_rn_by_scale``'s FAST form), or INT8 ``y * mult`` (3)."""
    if QMODE == 2:
        codes = fp8e4m3_code(div_rn_by_scale(y, tl.broadcast_to(s, y.shape), tl.broadcast_to(mult, y.shape), EMU,
                                             FAST_DIV), EMU)
        codes = tl.where(bad, 0x7F, codes.to(tl.int32)).to(tl.uint8)
    else:
        codes = int8_code(mul_rn(y, tl.broadcast_to(mult, y.shape), EMU), EMU)
    return codes


@triton.jit(do_not_specialize=["R", "num_valid"])
def act_quant_kernel(
    x_ptr, y_ptr, ys_ptr, stat_ptr, a2s_ptr,
    sorted_ids_ptr, expert_ids_ptr, ntpp_ptr, local_ptr, inv_ptr,
    R, NC, num_valid, UP_OFF, NUM_E,
    stride_xm, stride_ym, stride_ysm, stride_ysg,
    alpha, beta, limit, amax_floor, ue8m0_floor, min_token_scale,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BS: tl.constexpr, SORTED: tl.constexpr,
    ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, SPLIT: tl.constexpr, QMODE: tl.constexpr, ACT_DT: tl.constexpr,
    USE_UE8M0: tl.constexpr, UE8M0_EXACT: tl.constexpr, SCALE_INV: tl.constexpr, RECIP_MUL: tl.constexpr,
    EMU: tl.constexpr, PDL: tl.constexpr = False, ONE_PASS: tl.constexpr = False, TRIGGER: tl.constexpr = False,
    ROUTES: tl.constexpr = False, SLOTS: tl.constexpr = False, num_slots=0, SKIP_PAD: tl.constexpr = False,
    ROW_CHUNKS: tl.constexpr = 1, ROW_TAIL: tl.constexpr = 0, FAST_DIV: tl.constexpr = False,
):
    """Activation (``ACT``; ``ACT_NONE`` = copy) of ``NC`` output columns per row, rounded to ``ACT_DT``, then stored
    as ``ACT_DT`` or quantized (``QMODE``). Rows are ``[0, R)`` or, with ``SORTED``, the sorted positions below
    ``num_tokens_post_padded`` (padding rows are processed too, unless ``ROUTES``; they are excluded from
    per-tensor amax).
    ``PDL`` (launched with programmatic dependent launch, between the two GEMMs): let the next kernel start early,
    and wait for the previous one before reading its output. ``ONE_PASS`` (row modes 2 / 3 / 6): the tile holds
    the whole row (``NC <= BLOCK_C``), or for the per-tensor amax (6) this program's column chunk (grid axis 1), so
    it is loaded (and its activation computed) once instead of once per pass. ``TRIGGER`` (an input quantizer,
    ``host.STEP_PDL``): let a kernel launched with programmatic dependent launch after this one start now.
    ``ROUTES`` (with ``SORTED``; decode, where most rows of the layout are padding): the program's rows are routes
    ``[0, num_valid)``, each processed at its row ``inv_ptr[r]`` of the layout when held here (``local_ptr[r] >=
    0``); padding rows are not written (GEMM2 computes them and stores none of them: rows of an MMA are
    independent).
    ``SLOTS`` (QMODE 7): the per-tensor amax and flag are GEMM1's ``num_slots`` amax slots at ``stat_ptr`` (``OUT_QUANT``
    3; slot ``i``'s amax at ``i``, its flag at ``NUM_E + i``), reduced by every program, instead of the QMODE 6
    pass's ``stat``: the requantization in one pass.
    ``SKIP_PAD`` (row modes 2 / 3 with ``SORTED``, not ``ROUTES``; prefill): padding rows are neither read nor
    written (GEMM2 computes them and stores none of them, as under ``ROUTES``); the layout's ids are loaded beside
    ``num_tokens_post_padded``.
    ``ROW_CHUNKS`` > 1 (row modes 2 / 3, the whole row in one pass): the tile is ``[BLOCK_R, ROW_CHUNKS, BLOCK_C]``,
    the row's ``ROW_CHUNKS`` chunks of ``BLOCK_C`` (= 32 lanes x 8) columns on a middle axis. Triton's coalescing
    orders the axes by contiguity, ties by index, so after a chunk's columns the warps go to the rows before the
    chunks: a row spans fewer warps than in a ``[BLOCK_R, BLOCK_C]`` tile, whose 768-column row spans four (Triton
    3.6, sm_90, 4 rows of 768: the bf16 loads' layout puts the warps on the rows, the uint8 stores' 16-byte vectors
    2 x 2 over rows and chunks, so the main tile's amax still crosses two warps and its codes pass through shared
    memory; the tail tile's reductions are within a warp). ``ROW_TAIL`` (a power of two or 0): that many more chunks
    after them, as a second tile (a row of 768 columns: 2 + 1 chunks instead of 4, of which one would be masked).
    ``FAST_DIV`` (QMODE 2, bf16 / fp16 rows): the codes' division in ``jit.div_rn_by_scale``'s FAST form (the same
    codes)."""
    if PDL or TRIGGER:
        gdc_launch_dependents()
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    if ROUTES:
        r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        if ROUTES == 2 and PDL:  # ROUTE_TILES: the local ids are GEMM1's output (else the layout's, written before)
            gdc_wait()
        held = (r < num_valid) & (tl.load(local_ptr + r, mask=r < num_valid, other=-1) >= 0)
        if ROUTES == 2:  # ROUTE_TILES: route r's row is r * BS
            rows = r * BS
        else:
            rows = tl.load(inv_ptr + r, mask=held, other=0)
    else:
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row64 = rows.to(tl.int64)
    if ROUTES:
        rmask = held
        route_ok = held
    else:
        if SORTED and not PDL and (QMODE == 0 or QMODE == 1 or QMODE == 4 or QMODE == 5 or QMODE == 7):
            # the tile is loaded before the test against num_tokens_post_padded, so that the two loads' latencies
            # overlap (rows at or past it are never stored; rows are quantized independently)
            y = _act_load(x_ptr, row64, cols, (rows < R)[:, None] & (cols < NC)[None, :], stride_xm, UP_OFF, alpha,
                          beta, limit, SPLIT, ACT, HAS_LIMIT, ACT_DT, EMU)
        if SORTED:
            if SKIP_PAD:  # the layout's (written before GEMM1): issued beside ntpp's load
                pad = tl.load(sorted_ids_ptr + rows, mask=rows < R, other=num_valid) >= num_valid
            ntpp = tl.load(ntpp_ptr)
            if pid_r * BLOCK_R >= ntpp:
                return
            rmask = rows < ntpp
            if SKIP_PAD:
                rmask = rmask & ~pad
            if QMODE == 6:  # only the per-tensor amax asks which positions hold routes (one dependent load fewer)
                route_ok = rmask & (tl.load(sorted_ids_ptr + rows, mask=rmask, other=num_valid) < num_valid)
        else:
            rmask = rows < R
            route_ok = rmask
    if PDL:  # everything read from here on (x) is the previous kernel's output
        gdc_wait()
    ex = rows * 0  # one dynamic per-tensor scale over all routed rows (slot 0 of stat)
    y_rows = y_ptr + row64[:, None] * stride_ym
    if QMODE == 0 or QMODE == 1 or QMODE == 4 or QMODE == 5 or QMODE == 7:
        mask = rmask[:, None] & (cols < NC)[None, :]
        if PDL or not SORTED or ROUTES:
            y = _act_load(x_ptr, row64, cols, mask, stride_xm, UP_OFF, alpha, beta, limit,
                          SPLIT, ACT, HAS_LIMIT, ACT_DT, EMU)
        if QMODE == 0:
            tl.store(y_rows + cols[None, :], to_act(y, ACT_DT, EMU), mask=mask)
        elif QMODE == 1:
            codes, s = fp8_quant_rows(y, amax_floor, ue8m0_floor, USE_UE8M0, UE8M0_EXACT, SCALE_INV, RECIP_MUL, EMU)
            tl.store(y_rows + cols[None, :], codes, mask=mask)
            tl.store(ys_ptr + row64 * stride_ysm + pid_c * stride_ysg, s, mask=rmask)
        elif QMODE == 4:
            s = tl.load(a2s_ptr + tl.arange(0, 1)).to(tl.float32)
            inv = tl.math.div_rn(tl.full([1], 1.0, tl.float32), s)
            tl.store(y_rows + cols[None, :], fp8e4m3_code(mul_rn(y, tl.broadcast_to(inv[None, :], y.shape), EMU), EMU),
                     mask=mask)
        elif QMODE == 5:
            s = tl.load(a2s_ptr + tl.arange(0, 1)).to(tl.float32)
            tl.store(y_rows + cols[None, :], int8_code(tl.math.div_rn(y, tl.broadcast_to(s[None, :], y.shape)), EMU),
                     mask=mask)
        else:  # QMODE == 7: dynamic per-tensor scale from pass 1 (or from GEMM1's slots)
            if SLOTS:
                amax_all, bad_all = _slots_amax(stat_ptr, num_slots, 1, NUM_E, 2 if EMU else 1024)
                amax = tl.where(rmask, amax_all, 0.0)
                bad = tl.where(rmask, bad_all, 0.0) > 0
            else:
                amax = tl.load(stat_ptr + ex, mask=rmask, other=0.0)
                bad = tl.load(stat_ptr + NUM_E + ex, mask=rmask, other=0.0) > 0
            s = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
            inv = tl.where(s == 0, 0.0, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s))
            codes = fp8e4m3_code(mul_rn(y, tl.broadcast_to(inv[:, None], y.shape), EMU), EMU)
            codes = tl.where(bad[:, None], 0x7F, codes.to(tl.int32)).to(tl.uint8)
            tl.store(y_rows + cols[None, :], codes, mask=mask)
            s = tl.where(bad, float("nan"), s)
            tl.store(ys_ptr + row64 * stride_ysm, s, mask=rmask & (pid_c == 0))
    elif ROW_CHUNKS > 1:  # row modes 2 / 3, one pass over whole rows held as chunks on a middle axis
        col = tl.arange(0, BLOCK_C)[None, None, :]
        cols3 = tl.arange(0, ROW_CHUNKS)[None, :, None] * BLOCK_C + col
        mask3 = rmask[:, None, None] & (cols3 < NC)
        x_rows = x_ptr + row64[:, None, None] * stride_xm
        y = _act_load_at(x_rows, cols3, mask3, UP_OFF, alpha, beta, limit, SPLIT, ACT, HAS_LIMIT, ACT_DT, EMU)
        amax, nbad = _tile_amax3(y)
        if ROW_TAIL > 0:
            cols_t = (ROW_CHUNKS + tl.arange(0, ROW_TAIL))[None, :, None] * BLOCK_C + col
            mask_t = rmask[:, None, None] & (cols_t < NC)
            y_t = _act_load_at(x_rows, cols_t, mask_t, UP_OFF, alpha, beta, limit, SPLIT, ACT, HAS_LIMIT, ACT_DT,
                               EMU)
            amax_t, nbad_t = _tile_amax3(y_t)
            amax = tl.maximum(amax, amax_t)
            nbad += nbad_t
        s, mult = _row_scale(amax, nbad, min_token_scale, QMODE)
        s3, mult3, bad3 = s[:, None, None], mult[:, None, None], (nbad > 0)[:, None, None]
        y_rows3 = y_ptr + row64[:, None, None] * stride_ym
        tl.store(y_rows3 + cols3, _row_codes(y, s3, mult3, bad3, QMODE, EMU, FAST_DIV), mask=mask3)
        if ROW_TAIL > 0:
            tl.store(y_rows3 + cols_t, _row_codes(y_t, s3, mult3, bad3, QMODE, EMU, FAST_DIV), mask=mask_t)
        tl.store(ys_ptr + row64 * stride_ysm, s, mask=rmask)
    else:
        # row modes. ONE_PASS: the program's tile is the whole row (or, for the per-tensor amax, its own column
        # chunk: grid axis 1), loaded once; otherwise pass 1 finds the row's amax over chunks, pass 2 reloads them
        if ONE_PASS:
            mask = rmask[:, None] & (cols < NC)[None, :]
            y = _act_load(x_ptr, row64, cols, mask, stride_xm, UP_OFF, alpha, beta, limit,
                          SPLIT, ACT, HAS_LIMIT, ACT_DT, EMU)
            amax, nbad = tile_amax(y)
        else:
            amax = tl.zeros([BLOCK_R], dtype=tl.float32)
            nbad = tl.zeros([BLOCK_R], dtype=tl.int32)
            for c0 in range(0, NC, BLOCK_C):
                cols = c0 + tl.arange(0, BLOCK_C)
                mask = rmask[:, None] & (cols < NC)[None, :]
                y = _act_load(x_ptr, row64, cols, mask, stride_xm, UP_OFF, alpha, beta, limit,
                              SPLIT, ACT, HAS_LIMIT, ACT_DT, EMU)
                a, n = tile_amax(y)
                amax = tl.maximum(amax, a)
                nbad += n
        if QMODE == 6:
            tl.atomic_max(stat_ptr + ex, amax, mask=route_ok)
            tl.atomic_max(stat_ptr + NUM_E + ex, (nbad > 0).to(tl.float32), mask=route_ok)
        else:
            s, mult = _row_scale(amax, nbad, min_token_scale, QMODE)
            if ONE_PASS:
                tl.store(y_rows + cols[None, :], _row_codes(y, s[:, None], mult[:, None], (nbad > 0)[:, None],
                                                            QMODE, EMU, FAST_DIV), mask=mask)
            else:
                for c0 in range(0, NC, BLOCK_C):
                    cols = c0 + tl.arange(0, BLOCK_C)
                    mask = rmask[:, None] & (cols < NC)[None, :]
                    y = _act_load(x_ptr, row64, cols, mask, stride_xm, UP_OFF, alpha, beta, limit,
                                  SPLIT, ACT, HAS_LIMIT, ACT_DT, EMU)
                    tl.store(y_rows + cols[None, :], _row_codes(y, s[:, None], mult[:, None], (nbad > 0)[:, None],
                                                                QMODE, EMU, FAST_DIV), mask=mask)
            tl.store(ys_ptr + row64 * stride_ysm, s, mask=rmask)


@triton.jit(do_not_specialize=["num_valid"])
def permute_rows_kernel(src_ptr, dst_ptr, sorted_ids_ptr, ntpp_ptr, num_valid, ncols, stride_src, stride_dst,
                        TOP_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``dst[p] = src[sorted_ids[p] // TOP_K]`` for the sorted positions ``p < num_tokens_post_padded``; padding
    positions (ids ``>= num_valid``) get zeros. GEMM1 then reads contiguous row tiles (TMA) instead of a gather."""
    pid_r = tl.program_id(0)
    ntpp = tl.load(ntpp_ptr)
    if pid_r * BLOCK_R >= ntpp:
        return
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < ntpp
    ids = tl.load(sorted_ids_ptr + rows, mask=rmask, other=num_valid)
    valid = ids < num_valid
    src_rows = tl.where(valid, ids // TOP_K, 0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < ncols
    x = tl.load(src_ptr + src_rows[:, None] * stride_src + cols[None, :], mask=valid[:, None] & cmask[None, :],
                other=0)
    tl.store(dst_ptr + rows.to(tl.int64)[:, None] * stride_dst + cols[None, :], x, mask=rmask[:, None] & cmask[None, :])


@triton.jit
def moe_sum_kernel(c3_ptr, w_ptr, local_ptr, out_ptr, K, stride_c3, stride_w, stride_o,
                   TOPK: tl.constexpr, BLOCK_K: tl.constexpr, APPLY_W: tl.constexpr, EMU: tl.constexpr,
                   PDL: tl.constexpr = False):
    """``out[t] = round(sum_k w[t, k] * C3[t*TOPK + k])`` in fp32 over the routes held here (local id >= 0).
    ``PDL`` (launched with programmatic dependent launch during GEMM2): wait for GEMM2 before reading anything."""
    if PDL:
        gdc_wait()
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    cm = cols < K
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    t64 = t.to(tl.int64)
    # no branch per route: the TOPK loads are issued together (decode: one chain of latencies instead of TOPK).
    # A route not held here adds +0.0, which leaves the sum's bits unchanged (acc starts at +0.0 and is never -0.0)
    for k in tl.static_range(TOPK):
        keep = tl.load(local_ptr + t64 * TOPK + k) >= 0
        y = tl.load(c3_ptr + (t64 * TOPK + k) * stride_c3 + cols, mask=cm & keep, other=0.0).to(tl.float32)
        if APPLY_W:
            w = tl.load(w_ptr + t64 * stride_w + k).to(tl.float32)
            acc += tl.where(keep, w * y, 0.0)
        else:
            acc += y
    tl.store(out_ptr + t64 * stride_o + cols, to_act(acc, out_ptr.dtype.element_ty, EMU), mask=cm)
