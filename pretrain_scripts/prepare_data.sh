#!/usr/bin/env bash
# Build the indexed datasets of the shipped corpus, if missing (offline, a few seconds):
#   data/cache/gpt_text_document.{bin,idx}   GPT: one sequence per document, EOD appended
#   data/cache/bert_text_sentence.{bin,idx}  BERT: one sequence per sentence
# Usage: pretrain_scripts/prepare_data.sh [CACHE_DIR]     (default: data/cache)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${1:-$REPO/data/cache}"
PYTHON="${PYTHON:-$( [ -x "$REPO/.venv/bin/python" ] && echo "$REPO/.venv/bin/python" || echo python3 )}"
TOKENIZER_ARGS=(--tokenizer-type SentencePieceTokenizer --tokenizer-model "$REPO/data/tokenizer/spm_8k.model")

mkdir -p "$CACHE"
if [ ! -f "$CACHE/gpt_text_document.idx" ]; then
    "$PYTHON" "$REPO/tools/preprocess_data.py" --input "$REPO/data/corpus.jsonl" \
        --output-prefix "$CACHE/gpt" "${TOKENIZER_ARGS[@]}" --append-eod
fi
if [ ! -f "$CACHE/bert_text_sentence.idx" ]; then
    "$PYTHON" "$REPO/tools/preprocess_data.py" --input "$REPO/data/corpus.jsonl" \
        --output-prefix "$CACHE/bert" "${TOKENIZER_ARGS[@]}" --split-sentences
fi
