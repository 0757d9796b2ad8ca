#!/usr/bin/env bash
# The fused forward's device session on one H200 (issue 12), from the repo root, one device call per step
# (each fits the 10-minute limit):
#   source .gpu-node/activate.sh && bash tools/device_fwd.sh check    # then: ... bash tools/device_fwd.sh bench
# check: fused_fwd (the default, direct, MXFP8 and helper-warp rows), tails (H, I not multiples of 256: the n_tail
# variants, the helper warps' masked columns at gpt-oss's H 2880). bench: bench_layer (FWD_BENCH: its arguments).
# helpers: the helper warps at the cap, H 7168 and I 1024 shapes, beside the staged gather (three helper warps) and
# without helpers (HELPERS_SHAPES: energy_fwd's --shapes).
# bulk: the opt-in bulk background gather (MOK_CUTE_BG_BULK=1): its gpu_check rows, then at the cap beside the
# default (BULK_SHAPES: energy_fwd's --shapes), then one traced forward each, with and without, per shape of
# BULK_TRACE_SHAPES (bench_layer's shape numbers, default 1: T8192 H4096 I1024; BULK=0 skips the check and the A/B).
# rates: the four GEMMs alone as SM-us per tile (tools/tile_rates.py, RATES_SHAPES), beside the traces' tiles.
# ratios: the BF16 forward against the torch layer at the cap in REPEAT interleaved rounds (RATIO_SHAPES, default the
# H 7168 shapes 3,0,4), each row's median and its per-round ratios. fwdbwd: forward + backward at the cap, BF16 and
# MXFP8 (FWDBWD_SHAPES, default 0,1).
# Logs in $OUT (or /tmp/mok-out); the summary prints last.
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out=${OUT:-/tmp/mok-out}
mkdir -p "$out"
: > "$out/summary.txt"
for step in ${*:-check}; do
    if [ "$step" = check ]; then
        for c in fused_fwd tails; do
            timeout -s KILL 400 python3 tools/gpu_check.py $c > "$out/check_$c.log" 2>&1
            echo "gpu_check $c rc=$?" >> "$out/summary.txt"
            grep -A40 "== gpu_check" "$out/check_$c.log" | grep -v "^\s*$\|== gpu_check\|^check \|^---" | cut -c1-200
        done
    elif [ "$step" = helpers ]; then
        timeout -s KILL 560 python3 tools/energy_fwd.py --shapes ${HELPERS_SHAPES:-1,3,0} --gathers default,staged \
            --env MOK_CUTE_FUSED_HELPERS=0 --seconds 1.0 > "$out/helpers.log" 2>&1
        echo "energy_fwd helpers rc=$?" >> "$out/summary.txt"
        grep "^|" "$out/helpers.log" | cut -c1-300
    elif [ "$step" = bulk ]; then
        if [ "${BULK:-1}" = 1 ]; then
            MOK_FUSED_FWD_BULK_ONLY=1 timeout -s KILL 120 python3 tools/gpu_check.py fused_fwd > "$out/check_bulk.log" 2>&1
            echo "gpu_check fused_fwd bulk rows rc=$?" >> "$out/summary.txt"
            grep "bulk bg" "$out/check_bulk.log" | cut -c1-200
            timeout -s KILL 260 python3 tools/energy_fwd.py --shapes ${BULK_SHAPES:-1,2,0} --env MOK_CUTE_BG_BULK=1 \
                --seconds 1.0 > "$out/bulk.log" 2>&1
            echo "energy_fwd bulk rc=$?" >> "$out/summary.txt"
            grep "^|" "$out/bulk.log" | cut -c1-300
        fi
        for sh in ${BULK_TRACE_SHAPES:-1}; do
            for v in 0 1; do
                MOK_CUTE_BG_BULK=$v timeout -s KILL 100 python3 tools/bench_layer.py --shapes $sh --comm 16 --no-ref \
                    --rounds 1 --trace "$out/trace_s${sh}_bulk$v.json" > "$out/trace_s${sh}_bulk$v.log" 2>&1
                echo "trace shape $sh MOK_CUTE_BG_BULK=$v rc=$?" >> "$out/summary.txt"
                grep "^\[trace" "$out/trace_s${sh}_bulk$v.log" | cut -c1-700
            done
        done
    elif [ "$step" = rates ]; then
        timeout -s KILL 150 python3 tools/tile_rates.py --shapes ${RATES_SHAPES:-0,1} > "$out/rates.log" 2>&1
        echo "tile_rates rc=$?" >> "$out/summary.txt"
        grep "^|" "$out/rates.log" | cut -c1-200
    elif [ "$step" = ratios ]; then
        timeout -s KILL 330 python3 tools/energy_fwd.py --shapes ${RATIO_SHAPES:-3,0,4} --repeat ${REPEAT:-3} \
            --seconds 1.0 > "$out/ratios.log" 2>&1
        echo "energy_fwd ratios rc=$?" >> "$out/summary.txt"
        grep "^|" "$out/ratios.log" | cut -c1-300
    elif [ "$step" = fwdbwd ]; then
        timeout -s KILL 400 python3 tools/energy_fwd.py --shapes ${FWDBWD_SHAPES:-0,1} --mx --bwd --seconds 1.0 \
            > "$out/fwdbwd.log" 2>&1
        echo "energy_fwd fwd+bwd rc=$?" >> "$out/summary.txt"
        grep "^|" "$out/fwdbwd.log" | cut -c1-300
    elif [ "$step" = bench ]; then
        timeout -s KILL 560 python3 tools/bench_layer.py ${FWD_BENCH:---shapes 0,3 --comm 16 --no-ref --tiles --mx --rounds 3 --trace "$out/trace.json"} \
            > "$out/bench_fwd.log" 2>&1
        echo "bench_layer rc=$?" >> "$out/summary.txt"
        grep "^|\|^\[trace\|^\[power" "$out/bench_fwd.log" | cut -c1-700
    fi
done
cat "$out/summary.txt"
