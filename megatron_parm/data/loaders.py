"""Batches of the datasets: Megatron-LM's --dataloader-type samplers, the DataLoaders and
iterators over them, and its training phases (--phase-transition-iterations).

    PretrainingBatchSampler   single: every sample once, in the dataset's order, from the
                              consumed samples on (Megatron-LM's MegatronPretrainingSampler)
    RandomBatchSampler        cyclic: a new random order each epoch, each data-parallel rank
                              drawing from its own share (its MegatronPretrainingRandomSampler,
                              with data sharding, its default)
    build_data_loader, build_data_iterator
                              one split's DataLoader / iterator of batch dicts for one
                              data-parallel rank
    build_iterators(args, tokenizer, num_chunks, consumed_samples, iteration)
                              the trainer's (train, validation) iterators, one per model chunk
    shut_down(iterator)       end an iterator's worker processes now
    phase_start, phase_transition_at, check_phase_resume
                              where the current training phase starts; whether one ends

Notation: b micro batch size, s sequence length, d data-parallel size.
"""

import signal
from functools import partial
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_parm.data.datasets import build_datasets_from_args, train_valid_test_num_samples
from megatron_parm.settings.data import phase_transition_iterations

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


class RandomBatchSampler:
    """Micro batches in a random order for one data-parallel rank, cycling through epochs,
    resumable (--dataloader-type cyclic).

    Each epoch covers the whole steps of the dataset (b * d samples each; the remainder is
    left out); rank r draws its micro batches from its own contiguous share of an epoch, in an
    order shuffled by a generator seeded with the epoch number (as Megatron-LM's
    MegatronPretrainingRandomSampler with data sharding). One pass of __iter__ is the rest of
    the current epoch; consumed_samples advances as batches are drawn, so the next pass is the
    next epoch.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"--micro-batch-size must be >= 1, got {micro_batch_size}")
        assert 0 <= data_parallel_rank < data_parallel_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.num_samples_per_step = micro_batch_size * data_parallel_size
        self.samples_per_epoch = total_samples - total_samples % self.num_samples_per_step
        if self.samples_per_epoch == 0:
            raise ValueError(f"--dataloader-type cyclic: the split has {total_samples} samples, "
                             f"fewer than one step's {self.num_samples_per_step}")
        self.consumed_samples = consumed_samples

    def __len__(self) -> int:
        return (self.samples_per_epoch - self.consumed_samples % self.samples_per_epoch) \
            // self.num_samples_per_step

    def __iter__(self) -> Iterator[List[int]]:
        epoch, done = divmod(self.consumed_samples, self.samples_per_epoch)
        share = self.samples_per_epoch // self.data_parallel_size  # this rank's, in samples
        first = self.data_parallel_rank * share
        generator = torch.Generator()
        generator.manual_seed(epoch)
        order = torch.randperm(share, generator=generator)[done // self.data_parallel_size:]
        order = order.tolist()
        for start in range(0, len(order) - self.micro_batch_size + 1, self.micro_batch_size):
            self.consumed_samples += self.num_samples_per_step
            yield [first + index for index in order[start:start + self.micro_batch_size]]


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


def build_data_loader(dataset, micro_batch_size: int, consumed_samples: int = 0,
                      data_parallel_rank: int = 0, data_parallel_size: int = 1,
                      num_workers: int = 0, shuffle: bool = False,
                      exit_signal: Optional[str] = None
                      ) -> Optional[torch.utils.data.DataLoader]:
    """DataLoader over one split for one data-parallel rank; None when dataset is None.
    shuffle: RandomBatchSampler's order (--dataloader-type cyclic), else the dataset's.
    exit_signal (--exit-signal-handler's signal, e.g. 'SIGTERM'): its workers ignore the first
    one, as Megatron-LM's ignore it.

    It has a generator of its own: each iterator of a DataLoader draws its workers' base seed
    from its generator, by default torch's global one, which on CPU is also dropout's (outside
    the tracker's regions: tp=1 without --sequence-parallel). The iterators start lazily (at
    the first batch, again at each pass), so a resumed run would draw that seed after its RNG
    states were restored, where the uninterrupted run drew it long before, and its dropout
    masks would differ from there on. Nothing in the samples depends on that seed (the
    datasets and collate_batch draw no random numbers)."""
    if dataset is None:
        return None
    sampler = (RandomBatchSampler if shuffle else PretrainingBatchSampler)(
        len(dataset), consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
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
                        shuffle: bool = False, exit_signal: Optional[str] = None
                        ) -> Optional[Iterator]:
    """Iterator of batch dicts (see collate_batch); cyclic restarts at the end of the split
    (Megatron-LM's cyclic_iter; with shuffle, the next epoch's order); exit_signal:
    build_data_loader's."""
    loader = build_data_loader(dataset, micro_batch_size, consumed_samples,
                               data_parallel_rank, data_parallel_size, num_workers, shuffle,
                               exit_signal)
    if loader is None:
        return None
    if not cyclic:
        return iter(loader)

    def _cycle():
        try:
            while True:
                yield from loader
        finally:  # persistent workers: ended with the iterator
            shut_down(getattr(loader, "_iterator", None))
            loader._iterator = None
    return _cycle()


def shut_down(iterator) -> None:
    """End the worker processes behind a build_data_iterator iterator (None: nothing) now,
    rather than when the rank exits: a single pass's DataLoader iterator, or a cyclic
    iterator's generator (closed)."""
    if hasattr(iterator, "_shutdown_workers"):  # torch's multi-process DataLoader iterator
        iterator._shutdown_workers()
    elif hasattr(iterator, "close"):
        iterator.close()


# ---------------------------------------------------------------------------------------------
# The trainer's iterators, and training phases
# ---------------------------------------------------------------------------------------------

def phase_start(args, iteration: int) -> Tuple[int, int]:
    """(the first iteration of the phase ITERATION is in, the samples that phase trains on):
    with --phase-transition-iterations each phase builds its datasets anew, from their start
    (Megatron-LM's rule; the last phase ends at --train-iters' samples)."""
    total = getattr(args, "train_samples", None) or args.train_iters * args.global_batch_size
    if not getattr(args, "phase_transition_iterations", None):
        return 0, total
    bounds = [0, *phase_transition_iterations(args.phase_transition_iterations),
              args.train_iters]
    first = max(bound for bound in bounds if bound <= iteration)
    after = min((bound for bound in bounds if bound > iteration), default=args.train_iters)
    return first, max(after - first, 1) * args.global_batch_size


def phase_transition_at(iteration: int, args) -> bool:
    """Whether a phase ends after ITERATION (the run then saves and stops, as Megatron-LM)."""
    transitions = getattr(args, "phase_transition_iterations", None)
    return bool(transitions) and iteration in phase_transition_iterations(transitions) \
        and iteration < args.train_iters


def check_phase_resume(saved_args: Optional[Dict], args) -> None:
    """With --phase-transition-iterations a phase's position is counted in global batches:
    refuse a checkpoint saved with another --global-batch-size (Megatron-LM's check)."""
    if not getattr(args, "phase_transition_iterations", None) or not saved_args:
        return
    saved = saved_args.get("global_batch_size")
    if saved is not None and saved != args.global_batch_size:
        raise ValueError(f"--phase-transition-iterations: the checkpoint was saved with "
                         f"--global-batch-size {saved}, this run has {args.global_batch_size} "
                         f"(phases are counted in global batches)")


def consumed_validation_samples(args, iteration: int) -> int:
    """Where validation resumes: the evaluations before ITERATION took their samples
    (Megatron-LM's count for a checkpoint that does not record it); 0 with --skip-train."""
    if getattr(args, "skip_train", False) or not args.eval_interval:
        return 0
    return (iteration // args.eval_interval) * args.eval_iters * args.global_batch_size


def _check_enough(dataset, needed: int, split: str) -> None:
    if dataset is not None and len(dataset) < needed:
        raise ValueError(f"--data-path: the {split} data holds {len(dataset)} samples, fewer "
                         f"than the {needed} this run reads with --dataloader-type single "
                         f"(unweighted prefixes are read once each: give weights, or more "
                         f"data)")


def build_iterators(args, tokenizer, num_chunks: int, consumed_samples: int, iteration: int = 0,
                    data_parallel_rank: Optional[int] = None):
    """(train, validation) iterators, one per model chunk (the interleaved schedule draws a
    micro-batch for each chunk's forward step, and every chunk must see the same samples); the
    validation ones None where no data or no evaluation. Every rank reads the samples of its
    data-parallel rank (TP peers read the same). --dataloader-type single: each sample once,
    from where the run (its phase) and its evaluations stopped; cyclic: a random order,
    repeating."""
    if data_parallel_rank is None:
        from megatron.core import parallel_state

        data_parallel_rank = parallel_state.get_data_parallel_rank()
    first_iteration, train_samples = phase_start(args, iteration)
    num_samples = train_valid_test_num_samples(args.train_iters, args.global_batch_size,
                                               args.eval_interval, args.eval_iters)
    num_samples[0] = train_samples
    train_ds, valid_ds, _ = build_datasets_from_args(args, tokenizer, args.model_type,
                                                     num_samples)
    cyclic = (getattr(args, "dataloader_type", None) or "single") == "cyclic"
    train_consumed = consumed_samples - first_iteration * args.global_batch_size
    valid_consumed = consumed_validation_samples(args, iteration)
    if not cyclic:
        _check_enough(train_ds, train_samples, "train")
        _check_enough(valid_ds if args.eval_iters else None, num_samples[1], "validation")

    # --exit-signal-handler: the workers ignore the signal (a job-wide one reaches them too)
    caught = args.exit_signal if getattr(args, "exit_signal_handler", False) else None

    def iterators(dataset, consumed: int):
        return [build_data_iterator(dataset, args.micro_batch_size, consumed, data_parallel_rank,
                                    args.data_parallel_size, args.num_workers, cyclic=cyclic,
                                    shuffle=cyclic, exit_signal=caught)
                for _ in range(num_chunks)]

    train_iter = iterators(train_ds, train_consumed)
    valid_iter = iterators(valid_ds, valid_consumed) if valid_ds is not None \
        and args.eval_iters > 0 else None
    return train_iter, valid_iter
