"""Error statistics of an output against the reference: the one metrics module every layer above uses.

Pure functions, no assertions: ``conformance.metrics`` turns these numbers into pass/fail verdicts against the
bounds of ``specs/tolerances.toml``; the backends' GPU scripts and the benchmarks print them.

- ``max_norm``: ``max|out - ref| / max|ref|`` (the worst element relative to the tensor's scale);
- ``rms_norm``: ``RMS(out - ref) / RMS(ref)`` (the typical error);
- ``calc_diff``: DeepGEMM's ``1 - 2 sum(x*y) / sum(x^2 + y^2)`` in float64 (0 = identical;
  as in DeepGEMM's tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["ErrorStats", "error_stats", "calc_diff"]


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's similarity measure ``1 - 2 sum(x*y) / sum(x*x + y*y)`` in float64 (0 = identical)."""
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    if denom == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denom)


@dataclass
class ErrorStats:
    max_norm: float
    rms_norm: float
    calc_diff: float
    worst_index: tuple[int, ...] | None
    worst_out: float
    worst_ref: float
    nonfinite: int

    def as_dict(self) -> dict:
        return dict(max_norm=self.max_norm, rms_norm=self.rms_norm, calc_diff=self.calc_diff,
                    nonfinite=self.nonfinite)


def error_stats(out: torch.Tensor, ref: torch.Tensor) -> ErrorStats:
    """Normalized error statistics of ``out`` against ``ref`` (same shape), computed in float64 on the CPU."""
    o = out.detach().double().cpu()
    r = ref.detach().double().cpu()
    nonfinite = int((~torch.isfinite(o) & torch.isfinite(r)).sum())
    diff = (o - r).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    if diff.numel() == 0:
        return ErrorStats(0.0, 0.0, 0.0, None, 0.0, 0.0, 0)
    scale = float(r.abs().max())
    rms_ref = float(r.pow(2).mean().sqrt())
    flat = int(diff.argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    finite = torch.isfinite(diff)
    rms_err = float(diff[finite].pow(2).mean().sqrt()) if finite.any() else math.inf
    return ErrorStats(
        max_norm=float(diff.max()) / scale if scale > 0 else float(diff.max()),
        rms_norm=(rms_err / rms_ref if rms_ref > 0 else rms_err) if nonfinite == 0 else math.inf,
        calc_diff=calc_diff(torch.nan_to_num(o), r) if nonfinite == 0 else math.inf,
        worst_index=idx,
        worst_out=float(o[idx]),
        worst_ref=float(r[idx]),
        nonfinite=nonfinite,
    )
