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
    assert [a for a in A if not a.is_gated] == [A.SILU_NO_MUL, A.GELU_NO_MUL, A.RELU2_NO_MUL, A.GELU_TANH_NO_MUL]
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


# --- vLLM 0.33's new members: SITU and GELU_TANH_NO_MUL, against float64 formulas written from the upstream source ---
def _situ_f64(x: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """csrc/activation_kernels.cu situ_activation, in float64: (0.5 b) tanh(g / b) (1 + tanh(g / 2)) * u', with
    u' = lb tanh(u / lb) for lb > 0 (the kernel's sigmoid form, independent of the reference's torch.sigmoid)."""
    xd = x.double()
    d = xd.shape[-1] // 2
    g, u = xd[..., :d], xd[..., d:]
    gate = (0.5 * beta) * torch.tanh(g / beta) * (1.0 + torch.tanh(g * 0.5))
    if linear_beta is not None and linear_beta > 0:
        u = linear_beta * torch.tanh(u / linear_beta)
    return gate * u


def test_situ_hand_value():
    # g = 2, u = 30, b = 4, lb = 25: 4 tanh(0.5) sigmoid(2) * 25 tanh(1.2)
    x = torch.tensor([[2.0, 30.0]], dtype=torch.float64)
    exp = 4 * math.tanh(0.5) / (1 + math.exp(-2)) * 25 * math.tanh(1.2)
    out = apply_moe_activation(A.SITU, x.float(), situ_beta=4.0, situ_linear_beta=25.0)
    torch.testing.assert_close(out, torch.tensor([[exp]], dtype=torch.float32))  # fp32 default tolerances
    # linear_beta unset (None or <= 0): u passes through
    for lb in (None, 0.0, -1.0):
        out = apply_moe_activation(A.SITU, x.float(), situ_beta=4.0, situ_linear_beta=lb)
        torch.testing.assert_close(out, torch.tensor([[4 * math.tanh(0.5) / (1 + math.exp(-2)) * 30]]))


def _spec_ulps(dtype):
    from specs import load_tolerances

    tol = load_tolerances()["activation"]
    return tol["ulps"][str(dtype).removeprefix("torch.")], tol["gelu_cancellation"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("linear_beta", [25.0, None])
def test_situ_matches_float64_within_one_rounding(dtype, linear_beta):
    """fp32 math rounded once: within the activation ulps of specs/tolerances.toml of the float64 value."""
    from conformance.metrics import assert_ulps

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 512, generator=g) * 6).to(dtype)
    out = apply_moe_activation(A.SITU, x, situ_beta=4.0, situ_linear_beta=linear_beta)
    assert out.dtype == dtype and out.shape == (64, 256)
    ulps, _ = _spec_ulps(dtype)
    assert_ulps(out, _situ_f64(x, 4.0, linear_beta).to(dtype), ulps, case=f"situ-{dtype}", what="SITU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gelu_tanh_no_mul_matches_float64(dtype):
    from conformance.metrics import assert_ulps, gelu_cancellation_atol

    g = torch.Generator().manual_seed(4)
    x = torch.cat([torch.linspace(-12, -3, 2048), torch.randn(2048, generator=g) * 4])[None].to(dtype)
    xd = x.double()
    exact = 0.5 * xd * (1 + torch.tanh(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd**3)))
    out = apply_moe_activation(A.GELU_TANH_NO_MUL, x)
    assert out.shape == x.shape and out.dtype == dtype
    ulps, cancel = _spec_ulps(dtype)
    assert_ulps(out, exact.to(dtype), ulps, case=f"gelu_tanh_no_mul-{dtype}", what="GELU_TANH_NO_MUL",
                atol=gelu_cancellation_atol(A.GELU_TANH_NO_MUL, x, cancel))
    assert not A.GELU_TANH_NO_MUL.is_gated and A.SITU.is_gated
    assert adjust_N_for_activation(512, A.GELU_TANH_NO_MUL) == 512 and adjust_N_for_activation(512, A.SITU) == 256


def test_new_members_need_033_semantics_and_situ_needs_beta():
    from reference.activation import activation_defined
    from reference.semantics import SemanticsError, use_semantics

    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="situ_beta"):
        apply_moe_activation(A.SITU, x)
    with pytest.raises(ValueError, match="situ_beta"):
        apply_moe_activation(A.SITU, x, situ_beta=0.0)
    with use_semantics("0.17"):
        assert not activation_defined(A.SITU) and activation_defined(A.SILU)
        for act in (A.SITU, A.GELU_TANH_NO_MUL):
            with pytest.raises(SemanticsError, match="0.33"):
                apply_moe_activation(act, x, situ_beta=1.0)
    assert activation_defined(A.SITU, "0.33") and A.from_str("situ") is A.SITU


# ---------------------------------------------------------------------------------------------------------------
# vLLM 0.33's FusedMoEExpertsModular.activation(..., topk_ids, expert_map, valid_token_counts)
# ---------------------------------------------------------------------------------------------------------------

from reference.activation import ApplyMoEActivationConfig, apply_moe_activation_into  # noqa: E402
from reference.semantics import SemanticsError, use_semantics  # noqa: E402


def test_activation_config_fallbacks_quant_then_layer_then_defaults():
    from reference.config import FusedMoEConfig, FusedMoEQuantConfig

    moe = FusedMoEConfig(num_experts=4, experts_per_token=2, hidden_dim=8, intermediate_size_per_partition=8,
                         num_local_experts=4, swiglu_limit=5.0, swiglu_alpha=1.5, activation_situ_beta=4.0)
    qc = FusedMoEQuantConfig(gemm1_clamp_limit=7.0)
    cfg = ApplyMoEActivationConfig.from_configs(moe, qc)
    assert (cfg.clamp_limit, cfg.alpha, cfg.beta, cfg.activation_situ_beta) == (7.0, 1.5, 0.0, 4.0)
    cfg = ApplyMoEActivationConfig.from_configs(
        FusedMoEConfig(num_experts=4, experts_per_token=2, hidden_dim=8, intermediate_size_per_partition=8,
                       num_local_experts=4), FusedMoEQuantConfig())
    assert cfg == ApplyMoEActivationConfig(None, 1.0, 0.0, None, None)


def test_masked_batched_rows_by_hand():
    """(E=2, T=3): counts [2, 5] -> expert 0 rows 0, 1 written, row 2 untouched; expert 1 all 3 (count clamped)."""
    x = torch.tensor([[[1.0, 3.0], [-2.0, 0.5], [float("nan"), float("inf")]],
                      [[0.0, 1.0], [1.0, 1.0], [2.0, -1.0]]])
    out = torch.full((2, 3, 1), -7.0)
    apply_moe_activation_into(A.SILU, out, x, valid_token_counts=torch.tensor([2, 5], dtype=torch.int32),
                              semantics="0.33")
    exp = torch.tensor([[[silu(1) * 3], [silu(-2) * 0.5], [-7.0]], [[0.0], [silu(1)], [silu(2) * -1]]])
    torch.testing.assert_close(out, exp)
    out2 = torch.full((3, 1), -7.0)  # 2-D: one count; a negative count writes nothing
    apply_moe_activation_into(A.SILU, out2, x[1], valid_token_counts=torch.tensor([-1], dtype=torch.int32),
                              semantics="0.33")
    assert bool((out2 == -7.0).all())


def test_silu_clamp_masked_reads_alpha_beta_unmasked_does_not():
    x = torch.tensor([[9.0, 2.0]])  # g = 9 -> clamped to 7, u = 2
    cfg = ApplyMoEActivationConfig(clamp_limit=7.0, alpha=2.0, beta=1.0)
    out = torch.empty(1, 1)
    apply_moe_activation_into(A.SILU, out, x, activation_config=cfg, semantics="0.33")
    torch.testing.assert_close(out, torch.tensor([[silu(7.0) * 2.0]]))
    apply_moe_activation_into(A.SILU, out, x, activation_config=cfg, semantics="0.33",
                              valid_token_counts=torch.tensor([1], dtype=torch.int32))
    torch.testing.assert_close(out, torch.tensor([[7.0 / (1 + math.exp(-14.0)) * 3.0]]))


def test_swigluoai_ignores_the_config():
    x = torch.tensor([[10.0, 1.0]])
    out = torch.empty(1, 1)
    apply_moe_activation_into(A.SWIGLUOAI, out, x, activation_config=ApplyMoEActivationConfig(clamp_limit=2.0,
                                                                                              alpha=5.0),
                              semantics="0.33")
    torch.testing.assert_close(out, apply_moe_activation(A.SWIGLUOAI, x))


def test_pad_aware_limit_skips_minus_one_and_non_local_and_limit_zero_does_not_clamp():
    emap = torch.tensor([-1, 0, 1, -1], dtype=torch.int32)
    ids = torch.tensor([[1, -1], [0, 2]], dtype=torch.int32)  # routes: local, -1, non-local, local
    x = torch.tensor([[9.0, 2.0], [1.0, 1.0], [1.0, 1.0], [-1.0, 8.0]])
    for limit, exp0, exp3 in ((7.0, silu(7.0) * 2.0, silu(-1.0) * 7.0), (0.0, silu(9.0) * 2.0, silu(-1.0) * 8.0)):
        out = torch.full((4, 1), -5.0)
        apply_moe_activation_into(A.SILU, out, x, activation_config=ApplyMoEActivationConfig(clamp_limit=limit),
                                  topk_ids=ids, expert_map=emap, semantics="0.33")
        torch.testing.assert_close(out, torch.tensor([[exp0], [-5.0], [-5.0], [exp3]]))
    # without expert_map every row is written, and limit 0 clamps (silu_and_mul_with_clamp(0.0, 1.0, 0.0))
    out = torch.full((4, 1), -5.0)
    apply_moe_activation_into(A.SILU, out, x, activation_config=ApplyMoEActivationConfig(clamp_limit=0.0),
                              topk_ids=ids, semantics="0.33")
    torch.testing.assert_close(out, torch.zeros(4, 1))


def test_activation_into_errors_and_versions():
    x, out = torch.zeros(2, 4), torch.zeros(2, 2)
    with pytest.raises(SemanticsError):
        apply_moe_activation_into(A.SILU, out, x, semantics="0.17")
    with pytest.raises(NotImplementedError):
        apply_moe_activation_into(A.RELU2, out, x, valid_token_counts=torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        apply_moe_activation_into(A.SILU, out, x, valid_token_counts=torch.tensor([1]))
    with pytest.raises(ValueError, match="clamp_limit"):
        apply_moe_activation_into(A.SWIGLUOAI_UNINTERLEAVE, out, x)
    with pytest.raises(ValueError, match="element"):
        apply_moe_activation_into(A.SILU, out.expand(3, 2, 2).clone(), x.expand(3, 2, 4).clone(),
                                  valid_token_counts=torch.tensor([1], dtype=torch.int32))


def test_relu2_no_mul_unmasked_relus_the_input_in_place():
    x = torch.tensor([[-2.0, 3.0]])
    out = torch.empty(1, 2)
    apply_moe_activation_into(A.RELU2_NO_MUL, out, x, semantics="0.33")
    assert out.tolist() == [[0.0, 9.0]] and x.tolist() == [[0.0, 3.0]]


def test_experts_activation_method_per_version():
    from reference.config import FusedMoEConfig, FusedMoEQuantConfig
    from reference.experts import ReferenceExperts

    moe = FusedMoEConfig(num_experts=2, experts_per_token=1, hidden_dim=8, intermediate_size_per_partition=2,
                         num_local_experts=2, swiglu_limit=7.0)
    ex = ReferenceExperts(moe, FusedMoEQuantConfig())
    x = torch.tensor([[[9.0, 0.0, 2.0, 0.0]], [[1.0, 1.0, 1.0, 1.0]]])
    vtc = torch.tensor([1, 0], dtype=torch.int32)
    out = torch.full((2, 1, 2), -1.0)
    with use_semantics("0.33"):
        ex.activation(A.SILU, out, x, valid_token_counts=vtc)  # swiglu_limit is the clamp fallback
    torch.testing.assert_close(out, torch.tensor([[[silu(7.0) * 2.0, 0.0]], [[-1.0, -1.0]]]))
    with use_semantics("0.17"):
        with pytest.raises(SemanticsError):
            ex.activation(A.SILU, out, x, valid_token_counts=vtc)
        out2 = torch.empty(1, 2)
        ex.activation(A.SILU, out2, x[0])  # the seed's signature: no layer fallback
        torch.testing.assert_close(out2, torch.tensor([[silu(9.0) * 2.0, 0.0]]))
