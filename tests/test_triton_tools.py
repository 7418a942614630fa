"""The triton backend's GPU tools import on a CPU-only machine (no GPU work at import time) and refuse to run
without a GPU with a clear message instead of a traceback."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install -e '.[triton]')", allow_module_level=True)


def test_fp8_accum_imports_on_cpu():
    import torch

    from tools.triton import fp8_accum

    assert set(fp8_accum.VARIANTS) >= {fp8_accum.OLD} and len(fp8_accum.VARIANTS) >= 2
    assert fp8_accum.VARIANTS[fp8_accum.OLD] == {"FAST_ACCUM": 1}
    # the single-GEMM accuracy part runs the accumulation forms only (tile / table variants are the step's)
    assert fp8_accum.OLD in fp8_accum.ACC_VARIANTS and "table" not in fp8_accum.ACC_VARIANTS
    assert not any("_tile" in k for k in fp8_accum.ACC_VARIANTS.values())
    assert [s.scheme for s in fp8_accum.timing_shapes()] == ["fp8_channel_token", "fp8_tensor"]
    cfg = fp8_accum.with_variant({"gemm1": dict(BLOCK_SIZE_K=256), "gemm2": dict(BLOCK_SIZE_K=128)},
                                 {"PROMOTE_K": 128})
    assert cfg["gemm1"] == {"BLOCK_SIZE_K": 128, "PROMOTE_K": 128} and cfg["gemm2"]["BLOCK_SIZE_K"] == 128
    # a per-GEMM tile applies to prefill configs only
    tile = {"_tile": {"gemm1": dict(BLOCK_SIZE_N=64, COOPERATIVE=1), "gemm2": dict(BLOCK_SIZE_N=128)}}
    pre = fp8_accum.with_variant({"gemm1": dict(BLOCK_SIZE_M=128), "gemm2": dict(BLOCK_SIZE_M=128)}, tile)
    assert pre["gemm1"] == dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=64, COOPERATIVE=1)
    assert pre["gemm2"] == dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128)
    dec = {"gemm1": dict(BLOCK_SIZE_M=16), "gemm2": dict(BLOCK_SIZE_M=16)}
    assert fp8_accum.with_variant(dec, tile) == dec
    if not torch.cuda.is_available():
        assert fp8_accum.main(["--no-timing", "--json", "/dev/null"]) == 2
