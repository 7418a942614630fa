"""``FusedMoEKernel``: prepare -> experts -> finalize (seed 002; vLLM ``fused_moe/modular_kernel.py``).

The kernel's body is written once; every point where vLLM 0.17 and 0.33 differ is a small strategy object (one per
semantics point of ``reference.semantics`` whose behaviour differs in code), chosen by the kernel's semantics
version at construction (``KernelSemantics.for_version``):

=============================== ============================== ===============================================
semantics point                 0.17                           0.33
=============================== ============================== ===============================================
``modular.activation_chunking`` ``ChunkedExperts`` (chunk      ``UnchunkedExperts`` (one experts call; the
                                loop, per-chunk metadata and   prepare/finalize or the caller's output may be
                                scales)                        the experts' buffer)
``modular.output_hidden_dim``   ``InputShapedOutput`` (``(M,   ``OutputHiddenDimOutput`` (``(M,
                                K)``, or hidden_states when    output_hidden_dim(K))``)
                                inplace)
``modular.supports_expert_map`` ``CheckedExpertMap``           ``UncheckedExpertMap``
``modular.empty_batch`` /       ``FinalizeWithTokens``         ``FinalizeAlways`` (an ``UnfinalizedMoEOutput``
``modular.deferred_finalize``   (skipped on an empty rank      passes through when the prepare/finalize
                                with one dispatcher)           supports it)
``modular.shared_experts_order`` ``ConstructorSharedExperts``  ``RunnerSharedExperts`` (MK_INTERNAL_OVERLAPPED
                                (``(shared, routed)``)         inside the kernel, between ``finalize_async`` and
                                                               its hook)
``modular.supports_dbo``        ``AsyncOnlyDbo`` (under DBO a  ``SupportsDbo`` (a synchronous one is allowed
                                synchronous prepare/finalize   when its ``supports_dbo()``, default
                                raises)                        ``supports_async()``)
=============================== ============================== ===============================================

Both versions drive an async prepare/finalize (``supports_async()``) the same way (``_prepare`` / ``_finalize``):
``prepare_async`` / ``finalize_async`` return ``(hook, receiver)`` or a receiver; without DBO the kernel calls the
hook and then the receiver; under DBO (``reference.modular.ubatching``) it registers the hook in the next ubatch's
context, yields, and calls the receiver when resumed (the other ubatch has run the hook by then). ``_prepare`` first
runs a hook another ubatch left in this one's context (``dbo_maybe_run_recv_hook``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Callable

import torch

from reference.activation import MoEActivation
from reference.config import FusedMoEParallelConfig
from reference.modular.envs import chunk_size_from_env
from reference.modular.experts_base import (
    ExpertTokensMetadata,
    FusedMoEExperts,
    FusedMoEExpertsModular,
    FusedMoEExpertsMonolithic,
)
from reference.modular.prepare_finalize import (
    FusedMoEPrepareAndFinalize,
    FusedMoEPrepareAndFinalizeModular,
    FusedMoEPrepareAndFinalizeMonolithic,
    split_hook_receiver,
)
from reference.modular.ubatching import dbo_enabled, dbo_maybe_run_recv_hook, dbo_register_recv_hook, dbo_yield
from reference.moe_output import UnfinalizedMoEOutput
from reference.semantics import SemanticsError, SemanticsVersion, resolve_semantics
from reference.shared_experts import SharedExperts, SharedExpertsOrder

__all__ = ["FusedMoEKernel", "ExpertsCall", "KernelSemantics", "cdiv", "slice_scales"]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (vLLM ``cdiv``)."""
    return -(a // -b)


def slice_scales(scales: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    """A token chunk's activation scales (vLLM ``_slice_scales``): per-token / per-group scales ``(M, ...)`` follow
    the rows ``[start, end)``; a single (per-tensor) scale, or None, is shared by every chunk."""
    if scales is None or scales.numel() == 1:
        return scales
    return scales[start:end]


def _resize_cache(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A view of the first ``prod(shape)`` elements of workspace ``x`` with ``shape`` (vLLM ``_resize_cache``)."""
    n = prod(shape)
    if n > x.numel():
        raise ValueError(f"workspace of {x.numel()} elements is too small for {shape}")
    return x.flatten()[:n].view(*shape)


@dataclass
class ExpertsCall:
    """The operands of one experts step after prepare (what vLLM's ``_fused_experts`` receives).

    ``a1q``: ``(M, K')`` (standard) or ``(E_local, max_tokens, K')`` (batched), quantized as the experts' quant
    config says (``K'`` < K for packed formats); ``a1q_scale`` its scales or None; ``topk_weights`` / ``topk_ids``
    ``(M, topk)`` after dispatch; ``in_dtype`` the hidden states' dtype (the output's); ``output``: 0.33 only, the
    kernel's output, which the experts write directly when it has their output's shape.
    """

    in_dtype: torch.dtype
    a1q: torch.Tensor
    a1q_scale: torch.Tensor | None
    w1: torch.Tensor
    w2: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    activation: MoEActivation
    global_num_experts: int
    local_num_experts: int
    expert_map: torch.Tensor | None
    apply_router_weight_on_input: bool
    expert_tokens_meta: ExpertTokensMetadata | None
    output: torch.Tensor | None = field(default=None)

    def run(self, fe: FusedMoEExpertsModular, *, output, workspace13, workspace2, rows: slice | None = None,
            expert_tokens_meta: ExpertTokensMetadata | None = None, a2_scale=None, whole_scales: bool = True):
        """``fe.apply`` on this call's tokens (``rows`` of them when chunking: ids, weights and per-token scales
        sliced alike)."""
        if rows is None:
            return fe.apply(
                output=output, hidden_states=self.a1q, w1=self.w1, w2=self.w2, topk_weights=self.topk_weights,
                topk_ids=self.topk_ids, activation=self.activation, global_num_experts=self.global_num_experts,
                expert_map=self.expert_map, a1q_scale=self.a1q_scale, a2_scale=fe.a2_scale, workspace13=workspace13,
                workspace2=workspace2, expert_tokens_meta=self.expert_tokens_meta,
                apply_router_weight_on_input=self.apply_router_weight_on_input)
        s, e = rows.start, rows.stop
        return fe.apply(
            output=output, hidden_states=self.a1q[s:e], w1=self.w1, w2=self.w2, topk_weights=self.topk_weights[s:e],
            topk_ids=self.topk_ids[s:e], activation=self.activation, global_num_experts=self.global_num_experts,
            expert_map=self.expert_map, a1q_scale=slice_scales(self.a1q_scale, s, e),
            a2_scale=slice_scales(fe.a2_scale, s, e), workspace13=workspace13, workspace2=workspace2,
            expert_tokens_meta=expert_tokens_meta, apply_router_weight_on_input=self.apply_router_weight_on_input)


# ------------------------------------------------------------------------------------------------------------
# modular.activation_chunking: the experts step
# ------------------------------------------------------------------------------------------------------------


class ChunkedExperts:
    """0.17: the experts run over chunks of ``chunk_size`` tokens (when the experts enable chunking), with per-chunk
    ``ExpertTokensMetadata`` and scales; workspaces sized by the chunk, the output by all tokens."""

    def __init__(self, chunk_size: int):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.chunk_size = chunk_size

    def chunk_info(self, fe: FusedMoEExperts, M: int) -> tuple[int, int]:
        chunk = max(1, min(M, self.chunk_size) if fe.enable_chunking() else M)
        return cdiv(M, chunk), chunk

    def run(self, kernel: "FusedMoEKernel", call: ExpertsCall):
        fe = kernel.fused_experts
        _, M_full, N, K, top_k = fe.moe_problem_size(call.a1q, call.w1, call.w2, call.topk_ids)
        if call.a1q.dim() == 2 and call.a1q.size(0) == 0:  # batched slots may hold other ranks' tokens
            M_full = 0
        num_chunks, CHUNK_SIZE = kernel._chunk_info(M_full)
        if M_full == 0:
            return torch.empty(call.a1q.shape[:-1] + (K,), dtype=call.in_dtype, device=call.a1q.device)
        ws13, ws2, fused_out = kernel._allocate_buffers(call, M_chunk=CHUNK_SIZE, M_full=M_full, N=N, K=K,
                                                        top_k=top_k)
        for chunk_idx in range(num_chunks):
            if num_chunks == 1:
                s, e = 0, call.a1q.size(0)  # batched format does not keep M in dim 0
            else:
                s = chunk_idx * CHUNK_SIZE
                e = min(s + CHUNK_SIZE, M_full)
            c_meta = kernel._slice_expert_tokens_metadata(num_chunks, call.expert_tokens_meta, call.topk_ids[s:e],
                                                          call.local_num_experts, call.expert_map)
            c_out = kernel._slice_output_tensor(fused_out, chunk_idx, num_chunks, CHUNK_SIZE, M_full)
            ret = call.run(fe, output=c_out, workspace13=ws13, workspace2=ws2, rows=slice(s, e),
                           expert_tokens_meta=c_meta)
            if isinstance(ret, UnfinalizedMoEOutput):
                raise SemanticsError(f"{type(fe).__name__}.apply returned an UnfinalizedMoEOutput: deferred finalize "
                                     "is vLLM 0.33 semantics (fused_moe/moe_output.py); the 0.17 kernel needs the "
                                     "experts to write their output")
        return fused_out


class UnchunkedExperts:
    """0.33: one experts call over every token (a dynamic per-tensor scale of GEMM2's input is the amax over the
    whole call); M == 0 returns before allocating or calling the experts; the experts' output buffer is the
    prepare/finalize's, or the caller's output when the shapes match; an ``UnfinalizedMoEOutput`` is returned."""

    chunk_size = None

    def chunk_info(self, fe: FusedMoEExperts, M: int) -> tuple[int, int]:
        chunk = max(1, M)
        return cdiv(M, chunk), chunk

    def run(self, kernel: "FusedMoEKernel", call: ExpertsCall):
        fe = kernel.fused_experts
        _, M_full, N, K, top_k = fe.moe_problem_size(call.a1q, call.w1, call.w2, call.topk_ids)
        if call.a1q.dim() == 2 and call.a1q.size(0) == 0:
            M_full = 0
        if M_full == 0:
            # No token reached this rank: return before allocating anything or calling the experts.
            # K of the problem, not a1q's last dimension: packed FP4 activations hold K / 2 bytes per row.
            return torch.empty((*call.a1q.shape[:-1], fe.output_hidden_dim(K)), dtype=call.in_dtype,
                               device=call.a1q.device)
        ws13, ws2, fused_out = kernel._allocate_buffers_unchunked(call, M=M_full, N=N, K=K, top_k=top_k)
        unfinalized = call.run(fe, output=fused_out, workspace13=ws13, workspace2=ws2)
        if isinstance(unfinalized, UnfinalizedMoEOutput):
            return unfinalized  # the experts wrote nothing; the top-k reduction belongs to whoever takes this
        return fused_out


# ------------------------------------------------------------------------------------------------------------
# modular.output_hidden_dim: the kernel's output
# ------------------------------------------------------------------------------------------------------------


class InputShapedOutput:
    """0.17: the output is ``(M, K)`` like hidden_states, or hidden_states itself when ``inplace``."""

    def __init__(self, inplace: bool):
        self.inplace = inplace

    def allocate(self, fe: FusedMoEExperts, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states if self.inplace else torch.empty_like(hidden_states)


class OutputHiddenDimOutput:
    """0.33: the output is ``(M, fused_experts.output_hidden_dim(K))`` (experts may drop a hidden padding)."""

    inplace = False

    def allocate(self, fe: FusedMoEExperts, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.new_empty((*hidden_states.shape[:-1], fe.output_hidden_dim(hidden_states.size(-1))))


# ------------------------------------------------------------------------------------------------------------
# modular.supports_expert_map
# ------------------------------------------------------------------------------------------------------------


class CheckedExpertMap:
    """0.17: an ``expert_map`` given to experts whose ``supports_expert_map()`` is False raises ValueError."""

    def check(self, fe: FusedMoEExperts, expert_map: torch.Tensor | None) -> None:
        if expert_map is not None and not fe.supports_expert_map():
            raise ValueError(f"{type(fe).__name__} does not support expert_map")


class UncheckedExpertMap:
    """0.33: the kernel never asks (the claim stays ``SupportRecord.expert_map``)."""

    def check(self, fe: FusedMoEExperts, expert_map: torch.Tensor | None) -> None:
        return None


# ------------------------------------------------------------------------------------------------------------
# modular.empty_batch / modular.deferred_finalize: finalize
# ------------------------------------------------------------------------------------------------------------


class FinalizeWithTokens:
    """0.17: finalize runs when this rank has tokens, or across ranks (a combine is a collective; a kernel whose
    ``finalizes_empty_batch`` is True always runs it); experts never defer it."""

    def runs(self, kernel: "FusedMoEKernel", num_tokens: int) -> bool:
        return num_tokens > 0 or kernel.prepare_finalize.num_dispatchers() > 1 or kernel.finalizes_empty_batch

    def pass_through(self, kernel: "FusedMoEKernel", unfinalized: UnfinalizedMoEOutput) -> UnfinalizedMoEOutput:
        raise SemanticsError("deferred finalize (UnfinalizedMoEOutput) is vLLM 0.33 semantics")


class FinalizeAlways:
    """0.33: finalize always runs; an ``UnfinalizedMoEOutput`` is returned instead when the prepare/finalize
    supports deferring it (the consumer owes the top-k reduction), else ValueError."""

    def runs(self, kernel: "FusedMoEKernel", num_tokens: int) -> bool:
        return True

    def pass_through(self, kernel: "FusedMoEKernel", unfinalized: UnfinalizedMoEOutput) -> UnfinalizedMoEOutput:
        if not kernel.prepare_finalize.supports_deferred_moe_finalize():
            raise ValueError(f"{type(kernel.prepare_finalize).__name__} cannot pass through a deferred MoE output "
                             f"(supports_deferred_moe_finalize() is False) but {type(kernel.fused_experts).__name__} "
                             "returned one")
        return unfinalized


# ------------------------------------------------------------------------------------------------------------
# modular.shared_experts_order
# ------------------------------------------------------------------------------------------------------------


class ConstructorSharedExperts:
    """0.17: a shared-experts callable given to the kernel runs after the routed experts; ``apply`` then returns
    ``(shared, routed)``. ``apply(shared_experts=...)`` raises SemanticsError."""

    def __init__(self, shared_experts: Callable[[torch.Tensor], torch.Tensor] | None):
        self.shared_experts = shared_experts

    def check(self, shared_experts: SharedExperts | None) -> None:
        if shared_experts is not None:
            raise SemanticsError("apply(shared_experts=SharedExperts) is vLLM 0.33 semantics; the 0.17 kernel takes "
                                 "a shared-experts callable in its constructor")

    def overlapped(self, kernel: "FusedMoEKernel", hidden_states, shared_experts_input, shared_experts):
        # 0.17 runs its shared experts after finalize (or between finalize_async and its hook): on one stream the
        # result is the same, so ``after`` runs them.
        return None

    def after(self, kernel: "FusedMoEKernel", output, hidden_states, shared_experts_input, shared_experts):
        if self.shared_experts is None:
            return output
        se_in = shared_experts_input if shared_experts_input is not None else hidden_states
        return self.shared_experts(se_in), output


class RunnerSharedExperts:
    """0.33: a ``SharedExperts`` passed to ``apply`` runs inside the kernel only in the MK_INTERNAL_OVERLAPPED order;
    ``apply`` returns the routed output alone."""

    shared_experts = None

    def check(self, shared_experts: SharedExperts | None) -> None:
        return None

    def overlapped(self, kernel: "FusedMoEKernel", hidden_states, shared_experts_input, shared_experts):
        """What runs between ``finalize_async`` and its hook (vLLM ``_maybe_apply_shared_experts``): the shared
        experts in the MK_INTERNAL_OVERLAPPED order (only an async prepare/finalize gets there)."""
        if shared_experts is None:
            return None
        return lambda: shared_experts(shared_experts_input if shared_experts_input is not None else hidden_states,
                                      SharedExpertsOrder.MK_INTERNAL_OVERLAPPED)

    def after(self, kernel: "FusedMoEKernel", output, hidden_states, shared_experts_input, shared_experts):
        return output


# ------------------------------------------------------------------------------------------------------------
# modular.supports_dbo: which prepare/finalize may run under dual-batch overlap
# ------------------------------------------------------------------------------------------------------------


class AsyncOnlyDbo:
    """0.17: under DBO the prepare/finalize must be async (``assert not dbo_enabled()`` on the synchronous path)."""

    def check(self, pf: FusedMoEPrepareAndFinalize) -> None:
        if dbo_enabled() and not pf.supports_async():
            raise ValueError(f"{type(pf).__name__} is synchronous (supports_async() is False) and vLLM 0.17 runs no "
                             "synchronous prepare/finalize under DBO (modular_kernel.py: assert not dbo_enabled())")


class SupportsDbo:
    """0.33: under DBO a synchronous prepare/finalize must say ``supports_dbo()`` (it does its own hand-off)."""

    def check(self, pf: FusedMoEPrepareAndFinalize) -> None:
        if dbo_enabled() and not pf.supports_dbo():
            raise ValueError(f"{type(pf).__name__} does not support DBO (supports_dbo() is False; vLLM 0.33 "
                             "modular_kernel.py: assert not dbo_enabled() or supports_dbo())")


@dataclass(frozen=True)
class KernelSemantics:
    """The kernel's choice at each semantics point where 0.17 and 0.33 differ in code."""

    chunking: ChunkedExperts | UnchunkedExperts
    output: InputShapedOutput | OutputHiddenDimOutput
    expert_map: CheckedExpertMap | UncheckedExpertMap
    finalize: FinalizeWithTokens | FinalizeAlways
    shared_experts: ConstructorSharedExperts | RunnerSharedExperts
    dbo: AsyncOnlyDbo | SupportsDbo

    @staticmethod
    def for_version(version: SemanticsVersion, *, chunk_size: int | None, inplace: bool,
                    shared_experts: Callable | None) -> "KernelSemantics":
        """0.33: refuses the 0.17-only arguments (SemanticsError). 0.17: chunk size default from the environment."""
        if version >= SemanticsVersion.V0_33:
            # vLLM 0.33's FusedMoEKernel has none of these: refuse them rather than silently ignore them.
            for name, given in (("chunk_size", chunk_size is not None), ("inplace", inplace),
                                ("shared_experts", shared_experts is not None)):
                if given:
                    hint = {"chunk_size": "vLLM 0.33 has no activation chunking (no chunk loop, no "
                                          "VLLM_FUSED_MOE_CHUNK_SIZE)",
                            "inplace": "vLLM 0.33's kernel always allocates its output",
                            "shared_experts": "pass a reference.shared_experts.SharedExperts to apply()"}[name]
                    raise SemanticsError(f"FusedMoEKernel({name}=...) is vLLM 0.17 semantics: {hint}. Use "
                                         "semantics='0.17' for the 0.17 kernel.")
            return KernelSemantics(UnchunkedExperts(), OutputHiddenDimOutput(), UncheckedExpertMap(),
                                   FinalizeAlways(), RunnerSharedExperts(), SupportsDbo())
        chunking = ChunkedExperts(chunk_size_from_env() if chunk_size is None else chunk_size)
        return KernelSemantics(chunking, InputShapedOutput(inplace), CheckedExpertMap(), FinalizeWithTokens(),
                               ConstructorSharedExperts(shared_experts), AsyncOnlyDbo())


# ------------------------------------------------------------------------------------------------------------
# The kernel
# ------------------------------------------------------------------------------------------------------------


class FusedMoEKernel:
    """prepare -> experts -> finalize (seed 002 ``FusedMoEKernel`` + ``...ModularImpl``), per semantics version:
    0.17 chunks the experts over tokens, 0.33 runs them once (see ``reference.modular`` for every 0.33 change and
    this module's table for the strategy of each).

    Args:
        prepare_finalize: a ``FusedMoEPrepareAndFinalizeModular`` (or ``...Monolithic`` with monolithic experts).
        fused_experts: the experts implementation under test.
        shared_experts: 0.17 only: optional callable ``(M, K) -> (M, K)``; when set, ``apply`` returns
            ``(shared, routed)``. (0.33: pass a ``SharedExperts`` to ``apply``.)
        inplace: 0.17 only: write the result into ``hidden_states`` (not allowed with shared experts).
        chunk_size: 0.17 only: tokens per chunk; default ``VLLM_FUSED_MOE_CHUNK_SIZE`` (16*1024) read at
            construction.
        poison: if not None, fill every workspace and the experts' output buffer with this value before the
            experts run (conformance uses NaN so unwritten elements fail).
        semantics: the vLLM semantics version (default: the one in force at construction, ``reference.semantics``).

    Raises:
        ValueError: mismatched monolithic/modular pair or activation formats, inplace with shared experts,
            chunk_size < 1.
        SemanticsError (a ValueError): ``shared_experts``, ``inplace`` or ``chunk_size`` under 0.33.
    """

    #: Run finalize on a rank without tokens even with one dispatcher (``reference.distributed.EPFusedMoEKernel``:
    #: its combine is a collective). Read by the 0.17 ``FinalizeWithTokens``; 0.33 always finalizes.
    finalizes_empty_batch: bool = False

    def __init__(
        self,
        prepare_finalize: FusedMoEPrepareAndFinalize,
        fused_experts: FusedMoEExperts,
        shared_experts: Callable[[torch.Tensor], torch.Tensor] | None = None,
        moe_parallel_config: FusedMoEParallelConfig | None = None,
        inplace: bool = False,
        *,
        chunk_size: int | None = None,
        poison: float | None = None,
        semantics: SemanticsVersion | str | None = None,
    ):
        self.semantics = resolve_semantics(semantics)
        if self.semantics >= SemanticsVersion.V0_33:
            KernelSemantics.for_version(self.semantics, chunk_size=chunk_size, inplace=inplace,
                                        shared_experts=shared_experts)  # refuses the 0.17-only arguments first
        modular = isinstance(prepare_finalize, FusedMoEPrepareAndFinalizeModular) and isinstance(
            fused_experts, FusedMoEExpertsModular
        )
        monolithic = isinstance(prepare_finalize, FusedMoEPrepareAndFinalizeMonolithic) and isinstance(
            fused_experts, FusedMoEExpertsMonolithic
        )
        if not (modular or monolithic):
            raise ValueError(
                "prepare_finalize and fused_experts must both be either monolithic or non-monolithic but got "
                f"{type(prepare_finalize).__name__} and {type(fused_experts).__name__}"
            )
        if monolithic and (shared_experts is not None or inplace):
            raise ValueError("monolithic kernels support neither shared experts nor inplace")
        if inplace and shared_experts is not None:
            raise ValueError("inplace is not allowed with shared experts")
        self.prepare_finalize = prepare_finalize
        self.fused_experts = fused_experts
        self.moe_parallel_config = moe_parallel_config
        self._sem = KernelSemantics.for_version(self.semantics, chunk_size=chunk_size, inplace=inplace,
                                                shared_experts=shared_experts)
        self.poison = poison
        prepare_finalize.post_init_setup(fused_experts)
        if prepare_finalize.activation_format != fused_experts.activation_format():
            raise ValueError(
                f"prepare_finalize produces {prepare_finalize.activation_format} but the experts expect "
                f"{fused_experts.activation_format()}"
            )

    # The 0.17 constructor arguments as attributes (None / False under 0.33, where they do not exist).
    chunk_size = property(lambda self: self._sem.chunking.chunk_size, doc="tokens per chunk (0.17); None: no chunking")
    inplace = property(lambda self: self._sem.output.inplace)
    shared_experts = property(lambda self: self._sem.shared_experts.shared_experts)

    @property
    def is_monolithic(self) -> bool:
        return isinstance(self.fused_experts, FusedMoEExpertsMonolithic)

    def supports_expert_map(self) -> bool:
        return self.fused_experts.supports_expert_map()

    def output_is_reduced(self) -> bool:
        return self.prepare_finalize.output_is_reduced()

    def supports_deferred_moe_finalize(self) -> bool:
        """vLLM 0.33: the prepare/finalize's ``supports_deferred_moe_finalize``."""
        return self.prepare_finalize.supports_deferred_moe_finalize()

    @property
    def can_overlap_shared_experts(self) -> bool:
        """vLLM 0.33: the kernel runs shared experts itself (MK_INTERNAL_OVERLAPPED) when its prepare/finalize
        supports async; monolithic kernels never do."""
        return (not self.is_monolithic) and bool(getattr(self.prepare_finalize, "supports_async", lambda: False)())

    # --- chunking helpers (seed 002) -------------------------------------------------------------------------
    def _chunk_info(self, M: int) -> tuple[int, int]:
        """``(num_chunks, CHUNK_SIZE)``; one chunk when chunking is off (always under 0.33); zero chunks when M == 0."""
        num_chunks, CHUNK_SIZE = self._sem.chunking.chunk_info(self.fused_experts, M)
        assert M > 0 or num_chunks == 0
        return num_chunks, CHUNK_SIZE

    @staticmethod
    def _slice_output_tensor(fused_out, chunk_idx, num_chunks, CHUNK_SIZE, M):
        if num_chunks == 1:
            return fused_out
        if fused_out.size(0) % M != 0:
            raise ValueError(f"fused_out shape {tuple(fused_out.shape)} is not a multiple of M={M}")
        factor = fused_out.size(0) // M
        out_chunk = CHUNK_SIZE * factor
        s = chunk_idx * out_chunk
        return fused_out[s : min(s + out_chunk, fused_out.size(0))]

    @staticmethod
    def _slice_expert_tokens_metadata(num_chunks, full_meta, chunk_topk_ids, local_num_experts, expert_map):
        """Chunking invalidates the per-expert counts: recompute them for the chunk (vLLM #20392 was this bug)."""
        if num_chunks == 1 or full_meta is None:
            return full_meta
        from reference.align import count_expert_num_tokens

        counts = count_expert_num_tokens(chunk_topk_ids, local_num_experts, expert_map)
        cpu = counts.to("cpu") if full_meta.expert_num_tokens_cpu is not None else None
        return ExpertTokensMetadata(expert_num_tokens=counts, expert_num_tokens_cpu=cpu)

    def _workspace_shapes(self, call: ExpertsCall, M: int, N: int, K: int, top_k: int):
        return self.fused_experts.workspace_shapes(M, N, K, top_k, call.global_num_experts, call.local_num_experts,
                                                   call.expert_tokens_meta, call.activation)

    def _allocate_buffers(self, call: ExpertsCall, *, M_chunk: int, M_full: int, N: int, K: int, top_k: int):
        """0.17 ``_allocate_buffers``: ``(workspace13, workspace2, fused_out)``, workspaces sized by the chunk, the
        output by all tokens; with one chunk workspace13 and the output share memory when their dtypes agree."""
        num_chunks, _ = self._chunk_info(M_full)
        out_dtype, device = call.in_dtype, call.a1q.device
        ws_dtype = self.fused_experts.workspace_dtype(out_dtype)
        ws13_shape, ws2_shape, _ = self._workspace_shapes(call, M_chunk, N, K, top_k)
        _, _, out_shape = self._workspace_shapes(call, M_full, N, K, top_k)
        empty = torch.empty
        if num_chunks == 1:
            # workspace13 and the output share memory: by the time the output is written, GEMM1's result is dead.
            # Only legal when they have the same dtype (the seed assumes it).
            if ws_dtype == out_dtype:
                common = empty(max(prod(ws13_shape), prod(out_shape)), dtype=ws_dtype, device=device)
                ws13 = _resize_cache(common, ws13_shape)
                fused_out = _resize_cache(common, out_shape)
            else:
                ws13 = empty(ws13_shape, dtype=ws_dtype, device=device)
                fused_out = empty(out_shape, dtype=out_dtype, device=device)
            ws2 = empty(ws2_shape, dtype=ws_dtype, device=device)
        else:
            ws13 = empty(ws13_shape, dtype=ws_dtype, device=device)
            ws2 = empty(ws2_shape, dtype=ws_dtype, device=device)
            fused_out = empty(out_shape, dtype=out_dtype, device=device)
        self._poison(ws13, ws2, fused_out)
        return ws13, ws2, fused_out

    def _allocate_buffers_unchunked(self, call: ExpertsCall, *, M: int, N: int, K: int, top_k: int):
        """Workspaces and the experts' output for one unchunked call (0.33 ``_allocate_buffers`` with M_chunk ==
        M_full, plus the output aliasing of ``_fused_experts``).

        The experts' output is, in order of preference: the prepare/finalize's ``allocate_fused_expert_output``
        buffer (validated); the caller's ``output`` when it has exactly the experts' output shape and dtype (the
        experts then write the final output directly and a NoOP finalize copies nothing); a view of workspace13's
        memory (GEMM1's result is dead by the time the output is written).
        """
        fe = self.fused_experts
        device, output = call.a1q.device, call.output
        ws_dtype = fe.workspace_dtype(call.in_dtype)
        ws13_shape, ws2_shape, out_shape = self._workspace_shapes(call, M, N, K, top_k)
        alias = self.prepare_finalize.allocate_fused_expert_output(
            tuple(out_shape), ws_dtype, device, fe.finalize_weight_and_reduce_impl())
        if alias is not None:
            # vLLM asserts these; a wrong buffer would be written out of bounds or reinterpreted.
            if (tuple(alias.shape) != tuple(out_shape) or alias.dtype != ws_dtype or alias.device != torch.device(device)
                    or not alias.is_contiguous()):
                raise ValueError(
                    f"{type(self.prepare_finalize).__name__}.allocate_fused_expert_output returned "
                    f"{tuple(alias.shape)} {alias.dtype} on {alias.device} (contiguous: {alias.is_contiguous()}); "
                    f"the experts need a contiguous {tuple(out_shape)} {ws_dtype} tensor on {device}")
            fused_out = alias
            ws13 = torch.empty(ws13_shape, dtype=ws_dtype, device=device)
        elif (output is not None and tuple(output.shape) == tuple(out_shape) and output.dtype == ws_dtype
              and output.is_contiguous()):
            fused_out = output
            ws13 = torch.empty(ws13_shape, dtype=ws_dtype, device=device)
        else:
            common = torch.empty(max(prod(ws13_shape), prod(out_shape)), dtype=ws_dtype, device=device)
            ws13 = _resize_cache(common, ws13_shape)
            fused_out = _resize_cache(common, out_shape)
        ws2 = torch.empty(ws2_shape, dtype=ws_dtype, device=device)
        self._poison(ws13, ws2, fused_out)
        return ws13, ws2, fused_out

    def _poison(self, *buffers: torch.Tensor) -> None:
        """Fill fresh buffers with ``poison`` (NaN; -1 for integer ones) so a kernel that leaves an element unwritten
        is caught."""
        if self.poison is None:
            return
        for t in buffers:
            if t.is_floating_point():
                t.fill_(self.poison)
            elif t.numel():
                t.fill_(-1)

    def _fused_experts(self, call: ExpertsCall) -> torch.Tensor | UnfinalizedMoEOutput:
        """The experts step (``modular.activation_chunking``'s strategy): the experts' output buffer, or (0.33) their
        ``UnfinalizedMoEOutput``."""
        return self._sem.chunking.run(self, call)

    def apply(
        self,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: MoEActivation = MoEActivation.SILU,
        global_num_experts: int = -1,
        expert_map: torch.Tensor | None = None,
        apply_router_weight_on_input: bool = False,
        shared_experts_input: torch.Tensor | None = None,
        shared_experts: SharedExperts | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | UnfinalizedMoEOutput:
        """Run the layer.

        Args:
            hidden_states: ``(M, K)``. w1 ``(E_local, N, K)``, w2 ``(E_local, K, N')`` (maybe quantized/packed).
            topk_weights: ``(M, topk)`` fp32. topk_ids: ``(M, topk)`` int32/int64 global expert ids.
            global_num_experts: E (``-1`` means ``E_local``). expert_map: int32 ``(E,)`` global -> local, -1 not held.
            apply_router_weight_on_input: weights multiply the input (topk must be 1) instead of the output.
            shared_experts_input: input of the shared experts when it differs (latent MoE).
            shared_experts: 0.33 only: a ``SharedExperts``; the kernel runs it when its order is
                ``MK_INTERNAL_OVERLAPPED`` (read the result from ``shared_experts.output``).

        Returns:
            0.17: ``(M, K)`` in ``hidden_states.dtype``, or ``(shared_out, routed_out)`` with the constructor's
            shared experts. 0.33: ``(M, fused_experts.output_hidden_dim(K))`` in ``hidden_states.dtype``, or the
            experts' ``UnfinalizedMoEOutput`` (deferred finalize).

        Raises:
            ValueError: shape mismatches, apply_router_weight_on_input with topk > 1; 0.17: expert_map given to
                experts that do not support it; 0.33: an unfinalized output the prepare/finalize cannot pass
                through, a bad ``allocate_fused_expert_output`` buffer. SemanticsError: ``shared_experts`` under
                0.17.
        """
        if self.is_monolithic:
            raise ValueError("this kernel is monolithic: call apply_monolithic with router logits")
        if hidden_states.dim() != 2:
            raise ValueError(f"hidden_states must be (M, K), got {tuple(hidden_states.shape)}")
        if topk_ids.shape != topk_weights.shape or topk_ids.size(0) != hidden_states.size(0):
            raise ValueError(
                f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be "
                f"(M={hidden_states.size(0)}, topk)"
            )
        if apply_router_weight_on_input and topk_ids.size(1) != 1:
            raise ValueError(f"apply_router_weight_on_input is only supported for topk == 1, got {topk_ids.size(1)}")
        sem, fe = self._sem, self.fused_experts
        sem.shared_experts.check(shared_experts)
        sem.expert_map.check(fe, expert_map)
        output = sem.output.allocate(fe, hidden_states)
        local_num_experts = w1.size(0)
        if global_num_experts == -1:
            global_num_experts = local_num_experts
        a1q, a1q_scale, meta, topk_ids, topk_weights = self._prepare(
            hidden_states, topk_weights, topk_ids, global_num_experts, expert_map, apply_router_weight_on_input)
        fused_out = self._fused_experts(ExpertsCall(
            in_dtype=hidden_states.dtype, a1q=a1q, a1q_scale=a1q_scale, w1=w1, w2=w2, topk_weights=topk_weights,
            topk_ids=topk_ids, activation=activation, global_num_experts=global_num_experts,
            local_num_experts=local_num_experts, expert_map=expert_map,
            apply_router_weight_on_input=apply_router_weight_on_input, expert_tokens_meta=meta, output=output))
        if isinstance(fused_out, UnfinalizedMoEOutput):
            # Nothing below can run on an unfinalized output: finalize (top-k reduction, combine) is the consumer's.
            return sem.finalize.pass_through(self, fused_out)
        if sem.finalize.runs(self, hidden_states.size(0)):
            self._finalize(output, fused_out, topk_weights, topk_ids, apply_router_weight_on_input,
                           sem.shared_experts.overlapped(self, hidden_states, shared_experts_input, shared_experts))
        return sem.shared_experts.after(self, output, hidden_states, shared_experts_input, shared_experts)

    @staticmethod
    def _await(hook, receiver):
        """Complete an async step (vLLM's hook handling in ``_prepare`` / ``_finalize``): without DBO call the hook
        now; under DBO register it in the next ubatch's context and yield (that ubatch runs it); then receive."""
        if hook is not None:
            if dbo_enabled():
                dbo_register_recv_hook(hook)
                dbo_yield()
            else:
                hook()
        return receiver()

    def _finalize(self, output, fused_out, topk_weights, topk_ids, apply_router_weight_on_input,
                  overlapped: Callable[[], object] | None = None) -> None:
        """``prepare_finalize.finalize``, or (``supports_async()``) ``finalize_async`` -> ``overlapped()`` (0.33:
        the MK_INTERNAL_OVERLAPPED shared experts) -> hook -> receiver. Raises ValueError for a prepare/finalize that
        may not run under the DBO in force (``modular.supports_dbo``)."""
        pf, impl = self.prepare_finalize, self.fused_experts.finalize_weight_and_reduce_impl()
        if not pf.supports_async():
            self._sem.dbo.check(pf)
            pf.finalize(output, fused_out, topk_weights, topk_ids, apply_router_weight_on_input, impl)
            return
        hook, receiver = split_hook_receiver(
            pf.finalize_async(output, fused_out, topk_weights, topk_ids, apply_router_weight_on_input, impl))
        if overlapped is not None:
            overlapped()
        self._await(hook, receiver)

    def _prepare(self, hidden_states, topk_weights, topk_ids, global_num_experts, expert_map,
                 apply_router_weight_on_input):
        """``prepare_finalize.prepare``, or (``supports_async()``) a pending recv hook of another ubatch ->
        ``prepare_async`` -> hook -> receiver (vLLM ``_prepare``, 0.17.0 and 0.33.0 alike but for the DBO check)."""
        pf = self.prepare_finalize
        args = (hidden_states, topk_weights, topk_ids, global_num_experts, expert_map, apply_router_weight_on_input,
                self.fused_experts.quant_config)
        defer = self.fused_experts.expects_unquantized_inputs
        if not pf.supports_async():
            self._sem.dbo.check(pf)
            ret = pf.prepare(*args, defer_input_quant=defer)
        else:
            dbo_maybe_run_recv_hook()  # overlap the other ubatch's receive with this one's dispatch
            ret = self._await(*split_hook_receiver(pf.prepare_async(*args, defer_input_quant=defer)))
        a1q, a1q_scale, meta, d_ids, d_weights = ret
        # Dispatching prepare/finalizes hand back the topk ids and weights of the tokens they gathered.
        topk_ids = topk_ids if d_ids is None else d_ids
        topk_weights = topk_weights if d_weights is None else d_weights
        return a1q, a1q_scale, meta, topk_ids, topk_weights

    def forward_with_shared_experts(self, shared_experts: SharedExperts, hidden_states: torch.Tensor, w1, w2,
                                    topk_weights, topk_ids, activation: MoEActivation = MoEActivation.SILU,
                                    global_num_experts: int = -1, expert_map: torch.Tensor | None = None,
                                    apply_router_weight_on_input: bool = False,
                                    shared_experts_input: torch.Tensor | None = None):
        """vLLM 0.33's runner around this kernel (``MoERunner._forward_impl`` / ``_apply_quant_method``): the shared
        experts run once, at the site their order names: ``maybe_forward_async`` before the routed experts
        (MULTI_STREAM_OVERLAPPED), ``NO_OVERLAP`` just before the kernel, or inside it (MK_INTERNAL_OVERLAPPED).

        Returns:
            ``(shared_output, routed_output)``; combine them with ``reference.shared_experts.combine_shared_and_routed``.

        Raises:
            SemanticsError: under 0.17.
        """
        if self.semantics < SemanticsVersion.V0_33:
            raise SemanticsError("SharedExperts orderings are vLLM 0.33 semantics (runner/shared_experts.py)")
        se_in = shared_experts_input if shared_experts_input is not None else hidden_states
        shared_experts.maybe_forward_async(se_in)
        shared_experts(se_in, SharedExpertsOrder.NO_OVERLAP)
        routed = self.apply(hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map,
                            apply_router_weight_on_input, shared_experts_input=shared_experts_input,
                            shared_experts=shared_experts)
        return shared_experts.output, routed

    def apply_monolithic(self, hidden_states, w1, w2, router_logits, activation, global_num_experts, expert_map,
                         apply_router_weight_on_input, num_expert_group=None, e_score_correction_bias=None,
                         routed_scaling_factor=None, topk_group=None, *, routing_sink=None, input_ids=None,
                         hash_indices_table=None):
        """Monolithic path (vLLM ``FusedMoEKernelMonolithicImpl.apply``): ``prepare`` (quantize) -> experts route +
        compute -> ``finalize``.

        0.33 keywords (point ``modular.apply_monolithic``): ``routing_sink`` (a ``reference.routing.RoutedExpertsSink``
        or None; required keyword upstream, default None here): the experts must ``supports_routing_replay_capture``
        (else ValueError, checked per call), get ``routing_replay_out = routing_sink.buffer[:M]`` and, after they ran,
        ``routing_sink.capture_fn(routing_replay_out)`` is called. ``input_ids`` / ``hash_indices_table``: forwarded
        to the experts as keywords only when ``hash_indices_table`` is given (only classes that
        ``_supports_hash_routing`` are selected for such a layer). Deferred finalize: an ``UnfinalizedMoEOutput``
        from the experts is returned when ``prepare_finalize.supports_deferred_moe_finalize()``, else ValueError.

        Raises:
            ValueError: a modular kernel; capture with experts that cannot; an unfinalized output the
                prepare/finalize cannot pass through. SemanticsError: a 0.33 keyword, or an ``UnfinalizedMoEOutput``,
                under 0.17.
        """
        if not self.is_monolithic:
            raise ValueError("this kernel is modular: call apply with topk ids and weights")
        v033 = self.semantics >= SemanticsVersion.V0_33
        if not v033 and (routing_sink is not None or input_ids is not None or hash_indices_table is not None):
            raise SemanticsError("apply_monolithic(routing_sink=, input_ids=, hash_indices_table=) is vLLM 0.33 "
                                 "semantics (fused_moe/modular_kernel.py FusedMoEKernelMonolithicImpl.apply)")
        hash_kwargs = {}
        if hash_indices_table is not None:
            hash_kwargs = {"input_ids": input_ids, "hash_indices_table": hash_indices_table}
        a1q, a1q_scale, router_logits = self.prepare_finalize.prepare(
            hidden_states, router_logits, self.fused_experts.quant_config,
            defer_input_quant=self.fused_experts.expects_unquantized_inputs,
        )
        replay = {}
        if routing_sink is not None:
            if not self.fused_experts.supports_routing_replay_capture():
                raise ValueError("Routed-experts capture is not supported with monolithic MoE kernel "
                                 f"{type(self.fused_experts).__name__}.")
            replay["routing_replay_out"] = routing_sink.buffer[: len(a1q)]
        out = self.fused_experts.apply(
            hidden_states=a1q, w1=w1, w2=w2, router_logits=router_logits, activation=activation,
            global_num_experts=global_num_experts, expert_map=expert_map, a1q_scale=a1q_scale,
            apply_router_weight_on_input=apply_router_weight_on_input, num_expert_group=num_expert_group,
            e_score_correction_bias=e_score_correction_bias, routed_scaling_factor=routed_scaling_factor,
            topk_group=topk_group, **replay, **hash_kwargs,
        )
        if routing_sink is not None:
            routing_sink.capture_fn(replay["routing_replay_out"])
        if isinstance(out, UnfinalizedMoEOutput):
            return self._sem.finalize.pass_through(self, out)
        return self.prepare_finalize.finalize(out)
