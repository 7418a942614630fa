"""Host-side helpers of the triton backend: activation codes, recipe parameters, small integer helpers, and the
grouped GEMM's launch surface (its mode enums and argument groups, shared by ``experts`` and the Gluon kernels).

Imports triton only through ``jit`` (the kernels' constants); everything else is plain Python / torch.
"""

from __future__ import annotations

import enum
import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from reference.activation import (
    SWIGLUOAI_DEFAULT_ALPHA,
    SWIGLUOAI_DEFAULT_LIMIT,
    SWIGLUSTEP_LIMIT,
    MoEActivation,
)

from . import jit

if TYPE_CHECKING:
    from .align import RouteLayout

__all__ = [
    "INTERPRET", "cdiv", "next_pow2", "round_up", "activation_code", "act_params", "recipe_params",
    "check_device", "fp8_capable", "Fusion", "ScaleMode", "GemmOperands", "GemmShape", "GemmScales", "GemmEpilogue",
]

INTERPRET = jit.INTERPRET

#: Programmatic dependent launch around the experts step's small kernels (sm_90; never under the interpreter): the
#: input quantizers let the next kernel start (they trigger at their start), the one-launch route alignment is
#: launched early and reads the router's ids beside them, and the top-k sum is launched during GEMM2.
#: ``MOE_TRITON_STEP_PDL=0`` turns it off (an A / B on the GPU). The rules that make it safe: a kernel launched so
#: reads, before its ``gdc_wait``, only what was finished before the kernel it follows started (the ids, the map),
#: and writes nothing before it (its outputs are fresh allocations, and the caching allocator may hand out memory
#: that the running kernel still reads, e.g. a temporary freed right after its launch); after the wait the kernel
#: before it has finished and its writes are visible, so GEMM1, launched normally after the alignment, sees the
#: codes.
STEP_PDL = os.environ.get("MOE_TRITON_STEP_PDL", "1") != "0" and not INTERPRET
#: The activation / requantization kernel between the GEMMs takes the routes instead of the layout's rows where at
#: least half of the rows are padding (decode: E * (BLOCK_M - 1) padding rows against M * topk routes), and leaves
#: the padding rows unwritten (``quant.launch_act_quant``'s ``ROUTES``). ``MOE_TRITON_QUANT_ROUTES=0`` turns it off
#: (an A / B on the GPU).
QUANT_ROUTES = os.environ.get("MOE_TRITON_QUANT_ROUTES", "1") != "0"
#: The per-token requantization over the layout's rows (prefill) holds rows wider than 256 columns as
#: ``[rows, chunks, 256]`` tiles of ``QUANT_ROW_TILE`` elements (at least one row), so that a row spans fewer warps
#: (``kernels.act_quant_kernel``'s ``ROW_CHUNKS``), and may skip the layout's padding rows
#: (``SKIP_PAD``: off, the ids' load before the rows' costs more than the padding). H200, Qwen3-30B
#: fp8_channel_token, the kernel at M = 1024 / 4096: 33.4 / 86.2 us with ``[rows, 1024]`` tiles of 4096 elements
#: (a row over four warps, reduced through shared memory), 31.3 / 72.9 chunked and padded to 4 chunks, 23.8 / 52.1
#: with the tail tile (``QUANT_ROW_TAIL``, the default); padded, with SKIP_PAD 31.4 / 76.6, tiles of 2048 / 8192 /
#: 16384 elements 78.6 / 86.9 / 143.5 us at M = 4096 (docs/notes/gpu-sessions.md, eighteenth session). With the
#: tail, 8192 elements (8 rows of 768, one barrier in the SASS) against 4096: 24.5 / 48.4 against 22.8 / 50.4 us,
#: and with ``QUANT_FAST_DIV`` 13.6 / 35.5 against 16.0 / 43.2 (nineteenth session, two interleaved rounds): the
#: default. ``MOE_TRITON_QUANT_ROW_CHUNKED=0`` / ``MOE_TRITON_QUANT_ROW_TILE`` / ``MOE_TRITON_QUANT_SKIP_PAD=1``
#: for an A / B on the GPU.
#: (``MOE_TRITON_QUANT_ROW_CHUNKED=2``: also at decode and over the routes, an experiment)
QUANT_ROW_CHUNKED = int(os.environ.get("MOE_TRITON_QUANT_ROW_CHUNKED", "1"))
QUANT_ROW_TILE = int(os.environ.get("MOE_TRITON_QUANT_ROW_TILE", "8192"))
#: rows of ``2^a + 2^b`` chunks as two tiles (``ROW_TAIL``; 768 columns: 2 + 1 chunks) instead of one padded to a power
#: of two (4 chunks, one masked); ``MOE_TRITON_QUANT_ROW_TAIL=0`` pads instead
QUANT_ROW_TAIL = os.environ.get("MOE_TRITON_QUANT_ROW_TAIL", "1") != "0"
QUANT_SKIP_PAD = os.environ.get("MOE_TRITON_QUANT_SKIP_PAD", "0") == "1"
#: The dynamic per-token FP8 quantizer's division (bf16 / fp16 rows) in ``jit.div_rn_by_scale``'s FAST form: a
#: multiply by the row's reciprocal and two FMAs instead of ``div.rn.f32``, the same codes for every input of that
#: domain (tests/test_exact_division.py enumerates them on the CPU, tests/test_triton_gpu.py on the GPU's own FMA:
#: passed on an H200). On by default since the nineteenth session's A / B (the prefill requantization above, H200:
#: 24.5 -> 13.6 us at M = 1024, 48.4 -> 35.5 at M = 4096); ``MOE_TRITON_FAST_DIV=0`` keeps the division.
QUANT_FAST_DIV = os.environ.get("MOE_TRITON_FAST_DIV", "1") != "0"
#: The dynamic per-tensor requantization between the GEMMs (``act_quant_kernel`` QMODE 6 / 7, element-wise) takes
#: ``[rows, min(next_pow2(I), QUANT_TENSOR_COLS)]`` tiles of ``QUANT_TENSOR_TILE`` elements over
#: ``QUANT_TENSOR_WARPS`` warps a program over the layout's rows (prefill), and one route's
#: ``QUANT_TENSOR_ROUTE_COLS`` columns a program over the routes (decode, ``ROUTES``); the table's ``QUANT_WARPS``
#: overrides the warps. ``MOE_TRITON_QUANT_TENSOR_{TILE,COLS,ROUTE_COLS,WARPS}``: an A / B on the GPU,
#: ``tools/diag/requant_tiles.py`` (the codes are the same in every tiling). H200, Mixtral TP2 fp8_tensor (I = 7168),
#: the kernel alone (twenty-second / twenty-third sessions, three rounds): at M = 64 over the routes 5.52 us with
#: 1024 columns a program, 4.08 with 2048, 3.26 with 4096, 3.16 with 8192 (a route a program); at M = 1 (two routes)
#: 2.00 / 2.08 / 2.43 us with 2048 / 4096 / 8192 (fewer programs for the same latency chain); at M = 1024 / 4096
#: over the rows 22.8 / 64.0 us with the defaults (4096 x 1024 on 4 warps), 23.3 / 65.2 with 8192 x 1024 on 8,
#: 26.0 / 73.7 with 8192 x 2048 on 8, 23.7 / 66.5 with 16384 x 1024 on 16.
QUANT_TENSOR_TILE = int(os.environ.get("MOE_TRITON_QUANT_TENSOR_TILE", "4096"))
QUANT_TENSOR_COLS = int(os.environ.get("MOE_TRITON_QUANT_TENSOR_COLS", "1024"))
QUANT_TENSOR_ROUTE_COLS = int(os.environ.get("MOE_TRITON_QUANT_TENSOR_ROUTE_COLS", "4096"))
QUANT_TENSOR_WARPS = int(os.environ.get("MOE_TRITON_QUANT_TENSOR_WARPS", "4"))

_ACT_CODES = {
    MoEActivation.SILU: jit.ACT_SILU,
    MoEActivation.GELU: jit.ACT_GELU,
    MoEActivation.GELU_TANH: jit.ACT_GELU_TANH,
    MoEActivation.SWIGLUOAI: jit.ACT_SWIGLUOAI,
    MoEActivation.SWIGLUOAI_UNINTERLEAVE: jit.ACT_SWIGLUOAI_UNINTERLEAVE,
    MoEActivation.SWIGLUSTEP: jit.ACT_SWIGLUSTEP,
    MoEActivation.SILU_NO_MUL: jit.ACT_SILU_NO_MUL,
    MoEActivation.GELU_NO_MUL: jit.ACT_GELU_NO_MUL,
    MoEActivation.RELU2_NO_MUL: jit.ACT_RELU2_NO_MUL,
}

SUPPORTED_ACTIVATIONS = frozenset(_ACT_CODES)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def activation_code(activation: MoEActivation) -> int:
    """The kernels' ``ACT`` code of a ``MoEActivation``.

    Raises:
        ValueError: gated RELU2 (undefined, as in the reference) or an activation the kernels do not implement.
    """
    try:
        return _ACT_CODES[activation]
    except KeyError:
        raise ValueError(f"the triton backend does not implement activation {activation} "
                         f"(supported: {sorted(a.value for a in _ACT_CODES)})") from None


def act_params(activation: MoEActivation, alpha, beta, limit) -> tuple[float, float, float, bool]:
    """Resolve ``(alpha, beta, limit, has_limit)`` with the reference's defaults per activation."""
    A = MoEActivation
    if activation is A.SWIGLUOAI:
        return (SWIGLUOAI_DEFAULT_ALPHA if alpha is None else float(alpha), 0.0,
                SWIGLUOAI_DEFAULT_LIMIT if limit is None else float(limit), True)
    if activation is A.SWIGLUOAI_UNINTERLEAVE:
        return (1.0 if alpha is None else float(alpha), 0.0 if beta is None else float(beta),
                0.0 if limit is None else float(limit), limit is not None)
    if activation is A.SWIGLUSTEP:
        return 1.0, 0.0, SWIGLUSTEP_LIMIT if limit is None else float(limit), True
    if activation is A.SILU:
        return 1.0, 0.0, 0.0 if limit is None else float(limit), limit is not None
    return 1.0, 0.0, 0.0, False


def recipe_params(recipe) -> dict:
    """Kernel parameters of a ``reference.quant`` recipe (name or ``QuantRecipe``).

    Returns ``amax_floor``, ``ue8m0_floor`` (floats) and the constexprs ``UE8M0_EXACT`` (``ceil_to_ue8m0`` vs
    vLLM's ``exp2(ceil(log2))``), ``RECIP_MUL`` (``x * (1/s)`` vs ``x / s``), ``SCALE_INV`` (``1/(448/amax)``).

    Raises:
        ValueError: unknown recipe name or an overflow mode other than saturate.
    """
    from reference.quant.recipes import get_recipe

    r = get_recipe(recipe)
    if r.overflow != "saturate":
        raise ValueError(f"recipe {r.name!r}: only saturating FP8 overflow is implemented, got {r.overflow!r}")
    return dict(
        amax_floor=float(r.amax_floor),
        ue8m0_floor=float(r.ue8m0_scale_floor),
        UE8M0_EXACT=r.ue8m0_rounding == "ceil_to_ue8m0",
        RECIP_MUL=r.quant_op == "reciprocal_multiply",
        SCALE_INV=r.scale_computation == "1/(max/amax)",
    )


def check_device(*tensors: torch.Tensor, what: str = "operands") -> torch.device:
    """All tensors on one device, and that device usable by the kernels (CUDA, or CPU under the interpreter).

    Raises:
        ValueError: mixed devices, or a CPU tensor without ``TRITON_INTERPRET=1`` / a CUDA tensor under it.
    """
    devs = {t.device for t in tensors if t is not None}
    if len(devs) != 1:
        raise ValueError(f"triton backend: {what} must be on one device, got {sorted(map(str, devs))}")
    dev = devs.pop()
    if INTERPRET and dev.type != "cpu":
        raise ValueError(f"triton backend: TRITON_INTERPRET=1 runs kernels on CPU tensors, got {what} on {dev}")
    if not INTERPRET and dev.type != "cuda":
        raise ValueError(f"triton backend: {what} must be CUDA tensors (or set TRITON_INTERPRET=1 for CPU), "
                         f"got {dev}")
    return dev


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def fp8_capable(device: torch.device | None = None) -> bool:
    """FP8 ``tl.dot`` needs sm_89+ (true under the interpreter)."""
    if INTERPRET:
        return True
    if not torch.cuda.is_available():
        return False
    idx = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    return _capability(idx) >= (8, 9)


# --------------------------------------------------------------------------------------------------------------
# the grouped GEMM's launch surface: C[rows, n] = epilogue(A[rows] @ W[e, n, :]^T) over a route layout
# (``fused_moe_kernel``, ``gluon_sm90.fp8_block_moe_gemm_kernel``, ``gluon_ws.ws_moe_gemm_kernel``)
# --------------------------------------------------------------------------------------------------------------


class Fusion(enum.IntEnum):
    """What the GEMM's epilogue fuses: ``fused_moe_kernel``'s ``FUSE`` constexpr (the int value is what the kernel
    receives). GEMM2 and an unfused GEMM1 are ``NONE``; a fused GEMM1 computes ``I`` activation columns from the
    ``2I`` weight rows (gated) or ``I`` rows (``ACT``)."""

    NONE = 0  # plain: the output columns as computed
    GATED = 1  # gate / up halves (gate row n, up row UP_OFF + n = I + n): two MMA chains
    INTERLEAVED = 2  # gate / up interleaved (rows 2n, 2n + 1: SWIGLUOAI): one [2 * BLOCK_N] weight tile
    ACT = 3  # a non-gated activation on the tile (the *_NO_MUL activations)
    GATED_JOINT = 4  # gate / up halves as one [2 * BLOCK_N] weight tile (the N tile's gate rows, then its up rows)

    @property
    def halves(self) -> bool:
        """Gate and up as the two halves of the weight rows (``UP_OFF`` = the output columns ``I``)."""
        return self in (Fusion.GATED, Fusion.GATED_JOINT)

    @property
    def wide(self) -> bool:
        """One weight tile of ``2 * BLOCK_N`` rows (gate and up in one MMA chain)."""
        return self in (Fusion.INTERLEAVED, Fusion.GATED_JOINT)


class ScaleMode(enum.IntEnum):
    """How an operand's scales are laid out: ``fused_moe_kernel``'s ``A_SCALE`` / ``B_SCALE`` constexprs."""

    NONE = 0  # unquantized
    TENSOR = 1  # A: one scalar; W: one per expert
    ROW = 2  # A: one per row (token); W: one per expert and output channel
    GROUP = 3  # A: one per row and GROUP_K group of K; W: one per GROUP_N x GROUP_K block
    TENSOR_SLOTS = 4  # A only: in the act dtype, quantized on load with a dynamic per-tensor scale (amax slots)


@dataclass(frozen=True)
class GemmOperands:
    """The tensors of one grouped GEMM (device tensors; the kernels read their strides).

    ``a``: ``(rows of A, K)``, the hidden states (gathered by route) or GEMM1's sorted output (FP8 codes may come
    as uint8); ``w``: ``(E, NW, K)`` weights (codes when quantized); ``c``: the output, ``(rows, n_out)`` by sorted
    position or ``(routes, n_out)`` by route; ``cs``: ``c``'s fp32 row-group scales when the epilogue quantizes
    (``GemmEpilogue.out_quant``); ``a_scale`` / ``w_scale``: fp32 scales as ``GemmScales``' modes lay them out;
    ``bias``: ``(E, NW)`` or None.
    """

    a: torch.Tensor
    w: torch.Tensor
    c: torch.Tensor
    cs: torch.Tensor | None = None
    a_scale: torch.Tensor | None = None
    w_scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None


@dataclass(frozen=True)
class GemmShape:
    """Which rows and columns one grouped GEMM computes.

    ``layout``: the route layout (its tile list when ``layout.tiles`` is set: ``HALF_TAIL``); ``rows``: its rows
    (``layout_rows``); ``num_valid``: routes (``M * top_k``; larger route ids are padding); ``n_out``: output columns
    (``I`` for a fused GEMM1). ``a_gather``: A row = route // ``top_k`` (GEMM1 reads the hidden states), else the
    sorted position; ``c_sorted``: C row = sorted position (GEMM1), else the route id (GEMM2).
    """

    layout: RouteLayout
    rows: int
    num_valid: int
    top_k: int
    n_out: int
    a_gather: bool
    c_sorted: bool

    @property
    def half_tail(self) -> bool:
        return self.layout.tiles is not None


@dataclass(frozen=True)
class GemmScales:
    """How the operands are quantized: ``a_mode`` / ``b_mode`` (``ScaleMode``), INT8 codes (else FP8 when
    scaled), and the weight block ``(group_n, group_k)`` of ``ScaleMode.GROUP``."""

    a_mode: ScaleMode = ScaleMode.NONE
    b_mode: ScaleMode = ScaleMode.NONE
    int8: bool = False
    group_n: int = 128
    group_k: int = 128


#: ``GemmEpilogue.out_quant``: the per-tensor amax of the output folded into ``cs`` (see ``GemmEpilogue``)
OUT_AMAX = 2
#: ``GemmEpilogue.out_quant``: the per-tensor amax of each output tile in a slot of its own (see ``GemmEpilogue``)
OUT_AMAX_SLOTS = 3


@dataclass(frozen=True)
class GemmEpilogue:
    """What the epilogue does after dequantization and bias: the fused activation (``fuse``; ``act`` its ``ACT``
    code with ``alpha`` / ``beta`` / ``limit`` / ``has_limit`` from :func:`act_params`), the rounding to
    ``act_dtype``, and ``out_quant``: 0 none; 1 (``True``) an FP8 quantization of each row's ``BLOCK_N`` columns
    with the recipe parameters ``rp`` (:func:`recipe_params`) and ``use_ue8m0`` scales (codes in ``c``, scales in
    ``cs``); :data:`OUT_AMAX` (2) the rounded output stored as is, and its routed rows' largest finite magnitude
    and a non-finite flag folded into ``cs`` (``(1, 2)`` fp32, ``[amax, bad]``, zeros before the launch) by
    atomic max: the first pass of a dynamic per-tensor requantization (``act_quant_kernel``'s QMODE 6) done by the
    GEMM that writes the values, ``fused_moe_kernel`` only; :data:`OUT_AMAX_SLOTS` (3) the same amax and flag
    per output tile in ``cs`` of ``(amax_slots(...), 2)`` (no zeros needed), read by a GEMM2 of
    ``ScaleMode.TENSOR_SLOTS``."""

    act_dtype: torch.dtype
    fuse: Fusion = Fusion.NONE
    act: int = 0
    alpha: float = 1.0
    beta: float = 0.0
    limit: float = 0.0
    has_limit: bool = False
    out_quant: int = 0
    rp: dict | None = None
    use_ue8m0: bool = False
