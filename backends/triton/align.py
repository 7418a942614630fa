"""``moe_align_block_size`` in Triton: the exact layout of ``reference.align.moe_align_block_size``.

Layout (see the reference): for each local expert ``e`` in increasing order, the flat route indices
``i = t * topk + k`` of its routes in increasing order, padded with ``numel`` to a multiple of ``block_size``; one
(local) expert id per block, ``-1`` for every block at or after ``num_tokens_post_padded``; routes whose expert is
``-1``, out of range (when dropping) or mapped to ``-1`` by ``expert_map`` are dropped.

Unlike vLLM's CUDA kernel (atomics: order within an expert is arbitrary), this implementation is deterministic and
reproduces the reference's order exactly, in four launches (one for small inputs, below) and without host
synchronization:

1. ``torch.full`` fills ``sorted_token_ids`` with the padding value ``numel``;
2. ``_align_count_kernel`` (one program per chunk of routes): local expert of every route, per-chunk per-expert
   counts, and each route's rank among the routes of its expert inside the chunk (a one-hot prefix sum);
3. ``_align_scan_kernel`` (one program): prefix sums over chunks -> each chunk's offset inside each expert's
   segment, the padded segment starts/ends, ``num_tokens_post_padded``;
4. ``_align_scatter_kernel`` (one program per chunk): writes every kept route at
   ``start[e] + chunk_offset[c, e] + rank``, and fills a slice of ``expert_ids`` from the segment ends.

With ``tiles=True`` (the experts' ``HALF_TAIL`` configs) launches 3 and 4 also build a tile list: each expert's
blocks in pairs, plus its odd last block alone (``first_block * 2 + full``), in sorted-row order, so that the GEMMs
run two-block tiles and one single-block tail per expert in one launch.

Up to ``ONE_LAUNCH_MAX_ROUTES`` routes (decode; and ``ONE_LAUNCH_MAX_WORK`` routes x experts, :func:`one_launch`)
the four steps run in one launch instead, ``_align_one_kernel``: one
program does the fill, walks the chunks in turn (counts carried from chunk to chunk instead of scanned), then
scatters and writes the expert ids, with CTA barriers between the phases; the same layout, three launches fewer on
the step's critical path.

All index arithmetic is int32 (the layout is refused when it does not fit, as the reference does).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_wait

from .host import INTERPRET, cdiv, check_device, next_pow2, round_up
from .jit import route_local_experts

__all__ = ["moe_align_block_size", "count_expert_num_tokens", "align_routes", "max_num_tokens_padded", "max_num_tiles",
           "RouteLayout"]

_INT32_MAX = 2**31 - 1


@triton.jit
def _align_count_kernel(ids_ptr, emap_ptr, local_ptr, rank_ptr, counts_ptr, numel, num_ids,
                        CHUNK: tl.constexpr, E_PAD: tl.constexpr, HAS_MAP: tl.constexpr, SUB: tl.constexpr = 0):
    """Chunk ``c`` of ``CHUNK`` routes: each route's local expert and its rank among the chunk's routes of that
    expert, and the chunk's count per expert. The one-hot rank work is ``[SUB, E_PAD]`` a step, ``CHUNK / SUB``
    steps in turn (``SUB`` 0: one step), so that many experts need not mean many chunks for the scan."""
    c = tl.program_id(0)
    cols = tl.arange(0, E_PAD)
    carry = tl.zeros([E_PAD], dtype=tl.int32)
    if SUB == 0:  # one step
        carry = _count_step(ids_ptr, emap_ptr, local_ptr, rank_ptr, c * CHUNK + tl.arange(0, CHUNK), numel, num_ids,
                            cols, carry, HAS_MAP, True)
    else:
        for s0 in range(0, CHUNK, SUB):
            carry = _count_step(ids_ptr, emap_ptr, local_ptr, rank_ptr, c * CHUNK + s0 + tl.arange(0, SUB), numel,
                                num_ids, cols, carry, HAS_MAP, False)
    tl.store(counts_ptr + c * E_PAD + cols, carry)


@triton.jit
def _count_step(ids_ptr, emap_ptr, local_ptr, rank_ptr, offs, numel, num_ids, cols, carry, HAS_MAP: tl.constexpr,
                FIRST: tl.constexpr):
    """Routes ``offs``: their local experts and ranks (after ``carry`` routes per expert counted before them; none
    with ``FIRST``) are stored; returns ``carry`` plus their counts."""
    m, le = route_local_experts(ids_ptr, emap_ptr, offs, numel, num_ids, HAS_MAP)
    oh = (le[:, None] == cols[None, :]).to(tl.int32)
    cnt = tl.sum(oh, axis=0)  # (first: the one-hot tile's sum before its scan, or E 8's [1024, 16] tile spills)
    if FIRST:
        rank = tl.sum(tl.cumsum(oh, axis=0) * oh, axis=1) - 1
    else:
        rank = tl.sum((tl.cumsum(oh, axis=0) - 1 + carry[None, :]) * oh, axis=1)  # dropped routes: 0, never read
    tl.store(local_ptr + offs, le, mask=m)
    tl.store(rank_ptr + offs, rank, mask=m)
    return carry + cnt


@triton.jit
def _align_scan_kernel(counts_ptr, off_ptr, end_ptr, ntpp_ptr, tile_end_ptr, ntiles_ptr, num_chunks, E,
                       BS: tl.constexpr, E_PAD: tl.constexpr, CB: tl.constexpr, TILES: tl.constexpr):
    cols = tl.arange(0, E_PAD)
    carry = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, num_chunks, CB):
        rows = c0 + tl.arange(0, CB)
        m = (rows < num_chunks)[:, None]
        ptrs = rows[:, None] * E_PAD + cols[None, :]
        cnt = tl.load(counts_ptr + ptrs, mask=m, other=0)
        excl = tl.cumsum(cnt, axis=0) - cnt + carry[None, :]
        tl.store(off_ptr + ptrs, excl, mask=m)
        carry += tl.sum(cnt, axis=0)
    padded = tl.where(cols < E, (carry + BS - 1) // BS * BS, 0)
    end = tl.cumsum(padded, axis=0)
    tl.store(end_ptr + cols, end)
    tl.store(ntpp_ptr, tl.sum(padded, axis=0))
    if TILES:  # tiles of two blocks, plus one single-block tile where an expert has an odd number of blocks
        nt = (padded // BS + 1) // 2
        tl.store(tile_end_ptr + cols, tl.cumsum(nt, axis=0))
        tl.store(ntiles_ptr, tl.sum(nt, axis=0))


@triton.jit
def _align_scatter_kernel(local_ptr, rank_ptr, inv_ptr, off_ptr, end_ptr, sorted_ptr, expert_ids_ptr, tile_end_ptr,
                          tiles_ptr, numel, num_blocks, E, blocks_per_prog,
                          CHUNK: tl.constexpr, E_PAD: tl.constexpr, BS: tl.constexpr, BLK: tl.constexpr,
                          TILES: tl.constexpr):
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    m = offs < numel
    le = tl.load(local_ptr + offs, mask=m, other=-1)
    keep = m & (le >= 0)
    lec = tl.where(keep, le, 0)
    rank = tl.load(rank_ptr + offs, mask=keep, other=0)
    end = tl.load(end_ptr + lec, mask=keep, other=0)
    cnt_pad_start = tl.load(end_ptr + lec - 1, mask=keep & (lec > 0), other=0)
    pos = cnt_pad_start + tl.load(off_ptr + c * E_PAD + lec, mask=keep, other=0) + rank
    tl.store(sorted_ptr + pos, offs, mask=keep & (pos < end))
    tl.store(inv_ptr + offs, pos, mask=keep)  # inv_permuted_idx
    # expert id of blocks [c * blocks_per_prog, (c + 1) * blocks_per_prog)
    cols = tl.arange(0, E_PAD)
    ends = tl.load(end_ptr + cols)
    ecol = cols < E
    b_start = c * blocks_per_prog
    b_stop = tl.minimum(b_start + blocks_per_prog, num_blocks)
    for b0 in range(b_start, b_stop, BLK):
        b = b0 + tl.arange(0, BLK)
        p = b * BS
        eid = tl.sum(((ends[None, :] <= p[:, None]) & ecol[None, :]).to(tl.int32), axis=1)
        eid = tl.where(eid >= E, -1, eid)
        tl.store(expert_ids_ptr + b, eid, mask=b < b_stop)
        if TILES:
            # block b starts a tile when it is an even block of its expert's segment; the tile is "full" (two
            # blocks) when the segment goes on past the next block. Value: b * 2 + full.
            ok = (b < b_stop) & (eid >= 0)
            ec = tl.where(ok, eid, 0)
            seg_start = tl.load(end_ptr + ec - 1, mask=ok & (ec > 0), other=0)
            seg_end = tl.load(end_ptr + ec, mask=ok, other=0)
            r = b - seg_start // BS
            t = tl.load(tile_end_ptr + ec - 1, mask=ok & (ec > 0), other=0) + r // 2
            full = ((b + 2) * BS <= seg_end).to(tl.int32)
            tl.store(tiles_ptr + t, b * 2 + full, mask=ok & (r % 2 == 0))


@triton.jit
def _fill(ptr, n, value, FILL: tl.constexpr):
    """``ptr[0:n] = value`` (int32) by one program."""
    for f0 in range(0, n, FILL):
        f = f0 + tl.arange(0, FILL)
        tl.store(ptr + f, tl.zeros([FILL], dtype=tl.int32) + value, mask=f < n)


@triton.jit
def _align_one_chunks(ids_ptr, emap_ptr, local_ptr, rank_ptr, inv_ptr, ends_ptr, tile_end_ptr, sorted_ptr, ntpp_ptr,
                      ntiles_ptr, numel, num_ids, E, cols, CHUNK: tl.constexpr, E_PAD: tl.constexpr,
                      BS: tl.constexpr, HAS_MAP: tl.constexpr, TILES: tl.constexpr):
    """Phases 2-4 of ``_align_one_kernel`` over several chunks of routes; returns the segment ends (``[E_PAD]``)."""
    # 2. local expert and rank of every route, counts per expert
    carry = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, numel, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        m, le = route_local_experts(ids_ptr, emap_ptr, offs, numel, num_ids, HAS_MAP)
        oh = (le[:, None] == cols[None, :]).to(tl.int32)
        rank = tl.sum((tl.cumsum(oh, axis=0) - 1 + carry[None, :]) * oh, axis=1)
        carry += tl.sum(oh, axis=0)
        tl.store(local_ptr + offs, le, mask=m)
        tl.store(rank_ptr + offs, rank, mask=m)
    # 3. segment ends (padded to BS), num_tokens_post_padded, the tile list's ends
    padded = tl.where(cols < E, (carry + BS - 1) // BS * BS, 0)
    end = tl.cumsum(padded, axis=0)
    tl.store(ends_ptr + cols, end)
    tl.store(ntpp_ptr, tl.sum(padded, axis=0))
    if TILES:
        nt = (padded // BS + 1) // 2
        tl.store(tile_end_ptr + cols, tl.cumsum(nt, axis=0))
        tl.store(ntiles_ptr, tl.sum(nt, axis=0))
    tl.debug_barrier()  # the fill, local / rank and the ends are read below by other threads of the program
    # 4. scatter the routes to their rows
    for c0 in range(0, numel, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        m = offs < numel
        le = tl.load(local_ptr + offs, mask=m, other=-1)
        keep = m & (le >= 0)
        lec = tl.where(keep, le, 0)
        rank = tl.load(rank_ptr + offs, mask=keep, other=0)
        seg_end = tl.load(ends_ptr + lec, mask=keep, other=0)
        seg_start = tl.load(ends_ptr + lec - 1, mask=keep & (lec > 0), other=0)
        pos = seg_start + rank
        tl.store(sorted_ptr + pos, offs, mask=keep & (pos < seg_end))
        tl.store(inv_ptr + offs, pos, mask=keep)  # inv_permuted_idx
    return tl.load(ends_ptr + cols)


@triton.jit
def _align_one_kernel(ids_ptr, emap_ptr, local_ptr, rank_ptr, inv_ptr, ends_ptr, tile_end_ptr, sorted_ptr,
                      expert_ids_ptr, tiles_ptr, ntpp_ptr, ntiles_ptr, numel, num_ids, total_len, num_blocks, E,
                      CHUNK: tl.constexpr, E_PAD: tl.constexpr, BS: tl.constexpr, BLK: tl.constexpr,
                      FILL: tl.constexpr, HAS_MAP: tl.constexpr, TILES: tl.constexpr, ONE_CHUNK: tl.constexpr = False,
                      PDL: tl.constexpr = False):
    """The whole layout in one program (small ``numel``: decode): the fill, ``_align_count_kernel`` over the chunks
    in turn (each route's rank = its rank inside its chunk + the routes of its expert in the chunks before),
    ``_align_scan_kernel``'s segment ends and ``_align_scatter_kernel``'s writes, with CTA barriers between the
    phases (each phase reads what other threads of the program wrote to global memory in the one before).
    ``ONE_CHUNK`` (``numel <= CHUNK``): the count, scan and scatter phases on registers, one barrier (after the
    fill) instead of a store, a barrier and a reload between each, and (without the tile list) each route writes
    its block's expert id instead of every block searching the segment ends.
    ``PDL`` (launched with programmatic dependent launch, ``host.STEP_PDL``): the program may start beside the kernel
    before it (the input quantizer, which triggers at its start) and read the router's ids and the expert map (older,
    alive) and, with ``ONE_CHUNK``, compute the layout in registers; it waits for that kernel before its first write
    (its outputs are fresh allocations, which the caching allocator may have carved out of memory that kernel still
    reads, a temporary freed after its launch), so its completion also implies that kernel's (GEMM1, launched after
    it, reads the codes)."""
    cols = tl.arange(0, E_PAD)
    if ONE_CHUNK:
        # decode: every route in one chunk, so the phases below run on registers (no store / barrier / reload of
        # local, rank and the ends between them: each such round trip is a global-memory latency on a one-program
        # critical path); one barrier orders the fill before the scatter
        offs = tl.arange(0, CHUNK)
        m, le = route_local_experts(ids_ptr, emap_ptr, offs, numel, num_ids, HAS_MAP)
        oh = (le[:, None] == cols[None, :]).to(tl.int32)
        rank = tl.sum((tl.cumsum(oh, axis=0) - 1) * oh, axis=1)
        carry = tl.sum(oh, axis=0)
        padded = tl.where(cols < E, (carry + BS - 1) // BS * BS, 0)
        end = tl.cumsum(padded, axis=0)
        pos = tl.sum(oh * (end - padded)[None, :], axis=1) + rank  # the expert's segment start + the route's rank
        if PDL:  # every write of the kernel comes after the kernel before it has finished (host.STEP_PDL)
            gdc_wait()
        # 1. sorted_token_ids = numel (the padding value), and (no tile list) expert_ids = -1: each block of a
        # segment is then written by the routes it holds
        _fill(sorted_ptr, total_len, numel, FILL)
        if not TILES:
            _fill(expert_ids_ptr, num_blocks, -1, FILL)
        tl.store(local_ptr + offs, le, mask=m)
        tl.store(ends_ptr + cols, end)
        tl.store(ntpp_ptr, tl.sum(padded, axis=0))
        if TILES:
            nt = (padded // BS + 1) // 2
            tl.store(tile_end_ptr + cols, tl.cumsum(nt, axis=0))
            tl.store(ntiles_ptr, tl.sum(nt, axis=0))
        tl.debug_barrier()  # the fills (and, with TILES, the ends read by index below) before what follows
        tl.store(sorted_ptr + pos, offs, mask=m & (le >= 0))
        tl.store(inv_ptr + offs, pos, mask=m & (le >= 0))  # inv_permuted_idx
        if not TILES:
            # each route writes its block's expert: a segment of ceil(count / BS) blocks holds ranks 0 .. count - 1,
            # so every block of it is written (by all its routes, the same value); blocks past the segments keep -1
            tl.store(expert_ids_ptr + pos // BS, le, mask=m & (le >= 0))
        ends = end
    else:
        if PDL:
            gdc_wait()
        _fill(sorted_ptr, total_len, numel, FILL)  # 1. sorted_token_ids = numel (the padding value)
        ends = _align_one_chunks(ids_ptr, emap_ptr, local_ptr, rank_ptr, inv_ptr, ends_ptr, tile_end_ptr, sorted_ptr,
                                 ntpp_ptr, ntiles_ptr, numel, num_ids, E, cols, CHUNK, E_PAD, BS, HAS_MAP, TILES)
    # 5. the expert id of every block (and the tile list), as _align_scatter_kernel over all blocks
    ecol = cols < E
    for b0 in range(0, num_blocks if not ONE_CHUNK or TILES else 0, BLK):
        b = b0 + tl.arange(0, BLK)
        p = b * BS
        eid = tl.sum(((ends[None, :] <= p[:, None]) & ecol[None, :]).to(tl.int32), axis=1)
        eid = tl.where(eid >= E, -1, eid)
        tl.store(expert_ids_ptr + b, eid, mask=b < num_blocks)
        if TILES:
            ok = (b < num_blocks) & (eid >= 0)
            ec = tl.where(ok, eid, 0)
            seg_start = tl.load(ends_ptr + ec - 1, mask=ok & (ec > 0), other=0)
            seg_end = tl.load(ends_ptr + ec, mask=ok, other=0)
            r = b - seg_start // BS
            t = tl.load(tile_end_ptr + ec - 1, mask=ok & (ec > 0), other=0) + r // 2
            full = ((b + 2) * BS <= seg_end).to(tl.int32)
            tl.store(tiles_ptr + t, b * 2 + full, mask=ok & (r % 2 == 0))


#: ``align_routes`` builds the layout in one launch (``_align_one_kernel``) up to this many routes (decode: M * topk
#: of a few hundred tokens), in four launches above (the fill, then count / scan / scatter over chunks in parallel);
#: ``MOE_TRITON_ALIGN_ONE_MAX`` sets it (0: always four launches, for an A / B on the GPU)
ONE_LAUNCH_MAX_ROUTES = int(os.environ.get("MOE_TRITON_ALIGN_ONE_MAX", "1024"))
#: ... and while routes x ``next_pow2(E + 1)`` (the one program's one-hot rank work) is at most this. H200, eleventh
#: session: E 8 at 16 / 128 routes 2.0 / 2.9 us in one launch against 16 us in four (the count kernel's one
#: 1024-route chunk); E 128 at 64 routes 6.2 us against 8.4 us, at 512 routes 29.0 us against 8.2 us
ONE_LAUNCH_MAX_WORK = 16384
#: the one-launch kernel's register path for routes that fit one chunk (``ONE_CHUNK``); ``MOE_TRITON_ALIGN_ONE_CHUNK=0``
#: turns it off (an A / B on the GPU)
ONE_CHUNK = os.environ.get("MOE_TRITON_ALIGN_ONE_CHUNK", "1") != "0"


def one_launch(numel: int, num_slots: int) -> bool:
    """Whether :func:`align_routes` builds this layout in one launch (see ``ONE_LAUNCH_MAX_ROUTES``)."""
    return 0 < numel <= ONE_LAUNCH_MAX_ROUTES and numel * next_pow2(num_slots + 1) <= ONE_LAUNCH_MAX_WORK


def max_num_tokens_padded(numel: int, num_experts: int, block_size: int, pad_sorted_ids: bool = False) -> int:
    """Length of ``sorted_token_ids`` (same rule as ``reference.align.max_num_tokens_padded``):
    ``numel + E * (bs - 1)`` (rounded up to bs if ``pad_sorted_ids``), capped at ``numel * bs`` when
    ``numel < E``; 0 when ``numel == 0``."""
    padded = numel + num_experts * (block_size - 1)
    if pad_sorted_ids:
        padded = round_up(padded, block_size)
    if numel < num_experts:
        padded = min(numel * block_size, padded)
    return padded


#: the four-launch layout's chunks of routes: at most about this many (each ``_align_count_kernel`` program then
#: steps over several one-hot sub-chunks): the scan runs over the chunks in turn in one program, and 1024 chunks of
#: 32 routes (DeepSeek-V3 TP8 at M = 4096: E 256, 32768 routes) took it 122 us on an H200
TARGET_CHUNKS = 8 if INTERPRET else 64


def _chunk_sizes(e_pad: int) -> tuple[int, int]:
    budget = 4096 if INTERPRET else 16384
    chunk = max(16, min(1024, next_pow2(budget // e_pad) if budget >= e_pad else 16))
    if chunk * e_pad > budget and chunk > 16:
        chunk //= 2
    # the scan's [cb, e_pad] tiles: a quarter of the budget (its cumsum temporaries spilled registers at the full one)
    cb = max(1, min(256, budget // 4 // e_pad))
    cb = 1 << (cb.bit_length() - 1)
    return chunk, cb


class RouteLayout(NamedTuple):
    """The route layout of one call (see :func:`align_routes`)."""

    sorted_token_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_tokens_post_padded: torch.Tensor
    local_ids: torch.Tensor
    tiles: torch.Tensor | None = None
    num_tiles: torch.Tensor | None = None
    #: route -> its row in the sorted layout (vLLM's ``moe_permute`` name): ``sorted_token_ids[inv_permuted_idx[r]]
    #: == r`` for every route held here; undefined for dropped routes (``local_ids < 0``)
    inv_permuted_idx: torch.Tensor | None = None
    #: no layout at all (``experts.ROUTE_TILES_MAX``): 1, or 2 with an expert map; then ``sorted_token_ids`` is
    #: ``topk_ids`` (flat), ``expert_ids`` the map, ``local_ids`` written by GEMM1, and ``num_ids`` the id space
    route_tiles: int = 0
    num_ids: int = 0


def max_num_tiles(numel: int, num_experts: int, block_size: int, total_len: int) -> int:
    """Upper bound of the tile list's length: an expert with ``c`` routes has ``ceil(c / (2 * block_size))`` tiles,
    so at most ``numel // (2 * block_size) + min(E, numel)`` in all, and never more than the layout's blocks."""
    return max(1, min(cdiv(total_len, block_size), numel // (2 * block_size) + min(num_experts, numel)))


def align_routes(topk_ids: torch.Tensor, block_size: int, num_slots: int, expert_map: torch.Tensor | None,
                 num_ids: int, total_len: int, tiles: bool = False, pdl: bool = False) -> RouteLayout:
    """The layout kernels without argument checks (the experts' fast path).

    Args:
        topk_ids: ``(M, topk)`` integer ids (int32/int64), contiguous.
        block_size: rows per block. num_slots: number of local experts (blocks carry ids in ``[0, num_slots)``).
        expert_map: int ``(num_ids,)`` global -> local map or None (then ids are local ids).
        num_ids: ids outside ``[0, num_ids)`` are dropped (``len(expert_map)``, or ``num_slots`` without a map).
        total_len: length of ``sorted_token_ids`` (>= any layout: ``max_num_tokens_padded``).
        tiles: also build the tile list of the ``HALF_TAIL`` GEMMs: each expert's segment cut into tiles of two
            blocks, the last one a single block when the segment has an odd number of blocks.
        pdl: the one-launch kernel with programmatic dependent launch (the experts step after its input quantizer,
            ``host.STEP_PDL``; see ``_align_one_kernel``).

    Returns:
        ``RouteLayout(sorted_token_ids int32 (total_len,), expert_ids int32 (cdiv(total_len, bs),),
        num_tokens_post_padded int32 (1,), local_ids int32 (numel,), tiles, num_tiles, inv_permuted_idx int32
        (numel,))``; ``local_ids`` is each route's local expert, -1 when dropped; ``inv_permuted_idx`` each held
        route's row in the layout (what the requantization between the GEMMs reads at decode, where most rows are
        padding). With ``tiles``: ``tiles`` int32 ``(max_num_tiles,)``, entry ``t <
        num_tiles`` = ``first_block * 2 + (1 if the tile has two blocks else 0)``, tiles in sorted-row order (entries
        from ``num_tiles`` on are undefined); ``num_tiles`` int32 (1,). Otherwise both are None.
    """
    dev = topk_ids.device
    numel = topk_ids.numel()
    num_blocks = cdiv(total_len, block_size)
    one = one_launch(numel, num_slots)
    if one:  # filled by the one-launch kernel's first phase
        sorted_ids = torch.empty((total_len,), dtype=torch.int32, device=dev)
    else:
        sorted_ids = torch.full((total_len,), numel, dtype=torch.int32, device=dev)
    expert_ids = torch.empty((num_blocks,), dtype=torch.int32, device=dev)
    ntpp = torch.empty((1,), dtype=torch.int32, device=dev)
    local = torch.empty((numel,), dtype=torch.int32, device=dev)
    tile_list = ntiles = None
    if tiles:
        tile_list = torch.empty((max_num_tiles(numel, num_slots, block_size, total_len),), dtype=torch.int32,
                                device=dev)
        ntiles = torch.empty((1,), dtype=torch.int32, device=dev)
    if numel == 0:
        ntpp.zero_()
        expert_ids.fill_(-1)
        if tiles:
            ntiles.zero_()
        return RouteLayout(sorted_ids, expert_ids, ntpp, local, tile_list, ntiles, local)
    e_pad = next_pow2(num_slots + 1)
    chunk, cb = _chunk_sizes(e_pad)
    if one:
        rank = torch.empty((numel,), dtype=torch.int32, device=dev)
        ends = torch.empty((e_pad,), dtype=torch.int32, device=dev)
        tile_ends = torch.empty((e_pad,), dtype=torch.int32, device=dev) if tiles else ends
        blk = max(16, min(128, next_pow2(num_blocks), 8192 // e_pad))
        one_chunk = max(16, min(chunk, next_pow2(numel)))
        inv = torch.empty((numel,), dtype=torch.int32, device=dev)
        _align_one_kernel[(1,)](topk_ids.reshape(-1), expert_map if expert_map is not None else topk_ids, local, rank,
                                inv, ends, tile_ends, sorted_ids, expert_ids, tile_list if tiles else expert_ids, ntpp,
                                ntiles if tiles else ntpp, numel, num_ids, total_len, num_blocks, num_slots,
                                CHUNK=one_chunk, E_PAD=e_pad, BS=block_size, BLK=blk,
                                FILL=1024 if not INTERPRET else 256, HAS_MAP=expert_map is not None, TILES=tiles,
                                ONE_CHUNK=ONE_CHUNK and numel <= one_chunk, PDL=pdl,
                                # one chunk over E_PAD >= 512 columns: 4 warps (H200, DSV3 TP8 M=1: step 26.18 ->
                                # 25.81 us; 2 warps 26.6; Qwen3's E_PAD 256 keeps 8: 4 warps cost it 0.1-0.15 us)
                                num_warps=4 if numel <= one_chunk and e_pad >= 512 else 8,
                                num_stages=1,  # no loop pipelining across the phases' barrier
                                **({"launch_pdl": True} if pdl else {}))
        return RouteLayout(sorted_ids, expert_ids, ntpp, local, tile_list, ntiles, inv)
    sub = chunk  # the one-hot step; a chunk is several of them when there would be more than TARGET_CHUNKS chunks
    chunk = sub * next_pow2(cdiv(cdiv(numel, sub), TARGET_CHUNKS))
    num_chunks = cdiv(numel, chunk)
    rank = torch.empty((numel,), dtype=torch.int32, device=dev)
    counts = torch.empty((num_chunks, e_pad), dtype=torch.int32, device=dev)
    offs = torch.empty((num_chunks, e_pad), dtype=torch.int32, device=dev)
    ends = torch.empty((e_pad,), dtype=torch.int32, device=dev)
    tile_ends = torch.empty((e_pad,), dtype=torch.int32, device=dev) if tiles else ends
    ids = topk_ids.reshape(-1)
    emap = expert_map if expert_map is not None else ids  # dummy pointer when there is no map
    _align_count_kernel[(num_chunks,)](ids, emap, local, rank, counts, numel, num_ids,
                                       CHUNK=chunk, E_PAD=e_pad, HAS_MAP=expert_map is not None,
                                       SUB=sub if chunk > sub else 0)
    _align_scan_kernel[(1,)](counts, offs, ends, ntpp, tile_ends, ntiles if tiles else ntpp, num_chunks, num_slots,
                             BS=block_size, E_PAD=e_pad, CB=cb, TILES=tiles,
                             num_warps=8)  # one CTA scans [CB, E_PAD] tiles: at 4 warps E = 128 spilled 192 bytes
    blocks_per_prog = cdiv(num_blocks, num_chunks)
    blk = max(16, min(128, next_pow2(blocks_per_prog), 8192 // e_pad))
    inv = torch.empty((numel,), dtype=torch.int32, device=dev)
    _align_scatter_kernel[(num_chunks,)](local, rank, inv, offs, ends, sorted_ids, expert_ids, tile_ends,
                                         tile_list if tiles else expert_ids, numel, num_blocks,
                                         num_slots, blocks_per_prog, CHUNK=chunk, E_PAD=e_pad, BS=block_size,
                                         BLK=blk, TILES=tiles)
    return RouteLayout(sorted_ids, expert_ids, ntpp, local, tile_list, ntiles, inv)


def _check_ids_and_map(fn, topk_ids, expert_map, num_slots, num_ids_no_map, drop_out_of_range_ids):
    """Shared argument checks (reference semantics); returns (contiguous int ids, int32 map or None, num_ids)."""
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise ValueError(f"{fn}: topk_ids must be a 2-D (M, topk) tensor, got "
                         f"{tuple(topk_ids.shape) if isinstance(topk_ids, torch.Tensor) else type(topk_ids)}")
    if topk_ids.dtype not in (torch.int8, torch.int16, torch.int32, torch.int64):
        raise ValueError(f"{fn}: topk_ids must have a signed integer dtype, got {topk_ids.dtype}")
    check_device(topk_ids, expert_map, what="topk_ids and expert_map")
    ids = topk_ids.contiguous()
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.to(torch.int32)
    emap, num_ids = None, num_ids_no_map
    if expert_map is not None:
        if expert_map.dim() != 1 or expert_map.dtype not in (torch.int8, torch.int16, torch.int32, torch.int64):
            raise ValueError(f"{fn}: expert_map must be a 1-D signed integer tensor, got {expert_map.dtype} "
                             f"{tuple(expert_map.shape)}")
        em = expert_map.to(torch.int64)
        if bool(((em < -1) | (em >= num_slots)).any()):
            raise ValueError(f"{fn}: expert_map values must lie in [-1, {num_slots})")
        loc = em[em >= 0]
        if loc.numel() != torch.unique(loc).numel():
            raise ValueError(f"{fn}: expert_map maps two global experts to the same local expert")
        emap, num_ids = expert_map.to(torch.int32).contiguous(), expert_map.numel()
    if ids.numel() and not drop_out_of_range_ids:
        bad = (ids < -1) | (ids >= num_ids)
        if bool(bad.any()):
            i = int(bad.reshape(-1).nonzero()[0, 0])
            k = ids.size(1)
            raise ValueError(f"{fn}: topk_ids[{i // k}, {i % k}] = {int(ids.reshape(-1)[i])} is outside "
                             f"[0, {num_ids}) and is not the -1 sentinel (pass drop_out_of_range_ids=True to drop)")
    return ids, emap, num_ids


def count_expert_num_tokens(
    topk_ids: torch.Tensor,
    num_local_experts: int,
    expert_map: torch.Tensor | None = None,
    *,
    drop_out_of_range_ids: bool = False,
) -> torch.Tensor:
    """Routes per local expert, int32 ``(num_local_experts,)`` (same contract as
    ``reference.align.count_expert_num_tokens``; vLLM ``fused_moe/utils.py::count_expert_num_tokens``): the
    per-chunk counts of ``_align_count_kernel`` summed on the device.

    Raises:
        ValueError: bad topk_ids / num_local_experts / expert_map; an out-of-range id (unless dropping).
    """
    fn = "count_expert_num_tokens"
    if isinstance(num_local_experts, bool) or not isinstance(num_local_experts, int) or num_local_experts <= 0:
        raise ValueError(f"{fn}: num_local_experts must be a positive int, got {num_local_experts!r}")
    ids, emap, num_ids = _check_ids_and_map(fn, topk_ids, expert_map, num_local_experts, num_local_experts,
                                            drop_out_of_range_ids)
    numel = ids.numel()
    if numel == 0:
        return torch.zeros(num_local_experts, dtype=torch.int32, device=ids.device)
    e_pad = next_pow2(num_local_experts + 1)
    chunk, _ = _chunk_sizes(e_pad)
    num_chunks = cdiv(numel, chunk)
    local = torch.empty((numel,), dtype=torch.int32, device=ids.device)
    rank = torch.empty_like(local)
    counts = torch.empty((num_chunks, e_pad), dtype=torch.int32, device=ids.device)
    _align_count_kernel[(num_chunks,)](ids.reshape(-1), emap if emap is not None else ids, local, rank, counts,
                                       numel, num_ids, CHUNK=chunk, E_PAD=e_pad, HAS_MAP=emap is not None)
    return counts.sum(0, dtype=torch.int32)[:num_local_experts].contiguous()


def moe_align_block_size(
    topk_ids: torch.Tensor,
    block_size: int,
    num_experts: int,
    expert_map: torch.Tensor | None = None,
    pad_sorted_ids: bool = False,
    *,
    drop_out_of_range_ids: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the routes by expert, padding each expert's group to a multiple of ``block_size`` (Triton kernels).

    Same signature, layout, dtypes and errors as ``reference.align.moe_align_block_size`` (which mirrors vLLM's
    ``moe_align_block_size`` with ``ignore_invalid_experts=True``): ``(sorted_token_ids int32
    (max_num_tokens_padded,), expert_ids int32 (cdiv(len, block_size),), num_tokens_post_padded int32 (1,))``,
    padding value ``numel``, ``-1`` expert ids for unused blocks, non-local routes dropped under ``expert_map``.

    The argument checks (id range, map validity) synchronize with the device; the experts call
    :func:`align_routes` directly.

    Raises:
        ValueError: topk_ids not 2-D / not a signed integer tensor; block_size / num_experts not positive ints;
            expert_map not 1-D of length num_experts, values outside [-1, num_experts) or duplicate local ids; an
            id outside ``[0, num_experts)`` other than -1 (unless ``drop_out_of_range_ids``); a layout too large for
            int32; tensors not on the kernels' device.
    """
    fn = "moe_align_block_size"
    for name, v in (("block_size", block_size), ("num_experts", num_experts)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{fn}: {name} must be a positive int, got {v!r}")
    if expert_map is not None and expert_map.dim() == 1 and expert_map.numel() != num_experts:
        raise ValueError(f"{fn}: expert_map must have shape ({num_experts},), got {tuple(expert_map.shape)}")
    ids, emap, _ = _check_ids_and_map(fn, topk_ids, expert_map, num_experts, num_experts, drop_out_of_range_ids)
    numel = ids.numel()
    total_len = max_num_tokens_padded(numel, num_experts, block_size, pad_sorted_ids) if numel else 0
    if total_len > _INT32_MAX:
        raise ValueError(f"{fn}: sorted_token_ids would need {total_len} int32 entries (> 2**31 - 1)")
    sorted_ids, expert_ids, ntpp = align_routes(ids, block_size, num_experts, emap, num_experts, total_len)[:3]
    return sorted_ids, expert_ids, ntpp
