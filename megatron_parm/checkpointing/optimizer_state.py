"""The optimizer's state in a checkpoint: Adam's moments (and, with --bf16 / --fp16, the fp32
main parameters) as ShardedTensors named after their parameter's global key, in one flat dict
for all of Megatron's chained optimizers, so that any layout loads any other's.

    sharded_optimizer_state(optimizer, model_state, is_loading) -> (tensors, step, targets)
    load_optimizer_state(optimizer, loaded, targets, step, scaler_state)
    loss_scaler_state(optimizer)   the fp16 loss scaler's state, or None
"""

from __future__ import annotations

import collections

import torch

from megatron_parm.checkpointing.errors import CheckpointError


def optimizer_parts(optimizer):
    return [part for part in getattr(optimizer, "chained_optimizers", [optimizer])
            if hasattr(part, "get_parameters") and not getattr(part, "is_stub_optimizer", False)]


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
        if hasattr(part, "shard_fp32_from_float16_groups"):
            raise CheckpointError("checkpoints of the distributed optimizer "
                                  "(--use-distributed-optimizer) are not supported yet")
        if is_loading:
            part.init_state_fn(part.optimizer, part.config)  # creates the moments to load into
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
            target.copy_(loaded[key])
        for part in optimizer_parts(optimizer):
            # Mixed precision: the model's bf16/fp16 parameters follow the loaded main params.
            if hasattr(part, "float16_groups"):
                part._copy_main_params_to_model_params()
            if scaler_state and getattr(part, "grad_scaler", None) is not None:
                part.grad_scaler.load_state_dict(scaler_state)
    if step is None:
        return
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        for param_state in getattr(part, "optimizer", part).state.values():
            param_state["step"] = step.clone() if torch.is_tensor(step) else step
