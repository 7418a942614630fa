"""Download and unpack vLLM's source distribution (it carries vllm/, csrc/ and tests/) into a cache directory.

``python tests/parity/fetch_sdist.py 0.33.0 CACHE_DIR`` prints the unpacked tree's path (``CACHE_DIR/vllm-0.33.0``),
or exits 3 with the reason on stderr when the index is unreachable or has no such version.

First ``pip download --no-deps --no-binary :all: vllm==X`` (pip's own index configuration). vLLM's sdist cannot
build its metadata without its build toolchain, so pip stops after downloading and keeps nothing; the fallback then
asks the same index (pip's ``index-url``, PEP 691 JSON) for the sdist's URL and sha256 and downloads that file,
checking the hash. An already unpacked tree is reused.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path


def _index_url() -> str:
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"], capture_output=True,
                             text=True, timeout=30).stdout.strip()
    except Exception:  # noqa: BLE001
        out = ""
    return (out or "https://pypi.org/simple").rstrip("/")


def fetch(version: str, cache: Path) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    tree = cache / f"vllm-{version}"
    if (tree / "vllm" / "model_executor").is_dir():
        return tree
    name = f"vllm-{version}.tar.gz"
    sdist = cache / name
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
                        f"vllm=={version}", "-d", str(cache)], capture_output=True, text=True, timeout=900)
    if not sdist.exists():  # metadata preparation failed after the download: ask the index for the file
        req = urllib.request.Request(f"{_index_url()}/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        files = json.load(urllib.request.urlopen(req, timeout=60))["files"]
        match = [f for f in files if f["filename"] == name]
        if not match:
            raise LookupError(f"the index has no {name}")
        part = sdist.with_suffix(".part")
        urllib.request.urlretrieve(match[0]["url"], part)
        want = match[0].get("hashes", {}).get("sha256")
        got = hashlib.sha256(part.read_bytes()).hexdigest()
        if want and got != want:
            part.unlink()
            raise ValueError(f"{name}: sha256 {got} != index {want}")
        part.rename(sdist)
    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers() if m.name.startswith(f"vllm-{version}/")
                   and m.name.split("/")[1] in ("vllm", "tests", "csrc", "PKG-INFO") and ".." not in m.name]
        tf.extractall(cache, members=members, filter="data")
    return tree


def main() -> int:
    version, cache = sys.argv[1], Path(sys.argv[2])
    try:
        print(fetch(version, cache))
    except Exception as exc:  # noqa: BLE001 - any failure is a reason to skip, reported as such
        print(f"cannot fetch vllm {version}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
