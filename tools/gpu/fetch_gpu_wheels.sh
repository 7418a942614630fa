#!/usr/bin/env bash
# Download, here (PyPI reachable), the wheels the GPU machine lacks into .whl/ (git-ignored), for Python 3.12.
# Differs from ../shared/gpu/fetch-wheels.sh in one pin: DeepGEMM comes from tokenspeed-deepgemm 2.5.0.post20260604,
# because sgl-deep-gemm 0.2.0 fails every call on torch 2.11 (see backends/deep_gemm/__init__.py); and it adds
# pytest-xdist (crash isolation of the conformance run), and nvidia-ml-py (the benchmark's clock sampling).
set -euo pipefail
dest=${1:-.whl}
mkdir -p "$dest"
rm -f "$dest"/sgl_deep_gemm-*.whl "$dest"/apache_tvm_ffi-*.whl
pins=(
  tokenspeed-deepgemm==2.5.0.post20260604
  pytest-xdist==3.8.0 execnet==2.1.1
  nox==2026.10.20 argcomplete==3.7.2 colorlog==6.12.0 dependency-groups==1.3.2 distlib==0.4.4
  humanize==4.17.0 platformdirs==4.14.7 virtualenv==21.15.8 python-discovery==1.9.5
  ml-dtypes==0.6.0
  nvidia-ml-py==13.615.71
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" "${pins[@]}"
ls -1 "$dest"
