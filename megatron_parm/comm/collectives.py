"""Collectives along dim 0 for the dispatchers: async starters and autograd functions.

Notation: g = size of the group, rows = first dimension of a tensor.

Each collective comes twice:
- ``start_*`` launches it asynchronously and returns a ``Pending`` whose ``wait()`` gives
  the result; the S2 pipeline uses these to keep collectives on the EP and ESP groups in
  flight at the same time.
- a lowercase autograd wrapper (``all_to_all``, ``all_gather``, ``reduce_scatter``,
  ``all_reduce``) whose backward is the dual collective (A2A <-> A2A with splits swapped,
  AG <-> RS, AR <-> AR).

Uneven splits are supported everywhere by padding each split to the largest one (gloo's
all_gather and reduce_scatter need equal sizes; NCCL is fine with either), so nothing here
assumes a device or backend. A group of one rank returns its input untouched.

Every call records its bytes in ``megatron_parm.comm.accounting`` under the group name the
caller gives ("tp", "ep", "expt_tp"); name=None leaves a call unaccounted.

Devices and streams: outputs are made with ``new_empty`` / ``new_zeros`` of the input, so on
its device. On NCCL, ``Pending.wait()`` is ``work.wait()``: the current stream waits for the
collective's stream, the host does not. The input and output of an in-flight collective must
not be freed (and their memory reused) before the collective has run on its stream: a
``Pending`` keeps references to them until it is waited on. That rule is enough on every
backend: once waited on, the current stream is ordered after the collective, so memory freed
afterwards and reused by later work on the current stream is safe. No ``record_stream`` is
needed for it (ProcessGroupNCCL also records its tensors on its stream itself, unless
TORCH_NCCL_AVOID_RECORD_STREAMS=1, in which case it stashes them instead; gloo copies CUDA
tensors through the host inside the work). Waiting on a Pending is required, as with any
async collective: every Pending made here is waited on by its caller.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, ContextManager, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_parm.comm.accounting import get_comm_stats


# Not cached: a cache keyed by groups kept every destroyed group, and its gloo threads, alive
# (each lookup takes under a microsecond).
def is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def _group_ranks(group) -> tuple:
    return tuple(dist.get_process_group_ranks(group))


def _row_bytes(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape[1:]) * tensor.element_size()


def record_bytes(kind: str, name: Optional[str], group, bytes_per_peer: Sequence[int]) -> None:
    if name is None:  # unaccounted traffic (mcore_compat's redirect of Megatron's own calls)
        return
    ranks = _group_ranks(group)
    me = ranks[group.rank()]
    get_comm_stats().record(kind, name, me, list(zip(ranks, bytes_per_peer)))


# Context-manager factories entered around every blocking wait of a Pending, while this
# process waits for its peers (the combined 1F1B's communication thread on the CPU registers
# one: mcore_compat.comm_stream.rng_lock_released).
WAIT_CONTEXTS: List[Callable[[], ContextManager]] = []


class Pending:
    """An in-flight collective; ``wait()`` returns its result (once).

    keep: the tensors the collective reads and writes, held until the wait (see above).
    """

    def __init__(self, work, finish: Callable[[], torch.Tensor], keep: Sequence[torch.Tensor] = ()):
        self._work = work
        self._finish = finish
        self._keep = tuple(keep)

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            with contextlib.ExitStack() as waiting:
                for context in WAIT_CONTEXTS:
                    waiting.enter_context(context())
                self._work.wait()
        result = self._finish()
        self._keep = ()
        return result


def _done(tensor: torch.Tensor) -> Pending:
    return Pending(None, lambda: tensor)


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor.contiguous()
    pad = tensor.new_zeros((rows - tensor.shape[0],) + tuple(tensor.shape[1:]))
    return torch.cat([tensor, pad], dim=0)


# ----------------------------------------------------------------------------------------
# async starters
# ----------------------------------------------------------------------------------------


def start_all_to_all(tensor: torch.Tensor, group, name: str,
                     output_splits: Sequence[int], input_splits: Sequence[int],
                     out: Optional[torch.Tensor] = None) -> Pending:
    """Send input_splits[j] rows to peer j, receive output_splits[j] rows from peer j
    (into ``out`` where given: a contiguous tensor of the received rows' shape)."""
    if group.size() == 1:
        return _done(tensor if out is None else out.copy_(tensor))
    input_splits = [int(s) for s in input_splits]
    output_splits = [int(s) for s in output_splits]
    tensor = tensor.contiguous()
    if out is None:
        out = tensor.new_empty((sum(output_splits),) + tuple(tensor.shape[1:]))
    row = _row_bytes(tensor)
    record_bytes("all_to_all", name, group, [s * row for s in input_splits])
    work = dist.all_to_all_single(out, tensor, output_splits, input_splits, group=group,
                                  async_op=True)
    return Pending(work, lambda: out, keep=(tensor, out))


def start_all_gather(tensor: torch.Tensor, group, name: str,
                     split_sizes: Optional[Sequence[int]] = None) -> Pending:
    """Concatenate every rank's rows in rank order; rank i holds split_sizes[i] rows."""
    size = group.size()
    if size == 1:
        return _done(tensor)
    rows = tensor.shape[0]
    record_bytes("all_gather", name, group, [rows * _row_bytes(tensor)] * size)
    tail = tuple(tensor.shape[1:])
    if split_sizes is None or len(set(int(s) for s in split_sizes)) == 1:
        out = tensor.new_empty((rows * size,) + tail)
        tensor = tensor.contiguous()
        work = dist.all_gather_into_tensor(out, tensor, group=group, async_op=True)
        return Pending(work, lambda: out, keep=(tensor, out))
    split_sizes = [int(s) for s in split_sizes]
    longest = max(split_sizes)
    padded = [tensor.new_empty((longest,) + tail) for _ in range(size)]
    sent = _pad_rows(tensor, longest)
    work = dist.all_gather(padded, sent, group=group, async_op=True)
    return Pending(work, lambda: torch.cat([p[:s] for p, s in zip(padded, split_sizes)]),
                   keep=(sent, *padded))


def start_reduce_scatter(tensor: torch.Tensor, group, name: str,
                         split_sizes: Optional[Sequence[int]] = None) -> Pending:
    """Sum over ranks, then rank i keeps rows of split i (split_sizes[i] rows)."""
    size = group.size()
    if size == 1:
        return _done(tensor)
    tail = tuple(tensor.shape[1:])
    if split_sizes is None:
        assert tensor.shape[0] % size == 0, "reduce_scatter: rows must divide the group"
        split_sizes = [tensor.shape[0] // size] * size
    split_sizes = [int(s) for s in split_sizes]
    row = _row_bytes(tensor)
    record_bytes("reduce_scatter", name, group, [s * row for s in split_sizes])
    me = group.rank()
    if is_gloo(group):
        # gloo's reduce_scatter costs as much as an all_reduce of the whole tensor; sending
        # chunk j to rank j and summing what arrives moves (g-1)/g of it, as a ring would.
        mine = split_sizes[me]
        received = tensor.new_empty((size * mine,) + tail)
        tensor = tensor.contiguous()
        work = dist.all_to_all_single(received, tensor, [mine] * size, split_sizes,
                                      group=group, async_op=True)
        return Pending(work, lambda: received.view((size, mine) + tail).sum(dim=0),
                       keep=(tensor, received))
    if len(set(split_sizes)) == 1:
        out = tensor.new_empty((split_sizes[0],) + tail)
        tensor = tensor.contiguous()
        work = dist.reduce_scatter_tensor(out, tensor, group=group, async_op=True)
        return Pending(work, lambda: out, keep=(tensor, out))
    longest = max(split_sizes)
    chunks = [_pad_rows(c, longest) for c in torch.split(tensor, split_sizes, dim=0)]
    out = tensor.new_empty((longest,) + tail)
    work = dist.reduce_scatter(out, chunks, group=group, async_op=True)
    return Pending(work, lambda: out[: split_sizes[me]], keep=(*chunks, out))


def start_all_reduce(tensor: torch.Tensor, group, name: str) -> Pending:
    size = group.size()
    if size == 1:
        return _done(tensor)
    total = tensor.numel() * tensor.element_size()
    # reduce-scatter + all-gather: one g-th of the tensor to each peer, twice.
    record_bytes("all_reduce", name, group, [2 * total // size] * size)
    out = tensor.clone()
    work = dist.all_reduce(out, group=group, async_op=True)
    return Pending(work, lambda: out, keep=(out,))


# ----------------------------------------------------------------------------------------
# autograd wrappers
# ----------------------------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group, name, output_splits, input_splits):
        ctx.group, ctx.name = group, name
        ctx.output_splits, ctx.input_splits = output_splits, input_splits
        return start_all_to_all(tensor, group, name, output_splits, input_splits).wait()

    @staticmethod
    def backward(ctx, grad):
        grad = start_all_to_all(grad, ctx.group, ctx.name, ctx.input_splits,
                                ctx.output_splits).wait()
        return grad, None, None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group, name, split_sizes):
        ctx.group, ctx.name, ctx.split_sizes = group, name, split_sizes
        return start_all_gather(tensor, group, name, split_sizes).wait()

    @staticmethod
    def backward(ctx, grad):
        grad = start_reduce_scatter(grad, ctx.group, ctx.name, ctx.split_sizes).wait()
        return grad, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group, name, split_sizes):
        ctx.group, ctx.name, ctx.split_sizes = group, name, split_sizes
        return start_reduce_scatter(tensor, group, name, split_sizes).wait()

    @staticmethod
    def backward(ctx, grad):
        grad = start_all_gather(grad.contiguous(), ctx.group, ctx.name, ctx.split_sizes).wait()
        return grad, None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group, name):
        ctx.group, ctx.name = group, name
        return start_all_reduce(tensor, group, name).wait()

    @staticmethod
    def backward(ctx, grad):
        return start_all_reduce(grad.contiguous(), ctx.group, ctx.name).wait(), None, None


class _KeepShard(torch.autograd.Function):
    """Replicated tensor -> this rank's equal row shard; backward gathers the shard grads."""

    @staticmethod
    def forward(ctx, tensor, group, name):
        ctx.group, ctx.name = group, name
        rows = tensor.shape[0] // group.size()
        return tensor[group.rank() * rows : (group.rank() + 1) * rows].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return start_all_gather(grad.contiguous(), ctx.group, ctx.name).wait(), None, None


class _GatherReplicated(torch.autograd.Function):
    """Row shards -> the replicated whole; backward keeps this rank's rows of the grad."""

    @staticmethod
    def forward(ctx, tensor, group, name):
        ctx.group = group
        return start_all_gather(tensor.contiguous(), group, name).wait()

    @staticmethod
    def backward(ctx, grad):
        rows = grad.shape[0] // ctx.group.size()
        return grad[ctx.group.rank() * rows : (ctx.group.rank() + 1) * rows], None, None


def keep_shard(tensor, group, name: str):
    """Slice a TP-replicated tensor to this rank's rows (grads are replicated again by AG)."""
    if group.size() == 1:
        return tensor
    return _KeepShard.apply(tensor, group, name)


def gather_replicated(tensor, group, name: str):
    """AG row shards into a tensor every rank holds whole (its grad is replicated too)."""
    if group.size() == 1:
        return tensor
    return _GatherReplicated.apply(tensor, group, name)


def all_to_all(tensor, group, name: str, output_splits: List[int], input_splits: List[int]):
    if group.size() == 1:
        return tensor
    return _AllToAll.apply(tensor, group, name, list(output_splits), list(input_splits))


def all_gather(tensor, group, name: str, split_sizes: Optional[List[int]] = None):
    if group.size() == 1:
        return tensor
    return _AllGather.apply(tensor, group, name, None if split_sizes is None else list(split_sizes))


def reduce_scatter(tensor, group, name: str, split_sizes: Optional[List[int]] = None):
    if group.size() == 1:
        return tensor
    return _ReduceScatter.apply(tensor, group, name,
                                None if split_sizes is None else list(split_sizes))


def all_reduce(tensor, group, name: str):
    if group.size() == 1:
        return tensor
    return _AllReduce.apply(tensor, group, name)
