"""Quantization keys: ``GroupShape``, ``ScaleDesc``, ``QuantKey`` and the named keys that experts
match on in ``_supports_quant_scheme(weight_key, activation_key)`` (seeds 001 / 002 / 004).

Mirrors ``vllm/model_executor/layers/quantization/utils/quant_utils.py``. One deliberate
difference: keys carry the *logical* dtype. vLLM stores FP4 data as ``torch.uint8`` (FP4_DTYPE)
and MX scales as ``torch.uint8`` (MXFP_SCALE_DTYPE); here they are ``torch.float4_e2m1fn_x2``
and ``torch.float8_e8m0fnu`` so a key says what the bytes mean. INT4 weights use ``torch.int4``
(vLLM 0.33: ``INT4_DTYPE = scalar_types.uint4b8``, the same values stored with a bias of 8), asymmetric
INT4 ``torch.uint4`` (``scalar_types.uint4``), and ``kInt8Static``'s INT8 ``torch.int8`` (vLLM 0.33:
``INT8_DTYPE = scalar_types.uint8b128``).

Versions: the names vLLM 0.33.0 defines and vLLM 0.17.0 does not are listed in :data:`KEYS_NEW_IN_0_33`
(semantics point ``quant.keys``); a name the reference adds where vLLM builds a key without naming it is in
:data:`REFERENCE_ONLY_KEYS`. One name changed meaning: ``kInt4W4A8StaticGroup128Sym`` is, as in vLLM 0.33,
INT8-stored INT4 weights with *bf16* group scales (the CPU W4A8 experts' key); the CUTLASS INT4 x FP8 experts
(``cutlass_moe_w4a8_fp8``) claim ``(kInt4Static, kFp8DynamicTokenSym)`` (``fused_moe/experts/cutlass_moe.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, Mapping, NamedTuple

import torch

__all__ = [
    "GroupShape",
    "ScaleDesc",
    "QuantKey",
    "create_fp8_quant_key",
    "QUANT_KEYS",
    "kStaticTensorScale",
    "kDynamicTensorScale",
    "kStaticTokenScale",
    "kDynamicTokenScale",
    "kStaticChannelScale",
    "kFp8StaticTensorSym",
    "kFp8DynamicTensorSym",
    "kFp8StaticTokenSym",
    "kFp8DynamicTokenSym",
    "kFp8StaticChannelSym",
    "kFp8Dynamic128Sym",
    "kFp8Dynamic64Sym",
    "kFp8Static128BlockSym",
    "kFp8Static128BlockE8M0Sym",
    "kMxfp8Static",
    "kMxfp8Dynamic",
    "kMxfp4Static",
    "kMxfp4Dynamic",
    "kMxfp6E3M2Static",
    "kMxfp6E3M2Dynamic",
    "kMxfp6E2M3Static",
    "kMxfp6E2M3Dynamic",
    "FloatScalarType",
    "kNvfp4Static",
    "kNvfp4Dynamic",
    "kInt8StaticChannelSym",
    "kInt8DynamicTokenSym",
    "kInt8StaticTensorSym",
    "kInt8DynamicTensorSym",
    "kInt8DynamicTokenAsym",
    "kInt8StaticTensorAsym",
    "kInt8DynamicTensorAsym",
    "kInt8Dynamic32Sym",
    "kNvfp4DynamicToken",
    "kFp8Static64BlockSym",
    "kInt4StaticGroup128Sym",
    "kInt4Static",
    "kInt4StaticAsym",
    "kInt4Static32",
    "kInt4Static32Asym",
    "kInt8Static",
    "kInt4W4A8StaticGroup128Sym",
    "kInt4W4A8StaticGroup64Sym",
    "kInt4W4A8StaticGroup32Sym",
    "kInt4W4A8StaticGroupSym",
    "kInt4W4A8StaticChannelSym",
    "KEYS_NEW_IN_0_33",
    "REFERENCE_ONLY_KEYS",
]

FP8_DTYPE = torch.float8_e4m3fn
FP4_DTYPE = torch.float4_e2m1fn_x2
E8M0_DTYPE = torch.float8_e8m0fnu
INT4_DTYPE = torch.int4


@dataclass(frozen=True)
class FloatScalarType:
    """A floating element type torch has no dtype for, by vLLM's ``scalar_types`` name (``vllm/scalar_type.py``:
    ``float6_e3m2f = ScalarType.float_(3, 2, True, NanRepr.NONE)``, ``float6_e2m3f``): the MXFP6 keys' dtype."""

    name: str
    exponent: int
    mantissa: int

    def __repr__(self) -> str:
        return self.name


FP6_E3M2_DTYPE = FloatScalarType("float6_e3m2f", 3, 2)
FP6_E2M3_DTYPE = FloatScalarType("float6_e2m3f", 2, 3)

_DTYPE_NAMES = {
    torch.float8_e4m3fn: "fp8e4m3",
    torch.float4_e2m1fn_x2: "fp4e2m1",
    torch.float8_e8m0fnu: "e8m0",
    torch.int8: "int8",
    torch.int4: "int4",
    torch.uint8: "uint8",
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    FP6_E3M2_DTYPE: "fp6e3m2",
    FP6_E2M3_DTYPE: "fp6e2m3",
}


def _dtype_name(d: torch.dtype) -> str:
    return _DTYPE_NAMES.get(d, str(d).replace("torch.", ""))


class _GroupShape(NamedTuple):
    row: int
    col: int


class GroupShape(_GroupShape):
    """Shape of the elements that share one scale; ``-1`` means the full extent of that dim.

    ``PER_TENSOR = (-1, -1)``, ``PER_TOKEN = (1, -1)``, ``PER_CHANNEL = (-1, 1)``; ``(1, 128)`` is a
    1x128 activation group, ``(128, 128)`` a weight block. Mirrors vLLM's ``GroupShape``.
    """

    PER_TENSOR: ClassVar["GroupShape"]
    PER_TOKEN: ClassVar["GroupShape"]
    PER_CHANNEL: ClassVar["GroupShape"]

    def is_per_tensor(self) -> bool:
        return self.row == -1 and self.col == -1

    def is_per_token(self) -> bool:
        return self.row == 1 and self.col == -1

    def is_per_channel(self) -> bool:
        return self.row == -1 and self.col == 1

    def is_per_group(self) -> bool:
        return self.row == 1 and self.col >= 1

    def describe(self) -> str:
        """``"per-tensor"``, ``"per-token"``, ``"per-channel"``, ``"1x128 groups"``, ``"128x128 blocks"``."""
        if self.is_per_tensor():
            return "per-tensor"
        if self.is_per_token():
            return "per-token"
        if self.is_per_channel():
            return "per-channel"
        if self.is_per_group():
            return f"1x{self.col} groups"
        return f"{self.row}x{self.col} blocks"

    def __repr__(self) -> str:
        return f"GroupShape({self.row}, {self.col})"


GroupShape.PER_TENSOR = GroupShape(-1, -1)
GroupShape.PER_TOKEN = GroupShape(1, -1)
GroupShape.PER_CHANNEL = GroupShape(-1, 1)


@dataclass(frozen=True, repr=False)
class ScaleDesc:
    """One level of scaling: scale dtype, static (calibrated) or dynamic (computed at runtime),
    and the group shape it covers. Mirrors vLLM's ``ScaleDesc``."""

    dtype: torch.dtype
    static: bool
    group_shape: GroupShape

    def __str__(self) -> str:
        kind = "static" if self.static else "dynamic"
        return f"{_dtype_name(self.dtype)}, {kind}, {self.group_shape.describe()}"

    def __repr__(self) -> str:
        return f"ScaleDesc({self})"


@dataclass(frozen=True, repr=False)
class QuantKey:
    """Identifies a quantization scheme: quantized dtype, scale, optional second-level scale
    (NVFP4 global scale, W4A8 channel scale), symmetric or not. Mirrors vLLM's ``QuantKey``.

    ``repr`` reads like ``QuantKey(fp8e4m3, static, 128x128 blocks, sym)``; the scale dtype is
    named when it is not fp32, e.g. ``QuantKey(fp4e2m1, dynamic, 1x16 groups, fp8e4m3 scales,
    scale2=fp32 static per-tensor, sym)``. Keys are hashable and compare by value.
    """

    dtype: torch.dtype
    scale: ScaleDesc
    scale2: ScaleDesc | None = None
    symmetric: bool = True

    def __repr__(self) -> str:
        sc = self.scale
        parts = [_dtype_name(self.dtype), "static" if sc.static else "dynamic", sc.group_shape.describe()]
        if sc.dtype != torch.float32:
            parts.append(f"{_dtype_name(sc.dtype)} scales")
        if self.scale2 is not None:
            s2 = self.scale2
            parts.append(
                f"scale2={_dtype_name(s2.dtype)} {'static' if s2.static else 'dynamic'} {s2.group_shape.describe()}"
            )
        parts.append("sym" if self.symmetric else "asym")
        return f"QuantKey({', '.join(parts)})"

    __str__ = __repr__


def create_fp8_quant_key(
    static: bool, group_shape: GroupShape, symmetric: bool = True, scale_dtype: torch.dtype = torch.float32
) -> QuantKey:
    """An FP8 E4M3 key with one scale level (vLLM ``create_fp8_quant_key``)."""
    return QuantKey(FP8_DTYPE, ScaleDesc(scale_dtype, static, group_shape), symmetric=symmetric)


kStaticTensorScale = ScaleDesc(torch.float32, True, GroupShape.PER_TENSOR)
kDynamicTensorScale = ScaleDesc(torch.float32, False, GroupShape.PER_TENSOR)
kStaticTokenScale = ScaleDesc(torch.float32, True, GroupShape.PER_TOKEN)
kDynamicTokenScale = ScaleDesc(torch.float32, False, GroupShape.PER_TOKEN)
kStaticChannelScale = ScaleDesc(torch.float32, True, GroupShape.PER_CHANNEL)

# FP8 E4M3
kFp8StaticTensorSym = QuantKey(FP8_DTYPE, kStaticTensorScale)
kFp8DynamicTensorSym = QuantKey(FP8_DTYPE, kDynamicTensorScale)
kFp8StaticTokenSym = QuantKey(FP8_DTYPE, kStaticTokenScale)
kFp8DynamicTokenSym = QuantKey(FP8_DTYPE, kDynamicTokenScale)
kFp8StaticChannelSym = QuantKey(FP8_DTYPE, kStaticChannelScale)
kFp8Dynamic128Sym = QuantKey(FP8_DTYPE, ScaleDesc(torch.float32, False, GroupShape(1, 128)))
kFp8Dynamic64Sym = QuantKey(FP8_DTYPE, ScaleDesc(torch.float32, False, GroupShape(1, 64)))
kFp8Static128BlockSym = QuantKey(FP8_DTYPE, ScaleDesc(torch.float32, True, GroupShape(128, 128)))
# 128x128 blocks whose scales are powers of two (DeepGEMM E8M0: fp32-ceil on SM90, packed on SM100)
kFp8Static128BlockE8M0Sym = QuantKey(FP8_DTYPE, ScaleDesc(E8M0_DTYPE, True, GroupShape(128, 128)))

# MX: E8M0 scale per 1x32
kMxfp8Static = QuantKey(FP8_DTYPE, ScaleDesc(E8M0_DTYPE, True, GroupShape(1, 32)))
kMxfp8Dynamic = QuantKey(FP8_DTYPE, ScaleDesc(E8M0_DTYPE, False, GroupShape(1, 32)))
kMxfp4Static = QuantKey(FP4_DTYPE, ScaleDesc(E8M0_DTYPE, True, GroupShape(1, 32)))
kMxfp4Dynamic = QuantKey(FP4_DTYPE, ScaleDesc(E8M0_DTYPE, False, GroupShape(1, 32)))
# MXFP6 (OCP MX; vLLM 0.33 quant_utils.py, the OCP MX emulation experts): E3M2 / E2M3 elements, E8M0 per 1x32
kMxfp6E3M2Static = QuantKey(FP6_E3M2_DTYPE, ScaleDesc(E8M0_DTYPE, True, GroupShape(1, 32)))
kMxfp6E3M2Dynamic = QuantKey(FP6_E3M2_DTYPE, ScaleDesc(E8M0_DTYPE, False, GroupShape(1, 32)))
kMxfp6E2M3Static = QuantKey(FP6_E2M3_DTYPE, ScaleDesc(E8M0_DTYPE, True, GroupShape(1, 32)))
kMxfp6E2M3Dynamic = QuantKey(FP6_E2M3_DTYPE, ScaleDesc(E8M0_DTYPE, False, GroupShape(1, 32)))

# NVFP4: E4M3 scale per 1x16 + fp32 global scale
kNvfp4Static = QuantKey(FP4_DTYPE, ScaleDesc(FP8_DTYPE, True, GroupShape(1, 16)), scale2=kStaticTensorScale)
kNvfp4Dynamic = QuantKey(FP4_DTYPE, ScaleDesc(FP8_DTYPE, False, GroupShape(1, 16)), scale2=kStaticTensorScale)

# INT8 W8A8
kInt8StaticChannelSym = QuantKey(torch.int8, kStaticChannelScale)
kInt8DynamicTokenSym = QuantKey(torch.int8, kDynamicTokenScale)
kInt8StaticTensorSym = QuantKey(torch.int8, kStaticTensorScale)
kInt8DynamicTensorSym = QuantKey(torch.int8, kDynamicTensorScale)
kInt8DynamicTokenAsym = QuantKey(torch.int8, kDynamicTokenScale, symmetric=False)
kInt8StaticTensorAsym = QuantKey(torch.int8, kStaticTensorScale, symmetric=False)
kInt8DynamicTensorAsym = QuantKey(torch.int8, kDynamicTensorScale, symmetric=False)
kInt8Dynamic32Sym = QuantKey(torch.int8, ScaleDesc(torch.float32, False, GroupShape(1, 32)))

# NVFP4 activations with one dynamic fp32 global scale per token (vLLM 0.33: FlashInfer TRT-LLM / CuteDSL experts,
# ``quantize_nvfp4_per_token_input``) instead of the calibrated per-tensor one of kNvfp4Dynamic.
kNvfp4DynamicToken = QuantKey(FP4_DTYPE, ScaleDesc(FP8_DTYPE, False, GroupShape(1, 16)), scale2=kDynamicTokenScale)

# FP8 weights per 64x64 block. vLLM 0.33 builds this key without naming it
# (``create_fp8_quant_key(static=True, group_shape=GroupShape(64, 64))`` in ``quantization/fp8.py`` when
# ``oracle/fp8.py::refine_fp8_moe_block_shape`` refines 128x128 checkpoint blocks for a TP shard); the Triton
# experts claim any such block shape with the activation key kFp8Dynamic128Sym (activations are then quantized
# per 1x64 group: ``fused_moe/utils.py::_fp8_quantize`` takes the group from the block shape, not the key).
kFp8Static64BlockSym = QuantKey(FP8_DTYPE, ScaleDesc(torch.float32, True, GroupShape(64, 64)))

# INT4 weights, group 128 along K, fp32 scales: a reference-only name of the seed era (no vLLM release names it).
kInt4StaticGroup128Sym = QuantKey(INT4_DTYPE, ScaleDesc(torch.float32, True, GroupShape(1, 128)))

# Weight-only INT4 / INT8 (WNA16: Marlin, TritonWNA16Experts, ...; vLLM 0.33 quant_utils.py). The scale
# descriptor is vLLM's as written (fp16, group shape (1, -1) = "a group size chosen at runtime"; vLLM marks it
# "TODO: not right"): the scales are stored in the activation dtype and the group size is the checkpoint's. The
# group-32 keys name that size; every other group size uses the generic key.
kInt4StaticGroupScale = ScaleDesc(torch.float16, True, GroupShape(1, -1))
kInt4Static = QuantKey(INT4_DTYPE, kInt4StaticGroupScale)
kInt8Static = QuantKey(torch.int8, ScaleDesc(torch.float16, True, GroupShape(1, -1)))
kInt4Static32GroupScale = ScaleDesc(torch.float16, True, GroupShape(1, 32))
kInt4Static32 = QuantKey(INT4_DTYPE, kInt4Static32GroupScale)
kInt4StaticAsym = QuantKey(torch.uint4, kInt4StaticGroupScale, symmetric=False)
kInt4Static32Asym = QuantKey(torch.uint4, kInt4Static32GroupScale, symmetric=False)

# vLLM 0.33's W4A8 keys of the CPU INT4 experts (``experts/cpu_int4_moe.py``): INT4 values stored as int8 with bf16
# group scales (group 128 / 64 / 32 / runtime) or fp32 channel scales. Not the CUTLASS INT4 x FP8 format (that is
# kInt4Static with kFp8DynamicTokenSym activations).
kInt4W4A8StaticGroup128Sym = QuantKey(torch.int8, ScaleDesc(torch.bfloat16, True, GroupShape(1, 128)))
kInt4W4A8StaticGroup64Sym = QuantKey(torch.int8, ScaleDesc(torch.bfloat16, True, GroupShape(1, 64)))
kInt4W4A8StaticGroup32Sym = QuantKey(torch.int8, ScaleDesc(torch.bfloat16, True, GroupShape(1, 32)))
kInt4W4A8StaticGroupSym = QuantKey(torch.int8, ScaleDesc(torch.bfloat16, True, GroupShape(1, -1)))
kInt4W4A8StaticChannelSym = QuantKey(torch.int8, ScaleDesc(torch.float32, True, GroupShape.PER_CHANNEL))

#: Key names vLLM 0.33.0's ``quantization/utils/quant_utils.py`` defines and vLLM 0.17.0's does not (read from both
#: source distributions). The seeds (0.11-0.17 era experts) already used the MX ones; the reference has them under
#: both semantics versions, since a key is a name for a format, not a behaviour.
KEYS_NEW_IN_0_33 = frozenset({
    "kFp8Static128BlockE8M0Sym", "kMxfp8Static", "kMxfp8Dynamic", "kNvfp4DynamicToken",
    "kInt8StaticChannelSym", "kInt8DynamicTokenSym", "kInt8StaticTensorSym", "kInt8DynamicTensorSym",
    "kInt8DynamicTokenAsym", "kInt8StaticTensorAsym", "kInt8DynamicTensorAsym", "kInt8Dynamic32Sym",
    "kInt4Static", "kInt4StaticAsym", "kInt4Static32", "kInt4Static32Asym", "kInt8Static",
    "kInt4W4A8StaticGroup128Sym", "kInt4W4A8StaticGroup64Sym", "kInt4W4A8StaticGroup32Sym",
    "kInt4W4A8StaticGroupSym", "kInt4W4A8StaticChannelSym",
    "kMxfp6E3M2Static", "kMxfp6E3M2Dynamic", "kMxfp6E2M3Static", "kMxfp6E2M3Dynamic",
})
#: Names no vLLM release defines: the reference names a key vLLM builds unnamed (kFp8Static64BlockSym), or one of
#: the seed era's reference (kInt4StaticGroup128Sym).
REFERENCE_ONLY_KEYS = frozenset({"kFp8Static64BlockSym", "kInt4StaticGroup128Sym"})

# --- issue 41 (FP8 / INT scheme pairs): keys the reference names where vLLM 0.33 builds them unnamed --------------
# FP8 weights per bn x bk block with fp32 scales: ``quantization/fp8.py`` builds
# ``create_fp8_quant_key(static=True, group_shape=GroupShape(*weight_block_size))`` for any checkpoint block shape
# (``Fp8Config.weight_block_size``: any two dims) or the shape ``oracle/fp8.py::refine_fp8_moe_block_shape`` refines
# it to (``[r, r]``, ``r = gcd(block_n, block_k, ispp, hidden) >= 32``); ``TritonExperts._supports_quant_scheme``
# (``experts/triton_moe.py``) claims every static fp32 block shape with rows > 1 and cols > 1, paired with
# kFp8Dynamic128Sym (activations per 1 x block_k group). :func:`fp8_static_block_key` builds any of them.
kFp8Static128x64BlockSym = QuantKey(FP8_DTYPE, ScaleDesc(torch.float32, True, GroupShape(128, 64)))
kFp8Static64x128BlockSym = QuantKey(FP8_DTYPE, ScaleDesc(torch.float32, True, GroupShape(64, 128)))
kFp8Static32BlockSym = QuantKey(FP8_DTYPE, ScaleDesc(torch.float32, True, GroupShape(32, 32)))
# INT8 W8A8 with block weight scales and per-token-group activations: ``fused_moe.py`` (``use_int8_w8a8`` with
# ``block_shape``: ``utils.py::_int8_quantize`` -> ``int8_utils.py::per_token_group_quant_int8``), vLLM's
# ``tests/kernels/moe/test_block_int8.py``; no experts class of 0.33 claims a key for it (TritonExperts claims INT8
# per-channel / per-tensor only), so vLLM names neither key.
kInt8Static128BlockSym = QuantKey(torch.int8, ScaleDesc(torch.float32, True, GroupShape(128, 128)))
kInt8Dynamic128Sym = QuantKey(torch.int8, ScaleDesc(torch.float32, False, GroupShape(1, 128)))

#: Reference-only names of the issue-41 FP8 / INT pairs (joined to REFERENCE_ONLY_KEYS).
REFERENCE_ONLY_KEYS_FP_INT = frozenset({"kFp8Static128x64BlockSym", "kFp8Static64x128BlockSym",
                                        "kFp8Static32BlockSym", "kInt8Static128BlockSym", "kInt8Dynamic128Sym"})
REFERENCE_ONLY_KEYS = REFERENCE_ONLY_KEYS | REFERENCE_ONLY_KEYS_FP_INT
__all__ += ["fp8_static_block_key", *sorted(REFERENCE_ONLY_KEYS_FP_INT)]


def fp8_static_block_key(block_n: int, block_k: int) -> QuantKey:
    """The FP8 weight key of ``block_n x block_k`` blocks with fp32 scales, as vLLM 0.33's ``Fp8MoEMethod`` builds it
    (``create_fp8_quant_key(static=True, group_shape=GroupShape(block_n, block_k))``); equal to the named key where
    one exists (kFp8Static128BlockSym, kFp8Static64BlockSym, ...).

    Raises:
        ValueError: a dimension below 2 (vLLM's Triton experts claim block shapes with rows > 1 and cols > 1 only).
    """
    if int(block_n) < 2 or int(block_k) < 2:
        raise ValueError(f"an FP8 block shape needs both dims > 1 (TritonExperts), got [{block_n}, {block_k}]")
    return create_fp8_quant_key(static=True, group_shape=GroupShape(int(block_n), int(block_k)))


#: Every named key by name (for specs and reports).
QUANT_KEYS: Mapping[str, QuantKey] = MappingProxyType(
    {name: value for name, value in dict(globals()).items() if name.startswith("k") and isinstance(value, QuantKey)}
)
