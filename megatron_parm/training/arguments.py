"""Command-line arguments for GPT / BERT MoE pretraining, with Megatron-LM's flag names.

    build_parser(model_type)       the training flags (declared in megatron_parm.settings)
    parse_args(argv, model_type)   argv over an optional --config YAML (settings.read), then
                                   validate()

A YAML config holds flag names with underscores as keys (`num_layers: 12`); flags given on
the command line override it. validate() checks everything a user can get wrong before any
process group exists, raising ValueError with a message that names the flag.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from typing import List, Optional

from megatron_parm import settings, tuning
from megatron_parm.data.datasets import check_data_flags
from megatron_parm.data.tokenizers import check_tokenizer_flags
from megatron_parm.data.tokenizer_files import huggingface_tokenizer_file
from megatron_parm.layout_rules import (
    architecture_problem, batch_problem, default_ffn_hidden_size, microbatch_problem,
    LAYOUT_FLAG, layout_virtual_stages, model_problem, moe_overlap_problem, mtp_problem,
    pipeline_stage_layers, recompute_problem, shape_problem, virtual_stages)
from megatron_parm.parallel import validate_layout
from megatron_parm.training import ddp, mixed_precision, schedule
from megatron_parm.training.implementation import check_implementation

MODEL_TYPES = ("gpt", "bert")
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
            "lr", "tokenizer_type")


def build_parser(model_type: str = "gpt") -> argparse.ArgumentParser:
    return settings.training_parser(
        f"{model_type.upper()} MoE pretraining on Megatron-Core with Parm's dispatchers")


def parse_args(argv: Optional[List[str]] = None, model_type: str = "gpt",
               world_size: Optional[int] = None, reads_data: bool = True) -> argparse.Namespace:
    """Parse flags (config file first, command line on top) and validate them.

    world_size: the number of ranks; by default $WORLD_SIZE (set by torchrun, srun + torchrun
    and tools/emulate_cluster.py), else 1. reads_data: False for a caller that feeds random
    tokens (calibration's step timing): --data-path and --tokenizer-model are not checked.
    """
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
    args = settings.read(build_parser(model_type), argv)
    args.model_type = model_type
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate(args, world_size, reads_data)
    return args


def validate(args: argparse.Namespace, world_size: int, reads_data: bool = True) -> None:
    """Fill defaults that depend on other flags, and refuse anything inconsistent (each flag's
    own check ran in settings.read)."""
    _validate_seq_length(args)
    settings.require(args, REQUIRED)
    if reads_data:
        _validate_inputs(args)
    _validate_model(args)
    _validate_layout(args, world_size)
    _validate_batch(args, world_size)
    _validate_schedule(args)
    _validate_optimizer(args, world_size)
    _validate_parm(args, world_size)
    _validate_implementation(args)
    _validate_config(args)


def _validate_config(args) -> None:
    """What Megatron-Core 0.16.1's TransformerConfig refuses of the flags beyond the rules
    above, as one line (before any process group exists)."""
    import warnings

    from megatron_parm.training.model import build_config

    try:
        with warnings.catch_warnings():  # its advice comes when the model is built
            warnings.simplefilter("ignore")
            build_config(args)
    except (ValueError, AssertionError, TypeError) as error:
        raise ValueError(f"Megatron-Core 0.16.1 refuses these flags: "
                         f"{' '.join(str(error).split())}") from error


def _validate_seq_length(args) -> None:
    """--encoder-seq-length: Megatron-LM's other name of --seq-length (one of the two)."""
    if args.encoder_seq_length is None:
        return
    if args.seq_length is not None:
        raise ValueError(f"--encoder-seq-length {args.encoder_seq_length} and --seq-length "
                         f"{args.seq_length}: give one of the two (Megatron-LM's other name of "
                         f"--seq-length)")
    args.seq_length = args.encoder_seq_length


def _validate_inputs(args) -> None:
    """The data and tokenizer flags that go together, and the files they name."""
    check_data_flags(args, getattr(args, "model_type", "gpt"))  # every prefix names a whole indexed dataset
    check_tokenizer_flags(args)
    if getattr(args, "phase_transition_iterations", None):
        args.phase_transition_iterations = settings.data.phase_transition_iterations(
            args.phase_transition_iterations)
    if args.tokenizer_type in settings.data.SENTENCEPIECE_TYPES + ("TikTokenizer",):
        if not args.tokenizer_model or not os.path.isfile(args.tokenizer_model):
            raise ValueError(f"--tokenizer-model: file not found: {args.tokenizer_model}")
    if args.tokenizer_type == "HuggingFaceTokenizer":
        huggingface_tokenizer_file(args.tokenizer_model)  # a directory with tokenizer.json
    # checked here rather than where the flags are read: a planner reads the same config
    # without the tokenizer (the real-size configs name files the user downloads)
    for flag, path in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag}: file not found: {path}")


def _one_per_layer_type(args) -> None:
    """--moe-router-load-balancing-type and --moe-aux-loss-coeff take a list (one coefficient
    per balancing type), which Megatron-LM reads as the one value when it holds one."""
    for key in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(args, key)
        if isinstance(value, list) and len(value) == 1:
            setattr(args, key, value[0])
        elif isinstance(value, list):
            raise ValueError(f"{settings.flag_of(key)} {' '.join(map(str, value))}: several "
                             f"load-balancing losses at once are not built here (give one)")


def _validate_model(args) -> None:
    _one_per_layer_type(args)
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = default_ffn_hidden_size(args.hidden_size, args.swiglu)
        if args.ffn_hidden_size == 0:
            raise ValueError(f"--swiglu at --hidden-size {args.hidden_size} needs "
                             f"--ffn-hidden-size (its default, 8/3 x hidden rounded down to a "
                             f"multiple of 64, is 0)")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if not args.add_position_embedding:
        args.position_embedding_type = "none"
    _refuse(shape_problem(args.hidden_size, args.num_attention_heads, args.seq_length,
                          args.max_position_embeddings, args.num_experts, args.moe_router_topk))
    if args.model_type == "bert" and args.untie_embeddings_and_output_weights:
        raise ValueError("--untie-embeddings-and-output-weights is not supported for BERT")
    _refuse(architecture_problem(
        model_type=args.model_type, num_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads, tp=args.tensor_model_parallel_size,
        num_experts=args.num_experts, topk=args.moe_router_topk,
        moe_layer_freq=args.moe_layer_freq, group_query_attention=args.group_query_attention,
        num_query_groups=args.num_query_groups,
        position_embedding_type=args.position_embedding_type, qk_layernorm=args.qk_layernorm,
        multi_latent_attention=args.multi_latent_attention,
        shared_expert_size=args.moe_shared_expert_intermediate_size,
        shared_expert_gate=args.moe_shared_expert_gate,
        shared_expert_overlap=args.moe_shared_expert_overlap,
        add_bias_linear=not args.disable_bias_linear, sequence_parallel=args.sequence_parallel,
        score_function=args.moe_router_score_function,
        expert_bias=args.moe_router_enable_expert_bias, num_groups=args.moe_router_num_groups,
        group_topk=args.moe_router_group_topk))
    _refuse(mtp_problem(args.mtp_num_layers, model_type=args.model_type,
                        position_embedding_type=args.position_embedding_type,
                        recompute_method=args.recompute_method,
                        recompute_num_layers=args.recompute_num_layers))


def _validate_layout(args, world_size: int) -> None:
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    validate_layout(world_size, tp, ep, args.expert_tensor_parallel_size, args.num_experts,
                    args.moe_token_dispatcher_type, args.sequence_parallel,
                    pp=args.pipeline_model_parallel_size)
    _validate_pipeline(args)
    _refuse(model_problem(
        tp, ep, args.expert_tensor_parallel_size, num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length, sequence_parallel=args.sequence_parallel,
        num_experts=args.num_experts,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size or args.ffn_hidden_size,
        add_bias_linear=not args.disable_bias_linear))
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # Megatron-LM does the same: nothing to split.


def _validate_batch(args, world_size: int) -> None:
    """The data-parallel size, the global batch (each of --rampup-batch-size's too) and the
    micro-batches per step; args.num_microbatches: the full batch's, which evaluation runs
    (Megatron-LM's)."""
    pp = args.pipeline_model_parallel_size
    data_parallel_size = world_size // (args.tensor_model_parallel_size * pp)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * data_parallel_size
    args.data_parallel_size = data_parallel_size
    _validate_rampup(args)
    per_step = args.micro_batch_size * data_parallel_size
    for batch in schedule.ramp_batch_sizes(args):
        where = "" if batch == args.global_batch_size else \
            f"--rampup-batch-size: at global batch size {batch}: "
        if not args.decrease_batch_size_if_needed and batch % per_step:
            raise ValueError((f"{where}global batch size {batch} must be divisible by "
                              f"--micro-batch-size x data-parallel size ({per_step})" if where
                              else batch_problem(batch, args.micro_batch_size, data_parallel_size))
                             + " (or give --decrease-batch-size-if-needed)")
        running = schedule.running_batch_size(batch, per_step, args.decrease_batch_size_if_needed)
        if running == 0:
            raise ValueError(f"{where}--decrease-batch-size-if-needed: global batch size {batch} "
                             f"is less than one micro-batch on every data-parallel rank "
                             f"(--micro-batch-size x data-parallel size = {per_step})")
        problem = microbatch_problem(running // per_step, pp,
                                     args.virtual_pipeline_model_parallel_size)
        _refuse(problem and where + problem)
    args.num_microbatches = args.global_batch_size // per_step


def _validate_rampup(args) -> None:
    """--rampup-batch-size START INCREMENT SAMPLES against --global-batch-size (Megatron-Core's
    calculator asserts these, and divides by zero when there is nothing to ramp)."""
    if args.rampup_batch_size is None:
        return
    start, increment, _ = args.rampup_batch_size
    if args.train_samples is None:
        raise ValueError("--rampup-batch-size needs sample-based training: --train-samples "
                         "instead of --train-iters (as in Megatron-LM)")
    if not start < args.global_batch_size or (args.global_batch_size - start) % increment:
        raise ValueError(f"--rampup-batch-size {start} {increment} ...: the start must be below "
                         f"--global-batch-size ({args.global_batch_size}) and the difference a "
                         f"multiple of the increment")


def _validate_schedule(args) -> None:
    """The training length and the learning-rate and weight-decay schedule (Megatron-LM's
    rules, and what Megatron-Core's OptimizerParamScheduler asserts), and how a resume treats
    the checkpoint's schedule."""
    _validate_training_length(args)
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr ({args.min_lr}) must not exceed --lr ({args.lr})")
    if args.lr_warmup_init > args.lr:
        raise ValueError(f"--lr-warmup-init ({args.lr_warmup_init}) must not exceed --lr "
                         f"({args.lr})")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        raise ValueError("--decoupled-min-lr needs --decoupled-lr (the embedding's and output "
                         "layer's own peak learning rate)")
    _validate_weight_decay(args)
    unit = "samples" if schedule.sample_based(args) else "iters"
    lengths = schedule.scheduler_lengths(args)
    if lengths["lr_warmup_steps"] >= lengths["lr_decay_steps"]:
        warmup = ("--lr-warmup-fraction" if args.lr_warmup_fraction is not None
                  else f"--lr-warmup-{unit}")
        per = 1 if unit == "samples" else args.global_batch_size
        raise ValueError(f"{warmup} must give a warmup shorter than --lr-decay-{unit} (default "
                         f"--train-{unit}): {lengths['lr_warmup_steps'] / per:g} against "
                         f"{lengths['lr_decay_steps'] / per:g} {'samples' if per == 1 else 'iterations'}")
    if args.lr_decay_style == "WSD" and lengths["wsd_decay_steps"] is None:
        raise ValueError(f"--lr-decay-style WSD needs --lr-wsd-decay-{unit} (the length of its "
                         f"final decay)")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ValueError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
                         "exclude each other (the command line's schedule, or the checkpoint's)")
    if args.skip_train and not args.load:
        raise ValueError("--skip-train needs --load (the checkpoint to evaluate)")


# The schedule's lengths in one unit each: (iterations' flag, samples' flag).
_LENGTH_FLAGS = (("--lr-decay-iters", "--lr-decay-samples"),
                 ("--lr-warmup-iters", "--lr-warmup-samples"),
                 ("--lr-wsd-decay-iters", "--lr-wsd-decay-samples"))


def _validate_training_length(args) -> None:
    """Iteration-based (--train-iters) or sample-based (--train-samples) training, each with
    its own unit for the schedule's lengths (Megatron-LM's rules); fills the decay length's
    default and, from --train-samples, the iterations."""
    if (args.train_iters is None) == (args.train_samples is None):
        raise ValueError("give --train-iters or --train-samples" if args.train_iters is None
                         else "--train-iters and --train-samples exclude each other (iterations "
                              "or samples)")
    sample_based = schedule.sample_based(args)
    length = "--train-samples" if sample_based else "--train-iters"
    for iterations, samples in _LENGTH_FLAGS:
        wrong, right = (iterations, samples) if sample_based else (samples, iterations)
        if getattr(args, wrong[2:].replace("-", "_")):
            raise ValueError(f"{wrong} does not go with {length}: give {right}")
    warmup = _LENGTH_FLAGS[1][1 if sample_based else 0]
    if args.lr_warmup_fraction is not None and getattr(args, warmup[2:].replace("-", "_")):
        raise ValueError(f"--lr-warmup-fraction and {warmup} exclude each other (one warmup "
                         f"length)")
    if sample_based:
        if args.lr_decay_samples is None:
            args.lr_decay_samples = args.train_samples
        args.train_iters = schedule.train_iters_of_samples(args)
        if args.train_iters < 1:
            raise ValueError(f"--train-samples ({args.train_samples}) is less than one global "
                             f"batch ({args.global_batch_size})")
    elif args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters


def _validate_weight_decay(args) -> None:
    """The weight-decay schedule: --weight-decay throughout, or from --start-weight-decay up to
    --end-weight-decay (linear or cosine)."""
    if args.no_weight_decay_cond_type is not None:  # Megatron-LM's deprecated spelling
        args.apply_wd_to_qk_layernorm, args.no_weight_decay_cond_type = True, None
    if args.weight_decay_incr_style == "constant":
        if args.start_weight_decay is not None or args.end_weight_decay is not None:
            raise ValueError("--start-weight-decay and --end-weight-decay need "
                             "--weight-decay-incr-style linear or cosine (constant keeps "
                             "--weight-decay)")
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
        return
    if args.start_weight_decay is None or args.end_weight_decay is None:
        raise ValueError(f"--weight-decay-incr-style {args.weight_decay_incr_style} needs "
                         f"--start-weight-decay and --end-weight-decay")
    if args.end_weight_decay < args.start_weight_decay:
        raise ValueError(f"--end-weight-decay ({args.end_weight_decay}) must be at least "
                         f"--start-weight-decay ({args.start_weight_decay}): Megatron-Core's "
                         f"schedule only increases weight decay")


def _validate_optimizer(args, world_size: int) -> None:
    """The optimizer's flags against the layout and checkpoints (Megatron-Core 0.16.1's
    assertions)."""
    instances = args.num_distributed_optimizer_instances
    if instances > 1:
        if not args.use_distributed_optimizer:
            raise ValueError("--num-distributed-optimizer-instances needs "
                             "--use-distributed-optimizer (it splits that optimizer's sharding)")
        if importlib.util.find_spec("einops") is None:
            raise ValueError(f"--num-distributed-optimizer-instances {instances}: Megatron-Core "
                             f"0.16.1 builds its groups with the einops package, which is not "
                             f"installed (pip install einops)")
        expert_dp = world_size // (args.expert_model_parallel_size
                                   * args.expert_tensor_parallel_size
                                   * args.pipeline_model_parallel_size)
        for name, size in (("data-parallel", args.data_parallel_size),
                           ("expert data-parallel", expert_dp)):
            if size % instances:
                raise ValueError(f"--num-distributed-optimizer-instances ({instances}) must "
                                 f"divide the {name} size ({size})")
    if args.optimizer == "sgd" and args.use_distributed_optimizer and (args.save or args.load):
        raise ValueError("--optimizer sgd with --use-distributed-optimizer: Megatron-Core "
                         "0.16.1's distributed optimizer saves and loads Adam's state only; "
                         "drop --use-distributed-optimizer, or --save / --load")


def _validate_parm(args, world_size: int) -> None:
    """Parm's flags: node size, profile and tuning."""
    from megatron_parm.comm.accounting import ranks_per_node

    per_node = ranks_per_node(world_size, args.parm_ranks_per_node)  # must divide the world
    if args.moe_token_dispatcher_type == "parm_hier":  # parm leaves it out instead (one line)
        from megatron_parm.perf_model.layout import world_node_split_problem

        problem = world_node_split_problem(world_size, args.expert_model_parallel_size,
                                           args.expert_tensor_parallel_size,
                                           args.pipeline_model_parallel_size, per_node)
        if problem:
            raise ValueError(f"--moe-token-dispatcher-type parm_hier with --parm-ranks-per-node "
                             f"{per_node}: {problem}")
    if args.parm_profile is not None:
        from megatron_parm.perf_model import load_profile

        try:  # a missing or bad file stops the run here, before any process-group work
            load_profile(args.parm_profile, require_terms=True)
        except ValueError as err:
            raise ValueError(f"--parm-profile: {err}") from err
    tuning.check_args(args.parm_tune_steps, args.parm_tune_margin, args.parm_tune_candidates,
                      args.parm_tune_cache)
    args.parm_tune_cache = tuning.default_cache(args.parm_tune_cache, args.save)


def _validate_implementation(args) -> None:
    """What this machine and Megatron-Core 0.16.1 can run: data parallelism, precision,
    layer modules, activation recompute."""
    _refuse(recompute_problem(
        args.recompute_granularity, args.recompute_method, args.recompute_num_layers,
        args.recompute_modules,
        layers_per_stage=args.num_layers // args.pipeline_model_parallel_size,
        grouped_gemm=bool(args.moe_grouped_gemm),
        shared_experts=args.moe_shared_expert_intermediate_size is not None,
        shared_expert_overlap=args.moe_shared_expert_overlap))
    ddp.check_args(args, _cuda_available())
    mixed_precision.validate(args)
    _refuse(moe_overlap_problem(
        args.overlap_moe_expert_parallel_comm, args.delay_wgrad_compute,
        dispatcher=args.moe_token_dispatcher_type, ep=args.expert_model_parallel_size,
        pp=args.pipeline_model_parallel_size, vpp=args.virtual_pipeline_model_parallel_size,
        half_precision=args.bf16 or args.fp16, recompute_granularity=args.recompute_granularity,
        recompute_modules=args.recompute_modules,
        shared_expert_overlap=args.moe_shared_expert_overlap))
    check_implementation(args.transformer_impl, args.moe_grouped_gemm, model_type=args.model_type,
                         num_experts=args.num_experts, dtype=mixed_precision.dtype_name(args),
                         add_bias_linear=not args.disable_bias_linear, cuda=_cuda_available(),
                         hidden_size=args.hidden_size,
                         ffn_per_rank=(args.moe_ffn_hidden_size or args.ffn_hidden_size)
                         // args.expert_tensor_parallel_size)


def _refuse(problem: Optional[str]) -> None:
    if problem:
        raise ValueError(problem)


def _validate_pipeline(args) -> None:
    """The pipeline flags: virtual stages per rank resolved into
    --virtual-pipeline-model-parallel-size (None without interleaving), and a split of the
    layers Megatron-Core 0.16.1 builds."""
    layout = args.pipeline_model_parallel_layout
    if layout is not None and (args.virtual_pipeline_model_parallel_size is not None
                               or args.num_layers_per_virtual_pipeline_stage is not None):
        raise ValueError(f"{LAYOUT_FLAG} sets the virtual stages itself: it excludes "
                         f"--num-virtual-stages-per-pipeline-rank and "
                         f"--num-layers-per-virtual-pipeline-stage (as in Megatron-LM)")
    vpp = layout_virtual_stages(layout, args.pipeline_model_parallel_size) if layout else \
        virtual_stages(args.num_layers, args.pipeline_model_parallel_size,
                       args.virtual_pipeline_model_parallel_size,
                       args.num_layers_per_virtual_pipeline_stage)
    if isinstance(vpp, str):
        raise ValueError(vpp)
    args.virtual_pipeline_model_parallel_size = vpp
    layers = pipeline_stage_layers(
        args.num_layers, args.pipeline_model_parallel_size, vpp,
        args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers,
        args.account_for_embedding_in_pipeline_split, args.account_for_loss_in_pipeline_split,
        layout=layout, mtp_num_layers=args.mtp_num_layers)
    if isinstance(layers, str):
        raise ValueError(layers)


def _cuda_available() -> bool:
    from megatron_parm import device

    return device.is_cuda()
