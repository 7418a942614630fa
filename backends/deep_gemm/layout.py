"""DeepGEMM's M-grouped *contiguous* layout, built with torch ops on the device (no Python loop over experts, no
host synchronisation unless validation is asked for).

The layout (the same as ``reference.align.deepgemm_moe_permute``, seed 001's ``deepgemm_moe_permute`` /
``ep_scatter``): local expert ``e`` owns rows ``[start_e, start_e + count_e)`` of an ``(M_sum, K)`` buffer,
``start_e = sum_{j<e} round_up(count_j, alignment)``; its routes ``(t, k)`` fill the rows in increasing flat index
``t * topk + k``. ``m_indices[row]`` (DeepGEMM's ``grouped_layout``) is ``e`` on the rows of expert ``e`` and -1 on
every other row. DeepGEMM reads the group of an M block from the *first* row of the block
(``grouped_layout[m_block_idx * BLOCK_M]``, ``deep_gemm/include/deep_gemm/scheduler/gemm.cuh``) and skips blocks
(and 64-row WGMMA halves) whose first row is -1, so every expert must start at a multiple of BLOCK_M
(``get_mk_alignment_for_contiguous_layout()`` = 128 on SM90) and BLOCK_M must not exceed the alignment.

Algorithm (every step a torch op, O(M * topk) work, same results on CPU and CUDA):

1. local id of each route (``expert_map`` gather, -1 for non-local / -1 ids);
2. stable sort of the routes by local id (dropped routes sort last), ``counts = bincount``;
3. ``row = start[e] + (position in sorted order - first position of e)``; dropped routes get the *trash* row
   ``M_sum`` of ``(M_sum + 1)``-long index buffers, which are then cut to ``M_sum``;
4. ``row_token[row]`` = source token (scatter), ``m_indices[row]`` = e (scatter), ``inv_perm[t, k] = row``.

Rows the layout does not use get ``row_token = 0`` instead of being left uninitialised, so the gathered activation
buffer holds finite copies of token 0 there (vLLM leaves them uninitialised; the reference zeroes them): DeepGEMM
computes padding rows that share a block with real rows, and finite inputs keep those throw-away rows finite. (The
fused input quantization of :func:`quantize_scatter` / ``triton_kernels.quantize_scatter`` writes the routed rows
only: padding rows then hold whatever the workspace held. No output depends on them: a padding row's GEMM result is
its own row, and the reduction reads routed rows only.)

The *masked* layout (DeepGEMM's ``m_grouped_fp8_gemm_nt_masked``, vLLM's ``BatchedDeepGemmExperts``) is the same
construction with fixed slots: expert ``e`` owns rows ``[e * slot_rows, e * slot_rows + count_e)`` of an ``(E_local *
slot_rows, K)`` buffer, viewed ``(E_local, slot_rows, K)``; ``masked_m = min(counts, slot_rows)``. A route that does not
fit its slot (more than ``slot_rows`` routes on one expert: duplicate ids in a token) is dropped and poisoned.

Poisoned routes: ``inv_perm = -2`` (:data:`POISON_ROW`) marks a route whose id is outside the id space or that found
no row (``M_sum`` / ``slot_rows`` too small). The reduction writes NaN into its token's output row, so a bad input
that is not validated (validation needs a device->host copy; ``DeepGemmExperts.validate_routes``) gives a loud NaN,
never a plausible wrong number. ``inv_perm = -1`` is a route legitimately dropped (id -1, or non-local under
``expert_map``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "POISON_ROW",
    "ContiguousLayout",
    "build_contiguous_layout",
    "gather_rows",
    "gather_scales_mn_major",
    "mn_major_tma_aligned_empty",
    "quantize_scatter",
    "sf_addressing",
    "sf_empty",
    "tma_aligned_size",
    "unpermute_and_reduce",
    "round_up",
]


#: ``inv_perm`` value of a poisoned route (out-of-range id, or no row left for it): its token's output is NaN.
POISON_ROW = -2


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def tma_aligned_size(mn: int, element_size: int = 4) -> int:
    """DeepGEMM ``get_tma_aligned_size``: ``mn`` rounded up so ``mn * element_size`` is a multiple of 16 bytes."""
    if element_size <= 0 or 16 % element_size:
        raise ValueError(f"element_size must divide 16, got {element_size}")
    return round_up(mn, 16 // element_size)


@dataclass
class ContiguousLayout:
    """Result of :func:`build_contiguous_layout` (all tensors on the device of ``topk_ids``).

    Attributes:
        row_token: int64 ``(M_sum,)``: the token whose activation row goes to each row (0 on unused rows); None when
            the builder was asked not to build it (``triton_kernels``' ``with_row_token=False``).
        m_indices: int32 ``(M_sum,)``: local expert of each row, -1 on padding / unused rows (DeepGEMM
            ``grouped_layout`` for ``use_psum_layout=False``); None for the Triton-built masked layout (the masked
            GEMM reads ``masked_m``).
        inv_perm: int64 ``(M, topk)``: the row of each route, -1 for dropped (non-local / -1) routes,
            :data:`POISON_ROW` for poisoned ones (module docstring).
        counts: int64 ``(E_local,)``: routes per local expert.
        M_sum: rows of the layout; alignment: per-expert row alignment used.
        slot_rows: None for the contiguous layout; for the masked layout the rows of each expert's slot
            (``M_sum = E_local * slot_rows``).
        masked_m_buf: the masked layout's ``masked_m`` when the builder wrote it (else derived from ``counts``).
    """

    row_token: torch.Tensor
    m_indices: torch.Tensor
    inv_perm: torch.Tensor
    counts: torch.Tensor
    M_sum: int
    alignment: int
    slot_rows: int | None = None
    masked_m_buf: torch.Tensor | None = None

    @property
    def masked(self) -> bool:
        return self.slot_rows is not None

    @property
    def masked_m(self) -> torch.Tensor:
        """int32 ``(E_local,)`` rows used in each slot (DeepGEMM's ``masked_m``; counts capped at the slot)."""
        if self.masked_m_buf is not None:
            return self.masked_m_buf
        return self.counts.clamp(max=self.slot_rows if self.masked else self.M_sum).to(torch.int32)


def local_expert_ids(topk_ids: torch.Tensor, local_num_experts: int,
                     expert_map: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(local, out_of_range)``, both ``(M * topk,)`` on the ids' device.

    ``local``: int64 local expert id of each route, -1 where the route is dropped (id -1, non-local under
    ``expert_map``, or out of range). ``out_of_range``: bool, ids that are neither -1 nor in the id space
    (``[0, len(expert_map))`` or ``[0, local_num_experts)``): the caller decides whether that is an error.
    """
    ids = topk_ids.reshape(-1).to(torch.int64)
    n_ids = expert_map.numel() if expert_map is not None else local_num_experts
    out_of_range = (ids < -1) | (ids >= n_ids)
    valid = (ids >= 0) & ~out_of_range
    if expert_map is None:
        local = torch.where(valid, ids, torch.full_like(ids, -1))
    else:
        emap = expert_map.to(device=ids.device, dtype=torch.int64)
        mapped = emap[ids.clamp(0, n_ids - 1)]  # never index with -1 / out of range (vLLM #48371)
        local = torch.where(valid, mapped, torch.full_like(ids, -1))
    return local, out_of_range


def build_contiguous_layout(
    topk_ids: torch.Tensor,
    local_num_experts: int,
    M_sum: int,
    alignment: int,
    expert_map: torch.Tensor | None = None,
    *,
    slot_rows: int | None = None,
) -> tuple[ContiguousLayout, torch.Tensor]:
    """Place every local route of ``topk_ids`` in DeepGEMM's contiguous layout of ``M_sum`` rows (or, with
    ``slot_rows``, the masked layout: ``M_sum = local_num_experts * slot_rows`` and ``alignment = slot_rows``).

    Args:
        topk_ids: ``(M, topk)`` signed integer expert ids (global ids when ``expert_map`` is given).
        local_num_experts: experts held here (``w1.size(0)``).
        M_sum: rows of the layout; must be at least ``sum_e round_up(count_e, alignment)``
            (``reference.align.compute_aligned_M_and_alignment`` gives it; the worst case needs no counts).
        alignment: per-expert row alignment (DeepGEMM block M, 128).
        expert_map: optional ``(E_global,)`` int map global -> local, -1 where not held.

    Returns:
        ``(layout, out_of_range)``; ``out_of_range`` is the bool ``(M * topk,)`` mask of ids outside the id space
        (they are dropped in the layout). No host synchronisation.

    Raises:
        ValueError: ``topk_ids`` not 2-D integer, non-positive ``local_num_experts`` / ``alignment``, negative
            ``M_sum``, a masked ``M_sum`` other than ``local_num_experts * slot_rows``.
    """
    if topk_ids.dim() != 2 or topk_ids.is_floating_point() or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be a 2-D integer (M, topk) tensor, got {tuple(topk_ids.shape)} "
                         f"{topk_ids.dtype}")
    if local_num_experts <= 0 or alignment <= 0 or M_sum < 0:
        raise ValueError(f"need local_num_experts > 0, alignment > 0, M_sum >= 0; got {local_num_experts}, "
                         f"{alignment}, {M_sum}")
    device = topk_ids.device
    M, topk = topk_ids.shape
    E = local_num_experts
    if slot_rows is not None and (slot_rows <= 0 or M_sum != E * slot_rows or alignment != slot_rows):
        raise ValueError(f"the masked layout needs M_sum = local_num_experts * slot_rows and alignment = slot_rows, "
                         f"got M_sum={M_sum}, E={E}, slot_rows={slot_rows}, alignment={alignment}")
    local, out_of_range = local_expert_ids(topk_ids, E, expert_map)
    n_routes = local.numel()

    key = torch.where(local >= 0, local, torch.full_like(local, E))
    sorted_key, order = torch.sort(key, stable=True)
    # scatter_add instead of bincount: CUDA bincount reads the max id back to the host (a synchronisation)
    counts_all = torch.zeros(E + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    counts = counts_all[:E]
    if slot_rows is None:
        aligned = (counts + alignment - 1) // alignment * alignment
        starts = torch.cumsum(aligned, 0) - aligned
        cap = M_sum
    else:
        starts = torch.arange(E, device=device, dtype=torch.int64) * slot_rows
        cap = slot_rows
    first_pos = torch.cumsum(counts, 0) - counts
    e_sorted = sorted_key.clamp(max=E - 1)
    pos = torch.arange(n_routes, device=device, dtype=torch.int64)
    within = pos - first_pos[e_sorted]
    row_sorted = torch.where((sorted_key < E) & (within < cap), starts[e_sorted] + within,
                             torch.full_like(pos, M_sum))
    row_of_route = torch.empty_like(row_sorted)
    row_of_route[order] = row_sorted
    # A route whose row would fall outside M_sum (M_sum too small) or its slot goes to the trash row too, and is
    # poisoned below; the caller's validation reports it.
    row_of_route = torch.where(row_of_route < M_sum, row_of_route, torch.full_like(row_of_route, M_sum))

    token_of_route = torch.arange(n_routes, device=device, dtype=torch.int64) // max(topk, 1)
    row_token = torch.zeros(M_sum + 1, dtype=torch.int64, device=device)
    row_token.scatter_(0, row_of_route, token_of_route)
    m_indices = torch.full((M_sum + 1,), -1, dtype=torch.int32, device=device)
    m_indices.scatter_(0, row_of_route, local.to(torch.int32))
    placed = (local >= 0) & (row_of_route < M_sum)
    poisoned = out_of_range | ((local >= 0) & ~placed)
    inv_perm = torch.where(placed, row_of_route, torch.where(poisoned, torch.full_like(row_of_route, POISON_ROW),
                                                             torch.full_like(row_of_route, -1)))
    layout = ContiguousLayout(
        row_token=row_token[:M_sum],
        m_indices=m_indices[:M_sum],
        inv_perm=inv_perm.reshape(M, topk),
        counts=counts,
        M_sum=M_sum,
        alignment=alignment,
        slot_rows=slot_rows,
    )
    return layout, out_of_range


def gather_rows(src: torch.Tensor, row_token: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[r] = src[row_token[r]]`` for a 2-D ``src`` of any dtype (1-byte floats go through a uint8 view, so
    FP8 rows are copied bit-exactly on every device). Returns ``out`` (allocated when None)."""
    rows = row_token.numel()
    if out is None:
        out = torch.empty((rows, src.size(1)), dtype=src.dtype, device=src.device)
    if tuple(out.shape) != (rows, src.size(1)) or out.dtype != src.dtype:
        raise ValueError(f"out must be ({rows}, {src.size(1)}) {src.dtype}, got {tuple(out.shape)} {out.dtype}")
    if src.element_size() == 1 and src.dtype != torch.uint8:
        torch.index_select(src.contiguous().view(torch.uint8), 0, row_token, out=out.view(torch.uint8))
    else:
        torch.index_select(src, 0, row_token, out=out)
    return out


def mn_major_tma_aligned_empty(mn: int, groups: int, device, dtype=torch.float32) -> torch.Tensor:
    """An uninitialised ``(mn, groups)`` tensor with DeepGEMM's SM90 scale layout: strides
    ``(1, tma_aligned_size(mn, 4))`` (MN-major, each column padded to 16 bytes). Padding storage is zeroed."""
    stride = tma_aligned_size(mn, torch.empty((), dtype=dtype).element_size())
    storage = torch.empty((groups, stride), dtype=dtype, device=device)
    if stride > mn:
        storage[:, mn:].zero_()
    return storage[:, :mn].t()


def sf_empty(rows: int, groups: int, device, slot_rows: int | None = None) -> torch.Tensor:
    """Uninitialised fp32 scales in the layout DeepGEMM's SM90 kernels read without transposing them.

    Contiguous layout (``slot_rows`` None): ``(rows, groups)``, MN-major TMA-aligned (see
    :func:`mn_major_tma_aligned_empty`). Masked layout: ``(rows // slot_rows, slot_rows, groups)`` with strides
    ``(groups * slot_rows, 1, slot_rows)`` (``check_sf_layout`` of ``csrc/utils/layout.hpp``: MN-major within each
    group; ``slot_rows`` a multiple of 4 keeps it TMA-aligned).

    The scale of layout row ``r`` and group ``g`` lives at storage offset ``(r // R0) * S0 + g * S1 + r % R0``
    with ``(R0, S0, S1) =`` :func:`sf_addressing` of the tensor (the Triton kernels write through it).
    """
    if slot_rows is None:
        return mn_major_tma_aligned_empty(rows, groups, device)
    if slot_rows % 4 or rows % slot_rows:
        raise ValueError(f"slot_rows must be a multiple of 4 dividing rows, got {slot_rows} / {rows}")
    return torch.empty((rows // slot_rows, groups, slot_rows), dtype=torch.float32, device=device).transpose(1, 2)


def sf_addressing(sf: torch.Tensor) -> tuple[int, int, int]:
    """``(R0, S0, S1)`` of a tensor from :func:`sf_empty`: row ``r``, group ``g`` at ``(r // R0) * S0 + g * S1 +
    r % R0``."""
    if sf.dim() == 2:
        if sf.stride(0) != 1:
            raise ValueError(f"scales must be MN-major, got strides {sf.stride()}")
        return max(sf.size(0), 1), 0, sf.stride(1)
    E, slot, _ = sf.shape
    if sf.stride(1) != 1:
        raise ValueError(f"scales must be MN-major within each group, got strides {sf.stride()}")
    return slot, sf.stride(0), sf.stride(2)


def gather_scales_mn_major(scales: torch.Tensor, row_token: torch.Tensor,
                           slot_rows: int | None = None) -> torch.Tensor:
    """Per-token-group scales ``(M, G)`` (any strides) gathered to the layout's rows, returned in the layout of
    :func:`sf_empty` (the SFA layout DeepGEMM's SM90 kernel reads; it then skips its own transposition)."""
    if scales.dim() != 2:
        raise ValueError(f"scales must be (M, K // 128), got {tuple(scales.shape)}")
    out = sf_empty(row_token.numel(), scales.size(1), scales.device, slot_rows)
    gathered = scales.to(torch.float32).index_select(0, row_token)
    out.copy_(gathered.view(out.shape))  # (the masked layout's rows are not a strided 2-D view: copy by shape)
    return out


def quantize_scatter(x: torch.Tensor, inv_perm: torch.Tensor, out_q: torch.Tensor, out_s: torch.Tensor, *,
                     group_size: int = 128, use_ue8m0: bool = True, recipe="vllm") -> None:
    """Quantize the hidden states per 1 x ``group_size`` group and write each token's codes and scales to the rows
    of its routes: ``out_q[inv_perm[t, k]] = q[t]``, ``out_s[inv_perm[t, k]] = s[t]`` for ``inv_perm >= 0``.

    The prepare step's ``per_token_group_quant_fp8`` and the permutation in one (the torch definition of
    ``triton_kernels.quantize_scatter``): the codes and scales are those of
    ``reference.quant.per_token_group_quant_fp8(x, group_size, use_ue8m0, recipe)``. Rows no route points to are
    not written.

    Args:
        x: ``(M, K)`` bf16 / fp16 / fp32 hidden states.
        inv_perm: ``(M, topk)`` integer rows of the layout (negative: no row).
        out_q: ``(rows, K)`` float8_e4m3fn; out_s: scales from :func:`sf_empty` for ``rows``.
    """
    from backends.deep_gemm.act_quant import per_token_group_quant_fp8_mn_major

    M, topk = inv_perm.shape
    q, s = per_token_group_quant_fp8_mn_major(x, group_size, use_ue8m0=use_ue8m0, recipe=recipe)
    routes = inv_perm.reshape(-1).to(torch.int64)
    valid = routes >= 0
    rows = routes[valid]
    tokens = (torch.arange(M * topk, device=x.device) // max(topk, 1))[valid]
    out_q.view(torch.uint8)[rows] = q.view(torch.uint8)[tokens]
    copy_back = out_s.dim() == 3
    s_rows = out_s.contiguous().view(-1, out_s.size(-1)) if copy_back else out_s
    s_rows[rows] = s[tokens]
    if copy_back:
        out_s.copy_(s_rows.view(out_s.shape))


def unpermute_and_reduce(
    a: torch.Tensor,
    inv_perm: torch.Tensor,
    topk_weights: torch.Tensor,
    output: torch.Tensor,
) -> torch.Tensor:
    """``output[t] = sum_k w[t, k] * a[inv_perm[t, k]]`` over the local routes (``inv_perm >= 0``).

    Numerics (those of ``reference.align.deepgemm_unpermute_and_reduce``): fp32 accumulator, ``k`` ascending, each
    term ``a[row].float() * w.float()`` rounded to fp32, one cast to ``output.dtype``; tokens without a local route
    get 0; a token with a poisoned route (``inv_perm == POISON_ROW``) gets NaN. Rows of ``a`` that no route points
    to are never read (they may hold NaN). Every row of ``output`` is written.

    Args:
        a: ``(M_sum, K)`` floating GEMM2 output in layout order.
        inv_perm: ``(M, topk)`` integer rows (-1: no local route).
        topk_weights: ``(M, topk)`` floating weights (ones when the weight was applied on the input).
        output: ``(M, K)`` floating, overwritten (may alias memory that ``a`` does not use).
    """
    M, topk = inv_perm.shape
    if tuple(output.shape) != (M, a.size(1)):
        raise ValueError(f"output must be ({M}, {a.size(1)}), got {tuple(output.shape)}")
    if tuple(topk_weights.shape) != (M, topk):
        raise ValueError(f"topk_weights must be ({M}, {topk}), got {tuple(topk_weights.shape)}")
    acc = torch.zeros((M, a.size(1)), dtype=torch.float32, device=a.device)
    w = topk_weights.to(device=a.device, dtype=torch.float32)
    for k in range(topk):  # ascending k fixes the fp32 summation order
        rows = inv_perm[:, k]
        valid = rows >= 0
        term = a.index_select(0, rows.clamp(min=0)).float() * w[:, k : k + 1]
        acc += torch.where(valid[:, None], term, torch.zeros((), dtype=torch.float32, device=a.device))
    poisoned = (inv_perm == POISON_ROW).any(dim=1)
    acc = torch.where(poisoned[:, None], torch.full((), float("nan"), device=a.device), acc)
    output.copy_(acc)
    return output
