#!/usr/bin/env bash
# One prepared check of megatron-parm on a machine with one NVIDIA GPU, in under 8 minutes.
#
#   WHEELS=/path/to/wheels tools/gpu_check.sh OUT_DIR [--stages a,b,c,d] [--allow-cpu] [--quick]
#
# The machine needs Python 3.12 (or $PYTHON) with a CUDA build of torch, numpy, pyyaml and
# sentencepiece; no network. What it lacks (megatron-core 0.16.1 at least) comes as wheels in
# the folder $WHEELS, installed with `pip install --no-index --no-deps --target` into a
# temporary folder put first on PYTHONPATH. Download the wheels on a machine with network:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       -d WHEELS_DIR megatron-core==0.16.1
#
# Stages (tools/gpu_check.py says more): a dispatcher equivalence on 4 ranks sharing the GPU
# over gloo; b tiny GPT-2 MoE in bf16 on NCCL, 30 iterations, checkpoint saved and loaded, and
# fp16; c one MoE layer at GPT-2-small-MoE shapes, every dispatcher timed with CUDA events;
# d host synchronisations per layer call; e what each S2 chunk costs, with a profile; f the
# same with SequentialMLP and grouped experts on that layer and a larger one (hidden 2048, FFN
# 8192), kernel launches and the grouped experts' targets; g calibration on the GPU alone
# (compute, the chunk cost, the framework terms; OUT_DIR/g_profile.yaml); h today's MoE models
# in bf16; i Megatron-Core's combined 1F1B (--overlap-moe-expert-parallel-comm) with Parm's
# dispatchers on 2 ranks sharing the GPU over gloo. Writes OUT_DIR/gpu_check.log and
# OUT_DIR/summary.json.
# Exit status: 0 every stage passed, 1 some did not, 2 bad arguments or setup, 124 timed out.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
LIMIT_S=470  # the whole check, setup included, stays under 8 minutes

usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | grep '^#' | sed 's/^# \{0,1\}//'; }
die() { echo "gpu_check.sh: error: $*" >&2; exit 2; }

case "${1:-}" in
    -h|--help) usage; exit 0 ;;
    "") die "OUT_DIR is required (the folder for the log and summary.json; see --help)" ;;
    -*) die "the first argument must be OUT_DIR, got option $1" ;;
esac
OUT="$1"
shift
mkdir -p "$OUT" || die "cannot create OUT_DIR $OUT"
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/gpu_check.log"
: > "$LOG"
command -v "$PYTHON" > /dev/null 2>&1 || die "no Python at '$PYTHON' (set PYTHON=...)"

PATH_PREFIX="$REPO"
if [ -n "${WHEELS:-}" ]; then
    [ -d "$WHEELS" ] || die "WHEELS=$WHEELS is not a folder"
    shopt -s nullglob
    wheels=("$WHEELS"/*.whl)
    shopt -u nullglob
    [ "${#wheels[@]}" -gt 0 ] || die "WHEELS=$WHEELS holds no .whl file"
    SITE="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_site.XXXXXX")"
    echo "installing ${#wheels[@]} wheel(s) from $WHEELS into $SITE" | tee -a "$LOG"
    "$PYTHON" -m pip install -q --no-index --no-deps --target "$SITE" "${wheels[@]}" >> "$LOG" 2>&1 \
        || die "pip install --no-index --no-deps --target $SITE failed (see $LOG)"
    PATH_PREFIX="$SITE:$REPO"
fi
export PYTHONPATH="$PATH_PREFIX${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PYTHON" -c "import megatron.core" >> "$LOG" 2>&1; then
    die "megatron-core is not importable by $PYTHON: give WHEELS=<folder with the \
megatron_core-0.16.1 wheel for this Python> (how to download it: tools/gpu_check.sh --help, \
or the head of this script)"
fi

timeout --signal=TERM --kill-after=10 "$LIMIT_S" "$PYTHON" "$REPO/tools/gpu_check.py" --out "$OUT" "$@"
status=$?
if [ "$status" -eq 124 ]; then
    echo "gpu_check.sh: timed out after $LIMIT_S s; $OUT/summary.json holds the stages that finished" \
        | tee -a "$LOG" >&2
fi
exit "$status"
