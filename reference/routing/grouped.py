"""Grouped top-k (DeepSeek-V2/V3 style): ``valid_grouping``, ``grouped_topk`` (native torch version of
``fused_moe/router/grouped_topk_router.py``, with the fused CUDA kernel's single-group non-finite rule, point
``routing.grouped_topk_nonfinite``) and ``grouped_topk_router`` with each version's fallback for an invalid grouping
(point ``routing.invalid_grouping_fallback``)."""

from __future__ import annotations

import torch

from reference.routing.common import V033, _finish, _scores, _topk_ids, apply_padding_rows, check_router_logits
from reference.routing.topk import fused_topk, fused_topk_bias
from reference.semantics import resolve_semantics

__all__ = ["valid_grouping", "grouped_topk", "grouped_topk_router", "SINGLE_GROUP_TIERS",
           "single_group_kernel_applies"]

# The (max experts, max top-k) tiers of ``csrc/moe/grouped_topk_kernels.cu::single_group_topk`` (vLLM 0.33.0:
# ``SigmoidBiasTiers``, ``PrecomputedSoftmaxBiasTiers``); a config that fits no tier runs the older
# ``grouped_topk_fused_small_expert_count_kernel``, which has no non-finite rule.
SINGLE_GROUP_TIERS = {
    "sigmoid": ((128, 8), (256, 8), (384, 8), (512, 8), (512, 22), (768, 16), (896, 16), (1024, 16)),
    "softmax": ((128, 4), (128, 8), (160, 8), (256, 8), (256, 16), (512, 8), (512, 16), (512, 22), (512, 32),
                (576, 8), (768, 16), (896, 16), (1024, 16)),
}


def single_group_kernel_applies(num_experts: int, topk: int, num_expert_group: int, topk_group: int,
                                scoring_func: str, has_bias: bool, *, semantics=None) -> bool:
    """Whether vLLM's fused grouped top-k runs its single-group kernels (Kimi-K2 style, where the non-finite rule
    of point ``routing.grouped_topk_nonfinite`` is defined): 0.33 semantics, a correction bias (the fused path
    needs one: ``grouped_topk_router.py::grouped_topk``), ``num_expert_group == topk_group == 1``, E > 1, and
    ``(E, topk)`` within a tier of ``SINGLE_GROUP_TIERS[scoring_func]`` (``invokeNoAuxTc`` in
    ``csrc/moe/grouped_topk_kernels.cu``, vLLM 0.33.0). Always False under 0.17 (vLLM 0.17.0 has no such kernel)."""
    if resolve_semantics(semantics) < V033 or not has_bias or num_expert_group != 1 or topk_group != 1:
        return False
    if num_experts <= 1 or scoring_func not in SINGLE_GROUP_TIERS:
        return False
    return any(num_experts <= e and topk <= k for e, k in SINGLE_GROUP_TIERS[scoring_func])


def _single_group_nonfinite(gating_output, bias, topk, renormalize, scoring_func, routed_scaling_factor):
    """The single-group kernels' rule (``single_group_topk::preprocess_score`` / ``write_outputs``, vLLM 0.33.0):
    an expert whose input (the logit for sigmoid; the softmax score computed beforehand for softmax) or bias is
    not finite is invalid: selection score -inf (ranked after every valid expert, lower index first), weight 0.
    Valid selected weights: ``s * (rsf / (sum_valid + 1e-20))`` with renormalize, ``s * rsf`` without; a token
    with no valid selected expert gets ``1/k`` (renormalize) or 0 and no routed scaling factor."""
    x = gating_output.float()
    b = bias.float().unsqueeze(0)
    if scoring_func == "sigmoid":
        unbiased = torch.sigmoid(x)
        valid = torch.isfinite(x) & torch.isfinite(b)
    else:  # softmax over all E first (fused_grouped_topk), then the kernel's SCORING_NONE path
        unbiased = torch.softmax(x, dim=-1)
        valid = torch.isfinite(unbiased) & torch.isfinite(b)
    biased = unbiased + b
    valid = valid & torch.isfinite(biased)
    key = torch.where(valid, biased, torch.full_like(biased, float("-inf")))
    ids = _topk_ids(key, topk)
    sel_valid = valid.gather(1, ids)
    w = torch.where(sel_valid, unbiased.gather(1, ids), torch.zeros_like(key[:, :topk]))
    if renormalize:
        w = w * (routed_scaling_factor / (w.sum(dim=-1, keepdim=True) + 1e-20))
    else:
        w = w * routed_scaling_factor
    none = ~sel_valid.any(dim=-1, keepdim=True)
    w = torch.where(none, torch.full_like(w, 1.0 / topk if renormalize else 0.0), w)
    return w, ids


def valid_grouping(num_experts: int, num_expert_group: int | None) -> bool:
    """Whether grouped top-k applies: ``num_expert_group`` divides E and E > num_expert_group (vLLM's condition)."""
    return bool(num_expert_group) and num_experts > num_expert_group and num_experts % num_expert_group == 0


def grouped_topk(
    hidden_states: torch.Tensor | None,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    *,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: torch.Tensor | None = None,
    indices_type: torch.dtype | None = None,
    check_finite: bool | None = None,
    semantics=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style grouped top-k.

    1. scores = softmax or sigmoid of the logits (fp32); with a bias, ``biased = scores + bias``.
    2. Group score: with a bias, the sum of the top-2 *biased* scores of each group; without, the max score.
    3. Keep the ``topk_group`` best groups (lower group index wins ties), mask the other experts to -inf.
    4. Top-``topk`` experts of the (biased) masked scores; weights gathered from the *unbiased* scores.
    5. Renormalize (if asked), then multiply by ``routed_scaling_factor``.

    Args:
        gating_output: ``(M, E)`` logits. num_expert_group: G, must divide E with E > G (else ValueError; the
            caller ``select_experts`` falls back to plain top-k there, as vLLM does). topk_group: groups kept,
            ``1 <= topk_group <= G``; ``topk <= topk_group * E / G``.

    Non-finite logits or bias (point ``routing.grouped_topk_nonfinite``): where vLLM 0.33.0's fused single-group
    kernels run (``single_group_kernel_applies``: 0.33, a bias, G = topk_group = 1, E / k within a tier) the
    kernels' rule is specified (``_single_group_nonfinite``; ``check_finite`` None or False applies it, True
    raises). Everywhere else (0.17, multi-group, no bias, E / k outside the tiers: the multi-group kernels only
    guard candidate logits, the group scores and weights are undefined) non-finite logits raise ValueError unless
    ``check_finite=False`` (ids in range, weights unspecified).

    Returns:
        ``(topk_weights (M, topk) fp32, topk_ids (M, topk) int32)``.

    Mirrors ``vllm/model_executor/layers/fused_moe/router/grouped_topk_router.py::grouped_topk`` (native torch)
    and ``fused_grouped_topk`` / ``csrc/moe/grouped_topk_kernels.cu`` (vLLM 0.33.0) for the non-finite rule.
    """
    M, E = gating_output.shape if gating_output.dim() == 2 else (0, 0)
    rule = (check_finite is not True and gating_output.dim() == 2 and e_score_correction_bias is not None
            and valid_grouping(E, num_expert_group)
            and single_group_kernel_applies(E, topk, num_expert_group, topk_group, scoring_func, True,
                                            semantics=semantics))
    nonfinite_rows = None
    if rule:
        bad = ~torch.isfinite(gating_output) | ~torch.isfinite(e_score_correction_bias).unsqueeze(0)
        nonfinite_rows = bad.any(dim=-1)
        if not bool(nonfinite_rows.any()):
            nonfinite_rows = None
    elif check_finite is not False:  # no rule upstream here (module doc): raise
        check_router_logits(gating_output)
    M, E = gating_output.shape
    if not valid_grouping(E, num_expert_group):
        raise ValueError(
            f"grouped_topk needs num_expert_group to divide num_experts with E > G; got E={E}, "
            f"G={num_expert_group}. select_experts falls back to fused_topk for such configs."
        )
    G = num_expert_group
    if not 1 <= topk_group <= G:
        raise ValueError(f"topk_group must be in [1, {G}], got {topk_group}")
    per_group = E // G
    if topk > topk_group * per_group:
        raise ValueError(f"topk={topk} exceeds the {topk_group * per_group} experts in the kept groups")
    if scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"unsupported scoring_func {scoring_func!r} for grouped_topk; use 'softmax' or 'sigmoid'")
    scores = _scores(gating_output, scoring_func)
    if e_score_correction_bias is not None:
        choice = scores + e_score_correction_bias.float().unsqueeze(0)
        grouped = choice.view(M, G, per_group)
        top2 = min(2, per_group)
        # Sum of the top-2 biased scores per group (NaN treated as -inf, like every selection here).
        g_key = torch.where(torch.isnan(grouped), torch.full_like(grouped, float("-inf")), grouped)
        group_scores = torch.sort(g_key, dim=-1, descending=True).values[..., :top2].sum(dim=-1)
    else:
        choice = scores
        grouped = choice.view(M, G, per_group)
        g_key = torch.where(torch.isnan(grouped), torch.full_like(grouped, float("-inf")), grouped)
        group_scores = g_key.max(dim=-1).values
    group_idx = _topk_ids(group_scores, topk_group)
    group_mask = torch.zeros(M, G, dtype=torch.bool, device=scores.device)
    group_mask.scatter_(1, group_idx, True)
    expert_mask = group_mask.unsqueeze(-1).expand(M, G, per_group).reshape(M, E)
    masked = choice.masked_fill(~expert_mask, float("-inf"))
    ids = _topk_ids(masked, topk)
    if nonfinite_rows is not None:
        w_rule, ids_rule = _single_group_nonfinite(gating_output, e_score_correction_bias, topk, renormalize,
                                                   scoring_func, routed_scaling_factor)
        w, ids = _finish(scores.gather(1, ids), ids, renormalize, routed_scaling_factor, None)
        rows = nonfinite_rows.unsqueeze(-1)
        return (torch.where(rows, w_rule, w).float(),
                torch.where(rows, ids_rule.to(ids.dtype), ids).to(indices_type or torch.int32))
    return _finish(scores.gather(1, ids), ids, renormalize, routed_scaling_factor, indices_type)


def grouped_topk_router(
    hidden_states: torch.Tensor | None,
    router_logits: torch.Tensor,
    top_k: int,
    num_expert_group: int,
    topk_group: int,
    *,
    renormalize: bool = True,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: torch.Tensor | None = None,
    indices_type: torch.dtype | None = None,
    is_padding: torch.Tensor | None = None,
    skip_padding: bool = False,
    check_finite: bool | None = None,
    semantics=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``GroupedTopKRouter._compute_routing`` (``fused_moe/router/grouped_topk_router.py``) per version.

    A valid grouping (E > G and G divides E) runs ``grouped_topk``. Otherwise the fallback:
        - no correction bias: ``fused_topk`` with *softmax* (the layer's scoring_func is not passed) and
          renormalize, and *no* routed_scaling_factor - in both 0.17.0 and 0.33.0;
        - with a bias: ``fused_topk_bias`` then ``* routed_scaling_factor``; its scoring function is *softmax*
          under 0.17 (0.17.0 does not pass the layer's scoring_func and the default is softmax) and the layer's
          ``scoring_func`` under 0.33 (0.33.0 passes it).
    Padding rows (0.33 only): with ``skip_padding`` (and ``VLLM_MOE_SKIP_PADDING``), ``is_padding`` rows of the
    grouped result get id -1 / weight 0; the fallback paths do not mask them (upstream returns before the mask).
    """
    v = resolve_semantics(semantics)
    E = router_logits.shape[-1]
    if not valid_grouping(E, num_expert_group):
        if e_score_correction_bias is None:
            return fused_topk(hidden_states, router_logits, top_k, renormalize, indices_type=indices_type,
                              check_finite=check_finite, semantics=v)
        w, ids = fused_topk_bias(hidden_states, router_logits, e_score_correction_bias, top_k, renormalize,
                                 scoring_func=scoring_func if v >= V033 else "softmax", check_finite=check_finite,
                                 semantics=v)
        if routed_scaling_factor != 1.0:
            w = w * routed_scaling_factor
        return w, ids.to(indices_type or torch.int32)
    w, ids = grouped_topk(hidden_states, router_logits, top_k, renormalize, num_expert_group, topk_group,
                          scoring_func=scoring_func, routed_scaling_factor=routed_scaling_factor,
                          e_score_correction_bias=e_score_correction_bias, indices_type=indices_type,
                          check_finite=check_finite, semantics=v)
    if skip_padding and is_padding is not None:
        w, ids = apply_padding_rows(w, ids, is_padding, semantics=v)
    return w, ids
