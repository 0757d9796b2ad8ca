#!/usr/bin/env bash
# One batched device session on an H200 machine (2 GPUs for the comm steps), from the repo root:
#   source .gpu-node/activate.sh && bash tools/device_run.sh [checks...]
# Single-GPU checks (default: every SM90 kernel and layer check, one process each), the quickstart, the comm
# checks (EP = 1 in one process; EP = 2 through torchrun when 2 GPUs are present, plus the
# EP = 2 layer), the fused layer (stress, virtual-rank EP, bench_layer), then the benchmarks (BENCH_ARGS for bench_expert_mlp, COMM_BENCH=1 for the
# bench_comm sweep). Logs go to $OUT (or /tmp/mok-out); the summary prints last. The opt-in bulk
# transport runs as EP = 1 comm checks, one direction at a time, then both.
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out=${OUT:-/tmp/mok-out}
mkdir -p "$out"
checks=${*:-quantize gemm_sm90 gemm_fp8 gemm_fp8_scaled gemm_mxfp8_mixed route_grad local_plan mx_gather layer_sm90 layer_fp8 fused_fwd fused_bad_expert fused_bwd train_loop}
: > "$out/summary.txt"
for c in $checks; do  # one process per check: a device fault in one cannot take down the others
    timeout 420 python3 tools/gpu_check.py "$c" > "$out/check_$c.log" 2>&1
    echo "gpu_check $c rc=$?" >> "$out/summary.txt"
done
timeout 90 python3 examples/quickstart.py > "$out/quickstart.log" 2>&1
echo "quickstart rc=$? $(tail -1 "$out/quickstart.log")" >> "$out/summary.txt"
MOK_COMM_QUICK=1 timeout 60 python3 tools/gpu_check.py comm > "$out/comm1.log" 2>&1
echo "comm EP=1 rc=$?" >> "$out/summary.txt"
for tr in bulk_pull bulk_push bulk; do  # the bulk transport (EP = 1, every route local)
    MOK_COMM_TRANSPORT=$tr MOK_COMM_QUICK=1 timeout 60 python3 tools/gpu_check.py comm > "$out/comm1_$tr.log" 2>&1
    echo "comm EP=1 $tr rc=$?" >> "$out/summary.txt"
done
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    timeout 180 torchrun --nproc_per_node=2 tools/gpu_check.py comm layer_ep > "$out/comm.log" 2>&1
    echo "comm + layer_ep EP=2 rc=$?" >> "$out/summary.txt"
    if [ "${COMM_BENCH:-0}" = 1 ]; then
        timeout 120 torchrun --nproc_per_node=2 tools/bench_comm.py > "$out/bench_comm.log" 2>&1
        echo "bench_comm rc=$?" >> "$out/summary.txt"
    fi
fi
# the fused layer: stress (every launch synchronised, short device timeout), EP = 2 virtual ranks on this
# GPU with the unfused and the fused EP forward, then the layer benchmark with MXFP8 rows
timeout 150 python3 tools/fused_stress.py --comm 2,8,40 --ring 0,2,16 --reps 2 > "$out/fused_stress.log" 2>&1
echo "fused_stress rc=$?" >> "$out/summary.txt"
CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32 MOK_CUTE_LAUNCH=dsl MOK_EP_VIRTUAL_MODES=unfused,fused \
    timeout -s KILL 400 python3 tools/gpu_check.py layer_ep_virtual > "$out/check_layer_ep_virtual.log" 2>&1
echo "gpu_check layer_ep_virtual (unfused + fused EP) rc=$?" >> "$out/summary.txt"
timeout 300 python3 tools/bench_layer.py --comm 16,8 --mx --bwd 1,2,3 > "$out/bench_layer.log" 2>&1
echo "bench_layer rc=$?" >> "$out/summary.txt"
timeout 300 python3 tools/bench_expert_mlp.py ${BENCH_ARGS:-} > "$out/bench.log" 2>&1
echo "bench rc=$?" >> "$out/summary.txt"
for c in $checks layer_ep_virtual; do grep -A200 "== gpu_check" "$out/check_$c.log" | grep -v "^\s*$\|== gpu_check\|^check \|^---" | cut -c1-170; done
tail -40 "$out/fused_stress.log" | grep "^|"
grep "^|" "$out/bench_layer.log" | cut -c1-170
grep -A40 "== gpu_check" "$out/comm1.log" | cut -c1-150 | head -20
[ -f "$out/comm.log" ] && grep -A60 "== gpu_check" "$out/comm.log" | cut -c1-150 | head -40
[ -f "$out/bench_comm.log" ] && tail -40 "$out/bench_comm.log" | cut -c1-170
tail -30 "$out/bench.log" | cut -c1-180
cat "$out/summary.txt"
