"""Compile the triton backend's kernels for sm_90 on a machine without a GPU, through the real launch path.

    python -m tools.triton.sm90                     # every entry of the H200 and H100 tables: compile + resources
    python -m tools.triton.sm90 --gpus NVIDIA_H200 --shapes qwen3_30b_fp8blk --ms 4096 [--json]
    python -m tools.triton.sm90 --glue [--json]      # the deep_gemm backend's Triton glue kernels instead

Under :func:`compile_only` Triton's active driver is replaced by one that targets ``cuda:90`` and launches nothing,
and the backend's device checks accept CPU tensors: ``fused_experts`` then runs its host code on CPU tensors of the
real shapes (``torch.empty``: nothing is touched) and every ``kernel[grid](...)`` is specialized by the JIT exactly
as on the GPU (pointer alignment, unit strides, multiples of 16) and compiled by Triton's bundled ``ptxas`` for
sm_90, but not run. What that checks without a GPU, and the interpreter cannot: that each tuned configuration
compiles for the H100 / H200 (a ``CompilationError`` in the tile code, a shared-memory request above the SM's
227 KiB, a TMA box Triton rejects), and what it costs in registers, spills and shared memory (read from the cubin
with the bundled ``cuobjdump``). It says nothing about numerics or speed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

# sm_90 (H100 / H200): 227 KiB of shared memory per block (opt-in), 132 SMs on both SKUs we tune for
SM90 = dict(arch=90, max_shared_mem=232448, multiprocessor_count=132)


@dataclasses.dataclass
class Compiled:
    """One kernel the JIT compiled under :func:`compile_only`."""

    name: str
    num_warps: int
    num_stages: int
    shared: int  # bytes of shared memory the kernel requests
    cubin: bytes
    constexprs: dict = dataclasses.field(default_factory=dict)  # the specialization's scalar constexprs, by name

    def resources(self) -> dict:
        """``{"regs", "stack", "ops"}`` from the cubin: registers per thread, stack bytes (local-memory spills), and
        counts of the instructions that show the code path (HGMMA / QGMMA / IGMMA = wgmma, HMMA = mma.sync,
        UTMALDG = TMA loads, LDGSTS = cp.async, STL / LDL = local memory, DEPBAR_LE_1 / DEPBAR_LE_2 = wgmma waits
        that leave one / two groups in flight, BAR_SYNC = block-wide barriers, FFMA = fp32 multiply-adds rounded
        once, F2F_BF16 = fp32 -> bf16 conversions of one value, where a packed one converts two)."""
        sass, res = _cuobjdump(self.cubin)
        m = re.search(r"REG:(\d+).*?STACK:(\d+)", res, re.S)
        ops = {o: sass.count(o) for o in ("HGMMA", "QGMMA", "IGMMA", "HMMA", "UTMALDG", "LDGSTS", "STL", "LDL")}
        # waits that leave one wgmma group in flight (an MMA overlapping other work; ptxas drops them when it
        # serializes the wgmmas)
        ops["DEPBAR_LE_1"] = sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x1")
        ops["DEPBAR_LE_2"] = sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x2")  # two chains (gate / up) in flight
        # block-wide barriers: reductions or layout conversions across warps through shared memory (what the
        # requantization's ROW_CHUNKS tiles try to avoid)
        ops["BAR_SYNC"] = sass.count("BAR.SYNC")
        # fp32 multiply-adds contracted into one rounding (FP fusion, pinned by the backend: jit.FP_FUSION)
        ops["FFMA"] = len(re.findall(r"\bFFMA\b", sass))
        # fp32 -> bf16 conversions of one value each (the 16-lane conversion pipe; F2FP ... PACK_AB converts two)
        ops["F2F_BF16"] = sass.count("F2F.BF16.F32")
        return dict(regs=int(m.group(1)) if m else -1, stack=int(m.group(2)) if m else -1,
                    ops={k: v for k, v in ops.items() if v})


def _bin(tool: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def _cuobjdump(cubin: bytes) -> tuple[str, str]:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([_bin("cuobjdump"), "--dump-sass", path], capture_output=True, text=True).stdout
        res = subprocess.run([_bin("cuobjdump"), "--dump-resource-usage", path], capture_output=True,
                             text=True).stdout
    return sass, res


class _NoLaunch:
    """Triton launcher stand-in: the kernel is compiled, the launch does nothing."""

    def __init__(self, src, metadata):
        pass

    def __call__(self, *args, **kwargs):
        return None


class _Utils:
    def get_device_properties(self, device):
        return dict(max_shared_mem=SM90["max_shared_mem"], multiprocessor_count=SM90["multiprocessor_count"],
                    max_num_regs=65536, warpSize=32, sm_clock_rate=1980000, mem_clock_rate=3201000,
                    mem_bus_width=6144)

    def load_binary(self, name, kernel, shared, device):
        return None, None, 0, 0, 1024  # module, function, n_regs, n_spills, max threads per block


class _CompileOnlyDriver:
    """A Triton driver that targets sm_90 and launches nothing (see :func:`compile_only`)."""

    backend = "cuda"

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", SM90["arch"], 32)
        self.utils = _Utils()
        self.launcher_cls = _NoLaunch

    def is_active(self):
        return True

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def get_empty_cache_for_benchmark(self):
        return torch.empty(0)

    def clear_cache(self, cache):
        pass


def _constexprs(src) -> dict:
    """``{name: value}`` of a compile source's int / bool constexprs (``ASTSource.constants`` is keyed by argument
    index paths; the names come from its function), e.g. ``N_HALVES`` of ``ws_moe_gemm_kernel``."""
    names = getattr(getattr(src, "fn", None), "arg_names", None) or []
    out = {}
    for path, v in (getattr(src, "constants", None) or {}).items():
        if isinstance(path, tuple) and len(path) == 1 and path[0] < len(names) and isinstance(v, (bool, int)):
            out[names[path[0]]] = v
    return out


@contextlib.contextmanager
def compile_only(gpu_name: str = "NVIDIA_H200"):
    """Within the block, the triton backend's launches compile for sm_90 and run nothing; yields the list of
    :class:`Compiled` kernels, appended as the JIT compiles them (a specialization compiled earlier in the block is
    served from the JIT's cache and not listed again).

    ``gpu_name`` is what ``configs.device_name()`` returns inside (which tuned table ``get_config`` reads).
    Operands are CPU tensors; outputs are left as allocated (garbage). Not re-entrant.

    Raises:
        RuntimeError: under ``TRITON_INTERPRET=1`` (the interpreter replaces the JIT).
    """
    import triton.compiler
    from triton.runtime.driver import driver

    from backends.triton import align, configs, experts, quant, routing
    from backends.triton.jit import INTERPRET

    if INTERPRET:
        raise RuntimeError("compile_only needs the real JIT: unset TRITON_INTERPRET")
    log: list[Compiled] = []
    real_compile = triton.compiler.compile

    def compile_and_log(*a, **kw):
        k = real_compile(*a, **kw)
        md = k.metadata
        log.append(Compiled(name=md.name, num_warps=md.num_warps, num_stages=md.num_stages, shared=md.shared,
                            cubin=k.asm["cubin"], constexprs=_constexprs(a[0] if a else kw.get("src"))))
        return k

    def accept_cpu(*tensors, what="operands"):
        return next(t.device for t in tensors if t is not None)

    patches = [(m, "check_device", accept_cpu) for m in (experts, align, quant, routing)]
    patches += [(experts, "fp8_capable", lambda device=None: True), (configs, "device_name", lambda: gpu_name),
                (triton.compiler, "compile", compile_and_log)]
    saved = [(m, n, getattr(m, n)) for m, n, _ in patches]
    jits = _jit_functions()
    driver.set_active(_CompileOnlyDriver())
    for m, n, v in patches:
        setattr(m, n, v)
    for jf in jits:  # the JIT binds target and compile function per device on first launch: rebind to ours
        jf.device_caches.clear()
    configs.load_table.cache_clear()
    try:
        yield log
    finally:
        for m, n, v in saved:
            setattr(m, n, v)
        for jf in jits:
            jf.device_caches.clear()
        configs.load_table.cache_clear()
        driver._active = None  # the real driver again (created lazily, if this machine has one)


def _jit_functions():
    """The backend's ``@triton.jit`` kernels (the ones a launch can compile)."""
    import triton

    from backends.deep_gemm import triton_kernels as deep_gemm_glue
    from backends.triton import align, gluon_sm90, gluon_ws, kernels, quant, routing

    out = []
    for mod in (kernels, align, quant, routing, gluon_sm90, gluon_ws, deep_gemm_glue):
        for v in vars(mod).values():
            if isinstance(v, triton.runtime.jit.JITFunction) and v not in out:
                out.append(v)
    return out


def _weights(sh):
    """CPU weights of a bench shape, uninitialized (``torch.empty``: never touched), with scales of ones / zero
    biases: ``(w1, w2, quant_config, activation)``."""
    from reference.activation import MoEActivation
    from reference.config import FUSED_MOE_UNQUANTIZED_CONFIG, biased_moe_quant_config, fp8_w8a8_moe_quant_config

    E, K, I = sh.E, sh.K, sh.I
    dt = torch.float8_e4m3fn if sh.scheme.startswith("fp8") else torch.bfloat16
    w1, w2 = torch.empty(E, 2 * I, K, dtype=dt), torch.empty(E, K, I, dtype=dt)
    if sh.scheme == "fp8_block128":
        qc = fp8_w8a8_moe_quant_config(torch.ones(E, -(-2 * I // 128), -(-K // 128)),
                                       torch.ones(E, -(-K // 128), -(-I // 128)), block_shape=[128, 128])
    elif sh.scheme == "fp8_tensor":  # per-expert weight scales, dynamic per-tensor activations
        qc = fp8_w8a8_moe_quant_config(torch.ones(E), torch.ones(E))
    elif sh.scheme == "fp8_channel_token":  # per-channel weight scales, dynamic per-token activations
        qc = fp8_w8a8_moe_quant_config(torch.ones(E, 2 * I, 1), torch.ones(E, K, 1), per_act_token_quant=True,
                                       per_out_ch_quant=True)
    elif sh.bias:
        qc = biased_moe_quant_config(torch.zeros(E, 2 * I, dtype=torch.bfloat16),
                                     torch.zeros(E, K, dtype=torch.bfloat16))
    else:
        qc = FUSED_MOE_UNQUANTIZED_CONFIG
    return w1, w2, qc, MoEActivation.from_str(sh.activation)


def compile_tables(gpu_name: str, shapes=None, Ms=None, progress=print) -> list[dict]:
    """Compile, for sm_90, every kernel of the experts step for each entry of ``gpu_name``'s tuned tables (those
    of the bench shapes): one row per entry and kernel it launches, ``{shape, M, kernel, num_warps, num_stages,
    shared, regs, stack, ops}``, or ``{shape, M, error}`` for an entry whose step raised (compilation error, shared
    memory above the SM's, a launch argument Triton rejects, a ``GLUON`` / ``PINGPONG`` / ``COOPERATIVE`` GEMM its
    Gluon kernel does not cover)."""
    from backends.triton import configs as C
    from tools.triton.common import make_routing, shapes as _shapes

    SHAPES = _shapes()
    from backends.triton.experts import fused_experts, plan_quant, strict_kernels

    rows = []
    for sh in SHAPES:
        if shapes and sh.name not in shapes:
            continue
        w1, w2, qc, act = _weights(sh)
        plan = plan_quant(qc)
        table = C.load_table(sh.E, sh.I, plan.cfg_dtype, plan.block_shape, gpu_name)
        if not table:
            continue
        for M in sorted(table):
            if Ms and M not in Ms:
                continue
            t0 = time.time()
            x = torch.empty(M, sh.K, dtype=torch.bfloat16)
            w, ids = make_routing(M, sh.E, sh.topk, torch.device("cpu"), seed=M)  # as the benchmark draws it
            # strict: an entry tuned for a Gluon kernel that does not cover it (it would silently run
            # fused_moe_kernel) is an error
            with compile_only(gpu_name) as log, strict_kernels():
                err = _error_of(lambda: fused_experts(x, w1, w2, w, ids, activation=act, quant_config=qc))
            rows += _rows(sh.name, M, log, err)
            progress(f"[{gpu_name}] {sh.name} M={M}: {len(log)} kernels compiled in {time.time() - t0:.1f}s"
                     + (f", ERROR {err}" if err else ""))
    return rows


def _error_of(step) -> str | None:
    """``step()``'s exception as one line (what a row reports), or None when it returned."""
    try:
        step()
    except Exception as exc:  # noqa: BLE001 - reported per row
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    return None


def _rows(shape: str, M: int, log: list[Compiled], err: str | None) -> list[dict]:
    """The rows of one compiled step: ``{shape, M, error}`` if it raised, then one per kernel it compiled."""
    rows = [dict(shape=shape, M=M, error=err)] if err else []
    for k in log:
        r = k.resources()
        rows.append(dict(shape=shape, M=M, kernel=k.name, num_warps=k.num_warps, num_stages=k.num_stages,
                         shared=k.shared, regs=r["regs"], stack=r["stack"], ops=r["ops"],
                         n_halves=k.constexprs.get("N_HALVES", 0)))
    return rows


def compile_deep_gemm_glue(progress=print) -> list[dict]:
    """Compile, for sm_90, the deep_gemm backend's Triton glue kernels (``backends.deep_gemm.triton_kernels``: the
    activation-and-requantization for each activation and scale rule, the input quantization-and-scatter, the weighted
    top-k reduction, the layout) at Qwen3-30B-A3B's FP8 block shape (K = 2048, I = 768, top-8): one row per kernel,
    ``{shape, M, kernel, num_warps, num_stages, shared, regs, stack, ops}``, or ``{shape, M, error}``."""
    from backends.deep_gemm import triton_kernels as glue
    from backends.deep_gemm.layout import sf_empty
    from reference.activation import MoEActivation

    M, K, I, topk, E = 64, 2048, 768, 8, 128
    steps = [(f"act_mul_quant {act.name} ue8m0={ue8m0}",
              lambda act=act, ue8m0=ue8m0: glue.act_mul_quant(torch.empty(M * topk, 2 * I, dtype=torch.bfloat16),
                                                              act, alpha=None, beta=None, limit=None, group_size=128,
                                                              use_ue8m0=ue8m0, recipe="vllm"))
             for act in (MoEActivation.SILU, MoEActivation.SWIGLUOAI_UNINTERLEAVE, MoEActivation.SWIGLUSTEP)
             for ue8m0 in (False, True)]
    inv = torch.arange(M * topk, dtype=torch.int64).view(M, topk)
    steps += [("quantize_scatter", lambda: glue.quantize_scatter(
                  torch.empty(M, K, dtype=torch.bfloat16), inv, torch.empty(M * topk, K, dtype=torch.float8_e4m3fn),
                  sf_empty(M * topk, K // 128, torch.device("cpu")))),
              ("unpermute_and_reduce", lambda: glue.unpermute_and_reduce(
                  torch.empty(M * topk, K, dtype=torch.bfloat16), inv, torch.ones(M, topk),
                  torch.empty(M, K, dtype=torch.bfloat16))),
              ("build_contiguous_layout", lambda: glue.build_contiguous_layout(
                  torch.randint(0, E, (M, topk), dtype=torch.int32), E, M * topk + E * 128, 128))]
    rows = []
    for name, step in steps:
        with compile_only() as log:
            err = _error_of(step)
        rows += _rows(f"deep_gemm glue {name}", M, log, err)
        progress(f"[sm_90] deep_gemm glue {name}: {len(log)} kernels compiled" + (f", ERROR {err}" if err else ""))
    return rows


def main(argv=None) -> int:
    import json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default="NVIDIA_H200,NVIDIA_H100_80GB_HBM3", help="tables of these device names")
    ap.add_argument("--shapes", default="", help="comma-separated bench shape names (default: all)")
    ap.add_argument("--ms", default="", help="comma-separated table Ms (default: every entry)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON lines instead of a table")
    ap.add_argument("--glue", action="store_true",
                    help="compile the deep_gemm backend's Triton glue kernels instead of the triton backend's tables")
    args = ap.parse_args(argv)
    shapes = set(filter(None, args.shapes.split(",")))
    Ms = {int(m) for m in args.ms.split(",") if m}
    bad = 0
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    for gpu in ["sm_90"] if args.glue else args.gpus.split(","):
        rows = compile_deep_gemm_glue(progress=log) if args.glue else compile_tables(gpu, shapes, Ms, progress=log)
        for r in rows:
            bad += "error" in r
            if args.json:
                print(json.dumps(dict(r, gpu=gpu)), flush=True)
            elif "error" in r:
                print(f"{gpu} {r['shape']} M={r['M']}: ERROR {r['error']}")
            else:
                ops = " ".join(f"{k}={v}" for k, v in r["ops"].items())
                print(f"{gpu[:12]:12s} {r['shape']:20s} M={r['M']:<5d} {r['kernel'][:32]:32s} "
                      f"warps {r['num_warps']:>2d} stages {r['num_stages']} smem {r['shared']:>6d} "
                      f"regs {r['regs']:>3d} stack {r['stack']:>4d}  {ops}")
    if bad:
        print(f"{bad} {'glue steps' if args.glue else 'table entries'} failed to compile for sm_90", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
