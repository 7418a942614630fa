"""Conformance results keep what the terminal shows, and one run never destroys another's results.

Unit tests of ``conformance.report`` (failure parsing, merging, rendering, the CLI's output names), and one
end-to-end run of a planted broken backend whose printed reproduce command is then run as a user would.
"""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.report import main, margin, merge, output_name, parse_failure, render

ROOT = Path(__file__).resolve().parents[1]

CLOSE_FAILURE = """_NoRouterWeights output differs from the reference: max_norm = 2.058e+00 > 1.6e-02; rms_norm = 1.625e+00 > 2.0e-03; calc_diff = 4.216e-01 > 1.0e-05
  worst at [0, 1241]: got -4.5625, expected -1.234375
  max_norm=2.058e+00 rms_norm=1.625e+00 calc_diff=4.216e-01
  case: qwen3_30b_a3b-bf16-M4-ep8r0
  reproduce: python -m pytest 'conformance/test_experts.py::test_experts[qwen3_30b_a3b-bf16-M4-ep8r0]' --backend x
  diagnosis: divergent stage(s): router_weight (100% of the output error)
  input_quant: not applicable or no quantizer op
  gemm1 -> gemm2 with unit router weights: matches
  inputs dumped to d/c.pt; replay them: python -m pytest 'x' --backend x --replay d/c.pt"""

EXACT_FAILURE = """per_token_group_quant_fp8 scales (recipe vllm): 3 of 56 elements differ
    at [0, 1]: got 0.5, expected 1.0 (value before rounding 0.71)
    at [2, 3]: got 0.25, expected 0.5
  case: q-M7
  reproduce: python -m pytest 'conformance/test_quant.py::test_quantizer[q-M7]' --backend x"""


def test_parse_a_metric_failure():
    f = parse_failure(CLOSE_FAILURE)
    assert f["headline"].startswith("_NoRouterWeights output differs")
    assert f["violations"][0] == {"metric": "max_norm", "value": 2.058, "bound": 0.016}
    assert [v["metric"] for v in f["violations"]] == ["max_norm", "rms_norm", "calc_diff"]
    assert f["metrics"] == {"max_norm": 2.058, "rms_norm": 1.625, "calc_diff": 0.4216}
    assert f["worst"] == {"index": [0, 1241], "got": -4.5625, "expected": -1.234375}
    assert f["case"] == "qwen3_30b_a3b-bf16-M4-ep8r0"
    assert f["reproduce"].startswith("python -m pytest 'conformance/test_experts.py::test_experts[")
    assert f["diagnosis"].startswith("divergent stage(s): router_weight")
    assert f["stages"] == ["input_quant: not applicable or no quantizer op",
                           "gemm1 -> gemm2 with unit router weights: matches"]
    assert f["replay"].endswith("--replay d/c.pt")


def test_parse_an_exact_failure():
    f = parse_failure(EXACT_FAILURE)
    assert f["mismatches"][0] == {"index": [0, 1], "got": 0.5, "expected": 1.0, "before_rounding": 0.71}
    assert f["worst"] == {"index": [0, 1], "got": 0.5, "expected": 1.0}
    assert f["case"] == "q-M7" and "violations" not in f


def _entry(nodeid, outcome="passed", **kw):
    return {"nodeid": nodeid, "outcome": outcome, "duration_s": 0.1, **kw}


def _payload(results, **kw):
    return {"backend": "b", "version": "1", "torch": "2", "device": "cpu", "capability": None, "unavailable": None,
            "time": "T1", "results": results, **kw}


def test_margin_and_matrix_cells():
    ok = _entry("e::a", component="experts", model="m", scheme="bf16", tokens=4, experts_class="X",
                max_norm=0.004, rms_norm=0.001, calc_diff=1e-6, bounds={"max_norm": 0.016, "rms_norm": 0.002})
    assert margin(ok) == 0.5
    bad = _entry("e::b", "failed", component="experts", model="m", scheme="fp8", tokens=16, experts_class="X",
                 message=CLOSE_FAILURE, failure=parse_failure(CLOSE_FAILURE), max_norm=2.058,
                 bounds={"max_norm": 0.016})
    md = render(_payload([ok, bad, _entry("q::c", component="quant", scheme="op", tokens=7)]))
    assert "## experts: X" in md and "| model | tokens | bf16 | fp8 |" in md
    assert "| m | 4, 16 | pass 1/1 · 0.5 | **FAIL** 1/1 · 1.3e+02 |" in md
    assert "| op | pass 1/1 | 7 |" in md  # a component without models: one row per case family, no "-" row
    for text in ("max_norm = 2.06 > bound 0.016", "worst at [0, 1241]: got -4.5625, expected -1.234375",
                 "diagnosis: divergent stage(s): router_weight",
                 "python -m pytest 'conformance/test_experts.py::test_experts[qwen3_30b_a3b-bf16-M4-ep8r0]'"):
        assert text in md, text


def test_merge_replaces_case_by_case_and_keeps_the_rest():
    old = _payload([_entry("a"), _entry("b")], full=True, runs=[{"time": "T0", "selection": None, "cases": 2}])
    new = _payload([_entry("b", "failed"), _entry("c")], time="T1", selection="-k b", full=False,
                   runs=[{"time": "T1", "selection": "-k b", "cases": 2}])
    m = merge(old, new)
    assert [(e["nodeid"], e["outcome"]) for e in m["results"]] == [("a", "passed"), ("b", "failed"), ("c", "passed")]
    assert m["full"] is True and [r["selection"] for r in m["runs"]] == [None, "-k b"]
    assert "- runs merged into this file" in render(m) and "T1: -k b (2 cases)" in render(m)
    assert merge({**old, "backend": "other"}, new) is new and merge(None, new) is new


def test_cli_writes_one_file_per_input_under_the_committed_names(tmp_path):
    for name in ("torch", "triton"):
        (tmp_path / f"conformance-{name}.json").write_text(json.dumps(_payload([_entry("a")], backend=name)))
    out = tmp_path / "docs" / "conformance"  # missing: created
    main([str(tmp_path / "conformance-torch.json"), str(tmp_path / "conformance-triton.json"), "-o", str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["torch.md", "triton.md"]
    assert "`triton`" in (out / "triton.md").read_text()
    assert output_name(Path("results/conformance-deep_gemm.json")) == "deep_gemm.md"
    main([str(tmp_path / "conformance-torch.json"), "-o", str(tmp_path / "one.md")])
    assert (tmp_path / "one.md").exists()


def _run(cmd, tmp_path):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "MOE_PROGRESS_INTERVAL": "0"})


@pytest.mark.slow  # a subprocess run of the suite: nox -s slow
def test_a_planted_failure_is_reported_whole_and_its_reproduce_keeps_the_full_report(tmp_path):
    case = "conformance/test_experts.py::test_experts[qwen3_30b_a3b-bf16-M4-ep8r0]"
    # A full run's report already there (as after `nox -s conformance`): the selected runs must merge into it.
    full = _payload([_entry("conformance/test_align.py::test_align[other]", component="align", model="m",
                            scheme="bs16", tokens=1), _entry(case, component="experts")],
                    backend="broken_no_router_weights", time="T0", full=True, selection=None,
                    runs=[{"time": "T0", "selection": None, "cases": 2}])
    path = tmp_path / "conformance-broken_no_router_weights.json"
    path.write_text(json.dumps(full))
    r = _run([sys.executable, "-m", "pytest", "conformance", "--backend", "tests.broken_backends:no_router_weights",
              "-p", "no:cacheprovider", "--results-dir", str(tmp_path), "-k", "test_experts and qwen3_30b_a3b-bf16-M4-"],
             tmp_path)
    assert r.returncode == 1, r.stdout[-3000:]
    # The terminal: the message leads, without the harness's source; the end lists the reason whole.
    assert "ConformanceFailure: _NoRouterWeights output differs from the reference: max_norm = " in r.stdout
    assert "def test_experts(" not in r.stdout and "kernel_for" not in r.stdout
    summary = r.stdout.split("failed cases: reason and reproduce command")[1]
    assert f"{case} - _NoRouterWeights output differs from the reference: max_norm = " in summary
    # The JSON keeps what the terminal showed.
    payload = json.loads(path.read_text())
    entries = {e["nodeid"]: e for e in payload["results"]}
    assert "conformance/test_align.py::test_align[other]" in entries  # the full run's other cases stay
    e = entries[case]
    assert e["outcome"] == "failed" and "worst at [" in e["message"]
    f = e["failure"]
    assert {v["metric"] for v in f["violations"]} == {"max_norm", "rms_norm", "calc_diff"}
    assert all(v["value"] > v["bound"] for v in f["violations"])
    # the message prints the bound to 2 digits; the record keeps the exact one
    assert abs(e["bounds"]["max_norm"] / f["violations"][0]["bound"] - 1) < 0.06
    assert e["max_norm"] == f["metrics"]["max_norm"]
    assert e["margin"] > 1
    assert len(f["worst"]["index"]) == 2 and isinstance(f["worst"]["got"], float)
    assert f["diagnosis"].startswith("divergent stage(s): router_weight")
    assert f["case"] == "qwen3_30b_a3b-bf16-M4-ep8r0"
    assert f["reproduce"] == (f"python -m pytest '{case}' --backend tests.broken_backends:no_router_weights")
    assert payload["full"] is True and [r_["selection"] for r_ in payload["runs"]] == [
        None, "-k 'test_experts and qwen3_30b_a3b-bf16-M4-'"]
    md = path.with_suffix(".md").read_text()
    for text in ("**FAIL** 1/1", "max_norm = ", "> bound ", "worst at [", "diagnosis: divergent stage(s)",
                 f["reproduce"], "| m | 1 | pass 1/1 |"):
        assert text in md, text
    # The printed reproduce command, run as printed (python = this interpreter): the full report stays.
    argv = shlex.split(f["reproduce"])
    r2 = _run([sys.executable, *argv[1:], "-p", "no:cacheprovider", "--results-dir", str(tmp_path)], tmp_path)
    assert r2.returncode == 1 and "1 failed" in r2.stdout, r2.stdout[-3000:]
    payload = json.loads(path.read_text())
    assert {e["nodeid"] for e in payload["results"]} == set(entries)
    assert payload["runs"][-1]["selection"] == shlex.quote(case) and len(payload["runs"]) == 3
    assert "| m | 1 | pass 1/1 |" in path.with_suffix(".md").read_text()


def test_header_counts_a_known_failure_apart_from_the_skips():
    """An xfailed case (pytest reports it as skipped with ``wasxfail``) is counted as xfailed in the header, never
    among the skips: a known failure is not a skipped check."""
    entries = [_entry("e::a", component="experts", model="m", scheme="bf16", tokens=4, experts_class="X"),
               _entry("e::b", "skipped", component="experts", model="m", scheme="bf16", tokens=1, experts_class="X",
                      xfail="a known tail event", reason="a known tail event"),
               _entry("e::c", "skipped", component="experts", model="m", scheme="fp8", tokens=1, experts_class="X",
                      reason="unsupported")]
    header = [line for line in render(_payload(entries)).splitlines() if line.startswith("- cases:")]
    assert header == ["- cases: 1 passed, 1 skipped, 1 xfailed"]


def test_a_cell_cites_every_skip_reason_whatever_the_order():
    """A cell whose cases skipped for different reasons cites each reason once (the commonest first), and the
    report is the same text whichever order the cases ran in (pytest-xdist reorders them)."""
    def entries():
        return [_entry("e::a", component="experts", model="m", scheme="bf16", tokens=4, experts_class="X"),
                *(_entry(f"e::s{i}", "skipped", component="experts", model="m", scheme="bf16", tokens=4,
                         experts_class="X", reason="no op A" if i < 2 else "no op B") for i in range(5))]
    md = render(_payload(entries()))
    assert "| m | 4 | pass 1/6, skipped 5[^1][^2] |" in md
    assert "[^1]: no op B" in md and "[^2]: no op A" in md
    assert render(_payload(entries()[::-1])) == md
