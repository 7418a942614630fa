"""Deterministic inputs for conformance cases.

Weights are drawn once per (model, scheme, EP shard) and cached (the largest, DeepSeek-V3's 8 local experts, are
0.7 GB in bf16); tokens and router logits are drawn per case from the case's seed. Scales keep outputs O(1):
w1 ~ N(0, 1/K), w2 ~ N(0, 1/I), hidden states ~ N(0, 1).

Routing for experts cases uses the *reference* router (``reference.routing.select_experts``) with the model's
settings, so backend and reference see the same ids; the logits of a random subset of this rank's experts are
raised so every token reaches at least one local expert (otherwise EP-sharded decode cases would test zeros).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

import torch

from conformance.cases import ExpertsCase, RoutingCase
from reference.activation import MoEActivation
from reference.config import FusedMoEQuantConfig
from reference.routing import determine_expert_map, llama4_routing, select_experts, topk_softmax
from reference.schemes import quantize_weights
from specs import ModelSpec

__all__ = ["ExpertsInputs", "make_experts_inputs", "to_device", "route", "router_logits", "routing_bias"]


@dataclass
class ExpertsInputs:
    hidden_states: torch.Tensor
    w1: torch.Tensor  # bf16, or the scheme's codes
    w2: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    expert_map: torch.Tensor | None
    global_num_experts: int
    quant_config: FusedMoEQuantConfig


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


@lru_cache(maxsize=1)
def _bf16_weights(model: ModelSpec, dtype: torch.dtype, ep_size: int, ep_rank: int):
    from conformance.cases import seed_of

    g = _gen(seed_of(f"weights-{model.name}-{dtype}-ep{ep_size}r{ep_rank}"))
    E_local = model.num_experts // ep_size
    K, I = model.hidden_size, model.intermediate_size
    N = 2 * I if MoEActivation.from_str(model.activation).is_gated else I
    w1 = (torch.randn(E_local, N, K, generator=g) * K**-0.5).to(dtype)
    w2 = (torch.randn(E_local, K, I, generator=g) * I**-0.5).to(dtype)
    b1 = b2 = None
    if model.expert_bias:
        b1 = (torch.randn(E_local, N, generator=g) * 0.1).to(dtype)
        b2 = (torch.randn(E_local, K, generator=g) * 0.1).to(dtype)
    return w1, w2, b1, b2


def to_device(t, device):
    """``t`` on ``device``: a tensor, or a dataclass (a quant config) whose tensor fields are moved recursively."""
    if isinstance(t, torch.Tensor):
        return t.to(device)
    if dataclasses.is_dataclass(t) and not isinstance(t, type):
        return dataclasses.replace(t, **{f.name: to_device(getattr(t, f.name), device)
                                     for f in dataclasses.fields(t)})
    return t


@lru_cache(maxsize=1)
def _scheme_weights(model: ModelSpec, scheme: str, dtype: torch.dtype, ep_size: int, ep_rank: int, device: str):
    """The case's weights in the scheme's format, with the quant config that describes them, on ``device``."""
    w1, w2, b1, b2 = _bf16_weights(model, dtype, ep_size, ep_rank)
    w1q, w2q, qc = quantize_weights(scheme, w1, w2, w1_bias=b1, w2_bias=b2, gemm1_alpha=model.gemm1_alpha,
                                    gemm1_clamp_limit=model.gemm1_clamp_limit)
    return w1q.to(device), w2q.to(device), to_device(qc, device)


def routing_bias(model: ModelSpec, g: torch.Generator) -> torch.Tensor | None:
    """The model's ``e_score_correction_bias`` stand-in: fp32 ``(E,)`` ~ 0.05 * N(0, 1), or None."""
    if not model.e_score_correction_bias:
        return None
    return torch.randn(model.num_experts, generator=g) * 0.05


def router_logits(model: ModelSpec, M: int, g: torch.Generator, boost: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``(M, E)`` logits ~ N(0, 1); ``boost`` (E,) bool raises the marked experts' logits for random tokens."""
    logits = torch.randn(M, model.num_experts, generator=g)
    if boost is not None and M:
        local = boost.nonzero().squeeze(1)
        pick = local[torch.randint(len(local), (M,), generator=g)]
        logits[torch.arange(M), pick] += 4.0
    return logits


def route(model: ModelSpec, logits: torch.Tensor, bias: torch.Tensor | None, hidden: torch.Tensor | None = None):
    """The model's routing with the reference router: ``(topk_weights fp32, topk_ids int32)``."""
    if model.scoring_func == "topk_softmax":
        return topk_softmax(hidden, logits, model.top_k)
    if model.scoring_func == "llama4":
        return llama4_routing(hidden, logits, model.top_k)
    w, ids, _ = select_experts(
        hidden, logits, model.top_k, model.use_grouped_topk, model.renormalize,
        topk_group=model.topk_group, num_expert_group=model.num_expert_group,
        scoring_func=model.scoring_func, routed_scaling_factor=model.routed_scaling_factor,
        e_score_correction_bias=bias,
    )
    return w, ids


def make_experts_inputs(case: ExpertsCase, device: str) -> ExpertsInputs:
    m = case.model
    w1, w2, qc = _scheme_weights(m, case.scheme, case.dtype, case.ep_size, case.ep_rank, device)
    g = _gen(case.seed)
    _, expert_map, _ = determine_expert_map(case.ep_size, case.ep_rank, m.num_experts)
    hidden = torch.randn(case.tokens, m.hidden_size, generator=g).to(case.dtype)
    boost = (expert_map >= 0) if expert_map is not None else None
    logits = router_logits(m, case.tokens, g, boost)
    bias = routing_bias(m, g)
    w, ids = route(m, logits, bias, hidden)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return ExpertsInputs(to(hidden), w1, w2, to(w), to(ids), to(expert_map), m.num_experts, qc)
