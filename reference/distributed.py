"""Prepare/finalize across processes: expert parallelism (EP) over ``torch.distributed``.

Each EP rank holds ``num_local_experts`` of the ``E`` global experts (``reference.routing.determine_expert_map``,
``"linear"`` or ``"round_robin"``) and its own tokens ``(M_r, K)`` with their routing ``topk_ids`` / ``topk_weights``
``(M_r, topk)`` over the *global* experts (-1: no route). A dispatch/combine pair must give every rank exactly the
single-process layer's output for its own tokens (``reference.experts.fused_experts`` over all E experts on the union
of all ranks' tokens), within the experts tolerance: no token lost or duplicated, the router weights applied exactly
once, quantization before or after the dispatch giving the same codes.

Three prepare/finalize pairs, each a ``reference.modular.FusedMoEPrepareAndFinalizeModular`` named after the vLLM class
whose data layout it reproduces (vLLM ``model_executor/layers/fused_moe/prepare_finalize/*.py``); the communication is
plain ``torch.distributed`` (gloo on CPU, NCCL on GPU) in place of DeepEP's / pplx's kernels:

=========================================  ==========  ===============================================================
class                                      format      dispatch / combine                 router weights applied
=========================================  ==========  ===============================================================
``MoEPrepareAndFinalizeNaiveDPEPModular``  Standard    all-gather every token / reduce-   by the experts or finalize's
  (``naive_dp_ep.py``; "AgRs")                         scatter the partial outputs        TopKWeightAndReduce, on the
                                                                                          expert side, before combine
``DeepEPHTPrepareAndFinalize``             Standard    all-to-all: each token once to     expert side, before combine
  (``deepep_ht.py``, DeepEP high-                      every rank holding one of its      (TopKWeightAndReduceContiguous
  throughput ``dispatch`` / ``combine``)               experts / send partials back, sum  or the experts' NoOP)
``DeepEPLLPrepareAndFinalize``             Batched     all-to-all: each (token, expert)   source side, in the combine
  (``deepep_ll.py``, DeepEP low-latency                route into its expert's slot       (``low_latency_combine``
  ``low_latency_dispatch`` / ``_combine``;             ``(E_local, max_num_tokens *       weights); the experts return
  pplx has the same layout)                            num_dispatchers, K)`` / return     unweighted slots (Delegate)
                                                       rows, weighted sum at the source
=========================================  ==========  ===============================================================

With ``apply_router_weight_on_input`` (topk == 1) the weight multiplies the input in ``a1``'s dtype *before*
quantization and dispatch, and every later step uses weight 1 (``apply_router_weight_on_input=True`` in finalize).

Quantization (``FusedMoEQuantConfig.a1``):

- before dispatch (default; vLLM's choice for block FP8, and DeepEP's FP8 dispatch): the source rank quantizes its
  tokens with ``moe_kernel_quantize_input``; the codes and their row-aligned scales (per token ``(M, 1)``, per 1x128
  group ``(M, K/128)``, MX / NVFP4 block scales) travel together, row by row. A static per-tensor scale is the same on
  every rank and does not travel. A *dynamic per-tensor* scale cannot be quantized before dispatch (each rank would
  use its own amax, so the receiver would get rows with different scales under one per-tensor scale): ValueError.
- after dispatch (``quantize_after_dispatch=True``; vLLM DeepEP HT's path for non-block schemes): bf16 rows travel
  and the receiving rank quantizes what it received (per slot in the batched format). Row-local formats (per token,
  per group) give the same codes either way; per-tensor dynamic scales then cover the received rows only.
- deferred (``defer_input_quant=True`` from ``FusedMoEExperts.expects_unquantized_inputs``): prepare never quantizes;
  the experts quantize the dispatched rows themselves.

Numerics of the combine (the only arithmetic the dispatch/combine adds):

- Standard formats: each rank's partial output per received token is the finalize ``TopKWeightAndReduce`` result,
  rounded to the activation dtype (as vLLM's combine receives it; experts that weight and reduce themselves, with
  ``TopKWeightAndReduceNoOP``, round it already); the source rank sums the ranks' partials in fp32 in rank order and
  rounds once. Compared with the single process: one extra rounding of each partial (<= 1/2 ulp of the partial);
  ``fused_experts_ep(combine="partials")`` computes this result in one process.
- Batched format: the experts' unweighted rows (activation dtype) return to the source rank, which computes
  ``sum_k w[t, k] * y[t, k]`` in fp32 and rounds once: the single-process reduction exactly
  (``fused_experts_ep(combine="routes")`` equals ``fused_experts``).

Layouts (within a destination, increasing source token index; sources in rank order):

- Standard dispatch returns ``(a1q (R, K), a1q_scale (R, ...) or None, ExpertTokensMetadata, topk_ids (R, topk),
  topk_weights (R, topk))``: R received tokens (naive: all ``sum_r M_r``); ``topk_ids`` are *global* ids with the
  routes to experts not held here replaced by -1 and their weights by 0 (vLLM's DeepEP HT maps DeepEP's -1 to a
  non-local expert id instead; the effect through ``expert_map`` is the same). The naive all-gather keeps every
  route (non-local ones are dropped by ``expert_map`` in the experts).
- Batched dispatch returns ``(a1q (E_local, T, K), scales (E_local, T, G) or (E_local, 1) or None,
  ExpertTokensMetadata(expert_num_tokens int32 (E_local,)), None, None)`` with ``T = max_num_tokens *
  num_dispatchers`` rows per slot (vLLM ``BatchedTritonExperts.workspace_shapes``, pplx, DeepEP LL's
  ``num_max_dispatch_tokens_per_rank * num_ranks``); rows past ``expert_num_tokens[e]`` are zero. A rank with more
  than ``max_num_tokens`` tokens raises ``DispatchCapacityError`` on *every* rank (naming the rank) before any data
  moves: tokens are never dropped silently, and no rank is left waiting in a collective.

Every rank must call ``prepare`` and ``finalize`` (they are collectives), also with no tokens of its own: drive them
with ``EPFusedMoEKernel`` (``reference.modular.FusedMoEKernel`` skips finalize when a rank has no tokens).

Construction (one keyword signature for every class, so the conformance suite can drive a backend's own classes the
same way, see ``backends.Backend.prepare_finalize``)::

    cls(group=None, *, moe_config=None, max_num_tokens=None, expert_placement_strategy="linear",
        quantize_after_dispatch=False)
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
import torch.distributed as dist

from reference.activation import MoEActivation
from reference.batched import BatchedReferenceExperts
from reference.config import FusedMoEConfig, FusedMoEQuantConfig
from reference.experts import experts_unreduced, check_moe_inputs, fused_experts
from reference.modular import (
    ExpertTokensMetadata,
    FusedMoEActivationFormat,
    ExpertsCall,
    FusedMoEKernel,
    FusedMoEPrepareAndFinalizeModular,
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNaiveBatched,
    apply_router_weight_to_input,
    moe_kernel_quantize_input,
    resolve_delegate,
)
from reference.routing import determine_expert_map
from reference.semantics import SemanticsVersion

__all__ = [
    "DispatchCapacityError",
    "expert_placement",
    "MoEPrepareAndFinalizeNaiveDPEPModular",
    "DeepEPHTPrepareAndFinalize",
    "DeepEPLLPrepareAndFinalize",
    "EPFusedMoEKernel",
    "BatchedReferenceExpertsEP",
    "REFERENCE_PREPARE_FINALIZE",
    "fused_experts_ep",
    "quantize_slots",
]


class DispatchCapacityError(ValueError):
    """A rank would dispatch more tokens than the batched format holds; raised on every rank, naming the rank."""


def expert_placement(num_experts: int, ep_size: int, strategy: str = "linear") -> tuple[torch.Tensor, torch.Tensor]:
    """``(owner, local_index)``, int64 ``(E,)`` each: the EP rank holding each global expert and its index there,
    from ``determine_expert_map`` of every rank (``ep_size == 1``: rank 0 holds expert e as local e)."""
    owner = torch.zeros(num_experts, dtype=torch.int64)
    local_index = torch.arange(num_experts, dtype=torch.int64)
    if ep_size == 1:
        return owner, local_index
    for r in range(ep_size):
        _, emap, _ = determine_expert_map(ep_size, r, num_experts, strategy)
        held = emap >= 0
        owner[held] = r
        local_index[held] = emap[held].long()
    return owner, local_index


# ------------------------------------------------------------------------------------------------------------
# Moving rows between ranks. Data moves as raw bytes (gloo has no FP8 types, and moving data must not round);
# arithmetic happens locally, in fp32.
# ------------------------------------------------------------------------------------------------------------


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``(n, ...)`` of any dtype -> ``(n, bytes_per_row)`` uint8 (a view of a contiguous copy)."""
    n, width = t.shape[0], prod(t.shape[1:])
    return t.contiguous().reshape(n, width).view(torch.uint8)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, rest: tuple[int, ...]) -> torch.Tensor:
    return b.contiguous().view(dtype).reshape(b.shape[0], *rest)


@dataclass
class _Handle:
    """What the combine needs from the dispatch of the same call (DeepEP's ``handle``)."""

    num_tokens: int  # M of this rank
    send_counts: list[int]  # rows sent to each rank
    recv_counts: list[int]  # rows received from each rank
    send_tokens: torch.Tensor | None = None  # standard all-to-all: source token of each sent row
    send_routes: torch.Tensor | None = None  # batched: (token, k) of each sent route, (R, 2)
    recv_slot: torch.Tensor | None = None  # batched: (local expert, row) of each received route, (R, 2)
    sizes: list[int] | None = None  # naive: tokens of every rank


class _EPPrepareAndFinalize(FusedMoEPrepareAndFinalizeModular):
    """Common part of the EP prepare/finalize pairs: the process group, the expert placement, the collectives.

    Args:
        group: the EP process group (None: the default group). ``torch.distributed`` must be initialized.
        moe_config: the layer (unused by the reference classes; backends' classes size buffers from it).
        max_num_tokens: per-rank dispatch capacity (batched format only; the standard formats have no bound).
        expert_placement_strategy: ``"linear"`` or ``"round_robin"`` (``determine_expert_map``); prepare checks that
            the ``expert_map`` it is given is this rank's map under it.
        quantize_after_dispatch: move unquantized rows and quantize on the receiving rank.

    Raises:
        RuntimeError: torch.distributed is not initialized.
    """

    def __init__(self, group=None, *, moe_config: FusedMoEConfig | None = None, max_num_tokens: int | None = None,
                 expert_placement_strategy: str = "linear", quantize_after_dispatch: bool = False):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"{type(self).__name__} needs torch.distributed: call init_process_group first")
        if expert_placement_strategy not in ("linear", "round_robin"):
            raise ValueError(f"unknown expert_placement_strategy {expert_placement_strategy!r}")
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.moe_config = moe_config
        self.max_num_tokens = max_num_tokens
        self.expert_placement_strategy = expert_placement_strategy
        self.quantize_after_dispatch = quantize_after_dispatch
        self._handle: _Handle | None = None

    # --- FusedMoEPrepareAndFinalize -------------------------------------------------------------------------------
    def topk_indices_dtype(self):
        return None

    def max_num_tokens_per_rank(self):
        return None

    def num_dispatchers(self) -> int:
        return self.world_size

    def output_is_reduced(self) -> bool:
        return True  # the combine sums every rank's experts into the source rank's output

    @classmethod
    def is_supported_config(cls, moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig,
                            quantize_after_dispatch: bool) -> tuple[bool, str | None]:
        """``(True, None)``, or ``(False, reason)`` for a configuration this dispatch cannot carry (the conformance
        suite skips those with the reason). The reference carries everything but a dynamic per-tensor activation
        scale quantized before dispatch."""
        if not quantize_after_dispatch and per_tensor_dynamic(quant_config):
            return False, "a dynamic per-tensor a1 scale cannot be quantized before dispatch (one scale per rank)"
        return True, None

    # --- helpers --------------------------------------------------------------------------------------------------
    def _all_gather_ints(self, values: list[int], device) -> torch.Tensor:
        """Every rank's ``values`` as int64 ``(world_size, len(values))`` (on the CPU)."""
        mine = torch.tensor(values, dtype=torch.int64, device=device)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(parts, mine, group=self.group)
        return torch.stack(parts).cpu()

    def _exchange_counts(self, send_counts: list[int], device) -> list[int]:
        """Rows each rank will send here (an all-to-all of the counts)."""
        send = torch.tensor(send_counts, dtype=torch.int64, device=device)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv.tolist()

    def _all_to_all_rows(self, t: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows of ``t`` grouped by destination (``send_counts[r]`` rows for rank r, in rank order) -> the rows sent
        here, grouped by source rank in rank order."""
        rest = tuple(t.shape[1:])
        b = _as_bytes(t)
        out = torch.empty(sum(recv_counts), b.shape[1], dtype=torch.uint8, device=t.device)
        dist.all_to_all_single(out, b, output_split_sizes=recv_counts, input_split_sizes=send_counts,
                               group=self.group)
        return _from_bytes(out, t.dtype, rest)

    def _all_gather_rows(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenation of every rank's ``t`` (``sizes[r]`` rows from rank r), in rank order."""
        rest = tuple(t.shape[1:])
        M_max = max(sizes)
        if M_max == 0:  # every rank knows every size: all skip together
            return t.new_empty((0, *rest))
        b = _as_bytes(t)
        padded = b.new_zeros((M_max, b.shape[1]))
        padded[: b.shape[0]] = b
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded, group=self.group)
        return _from_bytes(torch.cat([p[:n] for p, n in zip(parts, sizes)]), t.dtype, rest)

    def _sync(self, topk_ids: torch.Tensor, extra: list[int] | None = None) -> torch.Tensor:
        """Gather ``[M, topk, *extra]`` of every rank; raise on every rank if topk differs."""
        stats = self._all_gather_ints([topk_ids.shape[0], topk_ids.shape[1], *(extra or [])], topk_ids.device)
        if len(set(stats[:, 1].tolist())) != 1:
            raise ValueError(f"EP ranks disagree on topk: {stats[:, 1].tolist()}")
        return stats

    def _placement(self, num_experts: int, expert_map: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(owner, local_index)`` on the device, checked against this rank's ``expert_map``."""
        owner, local_index = expert_placement(num_experts, self.world_size, self.expert_placement_strategy)
        if expert_map is None:
            if self.world_size > 1:
                raise ValueError(f"EP over {self.world_size} ranks needs this rank's expert_map")
        else:
            mine = (owner == self.rank)
            emap = expert_map.long().cpu()
            if emap.numel() != num_experts or not torch.equal(emap >= 0, mine) or \
                    not torch.equal(emap[mine], local_index[mine]):
                raise ValueError(f"rank {self.rank}'s expert_map is not its {self.expert_placement_strategy!r} "
                                 f"placement of {num_experts} experts over {self.world_size} ranks "
                                 "(determine_expert_map)")
        return owner, local_index

    def _quantize_before_dispatch(self, a1: torch.Tensor, quant_config: FusedMoEQuantConfig,
                                  defer_input_quant: bool) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """``(x, scale, scale_travels)``: the rows to dispatch, their scale, and whether the scale is row-aligned
        (travels with the rows) rather than one replicated static scale."""
        if defer_input_quant or self.quantize_after_dispatch or quant_config.a1.dtype is None:
            return a1, None, False
        if per_tensor_dynamic(quant_config):
            raise ValueError(
                "a dynamic per-tensor a1 scale cannot be quantized before dispatch: each rank would use its own "
                "amax under one per-tensor scale; construct the prepare/finalize with quantize_after_dispatch=True")
        x, scale = moe_kernel_quantize_input(a1, quant_config.a1_scale, quant_config, "a1")
        if scale is None or (quant_config.a1_scale is not None and scale.numel() == 1):
            return x, scale, False  # static per-tensor: the same scale everywhere
        if scale.dim() == 0 or scale.shape[0] != a1.shape[0]:
            raise ValueError(f"activation scales {tuple(scale.shape)} are not row-aligned with {tuple(a1.shape)}; "
                             "this dispatch moves scales row by row with their codes")
        return x, scale, True

    def _rows_to_dispatch(self, a1: torch.Tensor, topk_weights: torch.Tensor, apply_router_weight_on_input: bool,
                          quant_config: FusedMoEQuantConfig,
                          defer_input_quant: bool) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """The prepare's common first step: ``a1`` weighted by the router (``apply_router_weight_on_input``, top-1),
        then ``_quantize_before_dispatch`` -> ``(x, scale, scale_travels)``."""
        if apply_router_weight_on_input:
            a1 = apply_router_weight_to_input(a1, topk_weights)
        return self._quantize_before_dispatch(a1, quant_config, defer_input_quant)

    def _quantize_after_dispatch(self, x: torch.Tensor, quant_config: FusedMoEQuantConfig,
                                 defer_input_quant: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        if defer_input_quant or not self.quantize_after_dispatch or quant_config.a1.dtype is None:
            return x, None
        return moe_kernel_quantize_input(x, quant_config.a1_scale, quant_config, "a1")

    @staticmethod
    def _reduce_local(fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                      weight_and_reduce_impl) -> torch.Tensor:
        """This rank's weighted top-k partial of the tokens it computed, before the combine (``Delegate`` ->
        ``Contiguous``)."""
        impl = resolve_delegate(weight_and_reduce_impl, TopKWeightAndReduceContiguous())
        return impl.apply(None, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input)

    def _take_handle_and_reduce_local(self, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                                      weight_and_reduce_impl) -> tuple[_Handle, torch.Tensor]:
        """The finalize's common first step: the prepare's handle and this rank's partial (``_reduce_local``)."""
        h = self._take_handle()
        return h, self._reduce_local(fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                                     weight_and_reduce_impl)

    def _take_handle(self) -> _Handle:
        if self._handle is None:
            raise RuntimeError(f"{type(self).__name__}.finalize called without a prepare on this rank")
        h, self._handle = self._handle, None
        return h


def per_tensor_dynamic(qc: FusedMoEQuantConfig) -> bool:
    """Whether ``a1`` is quantized with one dynamic scale for the whole tensor (FP8 / INT8, no static ``a1_scale``):
    such a scale spans every rank's tokens, so it must be computed before the dispatch (or all-reduced after)."""
    return (qc.a1.dtype in (torch.float8_e4m3fn, torch.int8) and qc.a1.shape in (None, (-1, -1))
            and qc.a1_scale is None)


def _sum_partials(rows: torch.Tensor, send_tokens: torch.Tensor, send_counts: list[int], M: int) -> torch.Tensor:
    """fp32 ``(M, K)``: the partial outputs returned by each rank (``rows``, in this rank's send order), summed over
    ranks in rank order (deterministic; no atomics)."""
    W, K = len(send_counts), rows.shape[-1]
    acc = torch.zeros(W, M, K, dtype=torch.float32, device=rows.device)
    start = 0
    for r, n in enumerate(send_counts):
        acc[r, send_tokens[start : start + n]] = rows[start : start + n].float()
        start += n
    return acc.sum(dim=0)


# ------------------------------------------------------------------------------------------------------------
# All-gather / reduce-scatter
# ------------------------------------------------------------------------------------------------------------


class MoEPrepareAndFinalizeNaiveDPEPModular(_EPPrepareAndFinalize):
    """Naive EP ("AgRs"): every rank sees every token (vLLM ``prepare_finalize/naive_dp_ep.py``, formerly
    ``FusedMoENaivePrepareAndFinalize``; ``EPGroup.dispatch`` / ``combine``).

    prepare: apply the router weight on the input (topk == 1), quantize (before dispatch unless after/deferred),
        all-gather the rows, their row-aligned scales, ``topk_ids`` and ``topk_weights`` of every rank (rank order):
        ``a1q (sum_r M_r, K)``. The experts run on every token; ``expert_map`` drops the routes held elsewhere.
    finalize: the experts' ``TopKWeightAndReduce`` (``Delegate`` -> ``Contiguous``) gives this rank's partial output
        ``(sum_r M_r, K)`` in the activation dtype, weighted on the expert side; the reduce-scatter sends rank s its
        rows, which it sums over ranks in fp32 (rank order) and rounds once into ``output (M_s, K)``.
    """

    @property
    def activation_format(self):
        return FusedMoEActivationFormat.Standard

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant_config, defer_input_quant=False):
        sizes = self._sync(topk_ids)[:, 0].tolist()
        self._placement(num_experts, expert_map)
        x, scale, scale_travels = self._rows_to_dispatch(a1, topk_weights, apply_router_weight_on_input, quant_config,
                                                         defer_input_quant)
        x = self._all_gather_rows(x, sizes)
        if scale_travels:
            scale = self._all_gather_rows(scale, sizes)
        ids = self._all_gather_rows(topk_ids, sizes)
        weights = self._all_gather_rows(topk_weights, sizes)
        if self.quantize_after_dispatch:
            x, scale = self._quantize_after_dispatch(x, quant_config, defer_input_quant)
        self._handle = _Handle(num_tokens=a1.shape[0], send_counts=[], recv_counts=[], sizes=sizes)
        return x, scale, None, ids, weights

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl):
        h, partial = self._take_handle_and_reduce_local(fused_expert_output, topk_weights, topk_ids,
                                                        apply_router_weight_on_input, weight_and_reduce_impl)
        # Reduce-scatter: rank s receives every rank's rows of its own tokens and sums them.
        M = h.num_tokens
        rows = self._all_to_all_rows(partial, h.sizes, [M] * self.world_size)
        summed = rows.float().reshape(self.world_size, M, partial.shape[-1]).sum(dim=0)
        output.copy_(summed)


# ------------------------------------------------------------------------------------------------------------
# All-to-all, standard format (DeepEP high-throughput)
# ------------------------------------------------------------------------------------------------------------


class DeepEPHTPrepareAndFinalize(_EPPrepareAndFinalize):
    """All-to-all in the standard format, as DeepEP's high-throughput ``dispatch`` / ``combine`` (vLLM
    ``prepare_finalize/deepep_ht.py``).

    prepare: each token goes once to every rank holding at least one of its experts (``send_counts[r]`` tokens for
        rank r, in increasing token order); with it travel its codes and row-aligned scales, its ``topk_ids`` (global
        ids; routes to experts of other ranks -1) and ``topk_weights`` (0 there). The receiver gets ``R = sum of
        recv_counts`` tokens (sources in rank order) and ``ExpertTokensMetadata`` with the routes per local expert.
    finalize: the experts' ``TopKWeightAndReduce`` (``Delegate`` -> ``Contiguous``; ``NoOP`` when the experts already
        weighted and reduced) gives the partial output ``(R, K)`` in the activation dtype, weighted on the expert
        side; the combine sends each partial back to its source token, where the ranks' partials are summed in fp32
        (rank order) and rounded once. A token with no route keeps output 0.
    """

    @property
    def activation_format(self):
        return FusedMoEActivationFormat.Standard

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant_config, defer_input_quant=False):
        M, _ = topk_ids.shape
        self._sync(topk_ids)
        owner, local_index = self._placement(num_experts, expert_map)
        owner, local_index = owner.to(a1.device), local_index.to(a1.device)
        x, scale, scale_travels = self._rows_to_dispatch(a1, topk_weights, apply_router_weight_on_input, quant_config,
                                                         defer_input_quant)

        ids = topk_ids.long()
        valid = (ids >= 0) & (ids < num_experts)
        dest = torch.where(valid, owner[ids.clamp(0, num_experts - 1)], -1)  # (M, topk) rank of each route
        per_rank = [(dest == r).any(dim=1).nonzero().squeeze(1) for r in range(self.world_size)]
        send_tokens = torch.cat(per_rank)
        send_counts = [t.numel() for t in per_rank]
        row_dest = torch.repeat_interleave(torch.arange(self.world_size, device=a1.device),
                                           torch.tensor(send_counts, device=a1.device))
        here = dest[send_tokens] == row_dest[:, None]  # (rows, topk): the routes this row serves at its destination
        row_ids = torch.where(here, topk_ids[send_tokens], torch.full_like(topk_ids[send_tokens], -1))
        row_w = torch.where(here, topk_weights[send_tokens], torch.zeros_like(topk_weights[send_tokens]))

        recv_counts = self._exchange_counts(send_counts, a1.device)
        recv_x = self._all_to_all_rows(x[send_tokens], send_counts, recv_counts)
        recv_scale = self._all_to_all_rows(scale[send_tokens], send_counts, recv_counts) if scale_travels else scale
        recv_ids = self._all_to_all_rows(row_ids, send_counts, recv_counts)
        recv_w = self._all_to_all_rows(row_w, send_counts, recv_counts)
        if self.quantize_after_dispatch:
            recv_x, recv_scale = self._quantize_after_dispatch(recv_x, quant_config, defer_input_quant)
        self._handle = _Handle(num_tokens=M, send_counts=send_counts, recv_counts=recv_counts,
                               send_tokens=send_tokens)

        num_local = int((owner == self.rank).sum())
        r_ids = recv_ids.long()
        local = local_index[r_ids.clamp(min=0)][r_ids >= 0]
        counts = torch.bincount(local, minlength=num_local).tolist()
        meta = ExpertTokensMetadata.make_from_list(counts, a1.device)
        return recv_x, recv_scale, meta, recv_ids, recv_w

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl):
        h, partial = self._take_handle_and_reduce_local(fused_expert_output, topk_weights, topk_ids,
                                                        apply_router_weight_on_input, weight_and_reduce_impl)
        back = self._all_to_all_rows(partial, h.recv_counts, h.send_counts)  # this rank's send order
        output.copy_(_sum_partials(back, h.send_tokens, h.send_counts, h.num_tokens))


# ------------------------------------------------------------------------------------------------------------
# All-to-all, batched format (DeepEP low-latency, pplx)
# ------------------------------------------------------------------------------------------------------------


class DeepEPLLPrepareAndFinalize(_EPPrepareAndFinalize):
    """All-to-all in the batched format, as DeepEP's ``low_latency_dispatch`` / ``low_latency_combine`` (vLLM
    ``prepare_finalize/deepep_ll.py``; pplx ``PplxPrepareAndFinalize`` has the same layout and bound).

    prepare: every valid (token, k) route goes to the rank holding its expert, into that expert's slot: ``a1q
        (E_local, T, K)``, ``T = max_num_tokens * num_dispatchers``, rows in (source rank, token, k) order, zero past
        ``expert_num_tokens[e]``. Scales: ``(E_local, T, G)`` for row-aligned scales (zero padding rows), ``(E_local,
        1)`` for a static per-tensor one, and after-dispatch quantization is per slot (a per-tensor dynamic scale is
        one scale per local expert, as ``reference.batched.BatchedPrepareAndFinalize``). Returns no topk ids/weights:
        the experts work on slots and return them unweighted (``TopKWeightAndReduceDelegate``).
    finalize: each slot row returns to its source rank, which computes ``output[t] = sum_k w[t, k] * y[t, k]`` in
        fp32 and rounds once (w = 1 with ``apply_router_weight_on_input``): the router weights are applied here, on
        the source side, exactly once.

    Bound: a rank may dispatch at most ``max_num_tokens`` tokens, each at most once per expert, so a slot never
    holds more than ``T`` rows. Every rank checks every rank's token count (and the routes it sends to one expert)
    before any data moves and raises ``DispatchCapacityError`` naming the rank; nothing is truncated.

    Raises:
        ValueError: ``max_num_tokens`` missing or < 1.
    """

    def __init__(self, group=None, *, moe_config=None, max_num_tokens=None, expert_placement_strategy="linear",
                 quantize_after_dispatch=False):
        super().__init__(group, moe_config=moe_config, max_num_tokens=max_num_tokens,
                         expert_placement_strategy=expert_placement_strategy,
                         quantize_after_dispatch=quantize_after_dispatch)
        if max_num_tokens is None or max_num_tokens < 1:
            raise ValueError(f"the batched dispatch needs max_num_tokens >= 1 (tokens per rank), got {max_num_tokens}")

    @property
    def activation_format(self):
        return FusedMoEActivationFormat.BatchedExperts

    def max_num_tokens_per_rank(self):
        return self.max_num_tokens

    def _check_capacity(self, stats: torch.Tensor) -> None:
        """``stats[r] = [M_r, topk, max routes from rank r to one expert]``: raise on every rank if one is over."""
        cap = self.max_num_tokens
        for r, (m, _, per_expert) in enumerate(stats.tolist()):
            if m > cap:
                raise DispatchCapacityError(
                    f"EP rank {r} dispatches {m} tokens but the batched format holds max_num_tokens={cap} per rank "
                    f"(slots of max_num_tokens * num_dispatchers = {cap * self.world_size} rows); raise "
                    "max_num_tokens or split the batch (tokens are never dropped)")
            if per_expert > cap:
                raise DispatchCapacityError(
                    f"EP rank {r} sends {per_expert} routes to one expert (an expert repeated in a token's topk_ids) "
                    f"but a slot holds max_num_tokens={cap} rows per source rank")

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant_config, defer_input_quant=False):
        M, topk = topk_ids.shape
        ids = topk_ids.long()
        valid = (ids >= 0) & (ids < num_experts)
        per_expert = torch.bincount(ids[valid], minlength=num_experts)
        stats = self._sync(topk_ids, [int(per_expert.max()) if per_expert.numel() else 0])
        self._check_capacity(stats)
        owner, local_index = self._placement(num_experts, expert_map)
        owner, local_index = owner.to(a1.device), local_index.to(a1.device)
        x, scale, scale_travels = self._rows_to_dispatch(a1, topk_weights, apply_router_weight_on_input, quant_config,
                                                         defer_input_quant)

        routes = valid.nonzero()  # (R, 2) = (token, k), row-major: increasing token, then k
        route_ids = ids[routes[:, 0], routes[:, 1]]
        dest = owner[route_ids]
        order = torch.argsort(dest, stable=True)  # grouped by destination, (token, k) order kept
        routes, dest, route_ids = routes[order], dest[order], route_ids[order]
        send_counts = torch.bincount(dest, minlength=self.world_size).tolist()
        tokens = routes[:, 0]

        recv_counts = self._exchange_counts(send_counts, a1.device)
        recv_x = self._all_to_all_rows(x[tokens], send_counts, recv_counts)
        recv_scale = self._all_to_all_rows(scale[tokens], send_counts, recv_counts) if scale_travels else None
        recv_slot = self._all_to_all_rows(local_index[route_ids], send_counts, recv_counts)  # local expert

        num_local = int((owner == self.rank).sum())
        T = self.max_num_tokens * self.world_size
        slots = x.new_zeros((num_local, T, x.shape[-1]))
        slot_scale = None
        if scale_travels:
            slot_scale = scale.new_zeros((num_local, T, *scale.shape[1:]))
        elif scale is not None:  # static per-tensor: the same scale for every slot
            slot_scale = scale.reshape(1, 1).expand(num_local, 1).contiguous()
        row = torch.empty_like(recv_slot)
        counts = []
        for e in range(num_local):
            idx = (recv_slot == e).nonzero().squeeze(1)  # received order: source rank, token, k
            n = idx.numel()
            if n > T:  # unreachable after _check_capacity; never truncate
                raise DispatchCapacityError(f"local expert {e} of rank {self.rank} receives {n} rows > {T}")
            slots[e, :n] = recv_x[idx]
            if scale_travels:
                slot_scale[e, :n] = recv_scale[idx]
            row[idx] = torch.arange(n, device=row.device)
            counts.append(n)
        if self.quantize_after_dispatch and not defer_input_quant and quant_config.a1.dtype is not None:
            slots, slot_scale = quantize_slots(slots, counts, quant_config)
        self._handle = _Handle(num_tokens=M, send_counts=send_counts, recv_counts=recv_counts, send_routes=routes,
                               recv_slot=torch.stack([recv_slot, row], dim=1))
        meta = ExpertTokensMetadata.make_from_list(counts, a1.device)
        return slots, slot_scale, meta, None, None

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl):
        h = self._take_handle()
        if not isinstance(weight_and_reduce_impl, (TopKWeightAndReduceDelegate, TopKWeightAndReduceNaiveBatched)):
            raise ValueError(
                f"the batched combine applies the router weights itself (DeepEP low_latency_combine): the experts must "
                "return unweighted slots with TopKWeightAndReduceDelegate, got "
                f"{type(weight_and_reduce_impl).__name__}")
        rows = fused_expert_output[h.recv_slot[:, 0], h.recv_slot[:, 1]]  # (R_recv, K), received order
        back = self._all_to_all_rows(rows, h.recv_counts, h.send_counts)  # (R_sent, K), this rank's send order
        M, topk = topk_ids.shape
        y = torch.zeros(M, topk, back.shape[-1], dtype=torch.float32, device=back.device)
        y[h.send_routes[:, 0], h.send_routes[:, 1]] = back.float()
        w = torch.ones_like(topk_weights, dtype=torch.float32) if apply_router_weight_on_input else topk_weights.float()
        output.copy_((y * w.unsqueeze(-1)).sum(dim=1))


def quantize_slots(slots: torch.Tensor, counts: list[int], quant_config: FusedMoEQuantConfig):
    """Quantize each slot of ``slots (E_local, T, K)`` in its first ``counts[e]`` rows as ``quant_config.a1`` says
    (``reference.batched.BatchedPrepareAndFinalize``'s rule): codes ``(E_local, T, K')`` with zero rows past the count;
    row-aligned scales padded with zero rows to ``(E_local, T, G)``, a per-tensor scale one per slot
    ``(E_local, 1)``; scales None when a1 is not quantized. Raises as ``moe_kernel_quantize_input``."""
    E, T, _ = slots.shape
    qs, ss = [], []
    for e in range(E):
        q, s = moe_kernel_quantize_input(slots[e, : counts[e]], quant_config.a1_scale, quant_config, "a1")
        qfull = torch.zeros(T, *q.shape[1:], dtype=q.dtype, device=q.device)
        qfull[: counts[e]] = q
        qs.append(qfull)
        if s is not None and (s.numel() > 1 or quant_config.a1.shape not in (None, (-1, -1))):
            sfull = torch.zeros(T, *s.shape[1:], dtype=s.dtype, device=s.device)
            sfull[: counts[e]] = s
            s = sfull
        ss.append(s.reshape(-1)[:1] if s is not None and s.dim() <= 1 else s)
    scales = None if ss and ss[0] is None else torch.stack(ss)
    return torch.stack(qs), scales


# ------------------------------------------------------------------------------------------------------------
# The kernel and the batched reference experts under EP
# ------------------------------------------------------------------------------------------------------------


class EPFusedMoEKernel(FusedMoEKernel):
    """``FusedMoEKernel`` for prepare/finalize pairs that communicate.

    Two differences from ``reference.modular.FusedMoEKernel`` (which models a single process), both as in vLLM's
    ``FusedMoEKernelModularImpl`` (seed 002):

    - ``finalize`` runs on every rank, also when this rank has no tokens (the combine is a collective: skipping it
      leaves the other ranks waiting);
    - in the batched format the experts always run on the dispatched slots: a rank with no tokens of its own still
      computes the tokens other ranks sent it (the base kernel's ``M == 0`` shortcut looks at this rank's
      ``topk_ids``).
    """

    #: The combine is a collective: a rank without tokens still finalizes (0.17 ``FinalizeWithTokens``; 0.33 always
    #: finalizes).
    finalizes_empty_batch = True

    def _fused_experts(self, call: ExpertsCall):
        if call.a1q.dim() != 3 or self.semantics >= SemanticsVersion.V0_33:
            return super()._fused_experts(call)
        # 0.17, batched format: one call over every dispatched slot, whatever this rank's own token count.
        fe = self.fused_experts
        _, T, N, K, top_k = fe.moe_problem_size(call.a1q, call.w1, call.w2, call.topk_ids)
        ws13, ws2, fused_out = self._allocate_buffers(call, M_chunk=T, M_full=T, N=N, K=K, top_k=top_k)
        call.run(fe, output=fused_out, workspace13=ws13, workspace2=ws2)
        return fused_out


class BatchedReferenceExpertsEP(BatchedReferenceExperts):
    """``reference.batched.BatchedReferenceExperts`` with vLLM's slot size under EP: ``max_num_tokens *
    num_dispatchers`` rows per expert (``BatchedTritonExperts.workspace_shapes``; the base class sizes slots by
    ``max_num_tokens`` alone, which is the same with one dispatcher)."""

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation):
        ws13, ws2, out = super().workspace_shapes(M, N, K, topk, global_num_experts, local_num_experts,
                                                  expert_tokens_meta, activation)
        T = self.max_num_tokens * self.num_dispatchers
        return (ws13[0], T, ws13[2]), (ws2[0], T, ws2[2]), (out[0], T, out[2])


#: The reference prepare/finalize classes, in the order the conformance suite runs them.
REFERENCE_PREPARE_FINALIZE = (MoEPrepareAndFinalizeNaiveDPEPModular, DeepEPHTPrepareAndFinalize,
                              DeepEPLLPrepareAndFinalize)


def fused_experts_ep(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    shards: list[tuple[torch.Tensor, torch.Tensor, FusedMoEQuantConfig, torch.Tensor | None]],
    *,
    combine: str,
    activation: MoEActivation = MoEActivation.SILU,
    global_num_experts: int = -1,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    """What an EP layer must output, computed in one process: ``(M, K)`` in ``hidden_states.dtype`` for the union of
    all ranks' tokens.

    Args:
        hidden_states, topk_weights, topk_ids: every rank's tokens, concatenated (as ``fused_experts``).
        shards: per EP rank ``(w1, w2, quant_config, expert_map)``: its local experts and their global -> local map.
        combine: ``"partials"`` (standard formats: each rank's partial output ``fused_experts(..., expert_map=its
            map)`` rounded to the activation dtype, then summed over ranks in fp32 and rounded once: what the
            all-gather / reduce-scatter and DeepEP HT pairs compute) or ``"routes"`` (batched format: every route's
            expert output from the rank holding it, ``sum_k w * y`` in fp32, rounded once: ``fused_experts`` exactly).

    The two differ by one rounding of each partial (<= 1/2 ulp of the partial), which is the only numerical effect
    of a standard-format combine. Raises ValueError for an unknown ``combine`` (and whatever ``fused_experts`` raises).
    """
    if combine == "partials":
        acc = None
        for w1, w2, qc, emap in shards:
            p = fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation=activation,
                              global_num_experts=global_num_experts, expert_map=emap,
                              apply_router_weight_on_input=apply_router_weight_on_input, quant_config=qc).float()
            acc = p if acc is None else acc + p
        return acc.to(hidden_states.dtype)
    if combine != "routes":
        raise ValueError(f"combine must be 'partials' or 'routes', got {combine!r}")
    x = hidden_states
    if apply_router_weight_on_input:
        x = apply_router_weight_to_input(x, topk_weights)
    y = None
    for w1, w2, qc, emap in shards:
        check_moe_inputs(hidden_states, w1, w2, topk_weights, topk_ids, activation, emap, global_num_experts, qc)
        a1q, a1q_scale = moe_kernel_quantize_input(x, qc.a1_scale, qc, "a1")
        part = experts_unreduced(a1q, a1q_scale, w1, w2, topk_ids, emap, qc, activation, hidden_states.dtype)
        y = part if y is None else y + part  # each route is held by exactly one rank: the others add zeros
    w = torch.ones_like(topk_weights) if apply_router_weight_on_input else topk_weights
    return (y.float() * w.float().unsqueeze(-1)).sum(dim=1).to(hidden_states.dtype)
