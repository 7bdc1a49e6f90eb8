"""parm_hier_s2: parm_hier's dataflow pipelined over chunks of the tokens.

Notation (as in docs/design.md and parm_hier.py): n tokens this rank routes, c chunks, K
nodes of the EP group, g EP ranks of it per node, L local experts, s the ESP size, M the
hidden size. Chunk i is the tokens [ceil(n*i/c), ceil(n*(i+1)/c)) of every rank (a token t
is in chunk floor(t*c/n)); each chunk is deduplicated by itself (one row per token and
destination node, its further experts there as secondary pairs), so the bytes of all chunks
together are parm_hier's, each (token, node) row exactly once. A chunk flows through

    A: A2A [ep_inter] (rows, probabilities, secondary pairs to the relays)
       -> relay expands to one row per pair -> A2A [ep_intra] -> AG [ESP]
    X: experts
    C: RS [ESP] -> A2A [ep_intra] back -> relay sums per (token, node)
    D: A2A [ep_inter] back

and while chunk i fans out inside the node, is computed and is combined (the intra-node
link and the compute), the inter-node A2A of chunk i+1 and the return of chunk i-1 are in
flight on the inter-node link: what S2 does for S1's stages, here for the hierarchical
ones. The backward pass runs the duals in the same chunks (one chunk count for both passes:
a backward cut of its own would need each forward chunk's relay plan split again).

Everything the collectives need is host data, from one exchange of every rank's counts per
chunk ([c, 2, E] integers per rank instead of parm_hier's [2, E]) in dispatch_preprocess;
the relay's expansion of a chunk needs the row indices its secondary pairs carry, known when
the chunk's A has landed. Called phase by phase (Megatron-Core's callers, the combined
1F1B's nodes) it runs parm_hier's phases, as one chunk: those are this schedule at c = 1.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch

from megatron_parm import schedules
from megatron_parm.comm.collectives import (start_all_gather, start_all_to_all,
                                            start_reduce_scatter)
from megatron_parm.config import parm_setting
from megatron_parm.dispatchers import row_order
from megatron_parm.dispatchers.parm_hier import (Messages, NodePlan, ParmHierTokenDispatcher,
                                                 relay_order)
from megatron_parm.dispatchers.parm_s2 import PendingTuple, run_pipeline
from megatron_parm.dispatchers.row_order import Message


@dataclass
class HierChunk:
    """One chunk's plan: its split sizes (``node``), where its rows and secondary pairs lie
    in the source's chunk-major order, its ESP stage (split sizes, the experts' sort on the
    rows' device) and, once its rows reached the relay, the relay's expansion."""

    node: NodePlan
    rows: slice
    secondaries: slice
    etp_sizes: List[int]
    tokens: torch.Tensor  # [L] rows per local expert (host)
    to_expert: Optional[torch.Tensor] = None
    from_expert: Optional[torch.Tensor] = None
    pair_row: Optional[torch.Tensor] = None  # relay: the received row of each sorted pair
    order: Optional[torch.Tensor] = None  # relay: cat(row probs, secondary probs) -> pair order
    messages: Optional[Messages] = None  # the latest A2A [ep_inter]'s, to unpack what arrives


def plan_chunks(counts_by_part: torch.Tensor, groups, me_ep: int, me_etp: int,
                num_local_experts: int, device) -> List[HierChunk]:
    """Every chunk's plan from the gathered counts [e, s, c, 2, E] (host); the experts' sort
    indices of all chunks copied to ``device`` in one transfer."""
    chunks, offsets = [], [0, 0]
    for i in range(counts_by_part.shape[2]):
        node = NodePlan(counts_by_part[:, :, i], groups, me_ep, me_etp, num_local_experts)
        rows = slice(offsets[0], offsets[0] + node.sent_rows)
        secondaries = slice(offsets[1], offsets[1] + node.sent_secondaries)
        offsets = [rows.stop, secondaries.stop]
        chunks.append(HierChunk(node, rows, secondaries, node.member.etp_split_sizes(),
                                node.member.tokens_per_local_expert()))
    host = []
    for chunk in chunks:
        order = chunk.node.member.expert_order()
        host += [order, None if order is None else row_order.inverse(order)]
    moved = iter(row_order.to_device(host, device))
    for chunk in chunks:
        chunk.to_expert, chunk.from_expert = next(moved), next(moved)
    return chunks


class _HierPipeline:
    """The forward and backward pipelines of one parm_hier_s2 layer call."""

    def __init__(self, dispatcher: "ParmHierS2TokenDispatcher", chunks: List[HierChunk],
                 expert_fn: Callable, secondary_rows: torch.Tensor):
        self.groups, self.etp_group = dispatcher.groups, dispatcher.etp_group
        self.chunks, self.expert_fn = chunks, expert_fn
        self.secondary_rows = secondary_rows  # chunk-major, each within its (chunk, node) block
        self.with_secondaries = dispatcher.has_secondaries
        self.num_local_experts = dispatcher.num_local_experts
        self.saved = {}  # chunk -> (rows, probs) the experts saw and their output
        self.deferred = None  # TorchGroupedMLP's deferred weight gradients (as S2's)

    # -- between the source and the relay (A, D and their duals) ------------------------

    def _inter(self, chunk: HierChunk, tensors: Sequence[torch.Tensor], back: bool) -> PendingTuple:
        """A2A [ep_inter] of a chunk's rows, probabilities and secondary pairs (one message
        per dtype): source -> relays, or relays -> sources where ``back``."""
        node = chunk.node
        sent = [node.rows_out, node.rows_out, node.secondaries_out]
        received = [node.rows_in, node.rows_in, node.secondaries_in]
        if back:
            sent, received = received, sent
        messages = Messages(tensors, sent[:len(tensors)], received[:len(tensors)])
        packed = messages.pack(tensors)
        chunk.messages = messages
        return PendingTuple(*[start_all_to_all(flat, self.groups.inter, "ep_inter", recv, send)
                              for flat, send, recv in packed], keep=[p[0] for p in packed])

    def _fan_out(self, chunk: HierChunk, tensors: Sequence[torch.Tensor], back: bool):
        """A2A [ep_intra] between the relay and its node's members (waited on): relay ->
        members, or members -> relay where ``back``."""
        node = chunk.node
        out_splits, in_splits = ((node.pairs_out, node.pairs_in) if back
                                 else (node.pairs_in, node.pairs_out))
        pending = [start_all_to_all(t, self.groups.intra, "ep_intra", out_splits, in_splits)
                   for t in tensors]
        return tuple(p.wait() for p in pending)

    def _esp(self, chunk: HierChunk, tensors: Sequence[torch.Tensor], gather: bool) -> PendingTuple:
        start = start_all_gather if gather else start_reduce_scatter
        return PendingTuple(*[start(t, self.etp_group, "expt_tp", chunk.etp_sizes)
                              for t in tensors], keep=tensors)

    # -- forward ------------------------------------------------------------------------

    def forward(self, rows: torch.Tensor, row_probs: torch.Tensor, secondary_probs: torch.Tensor,
                build_graph: bool) -> torch.Tensor:
        """Chunk-major rows (one per token and node), their probabilities and the secondary
        pairs' probabilities in; each row's node-local sum of its expert outputs out."""
        meta_dtype = torch.promote_types(row_probs.dtype, torch.float32)  # row indices exact
        secondaries = torch.stack([secondary_probs.to(meta_dtype),
                                   self.secondary_rows.to(meta_dtype)], dim=1)
        hidden = rows.shape[1]
        message = Message(hidden, rows.dtype, row_probs.dtype)
        out = rows.new_empty(rows.shape)
        chunks = self.chunks

        def first(i: int) -> PendingTuple:
            chunk = chunks[i]
            tensors = [rows[chunk.rows], row_probs[chunk.rows].unsqueeze(1)]
            if self.with_secondaries:
                tensors.append(secondaries[chunk.secondaries])
            return self._inter(chunk, tensors, back=False)

        def second(i: int, flats) -> PendingTuple:
            # the relay: one row per pair, sorted [member][source node][local expert]
            chunk = chunks[i]
            got = chunk.messages.unpack(flats)
            relayed, relayed_probs = got[0], got[1].squeeze(1)
            pairs = got[2] if self.with_secondaries else secondaries[:0]
            chunk.pair_row, chunk.order = relay_order(
                *chunk.node.relay_counts(), pairs[:, 1], self.num_local_experts, rows.device)
            pair_probs = torch.cat([relayed_probs, pairs[:, 0].to(relayed_probs.dtype)])[chunk.order]
            if message.packs:
                tensors = (message.pack(relayed, pair_probs, order=chunk.pair_row,
                                        probs_in_order=True),)
            else:
                tensors = (relayed.index_select(0, chunk.pair_row), pair_probs)
            return self._esp(chunk, self._fan_out(chunk, tensors, back=False), gather=True)

        def compute(i: int, gathered) -> tuple:
            chunk = chunks[i]
            if message.packs:
                x, x_probs = message.unpack_gathered(gathered[0], chunk.to_expert)
            else:
                x, x_probs = row_order.gather_contiguous(gathered, chunk.to_expert)
            with torch.enable_grad() if build_graph else torch.no_grad():
                if build_graph:
                    x = x.detach().requires_grad_()
                    x_probs = x_probs.detach().requires_grad_()
                y, bias = self.expert_fn(x, chunk.tokens, x_probs)
            assert bias is None, "expert bias is not supported by parm_hier_s2"
            if build_graph:
                self.saved[i] = (x, x_probs, y)
            return (row_order.gather(y.detach(), chunk.from_expert),)

        def third(i: int, outputs) -> PendingTuple:
            return self._esp(chunks[i], outputs, gather=False)

        def fourth(i: int, summed) -> PendingTuple:
            chunk = chunks[i]
            (pairs,) = self._fan_out(chunk, summed, back=True)
            node_rows = pairs.new_zeros((chunk.node.relay_rows, hidden)).index_add(
                0, chunk.pair_row, pairs)
            node = chunk.node
            return PendingTuple(start_all_to_all(node_rows, self.groups.inter, "ep_inter",
                                                 node.rows_out, node.rows_in, out=out[chunk.rows]),
                                keep=(node_rows,))

        defer = getattr(self.expert_fn, "deferring_weight_grads", None) if build_graph else None
        with defer() if defer is not None else contextlib.nullcontext() as deferred:
            run_pipeline(len(chunks), first, second, compute, third, fourth, early_prefetch=True)
        self.deferred = deferred
        return out

    # -- backward -----------------------------------------------------------------------

    def backward(self, grad_out: torch.Tensor, probs_dtype: torch.dtype):
        """The output's gradient (chunk-major) in; the gradients of the rows, their
        probabilities and the secondary pairs' probabilities out (chunk-major)."""
        chunks, hidden = self.chunks, grad_out.shape[1]
        meta_dtype = torch.promote_types(probs_dtype, torch.float32)
        message = Message(hidden, grad_out.dtype, probs_dtype, summed=True)

        def first(i: int) -> PendingTuple:
            chunk, node = chunks[i], chunks[i].node
            part = grad_out[chunk.rows]
            return PendingTuple(start_all_to_all(part, self.groups.inter, "ep_inter",
                                                 node.rows_in, node.rows_out), keep=(part,))

        def second(i: int, arrived) -> PendingTuple:
            chunk = chunks[i]
            pairs = (arrived[0].index_select(0, chunk.pair_row),)
            return self._esp(chunk, self._fan_out(chunk, pairs, back=False), gather=True)

        def compute(i: int, gathered) -> tuple:
            chunk = chunks[i]
            grad_y = row_order.gather(gathered[0], chunk.to_expert)
            x, x_probs, y = self.saved.pop(i)  # freed once used
            if y.requires_grad:  # empty too: the expert weights' (zero) gradient, as in S2
                torch.autograd.backward([y], [grad_y])
            grad_x = x.grad if x.grad is not None else torch.zeros_like(x)
            grad_p = x_probs.grad if x_probs.grad is not None else torch.zeros_like(x_probs)
            if message.packs:  # one pass: packing and unsorting
                return (message.pack(grad_x, grad_p, order=chunk.from_expert),)
            return (row_order.gather(grad_x, chunk.from_expert),
                    row_order.gather(grad_p, chunk.from_expert))

        def third(i: int, grads) -> PendingTuple:
            return self._esp(chunks[i], grads, gather=False)

        def fourth(i: int, summed) -> PendingTuple:
            chunk, node = chunks[i], chunks[i].node
            back = self._fan_out(chunk, summed, back=True)
            grad_pairs, grad_pair_probs = message.unpack(back[0]) if message.packs else back
            grad_rows = grad_pairs.new_zeros((node.relay_rows, hidden)).index_add(
                0, chunk.pair_row, grad_pairs)
            grad_probs = grad_pair_probs.new_empty(grad_pair_probs.shape).index_copy(
                0, chunk.order, grad_pair_probs)
            grad_row_probs, grad_secondaries = grad_probs.split(
                [node.relay_rows, grad_probs.shape[0] - node.relay_rows])
            tensors = [grad_rows, grad_row_probs.unsqueeze(1)]
            if self.with_secondaries:  # the row indices' column carries no gradient
                tensors.append(torch.stack([grad_secondaries.to(meta_dtype),
                                            grad_secondaries.new_zeros(
                                                grad_secondaries.shape, dtype=meta_dtype)], dim=1))
            return self._inter(chunk, tensors, back=True)

        deferred, self.deferred = self.deferred, None
        arrived = run_pipeline(len(chunks), first, second, compute, third, fourth,
                               drain=deferred.backward_dw if deferred is not None else None,
                               early_prefetch=True)
        grads = [chunk.messages.unpack(flats) for chunk, flats in zip(chunks, arrived)]
        grad_rows = torch.cat([g[0] for g in grads])
        grad_row_probs = torch.cat([g[1].squeeze(1) for g in grads]).to(probs_dtype)
        if self.with_secondaries:
            grad_secondary_probs = torch.cat([g[2][:, 0] for g in grads]).to(probs_dtype)
        else:
            grad_secondary_probs = grad_row_probs.new_zeros(0)
        return grad_rows, grad_row_probs, grad_secondary_probs


class _HierPipelineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, row_probs, secondary_probs, anchor, pipeline: _HierPipeline):
        ctx.pipeline, ctx.probs_dtype = pipeline, row_probs.dtype
        return pipeline.forward(rows, row_probs, secondary_probs, build_graph=True)

    @staticmethod
    def backward(ctx, grad_out):
        grads = ctx.pipeline.backward(grad_out.contiguous(), ctx.probs_dtype)
        ctx.pipeline = None
        return (*grads, None, None)


class ParmHierS2TokenDispatcher(ParmHierTokenDispatcher):
    """parm_hier_s2: parm_hier's rows, in chunks of the tokens, through a pipeline that keeps
    the inter-node link busy while the node fans out, computes and combines.

    Workflow (communication on the group in brackets), as ParmMoELayer runs it (the
    catalog's ``pipelined``):
    (1) dispatch_preprocess: parm_hier's (one row per token and node, secondary pairs);
        exchange the counts of every chunk [ESP x EP]
    (2)-(6) dispatch_compute_combine: plan every chunk (split sizes, the relays' and the
        experts' sorts; host); put the rows and secondary pairs in chunk order (one gather
        each); then per chunk, pipelined: A2A [ep_inter] -> relay expands -> A2A [ep_intra]
        -> AG [ESP] -> experts -> RS [ESP] -> A2A [ep_intra] -> relay sums -> A2A [ep_inter];
        chunk i+1's A2A [ep_inter] is issued as soon as chunk i's has landed and runs while
        chunk i is fanned out, computed and combined, as does chunk i-1's return. The
        backward runs the same pipeline of the duals, in the same chunks.
    (7) combine_postprocess: add the node partial sums of each token (in chunk order)
    Phase by phase (Megatron-Core's callers, the combined 1F1B's nodes) it runs parm_hier's
    phases: one chunk. --parm-num-chunks applies to the pipelined call only; the backward
    runs in the forward's chunks (--parm-bwd-num-chunks is S2's alone).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_chunks, self.bwd_num_chunks = schedules.get("parm_hier_s2").chunk_counts(
            parm_setting(self.config, "parm_num_chunks"))

    def _routing_counts(self, routing_map: torch.Tensor, primary: torch.Tensor) -> torch.Tensor:
        """[c, 2, E]: each chunk's pairs and primary rows per expert."""
        n, c = routing_map.shape[0], self.num_chunks
        bounds = [-(-n * i // c) for i in range(c + 1)]  # ceil(n * i / c)
        return torch.stack([torch.stack([routing_map[lo:hi].sum(dim=0), primary[lo:hi].sum(dim=0)])
                            for lo, hi in zip(bounds[:-1], bounds[1:])]).long()

    def dispatch_compute_combine(self, rows: torch.Tensor, probs: torch.Tensor,
                                 expert_fn: Callable) -> torch.Tensor:
        by_chunk = self.counts_by_part
        if self.num_chunks != by_chunk.shape[2]:  # parm's fallback after a failed call: one
            by_chunk = self.counts.unsqueeze(2)
        chunks = plan_chunks(by_chunk, self.groups, self.ep_rank, self.etp_rank,
                             self.num_local_experts, rows.device)
        row_probs, secondary_probs = probs.split([rows.shape[0], probs.shape[0] - rows.shape[0]])
        rows_order, secondaries_order, secondary_rows = self._chunk_major(len(chunks))
        if rows_order is not None:  # the output comes back in chunk order
            rows, row_probs = rows.index_select(0, rows_order), row_probs.index_select(0, rows_order)
            secondary_probs = secondary_probs.index_select(0, secondaries_order)
        pipeline = _HierPipeline(self, chunks, expert_fn, secondary_rows)
        if not torch.is_grad_enabled():
            out = pipeline.forward(rows, row_probs, secondary_probs, build_graph=False)
        else:
            # The anchor keeps the pipeline in the autograd graph even when nothing else
            # needs a gradient: the expert weights inside it still do.
            anchor = rows.new_empty(0).requires_grad_()
            out = _HierPipelineFunction.apply(rows, row_probs, secondary_probs, anchor, pipeline)
        # the call's state changes only once it has run (a failed call may run again)
        if rows_order is not None:
            self._row_token = self._row_token.index_select(0, rows_order)
        self.plan = self._secondary_rows = None
        return out

    def _chunk_major(self, num_chunks: int):
        """(rows' order, secondary pairs' order, the secondary pairs' row indices) that take
        dispatch_preprocess's node-major rows [node][expert][token] to chunk-major ones
        [chunk][node][expert][token] (None orders where one chunk), each secondary pair
        naming its row within its (chunk, node) block (device, no host wait)."""
        secondary_rows = self._secondary_rows
        if num_chunks == 1:
            return None, None, secondary_rows
        n, K = self.hidden_shape[:-1].numel(), self.groups.nodes
        mine = self.counts_by_part[self.ep_rank, self.etp_rank, :, 1]  # [c, E] primary rows
        per_block = mine.view(num_chunks, K, -1).sum(dim=-1)  # [c, K]: rows per (chunk, node)
        per_node = per_block.sum(dim=0)
        block_start, node_start = row_order.to_device(
            [_starts(per_block.reshape(-1)), _starts(per_node)], self._row_token.device)
        block = (self._row_token * num_chunks // n) * K + self._row_node
        rows_order = torch.argsort(block, stable=True)
        position = torch.empty_like(rows_order)
        position[rows_order] = torch.arange(rows_order.numel(), device=rows_order.device)
        within_block = position - block_start[block]  # as the relay counts a chunk's rows
        secondary_block = (self._secondary_token * num_chunks // n) * K + self._secondary_node
        secondaries_order = torch.argsort(secondary_block, stable=True)
        old_row = node_start[self._secondary_node] + secondary_rows  # node-major position
        return rows_order, secondaries_order, within_block[old_row].index_select(0, secondaries_order)


def _starts(sizes: torch.Tensor) -> torch.Tensor:
    """Where each of consecutive blocks of these sizes starts (host)."""
    return torch.cumsum(sizes, 0) - sizes
