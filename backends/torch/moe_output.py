"""vLLM 0.33's ``moe_fused_mul_sum`` in vectorized torch (own code; the spec is
``reference.moe_output.moe_fused_mul_sum``)."""

from __future__ import annotations

import torch


def moe_fused_mul_sum(inputs, topk_weights, outputs=None, topk_ids=None, expert_map=None, num_valid_tokens=None):
    """Weighted top-k sum skipping ``-1`` and non-local slots: a slot mask folded into the weights, one fp32
    einsum over top-k, and a row mask for the rows left untouched (all-padding rows, rows past
    ``num_valid_tokens``)."""
    if inputs.dim() != 3 or tuple(topk_weights.shape) != tuple(inputs.shape[:2]):
        raise ValueError(f"moe_fused_mul_sum: inputs {tuple(inputs.shape)} must be (T, top_k, H) with topk_weights "
                         f"(T, top_k), got {tuple(topk_weights.shape)}")
    if expert_map is not None and topk_ids is None:
        raise ValueError("moe_fused_mul_sum: topk_ids is required to interpret expert_map")
    T, k, H = inputs.shape
    if outputs is None:
        outputs = torch.empty(T, H, dtype=inputs.dtype, device=inputs.device)
    if tuple(outputs.shape) != (T, H):
        raise ValueError(f"moe_fused_mul_sum: outputs must be {(T, H)}, got {tuple(outputs.shape)}")
    w = topk_weights.float()
    rows = torch.ones(T, dtype=torch.bool, device=inputs.device)
    if topk_ids is not None:
        ids = topk_ids.long()
        valid = ids >= 0
        rows = valid.any(1)
        if expert_map is not None:
            valid = valid & (expert_map.long()[ids.clamp(min=0)] >= 0)
        w = torch.where(valid, w, torch.zeros_like(w))
    if num_valid_tokens is not None:
        n = int(num_valid_tokens.reshape(-1)[0]) if isinstance(num_valid_tokens, torch.Tensor) else int(num_valid_tokens)
        rows = rows & (torch.arange(T, device=inputs.device) < n)
    acc = torch.einsum("tkh,tk->th", inputs.float(), w)
    outputs[rows] = acc[rows].to(outputs.dtype)
    return outputs
