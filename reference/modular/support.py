"""``SupportRecord``: what an experts class claims, as data (this project's form of the seed's ``_supports_*``
predicates; ``reference.modular.FusedMoEExperts`` derives the predicates from it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping

import torch

from reference.activation import MoEActivation
from reference.config import FusedMoEParallelConfig

if TYPE_CHECKING:
    from reference.modular.experts_base import FusedMoEActivationFormat

__all__ = ["ACTIVATION_PARAMS", "SupportRecord"]

_ALL_ACT_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})

#: The activation variants a ``SupportRecord`` claims by name (``activation_params``): ``apply_moe_activation``'s
#: keywords, set in a layer by ``FusedMoEQuantConfig.gemm1_alpha`` / ``gemm1_beta`` / ``gemm1_clamp_limit``.
ACTIVATION_PARAMS = frozenset({"alpha", "beta", "limit"})
_QC_ACTIVATION_PARAMS = {"alpha": "gemm1_alpha", "beta": "gemm1_beta", "limit": "gemm1_clamp_limit"}


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
        activation_params: the activation variants claimed (opt-in: an activation is claimed in its plain form
            only): entries of ``ACTIVATION_PARAMS`` (``"alpha"``, ``"beta"``, ``"limit"``: ``apply_moe_activation``'s
            keywords, ``FusedMoEQuantConfig.gemm1_alpha`` / ``gemm1_beta`` / ``gemm1_clamp_limit``; e.g. SiLU with a
            clamp limit, gpt-oss's SwiGLU with alpha and limit), for every claimed activation, or ``(MoEActivation,
            name)`` pairs for one activation only. ``ACTIVATION_PARAMS`` itself claims every variant.
        ue8m0_scales: the power-of-two (UE8M0) scale variant of the claimed block-scaled FP8 keys
            (``FusedMoEQuantConfig.use_ue8m0``: DeepGEMM's recipe on SM90 / SM100) is claimed too (opt-in: claiming
            ``kFp8Static128BlockSym x kFp8Dynamic128Sym`` claims fp32 scales only).
        notes: one line for the matrix (recipes, limits not expressible above).
        declined: ``{(weight_key, activation_key): reason}`` for unclaimed pairs the class names a reason for (a
            vLLM 0.33 pair that only an SM100 / ROCm / external kernel runs, ...); ``is_supported_config`` adds the
            reason to its refusal. Never a claim: a pair in both ``quant_schemes`` and here is claimed.

    Variants: a configuration the oracle (``is_supported_config``, on vLLM's keys) accepts may still use a variant
    that the keys do not name (an activation parameter, UE8M0 scales); ``variant_reason`` says which one is not
    claimed. Conformance skips an unclaimed variant with that reason (and never calls the kernel on it); on a claimed
    one anything the kernel raises, ``NotImplementedError`` included, is a failure.
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
    activation_params: frozenset = frozenset()
    ue8m0_scales: bool = False
    notes: str = ""
    declined: Mapping = field(default_factory=dict, compare=False)

    def declined_reason(self, weight_key, activation_key) -> str | None:
        """The reason ``declined`` gives for an unclaimed pair, or None."""
        return None if self.claims_quant(weight_key, activation_key) else \
            self.declined.get((weight_key, activation_key))

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

    def claims_activation_params(self, activation: MoEActivation, params) -> bool:
        """``params``: names of ``ACTIVATION_PARAMS`` that the call sets (not None)."""
        return all(p in self.activation_params or (activation, p) in self.activation_params for p in params)

    def variant_reason(self, activation: MoEActivation | None = None, quant_config=None, params=(),
                       ue8m0: bool = False) -> str | None:
        """None when every variant of the call is claimed, else ``"kernel does not claim <variant>"``.

        Args:
            activation: the call's ``MoEActivation`` (for per-activation parameter claims).
            quant_config: a ``FusedMoEQuantConfig``: its ``gemm1_alpha`` / ``gemm1_beta`` / ``gemm1_clamp_limit``
                (set: the variant is used) and ``use_ue8m0``.
            params: further ``ACTIVATION_PARAMS`` names the call sets (e.g. ``apply_moe_activation``'s keywords).
            ue8m0: the call's block scales are UE8M0 (also read from ``quant_config``).

        Raises:
            ValueError: a parameter name outside ``ACTIVATION_PARAMS``.
        """
        used = set(params)
        if quant_config is not None:
            used |= {p for p, f in _QC_ACTIVATION_PARAMS.items() if getattr(quant_config, f, None) is not None}
            ue8m0 = ue8m0 or bool(getattr(quant_config, "use_ue8m0", False))
        unknown = used - set(ACTIVATION_PARAMS)
        if unknown:
            raise ValueError(f"unknown activation parameters {sorted(unknown)}; known: {sorted(ACTIVATION_PARAMS)}")
        missing = sorted(p for p in used if not self.claims_activation_params(activation, (p,)))
        if missing:
            name = activation.name if activation is not None else "the activation"
            return f"kernel does not claim {name} with {', '.join(missing)} (SupportRecord.activation_params)"
        if ue8m0 and not self.ue8m0_scales:
            return "kernel does not claim UE8M0 (power-of-two) block scales (SupportRecord.ue8m0_scales)"
        return None

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
            "activation params": ("any" if set(self.activation_params) >= set(ACTIVATION_PARAMS) else
                                  ", ".join(sorted(p if isinstance(p, str) else f"{p[0].name}:{p[1]}"
                                                   for p in self.activation_params)) or "none"),
            "ue8m0 scales": "yes" if self.ue8m0_scales else "no",
            "notes": self.notes or "-",
        }
