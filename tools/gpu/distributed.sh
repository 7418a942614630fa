#!/usr/bin/env bash
# One device call on a multi-GPU machine: expert parallelism over NCCL. Run from the repository root (.whl/ carried,
# tools/gpu/fetch_gpu_wheels.sh), NVLink multicast off (NCCL_NVLS_ENABLE=0, set here again).
#   bash tools/gpu/distributed.sh OUT [DEEPEP_SOURCE.tar.gz]
# CONF_WORKERS=N runs each backend's conformance over N pytest-xdist workers (each with its own ranks; the first
# call, without, needed ~8 s per case: each rank process compiles its kernels, and 3 backends shared 64 cores);
# SKIP_BENCH=1 leaves out the triton timing table.
# Steps, each under its own limit and all inside DEADLINE seconds (default 560) from the start:
#   1. env: GPUs, NVLink topology, torch, NCCL version;
#   2. DeepEP build in the background (tools/gpu/deepep_build.sh), if a source tarball is given;
#   3. the distributed conformance of every backend of $BACKENDS (default: triton cuda deep_gemm), side by side:
#      python -m pytest conformance/test_distributed.py --backend B --world-size $WORLD_SIZES (default 2,4),
#      results in OUT/results/conformance-B.{json,md} (the matrix, with world-size rows, GPU, NCCL, date);
#   4. the timing table: python -m benchmarks --distributed --backend $BENCH_BACKEND (default triton) over
#      $WORLD_SIZES at DeepSeek-V3 EP shapes, M = $BENCH_MS (default 1,64,1024,4096), alone on the GPUs (the DeepEP
#      build may still be compiling on the host CPUs);
#   5. DeepEP through the suite once built: --backend examples.clients.deepep:backend -k DeepEPIntranode
#      (results OUT/results/conformance-triton_deepep.*), then its step in a timing table next to the reference
#      all-to-all pair.
# Everything is packed into OUT/distributed.tgz (plus OUT/summary.txt): copy the matrices to docs/conformance/
# with `python -m conformance.report OUT/results/conformance-*.json -o docs/conformance/multi-gpu/`.
set -u
out=${1:?OUT}; deepep_src=${2:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
here=$(pwd); res=$here/results-dist; rm -rf "$res"; mkdir -p "$res/results"
t0=$(date +%s); deadline=$(( t0 + ${DEADLINE:-560} ))
left() { local l=$(( deadline - $(date +%s) )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
ws=${WORLD_SIZES:-2,4}
backends=(${BACKENDS:-triton cuda deep_gemm})
{
source tools/gpu/gpu_env.sh
nvidia-smi topo -m 2>&1 | head -n 8
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', '.'.join(map(str, torch.cuda.nccl.version())), 'gpus', torch.cuda.device_count())"
date -u +%Y-%m-%dT%H:%M:%SZ
if [ -n "$deepep_src" ]; then
  ( bash tools/gpu/deepep_build.sh "$deepep_src" /tmp/deepep >"$res/deepep-build.log" 2>&1; echo $? >"$res/deepep-build.rc" ) &
  build_pid=$!
fi
for b in "${backends[@]}"; do
  [ "$b" = - ] && continue  # BACKENDS=-: no conformance of the built-in backends
  timeout -s INT -k 20 "$(left ${CONF_LIMIT:-200})" python3 -m pytest conformance/test_distributed.py --backend "$b" \
    --world-size "$ws" -q -p no:cacheprovider --results-dir "$res/results" -o console_output_style=count \
    ${CONF_WORKERS:+-n $CONF_WORKERS} >"$res/conformance-$b.log" 2>&1 &
done
wait $(jobs -p | grep -v "^${build_pid:-none}$") 2>/dev/null
for b in "${backends[@]}"; do [ "$b" = - ] && continue; echo "== conformance $b ($(( $(date +%s) - t0 )) s)"; tail -n 6 "$res/conformance-$b.log"; done
if [ -z "${SKIP_BENCH:-}" ] && [ "$(left 100000)" -gt 60 ]; then
  timeout -s INT -k 20 "$(left ${BENCH_LIMIT:-200})" python3 -m benchmarks --distributed --backend "${BENCH_BACKEND:-triton}" \
    --world-size "$ws" --ms "${BENCH_MS:-1,64,1024,4096}" --json "$res/bench-distributed.json" \
    --md "$res/bench-distributed.md" >"$res/bench.log" 2>&1
  echo "== bench rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 70 "$res/bench.log"
fi
if [ -n "$deepep_src" ]; then
  while kill -0 "$build_pid" 2>/dev/null && [ "$(left 100000)" -gt 90 ]; do sleep 5; done
  echo "== deepep build ($(( $(date +%s) - t0 )) s)"; cat "$res/deepep-build.log"
  if [ "$(cat "$res/deepep-build.rc" 2>/dev/null)" = 0 ]; then
    export PYTHONPATH=/tmp/deepep:${PYTHONPATH:-}
    timeout -s INT -k 20 "$(left ${DEEPEP_LIMIT:-120})" python3 -m pytest conformance/test_distributed.py \
      --backend examples.clients.deepep:backend --world-size "$ws" -k DeepEPIntranode -q -p no:cacheprovider \
      ${CONF_WORKERS:+-n 2} \
      --results-dir "$res/results" -o console_output_style=count >"$res/conformance-deepep.log" 2>&1
    echo "== conformance deepep rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 40 "$res/conformance-deepep.log"
  fi
fi
if [ -n "$deepep_src" ] && [ "$(cat "$res/deepep-build.rc" 2>/dev/null)" = 0 ] && [ "$(left 100000)" -gt 45 ]; then
  timeout -s INT -k 10 "$(left 120)" python3 -m benchmarks --distributed --backend examples.clients.deepep:backend \
    --pairs DeepEPIntranodePrepareAndFinalize,DeepEPHTPrepareAndFinalize --world-size "$ws" \
    --ms "${BENCH_MS:-1,64,1024,4096}" --json "$res/bench-deepep.json" --md "$res/bench-deepep.md" >"$res/bench-deepep.log" 2>&1
  echo "== bench deepep rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 30 "$res/bench-deepep.log"
fi
} 2>&1 | tee "$res/summary.txt"
kill "${build_pid:-}" 2>/dev/null
cp /tmp/deepep/build.log "$res/deepep-build-full.log" 2>/dev/null
mkdir -p "$out"; tar czf "$out/distributed.tgz" -C "$res" . && cp "$res/summary.txt" "$out/summary.txt"
ls -la "$out"
