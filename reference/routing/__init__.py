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
    and weights finite; sqrtsoftplus clamps NaN only (+inf is chosen first and, renormalized, weighs NaN).
    ``grouped_topk`` follows the fused single-group kernels' rule where they run (point
    ``routing.grouped_topk_nonfinite``: invalid expert weight 0, ranked last) and raises elsewhere;
    ``topk_softmax`` and ``llama4_routing`` have no clamp upstream and keep the 0.17 rule. ``check_finite=True``
    raises under either version.
- New in 0.33: sqrtsoftplus scoring, hash routing and the image-token
  bias in ``fused_topk_bias``, padding rows (``is_padding``: id -1, weight 0), fused shared-expert slots, Gemma4's
  per-expert scale, MiniMax2's epsilon renormalization, EPLB logical -> physical ids, the router factory and
  ``RoutingMethodType`` per version. ``python -m reference.semantics`` lists every point.

The package, by component (every name is re-exported here):

- ``reference.routing.common``: ``RoutingMethodType``, ``check_router_logits``, scores and the non-finite rule,
  ``apply_padding_rows``;
- ``reference.routing.topk``: ``fused_topk``, ``fused_topk_bias``, ``topk_softmax``, ``image_token_mask``,
  ``hash_topk_ids``;
- ``reference.routing.grouped``: ``valid_grouping``, ``grouped_topk``, ``grouped_topk_router``,
  ``single_group_kernel_applies``;
- ``reference.routing.custom``: ``llama4_routing``, ``gemma4_routing``, ``minimax2_routing``,
  ``token_choice_with_bias`` (Cohere2-MoE), ``musespark1x_routing`` (MuseSpark1x);
- ``reference.routing.router``: ``select_experts``, ``router_kind``, ``route``, ``append_fused_shared_experts``, the
  enum per version (``RoutingMethodType017``, ``routing_method_type_value`` / ``_enum``, ``get_routing_method_type``,
  ``custom_routing_method_type``);
- ``reference.routing.cpu``: ``CPURouter``'s dispatch (``cpu_router_path``) and routing (``cpu_route``);
- ``reference.routing.zero``: ``ZeroExpertRouter`` (``zero_expert_router``, ``zero_expert_identity_output``);
- ``reference.routing.eplb``: ``eplb_logical_to_physical``;
- ``reference.routing.expert_map``: ``determine_expert_map``;
- ``reference.routing.points``: the semantics points of routing.
"""

from reference.routing import points as _points  # noqa: F401  (registers the routing semantics points)
from reference.routing.common import RoutingMethodType, apply_padding_rows, check_router_logits
from reference.routing.cpu import CPU_ROUTER_PATHS, cpu_route, cpu_router_path
from reference.routing.custom import (
    MINIMAX2_EPSILON,
    MUSESPARK_DIVISION_EPS,
    gemma4_routing,
    llama4_routing,
    minimax2_routing,
    musespark1x_routing,
    token_choice_with_bias,
)
from reference.routing.eplb import EPLB_KNUTH_MULTIPLIER, eplb_logical_to_physical
from reference.routing.expert_map import determine_expert_map
from reference.routing.grouped import (
    SINGLE_GROUP_TIERS,
    grouped_topk,
    grouped_topk_router,
    single_group_kernel_applies,
    valid_grouping,
)
from reference.routing.capture import RoutedExpertsSink
from reference.routing.router import (
    RoutingMethodType017,
    append_fused_shared_experts,
    custom_routing_method_type,
    get_routing_method_type,
    route,
    router_kind,
    routing_method_type_enum,
    routing_method_type_value,
    select_experts,
)
from reference.routing.topk import (
    IMAGE_SENTINEL_COUNT,
    fused_topk,
    fused_topk_bias,
    hash_topk_ids,
    image_token_mask,
    topk_softmax,
)
from reference.routing.zero import ZERO_EXPERT_BLOCK, zero_expert_identity_output, zero_expert_router

__all__ = [
    "RoutedExpertsSink",
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
    "SINGLE_GROUP_TIERS",
    "single_group_kernel_applies",
    "route",
    "custom_routing_method_type",
    "CPU_ROUTER_PATHS",
    "cpu_router_path",
    "cpu_route",
    "token_choice_with_bias",
    "musespark1x_routing",
    "MUSESPARK_DIVISION_EPS",
    "ZERO_EXPERT_BLOCK",
    "zero_expert_router",
    "zero_expert_identity_output",
]
