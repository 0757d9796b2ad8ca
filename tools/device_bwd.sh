#!/usr/bin/env bash
# The fused backward's device session on one H200 (issue 13), from the repo root:
#   source .gpu-node/activate.sh && bash tools/device_bwd.sh
# fused_bwd (modes 1-3 bitwise vs the unfused backward, MXFP8, the core's speed), train_loop (50 steps per
# mode, whole-step CUDA graph), layer_sm90 and layer_fp8 (regression), compile (torch.compile of the
# layer), the EP > 1 backward in one launch on virtual ranks, then
# bench_layer with the fused backward rows (BWD_CHECKS: the checks to run, BWD_BENCH: bench_layer's
# extra arguments, default --mx). One process per step; logs in $OUT (or /tmp/mok-out); the summary prints last.
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out=${OUT:-/tmp/mok-out}
mkdir -p "$out"
: > "$out/summary.txt"
for c in ${BWD_CHECKS:-fused_bwd train_loop layer_sm90 layer_fp8 compile shared_gate fc1_views}; do
    timeout 300 python3 tools/gpu_check.py "$c" > "$out/check_$c.log" 2>&1  # a fresh machine JIT-compiles
    echo "gpu_check $c rc=$?" >> "$out/summary.txt"
done
# the EP > 1 backward in one launch (the default mode) on virtual ranks: vs the reference backend, bitwise
# repeats, bitwise the unfused EP backward (MOK_CUTE_FUSED_BWD=0)
CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32 MOK_CUTE_LAUNCH=dsl MOK_EP_VIRTUAL_MODES=fused \
    MOK_EP_VIRTUAL_QUICK=1 timeout -s KILL 240 python3 tools/gpu_check.py layer_ep_virtual > "$out/check_ep_bwd.log" 2>&1
echo "gpu_check layer_ep_virtual (fused EP backward) rc=$?" >> "$out/summary.txt"
timeout 300 python3 tools/bench_layer.py --shapes ${BWD_SHAPES:-0,1} --comm 16 --no-ref --tiles --bwd 0,3 ${BWD_BENCH:---mx} \
    > "$out/bench_bwd.log" 2>&1
echo "bench_layer --bwd rc=$?" >> "$out/summary.txt"
for c in ${BWD_CHECKS:-fused_bwd train_loop layer_sm90 layer_fp8 compile shared_gate fc1_views} ep_bwd; do
    grep -A40 "== gpu_check" "$out/check_$c.log" | grep -v "^\s*$\|== gpu_check\|^check \|^---" | cut -c1-200
done
grep "^|\|^\[trace" "$out/bench_bwd.log" | cut -c1-900
cat "$out/summary.txt"
