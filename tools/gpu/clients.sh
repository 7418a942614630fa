#!/usr/bin/env bash
# One device-session step: vLLM 0.33's own Triton fused_moe_kernel (examples/clients/vllm_triton.py, loaded from
# vLLM's source by benchmarks.peer_vllm) through the conformance suite on one GPU. Run from the repository root with
# the vLLM slice carried (python -m benchmarks.peer_vllm slice SDIST_OR_TREE .vllm-src/vllm-0.33.0, 1.5 MiB) and,
# for pytest-xdist, .whl/ (tools/gpu/fetch_gpu_wheels.sh; without it the run is serial):
#   bash tools/gpu/clients.sh OUT [VLLM_SRC]            (VLLM_SRC default: $MOE_VLLM_SRC or .vllm-src/vllm-0.33.0)
# Steps, all inside DEADLINE seconds (default 250) from the start, each under its own limit:
#   1. env: GPU, torch, triton; the vLLM source's version and the kernel file (python -m benchmarks.peer_vllm info);
#   2. conformance: --backend examples.clients.vllm_triton:backend --scheme $SCHEMES (default: bf16, fp8_block128
#      and the per-tensor / per-channel FP8 schemes), every test file: experts, padding, hygiene (graph replay,
#      repeated runs, router weight on input), regressions, the accumulation probe; $WORKERS xdist workers (default
#      4); results OUT/results/conformance-vllm_triton.{json,md} (the matrix);
#   3. the int32-offsets hygiene case (test_offsets_past_int32 carries no scheme, so --scheme deselects it), into
#      OUT/results-offsets/;
#   4. if time is left: the per-tensor / per-channel FP8 experts cases of Qwen3-30B judged under the vllm profile
#      (--numerics-profile vllm) instead of their declared fp8_inplace_accumulation, to show the verdict naming the
#      profile the output matches (OUT/results-vllm-profile/; failures expected there).
# Everything is packed into OUT/clients.tgz, plus OUT/summary.txt and the matrix OUT/conformance-vllm_triton.md.
set -u
out=${1:-results}; src=${2:-${MOE_VLLM_SRC:-.vllm-src/vllm-0.33.0}}
here=$(pwd); res=$here/results-clients; rm -rf "$res"; mkdir -p "$res" "$out"
t0=$(date +%s); deadline=$(( t0 + ${DEADLINE:-250} ))
left() { local l=$(( deadline - $(date +%s) )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
export PYTHONUNBUFFERED=1 MOE_VLLM_SRC=$(realpath "$src")
schemes=${SCHEMES:-bf16,fp8_block128,fp8_tensor,fp8_channel_token,fp8_tensor_static,fp8_tensor_token}
backend=examples.clients.vllm_triton:backend
{
source tools/gpu/gpu_env.sh 2>&1
python3 -m benchmarks.peer_vllm info "$MOE_VLLM_SRC" 2>&1
python3 -c "import examples.clients.vllm_triton as v; print('backend', v.backend.name, '|', v.backend.version, '|', \
v.backend.unavailable_reason() or 'available')"
xd=""
if python3 -c "import xdist" 2>/dev/null; then xd="-n ${WORKERS:-4} --dist worksteal --max-worker-restart 1000"; fi
echo "== conformance --scheme $schemes ${xd:-(serial: no pytest-xdist)}"
timeout -s INT -k 20 "$(left ${CONF_LIMIT:-175})" python3 -m pytest conformance --backend "$backend" \
  --scheme "$schemes" -p no:cacheprovider -q -rfE $xd --results-dir "$res/results" \
  -o console_output_style=count >"$res/conformance.log" 2>&1
echo "== conformance rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 40 "$res/conformance.log"
timeout -s INT -k 10 "$(left ${OFFSETS_LIMIT:-45})" python3 -m pytest conformance/test_hygiene.py -k offsets_past_int32 \
  --backend "$backend" -p no:cacheprovider -q -rfE --results-dir "$res/results-offsets" >"$res/offsets.log" 2>&1
echo "== offsets rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 15 "$res/offsets.log"
if [ "$(left 100000)" -gt 25 ]; then
  timeout -s INT -k 5 "$(left 40)" python3 -m pytest conformance/test_experts.py --backend "$backend" \
    --model qwen3_30b_a3b --scheme fp8_tensor,fp8_channel_token --numerics-profile vllm -p no:cacheprovider -q \
    -rfE $xd --results-dir "$res/results-vllm-profile" >"$res/vllm-profile.log" 2>&1
  echo "== fp8 per-tensor/per-channel judged under vllm rc=$? ($(( $(date +%s) - t0 )) s)"
  grep -m 3 -A 3 "numerics profile" "$res/vllm-profile.log"; tail -n 4 "$res/vllm-profile.log"
fi
} 2>&1 | tee "$res/summary.txt"
tar czf "$out/clients.tgz" -C "$res" . && cp "$res/summary.txt" "$out/summary.txt"
cp "$res/results/conformance-vllm_triton.md" "$out/" 2>/dev/null
ls -la "$out"
