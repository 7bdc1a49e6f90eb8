"""The layout planner: parameter shards, memory, step time, the ranking and its CLIs (pure
Python; the counts against Megatron-Core's own model are in
tests/distributed/test_planner_memory.py)."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from megatron_parm import schedules
from megatron_parm.perf_model import load_profile, predict
from megatron_parm.perf_model.layout import Layout
from megatron_parm.perf_model.memory import (GIB, Precision, activation_bytes, layer_shape,
                                             memory_per_rank, microbatches_in_flight,
                                             stage_activation_bytes, stage_parameter_counts)
from megatron_parm.perf_model.planner import (Cluster, PlanError, _dispatchers_for,
                                              _merge_equivalents, enumerate_layouts, plan,
                                              virtual_stage_counts)
from megatron_parm.perf_model.recompute import NONE, Recompute
from megatron_parm.perf_model.step_time import (collective_seconds, layer_gemm_flops,
                                                pipeline_link, stage_times, step_time)
from megatron_parm.perf_model.transformer import (ModelSpec, check_layout, padded_vocab_size,
                                                  parameter_counts, per_rank_spec)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAN_LAYOUT = os.path.join(REPO, "tools", "plan_layout.py")
sys.path.insert(0, os.path.join(REPO, "tools"))

import validate_planner  # noqa: E402

PROFILE = load_profile("emulated_pcie_measured")
TINY = dict(model_type="gpt", num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64,
            vocab_size=8000, num_experts=4, moe_ffn_hidden_size=256, topk=2)


def tiny(**overrides):
    return ModelSpec(**{**TINY, **overrides})


def layout(tp, ep, etp, nodes=2, ranks_per_node=2, pp=1):
    return Layout(tp=tp, ep=ep, etp=etp, nodes=nodes, ranks_per_node=ranks_per_node, pp=pp)


# ---------------------------------------------------------------- parameters

def test_padded_vocab_is_a_multiple_of_128_tp():
    assert padded_vocab_size(8000, 1) == 8064
    assert padded_vocab_size(8000, 4) == 8192
    assert padded_vocab_size(8192, 2) == 8192


def test_parameters_shard_as_megatron_lays_them_out():
    spec = tiny()
    whole = parameter_counts(spec, 1, 1, 1)
    # experts: E/e of them per rank, each with F/x of its FFN
    assert parameter_counts(spec, 1, 4, 1).expert == whole.expert // 4
    assert parameter_counts(spec, 1, 2, 2).expert == whole.expert // 4
    assert whole.expert == 2 * 4 * 2 * 64 * 256
    # attention shards over TP; LayerNorms and routers do not
    h = 64
    assert whole.dense - parameter_counts(spec, 2, 1, 1).dense == 2 * (4 * h * h) // 2
    # the word embedding shards over TP (with the TP-dependent padding)
    assert parameter_counts(spec, 2, 1, 1).embedding == 8192 // 2 * h + 64 * h  # 8000 -> 8192
    untied = parameter_counts(tiny(untie_embeddings_and_output_weights=True), 1, 1, 1)
    assert untied.embedding - whole.embedding == 8064 * h


def test_layout_checks_name_the_flag():
    assert check_layout(tiny(), layout(1, 4, 1)) is None
    assert "--num-experts" in check_layout(tiny(num_experts=6), layout(1, 4, 1))
    assert "--num-attention-heads" in check_layout(tiny(num_attention_heads=2), layout(4, 1, 1))
    assert "--disable-bias-linear" in check_layout(tiny(add_bias_linear=True), layout(2, 2, 2))
    with pytest.raises(ValueError, match="--moe-router-topk"):
        tiny(topk=5)


def test_data_parallel_groups_follow_megatrons_rank_order():
    lay = layout(2, 2, 1, nodes=2, ranks_per_node=4)  # 8 ranks
    assert lay.group_ranks("dp", 5) == [1, 3, 5, 7]
    assert lay.group_ranks("expt_dp", 5) == [1, 3, 5, 7]
    assert layout(1, 4, 1).group_ranks("expt_dp", 2) == [2]
    assert layout(1, 4, 1).group_size("dp") == 4
    assert layout(1, 1, 1).peer_counts("dp") == (1, 2)


# ---------------------------------------------------------------- memory

@pytest.mark.parametrize("precision,plain,sharded", [
    ("fp32", 16, (8, 8)),     # Megatron's table: 16 and 8 + 8/d bytes per parameter
    ("bf16", 18, (6, 12)),    # 18 and 6 + 12/d (fp32 gradients)
])
def test_model_state_bytes_per_parameter(precision, plain, sharded):
    spec, lay = tiny(), layout(1, 1, 1)  # dp = edp = 4
    params = parameter_counts(spec, 1, 1, 1).total
    state = memory_per_rank(spec, lay, 4, Precision(precision))
    assert state.weights + state.gradients + state.optimizer == plain * params
    state = memory_per_rank(spec, lay, 4, Precision(precision), distributed_optimizer=True)
    fixed, divided = sharded
    assert state.weights + state.gradients + state.optimizer == pytest.approx(
        fixed * params + divided * params / 4)


def test_activations_shrink_with_tp_and_grow_with_the_batch():
    spec, fp32 = tiny(), Precision("fp32")
    one = activation_bytes(spec, layout(1, 1, 1), 4, fp32)
    assert activation_bytes(spec, layout(2, 2, 2), 4, fp32) < 0.6 * one
    assert activation_bytes(spec, layout(1, 1, 1), 8, fp32) == pytest.approx(2 * one, rel=0.01)
    assert activation_bytes(spec, layout(1, 1, 1), 4, Precision("bf16")) < one
    # ds_baseline routes all t*n tokens on every TP rank: more expert rows than S1 at etp < tp
    assert activation_bytes(spec, layout(2, 2, 1), 4, fp32, "ds_baseline") > \
        activation_bytes(spec, layout(2, 2, 1), 4, fp32, "parm_s1")
    assert activation_bytes(tiny(hidden_dropout=0.1, attention_dropout=0.1), layout(1, 1, 1),
                            4, fp32) > one
    # BERT's binary head: token-type ids (8 b s), and the pooler all-gathers the
    # sequence-parallel shards for its first token: s b h p more
    bert = tiny(model_type="bert")
    for tp, extra in ((1, 8 * 4 * 64), (2, 8 * 4 * 64 + 64 * 4 * 64 * 4)):
        assert activation_bytes(bert, layout(tp, 1, 1), 4, fp32) - activation_bytes(
            dataclasses.replace(bert, bert_binary_head=False), layout(tp, 1, 1), 4, fp32) == extra


# ---------------------------------------------------------------- step time

def test_step_time_adds_up():
    spec, lay, fp32 = tiny(), layout(2, 2, 2), Precision("fp32")
    step = step_time(spec, lay, PROFILE, "parm_s2", 2, 4, 16, fp32)
    moe = predict("parm_s2", layer_shape(spec, lay, 4, fp32), lay, PROFILE, 2)
    assert step.moe_s == pytest.approx(2 * moe.total_s)
    assert step.num_microbatches == 2  # 16 / (4 * dp 2)
    assert step.framework_s == pytest.approx(PROFILE.microbatch_overhead
                                             + spec.num_layers * PROFILE.layer_overhead)
    assert step.step_s == pytest.approx(2 * (step.moe_s + step.dense_compute_s + step.tp_comm_s
                                             + step.framework_s) + step.grad_reduce_s)
    assert step.tokens_per_s == pytest.approx(16 * 64 / step.step_s)
    assert step.tp_comm_s > 0 and step.grad_reduce_s > 0
    alone = step_time(spec, layout(1, 1, 1, nodes=1, ranks_per_node=1), PROFILE, "parm_s1",
                      None, 4, 16, fp32)
    assert alone.tp_comm_s == 0 and alone.grad_reduce_s == 0  # one rank: nothing to reduce
    with pytest.raises(ValueError, match="--global-batch-size"):
        step_time(spec, lay, PROFILE, "parm_s1", None, 4, 12, fp32)


# ---------------------------------------------------------------- pipeline parallelism

def test_pipeline_stages_are_outermost_in_megatrons_rank_order():
    # 2 nodes x 2 ranks at pp 2: a stage per node, every p2p send crosses nodes
    lay = layout(1, 2, 1, pp=2)
    assert lay.stage_size == 2 and [lay.stage_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert lay.group_ranks("ep", 3) == [2, 3] and lay.group_ranks("dp", 2) == [2, 3]
    assert lay.group_ranks("pp", 1) == [1, 3] and lay.group_size("pp") == 2
    assert lay.is_intra("ep") and lay.is_intra("dp") and not lay.is_intra("pp")
    assert pipeline_link(lay) == "inter"
    # one node of 4: the stages share it; 2 nodes x 4 at pp 2 with tp 2: TP in a node, DP too
    assert pipeline_link(layout(1, 1, 1, nodes=1, ranks_per_node=4, pp=2)) == "intra"
    big = layout(2, 2, 1, nodes=2, ranks_per_node=4, pp=2)
    assert big.group_ranks("dp", 5) == [5, 7] and big.group_ranks("tp", 5) == [4, 5]
    assert big.group_ranks("pp", 5) == [1, 5] and pipeline_link(big) == "inter"
    assert pipeline_link(layout(1, 1, 1)) is None
    with pytest.raises(ValueError, match="pp=3"):
        layout(1, 1, 1, pp=3)


def test_microbatches_the_1f1b_schedule_holds():
    # 1F1B: stage i holds pp - i micro-batches (at most all m of them)
    assert [microbatches_in_flight(4, stage, 8) for stage in range(4)] == [4, 3, 2, 1]
    assert microbatches_in_flight(4, 0, 2) == 2
    # interleaved, v chunks of L / (p v) layers: the first stage holds L (1 + (p-1)/(p v))
    pp, vpp = 4, 2
    chunks = microbatches_in_flight(pp, 0, 16, vpp)
    assert chunks / vpp == pytest.approx(pp * (1 + (pp - 1) / (pp * vpp)))
    assert microbatches_in_flight(pp, 0, 1, vpp) == vpp  # one micro-batch: all its chunks


def test_stage_memory():
    spec, fp32 = tiny(num_layers=4), Precision("fp32")
    whole = parameter_counts(spec, 1, 1, 1)
    lay = layout(1, 1, 1, pp=2)
    first, last = (stage_parameter_counts(spec, lay, stage, 2) for stage in (0, 1))
    word = 8064 * 64
    # the layers split in two, the embeddings on the first stage, a copy of them last (tied)
    assert first.expert + last.expert == whole.expert
    assert first.embedding == whole.embedding and last.embedding == word
    assert first.total + last.total == whole.total + word
    # the first stage holds pp micro-batches of its L / pp layers: the whole model's layers
    one_layer = (activation_bytes(tiny(num_layers=2), lay, 4, fp32)
                 - activation_bytes(tiny(num_layers=1), lay, 4, fp32))
    bytes0, held0 = stage_activation_bytes(spec, lay, 4, fp32, stage=0, num_microbatches=8)
    bytes1, held1 = stage_activation_bytes(spec, lay, 4, fp32, stage=1, num_microbatches=8)
    assert (held0, held1) == (2, 1)
    # the model-level terms once per micro-batch held, the attention mask (b s^2) on each stage
    mask = 4 * 64 * 64
    ends = activation_bytes(spec, lay, 4, fp32) - 4 * one_layer
    assert (bytes0 - 4 * one_layer) / 2 + bytes1 - 2 * one_layer == pytest.approx(ends + mask)
    interleaved, _ = stage_activation_bytes(spec, lay, 4, fp32, 0, 8, vpp=2)
    # (1 + 1/4) of 4 layers, a mask for each of the 5 (micro-batch, chunk) pairs (2 before)
    assert interleaved == pytest.approx(bytes0 + one_layer + 3 * mask)
    # the layout's memory is its fullest stage's (here the last: the logits)
    memory = memory_per_rank(spec, lay, 4, fp32, num_microbatches=8)
    assert (memory.stage, memory.activations, memory.microbatches_in_flight) == (1, bytes1, 1)
    assert memory.weights == 4 * last.total and bytes0 < bytes1
    with pytest.raises(ValueError, match="--num-layers"):
        memory_per_rank(tiny(num_layers=3), lay, 4, fp32)


def test_pipelined_step_time():
    spec, fp32 = tiny(num_layers=4), Precision("fp32")
    flat = step_time(spec, layout(1, 2, 1), PROFILE, "alltoall", None, 2, 16, fp32)
    assert (flat.pp, flat.bubble_s, flat.p2p_s, flat.bubble_share) == (1, 0.0, 0.0, 0.0)
    lay = layout(1, 2, 1, pp=2)
    step = step_time(spec, lay, PROFILE, "alltoall", None, 2, 16, fp32)
    assert step.num_microbatches == 4  # 16 / (2 x dp 2)
    assert step.p2p_link == "inter" and step.p2p_bytes == 64 * 2 * 64 * 4  # [s, b, h] fp32
    stages = [sum(stage.values()) for stage in stage_times(spec, lay, PROFILE, step.moe_layer,
                                                           2, fp32)]
    assert step.bubble_s == pytest.approx(sum(stages) - max(stages))
    assert step.microbatch_s + step.p2p_s == pytest.approx(max(stages))
    assert step.step_s == pytest.approx(4 * max(stages) + step.bubble_s + step.grad_reduce_s)
    # equal stages: the bubble is (pp - 1) / (m + pp - 1) of the pipelined time
    assert step.bubble_share == pytest.approx(1 / 5, rel=0.5)
    assert step.moe_s == pytest.approx(2 * step.moe_layer.total_s)  # 2 of the 4 layers
    sp = step_time(spec, layout(2, 1, 1, pp=2), PROFILE, "alltoall", None, 2, 16, fp32)
    assert sp.p2p_bytes == 64 // 2 * 2 * 64 * 4  # sequence parallel: [s / t, b, h]
    # interleaving halves the bubble of stages without framework time (a profile's per
    # micro-batch and per layer terms are charged per virtual stage, and the shipped ones move)
    lean = dataclasses.replace(PROFILE, microbatch_overhead=0.0, layer_overhead=0.0)
    step = step_time(spec, lay, lean, "alltoall", None, 2, 16, fp32)
    interleaved = step_time(spec, lay, lean, "alltoall", None, 2, 16, fp32, vpp=2)
    assert interleaved.bubble_s == pytest.approx(step.bubble_s / 2, rel=0.2)
    assert interleaved.p2p_s > step.p2p_s
    with pytest.raises(ValueError, match="fewer than --pipeline-model-parallel-size"):
        step_time(spec, layout(1, 1, 1, pp=4), PROFILE, "alltoall", None, 4, 12, fp32)


def test_plan_searches_pipeline_layouts():
    spec = tiny(num_layers=4)
    result = plan(spec, Cluster(2, 2, GIB), PROFILE, 2, 16, Precision("fp32"),
                  fixed={"pp": 2, "ep": 2})
    assert {(c.layout.pp, c.layout.ep) for c in result.candidates} == {(2, 2)}
    best = result.candidates[0]
    flags = best.flags()
    assert flags[flags.index("--pipeline-model-parallel-size") + 1] == "2"
    assert best.dp == 2 and best.as_dict()["pp"] == 2
    assert best.step.bubble_s > 0 and best.memory.microbatches_in_flight >= 1
    assert "--pipeline-model-parallel-size" not in plan(
        spec, Cluster(2, 2, GIB), PROFILE, 2, 16, Precision("fp32"),
        fixed={"pp": 1}).candidates[0].flags()


def test_context_parallel_splits_each_sequence_and_gathers_keys_and_values():
    """cp=2: Megatron's rank order [dp][cp][tp] (the CP group strides by t, the gradients
    reduce over data x context ranks, the batch splits over the data-parallel ones); a CP rank
    routes and computes half of each sequence but its queries see all keys, and pays the
    gathers of keys and values; the planner plans the given cp (world = tp x cp x pp x dp)."""
    cp = Layout(tp=2, ep=2, etp=1, nodes=2, ranks_per_node=4, cp=2)
    assert cp.group_ranks("cp", 5) == [5, 7] and cp.group_ranks("tp", 5) == [4, 5]
    assert cp.group_size("dp") == 4 and cp.data_parallel_size == 2
    with pytest.raises(ValueError, match="tp \\* cp"):
        Layout(tp=2, ep=1, etp=1, nodes=1, ranks_per_node=2, cp=2)
    spec, fp32 = tiny(), Precision("fp32")
    plain = Layout(tp=2, ep=2, etp=1, nodes=2, ranks_per_node=4)
    assert layer_shape(per_rank_spec(spec, 2), cp, 4, fp32).num_tokens * 2 == \
        layer_shape(spec, plain, 4, fp32).num_tokens
    gemms, whole = layer_gemm_flops(per_rank_spec(spec, 2), cp, 4), layer_gemm_flops(spec, plain, 4)
    for module in ("core_attn", "qkv"):  # half the queries (over all keys), half the tokens
        assert gemms[module] == tuple(flops / 2 for flops in whole[module])
    step = step_time(spec, cp, PROFILE, "alltoall", None, 4, 16, fp32)
    assert step.cp_comm_s > 0 and step.num_microbatches == 2  # 16 / (4 x dp 2)
    assert step_time(spec, plain, PROFILE, "alltoall", None, 4, 16, fp32).cp_comm_s == 0
    result = plan(spec, Cluster(2, 4, GIB), PROFILE, 2, 16, fp32, fixed={"cp": 2})
    assert {c.layout.cp for c in result.candidates} == {2}
    best = result.candidates[0]
    assert best.flags()[best.flags().index("--context-parallel-size") + 1] == "2"
    assert best.dp * best.layout.tp * 2 * best.layout.pp == 8
    with pytest.raises(PlanError, match="multiple of 2 x --context-parallel-size"):
        plan(tiny(seq_length=62), Cluster(2, 4, GIB), PROFILE, 2, 16, fp32, fixed={"cp": 2})


def _by_schedule(result, **sizes):
    """{vpp: candidate} of one layout and dispatcher of a plan."""
    return {c.vpp: c for c in result.candidates
            if all(getattr(c.layout, key) == value for key, value in sizes.items())
            and c.dispatcher == "alltoall"}


def test_virtual_stage_counts_follow_megatrons_rules():
    # a stage's layers split evenly into v virtual stages, at most one layer each
    assert virtual_stage_counts(tiny(num_layers=8), 2, 4) == [None, 2, 4]
    assert virtual_stage_counts(tiny(num_layers=6), 2, 4) == [None, 3]  # 6 % (2 x 2)
    assert virtual_stage_counts(tiny(num_layers=4), 4, 4) == [None]  # one layer a stage
    # the micro-batches run in groups of pp: 3 at pp 2 leave a short group
    assert virtual_stage_counts(tiny(num_layers=4), 2, 3) == [None]
    assert virtual_stage_counts(tiny(num_layers=4), 1, 4) == [None]


def test_plan_ranks_interleaved_pipelines():
    spec, fp32 = tiny(num_layers=4), Precision("fp32")
    result = plan(spec, Cluster(2, 2, GIB), PROFILE, 2, 16, fp32, fixed={"pp": 2})
    plain, interleaved = (_by_schedule(result, tp=1, ep=2, etp=1)[vpp] for vpp in (None, 2))
    assert {c.vpp for c in result.candidates} == {None, 2}
    # the candidate carries its vpp through the step model: (sum - max) / vpp of its stages
    lay, m = interleaved.layout, interleaved.step.num_microbatches
    stages = [sum(stage.values()) for stage in stage_times(
        spec, lay, PROFILE, interleaved.step.moe_layer, 2, fp32, vpp=2)]
    assert interleaved.step.bubble_s == pytest.approx((sum(stages) - max(stages)) / 2)
    assert interleaved.step.bubble_s < plain.step.bubble_s
    # ... and the memory model: more (micro-batch, model chunk) pairs in flight
    assert interleaved.memory == memory_per_rank(spec, lay, 2, fp32, False, "alltoall", m, 2)
    assert microbatches_in_flight(2, 0, m, 2) / 2 > microbatches_in_flight(2, 0, m)
    assert interleaved.memory.activations > plain.memory.activations
    # what the user passes and reads
    flags = interleaved.flags()
    assert flags[flags.index("--num-layers-per-virtual-pipeline-stage") + 1] == "1"
    assert "--num-layers-per-virtual-pipeline-stage" not in plain.flags()
    assert (interleaved.as_dict()["vpp"], plain.as_dict()["vpp"]) == (2, None)
    assert interleaved.describe() == "tp=1 ep=2 etp=1 pp=2 vpp=2 alltoall"
    # alike but for vpp: two rows, not one
    twin = dataclasses.replace(plain, dispatcher="parm_s1", layers_per_virtual_stage=1,
                               step=dataclasses.replace(plain.step, vpp=2))
    assert len(_merge_equivalents([plain, twin])) == 2


@pytest.mark.parametrize("num_layers,global_batch_size,allowed", [
    (6, 16, {None, 3}),   # 3 layers a stage: not 2 virtual stages, 3 of one layer
    (4, 12, {None}),      # 3 micro-batches at pp 2: no whole group of pp for interleaving
])
def test_plan_interleaves_only_what_megatron_accepts(num_layers, global_batch_size, allowed):
    result = plan(tiny(num_layers=num_layers), Cluster(2, 2, GIB), PROFILE, 2,
                  global_batch_size, Precision("fp32"), fixed={"pp": 2, "tp": 1})
    assert {c.vpp for c in result.candidates} == allowed


def test_interleaved_flags_parse_in_training(prepared_data, monkeypatch):
    from megatron_parm import planner_inputs
    from megatron_parm.training.arguments import parse_args

    monkeypatch.chdir(REPO)  # the config's data and tokenizer paths
    config = ["--config", "configs/gpt2_tiny_moe.yaml", "--num-layers", "8"]
    _, settings, _ = planner_inputs.resolve_settings(
        planner_inputs.build_parser(), config + ["--nproc-per-node", "2",
                                                 "--parm-profile", "emulated_pcie_measured"])
    spec = planner_inputs.build_spec(settings, "gpt")
    result = plan(spec, Cluster(2, 2, GIB), PROFILE, 4, 32, Precision("fp32"), fixed={"pp": 2})
    interleaved = [c for c in result.candidates if c.vpp]
    assert {c.vpp for c in interleaved} == {2, 4}
    for candidate in interleaved:
        args = parse_args(config + candidate.flags(), world_size=4)
        assert args.virtual_pipeline_model_parallel_size == candidate.vpp
        assert args.num_microbatches == candidate.step.num_microbatches


def test_collectives_cost_nothing_on_one_rank_and_more_across_nodes():
    assert collective_seconds(PROFILE, layout(1, 1, 1), "all_reduce", "tp", 1e6) == 0
    inside = collective_seconds(PROFILE, layout(2, 1, 1), "all_gather", "tp", 1e6)
    across = collective_seconds(PROFILE, layout(4, 1, 1), "all_gather", "tp", 1e6)
    assert 0 < inside < across


# ---------------------------------------------------------------- planner

def test_dispatchers_follow_the_layout_rules():
    allowed, refused = _dispatchers_for(layout(2, 2, 2))
    assert [s.name for s in allowed] == ["allgather", "alltoall", "ds_baseline", "parm_s1",
                                         "parm_s2", "parm_hier", "parm_hier_s2"]
    assert "parm_s1" in refused["parm"] and "allgather" in refused["parm"]
    allowed, refused = _dispatchers_for(layout(1, 2, 2))
    assert "ds_baseline" not in [s.name for s in allowed]
    assert "--expert-tensor-parallel-size" in refused["ds_baseline"]
    _, refused = _dispatchers_for(layout(2, 2, 2), sequence_parallel=False)
    assert "--sequence-parallel" in refused["alltoall"] and "--sequence-parallel" in refused["allgather"]


def test_a_schedule_added_to_the_catalog_is_planned():
    def only_ep_4(tp, ep, etp):
        return None if ep == 4 else "--moe-token-dispatcher-type plan_toy needs ep 4"

    toy = schedules.Schedule("plan_toy", schedules.PARM, "a test's schedule",
                             dispatcher="nowhere:Toy", layout_rule=only_ep_4,
                             cost_plan=schedules.baseline_cost)
    schedules.register(toy)
    try:
        result = plan(tiny(), Cluster(2, 2, GIB), PROFILE, 4, 16, Precision("fp32"))
        toys = [c for c in result.candidates if "plan_toy" in c.schedule_label()]
        assert toys and all(c.layout.ep == 4 for c in toys)
        assert "needs ep 4" in _dispatchers_for(layout(2, 2, 2))[1]["plan_toy"]
    finally:
        schedules.unregister("plan_toy")


def test_enumerates_every_layout_of_four_ranks():
    layouts, skipped = enumerate_layouts(tiny(), Cluster(2, 2, GIB), 4, 16)
    sizes = {(lay.tp, lay.ep, lay.etp, lay.pp) for lay in layouts}
    # pp 1: tp in 1,2,4 x (ep, etp) with ep * etp | 4; pp 2 (2 ranks a stage): 2 x 3
    assert len(sizes) == 3 * 6 + 2 * 3
    assert (4, 4, 1, 1) in sizes and (1, 2, 2, 1) in sizes and (2, 1, 1, 2) in sizes
    assert "--num-layers (2) must be divisible by --pipeline-model-parallel-size (4)" in \
        skipped[(1, 1, 1, 4)]
    layouts, skipped = enumerate_layouts(tiny(num_experts=2), Cluster(2, 2, GIB), 4, 16)
    assert "--num-experts" in skipped[(1, 4, 1, 1)]
    # at most one micro-batch per stage at pp 2: fewer micro-batches than stages
    _, skipped = enumerate_layouts(tiny(), Cluster(2, 2, GIB), 4, 8)
    assert "fewer than --pipeline-model-parallel-size (2)" in skipped[(1, 1, 1, 2)]


def test_plan_ranks_fitting_candidates_fastest_first():
    result = plan(tiny(), Cluster(2, 2, GIB), PROFILE, 4, 16, Precision("fp32"))
    times = [candidate.step.step_s for candidate in result.candidates]
    assert times == sorted(times)
    labels = {candidate.schedule_label() for candidate in result.candidates}
    assert {"parm_s2(c=2)", "parm_s2(c=4)", "parm_s2(c=8)"} <= labels
    best = result.candidates[0]
    flags = best.flags()
    for flag in ("--tensor-model-parallel-size", "--expert-model-parallel-size",
                 "--expert-tensor-parallel-size", "--moe-token-dispatcher-type",
                 "--global-batch-size"):
        assert flag in flags
    # a tight budget: the candidates that fit come first, the others say by how much
    budget = sorted(c.memory.total for c in result.candidates)[len(result.candidates) // 2]
    tight = plan(tiny(), Cluster(2, 2, budget), PROFILE, 4, 16, Precision("fp32"))
    fits = [candidate.fits for candidate in tight.candidates]
    assert fits == sorted(fits, reverse=True) and not all(fits)
    assert all(c.spare_bytes < 0 for c in tight.candidates if not c.fits)


def test_plan_fixed_sizes_and_dispatchers():
    result = plan(tiny(), Cluster(2, 2, GIB), PROFILE, 4, 16, Precision("fp32"),
                  fixed={"tp": 2, "etp": 2}, dispatchers=["parm_s2"])
    assert {(c.layout.tp, c.layout.etp, c.dispatcher) for c in result.candidates} == \
        {(2, 2, "parm_s2")}


@pytest.mark.parametrize("kwargs,message", [
    (dict(fixed={"tp": 3}), "--tensor-model-parallel-size (3) must divide the world size (4)"),
    (dict(fixed={"ep": 8}), "--expert-model-parallel-size (8) must divide the world size"),
    (dict(global_batch_size=10), "--global-batch-size (10) must be divisible"),
    (dict(gpu_memory=1e6), "needs 0.00631 GiB per rank; try a smaller --micro-batch-size"),
])
def test_impossible_plans_say_what_to_change(kwargs, message):
    gpu_memory = kwargs.pop("gpu_memory", GIB)
    arguments = dict(micro_batch_size=4, global_batch_size=16, precision=Precision("fp32"))
    arguments.update(kwargs)
    with pytest.raises(PlanError, match=re.escape(message)):
        plan(tiny(), Cluster(2, 2, gpu_memory), PROFILE, **arguments)


def test_nothing_fits_suggests_the_distributed_optimizer_where_it_helps():
    spec = tiny(num_attention_heads=2)  # tp <= 2: every layout keeps data parallelism
    no_pipeline = {"pp": 1}  # (pp 2 x tp 2 would leave none)

    def smallest(distributed):
        return min(memory_per_rank(spec, lay, 4, Precision("fp32"), distributed).total
                   for lay in enumerate_layouts(spec, Cluster(2, 2, GIB), 4, 16,
                                                no_pipeline)[0])

    plain, sharded = smallest(False), smallest(True)
    assert sharded < plain
    # without activation recomputation (which would make it fit: test_planner_recompute.py)
    with pytest.raises(PlanError, match=r"try --use-distributed-optimizer \(then"):
        plan(spec, Cluster(2, 2, (plain + sharded) / 2), PROFILE, 4, 16, Precision("fp32"),
             fixed=no_pipeline, recompute=NONE)
    result = plan(spec, Cluster(2, 2, (plain + sharded) / 2), PROFILE, 4, 16,
                  Precision("fp32"), distributed_optimizer=True, fixed=no_pipeline,
                  recompute=NONE)
    assert result.candidates[0].fits and "--use-distributed-optimizer" in \
        result.candidates[0].flags()


# ---------------------------------------------------------------- tools/plan_layout.py

def _plan_layout(*args):
    return subprocess.run([sys.executable, PLAN_LAYOUT, *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO)


CLUSTER = ["--nnodes", "2", "--nproc-per-node", "2", "--parm-profile", "emulated_pcie_measured"]


def test_plan_layout_table_and_json_for_a_shipped_config():
    result = _plan_layout("--config", "configs/gpt2_tiny_moe.yaml", *CLUSTER, "--top", "5")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.lstrip().startswith("1 ") for line in lines)
    assert "tokens/s" in result.stdout and "memory/rank" in result.stdout
    assert "pretrain_scripts/pretrain_gpt2_moe.py --config configs/gpt2_tiny_moe.yaml " \
           "--tensor-model-parallel-size" in result.stdout
    assert "not used by the planner" in result.stderr and "lr" in result.stderr
    result = _plan_layout("--config", "configs/gpt2_tiny_moe.yaml", *CLUSTER, "--num-layers", "4",
                          "--show-flags", "1")
    launch = [line for line in result.stdout.splitlines() if "pretrain_gpt2_moe.py" in line]
    assert len(launch) == 1 and "--num-layers 4 --tensor-model-parallel-size" in launch[0]

    result = _plan_layout("--config", "configs/bert_base_moe.yaml", "--model-type", "bert",
                          *CLUSTER, "--bf16", "--use-distributed-optimizer", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["precision"] == "bf16" and report["model"]["vocab_size"] == 8000
    first = report["candidates"][0]
    assert "--bf16" in first["flags"] and "--use-distributed-optimizer" in first["flags"]
    assert first["fits"] and first["memory_bytes"]["total"] > 0
    steps = [c["step"]["step_s"] for c in report["candidates"] if c["fits"]]
    assert steps == sorted(steps)


def test_plan_layout_shows_interleaved_pipelines():
    result = _plan_layout("--config", "configs/gpt2_tiny_moe.yaml", *CLUSTER, "--num-layers", "4",
                          "--pipeline-model-parallel-size", "2", "--top", "0", "--show-flags", "30")
    assert result.returncode == 0, result.stderr
    header = next(line for line in result.stdout.splitlines() if line.lstrip().startswith("#"))
    assert header.split()[:7] == ["#", "tp", "ep", "etp", "pp", "vpp", "dp"]
    rows = [line.split() for line in result.stdout.splitlines() if re.match(r"^ *\d+ ", line)]
    assert {row[5] for row in rows} == {"-", "2"}
    launches = [line for line in result.stdout.splitlines() if "pretrain_gpt2_moe.py" in line]
    titles = [line for line in result.stdout.splitlines() if re.match(r"^#\d+ tp=", line)]
    assert len(titles) == len(launches) and any(" pp=2 vpp=2 " in line for line in titles)
    for title, launch in zip(titles, launches):
        assert (" vpp=2 " in title) == ("--num-layers-per-virtual-pipeline-stage 1" in launch)


@pytest.mark.parametrize("args,message", [
    (["--nnodes", "2", "--nproc-per-node", "3", "--tensor-model-parallel-size", "4",
      "--parm-profile", "emulated_pcie_measured"],
     "--tensor-model-parallel-size (4) must divide the world size (6)"),
    (["--nnodes", "1", "--nproc-per-node", "2", "--expert-model-parallel-size", "4",
      "--parm-profile", "emulated_pcie_measured"],
     "--expert-model-parallel-size (4) must divide the world size (2)"),
    (CLUSTER + ["--num-experts", "6", "--expert-model-parallel-size", "4"],
     "--num-experts (6) must be divisible by --expert-model-parallel-size (4)"),
    (CLUSTER + ["--gpu-memory-gb", "0.001"], "no layout fits in --gpu-memory-gb"),
    (CLUSTER + ["--global-batch-size", "6"], "--global-batch-size (6) must be divisible"),
    (CLUSTER + ["--pipeline-model-parallel-size", "3"],
     "--pipeline-model-parallel-size (3) must divide the world size (4)"),
    (CLUSTER + ["--pipeline-model-parallel-size", "4"],
     "--num-layers (2) must be divisible by --pipeline-model-parallel-size (4)"),
    (CLUSTER + ["--hidden-size", "x"], "--hidden-size"),
    (CLUSTER + ["--bf16", "--fp16"], "--bf16 and --fp16"),
    (CLUSTER + ["--moe-token-dispatcher-type", "parm_s3"],
     "--moe-token-dispatcher-type: unknown dispatcher 'parm_s3'"),
    (["--nnodes", "2", "--parm-profile", "emulated_pcie_measured"], "--nproc-per-node"),
    (CLUSTER[:4] + ["--parm-profile", "no_such_profile"], "--parm-profile"),
])
def test_plan_layout_bad_input_is_one_line(args, message):
    result = _plan_layout("--config", "configs/gpt2_tiny_moe.yaml", *args)
    assert result.returncode == 2, result.stdout
    errors = [line for line in result.stderr.splitlines() if not line.startswith("note:")]
    assert len(errors) == 1 and errors[0].startswith("error: "), result.stderr
    assert message in errors[0]
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_plan_layout_without_a_profile_lists_the_shipped_ones():
    from megatron_parm.perf_model.profile import shipped_profiles

    result = _plan_layout("--config", "configs/gpt2_tiny_moe.yaml", "--nproc-per-node", "2")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "--parm-profile" in result.stderr
    assert all(name in result.stderr for name in shipped_profiles())
    assert "nvlink_ib_estimate" in _plan_layout("--help").stdout


def test_plan_layout_without_a_vocabulary_names_the_flags():
    result = _plan_layout("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
                          "4", "--seq-length", "64", "--num-experts", "4", "--micro-batch-size",
                          "4", "--global-batch-size", "16", *CLUSTER)
    assert result.returncode == 2
    assert result.stderr.startswith("error: --vocab-size is required")


# ---------------------------------------------------------------- tools/validate_planner.py

def test_validation_picks_the_top_and_a_spread_of_the_rest():
    assert validate_planner.pick_runs(83, 3, 3) == [0, 1, 2, 23, 43, 63]
    assert validate_planner.pick_runs(4, 3, 3) == [0, 1, 2, 3]


def test_validation_adds_pipelined_layouts():
    # ranks 1-3 and 6 are picked, pipelined ones sit at 2, 5, 7 and 9
    sizes = [1, 2, 1, 1, 2, 1, 2, 1, 2]
    assert validate_planner.pick_pipelined(sizes, [0, 1, 2, 5], 2) == [4, 8]
    assert validate_planner.pick_pipelined(sizes, [0, 1, 2, 5], 1) == [4]
    assert validate_planner.pick_pipelined(sizes, [], 0) == []
    assert validate_planner.pick_pipelined([1, 1], [0], 2) == []


def test_spearman_and_log_parsing():
    assert validate_planner.spearman([1, 2, 3], [10, 30, 20]) == pytest.approx(0.5)
    assert validate_planner.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert validate_planner.spearman([1, 2], [1, 2]) is None
    log = (" iteration        1/      10 | consumed samples:           16 | elapsed time per "
           "iteration (ms): 1054.0 | learning rate: 1E-3 |\n> done\n"
           " iteration        2/      10 | consumed samples:           32 | elapsed time per "
           "iteration (ms): 523.6 | learning rate: 1E-3 |\n")
    assert validate_planner.iteration_times_ms(log) == [1054.0, 523.6]


# ---------------------------------------------------------------- today's architectures

DEEPSEEK_LIKE = dict(TINY, num_layers=4, moe_layer_freq=(0, 1, 1, 1), ffn_hidden_size=512,
                     swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                     shared_expert_size=128, untie_embeddings_and_output_weights=True)


def test_dense_layers_sit_on_the_stages_megatron_gives_them():
    spec = ModelSpec(**DEEPSEEK_LIKE)
    whole = parameter_counts(spec, 1, 1, 1)
    lay = layout(1, 1, 1, nodes=1, ranks_per_node=4, pp=2)
    first, last = (stage_parameter_counts(spec, lay, stage, 2) for stage in (0, 1))
    # untied: the stages' parameters add up to the model's; the dense layer 0 is the first's
    assert first.total + last.total == whole.total
    assert 2 * first.expert == last.expert == 2 * whole.expert // 3
    interleaved = [stage_parameter_counts(spec, lay, stage, 2, vpp=2) for stage in (0, 1)]
    # virtual stages of one layer: rank 0 holds layers 0 and 2, rank 1 layers 1 and 3
    assert interleaved[0].expert == interleaved[1].expert // 2
    assert sum(c.total for c in interleaved) == whole.total


def test_dense_layers_cost_their_mlp_not_a_dispatcher():
    spec = ModelSpec(**DEEPSEEK_LIKE)
    moe_only = dataclasses.replace(spec, moe_layer_freq=1)
    lay = layout(1, 2, 1)
    step = step_time(spec, lay, PROFILE, "alltoall", None, 4, 16, Precision("fp32"))
    reference = step_time(moe_only, lay, PROFILE, "alltoall", None, 4, 16, Precision("fp32"))
    assert step.moe_s == pytest.approx(reference.moe_s * 3 / 4)
    assert step.dense_compute_s > reference.dense_compute_s  # the dense MLP's GEMMs
    fewer_heads = dataclasses.replace(spec, num_query_groups=1)
    assert parameter_counts(fewer_heads, 1, 1, 1).dense < parameter_counts(spec, 1, 1, 1).dense


def test_gqa_and_widths_are_checked_against_tp():
    spec = ModelSpec(**dict(DEEPSEEK_LIKE, num_query_groups=2))
    assert check_layout(spec, layout(2, 1, 1)) is None
    assert check_layout(spec, layout(4, 1, 1)) is None  # 2 KV heads: a divisor of tp 4
    odd = ModelSpec(**dict(DEEPSEEK_LIKE, shared_expert_size=130))
    assert "--moe-shared-expert-intermediate-size (130)" in check_layout(odd, layout(4, 1, 1))
    with pytest.raises(ValueError, match="--moe-layer-freq"):
        ModelSpec(**dict(DEEPSEEK_LIKE, moe_layer_freq=(0, 1)))


# ---------------------------------------------------------------- shared-expert overlap

def _shared_gemm_seconds(spec, lay, micro_batch_size, profile):
    """Per pass, the shared experts' GEMMs of one MoE layer, from their sizes: fc1 (SwiGLU:
    2 S outputs) and fc2 over the whole sequence split over TP; backward two GEMMs each."""
    tokens, h, shared = spec.seq_length * micro_batch_size, spec.hidden_size, spec.shared_expert_size
    forward = sum(profile.compute_time(flops) for flops in (
        2 * tokens * h * 2 * shared / lay.tp, 2 * tokens * shared * h / lay.tp))
    return {"forward": forward, "backward": 2 * forward}


def _steps(spec, lay, profile, dispatcher="alltoall", chunks=None):
    fp32 = Precision("fp32")
    return [step_time(dataclasses.replace(spec, shared_expert_overlap=overlap), lay, profile,
                      dispatcher, chunks, 4, 16, fp32) for overlap in (False, True)]


def test_comm_wait_is_the_layers_collectives():
    """Prediction.comm_wait_s: what the dispatcher's collectives keep the compute waiting, the
    window the shared experts' stream fills: unchunked, every collective stage (layer_scale
    applied); chunked, the pipelined pass less its compute."""
    spec = ModelSpec(**DEEPSEEK_LIKE)
    lay = layout(1, 4, 1)
    prediction = predict("alltoall", layer_shape(spec, lay, 4, Precision("fp32")), lay, PROFILE)
    for direction in ("forward", "backward"):
        collectives = sum(stage.seconds for stage in prediction.stages
                          if stage.direction == direction and stage.kind != "compute")
        assert collectives > 0
        assert prediction.comm_wait_s[direction] == pytest.approx(
            PROFILE.layer_scale * collectives)
    chunked = predict("parm_s2", layer_shape(spec, lay, 4, Precision("fp32")), lay, PROFILE, 4)
    assert 0 < chunked.comm_wait_s["forward"] < chunked.forward_s


def test_shared_expert_overlap_hides_their_gemms_behind_the_dispatcher():
    """Per MoE layer and pass the step saves e * min(shared GEMMs, comm wait): all of the
    GEMMs where the collectives take longer, the collectives' time where they are shorter,
    nothing without a collective to hide behind."""
    spec, fp32 = ModelSpec(**DEEPSEEK_LIKE), Precision("fp32")
    lay = layout(1, 4, 1)
    plain, overlapped = _steps(spec, lay, PROFILE)
    moe_layers = spec.num_moe_layers
    gemms = _shared_gemm_seconds(spec, lay, 4, PROFILE)
    wait = plain.moe_layer.comm_wait_s
    hidden = PROFILE.overlap_efficiency * sum(min(gemms[d], wait[d]) for d in gemms)
    assert hidden > 0
    assert overlapped.shared_overlap_s == pytest.approx(-moe_layers * hidden)
    assert plain.microbatch_s - overlapped.microbatch_s == pytest.approx(moe_layers * hidden)
    assert overlapped.dense_compute_s == plain.dense_compute_s  # the GEMMs still run
    assert overlapped.as_dict()["shared_overlap_s"] < 0 == plain.shared_overlap_s
    # communication-bound: shared experts 64x wider hide only the collectives' time
    wide = dataclasses.replace(spec, shared_expert_size=64 * 128)
    gemms = _shared_gemm_seconds(wide, lay, 4, PROFILE)
    assert all(gemms[d] > wait[d] for d in gemms)
    plain, overlapped = _steps(wide, lay, PROFILE)
    assert plain.step_s - overlapped.step_s == pytest.approx(
        plain.num_microbatches * moe_layers * PROFILE.overlap_efficiency * sum(wait.values()))
    # nothing in flight on one rank: the flag saves no time
    alone = layout(1, 1, 1, nodes=1, ranks_per_node=1)
    plain, overlapped = _steps(spec, alone, PROFILE)
    assert overlapped.step_s == plain.step_s and overlapped.shared_overlap_s == 0


def test_overlapped_shared_experts_gather_their_input_once():
    """At tp > 1 the overlapped shared experts all-gather their input themselves and their
    fc1 keeps it: one AG less per MoE layer (no re-gather for the weight gradient; the
    overlap's term gives it back, tp_comm_s still holds it), and t n h p more activations,
    less one SwiGLU tensor n S p (no glu_linear_offset sum)."""
    spec, fp32 = ModelSpec(**DEEPSEEK_LIKE), Precision("fp32")
    lay = layout(2, 2, 1)
    plain, overlapped = _steps(spec, lay, PROFILE)
    shard = 64 * 4 // 2 * 64 * 4  # n h p: s b / t tokens of h fp32
    all_gather = collective_seconds(PROFILE, lay, "all_gather", "tp", shard)
    gemms, wait = _shared_gemm_seconds(spec, lay, 4, PROFILE), plain.moe_layer.comm_wait_s
    hidden = PROFILE.overlap_efficiency * sum(min(gemms[d], wait[d]) for d in gemms)
    assert overlapped.tp_comm_s == plain.tp_comm_s
    assert -overlapped.shared_overlap_s == pytest.approx(
        spec.num_moe_layers * (hidden + all_gather))
    n = 64 * 4 // 2
    memory = [activation_bytes(dataclasses.replace(spec, shared_expert_overlap=overlap), lay,
                               4, fp32) for overlap in (False, True)]
    assert memory[1] - memory[0] == spec.num_moe_layers * (2 * n * 64 * 4 - n * 128 * 4)
    one = layout(1, 4, 1)
    memory = [activation_bytes(dataclasses.replace(spec, shared_expert_overlap=overlap), one,
                               4, fp32) for overlap in (False, True)]
    assert memory[0] - memory[1] == spec.num_moe_layers * 2 * n * 128 * 4  # tp 1: no gather


def test_plan_adds_the_shared_expert_overlap_where_it_helps():
    """The planner runs each candidate of a model with shared experts with the overlap where
    that ranks better (faster; as fast and smaller) and prints the flag there; where its
    memory (at tp > 1 its fc1 keeps the gathered input) fits only with recomputation, that
    recomputation's time is weighed too."""
    # shared experts of 64: the gathered input (t n h p) outweighs the SwiGLU tensor it saves
    spec, fp32 = ModelSpec(**dict(DEEPSEEK_LIKE, shared_expert_size=64)), Precision("fp32")
    cluster = Cluster(nodes=2, ranks_per_node=2, gpu_memory_bytes=80 * GIB)
    fixed = {"tp": 2, "ep": 2, "etp": 1, "pp": 1}
    roomy = plan(spec, cluster, PROFILE, 4, 16, fp32, fixed=fixed, dispatchers=["alltoall"])
    (best,) = roomy.candidates
    plain, overlapped = _steps(spec, best.layout, PROFILE)
    assert best.shared_expert_overlap and best.step.step_s == overlapped.step_s < plain.step_s
    assert "--moe-shared-expert-overlap" in best.flags()
    assert "shared-expert-overlap" in best.describe()
    memory = [memory_per_rank(dataclasses.replace(spec, shared_expert_overlap=overlap),
                              best.layout, 4, fp32, num_microbatches=2).total
              for overlap in (False, True)]
    assert memory[0] < memory[1]
    tight = dataclasses.replace(cluster, gpu_memory_bytes=sum(memory) / 2)
    (best,) = plan(spec, tight, PROFILE, 4, 16, fp32, fixed=fixed,
                   dispatchers=["alltoall"]).candidates
    # too tight for the overlap as it is: it fits only recomputing, charged in its time; the
    # faster of that and the plain candidate wins
    assert best.fits
    assert best.step.step_s <= plain.step_s
    if best.shared_expert_overlap:
        assert best.recompute != NONE and "--moe-shared-expert-overlap" in best.flags()
    else:
        assert best.recompute == NONE and "--moe-shared-expert-overlap" not in best.flags()
    # one rank: nothing to hide behind, as fast, but one SwiGLU tensor less a layer
    alone = plan(spec, Cluster(1, 1, 80 * GIB), PROFILE, 4, 16, fp32).candidates
    assert all(c.shared_expert_overlap for c in alone)
    assert alone[0].memory.total < memory_per_rank(spec, alone[0].layout, 4, fp32,
                                                   num_microbatches=4).total
    assert not any(c.shared_expert_overlap for c in
                   plan(dataclasses.replace(spec, shared_expert_size=None), cluster, PROFILE, 4,
                        16, fp32).candidates)
    given = plan(dataclasses.replace(spec, shared_expert_overlap=True), cluster, PROFILE, 4, 16,
                 fp32)
    assert all(c.shared_expert_overlap for c in given.candidates)
    recomputed = Recompute("selective", modules=("shared_experts",))
    assert not any(c.shared_expert_overlap for c in plan(
        spec, cluster, PROFILE, 4, 16, fp32, recompute=recomputed).candidates)
    with pytest.raises(PlanError, match="--moe-shared-expert-overlap"):
        plan(dataclasses.replace(spec, shared_expert_overlap=True), cluster, PROFILE, 4, 16,
             fp32, recompute=recomputed)


@pytest.mark.parametrize("config,vocab", [("mixtral_8x7b", 32000), ("qwen3_30b_a3b", 151936),
                                          ("deepseek_v2_lite", 102400)])
def test_real_size_configs_rank_layouts(config, vocab):
    result = subprocess.run(
        [sys.executable, PLAN_LAYOUT, "--config", f"configs/{config}.yaml", "--vocab-size",
         str(vocab), "--nnodes", "2", "--nproc-per-node", "8", "--top", "3", "--parm-profile",
         "nvlink_ib_estimate"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "SwiGLU" in result.stdout and "rope" in result.stdout
    assert "#1 " in result.stdout and "--use-distributed-optimizer" in result.stdout
    # DeepSeek's shared experts overlap the dispatcher's all-to-all on its best layouts
    overlap = "--moe-shared-expert-overlap" in result.stdout.split("#1 ")[1]
    assert overlap == (config == "deepseek_v2_lite"), result.stdout
