"""MoE activation functions (vLLM ``MoEActivation``) with their exact formulas.

Mirrors ``vllm/model_executor/layers/fused_moe/activation.py`` and the kernels in
``vllm/model_executor/layers/activation.py`` (vLLM 0.17-0.33). ``SITU`` and ``GELU_TANH_NO_MUL`` are vLLM 0.33
members: under the 0.17 semantics (``reference.semantics``) applying them raises ``SemanticsError``.

Numerics: every activation reads its input in the input dtype, computes in fp32 and rounds the result once to
the input dtype, as vLLM's CUDA activation kernels (``silu_and_mul`` etc.) do.

Gated layout: for gated activations the input is ``(..., 2d)`` and the output ``(..., d)``. The gate ``g`` is the
first half and the up projection ``u`` the second half (vLLM's packed ``w13`` = [w1; w3]), except SWIGLUOAI, whose
gate/up are *interleaved*: ``g = x[..., 0::2]``, ``u = x[..., 1::2]`` (gpt-oss checkpoints; vLLM #44893 shows
what mixing the two layouts costs).
"""

from __future__ import annotations

import enum

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


_register_points()
