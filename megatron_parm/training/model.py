"""GPT and BERT MoE models from Megatron-Core with ParmMoELayer, and their forward steps.

    build_model(args)               GPTModel or BertModel (args.model_type), on this rank
    build_model_chunks(args)        this rank's model chunks: one per virtual pipeline stage
    FORWARD_STEPS[args.model_type]  forward_step(data_iterator, model) for Megatron's schedules

Notation: b micro-batch size, s sequence length, V padded vocabulary size.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.activations import squared_relu
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.utils import openai_gelu

from megatron_parm import tuning
from megatron_parm.attention import split_for_context_parallel
from megatron_parm.checkpointing.state import unwrap  # noqa: F401 (the one unwrap; trainer's too)
from megatron_parm.config import ParmMLATransformerConfig, ParmTransformerConfig
from megatron_parm.data.vocab import MAKE_VOCAB_SIZE_DIVISIBLE_BY, padded_vocab_size
from megatron_parm.layout_rules import pre_softmax_routing
from megatron_parm import device
from megatron_parm.specs import gpt_block_spec, layer_spec
from megatron_parm.training.bert_schedule_plan import ParmBertModel
from megatron_parm.training import mixed_precision, mtp
from megatron_parm.training.implementation import expert_implementation


def build_config(args) -> ParmTransformerConfig:
    mla = getattr(args, "multi_latent_attention", False)
    return (ParmMLATransformerConfig if mla else ParmTransformerConfig)(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        add_bias_linear=not args.disable_bias_linear,
        **architecture_fields(args),
        **(mla_fields(args) if mla else {}),
        **megatron_lm_fields(args),
        **init_fields(args),
        num_moe_experts=args.num_experts,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_topk=args.moe_router_topk,
        **router_fields(args),
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        sequence_parallel=args.sequence_parallel,
        **context_parallel_fields(args),
        **pipeline_fields(args),
        **recompute_fields(args),
        **run_fields(args),
        params_dtype=mixed_precision.params_dtype(args),
        bf16=mixed_precision.params_dtype(args) == torch.bfloat16,
        fp16=mixed_precision.params_dtype(args) == torch.float16,
        moe_grouped_gemm=bool(getattr(args, "moe_grouped_gemm", False)),
        transformer_impl=getattr(args, "transformer_impl", "local"),
        parm_num_chunks=args.parm_num_chunks,
        parm_bwd_num_chunks=args.parm_bwd_num_chunks,
        parm_profile=args.parm_profile,
        parm_ranks_per_node=args.parm_ranks_per_node,
        parm_tune=getattr(args, "parm_tune", None),
        parm_tune_steps=getattr(args, "parm_tune_steps", tuning.DEFAULT_STEPS),
        parm_tune_margin=getattr(args, "parm_tune_margin", tuning.DEFAULT_MARGIN),
        parm_tune_candidates=getattr(args, "parm_tune_candidates", tuning.DEFAULT_MAX_CANDIDATES),
        parm_tune_cache=getattr(args, "parm_tune_cache", None),
        **mtp.config_fields(args),
    )


def architecture_fields(args) -> dict:
    """The config's architecture fields from Megatron-LM's flags: activation, normalization,
    attention (GQA, head width, q/k norms), dense / MoE layers and shared experts."""
    fields = dict(
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        qk_layernorm=args.qk_layernorm, kv_channels=args.kv_channels,
        add_qkv_bias=args.add_qkv_bias,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        moe_layer_freq=args.moe_layer_freq,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=args.moe_shared_expert_gate,
        moe_shared_expert_overlap=args.moe_shared_expert_overlap,
        overlap_moe_expert_parallel_comm=args.overlap_moe_expert_parallel_comm,
        delay_wgrad_compute=args.delay_wgrad_compute)
    fields.update(activation_fields(args))
    return fields


def activation_fields(args) -> dict:
    """The MLPs' activation (dense and experts), as Megatron-LM maps its flags: --swiglu,
    --squared-relu, --quick-geglu (gated), --openai-gelu, else GELU. Unfused: the fused kernels
    compute the same."""
    if args.swiglu:
        return dict(gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False)
    if getattr(args, "squared_relu", False):
        return dict(activation_func=squared_relu)
    if getattr(args, "quick_geglu", False):
        return dict(gated_linear_unit=True, activation_func=quick_gelu,
                    bias_activation_fusion=False)
    return dict(activation_func=openai_gelu if args.openai_gelu else F.gelu)


# TransformerConfig fields that Megatron-LM's core_transformer_config_from_args copies from the
# flag of the same name (their dests): attention, positions, norms, activations' GLU settings,
# router and pipeline settings. A flag an older checkpoint's args lack keeps Megatron-Core's
# default.
SAME_NAME_FIELDS = (
    "attention_softmax_in_fp32", "apply_query_key_layer_scaling", "fp32_residual_connection",
    "layernorm_zero_centered_gamma", "glu_linear_offset", "activation_func_clamp_value",
    "rotary_interleaved", "no_rope_freq", "qk_l2_norm", "attention_output_gate",
    "softmax_type", "window_size", "window_attn_skip_freq", "embedding_init_method_std",
    "perform_initialization", "moe_router_force_load_balancing", "moe_input_jitter_eps",
    "moe_token_drop_policy", "moe_apply_probs_on_input", "moe_layer_recompute",
    "microbatch_group_size_per_vp_stage")


def megatron_lm_fields(args) -> dict:
    """The SAME_NAME_FIELDS args has, and --attention-backend as Megatron-Core's enum."""
    fields = {name: getattr(args, name) for name in SAME_NAME_FIELDS if hasattr(args, name)}
    if getattr(args, "attention_backend", None) is not None:
        fields["attention_backend"] = AttnBackend[args.attention_backend]
    return fields


def init_fields(args) -> dict:
    """The weights' initialization: normal (--init-method-std), or Xavier-uniform for every
    weight the normal one would take (--init-method-xavier-uniform: Megatron-LM meant the output
    layers' too); on the CPU with --use-cpu-initialization, and always without a GPU."""
    fields = dict(init_method_std=args.init_method_std,
                  use_cpu_initialization=bool(getattr(args, "use_cpu_initialization", False))
                  or not device.is_cuda())
    if getattr(args, "init_method_xavier_uniform", False):
        fields.update(init_method=torch.nn.init.xavier_uniform_,
                      output_layer_init_method=torch.nn.init.xavier_uniform_)
    return fields


def mla_fields(args) -> dict:
    """The config's multi-latent attention fields from Megatron-LM's flags (its rotary: rope or
    yarn, MLATransformerConfig's default, with YaRN's factor and mscales)."""
    return dict(
        q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank,
        qk_head_dim=args.qk_head_dim, qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
        v_head_dim=args.v_head_dim, rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent, rotary_scaling_factor=args.rotary_scaling_factor,
        mscale=args.mscale, mscale_all_dim=args.mscale_all_dim,
        **({"rope_type": args.rope_type} if args.rope_type else {}))


def router_fields(args) -> dict:
    """The config's router fields from Megatron-LM's flags."""
    return dict(
        moe_router_pre_softmax=pre_softmax_routing(args.moe_router_pre_softmax,
                                                   args.moe_router_topk),
        moe_router_score_function=args.moe_router_score_function,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_router_num_groups=args.moe_router_num_groups,
        moe_router_group_topk=args.moe_router_group_topk,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        moe_router_dtype=args.moe_router_dtype, moe_z_loss_coeff=args.moe_z_loss_coeff)


def run_fields(args) -> dict:
    """The config's fields of the run-control and loss flags (Megatron-LM copies them into its
    TransformerConfig): the per-token loss (Megatron-Core's schedules, DDP and routers read
    it), deterministic kernels, real-time tests."""
    return dict(calculate_per_token_loss=getattr(args, "calculate_per_token_loss", False),
                deterministic_mode=getattr(args, "deterministic_mode", False),
                test_mode=getattr(args, "test_mode", False))


def recompute_fields(args) -> dict:
    """The config's activation-recompute fields from Megatron-LM's flags (none without them)."""
    granularity = getattr(args, "recompute_granularity", None)
    if granularity is None:
        return {}
    return dict(recompute_granularity=granularity, recompute_method=args.recompute_method,
                recompute_num_layers=args.recompute_num_layers,
                **({"recompute_modules": list(args.recompute_modules)}
                   if args.recompute_modules else {}))


def context_parallel_fields(args) -> dict:
    """The config's context-parallel fields (none without it), as Megatron-LM sets them: the
    --cp-comm-type of every layer as a string (the same value per layer: the same type)."""
    cp = getattr(args, "context_parallel_size", 1)
    if cp == 1:
        return {}
    return dict(context_parallel_size=cp, cp_comm_type=args.cp_comm_type[0])


def pipeline_fields(args) -> dict:
    """The config's pipeline fields from the flags (all defaults without them)."""
    pp = getattr(args, "pipeline_model_parallel_size", 1)
    if pp == 1:
        return {}
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    return dict(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=mixed_precision.params_dtype(args),
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        # Megatron-LM's choice: the interleaved schedule overlaps its p2p transfers (separate
        # isend/irecv), the 1F1B one batches them. On gloo batching gains nothing and its
        # batch_p2p_sync is a CUDA synchronize: separate transfers there too.
        pipeline_model_parallel_layout=getattr(args, "pipeline_model_parallel_layout", None),
        overlap_p2p_comm=vpp is not None,
        batch_p2p_comm=vpp is None and device.is_cuda(),
    )


def expert_module_name(config) -> str:
    """The expert module this run's layers are built with (SequentialMLP, TorchGroupedMLP, ...)."""
    return expert_implementation(config.transformer_impl, config.moe_grouped_gemm,
                                 cuda=device.is_cuda(), bf16=config.bf16)


def build_model_chunks(args, vocab_size: int, padded_vocab: Optional[int] = None) -> list:
    """This rank's part of the model: one chunk per virtual pipeline stage (one without
    interleaving), each build_model's."""
    chunks = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    return [build_model(args, vocab_size, padded_vocab, vp_stage=None if chunks == 1 else stage)
            for stage in range(chunks)]


def build_model(args, vocab_size: int, padded_vocab: Optional[int] = None,
                vp_stage: Optional[int] = None) -> torch.nn.Module:
    """The model for args.model_type on this rank (its TP/EP shards, its pipeline stage's
    layers: with the embedding on the first stage, the output layer and loss on the last), on
    the GPU if any; with --bf16 / --fp16 inside Megatron-Core's Float16Module.

    padded_vocab: the padded vocabulary (data.vocab.model_vocab_sizes: a resumed checkpoint's is
    kept, it depends on the TP size it was saved with); None: --padded-vocab-size, else VOCAB_SIZE
    padded by --make-vocab-size-divisible-by x TP.
    vp_stage: the virtual pipeline stage of this chunk (interleaving only).
    """
    from megatron.core import parallel_state

    stage = dict(pre_process=parallel_state.is_pipeline_first_stage(False, vp_stage),
                 post_process=parallel_state.is_pipeline_last_stage(False, vp_stage),
                 vp_stage=vp_stage)
    config = build_config(args)
    vocab = padded_vocab or getattr(args, "padded_vocab_size", None) or padded_vocab_size(
        vocab_size, args.tensor_model_parallel_size,
        getattr(args, "make_vocab_size_divisible_by", MAKE_VOCAB_SIZE_DIVISIBLE_BY))
    if vocab < vocab_size or vocab % args.tensor_model_parallel_size != 0:
        raise ValueError(f"--load: the checkpoint's padded vocabulary ({vocab}) does not fit "
                         f"--tensor-model-parallel-size {args.tensor_model_parallel_size} "
                         f"(must be divisible by it) or the tokenizer ({vocab_size} tokens)")
    if args.model_type == "gpt":
        decoder = gpt_block_spec(config, expert_module_name(config), vp_stage)
        model = GPTModel(
            config=config,
            transformer_layer_spec=decoder,
            mtp_block_spec=mtp.block_spec(
                config, decoder, lambda whole: gpt_block_spec(whole, expert_module_name(config)),
                vp_stage),
            vocab_size=vocab,
            max_sequence_length=args.max_position_embeddings,
            parallel_output=True,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_base=args.rotary_base,
            rotary_percent=args.rotary_percent,
            rope_scaling=getattr(args, "use_rope_scaling", False),
            **stage,
        )
        mtp.drop_unused_output_weight(model)
    else:
        model = ParmBertModel(
            config=config,
            num_tokentypes=2 if args.bert_binary_head else 0,
            transformer_layer_spec=layer_spec(args.model_type, args.num_experts,
                                              config.transformer_impl, config.moe_grouped_gemm,
                                              expert_module_name(config)),
            vocab_size=vocab,
            max_sequence_length=args.max_position_embeddings,
            parallel_output=True,
            share_embeddings_and_output_weights=True,
            add_binary_head=args.bert_binary_head,
            **stage,
        )
    model.tokenizer_vocab_size = vocab_size  # recorded in checkpoints; --to-hf trims to it
    if device.is_cuda():
        model.to(device.current())
    return mixed_precision.wrap(model, config)


def moe_layers(model):
    """The MoE layers of a model (unwrapped or DDP-wrapped; or a list of pipeline chunks), in
    depth order."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [module for chunk in chunks for module in chunk.modules()
            if isinstance(module, MoELayer)]


def still_tuning(layers) -> bool:
    """Whether a dispatcher of these MoE layers is still measuring its candidates (parm's
    tuning: from one call to the next it may run another schedule)."""
    return any(getattr(layer.token_dispatcher, "tuning", False) for layer in layers)


def runs_pipelined(layers) -> bool:
    """Whether a dispatcher of these MoE layers runs a pipelined schedule (parm_s2, or parm
    having chosen it)."""
    return any(getattr(layer.token_dispatcher, "pipelined", False) for layer in layers)


# ---------------------------------------------------------------------------------------------
# Forward steps: (data_iterator, model) -> (output, loss_func), as Megatron's schedules expect
# ---------------------------------------------------------------------------------------------

def _to_device(batch):
    if not device.is_cuda():
        return batch
    target = device.current()
    return {k: v.to(target, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def next_batch(data_iterator, model) -> dict:
    """The next micro-batch on this rank's device, timed as Megatron-LM's batch-generator
    (--timing-log-level 2) by the timers the model's config carries (none in evaluation)."""
    timers = getattr(getattr(model, "config", None), "timers", None)
    if timers is not None:
        timers("batch-generator", log_level=2).start()
    batch = _to_device(next(data_iterator))
    if timers is not None:
        timers("batch-generator").stop()
    return batch


# The GPT batch's tensors split along their sequence: [b, s] ones along dim 1, the attention
# mask [b, 1, s, s] along its query rows (dim 2), as Megatron-LM's get_batch_on_this_cp_rank.
CP_SPLIT_DIMS = {"tokens": 1, "labels": 1, "loss_mask": 1, "position_ids": 1,
                 "attention_mask": 2}


def batch_on_this_cp_rank(batch: dict) -> dict:
    """This context-parallel rank's part of a GPT micro-batch (every CP rank of a data-parallel
    rank reads the same one): chunks r and 2c - 1 - r of 2c, for tokens, labels, loss mask,
    position ids and the attention mask's rows alike; the batch itself without CP."""
    from megatron.core import parallel_state

    cp_size = parallel_state.get_context_parallel_world_size()
    if cp_size == 1:
        return batch
    cp_rank = parallel_state.get_context_parallel_rank()
    return {key: split_for_context_parallel(value, CP_SPLIT_DIMS[key], cp_size, cp_rank)
            if key in CP_SPLIT_DIMS and value is not None else value
            for key, value in batch.items()}


def _masked_mean(losses_bs: torch.Tensor, loss_mask_bs: torch.Tensor) -> torch.Tensor:
    loss_mask_bs = loss_mask_bs.float()
    return (losses_bs.float() * loss_mask_bs).sum() / loss_mask_bs.sum().clamp(min=1.0)


def _masked_sum(losses_bs: torch.Tensor, loss_mask_bs: torch.Tensor):
    """(the summed loss of the unmasked tokens, their number as an int tensor)."""
    loss_mask_bs = loss_mask_bs.float()
    return (losses_bs.float() * loss_mask_bs).sum(), loss_mask_bs.sum().to(torch.int)


def _per_token(model) -> bool:
    """--calculate-per-token-loss (the model config's calculate_per_token_loss)."""
    return bool(getattr(unwrap(model).config, "calculate_per_token_loss", False))


def _reported(loss: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    """[summed loss, tokens]: how Megatron-LM reports a per-token loss (the trainer divides the
    global batch's sums)."""
    return torch.stack([loss.detach().clone(), num_tokens.detach().float()])


# The reported values are clones: Megatron's schedule divides the returned loss in place by
# the number of micro-batches, and a detached view would follow it.
#
# With --calculate-per-token-loss a loss function returns (summed loss, tokens, report), which
# Megatron-Core's schedules neither divide by the tokens nor by the micro-batches: the
# gradients are divided by the global batch's token count in finalize_model_grads.

def gpt_loss(loss_mask_bs, losses_bs, per_token: bool = False, cp_group=None):
    if per_token:
        lm_loss, num_tokens = _masked_sum(losses_bs, loss_mask_bs)
        return lm_loss, num_tokens, {"lm loss": _reported(lm_loss, num_tokens)}
    if cp_group is not None:
        return _context_parallel_mean(losses_bs, loss_mask_bs, cp_group)
    lm_loss = _masked_mean(losses_bs, loss_mask_bs)
    return lm_loss, {"lm loss": lm_loss.detach().clone()}


def _context_parallel_mean(losses_bs, loss_mask_bs, cp_group):
    """A CP rank's share of the micro-batch's mean loss: its summed loss over the tokens of the
    whole sequences (counted over the CP group), as Megatron-LM reduced it with CP before its
    losses became [sum, tokens]. Megatron-Core's schedule multiplies it by c and DDP averages
    the gradients over data x context parallel ranks, so they are the mean's, exactly; the
    report is the whole micro-batch's mean, the same on every CP rank."""
    lm_sum, num_tokens = _masked_sum(losses_bs, loss_mask_bs)
    totals = torch.stack([lm_sum.detach(), num_tokens.float()])
    torch.distributed.all_reduce(totals, group=cp_group)
    count = totals[1].clamp(min=1.0)
    return lm_sum / count, {"lm loss": (totals[0] / count).clone()}


def _cp_group():
    """The context-parallel group where it has more than one rank, else None."""
    from megatron.core import parallel_state

    if parallel_state.get_context_parallel_world_size() == 1:
        return None
    return parallel_state.get_context_parallel_group()


def gpt_forward_step(data_iterator, model, return_schedule_plan=False):
    batch = batch_on_this_cp_rank(next_batch(data_iterator, model))
    loss_func = partial(gpt_loss, batch["loss_mask"], per_token=_per_token(model),
                        cp_group=_cp_group())
    if return_schedule_plan:
        plan = model.build_schedule_plan(batch["tokens"], batch["position_ids"],
                                         batch.get("attention_mask"), labels=batch["labels"],
                                         loss_mask=batch["loss_mask"])
        return plan, loss_func
    # losses [b, s]: per-token cross entropy (the model computes it from labels). Without an
    # attention mask (--no-create-attention-mask-in-dataloader) attention uses its causal one.
    # The loss mask is the MTP losses' (Megatron-LM passes it too; nothing else reads it).
    losses_bs = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                      labels=batch["labels"], loss_mask=batch["loss_mask"])
    return losses_bs, loss_func


def bert_loss(loss_mask_bs, is_random_b, *output, per_token: bool = False):
    # output: the model's (losses, binary logits), or, from the combined 1F1B's plan, its
    # post-process node's outputs as arguments (the losses alone without a binary head)
    if len(output) == 1 and isinstance(output[0], tuple):
        output = output[0]
    losses_bs, binary_logits_b2 = output if len(output) == 2 else (output[0], None)
    if per_token:
        lm_loss, num_tokens = _masked_sum(losses_bs, loss_mask_bs)
    else:
        lm_loss = _masked_mean(losses_bs, loss_mask_bs)
    if binary_logits_b2 is None:
        if per_token:
            return lm_loss, num_tokens, {"lm loss": _reported(lm_loss, num_tokens)}
        return lm_loss, {"lm loss": lm_loss.detach().clone()}
    # BERT's second objective here is next-sentence prediction (is B random?).
    sop_loss = torch.nn.functional.cross_entropy(binary_logits_b2.view(-1, 2).float(),
                                                 is_random_b.view(-1), ignore_index=-1)
    if per_token:  # weighted by the micro-batch's tokens, as Megatron-Core's router losses
        sop_loss = sop_loss * num_tokens
        return lm_loss + sop_loss, num_tokens, {"lm loss": _reported(lm_loss, num_tokens),
                                                "sop loss": _reported(sop_loss, num_tokens)}
    return lm_loss + sop_loss, {"lm loss": lm_loss.detach().clone(),
                                "sop loss": sop_loss.detach().clone()}


def bert_forward_step(data_iterator, model, return_schedule_plan=False):
    batch = next_batch(data_iterator, model)
    loss_func = partial(bert_loss, batch["loss_mask"], batch["is_random"],
                        per_token=_per_token(model))
    if return_schedule_plan:
        plan = model.build_schedule_plan(
            batch["text"], batch["padding_mask"],
            tokentype_ids=batch["types"] if model_has_tokentypes(model) else None,
            lm_labels=batch["labels"])
        return plan, loss_func
    output = model(batch["text"], batch["padding_mask"],
                   tokentype_ids=batch["types"] if model_has_tokentypes(model) else None,
                   lm_labels=batch["labels"])
    return output, loss_func


def model_has_tokentypes(model) -> bool:
    embedding = getattr(unwrap(model), "embedding", None)
    return getattr(embedding, "tokentype_embeddings", None) is not None


FORWARD_STEPS = {"gpt": gpt_forward_step, "bert": bert_forward_step}
