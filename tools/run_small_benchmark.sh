#!/usr/bin/env bash
# The small-grid benchmark on the emulated 2-node x 2-rank cluster, for both link classes,
# plus an unshaped run (for the communication share), then the report. Root only.
#
#   bash tools/run_small_benchmark.sh [OUT_DIR]      (default docs/bench)
#
# Link classes: the emulator's presets (inter-node 500mbit, at which communication is 30-70%
# of alltoall's layer time on this 2-core machine; see docs/benchmark.md):
#   pcie:   inter 500mbit, intra 1gbit (intra/inter 2x)
#   nvlink: inter 500mbit, intra 6gbit (12x)
# `parm` decides with the profile calibrated for each class (shipped profiles emulated_*_measured).
# The runs are niced so that other work on the machine disturbs them less.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/bench}
PY=${PY:-.venv/bin/python}
GRID=${GRID:-configs/bench/small.yaml}
ITERS=${ITERS:-3}
DISPATCHERS=${DISPATCHERS:-alltoall,allgather,ds_baseline,parm_s1,parm_s2,parm_hier,parm}
mkdir -p "$OUT"

run() {  # label emulator-shaping-args...
    local label=$1; shift
    rm -f "$OUT/small_$label.jsonl"
    nice -n -15 "$PY" tools/emulate_cluster.py --nnodes 2 --nproc-per-node 2 "$@" -- \
        "$PY" tools/bench_moe_layer.py --grid "$GRID" --iters "$ITERS" --warmup 1 --no-check \
        --dispatchers "$DISPATCHERS" --label "$label" --output "$OUT/small_$label.jsonl" \
        --parm-profile "emulated_${label/unshaped/pcie}_measured" 2>&1 \
        | grep -v "Warning\|warnings.warn\|hostname"
}

time run unshaped --inter-node-bandwidth none --intra-node-bandwidth none
time run pcie --preset pcie
time run nvlink --preset nvlink
"$PY" tools/bench_report.py "$OUT"/small_unshaped.jsonl "$OUT"/small_pcie.jsonl "$OUT"/small_nvlink.jsonl \
    --markdown "$OUT/small_table.md" --plot "$OUT/small_speedup.png" --summary "$OUT/small_summary.json" \
    --parm-profile pcie=emulated_pcie_measured \
    --parm-profile nvlink=emulated_nvlink_measured
