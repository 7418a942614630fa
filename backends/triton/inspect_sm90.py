"""Compile ``fused_moe_kernel`` variants for sm_90 on a machine without a GPU and report their resources.

    python -m backends.triton.inspect_sm90            # the default variant list
    python -m backends.triton.inspect_sm90 --sass K   # also print the first K SASS lines of each

Uses Triton's bundled ptxas / cuobjdump (``triton.compile`` with ``GPUTarget("cuda", 90, 32)``) and mimics the JIT's
argument specialization (16-byte aligned pointers, unit strides as constants, multiples of 16 marked divisible), so
the numbers match what the GPU run compiles: registers, stack (spills), shared memory, and which MMA / copy
instructions appear (HGMMA / QGMMA / IGMMA = wgmma, HMMA = mma.sync, LDGSTS = cp.async, UTMALDG = TMA).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from backends.triton.kernels import fused_moe_kernel

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_FLOATS = ("alpha", "beta", "limit", "amax_floor", "ue8m0_floor")
_NOSPEC = ("EM", "num_valid_tokens")
# representative runtime ints (Qwen3-30B GEMM1); unit strides become constants as in the JIT
INTS = dict(N=768, K=2048, EM=1024, num_valid_tokens=1000, UP_OFF=768, NW=1536, stride_am=2048, stride_ak=1,
            stride_be=1536 * 2048, stride_bn=2048, stride_bk=1, stride_cm=768, stride_cn=1, stride_asm=16,
            stride_ask=1, stride_bse=96, stride_bsn=16, stride_bsk=1, stride_biase=1536, stride_biasn=1,
            stride_csm=6, stride_csg=1)
BASE = dict(GROUP_N=128, GROUP_K=128, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, TOP_K=8, A_GATHER=True,
            C_SORTED=True, A_SCALE=0, B_SCALE=0, B_SCALAR=False, INT8=False, HAS_BIAS=False, FUSE=1, ACT=1,
            HAS_LIMIT=False, ACT_DT=tl.bfloat16, OUT_QUANT=False, USE_UE8M0=False, UE8M0_EXACT=False,
            SCALE_INV=False, RECIP_MUL=False, EVEN_K=True, TMA_A=False, TMA_B=False, EMU=False, DOT_PREC="tf32")
_F8 = dict(a_dt="fp8e4nv", b_dt="fp8e4nv")
_BLK = dict(A_SCALE=3, B_SCALE=3, B_SCALAR=True)
VARIANTS = [
    ("bf16 gemm1 fused BM64 BN64 BK64 w4 s4", {}, dict(num_stages=4)),
    ("bf16 gemm1 fused BM128 BN128 BK64 w8 s3", dict(BLOCK_M=128, BLOCK_N=128), dict(num_warps=8)),
    ("bf16 gemm1 decode BM16 BN64 BK128 w4 s4", dict(BLOCK_M=16, BLOCK_K=128), dict(num_stages=4)),
    ("bf16 gemm1 TMA weights BM64 BN64", dict(TMA_B=True), dict(tma_b="tensordesc<bf16[64, 64]>")),
    ("bf16 gemm2 BM128 BN256 BK64 w8 s3", dict(FUSE=0, A_GATHER=False, C_SORTED=False, BLOCK_M=128, BLOCK_N=256),
     dict(num_warps=8)),
    ("fp8blk gemm1 fused-quant BM64 BN128 BK128 w8", dict(BLOCK_N=128, BLOCK_K=128, OUT_QUANT=True, **_BLK),
     dict(num_warps=8, dts=dict(_F8, c_dt="u8"))),
    ("fp8blk gemm2 BM64 BN128 BK128 w4", dict(FUSE=0, A_GATHER=False, C_SORTED=False, BLOCK_N=128, BLOCK_K=128,
                                               **_BLK), dict(dts=_F8)),
    ("int8 gemm1 BM64 BN64 BK128", dict(INT8=True, A_SCALE=2, B_SCALE=2, BLOCK_K=128), dict(dts=dict(a_dt="i8",
                                                                                               b_dt="i8"))),
    ("bf16 gemm1 swigluoai interleaved + bias", dict(FUSE=2, ACT=4, HAS_BIAS=True), {}),
]


def compile_variant(cex: dict, *, a_dt="bf16", b_dt="bf16", c_dt="bf16", tma_a=None, tma_b=None, num_warps=4,
                    num_stages=3, ints=None):
    """``triton.compile`` one specialization of ``fused_moe_kernel`` for sm_90; returns the CompiledKernel."""
    fn = fused_moe_kernel
    iv = dict(INTS, **(ints or {}))
    ptr = dict(a_ptr=f"*{a_dt}", b_ptr=f"*{b_dt}", c_ptr=f"*{c_dt}", cs_ptr="*fp32", a_scale_ptr="*fp32",
               b_scale_ptr="*fp32", bias_ptr="*bf16", sorted_token_ids_ptr="*i32", expert_ids_ptr="*i32",
               num_tokens_post_padded_ptr="*i32")
    sig, consts, attrs = {}, {}, {}
    for i, n in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr:
            sig[n] = "constexpr"
            consts[(i,)] = cex[n]
        elif n in ptr:
            sig[n] = ptr[n]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in _FLOATS:
            sig[n] = "fp32"
        elif n in ("a_desc", "b_desc"):
            d = tma_a if n == "a_desc" else tma_b
            sig[n] = d or "constexpr"
            if not d:
                consts[(i,)] = None
        else:
            v = iv[n]
            if v == 1 and n not in _NOSPEC:
                sig[n] = "constexpr"
                consts[(i,)] = 1
            else:
                sig[n] = "i32"
                if v % 16 == 0 and n not in _NOSPEC:
                    attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                              num_stages=num_stages))


def report(k, label: str, sass_lines: int = 0) -> str:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(k.asm["cubin"])
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-sass", path], capture_output=True,
                              text=True).stdout
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", path], capture_output=True,
                             text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", res, re.S)
    ops = {o: sass.count(o) for o in ("HGMMA", "QGMMA", "IGMMA", "HMMA", "UTMALDG", "LDGSTS", "STL", "LDL")}
    ops = " ".join(f"{o}={c}" for o, c in ops.items() if c)
    regs, stack = m.groups() if m else ("?", "?")
    line = f"{label:48s} regs {regs:>3s} stack {stack:>4s} smem {k.metadata.shared:>6d}  {ops}"
    if sass_lines:
        line += "\n" + "\n".join(sass.splitlines()[:sass_lines])
    return line


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sass", type=int, default=0, help="print this many SASS lines per variant")
    args = ap.parse_args(argv)
    for label, cex, opts in VARIANTS:
        opts = dict(opts)
        dts = opts.pop("dts", {})
        t = time.time()
        try:
            k = compile_variant(dict(BASE, **cex), **dts, **opts)
            print(report(k, f"{label} ({time.time() - t:.1f}s)", args.sass), flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"{label}: FAILED {type(exc).__name__}: {str(exc)[:400]}", flush=True)


if __name__ == "__main__":
    main()
