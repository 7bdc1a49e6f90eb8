"""Every rank's random-number state, so a resumed run draws the same numbers (dropout, ...).

    capture()          this rank's python / numpy / torch CPU (+ CUDA) / Megatron tracker states
    gather()           all ranks' capture(), in rank order (collective)
    restore(states)    this rank's entry back into every generator

The tracker is Megatron's tensor_parallel.random CUDA RNG tracker (on CPU, the tracker that
megatron_parm.mcore_compat puts in its place): the per-parallel-group states used for
model-parallel initialisation and dropout inside tensor-parallel regions.
"""

from __future__ import annotations

import random
from typing import List

import numpy
import torch

from megatron_parm import device


def capture() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "random": random.getstate(),
        "numpy": numpy.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": {name: value.clone() for name, value in get_cuda_rng_tracker().get_states().items()},
    }
    if device.is_cuda():
        state["cuda"] = device.get_rng_state()
    return state


def gather() -> List[dict]:
    states = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(states, capture())
    return states


def restore(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["random"])
    numpy.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        device.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states({name: value.clone() for name, value in state["tracker"].items()})
