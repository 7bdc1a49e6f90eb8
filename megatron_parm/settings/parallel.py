"""The parallelism flags (tensor, context, expert, pipeline, data) and the cluster's (the planners
and the emulator)."""

from __future__ import annotations

from typing import List

from megatron_parm.layout_rules import CP_COMM_TYPES, expand_pipeline_layout
from megatron_parm.settings import megatron_lm
from megatron_parm.settings.flag import Flag, positive_int, positive_number

GROUP = "parallelism"
CLUSTER = "cluster"
DEFAULT_TIMEOUT_MINUTES = megatron_lm.option("--distributed-timeout-minutes").default


def flags() -> List[Flag]:
    return [
        Flag("--tensor-model-parallel-size", GROUP, check=positive_int),
        Flag("--context-parallel-size", GROUP, check=positive_int,
             help="Context parallelism: each sequence split over this many ranks (in 2 x size "
                  "chunks, rank r holding chunks r and 2 x size - 1 - r for causal balance); "
                  "attention gathers the keys and values over them (--cp-comm-type). "
                  "docs/pretraining.md."),
        Flag("--cp-comm-type", GROUP, check=_cp_comm_types,
             help="How attention exchanges the sequence over the context-parallel ranks: "
                  "all_gather (the keys and values) or a2a (Ulysses: the heads), one value for "
                  "every layer (a different one per layer fails in Megatron-Core 0.16.1). p2p "
                  "(Megatron-LM's default) and a2a+p2p need Transformer Engine's attention "
                  "(--transformer-impl transformer_engine)."),
        Flag("--expert-model-parallel-size", GROUP, check=positive_int),
        Flag("--expert-tensor-parallel-size", GROUP, help="Default: "
             "--tensor-model-parallel-size.", check=positive_int),
        Flag("--sequence-parallel", GROUP),
        Flag("--pipeline-model-parallel-size", GROUP, check=positive_int,
             help="Pipeline stages: consecutive layers on consecutive groups of ranks, run by "
                  "Megatron-Core's 1F1B schedule."),
        Flag("--num-virtual-stages-per-pipeline-rank", GROUP, check=positive_int,
             aliases=("--virtual-pipeline-model-parallel-size",),
             dest="virtual_pipeline_model_parallel_size",
             help="Interleaved schedule: model chunks (virtual stages) per pipeline rank "
                  "(also under Megatron-LM's older name, --virtual-pipeline-model-parallel-size)."),
        Flag("--num-layers-per-virtual-pipeline-stage", GROUP,
             help="Interleaved schedule, by the layers of one virtual stage (instead of "
                  "--num-virtual-stages-per-pipeline-rank)."),
        Flag("--pipeline-model-parallel-layout", GROUP, check=_layout_reads,
             help="Every stage's layers, as Megatron-LM writes them: E the embedding, t a "
                  "transformer layer, m a multi-token prediction layer, L the loss, | the end "
                  "of a stage, x*N and (...)*N repeats, commas for the eye; more stages than "
                  "--pipeline-model-parallel-size are virtual stages (interleaved), e.g. "
                  "\"Et*2|(tt|)*5t|tmL\" (docs/pretraining.md)."),
        Flag("--decoder-first-pipeline-num-layers", GROUP,
             help="Transformer layers of the first pipeline stage (the others share the rest "
                  "evenly)."),
        Flag("--decoder-last-pipeline-num-layers", GROUP,
             help="Transformer layers of the last pipeline stage."),
        Flag("--account-for-embedding-in-pipeline-split", GROUP,
             help="Count the embedding as a layer of the first stage when splitting."),
        Flag("--account-for-loss-in-pipeline-split", GROUP,
             help="Count the output layer and loss as a layer of the last stage."),
        Flag("--microbatch-group-size-per-virtual-pipeline-stage", GROUP, check=positive_int,
             help="Interleaved schedule: micro-batches a virtual stage runs in a row (default "
                  "--pipeline-model-parallel-size: depth first)."),
        Flag("--use-tp-pp-dp-mapping", GROUP,
             help="Megatron-Core's other rank order (tensor, pipeline, then data parallel); "
                  "without pipelining it is the default order, with it the expert layers' "
                  "data-parallel size must be attention's."),
        Flag("--distributed-timeout-minutes", GROUP, float, check=positive_number,
             differs="a fraction of a minute is taken too",
             help="Timeout of every process group's collectives, as in Megatron-LM: a rank that "
                  "waits longer on a hung or vanished peer fails and the job ends (default: "
                  "%(default)s)."),
        Flag("--distributed-timeout-seconds-after-init", GROUP, check=positive_int,
             help="After the first iteration (which builds and warms up everything), every "
                  "process group's timeout becomes this many seconds (Megatron-LM's "
                  "update_pg_timeout)."),
        Flag("--distributed-backend", GROUP,
             help="The collectives' backend on a GPU: nccl, or gloo (several ranks may then "
                  "share one GPU, which NCCL refuses). Without a GPU it is gloo whatever this "
                  "says (NCCL needs GPUs)."),
    ]


def _layout_reads(flag: str, value) -> None:
    """A --pipeline-model-parallel-layout that reads (the layers it places are checked against
    the model in training/arguments.py)."""
    problem = expand_pipeline_layout(value)
    if isinstance(problem, str):
        raise ValueError(problem)


def _cp_comm_types(flag: str, values) -> None:
    """Every value one of the communication types of Megatron-Core's attention."""
    for value in values:
        if value not in CP_COMM_TYPES:
            raise ValueError(f"{flag}: {value!r} is none of {', '.join(CP_COMM_TYPES)}")


def cluster_flags() -> List[Flag]:
    return [
        Flag("--nnodes", CLUSTER, int, 1, check=positive_int),
        Flag("--nproc-per-node", CLUSTER, int, check=positive_int),
        Flag("--gpu-memory-gb", CLUSTER, float, 80.0, check=positive_number,
             help="memory per rank the plan may use, GiB (default 80)"),
    ]
