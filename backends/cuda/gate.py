"""The router gate GEMM tiers of vLLM's ``GateLinear`` (seed 000) on CUDA: hand-written kernels for tiers 1 and 2,
cuBLAS for tier 3, ``F.linear`` for tier 4 and for the fp32 dispatch op's M > 32 branch.

Ops (each mirrors the vLLM call the seed makes; ``reference.gate`` defines the numerics they are checked against):

- ``dsv3_router_gemm(hidden_states, router_weight, output_dtype=None)``: tier 1, ``ops.dsv3_router_gemm``
  (``csrc/moe/dsv3_router_gemm_entry.cu``). x ``(M, 7168)`` bf16, weight ``(E, 7168)`` bf16, E in {256, 384},
  1 <= M <= 16; returns ``(M, E)`` fp32 (unrounded fp32 accumulator) or bf16 (that value rounded once, RNE).
- ``fp32_router_gemm(x, weight)``: tier 2's kernel, ``ops.fp32_router_gemm`` (``csrc/moe/fp32_router_gemm_entry.cu``).
  x ``(M, 3072)`` bf16 or fp32, weight ``(256, 3072)`` fp32, 0 <= M <= 32; returns ``(M, 256)`` fp32.
- ``router_gemm_cublas(x, weight)``: tier 3, ``torch.mm(x, weight.T, out_dtype=torch.float32)`` (cuBLAS bf16 x bf16
  -> fp32). x ``(M, H)`` and weight ``(E, H)`` bf16; returns ``(M, E)`` fp32.
- ``gate_linear(x, weight, *, tier, out_dtype, bias=None)``: runs the implementation of ``tier`` (a
  ``reference.gate.GateTier``) with the same arguments and contract as ``reference.gate.gate_reference``, so
  conformance can compare tier by tier.
- ``gate_forward(x, weight, *, out_dtype, bias=None, platform=None)``: the seed's ``GateLinear.forward``: picks the
  tier with ``reference.gate.select_gate_tier`` for this device's platform, then ``gate_linear``.

Errors: an input outside a tier's contract raises ``reference.gate.GateContractError`` (a ``ValueError``) naming
the tier's limits; a failed JIT build raises ``RuntimeError`` with the compiler output's tail (``build.py``).

The matmul tiers (3, 4 and the fp32 dispatch fallback) run with TF32 and reduced-precision (bf16/fp16) split-K
reductions switched off for the call, so that their result is the fp32 accumulation the reference specifies.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from reference.gate import (
    CPU,
    DSV3_MAX_TOKENS,
    DSV3_SUPPORTED_HIDDEN_SIZES,
    DSV3_SUPPORTED_NUM_EXPERTS,
    FP32_MAX_TOKENS,
    FP32_SUPPORTED_HIDDEN_SIZES,
    FP32_SUPPORTED_NUM_EXPERTS,
    GateContractError,
    GateTier,
    Platform,
    select_gate_tier,
)

__all__ = [
    "current_platform",
    "gate_platforms",
    "dsv3_router_gemm",
    "fp32_router_gemm",
    "router_gemm_cublas",
    "gate_linear",
    "gate_forward",
    "tier_for",
    "kernel_variants",
    "strict_fp32_matmul",
]

BF16, FP32 = torch.bfloat16, torch.float32


def current_platform() -> Platform:
    """``reference.gate.Platform`` of the current device: ``CPU`` without a CUDA GPU; ROCm reports
    ``is_cuda=False`` with its capability (as vLLM's ``current_platform``)."""
    if not torch.cuda.is_available():
        return CPU
    major, minor = torch.cuda.get_device_capability()
    return Platform(is_cuda=torch.version.hip is None, capability=(int(major), int(minor)))


def gate_platforms() -> tuple[Platform, ...]:
    """The platforms whose tier dispatch ``gate_linear`` reproduces on this machine: ``CPU`` (tier 4, any device)
    and, with a CUDA GPU, the current device's platform (on SM90: every tier). Used by conformance/test_gate.py."""
    cur = current_platform()
    return (CPU,) if cur == CPU else (CPU, cur)


@contextlib.contextmanager
def strict_fp32_matmul():
    """Within the block: no TF32, no reduced-precision (bf16/fp16) reductions in cuBLAS. Restores the settings."""
    m = torch.backends.cuda.matmul
    saved = (m.allow_tf32, m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction)
    try:
        m.allow_tf32 = False
        m.allow_bf16_reduced_precision_reduction = False
        m.allow_fp16_reduced_precision_reduction = False
        yield
    finally:
        (m.allow_tf32, m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction) = saved


def _check_2d(x: object, weight: object) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"x and weight must be tensors, got {type(x).__name__} and {type(weight).__name__}")
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x must be (M, H) and weight (E, H); got shapes {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x has hidden size {x.shape[1]} but weight {tuple(weight.shape)} expects {weight.shape[1]}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but weight is on {weight.device}")


def _check_cuda(x: torch.Tensor, op: str) -> None:
    if x.device.type != "cuda":
        raise ValueError(f"{op} is a CUDA kernel: inputs must be on a CUDA device, got {x.device}")


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Row-major and 16-byte aligned (the kernels stream 16-byte vectors); copies only when needed."""
    if not t.is_contiguous():
        t = t.contiguous()
    if t.data_ptr() % 16:
        t = t.clone()
    return t


def kernel_variants() -> dict[str, list[str]]:
    """``{"dsv3_router_gemm": [...], "fp32_router_gemm": [...]}``: the tiling variants of each kernel (index =
    the ``variant`` argument); builds the extension if needed."""
    from backends.cuda.build import load_router_gemm_ext

    ext = load_router_gemm_ext()
    return {"dsv3_router_gemm": list(ext.dsv3_variants()), "fp32_router_gemm": list(ext.fp32_variants())}


#: Token counts from which tier 1 runs cuBLAS (``router_gemm_cublas``, then one RNE rounding for a bf16 output)
#: instead of the hand-written kernel, per expert count: the kernel is latency-bound and loses to cuBLAS at Kimi-K2's
#: E = 384 from M = 9, its next M bucket (docs/notes/cuda-results.md; H100 M = 8 / 9: 6.81 / 9.91 us against cuBLAS's
#: 7.88 / 8.05; H200 M = 8 / 12: 5.98 / 9.63 against 7.61 / 7.85). Same contract: the fp32 accumulation of the bf16
#: products (docs/gate_tiers.md). An explicit ``variant`` always runs the kernel.
DSV3_CUBLAS_FROM_M = {384: 9}


def dsv3_router_gemm(
    hidden_states: torch.Tensor,
    router_weight: torch.Tensor,
    output_dtype: torch.dtype | None = None,
    *,
    variant: int | None = None,
) -> torch.Tensor:
    """Tier 1: the DeepSeek-V3 router GEMM, ``hidden_states @ router_weight.T``.

    Args:
        hidden_states: ``(M, 7168)`` bf16 on a CUDA device, 1 <= M <= 16.
        router_weight: ``(E, 7168)`` bf16, E in {256, 384} (DeepSeek-V3 / Kimi-K2).
        output_dtype: fp32 or bf16; None means ``torch.get_default_dtype()`` (as vLLM's ``torch.empty(...,
            dtype=None)``).
        variant: kernel tiling variant (index into ``kernel_variants()["dsv3_router_gemm"]``); None = the one
            ``dsv3_auto_variant(M, E)`` picks (fastest measured for that token count), or cuBLAS where
            ``DSV3_CUBLAS_FROM_M`` says it is faster.

    Returns:
        ``(M, E)`` in ``output_dtype``: the fp32 accumulation (bf16: rounded once, RNE).

    Raises:
        GateContractError (ValueError): dtype, shape or token count outside the kernel's contract.
        RuntimeError: the extension failed to build (compiler output tail) or launch.

    Mirrors ``ops.dsv3_router_gemm`` / ``csrc/moe/dsv3_router_gemm_entry.cu`` (vLLM), called by tier 1 of
    ``vllm/model_executor/layers/fused_moe/router/gate_linear.py``.
    """
    _check_2d(hidden_states, router_weight)
    out = output_dtype if output_dtype is not None else torch.get_default_dtype()
    M, H = hidden_states.shape
    E = router_weight.shape[0]
    limits = (f"dsv3_router_gemm supports x bf16 (M, 7168) with 1 <= M <= {DSV3_MAX_TOKENS}, weight bf16 "
              f"(E, 7168) with E in {DSV3_SUPPORTED_NUM_EXPERTS}, output fp32 or bf16")
    if hidden_states.dtype != BF16 or router_weight.dtype != BF16:
        raise GateContractError(f"{limits}; got x {hidden_states.dtype}, weight {router_weight.dtype}")
    if out not in (FP32, BF16):
        raise GateContractError(f"{limits}; got output dtype {out}")
    if not 1 <= M <= DSV3_MAX_TOKENS:
        raise GateContractError(f"{limits}; got M = {M}")
    if H not in DSV3_SUPPORTED_HIDDEN_SIZES or E not in DSV3_SUPPORTED_NUM_EXPERTS:
        raise GateContractError(f"{limits}; got weight shape {tuple(router_weight.shape)}")
    _check_cuda(hidden_states, "dsv3_router_gemm")
    if variant is None and M >= DSV3_CUBLAS_FROM_M.get(E, DSV3_MAX_TOKENS + 1):
        logits = router_gemm_cublas(hidden_states, router_weight)
        return logits if out == FP32 else logits.to(out)
    from backends.cuda.build import load_router_gemm_ext

    ext = load_router_gemm_ext()
    return ext.dsv3_router_gemm(_aligned(hidden_states), _aligned(router_weight), out == BF16,
                                -1 if variant is None else int(variant))


def fp32_router_gemm(x: torch.Tensor, weight: torch.Tensor, *, variant: int | None = None) -> torch.Tensor:
    """Tier 2's kernel: the fp32 router GEMM (MiniMax-M2 gate), ``x.float() @ weight.T``.

    Args:
        x: ``(M, 3072)`` bf16 or fp32 on a CUDA device, 0 <= M <= 32.
        weight: ``(256, 3072)`` fp32.
        variant: kernel tiling variant (index into ``kernel_variants()["fp32_router_gemm"]``); None = the one
            ``fp32_auto_variant(M)`` picks.

    Returns:
        ``(M, 256)`` fp32, the fp32 accumulation (M == 0: an empty tensor, no launch).

    Raises:
        GateContractError (ValueError): dtype, shape or token count outside the kernel's contract.
        RuntimeError: the extension failed to build (compiler output tail) or launch.

    Mirrors ``ops.fp32_router_gemm`` / ``csrc/moe/fp32_router_gemm_entry.cu`` (vLLM), called through
    ``fp32_router_gemm_dispatch`` by tier 2 of ``vllm/model_executor/layers/fused_moe/router/gate_linear.py``.
    """
    _check_2d(x, weight)
    M, H = x.shape
    E = weight.shape[0]
    limits = (f"fp32_router_gemm supports x bf16 or fp32 (M, 3072) with 0 <= M <= {FP32_MAX_TOKENS}, weight fp32 "
              f"(E, 3072) with E in {FP32_SUPPORTED_NUM_EXPERTS}; output fp32")
    if weight.dtype != FP32 or x.dtype not in (FP32, BF16):
        raise GateContractError(f"{limits}; got x {x.dtype}, weight {weight.dtype}")
    if M > FP32_MAX_TOKENS:
        raise GateContractError(f"{limits}; got M = {M}")
    if H not in FP32_SUPPORTED_HIDDEN_SIZES or E not in FP32_SUPPORTED_NUM_EXPERTS:
        raise GateContractError(f"{limits}; got weight shape {tuple(weight.shape)}")
    _check_cuda(x, "fp32_router_gemm")
    if M == 0:
        return torch.empty(0, E, dtype=FP32, device=x.device)
    from backends.cuda.build import load_router_gemm_ext

    ext = load_router_gemm_ext()
    return ext.fp32_router_gemm(_aligned(x), _aligned(weight), -1 if variant is None else int(variant))


def router_gemm_cublas(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Tier 3: cuBLAS bf16 x bf16 -> fp32, ``torch.mm(x, weight.T, out_dtype=torch.float32)``.

    Args:
        x: ``(M, H)`` bf16; weight: ``(E, H)`` bf16 (any M, H, E; same device).

    Returns:
        ``(M, E)`` fp32, never rounded to bf16.

    Raises:
        GateContractError (ValueError): x or weight not bf16.

    Mirrors tier 3 of ``vllm/model_executor/layers/fused_moe/router/gate_linear.py``.
    """
    _check_2d(x, weight)
    if x.dtype != BF16 or weight.dtype != BF16:
        raise GateContractError(f"router_gemm_cublas needs bf16 x and weight, got x {x.dtype}, weight {weight.dtype}")
    with strict_fp32_matmul():
        return torch.mm(x, weight.T, out_dtype=FP32)


def _f_linear_tier(x, weight, bias, out_dtype):
    if out_dtype is not None and x.dtype != weight.dtype:
        x = x.to(weight.dtype)
    if x.dtype != weight.dtype:
        raise GateContractError(
            f"F.linear needs x and weight of one dtype, got x {x.dtype} and weight {weight.dtype} "
            "(GateLinear casts x to the weight dtype only when out_dtype is set)"
        )
    if bias is not None and bias.dtype != weight.dtype:
        raise GateContractError(f"bias must be in the weight dtype {weight.dtype}, got {bias.dtype}")
    with strict_fp32_matmul():
        y = F.linear(x, weight, bias)
    if out_dtype is not None and y.dtype != out_dtype:
        y = y.to(out_dtype)
    return y


def gate_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    tier: GateTier,
    out_dtype: torch.dtype | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Router logits ``(M, E)`` computed by the implementation of ``tier``, with ``gate_reference``'s contract.

    Args:
        x: ``(M, H)`` activations; weight: ``(E, H)`` stored gate weight; same CUDA device (tier 4 and the fp32
            dispatch fallback also run on CPU).
        tier: a ``reference.gate.GateTier``.
        out_dtype: GateLinear's ``out_dtype`` (None = unset); consulted by tiers 1 and 4 only.
        bias: ``(E,)`` in the weight dtype; only ``F_LINEAR`` accepts one.

    Returns / numerics (as ``reference.gate.gate_reference``):
        DSV3_ROUTER_GEMM: ``dsv3_router_gemm`` (fp32 accumulation; ``out_dtype`` None -> default dtype).
        FP32_ROUTER_GEMM: ``fp32_router_gemm`` (M <= 32). FP32_DISPATCH_F_LINEAR: ``F.linear(x.float(), W)`` in full
        fp32 (any M). CUBLAS_BF16_FP32: ``router_gemm_cublas``. F_LINEAR: x cast to the weight dtype when
        ``out_dtype`` is set, ``F.linear(x, W, b)`` rounded to the weight dtype, then cast to ``out_dtype``.

    Raises:
        TypeError: ``tier`` is not a ``GateTier``, non-tensor operands.
        ValueError: shape/device mismatches. GateContractError (a ValueError): the tier's contract is violated
            (dtypes, H, E, M limits, a bias on tiers 1-3).
        RuntimeError: the router GEMM extension failed to build or launch.

    Mirrors ``GateLinear.forward`` and ``fp32_router_gemm_dispatch_impl`` of
    ``vllm/model_executor/layers/fused_moe/router/gate_linear.py``.
    """
    if not isinstance(tier, GateTier):
        raise TypeError(f"tier must be a reference.gate.GateTier, got {tier!r}")
    _check_2d(x, weight)
    if bias is not None and not tier.supports_bias:
        raise GateContractError(f"{tier.name} has no bias; the seed only selects it for gates built with bias=False")
    if tier is GateTier.DSV3_ROUTER_GEMM:
        return dsv3_router_gemm(x, weight, out_dtype)
    if tier is GateTier.FP32_ROUTER_GEMM:
        return fp32_router_gemm(x, weight)
    if tier is GateTier.FP32_DISPATCH_F_LINEAR:
        if weight.dtype != FP32 or x.dtype not in (FP32, BF16):
            raise GateContractError(
                f"fp32_router_gemm_dispatch (F.linear branch) needs an fp32 weight and fp32 or bf16 x, got x "
                f"{x.dtype}, weight {weight.dtype}"
            )
        with strict_fp32_matmul():
            return F.linear(x.float(), weight)
    if tier is GateTier.CUBLAS_BF16_FP32:
        return router_gemm_cublas(x, weight)
    return _f_linear_tier(x, weight, bias, out_dtype)


def tier_for(
    M: int,
    H: int,
    E: int,
    *,
    x_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    out_dtype: torch.dtype | None,
    bias: bool = False,
    platform: Platform | None = None,
) -> GateTier:
    """The tier GateLinear would run on ``platform`` (default: this device), via ``reference.gate.select_gate_tier``
    (the dispatch is specification, not implementation, so the backend reuses it rather than re-deriving it)."""
    return select_gate_tier(M, H, E, x_dtype=x_dtype, weight_dtype=weight_dtype, out_dtype=out_dtype, bias=bias,
                            platform=current_platform() if platform is None else platform)


def gate_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    out_dtype: torch.dtype | None,
    bias: torch.Tensor | None = None,
    platform: Platform | None = None,
) -> torch.Tensor:
    """``GateLinear.forward`` on this backend: ``gate_linear(x, weight, tier=tier_for(...), ...)``.

    ``weight.dtype`` is the stored (resolved) parameter dtype. Raises as ``gate_linear``.
    """
    _check_2d(x, weight)
    tier = tier_for(x.shape[0], x.shape[1], weight.shape[0], x_dtype=x.dtype, weight_dtype=weight.dtype,
                    out_dtype=out_dtype, bias=bias is not None, platform=platform)
    return gate_linear(x, weight, tier=tier, out_dtype=out_dtype, bias=bias)
