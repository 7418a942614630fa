"""The experts computation, written as the readable per-expert loop that every kernel must reproduce.

For each local expert ``e`` and the tokens routed to it (mirrors vLLM's ``fused_experts_impl`` in
``fused_moe/fused_moe.py`` and the test oracle ``torch_experts`` in ``tests/kernels/utils.py``)::

    a   = dequant(quant_a1(x))                       fp32 (M_e, K)        [prepare: a1 quantized per the config]
    h   = a @ dequant(w1[e]).T  (+ w1_bias[e])       fp32 accumulate -> ROUND to act dtype   (intermediate_cache1)
    g   = activation(h)                              fp32 math         -> ROUND to act dtype   (intermediate_cache2)
    g'  = dequant(quant_a2(g))                       fp32 (if a2 is quantized: dynamic per token/group)
    y   = g' @ dequant(w2[e]).T (+ w2_bias[e])       fp32 accumulate -> ROUND to act dtype   (intermediate_cache3)
    out[t] = sum_k  w[t, k] * y[t, k]               fp32 accumulate -> ROUND to act dtype once

Rounding points are exactly the four ROUND/quantize steps above; every other step is fp32. A *per-tensor* dynamic
a2 scale is taken over all routed rows of the call (vLLM quantizes ``intermediate_cache2`` at once), so under the
modular kernel's chunking each chunk has its own a2 scale; per-token and per-group scales see only their row. ``act dtype`` is the
hidden_states dtype (bf16/fp16/fp32). A kernel's fp32 accumulation order differs from ``torch.matmul``'s, so GEMM
results are compared with tolerances derived from the format (``specs/tolerances.toml``), quantizers bit-exactly.

Routes to experts not held by this rank (``expert_map[id] == -1``) contribute nothing. With
``apply_router_weight_on_input`` (topk == 1) the input is multiplied by the weight in the act dtype before
quantization, and the output sum uses weight 1.

Dequantization (``dequant`` above) multiplies each code by the scale of its group: per tensor (one scale per expert),
per token / per output channel, per 1xG group along K, or per 128x128 block; it is exact in fp32 for FP8/INT8 codes.
"""

from __future__ import annotations

import torch

from reference.activation import MoEActivation, adjust_N_for_activation, apply_moe_activation
from reference.config import FUSED_MOE_UNQUANTIZED_CONFIG, FusedMoEQuantConfig
from reference.modular import (
    ACTIVATION_PARAMS,
    ExpertTokensMetadata,
    FusedMoEActivationFormat,
    FusedMoEExpertsModular,
    SupportRecord,
    TopKWeightAndReduceContiguous,
)
from reference.quant.moe import dequant_activation, dequant_groups, dequant_weight, moe_kernel_quantize_input, \
    weight_pack_factor

__all__ = ["fused_experts", "experts_unreduced", "ReferenceExperts", "reference_support", "dequant_groups", "local_expert_ids", "check_moe_inputs"]


def local_expert_ids(topk_ids: torch.Tensor, num_local_experts: int, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Local expert index of every route, -1 where the expert is not held (or the id is out of range / -1)."""
    ids = topk_ids.long()
    if expert_map is None:
        valid = (ids >= 0) & (ids < num_local_experts)
        return torch.where(valid, ids, torch.full_like(ids, -1))
    E = expert_map.numel()
    valid = (ids >= 0) & (ids < E)
    # Never index expert_map with -1 or an out-of-range id (vLLM #48371 read expert_map[-1]).
    mapped = expert_map.long()[ids.clamp(0, E - 1)]
    return torch.where(valid, mapped, torch.full_like(ids, -1))


def check_moe_inputs(hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map=None,
                     global_num_experts=-1, quant_config: FusedMoEQuantConfig | None = None) -> None:
    """Validate the experts' operands with clear messages (shapes, dtypes, devices, id ranges).

    Raises:
        ValueError: any mismatch; the message names the tensor, what it has and what it needs.
    """
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be (M, K), got {tuple(hidden_states.shape)}")
    if w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w1/w2 must be (E, N, K) / (E, K, I), got {tuple(w1.shape)} / {tuple(w2.shape)}")
    M, K = hidden_states.shape
    qc = quant_config or FUSED_MOE_UNQUANTIZED_CONFIG
    pack1, pack2 = weight_pack_factor(qc.w1), weight_pack_factor(qc.w2)
    E_local, N, K1 = w1.shape
    K1 *= pack1
    if w2.size(0) != E_local:
        raise ValueError(f"w1 has {E_local} experts but w2 has {w2.size(0)}")
    if K1 != K or w2.size(1) != K:
        raise ValueError(f"hidden size mismatch: hidden_states K={K}, w1 K={K1}, w2 K={w2.size(1)}")
    I = adjust_N_for_activation(N, activation)
    if w2.size(2) * pack2 != I:
        raise ValueError(f"w2 must be (E, K, {I // pack2}) for {activation.name} with w1 N={N}, got {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.size(0) != M:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must be (M={M}, topk)"
        )
    if topk_ids.is_floating_point() or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if hidden_states.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"hidden_states must be bf16, fp16 or fp32 (quantization happens inside), got "
                         f"{hidden_states.dtype}")
    if qc.w1.dtype is None and (w1.dtype != hidden_states.dtype or w2.dtype != hidden_states.dtype):
        raise ValueError(f"unquantized weights must have the activations' dtype {hidden_states.dtype}, got "
                         f"w1 {w1.dtype} and w2 {w2.dtype}")
    n_ids = (global_num_experts if global_num_experts != -1 else
             expert_map.numel() if expert_map is not None else E_local)
    if topk_ids.numel() and (int(topk_ids.min()) < -1 or int(topk_ids.max()) >= n_ids):
        raise ValueError(f"topk_ids must lie in [0, {n_ids}) (or be -1 for no route); got values in "
                         f"[{int(topk_ids.min())}, {int(topk_ids.max())}]. Non-finite router logits produce such ids "
                         "(vLLM #39391): check the routing.")
    devices = {t.device for t in (hidden_states, w1, w2, topk_weights, topk_ids)}
    if len(devices) != 1:
        raise ValueError(f"all operands must be on one device, got {sorted(map(str, devices))}")
    if expert_map is not None:
        E = global_num_experts if global_num_experts != -1 else expert_map.numel()
        if expert_map.numel() != E:
            raise ValueError(f"expert_map has {expert_map.numel()} entries, expected global_num_experts={E}")


def experts_unreduced(a1q, a1q_scale, w1, w2, topk_ids, expert_map, qc, activation, act_dtype,
                       acc_dtype: torch.dtype = torch.float32, gemm=None, *, situ_beta=None,
                       situ_linear_beta=None, stages: dict | None = None) -> torch.Tensor:
    """Every route's expert output, unweighted and unreduced: the reference loop up to GEMM2 (see the module
    docstring), ``(M, topk, K)`` in ``act_dtype``, zeros for routes to experts not held here (``expert_map``).

    Args:
        a1q, a1q_scale: the quantized activations ``(M, K')`` and their scales, as ``moe_kernel_quantize_input``
            returns them for ``qc.a1`` (``K'`` = K, or K / 2 for packed FP4).
        w1: ``(E_local, N, K / pack)``; w2: ``(E_local, K, N' / pack)`` (``N'`` = N / 2 for gated activations).
        topk_ids: ``(M, topk)`` integer global expert ids (-1: no route). expert_map: int32 ``(E,)`` or None.
        qc: the ``FusedMoEQuantConfig`` (weight scales, a2 quantization, biases, gemm1 alpha/beta/limit).
        activation: the ``MoEActivation`` between the GEMMs. act_dtype: the rounding dtype of each GEMM's output.
        acc_dtype: the GEMMs' accumulation dtype: fp32 defines the reference; float64 gives the (nearly) exact
            products of the dequantized operands that ``reference.error_model`` measures accumulation errors
            against.
        gemm: ``gemm(a (R, K), w (N, K)) -> (R, N)`` replaces the matmul of both GEMMs (dequantized fp32 operands
            in, the accumulated product out): a hook for emulating a kernel's accumulator (tests/emulated_backends.py).
        situ_beta, situ_linear_beta: SITU's parameters.
        stages: a dict that receives GEMM1's rounded output (``"gemm1"``, ``(M, topk, N)``) and the activation's
            (``"activation"``, ``(M, topk, N')``) per route, zeros for routes not held here (``conformance/diagnose.py``).

    Three passes, because the requantization of a2 may need every routed row at once: a *per-tensor* dynamic a2
    scale is the amax over all routed rows of the call (one chunk of the modular kernel), as vLLM's Triton path
    quantizes ``intermediate_cache2`` in one go. Per-token and per-group scales only see their own row.

    Raises:
        NotImplementedError / ValueError: as ``moe_kernel_quantize_input`` and the dequantizers for a format the
            reference does not define or a missing scale. Operands are not validated here (``check_moe_inputs``).
    """
    M, topk = topk_ids.shape
    if gemm is None:
        def gemm(x, w):
            return x.to(acc_dtype) @ w.to(acc_dtype).T
    a = dequant_activation(a1q, a1q_scale, qc.a1)
    K = a.size(1)  # packed activations (NVFP4) hold K // 2 bytes
    local = local_expert_ids(topk_ids, w1.size(0), expert_map)
    routes = [(e, *(local == e).nonzero(as_tuple=True)) for e in range(w1.size(0))]
    routes = [(e, t, k) for e, t, k in routes if t.numel()]
    # Pass 1: GEMM1 (+ bias) rounded to the act dtype, then the activation (fp32 math, rounded once).
    g_rows = {}
    for e, t, k in routes:
        h = gemm(a[t], dequant_weight(w1, qc.w1, e))
        if qc.w1_bias is not None:
            h = h + qc.w1_bias[e].to(acc_dtype)
        h = h.to(act_dtype)
        g_rows[e] = apply_moe_activation(activation, h, alpha=qc.gemm1_alpha, beta=qc.gemm1_beta,
                                         limit=qc.gemm1_clamp_limit, situ_beta=situ_beta,
                                         situ_linear_beta=situ_linear_beta)
        if stages is not None:
            for name, val in (("gemm1", h), ("activation", g_rows[e])):
                buf = stages.setdefault(name, torch.zeros(M, topk, val.shape[1], dtype=val.dtype, device=val.device))
                buf[t, k] = val
    out = torch.zeros(M, topk, K, dtype=act_dtype, device=a1q.device)
    if not routes:
        return out
    # Pass 2: requantize a2 over all routed rows of the call, back to fp32.
    g_all = torch.cat([g_rows[e] for e, _, _ in routes])
    gq, gs = moe_kernel_quantize_input(g_all, qc.a2_scale, qc, "a2")
    g_all = dequant_activation(gq, gs, qc.a2)
    # Pass 3: GEMM2 (+ bias) rounded to the act dtype.
    start = 0
    for e, t, k in routes:
        g = g_all[start : start + t.numel()]
        start += t.numel()
        y = gemm(g, dequant_weight(w2, qc.w2, e))
        if qc.w2_bias is not None:
            y = y + qc.w2_bias[e].to(acc_dtype)
        out[t, k] = y.to(act_dtype)
    return out


def fused_experts(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: MoEActivation = MoEActivation.SILU,
    global_num_experts: int = -1,
    expert_map: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    quant_config: FusedMoEQuantConfig | None = None,
    accumulate_dtype: torch.dtype = torch.float32,
    activation_situ_beta: float | None = None,
    activation_situ_linear_beta: float | None = None,
) -> torch.Tensor:
    """The reference MoE experts: ``(M, K)`` output in ``hidden_states.dtype``.

    Args:
        hidden_states: ``(M, K)`` bf16/fp16/fp32 (unquantized; quantized here per ``quant_config.a1``).
        w1: ``(E_local, N, K)``, w2: ``(E_local, K, N // 2)`` (gated) or ``(E_local, K, N)``; unquantized or codes
            whose scales are in ``quant_config``.
        topk_weights: ``(M, topk)`` fp32; topk_ids: ``(M, topk)`` integer global expert ids.
        activation: the ``MoEActivation`` between the GEMMs (gemm1 alpha/beta/limit from the quant config).
        global_num_experts: E (-1: E_local). expert_map: int32 ``(E,)`` global -> local, -1 not held.
        apply_router_weight_on_input: multiply the input by the weight (topk must be 1).
        quant_config: ``FusedMoEQuantConfig`` (default unquantized).
        accumulate_dtype: the GEMMs' accumulation dtype. fp32 (default) *is* the reference; float64 computes the
            exact products of the dequantized operands, for measuring accumulation error
            (``reference.error_model``, ``conformance/test_accumulation.py``).
        activation_situ_beta, activation_situ_linear_beta: SITU's parameters (vLLM 0.33 ``FusedMoEConfig``).

    Raises:
        ValueError: bad shapes/dtypes/devices (``check_moe_inputs``), apply_router_weight_on_input with topk > 1.
    """
    qc = quant_config or FUSED_MOE_UNQUANTIZED_CONFIG
    check_moe_inputs(hidden_states, w1, w2, topk_weights, topk_ids, activation, expert_map, global_num_experts, qc)
    act_dtype = hidden_states.dtype
    x = hidden_states
    if apply_router_weight_on_input:
        if topk_ids.size(1) != 1:
            raise ValueError(f"apply_router_weight_on_input is only supported for topk == 1, got {topk_ids.size(1)}")
        x = x * topk_weights.to(x.dtype)
    if qc.a1.dtype is not None and not x.is_contiguous():  # as the prepare step: quantizers read contiguous rows
        x = x.contiguous()
    a1q, a1q_scale = moe_kernel_quantize_input(x, qc.a1_scale, qc, "a1")
    y = experts_unreduced(a1q, a1q_scale, w1, w2, topk_ids, expert_map, qc, activation, act_dtype,
                           accumulate_dtype, situ_beta=activation_situ_beta,
                           situ_linear_beta=activation_situ_linear_beta)
    w = torch.ones_like(topk_weights) if apply_router_weight_on_input else topk_weights
    return (y.float() * w.float().unsqueeze(-1)).sum(dim=1).to(act_dtype)


def reference_support(activation_format: FusedMoEActivationFormat, **overrides) -> SupportRecord:
    """The claims of every reference experts class: any device, every activation vLLM can apply (not the
    unprojected RELU2), every quantization scheme the loop dequantizes, every parallel config."""
    return SupportRecord(activation_format, activations=frozenset(a for a in MoEActivation if a is not MoEActivation.RELU2),
                         activation_params=ACTIVATION_PARAMS, ue8m0_scales=True,
                         notes="the reference loop (reference.experts)", **overrides)


class ReferenceExperts(FusedMoEExpertsModular):
    """The reference loop as a ``FusedMoEExpertsModular`` (Standard format), so the modular kernel itself (chunking,
    prepare/finalize, shared experts) can be tested against ``fused_experts``. Supports every activation, expert_map,
    chunking, and the quant schemes the loop dequantizes. Output: ``(M, topk, K)`` unweighted, reduced by
    ``TopKWeightAndReduceContiguous``.
    """

    support = reference_support(FusedMoEActivationFormat.Standard,
                                finalize="(M, topk, K) unweighted: TopKWeightAndReduceContiguous")

    @staticmethod
    def activation_format():
        return FusedMoEActivationFormat.Standard

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceContiguous()

    def moe_problem_size(self, a1, w1, w2, topk_ids):
        E, M, N, K, topk = super().moe_problem_size(a1, w1, w2, topk_ids)
        if self.quant_config.a1.dtype in ("nvfp4", "mxfp4"):
            K *= 2  # packed E2M1 activations: two elements per byte
        return E, M, N, K, topk

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation):
        # The loop allocates its own temporaries; workspaces are unused but sized like vLLM's Triton experts.
        return (M * topk, max(N, K)), (M * topk, adjust_N_for_activation(N, activation)), (M, topk, K)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        act_dtype = output.dtype
        y = experts_unreduced(hidden_states, a1q_scale, w1, w2, topk_ids, expert_map, self.quant_config,
                               activation, act_dtype, situ_beta=getattr(self.moe_config, "activation_situ_beta", None),
                               situ_linear_beta=getattr(self.moe_config, "activation_situ_linear_beta", None))
        output.copy_(y.view(output.shape))
