"""Deferred finalize (vLLM 0.33): the unfinalized MoE output and the weighted top-k sums that finalize it.

Mirrors ``vllm/model_executor/layers/fused_moe/moe_output.py`` (``UnfinalizedMoEOutput``, ``route_major_moe_output``,
``MoEOutput``) and ``vllm/model_executor/layers/fused_moe/moe_fused_mul_sum.py`` (``moe_fused_mul_sum``) of vLLM
0.33.0. None of it exists in vLLM 0.17: under the 0.17 semantics (``reference.semantics``) the modular kernel
refuses an unfinalized output (``reference.modular.FusedMoEKernel``).

An experts kernel that stops after GEMM2 hands back its permuted, *unweighted* GEMM2 rows, the routing weights and
the permute map; whoever takes it (a fused consumer: the shared-expert add, the all-reduce + RMSNorm) does the top-k
reduction. ``UnfinalizedMoEOutput.finalize`` defines that reduction: what the consumer must compute.

Numerics (reference): products and sums in fp32 over the top-k slots in slot order, one rounding to the output
dtype (vLLM's ``moe_fused_mul_sum`` Triton kernel accumulates ``a.to(fp32) * w.to(fp32)`` in slot order and stores
once; vLLM's fused consumers are FlashInfer kernels, not read).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["UnfinalizedMoEOutput", "route_major_moe_output", "MoEOutput", "moe_fused_mul_sum"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class UnfinalizedMoEOutput:
    """The output of an experts kernel that left the top-k reduction open (vLLM 0.33 ``UnfinalizedMoEOutput``).

    Fields:
        gemm2_permuted: ``(num_permuted_rows, hidden_dim)`` permuted, unweighted GEMM2 output, densely packed; its
            row count may exceed the routes (an autotuner-dependent padding that is never referenced).
        expert_weights: ``(num_tokens, top_k)`` routing weights (the router's dtype for modular experts; they already
            carry ``routed_scaling_factor`` where the routing method folds it in).
        expanded_idx_to_permuted_idx: ``(num_tokens, top_k)`` int32: the ``gemm2_permuted`` row of route (t, k), or
            ``-1`` when the route's expert is not local to this rank (or the slot is padding).
        route_major: row ``t * top_k + k`` holds route (t, k): the map is the identity apart from its ``-1`` slots
            and ``num_permuted_rows == num_tokens * top_k`` on every rank.
    """

    gemm2_permuted: torch.Tensor
    expert_weights: torch.Tensor
    expanded_idx_to_permuted_idx: torch.Tensor
    route_major: bool = False

    @property
    def num_tokens(self) -> int:
        return self.expanded_idx_to_permuted_idx.shape[0]

    @property
    def hidden_dim(self) -> int:
        return self.gemm2_permuted.shape[-1]

    def validate(self) -> None:
        """Check the layout contract above.

        Raises:
            ValueError: naming the field that breaks it (rank, shapes, int32 map, indices outside
                ``[-1, num_permuted_rows)``, a route-major map that is not the identity, mixed devices).
        """
        g, w, idx = self.gemm2_permuted, self.expert_weights, self.expanded_idx_to_permuted_idx
        if g.dim() != 2:
            raise ValueError(f"gemm2_permuted must be (num_permuted_rows, hidden_dim), got {tuple(g.shape)}")
        if idx.dim() != 2 or w.shape != idx.shape:
            raise ValueError(f"expert_weights {tuple(w.shape)} and expanded_idx_to_permuted_idx {tuple(idx.shape)} "
                             "must both be (num_tokens, top_k)")
        if idx.dtype != torch.int32:
            raise ValueError(f"expanded_idx_to_permuted_idx must be int32 (vLLM's permute map), got {idx.dtype}")
        if not (g.device == w.device == idx.device):
            raise ValueError("the fields of an UnfinalizedMoEOutput must share a device")
        if g.dtype not in _FLOAT_DTYPES or w.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"gemm2_permuted / expert_weights must be fp32/fp16/bf16, got {g.dtype} / {w.dtype}")
        if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= g.shape[0]):
            raise ValueError(f"expanded_idx_to_permuted_idx outside [-1, {g.shape[0]})")
        if self.route_major:
            T, k = idx.shape
            if g.shape[0] != T * k:
                raise ValueError(f"a route-major output has num_tokens * top_k = {T * k} rows, got {g.shape[0]}")
            ident = torch.arange(T * k, dtype=torch.int32, device=idx.device).view(T, k)
            if not bool(((idx == ident) | (idx == -1)).all()):
                raise ValueError("a route-major permute map must be the identity apart from its -1 slots")

    def finalize(self, output: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The top-k reduction the consumer takes over: ``out[t] = sum_k w[t, k] * gemm2_permuted[idx[t, k]]`` over
        the slots with ``idx >= 0``, in fp32 in slot order, rounded once.

        Args:
            output: optional ``(num_tokens, hidden_dim)`` destination (written in place and returned).
            dtype: output dtype when ``output`` is None (default ``gemm2_permuted.dtype``).

        Returns:
            ``(num_tokens, hidden_dim)``; a token with no local route gets a zero row.

        Raises:
            ValueError: a broken layout (``validate``) or an ``output`` of the wrong shape.
        """
        self.validate()
        T, k = self.expanded_idx_to_permuted_idx.shape
        H = self.hidden_dim
        if output is not None and tuple(output.shape) != (T, H):
            raise ValueError(f"output must be (num_tokens, hidden_dim) = {(T, H)}, got {tuple(output.shape)}")
        idx = self.expanded_idx_to_permuted_idx.long()
        acc = torch.zeros(T, H, dtype=torch.float32, device=self.gemm2_permuted.device)
        for slot in range(k):  # slot order: the order vLLM's mul-sum kernels accumulate in
            take = idx[:, slot] >= 0
            rows = self.gemm2_permuted[idx[:, slot].clamp(min=0)].float()
            w = self.expert_weights[:, slot].float().unsqueeze(1)
            acc += torch.where(take.unsqueeze(1), rows * w, torch.zeros_like(rows))
        if output is None:
            return acc.to(dtype or self.gemm2_permuted.dtype)
        output.copy_(acc)
        return output


def route_major_moe_output(
    routes: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
) -> UnfinalizedMoEOutput:
    """Wrap one-row-per-route GEMM2 output (vLLM 0.33 ``route_major_moe_output``).

    Args:
        routes: ``(num_tokens, top_k, hidden)`` or ``(num_tokens * top_k, hidden)`` unweighted GEMM2 rows.
        topk_weights: ``(num_tokens, top_k)``; topk_ids: ``(num_tokens, top_k)`` global expert ids (``-1``: padding).
        expert_map: optional ``(E,)`` global -> local (``-1``: not on this rank).

    Returns:
        A route-major ``UnfinalizedMoEOutput`` whose map is ``-1`` for remote routes and for ``-1`` slots.
        Upstream masks only ``expert_map[topk_ids] < 0`` (so a ``-1`` slot reads ``expert_map[-1]``, the last
        expert's entry, and without a map a ``-1`` slot keeps its row); the reference defines a ``-1`` slot as no
        route in every case (``reference.experts.local_expert_ids``).

    Raises:
        ValueError: shapes that do not agree, ids outside ``[-1, E)``.
    """
    if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be "
                         "(num_tokens, top_k)")
    T, k = topk_ids.shape
    if routes.numel() != T * k * routes.shape[-1]:
        raise ValueError(f"routes {tuple(routes.shape)} must hold num_tokens * top_k = {T * k} rows")
    ids = topk_ids.long()
    valid = ids >= 0
    if expert_map is not None:
        if ids.numel() and int(ids.max()) >= expert_map.numel():
            raise ValueError(f"topk_ids outside [-1, {expert_map.numel()})")
        valid &= expert_map.long()[ids.clamp(min=0)] >= 0
    idx = torch.arange(T * k, dtype=torch.int32, device=routes.device).view(T, k)
    idx = idx.masked_fill(~valid.to(routes.device), -1)
    return UnfinalizedMoEOutput(gemm2_permuted=routes.reshape(T * k, routes.shape[-1]), expert_weights=topk_weights,
                                expanded_idx_to_permuted_idx=idx, route_major=True)


@dataclass
class MoEOutput:
    """A MoE layer's output with its final reduction still open (vLLM 0.33 ``MoEOutput``): the routed output
    (finalized or not), the shared-expert output and the routed scale, for a consumer that fuses the reduction."""

    routed: torch.Tensor | UnfinalizedMoEOutput
    shared_output: torch.Tensor | None = None
    routed_scaling_factor: float = 1.0


def moe_fused_mul_sum(
    inputs: torch.Tensor,
    topk_weights: torch.Tensor,
    outputs: torch.Tensor | None = None,
    topk_ids: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    num_valid_tokens: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Weighted top-k sum of expert outputs that skips invalid and non-local slots (vLLM 0.33
    ``fused_moe/moe_fused_mul_sum.py``).

    ``outputs[t] = sum over taken slots k of inputs[t, k] * topk_weights[t, k]``, fp32 products and sum in slot order,
    rounded once to ``outputs.dtype``. A slot is taken when ``topk_ids`` is None, else when ``topk_ids[t, k] >= 0``
    and (no ``expert_map``, or ``expert_map[topk_ids[t, k]] >= 0``). Rows left **untouched** (not zeroed: the
    caller's buffer keeps what it held):

    - with ``topk_ids``: a row whose ids are all ``< 0`` (worst-case padding);
    - with ``num_valid_tokens``: rows ``t >= num_valid_tokens`` (the CUDA-graph padding rows past ``num_recv``).

    A row with some valid slots, none of them local, is written as zero.

    Args:
        inputs: ``(num_tokens, top_k, hidden)`` fp32/fp16/bf16, contiguous.
        topk_weights: ``(num_tokens, top_k)`` fp32/fp16/bf16.
        outputs: optional ``(num_tokens, hidden)`` destination; default a new tensor of ``inputs.dtype`` (whose
            untouched rows are then unspecified, as upstream's ``torch.empty``).
        topk_ids: optional ``(num_tokens, top_k)`` int32/int64 global expert ids (``-1``: a slot the GEMM skipped).
        expert_map: optional ``(E,)`` global -> local map; requires ``topk_ids``.
        num_valid_tokens: optional real token count (a 1-element tensor or an int), not tokens * top_k.

    Returns:
        ``outputs``.

    Raises:
        ValueError: what upstream asserts (ranks, dtypes, shapes, contiguity, ``expert_map`` without ``topk_ids``),
            and ids outside ``[-1, E)`` under an expert map.
    """
    if inputs.dim() != 3:
        raise ValueError(f"inputs must be (num_tokens, top_k, hidden), got {tuple(inputs.shape)}")
    if topk_weights.dim() != 2:
        raise ValueError(f"topk_weights must be (num_tokens, top_k), got {tuple(topk_weights.shape)}")
    if not inputs.is_contiguous() or not topk_weights.is_contiguous():
        raise ValueError("inputs and topk_weights must be contiguous (the kernel indexes them by stride)")
    if inputs.dtype not in _FLOAT_DTYPES or topk_weights.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"inputs / topk_weights must be fp32/fp16/bf16, got {inputs.dtype} / {topk_weights.dtype}")
    T, k, H = inputs.shape
    if outputs is None:
        outputs = torch.empty((T, H), dtype=inputs.dtype, device=inputs.device)
    if tuple(outputs.shape) != (T, H):
        raise ValueError(f"outputs must be (num_tokens, hidden) = {(T, H)}, got {tuple(outputs.shape)}")
    if tuple(topk_weights.shape) != (T, k):
        raise ValueError(f"topk_weights must be (num_tokens, top_k) = {(T, k)}, got {tuple(topk_weights.shape)}")
    if expert_map is not None and topk_ids is None:
        raise ValueError("topk_ids is required to interpret expert_map")
    take = torch.ones(T, k, dtype=torch.bool, device=inputs.device)
    write = torch.ones(T, dtype=torch.bool, device=inputs.device)
    if topk_ids is not None:
        if tuple(topk_ids.shape) != (T, k) or topk_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"topk_ids must be int32/int64 (num_tokens, top_k) = {(T, k)}, got "
                             f"{topk_ids.dtype} {tuple(topk_ids.shape)}")
        ids = topk_ids.long()
        take = ids >= 0
        write = take.any(dim=1)  # all-padding rows return before any load: left untouched
        if expert_map is not None:
            if ids.numel() and int(ids.max()) >= expert_map.numel():
                raise ValueError(f"topk_ids outside [-1, {expert_map.numel()})")
            take &= expert_map.long()[ids.clamp(min=0)] >= 0
    if num_valid_tokens is not None:
        n = int(num_valid_tokens.reshape(-1)[0]) if isinstance(num_valid_tokens, torch.Tensor) else int(num_valid_tokens)
        write &= torch.arange(T, device=inputs.device) < n
    acc = torch.zeros(T, H, dtype=torch.float32, device=inputs.device)
    for slot in range(k):  # slot order, as the kernel's static_range over top_k
        term = inputs[:, slot].float() * topk_weights[:, slot].float().unsqueeze(1)
        acc += torch.where(take[:, slot].unsqueeze(1), term, torch.zeros_like(term))
    rows = write.nonzero().squeeze(1)
    outputs[rows] = acc[rows].to(outputs.dtype)
    return outputs
