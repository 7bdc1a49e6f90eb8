"""tests/device_sim.py itself: it flags what a GPU would refuse or wait for, and nothing else."""

from __future__ import annotations

import pytest
import torch

from device_sim import SimulatedDevice, mark_device
from megatron_parm.dispatchers.base import chunk_row_index, chunk_row_indices
from megatron_parm.platform.device import HOST


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


def test_chunk_row_indices_on_the_rows_device_without_a_sync():
    counts = torch.tensor([4, 0, 3, 5], device=HOST)
    rows = torch.randn(12, 2)
    mark_device(rows)
    sim = SimulatedDevice()
    with sim:
        indices = chunk_row_indices(counts, 3, rows.device)
        for index in indices:
            rows.index_select(0, index)
    assert sim.syncs == []
    assert [i.tolist() for i in indices] == [chunk_row_index(counts, i, 3).tolist() for i in range(3)]
    assert sorted(torch.cat(indices).tolist()) == list(range(12))


def test_rows_for_the_experts_are_contiguous():
    """Rows unpacked from a message with their probs are a strided view; the experts get them
    contiguous (grouped_gemm refuses anything else), with one local expert too."""
    from megatron_parm.dispatchers.base import pack_rows, sort_by_local_expert, unpack_rows

    rows, probs = unpack_rows(pack_rows(torch.randn(5, 4), torch.rand(5)), 4, torch.float32)
    assert not rows.is_contiguous()
    for experts, sizes in ((1, [2, 3]), (2, [1, 2, 1, 1])):
        out, _ = sort_by_local_expert(rows, probs, torch.tensor(sizes, device=HOST), experts)
        assert out.is_contiguous()
