"""Tools of the deep_gemm backend (GPU scripts run as ``python3 -m tools.deep_gemm.<name>``): ``probe`` (layout
probe, kernels against the torch ops, the grouped GEMM at the published shapes)."""
