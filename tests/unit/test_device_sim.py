"""tests/device_sim.py itself: it flags what a GPU would refuse or wait for, and nothing else."""

from __future__ import annotations

import pytest
import torch

from device_sim import SimulatedDevice, mark_device
from megatron_parm.dispatchers.base import RoutingPlan
from megatron_parm.device import HOST


def test_host_index_with_device_rows_is_an_error():
    rows = torch.randn(6, 2)
    mark_device(rows)
    with SimulatedDevice():
        rows.index_select(0, torch.arange(3, device=rows.device))  # made on the rows' device
        rows[torch.arange(2)]  # indexing with a host index: CUDA allows it
        with pytest.raises(RuntimeError, match="index_select .* host tensor of shape \\(3,\\)"):
            rows.index_select(0, torch.arange(3))
        with pytest.raises(RuntimeError, match="host tensor"):
            rows.index_select(0, torch.arange(3, device=HOST))


def test_host_reads_of_device_tensors_are_syncs():
    counts = torch.tensor([3, 1, 2])
    mark_device(counts)
    sim = SimulatedDevice()
    with sim:
        host = counts.to(HOST)
        host.tolist(), int(host.sum())  # host data: free
        counts.sum().item()
        counts.masked_select(counts > 1)
        torch.arange(4).tolist()
    assert [name for name, _ in sim.syncs] == ["to", "item", "masked_select"]
    assert all(site.endswith("test_host_reads_of_device_tensors_are_syncs") for _, site in sim.syncs)


def test_chunk_plans_on_the_rows_device_without_a_sync():
    """S2's indices (chunk order, sorts, the map between the passes' chunk orders) are made on
    the host from host counts and reach the rows' device without the host waiting."""
    from megatron_parm.dispatchers.parm_s2 import ChunkPlan

    counts = torch.tensor([[[4, 0, 3, 5]], [[2, 1, 0, 6]]], device=HOST)  # [e=2, s=1, E=4]
    plan = RoutingPlan(counts, me_ep=0, me_etp=0, num_local_experts=2)
    rows = torch.randn(12, 2)
    mark_device(rows)
    sim = SimulatedDevice()
    with sim:
        chunks = ChunkPlan(plan, 3, 2, rows.device)
        ordered = rows.index_select(0, chunks.fwd.order)
        ordered.index_select(0, chunks.to_backward).index_select(0, chunks.restore)
        gathered = torch.randn(int(plan.local_counts().sum()), 2, device=rows.device)
        for index in chunks.fwd.sort + chunks.bwd.sort:
            if index is not None:
                gathered[: index.numel()].index_select(0, index)
    assert sim.syncs == []
    assert sorted(chunks.fwd.order.tolist()) == list(range(12))


def test_rows_for_the_experts_are_contiguous():
    """Rows unpacked from a message with their probs are a strided view; the experts get them
    contiguous (grouped_gemm refuses anything else), with one local expert too."""
    from megatron_parm.dispatchers.base import sort_by_local_expert
    from megatron_parm.dispatchers.row_order import Message

    message = Message(4, torch.float32, torch.float32)
    packed = message.pack(torch.randn(5, 4), torch.rand(5))
    rows, probs = message.unpack(packed)
    assert not rows.is_contiguous()
    for order in (None, torch.tensor([4, 0, 3, 1, 2], device=HOST)):
        assert all(t.is_contiguous() for t in message.unpack_gathered(packed, order))
    for experts, sizes in ((1, [2, 3]), (2, [1, 2, 1, 1]), (2, [2, 3])):
        out, _ = sort_by_local_expert(rows, probs, torch.tensor(sizes, device=HOST), experts)
        assert out.is_contiguous()
