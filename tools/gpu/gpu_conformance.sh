#!/usr/bin/env bash
# Run the conformance suite of the GPU backends side by side on the GPU machine, each in its own pytest (xdist
# workers isolate crashes), writing results/conformance-<backend>.{json,md} and a log per backend to $1.
#   source tools/gpu/gpu_env.sh; bash tools/gpu/gpu_conformance.sh "$OUT" [seconds] [backends...]
# A run past its time limit is interrupted with SIGINT, so pytest still writes the results of the finished cases.
set -u
out=${1:-results}; limit=${2:-480}; shift 2 2>/dev/null || shift $#
backends=("${@:-triton cuda deep_gemm}"); backends=(${backends[*]})
mkdir -p "$out"
export PYTHONUNBUFFERED=1
for b in "${backends[@]}"; do
  timeout -s INT -k 30 "$limit" python3 -m pytest conformance --backend "$b" -p no:cacheprovider -q \
    -n "${MOE_CONFORMANCE_WORKERS:-3}" --dist worksteal --max-worker-restart 1000 --results-dir "$out" \
    -o console_output_style=count >"$out/conformance-$b.log" 2>&1 &
done
wait
for b in "${backends[@]}"; do echo "== $b"; tail -n 25 "$out/conformance-$b.log"; done
