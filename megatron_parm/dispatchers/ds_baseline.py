"""DeepSpeed-MoE's MP+EP+ESP dataflow, Parm's baseline."""

from __future__ import annotations

import torch

from megatron.core import utils

from megatron_parm.comm.collectives import all_gather, all_reduce, all_to_all, start_all_gather
from megatron_parm.dispatchers.base import ParmTokenDispatcher, RoutingPlan


class DSBaselineTokenDispatcher(ParmTokenDispatcher):
    """ds_baseline: every TP rank holds and dispatches all N = t*n tokens of its TP group.

    Workflow (communication on the group in brackets):
    (1) dispatch_preprocess: flatten this rank's n tokens
    (2) token_dispatch: AG [TP] of tokens, probs and routing map, so every TP rank holds
        all N tokens as after DeepSpeed's attention all-reduce; permute the N tokens by
        expert; exchange the E counts [EP]; A2A [EP] of the duplicated dispatch tensor
        (each token leaves its TP group t times)
    (3) dispatch_postprocess: sort by local expert; the ranks of an ESP group now hold
        identical rows
    (4) experts: fc1 column-split, fc2 row-split over ESP (partial sums out)
    (5) combine_preprocess: unsort; AR [ESP] of the partial sums
    (6) token_combine: A2A [EP] back
    (7) combine_postprocess: unpermute the N tokens and keep this rank's n
    As the combined 1F1B's nodes (``comm_nodes``), (2)'s AG [TP] and permutation move to (1)
    (with the other TP collectives, on the compute stream) and (2) keeps the EP ones.

    The gate runs on each rank's own n tokens (Megatron's router, so the aux loss keeps
    its definition) and its decisions travel with the AG; DeepSpeed instead recomputes
    the gate on all N tokens on every TP rank, which adds compute but no communication.
    Requires ESP groups inside TP groups (ETP divides TP): only then do ESP peers hold
    the same tokens, which is what lets DeepSpeed close the experts with an all-reduce
    (the catalog's layout rule for ds_baseline, checked by ParmMoELayer).
    """

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
        super().__init__(num_local_experts, local_expert_indices, config, pg_collection)
        self.attn_tp_rank = utils.get_pg_rank(self.attn_tp_group)

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor,
                            probs: torch.Tensor):
        self.hidden_shape = hidden_states.shape
        tokens = hidden_states.view(-1, self.hidden_shape[-1])
        if not self.comm_nodes:
            self.routing_map = routing_map
            return tokens, probs
        # As the combined 1F1B's nodes, the AG [TP] and the permutation run here, with the
        # compute stream's other TP collectives; token_dispatch keeps the EP ones.
        return self._gather_and_permute(tokens, probs, routing_map)

    def _gather_and_permute(self, tokens: torch.Tensor, probs: torch.Tensor,
                            routing_map: torch.Tensor):
        """(2)'s AG [TP] of tokens, probs and routing map; the N tokens permuted by expert."""
        self.num_local_tokens = tokens.shape[0]
        tokens = all_gather(tokens, self.attn_tp_group, "tp")
        probs = all_gather(probs, self.attn_tp_group, "tp")
        routing_map = start_all_gather(routing_map.to(torch.uint8), self.attn_tp_group,
                                       "tp_routing").wait().bool()
        rows, row_probs, self.counts = self._permute(
            tokens, routing_map, probs, num_routers=utils.get_pg_size(self.attn_tp_group))
        return rows, row_probs

    def token_dispatch(self, tokens: torch.Tensor, probs: torch.Tensor):
        if self.comm_nodes:
            rows, row_probs = tokens, probs
        else:
            rows, row_probs = self._gather_and_permute(tokens, probs, self.routing_map)
            self.routing_map = None
        all_counts = self._exchange_counts(self.counts, self.ep_group, "ep_counts", 1)
        self.plan = RoutingPlan(all_counts, self.ep_rank, 0, self.num_local_experts)
        out_splits, in_splits = self.plan.a2a_output_splits(), self.plan.a2a_input_splits()
        rows = all_to_all(rows, self.ep_group, "ep", out_splits, in_splits)
        row_probs = all_to_all(row_probs, self.ep_group, "ep", out_splits, in_splits)
        return rows, row_probs

    def dispatch_postprocess(self, rows: torch.Tensor, row_probs: torch.Tensor):
        return self._sort_for_experts(rows, row_probs, new_storage=self.comm_nodes)

    def combine_preprocess(self, hidden_states: torch.Tensor):
        return all_reduce(self._unsort_from_experts(hidden_states), self.etp_group, "expt_tp")

    def combine_postprocess(self, hidden_states: torch.Tensor):
        self.plan = self.chunk_sizes = None
        tokens = self._unpermute(hidden_states)
        start = self.attn_tp_rank * self.num_local_tokens
        return tokens[start : start + self.num_local_tokens].view(self.hidden_shape)
