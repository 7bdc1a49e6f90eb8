"""Parm's schedule S1: deduplicated, sequential."""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import utils

from megatron_parm.comm.collectives import start_all_gather, start_all_to_all, start_reduce_scatter
from megatron_parm.dispatchers import row_order
from megatron_parm.dispatchers.base import ParmTokenDispatcher, RoutingPlan
from megatron_parm.dispatchers.row_order import Message


class Route:
    """The collectives and the expert sort of one dispatch, for one layer call.

    ``gather``: A2A [EP] -> AG [ESP] (rows arrive as blocks [q][j][local expert]);
    ``scatter``: RS [ESP] -> A2A [EP] back, its dual. Without ``with_ep`` the A2As are left
    out: a subclass that moves the rows over EP its own way (parm_hier) reuses the ESP stage.
    ``to_expert`` sorts gathered rows expert-major for the experts and ``from_expert`` undoes
    it (gather indices on the rows' device; None where the gathered order is already
    expert-major). Split sizes are host lists taken from the plan once; nothing here waits on
    the device.
    """

    def __init__(self, dispatcher: ParmTokenDispatcher, plan: RoutingPlan, device,
                 with_ep: bool = True):
        self.ep_group, self.etp_group = dispatcher.ep_group, dispatcher.etp_group
        self.with_ep = with_ep  # the A2As [EP] are this route's
        ep_moves = with_ep and utils.get_pg_size(self.ep_group) > 1
        self.a2a_in, self.a2a_out = plan.a2a_input_splits(), plan.a2a_output_splits()
        self.etp_sizes = plan.etp_split_sizes()
        self.communicates = ep_moves or utils.get_pg_size(self.etp_group) > 1
        order = plan.expert_order()
        self.to_expert, self.from_expert = row_order.to_device(
            [order, None if order is None else row_order.inverse(order)], device)

    @property
    def trivial(self) -> bool:
        """Nothing to move and nothing to sort (e.g. every group of one rank)."""
        return not self.communicates and self.to_expert is None

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.with_ep:
            tensor = start_all_to_all(tensor, self.ep_group, "ep", self.a2a_out, self.a2a_in).wait()
        return start_all_gather(tensor, self.etp_group, "expt_tp", self.etp_sizes).wait()

    def scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = start_reduce_scatter(tensor, self.etp_group, "expt_tp", self.etp_sizes).wait()
        if self.with_ep:
            tensor = start_all_to_all(tensor, self.ep_group, "ep", self.a2a_in, self.a2a_out).wait()
        return tensor

    def sort(self, tensor: torch.Tensor) -> torch.Tensor:
        return row_order.gather(tensor, self.to_expert)

    def unsort(self, tensor: torch.Tensor) -> torch.Tensor:
        return row_order.gather(tensor, self.from_expert)


class _Dispatch(torch.autograd.Function):
    """Rows and probs -> A2A [EP] -> AG [ESP] -> sorted for the experts, as one message.

    Forward: pack (one pass), the two collectives, sort and unpack (one gather); rows and
    probs come out contiguous. Backward: the two gradients packed with the unsort in
    the same pass, then RS [ESP] -> A2A [EP] back. Dtypes that cannot share a message
    travel in messages of their own. Without ``sort`` (the combined 1F1B's communication
    node: collectives only) the rows and probs come out as received, views of the message,
    and the backward packs the gradients as they come.
    """

    @staticmethod
    def forward(ctx, rows, probs, route: Route, sort: bool = True):
        ctx.route, ctx.sort = route, sort
        message = Message(rows.shape[1], rows.dtype, probs.dtype)
        if not message.packs:
            if not sort:
                return route.gather(rows), route.gather(probs)
            return route.sort(route.gather(rows)), route.sort(route.gather(probs))
        gathered = route.gather(message.pack(rows, probs))
        if not sort:
            return message.unpack(gathered)
        # sorted and unpacked in one gather: contiguous rows, as grouped GEMMs need
        return message.unpack_gathered(gathered, route.to_expert)

    @staticmethod
    def backward(ctx, grad_rows, grad_probs):
        route = ctx.route
        order = route.from_expert if ctx.sort else None
        if grad_probs is None:
            grad_probs = grad_rows.new_zeros(grad_rows.shape[0])
        message = Message(grad_rows.shape[1], grad_rows.dtype, grad_probs.dtype, summed=True)
        if not message.packs:
            return (route.scatter(row_order.gather(grad_rows, order)),
                    route.scatter(row_order.gather(grad_probs, order)), None, None)
        packed = message.pack(grad_rows, grad_probs, order=order)
        return (*message.unpack(route.scatter(packed)), None, None)


class _Combine(torch.autograd.Function):
    """Expert outputs -> unsorted (one gather) -> RS [ESP] -> A2A [EP] back; backward: the dual.
    Without ``unsort`` (the combined 1F1B's communication node) the collectives only."""

    @staticmethod
    def forward(ctx, hidden_states, route: Route, unsort: bool = True):
        ctx.route, ctx.unsort = route, unsort
        return route.scatter(route.unsort(hidden_states) if unsort else hidden_states)

    @staticmethod
    def backward(ctx, grad):
        gathered = ctx.route.gather(grad.contiguous())
        return (ctx.route.sort(gathered) if ctx.unsort else gathered), None, None


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
    A subclass that moves the rows over EP its own way overrides token_dispatch and
    token_combine; then (3) runs the ESP stage (AG [ESP], sort) and (5) its dual (unsort,
    RS [ESP]) as one autograd function each.
    As the combined 1F1B's nodes (``comm_nodes``), (2) and (6) run the collectives only:
    the sort moves to (3), which gathers the rows into tensors of their own, and the unsort
    to (5).
    parm_s2 derives from this class: called phase by phase, it runs these phases (S2 at one
    chunk is this dataflow).
    When the layer input is replicated over TP (no sequence parallelism), ParmMoELayer
    hands this dispatcher the rank's shard and restores the full output with one AG [TP].
    """

    s1_route: Optional[Route] = None  # this layer call's, from token_dispatch to token_combine

    @staticmethod
    def _dispatch(route: Route, rows: torch.Tensor, row_probs: torch.Tensor, sort: bool = True):
        return (rows, row_probs) if route.trivial else _Dispatch.apply(rows, row_probs, route, sort)

    @staticmethod
    def _combine(route: Route, hidden_states: torch.Tensor, unsort: bool = True) -> torch.Tensor:
        return hidden_states if route.trivial else _Combine.apply(hidden_states, route, unsort)

    def token_dispatch(self, rows: torch.Tensor, row_probs: torch.Tensor):
        self.s1_route = Route(self, self.plan, rows.device)
        return self._dispatch(self.s1_route, rows, row_probs, sort=not self.comm_nodes)

    def dispatch_postprocess(self, rows: torch.Tensor, row_probs: torch.Tensor):
        if self.s1_route is None:  # the rows came over EP another way: the ESP stage here
            self.s1_route = Route(self, self.plan, rows.device, with_ep=False)
            rows, row_probs = self._dispatch(self.s1_route, rows, row_probs)
        elif self.comm_nodes:  # token_dispatch left the rows as received: sort them here
            rows, row_probs = row_order.gather_new((rows, row_probs), self.s1_route.to_expert)
        return rows, self.plan.tokens_per_local_expert(), row_probs

    def combine_preprocess(self, hidden_states: torch.Tensor):
        if not self.s1_route.with_ep and not self.comm_nodes:
            route, self.s1_route = self.s1_route, None
            return self._combine(route, hidden_states)
        if self.comm_nodes:  # token_combine runs the collectives only
            return self.s1_route.unsort(hidden_states)
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor):
        route, self.s1_route = self.s1_route, None
        return self._combine(route, hidden_states, unsort=not self.comm_nodes)
