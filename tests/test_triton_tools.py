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


def test_table_ab_writes_each_variant_over_the_committed_tables(tmp_path):
    """``tools.triton.table_ab``: a variant's directory holds every committed table; its entries update the named
    M's keys (``merge``, the default; a ``None`` value drops a key) or replace the entry (``merge: false``), and
    the other M and tables are the committed ones, byte for byte."""
    import json

    from tools.triton.table_ab import CONFIGS, write_tables

    name = "E=8,N=7168,device_name=NVIDIA_H200,dtype=fp8_w8a8.json"
    committed = json.loads((CONFIGS / name).read_text())
    merged = write_tables(tmp_path, "m", {"table": name, "entries": {
        "1": {"gemm1": {"BLOCK_SIZE_N": 64, "AMAX_EPILOGUE": None}, "gemm2": {"SWAP_AB": 1}}}})
    t = json.loads((merged / name).read_text())
    assert t["1"]["gemm1"] == {**{k: v for k, v in committed["1"]["gemm1"].items() if k != "AMAX_EPILOGUE"},
                               "BLOCK_SIZE_N": 64}
    assert t["1"]["gemm2"] == {**committed["1"]["gemm2"], "SWAP_AB": 1}
    assert {m: t[m] for m in t if m != "1"} == {m: committed[m] for m in committed if m != "1"}
    tile = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128}
    entry = {"gemm1": dict(tile), "gemm2": dict(tile)}
    replaced = write_tables(tmp_path, "r", {"table": name, "merge": False, "entries": {"8": entry}})
    assert json.loads((replaced / name).read_text())["8"] == entry
    others = {f.name for f in CONFIGS.glob("*.json")} - {name}
    assert others and all((merged / f).read_bytes() == (CONFIGS / f).read_bytes() for f in others)


def test_table_ab_reads_each_row_with_its_aa():
    """``table_ab.row_result``: a bench row's ``gemms`` and ``step`` in us and, from a run with ``--aa``, the twin's
    paired ratio to ``gemms`` (hand-made rounds: the twin 1% slower in every round); a row whose ``gemms`` was not
    timed gives None."""
    from tools.triton.table_ab import row_result

    row = {"M": 1, "times_s": {"step": 20e-6, "gemms": 16e-6, "gemms (A/A)": 16.16e-6}, "timing": "interleaved",
           "rounds_s": {"gemms": [16e-6] * 10, "gemms (A/A)": [16.16e-6] * 10}}
    g, s, aa = row_result(row)
    assert (round(g, 6), round(s, 6), round(aa, 6)) == (16.0, 20.0, 1.01)
    del row["rounds_s"]["gemms (A/A)"]
    assert row_result(row)[2] is None  # a run without --aa
    assert row_result({"M": 1, "times_s": {"step": 20e-6}}) is None


def test_table_ab_refuses_an_entry_the_backend_would_replace_by_its_default(tmp_path):
    """An entry ``configs.sanitize_config`` rejects (GEMM1 and GEMM2 on different ``BLOCK_SIZE_M``, a SPLIT_K out of
    range) would be replaced by the default config when the backend loads the table, and the A / B would time the
    default under the variant's name: ``write_tables`` raises, naming the variant and the M."""
    import pytest

    from tools.triton.table_ab import write_tables

    name = "E=8,N=7168,device_name=NVIDIA_H200,dtype=fp8_w8a8.json"
    for bad in ({"gemm1": {"BLOCK_SIZE_M": 64}}, {"gemm2": {"SPLIT_K": 99}}):
        with pytest.raises(ValueError, match=r"variant 'v', M=64 of .*default config"):
            write_tables(tmp_path, "v", {"table": name, "entries": {"64": bad}})
    block = "E=128,N=768,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"
    with pytest.raises(ValueError, match="M=8"):  # BLOCK_SIZE_K past the 128 scale group
        write_tables(tmp_path, "b", {"table": block, "entries": {"8": {"gemm1": {"BLOCK_SIZE_K": 256}}}})
    write_tables(tmp_path, "ok", {"table": block, "entries": {"8": {"gemm1": {"BLOCK_SIZE_K": 64}}}})


def test_table_ab_runs_only_the_variants_of_this_gpu():
    """``for_device``: a spec may name the H100's and the H200's tables; on one GPU the other's variants are set
    aside (they would time the committed tables under their names); variants without a table stay."""
    from tools.triton.table_ab import for_device

    spec = {"a": {"table": "E=8,N=7168,device_name=NVIDIA_H200,dtype=fp8_w8a8.json"},
            "b": {"table": "E=8,N=7168,device_name=NVIDIA_H100_80GB_HBM3.json"},
            "c": {"shape": "x"}}
    kept, other = for_device(spec, "NVIDIA_H200")
    assert set(kept) == {"a", "c"} and other == ["b"]
    kept, other = for_device(spec, "NVIDIA_H100_80GB_HBM3")
    assert set(kept) == {"b", "c"} and other == ["a"]
    assert for_device(spec, "NVIDIA_H20")[1] == ["a", "b"]  # a name that is a prefix of another is not it
