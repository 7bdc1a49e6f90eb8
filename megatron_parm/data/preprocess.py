"""JSON lines -> Megatron indexed dataset (.bin/.idx), the logic behind tools/preprocess_data.py.

Output names follow Megatron-LM's preprocess_data.py: for each json key K the dataset is
{output_prefix}_{K}_document, or {output_prefix}_{K}_sentence with --split-sentences. Each
document is one IndexedDataset document; with --split-sentences each of its sentences is a
separate sequence, the layout Megatron-Core's BERT dataset expects.
"""

import json
import multiprocessing
import os
import re
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy

from megatron.core.datasets.indexed_dataset import (
    DType,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)

from megatron_parm.data.tokenizers import build_tokenizer

# Words that end with a period without ending a sentence (compared lower-cased, sans period).
_ABBREVIATIONS = frozenset(
    "e.g i.e etc vs cf al approx ca fig figs eq eqs no nos vol pp ch sec ref refs resp "
    "mr mrs ms dr prof sr jr st inc ltd co corp jan feb mar apr jun jul aug sep sept oct "
    "nov dec u.s u.k".split()
)
# Sentence-final punctuation, optional closing quotes/brackets, then whitespace.
_SENTENCE_END = re.compile(r"[.!?]+[\"')\]]*\s+")
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


def split_sentences(text: str) -> List[str]:
    """Split English text into sentences, offline and without models.

    Paragraphs (blank-line separated) always end a sentence. Inside a paragraph, a sentence
    ends at . ! or ? (plus closing quotes or brackets) followed by whitespace and then an
    upper-case letter, digit, quote or bracket, unless the period closes a known
    abbreviation or a single-letter initial. Whitespace inside a sentence is collapsed.
    """
    sentences = []
    for paragraph in _PARAGRAPH_BREAK.split(text):
        paragraph = " ".join(paragraph.split())
        start = 0
        for match in _SENTENCE_END.finditer(paragraph):
            end = match.end()
            if end >= len(paragraph):
                break
            following = paragraph[end]
            if not (following.isupper() or following.isdigit() or following in "\"'([`"):
                continue
            words_before = paragraph[start:match.start()].split()
            last_word = words_before[-1].lower().strip("\"'([") if words_before else ""
            if match.group().startswith(".") and (
                    last_word in _ABBREVIATIONS or (len(last_word) == 1 and last_word.isalpha())):
                continue
            sentences.append(paragraph[start:end].strip())
            start = end
        tail = paragraph[start:].strip()
        if tail:
            sentences.append(tail)
    return sentences


class _Encoder:
    """Per-process tokenizer state; the pool builds one in each worker."""

    tokenizer = None

    def __init__(self, tokenizer_args: Dict, json_keys: Sequence[str], split: bool,
                 append_eod: bool) -> None:
        self.tokenizer_args = tokenizer_args
        self.json_keys = list(json_keys)
        self.split = split
        self.append_eod = append_eod

    def initializer(self) -> None:
        _Encoder.tokenizer = build_tokenizer(_Namespace(self.tokenizer_args))

    def encode(self, numbered_line: Tuple[int, str]) -> Dict[str, List[List[int]]]:
        """Return {key: [sentence token ids, ...]} for one JSON line."""
        line_number, line = numbered_line
        document = json.loads(line)
        encoded = {}
        for key in self.json_keys:
            if key not in document:
                raise ValueError(f"--json-keys: line {line_number} has no key {key!r}")
            text = document[key]
            pieces = split_sentences(text) if self.split else [text]
            sentences = [ids for ids in map(_Encoder.tokenizer.tokenize, pieces) if ids]
            if sentences and self.append_eod:
                sentences[-1] = list(sentences[-1]) + [_Encoder.tokenizer.eod]
            encoded[key] = sentences
        return encoded


class _Namespace:
    def __init__(self, values: Dict) -> None:
        self.__dict__.update(values)


def _numbered_lines(path: str) -> Iterator[Tuple[int, str]]:
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if line.strip():
                yield line_number, line


def output_prefix_for(output_prefix: str, key: str, split_sentences_: bool) -> str:
    level = "sentence" if split_sentences_ else "document"
    return f"{output_prefix}_{key}_{level}"


def preprocess_jsonl(input_path: str, output_prefix: str, tokenizer_args: Dict,
                     json_keys: Sequence[str] = ("text",), append_eod: bool = False,
                     split: bool = False, workers: int = 1,
                     log_interval: Optional[int] = None,
                     on_document: Optional[Callable[[int], None]] = None) -> Dict[str, str]:
    """Tokenize a JSON-lines file into one indexed dataset per json key.

    tokenizer_args: the tokenizer flags as a dict (tokenizer_type, tokenizer_model, ...).
    Returns {key: dataset prefix}. Documents that tokenize to nothing are skipped.
    on_document(n) is called after each document with the number done (a progress bar).
    """
    if not os.path.isfile(input_path):
        raise ValueError(f"--input: file not found: {input_path}")
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    output_dir = os.path.dirname(os.path.abspath(output_prefix))
    if not os.path.isdir(output_dir):
        raise ValueError(f"--output-prefix: directory does not exist: {output_dir}")

    encoder = _Encoder(tokenizer_args, json_keys, split, append_eod)
    encoder.initializer()  # also validates the tokenizer flags before any worker starts
    dtype = DType.optimal_dtype(_Encoder.tokenizer.vocab_size)

    prefixes = {key: output_prefix_for(output_prefix, key, split) for key in json_keys}
    builders = {key: IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
                for key, prefix in prefixes.items()}

    if workers == 1:
        results = map(encoder.encode, _numbered_lines(input_path))
        pool = None
    else:
        pool = multiprocessing.get_context("spawn").Pool(workers, initializer=encoder.initializer)
        results = pool.imap(encoder.encode, _numbered_lines(input_path), chunksize=32)
    try:
        num_documents = 0
        for encoded in results:
            for key, sentences in encoded.items():
                if not sentences:
                    continue
                tokens = numpy.concatenate([numpy.asarray(s, dtype=numpy.int64)
                                            for s in sentences])
                # add_document takes any array-like; numpy avoids a torch.__array__ detour.
                builders[key].add_document(tokens, [len(s) for s in sentences])
            num_documents += 1
            if on_document is not None:
                on_document(num_documents)
            if log_interval and num_documents % log_interval == 0:
                print(f"processed {num_documents} documents", flush=True)
    finally:
        if pool is not None:
            pool.close()
            pool.join()

    for key, prefix in prefixes.items():
        builders[key].finalize(get_idx_path(prefix))
    return prefixes
