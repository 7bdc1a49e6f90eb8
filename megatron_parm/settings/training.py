"""The training flags: batches, iterations or samples, the learning-rate and weight-decay
schedule, data-parallel gradients, activation recompute (the optimizer's own: optimizer.py).

Megatron-LM's rules between them (iterations or samples, one warmup length, the weight-decay
schedule's ends) are training/arguments.py's; training/schedule.py turns them into Megatron-Core's
OptimizerParamScheduler and number-of-micro-batches calculator."""

from __future__ import annotations

from typing import List

from megatron_parm.perf_model.recompute import RECOMPUTE_MODULES
from megatron_parm.settings.flag import (
    Flag, non_negative_int, non_negative_number, positive_int)

GROUP = "training"

# The flags that say one setting in different units: the command line's choice replaces a config
# file's other one (a config's train_iters does not stand against --train-samples).
ALTERNATIVES = (
    ("train_iters", "train_samples"),
    ("lr_decay_iters", "lr_decay_samples"),
    ("lr_warmup_iters", "lr_warmup_samples", "lr_warmup_fraction"),
    ("lr_wsd_decay_iters", "lr_wsd_decay_samples"),
)


def _warmup_fraction(flag: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{flag} must be a number in [0, 1) (a share of the decay length), "
                         f"got {value!r}")


def _rampup(flag: str, value) -> None:
    start, increment, samples = value
    if start < 1 or increment < 1 or samples < 0:
        raise ValueError(f"{flag} takes <start batch size> <batch size increment> <ramp-up "
                         f"samples>: positive, positive and >= 0, got "
                         f"{' '.join(map(str, value))}")


def flags() -> List[Flag]:
    return [
        Flag("--micro-batch-size", GROUP, check=positive_int),
        Flag("--global-batch-size", GROUP, help="Default: micro-batch size x data-parallel "
             "size.", check=positive_int),
        Flag("--rampup-batch-size", GROUP, check=_rampup, metavar=("START", "INCREMENT",
                                                                    "SAMPLES"),
             help="Grow the global batch from START by INCREMENT up to --global-batch-size, "
                  "over the first SAMPLES samples (in equal shares of samples per batch size); "
                  "the micro-batches per iteration follow. Sample-based training only."),
        Flag("--decrease-batch-size-if-needed", GROUP,
             help="Run each global batch rounded down to a multiple of micro-batch size x "
                  "data-parallel size instead of refusing it (the samples left out are logged "
                  "as skipped)."),
        Flag("--train-iters", GROUP, check=positive_int,
             help="Iterations to train (or --train-samples)."),
        Flag("--train-samples", GROUP, check=positive_int,
             help="Samples to train instead of --train-iters: the schedule's lengths are then "
                  "in samples (--lr-decay-samples, --lr-warmup-samples, "
                  "--lr-wsd-decay-samples)."),
        *_schedule_flags(),
        Flag("--clip-grad", GROUP),
        Flag("--use-distributed-optimizer", GROUP,
             help="Shard the optimizer state and fp32 main parameters over the data-parallel "
                  "ranks (Megatron-Core's DistributedOptimizer)."),
        Flag("--num-distributed-optimizer-instances", GROUP, check=positive_int,
             help="With --use-distributed-optimizer: shard over data-parallel groups of DP / N "
                  "ranks, N copies of the optimizer (gradients reduce-scattered within a group, "
                  "then all-reduced across the N)."),
        Flag("--overlap-grad-reduce", GROUP,
             help="Reduce each gradient bucket during backward, as soon as it is complete "
                  "(Megatron-LM's flag)."),
        Flag("--overlap-param-gather", GROUP,
             help="With --use-distributed-optimizer and --overlap-grad-reduce: all-gather the "
                  "updated parameters during the next forward."),
        Flag("--ddp-bucket-size", GROUP, check=positive_int,
             help="Parameters per gradient bucket with --overlap-grad-reduce (default: "
                  "Megatron-Core's, max(40M, 1M x data-parallel size))."),
        Flag("--ddp-num-buckets", GROUP, check=positive_int,
             help="With --overlap-grad-reduce: this many gradient buckets (the rank's "
                  "parameters divided evenly; instead of --ddp-bucket-size)."),
        Flag("--ddp-reduce-scatter-with-fp32-accumulation", GROUP,
             help="With --use-distributed-optimizer: reduce-scatter the gradients as an "
                  "all-to-all and a sum in fp32 (for bf16 gradients)."),
        Flag("--use-megatron-fsdp", GROUP,
             help="Wrap the model in Megatron-Core's Megatron-FSDP instead of its DDP, sharding "
                  "over the data-parallel ranks what --data-parallel-sharding-strategy says "
                  "(needs --ckpt-format fsdp_dtensor, as in Megatron-LM; its checkpoints are "
                  "not built here: no --save or --load)."),
        Flag("--data-parallel-sharding-strategy", GROUP,
             help="With --use-megatron-fsdp: what is sharded over the data-parallel ranks. "
                  "no_shard: nothing (gradients all-reduced); optim: the optimizer state "
                  "(ZeRO-1); optim_grads: and the gradients, reduce-scattered after each "
                  "micro-batch's backward (ZeRO-2); optim_grads_params: and the parameters, "
                  "all-gathered per transformer layer before its forward and backward (ZeRO-3)."),
        Flag("--ddp-average-in-collective", GROUP,
             help="Average gradients in the collective (ReduceOp.AVG; NCCL only) instead of "
                  "dividing by the data-parallel size before summing."),
        Flag("--seed", GROUP),
        Flag("--calculate-per-token-loss", GROUP,
             help="Average the loss over every token of the global batch (Megatron-Core's "
                  "schedules with calculate_per_token_loss: each micro-batch's summed loss, "
                  "the gradients divided by the global batch's token count) instead of over "
                  "each micro-batch's tokens, then over the micro-batches. BERT's "
                  "sentence-order loss enters weighted by its micro-batch's tokens, as "
                  "Megatron-Core weights the router's losses."),
        *_recompute_flags(),
    ]


def _schedule_flags() -> List[Flag]:
    """The learning-rate and weight-decay schedule (Megatron-Core's OptimizerParamScheduler),
    in iterations or, with --train-samples, in samples."""
    return [
        Flag("--lr", GROUP),
        Flag("--min-lr", GROUP),
        Flag("--decoupled-lr", GROUP, check=non_negative_number,
             help="A learning rate of its own for the input embedding and the output layer "
                  "(the same schedule, to --decoupled-min-lr)."),
        Flag("--decoupled-min-lr", GROUP, check=non_negative_number,
             help="With --decoupled-lr: the embedding's and output layer's minimum learning "
                  "rate (default: --min-lr)."),
        Flag("--lr-decay-style", GROUP,
             help="WSD: warmup, stable at --lr, then the last --lr-wsd-decay-iters (or "
                  "-samples) of the decay length decay in --lr-wsd-decay-style."),
        Flag("--lr-wsd-decay-style", GROUP),
        Flag("--lr-decay-iters", GROUP, help="Default: --train-iters.", check=positive_int),
        Flag("--lr-decay-samples", GROUP, help="Default: --train-samples.", check=positive_int),
        Flag("--lr-wsd-decay-iters", GROUP, check=positive_int),
        Flag("--lr-wsd-decay-samples", GROUP, check=positive_int),
        Flag("--lr-warmup-fraction", GROUP, check=_warmup_fraction,
             help="Warm up over this share of the decay length (instead of --lr-warmup-iters "
                  "or --lr-warmup-samples)."),
        Flag("--lr-warmup-iters", GROUP, check=non_negative_int),
        Flag("--lr-warmup-samples", GROUP, check=non_negative_int),
        Flag("--lr-warmup-init", GROUP, check=non_negative_number,
             help="The learning rate warmup starts from."),
        Flag("--weight-decay", GROUP),
        Flag("--start-weight-decay", GROUP, check=non_negative_number,
             help="With --weight-decay-incr-style linear or cosine: the first weight decay."),
        Flag("--end-weight-decay", GROUP, check=non_negative_number,
             help="With --weight-decay-incr-style linear or cosine: the last one, reached at "
                  "the end of training."),
        Flag("--weight-decay-incr-style", GROUP),
    ]


def _recompute_flags() -> List[Flag]:
    """Activation recompute, as Megatron-LM spells it (its rules: training.arguments)."""
    return [
        Flag("--recompute-activations", GROUP,
             help="Megatron-LM's older spelling of --recompute-granularity selective."),
        Flag("--recompute-granularity", GROUP,
             help="Recompute activations in the backward pass instead of keeping them: 'full' "
                  "the whole transformer layer (with --recompute-method and "
                  "--recompute-num-layers), 'selective' the modules of --recompute-modules."),
        Flag("--recompute-method", GROUP,
             help="With --recompute-granularity full: 'uniform' recomputes every chunk of "
                  "--recompute-num-layers layers, 'block' the first --recompute-num-layers "
                  "layers of each pipeline stage."),
        Flag("--recompute-num-layers", GROUP, check=positive_int,
             help="With --recompute-granularity full: layers per recompute unit (uniform) or "
                  "recomputed layers per pipeline stage (block)."),
        Flag("--recompute-modules", GROUP, choices=RECOMPUTE_MODULES,
             differs="the modules Megatron-Core 0.16.1 recomputes, checked when read",
             help="With --recompute-granularity selective: the submodules to recompute "
                  "(default: core_attn). moe: the whole MoE layer, its dispatcher's "
                  "collectives included; moe_act needs --moe-grouped-gemm."),
        Flag("--moe-layer-recompute", GROUP,
             help="Megatron-LM's older spelling of --recompute-granularity selective with "
                  "moe added to --recompute-modules."),
    ]
