"""Command-line arguments for GPT / BERT MoE pretraining, with Megatron-LM's flag names.

    parse_args(argv, model_type)   argparse + optional --config YAML, then validate()

A YAML config holds flag names with underscores as keys (`num_layers: 12`); flags given on
the command line override it. validate() checks everything a user can get wrong before any
process group exists, raising ValueError with a message that names the flag.
"""

from __future__ import annotations

import argparse
import os
from typing import List, Optional

import yaml

from megatron_parm.data.datasets import add_data_args, parse_data_path
from megatron_parm.data.tokenizers import add_tokenizer_args
from megatron_parm import schedules, tuning
from megatron_parm.layout_rules import (
    batch_problem, microbatch_problem, model_problem, pipeline_stage_layers, shape_problem,
    virtual_stages)
from megatron_parm.parallel import DEFAULT_TIMEOUT_MINUTES, validate_layout
from megatron_parm.training import mixed_precision
from megatron_parm.training.implementation import TRANSFORMER_IMPLS, check_implementation

MODEL_TYPES = ("gpt", "bert")


def build_parser(model_type: str = "gpt") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=f"{model_type.upper()} MoE pretraining on Megatron-Core with Parm's dispatchers",
        allow_abbrev=False)
    parser.add_argument("--config", default=None,
                        help="YAML file of flag values (keys: flag names with underscores); "
                             "command-line flags override it.")

    group = parser.add_argument_group("model")
    group.add_argument("--num-layers", type=int, default=None)
    group.add_argument("--hidden-size", type=int, default=None)
    group.add_argument("--ffn-hidden-size", type=int, default=None,
                       help="Default: 4 x --hidden-size.")
    group.add_argument("--num-attention-heads", type=int, default=None)
    group.add_argument("--seq-length", type=int, default=None)
    group.add_argument("--max-position-embeddings", type=int, default=None,
                       help="Default: --seq-length.")
    group.add_argument("--hidden-dropout", type=float, default=0.1)
    group.add_argument("--attention-dropout", type=float, default=0.1)
    group.add_argument("--disable-bias-linear", action="store_true",
                       help="No bias in linear layers (with MoE, biases need "
                            "--expert-tensor-parallel-size 1 on Megatron-Core 0.16.1).")
    group.add_argument("--openai-gelu", action="store_true",
                       help="GELU's tanh approximation, as GPT-2 (Hugging Face 'gelu_new').")
    group.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    group.add_argument("--init-method-std", type=float, default=0.02)
    group.add_argument("--transformer-impl", default="local", choices=TRANSFORMER_IMPLS,
                       help="Layer modules: Megatron-Core's own (local, the default here) or "
                            "Transformer Engine's (needs transformer-engine and a GPU).")

    group = parser.add_argument_group("mixture of experts")
    group.add_argument("--num-experts", type=int, default=None)
    group.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                       help="Default: --ffn-hidden-size.")
    group.add_argument("--moe-router-topk", type=int, default=2)
    group.add_argument("--moe-aux-loss-coeff", type=float, default=1e-2)
    group.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                       choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"))
    group.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                       help="Default: no capacity limit (dropless).")
    group.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    group.add_argument("--moe-token-dispatcher-type", default="alltoall",
                       choices=schedules.names(),
                       help="; ".join(f"{s.name}: {s.summary}" for s in map(schedules.get, schedules.names())))
    group.add_argument("--parm-num-chunks", type=int, default=None,
                       help="Forward pipeline chunks of the chunked schedules (1 = one chunk); "
                            "default: " + ", ".join(f"{s.name} {s.default_chunks}" for s in map(
                                schedules.get, schedules.names()) if s.chunked))
    group.add_argument("--parm-bwd-num-chunks", type=int, default=None,
                       help="Backward pipeline chunks of the chunked schedules; default: the "
                            "forward count (--parm-num-chunks, or the schedule's default)")
    group.add_argument("--parm-profile", default=None,
                       help="Performance-model profile for the automatic dispatcher: a YAML "
                            "file, or the name of a shipped one (e.g. nvlink_ib_estimate).")
    group.add_argument("--parm-ranks-per-node", type=int, default=None,
                       help="Ranks per node, for parm_hier's node groups and the performance "
                            "model; default: LOCAL_WORLD_SIZE (set by torchrun).")
    tuning.add_args(group)
    group.add_argument("--moe-grouped-gemm", action="store_true",
                       help="Run a layer's local experts as one grouped GEMM (TEGroupedMLP with "
                            "--transformer-impl transformer_engine, else GroupedMLP: needs the "
                            "grouped_gemm package, a GPU and --bf16).")

    group = parser.add_argument_group("parallelism")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1)
    group.add_argument("--expert-model-parallel-size", type=int, default=1)
    group.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                       help="Default: --tensor-model-parallel-size.")
    group.add_argument("--sequence-parallel", action="store_true")
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                       help="Pipeline stages: consecutive layers on consecutive groups of "
                            "ranks, run by Megatron-Core's 1F1B schedule.")
    group.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                       help="Interleaved schedule: model chunks (virtual stages) per pipeline "
                            "rank.")
    group.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                       help="Interleaved schedule, by the layers of one virtual stage "
                            "(instead of --virtual-pipeline-model-parallel-size).")
    group.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                       help="Transformer layers of the first pipeline stage (the others share "
                            "the rest evenly).")
    group.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                       help="Transformer layers of the last pipeline stage.")
    group.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                       help="Count the embedding as a layer of the first stage when splitting.")
    group.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                       help="Count the output layer and loss as a layer of the last stage.")
    group.add_argument("--distributed-timeout-minutes", type=float,
                       default=DEFAULT_TIMEOUT_MINUTES,
                       help="Timeout of every process group's collectives, as in Megatron-LM: "
                            "a rank that waits longer on a hung or vanished peer fails and the "
                            "job ends (default: %(default)s).")

    group = parser.add_argument_group("training")
    group.add_argument("--micro-batch-size", type=int, default=None)
    group.add_argument("--global-batch-size", type=int, default=None,
                       help="Default: micro-batch size x data-parallel size.")
    group.add_argument("--train-iters", type=int, default=None)
    group.add_argument("--lr", type=float, default=None)
    group.add_argument("--min-lr", type=float, default=0.0)
    group.add_argument("--lr-decay-style", default="cosine",
                       choices=("constant", "linear", "cosine", "inverse-square-root"))
    group.add_argument("--lr-warmup-iters", type=int, default=0)
    group.add_argument("--lr-decay-iters", type=int, default=None,
                       help="Default: --train-iters.")
    group.add_argument("--clip-grad", type=float, default=1.0)
    group.add_argument("--weight-decay", type=float, default=0.01)
    group.add_argument("--adam-beta1", type=float, default=0.9)
    group.add_argument("--adam-beta2", type=float, default=0.999)
    group.add_argument("--adam-eps", type=float, default=1e-8)
    group.add_argument("--use-distributed-optimizer", action="store_true")
    group.add_argument("--seed", type=int, default=1234)

    group = parser.add_argument_group("checkpoints and logging")
    group.add_argument("--save", default=None, help="Checkpoint folder (torch_dist format).")
    group.add_argument("--load", default=None, help="Checkpoint folder to start from.")
    group.add_argument("--save-interval", type=int, default=None,
                       help="Also save every this many iterations (always at the end).")
    group.add_argument("--exit-interval", type=int, default=None,
                       help="Stop (after saving, with --save) once the iteration is a "
                            "multiple of this.")
    group.add_argument("--exit-signal-handler", action="store_true",
                       help="On SIGTERM (Slurm's time limit or preemption), finish the "
                            "iteration, save (with --save) and stop.")
    group.add_argument("--override-opt_param-scheduler", action="store_true",
                       help="On resume, take the learning-rate schedule (--lr, --min-lr, "
                            "--lr-warmup-iters, --lr-decay-iters, --lr-decay-style, "
                            "--weight-decay, --train-iters) from the command line, not the "
                            "checkpoint. Without this or the next flag a difference is an error.")
    group.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                       help="On resume, keep the checkpoint's learning-rate schedule.")
    group.add_argument("--skip-train", action="store_true",
                       help="Load --load, evaluate (--eval-iters batches) and stop.")
    group.add_argument("--eval-interval", type=int, default=1000)
    group.add_argument("--eval-iters", type=int, default=10)
    group.add_argument("--log-interval", type=int, default=100)
    group.add_argument("--tensorboard-dir", default=None)

    mixed_precision.add_args(parser)
    add_data_args(parser)
    add_tokenizer_args(parser)
    return parser


def parse_args(argv: Optional[List[str]] = None, model_type: str = "gpt",
               world_size: Optional[int] = None) -> argparse.Namespace:
    """Parse flags (config file first, command line on top) and validate them.

    world_size: the number of ranks; by default $WORLD_SIZE (set by torchrun, srun + torchrun
    and tools/emulate_cluster.py), else 1.
    """
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
    parser = build_parser(model_type)
    args = parser.parse_args(argv)
    if args.config is not None:
        parser.set_defaults(**load_config(args.config, parser))
        args = parser.parse_args(argv)
    args.model_type = model_type
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate(args, world_size)
    return args


def load_config(path: str, parser: argparse.ArgumentParser) -> dict:
    if not os.path.isfile(path):
        raise ValueError(f"--config: file not found: {path}")
    with open(path) as f:
        try:
            values = yaml.safe_load(f) or {}
        except yaml.YAMLError as err:
            raise ValueError(f"--config: {path} is not valid YAML: {' '.join(str(err).split())}") from err
    if not isinstance(values, dict):
        raise ValueError(f"--config: {path} must hold a mapping of flag names to values")
    known = {action.dest for action in parser._actions}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"--config: {path}: unknown keys {', '.join(unknown)} "
                         f"(keys are flag names with underscores, e.g. num_layers)")
    if isinstance(values.get("data_path"), str):
        values["data_path"] = values["data_path"].split()
    return values


def validate(args: argparse.Namespace, world_size: int) -> None:
    """Fill defaults that depend on other flags, and refuse anything inconsistent."""
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "train_iters", "lr", "tokenizer_type"):
        if getattr(args, flag) is None:
            raise ValueError(f"--{flag.replace('_', '-')} is required (on the command line "
                             f"or in --config)")
    parse_data_path(args.data_path)  # every prefix names a whole indexed dataset
    if args.tokenizer_type == "SentencePieceTokenizer":
        if not args.tokenizer_model or not os.path.isfile(args.tokenizer_model):
            raise ValueError(f"--tokenizer-model: file not found: {args.tokenizer_model}")
    for flag in ("vocab_file", "merge_file"):
        path = getattr(args, flag)
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"--{flag.replace('_', '-')}: file not found: {path}")

    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    problem = shape_problem(args.hidden_size, args.num_attention_heads, args.seq_length,
                            args.max_position_embeddings, args.num_experts, args.moe_router_topk)
    if problem:
        raise ValueError(problem)

    if not args.distributed_timeout_minutes > 0:
        raise ValueError(f"--distributed-timeout-minutes must be > 0, got "
                         f"{args.distributed_timeout_minutes:g}")
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    pp = args.pipeline_model_parallel_size
    validate_layout(world_size, tp, ep, args.expert_tensor_parallel_size, args.num_experts,
                    args.moe_token_dispatcher_type, args.sequence_parallel, pp=pp)
    _validate_pipeline(args)
    problem = model_problem(
        tp, ep, args.expert_tensor_parallel_size, num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length, sequence_parallel=args.sequence_parallel,
        num_experts=args.num_experts,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size or args.ffn_hidden_size,
        add_bias_linear=not args.disable_bias_linear)
    if problem:  # without --num-experts the model is dense (the source of an upcycled MoE)
        raise ValueError(problem)
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # Megatron-LM does the same: nothing to split.

    data_parallel_size = world_size // (tp * pp)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * data_parallel_size
    problem = batch_problem(args.global_batch_size, args.micro_batch_size, data_parallel_size)
    if problem:
        raise ValueError(problem)
    args.data_parallel_size = data_parallel_size
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * data_parallel_size)
    problem = microbatch_problem(args.num_microbatches, pp,
                                 args.virtual_pipeline_model_parallel_size)
    if problem:
        raise ValueError(problem)

    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_iters >= args.lr_decay_iters:
        raise ValueError(f"--lr-warmup-iters ({args.lr_warmup_iters}) must be below "
                         f"--lr-decay-iters ({args.lr_decay_iters}, default --train-iters)")
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr ({args.min_lr}) must not exceed --lr ({args.lr})")
    for flag in ("save_interval", "exit_interval"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ValueError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
                         "exclude each other (the command line's schedule, or the checkpoint's)")
    if args.skip_train and not args.load:
        raise ValueError("--skip-train needs --load (the checkpoint to evaluate)")
    for flag in ("train_iters", "log_interval", "eval_interval"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.eval_iters < 0:
        raise ValueError(f"--eval-iters must be >= 0, got {args.eval_iters}")
    if args.parm_num_chunks is not None:
        schedules.check_num_chunks(args.parm_num_chunks)
    if args.parm_ranks_per_node is not None:
        from megatron_parm.comm.accounting import ranks_per_node

        ranks_per_node(world_size, args.parm_ranks_per_node)  # must divide the world
    if args.parm_bwd_num_chunks is not None:
        schedules.check_num_chunks(args.parm_bwd_num_chunks, schedules.BWD_CHUNKS_FLAG)
    if args.parm_profile is not None:
        from megatron_parm.perf_model import load_profile

        try:  # a missing or bad file stops the run here, before any process-group work
            load_profile(args.parm_profile, require_terms=True)
        except ValueError as err:
            raise ValueError(f"--parm-profile: {err}") from err
    tuning.check_args(args.parm_tune_steps, args.parm_tune_margin, args.parm_tune_candidates,
                      args.parm_tune_cache)
    args.parm_tune_cache = tuning.default_cache(args.parm_tune_cache, args.save)
    if args.use_distributed_optimizer and not _cuda_available():
        raise ValueError("--use-distributed-optimizer needs CUDA: Megatron-Core 0.16.1's "
                         "distributed optimizer only wraps CUDA parameters")
    if args.model_type == "bert" and args.untie_embeddings_and_output_weights:
        raise ValueError("--untie-embeddings-and-output-weights is not supported for BERT")
    mixed_precision.validate(args)
    check_implementation(args.transformer_impl, args.moe_grouped_gemm, model_type=args.model_type,
                         num_experts=args.num_experts, dtype=mixed_precision.dtype_name(args),
                         add_bias_linear=not args.disable_bias_linear, cuda=_cuda_available(),
                         hidden_size=args.hidden_size,
                         ffn_per_rank=(args.moe_ffn_hidden_size or args.ffn_hidden_size)
                         // args.expert_tensor_parallel_size)


def _validate_pipeline(args) -> None:
    """The pipeline flags: virtual stages per rank resolved into
    --virtual-pipeline-model-parallel-size (None without interleaving), and a split of the
    layers Megatron-Core 0.16.1 builds."""
    vpp = virtual_stages(args.num_layers, args.pipeline_model_parallel_size,
                         args.virtual_pipeline_model_parallel_size,
                         args.num_layers_per_virtual_pipeline_stage)
    if isinstance(vpp, str):
        raise ValueError(vpp)
    args.virtual_pipeline_model_parallel_size = vpp
    layers = pipeline_stage_layers(
        args.num_layers, args.pipeline_model_parallel_size, vpp,
        args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers,
        args.account_for_embedding_in_pipeline_split, args.account_for_loss_in_pipeline_split)
    if isinstance(layers, str):
        raise ValueError(layers)


def _cuda_available() -> bool:
    from megatron_parm import device

    return device.is_cuda()
