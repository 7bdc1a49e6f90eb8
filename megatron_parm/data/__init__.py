"""Tokenizers and dataset glue over Megatron-Core's datasets.

tokenizers       build_tokenizer(args) from Megatron-LM's --tokenizer-* flags, offline
tokenizer_files  a Hugging Face tokenizer directory's files, checked (pure Python)
preprocess       JSON lines -> Megatron indexed datasets (.bin/.idx), sentence splitting
datasets         GPT / BERT train-valid-test datasets from --data-path / --split, batch iterators
"""
