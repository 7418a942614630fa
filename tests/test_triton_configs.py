"""The committed Triton launch tables (``backends/triton/configs/*.json``): each file is named as vLLM names its
tables and every entry passes ``configs.sanitize_config`` for the table's block shape, so that ``get_config`` uses
it (an entry it rejects would silently fall back to the default configuration)."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install -e '.[triton]')", allow_module_level=True)

from backends.triton import configs as C  # noqa: E402

NAME = re.compile(r"^E=(\d+),N=(\d+),device_name=([A-Za-z0-9_]+)(?:,dtype=(\w+))?(?:,block_shape=\[(\d+),(\d+)\])?\.json$")
TABLES = sorted(C.CONFIG_DIR.glob("*.json"))


def test_tables_exist_for_both_gpus():
    devices = {NAME.match(p.name).group(3) for p in TABLES if NAME.match(p.name)}
    assert {"NVIDIA_H200", "NVIDIA_H100_80GB_HBM3"} <= devices, devices


@pytest.mark.parametrize("path", TABLES, ids=lambda p: p.name)
def test_table_entries_are_valid(path):
    m = NAME.match(path.name)
    assert m, f"{path.name}: not E=..,N=..,device_name=..[,dtype=..][,block_shape=[..]].json"
    E, N, dev, dtype = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
    block = (int(m.group(5)), int(m.group(6))) if m.group(5) else None
    assert path.name == C.config_file_name(E, N, dtype, block, dev)
    table = json.loads(path.read_text())
    assert table, f"{path.name} is empty"
    for M, entry in table.items():
        assert int(M) > 0
        assert set(entry) == {"gemm1", "gemm2"}, f"{path.name} M={M}: {sorted(entry)}"
        unknown = (set(entry["gemm1"]) - set(C.GEMM1_KEYS)) | (set(entry["gemm2"]) - set(C.GEMM2_KEYS))
        assert not unknown, f"{path.name} M={M}: unknown keys {unknown} (a typo is silently ignored)"
        cfg = C.sanitize_config(entry, block_shape=block)  # raises ValueError on a violated constraint
        for g in ("gemm1", "gemm2"):
            assert cfg[g]["num_warps"] in (2, 4, 8) and 1 <= cfg[g]["num_stages"] <= 8, (path.name, M, g, cfg[g])


def test_half_tail_needs_tiles_of_32_rows():
    """HALF_TAIL's tail tile is BLOCK_SIZE_M / 2 rows; a dot needs 16 at least, so BLOCK_SIZE_M 16 is refused."""
    g = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64)
    with pytest.raises(ValueError, match="HALF_TAIL needs BLOCK_SIZE_M >= 32"):
        C.sanitize_config({"gemm1": dict(g, HALF_TAIL=1), "gemm2": g})
    cfg = C.sanitize_config({"gemm1": dict(g, BLOCK_SIZE_M=32, HALF_TAIL=1), "gemm2": dict(g, BLOCK_SIZE_M=32)})
    assert cfg["gemm1"]["HALF_TAIL"] == 1
    assert C.sanitize_config({"gemm1": g, "gemm2": g})["gemm1"]["HALF_TAIL"] == 0


def test_tuner_candidate_lists_are_complete():
    """Each GEMM's candidate list is deduplicated on its own (a GEMM2 candidate equal to a GEMM1 candidate is still
    timed), and prefill has the 128-row HALF_TAIL key."""
    from backends.triton.tune import candidates

    for M, E, topk in ((1, 128, 8), (8, 128, 8), (4096, 128, 8), (1024, 32, 8)):
        for fp8_block in (False, True):
            for key, (g1s, g2s) in candidates(M, E, topk, fp8_block, fp8_block).items():
                for lst in (g1s, g2s):
                    keys = [json.dumps(c, sort_keys=True) for c in lst]
                    assert len(keys) == len(set(keys)), (M, key)
                shared = {json.dumps(c, sort_keys=True) for c in g1s} & {json.dumps(c, sort_keys=True) for c in g2s}
                if M == 1 and not fp8_block:
                    assert shared, "the decode lists share configs; each list must keep its own copy"
                if key == "128h":
                    assert all(c["HALF_TAIL"] == 1 and c["BLOCK_SIZE_M"] == 128 for c in g1s)
    assert "128h" in candidates(4096, 128, 8, False, False)
