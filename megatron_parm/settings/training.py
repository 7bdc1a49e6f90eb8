"""The training flags: batches, iterations, the learning-rate schedule, the optimizer, data-parallel
gradients, activation recompute."""

from __future__ import annotations

from typing import List

from megatron_parm.perf_model.recompute import RECOMPUTE_MODULES
from megatron_parm.settings.flag import Flag, non_negative_int, positive_int

GROUP = "training"
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


def flags() -> List[Flag]:
    return [
        Flag("--micro-batch-size", GROUP, check=positive_int),
        Flag("--global-batch-size", GROUP, help="Default: micro-batch size x data-parallel "
             "size.", check=positive_int),
        Flag("--train-iters", GROUP, check=positive_int),
        Flag("--lr", GROUP),
        Flag("--min-lr", GROUP),
        Flag("--lr-decay-style", GROUP, supported=LR_DECAY_STYLES,
             unsupported="not built here"),
        Flag("--lr-warmup-iters", GROUP, check=non_negative_int),
        Flag("--lr-decay-iters", GROUP, help="Default: --train-iters.", check=positive_int),
        Flag("--clip-grad", GROUP),
        Flag("--weight-decay", GROUP),
        Flag("--adam-beta1", GROUP),
        Flag("--adam-beta2", GROUP),
        Flag("--adam-eps", GROUP),
        Flag("--use-distributed-optimizer", GROUP,
             help="Shard the optimizer state and fp32 main parameters over the data-parallel "
                  "ranks (Megatron-Core's DistributedOptimizer)."),
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
        Flag("--ddp-average-in-collective", GROUP,
             help="Average gradients in the collective (ReduceOp.AVG; NCCL only) instead of "
                  "dividing by the data-parallel size before summing."),
        Flag("--seed", GROUP),
        *_recompute_flags(),
    ]


def _recompute_flags() -> List[Flag]:
    """Activation recompute, as Megatron-LM spells it (its rules: training.arguments)."""
    return [
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
