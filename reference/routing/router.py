"""The router end to end: seed 003's ``select_experts``, ``RoutingMethodType`` per version
(``RoutingMethodType017``, ``routing_method_type_value``, ``get_routing_method_type``), ``create_fused_moe_router``'s
dispatch (``router_kind``), fused shared-expert slots and ``route`` (kind -> routing -> padding -> shared slots ->
EPLB)."""

from __future__ import annotations

import enum
from typing import Callable

import torch

from reference.routing.common import RoutingMethodType, V033, _UP, check_router_logits
from reference.routing.cpu import cpu_route
from reference.routing.custom import llama4_routing, token_choice_with_bias
from reference.routing.eplb import eplb_logical_to_physical
from reference.routing.grouped import grouped_topk, grouped_topk_router, valid_grouping
from reference.routing.topk import fused_topk, fused_topk_bias
from reference.routing.zero import zero_expert_router
from reference.semantics import SemanticsError, require, resolve_semantics

__all__ = ["RoutingMethodType017", "routing_method_type_enum", "routing_method_type_value", "get_routing_method_type",
           "custom_routing_method_type", "router_kind", "append_fused_shared_experts", "select_experts", "route"]


class RoutingMethodType017(enum.IntEnum):
    """vLLM 0.17.0's ``RoutingMethodType`` (``fused_moe/config.py``): the values under the 0.17 semantics."""

    Default = 0
    Renormalize = 1
    DeepSeekV3 = 2
    Llama4 = 3
    RenormalizeNaive = 4
    TopK = 5
    Custom = 6
    Simulated = 7
    Unspecified = 8  # written ``8.0`` upstream


def routing_method_type_enum(semantics=None) -> type[enum.IntEnum]:
    """The ``RoutingMethodType`` class of the version: ``RoutingMethodType017`` or ``RoutingMethodType`` (0.33)."""
    return RoutingMethodType017 if resolve_semantics(semantics) < V033 else RoutingMethodType


def routing_method_type_value(member: str | enum.Enum, semantics=None) -> int:
    """The integer value of a ``RoutingMethodType`` member (by name) under the version.

    Raises: SemanticsError when the version has no such member (e.g. ``MiniMax2`` under 0.17).
    """
    name = member.name if isinstance(member, enum.Enum) else str(member)
    cls = routing_method_type_enum(semantics)
    try:
        return int(cls[name])
    except KeyError:
        raise SemanticsError(f"RoutingMethodType.{name} does not exist under vLLM "
                             f"{resolve_semantics(semantics).value} semantics; its members: "
                             f"{', '.join(m.name for m in cls)}") from None


def get_routing_method_type(scoring_func: str, top_k: int, renormalize: bool, num_expert_group: int | None,
                            has_e_score_bias: bool, *, semantics=None) -> enum.IntEnum:
    """vLLM's ``get_routing_method_type`` (``fused_moe/config.py``) per version; returns that version's enum member.

    0.33.0: sqrtsoftplus -> DeepseekV4 (renormalize) / Unspecified; bias + sigmoid + renormalize -> DeepSeekV3 with
    groups, MiniMax2 without; bias otherwise -> Unspecified; sigmoid -> SigmoidRenorm / Sigmoid; softmax ->
    RenormalizeNaive (renormalize) / Default. 0.17.0: bias -> DeepSeekV3 (groups and sigmoid) / Unspecified;
    sigmoid -> Llama4 (top_k == 1) / Unspecified; softmax -> Renormalize (renormalize) / Default.
    """
    v = resolve_semantics(semantics)
    if v >= V033:
        T = RoutingMethodType
        if scoring_func == "sqrtsoftplus":
            return T.DeepseekV4 if renormalize else T.Unspecified
        if has_e_score_bias:
            if scoring_func == "sigmoid":
                if not renormalize:
                    return T.Unspecified
                return T.DeepSeekV3 if (num_expert_group or 0) > 0 else T.MiniMax2
            return T.Unspecified
        if scoring_func == "sigmoid":
            return T.SigmoidRenorm if renormalize else T.Sigmoid
        if scoring_func == "softmax":
            return T.RenormalizeNaive if renormalize else T.Default
        return T.Unspecified
    T = RoutingMethodType017
    if has_e_score_bias:
        return T.DeepSeekV3 if (num_expert_group or 0) > 0 and scoring_func == "sigmoid" else T.Unspecified
    if scoring_func == "sigmoid":
        return T.Llama4 if top_k == 1 else T.Unspecified
    if scoring_func == "softmax":
        return T.Renormalize if renormalize else T.Default
    return T.Unspecified


# The custom routing functions CustomRoutingRouter recognises, by the reference function and by vLLM's name.
_LLAMA4 = ("Llama4MoE.custom_routing_function", llama4_routing)
_COHERE2 = ("token_choice_with_bias", token_choice_with_bias)


def custom_routing_method_type(custom_routing_function: Callable | str, renormalize: bool = True, *,
                               semantics=None) -> enum.IntEnum:
    """``CustomRoutingRouter.routing_method_type`` (``fused_moe/router/custom_routing_router.py``) per version: the
    ``RoutingMethodType`` a custom routing function advertises (it drives kernel selection, e.g. FlashInfer
    TRT-LLM's built-in routing).

    ``custom_routing_function`` is the function (the reference's ``llama4_routing`` stands for vLLM's
    ``Llama4MoE.custom_routing_function``, ``token_choice_with_bias`` for Cohere2-MoE's) or its vLLM name
    (``"Llama4MoE.custom_routing_function"``, ``"token_choice_with_bias"``); anything else is another function.

    0.33.0: Llama-4's -> ``Llama4``; Cohere2-MoE's ``token_choice_with_bias`` -> ``SigmoidRenorm`` when the router
    renormalizes, else ``Sigmoid``; any other -> ``Custom``. 0.17.0: Llama-4's -> ``Llama4``; any other (there is
    no Cohere2-MoE) -> ``Custom``. Returns that version's enum member (``routing_method_type_enum``).
    """
    v = resolve_semantics(semantics)
    T = routing_method_type_enum(v)
    if any(custom_routing_function is f or custom_routing_function == f for f in _LLAMA4):
        return T.Llama4
    if v >= V033 and any(custom_routing_function is f or custom_routing_function == f for f in _COHERE2):
        return T.SigmoidRenorm if renormalize else T.Sigmoid
    return T.Custom


def router_kind(
    *,
    top_k: int,
    renormalize: bool = True,
    use_grouped_topk: bool = False,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    has_e_score_correction_bias: bool = False,
    custom_routing_function: bool = False,
    zero_expert_type: str | None = None,
    has_hash_indices_table: bool = False,
    num_fused_shared_experts: int = 0,
    is_cpu: bool = False,
    aiter_shared_experts_enabled: bool = False,
    routing_simulation_strategy: str = "",
    semantics=None,
) -> str:
    """Which router ``create_fused_moe_router`` (``fused_moe/router/router_factory.py``) builds, per version.

    0.33.0, in order: ``ZeroExpertRouter`` (zero_expert_type set; a correction bias required, whatever else is set);
    ``CPURouter`` (on CPU, whatever else is set: grouping with a custom function is not rejected there, see
    ``reference.routing.cpu_router_path``); ``GroupedTopKRouter``
    when ``use_grouped_topk`` unless the grouping is degenerate (``num_expert_group <= 1 and topk_group <= 1``)
    *and* the scaling is handled downstream (``routed_scaling_factor == 1`` or a correction bias) *and* the
    advertised ``RoutingMethodType`` is the same with and without the groups - then it falls through;
    ``CustomRoutingRouter``; ``FusedTopKBiasRouter`` (correction bias or hash table);
    ``AiterSharedRoutedFusedMoERouter`` (fused shared experts, softmax, AITER shared-expert fusion on);
    ``FusedTopKRouter``. ``VLLM_MOE_ROUTING_SIMULATION_STRATEGY`` replaces the chosen one by
    ``RoutingSimulatorRouter`` (after choosing it).

    0.17.0: ``RoutingSimulatorRouter`` first when the strategy is set; ``GroupedTopKRouter`` when
    ``use_grouped_topk`` and (its routing method is not Unspecified or ``num_expert_group > 1`` or
    ``topk_group > 1``), else fall through; ``CustomRoutingRouter``; ``FusedTopKBiasRouter`` (correction bias);
    ``FusedTopKRouter``. No zero-expert, CPU, hash or AITER-shared router.

    Raises:
        ValueError: grouped routing without ``num_expert_group`` / ``topk_group``, grouped with a custom routing
            function (vLLM asserts), an unknown scoring_func. SemanticsError: a 0.33-only input under 0.17.
    """
    v = resolve_semantics(semantics)

    def check_grouped():  # vLLM checks these inside the grouped branch only (not for zero experts / CPU / simulation)
        if custom_routing_function:
            raise ValueError("use_grouped_topk with a custom_routing_function is not allowed (vLLM asserts)")
        if num_expert_group is None or topk_group is None:
            raise ValueError("num_expert_group and topk_group must be provided when use_grouped_topk is True")

    if v < V033:
        if zero_expert_type is not None or has_hash_indices_table or is_cpu or num_fused_shared_experts:
            raise SemanticsError("zero experts / hash tables / the CPU router / fused shared experts are not part "
                                 "of vLLM 0.17.0's create_fused_moe_router")
        if routing_simulation_strategy:
            return "RoutingSimulatorRouter"
        if use_grouped_topk:
            check_grouped()
            rmt = get_routing_method_type(scoring_func, top_k, renormalize, num_expert_group,
                                          has_e_score_correction_bias, semantics=v)
            if rmt != RoutingMethodType017.Unspecified or num_expert_group > 1 or topk_group > 1:
                return "GroupedTopKRouter"
        if custom_routing_function:
            return "CustomRoutingRouter"
        if has_e_score_correction_bias:
            return "FusedTopKBiasRouter"
        return "FusedTopKRouter"

    kind = None
    if zero_expert_type is not None:
        if not has_e_score_correction_bias:
            raise ValueError("e_score_correction_bias is required when zero_expert_type is set")
        kind = "ZeroExpertRouter"
    elif is_cpu:
        kind = "CPURouter"
    elif use_grouped_topk:
        check_grouped()
        degenerate = num_expert_group <= 1 and topk_group <= 1
        scaling_downstream = routed_scaling_factor == 1.0 or has_e_score_correction_bias

        def advertised(groups):
            return get_routing_method_type(scoring_func, top_k, renormalize, groups, has_e_score_correction_bias,
                                           semantics=v)

        if not (degenerate and scaling_downstream and advertised(num_expert_group) == advertised(None)):
            kind = "GroupedTopKRouter"
    if kind is None:
        if not custom_routing_function and scoring_func not in ("sigmoid", "softmax", "sqrtsoftplus"):
            raise ValueError(f"unsupported scoring_func {scoring_func!r}")
        if custom_routing_function:
            kind = "CustomRoutingRouter"
        elif has_e_score_correction_bias or has_hash_indices_table:
            kind = "FusedTopKBiasRouter"
        elif num_fused_shared_experts > 0 and scoring_func == "softmax" and aiter_shared_experts_enabled:
            kind = "AiterSharedRoutedFusedMoERouter"
        else:
            kind = "FusedTopKRouter"
    if routing_simulation_strategy:
        return "RoutingSimulatorRouter"
    return kind


def append_fused_shared_experts(topk_weights: torch.Tensor, topk_ids: torch.Tensor, global_num_experts: int,
                                num_fused_shared_experts: int, shared_expert_weight: float = 1.0, *,
                                semantics=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused shared experts: append ``n`` slots with ids ``E, E+1, ..., E+n-1`` and weight ``shared_expert_weight``.

    Every row gets them, after the routed top-k has been renormalized and scaled (so they do not enter the
    renormalization), padding rows included (their routed slots are -1, the shared slots are not). Output
    ``(M, k + n)``: weights in ``topk_weights``' dtype, ids in ``topk_ids``' dtype. ``n == 0`` returns the inputs.
    Mirrors ``FusedTopKBiasRouter._compute_routing`` in ``fused_moe/router/fused_topk_bias_router.py`` (vLLM 0.33.0).

    Raises:
        ValueError: ``n < 0``. SemanticsError under 0.17 (vLLM 0.17.0 has no such slots in its routers).
    """
    require("fused shared-expert slots", "0.33", semantics, upstream=_UP + "fused_topk_bias_router.py")
    n = int(num_fused_shared_experts)
    if n < 0:
        raise ValueError(f"num_fused_shared_experts must be >= 0, got {n}")
    if n == 0:
        return topk_weights, topk_ids
    m = topk_ids.shape[0]
    shared_ids = torch.arange(global_num_experts, global_num_experts + n, dtype=topk_ids.dtype,
                              device=topk_ids.device).expand(m, n)
    shared_w = torch.full((m, n), shared_expert_weight, dtype=topk_weights.dtype, device=topk_weights.device)
    return torch.cat([topk_weights, shared_w], dim=-1), torch.cat([topk_ids, shared_ids], dim=-1)


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

    Dispatch: ``use_grouped_topk`` -> ``grouped_topk_router``: ``grouped_topk`` on a
    valid grouping, else the selected release's fallback (point ``routing.invalid_grouping_fallback``: no bias:
    softmax ``fused_topk``, no scaling; bias: ``fused_topk_bias`` (0.17 softmax, 0.33 the layer's scoring_func),
    then scaled); ``custom_routing_function(hidden_states, gating_output, topk, renormalize)``
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
    invalid-grouping fallback, shared-expert slots, padding rows, EPLB) is ``reference.route``.

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
    if use_grouped_topk:
        # GroupedTopKRouter: grouped_topk, or each release's invalid-grouping fallback.
        w, ids = grouped_topk_router(
            hidden_states, router_logits, top_k, num_expert_group or 0, topk_group or num_expert_group or 0,
            renormalize=renormalize, scoring_func=scoring_func, routed_scaling_factor=routed_scaling_factor,
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


def route(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool = True,
    use_grouped_topk: bool = False,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: torch.Tensor | None = None,
    custom_routing_function: Callable | None = None,
    input_ids: torch.Tensor | None = None,
    hash_indices_table: torch.Tensor | None = None,
    bias_vl: torch.Tensor | None = None,
    image_sentinel_lo: int = 0,
    num_fused_shared_experts: int = 0,
    shared_expert_weight: float = 1.0,
    is_padding: torch.Tensor | None = None,
    skip_padding: bool = False,
    eplb: tuple[torch.Tensor, torch.Tensor] | None = None,
    indices_type: torch.dtype | None = None,
    check_finite: bool | None = None,
    capture_fn: Callable[[torch.Tensor], None] | None = None,
    zero_expert_type: str | None = None,
    num_logical_experts: int | None = None,
    zero_expert_output_fn: Callable[[torch.Tensor], None] | None = None,
    is_cpu: bool = False,
    semantics=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router end to end, as ``create_fused_moe_router(...)`` + ``select_experts`` run it.

    1. ``router_kind`` picks the router (CUDA unless ``is_cpu``; no AITER, no simulation);
    2. that router's routing: ``zero_expert_router`` (``ZeroExpertRouter``, 0.33: ``zero_expert_type`` and
       ``num_logical_experts`` given; its zero-expert output goes to ``zero_expert_output_fn``, vLLM's
       ``router.zero_expert_output``), ``cpu_route`` (``CPURouter``, 0.33, ``is_cpu``), ``fused_topk``
       (``FusedTopKRouter``, padding rows masked), ``fused_topk_bias`` + ``append_fused_shared_experts``
       (``FusedTopKBiasRouter``), ``grouped_topk_router`` (``GroupedTopKRouter``), or
       ``custom_routing_function(hidden_states, gating_output, topk, renormalize)`` (weights fp32, ids int32);
    3. routed-expert capture: ``capture_fn(ids)`` with the logical ids (``BaseRouter.capture_fn``, 0.17.0 and 0.33.0;
       ``reference.routing.capture``);
    4. EPLB (``eplb=(logical_to_physical_map, logical_replica_count)``): ``eplb_logical_to_physical``;
    5. ids to ``indices_type``.
    Under 0.17 the 0.33-only inputs raise SemanticsError. Mirrors ``fused_moe/router/router_factory.py`` and
    ``base_router.py::BaseRouter._select_experts`` (vLLM 0.17.0 / 0.33.0).
    """
    v = resolve_semantics(semantics)
    kind = router_kind(top_k=top_k, renormalize=renormalize, use_grouped_topk=use_grouped_topk,
                       num_expert_group=num_expert_group, topk_group=topk_group, scoring_func=scoring_func,
                       routed_scaling_factor=routed_scaling_factor,
                       has_e_score_correction_bias=e_score_correction_bias is not None,
                       custom_routing_function=custom_routing_function is not None,
                       has_hash_indices_table=hash_indices_table is not None,
                       num_fused_shared_experts=num_fused_shared_experts if v >= V033 else 0,
                       zero_expert_type=zero_expert_type, is_cpu=is_cpu, semantics=v)
    if v < V033 and (num_fused_shared_experts or is_padding is not None or hash_indices_table is not None
                     or bias_vl is not None):
        raise SemanticsError("shared-expert slots / padding rows / hash routing / image bias are 0.33 features")
    if kind == "ZeroExpertRouter":
        if num_logical_experts is None:
            raise ValueError("num_logical_experts is required when zero_expert_type is set")
        w, ids, out = zero_expert_router(hidden_states, router_logits, top_k, e_score_correction_bias,
                                         num_logical_experts, zero_expert_type, scoring_func=scoring_func,
                                         renormalize=renormalize, routed_scaling_factor=routed_scaling_factor,
                                         indices_type=indices_type, check_finite=check_finite, semantics=v)
        if zero_expert_output_fn is not None:
            zero_expert_output_fn(out)
    elif kind == "CPURouter":
        w, ids = cpu_route(hidden_states, router_logits, top_k, use_grouped_topk=use_grouped_topk,
                           num_expert_group=num_expert_group, topk_group=topk_group, renormalize=renormalize,
                           scoring_func=scoring_func, routed_scaling_factor=routed_scaling_factor,
                           e_score_correction_bias=e_score_correction_bias,
                           custom_routing_function=custom_routing_function, input_ids=input_ids,
                           hash_indices_table=hash_indices_table, check_finite=check_finite, semantics=v)
    elif kind == "FusedTopKRouter":
        w, ids = fused_topk(hidden_states, router_logits, top_k, renormalize, scoring_func=scoring_func,
                            indices_type=indices_type, check_finite=check_finite, is_padding=is_padding, semantics=v)
    elif kind == "FusedTopKBiasRouter":
        w, ids = fused_topk_bias(hidden_states, router_logits, e_score_correction_bias, top_k, renormalize,
                                 scoring_func=scoring_func, routed_scaling_factor=routed_scaling_factor,
                                 indices_type=indices_type, check_finite=check_finite, input_tokens=input_ids,
                                 hash_indices_table=hash_indices_table, bias_vl=bias_vl,
                                 image_sentinel_lo=image_sentinel_lo, is_padding=is_padding, semantics=v)
        if v >= V033:
            w, ids = append_fused_shared_experts(w, ids, router_logits.shape[-1], num_fused_shared_experts,
                                                 shared_expert_weight, semantics=v)
    elif kind == "GroupedTopKRouter":
        w, ids = grouped_topk_router(hidden_states, router_logits, top_k, num_expert_group, topk_group,
                                     renormalize=renormalize, scoring_func=scoring_func,
                                     routed_scaling_factor=routed_scaling_factor,
                                     e_score_correction_bias=e_score_correction_bias, indices_type=indices_type,
                                     is_padding=is_padding if v >= V033 else None, skip_padding=skip_padding,
                                     check_finite=check_finite, semantics=v)
    elif kind == "CustomRoutingRouter":
        if check_finite is not False:
            check_router_logits(router_logits)
        w, ids = custom_routing_function(hidden_states, router_logits, top_k, renormalize)
        w, ids = w.float(), ids.to(indices_type or torch.int32)
    else:
        raise ValueError(f"router {kind} is not specified by the reference")
    if capture_fn is not None:
        capture_fn(ids)  # logical ids, before the EPLB mapping (base_router.py)
    if eplb is not None:
        ids = eplb_logical_to_physical(ids, eplb[0], eplb[1], semantics=v)
    return w, ids.to(indices_type or ids.dtype)
