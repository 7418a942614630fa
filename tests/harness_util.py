"""Helpers of the tests that run the conformance suite in a subprocess, as a user would (tests/test_harness.py,
tests/test_error_model.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_conformance(backend: str, *args: str, tmp_path: Path, quiet: bool = True) -> subprocess.CompletedProcess:
    """``python -m pytest conformance --backend BACKEND ARGS`` from the repository root, results into ``tmp_path``
    (``-q`` unless ``quiet=False``); returns the finished process (stdout and stderr captured as text)."""
    cmd = [sys.executable, "-m", "pytest", "conformance", "--backend", backend, "-p", "no:cacheprovider",
           "--results-dir", str(tmp_path), *(["-q"] if quiet else []), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
