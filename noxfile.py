"""Sessions of the MoE conformance harness. ``nox -l`` lists them.

    nox -s conformance                 every built-in backend; those unavailable here are skipped with the reason
    nox -s "conformance(torch)"        one backend (arguments after -- go to pytest: -k, -x, --results-dir ...)
    nox -s conformance -- --backend X  only X's session runs (the others say they were not selected); an
                                       out-of-tree ``module:attribute`` runs in conformance(torch)'s environment
    nox -s tests                       the reference and the harness against independent oracles (2 workers),
                                       every test not marked slow
    nox -s slow                        the tests marked slow (subprocess runs of the suite, the interpreter)
    nox -s benchmark                   pytest-benchmark suite (GPU figures need a GPU)
    nox -s dev                         a development environment in .venv for the commands run without nox

The conformance sessions come from the backend registry (``backends.registered_backends()``: ``BUILTIN`` plus the
entry points installed in nox's interpreter); ``plan_conformance`` (a pure function, tests/test_noxfile.py) decides
what each session does with the arguments after ``--``. A GPU backend's session on a machine without an NVIDIA GPU
skips before installing anything.

On a machine whose Python already has torch (the GPU machine), add ``--no-venv`` to run any session in the current
interpreter without installing anything: ``nox --no-venv -s "conformance(triton)"``.

Environment: ``MOE_TORCH_SPEC`` (default ``torch==2.13.0``, which the CPU machines install from local disk in
seconds) is installed first so that pip never pulls a multi-GB CUDA build as a dependency.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import nox
from nox.virtualenv import PassthroughEnv

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The registry module imports only the standard library (no torch): safe in nox's own interpreter.
from backends import BUILTIN, BUILTIN_NEEDS, BuiltinNeeds, registered_backends  # noqa: E402

nox.options.sessions = ["conformance", "tests"]
nox.options.reuse_existing_virtualenvs = True

# Sessions run on the interpreter that runs nox (3.11 on the CPU machines, 3.12 on the GPU machine).
TORCH_SPEC = os.environ.get("MOE_TORCH_SPEC", "torch==2.13.0")
TRITON_SPEC = os.environ.get("MOE_TRITON_SPEC", "triton==3.6.0")
# One conformance session per registered backend (built-in first); out-of-tree ``--backend module:attr`` runs in
# the session of HOST_BACKEND.
BACKENDS = list(registered_backends())
GPU_BACKENDS = [b for b in BUILTIN if BUILTIN_NEEDS[b].cuda]
HOST_BACKEND = "torch"

# Prints one JSON line: {"kind": null} when available, else the typed reason (backends.Unavailable) or not_found.
PROBE = """
import json, sys
from backends import BackendNotFound, Unavailable, load_backend
try:
    status = load_backend(sys.argv[1]).availability_status()
except BackendNotFound as exc:
    status = Unavailable(str(exc)); status.kind = "not_found"
print(json.dumps({"kind": None} if status is None else status.as_dict()))
"""


@dataclass(frozen=True)
class Plan:
    """What one ``conformance(<session>)`` session does: run pytest for ``backend`` with ``pytest_args``, or skip
    saying ``reason``."""

    run: bool
    backend: str | None = None
    pytest_args: tuple[str, ...] = ()
    reason: str = ""
    error: bool = False  # the session fails with ``reason`` (an unknown backend), before installing anything


def split_backend_arg(posargs: Sequence[str]) -> tuple[str | None, list[str]]:
    """``--backend X`` / ``--backend=X`` taken out of the arguments after ``--`` (the last one wins)."""
    backend, rest, args = None, [], list(posargs)
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--backend" and i + 1 < len(args):
            backend, i = args[i + 1], i + 2
            continue
        if a.startswith("--backend="):
            backend = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return backend, rest


def plan_conformance(session_backend: str, posargs: Sequence[str], sessions: Sequence[str] = tuple(BACKENDS),
                     host: str = HOST_BACKEND) -> Plan:
    """Map the arguments after ``--`` to what the session of ``session_backend`` does.

    Without ``--backend`` every session runs its own backend. ``--backend X`` where X has a session: only that one
    runs. An out-of-tree ``module:attribute`` runs in the ``host`` session's environment under its own name; the
    other sessions skip, saying where it runs. Any other name is unknown: the host session fails saying so.
    """
    wanted, rest = split_backend_arg(posargs)
    if wanted is None or wanted == session_backend:
        return Plan(True, session_backend, tuple(rest))
    if wanted in sessions:
        return Plan(False, reason=f"not selected: --backend {wanted} runs in conformance({wanted})")
    if session_backend == host:
        if ":" not in wanted:
            return Plan(False, wanted, reason=f"--backend {wanted}: unknown backend {wanted!r}; registered: "
                        f"{', '.join(sorted(sessions))}, or pass 'module:attribute'", error=True)
        return Plan(True, wanted, tuple(rest))
    return Plan(False, reason=f"not selected: --backend {wanted} runs in conformance({host})'s environment")


def gpu_absent_reason(dev: Path = Path("/dev"), proc: Path = Path("/proc/driver/nvidia/gpus")) -> str | None:
    """None if this machine shows an NVIDIA GPU (a /dev/nvidiaN node, a driver entry, or ``nvidia-smi -L``),
    else why not. Checked by nox itself, before a session installs anything."""
    if any(dev.glob("nvidia[0-9]*")) or (proc.is_dir() and any(proc.iterdir())):
        return None
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        if "GPU" in out:
            return None
    return "no CUDA GPU on this machine (no /dev/nvidia* device, nvidia-smi lists none)"


def _passthrough(session: nox.Session) -> bool:
    return isinstance(session.virtualenv, PassthroughEnv)


def _install(session: nox.Session, extras: str = "test") -> None:
    if _passthrough(session):
        return  # --no-venv: use what the interpreter has
    session.install(TORCH_SPEC)
    session.install("-e", f".[{extras}]")


def _probe(session: nox.Session, backend: str) -> dict:
    """{"kind": None} if ``backend`` can run in the session's environment, else {"kind", "extra", "reason"}."""
    out = session.run("python", "-c", PROBE, backend, silent=True) or ""
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"kind": "other", "reason": f"availability probe printed {out[-500:]!r}"}


def _skip_unless_available(session: nox.Session, backend: str) -> None:
    """Skip (never pass) a session whose backend cannot run here, with its true reason; install the backend's
    extra first when the GPU is there but its packages are not."""
    needs = BUILTIN_NEEDS.get(backend, BuiltinNeeds())
    if needs.cuda and not _passthrough(session):
        reason = gpu_absent_reason()
        if reason is not None:  # before installing anything
            session.skip(f"backend {backend} not tested: {reason} [no_device]")
    _install(session)
    status = _probe(session, backend)
    if status["kind"] not in (None, "no_device", "capability", "not_found") and needs.extra \
            and not _passthrough(session):
        session.install("-e", f".[test,{needs.extra}]")
        status = _probe(session, backend)
    if status["kind"] == "not_found" and backend in BACKENDS and backend not in BUILTIN:
        session.skip(f"backend {backend} not tested: its entry point is installed in nox's interpreter, not in this "
                     "session's virtualenv (run with --no-venv, or --backend module:attribute)")
    if status["kind"] == "not_found":
        session.error(f"--backend {backend}: {status['reason']}")
    if status["kind"] is not None:
        session.skip(f"backend {backend} not tested: {status['reason']} [{status['kind']}]")


@nox.session
@nox.parametrize("backend", BACKENDS, ids=BACKENDS)
def conformance(session: nox.Session, backend: str) -> None:
    """Run the conformance suite of one backend against the reference (skipped with the reason if unavailable)."""
    plan = plan_conformance(backend, session.posargs)
    if plan.error:
        session.error(plan.reason)
    if not plan.run:
        session.skip(plan.reason)
    backend = plan.backend
    _skip_unless_available(session, backend)
    # Worker processes (pytest-xdist) isolate crashes: a segfault or illegal memory access fails that case, the
    # worker restarts and the run goes on. MOE_CONFORMANCE_WORKERS=0 runs in-process (for debuggers).
    workers = os.environ.get("MOE_CONFORMANCE_WORKERS", "2")
    # worksteal hands each worker a contiguous half of the cases (cases of one model share cached weights) and
    # reports a crashed case once (loadgroup/loadfile re-queue it).
    xdist = ["-n", workers, "--dist", "worksteal", "--max-worker-restart", "1000"] if workers != "0" else []
    summary = Path(session.create_tmp()) / f"run-{backend.replace(':', '_').replace('/', '_')}.json"
    summary.unlink(missing_ok=True)
    # COLUMNS: pytest trims the reason in its short summary to the terminal width (80 when piped).
    env = {"MOE_RUN_SUMMARY": str(summary), "COLUMNS": os.environ.get("COLUMNS", "200")}
    session.run("python", "-m", "pytest", "conformance", "--backend", backend, "-p", "no:cacheprovider",
                *xdist, *plan.pytest_args, env=env)
    counts = json.loads(summary.read_text()) if summary.exists() else {}
    if counts.get("passed", 0) + counts.get("failed", 0) == 0:
        session.skip(f"backend {backend}: no case ran ({counts.get('skipped', 0)} skipped): nothing was tested")


def _run_tests(session: nox.Session, marker: str) -> None:
    _install(session, "test,plot")
    if not _passthrough(session):
        # The Triton kernels run under TRITON_INTERPRET=1 on CPU (tests/test_triton_interpret.py); same Triton as
        # the GPU machine.
        session.install(TRITON_SPEC, "nox")  # nox: tests/test_noxfile.py imports the noxfile
    # Two worker processes (MOE_TESTS_WORKERS, 0 = in-process): much of the suite is independent subprocess runs
    # of the conformance suite and interpreter kernels, so it scales with the cores. loadfile: a module's
    # expensive module-scoped fixtures (the sm_90 compilation of every table entry) run once, not once per worker.
    workers = os.environ.get("MOE_TESTS_WORKERS", "2")
    xdist = ["-n", workers, "--dist", "loadfile"] if workers != "0" else []
    # the ten slowest tests in the log: a subprocess run nearing its timeout shows before CI goes red on it (stop 62:
    # the suite's op files in the interpreter passed 900 s unseen)
    session.run("python", "-m", "pytest", "tests", "-p", "no:cacheprovider", "-m", marker, "--durations=10", *xdist,
                *session.posargs)


@nox.session
def tests(session: nox.Session) -> None:
    """Test the reference against independent oracles, and the harness (it must go red for broken backends): every
    test not marked ``slow`` (about 6 minutes on 2 cores)."""
    _run_tests(session, "not slow")


@nox.session(default=False)
def slow(session: nox.Session) -> None:
    """The tests marked ``slow`` (about 30 minutes on 2 cores; CI runs them after ``tests``): the harness run end to
    end against broken backends in subprocesses, the Triton kernels and the suite's op files in Triton's
    interpreter, the error model's float64 sweep over every model x scheme and its K = 16384 probe, nvcc."""
    _run_tests(session, "slow")


# Triton releases besides TRITON_SPEC that the backend must compile under: the GPU machine can be given a newer one
# (../shared/gpu/triton-parts.sh), and Gluon renames its operations between releases (3.9 removed
# async_copy_global_to_shared, which GATHER_A's producer called).
NEWER_TRITONS = ["3.9.0"]


@nox.session(default=False)
@nox.parametrize("triton", NEWER_TRITONS, ids=NEWER_TRITONS)
def sm90(session: nox.Session, triton: str) -> None:
    """Every table entry of the H200 and H100 compiled for sm_90 under another Triton release than the tests'
    (``python -m tools.triton.sm90``: the real launch path, Triton's driver swapped for one that compiles and launches
    nothing; no GPU needed), then the deep_gemm backend's Triton glue kernels (``--glue``), failing on one that does
    not compile (about 10 minutes on 2 cores; CI runs it). Arguments after ``--`` replace both runs by one."""
    _install(session, "test")
    if not _passthrough(session):
        session.install(f"triton=={triton}")
    session.run("python", "-c", "import triton; print('triton', triton.__version__)")
    session.run("python", "-m", "tools.triton.sm90", *session.posargs)
    if not session.posargs:
        session.run("python", "-m", "tools.triton.sm90", "--glue")


@nox.session(venv_backend="none", default=False)
def dev(session: nox.Session) -> None:
    """Create (or update) the development environment .venv (or the folder given after --): torch, the project
    editable with its test and plot extras, and the tests session's Triton. Then: ``source .venv/bin/activate``."""
    target = Path(session.posargs[0] if session.posargs else ".venv").resolve()
    if not (target / "bin" / "python").exists():
        session.run(sys.executable, "-m", "venv", str(target), external=True)
    python = str(target / "bin" / "python")
    session.run(python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", TORCH_SPEC, external=True)
    session.run(python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-e", ".[test,plot]",
                TRITON_SPEC, "nox", external=True)
    session.log(f"ready: source {os.path.relpath(target)}/bin/activate  (or call {os.path.relpath(python)})")


@nox.session
def benchmark(session: nox.Session) -> None:
    """pytest-benchmark suite; pass --benchmark-compare etc. after --."""
    _install(session, "test,plot")
    session.run("python", "-m", "pytest", "benchmarks", "-p", "no:cacheprovider", *session.posargs)


@nox.session(default=False)
@nox.parametrize("backend", GPU_BACKENDS, ids=GPU_BACKENDS)
def sanitizer(session: nox.Session, backend: str) -> None:
    """A subset of a GPU backend's conformance under compute-sanitizer memcheck (GPU machine; slow)."""
    _skip_unless_available(session, backend)
    selection = session.posargs or ["-k", "(test_experts and qwen3_30b_a3b and (M4- or M64-)) or test_quantizer"]
    session.run("compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "99", "--target-processes", "all",
                "python", "-m", "pytest", "conformance", "--backend", backend, "-p", "no:cacheprovider", "-x",
                *selection, external=True)


@nox.session(default=False)
def parity(session: nox.Session) -> None:
    """The reference router against vLLM's own pure-torch code (tests/parity/): ``nox -s parity -- --vllm 0.33.0``
    (other arguments go to pytest). vLLM's source distribution is downloaded once into ``$MOE_VLLM_CACHE`` (default
    ``.nox/vllm-sdist``) by ``tests/parity/fetch_sdist.py`` and read, never installed; where the index cannot be
    reached or has no such version, every parity test skips with that reason."""
    args = list(session.posargs)
    version = "0.33.0"
    if "--vllm" in args:
        i = args.index("--vllm")
        version = args[i + 1]
        del args[i : i + 2]
    _install(session, "test")
    cache = Path(os.environ.get("MOE_VLLM_CACHE", ".nox/vllm-sdist")).resolve()
    out = session.run("python", "tests/parity/fetch_sdist.py", version, str(cache), silent=True,
                      success_codes=[0, 3]) or ""
    last = out.strip().splitlines()[-1] if out.strip() else "no output from fetch_sdist.py"
    env = {"MOE_VLLM_SRC": last} if Path(last).is_dir() else {"MOE_VLLM_SRC_ERROR": last}
    session.log(f"vLLM {version} source: {last}")
    session.run("python", "-m", "pytest", "tests/parity", "-p", "no:cacheprovider", "-rs", *args, env=env)


@nox.session(default=False)
def fuzz(session: nox.Session) -> None:
    """Property-based fuzz of a backend's experts inside its claims (``conformance/fuzz.py``):
    ``nox -s fuzz -- --backend triton --budget 600``. Shrunk failures are appended to specs/regressions.toml, which
    every conformance run replays; the figures (cases, passed, refused by reason, failed) are printed last."""
    args = list(session.posargs)
    backend, _ = split_backend_arg(args)
    _skip_unless_available(session, backend or "torch")  # installs; skips (never passes) where it cannot run
    session.run("python", "-m", "conformance.fuzz", *args)


# Client adapters (examples/clients/): third-party experts modules run through the suite under the numerics profile
# each declares (reference/profiles.py). Not part of CI; docs/clients.md records the verdicts.
CLIENTS = {
    "examples.clients.transformers_moe:MixtralBackend": "mixtral_8x7b",
    "examples.clients.transformers_moe:Qwen3MoeBackend": "qwen3_30b_a3b",
    "examples.clients.transformers_moe:GptOssBackend": "gpt_oss_120b",
}


@nox.session(default=False)
def clients(session: nox.Session) -> None:
    """transformers' Mixtral, Qwen3-MoE and gpt-oss experts (eager) through ``conformance/test_experts.py`` on their
    models' cases, on the CPU (about 15 min on 2 cores): ``nox -s clients``; extra pytest arguments after ``--``.
    Each run's results go to results/conformance-hf_*.json; a failing adapter fails the session."""
    _install(session, "test,clients")
    failed = []
    for spec, model in CLIENTS.items():
        try:
            session.run("python", "-m", "pytest", "conformance/test_experts.py", "--backend", spec, "-k", model,
                        "-n", "2", "-rs", *session.posargs)
        except Exception:  # nox raises on a non-zero exit: run the others, then fail
            failed.append(spec)
    if failed:
        session.error(f"client adapters failing: {', '.join(failed)}")
