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
