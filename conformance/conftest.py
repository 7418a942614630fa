"""pytest plumbing of the conformance suite: backend selection, report header, case generation, known failures,
per-case JSON results.

The backend is chosen in one place: ``--backend NAME`` (a registered name or ``module:attribute``), else the
``MOE_BACKEND`` environment variable, else ``torch``.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import time
from pathlib import Path

import pytest
import torch

from backends import Backend, BackendNotFound, load_backend
from specs import load_tolerances, load_xfails

_RESULTS: list[dict] = []


def pytest_addoption(parser):
    group = parser.getgroup("moe-conformance")
    group.addoption("--backend", default=None,
                    help="backend under test: a registered name or module:attribute (default: $MOE_BACKEND or torch)")
    group.addoption("--dump-failures", default=None, metavar="DIR",
                    help="save the inputs, output and diagnosis of each failing experts case to DIR/<case>.pt")
    group.addoption("--replay", default=None, metavar="FILE",
                    help="run an experts case on the inputs saved by --dump-failures instead of drawing them")
    group.addoption("--world-size", default=None, metavar="N[,N...]",
                    help="run conformance/test_distributed.py over N spawned ranks (gloo on CPU, NCCL with one GPU "
                         "per rank); comma-separated for several world sizes")
    group.addoption("--results-dir", default=os.environ.get("MOE_RESULTS_DIR", "results"),
                    help="where per-case JSON results are written (default: results/)")
    group.addoption("--vllm-semantics", default=None, choices=("0.17", "0.33"),
                    help="vLLM release whose semantics the reference specifies (reference.semantics; default: "
                         "$MOE_VLLM_SEMANTICS or the newest, 0.33)")


def _backend_spec(config) -> str:
    return config.getoption("--backend") or os.environ.get("MOE_BACKEND") or "torch"


def pytest_configure(config):
    spec = _backend_spec(config)
    try:
        config._moe_backend = load_backend(spec)
    except BackendNotFound as exc:
        raise pytest.UsageError(str(exc)) from None
    config._moe_backend_spec = spec


def _device_description(backend: Backend) -> str:
    if backend.device == "cuda" and torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        return f"{torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]})"
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def pytest_report_header(config):
    b: Backend = config._moe_backend
    reason = b.unavailable_reason()
    return [
        f"moe-conformance backend: {b.name} ({config._moe_backend_spec}) version {b.version}",
        f"  {b.description}" if b.description else "  (no description)",
        f"  torch {torch.__version__}; device: {_device_description(b)}",
        f"  ops: {', '.join(sorted(b.ops)) or '-'}; experts: {', '.join(c.__name__ for c in b.experts) or '-'}",
        "  status: available" if reason is None else f"  status: UNAVAILABLE - {reason} (every case is skipped)",
        "  vLLM semantics: "  # the version the routing reference checks (conformance/test_routing.py applies it)
        f"{__import__('reference.semantics').semantics.resolve_semantics(config.getoption('--vllm-semantics'))}"
        " (--vllm-semantics / $MOE_VLLM_SEMANTICS; python -m reference.semantics lists the points)",
    ]


@pytest.fixture(scope="session")
def backend(request) -> Backend:
    b: Backend = request.config._moe_backend
    reason = b.unavailable_reason()
    if reason is not None:
        pytest.skip(f"backend {b.name} unavailable: {reason}")
    return b


@pytest.fixture(scope="session")
def tolerances() -> dict:
    return load_tolerances()


def _plain_nodeid(nodeid: str) -> str:
    """The node id without pytest-xdist's ``@group`` suffix (``--dist loadgroup``), so it can be re-run as is."""
    return nodeid.split("@", 1)[0]


@pytest.fixture
def repro(request) -> str:
    """One-line command that re-runs exactly this case."""
    spec = request.config._moe_backend_spec
    return f"python -m pytest {shlex.quote(_plain_nodeid(request.node.nodeid))} --backend {shlex.quote(spec)}"


@pytest.fixture
def record(request):
    """``record(key=value, ...)`` attaches metrics to this case's JSON result."""

    def _record(**kw):
        request.node.user_properties.extend(kw.items())

    return _record


def pytest_collection_modifyitems(config, items):
    b: Backend = config._moe_backend
    xfails = load_xfails(b.name)
    used = set()
    for item in items:
        for xf in xfails:
            if item.nodeid.startswith(xf.node_id) or item.nodeid.split("/")[-1].startswith(xf.node_id):
                used.add(xf)
                item.add_marker(pytest.mark.xfail(reason=f"{xf.reason} ({xf.issue})", strict=xf.strict))
    config._moe_unused_xfails = [xf for xf in xfails if xf not in used]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    unused = getattr(config, "_moe_unused_xfails", [])
    if unused:
        terminalreporter.section("stale known failures")
        for xf in unused:
            where = os.environ.get("MOE_XFAIL_DIR", "specs/xfail")
            terminalreporter.write_line(f"{where}/{config._moe_backend.name}.toml: {xf.node_id!r} matches no test")
    if _RESULTS:
        path = Path(config.getoption("--results-dir")) / f"conformance-{config._moe_backend.name}"
        terminalreporter.write_line(f"per-case results: {path}.json; matrix: {path}.md")


def pytest_runtest_logreport(report):
    # Under pytest-xdist this runs in the controller for every worker's report, including the synthetic failure
    # xdist reports for a test whose worker crashed (segfault, illegal memory access): crash isolation.
    crashed = report.when not in ("setup", "call", "teardown")  # xdist's report for a crashed worker
    if report.when == "call" or crashed or (report.when == "setup" and report.outcome != "passed"):
        entry = {"nodeid": _plain_nodeid(report.nodeid), "outcome": report.outcome,
                 "duration_s": round(report.duration, 4)}
        if crashed:
            entry["crashed"] = True
        if hasattr(report, "wasxfail"):
            entry["xfail"] = report.wasxfail
        if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            entry["reason"] = report.longrepr[2]
        elif report.outcome == "failed":
            entry["message"] = str(report.longrepr).splitlines()[-1][:500] if report.longrepr else ""
        entry.update({k: v for k, v in report.user_properties})
        _RESULTS.append(entry)


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if not _RESULTS or not hasattr(config, "_moe_backend") or hasattr(config, "workerinput"):
        return  # xdist workers: the controller writes the file
    b: Backend = config._moe_backend
    out_dir = Path(config.getoption("--results-dir"))
    out_dir.mkdir(parents=True, exist_ok=True)
    cap = list(torch.cuda.get_device_capability()) if b.device == "cuda" and torch.cuda.is_available() else None
    payload = {
        "backend": b.name, "version": b.version, "torch": torch.__version__,
        "device": _device_description(b), "capability": cap,
        "unavailable": b.unavailable_reason(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "results": _RESULTS,
    }
    (out_dir / f"conformance-{b.name}.json").write_text(json.dumps(payload, indent=1, default=str))
    from conformance.report import render

    (out_dir / f"conformance-{b.name}.md").write_text(render(json.loads(json.dumps(payload, default=str))))
