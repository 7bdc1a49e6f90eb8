"""Where checkpoints live and which one to load: Megatron-LM's layout, atomic publishing.

    ROOT/
      latest_checkpointed_iteration.txt   "20"  (written last, by rename: names a complete one)
      iter_0000010/                       a complete checkpoint (published by rename)
      iter_0000020/
      iter_0000030.partial/               a save in progress, or one killed mid-way: ignored

Pure file-system logic, no process groups; the collective save/load is in save_load.py.
An iteration's folder holds either format (formats.py).

    resolve_load(load, step)            which checkpoint --load (and --ckpt-step) means
    publish(root, iteration)            a staged save made the tracked one
    retention_victim(previous, saved, retain_interval)
                                        the save --save-retain-interval deletes (Megatron-LM's rule)
    remove_checkpoint(root, iteration)  delete one published save (never through a link)
"""

from __future__ import annotations

import os
import re
import shutil
from typing import List, Optional, Tuple

from megatron_parm.checkpointing.errors import CheckpointError
from megatron_parm.checkpointing.formats import TORCH, detect_format, rank_zero_file

TRACKER_FILE = "latest_checkpointed_iteration.txt"
PARTIAL_SUFFIX = ".partial"
REPLACED_SUFFIX = ".replaced"
# The files every published torch_dist checkpoint folder holds (.metadata: torch DCP's index).
REQUIRED_FILES = ("metadata.json", "common.pt", ".metadata")
_ITER_DIR = re.compile(r"^iter_(\d{7})$")


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def partial_dir(root: str, iteration: int) -> str:
    return checkpoint_dir(root, iteration) + PARTIAL_SUFFIX


def is_checkpoint_dir(path: str) -> bool:
    """A folder that looks like one published checkpoint (not a root of several)."""
    return detect_format(path) is not None


def read_tracker(root: str) -> Optional[int]:
    """The iteration named by ROOT/latest_checkpointed_iteration.txt, or None if absent."""
    path = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} should hold an iteration number, got {text!r} "
                              f"(corrupted tracker file)")
    return int(text)


def list_checkpoints(root: str) -> List[Tuple[int, str]]:
    """(iteration, folder) of every published iter_NNNNNNN folder under ROOT, in order."""
    found = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            match = _ITER_DIR.match(name)
            if match and os.path.isdir(os.path.join(root, name)):
                found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


def list_partial(root: str) -> List[str]:
    if not os.path.isdir(root):
        return []
    return sorted(name for name in os.listdir(root) if name.endswith(PARTIAL_SUFFIX))


def missing_files(path: str) -> List[str]:
    """The files a published checkpoint folder of its format must hold and PATH lacks."""
    if detect_format(path) == TORCH:
        return [] if rank_zero_file(path) else ["mp_rank_00*/model_optim_rng.pt"]
    return [name for name in REQUIRED_FILES if not os.path.isfile(os.path.join(path, name))]


def resolve_load(load: str, step: Optional[int] = None, flag: str = "--load",
                 may_be_empty: bool = False) -> Optional[Tuple[str, int]]:
    """Which checkpoint `--load LOAD` means: (folder, iteration), or None for a fresh start.

    MAY_BE_EMPTY (--load of a training run): a LOAD that does not exist, or holds nothing but
    unfinished saves, is a fresh start, as in Megatron-LM (the first run of a job, or of a
    config whose --load is a new folder). Everything else that finds no usable checkpoint raises
    CheckpointError: a tracker naming a missing folder, an incomplete iter_NNNNNNN folder.
    LOAD may also name one checkpoint folder (iter_NNNNNNN) directly. STEP (--ckpt-step): that
    iteration's folder of LOAD, whatever the tracker names. FLAG: the flag that named LOAD, for
    the messages.
    """
    may_be_empty = may_be_empty and step is None
    if not os.path.exists(load):
        if may_be_empty:
            return None
        raise CheckpointError(f"{flag} {load}: no such directory")
    if not os.path.isdir(load):
        raise CheckpointError(f"{flag} {load}: not a directory")
    if step is not None:
        return _step_folder(load, step, flag)
    if is_checkpoint_dir(load):
        match = _ITER_DIR.match(os.path.basename(os.path.normpath(load)))
        return load, int(match.group(1)) if match else _iteration_from_common(load)
    tracked = read_tracker(load)
    if tracked is not None:
        path = checkpoint_dir(load, tracked)
        if not os.path.isdir(path):
            raise CheckpointError(
                f"{flag} {load}: {TRACKER_FILE} names iteration {tracked}, but {path} does not "
                f"exist (deleted, or moved without the tracker file)")
        return path, tracked
    published = [(it, path) for it, path in list_checkpoints(load) if not missing_files(path)]
    if published:
        # A kill between publishing a folder and writing the tracker leaves exactly this.
        return published[-1][1], published[-1][0]
    partial = list_partial(load)
    unfinished = [os.path.basename(p) for _, p in list_checkpoints(load)]
    if may_be_empty and not unfinished:
        return None
    detail = ""
    if unfinished:
        detail = f"; incomplete checkpoint folders: {', '.join(unfinished)}"
    if partial:
        detail += f"; unfinished saves: {', '.join(partial)}"
    raise CheckpointError(f"{flag} {load}: no checkpoint found (no {TRACKER_FILE} and no "
                          f"complete iter_NNNNNNN folder){detail}")


def _step_folder(load: str, step: int, flag: str) -> Tuple[str, int]:
    """--ckpt-step STEP of LOAD: (its iter_ folder, STEP), or CheckpointError naming both."""
    if is_checkpoint_dir(load):
        raise CheckpointError(f"--ckpt-step {step}: {flag} {load} names one checkpoint folder; "
                              f"give the folder that holds its iter_NNNNNNN folders")
    path = checkpoint_dir(load, step)
    if not os.path.isdir(path) or missing_files(path):
        held = ", ".join(str(it) for it, found in list_checkpoints(load)
                         if not missing_files(found)) or "none"
        problem = "is incomplete" if os.path.isdir(path) else "does not exist"
        raise CheckpointError(f"--ckpt-step {step}: {path} {problem} (complete iterations in "
                              f"{load}: {held})")
    return path, step


def _iteration_from_common(path: str) -> int:
    from megatron_parm.checkpointing.safe_load import load_torch_file

    common_file = rank_zero_file(path) if detect_format(path) == TORCH else \
        os.path.join(path, "common.pt")
    common = load_torch_file(common_file, "--load")
    return int(common.get("iteration", 0))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_tracker(root: str, iteration: int) -> None:
    """Point the tracker at ITERATION atomically (temporary file, fsync, rename)."""
    tmp = os.path.join(root, TRACKER_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER_FILE))
    fsync_dir(root)


def publish(root: str, iteration: int) -> str:
    """Rename iter_N.partial to iter_N (replacing an older iter_N), then write the tracker.

    Run by one rank once every rank has finished writing. A kill at any point leaves either
    the previous checkpoint tracked, or the new one complete (and found without the tracker).
    Afterwards the folders of earlier, killed saves (*.partial) are removed.
    """
    staged, final = partial_dir(root, iteration), checkpoint_dir(root, iteration)
    for name in os.listdir(staged):
        if os.path.isfile(os.path.join(staged, name)):
            with open(os.path.join(staged, name), "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(staged)
    replaced = None
    if os.path.exists(final):
        replaced = final + REPLACED_SUFFIX
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    os.rename(staged, final)
    fsync_dir(root)
    write_tracker(root, iteration)
    if replaced:
        shutil.rmtree(replaced, ignore_errors=True)
    # Saves are sequential: any other unfinished save here was killed. Reclaim its space.
    for name in list_partial(root):
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return final


def retention_victim(previous: Optional[int], saved: int,
                     retain_interval: Optional[int]) -> Optional[int]:
    """The iteration --save-retain-interval deletes once SAVED is published and tracked:
    Megatron-LM's rule, the save the tracker named before (PREVIOUS) when its iteration is not
    a multiple of the interval. Only an older one: the latest complete save is never deleted."""
    if retain_interval is None or previous is None or not 0 < previous < saved:
        return None
    return previous if previous % retain_interval else None


def remove_checkpoint(root: str, iteration: int) -> bool:
    """Delete ROOT's published save of ITERATION (not through a symbolic link, as Megatron-LM);
    whether it was deleted."""
    path = checkpoint_dir(root, iteration)
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True
