"""The model's vocabulary size, as Megatron-LM computes it (pure Python).

Megatron-LM pads the vocabulary so every tensor-parallel shard of the embedding and the
output layer has the same size: a multiple of --make-vocab-size-divisible-by (128) x
--tensor-model-parallel-size, unless --padded-vocab-size gives it. The model, checkpoint
import/conversion and the layout planner all need the same number.

    padded_vocab_size(vocab, tp, divisible_by)   the padding rule
    model_vocab_sizes(tokenizer_vocab, args, checkpoint_padded)
                                                 (vocabulary, padded vocabulary) of a run
"""

from typing import Optional, Tuple

MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128  # Megatron-LM's default of --make-vocab-size-divisible-by
# The tokenizers whose model vocabulary Megatron-LM grows by --vocab-extra-ids (its tokenizer for
# the model, megatron/training/tokenizer, appends <extra_id_0> ... for these types only).
EXTRA_IDS_TOKENIZERS = ("BertWordPieceLowerCase", "BertWordPieceCase", "SentencePieceTokenizer")


def padded_vocab_size(vocab_size: int, tensor_parallel_size: int,
                      divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY) -> int:
    multiple = divisible_by * tensor_parallel_size
    return -(-vocab_size // multiple) * multiple


def model_vocab_sizes(tokenizer_vocab_size: int, args,
                      checkpoint_padded: Optional[int] = None) -> Tuple[int, int]:
    """(the model's vocabulary, its padded size) for a run's flags: the tokenizer's vocabulary
    with --vocab-extra-ids where Megatron-LM adds them, padded by --padded-vocab-size or the
    rule above. A resumed checkpoint's padded size is kept (it depends on the TP size it was
    saved with); --padded-vocab-size must then agree with it. ValueError naming the flag."""
    tokenizer_type = getattr(args, "tokenizer_type", None)
    extra = getattr(args, "vocab_extra_ids", 0) or 0
    vocab = tokenizer_vocab_size + (extra if tokenizer_type in EXTRA_IDS_TOKENIZERS else 0)
    tp = getattr(args, "tensor_model_parallel_size", 1)
    given = getattr(args, "padded_vocab_size", None)
    if given is not None:
        if given < vocab:
            raise ValueError(f"--padded-vocab-size {given} is smaller than the vocabulary "
                             f"({vocab} tokens with --tokenizer-type {tokenizer_type})")
        if given % tp:
            raise ValueError(f"--padded-vocab-size {given} must be divisible by "
                             f"--tensor-model-parallel-size {tp}")
        if checkpoint_padded is not None and checkpoint_padded != given:
            raise ValueError(f"--padded-vocab-size {given}: the checkpoint being loaded has a "
                             f"vocabulary of {checkpoint_padded}")
        return vocab, given
    if checkpoint_padded is not None:
        return vocab, checkpoint_padded
    divisible_by = getattr(args, "make_vocab_size_divisible_by", MAKE_VOCAB_SIZE_DIVISIBLE_BY)
    return vocab, padded_vocab_size(vocab, tp, divisible_by)
