#!/usr/bin/env bash
# The MoE-layer benchmark of docs/benchmark.md, end to end, on the emulated 2-node x 2-rank
# cluster (tools/emulate_cluster.py; root, iproute2). Run it on a quiet machine.
#
#   bash tools/run_benchmark.sh [OUT_DIR]            (default docs/bench)
#   SMOKE=1 bash tools/run_benchmark.sh /tmp/smoke   (tiny grid, minutes: proves the pipeline)
#
# Duration on this project's 2-core machine when nothing else runs, measured 2026-11-30 with
# the 8-expert half of the grid (GRID=configs/bench/emulated_8experts.yaml): 48 minutes
# (calibration 2-3 min per preset; per pass of 6 configurations ~5 min unshaped, ~8 min pcie,
# ~7 min nvlink, 0.5 min at world size 1; memory ~3 min). The whole grid took about 1.6 hours
# then; with 6 timed steps and parm:measured one pass of a preset takes 21-26 min
# (2026-12-01), so about 2.5 hours.
# PASSES=1 saves a third (and gives no run-to-run spread); the log (OUT_DIR/run.log) has each
# step's duration.
#
# Steps (each logged with its start time and duration to OUT_DIR/run.log):
#  1. recalibrate both presets' profiles (tools/calibrate.py, in-layer terms on the grid's
#     layers) into PROFILES (default: the shipped megatron_parm/perf_model/profiles/
#     emulated_{pcie,nvlink}_measured.yaml; SMOKE writes to OUT_DIR/profiles instead);
#  2. PASSES passes of the grid (configs/bench/emulated.yaml): unshaped links (compute for
#     the bound), pcie, nvlink, and world size 1 (configs/bench/world1.yaml, one rank, no
#     emulator); passes alternate their order, dispatchers run interleaved inside each, and
#     the passes' medians give the run-to-run spread;
#  3. peak memory per rank of every dispatcher on the grid (one --memory pass, unshaped);
#  4. the MTU's effect (the measurement: pcie, S=1024 B=2 M=512 F=512 E=4, (2,2,2))
#     at --mtu 1500 and at the default 65535;
#  5. the report: OUT_DIR/table.md (times, best Parm, bound, efficiency, spread; memory),
#     OUT_DIR/speedup.png (speedups over ds_baseline with the bound), OUT_DIR/summary.json
#     (per label: ratios, bounds, spreads, memory, the targets checked with their
#     margins, the model's accuracy, alltoall's compute : inter : intra per preset, and the
#     model's for GPT-2-small/medium-MoE on nvlink_ib_estimate).
# Knobs (environment): PASSES (2), ITERS (6), WORLD1_ITERS (10), CALIBRATE (1), PROFILES,
# GRID, WORLD1_GRID, MTU_CHECK (1), PY (.venv/bin/python), SMOKE (0).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/bench}
PY=${PY:-.venv/bin/python}
SMOKE=${SMOKE:-0}
if [ "$SMOKE" = 1 ]; then
    GRID=${GRID:-configs/bench/smoke.yaml}
    WORLD1_GRID=${WORLD1_GRID:-$OUT/world1_smoke.yaml}
    PASSES=${PASSES:-2}; ITERS=${ITERS:-2}; WORLD1_ITERS=${WORLD1_ITERS:-3}
    PROFILES=${PROFILES:-$OUT/profiles}
    CALIBRATE_FLAGS=(--sizes 16KiB..128KiB --reps 3 --compute-rows 64..256 --layer-tokens 64
                     --layer-hidden-size 64 --layer-ffn-hidden-size 128 --layer-num-experts 4)
    MTU_SHAPE=(--seq-length 128 --hidden-size 64 --moe-ffn-hidden-size 128)
    mkdir -p "$OUT"
    sed -e 's/tokens_per_rank: \[.*\]/tokens_per_rank: [64]/' -e 's/: 512$/: 64/' \
        configs/bench/world1.yaml > "$WORLD1_GRID"
else
    GRID=${GRID:-configs/bench/emulated.yaml}
    WORLD1_GRID=${WORLD1_GRID:-configs/bench/world1.yaml}
    PASSES=${PASSES:-2}; ITERS=${ITERS:-6}; WORLD1_ITERS=${WORLD1_ITERS:-10}
    PROFILES=${PROFILES:-megatron_parm/perf_model/profiles}
    # in-layer terms fitted on layers like the grid's
    CALIBRATE_FLAGS=(--layer-tokens 1024,4096 --layer-hidden-size 512 --layer-ffn-hidden-size 512
                     --layer-num-experts 4,8)
    MTU_SHAPE=(--seq-length 1024 --hidden-size 512 --moe-ffn-hidden-size 512)
fi
CALIBRATE=${CALIBRATE:-1}
MTU_CHECK=${MTU_CHECK:-1}
PRESETS=(pcie nvlink)
die() { echo "run_benchmark.sh: error: $*" >&2; exit 2; }
for grid in "$GRID" "$WORLD1_GRID"; do
    [ -f "$grid" ] || die "$([ "$grid" = "$GRID" ] && echo GRID || echo WORLD1_GRID)=$grid: no such file"
done
[ "$(id -u)" = 0 ] || die "the emulated cluster needs root (network namespaces): run it with sudo"
mkdir -p "$OUT" "$PROFILES"
LOG="$OUT/run.log"
export PYTHONWARNINGS=ignore
EMULATE=(nice -n -15 "$PY" tools/emulate_cluster.py --nnodes 2 --nproc-per-node 2 --timeout 7200)
LAYOUT=(--tensor-model-parallel-size 2 --expert-model-parallel-size 2 --expert-tensor-parallel-size 2)

step() {  # name command...: run, log start and duration
    local name=$1; shift
    local start=$SECONDS
    echo "[$(date -u +%H:%M:%S)] $name" | tee -a "$LOG"
    set +e
    "$@" 2>&1 | grep -v "hostname\|^\*\*\*\|OMP_NUM_THREADS" | tee -a "$LOG.detail" | grep "^\[\|^calibrate\|rror"
    local status=${PIPESTATUS[0]}
    set -e
    echo "[$(date -u +%H:%M:%S)] $name: $((SECONDS - start)) s, exit $status" | tee -a "$LOG"
    [ "$status" = 0 ] || { echo "step $name failed; see $LOG.detail" >&2; exit "$status"; }
}

profile() { echo "$PROFILES/emulated_${1}_measured.yaml"; }

links() {  # label -> emulator flags
    case $1 in
        unshaped|memory) echo "--inter-node-bandwidth none --intra-node-bandwidth none" ;;
        *) echo "--preset $1" ;;
    esac
}

bench() {  # label run extra-flags...: one pass of the grid on the emulated cluster
    local label=$1 run=$2; shift 2
    local preset=$label dispatchers=all
    [ "$label" = unshaped ] || [ "$label" = memory ] && preset=pcie
    # on the presets, parm both ways: the model alone (its profile) and measured (--parm-tune)
    [ "$preset" = "$label" ] && dispatchers=all,parm:measured
    # shellcheck disable=SC2046
    step "$label (run $run)" "${EMULATE[@]}" $(links "$label") -- \
        "$PY" tools/bench_moe_layer.py --grid "$GRID" --chunk-variants 2,4,8 --no-check \
        --dispatchers "$dispatchers" --label "$label" --run-id "$run" --output "$OUT/$label.jsonl" \
        --parm-profile "$(profile "$preset")" "$@"
}

world1() {  # run
    step "world1 (run $1)" env OMP_NUM_THREADS=2 nice -n -15 "$PY" -m torch.distributed.run \
        --nproc-per-node 1 tools/bench_moe_layer.py --grid "$WORLD1_GRID" --no-check \
        --iters "$WORLD1_ITERS" --warmup 2 --label world1 --run-id "$1" --output "$OUT/world1.jsonl"
}

: > "$LOG"
echo "run_benchmark: OUT=$OUT GRID=$GRID PASSES=$PASSES ITERS=$ITERS SMOKE=$SMOKE $(date -u)" | tee -a "$LOG"
rm -f "$OUT"/{unshaped,pcie,nvlink,world1,memory,mtu}.jsonl

# 1. calibration
if [ "$CALIBRATE" = 1 ]; then
    for preset in "${PRESETS[@]}"; do
        step "calibrate $preset" "${EMULATE[@]}" --preset "$preset" -- \
            "$PY" tools/calibrate.py "${LAYOUT[@]}" "${CALIBRATE_FLAGS[@]}" \
            --note "emulated cluster (tools/emulate_cluster.py), 2 nodes x 2 ranks, preset $preset" \
            --output "$(profile "$preset")"
    done
fi

# 2. the grid, PASSES times, alternating the order
for run in $(seq 1 "$PASSES"); do
    if [ $((run % 2)) = 1 ]; then order=(unshaped pcie nvlink); else order=(nvlink pcie unshaped); fi
    for label in "${order[@]}"; do
        bench "$label" "$run" --iters "$ITERS" --warmup 1
    done
    world1 "$run"
done

# 3. memory
bench memory 1 --memory

# 4. the MTU's effect
if [ "$MTU_CHECK" = 1 ]; then
    for mtu in 1500 65535; do
        step "mtu $mtu" "${EMULATE[@]}" --preset pcie --mtu "$mtu" -- \
            "$PY" tools/bench_moe_layer.py "${LAYOUT[@]}" --sequence-parallel "${MTU_SHAPE[@]}" \
            --micro-batch-size 2 --num-experts 4 --dispatchers alltoall,parm_s1,parm_s2 --no-check \
            --iters 3 --warmup 1 --label "mtu$mtu" --output "$OUT/mtu.jsonl"
    done
fi

# 5. the report
inputs=("$OUT"/unshaped.jsonl "$OUT"/pcie.jsonl "$OUT"/nvlink.jsonl "$OUT"/world1.jsonl "$OUT"/memory.jsonl)
[ -f "$OUT/mtu.jsonl" ] && inputs+=("$OUT/mtu.jsonl")
step report "$PY" tools/bench_report.py "${inputs[@]}" \
    --markdown "$OUT/table.md" --plot "$OUT/speedup.png" --summary "$OUT/summary.json" \
    --parm-profile "pcie=$(profile pcie)" --parm-profile "nvlink=$(profile nvlink)" \
    --model-config configs/gpt2_small_moe.yaml --model-config configs/gpt2_medium_moe.yaml \
    --model-profile nvlink_ib_estimate
echo "run_benchmark: done in $SECONDS s; $OUT/table.md, $OUT/speedup.png, $OUT/summary.json" | tee -a "$LOG"
