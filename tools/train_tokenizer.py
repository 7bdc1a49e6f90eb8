"""Train a SentencePiece tokenizer on JSON-lines text, for --tokenizer-type SentencePieceTokenizer.

The model reserves <pad>=0, <unk>=1, <s>=2, </s>=3 (end of document) and [CLS], [SEP],
[MASK], so one model serves both GPT and BERT pretraining.

    python tools/train_tokenizer.py --input data/corpus.jsonl --vocab-size 8000 \\
        --output-prefix data/tokenizer/spm_8k
    # writes data/tokenizer/spm_8k.model and data/tokenizer/spm_8k.vocab
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from megatron_parm import cli  # noqa: E402

cli.setup_warnings()  # before Megatron-Core is imported

from megatron_parm.data.tokenizers import train_sentencepiece  # noqa: E402


def iter_lines(paths, json_keys):
    """Yield the non-empty lines of every json_keys field of every document, in file order."""
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    document = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"--input: {path}:{line_number}: invalid JSON: {error}")
                for key in json_keys:
                    if key not in document:
                        raise ValueError(
                            f"--json-keys: {path}:{line_number} has no key {key!r}")
                    for text_line in document[key].split("\n"):
                        if text_line.strip():
                            yield text_line


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="JSON-lines file(s).")
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--output-prefix", required=True,
                        help="Writes PREFIX.model and PREFIX.vocab.")
    parser.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    parser.add_argument("--character-coverage", type=float, default=0.9999)
    parser.add_argument("--num-threads", type=int, default=4)
    args = parser.parse_args(argv)

    for path in args.input:
        if not os.path.isfile(path):
            raise ValueError(f"--input: file not found: {path}")
    model_path = train_sentencepiece(
        iter_lines(args.input, args.json_keys), args.vocab_size, args.output_prefix,
        model_type=args.model_type, character_coverage=args.character_coverage,
        num_threads=args.num_threads,
    )
    print(f"wrote {model_path} and {args.output_prefix}.vocab")


if __name__ == "__main__":
    cli.run(main)
