"""The noxfile's backend selection (``plan_conformance``), its GPU check and the registry it is built from."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nox")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def noxfile():
    spec = importlib.util.spec_from_file_location("moe_noxfile", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


SESSIONS = ("torch", "triton", "deep_gemm", "cuda")


def plans(noxfile, posargs):
    return {s: noxfile.plan_conformance(s, posargs, SESSIONS) for s in SESSIONS}


def test_sessions_come_from_the_registry(noxfile):
    from backends import BUILTIN, BUILTIN_NEEDS, registered_backends

    assert noxfile.BACKENDS == list(registered_backends())
    assert noxfile.BACKENDS[:len(BUILTIN)] == list(BUILTIN)
    assert noxfile.GPU_BACKENDS == [b for b in BUILTIN if BUILTIN_NEEDS[b].cuda] == ["triton", "deep_gemm", "cuda"]
    assert set(BUILTIN_NEEDS) == set(BUILTIN)


def test_without_backend_every_session_runs_its_own(noxfile):
    p = plans(noxfile, ["-k", "deepseek_v3", "-x"])
    assert all(p[s].run and p[s].backend == s and p[s].pytest_args == ("-k", "deepseek_v3", "-x") for s in SESSIONS)


@pytest.mark.parametrize("posargs", [["--backend", "triton", "-k", "M4"], ["-k", "M4", "--backend=triton"]])
def test_a_builtin_name_selects_its_session_only(noxfile, posargs):
    p = plans(noxfile, posargs)
    assert p["triton"].run and p["triton"].backend == "triton" and p["triton"].pytest_args == ("-k", "M4")
    for s in ("torch", "deep_gemm", "cuda"):
        assert not p[s].run and not p[s].error
        assert p[s].reason == "not selected: --backend triton runs in conformance(triton)"


def test_an_out_of_tree_backend_runs_in_the_torch_session_under_its_own_name(noxfile):
    p = plans(noxfile, ["--backend", "mypkg.moe:backend"])
    assert p["torch"].run and p["torch"].backend == "mypkg.moe:backend" and p["torch"].pytest_args == ()
    assert all(not p[s].run and "conformance(torch)" in p[s].reason for s in ("triton", "deep_gemm", "cuda"))


def test_an_unknown_name_fails_in_one_session_saying_so(noxfile):
    p = plans(noxfile, ["--backend", "nosuchbackend"])
    assert p["torch"].error and not p["torch"].run
    assert "unknown backend 'nosuchbackend'; registered: cuda, deep_gemm, torch, triton" in p["torch"].reason
    assert all(not p[s].run and not p[s].error for s in ("triton", "deep_gemm", "cuda"))


def test_the_last_backend_argument_wins(noxfile):
    assert noxfile.split_backend_arg(["--backend", "a", "-q", "--backend=b"]) == ("b", ["-q"])
    assert noxfile.split_backend_arg([]) == (None, [])


def test_gpu_check(noxfile, tmp_path, monkeypatch):
    dev, proc = tmp_path / "dev", tmp_path / "gpus"
    dev.mkdir()
    monkeypatch.setattr(noxfile.shutil, "which", lambda name: None)
    assert "no CUDA GPU" in noxfile.gpu_absent_reason(dev, proc)
    (dev / "nvidia0").touch()
    assert noxfile.gpu_absent_reason(dev, proc) is None
    (dev / "nvidia0").unlink()
    (proc / "0000:01:00.0").mkdir(parents=True)
    assert noxfile.gpu_absent_reason(dev, proc) is None


def test_probe_prints_a_typed_reason(noxfile):
    def probe(name):
        r = subprocess.run([sys.executable, "-c", noxfile.PROBE, name], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
        return json.loads(r.stdout.strip().splitlines()[-1])

    assert probe("torch") == {"kind": None}
    assert probe("nosuchbackend")["kind"] == "not_found"
    cuda = probe("cuda")
    import torch

    if not torch.cuda.is_available():
        assert cuda["kind"] == "no_device" and "no CUDA GPU" in cuda["reason"]


def test_unavailable_is_a_string_with_a_kind():
    from backends import Unavailable, package_unavailable_reason

    r = package_unavailable_reason("no_such_module_xyz", "triton")
    assert isinstance(r, str) and r.kind == "missing_package" and r.extra == "triton"
    assert r == "no_such_module_xyz is not installed (pip install -e '.[triton]')"
    assert Unavailable.of("plain").kind == "other" and Unavailable.of(None) is None
    with pytest.raises(ValueError):
        Unavailable("x", "nonsense")
