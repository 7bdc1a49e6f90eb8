"""What each dispatcher communicates and computes, per rank, for one forward + backward.

The stages come from each schedule's cost plan in the catalog (megatron_parm/schedules.py;
docs/design.md derives them); this module places them on a layout.

Byte convention: bytes *sent by one rank*, per peer, direct algorithm, split by whether the
peer is on the same node ("intra") or not ("inter"):
    A2A over g ranks: rows for each other peer * row bytes
    AG over g ranks:  my whole chunk to each of the g-1 peers
    RS over g ranks:  chunk j to peer j (g-1 chunks)
    AR over g ranks:  RS + AG = 2 * size / g to each peer, 2 * (g-1)/g * size in all
Backward duals: A2A -> A2A, AG -> RS, RS -> AG, AR -> AR. A group of one rank costs nothing.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from megatron_parm import schedules
from megatron_parm.perf_model.layout import Layout
from megatron_parm.perf_model.shape import LayerShape
from megatron_parm.schedules import COLLECTIVE_KINDS, COMPUTE


def modelled_dispatchers() -> Tuple[str, ...]:
    """The schedules the model can predict: those whose catalog entry has a cost plan."""
    return tuple(name for name in schedules.names() if schedules.get(name).cost_plan is not None)


@dataclass(frozen=True)
class Step:
    """One stage of a dispatcher's dataflow on one rank (whole layer, not per chunk)."""

    direction: str  # "forward" or "backward"
    name: str
    kind: str  # one of COLLECTIVE_KINDS, or "compute"
    group: Optional[str]  # a layout.GROUP_NAMES name ("tp", "ep", ...); None for compute
    intra_bytes: float = 0.0
    inter_bytes: float = 0.0
    intra_peers: int = 0
    inter_peers: int = 0
    flops: float = 0.0


def place_stage(stage: schedules.Stage, layout: Layout) -> List[Step]:
    """A catalog stage on this layout: its bytes split by peer location; none on a group of one."""
    if stage.kind == COMPUTE:
        return [Step(stage.direction, stage.name, COMPUTE, None, flops=stage.flops)]
    if stage.kind not in COLLECTIVE_KINDS:
        raise ValueError(f"stage {stage.name!r}: unknown kind {stage.kind!r}")
    if layout.group_size(stage.group) == 1:
        return []
    intra_peers, inter_peers = layout.peer_counts(stage.group)
    return [Step(stage.direction, stage.name, stage.kind, stage.group,
                 intra_bytes=intra_peers * stage.bytes_per_peer,
                 inter_bytes=inter_peers * stage.bytes_per_peer,
                 intra_peers=intra_peers, inter_peers=inter_peers)]


def build_plan(dispatcher: str, shape: LayerShape, layout: Layout,
               sequence_parallel: bool = True) -> Tuple[Step, ...]:
    """The ordered stages of `dispatcher` (its catalog cost plan): forward, then backward."""
    if dispatcher not in modelled_dispatchers():
        raise ValueError(f"unknown dispatcher {dispatcher!r}; expected one of "
                         f"{modelled_dispatchers()}")
    if shape.num_experts % layout.ep != 0:
        raise ValueError(
            f"LayerShape.num_experts={shape.num_experts} is not divisible by Layout.ep={layout.ep}"
        )
    plan = schedules.get(dispatcher).cost_plan(shape, layout, sequence_parallel)
    return tuple(step for stage in plan for step in place_stage(stage, layout))


def comm_volumes(dispatcher: str, shape: LayerShape, layout: Layout,
                 sequence_parallel: bool = True) -> Dict[Tuple[str, str], Dict[str, float]]:
    """Bytes one rank sends in one forward + backward of the layer.

    Returns {(collective_kind, group_name): {"intra": bytes, "inter": bytes}}, where
    group_name is one of layout.GROUP_NAMES ("tp", "ep", "expt_tp", ...). Probabilities are
    included (LayerShape.prob_bytes per row on the dispatch path; allgather gathers all E of a
    token's); set prob_bytes=0 to count activations only.
    The numbers are those of the worst rank (most inter-node peers) of each group kind.
    """
    volumes: Dict[Tuple[str, str], Dict[str, float]] = {}
    for step in build_plan(dispatcher, shape, layout, sequence_parallel):
        if step.kind == "compute":
            continue
        entry = volumes.setdefault((step.kind, step.group), {"intra": 0.0, "inter": 0.0})
        entry["intra"] += step.intra_bytes
        entry["inter"] += step.inter_bytes
    return volumes
