"""The files of a Hugging Face tokenizer directory, checked (pure Python).

--tokenizer-type HuggingFaceTokenizer takes --tokenizer-model DIR, a directory as
`save_pretrained` writes it. The tokenizer, the trainer's start-up checks and the planner
all check it here, so a mistake reads the same wherever it is found.
"""

import os
from typing import Optional

HF_TOKENIZER_FILE = "tokenizer.json"  # the whole tokenizer (the `tokenizers` library's)
HF_CONFIG_FILE = "tokenizer_config.json"  # optional: names the special tokens


def huggingface_tokenizer_file(directory: Optional[str]) -> str:
    """DIR/tokenizer.json for --tokenizer-model DIR; ValueError naming the flag when DIR is
    not given, not a directory or has no tokenizer.json."""
    if not directory:
        raise ValueError("--tokenizer-model is required with --tokenizer-type "
                         "HuggingFaceTokenizer (a Hugging Face tokenizer directory)")
    if not os.path.isdir(directory):
        raise ValueError(f"--tokenizer-model: not a directory: {directory} "
                         f"(HuggingFaceTokenizer reads DIR/{HF_TOKENIZER_FILE})")
    path = os.path.join(directory, HF_TOKENIZER_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"--tokenizer-model: no {HF_TOKENIZER_FILE} in {directory}")
    return path
