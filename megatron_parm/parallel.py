"""Parallel layout: checks with flag-named errors, and Megatron's process groups.

A layout is (t, e, s) = (--tensor-model-parallel-size, --expert-model-parallel-size,
--expert-tensor-parallel-size) on a world of W ranks (pipeline and context parallelism 1).
Megatron lays attention ranks out as [dp][tp] and expert ranks as [edp][ep][etp], TP and
ETP innermost, so TP/ETP groups are consecutive ranks (inside a node) and EP groups
stride across nodes.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_parm import schedules


def validate_layout(world_size: int, tp: int, ep: int, etp: Optional[int], num_experts: Optional[int] = None,
                    dispatcher: Optional[str] = None, sequence_parallel: bool = True) -> None:
    """Raise ValueError naming the flag for any layout Megatron or a dispatcher cannot run.

    The dispatcher's own rules are its schedule catalog entry's (megatron_parm/schedules.py).
    """
    etp = tp if etp is None else etp
    for flag, value in (("--tensor-model-parallel-size", tp), ("--expert-model-parallel-size", ep),
                        ("--expert-tensor-parallel-size", etp)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if world_size % tp != 0:
        raise ValueError(f"--tensor-model-parallel-size ({tp}) must divide the world size ({world_size})")
    if world_size % etp != 0:
        raise ValueError(f"--expert-tensor-parallel-size ({etp}) must divide the world size ({world_size})")
    if world_size % (etp * ep) != 0:
        raise ValueError(
            f"--expert-tensor-parallel-size x --expert-model-parallel-size ({etp} x {ep}) must divide "
            f"the world size ({world_size})")
    if num_experts is not None and num_experts % ep != 0:
        raise ValueError(f"--num-experts ({num_experts}) must be divisible by "
                         f"--expert-model-parallel-size ({ep})")
    if dispatcher is not None:
        schedules.get(dispatcher).check_layout(tp, ep, etp, sequence_parallel)


def initialize_model_parallel(tp: int = 1, ep: int = 1, etp: Optional[int] = None,
                              num_experts: Optional[int] = None, dispatcher: Optional[str] = None) -> None:
    """Check the layout, then build Megatron's process groups (torch.distributed must be up)."""
    from megatron.core import parallel_state

    validate_layout(torch.distributed.get_world_size(), tp, ep, etp, num_experts, dispatcher)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp if etp is None else etp)
