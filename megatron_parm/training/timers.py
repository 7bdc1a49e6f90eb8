"""Megatron-LM's timers (--timing-log-level, --timing-log-option, --no-barrier-with-level-1-timing,
--log-timers-to-tensorboard): Megatron-Core's Timers, handed to the model's and the optimizer's
configs as Megatron-LM hands them, so that Megatron-Core's schedules, gradient finalization and
optimizer time themselves; the training loop times the optimizer step and the forward steps
their batches.

    TIMER_NAMES[level]          the timers Megatron-LM prints at --timing-log-level LEVEL (each
                                level adds to the one below; 0: none)
    Timers.install(args, model, optimizer)
      (name, log_level)         a timer, Megatron-Core's (a dummy above --timing-log-level)
      .region(name, log_level)  a `with` block timed by that timer (level 1 after a barrier,
                                unless --no-barrier-with-level-1-timing)
      .paused()                 a `with` block the timers do not see (evaluation: Megatron-LM
                                times training steps only)
      .log(normalizer)          the timers' line block, printed on rank 0; resets them
      .write(writers, iteration, normalizer)   their slowest rank to TensorBoard / W&B
                                ('<name>-time', seconds per iteration as Megatron-Core's
                                Timers.write writes them), without resetting

Which timer runs where (Megatron-Core 0.16.1 and this loop):
  level 1  forward-backward (the schedule), all-grads-sync, layernorm- and embedding-grads-all-
           reduce (finalize_model_grads), optimizer (the loop's step), optimizer-copy-to-main-
           grad, -unscale-and-check-inf, -clip-main-grad, -count-zeros, -inner-step,
           -copy-main-to-model-params (the optimizer's phases; mixed precision runs them all),
           params-all-gather (the distributed optimizer)
  level 2  batch-generator (the forward steps), forward-compute, backward-compute (the
           schedule), the pipeline's sends and receives
A timer that did not run in the interval is left out of the block (Megatron-Core's rule).
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Tuple

# Megatron-LM's training_log: the timers it logs per level.
TIMER_NAMES: Dict[int, Tuple[str, ...]] = {
    0: (),
    1: ("forward-backward", "layernorm-grads-all-reduce", "embedding-grads-all-reduce",
        "all-grads-sync", "params-all-gather", "optimizer-copy-to-main-grad",
        "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad", "optimizer-count-zeros",
        "optimizer-inner-step", "optimizer-copy-main-to-model-params", "optimizer"),
    2: ("batch-generator", "forward-compute", "backward-compute", "forward-recv",
        "forward-send", "backward-recv", "backward-send", "forward-send-forward-recv",
        "forward-send-backward-recv", "backward-send-forward-recv",
        "backward-send-backward-recv", "forward-backward-send-forward-backward-recv"),
}


def timer_names(level: int) -> List[str]:
    """The timers logged at --timing-log-level LEVEL, in Megatron-LM's order."""
    return [name for lower in range(level + 1) for name in TIMER_NAMES[lower]]


def _configs(model, optimizer) -> list:
    """The configs Megatron-Core reads its timers from: each model chunk's, each optimizer's."""
    from megatron_parm.training.model import unwrap

    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [unwrap(chunk).config for chunk in model] + [part.config for part in parts]


class Timers:
    """Megatron-Core's Timers of one training run (see the module docstring)."""

    def __init__(self, args, configs: list):
        from megatron.core.timers import Timers as MegatronTimers

        self.timers = MegatronTimers(args.timing_log_level, args.timing_log_option)
        self.names = timer_names(args.timing_log_level)
        self.barrier = args.barrier_with_L1_time
        self.configs = configs
        for config in configs:
            config.timers = self.timers
            config.barrier_with_L1_time = args.barrier_with_L1_time

    @classmethod
    def install(cls, args, model, optimizer) -> "Timers":
        return cls(args, _configs(model, optimizer))

    def __call__(self, name: str, log_level=None):
        return self.timers(name, log_level=log_level)

    @contextlib.contextmanager
    def region(self, name: str, log_level: int):
        timer = self.timers(name, log_level=log_level)
        timer.start(barrier=self.barrier and log_level == 1)
        try:
            yield
        finally:
            timer.stop()

    @contextlib.contextmanager
    def paused(self):
        for config in self.configs:
            config.timers = None
        try:
            yield
        finally:
            for config in self.configs:
                config.timers = self.timers

    def log(self, normalizer: int) -> None:
        """The block of the timers of this level, ms per iteration (NORMALIZER iterations
        since the last call), printed on rank 0; resets them. Collective."""
        import torch

        if not self.names:
            return
        text = self.timers.get_all_timers_string(self.names, normalizer=normalizer, reset=True)
        if text is not None and torch.distributed.get_rank() == 0:
            print(text, flush=True)

    def write(self, writers, iteration: int, normalizer: int) -> None:
        """Each timer's slowest rank, seconds per iteration, to TensorBoard / W&B as
        '<name>-time'; keeps the counts for log(). Collective."""
        if not self.names:
            return
        # Timers.write's reduction, once for both writers (its own write takes one at a time)
        times = self.timers._get_global_min_max_time(self.names, reset=False, barrier=False,
                                                     normalizer=normalizer)
        writers.scalars({f"{name}-time": slowest for name, (_, slowest) in times.items()},
                        iteration)
