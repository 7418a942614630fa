"""NVFP4 (vLLM encode convention) against a numpy float32 + ml_dtypes oracle and hand values."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.quant import nvfp4_dequantize, nvfp4_global_scale, nvfp4_quantize


@pytest.fixture(autouse=True)
def _seed_torch():
    # unseeded torch.randn in a test still draws the same inputs on every run
    torch.manual_seed(0)


F32 = np.float32
E2M1 = ml_dtypes.float4_e2m1fn
E4M3 = ml_dtypes.float8_e4m3fn


def oracle_nvfp4(x: np.ndarray, gs: np.float32):
    """vLLM's ref_nvfp4_quant written with numpy float32 arithmetic and ml_dtypes casts."""
    m, k = x.shape
    xb = x.reshape(m, k // 16, 16).astype(F32)
    amax = np.abs(xb).max(-1).astype(F32)
    sf = (gs * (amax * (F32(1) / F32(6)))).astype(F32)
    sf = np.clip(sf, F32(-448), F32(448)).astype(E4M3)
    sf32 = sf.astype(F32)
    denom = (sf32 * (F32(1) / gs)).astype(F32)
    with np.errstate(divide="ignore"):
        mult = np.where(sf32 == 0, F32(0), F32(1) / denom).astype(F32)
    y = np.clip(xb * mult[..., None], F32(-6), F32(6)).astype(F32)
    c = y.astype(E2M1).view(np.uint8).reshape(m, k)
    packed = (c[:, 0::2] | (c[:, 1::2] << 4)).astype(np.uint8)
    return packed, sf.view(np.uint8)


@pytest.mark.parametrize("explicit_gs", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nvfp4_matches_oracle(explicit_gs, dtype):
    g = torch.Generator().manual_seed(21)
    x = (torch.randn(32, 256, generator=g) * torch.logspace(-2, 2, 32).unsqueeze(1)).to(dtype)
    gs_in = 123.456 if explicit_gs else None
    p, sf, gs = nvfp4_quantize(x, gs_in)
    xf = x.float().numpy()
    gs_want = F32(123.456) if explicit_gs else F32(448 * 6) / F32(np.abs(xf).max())
    assert gs.dtype == torch.float32 and gs.shape == (1,) and gs.item() == float(gs_want)
    want_p, want_sf = oracle_nvfp4(xf, gs_want)
    assert p.dtype == torch.uint8 and p.shape == (32, 128)
    assert sf.dtype == torch.float8_e4m3fn and sf.shape == (32, 16)
    assert np.array_equal(sf.view(torch.uint8).numpy(), want_sf)
    assert np.array_equal(p.numpy(), want_p)


def test_nvfp4_hand_block():
    # gs = 448 -> SF = e4m3(448 * 6 / 6) = 448, mult = 1 / (448 / 448) = 1
    x = torch.zeros(1, 16)
    x[0, :5] = torch.tensor([6.0, 3.0, -1.5, 0.5, 0.75])
    p, sf, gs = nvfp4_quantize(x, 448.0)
    assert sf.float().tolist() == [[448.0]]
    # codes 7, 5, 11, 1, 2 (0.75 ties to 1.0), packed low nibble first
    assert p[0, :3].tolist() == [7 | 5 << 4, 11 | 1 << 4, 2]
    d = nvfp4_dequantize(p, sf, gs)
    assert d[0, :5].tolist() == [6.0, 3.0, -1.5, 0.5, 1.0]


def test_nvfp4_zero_block_zero_tensor_and_poison():
    x = torch.randn(2, 48)
    x[0, 16:32] = 0
    p, sf, gs = nvfp4_quantize(x)
    assert sf[0, 1].float().item() == 0.0 and not p[0, 8:16].any()
    assert torch.equal(nvfp4_dequantize(p, sf, gs)[0, 16:32], torch.zeros(16))
    # an all-zero tensor: gs = 1, everything zero
    p0, sf0, gs0 = nvfp4_quantize(torch.zeros(3, 32))
    assert gs0.item() == 1.0 and not p0.any() and not sf0.view(torch.uint8).any()
    # a non-finite block with an explicit global scale: SF NaN, codes 0, dequant NaN
    x[1, 20] = float("nan")
    x[1, 40] = float("inf")
    p, sf, gs = nvfp4_quantize(x, 10.0)
    assert math.isnan(sf[1, 1].float().item()) and math.isnan(sf[1, 2].float().item())
    assert not p[1, 8:24].any()
    d = nvfp4_dequantize(p, sf, gs)
    assert torch.isnan(d[1, 16:]).all() and torch.isfinite(d[1, :16]).all()
    want_p, want_sf = oracle_nvfp4(x[:, :16].numpy(), F32(10.0))
    assert np.array_equal(p[:, :8].numpy(), want_p) and np.array_equal(sf[:, :1].view(torch.uint8).numpy(), want_sf)
    with pytest.raises(ValueError):
        nvfp4_quantize(x)  # no finite global scale without an explicit one


@settings(max_examples=25, deadline=None, database=None)
@given(m=st.integers(1, 4), blocks=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_nvfp4_round_trip_on_grid(m, blocks, seed):
    # codes with a +-6 in every block, SF any positive e4m3 value, gs a power of two: exact grid
    rng = np.random.default_rng(seed)
    c = rng.integers(0, 16, size=(m, blocks * 16), dtype=np.uint8)
    c[:, ::16] = np.where(rng.random((m, blocks)) < 0.5, 7, 15)
    sf_bytes = rng.integers(1, 0x7F, size=(m, blocks), dtype=np.uint8)
    gs = float(2.0 ** rng.integers(-8, 9))
    packed = torch.from_numpy((c[:, 0::2] | (c[:, 1::2] << 4)).astype(np.uint8))
    sf = torch.from_numpy(sf_bytes).view(torch.float8_e4m3fn)
    x = nvfp4_dequantize(packed, sf, gs)
    p2, sf2, gs2 = nvfp4_quantize(x, gs)
    assert gs2.item() == gs
    assert torch.equal(sf2.view(torch.uint8), sf.view(torch.uint8))
    assert torch.equal(p2, packed)  # -0 (code 8) comes back as -0: the sign bit is kept
    assert torch.equal(nvfp4_dequantize(p2, sf2, gs2), x)


def test_nvfp4_global_scale_and_errors():
    x = torch.tensor([[1.0, -7.0] + [0.0] * 14])
    assert nvfp4_global_scale(x).item() == float(F32(2688) / F32(7))
    with pytest.raises(ValueError, match="multiple"):
        nvfp4_quantize(torch.randn(2, 40))
    with pytest.raises(ValueError):
        nvfp4_quantize(torch.randn(2, 32), 0.0)
    with pytest.raises(ValueError):
        nvfp4_quantize(torch.randn(2, 32), -1.0)
    with pytest.raises(TypeError):
        nvfp4_quantize(torch.randn(2, 32, dtype=torch.float64))
    p, sf, gs = nvfp4_quantize(torch.randn(2, 32))
    with pytest.raises(ValueError):
        nvfp4_dequantize(p, sf[:, :1], gs)


def test_nvfp4_empty_rows():
    p, sf, gs = nvfp4_quantize(torch.empty(0, 32))
    assert p.shape == (0, 16) and sf.shape == (0, 2) and gs.item() == 1.0
    assert nvfp4_dequantize(p, sf, gs).shape == (0, 32)
