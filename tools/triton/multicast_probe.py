"""What 2-CTA TMA multicast buys a Hopper GEMM tile (issue 44's prefill lever), measured on a dense GEMM in Gluon.

Needs Triton >= 3.9 (Gluon's multi-CTA layouts, ``tma.async_load(..., multicast=True)``): on the GPU machine, the
wheel that ``../shared/gpu/triton-parts.sh`` carries (``source /tmp/tw/env.sh`` first); here, a Python 3.12 venv with
``triton==3.9.0`` compiles it offline for sm_90 (``--compile-only``: PTX evidence, no GPU).

The kernel: ``C (M, N) = A (M, K) @ B (N, K)^T`` (B stored as the experts' weights are, K-major), bf16 or FP8 e4m3
operands, fp32 accumulation in place, bf16 out; a ``STAGES``-deep TMA ring, one partition of 8 warps (two
warpgroups of 64 rows: a 128 x ``BN`` tile per CTA, ``fused_moe_kernel``'s prefill tile). ``--pair``:

- ``none``: one CTA per tile (what every kernel of the backend does today);
- ``m``: a cluster of 2 CTAs computes two M tiles that share the B tile: the lead CTA loads B once and multicasts it
  into both CTAs' shared memory (each CTA loads its own A rows). Per CTA and K step: A + B / 2 bytes from L2 instead
  of A + B. A stage may be refilled only when both CTAs are done with it, so the ring's "empty" barrier is a
  two-CTA one (both consumers arrive on the lead CTA's barrier, the lead waits on it before it multicasts).

Every variant is checked against ``torch.matmul`` (fp32) before it is timed (``triton.testing.do_bench``, CUDA
graphs), beside cuBLAS (``torch.matmul`` in bf16). What the MoE kernel would need beyond this (pairs of one expert's
M tiles, the promoted FP8 accumulation, warp specialization) is in docs/notes/triton.md.

    python -m tools.triton.multicast_probe                       # GPU: the default shapes, bf16 and fp8
    python -m tools.triton.multicast_probe --compile-only        # any machine with Triton >= 3.9: PTX evidence
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

try:  # Triton >= 3.9
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAVE_MULTICTA = hasattr(tma, "async_load") and hasattr(gl, "num_ctas")
except ImportError:  # pragma: no cover - older Triton
    HAVE_MULTICTA = False

BM, STAGES, WARPS = 128, 4, 8


def _bk(dt) -> int:
    """K tile: 128 bytes of a row (the 128-byte swizzle)."""
    return 128 // (dt.itemsize if isinstance(dt, torch.dtype) else dt.primitive_bitwidth // 8)


@gluon.jit
def probe_gemm_kernel(a_desc, b_desc, c_ptr, M, N, K, stride_cm, BN: gl.constexpr, PAIR: gl.constexpr,
                      STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """One cluster tile of ``(1 + PAIR) * BM`` rows x ``BN`` columns (``PAIR``: two CTAs sharing B by multicast)."""
    CM: gl.constexpr = a_desc.block_shape[0]  # the cluster tile's rows: BM per CTA
    BKC: gl.constexpr = a_desc.block_shape[1]
    pid = gl.program_id(0)  # one program per cluster
    num_m = gl.cdiv(M, CM)
    num_n = gl.cdiv(N, BN)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    gsz = gl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % gsz
    pid_n = (pid % group) // gsz
    off_m = pid_m * CM
    off_n = pid_n * BN

    a_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES, CM, BKC], a_desc.layout)
    b_s = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BKC], b_desc.layout)
    ready = mbarrier.allocate_mbarrier(batch=STAGES)  # one per CTA: its A rows and the (multicast) B tile landed
    empty = mbarrier.allocate_mbarrier(batch=STAGES, two_ctas=PAIR)  # PAIR: both CTAs released the stage
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)

    if PAIR:
        acc_cga: gl.constexpr = [[1, 0]]
    else:
        acc_cga: gl.constexpr = []
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                   instr_shape=[16, BN, 256 // a_desc.dtype.primitive_bitwidth],
                                                   cga_layout=acc_cga)
    acc = gl.zeros([CM, BN], gl.float32, acc_l)
    nk = gl.cdiv(K, BKC)
    nbytes: gl.constexpr = a_desc.nbytes_per_cta + b_desc.nbytes_per_cta
    for i in gl.static_range(STAGES - 1):  # prologue: the ring's first STAGES - 1 K tiles (all stages free)
        mbarrier.expect(ready.index(i), nbytes, pred=i < nk)
        tma.async_load(a_desc, [off_m, i * BKC], ready.index(i), a_s.index(i), pred=i < nk)
        tma.async_load(b_desc, [off_n, i * BKC], ready.index(i), b_s.index(i), pred=i < nk, multicast=PAIR)
    for k in range(nk):
        s = k % STAGES
        mbarrier.wait(ready.index(s), (k // STAGES) & 1)
        acc = warpgroup_mma(a_s.index(s), b_s.index(s).permute((1, 0)), acc, is_async=True)
        # K tile k - 1's MMA done: its stage is free here; refill it with K tile k - 1 + STAGES (at k = 0 that stage
        # is the one the prologue left unused)
        acc = warpgroup_mma_wait(1, deps=(acc,))
        j = k - 1 + STAGES
        sp = j % STAGES
        if k > 0:
            mbarrier.arrive(empty.index(sp))
        if j < nk:
            if k > 0:
                # the lead CTA waits until both CTAs released the stage (the other CTA's wait is a no-op: it only
                # loads into its own A rows, which its own MMA above has finished with)
                mbarrier.wait(empty.index(sp), ((k - 1) // STAGES) & 1)
            mbarrier.expect(ready.index(sp), nbytes)
            tma.async_load(a_desc, [off_m, j * BKC], ready.index(sp), a_s.index(sp))
            tma.async_load(b_desc, [off_n, j * BKC], ready.index(sp), b_s.index(sp), multicast=PAIR)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    out_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0], cga_layout=acc_cga)
    c = gl.convert_layout(acc.to(gl.bfloat16), out_l)
    rows = off_m + gl.arange(0, CM, gl.SliceLayout(1, out_l))
    cols = off_n + gl.arange(0, BN, gl.SliceLayout(0, out_l))
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    gl.store(c_ptr + rows.to(gl.int64)[:, None] * stride_cm + cols[None, :], c, mask=mask)


def _gl_dtype(dt):
    return {torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv}[dt]


def descriptors(a, b, bn: int, pair: bool):
    cm, bk = BM * (2 if pair else 1), _bk(a.dtype)
    a_l = gl.NVMMASharedLayout.get_default_for([cm, bk], _gl_dtype(a.dtype), cga_layout=[[1, 0]] if pair else None)
    b_l = gl.NVMMASharedLayout.get_default_for([bn, bk], _gl_dtype(b.dtype), cga_layout=[[0, 0]] if pair else None)
    return TensorDescriptor.from_tensor(a, [cm, bk], a_l), TensorDescriptor.from_tensor(b, [bn, bk], b_l)


def gemm(a, b, c, bn: int, pair: bool, group_m: int = 8):
    M, K = a.shape
    N = b.shape[0]
    a_d, b_d = descriptors(a, b, bn, pair)
    grid = (triton.cdiv(M, BM * (2 if pair else 1)) * triton.cdiv(N, bn),)
    probe_gemm_kernel[grid](a_d, b_d, c, M, N, K, c.stride(0), BN=bn, PAIR=pair, STAGES=STAGES, GROUP_M=group_m,
                            num_warps=WARPS, num_ctas=2 if pair else 1)
    return c


def compile_only() -> int:
    """Compile both variants for sm_90 without a GPU; print the multicast and cluster lines of the PTX."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    for dt, name in ((gl.bfloat16, "bf16"), (gl.float8e4nv, "fp8e4nv")):
        for pair in (False, True):
            bn = 256 if dt == gl.bfloat16 else 128
            cm, bk = BM * (2 if pair else 1), _bk(dt)
            a_l = gl.NVMMASharedLayout.get_default_for([cm, bk], dt, cga_layout=[[1, 0]] if pair else None)
            b_l = gl.NVMMASharedLayout.get_default_for([bn, bk], dt, cga_layout=[[0, 0]] if pair else None)
            sig = {"a_desc": f"tensordesc<{name}[{cm},{bk}],{a_l!r}>", "b_desc": f"tensordesc<{name}[{bn},{bk}],{b_l!r}>",
                   "c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_cm": "i32",
                   "BN": "constexpr", "PAIR": "constexpr", "STAGES": "constexpr", "GROUP_M": "constexpr"}
            src = GluonASTSource(probe_gemm_kernel, sig,
                                 constexprs={"BN": bn, "PAIR": pair, "STAGES": STAGES, "GROUP_M": 8})
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=WARPS, num_ctas=2 if pair else 1))
            ptx = k.asm["ptx"]
            lines = [ln.strip() for ln in ptx.splitlines() if not ln.strip().startswith(".loc") and (
                "multicast" in ln or "reqnctapercluster" in ln or "mapa" in ln or "shared::cluster" in ln)]
            print(f"{name} pair={pair}: {k.metadata.shared} B shared, {len(lines)} cluster lines, SASS wgmma waits "
                  f"{_sass_waits(k.asm['cubin'])} (a wait leaving 0x1 group in flight: the MMAs overlap the loads)")
            for ln in lines[:8]:
                print("   ", ln[:160])
    return 0


def _sass_waits(cubin: bytes) -> dict:
    """The SASS wgmma waits (``DEPBAR.LE gsb0, N``: N groups left in flight; ptxas turns every wait into 0 when it
    serializes the wgmmas), read with Triton's bundled cuobjdump."""
    import collections
    import os
    import re
    import subprocess
    import tempfile
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "--dump-sass", f.name], capture_output=True, text=True).stdout
    return dict(collections.Counter(re.findall(r"DEPBAR\.LE gsb0, (0x\d)", sass)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compile-only", action="store_true", help="compile for sm_90 and print PTX evidence (no GPU)")
    p.add_argument("--shapes", default="8192x8192x8192,8192x14336x4096,1024x14336x4096,256x1536x2048",
                   help="comma-separated MxNxK")
    p.add_argument("--dtypes", default="bf16,fp8")
    args = p.parse_args(argv)
    if not HAVE_MULTICTA:
        print(f"multicast_probe needs Triton >= 3.9 (Gluon multi-CTA); this is Triton {triton.__version__}",
              file=sys.stderr)
        return 2
    if args.compile_only:
        return compile_only()
    if not torch.cuda.is_available():
        print("no GPU: pass --compile-only", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()}, Triton {triton.__version__}; TFLOP/s (time us), checked against fp32")
    print("| dtype | M x N x K | tile | one CTA a tile | 2-CTA pair, B multicast | pair / one | cuBLAS bf16 |")
    print("|---|---|---|---|---|---|---|")
    for dname in args.dtypes.split(","):
        dt = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[dname]
        bn = 256 if dt == torch.bfloat16 else 128
        for spec in args.shapes.split(","):
            M, N, K = map(int, spec.split("x"))
            g = torch.Generator(device=dev).manual_seed(0)
            a32 = torch.randn(M, K, device=dev, generator=g) * 0.5
            b32 = torch.randn(N, K, device=dev, generator=g) * 0.5
            a, b = a32.to(dt), b32.to(dt)
            ref = a.float() @ b.float().t()
            flops = 2.0 * M * N * K
            res = {}
            for pair in (False, True):
                c = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
                gemm(a, b, c, bn, pair)
                err = ((c.float() - ref).norm() / ref.norm()).item()
                if not err < 1e-2:
                    res[pair] = f"wrong (rel {err:.1e})"
                    continue
                ms = triton.testing.do_bench_cudagraph(lambda: gemm(a, b, c, bn, pair))
                res[pair] = (flops / ms * 1e-9, ms * 1e3)
            ab, bb = a32.bfloat16(), b32.bfloat16()
            ms = triton.testing.do_bench_cudagraph(lambda: ab @ bb.t())
            fmt = lambda r: r if isinstance(r, str) else f"{r[0]:.0f} ({r[1]:.1f})"  # noqa: E731
            ratio = (f"{res[False][1] / res[True][1]:.3f}x" if all(not isinstance(res[x], str) for x in res)
                     else "-")
            print(f"| {dname} | {M}x{N}x{K} | {BM}x{bn} | {fmt(res[False])} | {fmt(res[True])} | {ratio} "
                  f"| {flops / ms * 1e-9:.0f} ({ms * 1e3:.1f}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
