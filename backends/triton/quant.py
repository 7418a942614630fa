"""``per_token_group_quant_fp8`` as a Triton kernel, bit-exact to ``reference.quant.per_token_group_quant_fp8``.

Mirrors the reference's signature and semantics (which mirror vLLM's
``vllm/model_executor/layers/quantization/utils/fp8_utils.py::per_token_group_quant_fp8`` / CUDA
``per_token_group_quant_8bit`` under ``recipe="vllm"`` and DeepGEMM's ``per_token_cast_to_fp8`` under
``recipe="deepgemm"``). Every recipe of ``reference.quant.recipes`` is implemented bit-exactly: amax floor, scale
computation, UE8M0 rounding rule (vLLM's ``exp2(ceil(log2))`` including its one-binade-low results for fp32 scales a
few ULPs above a power of two), divide vs multiply-by-reciprocal, saturation, NaN/inf poisoning. The backend declares
``recipe="vllm"`` (the default) in ``Backend.recipes``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .host import (INTERPRET, QUANT_FAST_DIV, QUANT_ROUTES, QUANT_ROW_CHUNKED, QUANT_ROW_TAIL, QUANT_ROW_TILE,
                   QUANT_SKIP_PAD, QUANT_TENSOR_COLS, QUANT_TENSOR_ROUTE_COLS, QUANT_TENSOR_TILE, QUANT_TENSOR_WARPS,
                   STEP_PDL, cdiv, check_device, next_pow2, recipe_params)
from .jit import FP_FUSION, fp8_quant_rows
from .kernels import (
    QMODE_FP8_GROUP,
    QMODE_FP8_STATIC,
    QMODE_FP8_TENSOR_AMAX,
    QMODE_FP8_TENSOR_QUANT,
    QMODE_FP8_TOKEN,
    QMODE_INT8_STATIC,
    QMODE_INT8_TOKEN,
    QMODE_NONE,
    act_quant_kernel,
)

__all__ = ["per_token_group_quant_fp8", "scaled_fp8_quant", "int8_quant_per_token", "quantize_activation",
           "launch_act_quant"]

_FP8 = torch.float8_e4m3fn
# vLLM dynamic per-token floor 1 / (448 * 512) as the fp32 quotient (reference.quant.fp8._MIN_PER_TOKEN_SCALE)
_MIN_TOKEN_SCALE = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(448.0 * 512.0, dtype=torch.float32))


def _tl_dtype(dt: torch.dtype):
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dt]


@triton.jit
def _per_token_group_quant_fp8_kernel(
    x_ptr, q_ptr, s_ptr,
    R, M_inner, stride_xr, stride_sb, stride_sm, stride_sg,
    amax_floor, ue8m0_floor,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_R: tl.constexpr,
    USE_UE8M0: tl.constexpr, UE8M0_EXACT: tl.constexpr, SCALE_INV: tl.constexpr, RECIP_MUL: tl.constexpr,
    EMU: tl.constexpr, TRIGGER: tl.constexpr = False,
):
    if TRIGGER:  # host.STEP_PDL: the next kernel (the route alignment) may start now
        gdc_launch_dependents()
    pid_r = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, GROUP_P2)
    rmask = rows < R
    mask = rmask[:, None] & (cols < GROUP)[None, :]
    offs = rows[:, None].to(tl.int64) * stride_xr + (g * GROUP + cols)[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    codes, s = fp8_quant_rows(x, amax_floor, ue8m0_floor, USE_UE8M0, UE8M0_EXACT, SCALE_INV, RECIP_MUL, EMU)
    tl.store(q_ptr + offs, codes, mask=mask)
    b = rows // M_inner
    m = rows - b * M_inner
    s_offs = b.to(tl.int64) * stride_sb + m.to(tl.int64) * stride_sm + g * stride_sg
    tl.store(s_ptr + s_offs, s, mask=rmask)


def per_token_group_quant_fp8(
    x: torch.Tensor,
    group_size: int = 128,
    *,
    column_major_scales: bool = False,
    tma_aligned_scales: bool = False,
    use_ue8m0: bool = False,
    recipe="vllm",
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 quantization with one fp32 scale per ``group_size`` consecutive elements of K (Triton kernel).

    Same contract as ``reference.quant.per_token_group_quant_fp8`` (and bit-exact to it under the same recipe):

    Args:
        x: ``(..., K)`` float16 / bfloat16 / float32, contiguous, on CUDA (CPU under ``TRITON_INTERPRET=1``).
        group_size: elements per group along K (any positive int; 128 and 64 in practice).
        column_major_scales: MN-major scales, shape ``(M, G)`` strides ``(1, M)`` (3-D: ``(B, M, G)`` strides
            ``(G*M, 1, M)``); x must be 2-D or 3-D.
        tma_aligned_scales: with ``column_major_scales``, column stride ``align(M, 4)`` (DeepGEMM SM90 layout);
            padding storage is zero.
        use_ue8m0: power-of-two scales (fp32 storage), rounded by the recipe's UE8M0 rule.
        recipe: ``"vllm"`` (default), ``"deepgemm"`` or a ``reference.quant.QuantRecipe``.

    Returns:
        ``(q, scales)``: q float8_e4m3fn with x's shape; scales float32 ``(..., K // group_size)``.

    Raises:
        TypeError: x not fp16/bf16/fp32.
        ValueError: ``K % group_size != 0``, non-contiguous x, ``tma_aligned_scales`` without
            ``column_major_scales``, column-major scales for x not 2-D/3-D, unknown recipe, wrong device.
    """
    fn = "per_token_group_quant_fp8"
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{fn}: x must be a float16/bfloat16/float32 tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"{fn}: group_size must be a positive int, got {group_size!r}")
    if x.dim() == 0:
        raise ValueError(f"{fn}: x must have at least one dimension")
    K = x.shape[-1]
    if K % group_size:
        raise ValueError(f"{fn}: the last dimension K={K} is not a multiple of group_size={group_size}")
    if not x.is_contiguous():
        raise ValueError(f"{fn}: x must be contiguous, got strides {tuple(x.stride())}")
    if tma_aligned_scales and not column_major_scales:
        raise ValueError(f"{fn}: tma_aligned_scales=True requires column_major_scales=True")
    if column_major_scales and x.dim() not in (2, 3):
        raise ValueError(f"{fn}: column-major scales need x of shape (M, K) or (B, M, K), got {tuple(x.shape)}")
    p = recipe_params(recipe)
    check_device(x, what="x")

    G = K // group_size
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    R = x.numel() // K if K else 0
    if column_major_scales:
        M = x.shape[-2]
        stride = (cdiv(M, 4) * 4) if tma_aligned_scales else M
        batch = x.shape[:-2]
        storage = torch.zeros(*batch, G, stride, dtype=torch.float32, device=x.device)
        s = storage[..., :M].transpose(-1, -2)
        M_inner = max(M, 1)
        stride_sb = G * stride if x.dim() == 3 else 0
        stride_sm, stride_sg = 1, stride
    else:
        s = torch.empty(*x.shape[:-1], G, dtype=torch.float32, device=x.device)
        M_inner, stride_sb, stride_sm, stride_sg = max(R, 1), 0, G, 1
    if R == 0 or G == 0:
        return q, s
    gp2 = next_pow2(group_size)
    block_r = max(1, min(64, 4096 // gp2))
    # decode: no more rows per tile than there are (masked rows cost the same per-thread chain: M=1 at K 2048 took
    # 6.2 us in [32, 128] tiles on an H200)
    block_r = min(block_r, next_pow2(R))
    grid = (cdiv(R, block_r), G)
    _per_token_group_quant_fp8_kernel[grid](
        x, q.view(torch.uint8), s,
        R, M_inner, K, stride_sb, stride_sm, stride_sg,
        p["amax_floor"], p["ue8m0_floor"],
        GROUP=group_size, GROUP_P2=gp2, BLOCK_R=block_r,
        USE_UE8M0=bool(use_ue8m0), UE8M0_EXACT=p["UE8M0_EXACT"], SCALE_INV=p["SCALE_INV"],
        RECIP_MUL=p["RECIP_MUL"], EMU=INTERPRET, TRIGGER=STEP_PDL, **FP_FUSION,
    )
    return q, s


def launch_act_quant(*, x, y, ys=None, stat=None, a2s=None, sorted_ids=None, expert_ids=None, ntpp=None,
                      rows, nc, num_valid, up_off=0, num_e=1, block_m=16, act, split, qmode, act_dtype,
                      alpha=1.0, beta=0.0, limit=0.0, has_limit=False, rp=None, use_ue8m0=False, group=128,
                      pdl=False, num_warps=None, trigger=False, local_ids=None, inv_permuted_idx=None,
                      route_tiles=False, slots=None):
    """Launch ``act_quant_kernel`` over ``rows`` rows (sorted layout when ``sorted_ids`` is given); ``pdl``: with
    programmatic dependent launch (see ``kernels.act_quant_kernel``); ``trigger``: let the next kernel start early
    (an input quantizer's last launch, ``host.STEP_PDL``); ``num_warps`` per program (the table's
    ``QUANT_WARPS``: at decode the kernel is a chain of per-thread latencies, more threads per tile shorten it;
    None: 4, or one warp per 256 elements of a row-mode tile, up to 16).

    Tiles: element-wise modes take ``[BLOCK_R, min(next_pow2(nc), 1024)]`` chunks (grid axis 1); the per-token modes
    (2, 3) a whole row of up to 4096 columns in one pass (longer rows: two passes over 1024-column chunks), one row
    per program at up to 128 rows (decode: as many programs as rows) and up to 4096 elements a tile above; over a
    layout's rows (not ``ROUTES``) rows of 257-1024 columns are held as ``[BLOCK_R, ROW_CHUNKS, 256]`` tiles (plus a
    ``ROW_TAIL`` tile) of ``host.QUANT_ROW_TILE`` elements (``host.QUANT_ROW_CHUNKED``; a row over fewer warps) and
    a layout's padding rows may be skipped (``SKIP_PAD``, ``host.QUANT_SKIP_PAD``); the per-tensor amax (6) one
    ``[BLOCK_R, 1024]`` chunk per program.

    ``local_ids`` / ``inv_permuted_idx`` (``RouteLayout``'s, with ``sorted_ids``): where at least half of the
    layout's rows are padding (decode: E * (block_m - 1) padding rows against M * topk routes), the programs take
    the routes instead of the rows and write only the held routes' rows (``ROUTES``; ``QUANT_ROUTES`` turns it off).

    ``slots`` (``QMODE_FP8_TENSOR_QUANT`` only, instead of ``stat``): GEMM1's amax slots, ``(n, 2)`` fp32 with strides
    ``(1, n)`` (``experts.amax_slots``; ``[amax..., flags...]``), reduced by every program (``SLOTS``): no QMODE 6
    pass before this one.
    """
    if slots is not None:
        n = slots.shape[0]
        if qmode != QMODE_FP8_TENSOR_QUANT or slots.dim() != 2 or slots.shape[1] != 2 or slots.stride() != (1, n) \
                or slots.dtype != torch.float32:
            raise ValueError(f"slots: (n, 2) fp32 with strides (1, n), for QMODE_FP8_TENSOR_QUANT only; got "
                             f"{tuple(slots.shape)} {slots.dtype} strides {slots.stride()}, qmode {qmode}")
        stat, num_e = slots, n
    sorted_ = sorted_ids is not None
    # ROUTES 1: over the routes at their layout rows; 2 (route_tiles, no layout: RouteLayout.route_tiles): route r's
    # row is r * block_m
    if route_tiles:
        routes = 2
    else:
        routes = int(QUANT_ROUTES and sorted_ and inv_permuted_idx is not None and 2 * num_valid <= rows)
    row_mode = qmode in (QMODE_FP8_TOKEN, QMODE_INT8_TOKEN)
    if qmode == QMODE_FP8_GROUP:
        bc = group
        if bc & (bc - 1):
            raise ValueError(f"group size {group} must be a power of two")
    elif row_mode and next_pow2(nc) <= 4096:
        bc = next_pow2(nc)
    else:
        bc = min(next_pow2(nc), 1024)
    budget = 4096
    per_tensor = qmode in (QMODE_FP8_TENSOR_AMAX, QMODE_FP8_TENSOR_QUANT) and not INTERPRET
    if per_tensor:  # (over the routes a program is one route: fewer, wider programs; host.QUANT_TENSOR_ROUTE_COLS)
        bc = min(next_pow2(nc), QUANT_TENSOR_ROUTE_COLS if routes and num_valid <= 128 else QUANT_TENSOR_COLS)
        budget = QUANT_TENSOR_TILE
    br = max(1, min(budget // bc, 64))
    br = 1 << (br.bit_length() - 1)
    if (row_mode and rows <= 128) or (routes and num_valid <= 128):
        br = 1  # decode: one row (route) per program, a row's reduction spread over the program's warps
    if sorted_:
        br = min(br, block_m)
    per_chunk = qmode in (QMODE_NONE, QMODE_FP8_GROUP, QMODE_FP8_STATIC, QMODE_INT8_STATIC, QMODE_FP8_TENSOR_QUANT,
                          QMODE_FP8_TENSOR_AMAX)
    one_pass = qmode == QMODE_FP8_TENSOR_AMAX or (row_mode and nc <= bc)
    if num_warps is None:
        num_warps = max(4, min(16, br * bc // 256)) if row_mode else (QUANT_TENSOR_WARPS if per_tensor else 4)
    # per-token over the layout's rows (prefill; not the routes: slower at Qwen3-30B M = 64 on an H200) of 257 to 1024
    # columns: whole rows as chunks of a warp's 256 columns on a middle axis (ROW_CHUNKS), QUANT_ROW_TILE elements a
    # program (not the input quantizer's rows: 2048 columns at Qwen3-30B M = 1024 were slower, the programs too few
    # threads; narrower ones not measured)
    chunks, tail, skip_pad = 1, 0, False
    if row_mode and one_pass and sorted_ and 256 < bc <= 1024 and (
            (br > 1 and not routes and QUANT_ROW_CHUNKED) or QUANT_ROW_CHUNKED == 2):
        bc, n = 256, cdiv(nc, 256)
        chunks = 1 << (n.bit_length() - 1)  # the largest power of two <= n, then the rest as a second tile
        tail = n - chunks                     # when it is a power of two (768 columns: 2 + 1 chunks), else padded
        if tail & (tail - 1) or not QUANT_ROW_TAIL:
            chunks, tail = next_pow2(n), 0
        if br > 1:  # (decode keeps a row a program: as many programs as rows)
            br = max(1, QUANT_ROW_TILE // (next_pow2(n) * bc))  # (as if padded: the same rows with a tail)
            br = 1 << (br.bit_length() - 1)
        num_warps = min(num_warps, 4, br)
        # the layout's padding rows neither read nor written (the ids are the layout's: every row in range)
        skip_pad = bool(QUANT_SKIP_PAD and not routes and sorted_ids.numel() >= rows)
    grid = (cdiv(num_valid if routes else rows, br), cdiv(nc, bc) if per_chunk else 1)
    dummy = y
    rp = rp or recipe_params("vllm")
    act_quant_kernel[grid](
        x, y, ys if ys is not None else dummy, stat if stat is not None else dummy,
        a2s if a2s is not None else dummy,
        sorted_ids if sorted_ else dummy, expert_ids if sorted_ else dummy, ntpp if sorted_ else dummy,
        local_ids if routes else dummy, inv_permuted_idx if routes == 1 else dummy,
        rows, nc, num_valid, up_off, num_e,
        x.stride(0), y.stride(0), ys.stride(0) if ys is not None else 0,
        (ys.stride(1) if ys is not None and ys.dim() > 1 else 0),
        alpha, beta, limit, rp["amax_floor"], rp["ue8m0_floor"], _MIN_TOKEN_SCALE,
        BLOCK_R=br, BLOCK_C=bc, BS=block_m, SORTED=sorted_, ACT=act, HAS_LIMIT=has_limit, SPLIT=split,
        QMODE=qmode, ACT_DT=_tl_dtype(act_dtype), USE_UE8M0=use_ue8m0, UE8M0_EXACT=rp["UE8M0_EXACT"],
        SCALE_INV=rp["SCALE_INV"], RECIP_MUL=rp["RECIP_MUL"], EMU=INTERPRET, PDL=pdl, ONE_PASS=one_pass, TRIGGER=trigger,
        ROUTES=routes, SLOTS=slots is not None, num_slots=slots.shape[0] if slots is not None else 0,
        SKIP_PAD=skip_pad, ROW_CHUNKS=chunks, ROW_TAIL=tail,
        FAST_DIV=QUANT_FAST_DIV and qmode == QMODE_FP8_TOKEN and act_dtype in (torch.bfloat16, torch.float16),
        num_warps=num_warps, **FP_FUSION, **({"launch_pdl": True} if pdl else {}),
    )


def quantize_activation(x: torch.Tensor, qmode: int, scale: torch.Tensor | None = None, *, group: int = 128,
                        recipe="vllm", use_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x (M, K)`` rows with the act_quant kernel (no activation): returns ``(codes, scales)``.

    Modes and the reference op they reproduce bit-exactly: ``QMODE_FP8_GROUP`` ->
    ``per_token_group_quant_fp8`` (scales ``(M, K/group)``); ``QMODE_FP8_TOKEN`` -> ``scaled_fp8_quant(x,
    use_per_token_if_dynamic=True)`` (``(M, 1)``); ``QMODE_FP8_STATIC`` -> ``scaled_fp8_quant(x, scale)`` (``(1,)``);
    ``QMODE_FP8_TENSOR_AMAX`` -> dynamic per-tensor ``scaled_fp8_quant(x)`` (``(1,)``);
    ``QMODE_INT8_TOKEN`` -> ``int8_quant_per_token`` (``(M, 1)``); ``QMODE_INT8_STATIC`` -> ``int8_quant_static``.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_activation expects (M, K), got {tuple(x.shape)}")
    x = x.contiguous()
    M, K = x.shape
    if qmode == QMODE_FP8_GROUP:
        return per_token_group_quant_fp8(x, group, use_ue8m0=use_ue8m0, recipe=recipe)
    int8 = qmode in (QMODE_INT8_TOKEN, QMODE_INT8_STATIC)
    q = torch.empty((M, K), dtype=torch.int8 if int8 else _FP8, device=x.device)
    qv = q if int8 else q.view(torch.uint8)
    kw = dict(rows=M, nc=K, num_valid=M, act=0, split=0, act_dtype=x.dtype)
    if qmode in (QMODE_FP8_TOKEN, QMODE_INT8_TOKEN):
        s = torch.empty((M, 1), dtype=torch.float32, device=x.device)
        if M:
            launch_act_quant(x=x, y=qv, ys=s, qmode=qmode, trigger=STEP_PDL, **kw)
        return q, s
    if qmode in (QMODE_FP8_STATIC, QMODE_INT8_STATIC):
        if scale is None:
            raise ValueError("static quantization needs a scale")
        s = scale.reshape(1).to(torch.float32)
        if M:
            launch_act_quant(x=x, y=qv, a2s=s, qmode=qmode, trigger=STEP_PDL, **kw)
        return q, s
    if qmode == QMODE_FP8_TENSOR_AMAX:
        stat = torch.zeros(2, dtype=torch.float32, device=x.device)
        srow = torch.empty((max(M, 1), 1), dtype=torch.float32, device=x.device)
        if M:
            launch_act_quant(x=x, y=qv, stat=stat, qmode=QMODE_FP8_TENSOR_AMAX, **kw)
            launch_act_quant(x=x, y=qv, ys=srow, stat=stat, qmode=QMODE_FP8_TENSOR_QUANT, trigger=STEP_PDL, **kw)
            return q, srow[:1, 0]  # a view (not a copy: one kernel fewer in the experts step's prepare)
        return q, torch.zeros(1, dtype=torch.float32, device=x.device)
    raise ValueError(f"unknown quantization mode {qmode}")


def _check_hp(x, fn):
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{fn}: x must be a float16/bfloat16/float32 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() == 0:
        raise ValueError(f"{fn}: x must have at least one dimension")
    check_device(x, what="x")


def _static_scale(scale, fn) -> torch.Tensor:
    """The one-element fp32 static scale; its value is checked on the host (a device-to-host copy), except while a
    CUDA graph is being captured on its device (a copy cannot be recorded: the check ran on the eager warm-up call,
    as ``backends._validation`` does for route ids)."""
    t = scale if isinstance(scale, torch.Tensor) else torch.tensor(float(scale), dtype=torch.float32)
    if t.numel() != 1:
        raise ValueError(f"{fn}: a static scale must have exactly one element, got shape {tuple(t.shape)}")
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return t.reshape(1).to(torch.float32)
    v = float(t.reshape(()))
    if not (v > 0.0 and v != float("inf")):
        raise ValueError(f"{fn}: scale must be positive and finite, got {v!r}")
    return t.reshape(1).to(torch.float32)


def scaled_fp8_quant(x: torch.Tensor, scale=None, *, use_per_token_if_dynamic: bool = False, scale_ub=None):
    """FP8 E4M3 quantization, per-tensor (static or dynamic) or dynamic per-token (Triton), bit-exact to
    ``reference.quant.scaled_fp8_quant`` (vLLM ``scaled_fp8_quant``): static ``q = sat(x * (1/s))``; dynamic
    per-tensor ``s = amax / 448`` (all-zero -> s = 0, q = 0); per-token ``s = max(amax / 448, 1 / (448 * 512))``,
    ``q = sat(x / s)``; a non-finite value poisons its tensor / row (NaN scale and codes).

    Args: x ``(..., K)`` fp16/bf16/fp32 (contiguous for per-token); scale one-element static scale or None.
    Returns: ``(q float8_e4m3fn like x, s float32 (1,) or (..., 1))``.
    Raises: TypeError (dtype), ValueError (bad static scale, scale_ub outside per-token mode, non-contiguous x),
        NotImplementedError (``scale_ub``: not implemented by this backend).
    """
    fn = "scaled_fp8_quant"
    _check_hp(x, fn)
    if scale_ub is not None:
        if scale is not None or not use_per_token_if_dynamic:
            raise ValueError(f"{fn}: scale_ub is only valid for dynamic per-token quantization")
        raise NotImplementedError(f"{fn}: scale_ub is not implemented by the triton backend")
    K = x.shape[-1]
    x2 = x.reshape(-1, K) if K else x.reshape(-1, 1)
    if scale is not None:
        s = _static_scale(scale, fn).to(x.device)
        q, _ = quantize_activation(x2.contiguous(), QMODE_FP8_STATIC, s)
        return q.reshape(x.shape), s
    if use_per_token_if_dynamic:
        if not x.is_contiguous():
            raise ValueError(f"{fn}: x must be contiguous for dynamic per-token quantization")
        q, s = quantize_activation(x2, QMODE_FP8_TOKEN)
        return q.reshape(x.shape), s.reshape(*x.shape[:-1], 1)
    q, s = quantize_activation(x2.contiguous(), QMODE_FP8_TENSOR_AMAX)
    return q.reshape(x.shape), s.reshape(1)


def int8_quant_per_token(x: torch.Tensor):
    """Dynamic symmetric INT8 per token (Triton), bit-exact to ``reference.quant.int8_quant_per_token`` (vLLM
    ``scaled_int8_quant``): ``s = absmax / 127``, ``q = clamp(rne(x * (127 / absmax)), -128, 127)`` with
    ``127 / absmax`` evaluated as torch does (reciprocal, then multiply); a zero row gives ``s = 0, q = 0``.

    Returns ``(q int8 like x, s float32 (..., 1))``. Raises TypeError (dtype), ValueError (NaN/inf: integers cannot
    represent them; checked on the host, as the reference raises).
    """
    fn = "int8_quant_per_token"
    _check_hp(x, fn)
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{fn}: input contains NaN or inf; integer formats cannot represent them")
    K = x.shape[-1]
    q, s = quantize_activation(x.reshape(-1, K).contiguous(), QMODE_INT8_TOKEN)
    return q.reshape(x.shape), s.reshape(*x.shape[:-1], 1)
