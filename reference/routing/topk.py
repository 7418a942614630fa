"""Top-k over all experts: ``fused_topk`` (softmax / sigmoid), ``fused_topk_bias`` (correction bias; 0.33:
sqrtsoftplus, hash routing and the DeepSeek-V4 image-token bias), ``topk_softmax`` (the raw kernel op).

Mirrors ``vllm/model_executor/layers/fused_moe/router/fused_topk_router.py`` and ``fused_topk_bias_router.py``.
"""

from __future__ import annotations

import torch

from reference.routing.common import (
    _UP,
    _checked_scores,
    _finish,
    _nonfinite_mode,
    _topk_ids,
    apply_padding_rows,
    check_router_logits,
)
from reference.semantics import SemanticsVersion, require, resolve_semantics

__all__ = ["IMAGE_SENTINEL_COUNT", "image_token_mask", "hash_topk_ids", "fused_topk", "fused_topk_bias", "topk_softmax"]


IMAGE_SENTINEL_COUNT = 5  # "five consecutive in-vocab sentinel ids starting at image_sentinel_lo"


def image_token_mask(input_tokens: torch.Tensor | None, image_sentinel_lo: int, num_tokens: int | None = None
                     ) -> torch.Tensor:
    """``(M,)`` bool: which tokens are image tokens, i.e. ``image_sentinel_lo <= id < image_sentinel_lo + 5``.

    Ids above the block are ordinary special tokens and do not match. ``image_sentinel_lo <= 0`` disables it (all
    False). Mirrors ``fused_moe/router/fused_topk_bias_router.py::fused_topk_bias`` and the ``HAS_VL`` branch of
    ``router/dsv4_topk.py`` (vLLM 0.33.0).

    Raises:
        ValueError: ``input_tokens`` missing ("bias_vl routing requires input_tokens") or not ``(M,)`` integer.
    """
    if input_tokens is None:
        raise ValueError("bias_vl routing requires input_tokens (the token ids of the M rows)")
    if input_tokens.dim() != 1 or input_tokens.is_floating_point() or (num_tokens is not None and
                                                                 input_tokens.shape[0] != num_tokens):
        raise ValueError(f"input_tokens must be 1-D integer with {num_tokens} rows, got {input_tokens.dtype} "
                         f"{tuple(input_tokens.shape)}")
    ids = input_tokens.long()
    if image_sentinel_lo <= 0:
        return torch.zeros_like(ids, dtype=torch.bool)
    return (ids >= image_sentinel_lo) & (ids < image_sentinel_lo + IMAGE_SENTINEL_COUNT)


def hash_topk_ids(input_tokens: torch.Tensor | None, hash_indices_table: torch.Tensor, topk: int, num_experts: int,
                  *, skip: torch.Tensor | None = None, semantics=None) -> torch.Tensor:
    """DeepSeek-V4 hash routing: ``hash_indices_table[input_tokens]``, a lookup (``(M, topk)``, the table's dtype).

    Args:
        input_tokens: ``(M,)`` token ids (any integer dtype; vLLM casts them to the table's dtype).
        hash_indices_table: ``(vocab, topk)`` integer expert ids (``tid2eid``), each in ``[0, E)``.
        skip: ``(M,)`` bool rows whose id is not looked up (image or padding rows; they read row 0, as vLLM's
            ``safe_ids``, and the caller overwrites them).

    Raises:
        ValueError: missing ``input_tokens``, table width != topk, a token id outside ``[0, vocab)`` or a table entry
            outside ``[0, E)`` on a looked-up row. SemanticsError under 0.17.

    Mirrors ``fused_topk_bias`` (``topk_indices = hash_indices_table[input_tokens]``) and the ``USE_HASH`` path of
    ``csrc/moe/topk_softplus_sqrt_kernels.cu`` (``tid2eid[token_id * k + k_idx]``), vLLM 0.33.0.
    """
    require("hash routing (hash_indices_table)", "0.33", semantics, upstream=_UP + "fused_topk_bias_router.py")
    if input_tokens is None:
        raise ValueError("hash routing needs input_tokens")
    if hash_indices_table.dim() != 2 or hash_indices_table.is_floating_point():
        raise ValueError(f"hash_indices_table must be (vocab, topk) integer, got {hash_indices_table.dtype} "
                         f"{tuple(hash_indices_table.shape)}")
    if hash_indices_table.shape[1] != topk:
        raise ValueError(f"hash_indices_table has {hash_indices_table.shape[1]} experts per token, topk is {topk}")
    tok = input_tokens.long()
    if skip is not None:
        tok = torch.where(skip.to(torch.bool), torch.zeros_like(tok), tok)
    vocab = hash_indices_table.shape[0]
    if tok.numel() and (int(tok.min()) < 0 or int(tok.max()) >= vocab):
        bad = int(((tok < 0) | (tok >= vocab)).nonzero()[0])
        raise ValueError(f"token {bad} has id {int(tok[bad])} outside the hash table's vocabulary [0, {vocab})")
    ids = hash_indices_table[tok]
    looked = ids if skip is None else ids[~skip.to(torch.bool)]
    if looked.numel() and (int(looked.min()) < 0 or int(looked.max()) >= num_experts):
        raise ValueError(f"hash_indices_table holds expert ids outside [0, {num_experts})")
    return ids


def _padded(w: torch.Tensor, ids: torch.Tensor, is_padding: torch.Tensor | None,
            v) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w, ids)`` with the padding rows' routes replaced (``apply_padding_rows``) when ``is_padding`` is given."""
    if is_padding is None:
        return w, ids
    return apply_padding_rows(w, ids, is_padding, semantics=v)


def fused_topk(
    hidden_states: torch.Tensor | None,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    *,
    scoring_func: str = "softmax",
    indices_type: torch.dtype | None = None,
    check_finite: bool | None = None,
    is_padding: torch.Tensor | None = None,
    semantics: SemanticsVersion | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score all experts, keep the top ``topk`` per token, optionally renormalize.

    Args:
        hidden_states: ``(M, K)`` or None; only its row count is checked (vLLM's signature carries it).
        gating_output: ``(M, E)`` router logits, any floating dtype (scored in fp32).
        topk: experts per token, ``1 <= topk <= E``.
        renormalize: divide the k weights by their sum (a zero sum divides by 1).
        scoring_func: ``"softmax"`` (over all E) or ``"sigmoid"``.
        indices_type: dtype of the ids (int32 by default).
        check_finite: None: the version's rule; True: raise on NaN/inf; False: never raise (module doc).
        is_padding: ``(M,)`` bool, 0.33 only: padding rows get id -1 and weight 0 (``apply_padding_rows``).
        semantics: version (default ``reference.semantics.current_semantics()``).

    Returns:
        ``(topk_weights (M, topk) fp32, topk_ids (M, topk) int32)``; per token in descending score order.

    Raises:
        ValueError: bad shapes, topk out of range, unknown scoring_func, non-finite logits (see module doc).
        SemanticsError: ``is_padding`` under 0.17.

    Mirrors ``vllm/model_executor/layers/fused_moe/router/fused_topk_router.py::fused_topk``. Versions differ in the
    non-finite rule (point ``routing.nonfinite_logits``: 0.17.0 raises / unspecified, 0.33.0 clamps,
    ``csrc/moe/topk_softmax_kernels.cu``) and padding rows (``routing.padding_rows``, 0.33.0 only).
    """
    v = resolve_semantics(semantics)
    mode = _nonfinite_mode(check_finite, v)
    if hidden_states is not None and hidden_states.shape[0] != gating_output.shape[0]:
        raise ValueError(
            f"hidden_states has {hidden_states.shape[0]} tokens but gating_output has {gating_output.shape[0]}"
        )
    if scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"unsupported scoring_func {scoring_func!r} for fused_topk; use 'softmax' or 'sigmoid'")
    scores = _checked_scores(gating_output, scoring_func, mode, v, check_finite is False)
    ids = _topk_ids(scores, topk)
    w, ids = _finish(scores.gather(1, ids), ids, renormalize, 1.0, indices_type)
    return _padded(w, ids, is_padding, v)


def fused_topk_bias(
    hidden_states: torch.Tensor | None,
    gating_output: torch.Tensor,
    e_score_correction_bias: torch.Tensor | None,
    topk: int,
    renormalize: bool,
    *,
    scoring_func: str = "sigmoid",
    routed_scaling_factor: float = 1.0,
    indices_type: torch.dtype | None = None,
    check_finite: bool | None = None,
    input_tokens: torch.Tensor | None = None,
    hash_indices_table: torch.Tensor | None = None,
    bias_vl: torch.Tensor | None = None,
    image_sentinel_lo: int = 0,
    is_padding: torch.Tensor | None = None,
    semantics: SemanticsVersion | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k where the *biased* scores choose the experts and the *unbiased* scores are the weights.

    Weights are renormalized (if asked; a zero sum divides by 1) and then multiplied by ``routed_scaling_factor``.
    ``e_score_correction_bias`` is ``(E,)`` (fp32 in real checkpoints; added in fp32). Mirrors vLLM
    ``fused_moe/router/fused_topk_bias_router.py::fused_topk_bias``.

    Under the 0.33 semantics (vLLM 0.33.0: ``fused_topk_bias_router.py``, ``router/dsv4_topk.py``,
    ``csrc/moe/topk_softplus_sqrt_kernels.cu``; ``SemanticsError`` under 0.17, which has none of them):

    - ``scoring_func="sqrtsoftplus"`` (DeepSeek-V4, point ``routing.sqrtsoftplus``): score =
      ``sqrt(softplus(x))`` in fp32, softplus(x) = x for x > 20 else log(1 + exp(x)). Non-finite (vLLM 0.33.0's
      ``topk_softplus_sqrt_kernels.cu``): a NaN score is 0 (the kernels' clamp), a -inf logit scores 0, a +inf
      logit scores +inf and is selected first; renormalizing then gives its slot a NaN weight and every other slot
      0 (``rsf / inf``), without renormalization its weight is +inf. The
      ``e_score_correction_bias`` may be None (no bias).
    - Hash routing (``hash_indices_table`` ``(vocab, topk)`` int, ``input_tokens`` ``(M,)`` int (vLLM's name); point
      ``routing.hash_routing``; sqrtsoftplus only, as on CUDA): ids = ``hash_indices_table[input_tokens]`` (a lookup:
      no score decides, order kept); weights = the unbiased scores of those ids, renormalized, scaled. An id
      outside ``[0, vocab)`` raises.
    - Image-token bias (``bias_vl`` ``(E,)`` fp32, ``image_sentinel_lo > 0``; point ``routing.image_token_bias``;
      sqrtsoftplus only): a token whose id is in ``[image_sentinel_lo, image_sentinel_lo + 5)`` chooses by
      ``score + bias_vl`` instead of ``score + e_score_correction_bias`` and, with a hash table, instead of the
      lookup. ``image_sentinel_lo == 0`` disables it.
    - ``is_padding`` ``(M,)`` bool (point ``routing.padding_rows``): padding rows get id -1 and weight 0.

    Ties: lower expert index first (the kernels' argmax). The CUDA sqrtsoftplus kernel returns ``(s + b) - b`` as
    the weight of a biased choice (not ``s``), so weights may differ from the reference in the last bits.
    """
    v = resolve_semantics(semantics)
    new_feature = (scoring_func == "sqrtsoftplus" or hash_indices_table is not None or bias_vl is not None
                   or is_padding is not None or e_score_correction_bias is None)
    if new_feature:
        require("fused_topk_bias with sqrtsoftplus / hash_indices_table / bias_vl / is_padding / no bias", "0.33",
                v, upstream="fused_moe/router/fused_topk_bias_router.py")
    if (hash_indices_table is not None or bias_vl is not None) and scoring_func != "sqrtsoftplus":
        raise ValueError("hash_indices_table and bias_vl are defined with scoring_func='sqrtsoftplus' only (vLLM "
                         "0.33.0's CUDA topk_softmax / topk_sigmoid kernels take neither)")
    mode = _nonfinite_mode(check_finite, v)
    scores = _checked_scores(gating_output, scoring_func, mode, v, check_finite is False)
    M, E = scores.shape
    if e_score_correction_bias is not None:
        choice = scores + e_score_correction_bias.float().unsqueeze(0)
    else:
        choice = scores

    image = None
    if bias_vl is not None and image_sentinel_lo > 0:
        image = image_token_mask(input_tokens, image_sentinel_lo, M)
        choice = torch.where(image.unsqueeze(-1), scores + bias_vl.float().unsqueeze(0), choice)
    if hash_indices_table is not None:
        skip = image
        if is_padding is not None:
            pad = is_padding.to(torch.bool)
            skip = pad if skip is None else (skip | pad)
        ids = hash_topk_ids(input_tokens, hash_indices_table, topk, E, skip=skip, semantics=v)
        if image is not None:
            ids = torch.where(image.unsqueeze(-1), _topk_ids(choice, topk), ids)
    else:
        ids = _topk_ids(choice, topk)
    w, ids = _finish(scores.gather(1, ids), ids, renormalize, routed_scaling_factor, indices_type)
    return _padded(w, ids, is_padding, v)


def topk_softmax(
    hidden_states: torch.Tensor | None,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool = True,
    *,
    indices_type: torch.dtype | None = None,
    check_finite: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss routing (``RoutingMethodType.Renormalize``): top-k of the raw logits, softmax over those k (fp32).

    Mathematically equal to softmax -> top-k -> renormalize, but rounded differently; ``renormalize`` is accepted
    for signature compatibility and must be True.
    """
    if not renormalize:
        raise ValueError("topk_softmax always normalizes over the selected k; renormalize=False is not defined")
    if check_finite is not False:  # no clamp upstream in 0.17.0 or 0.33.0: raises under both
        check_router_logits(gating_output)
    logits = gating_output.float()
    ids = _topk_ids(logits, topk)
    w = torch.softmax(logits.gather(1, ids), dim=-1)
    return w.float(), ids.to(indices_type or torch.int32)
