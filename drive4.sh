set -u
source tools/gpu/gpu_env.sh
export OUT=${OUT:-results}
bash tools/gpu/gpu_conformance.sh $OUT 260 triton
TAIL=30 bash tools/gpu/gpu_step.sh bench 200 python3 -m benchmarks --backend triton --peer vllm --vllm-src .vllm-src/vllm-0.33.0 --no-gate --shapes qwen3_30b-bf16,qwen3_30b-fp8_channel_token,qwen3_30b-fp8_block128 --ms 1024,4096 --json $OUT/bench.json
