"""Re-judge a stored conformance run with the current error model, without its GPU.

    python tools/diag/rebound.py results/conformance-triton.json --backend triton [--all]

A conformance run records, per experts case, the measured ``max_norm`` / ``rms_norm`` / ``calc_diff`` and the bounds
it was judged by (``--results-dir``). This recomputes each case's bound with ``reference/error_model.py`` and
``specs/tolerances.toml`` as they are now (the case rebuilt from its id: the spec list and the backend's claim-derived
cases) and prints, per case, measured / old bound / new bound, the cases the new model would fail, and the ratio
range. Use it to see what a change of the model does to every measured case before spending GPU time; never to pick
a constant that admits a measurement (docs/ERROR_MODEL.md: tolerances are derived).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("TRITON_INTERPRET", "1")  # the FP8 claims of the triton backend hold under the interpreter

import torch  # noqa: E402

from backends import load_backend  # noqa: E402
from conformance.cases import claim_cases, experts_cases  # noqa: E402
from conformance.experts_case import case_error_bound  # noqa: E402
from reference.schemes import quantize_weights  # noqa: E402

METRICS = ("max_norm", "rms_norm", "calc_diff")


def _quant_config(scheme: str):
    """The scheme's quant config on a tiny layer: the model reads only its formats, never the scales' values."""
    w1, w2 = torch.randn(1, 256, 256).bfloat16(), torch.randn(1, 256, 128).bfloat16()
    return quantize_weights(scheme, w1, w2)[2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="a conformance JSON (results/conformance-<backend>.json)")
    p.add_argument("--backend", required=True)
    p.add_argument("--all", action="store_true", help="print every case, not only those over a bound")
    args = p.parse_args(argv)
    data = json.loads(Path(args.results).read_text())
    backend = load_backend(args.backend)
    classes = {c.__name__: c for c in backend.experts}
    cases = {c.id: c for c in experts_cases(include_gpu_only=True)}
    # A case id names its model, scheme, tokens and shard, not its class: the claim-derived cases of the torch
    # backend (which claims nearly everything, on any device) rebuild those of a class whose device is not here.
    for cls in list(classes.values()) + list(load_backend("torch").experts):
        cases.update({c.id: c for c in claim_cases(cls, True) if c.id not in cases})
    rows, missing = [], 0
    for r in data["results"]:
        if r.get("component") != "experts" or not r.get("bounds") or r.get("rms_norm") is None:
            continue
        param = r["nodeid"].split("[", 1)[1].rstrip("]")
        cls_name = r.get("experts_class")
        cid = param.removesuffix(f"-{cls_name}") if cls_name else param
        case = cases.get(cid)
        if case is None:
            missing += 1
            if missing <= 3:
                print(f"not rebuilt: {cid}")
            continue
        new = case_error_bound(case, _quant_config(case.scheme), classes.get(cls_name)).as_tolerance()
        ratio = {k: r[k] / new[k] for k in METRICS if new[k] > 0 and r.get(k) is not None}
        if len(ratio) < len(METRICS):  # a case checked exactly (zero bound) or without all metrics
            continue
        rows.append((param, r, r["bounds"], new, ratio))
    worst = max((max(x[4]["max_norm"], x[4]["rms_norm"]) for x in rows), default=0.0)
    print(f"{len(rows)} experts cases re-judged ({missing} not rebuilt from their ids); worst measured / new bound "
          f"(max_norm, rms_norm; calc_diff goes as rms_norm squared) {worst:.2f}")
    print("| case | rms measured | old bound | new bound | max measured / new bound | rms / new |")
    print("|---|---|---|---|---|---|")
    for param, r, old, new, ratio in sorted(rows, key=lambda x: -max(x[4]["max_norm"], x[4]["rms_norm"])):
        if args.all or max(ratio["max_norm"], ratio["rms_norm"]) > 1.0:
            print(f"| {param} | {r['rms_norm']:.2e} | {old['rms_norm']:.2e} | {new['rms_norm']:.2e} | "
                  f"{ratio['max_norm']:.2f} | {ratio['rms_norm']:.2f} |")
    return 1 if worst > 1.0 else 0


if __name__ == "__main__":
    sys.exit(main())
