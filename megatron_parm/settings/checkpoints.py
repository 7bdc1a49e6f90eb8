"""The checkpoint flags: where to save and load, when, in which format, what a save holds and a
load takes, and how a resume treats what it finds; and the run's stops (--exit-*)."""

from __future__ import annotations

from typing import List

from megatron_parm.settings.flag import Flag, non_negative_int, positive_int

GROUP = "checkpoints"
# --ckpt-format's values that run here (torch_dcp is torch FSDP2's format; fsdp_dtensor,
# Megatron-FSDP's, is taken with --use-megatron-fsdp, which saves and loads nothing here).
CKPT_FORMATS = ("torch_dist", "torch", "fsdp_dtensor")
# --non-persistent-ckpt-type's values that run here ('local' needs NVIDIA's resiliency package).
NON_PERSISTENT_TYPES = ("global",)
UNCATCHABLE = ("SIGKILL", "SIGSTOP")  # no process can handle them


def catchable(flag: str, value) -> None:
    if value in UNCATCHABLE:
        raise ValueError(f"{flag} {value}: no process can catch {value} (pick another signal, "
                         f"e.g. SIGTERM or SIGUSR1)")


def flags() -> List[Flag]:
    return [
        Flag("--save", GROUP, help="Checkpoint folder."),
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
        *_format_flags(),
        *_content_flags(),
        *_which_flags(),
    ]


def _format_flags() -> List[Flag]:
    """How a checkpoint is written and read (Megatron-Core's strategies)."""
    return [
        Flag("--ckpt-format", GROUP, supported=CKPT_FORMATS,
             unsupported="torch_dcp is the format of torch FSDP2, which is not built here "
                         "(torch_dist and torch are)",
             help="torch_dist: Megatron-Core's distributed checkpoint (loads in any layout); "
                  "torch: Megatron-LM's per-rank files iter_N/mp_rank_TT[_PPP][_EEE]/"
                  "model_optim_rng.pt (loads at the same tp, pp, vpp, ep and etp). With "
                  "torch_dist, a --load folder of either format loads. fsdp_dtensor: "
                  "Megatron-FSDP's, which --use-megatron-fsdp needs (as in Megatron-LM); its "
                  "saving and loading is not built here."),
        Flag("--auto-detect-ckpt-format", GROUP,
             help="Load whichever format the --load folder holds (with --ckpt-format torch, a "
                  "torch_dist folder too)."),
        Flag("--dist-ckpt-strictness", GROUP,
             help="What a torch_dist load does with tensors the model asks for that the "
                  "checkpoint lacks ('unexpected') and tensors of the checkpoint the model does "
                  "not ask for ('missing'): Megatron-Core's StrictHandling. assume_ok_unexpected: "
                  "a lacking tensor is an error; log_*: logged, the model keeps its own values; "
                  "raise_*: an error naming them; return_*: named in a note; ignore_all: "
                  "nothing. *_unexpected look at lacking tensors only, *_all at both."),
        Flag("--no-ckpt-fully-parallel-save", GROUP,
             help="Save each tensor replicated over the data-parallel ranks from its first "
                  "replica only. Default (Megatron-LM's): the data-parallel ranks share the "
                  "writing (Megatron-Core's FullyParallelSaveStrategyWrapper); the checkpoint "
                  "holds the same tensors either way."),
        Flag("--ckpt-fully-parallel-load", GROUP,
             help="Each data-parallel rank reads a share of the replicated tensors and they "
                  "exchange them (Megatron-Core's FullyParallelLoadStrategyWrapper); the "
                  "loaded state is the same."),
        Flag("--ckpt-assume-constant-structure", GROUP,
             help="The saves of a run keep one save strategy, which reuses the previous "
                  "save's plan and metadata once two saves agree (Megatron-Core's cached "
                  "checkpoint structure), instead of planning every save anew."),
    ]


def _content_flags() -> List[Flag]:
    """What a save writes, what a load takes, which saves are kept."""
    return [
        Flag("--no-save-optim", GROUP,
             help="Save no optimizer state and no learning-rate schedule."),
        Flag("--no-save-rng", GROUP, help="Save no RNG states."),
        Flag("--no-load-optim", GROUP,
             help="Load neither the optimizer state nor the learning-rate schedule (they start "
                  "fresh; the iteration and the data position are the checkpoint's)."),
        Flag("--no-load-rng", GROUP,
             help="Do not restore the RNG states (the generators keep --seed's)."),
        Flag("--finetune", GROUP,
             help="Load the model's weights only: iteration 0, no optimizer state, schedule or "
                  "RNG states, the data from its start."),
        Flag("--pretrained-checkpoint", GROUP,
             help="Where --load holds no checkpoint (or is not given): load this folder's, as "
                  "--finetune does. Later runs resume from --load."),
        Flag("--save-retain-interval", GROUP, check=positive_int,
             help="Keep only the saves whose iteration is a multiple of this (a multiple of "
                  "--save-interval), and the latest: each save deletes the one before it when "
                  "that is not a multiple."),
        Flag("--non-persistent-save-interval", GROUP, check=positive_int,
             help="With --non-persistent-ckpt-type global: also save every this many "
                  "iterations to a folder that keeps only its latest checkpoint; a resume "
                  "loads it when it is newer than --load's."),
        Flag("--non-persistent-ckpt-type", GROUP, supported=NON_PERSISTENT_TYPES,
             unsupported="local (and in_memory) non-persistent checkpoints need NVIDIA's "
                         "resiliency package (nvidia-resiliency-ext), which is not used here "
                         "(global is built)",
             help="global: the non-persistent checkpoints are ordinary ones in "
                  "--non-persistent-global-ckpt-dir (default: SAVE/non_persistent)."),
        Flag("--non-persistent-global-ckpt-dir", GROUP,
             help="The folder of global non-persistent checkpoints (default: "
                  "SAVE/non_persistent)."),
    ]


def _which_flags() -> List[Flag]:
    """Which checkpoint a run loads, and which flags it takes from it."""
    return [
        Flag("--ckpt-step", GROUP, check=positive_int,
             help="Load this iteration of --load (instead of the one its tracker names)."),
        Flag("--exit-on-missing-checkpoint", GROUP,
             help="Stop, with an error, where --load does not exist or holds no checkpoint "
                  "yet, instead of starting from scratch."),
        Flag("--use-checkpoint-args", GROUP,
             help="Take the model's flags from the --load checkpoint (Megatron-LM's list: "
                  "layers, sizes, heads, positions, experts, ...) over the command line's."),
        Flag("--use-mp-args-from-checkpoint-args", GROUP,
             help="With --use-checkpoint-args: the tensor, pipeline and expert parallel sizes "
                  "too."),
        Flag("--no-use-tokenizer-model-from-checkpoint-args", GROUP,
             help="With --use-checkpoint-args: keep the command line's --tokenizer-type and "
                  "--tokenizer-model."),
    ]
