"""Backend-only tools of the deep_gemm backend (GPU scripts run as ``python3 -m backends.deep_gemm.tools.<name>``):
``probe`` (layout probe, kernels against the torch ops, the grouped GEMM at the published shapes). They import only
reference, specs, benchmarks and this backend."""
