"""Byte accounting for the dispatchers' collectives.

Every collective in ``megatron_parm.comm.collectives`` reports, per call, how many bytes
this rank sends to each peer, under a (collective kind, group name) key, and whether each
peer is on this rank's node. Benchmarks and tests read the totals.

Convention ("bytes sent by this rank", direct algorithm, g = group size):
- all_to_all:     the rows addressed to each other peer.
- all_gather:     this rank's chunk, once to each of the g-1 peers.
- reduce_scatter: chunk j to peer j, for the g-1 peers.
- all_reduce:     reduce_scatter + all_gather of the same tensor (2 (g-1)/g of it).
Backward passes are recorded too, under the kind of the collective that actually runs
(the backward of an all_gather is a reduce_scatter, and so on).

Nodes: rank r lives on node r // ranks_per_node. ``ranks_per_node`` defaults to the
launcher's LOCAL_WORLD_SIZE (torchrun, Slurm via torchrun, the emulated cluster); the
flag --parm-ranks-per-node overrides it for the dispatchers and the performance model
(``ranks_per_node`` below is that rule, the one place it is written), and
``track_comm(ranks_per_node)`` for the accounting.
"""

from __future__ import annotations

import os
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Iterator, Optional, Sequence, Tuple

Key = Tuple[str, str]  # (collective kind, group name)


def launcher_ranks_per_node() -> Optional[int]:
    """The launcher's ranks per node (LOCAL_WORLD_SIZE), or None where it is not set."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None


def check_ranks_per_node(value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"--parm-ranks-per-node must be a positive integer, got {value!r}")


def ranks_per_node(world_size: int, setting: Optional[int] = None) -> int:
    """Ranks per node of a world: ``setting`` (--parm-ranks-per-node) where given, else the
    launcher's LOCAL_WORLD_SIZE where it divides the world, else the whole world (one node)."""
    if setting is not None:
        check_ranks_per_node(setting)
        if world_size % setting:
            raise ValueError(f"--parm-ranks-per-node ({setting}) must divide the world size "
                             f"({world_size})")
        return setting
    local = launcher_ranks_per_node()
    return local if local and world_size % local == 0 else world_size


@dataclass
class LinkBytes:
    intra: int = 0
    inter: int = 0

    @property
    def total(self) -> int:
        return self.intra + self.inter


@dataclass
class CommStats:
    """Bytes this rank sent, per (kind, group), split into intra- and inter-node."""

    ranks_per_node: Optional[int] = None
    bytes: Dict[Key, LinkBytes] = field(default_factory=lambda: defaultdict(LinkBytes))
    calls: Dict[Key, int] = field(default_factory=lambda: defaultdict(int))

    def node_of(self, global_rank: int) -> int:
        rpn = self.ranks_per_node or launcher_ranks_per_node()
        return 0 if rpn is None else global_rank // rpn

    def record(self, kind: str, group_name: str, my_rank: int,
               bytes_to_peer: Sequence[Tuple[int, int]]) -> None:
        """bytes_to_peer: (global rank of peer, bytes) for every peer this rank sends to."""
        key = (kind, group_name)
        entry = self.bytes[key]
        my_node = self.node_of(my_rank)
        for peer, nbytes in bytes_to_peer:
            if peer == my_rank or nbytes == 0:
                continue
            if self.node_of(peer) == my_node:
                entry.intra += int(nbytes)
            else:
                entry.inter += int(nbytes)
        self.calls[key] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def totals(self) -> Dict[Key, Dict[str, int]]:
        return {k: {"intra": v.intra, "inter": v.inter} for k, v in sorted(self.bytes.items())}

    def sum(self, kind: Optional[str] = None, group: Optional[str] = None) -> LinkBytes:
        out = LinkBytes()
        for (k, g), v in self.bytes.items():
            if (kind is None or k == kind) and (group is None or g == group):
                out.intra += v.intra
                out.inter += v.inter
        return out


_STATS = CommStats()


def get_comm_stats() -> CommStats:
    """The process-wide accounting the collectives write into."""
    return _STATS


@contextmanager
def track_comm(ranks_per_node: Optional[int] = None) -> Iterator[CommStats]:
    """Reset the accounting, yield it, and leave the totals readable afterwards."""
    _STATS.reset()
    _STATS.ranks_per_node = ranks_per_node
    yield _STATS
