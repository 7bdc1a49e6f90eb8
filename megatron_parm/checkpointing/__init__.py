"""Checkpoints in Megatron-LM's layout, written with Megatron-Core's dist_checkpointing.

    SAVE/
      latest_checkpointed_iteration.txt     "20"  (written last)
      iter_0000020/                         torch_dist: metadata.json, common.pt, .metadata,
                                            *.distcp, parm_manifest.json
      iter_0000030.partial/                 a save in progress (or killed): never loaded

    save_checkpoint(root, iteration, model, optimizer, scheduler, consumed_samples, args)
    find_checkpoint(load, save)   -> (folder, iteration) or None (fresh start: see paths.resolve_load)
    read_checkpoint_info(folder)  -> the saved flags and padded vocabulary, before building a model
    load_checkpoint(folder, model, optimizer, scheduler, args) -> {'iteration', ...}

A checkpoint holds the model and the optimizer state as sharded tensors under global names and
global shapes (Megatron's sharded_state_dict), so it loads in any (tp, ep, etp) layout and with
any dispatcher; plus the learning-rate schedule, the iteration, the consumed samples and every
rank's RNG states (restored when the layout is the same; a new layout reseeds, which is said).
A save is written to iter_N.partial/ and published by renaming it to iter_N/ once every rank
has finished, then the tracker file is replaced: a kill during a save leaves the previous
checkpoint in place and tracked. Loading reads every pickle of the folder with an allow-list
first (safe_load: nothing in a checkpoint runs code), checks the folder is whole, that every
tensor the model asks for exists with the same global shape and that the learning-rate schedule
agrees (scheduler: Megatron-LM's flags), and raises CheckpointError naming the tensor or flag
otherwise. Every rank calls save_checkpoint / load_checkpoint (they are collective).
"""

from __future__ import annotations

import collections
import os
import shutil
import warnings
from typing import Callable, Optional

import torch

from megatron_parm import mcore_compat
from megatron_parm.checkpointing import rng
from megatron_parm.checkpointing.paths import (
    TRACKER_FILE,
    CheckpointError,
    checkpoint_dir,
    partial_dir,
    publish,
    read_tracker,
    resolve_load,
)
from megatron_parm.checkpointing.safe_load import load_torch_file, read_sharded_objects
from megatron_parm.checkpointing.scheduler import check_schedule, schedule_differences
from megatron_parm.checkpointing.verify import (
    check_complete,
    check_request,
    read_metadata,
    write_manifest,
)

__all__ = [
    "TRACKER_FILE", "CheckpointError", "checkpoint_dir", "read_latest_iteration",
    "save_checkpoint", "find_checkpoint", "read_checkpoint_info", "load_checkpoint",
    "SHAPE_FLAGS", "set_fault_hook",
]

CHECKPOINT_VERSION = 3.0
# Flags that change tensor shapes or names, or what the weights compute (the activation):
# a checkpoint only loads into the same values.
SHAPE_FLAGS = ("model_type", "num_layers", "hidden_size", "ffn_hidden_size",
               "num_attention_heads", "num_experts", "moe_ffn_hidden_size",
               "max_position_embeddings", "disable_bias_linear",
               "untie_embeddings_and_output_weights", "openai_gelu")

# FutureWarnings that Megatron-Core 0.16.1's dist_checkpointing.load raises through torch 2.x
# about its own calls (torch DCP's load_state_dict, ShardedTensor), on every load: nothing a user
# can act on. (message pattern, module the warning is attributed to)
_LOAD_WARNINGS = (
    (r"`load_state_dict` is deprecated", r"megatron\.core\.dist_checkpointing\.strategies\.torch\Z"),
    (r"Please use DTensor instead and we are deprecating ShardedTensor",
     r"torch\.distributed\.checkpoint\.(planner_helpers|default_planner)\Z"),
)

# Tests set this to kill a rank at a given point of a save (see set_fault_hook).
_fault_hook: Optional[Callable[[str, int], None]] = None


def set_fault_hook(hook: Optional[Callable[[str, int], None]]) -> None:
    """Call hook(stage, iteration) at each stage of a save ('staged': folder created,
    'written': all tensors written but not published). For fault-injection tests only."""
    global _fault_hook
    _fault_hook = hook


def _fault_point(stage: str, iteration: int) -> None:
    if _fault_hook is not None:
        _fault_hook(stage, iteration)


def read_latest_iteration(root: str) -> Optional[int]:
    """The iteration named by ROOT/latest_checkpointed_iteration.txt, or None."""
    return read_tracker(root)


def _unwrap(model):
    # Megatron-LM stores the model under its own names (decoder.layers...), not DDP's module.*;
    # the model may sit in DDP and in Float16Module (--bf16 / --fp16).
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def _chunks(model) -> list:
    """The model's chunks, unwrapped: one per virtual pipeline stage (a list), or the model."""
    return [_unwrap(chunk) for chunk in (model if isinstance(model, (list, tuple)) else [model])]


def _model_keys(num_chunks: int) -> list:
    """Where each chunk's state sits: 'model', then 'model1', ... (Megatron-LM's names). The
    tensors inside carry global names and the layer axis at global layer numbers, so a
    chunk's key only groups them and any pipeline layout reads any other's."""
    return ["model"] + [f"model{index}" for index in range(1, num_chunks)]


def _sharded_state_dict(model, optimizer, is_loading: bool):
    """{'model': ..., 'optimizer_state': {key@offset: ShardedTensor}, 'optimizer_step': step},
    and for loading the map from each optimizer entry to the state tensor it fills."""
    chunks = _chunks(model)
    model_state = {key: chunk.sharded_state_dict()
                   for key, chunk in zip(_model_keys(len(chunks)), chunks)}
    state = {**model_state, "checkpoint_version": CHECKPOINT_VERSION}
    targets = {}
    if optimizer is not None:
        tensors, step, targets = _optimizer_state(optimizer, model_state, is_loading)
        state["optimizer_state"] = tensors
        state["optimizer_step"] = step
    return state, targets


def _optimizer_parts(optimizer):
    return [part for part in getattr(optimizer, "chained_optimizers", [optimizer])
            if hasattr(part, "get_parameters") and not getattr(part, "is_stub_optimizer", False)]


def _optimizer_state(optimizer, model_state, is_loading: bool):
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

    for part in _optimizer_parts(optimizer):
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


def _loss_scaler_state(optimizer):
    """The loss scaler's state (fp16 dynamic scaling), the same in every chained optimizer."""
    for part in _optimizer_parts(optimizer):
        scaler = getattr(part, "grad_scaler", None)
        if scaler is not None:
            return scaler.state_dict()
    return None


def _load_optimizer_state(optimizer, loaded: dict, targets: dict, step, scaler_state=None) -> None:
    with torch.no_grad():
        for key, target in targets.items():
            target.copy_(loaded[key])
        for part in _optimizer_parts(optimizer):
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


# A layout's pipeline entries as checkpoints without them (saved before pipelining) had them.
NO_PIPELINE = {"pipeline_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": None}


def _layout(args) -> dict:
    return {"world_size": torch.distributed.get_world_size(),
            "tensor_model_parallel_size": getattr(args, "tensor_model_parallel_size", None),
            "expert_model_parallel_size": getattr(args, "expert_model_parallel_size", None),
            "expert_tensor_parallel_size": getattr(args, "expert_tensor_parallel_size", None),
            "pipeline_model_parallel_size": getattr(args, "pipeline_model_parallel_size", 1),
            "virtual_pipeline_model_parallel_size": getattr(
                args, "virtual_pipeline_model_parallel_size", None)}


def same_layout(saved: Optional[dict], layout: dict) -> bool:
    """Whether a checkpoint's recorded layout is LAYOUT (one without pipeline entries was saved
    without pipelining); only then do its ranks' RNG states belong to this run's ranks."""
    return saved is not None and {**NO_PIPELINE, **saved} == {**NO_PIPELINE, **layout}


def _plain_args(args) -> dict:
    return {k: v for k, v in vars(args).items()
            if isinstance(v, (int, float, str, bool, list, tuple, type(None)))}


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler,
                    consumed_samples: int, args=None, save_rng: bool = True) -> str:
    """Write ROOT/iter_NNNNNNN.partial/, publish it as ROOT/iter_NNNNNNN/, then point the
    tracker at it; returns the published folder. Collective. save_rng=False (conversions)
    leaves the RNG states out, so a resumed run keeps its seed rather than the converter's."""
    mcore_compat.keep_writer_results_in_process()  # no Manager process (see its docstring)
    rank = torch.distributed.get_rank()
    staged = partial_dir(root, iteration)
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(staged, ignore_errors=True)  # left by a save that was killed
        os.makedirs(staged)
    torch.distributed.barrier()
    _fault_point("staged", iteration)
    state, _ = _sharded_state_dict(model, optimizer, is_loading=False)
    if state.get("optimizer_step") is None:  # no step taken yet: no moments to save
        state.pop("optimizer_state", None)
        state.pop("optimizer_step", None)
    elif _loss_scaler_state(optimizer) is not None:
        state["loss_scaler"] = _loss_scaler_state(optimizer)
    state["iteration"] = iteration
    state["consumed_samples"] = consumed_samples
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    layout = _layout(args)
    state["layout"] = layout
    state["model_info"] = {"padded_vocab_size": getattr(_chunks(model)[0], "vocab_size", None)}
    if args is not None:
        state["args"] = _plain_args(args)
    # Every rank's generators, gathered so that the common part (rank 0's) holds them all.
    if save_rng:
        state["rng_state"] = {"layout": layout, "per_rank": rng.gather()}
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(state, staged, sharded_strategy=("torch_dist", 1))
    _fault_point("written", iteration)
    torch.distributed.barrier()
    if rank == 0:
        write_manifest(staged, {"iteration": iteration, "layout": layout})
        publish(root, iteration)
    torch.distributed.barrier()
    return checkpoint_dir(root, iteration)


def find_checkpoint(load: Optional[str], save: Optional[str] = None):
    """(folder, iteration) that --load names, or None (no --load, or the documented first run of
    an auto-resuming job: --load equal to --save and nothing saved yet). Raises CheckpointError."""
    if not load:
        return None
    return resolve_load(load, save)


def read_checkpoint_info(path: str) -> dict:
    """The common (non-tensor) part of a checkpoint, after checking the folder is whole:
    {'iteration', 'args', 'model_info', 'layout', ...}. No process group needed."""
    check_complete(path)
    common = load_torch_file(os.path.join(path, "common.pt"))  # plain data only
    if not isinstance(common, dict):
        raise CheckpointError(f"{path}/common.pt holds a {type(common).__name__}, not a "
                              f"checkpoint's common state")
    return common


def check_model_flags(saved_args: Optional[dict], args, path: str) -> None:
    """Refuse a checkpoint of another model shape, naming the flag."""
    if not saved_args or args is None:
        return
    current = vars(args)
    for flag in SHAPE_FLAGS:
        if flag in saved_args and flag in current and \
                _effective(saved_args, flag) != _effective(current, flag):
            raise CheckpointError(
                f"{path} holds a different model: it was saved with --{flag.replace('_', '-')} "
                f"{saved_args[flag]!r}, this run has {getattr(args, flag)!r}")


def _effective(values: dict, flag: str):
    if flag == "moe_ffn_hidden_size" and values.get(flag) is None and values.get("num_experts"):
        return values.get("ffn_hidden_size")  # the default
    return values.get(flag)


def _agree(problems: list) -> list:
    """Every rank's problems, so that all ranks raise together instead of some hanging."""
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, problems)
    merged = []
    for rank_problems in gathered:
        merged.extend(p for p in rank_problems if p not in merged)
    return merged


def _sharded_tensors(state):
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


def load_checkpoint(path: str, model, optimizer, scheduler, args=None) -> dict:
    """Load the checkpoint folder PATH into model / optimizer / scheduler, and this rank's RNG
    states when the layout is the one it was saved with. Collective.

    Returns {'iteration', 'consumed_samples', 'optimizer_loaded', 'rng_restored', 'notes'}.
    A checkpoint without optimizer state (converted from a single file or upcycled) leaves
    the optimizer and the schedule fresh; notes says so.
    """
    from megatron.core import dist_checkpointing

    rank = torch.distributed.get_rank()
    problems = []
    common = None
    try:
        common = read_checkpoint_info(path)  # common.pt and .metadata, read safely
        # Megatron-Core's loader unpickles these without restriction: read them safely first.
        read_sharded_objects(path, read_metadata(path))
        check_model_flags(common.get("args"), args, path)
        if scheduler is not None and common.get("optimizer_step") is not None \
                and "opt_param_scheduler" in common:
            check_schedule(path, common["opt_param_scheduler"], scheduler,
                           (common.get("args") or {}).get("global_batch_size"),
                           getattr(args, "global_batch_size", None))
    except CheckpointError as err:
        problems.append(str(err))
    problems = _agree(problems)
    if problems:
        raise CheckpointError(problems[0])

    notes = []
    has_optimizer = common.get("optimizer_step") is not None
    if optimizer is not None and not has_optimizer:
        notes.append("the checkpoint holds no optimizer state: the optimizer and the "
                     "learning-rate schedule start fresh")
    request, targets = _sharded_state_dict(model, optimizer if has_optimizer else None,
                                           is_loading=True)
    metadata = read_metadata(path)
    problems = _agree(check_request(_sharded_tensors(request), metadata))
    if problems:
        # The first tensor on the error's own line, any others below it.
        shown = "\n  ".join(problems[:8])
        more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise CheckpointError(f"{path} does not fit this model: {shown}{more}")

    with warnings.catch_warnings():
        for message, module in _LOAD_WARNINGS:
            warnings.filterwarnings("ignore", message, FutureWarning, module)
        state = dist_checkpointing.load(request, path)
    chunks = _chunks(model)
    for key, chunk in zip(_model_keys(len(chunks)), chunks):
        chunk.load_state_dict(state[key])
    if optimizer is not None and not has_optimizer:
        # Mixed precision: without saved main params (a converted or upcycled checkpoint) the
        # optimizer's fp32 copies start from the loaded weights. (Saved ones were loaded in
        # place above, into the main params themselves: reloading would overwrite them.)
        optimizer.reload_model_params()
    if optimizer is not None and has_optimizer:
        _load_optimizer_state(optimizer, state["optimizer_state"], targets, common["optimizer_step"],
                              common.get("loss_scaler"))
    if scheduler is not None and has_optimizer and "opt_param_scheduler" in state:
        differences = schedule_differences(state["opt_param_scheduler"], scheduler, None, None)
        scheduler.load_state_dict(state["opt_param_scheduler"])
        if differences:
            kept = ("the command line's (--override-opt_param-scheduler)"
                    if scheduler.override_opt_param_scheduler else
                    "the checkpoint's (--use-checkpoint-opt_param-scheduler)")
            notes.append(f"learning-rate schedule: {kept}; they differ in "
                         + "; ".join(flag for flag, _ in differences))

    rng_restored = False
    saved_rng = common.get("rng_state")
    layout = _layout(args)
    if saved_rng is None:
        notes.append("the checkpoint holds no RNG states: generators keep this run's seed")
    elif not same_layout(saved_rng.get("layout"), layout):
        notes.append(f"saved in another layout ({_describe(saved_rng.get('layout'))}, now "
                     f"{_describe(layout)}): RNG states are reseeded, not restored")
    else:
        rng.restore(saved_rng["per_rank"][rank])
        rng_restored = True
    return {"iteration": int(common.get("iteration", 0)),
            "consumed_samples": int(common.get("consumed_samples", 0)),
            "optimizer_loaded": optimizer is not None and has_optimizer,
            "rng_restored": rng_restored, "notes": notes, "layout": common.get("layout")}


def _describe(layout: Optional[dict]) -> str:
    if not layout:
        return "unknown"
    layout = {**NO_PIPELINE, **layout}
    pipeline = ""
    if layout["pipeline_model_parallel_size"] != 1:
        pipeline = f" pp={layout['pipeline_model_parallel_size']}"
        if layout["virtual_pipeline_model_parallel_size"]:
            pipeline += f" vpp={layout['virtual_pipeline_model_parallel_size']}"
    return (f"{layout['world_size']} ranks, tp={layout['tensor_model_parallel_size']} "
            f"ep={layout['expert_model_parallel_size']} etp={layout['expert_tensor_parallel_size']}"
            + pipeline)
