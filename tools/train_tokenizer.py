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
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from megatron_parm import cli  # noqa: E402
from megatron_parm.wording import plural  # noqa: E402

cli.setup_warnings()  # before Megatron-Core is imported

from megatron_parm.data.tokenizers import train_sentencepiece  # noqa: E402
from megatron_parm.training.log import Progress  # noqa: E402


def iter_lines(paths, json_keys, on_bytes=None):
    """Yield the non-empty lines of every json_keys field of every document, in file order;
    on_bytes(n) is called with the size of each JSON line read."""
    for path in paths:
        with open(path, "rb") as handle:
            for line_number, raw in enumerate(handle, start=1):
                if on_bytes is not None:
                    on_bytes(len(raw))
                if not raw.strip():
                    continue
                try:
                    document = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as error:
                    raise ValueError(f"--input: {path}:{line_number}: invalid JSON: {error}")
                for key in json_keys:
                    if key not in document:
                        raise ValueError(
                            f"--json-keys: {path}:{line_number} has no key {key!r}")
                    for text_line in document[key].split("\n"):
                        if text_line.strip():
                            yield text_line


def reading(paths, json_keys):
    """iter_lines with a progress bar over the input bytes (on a terminal) and a line when the
    input has been read: SentencePiece reads all of it before it trains."""
    total = sum(os.path.getsize(path) for path in paths)
    progress = Progress(total, unit="bytes")
    done = {"bytes": 0, "lines": 0}

    def on_bytes(size):
        done["bytes"] += size
        progress.update(done["bytes"])

    start = time.time()
    print(f"reading {', '.join(paths)} ({total / 2**20:.1f} MiB) ...", flush=True)
    for line in iter_lines(paths, json_keys, on_bytes):
        done["lines"] += 1
        yield line
    progress.clear()
    print(f"  read {plural(done['lines'], 'line')} in {time.time() - start:.1f} s", flush=True)


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
    training = {}

    def lines_then_training():
        yield from reading(args.input, args.json_keys)
        print(f"training a SentencePiece {args.model_type} model, vocabulary {args.vocab_size} "
              f"...", flush=True)
        training["start"] = time.time()

    model_path = train_sentencepiece(
        lines_then_training(), args.vocab_size, args.output_prefix,
        model_type=args.model_type, character_coverage=args.character_coverage,
        num_threads=args.num_threads,
    )
    print(f"  done in {time.time() - training['start']:.1f} s", flush=True)
    print(f"wrote {model_path} and {args.output_prefix}.vocab")


if __name__ == "__main__":
    cli.run(main)
