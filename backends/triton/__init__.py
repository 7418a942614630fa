"""The ``triton`` backend (placeholder until its kernels land): reports itself unavailable with the reason."""

from backends import Backend, cuda_unavailable_reason, package_unavailable_reason


def _availability():
    return cuda_unavailable_reason((8, 0)) or package_unavailable_reason("triton", "triton") or \
        "the triton backend's kernels are not implemented yet"


backend = Backend(name="triton", version="0", availability=_availability, device="cuda",
                  description="Triton fused MoE kernels")
