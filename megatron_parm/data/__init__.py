"""Tokenizers and dataset glue over Megatron-Core's datasets.

tokenizers  build_tokenizer(args) from Megatron-LM's --tokenizer-* flags, offline
preprocess  JSON lines -> Megatron indexed datasets (.bin/.idx), sentence splitting
datasets    GPT / BERT train-valid-test datasets from --data-path / --split, batch iterators
"""
