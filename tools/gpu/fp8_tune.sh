#!/usr/bin/env bash
# One device call for issue 44's FP8 per-tensor / per-channel rows: tune their tables, then the bench and the
# accumulation probe on those tables, all inside DEADLINE seconds (default 540). Run from the repository root with
# .whl/ (tools/gpu/fetch_gpu_wheels.sh) and the vLLM slice (python -m benchmarks.peer_vllm slice SDIST_OR_TREE
# .vllm-src/vllm-0.33.0, 1.5 MiB) carried:
#   bash tools/gpu/fp8_tune.sh [OUT] [VLLM_SRC]     (OUT default $OUT; VLLM_SRC: $MOE_VLLM_SRC or .vllm-src/vllm-0.33.0)
# The tuner writes into a copy of the committed tables (OUT/configs, MOE_TRITON_CONFIG_DIR for every later step;
# TABLES=DIR copies a previous call's tables over them first); the tables that changed are copied to OUT/ under
# their backends/triton/configs/ names, to be committed by hand. Steps (STEPS=tune,variants,prefill,bench,probe, the
# default, selects them), each under its own limit, none past the deadline:
#   1. env: GPU, torch, triton; the vLLM source (python -m benchmarks.peer_vllm info);
#   2. tune: `tools.triton.tune --keep-entry` on Qwen3-30B fp8_channel_token (E 128, top-8, K 2048, I 768) at
#      M 1 / 8 / 64, then Mixtral TP2 fp8_tensor (E 8, top-2, K 4096, I 7168) at M 1 / 8 / 64: the sweep of
#      tune.candidates (decode: BLOCK_M 16 (and 32 at Qwen3 M = 64), 10 GEMM1 x 24 GEMM2 configs at M <= 8, 6 x 20
#      above, each compiled once and timed 0.25 s), an existing entry kept unless beaten; a shape's sweep starts no
#      new M after TUNE_S (default 70) s;
#   3. variants: tune --variants $VARIANTS (default swap,pdl,quant_warps,amax) --repeats 2 on those decode entries (SWAP_AB on GEMM2 / GEMM1
#      / both: up to 8 variants; PDL flipped; the requantization kernel at the other two of 4 / 8 / 16 warps;
#      AMAX_EPILOGUE flipped on the per-tensor entries);
#   4. prefill: tune --variants ws --repeats 1 on Mixtral's M = 1024 / 4096 entries (the warp-specialized Gluon
#      kernel's FP8 ping-pong / cooperative tiles, 7 variants per M, against the committed cooperative entry and
#      fused_moe_kernel's gathering path); only with >= 285 s left;
#   5. bench: python -m benchmarks --backend triton --peer vllm on the two shapes at M 1 / 8 / 64 / 1024 / 4096 (the
#      step with the backend's own prepare, CUDA-graph captured; gemms; vLLM 0.33 live; step / gemms; the checks);
#   6. probe: conformance/test_accumulation.py --backend triton, fp8_tensor and fp8_channel_token (GEMM1 over
#      K = 16384 exact, on the tuned decode (M 64) and prefill (M 1024) entries).
# Logs, the bench JSON and the tables are packed into OUT/fp8_tune.tgz; OUT/summary.txt holds every step's tail.
# Budget (estimated from the candidate counts, about 2 s per new config): tune 2 x <= 115 s (70 s of sweep + the M
# in flight), variants <= 90 s, prefill <= 65 s, bench <= 150 s, probe <= 65 s; each step leaves the later ones
# their reserve (the tuning never eats the bench's 150 s nor the probe's 65 s), and the tuner writes its table after
# every M, so a cut step keeps what it finished. A call that cannot fit everything: STEPS=tune,variants first, then
# STEPS=prefill,bench,probe TABLES=<the first call's OUT>.
set -u
out=${1:-${OUT:-results}}; src=${2:-${MOE_VLLM_SRC:-.vllm-src/vllm-0.33.0}}
here=$(pwd); res=$here/results-fp8tune; rm -rf "$res"; mkdir -p "$res" "$out"
t0=$(date +%s); deadline=$(( t0 + ${DEADLINE:-540} ))
left() { local l=$(( deadline - $(date +%s) )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
tab=$res/configs; mkdir -p "$tab"; cp backends/triton/configs/*.json "$tab/"
[ -n "${TABLES:-}" ] && cp "$TABLES"/*.json "$tab/"  # a previous call's tables (its OUT/*.json) over the committed
export PYTHONUNBUFFERED=1 MOE_TRITON_CONFIG_DIR=$tab OUT=$res
[ -d "$src" ] && export MOE_VLLM_SRC=$(realpath "$src")
qwen=qwen3_30b_fp8_channel_token; mixtral=mixtral_tp2_fp8_tensor
steps=",${STEPS:-tune,variants,prefill,bench,probe},"
step() {  # step NAME LIMIT RESERVE command...: at most LIMIT s, leaving RESERVE s for the later steps; skipped
           # when that leaves less than 20 s, or when its kind (NAME up to the first dash) is not in $STEPS
  local name=$1 lim=$2 rest=$(( deadline - $(date +%s) - $3 )); shift 3
  case $steps in *",${name%%-*},"*) ;; *) echo "== $name: not in STEPS"; return ;; esac
  [ "$rest" -lt "$lim" ] && lim=$rest
  if [ "$lim" -lt 20 ]; then echo "== $name: skipped ($lim s left for it before the deadline)"; return; fi
  TAIL=${TAIL:-30} bash tools/gpu/gpu_step.sh "$name" "$lim" "$@"
}
{
source tools/gpu/gpu_env.sh 2>&1
python3 -m benchmarks.peer_vllm info "${MOE_VLLM_SRC:-$src}" 2>&1 | tail -n 4
tune_s=${TUNE_S:-70}
step tune-$qwen 115 310 python3 -m tools.triton.tune --shapes $qwen --ms 1,8,64 --out "$tab" --keep-entry \
  --budget-s "$tune_s"
step tune-$mixtral 115 300 python3 -m tools.triton.tune --shapes $mixtral --ms 1,8,64 --out "$tab" --keep-entry \
  --budget-s "$tune_s"
step variants-decode 90 215 python3 -m tools.triton.tune --shapes $qwen,$mixtral --ms 1,8,64 --out "$tab" \
  --variants "${VARIANTS:-swap,pdl,quant_warps,amax}" --repeats 2
if [ "$(left 100000)" -ge 285 ]; then
  step prefill-variants 65 215 python3 -m tools.triton.tune --shapes $mixtral --ms 1024,4096 --out "$tab" \
    --variants ws --repeats 1
else
  echo "== prefill-variants: skipped ($(left 100000) s left, 285 needed)"
fi
peer=(--peer vllm); [ -n "${MOE_VLLM_SRC:-}" ] || peer=(--peer stored)
TAIL=40 step bench 150 65 python3 -m benchmarks --backend triton "${peer[@]}" --no-gate \
  --shapes mixtral_tp2-fp8_tensor,qwen3_30b-fp8_channel_token --ms 1,8,64,1024,4096 --json "$res/bench.json"
step probe 65 0 python3 -m pytest conformance/test_accumulation.py --backend triton \
  -k "fp8_tensor or fp8_channel_token" -p no:cacheprovider -q -rfE --results-dir "$res/probe"
echo "== tables changed (MOE_TRITON_CONFIG_DIR=$tab):"
for f in "$tab"/*.json; do
  b=$(basename "$f")
  if ! cmp -s "$f" "backends/triton/configs/$b"; then echo "  $b"; cp "$f" "$out/$b"; fi
done
echo "== done in $(( $(date +%s) - t0 )) s"
} 2>&1 | tee "$res/summary.txt"
tar czf "$out/fp8_tune.tgz" -C "$res" . && cp "$res/summary.txt" "$out/summary.txt"
ls -la "$out"
