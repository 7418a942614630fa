"""Where a failing fuzz / regression case differs: the backend's output and the reference, each computed on the GPU
and on the CPU (and the reference with float64 GEMM accumulation), compared pairwise with the error model's bound.

    python tools/diag/diag_regression.py --backend triton --case '{"E": 8, "topk": 5, ...}'   # a fuzz case (its JSON)

If the backends agree with each other and the reference on the GPU differs from the reference on the CPU, the
reference's own device arithmetic is what moves (the failure is then not the kernels'); if the GPU reference equals
the CPU one, the kernels are what differ. Prints one line per pair: ``rms_norm / max_norm / calc_diff`` and each as
a multiple of the bound; then, for each experts class with ``stages()`` (``conformance.diagnose``), its GEMM1 /
activation / GEMM2-per-route intermediates against the reference's on the same device, with the count of elements
that differ (a stage a class does not hand out is not listed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> int:
    import torch

    from backends import load_backend
    from conformance.cases import situ_params
    from conformance.diagnose import reference_stages
    from conformance.fuzz import FuzzCase, case_bound, make_inputs
    from conformance.inputs import to_device
    from reference.experts import fused_experts
    from reference.metrics import error_stats
    from reference.modular import FusedMoEKernel, MoEPrepareAndFinalizeNoEP

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", action="append", required=True, help="backend name (repeatable)")
    ap.add_argument("--case", required=True, help="the fuzz case as JSON (conformance.fuzz --replay's argument)")
    args = ap.parse_args()
    fc = FuzzCase(**json.loads(args.case))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x, w1, w2, w, ids, emap, qc, cfg = make_inputs(fc, dev)
    kw = dict(activation=fc.act, global_num_experts=fc.E, expert_map=emap)
    sit = situ_params(fc.act)
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    qc_cpu = to_device(qc, "cpu")
    outs = {f"reference@{dev}": fused_experts(x, w1, w2, w, ids, quant_config=qc, **kw, **sit)}
    kcpu = dict(kw, expert_map=cpu(emap))
    outs["reference@cpu"] = fused_experts(cpu(x), cpu(w1), cpu(w2), cpu(w), cpu(ids), quant_config=qc_cpu, **kcpu,
                                          **sit)
    outs["reference@cpu-f64"] = fused_experts(cpu(x), cpu(w1), cpu(w2), cpu(w), cpu(ids), quant_config=qc_cpu,
                                              accumulate_dtype=torch.float64, **kcpu, **sit)
    classes = []
    for name in args.backend:
        for cls in load_backend(name).experts:
            try:
                out = FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), cls(cfg, qc), poison=float("nan")).apply(
                    x, w1, w2, w, ids, **kw)
            except Exception as exc:  # noqa: BLE001 - an unclaimed class raises: not part of the comparison
                print(f"{cls.__name__}: raised {type(exc).__name__}: {str(exc)[:120]}")
                continue
            outs[cls.__name__] = out
            if hasattr(cls, "stages"):
                classes.append(cls)
    tol = case_bound(fc, qc, ids, emap).as_tolerance()

    def cells(got, want):  # each metric and its multiple of the bound
        s = error_stats(got, want)
        return ", ".join(f"{k} {getattr(s, k):.3e} ({getattr(s, k) / v:.2f}x)" for k, v in tol.items())

    print(f"case {fc.id} on {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}; bound {tol}")
    names = list(outs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            same = torch.equal(outs[a].cpu(), outs[b].cpu())
            print(f"{a:>22} vs {b:<22} {'BITWISE EQUAL' if same else cells(outs[a], outs[b])}")
    inputs = SimpleNamespace(hidden_states=x, w1=w1, w2=w2, topk_ids=ids, expert_map=emap, quant_config=qc)
    ref = reference_stages(inputs, fc.act)
    for cls in classes:
        got = cls(cfg, qc).stages(x, w1, w2, w, ids, fc.act, fc.E, emap)
        for stage in ("gemm1", "activation", "gemm2"):
            if stage in got and stage in ref:
                ndiff = int((got[stage].float() != ref[stage].float()).sum())
                print(f"{cls.__name__} stage {stage}: {ndiff} of {got[stage].numel()} elements differ; "
                      f"{cells(got[stage], ref[stage])}")
        if "gemm2" not in got:
            continue

        def weighted_sum(y):  # the router-weighted top-k sum of per-route outputs (M, topk, K), one rounding
            return (y.float() * w.float()[:, :, None]).sum(1).to(x.dtype)

        # how concentrated the difference is: the routes that carry it and their router weights
        d2 = ((got["gemm2"].double() - ref["gemm2"].double()) ** 2).sum(-1).cpu()  # (M, topk)
        held = (d2 > 0) | (ref["gemm2"].abs().sum(-1).cpu() > 0)
        top = ((w.double().cpu() ** 2) * d2).flatten().sort(descending=True).values
        if top.sum() > 0:
            share = " / ".join(f"{top[:n].sum() / top.sum():.0%}" for n in (1, 3, 10))
            print(f"{cls.__name__} gemm2 differs on {int((d2 > 0).sum())} of {int(held.sum())} local routes; router "
                  f"weight mean {w.cpu()[d2 > 0].float().mean():.3f} there vs {w.cpu()[held].float().mean():.3f} over "
                  f"all local routes; the top 1 / 3 / 10 routes carry {share} of the weighted squared difference")
        print(f"{cls.__name__} output vs the weighted sum of its gemm2 stage: rms_norm "
              f"{error_stats(outs[cls.__name__], weighted_sum(got['gemm2'])).rms_norm:.3e}; the reference vs the same "
              f"sum of its own: {error_stats(outs[names[0]], weighted_sum(ref['gemm2'])).rms_norm:.3e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
