#!/usr/bin/env bash
# One device call of a GPU session: the named steps, each under its own time limit, their logs and result files
# packed into $OUT/session.tgz (the device returns at most 8 files) plus $OUT/summary.txt (every step's tail).
#   bash tools/gpu/gpu_session.sh STEP[:SECONDS] ...        (run from the repository root, .whl/ carried)
# Steps:
#   probe                  python tools/diag/mma_probe.py (the tensor cores' bf16 accumulation, seconds)
#   conformance            tools/gpu/gpu_conformance.sh over $BACKENDS (default: triton cuda deep_gemm), side by side
#   nccl                   conformance/test_distributed.py --backend torch --world-size 1 (the NCCL smoke)
#   fuzz                   python -m conformance.fuzz per backend of $BACKENDS, side by side, seed $SEED (default 0);
#                          shrunk failures go to results/regressions-<backend>.toml (copied back, merged by hand)
#   bench-BACKEND          python -m benchmarks --backend BACKEND $BENCH_ARGS (timing: run it alone on the GPU;
#                          e.g. BENCH_ARGS="--quick --peer vllm --vllm-src .vllm-src/vllm-0.33.0", the slice carried)
#   warm-BACKEND           the same run as bench-BACKEND with a token measurement (MOE_BENCH_SECONDS=0.02, no
#                          checks, no budget): compiles every kernel into the Triton cache and builds vLLM's ops under
#                          /tmp (gpu_env.sh), so that a bench-BACKEND in the next call on the warm machine times all
#                          rows within one call (a fresh machine spends about 140 s of the triton suite compiling)
#   py-NAME                python tools/diag/NAME.py $PY_ARGS (a diagnosis script; started in the background, waited for at the end)
#   triton-TOOL            python -m tools.triton.TOOL $TOOL_ARGS (in the foreground: timings run alone)
#   cuda-TOOL              python -m tools.cuda.TOOL $TOOL_ARGS (e.g. cuda-glue_check)
#   breakdown-BACKEND      python -m benchmarks.breakdown --backend BACKEND $BREAKDOWN_ARGS (per-kernel times)
#   tests-NAME             python -m pytest tests/test_NAME.py (the project's tests of one module, on the GPU)
# Example: bash tools/gpu/gpu_session.sh probe:60 conformance:450 nccl:60
set -u
here=$(pwd)
res=$here/results; mkdir -p "$res"
out=${OUT:-$res}
source tools/gpu/gpu_env.sh >"$res/env.txt" 2>&1
cat "$res/env.txt"
backends=(${BACKENDS:-triton cuda deep_gemm})
export PYTHONUNBUFFERED=1 OUT=$res
{
for spec in "$@"; do
  step=${spec%%:*}; limit=${spec#*:}; [ "$limit" = "$spec" ] && limit=300
  case $step in
    probe) TAIL=60 bash tools/gpu/gpu_step.sh probe "$limit" python3 tools/diag/mma_probe.py ;;
    conformance) bash tools/gpu/gpu_conformance.sh "$res" "$limit" "${backends[@]}" ;;
    nccl) bash tools/gpu/gpu_step.sh nccl "$limit" python3 -m pytest conformance/test_distributed.py --backend torch \
            --world-size 1 -q -p no:cacheprovider ;;
    fuzz)
      for b in "${backends[@]}"; do
        cp specs/regressions.toml "$res/regressions-$b.toml"
        TAIL=25 bash tools/gpu/gpu_step.sh "fuzz-$b" "$((limit + 40))" python3 -m conformance.fuzz --backend "$b" \
          --budget "$limit" --seed "${SEED:-0}" --regressions "$res/regressions-$b.toml" \
          --json "$res/fuzz-$b.json" &
      done
      wait ;;
    py-*) TAIL=40 bash tools/gpu/gpu_step.sh "$step" "$limit" python3 "tools/diag/${step#py-}.py" ${PY_ARGS:-} >"$res/$step.summary" 2>&1 &
          ;;
    triton-*) TAIL=60 bash tools/gpu/gpu_step.sh "$step" "$limit" python3 -m "tools.triton.${step#triton-}" \
                ${TOOL_ARGS:-} ;;
    cuda-*) TAIL=60 bash tools/gpu/gpu_step.sh "$step" "$limit" python3 -m "tools.cuda.${step#cuda-}" \
              ${TOOL_ARGS:-} ;;
    breakdown-*) TAIL=80 bash tools/gpu/gpu_step.sh "$step" "$limit" python3 -m benchmarks.breakdown \
                   --backend "${step#breakdown-}" ${BREAKDOWN_ARGS:-} ;;
    tests-*) TAIL=15 bash tools/gpu/gpu_step.sh "$step" "$limit" python3 -m pytest "tests/test_${step#tests-}.py" -q \
               -p no:cacheprovider ;;
    warm-*) TAIL=5 MOE_BENCH_SECONDS=0.02 bash tools/gpu/gpu_step.sh "$step" "$limit" python3 -m benchmarks \
              --backend "${step#warm-}" ${BENCH_ARGS:-} --no-check --budget-s 100000 --json "$res/$step.json" ;;
    bench-*) TAIL=80 bash tools/gpu/gpu_step.sh "$step" "$limit" python3 -m benchmarks --backend "${step#bench-}" \
               ${BENCH_ARGS:-} --json "$res/$step.json" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
wait  # the py- steps
cat "$res"/*.summary 2>/dev/null
} 2>&1 | tee "$res/summary.txt"
tar czf "$out/session.tgz" -C "$res" . && cp "$res/summary.txt" "$out/summary.txt" 2>/dev/null
ls -la "$out"
