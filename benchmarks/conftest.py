"""pytest plumbing of the benchmark suite (docs/BENCHMARKS.md).

- Baselines per GPU: pytest-benchmark's machine id ignores the GPU, so unless ``--benchmark-storage`` is given the
  storage is ``benchmarks/baselines/<gpu-slug>`` (``nvidia-h100-80gb-hbm3``, ``nvidia-h200``, ``cpu``), chosen here
  before pytest-benchmark opens it. ``--bench-gate`` compares with the latest saved run there and fails on a median
  slower by more than 10% (``--benchmark-compare --benchmark-compare-fail=median:10%``; the threshold is
  ``--bench-gate-threshold``). Refresh a baseline on purpose with ``--benchmark-save=<name>`` or
  ``--benchmark-autosave``.
- ``ceilings`` (session fixture): copy bandwidth and matmul throughputs, measured once per run on the benchmark
  device; every result's roofline floor uses them, and they are recorded with the results.
- At the end: the side-by-side table (ratios to the best backend and to the floor) is printed last and written to
  ``results/benchmark-<gpu-slug>.md`` and ``.json`` (``--bench-results-dir`` / ``MOE_BENCH_RESULTS_DIR`` move them),
  with the roofline plot ``.png`` when matplotlib is importable (else ``python -m benchmarks.plot <json>``).
"""

from __future__ import annotations

import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from benchmarks import harness, report, timing

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
_RUN: dict = {"notes": [], "t0": time.time()}


def pytest_addoption(parser):
    g = parser.getgroup("moe-benchmarks", "fused-MoE benchmark suite")
    g.addoption("--bench-results-dir", default=None,
                help="where benchmark-<gpu>.md/.json/.png go (default: $MOE_BENCH_RESULTS_DIR or <repo>/results)")
    g.addoption("--bench-gate", action="store_true", default=False,
                help="compare with the latest baseline of this GPU (benchmarks/baselines/<gpu>) and fail on a "
                     "regression beyond --bench-gate-threshold")
    g.addoption("--bench-gate-threshold", default="median:10%",
                help="pytest-benchmark --benchmark-compare-fail expression for --bench-gate (default median:10%%)")


def _user_gave(config, option: str) -> bool:
    return any(str(a) == option or str(a).startswith(option + "=") for a in config.invocation_params.args)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # Runs before pytest-benchmark's own pytest_configure (trylast), which opens the storage.
    import torch

    if not torch.cuda.is_available():
        # One thread: CPU timings on a shared machine are far steadier (two threads time-share with any other job).
        torch.set_num_threads(int(os.environ.get("MOE_BENCH_CPU_THREADS", "1")))
    info = timing.device_info()
    _RUN["device"] = info
    if not _user_gave(config, "--benchmark-storage") and hasattr(config.option, "benchmark_storage"):
        config.option.benchmark_storage = "file://" + str(BENCH_DIR / "baselines" / info["slug"])
    storage = str(getattr(config.option, "benchmark_storage", "")).removeprefix("file://")
    _RUN["storage"] = storage
    if config.getoption("bench_gate", False):
        from pytest_benchmark.utils import parse_compare_fail

        saved = sorted(Path(storage).glob("*/*.json")) if storage else []
        if saved:
            if not config.option.benchmark_compare:
                config.option.benchmark_compare = True  # the latest saved run
            config.option.benchmark_compare_fail = [parse_compare_fail(config.getoption("bench_gate_threshold"))]
            _RUN["notes"].append(f"gate: comparing with {saved[-1]} ({config.getoption('bench_gate_threshold')})")
        else:
            _RUN["notes"].append(
                f"gate: no baseline in {storage} for {info['name']}: nothing to compare; save one with "
                "--benchmark-save=<name> (see docs/BENCHMARKS.md)")


def pytest_report_header(config):
    info = _RUN.get("device", {})
    lines = [f"moe-benchmarks: device {info.get('name')} (slug {info.get('slug')}), torch {info.get('torch')}"
             + (f", CUDA {info['cuda']}" if info.get("cuda") else ""),
             f"  baselines: {_RUN.get('storage')}"]
    lines += [f"  {n}" for n in _RUN["notes"]]
    return lines


def pytest_benchmark_update_machine_info(config, machine_info):
    info = _RUN.get("device", {})
    machine_info["moe_device"] = {k: info.get(k) for k in ("name", "slug", "capability", "sm_count", "cuda", "torch")}


@pytest.fixture(scope="session")
def device():
    return harness.bench_device()


@pytest.fixture(scope="session")
def device_info():
    return _RUN["device"]


@pytest.fixture(scope="session")
def ceilings(device):
    c = timing.measure_ceilings(device)
    c["l2_bytes"] = _RUN["device"].get("l2_bytes", 50 * 2**20)
    _RUN["ceilings"] = c
    return c


@pytest.fixture(scope="session")
def settings():
    return timing.Settings.from_env(harness.on_gpu())


def _results_dir(config) -> Path:
    opt = config.getoption("bench_results_dir", None) or os.environ.get("MOE_BENCH_RESULTS_DIR")
    return Path(opt) if opt else REPO / "results"


def _program() -> str:
    return "python -m pytest" if sys.argv[0].endswith("__main__.py") else os.path.basename(sys.argv[0])


def pytest_sessionfinish(session, exitstatus):
    recs = harness.RESULTS["records"]
    if not recs:
        return
    info = _RUN.get("device", {})
    doc = {
        "device": info,
        "datetime": datetime.now(timezone.utc).isoformat(),
        "command": " ".join([_program()] + [str(a) for a in session.config.invocation_params.args]),
        "env": {k: v for k, v in os.environ.items() if k.startswith("MOE_BENCH_")},
        "wall_s": round(time.time() - _RUN["t0"], 1),
        "ceilings": _RUN.get("ceilings", {}),
        "backends": harness.RESULTS["backends"],
        "results": report.finalize(recs),
        "skipped": harness.RESULTS["skipped"],
    }
    out_dir = _results_dir(session.config)
    try:
        jpath, mpath = report.write(doc, out_dir, info.get("slug", "unknown"))
    except OSError as exc:
        _RUN["notes"].append(f"could not write results to {out_dir}: {exc}")
        _RUN["doc"] = doc
        return
    _RUN["doc"], _RUN["paths"] = doc, [jpath, mpath]
    try:
        from benchmarks import plot

        _RUN["paths"].append(plot.plot_file(jpath))
    except ImportError:
        _RUN["notes"].append(f"no matplotlib here: make the plot with `python -m benchmarks.plot {jpath}`")
    except Exception as exc:  # a plot failure must not hide the table
        _RUN["notes"].append(f"plot failed: {type(exc).__name__}: {exc}")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # Outermost wrapper: its finally runs after every other summary (pytest-benchmark's table, -ra): printed last,
    # also when the regression gate fails.
    try:
        return (yield)
    finally:
        doc = _RUN.get("doc")
        if doc is not None:
            tr = terminalreporter
            tr.section("fused-MoE benchmarks side by side", sep="=", bold=True)
            tr.write_line(report.render_markdown(doc))
            for p in _RUN.get("paths", []):
                tr.write_line(f"written: {p}")
            for n in _RUN["notes"]:
                tr.write_line(n)
