"""MoE experts on CUTLASS grouped GEMMs exposed by torch (SM90), in the style of vLLM's ``CutlassExpertsFp8``
(seed 004, ``vllm/model_executor/layers/fused_moe/cutlass_moe.py``).

Classes (``reference.modular.FusedMoEExpertsModular``, Standard activation format, output already weighted and
reduced, so finalize is ``TopKWeightAndReduceNoOP``):

- ``CutlassExpertsBf16``: unquantized bf16, ``torch._grouped_mm`` (CUTLASS SM90 bf16 grouped GEMM, fp32
  accumulation, bf16 output).
- ``CutlassExpertsFp8``: FP8 E4M3 W8A8 with row-wise fp32 scales, ``torch._scaled_grouped_mm`` (CUTLASS SM90,
  epilogue ``bf16(acc * scale_a[row] * scale_b[col])``): per-token (dynamic) x per-channel, and per-tensor
  (static or dynamic) activations / weights expressed as broadcast row-wise scales.
- ``CutlassExpertsFp4`` (NVFP4) and ``CutlassExpertsMxfp4``: declared, never supported here: CUTLASS FP4 grouped
  GEMMs are SM100-only (block-scaled tcgen05 MMA) and this backend does not implement them (see ``unsupported_reason``).

The pipeline of ``apply`` (no host synchronization, so it can be captured in a CUDA graph). On CUDA tensors the
glue around the two grouped GEMMs is four kernels of ``moe_glue.cu`` (set ``MOE_CUDA_GLUE=torch`` to run the torch
ops instead); elsewhere (the CPU tests) it is the torch ops below, which define what those kernels compute:

1. Routing plan (``route_plan`` / ``moe_route_plan``): global ids -> local ids (``expert_map``; -1, out-of-range ids
   and experts not held map to "not here"), a stable sort of the ``M * topk`` routes by local expert, per-expert
   counts, ``offs`` = their cumulative sum (int32, one entry per local expert, as ``_grouped_mm`` wants).
2. Gather the routed token rows in that order (``moe_scatter_rows``: each token row is read once, quantized to FP8
   per token or with a static per-tensor scale where the scheme says so, and written to its routes' rows).
3. GEMM1 ``(R, K) x (E, K, N) -> (R, N)`` bf16 (fp32 accumulation, one rounding). The weight ``w1 (E, N, K)`` is
   passed as its transposed view ``(E, K, N)``: column-major, which CUTLASS reads as "B transposed".
4. Activation (fp32 math, one rounding to bf16) and, for FP8, the requantization per token (dynamic) or per tensor
   (static / dynamic, over this call's routed rows, as vLLM's ``scaled_fp8_quant`` on the whole intermediate):
   ``moe_act_quant``, one pass over the rows that belong to an expert.
5. GEMM2 ``(R, I) x (E, I, K) -> (R, K)`` bf16.
6. Weight and reduce in fp32: for each token, ``sum_k w[t, k] * y[t, k]`` (no atomics: bitwise deterministic),
   non-local routes contribute 0; one rounding to the output dtype (``moe_weight_reduce``). With
   ``apply_router_weight_on_input`` the weights were applied to the input and are 1 here.

Alignment rules of the torch CUTLASS ops (checked with clear errors): row strides multiple of 16 bytes, so
K and N multiples of 8 (bf16) or 16 (fp8: ``_scaled_grouped_mm`` checks K % 16 and N % 16); group sizes (rows per
expert) need no padding for 2-D x 3-D products; fewer than 1024 groups (local experts); output bf16 only
(``_grouped_mm`` output dtype must equal the input's; ``_scaled_grouped_mm`` supports only bf16 out); no bias.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backends._declined import MICROSCALING_DECLINED
from backends._validation import check_topk_ids_range, validate_routes_requested
from reference.activation import ACTIVATIONS_SINCE_033, GATED_ACTIVATIONS, NO_MUL_ACTIVATIONS, MoEActivation
from reference.modular import ACTIVATION_PARAMS, FusedMoEActivationFormat, FusedMoEExpertsModular, SupportRecord, \
    TopKWeightAndReduceNoOP
from reference.quant import keys as qk

__all__ = [
    "CutlassExpertsBf16",
    "CutlassExpertsFp8",
    "CutlassExpertsFp4",
    "CutlassExpertsMxfp4",
    "cuda_moe_activation",
    "quant_fp8_per_token",
    "quant_fp8_per_tensor",
    "grouped_mm_bf16",
    "scaled_grouped_mm_fp8",
    "RoutePlan",
    "route_plan",
    "FP8_SUPPORTED_W_A",
    "VLLM_CUTLASS_FP8_W_A",
    "MAX_GROUPS",
]

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
FP8_MAX = 448.0
#: vLLM's dynamic per-token floor: min_scaling_factor = 1 / (448 * 512), an fp32 constant.
_MIN_TOKEN_SCALE = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(FP8_MAX * 512.0, dtype=torch.float32)
#: torch's CUTLASS grouped GEMMs refuse 1024 or more groups ("Can't process more than 1024 groups").
MAX_GROUPS = 1023

#: (weight key, activation key) pairs of vLLM's CutlassExpertsFp8 (``_supports_quant_scheme``).
VLLM_CUTLASS_FP8_W_A = (
    (qk.kFp8StaticChannelSym, qk.kFp8DynamicTokenSym),
    (qk.kFp8StaticTensorSym, qk.kFp8DynamicTensorSym),
    (qk.kFp8StaticTensorSym, qk.kFp8StaticTensorSym),
)
#: What ``CutlassExpertsFp8`` implements: per-tensor or per-channel weights x static per-tensor, dynamic
#: per-tensor or dynamic per-token activations (every one is a row-wise x column-wise scale pair).
FP8_SUPPORTED_W_A = tuple(
    (w, a)
    for w in (qk.kFp8StaticTensorSym, qk.kFp8StaticChannelSym)
    for a in (qk.kFp8StaticTensorSym, qk.kFp8DynamicTensorSym, qk.kFp8DynamicTokenSym)
)

#: The activations this backend implements: the reference's gated and ``*_NO_MUL`` sets without the vLLM 0.33 members.
_GATED = tuple(a for a in GATED_ACTIVATIONS if a not in ACTIVATIONS_SINCE_033)
_NO_MUL = tuple(a for a in NO_MUL_ACTIVATIONS if a not in ACTIVATIONS_SINCE_033)


# --------------------------------------------------------------------------------------------------------------
# Device
# --------------------------------------------------------------------------------------------------------------


def _device_capability() -> tuple[int, int] | None:
    """Compute capability of the current CUDA device (None without one, or on ROCm)."""
    if not torch.cuda.is_available() or torch.version.hip is not None:
        return None
    major, minor = torch.cuda.get_device_capability()
    return int(major), int(minor)


def _is_sm90() -> bool:
    return _device_capability() == (9, 0)


def _sm90_reason() -> str | None:
    """The experts' device probe: None on SM90, else why not. torch's CUTLASS grouped GEMMs run on SM90 and SM100;
    this backend is built and checked on SM90 only."""
    if _is_sm90():
        return None
    cap = _device_capability()
    return ("torch's CUTLASS grouped GEMMs, built and checked on SM90 (H100/H200) only; this device is "
            f"{f'sm_{cap[0]}{cap[1]}' if cap else 'not a CUDA GPU'}")


def _never_here(reason: str):
    """The device probe of a class declared but never run here: always ``reason`` plus what this device is."""
    def probe() -> str:
        cap = _device_capability()
        where = f"this device is sm_{cap[0]}{cap[1]}" if cap else "no CUDA device here"
        return f"{reason} ({where})"

    return probe


# --------------------------------------------------------------------------------------------------------------
# Activation and FP8 quantization (this backend's own implementations)
# --------------------------------------------------------------------------------------------------------------


def cuda_moe_activation(activation: MoEActivation, h: torch.Tensor, *, alpha: float | None = None,
                        beta: float | None = None, limit: float | None = None) -> torch.Tensor:
    """The MoE activation on GEMM1's output: fp32 math with torch ops, rounded once to ``h.dtype``.

    Args:
        activation: gated ``(..., 2d) -> (..., d)`` (gate = first half, up = second half; SWIGLUOAI interleaved:
            gate = even columns) or ``*_NO_MUL`` ``(..., d) -> (..., d)``.
        h: GEMM1 output, bf16/fp16/fp32. alpha / beta / limit: ``gemm1_alpha`` / ``gemm1_beta`` /
            ``gemm1_clamp_limit`` (SWIGLUOAI defaults 1.702 / 7.0; SWIGLUOAI_UNINTERLEAVE 1.0 / 0.0, clamp only
            with a limit; SILU clamps only with a limit; SWIGLUSTEP limit 7.0).

    Raises:
        ValueError: gated RELU2 (vLLM raises too), an odd width for a gated activation.

    Formulas: ``reference.activation.apply_moe_activation`` (the spec); this is an independent implementation.
    """
    A = MoEActivation
    x = h.float()
    if activation in _NO_MUL:
        if activation is A.SILU_NO_MUL:
            y = F.silu(x)
        elif activation is A.GELU_NO_MUL:
            y = F.gelu(x)
        else:
            y = F.relu(x).square()
        return y.to(h.dtype)
    if activation not in _GATED:
        why = ("gated RELU2 is undefined" if activation is A.RELU2 else
               f"it claims {', '.join(a.name for a in _GATED + _NO_MUL)}")
        raise ValueError(f"activation {activation.name} is not supported by the cuda backend ({why})")
    if x.shape[-1] % 2:
        raise ValueError(f"gated activation {activation.name} needs an even width, got {tuple(h.shape)}")
    if activation is A.SWIGLUOAI:
        gate, up = x[..., 0::2], x[..., 1::2]
    else:
        gate, up = x.chunk(2, dim=-1)
    if activation is A.SILU:
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        y = F.silu(gate) * up
    elif activation is A.GELU:
        y = F.gelu(gate) * up
    elif activation is A.GELU_TANH:
        y = F.gelu(gate, approximate="tanh") * up
    elif activation is A.SWIGLUOAI:
        a = 1.702 if alpha is None else alpha
        lim = 7.0 if limit is None else limit
        gate, up = gate.clamp(max=lim), up.clamp(-lim, lim)
        y = (up + 1.0) * gate * torch.sigmoid(a * gate)
    elif activation is A.SWIGLUOAI_UNINTERLEAVE:
        a = 1.0 if alpha is None else alpha
        b = 0.0 if beta is None else beta
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        y = gate * torch.sigmoid(a * gate) * (up + b)
    else:  # SWIGLUSTEP
        lim = 7.0 if limit is None else limit
        y = F.silu(gate).clamp(max=lim) * up.clamp(-lim, lim)
    return y.to(h.dtype)


def _to_fp8(y: torch.Tensor) -> torch.Tensor:
    # Saturate explicitly: torch's own fp8 overflow behaviour changed between releases.
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quant_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token FP8: ``s = max(amax_row / 448, 1 / (448 * 512))``, ``q = sat(x / s)``; a row with a
    non-finite value gets a NaN scale and NaN codes.

    x ``(R, C)`` -> codes ``(R, C)`` float8_e4m3fn, scales ``(R,)`` fp32. vLLM's
    ``scaled_fp8_quant(use_per_token_if_dynamic=True)`` recipe (``csrc/quantization/w8a8/fp8/common.cu``). Both
    divisions are IEEE divisions by tensors (torch turns a division by a Python number into a multiplication by
    its reciprocal on CUDA, one ulp off).
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    s = torch.clamp(amax / torch.full_like(amax, FP8_MAX), min=_MIN_TOKEN_SCALE.item())
    s = torch.where(torch.isfinite(amax), s, torch.full_like(s, float("nan")))
    return _to_fp8(xf / s.unsqueeze(-1)), s


def quant_fp8_per_tensor(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8: static (``scale`` given) ``q = sat(x * (1 / s))``; dynamic ``s = amax / 448`` (0 for an
    all-zero tensor, codes 0). Returns codes and a ``(1,)`` fp32 scale. vLLM's ``scaled_fp8_quant`` recipe."""
    xf = x.float()
    if scale is None:
        amax = xf.abs().amax()
        s = (amax / torch.full_like(amax, FP8_MAX)).reshape(1)  # an IEEE division (see quant_fp8_per_token)
    else:
        s = scale.float().reshape(-1)
        if s.numel() != 1:
            raise ValueError(f"a static per-tensor FP8 scale must have one element, got shape {tuple(scale.shape)}")
    inv = torch.where(s == 0, torch.zeros_like(s), 1.0 / s)
    return _to_fp8(xf * inv), s


# --------------------------------------------------------------------------------------------------------------
# Grouped GEMMs (module-level so that CPU tests can substitute an emulation)
# --------------------------------------------------------------------------------------------------------------


def grouped_mm_bf16(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``out[r] = a[r] @ w[g(r)].T`` for rows grouped by ``offs``: ``torch._grouped_mm`` (CUTLASS on SM90).

    a ``(R, K)`` bf16 row-major; w ``(E, N, K)`` bf16 (passed as the column-major view ``(E, K, N)``); offs
    ``(E,)`` int32 cumulative row ends (rows past ``offs[-1]`` belong to no group and are left unwritten).
    Returns ``(R, N)`` bf16 (fp32 accumulation, one rounding).
    """
    return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)


def scaled_grouped_mm_fp8(a: torch.Tensor, w: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                          offs: torch.Tensor) -> torch.Tensor:
    """``out[r, n] = bf16(sum_k a[r, k] * w[g(r), n, k] * scale_a[r] * scale_b[g(r), n])``:
    ``torch._scaled_grouped_mm`` (CUTLASS SM90 FP8 row-wise), fp32 accumulation and epilogue.

    a ``(R, K)`` float8_e4m3fn row-major; w ``(E, N, K)`` float8_e4m3fn (passed as the column-major view
    ``(E, K, N)``); scale_a ``(R,)`` fp32 contiguous; scale_b ``(E, N)`` fp32 contiguous; offs ``(E,)`` int32.
    Returns ``(R, N)`` bf16. torch 2.11 signature: ``_scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=None,
    bias=None, scale_result=None, out_dtype=None, use_fast_accum=False)``.
    """
    return torch._scaled_grouped_mm(a, w.transpose(-2, -1), scale_a, scale_b, offs=offs, out_dtype=BF16,
                                    use_fast_accum=False)


# --------------------------------------------------------------------------------------------------------------
# Routing plan
# --------------------------------------------------------------------------------------------------------------


@dataclass
class RoutePlan:
    """The permutation of the ``R = M * topk`` routes, sorted by local expert (non-local routes last).

    Attributes:
        order: ``(R,)`` int64, flat route index (``token * topk + k``) of each sorted row.
        token: ``(R,)`` int64, token of each sorted row (``order // topk``).
        offs: ``(E_local,)`` int32, cumulative row count per local expert (``_grouped_mm``'s ``offs``).
        valid_sorted: ``(R,)`` bool, the sorted row belongs to a local expert.
        inv: ``(M, topk)`` int64, sorted row of each route.
        valid_route: ``(M, topk)`` bool, the route goes to a local expert.
        poisoned: ``(M,)`` bool, the token has an id outside ``[-1, E)``: its output row is NaN.
    """

    order: torch.Tensor
    token: torch.Tensor
    offs: torch.Tensor
    valid_sorted: torch.Tensor
    inv: torch.Tensor
    valid_route: torch.Tensor
    poisoned: torch.Tensor


def check_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_local_experts: int) -> None:
    """Reject ids outside [-1, E) with a clear error (-1 = no route). A host copy: the experts call it only when
    route validation is requested (``backends._validation``: the conformance suite does); otherwise the plan drops
    such ids without reading out of bounds and their tokens' output rows are NaN. Skipped under CUDA-graph
    capture."""
    check_topk_ids_range(topk_ids, expert_map.numel() if expert_map is not None else num_local_experts)


def route_plan(topk_ids: torch.Tensor, num_local_experts: int, expert_map: torch.Tensor | None) -> RoutePlan:
    """Sort the routes by local expert without a host synchronization.

    ``topk_ids (M, topk)`` global ids; ``expert_map (E,)`` int global -> local (-1: not held) or None (ids are
    local). Ids < 0, >= E, mapped to -1 or to >= ``num_local_experts`` are "not here" (never index out of range:
    vLLM #48371 read ``expert_map[-1]``).
    """
    M, topk = topk_ids.shape
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).long()
    n_ids = expert_map.numel() if expert_map is not None else num_local_experts
    poisoned = ((ids < -1) | (ids >= n_ids)).view(M, topk).any(dim=1)
    if expert_map is None:
        local = ids
    else:
        E = expert_map.numel()
        in_range = (ids >= 0) & (ids < E)
        local = torch.where(in_range, expert_map.long()[ids.clamp(0, max(E - 1, 0))], torch.full_like(ids, -1))
    here = (local >= 0) & (local < num_local_experts)
    key = torch.where(here, local, torch.full_like(local, num_local_experts))
    _, order = torch.sort(key, stable=True)
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int32, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    offs = torch.cumsum(counts[:num_local_experts], 0, dtype=torch.int32)
    R = order.numel()
    inv = torch.empty_like(order)
    inv.scatter_(0, order, torch.arange(R, device=dev))
    return RoutePlan(order=order, token=order // topk, offs=offs, valid_sorted=here[order],
                     inv=inv.view(M, topk), valid_route=here.view(M, topk), poisoned=poisoned)


#: fp32 bytes of gathered rows per chunk of the weighted reduction (bounds its temporaries).
REDUCE_CHUNK_BYTES = 128 << 20


def _weight_and_reduce(y: torch.Tensor, plan: RoutePlan, topk_weights: torch.Tensor, unit_weights: bool,
                       output: torch.Tensor) -> None:
    """``output[t] = sum_k w[t, k] * y[inv[t, k]]``: each product rounded to fp32, the sum taken in k order from 0
    (the definition ``moe_weight_reduce`` computes bit for bit; the reference's ``(y * w).sum`` leaves the order
    open); non-local routes add nothing (their rows, past every group, are never written by the GEMM and may hold
    NaN); one rounding to ``output.dtype``; a poisoned token's row is NaN.

    Tokens go in chunks whose gathered fp32 rows stay under ``REDUCE_CHUNK_BYTES``.
    """
    M, topk = plan.inv.shape
    K = y.shape[1]
    w = torch.ones_like(topk_weights, dtype=torch.float32) if unit_weights else topk_weights.float()
    chunk = max(1, REDUCE_CHUNK_BYTES // max(1, topk * K * 4))
    for t0 in range(0, M, chunk):
        t1 = min(M, t0 + chunk)
        rows = y.index_select(0, plan.inv[t0:t1].reshape(-1)).view(t1 - t0, topk, K).float()
        valid = plan.valid_route[t0:t1]
        acc = torch.zeros((t1 - t0, K), dtype=torch.float32, device=y.device)
        for k in range(topk):
            acc = torch.where(valid[:, k:k + 1], acc + rows[:, k] * w[t0:t1, k:k + 1], acc)
        output[t0:t1].copy_(_poison(acc, plan.poisoned[t0:t1]))


def _poison(acc: torch.Tensor, poisoned: torch.Tensor) -> torch.Tensor:
    # a token with an id outside the id space (not validated on the host) gets NaN, never a plausible number
    return torch.where(poisoned.unsqueeze(-1), torch.full((), float("nan"), device=acc.device), acc)


# --------------------------------------------------------------------------------------------------------------
# The glue kernels of moe_glue.cu (CUDA tensors); the torch ops above and below define what they compute
# --------------------------------------------------------------------------------------------------------------

#: ``MOE_CUDA_GLUE=torch`` runs the torch-op glue on the GPU too (A/B timing, ``tools/glue_check.py``).
GLUE_ENV = "MOE_CUDA_GLUE"
#: moe_glue.h's ``Act`` codes.
GLUE_ACT = {
    MoEActivation.SILU: 0, MoEActivation.GELU: 1, MoEActivation.GELU_TANH: 2, MoEActivation.SWIGLUOAI: 3,
    MoEActivation.SWIGLUOAI_UNINTERLEAVE: 4, MoEActivation.SWIGLUSTEP: 5, MoEActivation.SILU_NO_MUL: 6,
    MoEActivation.GELU_NO_MUL: 7, MoEActivation.RELU2_NO_MUL: 8,
}
#: moe_glue.h's ``ScatterMode`` and ``ActOut`` codes.
SCATTER_COPY, SCATTER_QUANT_PER_TOKEN, SCATTER_QUANT_STATIC_TENSOR = 0, 1, 2
ACT_OUT_BF16, ACT_OUT_FP8_PER_TOKEN, ACT_OUT_FP8_STATIC_TENSOR = 0, 1, 2
#: moe_glue.h's limits: topk (scatter_rows) and the activated width I (act_quant stages a row in shared memory).
GLUE_MAX_TOPK, GLUE_MAX_ACT_WIDTH = 64, 16384


def glue_act_params(activation: MoEActivation, alpha: float | None, beta: float | None,
                    limit: float | None) -> tuple[int, float, float, float] | None:
    """``(code, alpha, beta, limit)`` of ``moe_act_quant`` for ``cuda_moe_activation``'s defaults (limit -1: no
    clamp), or None where the kernel has no such case (a negative clamp limit)."""
    A = MoEActivation
    if activation not in GLUE_ACT or (limit is not None and not limit >= 0):  # negative or NaN: the torch ops
        return None
    a, b, lim = alpha, beta, limit
    if activation is A.SWIGLUOAI:
        a, lim = (1.702 if a is None else a), (7.0 if lim is None else lim)
    elif activation is A.SWIGLUOAI_UNINTERLEAVE:
        a, b = (1.0 if a is None else a), (0.0 if b is None else b)
    elif activation is A.SWIGLUSTEP:
        lim = 7.0 if lim is None else lim
    return GLUE_ACT[activation], float(1.0 if a is None else a), float(0.0 if b is None else b), \
        float(-1.0 if lim is None else lim)


def glue_kernels(hidden_states: torch.Tensor, topk: int, I: int):
    """The extension module whose glue kernels run this step, or None for the torch-op glue: tensors off the GPU,
    ``MOE_CUDA_GLUE=torch``, or a shape past the kernels' limits (topk > 64, I > 16384).

    Raises:
        RuntimeError: the extension failed to build (the compiler output's tail; ``backends/cuda/build.py``).
    """
    if not hidden_states.is_cuda or os.environ.get(GLUE_ENV, "cuda") == "torch":
        return None
    if hidden_states.data_ptr() % 16:  # the kernels read 16-byte vectors (an offset view of a larger tensor)
        return None
    if topk > GLUE_MAX_TOPK or I > GLUE_MAX_ACT_WIDTH:
        return None
    from backends.cuda.build import load_router_gemm_ext

    return load_router_gemm_ext()


def glue_route_plan(ext, topk_ids: torch.Tensor, num_local_experts: int,
                    expert_map: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_route_plan``: ``(offs (E_local,), inv (M * topk,), sorted_token (M * topk,))`` int32. ``offs`` and
    ``sorted_token[:offs[-1]]`` equal ``route_plan``'s; ``inv`` equals its sorted row for a local route, and is -1
    for a route to no local expert, -2 for an id outside the id space."""
    return ext.moe_route_plan(*_plan_inputs(topk_ids, expert_map), num_local_experts)


def _plan_inputs(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """topk_ids as contiguous int32 / int64 and expert_map as contiguous int32, as the plan kernels read them."""
    ids = topk_ids if topk_ids.dtype in (torch.int32, torch.int64) else topk_ids.long()
    return ids.contiguous(), None if expert_map is None else expert_map.to(torch.int32).contiguous()


def glue_route_plan_scatter(ext, topk_ids: torch.Tensor, num_local_experts: int, expert_map: torch.Tensor | None,
                            x: torch.Tensor, mode: int, scale_in: torch.Tensor | None, scale_per_token: bool,
                            out: torch.Tensor, scale_out: torch.Tensor | None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``glue_route_plan`` then ``moe_scatter_rows`` of ``x`` (M, K) into ``out`` (M * topk, K) (and the rows' scales
    into ``scale_out``), in one launch at decode (``moe_route_plan_scatter``). Returns the plan."""
    ids, emap = _plan_inputs(topk_ids, expert_map)
    return ext.moe_route_plan_scatter(ids, emap, num_local_experts, x, mode, scale_in, scale_per_token, out,
                                      scale_out)


def glue_weight_and_reduce(ext, y: torch.Tensor, inv: torch.Tensor, topk_weights: torch.Tensor, unit_weights: bool,
                           output: torch.Tensor) -> None:
    """``moe_weight_reduce`` into ``output`` (M, K) bf16: ``_weight_and_reduce``'s result (products rounded, summed
    in k order), bit for bit."""
    topk = topk_weights.shape[1]
    w = None if unit_weights else topk_weights.to(torch.float32).contiguous()
    direct = output.is_contiguous() and output.data_ptr() % 16 == 0
    out = output if direct else torch.empty_like(output, memory_format=torch.contiguous_format)
    ext.moe_weight_reduce(y.contiguous(), inv, topk, w, out)
    if out is not output:
        output.copy_(out)


# --------------------------------------------------------------------------------------------------------------
# Experts
# --------------------------------------------------------------------------------------------------------------


class _CutlassExpertsBase(FusedMoEExpertsModular):
    """Shared plumbing of the CUTLASS grouped-GEMM experts (see the module docstring)."""

    #: Alignment of K, N and I in elements (16 bytes of the operand dtype).
    ALIGN: int = 8

    def __init__(self, moe_config, quant_config, max_num_tokens=None, num_dispatchers=None):
        super().__init__(moe_config, quant_config, max_num_tokens, num_dispatchers)
        self._validate_quant_config()  # an unsupported scheme fails here, before any token (M == 0 too)

    def _validate_quant_config(self) -> None:
        """Raise ValueError if ``self.quant_config`` is a scheme this class does not run."""
        raise NotImplementedError

    @staticmethod
    def activation_format() -> FusedMoEActivationFormat:
        return FusedMoEActivationFormat.Standard

    #: The claims common to every CUTLASS class; the plumbing itself claims no quantization scheme (each subclass
    #: replaces ``quant_schemes``). Parallel configs: any (EP through expert_map with the NoEP prepare/finalize; no
    #: all2all of its own). ``_unsupported_layer_reason`` adds what the seed's predicates do not see.
    support = SupportRecord(
        FusedMoEActivationFormat.Standard,
        quant_schemes=frozenset(),
        activations=frozenset(_GATED + _NO_MUL),
        act_dtypes=frozenset({BF16}),  # the grouped GEMMs through torch output bf16 only (checked in apply too)
        device=_sm90_reason,
        finalize="(M, K) weighted and reduced: TopKWeightAndReduceNoOP",
        activation_params=ACTIVATION_PARAMS, ue8m0_scales=True,  # every variant, as before the claims had them
        notes="torch CUTLASS grouped GEMMs (SM90); no expert biases; < 1024 local experts; I a multiple of ALIGN",
        declined=MICROSCALING_DECLINED,  # vLLM 0.33's microscaling cross pairs: why not here (backends/_declined.py)
    )

    @classmethod
    def _unsupported_layer_reason(cls, moe_config) -> str | None:
        """Layer properties the seed's predicates do not see: expert biases, activation dtype, N / I alignment."""
        if moe_config.has_bias:
            return ("expert biases (torch._grouped_mm / _scaled_grouped_mm have no bias epilogue, and a bias added "
                    "after the bf16 store would round twice)")
        if moe_config.in_dtype not in cls.support.act_dtypes:
            return f"activation dtype {moe_config.in_dtype} (the CUTLASS grouped GEMMs through torch output bf16 only)"
        I = moe_config.intermediate_size_per_partition
        if I % cls.ALIGN:
            return f"intermediate size {I} (must be a multiple of {cls.ALIGN}: 16-byte row strides)"
        if moe_config.num_local_experts > MAX_GROUPS:
            return f"{moe_config.num_local_experts} local experts (torch's CUTLASS grouped GEMMs take < 1024 groups)"
        return None

    @staticmethod
    def is_supported_config(cls, moe_config, weight_key, activation_key, activation_format):
        """The seed's oracle (``FusedMoEExperts.is_supported_config``) plus ``_unsupported_layer_reason``."""
        ok, reason = FusedMoEExpertsModular.is_supported_config(cls, moe_config, weight_key, activation_key,
                                                                activation_format)
        if not ok:
            return ok, reason
        extra = cls._unsupported_layer_reason(moe_config)
        if extra is not None:
            return False, f"kernel does not support {extra}"
        return True, None

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOP()

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation):
        # The grouped GEMMs allocate their own outputs; the workspaces are sized like vLLM's CUTLASS experts.
        n_act = N // 2 if activation.is_gated else N
        return (M * topk, max(N, K)), (M * topk, n_act), (M, K)

    # --- helpers ------------------------------------------------------------------------------------------
    def _check_operands(self, output, hidden_states, w1, w2, topk_ids, activation, w_dtype) -> tuple[int, int, int]:
        name = type(self).__name__
        if not self._supports_current_device():
            cap = _device_capability()
            raise ValueError(f"{name} runs on SM90 (H100/H200) only: torch's CUTLASS grouped GEMMs; this device is "
                             f"{f'sm_{cap[0]}{cap[1]}' if cap else 'not a CUDA GPU'}")
        if hidden_states.dim() != 2 or w1.dim() != 3 or w2.dim() != 3:
            raise ValueError(f"{name}: expected hidden_states (M, K), w1 (E, N, K), w2 (E, K, I); got "
                             f"{tuple(hidden_states.shape)}, {tuple(w1.shape)}, {tuple(w2.shape)}")
        E, N, K = w1.shape
        I = N // 2 if activation.is_gated else N
        if hidden_states.shape[1] != K or tuple(w2.shape) != (E, K, I):
            raise ValueError(f"{name}: shapes disagree: hidden_states {tuple(hidden_states.shape)}, w1 "
                             f"{tuple(w1.shape)}, w2 {tuple(w2.shape)} (expected (E, K, {I}) for {activation.name})")
        if w1.dtype != w_dtype or w2.dtype != w_dtype:
            raise ValueError(f"{name}: weights must be {w_dtype}, got w1 {w1.dtype}, w2 {w2.dtype}")
        if output.dtype != BF16:
            raise ValueError(f"{name}: output dtype must be bf16 (the CUTLASS grouped GEMMs through torch output bf16 "
                             f"only), got {output.dtype}")
        for what, v in (("K (hidden size)", K), ("N (w1 rows)", N), ("I (intermediate size)", I)):
            if v % self.ALIGN:
                raise ValueError(f"{name}: {what} = {v} must be a multiple of {self.ALIGN} (16-byte row strides "
                                 "required by torch's CUTLASS grouped GEMMs)")
        if E > MAX_GROUPS:
            raise ValueError(f"{name}: {E} local experts; torch's CUTLASS grouped GEMMs take at most {MAX_GROUPS}")
        if self.quant_config.w1_bias is not None or self.quant_config.w2_bias is not None:
            raise ValueError(f"{name}: expert biases are not supported (no bias epilogue in torch._grouped_mm)")
        if topk_ids.is_floating_point():
            raise ValueError(f"{name}: topk_ids must be integers, got {topk_ids.dtype}")
        return E, N, K

    def _glue(self, hidden_states: torch.Tensor, topk: int, activation: MoEActivation, I: int):
        """``(extension, moe_act_quant parameters)`` when the CUDA glue kernels run this step, else ``(None, None)``."""
        qc = self.quant_config
        params = glue_act_params(activation, qc.gemm1_alpha, qc.gemm1_beta, qc.gemm1_clamp_limit)
        ext = glue_kernels(hidden_states, topk, I) if params is not None else None
        return (ext, params) if ext is not None else (None, None)

    @staticmethod
    def _glue_activation(ext, params, h: torch.Tensor, I: int, offs: torch.Tensor, out_kind: int, *,
                         static_scale: torch.Tensor | None = None, want_amax: bool = False):
        """``moe_act_quant`` over the expert rows of ``h`` (R, N): ``(out (R, I), per-row scales or None, amax or
        None)``; rows past ``offs[-1]`` are left unwritten (no expert reads them)."""
        code, alpha, beta, limit = params
        R = h.shape[0]
        out = torch.empty((R, I), dtype=BF16 if out_kind == ACT_OUT_BF16 else FP8, device=h.device)
        scale = torch.empty(R, dtype=torch.float32, device=h.device) if out_kind == ACT_OUT_FP8_PER_TOKEN else None
        amax = torch.zeros(1, dtype=torch.float32, device=h.device) if want_amax else None
        ext.moe_act_quant(h.contiguous(), code, alpha, beta, limit, offs, out_kind, out, scale, static_scale, amax)
        return out, scale, amax

    def _activation(self, activation: MoEActivation, h: torch.Tensor, plan: RoutePlan) -> torch.Tensor:
        qc = self.quant_config
        g = cuda_moe_activation(activation, h, alpha=qc.gemm1_alpha, beta=qc.gemm1_beta, limit=qc.gemm1_clamp_limit)
        # Rows of non-local routes lie outside every group: the GEMM never wrote them. Zero them so that they can
        # neither poison a dynamic per-tensor scale nor the reduction.
        return g.masked_fill(~plan.valid_sorted.unsqueeze(-1), 0).contiguous()


class CutlassExpertsBf16(_CutlassExpertsBase):
    """Unquantized bf16 experts on ``torch._grouped_mm`` (CUTLASS SM90 bf16 grouped GEMM).

    Shapes: hidden_states ``(M, K)`` bf16, w1 ``(E_local, N, K)`` bf16, w2 ``(E_local, K, I)`` bf16 (I = N/2 gated,
    N otherwise), topk ids/weights ``(M, topk)``, output ``(M, K)`` bf16. K, N, I multiples of 8.

    Rounding points (as ``reference.experts``): GEMM1 output bf16, activation output bf16, GEMM2 output bf16,
    weighted sum fp32 -> bf16 once.

    Raises:
        ValueError: non-bf16 operands or output, misaligned K/N/I, >= 1024 local experts, expert biases.
    """

    support = dataclasses.replace(
        _CutlassExpertsBase.support,
        quant_schemes=frozenset({(None, None)}),
        hidden_dim_multiple=_CutlassExpertsBase.ALIGN,  # 16-byte rows (apply checks K, N, I too)
        notes="torch._grouped_mm (CUTLASS SM90 bf16); no expert biases; < 1024 local experts; N, I multiples of 8",
    )

    def _validate_quant_config(self) -> None:
        qc = self.quant_config
        if qc.is_quantized:
            raise ValueError(f"CutlassExpertsBf16 runs unquantized bf16 experts, got the {qc.scheme_name()} scheme; "
                             "use CutlassExpertsFp8 for FP8")
        if qc.w1_bias is not None or qc.w2_bias is not None:
            raise ValueError("CutlassExpertsBf16: expert biases are not supported (no bias epilogue in "
                             "torch._grouped_mm)")

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        self._validate_quant_config()
        E, N, K = self._check_operands(output, hidden_states, w1, w2, topk_ids, activation, BF16)
        if hidden_states.dtype != BF16:
            raise ValueError(f"CutlassExpertsBf16: hidden_states must be bf16, got {hidden_states.dtype}")
        if topk_ids.shape[0] == 0:
            return
        if validate_routes_requested(None, topk_ids):
            check_ids(topk_ids, expert_map, E)
        I = w2.shape[2]
        ext, params = self._glue(hidden_states, topk_ids.shape[1], activation, I)
        if ext is None:  # the torch-op glue
            plan = route_plan(topk_ids, E, expert_map)
            a = hidden_states.index_select(0, plan.token)
            h = grouped_mm_bf16(a, w1, plan.offs)
            g = self._activation(activation, h, plan)
            y = grouped_mm_bf16(g, w2, plan.offs)
            _weight_and_reduce(y, plan, topk_weights, apply_router_weight_on_input, output)
            return
        a = torch.empty((topk_ids.numel(), K), dtype=BF16, device=hidden_states.device)
        offs, inv, _ = glue_route_plan_scatter(ext, topk_ids, E, expert_map, hidden_states.contiguous(), SCATTER_COPY,
                                               None, False, a, None)
        h = grouped_mm_bf16(a, w1, offs)
        g, _, _ = self._glue_activation(ext, params, h, I, offs, ACT_OUT_BF16)
        y = grouped_mm_bf16(g, w2, offs)
        glue_weight_and_reduce(ext, y, inv, topk_weights, apply_router_weight_on_input, output)


def _per_column_scales(scale: torch.Tensor | None, E: int, N: int, per_channel: bool, what: str) -> torch.Tensor:
    """Weight scales as ``_scaled_grouped_mm``'s ``scale_b``: ``(E, N)`` fp32 contiguous. Per-tensor scales (one per
    expert, or one in all) are broadcast along N; per-channel scales are ``(E, N)`` or ``(E, N, 1)``."""
    if scale is None:
        raise ValueError(f"CutlassExpertsFp8: {what} scale is missing from the quant config")
    s = scale.float()
    if per_channel:
        if s.numel() != E * N:
            raise ValueError(f"CutlassExpertsFp8: per-channel {what} scale must have E*N = {E}*{N} elements, got "
                             f"shape {tuple(scale.shape)}")
        return s.reshape(E, N).contiguous()
    if s.numel() == 1:
        return s.reshape(1, 1).expand(E, N).contiguous()
    if s.numel() == E:
        return s.reshape(E, 1).expand(E, N).contiguous()
    raise ValueError(f"CutlassExpertsFp8: per-tensor {what} scale must have 1 or E = {E} elements, got shape "
                     f"{tuple(scale.shape)}")


class CutlassExpertsFp8(_CutlassExpertsBase):
    """FP8 E4M3 W8A8 experts on ``torch._scaled_grouped_mm`` (CUTLASS SM90, row-wise fp32 scales).

    Quant schemes (``FP8_SUPPORTED_W_A``; vLLM's CutlassExpertsFp8 claims ``VLLM_CUTLASS_FP8_W_A``):
    weights per-tensor (scale ``(E,)``) or per-channel (``(E, N, 1)`` for w1, ``(E, K, 1)`` for w2); activations
    static per-tensor, dynamic per-tensor or dynamic per-token. Every pair is expressed as ``scale_a (R,)`` (one
    per routed row: the token's scale, or the tensor scale broadcast) and ``scale_b (E, N)``.

    Shapes: hidden_states ``(M, K)`` float8_e4m3fn codes from prepare (``a1q_scale`` ``(M, 1)`` per token or
    ``(1,)`` per tensor) or bf16 (quantized here with the config's a1 scheme); w1 ``(E, N, K)`` and w2
    ``(E, K, I)`` float8_e4m3fn; output ``(M, K)`` bf16. K, N, I multiples of 16.

    Rounding points: GEMM1 output bf16 (scales applied to the fp32 accumulator), activation bf16, a2 requantized
    to FP8 (per token: dynamic; per tensor: static, or dynamic over this call's routed rows as vLLM's
    ``scaled_fp8_quant`` on the whole intermediate), GEMM2 output bf16, weighted sum fp32 -> bf16 once.

    Raises:
        ValueError: non-FP8 weights, block-scaled or other unsupported schemes, bad scale shapes, misaligned
            K/N/I, >= 1024 local experts, expert biases, non-bf16 output.
    """

    ALIGN = 16

    support = dataclasses.replace(
        _CutlassExpertsBase.support,
        quant_schemes=frozenset(FP8_SUPPORTED_W_A),
        hidden_dim_multiple=ALIGN,  # _scaled_grouped_mm checks K % 16 (apply checks K, N, I too)
        notes="torch._scaled_grouped_mm (CUTLASS SM90 FP8 row-wise scales); no expert biases; < 1024 local experts; "
              "N, I multiples of 16; a1 codes from prepare or bf16 quantized here",
    )

    @property
    def expects_unquantized_inputs(self) -> bool:
        """True: prepare hands over bf16 rows and the step quantizes them itself with the scheme's recipe, fused
        with the gather on the GPU (``moe_scatter_rows``: each token row read once); FP8 codes from a prepare that
        quantized anyway are taken as they are."""
        return True

    def _validate_quant_config(self) -> None:
        self._scheme()
        if self.quant_config.w1_bias is not None or self.quant_config.w2_bias is not None:
            raise ValueError("CutlassExpertsFp8: expert biases are not supported (no bias epilogue in "
                             "torch._scaled_grouped_mm)")

    def _scheme(self) -> tuple[bool, bool]:
        """(per-channel weights, per-token activations); raises ValueError for anything else."""
        qc = self.quant_config
        if not qc.use_fp8_w8a8:
            raise ValueError(f"CutlassExpertsFp8 needs an FP8 W8A8 quant config, got {qc.scheme_name()}")
        if qc.w1.shape not in ((-1, -1), (1, -1)) or qc.w2.shape != qc.w1.shape:
            raise ValueError(f"CutlassExpertsFp8 supports per-tensor or per-channel weight scales, got group shape "
                             f"{qc.w1.shape} (block-scaled FP8 is the deep_gemm / triton backends' job)")
        if qc.a1.shape not in ((-1, -1), (1, -1)) or qc.a2.shape != qc.a1.shape:
            raise ValueError(f"CutlassExpertsFp8 supports per-tensor or per-token activation scales, got "
                             f"{qc.a1.shape} / {qc.a2.shape}")
        per_token = qc.a1.shape == (1, -1)
        if per_token and (qc.a1_scale is not None or qc.a2_scale is not None):
            raise ValueError("CutlassExpertsFp8: per-token activation scales are dynamic; static per-token scales "
                             "are not supported")
        return qc.w1.shape == (1, -1), per_token

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        per_channel, per_token = self._scheme()
        E, N, K = self._check_operands(output, hidden_states, w1, w2, topk_ids, activation, FP8)
        I = w2.shape[2]
        M = hidden_states.shape[0]
        if M == 0:
            return
        qc = self.quant_config
        if hidden_states.dtype not in (FP8, BF16):
            raise ValueError(f"CutlassExpertsFp8: hidden_states must be float8_e4m3fn codes or bf16, got "
                             f"{hidden_states.dtype}")
        if hidden_states.dtype == FP8 and a1q_scale is None:
            raise ValueError("CutlassExpertsFp8: FP8 hidden_states need a1q_scale")
        if validate_routes_requested(None, topk_ids):
            check_ids(topk_ids, expert_map, E)
        scale_b1 = _per_column_scales(qc.w1_scale, E, N, per_channel, "w1")
        scale_b2 = _per_column_scales(qc.w2_scale, E, K, per_channel, "w2")
        ext, params = self._glue(hidden_states, topk_ids.shape[1], activation, I)
        if ext is None:
            self._apply_torch_glue(output, hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map,
                                   a1q_scale, a2_scale, apply_router_weight_on_input, scale_b1, scale_b2, per_token)
            return
        # 1. The plan, and every token row read once, quantized if it is bf16, and written to its routes' rows.
        R, dev = topk_ids.numel(), hidden_states.device
        a = torch.empty((R, K), dtype=FP8, device=dev)
        sa1 = torch.empty(R, dtype=torch.float32, device=dev)
        x = hidden_states.contiguous()
        if x.dtype == FP8:
            mode, s1 = SCATTER_COPY, self._a1_scales(a1q_scale, M, per_token)
        elif per_token:
            mode, s1 = SCATTER_QUANT_PER_TOKEN, None
        elif qc.a1_scale is not None:
            mode, s1 = SCATTER_QUANT_STATIC_TENSOR, _one_scale(qc.a1_scale, "a1")
        else:  # dynamic per-tensor: the amax of the whole input first
            x, s1 = quant_fp8_per_tensor(x, None)
            mode = SCATTER_COPY
        offs, inv, _ = glue_route_plan_scatter(ext, topk_ids, E, expert_map, x, mode, s1, per_token, a, sa1)
        # 2. GEMM1, activation + requantization, GEMM2, weight and reduce.
        h = scaled_grouped_mm_fp8(a, w1, sa1, scale_b1, offs)
        if per_token:
            g8, sa2, _ = self._glue_activation(ext, params, h, I, offs, ACT_OUT_FP8_PER_TOKEN)
        elif a2_scale is not None:
            s2 = _one_scale(a2_scale, "a2")
            g8, _, _ = self._glue_activation(ext, params, h, I, offs, ACT_OUT_FP8_STATIC_TENSOR, static_scale=s2)
            sa2 = s2.expand(R).contiguous()
        else:  # dynamic per-tensor over the expert rows: their amax comes from the activation kernel
            g, _, amax = self._glue_activation(ext, params, h, I, offs, ACT_OUT_BF16, want_amax=True)
            g8, s2 = quant_fp8_per_tensor(g, amax / torch.full_like(amax, FP8_MAX))  # that scale, as a static one
            sa2 = s2.expand(R).contiguous()
        y = scaled_grouped_mm_fp8(g8, w2, sa2, scale_b2, offs)
        glue_weight_and_reduce(ext, y, inv, topk_weights, apply_router_weight_on_input, output)

    @staticmethod
    def _a1_scales(a1q_scale: torch.Tensor, M: int, per_token: bool) -> torch.Tensor:
        """The scales of FP8 hidden_states from prepare: ``(M,)`` per token or ``(1,)`` per tensor, fp32."""
        s1 = a1q_scale.float().reshape(-1).contiguous()
        want = M if per_token else 1
        if s1.numel() != want:
            raise ValueError(f"CutlassExpertsFp8: {'per-token' if per_token else 'per-tensor'} a1 scales must have "
                             f"{'M = ' if per_token else ''}{want} element{'s' if want != 1 else ''}, got "
                             f"{s1.numel()}")
        return s1

    def _apply_torch_glue(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map,
                          a1q_scale, a2_scale, apply_router_weight_on_input, scale_b1, scale_b2, per_token):
        """The step with the torch-op glue (the definition of the kernels of moe_glue.cu; the CPU tests run it)."""
        qc = self.quant_config
        E, _, K = w1.shape
        I = w2.shape[2]
        M = hidden_states.shape[0]
        # 1. a1 codes and their scales (prepare normally quantized already).
        if hidden_states.dtype == FP8:
            a1q, s1 = hidden_states, self._a1_scales(a1q_scale, M, per_token)
        else:
            a1q, s1 = (quant_fp8_per_token(hidden_states) if per_token
                       else quant_fp8_per_tensor(hidden_states, qc.a1_scale))
        plan = route_plan(topk_ids, E, expert_map)
        R = plan.token.numel()
        a = a1q.contiguous().view(torch.uint8).index_select(0, plan.token).view(FP8)
        s1 = s1.float().reshape(-1)
        sa1 = s1.index_select(0, plan.token).contiguous() if per_token else s1.expand(R).contiguous()
        # 2. GEMM1 with scale_a per row, scale_b per output column.
        h = scaled_grouped_mm_fp8(a, w1, sa1, scale_b1, plan.offs)
        # 3. Activation, requantization.
        g = self._activation(activation, h, plan)
        if per_token:
            g8, sa2 = quant_fp8_per_token(g)
        else:
            g8, s2 = quant_fp8_per_tensor(g, a2_scale)
            sa2 = s2.expand(R).contiguous()
        # 4. GEMM2, weight and reduce.
        y = scaled_grouped_mm_fp8(g8, w2, sa2.contiguous(), scale_b2, plan.offs)
        assert y.shape == (R, K) and g8.shape == (R, I)
        _weight_and_reduce(y, plan, topk_weights, apply_router_weight_on_input, output)


def _one_scale(scale: torch.Tensor, what: str) -> torch.Tensor:
    """A static per-tensor scale as a ``(1,)`` fp32 tensor (ValueError for more than one element)."""
    s = scale.float().reshape(-1)
    if s.numel() != 1:
        raise ValueError(f"a static per-tensor FP8 {what} scale must have one element, got shape {tuple(scale.shape)}")
    return s.contiguous()


class _UnsupportedOnSm90(_CutlassExpertsBase):
    """A CUTLASS path of vLLM that needs SM100 (Blackwell): declared so the conformance matrix shows why it is
    skipped; never claims support, and constructing it (or ``apply``) raises NotImplementedError."""

    #: Why this class never runs here (shown by ``is_supported_config`` through the record's device probe).
    unsupported_reason: str = ""

    support = dataclasses.replace(_CutlassExpertsBase.support, device=_never_here(unsupported_reason),
                                  hidden_dim_multiple=1, notes="declared only: never runs here")

    def _validate_quant_config(self) -> None:
        raise NotImplementedError(f"{type(self).__name__}: {self.unsupported_reason}")

    def apply(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__}: {self.unsupported_reason}")


class CutlassExpertsFp4(_UnsupportedOnSm90):
    """vLLM's ``CutlassExpertsFp4`` (NVFP4: E2M1 + E4M3 per-16 block scales + fp32 global scale; seed 004
    ``run_cutlass_moe_fp4``). Not available: SM100-only."""

    unsupported_reason = ("CUTLASS NVFP4 grouped GEMMs need SM100 (Blackwell block-scaled tcgen05 MMA; "
                          "torch._scaled_grouped_mm's NVFP4 path is fbgemm's SM100 kernel); SM90 has no FP4 MMA, "
                          "and the cuda backend does not implement them")

    support = dataclasses.replace(
        _UnsupportedOnSm90.support, quant_schemes=frozenset({(qk.kNvfp4Static, qk.kNvfp4Dynamic)}),
        device=_never_here(unsupported_reason),
        notes="declared only (vLLM's claims kept as data): SM100-only; construction and apply raise "
              "NotImplementedError")


class CutlassExpertsMxfp4(_UnsupportedOnSm90):
    """vLLM's ``CutlassExpertsMxfp4`` (MXFP4 x MXFP4, E8M0 per-32 scales in CUTLASS's 32x4x4 swizzle; seed 004
    ``run_cutlass_moe_mxfp4``). Not available: SM100-only."""

    unsupported_reason = ("CUTLASS MXFP4 grouped GEMMs need SM100 (Blackwell block-scaled tcgen05 MMA; "
                          "torch._scaled_grouped_mm's MXFP4 path is fbgemm's SM100 kernel); SM90 has no FP4 MMA, "
                          "and the cuda backend does not implement them")

    support = dataclasses.replace(
        _UnsupportedOnSm90.support, quant_schemes=frozenset({(qk.kMxfp4Static, qk.kMxfp4Dynamic)}),
        device=_never_here(unsupported_reason),
        notes="declared only (vLLM's claims kept as data): SM100-only; construction and apply raise "
              "NotImplementedError")
