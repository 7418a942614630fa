"""Backend-only tools of the cuda backend: the just-in-time build of the router GEMM extension (``build``, used by
the backend at run time) and the extra benchmark variants (``bench_variants``, read by ``python -m benchmarks``).
They import only reference, specs and benchmarks (``bench_variants``; the backend never imports it)."""
