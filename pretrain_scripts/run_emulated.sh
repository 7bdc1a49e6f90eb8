#!/usr/bin/env bash
# GPT-2 MoE (tiny) on the emulated multi-node cluster (tools/emulate_cluster.py: network
# namespaces with shaped links; root only), once per dispatcher, then tokens/s side by side.
#
#   sudo pretrain_scripts/run_emulated.sh                         # 2 nodes x 2 ranks, pcie preset
#   sudo NNODES=2 NPROC_PER_NODE=2 PRESET=nvlink DISPATCHERS="parm alltoall" \
#        pretrain_scripts/run_emulated.sh --train-iters 30
#   sudo TP=1 EP=2 PP=2 DISPATCHERS="parm alltoall" pretrain_scripts/run_emulated.sh \
#        --num-layers 4          # a pipeline stage per node: the p2p sends cross nodes
#
# Environment: NNODES, NPROC_PER_NODE (default 2, 2), PRESET (pcie|nvlink), TP, EP, PP (default
# 2, 2, 1), VPP (virtual pipeline stages per rank; default none), DISPATCHERS (default: parm
# alltoall ds_baseline), CONFIG, MODEL (gpt|bert), RUN_DIR. Extra arguments go to the training
# script. Ranks are node-major, stages outermost (Megatron's order): at PP=2 on 2 nodes each
# node holds one stage, and the pipeline's sends cross the inter-node link.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"

NNODES="${NNODES:-2}"
NPROC_PER_NODE="${NPROC_PER_NODE:-2}"
PRESET="${PRESET:-pcie}"
TP="${TP:-2}"
EP="${EP:-2}"
PP="${PP:-1}"
DISPATCHERS="${DISPATCHERS:-parm alltoall ds_baseline}"
RUN_DIR="${RUN_DIR:-runs/emulated-${MODEL}-$(date +%Y%m%d-%H%M%S)}"

pretrain_scripts/prepare_data.sh
mkdir -p "$RUN_DIR"

MODEL_ARGS=(--config "$CONFIG")
parallel_args
DATA_ARGS=(--data-path "$DATA_PATH")
CLUSTER_ARGS=(--nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" --preset "$PRESET")

for DISPATCHER in $DISPATCHERS; do
    echo "=== $DISPATCHER on $NNODES x $NPROC_PER_NODE emulated ranks ($PRESET) ==="
    MOE_ARGS=(--moe-token-dispatcher-type "$DISPATCHER")
    OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$PYTHON" tools/emulate_cluster.py "${CLUSTER_ARGS[@]}" -- \
        "$PYTHON" "$SCRIPT" "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${PARALLEL_ARGS[@]}" \
        "${DATA_ARGS[@]}" "$@" 2>&1 | tee "$RUN_DIR/$DISPATCHER.log" | grep -E "^ iteration|^>"
done

# tokens/s: mean over the logged intervals after the first (which includes warm-up).
echo
printf "%-14s %14s %22s\n" dispatcher "tokens/s" "lm loss (last log line)"
for DISPATCHER in $DISPATCHERS; do
    awk -v name="$DISPATCHER" '
        /^ iteration/ { n++; match($0, /tokens per second: [0-9.]+/);
                        t = substr($0, RSTART + 19, RLENGTH - 19); if (n > 1) { sum += t; m++ }
                        match($0, /lm loss: [0-9.E+-]+/); loss = substr($0, RSTART + 9, RLENGTH - 9) }
        END { printf "%-14s %14.1f %22s\n", name, (m ? sum / m : t), loss }' "$RUN_DIR/$DISPATCHER.log"
done | tee "$RUN_DIR/summary.txt"
