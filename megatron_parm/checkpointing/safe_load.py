"""Reading checkpoint files a user passes in without running code from them.

A pickle can call any Python function while it loads. Every pickle a checkpoint holds is read
here with an allow-list, and anything else is refused with CheckpointError naming the file:

    load_torch_file(path, what)     common.pt, single files: torch.load(weights_only=True) with
                                    numpy arrays allowed (Megatron's RNG states hold them)
    load_object_bytes(data, where)  one of Megatron's ShardedObjects (a layer's _extra_state),
                                    stored as a small torch.save pickle inside the .distcp files
    load_dcp_metadata(path)         torch DCP's index (.metadata): a plain pickle of DCP's own
                                    metadata classes, read with an unpickler that knows only them
    load_safely(state, path)        torch DCP's load in this process with the reads above
    read_sharded_objects(path, metadata)   every ShardedObject of a checkpoint, read safely

Megatron-Core's dist_checkpointing.load, which the trainer uses, reads the same files with
torch DCP's unrestricted pickle.load (.metadata) and torch.load(weights_only=False) (the
objects): load_checkpoint calls it only after every one of those files has been read here.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any, Dict

import numpy
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from megatron_parm.checkpointing.errors import CheckpointError

# numpy's random state (numpy.random.get_state()) is an uint32 array: what torch.load needs to
# rebuild one (numpy 2 names the module numpy._core; numpy 1 numpy.core). Allowed for every
# weights-only load of this process, Megatron-Core's own included (torch.serialization's
# safe_globals() context would drop, on exit, what Megatron-Core registered at import).
_NUMPY_ARRAY_GLOBALS = [getattr(numpy, "_core", numpy.core).multiarray._reconstruct,
                        numpy.ndarray, numpy.dtype, type(numpy.dtype(numpy.uint32))]
torch.serialization.add_safe_globals(_NUMPY_ARRAY_GLOBALS)

# What torch DCP 2.x writes into .metadata: (module, name).
_DCP_METADATA_CLASSES = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    *(("torch.distributed.checkpoint.planner", name) for name in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem",
        "LoadItemType")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    # the saving ranks' plans, which Megatron-Core keeps in .metadata once a save reuses the
    # cached structure (--ckpt-assume-constant-structure): each names its files' prefix
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
}

REFUSED = ("refused: it holds {what}, not plain checkpoint data (tensors, numbers, strings, "
           "containers, numpy arrays); loading it could run code. Checkpoints written by this "
           "project or Megatron-LM load without it; see docs/checkpoints.md")


def load_torch_file(path: str, what: str = "") -> Any:
    """torch.load(PATH) of plain data only; CheckpointError naming PATH otherwise."""
    name = f"{what} {path}".strip()
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as err:
        raise CheckpointError(f"{name}: no such file") from err
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{name}: {REFUSED.format(what=_unsupported(err))}") from None
    except Exception as err:  # noqa: BLE001 - truncated, not a torch file, ...
        raise CheckpointError(f"{name} cannot be read ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''})") from err


def load_object_bytes(data: bytes, where: str) -> Any:
    """One ShardedObject's pickle (bytes from a .distcp file), plain data only."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{where}: {REFUSED.format(what=_unsupported(err))}") from None
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(f"{where} cannot be read ({type(err).__name__}: {err})") from err


def _unsupported(err: Exception) -> str:
    """'a reference to posix.system' from torch's weights-only error message."""
    match = re.search(r"(?:GLOBAL|global) ([\w.]+)", str(err))
    return f"a reference to {match.group(1)}" if match else "Python objects"


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in _DCP_METADATA_CLASSES or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"{self.path}: {REFUSED.format(what=f'a reference to {module}.{name}')}")

    def persistent_load(self, pid):
        raise CheckpointError(f"{self.path}: refused: persistent references are not metadata")


def load_dcp_metadata(path: str):
    """torch DCP's Metadata from the .metadata file PATH, unpickling only DCP's own classes."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - truncated or garbled
        raise CheckpointError(f"{path} is corrupted ({type(err).__name__}: {err})") from err
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not torch DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """torch DCP's FileSystemReader, reading .metadata with load_dcp_metadata."""

    def read_metadata(self, *args, **kwargs):
        metadata = load_dcp_metadata(str(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeObjectsPlanner(DefaultLoadPlanner):
    """torch DCP's load planner, unpickling byte entries (ShardedObjects) with
    load_object_bytes instead of torch.load(weights_only=False). A refused object is kept in
    `refused` (DCP would wrap an exception raised here in its own); see load_safely."""

    def __init__(self, checkpoint: str):
        super().__init__()
        self.checkpoint = checkpoint
        self.refused = []

    def load_bytes(self, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = load_object_bytes(value.read(), f"{self.checkpoint}: object {fqn}")
        except CheckpointError as err:
            self.refused.append(err)
            loaded = None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def load_safely(state: dict, path: str) -> None:
    """torch DCP's load of STATE (tensors and io.BytesIO() entries for objects) from the
    checkpoint folder PATH in this process, every pickle read with the allow-lists above."""
    planner = SafeObjectsPlanner(path)
    dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=planner, no_dist=True)
    if planner.refused:
        raise planner.refused[0]


def read_sharded_objects(path: str, metadata) -> Dict[str, Any]:
    """Every ShardedObject of the torch_dist checkpoint PATH, each read with load_object_bytes."""
    objects = {key: io.BytesIO() for key, entry in metadata.state_dict_metadata.items()
               if isinstance(entry, BytesStorageMetadata)}
    if objects:
        load_safely(objects, path)
    return objects
