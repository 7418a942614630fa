"""tools/diag/mma_probe.py: its test vectors tell the accumulation models apart (checked on the CPU against figures
derived by hand), so a GPU run of it reads the MMA's alignment width and rounding off the table."""

import importlib.util
from pathlib import Path

import torch

spec = importlib.util.spec_from_file_location(
    "mma_probe", Path(__file__).resolve().parents[1] / "tools" / "diag" / "mma_probe.py")
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)


def lost(fn, family, dtype=torch.bfloat16):
    """``{j: (got - exact) / 2^-j}`` for one family of vectors."""
    rows = probe.vectors(dtype)[family]
    d = (fn(rows) - probe.exact(rows)) / torch.tensor([2.0 ** -j for j in probe.JS], dtype=torch.float64)
    return dict(zip(probe.JS, d.tolist()))


def test_vectors_are_exact_in_bf16():
    vec = probe.vectors(torch.bfloat16)
    for r, j in enumerate(probe.JS):  # built here from the description, in float64
        t = 2.0 ** -j
        want = {"align": [1.0] + [t] * 15 + [0.0] * 16, "neg": [1.0] + [-t] * 15 + [0.0] * 16,
                "carry": [1.0] + [0.0] * 15 + [t] * 16}
        for fam, row in want.items():
            assert vec[fam][r].double().tolist() == row, (fam, j)


def test_fp32_round_to_nearest_keeps_the_tail_up_to_2_to_the_minus_23():
    # 1 + 2^-24 is a tie between 1 and 1 + 2^-23: round-to-nearest-even gives 1, every time.
    a, c = lost(probe.sequential_fp32, "align"), lost(probe.sequential_fp32, "carry")
    assert all(a[j] == 0 for j in range(18, 24)) and all(a[j] == -15 for j in range(24, 31))
    assert all(c[j] == 0 for j in range(18, 24)) and c[24] == -16
    # 1 - 2^-24 is representable (the ulp below 1 is 2^-24), 1 - 2^-25 a tie that rounds to 1.
    n = lost(probe.sequential_fp32, "neg")
    assert n[24] == 0 and n[25] == 15


def test_an_aligning_truncating_mma_is_told_apart():
    p24 = lambda r: probe.emulated_mma(r, 24)  # noqa: E731
    p25 = lambda r: probe.emulated_mma(r, 25)  # noqa: E731
    # j = 24 with p = 24: all 15 tail terms kept, 1 + 15 * 2^-24 truncated to 24 significant bits = 1 + 14 * 2^-24.
    assert lost(p24, "align")[24] == -1 and lost(p24, "align")[25] == -15
    # p = 25 keeps 2^-25 terms: 1 + 15 * 2^-25 truncated to 1 + 12 * 2^-25 (-3), and drops 2^-26.
    assert lost(p25, "align")[25] == -3 and lost(p25, "align")[26] == -15
    # Across k-blocks the accumulator is aligned too: 16 * 2^-24 = 2^-20 survives where fp32 RN loses it.
    assert lost(p24, "carry")[24] == 0 and lost(probe.sequential_fp32, "carry")[24] == -16


def test_the_cli_runs_on_the_cpu(capsys):
    assert probe.main(["--emulate", "--dtypes", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "| model p=24 trunc | align |" in out and "j=30" in out
