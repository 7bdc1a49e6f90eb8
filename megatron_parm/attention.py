"""Core attention for multi-latent attention on Megatron-Core's local layer spec.

Megatron-Core 0.16.1's MLASelfAttention builds its core attention with the width of a query /
key head (k_channels = qk_head_dim + qk_pos_emb_head_dim) and of a value head (v_channels =
v_head_dim), which differ (DeepSeek-V2/V3: 192 and 128). Transformer Engine's attention takes
both; the local DotProductAttention of its local spec takes neither (a TypeError at build), and
it sizes its output by --kv-channels. Its computation needs no equal widths: scores from Q and
K over the k_channels, the softmax, then the probabilities times V over the v_channels.

MLADotProductAttention is that local attention built for MLA's widths: the same unfused
computation (batched matmuls, Megatron's masked softmax, attention dropout under the model
parallel RNG tracker without sequence parallelism), the same heads per tensor-parallel rank,
its output [s, b, heads per rank x v_channels]. specs.with_mla_core_attention puts it in place
of DotProductAttention in the local MLA layer specs only: Transformer Engine's spec keeps its
own. tests/unit/test_mla.py checks it against a plain reference and against Megatron-Core's
DotProductAttention where the widths are equal; tests/distributed/modern_moe_worker.py with
tensor and sequence parallelism.

Notation: s sequence, b micro-batch, n heads per tensor-parallel rank, dk / dv the widths of a
query-key / value head.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.transformer.dot_product_attention import DotProductAttention


class MLADotProductAttention(DotProductAttention):
    """Megatron-Core's local DotProductAttention for key and value heads of their own widths.

    query [s, b, n, dk], key [s, b, n, dk], value [s, b, n, dv] -> context [s, b, n dv]."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None):
        super().__init__(config, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        # The local attention sizes its output by --kv-channels: here by the value heads.
        self.k_channels = k_channels
        self.v_channels = v_channels or config.kv_channels
        self.hidden_size_per_partition = self.num_attention_heads_per_partition * self.v_channels
