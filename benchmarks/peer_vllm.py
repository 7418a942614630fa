"""vLLM's own Triton ``fused_moe_kernel`` as a live peer of ``python -m benchmarks --backend NAME --peer vllm``.

The kernel, its launch glue and its tuned configs are read from vLLM's source (an installed ``vllm`` located with
``importlib.util.find_spec`` without importing it, an unpacked sdist, an sdist ``.tar.gz``, or the minimal slice
``python -m benchmarks.peer_vllm slice`` writes); vLLM itself is never imported (it needs its compiled extensions):

- the ``@triton.jit`` functions (``fused_moe_kernel``, ``write_zeros_to_output`` and any other jit helper it calls)
  are written verbatim, decorators included, to a real ``.py`` file in the cache directory (named by the sha256 of
  their source) and imported from there: Triton's JIT reads a kernel's source through ``inspect``;
- the host functions (``invoke_fused_moe_triton_kernel``, 0.17's ``invoke_fused_moe_kernel``,
  ``get_config_file_name``, ``get_moe_configs``, ``get_default_config``, ``_prepare_expert_assignment``, utils.py's
  ``enable_swap_ab``) are executed from their AST with small stubs for ``envs``, ``current_platform``, the logger
  and the helpers they call; ``__file__`` is the real ``fused_moe.py``, so ``configs/`` resolves to vLLM's tuned
  tables; ``try_get_optimal_moe_config`` is mirrored (its body imports from vllm).

What is timed (``gemms_variant``) is what ``benchmarks/peers.toml``'s stored vLLM figures time: GEMM1 + GEMM2
launches only, as ``fused_experts_impl`` issues them (same config for both, same route layout); the input
quantization, the route alignment, the activation, the requantization and the top-k sum are done once per input set
outside the timed call (by the reference: ``reference.modular.moe_kernel_quantize_input``, ``reference.align``,
``reference.activation``). ``check`` runs the whole chain on set 0 against ``benchmarks.check.reference_output``
with the error model's bound, as every timed experts class is checked.

``chain_variant`` (the column ``vllm <version> chain``) times vLLM's whole GEMM stage as ``fused_experts_impl`` runs
it: GEMM1, vLLM's compiled activation (``silu_and_mul`` / ``swigluoai_and_mul``) into its workspace, vLLM's compiled
requantization of GEMM2's input (``scaled_fp8_quant``'s ops / ``per_token_group_fp8_quant``), GEMM2: the
like-for-like peer of a backend's ``gemms``, which fuses or runs these itself. The ops are compiled from vLLM's own
csrc files by ``benchmarks.vllm_ops`` (``attach_ops``; nvcc and a CUDA torch needed, else the column is absent and
the reason printed), and checked on its own before it is timed (``check(..., stage=True)``).

    python -m benchmarks.peer_vllm slice /tmp/vcache/vllm-0.33.0.tar.gz shared/vllm-0.33.0   # 1.5 MiB tree
    python -m benchmarks.peer_vllm info [SOURCE]                                            # version, files
    python -m benchmarks.peer_vllm build-ops [SOURCE]      # (GPU machine) compile vLLM's activation / quant ops
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

__all__ = ["ENV_SRC", "PeerUnavailable", "VllmTriton", "find_source", "load", "slice_tree", "version_of",
           "cache_dir", "config_dtype_str", "gemms_variant", "chain_variant", "attach_ops", "check"]

ENV_SRC = "MOE_VLLM_SRC"
REL = "vllm/model_executor/layers/fused_moe"
FILES = ("fused_moe.py", "utils.py", "config.py")
KERNEL = "fused_moe_kernel"
LAUNCHERS = ("invoke_fused_moe_triton_kernel", "invoke_fused_moe_kernel")  # 0.33, 0.17
HOST = ("get_config_file_name", "get_moe_configs", "get_default_config")
OPTIONAL_HOST = ("_prepare_expert_assignment",)


class PeerUnavailable(RuntimeError):
    """No usable vLLM source; the message says what to do."""


def howto(version: str = "0.33.0") -> str:
    return (f"get vLLM's source: `python tests/parity/fetch_sdist.py {version} DIR` then pass `--vllm-src "
            f"DIR/vllm-{version}` (or DIR/vllm-{version}.tar.gz, or set ${ENV_SRC}); or `pip install vllm` (located, "
            "never imported). For an offline GPU machine: `python -m benchmarks.peer_vllm slice SDIST_OR_TREE "
            f"shared/vllm-{version}` here (about 1.5 MiB), then `--vllm-src shared/vllm-{version}` there")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moe-conformance"


# ----------------------------------------------------------------------------------------------------------------
# Locating the source
# ----------------------------------------------------------------------------------------------------------------


def _is_root(p: Path) -> bool:
    return (p / REL / "fused_moe.py").is_file()


def find_source(path: str | os.PathLike | None = None) -> Path:
    """The root of a vLLM source tree (``root/vllm/model_executor/layers/fused_moe/fused_moe.py`` exists).

    ``path`` (else ``$MOE_VLLM_SRC``): an unpacked sdist root, an sdist ``.tar.gz`` (the fused_moe files, configs
    and PKG-INFO are extracted into ``cache_dir()/vllm-<version>``), a ``vllm`` package directory, or a slice.
    Neither given: an installed ``vllm`` (``importlib.util.find_spec``; not imported).

    Raises:
        PeerUnavailable: nothing usable; the message says what to do.
    """
    given = path if path is not None else os.environ.get(ENV_SRC) or None
    if given is not None:
        p = Path(given).expanduser()
        if not p.exists():
            raise PeerUnavailable(f"vLLM source {str(p)!r} does not exist: {howto()}")
        if p.is_file():
            if p.name.endswith((".tar.gz", ".tgz")):
                return _extract(p)
            raise PeerUnavailable(f"vLLM source {str(p)!r} is a file but not an sdist .tar.gz: {howto()}")
        if _is_root(p):
            return p
        if p.name == "vllm" and _is_root(p.parent):
            return p.parent
        raise PeerUnavailable(f"vLLM source {str(p)!r} has no {REL}/fused_moe.py (not an unpacked sdist, a slice or "
                              f"a vllm package directory): {howto()}")
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    locs = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locs:
        if _is_root(Path(loc).parent):
            return Path(loc).parent
    raise PeerUnavailable(f"no vLLM source: no --vllm-src, no ${ENV_SRC}, no installed vllm; {howto()}")


def version_of(root: Path) -> str:
    """``Version:`` of the tree's PKG-INFO, else the installed distribution's, else the directory name."""
    pkg = root / "PKG-INFO"
    if pkg.is_file():
        for line in pkg.read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    for meta in sorted(root.glob("vllm-*.dist-info/METADATA")):
        for line in meta.read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return root.name.removeprefix("vllm-") or "unknown"


def _wanted(rel: str) -> bool:
    """Is ``rel`` (a path inside the sdist's top directory) part of the slice?"""
    if rel == "PKG-INFO":
        return True
    if rel in _csrc():  # vLLM's activation / quantization kernels (benchmarks.vllm_ops builds them)
        return True
    d, _, name = rel.rpartition("/")
    if d == REL:
        return name in FILES
    return d == REL + "/configs" and name.endswith(".json")


def _csrc() -> tuple[str, ...]:
    from benchmarks.vllm_ops import CSRC

    return CSRC


def _extract(sdist: Path) -> Path:
    m = re.match(r"vllm-(.+?)\.(tar\.gz|tgz)$", sdist.name)
    dest = cache_dir() / (f"vllm-{m.group(1)}" if m else sdist.name.split(".tar")[0])
    if _is_root(dest) and (dest / "PKG-INFO").is_file() and (dest / "csrc").is_dir():  # (extracted before the
        return dest                                                                     # csrc files were kept: again)
    tmp = dest.with_name(dest.name + f".part{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    n = 0
    try:
        with tarfile.open(sdist) as tf:
            for mem in tf:
                top, _, rel = mem.name.partition("/")
                if not mem.isfile() or ".." in mem.name or not _wanted(rel):
                    continue
                target = tmp / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                with tf.extractfile(mem) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
                n += 1
    except (tarfile.TarError, OSError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise PeerUnavailable(f"cannot read the sdist {sdist}: {type(exc).__name__}: {exc}; {howto()}") from None
    if not _is_root(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
        raise PeerUnavailable(f"{sdist} has no {REL}/fused_moe.py: {howto()}")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def slice_tree(source: str | os.PathLike, dest: str | os.PathLike) -> tuple[Path, int]:
    """Write the minimal tree (PKG-INFO, fused_moe.py, utils.py, config.py, configs/*.json and, where the source
    has them, the csrc files ``benchmarks.vllm_ops`` builds) of ``source`` to ``dest``; returns (dest, bytes
    written)."""
    root = find_source(source)
    dest = Path(dest)
    total = 0
    files = ([root / "PKG-INFO"] + [root / REL / f for f in FILES] + sorted((root / REL / "configs").glob("*.json"))
             + [root / f for f in _csrc()])
    for f in files:
        if not f.is_file():
            continue
        target = dest / f.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, target)
        total += f.stat().st_size
    if not (dest / "PKG-INFO").is_file():  # an installed package: record the version it had
        (dest / "PKG-INFO").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version_of(root)}\n")
    return dest, total


# ----------------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------------


def _top_defs(nodes, out=None) -> dict:
    """Top-level function definitions by name (also under module-level ``if`` blocks; the first one wins)."""
    out = {} if out is None else out
    for node in nodes:
        if isinstance(node, ast.FunctionDef):
            out.setdefault(node.name, node)
        elif isinstance(node, ast.If):
            _top_defs(node.body + node.orelse, out)
    return out


def _is_jit(node: ast.FunctionDef) -> bool:
    for d in node.decorator_list:
        f = d.func if isinstance(d, ast.Call) else d
        if isinstance(f, ast.Attribute) and f.attr in ("jit", "autotune", "heuristics"):
            return True
        if isinstance(f, ast.Name) and f.id == "jit":
            return True
    return False


def _segment(lines: list[str], node: ast.FunctionDef) -> str:
    """The definition's source with its decorator lines."""
    start = min([d.lineno for d in node.decorator_list] + [node.lineno])
    return "".join(lines[start - 1 : node.end_lineno])


def _jit_closure(defs: dict, name: str) -> list[str]:
    """``name`` and every other jit function of the file it calls, transitively, in file order."""
    jit = {n: d for n, d in defs.items() if _is_jit(d)}
    seen, todo = set(), [name]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for sub in ast.walk(jit[n]):
            if isinstance(sub, ast.Name) and sub.id in jit and sub.id not in seen:
                todo.append(sub.id)
    return sorted(seen, key=lambda n: jit[n].lineno)


class _Logger:
    def __getattr__(self, name):
        return lambda *a, **k: None


@dataclass
class VllmTriton:
    """vLLM's Triton fused-MoE kernel and host functions, loaded from ``root``."""

    root: Path
    version: str
    fused_moe_path: Path
    kernel_path: Path
    kernel_module: object
    launcher_name: str
    ns: dict = field(repr=False)
    device_name: str | None = None  # overrides the CUDA device name (tests, no GPU)
    ops: object = None  # vLLM's compiled activation / quantization ops (attach_ops); None: GEMM launches only
    ops_error: str | None = None  # why ``ops`` is None after attach_ops

    @property
    def title(self) -> str:
        return f"vllm {self.version}"

    @property
    def chain_title(self) -> str:
        """The column of its whole GEMM stage (``chain_variant``)."""
        return f"{self.title} chain"

    @property
    def kernel(self):
        return self.kernel_module.fused_moe_kernel

    def launcher(self):
        return self.ns[self.launcher_name]

    def _unknown(self, exc: NameError) -> PeerUnavailable:
        return PeerUnavailable(f"vLLM {self.version}'s {self.fused_moe_path} uses {exc.name!r}, which "
                               f"benchmarks/peer_vllm.py does not provide (a version it does not know): {exc}")

    def config(self, w1_shape, w2_shape, topk: int, dtype_str: str | None, M: int, block_shape=None,
               *, device_name: str | None = None) -> tuple[dict, str]:
        """``try_get_optimal_moe_config`` mirrored: ``(config, source)``, source the tuned JSON file's name (the
        nearest M key of it) or ``"default"`` (``get_default_config``)."""
        try:
            return self._config(w1_shape, w2_shape, topk, dtype_str, M, block_shape, device_name)
        except NameError as exc:
            raise self._unknown(exc) from exc

    def _config(self, w1_shape, w2_shape, topk, dtype_str, M, block_shape, device_name):
        saved = self.device_name
        if device_name is not None:
            self.device_name = device_name
        try:
            ns = self.ns
            E, _, N = w2_shape
            if dtype_str == "int4_w4a16":
                N = N * 2
            block_n = block_shape[0] if block_shape else 0
            block_k = block_shape[1] if block_shape else 0
            configs = ns["get_moe_configs"](E, N, dtype_str, block_n, block_k)
            if configs:
                key = min(configs.keys(), key=lambda x: abs(x - M))
                bs = [block_n, block_k] if block_n and block_k else None
                return dict(configs[key]), f"{ns['get_config_file_name'](E, N, dtype_str, bs)}[{key}]"
            return dict(ns["get_default_config"](M, E, N, w1_shape[2], topk, dtype_str, block_shape)), "default"
        finally:
            self.device_name = saved

    def prepare_expert_assignment(self, topk_ids, config: dict, num_experts: int):
        """``(sorted_token_ids or None, expert_ids, num_tokens_post_padded)`` as ``fused_experts_impl`` gets them
        (no expert map): vLLM's ``_prepare_expert_assignment`` where the version has it, else its inline form of
        0.17 (naive per-route blocks when ``M * topk * 4 <= E``, else ``moe_align_block_size``); the alignment
        itself is the reference's, which mirrors vLLM's CUDA op."""
        M, topk = topk_ids.shape
        fn = self.ns.get("_prepare_expert_assignment")
        if fn is not None:
            kw = {k: v for k, v in dict(ignore_invalid_experts=True, weights_host_resident=False).items()
                  if k in inspect.signature(fn).parameters}
            return fn(topk_ids, config, M, topk, num_experts, None, **kw)
        if M * topk * 4 <= num_experts:  # 0.17's inline form of the same decision (SPARSITY_FACTOR = 4)
            import torch

            return (None, topk_ids.view(-1), torch.full((1,), topk_ids.numel() * config["BLOCK_SIZE_M"],
                                                         dtype=torch.int32, device=topk_ids.device))
        return self.ns["moe_align_block_size"](topk_ids, config["BLOCK_SIZE_M"], num_experts, None)

    def launch(self, **kw) -> None:
        """One ``invoke_fused_moe_[triton_]kernel`` call by keyword; the parameters this version does not take
        (``B_zp`` before 0.33, ``B_bias`` in old ones) are dropped if None, else an error names them."""
        fn = self.launcher()
        params = self.ns.get("__launcher_params__")
        if params is None:
            params = self.ns["__launcher_params__"] = inspect.signature(fn).parameters
        extra = [k for k in kw if k not in params and kw[k] is not None]
        if extra:
            raise NotImplementedError(f"{self.launcher_name} of vLLM {self.version} takes no {', '.join(extra)}")
        missing = [k for k, p in params.items() if k not in kw and p.default is inspect.Parameter.empty]
        if missing:
            raise PeerUnavailable(f"{self.launcher_name} of vLLM {self.version} ({self.fused_moe_path}) needs "
                                  f"{', '.join(missing)}, which this loader does not know")
        try:
            fn(**{k: v for k, v in kw.items() if k in params})
        except NameError as exc:
            raise self._unknown(exc) from exc


def _stubs(obj_ref: list, fused_moe_path: Path) -> dict:
    import torch

    def device_name(device_id: int = 0) -> str:
        me = obj_ref[0]
        if me is not None and me.device_name is not None:
            name = me.device_name
        else:
            name = torch.cuda.get_device_name(device_id) if torch.cuda.is_available() else "cpu"
        return re.sub(r"[\s/]+", "_", name)

    def is_device_capability(cap, device_id: int = 0) -> bool:
        if not torch.cuda.is_available():
            return False
        major, minor = torch.cuda.get_device_capability(device_id)
        if isinstance(cap, tuple):
            return (major, minor) == tuple(cap)
        return major * 10 + minor == int(cap)

    def has_device_capability(cap, device_id: int = 0) -> bool:
        if not torch.cuda.is_available():
            return False
        major, minor = torch.cuda.get_device_capability(device_id)
        want = cap[0] * 10 + cap[1] if isinstance(cap, tuple) else int(cap)
        return major * 10 + minor >= want

    platform = SimpleNamespace(
        is_cuda=lambda: True, is_cuda_alike=lambda: True, is_rocm=lambda: False, is_xpu=lambda: False,
        is_cpu=lambda: False, is_device_capability=is_device_capability,
        has_device_capability=has_device_capability, fp8_dtype=lambda: torch.float8_e4m3fn,
        get_device_name=lambda device_id=0: device_name(device_id))
    envs = SimpleNamespace(VLLM_BATCH_INVARIANT=False, VLLM_TUNED_CONFIG_FOLDER=None, VLLM_TRITON_USE_TD=False,
                           VLLM_FUSED_MOE_CHUNK_SIZE=16 * 1024)

    def next_power_of_2(n: int) -> int:
        return 1 << (int(n) - 1).bit_length() if n > 0 else 1

    def moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None, pad_sorted_ids=False,
                             ignore_invalid_experts=False):
        from reference.align import moe_align_block_size as ref

        return ref(topk_ids, block_size, num_experts, expert_map, pad_sorted_ids, ignore_invalid_experts)

    import functools
    import typing

    return {
        "torch": torch, "os": os, "json": json, "functools": functools, "Any": typing.Any,
        "Callable": typing.Callable, "Optional": typing.Optional, "envs": envs, "current_platform": platform,
        "logger": _Logger(), "warn_if_moe_use_td_ineffective": lambda *a, **k: None,
        "resolve_moe_use_td": lambda *a, **k: False, "set_triton_allocator": lambda *a, **k: None,
        "get_device_name_as_file_name": device_name, "next_power_of_2": next_power_of_2,
        "should_moe_wna16_use_cuda": lambda *a, **k: False, "moe_align_block_size": moe_align_block_size,
        "vllm_is_batch_invariant": lambda: False,  # 0.17
        "__file__": str(fused_moe_path), "__name__": "moe_conformance_vllm_host",
    }


def _exec(defs: dict, names, ns: dict, path: Path) -> None:
    for n in names:
        node = defs[n]
        node.decorator_list = []  # @functools.lru_cache etc.: the definitions come from a fresh parse
        mod = ast.Module(body=[node], type_ignores=[])
        exec(compile(mod, f"{path}::{n}", "exec"), ns)  # noqa: S102 - vLLM's own source, read from its files


def load(source: str | os.PathLike | None = None) -> VllmTriton:
    """Load the kernel and host functions from ``source`` (anything ``find_source`` takes; None: its defaults).

    Raises:
        PeerUnavailable: no source, or a function this loader needs is missing from it (the file and version named).
    """
    root = find_source(source)
    version = version_of(root)
    path = root / REL / "fused_moe.py"
    text = path.read_text()
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        raise PeerUnavailable(f"cannot parse {path} (vLLM {version}): {exc}") from None
    defs = _top_defs(tree.body)
    launcher = next((n for n in LAUNCHERS if n in defs), None)
    missing = [n for n in (KERNEL, *HOST) if n not in defs] + ([] if launcher else [" or ".join(LAUNCHERS)])
    if missing:
        raise PeerUnavailable(f"{path} of vLLM {version} has no {', '.join(missing)}: this loader knows vLLM's "
                              "fused_moe.py of 0.17 to 0.33")
    if not _is_jit(defs[KERNEL]):
        raise PeerUnavailable(f"{KERNEL} in {path} of vLLM {version} is not a @triton.jit function")
    lines = text.splitlines(keepends=True)
    jit_names = _jit_closure(defs, KERNEL)
    body = "import triton\nimport triton.language as tl\n\n\n" + "\n\n".join(_segment(lines, defs[n])
                                                                          for n in jit_names)
    body = (f"# vLLM {version}: {', '.join(jit_names)} of {REL}/fused_moe.py (verbatim), written by "
            f"benchmarks/peer_vllm.py\n") + body
    digest = hashlib.sha256(body.encode()).hexdigest()[:16]
    kdir = cache_dir() / "kernels"
    kdir.mkdir(parents=True, exist_ok=True)
    kpath = kdir / f"vllm_fused_moe_{digest}.py"
    if not kpath.is_file() or kpath.read_text() != body:
        tmp = kpath.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(body)
        tmp.replace(kpath)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        # Triton 3.6's interpreter cannot index with a runtime scalar under numpy 2 (``range(0, tl.cdiv(K, ...))``
        # in vLLM's kernel): the backends' shared interpreter patch applies
        from backends import patch_triton_interpreter

        patch_triton_interpreter()
    modname = f"moe_conformance_vllm_kernel_{digest}"
    kmod = sys.modules.get(modname)
    if kmod is None:
        spec = importlib.util.spec_from_file_location(modname, kpath)
        kmod = importlib.util.module_from_spec(spec)
        sys.modules[modname] = kmod
        try:
            spec.loader.exec_module(kmod)
        except Exception:
            del sys.modules[modname]
            raise
    ref: list = [None]
    ns = _stubs(ref, path)
    import triton
    import triton.language as tl

    ns.update(triton=triton, tl=tl, **{n: getattr(kmod, n) for n in jit_names})
    utils = root / REL / "utils.py"
    udefs = _top_defs(ast.parse(utils.read_text()).body) if utils.is_file() else {}
    if "enable_swap_ab" in udefs:
        _exec(udefs, ["enable_swap_ab"], ns, utils)
    else:
        ns["enable_swap_ab"] = lambda *a, **k: False  # before swap-AB existed
    _exec(defs, [*HOST, launcher, *(n for n in OPTIONAL_HOST if n in defs)], ns, path)
    obj = VllmTriton(root=root, version=version, fused_moe_path=path, kernel_path=kpath, kernel_module=kmod,
                     launcher_name=launcher, ns=ns)
    ref[0] = obj
    return obj


# ----------------------------------------------------------------------------------------------------------------
# The benchmark variant
# ----------------------------------------------------------------------------------------------------------------


def config_dtype_str(qc, act_dtype) -> str | None:
    """vLLM's ``_get_config_dtype_str`` as ``fused_experts_impl`` calls it (fp8_w8a8 / int8_w8a16 / int4_w4a16 only;
    int8 W8A8 gets the unquantized tables)."""
    import torch

    if qc.use_fp8_w8a8:
        return "fp8_w8a8"
    if qc.use_int8_w8a16:
        return "int8_w8a16"
    if qc.use_int4_w4a16:
        return "int4_w4a16"
    return "float32" if act_dtype == torch.float32 else None


def _plan(shape, qc) -> dict:
    """The launch flags for the shape's scheme; NotImplementedError (with the reason) outside what this runs."""
    import torch

    scheme = qc.scheme_name()
    if qc.w1.dtype is None and qc.a1.dtype is None:
        flags = dict(use_fp8_w8a8=False, use_int8_w8a8=False, per_channel_quant=False, block_shape=None)
    elif qc.use_fp8_w8a8 and not qc.use_ue8m0 and qc.recipe == "vllm" and qc.a1_scale is None and (
            (qc.block_shape is not None and qc.a1.shape == (1, qc.block_shape[1]))
            or (qc.block_shape is None and qc.w1.shape in ((-1, -1), None) and qc.a1.shape in ((-1, -1), None))
            or (qc.block_shape is None and qc.w1.shape == (1, -1) and qc.a1.shape == (1, -1))):
        flags = dict(use_fp8_w8a8=True, use_int8_w8a8=False, per_channel_quant=qc.a1.shape == (1, -1),
                     block_shape=qc.block_shape)
    elif qc.use_int8_w8a8 and qc.block_shape is None and qc.w1.shape == (1, -1) and qc.a1.shape == (1, -1):
        flags = dict(use_fp8_w8a8=False, use_int8_w8a8=True, per_channel_quant=True, block_shape=None)
    else:
        raise NotImplementedError(f"scheme {shape.scheme} ({scheme}) is not run through vLLM's fused_moe_kernel here "
                                  "(bf16/fp16/fp32, fp8_block128, fp8_tensor, fp8_channel_token, "
                                  "int8_channel_token are)")
    if shape.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise NotImplementedError(f"activation dtype {shape.dtype}")
    return flags


def attach_ops(vt: VllmTriton, log=None) -> VllmTriton:
    """Give ``vt`` vLLM's compiled activation and FP8 quantization ops (``benchmarks.vllm_ops``: built from its
    csrc, or ``$MOE_VLLM_OPS``), so that ``chain_variant`` times vLLM's whole GEMM stage; where they cannot be built
    or loaded, ``vt.ops`` stays None and ``vt.ops_error`` says why (the GEMM-launch column is unaffected)."""
    from benchmarks import vllm_ops

    try:
        vt.ops = vllm_ops.load(vt.root, log=log)
        vt.ops_error = None
    except vllm_ops.OpsUnavailable as exc:
        vt.ops, vt.ops_error = None, str(exc)
    return vt


@dataclass
class _Prepared:
    name: str
    config: dict
    config_source: str
    call: object  # call(i): GEMM1 + GEMM2 launches on set i
    outputs: list  # per set: (cache3 (M, topk, K), topk_weights)
    chain: object  # chain(i, compiled=False) -> (M, K): GEMM1, activation, requant, GEMM2, top-k sum (compiled:
    #                with vLLM's ops, the stage; else the reference's activation and requantization)
    stage: object = None  # stage(i): GEMM1, vLLM's compiled activation and requantization, GEMM2 (vt.ops)
    stage_error: str | None = None  # why ``stage`` is None


def _prepare(vt: VllmTriton, shape, M: int, inp, device) -> _Prepared:
    import torch
    import triton.language as tl

    from reference.activation import apply_moe_activation
    from reference.modular import moe_kernel_quantize_input

    copies, sets = inp.weights.copies, inp.sets
    nw = len(copies)
    qc0 = copies[0][2]
    flags = _plan(shape, qc0)
    E, topk, K = shape.E, shape.topk, shape.K
    w1_0, w2_0, _ = copies[0]
    N = w1_0.size(1)
    dtype_str = config_dtype_str(qc0, shape.dtype)
    cfg, cfg_src = vt.config(tuple(w1_0.shape), tuple(w2_0.shape), topk, dtype_str, M, flags["block_shape"])
    compute_type = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[shape.dtype]
    layouts, a1s, caches = [], [], []
    for i, (h, tw, ids) in enumerate(sets):
        qc = copies[i % nw][2]
        a1s.append(moe_kernel_quantize_input(h.contiguous(), qc.a1_scale, qc, "a1"))
        layouts.append(vt.prepare_expert_assignment(ids, cfg, E))
        c13 = torch.empty(M * topk * max(N, K), device=device, dtype=shape.dtype)
        caches.append((c13[: M * topk * N].view(M, topk, N), c13[: M * topk * K].view(M, topk, K)))

    def base(i):
        w1, w2, qc = copies[i % nw]
        sorted_ids, expert_ids, ntpp = layouts[i]
        return dict(topk_weights=sets[i][1], sorted_token_ids=sorted_ids, expert_ids=expert_ids,
                    num_tokens_post_padded=ntpp, config=cfg, compute_type=compute_type,
                    use_fp8_w8a8=flags["use_fp8_w8a8"], use_int8_w8a8=flags["use_int8_w8a8"], use_int8_w8a16=False,
                    use_int4_w4a16=False, per_channel_quant=flags["per_channel_quant"],
                    block_shape=flags["block_shape"], B_zp=None)

    def gemm1(i):
        w1, _, qc = copies[i % nw]
        a, s = a1s[i]
        vt.launch(A=a, B=w1, C=caches[i][0], A_scale=s, B_scale=qc.w1_scale, mul_routed_weight=False, top_k=topk,
                  B_bias=qc.w1_bias, **base(i))

    def activation_requant(i):
        qc = copies[i % nw][2]
        act = apply_moe_activation(shape.activation, caches[i][0].reshape(-1, N), alpha=qc.gemm1_alpha,
                                   beta=qc.gemm1_beta, limit=qc.gemm1_clamp_limit)
        return moe_kernel_quantize_input(act.contiguous(), qc.a2_scale, qc, "a2")

    a2s: list = [None] * len(sets)

    def gemm2(i, a2=None):
        _, w2, qc = copies[i % nw]
        a, s = a2s[i] if a2 is None else a2
        vt.launch(A=a, B=w2, C=caches[i][1], A_scale=s, B_scale=qc.w2_scale, mul_routed_weight=True, top_k=1,
                  B_bias=qc.w2_bias, **base(i))

    for i in range(len(sets)):  # GEMM2's input: GEMM1 once, the activation and the requantization
        gemm1(i)
        a2s[i] = activation_requant(i)

    def call(i):
        gemm1(i)
        gemm2(i)

    stage, stage_error = None, vt.ops_error or "vLLM's compiled ops not attached (peer_vllm.attach_ops)"
    if vt.ops is not None:
        stage_error = _stage_unsupported(shape, qc0, flags)
    if vt.ops is not None and stage_error is None:
        from benchmarks import vllm_ops

        # TritonExperts' workspace: intermediate_cache2 (M * topk, N / 2), reused across calls
        c2s = [torch.empty(M * topk, N // 2, device=device, dtype=shape.dtype) for _ in sets]

        def chain_stage(i):  # vLLM's fused_experts_impl from GEMM1 to GEMM2 (fused_moe.py), its own ops between them
            qc = copies[i % nw][2]
            gemm1(i)
            vllm_ops.activation(vt.ops, shape.activation, c2s[i], caches[i][0].view(-1, N), qc)
            a2 = (vllm_ops.quantize(vt.ops, c2s[i], qc.a2_scale, per_act_token=flags["per_channel_quant"],
                                    block_shape=flags["block_shape"]) if flags["use_fp8_w8a8"] else (c2s[i], None))
            gemm2(i, a2)

        stage = chain_stage

    def chain(i, compiled: bool = False):
        if compiled:  # the stage chain_variant times
            stage(i)
        else:
            gemm1(i)
            a2s[i] = activation_requant(i)
            gemm2(i)
        return caches[i][1].float().sum(dim=1).to(shape.dtype)

    return _Prepared(vt.title, cfg, cfg_src, call, caches, chain, stage, None if stage is not None else stage_error)


def _stage_unsupported(shape, qc, flags) -> str | None:
    """Why vLLM's whole GEMM stage is not run with its compiled ops for this shape (None: it is)."""
    from reference.activation import MoEActivation

    if shape.activation not in (MoEActivation.SILU, MoEActivation.SWIGLUOAI) or (
            shape.activation == MoEActivation.SILU and qc.gemm1_clamp_limit is not None):
        return f"activation {shape.activation.value}: vLLM's compiled op for it is not bound (benchmarks.vllm_ops)"
    if flags["use_int8_w8a8"]:
        return "int8 W8A8: vLLM's int8 requantization ops are not bound (benchmarks.vllm_ops)"
    return None


_CACHE: dict = {}


def _prepared(vt, shape, M, inp, device) -> _Prepared:
    key = (id(vt), id(vt.ops), shape.id, M, id(inp))
    if key not in _CACHE:
        _CACHE.clear()  # one (shape, M) at a time
        _CACHE[key] = _prepare(vt, shape, M, inp, device)
    return _CACHE[key]


def gemms_variant(vt: VllmTriton, shape, M: int, inp, device):
    """``(column name, call(i), config source)``: vLLM's GEMM1 then GEMM2 launches on input set ``i`` (weights
    copy ``i % copies``), everything else precomputed. NotImplementedError for a scheme it does not run."""
    p = _prepared(vt, shape, M, inp, device)
    return p.name, p.call, p.config_source


def chain_variant(vt: VllmTriton, shape, M: int, inp, device):
    """``(column name, stage(i))``: vLLM's whole GEMM stage on input set ``i`` as ``fused_experts_impl`` runs it
    (GEMM1, its compiled activation into the workspace, its compiled requantization of GEMM2's input, GEMM2; no
    top-k sum), the like-for-like peer of a backend's ``gemms`` (which fuses or runs these itself). Needs
    ``attach_ops``; NotImplementedError (with the reason) where the ops are absent or do not cover the shape."""
    p = _prepared(vt, shape, M, inp, device)
    if p.stage is None:
        raise NotImplementedError(p.stage_error)
    return vt.chain_title, p.stage


def check(vt: VllmTriton, shape, M: int, inp, device=None, *, stage: bool = False):
    """vLLM's whole chain on set 0 (GEMM1, activation, requantization, GEMM2 weighted by the router, top-k sum in
    fp32, rounded) against the reference, with the error model's bound (vLLM's ``MUL_ROUTED_WEIGHT`` rounds ``w * y``:
    the ``before_store`` router-weight rounding); a ``benchmarks.check.Check``.

    ``stage`` False: the activation and requantization by the reference (what the GEMM-launch column's precomputed
    GEMM2 input is). ``stage`` True: by vLLM's compiled ops, the stage ``chain_variant`` times (NotImplementedError
    where there is none); vLLM's compiled ``silu_and_mul`` rounds ``silu(g)`` to the act dtype before the multiply
    (csrc/activation_kernels.cu: ``silu_kernel`` returns ``scalar_t``), the ``torch_native_activation`` numerics
    profile's ``R(R(silu(g)) * u)``, not the default profile's single rounding, so a SiLU stage is judged against
    that profile's reference (``reference.profiles``). FP8 per-tensor / per-channel GEMMs accumulate in place in the
    wgmma accumulator (``acc=accumulator``, "to enable fp8_fast_accum"), so they are held to the error model's opt-in
    fast-accumulation bound (``Accumulation.fast``), not the default."""
    from benchmarks.check import experts_bound, reference_output, verdict
    from reference.activation import MoEActivation
    from reference.error_model import Accumulation

    device = device if device is not None else inp.sets[0][0].device
    p = _prepared(vt, shape, M, inp, device)
    if stage and p.stage is None:
        raise NotImplementedError(p.stage_error)
    out = p.chain(0, compiled=stage)
    w1, w2, qc = inp.weights.copies[0]
    h, tw, ids = inp.sets[0]
    profile = "torch_native_activation" if stage and shape.activation == MoEActivation.SILU else None
    ref, heavy = reference_output(h, w1, w2, tw, ids, qc, heavy=True, activation=shape.activation,
                                  global_num_experts=shape.E, profile=profile)
    cls = SimpleNamespace(support=SimpleNamespace(router_weight_rounding="before_store"))
    flags = _plan(shape, qc)
    fast = Accumulation.fast(14) if flags["use_fp8_w8a8"] and flags["block_shape"] is None else None
    return verdict(out, ref.to(out.device), experts_bound(shape, qc, M, cls, accumulation=fast, heavy=heavy))


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m benchmarks.peer_vllm", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("slice", help="write the minimal tree (PKG-INFO, fused_moe files, configs/) to DEST")
    s.add_argument("source", help="an sdist .tar.gz, an unpacked sdist, a vllm package directory or a slice")
    s.add_argument("dest")
    i = sub.add_parser("info", help="where the source is, its version, the kernel file written")
    i.add_argument("source", nargs="?", default=None)
    b = sub.add_parser("build-ops", help="compile vLLM's activation and FP8 quantization ops from the source's csrc "
                                         "(benchmarks.vllm_ops; needs nvcc, a CUDA torch and a GPU); prints the path")
    b.add_argument("source", nargs="?", default=None)
    args = ap.parse_args(argv)
    if args.cmd == "build-ops":
        from benchmarks import vllm_ops

        try:
            print(vllm_ops.build(find_source(args.source), log=print))
            return 0
        except (PeerUnavailable, vllm_ops.OpsUnavailable) as exc:
            print(f"benchmarks.peer_vllm: {exc}", file=sys.stderr)
            return 2
    try:
        if args.cmd == "slice":
            dest, _ = slice_tree(args.source, args.dest)
            n = sum(1 for f in dest.rglob("*") if f.is_file())
            print(f"{dest}: vLLM {version_of(dest)}, {n} files, {_size(dest) / 2**20:.2f} MiB "
                  f"(use --vllm-src {dest})")
            return 0
        vt = load(args.source)
        print(f"vLLM {vt.version} at {vt.root}\n  {vt.fused_moe_path}\n  launcher {vt.launcher_name}\n"
              f"  kernel file {vt.kernel_path}\n  configs: {len(list((vt.root / REL / 'configs').glob('*.json')))}")
        return 0
    except PeerUnavailable as exc:
        print(f"benchmarks.peer_vllm: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
