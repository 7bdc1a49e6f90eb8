"""Tokenize JSON lines into Megatron's indexed dataset format (.bin/.idx).

Same flags and output names as Megatron-LM's tools/preprocess_data.py:

    # GPT: one sequence per document, end-of-document token appended
    python tools/preprocess_data.py --input data/corpus.jsonl --output-prefix data/gpt \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model data/tokenizer/spm_8k.model \\
        --append-eod --workers 2
    # -> data/gpt_text_document.bin / .idx;  train with --data-path data/gpt_text_document

    # BERT: one sequence per sentence, documents kept
    python tools/preprocess_data.py --input data/corpus.jsonl --output-prefix data/bert \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model data/tokenizer/spm_8k.model \\
        --split-sentences
    # -> data/bert_text_sentence.bin / .idx;  train with --data-path data/bert_text_sentence

    # A Hugging Face tokenizer directory (DIR/tokenizer.json; eod: its eos_token)
    python tools/preprocess_data.py --input data/corpus.jsonl --output-prefix data/hf \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR --append-eod

Every tokenizer flag of the training scripts (--tokenizer-type NullTokenizer --vocab-size N
reads each text as its ids, "3 1 4"; TikTokenizer and its --tiktoken-* flags; ...).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from megatron_parm import cli  # noqa: E402
from megatron_parm.wording import plural  # noqa: E402

cli.setup_warnings()  # before Megatron-Core is imported

from megatron_parm.data.preprocess import preprocess_jsonl  # noqa: E402
from megatron_parm import settings  # noqa: E402
from megatron_parm.training.log import Progress  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="JSON-lines file, one document a line.")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="Keys to extract from each JSON line.")
    group.add_argument("--split-sentences", action="store_true",
                       help="Store each sentence as its own sequence (for BERT).")
    settings.add_flags(parser.add_argument_group("tokenizer"), settings.group("tokenizer"))
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="Writes PREFIX_{key}_document (or _sentence) .bin/.idx.")
    group.add_argument("--append-eod", action="store_true",
                       help="Append the end-of-document token to every document.")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="Tokenizer processes.")
    group.add_argument("--log-interval", type=int, default=10000,
                       help="Print progress every this many documents.")
    args = parser.parse_args(argv)
    if args.tokenizer_type is None:
        raise ValueError("--tokenizer-type is required")
    return args


def main(argv=None):
    args = parse_args(argv)
    tokenizer_args = {settings.FLAGS[name].key: getattr(args, settings.FLAGS[name].key)
                      for name in settings.group("tokenizer")}
    start = time.time()
    num_lines = count_lines(args.input)
    progress = Progress(num_lines, unit="documents")
    print(f"tokenizing {args.input} ({plural(num_lines, 'line')}) with {args.tokenizer_type}, "
          f"{plural(args.workers, 'worker')} ...", flush=True)
    prefixes = preprocess_jsonl(
        args.input, args.output_prefix, tokenizer_args, json_keys=args.json_keys,
        append_eod=args.append_eod, split=args.split_sentences, workers=args.workers,
        log_interval=args.log_interval, on_document=progress.update,
    )
    progress.clear()
    for key, prefix in prefixes.items():
        print(f"{key}: wrote {prefix}.bin and {prefix}.idx")
    print(f"done in {time.time() - start:.1f} s")


def count_lines(path: str) -> int:
    """Lines of a file (the progress bar's total), counted in 1 MiB blocks."""
    if not os.path.isfile(path):
        raise ValueError(f"--input: file not found: {path}")
    count = 0
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            count += block.count(b"\n")
    return count


if __name__ == "__main__":
    cli.run(main)
