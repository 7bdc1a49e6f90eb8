# Sourced by run_local.sh and run_emulated.sh: the repo root as working directory, the Python
# to use, the training script, config and data of MODEL (gpt|bert), and parallel_args.
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
source pretrain_scripts/parallel_args.sh
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo "$REPO/.venv/bin/python" || echo python3 )}"
MODEL="${MODEL:-gpt}"
case "$MODEL" in
    gpt)  SCRIPT=pretrain_scripts/pretrain_gpt2_moe.py; CONFIG="${CONFIG:-configs/gpt2_tiny_moe.yaml}"
          DATA_PATH="data/cache/gpt_text_document" ;;
    bert) SCRIPT=pretrain_scripts/pretrain_bert_moe.py; CONFIG="${CONFIG:-configs/bert_tiny_moe.yaml}"
          DATA_PATH="data/cache/bert_text_sentence" ;;
    *) echo "MODEL must be gpt or bert, got $MODEL" >&2; exit 2 ;;
esac
