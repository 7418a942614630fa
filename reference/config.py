"""Configuration dataclasses of the fused MoE layer, as plain data.

Mirrors ``vllm/model_executor/layers/fused_moe/config.py`` (``FusedMoEConfig``, ``FusedMoEParallelConfig``,
``FusedMoEQuantDesc``, ``FusedMoEQuantConfig`` and its ``*_moe_quant_config`` factories), reduced to what the
reference and the conformance harness need. Nothing here computes.

Shapes used throughout the project (vLLM's names):
    M tokens, K hidden size, N = w1.size(1) (2 * I for gated activations, I otherwise), I intermediate size,
    E global experts, E_local experts held by this rank, topk experts per token.
    w1 (w13): ``(E_local, N, K)``; w2: ``(E_local, K, I)``; hidden_states ``(M, K)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from reference.activation import MoEActivation
from reference.routing import RoutingMethodType

__all__ = [
    "FusedMoEParallelConfig",
    "FusedMoEConfig",
    "FusedMoEQuantDesc",
    "FusedMoEQuantConfig",
    "FUSED_MOE_UNQUANTIZED_CONFIG",
    "fp8_w8a8_moe_quant_config",
    "int8_w8a8_moe_quant_config",
    "biased_moe_quant_config",
    "mxfp4_moe_quant_config",
    "nvfp4_moe_quant_config",
    "w4a8_moe_quant_config",
    "int4_w4a16_moe_quant_config",
    "int8_w8a16_moe_quant_config",
    "fp8_w8a16_moe_quant_config",
    "mxfp8_w8a8_moe_quant_config",
    "microscaling_activation_desc",
    "mx_moe_quant_config",
    "is_wna16",
    "quant_key_of",
]


@dataclass(frozen=True)
class FusedMoEParallelConfig:
    """Parallel layout of the MoE layer. ``use_ep`` with ``ep_size > 1`` means experts are sharded by rank."""

    tp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    tp_rank: int = 0
    dp_rank: int = 0
    ep_rank: int = 0
    use_ep: bool = False
    all2all_backend: str = "naive"
    use_fi_nvl_two_sided_kernels: bool = False
    use_fi_nvl_one_sided_kernels: bool = False

    @staticmethod
    def make_no_parallel() -> "FusedMoEParallelConfig":
        return FusedMoEParallelConfig()

    @staticmethod
    def make_ep(ep_size: int, ep_rank: int) -> "FusedMoEParallelConfig":
        return FusedMoEParallelConfig(ep_size=ep_size, ep_rank=ep_rank, use_ep=ep_size > 1)


@dataclass(frozen=True)
class FusedMoEConfig:
    """Layer configuration an experts class is asked to support (seed 002 ``is_supported_config``)."""

    num_experts: int  # global E
    experts_per_token: int  # topk
    hidden_dim: int  # K
    intermediate_size_per_partition: int  # I
    num_local_experts: int
    activation: MoEActivation = MoEActivation.SILU
    in_dtype: torch.dtype = torch.bfloat16
    moe_parallel_config: FusedMoEParallelConfig = field(default_factory=FusedMoEParallelConfig)
    routing_method: RoutingMethodType = RoutingMethodType.Default
    router_logits_dtype: torch.dtype | None = None
    has_bias: bool = False
    max_num_tokens: int = 16 * 1024
    # SITU's parameters (vLLM 0.33 FusedMoEConfig; reference.activation.apply_moe_activation situ_beta / _linear_beta).
    activation_situ_beta: float | None = None
    activation_situ_linear_beta: float | None = None
    # vLLM 0.33 FusedMoEConfig: the model's SwiGLU parameters, the fallbacks of the quant config's gemm1_clamp_limit /
    # gemm1_alpha / gemm1_beta in reference.activation.ApplyMoEActivationConfig.from_configs.
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None
    swiglu_beta: float | None = None
    # vLLM 0.33 FusedMoEConfig: LoRA on the layer, a hash-routing table (``hash_indices_table is not None``), routes
    # adjusted between routing and the experts (expert substitution, or a router without monolithic kernels). Read by
    # ``is_supported_config`` under 0.33 only (point ``modular.is_supported_config``).
    is_lora_enabled: bool = False
    has_hash_routing: bool = False
    require_decomposed_backend: bool = False

    @property
    def is_act_and_mul(self) -> bool:
        """True for gated activations (w1 holds gate and up projections)."""
        return self.activation.is_gated


@dataclass(frozen=True)
class FusedMoEQuantDesc:
    """How one operand (a1, a2, w1 or w2) is quantized.

    dtype: None (unquantized), ``torch.float8_e4m3fn``, ``torch.int8``, or a string format name
        (``"mxfp8"``, ``"mxfp4"``, ``"mxfp6_e3m2"``, ``"mxfp6_e2m3"``, ``"nvfp4"``, ``"int4"`` (WNA16), ``"int4_w4a8"``
        (CUTLASS INT4 x FP8)).
    shape: group shape ``(rows, cols)`` of one scale: ``(-1, -1)`` per tensor, ``(1, -1)`` per token/channel,
        ``(1, 128)`` per 1x128 group, ``(128, 128)`` per block, ``(1, 32)`` MX, ``(0, G)`` weight-only groups of G
        along K (vLLM's ``block_shape=[0, group_size]`` of ``int4_w4a16_moe_quant_config``).
    scale: the scale tensor (dequant multiplier, x ~= q * scale) for static quantization; None for dynamic.
    alpha_or_gscale, zp, bias: global scale (NVFP4) / zero point / per-expert bias.
    per_token_gscale: NVFP4 activations with one dynamic global scale per token (``kNvfp4DynamicToken``, vLLM 0.33)
        instead of the fixed per-tensor ``alpha_or_gscale``.
    """

    dtype: torch.dtype | str | None = None
    shape: tuple[int, int] | None = None
    scale: torch.Tensor | None = None
    alpha_or_gscale: torch.Tensor | None = None
    zp: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    per_token_gscale: bool = False


def is_wna16(desc: FusedMoEQuantDesc) -> bool:
    """Weight-only INT4 / INT8 (``reference.quant.wna16``): group shape ``(0, G)``."""
    return desc.dtype in ("int4", torch.int8) and desc.shape is not None and desc.shape[0] == 0


@dataclass(frozen=True)
class FusedMoEQuantConfig:
    """Quantization of the four operands of the experts, plus the gated-activation parameters of seed 001.

    ``recipe`` names the scale rule used for *dynamic* activation quantization (``reference.quant`` recipes:
    ``"vllm"`` by default, ``"deepgemm"``); ``use_ue8m0`` rounds dynamic activation scales up to powers of two
    (DeepGEMM FLOAT32_CEIL_UE8M0 on SM90).
    """

    a1: FusedMoEQuantDesc = field(default_factory=FusedMoEQuantDesc)
    a2: FusedMoEQuantDesc = field(default_factory=FusedMoEQuantDesc)
    w1: FusedMoEQuantDesc = field(default_factory=FusedMoEQuantDesc)
    w2: FusedMoEQuantDesc = field(default_factory=FusedMoEQuantDesc)
    gemm1_alpha: float | None = None
    gemm1_beta: float | None = None
    gemm1_clamp_limit: float | None = None
    recipe: str = "vllm"
    use_ue8m0: bool = False

    # --- vLLM's accessors -------------------------------------------------------------------------------------
    @property
    def quant_dtype(self):
        return self.a1.dtype

    @property
    def weight_quant_dtype(self):
        return self.w1.dtype

    @property
    def is_quantized(self) -> bool:
        return self.a1.dtype is not None or self.w1.dtype is not None

    @property
    def block_shape(self) -> list[int] | None:
        s = self.w1.shape
        if s is not None and s[0] > 1 and s[1] > 1:
            return list(s)
        if s == (1, 32):  # MX formats: block_shape [1, 32] (seed 001 DeepGemmExperts.mxfp8)
            return [1, 32]
        return None

    @property
    def per_act_token_quant(self) -> bool:
        return self.a1.shape == (1, -1)

    @property
    def per_out_ch_quant(self) -> bool:
        return self.w1.shape == (1, -1)

    @property
    def use_fp8_w8a8(self) -> bool:
        return self.a1.dtype == torch.float8_e4m3fn and self.w1.dtype == torch.float8_e4m3fn

    @property
    def use_int8_w8a8(self) -> bool:
        return self.a1.dtype == torch.int8 and self.w1.dtype == torch.int8

    a1_scale = property(lambda self: self.a1.scale)
    a2_scale = property(lambda self: self.a2.scale)
    w1_scale = property(lambda self: self.w1.scale)
    w2_scale = property(lambda self: self.w2.scale)
    a1_gscale = property(lambda self: self.a1.alpha_or_gscale)
    a2_gscale = property(lambda self: self.a2.alpha_or_gscale)
    g1_alphas = property(lambda self: self.w1.alpha_or_gscale)
    g2_alphas = property(lambda self: self.w2.alpha_or_gscale)
    w1_zp = property(lambda self: self.w1.zp)
    w2_zp = property(lambda self: self.w2.zp)
    w1_bias = property(lambda self: self.w1.bias)
    w2_bias = property(lambda self: self.w2.bias)

    @property
    def use_int4_w4a16(self) -> bool:
        return self.w1.dtype == "int4" and is_wna16(self.w1)

    @property
    def use_int8_w8a16(self) -> bool:
        return self.w1.dtype == torch.int8 and is_wna16(self.w1)

    @property
    def weight_key(self):
        """The ``reference.quant.keys.QuantKey`` of the weights (None when unquantized)."""
        return quant_key_of(self.w1, is_weight=True)

    @property
    def activation_key(self):
        """The ``QuantKey`` of the activations (None when they stay in bf16/fp16, e.g. W4A16).

        Block-quantized FP8 weights pair with ``kFp8Dynamic128Sym`` whatever the block shape: vLLM 0.33's
        ``Fp8MoEMethod`` (``quantization/fp8.py``) sets that key for every block shape and the activations are
        quantized per 1 x ``block_k`` group (``fused_moe/utils.py::_fp8_quantize``), so a 64x64 scheme claims
        ``(kFp8Static64BlockSym, kFp8Dynamic128Sym)`` with 1x64 activation groups."""
        bs = self.block_shape
        if (bs is not None and bs != [1, 32] and self.w1.dtype == torch.float8_e4m3fn
                and self.a1.dtype == torch.float8_e4m3fn and self.a1.scale is None and self.a1.shape == (1, bs[1])):
            from reference.quant import keys as K

            return K.kFp8Dynamic128Sym
        return quant_key_of(self.a1, is_weight=False)

    def scheme_name(self) -> str:
        """Short name used in case ids, e.g. ``bf16``, ``fp8_block128``, ``fp8_tensor``, ``int8_token``."""
        if not self.is_quantized:
            return "unquantized"
        w, a = self.w1, self.a1
        if is_wna16(w):
            bits = "int4" if w.dtype == "int4" else "int8"
            name = f"{bits}_w{bits[3]}a16" + ("_zp" if w.zp is not None else "")
            return name + ("" if w.shape[1] == 128 else f"_g{w.shape[1]}")
        if w.dtype == torch.float8_e4m3fn:
            if a.dtype is None:
                return "fp8_w8a16"
            if self.block_shape is not None:
                return f"fp8_block{self.block_shape[0]}" + ("_ue8m0" if self.use_ue8m0 else "")
            if w.shape == (1, -1):
                return "fp8_channel_token" if a.shape == (1, -1) else "fp8_channel_tensor"
            if a.shape == (1, -1):
                return "fp8_tensor_token"
            return "fp8_tensor_static" if a.scale is not None else "fp8_tensor"
        if w.dtype == torch.int8:
            return "int8_tensor" if w.shape == (-1, -1) else "int8_channel_token"
        if w.dtype in ("mxfp4", "mxfp8", "nvfp4", "mxfp6_e3m2", "mxfp6_e2m3"):
            cross = _microscaling_cross_scheme(w, a)
            if cross is not None:
                return cross
        if w.dtype == "mxfp4":
            return {None: "mxfp4_w4a16", "mxfp8": "mxfp4_mxfp8", "mxfp4": "mxfp4_w4a4"}.get(a.dtype, "mxfp4_fp8")
        if w.dtype == "nvfp4" and a.per_token_gscale:
            return "nvfp4_token"
        return {"nvfp4": "nvfp4", "int4_w4a8": "w4a8", "mxfp8": "mxfp8"}.get(w.dtype, str(w.dtype))


# --- microscaling cross pairs (vLLM 0.33; issue 41 item 5): MXFP4 / MXFP8 / NVFP4 / MXFP6 weights with other
# activations. One block, kept together: the scheme names of specs/schemes.toml these configs carry.
_FP8 = torch.float8_e4m3fn


def _microscaling_cross_scheme(w: FusedMoEQuantDesc, a: FusedMoEQuantDesc) -> str | None:
    """The scheme name of a microscaling-weight config whose activation is not the weight's own format (None for the
    pairs ``scheme_name`` names itself)."""
    fp8 = None
    if a.dtype == _FP8:
        fp8 = ("fp8_static" if a.scale is not None else "fp8_tensor") if a.shape == (-1, -1) else \
            "fp8_token" if a.shape == (1, -1) else f"fp8_block{a.shape[1]}"
    if w.dtype == "mxfp4":
        return fp8 and f"mxfp4_{fp8}" or {"mxfp6_e3m2": "mxfp4_mxfp6_e3m2", "mxfp6_e2m3": "mxfp4_mxfp6_e2m3"}.get(a.dtype)
    if w.dtype == "mxfp8":
        return "mxfp8_w8a16" if a.dtype is None else fp8 and f"mxfp8_{fp8}"
    if w.dtype == "nvfp4":
        return {None: "nvfp4_w4a16", "mxfp8": "nvfp4_mxfp8"}.get(a.dtype) or fp8 and f"nvfp4_{fp8}"
    if w.dtype in ("mxfp6_e3m2", "mxfp6_e2m3"):
        return w.dtype if a.dtype == w.dtype else f"{w.dtype}_w6a16" if a.dtype is None else \
            fp8 and f"{w.dtype}_{fp8}"
    return None


def microscaling_activation_desc(activation: str | None, a1_scale: torch.Tensor | None = None,
                                 a2_scale: torch.Tensor | None = None) -> tuple[FusedMoEQuantDesc, FusedMoEQuantDesc]:
    """The ``(a1, a2)`` descriptors of the activations paired with microscaling weights (vLLM 0.33 keys):

    ``None`` (bf16 / fp16, W-only), ``"mxfp8"`` (kMxfp8Dynamic), ``"mxfp4"`` (kMxfp4Dynamic), ``"mxfp6_e3m2"`` /
    ``"mxfp6_e2m3"`` (kMxfp6E3M2Dynamic / kMxfp6E2M3Dynamic, E8M0 per 1x32), ``"fp8_static"`` (kFp8StaticTensorSym:
    ``a1_scale`` / ``a2_scale`` one element each), ``"fp8_token"`` (kFp8DynamicTokenSym), ``"fp8_block128"``
    (kFp8Dynamic128Sym: dynamic per 1x128 group).

    Raises:
        ValueError: an unknown activation, or static FP8 without both scales.
    """
    if activation == "fp8_static":
        if a1_scale is None or a2_scale is None:
            raise ValueError("fp8_static activations need a1_scale and a2_scale (static per-tensor)")
        return FusedMoEQuantDesc(_FP8, (-1, -1), a1_scale), FusedMoEQuantDesc(_FP8, (-1, -1), a2_scale)
    table = {None: FusedMoEQuantDesc(), "fp8_token": FusedMoEQuantDesc(_FP8, (1, -1)),
             "fp8_block128": FusedMoEQuantDesc(_FP8, (1, 128)),
             **{f: FusedMoEQuantDesc(f, (1, 32)) for f in ("mxfp8", "mxfp4", "mxfp6_e3m2", "mxfp6_e2m3")}}
    if activation not in table:
        raise ValueError(f"unknown microscaling activation {activation!r}; known: {sorted(map(str, table))} "
                         f"and 'fp8_static'")
    return table[activation], table[activation]


def mx_moe_quant_config(weight: str, w1_scale: torch.Tensor, w2_scale: torch.Tensor, *, activation: str | None,
                        a1_scale: torch.Tensor | None = None, a2_scale: torch.Tensor | None = None,
                        w1_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                        g1_gscale: torch.Tensor | None = None, g2_gscale: torch.Tensor | None = None,
                        gemm1_alpha: float | None = None, gemm1_clamp_limit: float | None = None,
                        ) -> FusedMoEQuantConfig:
    """Microscaling weights with any activation of :func:`microscaling_activation_desc` (the cross pairs of vLLM 0.33:
    ``experts/fused_humming_moe.py``, ``b12x.py``, ``flashinfer_b12x_moe.py``, ``aiter_mxfp4_w4a8_moe.py``,
    ``deep_gemm_moe.py``, ``xpu_moe.py``, ``ocp_mx_emulation_moe.py``).

    ``weight``: ``"mxfp4"`` (packed E2M1 ``(E, N, K // 2)`` + E8M0 bytes ``(E, N, K // 32)``), ``"mxfp8"`` (E4M3
    ``(E, N, K)`` + E8M0 bytes), ``"mxfp6_e3m2"`` / ``"mxfp6_e2m3"`` (FP6 codes one per byte ``(E, N, K)`` + E8M0
    bytes; :func:`reference.quant.pack_fp6` gives the checkpoint's 4-in-3 layout) or ``"nvfp4"`` (packed E2M1 + E4M3
    block scales ``(E, N, K // 16)`` + fp32 encode scales ``g*_gscale`` ``(E,)``).

    Raises:
        ValueError: an unknown weight format, NVFP4 without its encode scales, or a bad activation (see above).
    """
    a1, a2 = microscaling_activation_desc(activation, a1_scale, a2_scale)
    if weight == "nvfp4":
        if g1_gscale is None or g2_gscale is None:
            raise ValueError("NVFP4 weights need g1_gscale and g2_gscale (one fp32 encode scale per expert)")
        w1 = FusedMoEQuantDesc("nvfp4", (1, 16), w1_scale, alpha_or_gscale=g1_gscale, bias=w1_bias)
        w2 = FusedMoEQuantDesc("nvfp4", (1, 16), w2_scale, alpha_or_gscale=g2_gscale, bias=w2_bias)
    elif weight in ("mxfp4", "mxfp8", "mxfp6_e3m2", "mxfp6_e2m3"):
        w1 = FusedMoEQuantDesc(weight, (1, 32), w1_scale, bias=w1_bias)
        w2 = FusedMoEQuantDesc(weight, (1, 32), w2_scale, bias=w2_bias)
    else:
        raise ValueError(f"mx_moe_quant_config: unknown weight format {weight!r}")
    return FusedMoEQuantConfig(a1=a1, a2=a2, w1=w1, w2=w2, gemm1_alpha=gemm1_alpha,
                               gemm1_clamp_limit=gemm1_clamp_limit)
# --- end of the microscaling cross pairs


FUSED_MOE_UNQUANTIZED_CONFIG = FusedMoEQuantConfig()


def biased_moe_quant_config(w1_bias: torch.Tensor | None, w2_bias: torch.Tensor | None) -> FusedMoEQuantConfig:
    """Unquantized experts with per-expert biases: w1_bias ``(E_local, N)``, w2_bias ``(E_local, K)``."""
    return FusedMoEQuantConfig(w1=FusedMoEQuantDesc(bias=w1_bias), w2=FusedMoEQuantDesc(bias=w2_bias))


def fp8_w8a8_moe_quant_config(
    w1_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    a1_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
    per_act_token_quant: bool = False,
    per_out_ch_quant: bool = False,
    block_shape: list[int] | None = None,
    *,
    recipe: str = "vllm",
    use_ue8m0: bool = False,
    gemm1_alpha: float | None = None,
    gemm1_beta: float | None = None,
    gemm1_clamp_limit: float | None = None,
) -> FusedMoEQuantConfig:
    """FP8 E4M3 weights and activations (vLLM ``fp8_w8a8_moe_quant_config``).

    block_shape ``[128, 128]``: weights per 128x128 block (scales ``(E, cdiv(N,128), cdiv(K,128))`` fp32),
    activations dynamic per 1x128 group. per_out_ch_quant: weight scales ``(E, N, 1)``. per_act_token_quant:
    dynamic per-token activation scales. Otherwise per-tensor (static if a1_scale is given, dynamic if None).

    Raises:
        ValueError: block quantization combined with per-token/per-channel flags (vLLM excludes it).
    """
    fp8 = torch.float8_e4m3fn
    if block_shape is not None:
        if per_act_token_quant or per_out_ch_quant:
            raise ValueError("block quantization excludes per_act_token_quant / per_out_ch_quant (as in vLLM)")
        bn, bk = block_shape
        w_shape, a_shape = (bn, bk), (1, bk)
    else:
        w_shape = (1, -1) if per_out_ch_quant else (-1, -1)
        a_shape = (1, -1) if per_act_token_quant else (-1, -1)
    return FusedMoEQuantConfig(
        a1=FusedMoEQuantDesc(fp8, a_shape, a1_scale),
        a2=FusedMoEQuantDesc(fp8, a_shape, a2_scale),
        w1=FusedMoEQuantDesc(fp8, w_shape, w1_scale),
        w2=FusedMoEQuantDesc(fp8, w_shape, w2_scale),
        recipe=recipe,
        use_ue8m0=use_ue8m0,
        gemm1_alpha=gemm1_alpha,
        gemm1_beta=gemm1_beta,
        gemm1_clamp_limit=gemm1_clamp_limit,
    )


def int8_w8a8_moe_quant_config(
    w1_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    a1_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
    per_act_token_quant: bool = True,
    per_out_ch_quant: bool = True,
) -> FusedMoEQuantConfig:
    """INT8 W8A8 (vLLM ``int8_w8a8_moe_quant_config``): per-channel weight scales ``(E, N, 1)`` and dynamic per-token
    activations (the default), or, with both flags False, per-tensor weight scales ``(E,)`` and dynamic per-tensor
    activations (``(kInt8StaticTensorSym, kInt8DynamicTensorSym)``, vLLM 0.33 ``TritonExperts``)."""
    i8 = torch.int8
    a_shape = (1, -1) if per_act_token_quant else (-1, -1)
    w_shape = (1, -1) if per_out_ch_quant else (-1, -1)
    return FusedMoEQuantConfig(
        a1=FusedMoEQuantDesc(i8, a_shape, a1_scale),
        a2=FusedMoEQuantDesc(i8, a_shape, a2_scale),
        w1=FusedMoEQuantDesc(i8, w_shape, w1_scale),
        w2=FusedMoEQuantDesc(i8, w_shape, w2_scale),
    )


def int4_w4a16_moe_quant_config(
    w1_scale: torch.Tensor, w2_scale: torch.Tensor, w1_zp: torch.Tensor | None = None,
    w2_zp: torch.Tensor | None = None, block_shape: list[int] | None = None,
) -> FusedMoEQuantConfig:
    """Weight-only INT4 (vLLM 0.33 ``int4_w4a16_moe_quant_config``; ``reference.quant.wna16`` layout): packed uint8
    weights ``(E, N, K // 2)``, scales ``(E, N, K // G)`` in the activation dtype, optional zero points
    ``(E, N // 2, K // G)`` uint8; ``block_shape = [0, G]``; activations unquantized."""
    return _wna16("int4", w1_scale, w2_scale, w1_zp, w2_zp, block_shape)


def int8_w8a16_moe_quant_config(
    w1_scale: torch.Tensor, w2_scale: torch.Tensor, w1_zp: torch.Tensor | None = None,
    w2_zp: torch.Tensor | None = None, block_shape: list[int] | None = None,
) -> FusedMoEQuantConfig:
    """Weight-only INT8 (vLLM 0.33 ``int8_w8a16_moe_quant_config``): uint8 codes with bias 128 ``(E, N, K)``, scales
    ``(E, N, K // G)``; ``block_shape = [0, G]``; activations unquantized. Raises ValueError with zero points (vLLM
    0.33 has no INT8 weight-only key with them)."""
    if w1_zp is not None or w2_zp is not None:
        raise ValueError("int8_w8a16_moe_quant_config: zero points are not defined for INT8 weight-only")
    return _wna16(torch.int8, w1_scale, w2_scale, None, None, block_shape)


def _wna16(dtype, w1_scale, w2_scale, w1_zp, w2_zp, block_shape) -> FusedMoEQuantConfig:
    if block_shape is None or len(block_shape) != 2 or block_shape[0] != 0 or block_shape[1] <= 0:
        raise ValueError(f"weight-only quantization needs block_shape = [0, group_size], got {block_shape}")
    shape = (0, int(block_shape[1]))
    return FusedMoEQuantConfig(w1=FusedMoEQuantDesc(dtype, shape, w1_scale, zp=w1_zp),
                               w2=FusedMoEQuantDesc(dtype, shape, w2_scale, zp=w2_zp))


def fp8_w8a16_moe_quant_config(
    w1_scale: torch.Tensor, w2_scale: torch.Tensor, *, per_out_ch_quant: bool = True,
    block_shape: list[int] | None = None,
) -> FusedMoEQuantConfig:
    """FP8 weights with 16-bit activations (vLLM ``fp8_w8a16_moe_quant_config``; Marlin's FP8 path): weight scales
    per output channel ``(E, N, 1)`` (default), per tensor ``(E,)``, or per ``block_shape`` block; activations are
    not quantized. The reference dequantizes the weights to the exact fp32 products of codes and scales and
    multiplies the unquantized activations with fp32 accumulation (Marlin applies the scales in its epilogue;
    the products are the same up to accumulation order)."""
    fp8 = torch.float8_e4m3fn
    w_shape = tuple(block_shape) if block_shape is not None else ((1, -1) if per_out_ch_quant else (-1, -1))
    return FusedMoEQuantConfig(w1=FusedMoEQuantDesc(fp8, w_shape, w1_scale),
                               w2=FusedMoEQuantDesc(fp8, w_shape, w2_scale))


def mxfp8_w8a8_moe_quant_config(w1_scale: torch.Tensor, w2_scale: torch.Tensor) -> FusedMoEQuantConfig:
    """MXFP8 W8A8 (``(kMxfp8Static, kMxfp8Dynamic)``; vLLM 0.33 ``experts/mxfp8_native_moe.py``,
    ``mxfp8_emulation_moe.py``): E4M3 weights ``(E, N, K)`` with E8M0 scale bytes per 1x32 ``(E, N, K // 32)``;
    activations quantized dynamically to MXFP8 per 1x32 under the config's recipe."""
    mx = FusedMoEQuantDesc("mxfp8", (1, 32))
    return FusedMoEQuantConfig(a1=mx, a2=mx, w1=FusedMoEQuantDesc("mxfp8", (1, 32), w1_scale),
                               w2=FusedMoEQuantDesc("mxfp8", (1, 32), w2_scale))


def quant_key_of(desc: FusedMoEQuantDesc, *, is_weight: bool):
    """Map a descriptor to vLLM's named ``QuantKey`` (``reference.quant.keys``); None when unquantized.

    Raises:
        ValueError: a combination that has no named key (so a backend's support claim cannot be checked).
    """
    from reference.quant import keys as K

    d, shape, static = desc.dtype, desc.shape, desc.scale is not None or is_weight
    if d is None:
        return None
    if is_weight and is_wna16(desc):
        # vLLM 0.33 names group 32 and a generic "runtime" group size (quant_utils.py kInt4Static*, kInt8Static).
        if d == torch.int8:
            if desc.zp is not None:
                raise ValueError("no named QuantKey for INT8 weight-only quantization with zero points")
            return K.kInt8Static
        if shape[1] == 32:
            return K.kInt4Static32 if desc.zp is None else K.kInt4Static32Asym
        return K.kInt4Static if desc.zp is None else K.kInt4StaticAsym
    if d == "nvfp4" and desc.per_token_gscale and not is_weight:
        return K.kNvfp4DynamicToken
    table = {
        (torch.float8_e4m3fn, (-1, -1), True): K.kFp8StaticTensorSym,
        (torch.float8_e4m3fn, (-1, -1), False): K.kFp8DynamicTensorSym,
        (torch.float8_e4m3fn, (1, -1), True): K.kFp8StaticChannelSym if is_weight else K.kFp8StaticTokenSym,
        (torch.float8_e4m3fn, (1, -1), False): K.kFp8DynamicTokenSym,
        (torch.float8_e4m3fn, (1, 128), False): K.kFp8Dynamic128Sym,
        (torch.float8_e4m3fn, (1, 64), False): K.kFp8Dynamic64Sym,
        (torch.float8_e4m3fn, (128, 128), True): K.kFp8Static128BlockSym,
        (torch.float8_e4m3fn, (64, 64), True): K.kFp8Static64BlockSym,
        (torch.int8, (1, -1), True): K.kInt8StaticChannelSym if is_weight else None,
        (torch.int8, (1, -1), False): K.kInt8DynamicTokenSym,
        (torch.int8, (-1, -1), True): K.kInt8StaticTensorSym,
        (torch.int8, (-1, -1), False): K.kInt8DynamicTensorSym,
        ("mxfp8", (1, 32), True): K.kMxfp8Static,
        ("mxfp8", (1, 32), False): K.kMxfp8Dynamic,
        ("mxfp4", (1, 32), True): K.kMxfp4Static,
        ("mxfp4", (1, 32), False): K.kMxfp4Dynamic,
        ("mxfp6_e3m2", (1, 32), True): K.kMxfp6E3M2Static,
        ("mxfp6_e3m2", (1, 32), False): K.kMxfp6E3M2Dynamic,
        ("mxfp6_e2m3", (1, 32), True): K.kMxfp6E2M3Static,
        ("mxfp6_e2m3", (1, 32), False): K.kMxfp6E2M3Dynamic,
        ("nvfp4", (1, 16), True): K.kNvfp4Static,
        ("nvfp4", (1, 16), False): K.kNvfp4Dynamic,
        # The CUTLASS INT4 x FP8 experts claim kInt4Static (vLLM 0.33 experts/cutlass_moe.py); vLLM 0.33's
        # kInt4W4A8StaticGroup128Sym is another format (INT8-stored INT4, bf16 group scales: the CPU experts').
        ("int4_w4a8", (1, 128), True): K.kInt4Static,
    }
    key = table.get((d, shape, static))
    if key is None:  # issue 41: FP8 blocks of any shape, INT8 blocks / 1xG groups, CPU INT4 W4A8 (below)
        key = _quant_key_fp_int(d, shape, static, is_weight)
    if key is None:
        raise ValueError(f"no named QuantKey for {'weight' if is_weight else 'activation'} {d} {shape} "
                         f"{'static' if static else 'dynamic'}")
    return key


def mxfp4_moe_quant_config(
    w1_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    activation: str | None = None,
    w1_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    gemm1_alpha: float | None = None,
    gemm1_beta: float | None = None,
    gemm1_clamp_limit: float | None = None,
) -> FusedMoEQuantConfig:
    """MXFP4 weights (packed E2M1 ``(E, N, K // 2)`` uint8 + E8M0 bytes ``(E, N, K // 32)``), with activations
    unquantized (``activation=None``: W4A16, gpt-oss on Hopper) or dynamic MXFP8 (``"mxfp8"``) or dynamic MXFP4
    (``"mxfp4"``: W4A4, ``(kMxfp4Static, kMxfp4Dynamic)``, vLLM 0.33 ``CutlassExpertsMxfp4``) or dynamic FP8 per
    1x128 group (``"fp8"``, DeepGemmFP4Experts)."""
    a = {None: FusedMoEQuantDesc(), "mxfp8": FusedMoEQuantDesc("mxfp8", (1, 32)),
         "mxfp4": FusedMoEQuantDesc("mxfp4", (1, 32)),
         "fp8": FusedMoEQuantDesc(torch.float8_e4m3fn, (1, 128))}[activation]
    return FusedMoEQuantConfig(
        a1=a, a2=a, w1=FusedMoEQuantDesc("mxfp4", (1, 32), w1_scale, bias=w1_bias),
        w2=FusedMoEQuantDesc("mxfp4", (1, 32), w2_scale, bias=w2_bias),
        gemm1_alpha=gemm1_alpha, gemm1_beta=gemm1_beta, gemm1_clamp_limit=gemm1_clamp_limit,
    )


def nvfp4_moe_quant_config(
    w1_scale: torch.Tensor, w2_scale: torch.Tensor, g1_gscale: torch.Tensor, g2_gscale: torch.Tensor,
    a1_gscale: torch.Tensor | None, a2_gscale: torch.Tensor | None, *, per_token_activation: bool = False,
) -> FusedMoEQuantConfig:
    """NVFP4: weights packed E2M1 with E4M3 block scales per 16 (``(E, N, K // 16)``, linear layout) and an fp32
    encode scale per expert (``g*_gscale`` ``(E,)``: dequant = e2m1 * SF / gs); activations quantized dynamically
    per 16 with the fixed encode scales ``a1_gscale`` / ``a2_gscale`` (one element each), or, with
    ``per_token_activation`` (``kNvfp4DynamicToken``, vLLM 0.33 ``experts/trtllm_nvfp4_moe.py``), with one dynamic
    encode scale per token (``reference.quant.nvfp4_quantize_per_token``; pass None for the a*_gscale).

    Raises:
        ValueError: per-tensor activations without their global scales, or per-token ones with them.
    """
    if per_token_activation != (a1_gscale is None and a2_gscale is None):
        raise ValueError("nvfp4_moe_quant_config: give a1_gscale and a2_gscale for per-tensor activations, neither "
                         "for per_token_activation")
    return FusedMoEQuantConfig(
        a1=FusedMoEQuantDesc("nvfp4", (1, 16), alpha_or_gscale=a1_gscale, per_token_gscale=per_token_activation),
        a2=FusedMoEQuantDesc("nvfp4", (1, 16), alpha_or_gscale=a2_gscale, per_token_gscale=per_token_activation),
        w1=FusedMoEQuantDesc("nvfp4", (1, 16), w1_scale, alpha_or_gscale=g1_gscale),
        w2=FusedMoEQuantDesc("nvfp4", (1, 16), w2_scale, alpha_or_gscale=g2_gscale),
    )


def w4a8_moe_quant_config(
    w1_scale: torch.Tensor, w2_scale: torch.Tensor, w1_chan_scale: torch.Tensor, w2_chan_scale: torch.Tensor,
) -> FusedMoEQuantConfig:
    """W4A8 (seed 004 ``cutlass_moe_w4a8_fp8``): int4 weights packed 8 per int32 with E4M3 group scales per 128
    (``(E, N, K // 128)``) and fp32 per-channel scales ``(E, N)``; FP8 activations quantized per token. Its keys are
    vLLM 0.33's ``(kInt4Static, kFp8DynamicTokenSym)`` (``experts/cutlass_moe.py``)."""
    fp8_tok = FusedMoEQuantDesc(torch.float8_e4m3fn, (1, -1))
    return FusedMoEQuantConfig(
        a1=fp8_tok, a2=fp8_tok,
        w1=FusedMoEQuantDesc("int4_w4a8", (1, 128), w1_scale, alpha_or_gscale=w1_chan_scale),
        w2=FusedMoEQuantDesc("int4_w4a8", (1, 128), w2_scale, alpha_or_gscale=w2_chan_scale),
    )


# --- issue 41: the FP8 / INT scheme pairs of vLLM 0.33 that the seeds lack --------------------------------------------
def _quant_key_fp_int(d, shape, static: bool, is_weight: bool):
    """``quant_key_of`` for the issue-41 descriptors (None for anything else): FP8 weights of any ``bn x bk`` block
    shape (``fp8_static_block_key``, as vLLM 0.33's ``Fp8MoEMethod`` builds them), INT8 weights per ``bn x bk`` block
    and INT8 activations per dynamic 1 x G group (block INT8 W8A8: ``kInt8Static128BlockSym`` /
    ``kInt8Dynamic128Sym`` for 128; other sizes unnamed, as vLLM builds none), and the CPU INT4 W4A8 weights
    (``"int4_w4a8_int8"``: ``kInt4W4A8StaticChannelSym`` for ``(1, -1)``, the group-32 / 64 / 128 keys, else
    ``kInt4W4A8StaticGroupSym``)."""
    from reference.quant import keys as K

    if shape is None:
        return None
    r, c = shape
    if d == torch.float8_e4m3fn and is_weight and static and r > 1 and c > 1:
        return K.fp8_static_block_key(r, c)
    if d == torch.int8 and is_weight and static and r > 1 and c > 1:
        return K.kInt8Static128BlockSym if (r, c) == (128, 128) else K.QuantKey(
            torch.int8, K.ScaleDesc(torch.float32, True, K.GroupShape(r, c)))
    if d == torch.int8 and not is_weight and not static and r == 1 and c > 1:
        return K.kInt8Dynamic128Sym if c == 128 else (K.kInt8Dynamic32Sym if c == 32 else K.QuantKey(
            torch.int8, K.ScaleDesc(torch.float32, False, K.GroupShape(1, c))))
    if d == "int4_w4a8_int8" and is_weight:
        if shape == (1, -1):
            return K.kInt4W4A8StaticChannelSym
        return {32: K.kInt4W4A8StaticGroup32Sym, 64: K.kInt4W4A8StaticGroup64Sym,
                128: K.kInt4W4A8StaticGroup128Sym}.get(c, K.kInt4W4A8StaticGroupSym)
    return None


def int8_w8a8_block_moe_quant_config(w1_scale: torch.Tensor, w2_scale: torch.Tensor,
                                     block_shape: list[int]) -> FusedMoEQuantConfig:
    """Block INT8 W8A8 (vLLM 0.33 ``FusedMoEQuantConfig.make(torch.int8, ..., block_shape=[bn, bk])``, as
    ``tests/kernels/moe/utils.py::make_test_quant_config`` builds it for ``test_block_int8.py``; run by
    ``fused_moe.py``'s ``use_int8_w8a8`` path): int8 weights ``(E, N, K)`` with fp32 scales
    ``(E, cdiv(N, bn), cdiv(K, bk))``; activations quantized dynamically per 1 x bk group
    (``reference.quant.per_token_group_quant_int8``: truncating codes).

    Raises:
        ValueError: a block shape that is not two dims > 1.
    """
    if block_shape is None or len(block_shape) != 2 or min(block_shape) < 2:
        raise ValueError(f"block INT8 needs block_shape = [bn, bk] with both > 1, got {block_shape}")
    bn, bk = (int(v) for v in block_shape)
    i8 = torch.int8
    return FusedMoEQuantConfig(a1=FusedMoEQuantDesc(i8, (1, bk)), a2=FusedMoEQuantDesc(i8, (1, bk)),
                               w1=FusedMoEQuantDesc(i8, (bn, bk), w1_scale), w2=FusedMoEQuantDesc(i8, (bn, bk), w2_scale))


def int4_w4a8_int8_moe_quant_config(w1_scale: torch.Tensor, w2_scale: torch.Tensor,
                                    group_size: int | None) -> FusedMoEQuantConfig:
    """CPU INT4 W4A8 (vLLM 0.33 ``oracle/w4a8_int8.py::make_w4a8_int8_moe_quant_config``; experts
    ``experts/cpu_int4_moe.py``): INT4 values stored as int8 ``(E, N, K)`` with bf16 group scales
    ``(E, N, K // group_size)`` or, ``group_size=None``, fp32 channel scales ``(E, N, 1)`` (vLLM's ``block_shape
    [-1, 1]``). The activations stay unquantized in the config (a1 / a2 dtype None, as vLLM's): each GEMM quantizes
    its input rows itself, to asymmetric INT8 per row (``reference.quant.dyn_quant_int8_per_row_asym``;
    ``reference.quant.moe.gemm_input_quantizer``)."""
    shape = (1, -1) if group_size is None else (1, int(group_size))
    fmt = "int4_w4a8_int8"
    return FusedMoEQuantConfig(w1=FusedMoEQuantDesc(fmt, shape, w1_scale), w2=FusedMoEQuantDesc(fmt, shape, w2_scale))


def refine_fp8_moe_block_shape(config: FusedMoEConfig, weight_block_size: list[int]) -> list[int] | None:
    """The FP8 block shape vLLM 0.33 refines a checkpoint's ``[block_n, block_k]`` to when the TP shard's intermediate
    size cannot hold whole blocks (mirrors ``fused_moe/oracle/fp8.py::refine_fp8_moe_block_shape``): None when
    ``ispp % block_n == 0`` and (TP 1 or ``ispp % block_k == 0``); else ``[r, r]`` with
    ``r = gcd(block_n, block_k, ispp, hidden_dim)``, or None when ``r < 32``. The refined weight key is
    ``reference.quant.fp8_static_block_key(r, r)`` (activations per 1 x r group), which only Triton-based experts
    claim. ``ispp`` = ``config.intermediate_size_per_partition``, the TP size ``config.moe_parallel_config.tp_size``."""
    import math

    block_n, block_k = (int(v) for v in weight_block_size)
    ispp = config.intermediate_size_per_partition
    if ispp % block_n == 0 and (config.moe_parallel_config.tp_size == 1 or ispp % block_k == 0):
        return None
    refine = math.gcd(block_n, block_k, ispp, config.hidden_dim)
    return None if refine < 32 else [refine, refine]
