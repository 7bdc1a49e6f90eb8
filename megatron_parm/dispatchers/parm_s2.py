"""Parm's schedule S2: deduplicated and pipelined over c chunks.

The rows S1 would send are cut into c chunks (every (rank, expert) count split into c
near-equal parts). Each chunk flows through five stages:

    A: A2A [EP] -> B: AG [ESP] -> X: experts -> C: RS [ESP] -> D: A2A [EP] back

and the stages of neighbouring chunks run at the same time: while X works on chunk i,
the A2A of chunk i+1 (inter-node link) and the AG of chunk i (intra-node link) are in
flight, and D of chunk i-1 follows as soon as its RS lands. The backward pass runs the
same five-stage pipeline with the dual collectives (A2A, AG, expert backward, RS, A2A).

Collectives are asynchronous torch.distributed calls on the groups Megatron built; gloo
and NCCL both run collectives of different groups concurrently.

On GPUs (NCCL) every wait is a stream wait: ``Pending.wait`` calls ``work.wait()``, which
makes the current stream wait for the collective's stream and returns at once, so the host
keeps issuing chunk i+1's A2A [EP] while chunk i's AG/RS [ESP] (another communicator, another
stream) and its expert GEMMs are still queued. Nothing in the pipeline reads a device value
on the host (no .item(), .tolist(), .cpu() between chunks): every split size comes from the
host plan made before the first chunk, and the chunks' row indices are copied to the rows'
device once, up front. Tensors a collective reads or writes stay referenced by its Pending
until it is waited on (see megatron_parm.comm.collectives).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch

from megatron_parm import schedules
from megatron_parm.comm.collectives import Pending, start_all_gather, start_all_to_all, start_reduce_scatter
from megatron_parm.dispatchers.base import (
    ParmTokenDispatcher,
    RoutingPlan,
    can_pack,
    pack_rows,
    unpack_rows,
    chunk_row_indices,
    sort_by_local_expert,
    unsort_by_local_expert,
)

Tensors = Tuple[torch.Tensor, ...]
Stage = Callable[[int, Tensors], "PendingTuple"]


class PendingTuple:
    """Several in-flight collectives waited on together."""

    def __init__(self, *pendings: Pending):
        self.pendings = pendings

    def wait(self) -> Tensors:
        return tuple(p.wait() for p in self.pendings)


def run_pipeline(num_chunks: int, first: Callable[[int], PendingTuple], second: Stage,
                 compute: Callable[[int, Tensors], Tensors], third: Stage, fourth: Stage,
                 prefetch: int = 1) -> List[Tensors]:
    """Run num_chunks chunks through first -> second -> compute -> third -> fourth.

    first/fourth run on one group, second/third on another. ``prefetch`` first-stage
    collectives are kept in flight ahead of the chunk being worked on (1: chunk i+1's while
    chunk i is gathered and computed; more was no faster on the emulated cluster, since the
    first and fourth stages share one link). The order in which collectives are issued
    depends only on num_chunks and prefetch, so every rank issues them identically.
    """
    ahead = max(1, prefetch)
    in_first: Dict[int, PendingTuple] = {i: first(i) for i in range(min(ahead, num_chunks))}
    in_third: Dict[int, PendingTuple] = {}
    in_fourth: Dict[int, PendingTuple] = {}
    for i in range(num_chunks):
        in_second = second(i, in_first.pop(i).wait())
        if i + ahead < num_chunks:
            in_first[i + ahead] = first(i + ahead)  # overlaps second(i) and compute(i)
        if i >= 1:
            in_fourth[i - 1] = fourth(i - 1, in_third.pop(i - 1).wait())
        in_third[i] = third(i, compute(i, in_second.wait()))
    last = num_chunks - 1
    in_fourth[last] = fourth(last, in_third.pop(last).wait())
    return [in_fourth[i].wait() for i in range(num_chunks)]


class _ChunkedExperts:
    """The forward and backward pipelines of one S2 layer call."""

    def __init__(self, dispatcher: "ParmS2TokenDispatcher", plan: RoutingPlan, num_chunks: int,
                 expert_fn: Callable, device: torch.device):
        self.d = dispatcher
        self.num_chunks = num_chunks
        self.expert_fn = expert_fn
        self.plans = [plan.chunk(i, num_chunks) for i in range(num_chunks)]
        mine = plan.counts[plan.me_ep, plan.me_etp]
        # This rank's rows of each chunk, on the rows' device (index_select / index_copy_).
        self.rows = chunk_row_indices(mine, num_chunks, device)
        self.saved: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    # stage helpers: (chunk index, tensors) -> PendingTuple
    def _a2a_out(self, i: int, tensors: Tensors) -> PendingTuple:
        p = self.plans[i]
        return PendingTuple(*[start_all_to_all(t, self.d.ep_group, "ep", p.a2a_output_splits(),
                                               p.a2a_input_splits()) for t in tensors])

    def _a2a_back(self, i: int, tensors: Tensors) -> PendingTuple:
        p = self.plans[i]
        return PendingTuple(*[start_all_to_all(t, self.d.ep_group, "ep", p.a2a_input_splits(),
                                               p.a2a_output_splits()) for t in tensors])

    def _gather(self, i: int, tensors: Tensors) -> PendingTuple:
        sizes = self.plans[i].etp_split_sizes()
        return PendingTuple(*[start_all_gather(t, self.d.etp_group, "expt_tp", sizes) for t in tensors])

    def _scatter(self, i: int, tensors: Tensors) -> PendingTuple:
        sizes = self.plans[i].etp_split_sizes()
        return PendingTuple(*[start_reduce_scatter(t.contiguous(), self.d.etp_group, "expt_tp", sizes)
                              for t in tensors])

    def forward(self, rows: torch.Tensor, probs: torch.Tensor, build_graph: bool) -> torch.Tensor:
        # Probs ride in the rows' messages (pure data movement: any dtypes pack).
        hidden, probs_dtype = rows.shape[1], probs.dtype

        def first(i):
            idx = self.rows[i]
            return self._a2a_out(i, (pack_rows(rows.index_select(0, idx), probs.index_select(0, idx)),))

        def compute(i, gathered):
            chunk_rows, chunk_probs = unpack_rows(gathered[0], hidden, probs_dtype)
            plan = self.plans[i]
            sizes = plan.gathered_chunk_sizes()
            with torch.enable_grad() if build_graph else torch.no_grad():
                if build_graph:
                    chunk_rows = chunk_rows.detach().requires_grad_()
                    chunk_probs = chunk_probs.detach().requires_grad_()
                x, x_probs = sort_by_local_expert(chunk_rows, chunk_probs, sizes, self.d.num_local_experts)
                y, bias = self.expert_fn(x, plan.tokens_per_local_expert(), x_probs)
                assert bias is None, "expert bias is not supported by parm_s2"
                y = unsort_by_local_expert(y, sizes, self.d.num_local_experts)
            if build_graph:
                self.saved.append((chunk_rows, chunk_probs, y))
            return (y.detach(),)

        outputs = run_pipeline(self.num_chunks, first, self._gather, compute, self._scatter, self._a2a_back)
        out = rows.new_zeros(rows.shape)
        for idx, (chunk_out,) in zip(self.rows, outputs):
            out.index_copy_(0, idx, chunk_out)
        return out

    def backward(self, grad_out: torch.Tensor, rows_meta, probs_meta):
        def first(i):
            return self._a2a_out(i, (grad_out.index_select(0, self.rows[i]),))

        def compute(i, gathered):
            (grad_y,) = gathered
            chunk_rows, chunk_probs, y = self.saved[i]
            if y.requires_grad and y.numel() > 0:
                torch.autograd.backward(y, grad_y)
            grad_rows = chunk_rows.grad if chunk_rows.grad is not None else torch.zeros_like(chunk_rows)
            grad_probs = chunk_probs.grad if chunk_probs.grad is not None else torch.zeros_like(chunk_probs)
            self.saved[i] = None  # free the chunk's graph as soon as it is used
            # The RS sums: grads share a message only where their dtypes match.
            if can_pack(grad_rows, grad_probs, summed=True):
                return (pack_rows(grad_rows, grad_probs),)
            return grad_rows, grad_probs

        outputs = run_pipeline(self.num_chunks, first, self._gather, compute, self._scatter, self._a2a_back)
        grad_rows = torch.zeros(rows_meta[0], dtype=rows_meta[1], device=rows_meta[2])
        grad_probs = torch.zeros(probs_meta[0], dtype=probs_meta[1], device=probs_meta[2])
        for idx, chunk in zip(self.rows, outputs):
            g_rows, g_probs = unpack_rows(chunk[0], rows_meta[0][1], probs_meta[1]) if len(chunk) == 1 else chunk
            grad_rows.index_copy_(0, idx, g_rows)
            grad_probs.index_copy_(0, idx, g_probs)
        return grad_rows, grad_probs


class _PipelinedExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, probs, anchor, pipeline: _ChunkedExperts):
        ctx.pipeline = pipeline
        ctx.rows_meta = (rows.shape, rows.dtype, rows.device)
        ctx.probs_meta = (probs.shape, probs.dtype, probs.device)
        return pipeline.forward(rows, probs, build_graph=True)

    @staticmethod
    def backward(ctx, grad_out):
        grad_rows, grad_probs = ctx.pipeline.backward(grad_out.contiguous(), ctx.rows_meta,
                                                      ctx.probs_meta)
        ctx.pipeline = None
        return grad_rows, grad_probs, None, None


class ParmS2TokenDispatcher(ParmTokenDispatcher):
    """S2: S1's data, cut into c chunks that flow through a five-stage pipeline.

    Workflow (communication on the group in brackets):
    (1) dispatch_preprocess: permute this rank's n tokens by expert; exchange the E routing
        counts [ESP x EP]; cut every count into c parts
    (2)-(6) dispatch_compute_combine, per chunk, pipelined: A2A [EP] -> AG [ESP] -> experts
        -> RS [ESP] -> A2A [EP]; chunk i+1's A2A overlaps chunk i's AG and experts, chunk
        i-1's return A2A overlaps chunk i's experts
    (7) combine_postprocess: unpermute to this rank's n tokens
    ParmMoELayer calls dispatch_compute_combine in place of token_dispatch,
    dispatch_postprocess, the experts, combine_preprocess and token_combine.
    """

    pipelined = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_chunks = schedules.get("parm_s2").num_chunks(getattr(self.config, "parm_num_chunks", None))

    def dispatch_compute_combine(self, rows: torch.Tensor, row_probs: torch.Tensor,
                                 expert_fn: Callable) -> torch.Tensor:
        pipeline = _ChunkedExperts(self, self.plan, self.num_chunks, expert_fn, rows.device)
        self.plan = None
        if not torch.is_grad_enabled():
            return pipeline.forward(rows, row_probs, build_graph=False)
        # The anchor keeps the pipeline in the autograd graph even when rows and probs need
        # no grad: the expert weights inside it still do.
        anchor = rows.new_empty(0).requires_grad_()
        return _PipelinedExpertsFunction.apply(rows, row_probs, anchor, pipeline)

    # The six-phase entry points that S2 folds into dispatch_compute_combine.
    def token_dispatch(self, hidden_states, probs):
        raise RuntimeError("parm_s2 dispatches inside dispatch_compute_combine (see ParmMoELayer)")

    dispatch_postprocess = combine_preprocess = token_combine = token_dispatch