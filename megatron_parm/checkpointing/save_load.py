"""Saving and loading a run's checkpoint, collectively (every rank calls them), in either format
(--ckpt-format: torch_dist, Megatron-Core's distributed checkpoint; torch, Megatron-LM's
per-rank files: torch_format.py), as the checkpoint flags say (options.py).

    save_checkpoint(root, iteration, model, optimizer, scheduler, consumed_samples, args, ...)
    check_save_format(args)       a --ckpt-format torch save this layout cannot write, refused early
    find_checkpoint(load, step, pretrained, exit_on_missing) -> Found or None
    fresh_start_line(load, save)    what a run says when --load holds nothing yet
    read_checkpoint_info(folder)  -> the saved flags and padded vocabulary, before building a model
    load_checkpoint(folder, model, optimizer, scheduler, args) -> {'iteration', ...}
    read_latest_iteration(root)
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import List, NamedTuple, Optional

import torch

from megatron_parm import mcore_compat
from megatron_parm.checkpointing import rng, torch_format
from megatron_parm.checkpointing.errors import CheckpointError, agree
from megatron_parm.checkpointing.fault_hook import fault_point
from megatron_parm.checkpointing.formats import TORCH, detect_format, loading_format
from megatron_parm.checkpointing.optimizer_state import (
    optimizer_step,
    is_distributed,
    load_distributed_state,
    load_optimizer_state,
    match_main_params,
    load_metadata,
    loss_scaler_state,
    save_metadata,
)
from megatron_parm.checkpointing.options import STRICTNESS_DEFAULT, LoadOptions, SaveOptions
from megatron_parm.checkpointing.paths import (
    checkpoint_dir,
    list_checkpoints,
    partial_dir,
    publish,
    read_tracker,
    remove_checkpoint,
    resolve_load,
    retention_victim,
)
from megatron_parm.checkpointing.safe_load import load_torch_file, read_sharded_objects
from megatron_parm.checkpointing.scheduler import check_schedule, schedule_differences
from megatron_parm.checkpointing.state import (
    CHECKPOINT_VERSION,
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
from megatron_parm.checkpointing.strategies import (
    load_strategy,
    mcore_strictness,
    save_strategy,
    strictness_outcome,
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


# ---------------------------------------------------------------------------------------------
# saving
# ---------------------------------------------------------------------------------------------


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler,
                    consumed_samples: int, args=None, save_rng: bool = True, context=None,
                    non_persistent: bool = False, notes: Optional[List[str]] = None) -> str:
    """Write ROOT/iter_NNNNNNN.partial/, publish it as ROOT/iter_NNNNNNN/, then point the
    tracker at it; returns the published folder. Collective. The flags of ARGS (SaveOptions)
    choose the format and what is saved; save_rng=False (conversions) leaves the RNG states out,
    so a resumed run keeps its seed rather than the converter's. CONTEXT: the run's
    strategies.CheckpointingContext. Afterwards the save the tracker named before is deleted as
    --save-retain-interval says, or (NON_PERSISTENT) every older save of ROOT; NOTES gets a line
    for each deletion."""
    options = SaveOptions.from_args(args)
    mcore_compat.keep_writer_results_in_process()  # no Manager process (see its docstring)
    rank = torch.distributed.get_rank()
    staged = partial_dir(root, iteration)
    previous = _tracked(root) if rank == 0 else None
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(staged, ignore_errors=True)  # left by a save that was killed
        os.makedirs(staged)
    torch.distributed.barrier()
    fault_point("staged", iteration)
    common = _common_state(iteration, model, optimizer, scheduler, consumed_samples, args,
                           options, save_rng and options.save_rng)
    if options.ckpt_format == TORCH:
        files = torch_format.save_files(staged, common, model, optimizer, options.save_optim)
    else:
        _save_torch_dist(staged, common, model, optimizer, args, options, context)
    fault_point("written", iteration)
    torch.distributed.barrier()
    if rank == 0:
        extra = {"iteration": iteration, "layout": common["layout"]}
        if options.ckpt_format == TORCH:
            torch_format.write_manifest(staged, files, extra)
        else:
            write_manifest(staged, extra)
        publish(root, iteration)
        _delete_old(root, iteration, previous, options, non_persistent, notes)
    torch.distributed.barrier()
    return checkpoint_dir(root, iteration)


def check_save_format(args) -> None:
    """Refuse, before a run trains, a --ckpt-format torch save that its layout cannot write
    (torch_format.check_writers). Collective."""
    if args.save and SaveOptions.from_args(args).ckpt_format == TORCH:
        torch_format.check_writers()


def _tracked(root: str) -> Optional[int]:
    try:
        return read_tracker(root)
    except CheckpointError:  # a corrupted tracker: publish replaces it
        return None


def _delete_old(root: str, iteration: int, previous: Optional[int], options: SaveOptions,
                non_persistent: bool, notes: Optional[List[str]]) -> None:
    """Once ITERATION is published and tracked: the save --save-retain-interval drops, or every
    older one of a non-persistent folder."""
    if non_persistent:
        victims = [it for it, _ in list_checkpoints(root) if it < iteration]
    else:
        victims = [it for it in [retention_victim(previous, iteration, options.retain_interval)]
                   if it is not None]
    for victim in victims:
        if remove_checkpoint(root, victim) and notes is not None:
            why = "non-persistent" if non_persistent else \
                f"--save-retain-interval {options.retain_interval}"
            notes.append(f"deleted checkpoint {checkpoint_dir(root, victim)} ({why})")


def _common_state(iteration, model, optimizer, scheduler, consumed_samples, args,
                  options: SaveOptions, save_rng: bool) -> dict:
    """What a checkpoint holds besides the model's and optimizer's tensors (torch_dist's
    common.pt; every file of the torch format)."""
    layout = layout_of(args)
    first = model_chunks(model)[0]
    state = {"iteration": iteration, "consumed_samples": consumed_samples,
             "checkpoint_version": CHECKPOINT_VERSION, "layout": layout,
             "model_info": {"padded_vocab_size": getattr(first, "vocab_size", None),
                            "vocab_size": getattr(first, "tokenizer_vocab_size", None)}}
    if options.save_optim and optimizer is not None:
        step = optimizer_step(optimizer)
        if step is None and not is_distributed(optimizer) and scheduler is not None \
                and scheduler.num_steps > 0:
            # SGD keeps no step count: it stepped (the schedule moved), so its state is saved
            step = torch.tensor(0.0)
        if step is not None:  # no step taken yet: no moments to save
            state["optimizer_step"] = step
            if loss_scaler_state(optimizer) is not None:
                state["loss_scaler"] = loss_scaler_state(optimizer)
            if scheduler is not None:
                state["opt_param_scheduler"] = scheduler.state_dict()
    if args is not None:
        state["args"] = plain_args(args)
    # Every rank's generators, gathered so that the common part (rank 0's) holds them all.
    if save_rng:
        state["rng_state"] = {"layout": layout, "per_rank": rng.gather()}
    return state


def _save_torch_dist(staged: str, common: dict, model, optimizer, args, options: SaveOptions,
                     context) -> None:
    from megatron.core import dist_checkpointing

    saves_optimizer = "optimizer_step" in common
    metadata = save_metadata(optimizer, args) if saves_optimizer else None
    state, _ = sharded_state_dict(model, optimizer if saves_optimizer else None,
                                  is_loading=False, metadata=metadata)
    state.update(common)
    strategy, validate = save_strategy(options, context)
    # Megatron-LM's record of the distributed optimizer's format (read back on loading).
    dist_checkpointing.save(state, staged, sharded_strategy=strategy,
                            validate_access_integrity=validate, content_metadata=metadata)


# ---------------------------------------------------------------------------------------------
# which checkpoint, and what it says before a model exists
# ---------------------------------------------------------------------------------------------


class Found(NamedTuple):
    path: str
    iteration: int
    pretrained: bool  # --pretrained-checkpoint's: loaded as with --finetune


def find_checkpoint(load: Optional[str], step: Optional[int] = None,
                    pretrained: Optional[str] = None, exit_on_missing: bool = False,
                    non_persistent: Optional[str] = None):
    """The checkpoint to start from: Found(folder, iteration, pretrained) or None (no --load, or
    a --load that is missing or holds nothing yet: a fresh start, as in Megatron-LM; the caller
    says so with fresh_start_line). With PRETRAINED (--pretrained-checkpoint), such a --load
    means PRETRAINED's checkpoint. STEP: --ckpt-step. EXIT_ON_MISSING
    (--exit-on-missing-checkpoint): an error instead of a fresh start. NON_PERSISTENT: the
    folder of global non-persistent checkpoints, whose latest wins when it is at least as new.
    Raises CheckpointError."""
    found = None
    if load:
        found = resolve_load(load, step, may_be_empty=True)
    newer = _tracked(non_persistent) if non_persistent and step is None else None
    if newer is not None and (found is None or newer >= found[1]):
        found = resolve_load(non_persistent, None, "--non-persistent-global-ckpt-dir")
    if found is not None:
        return Found(*found, pretrained=False)
    if pretrained:
        return Found(*resolve_load(pretrained, step, "--pretrained-checkpoint"),
                     pretrained=True)
    if load and exit_on_missing:
        raise CheckpointError(f"--exit-on-missing-checkpoint: --load {load} holds no "
                              f"checkpoint yet")
    return None


def fresh_start_line(load: str, save: Optional[str]) -> str:
    """What a run whose --load holds no checkpoint says before it starts from scratch."""
    if save and os.path.abspath(load) == os.path.abspath(save):
        return (f"> no checkpoint in {load} yet (it is also --save): starting from scratch, "
                f"later runs resume from it")
    where = "no such directory" if not os.path.exists(load) else "no checkpoint there yet"
    return (f"warning: --load {load}: {where}: starting from scratch, as Megatron-LM does "
            f"(--exit-on-missing-checkpoint stops instead)")


def read_checkpoint_info(path: str) -> dict:
    """The common (non-tensor) part of a checkpoint of either format, after checking the folder
    is whole: {'iteration', 'args', 'model_info', 'layout', ...}. No process group needed."""
    if detect_format(path) == TORCH:
        common = torch_format.read_info(path)
    else:
        check_complete(path)
        common = load_torch_file(os.path.join(path, "common.pt"))  # plain data only
    if not isinstance(common, dict):
        raise CheckpointError(f"{path}: holds a {type(common).__name__}, not a checkpoint's "
                              f"common state")
    return common


def _check_before_loading(path: str, ckpt_format: str, optimizer, scheduler, args) -> dict:
    """The checkpoint's common part, after every rank checked the folder, read its pickles
    safely, and compared its model flags and learning-rate schedule with this run's (OPTIMIZER
    and SCHEDULER: None where they are not loaded); one CheckpointError on every rank
    otherwise. Collective."""
    problems = []
    common = None
    try:
        common = read_checkpoint_info(path)  # common.pt and .metadata, read safely
        check_model_flags(common.get("args"), args, path)
        if ckpt_format != TORCH:
            # Megatron-Core's loader unpickles these without restriction: read them safely first.
            read_sharded_objects(path, read_metadata(path))
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
    problems = agree(problems)
    if problems:
        raise CheckpointError(problems[0])
    return common


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------


def load_checkpoint(path: str, model, optimizer, scheduler, args=None,
                    options: Optional[LoadOptions] = None) -> dict:
    """Load the checkpoint folder PATH into model / optimizer / scheduler, and this rank's RNG
    states when the layout is the one it was saved with, as the flags of ARGS say (or
    OPTIONS: LoadOptions). Collective.

    Returns {'iteration', 'consumed_samples', 'optimizer_loaded', 'rng_restored', 'notes',
    'layout', 'ckpt_format'}. A checkpoint without optimizer state (converted from a single
    file, upcycled, saved with --no-save-optim) leaves the optimizer and the schedule fresh;
    notes says so. --finetune (or a --pretrained-checkpoint): the weights only, at iteration 0.
    """
    options = options or LoadOptions.from_args(args)
    ckpt_format = loading_format(detect_format(path), options.ckpt_format, options.auto_detect,
                                 path)
    load_optim = optimizer if options.load_optim else None
    common = _check_before_loading(path, ckpt_format, load_optim,
                                   scheduler if options.load_optim else None, args)
    has_optimizer = load_optim is not None and common.get("optimizer_step") is not None
    notes = []
    if load_optim is not None and not has_optimizer:
        notes.append("the checkpoint holds no optimizer state: the optimizer and the "
                     "learning-rate schedule start fresh")
    if ckpt_format == TORCH:
        torch_format.load_files(path, model, optimizer if has_optimizer else None,
                                layout_of(args))
        if optimizer is not None and not has_optimizer:
            optimizer.reload_model_params()  # --bf16 / --fp16: main params from the weights
    else:
        _load_torch_dist(path, model, optimizer, common, has_optimizer, args, options, notes)
    if scheduler is not None and has_optimizer and "opt_param_scheduler" in common:
        notes += _load_schedule(common["opt_param_scheduler"], scheduler)
    rng_restored = options.load_rng and _restore_rng(common.get("rng_state"), layout_of(args),
                                                     notes)
    return {"iteration": 0 if options.finetune else int(common.get("iteration", 0)),
            "consumed_samples": 0 if options.finetune else int(common.get("consumed_samples", 0)),
            "optimizer_loaded": has_optimizer, "rng_restored": rng_restored, "notes": notes,
            "layout": common.get("layout"), "ckpt_format": ckpt_format}


def _load_torch_dist(path: str, model, optimizer, common: dict, has_optimizer: bool, args,
                     options: LoadOptions, notes: list) -> None:
    """The model's (and, with HAS_OPTIMIZER, the optimizer's) tensors of the torch_dist
    checkpoint PATH, through Megatron-Core's load with the flags' strategy and strictness."""
    from megatron.core import dist_checkpointing

    optimizer_metadata = load_metadata(common, args)
    request, targets = sharded_state_dict(model, optimizer if has_optimizer else None,
                                          is_loading=True, metadata=optimizer_metadata)
    metadata = read_metadata(path)
    # The fp32 main parameters under the name the checkpoint has for them; none in a plain
    # optimizer's without --bf16 / --fp16: the distributed optimizer's from the loaded weights.
    main_params_missing = match_main_params(request, metadata)
    problems = agree(check_request(sharded_tensors(request), metadata,
                                   lacking=options.strictness == STRICTNESS_DEFAULT))
    if problems:
        # The first tensor on the error's own line, any others below it.
        shown = "\n  ".join(problems[:8])
        more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise CheckpointError(f"{path} does not fit this model: {shown}{more}")

    with warnings.catch_warnings():
        for message, module in _LOAD_WARNINGS:
            warnings.filterwarnings("ignore", message, FutureWarning, module)
        loaded = dist_checkpointing.load(request, path, load_strategy(path, options),
                                         strict=mcore_strictness(options.strictness))
    state, missing, unexpected = loaded if isinstance(loaded, tuple) else (loaded, (), ())
    error, strict_notes = strictness_outcome(options.strictness, set(missing),
                                             set(agree(sorted(unexpected))))
    if error:
        raise CheckpointError(error)
    notes += strict_notes
    chunks = model_chunks(model)
    for key, chunk in zip(model_keys(len(chunks)), chunks):
        # a tensor the checkpoint lacks (--dist-ckpt-strictness) keeps this run's values
        chunk.load_state_dict(state[key], strict=not unexpected)
    if optimizer is not None:
        _load_optimizer(optimizer, state if has_optimizer else None, targets, common,
                        optimizer_metadata, main_params_missing)


def _load_optimizer(optimizer, state, targets, common, metadata, main_params_missing) -> None:
    """The optimizer's part of the loaded STATE (None: not loaded), into the plain or the
    distributed optimizer, whichever format it was saved in."""
    if state is not None and is_distributed(optimizer):
        load_distributed_state(optimizer, state["optimizer"], metadata, common["optimizer_step"],
                               common.get("loss_scaler"))
    elif state is not None:
        load_optimizer_state(optimizer, state["optimizer_state"], targets,
                             common["optimizer_step"], common.get("loss_scaler"))
    if state is None or main_params_missing:
        # Mixed precision: without saved main params (a converted or upcycled checkpoint, a
        # plain fp32 one, --no-load-optim) the optimizer's fp32 copies start from the loaded
        # weights. (Saved ones were loaded in place, into the main params themselves:
        # reloading would overwrite them.)
        optimizer.reload_model_params()


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
