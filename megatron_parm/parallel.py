"""Parallel layout: checks with flag-named errors, and Megatron's process groups.

A layout is (t, e, s) = (--tensor-model-parallel-size, --expert-model-parallel-size,
--expert-tensor-parallel-size) on a world of W ranks, split into p pipeline stages
(--pipeline-model-parallel-size; context parallelism 1). Megatron lays attention ranks out
as [pp][dp][tp] and expert ranks as [pp][edp][ep][etp], TP and ETP innermost, so TP/ETP
groups are consecutive ranks (inside a node), EP groups stride across nodes, and every
group but the pipeline's and the embedding's stays inside one stage's W / p ranks.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_parm import schedules
from megatron_parm.layout_rules import layout_problem


def validate_layout(world_size: int, tp: int, ep: int, etp: Optional[int], num_experts: Optional[int] = None,
                    dispatcher: Optional[str] = None, sequence_parallel: bool = True,
                    pp: int = 1) -> None:
    """Raise ValueError naming the flag for any layout Megatron or a dispatcher cannot run.

    The rules are layout_rules.layout_problem's; the dispatcher's own are its schedule catalog
    entry's (megatron_parm/schedules.py).
    """
    etp = tp if etp is None else etp
    problem = layout_problem(world_size, tp, ep, etp, num_experts, pp)
    if problem:
        raise ValueError(problem)
    if dispatcher is not None:
        schedules.get(dispatcher).check_layout(tp, ep, etp, sequence_parallel)


def initialize_model_parallel(tp: int = 1, ep: int = 1, etp: Optional[int] = None,
                              num_experts: Optional[int] = None, dispatcher: Optional[str] = None,
                              pp: int = 1, vpp: Optional[int] = None) -> None:
    """Check the layout, then build Megatron's process groups (torch.distributed must be up)."""
    from megatron.core import parallel_state

    validate_layout(torch.distributed.get_world_size(), tp, ep, etp, num_experts, dispatcher,
                    pp=pp)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp if etp is None else etp,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp)

def stage_group():
    """The ranks of this rank's pipeline stage (its tensor x data x context-parallel ranks: the
    ranks that run the same layers at the same time), for collectives a layer makes on its own
    (parm's agreement and tuning); None, the whole world, without pipelining. A collective over
    the world inside a layer would wait for the other stages, which wait for this one's
    activations."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized() \
            or parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
