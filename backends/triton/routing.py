"""``fused_topk`` as a Triton kernel: softmax / sigmoid scores in fp32, top-k, optional renormalization.

Same signature and semantics as ``reference.routing.fused_topk`` (vLLM
``fused_moe/router/fused_topk_router.py::fused_topk`` / the ``topk_softmax`` CUDA kernel): experts chosen by
descending fp32 score, the lower expert index first among equal scores, NaN scores ranked below every other score
(``check_finite=False``), weights fp32, ids int32 (or ``indices_type``), per token in descending score order.

One program handles ``BLOCK_T`` tokens x all ``E`` experts (padded to a power of two); the top-k is ``topk``
rounds of (row max, lowest index attaining it, mask it out).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host import INTERPRET, cdiv, check_device, next_pow2
from .jit import FP_FUSION

__all__ = ["fused_topk"]


@triton.jit
def _fused_topk_kernel(logits_ptr, w_ptr, ids_ptr, M, E, stride_lm, stride_wm, stride_im,
                       TOPK: tl.constexpr, TOPK_P2: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                       SIGMOID: tl.constexpr, RENORM: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    rmask = rows < M
    cmask = cols < E
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_lm + cols[None, :],
                mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    if SIGMOID:
        s = 1.0 / (1.0 + tl.exp(-x))
    else:
        xm = tl.where(cmask[None, :], x, float("-inf"))
        mx = tl.max(xm, axis=1)
        ex = tl.where(cmask[None, :], tl.exp(xm - mx[:, None]), 0.0)
        den = tl.sum(ex, axis=1)
        s = tl.math.div_rn(ex, tl.broadcast_to(den[:, None], ex.shape))
    # ranking key: NaN and padding columns rank lowest; chosen experts are removed via `taken`
    key = tl.where((s != s) | (~cmask[None, :]), float("-inf"), s)
    taken = ~cmask[None, :] & (rows[:, None] >= 0)
    kcols = tl.arange(0, TOPK_P2)
    out_w = tl.zeros([BLOCK_T, TOPK_P2], dtype=tl.float32)
    out_i = tl.zeros([BLOCK_T, TOPK_P2], dtype=tl.int32)
    for j in tl.static_range(TOPK):
        live = tl.where(taken, float("-inf"), key)
        best = tl.max(live, axis=1)
        cand = (~taken) & (live == best[:, None])
        idx = tl.min(tl.where(cand, cols[None, :], E_PAD), axis=1)
        hit = cols[None, :] == idx[:, None]
        wj = tl.sum(tl.where(hit, s, 0.0), axis=1)
        taken = taken | hit
        out_w = tl.where(kcols[None, :] == j, wj[:, None], out_w)
        out_i = tl.where(kcols[None, :] == j, idx[:, None], out_i)
    if RENORM:
        tot = tl.sum(tl.where(kcols[None, :] < TOPK, out_w, 0.0), axis=1)
        out_w = tl.math.div_rn(out_w, tl.broadcast_to(tot[:, None], out_w.shape))
    omask = rmask[:, None] & (kcols[None, :] < TOPK)
    tl.store(w_ptr + rows[:, None].to(tl.int64) * stride_wm + kcols[None, :], out_w, mask=omask)
    tl.store(ids_ptr + rows[:, None].to(tl.int64) * stride_im + kcols[None, :],
             out_i.to(ids_ptr.dtype.element_ty), mask=omask)


def fused_topk(
    hidden_states: torch.Tensor | None,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    *,
    scoring_func: str = "softmax",
    indices_type: torch.dtype | None = None,
    check_finite: bool | None = None,
    semantics=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score all experts, keep the top ``topk`` per token, optionally renormalize (Triton kernel).

    Args:
        hidden_states: ``(M, K)`` or None; only its row count is checked.
        gating_output: ``(M, E)`` router logits, any floating dtype (scored in fp32), CUDA (CPU when interpreting).
        topk: ``1 <= topk <= E``. renormalize: divide the k weights by their sum.
        scoring_func: ``"softmax"`` or ``"sigmoid"``. indices_type: dtype of the ids (int32 default; int64 ok).
        check_finite: raise on NaN/inf logits (a device sync). None follows the vLLM semantics version
            (``reference.semantics``: 0.17 raises; 0.33 clamps non-finite scores to 0, as vLLM 0.33.0's topk_softmax
            kernel: unique in-range ids, finite weights). False never raises (0.33: clamps; 0.17: ranks NaN lowest).
        semantics: the vLLM semantics version (default: ``use_semantics`` / ``MOE_VLLM_SEMANTICS`` / the newest).

    Returns:
        ``(topk_weights (M, topk) fp32, topk_ids (M, topk))``, descending score order per token.

    Raises:
        ValueError: bad shapes, topk out of range, unknown scoring_func, non-finite logits, unsupported indices_type.
    """
    if gating_output.dim() != 2 or not gating_output.is_floating_point():
        raise ValueError(f"router logits must be a 2-D floating tensor, got {gating_output.dtype} "
                         f"{tuple(gating_output.shape)}")
    M, E = gating_output.shape
    if hidden_states is not None and hidden_states.shape[0] != M:
        raise ValueError(f"hidden_states has {hidden_states.shape[0]} tokens but gating_output has {M}")
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= E:
        raise ValueError(f"topk must be an int in [1, {E}], got {topk!r}")
    if scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"unsupported scoring_func {scoring_func!r}; use 'softmax' or 'sigmoid'")
    itype = indices_type or torch.int32
    if itype not in (torch.int32, torch.int64):
        raise ValueError(f"indices_type must be torch.int32 or torch.int64, got {itype}")
    check_device(gating_output, what="gating_output")
    from reference.semantics import SemanticsVersion, resolve_semantics

    clamp_033 = resolve_semantics(semantics) >= SemanticsVersion.V0_33
    if check_finite is None:
        check_finite = not clamp_033
    clamp = clamp_033 and not check_finite
    if check_finite and M and not bool(torch.isfinite(gating_output).all()):
        bad = (~torch.isfinite(gating_output)).nonzero()[0].tolist()
        raise ValueError(f"router logits are not finite: token {bad[0]}, expert {bad[1]}. Pass check_finite=False "
                         "to route them anyway (ids stay in range, weights unspecified).")
    logits = gating_output if gating_output.stride(-1) == 1 else gating_output.contiguous()
    w = torch.empty((M, topk), dtype=torch.float32, device=logits.device)
    ids = torch.empty((M, topk), dtype=itype, device=logits.device)
    if M == 0:
        return w, ids
    e_pad = next_pow2(E)
    budget = 2048 if INTERPRET else 8192
    block_t = max(1, min(64, budget // e_pad, next_pow2(M)))
    block_t = 1 << (block_t.bit_length() - 1)
    _fused_topk_kernel[(cdiv(M, block_t),)](
        logits, w, ids, M, E, logits.stride(0), w.stride(0), ids.stride(0),
        TOPK=topk, TOPK_P2=next_pow2(topk), E_PAD=e_pad, BLOCK_T=block_t,
        SIGMOID=scoring_func == "sigmoid", RENORM=bool(renormalize), **FP_FUSION,
    )
    if clamp:
        bad = ~torch.isfinite(logits).all(-1)
        if bool(bad.any()):  # rare, off the hot path: vLLM 0.33's clamp for the rows with non-finite logits
            x = logits[bad].float()
            sc = x.sigmoid() if scoring_func == "sigmoid" else x.softmax(-1)
            sc = sc.masked_fill(~torch.isfinite(sc), 0.0)
            # vLLM's kernel breaks ties (all clamped scores are 0) by the lower index: a stable sort, not topk.
            bw, bi = sc.sort(dim=-1, descending=True, stable=True)
            bw, bi = bw[:, :topk], bi[:, :topk]
            if renormalize:
                tot = bw.sum(-1, keepdim=True)
                bw = bw / torch.where(tot > 0, tot, torch.ones_like(tot))
            w[bad], ids[bad] = bw, bi.to(itype)
    return w, ids
