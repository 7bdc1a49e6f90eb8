"""The project's core attention on Megatron-Core's local layer spec: context parallelism, and
multi-latent attention's head widths.

Megatron-Core 0.16.1's local DotProductAttention asserts a context-parallel size of 1 (only
Transformer Engine's attention splits a sequence over ranks). ParmDotProductAttention is that
local attention (its unfused computation: batched matmuls, Megatron's masked softmax, attention
dropout under the model-parallel RNG tracker) that also runs with --context-parallel-size c > 1,
with the semantics of Megatron's --cp-comm-type:

    all_gather  AG(CP) of the keys and values (backward: RS(CP) of their gradients), put back in
                sequence order; this rank's queries attend to the whole sequence under a causal
                mask of their true positions.
    a2a         Ulysses: A2A(CP) trades this rank's part of the sequence for a 1/c share of its
                heads over the whole sequence (queries, keys and values), attention over the
                whole sequence, A2A(CP) back (backward: the same exchanges reversed).

The sequence is split as Megatron-LM splits a batch (get_batch_on_this_cp_rank): into 2c
chunks, CP rank r holding chunks r and 2c - 1 - r, so that under a causal mask every rank has
the same work. `split_for_context_parallel` and `context_parallel_positions` are that rule, for
the batch (training/model.py) and for the masks here; rotary embeddings take each token's true
position from Megatron-Core's RotaryEmbedding, which selects the same chunks.

MLADotProductAttention is this attention built for MLA's widths. Megatron-Core 0.16.1's
MLASelfAttention builds its core attention with the width of a query / key head (k_channels =
qk_head_dim + qk_pos_emb_head_dim) and of a value head (v_channels = v_head_dim), which differ
(DeepSeek-V2/V3: 192 and 128). Transformer Engine's attention takes both; the local
DotProductAttention takes neither (a TypeError at build), and it sizes its output by
--kv-channels. Its computation needs no equal widths: scores from Q and K over the k_channels,
the softmax, then the probabilities times V over the v_channels.

specs.with_core_attention puts MLADotProductAttention in place of DotProductAttention in the
local MLA layer specs, and ParmDotProductAttention in the other local specs where the config
has context parallelism; Transformer Engine's spec keeps its own. tests/unit/test_mla.py checks
MLA's against a plain reference and against Megatron-Core's DotProductAttention where the widths
are equal; tests/unit/test_context_parallel.py checks c = 2 against c = 1 (outputs and
gradients, both communication types).

Notation: s sequence, b micro-batch, n heads per tensor-parallel rank, g key-value groups per
tensor-parallel rank, dk / dv the widths of a query-key / value head, c the context-parallel
size; a tensor of this rank's part of a sequence has s / c rows.
"""

from __future__ import annotations

import contextlib
import copy
from typing import List, Optional

import torch

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_parm.comm.collectives import all_gather, all_to_all

CP_GROUP_NAME = "cp"  # the byte accounting's name of the context-parallel group


# ---------------------------------------------------------------------------------------------
# the load-balanced split of a sequence (Megatron-LM's get_batch_on_this_cp_rank)
# ---------------------------------------------------------------------------------------------


def cp_chunks(cp_size: int, cp_rank: int) -> List[int]:
    """The two chunks (of 2c) of a sequence that CP rank r holds: r and 2c - 1 - r."""
    return [cp_rank, 2 * cp_size - 1 - cp_rank]


def split_for_context_parallel(tensor: torch.Tensor, dim: int, cp_size: int,
                               cp_rank: int) -> torch.Tensor:
    """This CP rank's part of TENSOR along its sequence dimension DIM (s -> s / c rows)."""
    if cp_size == 1:
        return tensor
    shape = tensor.shape
    chunked = tensor.view(*shape[:dim], 2 * cp_size, shape[dim] // (2 * cp_size),
                          *shape[dim + 1:])
    index = torch.tensor(cp_chunks(cp_size, cp_rank), device=tensor.device)
    return chunked.index_select(dim, index).reshape(*shape[:dim], -1, *shape[dim + 1:])


def context_parallel_positions(seq_length: int, cp_size: int, cp_rank: int,
                               device=None) -> torch.Tensor:
    """The positions in the sequence of this CP rank's s / c tokens, in the order it holds them."""
    return split_for_context_parallel(torch.arange(seq_length, device=device), 0, cp_size,
                                      cp_rank)


def _rank_order(cp_size: int, device) -> torch.Tensor:
    """The sequence's 2c chunks in the order the CP ranks' parts concatenate them."""
    return torch.tensor([chunk for rank in range(cp_size) for chunk in cp_chunks(cp_size, rank)],
                        device=device)


def _reorder_chunks(tensor: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Dim 0 of TENSOR as 2c chunks, chunk i of the result being chunk order[i] of TENSOR."""
    chunks = order.numel()
    view = tensor.view(chunks, tensor.shape[0] // chunks, *tensor.shape[1:])
    return view.index_select(0, order).view(tensor.shape)


def to_sequence_order(gathered: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Every CP rank's part concatenated in rank order (dim 0) -> the sequence in its order."""
    return _reorder_chunks(gathered, torch.argsort(_rank_order(cp_size, gathered.device)))


def to_rank_order(sequence: torch.Tensor, cp_size: int) -> torch.Tensor:
    """The sequence in its order (dim 0) -> every CP rank's part concatenated in rank order."""
    return _reorder_chunks(sequence, _rank_order(cp_size, sequence.device))


def causal_mask_on_cp_rank(seq_length: int, cp_size: int, cp_rank: int,
                           device=None) -> torch.Tensor:
    """[1, 1, s / c, s] bool, True where a query of this CP rank may not see a key: the causal
    mask of the rows of its tokens' true positions, keys in sequence order."""
    queries = context_parallel_positions(seq_length, cp_size, cp_rank, device)
    keys = torch.arange(seq_length, device=device)
    return (keys[None, :] > queries[:, None])[None, None]


# ---------------------------------------------------------------------------------------------
# the core attention
# ---------------------------------------------------------------------------------------------


class ParmDotProductAttention(DotProductAttention):
    """Megatron-Core's local DotProductAttention, also with context parallelism.

    query [s/c, b, n, dk], key [s/c, b, g, dk], value [s/c, b, g, dv] -> context [s/c, b, n dv].
    attention_mask: [b or 1, 1, s/c, s] (this rank's rows of the sequence's mask, as
    get_batch_on_this_cp_rank splits the data loader's), or None for the causal one."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None):
        cp_size = config.context_parallel_size
        # Megatron-Core's class refuses CP > 1 in its constructor, and nothing else of it
        # depends on the size: build it from a copy of the config with CP 1, then keep ours.
        local = config
        if cp_size > 1:
            local = copy.copy(config)
            local.context_parallel_size = 1
        super().__init__(local, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        self.config = config
        self.cp_size = cp_size
        if cp_size == 1:
            return
        self.cp_comm_type = cp_comm_type or "all_gather"
        if self.cp_comm_type not in ("all_gather", "a2a"):
            raise ValueError(f"--cp-comm-type {self.cp_comm_type}: only all_gather and a2a run "
                             f"without Transformer Engine")
        cp_group = getattr(pg_collection, "cp", None)
        if cp_group is None:
            from megatron.core import parallel_state

            cp_group = parallel_state.get_context_parallel_group()
        self.cp_group = cp_group
        # With CP the mask is always given (its rows are not the sequence's first ones): the
        # softmax takes it as it is, never its own causal triangle.
        self.scale_mask_softmax.attn_mask_type = AttnMaskType.padding

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if self.cp_size == 1:
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        assert packed_seq_params is None, "packed sequences need Transformer Engine's attention"
        if self.cp_comm_type == "a2a":
            return self._forward_a2a(query, key, value, attention_mask)
        return self._forward_all_gather(query, key, value, attention_mask)

    def _forward_all_gather(self, query, key, value, attention_mask):
        """AG(CP) of keys and values, attention of this rank's queries over the sequence."""
        c = self.cp_size
        key = to_sequence_order(all_gather(key.contiguous(), self.cp_group, CP_GROUP_NAME), c)
        value = to_sequence_order(all_gather(value.contiguous(), self.cp_group, CP_GROUP_NAME),
                                  c)
        if attention_mask is None:
            attention_mask = causal_mask_on_cp_rank(key.shape[0], c, self.cp_group.rank(),
                                                    query.device)
        return super().forward(query, key, value, attention_mask)

    def _forward_a2a(self, query, key, value, attention_mask):
        """A2A(CP): this rank's part of the sequence, every head -> the whole sequence, a 1/c
        share of the heads; attention; A2A(CP) back."""
        c = self.cp_size
        query, key, value = (self._heads_to_ranks(x) for x in (query, key, value))
        seq_length = query.shape[0]
        if attention_mask is None:
            attention_mask = torch.ones(seq_length, seq_length, dtype=torch.bool,
                                        device=query.device).triu(1)[None, None]
        else:  # every rank's rows of the mask, in sequence order: [b, 1, s, s]
            rows = attention_mask.transpose(0, 2).to(torch.uint8).contiguous()
            attention_mask = to_sequence_order(all_gather(rows, self.cp_group, None), c)
            attention_mask = attention_mask.transpose(0, 2).bool()
        with self._head_share(c):
            context = super().forward(query, key, value, attention_mask)  # [s, b, n/c dv]
        return self._heads_from_ranks(context)

    def _heads_to_ranks(self, x: torch.Tensor) -> torch.Tensor:
        """[s/c, b, h, d] -> [s, b, h/c, d]: CP rank j gets head share j of every rank's part."""
        c = self.cp_size
        rows, batch, heads, width = x.shape
        shares = x.reshape(rows, batch, c, heads // c, width).permute(2, 0, 1, 3, 4)
        shares = shares.reshape(c * rows, batch, heads // c, width)
        received = all_to_all(shares, self.cp_group, CP_GROUP_NAME, [rows] * c, [rows] * c)
        return to_sequence_order(received, c)

    def _heads_from_ranks(self, context: torch.Tensor) -> torch.Tensor:
        """[s, b, n/c dv] -> [s/c, b, n dv]: the inverse exchange of _heads_to_ranks."""
        c = self.cp_size
        seq_length, batch, _ = context.shape
        rows = seq_length // c
        parts = to_rank_order(context, c)  # rank j's part at rows [j s/c, (j + 1) s/c)
        received = all_to_all(parts, self.cp_group, CP_GROUP_NAME, [rows] * c, [rows] * c)
        shares = received.view(c, rows, batch, -1).permute(1, 2, 0, 3)  # [s/c, b, c, n/c dv]
        return shares.reshape(rows, batch, -1)

    @contextlib.contextmanager
    def _head_share(self, c: int):
        """Megatron's computation sized for 1/c of this rank's heads (a2a)."""
        saved = (self.num_attention_heads_per_partition, self.num_query_groups_per_partition,
                 self.hidden_size_per_partition)
        self.num_attention_heads_per_partition //= c
        self.num_query_groups_per_partition //= c
        self.hidden_size_per_partition //= c
        try:
            yield
        finally:
            (self.num_attention_heads_per_partition, self.num_query_groups_per_partition,
             self.hidden_size_per_partition) = saved


class MLADotProductAttention(ParmDotProductAttention):
    """The project's local attention for key and value heads of their own widths.

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
