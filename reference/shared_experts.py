"""Shared experts and their orderings relative to the routed experts (vLLM 0.33).

Mirrors ``vllm/model_executor/layers/fused_moe/runner/shared_experts.py`` (``SharedExpertsOrder``,
``SharedExperts``) and the parts of ``runner/moe_runner.py`` that schedule and combine them, vLLM 0.33.0. vLLM 0.17's
modular kernel took a plain shared-experts module and returned ``(shared_out, routed_out)``; that form stays in
``reference.modular.FusedMoEKernel`` under the 0.17 semantics.

One order is chosen per call (``SharedExperts.determine_order``) and the shared experts run exactly once, at the
call site whose order matches:

- ``MULTI_STREAM_OVERLAPPED``: the runner launches them before the gate/dispatch (``maybe_forward_async``), on an
  auxiliary stream, when the platform is CUDA-like, an aux stream exists and ``M <= threshold`` (256,
  ``VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD``);
- ``NO_OVERLAP``: the runner calls them before the modular kernel;
- ``MK_INTERNAL_OVERLAPPED``: the modular kernel calls them itself, between launching finalize and receiving it,
  when its prepare/finalize supports async (``FusedMoEKernel.can_overlap_shared_experts``).

Overlap is disabled (``NO_OVERLAP``) with fully sharded LoRA, sequence-parallel sharding, EPLB on an all2all backend
outside {allgather_reducescatter, deepep_v2, flashinfer_nvlink_one_sided}, or FlashInfer NVLink two-sided kernels.
The reference runs everything on one stream: the orders differ in *when* the shared experts run, never in what
they compute, and ``combine_shared_and_routed`` is the numerics of the final add.
"""

from __future__ import annotations

import enum
from typing import Callable

import torch

__all__ = ["SharedExpertsOrder", "SharedExperts", "combine_shared_and_routed", "EPLB_OVERLAP_SAFE_BACKENDS",
           "SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD"]

#: vLLM 0.33.0 ``envs.VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD`` default.
SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD = 256
#: All2all backends shown safe for shared-expert overlap under EPLB (``_EPLB_OVERLAP_SAFE_BACKENDS``).
EPLB_OVERLAP_SAFE_BACKENDS = ("allgather_reducescatter", "deepep_v2", "flashinfer_nvlink_one_sided")


class SharedExpertsOrder(enum.IntEnum):
    """Where the shared experts run (vLLM 0.33 ``SharedExpertsOrder``; same values)."""

    NONE = 0  # no shared experts
    NO_OVERLAP = 1  # called by the runner before the modular kernel
    MK_INTERNAL_OVERLAPPED = 2  # called by the modular kernel, overlapped with dispatch/combine (DP/EP)
    MULTI_STREAM_OVERLAPPED = 3  # launched on an aux stream before the gate / router / experts


class SharedExperts:
    """The shared-experts MLP with its ordering rule (vLLM 0.33 ``SharedExperts``).

    Args:
        layer: the shared-experts MLP, ``(M, K) -> (M, K')``.
        mk_can_overlap_shared_experts: the modular kernel's ``can_overlap_shared_experts`` (a callable, read per call).
        aux_stream: an auxiliary stream exists (CUDA-like platform, ``VLLM_DISABLE_SHARED_EXPERTS_STREAM`` unset).
        is_cuda_alike: the platform is CUDA or ROCm.
        stream_token_threshold: ``VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD`` (256).
        lora_fully_sharded, shard_sequence_parallel, enable_eplb, all2all_backend, use_fi_nvl_two_sided_kernels: the
            inputs of ``disable_overlap`` (from the vLLM config, the layer and its ``FusedMoEParallelConfig``).

    ``forward(x, order)`` runs the layer only when ``order`` is the one ``determine_order`` chooses, and stores the
    result; ``output`` returns it once. Running twice before reading, or reading before running, raises
    ``ValueError`` (vLLM asserts): the shared output must be computed exactly once per call.
    """

    def __init__(self, layer: Callable[[torch.Tensor], torch.Tensor], *,
                 mk_can_overlap_shared_experts: Callable[[], bool] = lambda: False, aux_stream: bool = False,
                 is_cuda_alike: bool = False, stream_token_threshold: int = SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD,
                 lora_fully_sharded: bool = False, shard_sequence_parallel: bool = False, enable_eplb: bool = False,
                 all2all_backend: str = "naive", use_fi_nvl_two_sided_kernels: bool = False):
        if not callable(layer):
            raise ValueError(f"layer must be callable, got {type(layer).__name__}")
        self._layer = layer
        self._mk_can_overlap = mk_can_overlap_shared_experts
        self.aux_stream = aux_stream
        self.is_cuda_alike = is_cuda_alike
        self.stream_token_threshold = stream_token_threshold
        self.lora_fully_sharded = lora_fully_sharded
        self.shard_sequence_parallel = shard_sequence_parallel
        self.enable_eplb = enable_eplb
        self.all2all_backend = all2all_backend
        self.use_fi_nvl_two_sided_kernels = use_fi_nvl_two_sided_kernels
        self._output: torch.Tensor | None = None
        self.calls: list[SharedExpertsOrder] = []  # the order of each run, for tests

    @property
    def disable_overlap(self) -> bool:
        """``_disable_shared_experts_overlap`` of vLLM 0.33."""
        if self.lora_fully_sharded or self.shard_sequence_parallel:
            return True
        return (self.enable_eplb and self.all2all_backend not in EPLB_OVERLAP_SAFE_BACKENDS) or \
            self.use_fi_nvl_two_sided_kernels

    def determine_order(self, hidden_states: torch.Tensor) -> SharedExpertsOrder:
        """The order for this call (``_determine_shared_experts_order``): NO_OVERLAP when overlap is disabled, else
        MK_INTERNAL_OVERLAPPED when the kernel can overlap, else MULTI_STREAM_OVERLAPPED when CUDA-like with an aux
        stream and ``M <= stream_token_threshold``, else NO_OVERLAP."""
        if self.disable_overlap:
            return SharedExpertsOrder.NO_OVERLAP
        if self._mk_can_overlap():
            return SharedExpertsOrder.MK_INTERNAL_OVERLAPPED
        if self.is_cuda_alike and self.aux_stream and hidden_states.shape[0] <= self.stream_token_threshold:
            return SharedExpertsOrder.MULTI_STREAM_OVERLAPPED
        return SharedExpertsOrder.NO_OVERLAP

    def _run(self, x: torch.Tensor, order: SharedExpertsOrder) -> None:
        if self._output is not None:
            raise ValueError("shared experts ran twice in one call (the previous output was never read)")
        self._output = self._layer(x)
        self.calls.append(order)

    def maybe_forward_async(self, shared_experts_input: torch.Tensor) -> bool:
        """Run now if the order is MULTI_STREAM_OVERLAPPED (vLLM enqueues on the aux stream); True if it ran."""
        if self.determine_order(shared_experts_input) != SharedExpertsOrder.MULTI_STREAM_OVERLAPPED:
            return False
        self._run(shared_experts_input, SharedExpertsOrder.MULTI_STREAM_OVERLAPPED)
        return True

    def forward(self, shared_experts_input: torch.Tensor, order: SharedExpertsOrder) -> None:
        """Run if ``order`` is this call's order; otherwise do nothing (another call site runs them)."""
        if order == self.determine_order(shared_experts_input):
            self._run(shared_experts_input, order)

    __call__ = forward

    @property
    def output(self) -> torch.Tensor:
        """The shared output of this call (consumed: a second read raises)."""
        if self._output is None:
            raise ValueError("shared experts output read before they ran (or read twice)")
        out, self._output = self._output, None
        return out


def combine_shared_and_routed(shared_output: torch.Tensor | None, routed_output: torch.Tensor,
                              routed_scaling_factor: float = 1.0) -> torch.Tensor:
    """The runner's final add (vLLM 0.33 ``_maybe_apply_routed_scale_to_output`` then ``shared + fused``).

    With ``routed_scaling_factor != 1``: the routed output is scaled in its dtype, except in fp16 with shared
    experts, where the *shared* output is divided instead (overflow protection; the decoder layer compensates).
    Then ``shared + routed`` in the outputs' dtype. Inputs are not modified (upstream scales in place).

    Raises:
        ValueError: shapes or dtypes of the two outputs differ.
    """
    if shared_output is not None and (shared_output.shape != routed_output.shape
                                      or shared_output.dtype != routed_output.dtype):
        raise ValueError(f"shared output {tuple(shared_output.shape)} {shared_output.dtype} and routed output "
                         f"{tuple(routed_output.shape)} {routed_output.dtype} must agree")
    if routed_scaling_factor != 1.0:
        if routed_output.dtype != torch.float16 or shared_output is None:
            routed_output = routed_output * routed_scaling_factor
        else:
            shared_output = shared_output * (1.0 / routed_scaling_factor)
    return routed_output if shared_output is None else shared_output + routed_output
