"""What ``python -m benchmarks --backend NAME`` runs, and the peers' reference figures: both data.

``benchmarks/suites.toml`` names, per backend, the experts shapes (ids of :mod:`benchmarks.shapes`), the token
counts, up to which M each timed output is checked against the reference, the peer it is compared with, and the
router-gate shapes; ``benchmarks/peers.toml`` holds the peers' figures (vLLM's Triton kernels on the H200, DeepGEMM's
published rates), quoted from their sources, never measured here.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from benchmarks import shapes as S

__all__ = ["Suite", "Peer", "suite", "suites", "peer", "peers"]

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Peer:
    """A peer's reference figures: ``figures[shape id][M]`` in ``unit`` (``us`` per call or ``TFLOP/s``)."""

    name: str
    title: str
    device: str
    source: str
    measures: str
    unit: str
    figures: dict = field(default_factory=dict, compare=False, hash=False)

    def value(self, shape_id: str, M: int) -> float | None:
        return self.figures.get(shape_id, {}).get(M)

    def seconds(self, shape_id: str, M: int, flops: float | None = None) -> float | None:
        """The figure as seconds per call (a ``TFLOP/s`` figure needs the call's ``flops``)."""
        v = self.value(shape_id, M)
        if v is None:
            return None
        if self.unit == "us":
            return v * 1e-6
        if self.unit == "TFLOP/s" and flops:
            return flops / (v * 1e12)
        return None


@dataclass(frozen=True)
class Suite:
    backend: str
    experts: tuple[str, ...]
    M: tuple[int, ...]
    quick_M: tuple[int, ...]
    check_max_M: int
    peer: str | None = None
    compare: str | None = None
    gate: tuple[str, ...] = ()
    gate_M: tuple[int, ...] = ()
    aliases: dict = field(default_factory=dict, compare=False, hash=False)
    budget_s: float = 450.0
    beside: tuple[str, ...] = ()

    def experts_shapes(self) -> list[S.ExpertsShape]:
        return [S.experts_shape(i) for i in self.experts]

    def gate_shapes(self) -> list[S.GateShape]:
        return [S.gate_shape(i) for i in self.gate]

    def resolve(self, name: str) -> str:
        """A shape id from an id or an alias."""
        return self.aliases.get(name, name)


def _read(name: str) -> dict:
    with open(HERE / name, "rb") as f:
        return tomllib.load(f)


@cache
def peers() -> dict[str, Peer]:
    out = {}
    for name, d in _read("peers.toml")["peers"].items():
        figures = {shape: {int(m): float(v) for m, v in by_m.items()} for shape, by_m in d.get("figures", {}).items()}
        out[name] = Peer(name, d["title"], d["device"], d["source"], d["measures"], d["unit"], figures)
    return out


def peer(name: str) -> Peer:
    return peers()[name]


@cache
def suites() -> dict[str, Suite]:
    out = {}
    for name, d in _read("suites.toml")["suites"].items():
        out[name] = Suite(
            backend=name, experts=tuple(d.get("experts", ())), M=tuple(d.get("M", ())),
            quick_M=tuple(d.get("quick_M", d.get("M", ()))), check_max_M=int(d.get("check_max_M", 0)),
            peer=d.get("peer"), compare=d.get("compare"), gate=tuple(d.get("gate", ())),
            gate_M=tuple(d.get("gate_M", ())), aliases=dict(d.get("aliases", {})),
            budget_s=float(d.get("budget_s", 450.0)), beside=tuple(d.get("beside", ())))
    return out


def suite(backend: str) -> Suite:
    """The backend's suite; a backend without one (a new or entry-point backend) gets the GPU experts shapes."""
    s = suites()
    if backend in s:
        return s[backend]
    return Suite(backend=backend, experts=tuple(x.id for x in S.gpu_experts_shapes()), M=(1, 8, 64, 1024, 4096),
                 quick_M=(1, 64, 4096), check_max_M=1024)
