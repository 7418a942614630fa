"""The formats of a ``FusedMoEQuantConfig``, one table entry per format: how the experts quantize an activation,
and how the reference loop dequantizes an activation or a weight back to fp32.

Every format that an operand descriptor (``reference.config.FusedMoEQuantDesc``) can name has one ``MoEFormat``
entry in ``FORMATS``, holding everything the experts path needs to know about it:

============== ========= ============================================ =============================================
format         w packing activation quantizer (``a1`` / ``a2``)      weight dequantizer (expert ``e``)
============== ========= ============================================ =============================================
unquantized    1         identity (scale None)                         upcast
fp8 (e4m3)     1         static / dynamic per-tensor, per-token,       codes x scale per tensor / channel / 1xG /
                         per-1xG group (``recipe``, ``use_ue8m0``)     128x128 block (``dequant_groups``)
int8           1         static per-tensor, dynamic per-token /        as fp8 (also bn x bk blocks)
                         per-tensor, dynamic per 1xG group
                         (``per_token_group_quant_int8``: truncated)
mxfp8          1         ``mxfp8_quantize`` (recipe's MX scale rule)   ``mxfp8_dequantize``
mxfp4          2         ``mxfp4_quantize`` (W4A4 activations)         ``mxfp4_dequantize``
mxfp6_e3m2,    1         ``mxfp6_quantize`` (Quark's "even" scale      ``mxfp6_dequantize`` rounded to the
mxfp6_e2m3               rule; codes one per byte)                     activation dtype (OCP MX emulation; exact)
nvfp4          2         ``nvfp4_quantize`` with ``a*_gscale``, or per ``nvfp4_dequantize`` (global scale per expert)
                         token (``kNvfp4DynamicToken``)
wna16          2 (int4)  not quantized (weight-only)                   ``wna16_dequantize``, rounded to the scales'
                                                                       dtype
int4_w4a8      8         (its activations are fp8)                     ``w4a8_dequantize_weight`` x channel scale
int4_w4a8_int8 1         none: each GEMM quantizes its own input rows  ``int4_w4a8_int8_dequantize_weight``
                         (``gemm_input_quantizer``: asymmetric INT8)
============== ========= ============================================ =============================================

``moe_kernel_quantize_input`` mirrors ``vllm/model_executor/layers/fused_moe/utils.py::moe_kernel_quantize_input``;
its output is what ``dequant_activation`` takes back, so the pair lives here together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from reference import quant as q
from reference.config import FusedMoEQuantConfig, FusedMoEQuantDesc, is_wna16
from reference.quant._common import cdiv

__all__ = [
    "MoEFormat",
    "FORMATS",
    "format_of",
    "moe_kernel_quantize_input",
    "dequant_groups",
    "dequant_activation",
    "dequant_weight",
    "weight_pack_factor",
    "gemm_input_quantizer",
]


def dequant_groups(q: torch.Tensor, scale: torch.Tensor | None, group_shape: tuple[int, int] | None) -> torch.Tensor:
    """Dequantize a 2-D code tensor ``q (R, C)``: ``q * scale`` with one scale per ``group_shape`` tile, in fp32.

    ``group_shape`` entries of -1 mean "the whole dimension". ``scale`` may be None (unquantized: just upcast),
    a single element, or hold ``cdiv(R, gr) * cdiv(C, gc)`` elements in row-major tile order (any strides).

    Raises:
        ValueError: ``scale`` has the wrong number of elements for the tiling.
    """
    x = q.float()
    if scale is None:
        return x
    s = scale.float()
    if s.numel() == 1:
        return x * s.reshape(())
    R, C = q.shape
    gr, gc = group_shape if group_shape is not None else (-1, -1)
    gr = R if gr == -1 else gr
    gc = C if gc == -1 else gc
    tiles = (cdiv(R, gr), cdiv(C, gc))
    if s.numel() != tiles[0] * tiles[1]:
        raise ValueError(f"scale has {s.numel()} elements; {tuple(q.shape)} in {gr}x{gc} tiles needs {tiles}")
    s = s.reshape(tiles).repeat_interleave(gr, 0)[:R].repeat_interleave(gc, 1)[:, :C]
    return x * s


def _per_expert(t: torch.Tensor | None, e: int) -> torch.Tensor | None:
    """Expert e's slice of a per-expert scale; a single (per-tensor, shared) scale is returned as is."""
    if t is None or t.numel() == 1:
        return t
    return t[e]


# ------------------------------------------------------------------------------------------------------------
# One entry per format
# ------------------------------------------------------------------------------------------------------------

#: ``quantize(A, A_scale, quant_config, desc, desc_name) -> (A_q, scale)``
Quantize = Callable[[torch.Tensor, "torch.Tensor | None", FusedMoEQuantConfig, FusedMoEQuantDesc, str],
                    "tuple[torch.Tensor, torch.Tensor | None]"]


@dataclass(frozen=True)
class MoEFormat:
    """Everything the experts path knows about one operand format.

    Fields:
        name: the format's name (``format_of`` returns it).
        pack: weight elements per stored element (w1 is ``(E, N, K // pack)``).
        quantize: the activation quantizer ``(A, A_scale, quant_config, desc, desc_name) -> (A_q, scale)``; None
            where the format has no activation quantizer in the reference (``moe_kernel_quantize_input`` raises).
        dequantize_activation: ``(A_q (M, K'), scale, desc) -> fp32 (M, K)``.
        dequantize_weight: ``(w (E, N, K'), desc, e) -> fp32 (N, K)``: expert e's weight.
    """

    name: str
    pack: int
    quantize: Quantize | None
    dequantize_activation: Callable[[torch.Tensor, "torch.Tensor | None", FusedMoEQuantDesc], torch.Tensor] | None
    dequantize_weight: Callable[[torch.Tensor, FusedMoEQuantDesc, int], torch.Tensor]


def _quant_fp8(A, A_scale, qc, desc, desc_name):
    if desc.shape is not None and desc.shape[0] == 1 and desc.shape[1] > 0:
        return q.per_token_group_quant_fp8(A, desc.shape[1], use_ue8m0=qc.use_ue8m0, recipe=qc.recipe)
    return q.scaled_fp8_quant(A, A_scale, use_per_token_if_dynamic=desc.shape == (1, -1))


def _quant_int8(A, A_scale, qc, desc, desc_name):
    if A_scale is None and desc.shape is not None and desc.shape[0] == 1 and desc.shape[1] > 0:
        return q.per_token_group_quant_int8(A, desc.shape[1])  # block INT8 W8A8 (utils.py::_int8_quantize)
    if A_scale is not None:
        return q.int8_quant_static(A, A_scale)
    if desc.shape == (1, -1):
        return q.int8_quant_per_token(A)
    return q.int8_quant_per_tensor(A)  # kInt8DynamicTensorSym (vLLM 0.33 utils.py::_int8_quantize)


def _quant_mxfp8(A, A_scale, qc, desc, desc_name):
    return q.mxfp8_quantize(A, scale_rule=q.get_recipe(qc.recipe).mx_scale_rule)


def _quant_mxfp4(A, A_scale, qc, desc, desc_name):  # kMxfp4Dynamic (W4A4): codes and E8M0 scales
    return q.mxfp4_quantize(A, scale_rule=q.get_recipe(qc.recipe).mx_scale_rule)


def _quant_mxfp6(A, A_scale, qc, desc, desc_name):
    # kMxfp6E3M2Dynamic / kMxfp6E2M3Dynamic: vLLM 0.33 fake-quantizes (fused_moe/utils.py::_mxfp6_e3m2_quantize,
    # Quark's quant-dequant with the "even" scale rule whatever the recipe); the codes and scales here dequantize to
    # exactly those values (mxfp6_quantize's docstring).
    return q.mxfp6_quantize(A, desc.dtype.split("_")[1], scale_rule="even")


def _dequant_w_mxfp6(w, desc, e, act_dtype=torch.bfloat16):
    # OCP MX emulation (fused_moe/experts/ocp_mx_emulation_moe.py): the weights are dequantized to the activation
    # dtype before the bf16 Triton GEMM (mxfp6_utils.py::_dequant_mxfp6 ... .to(float_dtype)). The rounding is
    # mirrored here with bf16 (the dtype of every OCP MX case; exact unless a scale is below 2^-120).
    return q.mxfp6_dequantize(w[e], desc.scale[e], desc.dtype.split("_")[1], out_dtype=act_dtype).float()


def _quant_nvfp4(A, A_scale, qc, desc, desc_name):
    if desc.alpha_or_gscale is None:
        raise ValueError(f"NVFP4 activation quantization needs the global scale ({desc_name}_gscale)")
    packed, block_scales, _ = q.nvfp4_quantize(A, desc.alpha_or_gscale)
    return packed, block_scales


def _quant_nvfp4_per_token(A, A_scale, qc, desc, desc_name):
    # kNvfp4DynamicToken: the scale handed on is the per-block decode factor SF / gs_token (fp32 (M, K // 16)),
    # so it slices by rows like every other activation scale; the bits are nvfp4_quantize_per_token's.
    packed, block_scales, gs = q.nvfp4_quantize_per_token(A)
    return packed, block_scales.to(torch.float32) / gs


def _dequant_act_groups(aq, scale, desc):
    return dequant_groups(aq, scale, desc.shape)


def _dequant_act_nvfp4_per_token(aq, scale, desc):  # scale: per-block decode factors SF / gs_token (fp32)
    return q.e2m1_decode(q.unpack_fp4(aq)) * scale.float().repeat_interleave(q.NVFP4_BLOCK_SIZE, dim=-1)


def _dequant_w_groups(w, desc, e):
    return dequant_groups(w[e], _per_expert(desc.scale, e), desc.shape)


def _dequant_w_wna16(w, desc, e):  # weight-only INT4 / INT8: ((u - zp) * s) rounded to the scales' dtype
    zp = None if desc.zp is None else desc.zp[e]
    return q.wna16_dequantize(w[e], desc.scale[e], zp, num_bits=4 if desc.dtype == "int4" else 8,
                                 group_size=desc.shape[1], out_dtype=desc.scale.dtype).float()


def _dequant_w_nvfp4(w, desc, e):
    return q.nvfp4_dequantize(w[e], desc.scale[e], _per_expert(desc.alpha_or_gscale, e))


def _dequant_w_int4_w4a8(w, desc, e):
    wq = q.w4a8_dequantize_weight(w[e], desc.scale[e], desc.shape[1])
    chan = _per_expert(desc.alpha_or_gscale, e)
    return wq if chan is None else wq * chan.float().reshape(-1, 1)


FORMATS: dict[str, MoEFormat] = {f.name: f for f in (
    MoEFormat("unquantized", 1, None, lambda aq, scale, desc: aq.float(), lambda w, desc, e: w[e].float()),
    MoEFormat("fp8", 1, _quant_fp8, _dequant_act_groups, _dequant_w_groups),
    MoEFormat("int8", 1, _quant_int8, _dequant_act_groups, _dequant_w_groups),
    MoEFormat("mxfp8", 1, _quant_mxfp8, lambda aq, scale, desc: q.mxfp8_dequantize(aq, scale),
              lambda w, desc, e: q.mxfp8_dequantize(w[e], desc.scale[e])),
    MoEFormat("mxfp4", 2, _quant_mxfp4, lambda aq, scale, desc: q.mxfp4_dequantize(aq, scale),
              lambda w, desc, e: q.mxfp4_dequantize(w[e], desc.scale[e])),
    *(MoEFormat(f, 1, _quant_mxfp6, lambda aq, scale, desc: q.mxfp6_dequantize(aq, scale, desc.dtype.split("_")[1]),
                _dequant_w_mxfp6) for f in ("mxfp6_e3m2", "mxfp6_e2m3")),
    MoEFormat("nvfp4", 2, _quant_nvfp4,
              lambda aq, scale, desc: q.nvfp4_dequantize(aq, scale, desc.alpha_or_gscale), _dequant_w_nvfp4),
    MoEFormat("nvfp4_per_token", 2, _quant_nvfp4_per_token, _dequant_act_nvfp4_per_token, _dequant_w_nvfp4),
    MoEFormat("wna16", 2, None, None, _dequant_w_wna16),
    MoEFormat("int4_w4a8", 8, None, None, _dequant_w_int4_w4a8),
)}

# issue 41: the CPU INT4 W4A8 weights (INT4 values stored as int8, bf16 group / fp32 channel scales); their GEMMs
# quantize the activations themselves (gemm_input_quantizer), so the format has no activation quantizer of its own.
FORMATS["int4_w4a8_int8"] = MoEFormat(
    "int4_w4a8_int8", 1, None, None,
    lambda w, desc, e: q.int4_w4a8_int8_dequantize_weight(w[e], desc.scale[e]))

_BY_DTYPE = {None: "unquantized", torch.float8_e4m3fn: "fp8", torch.int8: "int8", "mxfp8": "mxfp8",
             "mxfp4": "mxfp4", "nvfp4": "nvfp4", "int4_w4a8": "int4_w4a8", "int4_w4a8_int8": "int4_w4a8_int8",
             "mxfp6_e3m2": "mxfp6_e3m2", "mxfp6_e2m3": "mxfp6_e2m3"}


def format_of(desc: FusedMoEQuantDesc) -> str | None:
    """The ``FORMATS`` key of an operand descriptor, or None for a dtype the reference does not define."""
    if is_wna16(desc):
        return "wna16"
    if desc.dtype == "nvfp4" and desc.per_token_gscale:
        return "nvfp4_per_token"
    return _BY_DTYPE.get(desc.dtype)


def weight_pack_factor(desc: FusedMoEQuantDesc) -> int:
    """Weight elements per stored element for ``desc`` (1 for unknown formats: nothing packed)."""
    name = format_of(desc)
    if name is None or name == "wna16":  # INT4 two to a byte; INT8 weight-only is not packed
        return 2 if desc.dtype == "int4" else 1
    return FORMATS[name].pack


def moe_kernel_quantize_input(
    A: torch.Tensor,
    A_scale: torch.Tensor | None,
    quant_config: FusedMoEQuantConfig,
    desc_name: str = "a1",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize an activation as the quant config's ``a1`` (or ``a2``) descriptor says.

    Returns ``(A, None)`` unchanged when the activation is not quantized. FP8: static per-tensor when a scale is
    given, else dynamic per-tensor / per-token / per-1x``block_k`` group (row-major fp32 scales ``(M, K/block_k)``,
    UE8M0-rounded when ``quant_config.use_ue8m0``) under ``quant_config.recipe``. INT8: dynamic per-token or static
    per-tensor. MXFP8 / MXFP4 / MXFP6: codes and E8M0 scales. NVFP4: packed codes and block scales (per-token global scale:
    the per-block decode factors). Mirrors ``vllm/model_executor/layers/fused_moe/utils.py::moe_kernel_quantize_input``.

    Raises:
        NotImplementedError: a format with no activation quantizer here (its name says which).
        ValueError: NVFP4 without its global scale.
    """
    desc = getattr(quant_config, desc_name)
    if desc.dtype is None:
        return A, None
    name = _BY_DTYPE.get(desc.dtype)
    if name == "nvfp4" and desc.per_token_gscale:
        name = "nvfp4_per_token"
    fmt = FORMATS.get(name) if name is not None else None
    if fmt is None or fmt.quantize is None:
        raise NotImplementedError(f"activation quantization to {desc.dtype!r} is not defined in the reference")
    return fmt.quantize(A, A_scale, quant_config, desc, desc_name)


def dequant_activation(aq: torch.Tensor, scale: torch.Tensor | None, desc: FusedMoEQuantDesc) -> torch.Tensor:
    """A quantized activation ``(M, K')`` (as ``moe_kernel_quantize_input`` returns it) back to fp32 ``(M, K)``.

    Formats without an activation dequantizer of their own (none of the configs' activations) are read as codes
    times group scales (``dequant_groups``).
    """
    name = format_of(desc)
    fmt = FORMATS.get(name) if name is not None else None
    if fmt is None or fmt.dequantize_activation is None:
        return dequant_groups(aq, scale, desc.shape)
    return fmt.dequantize_activation(aq, scale, desc)


def dequant_weight(w: torch.Tensor, desc: FusedMoEQuantDesc, e: int) -> torch.Tensor:
    """Expert e's weight of ``w (E, N, K')`` as fp32 ``(N, K)``: codes times scales (exact in fp32 for every format
    here; WNA16 rounds to its scales' dtype as the kernels do)."""
    name = format_of(desc)
    if name is None:
        return _dequant_w_groups(w, desc, e)
    return FORMATS[name].dequantize_weight(w, desc, e)


def gemm_input_quantizer(w_desc: FusedMoEQuantDesc) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The quantize-dequantize a GEMM applies to its own input rows, for weight formats whose kernels quantize the
    activations inside the GEMM; None for every other format (the config's a1 / a2 descriptors say it all).

    ``"int4_w4a8_int8"`` (CPU INT4 W4A8, vLLM 0.33 ``experts/cpu_int4_moe.py``): each GEMM of
    ``csrc/cpu/dynamic_4bit_int_moe_cpu.cpp`` (``at::_dyn_quant_matmul_4bit``) quantizes its left-hand side to
    asymmetric INT8 per row (``reference.quant.dyn_quant_int8_per_row_asym``); the callable returns the fp32 values
    ``(q - zp) * recip`` of ``rows (R, K)``.
    """
    if w_desc.dtype != "int4_w4a8_int8":
        return None

    def quantize(rows: torch.Tensor) -> torch.Tensor:
        return q.dequant_int8_per_row_asym(*q.dyn_quant_int8_per_row_asym(rows))

    return quantize
