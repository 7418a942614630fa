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

Not modelled: async prepare/finalize (a ``supports_async`` prepare/finalize runs synchronously), DBO, all2all
dispatch across real ranks (``reference.distributed`` does it over torch.distributed), the workspace manager
(buffers are allocated per call, with the same sharing rules).
"""

from __future__ import annotations

import enum
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from math import prod
from typing import Callable, ClassVar

import torch

from reference.activation import MoEActivation, adjust_N_for_activation, apply_moe_activation
from reference.config import FusedMoEConfig, FusedMoEParallelConfig, FusedMoEQuantConfig
from reference.quant.moe import moe_kernel_quantize_input
from reference.moe_output import UnfinalizedMoEOutput, moe_fused_mul_sum, route_major_moe_output
from reference.routing import RoutingMethodType
from reference.semantics import SemanticsError, SemanticsVersion, register_point, resolve_semantics
from reference.shared_experts import SharedExperts, SharedExpertsOrder

__all__ = [
    "ExpertTokensMetadata",
    "FusedMoEActivationFormat",
    "FusedMoEExperts",
    "SupportRecord",
    "FusedMoEExpertsModular",
    "FusedMoEExpertsMonolithic",
    "TopKWeightAndReduce",
    "TopKWeightAndReduceNoOP",
    "TopKWeightAndReduceContiguous",
    "TopKWeightAndReduceNaiveBatched",
    "TopKWeightAndReduceDelegate",
    "FusedMoEPrepareAndFinalize",
    "FusedMoEPrepareAndFinalizeModular",
    "FusedMoEPrepareAndFinalizeMonolithic",
    "MoEPrepareAndFinalizeNoEP",
    "FusedMoEKernel",
    "moe_kernel_quantize_input",
    "chunk_size_from_env",
    "chunking_enabled_from_env",
    "cdiv",
    "UnfinalizedMoEOutput",
    "route_major_moe_output",
    "moe_fused_mul_sum",
    "SharedExperts",
    "SharedExpertsOrder",
]

DEFAULT_CHUNK_SIZE = 16 * 1024


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def chunk_size_from_env() -> int:
    """``VLLM_FUSED_MOE_CHUNK_SIZE`` (default 16*1024), as vLLM 0.17's ``envs`` reads it."""
    value = int(os.environ.get("VLLM_FUSED_MOE_CHUNK_SIZE", DEFAULT_CHUNK_SIZE))
    if value < 1:
        raise ValueError(f"VLLM_FUSED_MOE_CHUNK_SIZE must be >= 1, got {value}")
    return value


def chunking_enabled_from_env() -> bool:
    """``VLLM_ENABLE_FUSED_MOE_ACTIVATION_CHUNKING`` (default on; "0"/"false" switch it off)."""
    return os.environ.get("VLLM_ENABLE_FUSED_MOE_ACTIVATION_CHUNKING", "1").lower() not in ("0", "false", "no")


@dataclass
class ExpertTokensMetadata:
    """Tokens routed to each local expert: ``expert_num_tokens`` int32 ``(E_local,)`` on the device, and an
    optional CPU copy (some kernels size buffers from it)."""

    expert_num_tokens: torch.Tensor
    expert_num_tokens_cpu: torch.Tensor | None

    @staticmethod
    def make_from_list(expert_num_tokens_list: list[int], device: str | torch.device) -> "ExpertTokensMetadata":
        cpu = torch.tensor(expert_num_tokens_list, device="cpu", dtype=torch.int32)
        return ExpertTokensMetadata(expert_num_tokens=cpu.to(device), expert_num_tokens_cpu=cpu)


class FusedMoEActivationFormat(enum.Enum):
    """Standard: ``(num_tokens, hidden)``. BatchedExperts: ``(num_local_experts, max_tokens_per_expert, hidden)``."""

    Standard = ("standard",)
    BatchedExperts = ("batched_experts",)


# ------------------------------------------------------------------------------------------------------------
# Weight application and reduction
# ------------------------------------------------------------------------------------------------------------


class TopKWeightAndReduce(ABC):
    """Applies topk weights to the experts' output and/or reduces over topk (seed 002)."""

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

    ``rank`` and ``expert_map`` say which global experts are local (first ``E_local`` global ids when no map).
    """

    def __init__(self, rank: int = 0, expert_map: torch.Tensor | None = None):
        self.rank = rank
        self.expert_map = expert_map

    def apply(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input):
        E_local, _, K = fused_expert_output.shape
        M = topk_ids.shape[0]
        acc = torch.zeros(M, K, dtype=torch.float32, device=fused_expert_output.device)
        for e in range(E_local):
            g = e if self.expert_map is None else int((self.expert_map == e).nonzero()[0])
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


# ------------------------------------------------------------------------------------------------------------
# Experts
# ------------------------------------------------------------------------------------------------------------


_ALL_ACT_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})


@dataclass(frozen=True)
class SupportRecord:
    """What an experts class claims, as data: the seed's ``_supports_*`` predicates and ``is_supported_config`` derive
    from it (``FusedMoEExperts``), the conformance matrix prints it, and conformance enumerates its cases from it (every
    claimed scheme x activation x expert map x token regime; ``conformance/cases.py``), and the fuzz draws inside it.

    Fields (None = no restriction):
        activation_format: Standard or BatchedExperts (seed 002 ``activation_format``).
        quant_schemes: claimed ``(weight_key, activation_key)`` pairs of ``reference.quant.keys.QuantKey`` (``(None,
            None)`` = unquantized). ``key_match`` compares keys when plain equality is too strict.
        activations: claimed ``MoEActivation`` values.
        act_dtypes: activation (hidden_states) dtypes the class computes in.
        no_act_and_mul: non-gated MLPs (``*_NO_MUL`` activations) claimed (``_supports_no_act_and_mul``).
        expert_map: EP shards with an ``expert_map`` (``supports_expert_map``).
        chunking: the modular kernel may chunk the tokens (``supports_chunking``).
        device: availability probe: returns None where the class runs, else why not (``_supports_current_device`` and
            its detail); None = any device.
        parallel_config: predicate on ``FusedMoEParallelConfig`` (``_supports_parallel_config``).
        hidden_dim_multiple: K must be a multiple of this (``_supports_shape``).
        min_tokens / max_tokens: token range of one call (None: unbounded).
        finalize: what ``apply`` leaves for finalize, e.g. "reduced (TopKWeightAndReduceNoOP)".
        router_weight_rounding: where the router weight meets GEMM2's rounding: "reference" (y rounded, weighted in
            fp32), "before_store" (vLLM fused_moe_kernel MUL_ROUTED_WEIGHT: w * y rounded) or "output_dtype"
            (TopKWeightAndReduceContiguous: y rounded, then w * y in the output dtype); reference.error_model allows
            the vLLM forms one more independent rounding per term.
        deferred_finalize: vLLM 0.33: ``apply`` honours ``post_gemm2_hook`` (hands it the route-major
            ``UnfinalizedMoEOutput`` instead of reducing); conformance/test_modular_033.py checks it when claimed.
        hidden_padding: vLLM 0.33: ``output_hidden_dim`` drops a hidden padding (``moe_config.hidden_dim`` smaller
            than the K the kernel runs at); checked by conformance when claimed.
        notes: one line for the matrix (recipes, limits not expressible above).
    """

    activation_format: "FusedMoEActivationFormat"
    quant_schemes: frozenset | None = None
    activations: frozenset | None = None
    act_dtypes: frozenset = _ALL_ACT_DTYPES
    no_act_and_mul: bool = True
    expert_map: bool = True
    chunking: bool = True
    device: Callable[[], str | None] | None = None
    parallel_config: Callable[[FusedMoEParallelConfig], bool] | None = None
    hidden_dim_multiple: int = 1
    min_tokens: int = 0
    max_tokens: int | None = None
    key_match: Callable | None = field(default=None, compare=False)
    finalize: str = ""
    router_weight_rounding: str = "reference"
    deferred_finalize: bool = False
    hidden_padding: bool = False
    notes: str = ""

    def claims_quant(self, weight_key, activation_key) -> bool:
        if self.quant_schemes is None:
            return True
        if self.key_match is None:
            return (weight_key, activation_key) in self.quant_schemes
        return any(self.key_match(weight_key, w) and self.key_match(activation_key, a) for w, a in self.quant_schemes)

    def claims_activation(self, activation: MoEActivation) -> bool:
        if self.activations is not None and activation not in self.activations:
            return False
        return activation.is_gated or self.no_act_and_mul

    def device_reason(self) -> str | None:
        return None if self.device is None else self.device()

    def describe(self) -> dict[str, str]:
        """The claims as short strings, for reports (``conformance.report``)."""
        def keys(pair):
            w, a = pair
            return "unquantized" if w is None and a is None else f"{w!r} x {a!r}"

        def dtype(d):
            return str(d).removeprefix("torch.")

        return {
            "format": self.activation_format.name,
            "quant schemes": "any" if self.quant_schemes is None else "; ".join(sorted(map(keys, self.quant_schemes))),
            "activations": "any" if self.activations is None else ", ".join(sorted(a.name for a in self.activations)),
            "act dtypes": ", ".join(sorted(map(dtype, self.act_dtypes))),
            "expert_map": "yes" if self.expert_map else "no",
            "chunking": "yes" if self.chunking else "no",
            "device": "any" if self.device is None else "probe",
            "hidden dim": "any" if self.hidden_dim_multiple == 1 else f"multiple of {self.hidden_dim_multiple}",
            "tokens": f"{self.min_tokens}..{'' if self.max_tokens is None else self.max_tokens}",
            "finalize": self.finalize or "-",
            "router weight": self.router_weight_rounding,
            "deferred finalize": "yes" if self.deferred_finalize else "no",
            "hidden padding": "yes" if self.hidden_padding else "no",
            "notes": self.notes or "-",
        }


class FusedMoEExperts(ABC):
    """Base of every experts implementation (seed 002 ``FusedMoEExperts``).

    Subclasses declare support through the static ``_supports_*`` predicates; ``is_supported_config`` combines them
    into the oracle vLLM uses to pick a kernel, and conformance checks the claims (claimed -> must pass; not
    claimed -> must raise).

    Raises (``__init__``): ValueError when ``max_num_tokens`` / ``num_dispatchers`` are given for the Standard format
    or missing for the BatchedExperts format.
    """

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
            return False, _make_reason(f"quantization scheme {weight_key}x{activation_key}")
        if not cls._supports_parallel_config(moe_config.moe_parallel_config):
            return False, _make_reason(f"parallel config {moe_config.moe_parallel_config}")
        if not cls._supports_routing_method(moe_config.routing_method, weight_key, activation_key):
            return False, _make_reason(f"routing method {moe_config.routing_method}")
        if not cls._supports_router_logits_dtype(moe_config.router_logits_dtype, moe_config.routing_method):
            return False, _make_reason(f"router logits dtype {moe_config.router_logits_dtype}")
        if not cls._supports_shape(moe_config.hidden_dim):
            return False, _make_reason(f"{moe_config.hidden_dim} hidden dim is not supported")
        if activation_format != cls.activation_format():
            return False, _make_reason(f"{activation_format.value} activation format")
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

    def activation(self, activation: MoEActivation, output: torch.Tensor, input: torch.Tensor) -> None:
        qc = self.quant_config
        output.copy_(
            apply_moe_activation(
                activation, input, alpha=qc.gemm1_alpha, beta=qc.gemm1_beta, limit=qc.gemm1_clamp_limit
            )
        )

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
    ) -> torch.Tensor:
        raise NotImplementedError


# ------------------------------------------------------------------------------------------------------------
# Prepare / finalize
# ------------------------------------------------------------------------------------------------------------


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


def _apply_router_weight_on_input(a1: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """``a1 * w`` in a1's dtype (vLLM rounds the weight to a1's dtype first). Only defined for topk == 1."""
    if topk_weights.dim() != 2 or topk_weights.size(1) != 1:
        raise ValueError(
            f"apply_router_weight_on_input is only supported for topk == 1, got topk_weights {tuple(topk_weights.shape)}"
        )
    return a1 * topk_weights.to(a1.dtype)


class MoEPrepareAndFinalizeNoEP(FusedMoEPrepareAndFinalizeModular):
    """No dispatch: optionally apply the router weight on the input (topk == 1), quantize a1, and in finalize run
    the experts' ``TopKWeightAndReduce`` (``Delegate`` -> ``Contiguous``). Mirrors vLLM ``MoEPrepareAndFinalizeNoEP``.
    """

    @property
    def activation_format(self) -> FusedMoEActivationFormat:
        return FusedMoEActivationFormat.Standard

    def topk_indices_dtype(self):
        return None

    def max_num_tokens_per_rank(self):
        return None

    def num_dispatchers(self) -> int:
        return 1

    def supports_deferred_moe_finalize(self) -> bool:
        # finalize here is the top-k weight-and-reduce and nothing else: exactly what a deferring consumer takes
        # over (vLLM 0.33 MoEPrepareAndFinalizeNoDPEPModular).
        return True

    def output_is_reduced(self) -> bool:
        return False

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant_config, defer_input_quant=False):
        if apply_router_weight_on_input:
            a1 = _apply_router_weight_on_input(a1, topk_weights)
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
        if isinstance(weight_and_reduce_impl, TopKWeightAndReduceDelegate):
            weight_and_reduce_impl = TopKWeightAndReduceContiguous()
        weight_and_reduce_impl.apply(output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input)


# ------------------------------------------------------------------------------------------------------------
# The kernel
# ------------------------------------------------------------------------------------------------------------


def _slice_scales(scales: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    """Per-token scales follow the token chunk; a single (per-tensor) scale is shared by every chunk."""
    if scales is None or scales.numel() == 1:
        return scales
    return scales[start:end]


def _resize_cache(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A view of the first ``prod(shape)`` elements of workspace ``x`` with ``shape`` (vLLM ``_resize_cache``)."""
    n = prod(shape)
    if n > x.numel():
        raise ValueError(f"workspace of {x.numel()} elements is too small for {shape}")
    return x.flatten()[:n].view(*shape)


class FusedMoEKernel:
    """prepare -> experts -> finalize (seed 002 ``FusedMoEKernel`` + ``...ModularImpl``), per semantics version:
    0.17 chunks the experts over tokens, 0.33 runs them once (see the module docstring for every 0.33 change).

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
        ValueError: mismatched monolithic/modular pair or activation formats, inplace with shared experts.
        SemanticsError (a ValueError): ``shared_experts``, ``inplace`` or ``chunk_size`` under 0.33.
    """

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
        self.shared_experts = shared_experts
        self.moe_parallel_config = moe_parallel_config
        self.inplace = inplace
        # 0.33 reads no chunk size (no VLLM_FUSED_MOE_CHUNK_SIZE): None marks "no chunking".
        if self.semantics >= SemanticsVersion.V0_33:
            self.chunk_size = None
        else:
            self.chunk_size = chunk_size_from_env() if chunk_size is None else chunk_size
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        self.poison = poison
        prepare_finalize.post_init_setup(fused_experts)
        if prepare_finalize.activation_format != fused_experts.activation_format():
            raise ValueError(
                f"prepare_finalize produces {prepare_finalize.activation_format} but the experts expect "
                f"{fused_experts.activation_format()}"
            )

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
        chunked = self.chunk_size is not None and self.fused_experts.enable_chunking()
        CHUNK_SIZE = max(1, min(M, self.chunk_size) if chunked else M)
        num_chunks = cdiv(M, CHUNK_SIZE)
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

    def _allocate_buffers(self, out_dtype, device, M_chunk, M_full, N, K, top_k, global_num_experts,
                          local_num_experts, expert_tokens_meta, activation):
        num_chunks, _ = self._chunk_info(M_full)
        ws_dtype = self.fused_experts.workspace_dtype(out_dtype)
        fe = self.fused_experts
        ws13_shape, ws2_shape, _ = fe.workspace_shapes(
            M_chunk, N, K, top_k, global_num_experts, local_num_experts, expert_tokens_meta, activation
        )
        _, _, out_shape = fe.workspace_shapes(
            M_full, N, K, top_k, global_num_experts, local_num_experts, expert_tokens_meta, activation
        )
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

    def _fused_experts(self, in_dtype, a1q, a1q_scale, w1, w2, topk_weights, topk_ids, activation,
                       global_num_experts, local_num_experts, expert_map, apply_router_weight_on_input,
                       expert_tokens_meta):
        fe = self.fused_experts
        _, M_full, N, K, top_k = fe.moe_problem_size(a1q, w1, w2, topk_ids)
        if a1q.dim() == 2 and a1q.size(0) == 0:  # batched slots may hold other ranks' tokens when this has none
            M_full = 0
        num_chunks, CHUNK_SIZE = self._chunk_info(M_full)
        if M_full == 0:
            return torch.empty(a1q.shape[:-1] + (K,), dtype=in_dtype, device=a1q.device)
        ws13, ws2, fused_out = self._allocate_buffers(
            in_dtype, a1q.device, CHUNK_SIZE, M_full, N, K, top_k, global_num_experts, local_num_experts,
            expert_tokens_meta, activation,
        )
        for chunk_idx in range(num_chunks):
            if num_chunks == 1:
                s, e = 0, a1q.size(0)  # batched format does not keep M in dim 0
            else:
                s = chunk_idx * CHUNK_SIZE
                e = min(s + CHUNK_SIZE, M_full)
            c_meta = self._slice_expert_tokens_metadata(
                num_chunks, expert_tokens_meta, topk_ids[s:e], local_num_experts, expert_map
            )
            c_out = self._slice_output_tensor(fused_out, chunk_idx, num_chunks, CHUNK_SIZE, M_full)
            ret = fe.apply(
                output=c_out,
                hidden_states=a1q[s:e],
                w1=w1,
                w2=w2,
                topk_weights=topk_weights[s:e],
                topk_ids=topk_ids[s:e],
                activation=activation,
                global_num_experts=global_num_experts,
                expert_map=expert_map,
                a1q_scale=_slice_scales(a1q_scale, s, e),
                a2_scale=_slice_scales(fe.a2_scale, s, e),
                workspace13=ws13,
                workspace2=ws2,
                expert_tokens_meta=c_meta,
                apply_router_weight_on_input=apply_router_weight_on_input,
            )
            if isinstance(ret, UnfinalizedMoEOutput):
                raise SemanticsError(f"{type(fe).__name__}.apply returned an UnfinalizedMoEOutput: deferred finalize "
                                     "is vLLM 0.33 semantics (fused_moe/moe_output.py); the 0.17 kernel needs the "
                                     "experts to write their output")
        return fused_out

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
        args = (hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map,
                apply_router_weight_on_input, shared_experts_input)
        if self.semantics >= SemanticsVersion.V0_33:
            return self._apply_033(*args, shared_experts)
        if shared_experts is not None:
            raise SemanticsError("apply(shared_experts=SharedExperts) is vLLM 0.33 semantics; the 0.17 kernel takes "
                                 "a shared-experts callable in its constructor")
        return self._apply_017(*args)

    def _prepare(self, hidden_states, topk_weights, topk_ids, global_num_experts, expert_map,
                 apply_router_weight_on_input):
        a1q, a1q_scale, meta, d_ids, d_weights = self.prepare_finalize.prepare(
            hidden_states, topk_weights, topk_ids, global_num_experts, expert_map, apply_router_weight_on_input,
            self.fused_experts.quant_config, defer_input_quant=self.fused_experts.expects_unquantized_inputs,
        )
        # Dispatching prepare/finalizes hand back the topk ids and weights of the tokens they gathered.
        topk_ids = topk_ids if d_ids is None else d_ids
        topk_weights = topk_weights if d_weights is None else d_weights
        return a1q, a1q_scale, meta, topk_ids, topk_weights

    def _apply_017(self, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map,
                   apply_router_weight_on_input, shared_experts_input):
        """vLLM 0.17: chunked experts, inplace, constructor shared experts, supports_expert_map checked."""
        if expert_map is not None and not self.fused_experts.supports_expert_map():
            raise ValueError(f"{type(self.fused_experts).__name__} does not support expert_map")
        output = hidden_states if self.inplace else torch.empty_like(hidden_states)
        local_num_experts = w1.size(0)
        if global_num_experts == -1:
            global_num_experts = local_num_experts
        a1q, a1q_scale, meta, topk_ids, topk_weights = self._prepare(
            hidden_states, topk_weights, topk_ids, global_num_experts, expert_map, apply_router_weight_on_input)
        fused_out = self._fused_experts(
            hidden_states.dtype, a1q, a1q_scale, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
            local_num_experts, expert_map, apply_router_weight_on_input, meta,
        )
        # Finalize always runs across ranks: a rank without tokens still takes part in the combine (seed 002).
        if hidden_states.size(0) > 0 or self.prepare_finalize.num_dispatchers() > 1:
            self.prepare_finalize.finalize(
                output, fused_out, topk_weights, topk_ids, apply_router_weight_on_input,
                self.fused_experts.finalize_weight_and_reduce_impl(),
            )
        if self.shared_experts is None:
            return output
        se_in = shared_experts_input if shared_experts_input is not None else hidden_states
        return self.shared_experts(se_in), output

    # --- vLLM 0.33 -------------------------------------------------------------------------------------------
    def _allocate_buffers_033(self, out_dtype, device, M, N, K, top_k, global_num_experts, local_num_experts,
                              expert_tokens_meta, activation, output):
        """Workspaces and the experts' output for one unchunked call (0.33 ``_allocate_buffers`` with M_chunk ==
        M_full, plus the output aliasing of ``_fused_experts``).

        The experts' output is, in order of preference: the prepare/finalize's ``allocate_fused_expert_output``
        buffer (validated); the caller's ``output`` when it has exactly the experts' output shape and dtype (the
        experts then write the final output directly and a NoOP finalize copies nothing); a view of workspace13's
        memory (GEMM1's result is dead by the time the output is written).
        """
        fe = self.fused_experts
        ws_dtype = fe.workspace_dtype(out_dtype)
        ws13_shape, ws2_shape, out_shape = fe.workspace_shapes(
            M, N, K, top_k, global_num_experts, local_num_experts, expert_tokens_meta, activation)
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
        elif (tuple(output.shape) == tuple(out_shape) and output.dtype == ws_dtype and output.is_contiguous()):
            fused_out = output
            ws13 = torch.empty(ws13_shape, dtype=ws_dtype, device=device)
        else:
            common = torch.empty(max(prod(ws13_shape), prod(out_shape)), dtype=ws_dtype, device=device)
            ws13 = _resize_cache(common, ws13_shape)
            fused_out = _resize_cache(common, out_shape)
        ws2 = torch.empty(ws2_shape, dtype=ws_dtype, device=device)
        self._poison(ws13, ws2, fused_out)
        return ws13, ws2, fused_out

    def _fused_experts_033(self, in_dtype, a1q, a1q_scale, w1, w2, topk_weights, topk_ids, activation,
                           global_num_experts, local_num_experts, expert_map, apply_router_weight_on_input,
                           expert_tokens_meta, output):
        """One experts call over every token (no chunk loop): a dynamic per-tensor scale of GEMM2's input is the
        amax over the whole call. Returns the experts' output buffer or their ``UnfinalizedMoEOutput``."""
        fe = self.fused_experts
        _, M_full, N, K, top_k = fe.moe_problem_size(a1q, w1, w2, topk_ids)
        if a1q.dim() == 2 and a1q.size(0) == 0:
            M_full = 0
        if M_full == 0:
            # No token reached this rank: return before allocating anything or calling the experts.
            # K of the problem, not a1q's last dimension: packed FP4 activations hold K / 2 bytes per row.
            out_dim = fe.output_hidden_dim(K)
            return torch.empty((*a1q.shape[:-1], out_dim), dtype=in_dtype, device=a1q.device)
        ws13, ws2, fused_out = self._allocate_buffers_033(
            in_dtype, a1q.device, M_full, N, K, top_k, global_num_experts, local_num_experts, expert_tokens_meta,
            activation, output)
        unfinalized = fe.apply(
            output=fused_out, hidden_states=a1q, w1=w1, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids,
            activation=activation, global_num_experts=global_num_experts, expert_map=expert_map,
            a1q_scale=a1q_scale, a2_scale=fe.a2_scale, workspace13=ws13, workspace2=ws2,
            expert_tokens_meta=expert_tokens_meta, apply_router_weight_on_input=apply_router_weight_on_input,
        )
        if isinstance(unfinalized, UnfinalizedMoEOutput):
            return unfinalized  # the experts wrote nothing; the top-k reduction belongs to whoever takes this
        return fused_out

    def _apply_033(self, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map,
                   apply_router_weight_on_input, shared_experts_input, shared_experts):
        """vLLM 0.33 ``FusedMoEKernelModularImpl.apply``."""
        fe = self.fused_experts
        output = hidden_states.new_empty((*hidden_states.shape[:-1], fe.output_hidden_dim(hidden_states.size(-1))))
        local_num_experts = w1.size(0)
        if global_num_experts == -1:
            global_num_experts = local_num_experts
        a1q, a1q_scale, meta, topk_ids, topk_weights = self._prepare(
            hidden_states, topk_weights, topk_ids, global_num_experts, expert_map, apply_router_weight_on_input)
        fused_out = self._fused_experts_033(
            hidden_states.dtype, a1q, a1q_scale, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
            local_num_experts, expert_map, apply_router_weight_on_input, meta, output)
        if isinstance(fused_out, UnfinalizedMoEOutput):
            # Nothing below can run on an unfinalized output: finalize (top-k reduction, combine) is the consumer's.
            if not self.prepare_finalize.supports_deferred_moe_finalize():
                raise ValueError(f"{type(self.prepare_finalize).__name__} cannot pass through a deferred MoE output "
                                 f"(supports_deferred_moe_finalize() is False) but {type(fe).__name__} returned one")
            return fused_out
        self.prepare_finalize.finalize(output, fused_out, topk_weights, topk_ids, apply_router_weight_on_input,
                                       fe.finalize_weight_and_reduce_impl())
        if shared_experts is not None and self.can_overlap_shared_experts:
            # Upstream launches finalize asynchronously and runs the shared experts before receiving it; the result
            # is the same in any order on one stream.
            shared_experts(shared_experts_input if shared_experts_input is not None else hidden_states,
                           SharedExpertsOrder.MK_INTERNAL_OVERLAPPED)
        return output

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
                         routed_scaling_factor=None, topk_group=None):
        """Monolithic path: ``prepare`` (quantize) -> experts route + compute -> ``finalize``."""
        if not self.is_monolithic:
            raise ValueError("this kernel is modular: call apply with topk ids and weights")
        a1q, a1q_scale, router_logits = self.prepare_finalize.prepare(
            hidden_states, router_logits, self.fused_experts.quant_config,
            defer_input_quant=self.fused_experts.expects_unquantized_inputs,
        )
        out = self.fused_experts.apply(
            hidden_states=a1q, w1=w1, w2=w2, router_logits=router_logits, activation=activation,
            global_num_experts=global_num_experts, expert_map=expert_map, a1q_scale=a1q_scale,
            apply_router_weight_on_input=apply_router_weight_on_input, num_expert_group=num_expert_group,
            e_score_correction_bias=e_score_correction_bias, routed_scaling_factor=routed_scaling_factor,
            topk_group=topk_group,
        )
        return self.prepare_finalize.finalize(out)


# ------------------------------------------------------------------------------------------------------------
# Semantics points (reference.semantics; docs/SEMANTICS.md)
# ------------------------------------------------------------------------------------------------------------

_MK017 = "vLLM 0.17.0 fused_moe/modular_kernel.py"
_MK033 = "vLLM 0.33.0 fused_moe/modular_kernel.py"

register_point(
    "modular.activation_chunking", component="modular",
    behaviour={"0.17": "FusedMoEKernel chunks the experts over tokens (chunk_size, VLLM_FUSED_MOE_CHUNK_SIZE default "
                       "16*1024, VLLM_ENABLE_FUSED_MOE_ACTIVATION_CHUNKING, supports_chunking); per-chunk "
                       "ExpertTokensMetadata; a dynamic per-tensor a2 scale is one per chunk; inplace allowed.",
               "0.33": "no chunking: one experts call over all M tokens (chunk_size raises, the environment "
                       "variables are not read); a dynamic per-tensor a2 scale spans the whole call; no inplace."},
    upstream={"0.17": _MK017 + " (FusedMoEModularKernel._chunk_info, _slice_*)",
              "0.33": _MK033 + " (FusedMoEKernelModularImpl._fused_experts: M_chunk == M_full)"},
    reference="reference.modular.FusedMoEKernel")
register_point(
    "modular.supports_expert_map", component="modular",
    behaviour={"0.17": "FusedMoEExperts.supports_expert_map() (from SupportRecord.expert_map); the kernel raises "
                       "ValueError for an expert_map given to experts that do not support it.",
               "0.33": "not in the base class and never called by the kernel; the reference keeps the claim as "
                       "SupportRecord.expert_map (conformance derives EP cases from it) and the 0.33 kernel does not "
                       "check it."},
    upstream={"0.17": _MK017 + " (FusedMoEExperts.supports_expert_map)",
              "0.33": _MK033 + " (absent; kept unused by experts/cpu_moe.py, b12x.py, trtllm_mxint4_moe.py, ...)"},
    reference="reference.modular.FusedMoEExperts.supports_expert_map")
register_point(
    "modular.deferred_finalize", component="modular",
    behaviour={"0.17": "experts always write their output; an UnfinalizedMoEOutput raises SemanticsError.",
               "0.33": "experts may return an UnfinalizedMoEOutput (permuted unweighted GEMM2 rows, weights, int32 "
                       "permute map, -1 = not local) or hand it to post_gemm2_hook; the kernel returns it when "
                       "prepare_finalize.supports_deferred_moe_finalize() (NoEP: True), else raises; "
                       "UnfinalizedMoEOutput.finalize is the top-k reduction the consumer owes."},
    upstream={"0.17": _MK017 + " (absent)",
              "0.33": _MK033 + ", fused_moe/moe_output.py, prepare_finalize/no_dp_ep.py"},
    reference="reference.moe_output.UnfinalizedMoEOutput / reference.modular.FusedMoEKernel")
register_point(
    "modular.output_hidden_dim", component="modular",
    behaviour={"0.17": "the output is (M, K) like hidden_states (or hidden_states itself when inplace).",
               "0.33": "the output is (M, fused_experts.output_hidden_dim(K)) (experts may drop a hidden padding); "
                       "prepare_finalize.allocate_fused_expert_output may supply the experts' output buffer; the "
                       "caller's output is the experts' buffer when the shapes match."},
    upstream={"0.17": _MK017,
              "0.33": _MK033 + " (output_hidden_dim, _allocate_buffers), experts/trtllm_mxfp4_moe.py, "
                               "prepare_finalize/naive_dp_ep.py"},
    reference="reference.modular.FusedMoEExpertsModular.output_hidden_dim")
register_point(
    "modular.empty_batch", component="modular",
    behaviour={"0.17": "M == 0: zero chunks, no experts call; finalize only when num_dispatchers() > 1.",
               "0.33": "M == 0: _fused_experts returns an empty (0, output_hidden_dim(K)) tensor before allocating "
                       "or calling the experts; finalize still runs."},
    upstream={"0.17": _MK017, "0.33": _MK033 + " (_fused_experts: 'if M_full == 0')"},
    reference="reference.modular.FusedMoEKernel._fused_experts_033")
register_point(
    "modular.shared_experts_order", component="modular",
    behaviour={"0.17": "a shared-experts callable given to the kernel runs after the routed experts; apply returns "
                       "(shared, routed).",
               "0.33": "SharedExperts picks one order per call (NO_OVERLAP when overlap is disabled, else "
                       "MK_INTERNAL_OVERLAPPED when the prepare/finalize supports async, else "
                       "MULTI_STREAM_OVERLAPPED on a CUDA-like aux stream for M <= 256, else NO_OVERLAP) and runs "
                       "once at that site; the runner adds shared + routed (routed scaled, fp16: shared divided)."},
    upstream={"0.17": _MK017 + " (FusedMoEModularKernel shared_experts)",
              "0.33": "vLLM 0.33.0 fused_moe/runner/shared_experts.py, runner/moe_runner.py, " + _MK033},
    reference="reference.shared_experts.SharedExperts / FusedMoEKernel.forward_with_shared_experts")
register_point(
    "modular.moe_fused_mul_sum", component="modular",
    behaviour={"0.17": "not defined (the experts' moe_sum / TopKWeightAndReduce reduce over top-k).",
               "0.33": "moe_fused_mul_sum: fp32 weighted top-k sum in slot order, skipping -1 and non-local slots; "
                       "all-padding rows and rows past num_valid_tokens are left untouched."},
    upstream={"0.17": "vLLM 0.17.0 (absent)", "0.33": "vLLM 0.33.0 fused_moe/moe_fused_mul_sum.py"},
    reference="reference.moe_output.moe_fused_mul_sum")
