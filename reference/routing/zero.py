"""vLLM 0.33's ``ZeroExpertRouter`` (LongCat-Flash zero experts, ``fused_moe/router/zero_expert_router.py``).

``create_fused_moe_router``'s first branch (``reference.routing.router_kind``: ``zero_expert_type`` set, before
the CPU router and every other one). The logits have ``num_logical_experts + zero_expert_num`` columns; the router
routes over all of them with the full correction bias, computes the zero experts' contribution itself (an
identity expert returns its input) and hands the routed experts only real ids.
"""

from __future__ import annotations

import torch

from reference.routing.common import _UP
from reference.routing.topk import fused_topk_bias
from reference.semantics import require

__all__ = ["ZERO_EXPERT_BLOCK", "zero_expert_router", "zero_expert_identity_output"]

ZERO_EXPERT_BLOCK = 256  # compute_identity_kernel's BLOCK_SIZE (fused_moe/fused_moe.py, vLLM 0.33.0)


def zero_expert_identity_output(topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                                hidden_states: torch.Tensor) -> torch.Tensor:
    """``zero_experts_compute_triton(..., zero_expert_type="identity")``: ``out[t] = sum_j s[t, j] * h[t]`` over the
    slots whose id is ``>= num_experts`` (a zero expert), in slot order, fp32 accumulation, stored in the hidden
    dtype. ``(M, K)``.

    The kernel's grid is ``M * (K // 256)`` programs of 256 columns, so only the first ``(K // 256) * 256`` columns
    are written: the rest stay 0 (all of them for ``K < 256``; vLLM's ``tests/kernels/moe/test_zero_expert_moe.py``
    says so: "grid=0 when hidden_dim<256"). The reference mirrors that (LongCat-Flash's hidden size is a multiple
    of 256). Mirrors ``zero_experts_compute_triton`` / ``compute_identity_kernel`` in
    ``vllm/model_executor/layers/fused_moe/fused_moe.py`` (vLLM 0.33.0).
    """
    M, K = hidden_states.shape
    scales = torch.where(topk_ids >= num_experts, topk_weights.float(), torch.zeros_like(topk_weights.float()))
    acc = torch.zeros(M, K, dtype=torch.float32, device=hidden_states.device)
    h = hidden_states.float()
    for j in range(topk_ids.shape[1]):
        acc += h * scales[:, j:j + 1]
    covered = (K // ZERO_EXPERT_BLOCK) * ZERO_EXPERT_BLOCK
    acc[:, covered:] = 0.0
    return acc.to(hidden_states.dtype)


def zero_expert_router(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    e_score_correction_bias: torch.Tensor,
    num_logical_experts: int,
    zero_expert_type: str = "identity",
    *,
    scoring_func: str = "softmax",
    renormalize: bool = False,
    routed_scaling_factor: float = 1.0,
    indices_type: torch.dtype | None = None,
    check_finite: bool | None = None,
    semantics=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ZeroExpertRouter._compute_routing``: ``(topk_weights, topk_ids, zero_expert_output)``.

    1. ``fused_topk_bias`` over all ``E_total = router_logits.shape[1]`` experts (real + zero) with the full bias,
       the layer's ``scoring_func`` and ``renormalize`` (LongCat-Flash: softmax, no renormalization);
    2. weights times ``routed_scaling_factor`` (when != 1);
    3. the zero-expert output from those weights and ids (``zero_expert_identity_output``; before any EPLB);
    4. slots with an id ``>= num_logical_experts`` become id 0, weight 0, so the routed experts ignore them.
    Shapes: ``hidden_states`` ``(M, K)``, ``router_logits`` ``(M, E_total)``, bias ``(E_total,)``. Weights fp32,
    ids int32 (or ``indices_type``), output ``(M, K)`` in the hidden dtype. ``routing_method_type`` is
    ``Unspecified`` (kernels with built-in routing cannot reproduce it). Non-finite logits: ``fused_topk_bias``'s
    rule. Mirrors ``fused_moe/router/zero_expert_router.py`` (vLLM 0.33.0).

    Raises: ValueError for a ``zero_expert_type`` other than "identity" (upstream leaves its scales undefined), a
    bias of the wrong width or ``num_logical_experts`` outside ``[1, E_total]``; SemanticsError under 0.17.
    """
    require("ZeroExpertRouter", "0.33", semantics, upstream=_UP + "zero_expert_router.py")
    if zero_expert_type != "identity":
        raise ValueError(f"zero_expert_type {zero_expert_type!r} is not defined; only 'identity' is")
    E_total = router_logits.shape[-1]
    if e_score_correction_bias is None or tuple(e_score_correction_bias.shape) != (E_total,):
        raise ValueError(f"ZeroExpertRouter needs an e_score_correction_bias of shape ({E_total},)")
    if not 0 < num_logical_experts <= E_total:
        raise ValueError(f"num_logical_experts={num_logical_experts} must be in [1, {E_total}]")
    w, ids = fused_topk_bias(hidden_states, router_logits, e_score_correction_bias, top_k, renormalize,
                             scoring_func=scoring_func, indices_type=indices_type, check_finite=check_finite,
                             semantics=semantics)
    if routed_scaling_factor != 1.0:
        w = w * routed_scaling_factor
    out = zero_expert_identity_output(w, ids, num_logical_experts, hidden_states)
    zero = ids >= num_logical_experts
    return w.masked_fill(zero, 0.0), ids.masked_fill(zero, 0), out
