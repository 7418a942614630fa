"""vLLM's own compiled activation and FP8 quantization ops, built from its ``csrc/``, for the live peer's whole chain.

``python -m benchmarks --peer vllm`` times vLLM's ``fused_moe_kernel`` live (``benchmarks.peer_vllm``), a Triton
kernel that runs from source. Between its two GEMMs vLLM's ``TritonExperts`` runs two compiled ops of its
``_C_stable_libtorch`` extension: the activation (``apply_moe_activation`` -> ``torch.ops._C.silu_and_mul`` /
``swigluoai_and_mul``) and the requantization of GEMM2's input (``moe_kernel_quantize_input`` ->
``ops.scaled_fp8_quant`` -> ``dynamic_scaled_fp8_quant`` / ``dynamic_per_token_scaled_fp8_quant`` /
``static_scaled_fp8_quant``, or ``per_token_group_quant_fp8`` -> ``per_token_group_fp8_quant``). A backend's GEMM
stage (the bench's ``gemms``) fuses or runs these itself, so a like-for-like peer times them too; vLLM cannot be
imported here (its wheel needs its own torch), so this module compiles just those kernels, verbatim from vLLM's
source files, registered under the op namespace ``_moe_vllm_peer`` with the schemas and C++ functions read from
vLLM's own ``csrc/torch_bindings.cpp`` (``bindings``).

The build (``build``) needs nvcc (``$CUDA_HOME/bin/nvcc`` or on ``PATH``), a C++ compiler and a CUDA torch: its
headers and libraries are the ones the ops link against, through the stable ABI vLLM targets
(``TORCH_TARGET_VERSION`` 2.11, as vLLM 0.33's CMakeLists.txt sets it). Flags: vLLM's for these files (C++20,
torch's ``COMMON_NVCC_FLAGS`` less the half-conversion switches CUDA 12 drops, ``-DENABLE_FP8 -DUSE_CUDA``), plus
``--expt-extended-lambda``, which their ``__device__`` lambdas need to compile here; for the GPU's own
architecture. The library is cached under ``peer_vllm.cache_dir()`` by a hash of the sources, flags, torch and nvcc
versions; 37 s on the H200 machine's 16 cores. ``$MOE_VLLM_OPS`` names a prebuilt library instead.

    python -m benchmarks.peer_vllm build-ops [SOURCE]      # build (or find) the library; prints its path
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["CSRC", "ENV_OPS", "NAMESPACE", "OpsUnavailable", "build", "load", "csrc_present", "activation",
           "quantize"]

ENV_OPS = "MOE_VLLM_OPS"
NAMESPACE = "_moe_vllm_peer"
#: vLLM's translation units compiled (paths under ``csrc/``)
SOURCES = ("activation_kernels.cu", "quantization/w8a8/fp8/common.cu",
           "quantization/w8a8/fp8/per_token_group_quant.cu")
#: everything they include from ``csrc/`` (nvcc -M on vLLM 0.33.0), plus ``ops.h`` (the declarations bound below)
HEADERS = ("ops.h", "async_util.cuh", "cub_helpers.h", "cuda_vec_utils.cuh", "dispatch_utils.h", "torch_utils.h",
           "core/cuda_compat.h", "core/vec_dtypes/dtype_bfloat16.cuh", "core/vec_dtypes/dtype_float16.cuh",
           "core/vec_dtypes/dtype_float32.cuh", "core/vec_dtypes/dtype_fp8.cuh", "core/vec_dtypes/dtype_generic.cuh",
           "core/vec_dtypes/vec_dtypes.h", "quantization/utils.cuh", "quantization/vectorization.cuh",
           "quantization/vectorization_utils.cuh", "quantization/w8a8/fp8/common.cuh",
           "quantization/w8a8/fp8/nvidia/quant_utils.cuh")
#: the files ``benchmarks.peer_vllm slice`` keeps (relative to the source root)
CSRC = tuple("csrc/" + f for f in SOURCES + HEADERS) + ("csrc/torch_bindings.cpp",)

#: the ops bound (vLLM's names, torch.ops._C.<name> there)
OPS = ("silu_and_mul", "swigluoai_and_mul", "static_scaled_fp8_quant", "dynamic_scaled_fp8_quant",
       "dynamic_per_token_scaled_fp8_quant", "per_token_group_fp8_quant")
#: where vLLM registers them (read, not compiled: their schemas and C++ functions are taken from it)
REGISTRY = "csrc/torch_bindings.cpp"
_LITERALS = re.compile(r'"((?:[^"\\]|\\.)*)"')


def bindings(root: str | os.PathLike) -> str:
    """The C++ registration of ``OPS`` under ``NAMESPACE``: each op's schema (``ops.def``) and C++ function
    (``ops.impl(..., TORCH_BOX(&fn))``) as vLLM's own ``csrc/torch_bindings.cpp`` has them. Raises
    ``OpsUnavailable`` for an op the file does not define (a vLLM version that renamed it)."""
    text = (Path(root) / REGISTRY).read_text()
    defs = {}
    for m in re.finditer(r'ops\.def\(\s*((?:"(?:[^"\\]|\\.)*"\s*)+)', text):  # adjacent literals: one string
        schema = "".join(_LITERALS.findall(m.group(1)))
        defs[schema.split("(", 1)[0].strip()] = schema
    lines, impls = [], []
    for op in OPS:
        fn = re.search(r'ops\.impl\(\s*"' + op + r'"\s*,\s*TORCH_BOX\(&(\w+)\)\)', text)
        if op not in defs or fn is None:
            raise OpsUnavailable(f"{REGISTRY} of this vLLM source does not register {op!r} as this module expects "
                                 "(ops.def and ops.impl with TORCH_BOX)")
        lines.append(f"  ops.def({json.dumps(defs[op])});")
        impls.append(f'  ops.impl("{op}", TORCH_BOX(&{fn.group(1)}));')
    return ("#include \"ops.h\"\n#include <torch/csrc/stable/library.h>\n\n"
            f"STABLE_TORCH_LIBRARY({NAMESPACE}, ops) {{\n" + "\n".join(lines) + "\n}\n\n"
            f"STABLE_TORCH_LIBRARY_IMPL({NAMESPACE}, CUDA, ops) {{\n" + "\n".join(impls) + "\n}\n")


DEFINES = ("-DENABLE_FP8", "-DUSE_CUDA", "-DNDEBUG", "-DTORCH_TARGET_VERSION=0x020B000000000000ULL")
NVCC_FLAGS = ("-std=c++20", "-O2", "--expt-relaxed-constexpr", "--expt-extended-lambda", "-Xcompiler", "-fPIC")
CXX_FLAGS = ("-std=c++20", "-O2", "-fPIC")


_SYSTEM_NVCC = "/usr/local/cuda/bin/nvcc"


class OpsUnavailable(RuntimeError):
    """vLLM's compiled ops cannot be built or loaded here; the message says why and what to do."""


def csrc_present(root: Path) -> list[str]:
    """The files of ``CSRC`` missing under ``root`` (an empty list: the source can be built)."""
    return [f for f in CSRC if not (Path(root) / f).is_file()]


def _nvcc() -> str:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    cand = [str(Path(home) / "bin" / "nvcc")] if home else []
    cand += [shutil.which("nvcc") or "", _SYSTEM_NVCC]
    for c in cand:
        if c and Path(c).is_file():
            return c
    raise OpsUnavailable("no nvcc (set CUDA_HOME or put nvcc on PATH) to build vLLM's activation and quantization "
                         f"ops; or name a prebuilt library in ${ENV_OPS}")


def _arch() -> str:
    import torch

    if not torch.cuda.is_available():
        raise OpsUnavailable("vLLM's ops are CUDA kernels: no CUDA device here")
    major, minor = torch.cuda.get_device_capability()
    return f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"


def _torch_paths() -> tuple[list[str], str, str]:
    import torch
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        raise OpsUnavailable(f"torch {torch.__version__} is a CPU build: vLLM's ops link against a CUDA torch")
    return list(cpp_extension.include_paths()), str(Path(torch.__file__).parent / "lib"), torch.__version__


def _cuda_lib(nvcc: str) -> str:
    home = Path(nvcc).resolve().parent.parent
    for d in ("lib64", "lib", "targets/x86_64-linux/lib"):
        if (home / d / "libcudart.so").exists():
            return str(home / d)
    return str(home / "lib64")


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    """``cmd``'s completed process; OpsUnavailable where it cannot start (a compiler missing or not executable)."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        raise OpsUnavailable(f"cannot run {cmd[0]}: {exc} (set CXX / CUDA_HOME, or name a prebuilt library in "
                             f"${ENV_OPS})") from None


def build(root: str | os.PathLike, out_dir: str | os.PathLike | None = None, *, jobs: int | None = None,
          log=None) -> Path:
    """Compile vLLM's ``SOURCES`` under ``root/csrc`` and their registration (``bindings``) into one shared library
    for this GPU's architecture; returns its path (an existing build of the same inputs is reused).

    Raises:
        OpsUnavailable: the csrc files are missing (a slice made before they were kept: slice again), no nvcc, no
            CUDA torch or GPU, or the compile failed (the compiler's last lines in the message).
    """
    from benchmarks.peer_vllm import cache_dir, version_of

    root = Path(root)
    missing = csrc_present(root)
    if missing:
        raise OpsUnavailable(f"vLLM source {root} lacks {len(missing)} csrc files ({missing[0]}, ...): pass an sdist "
                             "or slice it again (python -m benchmarks.peer_vllm slice SDIST DEST keeps them)")
    nvcc = _nvcc()
    includes, torch_lib, torch_version = _torch_paths()
    arch = _arch()
    nvcc_version = _run([nvcc, "--version"]).stdout
    h = hashlib.sha256()
    binding = bindings(root)
    for part in (binding, " ".join(DEFINES + NVCC_FLAGS + CXX_FLAGS), arch, torch_version, nvcc_version):
        h.update(part.encode())
    for f in CSRC:
        h.update((root / f).read_bytes())
    out_dir = Path(out_dir) if out_dir is not None else cache_dir() / "vllm-ops"
    so = out_dir / f"vllm{version_of(root)}-ops-{h.hexdigest()[:16]}.so"
    if so.is_file():
        return so
    work = out_dir / f"{so.stem}.build{os.getpid()}"  # a concurrent build of the same inputs has its own
    work.mkdir(parents=True, exist_ok=True)
    (work / "bindings.cpp").write_text(binding)
    cuda_include = Path(nvcc).resolve().parent.parent / "include"
    inc = [f"-I{root / 'csrc'}"] + [f"-I{p}" for p in includes] + [f"-I{cuda_include}"]
    cxx = os.environ.get("CXX") or shutil.which("c++") or "g++"
    cmds = [[nvcc, *NVCC_FLAGS, arch, *DEFINES, *inc, "-c", str(root / "csrc" / s), "-o",
             str(work / (Path(s).stem + ".o"))] for s in SOURCES]
    cmds.append([cxx, *CXX_FLAGS, *DEFINES, *inc, "-c", str(work / "bindings.cpp"), "-o", str(work / "bindings.o")])
    if log:
        log(f"vllm_ops: compiling {len(cmds)} files of {root / 'csrc'} ({arch.split(',')[-1]}) into {so}")

    def run(cmd):
        return cmd, _run(cmd)

    with ThreadPoolExecutor(max_workers=jobs or min(len(cmds), os.cpu_count() or 1)) as pool:
        for cmd, r in pool.map(run, cmds):
            if r.returncode != 0:
                tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-15:])
                raise OpsUnavailable(f"compiling {cmd[-3] if cmd[-2] == '-o' else cmd}: exit {r.returncode}\n{tail}")
    objs = [str(work / (Path(s).stem + ".o")) for s in SOURCES] + [str(work / "bindings.o")]
    link = [cxx, "-shared", "-o", str(work / so.name), *objs, f"-L{torch_lib}", "-lc10", "-ltorch_cpu", "-ltorch_cuda",
            "-ltorch", f"-L{_cuda_lib(nvcc)}", "-lcudart"]
    r = _run(link)
    if r.returncode != 0:
        raise OpsUnavailable(f"linking vLLM's ops: exit {r.returncode}\n{r.stderr.strip()[-2000:]}")
    os.replace(work / so.name, so)
    shutil.rmtree(work, ignore_errors=True)
    return so


_LOADED: dict = {}


def load(root: str | os.PathLike | None, *, log=None):
    """The op namespace (``torch.ops._moe_vllm_peer``) with vLLM's activation and FP8 quantization ops: the library
    named by ``$MOE_VLLM_OPS``, else built from ``root`` (``build``). Raises ``OpsUnavailable``."""
    import torch

    path = os.environ.get(ENV_OPS)
    if path:
        if not Path(path).is_file():
            raise OpsUnavailable(f"${ENV_OPS}={path!r} is not a file")
        so = Path(path)
    elif root is None:
        raise OpsUnavailable(f"no vLLM source to build its ops from and no ${ENV_OPS}")
    else:
        so = build(root, log=log)
    key = str(so.resolve())
    if key not in _LOADED:
        try:
            torch.ops.load_library(key)
        except (OSError, RuntimeError) as exc:  # not a library for this torch, or the namespace registered twice
            raise OpsUnavailable(f"loading {so}: {type(exc).__name__}: {str(exc).strip()[:300]}") from None
        ns = getattr(torch.ops, NAMESPACE)
        missing = [op for op in OPS if not hasattr(ns, op)]
        if missing:
            raise OpsUnavailable(f"{so} does not register {', '.join(missing)} under torch.ops.{NAMESPACE} (not a "
                                 "library benchmarks.vllm_ops built)")
        _LOADED[key] = ns
    return _LOADED[key]


# ----------------------------------------------------------------------------------------------------------------
# vLLM's Python wrappers around the ops, as TritonExperts calls them between its GEMMs (vLLM 0.33.0)
# ----------------------------------------------------------------------------------------------------------------


def activation(ops, act, out, x, qc) -> None:
    """``apply_moe_activation(act, out, x)`` (vllm/model_executor/layers/fused_moe/activation.py) for the gated
    activations the suite's models use: SILU -> ``silu_and_mul``; SWIGLUOAI -> ``swigluoai_and_mul(out, x)`` with
    its schema's defaults (alpha 1.702, limit 7), as vLLM calls it (it reads neither from the config). ``out``:
    (T, N/2), ``x``: (T, N). NotImplementedError for another activation (or SiLU with a clamp limit)."""
    from reference.activation import MoEActivation

    if act == MoEActivation.SILU and qc.gemm1_clamp_limit is None:
        ops.silu_and_mul(out, x)
    elif act == MoEActivation.SWIGLUOAI:
        ops.swigluoai_and_mul(out, x)
    else:
        raise NotImplementedError(f"vLLM's compiled activation for {act} is not bound here (silu, swigluoai are)")


def quantize(ops, x, scale, *, per_act_token: bool, block_shape):
    """``moe_kernel_quantize_input`` -> ``_fp8_quantize`` (vllm/model_executor/layers/fused_moe/utils.py) for FP8:
    ``ops.scaled_fp8_quant`` (vllm/_custom_ops.py: dynamic per-tensor, dynamic per-token, static) or, with
    ``block_shape``, ``per_token_group_quant_fp8`` (quantization/utils/fp8_utils.py; row-major scales, eps 1e-10,
    E4M3's range, fp32 scales: vLLM's setup without DeepGEMM, whose ``is_deep_gemm_e8m0_used()`` would round the
    scales to powers of two). ``x``: (T, D) contiguous; returns ``(x_q, scale)`` allocated as vLLM allocates them."""
    import torch

    fp8 = torch.float8_e4m3fn
    if block_shape is not None:
        group = int(block_shape[1])
        x_q = torch.empty(x.shape, device=x.device, dtype=fp8)
        x_s = torch.empty(x.shape[:-1] + (x.shape[-1] // group,), device=x.device, dtype=torch.float32)
        fi = torch.finfo(fp8)
        ops.per_token_group_fp8_quant(x, x_q, x_s, group, 1e-10, fi.min, fi.max, False, False, False)
        return x_q, x_s
    out = torch.empty(x.shape, device=x.device, dtype=fp8)
    if scale is None:
        if per_act_token:
            s = torch.empty((x.shape[0], 1), device=x.device, dtype=torch.float32)
            ops.dynamic_per_token_scaled_fp8_quant(out, x, s, None)
        else:
            s = torch.empty(1, device=x.device, dtype=torch.float32)
            ops.dynamic_scaled_fp8_quant(out, x, s)
        return out, s
    ops.static_scaled_fp8_quant(out, x, scale, None)
    return out, scale
