"""Parallel layout of a cluster and which peers of a group share a node.

Notation (as in docs/design.md):
    t = tp   attention tensor-parallel size (Megatron TP, the paper's MP)
    e = ep   expert-parallel size
    s = etp  expert-tensor-parallel size (Megatron ETP, the paper's ESP)

    p = pp   pipeline-parallel size (stages);  S = W / p  ranks of one stage
    c = cp   context-parallel size (each sequence split over c ranks)

Rank order follows Megatron-Core's default ("tp-cp-ep-dp-pp": pipeline outermost):
    stage:         global rank = pp_idx * S + stage rank          (a stage is S consecutive ranks)
    dense layout:  stage rank = (dp_idx * c + cp_idx) * t + tp_idx (TP groups are consecutive ranks)
    expert layout: stage rank = edp_idx * e * s + ep_idx * s + etp_idx
so TP and ETP groups are consecutive ranks and EP groups stride across ranks by s; the ESP x
EP group "tp_ep" (Megatron's allgather gathers over it) is e * s consecutive ranks. The
data-parallel groups that reduce gradients stride too, inside their stage: "dp" (dense
parameters, S / t ranks: Megatron's data x context parallel group, which its DDP reduces
over) by t, "expt_dp" (expert parameters, S / (e * s) ranks) by e * s; the context-parallel
group "cp" (attention's gather of the keys and values) is c ranks striding by t, and the
data-parallel size that splits the global batch is S / (t c) (Layout.data_parallel_size). The
pipeline group "pp" (the p2p sends between neighbouring stages) strides by S: rank r's next
stage is r + S.
A node holds ranks [node * ranks_per_node, (node + 1) * ranks_per_node). E.g. 2 nodes x 2
ranks at p = 2: stage 0 is ranks 0, 1 (node 0), stage 1 ranks 2, 3 (node 1); every TP, EP and
data-parallel group stays in a node and every p2p send (0 -> 2, 1 -> 3) crosses nodes.
Megatron-Core's other order (--use-tp-pp-dp-mapping, layout_rules.RANK_ORDERS) makes the same
TP, CP and ESP x EP groups, so the per-layer plans hold for it; its pipeline groups stride by
t * c and its data-parallel groups by t * c * p, which the step model does not price.

parm_hier splits each EP group by node (``ep_node_blocks``): "ep_inter" is the group of the
EP ranks at one position of every node (its inter-node stage), "ep_intra" the EP ranks of
one node (its intra-node fan-out).
"""

from dataclasses import dataclass
from functools import lru_cache
from typing import List, Sequence, Tuple

HIERARCHY_GROUPS = ("ep_inter", "ep_intra")  # parm_hier's EP groups split by node
# the groups a dispatcher communicates over; "tp_ep": Megatron's ESP x EP group (allgather's)
GROUP_NAMES = ("tp", "ep", "expt_tp", "tp_ep") + HIERARCHY_GROUPS
CONTEXT_PARALLEL_GROUP_NAME = "cp"  # attention's gather of the keys and values
DATA_PARALLEL_GROUP_NAMES = ("dp", "expt_dp")  # the groups gradients are reduced over
PIPELINE_GROUP_NAME = "pp"  # one rank per stage: the p2p sends of the pipeline schedules
_ALL_GROUP_NAMES = GROUP_NAMES + DATA_PARALLEL_GROUP_NAMES + (PIPELINE_GROUP_NAME,
                                                               CONTEXT_PARALLEL_GROUP_NAME)


def _by_node(ranks: Sequence[int], ranks_per_node: int) -> List[List[int]]:
    """Ranks in group order, cut where the node changes."""
    blocks: List[List[int]] = []
    for rank in ranks:
        if blocks and blocks[-1][-1] // ranks_per_node == rank // ranks_per_node:
            blocks[-1].append(rank)
        else:
            blocks.append([rank])
    return blocks


def _node_split(tp_ep_ranks: Sequence[int], etp: int, ranks_per_node: int):
    """Each EP group of the block split by node, and why that split is uneven (or None)."""
    groups = [list(tp_ep_ranks[q::etp]) for q in range(etp)]
    split = [_by_node(group, ranks_per_node) for group in groups]
    shapes = {tuple(len(block) for block in blocks) for blocks in split}
    shape = next(iter(shapes))
    nodes_once = all(len({block[0] // ranks_per_node for block in blocks}) == len(blocks)
                     for blocks in split)
    if len(shapes) == 1 and len(set(shape)) == 1 and nodes_once:
        return groups, split, None
    sizes = sorted({len(block) for blocks in split for block in blocks})
    return groups, split, (f"the EP group {groups[0]} does not split evenly by node at "
                           f"{ranks_per_node} ranks per node (nodes hold {sizes} of its "
                           f"ranks): parm_hier needs as many EP ranks on every node it spans")


def node_split_problem(tp_ep_ranks: Sequence[int], etp: int, ranks_per_node: int):
    """Why parm_hier cannot split the EP groups of this ESP x EP block by node (None if it
    can): every EP group must span its nodes with as many ranks on each (ep_node_blocks)."""
    return _node_split(tp_ep_ranks, etp, ranks_per_node)[2]


def world_node_split_problem(world_size: int, ep: int, etp: int, pp: int,
                             ranks_per_node: int):
    """node_split_problem for every ESP x EP block of a world laid out in Megatron's order
    (expert layout [pp][edp][ep][etp]), before any process group exists; None if parm_hier
    can split them all."""
    stage, block = world_size // pp, ep * etp
    for first in range(0, world_size, block) if stage % block == 0 else ():
        problem = node_split_problem(range(first, first + block), etp, ranks_per_node)
        if problem:
            return problem
    return None


def ep_node_blocks(tp_ep_ranks: Sequence[int], etp: int, ranks_per_node: int) -> List[List[List[int]]]:
    """The EP groups of one ESP x EP block, each split by node: [ESP index][block][position].

    tp_ep_ranks: the block's ranks ordered EP-major, ESP-minor (Megatron's expert TP x EP
    group), so EP group q is tp_ep_ranks[q::etp]. A block is the ranks of one EP group on
    one node. parm_hier's inter-node stage joins the ranks at one position of every block,
    its intra-node stage the ranks of one block; that needs every EP group of the ESP x EP
    block cut alike (as many blocks, each node once, as many ranks in each), since ESP peers
    gather each other's rows in that order. Where they are not (node_split_problem), every
    rank is a block of its own: the performance model then prices a single stage,
    deduplicated per destination rank; the dispatcher refuses such a layout.
    """
    groups, split, problem = _node_split(tp_ep_ranks, etp, ranks_per_node)
    if problem is None:
        return split
    return [[[rank] for rank in group] for group in groups]


@dataclass(frozen=True)
class Layout:
    """Sizes of the parallel groups and of the cluster."""

    tp: int
    ep: int
    etp: int
    nodes: int
    ranks_per_node: int
    pp: int = 1
    cp: int = 1

    def __post_init__(self):
        for name in ("tp", "ep", "etp", "nodes", "ranks_per_node", "pp", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Layout.{name} must be a positive integer, got {value!r}")
        if self.world_size % self.pp != 0:
            raise ValueError(
                f"Layout: world size {self.world_size} (nodes * ranks_per_node) is not "
                f"divisible by pp={self.pp}"
            )
        if self.stage_size % self.tp != 0:
            raise ValueError(
                f"Layout: stage size {self.stage_size} (world / pp) is not divisible by "
                f"tp={self.tp}"
            )
        if self.stage_size % (self.tp * self.cp) != 0:
            raise ValueError(
                f"Layout: stage size {self.stage_size} (world / pp) is not divisible by "
                f"tp * cp = {self.tp} * {self.cp}"
            )
        if self.stage_size % (self.ep * self.etp) != 0:
            raise ValueError(
                f"Layout: stage size {self.stage_size} (world / pp) is not divisible by "
                f"ep * etp = {self.ep} * {self.etp}"
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def stage_size(self) -> int:
        """S: ranks of one pipeline stage (the world without pipelining)."""
        return self.world_size // self.pp

    @property
    def data_parallel_size(self) -> int:
        """d: the ranks that split the global batch, S / (t c) (the gradients are reduced over
        the d x c ranks of "dp")."""
        return self.stage_size // (self.tp * self.cp)

    def stage_of(self, rank: int) -> int:
        return rank // self.stage_size

    def group_size(self, group_name: str) -> int:
        """Ranks in a group of this kind (for ep_inter / ep_intra, the largest such group)."""
        if group_name == "tp":
            return self.tp
        if group_name == "ep":
            return self.ep
        if group_name == "expt_tp":
            return self.etp
        if group_name == "tp_ep":
            return self.ep * self.etp
        if group_name == "dp":
            return self.stage_size // self.tp
        if group_name == "expt_dp":
            return self.stage_size // (self.ep * self.etp)
        if group_name == PIPELINE_GROUP_NAME:
            return self.pp
        if group_name == CONTEXT_PARALLEL_GROUP_NAME:
            return self.cp
        if group_name in HIERARCHY_GROUPS:
            return _largest_group(self, group_name)
        raise ValueError(f"unknown group name {group_name!r}; expected one of {_ALL_GROUP_NAMES}")

    def group_ranks(self, group_name: str, rank: int) -> List[int]:
        """Global ranks of the `group_name` group that contains `rank` (in group order)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        if group_name == "tp":
            start = rank - rank % self.tp
            return list(range(start, start + self.tp))
        if group_name == "expt_tp":
            start = rank - rank % self.etp
            return list(range(start, start + self.etp))
        if group_name == "tp_ep":
            block = self.ep * self.etp
            start = rank - rank % block
            return list(range(start, start + block))
        if group_name == "ep":
            block = self.ep * self.etp
            edp_base = rank - rank % block
            etp_idx = rank % self.etp
            return [edp_base + ep_idx * self.etp + etp_idx for ep_idx in range(self.ep)]
        if group_name in DATA_PARALLEL_GROUP_NAMES:
            stride = self.tp if group_name == "dp" else self.ep * self.etp
            base = rank - rank % self.stage_size
            return list(range(base + rank % stride, base + self.stage_size, stride))
        if group_name == PIPELINE_GROUP_NAME:
            return list(range(rank % self.stage_size, self.world_size, self.stage_size))
        if group_name == CONTEXT_PARALLEL_GROUP_NAME:
            block = self.tp * self.cp
            start = rank - rank % block + rank % self.tp
            return list(range(start, start + block, self.tp))
        if group_name in HIERARCHY_GROUPS:
            block = self.ep * self.etp
            blocks = _ep_blocks(self, rank - rank % block)[rank % self.etp]
            node = next(b for b, members in enumerate(blocks) if rank in members)
            if group_name == "ep_intra":
                return list(blocks[node])
            position = blocks[node].index(rank)
            return [members[position] for members in blocks]
        raise ValueError(f"unknown group name {group_name!r}; expected one of {_ALL_GROUP_NAMES}")

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def peer_counts(self, group_name: str, rank: int = None) -> Tuple[int, int]:
        """(peers on the same node, peers on other nodes) of one rank in its group.

        Without `rank`, the worst rank of the world: the one with the most inter-node peers.
        A collective is as slow as its slowest member, so the model uses that rank.
        """
        if rank is not None:
            members = self.group_ranks(group_name, rank)
            node = self.node_of(rank)
            intra = sum(1 for peer in members if peer != rank and self.node_of(peer) == node)
            return intra, len(members) - 1 - intra
        return _worst_peer_counts(self, group_name)

    def is_intra(self, group_name: str) -> bool:
        """True when every group of this kind lies inside one node."""
        return self.peer_counts(group_name)[1] == 0


@lru_cache(maxsize=256)
def _worst_peer_counts(layout: Layout, group_name: str) -> Tuple[int, int]:
    worst = None
    for rank in range(layout.world_size):
        intra, inter = layout.peer_counts(group_name, rank)
        if worst is None or (inter, intra) > (worst[1], worst[0]):
            worst = (intra, inter)
    return worst


@lru_cache(maxsize=256)
def _ep_blocks(layout: Layout, base: int) -> List[List[List[int]]]:
    """ep_node_blocks of the ESP x EP block that starts at rank ``base``."""
    ranks = range(base, base + layout.ep * layout.etp)
    return ep_node_blocks(ranks, layout.etp, layout.ranks_per_node)


@lru_cache(maxsize=256)
def _largest_group(layout: Layout, group_name: str) -> int:
    return max(len(layout.group_ranks(group_name, rank)) for rank in range(layout.world_size))
