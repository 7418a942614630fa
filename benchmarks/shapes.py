"""What the suite measures: the canonical shapes of shared/facts/perf-anchors.md, their CPU scale-downs, the router
gate shapes, and the environment knobs that pick a subset.

Experts shapes are derived from ``specs/models.toml`` (hidden size, intermediate size, experts, top-k, activation,
gpt-oss's alpha / clamp / biases) and a parallel layout: TP divides the intermediate size, EP the experts. For EP
the benchmark holds one rank's experts and routes over *those* experts only (top-k of the softmax of random logits
over the E_local experts), so every token's k experts are local: that is how vLLM's benchmark_moe.py and the
perf-anchors H200 table measure "DeepSeek-V3 EP8-local", not DeepSeek's grouped top-k over 256 experts.

Environment knobs (comma lists; unset = everything):
    MOE_BENCH_SHAPES    substrings of shape ids to keep, e.g. ``qwen3_30b,mixtral`` (``dsv3_gate`` for a gate)
    MOE_BENCH_M         token counts to keep, e.g. ``1,64,4096``
    MOE_BENCH_BACKENDS  backend names (``reference`` is the pseudo-backend ``reference.experts.fused_experts``; it is
                        benchmarked by default on CPU only)
    MOE_BENCH_QUICK=1   decode M in {1, 64} and prefill M = 4096 only (about a third of the cases)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cache

import torch

from specs import ModelSpec, load_models

__all__ = [
    "ExpertsShape",
    "GateShape",
    "DECODE_M",
    "PREFILL_M",
    "GATE_M",
    "CPU_M",
    "CPU_GATE_M",
    "gpu_experts_shapes",
    "cpu_experts_shapes",
    "gate_shapes",
    "experts_shape",
    "gate_shape",
    "selected",
    "selected_m",
    "selected_backends",
    "quick",
]

DECODE_M = (1, 8, 32, 64)
PREFILL_M = (1024, 4096, 16384)
GATE_M = (1, 16, 32, 256)
CPU_M = (1, 16, 128)
CPU_GATE_M = (1, 32)
QUICK_M = (1, 64, 4096)


@dataclass(frozen=True)
class ExpertsShape:
    """One MoE layer as one rank runs it.

    Attributes:
        id: stable id used in test ids and baselines (``<model>[_tp|_ep]-<scheme>[-cpu_small]``).
        model: the ``specs`` model it comes from. tp / ep: tensor- and expert-parallel degree applied to it.
        E: experts held (and routed over), topk, K hidden size, I intermediate size per shard, scheme (specs name).
        note: what is not literally the model (EP-local routing, CPU scale-down).
    """

    id: str
    model: ModelSpec
    scheme: str
    tp: int = 1
    ep: int = 1
    scale: int = 1  # CPU scale-down divisor of K and I (1 = the real shape)
    max_experts: int | None = None  # CPU scale-down cap on E
    note: str = ""

    @property
    def E(self) -> int:
        e = self.model.num_experts // self.ep
        return min(e, self.max_experts) if self.max_experts else e

    @property
    def topk(self) -> int:
        return min(self.model.top_k, self.E)

    @property
    def K(self) -> int:
        return _scaled(self.model.hidden_size, self.scale)

    @property
    def I(self) -> int:  # noqa: E743 (vLLM's name)
        return _scaled(self.model.intermediate_size // self.tp, self.scale)

    @property
    def activation(self):
        from reference.activation import MoEActivation

        return MoEActivation.from_str(self.model.activation)

    @property
    def N(self) -> int:
        """w1's rows: 2I for gated activations, I otherwise."""
        return 2 * self.I if self.activation.is_gated else self.I

    @property
    def dtype(self) -> torch.dtype:
        return {"fp16": torch.float16, "fp32": torch.float32}.get(self.scheme, torch.bfloat16)

    @property
    def compute_dtype(self) -> str:
        """The matmul throughput ceiling that bounds this scheme: ``bf16`` or ``fp8``."""
        return "fp8" if self.scheme.startswith("fp8") else "bf16"

    @property
    def label(self) -> str:
        par = f" TP{self.tp}" if self.tp > 1 else f" EP{self.ep}-local" if self.ep > 1 else ""
        small = " (CPU scale-down)" if self.scale > 1 or self.max_experts else ""
        return f"{self.model.display}{par} {self.scheme} (E={self.E}, topk={self.topk}, K={self.K}, I={self.I}){small}"


def _scaled(n: int, scale: int) -> int:
    if scale == 1:
        return n
    return max(128, -(-(n // scale) // 128) * 128)  # keep multiples of 128 (fp8 block scales)


@dataclass(frozen=True)
class GateShape:
    """A router gate GEMM ``(M, H) x (E, H)^T -> (M, E)`` of one model (reference.gate's tiers)."""

    id: str
    model: str
    H: int
    E: int
    x_dtype: torch.dtype
    weight_dtype: torch.dtype
    out_dtype: torch.dtype
    ops: tuple[str, ...] = field(default=())  # backend ops to time, in this order (when offered)

    @property
    def label(self) -> str:
        w = str(self.weight_dtype).removeprefix("torch.")
        return f"{self.model} router gate {self.H}x{self.E} {w} weight -> {str(self.out_dtype).removeprefix('torch.')}"


def _models() -> dict[str, ModelSpec]:
    return load_models()


@cache
def gpu_experts_shapes() -> tuple[ExpertsShape, ...]:
    """perf-anchors.md "Canonical benchmark shapes", at their real sizes."""
    m = _models()
    ep_note = ("EP8 rank-local: 32 of 256 experts, routing (top-8 of softmax of random logits) over the 32 local "
               "experts, as perf-anchors' table; not DeepSeek's grouped top-k")
    return (
        ExpertsShape("dsv3_ep8-fp8_block128", m["deepseek_v3"], "fp8_block128", ep=8, note=ep_note),
        ExpertsShape("dsv3_tp8-fp8_block128", m["deepseek_v3"], "fp8_block128", tp=8),
        ExpertsShape("mixtral_tp2-bf16", m["mixtral_8x7b"], "bf16", tp=2),
        ExpertsShape("mixtral_tp2-fp8_tensor", m["mixtral_8x7b"], "fp8_tensor", tp=2),
        ExpertsShape("qwen3_30b-bf16", m["qwen3_30b_a3b"], "bf16"),
        ExpertsShape("qwen3_30b-fp8_block128", m["qwen3_30b_a3b"], "fp8_block128"),
        ExpertsShape("qwen3_235b_tp4-bf16", m["qwen3_235b_a22b"], "bf16", tp=4),
        ExpertsShape("gpt_oss_120b-bf16", m["gpt_oss_120b"], "bf16",
                     note="swigluoai (alpha 1.702, limit 7) with expert biases; MXFP4 is SM100-only"),
    )


@cache
def cpu_experts_shapes() -> tuple[ExpertsShape, ...]:
    """Scaled-down shapes for a CPU run (wall clock): K and I / 8 (rounded up to 128), E capped at 16."""
    m = _models()
    note = "CPU scale-down: K, I / 8 (multiples of 128), E <= 16"
    return (
        ExpertsShape("qwen3_30b-bf16-cpu_small", m["qwen3_30b_a3b"], "bf16", scale=8, max_experts=16, note=note),
        ExpertsShape("qwen3_30b-fp8_block128-cpu_small", m["qwen3_30b_a3b"], "fp8_block128", scale=8,
                     max_experts=16, note=note),
        ExpertsShape("mixtral_tp2-bf16-cpu_small", m["mixtral_8x7b"], "bf16", tp=2, scale=8, note=note),
    )


@cache
def gate_shapes() -> tuple[GateShape, ...]:
    """The two specialized gate tiers' shapes: DeepSeek-V3 and Kimi-K2 (bf16 weight, fp32 logits; tier 1 at E = 256
    and 384) and MiniMax-M2 (fp32 weight)."""
    m = _models()
    ds, kimi, mm = m["deepseek_v3"], m["kimi_k2"], m["minimax_m2"]
    return (
        GateShape("dsv3_gate", ds.display, ds.hidden_size, ds.num_experts, torch.bfloat16, torch.bfloat16,
                  torch.float32, ops=("dsv3_router_gemm", "router_gemm_cublas", "gate_linear")),
        GateShape("kimi_k2_gate", kimi.display, kimi.hidden_size, kimi.num_experts, torch.bfloat16, torch.bfloat16,
                  torch.float32, ops=("dsv3_router_gemm", "router_gemm_cublas", "gate_linear")),
        GateShape("minimax_m2_gate", mm.display, mm.hidden_size, mm.num_experts, torch.bfloat16, torch.float32,
                  torch.float32, ops=("fp32_router_gemm", "gate_linear")),
    )


def experts_shape(shape_id: str) -> ExpertsShape:
    """The shape of id ``shape_id``: one of :func:`gpu_experts_shapes` / :func:`cpu_experts_shapes`, or a known
    ``<model>[_tpN|_epN]`` prefix of those with another scheme of ``specs/schemes.toml`` (``dsv3_ep8-bf16``), with
    ``-cpu_small`` at its end scaled down as :func:`cpu_experts_shapes` (``mixtral_tp2-fp8_tensor-cpu_small``)."""
    known = {s.id: s for s in gpu_experts_shapes() + cpu_experts_shapes()}
    if shape_id in known:
        return known[shape_id]
    small = shape_id.endswith("-cpu_small")  # the CPU scale-down of cpu_experts_shapes, for any scheme
    prefix, _, scheme = shape_id.removesuffix("-cpu_small").partition("-")
    base = next((s for s in gpu_experts_shapes() if s.id.partition("-")[0] == prefix), None)
    from specs import load_schemes

    if base is None or scheme not in load_schemes():
        raise KeyError(f"unknown experts shape {shape_id!r}: known {sorted(known)}, or <prefix>-<scheme> with a "
                       f"prefix of {sorted({s.id.partition('-')[0] for s in gpu_experts_shapes()})} and a scheme "
                       "of specs/schemes.toml")
    if small:
        return ExpertsShape(shape_id, base.model, scheme, tp=base.tp, ep=base.ep, scale=8, max_experts=16,
                            note="CPU scale-down: K, I / 8 (multiples of 128), E <= 16")
    return ExpertsShape(shape_id, base.model, scheme, tp=base.tp, ep=base.ep, note=base.note)


def gate_shape(shape_id: str) -> GateShape:
    known = {s.id: s for s in gate_shapes()}
    if shape_id not in known:
        raise KeyError(f"unknown gate shape {shape_id!r}: known {sorted(known)}")
    return known[shape_id]


# --------------------------------------------------------------------------------------------------------------
# Environment knobs
# --------------------------------------------------------------------------------------------------------------


def _env_list(name: str) -> list[str] | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    return [s.strip() for s in raw.split(",") if s.strip()]


def quick() -> bool:
    return os.environ.get("MOE_BENCH_QUICK", "0").lower() not in ("0", "", "false", "no")


def selected(shape_id: str) -> bool:
    keep = _env_list("MOE_BENCH_SHAPES")
    return keep is None or any(k in shape_id for k in keep)


def selected_m(ms: tuple[int, ...]) -> tuple[int, ...]:
    keep = _env_list("MOE_BENCH_M")
    if keep is not None:
        wanted = {int(k) for k in keep}
        return tuple(m for m in ms if m in wanted) or tuple(sorted(wanted))
    if quick():
        return tuple(m for m in ms if m in QUICK_M) or ms
    return ms


def selected_backends(names: list[str], *, on_gpu: bool) -> list[str]:
    """Backends to benchmark, in order: ``MOE_BENCH_BACKENDS`` if set, else every name (plus ``reference`` on CPU)."""
    keep = _env_list("MOE_BENCH_BACKENDS")
    if keep is not None:
        return keep
    return (["reference"] if not on_gpu else []) + list(names)
