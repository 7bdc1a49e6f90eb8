"""A toy schedule that proves the catalog's promise: a schedule is one dispatcher file and
one catalog entry. This file is both; ``register_toy()`` adds the entry at run time.

toy_s1 moves S1's data (A2A [EP] -> AG [ESP] -> experts -> RS [ESP] -> A2A [EP]) but sends
the routing probabilities in messages of their own instead of packing them into the rows',
and, to have a layout rule to check, it refuses expert parallelism of one rank.
"""

from __future__ import annotations

from megatron_parm import schedules
from megatron_parm.comm.collectives import all_gather, all_to_all, reduce_scatter
from megatron_parm.dispatchers.base import ParmTokenDispatcher

NAME = "toy_s1"


class ToyTokenDispatcher(ParmTokenDispatcher):
    """toy_s1: S1 with the probabilities in messages of their own.

    Workflow (communication on the group in brackets):
    (1) dispatch_preprocess (the base's): permute by expert; exchange the counts [ESP x EP]
    (2) token_dispatch: A2A [EP] of the rows, then of the probs
    (3) dispatch_postprocess: AG [ESP] of rows, then of probs; sort by local expert
    (4) experts
    (5) combine_preprocess: unsort; RS [ESP]
    (6) token_combine (the base's): A2A [EP] back
    (7) combine_postprocess (the base's): unpermute
    """

    def token_dispatch(self, rows, probs):
        splits = (self.plan.a2a_output_splits(), self.plan.a2a_input_splits())
        return (all_to_all(rows, self.ep_group, "ep", *splits),
                all_to_all(probs, self.ep_group, "ep", *splits))

    def dispatch_postprocess(self, rows, probs):
        sizes = self.plan.etp_split_sizes()
        rows = all_gather(rows, self.etp_group, "expt_tp", sizes)
        probs = all_gather(probs, self.etp_group, "expt_tp", sizes)
        return self._sort_for_experts(rows, probs)

    def combine_preprocess(self, hidden_states):
        return reduce_scatter(self._unsort_from_experts(hidden_states), self.etp_group, "expt_tp",
                              self.plan.etp_split_sizes())


def _needs_expert_parallelism(tp: int, ep: int, etp: int):
    if ep > 1:
        return None
    return f"--moe-token-dispatcher-type {NAME} needs --expert-model-parallel-size > 1 (got {ep})"


TOY = schedules.Schedule(
    NAME, schedules.PARM, "a test's schedule: S1 with the probabilities sent on their own",
    dispatcher=f"{__name__}:ToyTokenDispatcher", candidate=True,
    layout_rule=_needs_expert_parallelism, cost_plan=schedules.deduplicated_cost)


def register_toy() -> schedules.Schedule:
    if NAME not in schedules.names():
        schedules.register(TOY)
    return TOY
