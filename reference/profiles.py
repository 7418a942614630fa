"""Numerics profiles: named sets of rounding-point choices across the whole experts layer.

The reference (``reference.experts``) specifies one set of rounding points, vLLM's CUDA / Triton path. Real, widely
deployed kernels round elsewhere, on purpose or by accident. A *profile* names each such choice and specifies it
exactly, so a kernel engineer hears "your kernel implements the transformers rounding, which differs from vLLM's CUDA
path at these points" instead of a wall of failures. A backend declares the profile it implements
(``Backend.profile`` or ``SupportRecord.profile``; default ``vllm``) and conformance judges it against that
profile's reference with the same derived error bound (``reference.error_model``); a failing kernel is told which
known profile its output matches, if any (``conformance.profile_match``).

Selecting a profile (like the semantics version, ``reference.semantics``):

- the ``MOE_NUMERICS_PROFILE`` environment variable sets the process default (unset: ``vllm``);
- ``with use_profile("transformers_eager"): ...`` overrides it for a block (context-local; nests);
- ``fused_experts(..., profile="transformers_eager")`` wins over both;
- conformance: ``--numerics-profile NAME`` judges the backend under NAME instead of the one it declares.

The rounding points (``act`` = the activation dtype, bf16 / fp16 / fp32; ``R(x)`` = round to ``act``):

===============================  =========================================  =========================================
point (``NumericsProfile`` field) ``vllm`` (default)                         the alternative
===============================  =========================================  =========================================
``activation``                    ``"fused"``: fp32 math on the rounded      ``"per_op"``: every torch op of the
                                  GEMM1 output, ``R`` once: ``R(silu(g)*u)``  formula rounds: ``R(R(silu(g)) * u)``
                                  (fused epilogues; csrc                      (``SiluAndMul.forward_native``, HF,
                                  ``swigluoai_and_mul``)                      and csrc ``silu_and_mul`` (below))
``gemm_bias``                     ``"fused"``: ``R(acc + b)``                ``"after_store"``: ``R(R(acc) + b)``
``router_weight``                 ``"fp32"``: ``R(y)`` weighted in fp32 in   ``"after_store"``: each term
                                  the top-k sum                              ``R(w * R(y))`` in the act dtype
``topk_sum``                      ``"fp32"``: one ``R`` of the fp32 sum      ``"act_dtype_expert_order"``: a running
                                                                             ``R(acc + term)`` over the token's
                                                                             routes in *local expert* order
                                                                             (``index_add_`` per expert)
``fp8_accumulation``              ``"fp32"``                                 ``"inplace"``: per-tensor / per-channel
                                                                             FP8 GEMMs accumulate in a never-promoted
                                                                             14-bit partial (below)
===============================  =========================================  =========================================

vLLM's compiled ``silu_and_mul`` (and its clamp form) / ``gelu_and_mul`` / ``gelu_tanh_and_mul``
(csrc/activation_kernels.cu of 0.33.0: ``silu_kernel`` returns ``scalar_t``, so ``act(g)`` is rounded to the act
dtype before ``* up``) compute the ``per_op`` form for SiLU and GELU, not the single rounding: measured on an H200
with vLLM 0.33.0's own op compiled from its csrc (``benchmarks.vllm_ops``), its whole chain missed the default
profile's bound on 18 rows (rms_norm up to 1.4x, calc_diff up to 2.1x) (the extra rounding of ``silu(g)`` moves
about a quarter of the bf16 products by one step, and at an FP8 requantization flips codes) and is judged against
``torch_native_activation`` (docs/notes/gpu-sessions.md, sixteenth session). Its ``swigluoai_and_mul`` computes the
glu in fp32 and rounds once (the ``fused`` form; ``per_op``'s SwiGLU-OAI is transformers' several roundings).

``"inplace"`` FP8 accumulation (vLLM's Triton ``fused_moe_kernel`` for FP8 per-tensor / per-channel x per-token
scales: ``accumulator = tl.dot(a, b, acc=accumulator)`` on the codes, scales applied once after the K loop;
``docs/notes/triton.md`` "FP8 accumulation promotion" measured it at 5.4e-4 relative RMS at K = 1024, 1.9e-3 at
K = 7168): the GEMM of codes ``aq (R, K)``, ``wq (N, K)`` with per-row scale ``sa`` and per-column scale ``sw`` is::

    partial = 0
    for each step of fp8_mma_k (32) K elements (one wgmma m64nNk32):
        partial = trunc_{fp8_mma_bits}(partial + sum_k aq[:, k] * wq[:, k])    # the step's sum is exact
    out = fp32(partial) * sa * sw                                                # the epilogue, fp32

where ``trunc_b`` keeps ``b`` (14) mantissa bits, toward zero: the alignment shift of the Hopper FP8 tensor core's
accumulator (DeepSeek-V3 technical report 3.3.2; ``specs/tolerances.toml [error_model] mma_mantissa_bits``). Block
and group FP8 scales are promoted per K tile in every vLLM kernel and are not affected; neither are weight-only
schemes (dequantized to the act dtype before a bf16 MMA) nor INT8 (exact int32). It is a **named accuracy defect**,
not a valid alternative: the accumulation probe (``conformance/test_accumulation.py``) still fails it, and a kernel
that matches it is told so.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "ENV_VAR",
    "NumericsProfile",
    "PROFILES",
    "DEFAULT_PROFILE",
    "get_profile",
    "current_profile",
    "resolve_profile",
    "use_profile",
    "apply_activation_per_op",
    "inplace_fp8_gemm",
    "truncate_mantissa",
    "uses_inplace_fp8",
    "reduce_topk",
    "format_table",
]

ENV_VAR = "MOE_NUMERICS_PROFILE"


@dataclass(frozen=True)
class NumericsProfile:
    """One named set of rounding points (the module docstring's table gives each field's meaning).

    name: stable identifier (``vllm``, ``torch_native_activation``, ``transformers_eager``,
        ``fp8_inplace_accumulation``).
    defect: True for a named accuracy defect (a kernel matching it is told it implements a known defect).
    summary: one line for verdicts; upstream: the files whose numerics it specifies.
    """

    name: str
    activation: str = "fused"            # "fused" | "per_op"
    gemm_bias: str = "fused"             # "fused" | "after_store"
    router_weight: str = "fp32"          # "fp32" | "after_store"
    topk_sum: str = "fp32"               # "fp32" | "act_dtype_expert_order"
    fp8_accumulation: str = "fp32"       # "fp32" | "inplace"
    fp8_mma_bits: int = 14
    fp8_mma_k: int = 32
    defect: bool = False
    summary: str = ""
    upstream: str = ""

    def __post_init__(self):
        allowed = {"activation": ("fused", "per_op"), "gemm_bias": ("fused", "after_store"),
                   "router_weight": ("fp32", "after_store"), "topk_sum": ("fp32", "act_dtype_expert_order"),
                   "fp8_accumulation": ("fp32", "inplace")}
        for f, choices in allowed.items():
            if getattr(self, f) not in choices:
                raise ValueError(f"profile {self.name!r}: {f}={getattr(self, f)!r}, choose one of {choices}")

    @property
    def is_default(self) -> bool:
        return self == DEFAULT_PROFILE

    def differences(self, other: "NumericsProfile | None" = None) -> list[str]:
        """The rounding points where this profile differs from ``other`` (default: ``vllm``), as ``field: a -> b``."""
        other = other or DEFAULT_PROFILE
        fields = ("activation", "gemm_bias", "router_weight", "topk_sum", "fp8_accumulation")
        return [f"{f}: {getattr(other, f)} -> {getattr(self, f)}" for f in fields if getattr(self, f) != getattr(other, f)]

    def error_model_accumulation(self, quant_config):
        """The ``reference.error_model.Accumulation`` a kernel of this profile is allowed on ``quant_config``, or
        None for the error model's default.

        Under ``"inplace"`` FP8 accumulation the reference itself accumulates in the 14-bit partial, and a kernel of
        the profile does too, in its own order: two independent in-place accumulations differ by sqrt(2) times one's
        error, i.e. by one in-place accumulator of ``fp8_mma_bits - 1/2`` bits (the error is proportional to the
        partial's unit). Schemes the point does not touch keep the default.
        """
        if self.fp8_accumulation != "inplace" or not uses_inplace_fp8(quant_config):
            return None
        from reference.error_model import Accumulation

        b = self.fp8_mma_bits - 0.5
        return Accumulation(f"fp8 in place (profile {self.name}: two {self.fp8_mma_bits}-bit partials, never "
                            f"promoted)", b, None)


DEFAULT_PROFILE = NumericsProfile(
    "vllm",
    summary="vLLM's CUDA / Triton path: fp32 math between the four rounding points of reference/experts.py (the "
            "activation rounded once, as vLLM's fused epilogues do; its compiled silu_and_mul rounds silu(g) first: "
            "torch_native_activation)",
    upstream="vLLM fused_moe/fused_moe.py (fused_experts_impl), csrc/activation_kernels.cu (swigluoai_and_mul), "
             "TopKWeightAndReduceContiguous / moe_sum (fp32 sum)")

PROFILES: dict[str, NumericsProfile] = {p.name: p for p in (
    DEFAULT_PROFILE,
    NumericsProfile(
        "torch_native_activation", activation="per_op",
        summary="the activation computed in the output dtype: R(R(act(g)) * u) (two roundings where a fused "
                "epilogue rounds once); vLLM's compiled silu_and_mul / gelu_and_mul round this way too",
        upstream="vLLM csrc/activation_kernels.cu (silu_and_mul, gelu_and_mul: act_and_mul_kernel), "
                 "model_executor/layers/activation.py SiluAndMul.forward_native (and the other forward_native); "
                 "transformers ACT2FN[...](gate) * up"),
    NumericsProfile(
        "transformers_eager", activation="per_op", gemm_bias="after_store", router_weight="after_store",
        topk_sum="act_dtype_expert_order",
        summary="transformers' eager experts loop: output-dtype activation, bias added after the GEMM's bf16 store, "
                "router weight applied to the stored GEMM2 output, top-k routes summed in the act dtype in expert "
                "order (index_add_)",
        upstream="transformers 5.x models/{mixtral,qwen3_moe,gpt_oss}/modeling_*.py (MixtralExperts.forward, "
                 "Qwen3MoeExperts.forward, GptOssExperts.forward)"),
    NumericsProfile(
        "fp8_inplace_accumulation", fp8_accumulation="inplace", defect=True,
        summary="FP8 per-tensor / per-channel GEMMs accumulated in place in the FP8 MMA's ~14-bit partial, never "
                "promoted to fp32 (a known accuracy defect: error grows with K)",
        upstream="vLLM 0.17-0.33 fused_moe/fused_moe.py fused_moe_kernel (acc = tl.dot(a, b, acc) with "
                 "per-tensor / per-channel FP8 scales); docs/notes/triton.md FAST_ACCUM"),
)}


def get_profile(name: "NumericsProfile | str") -> NumericsProfile:
    """A profile by name (or the profile itself). Raises ValueError naming the known profiles."""
    if isinstance(name, NumericsProfile):
        return name
    try:
        return PROFILES[str(name).strip()]
    except KeyError:
        raise ValueError(f"unknown numerics profile {name!r}; choose one of {', '.join(PROFILES)}") from None


_OVERRIDE: contextvars.ContextVar[NumericsProfile | None] = contextvars.ContextVar("moe_numerics_profile",
                                                                                  default=None)


def current_profile() -> NumericsProfile:
    """The innermost ``use_profile`` block's profile, else ``$MOE_NUMERICS_PROFILE``, else ``vllm``."""
    p = _OVERRIDE.get()
    if p is not None:
        return p
    env = os.environ.get(ENV_VAR, "").strip()
    return get_profile(env) if env else DEFAULT_PROFILE


def resolve_profile(profile: "NumericsProfile | str | None" = None) -> NumericsProfile:
    """An explicit ``profile=`` argument if given, else ``current_profile()``."""
    return current_profile() if profile is None else get_profile(profile)


@contextlib.contextmanager
def use_profile(profile: "NumericsProfile | str"):
    """Select a numerics profile for the block (context-local; nests; restores on exit)."""
    token = _OVERRIDE.set(get_profile(profile))
    try:
        yield _OVERRIDE.get()
    finally:
        _OVERRIDE.reset(token)


# --- the rounding points' definitions -----------------------------------------------------------------------------


def apply_activation_per_op(activation, x: torch.Tensor, *, alpha=None, beta=None, limit=None, situ_beta=None,
                            situ_linear_beta=None) -> torch.Tensor:
    """The activation as torch evaluates its formula in ``x.dtype``: every op computed in fp32 from its rounded
    operands and rounded to ``x.dtype`` (``R``); clamps are exact. Same shapes, layouts and parameters as
    ``reference.activation.apply_moe_activation``.

    Formulas (g, u the gate and up halves of the rounded GEMM1 output)::

        SILU / GELU / GELU_TANH   R(R(act(g)) * u)           (SILU with limit: g, u clamped first)
        SWIGLUOAI(_UNINTERLEAVE)  glu = R(g * R(sigmoid(R(g * alpha)))); R(R(u + beta_or_1) * glu)
                                  (transformers GptOssExperts._apply_gate; vLLM SwigluOAIAndMul.forward_native)
        SWIGLUSTEP                R(R(silu(g)).clamp(max=L) * u.clamp(-L, L))
        *_NO_MUL                  R(act(x))  (one op: the same as the fused form)
        SITU                      not specified per op: ValueError

    Raises:
        ValueError: SITU, gated RELU2, non-floating input (as ``apply_moe_activation``).
    """
    from reference.activation import (SWIGLUOAI_DEFAULT_ALPHA, SWIGLUOAI_DEFAULT_LIMIT, SWIGLUSTEP_LIMIT,
                                      MoEActivation as A, _split_gated, apply_moe_activation)

    if not activation.is_gated:
        return apply_moe_activation(activation, x)
    if activation in (A.RELU2, A.SITU):
        raise ValueError(f"{activation.name}: no per-op form is specified (numerics profile activation='per_op')")
    dt = x.dtype

    def R(t):
        return t.to(dt).float()

    g, u = _split_gated(x.float(), interleaved=activation is A.SWIGLUOAI)
    # Contiguous halves: torch's vectorized (contiguous) and scalar (strided) erf / exp differ by an fp32 ulp in far
    # tails; the profile is defined with the vectorized fp32 functions, those of apply_moe_activation.
    g, u = g.contiguous(), u.contiguous()
    if activation in (A.SILU, A.GELU, A.GELU_TANH):
        if activation is A.SILU and limit is not None:
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        f = {A.SILU: F.silu, A.GELU: F.gelu, A.GELU_TANH: lambda t: F.gelu(t, approximate="tanh")}[activation]
        y = R(f(g)) * u
    elif activation in (A.SWIGLUOAI, A.SWIGLUOAI_UNINTERLEAVE):
        oai = activation is A.SWIGLUOAI
        a = (SWIGLUOAI_DEFAULT_ALPHA if oai else 1.0) if alpha is None else alpha
        b = (1.0 if oai else (0.0 if beta is None else beta))
        L = (SWIGLUOAI_DEFAULT_LIMIT if oai else None) if limit is None else limit
        if L is not None:
            g, u = g.clamp(max=L), u.clamp(-L, L)
        glu = R(g * R(torch.sigmoid(R(g * a))))
        y = R(u + b) * glu
    elif activation is A.SWIGLUSTEP:
        L = SWIGLUSTEP_LIMIT if limit is None else limit
        y = R(F.silu(g)).clamp(max=L) * u.clamp(-L, L)
    else:  # pragma: no cover
        raise ValueError(f"unhandled activation {activation}")
    return y.to(dt)


def truncate_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """float64 ``x`` with ``bits`` mantissa bits kept (below the leading one), toward zero; exact (frexp/ldexp)."""
    m, e = torch.frexp(x)  # x = m * 2^e, |m| in [0.5, 1)
    return torch.ldexp(torch.trunc(torch.ldexp(m, torch.full_like(e, bits + 1))), e - (bits + 1))


def inplace_fp8_gemm(aq: torch.Tensor, a_scale: torch.Tensor | None, wq: torch.Tensor, w_scale: torch.Tensor | None,
                     *, mantissa_bits: int = 14, k_step: int = 32) -> torch.Tensor:
    """``(aq @ wq.T) * a_scale * w_scale`` accumulated in place (the module docstring): fp32 ``(R, N)``.

    aq: ``(R, K)`` FP8 codes (any float dtype holding them); wq: ``(N, K)`` codes; a_scale: one element or ``(R, 1)``;
    w_scale: one element or ``(N, 1)`` / ``(N,)``; None: 1.
    """
    a64, w64 = aq.double(), wq.double()
    partial = torch.zeros(a64.shape[0], w64.shape[0], dtype=torch.float64, device=aq.device)
    for k0 in range(0, a64.shape[1], k_step):
        step = a64[:, k0:k0 + k_step] @ w64[:, k0:k0 + k_step].T  # <= 32 products of 4-bit significands: exact
        partial = truncate_mantissa(partial + step, mantissa_bits)
    out = partial.float()
    if a_scale is not None:
        out = out * (a_scale.float().reshape(()) if a_scale.numel() == 1 else a_scale.float().reshape(-1, 1))
    if w_scale is not None:
        out = out * (w_scale.float().reshape(()) if w_scale.numel() == 1 else w_scale.float().reshape(1, -1))
    return out


def uses_inplace_fp8(quant_config) -> bool:
    """Whether ``quant_config``'s GEMMs are FP8 x FP8 with per-tensor / per-channel / per-token scales (the GEMMs the
    ``"inplace"`` point touches)."""
    def fp8_tc(desc):
        return desc.dtype == torch.float8_e4m3fn and desc.shape in ((-1, -1), (1, -1))

    return fp8_tc(quant_config.w1) and fp8_tc(quant_config.a1) and fp8_tc(quant_config.w2) and fp8_tc(quant_config.a2)


def reduce_topk(y: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor, profile: NumericsProfile,
                out_dtype: torch.dtype) -> torch.Tensor:
    """The weighted top-k sum of the profile: ``(M, K)`` in ``out_dtype``.

    y: ``(M, topk, K)`` per-route outputs, already rounded to ``out_dtype`` (zeros for routes not held here);
    weights: ``(M, topk)`` router weights (ones when applied on the input); local_ids: ``(M, topk)`` local expert of
    each route, -1 where not held.
    """
    if profile.router_weight == "after_store":
        terms = (y.float() * weights.float().unsqueeze(-1)).to(out_dtype).float()
    else:
        terms = y.float() * weights.float().unsqueeze(-1)
    if profile.topk_sum == "fp32":
        return terms.sum(dim=1).to(out_dtype)
    # A running sum in the act dtype over each token's routes in local expert order; a token routes to an expert at
    # most once, so the order is the routes sorted by local expert id (not held: skipped).
    M, topk, K = y.shape
    key = torch.where(local_ids >= 0, local_ids.long(), torch.iinfo(torch.int64).max)
    order = torch.argsort(key, dim=1, stable=True)
    acc = torch.zeros(M, K, dtype=out_dtype, device=y.device)
    for j in range(topk):
        idx = order[:, j]
        held = (local_ids.gather(1, idx[:, None]).squeeze(1) >= 0)
        term = terms[torch.arange(M, device=y.device), idx]
        acc = torch.where(held[:, None], (acc.float() + term).to(out_dtype), acc)
    return acc


def format_table() -> str:
    """The profiles as Markdown (name, the points where each differs from ``vllm``, summary)."""
    rows = ["| profile | differs from vllm at | what it is |", "|---|---|---|"]
    for p in PROFILES.values():
        diff = "; ".join(p.differences()) or "(the default)"
        rows.append(f"| `{p.name}`{' (defect)' if p.defect else ''} | {diff} | {p.summary} |")
    return "\n".join(rows)
