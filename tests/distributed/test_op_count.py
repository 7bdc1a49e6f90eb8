"""S2's per-chunk work stays a fixed handful of operators with grouped experts.

One 2-rank launch of tools/count_ops.py (EP 2, 4 local experts per rank: S2's chunks carry
A2As and sorts) counts one forward+backward of parm_s2 at 1 and 3 chunks with
TorchGroupedMLP and with SequentialMLP. Each chunk beyond the first may
add at most the budget of docs/benchmark.md ("Per-chunk work"): what the dispatcher and one
grouped-expert call must do per chunk. SequentialMLP's per-expert GEMMs exceed it (the
check that the budget tells the two apart: going back to per-expert GEMMs fails here).
The classifier itself is checked in-process on known operators.
"""

from __future__ import annotations

import json

import pytest
import torch

from launch import torchrun

# docs/benchmark.md, "Per-chunk work": per extra chunk, one forward+backward, one rank.
DEVICE_OPS_PER_CHUNK = 24  # 6 gathers (dispatcher) + 15 (one grouped-expert call) + 3 slack
OPS_PER_CHUNK = 64  # every operator, views and allocations included (host cost)
# 2 forward + 2 backward (input gradients) grouped GEMMs, whatever the number of experts: S2
# defers the grouped experts' 2 weight-gradient GEMMs to once per layer call
# (TorchGroupedMLP.deferring_weight_grads), so a chunk adds none of them
GEMMS_PER_CHUNK = 4
SEQUENTIAL_GEMMS_PER_CHUNK = 4 * 6  # 4 local experts, each its own 2 + 4, every chunk
COLLECTIVES_PER_CHUNK = 4  # A2A out and back, forward and backward (ETP of one rank)
HOST_OPS_PER_CHUNK = 1  # the chunk plan is whole-array work, not a loop over chunks

GROUPED = "TorchGroupedMLP"
CHUNKS = 3  # compared with 1 chunk: the one-time work of cutting at all is shared by 2 chunks


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    out = tmp_path_factory.mktemp("op_count") / "counts.jsonl"
    torchrun("tools/count_ops.py", 2, "--expert-model-parallel-size", "2", "--seq-length", "64",
             "--experts", f"{GROUPED},SequentialMLP", "--dispatchers", f"parm_s2@1,parm_s2@{CHUNKS}",
             "--output", str(out), timeout=600)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return {(r["experts"], r["dispatcher"]): r for r in rows}


def per_chunk(counts, experts, quantity):
    one, many = counts[(experts, "parm_s2@1")], counts[(experts, f"parm_s2@{CHUNKS}")]
    return (many[quantity] - one[quantity]) / (CHUNKS - 1)


def test_grouped_experts_chunk_within_budget(counts):
    extra = {q: per_chunk(counts, GROUPED, q)
             for q in ("device", "ops", "gemms", "collectives", "host")}
    assert extra["gemms"] == GEMMS_PER_CHUNK, extra
    assert extra["collectives"] == COLLECTIVES_PER_CHUNK, extra
    assert extra["device"] <= DEVICE_OPS_PER_CHUNK, extra
    assert extra["ops"] <= OPS_PER_CHUNK, extra
    assert extra["host"] <= HOST_OPS_PER_CHUNK, extra


def test_per_expert_gemms_exceed_the_budget(counts):
    assert per_chunk(counts, "SequentialMLP", "gemms") == SEQUENTIAL_GEMMS_PER_CHUNK
    assert per_chunk(counts, "SequentialMLP", "device") > DEVICE_OPS_PER_CHUNK


def test_one_chunk_adds_no_gemm(counts):
    # parm_s2 at one chunk runs the experts once, as alltoall does: 3 forward + 6 backward
    # GEMMs (router's mm and its two gradients, the experts' 2 + 4)
    assert counts[(GROUPED, "parm_s2@1")]["gemms"] == 9


def test_classifier_sorts_known_operators():
    from megatron_parm.bench.op_count import OpCounter
    from megatron_parm.dispatchers import row_order

    a = torch.randn(4, 4)
    with OpCounter() as counter:
        torch.mm(a, a)
        a.t()
        a.new_empty(3)
        row_order.cut_bounds(torch.tensor([5, 3]), 2)
    kinds = {kind for kind, _ in counter.counts}
    assert counter.counts[("device", "mm")] == 1
    assert counter.counts[("view", "t")] == 1
    assert counter.counts[("alloc", "new_empty")] == 1
    assert "host" in kinds and all(k != "device" for k, name in counter.counts if name != "mm")
