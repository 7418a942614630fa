"""Tune the launch configurations of the triton backend's MoE GEMMs on the GPU; writes ``configs/*.json``.

    python -m tools.triton.tune --shapes qwen3_30b_bf16,dsv3_ep8_fp8blk --ms 1,8,64,1024,4096 \
        --out backends/triton/configs [--budget-s 540]

Shapes are the names of ``tools.triton.common.shapes()`` (the triton suite of ``benchmarks/suites.toml``), or ``E,topk,K,I,scheme[,activation]`` tuples (scheme: bf16, fp16,
fp8_block128, fp8_tensor, fp8_channel_token, int8_channel_token). For each shape and M the tuner

1. draws 4 routings (top-k of softmax of random logits; decode rotates them so L2 does not hold the experts),
2. for each candidate BLOCK_SIZE_M of the regime (tokens per expert; in prefill also 128-row tiles with
   ``HALF_TAIL``, i.e. over a 64-row padding), times GEMM1 (with its fused activation /
   requantization, or the separate kernel when unfused) over the GEMM1 candidates with GEMM2 fixed, then GEMM2 over
   its candidates with the best GEMM1 (CUDA graphs of the calls, median of replays),
3. times each BLOCK_SIZE_M's pair of winners over the whole GEMM stage, side by side, round for round in turn (the
   bench's interleaved method; with ``--keep-entry`` the table's entry and an A/A twin of it beside them) and keeps
   the fastest (over the entry only beyond the noise and the twin's spread: ``_pick``),

and merges the winners into ``E={E},N={I},device_name={GPU}[,dtype=..][,block_shape=[..]].json`` (existing entries
for other M are kept). A candidate that fails to compile or launch is skipped. Stops starting new shapes / Ms after
``--budget-s`` seconds, writing what it has.

``--variants [FAMILIES]`` (after tuning) only revisits the existing entries of ``--ms``: GEMM1 gathering its input
rows vs reading them pre-permuted (``input``: ``PERMUTE_A``, with and without TMA), with the gate and up halves as
one weight tile or two (``joint``: ``JOINT_GATE_UP``), each with and without ``HALF_TAIL`` (``half_tail``: experts
padded to half a tile, one half-height tail tile each), and for block FP8 with GEMM1, GEMM2 or both on the Gluon
kernel of ``gluon_sm90.py`` (``gluon``: ``GLUON``, unfused or gated, one program per tile or ``PERSISTENT``), on the
warp-specialized kernel of ``gluon_ws.py`` (``ws``: ``PINGPONG`` / ``COOPERATIVE``, bf16 and block FP8), and with
programmatic dependent launch between the GEMMs (``pdl``: ``PDL``), and decode GEMM2s computing several N tiles
per program (``ntiles``: ``N_TILES``, ``FLATTEN``); outputs must agree (see ``tune_variants``), the
variants whose output passes are timed side by side, round for round in turn (the bench's interleaved method), and the
fastest replaces the entry only if its paired rounds put it below the entry's time beyond the noise (``_pick``). ``--variants half_tail`` (for example) tries only that family
against the entry.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

T0 = time.time()
# a second instance of a table entry, timed beside it and its rivals (the placement's share of a ratio: _pick)
TWIN = "entry twin (A/A)"


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def _c(bm, bn, bk, gm, w, s, tma=0, **extra):
    d = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=gm, num_warps=w, num_stages=s,
             USE_TMA=tma)
    d.update(extra)
    return d


def candidates(M, E, topk, fp8_block, fp8, swap=False):
    """``{key: (gemm1 candidates, gemm2 candidates)}`` for the regime of M (tokens per expert T): one key per
    BLOCK_SIZE_M, and ``"128h"`` for 128-row tiles with ``HALF_TAIL`` in the prefill regime. ``swap`` (FP8 weights
    and activations): the decode lists also hold ``SWAP_AB`` tiles (the weight rows on the wgmma's M: GEMM1 32 / 64
    columns with gate and up as one tile, GEMM2 64 columns), which the ``swap`` variant family, flipping SWAP_AB on
    the entry's own (often too narrow) tile, does not reach (fourteenth session: the Qwen3-30B per-channel decode
    entries 3-4% faster on them).

    Small, hand-pruned lists (each distinct config compiles once, ~1 s): decode streams weights (BLOCK_M 16, long
    K tiles, deep pipelines), prefill is MMA-bound (64/128-row tiles, 4/8 warps, grouped tile order, TMA weights).
    """
    T = M * topk / E
    bk2 = 256 if fp8 and not fp8_block else 128
    if T <= 24:
        bms = [16] if T <= 12 else [16, 32]
    elif T <= 96:
        bms = [32, 64]
    else:
        bms = [64, 128]
    out = {}
    for bm in bms:
        if bm <= 32:
            g1 = [_c(bm, 32, 128, 1, 4, 4), _c(bm, 64, 128, 1, 4, 4), _c(bm, 64, 128, 1, 4, 4, 1),
                  _c(bm, 128, 128, 1, 4, 3), _c(bm, 32, bk2, 1, 4, 4), _c(bm, 64, 64, 1, 4, 6)]
            g2 = [_c(bm, 64, 128, 1, 4, 4), _c(bm, 64, 128, 1, 4, 4, 1), _c(bm, 128, 128, 1, 4, 3),
                  _c(bm, 32, 128, 1, 4, 4), _c(bm, 64, bk2, 1, 4, 3), _c(bm, 128, 64, 1, 4, 5)]
            # GEMM2's K (= I) is short: a program's few K tiles can all be in flight at once (deep pipelines, wide
            # tiles, about one program per SM), so that a program's life is one memory round trip, not several
            g2 += [_c(bm, 128, 128, 1, 4, 5), _c(bm, 128, 128, 1, 4, 6), _c(bm, 256, 64, 1, 8, 6),
                   _c(bm, 256, 128, 1, 8, 5), _c(bm, 64, 256, 1, 4, 3), _c(bm, 128, 256, 1, 8, 3)]
            if swap:
                g1 += [_c(bm, 32, 128, 1, 4, 5, SWAP_AB=1, JOINT_GATE_UP=1),
                       _c(bm, 64, 128, 1, 4, 4, SWAP_AB=1, JOINT_GATE_UP=1)]
                g2 += [_c(bm, 64, 128, 1, 4, 3, SWAP_AB=1), _c(bm, 64, bk2, 1, 4, 3, SWAP_AB=1)]
            if T <= 2:  # M ~ 1: a few experts x one row; more, narrower programs and fewer warps cut latency
                g1 += [_c(bm, 16, 128, 1, 2, 4), _c(bm, 32, 128, 1, 2, 5), _c(bm, 16, bk2, 1, 4, 3),
                       _c(bm, 32, 128, 1, 4, 4, 1)]
                g2 += [_c(bm, 32, 128, 1, 2, 4), _c(bm, 16, 128, 1, 2, 4), _c(bm, 32, bk2, 1, 4, 3),
                       _c(bm, 32, 128, 1, 4, 4, 1)]
        elif bm == 64:
            g1 = [_c(64, 64, 64, 8, 4, 4), _c(64, 128, 64, 8, 4, 3, 1), _c(64, 64, 128, 8, 4, 3),
                  _c(64, 128, 128, 8, 8, 3), _c(64, 64, 64, 16, 4, 5), _c(64, 128, 64, 8, 8, 4)]
            g2 = [_c(64, 128, 64, 8, 4, 4), _c(64, 128, 128, 8, 4, 3, 1), _c(64, 256, 64, 8, 8, 3),
                  _c(64, 64, 128, 8, 4, 4), _c(64, 128, 64, 16, 4, 5), _c(64, 256, 64, 8, 8, 4, 1)]
        else:
            g1 = [_c(128, 64, 64, 8, 8, 3), _c(128, 64, 64, 8, 8, 4, 1), _c(128, 128, 64, 8, 8, 3),
                  _c(128, 64, 128, 8, 8, 3, 1), _c(128, 128, 64, 16, 8, 4), _c(128, 128, 64, 8, 8, 3, 1)]
            g2 = [_c(128, 128, 64, 8, 8, 3), _c(128, 128, 64, 8, 8, 4, 1), _c(128, 256, 64, 8, 8, 3),
                  _c(128, 128, 128, 8, 8, 3, 1), _c(128, 256, 64, 16, 8, 3, 1), _c(128, 128, 64, 16, 8, 5)]
        if bm >= 64:  # short GEMM2 K (I = 256 / 384): two stages free shared memory for more programs per SM
            g2 += [dict(c, num_stages=2) for c in g2[:3]]
        if fp8_block:  # K tiles inside one 128 scale group; GEMM1 N tile 128 fuses the 1x128 requantization
            g1 = [dict(c, BLOCK_SIZE_K=128) for c in g1 if c["BLOCK_SIZE_N"] in (32, 64, 128)]
            g1 = [dict(c, FUSE_QUANT=int(c["BLOCK_SIZE_N"] == 128)) for c in g1]
            g2 = [dict(c, BLOCK_SIZE_K=128) for c in g2]
        # several N tiles per program over the same rows (FLATTEN: the tile loop and the K loop pipelined as one)
        g2 += [dict(c, N_TILES=n, FLATTEN=f) for c in g2[:2] for n in (2, 4) for f in (0, 1)]
        if bm >= 64:
            g1 += [dict(c, N_TILES=2, FLATTEN=f) for c in g1[:2] for f in (0, 1)]
            # gate and up rows as one weight tile: one MMA chain twice as wide (a 128 x 256 tile at BLOCK_N 128)
            g1 += [dict(c, JOINT_GATE_UP=1) for c in g1[:4]]
        out[bm] = (_dedupe(g1), _dedupe(g2))
    if 128 in out:  # 128-row tiles over a 64-row padding (one 64-row tail tile per expert): HALF_TAIL
        out["128h"] = ([dict(c, HALF_TAIL=1) for c in out[128][0]], out[128][1])
    return out


def _dedupe(configs):
    """The configs in order, without repeats (each list on its own: GEMM1 and GEMM2 may share a config)."""
    seen, out = set(), []
    for c in configs:
        key = json.dumps(c, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _smem_ok(cfg, elt, fuse_pair):
    """Rough shared-memory estimate: stages * (A tile + B tile(s)) must fit in ~227 KB."""
    bm, bn, bk, st = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"], cfg["num_stages"]
    b_rows = 2 * bn if fuse_pair else bn
    return st * (bm * bk + b_rows * bk) * elt <= 220 * 1024


def _draw_inputs(sh, M, dev, plan, qc, dt, R=4):
    """``R`` routings (seeded by M) and GEMM1 inputs (quantized per ``plan``): ``(routes, [(a1q, a1q_scale)])``."""
    from tools.triton.common import draw_inputs

    _, routes, a1s = draw_inputs(sh, M, dev, plan, qc, dt, R, seed=77 * M)
    return routes, a1s


def _reference_judge(sh, M, x, route, w1, w2, qc, act, dt):
    """``judge(out) -> benchmarks.check.Check``: ``out`` (the variant's output on input set 0) against the reference
    (``reference.experts.fused_experts`` on this device, computed once) within the error model's bound for the call
    (``reference.error_model.experts_error_bound`` at its routed rows, the heavy event on its own values): the one
    rule the conformance suite and the benchmark's check judge by."""
    from benchmarks.check import verdict
    from reference.error_model import experts_error_bound
    from reference.experts import fused_experts_with_heavy

    topk_weights, topk_ids = route
    ref, heavy = fused_experts_with_heavy(x, w1, w2, topk_weights, topk_ids, quant_config=qc, activation=act,
                                          global_num_experts=sh.E)
    bound = experts_error_bound(qc, act_dtype=dt, K=sh.K, I=sh.I, activation=act, routed_rows=M * sh.topk,
                                routes_per_row=sh.topk, heavy=heavy)
    return lambda out: verdict(out, ref, bound)


def _read_table(fname) -> dict:
    if not os.path.isfile(fname):
        return {}
    with open(fname) as f:
        return json.load(f)


def _write_table(fname, table: dict) -> None:
    os.makedirs(os.path.dirname(fname) or ".", exist_ok=True)
    with open(fname, "w") as f:
        json.dump(dict(sorted(table.items(), key=lambda kv: int(kv[0]))), f, indent=1)


def workspaces(sh, M, cfg, dev):
    """``(ws13, ws2)``: byte buffers for ``run_experts``'s workspaces that fit a config's layout at ``M`` tokens (the
    sweep's, and ``tools/diag/aa_timing.py --shared-ws``: copies of one call on the same addresses)."""
    from backends.triton.experts import layout_block, layout_rows

    rows = layout_rows(M * sh.topk, sh.E, layout_block(cfg))
    ws13 = torch.empty(rows * sh.I * 4 + rows * (sh.I // 128 + 1) * 4 + 1024, dtype=torch.uint8, device=dev)
    ws2 = torch.empty(max(rows * 2 * sh.I, M * sh.topk * sh.K) * 4 + 1024, dtype=torch.uint8, device=dev)
    return ws13, ws2


def _gemms_call(sh, entry, w1, w2, qc, act, plan, routes, a1s, outs, ws=None):
    """``call(i, stages="gemms")``: GEMM1 (+ its activation / requantization) + GEMM2 of a table entry on input set
    ``i % R`` (``run_experts`` on the entry's own layout, as the step runs it; ``stages="all"`` adds the top-k sum
    into ``outs``, for a check of the output); ``ws``: ``(ws13, ws2)`` to run on (``workspaces``), else
    ``run_experts`` allocates its own."""
    from backends.triton import configs as C
    from backends.triton.experts import run_experts, step_layout

    cfg = C.sanitize_config(entry, block_shape=plan.block_shape)
    lays = [step_layout(ids, cfg, sh.E) for _, ids in routes]
    R = len(routes)

    ws13, ws2 = ws if ws is not None else (None, None)

    def call(i, stages="gemms"):
        r = i % R
        run_experts(out=outs, a1q=a1s[r][0], a1q_scale=a1s[r][1], w1=w1, w2=w2, topk_weights=routes[r][0],
                    topk_ids=routes[r][1], activation=act, expert_map=None, num_ids=sh.E, qc=qc, plan=plan, cfg=cfg,
                    ws13=ws13, ws2=ws2, layout=lays[r], stages=stages)
    return call


def _entry_call(sh, entry, dev, w1, w2, qc, act, plan, routes, a1s, outs):
    """``--keep-entry``: GEMM1 + GEMM2 of a table entry (``_gemms_call``), called once to show that it still runs
    (raises otherwise); returned for ``_choose`` to time beside the candidates."""
    call = _gemms_call(sh, entry, w1, w2, qc, act, plan, routes, a1s, outs)
    call(0)
    torch.cuda.synchronize(dev)
    return call


def _choose(cands: dict, n_sets, dev, budget_s, entry_call=None, twin_call=None):
    """``(name, why)``: which of the sweep's candidates (``cands``: ``{name: call}``, one per ``BLOCK_SIZE_M``, each
    its GEMM1 and GEMM2 winners) a table takes, or ``"entry"`` to keep the entry (``--keep-entry``: ``entry_call``,
    with ``twin_call`` a second instance of it). All are timed side by side over the whole GEMM stage
    (``time_interleaved``; the sweep timed GEMM1 and GEMM2 apart, one candidate after the other, under whatever
    clock the power cap left each), and the fastest wins, over an entry only if the 95% interval of its paired
    ratio to the entry lies below 1.00 by more than the twin's spread (``_pick``). An entry that no longer runs is
    replaced, a candidate that does not run is never taken; ``(None, why)`` when none of the candidates runs and
    there is no entry to keep."""
    from tools.triton.common import time_interleaved

    calls = dict(cands)
    if entry_call is not None:
        calls["entry"] = entry_call
        if twin_call is not None:
            calls[TWIN] = twin_call
    inter, failed = time_interleaved(calls, n_sets, dev, budget_s)
    notes = "".join(f"; {k} failed: {v}" for k, v in failed.items())
    if inter is None or not set(inter.rounds) - {"entry", TWIN}:
        return ("entry" if inter is not None and "entry" in inter.rounds else None), f"no candidate ran{notes}"
    # no entry, or one that failed: _pick takes the fastest candidate by median
    name, why = _pick(inter.rounds, "entry" if "entry" in inter.rounds else None, TWIN)
    times = ", ".join(f"{k} {m.us:.2f} us" for k, m in inter.measurements.items())
    return name, f"{why}; {times}{notes}"


def tune_shape(sh, Ms, dev, out_dir, budget_s, reps_s=0.25, keep_entry=False):
    """Sweep the candidates of each M (see the module's docstring) and write the winners into the shape's table in
    ``out_dir``; ``keep_entry``: an M's existing entry is timed too and kept when the best candidate is not faster
    (so a re-tune never replaces a variant-tuned entry, e.g. one on the Gluon kernels, by a slower sweep winner)."""
    from backends.triton import configs as C
    from tools.triton.common import make_weights, time_us
    from backends.triton.experts import plan_quant, route_layout, route_tiles_apply, route_tiles_layout, run_experts

    w1, w2, qc, act, dt = make_weights(sh, sh.scheme, dev)
    plan = plan_quant(qc)
    elt_w = w1.element_size()
    fname = os.path.join(out_dir, C.config_file_name(sh.E, sh.I, plan.cfg_dtype, plan.block_shape))
    table = _read_table(fname)
    for M in Ms:
        if time.time() - T0 > budget_s:
            log(f"budget reached, skipping {sh.name} M={M}")
            continue
        R = 4
        routes, a1s = _draw_inputs(sh, M, dev, plan, qc, dt, R)
        outs = torch.empty(M, sh.K, device=dev, dtype=dt)
        per_key = {}  # "BM=..": the key's GEMM1 and GEMM2 winners (timed together and side by side after the sweep)
        entry_call = None
        if keep_entry and str(M) in table:
            try:
                entry_call = _entry_call(sh, table[str(M)], dev, w1, w2, qc, act, plan, routes, a1s, outs)
                log(f"{sh.name} M={M} entry (runs; timed beside the candidates after the sweep): {table[str(M)]}")
            except Exception as exc:  # noqa: BLE001 - an entry that no longer runs is replaced
                log(f"  entry of M={M} failed: {type(exc).__name__}: {str(exc)[:160]}")
        for key, (g1s, g2s) in candidates(M, sh.E, sh.topk, plan.block_shape is not None,
                                          plan.kind != "none", swap=plan.kind == "fp8").items():
            bm = g1s[0]["BLOCK_SIZE_M"]
            lay_cfg = {"gemm1": {"BLOCK_SIZE_M": bm, "HALF_TAIL": g1s[0].get("HALF_TAIL", 0)}}
            lays = [route_layout(ids, lay_cfg, sh.E) for _, ids in routes]
            ws13, ws2 = workspaces(sh, M, lay_cfg, dev)

            # at decode the step runs most candidates without a layout (experts.step_layout): timed so too
            tiles = [route_tiles_layout(ids, None, sh.E) for _, ids in routes]

            def timed(cfg, stage):
                on_tiles = route_tiles_apply(cfg, M * sh.topk, sh.E, "all", None)

                def call(i):
                    r = i % R
                    run_experts(out=outs, a1q=a1s[r][0], a1q_scale=a1s[r][1], w1=w1, w2=w2,
                                topk_weights=routes[r][0], topk_ids=routes[r][1], activation=act, expert_map=None,
                                num_ids=sh.E, qc=qc, plan=plan, cfg=cfg, ws13=ws13, ws2=ws2,
                                layout=tiles[r] if on_tiles else lays[r], stages=stage)
                return time_us(call, 8 if M <= 64 else 4, dev, reps_s)

            default = C.sanitize_config(C.default_config(M, sh.E, sh.I, sh.K, sh.topk, plan.cfg_dtype,
                                                         plan.block_shape), block_shape=plan.block_shape)
            g2_fixed = dict(default["gemm2"], BLOCK_SIZE_M=bm)
            res1 = []
            for g1 in g1s:
                if not _smem_ok(g1, elt_w, True) or time.time() - T0 > budget_s + 45:
                    continue
                cfg = C.sanitize_config({"gemm1": g1, "gemm2": g2_fixed}, block_shape=plan.block_shape)
                try:
                    res1.append((timed(cfg, "gemm1"), g1))
                except Exception as exc:  # noqa: BLE001
                    log(f"  skip gemm1 {g1}: {type(exc).__name__}: {str(exc)[:120]}")
            if not res1:
                continue
            t1, g1b = min(res1, key=lambda r: r[0])
            res2 = []
            timed(C.sanitize_config({"gemm1": g1b, "gemm2": g2_fixed}, block_shape=plan.block_shape),
                  "gemm1")  # leave GEMM1's output in the workspaces for GEMM2 to read
            for g2 in g2s:
                if not _smem_ok(g2, elt_w, False) or time.time() - T0 > budget_s + 45:
                    continue
                cfg = C.sanitize_config({"gemm1": g1b, "gemm2": g2}, block_shape=plan.block_shape)
                try:
                    res2.append((timed(cfg, "gemm2"), g2))
                except Exception as exc:  # noqa: BLE001
                    log(f"  skip gemm2 {g2}: {type(exc).__name__}: {str(exc)[:120]}")
            if not res2:
                continue
            t2, g2b = min(res2, key=lambda r: r[0])
            log(f"{sh.name} M={M} BM={key}: gemm1 {t1:.2f} us {g1b} | gemm2 {t2:.2f} us {g2b}")
            per_key[f"BM={key}"] = {"gemm1": g1b, "gemm2": g2b}
            ws13 = ws2 = lays = tiles = None  # frees the GPU memory (rebound, not del: `timed` names them)
            torch.cuda.empty_cache()
        if not per_key:
            continue

        def mk(cfg):
            return _gemms_call(sh, cfg, w1, w2, qc, act, plan, routes, a1s, outs)

        keep = entry_call is not None
        name, why = _choose({k: mk(c) for k, c in per_key.items()}, 8 if M <= 64 else 4, dev, 2 * reps_s,
                            entry_call=entry_call, twin_call=mk(table[str(M)]) if keep else None)
        log(f"{sh.name} M={M} the candidates{' and the entry' if keep else ''}, interleaved: {why}")
        if name is None or name == "entry":
            log(f"BEST {sh.name} M={M}: " + ("the entry kept" if name else "nothing ran"))
            continue
        table[str(M)] = per_key[name]
        log(f"BEST {sh.name} M={M}: {name} {per_key[name]}")
        _write_table(fname, table)
    log(f"wrote {fname}")


VARIANT_FAMILIES = ("input", "joint", "half_tail", "gluon", "ws", "pdl", "ntiles", "swap", "splitk", "quant_warps",
                    "amax", "half_blocks")


def _half_block_variants(entry_g1, g2):
    """Entries whose GEMM1 has ``HALF_TAIL`` and GEMM2 the same ``BLOCK_SIZE_M``: GEMM2 on the layout's half blocks
    instead of the tile list, as ping-pong tiles of half the rows at 3 and 4 stages (``configs.sanitize_config``
    accepts GEMM2's half ``BLOCK_SIZE_M`` then; H200 thirtieth session: Mixtral bf16 M = 1024's GEMM2 from 2.55 waves
    of 128-row tiles to 4.48 waves of 64-row ones, -1.9%). The same rows and K order per output, so bitwise equal."""
    bm = entry_g1["BLOCK_SIZE_M"]
    if not entry_g1.get("HALF_TAIL", 0) or g2["BLOCK_SIZE_M"] != bm or bm // 2 < 64:
        return []
    half = {k: v for k, v in g2.items() if k != "COOPERATIVE"}
    return [(f"gemm2-half-blocks-pp{st}", entry_g1, dict(half, BLOCK_SIZE_M=bm // 2, PINGPONG=1, num_stages=st))
            for st in (3, 4)]


def _swap_variants(entry_g1, g2):
    """FP8 (block, per-tensor or per-channel) decode entries (BLOCK_SIZE_M <= 32, on ``fused_moe_kernel``) with ``SWAP_AB`` (vLLM 0.33's decode
    form: the weight rows on the wgmma's M, the tile's token rows on its N): GEMM2, GEMM1 or both, one warpgroup each
    (wgmma needs four warps and 64 weight rows: GEMM2 tiles of at least 64 columns, GEMM1 gate / up halves of 32
    columns as one joint 64-row tile, of 64 columns as two chains or one joint 128-row tile)."""
    from backends.triton.experts import GLUON_KEYS

    if g2["BLOCK_SIZE_M"] > 32 or any(g.get(k, 0) for g in (entry_g1, g2) for k in GLUON_KEYS):
        return []
    s2 = [dict(g2, SWAP_AB=1, BLOCK_SIZE_N=max(g2["BLOCK_SIZE_N"], 64), num_warps=4)]
    if g2["BLOCK_SIZE_N"] < 128:
        s2.append(dict(s2[0], BLOCK_SIZE_N=128, N_TILES=1, FLATTEN=0))
    bn1 = entry_g1["BLOCK_SIZE_N"]
    s1 = [dict(entry_g1, SWAP_AB=1, num_warps=4, JOINT_GATE_UP=1, BLOCK_SIZE_N=max(bn1, 32))]
    if bn1 <= 64:
        s1.append(dict(entry_g1, SWAP_AB=1, num_warps=4, JOINT_GATE_UP=0, BLOCK_SIZE_N=64, FUSE_QUANT=0))
    out = [(f"swap2-bn{v['BLOCK_SIZE_N']}", entry_g1, v) for v in s2]
    out += [(f"swap1-bn{v['BLOCK_SIZE_N']}" + ("-joint" if v["JOINT_GATE_UP"] else ""), v, g2) for v in s1]
    out += [(f"swap12-bn{v1['BLOCK_SIZE_N']}" + ("-joint" if v1["JOINT_GATE_UP"] else "") + f"-bn{v2['BLOCK_SIZE_N']}",
             v1, v2) for v1 in s1 for v2 in s2]
    return out


def _splitk_variants(entry_g1, g2, K, I, fp8=False):
    """Decode entries (BLOCK_SIZE_M <= 32, on ``fused_moe_kernel``) with ``SPLIT_K``: GEMM1 over 2 / 4 / 8 shares of
    K (gate / up as one joint tile: one MMA chain), GEMM2 over 2 / 4 shares where its K (= I) has at least 8 K tiles,
    and GEMM1 / GEMM2 split 4 / 2 together; ``fp8``: an unswapped GEMM1 split also with ``SWAP_AB``. Aimed at M = 1,
    where a GEMM has only (8 experts x N tiles) programs of a long K: DeepSeek-V3 TP8 GEMM1 runs 64 programs of
    7168 K each, half the SMs idle."""
    from backends.triton.experts import GLUON_KEYS

    if g2["BLOCK_SIZE_M"] > 32 or any(g.get(k, 0) for g in (entry_g1, g2) for k in GLUON_KEYS):
        return []
    out = [(f"splitk1-x{n}", dict(entry_g1, SPLIT_K=n, JOINT_GATE_UP=1), g2)
           for n in (2, 4, 8) if K >= n * entry_g1["BLOCK_SIZE_K"]]
    if fp8 and not entry_g1.get("SWAP_AB", 0):
        out += [(f"splitk1-x{n}-swap", dict(entry_g1, SPLIT_K=n, JOINT_GATE_UP=1, SWAP_AB=1, num_warps=4,
                                            BLOCK_SIZE_N=max(entry_g1["BLOCK_SIZE_N"], 32)), g2)
                for n in (2, 4, 8) if K >= n * entry_g1["BLOCK_SIZE_K"]]
    if I >= 8 * g2["BLOCK_SIZE_K"]:
        out += [(f"splitk2-x{n}", entry_g1, dict(g2, SPLIT_K=n)) for n in (2, 4)]
        if K >= 4 * entry_g1["BLOCK_SIZE_K"]:
            out.append(("splitk12-x4-x2", dict(entry_g1, SPLIT_K=4, JOINT_GATE_UP=1), dict(g2, SPLIT_K=2)))
    return out


def _ntiles_variants(entry_g1, g2):
    """Decode GEMM2s (BLOCK_SIZE_M <= 32, on ``fused_moe_kernel``): several N tiles per program (``N_TILES`` 2 / 3 /
    4, with and without ``FLATTEN``) at the entry's BLOCK_SIZE_N and at 64. Fewer, longer programs (a third of the
    grid at 3: about one wave of resident CTAs at M = 8) whose next tile's loads overlap this tile's epilogue
    (``FLATTEN``), against the one-tile programs whose short K (= I) makes each a chain of latencies."""
    from backends.triton.experts import GLUON_KEYS

    if g2["BLOCK_SIZE_M"] > 32 or any(g2.get(k, 0) for k in GLUON_KEYS):
        return []
    out = []
    for bn in sorted({g2["BLOCK_SIZE_N"], 64}):
        for n in (2, 3, 4):
            for f in (0, 1):
                out.append((f"ntiles-bn{bn}-x{n}" + ("-flat" if f else ""), entry_g1,
                            dict(g2, BLOCK_SIZE_N=bn, N_TILES=n, FLATTEN=f)))
    return out


def _gluon_variants(g1, g2):
    """Block FP8, on the Gluon kernel (``GLUON``; one warpgroup per 64 rows): GEMM2 alone (at the entry's
    BLOCK_SIZE_M, 128-column tiles); GEMM1 alone over its pre-permuted input, either unfused (``FUSE_ACT`` 0: the
    activation and requantization in ``act_quant_kernel``) or with SiLU-and-mul in its epilogue (64 output columns:
    gate | up as one 128-column MMA; ``FUSE_QUANT`` 0: requantization in ``act_quant_kernel``); and both GEMMs, at
    64- and 128-row tiles; each with one program per tile and persistent (``PERSISTENT``)."""
    bm = g1["BLOCK_SIZE_M"]

    def gl(m, bn=128, stages=4):
        return dict(BLOCK_SIZE_M=m, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=128, GROUP_SIZE_M=8, num_warps=m // 16,
                    num_stages=stages, USE_TMA=1, GLUON=1)

    def gemm1(m, fused, stages=4):
        if fused:
            return dict(gl(m, 64, stages), PERMUTE_A=1, FUSE_ACT=1, FUSE_QUANT=0)
        return dict(gl(m, 128, stages), PERMUTE_A=1, FUSE_ACT=0)

    out = []
    if bm in (64, 128):
        g2t = {k: v for k, v in g2.items() if k != "GLUON"}
        out += [("gluon2", g1, gl(bm)), (f"gluon1-bm{bm}", gemm1(bm, False), g2t),
                (f"gluon1act-bm{bm}", gemm1(bm, True), g2t)]
    for m in (64, 128):
        out += [(f"gluon12-bm{m}", gemm1(m, False), gl(m)), (f"gluon12act-bm{m}", gemm1(m, True), gl(m))]
    # each also persistent: one program per resident CTA, the next tile's loads overlapping this tile's epilogue
    return out + [(f"{n}+persist", dict(v1, PERSISTENT=1) if v1.get("GLUON") else v1,
                   dict(v2, PERSISTENT=1) if v2.get("GLUON") else v2) for n, v1, v2 in out]


def _ws_variants(entry_g1, g1, g2, fp8_block):
    """Prefill entries (BLOCK_SIZE_M >= 64) on the warp-specialized kernel of ``gluon_ws.py`` (a TMA producer warp,
    two consumer warpgroups): ``PINGPONG`` (a consumer holds a whole tile: 128 x 128 or 64 x 256 MMA columns, FP8
    64 x 128; epilogues overlap the other consumer's MMAs) and ``COOPERATIVE`` (both share a 128-row tile:
    128 x 256, FP8 128 x 128). ``fp8_block``: FP8 operands, block or per-tensor / per-channel scales (the same
    two-register-set mainloop, BLOCK_K 128: ``gluon_ws.supported``), whose tiles hold a third of the bf16 ones'
    accumulator columns, or with ``N_HALVES`` (one register set, the promotion serialized) the bf16 ones' widths. GEMM2 alone (the entry's GEMM1 kept), GEMM1 over its pre-permuted input with
    SiLU-and-mul in its epilogue (block FP8: requantized by ``act_quant_kernel``; also unfused) alone or with GEMM2,
    with and without ``HALF_TAIL`` (64-row tails), in grouped tile orders of 8 / 16 / 32 row tiles. (Decode entries
    are left alone: 64-row tiles streaming the experts' weights through the ring measured 20-30% slower there than
    ``fused_moe_kernel``'s 16-row tiles, docs/notes/triton.md.) Each variant whose GEMM1 runs on the kernel also
    comes as ``+gather``: its producer, a warpgroup, gathering the rows by route (``GATHER_A``) instead of reading
    ``PERMUTE_A``'s sorted copy (H200: 1.4-6.9% faster on six prefill entries, slower on Mixtral bf16)."""

    def ws(m, bn, stages, **extra):
        return dict(BLOCK_SIZE_M=m, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=128 if fp8_block else 64, GROUP_SIZE_M=8,
                    num_warps=4, num_stages=stages, USE_TMA=1, **extra)

    def gemm1(m, bn, stages, **extra):
        return ws(m, bn, stages, PERMUTE_A=1, **(dict(FUSE_QUANT=0) if fp8_block else {}), **extra)

    def g16(*cfgs):
        return tuple(dict(c, GROUP_SIZE_M=16) for c in cfgs)

    def tail(cfg):
        return dict(cfg, HALF_TAIL=1)

    bm = g1["BLOCK_SIZE_M"]
    if bm < 64:
        return []
    no_tail = {k: v for k, v in entry_g1.items() if k != "HALF_TAIL"}
    if fp8_block:
        pp1, pp2 = gemm1(64, 64, 6, PINGPONG=1), ws(64, 128, 6, PINGPONG=1)
        co1, co2 = gemm1(128, 64, 5, COOPERATIVE=1), ws(128, 128, 5, COOPERATIVE=1)
        out = [("ws12-pingpong-bm64", pp1, pp2), ("ws12-coop-bm128", co1, co2),
               ("ws12-coop-bm128-g16", *g16(co1, co2)), ("ws12-coop-bm128+half_tail", tail(co1), co2),
               ("ws12-coop-bm128-unfused", dict(gemm1(128, 128, 5, COOPERATIVE=1), FUSE_ACT=0), co2)]
        if bm == 64:
            out += [("ws2-pingpong", no_tail, dict(pp2, GROUP_SIZE_M=g2.get("GROUP_SIZE_M", 8))),
                    ("ws1-pingpong-bm64", pp1, g2)]
        if bm == 128:
            out += [("ws2-coop", entry_g1, co2), ("ws1-coop-bm128", co1, g2)]
        # N_HALVES: 64 x 256 MMA columns a consumer through one register set, the promotion serialized (4 stages:
        # a per-tensor / per-channel consumer holds the two K tiles of its PROMOTE_K interval)
        hp1, hp2 = gemm1(64, 128, 4, PINGPONG=1, N_HALVES=1), ws(64, 256, 4, PINGPONG=1, N_HALVES=1)
        hc1, hc2 = gemm1(128, 128, 4, COOPERATIVE=1, N_HALVES=1), ws(128, 256, 4, COOPERATIVE=1, N_HALVES=1)
        out += [("ws12-halves-pingpong-bm64", hp1, hp2), ("ws12-halves-coop-bm128", hc1, hc2),
                ("ws12-halves-coop-bm128+half_tail", tail(hc1), hc2)]
        if bm == 64:
            out += [("ws2-halves-pingpong", no_tail, dict(hp2, GROUP_SIZE_M=g2.get("GROUP_SIZE_M", 8))),
                    ("ws1-halves-pingpong-bm64", hp1, g2)]
        if bm == 128:  # (GEMM1 alone: a long-K GEMM1 beside a short-K GEMM2 kept on its entry's kernel)
            out += [("ws2-halves-coop", entry_g1, hc2), ("ws1-halves-coop-bm128", hc1, g2)]
        return _with_gather(out)
    pp1_64, pp2_64 = gemm1(64, 128, 4, PINGPONG=1), ws(64, 256, 4, PINGPONG=1)
    co1, co2, pp2 = gemm1(128, 128, 3, COOPERATIVE=1), ws(128, 256, 3, COOPERATIVE=1), ws(128, 128, 4, PINGPONG=1)
    out = [("ws12-pingpong-bm64", pp1_64, pp2_64), ("ws12-coop-bm128", co1, co2),
           ("ws12-coop-bm128+half_tail", tail(co1), co2), ("ws1-coop+ws2-pingpong", co1, pp2),
           ("ws1-coop+ws2-pingpong+half_tail", tail(co1), pp2),
           ("ws1-coop+ws2-pingpong+half_tail-g16", *g16(tail(co1), pp2))]
    # GEMM2 alone, with the entry's GEMM1
    if bm == 64:
        out += [("ws2-pingpong", no_tail, dict(pp2_64, GROUP_SIZE_M=g2.get("GROUP_SIZE_M", 8))),
                ("ws2-pingpong-g16", no_tail, dict(pp2_64, GROUP_SIZE_M=16))]
    if bm == 128:
        out += [("ws2-pingpong", entry_g1, dict(pp2, GROUP_SIZE_M=g2.get("GROUP_SIZE_M", 8))),
                ("ws2-pingpong-g32", entry_g1, dict(pp2, GROUP_SIZE_M=32)),
                ("ws2-coop", entry_g1, dict(co2, GROUP_SIZE_M=g2.get("GROUP_SIZE_M", 8)))]
    return _with_gather(out)


def _with_gather(variants):
    """``variants`` and, for each whose GEMM1 is on ``gluon_ws`` over ``PERMUTE_A``'s copy, its ``+gather`` twin
    (``GATHER_A``: the producer gathers the rows by route, no copy)."""
    twins = [(f"{n}+gather", {**{k: v for k, v in g1.items() if k != "PERMUTE_A"}, "GATHER_A": 1}, g2)
             for n, g1, g2 in variants
             if g1.get("PERMUTE_A") and (g1.get("PINGPONG") or g1.get("COOPERATIVE"))]
    return variants + twins


def tune_variants(sh, Ms, dev, out_dir, reps_s=0.3, families=VARIANT_FAMILIES, repeats=2):
    """For each M with a table entry: time GEMM1 + GEMM2 with GEMM1's input gathered in the GEMM (the entry without
    ``PERMUTE_A`` / ``HALF_TAIL`` and on ``fused_moe_kernel``: the reference output) and the variants of ``families``:

    - ``input``: pre-permuted input (``PERMUTE_A``, with the entry's and with TMA loads);
    - ``joint``: each input path also with ``JOINT_GATE_UP`` flipped (gated halves);
    - ``half_tail``: each with ``HALF_TAIL`` (``BLOCK_SIZE_M >= 64``; for a 64-row entry also with 128-row tiles
      over the same 32-row padding);
    - ``gluon`` (block FP8): the Gluon kernel for GEMM1, GEMM2 or both (see ``_gluon_variants``);
    - ``ws`` (unquantized or block FP8, SiLU): the warp-specialized kernel, ping-pong or cooperative, for GEMM1,
      GEMM2 or both (see ``_ws_variants``);
    - ``pdl`` (entries on ``fused_moe_kernel``): the entry with ``PDL`` flipped on GEMM2 (programmatic dependent
      launch: GEMM2 is launched during GEMM1's last wave and waits for its output);
    - ``ntiles`` (decode GEMM2s): ``N_TILES`` 2 / 3 / 4, with and without ``FLATTEN`` (see ``_ntiles_variants``);
    - ``swap`` (FP8 decode entries): ``SWAP_AB`` on GEMM2, GEMM1 or both (see ``_swap_variants``);
    - ``splitk`` (decode entries): ``SPLIT_K`` on GEMM1, GEMM2 or both (see ``_splitk_variants``);
    - ``quant_warps`` (quantized schemes whose GEMM1 does not requantize in its epilogue): the requantization kernel
      at 4 / 8 / 16 warps per program (``QUANT_WARPS``);
    - ``amax`` (dynamic per-tensor FP8 requantization, both GEMMs on ``fused_moe_kernel``): ``AMAX_EPILOGUE`` at
      its other values (0: the requantization's amax in its own pass; 1: in GEMM1's epilogue by atomics; 2: in
      slots, GEMM2 quantizing its A tiles on load; 3: in slots, reduced by the requantization's one pass; 2 and 3
      also with GEMM2's ``PDL`` flipped; bitwise equal);
    - ``half_blocks`` (GEMM1 with ``HALF_TAIL``): GEMM2 on the layout's half blocks as ping-pong tiles
      (``_half_block_variants``);

    and keep the fastest (timed interleaved, ``repeats`` x ``reps_s`` of rounds each; it replaces the entry only if
    faster beyond the rounds' noise: ``_pick``) whose output is bitwise equal to the gathering
    one (the input path changes no arithmetic) or, where it differs (another MMA shape, accumulation schedule or
    order of the fp32 sums), within the error model's bound against the reference for the call (``_reference_judge``:
    the one rule of the conformance suite and the benchmark's check)."""
    from backends.triton.experts import strict_kernels

    # a variant its Gluon kernel does not cover is skipped, never timed on fused_moe_kernel by mistake
    with strict_kernels():
        _tune_variants(sh, Ms, dev, out_dir, reps_s, families, repeats)


def _gather_path(entry):
    """``(gemm1, gemm2)`` of the variants' reference path for a table entry: GEMM1 on ``fused_moe_kernel`` gathering
    its rows (no Gluon kernel: those need ``PERMUTE_A`` or ``GATHER_A``; nor ``gluon_ws``'s ``N_HALVES``, which
    ``configs.sanitize_config`` rejects without it), with the entry's GEMM2 where that GEMM2 runs GEMM1's row tiles;
    a GEMM2 on the half blocks of GEMM1's ``HALF_TAIL`` (half its ``BLOCK_SIZE_M``) has no such layout here and runs
    ``fused_moe_kernel`` on GEMM1's tiles instead."""
    from backends.triton.experts import GLUON_KEYS

    g1 = {k: v for k, v in entry["gemm1"].items()
          if k not in ("PERMUTE_A", "GATHER_A", "HALF_TAIL", "PERSISTENT", "N_HALVES") + GLUON_KEYS}
    g2 = dict(entry["gemm2"])
    if g2["BLOCK_SIZE_M"] != g1["BLOCK_SIZE_M"]:
        g2 = {k: v for k, v in g2.items() if k not in ("N_HALVES",) + GLUON_KEYS}
        g2["BLOCK_SIZE_M"] = g1["BLOCK_SIZE_M"]
    return g1, g2


def _variant_list(sh, entry, plan, families):
    """``([(name, gemm1, gemm2)], entry_names)``: the variants of ``families`` that ``tune --variants`` times for a
    table entry (``entry``: ``{"gemm1", "gemm2"}``; ``plan``: ``experts.plan_quant``'s), the gathering reference path
    first, and the names of those that run the entry's own config (``configs.sanitize_config`` equal). The entry is
    always among them (appended as ``"entry"`` when no variant runs it: ``_pick`` compares against it; the
    thirty-second session's run replaced two half-block entries it had never timed)."""
    from backends.triton import configs as C
    from backends.triton.experts import GLUON_KEYS, requantizes_in_epilogue
    from backends.triton.kernels import QMODE_FP8_TENSOR_AMAX

    g1, g2_path = _gather_path(entry)
    g2 = entry["gemm2"]
    bm = g1["BLOCK_SIZE_M"]
    paths = [("gather", g1)]
    if "input" in families:
        paths += [("permute", dict(g1, PERMUTE_A=1)), ("permute+tma", dict(g1, PERMUTE_A=1, USE_TMA=1))]
    if "joint" in families and sh.activation != "swigluoai":  # gate / up halves: also as one joint tile
        flip = 1 - g1.get("JOINT_GATE_UP", 0)
        paths += [(f"{n}+joint" if flip else f"{n}-joint", dict(g, JOINT_GATE_UP=flip)) for n, g in paths]
    variants = [(n, g, g2_path) for n, g in paths]
    if "half_tail" in families and bm >= 64:
        variants += [(f"{n}+half_tail", dict(g, HALF_TAIL=1), g2) for n, g in paths]
        if bm == 64:  # same 32-row padding as the entry, but 128-row tiles where an expert has them
            variants += [(f"{n}+bm128+half_tail", dict(g, BLOCK_SIZE_M=128, HALF_TAIL=1, num_warps=8),
                          dict(g2, BLOCK_SIZE_M=128, num_warps=8))
                         for n, g in paths if n in ("gather", "permute+tma")]
    if "gluon" in families and plan.block_shape is not None:
        variants += _gluon_variants(g1, g2)
    if "pdl" in families and not any(g.get(k, 0) for g in entry.values() for k in GLUON_KEYS):
        # GEMM2 (and the requantization before it) launched during GEMM1's last wave
        variants.append(("pdl", entry["gemm1"], dict(g2, PDL=1 - g2.get("PDL", 0))))
    if "ntiles" in families:
        variants += _ntiles_variants(entry["gemm1"], g2)
    if "splitk" in families:
        variants += _splitk_variants(entry["gemm1"], g2, sh.K, sh.I, fp8=plan.kind == "fp8")
    if "quant_warps" in families and plan.kind != "none" and not requantizes_in_epilogue(entry["gemm1"], plan,
                                                                                           sh.I):
        # the requantization kernel between the GEMMs at 4 / 8 / 16 warps per program (the others than the
        # entry's): the same arithmetic, so bitwise equal
        variants += [(f"quant_warps{w}", entry["gemm1"], dict(g2, QUANT_WARPS=w)) for w in (4, 8, 16)
                     if g2.get("QUANT_WARPS", 4) != w]
    on_gluon = any(g.get(k, 0) for g in (entry["gemm1"], g2) for k in GLUON_KEYS)
    if "amax" in families and plan.a2_qmode == QMODE_FP8_TENSOR_AMAX and not entry["gemm1"].get("GLUON", 0):
        # the per-tensor amax found by its own pass (0), GEMM1's epilogue (1), GEMM1's slots with GEMM2
        # quantizing on load (2) or GEMM1's slots reduced by the requantization's one pass (3); after 2 and 3
        # GEMM2 may take PDL. The same codes, so bitwise equal. With a warp-specialized GEMM (prefill) only 0
        # and 3 (gluon_ws's consumers write slots of their own; 1 / 2 and PDL are fused_moe_kernel's)
        cur = entry["gemm1"].get("AMAX_EPILOGUE", 0)
        for v in ((0, 3) if on_gluon else (0, 1, 2, 3)):
            if v != cur:  # (GEMM2's PDL works only after the slots paths: a dead key is dropped elsewhere)
                variants.append((f"amax{v}", dict(entry["gemm1"], AMAX_EPILOGUE=v),
                                 g2 if v in (2, 3) else {k: x for k, x in g2.items() if k != "PDL"}))
            if v in (2, 3) and not on_gluon:
                variants.append((f"amax{v}-pdl", dict(entry["gemm1"], AMAX_EPILOGUE=v),
                                 dict(g2, PDL=1 - g2.get("PDL", 0))))
    if "swap" in families and plan.kind == "fp8":
        variants += _swap_variants(entry["gemm1"], g2)
    if "half_blocks" in families:
        variants += _half_block_variants(entry["gemm1"], g2)
    if "ws" in families and (sh.activation == "silu" and not sh.bias and plan.kind in ("none", "fp8")
                             or sh.activation == "swigluoai" and plan.kind == "none"):
        # FP8 per-tensor / per-channel too (issue 44: Mixtral TP2 fp8_tensor prefill), on the FP8 tile list; and
        # gpt-oss's bf16 GEMMs (interleaved SWIGLUOAI, expert bias: thirty-third session)
        variants += _ws_variants(entry["gemm1"], g1, g2, plan.kind == "fp8")
    entry_cfg = C.sanitize_config(entry, block_shape=plan.block_shape)
    entry_names = {n for n, v1, v2 in variants if _sanitized(v1, v2, plan.block_shape) == entry_cfg}
    if not entry_names:
        variants.append(("entry", entry["gemm1"], g2))
        entry_names = {"entry"}
    return variants, entry_names


def _sanitized(gemm1, gemm2, block_shape):
    """``configs.sanitize_config`` of a variant, or None where the backend rejects the pair."""
    from backends.triton import configs as C

    try:
        return C.sanitize_config({"gemm1": gemm1, "gemm2": gemm2}, block_shape=block_shape)
    except ValueError:
        return None


def _tune_variants(sh, Ms, dev, out_dir, reps_s, families, repeats):
    from backends.triton import configs as C
    from benchmarks.timing import paired_ratio
    from tools.triton.common import draw_inputs, make_weights, time_interleaved
    from backends.triton.experts import plan_quant

    w1, w2, qc, act, dt = make_weights(sh, sh.scheme, dev)
    plan = plan_quant(qc)
    fname = os.path.join(out_dir, C.config_file_name(sh.E, sh.I, plan.cfg_dtype, plan.block_shape))
    table = _read_table(fname)
    if not table:
        log(f"{sh.name}: no table {fname}")
        return
    for M in Ms:
        if str(M) not in table:
            log(f"{sh.name} M={M}: no entry")
            continue
        entry = {k: dict(v) for k, v in table[str(M)].items()}
        bm = _gather_path(entry)[0]["BLOCK_SIZE_M"]
        R = 4
        xs, routes, a1s = draw_inputs(sh, M, dev, plan, qc, dt, R, seed=77 * M)
        judge = _reference_judge(sh, M, xs[0], routes[0], w1, w2, qc, act, dt)
        outs = torch.empty(M, sh.K, device=dev, dtype=dt)
        res, first = [], None
        variants, entry_names = _variant_list(sh, entry, plan, families)
        entry_name = None  # the first of entry_names that runs and passes: the one the others are compared with
        for name, v1, v2 in variants:
            cand = {"gemm1": v1, "gemm2": v2}
            try:  # a pair the backend rejects (e.g. a GEMM1-only variant beside a GEMM2 on half blocks) is skipped
                C.sanitize_config(cand, block_shape=plan.block_shape)
                call = _gemms_call(sh, cand, w1, w2, qc, act, plan, routes, a1s, outs)
                call(0, stages="all")
                verdict, ok = "bitwise equal", True
                if first is None:
                    first = outs.clone()
                elif not torch.equal(outs.view(torch.int16), first.view(torch.int16)):
                    # Another tile, MMA shape, accumulation schedule (SWAP_AB, SPLIT_K, the Gluon kernels) or
                    # requantization flip: judged like every output, against the reference by the error model's
                    # bound for this call (benchmarks.check), not against the gathering path by a limit of its own.
                    d = ((outs.double() - first.double()).abs().max() / first.double().abs().max()).item()
                    check = judge(outs)
                    ok = check.ok
                    verdict = f"differs from gather: max_norm {d:.2e}; vs reference: {check.text}" + (
                        "" if ok else " (REJECTED)")
            except Exception as exc:  # noqa: BLE001
                log(f"  skip {name}: {type(exc).__name__}: {str(exc)[:160]}")
                continue
            log(f"{sh.name} M={M} BM={bm} {name}: {verdict}")
            if ok:
                res.append((name, cand, call))
                if entry_name is None and name in entry_names:
                    entry_name = name
        if not res:
            continue
        # timed side by side, round for round in turn (the bench's method): timed one after the other, the same
        # config read 5% apart under the power cap, and a best-of-N favoured whichever variant met the coolest clock
        cands = {name: cand for name, cand, _ in res}
        calls = {name: call for name, _, call in res}
        if entry_name is not None:  # the placement's share of a ratio (_pick): the entry again, built anew
            calls[TWIN] = _gemms_call(sh, cands[entry_name], w1, w2, qc, act, plan, routes, a1s, outs)
        inter, failed = time_interleaved(calls, 4, dev, reps_s * repeats)
        for name, why in failed.items():
            log(f"  skip {name}: {why}")
        if inter is None:
            continue
        for name, m in inter.measurements.items():
            vs = ""
            if entry_name in inter.rounds and name != entry_name:
                r, lo, hi = paired_ratio(inter.rounds[name], inter.rounds[entry_name])
                vs = f"  {r:.3f}x the entry's time ({lo:.3f}-{hi:.3f})"
            log(f"time {sh.name} M={M} {name:32s} {m.us:9.2f} us{vs}" + (" (the entry)" if name == entry_name else ""))
        name, why = _pick(inter.rounds, entry_name, TWIN)
        table[str(M)] = cands[name]
        log(f"BEST {sh.name} M={M}: {name} {inter.measurements[name].us:.2f} us ({why}; {inter.measurements[name].rounds}"
            " interleaved rounds each)")
        _write_table(fname, table)  # after every M: a run cut by its time limit keeps what it finished


def _pick(rounds, entry, twin=None):
    """``(name, why)``: the variant a table takes from interleaved timings (``rounds[name]``: per-call seconds, round
    ``j`` of every name taken side by side). The fastest by median replaces the entry (``entry``: its name, or None
    when the entry's own config was not among them) only if the 95% interval of its paired rounds' ratio to the
    entry's lies wholly below 1.00 (``benchmarks.timing.paired_ratio``): a difference the rounds' noise could explain
    keeps the entry. ``twin``: the name of a second instance of the entry (its own closure, CUDA graph and
    workspaces), never picked; the farthest end of its interval from 1.00 is the placement's share of a ratio, which
    the rounds' interval does not hold (thirty-second session, H200: identical copies of Qwen3-30B fp8_channel_token
    M = 1's entry read 0.992-1.024x of one another, each interval 0.001 wide), and the variant must beat 1.00 by
    more than that."""
    from benchmarks.timing import median_interval, paired_ratio

    med = {k: median_interval(v)[0] for k, v in rounds.items() if k != twin}
    best = min(med, key=med.get)
    if entry is None or entry not in rounds:
        return best, "the fastest median (no entry among them)"
    if best == entry:
        return entry, "the entry is the fastest"
    r, lo, hi = paired_ratio(rounds[best], rounds[entry])
    margin, aa = 0.0, ""
    if twin is not None and twin in rounds:
        _, tlo, thi = paired_ratio(rounds[twin], rounds[entry])
        margin = max(abs(1.0 - tlo), abs(1.0 - thi))
        aa = f"; the entry's twin {tlo:.3f}-{thi:.3f}x"
    if hi < 1.0 - margin:
        return best, f"{r:.3f}x the entry's time ({lo:.3f}-{hi:.3f}), below {1.0 - margin:.3f}{aa}"
    return entry, (f"the entry kept: the fastest, {best}, is {r:.3f}x its time ({lo:.3f}-{hi:.3f}), a tie within the "
                   f"noise{aa}")


def parse_shape(spec):
    from tools.triton.common import Shape, shapes

    SHAPES = shapes()
    for s in SHAPES:
        if s.name == spec:
            return s
    parts = spec.split(",")
    if len(parts) >= 5:
        E, topk, K, I = map(int, parts[:4])
        return Shape(f"custom_{E}_{topk}_{K}_{I}_{parts[4]}", E, topk, K, I, parts[4],
                     activation=parts[5] if len(parts) > 5 else "silu")
    raise SystemExit(f"unknown shape {spec!r}; names: {[s.name for s in SHAPES]} or E,topk,K,I,scheme[,act]")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="", help="';'-separated names or E,topk,K,I,scheme tuples (default: all)")
    ap.add_argument("--ms", default="1,8,64,1024,4096")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--out", default=os.path.join(root, "backends", "triton", "configs"))
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--variants", nargs="?", const=",".join(VARIANT_FAMILIES), default=None, metavar="FAMILIES",
                    help="only revisit the existing table entries of --ms with the variant families given "
                         f"(comma-separated, default all: {','.join(VARIANT_FAMILIES)}; see tune_variants)")
    ap.add_argument("--keep-entry", action="store_true",
                    help="without --variants: time each M's existing entry (and an A/A twin of it) beside the sweep's "
                         "candidates and keep it unless one is faster beyond the noise and the twin's spread")
    ap.add_argument("--repeats", type=int, default=2,
                    help="with --variants: the interleaved rounds' budget, in units of 0.3 s per variant (default 2)")
    args = ap.parse_args(argv)
    families = tuple(args.variants.split(",")) if args.variants else ()
    if set(families) - set(VARIANT_FAMILIES):
        ap.error(f"unknown variant families {sorted(set(families) - set(VARIANT_FAMILIES))}; "
                 f"known: {','.join(VARIANT_FAMILIES)}")
    if not torch.cuda.is_available():
        print("no CUDA GPU: the tuner needs one")
        return 2
    from tools.triton.common import shapes

    SHAPES = shapes()
    specs = [s for s in args.shapes.replace(";", " ").split()] if args.shapes else [s.name for s in SHAPES]
    if args.shapes and ";" not in args.shapes and all(p in {s.name for s in SHAPES} for p in args.shapes.split(",")):
        specs = args.shapes.split(",")
    dev = torch.device("cuda")
    log(f"tuning on {torch.cuda.get_device_name()} -> {args.out}")
    for spec in specs:
        sh = parse_shape(spec)
        try:
            ms = [int(m) for m in args.ms.split(",")]
            if families:
                tune_variants(sh, ms, dev, args.out, families=families, repeats=args.repeats)
            else:
                tune_shape(sh, ms, dev, args.out, args.budget_s, keep_entry=args.keep_entry)
        except Exception as exc:  # noqa: BLE001
            log(f"FAILED {spec}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
