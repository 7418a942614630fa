"""The benchmark's whole-layer ``step`` of the triton backend with the backend's own prepare (``python -m benchmarks
--backend triton``'s default, ``--prepare backend``), its kernels in Triton's interpreter (``TRITON_INTERPRET=1``,
CPU tensors): the scaled-down FP8 shapes of the suite's schemes (per-tensor, per-channel x per-token, 1 x 128 block).

For each scheme the step built by ``benchmarks.harness.make_experts_call(..., prepare="backend")`` must

- quantize its input with the triton backend's own op (``BackendQuantPrepare.used``: ``scaled_fp8_quant`` or
  ``per_token_group_quant_fp8``, never the reference's torch quantizer),
- hand the experts exactly what the reference's quantizer computes (codes and scales bit-equal: the ops are
  bit-exact to ``reference.quant``),
- produce an output the benchmark's check accepts against ``reference.experts.fused_experts`` with the error
  model's bound (``benchmarks.check``, the one rule), and the same output as the step with the reference's prepare
  (bitwise: the same quantized input goes into the same kernels).

One subprocess runs the checks (the interpreter is chosen when the kernels are defined) and prints a JSON line each.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # the interpreter: about 2.5 minutes on a loaded 2-core machine (nox -s slow)
SHAPES = ["mixtral_tp2-fp8_tensor-cpu_small", "qwen3_30b-fp8_channel_token-cpu_small",
          "qwen3_30b-fp8_block128-cpu_small"]
EXPECT_OP = {"fp8_tensor": "scaled_fp8_quant", "fp8_channel_token": "scaled_fp8_quant",
             "fp8_block128": "per_token_group_quant_fp8"}

WORKER = r'''
import json, sys, torch
from benchmarks import harness, shapes
from benchmarks.check import experts_bound, reference_output, verdict
from benchmarks.harness import ExpertsParam
from reference.modular import MoEPrepareAndFinalizeNoEP
from backends import load_backend

b = load_backend("triton")
cls = b.experts[0]
dev = torch.device("cpu")
for sid in sys.argv[1:]:
    shape = shapes.experts_shape(sid)
    M = 5
    inp = harness.experts_inputs(shape, M, dev, 2 * 2**20)
    p = ExpertsParam(shape, M, "triton", cls)
    call, label = harness.make_experts_call(p, inp, prepare="backend")
    out = call(0)
    used = sorted(call.prepares[0].used)
    # the backend op's quantized input against the reference prepare's (bit-exact ops)
    w1, w2, qc = inp.weights.copies[0]
    h, tw, ids = inp.sets[0]
    args = (h, tw, ids, shape.E, None, False, qc)
    qb, sb = call.prepares[0].prepare(*args)[:2]
    qr, sr = MoEPrepareAndFinalizeNoEP().prepare(*args)[:2]
    same_q = bool(torch.equal(qb.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(sb.reshape(-1),
                                                                                         sr.reshape(-1)))
    ref_call, ref_label = harness.make_experts_call(p, inp, prepare="reference")
    same_out = bool(torch.equal(out.view(torch.int16), ref_call(0).view(torch.int16)))
    ref = reference_output(h, w1, w2, tw, ids, qc, activation=shape.activation, global_num_experts=shape.E)
    c = verdict(out, ref, experts_bound(shape, qc, M, cls))
    print(json.dumps(dict(shape=sid, scheme=shape.scheme, label=label, ref_label=ref_label, used=used,
                          same_q=same_q, same_out=same_out, ok=c.ok, text=c.text)), flush=True)
'''


@pytest.fixture(scope="module")
def results():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH",
                                                                                                        "")}
    r = subprocess.run([sys.executable, "-c", WORKER, *SHAPES], cwd=ROOT, capture_output=True, text=True, env=env,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    return {row["shape"]: row for row in rows}


@pytest.mark.parametrize("shape_id", SHAPES)
def test_step_quantizes_with_the_backend_op_and_passes_the_check(results, shape_id):
    row = results[shape_id]
    assert row["label"].startswith("triton quant ops"), row
    assert row["ref_label"] == "reference", row
    assert row["used"] == [EXPECT_OP[row["scheme"]]], row  # the backend's op ran, not the reference's quantizer
    assert row["same_q"], row  # bit-exact to the reference's quantizer
    assert row["same_out"], row  # so the step's output does not depend on whose quantizer ran
    assert row["ok"], row  # the benchmark's check: the error model's bound against the reference
