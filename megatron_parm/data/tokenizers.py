"""Tokenizers built from Megatron-LM's flags, usable offline.

    --tokenizer-type SentencePieceTokenizer  --tokenizer-model M.model
                     GPTSentencePieceTokenizer, Llama2Tokenizer: the same (Megatron-Core builds
                     all three with its SentencePiece library)
    --tokenizer-type GPT2BPETokenizer        --vocab-file vocab.json --merge-file merges.txt
    --tokenizer-type BertWordPieceLowerCase  --vocab-file vocab.txt
    --tokenizer-type BertWordPieceCase       --vocab-file vocab.txt
    --tokenizer-type HuggingFaceTokenizer    --tokenizer-model DIR   (DIR/tokenizer.json)
    --tokenizer-type TikTokenizer            --tokenizer-model V.json (tiktoken's vocabulary)
    --tokenizer-type NullTokenizer           --vocab-size N  (text "3 1 4" is ids; EOD is N)

Every type returns a `ParmTokenizer`, a megatron-core `MegatronTokenizerText`, so it has
the interface Megatron-Core's datasets and Megatron-LM's training code expect: tokenize,
detokenize, vocab_size, vocab, inv_vocab, eod, and (for BERT) cls, sep, mask, pad.

SentencePiece runs through megatron-core's own SentencePiece library class. Megatron-Core
routes GPT-2 BPE and BERT WordPiece through HuggingFace `transformers` and downloads
missing vocabularies, so for those two we carry short local implementations that only read
the files given on the command line. HuggingFaceTokenizer reads a local directory with the
`tokenizers` library alone (Megatron-Core's own HuggingFaceTokenizer needs `transformers`).
TikTokenizer and NullTokenizer are Megatron-Core's own library classes (TikTokenizer needs the
`tiktoken` package; nothing is downloaded).

SentencePiece special tokens: Megatron-LM's legacy SentencePiece tokenizer appends
<CLS>, <SEP>, ... after the model's vocabulary. Here they live inside the model instead:
`train_sentencepiece` reserves <pad>=0 (BERT datasets assume padding id 0), <unk>=1, <s>=2,
</s>=3 (the end-of-document token) and the control symbols [CLS], [SEP], [MASK].
"""

import json
import os
import re
import unicodedata
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional

from megatron.core.tokenizers.text.libraries.abstract_tokenizer import (
    MegatronTokenizerTextAbstract,
)
from megatron.core.tokenizers.text.libraries.sentencepiece_tokenizer import (
    SentencePieceTokenizer as _MegatronSentencePieceLibrary,
)
from megatron.core.tokenizers.text.text_tokenizer import MegatronTokenizerText

from megatron_parm.data.tokenizer_files import HF_CONFIG_FILE, huggingface_tokenizer_file
from megatron_parm.settings.data import (  # values of --tokenizer-type
    SENTENCEPIECE_TYPES, TOKENIZER_TYPES)

# Pieces that train_sentencepiece reserves; ids are fixed so every model built here agrees.
SPM_PAD, SPM_UNK, SPM_BOS, SPM_EOS = "<pad>", "<unk>", "<s>", "</s>"
SPM_CLS, SPM_SEP, SPM_MASK = "[CLS]", "[SEP]", "[MASK]"

GPT2_EOD = "<|endoftext|>"
BERT_CLS, BERT_SEP, BERT_MASK, BERT_PAD, BERT_UNK = "[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]"

# tokenizer_config.json's names of the special tokens HuggingFaceLibrary reads.
HF_SPECIAL_TOKENS = ("eos_token", "bos_token", "pad_token", "unk_token", "cls_token",
                     "sep_token", "mask_token")
# The end of a document when tokenizer_config.json names no eos_token (GPT-2, Llama, ChatML).
HF_END_TOKENS = ("<|endoftext|>", "</s>", "<|im_end|>")


# ---------------------------------------------------------------------------------------------
# Flags and the factory
# ---------------------------------------------------------------------------------------------

# The special tokens Megatron-Core's TikTokenizer requires among its own.
TIKTOKEN_REQUIRED = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")


def _require_file(flag: str, path: Optional[str], tokenizer_type: str) -> str:
    if not path:
        raise ValueError(f"{flag} is required with --tokenizer-type {tokenizer_type}")
    if not os.path.isfile(path):
        raise ValueError(f"{flag}: file not found: {path}")
    return path


def special_tokens_of(args) -> List[str]:
    """--tokenizer-special-tokens, or its older name --tiktoken-special-tokens."""
    return list(getattr(args, "tokenizer_special_tokens", None)
                or getattr(args, "tiktoken_special_tokens", None) or [])


def check_tokenizer_flags(args) -> None:
    """The tokenizer flags that go together, before anything is read (ValueError naming the
    flag): Megatron-LM's rules, and what the tokenizers here take."""
    tokenizer_type = getattr(args, "tokenizer_type", None)
    special = special_tokens_of(args)
    if tokenizer_type == "NullTokenizer" and not getattr(args, "vocab_size", None):
        raise ValueError("--vocab-size is required with --tokenizer-type NullTokenizer")
    if not special:
        return
    if tokenizer_type in SENTENCEPIECE_TYPES and not getattr(
            args, "tokenizer_sentencepiece_legacy", False):
        raise ValueError(f"--tokenizer-special-tokens: --tokenizer-type {tokenizer_type} takes "
                         f"them with --tokenizer-sentencepiece-legacy only (Megatron-Core's "
                         f"rule: otherwise they belong in the SentencePiece model)")
    if tokenizer_type in ("GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase",
                          "NullTokenizer"):
        where = ("its ids are numbers" if tokenizer_type == "NullTokenizer"
                 else "here it reads its tokens from --vocab-file: add them there")
        raise ValueError(f"--tokenizer-special-tokens: not taken by --tokenizer-type "
                         f"{tokenizer_type} ({where})")
    if tokenizer_type == "TikTokenizer":
        missing = [token for token in TIKTOKEN_REQUIRED if token not in special]
        if missing:
            raise ValueError(f"--tokenizer-special-tokens: TikTokenizer's must include "
                             f"{', '.join(TIKTOKEN_REQUIRED)} (missing {', '.join(missing)})")


def build_tokenizer(args) -> "ParmTokenizer":
    """Build the tokenizer named by args.tokenizer_type from local files.

    args: any object with tokenizer_type and, as needed, the other tokenizer flags'
    attributes (an argparse.Namespace of them, for instance; a missing one is its default).
    """
    check_tokenizer_flags(args)
    tokenizer_type = getattr(args, "tokenizer_type", None)
    tokenizer_model = getattr(args, "tokenizer_model", None)
    vocab_file = getattr(args, "vocab_file", None)
    merge_file = getattr(args, "merge_file", None)
    special = special_tokens_of(args)
    include_special = bool(getattr(args, "tokenizer_hf_include_special_tokens", False))

    if tokenizer_type in SENTENCEPIECE_TYPES:
        path = _require_file("--tokenizer-model", tokenizer_model, tokenizer_type)
        legacy = bool(getattr(args, "tokenizer_sentencepiece_legacy", False))
        library = _SentencePieceLibrary(path, legacy=legacy, special_tokens=special or None)
        variant = {"legacy": " ".join(["legacy", *special])} if legacy else {}
        return ParmTokenizer(library, tokenizer_type, path, library_name="sentencepiece",
                             **variant)
    if tokenizer_type == "GPT2BPETokenizer":
        vocab_path = _require_file("--vocab-file", vocab_file, tokenizer_type)
        merge_path = _require_file("--merge-file", merge_file, tokenizer_type)
        library = GPT2BPELibrary(vocab_path, merge_path)
        return ParmTokenizer(library, tokenizer_type, vocab_path, library_name="gpt2-bpe",
                             vocab_file=vocab_path, merges_file=merge_path)
    if tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        vocab_path = _require_file("--vocab-file", vocab_file, tokenizer_type)
        library = WordPieceLibrary(vocab_path, lower_case=tokenizer_type.endswith("LowerCase"),
                                   include_special_tokens=include_special)
        return ParmTokenizer(library, tokenizer_type, vocab_path, library_name="wordpiece",
                             vocab_file=vocab_path,
                             **({"include_special_tokens": "True"} if include_special else {}))
    if tokenizer_type == "HuggingFaceTokenizer":
        library = HuggingFaceLibrary(tokenizer_model, special, include_special)
        variant = {"special_tokens": " ".join(special)} if special else {}
        if include_special:
            variant["include_special_tokens"] = "True"
        return ParmTokenizer(library, tokenizer_type, tokenizer_model, library_name="tokenizers",
                             **variant)
    if tokenizer_type == "TikTokenizer":
        path = _require_file("--tokenizer-model", tokenizer_model, tokenizer_type)
        library = _tiktoken_library(path, args, special)
        return ParmTokenizer(library, tokenizer_type, path, library_name="tiktoken",
                             vocab_size=str(library.vocab_size),
                             pattern=getattr(args, "tiktoken_pattern", None) or "v2",
                             special_tokens=" ".join(library.special_tokens[:len(special)]))
    if tokenizer_type == "NullTokenizer":
        from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

        vocab_size = args.vocab_size
        return ParmTokenizer(NullTokenizer(vocab_size), tokenizer_type, None, library_name="null",
                             vocab_size=str(vocab_size))
    raise ValueError(
        f"--tokenizer-type: unsupported value {tokenizer_type!r}; choose one of "
        f"{', '.join(TOKENIZER_TYPES)}"
    )


def _tiktoken_library(path: str, args, special: List[str]):
    """Megatron-Core's TikTokenizer over a local vocabulary file (a JSON list of {rank,
    token_bytes, token_str}), its flags checked first: its own checks are bare asserts."""
    try:
        import tiktoken  # noqa: F401 (Megatron-Core's class needs it)
    except ImportError:
        raise ValueError("--tokenizer-type TikTokenizer needs the 'tiktoken' package "
                         "(pip install tiktoken)") from None
    from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import (
        DEFAULT_TIKTOKEN_MAX_VOCAB, TikTokenTokenizer)

    num_special = getattr(args, "tiktoken_num_special_tokens", 1000)
    vocab_size = getattr(args, "vocab_size", None) or DEFAULT_TIKTOKEN_MAX_VOCAB
    if not path.endswith(".json"):
        raise ValueError(f"--tokenizer-model: TikTokenizer reads a .json vocabulary, got {path}")
    with open(path, encoding="utf-8") as handle:
        try:
            entries = json.load(handle)
        except json.JSONDecodeError as error:
            raise ValueError(f"--tokenizer-model: {path} is not JSON: {error}") from None
    if not isinstance(entries, list):
        raise ValueError(f"--tokenizer-model: {path} is not a tiktoken vocabulary (a JSON list "
                         f"of rank, token_bytes, token_str)")
    if len(special or TIKTOKEN_REQUIRED) > num_special or num_special >= vocab_size:
        raise ValueError(f"--tiktoken-num-special-tokens {num_special} must hold the special "
                         f"tokens ({len(special or TIKTOKEN_REQUIRED)}) and be below --vocab-size "
                         f"{vocab_size}")
    if len(entries) < vocab_size - num_special:
        raise ValueError(f"--vocab-size {vocab_size} needs {vocab_size - num_special} entries "
                         f"in --tokenizer-model {path} after --tiktoken-num-special-tokens "
                         f"{num_special}; it has {len(entries)} (give a smaller --vocab-size)")
    try:
        return TikTokenTokenizer(path, special_tokens=special or None,
                                 num_special_tokens=num_special,
                                 pattern=getattr(args, "tiktoken_pattern", None) or "v2",
                                 vocab_size=vocab_size)
    except (AssertionError, KeyError, TypeError, ValueError) as error:
        raise ValueError(f"--tokenizer-model: {path} is not a tiktoken vocabulary Megatron-Core "
                         f"reads ({type(error).__name__}: {error})") from None


class ParmTokenizer(MegatronTokenizerText):
    """Megatron-Core's text tokenizer around one of the library objects below.

    MegatronTokenizerText picks its library object from a fixed table; this subclass hands
    it one that is already built, so the local GPT-2 BPE and WordPiece fit in too.
    """

    def __init__(self, library: MegatronTokenizerTextAbstract, tokenizer_type: str, path: str,
                 library_name: str, **file_kwargs: str) -> None:
        self._prebuilt_library = library
        self.tokenizer_type = tokenizer_type
        # file_kwargs (vocab_file, merges_file) land in additional_args, hence in
        # unique_identifiers, so dataset caches built with other tokenizer files never collide.
        super().__init__(path, {"library": library_name}, **file_kwargs)

    def _restore_model(self, **kwargs) -> MegatronTokenizerTextAbstract:
        return self._prebuilt_library

    @property
    def unique_identifiers(self) -> OrderedDict:
        identifiers = super().unique_identifiers
        identifiers["tokenizer_type"] = self.tokenizer_type
        return identifiers

    def has_bert_special_tokens(self) -> bool:
        """Whether cls, sep, mask and pad all exist (BERT pretraining needs them)."""
        try:
            ids = [self.cls, self.sep, self.mask, self.pad]
        except (AttributeError, ValueError, NameError):
            return False
        return all(token_id is not None and token_id >= 0 for token_id in ids)


# ---------------------------------------------------------------------------------------------
# SentencePiece: megatron-core's library class plus BERT ids and a cached vocabulary
# ---------------------------------------------------------------------------------------------

class _SentencePieceLibrary(_MegatronSentencePieceLibrary):
    """Megatron-Core's SentencePiece wrapper (non-legacy mode), with

    * cls_id / sep_id / mask_id read from the model's [CLS] / [SEP] / [MASK] pieces, which
      the upstream class only offers in legacy mode;
    * vocab / inv_vocab computed once: BERT masking looks up inv_vocab for every token, and
      the upstream properties rebuild the whole table on each access.
    """

    def __init__(self, model_path: str, legacy: bool = False,
                 special_tokens: Optional[List[str]] = None) -> None:
        super().__init__(model_path, special_tokens=special_tokens, legacy=legacy)
        self._model_path = model_path
        # the model's pieces, then (legacy) the special tokens the wrapper added after them
        self._vocab = _MegatronSentencePieceLibrary.vocab.fget(self)
        self._inv_vocab = dict(enumerate(self._vocab))

    def _control_id(self, piece: str) -> int:
        if piece in self.special_token_to_id:  # legacy: a --tokenizer-special-tokens one
            return self.special_token_to_id[piece]
        piece_id = self.tokenizer.piece_to_id(piece)
        if piece_id == self.tokenizer.unk_id():
            raise ValueError(
                f"--tokenizer-model: {self._model_path} has no {piece} piece; train one with "
                f"tools/train_tokenizer.py, which reserves [CLS], [SEP], [MASK] and <pad>"
            )
        return piece_id

    @property
    def cls_id(self) -> int:
        return self._control_id(SPM_CLS)

    @property
    def sep_id(self) -> int:
        return self._control_id(SPM_SEP)

    @property
    def mask_id(self) -> int:
        return self._control_id(SPM_MASK)

    @property
    def eod(self) -> int:
        return self.tokenizer.eos_id()

    @property
    def vocab(self) -> List[str]:
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return self._inv_vocab


def train_sentencepiece(lines: Iterable[str], vocab_size: int, output_prefix: str,
                        model_type: str = "bpe", character_coverage: float = 0.9999,
                        num_threads: int = 4) -> str:
    """Train a SentencePiece model on an iterable of text lines; return the .model path.

    Text round-trips exactly: no normalization, whitespace kept, "\\n" is its own piece and
    characters outside the vocabulary fall back to bytes. ValueError naming --vocab-size when it
    is under 300 or more than the lines can fill.
    """
    import sentencepiece

    if vocab_size < 300:
        # 256 byte-fallback pieces + 8 reserved pieces + something to learn
        raise ValueError(f"--vocab-size must be at least 300, got {vocab_size}")
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_prefix=output_prefix,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            pad_id=0, pad_piece=SPM_PAD,
            unk_id=1, unk_piece=SPM_UNK,
            bos_id=2, bos_piece=SPM_BOS,
            eos_id=3, eos_piece=SPM_EOS,
            control_symbols=[SPM_CLS, SPM_SEP, SPM_MASK],
            user_defined_symbols=["\n"],
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            num_threads=num_threads,
            minloglevel=2,
        )
    except RuntimeError as error:
        # SentencePiece's "Vocabulary size too high (V). Please set it to a value <= M."
        too_high = re.search(r"Vocabulary size too high \(\d+\)\D*(\d+)", str(error))
        if too_high is None:
            raise
        raise ValueError(
            f"--vocab-size {vocab_size} is more pieces than the input holds: give "
            f"--vocab-size {too_high.group(1)} or less, or more text with --input") from None
    return output_prefix + ".model"


# ---------------------------------------------------------------------------------------------
# GPT-2 byte-level BPE from local vocab.json + merges.txt
# ---------------------------------------------------------------------------------------------

def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    mapping = {byte: chr(byte) for byte in printable}
    num_shifted = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + num_shifted)
            num_shifted += 1
    return mapping


# GPT-2's pre-tokenizer, written with the standard `re` module: letters are [^\W\d_],
# numbers \d. Identical to the \p{L} / \p{N} original on ASCII text; rare unicode numerals
# (e.g. "²") group with letters instead of numbers.
_GPT2_PRETOKENIZE = re.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""
)


class GPT2BPELibrary(MegatronTokenizerTextAbstract):
    """GPT-2 byte-level BPE (the algorithm of the GPT-2 release) over local files."""

    def __init__(self, vocab_file: str, merges_file: str) -> None:
        with open(vocab_file, encoding="utf-8") as handle:
            try:
                self.encoder: Dict[str, int] = json.load(handle)
            except json.JSONDecodeError as error:
                raise ValueError(f"--vocab-file: not a GPT-2 vocab.json: {vocab_file}: {error}")
        self.decoder = {token_id: token for token, token_id in self.encoder.items()}
        with open(merges_file, encoding="utf-8") as handle:
            merge_lines = [line.rstrip("\n") for line in handle]
        merges = [tuple(line.split()) for line in merge_lines
                  if line.strip() and not line.startswith("#version")]
        if any(len(merge) != 2 for merge in merges):
            raise ValueError(f"--merge-file: expected two symbols per line in {merges_file}")
        self.bpe_ranks = {merge: rank for rank, merge in enumerate(merges)}
        self.byte_encoder = _bytes_to_unicode()
        self.byte_decoder = {char: byte for byte, char in self.byte_encoder.items()}
        missing = [char for char in self.byte_encoder.values() if char not in self.encoder]
        if missing:
            raise ValueError(
                f"--vocab-file: {vocab_file} lacks {len(missing)} of the 256 byte symbols; "
                f"it is not a byte-level BPE vocabulary"
            )
        if GPT2_EOD not in self.encoder:
            raise ValueError(f"--vocab-file: {vocab_file} has no {GPT2_EOD} token")
        self.vocab_size = len(self.encoder)
        self._bpe_cache: Dict[str, tuple] = {}

    def _bpe(self, word: str) -> tuple:
        cached = self._bpe_cache.get(word)
        if cached is not None:
            return cached
        symbols = list(word)
        while len(symbols) > 1:
            pairs = {(symbols[i], symbols[i + 1]) for i in range(len(symbols) - 1)}
            best = min(pairs, key=lambda pair: self.bpe_ranks.get(pair, float("inf")))
            if best not in self.bpe_ranks:
                break
            merged, i = [], 0
            while i < len(symbols):
                if i < len(symbols) - 1 and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        if len(self._bpe_cache) < 100_000:
            self._bpe_cache[word] = tuple(symbols)
        return tuple(symbols)

    def text_to_tokens(self, text: str) -> List[str]:
        tokens = []
        for chunk in _GPT2_PRETOKENIZE.findall(text):
            mapped = "".join(self.byte_encoder[byte] for byte in chunk.encode("utf-8"))
            tokens.extend(self._bpe(mapped))
        return tokens

    def tokens_to_text(self, tokens: List[str]) -> str:
        data = bytearray(self.byte_decoder[char] for token in tokens for char in token)
        return data.decode("utf-8", errors="replace")

    def tokens_to_ids(self, tokens: List[str]) -> List[int]:
        return [self.encoder[token] for token in tokens]

    def ids_to_tokens(self, ids: List[int]) -> List[str]:
        return [self.decoder[int(token_id)] for token_id in ids]

    def text_to_ids(self, text: str) -> List[int]:
        return self.tokens_to_ids(self.text_to_tokens(text))

    def ids_to_text(self, ids: List[int]) -> str:
        return self.tokens_to_text(self.ids_to_tokens(ids))

    def add_special_tokens(self, special_tokens) -> None:
        raise NotImplementedError("GPT2BPETokenizer: put extra tokens in --vocab-file instead")

    @property
    def eod(self) -> int:
        return self.encoder[GPT2_EOD]

    @property
    def eos_id(self) -> int:
        return self.encoder[GPT2_EOD]

    @property
    def bos_id(self) -> int:
        return self.encoder[GPT2_EOD]

    @property
    def pad_id(self) -> int:
        # No padding token in GPT-2: Megatron-Core's datasets then use their own sentinel.
        raise AttributeError("GPT2BPETokenizer has no padding token")

    @property
    def cls_id(self) -> int:
        raise AttributeError("GPT2BPETokenizer has no [CLS] token")

    @property
    def sep_id(self) -> int:
        raise AttributeError("GPT2BPETokenizer has no [SEP] token")

    @property
    def mask_id(self) -> int:
        raise AttributeError("GPT2BPETokenizer has no [MASK] token")

    @property
    def unk_id(self) -> Optional[int]:
        return None  # byte-level: every input is representable

    @property
    def vocab(self) -> Dict[str, int]:
        return self.encoder

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return self.decoder


# ---------------------------------------------------------------------------------------------
# BERT WordPiece from a local vocab.txt
# ---------------------------------------------------------------------------------------------

def _is_punctuation(char: str) -> bool:
    code = ord(char)
    # All non-letter/number ASCII symbols count as punctuation, as in the BERT release.
    if 33 <= code <= 47 or 58 <= code <= 64 or 91 <= code <= 96 or 123 <= code <= 126:
        return True
    return unicodedata.category(char).startswith("P")


def _is_cjk(code: int) -> bool:
    return (0x4E00 <= code <= 0x9FFF or 0x3400 <= code <= 0x4DBF or 0x20000 <= code <= 0x2A6DF
            or 0x2A700 <= code <= 0x2B73F or 0x2B740 <= code <= 0x2B81F
            or 0x2B820 <= code <= 0x2CEAF or 0xF900 <= code <= 0xFAFF
            or 0x2F800 <= code <= 0x2FA1F)


class WordPieceLibrary(MegatronTokenizerTextAbstract):
    """BERT's basic tokenizer (clean, split on whitespace and punctuation, optional lower
    case and accent stripping) followed by greedy longest-match-first WordPiece."""

    max_chars_per_word = 100

    def __init__(self, vocab_file: str, lower_case: bool,
                 include_special_tokens: bool = False) -> None:
        self.include_special_tokens = include_special_tokens
        with open(vocab_file, encoding="utf-8") as handle:
            tokens = [line.rstrip("\n").strip() for line in handle]
        self.vocab_dict: Dict[str, int] = {}
        for token in tokens:
            if token and token not in self.vocab_dict:
                self.vocab_dict[token] = len(self.vocab_dict)
        missing = [token for token in (BERT_CLS, BERT_SEP, BERT_MASK, BERT_PAD, BERT_UNK)
                   if token not in self.vocab_dict]
        if missing:
            raise ValueError(f"--vocab-file: {vocab_file} lacks {', '.join(missing)}")
        self.inv_vocab_dict = {token_id: token for token, token_id in self.vocab_dict.items()}
        self.lower_case = lower_case
        self.never_split = {BERT_CLS, BERT_SEP, BERT_MASK, BERT_PAD, BERT_UNK}
        self.vocab_size = len(self.vocab_dict)

    def _clean(self, text: str) -> str:
        chars = []
        for char in text:
            code = ord(char)
            if code == 0 or code == 0xFFFD:
                continue
            category = unicodedata.category(char)
            if char in " \t\n\r" or category == "Zs":
                chars.append(" ")
            elif category.startswith("C"):
                continue
            elif _is_cjk(code):
                chars.append(f" {char} ")
            else:
                chars.append(char)
        return "".join(chars)

    def _basic_tokens(self, text: str) -> List[str]:
        words = []
        for word in self._clean(text).split():
            if word in self.never_split:
                words.append(word)
                continue
            if self.lower_case:
                word = unicodedata.normalize("NFD", word.lower())
                word = "".join(char for char in word if unicodedata.category(char) != "Mn")
            current = ""
            for char in word:
                if _is_punctuation(char):
                    if current:
                        words.append(current)
                    words.append(char)
                    current = ""
                else:
                    current += char
            if current:
                words.append(current)
        return words

    def _wordpieces(self, word: str) -> List[str]:
        if len(word) > self.max_chars_per_word:
            return [BERT_UNK]
        pieces, start = [], 0
        while start < len(word):
            end = len(word)
            piece = None
            while start < end:
                candidate = word[start:end] if start == 0 else "##" + word[start:end]
                if candidate in self.vocab_dict:
                    piece = candidate
                    break
                end -= 1
            if piece is None:
                return [BERT_UNK]
            pieces.append(piece)
            start = end
        return pieces

    def text_to_tokens(self, text: str) -> List[str]:
        return [piece for word in self._basic_tokens(text) for piece in self._wordpieces(word)]

    def tokens_to_text(self, tokens: List[str]) -> str:
        return " ".join(tokens).replace(" ##", "").strip()

    def tokens_to_ids(self, tokens: List[str]) -> List[int]:
        unk = self.vocab_dict[BERT_UNK]
        return [self.vocab_dict.get(token, unk) for token in tokens]

    def ids_to_tokens(self, ids: List[int]) -> List[str]:
        return [self.inv_vocab_dict[int(token_id)] for token_id in ids]

    def text_to_ids(self, text: str) -> List[int]:
        ids = self.tokens_to_ids(self.text_to_tokens(text))
        if self.include_special_tokens:  # as BERT's own tokenizer frames a text
            return [self.cls_id, *ids, self.sep_id]
        return ids

    def ids_to_text(self, ids: List[int]) -> str:
        special = {BERT_CLS, BERT_SEP, BERT_PAD}
        return self.tokens_to_text([t for t in self.ids_to_tokens(ids) if t not in special])

    def add_special_tokens(self, special_tokens) -> None:
        raise NotImplementedError("BertWordPiece: put extra tokens in --vocab-file instead")

    @property
    def cls_id(self) -> int:
        return self.vocab_dict[BERT_CLS]

    @property
    def sep_id(self) -> int:
        return self.vocab_dict[BERT_SEP]

    @property
    def mask_id(self) -> int:
        return self.vocab_dict[BERT_MASK]

    @property
    def pad_id(self) -> int:
        return self.vocab_dict[BERT_PAD]

    @property
    def unk_id(self) -> int:
        return self.vocab_dict[BERT_UNK]

    @property
    def eod(self) -> int:
        # vocab.txt has no end-of-document token; [SEP] ends a segment, so it stands in.
        return self.vocab_dict[BERT_SEP]

    @property
    def eos_id(self) -> int:
        return self.vocab_dict[BERT_SEP]

    @property
    def bos_id(self) -> int:
        return self.vocab_dict[BERT_CLS]

    @property
    def vocab(self) -> Dict[str, int]:
        return self.vocab_dict

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return self.inv_vocab_dict


# ---------------------------------------------------------------------------------------------
# Hugging Face tokenizers from a local directory (tokenizer.json), without transformers
# ---------------------------------------------------------------------------------------------

def _read_special_tokens(directory: str) -> Dict[str, str]:
    """{"eos_token": "</s>", ...} of DIR/tokenizer_config.json ({} without one); each token
    is written there as a string or as a dict with its "content"."""
    path = os.path.join(directory, HF_CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as handle:
        try:
            config = json.load(handle)
        except json.JSONDecodeError as error:
            raise ValueError(f"--tokenizer-model: {path} is not JSON: {error}") from None
    tokens = {}
    for name in HF_SPECIAL_TOKENS:
        token = config.get(name)
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str) and token:
            tokens[name] = token
    return tokens


class HuggingFaceLibrary(MegatronTokenizerTextAbstract):
    """A Hugging Face tokenizer read from DIR/tokenizer.json with the `tokenizers` library,
    its special tokens from DIR/tokenizer_config.json when there is one.

    Text is encoded without the tokenizer's own special tokens (its post-processor's BOS /
    EOS; with them under --tokenizer-hf-include-special-tokens): a document's end is
    preprocess_data's --append-eod, as with the other types. The end-of-document id is
    eos_token's, else the first of HF_END_TOKENS the vocabulary has. special_tokens
    (--tokenizer-special-tokens) are added to the vocabulary where it lacks them.
    """

    def __init__(self, directory: Optional[str], special_tokens: Iterable[str] = (),
                 include_special_tokens: bool = False) -> None:
        try:
            import tokenizers
        except ImportError:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs the 'tokenizers' "
                             "package (pip install tokenizers)") from None
        path = huggingface_tokenizer_file(directory)
        try:
            self.tokenizer = tokenizers.Tokenizer.from_file(path)
        except Exception as error:  # the Rust library raises a plain Exception
            raise ValueError(f"--tokenizer-model: {path} is not a Hugging Face tokenizer: "
                             f"{error}") from None
        self.directory = directory
        self.include_special_tokens = include_special_tokens
        if special_tokens:
            self.tokenizer.add_special_tokens(list(special_tokens))
        self.vocab_dict: Dict[str, int] = self.tokenizer.get_vocab(with_added_tokens=True)
        self.inv_vocab_dict = {token_id: token for token, token_id in self.vocab_dict.items()}
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_ids = {name: self._configured_id(name, token)
                            for name, token in _read_special_tokens(directory).items()}
        self.eod_id = self._end_of_document_id()

    def _configured_id(self, name: str, token: str) -> int:
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"--tokenizer-model: {name} {token!r} of "
                             f"{os.path.join(self.directory, HF_CONFIG_FILE)} is not in its "
                             f"tokenizer.json")
        return token_id

    def _end_of_document_id(self) -> int:
        if "eos_token" in self.special_ids:
            return self.special_ids["eos_token"]
        for token in HF_END_TOKENS:
            token_id = self.tokenizer.token_to_id(token)
            if token_id is not None:
                return token_id
        raise ValueError(f"--tokenizer-model: {self.directory} has no end-of-document token: "
                         f"name an eos_token in its {HF_CONFIG_FILE}, or have one of "
                         f"{', '.join(HF_END_TOKENS)} in its tokenizer.json")

    def _special_id(self, name: str) -> int:
        if name not in self.special_ids:
            # AttributeError: Megatron-Core's datasets then fall back (no padding token, ...)
            raise AttributeError(f"HuggingFaceTokenizer {self.directory}: no {name} in its "
                                 f"{HF_CONFIG_FILE}")
        return self.special_ids[name]

    def text_to_tokens(self, text: str) -> List[str]:
        return self.tokenizer.encode(text, add_special_tokens=False).tokens

    def tokens_to_text(self, tokens: List[str]) -> str:
        return self.ids_to_text(self.tokens_to_ids(tokens))

    def tokens_to_ids(self, tokens: List[str]) -> List[int]:
        return [self.vocab_dict[token] for token in tokens]

    def ids_to_tokens(self, ids: List[int]) -> List[str]:
        return [self.inv_vocab_dict[int(token_id)] for token_id in ids]

    def text_to_ids(self, text: str) -> List[int]:
        return self.tokenizer.encode(text, add_special_tokens=self.include_special_tokens).ids

    def ids_to_text(self, ids: List[int]) -> str:
        return self.tokenizer.decode([int(token_id) for token_id in ids],
                                     skip_special_tokens=False)

    def add_special_tokens(self, special_tokens) -> None:
        raise NotImplementedError("HuggingFaceTokenizer: put extra tokens in the "
                                  "--tokenizer-model directory's tokenizer.json instead")

    # Megatron-Core's names; a token that tokenizer_config.json does not name: AttributeError
    eod = property(lambda self: self.eod_id)
    eos_id = property(lambda self: self.eod_id)
    bos_id = property(lambda self: self._special_id("bos_token"))
    pad_id = property(lambda self: self._special_id("pad_token"))
    cls_id = property(lambda self: self._special_id("cls_token"))
    sep_id = property(lambda self: self._special_id("sep_token"))
    mask_id = property(lambda self: self._special_id("mask_token"))
    unk_id = property(lambda self: self.special_ids.get("unk_token"))  # None: not named
    vocab = property(lambda self: self.vocab_dict)
    inv_vocab = property(lambda self: self.inv_vocab_dict)
