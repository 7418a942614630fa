"""Vectorized PyTorch routing, written independently of ``reference.routing`` (the harness compares the two).

Uses ``torch.topk`` directly: its tie order is unspecified, which conformance tolerates (ties accept either
expert). Ids always stay in ``[0, E)``.

Non-finite logits follow the vLLM semantics version selected the way the reference selects it
(``reference.semantics``: an explicit ``semantics=`` keyword, else the innermost ``use_semantics`` block, else
``$MOE_VLLM_SEMANTICS``, else the newest); only the selection is shared, the routing here is this module's own:

- 0.17: every op raises ``ValueError`` on NaN/inf logits by default; ``check_finite=False`` routes them anyway
  (NaN ranked lowest, weights of such a token unspecified).
- 0.33: ``fused_topk`` / ``fused_topk_bias`` clamp like vLLM 0.33.0's ``topk_softmax`` / ``topk_sigmoid`` kernels
  (``csrc/moe/topk_softmax_kernels.cu``): a NaN/+-inf score becomes 0 before selection, so ids are unique and
  weights finite; they do not raise by default. ``grouped_topk``, ``topk_softmax`` and ``llama4_routing`` have
  no clamp upstream and keep the 0.17 rule. ``check_finite=True`` raises under either version.

Renormalization divides by the selected sum, or by 1 where that sum is not positive (the kernels' ``denom``).
``is_padding`` (0.33 only) gives padding rows id -1 and weight 0.
"""

from __future__ import annotations

import torch

from reference.semantics import SemanticsError, SemanticsVersion, resolve_semantics


def _check(logits: torch.Tensor, check_finite: bool) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"router logits must be a 2-D floating tensor, got {tuple(logits.shape)} {logits.dtype}")
    if check_finite and not bool(torch.isfinite(logits).all()):
        raise ValueError("router logits contain NaN/inf; pass check_finite=False to route them anyway")


def _clamps(semantics, check_finite: bool | None) -> tuple[bool, bool]:
    """(raise on non-finite logits?, clamp non-finite scores to 0?) for fused_topk / fused_topk_bias."""
    new = resolve_semantics(semantics) >= SemanticsVersion.V0_33
    if check_finite is None:
        check_finite = not new
    return bool(check_finite), (new and not check_finite)


def _no_clamp(semantics, check_finite: bool | None) -> bool:
    """Whether to raise on non-finite logits for the ops without an upstream clamp (same under every version)."""
    resolve_semantics(semantics)  # validates an explicit version
    return check_finite is not False


def _topk(x: torch.Tensor, k: int) -> torch.Tensor:
    if not 0 < k <= x.shape[-1]:
        raise ValueError(f"topk={k} must be in [1, {x.shape[-1]}]")
    # NaN would win torch.topk; rank it lowest so ids never depend on garbage.
    x = torch.nan_to_num(x, nan=float("-inf"))
    return torch.topk(x, k, dim=-1).indices


def _score(logits: torch.Tensor, scoring_func: str, clamp: bool) -> torch.Tensor:
    x = logits.float()
    if scoring_func == "softmax":
        s = x.softmax(-1)
    elif scoring_func == "sigmoid":
        s = x.sigmoid()
    else:
        raise ValueError(f"unsupported scoring_func {scoring_func!r}")
    if clamp:
        s = s.masked_fill(~torch.isfinite(s), 0.0)
    return s


def _renorm(w: torch.Tensor) -> torch.Tensor:
    total = w.sum(-1, keepdim=True)
    return w / torch.where(total > 0, total, torch.ones_like(total))


def _pad(w, ids, is_padding, semantics):
    if is_padding is None:
        return w, ids
    if resolve_semantics(semantics) < SemanticsVersion.V0_33:
        raise SemanticsError("padding rows (is_padding) are not defined under vLLM 0.17 semantics; select 0.33")
    if is_padding.dtype != torch.bool or tuple(is_padding.shape) != (ids.shape[0],):
        raise ValueError(f"is_padding must be bool of shape ({ids.shape[0]},), got {is_padding.dtype} "
                         f"{tuple(is_padding.shape)}")
    if not ids.dtype.is_signed:
        raise ValueError(f"padding rows need a signed ids dtype, got {ids.dtype}")
    pad = is_padding.to(ids.device).unsqueeze(1)
    return w.masked_fill(pad, 0.0), ids.masked_fill(pad, -1)


def fused_topk(hidden_states, gating_output, topk, renormalize, *, scoring_func="softmax", indices_type=None,
               check_finite=None, is_padding=None, semantics=None):
    """softmax/sigmoid over the logits (fp32), top-k, optional renormalization; non-finite rule per version."""
    raises, clamp = _clamps(semantics, check_finite)
    _check(gating_output, raises)
    scores = _score(gating_output, scoring_func, clamp)
    ids = _topk(scores, topk)
    w = scores.gather(1, ids)
    if renormalize:
        w = _renorm(w)
    return _pad(w, ids.to(indices_type or torch.int32), is_padding, semantics)


def grouped_topk(hidden_states, gating_output, topk, renormalize, num_expert_group, topk_group, *,
                 scoring_func="softmax", routed_scaling_factor=1.0, e_score_correction_bias=None,
                 indices_type=None, check_finite=None, semantics=None):
    _check(gating_output, _no_clamp(semantics, check_finite))
    M, E = gating_output.shape
    if not (num_expert_group and E > num_expert_group and E % num_expert_group == 0):
        raise ValueError(f"invalid grouping E={E}, num_expert_group={num_expert_group}")
    scores = _score(gating_output, scoring_func, clamp=False)
    biased = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    groups = torch.nan_to_num(biased, nan=float("-inf")).view(M, num_expert_group, -1)
    if e_score_correction_bias is not None:
        gscore = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(-1)
    else:
        gscore = groups.amax(-1)
    keep = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, _topk(gscore, topk_group), True)
    masked = biased.masked_fill(~keep.repeat_interleave(E // num_expert_group, dim=1), float("-inf"))
    ids = _topk(masked, topk)
    w = scores.gather(1, ids)
    if renormalize:
        w = _renorm(w)
    return w * routed_scaling_factor, ids.to(indices_type or torch.int32)


def fused_topk_bias(hidden_states, gating_output, e_score_correction_bias, topk, renormalize, *,
                    scoring_func="sigmoid", routed_scaling_factor=1.0, indices_type=None, check_finite=None,
                    is_padding=None, semantics=None):
    """The biased scores choose, the unbiased scores weigh; renormalize, then scale. Non-finite rule per version."""
    if e_score_correction_bias is None and resolve_semantics(semantics) < SemanticsVersion.V0_33:
        raise SemanticsError("fused_topk_bias without a bias is not defined under vLLM 0.17 semantics; select 0.33")
    raises, clamp = _clamps(semantics, check_finite)
    _check(gating_output, raises)
    scores = _score(gating_output, scoring_func, clamp)
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    ids = _topk(choice, topk)
    w = scores.gather(1, ids)
    if renormalize:
        w = _renorm(w)
    return _pad(w * routed_scaling_factor, ids.to(indices_type or torch.int32), is_padding, semantics)


def topk_softmax(hidden_states, gating_output, topk, renormalize=True, *, indices_type=None, check_finite=None,
                 semantics=None):
    _check(gating_output, _no_clamp(semantics, check_finite))
    vals, ids = torch.topk(torch.nan_to_num(gating_output.float(), nan=float("-inf")), topk, dim=-1)
    return vals.softmax(-1), ids.to(indices_type or torch.int32)


def llama4_routing(hidden_states, gating_output, topk, renormalize=False, *, indices_type=None, check_finite=None,
                   semantics=None):
    _check(gating_output, _no_clamp(semantics, check_finite))
    vals, ids = torch.topk(torch.nan_to_num(gating_output.float(), nan=float("-inf")), topk, dim=-1)
    return vals.sigmoid(), ids.to(indices_type or torch.int32)
