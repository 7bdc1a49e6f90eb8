"""TransformerConfig with Parm's fields (flags --parm-*)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_parm import schedules, tuning
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

    parm_tune: Optional[bool] = None
    """--parm-tune / --no-parm-tune: parm measures the model's best candidates in the first
    steps (None: on without parm_profile, off with it; tuning.enabled)."""

    parm_tune_steps: int = tuning.DEFAULT_STEPS
    """--parm-tune-steps: timed calls per candidate (after one warm-up call)."""

    parm_tune_margin: float = tuning.DEFAULT_MARGIN
    """--parm-tune-margin: candidates predicted within (1 + margin) x the model's first."""

    parm_tune_candidates: int = tuning.DEFAULT_MAX_CANDIDATES
    """--parm-tune-candidates: at most this many candidates are timed."""

    parm_tune_cache: Optional[str] = None
    """--parm-tune-cache: JSON file of measured choices (None: not kept)."""

    def __post_init__(self):
        name = self.moe_token_dispatcher_type
        if name not in schedules.names() or schedules.is_native(name):
            super().__post_init__()
        else:
            # Megatron-Core's checks know its own dispatchers by name: Parm's are checked as the
            # alltoall one they replace (shared-expert overlap, say, is refused for others).
            self.moe_token_dispatcher_type = "alltoall"
            try:
                super().__post_init__()
            finally:
                self.moe_token_dispatcher_type = name
        tuning.check_args(self.parm_tune_steps, self.parm_tune_margin, self.parm_tune_candidates,
                          self.parm_tune_cache)
        if self.parm_num_chunks is not None:
            schedules.check_num_chunks(self.parm_num_chunks)
        if self.parm_ranks_per_node is not None:
            check_ranks_per_node(self.parm_ranks_per_node)
        if self.parm_bwd_num_chunks is not None:
            schedules.check_num_chunks(self.parm_bwd_num_chunks, schedules.BWD_CHUNKS_FLAG)


@dataclass
class ParmMLATransformerConfig(ParmTransformerConfig, MLATransformerConfig):
    """ParmTransformerConfig with Megatron-Core's multi-latent attention fields
    (MLATransformerConfig: q_lora_rank, kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim,
    v_head_dim, rope_type and YaRN's), as Megatron-LM builds it for --multi-latent-attention."""

    multi_latent_attention: bool = True


_PARM_FIELDS = {field.name: field for field in dataclasses.fields(ParmTransformerConfig)
                if field.name.startswith("parm_")}


def parm_setting(config, name: str):
    """CONFIG's value of the Parm setting NAME (a ParmTransformerConfig field), or that field's
    default where CONFIG is a plain TransformerConfig: every Parm dispatcher takes either."""
    if name not in _PARM_FIELDS:
        raise KeyError(f"{name} is not a ParmTransformerConfig setting "
                       f"(the settings: {', '.join(_PARM_FIELDS)})")
    return getattr(config, name, _PARM_FIELDS[name].default)
