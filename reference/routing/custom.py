"""Models' own routing functions: Llama-4's top-1 sigmoid, Gemma4's per-expert scale (0.33), MiniMax2's epsilon
renormalization (0.33), Cohere2-MoE's ``token_choice_with_bias`` (0.33), MuseSpark1x's router (0.33)."""

from __future__ import annotations

import torch

from reference.routing.common import _finish, _topk_ids, apply_padding_rows, check_router_logits
from reference.semantics import require

__all__ = ["MINIMAX2_EPSILON", "MUSESPARK_DIVISION_EPS", "llama4_routing", "gemma4_routing", "minimax2_routing",
           "token_choice_with_bias", "musespark1x_routing"]


MINIMAX2_EPSILON = 1e-20  # RoutingMethodType.MiniMax2 comment, fused_moe/config.py (0.33.0)


def llama4_routing(
    hidden_states: torch.Tensor | None,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool = False,
    *,
    indices_type: torch.dtype | None = None,
    check_finite: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama-4 custom routing: top-k of the raw logits, weight = sigmoid(logit) in fp32, no renormalization.

    Llama-4 uses topk = 1 with ``apply_router_weight_on_input=True``. Mirrors ``Llama4MoE.custom_routing_function``
    (``vllm/model_executor/models/llama4.py``).
    """
    if renormalize:
        raise ValueError("Llama-4 routing does not renormalize; pass renormalize=False")
    if check_finite is not False:  # no clamp upstream in 0.17.0 or 0.33.0: raises under both
        check_router_logits(gating_output)
    ids = _topk_ids(gating_output.float(), topk)
    w = torch.sigmoid(gating_output.gather(1, ids).float())
    return w, ids.to(indices_type or torch.int32)


def gemma4_routing(gating_output: torch.Tensor, topk: int, per_expert_scale: torch.Tensor, *,
                   check_finite: bool | None = None, semantics=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma4: top-k of the logits; weight = softmax over all E, renormalized over the k, times ``scale[id]``.

    ``w_j = exp(x_j) / sum_{i in topk} exp(x_i) * per_expert_scale[id_j]`` in fp32 (a zero sum divides by 1).
    Args: ``gating_output`` ``(M, E)``, ``per_expert_scale`` ``(E,)`` (a learned parameter, ones at init).
    Returns ``(weights (M, k) fp32, ids (M, k) int32)``, descending logit, lower index first on ties (the Triton
    kernel's stable sort of (logit key, index)). Non-finite logits raise unless ``check_finite=False`` (no clamp
    upstream; weights then unspecified).

    Mirrors ``gemma4_routing_function_torch`` / ``gemma4_fused_routing_kernel_triton`` in
    ``vllm/model_executor/models/gemma4.py`` (vLLM 0.33.0; tested against each other in
    ``tests/kernels/moe/test_gemma4router.py``). The torch version takes the softmax in the logits' dtype (bf16
    for bf16 logits); the Triton kernel used on CUDA computes in fp32, which the reference follows.

    Raises: SemanticsError under 0.17 (no Gemma4 in vLLM 0.17.0); ValueError for shapes / non-finite logits.
    """
    require("Gemma4 routing (per-expert scale)", "0.33", semantics, upstream="vllm/model_executor/models/gemma4.py")
    if check_finite is not False:
        check_router_logits(gating_output)
    M, E = gating_output.shape
    if per_expert_scale.shape != (E,):
        raise ValueError(f"per_expert_scale must be ({E},), got {tuple(per_expert_scale.shape)}")
    x = gating_output.float()
    ids = _topk_ids(x, topk)
    p = torch.softmax(x, dim=-1).gather(1, ids)
    w, ids = _finish(p, ids, True, 1.0, None)
    return (w * per_expert_scale.float()[ids.long()]).float(), ids


def minimax2_routing(gating_output: torch.Tensor, e_score_correction_bias: torch.Tensor, topk: int,
                     routed_scaling_factor: float = 1.0, *, check_finite: bool | None = None,
                     indices_type: torch.dtype | None = None, semantics=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``RoutingMethodType.MiniMax2``: sigmoid + bias -> top-k -> scaled sum-normalize with epsilon 1e-20.

    ``s = sigmoid(x)`` (fp32); experts chosen by ``s + bias`` (lower index first on ties); weights
    ``w_j = s_j * (routed_scaling_factor / (sum_i s_i + 1e-20))``. For any realistic sum the epsilon vanishes in
    fp32 (``1 + 1e-20 == 1``); it only matters when every selected sigmoid is below ~1e-13 (logits below ~-30),
    where the weights stay tiny instead of being normalized to sum ``routed_scaling_factor``.

    Source: the enum comment in ``fused_moe/config.py`` (vLLM 0.33.0): "MiniMax2: Sigmoid + Bias -> TopK ->
    ScaledSumNormalize (routeScale=routed_scaling_factor, epsilon=1e-20)"; the monolithic kernels implementing it
    are FlashInfer's (not in vLLM's tree, not read). The operation order is vLLM's own ``scale =
    routed_scaling_factor / (sum + 1e-20)`` of ``csrc/moe/grouped_topk_kernels.cu``. vLLM's non-monolithic path
    for the same model (``FusedTopKBiasRouter`` -> ``topk_sigmoid``) divides by ``sum > 0 ? sum : 1`` instead:
    that is ``fused_topk_bias(..., scoring_func="sigmoid")``.

    Raises: SemanticsError under 0.17 (no MiniMax2 in vLLM 0.17.0's enum); ValueError for non-finite logits
    unless ``check_finite=False``.
    """
    require("RoutingMethodType.MiniMax2 routing", "0.33", semantics, upstream="fused_moe/config.py")
    if check_finite is not False:
        check_router_logits(gating_output)
    s = torch.sigmoid(gating_output.float())
    ids = _topk_ids(s + e_score_correction_bias.float().unsqueeze(0), topk)
    w = s.gather(1, ids)
    scale = routed_scaling_factor / (w.sum(dim=-1, keepdim=True) + MINIMAX2_EPSILON)
    return (w * scale).float(), ids.to(indices_type or torch.int32)


def token_choice_with_bias(
    hidden_states: torch.Tensor | None,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    *,
    indices_type: torch.dtype | None = None,
    check_finite: bool | None = None,
    semantics=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cohere2-MoE's custom routing function: sigmoid (fp32) -> top-k -> optional renormalization. No bias is used,
    whatever the name says.

    ``s = sigmoid(gating_output.float())``; ids = the ``topk`` largest ``s`` (lower index first on ties; upstream
    ``torch.topk(..., sorted=False)`` leaves the order and the choice among exact ties unspecified);
    ``w = s[ids]``, divided by ``sum(w)`` when ``renormalize`` (a plain division: no epsilon and no zero-sum guard,
    so a row whose selected sigmoids all underflow to 0 - every selected logit below about -103 - weighs
    ``0 / 0 = NaN`` upstream, and here). Args: ``hidden_states`` ``(M, K)`` or None (vLLM only asserts its row
    count), ``gating_output`` ``(M, E)``. Returns ``(weights (M, k) fp32, ids (M, k) int32 or indices_type)``.

    It is the model's ``custom_routing_function`` when ``config.expert_selection_fn == "sigmoid"`` (renormalize =
    ``config.norm_topk_prob``, default True), so it runs through ``CustomRoutingRouter``, whose
    ``routing_method_type`` maps it to ``SigmoidRenorm`` / ``Sigmoid`` (``reference.routing.custom_routing_method_type``).
    Mirrors ``token_choice_with_bias`` in ``vllm/model_executor/models/cohere2_moe.py`` (vLLM 0.33.0; the model is
    absent from vLLM 0.17.0).

    Non-finite logits: no clamp upstream (``torch.topk`` ranks NaN highest): raise ValueError unless
    ``check_finite=False`` (then NaN ranks lowest, ids stay in ``[0, E)``, weights of such a row unspecified).

    Raises: SemanticsError under 0.17; ValueError for a row-count mismatch, shapes or non-finite logits.
    """
    require("Cohere2-MoE token_choice_with_bias routing", "0.33", semantics,
            upstream="vllm/model_executor/models/cohere2_moe.py")
    if hidden_states is not None and hidden_states.shape[0] != gating_output.shape[0]:
        raise ValueError(f"Number of tokens mismatch: hidden_states {hidden_states.shape[0]}, "
                         f"gating_output {gating_output.shape[0]}")
    if check_finite is not False:
        check_router_logits(gating_output)
    s = torch.sigmoid(gating_output.float())
    ids = _topk_ids(s, topk)
    w = s.gather(1, ids)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.float(), ids.to(indices_type or torch.int32)


MUSESPARK_DIVISION_EPS = 1e-15  # router_score_division_eps of MuseSpark1x's NVIDIA model (models/muse_spark/nvidia/model.py)


def musespark1x_routing(
    gating_output: torch.Tensor,
    bias: torch.Tensor,
    topk: int,
    route_scale: float,
    router_output_multiplier: float | None = None,
    router_score_normalization: str = "sigmoid",
    router_score_division_eps: float | None = None,
    *,
    is_padding: torch.Tensor | None = None,
    indices_type: torch.dtype | None = None,
    check_finite: bool | None = None,
    semantics=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MuseSpark1x's router: optional output multiplier -> sigmoid / softmax -> expert bias for the selection only
    -> top-k -> unbiased scores / (sum + eps) * route_scale.

    In fp32: ``g = gating_output.float()`` (times ``router_output_multiplier`` when given); ``s = sigmoid(g)`` or
    ``softmax(g)`` over the E experts; ids = the ``topk`` largest ``s + bias`` (lower index first on ties:
    the kernel's ``tl.argmax`` per round); ``w = s[ids] * (route_scale / (sum(s[ids]) + eps))``, ``eps`` =
    ``router_score_division_eps`` or no term when None (0.0 adds nothing). The NVIDIA model passes
    ``router_score_division_eps=1e-15`` (``MUSESPARK_DIVISION_EPS``), sigmoid, ``route_scale =
    config.routed_scaling_factor``, ``router_output_multiplier = config.output_multiplier`` (later folded into the
    router weight). ``is_padding`` (the Triton kernel's keyword): those rows get id -1 and weight 0. The kernel's output buffers
    (``topk_weights``, ``topk_ids``: allocation-free calls for CUDA graphs) are not taken: they change no value.

    Args: ``gating_output`` ``(M, E)`` floating; ``bias`` ``(E,)`` (the router's ``expert_bias``; the kernel's
    name). Returns ``(weights (M, k) fp32, ids (M,
    k) int32 or indices_type)``.

    Mirrors ``fused_musespark1x_routing`` (``vllm/models/muse_spark/common/ops/fused_routing.py``, the CUDA path of
    ``MuseSpark1xRouter._compute_routing`` in ``vllm/models/muse_spark/common/moe.py``, vLLM 0.33.0; the model is
    absent from 0.17.0), checked upstream against ``_compute_routing_native`` and a torch oracle in
    ``tests/kernels/moe/test_muse_spark_router.py``. Two recorded differences of the native (CPU) path: it computes
    in the logits' dtype (bf16 logits -> bf16 scores; the kernel converts to fp32 first) and writes ``w / denom *
    route_scale`` (the kernel ``w * (route_scale / denom)``; one rounding apart).

    Non-finite logits: no clamp upstream: raise ValueError unless ``check_finite=False`` (ids in range, NaN ranked
    lowest, weights unspecified). Raises: SemanticsError under 0.17; ValueError for a normalization other than
    sigmoid / softmax (as the router and the kernel do), a bias of the wrong shape, or non-finite logits.
    """
    require("MuseSpark1x routing", "0.33", semantics, upstream="vllm/models/muse_spark/common/moe.py")
    if router_score_normalization not in ("sigmoid", "softmax"):
        raise ValueError(f"Invalid router_score_normalization: {router_score_normalization}")
    if gating_output.dim() != 2:
        raise ValueError(f"gating_output must be 2D, got {tuple(gating_output.shape)}")
    M, E = gating_output.shape
    if tuple(bias.shape) != (E,):
        raise ValueError(f"bias must be ({E},), got {tuple(bias.shape)}")
    if check_finite is not False:
        check_router_logits(gating_output)
    g = gating_output.float()
    if router_output_multiplier is not None:
        g = g * router_output_multiplier
    s = torch.sigmoid(g) if router_score_normalization == "sigmoid" else torch.softmax(g, dim=-1)
    ids = _topk_ids(s + bias.float().unsqueeze(0), topk)
    w = s.gather(1, ids)
    denom = w.sum(dim=-1, keepdim=True)
    if router_score_division_eps is not None:
        denom = denom + router_score_division_eps
    w, ids = (w * (route_scale / denom)).float(), ids.to(indices_type or torch.int32)
    if is_padding is not None:
        w, ids = apply_padding_rows(w, ids, is_padding, semantics=semantics)
    return w, ids
