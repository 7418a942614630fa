"""The batched activation format of seed 002: tokens scattered per local expert into ``(E_local, max_tokens, K)``.

Mirrors vLLM's ``BatchedPrepareAndFinalize`` (``fused_moe/fused_batched_moe.py``) and the ``NaiveBatched``
weight-and-reduce: the format DeepEP low-latency dispatch produces, and that batched kernels (batched Triton,
CUTLASS batched FP8, DeepGEMM masked) consume.

Layout: expert slot e holds, in increasing token order, every token routed to local expert e; rows past
``expert_num_tokens[e]`` are zero. Quantization is per expert buffer (a per-tensor dynamic scale is one scale per
expert; per-token and per-group scales are per row, zero for the padding rows).
"""

from __future__ import annotations

import torch

from reference.activation import MoEActivation, adjust_N_for_activation
from reference.config import FusedMoEQuantConfig
from reference.experts import experts_unreduced, local_expert_ids, reference_support
from reference.modular import (
    ExpertTokensMetadata,
    FusedMoEActivationFormat,
    FusedMoEExpertsModular,
    FusedMoEPrepareAndFinalizeModular,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNaiveBatched,
    apply_router_weight_to_input,
    moe_kernel_quantize_input,
    resolve_delegate,
)

__all__ = ["BatchedPrepareAndFinalize", "BatchedReferenceExperts", "batch_by_expert"]


def batch_by_expert(a1: torch.Tensor, topk_ids: torch.Tensor, num_local_experts: int, max_num_tokens: int,
                    expert_map: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Scatter ``a1 (M, K)`` into ``(E_local, max_num_tokens, K)`` (zeros past each expert's count).

    Returns ``(batched, expert_num_tokens int32 (E_local,), token indices per expert)``.

    Raises:
        ValueError: an expert receives more than ``max_num_tokens`` tokens (the message names the expert and count).
    """
    local = local_expert_ids(topk_ids, num_local_experts, expert_map)
    out = a1.new_zeros(num_local_experts, max_num_tokens, a1.size(1))
    counts = torch.zeros(num_local_experts, dtype=torch.int32, device=a1.device)
    token_lists = []
    for e in range(num_local_experts):
        tokens = (local == e).any(dim=1).nonzero().squeeze(1)  # increasing token order
        if tokens.numel() > max_num_tokens:
            raise ValueError(f"local expert {e} receives {tokens.numel()} tokens but max_num_tokens is "
                             f"{max_num_tokens}; raise max_num_tokens (BatchedPrepareAndFinalize)")
        out[e, : tokens.numel()] = a1[tokens]
        counts[e] = tokens.numel()
        token_lists.append(tokens)
    return out, counts, token_lists


class BatchedPrepareAndFinalize(FusedMoEPrepareAndFinalizeModular):
    """No-EP batched prepare/finalize: scatter into ``(E_local, max_num_tokens, K)``, quantize per expert,
    report ``expert_num_tokens``; finalize with ``TopKWeightAndReduceNaiveBatched``.

    Args:
        max_num_tokens: capacity per expert (rows of each slot).
        num_local_experts: E_local. num_dispatchers: ranks that dispatch to this one (1 without EP).
        rank: EP rank; without an ``expert_map`` local expert e is global ``rank * E_local + e``.
    """

    def __init__(self, max_num_tokens: int, num_local_experts: int, num_dispatchers: int = 1, rank: int = 0):
        if max_num_tokens < 1 or num_local_experts < 1 or num_dispatchers < 1:
            raise ValueError("max_num_tokens, num_local_experts and num_dispatchers must be >= 1")
        self.max_num_tokens = max_num_tokens
        self.num_local_experts = num_local_experts
        self._num_dispatchers = num_dispatchers
        self.rank = rank
        self._expert_map = None

    @property
    def activation_format(self):
        return FusedMoEActivationFormat.BatchedExperts

    def topk_indices_dtype(self):
        return None

    def max_num_tokens_per_rank(self):
        return self.max_num_tokens

    def num_dispatchers(self) -> int:
        return self._num_dispatchers

    def output_is_reduced(self) -> bool:
        return False

    def _map(self, expert_map, num_experts):
        if expert_map is not None:
            return expert_map
        if self.rank == 0 and num_experts == self.num_local_experts:
            return None
        emap = torch.full((num_experts,), -1, dtype=torch.int32)
        start = self.rank * self.num_local_experts
        emap[start : start + self.num_local_experts] = torch.arange(self.num_local_experts, dtype=torch.int32)
        return emap

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant_config: FusedMoEQuantConfig, defer_input_quant=False):
        if apply_router_weight_on_input:
            a1 = apply_router_weight_to_input(a1, topk_weights)
        emap = self._map(expert_map, num_experts)
        self._expert_map = None if emap is None else emap.to(a1.device)
        batched, counts, token_lists = batch_by_expert(a1, topk_ids, self.num_local_experts, self.max_num_tokens,
                                                       self._expert_map)
        meta = ExpertTokensMetadata(expert_num_tokens=counts, expert_num_tokens_cpu=counts.cpu())
        if defer_input_quant or quant_config.a1.dtype is None:
            return batched, None, meta, None, None
        qs, ss = [], []
        for e in range(self.num_local_experts):
            n = int(counts[e])
            q, s = moe_kernel_quantize_input(batched[e, :n], quant_config.a1_scale, quant_config, "a1")
            qfull = torch.zeros(self.max_num_tokens, *q.shape[1:], dtype=q.dtype, device=q.device)
            qfull[:n] = q
            if s is not None and s.numel() > 1 or (s is not None and quant_config.a1.shape != (-1, -1)):
                sfull = torch.zeros(self.max_num_tokens, *s.shape[1:], dtype=s.dtype, device=s.device)
                sfull[:n] = s
                s = sfull
            qs.append(qfull)
            ss.append(s if s is not None else torch.zeros(1, device=a1.device))
        return torch.stack(qs), torch.stack(ss), meta, None, None

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl):
        weight_and_reduce_impl = resolve_delegate(weight_and_reduce_impl,
                                                  TopKWeightAndReduceNaiveBatched(self.rank, self._expert_map))
        weight_and_reduce_impl.apply(output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input)


class BatchedReferenceExperts(FusedMoEExpertsModular):
    """The reference loop on the batched format: each expert slot runs its first ``expert_num_tokens[e]`` rows;
    output ``(E_local, max_tokens, K)`` unweighted (padding rows zero); reduction by the prepare/finalize
    (``Delegate`` -> ``NaiveBatched``). No chunking (the batched format has no token dimension to chunk)."""

    support = reference_support(FusedMoEActivationFormat.BatchedExperts, chunking=False,
                                finalize="(E_local, max_tokens, K) unweighted: TopKWeightAndReduceDelegate")

    @staticmethod
    def activation_format():
        return FusedMoEActivationFormat.BatchedExperts

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceDelegate()

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation):
        # Each slot receives up to max_num_tokens rows from every dispatcher (seed 002 BatchedExperts).
        E, T = local_num_experts, self.max_num_tokens * self.num_dispatchers
        return (E, T, max(N, K)), (E, T, adjust_N_for_activation(N, activation)), (E, T, K)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        if expert_tokens_meta is None:
            raise ValueError("batched experts need expert_tokens_meta (expert_num_tokens) from the prepare step")
        output.zero_()
        counts = expert_tokens_meta.expert_num_tokens
        for e in range(hidden_states.size(0)):
            n = int(counts[e])
            if n == 0:
                continue
            scale = None if a1q_scale is None else (a1q_scale[e, :n] if a1q_scale[e].numel() > 1 else a1q_scale[e])
            one_expert = torch.full((n, 1), e, dtype=torch.int64, device=hidden_states.device)
            # Run the reference loop on this slot alone (expert e only, ids already local).
            y = experts_unreduced(hidden_states[e, :n], scale, w1, w2, one_expert, None, self.quant_config,
                                   activation, output.dtype,
                                   situ_beta=getattr(self.moe_config, "activation_situ_beta", None),
                                   situ_linear_beta=getattr(self.moe_config, "activation_situ_linear_beta", None))
            output[e, :n] = y[:, 0]
