"""MoE activation functions (vLLM ``MoEActivation``) with their exact formulas.

Mirrors ``vllm/model_executor/layers/fused_moe/activation.py`` and the kernels in
``vllm/model_executor/layers/activation.py`` (vLLM 0.17-0.33). ``SITU`` and ``GELU_TANH_NO_MUL`` are vLLM 0.33
members: under the 0.17 semantics (``reference.semantics``) applying them raises ``SemanticsError``.

Numerics: every activation reads its input in the input dtype, computes in fp32 and rounds the result once to
the input dtype, as vLLM's fused epilogues and its ``swigluoai_and_mul`` kernel do. Its ``silu_and_mul`` (with or
without a clamp), ``gelu_and_mul`` and ``gelu_tanh_and_mul`` (csrc ``act_and_mul_kernel``: the ``ACT_FN`` returns
``scalar_t``) round ``act(g)`` to the input dtype before the multiply: ``reference.profiles``' ``per_op``
activation (profile ``torch_native_activation``), measured with ``silu_and_mul`` compiled from vLLM 0.33.0's csrc.

Gated layout: for gated activations the input is ``(..., 2d)`` and the output ``(..., d)``. The gate ``g`` is the
first half and the up projection ``u`` the second half (vLLM's packed ``w13`` = [w1; w3]), except SWIGLUOAI, whose
gate/up are *interleaved*: ``g = x[..., 0::2]``, ``u = x[..., 1::2]`` (gpt-oss checkpoints; vLLM #44893 shows
what mixing the two layouts costs).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "MoEActivation",
    "apply_moe_activation",
    "adjust_N_for_activation",
    "SWIGLUOAI_DEFAULT_ALPHA",
    "SWIGLUOAI_DEFAULT_LIMIT",
    "SWIGLUSTEP_LIMIT",
    "SITU_KIMI_K3_BETA",
    "SITU_KIMI_K3_LINEAR_BETA",
    "activation_defined",
    "GATED_ACTIVATIONS",
    "NO_MUL_ACTIVATIONS",
    "ACTIVATIONS_SINCE_033",
    "ApplyMoEActivationConfig",
    "apply_moe_activation_into",
    "apply_moe_activation_supported",
    "apply_moe_activation_masked_supported",
]

SWIGLUOAI_DEFAULT_ALPHA = 1.702
SWIGLUOAI_DEFAULT_LIMIT = 7.0
SWIGLUSTEP_LIMIT = 7.0
# Kimi-K3's SITU parameters: the values vLLM 0.33.0 bakes into its fused SITU kernel (csrc/activation_kernels.cu
# SITU_BETA / SITU_LINEAR_BETA). The generic op takes them from FusedMoEConfig.activation_situ_beta / _linear_beta.
SITU_KIMI_K3_BETA = 4.0
SITU_KIMI_K3_LINEAR_BETA = 25.0


class MoEActivation(enum.Enum):
    """The activation applied between the two expert GEMMs (vLLM ``MoEActivation``).

    ``is_gated`` is False exactly for the ``*_NO_MUL`` members (their w1 is ``(E, I, K)``, not ``(E, 2I, K)``).
    """

    SILU = "silu"
    GELU = "gelu"
    GELU_TANH = "gelu_tanh"
    RELU2 = "relu2"  # in vLLM's enum, but apply_moe_activation raises for the gated form
    SWIGLUOAI = "swigluoai"
    SWIGLUOAI_UNINTERLEAVE = "swigluoai_uninterleave"
    SWIGLUSTEP = "swiglustep"
    SILU_NO_MUL = "silu_no_mul"
    GELU_NO_MUL = "gelu_no_mul"
    RELU2_NO_MUL = "relu2_no_mul"
    # vLLM 0.33 members (declared last so that the 0.17 members keep their order).
    SITU = "situ"  # Kimi SituGLU, gated
    GELU_TANH_NO_MUL = "gelu_tanh_no_mul"

    @property
    def is_gated(self) -> bool:
        return not self.value.endswith("_no_mul")

    @classmethod
    def from_str(cls, name: str) -> "MoEActivation":
        try:
            return cls(name.lower())
        except ValueError:
            valid = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown MoE activation {name!r}; valid: {valid}") from None


#: Members vLLM 0.17.0's ``MoEActivation`` does not have (vllm/model_executor/layers/fused_moe/activation.py).
ACTIVATIONS_SINCE_033 = frozenset({MoEActivation.SITU, MoEActivation.GELU_TANH_NO_MUL})
_SINCE_033 = ACTIVATIONS_SINCE_033

#: The gated activations ``apply_moe_activation`` defines, ``(..., 2d) -> (..., d)``: every gated member but RELU2
#: (vLLM's enum has it, ``apply_moe_activation`` raises). A tuple in enum order (error messages list it).
GATED_ACTIVATIONS = tuple(a for a in MoEActivation if a.is_gated and a is not MoEActivation.RELU2)
#: The non-gated ``*_NO_MUL`` activations, ``(..., d) -> (..., d)``, in enum order.
NO_MUL_ACTIVATIONS = tuple(a for a in MoEActivation if not a.is_gated)


def activation_defined(activation: MoEActivation, semantics=None) -> bool:
    """Whether ``activation`` exists under the semantics version (``reference.semantics``; default: the current one).

    SITU and GELU_TANH_NO_MUL are vLLM 0.33 members; every other member exists under 0.17 and 0.33.
    """
    from reference.semantics import SemanticsVersion, resolve_semantics

    return activation not in _SINCE_033 or resolve_semantics(semantics) >= SemanticsVersion.V0_33


def adjust_N_for_activation(N: int, activation: MoEActivation) -> int:
    """Width of the activation output for a GEMM1 output of width ``N``.

    ``N // 2`` for gated activations, ``N`` for ``*_NO_MUL``. Mirrors
    ``FusedMoEExpertsModular.adjust_N_for_activation`` (seed 002).
    """
    return N // 2 if activation.is_gated else N


def _split_gated(x: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape[-1] % 2:
        raise ValueError(f"a gated activation needs an even last dimension, got {tuple(x.shape)}")
    if interleaved:
        return x[..., 0::2], x[..., 1::2]
    d = x.shape[-1] // 2
    return x[..., :d], x[..., d:]


def apply_moe_activation(
    activation: MoEActivation,
    x: torch.Tensor,
    *,
    alpha: float | None = None,
    beta: float | None = None,
    limit: float | None = None,
    situ_beta: float | None = None,
    situ_linear_beta: float | None = None,
    semantics=None,
) -> torch.Tensor:
    """Apply ``activation`` to the GEMM1 output ``x``.

    Args:
        activation: the ``MoEActivation``.
        x: ``(..., N)`` floating tensor (bf16/fp16/fp32). Gated activations need ``N`` even.
        alpha, beta, limit: ``gemm1_alpha`` / ``gemm1_beta`` / ``gemm1_clamp_limit`` of the quant config (seed 001).
            SILU with ``limit`` clamps ``g <= limit`` and ``|u| <= limit`` first. SWIGLUOAI defaults to
            alpha 1.702, limit 7.0; SWIGLUOAI_UNINTERLEAVE defaults to alpha 1.0, beta 0.0 (== SILU) and applies
            the clamp only when ``limit`` is given.
        situ_beta, situ_linear_beta: SITU's ``activation_situ_beta`` / ``activation_situ_linear_beta`` of vLLM 0.33's
            ``FusedMoEConfig`` (Kimi-K3: 4.0 / 25.0). ``situ_beta`` is required (vLLM asserts it); a
            ``situ_linear_beta`` of None or <= 0 means "unset": the up projection passes through, as in the kernel.
        semantics: the vLLM semantics version (``reference.semantics``); SITU and GELU_TANH_NO_MUL need 0.33.

    Returns:
        ``(..., adjust_N_for_activation(N))`` tensor in ``x.dtype``; computed in fp32, rounded once.

    Formulas (g = gate, u = up):
        SILU           silu(g) * u
        GELU           gelu_erf(g) * u;  GELU_TANH: gelu_tanh(g) * u
        SWIGLUOAI      g = min(g, L); u = clamp(u, -L, L); (u + 1) * g * sigmoid(alpha * g)   [interleaved g/u]
        SWIGLUOAI_UNINTERLEAVE  same clamps (if L given); g * sigmoid(alpha * g) * (u + beta)   [packed halves]
        SWIGLUSTEP     min(silu(g), 7) * clamp(u, -7, 7)
        SILU_NO_MUL    silu(x);  GELU_NO_MUL: gelu_erf(x);  RELU2_NO_MUL: relu(x)^2
        SITU           b * tanh(g / b) * sigmoid(g) * u',  u' = lb * tanh(u / lb) if lb > 0 else u   [b = situ_beta,
                       lb = situ_linear_beta; vLLM 0.33.0 SituAndMul.forward_native and csrc situ_activation, which
                       writes sigmoid(g) as (1 + tanh(g / 2)) / 2: the same function, computed in fp32]
        GELU_TANH_NO_MUL  gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))  (vLLM 0.33.0:
                       ``F.gelu(input, approximate="tanh")`` in apply_moe_activation)

    Raises:
        ValueError: RELU2 (gated; vLLM raises too), odd width for a gated activation, non-floating input, SITU
            without a positive ``situ_beta``.
        SemanticsError (a ValueError): SITU / GELU_TANH_NO_MUL under the 0.17 semantics.
    """
    if activation in _SINCE_033:
        from reference.semantics import require

        require(f"MoEActivation.{activation.name}", "0.33", semantics,
                upstream="vllm/model_executor/layers/fused_moe/activation.py")
    if not x.is_floating_point():
        raise ValueError(f"activation input must be floating point, got {x.dtype}")
    xf = x.float()
    A = MoEActivation
    if activation is A.RELU2:
        raise ValueError("gated RELU2 is not supported (vLLM raises too); use RELU2_NO_MUL")
    if activation is A.SILU_NO_MUL:
        y = F.silu(xf)
    elif activation is A.GELU_NO_MUL:
        y = F.gelu(xf)
    elif activation is A.RELU2_NO_MUL:
        y = torch.square(F.relu(xf))
    elif activation is A.GELU_TANH_NO_MUL:
        y = F.gelu(xf, approximate="tanh")
    else:
        g, u = _split_gated(xf, interleaved=activation is A.SWIGLUOAI)
        if activation is A.SILU:
            if limit is not None:
                g = g.clamp(max=limit)
                u = u.clamp(-limit, limit)
            y = F.silu(g) * u
        elif activation is A.GELU:
            y = F.gelu(g) * u
        elif activation is A.GELU_TANH:
            y = F.gelu(g, approximate="tanh") * u
        elif activation is A.SWIGLUOAI:
            a = SWIGLUOAI_DEFAULT_ALPHA if alpha is None else alpha
            L = SWIGLUOAI_DEFAULT_LIMIT if limit is None else limit
            g = g.clamp(max=L)
            u = u.clamp(-L, L)
            y = (u + 1.0) * g * torch.sigmoid(a * g)
        elif activation is A.SWIGLUOAI_UNINTERLEAVE:
            a = 1.0 if alpha is None else alpha
            b = 0.0 if beta is None else beta
            if limit is not None:
                g = g.clamp(max=limit)
                u = u.clamp(-limit, limit)
            y = g * torch.sigmoid(a * g) * (u + b)
        elif activation is A.SWIGLUSTEP:
            L = SWIGLUSTEP_LIMIT if limit is None else limit
            y = F.silu(g).clamp(max=L) * u.clamp(-L, L)
        elif activation is A.SITU:
            # vLLM asserts the beta is set: a missing one means the config plumbing was bypassed.
            if situ_beta is None or not situ_beta > 0:
                raise ValueError(f"SITU needs a positive situ_beta (FusedMoEConfig.activation_situ_beta), "
                                 f"got {situ_beta!r}")
            if situ_linear_beta is not None and situ_linear_beta > 0:
                u = situ_linear_beta * torch.tanh(u / situ_linear_beta)
            y = situ_beta * torch.tanh(g / situ_beta) * torch.sigmoid(g) * u
        else:  # pragma: no cover - every member is handled above
            raise ValueError(f"unhandled activation {activation}")
    return y.to(x.dtype)



# ------------------------------------------------------------------------------------------------------------
# vLLM 0.33's out-parameter form: apply_moe_activation(activation, output, input, *, activation_config, topk_ids,
# expert_map, valid_token_counts), the body of FusedMoEExpertsModular.activation (point activation.experts_signature)
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ApplyMoEActivationConfig:
    """The layer's activation parameters (vLLM 0.33 ``fused_moe/activation.py::ApplyMoEActivationConfig``).

    ``clamp_limit`` None means "no clamp"; ``alpha`` / ``beta`` default to 1.0 / 0.0; the SITU betas come from
    ``FusedMoEConfig.activation_situ_beta`` / ``activation_situ_linear_beta``.
    """

    clamp_limit: float | None = None
    alpha: float = 1.0
    beta: float = 0.0
    activation_situ_beta: float | None = None
    activation_situ_linear_beta: float | None = None

    @classmethod
    def from_configs(cls, moe_config, quant_config) -> "ApplyMoEActivationConfig":
        """The 0.33 fallbacks: the quant config's ``gemm1_clamp_limit`` / ``gemm1_alpha`` / ``gemm1_beta`` when set,
        else the layer's ``swiglu_limit`` / ``swiglu_alpha`` / ``swiglu_beta`` (``FusedMoEConfig``), else None /
        1.0 / 0.0. Mirrors ``ApplyMoEActivationConfig.from_configs`` (vLLM 0.33.0)."""
        def pick(q, m):
            v = getattr(quant_config, q, None)
            return getattr(moe_config, m, None) if v is None else v

        alpha = pick("gemm1_alpha", "swiglu_alpha")
        beta = pick("gemm1_beta", "swiglu_beta")
        return cls(clamp_limit=pick("gemm1_clamp_limit", "swiglu_limit"),
                   alpha=1.0 if alpha is None else alpha, beta=0.0 if beta is None else beta,
                   activation_situ_beta=getattr(moe_config, "activation_situ_beta", None),
                   activation_situ_linear_beta=getattr(moe_config, "activation_situ_linear_beta", None))


#: The activations vLLM 0.33's ``apply_moe_activation`` (and its masked path) accepts: every member but gated RELU2.
_APPLY_033 = frozenset(a for a in MoEActivation if a is not MoEActivation.RELU2)


def apply_moe_activation_supported(activation: MoEActivation) -> bool:
    """Whether vLLM 0.33's ``apply_moe_activation`` supports ``activation`` (every member but gated RELU2)."""
    return activation in _APPLY_033


def apply_moe_activation_masked_supported(activation: MoEActivation) -> bool:
    """Whether the masked path (``valid_token_counts``) supports ``activation``: the same set as the unmasked one
    (vLLM 0.33 ``_MASKED_MOE_ACTIVATION_NAMES``)."""
    return activation in _APPLY_033


def _params_033(activation: MoEActivation, cfg: ApplyMoEActivationConfig, *, masked: bool,
                pad_aware: bool) -> tuple[MoEActivation, dict]:
    """The (activation, keywords) of :func:`apply_moe_activation` that vLLM 0.33's kernel for this path computes."""
    A = MoEActivation
    situ = {}
    if activation is A.SITU:
        if cfg.activation_situ_beta is None:
            raise ValueError("SITU requires activation_situ_beta from FusedMoEConfig (vLLM asserts it)")
        situ = dict(situ_beta=cfg.activation_situ_beta, situ_linear_beta=cfg.activation_situ_linear_beta)
    if activation is A.SWIGLUOAI_UNINTERLEAVE and cfg.clamp_limit is None:
        raise ValueError("SWIGLUOAI_UNINTERLEAVE requires clamp_limit (gemm1_clamp_limit or swiglu_limit)")
    if activation is A.SILU and cfg.clamp_limit is not None:
        if masked:  # "silu_with_clamp": the config's alpha inside the sigmoid, its beta added to up
            return A.SWIGLUOAI_UNINTERLEAVE, dict(alpha=cfg.alpha, beta=cfg.beta, limit=cfg.clamp_limit)
        if pad_aware:  # _swiglu_limit_pad_aware: HAS_LIMIT = swiglu_limit > 0
            return A.SILU, dict(limit=cfg.clamp_limit if cfg.clamp_limit > 0 else None)
        return A.SILU, dict(limit=cfg.clamp_limit)  # silu_and_mul_with_clamp(limit, 1.0, 0.0)
    if activation is A.SWIGLUOAI_UNINTERLEAVE:
        return activation, dict(alpha=cfg.alpha, beta=cfg.beta, limit=cfg.clamp_limit)
    if activation is A.SWIGLUOAI:  # swigluoai_and_mul's defaults; the config is not read
        return activation, dict(alpha=SWIGLUOAI_DEFAULT_ALPHA, limit=SWIGLUOAI_DEFAULT_LIMIT)
    if activation is A.SWIGLUSTEP:
        return activation, dict(limit=SWIGLUSTEP_LIMIT)
    return activation, situ


def apply_moe_activation_into(
    activation: MoEActivation,
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    activation_config: ApplyMoEActivationConfig | None = None,
    topk_ids: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    valid_token_counts: torch.Tensor | None = None,
    semantics=None,
) -> torch.Tensor:
    """vLLM 0.33's ``apply_moe_activation(activation, output, input, *, activation_config, topk_ids, expert_map,
    valid_token_counts)``: the body of ``FusedMoEExpertsModular.activation``; writes ``output`` and returns it.

    Mirrors ``vllm/model_executor/layers/fused_moe/activation.py`` (0.33.0) and its kernels
    (``csrc/activation_kernels.cu``: ``silu_and_mul_with_clamp``, ``masked_moe_activation``;
    ``fused_moe/utils.py::swiglu_limit_func``). Values are :func:`apply_moe_activation`'s (fp32, one rounding) with
    the parameters each path's kernel takes (``activation_config`` None = ``ApplyMoEActivationConfig()``):

    - SILU: no ``clamp_limit``: plain. With one: unmasked ``silu(min(g, L)) * clamp(u, -L, L)`` (alpha 1, beta 0,
      the config's alpha/beta are not read); masked ``"silu_with_clamp"``: ``g' sigmoid(alpha g') (u' + beta)`` with
      the config's alpha and beta (= SWIGLUOAI_UNINTERLEAVE's formula).
    - SWIGLUOAI: alpha 1.702, limit 7.0 always (``swigluoai_and_mul``'s defaults; the config is not read).
    - SWIGLUOAI_UNINTERLEAVE: ``clamp_limit`` required; the config's alpha, beta.  SWIGLUSTEP: limit 7.0.
    - SITU: ``activation_situ_beta`` required, ``activation_situ_linear_beta`` optional.
    - GELU, GELU_TANH, the ``*_NO_MUL`` members: plain.  RELU2_NO_MUL (unmasked) also applies ``relu`` to ``input``
      in place (vLLM ``F.relu(input, inplace=True)``).

    Which rows are written:

    - ``valid_token_counts`` given (the masked path; ``topk_ids`` / ``expert_map`` then unused): ``input`` is
      ``(T, N)`` with one count, or batched ``(E, T, N)`` with one count per expert; for each expert ``e`` the rows
      ``[0, clamp(count_e, 0, T))`` are written and every later row of ``output`` is left untouched (padding of a
      batched layout: whatever ``input`` holds there is never read).
    - else, the pad-aware limit: SILU with a ``clamp_limit`` and both ``topk_ids`` and ``expert_map`` given
      (``swiglu_limit_func`` -> ``_swiglu_limit_pad_aware``) reads row ``r`` of the 2-D ``input`` as flat route ``r``
      of ``topk_ids``: rows whose id is -1 (any negative) or maps to -1 are skipped (``output`` untouched); the
      clamp applies only when ``clamp_limit > 0``.
    - else every row is written (2-D only).

    Args:
        activation: the ``MoEActivation``.
        output: ``(..., d)`` (gated) or ``(..., N)`` tensor of ``input.dtype``; written in place.
        input: ``(M, N)`` or, masked, ``(T, N)`` / ``(E, T, N)``.
        activation_config: :class:`ApplyMoEActivationConfig` (``FusedMoEExpertsModular.activation_config``).
        topk_ids: ``(M', topk)`` integer ids with ``M' * topk == M`` (pad-aware path), or None.
        expert_map: ``(E_global,)`` global -> local map, -1 = other rank, or None.
        valid_token_counts: int32 1-D: ``(E,)`` for a 3-D input, ``(1,)`` for a 2-D one.
        semantics: must resolve to 0.33 (the 0.17 ``FusedMoEExpertsModular.activation`` has none of this).

    Raises:
        ValueError: gated RELU2 (unmasked; vLLM: ValueError), shape / dtype mismatches (vLLM asserts), a missing
            SITU beta or SWIGLUOAI_UNINTERLEAVE limit, a ``topk_ids`` whose size is not ``M``, an id
            ``>= len(expert_map)`` on the pad-aware path (an out-of-bounds read upstream).
        NotImplementedError: gated RELU2 on the masked path (vLLM's message).
        SemanticsError: under the 0.17 semantics.
    """
    from reference.semantics import require

    require("apply_moe_activation(output, input, *, activation_config, topk_ids, expert_map, valid_token_counts)",
            "0.33", semantics, upstream="vllm/model_executor/layers/fused_moe/activation.py")
    cfg = ApplyMoEActivationConfig() if activation_config is None else activation_config
    masked = valid_token_counts is not None
    if activation is MoEActivation.RELU2:
        if masked:
            raise NotImplementedError("Masked MoE activation is not implemented for relu2")
        raise ValueError(f"Unsupported FusedMoe activation: {activation}")
    if masked:
        if input.dim() not in (2, 3):
            raise ValueError(f"masked input must be 2-D or 3-D, got {tuple(input.shape)}")
    elif input.dim() != 2:
        raise ValueError(f"input must be 2-D (M, N) without valid_token_counts, got {tuple(input.shape)}")
    if output.dim() != input.dim() or output.shape[:-1] != input.shape[:-1]:
        raise ValueError(f"input/output leading shapes must match: {tuple(input.shape)} vs {tuple(output.shape)}")
    want = input.size(-1) // 2 if activation.is_gated else input.size(-1)
    if (activation.is_gated and input.size(-1) % 2) or output.size(-1) != want:
        raise ValueError(f"{activation.value}: output width {output.size(-1)} for input width {input.size(-1)}; "
                         f"expected {want}")
    if input.dtype != output.dtype:
        raise ValueError(f"input and output dtypes must match: {input.dtype} vs {output.dtype}")
    pad_aware = (not masked and activation is MoEActivation.SILU and cfg.clamp_limit is not None
                 and topk_ids is not None and expert_map is not None)
    act, kw = _params_033(activation, cfg, masked=masked, pad_aware=pad_aware)

    if masked:
        counts = valid_token_counts
        if counts.dtype != torch.int32 or counts.dim() != 1:
            raise ValueError(f"valid_token_counts must be a 1-D torch.int32 tensor, got {counts.dtype} "
                             f"{tuple(counts.shape)}")
        n_groups = input.size(0) if input.dim() == 3 else 1
        if counts.numel() != n_groups:
            raise ValueError(f"valid_token_counts must have {n_groups} element(s) for {input.dim()}D input, "
                             f"got {counts.numel()}")
        T = input.size(-2)
        inp3, out3 = (input, output) if input.dim() == 3 else (input.unsqueeze(0), output.unsqueeze(0))
        for e, c in enumerate(counts.tolist()):
            n = max(0, min(int(c), T))
            if n:
                out3[e, :n] = apply_moe_activation(act, inp3[e, :n], **kw)
        return output

    rows = slice(None)
    if pad_aware:
        ids = topk_ids.reshape(-1).to(torch.int64)
        if ids.numel() != input.size(0):
            raise ValueError(f"pad-aware activation: topk_ids has {ids.numel()} routes but input has "
                             f"{input.size(0)} rows (row r is flat route r)")
        emap = expert_map.to(ids.device, torch.int64)
        if bool((ids >= emap.numel()).any()):
            raise ValueError(f"topk_ids holds an id >= len(expert_map) = {emap.numel()} (undefined upstream)")
        keep = ids >= 0
        keep[keep.clone()] = emap[ids[keep]] != -1
        rows = keep.to(input.device)
    values = apply_moe_activation(act, input[rows], **kw)
    if activation is MoEActivation.RELU2_NO_MUL:
        input.relu_()  # vLLM: F.relu(input, inplace=True); torch.square(input, out=output)
    output[rows] = values
    return output


def _register_points() -> None:
    from reference.semantics import register_point

    register_point(
        "activation.new_members",
        component="activation",
        behaviour={
            "0.17": "MoEActivation has no SITU and no GELU_TANH_NO_MUL: applying them raises SemanticsError.",
            "0.33": "SITU (Kimi SituGLU, gated: b*tanh(g/b)*sigmoid(g)*u', u' = lb*tanh(u/lb) if lb > 0 else u; "
                    "b = activation_situ_beta required, lb = activation_situ_linear_beta optional) and "
                    "GELU_TANH_NO_MUL (gelu_tanh(x), non-gated); fp32 math, one rounding.",
        },
        upstream={
            "0.17": "vLLM 0.17.0 vllm/model_executor/layers/fused_moe/activation.py",
            "0.33": "vLLM 0.33.0 vllm/model_executor/layers/fused_moe/activation.py (apply_moe_activation), "
                    "vllm/model_executor/layers/activation.py (SituAndMul), csrc/activation_kernels.cu "
                    "(situ_activation, gelu_tanh_no_mul_kernel)",
        },
        reference="reference.activation.apply_moe_activation",
    )
    register_point(
        "activation.experts_signature",
        component="activation",
        behaviour={
            "0.17": "FusedMoEExpertsModular.activation(activation, output, input): every row of the 2-D input, "
                    "the seed's parameters (quant config gemm1_alpha / gemm1_beta / gemm1_clamp_limit); "
                    "topk_ids / expert_map / valid_token_counts raise SemanticsError.",
            "0.33": "activation(activation, output, input, *, topk_ids, expert_map, valid_token_counts) = "
                    "apply_moe_activation_into with the experts' ApplyMoEActivationConfig (quant config gemm1_* "
                    "else FusedMoEConfig swiglu_* else None/1.0/0.0; SITU betas from FusedMoEConfig): a masked "
                    "2-D/3-D input writes rows [0, clamp(count_e, 0, T)) per expert and leaves later rows "
                    "untouched; SILU with a clamp limit and topk_ids + expert_map skips rows of -1 / non-local "
                    "routes (pad-aware limit, clamp only when limit > 0); masked SILU+clamp takes the config's "
                    "alpha/beta, unmasked does not; SWIGLUOAI always 1.702/7.0.",
        },
        upstream={
            "0.17": "vLLM 0.17.0 vllm/model_executor/layers/fused_moe/modular_kernel.py "
                    "(FusedMoEExpertsModular.activation), fused_moe/activation.py (apply_moe_activation)",
            "0.33": "vLLM 0.33.0 fused_moe/modular_kernel.py (FusedMoEExpertsModular.activation), "
                    "fused_moe/activation.py (ApplyMoEActivationConfig, apply_moe_activation, "
                    "_apply_moe_activation_masked), fused_moe/utils.py (swiglu_limit_func, "
                    "_swiglu_limit_pad_aware), csrc/activation_kernels.cu (masked_moe_activation)",
        },
        reference="reference.activation.apply_moe_activation_into / "
                  "reference.modular.FusedMoEExpertsModular.activation",
    )


_register_points()
