"""Row bookkeeping of S1/S2 (dispatchers/row_order.py, parm_s2's chunk plans), on the host.

The chunk plans are checked by simulating the whole dataflow of one layer on labelled rows:
every rank's permuted rows, the chunks' A2A [EP] and AG [ESP] as list operations, then what
the experts see per sub-chunk, in both passes.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_parm.dispatchers import row_order
from megatron_parm.dispatchers.base import RoutingPlan
from megatron_parm.dispatchers.parm_s2 import ChunkPlan, plan_direction
from megatron_parm.dispatchers.row_order import Message

COUNTS = torch.tensor([0, 1, 2, 5, 7, 10, 13])


@pytest.mark.parametrize("num_chunks", [1, 2, 3, 4, 8])
def test_cut_partitions_each_count_evenly(num_chunks):
    parts = row_order.cut(COUNTS, num_chunks)
    assert torch.equal(parts.sum(dim=0), COUNTS)
    assert (parts.max(dim=0).values - parts.min(dim=0).values).max() <= 1


def test_cut_gives_the_first_rows_of_each_block_to_the_first_chunks():
    counts = torch.tensor([3, 0, 5, 1])
    assert row_order.cut(counts, 3).tolist() == [[1, 0, 2, 1], [1, 0, 2, 0], [1, 0, 1, 0]]


@pytest.mark.parametrize("coarse,fine", [(2, 4), (2, 6), (3, 6), (4, 8), (1, 5)])
def test_cut_composes(coarse, fine):
    """Grouping fine // coarse consecutive parts of the fine cut gives the coarse cut, which
    is what lets forward and backward pipelines share sub-chunks."""
    grouped = row_order.cut(COUNTS, fine).view(coarse, fine // coarse, -1).sum(dim=1)
    assert torch.equal(grouped, row_order.cut(COUNTS, coarse))


def test_ranges_inverse_and_identity():
    index = row_order.ranges(torch.tensor([5, 0, 9]), torch.tensor([2, 0, 3]))
    assert index.tolist() == [5, 6, 9, 10, 11]
    assert row_order.ranges(torch.tensor([3]), torch.tensor([0])).numel() == 0
    order = torch.tensor([2, 0, 3, 1])
    assert torch.equal(torch.arange(4)[order][row_order.inverse(order)], torch.arange(4))
    assert row_order.is_identity(torch.arange(5)) and not row_order.is_identity(order)
    assert row_order.to_device([order, None], "cpu")[1] is None


def test_split_orders_matches_each_piece_on_its_own():
    """The pieces' orders and inverses from whole-array work equal those made piece by piece;
    a piece that moves nothing (and an empty one) gives None."""
    pieces = [torch.tensor([2, 0, 1]), torch.arange(4), torch.zeros(0, dtype=torch.long),
              torch.tensor([1, 0]), torch.tensor([0])]
    orders, inverses = row_order.split_orders(torch.cat(pieces), [p.numel() for p in pieces])
    for piece, order, undo in zip(pieces, orders, inverses):
        if row_order.is_identity(piece):
            assert order is None and undo is None
        else:
            assert torch.equal(order, piece) and torch.equal(undo, row_order.inverse(piece))


def test_message_travels_apart_where_nothing_moves_it():
    assert not Message(4, torch.float32, torch.float32, travels=False).packs
    assert Message(4, torch.float32, torch.float32).packs


@pytest.mark.parametrize("rows_dtype,probs_dtype,summed,packs", [
    (torch.float32, torch.float32, False, True), (torch.bfloat16, torch.float32, False, True),
    (torch.bfloat16, torch.float32, True, False), (torch.float32, torch.float32, True, True)])
def test_message_packs_rows_and_probs(rows_dtype, probs_dtype, summed, packs):
    rows = torch.randn(6, 4).to(rows_dtype)
    probs = torch.rand(6).to(probs_dtype)
    message = Message(4, rows_dtype, probs_dtype, summed=summed)
    assert message.packs == packs
    if not packs:
        return
    order = torch.tensor([5, 3, 1, 0, 2, 4])
    back_rows, back_probs = message.unpack(message.pack(rows, probs, order=order))
    assert torch.equal(back_rows, rows[order]) and torch.equal(back_probs, probs[order])
    assert back_probs.dtype == probs_dtype
    plain_rows, plain_probs = message.unpack(message.pack(rows, probs))
    assert torch.equal(plain_rows, rows) and torch.equal(plain_probs, probs)


def _plan(counts, me_ep, me_etp, num_local):
    return RoutingPlan(counts, me_ep, me_etp, num_local)


def test_expert_order_sorts_gathered_blocks_by_expert():
    counts = torch.tensor([[[1, 2, 0, 1], [2, 0, 1, 1]], [[0, 1, 2, 2], [1, 1, 1, 0]]])  # [e, s, E]
    plan = _plan(counts, me_ep=0, me_etp=1, num_local=2)
    local = plan.local_counts()  # [q][j][x]
    labels = [(q, j, x) for q, j, x in itertools.product(range(2), range(2), range(2))
              for _ in range(int(local[q, j, x]))]
    order = plan.expert_order()
    sorted_labels = [labels[i] for i in order.tolist()]
    assert sorted_labels == sorted(labels, key=lambda t: (t[2], t[0], t[1]))
    one_expert = _plan(counts, me_ep=0, me_etp=0, num_local=1)
    assert one_expert.expert_order() is None


def _origin_rows(counts, j, q):
    """Labels of the rows rank (EP j, ESP q) permutes, in expert order: (j, q, x, i)."""
    return [(j, q, x, i) for x in range(counts.shape[2]) for i in range(int(counts[j, q, x]))]


def _simulate(counts, me_ep, me_etp, num_local, direction_of, kind):
    """What rank (me_ep, me_etp) receives per chunk after A2A [EP] + AG [ESP], as labels,
    with every origin sending its chunk slice in the chunk order of its own plan."""
    e, s, _ = counts.shape
    lo = me_ep * num_local
    directions = {}
    for j, q in itertools.product(range(e), range(s)):
        d = direction_of(_plan(counts, j, q, num_local))
        order = d.order.tolist() if d.order is not None else list(range(int(counts[j, q].sum())))
        rows = _origin_rows(counts, j, q)
        directions[(j, q)] = (d, [rows[t] for t in order])
    mine = directions[(me_ep, me_etp)][0]
    received = []
    for i in range(mine.num_chunks):
        chunk = []
        for q in range(s):  # AG [ESP] concatenates the ESP peers' A2A outputs
            for j in range(e):  # A2A [EP]: from each EP peer, the rows for my experts
                d, rows = directions[(j, q)]
                sent = rows[d.rows(i)]
                start = sum(d.a2a_in[i][:me_ep])
                chunk += sent[start : start + d.a2a_in[i][me_ep]]
                assert all(lo <= x < lo + num_local for _, _, x, _ in sent[start:start + d.a2a_in[i][me_ep]])
        assert len(chunk) == sum(mine.etp_sizes[i]), kind
        assert mine.a2a_out[i] == [directions[(j, me_etp)][0].a2a_in[i][me_ep] for j in range(e)]
        received.append(chunk)
    return mine, received


@pytest.mark.parametrize("fwd,bwd", [(1, 1), (3, 3), (2, 4), (4, 2), (3, 2), (1, 3)])
def test_chunk_plans_give_the_experts_every_row_once_per_pass(fwd, bwd):
    torch.manual_seed(0)
    e, s, num_local = 2, 2, 3
    counts = torch.randint(0, 7, (e, s, e * num_local))
    num_subs = row_order.lcm(fwd, bwd)
    for me_ep, me_etp in itertools.product(range(e), range(s)):
        seen = {}
        for kind, count in (("forward", fwd), ("backward", bwd)):
            mine, received = _simulate(counts, me_ep, me_etp, num_local,
                                       lambda plan: plan_direction(plan, count, num_subs), kind)
            subs = []
            for i, chunk in enumerate(received):
                ordered = chunk if mine.sort[i] is None else [chunk[t] for t in mine.sort[i].tolist()]
                if mine.unsort[i] is not None:  # unsort undoes sort
                    assert [ordered[t] for t in mine.unsort[i].tolist()] == chunk
                start = 0
                for k, size in enumerate(mine.sub_rows[i], start=mine.first_sub[i]):
                    part = ordered[start : start + size]
                    start += size
                    # expert-major inside a sub-chunk, and the same rows in both passes
                    assert [x for _, _, x, _ in part] == sorted(x for _, _, x, _ in part)
                    subs.append(part)
            assert len(subs) == num_subs
            seen[kind] = subs
        assert seen["forward"] == seen["backward"]
        everything = [row for sub in seen["forward"] for row in sub]
        lo = me_ep * num_local
        expected = [(j, q, x, i) for j in range(e) for q in range(s) for x in range(lo, lo + num_local)
                    for i in range(int(counts[j, q, x]))]
        assert sorted(everything) == sorted(expected)


@pytest.mark.parametrize("fwd,bwd", [(2, 2), (2, 4), (4, 2), (3, 2), (1, 4), (4, 1)])
def test_chunk_plan_maps_gradients_between_the_two_chunk_orders(fwd, bwd):
    counts = torch.tensor([[[3, 1, 4, 1, 5, 9]], [[2, 6, 5, 3, 5, 8]]])  # [e=2, s=1, E=6]
    plan = _plan(counts, me_ep=1, me_etp=0, num_local=3)
    chunks = ChunkPlan(plan, fwd, bwd, "cpu")
    rows = torch.arange(int(plan.mine().sum()))  # expert order
    forward_order = rows if chunks.fwd.order is None else rows[chunks.fwd.order]
    backward_order = rows if chunks.bwd.order is None else rows[chunks.bwd.order]
    moved = forward_order if chunks.to_backward is None else forward_order[chunks.to_backward]
    assert torch.equal(moved, backward_order)
    restored = backward_order if chunks.restore is None else backward_order[chunks.restore]
    assert torch.equal(restored, rows)
    assert len(chunks.tokens) == row_order.lcm(fwd, bwd)
    assert torch.equal(sum(chunks.tokens), plan.tokens_per_local_expert())
