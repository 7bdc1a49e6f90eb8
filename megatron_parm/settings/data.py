"""The data and tokenizer flags."""

from __future__ import annotations

from typing import List

from megatron_parm.settings.flag import Flag, non_negative_int

GROUP = "data"
TOKENIZER = "tokenizer"
# Values of --tokenizer-type built here (data/tokenizers.py imports them from here).
TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPT2BPETokenizer", "BertWordPieceLowerCase",
                   "BertWordPieceCase", "HuggingFaceTokenizer")
DEFAULT_SPLIT = "969,30,1"  # Megatron-LM's where --split is not given


def flags() -> List[Flag]:
    return [
        Flag("--data-path", GROUP,
             help="Indexed dataset prefix, or 'weight prefix weight prefix ...'."),
        Flag("--split", GROUP, help=f"Comma-separated train,valid,test weights (default "
             f"{DEFAULT_SPLIT})."),
        Flag("--data-cache-path", GROUP,
             help="Where to store dataset index caches (default: next to the data)."),
        Flag("--num-workers", GROUP, help="DataLoader workers.", check=non_negative_int),
        Flag("--reset-position-ids", GROUP,
             help="GPT: restart position ids after each end-of-document token."),
        Flag("--reset-attention-mask", GROUP,
             help="GPT: do not attend across end-of-document tokens."),
        Flag("--eod-mask-loss", GROUP, help="GPT: no loss on end-of-document tokens."),
        Flag("--mask-prob", GROUP, help="BERT: probability of masking a token."),
        Flag("--short-seq-prob", GROUP,
             help="BERT: probability of a shorter-than-maximum sample."),
        Flag("--bert-no-binary-head", GROUP, help="BERT: no next-sentence-prediction pairs."),
    ]


def tokenizer_flags() -> List[Flag]:
    return [
        Flag("--tokenizer-type", TOKENIZER, supported=TOKENIZER_TYPES,
             unsupported=f"not built here: {', '.join(TOKENIZER_TYPES)} are"),
        Flag("--tokenizer-model", TOKENIZER,
             help="SentencePiece .model file (SentencePieceTokenizer) or a Hugging Face "
                  "tokenizer directory with tokenizer.json (HuggingFaceTokenizer)."),
        Flag("--vocab-file", TOKENIZER,
             help="vocab.json (GPT2BPETokenizer) or vocab.txt (BertWordPiece*)."),
        Flag("--merge-file", TOKENIZER, help="merges.txt (GPT2BPETokenizer)."),
    ]
