"""What the benchmark tests share: backends, parameters, inputs, the implementations under test, the results list.

Every available backend runs on the same inputs in one run: each experts class of each backend is plugged into
``FusedMoEKernel(MoEPrepareAndFinalizeNoEP(), cls(moe_config, quant_config))`` exactly as conformance does
(``conformance/test_experts.py``); a configuration the class does not claim (seed 002 ``is_supported_config``) is
skipped with the class's reason; an unavailable backend is skipped with its ``unavailable_reason()``.

Inputs (deterministic, seeded from the shape id): weights ``w1 ~ N(0, 1/K)``, ``w2 ~ N(0, 1/I)`` drawn in bf16 on
the device and quantized with ``reference.schemes.quantize_weights`` (the reference quantizers, as conformance);
``n_sets`` rotating sets of hidden states ``~ N(0, 1)`` and routing (top-k of the softmax of random logits over the
held experts, int32 ids); weight copies too when the layer's weights are smaller than 4 x L2.

The step's prepare (``make_experts_call(..., prepare=)``): ``"backend"`` quantizes the activations with the
backend's own ``per_token_group_quant_fp8`` / ``scaled_fp8_quant`` / ``int8_quant_per_token`` op where it offers one
(what a serving user pays: ``python -m benchmarks --backend NAME`` does this by default), ``"reference"`` with the
reference's torch ops (every backend gets the same prepare, so rows differ only in the experts step); unset:
``MOE_BENCH_PREPARE`` (default ``reference``, the pytest suite's side-by-side rows).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from functools import cache

import torch

from benchmarks import shapes as S
from benchmarks.roofline import Work, distinct_experts, experts_bytes, experts_flops, gate_work, tensor_bytes
from benchmarks.timing import rotation_sets

__all__ = [
    "RESULTS",
    "on_gpu",
    "bench_device",
    "backends",
    "benchmarked_backends",
    "ExpertsParam",
    "GateParam",
    "experts_params",
    "gate_params",
    "backend_params",
    "experts_inputs",
    "oracle_output",
    "make_weights",
    "draw_routing",
    "replicate",
    "make_experts_call",
    "gate_inputs",
    "make_gate_call",
]

RESULTS: dict = {"records": [], "skipped": [], "backends": {}}


@cache
def on_gpu() -> bool:
    return torch.cuda.is_available()


def bench_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu() else torch.device("cpu")


# --------------------------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------------------------


@cache
def backends() -> dict[str, tuple[object | None, str | None]]:
    """name -> (Backend or None, reason it is not benchmarked here or None), for every registered backend."""
    from backends import load_backend, registered_backends

    out: dict[str, tuple[object | None, str | None]] = {}
    for name in registered_backends():
        try:
            b = load_backend(name)
        except Exception as exc:  # a backend being written may not import: report, never crash collection
            out[name] = (None, f"cannot load backend {name!r}: {type(exc).__name__}: {exc}")
            continue
        reason = b.unavailable_reason()
        if reason is None and not on_gpu() and name != "torch":
            reason = "CPU run: only the reference and the torch backend are benchmarked on CPU (wall clock)"
        if reason is None and on_gpu() and b.device != "cuda":
            reason = f"backend device is {b.device!r}, not the GPU"
        out[name] = (b, reason)
    return out


def benchmarked_backends() -> list[str]:
    """Names to benchmark, in order (``MOE_BENCH_BACKENDS`` or all; ``reference`` on CPU)."""
    return S.selected_backends(list(backends()), on_gpu=on_gpu())


def backend_params() -> list:
    import pytest

    return [pytest.param(n, id=n) for n in benchmarked_backends()]


# --------------------------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertsParam:
    shape: S.ExpertsShape
    M: int
    backend: str
    cls: type | None  # None: the reference function

    @property
    def impl(self) -> str:
        return "fused_experts" if self.cls is None else self.cls.__name__

    @property
    def id(self) -> str:
        return f"{self.shape.id}-M{self.M}-{self.backend}.{self.impl}"


@dataclass(frozen=True)
class GateParam:
    shape: S.GateShape
    M: int
    backend: str  # "torch" for the torch fallbacks
    op: str  # backend op name, or "F.linear" / "mm_out_fp32" / "F.linear_fp32"

    @property
    def id(self) -> str:
        return f"{self.shape.id}-M{self.M}-{self.backend}.{self.op}"


def _ready(name: str) -> object | None:
    if name == "reference":
        return None
    b, reason = backends().get(name, (None, "not registered"))
    return b if reason is None else None


def experts_params() -> list:
    import pytest

    shapes = S.gpu_experts_shapes() if on_gpu() else S.cpu_experts_shapes()
    ms = S.selected_m(S.DECODE_M + S.PREFILL_M) if on_gpu() else S.selected_m(S.CPU_M)
    names = benchmarked_backends()
    params = []
    for shape in shapes:
        if not S.selected(shape.id):
            continue
        for M in ms:
            for name in names:
                if name == "reference":
                    p = ExpertsParam(shape, M, "reference", None)
                    params.append(pytest.param(p, id=p.id))
                    continue
                b = _ready(name)
                if b is None:
                    continue  # reported once by test_backend
                for cls in b.experts:
                    if standard_modular(cls):
                        p = ExpertsParam(shape, M, name, cls)
                        params.append(pytest.param(p, id=p.id))
    for name in names:
        b = _ready(name)
        for cls in getattr(b, "experts", ()) or ():
            if not standard_modular(cls):
                skip(f"{name}.{cls.__name__}", "not a Standard-format modular experts class: it needs another "
                     "prepare/finalize than MoEPrepareAndFinalizeNoEP (batched or monolithic), not benchmarked")
    return params


def standard_modular(cls) -> bool:
    from reference.modular import FusedMoEActivationFormat, FusedMoEExpertsModular

    try:
        return issubclass(cls, FusedMoEExpertsModular) and cls.activation_format() == FusedMoEActivationFormat.Standard
    except Exception:
        return False


TORCH_GATE_OPS = {"dsv3_gate": ("F.linear", "mm_out_fp32"), "kimi_k2_gate": ("F.linear", "mm_out_fp32"),
                  "minimax_m2_gate": ("F.linear_fp32",)}


def gate_params() -> list:
    import pytest

    ms = S.selected_m(S.GATE_M if on_gpu() else S.CPU_GATE_M)
    names = [n for n in benchmarked_backends() if n != "reference"]
    params = []
    for shape in S.gate_shapes():
        if not S.selected(shape.id):
            continue
        for M in ms:
            if "torch" in names or not names:
                for op in TORCH_GATE_OPS[shape.id]:
                    p = GateParam(shape, M, "torch", op)
                    params.append(pytest.param(p, id=p.id))
            for name in names:
                b = _ready(name)
                if b is None:
                    continue
                for op in shape.ops:
                    if op in b.ops:
                        p = GateParam(shape, M, name, op)
                        params.append(pytest.param(p, id=p.id))
    return params


# --------------------------------------------------------------------------------------------------------------
# Experts inputs
# --------------------------------------------------------------------------------------------------------------


def _seed(text: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & (2**63 - 1)


def _gen(device: torch.device, text: str) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(_seed(text))
    return g


def replicate(obj, device):
    """A deep copy of tensors (and of dataclasses holding tensors: the quant config), on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, copy=True)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: replicate(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj)})
    return obj


@dataclass
class ExpertsWeights:
    shape: S.ExpertsShape
    copies: list  # [(w1, w2, quant_config)], >= 1
    bytes_per_expert: float
    total_bytes: float


@dataclass
class ExpertsInputs:
    shape: S.ExpertsShape
    M: int
    weights: ExpertsWeights
    sets: list  # [(hidden, topk_weights, topk_ids)]
    touched: float  # mean distinct experts per set
    work: Work


_WEIGHTS: dict = {}
_INPUTS: dict = {}
_ORACLE: dict = {}


def make_weights(E: int, N: int, K: int, I: int, scheme: str, dtype: torch.dtype, device, generator, *,  # noqa: E741
                 bias: bool = False, gemm1_alpha: float | None = None, gemm1_clamp_limit: float | None = None):
    """``(w1, w2, quant_config)``: ``w1 ~ N(0, 1/K)`` ``(E, N, K)``, ``w2 ~ N(0, 1/I)`` ``(E, K, I)`` drawn in
    ``dtype`` on ``device`` (biases ``N(0, 0.01)``), quantized for ``scheme`` by ``reference.schemes`` (as
    conformance); the one weight maker of the benchmarks and the backends' tools."""
    from reference.schemes import quantize_weights

    g = generator
    w1 = torch.randn(E, N, K, device=device, dtype=dtype, generator=g).mul_(K**-0.5)
    w2 = torch.randn(E, K, I, device=device, dtype=dtype, generator=g).mul_(I**-0.5)
    b1 = b2 = None
    if bias:
        b1 = torch.randn(E, N, device=device, dtype=dtype, generator=g).mul_(0.1)
        b2 = torch.randn(E, K, device=device, dtype=dtype, generator=g).mul_(0.1)
    return quantize_weights(scheme, w1, w2, w1_bias=b1, w2_bias=b2, gemm1_alpha=gemm1_alpha,
                            gemm1_clamp_limit=gemm1_clamp_limit)


def draw_routing(M: int, E: int, topk: int, device, generator, *, renormalize: bool = True):
    """``(topk_weights fp32, topk_ids int32)``: top-k of the softmax of ``N(0, 1)`` logits over the ``E`` held
    experts (every route local, as vLLM's benchmark_moe.py and the perf-anchors table)."""
    logits = torch.randn(M, E, device=device, dtype=torch.float32, generator=generator)
    tw, ids = torch.topk(torch.softmax(logits, dim=-1), topk, dim=-1)
    if renormalize:
        tw = tw / tw.sum(dim=-1, keepdim=True)
    return tw.float().contiguous(), ids.to(torch.int32).contiguous()


def _weights(shape: S.ExpertsShape, device: torch.device, l2_bytes: int) -> ExpertsWeights:
    key = (shape.id, str(device))
    if key in _WEIGHTS:
        return _WEIGHTS[key]
    _WEIGHTS.clear()  # one layer at a time: tests are ordered by shape
    _INPUTS.clear()
    _ORACLE.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    g = _gen(device, "weights-" + shape.id)
    w1q, w2q, qc = make_weights(shape.E, shape.N, shape.K, shape.I, shape.scheme, shape.dtype, device, g,
                                bias=shape.model.expert_bias, gemm1_alpha=shape.model.gemm1_alpha,
                                gemm1_clamp_limit=shape.model.gemm1_clamp_limit)
    E = shape.E
    extra = tensor_bytes(qc.w1.scale, qc.w2.scale, qc.w1.bias, qc.w2.bias)
    total = tensor_bytes(w1q, w2q) + extra
    copies = [(w1q, w2q, qc)]
    n_copies = min(8, math.ceil(4.0 * l2_bytes / total)) if device.type == "cuda" else 1
    for _ in range(1, n_copies):
        copies.append((replicate(w1q, device), replicate(w2q, device), replicate(qc, device)))
    w = ExpertsWeights(shape, copies, total / E, total)
    _WEIGHTS[key] = w
    return w


def experts_inputs(shape: S.ExpertsShape, M: int, device: torch.device, l2_bytes: int) -> ExpertsInputs:
    key = (shape.id, M, str(device))
    if key in _INPUTS:
        return _INPUTS[key]
    weights = _weights(shape, device, l2_bytes)
    for k in [k for k in _INPUTS if k[0] == shape.id]:
        del _INPUTS[k]  # one M at a time
    E, K, topk = shape.E, shape.K, shape.topk
    act = torch.tensor([], dtype=shape.dtype).element_size()
    # bytes of one call, from the expected distinct experts (1 - (1 - k/E)^M of them), to size the rotation
    expect = E * (1.0 - (1.0 - topk / E) ** M)
    per_call = experts_bytes(expect, weights.bytes_per_expert, M, K, topk, act, act)
    n_sets = rotation_sets(per_call, l2_bytes) if device.type == "cuda" else 2
    g = _gen(device, f"tokens-{shape.id}-M{M}")
    sets = []
    for _ in range(n_sets):
        hidden = torch.randn(M, K, device=device, dtype=shape.dtype, generator=g)
        tw, ids = draw_routing(M, E, topk, device, g, renormalize=shape.model.renormalize)
        sets.append((hidden, tw, ids))
    touched = sum(distinct_experts(s[2]) for s in sets) / n_sets
    work = Work(experts_flops(M, topk, K, shape.N, shape.I),
                experts_bytes(touched, weights.bytes_per_expert, M, K, topk, act, act), shape.compute_dtype)
    inp = ExpertsInputs(shape, M, weights, sets, touched, work)
    _INPUTS[key] = inp
    return inp


def moe_config_for(shape: S.ExpertsShape):
    from reference.config import FusedMoEConfig, FusedMoEParallelConfig

    return FusedMoEConfig(
        num_experts=shape.E, experts_per_token=shape.topk, hidden_dim=shape.K,
        intermediate_size_per_partition=shape.I, num_local_experts=shape.E, activation=shape.activation,
        in_dtype=shape.dtype, moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
        has_bias=shape.model.expert_bias, max_num_tokens=max(16 * 1024, max(S.PREFILL_M)),
    )


PREPARE_MODES = ("backend", "reference")


def _prepare_for(backend_name: str, mode: str | None = None):
    """``(prepare/finalize instance, label)`` for the step of ``backend_name``: ``MoEPrepareAndFinalizeNoEP`` with
    the reference's quantizers (``mode`` ``"reference"``), or (``"backend"``) a subclass whose a1 quantization runs
    the backend's own op where it has one for the scheme (:class:`BackendQuantPrepare`); ``mode`` None:
    ``MOE_BENCH_PREPARE`` (default ``reference``).

    Raises:
        ValueError: an unknown mode.
    """
    from reference.modular import MoEPrepareAndFinalizeNoEP

    mode = mode if mode is not None else os.environ.get("MOE_BENCH_PREPARE", "reference")
    if mode not in PREPARE_MODES:
        raise ValueError(f"prepare mode {mode!r}: expected one of {PREPARE_MODES}")
    if mode != "backend" or backend_name == "reference":
        return MoEPrepareAndFinalizeNoEP(), "reference"
    b = _ready(backend_name) or backends().get(backend_name, (None, None))[0]  # (on a CPU: the interpreter)
    ops = getattr(b, "ops", {}) or {}
    quant_ops = {k: ops[k] for k in ("per_token_group_quant_fp8", "scaled_fp8_quant", "int8_quant_per_token")
                 if k in ops}
    if not quant_ops:
        return MoEPrepareAndFinalizeNoEP(), "reference (backend has no quant op)"
    return backend_quant_prepare_class()(quant_ops), f"{backend_name} quant ops ({', '.join(quant_ops)})"


@cache
def backend_quant_prepare_class():
    """The class ``BackendQuantPrepare`` (built on first use: this module imports only torch at import time)."""
    from reference.modular import MoEPrepareAndFinalizeNoEP

    class BackendQuantPrepare(MoEPrepareAndFinalizeNoEP):
        """``MoEPrepareAndFinalizeNoEP`` whose a1 quantization calls a backend's ops (``ops``: name -> function, the
        reference's signatures), as vLLM's prepare calls its custom ops: FP8 1 x group (``per_token_group_quant_fp8``),
        FP8 per-tensor static / dynamic and dynamic per-token (``scaled_fp8_quant``), INT8 dynamic per-token
        (``int8_quant_per_token``). Anything else (no such op, deferred quantization, the router weight on the input,
        unquantized or other formats) goes through the reference's prepare. ``used`` counts the calls per op
        (``"reference"``: the reference's quantizer ran, ``"unquantized"``: nothing to quantize)."""

        def __init__(self, ops: dict):
            self.ops = dict(ops)
            self.used: dict[str, int] = {}

        def _quant(self, a1, quant_config):
            d = quant_config.a1
            shape = d.shape
            if d.dtype == torch.float8_e4m3fn:
                if shape is not None and shape[0] == 1 and shape[1] > 0 and "per_token_group_quant_fp8" in self.ops:
                    return "per_token_group_quant_fp8", self.ops["per_token_group_quant_fp8"](
                        a1, shape[1], use_ue8m0=quant_config.use_ue8m0)
                if shape in ((-1, -1), (1, -1)) and "scaled_fp8_quant" in self.ops and not (
                        shape == (1, -1) and d.scale is not None):
                    return "scaled_fp8_quant", self.ops["scaled_fp8_quant"](
                        a1, d.scale, use_per_token_if_dynamic=shape == (1, -1))
            elif d.dtype == torch.int8 and shape == (1, -1) and d.scale is None and "int8_quant_per_token" in self.ops:
                return "int8_quant_per_token", self.ops["int8_quant_per_token"](a1)
            return None, None

        def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                    quant_config, defer_input_quant=False):
            name = "unquantized" if quant_config.a1.dtype is None else "reference"
            if not (defer_input_quant or apply_router_weight_on_input or quant_config.a1.dtype is None):
                op, qs = self._quant(a1 if a1.is_contiguous() else a1.contiguous(), quant_config)
                if op is not None:
                    self.used[op] = self.used.get(op, 0) + 1
                    return qs[0], qs[1], None, None, None
            self.used[name] = self.used.get(name, 0) + 1
            return super().prepare(a1, topk_weights, topk_ids, num_experts, expert_map,
                                   apply_router_weight_on_input, quant_config, defer_input_quant)

    return BackendQuantPrepare


def supported(p: ExpertsParam) -> tuple[bool, str]:
    if p.cls is None:
        return True, ""
    from reference.modular import FusedMoEActivationFormat

    qc = _weights_qc_key(p.shape)
    return p.cls.is_supported_config(p.cls, moe_config_for(p.shape), qc[0], qc[1], FusedMoEActivationFormat.Standard)


@cache
def _weights_qc_key(shape: S.ExpertsShape):
    """(weight_key, activation_key) of the shape's scheme, from a tiny quantization (no big weights needed)."""
    from reference.schemes import quantize_weights

    n = 2 if shape.activation.is_gated else 1
    w1 = torch.randn(1, 128 * n, 128).to(torch.bfloat16)
    w2 = torch.randn(1, 128, 128).to(torch.bfloat16)
    _, _, qc = quantize_weights(shape.scheme, w1, w2)
    return qc.weight_key, qc.activation_key


def make_experts_call(p: ExpertsParam, inp: ExpertsInputs, prepare: str | None = None):
    """``(call(i), prepare_label)``: one layer call on input set ``i`` (weights copy ``i % copies``); ``prepare``:
    ``"backend"`` / ``"reference"`` quantizers in the step's prepare (None: ``MOE_BENCH_PREPARE``, see
    ``_prepare_for``). ``call.prepares``: the prepare/finalize instances (a ``BackendQuantPrepare``'s ``used``
    counts the backend ops it ran)."""
    shape = p.shape
    copies, sets = inp.weights.copies, inp.sets
    nw = len(copies)
    kw = dict(activation=shape.activation, global_num_experts=shape.E)
    if p.cls is None:
        from reference.experts import fused_experts

        def call(i):
            w1, w2, qc = copies[i % nw]
            h, tw, ids = sets[i]
            return fused_experts(h, w1, w2, tw, ids, quant_config=qc, **kw)

        return call, "reference"
    from reference.modular import FusedMoEKernel

    moe_config = moe_config_for(shape)
    kernels, prepares = [], []
    label = "reference"
    for w1, w2, qc in copies:
        prep, label = _prepare_for(p.backend, prepare)
        prepares.append(prep)
        kernels.append(FusedMoEKernel(prep, p.cls(moe_config, qc)))

    def call(i):
        w1, w2, _ = copies[i % nw]
        h, tw, ids = sets[i]
        return kernels[i % nw].apply(h, w1, w2, tw, ids, **kw)

    call.prepares = prepares
    return call, label


def remember_oracle(p: ExpertsParam, out: torch.Tensor) -> None:
    """The torch backend's own benchmark already computed set 0's output: keep it as the oracle of the case."""
    _ORACLE.clear()
    _ORACLE[(p.shape.id, p.M)] = out.detach().clone()


def oracle_output(p: ExpertsParam, inp: ExpertsInputs) -> torch.Tensor | None:
    """Output of the torch backend's ``TorchExperts`` on set 0 (itself conformance-tested against the reference),
    the sanity oracle of every other implementation; None when the torch backend is not usable here."""
    key = (p.shape.id, p.M)
    if key in _ORACLE:
        return _ORACLE[key]
    b = _ready("torch")
    if b is None or not b.experts:
        return None
    q = ExpertsParam(p.shape, p.M, "torch", b.experts[0])
    call, _ = make_experts_call(q, inp)
    _ORACLE.clear()
    _ORACLE[key] = call(0).detach().clone()
    return _ORACLE[key]


# --------------------------------------------------------------------------------------------------------------
# Gate inputs and ops
# --------------------------------------------------------------------------------------------------------------


def gate_inputs(shape: S.GateShape, M: int, device: torch.device, l2_bytes: int):
    """``(sets [(x, W)], work)``: rotating activations and weight copies (the 3-4 MB gate weight fits in L2)."""
    wb = torch.tensor([], dtype=shape.weight_dtype).element_size()
    xb = torch.tensor([], dtype=shape.x_dtype).element_size()
    ob = torch.tensor([], dtype=shape.out_dtype).element_size()
    work = gate_work(M, shape.H, shape.E, xb, wb, ob)
    n = rotation_sets(work.bytes, l2_bytes, max_sets=64) if device.type == "cuda" else 2
    g = _gen(device, f"gate-{shape.id}-M{M}")
    sets = []
    for _ in range(n):
        x = torch.randn(M, shape.H, device=device, dtype=shape.x_dtype, generator=g)
        w = torch.randn(shape.E, shape.H, device=device, dtype=torch.float32, generator=g).mul_(shape.H**-0.5)
        sets.append((x, w.to(shape.weight_dtype)))
    return sets, work


def make_gate_call(p: GateParam, sets):
    """``(call(i), skip_reason or None)``."""
    import torch.nn.functional as F

    shape, M = p.shape, p.M
    out = shape.out_dtype
    if p.backend == "torch" and p.op in TORCH_GATE_OPS[shape.id]:
        if p.op == "F.linear":  # tier 4: F.linear in the weight dtype, then cast
            return (lambda i: F.linear(sets[i][0], sets[i][1]).to(out)), None
        if p.op == "mm_out_fp32":  # tier 3 done by torch: cuBLAS bf16 x bf16 -> fp32
            return (lambda i: torch.mm(sets[i][0], sets[i][1].t(), out_dtype=out)), None
        if p.op == "F.linear_fp32":  # fp32 dispatch op's F.linear branch
            return (lambda i: F.linear(sets[i][0].float(), sets[i][1])), None
        raise ValueError(p.op)
    from reference.gate import DSV3_MAX_TOKENS, FP32_MAX_TOKENS, Platform, select_gate_tier

    fn = _ready(p.backend).ops[p.op]
    if p.op == "dsv3_router_gemm":
        if M > DSV3_MAX_TOKENS:
            return None, f"dsv3_router_gemm takes M <= {DSV3_MAX_TOKENS} (GateLinear uses another tier above)"
        return (lambda i: fn(sets[i][0], sets[i][1], out)), None
    if p.op == "fp32_router_gemm":
        if M > FP32_MAX_TOKENS:
            return None, f"fp32_router_gemm takes M <= {FP32_MAX_TOKENS} (the dispatch op runs F.linear above)"
        return (lambda i: fn(sets[i][0], sets[i][1])), None
    if p.op == "router_gemm_cublas":
        return (lambda i: fn(sets[i][0], sets[i][1])), None
    if p.op == "gate_linear":
        cap = torch.cuda.get_device_capability() if on_gpu() else None
        platform = Platform(is_cuda=on_gpu() and torch.version.hip is None,
                            capability=(int(cap[0]), int(cap[1])) if cap else None)
        tier = select_gate_tier(M, shape.H, shape.E, x_dtype=shape.x_dtype, weight_dtype=shape.weight_dtype,
                                out_dtype=out, bias=False, platform=platform)
        call = lambda i: fn(sets[i][0], sets[i][1], tier=tier, out_dtype=out)  # noqa: E731
        call.tier = tier.name
        return call, None
    raise ValueError(f"unknown gate op {p.op}")


# --------------------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------------------


def skip(test_id: str, reason: str) -> None:
    """Remember a configuration that was not measured (it appears under "Not measured" in the results)."""
    RESULTS["skipped"].append({"id": test_id, "reason": reason})


def record(benchmark, *, kind: str, case: str, label: str, M: int, backend: str, impl: str, work: Work, runner,
           ceilings: dict, device: dict, **extra) -> dict | None:
    """Fill ``benchmark.extra_info`` and the run's results from the finished ``benchmark.pedantic``."""
    stats = getattr(benchmark, "stats", None)
    if stats is None:  # --benchmark-disable: the function ran once, nothing was measured
        return None
    median = float(stats.stats.median)
    floor_s, bound = work.floor(ceilings)
    rec = {
        "kind": kind, "case": case, "shape": label, "M": M, "backend": backend, "impl": impl,
        "gpu": device.get("name"), "median_s": median, "min_s": float(stats.stats.min),
        "iqr_s": float(stats.stats.iqr), "rounds": int(stats.stats.rounds), "method": runner.method,
        "calls_per_round": runner.calls_per_round, "input_sets": runner.n_sets,
        "flops": work.flops, "bytes": work.bytes, "compute_dtype": work.compute_dtype,
        "tflops": work.flops / median / 1e12, "gbps": work.bytes / median / 1e9,
        "floor_s": floor_s, "bound": bound, "frac_of_floor": floor_s / median,
    }
    if runner.graph_error:
        rec["graph_error"] = runner.graph_error
    rec.update(extra)
    benchmark.extra_info.update(rec)
    benchmark.extra_info["ceilings"] = {
        "copy_TBps": ceilings["copy_bytes_per_s"] / 1e12,
        **{f"{k}_TFLOPs": v / 1e12 for k, v in ceilings["matmul_flops_per_s"].items()},
    }
    RESULTS["records"].append(rec)
    return rec
