"""Pure logic of the dispatchers: layout checks, routing plans, chunking, the S2 schedule."""

from __future__ import annotations

import pytest
import torch

from megatron_parm.dispatchers.base import RoutingPlan
from megatron_parm.dispatchers.parm_s2 import run_pipeline
from megatron_parm import schedules
from megatron_parm.parallel import validate_layout


@pytest.mark.parametrize("args,flag", [
    (dict(world_size=4, tp=2, ep=2, etp=2, num_experts=3), "--num-experts"),
    (dict(world_size=4, tp=2, ep=1, etp=3), "--expert-tensor-parallel-size"),
    (dict(world_size=6, tp=4, ep=1, etp=1), "--tensor-model-parallel-size"),
    (dict(world_size=4, tp=1, ep=4, etp=2), "--expert-tensor-parallel-size x --expert-model-parallel-size"),
    (dict(world_size=4, tp=1, ep=2, etp=2, dispatcher="ds_baseline"), "--expert-tensor-parallel-size"),
    (dict(world_size=4, tp=2, ep=2, etp=2, dispatcher="fastest"), "--moe-token-dispatcher-type"),
    (dict(world_size=4, tp=0, ep=2, etp=2), "--tensor-model-parallel-size"),
])
def test_bad_layouts_name_the_flag(args, flag):
    with pytest.raises(ValueError, match=flag.replace("+", r"\+")):
        validate_layout(**args)


@pytest.mark.parametrize("layout", [(2, 2, 2), (1, 4, 1), (2, 2, 1), (4, 1, 4), (1, 2, 1)])
def test_good_layouts_pass(layout):
    tp, ep, etp = layout
    validate_layout(4, tp, ep, etp, num_experts=8, dispatcher="ds_baseline" if tp % etp == 0 else None)


def test_unknown_dispatcher_lists_valid_names():
    with pytest.raises(ValueError) as err:
        schedules.get("parm_s3")
    for name in ("alltoall", "allgather", "ds_baseline", "parm_s1", "parm_s2"):
        assert name in str(err.value)


def test_routing_plan_splits():
    # e = 2 EP ranks, s = 2 ESP ranks, E = 4 experts (2 local). counts[j][q][x].
    counts = torch.arange(16).view(2, 2, 4)
    plan = RoutingPlan(counts, me_ep=1, me_etp=0, num_local_experts=2)
    mine = counts[1, 0]  # [8, 9, 10, 11]
    assert plan.a2a_input_splits() == [8 + 9, 10 + 11]
    # from EP peer j (ESP 0) to my experts 2, 3
    assert plan.a2a_output_splits() == [2 + 3, 10 + 11]
    # ESP peer q holds what its EP group sent to experts 2, 3
    assert plan.etp_split_sizes() == [2 + 3 + 10 + 11, 6 + 7 + 14 + 15]
    assert plan.gathered_chunk_sizes().tolist() == [2, 3, 10, 11, 6, 7, 14, 15]
    assert plan.tokens_per_local_expert().tolist() == [2 + 10 + 6 + 14, 3 + 11 + 7 + 15]
    assert mine.sum() == sum(plan.a2a_input_splits())


def test_pipeline_overlaps_neighbouring_chunks():
    """S2's schedule: chunk i+1's first A2A is issued before chunk i's experts run, and
    chunk i-1's return A2A before chunk i's experts; results come back in chunk order."""
    log = []

    class Done:
        def __init__(self, value):
            self.value = value

        def wait(self):
            return self.value

    def stage(name):
        def start(i, value=(0,)):
            log.append((name, i))
            return Done((value[0] + 1,))
        return start

    def compute(i, value):
        log.append(("compute", i))
        return (value[0] * 10,)

    out = run_pipeline(4, stage("A"), stage("B"), compute, stage("C"), stage("D"))
    assert len(out) == 4
    assert out == [((1 + 1) * 10 + 2,)] * 4
    issued = log
    for i in range(3):
        assert issued.index(("A", i + 1)) < issued.index(("compute", i))
    for i in range(1, 4):
        assert issued.index(("D", i - 1)) < issued.index(("compute", i))
    assert [e[1] for e in issued if e[0] == "compute"] == [0, 1, 2, 3]
