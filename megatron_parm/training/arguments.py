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

from megatron_parm import schedules, settings, tuning
from megatron_parm.data.tokenizer_files import huggingface_tokenizer_file
from megatron_parm.layout_rules import (
    architecture_problem, batch_problem, context_parallel_problem, ddp_problem,
    default_ffn_hidden_size, microbatch_problem, LAYOUT_FLAG, layout_virtual_stages, mla_problem,
    model_problem, moe_overlap_problem, mtp_problem, pipeline_stage_layers, recompute_problem,
    shape_problem, virtual_stages)
from megatron_parm.parallel import validate_layout
from megatron_parm.training import mixed_precision, schedule, upcycling, writers
from megatron_parm.training.implementation import check_implementation, expert_implementation
from megatron_parm.wording import plural

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
    if args.use_checkpoint_args:  # Megatron-LM takes them before validating the flags
        args.checkpoint_args_note = _checkpoint_args(args)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate(args, world_size, reads_data)
    return args


def _checkpoint_args(args) -> Optional[str]:
    """--use-checkpoint-args: the model's flags from --load's checkpoint; the line that says
    which (the trainer prints it)."""
    from megatron_parm.checkpointing.checkpoint_args import apply_checkpoint_args

    applied = apply_checkpoint_args(args)
    if applied is None:
        return None
    path, taken = applied
    if path is None:
        return f"--use-checkpoint-args: no checkpoint in {args.load} yet: the command line's flags"
    shown = ", ".join(f"{settings.flag_of(key)} {value}" for key, value in taken.items())
    return f"--use-checkpoint-args: from {path}: {shown or 'the same flags'}"


def validate(args: argparse.Namespace, world_size: int, reads_data: bool = True,
             megatron_core: bool = True) -> None:
    """Fill defaults that depend on other flags, and refuse anything inconsistent (each flag's
    own check ran in settings.read). megatron_core=False leaves out the one check that imports
    Megatron-Core (its TransformerConfig's refusals: seconds of import), as the launcher does
    (megatron_parm.launch checks the rest before any rank starts; keep the others free of
    Megatron-Core: tests/unit/test_training_args.py checks it)."""
    _validate_seq_length(args)
    _encoder_num_layers(args)
    settings.require(args, REQUIRED)
    if reads_data:
        _validate_inputs(args)
    _validate_model(args)
    _validate_layout(args, world_size)
    _validate_batch(args, world_size)
    _validate_schedule(args)
    _validate_checkpoints(args)
    _validate_optimizer(args, world_size)
    _validate_parm(args, world_size)
    _validate_run_control(args)
    _validate_implementation(args)
    writers.check_args(args)  # --wandb-*
    if megatron_core:
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
    from megatron_parm.data.datasets import check_data_flags  # Megatron-Core's datasets
    from megatron_parm.data.tokenizers import check_tokenizer_flags

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


def _encoder_num_layers(args) -> None:
    """--encoder-num-layers: Megatron-LM's other name of --num-layers (one of the two)."""
    if args.encoder_num_layers is None:
        return
    if args.num_layers is not None and args.num_layers != args.encoder_num_layers:
        raise ValueError(f"--num-layers ({args.num_layers}) and --encoder-num-layers "
                         f"({args.encoder_num_layers}) name the same depth: give one of them")
    args.num_layers = args.encoder_num_layers


def _one_per_layer_type(args) -> None:
    """--moe-router-load-balancing-type and --moe-aux-loss-coeff take a list (one coefficient
    per balancing type), which Megatron-LM reads as the one value when it holds one; several
    types need as many coefficients (sinkhorn runs alone in Megatron-Core 0.16.1)."""
    for key in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(args, key)
        if isinstance(value, list) and len(value) == 1:
            setattr(args, key, value[0])
    types, coeffs = args.moe_router_load_balancing_type, args.moe_aux_loss_coeff
    num_types = len(types) if isinstance(types, list) else 1
    num_coeffs = len(coeffs) if isinstance(coeffs, list) else 1
    if num_types != num_coeffs:
        raise ValueError(f"--moe-aux-loss-coeff needs one coefficient per "
                         f"--moe-router-load-balancing-type ({plural(num_types, 'type')}, "
                         f"{plural(num_coeffs, 'coefficient')})")
    if isinstance(types, list) and "sinkhorn" in types:
        raise ValueError("--moe-router-load-balancing-type sinkhorn runs alone (Megatron-Core "
                         "0.16.1 ignores it among several types)")


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
    _model_flags(args)
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
                        recompute_num_layers=args.recompute_num_layers,
                        overlap_moe_comm=args.overlap_moe_expert_parallel_comm,
                        pp=args.pipeline_model_parallel_size))
    _validate_rope_type(args)


def _validate_rope_type(args) -> None:
    """--rope-type: yarn is multi-latent attention's (its default there); standard attention
    takes rope only (Megatron-LM's rule), and only with --position-embedding-type rope."""
    if args.rope_type is None or args.multi_latent_attention:
        return
    if args.rope_type != "rope":
        raise ValueError(f"--rope-type {args.rope_type} needs --multi-latent-attention "
                         f"(standard attention takes rope only, as in Megatron-LM)")


# Flags of GPT's layers alone (Megatron-LM's BERT builder does not take them, or, the window,
# would make BERT's attention causal), and those of them that need rotary positions.
GPT_ONLY = ("--use-rotary-position-embeddings", "--rotary-interleaved", "--use-rope-scaling",
            "--rope-type", "--no-rope-freq", "--qk-l2-norm", "--window-size",
            "--window-attn-skip-freq")
ROPE_ONLY = ("--rotary-interleaved", "--use-rope-scaling", "--rope-type", "--no-rope-freq")
GATED_ONLY = ("--glu-linear-offset", "--activation-func-clamp-value")
ACTIVATIONS = ("--swiglu", "--squared-relu", "--quick-geglu", "--openai-gelu")
# MoE flags with an effect only where there are experts.
MOE_ONLY = ("--moe-input-jitter-eps", "--moe-router-force-load-balancing",
            "--moe-apply-probs-on-input", "--moe-token-drop-policy", "--moe-use-upcycling")


def _set(args, names) -> list:
    """The flags among NAMES (declared ones) that args sets to other than their default."""
    return [name for name in names
            if getattr(args, settings.FLAGS[name].key) != settings.FLAGS[name].default]


def _model_flags(args) -> None:
    """The attention, position, activation and MoE flags beyond the architecture's rules:
    Megatron-LM's implications, and what goes together."""
    if args.apply_query_key_layer_scaling:
        args.attention_softmax_in_fp32 = True  # Megatron-LM's: the scaled softmax is in fp32
    gpt_only = _set(args, GPT_ONLY)
    if args.model_type == "bert" and gpt_only:
        raise ValueError(f"{gpt_only[0]} applies to GPT models (Megatron-LM's BERT builder does "
                         f"not take it: BERT has learned positions, its own layer spec and "
                         f"attends both ways)")
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.model_type == "bert" and args.transformer_impl == "local" and \
            args.attention_backend not in ("local", "auto"):
        raise ValueError(f"--attention-backend {args.attention_backend}: BERT's local attention "
                         f"(Megatron-Core's DotProductAttention) takes local or auto, as "
                         f"Megatron-Core's BertModel")
    rope_only = _set(args, ROPE_ONLY)
    if rope_only and args.position_embedding_type != "rope":
        raise ValueError(f"{rope_only[0]} needs --position-embedding-type rope")
    if args.window_attn_skip_freq is not None and args.window_size is None:
        raise ValueError("--window-attn-skip-freq needs --window-size (the window)")
    activations = _set(args, ACTIVATIONS)
    if len(activations) > 1:
        raise ValueError(f"{activations[0]} and {activations[1]} both pick the MLPs' "
                         f"activation: give one")
    gated_only = _set(args, GATED_ONLY)
    if gated_only and not (args.swiglu or args.quick_geglu):
        raise ValueError(f"{gated_only[0]} applies to gated MLPs (--swiglu or --quick-geglu)")
    moe_only = _set(args, MOE_ONLY)
    if moe_only and not args.num_experts:
        raise ValueError(f"{moe_only[0]} needs --num-experts (the model is dense)")
    if args.moe_apply_probs_on_input and args.moe_router_topk != 1:
        raise ValueError(f"--moe-apply-probs-on-input needs --moe-router-topk 1 (Megatron-Core "
                         f"0.16.1), got {args.moe_router_topk}")
    if args.moe_token_drop_policy != "probs" and args.moe_expert_capacity_factor is None:
        raise ValueError("--moe-token-drop-policy applies with --moe-expert-capacity-factor "
                         "(dropless routing drops nothing)")


def _validate_layout(args, world_size: int) -> None:
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    validate_layout(world_size, tp, ep, args.expert_tensor_parallel_size, args.num_experts,
                    args.moe_token_dispatcher_type, args.sequence_parallel,
                    pp=args.pipeline_model_parallel_size, cp=args.context_parallel_size,
                    tp_pp_dp=args.use_tp_pp_dp_mapping)
    _validate_pipeline(args)
    _refuse(context_parallel_problem(
        args.context_parallel_size, model_type=getattr(args, "model_type", "gpt"),
        seq_length=args.seq_length, tp=tp, sequence_parallel=args.sequence_parallel,
        moe=args.num_experts is not None, comm_types=args.cp_comm_type,
        num_layers=args.num_layers, transformer_impl=getattr(args, "transformer_impl", "local"),
        num_attention_heads=args.num_attention_heads,
        num_query_groups=(args.num_query_groups if args.group_query_attention
                          and not args.multi_latent_attention else None)))
    _refuse(model_problem(
        tp, ep, args.expert_tensor_parallel_size, num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length, sequence_parallel=args.sequence_parallel,
        num_experts=args.num_experts,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size or args.ffn_hidden_size,
        add_bias_linear=not args.disable_bias_linear))
    if args.multi_latent_attention:
        _refuse(mla_problem(tp, args.q_lora_rank, args.kv_lora_rank, args.qk_pos_emb_head_dim))
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # Megatron-LM does the same: nothing to split.


def _validate_batch(args, world_size: int) -> None:
    """The data-parallel size, the global batch (each of --rampup-batch-size's too) and the
    micro-batches per step; args.num_microbatches: the full batch's, which evaluation runs
    (Megatron-LM's)."""
    pp = args.pipeline_model_parallel_size
    data_parallel_size = world_size // (args.tensor_model_parallel_size * pp
                                        * args.context_parallel_size)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * data_parallel_size
    args.data_parallel_size = data_parallel_size
    _validate_rampup(args)
    group_size = args.microbatch_group_size_per_vp_stage
    if group_size is not None and args.virtual_pipeline_model_parallel_size is None:
        raise ValueError("--microbatch-group-size-per-virtual-pipeline-stage orders the "
                         "interleaved schedule: it needs --num-virtual-stages-per-pipeline-rank")
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
                                     args.virtual_pipeline_model_parallel_size, group_size)
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


def _validate_checkpoints(args) -> None:
    """The checkpoint flags' rules (Megatron-LM's validate_args)."""
    if args.save and args.save_retain_interval is not None:
        if not args.save_interval:
            raise ValueError("--save-retain-interval needs --save-interval (it keeps the saves "
                             "at its multiples)")
        if args.save_retain_interval % args.save_interval:
            raise ValueError(f"--save-retain-interval ({args.save_retain_interval}) must be a "
                             f"multiple of --save-interval ({args.save_interval})")
    if args.non_persistent_save_interval and args.non_persistent_ckpt_type is None:
        raise ValueError("--non-persistent-save-interval needs --non-persistent-ckpt-type "
                         "global (where the non-persistent checkpoints go)")
    if args.skip_train:  # Megatron-LM: an evaluation loads no optimizer state
        args.no_load_optim = True


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
    # parm_hier and its pipelined form split the EP groups by node; parm leaves them out
    # instead (one line)
    if schedules.get(args.moe_token_dispatcher_type).splits_ep_by_node:
        from megatron_parm.perf_model.layout import world_node_split_problem

        problem = world_node_split_problem(world_size, args.expert_model_parallel_size,
                                           args.expert_tensor_parallel_size,
                                           args.pipeline_model_parallel_size, per_node)
        if problem:
            raise ValueError(f"--moe-token-dispatcher-type {args.moe_token_dispatcher_type} "
                             f"with --parm-ranks-per-node {per_node}: {problem}")
    if args.parm_profile is not None:
        from megatron_parm.perf_model import load_profile

        try:  # a missing or bad file stops the run here, before any process-group work
            load_profile(args.parm_profile, require_terms=True)
        except ValueError as err:
            raise ValueError(f"--parm-profile: {err}") from err
    tuning.check_args(args.parm_tune_steps, args.parm_tune_margin, args.parm_tune_candidates,
                      args.parm_tune_cache)
    args.parm_tune_cache = tuning.default_cache(args.parm_tune_cache, args.save)


def _validate_run_control(args) -> None:
    """The run-control flags' rules, Megatron-LM's validate_args' among them."""
    if args.recompute_activations:  # Megatron-LM's older spelling
        args.recompute_granularity = "selective"
    if args.fp16 and args.loss_scale is None:
        # dynamic loss scaling: a NaN or infinite gradient is its signal to lower the scale,
        # not an error (Megatron-LM turns the check off too)
        args.check_for_nan_in_loss_and_grad = False
    if args.error_injection_rate and args.rerun_mode != "validate_results":
        raise ValueError(f"--error-injection-rate {args.error_injection_rate} injects errors "
                         f"only with --rerun-mode validate_results (not {args.rerun_mode})")
    if args.calculate_per_token_loss and args.ddp_average_in_collective:
        raise ValueError("--calculate-per-token-loss with --ddp-average-in-collective: the "
                         "per-token loss sums the gradients over data-parallel ranks "
                         "(Megatron-Core refuses the average)")
    if args.result_rejected_tracker_filename and \
            os.path.isfile(args.result_rejected_tracker_filename):
        from megatron.core.rerun_state_machine import RerunStateMachine

        rejected = RerunStateMachine.get_skipped_iterations_from_tracker_file(
            args.result_rejected_tracker_filename)
        args.iterations_to_skip = sorted({*args.iterations_to_skip, *rejected})
    if args.deterministic_mode:
        _validate_deterministic(args)


def _validate_deterministic(args) -> None:
    """--deterministic-mode: Megatron-LM's rules, and cuBLAS's on a GPU."""
    for key in ("use_flash_attn", "cross_entropy_loss_fusion"):
        if getattr(args, key):
            raise ValueError(f"--deterministic-mode with {settings.flag_of(key)}: Megatron-LM "
                             f"refuses it (that kernel is not deterministic)")
    if not _cuda_available():
        return
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        raise ValueError("--deterministic-mode on a GPU needs CUBLAS_WORKSPACE_CONFIG=:4096:8 "
                         "(or :16:8) in the environment (cuBLAS's deterministic workspace)")
    algorithms = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")
    if args.distributed_backend == "nccl" and os.environ.get("NCCL_ALGO") not in algorithms:
        raise ValueError(f"--deterministic-mode with NCCL needs NCCL_ALGO in the environment, "
                         f"one of {', '.join(algorithms)} (Megatron-LM's rule)")


def _validate_implementation(args) -> None:
    """What this machine and Megatron-Core 0.16.1 can run: data parallelism, precision,
    layer modules, activation recompute."""
    _moe_layer_recompute(args)
    _refuse(recompute_problem(
        args.recompute_granularity, args.recompute_method, args.recompute_num_layers,
        args.recompute_modules,
        layers_per_stage=args.num_layers // args.pipeline_model_parallel_size,
        grouped_gemm=bool(args.moe_grouped_gemm),
        shared_experts=args.moe_shared_expert_intermediate_size is not None,
        shared_expert_overlap=args.moe_shared_expert_overlap,
        multi_latent_attention=args.multi_latent_attention))
    _validate_ddp(args, _cuda_available())
    _validate_fsdp(args)
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
    _modules_for_flags(args)
    upcycling.check_args(args, _cuda_available())


def _moe_layer_recompute(args) -> None:
    """--moe-layer-recompute, as Megatron-Core 0.16.1's TransformerConfig reads it: selective
    recompute with moe among the modules (core_attn by default)."""
    if not args.moe_layer_recompute:
        return
    if args.recompute_granularity == "full":
        raise ValueError("--moe-layer-recompute cannot go with --recompute-granularity full "
                         "(it asks for selective recompute of the MoE layers)")
    args.recompute_granularity = "selective"
    modules = list(args.recompute_modules or ["core_attn"])
    args.recompute_modules = modules + ([] if "moe" in modules else ["moe"])


def _modules_for_flags(args) -> None:
    """Flags the layer modules this run builds cannot take."""
    if args.fp32_residual_connection:
        if not (args.bf16 or args.fp16):
            raise ValueError("--fp32-residual-connection needs --bf16 or --fp16 (the residual "
                             "stream is fp32 anyway)")
        if args.transformer_impl != "transformer_engine":
            raise ValueError("--fp32-residual-connection needs --transformer-impl "
                             "transformer_engine: Megatron-Core's local LayerNorm (torch's) "
                             "takes no fp32 input with bf16 / fp16 weights")
    experts = expert_implementation(args.transformer_impl, args.moe_grouped_gemm,
                                    cuda=_cuda_available(), bf16=args.bf16)
    gated = _set(args, GATED_ONLY + ("--quick-geglu",))
    if args.num_experts and experts in ("GroupedMLP", "TorchGroupedMLP") and gated:
        raise ValueError(f"{gated[0]} with --moe-grouped-gemm: Megatron-Core 0.16.1's GroupedMLP "
                         f"(which {experts} follows) takes neither Quick-GELU nor the GLU's "
                         f"offset and clamp; drop --moe-grouped-gemm (SequentialMLP experts)")


def _validate_ddp(args, cuda: bool) -> None:
    """Megatron-LM's data-parallel flags (training/ddp.py maps them onto Megatron-Core)."""
    _refuse(ddp_problem(overlap_param_gather=args.overlap_param_gather,
                        overlap_grad_reduce=args.overlap_grad_reduce,
                        use_distributed_optimizer=args.use_distributed_optimizer,
                        average_in_collective=args.ddp_average_in_collective, cuda=cuda,
                        num_buckets=args.ddp_num_buckets, bucket_size=args.ddp_bucket_size,
                        reduce_scatter_with_fp32_accumulation=(
                            args.ddp_reduce_scatter_with_fp32_accumulation)))


# What Megatron-FSDP (--use-megatron-fsdp) does not run with here: flag -> (is it set, why).
_FSDP_NOT_HERE = {
    "--pipeline-model-parallel-size": (lambda a: a.pipeline_model_parallel_size > 1,
                                       "pipeline parallelism with Megatron-FSDP is not built here"),
    "--context-parallel-size": (lambda a: a.context_parallel_size > 1,
                                "context parallelism with Megatron-FSDP is not built here"),
    "--num-distributed-optimizer-instances": (
        lambda a: a.num_distributed_optimizer_instances > 1,
        "hybrid sharded Megatron-FSDP (HSDP) is not built here"),
    "--overlap-grad-reduce": (lambda a: a.overlap_grad_reduce,
                              "Megatron-FSDP's overlapped reductions are not built here"),
    "--overlap-param-gather": (lambda a: a.overlap_param_gather,
                               "Megatron-FSDP's overlapped all-gathers are not built here"),
    "--overlap-moe-expert-parallel-comm": (
        lambda a: a.overlap_moe_expert_parallel_comm,
        "the combined 1F1B schedule calls the layers' parts without their forward, which "
        "Megatron-FSDP 0.16.1 hooks"),
}


def _validate_fsdp(args) -> None:
    """--use-megatron-fsdp and --ckpt-format fsdp_dtensor: Megatron-LM's rules between them,
    and what Megatron-FSDP does not run with here (training/ddp.py wraps the model)."""
    if args.ckpt_format == "fsdp_dtensor" and not args.use_megatron_fsdp:
        raise ValueError("--ckpt-format fsdp_dtensor needs --use-megatron-fsdp (Megatron-LM's "
                         "rule: it is Megatron-FSDP's format)")
    if not args.use_megatron_fsdp:
        return
    if args.ckpt_format != "fsdp_dtensor":
        raise ValueError(f"--use-megatron-fsdp needs --ckpt-format fsdp_dtensor (Megatron-LM's "
                         f"rule), got {args.ckpt_format}")
    given = [flag for flag, value in (("--save", args.save), ("--load", args.load),
                                      ("--pretrained-checkpoint", args.pretrained_checkpoint),
                                      ("--non-persistent-save-interval",
                                       args.non_persistent_save_interval))
             if value]
    if given:
        raise ValueError(f"{given[0]} with --use-megatron-fsdp: saving and loading Megatron-FSDP's "
                         f"checkpoints (--ckpt-format fsdp_dtensor) is not built here; drop "
                         f"{' and '.join(given)}")
    strategy = args.data_parallel_sharding_strategy
    if strategy == "no_shard":
        raise ValueError("--data-parallel-sharding-strategy no_shard (its default) with "
                         "--use-megatron-fsdp: Megatron-FSDP 0.16.1 fails with it here (it "
                         "fetches from a parameter buffer no_shard does not build); give optim, "
                         "optim_grads or optim_grads_params")
    if not args.use_distributed_optimizer:
        raise ValueError("--use-megatron-fsdp needs --use-distributed-optimizer here: without it "
                         "Megatron-Core 0.16.1's optimizer clips with the gradient norm of this "
                         "rank's shard only")
    for flag, (is_set, why) in _FSDP_NOT_HERE.items():
        if is_set(args):
            raise ValueError(f"{flag} with --use-megatron-fsdp: {why}; drop one of the two")
    if strategy == "optim_grads_params" and \
            args.check_weight_hash_across_dp_replicas_interval is not None:
        raise ValueError("--check-weight-hash-across-dp-replicas-interval with "
                         "--data-parallel-sharding-strategy optim_grads_params: each "
                         "data-parallel rank holds a different shard of the weights "
                         "(Megatron-LM's rule)")
    if strategy in ("optim_grads", "optim_grads_params") and args.num_experts and \
            _may_pipeline(args.moe_token_dispatcher_type) and expert_implementation(
                args.transformer_impl, args.moe_grouped_gemm, cuda=_cuda_available(),
                bf16=args.bf16) == "SequentialMLP":
        raise ValueError(
            f"--moe-token-dispatcher-type {args.moe_token_dispatcher_type} with "
            f"--data-parallel-sharding-strategy {strategy} and SequentialMLP experts: a pipelined "
            f"schedule runs the experts' backward once per chunk, and Megatron-FSDP 0.16.1 "
            f"reduces a bucket's gradients as soon as each of its parameters has one: add "
            f"--moe-grouped-gemm (its experts compute their weight gradients once), or use "
            f"--data-parallel-sharding-strategy optim")


def _may_pipeline(dispatcher: str) -> bool:
    """Whether DISPATCHER runs a pipelined schedule, or may choose one (parm)."""
    schedule = schedules.get(dispatcher)
    return schedule.pipelined or (schedule.kind == schedules.AUTO and any(
        candidate.pipelined for candidate in schedules.candidates()))


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
