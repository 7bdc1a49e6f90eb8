"""List a checkpoint folder: iterations, the layout each was saved in, tensors and sizes.

    python tools/inspect_checkpoint.py runs/x/checkpoints            # every iteration, latest's tensors
    python tools/inspect_checkpoint.py runs/x/checkpoints/iter_0000020 --verify   # + CRC32 of all
    diff <(python tools/inspect_checkpoint.py A --verify | grep crc32) \
         <(python tools/inspect_checkpoint.py B --verify | grep crc32)    # which tensors differ

Checks each published checkpoint is whole (files, chunk coverage, data file lengths) and
exits non-zero naming the tensor when one is not. --verify also reads every tensor and prints
its CRC32 (and one per [layer, expert] of the expert tensors).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_parm import cli  # noqa: E402
from megatron_parm.wording import plural  # noqa: E402

cli.setup_warnings()  # before Megatron-Core is imported

from megatron_parm.checkpointing.paths import (  # noqa: E402
    CheckpointError,
    is_checkpoint_dir,
    list_checkpoints,
    list_partial,
    read_tracker,
)


def human(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    return ""


def describe(path: str, show_tensors: bool, verify: bool) -> None:
    import torch

    from megatron_parm.checkpointing import read_checkpoint_info
    from megatron_parm.checkpointing.verify import read_metadata, tensor_entries, is_expert_key

    info = read_checkpoint_info(path)  # checks the folder is whole
    layout = info.get("layout") or {}
    args = info.get("args") or {}
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    print(f"{path}: iteration {info.get('iteration')}, consumed samples "
          f"{info.get('consumed_samples')}, {human(size)} on disk")
    pp, vpp = layout.get("pipeline_model_parallel_size") or 1, layout.get(
        "virtual_pipeline_model_parallel_size")
    stages = (f" pp={pp}" + (f" vpp={vpp}" if vpp else "")) if pp > 1 else ""
    print(f"  saved on {plural(layout.get('world_size'), 'rank')}: tp={layout.get('tensor_model_parallel_size')} "
          f"ep={layout.get('expert_model_parallel_size')} etp={layout.get('expert_tensor_parallel_size')}"
          f"{stages}; "
          f"model {args.get('model_type')} layers={args.get('num_layers')} hidden={args.get('hidden_size')} "
          f"experts={args.get('num_experts')} top-k={args.get('moe_router_topk')}; padded vocabulary "
          f"{(info.get('model_info') or {}).get('padded_vocab_size')}")
    sharding = (info.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    print(f"  optimizer state: {'yes' if 'optimizer_step' in info else 'no'}"
          + (f" (distributed optimizer: {sharding})" if sharding else "") + "; LR schedule: "
          f"{'yes' if 'opt_param_scheduler' in info else 'no'}; RNG states: "
          f"{plural(len(info['rng_state']['per_rank']) if 'rng_state' in info else 0, 'rank')}"
          + (f"; upcycled from a dense checkpoint ({info['upcycled_from']})" if "upcycled_from" in info else ""))
    entries = tensor_entries(read_metadata(path))
    total = sum(e.size.numel() * torch.empty(0, dtype=e.properties.dtype).element_size()
                for e in entries.values())
    experts = [k for k in entries if is_expert_key(k)]
    print(f"  {len(entries)} tensors ({len(experts)} expert tensors), {human(total)}")
    if show_tensors:
        for key, entry in sorted(entries.items()):
            dtype = str(entry.properties.dtype).replace("torch.", "")
            print(f"    {key:90s} {dtype:9s} {str(tuple(entry.size)):24s} {plural(len(entry.chunks), 'chunk'):>10}")
    if verify:
        from megatron_parm.checkpointing.full import read_full
        from megatron_parm.checkpointing.verify import count_experts, tensor_checksums

        sums = tensor_checksums(read_full(path).tensors)
        print(f"  read every tensor: {len(sums)} tensors, {count_experts(sums)} [layer, expert] "
              f"slices; CRC32 of each (diff these lines between two checkpoints):")
        for line in checksum_lines(sums):
            print(f"    {line}")


def checksum_lines(sums):
    """'crc32 1a2b3c4d key dtype(shape)' per tensor, then one line per [layer, expert] slice
    of expert tensors ('crc32 ... key[layer 0, expert 1]'), sorted by key: no path, no size on
    disk, so that two checkpoints of the same model can be compared with diff."""
    for key in sorted(sums):
        info = sums[key]
        yield f"crc32 {info['crc32']:08x} {key} {info['dtype']}{tuple(info['shape'])}"
        for layer, row in enumerate(info.get("experts", [])):
            for expert, value in enumerate(row):
                yield f"crc32 {value:08x} {key}[layer {layer}, expert {expert}]"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="A checkpoint root or one iter_NNNNNNN folder.")
    parser.add_argument("--verify", action="store_true", help="Also read every tensor (CRC32).")
    parser.add_argument("--no-tensors", action="store_true", help="Do not list the tensors.")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.path):
        raise CheckpointError(f"{args.path}: no such directory")
    if is_checkpoint_dir(args.path):
        describe(args.path, not args.no_tensors, args.verify)
        return 0
    tracked = read_tracker(args.path)
    found = list_checkpoints(args.path)
    print(f"{args.path}: {plural(len(found), 'checkpoint')}, tracker -> "
          f"{tracked if tracked is not None else '(none)'}"
          + (f"; unfinished saves: {', '.join(list_partial(args.path))}" if list_partial(args.path) else ""))
    if not found:
        raise CheckpointError(f"{args.path}: no iter_NNNNNNN checkpoint folders")
    for index, (_, path) in enumerate(found):
        last = index == len(found) - 1
        describe(path, show_tensors=last and not args.no_tensors, verify=args.verify)
    return 0


if __name__ == "__main__":
    cli.run(main)
