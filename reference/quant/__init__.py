"""``reference.quant``: every quantization format of vLLM's fused-MoE layer as a bit-exact,
pure-torch quantize / dequantize pair, the recipes that name where implementations disagree,
scale layouts, and the ``QuantKey`` names experts match on.

Modules:
    recipes  QuantRecipe, VLLM (= VLLM_033; VLLM_017), DEEPGEMM, RECIPES, get_recipe
    fp8      scaled_fp8_quant, per_token_group_quant_fp8, per_block_quant_fp8, dequantizers
    ue8m0    ceil_to_ue8m0, ue8m0_byte, pack_ue8m0 / unpack_ue8m0, DeepGemmQuantScaleFMT
    mx       E8M0, MX scale rules, MXFP8, E2M1, MXFP4
    nvfp4    NVFP4 (E2M1 + E4M3 per 16 + fp32 global scale)
    int      INT8 W8A8, INT4 group quantization, W4A8 weights
    wna16    weight-only INT4 / INT8 with group scales and zero points (TritonWNA16Experts' layout)
    layout   MN-major TMA-aligned scales, CUTLASS 128x4 block-scale swizzle
    keys     GroupShape, ScaleDesc, QuantKey and the named keys

Bit-level rules: ``shared/facts/quant-formats.md``. Imports nothing from backends/ or conformance/.
"""

from .fp8 import (
    FP8_DTYPE,
    FP8_E4M3_MAX,
    dequant_fp8_block,
    dequant_fp8_per_tensor,
    dequant_fp8_per_token,
    dequant_fp8_per_token_group,
    per_block_quant_fp8,
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_packed_for_deepgemm,
    round_scale_to_ue8m0,
    scaled_fp8_quant,
    to_e4m3_satfinite,
)
from .int import (
    INT4_MAX,
    INT4_MIN,
    INT8_MAX,
    INT8_MIN,
    dequant_int4_group,
    dequant_int8,
    int4_group_quant,
    int8_quant_per_channel,
    int8_quant_per_token,
    int8_quant_per_tensor,
    int8_quant_static,
    pack_int4,
    unpack_int4,
    w4a8_dequantize_weight,
    w4a8_quantize_weight,
)
from .keys import (
    QUANT_KEYS,
    kFp8Static64BlockSym,
    kInt4Static,
    kInt4StaticAsym,
    kInt4Static32,
    kInt4Static32Asym,
    kInt8Static,
    kInt8DynamicTensorSym,
    kInt8DynamicTokenAsym,
    kInt8StaticTensorAsym,
    kInt8DynamicTensorAsym,
    kInt8Dynamic32Sym,
    kNvfp4DynamicToken,
    kInt4W4A8StaticGroup64Sym,
    kInt4W4A8StaticGroup32Sym,
    kInt4W4A8StaticGroupSym,
    kInt4W4A8StaticChannelSym,
    KEYS_NEW_IN_0_33,
    REFERENCE_ONLY_KEYS,
    GroupShape,
    QuantKey,
    ScaleDesc,
    create_fp8_quant_key,
    kDynamicTensorScale,
    kDynamicTokenScale,
    kFp8Dynamic64Sym,
    kFp8Dynamic128Sym,
    kFp8DynamicTensorSym,
    kFp8DynamicTokenSym,
    kFp8Static128BlockE8M0Sym,
    kFp8Static128BlockSym,
    kFp8StaticChannelSym,
    kFp8StaticTensorSym,
    kFp8StaticTokenSym,
    kInt4StaticGroup128Sym,
    kInt4W4A8StaticGroup128Sym,
    kInt8DynamicTokenSym,
    kInt8StaticChannelSym,
    kInt8StaticTensorSym,
    kMxfp4Dynamic,
    kMxfp4Static,
    kMxfp6E2M3Dynamic,
    kMxfp6E2M3Static,
    kMxfp6E3M2Dynamic,
    kMxfp6E3M2Static,
    kMxfp8Dynamic,
    kMxfp8Static,
    kNvfp4Dynamic,
    kNvfp4Static,
    kStaticChannelScale,
    kStaticTensorScale,
    kStaticTokenScale,
)
from .layout import (
    get_mn_major_tma_aligned_tensor,
    get_tma_aligned_size,
    mn_major_scales,
    swizzle_block_scales,
    swizzle_mxfp4_scales,
    unswizzle_block_scales,
)
from .mx import (
    E2M1_VALUES,
    FP4_E2M1_MAX,
    MX_BLOCK_SIZE,
    MX_SCALE_RULES,
    e2m1_decode,
    e2m1_encode,
    e8m0_to_fp32,
    mx_scale_e8m0,
    mxfp4_dequantize,
    mxfp4_quantize,
    mxfp8_dequantize,
    mxfp8_quantize,
    pack_fp4,
    unpack_fp4,
    FP6_ELEMENTS,
    fp6_decode,
    fp6_encode,
    mxfp6_dequantize,
    mxfp6_quantize,
    pack_fp6,
    unpack_fp6,
)
from .nvfp4 import (
    NVFP4_BLOCK_SIZE,
    nvfp4_dequantize,
    nvfp4_dequantize_per_token,
    nvfp4_global_scale,
    nvfp4_quantize,
    nvfp4_quantize_per_token,
)
from .recipes import DEEPGEMM, RECIPES, VLLM, VLLM_017, VLLM_033, QuantRecipe, get_recipe
from .wna16 import WNA16_BIAS, pack_uint4, unpack_uint4, wna16_dequantize, wna16_quantize
from .ue8m0 import DeepGemmQuantScaleFMT, ceil_to_ue8m0, pack_ue8m0, ue8m0_byte, unpack_ue8m0

# issue 41, FP8 / INT scheme pairs: block-shape and INT8 block keys, INT8 per-token-group (truncating) and block
# quantizers, the CPU INT4 W4A8 format with its in-kernel asymmetric INT8 activations.
from .int_block import (
    dequant_int8_per_row_asym,
    dyn_quant_int8_per_row_asym,
    int4_w4a8_int8_dequantize_weight,
    int4_w4a8_int8_quantize_weight,
    per_block_quant_int8,
    per_token_group_quant_int8,
)
from .keys import (
    REFERENCE_ONLY_KEYS_FP_INT,
    fp8_static_block_key,
    kFp8Static32BlockSym,
    kFp8Static64x128BlockSym,
    kFp8Static128x64BlockSym,
    kInt8Dynamic128Sym,
    kInt8Static128BlockSym,
)

__all__ = [
    # recipes
    "QuantRecipe", "VLLM", "VLLM_017", "VLLM_033", "DEEPGEMM", "RECIPES", "get_recipe",
    # fp8
    "FP8_DTYPE", "FP8_E4M3_MAX", "to_e4m3_satfinite", "round_scale_to_ue8m0", "scaled_fp8_quant",
    "per_token_group_quant_fp8", "per_token_group_quant_fp8_packed_for_deepgemm", "per_block_quant_fp8",
    "dequant_fp8_per_tensor", "dequant_fp8_per_token", "dequant_fp8_per_token_group", "dequant_fp8_block",
    # ue8m0
    "ceil_to_ue8m0", "ue8m0_byte", "pack_ue8m0", "unpack_ue8m0", "DeepGemmQuantScaleFMT",
    # mx
    "MX_BLOCK_SIZE", "MX_SCALE_RULES", "FP4_E2M1_MAX", "E2M1_VALUES", "e8m0_to_fp32", "mx_scale_e8m0",
    "mxfp8_quantize", "mxfp8_dequantize", "e2m1_encode", "e2m1_decode", "pack_fp4", "unpack_fp4",
    "mxfp4_quantize", "mxfp4_dequantize",
    "FP6_ELEMENTS", "fp6_encode", "fp6_decode", "pack_fp6", "unpack_fp6", "mxfp6_quantize", "mxfp6_dequantize",
    "kMxfp6E3M2Static", "kMxfp6E3M2Dynamic", "kMxfp6E2M3Static", "kMxfp6E2M3Dynamic",
    # nvfp4
    "NVFP4_BLOCK_SIZE", "nvfp4_global_scale", "nvfp4_quantize", "nvfp4_dequantize",
    "nvfp4_quantize_per_token", "nvfp4_dequantize_per_token",
    # int
    "INT8_MAX", "INT8_MIN", "INT4_MAX", "INT4_MIN", "int8_quant_per_token", "int8_quant_per_channel",
    "int8_quant_static", "int8_quant_per_tensor", "dequant_int8", "int4_group_quant", "dequant_int4_group", "pack_int4", "unpack_int4",
    "w4a8_quantize_weight", "w4a8_dequantize_weight",
    # wna16
    "WNA16_BIAS", "pack_uint4", "unpack_uint4", "wna16_quantize", "wna16_dequantize",
    # layout
    "get_tma_aligned_size", "get_mn_major_tma_aligned_tensor", "mn_major_scales", "swizzle_mxfp4_scales",
    "swizzle_block_scales", "unswizzle_block_scales",
    # keys
    "GroupShape", "ScaleDesc", "QuantKey", "create_fp8_quant_key", "QUANT_KEYS",
    "kStaticTensorScale", "kDynamicTensorScale", "kStaticTokenScale", "kDynamicTokenScale", "kStaticChannelScale",
    "kFp8StaticTensorSym", "kFp8DynamicTensorSym", "kFp8StaticTokenSym", "kFp8DynamicTokenSym",
    "kFp8StaticChannelSym", "kFp8Dynamic128Sym", "kFp8Dynamic64Sym", "kFp8Static128BlockSym",
    "kFp8Static128BlockE8M0Sym", "kMxfp8Static", "kMxfp8Dynamic", "kMxfp4Static", "kMxfp4Dynamic",
    "kNvfp4Static", "kNvfp4Dynamic", "kInt8StaticChannelSym", "kInt8DynamicTokenSym", "kInt8StaticTensorSym",
    "kInt4StaticGroup128Sym", "kInt4W4A8StaticGroup128Sym",
    "kFp8Static64BlockSym", "kInt4Static", "kInt4StaticAsym", "kInt4Static32", "kInt4Static32Asym", "kInt8Static", "kInt8DynamicTensorSym", "kInt8DynamicTokenAsym",
    "kInt8StaticTensorAsym", "kInt8DynamicTensorAsym", "kInt8Dynamic32Sym", "kNvfp4DynamicToken", "kInt4W4A8StaticGroup64Sym", "kInt4W4A8StaticGroup32Sym", "kInt4W4A8StaticGroupSym", "kInt4W4A8StaticChannelSym", "KEYS_NEW_IN_0_33", "REFERENCE_ONLY_KEYS",
]
__all__ += [  # issue 41, FP8 / INT scheme pairs
    "per_token_group_quant_int8", "per_block_quant_int8", "dyn_quant_int8_per_row_asym", "dequant_int8_per_row_asym",
    "int4_w4a8_int8_quantize_weight", "int4_w4a8_int8_dequantize_weight", "fp8_static_block_key",
    "REFERENCE_ONLY_KEYS_FP_INT", "kFp8Static128x64BlockSym", "kFp8Static64x128BlockSym", "kFp8Static32BlockSym",
    "kInt8Static128BlockSym", "kInt8Dynamic128Sym",
]
