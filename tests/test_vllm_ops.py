"""``benchmarks.vllm_ops`` (vLLM's compiled activation / FP8 quantization ops for the live peer's whole chain) without
a GPU: the registration read from vLLM's ``csrc/torch_bindings.cpp``, the slice keeping the csrc files, the build's
refusals (each says what is missing), and the Python wrappers calling the ops as vLLM's own wrappers do
(``vllm/_custom_ops.py``'s ``scaled_fp8_quant``, ``fp8_utils.per_token_group_quant_fp8``, ``apply_moe_activation``).
The compile and the ops' numerics run on the GPU machine (``python -m benchmarks.peer_vllm build-ops`` and the bench's
check of the chain against the reference, ``tests/test_triton_gpu.py``)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import peer_vllm, vllm_ops
from reference.activation import MoEActivation

REAL_SRC = os.environ.get(peer_vllm.ENV_SRC)

REGISTRY = '''
STABLE_TORCH_LIBRARY_FRAGMENT(_C, ops) {
  ops.def(
      "per_token_group_fp8_quant(Tensor input, Tensor! output_q, Tensor! "
      "output_s, int group_size) -> ()");
  ops.def("silu_and_mul(Tensor! result, Tensor input) -> ()");
  ops.def("swigluoai_and_mul(Tensor! out, Tensor input, float alpha=1.702) -> ()");
  ops.def("static_scaled_fp8_quant(Tensor! result, Tensor input, Tensor scale) -> ()");
  ops.def("dynamic_scaled_fp8_quant(Tensor! result, Tensor input, Tensor! scale) -> ()");
  ops.def("dynamic_per_token_scaled_fp8_quant(Tensor! result, Tensor input, Tensor! scale, Tensor? scale_ub) -> ()");
  ops.def("gelu_and_mul(Tensor! out, Tensor input) -> ()");
}
STABLE_TORCH_LIBRARY_IMPL(_C, CUDA, ops) {
  ops.impl("per_token_group_fp8_quant", TORCH_BOX(&per_token_group_quant_fp8));
  ops.impl("silu_and_mul", TORCH_BOX(&silu_and_mul));
  ops.impl("swigluoai_and_mul", TORCH_BOX(&swigluoai_and_mul));
  ops.impl("static_scaled_fp8_quant", TORCH_BOX(&static_scaled_fp8_quant));
  ops.impl("dynamic_scaled_fp8_quant", TORCH_BOX(&dynamic_scaled_fp8_quant));
  ops.impl("dynamic_per_token_scaled_fp8_quant",
           TORCH_BOX(&dynamic_per_token_scaled_fp8_quant));
}
'''


def bare_tree(base: Path) -> Path:
    """A vLLM source root with the Python files the peer loads but no csrc (what slices held before)."""
    (base / peer_vllm.REL).mkdir(parents=True)
    (base / peer_vllm.REL / "fused_moe.py").write_text("# fused_moe.py\n")
    (base / "PKG-INFO").write_text("Metadata-Version: 2.4\nName: vllm\nVersion: 9.9.9\n")
    return base


def csrc_tree(base: Path, registry: str = REGISTRY) -> Path:
    """A source root holding every file of ``vllm_ops.CSRC`` (placeholder text) and one csrc file not needed."""
    for f in vllm_ops.CSRC:
        (base / f).parent.mkdir(parents=True, exist_ok=True)
        (base / f).write_text(f"// {f}\n")
    (base / vllm_ops.REGISTRY).write_text(registry)
    (base / "csrc" / "attention" / "paged.cu").parent.mkdir(parents=True, exist_ok=True)
    (base / "csrc" / "attention" / "paged.cu").write_text("// not needed\n")
    return base


def test_bindings_read_vllms_schemas_and_functions(tmp_path):
    text = vllm_ops.bindings(csrc_tree(tmp_path))
    assert f"STABLE_TORCH_LIBRARY({vllm_ops.NAMESPACE}, ops)" in text
    assert f"STABLE_TORCH_LIBRARY_IMPL({vllm_ops.NAMESPACE}, CUDA, ops)" in text
    # adjacent string literals are one schema, as the C++ compiler joins them
    assert ('ops.def("per_token_group_fp8_quant(Tensor input, Tensor! output_q, Tensor! output_s, int group_size) '
            '-> ()");') in text
    assert 'ops.impl("dynamic_per_token_scaled_fp8_quant", TORCH_BOX(&dynamic_per_token_scaled_fp8_quant));' in text
    assert 'ops.impl("per_token_group_fp8_quant", TORCH_BOX(&per_token_group_quant_fp8));' in text
    assert "gelu_and_mul" not in text  # only the ops the chain calls
    assert text.count("ops.def(") == text.count("ops.impl(") == len(vllm_ops.OPS)
    renamed = REGISTRY.replace('"silu_and_mul(', '"silu_and_mul_v2(')
    with pytest.raises(vllm_ops.OpsUnavailable, match="does not register 'silu_and_mul'"):
        vllm_ops.bindings(csrc_tree(tmp_path / "renamed", renamed))


def test_bindings_of_the_real_source():
    if not REAL_SRC:
        pytest.skip(f"no vLLM source: set ${peer_vllm.ENV_SRC} to an unpacked sdist (as nox -s parity does)")
    root = peer_vllm.find_source(REAL_SRC)
    if vllm_ops.csrc_present(root):
        pytest.skip(f"{root} has no csrc files (a slice made before they were kept)")
    text = vllm_ops.bindings(root)
    for op in vllm_ops.OPS:
        assert f'ops.def("{op}(' in text and f'ops.impl("{op}", TORCH_BOX(&' in text


def test_slice_keeps_the_csrc_files_and_nothing_else(tmp_path):
    root = csrc_tree(bare_tree(tmp_path / "src"))
    dest, _ = peer_vllm.slice_tree(root, tmp_path / "slice")
    got = sorted(str(p.relative_to(dest)) for p in (dest / "csrc").rglob("*") if p.is_file())
    assert got == sorted(vllm_ops.CSRC) and vllm_ops.csrc_present(dest) == []
    assert vllm_ops.csrc_present(bare_tree(tmp_path / "bare")) == list(vllm_ops.CSRC)


def test_build_refuses_with_what_is_missing(tmp_path, monkeypatch):
    with pytest.raises(vllm_ops.OpsUnavailable, match="slice it again"):
        vllm_ops.build(bare_tree(tmp_path / "bare"), tmp_path / "out")
    root = csrc_tree(tmp_path / "full")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(vllm_ops, "_SYSTEM_NVCC", str(tmp_path / "no-nvcc"))
    with pytest.raises(vllm_ops.OpsUnavailable, match="no nvcc"):
        vllm_ops.build(root, tmp_path / "out")
    if torch.version.cuda is None:  # this machine's torch: the refusal names it
        nvcc = tmp_path / "cuda" / "bin" / "nvcc"
        nvcc.parent.mkdir(parents=True)
        nvcc.write_text("#!/bin/sh\n")
        monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
        with pytest.raises(vllm_ops.OpsUnavailable, match="CPU build"):
            vllm_ops.build(root, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-built left


def test_build_refuses_when_a_compiler_cannot_run(tmp_path, monkeypatch):
    """A compiler that is missing or not executable is OpsUnavailable (the bench then drops the chain column), not a
    crash of the run."""
    with pytest.raises(vllm_ops.OpsUnavailable, match="cannot run"):
        vllm_ops._run([str(tmp_path / "no-such-c++"), "--version"])
    notexec = tmp_path / "nvcc"
    notexec.write_text("not a program\n")
    with pytest.raises(vllm_ops.OpsUnavailable, match="cannot run"):
        vllm_ops._run([str(notexec), "--version"])


def test_load_names_a_missing_or_foreign_library(tmp_path, monkeypatch):
    monkeypatch.setenv(vllm_ops.ENV_OPS, str(tmp_path / "missing.so"))
    with pytest.raises(vllm_ops.OpsUnavailable, match="is not a file"):
        vllm_ops.load(None)
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"not an ELF file")
    monkeypatch.setenv(vllm_ops.ENV_OPS, str(junk))
    with pytest.raises(vllm_ops.OpsUnavailable, match="loading"):
        vllm_ops.load(None)
    monkeypatch.delenv(vllm_ops.ENV_OPS)
    with pytest.raises(vllm_ops.OpsUnavailable, match="no vLLM source"):
        vllm_ops.load(None)


class RecordingOps:
    """Records each op call (name, args), as torch.ops would receive them."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        if name not in vllm_ops.OPS:
            raise AttributeError(name)
        return lambda *args: self.calls.append((name, args))


def test_quantize_calls_the_ops_as_vllms_wrappers_do():
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    fp8 = torch.float8_e4m3fn
    ops = RecordingOps()
    q, s = vllm_ops.quantize(ops, x, None, per_act_token=False, block_shape=[128, 128])
    (name, (xin, xq, xs, group, eps, lo, hi, ue8m0, transposed, tma)), = ops.calls
    assert name == "per_token_group_fp8_quant" and xin is x and xq is q and xs is s
    assert q.shape == x.shape and q.dtype == fp8 and s.shape == (5, 2) and s.dtype == torch.float32
    assert (group, eps, lo, hi, ue8m0, transposed, tma) == (128, 1e-10, -448.0, 448.0, False, False, False)

    ops = RecordingOps()
    q, s = vllm_ops.quantize(ops, x, None, per_act_token=True, block_shape=None)
    assert ops.calls == [("dynamic_per_token_scaled_fp8_quant", (q, x, s, None))] and s.shape == (5, 1)
    ops = RecordingOps()
    q, s = vllm_ops.quantize(ops, x, None, per_act_token=False, block_shape=None)
    assert ops.calls == [("dynamic_scaled_fp8_quant", (q, x, s))] and s.shape == (1,) and q.dtype == fp8
    ops = RecordingOps()
    scale = torch.tensor([0.5])
    q, s = vllm_ops.quantize(ops, x, scale, per_act_token=False, block_shape=None)
    assert ops.calls == [("static_scaled_fp8_quant", (q, x, scale, None))] and s is scale


def test_activation_calls_the_ops_as_apply_moe_activation_does():
    x, out = torch.randn(3, 64), torch.empty(3, 32)
    ops = RecordingOps()
    plain = SimpleNamespace(gemm1_alpha=None, gemm1_clamp_limit=None)
    vllm_ops.activation(ops, MoEActivation.SILU, out, x, plain)
    vllm_ops.activation(ops, MoEActivation.SWIGLUOAI, out, x, plain)
    # vLLM 0.33's apply_moe_activation calls swigluoai_and_mul(output, input): the config's values are not passed
    vllm_ops.activation(ops, MoEActivation.SWIGLUOAI, out, x, SimpleNamespace(gemm1_alpha=1.5, gemm1_clamp_limit=6))
    assert ops.calls == [("silu_and_mul", (out, x)), ("swigluoai_and_mul", (out, x)), ("swigluoai_and_mul", (out, x))]
    for act, qc in ((MoEActivation.GELU, plain), (MoEActivation.SILU, SimpleNamespace(gemm1_alpha=None,
                                                                                        gemm1_clamp_limit=7.0))):
        with pytest.raises(NotImplementedError, match="not bound"):
            vllm_ops.activation(ops, act, out, x, qc)
