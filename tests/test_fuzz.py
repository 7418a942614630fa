"""The fuzz (``conformance/fuzz.py``) on planted backends: it finds a wrong kernel and an unclaimed configuration that
returns a tensor, writes the shrunk case as a replayable regression, keeps its draws inside the claims, and gives a
class that cannot run on this device only a short refusal check."""

from __future__ import annotations

import dataclasses
import tomllib

import pytest

pytest.importorskip("hypothesis")

from conformance import fuzz  # noqa: E402
from tests import broken_backends as bb  # noqa: E402


def test_fuzz_finds_a_wrong_kernel_and_writes_a_replayable_regression(tmp_path):
    reg = tmp_path / "regressions.toml"
    fig = fuzz.fuzz_class(bb._NoRouterWeights, "broken", "cpu", budget_s=20.0, seed=0, regressions=reg,
                          log=lambda *_: None)
    assert fig["failed"] >= 1, fig
    entries = tomllib.loads(reg.read_text())["experts"]
    case = fuzz.FuzzCase(**entries[0])
    assert fuzz.check_case(bb._NoRouterWeights, case, "cpu").kind == "failed"
    assert fuzz.check_case(bb.TorchExperts, case, "cpu").kind == "passed"  # the case itself is a fair one


class _GarbageClaimsBf16Only(bb._GarbageWhenUnsupported):
    """Returns zeros for what it does not claim, and claims only unquantized experts: an unclaimed draw (any
    quantized scheme) is likely in every few draws, whatever hypothesis picks."""

    support = dataclasses.replace(bb.TorchExperts.support, quant_schemes=frozenset({(None, None)}))


def test_fuzz_finds_an_unclaimed_configuration_that_returns_a_tensor(tmp_path):
    # A time budget, not a draw count: hypothesis starts from its simplest draws (inside the claims), so the budget
    # must hold enough draws for the two in ten outside them on a loaded 2-core machine (28 draws in 20 s was not).
    fig = fuzz.fuzz_class(_GarbageClaimsBf16Only, "broken", "cpu", budget_s=45.0, seed=0, regressions=None,
                          log=lambda *_: None)
    assert fig["failed"] >= 1 and any("instead of raising" in d for _, d in fig["failures"]), fig


class _OnlyBf16Silu(bb.TorchExperts):
    from reference.activation import MoEActivation as _A

    support = dataclasses.replace(bb.TorchExperts.support, quant_schemes=frozenset({(None, None)}),
                                  activations=frozenset({_A.SILU}))


def test_draws_stay_mostly_inside_the_claims():
    from hypothesis import HealthCheck, given, settings

    seen = []

    @settings(max_examples=200, database=None, suppress_health_check=list(HealthCheck), deadline=None)
    @given(fuzz._strategy(_OnlyBf16Silu))
    def collect(fc):
        seen.append(fc)

    collect()
    inside = [fc for fc in seen if fuzz.claim_of(_OnlyBf16Silu, fc)[0]]
    assert len(inside) >= 0.5 * len(seen), (len(inside), len(seen))
    outside = [fc for fc in seen if fc not in inside]
    assert outside, "no unclaimed draw: the refusal is never checked"
    assert all(fc.K <= 256 and fc.I <= 128 and fc.M <= 33 for fc in outside if fc.scheme != "bf16")


def test_a_class_without_a_device_gets_a_short_refusal_check(monkeypatch, capsys):
    class _NoDevice(bb.TorchExperts):
        support = dataclasses.replace(bb.TorchExperts.support, device=lambda: "needs a GPU that is not here")

    backend = dataclasses.replace(bb._torch, name="no_device", experts=[_NoDevice, bb.TorchExperts])
    budgets = {}
    real = fuzz.fuzz_class

    def spy(cls, name, device, budget_s, *a, **k):
        budgets[cls.__name__] = budget_s
        return real(cls, name, device, 0.5, *a, **k)

    monkeypatch.setattr(fuzz, "fuzz_class", spy)
    monkeypatch.setattr("backends.load_backend", lambda name: backend)
    assert fuzz.main(["--backend", "x", "--budget", "100", "--regressions", ""]) == 0
    assert budgets == {"_NoDevice": 10.0, "TorchExperts": 90.0}
    assert "fuzz:" in capsys.readouterr().out
