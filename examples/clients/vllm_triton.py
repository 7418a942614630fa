"""vLLM 0.33's own Triton ``fused_moe_kernel`` as an out-of-tree backend (issue 39, "client adapters").

The kernel, its launcher and its tuned configs are vLLM's, loaded from vLLM's source exactly as
``benchmarks.peer_vllm`` loads them (``peer_vllm.load``: the ``@triton.jit`` functions written verbatim to a file and
imported, the host functions executed from their AST with small stubs; vLLM itself is never imported). Where the
source comes from: ``$MOE_VLLM_SRC`` (an unpacked sdist, an sdist ``.tar.gz`` or the slice ``python -m
benchmarks.peer_vllm slice`` writes), else an installed ``vllm`` (located, not imported)::

    export MOE_VLLM_SRC=/path/to/vllm-0.33.0        # or the 1.3 MiB slice
    python -m pytest conformance --backend examples.clients.vllm_triton:backend --scheme bf16,fp8_block128
    bash tools/gpu/clients.sh OUT                    # the GPU session step (docs/clients.md)

``VllmTritonExperts.apply`` mirrors vLLM 0.33 ``fused_moe/experts/triton_moe.py::TritonExperts.apply`` (no LoRA, no
``post_gemm2_hook``) step by step:

=====================================  ===================================================================
vLLM 0.33 (``TritonExperts.apply``)      here
=====================================  ===================================================================
``try_get_optimal_moe_config``           vLLM's ``get_moe_configs`` / ``get_default_config`` (its tuned JSON
                                         tables, ``VllmTriton.config``); no ``get_config()`` override
``_prepare_expert_assignment``           vLLM's own (naive per-route blocks when ``M * topk * 4 <= E`` and no
                                         map, else ``moe_align_block_size``); ``moe_align_block_size`` itself
                                         is a CUDA op of vLLM's ``_custom_ops`` (not in the source slice):
                                         ``backends.triton.align.align_routes`` stands in (the reference's
                                         layout, which is vLLM's ``ignore_invalid_experts=True`` layout; order
                                         within an expert deterministic where vLLM's atomics are not; no host
                                         synchronization, so the call stays CUDA-graph capturable)
``invoke_fused_moe_triton_kernel`` x2    vLLM's own launcher and ``fused_moe_kernel`` (GEMM1 without router
                                         weights; GEMM2 with ``MUL_ROUTED_WEIGHT`` unless the weight was
                                         applied on the input)
``self.activation`` (``_C`` CUDA ops)    ``reference.activation.apply_moe_activation`` (the ``vllm`` profile's
                                         fused rounding: fp32 math, one rounding; csrc ``silu_and_mul`` itself
                                         rounds silu(g) first, the ``torch_native_activation`` form:
                                         ``benchmarks.vllm_ops`` builds it on a GPU machine)
``ops.silu_and_mul_per_block_quant``     (SiLU + FP8 128-blocks, a fused CUDA op) the reference activation,
                                         then the reference's 1x128 group quantizer: the unfused path vLLM
                                         takes with a clamp limit
``moe_kernel_quantize_input`` (a2)       ``reference.modular.moe_kernel_quantize_input`` (bit-exact quantizers)
``ops.moe_sum`` (pad-aware, fp32)        an fp32 sum of the route rows held here, rounded once; routes to
                                         other ranks' experts and ``-1`` slots are skipped as vLLM's pad-aware
                                         ``moe_sum`` skips them
=====================================  ===================================================================

vLLM aligns with ``ignore_invalid_experts=False`` when the second GEMM's activation scale is a dynamic per-tensor
one (``a2_scale_is_global``): its non-local routes then sit in ``-1`` blocks whose GEMM1 rows the kernel writes as
zeros, so the per-tensor amax sees zeros there. The stand-in aligner drops those routes, so here GEMM1's output is
zeroed first in that case: the same values reach the amax.

Two experts classes, because the numerics differ by scheme (``reference.profiles``):

- ``VllmTritonExperts`` (profile ``vllm``): unquantized bf16 / fp16 / fp32 and FP8 128x128 blocks
  (``kFp8Static128BlockSym x kFp8Dynamic128Sym``, fp32 scales; vLLM 0.33's Triton path takes no UE8M0 scales, so
  they are not claimed): block scales are applied per K tile in fp32, vLLM's reference rounding.
- ``VllmTritonFp8InplaceExperts`` (profile ``fp8_inplace_accumulation``, a named accuracy defect): FP8 per-tensor
  weights x dynamic / static per-tensor or dynamic per-token activations, and per-channel weights x dynamic
  per-token activations. The kernel accumulates these with ``accumulator = tl.dot(a, b, acc=accumulator)`` ("to
  enable fp8_fast_accum") and applies the scales once after the K loop: the FP8 MMA's partial is never promoted.
  The class declares that profile so its verdict reads "conforms to the in-place accumulation profile" rather
  than a failure of the vllm bound; the accumulation probe still fails it, as intended.

Both: SiLU (with a clamp limit: vLLM's ``swiglu_limit_func``) and gpt-oss's SwiGLU (alpha, limit; expert biases via
the kernel's ``B_bias``); ``expert_map`` (EP) and ``-1`` padding slots; the router weight multiplied in fp32 before
the kernel's store (``router_weight_rounding="before_store"``); chunking by the modular kernel; any M.

Availability: triton importable, a CUDA GPU of sm_80+ (FP8 claims need sm_89+), and a vLLM source that
``peer_vllm.load`` accepts; under ``TRITON_INTERPRET=1`` the backend runs on the CPU in Triton's interpreter (fp16 /
fp32 / FP8 only: the interpreter multiplies bf16 dot operands as raw bit patterns, tests/test_triton_interpret.py).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os

import torch

from backends import Backend, Unavailable, cuda_unavailable_reason, package_unavailable_reason
from reference.activation import MoEActivation, adjust_N_for_activation, apply_moe_activation
from reference.modular import (FusedMoEActivationFormat, FusedMoEExpertsModular, SupportRecord,
                               TopKWeightAndReduceNoOP, moe_kernel_quantize_input)
from reference.quant import keys as K

__all__ = ["VllmTritonExperts", "VllmTritonFp8InplaceExperts", "backend", "vllm_triton", "unavailable_reason",
           "moe_sum_pad_aware", "BF16_BLOCK_PAIRS", "FP8_INPLACE_PAIRS"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: The pairs of ``VllmTritonExperts`` (profile vllm): unquantized, FP8 128x128 blocks x 1x128 groups (fp32 scales).
BF16_BLOCK_PAIRS = frozenset({(None, None), (K.kFp8Static128BlockSym, K.kFp8Dynamic128Sym)})
#: The pairs of ``VllmTritonFp8InplaceExperts`` (profile fp8_inplace_accumulation): vLLM 0.33 ``TritonExperts``'
#: per-tensor / per-channel FP8 pairs.
FP8_INPLACE_PAIRS = frozenset({
    (K.kFp8StaticTensorSym, K.kFp8DynamicTensorSym),
    (K.kFp8StaticTensorSym, K.kFp8StaticTensorSym),
    (K.kFp8StaticTensorSym, K.kFp8DynamicTokenSym),
    (K.kFp8StaticChannelSym, K.kFp8DynamicTokenSym),
})


# ------------------------------------------------------------------------------------------------------------
# Loading vLLM's kernel (benchmarks.peer_vllm)
# ------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _load(source: str | None):
    from benchmarks import peer_vllm

    vt = peer_vllm.load(source)
    # vLLM's moe_align_block_size is a CUDA op (vllm._custom_ops), absent from the slice: peer_vllm stubs it with the
    # reference's (host-synchronizing); here the device-side aligner of backends/triton (same layout) replaces it in
    # the namespace vLLM's own _prepare_expert_assignment reads, so the whole call is capturable.
    vt.ns["moe_align_block_size"] = _align
    return vt


def vllm_triton():
    """The loaded ``benchmarks.peer_vllm.VllmTriton`` for ``$MOE_VLLM_SRC`` (else an installed vllm); cached.

    Raises:
        benchmarks.peer_vllm.PeerUnavailable: no usable source (the message says how to get one).
    """
    return _load(os.environ.get("MOE_VLLM_SRC") or None)


def _align(topk_ids, block_size, num_experts, expert_map=None, pad_sorted_ids=False, ignore_invalid_experts=False):
    """vLLM's ``moe_align_block_size`` signature, served by ``backends.triton.align.align_routes`` (no checks, no host
    synchronization). Non-local and ``-1`` routes are always dropped (vLLM's ``ignore_invalid_experts=True``
    layout); the other mode's zero rows are reproduced by ``apply`` (see the module docstring)."""
    from backends.triton.align import align_routes, max_num_tokens_padded

    ids = topk_ids.contiguous()
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.to(torch.int32)
    numel = ids.numel()
    total = max_num_tokens_padded(numel, num_experts, block_size, pad_sorted_ids) if numel else 0
    if expert_map is not None:
        emap = expert_map.to(torch.int32).contiguous()
        local = int(emap.numel())  # num_slots: an upper bound on the local ids (the map's values are < it)
        lay = align_routes(ids, block_size, local, emap, emap.numel(), total)
    else:
        lay = align_routes(ids, block_size, num_experts, None, num_experts, total)
    return lay.sorted_token_ids, lay.expert_ids, lay.num_tokens_post_padded


def unavailable_reason() -> str | None:
    """None where the adapter runs, else why not: triton missing, no CUDA GPU (sm_80+; not under
    ``TRITON_INTERPRET=1``), or no usable vLLM source (``benchmarks.peer_vllm``'s message, with what to do)."""
    reason = package_unavailable_reason("triton", "triton")
    if reason is not None:
        return reason
    if not _INTERPRET:
        reason = cuda_unavailable_reason((8, 0))
        if reason is not None:
            return Unavailable(f"{reason}; vLLM's Triton fused_moe_kernel needs a CUDA GPU (or TRITON_INTERPRET=1)",
                               reason.kind)
    from benchmarks.peer_vllm import PeerUnavailable

    try:
        vllm_triton()
    except PeerUnavailable as exc:
        return Unavailable(f"vLLM's source is needed: {exc}", "missing_package")
    return None


def _fp8_device_reason() -> str | None:
    reason = unavailable_reason()
    if reason is not None or _INTERPRET:
        return reason
    cap = torch.cuda.get_device_capability()
    if cap < (8, 9):
        return Unavailable(f"{torch.cuda.get_device_name()} is sm_{cap[0]}{cap[1]}; FP8 tl.dot needs sm_89+",
                           "capability")
    return None


def _version() -> str:
    try:
        from importlib.metadata import version as _v

        tv = _v("triton") if importlib.util.find_spec("triton") else "not installed"
    except Exception:  # pragma: no cover
        tv = "?"
    src = os.environ.get("MOE_VLLM_SRC")
    vv = "?"
    if src:
        try:
            from benchmarks.peer_vllm import find_source, version_of

            vv = version_of(find_source(src))
        except Exception:
            vv = "source unusable"
    return f"vllm {vv} fused_moe_kernel (triton {tv}{', interpreter' if _INTERPRET else ''})"


# ------------------------------------------------------------------------------------------------------------
# The experts
# ------------------------------------------------------------------------------------------------------------


def moe_sum_pad_aware(cache3: torch.Tensor, output: torch.Tensor, topk_ids: torch.Tensor,
                      expert_map: torch.Tensor | None) -> None:
    """vLLM 0.33 ``ops.moe_sum`` (csrc/moe/moe_align_sum_kernels.cu, pad-aware form): ``output (M, K) =
    R(sum_k cache3[:, k, :])`` summed in fp32, skipping slot ``k`` of token ``t`` when ``topk_ids[t, k] < 0`` or (with
    ``expert_map``) its expert is held elsewhere; those rows of ``cache3 (M, topk, K)`` are never read (they may hold
    anything, NaN included). No host synchronization."""
    ids = topk_ids.long()
    valid = ids >= 0
    if expert_map is not None:
        valid = valid & (expert_map.long()[ids.clamp(0, expert_map.numel() - 1)] >= 0)
    rows = torch.where(valid.unsqueeze(-1), cache3.float(), torch.zeros((), dtype=torch.float32,
                                                                         device=cache3.device))
    output.copy_(rows.sum(dim=1).to(output.dtype))


def _view(ws: torch.Tensor, shape) -> torch.Tensor:
    """vLLM ``_resize_cache``: the first ``prod(shape)`` elements of a workspace, viewed."""
    return ws.flatten()[: math.prod(shape)].view(*shape)


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    try:
        return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]
    except KeyError:
        raise ValueError(f"Unsupported compute_type: {dtype} (vLLM's TritonExperts takes bf16 / fp16 / fp32 "
                         "activations, or FP8 codes prepared by the prepare step)") from None


_ACTIVATIONS = frozenset({MoEActivation.SILU, MoEActivation.SWIGLUOAI})
_ACTIVATION_PARAMS = frozenset({(MoEActivation.SILU, "limit"), (MoEActivation.SWIGLUOAI, "alpha"),
                                (MoEActivation.SWIGLUOAI, "limit")})


class VllmTritonExperts(FusedMoEExpertsModular):
    """vLLM 0.33's ``TritonExperts`` (Standard format) with vLLM's own ``fused_moe_kernel``; see the module docstring
    for what is vLLM's and what stands in for its CUDA ops.

    Workspaces (vLLM's ``workspace_shapes``): ``workspace13 (M, topk, max(I, K))`` holds the activation output
    (GEMM2's unquantized input); ``workspace2 (M, topk, max(N, K))`` holds GEMM1's output, then GEMM2's per-route
    output. Output ``(M, K)``, weighted and reduced (``TopKWeightAndReduceNoOP``).

    Raises (``apply``): ValueError for shapes / dtypes vLLM asserts on; ``benchmarks.peer_vllm.PeerUnavailable`` if
    the source cannot be loaded.
    """

    support = SupportRecord(
        FusedMoEActivationFormat.Standard,
        quant_schemes=BF16_BLOCK_PAIRS,
        activations=_ACTIVATIONS,
        act_dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        no_act_and_mul=False,
        device=unavailable_reason,
        finalize="(M, K) weighted and reduced (vLLM's pad-aware moe_sum, fp32): TopKWeightAndReduceNoOP",
        router_weight_rounding="before_store",
        activation_params=_ACTIVATION_PARAMS,
        ue8m0_scales=False,
        notes="vLLM 0.33 fused_moe_kernel + tuned configs (benchmarks.peer_vllm); alignment, activation, a2 quant "
              "and moe_sum stand in for vLLM's CUDA ops",
    )

    @staticmethod
    def activation_format():
        return FusedMoEActivationFormat.Standard

    @classmethod
    def _supports_quant_scheme(cls, weight_key, activation_key) -> bool:
        if not cls.support.claims_quant(weight_key, activation_key):
            return False
        if weight_key is None or _INTERPRET:
            return True
        return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOP()

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                         activation):
        act_dim = adjust_N_for_activation(N, activation)
        return (M, topk, max(act_dim, K)), (M, topk, max(N, K)), (M, K)

    def _flags(self):
        qc = self.quant_config
        # Each class runs only the pairs it claims (the two classes split vLLM's FP8 pairs by numerics profile):
        # anything else is refused, never computed.
        if not type(self).support.claims_quant(qc.weight_key, qc.activation_key):
            raise NotImplementedError(f"{type(self).__name__}: {qc.weight_key} x {qc.activation_key} is not a "
                                      "scheme of this class")
        if qc.weight_key is None and qc.activation_key is None:
            return False, False, None
        if not qc.use_fp8_w8a8 or getattr(qc, "use_ue8m0", False):
            raise NotImplementedError(f"{type(self).__name__}: {qc.scheme_name()} is not a scheme of this class")
        return True, bool(qc.per_act_token_quant), qc.block_shape

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        qc = self.quant_config
        if activation not in _ACTIVATIONS:
            raise NotImplementedError(f"{type(self).__name__}: {activation.name} is not claimed")
        use_fp8, per_channel, block_shape = self._flags()
        # vLLM's asserts, as errors
        if hidden_states.dim() != 2 or hidden_states.size(-1) != w1.size(2):
            raise ValueError(f"Hidden size mismatch {tuple(hidden_states.shape)} vs w1 {tuple(w1.shape)}")
        if not hidden_states.is_contiguous() or w1.stride(-1) != 1 or w2.stride(-1) != 1:
            raise ValueError("hidden_states must be contiguous and w1 / w2 must have unit stride in their last dim")
        M, topk = topk_ids.shape
        E, N, _ = w1.shape
        Kdim = w2.size(1)
        if M == 0:
            return
        if global_num_experts == -1:
            global_num_experts = E
        compute_type = _tl_dtype(output.dtype)  # FP8 codes in: vLLM computes in bf16 = the output dtype here
        vt = vllm_triton()
        from benchmarks.peer_vllm import config_dtype_str

        config, _src = vt.config(tuple(w1.shape), tuple(w2.shape), topk, config_dtype_str(qc, output.dtype), M,
                                 block_shape)

        cache1 = _view(workspace2, (M, topk, N))
        act_dim = adjust_N_for_activation(N, activation)
        cache2 = _view(workspace13, (M * topk, act_dim))
        cache3 = _view(workspace2, (M, topk, Kdim))

        a2_scale_is_global = use_fp8 and a2_scale is None and block_shape is None and not per_channel
        skip_invalid = expert_map is not None and not a2_scale_is_global
        num_align_experts = E if expert_map is None else global_num_experts
        sorted_ids, expert_ids, ntpp = vt.ns["_prepare_expert_assignment"](
            topk_ids, config, M, topk, num_align_experts, expert_map, use_int8_w8a16=False, use_int4_w4a16=False,
            block_shape=block_shape, ignore_invalid_experts=skip_invalid, weights_host_resident=False)
        if a2_scale_is_global:
            cache1.zero_()  # vLLM's -1 blocks write these rows as zeros (module docstring)
        input_scale = a1q_scale if a1q_scale is not None else qc.a1_scale
        flags = dict(sorted_token_ids=sorted_ids, expert_ids=expert_ids, num_tokens_post_padded=ntpp, config=config,
                     compute_type=compute_type, use_fp8_w8a8=use_fp8, use_int8_w8a8=False, use_int8_w8a16=False,
                     use_int4_w4a16=False, per_channel_quant=per_channel, block_shape=block_shape)
        vt.launch(A=hidden_states, B=w1, C=cache1, A_scale=input_scale, B_scale=qc.w1_scale, topk_weights=None,
                  mul_routed_weight=False, top_k=topk, B_bias=qc.w1_bias, **flags)
        cache2.copy_(apply_moe_activation(activation, cache1.view(-1, N), alpha=qc.gemm1_alpha, beta=qc.gemm1_beta,
                                          limit=qc.gemm1_clamp_limit))
        a2q, a2q_scale = moe_kernel_quantize_input(cache2, a2_scale, qc, "a2")
        vt.launch(A=a2q, B=w2, C=cache3, A_scale=a2q_scale, B_scale=qc.w2_scale, topk_weights=topk_weights,
                  mul_routed_weight=not apply_router_weight_on_input, top_k=1, B_bias=qc.w2_bias, **flags)
        moe_sum_pad_aware(cache3, output, topk_ids, expert_map)


class VllmTritonFp8InplaceExperts(VllmTritonExperts):
    """The same kernel on vLLM's per-tensor / per-channel FP8 pairs, which it accumulates in place in the FP8 MMA's
    partial (``acc=accumulator``): declared with the ``fp8_inplace_accumulation`` numerics profile, a named accuracy
    defect (``reference.profiles``)."""

    numerics_profile = "fp8_inplace_accumulation"
    support = SupportRecord(
        FusedMoEActivationFormat.Standard,
        quant_schemes=FP8_INPLACE_PAIRS,
        activations=_ACTIVATIONS,
        act_dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        no_act_and_mul=False,
        device=_fp8_device_reason,
        finalize="(M, K) weighted and reduced (vLLM's pad-aware moe_sum, fp32): TopKWeightAndReduceNoOP",
        router_weight_rounding="before_store",
        activation_params=_ACTIVATION_PARAMS,
        notes="vLLM 0.33 fused_moe_kernel, FP8 per-tensor / per-channel (in-place accumulation: profile "
              "fp8_inplace_accumulation, a named defect)",
    )


backend = Backend(
    name="vllm_triton",
    version=_version(),
    experts=[VllmTritonExperts, VllmTritonFp8InplaceExperts],
    availability=unavailable_reason,
    device="cpu" if _INTERPRET else "cuda",
    profile="vllm",
    description="vLLM 0.33's Triton fused_moe_kernel with its tuned configs, loaded from vLLM's source by "
                "benchmarks.peer_vllm (examples/clients/vllm_triton.py)",
)
