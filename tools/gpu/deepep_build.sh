#!/usr/bin/env bash
# Build DeepEP v1 (intranode only, no NVSHMEM) on the GPU machine with its nvcc, into $2 (default /tmp/deepep).
#   bash tools/gpu/deepep_build.sh DEEPEP_SOURCE.tar.gz [DEST]      then: export PYTHONPATH=DEST:$PYTHONPATH
# The source is DeepEP at 567632d (the last commit before EPv2, whose setup.py builds without NVSHMEM when it finds
# none; EPv2's setup.py requires NVSHMEM and NCCL's device API): here `git -C <DeepEP clone> archive 567632d | gzip`.
# torch's wheels bring nvidia-nvshmem, which setup.py would find and then also build the internode/low-latency
# kernels: the probe is renamed so that only the intranode kernels (layout.cu, intranode.cu, runtime.cu) are built.
# Prints the build's time and its last lines; exit status is the build's.
set -u
src=$1; dest=${2:-/tmp/deepep}
rm -rf "$dest"; mkdir -p "$dest"
tar xzf "$src" -C "$dest" || exit 3
cd "$dest"
sed -i 's/find_spec("nvidia.nvshmem")/find_spec("nvidia.nvshmem_not_used_intranode_only")/' setup.py
# 567632d's csrc/deep_ep.cpp calls three low-latency mask helpers (internode_ll.cu, not built without NVSHMEM)
# outside its DISABLE_NVSHMEM guards: the import then fails with "undefined symbol:
# _ZN7deep_ep12internode_ll18update_mask_bufferEPiibP11CUstream_st" (seen 2026-11-27). Guard them as the rest.
python3 - <<'PY'
import re
p = "csrc/deep_ep.cpp"
s = open(p).read()
s, n = re.subn(r"(\n)(\s*internode_ll::(?:update|query|clean)_mask_buffer\([^;]*\);)",
               r"\1#ifndef DISABLE_NVSHMEM\n\2\n#endif", s)
open(p, "w").write(s)
print(f"deep_ep.cpp: {n} low-latency mask calls guarded by DISABLE_NVSHMEM")
PY
# Without NVSHMEM setup.py still compiles with -rdc=true but adds no device-link step: the import then fails with
# "undefined symbol: __cudaRegisterLinkedBinary_..._layout_cu_..." (seen 2026-11-27). The intranode kernels need no
# relocatable device code: drop the flag.
sed -i "s/'-rdc=true', //" setup.py
grep -c "rdc=true" setup.py
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
start=$(date +%s)
python3 setup.py build_ext --inplace >build.log 2>&1
rc=$?
echo "deepep build: rc=$rc, $(( $(date +%s) - start )) s, nvcc $(nvcc --version | tail -n 2 | head -n 1)"
grep -n "NVSHMEM\|Sources\|error" build.log | head -n 20
tail -n 15 build.log
ls "$dest"/deep_ep_cpp*.so 2>/dev/null
exit $rc
