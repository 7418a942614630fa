#!/usr/bin/env bash
# Source on the GPU machine (no package index there): installs the carried wheels (.whl/, from
# ../shared/gpu/fetch-wheels.sh plus pytest-xdist/execnet) into /tmp/site and prints the environment.
#   source tools/gpu/gpu_env.sh
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PATH=/tmp/site/bin:$PATH
# the Triton JIT cache and the built vLLM ops under /tmp, which a warm machine keeps between calls: a full
# `python -m benchmarks --backend triton --peer vllm` spends about 100 s compiling and 37 s building on a fresh one
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache} XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/xdg-cache}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
