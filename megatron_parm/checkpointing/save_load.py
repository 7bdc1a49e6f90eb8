"""Saving and loading a run's checkpoint, collectively (every rank calls them).

    save_checkpoint(root, iteration, model, optimizer, scheduler, consumed_samples, args)
    find_checkpoint(load, save)   -> (folder, iteration) or None (paths.resolve_load)
    read_checkpoint_info(folder)  -> the saved flags and padded vocabulary, before building a model
    load_checkpoint(folder, model, optimizer, scheduler, args) -> {'iteration', ...}
    read_latest_iteration(root)
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Optional

import torch

from megatron_parm import mcore_compat
from megatron_parm.checkpointing import rng
from megatron_parm.checkpointing.errors import CheckpointError
from megatron_parm.checkpointing.fault_hook import fault_point
from megatron_parm.checkpointing.optimizer_state import (
    is_distributed,
    load_distributed_state,
    load_optimizer_state,
    match_main_params,
    load_metadata,
    loss_scaler_state,
    save_metadata,
)
from megatron_parm.checkpointing.paths import (
    checkpoint_dir,
    partial_dir,
    publish,
    read_tracker,
    resolve_load,
)
from megatron_parm.checkpointing.safe_load import load_torch_file, read_sharded_objects
from megatron_parm.checkpointing.scheduler import check_schedule, schedule_differences
from megatron_parm.checkpointing.state import (
    check_model_flags,
    check_optimizer_format,
    describe_layout,
    layout_of,
    model_chunks,
    model_keys,
    plain_args,
    same_layout,
    sharded_state_dict,
    sharded_tensors,
)
from megatron_parm.checkpointing.verify import (
    check_complete,
    check_request,
    read_metadata,
    write_manifest,
)

# FutureWarnings that Megatron-Core 0.16.1's dist_checkpointing.load raises through torch 2.x
# about its own calls (torch DCP's load_state_dict, ShardedTensor), on every load: nothing a user
# can act on. (message pattern, module the warning is attributed to)
_LOAD_WARNINGS = (
    (r"`load_state_dict` is deprecated", r"megatron\.core\.dist_checkpointing\.strategies\.torch\Z"),
    (r"Please use DTensor instead and we are deprecating ShardedTensor",
     r"torch\.distributed\.checkpoint\.(planner_helpers|default_planner)\Z"),
)


def read_latest_iteration(root: str) -> Optional[int]:
    """The iteration named by ROOT/latest_checkpointed_iteration.txt, or None."""
    return read_tracker(root)


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
    fault_point("staged", iteration)
    metadata = save_metadata(optimizer, args)
    state, _ = sharded_state_dict(model, optimizer, is_loading=False, metadata=metadata)
    if state.get("optimizer_step") is None and "optimizer_state" in state \
            and scheduler is not None and scheduler.num_steps > 0:
        # SGD keeps no step count: it stepped (the schedule moved), so its state is saved
        state["optimizer_step"] = torch.tensor(0.0)
    if state.get("optimizer_step") is None:  # no step taken yet: no moments to save
        for key in ("optimizer_state", "optimizer_step", "optimizer"):
            state.pop(key, None)
    elif loss_scaler_state(optimizer) is not None:
        state["loss_scaler"] = loss_scaler_state(optimizer)
    state["iteration"] = iteration
    state["consumed_samples"] = consumed_samples
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    layout = layout_of(args)
    state["layout"] = layout
    first = model_chunks(model)[0]
    state["model_info"] = {"padded_vocab_size": getattr(first, "vocab_size", None),
                           "vocab_size": getattr(first, "tokenizer_vocab_size", None)}
    if args is not None:
        state["args"] = plain_args(args)
    # Every rank's generators, gathered so that the common part (rank 0's) holds them all.
    if save_rng:
        state["rng_state"] = {"layout": layout, "per_rank": rng.gather()}
    from megatron.core import dist_checkpointing

    # Megatron-LM's record of the distributed optimizer's format (read back on loading).
    dist_checkpointing.save(state, staged, sharded_strategy=("torch_dist", 1),
                            content_metadata=metadata if "optimizer_step" in state else None)
    fault_point("written", iteration)
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


def _agree(problems: list) -> list:
    """Every rank's problems, so that all ranks raise together instead of some hanging."""
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, problems)
    merged = []
    for rank_problems in gathered:
        merged.extend(p for p in rank_problems if p not in merged)
    return merged


def load_checkpoint(path: str, model, optimizer, scheduler, args=None) -> dict:
    """Load the checkpoint folder PATH into model / optimizer / scheduler, and this rank's RNG
    states when the layout is the one it was saved with. Collective.

    Returns {'iteration', 'consumed_samples', 'optimizer_loaded', 'rng_restored', 'notes'}.
    A checkpoint without optimizer state (converted from a single file or upcycled) leaves
    the optimizer and the schedule fresh; notes says so.
    """
    from megatron.core import dist_checkpointing

    common = _check_before_loading(path, optimizer, scheduler, args)
    notes = []
    has_optimizer = common.get("optimizer_step") is not None
    if optimizer is not None and not has_optimizer:
        notes.append("the checkpoint holds no optimizer state: the optimizer and the "
                     "learning-rate schedule start fresh")
    optimizer_metadata = load_metadata(common, args)
    request, targets = sharded_state_dict(model, optimizer if has_optimizer else None,
                                          is_loading=True, metadata=optimizer_metadata)
    metadata = read_metadata(path)
    # The fp32 main parameters under the name the checkpoint has for them; none in a plain
    # optimizer's without --bf16 / --fp16: the distributed optimizer's from the loaded weights.
    main_params_missing = match_main_params(request, metadata)
    problems = _agree(check_request(sharded_tensors(request), metadata))
    if problems:
        # The first tensor on the error's own line, any others below it.
        shown = "\n  ".join(problems[:8])
        more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise CheckpointError(f"{path} does not fit this model: {shown}{more}")

    with warnings.catch_warnings():
        for message, module in _LOAD_WARNINGS:
            warnings.filterwarnings("ignore", message, FutureWarning, module)
        state = dist_checkpointing.load(request, path)
    chunks = model_chunks(model)
    for key, chunk in zip(model_keys(len(chunks)), chunks):
        chunk.load_state_dict(state[key])
    if optimizer is not None:
        _load_optimizer(optimizer, state if has_optimizer else None, targets, common,
                        optimizer_metadata, main_params_missing)
    if scheduler is not None and has_optimizer and "opt_param_scheduler" in state:
        notes += _load_schedule(state["opt_param_scheduler"], scheduler)
    rng_restored = _restore_rng(common.get("rng_state"), layout_of(args), notes)
    return {"iteration": int(common.get("iteration", 0)),
            "consumed_samples": int(common.get("consumed_samples", 0)),
            "optimizer_loaded": optimizer is not None and has_optimizer,
            "rng_restored": rng_restored, "notes": notes, "layout": common.get("layout")}


def _load_optimizer(optimizer, state, targets, common, metadata, main_params_missing) -> None:
    """The optimizer's part of the loaded STATE (None: the checkpoint holds none), into the
    plain or the distributed optimizer, whichever format it was saved in."""
    if state is not None and is_distributed(optimizer):
        load_distributed_state(optimizer, state["optimizer"], metadata, common["optimizer_step"],
                               common.get("loss_scaler"))
    elif state is not None:
        load_optimizer_state(optimizer, state["optimizer_state"], targets,
                             common["optimizer_step"], common.get("loss_scaler"))
    if state is None or main_params_missing:
        # Mixed precision: without saved main params (a converted or upcycled checkpoint, a
        # plain fp32 one) the optimizer's fp32 copies start from the loaded weights. (Saved
        # ones were loaded in place, into the main params themselves: reloading would
        # overwrite them.)
        optimizer.reload_model_params()


def _check_before_loading(path: str, optimizer, scheduler, args) -> dict:
    """The checkpoint's common part, after every rank checked the folder, read its pickles
    safely, and compared its model flags and learning-rate schedule with this run's; one
    CheckpointError on every rank otherwise. Collective."""
    problems = []
    common = None
    try:
        common = read_checkpoint_info(path)  # common.pt and .metadata, read safely
        # Megatron-Core's loader unpickles these without restriction: read them safely first.
        read_sharded_objects(path, read_metadata(path))
        check_model_flags(common.get("args"), args, path)
        check_optimizer_format(path, common, optimizer, layout_of(args))
        if scheduler is not None and common.get("optimizer_step") is not None \
                and "opt_param_scheduler" in common:
            saved_args = common.get("args") or {}
            # lengths shown as iterations too only where both runs count iterations
            iterations = not saved_args.get("train_samples") and not getattr(
                args, "train_samples", None)
            check_schedule(path, common["opt_param_scheduler"], scheduler,
                           saved_args.get("global_batch_size") if iterations else None,
                           getattr(args, "global_batch_size", None) if iterations else None,
                           sample_based=getattr(args, "train_samples", None) is not None)
    except CheckpointError as err:
        problems.append(str(err))
    problems = _agree(problems)
    if problems:
        raise CheckpointError(problems[0])
    return common


def _load_schedule(saved: dict, scheduler) -> list:
    """Load the learning-rate schedule; a note when it differs from the command line's."""
    differences = schedule_differences(saved, scheduler, None, None)
    scheduler.load_state_dict(saved)
    if not differences:
        return []
    kept = ("the command line's (--override-opt_param-scheduler)"
            if scheduler.override_opt_param_scheduler else
            "the checkpoint's (--use-checkpoint-opt_param-scheduler)")
    return [f"learning-rate schedule: {kept}; they differ in "
            + "; ".join(flag for flag, _ in differences)]


def _restore_rng(saved_rng: Optional[dict], layout: dict, notes: list) -> bool:
    """Restore this rank's generators when the checkpoint was saved in LAYOUT; else a note."""
    if saved_rng is None:
        notes.append("the checkpoint holds no RNG states: generators keep this run's seed")
        return False
    if not same_layout(saved_rng.get("layout"), layout):
        notes.append(f"saved in another layout ({describe_layout(saved_rng.get('layout'))}, now "
                     f"{describe_layout(layout)}): RNG states are reseeded, not restored")
        return False
    rng.restore(saved_rng["per_rank"][torch.distributed.get_rank()])
    return True
