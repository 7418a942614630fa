#!/usr/bin/env bash
# One timed step of a GPU run, its log kept under $OUT (or results/): prints its exit code and the log's tail.
#   source tools/gpu/gpu_env.sh; bash tools/gpu/gpu_step.sh NAME SECONDS command args...
set -u
name=$1; limit=$2; shift 2
out=${OUT:-results}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
start=$(date +%s)
timeout -s INT -k 20 "$limit" "$@" >"$out/$name.log" 2>&1
rc=$?
echo "== $name: rc=$rc, $(( $(date +%s) - start )) s"
tail -n "${TAIL:-12}" "$out/$name.log"
