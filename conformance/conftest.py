"""pytest plumbing of the conformance suite: backend selection, report header, case generation, known failures,
failure output, progress, per-case JSON results.

The backend is chosen in one place: ``--backend NAME`` (a registered name or ``module:attribute``), else the
``MOE_BACKEND`` environment variable, else ``torch``.

A failing case's ``ConformanceFailure`` message (metric vs bound, worst coordinates, case, reproduce command,
diagnosis) is the whole failure report (the traceback only with ``--tb=long``), the first line of the short summary,
and, parsed, part of its JSON record. A run over the whole suite replaces ``results/conformance-<backend>.json``;
a run with a selection merges into it case by case (``conformance.report.merge``), so re-running one failing case
never destroys the full matrix.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import time
from pathlib import Path

import pytest
import torch

from backends import Backend, BackendNotFound, load_backend
from conformance.metrics import ConformanceFailure
from conformance.workers import share_cores_between_workers
from specs import load_tolerances, load_xfails

_RESULTS: list[dict] = []
_HERE = Path(__file__).resolve().parent


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
    group.addoption("--progress-interval", type=float, default=float(os.environ.get("MOE_PROGRESS_INTERVAL", "30")),
                    help="seconds between progress lines (cases done, outcomes, elapsed); 0 turns them off "
                         "(default: $MOE_PROGRESS_INTERVAL or 30)")
    group.addoption("--model", default=None, metavar="NAME[,NAME...]",
                    help="only cases of these models (specs/models.toml names, e.g. mixtral_8x7b); matched on the "
                         "case's model field, never on test ids (so an experts class named HFMixtralExperts is not "
                         "selected by it); cases without a model are deselected")
    group.addoption("--scheme", default=None, metavar="NAME[,NAME...]",
                    help="only cases of these quantization schemes (specs/schemes.toml names, e.g. bf16, "
                         "fp8_block128); matched on the case's scheme field; cases without one are deselected")
    group.addoption("--M", dest="moe_tokens", default=None, metavar="N[,N...]",
                    help="only cases of these token counts (the case's tokens field); cases without one are "
                         "deselected")
    group.addoption("--vllm-semantics", default=None, choices=("0.17", "0.33"),
                    help="vLLM release whose semantics the reference specifies (reference.semantics; default: "
                         "$MOE_VLLM_SEMANTICS or the newest, 0.33)")
    group.addoption("--numerics-profile", default=None, metavar="NAME",
                    help="judge the experts under this numerics profile (reference.profiles: vllm, "
                         "torch_native_activation, transformers_eager, fp8_inplace_accumulation) instead of the one "
                         "the backend declares (Backend.profile; default: $MOE_NUMERICS_PROFILE or the declared)")


def _backend_spec(config) -> str:
    return config.getoption("--backend") or os.environ.get("MOE_BACKEND") or "torch"


_CONFIG = None


def pytest_configure(config):
    global _CONFIG
    _CONFIG = config
    # Backends that validate routes on the host only on request (a device->host copy their hot path avoids, e.g.
    # DeepGemmExperts, the cuda experts: backends/_validation.py) validate them under the suite, so a bad input
    # raises a clear error here.
    os.environ.setdefault("MOE_VALIDATE_ROUTES", "1")
    share_cores_between_workers()
    chosen = config.getoption("--vllm-semantics", default=None)
    if chosen:
        # The whole run (case generation, every kernel the tests build, xdist workers) reads the version from the
        # environment (reference.semantics.current_semantics), so one option selects it everywhere.
        from reference.semantics import ENV_VAR

        os.environ[ENV_VAR] = chosen
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
        f"  numerics profile: {_profile_line(config, b)}",
    ]


def _profile_line(config, b: Backend) -> str:
    try:
        from conformance.profile_match import declared_profile, judged_profile

        judged, declared = judged_profile(config, b), declared_profile(b)
    except ValueError as exc:
        return f"INVALID: {exc}"
    how = "declared by the backend" if judged == declared else f"selected (the backend declares {declared.name})"
    return f"{judged.name} ({how}; --numerics-profile / $MOE_NUMERICS_PROFILE; reference/profiles.py)"


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


def _case_fields(item) -> dict[str, str]:
    """The selectable fields of an item's case (``--model`` / ``--scheme`` / ``--M``), read from its parameters: a
    case object's ``model`` (a ``ModelSpec`` or its name), ``scheme`` and ``tokens``, or a plain ``scheme`` argument."""
    fields: dict[str, str] = {}
    for name, v in getattr(getattr(item, "callspec", None), "params", {}).items():
        if name == "scheme" and isinstance(v, str):
            fields.setdefault("scheme", v)
            continue
        model = getattr(v, "model", None)
        if model is not None:
            fields.setdefault("model", model if isinstance(model, str) else getattr(model, "name", str(model)))
        for f, key in (("scheme", "scheme"), ("tokens", "M")):
            val = getattr(v, f, None)
            if isinstance(val, (str, int)) and not isinstance(val, bool):
                fields.setdefault(key, str(val))
    return fields


def _case_filter(config, items) -> list:
    """Apply ``--model`` / ``--scheme`` / ``--M``: keep the items whose case carries every given field with one of
    the given values; report the rest as deselected."""
    wanted = {key: {v.strip() for v in raw.split(",") if v.strip()}
              for key, raw in (("model", config.getoption("--model")), ("scheme", config.getoption("--scheme")),
                               ("M", config.getoption("moe_tokens"))) if raw}
    if not wanted:
        return items
    keep, drop = [], []
    for item in items:
        fields = _case_fields(item)
        (keep if all(fields.get(k) in vals for k, vals in wanted.items()) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    return keep


def pytest_collection_modifyitems(config, items):
    items[:] = _case_filter(config, items)
    b: Backend = config._moe_backend
    xfails = load_xfails(b.name)
    used = set()
    for item in items:
        for xf in xfails:
            if item.nodeid.startswith(xf.node_id) or item.nodeid.split("/")[-1].startswith(xf.node_id):
                used.add(xf)
                item.add_marker(pytest.mark.xfail(reason=f"{xf.reason} ({xf.issue})", strict=xf.strict))
    config._moe_unused_xfails = [xf for xf in xfails if xf not in used]


def _selection(config) -> list[str]:
    """What narrows this run to part of the suite (empty: the whole suite)."""
    opt = config.option
    sel = []
    if getattr(opt, "keyword", ""):
        sel.append(f"-k {shlex.quote(opt.keyword)}")
    if getattr(opt, "markexpr", ""):
        sel.append(f"-m {shlex.quote(opt.markexpr)}")
    for d in getattr(opt, "deselect", None) or []:
        sel.append(f"--deselect {shlex.quote(d)}")
    if config.getoption("--replay"):
        sel.append(f"--replay {config.getoption('--replay')}")
    for opt_name, dest in (("--model", "--model"), ("--scheme", "--scheme"), ("--M", "moe_tokens")):
        if config.getoption(dest):
            sel.append(f"{opt_name} {shlex.quote(config.getoption(dest))}")
    if getattr(opt, "lf", False) or getattr(opt, "last_failed", False):
        sel.append("--last-failed")
    invocation = Path(config.invocation_params.dir)
    for arg in config.args:
        path = arg.split("::", 1)[0]
        if "::" in arg or (invocation / path).resolve() != _HERE:
            sel.append(shlex.quote(_plain_nodeid(arg)))
    return sel


def _counts(results: list[dict]) -> dict[str, int]:
    from conformance.report import outcome_counts

    return outcome_counts(results)


def _progress(config, final: bool = False) -> None:
    state = config._moe_progress
    interval = config.getoption("--progress-interval")
    now = time.monotonic()
    if not interval or config.option.verbose > 0 or hasattr(config, "workerinput"):
        return
    if not final and now - state["last"] < interval:
        return
    if final and now - state["start"] < interval:
        return  # a short run: the summary line says it all
    state["last"] = now
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is None:
        return
    c = _counts(_RESULTS)
    total = state["total"]
    elapsed = int(now - state["start"])
    done = len(_RESULTS)
    eta = ""
    if total and done and not final:
        eta = f", about {int(elapsed * (total - done) / done) // 60}:{int(elapsed * (total - done) / done) % 60:02d} left"
    tr.write_line(f"[{config._moe_backend.name}] {done}/{total or '?'} cases done: {c['passed']} ok, {c['failed']} "
                  f"FAIL, {c['skipped']} skip, {c['xfailed']} xfail; {elapsed // 60}:{elapsed % 60:02d} "
                  f"elapsed{eta}")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    session.config._moe_progress = {"start": time.monotonic(), "last": time.monotonic(), "total": 0}


def pytest_collection_finish(session):
    session.config._moe_progress["total"] = len(session.items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    # Under pytest-xdist the controller collects nothing itself; every worker collects the same ids.
    node.config._moe_progress["total"] = len(ids)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    unused = getattr(config, "_moe_unused_xfails", [])
    if unused:
        terminalreporter.section("stale known failures")
        for xf in unused:
            where = os.environ.get("MOE_XFAIL_DIR", "specs/xfail")
            terminalreporter.write_line(f"{where}/{config._moe_backend.name}.toml: {xf.node_id!r} matches no test")
    failed = [e for e in _RESULTS if e["outcome"] == "failed"]
    if failed:
        # pytest's short summary trims the reason to the terminal width; this list keeps it whole.
        terminalreporter.section("failed cases: reason and reproduce command")
        for e in failed:
            f = e.get("failure") or {}
            terminalreporter.write_line(f"{e['nodeid']} - {f.get('headline') or e.get('message', '')}")
            if f.get("diagnosis"):
                terminalreporter.write_line(f"  diagnosis: {f['diagnosis']}")
            if f.get("reproduce"):
                terminalreporter.write_line(f"  reproduce: {f['reproduce']}")
    written = getattr(config, "_moe_written", None)
    if written:
        terminalreporter.write_line(written)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when != "call":
        return report
    if call.excinfo is not None and call.excinfo.errisinstance(ConformanceFailure):
        message = str(call.excinfo.value)
        report.user_properties.append(("failure_message", message))
        if report.failed and item.config.option.tbstyle in ("auto", "short"):
            # The message is the report; the harness's traceback (test body, fixtures) is noise to a kernel
            # engineer. --tb=long brings it back.
            entry = call.excinfo.traceback[-1]
            try:
                where = Path(entry.path).resolve().relative_to(item.config.rootpath)
            except ValueError:
                where = entry.path
            report.longrepr = (f"ConformanceFailure: {message}\n  (raised at {where}:{entry.lineno + 1}; "
                               f"--tb=long shows the traceback)")
    return report


def _failure_message(report) -> str:
    props = dict(report.user_properties)
    if "failure_message" in props:
        return props["failure_message"]
    crash = getattr(report.longrepr, "reprcrash", None)
    text = report.longreprtext if report.longrepr else ""
    if crash is not None:
        return f"{crash.message}\n  at {crash.path}:{crash.lineno}"
    return text[-2000:]


def pytest_runtest_logreport(report):
    # Under pytest-xdist this runs in the controller for every worker's report, including the synthetic failure
    # xdist reports for a test whose worker crashed (segfault, illegal memory access): crash isolation.
    crashed = report.when not in ("setup", "call", "teardown")  # xdist's report for a crashed worker
    if report.when == "call" or crashed or (report.when == "setup" and report.outcome != "passed"):
        from conformance.report import margin, parse_failure

        entry = {"nodeid": _plain_nodeid(report.nodeid), "outcome": report.outcome,
                 "duration_s": round(report.duration, 4)}
        if crashed:
            entry["crashed"] = True
        if hasattr(report, "wasxfail"):
            entry["xfail"] = report.wasxfail
        if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            entry["reason"] = report.longrepr[2]
        entry.update({k: v for k, v in report.user_properties if k != "failure_message"})
        if report.outcome == "failed" or "failure_message" in dict(report.user_properties):
            entry["message"] = _failure_message(report)
            failure = parse_failure(entry["message"])
            entry["failure"] = failure
            for k, v in failure.get("metrics", {}).items():
                entry.setdefault(k, v)
        m = margin(entry)
        if m is not None:
            entry["margin"] = m if math.isfinite(m) else str(m)
        _RESULTS.append(entry)
        if _CONFIG is not None and hasattr(_CONFIG, "_moe_progress"):
            _progress(_CONFIG)


def _semantics(config) -> str | None:
    """The vLLM semantics version the run checked (reference.semantics), for the report header."""
    try:
        from reference.semantics import resolve_semantics

        return str(resolve_semantics(config.getoption("--vllm-semantics")))
    except Exception:  # best effort: an older reference without the module
        return None


def _claims(backend: Backend) -> dict:
    """Each experts class's claims (its SupportRecord, as strings) and the claim dimensions to check for coverage
    (the matrix marks which claimed values had at least one experts case: conformance.report)."""
    out = {}
    for cls in backend.experts:
        rec = getattr(cls, "support", None)
        if rec is None:
            continue
        try:
            from reference.schemes import schemes

            claimed = [n for n, sch in schemes().items() if rec.claims_quant(*sch.quant_keys())]
        except Exception:  # best effort: the matrix then lists the record only
            claimed = []
        out[cls.__name__] = {
            "record": rec.describe(),
            "dimensions": {
                "scheme": claimed,
                "activation": sorted(a.name for a in rec.activations or ()),
                "regime": ["decode", "prefill"],
                "expert_map": ["ep rank 0", "last ep rank"] if rec.expert_map else [],
                "chunking": ["chunked"] if rec.chunking and rec.activation_format.name == "Standard" else [],
            },
        }
    return out


def _nccl_version(backend: Backend, config) -> str | None:
    """NCCL's version when this run used NCCL (distributed cases of a CUDA backend), for the matrix header."""
    if backend.device != "cuda" or not config.getoption("--world-size", default=None) or not torch.cuda.is_available():
        return None
    try:
        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as exc:  # best effort: the header says why it is missing
        return f"unknown ({type(exc).__name__})"


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if not hasattr(config, "_moe_backend") or hasattr(config, "workerinput"):
        return  # xdist workers: the controller writes the file
    b: Backend = config._moe_backend
    counts = _counts(_RESULTS)
    summary_path = os.environ.get("MOE_RUN_SUMMARY")
    if summary_path:  # nox reads it: a run that tested nothing is not reported as a success
        Path(summary_path).write_text(json.dumps({"backend": b.name, "unavailable": b.unavailable_reason(),
                                                  **counts}))
    if not _RESULTS:
        return
    _progress(config, final=True)
    out_dir = Path(config.getoption("--results-dir"))
    out_dir.mkdir(parents=True, exist_ok=True)
    cap = list(torch.cuda.get_device_capability()) if b.device == "cuda" and torch.cuda.is_available() else None
    selection = _selection(config)
    total = config._moe_progress["total"]
    if total and len(_RESULTS) < total:
        selection.append(f"stopped early: {len(_RESULTS)} of {total} collected cases ran")
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    payload = {
        "backend": b.name, "version": b.version, "torch": torch.__version__,
        "device": _device_description(b), "capability": cap,
        "unavailable": b.unavailable_reason(), "time": now, "semantics": _semantics(config),
        "nccl": _nccl_version(b, config),
        "selection": " ".join(selection) or None, "full": not selection,
        "runs": [{"time": now, "selection": " ".join(selection) or None, "cases": len(_RESULTS), **counts}],
        "results": _RESULTS,
        "claims": _claims(b),
    }
    from conformance.report import merge, render

    path = out_dir / f"conformance-{b.name}.json"
    how = "written"
    if selection:
        try:
            old = json.loads(path.read_text()) if path.exists() else None
        except (OSError, ValueError):
            old = None
        merged = merge(old, payload)
        if merged is not payload:
            how = f"{len(_RESULTS)} selected case(s) merged into the existing results"
        payload = merged
    text = json.dumps(payload, indent=1, default=str)
    for target, content in ((path, text), (path.with_suffix(".md"), render(json.loads(text)))):
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        tmp.write_text(content)
        os.replace(tmp, target)
    config._moe_written = f"per-case results ({how}): {path}; matrix: {path.with_suffix('.md')}"
