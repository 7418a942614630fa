"""Constant expert substitution (MoNE-pruned checkpoints, vLLM 0.33): routes to substituted experts become a
constant vector per expert, the retained experts run from compact weights.

Mirrors ``vllm/model_executor/layers/fused_moe/expert_substitution.py`` (vLLM 0.33.0: ``ConstantExpertSubstitution``,
``SubstitutedRoutedExperts.forward_modular``; test ``tests/kernels/moe/test_expert_substitution.py``). The checkpoint
parsing (``approximate_experts``, ``compression_config.transform_config.expert_substitution``) and weight loading are
not specified here (no numerics). What a kernel sees:

1. :func:`expert_substitution_routes`: logical expert -> compact physical row (retained experts, in increasing id) or
   ``-1 - row`` (substituted experts, row in the sorted substituted ids: the row of ``values``).
2. :func:`transform_routes` (between routing and the experts, in place): a valid route (id in ``[0, E_logical)``)
   to a retained expert gets its physical id, weight unchanged; a route to a substituted expert, and an invalid
   route (-1, out of range), get id 0 and weight 0 (so the experts run expert 0 at weight 0 there). It returns the
   constant output: per token, the fp32 sum of its substituted routes' fp32 weights per substituted expert
   (``scatter_add_``), times ``values.float()`` (an fp32 ``(M, S) @ (S, D)`` product), cast once to the hidden dtype,
   written into the first ``D`` columns of a zero ``hidden_states``-shaped tensor.
3. The layer adds it to the experts' output on TP rank 0 only (``output.add_(constant[..., :K_out])``, in the
   output dtype); deferred finalize, EP, DP, EPLB, quantized weights, monolithic experts, LoRA, fused shared experts,
   sequence / prefill-context parallelism and router weights on the input are refused (NotImplementedError).

Point ``modular.expert_substitution`` (0.17 has no substitution: SemanticsError).
"""

from __future__ import annotations

import torch

from reference.semantics import register_point, require

__all__ = ["expert_substitution_routes", "transform_routes", "add_constant_output"]

_UP = "vllm/model_executor/layers/fused_moe/expert_substitution.py"


def expert_substitution_routes(num_logical_experts: int, substituted_expert_ids, *, semantics=None) -> torch.Tensor:
    """int32 ``(num_logical_experts,)``: retained expert -> its compact row ``r >= 0`` (retained ids in increasing
    order), substituted expert -> ``-1 - row`` (row in the sorted substituted ids).

    Raises:
        ValueError: an id outside ``[0, num_logical_experts)``, every expert substituted (vLLM's messages).
        SemanticsError: under the 0.17 semantics.
    """
    require("expert substitution", "0.33", semantics, upstream=_UP)
    subs = sorted(set(int(e) for e in substituted_expert_ids))
    if not set(subs) <= set(range(num_logical_experts)):
        raise ValueError(f"approximate_experts must be within [0, {num_logical_experts}), got {subs}")
    if len(subs) == num_logical_experts:
        raise ValueError("approximate_experts must retain at least one expert")
    routes = [0] * num_logical_experts
    for row, e in enumerate(i for i in range(num_logical_experts) if i not in set(subs)):
        routes[e] = row
    for row, e in enumerate(subs):
        routes[e] = -1 - row
    return torch.tensor(routes, dtype=torch.int32)


def transform_routes(hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     routes: torch.Tensor, values: torch.Tensor, *, semantics=None) -> torch.Tensor:
    """Remap ``topk_ids`` / ``topk_weights`` in place and return the constant experts' output (module docstring).

    Args:
        hidden_states: ``(M, K)`` (its shape and dtype give the output's).
        topk_weights: ``(M, topk)`` floating router weights; zeroed on substituted and invalid routes.
        topk_ids: ``(M, topk)`` logical ids; replaced by physical ids (0 on substituted and invalid routes).
        routes: :func:`expert_substitution_routes`.
        values: ``(S, D)`` constants of the substituted experts (``D <= K``), in their sorted order.

    Returns:
        ``(M, K)`` tensor of ``hidden_states.dtype``: columns ``[0, D)`` = ``(sum of fp32 weights per substituted
        expert) @ values.float()`` rounded once, the rest 0.
    """
    require("expert substitution", "0.33", semantics, upstream=_UP)
    E = routes.numel()
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < E)
    r = routes.to(ids.device).long()[torch.where(valid, ids, torch.zeros_like(ids))]
    substituted = valid & (r < 0)
    S, D = values.shape
    if D > hidden_states.size(-1):
        raise ValueError(f"values are {D} wide, hidden_states only {hidden_states.size(-1)}")
    scales = torch.zeros((ids.size(0), S), dtype=torch.float32, device=ids.device)
    w = topk_weights.float()
    for k in range(ids.size(1)):  # top-k ids are distinct: each (token, row) receives at most one weight
        m = substituted[:, k]
        scales[m.nonzero().flatten(), (-1 - r[m, k])] += w[m, k]
    out = torch.zeros_like(hidden_states)
    out[..., :D] = (scales @ values.float()).to(hidden_states.dtype)
    topk_weights.masked_fill_(~valid | substituted, 0.0)
    topk_ids.copy_(r.clamp_min(0).to(topk_ids.dtype))
    return out


def add_constant_output(output: torch.Tensor, constant_output: torch.Tensor, tp_rank: int = 0) -> torch.Tensor:
    """``SubstitutedRoutedExperts.forward_modular``'s last step: on TP rank 0, ``output += constant[..., :K_out]``
    in the output dtype (the partial outputs of the TP ranks are all-reduced later, so once); other ranks unchanged.
    """
    if tp_rank == 0:
        output.add_(constant_output[..., : output.shape[-1]])
    return output


register_point(
    "modular.expert_substitution", component="modular",
    behaviour={"0.17": "no expert substitution (SemanticsError).",
               "0.33": "MoNE constant substitution: substituted routes -> id 0, weight 0, plus a constant output "
                       "(fp32 per-expert weight sums @ fp32 values, one rounding) added on TP rank 0; retained "
                       "experts renumbered to compact rows."},
    upstream={"0.17": "vLLM 0.17.0 (absent)", "0.33": "vLLM 0.33.0 " + _UP},
    reference="reference.expert_substitution.transform_routes")
