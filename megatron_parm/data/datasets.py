"""Train/valid/test datasets and data iterators for GPT and BERT pretraining.

The datasets are Megatron-Core's own (GPTDataset, BERTMaskedWordPieceDataset), built by its
BlendedMegatronDatasetBuilder from Megatron-LM's flags:

    --data-path P                  one indexed dataset (prefix of P.bin / P.idx)
    --data-path 0.3 P1 0.7 P2      a weighted blend
    --split 969,30,1               train/valid/test shares of every dataset

Distributed behaviour (Megatron-Core's): when torch.distributed is initialized, rank 0 builds
the index caches (under --data-cache-path, by default next to the data) while the other
ranks wait at a barrier, then load them. Call the build functions on every rank. Without
torch.distributed everything runs in the calling process.

Notation: b micro batch size, s sequence length.
"""

import contextlib
import os
import re
import signal
import struct
from functools import partial
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

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
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import (
    _INDEX_HEADER,
    DType,
    IndexedDataset,
    get_bin_path,
    get_idx_path,
)
from megatron.core.datasets.utils import Split, get_blend_from_list

Blend = Tuple[List[str], Optional[List[float]]]
NumSamples = Sequence[Optional[int]]  # (train, valid, test)


# ---------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------

def parse_data_path(data_path: Union[str, Sequence[str], None]) -> Blend:
    """Turn --data-path into Megatron-Core's blend, checking every prefix exists."""
    if isinstance(data_path, str):
        data_path = data_path.split()
    if not data_path:
        raise ValueError("--data-path is required (an indexed dataset prefix, or weighted "
                         "prefixes 'W1 P1 W2 P2 ...')")
    # Megatron-LM's reading: 'W1 P1 W2 P2 ...' when every other item is a number,
    # otherwise a list of prefixes weighted by their sizes.
    prefixes, weights = get_blend_from_list(list(data_path))
    if weights is not None and (any(w < 0 for w in weights) or sum(weights) <= 0):
        raise ValueError(f"--data-path: weights must be >= 0 with a positive sum, got {weights}")
    for prefix in prefixes:
        if not (os.path.isfile(get_bin_path(prefix)) and os.path.isfile(get_idx_path(prefix))):
            raise ValueError(
                f"--data-path: no such indexed dataset: {prefix} (.bin/.idx not found; build it "
                f"with tools/preprocess_data.py)")
        check_indexed_dataset(prefix)
    return prefixes, weights


# .idx: header, version (u64), dtype code (u8), sequence count (u64), document count (u64), then
# int32 sequence lengths, int64 sequence byte offsets into .bin, int64 document boundaries,
# and (multimodal datasets only) one int8 mode per sequence.
_IDX_FIXED = len(_INDEX_HEADER) + 8 + 1 + 8 + 8


def check_indexed_dataset(prefix: str) -> None:
    """Refuse a damaged PREFIX.idx / PREFIX.bin before Megatron-Core maps them: a header, size
    or length that does not match raises ValueError naming the file, what was expected, what
    was found and how to rebuild it. Reads only the header and the last index entries."""
    idx_path, bin_path = get_idx_path(prefix), get_bin_path(prefix)
    rebuild = "; rebuild the dataset with tools/preprocess_data.py"

    def refuse(path, what):
        raise ValueError(f"--data-path: {path}: {what}{rebuild}")

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
    evaluation, at the end)."""
    num_evaluations = train_iters // eval_interval + 1 if eval_interval else 1
    return [
        train_iters * global_batch_size,
        num_evaluations * eval_iters * global_batch_size,
        eval_iters * global_batch_size,
    ]


def _resolve_num_samples(blend: Blend, split_matrix, num_samples: NumSamples) -> List:
    """Per-split sample counts for the builder: 0 for absent splits, and counts required
    wherever a weighted blend has to be sampled in proportion."""
    if len(num_samples) != len(Split):
        raise ValueError(f"num_samples needs one entry per split (train, valid, test), "
                         f"got {num_samples}")
    resolved = [0 if split_matrix[i] is None else num_samples[i] for i in range(len(Split))]
    if blend[1] is not None:
        for split in Split:
            if resolved[split.value] is None:
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

def _build(dataset_cls, config, num_samples: NumSamples,
           is_built_on_rank: Optional[Callable[[], bool]]):
    """(train, valid, test) through megatron-core's builder (caches built on rank 0 first)."""
    builder = BlendedMegatronDatasetBuilder(dataset_cls, num_samples, is_built_on_rank or _always, config)
    with _process_group_for_building():
        return tuple(builder.build())


def _blend_and_samples(data_path, split: str, num_samples: NumSamples, by_document: bool,
                       min_sentences: int):
    """--data-path as Megatron's blend, and per-split sample counts, checked to select data."""
    blend = parse_data_path(data_path)
    split_matrix = parse_split(split)
    num_samples = _resolve_num_samples(blend, split_matrix, num_samples)
    _check_splits_have_data(blend[0], split_matrix, num_samples, by_document=by_document,
                            min_sentences=min_sentences)
    return blend, num_samples


def build_gpt_datasets(tokenizer, data_path, split: str, seq_length: int, seed: int,
                       num_samples: NumSamples, *, data_cache_path: Optional[str] = None,
                       reset_position_ids: bool = False, reset_attention_mask: bool = False,
                       eod_mask_loss: bool = False, create_attention_mask: bool = True,
                       is_built_on_rank: Optional[Callable[[], bool]] = None):
    """Return (train, valid, test) GPT datasets; a split with weight 0 is None.

    Each sample: tokens [s], labels [s] (tokens shifted by one), loss_mask [s] float,
    position_ids [s], and attention_mask [1, s, s] bool (True = masked) when requested.
    num_samples: samples per split (None builds one epoch). is_built_on_rank: Megatron-Core's
    hook to build only on some ranks (those return None); by default every rank builds.
    """
    if seq_length < 1:
        raise ValueError(f"--seq-length must be >= 1, got {seq_length}")
    blend, num_samples = _blend_and_samples(data_path, split, num_samples, by_document=False,
                                            min_sentences=1)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=split,
        path_to_cache=data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
    )
    return _build(GPTDataset, config, num_samples, is_built_on_rank)


def build_bert_datasets(tokenizer, data_path, split: str, seq_length: int, seed: int,
                        num_samples: NumSamples, *, data_cache_path: Optional[str] = None,
                        mask_prob: float = 0.15, short_seq_prob: float = 0.1,
                        binary_head: bool = True, masking_max_ngram: int = 3,
                        is_built_on_rank: Optional[Callable[[], bool]] = None):
    """Return (train, valid, test) BERT datasets; a split with weight 0 is None.

    data_path must name sentence-split datasets (tools/preprocess_data.py --split-sentences).
    Each sample: text [s], types [s], labels [s], loss_mask [s], padding_mask [s],
    is_random (next-sentence label), truncated. Masking follows Megatron-LM's defaults:
    up to 3-grams, no whole-word masking, no permutation.
    """
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
    blend, num_samples = _blend_and_samples(data_path, split, num_samples, by_document=True,
                                            min_sentences=2 if binary_head else 1)
    config = BERTMaskedWordPieceDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
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
    )
    return _build(BERTMaskedWordPieceDataset, config, num_samples, is_built_on_rank)


def build_datasets_from_args(args, tokenizer, model: str, num_samples: NumSamples,
                             is_built_on_rank: Optional[Callable[[], bool]] = None):
    """(train, valid, test) from Megatron-LM style args (the data flags of
    megatron_parm.settings plus --seq-length and --seed); model is 'gpt' or 'bert'."""
    common = dict(
        data_path=args.data_path, split=args.split, seq_length=args.seq_length,
        seed=args.seed, num_samples=num_samples,
        data_cache_path=getattr(args, "data_cache_path", None),
        is_built_on_rank=is_built_on_rank,
    )
    if model == "gpt":
        return build_gpt_datasets(
            tokenizer, **common,
            reset_position_ids=getattr(args, "reset_position_ids", False),
            reset_attention_mask=getattr(args, "reset_attention_mask", False),
            eod_mask_loss=getattr(args, "eod_mask_loss", False),
        )
    if model == "bert":
        return build_bert_datasets(
            tokenizer, **common,
            mask_prob=getattr(args, "mask_prob", 0.15),
            short_seq_prob=getattr(args, "short_seq_prob", 0.1),
            binary_head=getattr(args, "bert_binary_head", True),
        )
    raise ValueError(f"model must be 'gpt' or 'bert', got {model!r}")


# ---------------------------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------------------------

class PretrainingBatchSampler:
    """Sequential micro batches for one data-parallel rank, resumable.

    Walks the dataset in order from consumed_samples, one global slice of
    micro_batch_size * data_parallel_size samples at a time, and yields this rank's part
    (the same order as Megatron-LM's MegatronPretrainingSampler). Shuffling is already in
    the dataset's index; a trailing partial slice is dropped.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"--micro-batch-size must be >= 1, got {micro_batch_size}")
        assert 0 <= data_parallel_rank < data_parallel_size
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.num_samples_per_step = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        return max(0, self.total_samples - self.consumed_samples) // self.num_samples_per_step

    def __iter__(self) -> Iterator[List[int]]:
        begin = self.data_parallel_rank * self.micro_batch_size
        for start in range(self.consumed_samples,
                           self.total_samples - self.num_samples_per_step + 1,
                           self.num_samples_per_step):
            yield list(range(start + begin, start + begin + self.micro_batch_size))


def collate_batch(samples: List[Dict]) -> Dict[str, torch.Tensor]:
    """Stack samples into a batch of tensors.

    GPT: tokens, labels, position_ids [b, s] int64; loss_mask [b, s] float;
    attention_mask [b, 1, s, s] bool (True = masked), when the dataset makes one.
    BERT: text, types, labels, padding_mask [b, s] int64 (padding_mask 1 = real token);
    loss_mask [b, s] float; is_random, truncated [b] int64.
    """
    batch = torch.utils.data.default_collate(samples)
    if "text" in batch:
        # Megatron-Core fills padding positions of padding_mask and types with the pad id;
        # normalize so any pad id gives a 0/1 mask and token-type 0 on padding.
        batch["padding_mask"] = (batch["padding_mask"] == 1).long()
        batch["types"] = batch["types"].long() * batch["padding_mask"]
        batch["loss_mask"] = batch["loss_mask"].float()
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dtype in (torch.int32, torch.int16):
            batch[key] = value.long()
    return batch


# The DataLoaders' own generator's seed (build_data_loader): only the workers' seeds come from it.
LOADER_SEED = 0


def _worker_catches(signal_name: str, worker_id: int) -> None:
    """A data-loader worker's start: the first --exit-signal (signal_name) it receives is
    ignored, so that a job-wide signal (Slurm's) leaves the stop to its rank, which saves and
    stops (a worker that died of it would fail the rank, through DataLoader's SIGCHLD
    handler); a second one ends it as before."""
    signal.signal(signal.Signals[signal_name], _ignore_once)


def _ignore_once(signum, frame) -> None:
    signal.signal(signum, signal.SIG_DFL)


def shut_down(iterator) -> None:
    """End the worker processes behind a build_data_iterator iterator now (a cyclic one keeps
    them for its whole life), rather than when the rank exits."""
    close = getattr(iterator, "close", None)  # a cyclic iterator's generator
    if close is not None:
        close()


def build_data_loader(dataset, micro_batch_size: int, consumed_samples: int = 0,
                      data_parallel_rank: int = 0, data_parallel_size: int = 1,
                      num_workers: int = 0, exit_signal: Optional[str] = None
                      ) -> Optional[torch.utils.data.DataLoader]:
    """DataLoader over one split for one data-parallel rank; None when dataset is None.
    exit_signal (--exit-signal-handler's signal, e.g. 'SIGTERM'): its workers ignore it, as
    Megatron-LM's do.

    It has a generator of its own: each iterator of a DataLoader draws its workers' base seed
    from its generator, by default torch's global one, which on CPU is also dropout's (outside
    the tracker's regions: tp=1 without --sequence-parallel). The iterators start lazily (at
    the first batch, again at each pass), so a resumed run would draw that seed after its RNG
    states were restored, where the uninterrupted run drew it long before, and its dropout
    masks would differ from there on. Nothing in the samples depends on that seed (the
    datasets and collate_batch draw no random numbers)."""
    if dataset is None:
        return None
    sampler = PretrainingBatchSampler(len(dataset), consumed_samples, micro_batch_size,
                                      data_parallel_rank, data_parallel_size)
    generator = torch.Generator()
    generator.manual_seed(LOADER_SEED)
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=num_workers, collate_fn=collate_batch,
        persistent_workers=num_workers > 0, generator=generator,
        worker_init_fn=partial(_worker_catches, exit_signal) if exit_signal and num_workers
        else None,
    )


def build_data_iterator(dataset, micro_batch_size: int, consumed_samples: int = 0,
                        data_parallel_rank: int = 0, data_parallel_size: int = 1,
                        num_workers: int = 0, cyclic: bool = False,
                        exit_signal: Optional[str] = None) -> Optional[Iterator]:
    """Iterator of batch dicts (see collate_batch); cyclic restarts at the end of the split
    (for validation sets sized for a single pass, leave it False); exit_signal:
    build_data_loader's."""
    loader = build_data_loader(dataset, micro_batch_size, consumed_samples,
                               data_parallel_rank, data_parallel_size, num_workers, exit_signal)
    if loader is None:
        return None
    if not cyclic:
        return iter(loader)

    def _cycle():
        try:
            while True:
                yield from loader
        finally:  # persistent workers: ended with the iterator
            if getattr(loader, "_iterator", None) is not None:
                loader._iterator._shutdown_workers()
                loader._iterator = None
    return _cycle()
