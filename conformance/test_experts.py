"""Experts conformance: the backend's ``FusedMoEExpertsModular`` classes, driven by the reference's modular kernel
(``MoEPrepareAndFinalizeNoEP`` + ``FusedMoEKernel``, outputs and workspaces poisoned with NaN), against
``reference.experts.fused_experts`` on real model shapes (one EP rank's experts, routing over all experts)."""

from __future__ import annotations

import pytest
import torch

from conformance.cases import ExpertsCase, experts_cases
from conformance.inputs import make_experts_inputs
from conformance.metrics import assert_close
from reference.config import FUSED_MOE_UNQUANTIZED_CONFIG, FusedMoEConfig, FusedMoEParallelConfig, biased_moe_quant_config
from reference.config import FusedMoEQuantConfig
from reference.experts import fused_experts
from reference.modular import FusedMoEActivationFormat, FusedMoEKernel, MoEPrepareAndFinalizeNoEP


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames and "experts_cls" in metafunc.fixturenames:
        classes = list(metafunc.config._moe_backend.experts)
        cases = experts_cases()
        params, ids = [], []
        for cls in classes or [None]:
            for c in cases:
                params.append((cls, c))
                ids.append(c.id if len(classes) <= 1 else f"{c.id}-{cls.__name__}")
        metafunc.parametrize(("experts_cls", "case"), params, ids=ids)


def _quant_config(case: ExpertsCase, inputs) -> FusedMoEQuantConfig:
    m = case.model
    qc = FUSED_MOE_UNQUANTIZED_CONFIG
    if inputs.w1_bias is not None:
        qc = biased_moe_quant_config(inputs.w1_bias, inputs.w2_bias)
    if m.gemm1_alpha is not None or m.gemm1_clamp_limit is not None:
        qc = FusedMoEQuantConfig(a1=qc.a1, a2=qc.a2, w1=qc.w1, w2=qc.w2, gemm1_alpha=m.gemm1_alpha,
                                 gemm1_clamp_limit=m.gemm1_clamp_limit)
    return qc


def moe_config_for(case: ExpertsCase) -> FusedMoEConfig:
    m = case.model
    return FusedMoEConfig(
        num_experts=m.num_experts, experts_per_token=m.top_k, hidden_dim=m.hidden_size,
        intermediate_size_per_partition=m.intermediate_size, num_local_experts=m.num_experts // case.ep_size,
        activation=case.activation, in_dtype=case.dtype,
        moe_parallel_config=FusedMoEParallelConfig.make_ep(case.ep_size, case.ep_rank), has_bias=m.expert_bias,
    )


def test_experts(backend, experts_cls, case: ExpertsCase, tolerances, repro, record):
    if experts_cls is None:
        pytest.skip(f"backend {backend.name} offers no experts implementation")
    inputs = make_experts_inputs(case, backend.device)
    qc = _quant_config(case, inputs)
    moe_config = moe_config_for(case)
    ok, reason = experts_cls.is_supported_config(experts_cls, moe_config, None, None,
                                                 FusedMoEActivationFormat.Standard)
    if not ok:
        pytest.skip(f"{experts_cls.__name__}: {reason}")
    record(model=case.model.name, scheme=case.scheme, component="experts", tokens=case.tokens)
    kwargs = dict(activation=case.activation, global_num_experts=inputs.global_num_experts,
                  expert_map=inputs.expert_map, apply_router_weight_on_input=case.model.apply_router_weight_on_input)
    expected = fused_experts(inputs.hidden_states, inputs.w1, inputs.w2, inputs.topk_weights, inputs.topk_ids,
                             quant_config=qc, **kwargs)
    kernel = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), experts_cls(moe_config, qc), chunk_size=case.chunk_size,
                            poison=float("nan"))
    out = kernel.apply(inputs.hidden_states, inputs.w1, inputs.w2, inputs.topk_weights, inputs.topk_ids, **kwargs)
    tol = tolerances["experts"][str(case.dtype).removeprefix("torch.")]
    stats = assert_close(out, expected, tol, case=case.id, what=f"{experts_cls.__name__} output", repro=repro)
    record(**stats.as_dict())
