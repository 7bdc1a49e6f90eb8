"""Checkpoints in Megatron-LM's layout, written with Megatron-Core's dist_checkpointing.

    SAVE/
      latest_checkpointed_iteration.txt     "20"
      iter_0000020/                         torch_dist: metadata.json, common.pt, *.distcp

A checkpoint holds the model and optimizer as sharded tensors (so it can be loaded in
another (tp, ep, etp) layout), the learning-rate schedule, the iteration and the consumed
samples. Every rank calls save_checkpoint / load_checkpoint (they are collective).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from megatron.core import dist_checkpointing

TRACKER_FILE = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_latest_iteration(root: str) -> Optional[int]:
    """The iteration named by ROOT/latest_checkpointed_iteration.txt, or None."""
    path = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise ValueError(f"--load: {path} should hold an iteration number, got {text!r}")
    return int(text)


def _unwrap(model):
    # Megatron-LM stores the model under its own names (decoder.layers...), not DDP's module.*
    return getattr(model, "module", model)


def _sharded_state_dict(model, optimizer, is_loading: bool):
    model_state = _unwrap(model).sharded_state_dict()
    state = {"model": model_state, "checkpoint_version": CHECKPOINT_VERSION}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading)
    return state


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler,
                    consumed_samples: int, args=None) -> str:
    """Write ROOT/iter_NNNNNNN/ then point the tracker file at it; returns the folder."""
    path = checkpoint_dir(root, iteration)
    rank = torch.distributed.get_rank()
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    state = _sharded_state_dict(model, optimizer, is_loading=False)
    state["iteration"] = iteration
    state["consumed_samples"] = consumed_samples
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    if args is not None:
        state["args"] = {k: v for k, v in vars(args).items()
                         if isinstance(v, (int, float, str, bool, list, tuple, type(None)))}
    dist_checkpointing.save(state, path, sharded_strategy=("torch_dist", 1))
    torch.distributed.barrier()
    if rank == 0:
        # The tracker is written last, so it only ever names a complete checkpoint.
        tmp = os.path.join(root, TRACKER_FILE + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, TRACKER_FILE))
    torch.distributed.barrier()
    return path


def load_checkpoint(root: str, model, optimizer, scheduler):
    """Load the latest checkpoint under ROOT into model/optimizer/scheduler.

    Returns (iteration, consumed_samples), or (0, 0) when ROOT holds no checkpoint.
    """
    iteration = read_latest_iteration(root)
    if iteration is None:
        return 0, 0
    path = checkpoint_dir(root, iteration)
    state = dist_checkpointing.load(_sharded_state_dict(model, optimizer, is_loading=True), path)
    _unwrap(model).load_state_dict(state["model"])
    if optimizer is not None and "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and "opt_param_scheduler" in state:
        scheduler.load_state_dict(state["opt_param_scheduler"])
    return int(state["iteration"]), int(state.get("consumed_samples", 0))
