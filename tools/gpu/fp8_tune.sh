#!/usr/bin/env bash
# One device call for issue 44's FP8 per-tensor / per-channel rows: tune their tables, then the bench and the
# accumulation probe on those tables, all inside DEADLINE seconds (default 540). Run from the repository root with
# .whl/ (tools/gpu/fetch_gpu_wheels.sh) and the vLLM slice (python -m benchmarks.peer_vllm slice SDIST_OR_TREE
# .vllm-src/vllm-0.33.0, 1.3 MiB) carried:
#   bash tools/gpu/fp8_tune.sh [OUT] [VLLM_SRC]          (OUT default $OUT; VLLM_SRC: $MOE_VLLM_SRC or .vllm-src/vllm-0.33.0)
# The tuner writes into a copy of the committed tables (OUT/configs, MOE_TRITON_CONFIG_DIR for every later step);
# the tables of this GPU that changed are also copied to OUT/ as they are named in backends/triton/configs/, to be
# committed by hand. Steps, each under its own limit and never past the deadline:
#   1. env: GPU, torch, triton; the vLLM source (python -m benchmarks.peer_vllm info);
#   2. tune (decode): `tools.triton.tune --keep-entry` on Qwen3-30B fp8_channel_token (E 128, top-8, K 2048, I 768)
#      at M 1 / 8 / 64, then Mixtral TP2 fp8_tensor (E 8, top-2, K 4096, I 7168) at M 1 / 8 / 64: the sweep of
#      tune.candidates (decode: BLOCK_M 16 / 32, about 10 GEMM1 x 24 GEMM2 configs per M, each compiled once, timed
#      0.25 s), an existing entry kept unless beaten; each shape's sweep stops starting new M after TUNE_S (default
#      85) seconds;
#   3. tune --variants swap,pdl,quant_warps --repeats 2 on those decode entries (SWAP_AB on GEMM2 / GEMM1 / both:
#      about 5 variants; PDL flipped; the requantization kernel at 4 / 8 / 16 warps; about 10 timings per M);
#   4. tune --variants ws --repeats 1 on Mixtral's M = 1024 / 4096 entries (the warp-specialized Gluon kernel's
#      ping-pong / cooperative tiles, about 10 variants per M, against the committed cooperative entry; only
#      with >= 290 s left);
#   5. python -m benchmarks --backend triton --peer vllm on the two shapes at M 1 / 8 / 64 / 1024 / 4096 (the
#      step with the backend's own prepare, CUDA-graph captured; gemms; vLLM 0.33 live; step / gemms);
#   6. the accumulation probe (conformance/test_accumulation.py --backend triton, fp8_tensor and fp8_channel_token:
#      GEMM1 over K = 16384 exact on the tuned decode and prefill entries).
# Logs, the bench JSON and the tables are packed into OUT/fp8_tune.tgz; OUT/summary.txt holds every step's tail.
# Budget (H200 / H100, estimated from the candidate counts): 2: 2 x <= 130 s (85 s of sweep + the M in flight),
# 3: <= 90 s, 4: <= 70 s, 5: <= 150 s, 6: <= 70 s; each step leaves the later ones their reserve (the bench 150 s and
# the probe 70 s are never cut by the tuning; the tuner writes its table after every M, so a cut step keeps what it
# finished).
set -u
out=${1:-${OUT:-results}}; src=${2:-${MOE_VLLM_SRC:-.vllm-src/vllm-0.33.0}}
here=$(pwd); res=$here/results-fp8tune; rm -rf "$res"; mkdir -p "$res" "$out"
t0=$(date +%s); deadline=$(( t0 + ${DEADLINE:-540} ))
left() { local l=$(( deadline - $(date +%s) )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
tab=$res/configs; mkdir -p "$tab"; cp backends/triton/configs/*.json "$tab/"
export PYTHONUNBUFFERED=1 MOE_TRITON_CONFIG_DIR=$tab OUT=$res
[ -d "$src" ] && export MOE_VLLM_SRC=$(realpath "$src")
qwen=qwen3_30b_fp8_channel_token; mixtral=mixtral_tp2_fp8_tensor
step() {  # step NAME LIMIT RESERVE command...: at most LIMIT s, leaving RESERVE s for the later steps; skipped
           # when that leaves less than 20 s
  local name=$1 lim=$2 rest=$(( deadline - $(date +%s) - $3 )); shift 3
  [ "$rest" -lt "$lim" ] && lim=$rest
  if [ "$lim" -lt 20 ]; then echo "== $name: skipped ($lim s left for it before the deadline)"; return; fi
  TAIL=${TAIL:-30} bash tools/gpu/gpu_step.sh "$name" "$lim" "$@"
}
{
source tools/gpu/gpu_env.sh 2>&1
python3 -m benchmarks.peer_vllm info "${MOE_VLLM_SRC:-$src}" 2>&1 | tail -n 4
tune_s=${TUNE_S:-85}
step tune-$qwen 130 300 python3 -m tools.triton.tune --shapes $qwen --ms 1,8,64 --out "$tab" --keep-entry \
  --budget-s "$tune_s"
step tune-$mixtral 130 290 python3 -m tools.triton.tune --shapes $mixtral --ms 1,8,64 --out "$tab" --keep-entry \
  --budget-s "$tune_s"
step variants-decode 90 220 python3 -m tools.triton.tune --shapes $qwen,$mixtral --ms 1,8,64 --out "$tab" \
  --variants swap,pdl,quant_warps --repeats 2
if [ "$(left 100000)" -ge 290 ]; then
  step variants-prefill 70 220 python3 -m tools.triton.tune --shapes $mixtral --ms 1024,4096 --out "$tab" \
    --variants ws --repeats 1
else
  echo "== variants-prefill: skipped ($(left 100000) s left, 290 needed)"
fi
peer=(--peer vllm); [ -n "${MOE_VLLM_SRC:-}" ] || peer=(--peer stored)
TAIL=40 step bench 150 70 python3 -m benchmarks --backend triton "${peer[@]}" --no-gate \
  --shapes mixtral_tp2-fp8_tensor,qwen3_30b-fp8_channel_token --ms 1,8,64,1024,4096 --json "$res/bench.json"
step probe 70 0 python3 -m pytest conformance/test_accumulation.py --backend triton -k "fp8_tensor or fp8_channel_token" \
  -p no:cacheprovider -q -rfE --results-dir "$res/probe"
echo "== tables changed (MOE_TRITON_CONFIG_DIR=$tab):"
for f in "$tab"/*.json; do
  b=$(basename "$f")
  if ! cmp -s "$f" "backends/triton/configs/$b"; then echo "  $b"; cp "$f" "$out/$b"; fi
done
echo "== done in $(( $(date +%s) - t0 )) s"
} 2>&1 | tee "$res/summary.txt"
tar czf "$out/fp8_tune.tgz" -C "$res" . && cp "$res/summary.txt" "$out/summary.txt"
ls -la "$out"
