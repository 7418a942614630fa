"""Fused gated activation + FP8 quantization, each as one op: the kernels that write the second GEMM's FP8 input
directly (no bf16 activation buffer).

Each op is the composition of an activation with vLLM's *input-precision* rounding points (the gate activation and
the up projection narrowed to the input dtype before their product, as vLLM's C++ ``silu_and_mul`` ``compute``
template does) and a per-token-group FP8 quantizer (``reference.quant.fp8``: saturating E4M3 cast, UE8M0 rounding
``exp2(ceil(log2(s)))``, packing ``reference.quant.ue8m0.pack_ue8m0``), with the exact scale arithmetic and scale
layout of the kernel:

- :func:`silu_mul_per_token_group_quant_fp8_colmajor` (vLLM 0.33 ``quantization/utils/fp8_utils.py``, Triton
  ``_silu_mul_per_token_group_quant_fp8_colmajor``; test ``tests/kernels/moe/
  test_silu_mul_per_token_group_quant_fp8_colmajor.py``): fp32 math on the narrowed product, ``s = amax * (1/448)``
  (a multiply by the fp32 reciprocal, not ``amax / 448``), ``q = sat(y / s)``, column-major (MN-major) fp32 scales;
  optional DeepGEMM psum-layout ``expert_ends`` (padding rows left unwritten).
- :func:`persistent_masked_m_silu_mul_quant` (``experts/batched_deep_gemm_moe.py``, CUDA
  ``persistent_masked_m_silu_mul_quant``; test ``test_silu_mul_fp8_quant_deep_gemm.py``): the batched ``(E, T, 2H)``
  masked form, every quantization step in bfloat16 (the test's ``do_quant``), scales FLOAT32,
  FLOAT32_CEIL_UE8M0 or packed UE8M0 int32, MN-major; rows past ``tokens_per_expert`` left unwritten (their scales 0).

Not specified: ``situ_and_mul_quant`` (``test_situ_mul_fp8_quant.py``): its kernel takes the reciprocal with
``__fdividef`` (an approximate division, 2 ulp), so its codes are not a function of the inputs at fp8 rounding
boundaries; its parts (SITU: ``reference.activation``; the FP8 group quantizer) are specified.

Point ``activation.fused_fp8_quant`` (0.17 has neither the colmajor op's clamp / alpha / beta / expert_ends nor the
UE8M0 masked format differences listed there).
"""

from __future__ import annotations

import enum

import torch

from reference.quant._common import to_e4m3_satfinite
from reference.quant.fp8 import FP8_E4M3_MAX
from reference.quant.ue8m0 import pack_ue8m0

__all__ = ["DeepGemmQuantScaleFMT", "silu_mul_per_token_group_quant_fp8_colmajor",
           "persistent_masked_m_silu_mul_quant", "gated_act_at_input_precision"]


class DeepGemmQuantScaleFMT(enum.Enum):
    """vLLM ``vllm/utils/deep_gemm.py::DeepGemmQuantScaleFMT``: fp32 scales, fp32 power-of-two scales, or
    power-of-two scales packed four UE8M0 bytes to an int32."""

    FLOAT32 = 0
    FLOAT32_CEIL_UE8M0 = 1
    UE8M0 = 2


def gated_act_at_input_precision(x: torch.Tensor, *, clamp_limit: float | None = None, alpha: float = 1.0,
                                 beta: float = 0.0) -> torch.Tensor:
    """``silu``-family gated activation with vLLM's input-precision rounding points, as fp32 values.

    ``x``: ``(..., 2d)`` packed ``[gate | up]``. With a clamp: ``g = dt(min(g, L))``, ``u = dt(clamp(u, -L, L))``;
    then ``glu = dt(g / (1 + exp(-g * alpha)))``, ``up = dt(u + beta)``, ``y = dt(glu * up)`` (``dt`` = rounding to
    ``x.dtype``; the products and sums in fp32). Returns ``y`` as fp32 ``(..., d)``.
    """
    dt = x.dtype
    d = x.shape[-1] // 2
    g, u = x[..., :d], x[..., d:]
    if clamp_limit is not None:
        g = g.float().clamp(max=clamp_limit).to(dt)
        u = u.float().clamp(-clamp_limit, clamp_limit).to(dt)
    gf = g.float()
    glu = (gf / (1.0 + torch.exp(-gf * alpha))).to(dt)
    up = (u.float() + beta).to(dt)
    return (glu.float() * up.float()).to(dt).float()


def _group_quant_f32(y: torch.Tensor, group_size: int, eps: float, use_ue8m0: bool,
                     reciprocal: bool) -> tuple[torch.Tensor, ...]:
    """fp32 ``(R, N)`` -> codes ``(R, N)``, fp32 scales ``(R, N // group_size)``: Triton's arithmetic."""
    R, N = y.shape
    yg = y.reshape(R, N // group_size, group_size)
    amax = yg.abs().amax(-1).clamp_min(eps)
    if reciprocal:  # 0.33: _absmax * (1.0 / fp8_max)
        s = amax * torch.tensor(1.0 / FP8_E4M3_MAX, dtype=torch.float32)
    else:  # 0.17: _absmax / fp8_max
        s = amax / torch.full_like(amax, FP8_E4M3_MAX)
    if use_ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    q = to_e4m3_satfinite(yg / s.unsqueeze(-1)).reshape(R, N)
    return q, s


def silu_mul_per_token_group_quant_fp8_colmajor(
    input: torch.Tensor,
    output: torch.Tensor | None = None,
    use_ue8m0: bool | None = None,
    eps: float = 1e-10,
    clamp_limit: float | None = None,
    group_size: int = 128,
    alpha: float = 1.0,
    beta: float = 0.0,
    *,
    expert_ends: torch.Tensor | None = None,
    expert_alignment: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated SiLU (``alpha`` / ``beta`` / ``clamp_limit`` select SwiGLU-OAI-style variants) + 1 x ``group_size``
    FP8 quantization with column-major fp32 scales, one op.

    Mirrors ``vllm/model_executor/layers/quantization/utils/fp8_utils.py::
    silu_mul_per_token_group_quant_fp8_colmajor`` (vLLM 0.33.0). ``y`` = :func:`gated_act_at_input_precision`;
    per group ``amax = max(max|y|, eps)``, ``s = amax * fp32(1/448)`` (0.33; 0.17: ``amax / 448``, point
    ``activation.fused_fp8_quant``), with ``use_ue8m0`` ``s = exp2(ceil(log2 s))``, ``q = e4m3(clamp(y / s, -448,
    448))``.

    Args:
        input: ``(M, N)`` bf16/fp16, ``M % 8 == 0`` and ``N % (2 * group_size) == 0`` (vLLM asserts).
        output: optional ``(M, N // 2)`` float8_e4m3fn buffer (written and returned).
        use_ue8m0: None = False here (vLLM asks ``is_deep_gemm_e8m0_used()``, a platform fact).
        expert_ends: DeepGEMM psum layout: int32 ``(E,)`` logical ends (``reference.align.deepgemm_moe_permute(...,
            use_psum_layout=True)``); expert ``e``'s live rows are ``[round_up(ends[e-1], expert_alignment),
            ends[e])`` (``ends[-1]`` of e = 0 is 0); other rows of ``output`` and of the scales are left unwritten.
        expert_alignment: the psum layout's alignment (> 0, a multiple of 8, with ``expert_ends`` only).

    Returns:
        ``(output, scales)``: float8_e4m3fn ``(M, N // 2)``; fp32 ``(M, N // 2 // group_size)`` with strides
        ``(1, M)`` (column-major: ``scales.t()`` is contiguous). Unwritten scale rows are NaN here (vLLM:
        ``torch.empty``), unwritten output rows keep ``output``'s contents (zeros when allocated here).

    Raises:
        ValueError: the shape rules above; ``expert_ends`` not a 1-D int32 tensor; an ``expert_alignment``
            without ``expert_ends`` or not a positive multiple of 8 with it.
    """
    fn = "silu_mul_per_token_group_quant_fp8_colmajor"
    from reference.semantics import SemanticsVersion, current_semantics, require

    v033 = current_semantics() >= SemanticsVersion.V0_33
    new_args = [n for n, given in (("clamp_limit", clamp_limit is not None), ("alpha", alpha != 1.0),
                                   ("beta", beta != 0.0), ("group_size", group_size != 128),
                                   ("expert_ends", expert_ends is not None)) if given]
    if new_args:
        require(f"{fn}({', '.join(new_args)}=...)", "0.33",
                upstream="vllm/model_executor/layers/quantization/utils/fp8_utils.py")
    if input.dim() != 2 or input.size(0) % 8 or input.size(1) % (2 * group_size):
        raise ValueError(f"{fn}: input must be (M, N) with M % 8 == 0 and N % (2 * group_size) == 0, got "
                         f"{tuple(input.shape)} (group_size {group_size})")
    M, N = input.shape
    if output is None:
        output = torch.zeros((M, N // 2), dtype=torch.float8_e4m3fn, device=input.device)
    elif tuple(output.shape) != (M, N // 2):
        raise ValueError(f"{fn}: output must be ({M}, {N // 2}), got {tuple(output.shape)}")
    scales = torch.full((N // 2 // group_size, M), float("nan"), dtype=torch.float32, device=input.device).t()
    live = torch.ones(M, dtype=torch.bool, device=input.device)
    if expert_ends is not None:
        if expert_ends.dim() != 1 or expert_ends.numel() == 0 or expert_ends.dtype != torch.int32:
            raise ValueError(f"{fn}: expert_ends must be a non-empty 1-D int32 tensor")
        if expert_alignment <= 0 or expert_alignment % 8:
            raise ValueError(f"{fn}: expert_alignment must be a positive multiple of 8, got {expert_alignment}")
        live[:] = False
        prev = 0
        for end in expert_ends.tolist():
            start = -(-prev // expert_alignment) * expert_alignment
            live[start:max(start, min(end, M))] = True
            prev = end
    elif expert_alignment != 0:
        raise ValueError(f"{fn}: expert_alignment needs expert_ends")
    y = gated_act_at_input_precision(input[live], clamp_limit=clamp_limit, alpha=alpha, beta=beta)
    q, s = _group_quant_f32(y, group_size, eps, bool(use_ue8m0), reciprocal=v033)
    output[live] = q
    scales[live] = s
    return output, scales


def persistent_masked_m_silu_mul_quant(
    y: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    num_parallel_tokens: int = 16,
    group_size: int = 128,
    quant_scale_fmt: DeepGemmQuantScaleFMT = DeepGemmQuantScaleFMT.FLOAT32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked batched ``silu(y[..., :H]) * y[..., H:]`` -> FP8 with per-128 group scales (CUDA kernel, bf16 math).

    Mirrors ``vllm/model_executor/layers/fused_moe/experts/batched_deep_gemm_moe.py::
    persistent_masked_m_silu_mul_quant`` with its sm_80+ CUDA kernel, as vLLM's test derives it: per valid row,
    ``act = bf16(silu_fp32(gate))``, ``y = bf16(act * up)``; per group of 128, in bfloat16: ``amax =
    max(max|y|, bf16(1e-10))``, ``s = bf16(amax * bf16(bf16(1) / bf16(448)))``, with CEIL_UE8M0 / UE8M0
    ``s = bf16(exp2(bf16(ceil(bf16(log2 s)))))``, ``q = e4m3(bf16(clamp(bf16(y * bf16(1 / s)), -448, 448)))``.
    ``num_parallel_tokens`` is a launch parameter (no effect).

    Args:
        y: ``(E, T, 2H)`` bfloat16, ``H % 8 == 0``.
        tokens_per_expert: ``(E,)`` integer valid-row counts (rows ``[0, n_e)`` of expert ``e``; ``n_e <= T``).
        group_size: 128 only (vLLM asserts).

    Returns:
        ``(y_q, y_s)``: float8_e4m3fn ``(E, T, H)`` (rows past ``n_e`` zero here: vLLM leaves them unwritten) and
        scales with strides ``(T * G', 1, T)`` (MN-major per expert), zero past ``n_e`` (vLLM zero-fills them):
        FLOAT32 / FLOAT32_CEIL_UE8M0: fp32 ``(E, T, G)``; UE8M0: int32 ``(E, T, ceil(G / 4))`` holding the exponent
        bytes (``fp32 bits >> 23``) of four consecutive groups, group ``4j`` in the low byte.

    Raises:
        ValueError: ``y`` not 3-D bf16 with an even last dim and ``H % 8 == 0``, ``group_size != 128``,
            ``tokens_per_expert`` not ``(E,)``.
    """
    fn = "persistent_masked_m_silu_mul_quant"
    if y.dim() != 3 or y.dtype != torch.bfloat16 or y.size(-1) % 2 or (y.size(-1) // 2) % 8:
        raise ValueError(f"{fn}: y must be (E, T, 2H) bfloat16 with H % 8 == 0, got {y.dtype} {tuple(y.shape)}")
    if group_size != 128:
        raise ValueError(f"{fn}: group_size must be 128, got {group_size}")
    E, T, H2 = y.shape
    H = H2 // 2
    G = -(-H // group_size)
    if tokens_per_expert.dim() != 1 or tokens_per_expert.numel() != E:
        raise ValueError(f"{fn}: tokens_per_expert must be ({E},), got {tuple(tokens_per_expert.shape)}")
    bf = torch.bfloat16
    one, fmax = torch.tensor(1.0, dtype=bf), torch.tensor(FP8_E4M3_MAX, dtype=bf)
    fmax_inv = one / fmax
    ceil = quant_scale_fmt in (DeepGemmQuantScaleFMT.FLOAT32_CEIL_UE8M0, DeepGemmQuantScaleFMT.UE8M0)
    y_q = torch.zeros((E, T, H), dtype=torch.float8_e4m3fn, device=y.device)
    s32 = torch.zeros((E, T, G), dtype=torch.float32, device=y.device)
    for e, n in enumerate(tokens_per_expert.tolist()):
        n = max(0, min(int(n), T))
        if n == 0:
            continue
        gate, up = y[e, :n, :H], y[e, :n, H:]
        gf = gate.float()
        act = (gf / (1.0 + torch.exp(-gf))).to(bf)
        a = (act * up).reshape(n, G, group_size)  # bf16 * bf16 -> bf16
        amax = a.abs().amax(-1).clamp(min=torch.tensor(1e-10, dtype=bf))
        s = amax * fmax_inv
        if ceil:
            s = torch.exp2(torch.ceil(torch.log2(s).to(bf)).to(bf)).to(bf)
        inv_s = (one / s).unsqueeze(-1)
        q = torch.clamp(a * inv_s, min=-FP8_E4M3_MAX, max=FP8_E4M3_MAX)
        y_q[e, :n] = to_e4m3_satfinite(q.reshape(n, H))
        s32[e, :n] = s.float()
    if quant_scale_fmt is DeepGemmQuantScaleFMT.UE8M0:
        G4 = -(-G // 4)
        packed = torch.zeros((E, G4, T), dtype=torch.int32, device=y.device).transpose(1, 2)
        for e, n in enumerate(tokens_per_expert.tolist()):
            n = max(0, min(int(n), T))
            if n:
                packed[e, :n] = pack_ue8m0(s32[e, :n].contiguous())
        return y_q, packed
    out = torch.zeros((E, G, T), dtype=torch.float32, device=y.device).transpose(1, 2)
    out.copy_(s32)
    return y_q, out


def _register_points() -> None:
    from reference.semantics import register_point

    register_point(
        "activation.fused_fp8_quant", component="activation",
        behaviour={"0.17": "silu_mul_per_token_group_quant_fp8_colmajor(input, output, use_ue8m0, eps): SiLU, group "
                           "128, scale amax / 448 (IEEE division); clamp_limit / alpha / beta / group_size / "
                           "expert_ends raise SemanticsError. (persistent_masked_m_silu_mul_quant has 0.33's "
                           "signature; its "
                           "0.17 kernel was not compared: the reference applies the 0.33 rule under both.)",
                   "0.33": "colmajor op: clamp_limit, alpha, beta (input-precision rounding points), group_size, "
                           "expert_ends + expert_alignment (DeepGEMM psum layout; dead rows unwritten); scale "
                           "amax * fp32(1/448) (a multiply by the reciprocal), q = y / s; column-major fp32 scales."},
        upstream={"0.17": "vLLM 0.17.0 vllm/model_executor/layers/quantization/utils/fp8_utils.py",
                  "0.33": "vLLM 0.33.0 vllm/model_executor/layers/quantization/utils/fp8_utils.py "
                          "(_silu_mul_per_token_group_quant_fp8_colmajor), fused_moe/experts/batched_deep_gemm_moe.py"},
        reference="reference.fused_act_quant")


_register_points()
