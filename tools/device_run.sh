#!/usr/bin/env bash
# One batched device session on an H200 machine (1 or 2 GPUs), from the repo root:
#   source .gpu-node/activate.sh && bash tools/device_run.sh [checks...]
# Runs the device checks, the quickstart, the 2-GPU comm check (when 2 GPUs are present),
# and the expert-MLP benchmark; logs go to $OUT (or /tmp/mok-out); the summary prints last.
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out=${OUT:-/tmp/mok-out}
mkdir -p "$out"
checks=${*:-quantize gemm_sm90 gemm_fp8 layer_sm90}
timeout 330 python3 tools/gpu_check.py $checks > "$out/check.log" 2>&1
echo "gpu_check rc=$?" > "$out/summary.txt"
timeout 90 python3 examples/quickstart.py > "$out/quickstart.log" 2>&1
echo "quickstart rc=$? $(tail -1 "$out/quickstart.log")" >> "$out/summary.txt"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    MOK_COMM_QUICK=1 timeout 120 torchrun --nproc_per_node=2 tools/gpu_check.py comm > "$out/comm.log" 2>&1
    echo "comm rc=$?" >> "$out/summary.txt"
fi
timeout 260 python3 tools/bench_expert_mlp.py ${BENCH_ARGS:-} > "$out/bench.log" 2>&1
echo "bench rc=$?" >> "$out/summary.txt"
grep -A200 "== gpu_check" "$out/check.log" | grep -v "^\s*$"
[ -f "$out/comm.log" ] && grep -A40 "== gpu_check" "$out/comm.log" | head -30
tail -24 "$out/bench.log"
cat "$out/summary.txt"
