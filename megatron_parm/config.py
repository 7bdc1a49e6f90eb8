"""TransformerConfig with Parm's fields (flags --parm-*)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_parm import schedules
from megatron_parm.comm.accounting import check_ranks_per_node


@dataclass
class ParmTransformerConfig(TransformerConfig):
    """Megatron's TransformerConfig plus the knobs of Parm's dispatchers."""

    parm_num_chunks: Optional[int] = None
    """--parm-num-chunks: forward pipeline chunks of the chunked schedules (None: each one's
    default)."""

    parm_bwd_num_chunks: Optional[int] = None
    """--parm-bwd-num-chunks: backward pipeline chunks (None: the forward count)."""

    parm_profile: Optional[str] = None
    """--parm-profile: performance-model profile used by the automatic dispatcher."""

    parm_ranks_per_node: Optional[int] = None
    """--parm-ranks-per-node: ranks per node, for parm_hier's node groups and the performance
    model (None: the launcher's LOCAL_WORLD_SIZE; comm.accounting.ranks_per_node)."""

    def __post_init__(self):
        super().__post_init__()
        if self.parm_num_chunks is not None:
            schedules.check_num_chunks(self.parm_num_chunks)
        if self.parm_ranks_per_node is not None:
            check_ranks_per_node(self.parm_ranks_per_node)
        if self.parm_bwd_num_chunks is not None:
            schedules.check_num_chunks(self.parm_bwd_num_chunks, schedules.BWD_CHUNKS_FLAG)
