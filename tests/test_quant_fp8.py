"""FP8 E4M3 quantizers of reference.quant against independent oracles.

Oracles: ml_dtypes float8_e4m3fn (RNE) for every cast, numpy float32 arithmetic for scales and
element scaling, math/numpy frexp for power-of-two rounding, and hand-computed bytes. No expected
value below is produced by the code under test.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.semantics import use_semantics
from reference.quant import (
    DEEPGEMM,
    VLLM,
    dequant_fp8_block,
    dequant_fp8_per_tensor,
    dequant_fp8_per_token,
    dequant_fp8_per_token_group,
    per_block_quant_fp8,
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_packed_for_deepgemm,
    scaled_fp8_quant,
    to_e4m3_satfinite,
)


@pytest.fixture(autouse=True)
def _seed_torch():
    # unseeded torch.randn in a test still draws the same inputs on every run
    torch.manual_seed(0)


F32 = np.float32
E4M3 = ml_dtypes.float8_e4m3fn


# ----------------------------------------------------------------------------------------------
# oracle helpers (numpy + ml_dtypes only)


def np_e4m3_bytes(y: np.ndarray) -> np.ndarray:
    """Saturating RNE cast to E4M3 bytes via ml_dtypes (NaN stays NaN)."""
    y = np.asarray(y, dtype=F32)
    return np.clip(y, F32(-448), F32(448)).astype(E4M3).view(np.uint8)


def codes(q: torch.Tensor) -> np.ndarray:
    return q.contiguous().view(torch.uint8).numpy()


def is_nan_code(b: np.ndarray) -> np.ndarray:
    return (b & 0x7F) == 0x7F


def assert_codes_equal(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    """Bytewise equality, NaN codes (0x7F / 0xFF) compared as NaN; reports the first mismatch."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    both_nan = is_nan_code(got) & is_nan_code(want)
    bad = (got != want) & ~both_nan
    if bad.any():
        idx = tuple(int(i[0]) for i in np.nonzero(bad))
        raise AssertionError(
            f"{what}: {int(bad.sum())} codes differ; first at {idx}: "
            f"got 0x{int(got[idx]):02X}, want 0x{int(want[idx]):02X}"
        )


def exact_ceil_pow2(v: float) -> float:
    """Smallest power of two >= v > 0 (exact, via math.frexp on the float64 value)."""
    m, e = math.frexp(v)
    return math.ldexp(1.0, e - 1 if m == 0.5 else e)


def np_ceil_pow2(v: np.ndarray) -> np.ndarray:
    m, e = np.frexp(v.astype(np.float64))
    return np.ldexp(1.0, np.where(m == 0.5, e - 1, e)).astype(F32)


def oracle_group_quant(x_f32: np.ndarray, g: int, recipe: str, use_ue8m0: bool, semantics: str = "0.33"):
    """The facts-file table rows for vLLM CUDA / DeepGEMM, in numpy float32. vLLM 0.17's kernel divides by the
    group scale, 0.33's multiplies by its reciprocal (``1.0f / y_s``, per_token_group_quant.cu)."""
    m, k = x_f32.shape
    xg = x_f32.reshape(m, k // g, g)
    amax = np.abs(xg).max(axis=-1).astype(F32)
    floor = F32(1e-10) if recipe == "vllm" else F32(1e-4)
    amax = np.maximum(amax, floor)
    s = (amax / F32(448)).astype(F32)
    if use_ue8m0:
        if recipe == "vllm":
            s = np.maximum(s, F32(1e-10))
        s = np_ceil_pow2(s)
    with np.errstate(invalid="ignore", divide="ignore"):  # inf / NaN groups: checked separately
        if recipe == "vllm" and semantics == "0.17":
            y = xg / s[..., None]
        else:
            y = xg * (F32(1) / s)[..., None]
    return np_e4m3_bytes(y.astype(F32)).reshape(m, k), s


# ----------------------------------------------------------------------------------------------
# the saturating cast


def test_satfinite_cast_matches_ml_dtypes_on_every_bf16():
    allbits = np.arange(65536, dtype=np.uint16)
    vals = allbits.view(ml_dtypes.bfloat16).astype(F32)
    keep = ~np.isnan(vals)
    x = torch.from_numpy(allbits.view(np.int16).copy()).view(torch.bfloat16)[torch.from_numpy(keep)]
    got = codes(to_e4m3_satfinite(x.float()))
    assert_codes_equal(got, np_e4m3_bytes(vals[keep]), "e4m3 satfinite over all bf16")


def test_satfinite_cast_hand_values():
    x = torch.tensor([448.0, 449.0, 464.0, 465.0, 1e30, float("inf"), -float("inf"), -500.0, 2.0**-9, 2.0**-10])
    # 0x7E = 448, 0xFE = -448, 0x01 = 2^-9 (min subnormal), 2^-10 ties to even -> 0
    assert codes(to_e4m3_satfinite(x)).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0x01, 0x00]
    assert math.isnan(float(to_e4m3_satfinite(torch.tensor([float("nan")])).float()))


# ----------------------------------------------------------------------------------------------
# per_token_group_quant_fp8


@pytest.mark.parametrize("recipe,semantics", [("vllm", "0.17"), ("vllm", "0.33"), ("deepgemm", "0.33")])
@pytest.mark.parametrize("group_size", [128, 64])
@pytest.mark.parametrize("use_ue8m0", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_group_quant_matches_oracle(recipe, semantics, group_size, use_ue8m0, dtype):
    g = torch.Generator().manual_seed(1234 + group_size)
    x = (torch.randn(64, 512, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(1)).to(dtype)
    with use_semantics(semantics):
        q, s = per_token_group_quant_fp8(x, group_size, use_ue8m0=use_ue8m0, recipe=recipe)
    want_q, want_s = oracle_group_quant(x.float().numpy(), group_size, recipe, use_ue8m0, semantics)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (64, 512 // group_size) and s.is_contiguous()
    np.testing.assert_array_equal(s.numpy().view(np.uint32), want_s.view(np.uint32))
    assert_codes_equal(codes(q), want_q, f"{recipe} g={group_size} ue8m0={use_ue8m0}")


def test_group_quant_leading_dims():
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    q, s = per_token_group_quant_fp8(x, 128)
    want_q, want_s = oracle_group_quant(x.float().reshape(6, 256).numpy(), 128, "vllm", False)
    assert s.shape == (2, 3, 2)
    assert_codes_equal(codes(q).reshape(6, 256), want_q)
    np.testing.assert_array_equal(s.reshape(6, 2).numpy(), want_s)


def test_recipes_differ_with_fp32_scales_and_agree_with_pow2_scales():
    # facts: x*(1/s) vs x/s differ in ~0.05 % of codes for N(0,1) bf16 1x128 groups. vLLM 0.17 divides (DeepGEMM
    # multiplies by the reciprocal); vLLM 0.33 multiplies too, so there its codes equal DeepGEMM's where the scales do
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2048, 1024, generator=g).to(torch.bfloat16)
    with use_semantics("0.17"):
        qv, sv = per_token_group_quant_fp8(x, 128, recipe="vllm")
    with use_semantics("0.33"):
        q33, _ = per_token_group_quant_fp8(x, 128, recipe="vllm")
    qd, sd = per_token_group_quant_fp8(x, 128, recipe="deepgemm")
    assert np.array_equal(codes(q33), codes(qd))
    assert torch.equal(sv, sd)  # amax >> both floors: identical fp32 scales
    diff = codes(qv) != codes(qd)
    assert 0 < diff.sum() < 0.005 * diff.size, int(diff.sum())
    # where they differ, they are adjacent codes (same sign, one step apart)
    a = qv.float().numpy()[diff]
    b = qd.float().numpy()[diff]
    assert np.all(np.sign(a) == np.sign(b))
    qv8, sv8 = per_token_group_quant_fp8(x, 128, use_ue8m0=True, recipe="vllm")
    qd8, sd8 = per_token_group_quant_fp8(x, 128, use_ue8m0=True, recipe="deepgemm")
    assert torch.equal(sv8, sd8)
    assert np.array_equal(codes(qv8), codes(qd8))


def test_all_zero_group_scale_bytes():
    x = torch.zeros(3, 256, dtype=torch.bfloat16)
    x[1, 128:] = 1.0  # a non-zero neighbour group must not change the zero groups
    for recipe, byte, floor in (("vllm", 94, 1e-10), ("deepgemm", 105, 1e-4)):
        q, s = per_token_group_quant_fp8(x, 128, use_ue8m0=True, recipe=recipe)
        exps = np.frexp(s.numpy().astype(np.float64))[1] - 1 + 127  # 2^e -> e + 127
        assert exps[0, 0] == byte and exps[2, 1] == byte and exps[1, 0] == byte
        q32, s32 = per_token_group_quant_fp8(x, 128, recipe=recipe)
        assert s32[0, 0].item() == float(F32(F32(floor) / F32(448)))
        assert not codes(q)[0].any() and not codes(q32)[2].any()


def test_group_with_power_of_two_scale_hand_bytes():
    # amax = 7 = 448 * 2^-6: s = 2^-6 exactly under every recipe, with or without UE8M0
    row = torch.zeros(1, 128)
    row[0, :4] = torch.tensor([7.0, -3.5, 1.75, 0.0546875])  # 0.0546875 * 64 = 3.5
    for recipe in ("vllm", "deepgemm"):
        for ue in (False, True):
            q, s = per_token_group_quant_fp8(row, 128, use_ue8m0=ue, recipe=recipe)
            assert s.item() == 2.0**-6
            # 448 -> 0x7E, -224 -> 0xF6, 112 -> 0x6E, 3.5 -> 0x46
            assert codes(q)[0, :4].tolist() == [0x7E, 0xF6, 0x6E, 0x46]


def test_group_whose_amax_is_a_power_of_two():
    # amax = 256: fp32 scale 256/448 maps it to 448; UE8M0 ceil(log2(256/448)) = 0 -> s = 1, q = 256
    row = torch.zeros(2, 128, dtype=torch.bfloat16)
    row[:, 0] = 256.0
    row[:, 1] = -1.0
    for recipe in ("vllm", "deepgemm"):
        q, s = per_token_group_quant_fp8(row, 128, recipe=recipe)
        assert s[0, 0].item() == float(F32(256) / F32(448))
        assert codes(q)[0, 0] == 0x7E
        q8, s8 = per_token_group_quant_fp8(row, 128, use_ue8m0=True, recipe=recipe)
        assert s8[0, 0].item() == 1.0
        assert codes(q8)[0, :2].tolist() == [0x78, 0xB8]  # 256 = 2^8 -> 0x78 ; -1 -> 0xB8
    q, s = per_block_quant_fp8(row, (128, 128), use_ue8m0=True)
    assert s.item() == 1.0 and codes(q)[1, :2].tolist() == [0x78, 0xB8]


def test_scale_a_few_ulps_above_power_of_two_separates_recipes_and_needs_the_clamp():
    # amax = 448 * 2^-20 * (1 + 4u) in fp32 -> s = 2^-20 * (1 + 4u) exactly (4 ULPs above 2^-20)
    u = 2.0**-23
    amax = 448 * 2.0**-20 * (1 + 4 * u)
    assert float(F32(amax)) == amax
    row = torch.zeros(1, 128, dtype=torch.float32)
    row[0, 0] = amax
    row[0, 1] = -amax
    qv, sv = per_token_group_quant_fp8(row, 128, use_ue8m0=True, recipe="vllm")
    qd, sd = per_token_group_quant_fp8(row, 128, use_ue8m0=True, recipe="deepgemm")
    # vLLM's exp2(ceil(log2 s)) gives 2^-20 (fp32 log2 rounds to -20): x/s = 448 (1 + 4u) -> clamped
    assert sv.item() == 2.0**-20
    assert codes(qv)[0, :2].tolist() == [0x7E, 0xFE]
    # DeepGEMM's exact ceiling gives 2^-19: x/s = 224 (1 + 4u) -> 224 (0x76)
    assert sd.item() == exact_ceil_pow2(amax / 448) == 2.0**-19
    assert codes(qd)[0, :2].tolist() == [0x76, 0xF6]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_poisons_only_its_group(bad):
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    x[0, 5] = bad
    q, s = per_token_group_quant_fp8(x, 128)
    assert math.isnan(s[0, 0].item())
    assert is_nan_code(codes(q)[0, :128]).all()
    want_q, want_s = oracle_group_quant(x.float().numpy(), 128, "vllm", False)
    np.testing.assert_array_equal(s.numpy()[[0, 1, 1], [1, 0, 1]], want_s[[0, 1, 1], [1, 0, 1]])
    assert_codes_equal(codes(q)[0, 128:], want_q[0, 128:])
    assert_codes_equal(codes(q)[1], want_q[1])
    # UE8M0 scales keep the poison (NaN), the packed byte is 0xFF
    _, p = per_token_group_quant_fp8_packed_for_deepgemm(x, 128)
    assert (int(p[0, 0]) & 0xFF) == 0xFF


def test_group_quant_vllm_eps_dtype_out_q():
    """vLLM's ``eps`` is the amax floor (an all-zero group's scale is eps / 448), ``dtype`` only float8_e4m3fn,
    ``out_q`` receives the codes (fp8_utils.py::per_token_group_quant_fp8, vLLM 0.33.0)."""
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    x[1] = torch.linspace(-3, 3, 256).to(torch.bfloat16)
    q, s = per_token_group_quant_fp8(x, 128, eps=1e-3)
    assert s[0, 0].item() == float(F32(F32(1e-3) / F32(448)))
    q0, s0 = per_token_group_quant_fp8(x, 128)
    assert torch.equal(s[1], s0[1]) and np.array_equal(codes(q), codes(q0))  # amax 3 >> eps: only the zero row moves
    q1, s1 = per_token_group_quant_fp8(x, 128, eps=1e-10, dtype=torch.float8_e4m3fn)
    assert torch.equal(s1, s0)  # vLLM's default eps is the vllm recipe's floor
    out = torch.empty(2, 256, dtype=torch.float8_e4m3fn)
    q2, s2 = per_token_group_quant_fp8(x, 128, out_q=out)
    assert q2 is out and np.array_equal(codes(out), codes(q0)) and torch.equal(s2, s0)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        per_token_group_quant_fp8(x, 128, dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="out_q"):
        per_token_group_quant_fp8(x, 128, out_q=torch.empty(2, 128, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="amax_floor"):
        per_token_group_quant_fp8(x, 128, eps=-1.0)


def test_group_quant_errors():
    with pytest.raises(ValueError, match="multiple"):
        per_token_group_quant_fp8(torch.randn(2, 200), 128)
    with pytest.raises(TypeError):
        per_token_group_quant_fp8(torch.randint(0, 3, (2, 128)), 128)
    with pytest.raises(TypeError):
        per_token_group_quant_fp8(torch.randn(2, 128, dtype=torch.float64), 128)
    with pytest.raises(ValueError, match="contiguous"):
        per_token_group_quant_fp8(torch.randn(256, 4).t(), 128)
    with pytest.raises(ValueError, match="column_major"):
        per_token_group_quant_fp8(torch.randn(2, 128), 128, tma_aligned_scales=True)
    with pytest.raises(ValueError, match="valid names"):
        per_token_group_quant_fp8(torch.randn(2, 128), 128, recipe="cutlass")
    with pytest.raises(ValueError):
        per_token_group_quant_fp8(torch.randn(2, 128), 0)


@pytest.mark.parametrize("column_major,tma", [(False, False), (True, False), (True, True)])
def test_m_zero(column_major, tma):
    q, s = per_token_group_quant_fp8(torch.empty(0, 256), 128, column_major_scales=column_major, tma_aligned_scales=tma)
    assert q.shape == (0, 256) and s.shape == (0, 2)


@pytest.mark.parametrize("m", [1, 3, 4, 5, 130])
def test_column_major_and_tma_aligned_scale_layouts(m):
    x = torch.randn(m, 384, dtype=torch.bfloat16)
    q_r, s_r = per_token_group_quant_fp8(x, 128)
    q_c, s_c = per_token_group_quant_fp8(x, 128, column_major_scales=True)
    q_t, s_t = per_token_group_quant_fp8(x, 128, column_major_scales=True, tma_aligned_scales=True)
    aligned = (m + 3) // 4 * 4
    assert s_c.shape == s_t.shape == (m, 3)
    assert s_c.stride() == (1, m)
    assert s_t.stride() == (1, aligned)
    assert torch.equal(s_c, s_r) and torch.equal(s_t, s_r)
    assert torch.equal(codes_t(q_c), codes_t(q_r)) and torch.equal(codes_t(q_t), codes_t(q_r))
    # batched (B, M, K): strides (G * aligned, 1, aligned)
    xb = torch.randn(2, m, 256, dtype=torch.bfloat16)
    _, sb = per_token_group_quant_fp8(xb, 128, column_major_scales=True, tma_aligned_scales=True)
    assert sb.shape == (2, m, 2) and sb.stride() == (2 * aligned, 1, aligned)
    assert torch.equal(sb, per_token_group_quant_fp8(xb, 128)[1])


def codes_t(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


@settings(max_examples=25, deadline=None, database=None)
@given(
    m=st.integers(1, 6),
    groups=st.integers(1, 4),
    group_size=st.sampled_from([64, 128]),
    recipe=st.sampled_from(["vllm", "deepgemm"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_group_requantize_is_stable_with_fp32_scales(m, groups, group_size, recipe, seed):
    # with fp32 scales the group amax maps to exactly 448, so dequantize -> quantize returns q
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, groups * group_size, generator=g) * 10).to(torch.bfloat16)
    q, s = per_token_group_quant_fp8(x, group_size, recipe=recipe)
    x2 = dequant_fp8_per_token_group(q, s, group_size)
    q2, _ = per_token_group_quant_fp8(x2, group_size, recipe=recipe)
    assert np.array_equal(codes(q2), codes(q))
    # the dequantizer is q * s in fp32, checked against numpy
    want = q.float().numpy().reshape(m, groups, group_size) * s.numpy()[..., None]
    np.testing.assert_array_equal(x2.numpy(), want.reshape(m, -1).astype(F32))


def random_grid_codes(shape, rng: np.random.Generator) -> np.ndarray:
    """Random finite E4M3 values (as float32) with |v| <= 448."""
    b = rng.integers(0, 256, size=shape, dtype=np.uint8)
    b[(b & 0x7F) == 0x7F] = 0  # drop NaN codes
    return b.view(E4M3).astype(F32)


@settings(max_examples=25, deadline=None, database=None)
@given(
    m=st.integers(1, 5),
    groups=st.integers(1, 4),
    group_size=st.sampled_from([64, 128]),
    ue8m0=st.booleans(),
    recipe=st.sampled_from(["vllm", "deepgemm"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_group_quantize_of_grid_point_returns_its_codes(m, groups, group_size, ue8m0, recipe, seed):
    # grid point: codes with a +-448 in every group, power-of-two scales: x = q * 2^e is exact
    rng = np.random.default_rng(seed)
    qv = random_grid_codes((m, groups, group_size), rng)
    pos = rng.integers(0, group_size, size=(m, groups))
    np.put_along_axis(qv, pos[..., None], F32(448) * rng.choice([-1, 1], size=(m, groups, 1)).astype(F32), -1)
    e = rng.integers(-10, 11, size=(m, groups))
    s = np.ldexp(F32(1), e).astype(F32)
    x = torch.from_numpy((qv * s[..., None]).reshape(m, -1)).to(torch.bfloat16)  # exact
    q, s_got = per_token_group_quant_fp8(x, group_size, use_ue8m0=ue8m0, recipe=recipe)
    np.testing.assert_array_equal(s_got.numpy(), s)
    assert np.array_equal(codes(q), qv.reshape(m, -1).astype(E4M3).view(np.uint8))


def test_packed_for_deepgemm_matches_hand_packing():
    x = torch.randn(5, 128 * 6, dtype=torch.bfloat16) * 3
    x[2, 128:256] = 0
    q, packed = per_token_group_quant_fp8_packed_for_deepgemm(x, 128)
    q_ref, s_ref = per_token_group_quant_fp8(x, 128, use_ue8m0=True)
    assert np.array_equal(codes(q), codes(q_ref))
    assert packed.dtype == torch.int32 and packed.shape == (5, 2) and packed.stride() == (1, 8)
    exps = (np.frexp(s_ref.numpy().astype(np.float64))[1] - 1 + 127).astype(np.int64)  # byte of 2^e
    assert exps[2, 1] == 94
    for r in range(5):
        for j in range(2):
            word = 0
            for i in range(4):
                gi = 4 * j + i
                word |= (int(exps[r, gi]) if gi < 6 else 0) << (8 * i)
            assert (int(packed[r, j]) & 0xFFFFFFFF) == word


# ----------------------------------------------------------------------------------------------
# scaled_fp8_quant


def test_dynamic_per_tensor_matches_oracle():
    x = torch.randn(33, 100, dtype=torch.bfloat16) * 5
    q, s = scaled_fp8_quant(x)
    xf = x.float().numpy()
    s_want = F32(np.abs(xf).max()) / F32(448)
    assert s.shape == (1,) and s.item() == float(s_want)
    assert_codes_equal(codes(q), np_e4m3_bytes(xf * (F32(1) / s_want)))


def test_static_per_tensor_matches_oracle_and_saturates():
    x = torch.tensor([[224.0, 224.1, 232.0, 240.0, 1e6, float("inf"), -float("inf"), 1.0, -0.3]])
    q, s = scaled_fp8_quant(x, torch.tensor([0.5]))
    assert s.item() == 0.5
    # values at / just above / far above 448 * s saturate to 0x7E / 0xFE
    assert codes(q)[0, :7].tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE]
    assert_codes_equal(codes(q)[0, 7:], np_e4m3_bytes(np.array([1.0, -0.3], F32) * (F32(1) / F32(0.5))))
    y = torch.randn(7, 64)
    q2, _ = scaled_fp8_quant(y, 0.037)
    assert_codes_equal(codes(q2), np_e4m3_bytes(y.numpy() * (F32(1) / F32(0.037))))


def test_dynamic_per_token_matches_oracle():
    x = torch.randn(9, 300, dtype=torch.bfloat16) * torch.logspace(-6, 2, 9).unsqueeze(1).to(torch.bfloat16)
    x[4] = 0
    for ub in (None, 0.5):
        q, s = scaled_fp8_quant(x, use_per_token_if_dynamic=True, scale_ub=ub)
        xf = x.float().numpy()
        amax = np.abs(xf).max(axis=-1, keepdims=True).astype(F32)
        if ub is not None:
            amax = np.minimum(amax, F32(ub))
        s_want = np.maximum(amax / F32(448), F32(1) / F32(448 * 512)).astype(F32)
        assert s.shape == (9, 1)
        np.testing.assert_array_equal(s.numpy(), s_want)
        assert_codes_equal(codes(q), np_e4m3_bytes(xf / s_want))
    assert not codes(q)[4].any()


def test_scaled_fp8_quant_zero_and_empty_inputs():
    q, s = scaled_fp8_quant(torch.zeros(4, 8))
    assert s.item() == 0.0 and not codes(q).any()
    q, s = scaled_fp8_quant(torch.zeros(0, 8))
    assert q.shape == (0, 8) and s.item() == 0.0
    q, s = scaled_fp8_quant(torch.zeros(0, 8), use_per_token_if_dynamic=True)
    assert q.shape == (0, 8) and s.shape == (0, 1)
    q, s = scaled_fp8_quant(torch.tensor([[1.0, float("nan")]]))
    assert math.isnan(s.item()) and is_nan_code(codes(q)).all()


def test_scaled_fp8_quant_errors():
    with pytest.raises(ValueError):
        scaled_fp8_quant(torch.randn(2, 8), torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError):
        scaled_fp8_quant(torch.randn(2, 8), 0.0)
    with pytest.raises(ValueError):
        scaled_fp8_quant(torch.randn(2, 8), float("nan"))
    with pytest.raises(ValueError, match="scale_ub"):
        scaled_fp8_quant(torch.randn(2, 8), scale_ub=1.0)
    with pytest.raises(ValueError, match="contiguous"):
        scaled_fp8_quant(torch.randn(8, 2).t(), use_per_token_if_dynamic=True)
    with pytest.raises(TypeError):
        scaled_fp8_quant(torch.ones(2, 8, dtype=torch.int32))


def test_per_tensor_and_per_token_dequant():
    q = torch.tensor([[0x7E, 0x01, 0xFE]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert dequant_fp8_per_tensor(q, 0.5).tolist() == [[224.0, 2.0**-10, -224.0]]
    assert dequant_fp8_per_token(q, torch.tensor([[2.0]])).tolist() == [[896.0, 2.0**-8, -896.0]]
    assert dequant_fp8_per_token(q, torch.tensor([2.0]), out_dtype=torch.bfloat16).dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------
# per_block_quant_fp8


def oracle_block_quant(w: np.ndarray, bn: int, bk: int, recipe: str, use_ue8m0: bool):
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    s = np.zeros((nb, kb), F32)
    out = np.zeros((n, k), np.uint8)
    floor = F32(1e-10) if recipe == "vllm" else F32(1e-4)
    for i in range(nb):
        for j in range(kb):
            blk = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]  # only the valid part
            amax = max(F32(np.abs(blk).max()), floor)
            sc = F32(amax / F32(448))
            if use_ue8m0:
                sc = F32(exact_ceil_pow2(float(max(sc, F32(1e-10)) if recipe == "vllm" else sc)))
            s[i, j] = sc
            y = blk / sc if recipe == "vllm" else blk * (F32(1) / sc)
            out[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = np_e4m3_bytes(y.astype(F32))
    return out, s


@pytest.mark.parametrize("recipe", ["vllm", "deepgemm"])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_block_quant_matches_oracle_with_partial_blocks(recipe, use_ue8m0):
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(300, 200, generator=g) * 0.02).to(torch.bfloat16)
    w[256:, 128:] = 0  # an all-zero partial block
    q, s = per_block_quant_fp8(w, (128, 128), use_ue8m0=use_ue8m0, recipe=recipe)
    want_q, want_s = oracle_block_quant(w.float().numpy(), 128, 128, recipe, use_ue8m0)
    assert s.shape == (3, 2) and q.shape == w.shape
    np.testing.assert_array_equal(s.numpy(), want_s)
    assert_codes_equal(codes(q), want_q, f"block {recipe}")


def test_block_quant_3d_and_nan():
    w = torch.randn(3, 256, 384) * 0.1
    w[1, 130, 300] = float("nan")
    q, s = per_block_quant_fp8(w, [128, 128])
    assert s.shape == (3, 2, 3)
    assert math.isnan(s[1, 1, 2].item()) and torch.isfinite(s[1].flatten()[:5]).all()
    assert is_nan_code(codes(q)[1, 128:256, 256:384]).all()
    for e in (0, 2):
        want_q, want_s = oracle_block_quant(w[e].numpy(), 128, 128, "vllm", False)
        np.testing.assert_array_equal(s[e].numpy(), want_s)
        assert_codes_equal(codes(q[e]), want_q)


def test_block_requantize_is_stable_with_fp32_scales():
    w = torch.randn(2, 200, 260, dtype=torch.bfloat16)
    q, s = per_block_quant_fp8(w, (128, 128))
    w2 = dequant_fp8_block(q, s, (128, 128))
    q2, _ = per_block_quant_fp8(w2, (128, 128))
    assert np.array_equal(codes(q2), codes(q))
    want = q.float().numpy() * np.repeat(np.repeat(s.numpy(), 128, -2), 128, -1)[..., :200, :260]
    np.testing.assert_array_equal(w2.numpy(), want)


@pytest.mark.parametrize("recipe", ["vllm", "deepgemm"])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_block_quantize_of_grid_point_returns_its_codes(recipe, use_ue8m0):
    rng = np.random.default_rng(11)
    n, k = 200, 260
    qv = random_grid_codes((n, k), rng)
    for i in range(2):
        for j in range(3):
            qv[i * 128 + 5, j * 128 + 3] = F32(-448) if (i + j) % 2 else F32(448)
    e = rng.integers(-12, 5, size=(2, 3))
    s = np.ldexp(F32(1), e).astype(F32)
    x = qv * np.repeat(np.repeat(s, 128, 0), 128, 1)[:n, :k]
    q, s_got = per_block_quant_fp8(torch.from_numpy(x), (128, 128), use_ue8m0=use_ue8m0, recipe=recipe)
    np.testing.assert_array_equal(s_got.numpy(), s)
    assert np.array_equal(codes(q), qv.astype(E4M3).view(np.uint8))


def test_block_quant_empty():
    q, s = per_block_quant_fp8(torch.empty(0, 256))
    assert q.shape == (0, 256) and s.shape == (0, 2)
    q, s = per_block_quant_fp8(torch.empty(4, 0, 256))
    assert q.shape == (4, 0, 256) and s.shape == (4, 0, 2)


def test_block_quant_errors():
    with pytest.raises(ValueError):
        per_block_quant_fp8(torch.randn(128), (128, 128))
    with pytest.raises(ValueError):
        per_block_quant_fp8(torch.randn(128, 128), (128,))
    with pytest.raises(TypeError):
        per_block_quant_fp8(torch.randn(128, 128, dtype=torch.float64))
    with pytest.raises(ValueError):
        dequant_fp8_block(per_block_quant_fp8(torch.randn(128, 256))[0], torch.ones(1, 1))


def test_recipe_objects_are_accepted():
    x = torch.randn(4, 128)
    assert torch.equal(per_token_group_quant_fp8(x, recipe=VLLM)[1], per_token_group_quant_fp8(x, recipe="vllm")[1])
    by_obj, by_name = per_token_group_quant_fp8(x, recipe=DEEPGEMM), per_token_group_quant_fp8(x, recipe="deepgemm")
    assert torch.equal(by_obj[1], by_name[1]) and torch.equal(by_obj[0].view(torch.uint8), by_name[0].view(torch.uint8))


def test_max_over_amax_recipe_matches_input_to_float8_oracle():
    # vLLM's python input_to_float8 / scaled_quantize: amax.clamp(1e-12), q = (x * (448/amax)), s = 1/(448/amax)
    import dataclasses

    r = dataclasses.replace(
        VLLM,
        name="input_to_float8",
        amax_floor=1e-12,
        scale_computation="1/(max/amax)",
        quant_op="max_over_amax_multiply",
    )
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    q, s = per_token_group_quant_fp8(x, 128, recipe=r)
    xg = x.float().numpy().reshape(256, 4, 128)
    amax = np.maximum(np.abs(xg).max(-1), F32(1e-12)).astype(F32)
    inv = (F32(448) / amax).astype(F32)
    np.testing.assert_array_equal(s.numpy(), (F32(1) / inv).astype(F32))
    assert_codes_equal(codes(q), np_e4m3_bytes(xg * inv[..., None]).reshape(256, 512))
    # and it is a different recipe: codes differ from both named recipes on N(0,1) data
    assert (codes(q) != codes(per_token_group_quant_fp8(x, 128)[0])).any()
    with pytest.raises(ValueError, match="fp32 scales only"):
        per_token_group_quant_fp8(x, 128, use_ue8m0=True, recipe=r)


def test_floor_instead_of_ceil_ue8m0_is_caught(monkeypatch):
    """Swap the UE8M0 ceiling used by the quantizer for a floor (a one-bit change: drop the
    ``+ (mantissa != 0)``); the oracle comparison of test_group_quant_matches_oracle must fail."""
    import reference.quant.fp8 as fp8_mod

    def floor_ue8m0(x: torch.Tensor) -> torch.Tensor:
        bits = x.abs().float().contiguous().view(torch.int32)
        return (((bits >> 23) & 0xFF).clamp(1, 254) << 23).view(torch.float32)

    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    want_q, want_s = oracle_group_quant(x.float().numpy(), 128, "deepgemm", True)
    monkeypatch.setattr(fp8_mod, "ceil_to_ue8m0", floor_ue8m0)
    q, s = per_token_group_quant_fp8(x, 128, use_ue8m0=True, recipe="deepgemm")
    with pytest.raises(AssertionError):
        np.testing.assert_array_equal(s.numpy().view(np.uint32), want_s.view(np.uint32))
    with pytest.raises(AssertionError):
        assert_codes_equal(codes(q), want_q)
    monkeypatch.undo()
    q, s = per_token_group_quant_fp8(x, 128, use_ue8m0=True, recipe="deepgemm")
    np.testing.assert_array_equal(s.numpy().view(np.uint32), want_s.view(np.uint32))
    assert_codes_equal(codes(q), want_q)
