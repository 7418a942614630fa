"""The experts' side of the modular kernel (seed 002; in vLLM ``fused_moe/modular_kernel.py``):
``ExpertTokensMetadata``, ``FusedMoEActivationFormat`` and the experts ABCs ``FusedMoEExperts`` /
``FusedMoEExpertsModular`` / ``FusedMoEExpertsMonolithic`` with the ``is_supported_config`` oracle."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from reference.activation import (
    ApplyMoEActivationConfig,
    MoEActivation,
    adjust_N_for_activation,
    apply_moe_activation,
    apply_moe_activation_into,
)
from reference.config import FusedMoEConfig, FusedMoEParallelConfig, FusedMoEQuantConfig
from reference.modular.envs import batch_invariant_from_env, chunking_enabled_from_env
from reference.modular.support import SupportRecord
from reference.modular.topk_weight_and_reduce import TopKWeightAndReduce
from reference.moe_output import UnfinalizedMoEOutput
from reference.routing import RoutingMethodType
from reference.semantics import SemanticsVersion, current_semantics

__all__ = ["ExpertTokensMetadata", "FusedMoEActivationFormat", "FusedMoEExperts", "FusedMoEExpertsModular",
           "FusedMoEExpertsMonolithic", "layer_expert_map"]


def layer_expert_map(
    experts: "FusedMoEExperts | type[FusedMoEExperts] | None",
    expert_map: torch.Tensor | None,
    expert_mask: torch.Tensor | None,
    *,
    rocm_aiter_fmoe_enabled: bool = False,
    semantics=None,
) -> torch.Tensor | None:
    """The expert map a layer hands its experts kernel (``FusedMoE.expert_map`` / ``RoutedExperts.expert_map``).

    0.33 (``fused_moe/routed_experts.py``): ``expert_mask`` when the selected experts (class or instance) say
    ``consumes_expert_mask`` (ROCm AITER), else the canonical ``expert_map``; ``rocm_aiter_fmoe_enabled`` is not read.
    0.17 (``fused_moe/layer.py::FusedMoE.expert_map``): ``expert_mask`` when the global AITER switch
    ``rocm_aiter_fmoe_enabled`` is on, else ``expert_map``, whichever experts were selected. Point
    ``modular.consumes_expert_mask``.
    """
    from reference.semantics import resolve_semantics

    if resolve_semantics(semantics) < SemanticsVersion.V0_33:
        return expert_mask if rocm_aiter_fmoe_enabled else expert_map
    return expert_mask if (experts is not None and experts.consumes_expert_mask) else expert_map


@dataclass
class ExpertTokensMetadata:
    """Tokens routed to each local expert: ``expert_num_tokens`` int32 ``(E_local,)`` on the device, and an
    optional CPU copy (some kernels size buffers from it).

    vLLM 0.33 (``fused_moe/modular_kernel.py``) adds two optional fields, set by DeepEP-v2 INDEXED prepare/finalizes
    (``all2all_utils.py``) for experts that globalize the received ids themselves (``fused_humming_moe.py``,
    ``fused_globalize_align_block_size.py``); both default to None, and under 0.33 ``expert_num_tokens`` may be None
    with only ``psum_recv_per_rank`` set (a CUDA-graph decode carrier):

    - ``psum_recv_per_rank``: int32 ``(num_ranks,)`` inclusive prefix sum of the rows received from each source rank;
      its last element is the number of valid received rows (later rows are padding);
    - ``rank_expert_offset``: the local -> global expert-id offset (``rank * E_local``) when globalization is
      deferred to the experts.
    """

    expert_num_tokens: torch.Tensor | None
    expert_num_tokens_cpu: torch.Tensor | None
    psum_recv_per_rank: torch.Tensor | None = None
    rank_expert_offset: int | None = None

    def num_valid_tokens(self) -> torch.Tensor | None:
        """``psum_recv_per_rank[-1:]`` (int32 ``(1,)``, on the device) or None: what a 0.33 consumer reads as the
        valid-token count (``fused_humming_moe.py``: ``valid_tokens = psum_recv_per_rank[-1:]``)."""
        return None if self.psum_recv_per_rank is None else self.psum_recv_per_rank[-1:]

    @staticmethod
    def make_from_list(expert_num_tokens_list: list[int], device: str | torch.device) -> "ExpertTokensMetadata":
        cpu = torch.tensor(expert_num_tokens_list, device="cpu", dtype=torch.int32)
        return ExpertTokensMetadata(expert_num_tokens=cpu.to(device), expert_num_tokens_cpu=cpu)


class FusedMoEActivationFormat(enum.Enum):
    """Standard: ``(num_tokens, hidden)``. BatchedExperts: ``(num_local_experts, max_tokens_per_expert, hidden)``."""

    Standard = ("standard",)
    BatchedExperts = ("batched_experts",)


class FusedMoEExperts(ABC):
    """Base of every experts implementation (seed 002 ``FusedMoEExperts``).

    Subclasses declare support through the static ``_supports_*`` predicates; ``is_supported_config`` combines them
    into the oracle vLLM uses to pick a kernel, and conformance checks the claims (claimed -> must pass; not
    claimed -> must raise).

    Raises (``__init__``): ValueError when ``max_num_tokens`` / ``num_dispatchers`` are given for the Standard format
    or missing for the BatchedExperts format.
    """

    #: vLLM 0.33: ROCm AITER kernels consume the 0/1 local-expert mask (``determine_expert_map(...,
    #: return_expert_mask=True)``: ``(E + n_shared + 1,)`` int32, 1 = on this rank, trailing sentinel 0) instead of
    #: the canonical -1/local-slot ``expert_map``; ``RoutedExperts.expert_map`` hands the experts the mask when their
    #: class sets this (``layer_expert_map``, point ``modular.consumes_expert_mask``). No backend here does.
    consumes_expert_mask: ClassVar[bool] = False

    #: vLLM 0.33: called with the unweighted GEMM2 rows (an ``UnfinalizedMoEOutput``) and the output to weight
    #: and reduce into, replacing the experts' own top-k reduction (set on an instance by a fusing consumer).
    post_gemm2_hook: Callable[[UnfinalizedMoEOutput, torch.Tensor], None] | None = None

    def __init__(
        self,
        moe_config: FusedMoEConfig,
        quant_config: FusedMoEQuantConfig,
        max_num_tokens: int | None = None,
        num_dispatchers: int | None = None,
    ):
        fmt = self.activation_format()
        if fmt == FusedMoEActivationFormat.Standard and (max_num_tokens is not None or num_dispatchers is not None):
            raise ValueError(
                "max_num_tokens and num_dispatchers should only be set for BatchedExperts activation format."
            )
        if fmt == FusedMoEActivationFormat.BatchedExperts and (max_num_tokens is None or num_dispatchers is None):
            raise ValueError("max_num_tokens and num_dispatchers must be set for BatchedExperts activation format.")
        self.moe_config = moe_config
        self.quant_config = quant_config
        self.max_num_tokens = max_num_tokens
        self.num_dispatchers = num_dispatchers

    @staticmethod
    def is_monolithic() -> bool:
        raise NotImplementedError("Implemented by subclasses.")

    @property
    def expects_unquantized_inputs(self) -> bool:
        """True if the experts quantize the input themselves (prepare then skips input quantization)."""
        return False

    @staticmethod
    @abstractmethod
    def activation_format() -> FusedMoEActivationFormat:
        raise NotImplementedError

    @staticmethod
    def is_supported_config(
        cls: type["FusedMoEExperts"],
        moe_config: FusedMoEConfig,
        weight_key,
        activation_key,
        activation_format: FusedMoEActivationFormat,
    ) -> tuple[bool, str | None]:
        """The seed's support oracle: ``(True, None)`` or ``(False, "kernel does not support <reason>")``.

        ``weight_key`` / ``activation_key`` are ``reference.quant.keys.QuantKey`` values or None (unquantized).
        """

        def _make_reason(reason: str) -> str:
            return f"kernel does not support {reason}"

        if not cls._supports_current_device():
            detail = cls._current_device_unsupported_detail()
            return False, _make_reason("current device" + (f": {detail}" if detail else ""))
        if not (moe_config.is_act_and_mul or cls._supports_no_act_and_mul()):
            return False, _make_reason("no act_and_mul MLP layer")
        if not cls._supports_activation(moe_config.activation):
            return False, _make_reason(f"{moe_config.activation} activation")
        if not cls._supports_quant_scheme(weight_key, activation_key):
            why = cls.support.declined_reason(weight_key, activation_key) if cls.support is not None else None
            return False, _make_reason(f"quantization scheme {weight_key}x{activation_key}" + (f": {why}" if why else ""))
        if not cls._supports_parallel_config(moe_config.moe_parallel_config):
            return False, _make_reason(f"parallel config {moe_config.moe_parallel_config}")
        v033 = current_semantics() >= SemanticsVersion.V0_33  # point modular.is_supported_config
        if v033 and moe_config.has_hash_routing and cls.is_monolithic() and not cls._supports_hash_routing():
            return False, _make_reason("hash routing")
        if v033 and moe_config.require_decomposed_backend and cls.is_monolithic():
            return False, _make_reason("routes adjusted after routing")
        if not cls._supports_routing_method(moe_config.routing_method, weight_key, activation_key):
            return False, _make_reason(f"routing method {moe_config.routing_method}")
        if not cls._supports_router_logits_dtype(moe_config.router_logits_dtype, moe_config.routing_method):
            return False, _make_reason(f"router logits dtype {moe_config.router_logits_dtype}")
        if not cls._supports_shape(moe_config.hidden_dim):
            return False, _make_reason(f"{moe_config.hidden_dim} hidden dim is not supported")
        if activation_format != cls.activation_format():
            return False, _make_reason(f"{activation_format.value} activation format")
        if v033 and batch_invariant_from_env() and not cls._supports_batch_invariance():
            return False, _make_reason("batch invariance")
        if v033 and moe_config.is_lora_enabled and not cls.supports_lora():
            return False, _make_reason("LoRA")
        if cls.support is not None and moe_config.in_dtype not in cls.support.act_dtypes:
            short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
            claimed = ", ".join(sorted(short.get(d, str(d)) for d in cls.support.act_dtypes))
            return False, _make_reason(f"activation dtype {moe_config.in_dtype} ({claimed} only)")
        return True, None

    # The seed's predicates. A class that declares ``support`` (a ``SupportRecord``) gets them derived from it; a
    # class without one must override them (as in vLLM). They are called on the class: ``cls._supports_x(...)``.
    support: ClassVar["SupportRecord | None"] = None

    @classmethod
    def _record(cls) -> "SupportRecord":
        if cls.support is None:
            raise NotImplementedError(f"{cls.__name__} declares no SupportRecord (class attribute `support`) and "
                                      "does not override this _supports_* predicate")
        return cls.support

    @classmethod
    def _supports_current_device(cls) -> bool:
        return cls._record().device_reason() is None

    @classmethod
    def _current_device_unsupported_detail(cls) -> str | None:
        """Why ``_supports_current_device`` is False, appended to the support oracle's reason (this project's
        extension of the seed, whose reason is only "kernel does not support current device"). None: no detail."""
        return None if cls.support is None else cls.support.device_reason()

    @classmethod
    def _supports_no_act_and_mul(cls) -> bool:
        return cls._record().no_act_and_mul

    @classmethod
    def _supports_quant_scheme(cls, weight_key, activation_key) -> bool:
        return cls._record().claims_quant(weight_key, activation_key)

    @classmethod
    def _supports_activation(cls, activation: MoEActivation) -> bool:
        return cls._record().claims_activation(activation)

    @classmethod
    def _supports_parallel_config(cls, moe_parallel_config: FusedMoEParallelConfig) -> bool:
        pred = cls._record().parallel_config
        return True if pred is None else bool(pred(moe_parallel_config))

    @staticmethod
    def _supports_routing_method(routing_method: RoutingMethodType, weight_key, activation_key) -> bool:
        return True

    @staticmethod
    def _supports_router_logits_dtype(router_logits_dtype, routing_method: RoutingMethodType) -> bool:
        return True

    @staticmethod
    def _supports_hash_routing() -> bool:
        """vLLM 0.33: whether a monolithic kernel implements hash routing itself (it then receives ``input_ids`` and
        ``hash_indices_table`` in ``apply``). Default False."""
        return False

    @staticmethod
    def _supports_batch_invariance() -> bool:
        """vLLM 0.33: whether the output of a token does not depend on the rest of the batch (required under
        ``VLLM_BATCH_INVARIANT=1``). Default False."""
        return False

    @staticmethod
    def supports_lora() -> bool:
        """vLLM 0.33: whether the class handles LoRA natively (``LoRAExpertsMixin``). Default False."""
        return False

    @classmethod
    def _supports_shape(cls, hidden_dim: int) -> bool:
        return cls.support is None or hidden_dim % cls.support.hidden_dim_multiple == 0

    # vLLM's accessors of the quant config.
    quant_dtype = property(lambda self: self.quant_config.quant_dtype)
    weight_quant_dtype = property(lambda self: self.quant_config.weight_quant_dtype)
    block_shape = property(lambda self: self.quant_config.block_shape)
    per_act_token_quant = property(lambda self: self.quant_config.per_act_token_quant)
    per_out_ch_quant = property(lambda self: self.quant_config.per_out_ch_quant)
    a1_scale = property(lambda self: self.quant_config.a1_scale)
    a2_scale = property(lambda self: self.quant_config.a2_scale)
    w1_scale = property(lambda self: self.quant_config.w1_scale)
    w2_scale = property(lambda self: self.quant_config.w2_scale)
    w1_bias = property(lambda self: self.quant_config.w1_bias)
    w2_bias = property(lambda self: self.quant_config.w2_bias)

    def supports_chunking(self) -> bool:
        return type(self)._record().chunking

    def supports_expert_map(self) -> bool:
        """The 0.17 base-class predicate (``SupportRecord.expert_map``). vLLM 0.33 removed it from the base class
        and its kernel never asks; the reference's 0.33 kernel does not call it either (see the module docstring)."""
        return type(self)._record().expert_map

    def _uses_post_gemm2_hook(self, num_tokens: int) -> bool:
        """vLLM 0.33: defer the top-k reduction to ``post_gemm2_hook`` (only when there are tokens)."""
        return self.post_gemm2_hook is not None and num_tokens > 0

    def _run_post_gemm2_hook(self, unfinalized: UnfinalizedMoEOutput,
                             output: torch.Tensor | None = None) -> torch.Tensor:
        """Hand ``unfinalized`` and the output (allocated ``(num_tokens, hidden)`` if None) to the hook."""
        if self.post_gemm2_hook is None:
            raise ValueError("_run_post_gemm2_hook called without a post_gemm2_hook")
        if not isinstance(unfinalized, UnfinalizedMoEOutput):
            raise ValueError(f"post_gemm2_hook takes an UnfinalizedMoEOutput, got {type(unfinalized).__name__}")
        if output is None:
            rows = unfinalized.gemm2_permuted
            output = rows.new_empty((unfinalized.num_tokens, rows.shape[1]))
        self.post_gemm2_hook(unfinalized, output)
        return output

    def supports_packed_ue8m0_act_scales(self) -> bool:
        return False

    def enable_chunking(self) -> bool:
        return chunking_enabled_from_env() and self.supports_chunking()


class FusedMoEExpertsModular(FusedMoEExperts):
    """[Permute-Experts-Unpermute] on topk ids and weights (seed 002)."""

    @staticmethod
    def is_monolithic() -> bool:
        return False

    def moe_problem_size(
        self, a1: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor
    ) -> tuple[int, int, int, int, int]:
        """``(E, M, N, K, topk)`` from the operands; for the batched format M is max tokens per expert."""
        if w1.dim() != 3 or w2.dim() != 3:
            raise ValueError(f"w1 and w2 must be 3-D (E, N, K) / (E, K, N/2), got {tuple(w1.shape)}, {tuple(w2.shape)}")
        E, N, _ = w1.size()
        K = a1.size(-1)
        if a1.dim() == 2:
            if topk_ids.size(0) != a1.size(0):
                raise ValueError(f"topk_ids has {topk_ids.size(0)} rows but hidden_states has {a1.size(0)}")
            M = a1.size(0)
        else:
            if a1.dim() != 3 or a1.size(0) != E:
                raise ValueError(f"batched hidden_states must be (E={E}, max_tokens, K), got {tuple(a1.shape)}")
            M = a1.size(1)
        if topk_ids.dim() != 2:
            raise ValueError(f"topk_ids must be 2-D (M, topk), got {tuple(topk_ids.shape)}")
        return E, M, N, K, topk_ids.size(1)

    def workspace_dtype(self, act_dtype: torch.dtype) -> torch.dtype:
        return act_dtype

    def output_hidden_dim(self, hidden_dim: int) -> int:
        """Hidden size of the finalized output (vLLM 0.33). Experts that drop a hidden padding (their K is padded
        for the kernel, e.g. TRTLLM MXFP4 2880 -> 3072) return the unpadded size; the 0.33 kernel allocates the
        output, and the M == 0 result, with it. Under 0.17 the output is always ``(M, K)``."""
        return hidden_dim

    @abstractmethod
    def workspace_shapes(
        self,
        M: int,
        N: int,
        K: int,
        topk: int,
        global_num_experts: int,
        local_num_experts: int,
        expert_tokens_meta: ExpertTokensMetadata | None,
        activation: MoEActivation,
    ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """``(workspace13, workspace2, output)`` shapes; the first dim of a non-empty shape is a token count so that
        chunking can slice it."""
        raise NotImplementedError

    @staticmethod
    def adjust_N_for_activation(N: int, activation: MoEActivation) -> int:
        return adjust_N_for_activation(N, activation)

    @property
    def activation_config(self) -> ApplyMoEActivationConfig:
        """vLLM 0.33's ``self.activation_config`` (built in ``__init__`` upstream): the quant config's ``gemm1_*``
        else the layer's ``swiglu_*`` (``ApplyMoEActivationConfig.from_configs``)."""
        return ApplyMoEActivationConfig.from_configs(self.moe_config, self.quant_config)

    def activation(
        self,
        activation: MoEActivation,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        topk_ids: torch.Tensor | None = None,
        expert_map: torch.Tensor | None = None,
        valid_token_counts: torch.Tensor | None = None,
    ) -> None:
        """Write ``activation(input)`` into ``output`` (point ``activation.experts_signature``).

        0.17 (the seed's signature): every row of the 2-D ``input``, with the quant config's ``gemm1_alpha`` /
        ``gemm1_beta`` / ``gemm1_clamp_limit``; the three keywords raise SemanticsError.
        0.33: ``reference.activation.apply_moe_activation_into`` with ``self.activation_config`` (masked batched
        inputs: rows past ``valid_token_counts`` untouched; the pad-aware limit with ``topk_ids`` + ``expert_map``).
        """
        if current_semantics() < SemanticsVersion.V0_33:
            given = [n for n, v in (("topk_ids", topk_ids), ("expert_map", expert_map),
                                    ("valid_token_counts", valid_token_counts)) if v is not None]
            if given:
                from reference.semantics import require

                require(f"FusedMoEExpertsModular.activation({', '.join(given)}=...)", "0.33",
                        upstream="vllm/model_executor/layers/fused_moe/modular_kernel.py")
            qc = self.quant_config
            output.copy_(
                apply_moe_activation(
                    activation, input, alpha=qc.gemm1_alpha, beta=qc.gemm1_beta, limit=qc.gemm1_clamp_limit,
                    situ_beta=self.moe_config.activation_situ_beta,
                    situ_linear_beta=self.moe_config.activation_situ_linear_beta,
                )
            )
            return
        apply_moe_activation_into(activation, output, input, activation_config=self.activation_config,
                                  topk_ids=topk_ids, expert_map=expert_map, valid_token_counts=valid_token_counts)

    @abstractmethod
    def finalize_weight_and_reduce_impl(self) -> TopKWeightAndReduce:
        raise NotImplementedError

    @abstractmethod
    def apply(
        self,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: MoEActivation,
        global_num_experts: int,
        expert_map: torch.Tensor | None,
        a1q_scale: torch.Tensor | None,
        a2_scale: torch.Tensor | None,
        workspace13: torch.Tensor,
        workspace2: torch.Tensor,
        expert_tokens_meta: ExpertTokensMetadata | None,
        apply_router_weight_on_input: bool,
    ) -> UnfinalizedMoEOutput | None:
        """Compute the experts for one chunk (0.17) or the whole call (0.33), writing ``output`` (shape from
        ``workspace_shapes``) and returning None; under 0.33 an implementation that stopped after GEMM2 leaves
        ``output`` untouched and returns the ``UnfinalizedMoEOutput`` instead (deferred finalize)."""
        raise NotImplementedError


class FusedMoEExpertsMonolithic(FusedMoEExperts):
    """Experts that route themselves: take router logits instead of topk ids/weights (seed 002)."""

    @staticmethod
    def is_monolithic() -> bool:
        return True

    @staticmethod
    def _supports_routing_method(routing_method, weight_key, activation_key) -> bool:
        raise NotImplementedError("monolithic kernels must opt in to routing methods")

    @staticmethod
    def _supports_router_logits_dtype(router_logits_dtype, routing_method) -> bool:
        raise NotImplementedError("monolithic kernels must opt in to router logits dtypes")

    def supports_routing_replay_capture(self) -> bool:
        """vLLM 0.33: whether ``apply`` writes each token's routed expert ids into ``routing_replay_out`` (so a
        ``RoutedExpertsSink`` can capture them). Default False."""
        return False

    @abstractmethod
    def apply(
        self,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        router_logits: torch.Tensor,
        activation: MoEActivation,
        global_num_experts: int,
        expert_map: torch.Tensor | None,
        a1q_scale: torch.Tensor | None,
        apply_router_weight_on_input: bool,
        num_expert_group: int | None = None,
        e_score_correction_bias: torch.Tensor | None = None,
        routed_scaling_factor: float | None = None,
        topk_group: int | None = None,
        routing_replay_out: torch.Tensor | None = None,
        **hash_kwargs,
    ) -> torch.Tensor | UnfinalizedMoEOutput:
        """Route and compute (vLLM ``FusedMoEExpertsMonolithic.apply``). 0.33: ``routing_replay_out`` (``(M, topk)``
        int16, given only to classes that ``supports_routing_replay_capture``) receives the routed logical expert
        ids; ``input_ids`` / ``hash_indices_table`` arrive as keywords only for classes that
        ``_supports_hash_routing`` and a layer with a hash table; the result may be an ``UnfinalizedMoEOutput``
        (deferred finalize)."""
        raise NotImplementedError
