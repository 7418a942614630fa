"""``benchmarks.peer_vllm`` (``python -m benchmarks --backend NAME --peer vllm``) on a machine without a GPU.

The loader on a synthetic vLLM tree built here (kernel file written verbatim with its decorators and imported, host
functions executed with the stubs, tuned-config choice, the sdist .tar.gz and the slice), its errors, the CLI's
``--peer vllm --list`` and refusal, the live peer in the table; with ``$MOE_VLLM_SRC`` (an unpacked vLLM sdist, as
``nox -s parity`` sets it) the same on the real source, and vLLM's real ``fused_moe_kernel`` under Triton's
interpreter against the reference on tiny cases. The timings themselves need a GPU (``python -m benchmarks --backend
triton --peer vllm`` on the H200).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from benchmarks import cli, peer_vllm, report

ROOT = Path(__file__).resolve().parent.parent
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install -e '.[triton]')")

FAKE_FUSED_MOE = '''"""A synthetic fused_moe.py with the names benchmarks.peer_vllm loads."""
import functools
import json
import os

import vllm.envs as envs  # never executed: the loader reads definitions only
from vllm.triton_utils import tl, triton


@triton.jit
def helper(x):
    return x + 1


@triton.jit
def fused_moe_kernel(x_ptr, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < N)
    tl.store(x_ptr + offs, helper(x), mask=offs < N)


def invoke_fused_moe_triton_kernel(A, B, C, config, top_k, B_bias=None):
    C.append((A, B, config, top_k, B_bias, enable_swap_ab(16, 64)))


def get_config_file_name(E, N, dtype, block_shape=None):
    device_name = get_device_name_as_file_name()
    if "H200" in device_name.split("_"):
        device_name = "NVIDIA_H200"
    sel = "" if not dtype else f",dtype={dtype}"
    return f"E={E},N={N},device_name={device_name}{sel}.json"


@functools.lru_cache
def get_moe_configs(E, N, dtype, block_n=None, block_k=None):
    if envs.VLLM_BATCH_INVARIANT:
        return None
    path = os.path.join(os.path.dirname(os.path.realpath(__file__)), "configs", get_config_file_name(E, N, dtype))
    if os.path.exists(path):
        with open(path) as f:
            return {int(k): v for k, v in json.load(f).items()}
    logger.warning_once("no config at %s", path)
    return None


def get_default_config(M, E, N, K, topk, dtype, block_shape=None):
    return {"BLOCK_SIZE_M": 16 if M <= 32 else 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1}
'''

FAKE_UTILS = '''
def enable_swap_ab(BLOCK_SIZE_M, BLOCK_SIZE_N):
    return current_platform.is_device_capability(90) and BLOCK_SIZE_M < 64 and BLOCK_SIZE_N >= 64
'''


def fake_tree(base: Path, version: str = "9.9.9", fused_moe: str = FAKE_FUSED_MOE) -> Path:
    root = base / f"vllm-{version}"
    d = root / peer_vllm.REL
    (d / "configs").mkdir(parents=True)
    (root / "PKG-INFO").write_text(f"Metadata-Version: 2.4\nName: vllm\nVersion: {version}\n")
    (d / "fused_moe.py").write_text(fused_moe)
    (d / "utils.py").write_text(FAKE_UTILS)
    (d / "configs" / "E=8,N=64,device_name=NVIDIA_H200.json").write_text(json.dumps(
        {"1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32}, "64": {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128}}))
    (root / "README.md").write_text("not part of the slice\n")
    return root


REAL_SRC = os.environ.get(peer_vllm.ENV_SRC)  # read once: every test runs with it unset (the fixture below)


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(peer_vllm.ENV_SRC, raising=False)


def real_tree() -> Path:
    if not REAL_SRC:
        pytest.skip(f"no vLLM source: set ${peer_vllm.ENV_SRC} to an unpacked sdist (python "
                    "tests/parity/fetch_sdist.py 0.33.0 DIR; then DIR/vllm-0.33.0)")
    return peer_vllm.find_source(REAL_SRC)


# ----------------------------------------------------------------------------------------------------------------
# find_source
# ----------------------------------------------------------------------------------------------------------------


def test_find_source_accepts_root_package_dir_and_env(tmp_path, monkeypatch):
    root = fake_tree(tmp_path)
    assert peer_vllm.find_source(root) == root
    assert peer_vllm.find_source(root / "vllm") == root
    monkeypatch.setenv(peer_vllm.ENV_SRC, str(root))
    assert peer_vllm.find_source() == root
    assert peer_vllm.version_of(root) == "9.9.9"


def test_find_source_errors_say_what_to_do(tmp_path, monkeypatch):
    for bad in (tmp_path / "nope", tmp_path):
        with pytest.raises(peer_vllm.PeerUnavailable) as e:
            peer_vllm.find_source(bad)
        msg = str(e.value)
        assert str(bad) in msg and "python tests/parity/fetch_sdist.py 0.33.0 DIR" in msg
        assert "--vllm-src DIR/vllm-0.33.0" in msg and "pip install vllm" in msg
    monkeypatch.setattr(peer_vllm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(peer_vllm.PeerUnavailable, match="no --vllm-src, no \\$MOE_VLLM_SRC, no installed vllm"):
        peer_vllm.find_source()


def test_installed_package_is_located_not_imported(tmp_path, monkeypatch):
    root = fake_tree(tmp_path)
    spec = type("Spec", (), {"submodule_search_locations": [str(root / "vllm")]})()
    monkeypatch.setattr(peer_vllm.importlib.util, "find_spec", lambda name: spec if name == "vllm" else None)
    assert peer_vllm.find_source() == root
    assert "vllm" not in sys.modules


def test_sdist_tarball_is_extracted_minimally_and_sliced(tmp_path):
    root = fake_tree(tmp_path / "src")
    tgz = tmp_path / "vllm-9.9.9.tar.gz"
    with tarfile.open(tgz, "w:gz") as tf:
        tf.add(root, arcname="vllm-9.9.9")
    got = peer_vllm.find_source(tgz)
    assert got == tmp_path / "cache" / "moe-conformance" / "vllm-9.9.9"
    assert (got / "PKG-INFO").is_file() and not (got / "README.md").exists()
    assert peer_vllm.find_source(tgz) == got  # reused
    dest, n = peer_vllm.slice_tree(tgz, tmp_path / "slice")
    files = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert files == ["PKG-INFO", f"{peer_vllm.REL}/configs/E=8,N=64,device_name=NVIDIA_H200.json",
                     f"{peer_vllm.REL}/fused_moe.py", f"{peer_vllm.REL}/utils.py"] and n > 0
    assert peer_vllm.main(["slice", str(root), str(tmp_path / "slice2")]) == 0
    assert peer_vllm.version_of(tmp_path / "slice2") == "9.9.9"


# ----------------------------------------------------------------------------------------------------------------
# load
# ----------------------------------------------------------------------------------------------------------------


@needs_triton
def test_load_synthetic_tree(tmp_path):
    import triton

    vt = peer_vllm.load(fake_tree(tmp_path))
    assert vt.version == "9.9.9" and vt.title == "vllm 9.9.9" and vt.launcher_name == "invoke_fused_moe_triton_kernel"
    text = vt.kernel_path.read_text()
    assert text.startswith("# vLLM 9.9.9") and "import triton\nimport triton.language as tl\n" in text
    assert text.count("@triton.jit\n") == 2 and "def helper(x)" in text  # the jit helper it calls comes along
    assert vt.kernel_path.parent == tmp_path / "cache" / "moe-conformance" / "kernels"
    assert isinstance(vt.kernel, triton.runtime.JITFunction) and vt.kernel.fn.__name__ == "fused_moe_kernel"
    # the host functions run with the stubs: device name, configs/ next to the real __file__, nearest M key
    cfg, src = vt.config((8, 64, 32), (8, 32, 64), 2, None, 50, device_name="NVIDIA H200 NVL")
    assert cfg == {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128} and src == "E=8,N=64,device_name=NVIDIA_H200.json[64]"
    cfg, src = vt.config((8, 64, 32), (8, 32, 64), 2, None, 2, device_name="NVIDIA H200")
    assert cfg["BLOCK_SIZE_M"] == 16 and src.endswith("[1]")
    cfg, src = vt.config((8, 64, 32), (8, 32, 64), 2, "fp8_w8a8", 2, device_name="NVIDIA H200")
    assert src == "default" and cfg["BLOCK_SIZE_K"] == 128
    cfg, src = vt.config((8, 64, 32), (8, 32, 64), 2, None, 100, device_name="NVIDIA H100 80GB HBM3")
    assert src == "default" and cfg["BLOCK_SIZE_M"] == 64
    calls = []
    vt.launch(A=1, B=2, C=calls, config={}, top_k=3, B_bias=None, B_zp=None)  # unknown None kwargs are dropped
    assert calls == [(1, 2, {}, 3, None, False)]  # enable_swap_ab from utils.py: no sm_90 here
    with pytest.raises(NotImplementedError, match="takes no B_zp"):
        vt.launch(A=1, B=2, C=calls, config={}, top_k=3, B_zp=object())
    with pytest.raises(peer_vllm.PeerUnavailable, match="needs top_k"):
        vt.launch(A=1, B=2, C=calls, config={})


@needs_triton
def test_load_names_missing_functions_file_and_version(tmp_path):
    src = FAKE_FUSED_MOE.replace("def get_default_config", "def renamed_default_config")
    root = fake_tree(tmp_path, "1.2.3", src)
    with pytest.raises(peer_vllm.PeerUnavailable) as e:
        peer_vllm.load(root)
    assert "get_default_config" in str(e.value) and "1.2.3" in str(e.value) and "fused_moe.py" in str(e.value)
    root = fake_tree(tmp_path / "b", "1.2.4", FAKE_FUSED_MOE.replace("invoke_fused_moe_triton_kernel",
                                                                     "invoke_something_else"))
    with pytest.raises(peer_vllm.PeerUnavailable, match="invoke_fused_moe_triton_kernel or invoke_fused_moe_kernel"):
        peer_vllm.load(root)


def test_config_dtype_str_is_vllms():
    import torch

    from reference.schemes import quantize_weights

    w1, w2 = torch.randn(2, 256, 128).bfloat16(), torch.randn(2, 128, 128).bfloat16()
    assert peer_vllm.config_dtype_str(quantize_weights("bf16", w1, w2)[2], torch.bfloat16) is None
    assert peer_vllm.config_dtype_str(quantize_weights("fp8_block128", w1, w2)[2], torch.bfloat16) == "fp8_w8a8"
    assert peer_vllm.config_dtype_str(quantize_weights("fp8_tensor", w1, w2)[2], torch.bfloat16) == "fp8_w8a8"
    assert peer_vllm.config_dtype_str(quantize_weights("bf16", w1, w2)[2], torch.float32) == "float32"


# ----------------------------------------------------------------------------------------------------------------
# The real source ($MOE_VLLM_SRC)
# ----------------------------------------------------------------------------------------------------------------


@needs_triton
def test_real_source_loads_and_picks_vllms_tuned_configs():
    vt = peer_vllm.load(real_tree())
    assert vt.version[0].isdigit() and vt.launcher_name in peer_vllm.LAUNCHERS
    assert "def fused_moe_kernel(" in vt.kernel_path.read_text()
    name = "E=128,N=768,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"
    if not (vt.root / peer_vllm.REL / "configs" / name).is_file():
        pytest.skip(f"vLLM {vt.version} has no {name}")
    # Qwen3-30B-A3B: w1 (128, 1536, 2048), w2 (128, 2048, 768); N of the file name is w2's last dim
    table = json.loads((vt.root / peer_vllm.REL / "configs" / name).read_text())
    for M in (1, 64, 4096):
        cfg, src = vt.config((128, 1536, 2048), (128, 2048, 768), 8, "fp8_w8a8", M, [128, 128],
                             device_name="NVIDIA H200")
        key = min((int(k) for k in table if k != "triton_version"), key=lambda k: abs(k - M))
        assert src == f"{name}[{key}]" and cfg == table[str(key)]
    cfg, src = vt.config((128, 1536, 2048), (128, 2048, 768), 8, "fp8_w8a8", 64, [128, 128],
                         device_name="NVIDIA Imaginary GPU")
    assert src == "default" and cfg["BLOCK_SIZE_K"] == 128 and cfg["BLOCK_SIZE_M"] == 16  # block-FP8 defaults
    cfg, src = vt.config((7, 64, 64), (7, 64, 32), 2, None, 5, None, device_name="NVIDIA H200")
    assert src == "default" and set(cfg) >= {"BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M"}


INTERPRET_WORKER = r'''
import json, os, sys
assert os.environ.get("TRITON_INTERPRET") == "1"
from types import SimpleNamespace
import torch
from benchmarks import peer_vllm as P
from benchmarks.harness import draw_routing, make_weights
from reference.activation import MoEActivation

vt = P.load(sys.argv[1])
import benchmarks.check as BC

_reference_output, profiles = BC.reference_output, []


def recording_reference_output(*args, **kwargs):
    profiles.append(kwargs.get("profile"))
    return _reference_output(*args, **kwargs)


BC.reference_output = recording_reference_output


class TorchOps:
    """vLLM's silu_and_mul and per_token_group_fp8_quant in torch (their math, no CUDA): silu(g) rounded to the act
    dtype before the multiply, as csrc silu_and_mul does. At these sizes either profile's bound holds; which profile
    the stage is judged under is recorded below (the GPU run is where the wrong one failed: 18 rows)."""

    def __init__(self):
        self.calls = []

    def silu_and_mul(self, out, x):
        self.calls.append("silu_and_mul")
        d = x.shape[-1] // 2
        act = torch.nn.functional.silu(x[..., :d].float()).to(out.dtype)
        out.copy_((act.float() * x[..., d:].float()).to(out.dtype))

    def per_token_group_fp8_quant(self, x, xq, xs, group, eps, lo, hi, ue8m0, transposed, tma):
        self.calls.append("per_token_group_fp8_quant")
        xf = x.float().view(x.shape[0], -1, group)
        s = xf.abs().amax(-1).clamp_min(eps) / hi
        xs.copy_(s)
        xq.copy_((xf / s[..., None]).clamp(lo, hi).view(x.shape).to(xq.dtype))

DT = {"fp16": torch.float16, "fp32": torch.float32, "fp8_block128": torch.bfloat16}
for scheme, E, topk, K, I, M in json.loads(sys.argv[2]):
    g = torch.Generator().manual_seed(7)
    dt = DT[scheme]
    shape = SimpleNamespace(id=f"tiny-{scheme}-E{E}-M{M}", E=E, topk=topk, K=K, I=I, N=2 * I, dtype=dt,
                            scheme=scheme, activation=MoEActivation.SILU)
    w1, w2, qc = make_weights(E, 2 * I, K, I, scheme, dt, "cpu", g)
    sets = []
    for _ in range(2):
        h = torch.randn(M, K, dtype=dt, generator=g)
        sets.append((h, *draw_routing(M, E, topk, "cpu", g)))
    inp = SimpleNamespace(weights=SimpleNamespace(copies=[(w1, w2, qc)]), sets=sets)
    c = P.check(vt, shape, M, inp, torch.device("cpu"))
    name, call, src = P.gemms_variant(vt, shape, M, inp, torch.device("cpu"))
    call(1)
    # the whole-stage wiring (GEMM1, the ops between, GEMM2 on their output) with torch stand-ins for vLLM's
    # compiled ops: the chain checked is then the stage timed
    vt.ops, vt.ops_error = TorchOps(), None
    chain_name, stage = P.chain_variant(vt, shape, M, inp, torch.device("cpu"))
    stage(1)
    cc = P.check(vt, shape, M, inp, torch.device("cpu"), stage=True)
    vt.ops, calls = None, vt.ops.calls
    print(json.dumps({"case": shape.id, "ok": c.ok, "text": c.text, "config": src, "name": name,
                      "chain": chain_name, "chain_ok": cc.ok, "chain_text": cc.text, "ops": sorted(set(calls)),
                      "profiles": profiles[-2:]}),
          flush=True)
'''

# (scheme, E, topk, K, I, M): the aligned path (M * topk * 4 > E) and vLLM's naive per-route blocks (<= E), the
# unquantized kernel in fp16 and fp32, and block FP8 (1x128 activation groups, 128x128 weight blocks). bf16 is not
# among them: Triton's interpreter multiplies bf16 dot operands as raw bit patterns (tests/test_triton_interpret.py),
# so only the GPU run checks vLLM's bf16 path (python -m benchmarks checks every timed row up to check_max_M).
INTERPRET_CASES = [("fp16", 4, 2, 64, 32, 5), ("fp16", 64, 2, 64, 32, 2), ("fp32", 4, 2, 64, 32, 5),
                   ("fp8_block128", 4, 2, 256, 128, 5)]


@needs_triton
@pytest.mark.slow
def test_real_kernel_under_the_interpreter_matches_the_reference():
    root = real_tree()
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH",
                                                                                                        "")}
    r = subprocess.run([sys.executable, "-c", INTERPRET_WORKER, str(root), json.dumps(INTERPRET_CASES)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(INTERPRET_CASES), f"rc={r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    bad = [row for row in rows if not (row["ok"] and row["chain_ok"])]
    assert not bad, bad
    assert all(row["config"] == "default" and row["name"].startswith("vllm ") for row in rows)
    assert all(row["chain"] == row["name"] + " chain" for row in rows)
    assert {tuple(row["ops"]) for row in rows} == {("silu_and_mul",), ("per_token_group_fp8_quant", "silu_and_mul")}
    # the GEMM-launch check against the default profile, the compiled SiLU stage against R(R(silu(g)) * u)'s
    assert all(row["profiles"] == [None, "torch_native_activation"] for row in rows), rows


# ----------------------------------------------------------------------------------------------------------------
# The CLI and the table
# ----------------------------------------------------------------------------------------------------------------


def test_cli_list_names_the_live_source(tmp_path, capsys):
    root = fake_tree(tmp_path)
    assert cli.main(["--backend", "triton", "--peer", "vllm", "--vllm-src", str(root), "--list"]) == 0
    out = capsys.readouterr().out
    assert f"peer vLLM 9.9.9 (live) from {root}" in out and "qwen3_30b-bf16" in out
    assert cli.main(["--backend", "triton", "--peer", "none", "--list"]) == 0
    assert "; peer -" in capsys.readouterr().out
    assert cli.main(["--backend", "cuda", "--peer", "vllm", "--list"]) == 0  # no gemms variant: a note, no error
    assert "no GEMM-stage variant" in capsys.readouterr().out


def test_cli_bad_vllm_src_exits_2_with_the_fix(tmp_path):
    r = subprocess.run([sys.executable, "-m", "benchmarks", "--backend", "triton", "--peer", "vllm", "--vllm-src",
                        str(tmp_path / "missing"), "--list"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != peer_vllm.ENV_SRC})
    assert r.returncode == 2, r.stdout + r.stderr
    assert "does not exist" in r.stdout and "fetch_sdist.py 0.33.0 DIR" in r.stdout and "Traceback" not in r.stderr
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--backend", "triton", "--vllm-src", str(tmp_path)])
    assert e.value.code == 2


def test_render_suite_with_the_live_peer():
    doc = {"backend": "triton", "device": {"name": "NVIDIA H200"}, "ceilings": {}, "compare": "gemms",
           "peer": {"name": "vllm_live", "title": "vLLM 0.33.0 (live)", "source": "/x/fused_moe.py", "device": "H200",
                    "measures": "gemms", "unit": "us", "live": True, "column": "vllm 0.33.0"},
           "experts": [{"case": "qwen3_30b-bf16", "E": 128, "topk": 8, "K": 2048, "I": 768, "M": 1024,
                        "times_s": {"step": 4e-4, "gemms": 3e-4, "vllm 0.33.0": 3.6e-4}, "methods": {},
                        "peer_s": 3.6e-4, "floor_s": 1e-4, "checks": {"step": "ok 0.30",
                                                                      "vllm 0.33.0": "vllm 0.33.0: ok 0.41"},
                        "extra": {"vllm_config": "E=128,N=768,device_name=NVIDIA_H200.json[1024]"}}],
           "failures": [], "notes": []}
    text = report.render_suite(doc)
    assert "timed live in this run" in text and "vLLM 0.33.0 (live) us" not in text
    assert "| vllm 0.33.0 us | speedup |" in text and "| 1.20x |" in text
    assert "E=128,N=768,device_name=NVIDIA_H200.json[1024]" in text
    assert "geometric-mean speedup of gemms vs vLLM 0.33.0 (live): 1.200x" in text
    assert "speedup (chain)" not in text and "no `vllm 0.33.0 chain` column" in text


def test_render_suite_with_the_peers_whole_chain():
    """With vLLM's compiled ops the table has the chain's column and its speedup; the summary counts every row
    against both peers (the GEMM launches as filed, the whole stage beside)."""
    def row(M, gemms, peer, chain):
        return {"case": "mixtral_tp2-fp8_tensor", "E": 8, "topk": 2, "K": 4096, "I": 7168, "M": M,
                "times_s": {"gemms": gemms * 1e-6, "vllm 0.33.0": peer * 1e-6, "vllm 0.33.0 chain": chain * 1e-6},
                "methods": {}, "peer_s": peer * 1e-6, "peer_chain_s": chain * 1e-6, "floor_s": 1e-4, "checks": {},
                "extra": {}}

    doc = {"backend": "triton", "device": {"name": "NVIDIA H200"}, "ceilings": {}, "compare": "gemms",
           "peer": {"name": "vllm_live", "title": "vLLM 0.33.0 (live)", "source": "/x/fused_moe.py", "device": "H200",
                    "measures": "gemms", "unit": "us", "live": True, "column": "vllm 0.33.0",
                    "chain_column": "vllm 0.33.0 chain"},
           "experts": [row(64, 200, 190, 210), row(1024, 500, 430, 520), row(4096, 1500, 1320, 1450),
                       row(8, 100, 99.9, 110)],
           "failures": [], "notes": []}
    text = report.render_suite(doc)
    assert "| gemms us | vllm 0.33.0 us | vllm 0.33.0 chain us | speedup | speedup (chain) |" in text
    assert "| 0.95x | 1.05x |" in text and "| 0.86x | 1.04x |" in text and "| 0.88x | 0.97x |" in text
    assert "rows at or above 1.00x of vLLM 0.33.0 (live): 0 of 4" in text
    assert "M=8 0.999x" in text  # not "1.00x" among the rows below
    assert ("rows at or above 1.00x of vllm 0.33.0 chain: 3 of 4; below: mixtral_tp2-fp8_tensor M=4096 0.97x"
            in text)
    assert "geometric-mean speedup of gemms vs vllm 0.33.0 chain: 1.003x over 2 points" in text


def test_each_peer_column_is_checked_on_its_own(monkeypatch):
    """The GEMM-launch column (as filed) and the whole-stage column have separate checks: a chain outside its bound
    is noted and left untimed while the GEMM-launch column is still timed; a GEMM-launch check that fails drops both
    (nothing of that peer is timed); a shape the chain does not cover gets a note."""
    from types import SimpleNamespace as NS

    vt = NS(title="vllm 9.9.9", version="9.9.9", ops=object(), chain_title="vllm 9.9.9 chain")
    verdicts = {False: NS(ok=True, text="ok 0.50"), True: NS(ok=False, text="FAIL rms_norm 2e-2 > 1e-2")}
    monkeypatch.setattr(peer_vllm, "gemms_variant", lambda *a: ("vllm 9.9.9", "launches", "cfg.json[8]"))
    monkeypatch.setattr(peer_vllm, "chain_variant", lambda *a: ("vllm 9.9.9 chain", "stage"))
    monkeypatch.setattr(peer_vllm, "check", lambda *a, stage: verdicts[stage])

    def run():
        row, doc = {"extra": {}, "checks": {}}, {"notes": [], "failures": []}
        return cli._vllm_peer(vt, NS(id="s"), 8, None, None, row, doc, True), row, doc

    timed, row, doc = run()
    assert [t[0] for t in timed] == ["vllm 9.9.9"] and row["extra"]["vllm_config"] == "cfg.json[8]"
    assert row["checks"] == {"vllm 9.9.9": "vllm 9.9.9: ok 0.50",
                             "vllm 9.9.9 chain": "vllm 9.9.9 chain: FAIL rms_norm 2e-2 > 1e-2"}
    assert doc["notes"] == ["check s M=8 vllm 9.9.9 chain: FAIL rms_norm 2e-2 > 1e-2 (not timed)"]
    assert not doc["failures"]
    verdicts[True] = NS(ok=True, text="ok 0.40")
    assert [t[0] for t in run()[0]] == ["vllm 9.9.9", "vllm 9.9.9 chain"]

    def uncovered(*a):
        raise NotImplementedError("int8 W8A8: not bound")

    monkeypatch.setattr(peer_vllm, "chain_variant", uncovered)
    timed, _, doc = run()
    assert [t[0] for t in timed] == ["vllm 9.9.9"] and doc["notes"] == ["vllm 9.9.9 chain: s not run: int8 W8A8: "
                                                                         "not bound"]
    verdicts[False] = NS(ok=False, text="FAIL max_norm")
    assert run()[0] == []
