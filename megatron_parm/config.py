"""TransformerConfig with Parm's fields (flags --parm-*)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_parm import schedules


@dataclass
class ParmTransformerConfig(TransformerConfig):
    """Megatron's TransformerConfig plus the knobs of Parm's dispatchers."""

    parm_num_chunks: Optional[int] = None
    """--parm-num-chunks: pipeline chunks of the chunked schedules (None: each one's default)."""

    parm_profile: Optional[str] = None
    """--parm-profile: performance-model profile used by the automatic dispatcher."""

    def __post_init__(self):
        super().__post_init__()
        if self.parm_num_chunks is not None:
            schedules.check_num_chunks(self.parm_num_chunks)
