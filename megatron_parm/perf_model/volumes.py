"""What each dispatcher communicates and computes, per rank, for one forward + backward.

Notation (see shape.py and layout.py): n, N = t*n, M, H, E, k, b; t = tp, e = ep, s = etp.
    r   rows this rank sends to each expert (uniform routing, see LayerShape.rows_per_expert)
    R   rows a rank receives for its E/e local experts from its whole EP group = E * r
    row = M * b bytes; row_p = row + prob_bytes (the routing probability travels with the
          token on the dispatch path, and its gradient on the way back)

Byte convention: bytes *sent by one rank*, per peer, direct algorithm, split by whether the
peer is on the same node ("intra") or not ("inter"):
    A2A over g ranks: rows for each other peer * row bytes
    AG over g ranks:  my whole chunk to each of the g-1 peers
    RS over g ranks:  chunk j to peer j (g-1 chunks)
    AR over g ranks:  RS + AG = 2 * size / g to each peer, 2 * (g-1)/g * size in all
Backward duals: A2A -> A2A, AG -> RS, RS -> AG, AR -> AR. A group of one rank costs nothing.

Dataflows (forward; the backward runs the duals in reverse order):
    ds_baseline  [AG(TP) of the n*M input, SP only] -> A2A(EP) of k*N rows -> experts on R rows,
                 fc1 column-split / fc2 row-split over s -> AR(ESP) of R*M -> A2A(EP) back
                 (r = rows_per_expert(N): the t TP ranks all route the same N tokens)
    parm_s1      A2A(EP) of k*n rows -> AG(ESP) (s*R rows) -> experts, H/s each -> RS(ESP)
                 -> A2A(EP) [-> AG(TP) of the n*M combined output if no SP and t > 1;
                 its backward is a slice]
    parm_s2      parm_s1's volumes cut in chunks; without SP (t > 1) the restore is instead an
                 AG(TP) of the R received expert-output rows (with probabilities) before combine
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from megatron_parm.perf_model.layout import Layout
from megatron_parm.perf_model.shape import LayerShape

DISPATCHERS = ("ds_baseline", "parm_s1", "parm_s2")
COLLECTIVE_KINDS = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class Step:
    """One stage of a dispatcher's dataflow on one rank (whole layer, not per chunk)."""

    direction: str  # "forward" or "backward"
    name: str
    kind: str  # one of COLLECTIVE_KINDS, or "compute"
    group: Optional[str]  # "tp", "ep", "expt_tp"; None for compute
    intra_bytes: float = 0.0
    inter_bytes: float = 0.0
    intra_peers: int = 0
    inter_peers: int = 0
    flops: float = 0.0


def _collective(layout: Layout, direction: str, name: str, kind: str, group: str,
                bytes_per_peer: float) -> List[Step]:
    if layout.group_size(group) == 1:
        return []
    intra_peers, inter_peers = layout.peer_counts(group)
    return [Step(direction, name, kind, group,
                 intra_bytes=intra_peers * bytes_per_peer,
                 inter_bytes=inter_peers * bytes_per_peer,
                 intra_peers=intra_peers, inter_peers=inter_peers)]


def _compute(direction: str, name: str, flops: float) -> List[Step]:
    return [Step(direction, name, "compute", None, flops=flops)]


def build_plan(dispatcher: str, shape: LayerShape, layout: Layout,
               sequence_parallel: bool = True) -> Tuple[Step, ...]:
    """The ordered stages of `dispatcher`: forward stages, then backward stages."""
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"unknown dispatcher {dispatcher!r}; expected one of {DISPATCHERS}")
    t, e, s = layout.tp, layout.ep, layout.etp
    if shape.num_experts % e != 0:
        raise ValueError(
            f"LayerShape.num_experts={shape.num_experts} is not divisible by Layout.ep={e}"
        )
    num_local_experts = shape.num_experts // e
    row = shape.hidden_size * shape.dtype_bytes
    row_p = row + shape.prob_bytes
    n = shape.num_tokens
    restore = (not sequence_parallel) and t > 1

    if dispatcher == "ds_baseline":
        rows_per_expert = shape.rows_per_expert(t * n)
    else:
        rows_per_expert = shape.rows_per_expert(n)
    rows_per_peer = rows_per_expert * num_local_experts  # A2A(EP) rows to each EP peer
    rows_received = rows_per_expert * shape.num_experts  # R
    flops_per_row = shape.expert_flops_per_row(s)

    fwd, bwd = "forward", "backward"
    if dispatcher == "ds_baseline":
        gather_input = sequence_parallel and t > 1
        forward = (
            (_collective(layout, fwd, "input_ag", "all_gather", "tp", n * row)
             if gather_input else [])
            + _collective(layout, fwd, "dispatch_a2a", "all_to_all", "ep", rows_per_peer * row_p)
            + _compute(fwd, "experts", rows_received * flops_per_row)
            + _collective(layout, fwd, "expert_ar", "all_reduce", "expt_tp",
                          2.0 * rows_received * row / s)
            + _collective(layout, fwd, "combine_a2a", "all_to_all", "ep", rows_per_peer * row)
        )
        backward = (
            _collective(layout, bwd, "grad_combine_a2a", "all_to_all", "ep",
                        rows_per_peer * row)
            + _compute(bwd, "grad_experts", 2.0 * rows_received * flops_per_row)
            + _collective(layout, bwd, "grad_expert_ar", "all_reduce", "expt_tp",
                          2.0 * rows_received * row / s)
            + _collective(layout, bwd, "grad_dispatch_a2a", "all_to_all", "ep",
                          rows_per_peer * row_p)
            + (_collective(layout, bwd, "grad_input_ag", "reduce_scatter", "tp", n * row)
               if gather_input else [])
        )
        return tuple(forward + backward)

    if not restore:
        restore_steps = []
    elif dispatcher == "parm_s1":
        restore_steps = _collective(layout, fwd, "restore_ag", "all_gather", "tp", n * row)
    else:
        restore_steps = _collective(layout, fwd, "restore_ag", "all_gather", "tp",
                                    rows_received * row_p)
    forward = (
        _collective(layout, fwd, "dispatch_a2a", "all_to_all", "ep", rows_per_peer * row_p)
        + _collective(layout, fwd, "dispatch_ag", "all_gather", "expt_tp", rows_received * row_p)
        + _compute(fwd, "experts", s * rows_received * flops_per_row)
        + _collective(layout, fwd, "combine_rs", "reduce_scatter", "expt_tp", rows_received * row)
        + _collective(layout, fwd, "combine_a2a", "all_to_all", "ep", rows_per_peer * row)
        + restore_steps
    )
    backward = (
        _collective(layout, bwd, "grad_combine_a2a", "all_to_all", "ep", rows_per_peer * row)
        + _collective(layout, bwd, "grad_combine_rs", "all_gather", "expt_tp",
                      rows_received * row)
        + _compute(bwd, "grad_experts", 2.0 * s * rows_received * flops_per_row)
        + _collective(layout, bwd, "grad_dispatch_ag", "reduce_scatter", "expt_tp",
                      rows_received * row_p)
        + _collective(layout, bwd, "grad_dispatch_a2a", "all_to_all", "ep",
                      rows_per_peer * row_p)
    )
    return tuple(forward + backward)


def comm_volumes(dispatcher: str, shape: LayerShape, layout: Layout,
                 sequence_parallel: bool = True) -> Dict[Tuple[str, str], Dict[str, float]]:
    """Bytes one rank sends in one forward + backward of the layer.

    Returns {(collective_kind, group_name): {"intra": bytes, "inter": bytes}}, where
    group_name is "tp", "ep" or "expt_tp". Probabilities are included (LayerShape.prob_bytes
    per row on the dispatch path); set prob_bytes=0 to count activations only.
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
