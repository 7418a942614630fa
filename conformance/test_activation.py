"""Activation conformance: the backend's ``apply_moe_activation`` against the reference, within 1 ulp of the
output dtype (both compute in fp32 and round once), plus, for the GELU family, the absolute error that the fp32
formula's cancellation allows (``[activation] gelu_cancellation`` in specs/tolerances.toml)."""

from __future__ import annotations

import pytest
import torch

from conformance.cases import ActivationCase, activation_cases
from conformance.inputs import _gen
from conformance.metrics import assert_ulps, gelu_cancellation_atol
from reference.activation import apply_moe_activation
from reference.modular import ACTIVATION_PARAMS


@pytest.mark.parametrize("case", activation_cases(), ids=lambda c: c.id)
def test_activation(backend, case: ActivationCase, tolerances, repro, record):
    op = backend.ops.get("apply_moe_activation")
    if op is None:
        pytest.skip(f"backend {backend.name} does not implement apply_moe_activation")
    # The op is the experts' activation: it owes what some experts class of the backend claims, variants included
    # (``SupportRecord.activation_params``: a clamp limit, alpha, beta); a class without a SupportRecord claims all.
    records = [getattr(cls, "support", None) for cls in backend.experts]
    if records and not any(r is None or r.claims_activation(case.activation) for r in records):
        pytest.skip(f"no experts class of backend {backend.name} claims {case.activation.name}, so its "
                    "apply_moe_activation need not implement it")
    variant = [p for p, v in case.params if p in ACTIVATION_PARAMS and v is not None]
    if records and not any(r is None or (r.claims_activation(case.activation)
                                         and r.claims_activation_params(case.activation, variant)) for r in records):
        pytest.skip(f"unclaimed variant: no experts class of backend {backend.name} claims {case.activation.name} "
                    f"with {', '.join(variant)} (SupportRecord.activation_params)")
    record(component="activation", scheme=case.activation.value, tokens=case.tokens)
    g = _gen(case.seed)
    # Spread over [-12, 12] so clamps (limit 7) and saturation regions are exercised.
    x = (torch.randn(case.tokens, case.width, generator=g) * 4).to(case.dtype)
    params = dict(case.params)
    expected = apply_moe_activation(case.activation, x, **params)
    out = op(case.activation, x.to(backend.device), **params)
    tol = tolerances["activation"]
    assert_ulps(out, expected, tol["ulps"][str(case.dtype).removeprefix("torch.")], case=f"activation[{case.id}]",
                what="activation output", repro=repro,
                atol=gelu_cancellation_atol(case.activation, x, tol["gelu_cancellation"]))
