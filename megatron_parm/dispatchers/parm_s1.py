"""Parm's schedule S1: deduplicated, sequential."""

from __future__ import annotations

import torch

from megatron_parm.comm.collectives import all_gather, all_to_all, reduce_scatter
from megatron_parm.dispatchers.base import (
    ParmTokenDispatcher,
    pack_rows,
    unpack_rows,
    sort_by_local_expert,
    unsort_by_local_expert,
)


class ParmS1TokenDispatcher(ParmTokenDispatcher):
    """S1: every rank routes only its own n tokens; nothing is sent twice.

    Workflow (communication on the group in brackets):
    (1) dispatch_preprocess: permute this rank's n tokens by expert (k*n rows); exchange the
        E routing counts [ESP x EP]
    (2) token_dispatch: A2A [EP] of the rows and their probs
    (3) dispatch_postprocess: AG [ESP] of the received rows; sort them by local expert
    (4) experts (fc1 column- and fc2 row-split over ESP, partial sums out)
    (5) combine_preprocess: unsort; RS [ESP] of the partial sums
    (6) token_combine: A2A [EP] back
    (7) combine_postprocess: unpermute to this rank's n tokens
    When the layer input is replicated over TP (no sequence parallelism), ParmMoELayer
    hands this dispatcher the rank's shard and restores the full output with one AG [TP].
    """

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor,
                            probs: torch.Tensor):
        self.hidden_shape = hidden_states.shape
        tokens = hidden_states.view(-1, self.hidden_shape[-1])
        rows, row_probs, counts = self._permute(tokens, routing_map, probs)
        self.plan = self.build_plan(counts)
        return rows, row_probs

    def _both(self, collective, rows, row_probs, *args):
        """Run a collective on rows and probs: as one message where their dtypes match."""
        if rows.dtype != row_probs.dtype:
            return collective(rows, *args), collective(row_probs, *args)
        return unpack_rows(collective(pack_rows(rows, row_probs), *args), rows.shape[1], row_probs.dtype)

    def token_dispatch(self, rows: torch.Tensor, row_probs: torch.Tensor):
        return self._both(all_to_all, rows, row_probs, self.ep_group, "ep",
                          self.plan.a2a_output_splits(), self.plan.a2a_input_splits())

    def dispatch_postprocess(self, rows: torch.Tensor, row_probs: torch.Tensor):
        rows, row_probs = self._both(all_gather, rows, row_probs, self.etp_group, "expt_tp",
                                     self.plan.etp_split_sizes())
        self.chunk_sizes = self.plan.gathered_chunk_sizes()
        rows, row_probs = sort_by_local_expert(rows, row_probs, self.chunk_sizes,
                                               self.num_local_experts)
        return rows, self.plan.tokens_per_local_expert(), row_probs

    def combine_preprocess(self, hidden_states: torch.Tensor):
        rows = unsort_by_local_expert(hidden_states, self.chunk_sizes, self.num_local_experts)
        return reduce_scatter(rows, self.etp_group, "expt_tp", self.plan.etp_split_sizes())

    def token_combine(self, hidden_states: torch.Tensor):
        return all_to_all(hidden_states, self.ep_group, "ep", self.plan.a2a_input_splits(),
                          self.plan.a2a_output_splits())

    def combine_postprocess(self, hidden_states: torch.Tensor):
        self.plan = self.chunk_sizes = None
        return self._unpermute(hidden_states).view(self.hidden_shape)
