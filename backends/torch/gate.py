"""Router gate GEMM tiers the torch backend implements: tier 3 (bf16 x bf16 -> fp32) and tier 4 (F.linear), plus
the fp32 dispatch op's F.linear branch above 32 tokens. Tiers 1 and 2 are CUDA kernels (see the cuda backend)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from reference.gate import CPU, SM90, GateTier


def gate_linear(x: torch.Tensor, weight: torch.Tensor, *, tier: GateTier, out_dtype: torch.dtype | None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """Router logits ``(M, E)`` for ``tier`` (see ``reference.gate.gate_reference`` for each tier's numerics).

    Raises:
        NotImplementedError: tiers 1 and 2 (hand-written CUDA kernels, not torch ops).
    """
    if tier is GateTier.CUBLAS_BF16_FP32:
        if x.is_cuda:
            return torch.mm(x, weight.T, out_dtype=torch.float32)
        return x.float() @ weight.float().T  # exact products, fp32 accumulation: what cuBLAS computes
    if tier is GateTier.FP32_DISPATCH_F_LINEAR:
        return F.linear(x.float(), weight)
    if tier is GateTier.F_LINEAR:
        if out_dtype is not None and x.dtype != weight.dtype:
            x = x.to(weight.dtype)
        out = F.linear(x, weight, bias)
        return out if out_dtype is None else out.to(out_dtype)
    raise NotImplementedError(f"the torch backend does not implement gate tier {tier.name} (a CUDA kernel)")


def gate_platforms():
    """The torch backend computes the CPU dispatch (tier 4) and the SM90 dispatch's tiers 3 and 4 anywhere."""
    return (CPU, SM90)
