"""Quantization recipes: the bit-changing choices that public FP8 / MX quantizers disagree on.

Two implementations of "FP8 per-token-group quantization with amax/448 scales" do not produce the
same bytes: they differ in the amax floor, in how a UE8M0 (power-of-two) scale is rounded, and in
whether the element is divided by the scale or multiplied by its reciprocal (see
``shared/facts/quant-formats.md``). A :class:`QuantRecipe` names those choices so that a backend
can declare which one it implements and be checked bit-exactly against the reference.

``"vllm"`` (the default) follows vLLM's CUDA ``per_token_group_quant_8bit`` kernel
(``csrc/quantization/w8a8/fp8/per_token_group_quant.cu``), which changed between the releases the reference
specifies (semantics point ``quant.per_token_group_quant_op``): 0.17 divides each element by the group's scale
(``VLLM_017``), 0.33 multiplies it by the scale's reciprocal, one ``1.0f / y_s`` per group (``VLLM_033``, also
exported as ``VLLM``); :func:`get_recipe` resolves the name under the current semantics version
(``reference.semantics``). ``DEEPGEMM`` follows ``deep_gemm/utils/math.py::per_token_cast_to_fp8`` /
``per_block_cast_to_fp8``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Literal, Mapping

from reference.semantics import SemanticsVersion, register_point, resolve_semantics

__all__ = ["QuantRecipe", "VLLM", "VLLM_017", "VLLM_033", "DEEPGEMM", "RECIPES", "get_recipe"]

UE8M0Rounding = Literal["exp2_ceil_log2", "ceil_to_ue8m0"]
QuantOp = Literal["divide", "reciprocal_multiply", "max_over_amax_multiply"]
ScaleComputation = Literal["amax/max", "1/(max/amax)"]
MXScaleRule = Literal["floor", "ceil", "even", "rceil"]

_UE8M0_ROUNDINGS = ("exp2_ceil_log2", "ceil_to_ue8m0")
_QUANT_OPS = ("divide", "reciprocal_multiply", "max_over_amax_multiply")
_SCALE_COMPUTATIONS = ("amax/max", "1/(max/amax)")
_OVERFLOWS = ("saturate",)
_MX_RULES = ("floor", "ceil", "even", "rceil")


@dataclass(frozen=True)
class QuantRecipe:
    """The bit-changing choices of an amax-scaled FP8 quantizer (all arithmetic in fp32).

    Fields:
        name: registry name.
        amax_floor: lower bound applied to the group amax before the scale is computed
            (``amax = max(amax, amax_floor)``). vLLM CUDA starts its absmax reduction at
            ``eps = 1e-10``; DeepGEMM clamps with ``clamp(1e-4)``. Decides the scale of all-zero
            and tiny groups (UE8M0 byte 94 vs 105 for an all-zero group).
        scale_computation: ``"amax/max"`` -> ``s = amax / 448`` (vLLM kernels, DeepGEMM);
            ``"1/(max/amax)"`` -> ``s = 1 / (448 / amax)`` (vLLM's python ``input_to_float8``).
        ue8m0_rounding: how a power-of-two scale is obtained when ``use_ue8m0=True``.
            ``"exp2_ceil_log2"``: ``exp2(ceil(log2(max(|s|, ue8m0_scale_floor))))`` in fp32, as
            vLLM's CUDA and Triton kernels write it; for an fp32 ``s`` a few ULPs above a power of
            two, ``log2`` rounds to the integer and the result is that power of two (one binade
            too small; the clamp to +-448 then matters). ``"ceil_to_ue8m0"``: DeepGEMM's exact
            bit formula (:func:`reference.quant.ue8m0.ceil_to_ue8m0`). The two agree for every
            scale ``amax / 448`` with a bfloat16 ``amax`` (tested exhaustively).
        ue8m0_scale_floor: lower bound on ``s`` before UE8M0 rounding (vLLM CUDA
            ``fmaxf(s, 1e-10)``; DeepGEMM none -> 0.0).
        quant_op: ``"divide"`` -> ``q = x / s`` (vLLM per-token-group kernels);
            ``"reciprocal_multiply"`` -> ``q = x * (1 / s)`` (DeepGEMM helpers);
            ``"max_over_amax_multiply"`` -> ``q = x * (448 / amax)`` (vLLM's python
            ``input_to_float8`` / ``scaled_quantize``; fp32 scales only). They differ in ~0.05 -
            0.09 % of codes for fp32 scales and agree for power-of-two scales.
        overflow: ``"saturate"`` only: values are clamped to +-448 *before* the cast to
            float8_e4m3fn, independent of torch's own overflow behaviour (it changed between
            2.11 and 2.14). Any other value raises ValueError.
        mx_scale_rule: the E8M0 scale rule this producer uses for MX formats (``"floor"`` OCP,
            ``"ceil"``, ``"even"``, ``"rceil"``): vLLM's CUTLASS MXFP4 MoE uses EVEN (since vLLM
            #43557), DeepGEMM's helpers RCEIL. Read by callers of
            :func:`reference.quant.mx.mxfp4_quantize` / ``mxfp8_quantize`` (``scale_rule=``).

    Raises ValueError from ``__post_init__`` for an unknown option or a negative floor.
    """

    name: str
    amax_floor: float
    scale_computation: ScaleComputation
    ue8m0_rounding: UE8M0Rounding
    ue8m0_scale_floor: float
    quant_op: QuantOp
    overflow: Literal["saturate"] = "saturate"
    mx_scale_rule: MXScaleRule = "floor"

    def __post_init__(self) -> None:
        def _one_of(field: str, value: object, valid: tuple[str, ...]) -> None:
            if value not in valid:
                raise ValueError(f"QuantRecipe.{field}={value!r} is not one of {list(valid)}")

        _one_of("scale_computation", self.scale_computation, _SCALE_COMPUTATIONS)
        _one_of("ue8m0_rounding", self.ue8m0_rounding, _UE8M0_ROUNDINGS)
        _one_of("quant_op", self.quant_op, _QUANT_OPS)
        _one_of("overflow", self.overflow, _OVERFLOWS)
        _one_of("mx_scale_rule", self.mx_scale_rule, _MX_RULES)
        for field in ("amax_floor", "ue8m0_scale_floor"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0.0:
                raise ValueError(f"QuantRecipe.{field} must be a float >= 0, got {v!r}")


#: vLLM 0.17 CUDA per_token_group_quant_8bit: absmax starts at eps=1e-10, s = absmax/448,
#: UE8M0 s = exp2f(ceilf(log2f(fmaxf(s, 1e-10)))), q = clamp(x / s, +-448).
VLLM_017 = QuantRecipe(
    name="vllm",
    amax_floor=1e-10,
    scale_computation="amax/max",
    ue8m0_rounding="exp2_ceil_log2",
    ue8m0_scale_floor=1e-10,
    quant_op="divide",
    overflow="saturate",
    mx_scale_rule="even",
)

#: vLLM 0.33 CUDA per_token_group_quant_8bit: as 0.17, but q = clamp(x * (1.0f / s), +-448) (``inv_y = 1.0f / y_s``
#: once per group, in both the shared-memory and the register-resident kernel). Its register-resident UE8M0 branch
#: rounds by exponent bits (ceil), which equals exp2f(ceilf(log2f(s))) for every scale of a 16-bit input (the only
#: inputs that path takes; tests/test_quant_recipes.py), so ``ue8m0_rounding`` is unchanged.
VLLM_033 = replace(VLLM_017, quant_op="reciprocal_multiply")

#: today's vLLM (the newest semantics version)
VLLM = VLLM_033

#: DeepGEMM per_token_cast_to_fp8 / per_block_cast_to_fp8: amax.clamp(1e-4), s = amax/448,
#: optionally ceil_to_ue8m0(s), q = (x * (1.0 / s)).to(fp8).
DEEPGEMM = QuantRecipe(
    name="deepgemm",
    amax_floor=1e-4,
    scale_computation="amax/max",
    ue8m0_rounding="ceil_to_ue8m0",
    ue8m0_scale_floor=0.0,
    quant_op="reciprocal_multiply",
    overflow="saturate",
    mx_scale_rule="rceil",
)

#: Registry of named recipes (read-only).
RECIPES: Mapping[str, QuantRecipe] = MappingProxyType({"vllm": VLLM, "deepgemm": DEEPGEMM})


def get_recipe(name_or_recipe: str | QuantRecipe, semantics=None) -> QuantRecipe:
    """Resolve a recipe name (``"vllm"``, ``"deepgemm"``) or pass a :class:`QuantRecipe` through.

    ``"vllm"`` is the recipe of the vLLM release that ``semantics`` (a ``reference.semantics`` version; None: the
    current one) selects: ``VLLM_017`` (divide) or ``VLLM_033`` (reciprocal multiply); see the semantics point
    ``quant.per_token_group_quant_op``. ``RECIPES`` maps each name to its newest recipe.

    Raises:
        ValueError: unknown name (the message lists the valid names).
        TypeError: neither a str nor a QuantRecipe.
    """
    if isinstance(name_or_recipe, QuantRecipe):
        return name_or_recipe
    if isinstance(name_or_recipe, str):
        if name_or_recipe == "vllm":
            return VLLM_017 if resolve_semantics(semantics) == SemanticsVersion.V0_17 else VLLM_033
        try:
            return RECIPES[name_or_recipe]
        except KeyError:
            raise ValueError(
                f"unknown quantization recipe {name_or_recipe!r}; valid names: {sorted(RECIPES)}"
            ) from None
    raise TypeError(
        f"recipe must be a recipe name or a QuantRecipe, got {type(name_or_recipe).__name__}"
    )


_PTGQ = "csrc/quantization/w8a8/fp8/per_token_group_quant.cu"
register_point(
    "quant.per_token_group_quant_op", component="quant",
    behaviour={"0.17": "per_token_group_quant_fp8 (recipe 'vllm'): q = sat(x / s), one IEEE division per element.",
               "0.33": "per_token_group_quant_fp8 (recipe 'vllm'): q = sat(x * (1 / s)), the reciprocal once per "
                       "group (1.0f / y_s) and one multiply per element; the codes differ from 0.17's where the "
                       "two fp32 results fall on either side of an E4M3 rounding boundary."},
    upstream={"0.17": f"vLLM 0.17.0 {_PTGQ} (QuantizeGroup: static_cast<float>(src) / y_s)",
              "0.33": f"vLLM 0.33.0 {_PTGQ} (QuantizeGroup and the register-resident kernel: inv_y = 1.0f / y_s; "
                      "its Triton fallback for non-CUDA platforms, fp8_utils.py, still divides)"},
    reference="reference.quant.recipes.get_recipe('vllm') -> VLLM_017 / VLLM_033",
    introduced="0.33")
