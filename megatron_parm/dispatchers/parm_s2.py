"""Parm's schedule S2: deduplicated and pipelined over chunks.

The rows S1 would send are cut into c chunks (every (rank, expert) count split into c
near-equal parts, docs/design.md). Each chunk flows through five stages:

    A: A2A [EP] -> B: AG [ESP] -> X: experts -> C: RS [ESP] -> D: A2A [EP] back

and the stages of neighbouring chunks run at the same time: while X works on chunk i,
the A2A of chunk i+1 (inter-node link) and the AG of chunk i (intra-node link) are in
flight, and D of chunk i-1 follows as soon as its RS lands. The backward pass runs the
same five-stage pipeline with the dual collectives (A2A, AG, expert backward, RS, A2A), in
its own number of chunks (--parm-bwd-num-chunks; the backward has twice the compute per
row, so its best count can differ).

What a chunk costs beyond its collectives is kept small: everything that depends only on
the routing counts (split sizes, the rows of every chunk, the sorts for the experts) is
computed once per layer call on the host with whole-array operations (dispatchers/row_order.py)
and its indices are copied to the rows' device in one transfer. The rows are put in chunk
order and packed with their probabilities in one pass, so a chunk's message is a slice;
returning chunks land in slices of one output (the unpermutation takes the chunk order
as it is). Expert graphs are built per sub-chunk (the finer cut both pipelines share: lcm of
the two counts, i.e. the larger count when one divides the other) and each backward chunk
runs the expert backward of its sub-chunks in one call.

Collectives are asynchronous torch.distributed calls on the groups Megatron built; gloo
and NCCL both run collectives of different groups concurrently.

On GPUs (NCCL) every wait is a stream wait: ``Pending.wait`` calls ``work.wait()``, which
makes the current stream wait for the collective's stream and returns at once, so the host
keeps issuing chunk i+1's A2A [EP] while chunk i's AG/RS [ESP] (another communicator, another
stream) and its expert GEMMs are still queued. Nothing in the pipeline reads a device value
on the host (no .item(), .tolist(), .cpu() between chunks): every split size comes from the
host plan made before the first chunk, and its indices are copied to the rows' device once,
up front. Tensors a collective reads or writes stay referenced until it is waited on (by its
Pending, see megatron_parm.comm.collectives, and by the stage's PendingTuple).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_parm import schedules
from megatron_parm.config import parm_setting
from megatron_parm.comm.collectives import Pending, start_all_gather, start_all_to_all, start_reduce_scatter
from megatron_parm.dispatchers import row_order
from megatron_parm.dispatchers.base import RoutingPlan
from megatron_parm.dispatchers.parm_s1 import ParmS1TokenDispatcher
from megatron_parm.dispatchers.row_order import Message

Tensors = Tuple[torch.Tensor, ...]
Stage = Callable[[int, Tensors], "PendingTuple"]


class PendingTuple:
    """Several in-flight collectives waited on together; ``keep`` holds their inputs until then."""

    def __init__(self, *pendings: Pending, keep: Sequence[torch.Tensor] = ()):
        self.pendings = pendings
        self.keep = tuple(keep)

    def wait(self) -> Tensors:
        out = tuple(p.wait() for p in self.pendings)
        self.keep = ()
        return out


def run_pipeline(num_chunks: int, first: Callable[[int], PendingTuple], second: Stage,
                 compute: Callable[[int, Tensors], Tensors], third: Stage, fourth: Stage,
                 prefetch: int = 1, drain: Optional[Callable[[], None]] = None,
                 early_prefetch: bool = False) -> List[Tensors]:
    """Run num_chunks chunks through first -> second -> compute -> third -> fourth.

    first/fourth run on one group, second/third on another. ``prefetch`` first-stage
    collectives are kept in flight ahead of the chunk being worked on (1: chunk i+1's while
    chunk i is gathered and computed; more was no faster on the emulated cluster, since the
    first and fourth stages share one link). The order in which collectives are issued
    depends only on num_chunks and prefetch, so every rank issues them identically.
    ``drain``, if given, runs after the last chunk's compute, while its third and fourth
    stages are in flight (work that needs every chunk's compute and no collective).
    ``early_prefetch``: the next first-stage collective starts as soon as chunk i's first
    stage has landed, before chunk i's second stage (for second and fourth stages that wait
    on collectives of their own: parm_hier_s2's fan-out inside the node).
    """
    ahead = max(1, prefetch)
    in_first: Dict[int, PendingTuple] = {i: first(i) for i in range(min(ahead, num_chunks))}
    in_third: Dict[int, PendingTuple] = {}
    in_fourth: Dict[int, PendingTuple] = {}
    for i in range(num_chunks):
        arrived = in_first.pop(i).wait()
        if early_prefetch and i + ahead < num_chunks:
            in_first[i + ahead] = first(i + ahead)  # overlaps second(i) too
        in_second = second(i, arrived)
        if not early_prefetch and i + ahead < num_chunks:
            in_first[i + ahead] = first(i + ahead)  # overlaps second(i) and compute(i)
        if i >= 1:
            in_fourth[i - 1] = fourth(i - 1, in_third.pop(i - 1).wait())
        in_third[i] = third(i, compute(i, in_second.wait()))
    last = num_chunks - 1
    if drain is not None:
        drain()
    in_fourth[last] = fourth(last, in_third.pop(last).wait())
    return [in_fourth[i].wait() for i in range(num_chunks)]


@dataclass
class Direction:
    """How one pass (forward or backward) cuts the layer into chunks; host data, except the
    index tensors once ``ChunkPlan`` has moved them to the rows' device.

    At the rank that owns the rows (origin), chunk i is rows [offsets[i], offsets[i+1]) of
    the chunk-major order, ``order`` gathering it from the expert order of the permutation
    (None: the same order). At the experts, chunk i arrives as blocks [q][j][local expert];
    ``sort[i]`` gathers it into its sub-chunks, each expert-major ([local expert][q][j]),
    and ``unsort[i]`` undoes that (None where nothing moves).
    """

    num_chunks: int
    offsets: List[int]
    a2a_in: List[List[int]]  # [chunk][EP peer]: rows sent
    a2a_out: List[List[int]]  # [chunk][EP peer]: rows received
    etp_sizes: List[List[int]]  # [chunk][ESP peer]: the AG/RS split sizes
    sub_rows: List[List[int]]  # [chunk][its sub-chunks]: rows of each
    first_sub: List[int]  # [chunk]: global index of its first sub-chunk
    order: Optional[torch.Tensor]
    sort: List[Optional[torch.Tensor]]
    unsort: List[Optional[torch.Tensor]]

    def rows(self, i: int) -> slice:
        return slice(self.offsets[i], self.offsets[i + 1])


def plan_direction(plan: RoutingPlan, num_chunks: int, num_subs: int) -> Direction:
    """The chunking of one pass: num_chunks chunks of num_subs // num_chunks sub-chunks each."""
    c, g = num_chunks, num_subs
    per_chunk = g // c
    mine = plan.mine()  # [E]
    bounds = row_order.cut_bounds(mine, c)  # [c + 1, E]
    parts = bounds.diff(dim=0)  # [c, E]
    order = row_order.ranges(row_order.block_starts(mine) + bounds[:-1], parts)
    sizes = parts.sum(dim=1)
    offsets = [0] + torch.cumsum(sizes, 0).tolist()

    local = plan.local_counts()  # [s, e, L], gathered order
    s, e, num_local = local.shape
    chunk_bounds = row_order.cut_bounds(local, c)  # [c + 1, s, e, L]
    chunk_parts = chunk_bounds.diff(dim=0)
    sub_bounds = row_order.cut_bounds(local, g)
    sub_parts = sub_bounds.diff(dim=0)  # [g, s, e, L]
    flat = chunk_parts.reshape(c, -1)
    block_start = (torch.cumsum(flat, 1) - flat).view(c, s, e, num_local)  # in chunk i's message
    chunk_of = torch.arange(g) // per_chunk
    starts = block_start[chunk_of] + sub_bounds[:-1] - chunk_bounds[chunk_of]
    # sub-chunk-major, then expert-major inside each: [k][x][q][j]
    index = row_order.ranges(starts.permute(0, 3, 1, 2), sub_parts.permute(0, 3, 1, 2))
    sort, unsort = row_order.split_orders(index, flat.sum(dim=1).tolist())
    return Direction(
        num_chunks=c, offsets=offsets,
        a2a_in=parts.view(c, e, num_local).sum(dim=2).tolist(),
        a2a_out=chunk_parts[:, plan.me_etp].sum(dim=2).tolist(),
        etp_sizes=chunk_parts.sum(dim=(2, 3)).tolist(),
        sub_rows=sub_parts.sum(dim=(1, 2, 3)).view(c, per_chunk).tolist(),
        first_sub=[i * per_chunk for i in range(c)],
        order=None if c == 1 else order, sort=sort, unsort=unsort)


class ChunkPlan:
    """Both passes' chunking for one layer call, plus what maps one onto the other.

    ``tokens[k]``: tokens per local expert of sub-chunk k (host, as the experts take them).
    ``to_backward``: gathers the output gradient (forward chunk order) into backward chunk
    order; ``restore``: gathers the backward chunk order back into the expert order of the
    permutation (both None where nothing moves).
    """

    def __init__(self, plan: RoutingPlan, fwd_chunks: int, bwd_chunks: int, device):
        num_subs = row_order.lcm(fwd_chunks, bwd_chunks)
        self.fwd = plan_direction(plan, fwd_chunks, num_subs)
        self.bwd = self.fwd if bwd_chunks == fwd_chunks else plan_direction(plan, bwd_chunks, num_subs)
        self.tokens = list(row_order.cut(plan.local_counts(), num_subs).sum(dim=(1, 2)))
        f, b = self.fwd.order, self.bwd.order
        if self.bwd is self.fwd:
            to_backward = None
        elif f is None:
            to_backward = b
        else:
            to_backward = row_order.inverse(f) if b is None else row_order.inverse(f)[b]
        restore = None if b is None else row_order.inverse(b)
        # Every index to the rows' device in one transfer.
        directions = [self.fwd] if self.bwd is self.fwd else [self.fwd, self.bwd]
        host = [to_backward, restore] + [t for d in directions for t in [d.order, *d.sort, *d.unsort]]
        moved = iter(row_order.to_device(host, device))
        self.to_backward, self.restore = next(moved), next(moved)
        for d in directions:
            d.order = next(moved)
            d.sort = [next(moved) for _ in d.sort]
            d.unsort = [next(moved) for _ in d.unsort]


class _ChunkedExperts:
    """The forward and backward pipelines of one S2 layer call."""

    def __init__(self, dispatcher: "ParmS2TokenDispatcher", chunks: ChunkPlan, expert_fn: Callable):
        self.ep_group, self.etp_group = dispatcher.ep_group, dispatcher.etp_group
        self.chunks = chunks
        self.expert_fn = expert_fn
        # Rows and probs travel as one message only where a collective moves them; with one
        # rank in both groups packing would only add copies (a pass, and one per chunk).
        self.travels = self.ep_group.size() > 1 or self.etp_group.size() > 1
        # per sub-chunk: (rows, probs) the experts saw and their output, for the backward
        self.saved: Dict[int, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # Experts that can (TorchGroupedMLP) compute their weight gradients once for every
        # chunk, after the last chunk's backward, instead of once per chunk's autograd graph
        # (each a GEMM over few rows and an add of the whole weight, per weight): their
        # DeferredWeightGrads while the forward's graphs are alive. Others (SequentialMLP)
        # accumulate per chunk.
        self.deferred = None

    # stages: (chunk index, tensors) -> PendingTuple
    def _stages(self, d: Direction, outputs: Sequence[torch.Tensor]):
        ep, etp = self.ep_group, self.etp_group

        def first(i: int, tensors: Tensors) -> PendingTuple:
            return PendingTuple(*[start_all_to_all(t, ep, "ep", d.a2a_out[i], d.a2a_in[i])
                                  for t in tensors], keep=tensors)

        def second(i: int, tensors: Tensors) -> PendingTuple:
            return PendingTuple(*[start_all_gather(t, etp, "expt_tp", d.etp_sizes[i])
                                  for t in tensors], keep=tensors)

        def third(i: int, tensors: Tensors) -> PendingTuple:
            return PendingTuple(*[start_reduce_scatter(t, etp, "expt_tp", d.etp_sizes[i])
                                  for t in tensors], keep=tensors)

        def fourth(i: int, tensors: Tensors) -> PendingTuple:
            return PendingTuple(*[start_all_to_all(t, ep, "ep", d.a2a_in[i], d.a2a_out[i],
                                                   out=o[d.rows(i)])
                                  for t, o in zip(tensors, outputs)], keep=tensors)

        return first, second, third, fourth

    def forward(self, rows: torch.Tensor, probs: torch.Tensor, build_graph: bool) -> torch.Tensor:
        """Expert-order rows and probs in, expert outputs out in forward chunk order."""
        d = self.chunks.fwd
        message = Message(rows.shape[1], rows.dtype, probs.dtype, travels=self.travels)
        if message.packs:  # one pass: chunk order and packing
            origin = (message.pack(rows, probs, order=d.order),)
        else:
            origin = (row_order.gather(rows, d.order), row_order.gather(probs, d.order))
        out = rows.new_empty(rows.shape)
        first, second, third, fourth = self._stages(d, [out])

        def compute(i: int, gathered: Tensors) -> Tensors:
            # sorted into sub-chunks and unpacked in one gather: contiguous rows for the experts
            if message.packs:
                gathered = message.unpack_gathered(gathered[0], d.sort[i])
            else:
                gathered = row_order.gather_contiguous(gathered, d.sort[i])
            ys, start, whole = [], 0, len(d.sub_rows[i]) == 1
            for k, count in enumerate(d.sub_rows[i], start=d.first_sub[i]):
                x, x_probs = gathered if whole else (t[start : start + count] for t in gathered)
                start += count
                with torch.enable_grad() if build_graph else torch.no_grad():
                    if build_graph:
                        x = x.detach().requires_grad_()
                        x_probs = x_probs.detach().requires_grad_()
                    y, bias = self.expert_fn(x, self.chunks.tokens[k], x_probs)
                assert bias is None, "expert bias is not supported by parm_s2"
                if build_graph:
                    self.saved[k] = (x, x_probs, y)
                ys.append(y.detach())
            y = ys[0] if len(ys) == 1 else torch.cat(ys)
            return (row_order.gather(y, d.unsort[i]),)

        defer = getattr(self.expert_fn, "deferring_weight_grads", None) if build_graph else None
        with defer() if defer is not None else contextlib.nullcontext() as deferred:
            run_pipeline(d.num_chunks, lambda i: first(i, tuple(t[d.rows(i)] for t in origin)),
                         second, compute, third, fourth)
        self.deferred = deferred
        return out

    def backward(self, grad_out: torch.Tensor, probs_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """Output gradient in forward chunk order in; gradients of rows and probs out in the
        expert order of the permutation."""
        d = self.chunks.bwd
        grad_out = row_order.gather(grad_out, self.chunks.to_backward)
        num_rows, hidden = grad_out.shape
        message = Message(hidden, grad_out.dtype, probs_dtype, summed=True, travels=self.travels)
        if message.packs:
            outputs = [message.empty(grad_out, num_rows)]
        else:
            outputs = [grad_out.new_empty(grad_out.shape), grad_out.new_empty(num_rows, dtype=probs_dtype)]
        first, second, third, fourth = self._stages(d, outputs)

        def compute(i: int, gathered: Tensors) -> Tensors:
            (grad_y,) = gathered
            grad_y = row_order.gather(grad_y, d.sort[i])
            subs = range(d.first_sub[i], d.first_sub[i] + len(d.sub_rows[i]))
            saved = [self.saved.pop(k) for k in subs]  # freed once used
            ys, grads, start, whole = [], [], 0, len(saved) == 1
            # every sub-chunk's graph, empty ones too: a rank whose experts got no row still
            # owes its expert weights a (zero) gradient, which Megatron-Core's DDP waits for
            for (_, _, y), count in zip(saved, d.sub_rows[i]):
                if y.requires_grad:
                    ys.append(y)
                    grads.append(grad_y if whole else grad_y[start : start + count])
                start += count
            if ys:
                torch.autograd.backward(ys, grads)
            grad_x = [x.grad if x.grad is not None else torch.zeros_like(x) for x, _, _ in saved]
            grad_p = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p, _ in saved]
            grad_x = grad_x[0] if len(grad_x) == 1 else torch.cat(grad_x)
            grad_p = grad_p[0] if len(grad_p) == 1 else torch.cat(grad_p)
            if message.packs:  # one pass: packing and unsorting
                return (message.pack(grad_x, grad_p, order=d.unsort[i]),)
            return row_order.gather(grad_x, d.unsort[i]), row_order.gather(grad_p, d.unsort[i])

        deferred, self.deferred = self.deferred, None
        # every chunk's expert weight gradients at once, overlapping the last chunk's returns
        run_pipeline(d.num_chunks, lambda i: first(i, (grad_out[d.rows(i)],)),
                     second, compute, third, fourth,
                     drain=deferred.backward_dw if deferred is not None else None)
        grads = message.unpack(outputs[0]) if message.packs else outputs
        return tuple(row_order.gather(g, self.chunks.restore) for g in grads)


class _PipelinedExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, probs, anchor, pipeline: _ChunkedExperts):
        ctx.pipeline = pipeline
        ctx.probs_dtype = probs.dtype
        return pipeline.forward(rows, probs, build_graph=True)

    @staticmethod
    def backward(ctx, grad_out):
        grad_rows, grad_probs = ctx.pipeline.backward(grad_out.contiguous(), ctx.probs_dtype)
        ctx.pipeline = None
        return grad_rows, grad_probs, None, None


class ParmS2TokenDispatcher(ParmS1TokenDispatcher):
    """S2: S1's data, cut into chunks that flow through a five-stage pipeline.

    Workflow (communication on the group in brackets), as ParmMoELayer runs it (the
    catalog's ``pipelined``):
    (1) dispatch_preprocess: permute this rank's n tokens by expert; exchange the E routing
        counts [ESP x EP]
    (2)-(6) dispatch_compute_combine: plan every chunk once (split sizes, rows, sorts; host);
        put the rows in chunk order packed with their probs (one pass); then per chunk,
        pipelined: A2A [EP] -> AG [ESP] -> experts -> RS [ESP] -> A2A [EP]; chunk i+1's A2A
        overlaps chunk i's AG and experts, chunk i-1's return A2A overlaps chunk i's
        experts. The backward runs the same pipeline of the duals in its own chunk count.
    (7) combine_postprocess: unpermute to this rank's n tokens (in chunk order)
    Phase by phase (token_dispatch, dispatch_postprocess, the caller's experts,
    combine_preprocess, token_combine: how Megatron-Core's own callers and tests drive a
    dispatcher) the layer call runs unpipelined, as one chunk: S2 at one chunk is S1's
    dataflow (the same collectives, rows, sorts and packing), so those phases are S1's
    (ParmS1TokenDispatcher) and compute what the pipeline computes. --parm-num-chunks and
    --parm-bwd-num-chunks apply to the pipelined call only.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        schedule = schedules.get("parm_s2")
        self.num_chunks, self.bwd_num_chunks = schedule.chunk_counts(
            parm_setting(self.config, "parm_num_chunks"),
            parm_setting(self.config, "parm_bwd_num_chunks"))

    def dispatch_compute_combine(self, rows: torch.Tensor, row_probs: torch.Tensor,
                                 expert_fn: Callable) -> torch.Tensor:
        chunks = ChunkPlan(self.plan, self.num_chunks, self.bwd_num_chunks, rows.device)
        self.plan = None
        if chunks.fwd.order is not None:  # the output comes back in forward chunk order
            self._sorted_indices = self._sorted_indices.index_select(0, chunks.fwd.order)
        pipeline = _ChunkedExperts(self, chunks, expert_fn)
        if not torch.is_grad_enabled():
            return pipeline.forward(rows, row_probs, build_graph=False)
        # The anchor keeps the pipeline in the autograd graph even when rows and probs need
        # no grad: the expert weights inside it still do.
        anchor = rows.new_empty(0).requires_grad_()
        return _PipelinedExpertsFunction.apply(rows, row_probs, anchor, pipeline)
