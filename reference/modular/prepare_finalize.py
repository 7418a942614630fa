"""The [Quantize-Prepare] and [Finalize] steps of the modular kernel (seed 002): the ABCs (vLLM
``fused_moe/modular_kernel.py``) and the single-process ``MoEPrepareAndFinalizeNoEP`` (vLLM
``prepare_finalize/no_dp_ep.py``). The batched single-process pair is ``reference.batched``; the pairs that
communicate are ``reference.distributed``."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from reference.config import FusedMoEQuantConfig
from reference.modular.experts_base import ExpertTokensMetadata, FusedMoEActivationFormat, FusedMoEExperts
from reference.modular.topk_weight_and_reduce import (
    TopKWeightAndReduce,
    TopKWeightAndReduceContiguous,
    resolve_delegate,
)
from reference.quant.moe import moe_kernel_quantize_input

__all__ = ["FusedMoEPrepareAndFinalize", "FusedMoEPrepareAndFinalizeModular", "FusedMoEPrepareAndFinalizeMonolithic",
           "MoEPrepareAndFinalizeNoEP", "NoDispatch", "apply_router_weight_to_input"]


class FusedMoEPrepareAndFinalize(ABC):
    """Base of the [Quantize-Prepare] and [Finalize] steps (seed 002)."""

    def post_init_setup(self, fused_experts: FusedMoEExperts) -> None:
        return None

    @property
    @abstractmethod
    def activation_format(self) -> FusedMoEActivationFormat:
        raise NotImplementedError

    @abstractmethod
    def topk_indices_dtype(self) -> torch.dtype | None:
        raise NotImplementedError

    @abstractmethod
    def max_num_tokens_per_rank(self) -> int | None:
        raise NotImplementedError

    @abstractmethod
    def num_dispatchers(self) -> int:
        raise NotImplementedError

    @abstractmethod
    def output_is_reduced(self) -> bool:
        raise NotImplementedError

    def allocate_fused_expert_output(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                                     weight_and_reduce_impl: TopKWeightAndReduce) -> torch.Tensor | None:
        """vLLM 0.33: optionally provide the experts' exact output buffer (e.g. the combine input of a naive DP/EP
        prepare/finalize); None lets the kernel allocate it. A returned tensor must have ``shape`` and ``dtype``,
        live on ``device`` and be contiguous (the 0.33 kernel raises ValueError otherwise), and finalize must keep
        its identity. Not called under 0.17."""
        return None

    def supports_deferred_moe_finalize(self) -> bool:
        """vLLM 0.33: whether ``finalize`` may be skipped for a consumer that takes an ``UnfinalizedMoEOutput``:
        only if everything finalize does (the top-k reduction, any combine) is work the consumer takes over."""
        return False


class FusedMoEPrepareAndFinalizeModular(FusedMoEPrepareAndFinalize):
    """Prepare/finalize on topk ids and weights."""

    @abstractmethod
    def prepare(
        self,
        a1: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        num_experts: int,
        expert_map: torch.Tensor | None,
        apply_router_weight_on_input: bool,
        quant_config: FusedMoEQuantConfig,
        defer_input_quant: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, ExpertTokensMetadata | None, torch.Tensor | None, torch.Tensor | None]:
        """Returns ``(a1q, a1q_scale, expert_tokens_meta, dispatched topk_ids or None, dispatched weights or None)``."""
        raise NotImplementedError

    def supports_async(self) -> bool:
        return False

    @abstractmethod
    def finalize(
        self,
        output: torch.Tensor,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        weight_and_reduce_impl: TopKWeightAndReduce,
    ) -> None:
        raise NotImplementedError


class FusedMoEPrepareAndFinalizeMonolithic(FusedMoEPrepareAndFinalize):
    """Prepare/finalize for monolithic experts (router logits in)."""

    @abstractmethod
    def prepare(self, a1, router_logits, quant_config, defer_input_quant=False):
        raise NotImplementedError

    @abstractmethod
    def finalize(self, fused_expert_output: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def apply_router_weight_to_input(a1: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """The router weight applied to the input (``apply_router_weight_on_input``): ``a1 (M, K) * w (M, 1)`` in a1's
    dtype (vLLM rounds the weight to a1's dtype first, then multiplies once).

    Raises:
        ValueError: ``topk_weights`` is not ``(M, 1)`` (only defined for topk == 1).
    """
    if topk_weights.dim() != 2 or topk_weights.size(1) != 1:
        raise ValueError(
            f"apply_router_weight_on_input is only supported for topk == 1, got topk_weights {tuple(topk_weights.shape)}"
        )
    return a1 * topk_weights.to(a1.dtype)


class NoDispatch:
    """What a prepare/finalize without dispatch answers (mixed in before the ABC, single process, Standard
    format): no index dtype preference, no per-rank token cap, one dispatcher, an unreduced output."""

    @property
    def activation_format(self) -> FusedMoEActivationFormat:
        return FusedMoEActivationFormat.Standard

    def topk_indices_dtype(self):
        return None

    def max_num_tokens_per_rank(self):
        return None

    def num_dispatchers(self) -> int:
        return 1

    def output_is_reduced(self) -> bool:
        return False


class MoEPrepareAndFinalizeNoEP(NoDispatch, FusedMoEPrepareAndFinalizeModular):
    """No dispatch: optionally apply the router weight on the input (topk == 1), quantize a1, and in finalize run
    the experts' ``TopKWeightAndReduce`` (``Delegate`` -> ``Contiguous``). Mirrors vLLM ``MoEPrepareAndFinalizeNoEP``.
    """

    def supports_deferred_moe_finalize(self) -> bool:
        # finalize here is the top-k weight-and-reduce and nothing else: exactly what a deferring consumer takes
        # over (vLLM 0.33 MoEPrepareAndFinalizeNoDPEPModular).
        return True

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant_config, defer_input_quant=False):
        if apply_router_weight_on_input:
            a1 = apply_router_weight_to_input(a1, topk_weights)
        if defer_input_quant:
            return a1, None, None, None, None
        # The activation quantizers (vLLM's custom ops) need contiguous rows; a strided view of the hidden states
        # (a slice of a larger buffer) is quantized from a contiguous copy. Unquantized inputs pass as they are.
        if quant_config.a1.dtype is not None and not a1.is_contiguous():
            a1 = a1.contiguous()
        a1q, a1q_scale = moe_kernel_quantize_input(a1, quant_config.a1_scale, quant_config, "a1")
        return a1q, a1q_scale, None, None, None

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl):
        weight_and_reduce_impl = resolve_delegate(weight_and_reduce_impl, TopKWeightAndReduceContiguous())
        weight_and_reduce_impl.apply(output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input)
