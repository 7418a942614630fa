"""The MoE router gate GEMM (vLLM ``GateLinear``): its tier dispatch and each tier's numerics.

Mirrors ``vllm/model_executor/layers/fused_moe/router/gate_linear.py`` (seed 000), plus the kernel contracts of
``csrc/moe/dsv3_router_gemm_entry.cu`` and ``csrc/moe/fp32_router_gemm_entry.cu`` (the ``TORCH_CHECK`` s those
kernels apply to their inputs).

The gate computes router logits ``x @ W.T``: ``x`` is ``(M, H)`` (M tokens, hidden size H), ``W`` is ``(E, H)``
(E routed experts), the logits are ``(M, E)``. The seed picks one of four implementations ("tiers"), first match
wins:

1. ``DSV3_ROUTER_GEMM``: ``ops.dsv3_router_gemm`` (Hopper/Blackwell, no bias, H = 7168, E in {256, 384},
   M <= 16), output dtype ``out_dtype``.
2. ``FP32_ROUTER_GEMM``: ``torch.ops.vllm.fp32_router_gemm_dispatch`` (Hopper/Blackwell, no bias, fp32 weight,
   H = 3072, E = 256, x fp32 or bf16). That custom op switches at run time: M <= 32 runs
   ``ops.fp32_router_gemm``; M > 32 runs ``F.linear(x.float(), W)``. This module gives the second branch its own
   value, ``FP32_DISPATCH_F_LINEAR`` (``seed_tier`` 2), so a backend can claim the kernel without the fallback.
3. ``CUBLAS_BF16_FP32``: ``torch.mm(x, W.T, out_dtype=torch.float32)`` (Hopper/Blackwell, no bias, bf16 weight,
   ``out_dtype`` fp32, x bf16).
4. ``F_LINEAR``: ``ReplicatedLinear.forward`` i.e. ``F.linear(x, W, b)`` in the weight dtype, then a cast to
   ``out_dtype``.

"Hopper or Blackwell" is ``is_cuda and (capability == (9, 0) or capability major == 10)``: SM90, SM100, SM101,
SM103 qualify; SM80, SM89, SM120/SM121 (capability family 120) and ROCm do not.

Numerics (the contract every backend is checked against):

- Tiers 1, 2 (both branches) and 3 return the dot products accumulated in fp32 and never rounded to bf16 in
  between. The reference value is the exact dot product (every bf16 x bf16 and fp32 x fp32 product is exact in
  fp64; the sum is accumulated in fp64), rounded once to fp32. A kernel accumulates in fp32 in its own order, so
  conformance compares these tiers with an fp32-accumulation tolerance (it grows with H), never bitwise.
- Tier 1 with a bf16 ``out_dtype`` rounds that fp32 value once to bf16 (the kernel's epilogue).
- Tier 4 computes in the weight dtype: x is first cast to the weight dtype (only when ``out_dtype`` is set and
  the dtypes differ), the fp32 accumulation plus bias is rounded once to the weight dtype, and that value is cast
  to ``out_dtype``. With a bf16 weight the logits are therefore bf16 values even when ``out_dtype`` is fp32.

The platform is an argument (``Platform``), never read from globals, so every tier is selectable and testable on
a CPU. Everything here is pure torch and runs on any device that has float64 (MPS inputs are computed on CPU).
"""

from __future__ import annotations

import dataclasses
import enum

import torch

__all__ = [
    "Platform",
    "CPU",
    "SM80",
    "SM89",
    "SM90",
    "SM100",
    "SM103",
    "SM120",
    "ROCM_MI300",
    "GateTier",
    "GateContractError",
    "DSV3_SUPPORTED_NUM_EXPERTS",
    "DSV3_SUPPORTED_HIDDEN_SIZES",
    "DSV3_MAX_TOKENS",
    "FP32_SUPPORTED_NUM_EXPERTS",
    "FP32_SUPPORTED_HIDDEN_SIZES",
    "FP32_MAX_TOKENS",
    "can_use_specialized_kernels",
    "resolve_params_dtype",
    "select_gate_tier",
    "gate_reference",
    "GateLinear",
]

_SOURCE = "vllm/model_executor/layers/fused_moe/router/gate_linear.py"

#: Expert counts the DSV3 router GEMM supports (DeepSeek-V3 256, Kimi-K2 384). Seed: ``DSV3_SUPPORTED_NUM_EXPERTS``.
DSV3_SUPPORTED_NUM_EXPERTS: tuple[int, ...] = (256, 384)
#: Hidden sizes the DSV3 router GEMM supports. Seed: ``DSV3_SUPPORTED_HIDDEN_SIZES``.
DSV3_SUPPORTED_HIDDEN_SIZES: tuple[int, ...] = (7168,)
#: Largest token count GateLinear sends to the DSV3 router GEMM (``x.shape[0] <= 16`` in the seed's forward).
DSV3_MAX_TOKENS: int = 16
#: Expert counts of the fp32 router GEMM. Seed: ``FP32_SUPPORTED_NUM_EXPERTS``.
FP32_SUPPORTED_NUM_EXPERTS: tuple[int, ...] = (256,)
#: Hidden sizes of the fp32 router GEMM. Seed: ``FP32_SUPPORTED_HIDDEN_SIZES``.
FP32_SUPPORTED_HIDDEN_SIZES: tuple[int, ...] = (3072,)
#: Largest token count the fp32 dispatch op sends to the kernel (seed ``_FP32_ROUTER_GEMM_MAX_TOKENS``).
FP32_MAX_TOKENS: int = 32


# --------------------------------------------------------------------------------------------------------------
# Platform
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Platform:
    """The two facts about the device that GateLinear's dispatch reads, as a value.

    Mirrors the ``current_platform`` queries of ``vllm/model_executor/layers/fused_moe/router/gate_linear.py``
    (``is_cuda()``, ``is_device_capability((9, 0))``, ``is_device_capability_family(100)``), with the semantics of
    ``vllm/platforms/interface.py``.

    Attributes:
        is_cuda: True on an NVIDIA CUDA platform (vLLM ``current_platform.is_cuda()``; False on ROCm and CPU).
        capability: ``(major, minor)`` compute capability, or None where the platform has none (CPU).

    Raises:
        ValueError: ``capability`` is not None and not a pair of non-negative ints (minor < 10).
    """

    is_cuda: bool
    capability: tuple[int, int] | None

    def __post_init__(self) -> None:
        cap = self.capability
        if cap is not None:
            ok = (
                isinstance(cap, tuple)
                and len(cap) == 2
                and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cap)
                and cap[1] < 10
            )
            if not ok:
                raise ValueError(f"capability must be None or (major, minor) with 0 <= minor < 10, got {cap!r}")
        if not isinstance(self.is_cuda, bool):
            raise ValueError(f"is_cuda must be a bool, got {self.is_cuda!r}")

    def _to_int(self) -> int | None:
        if self.capability is None:
            return None
        return self.capability[0] * 10 + self.capability[1]

    def is_device_capability(self, capability: tuple[int, int] | int) -> bool:
        """Exact capability match: ``(9, 0)`` or ``90`` matches SM90 only (not SM90's family).

        Mirrors ``Platform.is_device_capability`` of ``vllm/platforms/interface.py``: False when the platform has
        no capability; a tuple compares as a tuple, an int compares with ``major * 10 + minor``.
        """
        cur = self._to_int()
        if cur is None:
            return False
        if isinstance(capability, tuple):
            return self.capability == capability
        return cur == capability

    def is_device_capability_family(self, capability: int) -> bool:
        """Family match on the major version: ``100`` matches 10.x (SM100, SM101, SM103), not SM120.

        Mirrors ``Platform.is_device_capability_family`` of ``vllm/platforms/interface.py``:
        ``(major * 10 + minor) // 10 == capability // 10``; False when the platform has no capability.
        """
        cur = self._to_int()
        if cur is None:
            return False
        return cur // 10 == capability // 10

    @property
    def is_hopper_or_blackwell(self) -> bool:
        """The seed's ``is_hopper_or_blackwell``: ``is_device_capability((9, 0)) or
        is_device_capability_family(100)``. Note: this alone does not check ``is_cuda`` (the seed checks it
        separately), so ``ROCM_MI300`` (capability 9.4) is False here only because 9.4 != 9.0."""
        return self.is_device_capability((9, 0)) or self.is_device_capability_family(100)

    @property
    def name(self) -> str:
        """A short label: ``cpu``, ``sm90``, ``rocm-9.4`` (used in test ids and tables)."""
        if self.capability is None:
            return "cuda-unknown" if self.is_cuda else "cpu"
        major, minor = self.capability
        return f"sm{major}{minor}" if self.is_cuda else f"rocm-{major}.{minor}"

    def __str__(self) -> str:
        return self.name


#: A machine without a GPU (vLLM's CPU platform: not CUDA, no capability).
CPU = Platform(is_cuda=False, capability=None)
#: NVIDIA A100 (Ampere).
SM80 = Platform(is_cuda=True, capability=(8, 0))
#: NVIDIA L4 / L40 / RTX 4090 (Ada).
SM89 = Platform(is_cuda=True, capability=(8, 9))
#: NVIDIA H100 / H200 (Hopper).
SM90 = Platform(is_cuda=True, capability=(9, 0))
#: NVIDIA B200 / GB200 (Blackwell, family 100).
SM100 = Platform(is_cuda=True, capability=(10, 0))
#: NVIDIA B300 / GB300 (Blackwell Ultra, family 100).
SM103 = Platform(is_cuda=True, capability=(10, 3))
#: NVIDIA RTX PRO 6000 / RTX 50xx (consumer Blackwell, family 120: not "hopper or blackwell" for the seed).
SM120 = Platform(is_cuda=True, capability=(12, 0))
#: AMD MI300X on ROCm (gfx942, reports capability 9.4; ``is_cuda`` is False).
ROCM_MI300 = Platform(is_cuda=False, capability=(9, 4))


# --------------------------------------------------------------------------------------------------------------
# Tiers
# --------------------------------------------------------------------------------------------------------------


class GateTier(enum.Enum):
    """Which implementation GateLinear.forward runs (the seed's "tiers"), first match wins.

    Mirrors the numbered tiers of ``vllm/model_executor/layers/fused_moe/router/gate_linear.py``. Values 1-4 are
    the seed's tier numbers. ``FP32_DISPATCH_F_LINEAR`` (value 5, ``seed_tier`` 2) is the M > 32 branch of the
    seed's ``fp32_router_gemm_dispatch`` custom op: tier 2 was selected, but the op runs
    ``F.linear(x.float(), W)`` instead of the fp32 router kernel. It has its own value because it is a different
    implementation (a backend may provide the kernel but not the fallback), although its numerics are tier 2's.
    """

    DSV3_ROUTER_GEMM = 1
    FP32_ROUTER_GEMM = 2
    CUBLAS_BF16_FP32 = 3
    F_LINEAR = 4
    FP32_DISPATCH_F_LINEAR = 5

    @property
    def seed_tier(self) -> int:
        """The seed's tier number (1-4); ``FP32_DISPATCH_F_LINEAR`` reports 2."""
        return 2 if self is GateTier.FP32_DISPATCH_F_LINEAR else self.value

    @property
    def kernel(self) -> str:
        """The call the seed makes for this tier (a vLLM op or torch function name)."""
        return _TIER_KERNEL[self]

    @property
    def returns_fp32_accumulator(self) -> bool:
        """True for the tiers whose logits are the unrounded fp32 accumulator (1 with fp32 out, 2, 5, 3).

        False for F_LINEAR (rounded to the weight dtype). Tier 1 returns it only when its output dtype is fp32.
        """
        return self is not GateTier.F_LINEAR

    @property
    def supports_bias(self) -> bool:
        """Only F_LINEAR adds a bias; a bias disables tiers 1-3 at construction."""
        return self is GateTier.F_LINEAR


_TIER_KERNEL = {
    GateTier.DSV3_ROUTER_GEMM: "ops.dsv3_router_gemm",
    GateTier.FP32_ROUTER_GEMM: "ops.fp32_router_gemm (via torch.ops.vllm.fp32_router_gemm_dispatch)",
    GateTier.CUBLAS_BF16_FP32: "torch.mm(x, W.T, out_dtype=torch.float32)",
    GateTier.F_LINEAR: "ReplicatedLinear.forward -> F.linear(x, W, b)",
    GateTier.FP32_DISPATCH_F_LINEAR: "F.linear(x.float(), W) (via torch.ops.vllm.fp32_router_gemm_dispatch)",
}


class GateContractError(ValueError):
    """The inputs violate the contract of the implementation a tier runs.

    Raised by ``gate_reference`` where the seed's kernel (or torch function) would reject the call: the
    ``TORCH_CHECK`` s of ``csrc/moe/dsv3_router_gemm_entry.cu`` / ``fp32_router_gemm_entry.cu``, the dtype
    check of ``F.linear``, a bias given to a tier that has none. The seed's dispatch
    (``vllm/model_executor/layers/fused_moe/router/gate_linear.py``) can route such inputs to a tier (e.g. a
    non-bf16 activation or M == 0 to the DSV3 router GEMM); those calls fail in vLLM too, and here.
    """


# --------------------------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------------------------


def _check_dtype_arg(name: str, dtype: object, *, allow_none: bool) -> None:
    if dtype is None and allow_none:
        return
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype{' or None' if allow_none else ''}, got {dtype!r}")
    if not dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point dtype, got {dtype}")


def _check_platform(platform: object) -> None:
    if not isinstance(platform, Platform):
        raise TypeError(f"platform must be a reference.gate.Platform, got {platform!r}")


def can_use_specialized_kernels(platform: Platform, *, bias: bool) -> bool:
    """The seed's ``can_use_specialized_kernels`` (stored as ``allow_specialized_router_gemm``).

    ``platform.is_cuda and platform.is_hopper_or_blackwell and not bias``. Gates tiers 1 and 3 (tier 2 repeats the
    same three conditions itself) and whether ``force_fp32_compute`` changes the parameter dtype.

    Mirrors ``GateLinear.__init__`` of ``vllm/model_executor/layers/fused_moe/router/gate_linear.py``.

    Raises:
        TypeError: ``platform`` is not a ``Platform``.
    """
    _check_platform(platform)
    return platform.is_cuda and platform.is_hopper_or_blackwell and not bias


def resolve_params_dtype(
    params_dtype: torch.dtype | None,
    *,
    bias: bool,
    force_fp32_compute: bool,
    platform: Platform,
) -> torch.dtype:
    """The dtype GateLinear stores its weight (and bias) in.

    ``force_fp32_compute`` turns the parameters to fp32 only when the specialized kernels are NOT available
    (``can_use_specialized_kernels`` False: not CUDA, not Hopper/Blackwell, or a bias). Where they are available
    the weight keeps ``params_dtype`` (e.g. bf16) and fp32 logits come from tiers 1/3, which need ``out_dtype``
    fp32 as well (with ``out_dtype`` None and no DSV3 shape, such a gate runs tier 4 in bf16).
    ``params_dtype=None`` then resolves to ``torch.get_default_dtype()`` as vLLM's ``LinearBase`` does (vLLM builds
    models under ``set_default_torch_dtype(model_dtype)``, so there it is the model dtype, e.g. bf16).

    Mirrors ``GateLinear.__init__`` of ``vllm/model_executor/layers/fused_moe/router/gate_linear.py`` and
    ``LinearBase.__init__`` of ``vllm/model_executor/layers/linear.py``.

    Raises:
        TypeError: ``params_dtype`` is not None or a floating dtype; ``platform`` is not a ``Platform``.
    """
    _check_dtype_arg("params_dtype", params_dtype, allow_none=True)
    if force_fp32_compute and not can_use_specialized_kernels(platform, bias=bias):
        params_dtype = torch.float32
    return params_dtype if params_dtype is not None else torch.get_default_dtype()


def select_gate_tier(
    M: int,
    H: int,
    E: int,
    *,
    x_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    out_dtype: torch.dtype | None,
    bias: bool,
    platform: Platform,
) -> GateTier:
    """The tier GateLinear.forward takes for an ``(M, H)`` input and an ``(E, H)`` weight.

    A pure function of the gate's final state: ``weight_dtype`` is the dtype the weight is stored in (after
    ``resolve_params_dtype``), ``out_dtype`` the current one (after any ``set_out_dtype``; the seed's
    ``set_out_dtype`` enables tier 3 exactly as construction with that ``out_dtype`` would).

    First match wins:

    1. ``DSV3_ROUTER_GEMM``: specialized kernels allowed (CUDA, SM90 or SM10x, no bias), H = 7168,
       E in {256, 384}, M <= 16. Neither x, weight nor out dtype is checked (the kernel checks them: see
       ``gate_reference``), and M == 0 is routed here too.
    2. ``FP32_ROUTER_GEMM`` (M <= 32) or ``FP32_DISPATCH_F_LINEAR`` (M > 32): no bias, weight fp32, CUDA, SM90 or
       SM10x, H = 3072, E = 256, x fp32 or bf16. ``out_dtype`` is not consulted (the output is fp32 always).
    3. ``CUBLAS_BF16_FP32``: specialized kernels allowed, weight bf16, ``out_dtype`` fp32, x bf16.
    4. ``F_LINEAR``: everything else.

    Args:
        M: tokens (rows of x), >= 0.
        H: hidden size (``input_size``), > 0.
        E: experts (``output_size``), > 0.
        x_dtype, weight_dtype: floating dtypes of the activation and the stored weight.
        out_dtype: GateLinear's ``out_dtype`` (None = unset).
        bias: whether the gate has a bias.
        platform: the device the seed would run on.

    Returns:
        The ``GateTier``.

    Raises:
        ValueError: M < 0, H <= 0 or E <= 0.
        TypeError: a dtype is not a floating torch.dtype, or ``platform`` is not a ``Platform``.

    Mirrors ``GateLinear.__init__``/``forward`` and ``fp32_router_gemm_dispatch_impl`` of
    ``vllm/model_executor/layers/fused_moe/router/gate_linear.py``.
    """
    for name, v, lo in (("M", M, 0), ("H", H, 1), ("E", E, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    _check_dtype_arg("x_dtype", x_dtype, allow_none=False)
    _check_dtype_arg("weight_dtype", weight_dtype, allow_none=False)
    _check_dtype_arg("out_dtype", out_dtype, allow_none=True)
    _check_platform(platform)

    specialized = can_use_specialized_kernels(platform, bias=bias)
    allow_dsv3 = specialized and E in DSV3_SUPPORTED_NUM_EXPERTS and H in DSV3_SUPPORTED_HIDDEN_SIZES
    allow_fp32 = (
        not bias
        and weight_dtype == torch.float32
        and platform.is_cuda
        and platform.is_hopper_or_blackwell
        and E in FP32_SUPPORTED_NUM_EXPERTS
        and H in FP32_SUPPORTED_HIDDEN_SIZES
    )
    allow_cublas = specialized and weight_dtype == torch.bfloat16 and out_dtype == torch.float32

    if allow_dsv3 and M <= DSV3_MAX_TOKENS:
        return GateTier.DSV3_ROUTER_GEMM
    if allow_fp32 and x_dtype in (torch.float32, torch.bfloat16):
        return GateTier.FP32_ROUTER_GEMM if M <= FP32_MAX_TOKENS else GateTier.FP32_DISPATCH_F_LINEAR
    if allow_cublas and x_dtype == torch.bfloat16:
        return GateTier.CUBLAS_BF16_FP32
    return GateTier.F_LINEAR


# --------------------------------------------------------------------------------------------------------------
# Numerics
# --------------------------------------------------------------------------------------------------------------


def _validate_operands(x: object, weight: object, bias: object) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (E, H), got shape {tuple(weight.shape)}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (M, H) = (num_tokens, hidden_size), got shape {tuple(x.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x has hidden size {x.shape[1]} (shape {tuple(x.shape)}) but weight expects "
            f"{weight.shape[1]} (shape {tuple(weight.shape)})"
        )
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must have a floating-point dtype, got {x.dtype}")
    if not weight.dtype.is_floating_point:
        raise TypeError(f"weight must have a floating-point dtype, got {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but weight is on {weight.device}; they must be on the same device")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        if bias.device != weight.device:
            raise ValueError(f"bias is on {bias.device} but weight is on {weight.device}")


def _accumulate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, acc: torch.dtype) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with products and sum in fp64, rounded once to ``acc`` (fp32 or fp64)."""
    dev = x.device
    xs, ws, bs = x, weight, bias
    if dev.type == "mps":  # no float64 there
        xs, ws = x.cpu(), weight.cpu()
        bs = bias.cpu() if bias is not None else None
    y = xs.double() @ ws.double().T
    if bs is not None:
        y = y + bs.double()
    return y.to(acc).to(dev)


def gate_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    tier: GateTier,
    out_dtype: torch.dtype | None,
    bias: torch.Tensor | None = None,
    strict: bool = True,
) -> torch.Tensor:
    """Router logits as ``tier`` defines them: where they are rounded, and to which dtype.

    Args:
        x: ``(M, H)`` activations, floating dtype, same device as ``weight``.
        weight: ``(E, H)`` gate weight (the stored dtype: bf16, fp32, ...).
        tier: the tier whose numerics to compute (normally ``select_gate_tier``'s answer).
        out_dtype: GateLinear's ``out_dtype`` (None = unset). Consulted by tiers 1 and 4 only.
        bias: ``(E,)`` in the weight dtype, or None. Only ``F_LINEAR`` accepts one.
        strict: also enforce the shape/token-count contract of the tier-1/2 kernels (H, E, M ranges). Set False
            to evaluate those numerics on small debugging shapes; dtype contracts are always enforced.

    Returns:
        ``(M, E)`` logits on x's device:

        - ``DSV3_ROUTER_GEMM``: exact dot product rounded once to fp32, then (bf16 ``out_dtype``) once to bf16.
          The dtype is ``out_dtype``; ``None`` resolves to ``torch.get_default_dtype()`` (fp32 unless changed),
          because the seed passes ``output_dtype=None`` to ``ops.dsv3_router_gemm``, whose ``torch.empty(...,
          dtype=None)`` uses the default dtype. Contract (kernel ``TORCH_CHECK`` s): x bf16, weight bf16, output
          fp32 or bf16, 1 <= M <= 16, H = 7168, E in {256, 384}.
        - ``FP32_ROUTER_GEMM`` / ``FP32_DISPATCH_F_LINEAR``: ``x.float() @ W.T``, exact then rounded once to fp32;
          fp32 whatever ``out_dtype`` is (the seed ignores it on this tier). Contract: weight fp32, x fp32 or
          bf16; kernel branch also 0 <= M <= 32, H = 3072, E = 256.
        - ``CUBLAS_BF16_FP32``: exact then rounded once to fp32; fp32. Contract: x and weight bf16.
        - ``F_LINEAR``: if ``out_dtype`` is set and ``x.dtype != weight.dtype``, x is cast to the weight dtype
          (rounding it); ``x @ W.T + b`` accumulated exactly, rounded once to fp32 (the accumulator; fp64 for fp64
          weights) and once to the weight dtype; then cast to ``out_dtype`` if set. Contract: x and weight share a
          dtype after that cast (``F.linear`` rejects mixed dtypes, so ``out_dtype=None`` with mixed dtypes fails),
          bias in the weight dtype.

        "Exact then rounded once to fp32": fp64 holds every bf16/fp16/fp32 product exactly and the fp64 sum's
        error is far below an fp32 ulp, so this is the correctly rounded fp32 dot product except in vanishingly
        rare near-tie cases. Kernels accumulate in fp32 in their own order: compare tiers 1-3 with an fp32
        accumulation tolerance (growing with H), and tier 4 within an ulp of the weight dtype.

    Raises:
        TypeError: non-tensor operands, non-floating dtypes, ``tier`` not a ``GateTier``.
        ValueError: x or weight not 2-D, H mismatch (the message names both), devices differ, bad bias shape.
        GateContractError: the tier's implementation would reject these inputs (see above).

    Mirrors ``GateLinear.forward`` and ``fp32_router_gemm_dispatch_impl`` of
    ``vllm/model_executor/layers/fused_moe/router/gate_linear.py``, with the kernel contracts of
    ``csrc/moe/dsv3_router_gemm_entry.cu`` and ``csrc/moe/fp32_router_gemm_entry.cu``.
    """
    _validate_operands(x, weight, bias)
    if not isinstance(tier, GateTier):
        raise TypeError(f"tier must be a GateTier, got {tier!r}")
    _check_dtype_arg("out_dtype", out_dtype, allow_none=True)
    M, H = x.shape
    E = weight.shape[0]
    bf16, fp32 = torch.bfloat16, torch.float32

    if bias is not None and not tier.supports_bias:
        raise GateContractError(f"{tier.name} has no bias; the seed only selects it for gates built with bias=False")

    if tier is GateTier.DSV3_ROUTER_GEMM:
        out = out_dtype if out_dtype is not None else torch.get_default_dtype()
        if x.dtype != bf16:
            raise GateContractError(f"dsv3_router_gemm: mat_a (x) must be bf16, got {x.dtype}")
        if weight.dtype != bf16:
            raise GateContractError(f"dsv3_router_gemm: mat_b (weight) must be bf16, got {weight.dtype}")
        if out not in (fp32, bf16):
            raise GateContractError(f"dsv3_router_gemm: output must be float32 or bf16, got {out}")
        if strict:
            if not 1 <= M <= DSV3_MAX_TOKENS:
                raise GateContractError(f"dsv3_router_gemm: num_tokens must be in [1, {DSV3_MAX_TOKENS}], got {M}")
            if H not in DSV3_SUPPORTED_HIDDEN_SIZES:
                raise GateContractError(f"dsv3_router_gemm: expected hidden_dim=7168, got {H}")
            if E not in DSV3_SUPPORTED_NUM_EXPERTS:
                raise GateContractError(f"dsv3_router_gemm: expected num_experts 256 or 384, got {E}")
        return _accumulate(x, weight, None, fp32).to(out)

    if tier in (GateTier.FP32_ROUTER_GEMM, GateTier.FP32_DISPATCH_F_LINEAR):
        if weight.dtype != fp32:
            raise GateContractError(f"{tier.kernel}: weight must be float32, got {weight.dtype}")
        if x.dtype not in (fp32, bf16):
            raise GateContractError(f"{tier.kernel}: x must be float32 or bfloat16, got {x.dtype}")
        if strict and tier is GateTier.FP32_ROUTER_GEMM:
            if M > FP32_MAX_TOKENS:
                raise GateContractError(f"fp32_router_gemm: num_tokens must be in [0, {FP32_MAX_TOKENS}], got {M}")
            if H not in FP32_SUPPORTED_HIDDEN_SIZES:
                raise GateContractError(f"fp32_router_gemm: expected hidden_dim=3072, got {H}")
            if E not in FP32_SUPPORTED_NUM_EXPERTS:
                raise GateContractError(f"fp32_router_gemm: expected num_experts=256, got {E}")
        return _accumulate(x, weight, None, fp32)

    if tier is GateTier.CUBLAS_BF16_FP32:
        if x.dtype != bf16 or weight.dtype != bf16:
            raise GateContractError(
                f"torch.mm(out_dtype=float32) tier needs bf16 x and weight, got x {x.dtype}, weight {weight.dtype}"
            )
        return _accumulate(x, weight, None, fp32)

    # Tier 4: F.linear in the weight dtype.
    if out_dtype is not None and x.dtype != weight.dtype:
        x = x.to(weight.dtype)
    if x.dtype != weight.dtype:
        raise GateContractError(
            f"F.linear needs x and weight of one dtype, got x {x.dtype} and weight {weight.dtype} "
            "(GateLinear casts x to the weight dtype only when out_dtype is set)"
        )
    if bias is not None and bias.dtype != weight.dtype:
        raise GateContractError(f"bias must be in the weight dtype {weight.dtype}, got {bias.dtype}")
    acc = torch.float64 if weight.dtype == torch.float64 else fp32
    y = _accumulate(x, weight, bias, acc).to(weight.dtype)
    if out_dtype is not None and y.dtype != out_dtype:
        y = y.to(out_dtype)
    return y


# --------------------------------------------------------------------------------------------------------------
# The module
# --------------------------------------------------------------------------------------------------------------


class GateLinear(torch.nn.Module):
    """MoE gate linear layer with vLLM's multi-tier GEMM dispatch, computing each tier's reference numerics.

    Mirrors ``GateLinear`` of ``vllm/model_executor/layers/fused_moe/router/gate_linear.py`` (a
    ``ReplicatedLinear``); the platform is the keyword argument ``platform`` instead of ``current_platform``.

    Args:
        input_size: H, the hidden size (> 0).
        output_size: E, the number of routed experts (> 0).
        bias: create an ``(E,)`` bias (disables tiers 1-3).
        out_dtype: the logits dtype, or None (unset; may be set once later with ``set_out_dtype``).
        params_dtype: weight/bias dtype; None = ``torch.get_default_dtype()`` (see ``resolve_params_dtype``).
        force_fp32_compute: store fp32 parameters when no specialized kernel is available on ``platform``.
        platform: the device the dispatch assumes (default ``CPU``). Tensors may live anywhere.
        prefix: accepted for signature parity with vLLM; unused.

    Attributes (computed once at construction, from the stored weight dtype, as in the seed):
        weight: ``(E, H)`` Parameter, zero-initialised (vLLM leaves it ``torch.empty`` until weights load); fill it
            with ``gate.weight.data.copy_(w)`` or ``load_state_dict``. Changing its dtype afterwards (``.to``)
            does not recompute the ``allow_*`` flags, as in the seed.
        bias: ``(E,)`` Parameter or None.
        out_dtype: the logits dtype or None.
        allow_specialized_router_gemm: ``can_use_specialized_kernels(platform, bias=bias)``.
        allow_dsv3_router_gemm: specialized and H = 7168 and E in {256, 384}.
        allow_fp32_router_gemm: no bias, fp32 weight, CUDA, Hopper/Blackwell, H = 3072, E = 256.
        allow_cublas_router_gemm: specialized, bf16 weight, ``out_dtype`` fp32 (or enabled by ``set_out_dtype``).

    Raises:
        ValueError: input_size or output_size not a positive int.
        TypeError: a dtype argument is not None or a floating dtype; ``platform`` not a ``Platform``.
    """

    DSV3_SUPPORTED_NUM_EXPERTS = list(DSV3_SUPPORTED_NUM_EXPERTS)
    DSV3_SUPPORTED_HIDDEN_SIZES = list(DSV3_SUPPORTED_HIDDEN_SIZES)
    FP32_SUPPORTED_NUM_EXPERTS = list(FP32_SUPPORTED_NUM_EXPERTS)
    FP32_SUPPORTED_HIDDEN_SIZES = list(FP32_SUPPORTED_HIDDEN_SIZES)
    FP32_MAX_TOKENS = FP32_MAX_TOKENS

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        out_dtype: torch.dtype | None = None,
        params_dtype: torch.dtype | None = None,
        force_fp32_compute: bool = False,
        *,
        platform: Platform = CPU,
        prefix: str = "",
    ) -> None:
        super().__init__()
        for name, v in (("input_size", input_size), ("output_size", output_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        _check_dtype_arg("out_dtype", out_dtype, allow_none=True)
        _check_platform(platform)
        self.platform = platform
        self.input_size = input_size
        self.output_size = output_size
        self.prefix = prefix
        self.force_fp32_compute = bool(force_fp32_compute)

        is_hopper_or_blackwell = platform.is_device_capability((9, 0)) or platform.is_device_capability_family(100)
        can_use_specialized = platform.is_cuda and is_hopper_or_blackwell and not bias
        if force_fp32_compute and not can_use_specialized:
            params_dtype = torch.float32
        _check_dtype_arg("params_dtype", params_dtype, allow_none=True)
        if params_dtype is None:
            params_dtype = torch.get_default_dtype()
        self.params_dtype = params_dtype

        self.weight = torch.nn.Parameter(
            torch.zeros(output_size, input_size, dtype=params_dtype), requires_grad=False
        )
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=params_dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.out_dtype = out_dtype

        self.allow_specialized_router_gemm = can_use_specialized
        self.allow_dsv3_router_gemm = (
            self.allow_specialized_router_gemm
            and output_size in self.DSV3_SUPPORTED_NUM_EXPERTS
            and input_size in self.DSV3_SUPPORTED_HIDDEN_SIZES
        )
        self.allow_fp32_router_gemm = (
            not bias
            and self.weight.dtype == torch.float32
            and platform.is_cuda
            and is_hopper_or_blackwell
            and output_size in self.FP32_SUPPORTED_NUM_EXPERTS
            and input_size in self.FP32_SUPPORTED_HIDDEN_SIZES
        )
        self.allow_cublas_router_gemm = (
            self.allow_specialized_router_gemm
            and self.weight.dtype == torch.bfloat16
            and self.out_dtype == torch.float32
        )

    def set_out_dtype(self, out_dtype: torch.dtype) -> None:
        """Set the logits dtype after construction (once).

        Enables tier 3 when the specialized kernels are allowed, ``out_dtype`` is fp32 and the weight is bf16,
        exactly as constructing with that ``out_dtype`` would. ``set_out_dtype(None)`` on an unset gate is a
        no-op (as in the seed).

        Raises:
            ValueError: "out_dtype has already been set" (``out_dtype`` is not None).
            TypeError: ``out_dtype`` is not None or a floating dtype.

        Mirrors ``GateLinear.set_out_dtype`` of ``vllm/model_executor/layers/fused_moe/router/gate_linear.py``.
        """
        if self.out_dtype is not None:
            raise ValueError("out_dtype has already been set")
        _check_dtype_arg("out_dtype", out_dtype, allow_none=True)
        self.out_dtype = out_dtype
        if (
            not self.allow_cublas_router_gemm
            and self.allow_specialized_router_gemm
            and out_dtype == torch.float32
        ):
            self.allow_cublas_router_gemm = self.weight.dtype == torch.bfloat16

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2:
            raise ValueError(f"x must be 2-D (M, H) = (num_tokens, hidden_size), got shape {tuple(x.shape)}")
        if x.shape[1] != self.input_size:
            raise ValueError(
                f"x has hidden size {x.shape[1]} (shape {tuple(x.shape)}) but the gate's input_size is "
                f"{self.input_size}"
            )
        if not x.dtype.is_floating_point:
            raise TypeError(f"x must have a floating-point dtype, got {x.dtype}")
        if x.device != self.weight.device:
            raise ValueError(
                f"x is on {x.device} but the gate weight is on {self.weight.device}; they must be on the same device"
            )

    def tier_for(self, x: torch.Tensor) -> GateTier:
        """The tier ``forward(x)`` takes (the seed's if-chain over the ``allow_*`` flags, M and x's dtype).

        Args:
            x: ``(M, H)`` activations, floating dtype, on the weight's device.

        Raises:
            ValueError / TypeError: as ``forward``.

        Mirrors ``GateLinear.forward`` and ``fp32_router_gemm_dispatch_impl`` of
        ``vllm/model_executor/layers/fused_moe/router/gate_linear.py``.
        """
        self._check_input(x)
        if self.allow_dsv3_router_gemm and x.shape[0] <= DSV3_MAX_TOKENS:
            return GateTier.DSV3_ROUTER_GEMM
        if self.allow_fp32_router_gemm and x.dtype in (torch.float32, torch.bfloat16):
            if x.shape[0] <= self.FP32_MAX_TOKENS:
                return GateTier.FP32_ROUTER_GEMM
            return GateTier.FP32_DISPATCH_F_LINEAR
        if self.allow_cublas_router_gemm and x.dtype == torch.bfloat16:
            return GateTier.CUBLAS_BF16_FP32
        return GateTier.F_LINEAR

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.nn.Parameter | None]:
        """Router logits ``(M, E)`` with the numerics of the tier the seed would run.

        Args:
            x: ``(M, H)`` activations, floating dtype, on the weight's device.

        Returns:
            ``(logits, output_bias)``; ``output_bias`` is always None (the bias, if any, is added inside tier 4,
            as ``ReplicatedLinear`` does without ``skip_bias_add``). The logits' dtype: tier 1 ``out_dtype``
            (None: the default dtype), tiers 2 and 3 fp32, tier 4 ``out_dtype`` or the weight dtype.

        Raises:
            ValueError: x not 2-D, ``x.shape[1] != input_size`` (the message names both), devices differ.
            TypeError: x is not a floating-point tensor.
            GateContractError: the selected tier's implementation rejects the input (e.g. fp32 x on tier 1, M == 0
                on tier 1, mixed dtypes on tier 4 with ``out_dtype`` unset) - as the seed would fail.

        Mirrors ``GateLinear.forward`` of ``vllm/model_executor/layers/fused_moe/router/gate_linear.py``.
        """
        tier = self.tier_for(x)
        out = gate_reference(x, self.weight, tier=tier, out_dtype=self.out_dtype, bias=self.bias)
        return out, None

    def extra_repr(self) -> str:
        return (
            f"in_features={self.input_size}, output_features={self.output_size}, bias={self.bias is not None}, "
            f"params_dtype={self.params_dtype}, out_dtype={self.out_dtype}, platform={self.platform.name}"
        )
