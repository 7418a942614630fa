"""Token -> expert alignment: the layouts the grouped expert GEMMs read.

Two layouts are defined here, both pure functions of ``topk_ids`` (and ``expert_map`` under expert parallelism):

1. The Triton / block layout of ``moe_align_block_size`` (mirrors
   ``vllm/model_executor/layers/fused_moe/moe_align_block_size.py`` and its CUDA kernel
   ``csrc/moe/moe_align_sum_kernels.cu``): a list of *flat route indices* ``i = token * topk + k`` grouped by
   expert, each expert's group padded to a multiple of ``block_size`` with the sentinel ``numel``, and one expert id
   per block of ``block_size`` entries. ``count_expert_num_tokens`` (``fused_moe/utils.py``) counts routes per
   local expert.
2. The DeepGEMM *contiguous* layout (mirrors ``vllm/model_executor/layers/fused_moe/deep_gemm_utils.py``:
   ``compute_aligned_M_and_alignment``, ``deepgemm_moe_permute`` = ``ep_scatter``, ``deepgemm_unpermute_and_reduce``
   = ``ep_gather``; used by ``DeepGemmExperts.apply`` of seed 001): activation rows copied so that each local
   expert's rows are contiguous and start at a multiple of the alignment, with a per-row expert id (``m_indices``)
   that is -1 on padding rows, and ``_valid_deep_gemm`` (seed 001), the shape/dtype gate of that path.

Route validity, one rule for every function of this module (vLLM's kernels disagree, see below):

- ``-1`` is the "no route" sentinel (EP masking, padding): the route is dropped. Always allowed.
- An id outside ``[0, num_ids)`` other than -1 (``num_ids`` = ``num_experts``, ``len(expert_map)`` or
  ``local_num_experts``, as each function says) raises ``ValueError`` by default: it is what NaN router logits
  produce (vLLM #39391) and what the ``expert_map[-1]`` / ``expert_map[E]`` out-of-bounds reads of vLLM #48371 feed
  on. With ``drop_out_of_range_ids=True`` such routes are dropped instead, as vLLM's current CUDA align kernel does
  (``if (expert_id >= num_experts) continue``; negative ids are skipped since vLLM's invalid-id test): use this for
  "zero experts" (ids ``>= E`` whose contribution the caller adds separately) and fused shared experts.
- With ``expert_map`` (global id -> local id, -1 where the expert lives on another rank) a route whose expert maps
  to -1 is *non-local* and is dropped; every kept route is labelled with its *local* id.
- Dropped routes never appear in any layout; ``sorted_token_ids`` keeps their flat index only as "absent".

Integer widths: every index tensor is int32, as in vLLM; a layout whose size does not fit in int32 raises
``ValueError`` (int32 stride overflow is vLLM #5938 / #34279).

Order: within one expert, routes are listed in increasing flat index. vLLM's kernels fill positions with atomics,
so their order within an expert is not deterministic; a conformance check of a kernel compares, per expert (per
block), the *set* of routes, and everything else (block expert ids, counts, padding, totals) exactly.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "moe_align_block_size",
    "globalize_recv_topk_idx",
    "fused_globalize_align_block_size",
    "max_num_tokens_padded",
    "count_expert_num_tokens",
    "compute_aligned_M_and_alignment",
    "deepgemm_moe_permute",
    "deepgemm_unpermute_and_reduce",
    "moe_permute",
    "moe_unpermute",
    "_valid_deep_gemm_shape",
    "valid_deep_gemm",
    "DEEP_GEMM_M_ALIGNMENT",
    "DEEP_GEMM_BLOCK_K",
]

#: DeepGEMM's ``get_mk_alignment_for_contiguous_layout()`` on SM90/SM100: ``(block_m, block_k) = (128, 128)``.
DEEP_GEMM_M_ALIGNMENT = 128
DEEP_GEMM_BLOCK_K = 128

_INT32_MAX = 2**31 - 1
_SIGNED_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)


# ----------------------------------------------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(x: int, multiple: int) -> int:
    return _cdiv(x, multiple) * multiple


def _check_positive_int(name: str, value: Any, fn: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{fn}: {name} must be a positive int, got {value!r}")


def _check_nonnegative_int(name: str, value: Any, fn: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{fn}: {name} must be a non-negative int, got {value!r}")


def _check_topk_ids(topk_ids: Any, fn: str) -> None:
    if not isinstance(topk_ids, torch.Tensor):
        raise ValueError(f"{fn}: topk_ids must be a torch.Tensor of shape (M, topk), got {type(topk_ids).__name__}")
    if topk_ids.dim() != 2:
        raise ValueError(
            f"{fn}: topk_ids must be 2-D (M, topk), got shape {tuple(topk_ids.shape)}; "
            "reshape it to (num_tokens, topk)"
        )
    if topk_ids.dtype not in _SIGNED_INT_DTYPES:
        raise ValueError(
            f"{fn}: topk_ids must have a signed integer dtype (int8/16/32/64; -1 marks a dropped route), got "
            f"{topk_ids.dtype}; convert it with topk_ids.to(torch.int32)"
        )


def _check_expert_map(expert_map: Any, num_local: int | None, fn: str) -> torch.Tensor:
    """Validate ``expert_map`` and return it as a CPU int64 tensor."""
    if not isinstance(expert_map, torch.Tensor) or expert_map.dim() != 1:
        raise ValueError(f"{fn}: expert_map must be a 1-D tensor (global_num_experts,), got {expert_map!r:.80}")
    if expert_map.dtype not in _SIGNED_INT_DTYPES:
        raise ValueError(f"{fn}: expert_map must have a signed integer dtype (-1 = not on this rank), got "
                         f"{expert_map.dtype}")
    emap = expert_map.detach().to("cpu", torch.int64)
    upper = num_local if num_local is not None else emap.numel()
    bad = (emap < -1) | (emap >= upper)
    if bool(bad.any()):
        g = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{fn}: expert_map[{g}] = {int(emap[g])} is not a local expert id in [0, {upper}) nor -1; build the map "
            "with reference.routing.determine_expert_map"
        )
    local = emap[emap >= 0]
    if local.numel() != torch.unique(local).numel():
        raise ValueError(f"{fn}: expert_map maps two global experts to the same local expert: {emap.tolist()}")
    return emap


def _local_ids(
    topk_ids: torch.Tensor,
    num_ids: int | None,
    emap: torch.Tensor | None,
    drop_out_of_range_ids: bool,
    fn: str,
) -> torch.Tensor:
    """Flat (M*topk,) int64 CPU tensor: the local expert id of every route, -1 where the route is dropped.

    ``num_ids`` is the size of the id space topk_ids indexes (``len(expert_map)`` when a map is given); None means
    unknown (only ``-1`` / other negatives can be classified then).
    """
    flat = topk_ids.detach().reshape(-1).to("cpu", torch.int64)
    if emap is not None:
        num_ids = emap.numel()
    out_of_range = flat < -1
    if num_ids is not None:
        out_of_range |= flat >= num_ids
    if bool(out_of_range.any()) and not drop_out_of_range_ids:
        i = int(out_of_range.nonzero()[0, 0])
        k = topk_ids.size(1)
        space = f"[0, {num_ids})" if num_ids is not None else "[0, inf)"
        raise ValueError(
            f"{fn}: topk_ids[{i // k}, {i % k}] = {int(flat[i])} is outside {space} and is not the -1 sentinel "
            "(NaN router logits? vLLM #39391). Fix the routing, or pass drop_out_of_range_ids=True to drop such "
            "routes (zero experts / fused shared experts handled by the caller)"
        )
    valid = (flat >= 0) & ~out_of_range
    local = torch.full_like(flat, -1)
    if emap is None:
        local[valid] = flat[valid]
    else:
        local[valid] = emap[flat[valid]]
    return local


def _counts(local: torch.Tensor, num_slots: int) -> list[int]:
    """Routes per local expert slot, as python ints."""
    kept = local[local >= 0]
    return torch.bincount(kept, minlength=num_slots).tolist() if kept.numel() else [0] * num_slots


# ----------------------------------------------------------------------------------------------------------------
# Triton block layout
# ----------------------------------------------------------------------------------------------------------------


def max_num_tokens_padded(numel: int, num_experts: int, block_size: int, pad_sorted_ids: bool = False) -> int:
    """Length of ``sorted_token_ids`` that ``moe_align_block_size`` allocates.

    ``numel + num_experts * (block_size - 1)``, rounded up to ``block_size`` if ``pad_sorted_ids``, then capped at
    ``numel * block_size`` when ``numel < num_experts`` (at most ``numel`` experts can be active, each needing at
    most one padded block per route). The cap is a multiple of ``block_size``, so the order of rounding and capping
    does not matter. ``numel == 0`` gives 0. Mirrors ``moe_align_block_size.py`` (vLLM >= 0.11; older versions had
    no cap). Any actual layout fits: ``sum_e round_up(count_e, bs) <= numel + active * (bs - 1)``.

    Raises:
        ValueError: negative numel, non-positive num_experts / block_size.
    """
    fn = "max_num_tokens_padded"
    _check_nonnegative_int("numel", numel, fn)
    _check_positive_int("num_experts", num_experts, fn)
    _check_positive_int("block_size", block_size, fn)
    padded = numel + num_experts * (block_size - 1)
    if pad_sorted_ids:
        padded = _round_up(padded, block_size)
    if numel < num_experts:
        padded = min(numel * block_size, padded)
    return padded


def moe_align_block_size(
    topk_ids: torch.Tensor,
    block_size: int,
    num_experts: int,
    expert_map: torch.Tensor | None = None,
    pad_sorted_ids: bool = False,
    ignore_invalid_experts: bool = False,
    return_scatter_idx: bool = False,
    *,
    drop_out_of_range_ids: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Group the routes by expert, padding each expert's group to a multiple of ``block_size``.

    Mirrors ``vllm/model_executor/layers/fused_moe/moe_align_block_size.py::moe_align_block_size`` (vLLM 0.33.0
    signature) with the CUDA kernel of ``csrc/moe/moe_align_sum_kernels.cu``. With ``expert_map`` there are two
    modes, as in vLLM:

    - ``ignore_invalid_experts=True`` (what vLLM's experts call: ``triton_moe.py``, ``marlin_moe.py``, ...): the
      kernel applies the map itself; non-local routes are dropped and blocks carry *local* ids (described below).
    - ``ignore_invalid_experts=False`` (vLLM's default, the *legacy* mode): the kernel aligns every *global* expert
      (``expert_map`` not passed to it), then ``expert_ids = expert_map[expert_ids]``: a block of a non-local expert
      is labelled -1 and its routes stay in ``sorted_token_ids`` and count in ``num_tokens_post_padded``; every
      unused block (-1 before the mapping) becomes ``expert_map[-1]`` (torch indexing wraps -1 to the map's last
      entry: the local id of global expert ``E - 1`` when this rank owns it, else -1; vLLM #48371's read). The
      Triton kernel never reads the unused blocks (they lie past ``num_tokens_post_padded``).

    Without ``expert_map`` both modes are the same. ``return_scatter_idx`` (0.33) appends ``scatter_idx``: int32
    ``(numel, 1)``, ``i`` for every route the layout keeps (id in ``[0, num_experts)`` and, in the ignore mode,
    local), ``-1`` otherwise; with ``expert_map`` it needs ``ignore_invalid_experts=True`` (ValueError, as vLLM).

    Args:
        topk_ids: ``(M, topk)`` signed integer tensor of global expert ids; flat route index ``i = t * topk + k``.
        block_size: the Triton kernel's ``BLOCK_SIZE_M`` (> 0).
        num_experts: number of (global) experts ids index; must equal ``len(expert_map)`` when a map is given.
        expert_map: optional ``(num_experts,)`` signed int map global -> local id, -1 for experts on other ranks.
            Non-local routes are dropped and blocks carry *local* ids.
        pad_sorted_ids: round the length of ``sorted_token_ids`` up to a multiple of ``block_size``.
        ignore_invalid_experts: with ``expert_map``, drop non-local routes in the kernel (True) or the legacy mode
            (False, vLLM's default; see above). No effect without a map.
        return_scatter_idx: also return ``scatter_idx`` (see above).
        drop_out_of_range_ids: drop routes with ids outside ``[0, num_experts)`` instead of raising (see module).

    Returns:
        ``sorted_token_ids``: int32 ``(max_num_tokens_padded,)`` (see :func:`max_num_tokens_padded`, computed with
        ``numel = topk_ids.numel()`` and the *global* ``num_experts``). For each local expert ``e`` in increasing
        order of ``e``, the flat indices of its routes in increasing order, followed by the padding value ``numel``
        up to a multiple of ``block_size``; experts with no route take no space. Every entry after
        ``num_tokens_post_padded`` is ``numel`` too.
        ``expert_ids``: int32 ``(cdiv(max_num_tokens_padded, block_size),)``, the local expert of each block of
        ``block_size`` entries; ``-1`` for every block at or after ``num_tokens_post_padded // block_size``
        (vLLM PR #35161 changed that fill from 0 to -1; 0 made the Triton kernel compute expert 0 on padding).
        ``num_tokens_post_padded``: int32 ``(1,)``, ``sum_e round_up(count_e, block_size)`` over local experts.
        ``scatter_idx`` (only with ``return_scatter_idx``): int32 ``(numel, 1)``.

    With ``M == 0`` all three describe an empty layout: shapes ``(0,)``, ``(0,)`` and value ``[0]``.

    Example (``topk_ids = [[0, 1], [1, 2], [0, 2]]``, ``block_size = 4``, ``num_experts = 4``): routes of expert 0
    are flat 0, 4; of expert 1: 1, 2; of expert 2: 3, 5, so ``sorted_token_ids = [0, 4, 6, 6, 1, 2, 6, 6, 3, 5, 6, 6,
    6, 6, 6, 6, 6, 6]`` (length 6 + 4 * 3 = 18), ``expert_ids = [0, 1, 2, -1, -1]``, ``num_tokens_post_padded =
    [12]``.

    The description above is the ignore mode (or no map); the legacy mode is that layout computed over the global
    experts without the map, then the ``expert_ids`` mapping.

    Raises:
        ValueError: topk_ids not 2-D / not signed integer; block_size or num_experts not a positive int; expert_map
            not 1-D, of length != num_experts, with values outside [-1, num_experts) or duplicate local ids; an id
            outside ``[0, num_experts)`` other than -1 (unless ``drop_out_of_range_ids``); a layout too large for
            int32 indices; ``return_scatter_idx`` with ``expert_map`` and not ``ignore_invalid_experts``.
    """
    fn = "moe_align_block_size"
    if return_scatter_idx:
        from reference.semantics import require

        require("moe_align_block_size(return_scatter_idx=True)", "0.33",
                upstream="vllm/model_executor/layers/fused_moe/moe_align_block_size.py")
    if return_scatter_idx and expert_map is not None and not ignore_invalid_experts:
        raise ValueError("scatter_idx with expert_map requires ignore_invalid_experts")
    _check_topk_ids(topk_ids, fn)
    _check_positive_int("block_size", block_size, fn)
    _check_positive_int("num_experts", num_experts, fn)
    emap = None
    if expert_map is not None:
        emap = _check_expert_map(expert_map, num_experts, fn)
        if emap.numel() != num_experts:
            raise ValueError(
                f"{fn}: expert_map must have shape ({num_experts},) (one entry per global expert; num_experts is the "
                f"global count), got {tuple(expert_map.shape)}"
            )

    numel = topk_ids.numel()
    total_len = max_num_tokens_padded(numel, num_experts, block_size, pad_sorted_ids)
    if total_len > _INT32_MAX:
        raise ValueError(f"{fn}: sorted_token_ids would need {total_len} int32 entries (> 2**31 - 1); chunk the batch")
    num_blocks = _cdiv(total_len, block_size)

    legacy_map = emap if (emap is not None and not ignore_invalid_experts) else None
    if legacy_map is not None:  # the kernel aligns the global experts; the map is applied to expert_ids afterwards
        emap = None
    local = _local_ids(topk_ids, num_experts, emap, drop_out_of_range_ids, fn)
    device = topk_ids.device

    # Build the layout as python lists: for each local expert in order, its routes, then padding.
    sorted_ids: list[int] = []
    block_experts: list[int] = []
    for e in range(num_experts):
        routes = (local == e).nonzero().flatten().tolist()  # increasing flat index
        if not routes:
            continue
        padded = _round_up(len(routes), block_size)
        sorted_ids.extend(routes)
        sorted_ids.extend([numel] * (padded - len(routes)))
        block_experts.extend([e] * (padded // block_size))
    num_post_padded = len(sorted_ids)
    assert num_post_padded <= total_len, "layout exceeds max_num_tokens_padded (reference bug)"

    sorted_token_ids = torch.full((total_len,), numel, dtype=torch.int32)
    sorted_token_ids[:num_post_padded] = torch.tensor(sorted_ids, dtype=torch.int32)
    expert_ids = torch.full((num_blocks,), -1, dtype=torch.int32)
    expert_ids[: len(block_experts)] = torch.tensor(block_experts, dtype=torch.int32)
    num_tokens_post_padded = torch.tensor([num_post_padded], dtype=torch.int32)
    if legacy_map is not None:
        expert_ids = legacy_map[expert_ids.long()].to(torch.int32)  # -1 wraps to the last entry, as torch indexing
    out = (sorted_token_ids.to(device), expert_ids.to(device), num_tokens_post_padded.to(device))
    if return_scatter_idx:
        flat = torch.arange(numel, dtype=torch.int32)
        scatter_idx = torch.where(local >= 0, flat, torch.full_like(flat, -1)).reshape(numel, 1)
        out = (*out, scatter_idx.to(device))
    return out


def _num_recv(psum_recv_per_rank: torch.Tensor, fn: str) -> int:
    if not isinstance(psum_recv_per_rank, torch.Tensor) or psum_recv_per_rank.dim() != 1 or \
            psum_recv_per_rank.numel() == 0 or psum_recv_per_rank.dtype.is_floating_point:
        raise ValueError(f"{fn}: psum_recv_per_rank must be a non-empty 1-D integer tensor (inclusive prefix sum of "
                         f"the rows received per source rank), got {psum_recv_per_rank!r:.80}")
    return int(psum_recv_per_rank[-1])


def globalize_recv_topk_idx(
    recv_topk_idx: torch.Tensor,
    psum_recv_per_rank: torch.Tensor,
    rank_expert_offset: int,
    num_experts: int,
) -> torch.Tensor:
    """DeepEP-v2 INDEXED decode: turn the received *local* ids into global ids, in place, and return the tensor.

    Mirrors ``vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_v2.py::_globalize_recv_topk_idx``
    (vLLM 0.33.0, Triton kernel ``_globalize_recv_topk_idx_kernel``): with ``num_recv = psum_recv_per_rank[-1]``
    (read on the device), slot ``(t, k)`` becomes ``v + rank_expert_offset`` when ``v >= 0``, ``v +
    rank_expert_offset < num_experts`` and ``t < num_recv``, else -1 (rows ``>= num_recv`` are padding).

    Args:
        recv_topk_idx: ``(N, topk)`` signed integer local ids (-1 = non-local); overwritten.
        psum_recv_per_rank: 1-D integer inclusive prefix sum of the rows received per source rank.
        rank_expert_offset: this rank's first global expert id (``rank * E_local``).
        num_experts: global expert count.
    """
    fn = "globalize_recv_topk_idx"
    _check_topk_ids(recv_topk_idx, fn)
    num_recv = _num_recv(psum_recv_per_rank, fn)
    v = recv_topk_idx.long()
    g = v + rank_expert_offset
    row = torch.arange(recv_topk_idx.size(0), device=v.device).unsqueeze(1)
    valid = (v >= 0) & (g < num_experts) & (row < num_recv)
    recv_topk_idx.copy_(torch.where(valid, g, torch.full_like(g, -1)))
    return recv_topk_idx


def fused_globalize_align_block_size(
    recv_topk_idx: torch.Tensor,
    psum_recv_per_rank: torch.Tensor,
    rank_expert_offset: int,
    global_num_experts: int,
    local_num_experts: int,
    block_size: int,
    return_scatter_idx: bool = False,
) -> tuple[torch.Tensor, ...]:
    """vLLM 0.33's fused DeepEP-v2 INDEXED decode metadata: globalize the received ids and align them in one launch.

    Mirrors ``vllm/model_executor/layers/fused_moe/fused_globalize_align_block_size.py`` and its CUDA kernel
    ``csrc/moe/fused_globalize_align_block_size.cu`` (``fused_gas_body``), which replaces
    :func:`globalize_recv_topk_idx` + :func:`moe_align_block_size` (``ignore_invalid_experts=True`` with the linear
    map of this rank) + ``count_and_sort_expert_tokens``.

    With ``num_recv = psum_recv_per_rank[-1]`` a slot ``i = t * topk + k`` holding local id ``v`` is *valid* when
    ``0 <= v < local_num_experts``, ``v + rank_expert_offset < global_num_experts`` and ``t < num_recv``.

    Returns ``(recv_topk_idx, sorted_ids, expert_ids, num_tokens_post_pad)`` (+ ``scatter_idx`` when asked):

    - ``recv_topk_idx``: the input tensor, overwritten: ``v + rank_expert_offset`` on valid slots, -1 elsewhere;
    - ``sorted_ids`` / ``expert_ids`` / ``num_tokens_post_pad``: :func:`moe_align_block_size`'s layout of the valid
      slots by *local* id ``v`` over ``local_num_experts`` experts (blocks carry local ids, -1 after the last used
      block, padding value ``numel``), with ``sorted_ids`` of length ``max_num_tokens_padded(numel,
      local_num_experts, block_size)`` (the *local* count: shorter than the chain's, which uses the global count;
      vLLM's test compares the used prefix and the padding tail). Order inside an expert: increasing ``i`` here; the
      kernel's atomics leave it unspecified (compare per block as a set).
    - ``scatter_idx``: int32 ``(numel, 1)``, ``i`` on valid slots, -1 elsewhere.

    With every id in ``[-1, local_num_experts)`` (what DeepEP-v2 delivers, and vLLM's test draws) this equals the
    unfused chain. An id ``>= local_num_experts`` differs: the fused kernel drops it (-1), the chain globalizes it to
    another rank's expert and then drops it from the layout as non-local.

    Raises:
        ValueError: ``recv_topk_idx`` not a 2-D int64 tensor (vLLM asserts int64), ``local_num_experts > 1024`` (the
            kernel's shared-memory histogram; vLLM's check), non-positive sizes, a bad ``psum_recv_per_rank``.
    """
    fn = "fused_globalize_align_block_size"
    from reference.semantics import require

    require(fn, "0.33", upstream="vllm/model_executor/layers/fused_moe/fused_globalize_align_block_size.py")
    _check_topk_ids(recv_topk_idx, fn)
    if recv_topk_idx.dtype != torch.int64:
        raise ValueError(f"{fn}: recv_topk_idx must be int64, got {recv_topk_idx.dtype}")
    _check_positive_int("local_num_experts", local_num_experts, fn)
    _check_positive_int("global_num_experts", global_num_experts, fn)
    _check_positive_int("block_size", block_size, fn)
    if local_num_experts > 1024:
        raise ValueError(f"{fn}: local_num_experts <= 1024 (the kernel's per-block histogram), got "
                         f"{local_num_experts}")
    num_recv = _num_recv(psum_recv_per_rank, fn)
    v = recv_topk_idx.detach().long()
    row = torch.arange(v.size(0), device=v.device).unsqueeze(1)
    valid = (v >= 0) & (v < local_num_experts) & (v + rank_expert_offset < global_num_experts) & (row < num_recv)
    local = torch.where(valid, v, torch.full_like(v, -1))
    sorted_ids, expert_ids, num_post = moe_align_block_size(local, block_size, local_num_experts)
    recv_topk_idx.copy_(torch.where(valid, v + rank_expert_offset, torch.full_like(v, -1)))
    out = (recv_topk_idx, sorted_ids, expert_ids, num_post)
    if return_scatter_idx:
        flat = torch.arange(v.numel(), dtype=torch.int32, device=v.device)
        out = (*out, torch.where(valid.reshape(-1), flat, torch.full_like(flat, -1)).reshape(-1, 1))
    return out


def count_expert_num_tokens(
    topk_ids: torch.Tensor,
    num_local_experts: int,
    expert_map: torch.Tensor | None = None,
    *,
    drop_out_of_range_ids: bool = False,
) -> torch.Tensor:
    """Number of routes per local expert: int32 ``(num_local_experts,)``.

    Mirrors ``vllm/model_executor/layers/fused_moe/utils.py::count_expert_num_tokens`` (the modular kernel
    recomputes ``ExpertTokensMetadata.expert_num_tokens`` with it, per chunk in vLLM 0.17).

    Args:
        topk_ids: ``(M, topk)`` signed integer tensor.
        num_local_experts: number of experts on this rank (> 0).
        expert_map: optional 1-D global -> local map (-1 = other rank); its length is the global expert count, ids
            must lie in ``[0, len(expert_map))`` and its values in ``[-1, num_local_experts)``. Without a map ids
            are local ids in ``[0, num_local_experts)``.
        drop_out_of_range_ids: drop out-of-range ids instead of raising (vLLM's Triton counter silently ignores
            ids ``>= num_local_experts`` without a map, and reads ``expert_map`` out of bounds with one).

    Raises:
        ValueError: bad topk_ids / num_local_experts / expert_map; an out-of-range id (unless dropping).
    """
    fn = "count_expert_num_tokens"
    _check_topk_ids(topk_ids, fn)
    _check_positive_int("num_local_experts", num_local_experts, fn)
    emap = _check_expert_map(expert_map, num_local_experts, fn) if expert_map is not None else None
    local = _local_ids(topk_ids, num_local_experts, emap, drop_out_of_range_ids, fn)
    return torch.tensor(_counts(local, num_local_experts), dtype=torch.int32, device=topk_ids.device)


# ----------------------------------------------------------------------------------------------------------------
# DeepGEMM contiguous layout
# ----------------------------------------------------------------------------------------------------------------


def _cpu_counts(meta: Any, local_num_experts: int, fn: str) -> list[int] | None:
    """``meta.expert_num_tokens_cpu`` as a python list (None when absent), validated."""
    if meta is None:
        return None
    counts = getattr(meta, "expert_num_tokens_cpu", None)
    if counts is None:
        return None
    counts = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
    if len(counts) != local_num_experts or any(int(c) != c or c < 0 for c in counts):
        raise ValueError(
            f"{fn}: expert_tokens_meta.expert_num_tokens_cpu must hold {local_num_experts} non-negative integer "
            f"counts (one per local expert), got {counts}"
        )
    return [int(c) for c in counts]


def compute_aligned_M_and_alignment(
    M: int,
    num_topk: int,
    local_num_experts: int,
    alignment: int,
    expert_tokens_meta: Any = None,
    *,
    per_call_alignment: int | None = None,
) -> tuple[int, int]:
    """Rows of the DeepGEMM contiguous workspace and the per-expert alignment used: ``(M_sum, alignment_used)``.

    Mirrors ``vllm/model_executor/layers/fused_moe/deep_gemm_utils.py::compute_aligned_M_and_alignment``.

    - With CPU counts (``expert_tokens_meta.expert_num_tokens_cpu`` is not None; ``expert_tokens_meta`` is any
      object with that attribute, e.g. ``reference.modular.ExpertTokensMetadata``): the exact size
      ``sum_e round_up(count_e, alignment)``, and ``alignment_used = alignment``.
    - Otherwise the worst case: ``round_up(M * num_topk + min(M * num_topk, local_num_experts) * (a - 1), a)``;
      at most ``M * num_topk`` experts can be active, so the padding is capped by that (vLLM <= 0.10 used
      ``local_num_experts * (a - 1)``, far too large at decode). ``a = alignment`` unless ``per_call_alignment`` is
      given and ``<= alignment``: it stands for DeepGEMM's per-call theoretical BLOCK_M on SM100/SM120
      (``get_theoretical_mk_alignment_for_contiguous_layout(expected_m=M*num_topk, num_groups=local_num_experts)``),
      a platform fact the reference takes as a parameter; ``alignment_used = a``.

    ``M == 0`` gives ``M_sum == 0``. ``M_sum % alignment_used == 0`` always.

    Raises:
        ValueError: negative M / num_topk, non-positive local_num_experts / alignment / per_call_alignment,
            CPU counts of the wrong length or negative.
    """
    fn = "compute_aligned_M_and_alignment"
    _check_nonnegative_int("M", M, fn)
    _check_nonnegative_int("num_topk", num_topk, fn)
    _check_positive_int("local_num_experts", local_num_experts, fn)
    _check_positive_int("alignment", alignment, fn)
    if per_call_alignment is not None:
        _check_positive_int("per_call_alignment", per_call_alignment, fn)

    counts = _cpu_counts(expert_tokens_meta, local_num_experts, fn)
    if counts is not None:
        return sum(_round_up(c, alignment) for c in counts), alignment

    if per_call_alignment is not None and per_call_alignment <= alignment:
        alignment = per_call_alignment
    expected_m = M * num_topk
    max_active_experts = min(expected_m, local_num_experts)
    M_sum = _round_up(expected_m + max_active_experts * (alignment - 1), alignment)
    return M_sum, alignment


def deepgemm_moe_permute(
    aq: torch.Tensor,
    aq_scale: torch.Tensor | None,
    topk_ids: torch.Tensor,
    local_num_experts: int,
    expert_map: torch.Tensor | None = None,
    expert_tokens_meta: Any = None,
    aq_out: torch.Tensor | None = None,
    block_size: int | None = None,
    use_psum_layout: bool = False,
    alignment: int = DEEP_GEMM_M_ALIGNMENT,
    *,
    per_call_alignment: int | None = None,
    drop_out_of_range_ids: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, int]:
    """Scatter activation rows into DeepGEMM's contiguous grouped layout (one row per local route).

    Mirrors ``vllm/model_executor/layers/fused_moe/deep_gemm_utils.py::deepgemm_moe_permute`` (``ep_scatter``,
    from LightLLM), as called by ``DeepGemmExperts.apply`` (seed 001).

    Args:
        aq: ``(M, K)`` activations (any dtype; fp8 e4m3 on the DeepGEMM path). Rows are copied bit-exactly.
        aq_scale: ``(M, K // block_size)`` per-token-group scales (fp32; or uint8 UE8M0 bytes for MXFP8), or None.
        topk_ids: ``(M, topk)`` signed integer ids (global ids when ``expert_map`` is given, else local ids).
        local_num_experts: experts on this rank (``w1.size(0)``).
        expert_map: optional 1-D global -> local map, -1 for other ranks (non-local routes are dropped).
        expert_tokens_meta: optional object with ``expert_num_tokens`` (device counts, used by vLLM to place rows)
            and ``expert_num_tokens_cpu`` (used for ``M_sum``); both, when not None, must equal the counts of
            ``topk_ids`` (stale counts were vLLM #20392).
        aq_out: optional ``(M_sum, K)`` output buffer of ``aq.dtype`` (vLLM passes a view of workspace13); fully
            overwritten and returned.
        block_size: K group size of ``aq_scale`` (None: DeepGEMM's ``block_k = 128``; MXFP8 passes 32).
        use_psum_layout: vLLM 0.33 (DeepGEMM's psum layout, used on SM100 by ``deep_gemm_moe.py``): the rows are
            placed exactly as in the contiguous layout, but ``expert_ids`` is replaced by the per-expert *logical
            ends*: int32 ``(local_num_experts,)``, entry ``e`` = ``start_e + count_e`` (the preceding experts'
            alignment gaps included; ``ep_scatter``'s ``_fwd_kernel_ep_scatter_1`` with ``USE_PSUM_LAYOUT``), which
            the GEMM reads as ``expert_ends`` with ``expert_alignment = alignment_used``. Under the 0.17 semantics
            it raises SemanticsError (0.17.0 has no such argument).
        alignment: per-expert M alignment (DeepGEMM ``block_m``, 128).
        per_call_alignment: see :func:`compute_aligned_M_and_alignment`.
        drop_out_of_range_ids: drop ids outside the id space instead of raising (see module docstring).

    Returns:
        ``(aq_perm, aq_scale_perm, expert_ids, inv_perm, alignment_used)`` with ``(M_sum, alignment_used) =
        compute_aligned_M_and_alignment(M, topk, local_num_experts, alignment, expert_tokens_meta, ...)``:

        - Local expert ``e`` owns rows ``[start_e, start_e + count_e)`` where ``start_e = sum_{j<e}
          round_up(count_j, alignment_used)``, so every expert starts at a multiple of ``alignment_used``; its
          routes fill them in increasing flat index ``t * topk + k``.
        - ``aq_perm``: ``(M_sum, K)``, ``aq.dtype``: row of route (t, k) = ``aq[t]``; every other row is zero
          (vLLM leaves them uninitialised; DeepGEMM skips them, so a conformance check compares valid rows only).
        - ``aq_scale_perm``: ``(M_sum, K // block_size)``, ``aq_scale.dtype``, zero-initialised, row of route
          (t, k) = ``aq_scale[t]``; None if ``aq_scale`` is None. vLLM packs uint8 UE8M0 scales four to an int32
          in DeepGEMM's MN-major TMA-aligned layout; the reference returns them unpacked (pack with the quant
          module's UE8M0 packing to compare).
        - ``expert_ids`` (DeepGEMM ``m_indices``/``grouped_layout``): int32 ``(M_sum,)``, ``e`` on the rows of
          expert ``e``, ``-1`` on every padding row (DeepGEMM skips negative rows); with ``use_psum_layout`` the
          int32 ``(local_num_experts,)`` logical ends instead.
        - ``inv_perm``: int32 ``(M, topk)``: the row of route (t, k), ``-1`` for dropped / non-local routes (vLLM
          leaves those entries uninitialised).
        - ``alignment_used``: int.

    Raises:
        ValueError: malformed shapes/dtypes; ``aq_out`` of the wrong shape/dtype; counts in ``expert_tokens_meta``
            that disagree with ``topk_ids``; out-of-range ids (unless dropping); M_sum too large for int32.
    """
    fn = "deepgemm_moe_permute"
    _check_topk_ids(topk_ids, fn)
    _check_positive_int("local_num_experts", local_num_experts, fn)
    _check_positive_int("alignment", alignment, fn)
    if not isinstance(aq, torch.Tensor) or aq.dim() != 2:
        raise ValueError(f"{fn}: aq must be a 2-D (M, K) tensor, got {getattr(aq, 'shape', aq)!r}")
    M, K = aq.shape
    topk = topk_ids.size(1)
    if topk_ids.size(0) != M:
        raise ValueError(
            f"{fn}: topk_ids has {topk_ids.size(0)} rows but aq has {M}; they must describe the same tokens"
        )
    block_k = DEEP_GEMM_BLOCK_K if block_size is None else block_size
    _check_positive_int("block_size", block_k, fn)
    if aq_scale is not None:
        if K % block_k != 0:
            raise ValueError(f"{fn}: K={K} is not a multiple of the scale group size block_size={block_k}")
        if aq_scale.dim() != 2 or tuple(aq_scale.shape) != (M, K // block_k):
            raise ValueError(
                f"{fn}: aq_scale must have shape (M, K // block_size) = ({M}, {K // block_k}) (per-token-group "
                f"scales), got {tuple(aq_scale.shape)}"
            )
    emap = _check_expert_map(expert_map, local_num_experts, fn) if expert_map is not None else None
    local = _local_ids(topk_ids, local_num_experts, emap, drop_out_of_range_ids, fn)
    counts = _counts(local, local_num_experts)

    if expert_tokens_meta is not None:
        for attr in ("expert_num_tokens", "expert_num_tokens_cpu"):
            given = getattr(expert_tokens_meta, attr, None)
            if given is None:
                continue
            given_list = given.tolist() if isinstance(given, torch.Tensor) else list(given)
            if given_list != counts:
                raise ValueError(
                    f"{fn}: expert_tokens_meta.{attr} = {given_list} but topk_ids route {counts} tokens to the local "
                    "experts; recompute it with count_expert_num_tokens for these topk_ids (stale counts: vLLM #20392)"
                )

    M_sum, align_used = compute_aligned_M_and_alignment(
        M, topk, local_num_experts, alignment, expert_tokens_meta, per_call_alignment=per_call_alignment
    )
    if M_sum > _INT32_MAX:
        raise ValueError(f"{fn}: M_sum={M_sum} rows do not fit int32 indices; chunk the batch")

    # Layout: expert e starts at the aligned prefix sum of the counts before it.
    starts: list[int] = []
    offset = 0
    for e in range(local_num_experts):
        starts.append(offset)
        offset += _round_up(counts[e], align_used)
    assert offset <= M_sum, "layout exceeds M_sum (reference bug)"

    inv_perm = torch.full((M * topk,), -1, dtype=torch.int64)
    expert_ids = torch.full((M_sum,), -1, dtype=torch.int32)
    for e in range(local_num_experts):
        routes = (local == e).nonzero().flatten()  # increasing flat index
        rows = starts[e] + torch.arange(routes.numel())
        inv_perm[routes] = rows
        expert_ids[starts[e] : starts[e] + routes.numel()] = e

    if use_psum_layout:
        from reference.semantics import require

        require("deepgemm_moe_permute(use_psum_layout=True)", "0.33",
                upstream="vllm/model_executor/layers/fused_moe/deep_gemm_utils.py")
        expert_ids = torch.tensor([starts[e] + counts[e] for e in range(local_num_experts)], dtype=torch.int32)

    kept = (inv_perm >= 0).nonzero().flatten()  # flat route indices of kept routes
    dst_rows = inv_perm[kept]
    src_tokens = kept // topk if topk else kept

    device = aq.device
    if aq_out is None:
        aq_out = torch.empty((M_sum, K), dtype=aq.dtype, device=device)
    elif tuple(aq_out.shape) != (M_sum, K) or aq_out.dtype != aq.dtype:
        raise ValueError(
            f"{fn}: aq_out must be ({M_sum}, {K}) of {aq.dtype} (M_sum from compute_aligned_M_and_alignment), got "
            f"{tuple(aq_out.shape)} of {aq_out.dtype}"
        )
    aq_out.zero_()
    aq_out[dst_rows.to(device)] = aq[src_tokens.to(device)]

    aq_scale_perm = None
    if aq_scale is not None:
        aq_scale_perm = torch.zeros((M_sum, aq_scale.size(1)), dtype=aq_scale.dtype, device=aq_scale.device)
        aq_scale_perm[dst_rows.to(aq_scale.device)] = aq_scale[src_tokens.to(aq_scale.device)]

    return (
        aq_out,
        aq_scale_perm,
        expert_ids.to(device),
        inv_perm.to(torch.int32).reshape(M, topk).to(device),
        align_used,
    )


def deepgemm_unpermute_and_reduce(
    a: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    inv_perm: torch.Tensor,
    expert_map: torch.Tensor | None,
    output: torch.Tensor,
    *,
    drop_out_of_range_ids: bool = False,
) -> torch.Tensor:
    """Gather the grouped GEMM output back to tokens and reduce over top-k: ``output[t] = sum_k w[t,k] * a[row]``.

    Mirrors ``vllm/model_executor/layers/fused_moe/deep_gemm_utils.py::deepgemm_unpermute_and_reduce``
    (``ep_gather``).

    Numerics: per token, an fp32 accumulator starts at 0 and, for ``k = 0 .. topk-1`` in order, adds
    ``a[inv_perm[t, k]].float() * topk_weights[t, k].float()`` (product rounded to fp32, then the sum) for every
    *local* route; the accumulator is cast once to ``output.dtype``. A GPU kernel may fuse the multiply-add (FMA),
    so a backend is compared with an fp32-accumulation tolerance, not bitwise. Tokens with no local route get 0.
    Every row of ``output`` is written.

    A route is local when its id is not -1 and (with ``expert_map``) ``expert_map[id] >= 0``; ``inv_perm`` of
    other routes is ignored (vLLM leaves it uninitialised). Without a map the expert count is not known here: a
    route whose id is ``>= 0`` but whose ``inv_perm`` is -1 was dropped by the permute, which is allowed only with
    ``drop_out_of_range_ids=True``.

    Args:
        a: ``(M_sum, K)`` floating GEMM output in the permuted row order.
        topk_ids: ``(M, topk)`` signed integer ids, the same as given to :func:`deepgemm_moe_permute`.
        topk_weights: ``(M, topk)`` floating router weights (pass ones when the weight was applied on the input).
        inv_perm: ``(M, topk)`` integer rows from :func:`deepgemm_moe_permute`.
        expert_map: the same map as given to the permute, or None.
        output: ``(M, K)`` floating tensor, overwritten.

    Returns:
        ``output`` (vLLM returns None; the reference returns the tensor it wrote).

    Raises:
        ValueError: shape/dtype mismatches; an id outside ``[0, len(expert_map))`` other than -1 (unless
            dropping); a local route whose ``inv_perm`` is not a row of ``a``.
    """
    fn = "deepgemm_unpermute_and_reduce"
    _check_topk_ids(topk_ids, fn)
    M, topk = topk_ids.shape
    for name, t in (("a", a), ("output", output)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.dtype.is_floating_point:
            raise ValueError(f"{fn}: {name} must be a 2-D floating tensor, got {getattr(t, 'shape', t)!r}")
    if output.size(0) != M or output.size(1) != a.size(1):
        raise ValueError(f"{fn}: output must be (M, K) = ({M}, {a.size(1)}), got {tuple(output.shape)}")
    if tuple(topk_weights.shape) != (M, topk) or not topk_weights.dtype.is_floating_point:
        raise ValueError(f"{fn}: topk_weights must be floating ({M}, {topk}), got {tuple(topk_weights.shape)} "
                         f"{topk_weights.dtype}")
    if tuple(inv_perm.shape) != (M, topk) or inv_perm.dtype.is_floating_point or inv_perm.dtype == torch.bool:
        raise ValueError(f"{fn}: inv_perm must be integer ({M}, {topk}), got {tuple(inv_perm.shape)} {inv_perm.dtype}")

    emap = _check_expert_map(expert_map, None, fn) if expert_map is not None else None
    local = _local_ids(topk_ids, None, emap, drop_out_of_range_ids, fn).reshape(M, topk)
    rows = inv_perm.detach().to("cpu", torch.int64)
    is_local = local >= 0
    if emap is None and drop_out_of_range_ids:
        is_local &= rows != -1  # dropped by the permute as out of range
    bad = is_local & ((rows < 0) | (rows >= a.size(0)))
    if bool(bad.any()):
        t, k = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"{fn}: route ({t}, {k}) is local but inv_perm[{t}, {k}] = {int(rows[t, k])} is not a row of a "
            f"(0..{a.size(0) - 1}); pass the topk_ids / expert_map / inv_perm of the same deepgemm_moe_permute call"
        )

    device = a.device
    acc = torch.zeros((M, a.size(1)), dtype=torch.float32, device=device)
    weights = topk_weights.to(device=device, dtype=torch.float32)
    for k in range(topk):  # k in increasing order: this fixes the fp32 summation order
        mask = is_local[:, k].to(device)
        term = torch.zeros_like(acc)
        term[mask] = a[rows[:, k].to(device)[mask]].float() * weights[mask, k : k + 1]
        acc = acc + term
    output.copy_(acc.to(output.dtype))
    return output


# ----------------------------------------------------------------------------------------------------------------
# vLLM's moe_permute / moe_unpermute (fused_moe/moe_permute_unpermute.py; CUTLASS grouped-GEMM layout)
# ----------------------------------------------------------------------------------------------------------------


def _permute_keys(topk_ids: torch.Tensor, n_expert: int, expert_map: torch.Tensor | None) -> torch.Tensor:
    """``preprocessTopkIdKernel``'s sort key per flat route: the local id; ``id + n_expert`` for a non-local
    expert; ``n_expert`` for an id outside ``[0, n_expert)`` (-1 padding)."""
    ids = topk_ids.detach().reshape(-1).to("cpu", torch.int64)
    in_range = (ids >= 0) & (ids < n_expert)
    emap = (torch.arange(n_expert) if expert_map is None
            else expert_map.detach().to("cpu", torch.int64))
    local = torch.full_like(ids, -1)
    local[in_range] = emap[ids[in_range]]
    key = torch.full_like(ids, n_expert)
    key[in_range] = torch.where(local[in_range] != -1, local[in_range], ids[in_range] + n_expert)
    return key


def moe_permute(
    hidden_states: torch.Tensor,
    a1q_scale: torch.Tensor | None,
    topk_ids: torch.Tensor,
    n_expert: int,
    n_local_expert: int = -1,
    expert_map: torch.Tensor | None = None,
    permuted_hidden_states: torch.Tensor | None = None,
    scratch: object | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expand and permute the activation rows so that each local expert's routes are contiguous.

    Mirrors ``vllm/model_executor/layers/fused_moe/moe_permute_unpermute.py::moe_permute`` (vLLM 0.17.0 / 0.33.0)
    and its kernels ``csrc/moe/permute_unpermute_kernels/`` (``preprocessTopkIdKernel``, a CUB radix sort,
    ``computeExpertOffsetsAndInverseKernel``, ``expandInputRowsKernel``). ``scratch`` (0.33's reusable buffers) does
    not change the result.

    Layout. Route ``i = t * topk + k`` gets the key ``local id`` (``expert_map[id]``, or ``id`` without a map) when
    its expert is local, ``id + n_expert`` when not, and ``n_expert`` when ``id`` is outside ``[0, n_expert)``
    (-1 padding). The routes are sorted by key, stably (ties by ``i``): permuted row ``r`` holds route
    ``src[r]``. ``valid = expert_first_token_offset[n_local_expert]`` routes are local.

    Returns ``(permuted_hidden_states, a1q_scale, expert_first_token_offset, inv_permuted_idx, permuted_idx)``:

    - ``permuted_hidden_states``: ``(M * topk, K)``, row ``r = hidden_states[src[r] // topk]`` bit-exactly for
      ``r < valid`` (every row without ``expert_map``); with a map the rows ``>= valid`` are not written (vLLM's
      ``torch.empty``: unspecified; the reference writes zeros there);
    - ``a1q_scale``: with ``a1q_scale.dim() > 1`` the per-row scales ``a1q_scale[permuted_idx.clamp(max=M*topk-1) //
      topk]`` (rows past ``valid`` therefore take token ``M - 1``'s scale); otherwise the argument unchanged;
    - ``expert_first_token_offset``: int64 ``(n_local_expert + 1,)``, entry ``e`` = the number of keys ``< e``;
    - ``inv_permuted_idx``: int32 ``(M * topk,)``, the permuted row of every route (non-local and -1 ones too);
    - ``permuted_idx``: int32 ``(M * topk,)``, ``src[r]`` for the written rows, ``M * topk`` for the others.

    Raises:
        ValueError: ``hidden_states`` not 2-D or its row not a multiple of 16 bytes (vLLM asserts), ``topk_ids`` not
            ``(M, topk)`` integer, ``expert_map`` not of length ``n_expert``, a ``permuted_hidden_states`` of the
            wrong shape.
    """
    fn = "moe_permute"
    _check_topk_ids(topk_ids, fn)
    _check_positive_int("n_expert", n_expert, fn)
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2:
        raise ValueError(f"{fn}: hidden_states must be 2-D (M, K), got {getattr(hidden_states, 'shape', None)}")
    M, K = hidden_states.shape
    if (K * hidden_states.element_size()) % 16:
        raise ValueError(f"{fn}: the permute kernel needs the hidden dim aligned to 16 bytes, got K={K} of "
                         f"{hidden_states.dtype}")
    if topk_ids.size(0) != M:
        raise ValueError(f"{fn}: topk_ids has {topk_ids.size(0)} rows, hidden_states {M}")
    n_local = n_expert if n_local_expert == -1 else n_local_expert
    _check_positive_int("n_local_expert", n_local, fn)
    if expert_map is not None and (expert_map.dim() != 1 or expert_map.numel() != n_expert):
        raise ValueError(f"{fn}: expert_map must be ({n_expert},), got {tuple(expert_map.shape)}")
    topk = topk_ids.size(1)
    rows = M * topk
    if permuted_hidden_states is not None and tuple(permuted_hidden_states.shape) != (rows, K):
        raise ValueError(f"{fn}: Expected permuted hidden states to be {(rows, K)} but got "
                         f"{tuple(permuted_hidden_states.shape)}")
    key = _permute_keys(topk_ids, n_expert, expert_map)
    from reference.semantics import SemanticsVersion, resolve_semantics

    flat_ids = topk_ids.detach().reshape(-1).cpu()
    if resolve_semantics() < SemanticsVersion.V0_33 and bool(((flat_ids < 0) | (flat_ids >= n_expert)).any()):
        raise ValueError(f"{fn}: topk_ids outside [0, {n_expert}) (e.g. -1 padding) are not defined under vLLM 0.17 "
                         "(an out-of-bounds expert_map read / a negative radix-sort key); 0.33 sorts them last "
                         "(point align.moe_permute_invalid_ids)")
    src = torch.sort(key, stable=True).indices  # permuted row r holds flat route src[r]
    sorted_keys = key[src]
    offsets = torch.tensor([int((sorted_keys < e).sum()) for e in range(n_local + 1)], dtype=torch.int64)
    inv = torch.empty(rows, dtype=torch.int64)
    inv[src] = torch.arange(rows)
    n_written = int(offsets[-1]) if expert_map is not None else rows
    permuted_idx = torch.full((rows,), rows, dtype=torch.int64)
    permuted_idx[:n_written] = src[:n_written]
    dev = hidden_states.device
    out = permuted_hidden_states if permuted_hidden_states is not None else \
        torch.empty((rows, K), dtype=hidden_states.dtype, device=dev)
    out.zero_()
    if n_written:
        out[:n_written] = hidden_states[(src[:n_written] // topk).to(dev)]
    if a1q_scale is not None and a1q_scale.dim() > 1:
        a1q_scale = a1q_scale[(permuted_idx.clamp(max=max(rows - 1, 0)) // topk).to(a1q_scale.device)]
    return (out, a1q_scale, offsets.to(dev), inv.to(torch.int32).to(dev), permuted_idx.to(torch.int32).to(dev))


def moe_unpermute(
    out: torch.Tensor,
    permuted_hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    inv_permuted_idx: torch.Tensor,
    expert_first_token_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather the permuted rows back to tokens and reduce over top-k: the inverse of :func:`moe_permute`.

    Mirrors ``moe_permute_unpermute.py::moe_unpermute`` and ``finalizeMoeRoutingKernel``
    (``moe_permute_unpermute_kernel.inl``): for token ``t`` an fp32 accumulator starts at 0 and for ``k = 0 ..
    topk-1`` in order adds ``topk_weights[t, k] * float(x[inv_permuted_idx[t * topk + k]])``, skipping a route
    whose row is ``>= expert_first_token_offset[-1]`` (a non-local or -1 route) when the offsets are given; the
    accumulator is cast once to ``out.dtype`` and every row of ``out`` is written (a token with no kept route: 0).
    A GPU kernel may fuse the multiply-add (FMA): compare with an fp32-accumulation tolerance.

    Args:
        out: ``(M, K)`` output, ``permuted_hidden_states.dtype``; overwritten (vLLM returns None, the reference
            returns ``out``).
        permuted_hidden_states: ``(M * topk, K)`` rows in the permuted order (the grouped GEMM's output).
        topk_weights: ``(M, topk)`` float32 (the kernel reads them as ``float*``).
        inv_permuted_idx: ``(M * topk,)`` or ``(M, topk)`` int32 from :func:`moe_permute`.
        expert_first_token_offset: int64 ``(n_local_expert + 1,)`` or None (then every route is summed).

    Raises:
        ValueError: dtype mismatch of ``out`` and ``permuted_hidden_states`` (vLLM's check), non-float32 weights,
            shape mismatches, a row that does not exist.
    """
    fn = "moe_unpermute"
    if permuted_hidden_states.dtype != out.dtype:
        raise ValueError(f"{fn}: permuted_hidden_states dtype must be same as hidden_states "
                         f"({permuted_hidden_states.dtype} vs {out.dtype})")
    if topk_weights.dtype != torch.float32 or topk_weights.dim() != 2:
        raise ValueError(f"{fn}: topk_weights must be a 2-D float32 tensor (read as float*), got "
                         f"{topk_weights.dtype} {tuple(topk_weights.shape)}")
    M, topk = topk_weights.shape
    K = permuted_hidden_states.size(-1)
    if out.dim() != 2 or tuple(out.shape) != (M, K):
        raise ValueError(f"{fn}: out must be ({M}, {K}), got {tuple(out.shape)}")
    if (K * out.element_size()) % 16:
        raise ValueError(f"{fn}: the unpermute kernel needs the hidden dim aligned to 16 bytes, got K={K}")
    rows = inv_permuted_idx.detach().reshape(-1).to("cpu", torch.int64)
    if rows.numel() != M * topk:
        raise ValueError(f"{fn}: inv_permuted_idx has {rows.numel()} entries, expected M * topk = {M * topk}")
    rows = rows.reshape(M, topk)
    keep = torch.ones_like(rows, dtype=torch.bool)
    if expert_first_token_offset is not None:
        keep = rows < int(expert_first_token_offset.reshape(-1)[-1])
    if bool((keep & ((rows < 0) | (rows >= permuted_hidden_states.size(0)))).any()):
        raise ValueError(f"{fn}: inv_permuted_idx names a row outside permuted_hidden_states "
                         f"(0..{permuted_hidden_states.size(0) - 1})")
    dev = out.device
    acc = torch.zeros((M, K), dtype=torch.float32, device=dev)
    w = topk_weights.to(dev)
    for k in range(topk):  # k in increasing order: the kernel's summation order
        m = keep[:, k].to(dev)
        term = torch.zeros_like(acc)
        term[m] = w[m, k: k + 1] * permuted_hidden_states[rows[:, k].to(dev)[m]].float()
        acc = acc + term
    out.copy_(acc.to(out.dtype))
    return out


# ----------------------------------------------------------------------------------------------------------------
# DeepGEMM support gate (seed 001)
# ----------------------------------------------------------------------------------------------------------------


def _valid_deep_gemm_shape(M: int, N: int, K: int, alignment: int = DEEP_GEMM_M_ALIGNMENT) -> bool:
    """``alignment <= M and N % alignment == 0 and K % alignment == 0``.

    Mirrors ``vllm/model_executor/layers/fused_moe/experts/deep_gemm_moe.py::_valid_deep_gemm_shape`` (alignment =
    ``get_mk_alignment_for_contiguous_layout()[0]``). Pure predicate, never raises.
    """
    return alignment <= M and N % alignment == 0 and K % alignment == 0


def valid_deep_gemm(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    alignment: int = DEEP_GEMM_M_ALIGNMENT,
) -> tuple[bool, str | None]:
    """Whether the DeepGEMM grouped GEMM path accepts this problem: ``(ok, reason_if_not)``.

    Mirrors ``_valid_deep_gemm`` of seed 001 (``experts/deep_gemm_moe.py``), checks in its order, with
    ``M = hidden_states.size(0)`` and ``_, K, N = w2.size()`` (so ``N`` is the intermediate size ``w2.size(2)``):

    1. shape: ``M >= alignment``, ``N % alignment == 0``, ``K % alignment == 0``;
    2. ``N > 512`` (below that vLLM prefers Triton);
    3. ``w1`` and ``w2`` are ``torch.float8_e4m3fn``;
    4. ``hidden_states``, ``w1``, ``w2`` are contiguous.

    vLLM's first check (``has_deep_gemm()``, the package being importable) is a platform fact and belongs to the
    backend's availability check, not to this predicate. The reason string names the failed rule and the values.

    Raises:
        ValueError: hidden_states not 2-D or w1/w2 not 3-D (malformed input, not an unsupported problem).
    """
    fn = "valid_deep_gemm"
    if hidden_states.dim() != 2:
        raise ValueError(f"{fn}: hidden_states must be 2-D (M, K), got {tuple(hidden_states.shape)}")
    if w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"{fn}: w1 and w2 must be 3-D (E, N, K) / (E, K, N), got {tuple(w1.shape)}, {tuple(w2.shape)}")
    _check_positive_int("alignment", alignment, fn)
    M = hidden_states.size(0)
    _, K, N = w2.shape
    if not _valid_deep_gemm_shape(M, N, K, alignment):
        return False, (
            f"unaligned problem size M={M}, N={N}, K={K}: M must be >= {alignment} and N, K multiples of {alignment}"
        )
    if N <= 512:
        return False, f"N={N} <= 512 (M={M}, K={K}): Triton is used for such shapes"
    if w1.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        return False, f"weights must be float8_e4m3fn, got w1.dtype={w1.dtype}, w2.dtype={w2.dtype}"
    if not (hidden_states.is_contiguous() and w1.is_contiguous() and w2.is_contiguous()):
        return False, (
            "weights or activations not contiguous: hidden_states="
            f"{hidden_states.is_contiguous()}, w1={w1.is_contiguous()}, w2={w2.is_contiguous()}"
        )
    return True, None


def _register_points() -> None:
    from reference.semantics import register_point

    up17 = "vLLM 0.17.0 vllm/model_executor/layers/fused_moe/"
    up33 = "vLLM 0.33.0 vllm/model_executor/layers/fused_moe/"
    register_point(
        "align.moe_align_scatter_idx", component="align",
        behaviour={"0.17": "moe_align_block_size(..., ignore_invalid_experts) returns three tensors; "
                           "return_scatter_idx raises SemanticsError.",
                   "0.33": "return_scatter_idx=True appends an int32 (numel, 1) scatter index (i for a kept route, "
                           "-1 otherwise); with an expert_map it needs ignore_invalid_experts=True (ValueError)."},
        upstream={"0.17": up17 + "moe_align_block_size.py",
                  "0.33": up33 + "moe_align_block_size.py, csrc/moe/moe_align_sum_kernels.cu"},
        reference="reference.align.moe_align_block_size")
    register_point(
        "align.fused_globalize_align_block_size", component="align",
        behaviour={"0.17": "not defined (SemanticsError): no DeepEP-v2 INDEXED decode metadata op.",
                   "0.33": "fused_globalize_align_block_size: received local ids valid when in [0, E_local), "
                           "globalizable and in a row < psum_recv_per_rank[-1]; globalized in place (-1 else) and "
                           "aligned by local id over E_local experts (+ scatter index)."},
        upstream={"0.17": up17 + " (absent)",
                  "0.33": up33 + "fused_globalize_align_block_size.py, csrc/moe/fused_globalize_align_block_size.cu, "
                                 "prepare_finalize/deepep_v2.py (_globalize_recv_topk_idx)"},
        reference="reference.align.fused_globalize_align_block_size")
    register_point(
        "align.deepgemm_psum_layout", component="align",
        behaviour={"0.17": "deepgemm_moe_permute has no use_psum_layout (True raises SemanticsError): expert_ids "
                           "is the per-row m_indices, -1 on padding rows.",
                   "0.33": "use_psum_layout=True (SM100): same rows; expert_ids is the int32 (E_local,) logical "
                           "ends start_e + count_e."},
        upstream={"0.17": up17 + "deep_gemm_utils.py", "0.33": up33 + "deep_gemm_utils.py (ep_scatter)"},
        reference="reference.align.deepgemm_moe_permute")
    register_point(
        "align.moe_permute_invalid_ids", component="align",
        behaviour={"0.17": "moe_permute needs every id in [0, n_expert): a -1 is undefined upstream (an "
                           "out-of-bounds expert_map read, a negative sort key) and raises ValueError.",
                   "0.33": "an id outside [0, n_expert) gets the sort key n_expert (after every local expert; equal to "
                           "a non-local expert 0's key n_expert + 0, ties by flat index); the rest is unchanged."},
        upstream={"0.17": "vLLM 0.17.0 csrc/moe/permute_unpermute_kernels/moe_permute_unpermute_kernel.cu "
                          "(preprocessTopkIdKernel)",
                  "0.33": "vLLM 0.33.0 csrc/moe/permute_unpermute_kernels/moe_permute_unpermute_kernel.cu "
                          "(preprocessTopkIdKernel), csrc/moe/moe_permute_unpermute_op.cu"},
        reference="reference.align.moe_permute")


_register_points()
