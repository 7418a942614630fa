"""Scale layouts: the CUTLASS 128x4 swizzle against the facts file's offset formula evaluated by a
python loop, vLLM's reshape/permute inverse, and MN-major TMA-aligned strides."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference.quant import (
    get_mn_major_tma_aligned_tensor,
    get_tma_aligned_size,
    swizzle_block_scales,
    swizzle_mxfp4_scales,
    unswizzle_block_scales,
)



@pytest.fixture(autouse=True)
def _seed_torch():
    # unseeded torch.randn in a test still draws the same inputs on every run
    torch.manual_seed(0)


def loop_swizzle(s: np.ndarray) -> np.ndarray:
    """facts: offset = (mTile*numKTiles + kTile)*512 + (m%32)*16 + ((m/32)%4)*4 + (k%4); pad 0."""
    m_rows, k_cols = s.shape
    n_mt, n_kt = -(-m_rows // 128), -(-k_cols // 4)
    out = np.zeros(n_mt * n_kt * 512, dtype=s.dtype)
    for m in range(m_rows):
        for k in range(k_cols):
            off = ((m // 128) * n_kt + k // 4) * 512 + (m % 32) * 16 + ((m // 32) % 4) * 4 + (k % 4)
            out[off] = s[m, k]
    return out


def vllm_recover_swizzled(flat: np.ndarray, m: int, scale_n: int) -> np.ndarray:
    """vLLM's test helper recover_swizzled_scales (reshape / permute), an independent inverse."""
    rm, rn = -(-m // 128) * 128, -(-scale_n // 4) * 4
    t = flat.reshape(1, rm // 128, rn // 4, 32, 4, 4).transpose(0, 1, 4, 3, 2, 5)
    return t.reshape(rm, rn)[:m, :scale_n]


@pytest.mark.parametrize("m", [1, 31, 100, 128, 129, 300])
@pytest.mark.parametrize("k_cols", [1, 3, 4, 7, 8])
def test_swizzle_matches_offset_formula(m, k_cols):
    rng = np.random.default_rng(m * 10 + k_cols)
    s = rng.integers(1, 256, size=(m, k_cols), dtype=np.uint8)  # non-zero so padding is visible
    sw = swizzle_mxfp4_scales(torch.from_numpy(s))
    n_mt, n_kt = -(-m // 128), -(-k_cols // 4)
    assert sw.shape == (n_mt, n_kt, 32, 4, 4) and sw.dtype == torch.uint8 and sw.is_contiguous()
    assert np.array_equal(sw.numpy().reshape(-1), loop_swizzle(s))
    assert np.array_equal(vllm_recover_swizzled(sw.numpy().reshape(-1), m, k_cols), s)
    assert torch.equal(unswizzle_block_scales(sw, m, k_cols), torch.from_numpy(s))
    assert torch.equal(unswizzle_block_scales(sw.reshape(-1), m, k_cols), torch.from_numpy(s))


def test_swizzle_dtypes_and_block_sizes():
    # NVFP4 (block 16): e4m3 scales for K = 128 -> 8 columns; MX (block 32): uint8 for K = 256
    s8 = torch.randn(200, 8).abs().to(torch.float8_e4m3fn)
    sw = swizzle_block_scales(s8)
    assert sw.dtype == torch.float8_e4m3fn and sw.shape == (2, 2, 32, 4, 4)
    assert np.array_equal(sw.view(torch.uint8).numpy().reshape(-1), loop_swizzle(s8.view(torch.uint8).numpy()))
    assert torch.equal(unswizzle_block_scales(sw, 200, 8).view(torch.uint8), s8.view(torch.uint8))
    f = torch.rand(130, 5)
    swf = swizzle_mxfp4_scales(f)
    assert np.array_equal(swf.numpy().reshape(-1), loop_swizzle(f.numpy()))


def test_swizzle_batched():
    s = torch.randint(0, 255, (3, 150, 6), dtype=torch.uint8)
    sw = swizzle_mxfp4_scales(s)
    assert sw.shape == (3, 2, 2, 32, 4, 4)
    for e in range(3):
        assert torch.equal(sw[e], swizzle_mxfp4_scales(s[e]))
    assert torch.equal(unswizzle_block_scales(sw, 150, 6), s)
    assert torch.equal(unswizzle_block_scales(sw.reshape(3, -1), 150, 6), s)


def test_unswizzle_errors():
    with pytest.raises(ValueError):
        unswizzle_block_scales(torch.zeros(100, dtype=torch.uint8), 128, 4)
    with pytest.raises(ValueError):
        swizzle_mxfp4_scales(torch.zeros(4, dtype=torch.uint8))


@settings(max_examples=20, deadline=None, database=None)
@given(m=st.integers(1, 300), k_cols=st.integers(1, 12))
def test_swizzle_round_trip(m, k_cols):
    s = torch.randint(0, 256, (m, k_cols), dtype=torch.uint8)
    assert torch.equal(unswizzle_block_scales(swizzle_mxfp4_scales(s), m, k_cols), s)


def test_tma_aligned_size():
    assert [get_tma_aligned_size(x, 4) for x in (0, 1, 3, 4, 5, 130)] == [0, 4, 4, 4, 8, 132]
    assert [get_tma_aligned_size(x, 1) for x in (1, 16, 17)] == [16, 16, 32]
    with pytest.raises(ValueError):
        get_tma_aligned_size(5, 3)


@pytest.mark.parametrize("mn", [0, 1, 3, 4, 5, 130])
def test_mn_major_tma_aligned_tensor(mn):
    s = torch.randn(mn, 7)
    t = get_mn_major_tma_aligned_tensor(s)
    a = -(-mn // 4) * 4
    assert t.shape == (mn, 7) and torch.equal(t, s)
    if mn:  # torch normalises the strides of empty tensors
        assert t.stride() == (1, a)
        storage = torch.empty(0, dtype=torch.float32).set_(t.untyped_storage())[: 7 * a].reshape(7, a)
        assert torch.equal(storage[:, :mn], s.t()) and not storage[:, mn:].any()
    b = torch.randint(-5, 5, (2, mn, 3), dtype=torch.int32)
    tb = get_mn_major_tma_aligned_tensor(b)
    assert torch.equal(tb, b) and (mn == 0 or tb.stride() == (3 * a, 1, a))


def test_mn_major_errors():
    with pytest.raises(TypeError):
        get_mn_major_tma_aligned_tensor(torch.randn(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError):
        get_mn_major_tma_aligned_tensor(torch.randn(4))
