"""Parm's schedule S1: deduplicated, sequential."""

from __future__ import annotations

from typing import List, Optional

import torch
from megatron.core import utils

from megatron_parm.comm.collectives import start_all_gather, start_all_to_all, start_reduce_scatter
from megatron_parm.dispatchers import row_order
from megatron_parm.dispatchers.base import ParmTokenDispatcher, RoutingPlan
from megatron_parm.dispatchers.row_order import Message


class Route:
    """The collectives and the expert sort of one dispatch, for one layer call.

    ``gather``: A2A [EP] -> AG [ESP] (rows arrive as blocks [q][j][local expert]);
    ``scatter``: RS [ESP] -> A2A [EP] back, its dual. ``to_expert`` sorts gathered rows
    expert-major for the experts and ``from_expert`` undoes it (gather indices on the rows'
    device; None where the gathered order is already expert-major). Split sizes are host lists
    taken from the plan once; nothing here waits on the device.
    """

    def __init__(self, dispatcher: ParmTokenDispatcher, plan: RoutingPlan, device):
        self.ep_group, self.etp_group = dispatcher.ep_group, dispatcher.etp_group
        self.a2a_in, self.a2a_out = plan.a2a_input_splits(), plan.a2a_output_splits()
        self.etp_sizes = plan.etp_split_sizes()
        self.communicates = utils.get_pg_size(self.ep_group) > 1 or utils.get_pg_size(self.etp_group) > 1
        order = plan.expert_order()
        self.to_expert, self.from_expert = row_order.to_device(
            [order, None if order is None else row_order.inverse(order)], device)

    @property
    def trivial(self) -> bool:
        """Nothing to move and nothing to sort (every group of one rank)."""
        return not self.communicates and self.to_expert is None

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = start_all_to_all(tensor, self.ep_group, "ep", self.a2a_out, self.a2a_in).wait()
        return start_all_gather(tensor, self.etp_group, "expt_tp", self.etp_sizes).wait()

    def scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = start_reduce_scatter(tensor, self.etp_group, "expt_tp", self.etp_sizes).wait()
        return start_all_to_all(tensor, self.ep_group, "ep", self.a2a_in, self.a2a_out).wait()

    def sort(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.to_expert is None else tensor.index_select(0, self.to_expert)

    def unsort(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.from_expert is None else tensor.index_select(0, self.from_expert)


def _apart(first: torch.Tensor, second: torch.Tensor, move) -> List[torch.Tensor]:
    """Rows and probs in messages of their own (dtypes that cannot share one)."""
    return [move(first), move(second)]


class _Dispatch(torch.autograd.Function):
    """Rows and probs -> A2A [EP] -> AG [ESP] -> sorted for the experts, as one message.

    Forward: pack (one pass), the two collectives, sort (one gather); rows and probs come out
    as views of the sorted message. Backward: the two gradients packed with the unsort in
    the same pass, then RS [ESP] -> A2A [EP] back.
    """

    @staticmethod
    def forward(ctx, rows, probs, route: Route):
        ctx.route = route
        message = Message(rows.shape[1], rows.dtype, probs.dtype)
        if not message.packs:
            return tuple(_apart(rows, probs, lambda t: route.sort(route.gather(t))))
        return message.unpack(route.sort(route.gather(message.pack(rows, probs))))

    @staticmethod
    def backward(ctx, grad_rows, grad_probs):
        route = ctx.route
        if grad_probs is None:
            grad_probs = grad_rows.new_zeros(grad_rows.shape[0])
        message = Message(grad_rows.shape[1], grad_rows.dtype, grad_probs.dtype, summed=True)
        if not message.packs:
            grads = _apart(grad_rows, grad_probs, lambda t: route.scatter(route.unsort(t)))
        else:
            grads = message.unpack(route.scatter(message.pack(grad_rows, grad_probs,
                                                              order=route.from_expert)))
        return grads[0], grads[1], None


class _Combine(torch.autograd.Function):
    """Expert outputs -> unsorted (one gather) -> RS [ESP] -> A2A [EP] back; backward: the dual."""

    @staticmethod
    def forward(ctx, hidden_states, route: Route):
        ctx.route = route
        return route.scatter(route.unsort(hidden_states))

    @staticmethod
    def backward(ctx, grad):
        return ctx.route.sort(ctx.route.gather(grad.contiguous())), None


class ParmS1TokenDispatcher(ParmTokenDispatcher):
    """S1: every rank routes only its own n tokens; nothing is sent twice.

    Workflow (communication on the group in brackets):
    (1) dispatch_preprocess: permute this rank's n tokens by expert (k*n rows); exchange the
        E routing counts [ESP x EP]
    (2) token_dispatch: rows and probs packed into one message; A2A [EP]; AG [ESP]; sort by
        local expert (one autograd function: the backward packs both gradients with the
        unsort and runs RS [ESP] -> A2A [EP])
    (3) dispatch_postprocess: the tokens per local expert
    (4) experts (fc1 column- and fc2 row-split over ESP, partial sums out)
    (5) combine_preprocess: nothing (the unsort is part of (6))
    (6) token_combine: unsort; RS [ESP] of the partial sums; A2A [EP] back
    (7) combine_postprocess: unpermute to this rank's n tokens
    Where every group has one rank (e.g. world size 1), steps (2) and (6) do nothing at all:
    the layer costs what permutation, experts and unpermutation cost.
    When the layer input is replicated over TP (no sequence parallelism), ParmMoELayer
    hands this dispatcher the rank's shard and restores the full output with one AG [TP].
    """

    route: Optional[Route] = None

    def token_dispatch(self, rows: torch.Tensor, row_probs: torch.Tensor):
        self.route = Route(self, self.plan, rows.device)
        if self.route.trivial:
            return rows, row_probs
        return _Dispatch.apply(rows, row_probs, self.route)

    def dispatch_postprocess(self, rows: torch.Tensor, row_probs: torch.Tensor):
        return rows, self.plan.tokens_per_local_expert(), row_probs

    def combine_preprocess(self, hidden_states: torch.Tensor):
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor):
        route, self.route = self.route, None
        if route.trivial:
            return hidden_states
        return _Combine.apply(hidden_states, route)
