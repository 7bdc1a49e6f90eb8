#!/usr/bin/env bash
# The small-grid benchmark on the emulated 2-node x 2-rank cluster, for both link classes,
# plus an unshaped run (for the communication share), then the report. Root only.
#
#   bash tools/run_small_benchmark.sh [OUT_DIR]      (default docs/bench)
#
# Link classes (inter-node bandwidth chosen so that communication is 30-70% of alltoall's
# layer time on this 2-core machine; see docs/benchmark.md):
#   pcie:   inter ${PCIE_INTER:-500mbit}, intra ${PCIE_INTRA:-1gbit}   (intra/inter 2x)
#   nvlink: inter ${NVLINK_INTER:-500mbit}, intra ${NVLINK_INTRA:-6gbit} (12x)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/bench}
PY=${PY:-.venv/bin/python}
GRID=${GRID:-configs/bench/small.yaml}
ITERS=${ITERS:-3}
DISPATCHERS=${DISPATCHERS:-alltoall,allgather,ds_baseline,parm_s1,parm_s2,parm}
mkdir -p "$OUT"

run() {  # label inter intra
    local label=$1
    rm -f "$OUT/small_$label.jsonl"
    "$PY" tools/emulate_cluster.py --nnodes 2 --nproc-per-node 2 \
        --inter-node-bandwidth "$2" --intra-node-bandwidth "$3" -- \
        "$PY" tools/bench_moe_layer.py --grid "$GRID" --iters "$ITERS" --warmup 1 --no-check \
        --dispatchers "$DISPATCHERS" --label "$label" --output "$OUT/small_$label.jsonl" \
        --parm-profile "configs/profiles/emulated_${4:-pcie}.yaml" 2>&1 | grep -v "Warning\|warnings.warn\|hostname"
}

time run unshaped none none
time run pcie "${PCIE_INTER:-500mbit}" "${PCIE_INTRA:-1gbit}" pcie
time run nvlink "${NVLINK_INTER:-500mbit}" "${NVLINK_INTRA:-6gbit}" nvlink
"$PY" tools/bench_report.py "$OUT"/small_unshaped.jsonl "$OUT"/small_pcie.jsonl "$OUT"/small_nvlink.jsonl \
    --markdown "$OUT/small_table.md" --plot "$OUT/small_speedup.png" --summary "$OUT/small_summary.json" \
    --parm-profile configs/profiles/emulated_pcie.yaml
