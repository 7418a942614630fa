"""The one rule, proved both ways: every comparison of an experts or layer output in the suite (experts, padding,
hygiene, distributed) is judged by the error model's bound for that exact case, so

- a conforming-but-noisy kernel passes all of them: ``tests.emulated_backends:noisy`` (every GEMM accumulated in
  fp32 in another order, K tiles of 64 summed last tile first, so the act-dtype roundings after it flip as on a GPU;
  shown below to differ from the reference bitwise), run through the suite as a user would;
- the planted bugs of ``tests/broken_backends.py`` still fail in each test that compares an output: the router
  weights ignored (experts, padding and distributed; with the weight applied on the input it is not the experts'), the router weight applied twice (hygiene),
  padding ids looked up clamped (padding) and the communication faults (distributed).
"""

from __future__ import annotations

import json

import pytest
import torch

from conformance.cases import ExpertsCase
from conformance.hygiene import inputs_error_bound, run_with_reference
from conformance.inputs import make_experts_inputs
from conformance.metrics import error_stats
from specs import load_models
from tests.emulated_backends import NoisyExperts, tile_reversed_gemm
from tests.harness_util import run_conformance

# One selection of every test that compares an experts or layer output (0.17 semantics: the chunked cases run too).
SELECTION = ("(test_experts and qwen3_30b_a3b-bf16-M16-ep8r0 and not (gelu or relu2 or swiglu or no_mul)) "
             "or (test_padding and bf16) or (test_router_weight_on_input and bf16-M16) "
             "or (test_distributed and uneven-bf16-linear)")
FAMILIES = ("test_experts", "test_padding_ids_under_expert_map", "test_router_weight_on_input", "test_distributed")
ARGS = ("--world-size", "2", "--vllm-semantics", "0.17")
TIMEOUT = 1800  # a subprocess run of 8 experts cases and two world-size-2 distributed cases, on busy cores


def _outcomes(tmp_path, name: str) -> dict[str, list[str]]:
    """``{test function: [outcome per case]}`` from the run's results JSON."""
    by_test: dict[str, list[str]] = {}
    for e in json.loads((tmp_path / f"conformance-{name}.json").read_text())["results"]:
        test = e["nodeid"].split("::")[-1].split("[")[0]
        by_test.setdefault(test, []).append(e["outcome"])
    return by_test


@pytest.mark.parametrize("scheme", ["bf16", "fp8_block128"])
def test_the_noisy_backend_is_noisy_and_within_the_bound(scheme):
    """Not vacuous: the noisy GEMM differs from the reference's fp32 matmul, its output differs from the reference's
    bitwise (flipped roundings), and lies within the error model's bound for the case."""
    a, w = torch.randn(32, 2048), torch.randn(96, 2048)
    assert not torch.equal(tile_reversed_gemm(a, w), a @ w.T)
    m = load_models()["qwen3_30b_a3b"]
    case = ExpertsCase(m, scheme, 16, m.cpu_ep_size, 0)
    inputs = make_experts_inputs(case, "cpu")
    out, expected = run_with_reference(NoisyExperts, case, inputs)
    assert (out != expected).any(), "the noisy backend computed the reference bit for bit: it proves nothing"
    s, tol = error_stats(out, expected), inputs_error_bound(NoisyExperts, case, inputs)
    assert s.nonfinite == 0 and s.max_norm <= tol["max_norm"] and s.rms_norm <= tol["rms_norm"], (s, tol)


@pytest.mark.slow  # a subprocess run of the suite: nox -s slow
def test_a_conforming_noisy_backend_passes_every_output_comparison(tmp_path):
    r = run_conformance("tests.emulated_backends:noisy", "-k", SELECTION, *ARGS, tmp_path=tmp_path, timeout=TIMEOUT)
    assert r.returncode == 0, r.stdout[-4000:]
    by_test = _outcomes(tmp_path, "emulated_noisy")
    for family in FAMILIES:
        assert by_test.get(family) and set(by_test[family]) == {"passed"}, (family, by_test)


@pytest.mark.slow  # a subprocess run of the suite: nox -s slow
@pytest.mark.parametrize("planted,name,families", [
    # (with the weight applied on the input, prepare weights the tokens: the experts' weights are not used there)
    ("no_router_weights", "broken_no_router_weights", tuple(f for f in FAMILIES if f != "test_router_weight_on_input")),
    ("router_weight_twice", "broken_router_weight_twice", ("test_router_weight_on_input",)),
    ("padding_id_clamped", "broken_padding_id_clamped", ("test_padding_ids_under_expert_map",)),
    ("dist_planted", "broken_dist_planted", ("test_distributed",)),
])
def test_planted_bugs_still_fail_under_the_one_rule(planted, name, families, tmp_path):
    """The same selection on each planted bug: red, with failures in every family whose comparison the bug reaches."""
    r = run_conformance(f"tests.broken_backends:{planted}", "-k", SELECTION, *ARGS, tmp_path=tmp_path, timeout=TIMEOUT)
    assert r.returncode == 1, r.stdout[-4000:]
    by_test = _outcomes(tmp_path, name)
    for family in families:
        assert "failed" in by_test.get(family, []), (family, by_test)
