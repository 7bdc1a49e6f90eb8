"""Hugging Face model directories on disk: config.json and safetensors weights, read and written
by this module alone (no `safetensors`, `transformers` or network needed).

    read_config(path)                    config.json as a dict
    read_weights(path)                   {name: tensor} of model.safetensors, of every shard a
                                         model.safetensors.index.json names, or of
                                         pytorch_model.bin
    read_safetensors(file)               {name: tensor} of one .safetensors file
    write_weights(path, tensors, max_shard_bytes)
                                         model.safetensors, or model-0000i-of-0000n.safetensors
                                         shards and their index
    parse_size("5GB")                    bytes (Hugging Face's max_shard_size spelling)

A .safetensors file: 8 bytes little-endian header length, a JSON header {name: {dtype, shape,
data_offsets: [begin, end]}} (padded with spaces to a multiple of 8), then the raw
little-endian data of each tensor in header order.
"""

from __future__ import annotations

import json
import os
import re
import struct
from typing import Dict

import torch

from megatron_parm.checkpointing.errors import CheckpointError
from megatron_parm.checkpointing.safe_load import load_torch_file

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_FILE = "pytorch_model.bin"
WEIGHT_FILES = (SAFETENSORS_FILE, SAFETENSORS_INDEX, TORCH_FILE)
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def has_weights(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        os.path.isfile(os.path.join(path, name)) for name in WEIGHT_FILES)


def read_config(path: str) -> dict:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise CheckpointError(f"{path}: no config.json (not a Hugging Face model directory)")
    try:
        with open(config_path) as handle:
            return json.load(handle)
    except ValueError as err:
        raise CheckpointError(f"{config_path}: not valid JSON ({err})") from err


def read_safetensors(file_path: str) -> Dict[str, torch.Tensor]:
    with open(file_path, "rb") as handle:
        blob = handle.read()
    try:
        (header_len,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8:8 + header_len])
    except (struct.error, ValueError) as err:
        raise CheckpointError(f"{file_path}: not a safetensors file ({err})") from err
    data = memoryview(blob)[8 + header_len:]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{file_path}: {name} has unsupported dtype {info['dtype']}")
        if end > len(data):
            raise CheckpointError(f"{file_path}: {name} lies past the end of the file "
                                  f"(truncated?)")
        flat = torch.frombuffer(bytearray(data[begin:end]), dtype=dtype) if end > begin \
            else torch.empty(0, dtype=dtype)
        tensors[name] = flat.reshape(info["shape"])
    return tensors


def read_weights(path: str) -> Dict[str, torch.Tensor]:
    """Every weight of the directory PATH; a shard the index names must exist and hold the
    tensors the index puts in it."""
    index_path = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as handle:
                weight_map = json.load(handle)["weight_map"]
        except (ValueError, KeyError) as err:
            raise CheckpointError(f"{index_path}: not a safetensors index ({err})") from err
        tensors = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = os.path.join(path, shard)
            if not os.path.isfile(shard_path):
                raise CheckpointError(f"{shard_path}: missing (named by {SAFETENSORS_INDEX})")
            tensors.update(read_safetensors(shard_path))
        absent = [name for name in weight_map if name not in tensors]
        if absent:
            raise CheckpointError(f"{os.path.join(path, weight_map[absent[0]])}: lacks "
                                  f"{absent[0]} (the index puts it there)")
        return tensors
    if os.path.isfile(os.path.join(path, SAFETENSORS_FILE)):
        return read_safetensors(os.path.join(path, SAFETENSORS_FILE))
    if os.path.isfile(os.path.join(path, TORCH_FILE)):
        return load_torch_file(os.path.join(path, TORCH_FILE))  # plain data only
    raise CheckpointError(f"{path}: no {', '.join(WEIGHT_FILES)}")


def _write_safetensors(file_path: str, tensors: Dict[str, torch.Tensor]) -> None:
    header, offset = {}, 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(file_path + ".tmp", "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for tensor in tensors.values():
            handle.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    os.replace(file_path + ".tmp", file_path)


def write_weights(path: str, tensors: Dict[str, torch.Tensor], max_shard_bytes: int) -> list:
    """Write TENSORS (in their order) into PATH in shards of at most MAX_SHARD_BYTES (a tensor
    larger than that gets a shard of its own); returns the files written."""
    shards, current, size = [], {}, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name], size = tensor, size + nbytes
    shards.append(current)
    if len(shards) == 1:
        _write_safetensors(os.path.join(path, SAFETENSORS_FILE), shards[0])
        return [SAFETENSORS_FILE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        _write_safetensors(os.path.join(path, name), shard)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total},
             "weight_map": {key: name for name, shard in zip(names, shards) for key in shard}}
    with open(os.path.join(path, SAFETENSORS_INDEX), "w") as handle:
        json.dump(index, handle, indent=2)
    return names + [SAFETENSORS_INDEX]


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


def parse_size(text: str) -> int:
    """Bytes of a size as Hugging Face's save_pretrained spells max_shard_size ('5GB')."""
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"--max-shard-size: {text!r} is not a size such as 5GB or 500MB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])
