"""What the triton backend's tools share: their named shapes, weights, routings and input sets, and their timer.

The shapes are the triton suite of ``benchmarks/suites.toml`` under the names the tuned tables, the notes and the
tools' command lines use (``qwen3_30b_fp8blk``: the suite's ``aliases``); weights come from
``benchmarks.harness.make_weights`` (the reference's quantizers, as conformance), time from
``benchmarks.timing.measure`` (CUDA graphs, median of rounds), the step's input quantization from
``benchmarks.variants.triton.quantize_a1``. Nothing here touches a GPU at import time.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

__all__ = ["Shape", "shapes", "shape", "make_weights", "make_routing", "draw_inputs", "time_us", "time_interleaved"]


@dataclass(frozen=True)
class Shape:
    """One experts layer as the tools name it: ``E`` experts held (routing over them), ``topk``, ``K`` hidden size,
    ``I`` intermediate size, ``scheme`` (``specs/schemes.toml``), activation name, expert biases."""

    name: str
    E: int
    topk: int
    K: int
    I: int  # noqa: E741 (vLLM's name)
    scheme: str
    activation: str = "silu"
    bias: bool = False

    @property
    def table_key(self) -> tuple[str | None, tuple[int, int] | None]:
        """``(dtype tag, block shape)`` of the tuned table the launch reads for this scheme (``configs.load_table``;
        ``experts.plan_quant``'s ``cfg_dtype`` / ``block_shape``): block FP8 ``("fp8_w8a8", (128, 128))``, other FP8
        ``("fp8_w8a8", None)``, INT8 ``("int8_w8a8", None)``, unquantized ``(None, None)``."""
        if self.scheme.startswith("fp8_block128"):
            return "fp8_w8a8", (128, 128)
        if self.scheme.startswith("fp8"):
            return "fp8_w8a8", None
        if self.scheme.startswith("int8"):
            return "int8_w8a8", None
        return None, None


@cache
def shapes() -> tuple[Shape, ...]:
    """The triton suite's shapes (``benchmarks/suites.toml [suites.triton]``) by their alias."""
    from benchmarks.shapes import experts_shape
    from benchmarks.suites import suite

    out = []
    for alias, shape_id in suite("triton").aliases.items():
        s = experts_shape(shape_id)
        out.append(Shape(alias, s.E, s.topk, s.K, s.I, s.scheme, s.model.activation, s.model.expert_bias))
    return tuple(out)


def shape(name: str) -> Shape:
    sh = next((s for s in shapes() if s.name == name), None)
    if sh is None:
        raise SystemExit(f"unknown shape {name!r}; names: {[s.name for s in shapes()]}")
    return sh


def make_weights(sh: Shape, scheme: str, dev, seed: int = 0):
    """``(w1, w2, quant_config, activation, dtype)``: ``benchmarks.harness.make_weights`` for ``sh`` in ``scheme``
    (bf16 weights, fp16 for ``fp16``; gpt-oss's SWIGLUOAI alpha 1.702 and limit 7)."""
    from benchmarks.harness import make_weights as weights
    from reference.activation import MoEActivation

    g = torch.Generator(device=dev).manual_seed(seed)
    dt = torch.float16 if scheme == "fp16" else torch.bfloat16
    act = MoEActivation.from_str(sh.activation)
    extra = dict(gemm1_alpha=1.702, gemm1_clamp_limit=7.0) if act is MoEActivation.SWIGLUOAI else {}
    n = 2 * sh.I if act.is_gated else sh.I
    w1, w2, qc = weights(sh.E, n, sh.K, sh.I, scheme, dt, dev, g, bias=sh.bias, **extra)
    return w1, w2, qc, act, dt


def make_routing(M: int, E: int, topk: int, dev, seed: int):
    """``(topk_weights, topk_ids)`` of ``M`` tokens over ``E`` experts, seeded (``benchmarks.harness.draw_routing``)."""
    from benchmarks.harness import draw_routing

    return draw_routing(M, E, topk, dev, torch.Generator(device=dev).manual_seed(seed))


def draw_inputs(sh: Shape, M: int, dev, plan, qc, dt, R: int, seed: int):
    """``R`` input sets of ``sh`` at ``M`` tokens (so that at decode the touched experts are not all in L2):
    ``(xs, routes, a1s)``, ``routes[r] = make_routing(..., seed + r)``, ``a1s[r] = quantize_a1(xs[r])``."""
    from benchmarks.variants.triton import quantize_a1

    xs, routes, a1s = [], [], []
    for r in range(R):
        x = torch.randn(M, sh.K, device=dev, dtype=dt)
        routes.append(make_routing(M, sh.E, sh.topk, dev, seed=seed + r))
        xs.append(x)
        a1s.append(quantize_a1(x, plan, qc))
    return xs, routes, a1s


def time_us(call, n_sets: int, dev, budget_s: float = 0.4, *, keep_runner: bool = False):
    """Median per-call device time (us) of ``call(i)``, ``i`` in ``range(n_sets)`` (``benchmarks.timing.measure``:
    CUDA graph of >= ``n_sets`` calls, rounds for ``budget_s``); with ``keep_runner`` also the open runner."""
    from benchmarks.timing import Settings, measure

    settings = Settings(budget_s=budget_s, min_rounds=5, max_rounds=60)
    if keep_runner:
        m, runner = measure(call, n_sets, dev, settings, keep_runner=True)
        return m.us, runner
    return measure(call, n_sets, dev, settings).us


def time_interleaved(calls: dict, n_sets: int, dev, budget_s: float = 0.4):
    """Time several implementations of one step side by side: each ``calls[name](i)`` (``i`` in ``range(n_sets)``) is
    prepared as a :class:`benchmarks.timing.Runner` (CUDA graph of >= ``n_sets`` calls) and all are timed round for
    round in turn (``benchmarks.timing.measure_interleaved``: A B C, then C B A, ...), ``budget_s`` of rounds each, so
    that the power cap's state falls on all of them alike (the bench's own method; timed one after the other, the
    same config read 5% apart on an H200). Returns ``(interleaved, failed)``: the
    :class:`benchmarks.timing.Interleaved` of those that prepared (None if none did) and ``{name: "Type: message"}``
    of those whose preparation raised."""
    from benchmarks.timing import Runner, Settings, measure_interleaved

    settings = Settings(budget_s=budget_s, min_rounds=5, max_rounds=60)
    runners, failed = {}, {}
    for name, call in calls.items():
        r = Runner(call, n_sets, dev, settings)
        try:
            r.prepare()
        except Exception as exc:  # noqa: BLE001 - reported by name, the others are still timed
            failed[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
            continue
        runners[name] = r
    try:
        return (measure_interleaved(runners) if runners else None), failed
    finally:
        for r in runners.values():
            r.close()
