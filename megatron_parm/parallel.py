"""Parallel layout: checks with flag-named errors, and Megatron's process groups.

A layout is (t, e, s) = (--tensor-model-parallel-size, --expert-model-parallel-size,
--expert-tensor-parallel-size) on a world of W ranks, split into p pipeline stages
(--pipeline-model-parallel-size), each sequence over c context-parallel ranks
(--context-parallel-size). Megatron lays attention ranks out as [pp][dp][cp][tp] and expert
ranks as [pp][edp][ep][etp], TP and ETP innermost, so TP/ETP groups are consecutive ranks
(inside a node), EP groups stride across nodes (over the CP ranks too), and every group but
the pipeline's and the embedding's stays inside one stage's W / p ranks.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from datetime import timedelta
from typing import List, Optional

import torch

from megatron_parm import schedules
from megatron_parm.comm.accounting import ranks_per_node as node_rule
from megatron_parm.layout_rules import RANK_ORDERS, layout_problem, rank_order_problem
from megatron_parm.perf_model.layout import ep_node_blocks, node_split_problem

# --distributed-timeout-minutes (Megatron-LM's default): a collective that waits longer (a peer
# hung, or its node died without closing its connections) fails, and the job ends.
from megatron_parm.settings import DEFAULT_TIMEOUT_MINUTES  # noqa: E402
_timeout = timedelta(minutes=DEFAULT_TIMEOUT_MINUTES)


def group_timeout() -> timedelta:
    """The timeout of every process group of the job (the default group's, Megatron's, and
    those the dispatchers make, e.g. parm_hier's): --distributed-timeout-minutes."""
    return _timeout


def set_group_timeout(minutes: float) -> timedelta:
    global _timeout
    _timeout = timedelta(minutes=minutes)
    return _timeout


def update_group_timeout(seconds: float) -> timedelta:
    """Every process group this rank is in, and those made from now on, time out after SECONDS
    (--distributed-timeout-seconds-after-init, as Megatron-LM's update_pg_timeout: after a
    barrier, so that no collective is in flight). Collective over every rank."""
    from torch.distributed import distributed_c10d

    global _timeout
    torch.distributed.barrier()
    _timeout = timedelta(seconds=seconds)
    for group in list(distributed_c10d._world.pg_map):
        distributed_c10d._set_pg_timeout(_timeout, group)
    return _timeout


def validate_layout(world_size: int, tp: int, ep: int, etp: Optional[int], num_experts: Optional[int] = None,
                    dispatcher: Optional[str] = None, sequence_parallel: bool = True,
                    pp: int = 1, cp: int = 1, tp_pp_dp: bool = False) -> None:
    """Raise ValueError naming the flag for any layout Megatron or a dispatcher cannot run.

    The rules are layout_rules.layout_problem's and, in the rank order tp_pp_dp
    (--use-tp-pp-dp-mapping) names, its rank_order_problem's; the dispatcher's own are its
    schedule catalog entry's (megatron_parm/schedules.py).
    """
    etp = tp if etp is None else etp
    problem = (layout_problem(world_size, tp, ep, etp, num_experts, pp, cp)
               or rank_order_problem(tp_pp_dp, tp, cp, ep, etp, pp))
    if problem:
        raise ValueError(problem)
    if dispatcher is not None:
        schedules.get(dispatcher).check_layout(tp, ep, etp, sequence_parallel)


def initialize_model_parallel(tp: int = 1, ep: int = 1, etp: Optional[int] = None,
                              num_experts: Optional[int] = None, dispatcher: Optional[str] = None,
                              timeout_minutes: Optional[float] = None, pp: int = 1,
                              vpp: Optional[int] = None,
                              ranks_per_node: Optional[int] = None,
                              num_distributed_optimizer_instances: int = 1,
                              get_embedding_ranks=None, cp: int = 1,
                              tp_pp_dp: bool = False) -> None:
    """Check the layout, then build Megatron's process groups (torch.distributed must be up),
    each with group_timeout() (timeout_minutes sets it first), destroying the groups the
    previous call made.

    A convenience for the project's tools, not a requirement: Parm's dispatchers build and
    run after Megatron-Core's own parallel_state.initialize_model_parallel alone (parm_hier
    makes its node groups when its first layer is built: node_groups). ranks_per_node
    (--parm-ranks-per-node, None for the launcher's) is checked here against the layout;
    num_distributed_optimizer_instances: Megatron-LM's flag (its partial data-parallel
    groups); get_embedding_ranks: the ranks of a pipeline group that hold the word embeddings
    (Megatron-Core's argument; None: its default, the first and last); cp:
    --context-parallel-size (Megatron-Core's CP, TP x CP and DP x CP groups, and its expert
    groups over the TP x CP x DP ranks); tp_pp_dp: --use-tp-pp-dp-mapping (Megatron-Core's
    rank order with the data-parallel groups outermost, layout_rules.RANK_ORDERS)."""
    from megatron.core import parallel_state
    from torch.distributed import distributed_c10d

    validate_layout(torch.distributed.get_world_size(), tp, ep, etp, num_experts, dispatcher,
                    pp=pp, cp=cp, tp_pp_dp=tp_pp_dp)
    if timeout_minutes is not None:
        set_group_timeout(timeout_minutes)
    if ranks_per_node is not None:
        node_rule(torch.distributed.get_world_size(), ranks_per_node)  # must divide the world
    parallel_state.destroy_model_parallel()
    _destroy_groups_made()
    before = set(distributed_c10d._world.pg_map)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp if etp is None else etp,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        get_embedding_ranks=get_embedding_ranks, order=RANK_ORDERS[tp_pp_dp],
        distributed_timeout_minutes=group_timeout().total_seconds() / 60)
    _groups_made[:] = [group for group in distributed_c10d._world.pg_map if group not in before]
    # Megatron-Core 0.16.1 makes its expert-data-parallel gloo group without the timeout it
    # is given (torch's default, 30 min), and the tools create the default group with torch's
    # default: set it on every group this rank is in.
    for group in list(distributed_c10d._world.pg_map):
        distributed_c10d._set_pg_timeout(group_timeout(), group)


# The groups the last initialize_model_parallel made. Megatron-Core 0.16.1's
# destroy_model_parallel only forgets its groups: they stay registered with torch.distributed,
# and under gloo each keeps its own I/O threads. A tool that changes layout (the benchmark's
# grid, calibration, the test workers) made hundreds of them, whose threads took a core's worth
# of CPU on the emulated cluster; so a new layout destroys the previous one's groups first.
_groups_made: list = []
# The groups a layer makes for itself (parm_hier's node groups, twin_group's), by their ranks,
# made when a layer first needs them and kept: only their members make them
# (use_local_synchronization), so torch names them by a hash of the ranks, and a group made
# again under the same name would meet its destroyed predecessor's addresses in the store.
# They are made after the layout's groups, so a new layout does not destroy them, and a
# layout met again reuses them.
_local_groups: dict = {}


def _local_group(ranks):
    """The group of RANKS this module made (by its members only), made now if need be."""
    from torch.distributed import distributed_c10d

    made = _local_groups.get(tuple(ranks))
    if made is None or made not in distributed_c10d._world.pg_map:  # none in this world
        _local_groups[tuple(ranks)] = torch.distributed.new_group(
            list(ranks), use_local_synchronization=True, timeout=group_timeout())
    return _local_groups[tuple(ranks)]


def twin_group(group):
    """A group of GROUP's ranks besides GROUP itself (made by its members the first time a
    layer asks, then kept; shared with any other group this module made of those ranks): for
    collectives issued from another thread than GROUP's own, which must not interleave with
    them (the combined 1F1B's communication thread on the CPU)."""
    return _local_group(torch.distributed.get_process_group_ranks(group))


def _destroy_groups_made() -> None:
    from torch.distributed import distributed_c10d

    if _groups_made:  # every rank is done with them before any rank closes its connections
        torch.distributed.barrier()
    for group in _groups_made:
        if group in distributed_c10d._world.pg_map:
            torch.distributed.destroy_process_group(group)
    _groups_made.clear()
    # A group's threads end when its last reference goes: a finished run's model holds them
    # in reference cycles (modules and their hooks) until the collector breaks those.
    gc.collect()


@dataclass(frozen=True)
class NodeGroups:
    """This rank's place in its EP group split by node, and the two groups of the split."""

    inter: object  # "ep_inter": the EP ranks at this rank's position of every node (K)
    intra: object  # "ep_intra": the EP ranks of this rank's node (g)
    nodes: int  # K
    per_node: int  # g
    node: int  # b
    position: int  # a
    ranks_per_node: int = 0  # of the world, as the split was made with
    ep_ranks: tuple = ()  # the EP group that was split


def node_groups(ep_group, tp_ep_group, etp_rank: int, etp_size: int,
                setting: Optional[int] = None) -> NodeGroups:
    """This rank's EP group split by node ("ep_inter", "ep_intra"), cut from a layer's own EP
    and expert TP x EP groups (Megatron's, however they were made); ranks per node: SETTING
    (--parm-ranks-per-node) or the launcher's.

    The groups are made the first time a layer of this layout asks, by the members of each
    group only (use_local_synchronization): every rank building its layers is enough, and
    every rank makes its intra-node group before its inter-node group (each rank belongs to
    one of each, so no member waits on a rank that waits on another group first). A split
    equal to the EP group is the EP group itself. Raises ValueError naming
    --parm-ranks-per-node where the EP groups do not split evenly by node."""
    dist = torch.distributed
    per_node_ranks = node_rule(dist.get_world_size(), setting)
    ep_ranks = dist.get_process_group_ranks(ep_group)
    tp_ep_ranks = dist.get_process_group_ranks(tp_ep_group)
    if list(tp_ep_ranks[etp_rank::etp_size]) != list(ep_ranks):
        raise RuntimeError(f"parm_hier: the expert TP x EP group {tp_ep_ranks} is not ordered "
                           f"EP-major, ESP-minor around this rank's EP group {ep_ranks}")
    problem = node_split_problem(tp_ep_ranks, etp_size, per_node_ranks)
    if problem:
        raise ValueError(f"--parm-ranks-per-node {per_node_ranks}: {problem}")
    blocks = ep_node_blocks(tp_ep_ranks, etp_size, per_node_ranks)[etp_rank]
    me = dist.get_rank()
    node = next(b for b, members in enumerate(blocks) if me in members)
    position = blocks[node].index(me)

    def group(ranks: List[int]):
        return ep_group if list(ranks) == list(ep_ranks) else _local_group(ranks)

    intra = group(blocks[node])
    inter = group([members[position] for members in blocks])
    return NodeGroups(inter, intra, nodes=len(blocks), per_node=len(blocks[node]), node=node,
                      position=position, ranks_per_node=per_node_ranks, ep_ranks=tuple(ep_ranks))


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
