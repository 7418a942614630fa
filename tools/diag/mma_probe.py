"""How does a tensor-core inner product round? Test vectors for the bf16 / fp16 MMA of a GPU (issue 22: the bf16
experts cases where the triton and cuda kernels agree with each other and differ from every reference variant).

    python tools/diag/mma_probe.py                 # GPU: cuBLAS (torch.mm, fp32 out), Triton wgmma (BLOCK_M 64), mma.sync (16)
    python tools/diag/mma_probe.py --emulate       # CPU: the same vectors through fp32 and emulated MMA models (self-check)

Each test vector is one row ``a`` against ``b = ones`` (so the products are the elements of ``a``, exact in any
format). Three families, each swept over ``j`` (the small terms are ``2^-j`` against a leading 1):

- ``align``: ``[1, 2^-j x 15]`` in one 16-wide k-block. An fp32 accumulator rounding to nearest keeps each small term
  while ``j <= 23``; hardware that aligns the block's products to the largest exponent and keeps ``p`` bits drops them
  once ``j > p`` (Fasi et al. 2021, "Numerical behavior of NVIDIA tensor cores"; Khattak & Mikaitis 2025, "Accurate
  models of NVIDIA tensor cores", arXiv 2512.07004).
- ``neg``: ``[1, -2^-j x 15]``: the same with a negative tail; truncation (round toward zero) and round-to-nearest
  differ in sign here.
- ``carry``: ``[1, 0 x 15 | 2^-j x 16]``: the small terms in the *next* k-block, so they meet the running accumulator
  rather than a product of the same block.

The printed figure is ``(got - exact) / 2^-j``: 0 exact; ``-15`` the whole tail lost (``-16`` for ``carry``); a
fraction, a partial loss. Reading: the largest ``j`` that stays exact in ``align`` is the alignment width ``p``; ``neg``
shows the rounding direction; ``carry`` whether the accumulator is aligned with the products. Findings go to
docs/notes/gpu-sessions.md and, once the parameters are known, become an ``Accumulation`` of ``reference/error_model.py`` (a
property of the SM90 MMA shared by every kernel on it), not a widened bound.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from reference.error_model import emulate_mma16  # noqa: E402

K_BLOCK = 16
JS = list(range(18, 31))


def vectors(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``{family: (len(JS), 32)`` rows in ``dtype``, one per ``j``}; exact in bf16 and fp16 for every ``j`` in JS
    (powers of two; fp16's subnormals reach 2^-24: fp16 rows beyond that are flushed, and printed as "-")."""
    out = {}
    for fam in ("align", "neg", "carry"):
        rows = torch.zeros(len(JS), 2 * K_BLOCK, dtype=torch.float64)
        for r, j in enumerate(JS):
            t = 2.0 ** -j
            rows[r, 0] = 1.0
            if fam == "align":
                rows[r, 1:K_BLOCK] = t
            elif fam == "neg":
                rows[r, 1:K_BLOCK] = -t
            else:
                rows[r, K_BLOCK:] = t
        out[fam] = rows.to(dtype)
    return out


def exact(rows: torch.Tensor) -> torch.Tensor:
    return rows.double().sum(dim=1)


def emulated_mma(rows: torch.Tensor, p: int, block: int = K_BLOCK) -> torch.Tensor:
    """``rows @ ones`` on the model MMA of ``reference.error_model.emulate_mma16`` (step 1b): per step of ``block``
    products, aligned with the accumulator, ``p`` bits kept below the largest magnitude, normalized toward zero."""
    ones = torch.ones(1, rows.shape[1], dtype=rows.dtype)
    return emulate_mma16(rows, ones, block=block, align_bits=p)[:, 0].double()


def sequential_fp32(rows: torch.Tensor) -> torch.Tensor:
    """``rows @ ones`` accumulated left to right in fp32, rounding to nearest after every addition."""
    acc = torch.zeros(rows.shape[0], dtype=torch.float32)
    for k in range(rows.shape[1]):
        acc = acc + rows[:, k].float()
    return acc.double()


def engines(emulate: bool):
    """``{name: fn(rows (n, K) dtype) -> (n,) float64}``: each computes ``rows @ ones``."""
    if emulate:
        return {
            "cpu fp32 (sequential RN)": sequential_fp32,
            "model p=24 trunc": lambda r: emulated_mma(r, 24),
            "model p=25 trunc": lambda r: emulated_mma(r, 25),
        }
    import triton
    import triton.language as tl

    @triton.jit
    def dot_kernel(a_ptr, b_ptr, c_ptr, M, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        ks = tl.arange(0, K)
        cols = tl.arange(0, BN)
        a = tl.load(a_ptr + rows[:, None] * K + ks[None, :], mask=rows[:, None] < M, other=0.0)
        b = tl.load(b_ptr + ks[:, None] * BN + cols[None, :])
        c = tl.dot(a, b)  # one dot over all of K: the MMA's own chaining of its k-blocks
        tl.store(c_ptr + rows[:, None] * BN + cols[None, :], c, mask=rows[:, None] < M)

    def triton_dot(bm):
        def run(r):
            a = r.cuda().contiguous()
            b = torch.ones(a.shape[1], 16, dtype=a.dtype, device="cuda")
            c = torch.empty(a.shape[0], 16, dtype=torch.float32, device="cuda")
            dot_kernel[(triton.cdiv(a.shape[0], bm),)](a, b, c, a.shape[0], K=a.shape[1], BM=bm, BN=16,
                                                       num_warps=4)
            return c[:, 0].double().cpu()
        return run

    def cublas(r):
        a = r.cuda()
        b = torch.ones(16, a.shape[1], dtype=a.dtype, device="cuda")
        return torch.mm(a, b.T, out_dtype=torch.float32)[:, 0].double().cpu()

    return {"cuBLAS torch.mm fp32 out": cublas, "triton tl.dot BM64 (wgmma)": triton_dot(64),
            "triton tl.dot BM16 (mma.sync)": triton_dot(16)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--emulate", action="store_true", help="CPU: fp32 and emulated MMA models (no GPU needed)")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    args = ap.parse_args(argv)
    if not args.emulate and not torch.cuda.is_available():
        print("no CUDA GPU: run with --emulate for the CPU self-check", file=sys.stderr)
        return 2
    if not args.emulate:
        print(f"device: {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))}), "
              f"torch {torch.__version__}")
    for dname in args.dtypes.split(","):
        dtype = getattr(torch, dname)
        vec = vectors(dtype)
        print(f"\n## {dname}: (got - exact) / 2^-j; 0 = exact, -15 / -16 = the tail lost")
        print("| engine | family | " + " | ".join(f"j={j}" for j in JS) + " |")
        print("|---|---|" + "---|" * len(JS))
        for name, fn in engines(args.emulate).items():
            for fam, rows in vec.items():
                got, want = fn(rows), exact(rows)
                cells = []
                for r, j in enumerate(JS):
                    if dtype == torch.float16 and j > 24:
                        cells.append("-")  # below fp16's smallest subnormal
                        continue
                    d = (got[r] - want[r]) / 2.0 ** -j
                    cells.append("0" if d == 0 else f"{d:.3g}")
                print(f"| {name} | {fam} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
