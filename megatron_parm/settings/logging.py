"""The logging and validation flags: what is printed and written (the console, TensorBoard,
Weights & Biases, progress.txt), and how often. Their effects: training/log.py (the iteration
line, validation), training/writers.py (TensorBoard, W&B), training/timers.py (Megatron-Core's
timers), training/flops.py (--log-throughput), training/memory.py, training/params_norm.py,
training/progress_log.py."""

from __future__ import annotations

from typing import List

from megatron_parm.settings.flag import Flag, non_negative_int, positive_int

GROUP = "logging"


def flags() -> List[Flag]:
    return [
        Flag("--eval-interval", GROUP, check=positive_int,
             help="Evaluate every this many iterations (default: only at the end)."),
        Flag("--eval-iters", GROUP, check=non_negative_int),
        Flag("--log-interval", GROUP, check=positive_int),
        Flag("--tensorboard-dir", GROUP),
        *_line_flags(),
        *_timing_flags(),
        *_tensorboard_flags(),
        *_wandb_flags(),
        Flag("--logging-level", GROUP, check=non_negative_int,
             help="Python's logging level for every logger (10 DEBUG, 20 INFO, 30 WARNING), "
                  "printed to stdout as Megatron-LM's handler prints it (default: Python's, "
                  "warnings and errors on stderr)."),
        Flag("--log-progress", GROUP,
             help="With --save: append Megatron-LM's lines to SAVE/progress.txt (each job's "
                  "start, each checkpoint with the job's and the cumulative TFLOP/s per rank, "
                  "FLOPs and tokens so far)."),
        Flag("--parm-timing-breakdown", GROUP, kind="switch",
             help="Time each step's parts (MoE dispatch, experts, combine; attention and dense "
                  "MLP; TP/SP collectives; DP gradient reduction; optimizer; rest) and print "
                  "their means per logged iteration, with the share of the host's cores busy "
                  "(synchronises the device at every boundary; "
                  "megatron_parm/training/timing.py)."),
        Flag("--parm-timing-file", GROUP, str,
             help="Also append the breakdown as JSON lines to this file (rank 0); implies "
                  "--parm-timing-breakdown."),
    ]


def _line_flags() -> List[Flag]:
    """What the iteration line adds (and TensorBoard with it)."""
    return [
        Flag("--log-params-norm", GROUP,
             help="The parameters' L2 norm over the whole model (each model-parallel shard "
                  "once) in the iteration line and TensorBoard (params-norm)."),
        Flag("--log-num-zeros-in-grad", GROUP,
             help="The number of zero gradient entries (Megatron-Core's optimizer counts them "
                  "after clipping) in the iteration line and TensorBoard (num-zeros)."),
        Flag("--log-throughput", GROUP,
             help="Model TFLOP/s per rank (Megatron-LM's FLOP count of the model, MoE experts "
                  "at top-k, over the iteration time and the world size) in the iteration line; "
                  "on CPU 'per GPU' means per rank (process)."),
        Flag("--log-memory-interval", GROUP, check=positive_int,
             help="Every this many iterations (at a log line) each rank of data-parallel rank "
                  "0 prints its memory: on a GPU the caching allocator's, on CPU the process's "
                  "resident memory and its peak."),
        Flag("--log-device-memory-used", GROUP,
             help="Add the whole device's memory in use to the memory line (on CPU: the "
                  "host's, total minus available)."),
        Flag("--moe-per-layer-logging", GROUP,
             help="Also write each layer's router losses to TensorBoard "
                  "(moe/<loss>_layer_<i>)."),
    ]


def _timing_flags() -> List[Flag]:
    """Megatron-Core's timers (training/timers.py)."""
    return [
        Flag("--timing-log-level", GROUP,
             help="Megatron-LM's timers printed after each iteration line: 0 none, 1 the "
                  "step's parts (forward-backward, gradient syncs, the optimizer's phases), 2 "
                  "also the micro-batches' (batch-generator, forward- and backward-compute, "
                  "pipeline sends and receives)."),
        Flag("--timing-log-option", GROUP,
             help="How the timers are reduced over the ranks: max, minmax or all (each rank)."),
        Flag("--no-barrier-with-level-1-timing", GROUP,
             help="Start the level-1 timers without a barrier over the ranks."),
    ]


def _tensorboard_flags() -> List[Flag]:
    """What TensorBoard (and W&B) receive, and how often."""
    return [
        Flag("--tensorboard-log-interval", GROUP, check=positive_int,
             help="Write the iteration's values to TensorBoard every this many iterations."),
        Flag("--tensorboard-queue-size", GROUP, check=positive_int,
             help="TensorBoard events queued before they are written to disk."),
        Flag("--log-timers-to-tensorboard", GROUP,
             help="Also write the iteration time, the throughput (with --log-throughput) and "
                  "the timers of --timing-log-level (their slowest rank) to TensorBoard."),
        Flag("--no-log-loss-scale-to-tensorboard", GROUP),
        Flag("--log-validation-ppl-to-tensorboard", GROUP,
             help="Also write each validation loss's perplexity (exp of the loss, capped at "
                  "exp(20))."),
        Flag("--log-memory-to-tensorboard", GROUP,
             help="Write memory at each TensorBoard write: on a GPU the caching allocator's "
                  "(mem-reserved-bytes, mem-allocated-bytes, mem-max-allocated-bytes, "
                  "mem-allocated-count), on CPU the process's resident memory "
                  "(mem-resident-bytes, mem-max-resident-bytes)."),
        Flag("--log-world-size-to-tensorboard", GROUP),
    ]


def _wandb_flags() -> List[Flag]:
    """Weights & Biases (training/writers.py), offline: the run is written to disk."""
    return [
        Flag("--wandb-project", GROUP,
             help="Log to Weights & Biases in offline mode (`wandb sync` uploads it) where the "
                  "optional package is installed (pip install 'megatron-parm[wandb]'); "
                  "without it the run says so once and goes on."),
        Flag("--wandb-exp-name", GROUP, help="The W&B run's name."),
        Flag("--wandb-save-dir", GROUP, help="Where W&B writes (default: SAVE/wandb)."),
        Flag("--wandb-entity", GROUP, help="The W&B user or team."),
    ]
