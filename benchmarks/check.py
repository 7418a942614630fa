"""Correctness of a timed implementation: the same metrics and bounds as conformance, before its time counts.

``python -m benchmarks`` checks the output of each timed experts class on input set 0 against
``reference.experts.fused_experts`` with ``reference.metrics.error_stats`` and the error model's bound of the case
(``reference.error_model.experts_error_bound``, as ``conformance/test_experts.py`` ``case_error_bound`` computes it:
every route of the benchmark is local, so the routed rows are ``M * topk``; the heavy event on the call's own values
at GEMM2's input, from the same reference run). The reference runs on the CPU:
``reference.quant`` divides by Python scalars, which torch's CUDA kernels compute as a multiplication by the
reciprocal, so the reference's FP8 / INT8 scales are bit-stable only there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from benchmarks.harness import replicate
from reference.error_model import ErrorBound, experts_error_bound
from reference.metrics import ErrorStats, error_stats

__all__ = ["Check", "experts_bound", "reference_output", "verdict"]

METRICS = ("max_norm", "rms_norm", "calc_diff")


@dataclass(frozen=True)
class Check:
    ok: bool
    stats: ErrorStats | None
    bound: dict
    text: str  # one short cell: "ok 0.31" (worst metric / its bound) or "FAIL rms_norm 2.1e-2 > 8.0e-3"

    @property
    def worst_ratio(self) -> float:
        if self.stats is None:
            return float("inf")
        return max(getattr(self.stats, m) / b for m, b in self.bound.items() if b > 0)


def experts_bound(shape, quant_config, M: int, experts_cls=None, accumulation=None,
                  heavy: torch.Tensor | None = None) -> ErrorBound:
    """The error model's bound for ``shape`` (a ``benchmarks.shapes.ExpertsShape``) at ``M`` tokens;
    ``accumulation``: a ``reference.error_model.Accumulation`` other than the default (a peer's opt-in recipe);
    ``heavy``: the call's own values at GEMM2's input (:func:`reference_output` with ``heavy=True``), on which the
    heavy event of step 7b is evaluated, as conformance does (None: its distributional estimate)."""
    return experts_error_bound(quant_config, act_dtype=shape.dtype, K=shape.K, I=shape.I,
                               activation=shape.activation, routed_rows=M * shape.topk, routes_per_row=shape.topk,
                               router_weight_rounding=getattr(getattr(experts_cls, "support", None),
                                                              "router_weight_rounding", "reference"),
                               accumulation=accumulation, heavy=heavy)


def reference_output(hidden, w1, w2, topk_weights, topk_ids, quant_config, *, heavy: bool = False, **kwargs):
    """``reference.experts.fused_experts`` on the CPU (inputs and the quant config's tensors copied there); with
    ``heavy``, ``(output, heavy values)`` from the same run (``reference.experts.fused_experts_with_heavy``)."""
    from reference.experts import fused_experts, fused_experts_with_heavy

    cpu = torch.device("cpu")
    kw = {k: replicate(v, cpu) for k, v in kwargs.items()}
    return (fused_experts_with_heavy if heavy else fused_experts)(
        replicate(hidden, cpu), replicate(w1, cpu), replicate(w2, cpu), replicate(topk_weights, cpu),
        replicate(topk_ids, cpu), quant_config=replicate(quant_config, cpu), **kw)


def verdict(out: torch.Tensor, ref: torch.Tensor, bound: ErrorBound | dict) -> Check:
    """conformance's ``assert_close`` criterion as a value: same shape, no non-finite element where the reference
    is finite, each metric within its bound."""
    tol = bound.as_tolerance() if isinstance(bound, ErrorBound) else dict(bound)
    if tuple(out.shape) != tuple(ref.shape):
        return Check(False, None, tol, f"FAIL shape {tuple(out.shape)} != {tuple(ref.shape)}")
    s = error_stats(out, ref)
    problems = [f"{s.nonfinite} non-finite"] if s.nonfinite else []
    problems += [f"{m} {getattr(s, m):.1e} > {tol[m]:.1e}" for m in METRICS if m in tol
                 and not getattr(s, m) <= tol[m]]
    if problems:
        return Check(False, s, tol, "FAIL " + "; ".join(problems))
    c = Check(True, s, tol, "")
    return Check(True, s, tol, f"ok {c.worst_ratio:.2f}")
