"""Launch options shared by the backends that ship Triton kernels (``triton``, ``deep_gemm``'s glue kernels).

:data:`FP_FUSION` is passed at every floating-point kernel launch of both backends: FMA contraction on (``a * b + c``
rounded once), the default of Triton 3.6 - 3.9 under which their numerics were checked on the GPU. Contraction
decides the rounding of the FP8 promotion (``acc += y * s``), the epilogue scales, the activations and the top-k
weighted sum (an sm_90 compile under 3.9 with ``TRITON_DEFAULT_FP_FUSION=0`` turns those FFMAs into FMUL + FADD; the
quantizers' codes do not change: their divisions and products round explicitly). Triton 3.10 turns the default off,
so it is pinned here, whatever the environment says (``tests/test_triton_sm90_compile.py`` compiles every kernel
with the default off and finds it unchanged).
"""

from __future__ import annotations

#: ``kernel[grid](..., **FP_FUSION)``: see the module docstring
FP_FUSION = {"enable_fp_fusion": True}
