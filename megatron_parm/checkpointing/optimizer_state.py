"""The optimizer's state in a checkpoint: Adam's moments or SGD's momentum buffers (and, with
--bf16 / --fp16, the fp32 main parameters) as ShardedTensors named after their parameter's global key, in one flat dict
for all of Megatron's chained optimizers, so that any layout loads any other's.

    sharded_optimizer_state(optimizer, model_state, is_loading) -> (tensors, step, targets)
    load_optimizer_state(optimizer, loaded, targets, step, scaler_state)
    loss_scaler_state(optimizer)   the fp16 loss scaler's state, or None

With --use-distributed-optimizer the state is Megatron-Core's own:
DistributedOptimizer.sharded_state_dict in one of its two formats (Megatron-LM's choice,
--dist-ckpt-optim-fully-reshardable):
    'dp_reshardable'     (default) each rank writes its shard of the flat buckets, as they are:
                         no communication, but the buckets' structure is the layout's, so it
                         loads only at the same (tp, pp, ep, etp), at any data-parallel size;
    'fully_reshardable'  gathered over the data-parallel group into model-space tensors
                         ('optimizer.state.exp_avg.<parameter key>', and 'fp32_param'): the
                         names and shapes of the plain optimizer's, so it loads in any layout,
                         with or without the distributed optimizer.
    is_distributed(optimizer), save_metadata(optimizer, args), load_metadata(common, args)
    distributed_state(optimizer, model_state, is_loading, metadata) -> (state, step)
    load_distributed_state(optimizer, loaded, metadata, step, scaler_state)
    match_main_params(request, metadata)   fp32 main parameters under the checkpoint's name
"""

from __future__ import annotations

import collections

import torch

from megatron_parm import device


def optimizer_parts(optimizer):
    return [part for part in getattr(optimizer, "chained_optimizers", [optimizer])
            if hasattr(part, "get_parameters") and not getattr(part, "is_stub_optimizer", False)]


def is_distributed(optimizer) -> bool:
    """Whether OPTIMIZER (or one of its chained optimizers) is Megatron's DistributedOptimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(part, DistributedOptimizer) for part in optimizer_parts(optimizer))


DP_RESHARDABLE, FULLY_RESHARDABLE = "dp_reshardable", "fully_reshardable"


def save_metadata(optimizer, args):
    """What a save records of the distributed optimizer's format (dist_checkpointing.save's
    content_metadata, Megatron-LM's keys) and asks its sharded_state_dict for, as Megatron-LM
    builds it from --dist-ckpt-optim-fully-reshardable; None for the plain optimizer."""
    if optimizer is None or not is_distributed(optimizer):
        return None
    return _metadata(FULLY_RESHARDABLE if getattr(args, "dist_ckpt_optim_fully_reshardable",
                                                  False) else DP_RESHARDABLE, args)


def saved_sharding(common: dict):
    """The distributed optimizer's format a checkpoint was saved in (its common part), or None
    (the plain optimizer's, or no optimizer state)."""
    return (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")


def load_metadata(common: dict, args) -> dict:
    """The format the distributed optimizer asks a checkpoint for: the one it was saved in; a
    plain optimizer's state is in model space, as the fully reshardable format's."""
    return _metadata(saved_sharding(common) or FULLY_RESHARDABLE, args)


def _metadata(sharding: str, args) -> dict:
    # chained_optim_avoid_prefix: Megatron-LM's default; the fully reshardable format's keys
    # then carry no chained optimizer's index (the dp-reshardable one's always do).
    metadata = {"distrib_optim_sharding_type": sharding, "chained_optim_avoid_prefix": True}
    if sharding == FULLY_RESHARDABLE:
        # The gather goes over Megatron's gloo groups with Megatron-LM's
        # --distrib-optim-fully-reshardable-mem-efficient, and without a GPU: the default
        # (every rank gathers, over NCCL) moves the shards to CUDA. The files differ, not the
        # state they hold.
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = not device.is_cuda() or \
            bool(getattr(args, "distrib_optim_fully_reshardable_mem_efficient", False))
    return metadata


# The fp32 main parameters: the fully reshardable format names them 'param' (Megatron-Core's
# gathered buffers), the plain optimizer's state 'fp32_param' (Megatron's model-space name).
MAIN_PARAM_PREFIXES = ("optimizer.state.param.", "optimizer.state.fp32_param.")


def match_main_params(request: dict, metadata) -> bool:
    """Point the fp32 main parameters of a load REQUEST that the checkpoint lacks at its
    other name for them; where it has neither (a plain optimizer's checkpoint without --bf16 /
    --fp16, whose weights are its main parameters), leave them as they are, to be copied from
    the loaded model (reload_model_params). Whether any was left."""
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    saved = metadata.state_dict_metadata
    left = False

    def other_name(key: str):
        for prefix, other in zip(MAIN_PARAM_PREFIXES, reversed(MAIN_PARAM_PREFIXES)):
            if key.startswith(prefix):
                return other + key[len(prefix):]
        return None

    def visit(node):
        nonlocal left
        for key, value in (node.items() if isinstance(node, dict) else enumerate(node)):
            if isinstance(value, (ShardedTensor, ShardedTensorFactory)):
                other = other_name(value.key)
                if other is not None and value.key not in saved:
                    if other in saved:
                        value.key = other
                    else:
                        node[key] = LocalNonpersistentObject(value.data)
                        left = True
            elif isinstance(value, (dict, list)):
                visit(value)

    visit({key: request[key] for key in ("optimizer", "optimizer_state") if key in request})
    return left


def optimizer_step(optimizer):
    for part in optimizer_parts(optimizer):
        for param_state in part.optimizer.state.values():
            if "step" in param_state:
                return param_state["step"]
    return None


def distributed_state(optimizer, model_state, is_loading: bool, metadata: dict):
    """(Megatron-Core's sharded state of the distributed optimizer in METADATA's format, the step)
    ({index: state} per chained optimizer when there are several). The step is None before the
    first one (nothing to save) and when loading."""
    if is_loading:
        for part in optimizer_parts(optimizer):
            if not part.optimizer.state:  # sharded_state_dict reads the state's step
                part.init_state_fn(part.optimizer, part.config)
                for param_state in part.optimizer.state.values():
                    param_state.setdefault("step", torch.tensor(0.0))
        step = None
    else:
        step = optimizer_step(optimizer)
        if step is None:
            return None, None
    return optimizer.sharded_state_dict(model_state, is_loading, metadata=metadata), step


def load_distributed_state(optimizer, loaded, metadata: dict, step, scaler_state=None) -> None:
    """Load the parameter state LOADED (distributed_state's, read back) into the distributed
    optimizer. The rest of Megatron's optimizer state dict (param_groups, the step, the loss
    scaler) is this run's own, with the checkpoint's step and scaler: the learning rate and
    weight decay come from the schedule, and the number of chained optimizers (dense and
    expert, or one) may differ from the layout that saved it.

    In two steps, Megatron's load_state_dict without the parameter state, then its loader of
    the format: with torch's Adam (no Apex or TE) the parameters' state holds the step, which
    Megatron-Core 0.16.1's loaders copy from the checkpoint's tensors (the fully reshardable
    format has none: KeyError; the dp-reshardable one's is the request's, not the saved one)."""
    sharding = metadata["distrib_optim_sharding_type"]
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    parts = optimizer_parts(optimizer)
    for index, part in enumerate(chained):
        if part not in parts:
            continue
        own = part.state_dict()
        for group in own["optimizer"]["param_groups"]:
            group["step"] = float(step)
        if scaler_state is not None and part.grad_scaler is not None:
            own["grad_scaler"] = scaler_state
        load_format = {DP_RESHARDABLE: part.load_parameter_state_from_dp_reshardable,
                       FULLY_RESHARDABLE: part.load_parameter_state_from_fully_reshardable}
        with torch.no_grad():  # fp32 main parameters are views of the model's
            part.load_state_dict(own)
            for param_state in part.optimizer.state.values():
                param_state.pop("step", None)
            load_format[sharding]((loaded if len(chained) == 1 else loaded[index])["param_state"])
    set_step(optimizer, step)


def init_state(part) -> None:
    """Create the state a checkpoint loads into: Adam's moments (Megatron's init_state_fn), or
    SGD's momentum buffers (none without momentum), which torch makes at the first step."""
    if part.init_state_fn is not None:
        part.init_state_fn(part.optimizer, part.config)
        return
    for group in part.optimizer.param_groups:
        if group.get("momentum"):
            for param in group["params"]:
                part.optimizer.state[param].setdefault("momentum_buffer", torch.zeros_like(param))


def sharded_optimizer_state(optimizer, model_state, is_loading: bool):
    """Adam's moments as ShardedTensors named after their parameter's global key
    ('optimizer.state.exp_avg.decoder.layers...'), in one flat dict for all of Megatron's
    chained optimizers (dense and expert): unlike optimizer.sharded_state_dict, whose keys
    carry the index of the chained optimizer and whose non-tensor part has one entry per
    chained optimizer, nothing here depends on how the layout groups the parameters.
    The step, common to all parameters, is saved once.

    With --bf16 / --fp16 (Megatron's Float16OptimizerWithFloat16Params) the optimizer steps
    on fp32 copies of the bf16/fp16 parameters: those main parameters are saved too, as
    'optimizer.state.fp32_param...' (Megatron's name), so a resumed run continues from the
    exact fp32 values rather than from their rounded bf16 copies."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        make_sharded_optimizer_tensor,
    )

    tensors, targets, step = {}, {}, None
    num_factories = collections.Counter()

    def add(sharded_param, value, name):
        # A ShardedTensorFactory (GroupedMLP's and TorchGroupedMLP's weight1 / weight2) gives
        # a factory too: dist_checkpointing builds it when saving, so the moments are stored in
        # SequentialMLP's layout and under its keys, and merges it back when loading.
        sharded = make_sharded_optimizer_tensor(sharded_param, value, prefix=f"optimizer.state.{name}")
        # One key holds every layer (a layer axis): name the entry by key and offset; a factory
        # has no offset until built, so by key and its rank among this rank's factories of it.
        if isinstance(sharded, ShardedTensorFactory):
            where = f"factory{num_factories[sharded.key]}"
            num_factories[sharded.key] += 1
        else:
            where = ",".join(map(str, sharded.global_offset))
        entry = f"{sharded.key}@{where}"
        tensors[entry] = sharded
        targets[entry] = value

    for part in optimizer_parts(optimizer):
        assert not is_distributed(part), "distributed_state() saves the distributed optimizer"
        if is_loading:
            init_state(part)
        params = part.get_parameters()  # what the optimizer steps on: fp32 main params, if any
        # The model parameter behind each optimizer parameter (itself, or the bf16/fp16
        # parameter whose main_param it is): the model state names it.
        model_param = {id(p.main_param): p for group in getattr(part, "float16_groups", [])
                       for p in group}
        sharded_params = get_param_id_to_sharded_param_map(
            model_state, [model_param.get(id(p), p) for p in params])
        for index, param in enumerate(params):
            if id(param) in model_param:
                add(sharded_params[index], param, "fp32_param")
            for name, value in part.optimizer.state.get(param, {}).items():
                if name == "step":
                    step = value
                elif torch.is_tensor(value) and value.shape == param.shape:
                    add(sharded_params[index], value, name)
    return tensors, step, targets


def loss_scaler_state(optimizer):
    """The loss scaler's state (fp16 dynamic scaling), the same in every chained optimizer."""
    for part in optimizer_parts(optimizer):
        scaler = getattr(part, "grad_scaler", None)
        if scaler is not None:
            return scaler.state_dict()
    return None


def load_optimizer_state(optimizer, loaded: dict, targets: dict, step, scaler_state=None) -> None:
    with torch.no_grad():
        for key, target in targets.items():
            if key in loaded:  # else not in the checkpoint (--dist-ckpt-strictness): as made
                target.copy_(loaded[key])
        for part in optimizer_parts(optimizer):
            # Mixed precision: the model's bf16/fp16 parameters follow the loaded main params.
            if hasattr(part, "float16_groups"):
                part._copy_main_params_to_model_params()
            if scaler_state and getattr(part, "grad_scaler", None) is not None:
                part.grad_scaler.load_state_dict(scaler_state)
    set_step(optimizer, step)


def set_step(optimizer, step) -> None:
    """Every parameter's Adam step, each its own tensor (Megatron's DistributedOptimizer loads
    one tensor shared by all, and its parameter state then copies the request's into it)."""
    if step is None:
        return
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        for param_state in getattr(part, "optimizer", part).state.values():
            param_state["step"] = step.clone() if torch.is_tensor(step) else step
