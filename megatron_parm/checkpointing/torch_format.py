"""--ckpt-format torch: Megatron-LM's per-rank checkpoint files, written and read as Megatron-LM
does, inside this project's atomic publishing (paths.publish).

    iter_N/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt   one per model-parallel rank (formats.py
                                                       names it): the model chunks' state_dict
                                                       ('model', or 'model0', 'model1', ...
                                                       with virtual stages), Megatron's
                                                       optimizer.state_dict(), and the common
                                                       part (iteration, schedule, RNG states,
                                                       flags, layout)
    iter_N/mp_rank_.../distrib_optim.pt                with --use-distributed-optimizer: its
                                                       parameter state, gathered on each
                                                       data-parallel group's first rank
                                                       (Megatron-Core's save_parameter_state)
    iter_N/parm_manifest.json                          the files the save wrote

    save_files(staged, common, model, optimizer, save_optim)  collective; -> the files written
    write_manifest(staged, files, extra), check_complete(path)
    read_info(path)                  the first rank's file, before a model exists
    load_files(path, model, optimizer, layout) -> the file's dict; collective

The ranks whose expert-data-parallel rank is 0 write (Megatron-LM's rule); every rank reads the
file of its tensor, pipeline and expert rank. A file holds one rank's shards, so a torch
checkpoint loads only at the layout (tp, pp, vpp, ep, etp) it was saved at, and a layout in
which two writers or a writer and a reader of one name hold different shards (tp=1 with etp=2,
say) is refused when saving. Files are read with safe_load's allow-list (weights only); the
flags are stored as plain values (Megatron-LM pickles its Namespace), so that they are.
"""

from __future__ import annotations

import json
import os
from typing import List

import torch

from megatron_parm.checkpointing.errors import CheckpointError, agree
from megatron_parm.checkpointing.formats import (
    MODEL_FILE, OPTIMIZER_FILE, TORCH, rank_dir_name, rank_zero_file)
from megatron_parm.checkpointing.optimizer_state import is_distributed, optimizer_parts, set_step
from megatron_parm.checkpointing.safe_load import load_torch_file
from megatron_parm.checkpointing.state import (
    BUCKET_LAYOUT, NO_PIPELINE, describe_model_parallel, model_chunks)

MANIFEST_FILE = "parm_manifest.json"
REFUSAL = "save with --ckpt-format torch_dist, which loads in any layout"


def parallel_ranks() -> dict:
    """This rank's place in the layout: what names its file and what its shards depend on."""
    from megatron.core import parallel_state as ps

    return {"tensor": ps.get_tensor_model_parallel_rank(),
            "pipeline": ps.get_pipeline_model_parallel_rank(),
            "expert": ps.get_expert_model_parallel_rank(),
            "expert_tensor": ps.get_expert_tensor_parallel_rank()}


def _rank_dir() -> str:
    from megatron.core import parallel_state as ps

    ranks = parallel_ranks()
    return rank_dir_name(ranks["tensor"], ranks["pipeline"], ranks["expert"],
                         ps.get_pipeline_model_parallel_world_size() > 1,
                         ps.get_expert_model_parallel_world_size() > 1)


def chunk_keys(num_chunks: int) -> List[str]:
    """Megatron-LM's keys of the model chunks in a torch file."""
    return ["model"] if num_chunks == 1 else [f"model{index}" for index in range(num_chunks)]


def _writers_problem(entries: list) -> str:
    """Why this layout cannot be saved in per-rank files ('' where it can): ENTRIES holds every
    rank's (folder name, ranks, writes)."""
    writer_of = {}
    for rank, (name, ranks, writes) in enumerate(entries):
        if writes and name in writer_of:
            return f"ranks {writer_of[name][0]} and {rank} would both write {name}"
        if writes:
            writer_of[name] = (rank, ranks)
    for rank, (name, ranks, _) in enumerate(entries):
        if name not in writer_of or writer_of[name][1] != ranks:
            return f"rank {rank} would read {name}, written by a rank with other shards"
    return ""


def check_writers() -> bool:
    """Whether this rank writes a file; CheckpointError on every rank where the layout cannot
    be saved in per-rank files (a run checks it before training). Collective."""
    from megatron.core import parallel_state as ps

    writes = ps.get_expert_data_parallel_rank() == 0
    entries = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(entries, (_rank_dir(), parallel_ranks(), writes))
    problem = _writers_problem(entries)
    if problem:
        raise CheckpointError(f"--ckpt-format torch: Megatron-LM's files are named by tensor, "
                              f"pipeline and expert rank, and in this layout {problem}: "
                              f"{REFUSAL}")
    return writes


def save_files(staged: str, common: dict, model, optimizer, save_optim: bool) -> List[str]:
    """Write this rank's files into STAGED (collective); returns every file written, relative
    to STAGED. COMMON: what every file holds besides the model and optimizer."""
    name, ranks, writes = _rank_dir(), parallel_ranks(), check_writers()
    folder = os.path.join(staged, name)
    os.makedirs(folder, exist_ok=True)
    written = []
    if writes:
        state = dict(common, ckpt_format=TORCH, ranks=ranks)
        chunks = model_chunks(model)
        for key, chunk in zip(chunk_keys(len(chunks)), chunks):
            state[key] = chunk.state_dict_for_save_checkpoint()
        if save_optim and optimizer is not None and common.get("optimizer_step") is not None:
            state["optimizer"] = optimizer.state_dict()
        torch.save(state, os.path.join(folder, MODEL_FILE))
        written.append(os.path.join(name, MODEL_FILE))
    if save_optim and optimizer is not None and is_distributed(optimizer) \
            and common.get("optimizer_step") is not None:
        optimizer.save_parameter_state(os.path.join(folder, OPTIMIZER_FILE))  # collective
        if os.path.isfile(os.path.join(folder, OPTIMIZER_FILE)):
            written.append(os.path.join(name, OPTIMIZER_FILE))
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, written)
    return sorted({path for files in every for path in files})


def write_manifest(staged: str, files: List[str], extra: dict) -> None:
    with open(os.path.join(staged, MANIFEST_FILE), "w") as f:
        json.dump({"format": "megatron-parm manifest", "ckpt_format": TORCH, "files": files,
                   **extra}, f, indent=1)


def check_complete(path: str) -> None:
    """Raise CheckpointError naming what a torch checkpoint folder lacks: the first rank's file,
    or a file its manifest lists."""
    if rank_zero_file(path) is None:
        raise CheckpointError(f"{path}: incomplete checkpoint, missing mp_rank_00*/{MODEL_FILE}")
    manifest = os.path.join(path, MANIFEST_FILE)
    if os.path.isfile(manifest):
        try:
            with open(manifest) as f:
                files = json.load(f)["files"]
        except (ValueError, KeyError) as err:
            raise CheckpointError(f"{manifest} is corrupted: {err}") from err
        lost = [name for name in files if not os.path.isfile(os.path.join(path, name))]
        if lost:
            raise CheckpointError(f"{path}: damaged checkpoint: missing {', '.join(lost[:8])}"
                                  + (f" and {len(lost) - 8} more" if len(lost) > 8 else ""))


def read_info(path: str) -> dict:
    """The first rank's file of the torch checkpoint PATH (plain data only)."""
    check_complete(path)
    return load_torch_file(rank_zero_file(path))


def _layout_problem(saved: dict, layout: dict) -> str:
    saved, current = {**NO_PIPELINE, **(saved or {})}, {**NO_PIPELINE, **layout}
    if any(saved.get(key) != current.get(key) for key in BUCKET_LAYOUT):
        return (f"it was saved at {describe_model_parallel(saved)}, this run has "
                f"{describe_model_parallel(current)}")
    return ""


def load_files(path: str, model, optimizer, layout: dict) -> dict:
    """Load this rank's file of PATH into the model chunks (and OPTIMIZER, unless None: its
    state_dict, and the distributed optimizer's parameter state); returns the file's dict.
    Every rank raises the first rank's CheckpointError alike. Collective."""
    name = _rank_dir()
    file = os.path.join(path, name, MODEL_FILE)
    state, problem = None, ""
    if not os.path.isfile(file):
        problem = f"{path}: no {name}/{MODEL_FILE} for this rank"
    else:
        state = load_torch_file(file)
        problem = _layout_problem(state.get("layout"), layout)
        if problem:
            problem = (f"--ckpt-format torch: {path} loads only at the layout it was saved at "
                       f"(tp, pp, vpp, ep and etp): {problem}; {REFUSAL}")
        elif state.get("ranks") not in (None, parallel_ranks()):
            problem = f"{file} holds the shards of ranks {state['ranks']}, not this rank's"
    problems = agree([problem] if problem else [])
    if problems:
        raise CheckpointError(problems[0])
    chunks = model_chunks(model)
    for key, chunk in zip(chunk_keys(len(chunks)), chunks):
        chunk.load_state_dict(state[key])
    if optimizer is not None and "optimizer" in state:
        with torch.no_grad():  # fp32 main parameters may be views of the model's
            optimizer.load_state_dict(state["optimizer"])
            if is_distributed(optimizer):
                _load_parameter_state(optimizer, os.path.join(path, name, OPTIMIZER_FILE),
                                      state["optimizer_step"])
    return state


def _load_parameter_state(optimizer, file: str, step) -> None:
    """Megatron-Core's load_parameter_state, around its copy of the parameters' 'step' from the
    file's tensors, which hold none (with torch's Adam, no Apex or TE, the step sits in each
    parameter's state): the step is set afterwards, as optimizer_state.load_distributed_state
    does."""
    for part in optimizer_parts(optimizer):
        for param_state in part.optimizer.state.values():
            param_state.pop("step", None)
    optimizer.load_parameter_state(file)
    set_step(optimizer, step)
