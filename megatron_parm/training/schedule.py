"""The learning-rate and weight-decay schedule and the global batch of each iteration, as
Megatron-LM's training makes them from its flags; Megatron-Core does the arithmetic (its
OptimizerParamScheduler and its number-of-micro-batches calculators).

    train_iters_of_samples(args)    --train-samples in iterations (Megatron-LM's
                                    update_train_iters: the ramp's iterations, then whole batches)
    scheduler_lengths(args)         the schedule's lengths, in samples
    build_scheduler(args, optimizer)     Megatron-Core's OptimizerParamScheduler for the flags
    ramp_batch_sizes(args)          the global batch sizes a run goes through, in order
    running_batch_size(batch, per_step, decrease)   what an iteration runs of a global batch
    BatchSchedule(args)             the global batch and micro-batches of the next iteration, from
                                    the samples consumed so far

Units (Megatron-LM's): the scheduler counts samples. In iteration-based training (--train-iters)
every length is its flag x --global-batch-size; with --train-samples they are the *-samples
flags themselves, and --rampup-batch-size grows the global batch with the consumed samples. An
iteration advances the schedule and the consumed samples by the batch it ran (with
--decrease-batch-size-if-needed, the batch rounded down to whole micro-batches on every
data-parallel rank; the rest counts as skipped samples).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional

if TYPE_CHECKING:  # Megatron-Core's modules are imported where used: the launcher's check of
    # the flags (training.arguments.validate) reads this module without Megatron-Core
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def sample_based(args) -> bool:
    return args.train_samples is not None


def _calculator(args, rank: int = 0):
    """Megatron-Core's calculator for the flags (rank 0 logs its batch-size changes)."""
    from megatron.core.num_microbatches_calculator import (
        ConstantNumMicroBatchesCalculator,
        RampupBatchsizeNumMicroBatchesCalculator,
    )

    common = (args.global_batch_size, args.micro_batch_size, args.data_parallel_size,
              args.decrease_batch_size_if_needed, rank)
    if args.rampup_batch_size is None:
        return ConstantNumMicroBatchesCalculator(*common)
    start, increment, samples = (int(value) for value in args.rampup_batch_size)
    return RampupBatchsizeNumMicroBatchesCalculator(*common, start, increment, samples)


def train_iters_of_samples(args) -> int:
    """The iterations --train-samples makes, as Megatron-LM counts them: whole global batches;
    with --rampup-batch-size the ramp's iterations first (its batch sizes, not rounded down),
    then whole batches of the rest (a partial last batch is dropped)."""
    if args.rampup_batch_size is None:
        return args.train_samples // args.global_batch_size
    calculator = _calculator(args, rank=-1)
    iterations = consumed = 0
    ramp_samples = int(args.rampup_batch_size[2])
    while consumed <= ramp_samples and consumed <= args.train_samples:
        calculator.update(consumed, consistency_check=False)
        consumed += calculator.get_current_global_batch_size()
        iterations += 1
    if args.train_samples > consumed:
        iterations += (args.train_samples - consumed) // args.global_batch_size
    return iterations


def scheduler_lengths(args) -> Dict[str, Optional[float]]:
    """OptimizerParamScheduler's lengths in samples (lr_warmup_steps, lr_decay_steps,
    wsd_decay_steps, wd_incr_steps), as Megatron-LM's get_optimizer_param_scheduler computes
    them. Needs the defaults arguments.validate fills (--lr-decay-iters / -samples)."""
    if sample_based(args):
        decay = args.lr_decay_samples
        lengths = dict(lr_decay_steps=decay, wd_incr_steps=args.train_samples,
                       wsd_decay_steps=args.lr_wsd_decay_samples,
                       lr_warmup_steps=args.lr_warmup_samples)
    else:
        batch = args.global_batch_size
        decay = args.lr_decay_iters * batch
        lengths = dict(lr_decay_steps=decay, wd_incr_steps=args.train_iters * batch,
                       wsd_decay_steps=None if args.lr_wsd_decay_iters is None
                       else args.lr_wsd_decay_iters * batch,
                       lr_warmup_steps=args.lr_warmup_iters * batch)
    if args.lr_warmup_fraction is not None:
        lengths["lr_warmup_steps"] = args.lr_warmup_fraction * decay
    return lengths


def build_scheduler(args, optimizer) -> "OptimizerParamScheduler":
    """Megatron-Core's scheduler of the learning rate and weight decay for the flags; on resume
    (Megatron-LM's rules, checked in checkpointing.scheduler) the command line's schedule, the
    checkpoint's, or (neither flag) a difference refused."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style, lr_wsd_decay_style=args.lr_wsd_decay_style,
        start_wd=args.start_weight_decay, end_wd=args.end_weight_decay,
        wd_incr_style=args.weight_decay_incr_style,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        **scheduler_lengths(args))


def ramp_batch_sizes(args) -> List[int]:
    """The global batch sizes of a run in order: --rampup-batch-size's start, each increment,
    up to --global-batch-size; that one alone without it."""
    if args.rampup_batch_size is None:
        return [args.global_batch_size]
    start, increment, _ = (int(value) for value in args.rampup_batch_size)
    return list(range(start, args.global_batch_size + 1, increment))


def running_batch_size(global_batch_size: int, per_step: int, decrease: bool) -> int:
    """The samples an iteration runs of GLOBAL_BATCH_SIZE: all of them, or with
    --decrease-batch-size-if-needed the most whole micro-batches on every data-parallel rank
    (PER_STEP = micro-batch size x data-parallel size) that fit."""
    return global_batch_size // per_step * per_step if decrease else global_batch_size


class BatchSchedule:
    """The global batch of the next iteration and its micro-batches per data-parallel rank,
    from the samples consumed so far (Megatron-Core's calculator: constant, or ramping up)."""

    def __init__(self, args, rank: int = 0):
        self.calculator = _calculator(args, rank)
        self.per_step = args.micro_batch_size * args.data_parallel_size

    def update(self, consumed_samples: int) -> bool:
        """Move to the batch of CONSUMED_SAMPLES; whether the micro-batches changed."""
        before = self.num_microbatches
        self.calculator.update(consumed_samples, consistency_check=True, verbose=True)
        return self.num_microbatches != before

    @property
    def num_microbatches(self) -> int:
        return self.calculator.get()

    @property
    def global_batch_size(self) -> int:
        """The global batch the schedule asks for now."""
        return self.calculator.get_current_global_batch_size()

    @property
    def running(self) -> int:
        """The samples the next iteration runs (and the schedule advances by)."""
        return self.num_microbatches * self.per_step

    @property
    def skipped(self) -> int:
        """The samples of the global batch it leaves out (--decrease-batch-size-if-needed)."""
        return self.global_batch_size - self.running
