"""Parallel layout of a cluster and which peers of a group share a node.

Notation (as in docs/design.md):
    t = tp   attention tensor-parallel size (Megatron TP, the paper's MP)
    e = ep   expert-parallel size
    s = etp  expert-tensor-parallel size (Megatron ETP, the paper's ESP)

Rank order follows Megatron-Core (pipeline parallel size 1):
    dense layout:  global rank = dp_idx * t + tp_idx            (TP groups are consecutive ranks)
    expert layout: global rank = edp_idx * e * s + ep_idx * s + etp_idx
so TP and ETP groups are consecutive ranks and EP groups stride across ranks by s. The
data-parallel groups that reduce gradients stride too: "dp" (dense parameters, W / t ranks)
by t, "expt_dp" (expert parameters, W / (e * s) ranks) by e * s.
A node holds ranks [node * ranks_per_node, (node + 1) * ranks_per_node).
"""

from dataclasses import dataclass
from functools import lru_cache
from typing import List, Tuple

GROUP_NAMES = ("tp", "ep", "expt_tp")  # the groups a dispatcher communicates over
DATA_PARALLEL_GROUP_NAMES = ("dp", "expt_dp")  # the groups gradients are reduced over
_ALL_GROUP_NAMES = GROUP_NAMES + DATA_PARALLEL_GROUP_NAMES


@dataclass(frozen=True)
class Layout:
    """Sizes of the parallel groups and of the cluster."""

    tp: int
    ep: int
    etp: int
    nodes: int
    ranks_per_node: int

    def __post_init__(self):
        for name in ("tp", "ep", "etp", "nodes", "ranks_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Layout.{name} must be a positive integer, got {value!r}")
        if self.world_size % self.tp != 0:
            raise ValueError(
                f"Layout: world size {self.world_size} (nodes * ranks_per_node) is not "
                f"divisible by tp={self.tp}"
            )
        if self.world_size % (self.ep * self.etp) != 0:
            raise ValueError(
                f"Layout: world size {self.world_size} (nodes * ranks_per_node) is not "
                f"divisible by ep * etp = {self.ep} * {self.etp}"
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def group_size(self, group_name: str) -> int:
        if group_name == "tp":
            return self.tp
        if group_name == "ep":
            return self.ep
        if group_name == "expt_tp":
            return self.etp
        if group_name == "dp":
            return self.world_size // self.tp
        if group_name == "expt_dp":
            return self.world_size // (self.ep * self.etp)
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
        if group_name == "ep":
            block = self.ep * self.etp
            edp_base = rank - rank % block
            etp_idx = rank % self.etp
            return [edp_base + ep_idx * self.etp + etp_idx for ep_idx in range(self.ep)]
        if group_name in DATA_PARALLEL_GROUP_NAMES:
            stride = self.tp if group_name == "dp" else self.ep * self.etp
            return list(range(rank % stride, self.world_size, stride))
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
