"""Routing of vLLM 0.33 that the seed-era reference did not have, and the routing points that differ by release.

Read from vLLM's source distributions on PyPI: ``vllm-0.33.0.tar.gz`` (sha256 f4c33c25...4c74112) for the 0.33
semantics and ``vllm-0.17.0.tar.gz`` (sha256 b0b62e58...1c5d629a) for the 0.17 semantics; ``fused_moe/`` below is
``vllm/model_executor/layers/fused_moe/``. Re-exported by ``reference.routing``.

What is here (each function names its upstream file; ``reference.semantics`` registers the points):

- ``image_token_mask``, ``hash_topk_ids``: DeepSeek-V4's image-token bias and hash routing (used by
  ``reference.routing.fused_topk_bias`` with ``scoring_func="sqrtsoftplus"``).
- ``apply_padding_rows``: padding rows (``is_padding``, ``VLLM_MOE_SKIP_PADDING``) -> id -1, weight 0.
- ``append_fused_shared_experts``: fused shared-expert slots ``[E, E + n)`` after the routed top-k.
- ``gemma4_routing``: Gemma4's softmax -> top-k -> renormalize -> per-expert scale.
- ``minimax2_routing``: ``RoutingMethodType.MiniMax2``'s scaled sum-normalization with epsilon 1e-20.
- ``eplb_logical_to_physical``: EPLB logical -> physical replica ids and the load count, per version.
- ``RoutingMethodType017``, ``routing_method_type_value``, ``get_routing_method_type``: the enum per version.
- ``router_kind``: ``create_fused_moe_router``'s dispatch per version; ``grouped_topk_router``: GroupedTopKRouter
  with the invalid-grouping fallback per version; ``route``: the router end to end (kind -> routing -> padding ->
  shared slots -> EPLB).

Shapes: M tokens, E routed experts, k = topk. Weights fp32, ids int32 unless ``indices_type`` says otherwise.
Ties: lower expert index first everywhere (the kernels' argmax rule).
"""

from __future__ import annotations

import enum
from typing import Callable

import torch

from reference.routing import (
    RoutingMethodType,
    _finish,
    _topk_ids,
    check_router_logits,
    fused_topk,
    fused_topk_bias,
    grouped_topk,
    valid_grouping,
)
from reference.semantics import SemanticsVersion, SemanticsError, register_point, require, resolve_semantics

__all__ = [
    "IMAGE_SENTINEL_COUNT",
    "MINIMAX2_EPSILON",
    "EPLB_KNUTH_MULTIPLIER",
    "image_token_mask",
    "hash_topk_ids",
    "apply_padding_rows",
    "append_fused_shared_experts",
    "gemma4_routing",
    "minimax2_routing",
    "eplb_logical_to_physical",
    "RoutingMethodType017",
    "routing_method_type_value",
    "routing_method_type_enum",
    "get_routing_method_type",
    "router_kind",
    "grouped_topk_router",
    "route",
]

V017, V033 = SemanticsVersion.V0_17, SemanticsVersion.V0_33
_UP = "fused_moe/router/"

IMAGE_SENTINEL_COUNT = 5  # "five consecutive in-vocab sentinel ids starting at image_sentinel_lo"
MINIMAX2_EPSILON = 1e-20  # RoutingMethodType.MiniMax2 comment, fused_moe/config.py (0.33.0)
EPLB_KNUTH_MULTIPLIER = 2654435769  # floor(2^32 / phi), base_router.py (0.33.0)


# --------------------------------------------------------------------------------------------------------------
# DeepSeek-V4: image tokens, hash routing


def image_token_mask(input_ids: torch.Tensor | None, image_sentinel_lo: int, num_tokens: int | None = None
                     ) -> torch.Tensor:
    """``(M,)`` bool: which tokens are image tokens, i.e. ``image_sentinel_lo <= id < image_sentinel_lo + 5``.

    Ids above the block are ordinary special tokens and do not match. ``image_sentinel_lo <= 0`` disables it (all
    False). Mirrors ``fused_moe/router/fused_topk_bias_router.py::fused_topk_bias`` and the ``HAS_VL`` branch of
    ``router/dsv4_topk.py`` (vLLM 0.33.0).

    Raises:
        ValueError: ``input_ids`` missing ("bias_vl routing requires input_ids") or not ``(M,)`` integer.
    """
    if input_ids is None:
        raise ValueError("bias_vl routing requires input_ids (the token ids of the M rows)")
    if input_ids.dim() != 1 or input_ids.is_floating_point() or (num_tokens is not None and
                                                                 input_ids.shape[0] != num_tokens):
        raise ValueError(f"input_ids must be 1-D integer with {num_tokens} rows, got {input_ids.dtype} "
                         f"{tuple(input_ids.shape)}")
    ids = input_ids.long()
    if image_sentinel_lo <= 0:
        return torch.zeros_like(ids, dtype=torch.bool)
    return (ids >= image_sentinel_lo) & (ids < image_sentinel_lo + IMAGE_SENTINEL_COUNT)


def hash_topk_ids(input_ids: torch.Tensor | None, hash_indices_table: torch.Tensor, topk: int, num_experts: int,
                  *, skip: torch.Tensor | None = None, semantics=None) -> torch.Tensor:
    """DeepSeek-V4 hash routing: ``hash_indices_table[input_ids]``, a lookup (``(M, topk)``, the table's dtype).

    Args:
        input_ids: ``(M,)`` token ids (any integer dtype; vLLM casts them to the table's dtype).
        hash_indices_table: ``(vocab, topk)`` integer expert ids (``tid2eid``), each in ``[0, E)``.
        skip: ``(M,)`` bool rows whose id is not looked up (image or padding rows; they read row 0, as vLLM's
            ``safe_ids``, and the caller overwrites them).

    Raises:
        ValueError: missing ``input_ids``, table width != topk, a token id outside ``[0, vocab)`` or a table entry
            outside ``[0, E)`` on a looked-up row. SemanticsError under 0.17.

    Mirrors ``fused_topk_bias`` (``topk_indices = hash_indices_table[input_tokens]``) and the ``USE_HASH`` path of
    ``csrc/moe/topk_softplus_sqrt_kernels.cu`` (``tid2eid[token_id * k + k_idx]``), vLLM 0.33.0.
    """
    require("hash routing (hash_indices_table)", "0.33", semantics, upstream=_UP + "fused_topk_bias_router.py")
    if input_ids is None:
        raise ValueError("hash routing needs input_ids")
    if hash_indices_table.dim() != 2 or hash_indices_table.is_floating_point():
        raise ValueError(f"hash_indices_table must be (vocab, topk) integer, got {hash_indices_table.dtype} "
                         f"{tuple(hash_indices_table.shape)}")
    if hash_indices_table.shape[1] != topk:
        raise ValueError(f"hash_indices_table has {hash_indices_table.shape[1]} experts per token, topk is {topk}")
    tok = input_ids.long()
    if skip is not None:
        tok = torch.where(skip.to(torch.bool), torch.zeros_like(tok), tok)
    vocab = hash_indices_table.shape[0]
    if tok.numel() and (int(tok.min()) < 0 or int(tok.max()) >= vocab):
        bad = int(((tok < 0) | (tok >= vocab)).nonzero()[0])
        raise ValueError(f"token {bad} has id {int(tok[bad])} outside the hash table's vocabulary [0, {vocab})")
    ids = hash_indices_table[tok]
    looked = ids if skip is None else ids[~skip.to(torch.bool)]
    if looked.numel() and (int(looked.min()) < 0 or int(looked.max()) >= num_experts):
        raise ValueError(f"hash_indices_table holds expert ids outside [0, {num_experts})")
    return ids


# --------------------------------------------------------------------------------------------------------------
# Padding rows, fused shared experts


def apply_padding_rows(topk_weights: torch.Tensor, topk_ids: torch.Tensor, is_padding: torch.Tensor | None, *,
                       semantics=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Padding rows (``is_padding[t]`` True) get id -1 in every slot and weight 0; other rows are unchanged.

    ``is_padding`` is ``(M,)`` bool (vLLM's forward-context ``is_padding``, used when ``VLLM_MOE_SKIP_PADDING`` is
    set, its default "1"). The ids must be a signed dtype (``-1`` sentinel). Mirrors vLLM 0.33.0:
    ``csrc/moe/topk_softmax_kernels.cu`` (``indices[idx] = is_pad_row ? -1 : ...``),
    ``csrc/moe/topk_softplus_sqrt_kernels.cu`` (-1 and a zero row), ``router/dsv4_topk.py`` (-1, 0.0) and
    ``router/grouped_topk_router.py`` (``masked_fill(is_padding, 0)`` / ``-1`` when ``skip_padding``).

    Upstream, the ``topk_softmax`` / ``topk_sigmoid`` kernels write -1 ids but leave the weight they computed for
    the padding row; the reference's weight 0 is what the other three write, and a kernel's weight on a -1 slot is
    never used (conformance compares only the ids of padding rows).

    Raises:
        ValueError: wrong shape or dtype. SemanticsError under 0.17 (vLLM 0.17.0 has no padding rows).
    """
    require("padding rows (is_padding)", "0.33", semantics, upstream=_UP + "fused_topk_router.py")
    if is_padding is None:
        return topk_weights, topk_ids
    if is_padding.dtype != torch.bool or is_padding.shape != (topk_ids.shape[0],):
        raise ValueError(f"is_padding must be bool of shape ({topk_ids.shape[0]},), got {is_padding.dtype} "
                         f"{tuple(is_padding.shape)}")
    if not topk_ids.dtype.is_signed:
        raise ValueError(f"padding rows need a signed ids dtype for the -1 sentinel, got {topk_ids.dtype}")
    pad = is_padding.unsqueeze(1)
    return topk_weights.masked_fill(pad, 0.0), topk_ids.masked_fill(pad, -1)


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


# --------------------------------------------------------------------------------------------------------------
# Model-specific routing functions


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


# --------------------------------------------------------------------------------------------------------------
# EPLB


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


# --------------------------------------------------------------------------------------------------------------
# RoutingMethodType per version, the factory, the invalid-grouping fallback


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

    0.33.0, in order: ``ZeroExpertRouter`` (zero_expert_type set); ``CPURouter`` (on CPU); ``GroupedTopKRouter``
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
    if use_grouped_topk:
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
                          check_finite=check_finite)
    if skip_padding and is_padding is not None:
        w, ids = apply_padding_rows(w, ids, is_padding, semantics=v)
    return w, ids


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
    semantics=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router end to end, as ``create_fused_moe_router(...)`` + ``select_experts`` run it (on CUDA).

    1. ``router_kind`` picks the router (platform CUDA, no zero experts, no AITER, no simulation);
    2. that router's routing: ``fused_topk`` (``FusedTopKRouter``, padding rows masked), ``fused_topk_bias`` +
       ``append_fused_shared_experts`` (``FusedTopKBiasRouter``), ``grouped_topk_router`` (``GroupedTopKRouter``),
       or ``custom_routing_function(hidden_states, gating_output, topk, renormalize)`` (weights fp32, ids int32);
    3. EPLB (``eplb=(logical_to_physical_map, logical_replica_count)``): ``eplb_logical_to_physical``;
    4. ids to ``indices_type``.
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
                       num_fused_shared_experts=num_fused_shared_experts if v >= V033 else 0, semantics=v)
    if v < V033 and (num_fused_shared_experts or is_padding is not None or hash_indices_table is not None
                     or bias_vl is not None):
        raise SemanticsError("shared-expert slots / padding rows / hash routing / image bias are 0.33 features")
    if kind == "FusedTopKRouter":
        w, ids = fused_topk(hidden_states, router_logits, top_k, renormalize, scoring_func=scoring_func,
                            indices_type=indices_type, check_finite=check_finite, is_padding=is_padding, semantics=v)
    elif kind == "FusedTopKBiasRouter":
        w, ids = fused_topk_bias(hidden_states, router_logits, e_score_correction_bias, top_k, renormalize,
                                 scoring_func=scoring_func, routed_scaling_factor=routed_scaling_factor,
                                 indices_type=indices_type, check_finite=check_finite, input_ids=input_ids,
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
    if eplb is not None:
        ids = eplb_logical_to_physical(ids, eplb[0], eplb[1], semantics=v)
    return w, ids.to(indices_type or ids.dtype)


# --------------------------------------------------------------------------------------------------------------
# The points (reference.semantics)

_F017 = "vLLM 0.17.0 "
_F033 = "vLLM 0.33.0 "
register_point(
    "routing.nonfinite_logits", component="routing", reference="reference.routing.fused_topk / fused_topk_bias",
    behaviour={
        V017: "fused_topk / fused_topk_bias raise ValueError on NaN/inf logits by default; check_finite=False: ids in "
              "[0, E) (NaN ranked lowest), weights unspecified.",
        V033: "fused_topk / fused_topk_bias clamp: a NaN/+-inf softmax or sigmoid score becomes 0 before selection "
              "(unique ids, lower index first, finite weights, zero-sum renormalization divides by 1); no raise "
              "unless check_finite=True. sqrtsoftplus clamps NaN only (+inf raises). grouped_topk, topk_softmax, "
              "llama4_routing: unchanged (raise).",
    },
    upstream={V017: _F017 + "csrc/moe/topk_softmax_kernels.cu (no clamp)",
              V033: _F033 + "csrc/moe/topk_softmax_kernels.cu ('Clamp NaN/Inf to 0'), "
                            "csrc/moe/topk_softplus_sqrt_kernels.cu, tests/kernels/moe/test_fused_topk.py"},
)
register_point(
    "routing.sqrtsoftplus", component="routing", reference="reference.routing.fused_topk_bias(scoring_func=...)",
    behaviour={V017: "not defined (SemanticsError).",
               V033: "score = sqrt(softplus(x)) fp32 (x > 20 -> x); biased choice, unbiased weights, renormalize, "
                     "scale; DeepseekV4 routing method."},
    upstream={V017: _F017 + "fused_moe/router/fused_topk_bias_router.py (softmax|sigmoid only)",
              V033: _F033 + "fused_moe/router/fused_topk_bias_router.py, router/dsv4_topk.py, "
                            "csrc/moe/topk_softplus_sqrt_kernels.cu, tests/kernels/moe/test_topk_softplus_sqrt.py"},
)
register_point(
    "routing.hash_routing", component="routing", reference="reference.routing_033.hash_topk_ids",
    behaviour={V017: "not defined (SemanticsError).",
               V033: "ids = hash_indices_table[input_ids] (a lookup, sqrtsoftplus only); weights = unbiased scores "
                     "of those ids, renormalized, scaled."},
    upstream={V017: _F017 + "(absent)",
              V033: _F033 + "fused_moe/router/fused_topk_bias_router.py, csrc/moe/topk_softplus_sqrt_kernels.cu"},
)
register_point(
    "routing.image_token_bias", component="routing", reference="reference.routing_033.image_token_mask",
    behaviour={V017: "not defined (SemanticsError).",
               V033: "tokens with id in [image_sentinel_lo, +5) choose by score + bias_vl (instead of the correction "
                     "bias or the hash lookup); image_sentinel_lo == 0 disables it."},
    upstream={V017: _F017 + "(absent)",
              V033: _F033 + "fused_moe/router/fused_topk_bias_router.py, router/dsv4_topk.py"},
)
register_point(
    "routing.padding_rows", component="routing", reference="reference.routing_033.apply_padding_rows",
    behaviour={V017: "no padding mask (SemanticsError for is_padding).",
               V033: "is_padding rows (VLLM_MOE_SKIP_PADDING, default on) get id -1, weight 0 (topk_softmax/sigmoid "
                     "kernels leave the weight; GroupedTopKRouter only with skip_padding)."},
    upstream={V017: _F017 + "(absent)",
              V033: _F033 + "fused_moe/router/fused_topk_router.py, grouped_topk_router.py, dsv4_topk.py, "
                            "csrc/moe/topk_softmax_kernels.cu, vllm/envs.py"},
)
register_point(
    "routing.fused_shared_expert_slots", component="routing",
    reference="reference.routing_033.append_fused_shared_experts",
    behaviour={V017: "not defined (SemanticsError); select_experts rejects num_fused_shared_experts.",
               V033: "FusedTopKBiasRouter appends ids [E, E+n) with shared_expert_weight after the routed top-k is "
                     "renormalized and scaled (padding rows too)."},
    upstream={V017: _F017 + "fused_moe/router/fused_topk_bias_router.py (no shared slots)",
              V033: _F033 + "fused_moe/router/fused_topk_bias_router.py"},
)
register_point(
    "routing.gemma4_per_expert_scale", component="routing", reference="reference.routing_033.gemma4_routing",
    behaviour={V017: "not defined (no Gemma4; SemanticsError).",
               V033: "top-k of logits, softmax renormalized over the k (fp32), times per_expert_scale[id]."},
    upstream={V017: _F017 + "(no vllm/model_executor/models/gemma4.py)",
              V033: _F033 + "vllm/model_executor/models/gemma4.py, tests/kernels/moe/test_gemma4router.py"},
)
register_point(
    "routing.minimax2_epsilon", component="routing", reference="reference.routing_033.minimax2_routing",
    behaviour={V017: "not defined (no MiniMax2 routing method; SemanticsError).",
               V033: "sigmoid + bias -> top-k -> w = s * rsf / (sum + 1e-20)."},
    upstream={V017: _F017 + "fused_moe/config.py (no MiniMax2)",
              V033: _F033 + "fused_moe/config.py (RoutingMethodType.MiniMax2 comment); kernel in FlashInfer, not read"},
)
register_point(
    "routing.eplb_replica_choice", component="routing", reference="reference.routing_033.eplb_logical_to_physical",
    behaviour={V017: "replica = flat slot position % replica count; every slot counted; ids must be valid.",
               V033: "replica = ((token * 2654435769) mod 2^32) mod max(count, 1); invalid ids -> -1; counted unless "
                     "recording off / padded token / physical id out of range."},
    upstream={V017: _F017 + "fused_moe/router/base_router.py (eplb_map_to_physical_and_record)",
              V033: _F033 + "fused_moe/router/base_router.py (_eplb_map_and_record_i32_kernel)"},
)
register_point(
    "routing.routing_method_type_values", component="routing",
    reference="reference.routing_033.routing_method_type_value / get_routing_method_type",
    behaviour={V017: "Default..TopK 0..5, Custom 6, Simulated 7, Unspecified 8; softmax+renormalize -> Renormalize, "
                     "sigmoid top-1 -> Llama4.",
               V033: "Default..TopK 0..5, SigmoidRenorm 6, MiniMax2 7, Sigmoid 8, Unspecified 9, DeepseekV4 100, "
                     "Custom 101, Simulated 102; softmax+renormalize -> RenormalizeNaive."},
    upstream={V017: _F017 + "fused_moe/config.py", V033: _F033 + "fused_moe/config.py"},
    notes="the seed-era reference had SigmoidRenorm 6, MiniMax2 7, Sigmoid 8, Custom 9, Unspecified 10, which "
          "matches none of 0.17.0, 0.20.0-0.25.0, 0.30.0, 0.33.0 (read).",
)
register_point(
    "routing.router_factory", component="routing", reference="reference.routing_033.router_kind",
    behaviour={V017: "simulator first; grouped unless (Unspecified and G <= 1 and topk_group <= 1); custom; bias; "
                     "plain.",
               V033: "zero-expert; CPU; grouped unless degenerate and scaling handled and routing method preserved; "
                     "custom; bias or hash; AITER shared; plain; simulator replaces the choice."},
    upstream={V017: _F017 + "fused_moe/router/router_factory.py", V033: _F033 + "fused_moe/router/router_factory.py"},
)
register_point(
    "routing.invalid_grouping_fallback", component="routing", reference="reference.routing_033.grouped_topk_router",
    behaviour={V017: "no bias: fused_topk softmax, no routed_scaling_factor; bias: fused_topk_bias with softmax "
                     "(layer's scoring_func dropped), then * routed_scaling_factor.",
               V033: "no bias: same; bias: fused_topk_bias with the layer's scoring_func, then * "
                     "routed_scaling_factor."},
    upstream={V017: _F017 + "fused_moe/router/grouped_topk_router.py",
              V033: _F033 + "fused_moe/router/grouped_topk_router.py"},
    notes="reference.routing.select_experts keeps its own fallback (fused_topk with the layer's scoring_func), "
          "which is neither release's; route() / grouped_topk_router() follow the releases.",
)
