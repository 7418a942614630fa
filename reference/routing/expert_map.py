"""Expert parallelism's global -> local expert map (seed 003 ``determine_expert_map``, ``fused_moe/layer.py``)."""

from __future__ import annotations

import torch


__all__ = ["determine_expert_map"]


def determine_expert_map(
    ep_size: int,
    ep_rank: int,
    global_num_experts: int,
    expert_placement_strategy: str = "linear",
    num_fused_shared_experts: int = 0,
    return_expert_mask: bool = False,
) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
    """Which global experts this EP rank holds: ``(local_num_experts, expert_map, expert_mask)``.

    ``expert_map`` is int32 ``(global_num_experts,)``: the local index of each global expert held here, -1 elsewhere.
    ``E % ep_size`` remainder experts go one each to the *first* ranks: this follows vLLM's code; seed 003's
    docstring says "assigned to the last rank", which the code does not do.
    Strategies: ``"linear"`` (contiguous ranges) and ``"round_robin"`` (expert e on rank ``e % ep_size``).
    ``expert_mask`` (AITER) is None unless ``return_expert_mask``: then it is ``(global + num_fused_shared_experts +
    1,)`` int32, 1 for held and shared experts, 0 for others and for the trailing sentinel, and ``expert_map`` is
    extended by the shared experts' local ids ``local_num_experts + i`` (length ``global + num_fused_shared_experts``).
    With ``ep_size == 1`` returns ``(global_num_experts, None, None)``. The same in vLLM 0.17.0 (``fused_moe/layer.py``)
    and 0.33.0 (``fused_moe/expert_map_manager.py``).

    Raises:
        ValueError: ep_size < 1, rank out of range, unknown strategy, more ranks than experts.
    """
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ValueError(f"need ep_size >= 1 and 0 <= ep_rank < ep_size, got ep_size={ep_size}, ep_rank={ep_rank}")
    if expert_placement_strategy not in ("linear", "round_robin"):
        raise ValueError(f"unknown expert_placement_strategy {expert_placement_strategy!r}; use linear|round_robin")
    if ep_size == 1:
        return global_num_experts, None, None
    if ep_size > global_num_experts:
        raise ValueError(f"ep_size={ep_size} exceeds global_num_experts={global_num_experts}")
    base, remainder = divmod(global_num_experts, ep_size)
    local = base + (1 if ep_rank < remainder else 0)
    expert_map = torch.full((global_num_experts,), -1, dtype=torch.int32)
    if expert_placement_strategy == "linear":
        start = ep_rank * base + min(ep_rank, remainder)
        expert_map[start : start + local] = torch.arange(local, dtype=torch.int32)
    else:
        held = torch.arange(ep_rank, global_num_experts, ep_size)
        expert_map[held] = torch.arange(local, dtype=torch.int32)
    expert_mask = None
    if return_expert_mask:
        expert_mask = torch.ones(global_num_experts + num_fused_shared_experts + 1, dtype=torch.int32)
        expert_mask[-1] = 0
        expert_mask[:global_num_experts] = (expert_map >= 0).int()
        shared = local + torch.arange(num_fused_shared_experts, dtype=torch.int32)
        expert_map = torch.cat((expert_map, shared))
    return local, expert_map, expert_mask
