"""Train/valid/test datasets for GPT and BERT pretraining.

The datasets are Megatron-Core's own (GPTDataset, MockGPTDataset, BERTMaskedWordPieceDataset),
built by its BlendedMegatronDatasetBuilder from Megatron-LM's flags:

    --data-path P                  one indexed dataset (prefix of P.bin / P.idx)
    --data-path 0.3 P1 0.7 P2      a weighted blend (P1 P2: weighted by their sizes)
    --split 969,30,1               train/valid/test shares of every dataset
    --train-data-path P ... --valid-data-path ... --test-data-path ...
                                   each split from its own dataset(s), no --split
    --data-args-path F, --per-split-data-args-path F.json
                                   the same values read from a file
    --mock-data                    GPT: Megatron-Core's mock dataset, no files

Distributed behaviour (Megatron-Core's): when torch.distributed is initialized, rank 0 builds
the index caches (under --data-cache-path, by default PREFIX/cache/ next to each dataset)
while the other ranks wait at a barrier, then load them. Call the build functions on every
rank. Without torch.distributed everything runs in the calling process. Batches and iterators
are loaders.py's.
"""

import contextlib
import json
import os
import re
import struct
from typing import Callable, List, Optional, Sequence, Tuple, Union

import numpy
import torch

from megatron.core.datasets.bert_dataset import (
    BERTMaskedWordPieceDataset,
    BERTMaskedWordPieceDatasetConfig,
)
from megatron.core.datasets.blended_megatron_dataset_builder import (
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import (
    _INDEX_HEADER,
    DType,
    IndexedDataset,
    get_bin_path,
    get_idx_path,
)
from megatron.core.datasets.utils import Split, get_blend_from_list

from megatron_parm.settings.data import DEFAULT_SPLIT

Blend = Tuple[List[str], Optional[List[float]]]
NumSamples = Sequence[Optional[int]]  # (train, valid, test)
SPLIT_NAMES = ("train", "valid", "test")  # Megatron-Core's Split order


# ---------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------

def parse_data_path(data_path: Union[str, Sequence[str], None], flag: str = "--data-path") -> Blend:
    """Turn --data-path (or FLAG, one of the per-split paths) into Megatron-Core's blend,
    checking every prefix exists."""
    if isinstance(data_path, str):
        data_path = data_path.split()
    if not data_path:
        raise ValueError(f"{flag} is required (an indexed dataset prefix, or weighted "
                         f"prefixes 'W1 P1 W2 P2 ...')")
    # Megatron-LM's reading: 'W1 P1 W2 P2 ...' when every other item is a number,
    # otherwise a list of prefixes weighted by their sizes.
    prefixes, weights = get_blend_from_list(list(data_path))
    if weights is not None and (any(w < 0 for w in weights) or sum(weights) <= 0):
        raise ValueError(f"{flag}: weights must be >= 0 with a positive sum, got {weights}")
    for prefix in prefixes:
        if not (os.path.isfile(get_bin_path(prefix)) and os.path.isfile(get_idx_path(prefix))):
            raise ValueError(
                f"{flag}: no such indexed dataset: {prefix} (.bin/.idx not found; build it "
                f"with tools/preprocess_data.py)")
        check_indexed_dataset(prefix, flag)
    return prefixes, weights


def _read_text(flag: str, path: str) -> str:
    if not os.path.isfile(path):
        raise ValueError(f"{flag}: file not found: {path}")
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def _read_json(flag: str, path: str):
    try:
        return json.loads(_read_text(flag, path))
    except json.JSONDecodeError as error:
        raise ValueError(f"{flag}: {path} is not JSON: {error}") from None


def _given(paths):
    """A --*-data-path value without its empty items (a config's path emptied on the command
    line: --data-path '')."""
    if isinstance(paths, str):
        paths = paths.split()
    return [path for path in paths if path] or None if paths is not None else None


def data_sources(args) -> Tuple[Optional[Blend], Optional[List[Optional[Blend]]]]:
    """(blend, blend_per_split) as Megatron-LM reads them: --data-path or --data-args-path
    (one blend, split by --split), --train/valid/test-data-path or --per-split-data-args-path
    (a blend per split, None for a split without one), (None, None) with --mock-data. Checks
    every prefix; ValueError naming the flag for a missing or second source."""
    data_path = _given(getattr(args, "data_path", None))
    data_args_path = getattr(args, "data_args_path", None)
    per_split = {name: _given(getattr(args, f"{name}_data_path", None)) for name in SPLIT_NAMES}
    per_split_args = getattr(args, "per_split_data_args_path", None)
    mock = getattr(args, "mock_data", False)
    if data_path and data_args_path:
        raise ValueError("--data-args-path holds --data-path's value: give one of the two")
    if any(per_split.values()) and per_split_args:
        raise ValueError("--per-split-data-args-path holds the --train/valid/test-data-path "
                         "values: give them one way")
    sources = [name for name, given in (
        ("--mock-data", mock), ("--data-path", data_path or data_args_path),
        ("--train/valid/test-data-path", any(per_split.values()) or per_split_args)) if given]
    if len(sources) > 1:
        raise ValueError(f"{' and '.join(sources)}: give a single data source (Megatron-LM's "
                         f"rule)")
    if not sources:
        raise ValueError("--data-path is required (an indexed dataset prefix, or weighted "
                         "prefixes 'W1 P1 W2 P2 ...'), or --train-data-path / --valid-data-path "
                         "/ --test-data-path, or --mock-data")
    if mock:
        return None, None
    if data_args_path:
        return parse_data_path(_read_text("--data-args-path", data_args_path).split(),
                               "--data-args-path"), None
    if data_path:
        return parse_data_path(data_path), None
    if per_split_args:
        values = _read_json("--per-split-data-args-path", per_split_args)
        missing = [name for name in SPLIT_NAMES if not isinstance(values, dict) or name not in values]
        if missing:
            raise ValueError(f"--per-split-data-args-path: {per_split_args} needs the keys "
                             f"train, valid and test (missing {', '.join(missing)})")
        per_split = {name: values[name].split() if isinstance(values[name], str) else values[name]
                     for name in SPLIT_NAMES}
        flags = {name: "--per-split-data-args-path" for name in SPLIT_NAMES}
    else:
        flags = {name: f"--{name}-data-path" for name in SPLIT_NAMES}
    return None, [parse_data_path(per_split[name], flags[name]) if per_split[name] else None
                  for name in SPLIT_NAMES]


def sequences_per_dataset(path: Optional[str], blend: Optional[Blend],
                          blend_per_split: Optional[List[Optional[Blend]]]):
    """--per-dataset-sequences-path's {prefix: (sequences, documents)} for every prefix of the
    blends (None without the flag)."""
    if path is None:
        return None
    flag = "--per-dataset-sequences-path"
    counts = _read_json(flag, path)
    prefixes = [prefix for one in [blend, *(blend_per_split or [])] if one for prefix in one[0]]
    for prefix in prefixes:
        entry = counts.get(prefix) if isinstance(counts, dict) else None
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2
                and all(isinstance(count, int) and count >= 0 for count in entry)):
            raise ValueError(f"{flag}: {path} has no [sequences, documents] for {prefix}")
    return {prefix: tuple(counts[prefix]) for prefix in prefixes}


# .idx: header, version (u64), dtype code (u8), sequence count (u64), document count (u64), then
# int32 sequence lengths, int64 sequence byte offsets into .bin, int64 document boundaries,
# and (multimodal datasets only) one int8 mode per sequence.
_IDX_FIXED = len(_INDEX_HEADER) + 8 + 1 + 8 + 8


def check_indexed_dataset(prefix: str, flag: str = "--data-path") -> None:
    """Refuse a damaged PREFIX.idx / PREFIX.bin before Megatron-Core maps them: a header, size
    or length that does not match raises ValueError naming the file, what was expected, what
    was found and how to rebuild it. Reads only the header and the last index entries."""
    idx_path, bin_path = get_idx_path(prefix), get_bin_path(prefix)
    rebuild = "; rebuild the dataset with tools/preprocess_data.py"

    def refuse(path, what):
        raise ValueError(f"{flag}: {path}: {what}{rebuild}")

    idx_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as index:
        fixed = index.read(_IDX_FIXED)
        if len(fixed) < _IDX_FIXED:
            refuse(idx_path, f"{idx_size} bytes, shorter than the {_IDX_FIXED}-byte header "
                             f"(truncated)")
        header, (version, code, num_sequences, num_documents) = \
            fixed[:len(_INDEX_HEADER)], struct.unpack("<QBQQ", fixed[len(_INDEX_HEADER):])
        if header != _INDEX_HEADER:
            refuse(idx_path, f"starts with {header!r}, expected {_INDEX_HEADER!r} (not a "
                             f"Megatron indexed-dataset index)")
        if version != 1:
            refuse(idx_path, f"format version {version}, expected 1")
        try:
            itemsize = DType.size(DType.dtype_from_code(code))
        except (ValueError, KeyError):
            refuse(idx_path, f"token type code {code} is not one of Megatron's")
        expected = _IDX_FIXED + num_sequences * (4 + 8) + num_documents * 8
        if idx_size not in (expected, expected + num_sequences):  # + modes if multimodal
            refuse(idx_path, f"{idx_size} bytes, expected {expected} for the {num_sequences} "
                             f"sequences and {num_documents} document boundaries its header "
                             f"lists (truncated or corrupted)")
        if num_sequences == 0:
            last_end = 0
        else:
            index.seek(_IDX_FIXED + (num_sequences - 1) * 4)
            (last_length,) = struct.unpack("<i", index.read(4))
            index.seek(_IDX_FIXED + num_sequences * 4 + (num_sequences - 1) * 8)
            (last_offset,) = struct.unpack("<q", index.read(8))
            last_end = last_offset + last_length * itemsize
        if num_documents:
            index.seek(_IDX_FIXED + num_sequences * 12 + (num_documents - 1) * 8)
            (last_boundary,) = struct.unpack("<q", index.read(8))
            if last_boundary != num_sequences:
                refuse(idx_path, f"its last document ends at sequence {last_boundary}, expected "
                                 f"{num_sequences} (corrupted)")
    bin_size = os.path.getsize(bin_path)
    if bin_size != last_end:
        refuse(bin_path, f"{bin_size} bytes, expected {last_end} ({last_end // itemsize} tokens of "
                         f"{itemsize} bytes) as {os.path.basename(idx_path)} says "
                         f"({'truncated' if bin_size < last_end else 'not the data of this index'})")


def parse_split(split: str) -> List[Optional[Tuple[float, float]]]:
    """Validate --split and return Megatron-Core's split matrix."""
    if not isinstance(split, str) or not re.fullmatch(
            r"\s*[0-9.]+\s*(,\s*[0-9.]+\s*){0,2}", split):
        raise ValueError(f"--split: expected up to three comma-separated numbers such as "
                         f"'969,30,1', got {split!r}")
    try:
        weights = [float(part) for part in split.split(",")]
    except ValueError:
        raise ValueError(f"--split: not numbers: {split!r}")
    if sum(weights) <= 0:
        raise ValueError(f"--split: weights must have a positive sum, got {split!r}")
    return convert_split_vector_to_split_matrix(parse_and_normalize_split(split))


def train_valid_test_num_samples(train_iters: int, global_batch_size: int,
                                 eval_interval: Optional[int], eval_iters: int) -> List[int]:
    """Samples each split must provide, as Megatron-LM counts them (eval_interval None: one
    evaluation, at the end; the training split's count is data.loaders.phase_start's, which
    knows --train-samples and the phases)."""
    num_evaluations = train_iters // eval_interval + 1 if eval_interval else 1
    return [
        train_iters * global_batch_size,
        num_evaluations * eval_iters * global_batch_size,
        eval_iters * global_batch_size,
    ]


def _resolve_num_samples(blends: List[Optional[Blend]], num_samples: NumSamples) -> List:
    """Per-split sample counts for the builder (BLENDS: each split's blend, None for a split
    that draws nothing): 0 for absent splits, and counts required wherever a weighted blend has
    to be sampled in proportion."""
    if len(num_samples) != len(Split):
        raise ValueError(f"num_samples needs one entry per split (train, valid, test), "
                         f"got {num_samples}")
    resolved = [0 if blends[i] is None else num_samples[i] for i in range(len(Split))]
    for split in Split:
        blend = blends[split.value]
        if blend is not None and blend[1] is not None and resolved[split.value] is None:
            raise ValueError(
                f"--data-path: a weighted blend needs a sample count for the {split.name} "
                f"split (got None); give counts or use unweighted prefixes")
    return resolved


def _check_splits_have_data(prefixes: List[str], split_matrix, num_samples: NumSamples,
                            by_document: bool, min_sentences: int) -> None:
    """Refuse splits that would select nothing.

    Megatron-Core's index builders loop until they have enough samples, so a split with
    no usable document never returns; catch that here with a message naming the flag.
    """
    for prefix in prefixes:
        dataset = IndexedDataset(prefix)
        if by_document:
            # A split takes whole documents; a document is usable with enough sentences.
            sentences_per_document = numpy.diff(dataset.document_indices)
            num_elements = len(sentences_per_document)
        else:
            num_elements = len(dataset.sequence_lengths)
        for split in Split:
            bookends = split_matrix[split.value]
            if bookends is None or num_samples[split.value] == 0:
                continue
            begin = int(round(bookends[0] * num_elements))
            end = int(round(bookends[1] * num_elements))
            if by_document:
                num_usable = int(numpy.sum(sentences_per_document[begin:end] >= min_sentences))
                what = f"documents with >= {min_sentences} sentences"
            else:
                num_usable = end - begin
                what = "sequences"
            if num_usable == 0:
                raise ValueError(
                    f"--split: the {split.name} split of {prefix} has no {what} "
                    f"({num_elements} in the whole dataset); give it a larger share, "
                    f"set its weight to 0, or use more data"
                )


@contextlib.contextmanager
def _process_group_for_building():
    """Give Megatron-Core a one-rank process group when the caller has none.

    MaskedWordPieceDataset (BERT) and BlendedDataset (weighted --data-path) call
    torch.distributed.get_rank() unconditionally while building their indices, so a
    single-process run needs a default group. One made here lives
    only for the build and is destroyed afterwards; an existing group is left alone.
    """
    if torch.distributed.is_initialized():
        yield
        return
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def _always() -> bool:
    return True


# ---------------------------------------------------------------------------------------------
# Dataset builders
# ---------------------------------------------------------------------------------------------

DataSource = Tuple[Optional[Blend], Optional[List[Optional[Blend]]]]  # data_sources(args)


def _build(dataset_cls, config, num_samples: NumSamples,
           is_built_on_rank: Optional[Callable[[], bool]]):
    """(train, valid, test) through megatron-core's builder (caches built on rank 0 first)."""
    builder = BlendedMegatronDatasetBuilder(dataset_cls, num_samples, is_built_on_rank or _always, config)
    with _process_group_for_building():
        return tuple(builder.build())


def _source_and_samples(data, split: Optional[str], num_samples: NumSamples, by_document: bool,
                        min_sentences: int):
    """(blend, blend_per_split, split, per-split sample counts) for Megatron-Core's config,
    checked to select data. DATA: a --data-path value, or data_sources(args)'s pair."""
    blend, per_split = data if isinstance(data, tuple) else (parse_data_path(data), None)
    if blend is None and per_split is None:  # --mock-data: Megatron-Core splits it 1,1,1
        return None, None, None, list(num_samples)
    if per_split is not None:
        num_samples = _resolve_num_samples(per_split, num_samples)
        for index, one in enumerate(per_split):
            if one is not None:  # this split takes the whole of its datasets
                matrix = [(0.0, 1.0) if i == index else None for i in range(len(Split))]
                _check_splits_have_data(one[0], matrix, num_samples, by_document, min_sentences)
        return None, per_split, None, num_samples
    split_matrix = parse_split(split)
    num_samples = _resolve_num_samples([blend if bookends else None for bookends in split_matrix],
                                       num_samples)
    _check_splits_have_data(blend[0], split_matrix, num_samples, by_document=by_document,
                            min_sentences=min_sentences)
    return blend, None, split, num_samples


def build_gpt_datasets(tokenizer, data_path, split: Optional[str], seq_length: int, seed: int,
                       num_samples: NumSamples, *, data_cache_path: Optional[str] = None,
                       reset_position_ids: bool = False, reset_attention_mask: bool = False,
                       eod_mask_loss: bool = False, create_attention_mask: bool = True,
                       mmap_bin_files: bool = True, mid_level_dataset_surplus: float = 0.005,
                       allow_ambiguous_pad_tokens: bool = False,
                       sequences_per_dataset_path: Optional[str] = None,
                       is_built_on_rank: Optional[Callable[[], bool]] = None):
    """Return (train, valid, test) GPT datasets; a split with weight 0 (or without data) is
    None.

    data_path: a --data-path value, or data_sources(args)'s (blend, blend_per_split) pair
    ((None, None): Megatron-Core's MockGPTDataset). Each sample: tokens [s], labels [s]
    (tokens shifted by one), loss_mask [s] float, position_ids [s], and attention_mask
    [1, s, s] bool (True = masked) when create_attention_mask. num_samples: samples per split
    (None builds one epoch). is_built_on_rank: Megatron-Core's hook to build only on some
    ranks (those return None); by default every rank builds.
    """
    if seq_length < 1:
        raise ValueError(f"--seq-length must be >= 1, got {seq_length}")
    blend, per_split, split, num_samples = _source_and_samples(
        data_path, split, num_samples, by_document=False, min_sentences=1)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=per_split,
        split=split,
        path_to_cache=data_cache_path,
        mmap_bin_files=mmap_bin_files,
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
        mid_level_dataset_surplus=mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=allow_ambiguous_pad_tokens,
        sequences_per_dataset=sequences_per_dataset(sequences_per_dataset_path, blend, per_split),
    )
    dataset_cls = MockGPTDataset if config.mock else GPTDataset
    return _build(dataset_cls, config, num_samples, is_built_on_rank)


def build_bert_datasets(tokenizer, data_path, split: Optional[str], seq_length: int, seed: int,
                        num_samples: NumSamples, *, data_cache_path: Optional[str] = None,
                        mask_prob: float = 0.15, short_seq_prob: float = 0.1,
                        binary_head: bool = True, masking_max_ngram: int = 3,
                        mid_level_dataset_surplus: float = 0.005,
                        allow_ambiguous_pad_tokens: bool = False,
                        is_built_on_rank: Optional[Callable[[], bool]] = None):
    """Return (train, valid, test) BERT datasets; a split with weight 0 (or without data) is
    None.

    data_path (a --data-path value, or data_sources(args)'s pair) must name sentence-split
    datasets (tools/preprocess_data.py --split-sentences). Each sample: text [s], types [s],
    labels [s], loss_mask [s], padding_mask [s], is_random (next-sentence label), truncated.
    Masking follows Megatron-LM's defaults: up to 3-grams, no whole-word masking, no
    permutation.
    """
    if isinstance(data_path, tuple) and data_path == (None, None):
        raise ValueError(MOCK_BERT)
    if not tokenizer.has_bert_special_tokens():
        raise ValueError(
            f"--tokenizer-type {tokenizer.tokenizer_type}: BERT needs [CLS], [SEP], [MASK] "
            f"and a padding token; use a BertWordPiece vocabulary or a SentencePiece model "
            f"from tools/train_tokenizer.py")
    if not 0.0 < mask_prob < 1.0:
        raise ValueError(f"--mask-prob must be in (0, 1), got {mask_prob}")
    if not 0.0 <= short_seq_prob <= 1.0:
        raise ValueError(f"--short-seq-prob must be in [0, 1], got {short_seq_prob}")
    if seq_length < 5:
        raise ValueError(f"--seq-length must be >= 5 for BERT ([CLS] A [SEP] B [SEP]), "
                         f"got {seq_length}")
    blend, per_split, split, num_samples = _source_and_samples(
        data_path, split, num_samples, by_document=True, min_sentences=2 if binary_head else 1)
    config = BERTMaskedWordPieceDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=per_split,
        split=split,
        path_to_cache=data_cache_path,
        tokenizer=tokenizer,
        masking_probability=mask_prob,
        short_sequence_probability=short_seq_prob,
        masking_max_ngram=masking_max_ngram,
        masking_do_full_word=False,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=False,
        classification_head=binary_head,
        mid_level_dataset_surplus=mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=allow_ambiguous_pad_tokens,
    )
    return _build(BERTMaskedWordPieceDataset, config, num_samples, is_built_on_rank)


MOCK_BERT = ("--mock-data: Megatron-Core 0.16.1 has a mock dataset for GPT only "
             "(MockGPTDataset); BERT needs --data-path or --train/valid/test-data-path")


def check_data_flags(args, model_type: str) -> None:
    """The data flags that go together, and the files they name, before any rank starts
    (ValueError naming the flag); fills --split's default as Megatron-LM does."""
    blend, per_split = data_sources(args)
    if blend is None and per_split is None and model_type == "bert":
        raise ValueError(MOCK_BERT)
    if per_split is not None and args.split is not None:
        raise ValueError(f"--split {args.split}: the --train/valid/test-data-path datasets are "
                         f"each one split's whole (Megatron-Core refuses both)")
    if blend is not None and args.split is None:
        args.split = DEFAULT_SPLIT
    if blend is not None:
        parse_split(args.split)
    sequences_per_dataset(getattr(args, "per_dataset_sequences_path", None), blend, per_split)


def build_datasets_from_args(args, tokenizer, model: str, num_samples: NumSamples,
                             is_built_on_rank: Optional[Callable[[], bool]] = None):
    """(train, valid, test) from Megatron-LM style args (the data flags of
    megatron_parm.settings plus --seq-length and --seed); model is 'gpt' or 'bert'."""
    common = dict(
        data_path=data_sources(args), split=args.split, seq_length=args.seq_length,
        seed=args.seed, num_samples=num_samples,
        data_cache_path=getattr(args, "data_cache_path", None),
        mid_level_dataset_surplus=getattr(args, "mid_level_dataset_surplus", 0.005),
        allow_ambiguous_pad_tokens=getattr(args, "allow_ambiguous_pad_tokens", False),
        is_built_on_rank=is_built_on_rank,
    )
    if model == "gpt":
        return build_gpt_datasets(
            tokenizer, **common,
            reset_position_ids=getattr(args, "reset_position_ids", False),
            reset_attention_mask=getattr(args, "reset_attention_mask", False),
            eod_mask_loss=getattr(args, "eod_mask_loss", False),
            create_attention_mask=getattr(args, "create_attention_mask_in_dataloader", True),
            mmap_bin_files=getattr(args, "mmap_bin_files", True),
            sequences_per_dataset_path=getattr(args, "per_dataset_sequences_path", None),
        )
    if model == "bert":
        return build_bert_datasets(
            tokenizer, **common,
            mask_prob=getattr(args, "mask_prob", 0.15),
            short_seq_prob=getattr(args, "short_seq_prob", 0.1),
            binary_head=getattr(args, "bert_binary_head", True),
        )
    raise ValueError(f"model must be 'gpt' or 'bert', got {model!r}")
