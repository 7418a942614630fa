"""``TritonExperts``: the Triton fused-MoE experts step (Standard activation format), and its functional form.

Pipeline of one call (``run_experts``), for ``M`` tokens, ``topk`` routes each, ``E`` local experts::

    align       align_routes(topk_ids)            -> sorted route ids (blocks of BLOCK_M per expert), expert ids
                  HALF_TAIL: blocks of BLOCK_M / 2 and a tile list (BLOCK_M tiles + one half tile per expert)
    [permute]   PERMUTE_A: permute_rows_kernel     -> a1q (and its row / group scales) in sorted order, so GEMM1
                                                      reads contiguous row tiles (TMA); else GEMM1 gathers rows
    GEMM1       fused_moe_kernel(A = a1q rows gathered by route // topk, W = w1)
                  FUSE_ACT:   gate+up tiles in one program, activation in the epilogue -> C2 (sorted rows, I cols)
                  FUSE_QUANT: + FP8 1x128 requantization in the epilogue (block-FP8)  -> C2 codes + scales
                  otherwise:  plain GEMM -> C1 (sorted rows, N cols); act_quant_kernel -> C2
    [requant]   act_quant_kernel (per-token / per-tensor a2 schemes)                   -> C2 codes + scales
    GEMM2       fused_moe_kernel(A = C2 contiguous sorted rows, W = w2)               -> C3 (route rows, K)
    reduce      moe_sum_kernel: out[t] = sum_k w[t,k] * C3[t*topk+k] over local routes, fp32, one rounding

Rounding points are the reference's (``reference.experts``): GEMM1 output, activation output, GEMM2 output, final
sum, each one RNE rounding to the activation dtype; router weights are applied in fp32 in the final sum (the
reference's order: weight the rounded expert output, sum in fp32, round once). Routes to experts not held here
(``expert_map`` -1, id -1 or out of range) contribute nothing.

Quantization schemes (``FusedMoEQuantConfig`` -> kernel modes, see ``plan_quant``):

=============================  =====================  ===========================================
weights (w1/w2)                activations (a1/a2)    GEMM dequantization
=============================  =====================  ===========================================
bf16 / fp16 / fp32             same                   none (fp32: IEEE fp32 dot)
fp8 per-tensor (per expert)    fp8 per-tensor / token acc * a_s * w_s[e] in the epilogue (*)
fp8 per-channel                fp8 per-token / tensor acc * a_s[row] * w_s[e, n] in the epilogue (*)
fp8 128x128 blocks             fp8 1x128 dynamic      per K tile: dot * a_s[row, kb] * w_s[e, nb, kb]
int8 per-channel               int8 per-token         int32 acc * a_s[row] * w_s[e, n]
=============================  =====================  ===========================================

(*) ``acc``: the FP8 MMA accumulator promoted into an fp32 accumulator every ``PROMOTE_K`` K elements (config key,
default 256; :func:`promotion_tiles`); ``FAST_ACCUM=1`` (opt-in, never in a table) accumulates in place instead.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace

import torch
import triton.language as tl

from backends._declined import MICROSCALING_DECLINED
from backends._validation import check_topk_ids_range
from reference.activation import MoEActivation, adjust_N_for_activation
from reference.config import FUSED_MOE_UNQUANTIZED_CONFIG, FusedMoEQuantConfig
from reference.modular import ACTIVATION_PARAMS, FusedMoEActivationFormat, FusedMoEExpertsModular, SupportRecord, \
    TopKWeightAndReduceNoOP
from reference.quant import keys as K

from . import configs as _configs
from .host import (
    INTERPRET,
    OUT_AMAX,
    OUT_AMAX_SLOTS,
    STEP_PDL,
    SUPPORTED_ACTIVATIONS,
    Fusion,
    GemmEpilogue,
    GemmOperands,
    GemmScales,
    GemmShape,
    ScaleMode,
    act_params,
    activation_code,
    cdiv,
    check_device,
    fp8_capable,
    next_pow2,
    recipe_params,
    round_up,
)
from .align import RouteLayout, align_routes, max_num_tokens_padded
from .kernels import (
    QMODE_FP8_GROUP,
    QMODE_FP8_STATIC,
    QMODE_FP8_TENSOR_AMAX,
    QMODE_FP8_TENSOR_QUANT,
    QMODE_FP8_TOKEN,
    QMODE_INT8_STATIC,
    QMODE_INT8_TOKEN,
    QMODE_NONE,
    fused_moe_kernel,
    moe_sum_kernel,
    permute_rows_kernel,
)
from .jit import FP_FUSION
from .quant import launch_act_quant as _launch_act_quant
from .quant import quantize_activation

__all__ = ["TritonExperts", "fused_experts", "run_experts", "plan_quant", "QuantPlan", "quantize_activation",
           "layout_rows", "layout_block", "route_layout", "step_layout", "promotion_tiles"]

_FP8 = torch.float8_e4m3fn
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_GATED_HALVES = {MoEActivation.SILU, MoEActivation.GELU, MoEActivation.GELU_TANH,
                 MoEActivation.SWIGLUOAI_UNINTERLEAVE, MoEActivation.SWIGLUSTEP}

# Diagnostics switches (environment): MOE_TRITON_BSCALAR=0 loads 128x128 weight scales per column instead of one
# scalar per K tile. "strict": see strict_kernels.
FLAGS = {"b_scalar": os.environ.get("MOE_TRITON_BSCALAR", "1") != "0", "strict": False}


@contextlib.contextmanager
def strict_kernels():
    """Within the block, a ``GLUON`` / ``PINGPONG`` / ``COOPERATIVE`` GEMM its Gluon kernel does not cover raises
    ``ValueError`` with the reason instead of running on ``fused_moe_kernel`` (``FLAGS["strict"]``)."""
    saved, FLAGS["strict"] = FLAGS["strict"], True
    try:
        yield
    finally:
        FLAGS["strict"] = saved


# --------------------------------------------------------------------------------------------------------------
# quantization plan
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantPlan:
    """What the kernels do for one ``FusedMoEQuantConfig``.

    ``a1_mode``: A_SCALE of GEMM1 (how ``a1q_scale`` is laid out); ``b_mode``: B_SCALE of both GEMMs;
    ``a2_qmode``: the act_quant mode that produces GEMM2's input (None: unquantized); ``a2_mode``: A_SCALE of GEMM2;
    ``a1_qmode``: the mode ``quantize_activation`` uses for a1; ``cfg_dtype``: the config tables' dtype tag.
    """

    kind: str  # "none" | "fp8" | "int8"
    a1_mode: ScaleMode
    b_mode: ScaleMode
    a2_mode: ScaleMode
    a1_qmode: int | None
    a2_qmode: int | None
    block_shape: tuple[int, int] | None
    group_k: int
    cfg_dtype: str | None
    recipe: object
    use_ue8m0: bool


def plan_quant(qc: FusedMoEQuantConfig) -> QuantPlan:
    """Resolve a quant config into kernel modes.

    Raises:
        NotImplementedError: a format the triton backend does not implement (MX, NVFP4, INT4, mixed precisions,
            dynamic per-tensor INT8 activations, static per-token activation scales).
        ValueError: inconsistent descriptors (e.g. block weights without 1xbk activation groups).
    """
    w1, w2, a1, a2 = qc.w1, qc.w2, qc.a1, qc.a2
    if w1.dtype is None and w2.dtype is None and a1.dtype is None and a2.dtype is None:
        return QuantPlan("none", ScaleMode.NONE, ScaleMode.NONE, ScaleMode.NONE, None, None, None, 128, None,
                         qc.recipe, False)
    dts = {w1.dtype, w2.dtype, a1.dtype, a2.dtype}
    if len(dts) != 1 or next(iter(dts)) not in (_FP8, torch.int8):
        raise NotImplementedError(
            f"triton backend: quantization {w1.dtype}/{w2.dtype} weights x {a1.dtype}/{a2.dtype} activations is not "
            "implemented (supported: fp8 e4m3 W8A8 per-tensor/per-channel/128x128-block, int8 W8A8 per-channel)")
    dt = next(iter(dts))
    if w1.shape != w2.shape or a1.shape != a2.shape:
        raise NotImplementedError("triton backend: w1/w2 (and a1/a2) must use the same quantization group shape")
    ws = w1.shape or (-1, -1)
    acts = a1.shape or (-1, -1)
    block = None
    if ws[0] > 1 and ws[1] > 1:
        if dt != _FP8:
            raise NotImplementedError("triton backend: block-quantized weights are implemented for fp8 only")
        if acts != (1, ws[1]):
            raise ValueError(f"block weights {ws} need 1x{ws[1]} dynamic activation groups, got {acts}")
        if a1.scale is not None or a2.scale is not None:
            raise NotImplementedError("triton backend: static activation scales with block weights")
        block = (int(ws[0]), int(ws[1]))
        return QuantPlan("fp8", ScaleMode.GROUP, ScaleMode.GROUP, ScaleMode.GROUP, QMODE_FP8_GROUP, QMODE_FP8_GROUP,
                         block, block[1], "fp8_w8a8", qc.recipe, bool(qc.use_ue8m0))
    if ws == (1, -1):
        b_mode = ScaleMode.ROW  # per output channel
    elif ws == (-1, -1):
        b_mode = ScaleMode.TENSOR
    else:
        raise NotImplementedError(f"triton backend: weight group shape {ws} is not implemented")

    def act_modes(desc, which):
        shape = desc.shape or (-1, -1)
        if shape == (1, -1):
            if desc.scale is not None:
                raise NotImplementedError(f"triton backend: static per-token {which} scales")
            return ScaleMode.ROW, (QMODE_FP8_TOKEN if dt == _FP8 else QMODE_INT8_TOKEN)
        if shape == (-1, -1):
            if desc.scale is not None:
                return ScaleMode.TENSOR, (QMODE_FP8_STATIC if dt == _FP8 else QMODE_INT8_STATIC)
            if dt == torch.int8:
                raise NotImplementedError(f"triton backend: dynamic per-tensor int8 {which} quantization "
                                          "(the reference does not define it either)")
            return ScaleMode.TENSOR if which == "a1" else ScaleMode.ROW, QMODE_FP8_TENSOR_AMAX
        raise NotImplementedError(f"triton backend: {which} group shape {shape} is not implemented")

    a1_mode, a1_q = act_modes(a1, "a1")
    a2_mode, a2_q = act_modes(a2, "a2")
    return QuantPlan("fp8" if dt == _FP8 else "int8", a1_mode, b_mode, a2_mode, a1_q, a2_q, None, 128,
                     "fp8_w8a8" if dt == _FP8 else "int8_w8a8", qc.recipe, bool(qc.use_ue8m0))


# --------------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------------


def layout_rows(numel: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted route layout (and of the intermediate buffers): ``max_num_tokens_padded`` rounded up to
    ``block_m`` so that no tile reads past the end."""
    return round_up(max(max_num_tokens_padded(numel, num_experts, block_m), 1), block_m)


def layout_block(cfg: dict) -> int:
    """The route layout's block (rows each expert is padded to) for a config: ``BLOCK_SIZE_M``, or half of it with
    ``HALF_TAIL`` (tiles of ``BLOCK_SIZE_M`` rows plus one ``BLOCK_SIZE_M / 2`` tail tile per expert)."""
    g1 = cfg["gemm1"]
    return g1["BLOCK_SIZE_M"] // 2 if g1.get("HALF_TAIL", 0) else g1["BLOCK_SIZE_M"]


def gemm2_on_half_blocks(cfg: dict) -> bool:
    """Whether GEMM2 runs the layout's half blocks instead of its tile list: GEMM1 has ``HALF_TAIL`` and GEMM2's
    ``BLOCK_SIZE_M`` is the layout's block, half of GEMM1's (``configs.sanitize_config`` allows no other mismatch)."""
    g1 = cfg["gemm1"]
    return bool(g1.get("HALF_TAIL", 0)) and cfg["gemm2"]["BLOCK_SIZE_M"] == layout_block(cfg)


def requantizes_in_epilogue(g1: dict, plan: QuantPlan, I: int) -> bool:
    """Whether GEMM1 of table entry ``g1`` (activation fused, ``FUSE_ACT``) requantizes its output to 1 x group FP8
    in its epilogue (``FUSE_QUANT`` with tiles of one whole group), so that no ``act_quant_kernel`` runs between
    the GEMMs."""
    return bool(g1.get("FUSE_ACT", 1) and plan.a2_qmode == QMODE_FP8_GROUP and g1.get("FUSE_QUANT", 1)
                and g1["BLOCK_SIZE_N"] == plan.group_k and I % plan.group_k == 0)


#: decode without a route layout (``RouteLayout.route_tiles``): up to this many routes (and no more than the local
#: experts), each route its own row tile read from ``topk_ids`` by the GEMMs, so the step has no layout kernel.
#: On (16): on an H200 it takes 2.4-4 us off every M = 1 step (docs/notes/gpu-sessions.md, fourteenth session, call
#: 1); ``MOE_TRITON_ROUTE_TILES=0`` turns it off for an A / B
ROUTE_TILES_MAX = int(os.environ.get("MOE_TRITON_ROUTE_TILES", "16"))


def route_tiles_apply(cfg: dict, numel: int, E: int, stages: str, taps) -> bool:
    """Whether this call runs without a route layout (see ``ROUTE_TILES_MAX``): the whole step, few routes (at most
    one per local expert, so the layout's row count ``M * topk * BLOCK_M`` holds them), both GEMMs on
    ``fused_moe_kernel`` without ``PERMUTE_A`` / ``HALF_TAIL``, no taps."""
    g1, g2 = cfg["gemm1"], cfg["gemm2"]
    return (0 < numel <= min(ROUTE_TILES_MAX, E) and stages == "all" and taps is None
            and not any(g.get(k, 0) for g in (g1, g2) for k in GLUON_KEYS + ("PERMUTE_A", "HALF_TAIL")))


def route_tiles_layout(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_ids: int) -> RouteLayout:
    """The layout of a call without one (``RouteLayout.route_tiles``): no kernel, views of ``topk_ids`` (int32 /
    int64, contiguous) and of ``expert_map`` (int32 or None), and the route -> local expert buffer GEMM1 fills."""
    flat = topk_ids.reshape(-1)
    return RouteLayout(flat, expert_map if expert_map is not None else flat, flat,
                       torch.empty(flat.numel(), dtype=torch.int32, device=flat.device),
                       route_tiles=2 if expert_map is not None else 1, num_ids=num_ids)


def _ids_and_map(topk_ids: torch.Tensor, expert_map: torch.Tensor | None):
    """``topk_ids`` as the layout kernels read them (contiguous int32 / int64) and ``expert_map`` as int32."""
    ids = topk_ids if topk_ids.is_contiguous() and topk_ids.dtype in (torch.int32, torch.int64) \
        else topk_ids.contiguous().to(torch.int32)
    emap = expert_map.to(torch.int32).contiguous() if expert_map is not None and expert_map.dtype != torch.int32 \
        else expert_map
    return ids, emap


def step_layout(topk_ids: torch.Tensor, cfg: dict, num_experts: int, expert_map: torch.Tensor | None = None,
                num_ids: int | None = None) -> RouteLayout:
    """The layout the whole step (``run_experts(stages="all")``) runs this call on: :func:`route_tiles_layout` where
    :func:`route_tiles_apply` (decode), else :func:`route_layout`. What the benchmark's ``gemms`` variant and the
    tuners pass to ``run_experts``, so that they time the kernels the step launches (the layout itself made
    outside the timed call, as vLLM's ``moe_align_block_size`` is for its timed GEMMs). Same arguments as
    :func:`route_layout` (ids of another integer dtype or not contiguous, and a map not int32, are converted as
    ``run_experts`` converts them).

    Raises:
        ValueError: an ``expert_map`` without ``num_ids`` (its length: the global id space).
    """
    if expert_map is not None and num_ids is None:
        raise ValueError("step_layout: pass num_ids (len(expert_map), the global id space) with an expert_map; "
                         "without it, global ids >= the local expert count would be dropped")
    num_ids = num_experts if num_ids is None else num_ids
    ids, emap = _ids_and_map(topk_ids, expert_map)
    if route_tiles_apply(cfg, ids.numel(), num_experts, "all", None):
        return route_tiles_layout(ids, emap, num_ids)
    return route_layout(ids, cfg, num_experts, emap, num_ids)


def route_layout(topk_ids: torch.Tensor, cfg: dict, num_experts: int, expert_map: torch.Tensor | None = None,
                 num_ids: int | None = None, pdl: bool = False) -> RouteLayout:
    """``align_routes`` for this config (block :func:`layout_block`, tile list with ``HALF_TAIL``); ids must be
    int32/int64 and contiguous, ``expert_map`` int32 or None; ``pdl``: launched to overlap the input quantizer
    before it (``host.STEP_PDL``)."""
    bs = layout_block(cfg)
    rows = layout_rows(topk_ids.numel(), num_experts, bs)
    return align_routes(topk_ids, bs, num_experts, expert_map, num_experts if num_ids is None else num_ids, rows,
                        tiles=bool(cfg["gemm1"].get("HALF_TAIL", 0)), pdl=pdl)


def _fusion(activation: MoEActivation) -> Fusion:
    """GEMM1's epilogue fusion for ``activation`` (``GATED`` may become ``GATED_JOINT`` per table entry)."""
    if activation is MoEActivation.SWIGLUOAI:
        return Fusion.INTERLEAVED
    if activation in _GATED_HALVES:
        return Fusion.GATED
    return Fusion.ACT


def _bytes_region(ws: torch.Tensor | None, nbytes: int, device) -> torch.Tensor:
    """A flat uint8 view of ``ws`` if it is contiguous and large enough, else a fresh allocation."""
    if ws is not None and ws.is_contiguous() and ws.numel() * ws.element_size() >= nbytes:
        return ws.reshape(-1).view(torch.uint8)[:nbytes]
    return torch.empty(max(nbytes, 16), dtype=torch.uint8, device=device)


def _view(buf: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    return buf[offset:offset + nbytes].view(dtype).view(shape)


def _scale_strides(s: torch.Tensor | None, mode: int, E: int, nw: int):
    """``(tensor, stride_e, stride_n, stride_k)`` for a weight scale in mode 1 (per expert), 2 (per channel), 3."""
    if mode == ScaleMode.NONE or s is None:
        if mode != ScaleMode.NONE:
            raise ValueError("quantized weights need weight scales (quant_config.w1_scale / w2_scale)")
        return None, 0, 0, 0
    s = s.to(torch.float32)
    if mode == ScaleMode.TENSOR:
        if s.numel() == 1:
            return s.reshape(1), 0, 0, 0
        if s.numel() != E:
            raise ValueError(f"per-tensor weight scales must have 1 or E={E} elements, got {tuple(s.shape)}")
        s = s.reshape(E).contiguous()
        return s, 1, 0, 0
    if mode == ScaleMode.ROW:
        if s.numel() != E * nw:
            raise ValueError(f"per-channel weight scales must have E*N={E}*{nw} elements, got {tuple(s.shape)}")
        s = s.reshape(E, nw)
        return s, s.stride(0), s.stride(1), 0
    if s.dim() != 3 or s.size(0) != E:
        raise ValueError(f"block weight scales must be (E, N/bn, K/bk), got {tuple(s.shape)}")
    return s, s.stride(0), s.stride(1), s.stride(2)


def _tma_ok(t: torch.Tensor, inner: int) -> bool:
    return (t.is_contiguous() and t.data_ptr() % 16 == 0 and (inner * t.element_size()) % 16 == 0)


def _descriptor(t2d: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t2d, block)


def _permute_rows(src: torch.Tensor, sorted_ids, ntpp, rows: int, num_valid: int, top_k: int) -> torch.Tensor:
    """``(rows, C)`` copy of ``src (M, C)`` in the route layout's sorted order (``permute_rows_kernel``)."""
    src = src if src.dtype != _FP8 else src.view(torch.uint8)
    dst = torch.empty((rows, src.shape[1]), dtype=src.dtype, device=src.device)
    bc = min(512, next_pow2(src.shape[1]))
    permute_rows_kernel[(cdiv(rows, 8), cdiv(src.shape[1], bc))](
        src, dst, sorted_ids, ntpp, num_valid, src.shape[1], src.stride(0), dst.stride(0),
        TOP_K=top_k, BLOCK_R=8, BLOCK_C=bc, num_warps=4)
    return dst


GLUON_KEYS = ("GLUON", "PINGPONG", "COOPERATIVE")  # table keys that put a GEMM on a Gluon kernel


_SCRATCH: dict = {}
_RETIRED_SCRATCH: list = []


def split_k_scratch(dev: torch.device, slots: int, slot_floats: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``SPLIT_K``'s workspaces on ``dev``: ``(partials, counters)``, at least ``slots * slot_floats`` fp32 and
    ``slots`` int32 zeros. One pair per device, grown on demand: every launch leaves the counters zero again, so
    they are zeroed once, at allocation (eager or replayed from a CUDA graph alike). Shared by the calls on that
    device as vLLM shares its MoE workspaces: two experts steps running concurrently on two streams of one device
    must not both use ``SPLIT_K``. A buffer replaced by a larger one is kept alive (a CUDA graph captured earlier
    may still use it).

    Raises:
        RuntimeError: the buffers must grow while a CUDA graph is being captured (an allocation captured into the
            graph's pool would not be zeroed outside it): run the step once eagerly first, as a capture's warm-up
            does.
    """
    key = str(dev) if dev.index is not None or dev.type != "cuda" else f"cuda:{torch.cuda.current_device()}"
    part, cnt = _SCRATCH.get(key, (None, None))
    if part is None or part.numel() < slots * slot_floats or cnt.numel() < slots:
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("SPLIT_K's workspaces must grow during CUDA-graph capture: run the experts step once "
                               "eagerly with this batch size before capturing it")
        if part is not None:
            _RETIRED_SCRATCH.append((part, cnt))
        part = torch.empty(max(slots * slot_floats, 1 << 16), dtype=torch.float32, device=dev)
        cnt = torch.zeros(max(slots, 1 << 12), dtype=torch.int32, device=dev)
        _SCRATCH[key] = (part, cnt)
    return part, cnt


def promotion_tiles(cfg: dict, *, a_mode: int, int8: bool = False) -> int:
    """``fused_moe_kernel``'s ``PROMOTE`` for one GEMM of launch config ``cfg`` (a ``gemm1`` / ``gemm2`` entry): the
    K tiles an FP8 per-tensor / per-channel GEMM (``a_mode`` 1, 2 or 4, not INT8) accumulates in the MMA accumulator
    before adding it to the fp32 accumulator, ``PROMOTE_K // BLOCK_SIZE_K`` (``PROMOTE_K`` K elements per
    interval, default ``configs.DEFAULT_PROMOTE_K`` = 256; DeepGEMM and CUTLASS promote every 128). 0 = in place:
    every other GEMM (bf16 / fp16 / fp32; block FP8, promoted per K tile with its scales; INT8, exact in int32),
    and the ``FAST_ACCUM`` opt-in (vLLM's ``fused_moe_kernel`` form, the FP8 accumulator's ~14 mantissa bits over
    the whole K; never in a committed table).

    Raises:
        ValueError: ``BLOCK_SIZE_K > PROMOTE_K`` for such a GEMM (one K tile would already exceed the interval).
    """
    if int8 or a_mode not in (ScaleMode.TENSOR, ScaleMode.ROW, ScaleMode.TENSOR_SLOTS) or cfg.get("FAST_ACCUM", 0):
        return 0
    pk, bk = cfg.get("PROMOTE_K", _configs.DEFAULT_PROMOTE_K), cfg["BLOCK_SIZE_K"]
    if bk > pk:
        raise ValueError(f"BLOCK_SIZE_K={bk} exceeds the FP8 promotion interval PROMOTE_K={pk}: one K tile would be "
                         "accumulated in the FP8 MMA accumulator beyond it (lower BLOCK_SIZE_K, or opt into "
                         "FAST_ACCUM=1)")
    return pk // bk


def _gluon_module(name: str):
    """``backends.triton.<name>`` (a Gluon kernel module), or None on a Triton without Gluon's Hopper API."""
    import importlib

    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError:
        return None


def amax_slots(cfg: dict, shape: GemmShape) -> tuple[int, int]:
    """The amax slots ``fused_moe_kernel`` writes with ``OUT_AMAX_SLOTS`` for one GEMM of launch config ``cfg`` over
    ``shape``, as ``(row tiles, N tiles per row tile)``: one slot per tile, the N tiles of a row tile counted in
    whole groups of ``N_TILES`` (wrapped ones included)."""
    BM, BN, n_tiles = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg.get("N_TILES", 1)
    num_pid_m = shape.layout.tiles.numel() if shape.half_tail else cdiv(shape.rows, BM)
    return num_pid_m, cdiv(cdiv(shape.n_out, BN), n_tiles) * n_tiles


def _gluon_key(cfg: dict) -> str | None:
    """The Gluon kernel module one GEMM's table entry names: ``gluon_sm90`` (``GLUON``), ``gluon_ws`` (``PINGPONG`` /
    ``COOPERATIVE``), or None (``fused_moe_kernel``)."""
    if cfg.get("GLUON", 0):
        return "gluon_sm90"
    return "gluon_ws" if cfg.get("PINGPONG", 0) or cfg.get("COOPERATIVE", 0) else None


def _gemm_gluon(ops: GemmOperands, shape: GemmShape, scales: GemmScales, epi: GemmEpilogue, cfg: dict):
    """The Gluon kernel module (``gluon_sm90`` / ``gluon_ws``) that :func:`launch_gemm` runs this GEMM on, or None
    for ``fused_moe_kernel`` (no Gluon key, the interpreter, a Triton without Gluon, or a GEMM the kernel does not
    cover).

    Raises:
        ValueError: under :func:`strict_kernels`, a Gluon key whose kernel does not cover this GEMM."""
    special = _gluon_key(cfg)
    if special is None or INTERPRET:
        return None
    mod = _gluon_module(special)
    why = f"{special} needs Gluon's Hopper API, which this Triton lacks" if mod is None else mod.supported(
        ops, shape, scales, epi, cfg)
    if why is None:
        return mod
    if FLAGS["strict"]:
        raise ValueError(f"table entry {cfg} is not covered by {special}: {why}")
    return None


def _pack_round(cfg: dict) -> bool:
    """Whether ``fused_moe_kernel``'s gated epilogue rounds gate and up to bf16 two values an instruction
    (``jit.act_rounded``; the same bits either way, tests/test_triton_gpu.py): on the 8-warp tiles only. H200, two
    interleaved rounds (docs/notes/triton.md, twenty-eighth session): the 8-warp 128 x 128 GEMM1s 1.0-1.2% faster
    (Mixtral bf16 M 1024, Qwen3-235B M 4096, gpt-oss M 4096); DeepSeek-V3 TP8's 4-warp 64 x 64 GEMM1s 0.8-1.2% slower
    packed (the pair's operands and widening cost registers and issue slots the smaller epilogue does not win back)."""
    return cfg.get("num_warps", 4) >= 8


def launch_gemm(ops: GemmOperands, shape: GemmShape, scales: GemmScales, epi: GemmEpilogue, cfg: dict, *,
                 pdl_trigger: bool = False, pdl_wait: bool = False):
    """Launch one grouped GEMM: ``fused_moe_kernel`` (see its docstring for the modes), or the Gluon kernel table
    entry ``cfg`` names (``GLUON`` / ``PINGPONG`` / ``COOPERATIVE``) where it covers the GEMM. ``cfg``: one GEMM's
    launch config (a ``gemm1`` / ``gemm2`` entry). ``pdl_trigger`` / ``pdl_wait``: programmatic dependent launch
    (``PDL_TRIGGER`` / ``PDL_WAIT``; ``pdl_wait`` launches with the attribute).

    Raises:
        ValueError: a table entry's mode this GEMM cannot take (``SPLIT_K`` with two MMA chains or INT8, ``SWAP_AB``
            without FP8 scales, ``SPLIT_K`` on a Gluon kernel, or under :func:`strict_kernels` a Gluon kernel that
            does not cover it); bad weight scales (see ``_scale_strides``).
    """
    a, w, c, cs = ops.a, ops.w, ops.c, ops.cs
    layout, fuse, rp = shape.layout, epi.fuse, epi.rp
    E, NW, K = w.shape
    BM, BN, BK = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]
    promote = promotion_tiles(cfg, a_mode=scales.a_mode, int8=scales.int8)
    half_tail = shape.half_tail
    up_off = shape.n_out if fuse.halves else 0
    ws, sbe, sbn, sbk = _scale_strides(ops.w_scale, scales.b_mode, E, NW)
    special = _gluon_key(cfg)
    if special is not None and cfg.get("SPLIT_K", 1) > 1:
        raise ValueError(f"table entry {cfg}: SPLIT_K is a fused_moe_kernel mode, not {special}'s")
    mod = _gemm_gluon(ops, shape, scales, epi, cfg)
    if mod is not None:
        # a Gluon kernel (GLUON: block-FP8 with the scale promotion overlapped; PINGPONG / COOPERATIVE: warp
        # specialized) where it covers this GEMM, else fused_moe_kernel below
        mod.launch(replace(ops, w_scale=ws), shape, scales, epi, cfg, w_strides=(sbe, sbn, sbk))
        return
    if epi.out_quant == OUT_AMAX_SLOTS:
        tiles_m, tiles_n = amax_slots(cfg, shape)
        if cs is None or tuple(cs.shape) != (tiles_m * tiles_n, 2):
            raise ValueError(f"OUT_AMAX_SLOTS needs cs of shape ({tiles_m * tiles_n}, 2), got "
                             f"{None if cs is None else tuple(cs.shape)}")
    swap = bool(cfg.get("SWAP_AB", 0))
    split_k = cfg.get("SPLIT_K", 1)
    if split_k > 1 and (scales.int8 or fuse == Fusion.GATED):
        raise ValueError(f"table entry {cfg}: SPLIT_K is implemented for one MMA chain per program (not "
                         + ("INT8 operands)" if scales.int8
                            else "gate / up halves as two chains: add JOINT_GATE_UP 1)"))
    if swap and (scales.int8 or ScaleMode.NONE in (scales.a_mode, scales.b_mode)):
        raise ValueError(f"table entry {cfg}: SWAP_AB is implemented for FP8 GEMMs only (block, per-tensor or "
                         f"per-channel scales), this GEMM has A_SCALE {int(scales.a_mode)} / B_SCALE "
                         f"{int(scales.b_mode)}" + (" and INT8 operands" if scales.int8 else ""))
    num_a_slots = 0
    if scales.a_mode in (ScaleMode.GROUP, ScaleMode.TENSOR_SLOTS):
        asm, ask = ops.a_scale.stride(0), ops.a_scale.stride(1)
        if scales.a_mode == ScaleMode.TENSOR_SLOTS:
            num_a_slots = ops.a_scale.shape[0]
    elif scales.a_mode == ScaleMode.ROW:
        asm, ask = ops.a_scale.stride(0), 0
    else:
        asm, ask = 0, 0
    use_tma = bool(cfg.get("USE_TMA", 0))
    tma_b = use_tma and _tma_ok(w, K)
    tma_a = use_tma and not shape.a_gather and _tma_ok(a, K)
    bn_load = 2 * BN if fuse.wide else BN
    if tma_b and fuse == Fusion.GATED_JOINT:  # the gate and up halves as one rank-3 box
        b_desc = _descriptor(w.view(E * 2, NW // 2, K), [2, BN, BK])
    else:
        b_desc = _descriptor(w.view(E * NW, K), [bn_load, BK]) if tma_b else None
    a_desc = _descriptor(a, [BM, BK]) if tma_a else None
    a_desc_h = _descriptor(a, [BM // 2, BK]) if tma_a and half_tail else a_desc
    bias = ops.bias
    if bias is not None:
        sbias_e, sbias_n = bias.stride(0), bias.stride(1)
    else:
        sbias_e = sbias_n = 0
    # one block scale per K tile when every tile's rows (and up rows) stay inside one GROUP_N block
    group_n = scales.group_n
    b_scalar = (FLAGS["b_scalar"] and scales.b_mode == ScaleMode.GROUP and fuse != Fusion.GATED_JOINT
                and group_n % bn_load == 0 and (fuse != Fusion.GATED or up_off % group_n == 0)
                and (NW % bn_load == 0))
    # EM: the layout's rows (BLOCK_M-row programs), or (HALF_TAIL) the tile list's length (one program per tile)
    if half_tail:
        em = num_pid_m = layout.tiles.numel()
    else:
        em, num_pid_m = shape.rows, cdiv(shape.rows, BM)
    n_tiles = cfg.get("N_TILES", 1)
    n_groups = cdiv(cdiv(shape.n_out, BN), n_tiles)  # programs per row tile (and split)
    grid = (num_pid_m * n_groups * split_k,)
    part = cnt = None
    if split_k > 1:
        # one slot per (row tile, N tile, wrapped ones included) of the row tiles that can hold routes: those below
        # num_tokens_post_padded, each with at least one route, so at most min(row tiles, routes)
        part, cnt = split_k_scratch(c.device, min(num_pid_m, shape.num_valid) * n_groups * n_tiles,
                                    split_k * BM * bn_load)
    # the kernel's flat argument list, in its groups (see fused_moe_kernel's signature); the enums pass their ints
    fused_moe_kernel[grid](
        # operands, split-K scratch, TMA descriptors
        a, w, c, cs, ops.a_scale, ws, bias, part if part is not None else c, cnt if cnt is not None else c,
        a_desc, a_desc_h, b_desc,
        # route layout
        layout.sorted_token_ids, layout.expert_ids, layout.num_tokens_post_padded,
        layout.tiles if half_tail else layout.expert_ids, layout.num_tiles if half_tail else layout.expert_ids,
        # sizes
        shape.n_out, K, em, shape.num_valid, up_off, NW, num_a_slots,
        # strides
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1),
        asm, ask, sbe, sbn, sbk, sbias_e, sbias_n,
        cs.stride(0) if cs is not None else 0, cs.stride(1) if cs is not None else 0,
        # epilogue scalars
        epi.alpha, epi.beta, epi.limit,
        rp["amax_floor"] if rp else 0.0, rp["ue8m0_floor"] if rp else 0.0,
        # constexprs: tiling and scheduling
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=cfg.get("GROUP_SIZE_M", 1), HALF_TAIL=half_tail,
        N_TILES=n_tiles, FLATTEN=bool(cfg.get("FLATTEN", 0)), SPLIT_K=split_k,
        # rows
        TOP_K=shape.top_k, A_GATHER=shape.a_gather, C_SORTED=shape.c_sorted,
        # operands and accumulation
        A_SCALE=int(scales.a_mode), B_SCALE=int(scales.b_mode), B_SCALAR=b_scalar, GROUP_N=group_n,
        GROUP_K=scales.group_k, INT8=scales.int8, PROMOTE=promote, SWAP_AB=swap,
        DOT_PREC="ieee" if epi.act_dtype == torch.float32 else "tf32",
        EVEN_K=K % BK == 0, TMA_A=tma_a, TMA_B=tma_b, EMU=INTERPRET,
        # epilogue
        HAS_BIAS=bias is not None, FUSE=int(fuse), ACT=epi.act, HAS_LIMIT=epi.has_limit,
        ACT_DT=_TL_DTYPES[epi.act_dtype], OUT_QUANT=epi.out_quant, USE_UE8M0=epi.use_ue8m0,
        UE8M0_EXACT=rp["UE8M0_EXACT"] if rp else False, SCALE_INV=rp["SCALE_INV"] if rp else False,
        RECIP_MUL=rp["RECIP_MUL"] if rp else False,
        # programmatic dependent launch
        PDL_TRIGGER=pdl_trigger, PDL_WAIT=pdl_wait, PACK_ROUND=_pack_round(cfg),
        **({"local_ptr": layout.local_ids, "num_ids": layout.num_ids, "ROUTE_TILES": layout.route_tiles}
           if layout.route_tiles else {}),
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3), **FP_FUSION,
        **({"launch_pdl": True} if pdl_wait else {}),
    )


# --------------------------------------------------------------------------------------------------------------
# the experts step
# --------------------------------------------------------------------------------------------------------------


def run_experts(*, out: torch.Tensor, a1q: torch.Tensor, a1q_scale: torch.Tensor | None, w1: torch.Tensor,
                w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: MoEActivation,
                expert_map: torch.Tensor | None, num_ids: int, qc: FusedMoEQuantConfig, plan: QuantPlan,
                cfg: dict, ws13: torch.Tensor | None = None, ws2: torch.Tensor | None = None,
                apply_router_weight_on_input: bool = False, a2_scale: torch.Tensor | None = None,
                layout: RouteLayout | None = None, stages: str = "all", taps: dict | None = None) -> torch.Tensor:
    """The experts step on already-quantized input: writes ``out (M, K)`` (activation dtype) and returns it.

    ``layout``: a precomputed :func:`step_layout` (or :func:`route_layout`) for this ``topk_ids`` and ``cfg``
    (benchmarks, tuners);
    ``stages``: ``"all"``; ``"gemms"`` = GEMM1 (+ activation / requantization) and GEMM2 only; ``"gemm1"`` /
    ``"gemm2"`` = one of them (the tuner; with explicit workspaces so GEMM2 reads what GEMM1 left).
    ``taps``: a dict that receives the intermediates this launch path materializes, as ``(M, topk, cols)`` tensors
    in the activation dtype (zeros for routes not held here), for the conformance diagnosis
    (:meth:`TritonExperts.stages`): ``"gemm1"`` (unfused GEMM1 output), ``"activation"`` (the activation output in
    the act dtype, when it is materialized unquantized: not where GEMM1's epilogue quantizes, nor on the unfused
    quantized path, whose act_quant kernel applies it on the way to the codes) and ``"gemm2"`` (GEMM2's output per
    route, before the router weights). Costs copies and a device-to-host read per tap: never on a hot path.

    Args:
        a1q: ``(M, K)`` input (bf16/fp16/fp32, or fp8/int8 codes per ``plan``); a1q_scale its scales.
        w1 ``(E, N, K)``, w2 ``(E, K, I)``: local experts (codes when quantized; scales in ``qc``).
        topk_weights ``(M, topk)`` fp32, topk_ids ``(M, topk)`` int: global ids (mapped by ``expert_map``).
        num_ids: ids outside ``[0, num_ids)`` are dropped (``len(expert_map)`` or E).
        cfg: ``configs.get_config(...)`` result. ws13 / ws2: optional workspaces (see ``TritonExperts``).
    """
    M, K = a1q.shape
    E, NW1, K1 = w1.shape
    I = w2.shape[2]
    topk = topk_ids.shape[1]
    numel = M * topk
    act_dtype = out.dtype
    dev = a1q.device
    if M == 0:
        return out
    g1, g2 = cfg["gemm1"], cfg["gemm2"]
    BM = layout_block(cfg)  # the layout's block: BLOCK_SIZE_M, or half of it with HALF_TAIL
    rows = layout_rows(numel, E, BM)
    if layout is None:
        ids, emap = _ids_and_map(topk_ids, expert_map)
        if route_tiles_apply(cfg, numel, E, stages, taps):
            # decode: no layout kernel; each route its own row tile (RouteLayout.route_tiles)
            layout = route_tiles_layout(ids, emap, num_ids)
        else:
            layout = route_layout(ids, cfg, E, emap, num_ids, pdl=STEP_PDL and stages == "all")
    sorted_ids, expert_ids, ntpp, local = layout[:4]

    act = activation_code(activation)
    alpha, beta, limit, has_limit = act_params(activation, qc.gemm1_alpha, qc.gemm1_beta, qc.gemm1_clamp_limit)
    fuse = _fusion(activation) if g1.get("FUSE_ACT", 1) else Fusion.NONE
    if fuse == Fusion.GATED and (g1.get("JOINT_GATE_UP", 0) or promotion_tiles(g1, a_mode=plan.a1_mode,
                                                                                int8=plan.kind == "int8") > 1):
        # gate and up rows of an N tile as one weight tile (one MMA chain of 2 * BLOCK_N columns). Always so for an
        # FP8 GEMM1 promoted every few K tiles: with two partial chains (gate, up) ptxas serializes every wgmma of
        # the loop (sm_90 SASS: a wait for zero groups after each QGMMA), with one it keeps a group in flight
        fuse = Fusion.GATED_JOINT
    # act_quant_kernel's SPLIT (how it reads gate / up when GEMM1 does not fuse the activation)
    split = {Fusion.GATED: 1, Fusion.INTERLEAVED: 2, Fusion.ACT: 0}[_fusion(activation)]
    quant = plan.kind != "none"
    int8 = plan.kind == "int8"
    rp = recipe_params(plan.recipe) if quant else None
    group = plan.group_k
    G2 = cdiv(I, group)
    a2q_dtype = torch.int8 if int8 else (_FP8 if quant else act_dtype)
    elt = torch.empty((), dtype=act_dtype).element_size()
    out_quant = requantizes_in_epilogue(g1, plan, I)
    # PDL (gemm2 entry key): GEMM2 (and the requantization between the GEMMs) are launched during GEMM1's last wave
    # and wait for its output (programmatic dependent launch); fused_moe_kernel on both GEMMs only, and not around
    # the two-pass per-tensor requantization
    on_fused_kernel = not any(g.get(k, 0) for g in (g1, g2) for k in GLUON_KEYS)
    # AMAX_EPILOGUE 2: the dynamic per-tensor requantization without a kernel between the GEMMs (GEMM1's tiles
    # store their amax in slots, GEMM2 quantizes its A tiles as it loads them)
    # (AMAX_EPILOGUE 3 also with GEMM1 on gluon_ws, whose consumers write slots of their own)
    amax_epi = g1.get("AMAX_EPILOGUE", 0) if plan.a2_qmode == QMODE_FP8_TENSOR_AMAX and bool(fuse) else 0
    if _gluon_key(g1) not in (None, "gluon_ws" if amax_epi == 3 else None):
        amax_epi = 0
    quant_on_load = amax_epi == 2 and on_fused_kernel
    # AMAX_EPILOGUE 3: GEMM1's tiles store their amax in slots, and the requantization kernel reduces them (one
    # pass, no atomics)
    slots_pass = amax_epi == 3
    pdl = bool(g2.get("PDL", 0)) and not INTERPRET and stages in ("all", "gemms") and (
        plan.a2_qmode != QMODE_FP8_TENSOR_AMAX or quant_on_load or slots_pass) and on_fused_kernel
    if plan.a2_qmode == QMODE_FP8_GROUP and I % group:
        raise ValueError(f"block-FP8 requantization needs I % {group} == 0, got I = {I}")

    gemm_rows = dict(layout=layout, rows=rows, num_valid=numel, top_k=topk)
    # ---- ws13: GEMM2's input (C2 codes + scales, or C2 in act dtype; with quant_on_load GEMM1's output in the act
    # dtype and its amax slots, (tiles, 2) fp32 stored as [amax..., flags...])
    c2_bytes = rows * I * (elt if quant_on_load or not quant else 1)
    s_off = round_up(c2_bytes, 16)
    tiles_m, tiles_n = amax_slots(g1, GemmShape(n_out=I, a_gather=True, c_sorted=True, **gemm_rows)) \
        if quant_on_load or slots_pass else (0, 0)
    # (GEMM1 on gluon_ws writes two slots per program, at most twice its tiles: the region holds that many)
    n_slots = 2 * tiles_m * tiles_n * (2 if slots_pass and _gluon_key(g1) == "gluon_ws" else 1)
    s_cols = G2 if plan.a2_qmode == QMODE_FP8_GROUP else 1
    # the slots: in C2's scales' place (quant_on_load: GEMM2 reads them), or after them (slots_pass)
    slot_off = s_off if quant_on_load else round_up(s_off + rows * s_cols * 4, 16)
    buf13 = _bytes_region(ws13, max(s_off + rows * s_cols * 4, slot_off + n_slots * 4), dev)
    c2 = _view(buf13, 0, (rows, I), act_dtype if quant_on_load or not quant else a2q_dtype)
    c2s = _view(buf13, s_off, (rows, s_cols), torch.float32) if quant else None
    slots = _view(buf13, slot_off, (2, tiles_m * tiles_n), torch.float32).t() if n_slots else None
    # ---- ws2: C1 (unfused GEMM1 output) or the pre-quant C2, then C3 (GEMM2 output by route)
    c1_cols = 0 if fuse and (out_quant or not quant or quant_on_load) else (I if fuse else NW1)
    buf2 = _bytes_region(ws2, max(rows * c1_cols, numel * K) * elt, dev)
    c3 = _view(buf2, 0, (numel, K), act_dtype)

    w1_bias, w2_bias = qc.w1_bias, qc.w2_bias
    # rp / use_ue8m0 go to both GEMMs (the kernel reads them only with out_quant)
    epi_quant = dict(act_dtype=act_dtype, rp=rp, use_ue8m0=plan.use_ue8m0)
    group_n = plan.block_shape[0] if plan.block_shape else 128
    scales1 = GemmScales(a_mode=plan.a1_mode, b_mode=plan.b_mode, int8=int8, group_n=group_n, group_k=group)
    epi1 = GemmEpilogue(fuse=fuse, act=act, alpha=alpha, beta=beta, limit=limit, has_limit=has_limit, **epi_quant)
    c2_view = c2.view(torch.uint8) if quant and not int8 and not quant_on_load else c2
    # ROUTE_TILES under STEP_PDL: GEMM1 follows the input quantizer directly (no layout kernel between them), so it
    # is launched with programmatic dependent launch: it reads the router's ids and the map (finished before the
    # quantizer started) beside the quantizer, and waits for it before reading the codes or writing anything
    g1_pdl = bool(layout.route_tiles) and STEP_PDL and stages == "all"
    # ---- GEMM1's A: gathered by route inside the GEMM, or (PERMUTE_A) copied into sorted order first so that GEMM1
    # reads contiguous row tiles (TMA with USE_TMA)
    a1, a1s, gather = a1q, a1q_scale, True
    if g1.get("PERMUTE_A", 0) and stages != "gemm2":
        a1 = _permute_rows(a1q, sorted_ids, ntpp, rows, numel, topk)
        a1 = a1.view(_FP8) if a1q.dtype == _FP8 else a1
        if plan.a1_mode in (ScaleMode.ROW, ScaleMode.GROUP):
            a1s = _permute_rows(a1q_scale.reshape(M, -1).to(torch.float32), sorted_ids, ntpp, rows, numel, topk)
        gather = False
    # ---- GEMM1 (+ activation (+ requantization))
    if stages == "gemm2":
        pass
    elif quant_on_load:
        launch_gemm(GemmOperands(a1, w1, c2, cs=slots, a_scale=a1s, w_scale=qc.w1_scale, bias=w1_bias),
                     GemmShape(n_out=I, a_gather=gather, c_sorted=True, **gemm_rows), scales1,
                     replace(epi1, out_quant=OUT_AMAX_SLOTS), g1, pdl_trigger=pdl, pdl_wait=g1_pdl)
        if taps is not None:
            taps["activation"] = _unsort_rows(c2, layout, numel, M, topk)
    elif fuse and (out_quant or not quant):
        launch_gemm(GemmOperands(a1, w1, c2_view, cs=c2s if out_quant else None, a_scale=a1s, w_scale=qc.w1_scale,
                                  bias=w1_bias),
                     GemmShape(n_out=I, a_gather=gather, c_sorted=True, **gemm_rows), scales1,
                     replace(epi1, out_quant=out_quant), g1, pdl_trigger=pdl, pdl_wait=g1_pdl)
        if taps is not None and not quant:
            taps["activation"] = _unsort_rows(c2, layout, numel, M, topk)
    else:
        c1 = _view(buf2, 0, (rows, c1_cols), act_dtype)
        qm = plan.a2_qmode if quant else QMODE_NONE
        stat = None
        amax_in_gemm1 = amax_epi == 1 or (amax_epi == 2 and not quant_on_load)  # 2 with GEMM2 on Gluon: 1
        if qm == QMODE_FP8_TENSOR_AMAX and not slots_pass:
            # one scale over all routed rows of the call (reference: vLLM quantizes intermediate_cache2 at once):
            # [amax, non-finite flag], found by act_quant_kernel's first pass, or (AMAX_EPILOGUE 1) by GEMM1's
            # epilogue when it applies the activation on fused_moe_kernel (OUT_AMAX); AMAX_EPILOGUE 3: in GEMM1's slots
            stat = torch.zeros(2, dtype=torch.float32, device=dev)
        ops1 = GemmOperands(a1, w1, c1, a_scale=a1s, w_scale=qc.w1_scale, bias=w1_bias)
        shape1 = GemmShape(n_out=I if fuse else NW1, a_gather=gather, c_sorted=True, **gemm_rows)
        if slots_pass:
            epi1_out = replace(epi1, out_quant=OUT_AMAX_SLOTS)
            ws_mod = _gemm_gluon(ops1, shape1, scales1, epi1_out, g1)  # gluon_ws here, or fused_moe_kernel (None)
            if ws_mod is not None:
                # two slots per program (its consumers), not fused_moe_kernel's one per tile (the region holds the
                # larger count)
                slots = _view(buf13, slot_off, (2, ws_mod.amax_slot_count(shape1, g1, dev)), torch.float32).t()
            cs1 = slots
        elif amax_in_gemm1:
            cs1, epi1_out = stat.view(1, 2), replace(epi1, out_quant=OUT_AMAX)
        else:
            cs1, epi1_out = None, epi1
        launch_gemm(replace(ops1, cs=cs1), shape1, scales1, epi1_out, g1, pdl_trigger=pdl, pdl_wait=g1_pdl)
        if taps is not None:  # copied now: GEMM2's output C3 reuses this buffer
            taps["activation" if fuse else "gemm1"] = _unsort_rows(c1, layout, numel, M, topk)
        aq = dict(sorted_ids=sorted_ids, expert_ids=expert_ids, ntpp=ntpp, rows=rows, nc=I, num_valid=numel,
                  up_off=I if split == 1 else 0, num_e=1, block_m=BM, act_dtype=act_dtype, rp=rp,
                  use_ue8m0=plan.use_ue8m0, group=group, alpha=alpha, beta=beta, limit=limit, has_limit=has_limit,
                  num_warps=g2.get("QUANT_WARPS"), local_ids=local, inv_permuted_idx=layout.inv_permuted_idx,
                  route_tiles=bool(layout.route_tiles))
        if fuse:
            aq.update(act=0, split=0, up_off=0)
        else:
            aq.update(act=act, split=split)
        if qm == QMODE_FP8_TENSOR_AMAX and slots_pass:
            _launch_act_quant(x=c1, y=c2_view, ys=c2s, slots=slots, qmode=QMODE_FP8_TENSOR_QUANT, pdl=pdl, **aq)
        elif qm == QMODE_FP8_TENSOR_AMAX:
            if not amax_in_gemm1:
                _launch_act_quant(x=c1, y=c2_view, stat=stat, qmode=QMODE_FP8_TENSOR_AMAX, **aq)
            _launch_act_quant(x=c1, y=c2_view, ys=c2s, stat=stat, qmode=QMODE_FP8_TENSOR_QUANT, **aq)
        else:
            a2s = None
            if qm in (QMODE_FP8_STATIC, QMODE_INT8_STATIC):
                a2s = (a2_scale if a2_scale is not None else qc.a2_scale).reshape(1).to(torch.float32)
            _launch_act_quant(x=c1, y=c2_view, ys=c2s, a2s=a2s, qmode=qm, pdl=pdl, **aq)
        if taps is not None and not quant and not fuse:
            taps["activation"] = _unsort_rows(c2, layout, numel, M, topk)
    if stages == "gemm1":
        return out
    # ---- GEMM2
    a2_scale_arg, a2_mode = None, ScaleMode.NONE
    if quant_on_load:
        a2_scale_arg, a2_mode = slots, ScaleMode.TENSOR_SLOTS
    elif quant:
        a2_mode = plan.a2_mode
        if a2_mode == ScaleMode.TENSOR:
            a2_scale_arg = (a2_scale if a2_scale is not None else qc.a2_scale).reshape(1).to(torch.float32)
        elif a2_mode == ScaleMode.ROW:
            a2_scale_arg = c2s[:, :1]
        else:
            a2_scale_arg = c2s
    # STEP_PDL: the top-k sum is launched during GEMM2 (which lets it start once every program of GEMM2 has) and
    # waits for it
    sum_pdl = STEP_PDL and stages == "all"
    rows2 = gemm_rows
    if layout.tiles is not None and gemm2_on_half_blocks(cfg):  # the layout's half blocks, not the tile list
        rows2 = dict(gemm_rows, layout=layout._replace(tiles=None, num_tiles=None))
    launch_gemm(GemmOperands(c2, w2, c3, a_scale=a2_scale_arg, w_scale=qc.w2_scale, bias=w2_bias),
                 GemmShape(n_out=K, a_gather=False, c_sorted=False, **rows2), replace(scales1, a_mode=a2_mode),
                 GemmEpilogue(**epi_quant), g2, pdl_wait=pdl, pdl_trigger=sum_pdl)
    if taps is not None:  # C3 is by route; rows of routes not held here were never written
        taps["gemm2"] = torch.where((local >= 0)[:, None], c3, torch.zeros((), dtype=c3.dtype, device=dev)).view(
            M, topk, K)  # a new tensor: C3's buffer may be reused
    if stages == "gemms":
        return out
    # ---- weighted top-k sum
    # decode: narrower column blocks, so that a few tokens still spread over many programs
    bk = min(next_pow2(K), 128 if INTERPRET else (1024 if M >= 64 else 256))
    tw = topk_weights if topk_weights.stride(1) == 1 else topk_weights.contiguous()
    moe_sum_kernel[(M, cdiv(K, bk))](
        c3, tw, local, out, K, c3.stride(0), tw.stride(0), out.stride(0),
        TOPK=topk, BLOCK_K=bk, APPLY_W=not apply_router_weight_on_input, EMU=INTERPRET, PDL=sum_pdl, num_warps=4,
        **FP_FUSION, **({"launch_pdl": True} if sum_pdl else {}))
    return out


def _unsort_rows(c: torch.Tensor, layout: RouteLayout, numel: int, M: int, topk: int) -> torch.Tensor:
    """Rows of ``c`` in the sorted layout (position ``p`` holds route ``sorted_token_ids[p]``) as ``(M, topk, cols)``
    by route; routes not in the layout (not held here) are zeros. For ``run_experts``' ``taps`` only."""
    n = int(layout[2].item())
    ids = layout[0][:n].long()
    pos = (ids < numel).nonzero().squeeze(1)
    out = torch.zeros(numel, c.shape[1], dtype=c.dtype, device=c.device)
    out[ids[pos]] = c[:n][pos]
    return out.view(M, topk, c.shape[1])


def _check_ids(topk_ids: torch.Tensor, num_ids: int) -> None:
    """Reject ids outside [-1, num_ids) with a clear error (-1 = no route). Costs one device-to-host copy, so it is
    skipped while a CUDA graph is being captured (the kernels drop such ids rather than read out of bounds)."""
    if topk_ids.is_floating_point():
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    check_topk_ids_range(topk_ids, num_ids)


def _check_weights(w1, w2, activation, plan: QuantPlan):
    if w1.dim() != 3 or w2.dim() != 3 or w1.size(0) != w2.size(0) or w1.size(2) != w2.size(1):
        raise ValueError(f"w1/w2 must be (E, N, K) / (E, K, I), got {tuple(w1.shape)} / {tuple(w2.shape)}")
    I = adjust_N_for_activation(w1.size(1), activation)
    if w2.size(2) != I:
        raise ValueError(f"w2 must be (E, K, {I}) for {activation.name} with w1 N={w1.size(1)}, got {tuple(w2.shape)}")
    want = {"none": None, "fp8": _FP8, "int8": torch.int8}[plan.kind]
    for name, w in (("w1", w1), ("w2", w2)):
        if want is None and w.dtype not in _TL_DTYPES:
            raise ValueError(f"{name} must be bf16/fp16/fp32 for unquantized experts, got {w.dtype}")
        if want is not None and w.dtype != want:
            raise ValueError(f"{name} must be {want} codes for this quant config, got {w.dtype}")
        if w.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along K (stride 1 in the last dim)")


# --------------------------------------------------------------------------------------------------------------
# modular experts class
# --------------------------------------------------------------------------------------------------------------


def _key_sig(key):
    """(dtype, scale dtype, static, group shape) of a QuantKey, compared by attribute (robust to module layout)."""
    if key is None:
        return None
    sc = key.scale
    return (key.dtype, sc.dtype, bool(sc.static), tuple(sc.group_shape), key.scale2 is None, bool(key.symmetric))


def _device_reason() -> str | None:
    """The backend's availability (``backends.triton._availability``), looked up at call time."""
    from backends.triton import _availability

    return _availability()


#: The FP8 W8A8 pairs the kernels implement (``plan_quant``): per-tensor or per-channel weights x static / dynamic
#: per-tensor or dynamic per-token activations; 128x128 blocks (fp32 or E8M0 scales) x dynamic 1x128 groups; 64x64
#: blocks (vLLM 0.33 refines a checkpoint's 128x128 blocks for a TP shard; it pairs every block shape with
#: kFp8Dynamic128Sym, and the activations are quantized per 1 x 64 all the same: plan_quant's group_k).
_FP8_PAIRS = frozenset({
    (K.kFp8StaticTensorSym, K.kFp8StaticTensorSym),
    (K.kFp8StaticTensorSym, K.kFp8DynamicTensorSym),
    (K.kFp8StaticTensorSym, K.kFp8DynamicTokenSym),
    (K.kFp8StaticChannelSym, K.kFp8DynamicTokenSym),
    (K.kFp8StaticChannelSym, K.kFp8StaticTensorSym),
    (K.kFp8StaticChannelSym, K.kFp8DynamicTensorSym),
    (K.kFp8Static128BlockSym, K.kFp8Dynamic128Sym),
    (K.kFp8Static128BlockE8M0Sym, K.kFp8Dynamic128Sym),
    (K.kFp8Static64BlockSym, K.kFp8Dynamic128Sym),
})
#: INT8 W8A8: per-channel weights x dynamic per-token or static per-tensor activations.
_INT8_PAIRS = frozenset({
    (K.kInt8StaticChannelSym, K.kInt8DynamicTokenSym),
    (K.kInt8StaticChannelSym, K.kInt8StaticTensorSym),
})


class TritonExperts(FusedMoEExpertsModular):
    """Triton fused-MoE experts (Standard format; the modular kernel's ``[Permute-Experts-Unpermute]`` step).

    Output: ``(M, K)`` already weighted and reduced, so the finalize step is ``TopKWeightAndReduceNoOP``.

    Workspaces (``workspace_shapes``, activation dtype elements,
    ``R = layout_rows(M * topk, E_local, layout_block(cfg))``):
    ``workspace13 (R, cols)`` holds GEMM2's input (C2 in the activation dtype, or its FP8/INT8 codes + fp32 scales;
    it may alias the output, which is written only after C2 is dead); ``workspace2 (R, max(N, K, I))`` holds the
    unfused GEMM1 output / pre-quantization C2, then GEMM2's route-ordered output C3. Too-small or non-contiguous
    workspaces are replaced by fresh allocations (never read uninitialized). With ``PERMUTE_A`` the sorted copy of
    the input (``R x K`` plus its scales) is a fresh allocation too.

    Supports (``support``, a ``SupportRecord``): every ``MoEActivation`` except gated RELU2; bf16/fp16/fp32 and the
    quant schemes of the module table (FP8 ones on sm_89+ only: ``_supports_quant_scheme``); ``expert_map``; chunking;
    ``apply_router_weight_on_input``; w1/w2 biases.

    Raises (``__init__``): NotImplementedError for a quant config it does not implement; (``apply``) ValueError for
    bad shapes/dtypes/devices.
    """

    def __init__(self, moe_config, quant_config: FusedMoEQuantConfig | None = None, max_num_tokens=None,
                 num_dispatchers=None, *, config: dict | None = None):
        super().__init__(moe_config, quant_config or FUSED_MOE_UNQUANTIZED_CONFIG, max_num_tokens, num_dispatchers)
        self.plan = plan_quant(self.quant_config)
        self.config_override = config

    @staticmethod
    def activation_format():
        return FusedMoEActivationFormat.Standard

    support = SupportRecord(
        FusedMoEActivationFormat.Standard,
        # Every pair the kernels implement (module table; plan_quant). The FP8 pairs are claimed only where FP8
        # ``tl.dot`` exists: see _supports_quant_scheme below.
        quant_schemes=frozenset({(None, None)} | _FP8_PAIRS | _INT8_PAIRS),
        # Keys are compared by signature (dtype, scale dtype, static, group shape, scale2 present, symmetric).
        key_match=lambda a, b: _key_sig(a) == _key_sig(b),
        activations=SUPPORTED_ACTIVATIONS,  # every MoEActivation but gated RELU2 (vLLM refuses it too)
        act_dtypes=frozenset(_TL_DTYPES),  # bf16 / fp16 / fp32 (fused_experts raises for anything else)
        device=_device_reason,
        finalize="(M, K) weighted and reduced: TopKWeightAndReduceNoOP",
        activation_params=ACTIVATION_PARAMS, ue8m0_scales=True,  # every variant, as before the claims had them
        notes="fused_moe_kernel (+ Gluon SM90 variants); FP8 pairs only on sm_89+ or the interpreter (fp8_capable); "
              "expert biases; unquantized weights must have the activation dtype",
        declined=MICROSCALING_DECLINED,  # vLLM 0.33's microscaling cross pairs: why not here (backends/_declined.py)
    )

    @classmethod
    def _supports_quant_scheme(cls, weight_key, activation_key) -> bool:
        # The record lists every pair (reports and case generation enumerate them); FP8 pairs are claimed only on an
        # FP8-capable GPU (sm_89+, or the interpreter): a frozen record cannot hold a device-dependent set.
        if not cls.support.claims_quant(weight_key, activation_key):
            return False
        return _key_sig(weight_key) is None or _key_sig(weight_key)[0] != _FP8 or fp8_capable()

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOP()

    def stages(self, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map):
        """The conformance diagnosis protocol (``conformance/diagnose.py``): this class's intermediates for the whole
        call (``fused_experts``: the launch configuration ``apply`` picks for an unchunked call of these M tokens, the
        input quantized by the backend's own quantizer): ``gemm1`` (unfused configs only), ``activation`` (where it
        is materialized unquantized) and ``gemm2`` (per route, before the router weights), each ``(M, topk, cols)``
        in the activation dtype, zeros for routes not held here (see ``run_experts``' ``taps``)."""
        taps: dict = {}
        fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation=activation,
                      global_num_experts=global_num_experts, expert_map=expert_map, quant_config=self.quant_config,
                      config=self.config_override, taps=taps)
        return taps

    def _act_elt(self) -> int:
        dt = getattr(self.moe_config, "in_dtype", torch.bfloat16)
        return torch.empty((), dtype=dt if dt in _TL_DTYPES else torch.bfloat16).element_size()

    def config_for(self, M: int, E: int, I: int, K: int, topk: int) -> dict:
        return _configs.get_config(M, E, I, K, topk, self.plan.cfg_dtype, self.plan.block_shape,
                                   override=self.config_override, act_elt=self._act_elt())

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                         activation):
        I = adjust_N_for_activation(N, activation)
        cfg = self.config_for(M, local_num_experts, I, K, topk)
        rows = layout_rows(M * topk, local_num_experts, layout_block(cfg))
        elt = self._act_elt()
        need13 = round_up(rows * I, 16) + rows * cdiv(I, self.plan.group_k) * 4
        g1 = cfg["gemm1"]
        amax_epi = g1.get("AMAX_EPILOGUE", 0) if self.plan.a2_qmode == QMODE_FP8_TENSOR_AMAX else 0
        if amax_epi in (2, 3):
            # GEMM1's amax slots (run_experts' quant_on_load: with GEMM2's input in the act dtype, in its scales'
            # place; slots_pass: after the codes' scales): row tiles at most rows / (BLOCK_M / 2) (HALF_TAIL's tail
            # tiles), N tiles in whole N_TILES groups
            bm, nt = g1["BLOCK_SIZE_M"], g1.get("N_TILES", 1)
            tiles = cdiv(rows, bm // 2 if g1.get("HALF_TAIL", 0) else bm) * cdiv(cdiv(I, g1["BLOCK_SIZE_N"]), nt) * nt
            if amax_epi == 2:
                need13 = max(need13, round_up(rows * I * elt, 16) + max(rows, 2 * tiles) * 4)
            else:  # (twice the slots: GEMM1 on gluon_ws writes two per program, up to twice its tiles)
                need13 = round_up(round_up(rows * I, 16) + rows * 4, 16) + 4 * tiles * 4
        cols13 = max(I, cdiv(need13, rows * elt))
        return (rows, cols13), (rows, max(N, K, I)), (M, K)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        check_device(hidden_states, w1, w2, topk_weights, topk_ids, output, what="experts operands")
        _check_weights(w1, w2, activation, self.plan)
        if hidden_states.dim() != 2 or hidden_states.size(1) != w1.size(2):
            raise ValueError(f"hidden_states must be (M, K={w1.size(2)}) to match w1 {tuple(w1.shape)}, got "
                             f"{tuple(hidden_states.shape)}")
        if self.plan.kind == "none" and (w1.dtype != output.dtype or w2.dtype != output.dtype):
            raise ValueError(f"unquantized weights must have the activations' dtype {output.dtype}, got "
                             f"w1 {w1.dtype} and w2 {w2.dtype}")
        E = w1.size(0)
        M, K = hidden_states.shape
        I = w2.size(2)
        num_ids = expert_map.numel() if expert_map is not None else E
        _check_ids(topk_ids, num_ids)
        cfg = self.config_for(M, E, I, K, topk_ids.size(1))
        if a2_scale is not None and a2_scale.numel() != 1:
            a2_scale = None  # per-token static a2 scales are rejected by plan_quant; a chunked copy of a scalar
        run_experts(out=output, a1q=hidden_states, a1q_scale=a1q_scale, w1=w1, w2=w2, topk_weights=topk_weights,
                    topk_ids=topk_ids, activation=activation, expert_map=expert_map, num_ids=num_ids,
                    qc=self.quant_config, plan=self.plan, cfg=cfg, ws13=workspace13, ws2=workspace2,
                    apply_router_weight_on_input=apply_router_weight_on_input, a2_scale=a2_scale)


# --------------------------------------------------------------------------------------------------------------
# functional form (mirrors reference.experts.fused_experts)
# --------------------------------------------------------------------------------------------------------------


def fused_experts(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: MoEActivation = MoEActivation.SILU,
    global_num_experts: int = -1,
    expert_map: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    quant_config: FusedMoEQuantConfig | None = None,
    config: dict | None = None,
    taps: dict | None = None,
) -> torch.Tensor:
    """The whole experts step on the GPU (input quantization included): same contract as
    ``reference.experts.fused_experts`` — ``(M, K)`` output in ``hidden_states.dtype``.

    ``config`` overrides the launch configuration (``{"gemm1": {...}, "gemm2": {...}}``, see ``configs``);
    ``taps`` receives the intermediates (see ``run_experts``).

    Raises:
        ValueError: bad shapes/dtypes/devices, apply_router_weight_on_input with topk > 1.
        NotImplementedError: a quant scheme the backend does not implement.
    """
    qc = quant_config or FUSED_MOE_UNQUANTIZED_CONFIG
    plan = plan_quant(qc)
    check_device(hidden_states, w1, w2, topk_weights, topk_ids, expert_map, what="experts operands")
    if hidden_states.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.size(0) != hidden_states.size(0):
        raise ValueError(f"hidden_states (M, K) {tuple(hidden_states.shape)}, topk_ids {tuple(topk_ids.shape)} and "
                         f"topk_weights {tuple(topk_weights.shape)} must agree on M")
    _check_weights(w1, w2, activation, plan)
    if w1.size(2) != hidden_states.size(1):
        raise ValueError(f"hidden size mismatch: hidden_states K={hidden_states.size(1)}, w1 K={w1.size(2)}")
    if hidden_states.dtype not in _TL_DTYPES:
        raise ValueError(f"hidden_states must be bf16/fp16/fp32, got {hidden_states.dtype}")
    if plan.kind == "none" and (w1.dtype != hidden_states.dtype or w2.dtype != hidden_states.dtype):
        raise ValueError(f"unquantized weights must have the activations' dtype {hidden_states.dtype}, got "
                         f"w1 {w1.dtype} and w2 {w2.dtype}")
    E = w1.size(0)
    if expert_map is not None:
        G = global_num_experts if global_num_experts != -1 else expert_map.numel()
        if expert_map.numel() != G:
            raise ValueError(f"expert_map has {expert_map.numel()} entries, expected global_num_experts={G}")
    M, K = hidden_states.shape
    x = hidden_states.contiguous()
    if apply_router_weight_on_input:
        if topk_ids.size(1) != 1:
            raise ValueError(f"apply_router_weight_on_input is only supported for topk == 1, got {topk_ids.size(1)}")
        x = x * topk_weights.to(x.dtype)
    out = torch.empty((M, K), dtype=hidden_states.dtype, device=hidden_states.device)
    if M == 0:
        return out
    if plan.kind == "none":
        a1q, a1s = x, None
    else:
        a1q, a1s = quantize_activation(x, plan.a1_qmode, qc.a1_scale, group=plan.group_k, recipe=plan.recipe,
                                       use_ue8m0=plan.use_ue8m0)
        if plan.a1_mode == ScaleMode.TENSOR:
            a1s = a1s.reshape(1)
    cfg = _configs.get_config(M, E, w2.size(2), K, topk_ids.size(1), plan.cfg_dtype, plan.block_shape,
                              override=config, act_elt=hidden_states.element_size() if plan.kind == "none" else 2)
    return run_experts(out=out, a1q=a1q, a1q_scale=a1s, w1=w1, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids,
                       activation=activation, expert_map=expert_map,
                       num_ids=expert_map.numel() if expert_map is not None else E, qc=qc, plan=plan, cfg=cfg,
                       apply_router_weight_on_input=apply_router_weight_on_input, taps=taps)
