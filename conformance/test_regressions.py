"""Replay of ``specs/regressions.toml``: cases that once failed somewhere (issue 22's GPU findings, and every shrunk
failure of ``python -m conformance.fuzz``), run on every experts class of the backend for ever. A claimed case must
match the reference within the error model's bound; an unclaimed one must raise (``conformance.fuzz.check_case``)."""

from __future__ import annotations

import pytest

from conformance.fuzz import check_case, load_regressions
from conformance.metrics import ConformanceFailure


def pytest_generate_tests(metafunc):
    if "regression" in metafunc.fixturenames:
        classes = list(metafunc.config._moe_backend.experts) or [None]
        cases = load_regressions()
        metafunc.parametrize(("experts_cls", "regression"),
                             [pytest.param(cls, fc, id=f"{fc.id}-{getattr(cls, '__name__', 'none')}")
                              for fc in cases for cls in classes])


def test_regression(backend, experts_cls, regression, record, request):
    if experts_cls is None:
        pytest.skip(f"backend {backend.name} offers no experts implementation")
    record(component="regression", model=f"E{regression.E}-K{regression.K}-I{regression.I}",
           scheme=regression.scheme, tokens=regression.M, experts_class=experts_cls.__name__)
    from conformance.profile_match import judged_profile

    profile = judged_profile(request.config, backend, experts_cls)
    o = check_case(experts_cls, regression, backend.device, profile=profile)
    if o.kind == "refused":
        record(support="unsupported", reason=o.detail)
        if o.detail.startswith("unclaimed variant"):
            pytest.skip(o.detail)
        pytest.skip(f"unsupported, and raises as required: {o.detail}")
    if o.kind == "failed":
        raise ConformanceFailure(f"{experts_cls.__name__} fails regression case {regression.id}: {o.detail}\n"
                                 f"  reproduce: {regression.repro(request.config._moe_backend_spec)}")
