"""What a checkpoint holds of a run, apart from the optimizer's moments (optimizer_state.py):
the model chunks' sharded state under Megatron-LM's keys, the layout it was saved in, the
flags that fix the model's shape.

    unwrap(model), model_chunks(model), model_keys(num_chunks)
    sharded_state_dict(model, optimizer, is_loading) -> (state to save or load, optimizer targets)
    sharded_tensors(state)          every ShardedTensor a load of STATE reads
    layout_of(args), same_layout(saved, layout), describe_layout(layout)
    check_model_flags(saved_args, args, path)   CheckpointError naming the flag of another shape
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_parm.checkpointing.errors import CheckpointError
from megatron_parm.checkpointing.optimizer_state import (
    DP_RESHARDABLE,
    distributed_state,
    is_distributed,
    saved_sharding,
    sharded_optimizer_state,
)
from megatron_parm.wording import plural

CHECKPOINT_VERSION = 3.0
# Flags that change tensor shapes or names, or what the weights compute (the activation):
# a checkpoint only loads into the same values.
SHAPE_FLAGS = ("model_type", "num_layers", "hidden_size", "ffn_hidden_size",
               "num_attention_heads", "num_experts", "moe_ffn_hidden_size",
               "max_position_embeddings", "disable_bias_linear",
               "untie_embeddings_and_output_weights", "openai_gelu", "swiglu",
               "normalization", "position_embedding_type", "group_query_attention",
               "num_query_groups", "kv_channels", "qk_layernorm", "moe_layer_freq",
               "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "add_qkv_bias",
               "squared_relu", "quick_geglu", "attention_output_gate", "softmax_type",
               "layernorm_zero_centered_gamma", "mtp_num_layers")
# The flags of SHAPE_FLAGS whose name is not their key's (settings is a layer above).
FLAG_NAMES = {"layernorm_zero_centered_gamma": "--apply-layernorm-1p"}


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel / BertModel inside DDP and Float16Module (--bf16 / --fp16): Megatron-LM
    stores the model under its own names (decoder.layers...), not the wrappers' module.*."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.distributed.fsdp.src.megatron_fsdp import MegatronFSDP
    from megatron.core.transformer.module import Float16Module

    while isinstance(model, (DistributedDataParallel, FullyShardedDataParallel, MegatronFSDP,
                             Float16Module)):
        model = model.module
    return model


def model_chunks(model) -> list:
    """The model's chunks, unwrapped: one per virtual pipeline stage (a list), or the model."""
    return [unwrap(chunk) for chunk in (model if isinstance(model, (list, tuple)) else [model])]


def model_keys(num_chunks: int) -> list:
    """Where each chunk's state sits: 'model', then 'model1', ... (Megatron-LM's names). The
    tensors inside carry global names and the layer axis at global layer numbers, so a
    chunk's key only groups them and any pipeline layout reads any other's."""
    return ["model"] + [f"model{index}" for index in range(1, num_chunks)]


def sharded_state_dict(model, optimizer, is_loading: bool, metadata: Optional[dict] = None):
    """{'model': ..., 'optimizer_state': {key@offset: ShardedTensor}, 'optimizer_step': step},
    and for loading the map from each optimizer entry to the state tensor it fills.
    The distributed optimizer's state is Megatron-Core's, under Megatron-LM's key 'optimizer',
    in METADATA's format (optimizer_state.save_metadata / load_metadata); no targets."""
    from megatron.core import parallel_state

    chunks = model_chunks(model)
    # the data-parallel group the model's replicated tensors are named by (Megatron-LM passes
    # it; the MTP stage's copy of the word embeddings needs it given)
    groups = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    model_state = {key: chunk.sharded_state_dict(metadata=dict(groups))
                   for key, chunk in zip(model_keys(len(chunks)), chunks)}
    state = {**model_state, "checkpoint_version": CHECKPOINT_VERSION}
    targets = {}
    if optimizer is not None and is_distributed(optimizer):
        state["optimizer"], state["optimizer_step"] = distributed_state(
            optimizer, model_state, is_loading, metadata)
    elif optimizer is not None:
        tensors, step, targets = sharded_optimizer_state(optimizer, model_state, is_loading)
        state["optimizer_state"] = tensors
        state["optimizer_step"] = step
    return state, targets


def sharded_tensors(state):
    """Every ShardedTensor of STATE, factories built: what loading STATE reads."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for value in nested_values(state):
        if isinstance(value, ShardedTensor):
            yield value
        elif isinstance(value, ShardedTensorFactory):
            # build() gives one ShardedTensor (GroupedMLP without GLU), a list or a dict
            for built in nested_values([value.build()]):
                if isinstance(built, ShardedTensor):
                    yield built


# A layout's pipeline entries as checkpoints without them (saved before pipelining) had them.
NO_PIPELINE = {"pipeline_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": None}
# What a layout recorded before a size existed had: no pipelining, no context parallelism.
LAYOUT_DEFAULTS = {**NO_PIPELINE, "context_parallel_size": 1}


def layout_of(args) -> dict:
    return {"world_size": torch.distributed.get_world_size(),
            "tensor_model_parallel_size": getattr(args, "tensor_model_parallel_size", None),
            "expert_model_parallel_size": getattr(args, "expert_model_parallel_size", None),
            "expert_tensor_parallel_size": getattr(args, "expert_tensor_parallel_size", None),
            "pipeline_model_parallel_size": getattr(args, "pipeline_model_parallel_size", 1),
            "virtual_pipeline_model_parallel_size": getattr(
                args, "virtual_pipeline_model_parallel_size", None),
            "context_parallel_size": getattr(args, "context_parallel_size", 1)}


def same_layout(saved: Optional[dict], layout: dict) -> bool:
    """Whether a checkpoint's recorded layout is LAYOUT (one without pipeline entries was saved
    without pipelining); only then do its ranks' RNG states belong to this run's ranks."""
    return saved is not None and {**LAYOUT_DEFAULTS, **saved} == {**LAYOUT_DEFAULTS, **layout}


def describe_layout(layout: Optional[dict]) -> str:
    if not layout:
        return "unknown"
    layout = {**LAYOUT_DEFAULTS, **layout}
    pipeline = f" cp={layout['context_parallel_size']}" if layout["context_parallel_size"] > 1 \
        else ""
    if layout["pipeline_model_parallel_size"] != 1:
        pipeline += f" pp={layout['pipeline_model_parallel_size']}"
        if layout["virtual_pipeline_model_parallel_size"]:
            pipeline += f" vpp={layout['virtual_pipeline_model_parallel_size']}"
    return (f"{plural(layout['world_size'], 'rank')}, tp={layout['tensor_model_parallel_size']} "
            f"ep={layout['expert_model_parallel_size']} etp={layout['expert_tensor_parallel_size']}"
            + pipeline)


# What the distributed optimizer's dp-reshardable buckets depend on, apart from the DP size.
BUCKET_LAYOUT = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "virtual_pipeline_model_parallel_size", "expert_model_parallel_size",
                 "expert_tensor_parallel_size")
RESHARDABLE_FLAG = "--dist-ckpt-optim-fully-reshardable"


def check_optimizer_format(path: str, common: dict, optimizer, layout: dict) -> None:
    """Refuse a distributed optimizer's dp-reshardable checkpoint (optimizer_state) that this
    run cannot read: without --use-distributed-optimizer, or at another (tp, pp, ep, etp);
    naming the flag that saves a checkpoint which loads there."""
    if optimizer is None or saved_sharding(common) != DP_RESHARDABLE \
            or common.get("optimizer_step") is None:
        return
    saved = {**NO_PIPELINE, **(common.get("layout") or {})}
    current = {**NO_PIPELINE, **layout}
    why = None
    if not is_distributed(optimizer):
        why = "this run has no --use-distributed-optimizer"
    elif any(saved.get(key) != current.get(key) for key in BUCKET_LAYOUT):
        why = f"this run has {describe_model_parallel(current)}"
    if why:
        raise CheckpointError(
            f"{path}: the distributed optimizer's state was saved in its dp-reshardable format "
            f"at {describe_model_parallel(saved)}, which loads only with --use-distributed-optimizer "
            f"at the same tp, pp, ep and etp (any data-parallel size); {why}. Save with "
            f"{RESHARDABLE_FLAG} for a checkpoint that loads in any layout")


def describe_model_parallel(layout: dict) -> str:
    """describe_layout without the number of ranks: 'tp=2 ep=2 etp=2'."""
    return describe_layout(layout).split(", ", 1)[1]


def plain_args(args) -> dict:
    return {k: v for k, v in vars(args).items()
            if isinstance(v, (int, float, str, bool, list, tuple, type(None)))}


def check_model_flags(saved_args: Optional[dict], args, path: str) -> None:
    """Refuse a checkpoint of another model shape, naming the flag."""
    if not saved_args or args is None:
        return
    current = vars(args)
    for flag in SHAPE_FLAGS:
        if flag in saved_args and flag in current and \
                _effective(saved_args, flag) != _effective(current, flag):
            raise CheckpointError(
                f"{path} holds a different model: it was saved with "
                f"{FLAG_NAMES.get(flag, '--' + flag.replace('_', '-'))} "
                f"{saved_args[flag]!r}, this run has {getattr(args, flag)!r}")


def _effective(values: dict, flag: str):
    if flag == "moe_ffn_hidden_size" and values.get(flag) is None and values.get("num_experts"):
        return values.get("ffn_hidden_size")  # the default
    return values.get(flag)
