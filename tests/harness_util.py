"""Helpers of the tests that run the conformance suite in a subprocess, as a user would (tests/test_harness.py,
tests/test_error_model.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_conformance(backend: str, *args: str, tmp_path: Path, quiet: bool = True,
                    timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m pytest conformance --backend BACKEND ARGS`` from the repository root, results into ``tmp_path``
    (``-q`` unless ``quiet=False``); returns the finished process (stdout and stderr captured as text). Raises
    ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
    cmd = [sys.executable, "-m", "pytest", "conformance", "--backend", backend, "-p", "no:cacheprovider",
           "--results-dir", str(tmp_path), *(["-q"] if quiet else []), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)


def experts_bound(x, w1, ids, *, quant_config=None, expert_map=None, activation=None, experts_cls=None,
                  accumulation=None, stage: str = "output") -> dict:
    """The error model's bound (``as_tolerance()``: ``max_norm`` / ``rms_norm`` / ``calc_diff``) on an experts output
    for hidden states ``x (M, K)``, ``w1 (E, N, K)`` (N = 2 I for a gated activation; packing runs along K, so N is
    the true width), routes ``ids (M, topk)`` held here under ``expert_map``: the one rule of the suite
    (``conformance.experts_case.routes_error_bound``), for the backends' own tests. ``accumulation``: a
    ``reference.error_model.Accumulation`` (e.g. ``Accumulation.fp32()`` for an emulation that accumulates in fp32);
    ``stage``: the intermediate compared (``reference.error_model.STAGES``: ``gemm1`` / ``activation`` / ``gemm2`` by
    route, or the output)."""
    from conformance.experts_case import routes_error_bound
    from reference.activation import MoEActivation
    from reference.config import FUSED_MOE_UNQUANTIZED_CONFIG

    act = MoEActivation.SILU if activation is None else activation
    N = w1.shape[1]
    return routes_error_bound(FUSED_MOE_UNQUANTIZED_CONFIG if quant_config is None else quant_config,
                              act_dtype=x.dtype, K=x.shape[-1], I=N // 2 if act.is_gated else N, activation=act,
                              topk_ids=ids, expert_map=expert_map, experts_cls=experts_cls,
                              accumulation=accumulation, stage=stage).as_tolerance()
