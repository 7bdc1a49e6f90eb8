"""Parm's schedule S1: deduplicated, sequential."""

from __future__ import annotations

import torch

from megatron_parm.comm.collectives import all_gather, all_to_all, reduce_scatter
from megatron_parm.dispatchers.base import ParmTokenDispatcher, pack_rows, unpack_rows


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
        return self._sort_for_experts(rows, row_probs)

    def combine_preprocess(self, hidden_states: torch.Tensor):
        return reduce_scatter(self._unsort_from_experts(hidden_states), self.etp_group, "expt_tp",
                              self.plan.etp_split_sizes())
