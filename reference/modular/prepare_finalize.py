"""The [Quantize-Prepare] and [Finalize] steps of the modular kernel (seed 002): the ABCs (vLLM
``fused_moe/modular_kernel.py``) and the single-process ``MoEPrepareAndFinalizeNoEP`` (vLLM
``prepare_finalize/no_dp_ep.py``). The batched single-process pair is ``reference.batched``; the pairs that
communicate are ``reference.distributed``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

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
           "MoEPrepareAndFinalizeNoEP", "AsyncMoEPrepareAndFinalizeNoEP", "NoDispatch", "apply_router_weight_to_input",
           "split_hook_receiver"]


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

    def supports_async(self) -> bool:
        """Whether this class implements ``prepare_async`` / ``finalize_async`` (vLLM 0.17.0 and 0.33.0); the
        kernel then drives those instead of ``prepare`` / ``finalize`` (and, 0.33, runs MK_INTERNAL_OVERLAPPED
        shared experts between ``finalize_async`` and its hook)."""
        return False

    def supports_dbo(self) -> bool:
        """vLLM 0.33 (semantics point ``modular.supports_dbo``): whether this class may run under dual-batch overlap.
        Defaults to ``supports_async()``; a class whose synchronous prepare/finalize do their own compute/comm
        hand-off (0.33 ``MoEPrepareAndFinalizeNaiveDPEP`` on ROCm) returns True while ``supports_async()`` stays
        False. Under 0.17 the method does not exist: DBO needs ``supports_async()``."""
        return self.supports_async()

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

    def prepare_async(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                      quant_config, defer_input_quant: bool = False):
        """``prepare`` without waiting for the other workers (vLLM ``prepare_async``, 0.17.0 and 0.33.0 alike).

        Returns:
            ``(hook, receiver)`` or ``receiver`` alone. ``hook()`` is the light "the receive is complete" step (under
            DBO another ubatch runs it, ``reference.modular.ubatching``); ``receiver()`` then returns what ``prepare``
            returns. Calling the hook (when there is one) and then the receiver equals ``prepare(...)``.

        Raises:
            NotImplementedError: the class does not support async (``supports_async()`` is False).
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement prepare_async")

    def finalize_async(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                       weight_and_reduce_impl):
        """``finalize`` without waiting (vLLM ``finalize_async``). Returns ``(hook, receiver)`` or ``receiver``;
        ``output`` is valid only after the hook (if any) and then the receiver ran: together they equal
        ``finalize(output, ...)``.

        Raises:
            NotImplementedError: the class does not support async.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement finalize_async")

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


def split_hook_receiver(ret) -> tuple[Callable[[], object] | None, Callable[[], object]]:
    """vLLM's unpacking of an async prepare/finalize result: ``(hook, receiver)`` or ``(None, receiver)``.

    Raises:
        TypeError: neither a pair of callables nor a callable.
    """
    hook, receiver = ret if isinstance(ret, tuple) else (None, ret)
    if not callable(receiver) or (hook is not None and not callable(hook)):
        raise TypeError(f"an async prepare/finalize returns (hook, receiver) or receiver, got {type(ret).__name__}")
    return hook, receiver


class AsyncMoEPrepareAndFinalizeNoEP(MoEPrepareAndFinalizeNoEP):
    """``MoEPrepareAndFinalizeNoEP`` with vLLM's async protocol (the reference of ``prepare_async`` /
    ``finalize_async``; the shape of ``prepare_finalize/deepep_ll.py``'s, without communication).

    ``prepare_async`` returns ``(hook, receiver)`` (``return_hook=True``) or a bare receiver. The hook does the
    work (the stand-in for the receive completing); a receiver called before its hook raises RuntimeError, as reading
    an all-to-all's receive buffer early would return garbage; each hook and receiver runs once. ``finalize_async``
    first runs a recv hook another ubatch left in this one's context (``dbo_maybe_run_recv_hook``, as DeepEP-LL's
    ``_finalize``), then returns the same pair for the weight-and-reduce into ``output``.

    ``events`` (a list, optional) records ``("prepare_hook" | "prepare_receiver" | "finalize_hook" |
    "finalize_receiver", ubatch id)`` in call order, for tests of who ran what when.
    """

    def __init__(self, return_hook: bool = True, events: list | None = None):
        self.return_hook = return_hook
        self.events = events

    def supports_async(self) -> bool:
        return True

    def _log(self, what: str) -> None:
        if self.events is not None:
            from reference.modular.ubatching import dbo_current_ubatch_id

            self.events.append((what, dbo_current_ubatch_id()))

    def _pair(self, name: str, work: Callable[[], object]):
        state: dict = {}

        def hook():
            if "done" in state:
                raise RuntimeError(f"{name} hook called twice")
            self._log(f"{name}_hook")
            state["result"] = work()
            state["done"] = True

        def receiver():
            if not self.return_hook and "done" not in state:  # receiver-only form: the receiver waits itself
                state["result"] = work()
                state["done"] = True
            if "done" not in state:
                raise RuntimeError(f"{name} receiver called before its hook: the receive is not complete")
            if state.get("received"):
                raise RuntimeError(f"{name} receiver called twice")
            state["received"] = True
            self._log(f"{name}_receiver")
            return state["result"]

        return (hook, receiver) if self.return_hook else receiver

    def prepare_async(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                      quant_config, defer_input_quant: bool = False):
        return self._pair("prepare", lambda: MoEPrepareAndFinalizeNoEP.prepare(
            self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input, quant_config,
            defer_input_quant))

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant_config, defer_input_quant=False):
        hook, receiver = split_hook_receiver(self.prepare_async(
            a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input, quant_config,
            defer_input_quant))
        if hook is not None:
            hook()
        return receiver()

    def finalize_async(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                       weight_and_reduce_impl):
        from reference.modular.ubatching import dbo_maybe_run_recv_hook

        dbo_maybe_run_recv_hook()
        return self._pair("finalize", lambda: MoEPrepareAndFinalizeNoEP.finalize(
            self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
            weight_and_reduce_impl))

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl):
        hook, receiver = split_hook_receiver(self.finalize_async(
            output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input, weight_and_reduce_impl))
        if hook is not None:
            hook()
        receiver()
