"""The padded vocabulary size, as Megatron-LM computes it (pure Python).

Megatron-LM pads the vocabulary so every tensor-parallel shard of the embedding and the
output layer has the same size, a multiple of --make-vocab-size-divisible-by (128). The
model, checkpoint import/conversion and the layout planner all need the same number.
"""

MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128


def padded_vocab_size(vocab_size: int, tensor_parallel_size: int) -> int:
    multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tensor_parallel_size
    return -(-vocab_size // multiple) * multiple
