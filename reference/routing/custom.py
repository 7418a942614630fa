"""Models' own routing functions: Llama-4's top-1 sigmoid, Gemma4's per-expert scale (0.33), MiniMax2's epsilon
renormalization (0.33)."""

from __future__ import annotations

import torch

from reference.routing.common import _finish, _topk_ids, check_router_logits
from reference.semantics import require

__all__ = ["MINIMAX2_EPSILON", "llama4_routing", "gemma4_routing", "minimax2_routing"]


MINIMAX2_EPSILON = 1e-20  # RoutingMethodType.MiniMax2 comment, fused_moe/config.py (0.33.0)


def llama4_routing(
    hidden_states: torch.Tensor | None,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool = False,
    *,
    indices_type: torch.dtype | None = None,
    check_finite: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama-4 custom routing: top-k of the raw logits, weight = sigmoid(logit) in fp32, no renormalization.

    Llama-4 uses topk = 1 with ``apply_router_weight_on_input=True``. Mirrors ``Llama4MoE.custom_routing_function``
    (``vllm/model_executor/models/llama4.py``).
    """
    if renormalize:
        raise ValueError("Llama-4 routing does not renormalize; pass renormalize=False")
    if check_finite is not False:  # no clamp upstream in 0.17.0 or 0.33.0: raises under both
        check_router_logits(gating_output)
    ids = _topk_ids(gating_output.float(), topk)
    w = torch.sigmoid(gating_output.gather(1, ids).float())
    return w, ids.to(indices_type or torch.int32)


def gemma4_routing(gating_output: torch.Tensor, topk: int, per_expert_scale: torch.Tensor, *,
                   check_finite: bool | None = None, semantics=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma4: top-k of the logits; weight = softmax over all E, renormalized over the k, times ``scale[id]``.

    ``w_j = exp(x_j) / sum_{i in topk} exp(x_i) * per_expert_scale[id_j]`` in fp32 (a zero sum divides by 1).
    Args: ``gating_output`` ``(M, E)``, ``per_expert_scale`` ``(E,)`` (a learned parameter, ones at init).
    Returns ``(weights (M, k) fp32, ids (M, k) int32)``, descending logit, lower index first on ties (the Triton
    kernel's stable sort of (logit key, index)). Non-finite logits raise unless ``check_finite=False`` (no clamp
    upstream; weights then unspecified).

    Mirrors ``gemma4_routing_function_torch`` / ``gemma4_fused_routing_kernel_triton`` in
    ``vllm/model_executor/models/gemma4.py`` (vLLM 0.33.0; tested against each other in
    ``tests/kernels/moe/test_gemma4router.py``). The torch version takes the softmax in the logits' dtype (bf16
    for bf16 logits); the Triton kernel used on CUDA computes in fp32, which the reference follows.

    Raises: SemanticsError under 0.17 (no Gemma4 in vLLM 0.17.0); ValueError for shapes / non-finite logits.
    """
    require("Gemma4 routing (per-expert scale)", "0.33", semantics, upstream="vllm/model_executor/models/gemma4.py")
    if check_finite is not False:
        check_router_logits(gating_output)
    M, E = gating_output.shape
    if per_expert_scale.shape != (E,):
        raise ValueError(f"per_expert_scale must be ({E},), got {tuple(per_expert_scale.shape)}")
    x = gating_output.float()
    ids = _topk_ids(x, topk)
    p = torch.softmax(x, dim=-1).gather(1, ids)
    w, ids = _finish(p, ids, True, 1.0, None)
    return (w * per_expert_scale.float()[ids.long()]).float(), ids


def minimax2_routing(gating_output: torch.Tensor, e_score_correction_bias: torch.Tensor, topk: int,
                     routed_scaling_factor: float = 1.0, *, check_finite: bool | None = None,
                     indices_type: torch.dtype | None = None, semantics=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``RoutingMethodType.MiniMax2``: sigmoid + bias -> top-k -> scaled sum-normalize with epsilon 1e-20.

    ``s = sigmoid(x)`` (fp32); experts chosen by ``s + bias`` (lower index first on ties); weights
    ``w_j = s_j * (routed_scaling_factor / (sum_i s_i + 1e-20))``. For any realistic sum the epsilon vanishes in
    fp32 (``1 + 1e-20 == 1``); it only matters when every selected sigmoid is below ~1e-13 (logits below ~-30),
    where the weights stay tiny instead of being normalized to sum ``routed_scaling_factor``.

    Source: the enum comment in ``fused_moe/config.py`` (vLLM 0.33.0): "MiniMax2: Sigmoid + Bias -> TopK ->
    ScaledSumNormalize (routeScale=routed_scaling_factor, epsilon=1e-20)"; the monolithic kernels implementing it
    are FlashInfer's (not in vLLM's tree, not read). The operation order is vLLM's own ``scale =
    routed_scaling_factor / (sum + 1e-20)`` of ``csrc/moe/grouped_topk_kernels.cu``. vLLM's non-monolithic path
    for the same model (``FusedTopKBiasRouter`` -> ``topk_sigmoid``) divides by ``sum > 0 ? sum : 1`` instead:
    that is ``fused_topk_bias(..., scoring_func="sigmoid")``.

    Raises: SemanticsError under 0.17 (no MiniMax2 in vLLM 0.17.0's enum); ValueError for non-finite logits
    unless ``check_finite=False``.
    """
    require("RoutingMethodType.MiniMax2 routing", "0.33", semantics, upstream="fused_moe/config.py")
    if check_finite is not False:
        check_router_logits(gating_output)
    s = torch.sigmoid(gating_output.float())
    ids = _topk_ids(s + e_score_correction_bias.float().unsqueeze(0), topk)
    w = s.gather(1, ids)
    scale = routed_scaling_factor / (w.sum(dim=-1, keepdim=True) + MINIMAX2_EPSILON)
    return (w * scale).float(), ids.to(indices_type or torch.int32)
