"""What every router shares: ``RoutingMethodType`` (vLLM 0.33 values), router-logit checks, the fp32 scores per
scoring function with the non-finite rule of each version (point ``routing.nonfinite_logits``), the top-k id rule
(descending score, lower index first on ties), the renormalize / scale / index-type finish, and padding rows
(point ``routing.padding_rows``)."""

from __future__ import annotations

import enum

import torch

from reference.semantics import SemanticsVersion, require

__all__ = ["RoutingMethodType", "check_router_logits", "apply_padding_rows"]


V017, V033 = SemanticsVersion.V0_17, SemanticsVersion.V0_33


_UP = "fused_moe/router/"


class RoutingMethodType(enum.IntEnum):
    """vLLM's ``RoutingMethodType`` (``fused_moe/config.py``): how a monolithic kernel must route.

    The values are vLLM 0.33.0's (the newest semantics; values are passed to FlashInfer's kernels as ints). They
    moved between releases: vLLM 0.17.0 has Default..TopK = 0..5, Custom = 6, Simulated = 7, Unspecified = 8 and no
    SigmoidRenorm / MiniMax2 / Sigmoid / DeepseekV4 (``RoutingMethodType017``). ``routing_method_type_value(name,
    semantics=...)`` gives a member's value under either version (point ``routing.routing_method_type_values``).
    """

    Default = 0  # softmax -> top-k
    Renormalize = 1  # top-k -> softmax (gpt-oss)
    DeepSeekV3 = 2  # sigmoid + bias, grouped top-k, renormalize, scale
    Llama4 = 3  # top-1 -> sigmoid
    RenormalizeNaive = 4  # softmax -> top-k -> renormalize
    TopK = 5  # top-k of the raw scores, no normalization
    SigmoidRenorm = 6  # sigmoid -> top-k -> renormalize
    MiniMax2 = 7  # sigmoid + bias -> top-k -> scaled sum-normalize (routed_scaling_factor, epsilon 1e-20)
    Sigmoid = 8  # sigmoid -> top-k, no renormalization
    Unspecified = 9
    DeepseekV4 = 100  # sqrtsoftplus + bias -> top-k -> normalize (not passed to FlashInfer)
    Custom = 101
    Simulated = 102


def check_router_logits(logits: torch.Tensor, num_experts: int | None = None) -> None:
    """Validate router logits: 2-D ``(M, E)`` floating, all finite.

    Raises:
        ValueError: wrong rank/dtype/width, or a non-finite value (names the first token and expert, and says how
            to opt out with ``check_finite=False``).
    """
    if logits.dim() != 2:
        raise ValueError(f"router logits must be 2-D (num_tokens, num_experts), got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"router logits must be floating point, got {logits.dtype}")
    if num_experts is not None and logits.shape[1] != num_experts:
        raise ValueError(f"router logits have {logits.shape[1]} experts, expected {num_experts}")
    bad = ~torch.isfinite(logits)
    if bool(bad.any()):
        t, e = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"router logits are not finite: token {t}, expert {e} is {logits[t, e].item()} "
            f"({int(bad.any(dim=1).sum())} bad tokens). Pass check_finite=False to route them anyway "
            "(ids stay in range, weights unspecified)."
        )


def _topk_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row: descending, lower index first on ties, NaN ranked lowest."""
    if k > scores.shape[-1]:
        raise ValueError(f"topk={k} is larger than the number of experts {scores.shape[-1]}")
    if k <= 0:
        raise ValueError(f"topk must be positive, got {k}")
    key = torch.where(torch.isnan(scores), torch.full_like(scores, float("-inf")), scores)
    # Stable sort keeps the lower index first among equal keys (NaN and -inf are both -inf here).
    return torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :k]


def _scores(logits: torch.Tensor, scoring_func: str, semantics=None) -> torch.Tensor:
    x = logits.float()
    if scoring_func == "softmax":
        return torch.softmax(x, dim=-1)
    if scoring_func == "sigmoid":
        return torch.sigmoid(x)
    if scoring_func == "sqrtsoftplus":
        require("scoring_func='sqrtsoftplus' (DeepSeek-V4)", "0.33", semantics,
                upstream="fused_moe/router/fused_topk_bias_router.py")
        # softplus with torch's threshold 20 (x > 20 -> x), the kernels' threshold; then sqrt.
        return torch.sqrt(torch.nn.functional.softplus(x))
    raise ValueError(f"unsupported scoring_func {scoring_func!r}; use 'softmax' or 'sigmoid' (or 'sqrtsoftplus' "
                     "under the 0.33 semantics)")


def _nonfinite_mode(check_finite: bool | None, v: SemanticsVersion, clamps: bool = True) -> str:
    """How non-finite logits are treated: "raise", "clamp" (0.33 topk_softmax/topk_sigmoid) or "rank_low" (0.17).

    ``check_finite=None`` is the version's default: raise under 0.17, clamp under 0.33 where vLLM clamps
    (``clamps``), raise elsewhere. True always raises; False never does.
    """
    if check_finite is None:
        check_finite = not (v >= SemanticsVersion.V0_33 and clamps)
    if check_finite:
        return "raise"
    return "clamp" if v >= SemanticsVersion.V0_33 and clamps else "rank_low"


def _checked_scores(logits: torch.Tensor, scoring_func: str, mode: str, v: SemanticsVersion,
                    explicit: bool) -> torch.Tensor:
    """Scores under the non-finite mode. Clamp: a NaN / +-inf score becomes 0 (``topk_softmax_kernels.cu`` and, for
    NaN only, ``topk_softplus_sqrt_kernels.cu`` of vLLM 0.33.0)."""
    if mode == "raise":
        check_router_logits(logits)
    s = _scores(logits, scoring_func, v)
    if mode == "clamp":
        if scoring_func == "sqrtsoftplus":
            # The sqrtsoftplus kernels clamp NaN only (``topk_softplus_sqrt_kernels.cu``, vLLM 0.33.0): a -inf
            # logit scores sqrt(softplus(-inf)) = 0; a +inf logit scores +inf (selected first, lower index first
            # among several), and ``_finish`` then gives that slot inf / inf = NaN and the others x / inf = 0 when
            # renormalizing (+inf * rsf without), as the kernel's ``scale = rsf / selected_sum`` does.
            s = torch.where(torch.isnan(s), torch.zeros_like(s), s)
        else:
            s = torch.where(torch.isfinite(s), s, torch.zeros_like(s))
    return s


def _finish(weights, ids, renormalize, routed_scaling_factor, indices_type):
    if renormalize:
        # A zero sum (every selected score 0: clamped rows, underflowed sigmoids) divides by 1, as the kernels do
        # (``denom = selected_sum > 0 ? selected_sum : 1`` in topk_softmax_kernels.cu of vLLM 0.17.0 and 0.33.0).
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / torch.where(total > 0, total, torch.ones_like(total))
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights.float(), ids.to(indices_type or torch.int32)


def apply_padding_rows(topk_weights: torch.Tensor, topk_ids: torch.Tensor, is_padding: torch.Tensor | None, *,
                       semantics=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Padding rows (``is_padding[t]`` True) get id -1 in every slot and weight 0; other rows are unchanged.

    ``is_padding`` is ``(M,)`` bool (vLLM's forward-context ``is_padding``, used when ``VLLM_MOE_SKIP_PADDING`` is
    set, its default "1"). The ids must be a signed dtype (``-1`` sentinel). Mirrors vLLM 0.33.0:
    ``csrc/moe/topk_softmax_kernels.cu`` (``indices[idx] = is_pad_row ? -1 : ...``),
    ``csrc/moe/topk_softplus_sqrt_kernels.cu`` (-1 and a zero row), ``router/dsv4_topk.py`` (-1, 0.0) and
    ``router/grouped_topk_router.py`` (``masked_fill(is_padding, 0)`` / ``-1`` when ``skip_padding``).

    Upstream, the ``topk_softmax`` / ``topk_sigmoid`` kernels write -1 ids but leave the weight they computed for
    the padding row; the reference's weight 0 is what the other three write, and a kernel's weight on a -1 slot is
    never used (conformance compares only the ids of padding rows).

    Raises:
        ValueError: wrong shape or dtype. SemanticsError under 0.17 (vLLM 0.17.0 has no padding rows).
    """
    require("padding rows (is_padding)", "0.33", semantics, upstream=_UP + "fused_topk_router.py")
    if is_padding is None:
        return topk_weights, topk_ids
    if is_padding.dtype != torch.bool or is_padding.shape != (topk_ids.shape[0],):
        raise ValueError(f"is_padding must be bool of shape ({topk_ids.shape[0]},), got {is_padding.dtype} "
                         f"{tuple(is_padding.shape)}")
    if not topk_ids.dtype.is_signed:
        raise ValueError(f"padding rows need a signed ids dtype for the -1 sentinel, got {topk_ids.dtype}")
    pad = is_padding.unsqueeze(1)
    return topk_weights.masked_fill(pad, 0.0), topk_ids.masked_fill(pad, -1)
