"""The ``torch`` backend: vectorized PyTorch implementations, independent of the reference, on any device.

The default backend on a machine without a GPU. It exists so the conformance suite compares two independent
implementations of the same definitions (and so the suite itself is exercised on every commit).
"""

from __future__ import annotations

import torch

from backends import Backend
from backends.torch import align, fused_act_quant, gate, moe_output, quant, routing
from backends.torch.experts import TorchBatchedExperts, TorchExperts, torch_activation, torch_activation_into

backend = Backend(
    name="torch",
    version=f"torch {torch.__version__}",
    ops={
        "fused_topk": routing.fused_topk,
        "grouped_topk": routing.grouped_topk,
        "grouped_topk_router": routing.grouped_topk_router,
        "fused_topk_bias": routing.fused_topk_bias,
        "topk_softmax": routing.topk_softmax,
        "llama4_routing": routing.llama4_routing,
        "gemma4_routing": routing.gemma4_routing,
        "minimax2_routing": routing.minimax2_routing,
        "token_choice_with_bias": routing.token_choice_with_bias,
        "musespark1x_routing": routing.musespark1x_routing,
        "zero_expert_router": routing.zero_expert_router,
        "apply_padding_rows": routing.apply_padding_rows,
        "append_fused_shared_experts": routing.append_fused_shared_experts,
        "eplb_logical_to_physical": routing.eplb_logical_to_physical,
        "per_token_group_quant_fp8": quant.per_token_group_quant_fp8,
        "scaled_fp8_quant": quant.scaled_fp8_quant,
        "int8_quant_per_token": quant.int8_quant_per_token,
        "gate_linear": gate.gate_linear,
        "moe_align_block_size": align.moe_align_block_size,
        "count_expert_num_tokens": align.count_expert_num_tokens,
        "fused_globalize_align_block_size": align.fused_globalize_align_block_size,
        "moe_permute": align.moe_permute,
        "moe_unpermute": align.moe_unpermute,
        # **situ: SITU's situ_beta / situ_linear_beta (vLLM 0.33), forwarded only when given.
        "apply_moe_activation": lambda act, x, *, alpha=None, beta=None, limit=None, **situ: torch_activation(
            act, x, alpha, beta, limit, **situ),
        "apply_moe_activation_into": torch_activation_into,
        "moe_fused_mul_sum": moe_output.moe_fused_mul_sum,
        "silu_mul_per_token_group_quant_fp8_colmajor": fused_act_quant.silu_mul_per_token_group_quant_fp8_colmajor,
        "persistent_masked_m_silu_mul_quant": fused_act_quant.persistent_masked_m_silu_mul_quant,
    },
    experts=[TorchExperts, TorchBatchedExperts],
    recipes={"per_token_group_quant_fp8": "vllm", "scaled_fp8_quant": "vllm", "int8_quant_per_token": "vllm"},
    device="cuda" if torch.cuda.is_available() else "cpu",
    gate_platforms=gate.gate_platforms,
    description="vectorized PyTorch (sort by expert, padded bmm, scatter-add)",
)
