"""Deliberately broken backends: the conformance suite must go red for each (tests/test_harness.py).

Each one wraps the correct torch backend and breaks one thing a real kernel gets wrong.
"""

from __future__ import annotations

import dataclasses

import torch

from backends import Backend
from backends.torch import backend as _torch
from backends.torch.experts import TorchExperts


def _fused_topk_no_renormalize(hidden_states, gating_output, topk, renormalize, **kw):
    return _torch.ops["fused_topk"](hidden_states, gating_output, topk, False, **kw)


no_renormalize = dataclasses.replace(_torch, name="broken_no_renormalize",
                                     ops={**_torch.ops, "fused_topk": _fused_topk_no_renormalize})


class _NoRouterWeights(TorchExperts):
    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, *args, **kwargs):
        super().apply(output, hidden_states, w1, w2, torch.ones_like(topk_weights), topk_ids, *args, **kwargs)


no_router_weights = dataclasses.replace(_torch, name="broken_no_router_weights", experts=[_NoRouterWeights])


class _HalfOutput(TorchExperts):
    """Writes only the first half of the hidden dimension (the rest keeps the harness's NaN poison)."""

    def apply(self, output, *args, **kwargs):
        full = torch.empty_like(output)
        super().apply(full, *args, **kwargs)
        half = output.shape[-1] // 2
        output[..., :half] = full[..., :half]


half_output = dataclasses.replace(_torch, name="broken_half_output", experts=[_HalfOutput])


def _activation_off_by_rounding(act, x, **kw):
    # SILU evaluated in the input dtype: silu(g) is rounded to bf16 before the multiply by u (two roundings).
    g, u = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


def not_a_backend():
    return 42


activation_double_rounding = dataclasses.replace(
    _torch, name="broken_activation", ops={**_torch.ops, "apply_moe_activation": _activation_off_by_rounding})
