"""Activations against hand-computed values and their algebraic identities."""

import math

import pytest
import torch

from reference.activation import MoEActivation as A
from reference.activation import adjust_N_for_activation, apply_moe_activation


def silu(v):
    return v / (1 + math.exp(-v))


def test_silu_gated_hand_values():
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5]])  # g = [1, -2], u = [3, 0.5]
    out = apply_moe_activation(A.SILU, x)
    torch.testing.assert_close(out, torch.tensor([[silu(1) * 3, silu(-2) * 0.5]]))


def test_swigluoai_is_interleaved_and_clamped():
    x = torch.tensor([[10.0, 1.0, 1.0, -9.0]])  # pairs (g, u): (10, 1), (1, -9)
    a, L = 1.702, 7.0
    g0, u0 = min(10.0, L), 1.0
    g1, u1 = 1.0, max(-9.0, -L)
    exp = [(u0 + 1) * g0 / (1 + math.exp(-a * g0)), (u1 + 1) * g1 / (1 + math.exp(-a * g1))]
    torch.testing.assert_close(apply_moe_activation(A.SWIGLUOAI, x), torch.tensor([exp]))


def test_silu_equals_swigluoai_uninterleave_with_alpha1_beta0():
    x = torch.randn(8, 64)
    torch.testing.assert_close(apply_moe_activation(A.SILU, x),
                               apply_moe_activation(A.SWIGLUOAI_UNINTERLEAVE, x, alpha=1.0, beta=0.0))


def test_swiglustep_and_no_mul():
    x = torch.tensor([[20.0, -20.0]])
    assert apply_moe_activation(A.SWIGLUSTEP, x).item() == pytest.approx(7.0 * -7.0)
    y = torch.tensor([[-1.0, 3.0]])
    assert apply_moe_activation(A.RELU2_NO_MUL, y).tolist() == [[0.0, 9.0]]
    torch.testing.assert_close(apply_moe_activation(A.SILU_NO_MUL, y), torch.tensor([[silu(-1), silu(3)]]))


def test_output_dtype_and_single_rounding():
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    out = apply_moe_activation(A.SILU, x)
    assert out.dtype == torch.bfloat16
    g, u = x.float().chunk(2, -1)
    assert torch.equal(out, (torch.nn.functional.silu(g) * u).to(torch.bfloat16))


def test_gated_relu2_raises_and_is_gated():
    with pytest.raises(ValueError, match="RELU2_NO_MUL"):
        apply_moe_activation(A.RELU2, torch.randn(2, 4))
    assert [a for a in A if not a.is_gated] == [A.SILU_NO_MUL, A.GELU_NO_MUL, A.RELU2_NO_MUL]
    assert adjust_N_for_activation(512, A.SILU) == 256 and adjust_N_for_activation(512, A.RELU2_NO_MUL) == 512
    with pytest.raises(ValueError, match="even"):
        apply_moe_activation(A.SILU, torch.randn(2, 5))
    with pytest.raises(ValueError, match="unknown MoE activation"):
        A.from_str("swish")


# --- the conformance check of activations (conformance/test_activation.py) against exact float64 values -----------
def _exact_gelu_family(activation, x: torch.Tensor) -> torch.Tensor:
    """GELU / GELU_TANH / GELU_NO_MUL in float64 (an oracle independent of torch's fp32 kernels), rounded once."""
    xd = x.double()
    g, u = (xd.chunk(2, dim=-1) if activation is not A.GELU_NO_MUL else (xd, 1.0))
    if activation is A.GELU_TANH:
        y = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
    else:
        y = 0.5 * g * (1 + torch.special.erf(g / math.sqrt(2)))
    return (y * u).to(x.dtype)


@pytest.mark.parametrize("activation", [A.GELU, A.GELU_TANH, A.GELU_NO_MUL])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_conformance_activation_tolerance_accepts_exact_gelu_and_rejects_a_wrong_one(activation, dtype):
    from conformance.metrics import ConformanceFailure, assert_ulps, gelu_cancellation_atol
    from specs import load_tolerances

    tol = load_tolerances()["activation"]
    ulps = tol["ulps"][str(dtype).removeprefix("torch.")]
    # Dense over the cancelling tail (x in [-12, -3]) and the rest of the conformance range.
    g = torch.cat([torch.linspace(-12, -3, 4096), torch.linspace(-3, 12, 4096)])
    # Packed halves (g | u) for the gated forms.
    x = (g[None] if activation is A.GELU_NO_MUL else torch.cat([g[None], torch.full_like(g, 1.5)[None]], dim=1))
    x = x.to(dtype)
    ref = apply_moe_activation(activation, x)  # fp32 computation, one rounding: the spec
    exact = _exact_gelu_family(activation, x)
    atol = gelu_cancellation_atol(activation, x, tol["gelu_cancellation"])
    # A correctly rounded implementation passes only thanks to the cancellation allowance (in bf16 the fp32
    # reference is the inexact one there) ...
    assert_ulps(exact, ref, ulps, case="exact", what="exact gelu", atol=atol)
    if dtype is torch.bfloat16:
        with pytest.raises(ConformanceFailure, match="beyond"):
            assert_ulps(exact, ref, ulps, case="exact", what="exact gelu")
    # ... and the allowance is far too small to hide a wrong formula (the other GELU variant).
    other = {A.GELU: A.GELU_TANH, A.GELU_TANH: A.GELU, A.GELU_NO_MUL: A.GELU_TANH}[activation]
    wrong = (_exact_gelu_family(other, x) if activation is not A.GELU_NO_MUL
             else _exact_gelu_family(A.GELU_TANH, torch.cat([x, torch.ones_like(x)], dim=1)))
    with pytest.raises(ConformanceFailure, match="beyond"):
        assert_ulps(wrong, ref, ulps, case="wrong", what="wrong gelu", atol=atol)
