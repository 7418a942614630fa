"""Conformance cases generated from ``specs/``: each has a stable id and a seed derived from it.

Ids read like ``deepseek_v3-bf16-M16-ep32r0`` (model, scheme, tokens, EP shard); options append ``-chunk64``.
The seed is the first 8 bytes of sha256(id), so a case draws the same inputs on every machine and run.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from reference.activation import MoEActivation
from specs import ModelSpec, load_cases, load_models

__all__ = ["ExpertsCase", "RoutingCase", "ActivationCase", "experts_cases", "routing_cases", "activation_cases",
           "seed_of", "SCHEME_DTYPES"]

# Unquantized schemes and their activation dtype.
SCHEME_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def seed_of(case_id: str) -> int:
    return int.from_bytes(hashlib.sha256(case_id.encode()).digest()[:8], "little") & (2**63 - 1)


@dataclass(frozen=True)
class ExpertsCase:
    model: ModelSpec
    scheme: str
    tokens: int
    ep_size: int
    ep_rank: int
    chunk_size: int | None = None

    @property
    def id(self) -> str:
        s = f"{self.model.name}-{self.scheme}-M{self.tokens}-ep{self.ep_size}r{self.ep_rank}"
        return s + (f"-chunk{self.chunk_size}" if self.chunk_size else "")

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
        cases.append(ExpertsCase(m, extra.get("scheme", "bf16"), extra["tokens"], m.cpu_ep_size,
                                 extra.get("ep_rank", 0), extra.get("chunk_size")))
    return cases


def routing_cases() -> list[RoutingCase]:
    tokens = load_cases()["routing"]["tokens"]
    return [RoutingCase(m, M) for m in load_models().values() for M in tokens]


def activation_cases() -> list[ActivationCase]:
    """Every activation in bf16 (and SILU in fp16/fp32), plus the parameterized gpt-oss forms."""
    tokens = load_cases()["activation"]["tokens"]
    A = MoEActivation
    out = []
    for act in A:
        if act is A.RELU2:
            continue
        for M in tokens:
            out.append(ActivationCase(act, torch.bfloat16, M, 256))
    for dt in (torch.float16, torch.float32):
        out.append(ActivationCase(A.SILU, dt, 33, 256))
    out.append(ActivationCase(A.SWIGLUOAI_UNINTERLEAVE, torch.bfloat16, 33, 256,
                              (("alpha", 1.702), ("beta", 1.0), ("limit", 7.0))))
    out.append(ActivationCase(A.SILU, torch.bfloat16, 33, 256, (("limit", 7.0),)))
    return out
