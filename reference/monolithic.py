"""The monolithic path of seed 002: experts that route themselves (router logits in, output out).

Mirrors ``FusedMoEExpertsMonolithic`` / ``FusedMoEPrepareAndFinalizeMonolithic`` / ``FusedMoEKernelMonolithicImpl``
(``fused_moe/modular_kernel.py``): kernels such as FlashInfer TRT-LLM fuse routing, both GEMMs and the reduction.
``ReferenceMonolithicExperts`` defines what such a kernel must compute: ``reference.routing.select_experts`` with
the layer's routing parameters, then ``reference.experts.fused_experts``.
"""

from __future__ import annotations

import torch

from reference.activation import MoEActivation
from reference.experts import fused_experts, reference_support
from reference.modular import (
    FusedMoEActivationFormat,
    FusedMoEExpertsMonolithic,
    FusedMoEPrepareAndFinalizeMonolithic,
    NoDispatch,
)
from reference.moe_output import route_major_moe_output
from reference.routing import RoutingMethodType, select_experts

__all__ = ["ReferenceMonolithicExperts", "MoEPrepareAndFinalizeNoEPMonolithic"]


class MoEPrepareAndFinalizeNoEPMonolithic(NoDispatch, FusedMoEPrepareAndFinalizeMonolithic):
    """No dispatch; input quantization is left to the experts (they see router logits and the bf16 input).
    0.33 (``prepare_finalize/no_dp_ep.py`` ``MoEPrepareAndFinalizeNoDPEPMonolithic``): supports deferred finalize
    (finalize is the identity, so a consumer that reduces the unfinalized output loses nothing)."""

    def supports_deferred_moe_finalize(self) -> bool:
        return True

    def prepare(self, a1, router_logits, quant_config, defer_input_quant=False):
        return a1, None, router_logits

    def finalize(self, fused_expert_output: torch.Tensor) -> torch.Tensor:
        return fused_expert_output


class ReferenceMonolithicExperts(FusedMoEExpertsMonolithic):
    """Routing + experts in one call. Routing settings come from the constructor (top_k, renormalize, scoring)
    and from ``apply``'s grouped-topk arguments, exactly as a fused router+experts kernel receives them.

    Args (beyond the seed's): top_k, renormalize, scoring_func ("softmax" | "sigmoid"), use_grouped_topk;
    ``defer_finalize`` (0.33): return the route-major ``UnfinalizedMoEOutput`` (``route_major_moe_output`` of the
    unweighted per-route GEMM2 rows) instead of the reduced output.

    0.33: ``supports_routing_replay_capture`` (``apply(routing_replay_out=...)`` receives the routed logical ids as
    int16, the FlashInfer ``routing_replay_out`` contract) and ``_supports_hash_routing`` is False (a layer with a
    hash table selects no reference monolithic experts, ``is_supported_config``).
    """

    def __init__(self, moe_config, quant_config, *, top_k: int, renormalize: bool = True,
                 scoring_func: str = "softmax", use_grouped_topk: bool = False, defer_finalize: bool = False):
        super().__init__(moe_config, quant_config)
        self.top_k, self.renormalize = top_k, renormalize
        self.scoring_func, self.use_grouped_topk = scoring_func, use_grouped_topk
        self.defer_finalize = defer_finalize

    def supports_routing_replay_capture(self) -> bool:
        return True

    support = reference_support(FusedMoEActivationFormat.Standard, chunking=False, finalize="(M, K) reduced")

    @staticmethod
    def activation_format():
        return FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_routing_method(routing_method, weight_key, activation_key) -> bool:
        return routing_method in (RoutingMethodType.Default, RoutingMethodType.DeepSeekV3,
                                  RoutingMethodType.Renormalize, RoutingMethodType.Sigmoid)

    @staticmethod
    def _supports_router_logits_dtype(router_logits_dtype, routing_method) -> bool:
        return router_logits_dtype in (None, torch.float32, torch.bfloat16)

    def apply(self, hidden_states, w1, w2, router_logits, activation, global_num_experts, expert_map, a1q_scale,
              apply_router_weight_on_input, num_expert_group=None, e_score_correction_bias=None,
              routed_scaling_factor=None, topk_group=None, routing_replay_out=None, **hash_kwargs):
        if hash_kwargs:
            raise ValueError("ReferenceMonolithicExperts does not implement hash routing (_supports_hash_routing)")
        w, ids, _ = select_experts(
            hidden_states, router_logits, self.top_k, self.use_grouped_topk, self.renormalize,
            topk_group=topk_group, num_expert_group=num_expert_group, scoring_func=self.scoring_func,
            routed_scaling_factor=1.0 if routed_scaling_factor is None else routed_scaling_factor,
            e_score_correction_bias=e_score_correction_bias,
            # A monolithic kernel is handed the factor itself (not through FusedTopKRouter): kept as it was, scaled
            # also for plain top-k (not checked against vLLM's monolithic kernels; see select_experts).
            scale_plain_topk=True,
        )
        if routing_replay_out is not None:
            routing_replay_out.copy_(ids.to(routing_replay_out.dtype))
        if self.defer_finalize:
            # One unweighted GEMM2 row per route (top-1 calls with weight 1), left for the consumer to reduce.
            routes = torch.stack([
                fused_experts(hidden_states, w1, w2, torch.ones_like(w[:, j:j + 1]), ids[:, j:j + 1],
                              activation=activation, global_num_experts=global_num_experts, expert_map=expert_map,
                              quant_config=self.quant_config) for j in range(ids.size(1))], dim=1)
            return route_major_moe_output(routes, w, ids, expert_map)
        return fused_experts(hidden_states, w1, w2, w, ids, activation=activation,
                             global_num_experts=global_num_experts, expert_map=expert_map,
                             apply_router_weight_on_input=apply_router_weight_on_input,
                             quant_config=self.quant_config)
