"""Megatron-Core's allgather dispatcher, run by `parm` as one of its candidates.

`--moe-token-dispatcher-type allgather` runs Megatron's MoEAllGatherTokenDispatcher inside
Megatron's MoELayer, untouched. `parm` runs the same class through the wrapper below, a
ParmTokenDispatcher like its other candidates: its phases are order-checked and, with
--moe-shared-expert-overlap, parm takes the shared experts' steps (base.py), which Megatron
allows with alltoall only. Inside ParmMoELayer it receives this rank's sequence shard also
without --sequence-parallel (the layer shards a TP-replicated input before routing and
gathers the output after), where Megatron's MoELayer refuses allgather.

Notation (as in docs/design.md): n tokens of this rank, M hidden, E experts, s ETP (ESP),
e EP; the ESP x EP group ("tp_ep", Megatron's tp_ep_group) has s * e ranks.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

from megatron_parm.dispatchers.base import ParmTokenDispatcher


def config_problem(config) -> Optional[str]:
    """Why Megatron-Core refuses its allgather dispatcher for this config (its
    TransformerConfig checks these by the dispatcher's name, and checks parm's layers as
    alltoall's), or None."""
    if getattr(config, "variable_seq_lengths", False):
        return ("Megatron-Core's allgather dispatcher does not take variable sequence lengths "
                "(--variable-seq-lengths): its all-gather needs as many tokens on every rank")
    if getattr(config, "moe_router_padding_for_quantization", False):
        return ("Megatron-Core's allgather dispatcher does not support "
                "--moe-router-padding-for-quantization")
    return None


class MegatronAllGatherTokenDispatcher(ParmTokenDispatcher):
    """allgather (Megatron-Core 0.16.1's MoEAllGatherTokenDispatcher), as parm runs it.

    Workflow (communication on the group in brackets), each phase Megatron's:
    (1) dispatch_preprocess: flatten the n tokens, keep the routing map
    (2) token_dispatch: AG [ESP x EP] of the routing map [n, E] (no gradient), of the
        probabilities [n, E] and of the tokens [n, M]: every rank holds its group's s*e*n
    (3) dispatch_postprocess: keep the pairs of the local experts, permute them by expert
    (4) experts (H / s each: partial sums over ESP)
    (5) combine_preprocess: unpermute into [s*e*n, M] (a token's local pairs summed)
    (6) token_combine: RS [ESP x EP], in the probabilities' dtype: each rank gets its own n
        tokens, summed over every rank's experts and the ESP partial sums
    (7) combine_postprocess: restore the input's shape
    Backward: the duals, RS [ESP x EP] of the tokens' and the probabilities' gradients and AG
    [ESP x EP] of the output's.
    """

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
        problem = config_problem(config)
        if problem:  # parm then leaves it out of its candidates, with one warning
            raise ValueError(problem)
        super().__init__(num_local_experts, local_expert_indices, config, pg_collection)
        self.megatron = MoEAllGatherTokenDispatcher(num_local_experts, self.local_expert_indices,
                                                    config=config, pg_collection=pg_collection)

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        return self.megatron.dispatch_preprocess(hidden_states, routing_map, probs)

    def token_dispatch(self, hidden_states, probs):
        return self.megatron.token_dispatch(hidden_states, probs)

    def dispatch_postprocess(self, hidden_states, probs):
        return self.megatron.dispatch_postprocess(hidden_states, probs)

    def combine_preprocess(self, hidden_states):
        return self.megatron.combine_preprocess(hidden_states)

    def token_combine(self, hidden_states):
        return self.megatron.token_combine(hidden_states)

    def combine_postprocess(self, hidden_states):
        return self.megatron.combine_postprocess(hidden_states)
