"""Bit-level check of the cuda backend's glue kernels (``moe_glue.cu``) against the torch-op glue of
``backends/cuda/experts.py`` that defines them, on the GPU.

    python -m tools.cuda.glue_check          # one line per check, then "N passed, N failed"

Every check draws its own inputs (routes with -1, ids outside the id space and experts not held; rows with NaN
and inf; all-zero rows) and compares bit for bit, except where torch's op is not itself one rounding (GELU's tanh
form, whose ``x + k x^3`` nvcc may contract into an FMA in torch's build and in ours): there the result may differ
by one bf16 ulp and still pass.

Exit status 0 when every check passes. Needs an SM90 GPU with nvcc (the extension is built on first use).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

from backends.cuda import experts as ce
from backends.cuda.build import load_router_gemm_ext
from reference.activation import MoEActivation

__all__ = ["CHECKS", "run_checks", "main"]

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of elements whose bits differ (NaN payloads and signs count as equal NaNs)."""
    af, bf = a.reshape(-1).float(), b.reshape(-1).float()  # exact for bf16 / e4m3 / fp32
    both_nan = torch.isnan(af) & torch.isnan(bf)
    same = (af == bf) & (torch.signbit(af) == torch.signbit(bf))
    return int((~(same | both_nan)).sum())


def _routes(M, topk, E, dev, *, expert_map_size=None, bad=True, gen=None):
    """topk_ids with some -1 and (bad=True) ids outside the id space; an expert_map over expert_map_size ids."""
    n_ids = expert_map_size or E
    ids = torch.randint(0, n_ids, (M, topk), generator=gen, device="cpu")
    if M * topk > 4:
        ids.view(-1)[torch.randperm(M * topk, generator=gen)[: max(1, M * topk // 17)]] = -1
        if bad:
            ids.view(-1)[torch.randperm(M * topk, generator=gen)[:1]] = n_ids + 3
    emap = None
    if expert_map_size:
        emap = torch.full((expert_map_size,), -1, dtype=torch.int32)
        held = torch.randperm(expert_map_size, generator=gen)[:E]
        emap[held] = torch.arange(E, dtype=torch.int32)
        emap = emap.to(dev)
    return ids.to(dev), emap


def check_route_plan(dev) -> str | None:
    ext = load_router_gemm_ext()
    gen = torch.Generator().manual_seed(1)
    for M, topk, E, map_size, dtype in ((1, 8, 128, None, torch.int64), (37, 6, 64, 256, torch.int32),
                                        (1024, 8, 32, 256, torch.int64), (4096, 8, 1023, None, torch.int32),
                                        (5, 1, 1, None, torch.int64)):
        ids, emap = _routes(M, topk, E, dev, expert_map_size=map_size, gen=gen)
        ids = ids.to(dtype)
        plan = ce.route_plan(ids, E, emap)
        offs, inv, token = ce.glue_route_plan(ext, ids, E, emap)
        if not torch.equal(offs, plan.offs):
            return f"M={M} E={E}: offs differ"
        flat = ids.reshape(-1).long()
        bad = (flat < -1) | (flat >= (emap.numel() if emap is not None else E))
        want = torch.where(plan.valid_route.reshape(-1), plan.inv.reshape(-1),
                           torch.where(bad, torch.full_like(flat, -2), torch.full_like(flat, -1)))
        if not torch.equal(inv.long(), want):
            return f"M={M} E={E}: inv differs at {int((inv.long() != want).sum())} routes"
        n = int(plan.offs[-1])
        if not torch.equal(token[:n].long(), plan.token[:n]):
            return f"M={M} E={E}: sorted_token differs"
    return None


#: (M, topk, E_local, K, expert_map size, id dtype): the scatter's cases. M = 67 at K = 2048 writes more than
#: kFusedScatterMaxBytes (plan, then a block per token); the others run the one fused launch: a warp group per
#: token (M <= 3), several rounds of a warp per token (M = 40), and E_local = 320 / 383, whose per-warp counters
#: plus the fused kernel's static shared memory pass the default 48 KiB.
SCATTER_CASES = ((67, 8, 16, 2048, None, torch.int64), (1, 8, 16, 2048, None, torch.int64),
                 (3, 6, 320, 1024, 512, torch.int32), (2, 8, 383, 2048, None, torch.int64),
                 (40, 8, 64, 128, 256, torch.int32))


def check_scatter(dev) -> str | None:
    """moe_route_plan_scatter against route_plan + the torch quantizers / gathers (SCATTER_CASES)."""
    ext = load_router_gemm_ext()
    gen = torch.Generator().manual_seed(2)
    for case in SCATTER_CASES:
        if why := _check_scatter_at(ext, dev, gen, *case):
            return f"M={case[0]} E={case[2]} K={case[3]}: {why}"
    return None


def _check_scatter_at(ext, dev, gen, M: int, topk: int, E: int, K: int, map_size, id_dtype) -> str | None:
    ids, emap = _routes(M, topk, E, dev, expert_map_size=map_size, gen=gen)
    ids = ids.to(id_dtype)
    plan = ce.route_plan(ids, E, emap)
    R = M * topk
    x = (torch.randn(M, K, generator=gen) * 3).to(BF16).to(dev)
    x[0, 7] = float("inf")  # rows with non-finite values: a NaN scale and NaN codes per token, saturation per tensor
    if M > 1:
        x[1] = 0
    if M > 2:
        x[2, 9] = float("nan")
    a, sa = torch.empty(R, K, dtype=FP8, device=dev), torch.empty(R, device=dev)
    n = int(plan.offs[-1])
    rows = plan.token[:n]

    def scatter(x, mode, scale_in, per_token, out, scale_out) -> bool:
        offs, inv, token = ce.glue_route_plan_scatter(ext, ids, E, emap, x, mode, scale_in, per_token, out, scale_out)
        flat = ids.reshape(-1).long()
        bad = (flat < -1) | (flat >= (emap.numel() if emap is not None else E))
        want = torch.where(plan.valid_route.reshape(-1), plan.inv.reshape(-1),
                           torch.where(bad, torch.full_like(flat, -2), torch.full_like(flat, -1)))
        return (torch.equal(offs, plan.offs) and torch.equal(token[:n].long(), rows)
                and torch.equal(inv.long(), want))

    # per-token quantization
    if not scatter(x, ce.SCATTER_QUANT_PER_TOKEN, None, False, a, sa):
        return "the plan differs"
    q, s = ce.quant_fp8_per_token(x)
    if (d := _bits_equal(a[:n], q[rows])) or _bits_equal(sa[:n], s[rows]):
        return f"per-token: {d} codes differ"
    # static per-tensor quantization
    s_static = torch.tensor([0.0173], device=dev)
    scatter(x, ce.SCATTER_QUANT_STATIC_TENSOR, s_static, False, a, sa)
    q, _ = ce.quant_fp8_per_tensor(x, s_static)
    if (d := _bits_equal(a[:n], q[rows])) or not torch.all(sa[:n] == s_static):
        return f"static per-tensor: {d} codes differ"
    # copies: bf16 rows, FP8 codes with per-token and per-tensor scales
    b = torch.empty(R, K, dtype=BF16, device=dev)
    scatter(x, ce.SCATTER_COPY, None, False, b, None)
    if _bits_equal(b[:n], x[rows]):
        return "bf16 copy differs"
    q, s = ce.quant_fp8_per_token(x)
    scatter(q, ce.SCATTER_COPY, s, True, a, sa)
    if _bits_equal(a[:n], q[rows]) or _bits_equal(sa[:n], s[rows]):
        return "FP8 copy (per-token scales) differs"
    q, s = ce.quant_fp8_per_tensor(x, s_static)
    scatter(q, ce.SCATTER_COPY, s, False, a, sa)
    if _bits_equal(a[:n], q[rows]) or not torch.all(sa[:n] == s):
        return "FP8 copy (per-tensor scale) differs"
    return None


def _check_activation(dev, activation: MoEActivation, limit: float | None) -> str | None:
    # I = 768: 128 threads, one vector each; I = 2048 with 3000 rows: 256 threads, rows past the grid (1056 blocks
    # on 132 SMs) taken by the grid-stride loop
    for R, I, offs in ((300, 768, (40, 90, 90, 250)), (3000, 2048, (1000, 2999))):
        if why := _check_activation_at(dev, activation, limit, R, I, offs):
            return f"R={R} I={I}: {why}"
    return None


def _check_activation_at(dev, activation, limit, R, I, offs_list) -> str | None:
    ext = load_router_gemm_ext()
    gen = torch.Generator().manual_seed(3)
    N = 2 * I if activation.is_gated else I
    h = (torch.randn(R, N, generator=gen) * 4).to(BF16).to(dev)
    h[7, 3] = float("nan")
    h[8] = 0
    offs = torch.tensor(offs_list, dtype=torch.int32, device=dev)  # rows offs[-1].. belong to no expert
    n = offs_list[-1]
    params = ce.glue_act_params(activation, None, None, limit)
    want = ce.cuda_moe_activation(activation, h[:n], limit=limit)
    ulp_ok = activation in (MoEActivation.GELU_TANH,)
    got, _, amax = ce._CutlassExpertsBase._glue_activation(ext, params, h, I, offs, ce.ACT_OUT_BF16, want_amax=True)
    d = _bits_equal(got[:n], want)
    if d and not (ulp_ok and _max_ulp(got[:n], want) <= 1):
        return f"bf16: {d} of {want.numel()} elements differ"
    wa = want.float().abs().amax()
    if not (torch.equal(amax.reshape(()), wa) or (torch.isnan(wa) and torch.isnan(amax).all())):
        return f"amax {float(amax)} != {float(wa)}"
    got8, s8, _ = ce._CutlassExpertsBase._glue_activation(ext, params, h, I, offs, ce.ACT_OUT_FP8_PER_TOKEN)
    q, s = ce.quant_fp8_per_token(got[:n])  # from the kernel's own bf16 values: the requantization alone
    if (d := _bits_equal(got8[:n], q)) or _bits_equal(s8[:n], s):
        return f"fp8 per token: {d} codes differ"
    st = torch.tensor([0.05], device=dev)
    got8, _, _ = ce._CutlassExpertsBase._glue_activation(ext, params, h, I, offs, ce.ACT_OUT_FP8_STATIC_TENSOR,
                                                         static_scale=st)
    q, _ = ce.quant_fp8_per_tensor(got[:n], st)
    if d := _bits_equal(got8[:n], q):
        return f"fp8 static per tensor: {d} codes differ"
    return None


def _max_ulp(a: torch.Tensor, b: torch.Tensor) -> int:
    fin = torch.isfinite(a.float()) & torch.isfinite(b.float())
    ai = a[fin].view(torch.int16).int()
    bi = b[fin].view(torch.int16).int()
    return int((ai - bi).abs().max()) if ai.numel() else 0


def check_reduce(dev) -> str | None:
    """moe_weight_reduce against ``_weight_and_reduce`` (the torch definition), weighted and with unit weights."""
    ext = load_router_gemm_ext()
    gen = torch.Generator().manual_seed(4)
    M, topk, E, K = 129, 8, 16, 7168
    ids, _ = _routes(M, topk, E, dev, gen=gen)
    offs, inv, _ = ce.glue_route_plan(ext, ids, E, None)
    plan = ce.route_plan(ids, E, None)
    y = torch.randn(M * topk, K, generator=gen).to(BF16).to(dev)
    y[int(offs[-1]):] = float("nan")  # rows of no expert: never read
    w = torch.rand(M, topk, generator=gen).to(dev)
    for unit in (False, True):
        out = torch.empty(M, K, dtype=BF16, device=dev)
        want = torch.empty_like(out)
        ce.glue_weight_and_reduce(ext, y, inv, w, unit, out)
        ce._weight_and_reduce(y, plan, w, unit, want)
        if d := _bits_equal(out, want):
            return f"{'unit weights: ' if unit else ''}{d} elements differ"
    return None


CHECKS: dict[str, Callable[[torch.device], str | None]] = {
    "route_plan": check_route_plan,
    "scatter_rows": check_scatter,
    **{f"act_quant[{a.name}{'' if lim is None else f',limit={lim}'}]":
       (lambda dev, a=a, lim=lim: _check_activation(dev, a, lim))
       for a, lim in [(a, None) for a in ce.GLUE_ACT] + [(MoEActivation.SILU, 7.0)]},
    "weight_reduce": check_reduce,
}


def run_checks(device: str = "cuda") -> dict[str, str | None]:
    """Run every check; ``{name: None (passed) or what differed}``."""
    dev = torch.device(device)
    return {name: fn(dev) for name, fn in CHECKS.items()}


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    if not torch.cuda.is_available():
        print("glue_check: no CUDA device here", file=sys.stderr)
        return 2
    results = run_checks()
    for name, why in results.items():
        print(f"{'ok  ' if why is None else 'FAIL'} {name}{'' if why is None else ': ' + why}")
    failed = sum(why is not None for why in results.values())
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
