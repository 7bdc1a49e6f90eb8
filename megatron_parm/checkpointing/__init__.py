"""Checkpoints in Megatron-LM's layout, written with Megatron-Core's dist_checkpointing
(--ckpt-format torch_dist, the default) or as Megatron-LM's per-rank files (torch).

    SAVE/
      latest_checkpointed_iteration.txt     "20"  (written last)
      iter_0000020/                         torch_dist: metadata.json, common.pt, .metadata,
                                            *.distcp, parm_manifest.json
      iter_0000025/                         torch: mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt
                                            (+ distrib_optim.pt), parm_manifest.json
      iter_0000030.partial/                 a save in progress (or killed): never loaded
      non_persistent/                       --non-persistent-ckpt-type global: the latest only

    save_checkpoint(root, iteration, model, optimizer, scheduler, consumed_samples, args)
    find_checkpoint(load, ...)    -> Found(folder, iteration, pretrained) or None (fresh
                                  start: see paths.resolve_load, said by fresh_start_line)
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

What a save writes and a load takes follows Megatron-LM's checkpoint flags (options.py):
--no-save-optim / --no-save-rng, --no-load-optim / --no-load-rng, --finetune and
--pretrained-checkpoint (weights only, iteration 0), --ckpt-step, --save-retain-interval,
--dist-ckpt-strictness, the fully parallel save and load, --ckpt-assume-constant-structure.

A module per concern, importing only downwards (errors first):
    errors           CheckpointError, agree (all ranks raise together)
    formats          torch_dist or torch: telling them apart, Megatron-LM's per-rank file names
    paths            the folder layout, which checkpoint to load, atomic publishing (tracker),
                     which saves --save-retain-interval deletes
    options          the checkpoint flags as SaveOptions / LoadOptions
    intervals        when a run saves, where non-persistent saves go
    safe_load        reading a checkpoint's pickles with an allow-list
    verify           a folder is whole; what a model asks for is in it; the manifest
    scheduler        the learning-rate schedule's flags against a checkpoint's
    optimizer_state  Adam's moments and fp32 main parameters as global ShardedTensors
    state            the model's sharded state, the layout record, the shape flags, unwrap()
    rng              every rank's generator states
    strategies       Megatron-Core's save and load strategies, --dist-ckpt-strictness
    torch_format     --ckpt-format torch's per-rank files
    save_load        save_checkpoint, load_checkpoint, find_checkpoint, read_checkpoint_info
    checkpoint_args  --use-checkpoint-args
    fault_hook       fault-injection tests' hook into a save
    full, hf_gpt2, upcycle   whole-model files: conversions (tools/convert_checkpoint.py)
"""

from megatron_parm.checkpointing.errors import CheckpointError
from megatron_parm.checkpointing.options import LoadOptions, SaveOptions
from megatron_parm.checkpointing.strategies import CheckpointingContext
from megatron_parm.checkpointing.fault_hook import set_fault_hook
from megatron_parm.checkpointing.paths import TRACKER_FILE, checkpoint_dir
from megatron_parm.checkpointing.save_load import (
    check_save_format,
    find_checkpoint,
    fresh_start_line,
    load_checkpoint,
    read_checkpoint_info,
    read_latest_iteration,
    save_checkpoint,
)
from megatron_parm.checkpointing.state import CHECKPOINT_VERSION, SHAPE_FLAGS, check_model_flags

__all__ = [
    "TRACKER_FILE", "CheckpointError", "check_save_format", "CheckpointingContext", "LoadOptions", "SaveOptions",
    "checkpoint_dir", "read_latest_iteration",
    "save_checkpoint", "find_checkpoint", "fresh_start_line", "read_checkpoint_info", "load_checkpoint",
    "SHAPE_FLAGS", "CHECKPOINT_VERSION", "check_model_flags", "set_fault_hook",
]
