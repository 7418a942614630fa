"""The quantization schemes of the experts: name -> how the weights and activations are quantized.

A scheme (``specs/schemes.toml``: its name, description and vLLM ``QuantKey`` names for the weights and activations;
its outputs are judged by the error model's bound, ``reference.error_model``) turns a case's bf16
weights into the codes, scales and ``FusedMoEQuantConfig`` a kernel receives. The weights are quantized here with
the reference quantizers, so the only quantization a backend performs itself is the activations' (a1 in prepare,
a2 between the GEMMs), as the config's activation descriptors say.

This is part of the reference (the conformance suite, the benchmarks and the backends' GPU scripts all build their
weights through :func:`quantize_weights`); the names and keys are data in ``specs/``, the
quantization recipe per scheme is code here (``_BUILDERS``), and the two must name the same schemes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Callable

import torch

from reference import quant as q
from reference.config import (
    FUSED_MOE_UNQUANTIZED_CONFIG,
    FusedMoEQuantConfig,
    biased_moe_quant_config,
    fp8_w8a8_moe_quant_config,
    fp8_w8a16_moe_quant_config,
    int4_w4a16_moe_quant_config,
    int8_w8a8_moe_quant_config,
    int8_w8a16_moe_quant_config,
    mxfp4_moe_quant_config,
    mx_moe_quant_config,
    mxfp8_w8a8_moe_quant_config,
    nvfp4_moe_quant_config,
    w4a8_moe_quant_config,
)
from reference.semantics import register_point
from specs import load_schemes

__all__ = ["Scheme", "schemes", "get_scheme", "quantize_weights", "UNQUANTIZED"]

# Unquantized schemes: the weights keep the case's dtype.
UNQUANTIZED = frozenset({"bf16", "fp16", "fp32"})
# NVFP4 activations use fixed global encode scales (vLLM calibrates them): 448*6 / expected amax.
NVFP4_A1_GSCALE = torch.tensor([448.0 * 6.0 / 8.0])
NVFP4_A2_GSCALE = torch.tensor([448.0 * 6.0 / 16.0])
# Static FP8 activation scales of fp8_tensor_static (vLLM loads calibrated ones from the checkpoint): the same
# expected amax as the NVFP4 encode scales above, so values fill E4M3's normal range (amax / 448).
FP8_A1_STATIC_SCALE = torch.tensor([8.0 / 448.0])
FP8_A2_STATIC_SCALE = torch.tensor([16.0 / 448.0])

register_point(
    "schemes.quant_keys",
    component="schemes",
    behaviour={
        "0.17": "Schemes are named by the keys of the seeds (seed 001/002: FP8 tensor/channel/128x128 block, MXFP4, "
                "MXFP8, NVFP4); vLLM 0.17.0's quant_utils.py defines no INT4/INT8 weight-only keys, no "
                "kNvfp4DynamicToken, no INT8 keys. The reference still builds every scheme of specs/schemes.toml "
                "(a format does not change with the release); a scheme whose keys only 0.33 defines says so in "
                "its `since`.",
        "0.33": "Schemes carry vLLM 0.33's key names (reference.quant.keys.KEYS_NEW_IN_0_33 lists the names 0.17 "
                "lacks): WNA16 kInt4Static / kInt4StaticAsym / kInt4Static32 / kInt8Static, kNvfp4DynamicToken, "
                "INT8 per-tensor, and the CUTLASS INT4 x FP8 scheme w4a8 as (kInt4Static, kFp8DynamicTokenSym); "
                "kInt4W4A8StaticGroup128Sym means INT8-stored INT4 with bf16 group-128 scales (the CPU experts').",
    },
    upstream={
        "0.17": "vllm-0.17.0 vllm/model_executor/layers/quantization/utils/quant_utils.py",
        "0.33": "vllm-0.33.0 vllm/model_executor/layers/quantization/utils/quant_utils.py; the experts' "
                "_supports_quant_scheme in fused_moe/experts/ (triton_moe.py TritonExperts / TritonWNA16Experts, "
                "cutlass_moe.py, trtllm_nvfp4_moe.py, mxfp8_native_moe.py, marlin_moe.py)",
    },
    reference="reference.schemes / specs/schemes.toml",
    introduced="",
    notes="The reference names the 64x64 FP8 block key vLLM builds unnamed (kFp8Static64BlockSym).",
)


@dataclass(frozen=True)
class Scheme:
    """One entry of ``specs/schemes.toml``.

    ``weight_key`` / ``activation_key`` are the ``reference.quant`` ``QuantKey`` names an experts class must claim
    (seed 002 ``_supports_quant_scheme``; ``"none"`` = unquantized); ``since`` is the
    first semantics version whose vLLM names these keys and claims the pair (``"0.17"``: the seeds' era), with
    ``upstream`` the vLLM file of an experts class that claims it (semantics point ``schemes.quant_keys``)."""

    name: str
    description: str
    weight_key: str
    activation_key: str
    since: str = "0.17"
    upstream: str = ""

    @property
    def quantized(self) -> bool:
        return self.name not in UNQUANTIZED

    @property
    def use_ue8m0(self) -> bool:
        """Block scales rounded up to powers of two (``FusedMoEQuantConfig.use_ue8m0``): a variant that the quant keys
        do not name (``SupportRecord.ue8m0_scales``)."""
        return self.name.endswith("_ue8m0")

    def quant_keys(self) -> tuple[q.QuantKey | None, q.QuantKey | None]:
        """The ``(weight, activation)`` ``QuantKey`` objects (``None`` for ``"none"``)."""
        return tuple(None if n == "none" else getattr(q, n) for n in (self.weight_key, self.activation_key))


def _stack(pairs):
    return tuple(torch.stack(t) for t in zip(*pairs))


def _unquantized(scheme, w1, w2, w1_bias, w2_bias, extra):
    qc = FUSED_MOE_UNQUANTIZED_CONFIG if w1_bias is None else biased_moe_quant_config(w1_bias, w2_bias)
    if any(v is not None for v in extra.values()):
        qc = FusedMoEQuantConfig(a1=qc.a1, a2=qc.a2, w1=qc.w1, w2=qc.w2, **extra)
    return w1, w2, qc


def _fp8_tensor(scheme, w1, w2, w1_bias, w2_bias, extra):
    (w1q, s1), (w2q, s2) = (_stack([q.scaled_fp8_quant(w[e]) for e in range(w.shape[0])]) for w in (w1, w2))
    return w1q, w2q, fp8_w8a8_moe_quant_config(s1.reshape(-1), s2.reshape(-1), **extra)


def _fp8_channel_token(scheme, w1, w2, w1_bias, w2_bias, extra):
    (w1q, s1), (w2q, s2) = (_stack([q.scaled_fp8_quant(w[e], use_per_token_if_dynamic=True)
                                    for e in range(w.shape[0])]) for w in (w1, w2))
    return w1q, w2q, fp8_w8a8_moe_quant_config(s1, s2, per_act_token_quant=True, per_out_ch_quant=True, **extra)


def _fp8_block128(scheme, w1, w2, w1_bias, w2_bias, extra):
    ue8m0 = scheme.endswith("ue8m0")
    w1q, s1 = q.per_block_quant_fp8(w1, (128, 128), use_ue8m0=ue8m0)
    w2q, s2 = q.per_block_quant_fp8(w2, (128, 128), use_ue8m0=ue8m0)
    return w1q, w2q, fp8_w8a8_moe_quant_config(s1, s2, block_shape=[128, 128], use_ue8m0=ue8m0, **extra)


def _fp8_tensor_act(scheme, w1, w2, w1_bias, w2_bias, extra):
    (w1q, s1), (w2q, s2) = (_stack([q.scaled_fp8_quant(w[e]) for e in range(w.shape[0])]) for w in (w1, w2))
    if scheme == "fp8_tensor_static":
        return w1q, w2q, fp8_w8a8_moe_quant_config(s1.reshape(-1), s2.reshape(-1), FP8_A1_STATIC_SCALE,
                                                   FP8_A2_STATIC_SCALE, **extra)
    return w1q, w2q, fp8_w8a8_moe_quant_config(s1.reshape(-1), s2.reshape(-1), per_act_token_quant=True, **extra)


def _fp8_block64(scheme, w1, w2, w1_bias, w2_bias, extra):
    w1q, s1 = q.per_block_quant_fp8(w1, (64, 64))
    w2q, s2 = q.per_block_quant_fp8(w2, (64, 64))
    return w1q, w2q, fp8_w8a8_moe_quant_config(s1, s2, block_shape=[64, 64], **extra)


def _fp8_w8a16(scheme, w1, w2, w1_bias, w2_bias, extra):
    (w1q, s1), (w2q, s2) = (_stack([q.scaled_fp8_quant(w[e], use_per_token_if_dynamic=True)
                                    for e in range(w.shape[0])]) for w in (w1, w2))
    return w1q, w2q, fp8_w8a16_moe_quant_config(s1, s2)


def _int8_tensor(scheme, w1, w2, w1_bias, w2_bias, extra):
    def one(w):  # one static scale per expert: absmax / 127, as the per-channel rule over the whole expert
        q8, s = q.int8_quant_per_channel(w.reshape(w.shape[0], 1, -1))
        return q8.reshape(w.shape), s.reshape(-1)

    (w1q, s1), (w2q, s2) = one(w1), one(w2)
    return w1q, w2q, int8_w8a8_moe_quant_config(s1, s2, per_act_token_quant=False, per_out_ch_quant=False)


# Weight-only schemes: (bits, group size, zero points). The scales are stored in the weights' dtype.
_WNA16 = {"int4_w4a16": (4, 128, False), "int4_w4a16_zp": (4, 128, True), "int4_w4a16_g32": (4, 32, False),
          "int8_w8a16": (8, 128, False)}


def _wna16(scheme, w1, w2, w1_bias, w2_bias, extra):
    bits, group, zp = _WNA16[scheme]
    (w1q, s1, z1), (w2q, s2, z2) = (q.wna16_quantize(w, num_bits=bits, group_size=group, zero_points=zp,
                                                     scale_dtype=w.dtype) for w in (w1, w2))
    factory = int4_w4a16_moe_quant_config if bits == 4 else int8_w8a16_moe_quant_config
    return w1q, w2q, factory(s1, s2, z1, z2, block_shape=[0, group])


def _mxfp8(scheme, w1, w2, w1_bias, w2_bias, extra):
    (w1q, s1), (w2q, s2) = q.mxfp8_quantize(w1), q.mxfp8_quantize(w2)
    return w1q, w2q, mxfp8_w8a8_moe_quant_config(s1, s2)


def _int8_channel_token(scheme, w1, w2, w1_bias, w2_bias, extra):
    (w1q, s1), (w2q, s2) = q.int8_quant_per_channel(w1), q.int8_quant_per_channel(w2)
    return w1q, w2q, int8_w8a8_moe_quant_config(s1, s2)


def _mxfp4(scheme, w1, w2, w1_bias, w2_bias, extra):
    (w1q, s1), (w2q, s2) = q.mxfp4_quantize(w1), q.mxfp4_quantize(w2)
    act = {"mxfp4_w4a16": None, "mxfp4_mxfp8": "mxfp8", "mxfp4_w4a4": "mxfp4"}[scheme]
    return w1q, w2q, mxfp4_moe_quant_config(s1, s2, activation=act, w1_bias=w1_bias, w2_bias=w2_bias, **extra)


def _nvfp4(scheme, w1, w2, w1_bias, w2_bias, extra):
    (w1q, s1, g1), (w2q, s2, g2) = (_stack([q.nvfp4_quantize(w[e]) for e in range(w.shape[0])]) for w in (w1, w2))
    if scheme == "nvfp4_token":
        return w1q, w2q, nvfp4_moe_quant_config(s1, s2, g1.reshape(-1), g2.reshape(-1), None, None,
                                                per_token_activation=True)
    return w1q, w2q, nvfp4_moe_quant_config(s1, s2, g1.reshape(-1), g2.reshape(-1), NVFP4_A1_GSCALE, NVFP4_A2_GSCALE)


def _w4a8(scheme, w1, w2, w1_bias, w2_bias, extra):
    def one(w):
        chan = w.float().abs().amax(dim=-1).clamp(min=1e-6)  # normalise rows so group scales fit in E4M3
        packed, gs = q.w4a8_quantize_weight(w.float() / chan.unsqueeze(-1), 128)
        return packed, gs, chan

    (w1q, s1, c1), (w2q, s2, c2) = one(w1), one(w2)
    return w1q, w2q, w4a8_moe_quant_config(s1, s2, c1, c2)


# --- microscaling cross pairs (vLLM 0.33, issue 41 item 5): one block, kept together.
# Weights: MXFP4 as _mxfp4 (OCP "floor" scale rule), MXFP8 as _mxfp8, NVFP4 per expert as _nvfp4, MXFP6 with Quark's
# "even" rule (the rule of vLLM 0.33's MXFP6 path, mxfp6_utils.py). Activations: reference.config
# microscaling_activation_desc (static FP8 with the fixed scales of fp8_tensor_static).
_MX_CROSS = {  # scheme -> (weight format, activation)
    "mxfp4_fp8_static": ("mxfp4", "fp8_static"),
    "mxfp4_fp8_block128": ("mxfp4", "fp8_block128"),
    "mxfp4_fp8_token": ("mxfp4", "fp8_token"),
    "mxfp8_w8a16": ("mxfp8", None),
    "mxfp8_fp8_token": ("mxfp8", "fp8_token"),
    "nvfp4_w4a16": ("nvfp4", None),
    "nvfp4_mxfp8": ("nvfp4", "mxfp8"),
    "nvfp4_fp8_token": ("nvfp4", "fp8_token"),
    "mxfp6_e3m2": ("mxfp6_e3m2", "mxfp6_e3m2"),
    "mxfp6_e2m3": ("mxfp6_e2m3", "mxfp6_e2m3"),
    "mxfp4_mxfp6_e3m2": ("mxfp4", "mxfp6_e3m2"),
    "mxfp4_mxfp6_e2m3": ("mxfp4", "mxfp6_e2m3"),
}


def _mx_cross(scheme, w1, w2, w1_bias, w2_bias, extra):
    weight, act = _MX_CROSS[scheme]
    statics = dict(a1_scale=FP8_A1_STATIC_SCALE, a2_scale=FP8_A2_STATIC_SCALE) if act == "fp8_static" else {}
    if weight == "nvfp4":
        (w1q, s1, g1), (w2q, s2, g2) = (_stack([q.nvfp4_quantize(w[e]) for e in range(w.shape[0])])
                                        for w in (w1, w2))
        return w1q, w2q, mx_moe_quant_config("nvfp4", s1, s2, activation=act, g1_gscale=g1.reshape(-1),
                                             g2_gscale=g2.reshape(-1), **statics, **extra)
    if weight == "mxfp4":
        (w1q, s1), (w2q, s2) = q.mxfp4_quantize(w1), q.mxfp4_quantize(w2)
    elif weight == "mxfp8":
        (w1q, s1), (w2q, s2) = q.mxfp8_quantize(w1), q.mxfp8_quantize(w2)
    else:
        element = weight.split("_")[1]
        (w1q, s1), (w2q, s2) = q.mxfp6_quantize(w1, element), q.mxfp6_quantize(w2, element)
    return w1q, w2q, mx_moe_quant_config(weight, s1, s2, activation=act, w1_bias=w1_bias, w2_bias=w2_bias,
                                         **statics, **extra)
# --- end of the microscaling cross pairs


# How each scheme of specs/schemes.toml quantizes: (scheme, w1, w2, w1_bias, w2_bias, extra) -> (w1q, w2q, qc).
_BUILDERS: dict[str, Callable] = {
    "bf16": _unquantized, "fp16": _unquantized, "fp32": _unquantized,
    "fp8_tensor": _fp8_tensor,
    "fp8_channel_token": _fp8_channel_token,
    "fp8_block128": _fp8_block128,
    "fp8_block128_ue8m0": _fp8_block128,
    "int8_channel_token": _int8_channel_token,
    "mxfp4_w4a16": _mxfp4,
    "mxfp4_mxfp8": _mxfp4,
    "nvfp4": _nvfp4,
    "w4a8": _w4a8,
    "fp8_tensor_static": _fp8_tensor_act,
    "fp8_tensor_token": _fp8_tensor_act,
    "fp8_block64": _fp8_block64,
    "fp8_w8a16": _fp8_w8a16,
    "int8_tensor": _int8_tensor,
    "int4_w4a16": _wna16,
    "int4_w4a16_zp": _wna16,
    "int4_w4a16_g32": _wna16,
    "int8_w8a16": _wna16,
    "mxfp8": _mxfp8,
    "mxfp4_w4a4": _mxfp4,
    "nvfp4_token": _nvfp4,
    **{name: _mx_cross for name in _MX_CROSS},
}


# --- issue 41: the FP8 / INT scheme pairs of vLLM 0.33 the seeds lack (Humming cross pairs, XPU FP8 W8A16, FP8 block
# shapes, block INT8 W8A8, Humming INT8, CPU INT4 W4A8 with in-kernel INT8 activations). Weights are quantized with
# the rules of the existing schemes of the same weight format; the activation descriptors are the pair's activation
# key (dynamic FP8 per 1x128 group / per token, static FP8 per tensor with the FP8_A*_STATIC_SCALE scales, none).
_FP8 = torch.float8_e4m3fn
# activation descriptor per activation key name: (shape, static scale for a1, for a2)
_FP8_ACT = {"none": None, "kFp8Dynamic128Sym": ((1, 128), None, None), "kFp8DynamicTokenSym": ((1, -1), None, None),
            "kFp8StaticTensorSym": ((-1, -1), FP8_A1_STATIC_SCALE, FP8_A2_STATIC_SCALE)}


def _with_fp8_activations(qc: FusedMoEQuantConfig, act_key: str, extra) -> FusedMoEQuantConfig:
    """``qc`` with the a1 / a2 descriptors of the FP8 activation key ``act_key`` (unchanged for ``"none"``)."""
    import dataclasses

    act = _FP8_ACT[act_key]
    fields = {k: v for k, v in extra.items() if v is not None}
    if act is not None:
        shape, s1, s2 = act
        fields.update(a1=_desc(_FP8, shape, s1), a2=_desc(_FP8, shape, s2))
    return dataclasses.replace(qc, **fields) if fields else qc


def _desc(dtype, shape, scale=None):
    from reference.config import FusedMoEQuantDesc

    return FusedMoEQuantDesc(dtype, shape, scale)


def _fp8_cross(scheme, w1, w2, w1_bias, w2_bias, extra):
    """FP8 weights per tensor / per output channel / per block (the scheme's weight key) under the scheme's activation
    key: vLLM 0.33's Humming pairs (``experts/fused_humming_moe.py``) and XPU's FP8 W8A16 (``experts/xpu_moe.py``)."""
    sch = get_scheme(scheme)
    wk = sch.quant_keys()[0]
    gs = tuple(wk.scale.group_shape)
    if gs == (-1, -1) or gs == (-1, 1):
        per_channel = gs == (-1, 1)
        (w1q, s1), (w2q, s2) = (_stack([q.scaled_fp8_quant(w[e], use_per_token_if_dynamic=per_channel)
                                        for e in range(w.shape[0])]) for w in (w1, w2))
        if not per_channel:
            s1, s2 = s1.reshape(-1), s2.reshape(-1)
        qc = fp8_w8a16_moe_quant_config(s1, s2, per_out_ch_quant=per_channel)
    else:  # bn x bk blocks (fp32 scales), the block shape read from the weight key
        w1q, s1 = q.per_block_quant_fp8(w1, gs)
        w2q, s2 = q.per_block_quant_fp8(w2, gs)
        qc = fp8_w8a16_moe_quant_config(s1, s2, block_shape=list(gs))
    return w1q, w2q, _with_fp8_activations(qc, sch.activation_key, extra)


def _fp8_block_shape(scheme, w1, w2, w1_bias, w2_bias, extra):
    """FP8 weights per ``bn x bk`` block (the weight key's group shape: vLLM 0.33 accepts any checkpoint
    ``weight_block_size`` and ``refine_fp8_moe_block_shape``'s ``[r, r]``), activations per 1 x bk group
    (``fused_moe/utils.py::_fp8_quantize``), as ``fp8_block64``."""
    bn, bk = get_scheme(scheme).quant_keys()[0].scale.group_shape
    w1q, s1 = q.per_block_quant_fp8(w1, (bn, bk))
    w2q, s2 = q.per_block_quant_fp8(w2, (bn, bk))
    return w1q, w2q, fp8_w8a8_moe_quant_config(s1, s2, block_shape=[bn, bk], **extra)


def _int8_block(scheme, w1, w2, w1_bias, w2_bias, extra):
    """Block INT8 W8A8 (``fused_moe.py`` ``use_int8_w8a8`` + ``block_shape``): 128x128 weight blocks, activations per
    1x128 group with vLLM's truncating ``per_token_group_quant_int8``."""
    from reference.config import int8_w8a8_block_moe_quant_config

    (w1q, s1), (w2q, s2) = q.per_block_quant_int8(w1, (128, 128)), q.per_block_quant_int8(w2, (128, 128))
    return w1q, w2q, int8_w8a8_block_moe_quant_config(s1, s2, [128, 128])


def _int8_cross(scheme, w1, w2, w1_bias, w2_bias, extra):
    """Humming's INT8 weight pairs: weight-only INT8 (``kInt8Static``, as ``int8_w8a16``) with FP8 dynamic per-token
    activations, and INT8 per-channel weights (as ``int8_channel_token``) with bf16 activations."""
    import dataclasses

    sch = get_scheme(scheme)
    if sch.weight_key == "kInt8Static":
        (w1q, s1, _), (w2q, s2, _) = (q.wna16_quantize(w, num_bits=8, group_size=128, zero_points=False,
                                                       scale_dtype=w.dtype) for w in (w1, w2))
        qc = int8_w8a16_moe_quant_config(s1, s2, block_shape=[0, 128])
        return w1q, w2q, _with_fp8_activations(qc, sch.activation_key, extra)
    (w1q, s1), (w2q, s2) = q.int8_quant_per_channel(w1), q.int8_quant_per_channel(w2)
    qc = int8_w8a8_moe_quant_config(s1, s2)
    return w1q, w2q, dataclasses.replace(qc, a1=_desc(None, None), a2=_desc(None, None))


def _int4_w4a8_int8(scheme, w1, w2, w1_bias, w2_bias, extra):
    """CPU INT4 W4A8 (``experts/cpu_int4_moe.py``): INT4 values stored as int8 with bf16 group scales (group from
    the weight key) or fp32 channel scales; the activations are quantized inside
    each GEMM (asymmetric INT8 per row)."""
    from reference.config import int4_w4a8_int8_moe_quant_config

    gs = get_scheme(scheme).quant_keys()[0].scale.group_shape
    group = None if tuple(gs) == (-1, 1) else gs[1]
    (w1q, s1), (w2q, s2) = (q.int4_w4a8_int8_quantize_weight(w, group) for w in (w1, w2))
    return w1q, w2q, int4_w4a8_int8_moe_quant_config(s1, s2, group)


_BUILDERS_FP_INT: dict[str, Callable] = {
    "fp8_tensor_w8a16": _fp8_cross,
    "fp8_tensor_block": _fp8_cross,
    "fp8_channel_block": _fp8_cross,
    "fp8_channel_tensor_static": _fp8_cross,
    "fp8_block128_w8a16": _fp8_cross,
    "fp8_block128_token": _fp8_cross,
    "fp8_block128x64": _fp8_block_shape,
    "fp8_block64x128": _fp8_block_shape,
    "fp8_block32": _fp8_block_shape,
    "int8_block128": _int8_block,
    "int8_w8a16_fp8_token": _int8_cross,
    "int8_channel_w8a16": _int8_cross,
    "int4_w4a8_int8_g128": _int4_w4a8_int8,
    "int4_w4a8_int8_g64": _int4_w4a8_int8,
    "int4_w4a8_int8_g32": _int4_w4a8_int8,
    "int4_w4a8_int8_channel": _int4_w4a8_int8,
}
_BUILDERS.update(_BUILDERS_FP_INT)

@cache
def schemes() -> dict[str, Scheme]:
    """Every scheme of ``specs/schemes.toml`` by name, in file order.

    Raises:
        ValueError: a scheme of the TOML without a builder here (or the reverse for a quantized one), or an entry
            missing ``keys``.
    """
    out = {}
    for name, raw in load_schemes().items():
        try:
            wkey, akey = raw["keys"]
            out[name] = Scheme(name, raw.get("description", ""), wkey, akey,
                               str(raw.get("since", "0.17")), raw.get("upstream", ""))
        except (KeyError, ValueError) as exc:
            raise ValueError(f"specs/schemes.toml [schemes.{name}]: needs keys = [weight, "
                             f"activation] ({exc})") from None
    missing = sorted(set(out) - set(_BUILDERS))
    unlisted = sorted(set(_BUILDERS) - set(out) - UNQUANTIZED)
    if missing or unlisted:
        raise ValueError(f"reference.schemes and specs/schemes.toml disagree: no builder for {missing}, "
                         f"not in the TOML: {unlisted}")
    return out


def get_scheme(name: str) -> Scheme:
    """The :class:`Scheme` named ``name``.

    Raises:
        ValueError: unknown scheme (lists the known ones).
    """
    try:
        return schemes()[name]
    except KeyError:
        raise ValueError(f"unknown scheme {name!r}; known: {', '.join(schemes())}") from None


def quantize_weights(scheme: str, w1: torch.Tensor, w2: torch.Tensor, *, w1_bias=None, w2_bias=None,
                     gemm1_alpha=None, gemm1_clamp_limit=None):
    """``(w1q, w2q, quant_config)`` for ``scheme`` from bf16 ``w1 (E, N, K)`` and ``w2 (E, K, I)``.

    Unquantized schemes return the weights unchanged. ``w1_bias`` / ``w2_bias`` (bf16 ``(E, N)`` / ``(E, K)``) go
    into the config where the scheme carries biases (unquantized, MXFP4); ``gemm1_alpha`` / ``gemm1_clamp_limit``
    are the SWIGLUOAI parameters the config passes to the activation.

    Raises:
        ValueError: unknown scheme (lists the known ones).
    """
    if scheme not in UNQUANTIZED:
        get_scheme(scheme)  # unknown names raise here, naming the known ones
    extra = dict(gemm1_alpha=gemm1_alpha, gemm1_clamp_limit=gemm1_clamp_limit)
    return _BUILDERS[scheme](scheme, w1, w2, w1_bias, w2_bias, extra)
