"""EPLB: logical -> physical expert replica ids and the load count, per version (point
``routing.eplb_replica_choice``; vLLM ``fused_moe/router/base_router.py``)."""

from __future__ import annotations

import torch

from reference.routing.common import V033
from reference.semantics import SemanticsError, resolve_semantics

__all__ = ["EPLB_KNUTH_MULTIPLIER", "eplb_logical_to_physical"]


EPLB_KNUTH_MULTIPLIER = 2654435769  # floor(2^32 / phi), base_router.py (0.33.0)


def eplb_logical_to_physical(
    topk_ids: torch.Tensor,
    logical_to_physical_map: torch.Tensor,
    logical_replica_count: torch.Tensor,
    *,
    expert_load_view: torch.Tensor | None = None,
    record_enabled: bool = True,
    num_unpadded_tokens: int | None = None,
    semantics=None,
) -> torch.Tensor:
    """EPLB: map logical expert ids to physical replica ids (and count the load), per version.

    Args:
        topk_ids: ``(M, k)`` logical ids (int32/int64).
        logical_to_physical_map: ``(L, R)`` int, physical ids of each logical expert's replicas (unused slots -1).
        logical_replica_count: ``(L,)`` int, replicas of each logical expert.
        expert_load_view: ``(P,)`` physical load counters, updated in place when given.
        record_enabled / num_unpadded_tokens: 0.33 only (recording switch; rows >= num_unpadded_tokens not counted).

    Returns:
        ``(M, k)`` physical ids in ``topk_ids``' dtype.

    Replica choice:
        - 0.17 (vLLM 0.17.0 ``fused_moe/router/base_router.py``, torch.compile'd): replica = ``p % count`` with
          ``p = t * k + j`` the flat slot position; every slot is counted (``scatter_add_``). An id outside
          ``[0, L)`` raises (torch would index out of range).
        - 0.33 (vLLM 0.33.0, same file, Triton ``_eplb_map_and_record_i32_kernel``): replica =
          ``((t * 2654435769) mod 2^32) mod max(count, 1)`` with ``t`` the token index (all k slots of a token use
          the same hash); an id outside ``[0, L)`` (padding -1) maps to -1; a slot is counted when recording is
          enabled, ``t < num_unpadded_tokens`` (if given) and ``0 <= physical < P``.

    Both releases return the ids unchanged on platforms without CUDA/XPU (their CPU fallback); the reference
    specifies the CUDA behaviour.
    """
    v = resolve_semantics(semantics)
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be (M, k), got {tuple(topk_ids.shape)}")
    M, k = topk_ids.shape
    L = logical_replica_count.shape[0]
    ids = topk_ids.long()
    l2p = logical_to_physical_map.long()
    if v >= V033:
        valid = (ids >= 0) & (ids < L)
        safe = torch.where(valid, ids, torch.zeros_like(ids))
        count = torch.clamp(logical_replica_count.long()[safe], min=1)
        t = torch.arange(M, dtype=torch.long, device=ids.device).unsqueeze(1).expand(M, k)
        replica = ((t * EPLB_KNUTH_MULTIPLIER) & 0xFFFFFFFF) % count
        phys = torch.where(valid, l2p[safe, replica], torch.full_like(ids, -1))
        if expert_load_view is not None and record_enabled:
            P = expert_load_view.shape[0]
            rec = (phys >= 0) & (phys < P)
            if num_unpadded_tokens is not None:
                rec &= t < int(num_unpadded_tokens)
            expert_load_view.index_add_(0, phys[rec], torch.ones_like(phys[rec], dtype=expert_load_view.dtype))
        return phys.to(topk_ids.dtype)
    if num_unpadded_tokens is not None or not record_enabled:
        raise SemanticsError("record_enabled / num_unpadded_tokens are not defined under vLLM 0.17 semantics "
                             "(eplb_map_to_physical_and_record of 0.17.0 always records every slot)")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= L):
        raise ValueError(f"logical expert ids must be in [0, {L}) under the 0.17 semantics (no padding rows)")
    count = logical_replica_count.long()[ids]
    pos = torch.arange(ids.numel(), dtype=torch.long, device=ids.device).reshape(M, k)
    phys = l2p[ids].gather(-1, (pos % count).unsqueeze(-1)).squeeze(-1)
    if expert_load_view is not None:
        if phys.numel() and (int(phys.min()) < 0 or int(phys.max()) >= expert_load_view.shape[0]):
            raise ValueError("a physical id is outside expert_load_view")
        expert_load_view.scatter_add_(0, phys.flatten(), torch.ones_like(phys.flatten(), dtype=expert_load_view.dtype))
    return phys.to(topk_ids.dtype)
