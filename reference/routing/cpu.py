"""vLLM 0.33's ``CPURouter`` (``vllm/model_executor/layers/fused_moe/router/cpu_router.py``): which routing path it
runs for which configuration (``cpu_router_path``) and that path's routing (``cpu_route``).

On a CPU platform ``create_fused_moe_router`` builds a ``CPURouter`` for everything except zero experts
(``reference.routing.router_kind(is_cpu=True)``); ``CPURouter._compute_routing`` then picks, in this order:

1. ``use_grouped_topk`` -> ``_grouped_topk`` (native torch grouped top-k: softmax / sigmoid, the correction bias
   steering group and expert choice, renormalize, then ``routed_scaling_factor``); a custom routing function, if
   any, is ignored (the factory's GPU-branch assert does not run on CPU);
2. ``scoring_func == "sqrtsoftplus"`` -> ``_sqrtsoftplus_bias_topk``: ``hash_topk_cpu`` over
   ``hash_indices_table[input_ids]`` when a hash table is given, else ``biased_topk_cpu`` with the correction bias
   (SGLang's AVX-512 kernels, ``csrc/cpu/sgl-kernels/topk.cpp``); requires ``renormalize`` (asserts); a custom
   routing function is ignored;
3. no custom routing function -> ``_softmax_topk`` (top-k of the logits, softmax over those k when
   ``renormalize``, else ``exp(logit - logsumexp)``); the scoring function must be softmax (asserts), and a
   correction bias and ``routed_scaling_factor`` are *ignored* on this path;
4. else the custom routing function, its weights made fp32 and ids int32 (contiguous).

vLLM 0.17.0 has no CPU router (SemanticsError).
"""

from __future__ import annotations

from typing import Callable

import torch

from reference.routing.common import _UP, check_router_logits
from reference.routing.grouped import grouped_topk
from reference.routing.topk import fused_topk, fused_topk_bias
from reference.semantics import require

__all__ = ["CPU_ROUTER_PATHS", "cpu_router_path", "cpu_route"]

CPU_ROUTER_PATHS = ("_grouped_topk", "_sqrtsoftplus_bias_topk:hash", "_sqrtsoftplus_bias_topk:bias", "_softmax_topk",
                    "custom_routing_function")


def cpu_router_path(*, use_grouped_topk: bool = False, scoring_func: str = "softmax", renormalize: bool = True,
                    num_expert_group: int | None = None, topk_group: int | None = None,
                    has_e_score_correction_bias: bool = False, has_hash_indices_table: bool = False,
                    custom_routing_function: bool = False, has_input_ids: bool = True, semantics=None) -> str:
    """The path ``CPURouter._compute_routing`` (vLLM 0.33.0 ``router/cpu_router.py``) takes: one of
    ``CPU_ROUTER_PATHS`` (the upstream function names; ``:hash`` / ``:bias`` say which SGLang kernel).

    Raises:
        ValueError: where vLLM asserts or raises on that path: grouped without ``num_expert_group`` / ``topk_group``,
            grouped with a scoring function other than softmax / sigmoid; sqrtsoftplus without a hash table or a
            bias, without ``renormalize``, or hash routing without ``input_ids``; no custom function and a scoring
            function other than softmax. SemanticsError under 0.17 (no CPU router).
    """
    require("CPURouter dispatch", "0.33", semantics, upstream=_UP + "cpu_router.py")
    if use_grouped_topk:
        if topk_group is None or num_expert_group is None:
            raise ValueError("CPURouter grouped top-k needs num_expert_group and topk_group (vLLM asserts)")
        if scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"Unsupported scoring function: {scoring_func}")
        return "_grouped_topk"
    if scoring_func == "sqrtsoftplus":
        if not (has_hash_indices_table or has_e_score_correction_bias):
            raise ValueError("CPURouter sqrtsoftplus needs a hash table or a correction bias (vLLM asserts)")
        if not renormalize:
            raise ValueError("DeepseekV4 routing always renormalizes (vLLM asserts renormalize on CPU)")
        if has_hash_indices_table:
            if not has_input_ids:
                raise ValueError("CPURouter hash routing needs input_ids (vLLM asserts)")
            return "_sqrtsoftplus_bias_topk:hash"
        return "_sqrtsoftplus_bias_topk:bias"
    if not custom_routing_function:
        if scoring_func != "softmax":
            raise ValueError(f"CPURouter without grouping or a custom function takes softmax only, got "
                             f"{scoring_func!r} (vLLM asserts)")
        return "_softmax_topk"
    return "custom_routing_function"


def cpu_route(
    hidden_states: torch.Tensor | None,
    router_logits: torch.Tensor,
    top_k: int,
    *,
    use_grouped_topk: bool = False,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    renormalize: bool = True,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: torch.Tensor | None = None,
    custom_routing_function: Callable | None = None,
    input_ids: torch.Tensor | None = None,
    hash_indices_table: torch.Tensor | None = None,
    check_finite: bool | None = None,
    semantics=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``CPURouter._compute_routing``: ``(weights (M, k) fp32, ids (M, k) int32)`` by ``cpu_router_path``.

    ``_grouped_topk`` = ``reference.routing.grouped_topk`` (parity-tested against the upstream torch function);
    ``_sqrtsoftplus_bias_topk`` = ``fused_topk_bias(scoring_func="sqrtsoftplus", routed_scaling_factor=...)`` with
    the hash table or the bias (the SGLang kernels are C++, not run here: the reference takes DeepSeek-V4's CUDA
    definition, which their docstring says they match); ``_softmax_topk`` = ``fused_topk(scoring_func="softmax")``
    with the bias and the scale ignored, as upstream; else the custom function.

    Non-finite logits: the CPU torch paths have no clamp, so by default (``check_finite=None``) they raise
    ValueError like ``check_finite=True``; ``check_finite=False`` routes them under each function's rule.
    Raises: as ``cpu_router_path``.
    """
    path = cpu_router_path(use_grouped_topk=use_grouped_topk, scoring_func=scoring_func, renormalize=renormalize,
                           num_expert_group=num_expert_group, topk_group=topk_group,
                           has_e_score_correction_bias=e_score_correction_bias is not None,
                           has_hash_indices_table=hash_indices_table is not None,
                           custom_routing_function=custom_routing_function is not None,
                           has_input_ids=input_ids is not None, semantics=semantics)
    cf = True if check_finite is None else check_finite
    if path == "_grouped_topk":
        return grouped_topk(hidden_states, router_logits, top_k, renormalize, num_expert_group, topk_group,
                            scoring_func=scoring_func, routed_scaling_factor=routed_scaling_factor,
                            e_score_correction_bias=e_score_correction_bias, check_finite=cf, semantics=semantics)
    if path.startswith("_sqrtsoftplus_bias_topk"):
        hashed = path.endswith(":hash")
        return fused_topk_bias(hidden_states, router_logits, None if hashed else e_score_correction_bias, top_k, True,
                               scoring_func="sqrtsoftplus", routed_scaling_factor=routed_scaling_factor,
                               input_tokens=input_ids if hashed else None,
                               hash_indices_table=hash_indices_table if hashed else None, check_finite=cf,
                               semantics=semantics)
    if path == "_softmax_topk":
        return fused_topk(hidden_states, router_logits, top_k, renormalize, scoring_func="softmax", check_finite=cf,
                          semantics=semantics)
    if cf:
        check_router_logits(router_logits)
    w, ids = custom_routing_function(hidden_states=hidden_states, gating_output=router_logits, topk=top_k,
                                     renormalize=renormalize)
    return w.to(torch.float32).contiguous(), ids.to(torch.int32).contiguous()
