"""The work of one call and its floor (shared/facts/perf-anchors.md "Floors", .library/device/METHOD.md).

- FLOPs of the experts: ``2 * M * topk * (K * N1 + I * K)`` with N1 = w1's rows (2I gated, I otherwise): the useful
  multiply-adds of GEMM1 and GEMM2 (padding rows, activation, quantization and the reduction are not counted).
- Bytes of the experts: every *distinct* expert the routing touches streams its w1 and w2 (with scales and biases)
  once, plus the activations in and out once: ``experts_touched * bytes_per_expert + M * K * (in + out bytes)
  + M * topk * 8`` (ids and weights). Decode is weight-streaming bound; prefill compute bound.
- Floor = ``max(bytes / copy bandwidth, FLOPs / matmul throughput of the scheme's dtype)``, both ceilings measured
  once per run on the same device (``timing.measure_ceilings``). ``floor / time`` is the fraction of the roofline
  reached (1.0 = at the floor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Work", "experts_flops", "experts_bytes", "distinct_experts", "gate_work", "floor_seconds", "tensor_bytes"]


@dataclass(frozen=True)
class Work:
    flops: float
    bytes: float
    compute_dtype: str  # key of the matmul ceiling: "bf16", "fp8", "fp32"

    def floor(self, ceilings: dict) -> tuple[float, str]:
        """``(seconds, bound)``: the floor and which term sets it (``"memory"`` or ``"compute"``)."""
        return floor_seconds(self.flops, self.bytes, ceilings, self.compute_dtype)


def floor_seconds(flops: float, nbytes: float, ceilings: dict, compute_dtype: str) -> tuple[float, str]:
    t_mem = nbytes / ceilings["copy_bytes_per_s"]
    t_cmp = flops / ceilings["matmul_flops_per_s"][compute_dtype]
    return (t_mem, "memory") if t_mem >= t_cmp else (t_cmp, "compute")


def sustained(ceilings: dict) -> dict | None:
    """``ceilings`` with the matmul rates sustained as the rows are timed (``timing.measure_ceilings``'
    ``sustained_matmul_flops_per_s``: under a power cap, below the burst rates) in place of the burst ones, for the
    dtypes that have one; None when none was measured (CPU)."""
    rates = ceilings.get("sustained_matmul_flops_per_s")
    if not rates:
        return None
    return {**ceilings, "matmul_flops_per_s": {**ceilings["matmul_flops_per_s"], **rates}}


def experts_flops(M: int, topk: int, K: int, N1: int, I: int) -> float:  # noqa: E741
    return 2.0 * M * topk * (K * N1 + I * K)


def tensor_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def distinct_experts(topk_ids: torch.Tensor) -> int:
    return int(torch.unique(topk_ids.reshape(-1)).numel())


def experts_bytes(touched: float, bytes_per_expert: float, M: int, K: int, topk: int, act_bytes: int = 2,
                  out_bytes: int = 2) -> float:
    return touched * bytes_per_expert + M * K * (act_bytes + out_bytes) + M * topk * 8.0


def gate_work(M: int, H: int, E: int, x_bytes: int, w_bytes: int, out_bytes: int) -> Work:
    """Router gate ``(M, H) x (E, H)^T``: the weight, x and the logits move once; ``2 M H E`` FLOPs. The ceiling is
    the weight dtype's matmul throughput (fp32 weights: the fp32 non-TF32 rate)."""
    flops = 2.0 * M * H * E
    nbytes = E * H * w_bytes + M * H * x_bytes + M * E * out_bytes
    return Work(flops, nbytes, "bf16" if w_bytes == 2 else "fp32")
