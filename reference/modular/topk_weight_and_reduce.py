"""How the experts' output is weighted by the router and reduced over top-k (seed 002).

Mirrors ``vllm/model_executor/layers/fused_moe/topk_weight_and_reduce.py``: ``TopKWeightAndReduceNoOP`` (the experts
already reduced), ``...Contiguous`` (``(M, topk, K)`` rows), ``...NaiveBatched`` (batched format),
``...Delegate`` (the prepare/finalize substitutes its own).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

__all__ = ["TopKWeightAndReduce", "TopKWeightAndReduceNoOP", "TopKWeightAndReduceContiguous",
           "TopKWeightAndReduceNaiveBatched", "TopKWeightAndReduceDelegate", "resolve_delegate"]


class TopKWeightAndReduce(ABC):
    """Applies topk weights to the experts' output and/or reduces over topk (seed 002).

    Equality (``__eq__``, vLLM 0.17.0 and 0.33.0 alike): two instances are equal when they are of the same class
    (``TopKWeightAndReduceNaiveBatched``: and the same ``rank``); vLLM's modular kernel compares the experts'
    ``finalize_weight_and_reduce_impl()`` with a prepare/finalize's own this way.
    """

    def __eq__(self, other):
        return type(other) is type(self)

    def __hash__(self):
        return hash(type(self))

    @abstractmethod
    def apply(
        self,
        output: torch.Tensor | None,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
    ) -> torch.Tensor:
        raise NotImplementedError


class TopKWeightAndReduceNoOP(TopKWeightAndReduce):
    """The experts already weighted and reduced: ``fused_expert_output`` is ``(M, K)``; copy it unless aliased."""

    def apply(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input):
        if output is None:
            return fused_expert_output
        if output.data_ptr() != fused_expert_output.data_ptr() or output.shape != fused_expert_output.shape:
            if output.shape != fused_expert_output.shape:
                raise ValueError(
                    f"NoOP reduce expects the experts' output to be (M, K) = {tuple(output.shape)}, "
                    f"got {tuple(fused_expert_output.shape)}"
                )
            output.copy_(fused_expert_output)
        return output


class TopKWeightAndReduceContiguous(TopKWeightAndReduce):
    """``fused_expert_output`` is ``(M * topk, K)`` or ``(M, topk, K)`` unweighted; output = sum_k w[m,k] * out[m,k].

    Numerics (reference): products and sum in fp32, one rounding to the output dtype. vLLM multiplies in the output
    dtype (``out.mul_(w.to(out.dtype)).sum(1)``), i.e. one extra rounding per term: within the experts tolerance.
    With ``apply_router_weight_on_input`` the weights were applied to the input, so only the sum is taken.
    """

    def apply(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input):
        M, topk = topk_ids.shape
        K = fused_expert_output.shape[-1]
        x = fused_expert_output.reshape(M, topk, K).float()
        if not apply_router_weight_on_input:
            x = x * topk_weights.float().reshape(M, topk, 1)
        result = x.sum(dim=1)
        if output is None:
            return result.to(fused_expert_output.dtype)
        output.copy_(result)
        return output


class TopKWeightAndReduceNaiveBatched(TopKWeightAndReduce):
    """Batched format: ``fused_expert_output`` is ``(E_local, max_tokens, K)`` with expert e's tokens in the order the
    batched prepare placed them (increasing token index). output[t] = sum over local routes of w * row, fp32.

    ``rank`` and ``expert_map`` say which global experts are local: with a map, the global ids mapped to
    ``0..E_local-1``; without one, the rank's own range ``[rank * E_local, (rank + 1) * E_local)`` as vLLM 0.17.0
    and 0.33.0 (``first_expert = num_local_experts * self.rank``) reduce. Equal to another NaiveBatched of the same
    rank (vLLM's ``__eq__``; the map is not compared, as vLLM has none).
    """

    def __init__(self, rank: int = 0, expert_map: torch.Tensor | None = None):
        self.rank = rank
        self.expert_map = expert_map

    def __eq__(self, other):
        return isinstance(other, TopKWeightAndReduceNaiveBatched) and other.rank == self.rank

    def __hash__(self):
        return hash((TopKWeightAndReduceNaiveBatched, self.rank))

    def apply(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input):
        E_local, _, K = fused_expert_output.shape
        M = topk_ids.shape[0]
        acc = torch.zeros(M, K, dtype=torch.float32, device=fused_expert_output.device)
        for e in range(E_local):
            g = self.rank * E_local + e if self.expert_map is None else int((self.expert_map == e).nonzero()[0])
            rows = (topk_ids == g).nonzero()  # (n, 2): token, k; tokens increasing
            if rows.numel() == 0:
                continue
            t, k = rows[:, 0], rows[:, 1]
            w = torch.ones_like(t, dtype=torch.float32) if apply_router_weight_on_input else topk_weights[t, k].float()
            acc.index_add_(0, t, fused_expert_output[e, : t.numel()].float() * w[:, None])
        if output is None:
            return acc.to(fused_expert_output.dtype)
        output.copy_(acc)
        return output


class TopKWeightAndReduceDelegate(TopKWeightAndReduce):
    """Placeholder: the prepare/finalize substitutes its own reduction. Calling it is an error."""

    def apply(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input):
        raise RuntimeError("TopKWeightAndReduceDelegate must be replaced by the prepare/finalize's own reduction")


def resolve_delegate(impl: TopKWeightAndReduce, default: TopKWeightAndReduce) -> TopKWeightAndReduce:
    """The reduction a prepare/finalize runs: ``default`` (its own) where the experts delegate
    (``TopKWeightAndReduceDelegate``), else the experts' ``impl`` (vLLM's ``finalize`` implementations)."""
    return default if isinstance(impl, TopKWeightAndReduceDelegate) else impl
