"""The routing points where vLLM releases differ (``reference.semantics``; ``python -m reference.semantics routing``)."""

from __future__ import annotations

from reference.routing.common import V017, V033
from reference.semantics import register_point

_F017 = "vLLM 0.17.0 "
_F033 = "vLLM 0.33.0 "
register_point(
    "routing.nonfinite_logits", component="routing", reference="reference.routing.fused_topk / fused_topk_bias",
    behaviour={
        V017: "fused_topk / fused_topk_bias raise ValueError on NaN/inf logits by default; check_finite=False: ids in "
              "[0, E) (NaN ranked lowest), weights unspecified.",
        V033: "fused_topk / fused_topk_bias clamp: a NaN/+-inf softmax or sigmoid score becomes 0 before selection "
              "(unique ids, lower index first, finite weights, zero-sum renormalization divides by 1); no raise "
              "unless check_finite=True. sqrtsoftplus clamps NaN only: -inf scores 0, +inf scores +inf (selected first; renormalized: "
              "its weight NaN, the others 0). grouped_topk: point routing.grouped_topk_nonfinite; topk_softmax, "
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
    "routing.hash_routing", component="routing", reference="reference.routing.hash_topk_ids",
    behaviour={V017: "not defined (SemanticsError).",
               V033: "ids = hash_indices_table[input_tokens] (a lookup, sqrtsoftplus only); weights = unbiased scores "
                     "of those ids, renormalized, scaled."},
    upstream={V017: _F017 + "(absent)",
              V033: _F033 + "fused_moe/router/fused_topk_bias_router.py, csrc/moe/topk_softplus_sqrt_kernels.cu"},
)
register_point(
    "routing.image_token_bias", component="routing", reference="reference.routing.image_token_mask",
    behaviour={V017: "not defined (SemanticsError).",
               V033: "tokens with id in [image_sentinel_lo, +5) choose by score + bias_vl (instead of the correction "
                     "bias or the hash lookup); image_sentinel_lo == 0 disables it."},
    upstream={V017: _F017 + "(absent)",
              V033: _F033 + "fused_moe/router/fused_topk_bias_router.py, router/dsv4_topk.py"},
)
register_point(
    "routing.padding_rows", component="routing", reference="reference.routing.apply_padding_rows",
    behaviour={V017: "no padding mask (SemanticsError for is_padding).",
               V033: "is_padding rows (VLLM_MOE_SKIP_PADDING, default on) get id -1, weight 0 (topk_softmax/sigmoid "
                     "kernels leave the weight; GroupedTopKRouter only with skip_padding)."},
    upstream={V017: _F017 + "(absent)",
              V033: _F033 + "fused_moe/router/fused_topk_router.py, grouped_topk_router.py, dsv4_topk.py, "
                            "csrc/moe/topk_softmax_kernels.cu, vllm/envs.py"},
)
register_point(
    "routing.fused_shared_expert_slots", component="routing",
    reference="reference.routing.append_fused_shared_experts",
    behaviour={V017: "not defined (SemanticsError); select_experts rejects num_fused_shared_experts.",
               V033: "FusedTopKBiasRouter appends ids [E, E+n) with shared_expert_weight after the routed top-k is "
                     "renormalized and scaled (padding rows too)."},
    upstream={V017: _F017 + "fused_moe/router/fused_topk_bias_router.py (no shared slots)",
              V033: _F033 + "fused_moe/router/fused_topk_bias_router.py"},
)
register_point(
    "routing.gemma4_per_expert_scale", component="routing", reference="reference.routing.gemma4_routing",
    behaviour={V017: "not defined (no Gemma4; SemanticsError).",
               V033: "top-k of logits, softmax renormalized over the k (fp32), times per_expert_scale[id]."},
    upstream={V017: _F017 + "(no vllm/model_executor/models/gemma4.py)",
              V033: _F033 + "vllm/model_executor/models/gemma4.py, tests/kernels/moe/test_gemma4router.py"},
)
register_point(
    "routing.minimax2_epsilon", component="routing", reference="reference.routing.minimax2_routing",
    behaviour={V017: "not defined (no MiniMax2 routing method; SemanticsError).",
               V033: "sigmoid + bias -> top-k -> w = s * rsf / (sum + 1e-20)."},
    upstream={V017: _F017 + "fused_moe/config.py (no MiniMax2)",
              V033: _F033 + "fused_moe/config.py (RoutingMethodType.MiniMax2 comment); kernel in FlashInfer, not read"},
)
register_point(
    "routing.eplb_replica_choice", component="routing", reference="reference.routing.eplb_logical_to_physical",
    behaviour={V017: "replica = flat slot position % replica count; every slot counted; ids must be valid.",
               V033: "replica = ((token * 2654435769) mod 2^32) mod max(count, 1); invalid ids -> -1; counted unless "
                     "recording off / padded token / physical id out of range."},
    upstream={V017: _F017 + "fused_moe/router/base_router.py (eplb_map_to_physical_and_record)",
              V033: _F033 + "fused_moe/router/base_router.py (_eplb_map_and_record_i32_kernel)"},
)
register_point(
    "routing.routing_method_type_values", component="routing",
    reference="reference.routing.routing_method_type_value / get_routing_method_type",
    behaviour={V017: "Default..TopK 0..5, Custom 6, Simulated 7, Unspecified 8; softmax+renormalize -> Renormalize, "
                     "sigmoid top-1 -> Llama4.",
               V033: "Default..TopK 0..5, SigmoidRenorm 6, MiniMax2 7, Sigmoid 8, Unspecified 9, DeepseekV4 100, "
                     "Custom 101, Simulated 102; softmax+renormalize -> RenormalizeNaive."},
    upstream={V017: _F017 + "fused_moe/config.py", V033: _F033 + "fused_moe/config.py"},
    notes="the seed-era reference had SigmoidRenorm 6, MiniMax2 7, Sigmoid 8, Custom 9, Unspecified 10, which "
          "matches none of 0.17.0, 0.20.0-0.25.0, 0.30.0, 0.33.0 (read).",
)
register_point(
    "routing.router_factory", component="routing", reference="reference.routing.router_kind",
    behaviour={V017: "simulator first; grouped unless (Unspecified and G <= 1 and topk_group <= 1); custom; bias; "
                     "plain.",
               V033: "zero-expert; CPU; grouped unless degenerate and scaling handled and routing method preserved; "
                     "custom; bias or hash; AITER shared; plain; simulator replaces the choice."},
    upstream={V017: _F017 + "fused_moe/router/router_factory.py", V033: _F033 + "fused_moe/router/router_factory.py"},
)
register_point(
    "routing.invalid_grouping_fallback", component="routing", reference="reference.routing.grouped_topk_router",
    behaviour={V017: "no bias: fused_topk softmax, no routed_scaling_factor; bias: fused_topk_bias with softmax "
                     "(layer's scoring_func dropped), then * routed_scaling_factor.",
               V033: "no bias: same; bias: fused_topk_bias with the layer's scoring_func, then * "
                     "routed_scaling_factor."},
    upstream={V017: _F017 + "fused_moe/router/grouped_topk_router.py",
              V033: _F033 + "fused_moe/router/grouped_topk_router.py"},
    notes="reference.routing.select_experts (seed 003's wrapper) runs grouped_topk_router, so it follows the "
          "releases too (before issue 41 it kept its own fallback, fused_topk with the layer's scoring_func).",
)
register_point(
    "routing.grouped_topk_nonfinite", component="routing",
    reference="reference.routing.grouped_topk / single_group_kernel_applies",
    behaviour={
        V017: "no rule: non-finite logits raise ValueError (check_finite=False: ids in [0, E), weights "
              "unspecified).",
        V033: "single-group fused kernels (bias, G = topk_group = 1, E <= 1024 within the tiers; Kimi-K2): an "
              "expert whose logit (sigmoid) or softmax score (softmax), or bias, is not finite is invalid: weight "
              "0, ranked after every valid expert (lower index first); valid weights s * rsf / (sum + 1e-20); a "
              "token with no valid expert: ids 0..k-1, weights 1/k (renormalize) or 0, no scaling. Multi-group / "
              "no bias / outside the tiers: no rule (the multi-group kernels guard only candidate logits): raise.",
    },
    upstream={V017: _F017 + "csrc/moe/grouped_topk_kernels.cu (no single-group kernels; candidate guard only)",
              V033: _F033 + "csrc/moe/grouped_topk_kernels.cu (single_group_topk::preprocess_score, "
                            "write_outputs, invokeNoAuxTc), fused_moe/router/grouped_topk_router.py, "
                            "tests/kernels/moe/test_grouped_topk.py::test_grouped_topk_single_group_nonfinite_scores"},
)
register_point(
    "routing.custom_routing_method_type", component="routing", reference="reference.routing.custom_routing_method_type",
    behaviour={V017: "CustomRoutingRouter advertises Llama4 for Llama4MoE.custom_routing_function, else Custom.",
               V033: "Llama4 for Llama-4's function; Cohere2-MoE's token_choice_with_bias: SigmoidRenorm "
                     "(renormalize) / Sigmoid; else Custom."},
    upstream={V017: _F017 + "fused_moe/router/custom_routing_router.py",
              V033: _F033 + "fused_moe/router/custom_routing_router.py, models/cohere2_moe.py"},
)
register_point(
    "routing.cpu_router", component="routing", reference="reference.routing.cpu_router_path / cpu_route",
    behaviour={V017: "no CPU router (SemanticsError).",
               V033: "on CPU every router but the zero-expert one is CPURouter: grouped -> _grouped_topk (a custom "
                     "function ignored); sqrtsoftplus -> SGLang hash / biased top-k (renormalize required); no "
                     "custom function -> _softmax_topk (softmax only; bias and routed_scaling_factor ignored); else "
                     "the custom function (fp32 / int32)."},
    upstream={V017: _F017 + "(absent)", V033: _F033 + "fused_moe/router/cpu_router.py, router/router_factory.py"},
)
register_point(
    "routing.zero_expert_router", component="routing", reference="reference.routing.zero_expert_router",
    behaviour={V017: "no ZeroExpertRouter in the factory (SemanticsError); seed 003's select_experts(zero_expert_num=) "
                     "is the reference's older form.",
               V033: "the factory's first branch: fused_topk_bias over real + zero experts (full bias), * rsf, "
                     "identity output sum(s * h) over zero slots (whole 256-column blocks only), zero slots -> id 0 "
                     "weight 0; routing method Unspecified."},
    upstream={V017: _F017 + "fused_moe/router/router_factory.py (no zero-expert branch)",
              V033: _F033 + "fused_moe/router/zero_expert_router.py, fused_moe.py (zero_experts_compute_triton), "
                            "tests/kernels/moe/test_zero_expert_moe.py"},
)
register_point(
    "routing.model_routers_033", component="routing",
    reference="reference.routing.token_choice_with_bias / musespark1x_routing",
    behaviour={V017: "not defined (no Cohere2-MoE, no MuseSpark; SemanticsError).",
               V033: "Cohere2-MoE: sigmoid -> top-k -> plain renormalize (0/0 = NaN unguarded). MuseSpark1x: "
                     "[x * multiplier] -> sigmoid|softmax -> bias chooses -> s * (route_scale / (sum + eps)), fp32, "
                     "is_padding rows -1 / 0."},
    upstream={V017: _F017 + "(absent)",
              V033: _F033 + "models/cohere2_moe.py, models/muse_spark/common/moe.py, "
                            "models/muse_spark/common/ops/fused_routing.py, tests/kernels/moe/test_muse_spark_router.py"},
)
