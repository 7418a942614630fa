"""The conformance harness must go red for broken backends, name the case and print a working repro command.

Each test runs the real suite in a subprocess (as a user would) on a small selection of cases.
"""

import json
import os
import shlex
import subprocess
import sys

import pytest

from tests.harness_util import ROOT, run_conformance


@pytest.mark.slow  # a subprocess run of the suite: nox -s slow
def test_correct_backend_passes_the_selection(tmp_path):
    r = run_conformance("torch", "-k", "qwen3_30b_a3b and (M1 or M7)", tmp_path=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:]
    assert " passed" in r.stdout and "failed" not in r.stdout
    results = json.loads((tmp_path / "conformance-torch.json").read_text())
    assert results["backend"] == "torch" and all(e["outcome"] == "passed" for e in results["results"])


@pytest.mark.slow  # a subprocess run of the suite: nox -s slow
def test_dropped_renormalization_fails_routing(tmp_path):
    r = run_conformance("tests.broken_backends:no_renormalize", "-k", "test_routing and qwen3_30b_a3b",
                        tmp_path=tmp_path)
    assert r.returncode == 1, r.stdout[-3000:]
    assert "routing[qwen3_30b_a3b-M1] via fused_topk" in r.stdout
    assert "weights differ" in r.stdout


def test_skipped_router_weights_fail_experts_with_case_and_repro(tmp_path):
    r = run_conformance("tests.broken_backends:no_router_weights", "-k", "test_experts and qwen3_30b_a3b-bf16-M4-",
                        tmp_path=tmp_path)
    assert r.returncode == 1, r.stdout[-3000:]
    out = r.stdout
    assert "case: qwen3_30b_a3b-bf16-M4-ep8r0" in out
    assert "worst at [" in out
    repro = next(line.split("reproduce: ", 1)[1] for line in out.splitlines() if "reproduce: python" in line)
    assert repro.startswith("python -m pytest 'conformance/test_experts.py::test_experts[qwen3_30b_a3b-bf16-M4-ep8r0]'")
    # The printed command reproduces the failure on its own ("python" is this interpreter, as in an activated venv).
    cmd = shlex.quote(sys.executable) + repro[len("python"):]
    r2 = subprocess.run(cmd + f" -p no:cacheprovider --results-dir {tmp_path}", shell=True, cwd=ROOT,
                        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert r2.returncode == 1 and "1 failed" in r2.stdout


@pytest.mark.slow  # a subprocess run of the suite: nox -s slow
def test_unwritten_output_is_caught_by_poisoning(tmp_path):
    r = run_conformance("tests.broken_backends:half_output", "-k", "test_experts and qwen3_30b_a3b-bf16-M1-",
                        tmp_path=tmp_path)
    assert r.returncode == 1, r.stdout[-3000:]
    assert "non-finite elements where the reference is finite" in r.stdout


@pytest.mark.slow  # a subprocess run of the suite: nox -s slow
def test_activation_double_rounding_is_caught(tmp_path):
    r = run_conformance("tests.broken_backends:activation_double_rounding", "-k",
                        "test_activation and silu-bfloat16-M33", tmp_path=tmp_path)
    assert r.returncode == 1, r.stdout[-3000:]
    assert "beyond 1 ulp" in r.stdout


@pytest.mark.parametrize("spec,message", [
    ("no_such_backend", "unknown backend 'no_such_backend'; registered: cuda, deep_gemm, torch, triton"),
    ("tests.broken_backends:not_a_backend", "is a int, not a backends.Backend"),
    ("no.such.module:backend", "cannot import backend module 'no.such.module'"),
])
def test_bad_backend_names_are_usage_errors(spec, message, tmp_path):
    r = run_conformance(spec, tmp_path=tmp_path)
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-2000:]
    assert message in r.stderr


def test_unavailable_backend_skips_every_case_with_reason(tmp_path):
    r = run_conformance("cuda", "-k", "test_routing and mixtral", "-rs", tmp_path=tmp_path, quiet=False)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "status: UNAVAILABLE - no CUDA GPU" in r.stdout
    assert "SKIPPED" in r.stdout and "backend cuda unavailable: no CUDA GPU" in r.stdout
    assert "passed" not in r.stdout


def test_one_bit_quantizer_change_is_caught(tmp_path):
    r = run_conformance("tests.broken_backends:ue8m0_floor", "-k", "test_quantizer and ue8m0 and M7-K7168-g128-",
                        tmp_path=tmp_path)
    assert r.returncode == 1, r.stdout[-3000:]
    assert "per_token_group_quant_fp8 scales (recipe vllm)" in r.stdout and "elements differ" in r.stdout


@pytest.mark.slow  # a subprocess run of the suite: nox -s slow
def test_works_but_not_claimed_is_reported(tmp_path):
    r = run_conformance("tests.broken_backends:claims_nothing", "-k", "test_experts and qwen3_30b_a3b-fp8_block128-M4",
                        tmp_path=tmp_path)
    assert r.returncode == 1, r.stdout[-3000:]
    assert "works but not claimed" in r.stdout


@pytest.mark.slow  # a subprocess run of the suite: nox -s slow
def test_garbage_for_unsupported_config_is_reported(tmp_path):
    r = run_conformance("tests.broken_backends:garbage_when_unsupported", "-k",
                        "test_experts and gpt_oss_120b-mxfp4_w4a16-M4", tmp_path=tmp_path)
    assert r.returncode == 1, r.stdout[-3000:]
    assert "returned a tensor instead of raising" in r.stdout


@pytest.mark.slow  # a subprocess run of the suite: nox -s slow
def test_a_crashing_case_does_not_take_the_run_with_it(tmp_path):
    r = run_conformance("tests.broken_backends:crashes_on_m4", "-k", "test_experts and qwen3_30b_a3b-bf16 and (M1- or M4- or M16-) and not gelu "
                        "and not relu and not silu and not swiglu and not situ", "-n", "1", "--dist", "worksteal", "--max-worker-restart", "5", tmp_path=tmp_path)
    assert r.returncode == 1, r.stdout[-3000:]
    assert "2 passed" in r.stdout and "1 failed" in r.stdout, r.stdout[-3000:]
    assert "crashed while running" in r.stdout and "qwen3_30b_a3b-bf16-M4-ep8r0" in r.stdout
    results = json.loads((tmp_path / "conformance-broken_crash.json").read_text())["results"]
    crashed = [e for e in results if e["outcome"] == "failed"]
    assert [e["nodeid"] for e in crashed] == ["conformance/test_experts.py::test_experts[qwen3_30b_a3b-bf16-M4-ep8r0]"]


@pytest.mark.slow  # a subprocess run of the suite: nox -s slow
def test_known_failures_file(tmp_path):
    """Entries mark failures as xfail; a stale entry is reported; a strict entry that passes fails the run."""
    xdir = tmp_path / "xfail"
    xdir.mkdir()
    (xdir / "broken_no_router_weights.toml").write_text('''
[[xfail]]
node_id = "conformance/test_experts.py::test_experts[qwen3_30b_a3b-bf16-M4-ep8r0"
reason = "drops the router weights"
issue = "https://example.invalid/issues/1"

[[xfail]]
node_id = "conformance/test_experts.py::test_experts[no_such_case"
reason = "stale"
issue = "https://example.invalid/issues/2"
''')
    env_backup = os.environ.get("MOE_XFAIL_DIR")
    os.environ["MOE_XFAIL_DIR"] = str(xdir)
    try:
        r = run_conformance("tests.broken_backends:no_router_weights", "-k", "test_experts and qwen3_30b_a3b-bf16-M4-",
                            "-rx", tmp_path=tmp_path)
        assert r.returncode == 0, r.stdout[-3000:]
        assert "1 xfailed" in r.stdout and "drops the router weights (https://example.invalid/issues/1)" in r.stdout
        assert "'conformance/test_experts.py::test_experts[no_such_case' matches no test" in r.stdout
        # The same entry against the correct backend: the known failure passes -> strict XPASS fails the run.
        (xdir / "torch.toml").write_text((xdir / "broken_no_router_weights.toml").read_text())
        r = run_conformance("torch", "-k", "test_experts and qwen3_30b_a3b-bf16-M4-", tmp_path=tmp_path)
        assert r.returncode == 1 and "XPASS(strict)" in r.stdout, r.stdout[-3000:]
    finally:
        if env_backup is None:
            os.environ.pop("MOE_XFAIL_DIR")
        else:
            os.environ["MOE_XFAIL_DIR"] = env_backup


@pytest.mark.slow  # a subprocess run of the suite: nox -s slow
def test_out_of_tree_backend_through_an_entry_point(tmp_path):
    """An installed package registers a backend under the entry-point group and runs with --backend NAME."""
    site = tmp_path / "site"
    (site / "mymoe-0.1.dist-info").mkdir(parents=True)
    (site / "mymoe.py").write_text(
        "import dataclasses\nfrom backends.torch import backend as _t\n"
        "backend = dataclasses.replace(_t, name='mine', version='mymoe 0.1')\n")
    (site / "mymoe-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: mymoe\nVersion: 0.1\n")
    (site / "mymoe-0.1.dist-info" / "entry_points.txt").write_text("[moe_conformance.backends]\nmine = mymoe:backend\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{site}"}
    cmd = [sys.executable, "-m", "pytest", "conformance", "--backend", "mine", "-p", "no:cacheprovider",
           "--results-dir", str(tmp_path), "-k", "test_routing and mixtral"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "moe-conformance backend: mine (mine) version mymoe 0.1" in r.stdout
    assert "4 passed" in r.stdout


@pytest.mark.slow  # a subprocess run of the suite: nox -s slow
def test_diagnosis_names_the_stage_and_the_dump_replays(tmp_path):
    dumps = tmp_path / "dumps"
    r = run_conformance("tests.broken_backends:no_router_weights", "-k", "test_experts and qwen3_30b_a3b-fp8_block128-M4-",
                        "--dump-failures", str(dumps), tmp_path=tmp_path)
    assert r.returncode == 1, r.stdout[-3000:]
    assert "divergent stage(s): router_weight (" in r.stdout, r.stdout[-3000:]
    assert "input_quant: matches (per_token_group_quant_fp8 op, bit-exact)" in r.stdout
    dump = dumps / "qwen3_30b_a3b-fp8_block128-M4-ep8r0.pt"
    assert dump.exists()
    # The dump replays: the same failure from the saved inputs, and a correct backend passes on them.
    r = run_conformance("tests.broken_backends:no_router_weights", "--replay", str(dump), "-k",
                        "qwen3_30b_a3b-fp8_block128-M4-", tmp_path=tmp_path)
    assert r.returncode == 1 and "1 failed" in r.stdout
    r = run_conformance("torch", "--replay", str(dump), "-k", "qwen3_30b_a3b-fp8_block128-M4-ep8r0-TorchExperts",
                        tmp_path=tmp_path)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-2000:]


# --- Issue 22 item 7: bug classes that used to pass the whole suite (conformance/test_padding.py, test_hygiene.py) --


@pytest.mark.slow  # a subprocess run of the suite: nox -s slow
@pytest.mark.parametrize("broken,rank,n_cases", [
    ("padding_id_clamped", "ep8r0", 3),  # expert_map[max(id, 0)]: -1 slots go to global expert 0, held by rank 0
    ("padding_id_wraps", "ep8r7", 2),  # expert_map[id] wrapping: -1 slots go to the last expert, held by rank 7
])
def test_padding_id_lookups_fail_the_padding_cases(broken, rank, n_cases, tmp_path):
    # Under 0.17 semantics, so that the chunked padding case (a chunk that routes nothing) runs too.
    r = run_conformance(f"tests.broken_backends:{broken}", "-k", f"test_padding and {rank}", "--vllm-semantics", "0.17",
                        tmp_path=tmp_path)
    assert r.returncode == 1, r.stdout[-3000:]
    assert f"{n_cases} failed" in r.stdout and "passed" not in r.stdout.splitlines()[-1], r.stdout[-3000:]
    assert "output with -1 routes differs from the reference" in r.stdout
    assert f"case: qwen3_30b_a3b-bf16-M16-{rank}-pad" in r.stdout


@pytest.mark.slow  # a subprocess run of the suite: nox -s slow
def test_router_weight_applied_twice_fails_the_weight_on_input_cases(tmp_path):
    r = run_conformance("tests.broken_backends:router_weight_twice", "-k", "test_router_weight_on_input",
                        "--vllm-semantics", "0.17", tmp_path=tmp_path)  # 0.17: the chunked case runs too
    assert r.returncode == 1, r.stdout[-3000:]
    assert "6 failed" in r.stdout and "passed" not in r.stdout.splitlines()[-1], r.stdout[-3000:]
    assert "case: qwen3_30b_a3b_top1-fp8_block128-M16-ep8r0-router-weight-on-input" in r.stdout


@pytest.mark.slow  # a subprocess run of the suite: nox -s slow
def test_torch_backend_passes_the_padding_weight_on_input_and_offsets_selection(tmp_path):
    """The correct backend on the same selections: green; the int32 case is GPU-only and says where its CPU proof
    is (tests/test_offsets_int32.py runs the check red on a planted wrap at a tiny width, green on torch)."""
    r = run_conformance("torch", "-k", "test_padding or test_router_weight_on_input or test_offsets_past_int32",
                        "-rs", "--vllm-semantics", "0.17", tmp_path=tmp_path)  # 0.17: the chunked cases run too
    assert r.returncode == 0, r.stdout[-3000:]
    assert "22 passed, 1 skipped" in r.stdout and "failed" not in r.stdout, r.stdout[-3000:]
    assert "its CPU proof: tests/test_offsets_int32.py" in r.stdout


@pytest.mark.slow  # a subprocess run of the suite: nox -s slow
def test_diagnosis_locates_gemm2_through_the_stages_protocol(tmp_path):
    r = run_conformance("tests.broken_backends:gemm2_wrong_expert", "-k", "test_experts and qwen3_30b_a3b-bf16-M4-",
                        tmp_path=tmp_path)
    assert r.returncode == 1, r.stdout[-3000:]
    assert "divergent stage(s): gemm2 (" in r.stdout, r.stdout[-3000:]
    assert "gemm2: DIVERGES" in r.stdout and "activation: matches" in r.stdout
