"""Claims at the granularity of the tests: the variants the suite exercises that vLLM's quant keys do not name
(``SupportRecord.activation_params``: alpha / beta / limit; ``SupportRecord.ue8m0_scales``) can be claimed or
declined; an unclaimed variant is a skip with its reason (the kernel never called), a ``NotImplementedError`` on a
claimed one a failure. And case selection by the case's fields (``--model`` / ``--scheme`` / ``--M``), which an
experts class named after a model does not confuse."""

from __future__ import annotations

import json

import pytest

from backends.torch.experts import TorchBatchedExperts, TorchExperts
from backends.triton.experts import TritonExperts
from reference.activation import MoEActivation
from reference.config import fp8_w8a8_moe_quant_config
from reference.experts import ReferenceExperts
from reference.modular import ACTIVATION_PARAMS, FusedMoEActivationFormat, SupportRecord
from tests.harness_util import run_conformance

A = MoEActivation
STD = FusedMoEActivationFormat.Standard


def test_variants_are_opt_in_and_named():
    plain = SupportRecord(STD, activations=frozenset({A.SILU}))
    assert plain.variant_reason(A.SILU) is None
    assert "SILU with limit" in plain.variant_reason(A.SILU, params=("limit",))
    assert "UE8M0" in plain.variant_reason(A.SILU, ue8m0=True)
    qc = fp8_w8a8_moe_quant_config(None, None, block_shape=[128, 128], use_ue8m0=True, gemm1_alpha=1.702)
    assert "alpha" in plain.variant_reason(A.SWIGLUOAI, qc)
    every = SupportRecord(STD, activation_params=ACTIVATION_PARAMS, ue8m0_scales=True)
    assert every.variant_reason(A.SWIGLUOAI, qc, params=("limit", "beta")) is None
    one = SupportRecord(STD, activation_params=frozenset({(A.SWIGLUOAI, "limit")}))
    assert one.variant_reason(A.SWIGLUOAI, params=("limit",)) is None
    assert one.variant_reason(A.SILU, params=("limit",)) is not None
    with pytest.raises(ValueError, match="unknown activation parameters"):
        plain.variant_reason(A.SILU, params=("clamp",))
    assert plain.describe()["activation params"] == "none" and every.describe()["activation params"] == "any"


@pytest.mark.parametrize("cls", [TorchExperts, TorchBatchedExperts, TritonExperts, ReferenceExperts])
def test_builtin_classes_keep_claiming_every_variant(cls):
    assert cls.support.activation_params == ACTIVATION_PARAMS and cls.support.ue8m0_scales


def _outcomes(tmp_path, name):
    return {e["nodeid"].split("::")[-1]: e for e in
            json.loads((tmp_path / f"conformance-{name}.json").read_text())["results"]}


SELECTION = "(test_activation and silu-bfloat16-M33) or (test_experts and fp8_block128_ue8m0-M4-)"


@pytest.mark.slow  # a subprocess run of the suite: nox -s slow
def test_unclaimed_variants_are_skipped_with_the_reason(tmp_path):
    r = run_conformance("tests.broken_backends:declines_variants", "-k", SELECTION, "-rs", tmp_path=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:]
    res = _outcomes(tmp_path, "declines_variants")
    limit = [e for n, e in res.items() if "limit" in n]
    ue8m0 = [e for n, e in res.items() if "ue8m0" in n]
    assert limit and ue8m0, sorted(res)
    assert all(e["outcome"] == "skipped" for e in limit + ue8m0), limit + ue8m0
    assert "unclaimed variant" in r.stdout and "SupportRecord.activation_params" in r.stdout
    assert "SupportRecord.ue8m0_scales" in r.stdout
    assert any(e["outcome"] == "passed" for n, e in res.items() if "limit" not in n)  # plain SiLU still runs


@pytest.mark.slow  # a subprocess run of the suite: nox -s slow
def test_not_implemented_on_a_claimed_variant_fails(tmp_path):
    r = run_conformance("tests.broken_backends:claims_variants_raises", "-k", SELECTION, tmp_path=tmp_path)
    assert r.returncode == 1, r.stdout[-3000:]
    res = _outcomes(tmp_path, "claims_variants_raises")
    assert all(e["outcome"] == "failed" for n, e in res.items() if "limit" in n or "ue8m0" in n), res
    assert "NotImplementedError" in r.stdout


@pytest.mark.slow  # a collection of the suite in a subprocess
def test_model_and_scheme_options_select_by_the_case_fields(tmp_path):
    """A class named after a model (HFMixtralExperts): ``-k "mixtral and bf16"`` also selects its Qwen3 cases;
    ``--model mixtral_8x7b --scheme bf16`` selects Mixtral bf16 cases only, of both classes."""
    backend = "tests.emulated_backends:hf_named"
    by_k = run_conformance(backend, "-k", "test_experts and mixtral and bf16", "--collect-only", tmp_path=tmp_path)
    by_opt = run_conformance(backend, "--model", "mixtral_8x7b", "--scheme", "bf16", "--M", "4,16",
                             "--collect-only", tmp_path=tmp_path)
    ids_k = [ln for ln in by_k.stdout.splitlines() if "::test_" in ln]
    ids_opt = [ln for ln in by_opt.stdout.splitlines() if "::test_" in ln]
    assert any("qwen3" in i for i in ids_k), ids_k  # the id-substring collision this option avoids
    assert ids_opt and all("mixtral_8x7b-bf16-M4-" in i or "mixtral_8x7b-bf16-M16-" in i for i in ids_opt), ids_opt
    assert {i.rsplit("-", 1)[-1] for i in ids_opt if "test_experts" in i} == {"TorchExperts]", "HFMixtralExperts]"}
