"""Conformance cases generated from ``specs/``: each has a stable id and a seed derived from it.

Ids read like ``deepseek_v3-bf16-M16-ep32r0`` (model, scheme, tokens, EP shard); options append ``-chunk64``.
The seed is the first 8 bytes of sha256(id), so a case draws the same inputs on every machine and run.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field

import torch

from reference.activation import MoEActivation
from specs import ModelSpec, load_cases, load_models

__all__ = ["ExpertsCase", "RoutingCase", "ActivationCase", "experts_cases", "claim_cases", "claim_coverage",
           "routing_cases", "activation_cases", "seed_of", "SCHEME_DTYPES", "chunking_defined", "kernel_chunk_kwargs",
           "situ_params"]

# Unquantized schemes and their activation dtype.
SCHEME_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def chunking_defined() -> bool:
    """Whether the semantics version in force (``--vllm-semantics``) has activation chunking: 0.17 yes, 0.33 no."""
    from reference.semantics import SemanticsVersion, current_semantics

    return current_semantics() < SemanticsVersion.V0_33


def kernel_chunk_kwargs(chunk_size: int | None) -> dict:
    """``FusedMoEKernel`` keywords for a case's chunk size: ``chunk_size`` under 0.17; none under 0.33, whose kernel
    has no chunking (a chunked case is skipped there; an unchunked one runs as one experts call anyway)."""
    return {"chunk_size": chunk_size} if chunking_defined() else {}


def situ_params(activation: MoEActivation) -> dict:
    """SITU's parameters for a case (Kimi-K3's, the values vLLM 0.33 bakes into its fused kernel); {} otherwise."""
    from reference.activation import SITU_KIMI_K3_BETA, SITU_KIMI_K3_LINEAR_BETA

    if activation is not MoEActivation.SITU:
        return {}
    return {"activation_situ_beta": SITU_KIMI_K3_BETA, "activation_situ_linear_beta": SITU_KIMI_K3_LINEAR_BETA}


def seed_of(case_id: str) -> int:
    return int.from_bytes(hashlib.sha256(case_id.encode()).digest()[:8], "little") & (2**63 - 1)


@dataclass(frozen=True)
class ExpertsCase:
    """One experts case. ``origin`` says where it comes from: ``"spec"`` (specs/cases.toml) or ``"claims"``
    (derived from an experts class's ``SupportRecord``: ``claim_cases``); ``regime`` is ``"decode"`` or
    ``"prefill"`` (every local expert gets >= ``[claims] prefill_tokens_per_expert`` tokens)."""

    model: ModelSpec
    scheme: str
    tokens: int
    ep_size: int
    ep_rank: int
    chunk_size: int | None = None
    tp_size: int = 1  # > 1: one TP rank's shard of every expert (``model.intermediate_size`` is then the shard's I)
    origin: str = field(default="spec", compare=False)
    regime: str = field(default="decode", compare=False)

    @property
    def id(self) -> str:
        s = f"{self.model.name}-{self.scheme}-M{self.tokens}-ep{self.ep_size}r{self.ep_rank}"
        s += f"-tp{self.tp_size}" if self.tp_size > 1 else ""
        s += f"-chunk{self.chunk_size}" if self.chunk_size else ""
        # A claim case may run a model with another claimed activation than its own.
        spec = load_models().get(self.model.name)
        return s + (f"-{self.model.activation}" if spec is not None and self.model.activation != spec.activation
                    else "")

    @property
    def seed(self) -> int:
        return seed_of(self.id)

    @property
    def activation(self) -> MoEActivation:
        return MoEActivation.from_str(self.model.activation)

    @property
    def dtype(self) -> torch.dtype:
        return SCHEME_DTYPES.get(self.scheme, torch.bfloat16)



@dataclass(frozen=True)
class RoutingCase:
    model: ModelSpec
    tokens: int

    @property
    def id(self) -> str:
        return f"{self.model.name}-M{self.tokens}"

    @property
    def seed(self) -> int:
        return seed_of("routing-" + self.id)


@dataclass(frozen=True)
class ActivationCase:
    activation: MoEActivation
    dtype: torch.dtype
    tokens: int
    width: int
    params: tuple = field(default=())  # ((name, value), ...) alpha / beta / limit

    @property
    def id(self) -> str:
        p = "".join(f"-{k}{v}" for k, v in self.params)
        return f"{self.activation.value}-{str(self.dtype).removeprefix('torch.')}-M{self.tokens}-N{self.width}{p}"

    @property
    def seed(self) -> int:
        return seed_of("activation-" + self.id)


def experts_cases(include_gpu_only: bool = False) -> list[ExpertsCase]:
    """Every model x its unquantized scheme x decode/prefill token counts, then the extra option cases
    (those marked ``gpu_only`` in specs/cases.toml only with ``include_gpu_only``: large prefill batches whose
    reference costs minutes on a CPU)."""
    spec = load_cases()["experts"]
    models = load_models()
    counts = list(spec["decode_tokens"]) + list(spec["prefill_tokens"])
    cases = []
    for m in models.values():
        for scheme in m.schemes:
            for M in counts if scheme == "bf16" else spec["quant_tokens"]:
                cases.append(ExpertsCase(m, scheme, M, m.cpu_ep_size, 0))
    generic = spec["generic_schemes"]
    m = models[generic["model"]]
    for scheme in generic["schemes"]:
        for M in generic["tokens"]:
            cases.append(ExpertsCase(m, scheme, M, m.cpu_ep_size, 0))
    for extra in spec.get("extra", []):
        if extra.get("gpu_only") and not include_gpu_only:
            continue
        m = models[extra["model"]]
        ep_size, tp_size = extra.get("ep_size", m.cpu_ep_size), extra.get("tp_size", 1)
        if tp_size > 1:
            m = tp_shard(m, tp_size, ep_size)
        cases.append(ExpertsCase(m, extra.get("scheme", "bf16"), extra["tokens"], ep_size, extra.get("ep_rank", 0),
                                 extra.get("chunk_size"), tp_size=tp_size))
    return cases


def tp_shard(model: ModelSpec, tp_size: int, ep_size: int = 1) -> ModelSpec:
    """``model`` as one TP rank holds it: every expert's intermediate size split ``tp_size`` ways (vLLM's
    ``intermediate_size_per_partition``; the shapes of the tuned tables' TP entries, e.g. Mixtral TP2: E=8, N=7168).
    The rank's output is its partial sum, which the all-reduce after the layer completes: the reference computes
    the same partial sum on the same shard.

    Raises:
        ValueError: ``tp_size`` does not divide the intermediate size, or ``ep_size`` > 1 (vLLM shards the experts by
            EP or their intermediate size by TP, not both: with EP on, its ``tp_size`` is 1).
    """
    if ep_size != 1:
        raise ValueError(f"{model.name}: tp_size {tp_size} needs ep_size 1, got {ep_size} (with EP on, vLLM shards "
                         "whole experts and its tp_size is 1)")
    if model.intermediate_size % tp_size:
        raise ValueError(f"{model.name}: tp_size {tp_size} does not divide intermediate_size "
                         f"{model.intermediate_size}")
    return dataclasses.replace(model, intermediate_size=model.intermediate_size // tp_size)


def parallel_config(case: ExpertsCase):
    """The case's ``FusedMoEParallelConfig``: its EP rank, or its TP size (``tp_shard``)."""
    from reference.config import FusedMoEParallelConfig

    if case.tp_size > 1:
        return FusedMoEParallelConfig(tp_size=case.tp_size)
    return FusedMoEParallelConfig.make_ep(case.ep_size, case.ep_rank)


def _claimed(cls, case: ExpertsCase) -> bool:
    from reference.config import FusedMoEConfig
    from reference.schemes import get_scheme

    m = case.model
    cfg = FusedMoEConfig(num_experts=m.num_experts, experts_per_token=m.top_k, hidden_dim=m.hidden_size,
                         intermediate_size_per_partition=m.intermediate_size,
                         num_local_experts=m.num_experts // case.ep_size, activation=case.activation,
                         in_dtype=case.dtype, moe_parallel_config=parallel_config(case),
                         has_bias=m.expert_bias, **situ_params(case.activation))
    w, a = get_scheme(case.scheme).quant_keys()
    ok, _ = cls.is_supported_config(cls, cfg, w, a, cls.activation_format())
    rec = cls.support
    if not ok or not (case.tokens >= rec.min_tokens and (rec.max_tokens is None or case.tokens <= rec.max_tokens)):
        return False
    from conformance.experts_case import case_variant_reason

    return case_variant_reason(cls, case) is None  # an unclaimed variant (activation parameter, UE8M0 scales)


def prefill_tokens(model: ModelSpec, per_expert: int) -> int:
    """Tokens at which every expert gets ``per_expert`` routes on average (``per_expert * E / topk``)."""
    return -(-per_expert * model.num_experts // model.top_k)


def claim_cases(cls, on_gpu: bool) -> list[ExpertsCase]:
    """Cases derived from what ``cls`` claims (its ``SupportRecord``), so a claim is exercised whatever the hand
    list in specs/cases.toml holds (``[claims]``):

    - every claimed scheme at a decode size (rank 0), at a decode size on the last EP rank (the expert map), and at
      a prefill size where every local expert gets >= ``prefill_tokens_per_expert`` tokens (the kernel's prefill
      configuration); on the GPU on every model that ships the scheme, on the CPU on ``generic_model``;
    - every claimed activation on ``generic_model`` (bf16 and the first claimed quantized scheme) that exists under
      the semantics version in force (SITU and GELU_TANH_NO_MUL are 0.33 members);
    - a chunked call when chunking is claimed and the semantics version has chunking (0.17).
    A combination the class's ``is_supported_config`` refuses (or outside its token range) is not generated.
    BatchedExperts classes get no CPU prefill case: their capacity is M tokens per expert, so the CPU cost grows as
    E_local * M^2 (their claims are exercised at decode sizes, where the format is used).
    """
    import dataclasses

    from reference.modular import FusedMoEActivationFormat
    from reference.schemes import schemes

    if getattr(cls, "support", None) is None:
        return []
    spec = load_cases()["claims"]
    models = load_models()
    generic = models[spec["generic_model"]]
    rec = cls.support
    batched = rec.activation_format == FusedMoEActivationFormat.BatchedExperts
    out: list[ExpertsCase] = []

    def add(case: ExpertsCase) -> None:
        if _claimed(cls, case):
            out.append(case)

    claimed_schemes = [n for n, sch in schemes().items() if rec.claims_quant(*sch.quant_keys())]
    for name in claimed_schemes:
        shipped = [m for m in models.values() if name in m.schemes] if on_gpu else []
        for m in shipped or [generic]:
            ep = m.cpu_ep_size if rec.expert_map else 1
            for M in spec["decode_tokens"]:
                add(ExpertsCase(m, name, M, ep, 0, origin="claims"))
            if ep > 1:
                add(ExpertsCase(m, name, spec["decode_tokens"][-1], ep, ep - 1, origin="claims"))
            if not (batched and not on_gpu):
                # Routing boosts one local expert per token, so local experts get more than the average.
                M = prefill_tokens(m, spec["prefill_tokens_per_expert"]) // (2 if ep > 1 else 1)
                add(ExpertsCase(m, name, M, ep, 0, origin="claims", regime="prefill"))
    quantized = [n for n in claimed_schemes if n not in SCHEME_DTYPES]
    ep = generic.cpu_ep_size if rec.expert_map else 1
    from reference.activation import activation_defined

    for act in sorted(rec.activations or (), key=lambda a: a.name):
        if not activation_defined(act):
            continue
        variant = dataclasses.replace(generic, activation=act.value)
        for name in ["bf16"] + quantized[:1]:
            add(ExpertsCase(variant, name, spec["activation_tokens"], ep, 0, origin="claims"))
    if rec.chunking and not batched and chunking_defined():
        add(ExpertsCase(generic, "bf16", spec["chunk_tokens"], ep, 0, chunk_size=spec["chunk_size"],
                        origin="claims"))
    return out


def claim_coverage(cls, cases: list[ExpertsCase]) -> dict[str, dict[str, bool]]:
    """For each claim dimension of ``cls`` (schemes, activations, expert map, token regime, chunking): which claimed
    values had at least one case among ``cases``. The conformance matrix prints it."""
    from reference.activation import activation_defined
    from reference.modular import FusedMoEActivationFormat
    from reference.schemes import schemes

    rec = cls.support
    if rec is None:
        return {}
    cases = [c for c in cases if _claimed(cls, c)]
    claimed = [n for n, sch in schemes().items() if rec.claims_quant(*sch.quant_keys())]
    cov = {
        "scheme": {n: any(c.scheme == n for c in cases) for n in claimed},
        "activation": {a.name: any(c.activation is a for c in cases)
                       for a in sorted(rec.activations or (), key=lambda a: a.name) if activation_defined(a)},
        "regime": {r: any(c.regime == r for c in cases) for r in ("decode", "prefill")},
    }
    if rec.expert_map:
        cov["expert_map"] = {"ep rank 0": any(c.ep_size > 1 and c.ep_rank == 0 for c in cases),
                             "last ep rank": any(c.ep_size > 1 and c.ep_rank == c.ep_size - 1 for c in cases)}
    if rec.chunking and rec.activation_format != FusedMoEActivationFormat.BatchedExperts and chunking_defined():
        cov["chunking"] = {"chunked": any(c.chunk_size for c in cases)}
    return cov


def routing_cases() -> list[RoutingCase]:
    tokens = load_cases()["routing"]["tokens"]
    return [RoutingCase(m, M) for m in load_models().values() for M in tokens]


def activation_cases() -> list[ActivationCase]:
    """Every activation of the semantics version in force in bf16 (and SILU in fp16/fp32), plus the parameterized
    gpt-oss forms and SITU with and without its linear beta."""
    from reference.activation import SITU_KIMI_K3_BETA, SITU_KIMI_K3_LINEAR_BETA, activation_defined

    tokens = load_cases()["activation"]["tokens"]
    A = MoEActivation
    out = []
    for act in A:
        if act is A.RELU2 or not activation_defined(act):
            continue
        for M in tokens:
            params = (("situ_beta", SITU_KIMI_K3_BETA), ("situ_linear_beta", SITU_KIMI_K3_LINEAR_BETA)) \
                if act is A.SITU else ()
            out.append(ActivationCase(act, torch.bfloat16, M, 256, params))
    if activation_defined(A.SITU):  # no linear beta: the up projection passes through
        out.append(ActivationCase(A.SITU, torch.bfloat16, 33, 256, (("situ_beta", 1.0),)))
    for dt in (torch.float16, torch.float32):
        out.append(ActivationCase(A.SILU, dt, 33, 256))
    out.append(ActivationCase(A.SWIGLUOAI_UNINTERLEAVE, torch.bfloat16, 33, 256,
                              (("alpha", 1.702), ("beta", 1.0), ("limit", 7.0))))
    out.append(ActivationCase(A.SILU, torch.bfloat16, 33, 256, (("limit", 7.0),)))
    return out
