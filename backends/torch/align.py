"""Alignment helpers of the torch backend (own code; the reference is ``reference.align``): vectorized with sort,
bincount and cumsum, as a GPU implementation would be organised."""

from __future__ import annotations

import torch


def _local(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int) -> torch.Tensor:
    ids = topk_ids.reshape(-1).long()
    if expert_map is None:
        ok = (ids >= 0) & (ids < num_experts)
        return torch.where(ok, ids, -1)
    ok = (ids >= 0) & (ids < expert_map.numel())
    return torch.where(ok, expert_map.long()[ids.clamp(0, expert_map.numel() - 1)], -1)


def count_expert_num_tokens(topk_ids, num_local_experts, expert_map=None):
    local = _local(topk_ids, expert_map, num_local_experts)
    return torch.bincount(local[local >= 0], minlength=num_local_experts).to(torch.int32)


def moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None, pad_sorted_ids=False,
                         ignore_invalid_experts=False, return_scatter_idx=False):
    """vLLM's layout and signature: with a map, ``ignore_invalid_experts=True`` drops non-local routes (the mode
    vLLM's experts call) and ``False`` is the legacy mode (global alignment, then the map applied to
    ``expert_ids``, -1 wrapping to the map's last entry)."""
    if return_scatter_idx and expert_map is not None and not ignore_invalid_experts:
        raise ValueError("scatter_idx with expert_map requires ignore_invalid_experts")
    legacy = expert_map if (expert_map is not None and not ignore_invalid_experts) else None
    if legacy is not None:
        expert_map = None
    out = _align(topk_ids, block_size, num_experts, expert_map, pad_sorted_ids)
    if legacy is not None:
        out = (out[0], legacy.to(out[1].device)[out[1].long()].to(torch.int32), out[2])
    if return_scatter_idx:
        local = _local(topk_ids, expert_map, num_experts)
        flat = torch.arange(local.numel(), dtype=torch.int32, device=local.device)
        out = (*out, torch.where(local >= 0, flat, -1).to(torch.int32).reshape(-1, 1))
    return out


def fused_globalize_align_block_size(recv_topk_idx, psum_recv_per_rank, rank_expert_offset, global_num_experts,
                                     local_num_experts, block_size, return_scatter_idx=False):
    """vLLM 0.33's fused DeepEP-v2 decode metadata (globalize in place + align by local id + scatter index)."""
    if recv_topk_idx.dtype != torch.int64:
        raise ValueError("fused_globalize_align_block_size: recv_topk_idx must be int64")
    n, topk = recv_topk_idx.shape
    num_recv = psum_recv_per_rank[-1].to(recv_topk_idx.device)
    v = recv_topk_idx
    rows = torch.arange(n, device=v.device).unsqueeze(1)
    valid = (v >= 0) & (v < local_num_experts) & (v + rank_expert_offset < global_num_experts) & (rows < num_recv)
    s, e, cnt = _align(torch.where(valid, v, -1), block_size, local_num_experts, None, False)
    recv_topk_idx.copy_(torch.where(valid, v + rank_expert_offset, -1))
    out = (recv_topk_idx, s, e, cnt)
    if return_scatter_idx:
        flat = torch.arange(n * topk, dtype=torch.int32, device=v.device)
        out = (*out, torch.where(valid.reshape(-1), flat, -1).to(torch.int32).reshape(-1, 1))
    return out


def _align(topk_ids, block_size, num_experts, expert_map, pad_sorted_ids):
    numel = topk_ids.numel()
    n_slots = num_experts if expert_map is None else int(expert_map.max()) + 1 if expert_map.numel() else 0
    size = numel + num_experts * (block_size - 1)
    if pad_sorted_ids:
        size = -(size // -block_size) * block_size
    if numel < num_experts:
        size = min(size, numel * block_size)
    local = _local(topk_ids, expert_map, num_experts)
    counts = torch.bincount(local[local >= 0], minlength=max(n_slots, 1))[:n_slots]
    padded = -(counts // -block_size) * block_size
    starts = torch.cumsum(padded, 0) - padded
    total = int(padded.sum())
    sorted_ids = torch.full((size,), numel, dtype=torch.int32, device=topk_ids.device)
    keep = (local >= 0).nonzero().squeeze(1)
    order = keep[torch.argsort(local[keep], stable=True)]
    e_sorted = local[order]
    rank_in_expert = torch.arange(order.numel(), device=order.device) - (torch.cumsum(counts, 0) - counts)[e_sorted]
    sorted_ids[starts[e_sorted] + rank_in_expert] = order.to(torch.int32)
    n_blocks = -(size // -block_size)
    expert_ids = torch.full((n_blocks,), -1, dtype=torch.int32, device=topk_ids.device)
    block_owner = torch.repeat_interleave(torch.arange(n_slots, device=topk_ids.device), padded // block_size)
    expert_ids[: block_owner.numel()] = block_owner.to(torch.int32)
    return sorted_ids, expert_ids, torch.tensor([total], dtype=torch.int32, device=topk_ids.device)


def moe_permute(hidden_states, a1q_scale, topk_ids, n_expert, n_local_expert=-1, expert_map=None,
                permuted_hidden_states=None, scratch=None):
    """vLLM's ``moe_permute`` (CUTLASS grouped-GEMM layout): stable sort of the routes by local id (non-local:
    ``id + n_expert``; out of range: ``n_expert``)."""
    M, K = hidden_states.shape
    topk = topk_ids.size(1)
    n_local = n_expert if n_local_expert == -1 else n_local_expert
    ids = topk_ids.reshape(-1).long()
    dev = ids.device
    in_range = (ids >= 0) & (ids < n_expert)
    emap = torch.arange(n_expert, device=dev) if expert_map is None else expert_map.long().to(dev)
    local = emap[ids.clamp(0, n_expert - 1)]
    key = torch.where(in_range, torch.where(local != -1, local, ids + n_expert), n_expert)
    src = torch.sort(key, stable=True).indices
    offsets = torch.searchsorted(key[src].contiguous(), torch.arange(n_local + 1, device=dev))
    rows = M * topk
    inv = torch.empty(rows, dtype=torch.int64, device=dev)
    inv[src] = torch.arange(rows, device=dev)
    n_written = int(offsets[-1]) if expert_map is not None else rows
    pidx = torch.full((rows,), rows, dtype=torch.int64, device=dev)
    pidx[:n_written] = src[:n_written]
    out = permuted_hidden_states if permuted_hidden_states is not None else hidden_states.new_zeros(rows, K)
    out[:n_written] = hidden_states[src[:n_written] // topk]
    if a1q_scale is not None and a1q_scale.dim() > 1:
        a1q_scale = a1q_scale[pidx.clamp(max=rows - 1) // topk]
    return out, a1q_scale, offsets.to(torch.int64), inv.to(torch.int32), pidx.to(torch.int32)


def moe_unpermute(out, permuted_hidden_states, topk_weights, inv_permuted_idx, expert_first_token_offset=None):
    """vLLM's ``moe_unpermute``: per token the fp32 weighted sum of its rows (rows past the valid count skipped)."""
    M, topk = topk_weights.shape
    rows = inv_permuted_idx.reshape(M, topk).long()
    keep = torch.ones_like(rows, dtype=torch.bool) if expert_first_token_offset is None else \
        rows < expert_first_token_offset[-1]
    vals = permuted_hidden_states[rows.clamp(0, permuted_hidden_states.size(0) - 1)].float()  # (M, topk, K)
    vals = torch.where(keep.unsqueeze(-1), vals * topk_weights.float().unsqueeze(-1), 0.0)  # skipped rows unread
    acc = vals[:, 0]
    for k in range(1, topk):
        acc = acc + vals[:, k]
    out.copy_(acc.to(out.dtype))
    return out
