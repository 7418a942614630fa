"""The ``cuda`` backend: cuBLAS / CUTLASS grouped GEMMs through torch, plus hand-written CUDA router GEMMs (SM90).

Ops (keyed by the name they replace; see ``backends/cuda/gate.py``):
    ``dsv3_router_gemm``    gate tier 1, CUDA kernel (router_gemm.cu), JIT-built on first use (``build.py``)
    ``fp32_router_gemm``    gate tier 2's kernel, CUDA kernel (router_gemm.cu)
    ``router_gemm_cublas``  gate tier 3, ``torch.mm(x, W.T, out_dtype=torch.float32)``
    ``gate_linear``         ``gate_linear(x, weight, *, tier, out_dtype, bias=None)``: any tier, with
                            ``reference.gate.gate_reference``'s contract (for tier-by-tier conformance)
    ``gate_forward``        GateLinear.forward: tier selection for this device + ``gate_linear``
    ``apply_moe_activation`` the experts' activation (torch ops, fp32 math, one rounding)

Experts (``backends/cuda/experts.py``): ``CutlassExpertsBf16`` (``torch._grouped_mm``), ``CutlassExpertsFp8``
(``torch._scaled_grouped_mm``, row-wise scales), and ``CutlassExpertsFp4`` / ``CutlassExpertsMxfp4`` declared
unsupported (SM100-only CUTLASS paths).

Availability: a CUDA GPU of compute capability >= 9.0 (``cuda_unavailable_reason((9, 0))``), a CUDA build of torch,
nvcc (``CUDA_HOME``) and ninja for the JIT build; a build that failed earlier in the process is reported too.
``gate_platforms`` returns the ``reference.gate.Platform`` values whose dispatch ``gate_linear`` computes here: CPU's
(tier 4) and the current GPU's (on an SM90 machine: tiers 1-4 and the fp32 dispatch fallback).
"""

from __future__ import annotations

import torch

from backends import Backend, cuda_unavailable_reason
from backends.cuda import build
from backends.cuda.experts import (
    CutlassExpertsBf16,
    CutlassExpertsFp4,
    CutlassExpertsFp8,
    CutlassExpertsMxfp4,
    cuda_moe_activation,
)
from backends.cuda.gate import (
    dsv3_router_gemm,
    fp32_router_gemm,
    gate_forward,
    gate_linear,
    gate_platforms,
    router_gemm_cublas,
)

__all__ = ["backend", "availability"]

VERSION = "1"


def availability() -> str | None:
    """None when the backend can run here, else why not (no SM90+ GPU, no CUDA torch, no nvcc/ninja, failed build)."""
    reason = cuda_unavailable_reason((9, 0))
    if reason is not None:
        return reason
    if torch.version.hip is not None:
        return f"ROCm build of torch ({torch.version.hip}): the cuda backend needs NVIDIA CUDA"
    return build.toolchain_unavailable_reason()


def _apply_moe_activation(activation, x, *, alpha=None, beta=None, limit=None):
    return cuda_moe_activation(activation, x, alpha=alpha, beta=beta, limit=limit)


backend = Backend(
    name="cuda",
    version=f"{VERSION} (torch {torch.__version__}, CUDA {torch.version.cuda})",
    ops={
        "dsv3_router_gemm": dsv3_router_gemm,
        "fp32_router_gemm": fp32_router_gemm,
        "router_gemm_cublas": router_gemm_cublas,
        "gate_linear": gate_linear,
        "gate_forward": gate_forward,
        "apply_moe_activation": _apply_moe_activation,
    },
    experts=[CutlassExpertsBf16, CutlassExpertsFp8, CutlassExpertsFp4, CutlassExpertsMxfp4],
    recipes={"scaled_fp8_quant": "vllm"},
    availability=availability,
    device="cuda",
    deterministic=True,
    gate_platforms=gate_platforms,
    description="cuBLAS / CUTLASS grouped GEMMs through torch (SM90), hand-written CUDA router GEMMs (JIT-built)",
)
