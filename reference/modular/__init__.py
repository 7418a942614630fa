"""The modular fused-MoE kernel of seed 002, in readable form.

Mirrors ``vllm/model_executor/layers/fused_moe/modular_kernel.py`` (vLLM 0.17, the version with activation
chunking) and ``prepare_finalize.py`` / ``topk_weight_and_reduce.py``. A fused MoE layer is three pluggable steps::

    [Quantize-Prepare]  FusedMoEPrepareAndFinalize.prepare   a1 -> a1q, a1q_scale (+ dispatch under EP)
    [Permute-Experts-Unpermute]  FusedMoEExpertsModular.apply  a1q -> fused_out (M, topk, K) or (M, K)
    [Finalize]          FusedMoEPrepareAndFinalize.finalize  weight + reduce (+ combine under EP) -> (M, K)

``FusedMoEKernel`` drives them, chunking the experts step over tokens (chunk size ``VLLM_FUSED_MOE_CHUNK_SIZE``,
default 16*1024; switched off by ``VLLM_ENABLE_FUSED_MOE_ACTIVATION_CHUNKING=0`` or an experts class that does not
support chunking). A backend plugs its ``FusedMoEExpertsModular`` subclass into this kernel; conformance compares the
result with ``reference.experts.fused_experts``.

Versions (``reference.semantics``; the kernel reads the version in force when it is constructed, or its
``semantics=`` argument). Under **0.17** (vLLM 0.17.0, the seeds) the kernel is as above. Under **0.33** (vLLM
0.33.0 ``modular_kernel.py``, the default):

- no chunking: one experts call over all M tokens (no chunk loop, no ``VLLM_FUSED_MOE_CHUNK_SIZE``; a ``chunk_size``
  argument raises), so a dynamic per-tensor scale of the second GEMM's input spans the whole call; no ``inplace``;
- the kernel never calls ``supports_expert_map`` (it left vLLM's base class; a few classes keep an unused
  override). The reference keeps the method for 0.17 and, under both versions, the claim as data:
  ``SupportRecord.expert_map``, from which conformance derives the EP cases;
- the output is ``(M, fused_experts.output_hidden_dim(K))`` (experts may drop a hidden padding);
  ``prepare_finalize.allocate_fused_expert_output`` may supply the experts' output buffer; when the caller's
  output has the experts' output shape the experts write into it directly;
- M == 0 returns before allocating or calling the experts (finalize still runs);
- deferred finalize: experts may return an ``UnfinalizedMoEOutput`` (``reference.moe_output``) instead of writing
  the output; the kernel passes it through when ``prepare_finalize.supports_deferred_moe_finalize()``, else raises;
  experts with a ``post_gemm2_hook`` hand it the unfinalized rows and the output to reduce into;
- shared experts are a ``reference.shared_experts.SharedExperts`` passed to ``apply``; the kernel runs them only in
  the ``MK_INTERNAL_OVERLAPPED`` order (prepare/finalize with async support) and returns the routed output alone.

Async prepare/finalize and DBO (both versions): a ``supports_async()`` prepare/finalize is driven through
``prepare_async`` / ``finalize_async`` (hook, receiver; ``AsyncMoEPrepareAndFinalizeNoEP`` is the reference's), and
under dual-batch overlap (``reference.modular.ubatching.run_ubatches``) the hook runs in the other ubatch; 0.33 adds
``supports_dbo`` (semantics point ``modular.supports_dbo``).

Not modelled: CUDA streams and events (the reference runs on one stream), all2all dispatch across real ranks (``reference.distributed`` does it over torch.distributed), the workspace manager
(buffers are allocated per call, with the same sharing rules).

The package follows vLLM's own files (``vllm/model_executor/layers/fused_moe/``):

==================================== ===========================================================================
module                               contents
==================================== ===========================================================================
``reference.modular.modular_kernel`` ``FusedMoEKernel`` (the 0.17 / 0.33 differences as strategies),
                                     ``ExpertsCall``, ``cdiv``, ``slice_scales``
``reference.modular.prepare_finalize`` the prepare/finalize ABCs and ``MoEPrepareAndFinalizeNoEP``
                                     (``prepare_finalize/no_dp_ep.py``), ``apply_router_weight_to_input``
``reference.modular.topk_weight_and_reduce`` ``TopKWeightAndReduce`` NoOP / Contiguous / NaiveBatched / Delegate
``reference.modular.experts_base``   ``ExpertTokensMetadata``, ``FusedMoEActivationFormat``, the experts ABCs
``reference.modular.support``        ``SupportRecord`` (this project's claims as data)
``reference.modular.ubatching``      DBO ubatch contexts (``vllm/v1/worker/ubatching.py``), ``run_ubatches``
``reference.modular.envs``           ``VLLM_FUSED_MOE_CHUNK_SIZE`` / ``VLLM_ENABLE_FUSED_MOE_ACTIVATION_CHUNKING``
==================================== ===========================================================================

The activation quantizer ``moe_kernel_quantize_input`` is ``reference.quant.moe`` (beside its dequantizers); the
semantics points of this component are registered in ``reference.semantics``. Every name is re-exported here.
"""

from reference.modular.envs import DEFAULT_CHUNK_SIZE, chunk_size_from_env, chunking_enabled_from_env
from reference.modular.experts_base import (
    ExpertTokensMetadata,
    FusedMoEActivationFormat,
    FusedMoEExperts,
    FusedMoEExpertsModular,
    FusedMoEExpertsMonolithic,
    layer_expert_map,
)
from reference.modular.modular_kernel import ExpertsCall, FusedMoEKernel, KernelSemantics, cdiv, slice_scales
from reference.modular.prepare_finalize import (
    FusedMoEPrepareAndFinalize,
    FusedMoEPrepareAndFinalizeModular,
    FusedMoEPrepareAndFinalizeMonolithic,
    AsyncMoEPrepareAndFinalizeNoEP,
    MoEPrepareAndFinalizeNoEP,
    NoDispatch,
    apply_router_weight_to_input,
    split_hook_receiver,
)
from reference.modular.support import ACTIVATION_PARAMS, SupportRecord
from reference.modular.topk_weight_and_reduce import (
    TopKWeightAndReduce,
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNaiveBatched,
    TopKWeightAndReduceNoOP,
    resolve_delegate,
)
from reference.moe_output import UnfinalizedMoEOutput, moe_fused_mul_sum, route_major_moe_output
from reference.quant.moe import moe_kernel_quantize_input
from reference.shared_experts import SharedExperts, SharedExpertsOrder

__all__ = [
    "ExpertTokensMetadata",
    "FusedMoEActivationFormat",
    "FusedMoEExperts",
    "SupportRecord",
    "ACTIVATION_PARAMS",
    "FusedMoEExpertsModular",
    "FusedMoEExpertsMonolithic",
    "layer_expert_map",
    "TopKWeightAndReduce",
    "TopKWeightAndReduceNoOP",
    "TopKWeightAndReduceContiguous",
    "TopKWeightAndReduceNaiveBatched",
    "TopKWeightAndReduceDelegate",
    "resolve_delegate",
    "FusedMoEPrepareAndFinalize",
    "FusedMoEPrepareAndFinalizeModular",
    "FusedMoEPrepareAndFinalizeMonolithic",
    "MoEPrepareAndFinalizeNoEP",
    "AsyncMoEPrepareAndFinalizeNoEP",
    "split_hook_receiver",
    "NoDispatch",
    "FusedMoEKernel",
    "ExpertsCall",
    "KernelSemantics",
    "moe_kernel_quantize_input",
    "apply_router_weight_to_input",
    "slice_scales",
    "DEFAULT_CHUNK_SIZE",
    "chunk_size_from_env",
    "chunking_enabled_from_env",
    "cdiv",
    "UnfinalizedMoEOutput",
    "route_major_moe_output",
    "moe_fused_mul_sum",
    "SharedExperts",
    "SharedExpertsOrder",
]
