"""The checkpoint flags: where to save and load, when, in which format, and how a resume treats
what it finds; and the run's stops (--exit-*)."""

from __future__ import annotations

from typing import List

from megatron_parm.settings.flag import Flag, non_negative_int, positive_int

GROUP = "checkpoints"
UNCATCHABLE = ("SIGKILL", "SIGSTOP")  # no process can handle them


def catchable(flag: str, value) -> None:
    if value in UNCATCHABLE:
        raise ValueError(f"{flag} {value}: no process can catch {value} (pick another signal, "
                         f"e.g. SIGTERM or SIGUSR1)")


def flags() -> List[Flag]:
    return [
        Flag("--save", GROUP, help="Checkpoint folder (torch_dist format)."),
        Flag("--load", GROUP, help="Checkpoint folder to start from."),
        Flag("--save-interval", GROUP, check=positive_int,
             help="Also save every this many iterations (always at the end)."),
        Flag("--exit-interval", GROUP, check=positive_int,
             help="Stop (after saving, with --save) once the iteration is a multiple of this."),
        Flag("--exit-duration-in-mins", GROUP, check=non_negative_int,
             help="Stop (after saving, with --save) after the first iteration that ends more "
                  "than this many minutes after the run started (its earliest rank's start; "
                  "every rank agrees; 0: never). An evaluation that runs past it ends early."),
        Flag("--exit-signal-handler", GROUP,
             help="On --exit-signal (SIGTERM: Slurm's time limit or preemption), finish the "
                  "iteration, save (with --save) and stop. The data loader's workers ignore "
                  "that signal."),
        Flag("--exit-signal", GROUP, check=catchable,
             help="The signal --exit-signal-handler catches (default SIGTERM; SIGUSR1 with "
                  "Slurm's --signal=USR1@SECONDS, say). megatron_parm.launch passes it on to "
                  "the ranks when it receives it, or SIGTERM or SIGINT."),
        Flag("--override-opt_param-scheduler", GROUP,
             help="On resume, take the learning-rate and weight-decay schedule (--lr, "
                  "--min-lr, the warmup and decay lengths in iterations or samples, "
                  "--lr-decay-style, the weight decay and its schedule, --train-iters or "
                  "--train-samples) from the command line, not the checkpoint. Without this "
                  "or the next flag a difference is an error."),
        Flag("--use-checkpoint-opt_param-scheduler", GROUP,
             help="On resume, keep the checkpoint's learning-rate schedule."),
        Flag("--dist-ckpt-optim-fully-reshardable", GROUP,
             help="With --use-distributed-optimizer: save its state gathered into model-space "
                  "tensors (Megatron-Core's 'fully_reshardable' format), which load in any "
                  "(tp, pp, ep, etp) layout and without the distributed optimizer. Default: "
                  "each rank's shard as it is ('dp_reshardable'), which loads only at the same "
                  "tp, pp, ep and etp (any data-parallel size)."),
        Flag("--distrib-optim-fully-reshardable-mem-efficient", GROUP,
             help="With --dist-ckpt-optim-fully-reshardable: gather the state on the first "
                  "data-parallel rank over gloo, which alone writes it, instead of on every "
                  "rank over NCCL (less memory; always so without a GPU)."),
        Flag("--skip-train", GROUP,
             help="Load --load, evaluate (--eval-iters batches) and stop."),
    ]
