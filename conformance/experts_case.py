"""Library code of the experts conformance test (conformance/test_experts.py) that other tests and tools reuse: the
case's ``FusedMoEConfig``, its error-model bound, and dumping / replaying a failing case's inputs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from conformance.cases import ExpertsCase, parallel_config, situ_params
from conformance.inputs import ExpertsInputs, make_experts_inputs
from reference.config import FusedMoEConfig
from reference.error_model import ErrorBound, experts_error_bound
from reference.experts import fused_experts_with_heavy

__all__ = ["case_error_bound", "case_variant_reason", "claims_config", "dump_case", "inputs_heavy_values", "load_inputs",
           "moe_config_for", "routes_error_bound", "variant_reason", "weights_key"]


def inputs_heavy_values(case: ExpertsCase, inputs: ExpertsInputs, apply_router_weight_on_input: bool = False,
                        profile=None) -> torch.Tensor:
    """``fused_experts_with_heavy``'s ``heavy`` for a case's inputs (a reference run of its own: for the tests whose
    reference is another class, e.g. the batched format's)."""
    return fused_experts_with_heavy(inputs.hidden_states, inputs.w1, inputs.w2, inputs.topk_weights, inputs.topk_ids,
                                activation=case.activation, global_num_experts=inputs.global_num_experts,
                                expert_map=inputs.expert_map, apply_router_weight_on_input=apply_router_weight_on_input,
                                quant_config=inputs.quant_config, profile=profile, **situ_params(case.activation))[1]


def weights_key(case: ExpertsCase) -> tuple:
    """What ``conformance.inputs`` caches per worker: the model's bf16 weights per EP shard, then the scheme's codes;
    cases sorted by it share their weights."""
    m = case.model
    return (m.name, m.activation, str(case.dtype), case.ep_size, case.ep_rank, case.tp_size, case.scheme)


def _router_weight_rounding(experts_cls) -> str:
    return getattr(getattr(experts_cls, "support", None), "router_weight_rounding", "reference")


def case_error_bound(case: ExpertsCase, quant_config, experts_cls=None, *, topk_ids: torch.Tensor | None = None,
                     expert_map: torch.Tensor | None = None, profile=None,
                     heavy: torch.Tensor | None = None) -> ErrorBound:
    """The case's bounds from the error model (``reference.error_model``; its constants in specs/tolerances.toml):
    the one rule every comparison of an experts or layer output in the suite is judged by.

    Without ``topk_ids`` the GEMM rows are the case's expected local routes (``M * topk * E_local / E``); with them
    (and ``expert_map``), the routes actually held here (``routes_error_bound``): padded (-1) or remote routes
    add no rows. ``profile``: the ``reference.profiles.NumericsProfile`` judged under (its accumulation, where it
    names one; None: the default). ``heavy``: the call's own values at GEMM2's input (``fused_experts_with_heavy``),
    for the heavy event on the call itself (error model step 7b); None: on the model's distribution only."""
    m = case.model
    accumulation = None if profile is None else profile.error_model_accumulation(quant_config)
    if topk_ids is not None:
        return routes_error_bound(quant_config, act_dtype=case.dtype, K=m.hidden_size, I=m.intermediate_size,
                                  activation=case.activation, topk_ids=topk_ids, expert_map=expert_map,
                                  experts_cls=experts_cls, accumulation=accumulation, heavy=heavy)
    rows = case.tokens * m.top_k * (m.num_experts // case.ep_size) / m.num_experts  # expected local routes
    return experts_error_bound(quant_config, act_dtype=case.dtype, K=m.hidden_size, I=m.intermediate_size,
                               activation=case.activation, routed_rows=rows,
                               routes_per_row=max(rows / max(case.tokens, 1), 1.0), accumulation=accumulation,
                               router_weight_rounding=_router_weight_rounding(experts_cls), heavy=heavy)


def routes_error_bound(quant_config, *, act_dtype: torch.dtype, K: int, I: int, activation, topk_ids: torch.Tensor,
                       expert_map: torch.Tensor | None = None, experts_cls=None, accumulation=None,
                       stage: str = "output", heavy: torch.Tensor | None = None) -> ErrorBound:
    """The error model's bound on one experts output over the routes it holds: ids ``>= 0`` of ``topk_ids (M, topk)``
    that ``expert_map`` (``(E,)``, -1 = not here; None: every expert) maps to a local expert. ``experts_cls``: its
    ``SupportRecord.router_weight_rounding`` is allowed; ``accumulation``: a ``reference.error_model.Accumulation``
    other than the allowed default; ``stage``: the intermediate compared (``reference.error_model.STAGES``;
    default the output); ``heavy``: as ``case_error_bound``'s."""
    ids = topk_ids.long()
    local = ids >= 0
    if expert_map is not None:
        local &= expert_map.to(ids.device).long()[ids.clamp(min=0)] >= 0
    rows, M = int(local.sum()), max(int(ids.shape[0]), 1)
    return experts_error_bound(quant_config, act_dtype=act_dtype, K=K, I=I, activation=activation,
                               routed_rows=rows, routes_per_row=max(rows / M, 1.0), accumulation=accumulation,
                               router_weight_rounding=_router_weight_rounding(experts_cls), stage=stage,
                               heavy=heavy)


def variant_reason(cls, activation, quant_config=None, *, params=(), ue8m0: bool = False) -> str | None:
    """Why ``cls`` does not claim a variant of the call (``SupportRecord.variant_reason``: an activation parameter,
    UE8M0 block scales), or None: every variant claimed, or a class without a ``SupportRecord`` (claims everything).
    Conformance skips an unclaimed variant with this reason and never calls the kernel on it."""
    rec = getattr(cls, "support", None)
    return None if rec is None else rec.variant_reason(activation, quant_config, params, ue8m0)


def case_variant_reason(cls, case: ExpertsCase) -> str | None:
    """``variant_reason`` from the case alone (no inputs built): the model's ``gemm1_alpha`` / ``gemm1_clamp_limit``
    and the scheme's UE8M0 scales."""
    from reference.schemes import get_scheme

    m = case.model
    params = [p for p, v in (("alpha", m.gemm1_alpha), ("limit", m.gemm1_clamp_limit)) if v is not None]
    return variant_reason(cls, case.activation, params=params, ue8m0=get_scheme(case.scheme).use_ue8m0)


def claims_config(cls, moe_config: FusedMoEConfig, quant_config) -> tuple[bool, str | None]:
    """``cls.is_supported_config`` on the quant config's keys, then every variant of it (``variant_reason``):
    ``(True, None)`` or ``(False, reason)``."""
    ok, reason = cls.is_supported_config(cls, moe_config, quant_config.weight_key, quant_config.activation_key,
                                         cls.activation_format())
    if not ok:
        return ok, reason
    reason = variant_reason(cls, moe_config.activation, quant_config)
    return reason is None, reason


def moe_config_for(case: ExpertsCase) -> FusedMoEConfig:
    m = case.model
    return FusedMoEConfig(
        num_experts=m.num_experts, experts_per_token=m.top_k, hidden_dim=m.hidden_size,
        intermediate_size_per_partition=m.intermediate_size, num_local_experts=m.num_experts // case.ep_size,
        activation=case.activation, in_dtype=case.dtype,
        moe_parallel_config=parallel_config(case), has_bias=m.expert_bias,
        **situ_params(case.activation),
    )


def dump_case(request, case, inputs, out, expected, diagnosis) -> str:
    """With ``--dump-failures DIR``: save the case's inputs and results; returns the replay hint for the message."""
    directory = request.config.getoption("--dump-failures")
    if not directory:
        return ""
    path = Path(directory) / f"{case.id}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"case": case.id, "inputs": dataclasses.asdict(inputs) | {"quant_config": inputs.quant_config},
                "out": out.cpu(), "expected": expected.cpu(), "diagnosis": diagnosis}, path)
    spec = request.config._moe_backend_spec
    return (f"\n  inputs dumped to {path}; replay them: python -m pytest "
            f"'{request.node.nodeid.split('@')[0]}' --backend {spec} --replay {path}")


def load_inputs(request, case, device) -> ExpertsInputs:
    """The case's inputs: drawn from its seed (``conformance.inputs.make_experts_inputs``), or with ``--replay FILE``
    the ones ``dump_case`` saved (skips when the file holds another case)."""
    replay = request.config.getoption("--replay")
    if not replay:
        return make_experts_inputs(case, device)
    saved = torch.load(replay, weights_only=False)
    if saved["case"] != case.id:
        pytest.skip(f"--replay {replay} holds case {saved['case']}, not {case.id}")
    fields = saved["inputs"]
    move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    return ExpertsInputs(**{k: move(v) for k, v in fields.items() if k != "quant_config"},
                         quant_config=fields["quant_config"])
