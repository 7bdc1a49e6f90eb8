"""The two checkpoint formats (--ckpt-format), told apart by their files, and Megatron-LM's names
of the torch format's per-rank files. Pure file-system logic, no process groups.

    torch_dist   iter_N/metadata.json, common.pt, .metadata, *.distcp (Megatron-Core's
                 dist_checkpointing): loads in any layout
    torch        iter_N/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt (+ distrib_optim.pt with the
                 distributed optimizer): one file per model-parallel rank, torch.save'd; loads at
                 the same tp, pp, vpp, ep and etp

    detect_format(folder)                          'torch_dist', 'torch' or None
    loading_format(found, ckpt_format, auto_detect, folder)
                                                   the format to load, or CheckpointError
    rank_dir_name(tp_rank, pp_rank, ep_rank, pipeline_parallel, expert_parallel)
    rank_zero_file(folder)                         the first rank's file, whichever naming
"""

from __future__ import annotations

import os
from typing import Optional

from megatron_parm.checkpointing.errors import CheckpointError

TORCH_DIST, TORCH = "torch_dist", "torch"
MODEL_FILE = "model_optim_rng.pt"  # Megatron-LM's names
OPTIMIZER_FILE = "distrib_optim.pt"
RANK_DIR_PREFIX = "mp_rank_"


def detect_format(folder: str) -> Optional[str]:
    """The format of the checkpoint folder FOLDER (one iteration's), as Megatron-LM tells it:
    torch_dist where Megatron-Core's metadata.json is, torch where an mp_rank_0* entry is."""
    if os.path.isfile(os.path.join(folder, "metadata.json")):
        return TORCH_DIST
    if os.path.isdir(folder) and any(name.startswith(RANK_DIR_PREFIX + "0")
                                     for name in os.listdir(folder)):
        return TORCH
    return None


def loading_format(found: Optional[str], ckpt_format: str, auto_detect: bool,
                   folder: str) -> str:
    """The format a run loads FOLDER in, by Megatron-LM's rules: the folder's own with
    --ckpt-format torch_dist (the default) or --auto-detect-ckpt-format; --ckpt-format torch
    alone loads torch folders only."""
    if found is None:
        raise CheckpointError(f"{folder} holds no checkpoint of either format (no metadata.json "
                              f"of torch_dist, no {RANK_DIR_PREFIX}* folder of torch)")
    if found == ckpt_format or auto_detect or ckpt_format == TORCH_DIST:
        return found
    raise CheckpointError(f"--ckpt-format {ckpt_format}: {folder} holds a {found} checkpoint; "
                          f"give --auto-detect-ckpt-format to load it (or --ckpt-format {found})")


def rank_dir_name(tp_rank: int, pp_rank: int, ep_rank: int, pipeline_parallel: bool,
                  expert_parallel: bool) -> str:
    """Megatron-LM's folder of one model-parallel rank's files: mp_rank_TT, with _PPP where the
    pipeline has several stages and _EEE where experts are split over several ranks."""
    name = f"{RANK_DIR_PREFIX}{tp_rank:02d}"
    if pipeline_parallel:
        name += f"_{pp_rank:03d}"
    if expert_parallel:
        name += f"_{ep_rank:03d}"
    return name


def rank_zero_file(folder: str) -> Optional[str]:
    """The first rank's model file of a torch checkpoint folder, under any of the four namings
    (Megatron-LM's find_checkpoint_rank_0), or None."""
    for pipeline_parallel in (False, True):
        for expert_parallel in (False, True):
            path = os.path.join(folder, rank_dir_name(0, 0, 0, pipeline_parallel,
                                                      expert_parallel), MODEL_FILE)
            if os.path.isfile(path):
                return path
    return None
