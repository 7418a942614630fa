"""The triton backend's extra variants for ``python -m benchmarks --backend triton`` (``benchmarks/cli.py``).

``gemms``: the GEMM stage alone (GEMM1 with its fused activation / requantization or the separate kernel, GEMM2;
``run_experts(stages="gemms")``) on the step's layout (``experts.step_layout``: at decode no layout, each route its
own row tile, as the step runs) and pre-quantized input: what vLLM's H200 figures time.
``tuned``: whether the GPU has a tuned table for the shape (``configs/``), else the defaults.
"""

from __future__ import annotations

import torch


def quantize_a1(x: torch.Tensor, plan, qc):
    """``(a1q, a1q_scale)``: ``x`` quantized as the triton experts step quantizes its input (``(x, None)``
    unquantized)."""
    from backends.triton.experts import quantize_activation

    if plan.kind == "none":
        return x, None
    return quantize_activation(x, plan.a1_qmode, qc.a1_scale, group=plan.group_k, recipe=plan.recipe,
                               use_ue8m0=plan.use_ue8m0)


def _plan(inp):
    from backends.triton.experts import plan_quant

    return plan_quant(inp.weights.copies[0][2])


def variants(shape, M: int, inp, device):
    from backends.triton import configs as C
    from backends.triton.experts import run_experts, step_layout

    copies, sets = inp.weights.copies, inp.sets
    nw = len(copies)
    plan = _plan(inp)
    cfg = C.get_config(M, shape.E, shape.I, shape.K, shape.topk, plan.cfg_dtype, plan.block_shape)
    a1s = [quantize_a1(h, plan, copies[i % nw][2]) for i, (h, _, _) in enumerate(sets)]
    lays = [step_layout(ids, cfg, shape.E) for _, _, ids in sets]
    outs = [torch.empty(M, shape.K, device=device, dtype=shape.dtype) for _ in sets]

    def gemms(i):
        w1, w2, qc = copies[i % nw]
        _, tw, ids = sets[i]
        run_experts(out=outs[i], a1q=a1s[i][0], a1q_scale=a1s[i][1], w1=w1, w2=w2, topk_weights=tw, topk_ids=ids,
                    activation=shape.activation, expert_map=None, num_ids=shape.E, qc=qc, plan=plan, cfg=cfg,
                    layout=lays[i], stages="gemms")

    return [("gemms", gemms)]


def extra(shape, inp) -> dict:
    from backends.triton import configs as C

    plan = _plan(inp)
    tuned = C.load_table(shape.E, shape.I, plan.cfg_dtype, plan.block_shape, C.device_name()) is not None
    return {"tuned": "y" if tuned else "n"}
