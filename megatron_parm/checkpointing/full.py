"""A whole checkpoint on one process: read every tensor unsharded, write one back.

    read_full(path)  -> FullCheckpoint(tensors {key: full tensor}, objects {key: bytes}, common)
    write_full(root, iteration, full)   a torch_dist checkpoint (one chunk per tensor), published
    save_single_file / load_single_file one torch.save file with checksums

A torch_dist checkpoint stores each tensor under its global name with its global shape, cut in
chunks by the layout that saved it; torch DCP reads any box of it, so reading whole tensors
needs no model and no process group. A checkpoint written whole loads in any layout (every
rank reads its own box), which is what the training loader does.
"""

from __future__ import annotations

import dataclasses
import io
import os
import shutil
from typing import Dict

import torch

from megatron_parm.checkpointing.errors import CheckpointError
from megatron_parm.checkpointing.paths import partial_dir, publish
from megatron_parm.checkpointing.safe_load import load_safely, load_torch_file
from megatron_parm.checkpointing.verify import (
    check_complete,
    compare_checksums,
    read_metadata,
    tensor_entries,
    tensor_checksums,
    write_manifest,
)

SINGLE_FILE_FORMAT = "megatron-parm single-file checkpoint"


@dataclasses.dataclass
class FullCheckpoint:
    tensors: Dict[str, torch.Tensor]
    objects: Dict[str, object]         # Megatron's ShardedObjects (layers' _extra_state)
    common: dict                       # iteration, args, schedule, RNG states, ...


def read_full(path: str) -> FullCheckpoint:
    """Every tensor of the checkpoint folder PATH, whole, its objects and its common state;
    every pickle in it read with safe_load's allow-lists."""
    check_complete(path)
    metadata = read_metadata(path)
    entries = tensor_entries(metadata)
    tensors = {key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
               for key, entry in entries.items()}
    objects = {key: io.BytesIO() for key in metadata.state_dict_metadata if key not in entries}
    state = {**tensors, **objects}
    # The planner replaces each byte entry by the object read (safely) from it.
    load_safely(state, path)
    common = load_torch_file(os.path.join(path, "common.pt"))
    return FullCheckpoint(tensors, {key: state[key] for key in objects}, common)


def write_full(root: str, iteration: int, full: FullCheckpoint) -> str:
    """Write FULL as ROOT/iter_N (staged in iter_N.partial, then published with the tracker)."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    staged = partial_dir(root, iteration)
    os.makedirs(root, exist_ok=True)
    shutil.rmtree(staged, ignore_errors=True)
    os.makedirs(staged)
    state = {**{k: v.contiguous() for k, v in full.tensors.items()},
             **full.objects}  # DCP pickles each object into its byte entry, as Megatron does
    dcp.save(state, storage_writer=dcp.FileSystemWriter(staged), no_dist=True)
    torch.save(full.common, os.path.join(staged, "common.pt"))
    save_config(CheckpointingConfig("torch_dist", 1), staged)
    write_manifest(staged, {"iteration": iteration, "layout": full.common.get("layout")})
    return publish(root, iteration)


def verify_against(path: str, expected: Dict[str, dict], what: str) -> FullCheckpoint:
    """Read PATH back and raise CheckpointError naming every tensor whose checksum differs."""
    full = read_full(path)
    problems = compare_checksums(expected, tensor_checksums(full.tensors))
    if problems:
        raise CheckpointError(f"{path}: {what}: tensors did not make it across:\n  "
                              + "\n  ".join(problems[:20]))
    return full


def save_single_file(full: FullCheckpoint, file_path: str, sums=None) -> Dict[str, dict]:
    """Write FULL as one torch.save file with its tensors' checksums (SUMS, computed if None)."""
    sums = sums or tensor_checksums(full.tensors)
    os.makedirs(os.path.dirname(os.path.abspath(file_path)), exist_ok=True)
    torch.save({"format": SINGLE_FILE_FORMAT, "version": 1, "tensors": full.tensors,
                "objects": full.objects, "common": full.common, "checksums": sums},
               file_path + ".tmp")
    os.replace(file_path + ".tmp", file_path)
    return sums


def load_single_file(file_path: str) -> FullCheckpoint:
    """Read a single file and check every tensor against the checksums stored with it."""
    if not os.path.isfile(file_path):
        raise CheckpointError(f"--from-single-file {file_path}: no such file")
    data = load_torch_file(file_path, "--from-single-file")  # plain data only
    if not isinstance(data, dict) or data.get("format") != SINGLE_FILE_FORMAT:
        raise CheckpointError(f"{file_path} is not a {SINGLE_FILE_FORMAT} "
                              f"(written by tools/convert_checkpoint.py --to-single-file)")
    problems = compare_checksums(data["checksums"], tensor_checksums(data["tensors"]))
    if problems:
        raise CheckpointError(f"{file_path}: tensors do not match the checksums stored with "
                              f"them:\n  " + "\n  ".join(problems[:20]))
    return FullCheckpoint(data["tensors"], data["objects"], data["common"])
