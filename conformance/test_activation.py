"""Activation conformance: the backend's ``apply_moe_activation`` against the reference, within 1 ulp of the
output dtype (both compute in fp32 and round once), plus, for the GELU family, the absolute error that the fp32
formula's cancellation allows (``[activation] gelu_cancellation`` in specs/tolerances.toml)."""

from __future__ import annotations

import pytest
import torch

from conformance.cases import ActivationCase, activation_cases
from conformance.inputs import _gen
from conformance.metrics import assert_ulps
from reference.activation import MoEActivation, apply_moe_activation

_GELU_FAMILY = {MoEActivation.GELU: True, MoEActivation.GELU_TANH: True, MoEActivation.GELU_NO_MUL: False}


def gelu_cancellation_atol(activation: MoEActivation, x: torch.Tensor, factor: float) -> torch.Tensor | None:
    """``factor * 2^-24 * |g| * |u|`` per output element for the GELU family (None for the others).

    ``x`` is the activation input (M, 2I) for gated GELUs (g, u = the packed halves) or (M, I) for GELU_NO_MUL."""
    if activation not in _GELU_FAMILY:
        return None
    xf = x.float()
    if _GELU_FAMILY[activation]:
        g, u = xf.chunk(2, dim=-1)
        return factor * 2.0**-24 * (g * u).abs()
    return factor * 2.0**-24 * xf.abs()


@pytest.mark.parametrize("case", activation_cases(), ids=lambda c: c.id)
def test_activation(backend, case: ActivationCase, tolerances, repro, record):
    op = backend.ops.get("apply_moe_activation")
    if op is None:
        pytest.skip(f"backend {backend.name} does not implement apply_moe_activation")
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
