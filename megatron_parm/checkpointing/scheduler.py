"""Resuming the learning-rate schedule: Megatron-LM's rules.

A checkpoint holds the schedule it was trained with (Megatron's OptimizerParamScheduler state:
peak and minimum learning rate, warmup and decay lengths in samples, decay style, weight decay
and its schedule's length, and the samples it has advanced by), whether it counted iterations
(--train-iters) or samples (--train-samples): both are samples there, so a run may resume the
other kind's checkpoint. A resumed run whose command line describes another schedule must
say which one to follow, as in Megatron-LM:

    --override-opt_param-scheduler       the command line's values
    --use-checkpoint-opt_param-scheduler the checkpoint's values
    neither                              a difference is a CheckpointError naming both values
                                         and the two flags

    schedule_differences(saved, scheduler, saved_batch, batch) -> [('--lr', '0.003 in ...'), ...]
    check_schedule(path, saved, scheduler, ...)                 raises on differences
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from megatron_parm.checkpointing.errors import CheckpointError
from megatron_parm.wording import plural

OVERRIDE_FLAG = "--override-opt_param-scheduler"
USE_CHECKPOINT_FLAG = "--use-checkpoint-opt_param-scheduler"

# (key in the scheduler's state dict and attribute of the scheduler, the flag that sets it in
#  iteration-based training, in sample-based training (--train-samples), whether it counts
#  samples)
SCHEDULE_FIELDS = (
    ("max_lr", "--lr", "--lr", False),
    ("min_lr", "--min-lr", "--min-lr", False),
    ("lr_warmup_steps", "--lr-warmup-iters (or --lr-warmup-fraction)",
     "--lr-warmup-samples (or --lr-warmup-fraction)", True),
    ("lr_decay_steps", "--lr-decay-iters (default: --train-iters)",
     "--lr-decay-samples (default: --train-samples)", True),
    ("lr_decay_style", "--lr-decay-style", "--lr-decay-style", False),
    ("start_wd", "--start-weight-decay (default: --weight-decay)",
     "--start-weight-decay (default: --weight-decay)", False),
    ("end_wd", "--end-weight-decay (default: --weight-decay)",
     "--end-weight-decay (default: --weight-decay)", False),
    ("wd_incr_steps", "--train-iters (the weight-decay schedule's length)",
     "--train-samples (the weight-decay schedule's length)", True),
    ("wd_incr_style", "--weight-decay-incr-style", "--weight-decay-incr-style", False),
)


def _describe(value, samples: bool, batch: Optional[int]) -> str:
    if not samples:
        return repr(value)
    if batch and value % batch == 0:
        return f"{plural(value // batch, 'iteration')} ({plural(value, 'sample')})"
    return plural(value, "sample")


def schedule_differences(saved: dict, scheduler, saved_batch: Optional[int],
                         batch: Optional[int], sample_based: bool = False
                         ) -> List[Tuple[str, str]]:
    """(flag, both values) for each value in which the scheduler (built from the command line)
    differs from the checkpoint's state SAVED; *_batch: the global batch sizes, to show
    iterations (None: samples only); sample_based: the command line has --train-samples."""
    differences = []
    for key, iterations_flag, samples_flag, samples in SCHEDULE_FIELDS:
        flag = samples_flag if sample_based else iterations_flag
        if key not in saved or not hasattr(scheduler, key) or flag in dict(differences):
            continue
        old, new = saved[key], getattr(scheduler, key)
        if old != new:
            differences.append((flag, f"{_describe(old, samples, saved_batch)} in the "
                                      f"checkpoint, {_describe(new, samples, batch)} on the "
                                      f"command line"))
    return differences


def check_schedule(path: str, saved: dict, scheduler, saved_batch: Optional[int],
                   batch: Optional[int], sample_based: bool = False) -> None:
    """Raise CheckpointError when the command line's schedule differs from the checkpoint's
    and neither flag says which to use."""
    if scheduler.override_opt_param_scheduler or scheduler.use_checkpoint_opt_param_scheduler:
        return
    differences = schedule_differences(saved, scheduler, saved_batch, batch, sample_based)
    if differences:
        raise CheckpointError(
            f"{path}: the learning-rate schedule on the command line differs from the "
            f"checkpoint's:\n  " + "\n  ".join(f"{flag}: {values}" for flag, values in differences)
            + f"\n  give {OVERRIDE_FLAG} to "
            f"use the command line's or {USE_CHECKPOINT_FLAG} to keep the checkpoint's")
