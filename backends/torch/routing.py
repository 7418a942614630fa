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
  weights finite; they do not raise by default. sqrtsoftplus clamps NaN only (+inf is selected first, NaN weight
  after renormalization). ``grouped_topk`` follows the single-group kernels' rule where they run (a bias, one
  group, ``csrc/moe/grouped_topk_kernels.cu``) and raises elsewhere; ``topk_softmax`` and ``llama4_routing`` have
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


# vLLM 0.33.0 csrc/moe/grouped_topk_kernels.cu single_group_topk tiers: (max experts, max top-k).
_SG_TIERS = {"sigmoid": [(128, 8), (256, 8), (384, 8), (512, 8), (512, 22), (768, 16), (896, 16), (1024, 16)],
             "softmax": [(128, 4), (128, 8), (160, 8), (256, 8), (256, 16), (512, 8), (512, 16), (512, 22),
                         (512, 32), (576, 8), (768, 16), (896, 16), (1024, 16)]}


def _single_group(gating_output, bias, topk, renormalize, scoring_func, rsf):
    """vLLM 0.33 single-group kernels: invalid (non-finite input or bias) experts get -inf / weight 0."""
    x = gating_output.float()
    b = bias.float()[None, :]
    s = x.sigmoid() if scoring_func == "sigmoid" else x.softmax(-1)
    ok = torch.isfinite(x if scoring_func == "sigmoid" else s) & torch.isfinite(b) & torch.isfinite(s + b)
    key = (s + b).masked_fill(~ok, float("-inf"))
    # stable descending sort: equal keys (the -inf of invalid experts) keep the lower index first
    ids = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :topk]
    okk = ok.gather(1, ids)
    w = s.gather(1, ids).masked_fill(~okk, 0.0)
    w = w * (rsf / (w.sum(-1, keepdim=True) + 1e-20)) if renormalize else w * rsf
    empty = ~okk.any(-1, keepdim=True)
    return w.masked_fill(empty, 1.0 / topk if renormalize else 0.0), ids


def grouped_topk(hidden_states, gating_output, topk, renormalize, num_expert_group, topk_group, *,
                 scoring_func="softmax", routed_scaling_factor=1.0, e_score_correction_bias=None,
                 indices_type=None, check_finite=None, semantics=None):
    """Grouped top-k. Under 0.33 with a bias and one group (Kimi-K2), E / k within the fused kernel's tiers,
    non-finite logits or bias follow the single-group kernels' rule (invalid expert: weight 0, ranked last; no
    valid expert: ids 0..k-1, weights 1/k or 0); elsewhere they raise unless ``check_finite=False``."""
    E = gating_output.shape[-1]
    sg = (resolve_semantics(semantics) >= SemanticsVersion.V0_33 and check_finite is not True
          and e_score_correction_bias is not None and num_expert_group == 1 and topk_group == 1 and E > 1
          and any(E <= te and topk <= tk for te, tk in _SG_TIERS.get(scoring_func, [])))
    if sg:
        _check(gating_output, False)
        bad = ~(torch.isfinite(gating_output).all(-1) & bool(torch.isfinite(e_score_correction_bias).all()))
        if bool(bad.any()):
            w, ids = _single_group(gating_output, e_score_correction_bias, topk, renormalize, scoring_func,
                                   routed_scaling_factor)
            if not bool(bad.all()):
                w0, ids0 = grouped_topk(hidden_states, gating_output.masked_fill(bad[:, None], 0.0), topk,
                                        renormalize, 1, 1, scoring_func=scoring_func,
                                        routed_scaling_factor=routed_scaling_factor,
                                        e_score_correction_bias=e_score_correction_bias, check_finite=True,
                                        semantics=semantics)
                w = torch.where(bad[:, None], w, w0)
                ids = torch.where(bad[:, None], ids, ids0.long())
            return w, ids.to(indices_type or torch.int32)
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
                    input_tokens=None, hash_indices_table=None, bias_vl=None, image_sentinel_lo=0,
                    is_padding=None, semantics=None):
    """The biased scores choose, the unbiased scores weigh; renormalize, then scale. Non-finite rule per version.

    0.33 only: ``scoring_func="sqrtsoftplus"`` (DeepSeek-V4: sqrt(softplus(x)), softplus linear above 20; a NaN
    score is 0, a +inf logit stays +inf), hash routing (ids = ``hash_indices_table[input_tokens]``) and the image
    bias (tokens with id in ``[image_sentinel_lo, image_sentinel_lo + 5)`` choose by ``score + bias_vl``)."""
    new = resolve_semantics(semantics) >= SemanticsVersion.V0_33
    extras = scoring_func == "sqrtsoftplus" or hash_indices_table is not None or bias_vl is not None
    if (e_score_correction_bias is None or extras) and not new:
        raise SemanticsError("fused_topk_bias without a bias, sqrtsoftplus, hash routing and bias_vl are not defined "
                             "under vLLM 0.17 semantics; select 0.33")
    if scoring_func == "sqrtsoftplus":
        _check(gating_output, check_finite is True)
        x = gating_output.float()
        scores = torch.where(x > 20, x, torch.log1p(torch.exp(torch.clamp(x, max=20)))).sqrt()
        scores = torch.nan_to_num(scores, nan=0.0, posinf=float("inf"), neginf=float("-inf"))
    else:
        raises, clamp = _clamps(semantics, check_finite)
        _check(gating_output, raises)
        scores = _score(gating_output, scoring_func, clamp)
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    image = None
    if bias_vl is not None and image_sentinel_lo > 0:
        if input_tokens is None:
            raise ValueError("bias_vl routing requires input_tokens")
        tok = input_tokens.long()
        image = (tok >= image_sentinel_lo) & (tok < image_sentinel_lo + 5)
        choice = torch.where(image[:, None], scores + bias_vl.float(), choice)
    if hash_indices_table is not None:
        if input_tokens is None:
            raise ValueError("hash routing requires input_tokens")
        tok = input_tokens.long()
        if image is not None:
            tok = tok.masked_fill(image, 0)
        if is_padding is not None:
            tok = tok.masked_fill(is_padding.to(tok.device), 0)
        if tok.numel() and (int(tok.min()) < 0 or int(tok.max()) >= hash_indices_table.shape[0]):
            raise ValueError("a token id is outside the hash table")
        ids = hash_indices_table.long()[tok]
        if image is not None:
            ids = torch.where(image[:, None], _topk(choice, topk), ids)
    else:
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


# ------------------------------------------------------------------------------------------------------------------
# vLLM 0.33 routing pieces (each raises SemanticsError under 0.17, which has none of them)


def _require_033(what, semantics):
    if resolve_semantics(semantics) < SemanticsVersion.V0_33:
        raise SemanticsError(f"{what} is not defined under vLLM 0.17 semantics; select 0.33")


def apply_padding_rows(topk_weights, topk_ids, is_padding, *, semantics=None):
    """Padding rows: id -1, weight 0 (vLLM 0.33 ``is_padding``)."""
    _require_033("padding rows", semantics)
    return _pad(topk_weights, topk_ids, is_padding, semantics)


def append_fused_shared_experts(topk_weights, topk_ids, global_num_experts, num_fused_shared_experts,
                                shared_expert_weight=1.0, *, semantics=None):
    """Append ids ``E .. E+n-1`` with weight ``shared_expert_weight`` to every row (vLLM 0.33 FusedTopKBiasRouter)."""
    _require_033("fused shared-expert slots", semantics)
    n = int(num_fused_shared_experts)
    if n < 0:
        raise ValueError("num_fused_shared_experts must be >= 0")
    m = topk_ids.shape[0]
    sid = (global_num_experts + torch.arange(n, device=topk_ids.device)).to(topk_ids.dtype).repeat(m, 1)
    sw = topk_weights.new_full((m, n), shared_expert_weight)
    return torch.cat((topk_weights, sw), 1), torch.cat((topk_ids, sid), 1)


def gemma4_routing(gating_output, topk, per_expert_scale, *, check_finite=None, semantics=None):
    """Gemma4: top-k of the logits, softmax over those k (fp32), times ``per_expert_scale[id]``."""
    _require_033("Gemma4 routing", semantics)
    _check(gating_output, check_finite is not False)
    vals, ids = torch.topk(torch.nan_to_num(gating_output.float(), nan=float("-inf")), topk, dim=-1)
    w = (vals - vals[:, :1]).exp()
    w = w / w.sum(-1, keepdim=True)
    return w * per_expert_scale.float()[ids], ids.to(torch.int32)


def minimax2_routing(gating_output, e_score_correction_bias, topk, routed_scaling_factor=1.0, *, check_finite=None,
                     indices_type=None, semantics=None):
    """RoutingMethodType.MiniMax2: sigmoid + bias choose, ``w = s * rsf / (sum s + 1e-20)``."""
    _require_033("MiniMax2 routing", semantics)
    _check(gating_output, check_finite is not False)
    s = gating_output.float().sigmoid()
    ids = _topk(s + e_score_correction_bias.float(), topk)
    w = s.gather(1, ids)
    return w * (routed_scaling_factor / (w.sum(-1, keepdim=True) + 1e-20)), ids.to(indices_type or torch.int32)


def eplb_logical_to_physical(topk_ids, logical_to_physical_map, logical_replica_count, *, expert_load_view=None,
                             record_enabled=True, num_unpadded_tokens=None, semantics=None):
    """EPLB (vLLM 0.33 ``_eplb_map_and_record_i32_kernel``): replica ``(t * 2654435769 mod 2^32) mod count`` of token
    t; invalid logical ids map to -1; counted when recording, ``t < num_unpadded_tokens`` and in range."""
    _require_033("EPLB ids (0.33 rule)", semantics)
    M, k = topk_ids.shape
    L = logical_replica_count.numel()
    lid = topk_ids.long()
    ok = (lid >= 0) & (lid < L)
    lid0 = lid.clamp(0, max(L - 1, 0))
    tok = torch.arange(M, device=lid.device)[:, None].expand(M, k)
    rep = ((tok * 2654435769) % (1 << 32)) % logical_replica_count.long()[lid0].clamp(min=1)
    phys = logical_to_physical_map.long()[lid0, rep].masked_fill(~ok, -1)
    if expert_load_view is not None and record_enabled:
        use = (phys >= 0) & (phys < expert_load_view.numel())
        if num_unpadded_tokens is not None:
            use &= tok < num_unpadded_tokens
        expert_load_view += torch.bincount(phys[use], minlength=expert_load_view.numel()).to(expert_load_view.dtype)
    return phys.to(topk_ids.dtype)


def token_choice_with_bias(hidden_states, gating_output, topk, renormalize, *, indices_type=None, check_finite=None,
                           semantics=None):
    """Cohere2-MoE (vLLM 0.33 ``models/cohere2_moe.py``): sigmoid -> top-k -> plain renormalization (no guard)."""
    _require_033("Cohere2-MoE token_choice_with_bias", semantics)
    if hidden_states is not None and hidden_states.shape[0] != gating_output.shape[0]:
        raise ValueError("Number of tokens mismatch")
    _check(gating_output, check_finite is not False)
    s = torch.nan_to_num(gating_output.float().sigmoid(), nan=float("-inf"))
    w, ids = torch.topk(s, topk, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w, ids.to(indices_type or torch.int32)


def musespark1x_routing(gating_output, bias, topk, route_scale, router_output_multiplier=None,
                        router_score_normalization="sigmoid", router_score_division_eps=None, *, is_padding=None,
                        indices_type=None, check_finite=None, semantics=None):
    """MuseSpark1x (vLLM 0.33 ``models/muse_spark``): [x * m] -> sigmoid|softmax -> bias chooses -> scores / (sum +
    eps) * route_scale; ``is_padding`` rows id -1, weight 0."""
    _require_033("MuseSpark1x routing", semantics)
    if router_score_normalization not in ("sigmoid", "softmax"):
        raise ValueError(f"Invalid router_score_normalization: {router_score_normalization}")
    _check(gating_output, check_finite is not False)
    x = gating_output.float()
    if router_output_multiplier is not None:
        x = x * router_output_multiplier
    s = x.sigmoid() if router_score_normalization == "sigmoid" else x.softmax(-1)
    ids = _topk(s + bias.float(), topk)
    w = s.gather(1, ids)
    tot = w.sum(-1, keepdim=True) + (router_score_division_eps or 0.0)
    return _pad(w * (route_scale / tot), ids.to(indices_type or torch.int32), is_padding, semantics)


def zero_expert_router(hidden_states, router_logits, top_k, e_score_correction_bias, num_logical_experts,
                       zero_expert_type="identity", *, scoring_func="softmax", renormalize=False,
                       routed_scaling_factor=1.0, indices_type=None, check_finite=None, semantics=None):
    """vLLM 0.33 ``ZeroExpertRouter``: biased top-k over real + zero experts, scale, identity output of the zero
    slots (whole 256-column blocks, as the Triton kernel's grid), then zero slots -> id 0, weight 0."""
    _require_033("ZeroExpertRouter", semantics)
    if zero_expert_type != "identity":
        raise ValueError(f"zero_expert_type {zero_expert_type!r} is not defined")
    w, ids = fused_topk_bias(hidden_states, router_logits, e_score_correction_bias, top_k, renormalize,
                             scoring_func=scoring_func, indices_type=indices_type, check_finite=check_finite,
                             semantics=semantics)
    w = w * routed_scaling_factor
    zero = ids.long() >= num_logical_experts
    scale = (w * zero).sum(-1, keepdim=True)
    K = hidden_states.shape[-1]
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    cols = K // 256 * 256
    out[:, :cols] = hidden_states[:, :cols].float() * scale
    return w.masked_fill(zero, 0.0), ids.masked_fill(zero, 0), out.to(hidden_states.dtype)


def grouped_topk_router(hidden_states, router_logits, top_k, num_expert_group, topk_group, *, renormalize=True,
                        scoring_func="softmax", routed_scaling_factor=1.0, e_score_correction_bias=None,
                        indices_type=None, is_padding=None, skip_padding=False, check_finite=None, semantics=None):
    """GroupedTopKRouter: grouped top-k on a valid grouping (E > G, G | E), else the fallback: softmax top-k
    unscaled (no bias) or the biased top-k (0.17: softmax, 0.33: the layer's scoring) then scaled. Padding rows
    (0.33, ``skip_padding``) masked on the grouped path only."""
    new = resolve_semantics(semantics) >= SemanticsVersion.V0_33
    E = router_logits.shape[-1]
    if not (E > num_expert_group and E % num_expert_group == 0):
        if e_score_correction_bias is None:
            return fused_topk(hidden_states, router_logits, top_k, renormalize, indices_type=indices_type,
                              check_finite=check_finite, semantics=semantics)
        w, ids = fused_topk_bias(hidden_states, router_logits, e_score_correction_bias, top_k, renormalize,
                                 scoring_func=scoring_func if new else "softmax", check_finite=check_finite,
                                 semantics=semantics)
        return w * routed_scaling_factor, ids.to(indices_type or torch.int32)
    w, ids = grouped_topk(hidden_states, router_logits, top_k, renormalize, num_expert_group, topk_group,
                          scoring_func=scoring_func, routed_scaling_factor=routed_scaling_factor,
                          e_score_correction_bias=e_score_correction_bias, indices_type=indices_type,
                          check_finite=check_finite, semantics=semantics)
    if is_padding is not None and skip_padding:
        w, ids = _pad(w, ids, is_padding, semantics)
    return w, ids
