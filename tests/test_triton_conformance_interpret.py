"""The conformance suite itself against the triton backend, with its kernels in Triton's interpreter
(``TRITON_INTERPRET=1``, CPU tensors): quantizers, routing, alignment and bad inputs on their real shapes (the experts
cases are too large for the interpreter; tests/test_triton_interpret.py covers the experts kernels on small shapes).
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # the suite's op files in the interpreter: minutes (nox -s slow)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install triton)")
def test_triton_backend_conformance_under_the_interpreter(tmp_path):
    files = ["conformance/test_quant.py", "conformance/test_routing.py", "conformance/test_align.py",
             "conformance/test_errors.py"]
    cmd = [sys.executable, "-m", "pytest", *files, "--backend", "triton", "-q", "-p", "no:cacheprovider",
           "--results-dir", str(tmp_path)]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    summary = r.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary, summary
