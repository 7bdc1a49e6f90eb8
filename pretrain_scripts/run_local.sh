#!/usr/bin/env bash
# GPT-2 MoE (or BERT MoE) pretraining on one node with torchrun (megatron_parm.launch: a
# user's mistake in one line, Ctrl-C or SIGTERM saves and stops); gloo on CPU, NCCL on GPUs.
#
#   pretrain_scripts/run_local.sh                                # GPT-2 MoE tiny, 4 ranks, parm
#   NPROC=4 DISPATCHER=alltoall pretrain_scripts/run_local.sh --train-iters 100
#   MODEL=bert CONFIG=configs/bert_tiny_moe.yaml pretrain_scripts/run_local.sh
#   NPROC=8 TP=2 EP=4 CONFIG=configs/gpt2_small_moe.yaml pretrain_scripts/run_local.sh
#   TP=1 EP=2 PP=2 pretrain_scripts/run_local.sh --num-layers 4    # 2 pipeline stages
#
# Environment: MODEL (gpt|bert), CONFIG, NPROC (ranks, default 4), TP, EP, PP (default 2, 2, 1),
# VPP (virtual pipeline stages per rank; default none), DISPATCHER (default parm), RUN_DIR
# (default runs/<name>-<time>), MASTER_PORT (default: a free port).
# Extra arguments are passed to the training script and override everything else.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"

NPROC="${NPROC:-4}"
TP="${TP:-2}"
EP="${EP:-2}"
PP="${PP:-1}"
DISPATCHER="${DISPATCHER:-parm}"
RUN_DIR="${RUN_DIR:-runs/${MODEL}_moe-${DISPATCHER}-$(date +%Y%m%d-%H%M%S)}"

pretrain_scripts/prepare_data.sh   # offline; skipped when the .bin/.idx exist

MODEL_ARGS=(--config "$CONFIG")
MOE_ARGS=(--moe-token-dispatcher-type "$DISPATCHER")
parallel_args
DATA_ARGS=(--data-path "$DATA_PATH")
OUTPUT_ARGS=(--save "$RUN_DIR/checkpoints" --tensorboard-dir "$RUN_DIR/tensorboard")

mkdir -p "$RUN_DIR"
echo "run folder: $RUN_DIR (log: $RUN_DIR/train.log)"
# MASTER_PORT given: torchrun's static rendezvous on it; else --standalone (a free port), so that
# a second job on the machine does not collide with the first.
RENDEZVOUS=(--standalone)
if [ -n "${MASTER_PORT:-}" ]; then
    RENDEZVOUS=(--master-addr 127.0.0.1 --master-port "$MASTER_PORT")
fi
# tee ignores Ctrl-C so that the ranks can still log while they save and stop.
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$PYTHON" -m megatron_parm.launch \
    --nproc-per-node "$NPROC" "${RENDEZVOUS[@]}" \
    "$SCRIPT" "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}" --exit-signal-handler "$@" 2>&1 | (trap '' INT; tee "$RUN_DIR/train.log")
