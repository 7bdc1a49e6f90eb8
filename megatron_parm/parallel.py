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
from megatron_parm.layout_rules import layout_problem


def validate_layout(world_size: int, tp: int, ep: int, etp: Optional[int], num_experts: Optional[int] = None,
                    dispatcher: Optional[str] = None, sequence_parallel: bool = True) -> None:
    """Raise ValueError naming the flag for any layout Megatron or a dispatcher cannot run.

    The rules are layout_rules.layout_problem's; the dispatcher's own are its schedule catalog
    entry's (megatron_parm/schedules.py).
    """
    etp = tp if etp is None else etp
    problem = layout_problem(world_size, tp, ep, etp, num_experts)
    if problem:
        raise ValueError(problem)
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
