"""Router gate conformance: the backend's ``gate_linear`` op computes, for each real model's gate (H, E, weight
dtype, out_dtype) at the token counts around the tier boundaries, the tier that ``reference.gate.select_gate_tier``
picks on each platform the backend claims, with that tier's numerics (``reference.gate.gate_reference``)."""

from __future__ import annotations

import itertools

import pytest
import torch

from conformance.cases import seed_of
from conformance.metrics import assert_within_bound
from reference.gate import GateTier, gate_reference, select_gate_tier
from specs import load_cases, load_models

DT = {"bfloat16": torch.bfloat16, "float32": torch.float32}
PLATFORM_NAMES = ("cpu", "sm90", "sm100")


def _cases():
    tokens = load_cases()["gate"]["tokens"]
    for m, M in itertools.product(load_models().values(), tokens):
        yield pytest.param((m, M), id=f"{m.name}-M{M}")


def _platforms(backend):
    if backend.gate_platforms is None:
        pytest.skip(f"backend {backend.name} implements no router gate tier")
    return backend.gate_platforms()


@pytest.mark.parametrize("case", list(_cases()))
def test_gate(backend, case, tolerances, repro, record):
    m, M = case
    H, E = m.hidden_size, m.num_experts
    w_dtype = DT[m.gate_weight_dtype]
    out_dtype = DT[m.gate_out_dtype] if m.gate_out_dtype else None
    g = torch.Generator().manual_seed(seed_of(f"gate-{m.name}-M{M}"))
    x = torch.randn(M, H, generator=g).to(torch.bfloat16)
    w = (torch.randn(E, H, generator=g) * H**-0.5).to(w_dtype)
    tol = tolerances["gate"]
    op = backend.ops.get("gate_linear")
    if op is None:
        pytest.skip(f"backend {backend.name} does not implement gate_linear")
    checked, not_implemented = [], []
    for platform in _platforms(backend):
        tier = select_gate_tier(M, H, E, x_dtype=x.dtype, weight_dtype=w_dtype, out_dtype=out_dtype, bias=False,
                                platform=platform)
        ref = gate_reference(x, w, tier=tier, out_dtype=out_dtype)
        try:
            out = op(x.to(backend.device), w.to(backend.device), tier=tier, out_dtype=out_dtype)
        except NotImplementedError as exc:
            not_implemented.append(f"{platform.name}: {tier.name} ({exc})")
            continue
        what = f"gate {m.name} M={M} on {platform.name} via {tier.name}"
        bound = tol["accumulation_factor"] * H * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
        # F.linear rounds to the weight dtype even when out_dtype is fp32: allow a flip of that rounding.
        rounded_to = w_dtype if tier is GateTier.F_LINEAR else ref.dtype
        if rounded_to != torch.float32:
            bound = bound + tol["output_ulps"] * ref.double().abs() * torch.finfo(rounded_to).eps
        assert_within_bound(out, ref, bound, case=f"gate[{m.name}-M{M}]",
                            what=f"{what} (fp32 accumulation bound)", repro=repro)
        checked.append(f"{platform.name}:{tier.name}")
    record(component="gate", model=m.name, tokens=M, scheme=",".join(checked) or "none")
    if not checked:
        pytest.skip("no tier this backend implements is selected here: " + "; ".join(not_implemented))
