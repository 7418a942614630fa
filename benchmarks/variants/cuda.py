"""The cuda backend's extra variants for ``python -m benchmarks --backend cuda`` (``benchmarks/cli.py``).

``gemms``: the two grouped GEMMs alone (``torch._grouped_mm`` bf16, ``torch._scaled_grouped_mm`` FP8 per-token x
per-channel) on pre-permuted operands, as the CUTLASS experts class runs them inside its step.
Router gate: every kernel variant of the router GEMM extension (``v<i>:<name>``) next to the backend's ops and the
torch fallbacks; before a variant is timed its output on the first input set is checked against the float64 dot
product with conformance's fp32-accumulation bound (``specs/tolerances.toml [gate]``).
"""

from __future__ import annotations

import torch

FP32 = torch.float32


def variants(shape, M: int, inp, device):
    from backends.cuda import experts as ce

    if shape.scheme not in ("bf16", "fp8_channel_token"):
        return []
    copies, sets = inp.weights.copies, inp.sets
    nw = len(copies)
    E, act = shape.E, shape.activation
    prepared = []
    for i, (x, _, ids) in enumerate(sets):
        w1, w2, qc = copies[i % nw]
        plan = ce.route_plan(ids, E, None)
        if shape.scheme == "bf16":
            aa = x.index_select(0, plan.token)
            gg = ce.cuda_moe_activation(act, ce.grouped_mm_bf16(aa, w1, plan.offs)).contiguous()
            prepared.append((aa, gg, None, None, None, None, plan.offs))
        else:
            xq, xs = ce.quant_fp8_per_token(x)
            aa = xq.view(torch.uint8).index_select(0, plan.token).view(torch.float8_e4m3fn)
            sa = xs.reshape(-1).index_select(0, plan.token).contiguous()
            sb1 = qc.w1.scale.reshape(E, -1).contiguous()
            sb2 = qc.w2.scale.reshape(E, -1).contiguous()
            gg, sg = ce.quant_fp8_per_token(ce.cuda_moe_activation(act, ce.scaled_grouped_mm_fp8(aa, w1, sa, sb1,
                                                                                                  plan.offs)))
            prepared.append((aa, gg, sa, sg, sb1, sb2, plan.offs))

    def gemms(i):
        w1, w2, _ = copies[i % nw]
        aa, gg, sa, sg, sb1, sb2, offs = prepared[i]
        if sa is None:
            ce.grouped_mm_bf16(aa, w1, offs)
            ce.grouped_mm_bf16(gg, w2, offs)
        else:
            ce.scaled_grouped_mm_fp8(aa, w1, sa, sb1, offs)
            ce.scaled_grouped_mm_fp8(gg, w2, sg, sb2, offs)

    return [("gemms", gemms)]


def _checked(name, fn, x, w, out_dtype):
    """``fn(x, w)`` against the float64 product with conformance's gate bound; raises if outside it."""
    from specs import load_tolerances

    tol = load_tolerances()["gate"]
    out = fn(x, w).double()
    ref = x.double() @ w.double().T
    bound = tol["accumulation_factor"] * x.shape[1] * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    if out_dtype != FP32:
        bound = bound + tol["output_ulps"] * ref.abs() * torch.finfo(out_dtype).eps
    bad = int((~((out - ref).abs() <= bound)).sum())
    if bad:
        raise RuntimeError(f"{name}: {bad} elements outside the fp32-accumulation bound")


def gate_variants(shape, M: int, sets):
    from backends.cuda import gate
    from backends.cuda.build import load_router_gemm_ext
    from reference.gate import DSV3_MAX_TOKENS, FP32_MAX_TOKENS

    ext = load_router_gemm_ext()
    out = []
    if shape.weight_dtype == torch.bfloat16:
        if M > DSV3_MAX_TOKENS:
            return []
        for v, vname in enumerate(ext.dsv3_variants()):
            fn = (lambda x, w, v=v: gate.dsv3_router_gemm(x, w, FP32, variant=v))  # noqa: E731
            _checked(f"v{v}:{vname}", fn, *sets[0], FP32)
            out.append((f"v{v}:{vname}", lambda i, fn=fn: fn(*sets[i])))
    elif shape.weight_dtype == FP32:
        if M > FP32_MAX_TOKENS:
            return []
        for v, vname in enumerate(ext.fp32_variants()):
            fn = (lambda x, w, v=v: gate.fp32_router_gemm(x, w, variant=v))  # noqa: E731
            _checked(f"v{v}:{vname}", fn, *sets[0], FP32)
            out.append((f"v{v}:{vname}", lambda i, fn=fn: fn(*sets[i])))
    return out
