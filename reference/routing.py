"""Top-k routing: which experts each token goes to, with which weight.

Mirrors vLLM's router (``vllm/model_executor/layers/fused_moe/router/``: ``fused_topk``, ``fused_topk_bias``,
``grouped_topk`` (native torch version in ``grouped_topk_router.py``), Llama-4's custom routing function) and
``FusedMoE.select_experts`` / ``determine_expert_map`` of seed 003 (``fused_moe/layer.py``).

Numerics: scores are computed in fp32 from the router logits (``logits.float()``); weights are returned as fp32 and
ids as int32 (or ``indices_type``).

Defined behaviour the kernels must match:
- Order and ties: experts are chosen by descending score; among equal scores the lower expert index wins. A
  kernel may return the k experts of a token in any order (conformance compares per-token sets), and where the
  k-th and (k+1)-th scores tie exactly, either choice is accepted if the weights match.
- Non-finite logits (NaN/inf, e.g. CUDA-graph padding rows, vLLM #39391) depend on the semantics version
  (``reference.semantics``; point ``routing.nonfinite_logits``):
  * 0.17 (vLLM 0.17.0, ``csrc/moe/topk_softmax_kernels.cu`` without a clamp): by default every routing function
    raises ``ValueError`` naming the first bad token. With ``check_finite=False`` routing never yields an id outside
    ``[0, E)``: NaN scores rank below every other score (as if -inf), and the weights of such a token are
    unspecified (they may be NaN).
  * 0.33 (vLLM 0.33.0, same file, "Clamp NaN/Inf to 0"): ``fused_topk`` and ``fused_topk_bias`` (the
    ``topk_softmax`` / ``topk_sigmoid`` kernels) do not raise: a score (softmax / sigmoid of the fp32 logits) that
    is NaN or +-inf becomes 0 before selection, so ids are unique and in range (lower index first among the zeros)
    and weights finite. ``grouped_topk``, ``topk_softmax`` and ``llama4_routing`` have no clamp upstream and keep
    the 0.17 rule. ``check_finite=True`` raises under either version.
- New in 0.33 (``reference.routing_033``, re-exported here): sqrtsoftplus scoring, hash routing and the image-token
  bias in ``fused_topk_bias``, padding rows (``is_padding``: id -1, weight 0), fused shared-expert slots, Gemma4's
  per-expert scale, MiniMax2's epsilon renormalization, EPLB logical -> physical ids, the router factory and
  ``RoutingMethodType`` per version. ``python -m reference.semantics`` lists every point.
"""

from __future__ import annotations

import enum
from typing import Callable

import torch

from reference.semantics import SemanticsVersion, register_point, require, resolve_semantics

__all__ = [
    "RoutingMethodType",
    "fused_topk",
    "fused_topk_bias",
    "grouped_topk",
    "topk_softmax",
    "llama4_routing",
    "select_experts",
    "determine_expert_map",
    "check_router_logits",
    "valid_grouping",
    *(_ROUTING_033 := (  # defined in reference.routing_033, re-exported lazily (module __getattr__ below)
        "image_token_mask", "hash_topk_ids", "apply_padding_rows", "append_fused_shared_experts", "gemma4_routing",
        "minimax2_routing", "eplb_logical_to_physical", "RoutingMethodType017", "routing_method_type_value",
        "routing_method_type_enum", "get_routing_method_type", "router_kind", "grouped_topk_router", "route",
    )),
]


def __getattr__(name: str):
    """The 0.33 routing functions of ``reference.routing_033`` as ``reference.routing.<name>`` (imported lazily:
    ``routing_033`` imports this module)."""
    if name in _ROUTING_033:
        from reference import routing_033

        return getattr(routing_033, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class RoutingMethodType(enum.IntEnum):
    """vLLM's ``RoutingMethodType`` (``fused_moe/config.py``): how a monolithic kernel must route.

    The values are vLLM 0.33.0's (the newest semantics; values are passed to FlashInfer's kernels as ints). They
    moved between releases: vLLM 0.17.0 has Default..TopK = 0..5, Custom = 6, Simulated = 7, Unspecified = 8 and no
    SigmoidRenorm / MiniMax2 / Sigmoid / DeepseekV4 (``RoutingMethodType017``). ``routing_method_type_value(name,
    semantics=...)`` gives a member's value under either version (point ``routing.routing_method_type_values``).
    """

    Default = 0  # softmax -> top-k
    Renormalize = 1  # top-k -> softmax (gpt-oss)
    DeepSeekV3 = 2  # sigmoid + bias, grouped top-k, renormalize, scale
    Llama4 = 3  # top-1 -> sigmoid
    RenormalizeNaive = 4  # softmax -> top-k -> renormalize
    TopK = 5  # top-k of the raw scores, no normalization
    SigmoidRenorm = 6  # sigmoid -> top-k -> renormalize
    MiniMax2 = 7  # sigmoid + bias -> top-k -> scaled sum-normalize (routed_scaling_factor, epsilon 1e-20)
    Sigmoid = 8  # sigmoid -> top-k, no renormalization
    Unspecified = 9
    DeepseekV4 = 100  # sqrtsoftplus + bias -> top-k -> normalize (not passed to FlashInfer)
    Custom = 101
    Simulated = 102


def check_router_logits(logits: torch.Tensor, num_experts: int | None = None) -> None:
    """Validate router logits: 2-D ``(M, E)`` floating, all finite.

    Raises:
        ValueError: wrong rank/dtype/width, or a non-finite value (names the first token and expert, and says how
            to opt out with ``check_finite=False``).
    """
    if logits.dim() != 2:
        raise ValueError(f"router logits must be 2-D (num_tokens, num_experts), got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"router logits must be floating point, got {logits.dtype}")
    if num_experts is not None and logits.shape[1] != num_experts:
        raise ValueError(f"router logits have {logits.shape[1]} experts, expected {num_experts}")
    bad = ~torch.isfinite(logits)
    if bool(bad.any()):
        t, e = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"router logits are not finite: token {t}, expert {e} is {logits[t, e].item()} "
            f"({int(bad.any(dim=1).sum())} bad tokens). Pass check_finite=False to route them anyway "
            "(ids stay in range, weights unspecified)."
        )


def _topk_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row: descending, lower index first on ties, NaN ranked lowest."""
    if k > scores.shape[-1]:
        raise ValueError(f"topk={k} is larger than the number of experts {scores.shape[-1]}")
    if k <= 0:
        raise ValueError(f"topk must be positive, got {k}")
    key = torch.where(torch.isnan(scores), torch.full_like(scores, float("-inf")), scores)
    # Stable sort keeps the lower index first among equal keys (NaN and -inf are both -inf here).
    return torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :k]


def _scores(logits: torch.Tensor, scoring_func: str, semantics=None) -> torch.Tensor:
    x = logits.float()
    if scoring_func == "softmax":
        return torch.softmax(x, dim=-1)
    if scoring_func == "sigmoid":
        return torch.sigmoid(x)
    if scoring_func == "sqrtsoftplus":
        require("scoring_func='sqrtsoftplus' (DeepSeek-V4)", "0.33", semantics,
                upstream="fused_moe/router/fused_topk_bias_router.py")
        # softplus with torch's threshold 20 (x > 20 -> x), the kernels' threshold; then sqrt.
        return torch.sqrt(torch.nn.functional.softplus(x))
    raise ValueError(f"unsupported scoring_func {scoring_func!r}; use 'softmax' or 'sigmoid' (or 'sqrtsoftplus' "
                     "under the 0.33 semantics)")


def _nonfinite_mode(check_finite: bool | None, v: SemanticsVersion, clamps: bool = True) -> str:
    """How non-finite logits are treated: "raise", "clamp" (0.33 topk_softmax/topk_sigmoid) or "rank_low" (0.17).

    ``check_finite=None`` is the version's default: raise under 0.17, clamp under 0.33 where vLLM clamps
    (``clamps``), raise elsewhere. True always raises; False never does.
    """
    if check_finite is None:
        check_finite = not (v >= SemanticsVersion.V0_33 and clamps)
    if check_finite:
        return "raise"
    return "clamp" if v >= SemanticsVersion.V0_33 and clamps else "rank_low"


def _checked_scores(logits: torch.Tensor, scoring_func: str, mode: str, v: SemanticsVersion,
                    explicit: bool) -> torch.Tensor:
    """Scores under the non-finite mode. Clamp: a NaN / +-inf score becomes 0 (``topk_softmax_kernels.cu`` and, for
    NaN only, ``topk_softplus_sqrt_kernels.cu`` of vLLM 0.33.0)."""
    if mode == "raise":
        check_router_logits(logits)
    s = _scores(logits, scoring_func, v)
    if mode == "clamp":
        if scoring_func == "sqrtsoftplus":
            # The sqrtsoftplus kernels clamp NaN only: +inf logits give an infinite score and NaN weights upstream.
            if not explicit and bool(torch.isposinf(logits).any()):
                t, e = (int(i) for i in torch.isposinf(logits).nonzero()[0])
                raise ValueError(
                    f"router logits: token {t}, expert {e} is +inf; vLLM 0.33's sqrtsoftplus kernels return NaN "
                    "weights for it (they clamp NaN only), which the reference does not specify. Pass "
                    "check_finite=False to route it anyway (weights unspecified).")
            s = torch.where(torch.isnan(s), torch.zeros_like(s), s)
        else:
            s = torch.where(torch.isfinite(s), s, torch.zeros_like(s))
    return s


def _finish(weights, ids, renormalize, routed_scaling_factor, indices_type):
    if renormalize:
        # A zero sum (every selected score 0: clamped rows, underflowed sigmoids) divides by 1, as the kernels do
        # (``denom = selected_sum > 0 ? selected_sum : 1`` in topk_softmax_kernels.cu of vLLM 0.17.0 and 0.33.0).
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / torch.where(total > 0, total, torch.ones_like(total))
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights.float(), ids.to(indices_type or torch.int32)


def fused_topk(
    hidden_states: torch.Tensor | None,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    *,
    scoring_func: str = "softmax",
    indices_type: torch.dtype | None = None,
    check_finite: bool | None = None,
    is_padding: torch.Tensor | None = None,
    semantics: SemanticsVersion | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score all experts, keep the top ``topk`` per token, optionally renormalize.

    Args:
        hidden_states: ``(M, K)`` or None; only its row count is checked (vLLM's signature carries it).
        gating_output: ``(M, E)`` router logits, any floating dtype (scored in fp32).
        topk: experts per token, ``1 <= topk <= E``.
        renormalize: divide the k weights by their sum (a zero sum divides by 1).
        scoring_func: ``"softmax"`` (over all E) or ``"sigmoid"``.
        indices_type: dtype of the ids (int32 by default).
        check_finite: None: the version's rule; True: raise on NaN/inf; False: never raise (module doc).
        is_padding: ``(M,)`` bool, 0.33 only: padding rows get id -1 and weight 0 (``apply_padding_rows``).
        semantics: version (default ``reference.semantics.current_semantics()``).

    Returns:
        ``(topk_weights (M, topk) fp32, topk_ids (M, topk) int32)``; per token in descending score order.

    Raises:
        ValueError: bad shapes, topk out of range, unknown scoring_func, non-finite logits (see module doc).
        SemanticsError: ``is_padding`` under 0.17.

    Mirrors ``vllm/model_executor/layers/fused_moe/router/fused_topk_router.py::fused_topk``. Versions differ in the
    non-finite rule (point ``routing.nonfinite_logits``: 0.17.0 raises / unspecified, 0.33.0 clamps,
    ``csrc/moe/topk_softmax_kernels.cu``) and padding rows (``routing.padding_rows``, 0.33.0 only).
    """
    v = resolve_semantics(semantics)
    mode = _nonfinite_mode(check_finite, v)
    if hidden_states is not None and hidden_states.shape[0] != gating_output.shape[0]:
        raise ValueError(
            f"hidden_states has {hidden_states.shape[0]} tokens but gating_output has {gating_output.shape[0]}"
        )
    if scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"unsupported scoring_func {scoring_func!r} for fused_topk; use 'softmax' or 'sigmoid'")
    scores = _checked_scores(gating_output, scoring_func, mode, v, check_finite is False)
    ids = _topk_ids(scores, topk)
    w, ids = _finish(scores.gather(1, ids), ids, renormalize, 1.0, indices_type)
    if is_padding is not None:
        from reference.routing_033 import apply_padding_rows

        w, ids = apply_padding_rows(w, ids, is_padding, semantics=v)
    return w, ids


def fused_topk_bias(
    hidden_states: torch.Tensor | None,
    gating_output: torch.Tensor,
    e_score_correction_bias: torch.Tensor | None,
    topk: int,
    renormalize: bool,
    *,
    scoring_func: str = "sigmoid",
    routed_scaling_factor: float = 1.0,
    indices_type: torch.dtype | None = None,
    check_finite: bool | None = None,
    input_ids: torch.Tensor | None = None,
    hash_indices_table: torch.Tensor | None = None,
    bias_vl: torch.Tensor | None = None,
    image_sentinel_lo: int = 0,
    is_padding: torch.Tensor | None = None,
    semantics: SemanticsVersion | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k where the *biased* scores choose the experts and the *unbiased* scores are the weights.

    Weights are renormalized (if asked; a zero sum divides by 1) and then multiplied by ``routed_scaling_factor``.
    ``e_score_correction_bias`` is ``(E,)`` (fp32 in real checkpoints; added in fp32). Mirrors vLLM
    ``fused_moe/router/fused_topk_bias_router.py::fused_topk_bias``.

    Under the 0.33 semantics (vLLM 0.33.0: ``fused_topk_bias_router.py``, ``router/dsv4_topk.py``,
    ``csrc/moe/topk_softplus_sqrt_kernels.cu``; ``SemanticsError`` under 0.17, which has none of them):

    - ``scoring_func="sqrtsoftplus"`` (DeepSeek-V4, point ``routing.sqrtsoftplus``): score =
      ``sqrt(softplus(x))`` in fp32, softplus(x) = x for x > 20 else log(1 + exp(x)). Non-finite: a NaN score is 0
      (the kernels' clamp); +inf logits raise unless ``check_finite=False`` (upstream weights are NaN). The
      ``e_score_correction_bias`` may be None (no bias).
    - Hash routing (``hash_indices_table`` ``(vocab, topk)`` int, ``input_ids`` ``(M,)`` int; point
      ``routing.hash_routing``; sqrtsoftplus only, as on CUDA): ids = ``hash_indices_table[input_ids]`` (a lookup:
      no score decides, order kept); weights = the unbiased scores of those ids, renormalized, scaled. An id
      outside ``[0, vocab)`` raises.
    - Image-token bias (``bias_vl`` ``(E,)`` fp32, ``image_sentinel_lo > 0``; point ``routing.image_token_bias``;
      sqrtsoftplus only): a token whose id is in ``[image_sentinel_lo, image_sentinel_lo + 5)`` chooses by
      ``score + bias_vl`` instead of ``score + e_score_correction_bias`` and, with a hash table, instead of the
      lookup. ``image_sentinel_lo == 0`` disables it.
    - ``is_padding`` ``(M,)`` bool (point ``routing.padding_rows``): padding rows get id -1 and weight 0.

    Ties: lower expert index first (the kernels' argmax). The CUDA sqrtsoftplus kernel returns ``(s + b) - b`` as
    the weight of a biased choice (not ``s``), so weights may differ from the reference in the last bits.
    """
    v = resolve_semantics(semantics)
    new_feature = (scoring_func == "sqrtsoftplus" or hash_indices_table is not None or bias_vl is not None
                   or is_padding is not None or e_score_correction_bias is None)
    if new_feature:
        require("fused_topk_bias with sqrtsoftplus / hash_indices_table / bias_vl / is_padding / no bias", "0.33",
                v, upstream="fused_moe/router/fused_topk_bias_router.py")
    if (hash_indices_table is not None or bias_vl is not None) and scoring_func != "sqrtsoftplus":
        raise ValueError("hash_indices_table and bias_vl are defined with scoring_func='sqrtsoftplus' only (vLLM "
                         "0.33.0's CUDA topk_softmax / topk_sigmoid kernels take neither)")
    mode = _nonfinite_mode(check_finite, v)
    scores = _checked_scores(gating_output, scoring_func, mode, v, check_finite is False)
    M, E = scores.shape
    if e_score_correction_bias is not None:
        choice = scores + e_score_correction_bias.float().unsqueeze(0)
    else:
        choice = scores
    from reference.routing_033 import hash_topk_ids, image_token_mask

    image = None
    if bias_vl is not None and image_sentinel_lo > 0:
        image = image_token_mask(input_ids, image_sentinel_lo, M)
        choice = torch.where(image.unsqueeze(-1), scores + bias_vl.float().unsqueeze(0), choice)
    if hash_indices_table is not None:
        skip = image
        if is_padding is not None:
            pad = is_padding.to(torch.bool)
            skip = pad if skip is None else (skip | pad)
        ids = hash_topk_ids(input_ids, hash_indices_table, topk, E, skip=skip, semantics=v)
        if image is not None:
            ids = torch.where(image.unsqueeze(-1), _topk_ids(choice, topk), ids)
    else:
        ids = _topk_ids(choice, topk)
    w, ids = _finish(scores.gather(1, ids), ids, renormalize, routed_scaling_factor, indices_type)
    if is_padding is not None:
        from reference.routing_033 import apply_padding_rows

        w, ids = apply_padding_rows(w, ids, is_padding, semantics=v)
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

    Returns:
        ``(topk_weights (M, topk) fp32, topk_ids (M, topk) int32)``.

    Mirrors ``vllm/model_executor/layers/fused_moe/router/grouped_topk_router.py::grouped_topk`` (native torch).
    """
    if check_finite is not False:  # no clamp upstream in 0.17.0 or 0.33.0: raises under both
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
    return _finish(scores.gather(1, ids), ids, renormalize, routed_scaling_factor, indices_type)


def topk_softmax(
    hidden_states: torch.Tensor | None,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool = True,
    *,
    indices_type: torch.dtype | None = None,
    check_finite: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss routing (``RoutingMethodType.Renormalize``): top-k of the raw logits, softmax over those k (fp32).

    Mathematically equal to softmax -> top-k -> renormalize, but rounded differently; ``renormalize`` is accepted
    for signature compatibility and must be True.
    """
    if not renormalize:
        raise ValueError("topk_softmax always normalizes over the selected k; renormalize=False is not defined")
    if check_finite is not False:  # no clamp upstream in 0.17.0 or 0.33.0: raises under both
        check_router_logits(gating_output)
    logits = gating_output.float()
    ids = _topk_ids(logits, topk)
    w = torch.softmax(logits.gather(1, ids), dim=-1)
    return w.float(), ids.to(indices_type or torch.int32)


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


def select_experts(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    use_grouped_topk: bool,
    renormalize: bool,
    topk_group: int | None = None,
    num_expert_group: int | None = None,
    custom_routing_function: Callable | None = None,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: torch.Tensor | None = None,
    indices_type: torch.dtype | None = None,
    enable_eplb: bool = False,
    expert_map: torch.Tensor | None = None,
    expert_load_view: torch.Tensor | None = None,
    logical_to_physical_map: torch.Tensor | None = None,
    logical_replica_count: torch.Tensor | None = None,
    global_num_experts: int | None = None,
    zero_expert_num: int | None = None,
    zero_expert_type: str | None = None,
    num_fused_shared_experts: int = 0,
    *,
    check_finite: bool | None = None,
    scale_plain_topk: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Route tokens (seed 003 ``FusedMoE.select_experts``): returns ``(topk_weights, topk_ids, zero_expert_result)``.

    Dispatch: ``use_grouped_topk`` with a valid grouping -> ``grouped_topk``; ``use_grouped_topk`` with an invalid
    grouping (E <= G or E % G != 0) falls back to plain top-k as vLLM does (``fused_topk_bias`` when a correction
    bias is given, else ``fused_topk``); ``custom_routing_function(hidden_states, gating_output, topk, renormalize)``
    when given; a correction bias without grouping -> ``fused_topk_bias``; else ``fused_topk``.

    ``routed_scaling_factor`` reaches the grouped and the biased routers only: vLLM's plain top-k router is built
    without it (``vllm/model_executor/layers/fused_moe/router/router_factory.py`` ``create_fused_moe_router``
    passes no factor to ``FusedTopKRouter``, and ``router/fused_topk_router.py`` never scales), so plain top-k
    weights are *not* multiplied by a factor != 1 (vLLM 0.17 and later). ``scale_plain_topk=True`` multiplies them
    anyway (what this reference did before, and what a model that scales outside the router expects).

    Zero experts (LongCat-style, ``zero_expert_num > 0``): logits have ``global_num_experts + zero_expert_num``
    columns; a slot routed to an id ``>= global_num_experts`` is a zero expert: with ``zero_expert_type ==
    "identity"`` it contributes ``weight * hidden_states`` to ``zero_expert_result`` (M, K) in the hidden dtype
    (fp32 accumulation), and its slot is rewritten to id 0 with weight 0 so the routed experts ignore it.

    Non-finite logits follow each routing function's rule under the selected semantics (``check_finite=None``); a
    custom routing function's logits are checked unless ``check_finite=False``. The 0.33 router (factory dispatch,
    invalid-grouping fallback, shared-expert slots, padding rows, EPLB) is ``reference.routing_033.route``.

    Not modelled: EPLB (``enable_eplb=True`` raises ValueError), ``expert_map`` is accepted and unused here (routing
    runs over global ids; the experts apply the map), ``num_fused_shared_experts`` must be 0.
    """
    if enable_eplb:
        raise ValueError("EPLB (redundant experts) is outside this reference; pass enable_eplb=False")
    if num_fused_shared_experts:
        raise ValueError("fused shared experts are not modelled by select_experts; pass num_fused_shared_experts=0")
    E = router_logits.shape[-1]
    zero_n = zero_expert_num or 0
    if global_num_experts is not None and global_num_experts + zero_n != E:
        raise ValueError(
            f"router_logits has {E} columns but global_num_experts + zero_expert_num = {global_num_experts + zero_n}"
        )
    common = dict(indices_type=indices_type, check_finite=check_finite)
    if use_grouped_topk and valid_grouping(E, num_expert_group):
        w, ids = grouped_topk(
            hidden_states, router_logits, top_k, renormalize, num_expert_group, topk_group or num_expert_group,
            scoring_func=scoring_func, routed_scaling_factor=routed_scaling_factor,
            e_score_correction_bias=e_score_correction_bias, **common,
        )
    elif custom_routing_function is not None:
        if check_finite is not False:
            check_router_logits(router_logits)
        w, ids = custom_routing_function(hidden_states, router_logits, top_k, renormalize)
        w, ids = w.float(), ids.to(indices_type or torch.int32)
    elif e_score_correction_bias is not None:
        w, ids = fused_topk_bias(
            hidden_states, router_logits, e_score_correction_bias, top_k, renormalize,
            scoring_func=scoring_func, routed_scaling_factor=routed_scaling_factor, **common,
        )
    else:
        w, ids = fused_topk(hidden_states, router_logits, top_k, renormalize, scoring_func=scoring_func, **common)
        if scale_plain_topk and routed_scaling_factor != 1.0:  # vLLM's FusedTopKRouter never scales
            w = w * routed_scaling_factor

    zero_result = None
    if zero_n:
        if zero_expert_type != "identity":
            raise ValueError(f"zero_expert_type {zero_expert_type!r} is not defined; only 'identity' is")
        n_real = E - zero_n
        is_zero = ids >= n_real
        zw = torch.where(is_zero, w, torch.zeros_like(w))
        zero_result = (zw.sum(dim=1, keepdim=True) * hidden_states.float()).to(hidden_states.dtype)
        ids = torch.where(is_zero, torch.zeros_like(ids), ids)
        w = torch.where(is_zero, torch.zeros_like(w), w)
    return w, ids, zero_result


def determine_expert_map(
    ep_size: int,
    ep_rank: int,
    global_num_experts: int,
    expert_placement_strategy: str = "linear",
    num_fused_shared_experts: int = 0,
) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
    """Which global experts this EP rank holds: ``(local_num_experts, expert_map, expert_mask)``.

    ``expert_map`` is int32 ``(global_num_experts,)``: the local index of each global expert held here, -1 elsewhere.
    ``E % ep_size`` remainder experts go one each to the *first* ranks: this follows vLLM's code; seed 003's
    docstring says "assigned to the last rank", which the code does not do.
    Strategies: ``"linear"`` (contiguous ranges) and ``"round_robin"`` (expert e on rank ``e % ep_size``).
    ``expert_mask`` (AITER): ``(global + num_fused_shared_experts + 1,)`` int32, 1 for held and shared experts,
    0 for others and for the trailing sentinel. With ``ep_size == 1`` returns ``(global_num_experts, None, None)``.

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
    expert_mask = torch.zeros(global_num_experts + num_fused_shared_experts + 1, dtype=torch.int32)
    expert_mask[:global_num_experts] = (expert_map >= 0).int()
    expert_mask[global_num_experts : global_num_experts + num_fused_shared_experts] = 1
    return local, expert_map, expert_mask
