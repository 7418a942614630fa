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


def moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None, pad_sorted_ids=False):
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
