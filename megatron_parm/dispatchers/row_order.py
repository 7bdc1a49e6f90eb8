"""Row bookkeeping of the deduplicated schedules (parm_s1, parm_s2), once per layer call.

Everything here is decided on the host from the routing counts (which the collectives need
there anyway) with a few vectorised tensor operations, whatever the number of experts,
sources or chunks; its tensors are made on the host on purpose (``device=HOST``, the device
seam's name for it), and the index tensors are copied to the rows' device in one transfer
that does not wait (``to_device``). The layer's tensors are then moved by whole-tensor
gathers (``index_select``) only: a row order is applied in one pass, and where the
probabilities travel with the rows the packing is the same pass (``Message.pack``).

Notation (as in docs/design.md): M hidden size; a *block* is the rows one source sent to one
expert, contiguous in a message; an *order* is a gather index: ``out = rows[order]``.

Chunks. A count n cut into c chunks gives chunk i the rows [ceil(n*i/c), ceil(n*(i+1)/c)) of
its block (parts differ by at most one). The rule composes: cutting into g = c*m parts and
taking m consecutive ones gives exactly the cut into c, so forward and backward pipelines
with different chunk counts share one finer partition (``sub-chunks``, g = lcm of the two).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch

from megatron_parm.device import HOST


def cut_bounds(counts: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """[c + 1, *counts.shape]: where each count's chunk i starts, ceil(n * i / c)."""
    steps = torch.arange(num_chunks + 1, dtype=counts.dtype, device=HOST).view(-1, *([1] * counts.dim()))
    return -torch.div(-counts.unsqueeze(0) * steps, num_chunks, rounding_mode="floor")


def cut(counts: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """[c, *counts.shape]: each count cut into num_chunks parts that differ by at most one."""
    return cut_bounds(counts, num_chunks).diff(dim=0)


def ranges(starts: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """The concatenation of arange(start, start + size) over the given ranges (host)."""
    starts, sizes = starts.reshape(-1), sizes.reshape(-1)
    total = int(sizes.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.long, device=HOST)
    placed = torch.cumsum(sizes, 0) - sizes  # where each range begins in the output
    return torch.repeat_interleave(starts - placed, sizes) + torch.arange(total, device=HOST)


def block_starts(sizes: torch.Tensor) -> torch.Tensor:
    """Start of every block of a message whose blocks (sizes, any shape) lie in row-major order."""
    flat = sizes.reshape(-1)
    return (torch.cumsum(flat, 0) - flat).view(sizes.shape)


def inverse(order: torch.Tensor) -> torch.Tensor:
    """The gather index that undoes ``order`` (a permutation)."""
    out = torch.empty_like(order, device=HOST)
    out[order] = torch.arange(order.numel(), device=HOST)
    return out


def is_identity(order: torch.Tensor) -> bool:
    return bool(torch.equal(order, torch.arange(order.numel(), device=HOST)))


def split_orders(index: torch.Tensor, sizes: Sequence[int]) -> Tuple[List[Optional[torch.Tensor]],
                                                                     List[Optional[torch.Tensor]]]:
    """Pieces of one concatenated gather index, each a permutation of its own piece's rows
    (0 .. size - 1): every piece's order and its inverse, None for a piece that moves
    nothing. Whole-array operations, whatever the number of pieces (S2's chunks)."""
    sizes_t = torch.tensor(list(sizes), dtype=torch.long, device=HOST)
    shift = torch.repeat_interleave(torch.cumsum(sizes_t, 0) - sizes_t, sizes_t)
    whole = index + shift  # one permutation of all the rows
    piece_of_row = torch.repeat_interleave(torch.arange(len(sizes), device=HOST), sizes_t)
    moved_rows = whole != torch.arange(whole.numel(), device=HOST)
    moved = (torch.bincount(piece_of_row[moved_rows], minlength=len(sizes)) > 0).tolist()
    undo = inverse(whole) - shift
    orders = [piece if m else None for piece, m in zip(index.split(list(sizes)), moved)]
    inverses = [piece if m else None for piece, m in zip(undo.split(list(sizes)), moved)]
    return orders, inverses


def to_device(indices: Sequence[Optional[torch.Tensor]], device) -> List[Optional[torch.Tensor]]:
    """Host index tensors on ``device``: one copy for all, without a host wait (on the CPU
    itself each stays where it is)."""
    present = [t for t in indices if t is not None]
    if not present or torch.device(device).type == "cpu":
        return [None if t is None else t.to(device) for t in indices]
    moved = iter(torch.cat(present).to(device, non_blocking=True).split([t.numel() for t in present]))
    return [None if t is None else next(moved) for t in indices]


def gather(tensor: torch.Tensor, order: Optional[torch.Tensor]) -> torch.Tensor:
    """``tensor[order]`` (rows), or the tensor itself where order is None."""
    return tensor if order is None else tensor.index_select(0, order)


def gather_contiguous(tensors: Sequence[torch.Tensor], order: Optional[torch.Tensor]) -> tuple:
    """Each of ``tensors`` gathered in ``order`` (None: as they are), contiguous: the experts'
    grouped GEMMs need contiguous rows, and the gather makes them in the same pass."""
    return tuple(t.contiguous() if order is None else t.index_select(0, order) for t in tensors)


def gather_new(tensors: Sequence[torch.Tensor], order: Optional[torch.Tensor]) -> tuple:
    """Each of ``tensors`` gathered in ``order`` into new storage, contiguous (None: copied):
    for a caller that frees the storage it was handed once the tensors are made."""
    return tuple(t.clone(memory_format=torch.contiguous_format) if order is None
                 else t.index_select(0, order) for t in tensors)


def lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)


class Message:
    """Rows [R, M] and their routing probabilities [R] as one message [R, M + p].

    p = 1 where the dtypes match; otherwise the probabilities' bytes ride as p columns of the
    rows' dtype, which only pure data movement may carry (``summed``: a reduction would add
    reinterpreted bytes); ``packs`` is False where neither works, and the two travel apart.
    ``travels`` False (no collective moves the message: groups of one rank) packs nothing:
    packing would only copy the rows, and unpacking copy them back for the experts.
    """

    def __init__(self, hidden: int, rows_dtype: torch.dtype, probs_dtype: torch.dtype,
                 summed: bool = False, travels: bool = True):
        self.hidden, self.probs_dtype = hidden, probs_dtype
        ratio, rest = divmod(probs_dtype.itemsize, rows_dtype.itemsize)
        if not travels:
            self.prob_cols = 0
        elif rows_dtype == probs_dtype:
            self.prob_cols = 1
        elif not summed and rest == 0:
            self.prob_cols = ratio
        else:
            self.prob_cols = 0
        self.same_dtype = rows_dtype == probs_dtype

    @property
    def packs(self) -> bool:
        return self.prob_cols > 0

    def empty(self, like: torch.Tensor, num_rows: int) -> torch.Tensor:
        return like.new_empty((num_rows, self.hidden + self.prob_cols))

    def pack(self, rows: torch.Tensor, probs: torch.Tensor, order: Optional[torch.Tensor] = None,
             out: Optional[torch.Tensor] = None, probs_in_order: bool = False) -> torch.Tensor:
        """One pass: out[i] = (rows[order[i]], probs[order[i]]) (order None: as they are;
        probs_in_order: the probs are already in the output's order, only the rows move)."""
        num_rows = rows.shape[0] if order is None else order.numel()
        out = self.empty(rows, num_rows) if out is None else out
        body, tail = out[:, : self.hidden], out[:, self.hidden:]
        if not self.same_dtype:
            probs = probs.contiguous().view(rows.dtype).view(-1, self.prob_cols)
        else:
            probs = probs.unsqueeze(-1)
        if order is None:
            body.copy_(rows)
            tail.copy_(probs)
        else:
            torch.index_select(rows, 0, order, out=body)
            if probs_in_order:
                tail.copy_(probs)
            else:
                torch.index_select(probs, 0, order, out=tail)
        return out

    def unpack(self, packed: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(rows, probs) as views of the message (probs copied only where reinterpreted)."""
        rows, tail = packed[:, : self.hidden], packed[:, self.hidden:]
        if self.same_dtype:
            return rows, tail.squeeze(-1)
        return rows, tail.contiguous().view(self.probs_dtype).view(-1)

    def unpack_gathered(self, packed: torch.Tensor, order: Optional[torch.Tensor]):
        """(rows, probs) of the message gathered in ``order``, contiguous (gather_contiguous)."""
        return gather_contiguous(self.unpack(packed), order)
