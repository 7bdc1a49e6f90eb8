"""TransformerConfig with Parm's fields (flags --parm-*)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class ParmTransformerConfig(TransformerConfig):
    """Megatron's TransformerConfig plus the knobs of Parm's dispatchers."""

    parm_num_chunks: int = 4
    """--parm-num-chunks: pipeline chunks of parm_s2 (1 = S1's volumes in one chunk)."""

    parm_profile: Optional[str] = None
    """--parm-profile: performance-model profile used by the automatic dispatcher."""

    def __post_init__(self):
        super().__post_init__()
        if self.parm_num_chunks < 1:
            raise ValueError(f"--parm-num-chunks must be >= 1, got {self.parm_num_chunks}")
