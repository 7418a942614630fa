"""Tests of reference.gate (the router gate GEMM tiers of seed 000) against independent oracles.

The dispatch oracle (`_SeedGate`) is a literal re-reading of seed 000
(vllm/model_executor/layers/fused_moe/router/gate_linear.py: GateLinear.__init__, set_out_dtype, forward,
fp32_router_gemm_dispatch_impl, plus the TORCH_CHECKs of the two router kernels). It shares no code with
reference/gate.py. The numerics oracles are float64 matmuls, math.fsum and torch's own bf16 F.linear.
"""

from __future__ import annotations

import itertools
import math
import pathlib

import pytest
import torch
import torch.nn.functional as F

from reference.gate import (
    CPU,
    ROCM_MI300,
    SM80,
    SM89,
    SM90,
    SM100,
    SM103,
    SM120,
    GateContractError,
    GateLinear,
    GateTier,
    Platform,
    can_use_specialized_kernels,
    gate_reference,
    resolve_params_dtype,
    select_gate_tier,
)
from tools.gate_docs import BEGIN, END, regenerate, render_tier_table

BF16, FP32 = torch.bfloat16, torch.float32
REPO = pathlib.Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------------------------
# The oracle: seed 000 read line by line (written without looking at reference/gate.py's structure).
# ----------------------------------------------------------------------------------------------------------------


class _SeedError(Exception):
    """What the seed would raise (a TORCH_CHECK or F.linear dtype error)."""


class _SeedGate:
    DSV3_SUPPORTED_NUM_EXPERTS = [256, 384]
    DSV3_SUPPORTED_HIDDEN_SIZES = [7168]
    FP32_SUPPORTED_NUM_EXPERTS = [256]
    FP32_SUPPORTED_HIDDEN_SIZES = [3072]
    _FP32_ROUTER_GEMM_MAX_TOKENS = 32

    def __init__(self, input_size, output_size, bias, out_dtype, params_dtype, force_fp32_compute, is_cuda, cap):
        # current_platform stand-ins (vllm/platforms/interface.py semantics)
        def is_device_capability(c):
            if cap is None:
                return False
            return cap == c

        def is_device_capability_family(c):
            if cap is None:
                return False
            return (cap[0] * 10 + cap[1]) // 10 == c // 10

        is_hopper_or_blackwell = is_device_capability((9, 0)) or is_device_capability_family(100)
        can_use_specialized_kernels = is_cuda and is_hopper_or_blackwell and not bias
        if force_fp32_compute and not can_use_specialized_kernels:
            params_dtype = torch.float32
        # ReplicatedLinear / LinearBase: params_dtype None -> torch.get_default_dtype()
        self.weight_dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        self.has_bias = bias
        self.out_dtype = out_dtype
        self.allow_specialized_router_gemm = can_use_specialized_kernels
        self.allow_dsv3_router_gemm = (
            self.allow_specialized_router_gemm
            and output_size in self.DSV3_SUPPORTED_NUM_EXPERTS
            and input_size in self.DSV3_SUPPORTED_HIDDEN_SIZES
        )
        self.allow_fp32_router_gemm = (
            not bias
            and self.weight_dtype == torch.float32
            and is_cuda
            and is_hopper_or_blackwell
            and output_size in self.FP32_SUPPORTED_NUM_EXPERTS
            and input_size in self.FP32_SUPPORTED_HIDDEN_SIZES
        )
        self.allow_cublas_router_gemm = (
            self.allow_specialized_router_gemm
            and self.weight_dtype == torch.bfloat16
            and self.out_dtype == torch.float32
        )

    def set_out_dtype(self, out_dtype):
        if self.out_dtype is not None:
            raise ValueError("out_dtype has already been set")
        self.out_dtype = out_dtype
        if (
            not self.allow_cublas_router_gemm
            and self.allow_specialized_router_gemm
            and out_dtype == torch.float32
        ):
            self.allow_cublas_router_gemm = self.weight_dtype == torch.bfloat16

    def forward(self, num_tokens, x_dtype):
        """(branch name, output dtype) or raises _SeedError."""
        if self.allow_dsv3_router_gemm and num_tokens <= 16:
            # ops.dsv3_router_gemm: torch.empty(..., dtype=output_dtype) then the kernel's TORCH_CHECKs
            out = self.out_dtype if self.out_dtype is not None else torch.get_default_dtype()
            if not (1 <= num_tokens <= 16) or x_dtype != torch.bfloat16 or self.weight_dtype != torch.bfloat16:
                raise _SeedError("dsv3_router_gemm")
            if out not in (torch.float32, torch.bfloat16):
                raise _SeedError("dsv3_router_gemm output")
            return "dsv3", out
        if self.allow_fp32_router_gemm and x_dtype in (torch.float32, torch.bfloat16):
            if num_tokens <= self._FP32_ROUTER_GEMM_MAX_TOKENS:
                return "fp32_kernel", torch.float32
            return "fp32_linear", torch.float32  # F.linear(x.float(), weight) with an fp32 weight
        if self.allow_cublas_router_gemm and x_dtype == torch.bfloat16:
            return "mm", torch.float32
        if self.out_dtype is not None and x_dtype != self.weight_dtype:
            x_dtype = self.weight_dtype
        if x_dtype != self.weight_dtype:
            raise _SeedError("F.linear dtype mismatch")
        output_dtype = self.weight_dtype
        if self.out_dtype is not None and output_dtype != self.out_dtype:
            output_dtype = self.out_dtype
        return "linear", output_dtype


_BRANCH_TO_TIER = {
    "dsv3": GateTier.DSV3_ROUTER_GEMM,
    "fp32_kernel": GateTier.FP32_ROUTER_GEMM,
    "fp32_linear": GateTier.FP32_DISPATCH_F_LINEAR,
    "mm": GateTier.CUBLAS_BF16_FP32,
    "linear": GateTier.F_LINEAR,
}

# The oracle raises before it can name a branch; for those, the branch the seed's if-chain entered is tier 1
# (the only kernel whose dtype contract the dispatch does not guarantee) or tier 4 (F.linear mixed dtypes).


def _oracle_branch_only(o: _SeedGate, num_tokens: int, x_dtype: torch.dtype) -> GateTier:
    if o.allow_dsv3_router_gemm and num_tokens <= 16:
        return GateTier.DSV3_ROUTER_GEMM
    if o.allow_fp32_router_gemm and x_dtype in (torch.float32, torch.bfloat16):
        return GateTier.FP32_ROUTER_GEMM if num_tokens <= 32 else GateTier.FP32_DISPATCH_F_LINEAR
    if o.allow_cublas_router_gemm and x_dtype == torch.bfloat16:
        return GateTier.CUBLAS_BF16_FP32
    return GateTier.F_LINEAR


# ----------------------------------------------------------------------------------------------------------------
# Dispatch: exhaustive enumeration against the oracle
# ----------------------------------------------------------------------------------------------------------------

MS = (1, 16, 17, 32, 33, 256)
HES = ((7168, 256), (7168, 384), (3072, 256), (4096, 128), (2048, 128))
W_DTYPES = (BF16, FP32)
X_DTYPES = (BF16, FP32)
OUT_DTYPES = (None, FP32, BF16)
PLATFORMS = (CPU, SM80, SM90, SM100, SM120, SM89, SM103, ROCM_MI300)


@pytest.mark.parametrize("HE", HES, ids=lambda he: f"H{he[0]}-E{he[1]}")
@pytest.mark.parametrize("platform", PLATFORMS, ids=lambda p: p.name)
def test_dispatch_matches_seed_transcription(platform: Platform, HE: tuple[int, int]) -> None:
    H, E = HE
    failures: list[str] = []
    checked = 0
    for w_dtype, out_dtype, bias, force, late in itertools.product(
        W_DTYPES, OUT_DTYPES, (False, True), (False, True), (False, True)
    ):
        # late=True: construct with out_dtype=None, then set_out_dtype(out_dtype) (the seed's set_out_dtype path).
        oracle = _SeedGate(H, E, bias, None if late else out_dtype, w_dtype, force, platform.is_cuda,
                           platform.capability)
        with torch.device("meta"):  # no real allocation: the weights are up to 384 x 7168
            gate = GateLinear(H, E, bias=bias, out_dtype=None if late else out_dtype, params_dtype=w_dtype,
                              force_fp32_compute=force, platform=platform)
        if late:
            oracle.set_out_dtype(out_dtype)
            gate.set_out_dtype(out_dtype)
        for flag in ("allow_specialized_router_gemm", "allow_dsv3_router_gemm", "allow_fp32_router_gemm",
                     "allow_cublas_router_gemm"):
            if getattr(gate, flag) != getattr(oracle, flag):
                failures.append(f"{flag}: w={w_dtype} out={out_dtype} bias={bias} force={force} late={late}")
        if gate.weight.dtype != oracle.weight_dtype:
            failures.append(f"weight dtype {gate.weight.dtype} != {oracle.weight_dtype} (force={force})")
        for M, x_dtype in itertools.product(MS, X_DTYPES):
            checked += 1
            ctx = f"M={M} x={x_dtype} w={w_dtype} out={out_dtype} bias={bias} force={force} late={late}"
            x = torch.empty(M, H, dtype=x_dtype, device="meta")
            expected_tier = _oracle_branch_only(oracle, M, x_dtype)
            got_tier = gate.tier_for(x)
            pure = select_gate_tier(M, H, E, x_dtype=x_dtype, weight_dtype=gate.weight.dtype,
                                    out_dtype=gate.out_dtype, bias=bias, platform=platform)
            if got_tier is not expected_tier or pure is not expected_tier:
                failures.append(f"tier {got_tier}/{pure} != {expected_tier}: {ctx}")
                continue
            try:
                branch, out_dt = oracle.forward(M, x_dtype)
            except _SeedError:
                with pytest.raises(GateContractError):
                    gate(x)
                continue
            assert _BRANCH_TO_TIER[branch] is expected_tier
            y, y_bias = gate(x)
            if y.shape != (M, E) or y.dtype != out_dt or y_bias is not None:
                failures.append(f"output {tuple(y.shape)} {y.dtype} (bias {y_bias}) != {(M, E)} {out_dt}: {ctx}")
    assert checked == 2 * 3 * 2 * 2 * 2 * len(MS) * 2
    assert not failures, f"{len(failures)} mismatches, first: " + "\n".join(failures[:10])


def test_hopper_and_blackwell_dispatch_identically() -> None:
    for (H, E), w, x, out, bias, M in itertools.product(HES, W_DTYPES, X_DTYPES, OUT_DTYPES, (False, True), MS):
        kw = dict(x_dtype=x, weight_dtype=w, out_dtype=out, bias=bias)
        tiers = {select_gate_tier(M, H, E, platform=p, **kw) for p in (SM90, SM100, SM103)}
        assert len(tiers) == 1
        others = {select_gate_tier(M, H, E, platform=p, **kw) for p in (CPU, SM80, SM89, SM120, ROCM_MI300)}
        assert others == {GateTier.F_LINEAR}


def test_not_cuda_with_hopper_capability_is_not_specialized() -> None:
    fake = Platform(is_cuda=False, capability=(9, 0))
    assert fake.is_hopper_or_blackwell
    assert not can_use_specialized_kernels(fake, bias=False)
    assert select_gate_tier(1, 7168, 256, x_dtype=BF16, weight_dtype=BF16, out_dtype=FP32, bias=False,
                            platform=fake) is GateTier.F_LINEAR
    assert select_gate_tier(1, 3072, 256, x_dtype=FP32, weight_dtype=FP32, out_dtype=FP32, bias=False,
                            platform=fake) is GateTier.F_LINEAR


def test_tier1_boundaries_and_M0() -> None:
    kw = dict(x_dtype=BF16, weight_dtype=BF16, out_dtype=None, bias=False, platform=SM90)
    assert select_gate_tier(0, 7168, 256, **kw) is GateTier.DSV3_ROUTER_GEMM  # seed routes M == 0 here
    assert select_gate_tier(16, 7168, 384, **kw) is GateTier.DSV3_ROUTER_GEMM
    assert select_gate_tier(17, 7168, 256, **kw) is GateTier.F_LINEAR  # out_dtype unset: no tier 3
    assert select_gate_tier(17, 7168, 256, **{**kw, "out_dtype": FP32}) is GateTier.CUBLAS_BF16_FP32
    # tier 1 ignores x / weight / out dtypes in the dispatch
    assert select_gate_tier(4, 7168, 256, **{**kw, "x_dtype": FP32, "weight_dtype": FP32,
                                             "out_dtype": torch.float16}) is GateTier.DSV3_ROUTER_GEMM


def test_tier2_runtime_switch_and_x_dtype() -> None:
    kw = dict(weight_dtype=FP32, out_dtype=None, bias=False, platform=SM100)
    assert select_gate_tier(0, 3072, 256, x_dtype=BF16, **kw) is GateTier.FP32_ROUTER_GEMM
    assert select_gate_tier(32, 3072, 256, x_dtype=FP32, **kw) is GateTier.FP32_ROUTER_GEMM
    assert select_gate_tier(33, 3072, 256, x_dtype=FP32, **kw) is GateTier.FP32_DISPATCH_F_LINEAR
    assert select_gate_tier(8, 3072, 256, x_dtype=torch.float16, **kw) is GateTier.F_LINEAR
    assert GateTier.FP32_DISPATCH_F_LINEAR.seed_tier == 2
    assert [t.seed_tier for t in GateTier] == [1, 2, 3, 4, 2]


# ----------------------------------------------------------------------------------------------------------------
# Construction semantics
# ----------------------------------------------------------------------------------------------------------------


def test_set_out_dtype_twice_raises() -> None:
    g = GateLinear(64, 8, params_dtype=BF16)
    g.set_out_dtype(FP32)
    with pytest.raises(ValueError, match="out_dtype has already been set"):
        g.set_out_dtype(FP32)
    g2 = GateLinear(64, 8, params_dtype=BF16, out_dtype=BF16)
    with pytest.raises(ValueError, match="out_dtype has already been set"):
        g2.set_out_dtype(FP32)


def test_set_out_dtype_fp32_enables_tier3_on_sm90() -> None:
    g = GateLinear(4096, 128, params_dtype=BF16, platform=SM90)
    x = torch.zeros(64, 4096, dtype=BF16)
    assert not g.allow_cublas_router_gemm and g.tier_for(x) is GateTier.F_LINEAR
    g.set_out_dtype(FP32)
    assert g.allow_cublas_router_gemm and g.tier_for(x) is GateTier.CUBLAS_BF16_FP32
    y, _ = g(x)
    assert y.dtype == FP32
    # bf16 out_dtype does not enable it; neither does fp32 on a platform without specialized kernels
    g_bf16 = GateLinear(4096, 128, params_dtype=BF16, platform=SM90)
    g_bf16.set_out_dtype(BF16)
    assert not g_bf16.allow_cublas_router_gemm
    g_a100 = GateLinear(4096, 128, params_dtype=BF16, platform=SM80)
    g_a100.set_out_dtype(FP32)
    assert not g_a100.allow_cublas_router_gemm and g_a100.tier_for(x) is GateTier.F_LINEAR


def test_force_fp32_compute_params_dtype() -> None:
    assert GateLinear(64, 8, params_dtype=BF16, force_fp32_compute=True).weight.dtype == FP32  # CPU
    assert GateLinear(64, 8, params_dtype=BF16, force_fp32_compute=True, platform=SM80).weight.dtype == FP32
    assert GateLinear(64, 8, params_dtype=BF16, force_fp32_compute=True, platform=SM120).weight.dtype == FP32
    # specialized kernels available: the weight keeps its dtype
    assert GateLinear(64, 8, params_dtype=BF16, force_fp32_compute=True, platform=SM90).weight.dtype == BF16
    # ... unless a bias disables them
    g = GateLinear(64, 8, bias=True, params_dtype=BF16, force_fp32_compute=True, platform=SM90)
    assert g.weight.dtype == FP32 and g.bias.dtype == FP32
    assert resolve_params_dtype(BF16, bias=False, force_fp32_compute=True, platform=SM100) == BF16
    assert resolve_params_dtype(None, bias=False, force_fp32_compute=False, platform=CPU) == torch.get_default_dtype()


def test_force_fp32_compute_without_out_dtype_still_rounds_to_bf16_on_sm90() -> None:
    """Seed hazard: on SM90 force_fp32_compute keeps a bf16 weight; without out_dtype=fp32, tier 4 runs in bf16."""
    g = GateLinear(2688, 128, params_dtype=BF16, force_fp32_compute=True, platform=SM90)
    x = torch.randn(40, 2688, generator=torch.Generator().manual_seed(0)).to(BF16)
    g.weight.data.copy_(torch.randn(128, 2688, generator=torch.Generator().manual_seed(1)) * 0.02)
    assert g.tier_for(x) is GateTier.F_LINEAR
    assert g(x)[0].dtype == BF16
    g.set_out_dtype(FP32)
    assert g.tier_for(x) is GateTier.CUBLAS_BF16_FP32


def test_bias_disables_specialized_tiers() -> None:
    cases = [
        (7168, 256, BF16, BF16, FP32, 4),     # would be tier 1
        (3072, 256, FP32, FP32, FP32, 8),     # would be tier 2
        (3072, 256, FP32, BF16, None, 64),    # would be tier 2 (F.linear branch)
        (4096, 128, BF16, BF16, FP32, 64),    # would be tier 3
    ]
    for H, E, w, x_dtype, out, M in cases:
        for p in (SM90, SM100):
            no_bias = select_gate_tier(M, H, E, x_dtype=x_dtype, weight_dtype=w, out_dtype=out, bias=False, platform=p)
            assert no_bias is not GateTier.F_LINEAR
            assert select_gate_tier(M, H, E, x_dtype=x_dtype, weight_dtype=w, out_dtype=out, bias=True,
                                    platform=p) is GateTier.F_LINEAR
        with torch.device("meta"):
            g = GateLinear(H, E, bias=True, out_dtype=out, params_dtype=w, platform=SM90)
        assert not (g.allow_specialized_router_gemm or g.allow_dsv3_router_gemm or g.allow_fp32_router_gemm
                    or g.allow_cublas_router_gemm)
        assert g.tier_for(torch.empty(M, H, dtype=x_dtype, device="meta")) is GateTier.F_LINEAR


# ----------------------------------------------------------------------------------------------------------------
# Numerics
# ----------------------------------------------------------------------------------------------------------------


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().T


def _assert_within_half_ulp_fp32(y: torch.Tensor, exact: torch.Tensor) -> None:
    """y (fp32) is the fp64 value rounded to fp32: |y - exact| <= half an fp32 ulp (<= 2^-24 |exact|)."""
    assert y.dtype == FP32
    err = (y.double() - exact).abs()
    bound = exact.abs() * 2.0**-24 + 2.0**-149
    assert bool((err <= bound).all()), f"max err {err.max().item()} exceeds half-ulp bound"


def _fsum_fp32(x: torch.Tensor, w: torch.Tensor, i: int, j: int) -> float:
    prods = [a * b for a, b in zip(x[i].double().tolist(), w[j].double().tolist())]  # exact in double
    return torch.tensor(math.fsum(prods), dtype=torch.float64).to(FP32).item()


def test_tier4_bf16_rounds_to_weight_dtype_before_out_cast() -> None:
    # small-integer data: every fp32 partial sum is exact, so any fp32-accumulating F.linear gives the same bits
    x = torch.randint(-8, 9, (8, 64), generator=_gen(0)).to(BF16)
    w = torch.randint(-8, 9, (16, 64), generator=_gen(1)).to(BF16)
    b = torch.randint(-300, 301, (16,), generator=_gen(2)).to(BF16)
    g = GateLinear(64, 16, bias=True, out_dtype=FP32, params_dtype=BF16, platform=SM90)  # bias -> tier 4
    g.weight.data.copy_(w)
    g.bias.data.copy_(b)
    assert g.tier_for(x) is GateTier.F_LINEAR
    y, y_bias = g(x)
    assert y.dtype == FP32 and y_bias is None
    torch.testing.assert_close(y, F.linear(x, w, b).float(), rtol=0, atol=0)
    fp32_product = x.float() @ w.float().T + b.float()
    assert bool((y != fp32_product).any()), "tier 4 must differ from the unrounded fp32 product somewhere"
    assert torch.equal(y, fp32_product.to(BF16).float())


def test_tier4_random_data_against_torch_bf16_linear() -> None:
    x = torch.randn(33, 512, generator=_gen(3)).to(BF16)
    w = (torch.randn(64, 512, generator=_gen(4)) * 0.05).to(BF16)
    y = gate_reference(x, w, tier=GateTier.F_LINEAR, out_dtype=FP32)
    ref = F.linear(x, w).float()
    # torch's CPU accumulation order differs from the exact sum: at most one bf16 ulp apart, mostly equal
    ulp = torch.finfo(BF16).eps * ref.abs().clamp_min(2.0**-126)
    assert bool(((y - ref).abs() <= ulp).all())
    assert (y == ref).float().mean().item() > 0.95
    # x in fp32 with a bf16 weight: x is rounded to bf16 first (out_dtype set)
    xf = torch.randn(33, 512, generator=_gen(5))
    torch.testing.assert_close(gate_reference(xf, w, tier=GateTier.F_LINEAR, out_dtype=FP32),
                               gate_reference(xf.to(BF16), w, tier=GateTier.F_LINEAR, out_dtype=FP32), rtol=0, atol=0)


def test_tier4_fp32_weight_and_out_dtype_cast() -> None:
    x = torch.randn(5, 96, generator=_gen(6)).to(BF16)
    w = torch.randn(12, 96, generator=_gen(7))
    y = gate_reference(x, w, tier=GateTier.F_LINEAR, out_dtype=BF16)  # x -> fp32, fp32 linear, -> bf16
    assert y.dtype == BF16
    torch.testing.assert_close(y, _exact(x.float(), w).float().to(BF16), rtol=0, atol=0)
    with pytest.raises(GateContractError, match="one dtype"):
        gate_reference(x, w, tier=GateTier.F_LINEAR, out_dtype=None)


def test_tier1_fp32_exact_and_bf16_out_rounded_once() -> None:
    x = torch.randn(16, 7168, generator=_gen(8)).to(BF16)
    w = (torch.randn(256, 7168, generator=_gen(9)) * 0.02).to(BF16)
    g = GateLinear(7168, 256, out_dtype=FP32, params_dtype=BF16, platform=SM90)
    g.weight.data.copy_(w)
    assert g.tier_for(x) is GateTier.DSV3_ROUTER_GEMM
    y, _ = g(x)
    exact = _exact(x, w)
    _assert_within_half_ulp_fp32(y, exact)
    assert bool((y.to(BF16).float() != y).any()), "no intermediate bf16 rounding"
    for i, j in ((0, 0), (3, 17), (15, 255), (7, 128)):
        assert y[i, j].item() == _fsum_fp32(x, w, i, j)
    # an fp32-accumulating kernel (torch's fp32 matmul) lies within the gamma_H bound of the reference
    mm = x.float() @ w.float().T
    gamma = 7168 * 2.0**-24
    assert bool(((mm.double() - y.double()).abs() <= gamma * (x.double().abs() @ w.double().abs().T)).all())

    y_bf16 = gate_reference(x, w, tier=GateTier.DSV3_ROUTER_GEMM, out_dtype=BF16)
    assert y_bf16.dtype == BF16 and torch.equal(y_bf16, y.to(BF16))
    # out_dtype None: torch.empty(dtype=None) -> default dtype (fp32)
    y_none = gate_reference(x, w, tier=GateTier.DSV3_ROUTER_GEMM, out_dtype=None)
    assert y_none.dtype == torch.get_default_dtype() == FP32 and torch.equal(y_none, y)


def test_tier1_out_dtype_none_follows_default_dtype() -> None:
    x = torch.ones(2, 7168, dtype=BF16)
    w = torch.ones(256, 7168, dtype=BF16)
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        with pytest.raises(GateContractError, match="float32 or bf16"):
            gate_reference(x, w, tier=GateTier.DSV3_ROUTER_GEMM, out_dtype=None)
    finally:
        torch.set_default_dtype(old)


@pytest.mark.parametrize("x_dtype", [FP32, BF16], ids=["x_fp32", "x_bf16"])
@pytest.mark.parametrize("M", [32, 33], ids=["kernel", "linear_fallback"])
def test_tier2_fp32_numerics(x_dtype: torch.dtype, M: int) -> None:
    x = torch.randn(M, 3072, generator=_gen(10)).to(x_dtype)
    w = torch.randn(256, 3072, generator=_gen(11)) * 0.02
    g = GateLinear(3072, 256, out_dtype=BF16, params_dtype=FP32, platform=SM90)  # out_dtype is ignored on tier 2
    g.weight.data.copy_(w)
    expected = GateTier.FP32_ROUTER_GEMM if M <= 32 else GateTier.FP32_DISPATCH_F_LINEAR
    assert g.tier_for(x) is expected
    y, _ = g(x)
    assert y.dtype == FP32
    _assert_within_half_ulp_fp32(y, _exact(x, w))
    assert y[M - 1, 200].item() == _fsum_fp32(x, w, M - 1, 200)


def test_tier3_numerics_and_difference_from_tier4() -> None:
    x = torch.randn(64, 4096, generator=_gen(12)).to(BF16)
    w = (torch.randn(128, 4096, generator=_gen(13)) * 0.02).to(BF16)
    on_h100 = GateLinear(4096, 128, out_dtype=FP32, params_dtype=BF16, platform=SM90)
    on_a100 = GateLinear(4096, 128, out_dtype=FP32, params_dtype=BF16, platform=SM80)
    for g in (on_h100, on_a100):
        g.weight.data.copy_(w)
    assert on_h100.tier_for(x) is GateTier.CUBLAS_BF16_FP32 and on_a100.tier_for(x) is GateTier.F_LINEAR
    y3, y4 = on_h100(x)[0], on_a100(x)[0]
    assert y3.dtype == y4.dtype == FP32
    _assert_within_half_ulp_fp32(y3, _exact(x, w))
    assert torch.equal(y4, y3.to(BF16).float())  # tier 4 = the same value rounded to the bf16 weight dtype
    assert bool((y3 != y4).any())


# ----------------------------------------------------------------------------------------------------------------
# Seed hazards: inputs the dispatch routes to a kernel that rejects them
# ----------------------------------------------------------------------------------------------------------------


def test_tier1_rejects_what_the_kernel_rejects() -> None:
    with torch.device("meta"):
        g = GateLinear(7168, 256, out_dtype=FP32, params_dtype=BF16, platform=SM90)
        g_fp32w = GateLinear(7168, 256, out_dtype=FP32, params_dtype=FP32, platform=SM90)
        g_fp16out = GateLinear(7168, 256, out_dtype=torch.float16, params_dtype=BF16, platform=SM90)
    x_fp32 = torch.empty(4, 7168, dtype=FP32, device="meta")
    x_bf16 = torch.empty(4, 7168, dtype=BF16, device="meta")
    empty = torch.empty(0, 7168, dtype=BF16, device="meta")
    assert g.tier_for(x_fp32) is GateTier.DSV3_ROUTER_GEMM
    with pytest.raises(GateContractError, match="mat_a"):
        g(x_fp32)
    assert g.tier_for(empty) is GateTier.DSV3_ROUTER_GEMM
    with pytest.raises(GateContractError, match="num_tokens"):
        g(empty)
    assert g_fp32w.tier_for(x_bf16) is GateTier.DSV3_ROUTER_GEMM
    with pytest.raises(GateContractError, match="mat_b"):
        g_fp32w(x_bf16)
    with pytest.raises(GateContractError, match="float32 or bf16"):
        g_fp16out(x_bf16)


def test_gate_reference_contracts() -> None:
    x = torch.zeros(4, 64, dtype=BF16)
    w = torch.zeros(8, 64, dtype=BF16)
    for tier in (GateTier.DSV3_ROUTER_GEMM, GateTier.FP32_ROUTER_GEMM, GateTier.CUBLAS_BF16_FP32,
                 GateTier.FP32_DISPATCH_F_LINEAR):
        with pytest.raises(GateContractError, match="no bias"):
            gate_reference(x, w, tier=tier, out_dtype=FP32, bias=torch.zeros(8, dtype=BF16))
    with pytest.raises(GateContractError, match="hidden_dim=7168"):
        gate_reference(x, w, tier=GateTier.DSV3_ROUTER_GEMM, out_dtype=FP32)
    assert gate_reference(x, w, tier=GateTier.DSV3_ROUTER_GEMM, out_dtype=FP32, strict=False).shape == (4, 8)
    with pytest.raises(GateContractError, match="float32"):
        gate_reference(x, w, tier=GateTier.FP32_ROUTER_GEMM, out_dtype=None)
    wf = torch.zeros(8, 64)
    with pytest.raises(GateContractError, match="hidden_dim=3072"):
        gate_reference(x, wf, tier=GateTier.FP32_ROUTER_GEMM, out_dtype=None)
    assert gate_reference(x, wf, tier=GateTier.FP32_DISPATCH_F_LINEAR, out_dtype=None).dtype == FP32
    with pytest.raises(GateContractError, match="float32 or bfloat16"):
        gate_reference(x.half(), wf, tier=GateTier.FP32_DISPATCH_F_LINEAR, out_dtype=None)
    with pytest.raises(GateContractError, match="bf16"):
        gate_reference(x.float(), w, tier=GateTier.CUBLAS_BF16_FP32, out_dtype=FP32)
    with pytest.raises(GateContractError, match="weight dtype"):
        gate_reference(x, w, tier=GateTier.F_LINEAR, out_dtype=None, bias=torch.zeros(8))
    with pytest.raises(TypeError, match="GateTier"):
        gate_reference(x, w, tier=4, out_dtype=None)


# ----------------------------------------------------------------------------------------------------------------
# Input validation
# ----------------------------------------------------------------------------------------------------------------


def test_bad_inputs() -> None:
    g = GateLinear(64, 8, params_dtype=BF16)
    with pytest.raises(ValueError, match="2-D"):
        g(torch.zeros(64, dtype=BF16))
    with pytest.raises(ValueError, match="2-D"):
        g(torch.zeros(2, 3, 64, dtype=BF16))
    with pytest.raises(ValueError, match=r"hidden size 32.*input_size is 64"):
        g(torch.zeros(4, 32, dtype=BF16))
    with pytest.raises(TypeError, match="floating"):
        g(torch.zeros(4, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="same device"):
        g.tier_for(torch.empty(4, 64, dtype=BF16, device="meta"))
    with pytest.raises(ValueError, match=r"hidden size 32.*expects 64"):
        gate_reference(torch.zeros(4, 32), torch.zeros(8, 64), tier=GateTier.F_LINEAR, out_dtype=None)
    with pytest.raises(ValueError, match="same device"):
        gate_reference(torch.zeros(4, 64, device="meta"), torch.zeros(8, 64), tier=GateTier.F_LINEAR,
                       out_dtype=None)
    with pytest.raises(ValueError, match="bias must have shape"):
        gate_reference(torch.zeros(4, 64), torch.zeros(8, 64), tier=GateTier.F_LINEAR, out_dtype=None,
                       bias=torch.zeros(7))
    with pytest.raises(ValueError, match="positive int"):
        GateLinear(0, 8)
    with pytest.raises(TypeError, match="floating"):
        GateLinear(64, 8, out_dtype=torch.int8)
    with pytest.raises(TypeError, match="Platform"):
        GateLinear(64, 8, platform="sm90")
    with pytest.raises(ValueError, match="M must be"):
        select_gate_tier(-1, 64, 8, x_dtype=BF16, weight_dtype=BF16, out_dtype=None, bias=False, platform=CPU)
    with pytest.raises(ValueError, match="capability"):
        Platform(is_cuda=True, capability=(9, 10))


def test_platform_helpers() -> None:
    assert SM90.is_device_capability((9, 0)) and SM90.is_device_capability(90)
    assert not SM100.is_device_capability((9, 0)) and SM100.is_device_capability_family(100)
    assert SM103.is_device_capability_family(100) and not SM103.is_device_capability((10, 0))
    assert not SM120.is_device_capability_family(100) and SM120.is_device_capability_family(120)
    assert not SM89.is_device_capability((9, 0)) and SM89.is_device_capability_family(80)
    assert not CPU.is_device_capability((9, 0)) and not CPU.is_device_capability_family(100)
    assert [p.is_hopper_or_blackwell for p in (CPU, SM80, SM89, SM90, SM100, SM103, SM120, ROCM_MI300)] == [
        False, False, False, True, True, True, False, False]
    assert [p.name for p in (CPU, SM90, ROCM_MI300)] == ["cpu", "sm90", "rocm-9.4"]


# ----------------------------------------------------------------------------------------------------------------
# Documentation
# ----------------------------------------------------------------------------------------------------------------

def test_docs_match_render_tier_table() -> None:
    text = (REPO / "docs" / "gate_tiers.md").read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, "docs/gate_tiers.md lost its generated markers"
    generated = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert generated == render_tier_table(), (
        "docs/gate_tiers.md is stale: regenerate the block between the markers with "
        "`python -m tools.gate_docs`"
    )


def test_regenerate_replaces_only_the_block() -> None:
    """``python -m tools.gate_docs`` rewrites the block between the markers and nothing else; markers missing or
    repeated are an error."""
    text = "head\n" + BEGIN + "stale\n" + END + "tail\n"
    assert regenerate(text) == "head\n" + BEGIN + render_tier_table() + END + "tail\n"
    assert regenerate(regenerate(text)) == regenerate(text)
    for bad in ("head\n" + BEGIN + "x\n", "head\n" + BEGIN + BEGIN + END):
        with pytest.raises(ValueError, match="marker"):
            regenerate(bad)


def test_tier_table_models() -> None:
    table = render_tier_table()
    rows = {line.split("|")[2].strip(): line for line in table.splitlines() if line.startswith("| ") and "`" in
            line.split("|")[2]}
    assert "DeepSeek-V3 / R1 / V3.2" in rows["`DSV3_ROUTER_GEMM`"] and "Kimi-K2" in rows["`DSV3_ROUTER_GEMM`"]
    assert "MiniMax-M2" in rows["`FP32_ROUTER_GEMM`"] and "MiniMax-M2" in rows["`FP32_DISPATCH_F_LINEAR`"]
    assert "MiniMax" not in rows["`DSV3_ROUTER_GEMM`"] and "Kimi" not in rows["`FP32_ROUTER_GEMM`"]
    assert "gpt-oss-120b" in rows["`F_LINEAR`"] and "GLM-4.5" in rows["`F_LINEAR`"]
    assert "Qwen3-235B-A22B" in rows["`CUBLAS_BF16_FP32`"]
