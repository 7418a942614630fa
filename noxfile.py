"""Sessions of the MoE conformance harness. ``nox -l`` lists them.

    nox -s conformance                 every built-in backend; those unavailable here are skipped with the reason
    nox -s "conformance(torch)"        one backend (arguments after -- go to pytest: -k, -x, --results-dir ...)
    nox -s tests                       the reference and the harness against independent oracles
    nox -s benchmark                   pytest-benchmark suite (GPU figures need a GPU)

On a machine whose Python already has torch (the GPU machine), add ``--no-venv`` to run any session in the current
interpreter without installing anything: ``nox --no-venv -s "conformance(triton)"``.

Environment: ``MOE_TORCH_SPEC`` (default ``torch==2.13.0``, which the CPU machines install from local disk in
seconds) is installed first so that pip never pulls a multi-GB CUDA build as a dependency.
"""

from __future__ import annotations

import os

import nox
from nox.virtualenv import PassthroughEnv

nox.options.sessions = ["conformance", "tests"]
nox.options.reuse_existing_virtualenvs = True

# Sessions run on the interpreter that runs nox (3.11 on the CPU machines, 3.12 on the GPU machine).
TORCH_SPEC = os.environ.get("MOE_TORCH_SPEC", "torch==2.13.0")
TRITON_SPEC = os.environ.get("MOE_TRITON_SPEC", "triton==3.6.0")
BACKENDS = ["torch", "triton", "deep_gemm", "cuda"]
# Optional dependencies of each backend (pyproject extras).
EXTRAS = {"triton": "triton", "deep_gemm": "deep_gemm"}

PROBE = """
import sys
from backends import load_backend
reason = load_backend(sys.argv[1]).unavailable_reason()
print("AVAILABLE" if reason is None else "UNAVAILABLE: " + reason)
"""


def _passthrough(session: nox.Session) -> bool:
    return isinstance(session.virtualenv, PassthroughEnv)


def _install(session: nox.Session, extras: str = "test") -> None:
    if _passthrough(session):
        return  # --no-venv: use what the interpreter has
    session.install(TORCH_SPEC)
    session.install("-e", f".[{extras}]")


def _unavailable(session: nox.Session, backend: str) -> str | None:
    out = session.run("python", "-c", PROBE, backend, silent=True) or ""
    line = out.strip().splitlines()[-1] if out.strip() else "UNAVAILABLE: probe printed nothing"
    return None if line == "AVAILABLE" else line.removeprefix("UNAVAILABLE: ")


@nox.session
@nox.parametrize("backend", BACKENDS, ids=BACKENDS)
def conformance(session: nox.Session, backend: str) -> None:
    """Run the conformance suite of one backend against the reference (skipped with the reason if unavailable)."""
    _install(session)
    # Probe before installing the backend's own packages: a machine without a GPU skips without downloading them.
    reason = _unavailable(session, backend)
    if reason is not None and backend in EXTRAS and not _passthrough(session) and "not installed" in reason:
        session.install("-e", f".[test,{EXTRAS[backend]}]")
        reason = _unavailable(session, backend)
    if reason is not None:
        session.skip(f"backend {backend} unavailable: {reason}")
    # Worker processes (pytest-xdist) isolate crashes: a segfault or illegal memory access fails that case, the
    # worker restarts and the run goes on. MOE_CONFORMANCE_WORKERS=0 runs in-process (for debuggers).
    workers = os.environ.get("MOE_CONFORMANCE_WORKERS", "2")
    # worksteal hands each worker a contiguous half of the cases (cases of one model share cached weights) and
    # reports a crashed case once (loadgroup/loadfile re-queue it).
    xdist = ["-n", workers, "--dist", "worksteal", "--max-worker-restart", "1000"] if workers != "0" else []
    session.run("python", "-m", "pytest", "conformance", "--backend", backend, "-p", "no:cacheprovider",
                *xdist, *session.posargs)


@nox.session
def tests(session: nox.Session) -> None:
    """Test the reference against independent oracles, and the harness (it must go red for broken backends)."""
    _install(session, "test,plot")
    if not _passthrough(session):
        # The Triton kernels run under TRITON_INTERPRET=1 on CPU (tests/test_triton_interpret.py); same Triton as
        # the GPU machine.
        session.install(TRITON_SPEC)
    session.run("python", "-m", "pytest", "tests", "-p", "no:cacheprovider", *session.posargs)


@nox.session
def benchmark(session: nox.Session) -> None:
    """pytest-benchmark suite; pass --benchmark-compare etc. after --."""
    _install(session, "test,plot")
    session.run("python", "-m", "pytest", "benchmarks", "-p", "no:cacheprovider", *session.posargs)


@nox.session(default=False)
@nox.parametrize("backend", BACKENDS[1:], ids=BACKENDS[1:])
def sanitizer(session: nox.Session, backend: str) -> None:
    """A subset of a GPU backend's conformance under compute-sanitizer memcheck (GPU machine; slow)."""
    _install(session)
    reason = _unavailable(session, backend)
    if reason is not None:
        session.skip(f"backend {backend} unavailable: {reason}")
    selection = session.posargs or ["-k", "(test_experts and qwen3_30b_a3b and (M4- or M64-)) or test_quantizer"]
    session.run("compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "99", "--target-processes", "all",
                "python", "-m", "pytest", "conformance", "--backend", backend, "-p", "no:cacheprovider", "-x",
                *selection, external=True)
