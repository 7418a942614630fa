"""Launch configurations of the fused-MoE GEMMs: tuned tables (JSON, written by ``tune.py``) and defaults.

A table is one JSON file per ``(E, N, device, dtype, block shape)`` in ``backends/triton/configs/``, named as vLLM
names its tables (``E={E},N={N},device_name={dev}[,dtype={dtype}][,block_shape=[bn,bk]].json``, N = the
intermediate size I = ``w2.shape[2]``). Content::

    {"<M>": {"gemm1": {BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages,
                       USE_TMA, N_TILES, FLATTEN, GLUON, PERSISTENT, PINGPONG, COOPERATIVE, N_HALVES, FUSE_ACT,
                       FUSE_QUANT, PROMOTE_K, FAST_ACCUM, SWAP_AB, SPLIT_K, PERMUTE_A, HALF_TAIL, JOINT_GATE_UP,
                       AMAX_EPILOGUE},
             "gemm2": {BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages, USE_TMA,
                       N_TILES, FLATTEN, GLUON, PERSISTENT, PINGPONG, COOPERATIVE, N_HALVES, PDL, PROMOTE_K,
                       FAST_ACCUM, SWAP_AB, SPLIT_K, QUANT_WARPS}},
     ...}

``BLOCK_SIZE_M`` is the alignment block of the route layout and must be equal in both GEMMs, except that with
GEMM1's ``HALF_TAIL`` GEMM2's may be half of it: GEMM2 then runs the layout's half blocks (as ping-pong 64-row
tiles, say) instead of the tile list (H200, Mixtral TP2 bf16 M = 1024, GEMM2 ping-pong 64 x 256 on the half blocks
against cooperative 128 x 256 on the tile list: 796.3 / 796.4 -> 782.5 / 780.8 us, thirtieth session; a persistent
launch of 2.55 waves takes three waves' time, and 64-row tiles cut the idle part of the last). ``N_TILES``
(optional, default 1) is the number of consecutive N tiles one program computes in turn over the same rows, and
``FLATTEN`` (default 0) asks Triton to software-pipeline that tile loop and the K loop as one (the next tile's loads
then overlap this tile's epilogue: short-K GEMMs whose programs are otherwise a chain of latencies).
``JOINT_GATE_UP`` (optional, default 0; gated activations with gate / up halves) computes an N tile's gate and up
rows as one ``2 * BLOCK_SIZE_N``-wide weight tile (one MMA chain, split in the epilogue) instead of two chains (always
for an FP8 per-tensor / per-channel GEMM1 promoted every few K tiles, see ``PROMOTE_K``). ``PERMUTE_A``
(optional, default 0) copies GEMM1's input rows into the layout's sorted order first, so that GEMM1 reads
contiguous row tiles (through TMA when ``USE_TMA``) instead of gathering them; ``GATHER_A`` (optional, default 0;
GEMM1 on ``gluon_ws`` without ``PERMUTE_A``) has the warp-specialized kernel's producer, a warpgroup, gather the
rows by route itself (asynchronous copies into the TMA-swizzled stages; per-token and block scales read by token in
the consumers), so that no sorted copy is written and read. ``HALF_TAIL`` (optional, default 0;
``BLOCK_SIZE_M >= 32``) pads each expert's routes to ``BLOCK_SIZE_M / 2`` rows instead of ``BLOCK_SIZE_M`` and runs
both GEMMs over a tile list: ``BLOCK_SIZE_M``-row tiles plus, where an expert's segment has an odd number of
half blocks, one ``BLOCK_SIZE_M / 2``-row tail tile in the same launch. ``GLUON`` (optional, default 0) runs
the GEMM on the Gluon block-FP8 kernel of ``gluon_sm90.py`` (weight-scale promotion overlapped with the wgmmas;
``num_stages`` = its TMA stages, ``num_warps`` = ``BLOCK_SIZE_M / 16``) where that kernel applies (block-FP8
scales, contiguous A rows, plain epilogue: GEMM2, or GEMM1 with ``PERMUTE_A`` and ``FUSE_ACT`` 0; see
``gluon_sm90.supported``), and on ``fused_moe_kernel`` otherwise; with ``PERSISTENT`` (optional, default 0) its grid
is one program per resident CTA, each loading its next tile while storing this one. ``PINGPONG`` / ``COOPERATIVE``
(optional, default 0) run the GEMM on the warp-specialized Gluon kernel of ``gluon_ws.py`` (a TMA producer warp and
two consumer warpgroups, one CTA per SM; ``num_stages`` = its TMA ring, ``num_warps`` = 4 per consumer): ping-pong
(each consumer a whole tile, the epilogue of one overlapping the other's MMAs) or cooperative (both share a 128-row
tile), bf16 / fp16 or block FP8, contiguous A rows, plain or SiLU-gated epilogue (``gluon_ws.supported``), else
``fused_moe_kernel``. ``N_HALVES`` (optional, default 0; with ``PINGPONG`` / ``COOPERATIVE``, FP8 GEMMs with
promotion) computes a consumer's MMA columns as two halves (GEMM1: gate, then up) through one MMA register set, each
K tile's promotion serialized behind its MMA (DeepGEMM's schedule): a 64 x 256 consumer tile in the registers a
64 x 128 one takes with two sets overlapping the promotion, so fewer operand bytes per FLOP (``gluon_ws``); its
per-tensor / per-channel consumers hold a ``PROMOTE_K`` interval's K tiles at once, so ``num_stages`` >= that many
(4 at ``BLOCK_K`` 128: at 3 the ring starved, 12-16% slower). H200 (twentieth session), GEMMs at M 1024 / 4096:
Mixtral TP2 fp8_tensor 507 -> 477 / 1514 -> 1490 us, Qwen3-30B fp8_channel_token 226 -> 219 / 515 -> 496,
fp8_block128 221 -> 217 / 517 -> 497; DeepSeek-V3 EP8 998 -> 967 at M 1024, a loss at 4096 (3286 -> 3550).
``PDL`` (optional, default 0; GEMM2) launches GEMM2, and the requantization before it, with
programmatic dependent launch: they start during GEMM1's last wave and wait for its output. ``PROMOTE_K``
(optional, default ``DEFAULT_PROMOTE_K`` = 256, a power of two <= 256, >= ``BLOCK_SIZE_K``; FP8 per-tensor /
per-channel GEMMs only) is the number of K elements accumulated in the FP8 MMA accumulator (about 14 mantissa bits
on sm_90) before it is added to an fp32 accumulator; ``FAST_ACCUM`` (optional, default 0; an explicit opt-in that no
committed table uses) accumulates those GEMMs in place over the whole K instead, as vLLM's ``fused_moe_kernel`` does
(error growing with K). ``SWAP_AB`` (optional, default 0; FP8 GEMMs on ``fused_moe_kernel`` only, else a
``ValueError``) computes each K tile as ``W_tile @ A_tile^T``, vLLM 0.33's decode form: the weight rows fill the
wgmma's 64-row M and the tile's 16-32 token rows its N. ``SPLIT_K`` (optional, default 1; ``fused_moe_kernel``, not
with gate / up as two chains nor INT8) runs that many programs per output tile over contiguous shares of K, the last
to finish summing their fp32 partials in split order before the epilogue: decode GEMMs whose (expert, N tile)
programs are too few to stream the weights (DeepSeek-V3 TP8 GEMM1 at M = 1: 64 programs of K = 7168).
``QUANT_WARPS`` (optional; GEMM2 entry; default 4, or for a per-token requantization one warp per 256 elements of
a tile, up to 16; over a prefill layout's rows of 257-1024 columns at most 4, ``host.QUANT_ROW_TILE``)
is the warps per program of the requantization kernel run
before GEMM2 (``act_quant_kernel``, where GEMM1 does not requantize in its epilogue): a power of two in [1, 16].
``AMAX_EPILOGUE`` (optional, default 0; GEMM1 entry; dynamic per-tensor FP8 requantization, GEMM1 applying the
activation on ``fused_moe_kernel``) finds the requantization's amax in GEMM1's epilogue (one atomic max per program,
``host.OUT_AMAX``) instead of a pass of ``act_quant_kernel`` over GEMM1's output: one kernel fewer, paid by the
tile reduction and the programs' atomics on one address (H200, Mixtral TP2 fp8_tensor: a gain at M = 1, a loss
from M = 8 up). ``AMAX_EPILOGUE`` 2 removes the requantization kernel altogether: each GEMM1 tile stores its amax in
a slot of its own (``host.OUT_AMAX_SLOTS``: plain stores, no zeros written before) and GEMM2, on
``fused_moe_kernel`` too, reduces the slots and quantizes its A tiles as it loads them (``ScaleMode.TENSOR_SLOTS``:
one multiply and one conversion per element, the codes of ``act_quant_kernel``'s pass bit for bit). H200, Mixtral TP2
fp8_tensor: a gain at M = 8 (GEMMs 167.7 -> 160.4 us with GEMM2's PDL), a tie at M = 1, a loss at M = 64 (196.7 ->
222.0: the 32-row A tiles quantized once per N tile); the per-token form was 1.4-1.8x slower at every Qwen3-30B
decode entry with an IEEE division per element, and 2.4-5.3x with the FAST division and no slots (its A tiles no
longer copied asynchronously under SWAP_AB), and is not kept (docs/notes/triton.md, "Tried and rejected").
``AMAX_EPILOGUE`` 3 keeps the slots and the requantization kernel: each of its programs reduces GEMM1's slots and
quantizes its rows in one pass (no atomics, no amax pass, GEMM2 reading FP8 codes as with 0 / 1; GEMM2's ``PDL``
applies); the only value that also takes GEMM1 on ``gluon_ws`` (``PINGPONG`` / ``COOPERATIVE``: each consumer writes
one slot at its end). H200 (fourteenth
session): Mixtral TP2 fp8_tensor M 1 / 64 gain 1.6 / 5.8 us on ``fused_moe_kernel``; on ``gluon_ws`` (prefill, each
consumer a running max per row, reduced across its warps once) Mixtral TP2 fp8_tensor M 1024 / 4096: H100 -11 / -34
us, H200 510.0 -> 497.7 / 1518.1 -> 1503.8 us (fifteenth session).
The entry whose ``M`` is nearest the batch is used (as vLLM does) when it is within a factor 8 of the batch;
otherwise (or without a table) :func:`default_config` chooses by tokens per expert.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

from .host import INTERPRET

__all__ = ["CONFIG_DIR", "GEMM1_KEYS", "GEMM2_KEYS", "DEFAULT_PROMOTE_K", "MAX_PROMOTE_K", "config_file_name",
           "device_name", "load_table", "default_config", "get_config", "sanitize_config"]

CONFIG_DIR = Path(os.environ.get("MOE_TRITON_CONFIG_DIR", Path(__file__).with_name("configs")))

# The keys a table entry may hold (anything else is a typo that would be ignored).
GEMM2_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages", "USE_TMA",
              "N_TILES", "FLATTEN", "GLUON", "PERSISTENT", "PINGPONG", "COOPERATIVE", "N_HALVES", "PDL", "PROMOTE_K",
              "FAST_ACCUM", "SWAP_AB", "SPLIT_K", "QUANT_WARPS")
# K elements an FP8 per-tensor / per-channel GEMM accumulates in the MMA accumulator before promoting it into fp32
# (PROMOTE_K's default and its largest allowed value; DeepGEMM / CUTLASS use 128)
DEFAULT_PROMOTE_K = 256
MAX_PROMOTE_K = 256
GEMM1_KEYS = GEMM2_KEYS + ("FUSE_ACT", "FUSE_QUANT", "PERMUTE_A", "HALF_TAIL", "JOINT_GATE_UP", "AMAX_EPILOGUE",
                           "GATHER_A")


def device_name() -> str:
    """``torch.cuda.get_device_name()`` with spaces and dashes as underscores (vLLM's rule), or ``"interpreter"``."""
    if INTERPRET or not torch.cuda.is_available():
        return "interpreter" if INTERPRET else "cpu"
    return torch.cuda.get_device_name().replace(" ", "_").replace("-", "_")


def config_file_name(E: int, N: int, dtype: str | None, block_shape=None, dev: str | None = None) -> str:
    """vLLM's table name: ``E=..,N=..,device_name=..[,dtype=..][,block_shape=[..]].json``."""
    dev = dev or device_name()
    d = f",dtype={dtype}" if dtype else ""
    b = f",block_shape=[{block_shape[0]},{block_shape[1]}]" if block_shape else ""
    return f"E={E},N={N},device_name={dev}{d}{b}.json"


@functools.lru_cache(maxsize=None)
def load_table(E: int, N: int, dtype: str | None, block_shape: tuple | None, dev: str) -> dict[int, dict] | None:
    """The tuned table for this shape, keyed by int M, or None when no file exists."""
    path = CONFIG_DIR / config_file_name(E, N, dtype, block_shape, dev)
    if not path.is_file():
        return None
    with open(path) as f:
        raw = json.load(f)
    return {int(m): v for m, v in raw.items()}


def default_config(M: int, E: int, N: int, K: int, topk: int, dtype: str | None, block_shape=None) -> dict:
    """Heuristic configs by average routes per expert ``T = M * topk / E`` (decode: small BLOCK_M, long K tiles
    to stream weights; prefill: 64/128-row tiles, grouped ordering for L2 reuse)."""
    if INTERPRET:  # small tiles: the interpreter runs every program in numpy
        bm = 16
        g1 = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=1)
        g2 = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=1)
        if block_shape is not None:
            g1.update(BLOCK_SIZE_N=block_shape[0], BLOCK_SIZE_K=min(64, block_shape[1]))
            g2.update(BLOCK_SIZE_K=min(64, block_shape[1]))
        return {"gemm1": g1, "gemm2": g2}
    fp8 = dtype in ("fp8_w8a8", "int8_w8a8")
    T = M * topk / max(E, 1)
    bk = 128 if fp8 else 64
    if T <= 16:
        g1 = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128 if not fp8 else 256, GROUP_SIZE_M=1,
                  num_warps=4, num_stages=4)
        g2 = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128 if not fp8 else 256, GROUP_SIZE_M=1,
                  num_warps=4, num_stages=4)
    elif T <= 64:
        g1 = dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=64, BLOCK_SIZE_K=bk * 2 if not fp8 else bk, GROUP_SIZE_M=1,
                  num_warps=4, num_stages=4)
        g2 = dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=128, BLOCK_SIZE_K=bk, GROUP_SIZE_M=1, num_warps=4, num_stages=4)
    elif T <= 192:
        g1 = dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=bk, GROUP_SIZE_M=8, num_warps=4, num_stages=4)
        g2 = dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=bk, GROUP_SIZE_M=8, num_warps=4, num_stages=4)
    else:
        g1 = dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=64, BLOCK_SIZE_K=bk, GROUP_SIZE_M=8, num_warps=8, num_stages=3)
        g2 = dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, BLOCK_SIZE_K=bk, GROUP_SIZE_M=8, num_warps=8, num_stages=3)
    if block_shape is not None:
        # block scales: a K tile must stay inside one scale group; fuse the 1x128 requant into GEMM1 (BLOCK_N 128)
        for g in (g1, g2):
            g["BLOCK_SIZE_K"] = block_shape[1]
        g1["BLOCK_SIZE_N"] = block_shape[0]
        if g1["BLOCK_SIZE_M"] == 128:
            g1["BLOCK_SIZE_M"] = g2["BLOCK_SIZE_M"] = 64
            g1["num_warps"] = 8
    return {"gemm1": g1, "gemm2": g2}


def sanitize_config(cfg: dict, *, block_shape=None) -> dict:
    """Fill optional keys and enforce the constraints the kernels rely on (raises ValueError when violated)."""
    out = {"gemm1": dict(cfg["gemm1"]), "gemm2": dict(cfg["gemm2"])}
    for g in out.values():
        g.setdefault("GROUP_SIZE_M", 1)
        g.setdefault("num_warps", 4)
        g.setdefault("num_stages", 3)
        g.setdefault("USE_TMA", 0)
        g.setdefault("N_TILES", 1)
        g.setdefault("FLATTEN", 0)
        g.setdefault("PROMOTE_K", DEFAULT_PROMOTE_K)
        # MOE_TRITON_FAST_ACCUM=1 forces the in-place form where a config does not say: only to show that the
        # conformance accumulation probe catches it (conformance/test_accumulation.py); never for real use.
        g.setdefault("FAST_ACCUM", int(os.environ.get("MOE_TRITON_FAST_ACCUM", "0")))
        pk = g["PROMOTE_K"]
        if not (isinstance(pk, int) and 16 <= pk <= MAX_PROMOTE_K and not pk & (pk - 1)):
            raise ValueError(f"PROMOTE_K={pk!r} must be a power of two in [16, {MAX_PROMOTE_K}] (K elements per FP8 "
                             "promotion interval)")
        g.setdefault("SPLIT_K", 1)
        if not (isinstance(g["SPLIT_K"], int) and 1 <= g["SPLIT_K"] <= 16):
            raise ValueError(f"SPLIT_K={g['SPLIT_K']!r} must be an int in [1, 16] (programs per output tile)")
        if g["SPLIT_K"] > 1 and g.get("FLATTEN", 0):
            # the split's arrival barrier inside a software-pipelined (tile, K) loop is not a schedule anyone checked
            raise ValueError("SPLIT_K > 1 does not combine with FLATTEN (use N_TILES without FLATTEN)")
        halves = g.get("N_HALVES", 0)
        if halves not in (0, 1) or halves and not (g.get("PINGPONG", 0) or g.get("COOPERATIVE", 0)):
            raise ValueError(f"N_HALVES={g.get('N_HALVES')!r} must be 0 or 1, and 1 only with PINGPONG or COOPERATIVE "
                             "(it is a schedule of the warp-specialized kernel, gluon_ws)")
        qw = g.get("QUANT_WARPS", 4)
        if not isinstance(qw, int) or isinstance(qw, bool) or qw not in (1, 2, 4, 8, 16):
            raise ValueError(f"QUANT_WARPS={qw!r} must be a power of two in [1, 16] (warps per requantization program)")
        if not (isinstance(g["N_TILES"], int) and g["N_TILES"] >= 1):
            raise ValueError(f"N_TILES={g['N_TILES']!r} must be a positive int (N tiles per program)")
        for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"):
            v = g[k]
            if v < 16 or v & (v - 1):
                raise ValueError(f"{k}={v} must be a power of two >= 16")
        if block_shape is not None and block_shape[1] % g["BLOCK_SIZE_K"]:
            raise ValueError(f"BLOCK_SIZE_K={g['BLOCK_SIZE_K']} must divide the scale group {block_shape[1]} "
                             "(a K tile spanning two groups would use one scale: vLLM #52576)")
    if "QUANT_WARPS" in out["gemm1"]:
        raise ValueError("QUANT_WARPS is a gemm2 key (the requantization kernel runs between the GEMMs, before GEMM2)")
    out["gemm1"].setdefault("FUSE_ACT", 1)
    out["gemm1"].setdefault("FUSE_QUANT", 1)
    out["gemm1"].setdefault("PERMUTE_A", 0)
    out["gemm1"].setdefault("HALF_TAIL", 0)
    out["gemm1"].setdefault("JOINT_GATE_UP", 0)
    out["gemm1"].setdefault("AMAX_EPILOGUE", 0)
    if "AMAX_EPILOGUE" in out["gemm2"]:
        raise ValueError("AMAX_EPILOGUE is a gemm1 key (GEMM1's epilogue finds the requantization's amax)")
    if out["gemm1"]["AMAX_EPILOGUE"] not in (0, 1, 2, 3):
        raise ValueError(f"AMAX_EPILOGUE={out['gemm1']['AMAX_EPILOGUE']!r} must be 0 (act_quant's amax pass), 1 "
                         "(GEMM1's epilogue, atomics), 2 (slots, GEMM2 quantizes on load) or 3 (slots, reduced by "
                         "the requantization kernel)")
    if "GATHER_A" in out["gemm2"]:
        raise ValueError("GATHER_A is a gemm1 key (GEMM1's producer gathers the hidden states' rows by route)")
    g1 = out["gemm1"]
    if g1.get("GATHER_A", 0) and (g1["PERMUTE_A"] or not (g1.get("PINGPONG", 0) or g1.get("COOPERATIVE", 0))):
        raise ValueError("GATHER_A gathers GEMM1's rows in gluon_ws's producer: it needs PINGPONG or COOPERATIVE and "
                         "no PERMUTE_A (which copies the rows into sorted order instead)")
    if out["gemm1"]["HALF_TAIL"] and out["gemm1"]["BLOCK_SIZE_M"] < 32:
        raise ValueError(f"HALF_TAIL needs BLOCK_SIZE_M >= 32 (tail tiles of BLOCK_SIZE_M / 2 >= 16 rows), got "
                         f"{out['gemm1']['BLOCK_SIZE_M']}")
    bm1, bm2 = out["gemm1"]["BLOCK_SIZE_M"], out["gemm2"]["BLOCK_SIZE_M"]
    if bm2 != bm1 and not (out["gemm1"]["HALF_TAIL"] and bm2 == bm1 // 2):
        raise ValueError("gemm1 and gemm2 must use the same BLOCK_SIZE_M (the route layout's block), or with gemm1's "
                         "HALF_TAIL gemm2 half of it (GEMM2 then runs the layout's half blocks, not the tile list)")
    return out


def get_config(M: int, E: int, N: int, K: int, topk: int, dtype: str | None, block_shape=None,
               override: dict | None = None, act_elt: int = 2) -> dict:
    """The config for a batch of ``M`` tokens: ``override``, else the tuned table's nearest M, else the default;
    ``act_elt``: bytes per unquantized activation element (4 for fp32: see ``fit_shared_memory``)."""
    if override is not None:
        if dtype != "fp8_w8a8" and any(override[g].get("SWAP_AB", 0) for g in ("gemm1", "gemm2") if g in override):
            raise ValueError("SWAP_AB is implemented for FP8 GEMMs only (dtype fp8_w8a8), not "
                             f"{dtype or 'unquantized'}")
        return sanitize_config(override, block_shape=block_shape)
    table = load_table(E, N, dtype, tuple(block_shape) if block_shape else None, device_name())
    if table:
        m = min(table, key=lambda x: abs(x - M))
        # a tuned entry for a very different batch (e.g. a prefill entry for decode) is worse than the default
        if max(m, M) <= 8 * max(min(m, M), 1):
            try:
                return fit_shared_memory(sanitize_config(table[m], block_shape=block_shape), act_elt)
            except (KeyError, ValueError):
                pass
    return fit_shared_memory(sanitize_config(default_config(M, E, N, K, topk, dtype, block_shape),
                                             block_shape=block_shape), act_elt)


#: Shared memory one block may opt into on sm_90 (H100 / H200), bytes: the fallback where the device is not asked.
SMEM_LIMIT_SM90 = 232448


def shared_memory_limit() -> int:
    """Bytes of shared memory one block may use on the current device (``SMEM_LIMIT_SM90`` without a GPU)."""
    if INTERPRET or not torch.cuda.is_available():
        return SMEM_LIMIT_SM90
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "shared_memory_per_block_optin", SMEM_LIMIT_SM90))


def shared_memory_estimate(g: dict, act_elt: int, b_tiles: int) -> int:
    """Upper estimate of one GEMM config's pipelined operand buffers: ``num_stages`` copies of an A tile
    (``BLOCK_M x BLOCK_K``) and ``b_tiles`` B tiles (``BLOCK_K x BLOCK_N``; GEMM1 fuses gate and up: 2)."""
    return g["num_stages"] * (g["BLOCK_SIZE_M"] + b_tiles * g["BLOCK_SIZE_N"]) * g["BLOCK_SIZE_K"] * act_elt


def fit_shared_memory(cfg: dict, act_elt: int, limit: int | None = None) -> dict:
    """Shrink a config sized for 16-bit operands until its operand buffers fit the device's shared memory: fp32
    activations need twice the bytes per stage, and an over-sized config does not compile (``OutOfResources``:
    found by ``conformance.fuzz`` at fp32, M = 257). Drops pipeline stages (to 2), then halves BLOCK_SIZE_K (to 16;
    a power of two dividing a scale group still divides it). 16-bit configs are returned as they are (the tuned
    tables compile: their GPU runs say so)."""
    if act_elt <= 2:
        return cfg
    limit = shared_memory_limit() if limit is None else limit
    out = {"gemm1": dict(cfg["gemm1"]), "gemm2": dict(cfg["gemm2"])}
    for name, g in out.items():
        b_tiles = 2 if name == "gemm1" else 1
        while shared_memory_estimate(g, act_elt, b_tiles) > limit:
            if g["num_stages"] > 2:
                g["num_stages"] -= 1
            elif g["BLOCK_SIZE_K"] > 16:
                g["BLOCK_SIZE_K"] //= 2
            else:
                break
    return out
