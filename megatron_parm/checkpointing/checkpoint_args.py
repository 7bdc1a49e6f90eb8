"""--use-checkpoint-args: the model's flags taken from the checkpoint --load names, as Megatron-LM's
load_args_from_checkpoint takes them, before the flags are validated.

    taken_args(saved, args, mp_args, tokenizer) -> {key: value}   pure: what changes
    apply_checkpoint_args(args) -> (folder, {key: value}) or None  reads the checkpoint, applies

Megatron-LM's list, in its order, with its rule for each: a 'forced' flag takes the checkpoint's
value over the command line's; another only where the command line left it unset (None). A value
the checkpoint does not hold (None, or a flag it predates) changes nothing. The tokenizer's flags
come too unless --no-use-tokenizer-model-from-checkpoint-args; the tensor, pipeline and expert
parallel sizes with --use-mp-args-from-checkpoint-args. Flags this project keeps under other
names are read under them (Megatron-LM's add_bias_linear is --disable-bias-linear's opposite).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

# (key, forced) in Megatron-LM core_v0.16.1's order (model, MoE, tokenizer, checkpoint)
MODEL_ARGS: Tuple[Tuple[str, bool], ...] = (
    ("num_layers", False), ("hidden_size", False), ("ffn_hidden_size", False),
    ("seq_length", False), ("num_attention_heads", False), ("num_query_groups", True),
    ("group_query_attention", True), ("kv_channels", False), ("max_position_embeddings", False),
    ("position_embedding_type", True), ("add_position_embedding", True),
    ("use_rotary_position_embeddings", True), ("rotary_base", True), ("rotary_percent", True),
    ("rotary_interleaved", True), ("add_bias_linear", True), ("add_qkv_bias", True),
    ("squared_relu", True), ("swiglu", True), ("untie_embeddings_and_output_weights", True),
    ("normalization", True), ("apply_query_key_layer_scaling", True),
    ("attention_dropout", True), ("hidden_dropout", True),
    ("num_experts", True), ("moe_layer_freq", True), ("moe_ffn_hidden_size", True),
    ("moe_router_topk", True), ("moe_token_dispatcher_type", False),
    ("moe_router_pre_softmax", True), ("moe_grouped_gemm", True),
    ("moe_shared_expert_intermediate_size", True), ("moe_router_score_function", True),
    ("moe_router_enable_expert_bias", True), ("moe_router_topk_scaling_factor", True),
    ("moe_latent_size", True))
TOKENIZER_ARGS = (("tokenizer_model", True), ("tokenizer_type", True))
LATE_ARGS = (("ckpt_format", False),)
MP_ARGS = (("tensor_model_parallel_size", True), ("pipeline_model_parallel_size", True),
           ("virtual_pipeline_model_parallel_size", True),
           ("num_layers_per_virtual_pipeline_stage", False),
           ("expert_model_parallel_size", True))


def _saved(saved: dict, key: str):
    """The checkpoint's value of Megatron-LM's KEY, read under this project's name for it."""
    if key == "add_bias_linear" and "disable_bias_linear" in saved:
        return not saved["disable_bias_linear"]
    return saved.get(key)


def _current(args, key: str):
    if key == "add_bias_linear":
        return not args.disable_bias_linear
    return getattr(args, key)


def _has(args, key: str) -> bool:
    return hasattr(args, "disable_bias_linear" if key == "add_bias_linear" else key)


def taken_args(saved: dict, args, mp_args: bool, tokenizer: bool) -> Dict[str, object]:
    """{key: value} (ARGS' keys) of the flags --use-checkpoint-args changes in ARGS, from a
    checkpoint's saved flags SAVED, by Megatron-LM's rules."""
    rules = MODEL_ARGS + (TOKENIZER_ARGS if tokenizer else ()) + LATE_ARGS + \
        (MP_ARGS if mp_args else ())
    taken = {}
    for key, forced in rules:
        if not _has(args, key) or (not forced and _current(args, key) is not None):
            continue
        value = _saved(saved, key)
        if key == "moe_ffn_hidden_size" and saved.get("num_experts") is None:
            value = None  # Megatron-LM: no experts in the checkpoint, no expert width
            if _current(args, key) is not None:
                taken[key] = None
            continue
        if value is not None and value != _current(args, key):
            if key == "add_bias_linear":
                taken["disable_bias_linear"] = not value
            else:
                taken[key] = value
    return taken


def apply_checkpoint_args(args) -> Optional[Tuple[Optional[str], Dict[str, object]]]:
    """Set the flags --use-checkpoint-args takes from --load's checkpoint; (the checkpoint
    folder, or None where --load holds none yet; {key: value} of what changed), or None
    without the flag or a --load (ARGS unchanged)."""
    from megatron_parm.checkpointing.save_load import find_checkpoint, read_checkpoint_info

    if not args.use_checkpoint_args or not args.load:
        return None
    found = find_checkpoint(args.load, args.ckpt_step)
    if found is None:
        return None, {}
    saved = read_checkpoint_info(found.path).get("args") or {}
    taken = taken_args(saved, args, args.use_mp_args_from_checkpoint_args,
                       args.use_tokenizer_model_from_checkpoint_args)
    for key, value in taken.items():
        setattr(args, key, value)
    return found.path, taken
