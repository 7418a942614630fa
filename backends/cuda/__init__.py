"""The ``cuda`` backend (placeholder until its kernels land): reports itself unavailable with the reason."""

from backends import Backend, cuda_unavailable_reason


def _availability():
    return cuda_unavailable_reason((9, 0)) or "the cuda backend is not implemented yet"


backend = Backend(name="cuda", version="0", availability=_availability, device="cuda",
                  description="cuBLAS / CUTLASS grouped GEMMs through torch, CUDA router GEMMs")
