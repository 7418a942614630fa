"""Just-in-time build of the ``cuda`` backend's extension: the router GEMMs (``router_gemm.cu``), the experts step's
glue kernels (``moe_glue.cu``) and their torch binding (``binding.cpp``).

The extension is compiled on first use with ``torch.utils.cpp_extension.load`` (ninja + nvcc) for SM90:
``-O3 -gencode=arch=compute_90a,code=sm_90a`` plus ``compute_90`` PTX so newer GPUs can JIT it. Builds are cached
under ``$MOE_CUDA_BUILD_DIR`` (default ``~/.cache/moe_conformance/cuda_ext/<name>``); the module name carries a
hash of the sources, the flags, and the torch and CUDA versions, so editing a source (or switching torch) builds a
fresh module instead of loading a stale one.

Errors:
    ``toolchain_unavailable_reason()`` says why no build can be attempted here (no CUDA build of torch, no nvcc,
    no ninja) without compiling anything; the backend's availability check reports it.
    ``load_router_gemm_ext()`` raises ``RuntimeError`` whose message names the build directory and ends with the
    tail of the compiler output; the failure is remembered, so later calls (and the availability check) report it
    at once instead of recompiling.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
from pathlib import Path

__all__ = [
    "SRC_DIR",
    "SOURCES",
    "HEADERS",
    "NVCC_FLAGS",
    "CXX_FLAGS",
    "extension_name",
    "build_directory",
    "find_nvcc",
    "toolchain_unavailable_reason",
    "load_router_gemm_ext",
    "build_failure",
    "standalone_nvcc_command",
]

SRC_DIR = Path(__file__).resolve().parent  # backends/cuda: the sources beside this module
SOURCES = (SRC_DIR / "binding.cpp", SRC_DIR / "router_gemm.cu", SRC_DIR / "moe_glue.cu")
HEADERS = (SRC_DIR / "router_gemm.h", SRC_DIR / "moe_glue.h")

#: nvcc flags of the build. Naming an arch here stops torch from adding its own -gencode flags.
NVCC_FLAGS = (
    "-O3",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_90,code=compute_90",
    "-lineinfo",
)
CXX_FLAGS = ("-O3",)

_TAIL_CHARS = 4000
_lock = threading.Lock()
_module = None
_failure: str | None = None


def extension_name() -> str:
    """``moe_router_gemm_<12 hex>``: a hash of sources, headers, flags, torch and CUDA versions."""
    import torch

    h = hashlib.sha256()
    for p in (*SOURCES, *HEADERS):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(repr((NVCC_FLAGS, CXX_FLAGS, torch.__version__, torch.version.cuda)).encode())
    return f"moe_router_gemm_{h.hexdigest()[:12]}"


def build_directory(name: str | None = None) -> Path:
    """Where the build of ``name`` lives: ``$MOE_CUDA_BUILD_DIR/<name>`` or ``~/.cache/moe_conformance/cuda_ext/
    <name>`` (a temporary directory if the home directory is not writable). Created if missing."""
    name = name or extension_name()
    root = os.environ.get("MOE_CUDA_BUILD_DIR")
    candidates = [Path(root)] if root else []
    candidates.append(Path(os.path.expanduser("~")) / ".cache" / "moe_conformance" / "cuda_ext")
    candidates.append(Path(tempfile.gettempdir()) / "moe_conformance_cuda_ext")
    last_exc: OSError | None = None
    for base in candidates:
        try:
            d = base / name
            d.mkdir(parents=True, exist_ok=True)
            return d
        except OSError as exc:
            last_exc = exc
    raise RuntimeError(f"no writable build directory for the cuda backend's extension: {last_exc}")


def find_nvcc() -> str | None:
    """Path of nvcc: ``$CUDA_HOME/bin/nvcc`` (torch's CUDA_HOME), else ``nvcc`` on PATH, else /usr/local/cuda."""
    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except Exception:  # pragma: no cover - torch always has cpp_extension
        CUDA_HOME = None
    for home in (CUDA_HOME, os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    on_path = shutil.which("nvcc")
    if on_path:
        return on_path
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


def toolchain_unavailable_reason() -> str | None:
    """None if a JIT build can be attempted here, else why not (never compiles, never raises)."""
    try:
        import torch
        from torch.utils import cpp_extension
    except Exception as exc:  # pragma: no cover
        return f"torch.utils.cpp_extension is unavailable: {exc}"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build: the extension (router GEMMs, experts glue) cannot be built"
    if cpp_extension.CUDA_HOME is None:
        return ("CUDA toolkit not found (torch.utils.cpp_extension.CUDA_HOME is None): set CUDA_HOME to the "
                "directory holding bin/nvcc to build the router GEMM kernels")
    if not (Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc").exists():
        return f"nvcc not found under CUDA_HOME={cpp_extension.CUDA_HOME}: the router GEMM kernels cannot be built"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja): torch.utils.cpp_extension.load needs it"
    if _failure is not None:
        return f"building the extension (router GEMMs, experts glue) failed earlier in this process: {_failure.splitlines()[0]}"
    return None


def build_failure() -> str | None:
    """The message of this process's failed build, or None."""
    return _failure


def _tail(text: str, n: int = _TAIL_CHARS) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


def load_router_gemm_ext(verbose: bool = False):
    """Build (first call) or load the extension module; cached for the process.

    Returns:
        The module, with ``dsv3_router_gemm(x, w, out_bf16, variant=-1)``, ``fp32_router_gemm(x, w, variant=-1)``,
        ``dsv3_variants()``, ``fp32_variants()``, ``dsv3_auto_variant(M, E)``, ``fp32_auto_variant(M)``.

    Raises:
        RuntimeError: the toolchain is missing (the reason) or the build failed (build directory, flags and the
            tail of the compiler output). A failed build is not retried in this process.
    """
    global _module, _failure
    if _module is not None:
        return _module
    with _lock:
        if _module is not None:
            return _module
        if _failure is not None:
            raise RuntimeError(_failure)
        reason = toolchain_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"cannot build the cuda backend's extension (router GEMMs, experts glue): {reason}")
        from torch.utils.cpp_extension import load

        name = extension_name()
        build_dir = build_directory(name)
        try:
            _module = load(
                name=name,
                sources=[str(p) for p in SOURCES],
                extra_cflags=list(CXX_FLAGS),
                extra_cuda_cflags=list(NVCC_FLAGS),
                extra_include_paths=[str(SRC_DIR)],
                build_directory=str(build_dir),
                with_cuda=True,
                verbose=verbose,
            )
        except Exception as exc:  # ninja/nvcc errors arrive as RuntimeError with the compiler output appended
            _failure = (
                f"building the extension {name} (router GEMMs, experts glue) failed ({type(exc).__name__}); build directory "
                f"{build_dir}; nvcc flags {' '.join(NVCC_FLAGS)}. Compiler output (tail):\n{_tail(str(exc))}"
            )
            raise RuntimeError(_failure) from exc
        return _module


def standalone_nvcc_command(nvcc: str, output: str | os.PathLike, *, extra: tuple[str, ...] = (),
                            source: str = "router_gemm.cu") -> list[str]:
    """The nvcc command that compiles one kernel source (``router_gemm.cu`` or ``moe_glue.cu``; neither includes torch
    headers) alone to an object file, with the flags of the real build plus torch's common CUDA defines (used by the
    CPU tests as a compile-only check)."""
    return [
        nvcc,
        "-std=c++17",
        *NVCC_FLAGS,
        "-D__CUDA_NO_HALF_OPERATORS__",
        "-D__CUDA_NO_HALF_CONVERSIONS__",
        "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-D__CUDA_NO_HALF2_OPERATORS__",
        "--expt-relaxed-constexpr",
        "-Xcompiler",
        "-fPIC",
        *extra,
        "-c",
        str(SRC_DIR / source),
        "-o",
        str(output),
    ]
