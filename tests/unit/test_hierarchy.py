"""parm_hier's pure parts: the node split of EP groups, its layout groups, its cost plan and
its split sizes (no process groups; the 4- and 8-rank runs are in test_dispatchers.py)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from megatron_parm import schedules
from megatron_parm.comm.accounting import ranks_per_node
from megatron_parm.dispatchers.parm_hier import NodeGroups, NodePlan
from megatron_parm.perf_model import LayerShape, Layout, comm_volumes
from megatron_parm.perf_model.layout import ep_node_blocks


def test_ep_groups_split_by_node():
    # tp_ep block of 8 ranks, ESP 2: EP groups [0,2,4,6] and [1,3,5,7]; 4 ranks per node
    assert ep_node_blocks(range(8), 2, 4) == [[[0, 2], [4, 6]], [[1, 3], [5, 7]]]
    # one EP rank per node; EP inside one node
    assert ep_node_blocks(range(4), 2, 2) == [[[0], [2]], [[1], [3]]]
    assert ep_node_blocks(range(4), 1, 4) == [[[0, 1, 2, 3]]]
    # a group across a node boundary, evenly: two blocks
    assert ep_node_blocks(range(4, 8), 1, 6) == [[[4, 5], [6, 7]]]
    # nodes holding different numbers of the group's ranks: one block per rank
    assert ep_node_blocks(range(4), 1, 3) == [[[0], [1], [2], [3]]]


def test_layout_knows_the_hierarchy_groups():
    layout = Layout(tp=2, ep=4, etp=2, nodes=2, ranks_per_node=4)
    assert layout.group_ranks("ep", 2) == [0, 2, 4, 6]
    assert layout.group_ranks("ep_intra", 2) == [0, 2]
    assert layout.group_ranks("ep_inter", 2) == [2, 6]
    assert (layout.group_size("ep_inter"), layout.group_size("ep_intra")) == (2, 2)
    assert layout.peer_counts("ep_inter") == (0, 1) and layout.peer_counts("ep_intra") == (1, 0)
    inside = Layout(tp=2, ep=2, etp=1, nodes=2, ranks_per_node=2)
    assert inside.group_size("ep_inter") == 1 and inside.group_ranks("ep_intra", 3) == [2, 3]
    one_per_node = Layout(tp=2, ep=4, etp=2, nodes=4, ranks_per_node=2)
    assert one_per_node.group_ranks("ep_inter", 3) == [1, 3, 5, 7]
    assert one_per_node.group_size("ep_intra") == 1


def test_ranks_per_node_setting_wins_and_is_checked(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ranks_per_node(8) == 4 and ranks_per_node(8, 2) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert ranks_per_node(8) == 8  # a launcher value that does not divide the world: one node
    with pytest.raises(ValueError, match="--parm-ranks-per-node \\(3\\) must divide the world size \\(8\\)"):
        ranks_per_node(8, 3)
    with pytest.raises(ValueError, match="--parm-ranks-per-node must be a positive integer"):
        ranks_per_node(8, 0)
    from megatron_parm.config import ParmTransformerConfig

    with pytest.raises(ValueError, match="--parm-ranks-per-node must be a positive integer"):
        ParmTransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, parm_ranks_per_node=0)


@pytest.mark.parametrize("experts,node_experts,topk", [(8, 4, 2), (8, 2, 2), (16, 4, 3), (8, 8, 2), (8, 4, 1)])
def test_node_row_share_is_the_exact_expectation(experts, node_experts, topk):
    """Rows per pair to one node, by enumerating every top-k choice (equally likely)."""
    node = set(range(node_experts))
    choices = list(itertools.combinations(range(experts), topk))
    rows = sum(bool(node & set(c)) for c in choices) / len(choices)
    pairs = sum(len(node & set(c)) for c in choices) / len(choices)
    assert math.isclose(schedules.node_row_share(experts, node_experts, topk), rows / pairs)


SHAPE = LayerShape(num_tokens=64, hidden_size=16, ffn_hidden_size=32, num_experts=8, topk=2,
                   dtype_bytes=4, prob_bytes=4)


@pytest.mark.parametrize("layout", [
    Layout(tp=2, ep=2, etp=2, nodes=2, ranks_per_node=2), Layout(tp=1, ep=4, etp=1, nodes=2, ranks_per_node=2),
    Layout(tp=2, ep=4, etp=2, nodes=2, ranks_per_node=4), Layout(tp=1, ep=8, etp=1, nodes=8, ranks_per_node=1),
    Layout(tp=2, ep=2, etp=1, nodes=2, ranks_per_node=2)], ids=str)
@pytest.mark.parametrize("topk", [1, 2, 4])
def test_hier_moves_at_most_s1s_inter_node_bytes(layout, topk):
    shape = LayerShape(**{**SHAPE.__dict__, "topk": topk})

    def inter(name):
        return sum(v["inter"] for v in comm_volumes(name, shape, layout).values())

    hier, s1 = inter("parm_hier"), inter("parm_s1")
    experts_per_node = shape.num_experts // layout.group_size("ep_inter")
    if s1 == 0:
        assert hier == 0
    elif topk > 1 and experts_per_node > 1:
        assert hier < s1
    else:
        assert hier == pytest.approx(s1)


def test_hier_cost_plan_by_hand():
    """2 nodes x 2 ranks, (1,4,1): K = 2, g = 2, L = 2, G = 4; n = 64, k = 2, E = 8.
    r = k n / E = 16 rows per expert, 64 pairs to a node; rows per pair
    (1 - C(4,2)/C(8,2)) / (2 * 4 / 8) = 22/28, so 64 * 22/28 rows of 68 B and the other
    pairs as 8 B (probability, row index); the relay fans out K r L = 64 pairs of 68 B to
    its node peer. Combine: the same rows / pairs of 64 B. Backward: the same again."""
    layout = Layout(tp=1, ep=4, etp=1, nodes=2, ranks_per_node=2)
    rows = 64 * 22 / 28
    inter = 2 * (rows * 68 + (64 - rows) * 8 + rows * 64)
    intra = 2 * (64 * 68 + 64 * 64)
    volumes = comm_volumes("parm_hier", SHAPE, layout)
    assert volumes.keys() == {("all_to_all", "ep_inter"), ("all_to_all", "ep_intra")}
    assert volumes[("all_to_all", "ep_inter")] == {"intra": 0.0, "inter": pytest.approx(inter)}
    assert volumes[("all_to_all", "ep_intra")] == {"intra": pytest.approx(intra), "inter": 0.0}
    stages = schedules.hierarchical_cost(SHAPE, layout)
    forward = [s for s in stages if s.direction == schedules.FORWARD and s.kind != schedules.COMPUTE]
    backward = [s for s in stages if s.direction == schedules.BACKWARD and s.kind != schedules.COMPUTE]
    assert [(schedules.DUAL[s.kind], s.group, s.bytes_per_peer) for s in reversed(forward)] == \
        [(s.kind, s.group, s.bytes_per_peer) for s in backward]


def test_node_plan_split_sizes():
    """EP 4 over 2 nodes (K = 2, g = 2), 1 local expert, ESP 1; this rank: node 1, position 0
    (EP index 2). counts[j][0][0][x]: pairs of EP rank j to expert x; counts[j][0][1][x]: its
    rows whose primary expert on x's node is x."""
    pairs = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
    primary = torch.tensor([[1, 1, 2, 0], [3, 2, 4, 1], [5, 3, 6, 2], [7, 4, 8, 3]])
    counts = torch.stack([pairs, primary], dim=1).unsqueeze(1)  # [e, s, 2, E]
    groups = NodeGroups(inter=None, intra=None, nodes=2, per_node=2, node=1, position=0)
    plan = NodePlan(counts, groups, me_ep=2, me_etp=0, num_local_experts=1)
    assert plan.rows_out == [5 + 3, 6 + 2]  # my rows to node 0 and node 1 (the latter stays)
    assert plan.secondaries_out == [9 + 10 - 8, 11 + 12 - 8]
    # as relay of node 1, position 0: from EP ranks 0 and 2 (position 0 of each node)
    assert plan.rows_in == [2 + 0, 6 + 2]
    assert plan.secondaries_in == [3 + 4 - 2, 11 + 12 - 8]
    assert plan.pairs_out == [3 + 11, 4 + 12]  # to node 1's members: experts 2 and 3
    assert plan.pairs_in == [3 + 11, 7 + 15]  # to my expert 2 from relays 0 (me) and 1
    primaries, secondaries = plan.relay_counts()
    assert primaries.tolist() == [[2, 0], [6, 2]] and secondaries.tolist() == [[1, 4], [5, 10]]
    # S1's member side, its sources in arrival order [relay][source node]: EP 0, 2, 1, 3
    assert plan.member.gathered_chunk_sizes().tolist() == [3, 11, 7, 15]
    assert plan.member.etp_split_sizes() == [36]


def test_the_model_prefers_hier_only_where_its_rows_pay():
    """Fewer inter-node rows against the relay's extra passes: parm_hier predicts faster than
    S1 for a large top-2 layer across nodes, not for a tiny one, and never for top-1."""
    from megatron_parm.perf_model import load_profile, predict

    # the nvlink preset's estimate: a property of the model, not of one (noisy) calibration
    profile = load_profile("emulated_nvlink")
    layout = Layout(tp=2, ep=2, etp=2, nodes=2, ranks_per_node=2)

    def ratio(**fields):
        shape = LayerShape(**{**SHAPE.__dict__, **fields})
        return (predict("parm_hier", shape, layout, profile).total_s
                / predict("parm_s1", shape, layout, profile).total_s)

    assert ratio(num_tokens=4096, hidden_size=256) < 0.95
    assert ratio(num_tokens=8) > 1.0
    assert ratio(num_tokens=4096, hidden_size=256, topk=1) > 1.0


def test_the_planner_counts_expert_rows_not_the_relay_passes():
    """The planner's memory model reads the rows through the experts from the cost plan's
    expert stage; parm_hier's relay passes are compute stages too but carry no expert rows."""
    from megatron_parm.perf_model.memory import expert_rows

    layout = Layout(tp=1, ep=4, etp=1, nodes=2, ranks_per_node=2)
    assert expert_rows(SHAPE, layout, "parm_hier") == pytest.approx(expert_rows(SHAPE, layout, "parm_s1"))
