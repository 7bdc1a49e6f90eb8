"""The data and tokenizer flags (data/ implements them: datasets.py, loaders.py, tokenizers.py,
vocab.py)."""

from __future__ import annotations

from typing import List

from megatron_parm.settings.flag import Flag, non_negative_int, non_negative_number, positive_int

GROUP = "data"
TOKENIZER = "tokenizer"
# Values of --tokenizer-type built here (data/tokenizers.py imports them from here).
TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                   "GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase",
                   "HuggingFaceTokenizer", "TikTokenizer", "NullTokenizer")
# The --tokenizer-type values Megatron-Core builds with its SentencePiece library.
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
# Values of --dataloader-type built here (Megatron-LM's 'external' passes a dataset provider's
# own iterators through, and the scripts here build Megatron-Core's datasets).
DATALOADER_TYPES = ("single", "cyclic")
DEFAULT_SPLIT = "969, 30, 1"  # Megatron-LM's where --data-path is given without --split
TIKTOKEN_PATTERNS = ("v1", "v2")


def phase_transition_iterations(text) -> List[int]:
    """--phase-transition-iterations '1000,2000' -> [1000, 2000] (sorted, as Megatron-LM)."""
    if isinstance(text, list):
        return sorted(text)
    try:
        values = sorted(int(item.strip()) for item in str(text).split(","))
    except ValueError:
        raise ValueError(f"--phase-transition-iterations: expected comma-separated iteration "
                         f"numbers such as '1000,2000', got {text!r}") from None
    if any(value < 1 for value in values):
        raise ValueError(f"--phase-transition-iterations: iterations must be >= 1, got {text!r}")
    return values


def _check_phases(flag: str, value) -> None:
    if value is not None:
        phase_transition_iterations(value)


def _check_pattern(flag: str, value) -> None:
    if value is not None and value not in TIKTOKEN_PATTERNS:
        raise ValueError(f"{flag} must be one of {', '.join(TIKTOKEN_PATTERNS)}, got {value!r}")


def flags() -> List[Flag]:
    return [
        Flag("--data-path", GROUP,
             help="Indexed dataset prefix, 'prefix prefix ...' (weighted by size) or 'weight "
                  "prefix weight prefix ...', split by --split."),
        Flag("--split", GROUP, help=f"train, valid, test weights of --data-path (default "
             f"'{DEFAULT_SPLIT}', Megatron-LM's)."),
        Flag("--train-data-path", GROUP,
             help="The train split's own dataset(s), as --data-path (instead of it and --split)."),
        Flag("--valid-data-path", GROUP, help="The validation split's own dataset(s)."),
        Flag("--test-data-path", GROUP, help="The test split's own dataset(s)."),
        Flag("--data-args-path", GROUP,
             help="A file holding --data-path's value (for long blends)."),
        Flag("--per-split-data-args-path", GROUP,
             help="A JSON file {'train': ..., 'valid': ..., 'test': ...} holding the "
                  "--*-data-path values."),
        Flag("--per-dataset-sequences-path", GROUP,
             help="GPT: a JSON file {prefix: [sequences, documents]}; the .idx headers are "
                  "not read."),
        Flag("--mock-data", GROUP,
             help="GPT: Megatron-Core's mock dataset (no files; with any tokenizer, e.g. "
                  "NullTokenizer and --vocab-size)."),
        Flag("--phase-transition-iterations", GROUP, check=_check_phases,
             help="Iterations where a phase ends: the run saves and stops there, and the next "
                  "launch reads its data (a new --data-path) from the start."),
        Flag("--data-cache-path", GROUP,
             help="Where to store dataset index caches (default: PREFIX/cache/ next to each "
                  "dataset, as Megatron-Core)."),
        Flag("--no-mmap-bin-files", GROUP, help="Read .bin files with file reads, not mmap."),
        Flag("--encoder-seq-length", GROUP, check=positive_int,
             help="Megatron-LM's other name of --seq-length (give one of the two)."),
        Flag("--num-workers", GROUP, help="DataLoader worker processes per rank.",
             check=non_negative_int),
        Flag("--dataloader-type", GROUP, supported=DATALOADER_TYPES,
             unsupported="external passes a dataset provider's own iterators through, and the "
                         "pretraining scripts here build Megatron-Core's datasets",
             help="single: each sample once, in the dataset's order; cyclic: a random order "
                  "each epoch, repeating (default single)."),
        Flag("--reset-position-ids", GROUP,
             help="GPT: restart position ids after each end-of-document token."),
        Flag("--reset-attention-mask", GROUP,
             help="GPT: do not attend across end-of-document tokens."),
        Flag("--eod-mask-loss", GROUP, help="GPT: no loss on end-of-document tokens."),
        Flag("--no-create-attention-mask-in-dataloader", GROUP,
             help="GPT: no attention mask in the batch (the model's causal mask instead)."),
        Flag("--mid-level-dataset-surplus", GROUP, check=non_negative_number,
             help="Weighted blends: the share of extra samples built per dataset."),
        Flag("--allow-ambiguous-pad-tokens", GROUP,
             help="Mask the loss on tokens equal to the padding id even where that id is also "
                  "another special token's."),
        Flag("--make-vocab-size-divisible-by", GROUP, check=positive_int,
             help="Pad the model's vocabulary to a multiple of this x "
                  "--tensor-model-parallel-size."),
        Flag("--mask-prob", GROUP, help="BERT: probability of masking a token."),
        Flag("--short-seq-prob", GROUP,
             help="BERT: probability of a shorter-than-maximum sample."),
        Flag("--bert-no-binary-head", GROUP, help="BERT: no next-sentence-prediction pairs."),
    ]


def tokenizer_flags() -> List[Flag]:
    return [
        Flag("--tokenizer-type", TOKENIZER, supported=TOKENIZER_TYPES,
             unsupported="multimodal and SFT tokenizers belong to training this project does "
                         f"not do: {', '.join(TOKENIZER_TYPES)} are built"),
        Flag("--tokenizer-model", TOKENIZER,
             help="SentencePiece .model file (SentencePieceTokenizer, GPTSentencePieceTokenizer, "
                  "Llama2Tokenizer), a Hugging Face tokenizer directory with tokenizer.json "
                  "(HuggingFaceTokenizer) or a tiktoken vocabulary .json (TikTokenizer)."),
        Flag("--vocab-file", TOKENIZER,
             help="vocab.json (GPT2BPETokenizer) or vocab.txt (BertWordPiece*)."),
        Flag("--merge-file", TOKENIZER, help="merges.txt (GPT2BPETokenizer)."),
        Flag("--vocab-size", TOKENIZER, check=positive_int,
             help="NullTokenizer: ids 0..N-1 (end of document: N); TikTokenizer: the vocabulary "
                  "with its special tokens; the planners' vocabulary without a tokenizer. "
                  "Other tokenizers read theirs from their files."),
        Flag("--padded-vocab-size", TOKENIZER, check=positive_int,
             help="The model's vocabulary (default: the tokenizer's, padded to a multiple of "
                  "--make-vocab-size-divisible-by x --tensor-model-parallel-size)."),
        Flag("--vocab-extra-ids", TOKENIZER, check=non_negative_int,
             help="BertWordPiece*, SentencePieceTokenizer: N <extra_id_*> tokens more in the "
                  "model's vocabulary (T5's sentinels; no GPT or BERT sample uses them)."),
        Flag("--tokenizer-special-tokens", TOKENIZER,
             help="Special tokens: TikTokenizer's, a HuggingFaceTokenizer's additional ones, "
                  "SentencePiece's with --tokenizer-sentencepiece-legacy."),
        Flag("--tokenizer-sentencepiece-legacy", TOKENIZER,
             help="SentencePiece: Megatron-Core's legacy wrapper, which adds "
                  "--tokenizer-special-tokens after the model's pieces."),
        Flag("--tokenizer-hf-include-special-tokens", TOKENIZER,
             help="HuggingFaceTokenizer, BertWordPiece*: text to ids with the tokenizer's own "
                  "special tokens (its BOS / EOS, [CLS] ... [SEP])."),
        Flag("--tiktoken-pattern", TOKENIZER, check=_check_pattern,
             help="TikTokenizer: the pre-tokenizer pattern, v1 or v2 (default v2)."),
        Flag("--tiktoken-num-special-tokens", TOKENIZER, check=positive_int,
             help="TikTokenizer: ids kept for special tokens before the vocabulary's."),
        Flag("--tiktoken-special-tokens", TOKENIZER,
             help="TikTokenizer: Megatron-LM's older name of --tokenizer-special-tokens."),
    ]
