"""The formats vLLM 0.33's schemes add, bit-exactly against independent oracles: weight-only INT4 / INT8 (WNA16,
symmetric and with zero points) against numpy integer arithmetic and ml_dtypes' bfloat16 / float16 casts; dynamic
per-tensor INT8 against numpy; NVFP4 with a per-token global scale against numpy float32 + ml_dtypes E2M1 / E4M3.
None of the oracles calls the code under test."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.quant import (
    int8_quant_per_tensor,
    nvfp4_dequantize_per_token,
    nvfp4_quantize_per_token,
    pack_uint4,
    unpack_uint4,
    wna16_dequantize,
    wna16_quantize,
)

F32 = np.float32
BF16 = ml_dtypes.bfloat16
E2M1 = ml_dtypes.float4_e2m1fn
E4M3 = ml_dtypes.float8_e4m3fn
_NP_SCALE = {torch.bfloat16: BF16, torch.float16: np.float16, torch.float32: F32}


def _np(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy()


# --- WNA16 ------------------------------------------------------------------------------------------------------
def oracle_wna16(w: np.ndarray, bits: int, group: int, zero_points: bool, sdt):
    """The module docstring's rule in numpy: fp32 group statistics, the scale cast with ml_dtypes, np.rint
    (round-half-even) codes, integer offsets; unpacked unsigned codes ``(N, K)``, scales ``(N, G)``, zp ``(N, G)``."""
    n, k = w.shape
    wg = w.astype(F32).reshape(n, k // group, group)
    mx, mn = wg.max(-1), wg.min(-1)
    if zero_points:
        s = (np.maximum(mx - mn, F32(1e-5)) / F32(15)).astype(F32)
        s_st = s.astype(sdt).astype(F32)
        zp = np.clip(np.rint(-mn / s_st), 0, 15).astype(np.int64)
        u = np.clip(np.rint(wg / s_st[..., None]).astype(np.int64) + zp[..., None], 0, 15)
    else:
        qmax, qmin, bias = (7, -8, 8) if bits == 4 else (127, -128, 128)
        s = np.maximum(np.abs(mx) / F32(qmax), np.abs(mn) / F32(-qmin)).astype(F32)
        s_st = s.astype(sdt).astype(F32)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(s_st[..., None] == 0, 0, np.clip(np.rint(wg / s_st[..., None]), qmin, qmax))
        u = q.astype(np.int64) + bias
        zp = np.full(s.shape, bias, dtype=np.int64)
    return u.reshape(n, k), s_st, zp


def oracle_dequant(u: np.ndarray, s: np.ndarray, zp: np.ndarray, group: int, out_np) -> np.ndarray:
    """((u - zp) * s) exactly (integers times a 16-bit scale fit float64), rounded once by ml_dtypes."""
    n, k = u.shape
    diff = u.reshape(n, k // group, group).astype(np.int64) - zp[..., None]
    return (diff.astype(np.float64) * s.astype(np.float64)[..., None]).reshape(n, k).astype(out_np)


def _nibbles_np(packed: np.ndarray, axis: int) -> np.ndarray:
    p = np.moveaxis(packed.astype(np.int64), axis, -1)
    out = np.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)
    return np.moveaxis(out, -1, axis)


@pytest.mark.parametrize("bits,group,zp", [(4, 128, False), (4, 128, True), (4, 32, False), (4, 32, True),
                                           (8, 128, False), (8, 64, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wna16_matches_numpy_oracle(bits, group, zp, dtype):
    g = torch.Generator().manual_seed(bits * 1000 + group + zp)
    w = (torch.randn(16, 256, generator=g) * torch.logspace(-3, 1, 16).unsqueeze(1))
    w[3, :group] = 0.0                  # an all-zero group
    w[5, group: 2 * group] = w[5, group: 2 * group].abs() + 0.5  # an all-positive group
    w = w.to(dtype)
    qw, s, z = wna16_quantize(w, num_bits=bits, group_size=group, zero_points=zp, scale_dtype=dtype)
    u_want, s_want, zp_want = oracle_wna16(_np(w), bits, group, zp, _NP_SCALE[dtype])
    assert qw.dtype == torch.uint8 and s.dtype == dtype
    u = _nibbles_np(qw.numpy(), -1) if bits == 4 else qw.numpy().astype(np.int64)
    assert np.array_equal(u, u_want)
    assert np.array_equal(_np(s), s_want)
    if zp:
        assert z.dtype == torch.uint8 and z.shape == (8, 256 // group)
        assert np.array_equal(_nibbles_np(z.numpy(), 0), zp_want)
    else:
        assert z is None
    got = wna16_dequantize(qw, s, z, num_bits=bits, group_size=group, out_dtype=dtype)
    want = oracle_dequant(u_want, s_want, zp_want, group, _NP_SCALE[dtype])
    assert got.dtype == dtype
    assert np.array_equal(_np(got), want.astype(F32))


def test_wna16_hand_values():
    # one group of 8, INT4 symmetric, fp32 scales: max |w| = 3.5 = 7 * 0.5 -> s = 0.5
    w = torch.tensor([[3.5, -3.5, 0.25, 0.75, 1.25, -0.25, 0.0, -4.0]])
    qw, s, z = wna16_quantize(w, num_bits=4, group_size=8, scale_dtype=torch.float32)
    assert s.tolist() == [[0.5]] and z is None
    # w / s = 7, -7, 0.5->0, 1.5->2, 2.5->2, -0.5->-0, 0, -8; stored + 8
    assert unpack_uint4(qw).tolist() == [[15, 1, 8, 10, 10, 8, 8, 0]]
    assert qw.tolist() == [[0x1F, 0xA8, 0x8A, 0x08]]  # element 2j in the low nibble
    # with zero points: s = (3.5 - -4) / 15 = 0.5, zp = rint(4 / 0.5) = 8: the same codes
    qz, sz, zz = wna16_quantize(w.repeat(2, 1), num_bits=4, group_size=8, zero_points=True,
                                scale_dtype=torch.float32)
    assert sz.tolist() == [[0.5], [0.5]] and zz.tolist() == [[0x88]]
    assert torch.equal(unpack_uint4(qz)[0], unpack_uint4(qw)[0])
    assert wna16_dequantize(qz, sz, zz, group_size=8, out_dtype=torch.float32)[0].tolist() == \
        [3.5, -3.5, 0.0, 1.0, 1.0, 0.0, 0.0, -4.0]


def test_wna16_dequant_rounds_once_to_the_activation_dtype():
    # (u - zp) * s is exact in fp32 but not in bf16: 7 * (1 + 2^-7) = 7.0546875 needs 10 significant bits
    s = torch.tensor([[1.0 + 2.0**-7]], dtype=torch.bfloat16)
    qw = torch.tensor([[0xFF] * 4], dtype=torch.uint8)  # u = 15 -> 7 after the bias
    got = wna16_dequantize(qw, s, None, group_size=8, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert got[0, 0].item() == float(np.float64(7 * (1 + 2.0**-7)).astype(BF16))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(1, 8), st.integers(0, 2**31 - 1))
def test_pack_uint4_matches_numpy(rows, half, seed):
    u = torch.randint(0, 16, (rows, 2 * half), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    p = pack_uint4(u)
    want = (u.numpy()[:, 0::2].astype(np.int64) | (u.numpy()[:, 1::2].astype(np.int64) << 4)).astype(np.uint8)
    assert np.array_equal(p.numpy(), want)
    assert torch.equal(unpack_uint4(p), u)
    pn = pack_uint4(u.T.contiguous(), dim=0)
    assert torch.equal(pn, p.T) and torch.equal(unpack_uint4(pn, dim=0), u.T)


def test_wna16_errors():
    w = torch.randn(4, 128)
    with pytest.raises(ValueError, match="num_bits"):
        wna16_quantize(w, num_bits=3)
    with pytest.raises(ValueError, match="INT4 only"):
        wna16_quantize(w, num_bits=8, zero_points=True)
    with pytest.raises(ValueError, match="group_size"):
        wna16_quantize(w, group_size=96)
    with pytest.raises(ValueError, match="NaN"):
        wna16_quantize(torch.full((4, 128), float("nan")))
    with pytest.raises(ValueError, match="odd"):
        wna16_quantize(torch.randn(3, 128), zero_points=True)
    with pytest.raises(TypeError):
        wna16_quantize(torch.zeros(4, 128, dtype=torch.int32))
    qw, s, _ = wna16_quantize(w)
    with pytest.raises(ValueError, match="scales shape"):
        wna16_dequantize(qw, s[:, :0])
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_uint4(torch.tensor([[16, 0]]))


# --- INT8 dynamic per tensor --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int8_per_tensor_matches_numpy(dtype):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(33, 512, generator=g) * 3).to(dtype)
    q, s = int8_quant_per_tensor(x)
    xn = x.float().numpy()
    np_dt = _NP_SCALE[dtype]
    # vLLM: torch.clamp(A.abs().max() / 127.0, min=1e-10) in A's dtype (one rounding of the fp32 quotient)
    s_want = max(F32(F32(np.abs(xn).max()) / F32(127)).astype(np_dt), np.array(1e-10).astype(np_dt))
    assert s.dtype == torch.float32 and s.shape == (1,) and s.item() == float(F32(s_want))
    q_want = np.clip(np.rint(xn / F32(s_want)), -128, 127).astype(np.int8)
    assert np.array_equal(q.numpy(), q_want)


def test_int8_per_tensor_zero_and_errors():
    q, s = int8_quant_per_tensor(torch.zeros(2, 8, dtype=torch.bfloat16))
    assert q.abs().max().item() == 0 and 0 < s.item() < 1.1e-10
    with pytest.raises(ValueError, match="NaN"):
        int8_quant_per_tensor(torch.tensor([1.0, float("inf")]))


# --- NVFP4 with a per-token global scale ------------------------------------------------------------------------
def oracle_nvfp4_per_token(x: np.ndarray):
    m, k = x.shape
    xf = x.astype(F32)
    amax = np.abs(xf).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        gs = np.where(amax == 0, F32(1), F32(448 * 6) / amax).astype(F32)
    xb = xf.reshape(m, k // 16, 16)
    bmax = np.abs(xb).max(-1).astype(F32)
    sf = np.clip((gs * (bmax * (F32(1) / F32(6)))).astype(F32), F32(-448), F32(448)).astype(E4M3)
    sf32 = sf.astype(F32)
    denom = (sf32 * (F32(1) / gs)).astype(F32)
    with np.errstate(divide="ignore"):
        mult = np.where(sf32 == 0, F32(0), F32(1) / denom).astype(F32)
    y = np.clip(xb * mult[..., None], F32(-6), F32(6)).astype(F32)
    c = y.astype(E2M1).view(np.uint8).reshape(m, k)
    packed = (c[:, 0::2] | (c[:, 1::2] << 4)).astype(np.uint8)
    deq = (y.astype(E2M1).astype(F32) * (sf32 / gs)[..., None]).reshape(m, k).astype(F32)
    return packed, sf.view(np.uint8), gs, deq


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nvfp4_per_token_matches_oracle(dtype):
    g = torch.Generator().manual_seed(23)
    x = (torch.randn(24, 256, generator=g) * torch.logspace(-3, 3, 24).unsqueeze(1)).to(dtype)
    x[4] = 0.0  # an all-zero token: gs = 1, zero codes and scales
    p, sf, gs = nvfp4_quantize_per_token(x)
    want_p, want_sf, want_gs, want_deq = oracle_nvfp4_per_token(x.float().numpy())
    assert p.dtype == torch.uint8 and p.shape == (24, 128)
    assert sf.dtype == torch.float8_e4m3fn and sf.shape == (24, 16)
    assert gs.dtype == torch.float32 and gs.shape == (24, 1)
    assert np.array_equal(gs.numpy(), want_gs)
    assert np.array_equal(sf.view(torch.uint8).numpy(), want_sf)
    assert np.array_equal(p.numpy(), want_p)
    assert np.array_equal(nvfp4_dequantize_per_token(p, sf, gs).numpy(), want_deq)


def test_nvfp4_per_token_errors():
    with pytest.raises(ValueError, match="NaN"):
        nvfp4_quantize_per_token(torch.tensor([[float("nan")] * 16]))
    with pytest.raises(ValueError, match="block size"):
        nvfp4_quantize_per_token(torch.randn(2, 24))
    p, sf, gs = nvfp4_quantize_per_token(torch.randn(2, 32))
    with pytest.raises(ValueError, match="token_gs"):
        nvfp4_dequantize_per_token(p, sf, gs.reshape(-1))
