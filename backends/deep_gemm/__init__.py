"""The ``deep_gemm`` backend (placeholder until DeepGemmExperts lands): reports itself unavailable with the reason."""

from backends import Backend, cuda_unavailable_reason, package_unavailable_reason


def _availability():
    return cuda_unavailable_reason((9, 0)) or package_unavailable_reason("deep_gemm", "deep_gemm") or \
        "the deep_gemm backend is not implemented yet"


backend = Backend(name="deep_gemm", version="0", availability=_availability, device="cuda",
                  description="DeepGEMM grouped FP8 GEMMs (seed 001 DeepGemmExperts)")
