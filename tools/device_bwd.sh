#!/usr/bin/env bash
# The fused backward's device session on one H200 (issue 13), from the repo root:
#   source .gpu-node/activate.sh && bash tools/device_bwd.sh
# fused_bwd (modes 1-3 bitwise vs the unfused backward, the core's speed), train_loop (50 steps per
# mode, whole-step CUDA graph), layer_sm90 (regression), then bench_layer with the fused backward
# rows. One process per step; logs in $OUT (or /tmp/mok-out); the summary prints last.
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out=${OUT:-/tmp/mok-out}
mkdir -p "$out"
: > "$out/summary.txt"
for c in fused_bwd train_loop layer_sm90; do
    timeout 240 python3 tools/gpu_check.py "$c" > "$out/check_$c.log" 2>&1
    echo "gpu_check $c rc=$?" >> "$out/summary.txt"
done
timeout 240 python3 tools/bench_layer.py --shapes ${BWD_SHAPES:-0,1} --comm 16 --no-ref --bwd 1,2,3 > "$out/bench_bwd.log" 2>&1
echo "bench_layer --bwd rc=$?" >> "$out/summary.txt"
for c in fused_bwd train_loop layer_sm90; do
    grep -A40 "== gpu_check" "$out/check_$c.log" | grep -v "^\s*$\|== gpu_check\|^check \|^---" | cut -c1-200
done
grep "^|" "$out/bench_bwd.log" | cut -c1-170
cat "$out/summary.txt"
