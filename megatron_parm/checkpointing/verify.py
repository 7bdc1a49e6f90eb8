"""Checks that a torch_dist checkpoint is whole, and that it fits the model asking for it.

    check_complete(path)                  files present, every tensor fully covered by chunks
                                          whose bytes exist, everything the manifest lists present
    check_request(sharded_sd, metadata)   the keys and global shapes a model asks for exist
    tensor_checksums / compare_tensors    per-tensor (and per-expert) CRC32s, for the converter

Expert weights are stored as one tensor per linear layer with a layer and an expert axis,
[L, E, rows, cols] (Megatron's SequentialMLP / GroupedMLP sharded keys); problems inside one
are named with the layer and expert they hit.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from typing import Callable, Dict, Iterable, List, Optional

import torch

from megatron_parm import __version__
from megatron_parm.checkpointing.errors import CheckpointError
from megatron_parm.checkpointing.formats import TORCH, detect_format
from megatron_parm.checkpointing.paths import missing_files

MANIFEST_FILE = "parm_manifest.json"
# An expert tensor saved per layer (a model whose layers differ, an MTP layer): [E, ...]
_ONE_LAYER = re.compile(r"layers\.\d+\.")
_SHOWN = 8  # problems listed in one error message before "... and N more"


def read_metadata(path: str):
    """torch DCP's index of a checkpoint folder (.metadata), read safely, with a clear error if
    unreadable."""
    from megatron_parm.checkpointing.safe_load import load_dcp_metadata

    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(f"{path}: .metadata missing (not a torch_dist checkpoint, or a "
                              f"save that did not finish)")
    return load_dcp_metadata(os.path.join(path, ".metadata"))  # refuses anything but metadata


def tensor_entries(metadata) -> Dict[str, "object"]:
    """key -> TensorStorageMetadata for every tensor (not the byte objects) in a checkpoint."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {key: value for key, value in metadata.state_dict_metadata.items()
            if isinstance(value, TensorStorageMetadata)}


def is_expert_key(key: str) -> bool:
    return ".mlp.experts." in key and not key.endswith("_extra_state")


def describe_offset(key: str, offsets) -> str:
    """'offset (0, 1, 0, 0) [layer 0, expert 1]' for an expert tensor chunk, else the offset."""
    text = f"offset {tuple(offsets)}"
    if is_expert_key(key) and len(offsets) >= 3:
        text += f" [layer {offsets[0]}, expert {offsets[1]}]"
    return text


def _volume(sizes) -> int:
    total = 1
    for size in sizes:
        total *= int(size)
    return total


def _raise(path: str, what: str, problems: List[str]) -> None:
    if problems:
        more = f"\n  ... and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
        raise CheckpointError(f"{path}: {what}:\n  " + "\n  ".join(problems[:_SHOWN]) + more)


def check_complete(path: str) -> None:
    """Raise CheckpointError naming the tensor if PATH is not a whole checkpoint."""
    if detect_format(path) == TORCH:
        raise CheckpointError(f"{path} is a --ckpt-format torch checkpoint (per-rank files): "
                              f"this reads torch_dist ones; a run loads it with the layout it "
                              f"was saved at, and saves torch_dist with --ckpt-format torch_dist")
    missing = missing_files(path)
    if missing:
        raise CheckpointError(f"{path}: incomplete checkpoint, missing {', '.join(missing)}")
    metadata = read_metadata(path)
    problems = []
    tensors = tensor_entries(metadata)
    # 1. Chunks inside bounds and covering every tensor (chunks never overlap in DCP).
    for key, entry in tensors.items():
        covered = 0
        for chunk in entry.chunks:
            if any(o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, entry.size)):
                problems.append(f"{key}: chunk at {describe_offset(key, chunk.offsets)} lies "
                                f"outside its shape {tuple(entry.size)}")
            covered += _volume(chunk.sizes)
        if covered != _volume(entry.size):
            problems.append(f"{key}: chunks cover {covered} of {_volume(entry.size)} elements "
                            f"(a shard is missing){_missing_experts(key, entry)}")
    # 2. Every chunk's bytes are in a file that is long enough; a missing file is one problem
    # naming what it held, its tensors first.
    file_sizes, lost = {}, {}
    for index, info in metadata.storage_data.items():
        file_path = os.path.join(path, info.relative_path)
        if info.relative_path not in file_sizes:
            file_sizes[info.relative_path] = (os.path.getsize(file_path)
                                              if os.path.isfile(file_path) else -1)
        size = file_sizes[info.relative_path]
        where = f" at {describe_offset(index.fqn, index.offset)}" if index.offset is not None else ""
        if size < 0:
            lost.setdefault(info.relative_path, []).append(index.fqn)
        elif size < info.offset + info.length:
            problems.append(f"{index.fqn}{where}: its data file {info.relative_path} is "
                            f"truncated ({size} bytes, needs {info.offset + info.length})")
    for file_name, keys in lost.items():
        held = sorted(set(keys), key=lambda key: (key not in tensors, key))
        shown = ", ".join(held[:_SHOWN]) + (f" and {len(held) - _SHOWN} more"
                                            if len(held) > _SHOWN else "")
        problems.append(f"its data file {file_name} is missing; it held {shown}")
    # 3. Every chunk the index lists has a storage entry.
    stored = {(index.fqn, tuple(index.offset)) for index in metadata.storage_data
              if index.offset is not None}
    for key, entry in tensors.items():
        for chunk in entry.chunks:
            if (key, tuple(chunk.offsets)) not in stored:
                problems.append(f"{key}: chunk at {describe_offset(key, chunk.offsets)} has no data")
    # 4. What the manifest (written when the checkpoint was saved) promises is there.
    manifest = read_manifest(path)
    if manifest is not None:
        for key, info in manifest["tensors"].items():
            if key not in tensors:
                problems.append(f"{key}: listed in {MANIFEST_FILE} but missing from the checkpoint")
            elif list(tensors[key].size) != info["shape"]:
                problems.append(f"{key}: shape {tuple(tensors[key].size)}, but "
                                f"{MANIFEST_FILE} says {tuple(info['shape'])}")
    _raise(path, "damaged checkpoint", problems)


def _missing_experts(key: str, entry) -> str:
    """For an expert tensor [L, E, ...]: which (layer, expert) slices no chunk touches."""
    if not is_expert_key(key) or len(entry.size) < 3:
        return ""
    present = set()
    for chunk in entry.chunks:
        for layer in range(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]):
            for expert in range(chunk.offsets[1], chunk.offsets[1] + chunk.sizes[1]):
                present.add((layer, expert))
    absent = [(l, e) for l in range(entry.size[0]) for e in range(entry.size[1])
              if (l, e) not in present]
    if not absent:
        return ""
    return "; no data at all for " + ", ".join(f"layer {l} expert {e}" for l, e in absent[:6])


def manifest_from_metadata(metadata, extra: Optional[dict] = None) -> dict:
    tensors = tensor_entries(metadata)
    manifest = {
        "format": "megatron-parm manifest", "version": 1, "megatron_parm_version": __version__,
        "tensors": {key: {"shape": list(entry.size),
                          "dtype": str(entry.properties.dtype).replace("torch.", "")}
                    for key, entry in sorted(tensors.items())},
        "num_expert_tensors": sum(1 for key in tensors if is_expert_key(key)),
        "num_objects": len(metadata.state_dict_metadata) - len(tensors),
    }
    manifest.update(extra or {})
    return manifest


def write_manifest(path: str, extra: Optional[dict] = None) -> dict:
    manifest = manifest_from_metadata(read_metadata(path), extra)
    with open(os.path.join(path, MANIFEST_FILE), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def read_manifest(path: str) -> Optional[dict]:
    file_path = os.path.join(path, MANIFEST_FILE)
    if not os.path.isfile(file_path):
        return None
    try:
        with open(file_path) as f:
            return json.load(f)
    except ValueError as err:
        raise CheckpointError(f"{file_path} is corrupted: {err}") from err


def check_request(sharded_tensors: Iterable, metadata, lacking: bool = True) -> List[str]:
    """Problems loading these ShardedTensors (this rank's) from a checkpoint with METADATA:
    a key the checkpoint lacks (unless LACKING is False: --dist-ckpt-strictness says what
    happens then), or one whose global shape differs (another model shape)."""
    tensors = tensor_entries(metadata)
    problems = []
    for sharded in sharded_tensors:
        entry = tensors.get(sharded.key)
        if entry is None:
            if lacking:
                problems.append(f"{sharded.key}: not in the checkpoint")
        elif tuple(entry.size) != tuple(sharded.global_shape):
            problems.append(f"{sharded.key}: shape {tuple(entry.size)} in the checkpoint, "
                            f"{tuple(sharded.global_shape)} in this model")
    return problems


# ---------------------------------------------------------------------------------------------
# checksums (for the converter: full, unsharded tensors)
# ---------------------------------------------------------------------------------------------

def crc32(tensor: torch.Tensor) -> int:
    data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return zlib.crc32(data)


def tensor_checksums(tensors: Dict[str, torch.Tensor],
                     on_tensor: Optional[Callable[[int], None]] = None) -> Dict[str, dict]:
    """key -> {'shape', 'dtype', 'crc32'} and, for expert tensors, one crc32 per [layer, expert]
    (one layer where the key names it).
    on_tensor(n) is called after each tensor with the number done (a progress bar)."""
    sums = {}
    for key, tensor in tensors.items():
        info = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).replace("torch.", ""),
                "crc32": crc32(tensor)}
        if is_expert_key(key) and tensor.dim() >= 3:
            layers = tensor.unsqueeze(0) if _ONE_LAYER.search(key) else tensor
            info["experts"] = [[crc32(layers[l, e]) for e in range(layers.shape[1])]
                               for l in range(layers.shape[0])]
        sums[key] = info
        if on_tensor is not None:
            on_tensor(len(sums))
    return sums


def slice_name(key: str, layer: int, expert: int) -> str:
    """How an error or a listing names one [layer, expert] slice of the expert tensor KEY."""
    return f"expert {expert}" if _ONE_LAYER.search(key) else f"layer {layer} expert {expert}"


def count_experts(sums: Dict[str, dict]) -> int:
    """Number of [layer, expert] slices over all expert tensors."""
    return sum(len(row) for info in sums.values() for row in info.get("experts", []))


def compare_checksums(expected: Dict[str, dict], actual: Dict[str, dict],
                      ignore_prefixes=()) -> List[str]:
    """Problems (naming the tensor, and the layer/expert for expert tensors) between two sets."""
    problems = []
    for key, want in expected.items():
        if any(key.startswith(prefix) for prefix in ignore_prefixes):
            continue
        got = actual.get(key)
        if got is None:
            problems.append(f"{key}: missing")
            continue
        if got["shape"] != want["shape"] or got["dtype"] != want["dtype"]:
            problems.append(f"{key}: {got['dtype']}{tuple(got['shape'])}, expected "
                            f"{want['dtype']}{tuple(want['shape'])} (truncated or reshaped)")
            continue
        if got["crc32"] != want["crc32"]:
            bad = [slice_name(key, l, e) for l, row in enumerate(want.get("experts", []))
                   for e, value in enumerate(row) if got["experts"][l][e] != value]
            problems.append(f"{key}: checksum differs" + (f" ({', '.join(bad[:6])})" if bad else ""))
    for key in actual:
        if key not in expected and not any(key.startswith(p) for p in ignore_prefixes):
            problems.append(f"{key}: unexpected extra tensor")
    return problems
