"""Every comparison the conformance suite makes, in one module.

- ``assert_exact``: ids, counts, layouts, quantized codes (bitwise; NaN equals NaN at the same place).
- ``assert_close``: GEMM outputs against the reference with tolerances from ``specs/tolerances.toml``, reporting
  ``max_norm`` (max|out-ref| / max|ref|), ``rms_norm`` (RMS error / RMS of ref) and ``calc_diff`` (DeepGEMM's
  ``1 - 2 sum(xy) / sum(x^2 + y^2)`` in float64).
- ``assert_routing``: per-token expert sets (ties accepted either way) and their weights.
- ``assert_within_bound``: elementwise ``|out - ref| <= bound`` (the gate's fp32 accumulation bound).
- ``assert_same_blocks``: equal as sets within each block (layouts filled by atomics, e.g. sorted_token_ids).

The statistics themselves (``ErrorStats``, ``error_stats``, ``calc_diff``) live in ``reference.metrics`` (the lowest
layer that needs them: backends' scripts and benchmarks use them too) and are re-exported here.

Every failure raises ``ConformanceFailure`` whose message names the case, the metric and its bound, the worst
coordinates with both values, and the one-line command that reproduces it.
"""

from __future__ import annotations

import torch

from reference.activation import MoEActivation
from reference.metrics import ErrorStats, calc_diff, error_stats

__all__ = ["ConformanceFailure", "ErrorStats", "error_stats", "calc_diff", "assert_close", "assert_exact",
           "assert_routing", "assert_ulps", "gelu_cancellation_atol", "assert_within_bound", "assert_same_blocks"]


class ConformanceFailure(AssertionError):
    """A backend's result disagrees with the reference (message: case, metric, worst coordinates, repro)."""


def _fmt_idx(idx: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, idx)) + "]"


def _footer(case: str, repro: str | None) -> str:
    return f"\n  case: {case}" + (f"\n  reproduce: {repro}" if repro else "")


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: dict, *, case: str, what: str = "output",
                 repro: str | None = None) -> ErrorStats:
    """Check ``out`` against ``ref`` with the ``max_norm`` / ``rms_norm`` / ``calc_diff`` bounds in ``tol``.

    Raises:
        ConformanceFailure: shape/dtype mismatch, any non-finite element where the reference is finite (the
            harness poisons outputs with NaN, so unwritten elements land here), or a metric over its bound.
    """
    if out.shape != ref.shape:
        raise ConformanceFailure(f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}" +
                                 _footer(case, repro))
    if out.dtype != ref.dtype:
        raise ConformanceFailure(f"{what}: dtype {out.dtype} != reference {ref.dtype}" + _footer(case, repro))
    s = error_stats(out, ref)
    problems = []
    if s.nonfinite:
        problems.append(f"{s.nonfinite} non-finite elements where the reference is finite (unwritten or overflow)")
    for metric in ("max_norm", "rms_norm", "calc_diff"):
        value, bound = getattr(s, metric), tol.get(metric)
        if bound is not None and not value <= bound:
            problems.append(f"{metric} = {value:.3e} > {bound:.1e}")
    if problems:
        worst = (f"worst at {_fmt_idx(s.worst_index)}: got {s.worst_out!r}, expected {s.worst_ref!r}"
                 if s.worst_index is not None else "")
        raise ConformanceFailure(
            f"{what} differs from the reference: " + "; ".join(problems)
            + f"\n  {worst}\n  max_norm={s.max_norm:.3e} rms_norm={s.rms_norm:.3e} calc_diff={s.calc_diff:.3e}"
            + _footer(case, repro)
        )
    return s


def assert_exact(out: torch.Tensor, ref: torch.Tensor, *, case: str, what: str, repro: str | None = None,
                 pre_rounding: torch.Tensor | None = None, max_report: int = 5) -> None:
    """Bitwise equality (floating tensors compared through their bit patterns; NaN == NaN at the same place).

    Raises:
        ConformanceFailure: shape/dtype mismatch or differing elements: the count, the first coordinates, both
            values, and the pre-rounding value when ``pre_rounding`` is given.
    """
    if out.shape != ref.shape or out.dtype != ref.dtype:
        raise ConformanceFailure(
            f"{what}: got {tuple(out.shape)} {out.dtype}, reference {tuple(ref.shape)} {ref.dtype}" +
            _footer(case, repro))
    o, r = out.detach().cpu(), ref.detach().cpu()
    if o.is_floating_point():
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[o.element_size()]
        both_nan = torch.isnan(o.float()) & torch.isnan(r.float())
        neq = (o.view(bits) != r.view(bits)) & ~both_nan
    else:
        neq = o != r
    n = int(neq.sum())
    if n:
        lines = []
        for idx in neq.nonzero()[:max_report].tolist():
            idx = tuple(idx)
            line = f"    at {_fmt_idx(idx)}: got {o[idx].item()!r}, expected {r[idx].item()!r}"
            if pre_rounding is not None:
                line += f" (value before rounding {pre_rounding.detach().cpu()[idx].item()!r})"
            lines.append(line)
        raise ConformanceFailure(f"{what}: {n} of {neq.numel()} elements differ\n" + "\n".join(lines) +
                                 _footer(case, repro))


def assert_ulps(out: torch.Tensor, ref: torch.Tensor, ulps: int, *, case: str, what: str,
                repro: str | None = None, atol: torch.Tensor | None = None) -> None:
    """Elementwise: ``|out - ref| <= ulps * ulp(ref) + atol`` in ``ref``'s dtype (for single-rounding elementwise
    ops). ``atol`` (broadcastable to ``ref``, default 0) is an absolute allowance where the fp32 formula itself is
    ill-conditioned (see ``[activation] gelu_cancellation`` in specs/tolerances.toml)."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        raise ConformanceFailure(
            f"{what}: got {tuple(out.shape)} {out.dtype}, reference {tuple(ref.shape)} {ref.dtype}" +
            _footer(case, repro))
    o, r = out.detach().cpu().double(), ref.detach().cpu().double()
    finfo = torch.finfo(ref.dtype)
    # ulp of each reference value: 2^(exponent - mantissa bits), at least the smallest subnormal step.
    exp = torch.floor(torch.log2(r.abs().clamp(min=finfo.tiny)))
    ulp = torch.pow(2.0, exp - (finfo.bits - 1 - {torch.bfloat16: 8, torch.float16: 5, torch.float32: 8}[ref.dtype]))
    allowed = ulps * ulp if atol is None else ulps * ulp + atol.detach().cpu().double()
    bad = ~((o - r).abs() <= allowed) & ~(torch.isnan(o) & torch.isnan(r))
    n = int(bad.sum())
    if n:
        idx = tuple(bad.nonzero()[0].tolist())
        raise ConformanceFailure(
            f"{what}: {n} elements beyond {ulps} ulp; first at {_fmt_idx(idx)}: got {o[idx].item()!r}, "
            f"expected {r[idx].item()!r}" + _footer(case, repro))


# The activations whose fp32 formula cancels for g << 0 (value: gated). SITU joins them: vLLM's kernel writes
# sigmoid(g) as (1 + tanh(g / 2)) / 2, which cancels like GELU's 1 + erf, with |b tanh(g / b)| <= |g|.
_GELU_FAMILY = {MoEActivation.GELU: True, MoEActivation.GELU_TANH: True, MoEActivation.GELU_NO_MUL: False,
                MoEActivation.GELU_TANH_NO_MUL: False, MoEActivation.SITU: True}


def gelu_cancellation_atol(activation: MoEActivation, x: torch.Tensor, factor: float) -> torch.Tensor | None:
    """``factor * 2^-24 * |g| * |u|`` per output element for the GELU family (None for the others).

    ``x`` is the activation input (M, 2I) for gated GELUs (g, u = the packed halves) or (M, I) for GELU_NO_MUL."""
    if activation not in _GELU_FAMILY:
        return None
    xf = x.float()
    if _GELU_FAMILY[activation]:
        g, u = xf.chunk(2, dim=-1)
        return factor * 2.0**-24 * (g * u).abs()
    return factor * 2.0**-24 * xf.abs()


def assert_routing(out_w: torch.Tensor, out_ids: torch.Tensor, ref_w: torch.Tensor, ref_ids: torch.Tensor,
                   selection_key: torch.Tensor, tol: dict, *, case: str, repro: str | None = None) -> None:
    """Compare top-k routing per token as sets of (expert, weight).

    A token passes when its expert set equals the reference's and the weights (matched by expert) agree within
    ``weights_atol`` / ``weights_rtol``; or, where the sets differ only by experts whose ``selection_key`` ties (within
    ``tie_tolerance``) with the reference's weakest selected expert, when the sorted weights agree.

    Raises:
        ConformanceFailure: wrong shapes/dtypes, an id out of ``[0, E)``, a differing set without a tie, or weights
            out of tolerance; names the first bad token with both rows.
    """
    E = selection_key.shape[1]
    if out_ids.shape != ref_ids.shape or out_w.shape != ref_w.shape:
        raise ConformanceFailure(f"routing: got ids {tuple(out_ids.shape)} weights {tuple(out_w.shape)}, expected "
                                 f"{tuple(ref_ids.shape)}" + _footer(case, repro))
    if out_w.dtype != torch.float32:
        raise ConformanceFailure(f"routing: topk_weights must be float32, got {out_w.dtype}" + _footer(case, repro))
    if out_ids.is_floating_point():
        raise ConformanceFailure(f"routing: topk_ids must be integer, got {out_ids.dtype}" + _footer(case, repro))
    ow, oi = out_w.detach().cpu().float(), out_ids.detach().cpu().long()
    rw, ri = ref_w.detach().cpu().float(), ref_ids.detach().cpu().long()
    key = selection_key.detach().cpu().float()
    bad_range = (oi < 0) | (oi >= E)
    if bool(bad_range.any()):
        t = int(bad_range.any(1).nonzero()[0])
        raise ConformanceFailure(f"routing: token {t} has expert ids {oi[t].tolist()} outside [0, {E})" +
                                 _footer(case, repro))
    atol, rtol, tie = tol["weights_atol"], tol["weights_rtol"], tol["tie_tolerance"]
    for t in range(oi.shape[0]):
        o_order, r_order = torch.argsort(oi[t]), torch.argsort(ri[t])
        o_ids, r_ids = oi[t][o_order], ri[t][r_order]
        o_w, r_w = ow[t][o_order], rw[t][r_order]
        if torch.equal(o_ids, r_ids):
            if not torch.allclose(o_w, r_w, atol=atol, rtol=rtol):
                raise ConformanceFailure(
                    f"routing: token {t} weights differ\n    experts {r_ids.tolist()}\n    got      {o_w.tolist()}"
                    f"\n    expected {r_w.tolist()}" + _footer(case, repro))
            continue
        extra = sorted(set(o_ids.tolist()) - set(r_ids.tolist()))
        weakest = float(key[t, r_ids].min())
        if len(set(o_ids.tolist())) != len(o_ids) or any(abs(float(key[t, e]) - weakest) > tie for e in extra):
            raise ConformanceFailure(
                f"routing: token {t} selects experts {o_ids.tolist()}, expected {r_ids.tolist()} "
                f"(not a tie: selection scores of the extra experts {[float(key[t, e]) for e in extra]} vs the "
                f"weakest expected {weakest})" + _footer(case, repro))
        if not torch.allclose(o_w.sort().values, r_w.sort().values, atol=atol, rtol=rtol):
            raise ConformanceFailure(f"routing: token {t} tie resolved differently and weights differ: got "
                                     f"{o_w.tolist()}, expected {r_w.tolist()}" + _footer(case, repro))


def assert_within_bound(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, *, case: str, what: str,
                        repro: str | None = None) -> None:
    """Elementwise ``|out - ref| <= bound`` (float64); NaN anywhere fails.

    Raises:
        ConformanceFailure: shape/dtype mismatch, or elements outside the bound (count, first coordinates, both
            values and the bound there).
    """
    if out.shape != ref.shape or out.dtype != ref.dtype:
        raise ConformanceFailure(f"{what}: got {tuple(out.shape)} {out.dtype}, expected {tuple(ref.shape)} "
                                 f"{ref.dtype}" + _footer(case, repro))
    err = (out.detach().double().cpu() - ref.detach().double().cpu()).abs()
    bad = ~(err <= bound.cpu())
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ConformanceFailure(
            f"{what}: {int(bad.sum())} elements outside the bound; first at {_fmt_idx(idx)}: got {out[idx].item()!r}, "
            f"expected {ref[idx].item()!r} (bound {bound[idx].item():.3e})" + _footer(case, repro))


def assert_same_blocks(out: torch.Tensor, ref: torch.Tensor, block: int, *, case: str, what: str,
                       repro: str | None = None) -> None:
    """``out`` equals ``ref`` as a multiset within each run of ``block`` elements (exactly when the length is not a
    multiple of ``block``).

    Raises:
        ConformanceFailure: shape/dtype mismatch or the first block whose contents differ (both sorted).
    """
    if out.shape != ref.shape or out.dtype != ref.dtype:
        raise ConformanceFailure(f"{what}: got {tuple(out.shape)} {out.dtype}, expected {tuple(ref.shape)} "
                                 f"{ref.dtype}" + _footer(case, repro))
    if ref.numel() % block:
        assert_exact(out, ref, case=case, what=what, repro=repro)
        return
    o = out.detach().cpu().view(-1, block).sort(dim=1).values
    r = ref.detach().cpu().view(-1, block).sort(dim=1).values
    if not torch.equal(o, r):
        b = int((o != r).any(1).nonzero()[0])
        raise ConformanceFailure(f"{what}: block {b} holds {o[b].tolist()}, expected {r[b].tolist()}" +
                                 _footer(case, repro))
