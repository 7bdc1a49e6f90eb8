"""Activation recomputation in the planner's memory model (perf_model/recompute.py, memory.py)
and its flags in the ranking (pure Python; measured against Megatron-Core by
tools/recompute_memory.py, docs/planner.md)."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from megatron_parm.perf_model import load_profile
from megatron_parm.perf_model.layout import Layout
from megatron_parm.perf_model.memory import (GIB, Precision, _activation_terms,
                                             activation_bytes, memory_per_rank,
                                             stage_activation_bytes)
from megatron_parm.perf_model.planner import Cluster, plan
from megatron_parm.perf_model.recompute import NONE, Recompute, search_choices
from megatron_parm.perf_model.step_time import collective_seconds, stage_times, step_time
from megatron_parm.perf_model.transformer import ModelSpec
from megatron_parm.planner_inputs import recompute_of

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FP32 = Precision("fp32")
# GPT-2-small-MoE's layer (configs/gpt2_small_moe.yaml) at a short sequence
SMALL = ModelSpec(model_type="gpt", num_layers=4, hidden_size=768, num_attention_heads=12,
                  seq_length=256, vocab_size=8000, num_experts=8, moe_ffn_hidden_size=3072,
                  topk=2, hidden_dropout=0.1, attention_dropout=0.1)
ONE = Layout(1, 1, 1, nodes=1, ranks_per_node=2)
FULL_1 = Recompute("full", "uniform", 1)
# a profile with every term non-zero (the framework terms among them)
PCIE = load_profile("emulated_pcie_measured")


def _activations(spec=SMALL, recompute=NONE, lay=ONE):
    return activation_bytes(spec, lay, 2, FP32, dropout_mask_bytes=4, recompute=recompute)


def test_full_keeps_less_than_selective_keeps_less_than_none():
    none = _activations()
    selective = _activations(recompute=Recompute("selective"))
    full = _activations(recompute=FULL_1)
    assert full < selective < none
    assert none / full >= 3  # the target, 4 layers of GPT-2-small-MoE
    assert _activations(recompute=Recompute("selective", modules=("moe",))) < none


def test_full_uniform_keeps_layer_inputs_and_recomputes_one_checkpoint():
    layer, mask, first, last = _activation_terms(SMALL, ONE, 2, FP32, "alltoall", 4)
    whole = layer.total(moe=True)
    for count in (1, 2, 4):
        kept = SMALL.num_layers * layer.layer_input
        # the last checkpoint's recomputation: the layers before it keep their inputs
        recomputing = (SMALL.num_layers - count) * layer.layer_input + count * whole
        expected = mask + first + max(kept + last, recomputing)
        assert _activations(recompute=Recompute("full", "uniform", count)) == \
            pytest.approx(expected)
    # more layers a checkpoint: more live while it recomputes
    assert _activations(recompute=Recompute("full", "uniform", 2)) > _activations(
        recompute=FULL_1)


def test_full_block_recomputes_the_first_layers_only():
    none = _activations()
    blocks = [_activations(recompute=Recompute("full", "block", count)) for count in (1, 2, 3)]
    assert none > blocks[0] > blocks[1] > blocks[2]
    # every layer its own checkpoint: as uniform 1
    assert _activations(recompute=Recompute("full", "block", 4)) == _activations(
        recompute=FULL_1)


def test_selective_modules_drop_their_terms():
    layer, *_ = _activation_terms(SMALL, ONE, 2, FP32, "alltoall", 4)
    none = layer.kept(True, NONE)
    assert none == layer.total(True)
    assert none - layer.kept(True, Recompute("selective")) == layer.scores
    assert none - layer.kept(True, Recompute("selective", modules=("layernorm",))) == \
        layer.layernorms
    assert none - layer.kept(True, Recompute("selective", modules=("moe",))) == \
        layer.moe - layer.layer_input
    assert none - layer.kept(True, Recompute("selective", modules=("moe_act",))) == \
        layer.expert_activation > 0
    # dense layers: mlp; moe does nothing to them
    assert layer.kept(False, Recompute("selective", modules=("moe",))) == layer.total(False)
    assert layer.total(False) - layer.kept(False, Recompute("selective", modules=("mlp",))) \
        == layer.dense_mlp - layer.layer_input


def test_pipeline_stage_holds_its_microbatches_inputs_and_one_recomputation():
    lay = Layout(1, 1, 1, nodes=1, ranks_per_node=2, pp=2)
    none, held = stage_activation_bytes(SMALL, lay, 2, FP32, 0, 4, dropout_mask_bytes=4)
    full, held_full = stage_activation_bytes(SMALL, lay, 2, FP32, 0, 4, dropout_mask_bytes=4,
                                             recompute=FULL_1)
    assert held == held_full == 2
    layer, mask, first, _ = _activation_terms(SMALL, lay, 2, FP32, "alltoall", 4)
    # 2 micro-batches x 2 layers' inputs, one layer recomputed (its own input inside it)
    expected = 2 * (2 * layer.layer_input + mask) + 2 * first - layer.layer_input \
        + layer.total(True)
    assert full == pytest.approx(expected)
    assert none / full > 3


def test_bad_choices_name_the_flag():
    with pytest.raises(ValueError, match="--recompute-method"):
        Recompute("full")
    with pytest.raises(ValueError, match="--recompute-granularity full"):
        Recompute("selective", "uniform", 1)
    with pytest.raises(ValueError, match="--recompute-modules"):
        Recompute("selective", modules=("attention",))
    with pytest.raises(ValueError, match="needs --recompute-granularity"):
        recompute_of({"recompute_granularity": None, "recompute_method": "block"})
    assert recompute_of({"recompute_granularity": None}) is None


def test_flags_are_megatron_lms():
    assert NONE.flags() == []
    assert FULL_1.flags() == ["--recompute-granularity", "full", "--recompute-method",
                              "uniform", "--recompute-num-layers", "1"]
    assert Recompute("selective").flags() == ["--recompute-granularity", "selective"]
    assert Recompute("selective", modules=("moe", "moe_act")).flags() == [
        "--recompute-granularity", "selective", "--recompute-modules", "moe", "moe_act"]
    assert [choice.label() for choice in search_choices(3)] == [
        "selective core_attn", "selective core_attn,moe", "full block 1", "full block 2",
        "full uniform 1"]
    assert [choice.label() for choice in search_choices(12)][2:] == [
        "full block 1", "full block 2", "full block 4", "full block 8", "full uniform 1"]


def _small_plan(gib, recompute=None):
    return plan(SMALL, Cluster(1, 2, gib * GIB), load_profile("nvlink_ib_estimate"), 2, 8,
                FP32, recompute=recompute)


def test_plan_recomputes_where_a_layout_does_not_fit_otherwise():
    roomy = _small_plan(80)
    assert all(candidate.recompute == NONE for candidate in roomy.candidates)
    need = min(candidate.memory.total for candidate in roomy.candidates)
    tight = _small_plan(need / GIB * 0.999)
    assert tight.fitting and all(c.recompute != NONE for c in tight.fitting)
    best = tight.fitting[0]
    assert best.flags()[-len(best.recompute.flags()):] == best.recompute.flags()
    assert best.memory == memory_per_rank(SMALL, best.layout, 2, FP32, False, best.dispatcher,
                                          best.step.num_microbatches, best.vpp, best.recompute)
    fixed = _small_plan(80, recompute=FULL_1)
    assert all(c.recompute == FULL_1 and "--recompute-num-layers" in c.flags()
               for c in fixed.candidates)


def test_plan_layout_prints_the_recompute_flags():
    command = [sys.executable, os.path.join(REPO, "tools", "plan_layout.py"),
               "--config", "configs/gpt2_small_moe.yaml", "--nnodes", "1",
               "--nproc-per-node", "2", "--parm-profile", "nvlink_ib_estimate", "--top", "3",
               "--show-flags", "1", "--recompute-granularity", "full", "--recompute-method",
               "block", "--recompute-num-layers", "2"]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    charged = re.findall(r"yes, recompute full block 2 \(\+([0-9.]+) ms\)", proc.stdout)
    assert len(charged) == 3 and all(float(ms) > 0 for ms in charged)
    launch = [line for line in proc.stdout.splitlines() if "pretrain_gpt2_moe.py" in line]
    assert launch and launch[0].endswith("--recompute-granularity full --recompute-method block "
                                         "--recompute-num-layers 2")
    bad = subprocess.run(command[:-6] + ["--recompute-granularity", "full"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.splitlines()[-1].startswith("error: --recompute-granularity full needs")


def test_selective_moe_peaks_while_the_last_layer_recomputes_its_moe():
    """Measured (docs/planner.md): the backward pass recomputes the last layer's MoE side
    while every layer keeps its other tensors and the head's are gone."""
    choice = Recompute("selective", modules=("moe",))
    layer, mask, first, last = _activation_terms(SMALL, ONE, 2, FP32, "alltoall", 4)
    kept = SMALL.num_layers * layer.kept(True, choice)
    expected = mask + first + max(kept + last, kept + layer.moe - layer.layer_input)
    assert _activations(recompute=choice) == pytest.approx(expected)


# ---------------------------------------------------------------- the time recomputation costs

def _gemm(flops):
    """One GEMM's forward on PCIE."""
    return PCIE.compute_alpha + PCIE.compute_beta * flops


def _tp_forward(lay, num_bytes):
    """The forward TP collectives around a column- and a row-parallel GEMM: AG, then RS."""
    return (collective_seconds(PCIE, lay, "all_gather", "tp", num_bytes)
            + collective_seconds(PCIE, lay, "reduce_scatter", "tp", num_bytes))


def _step(spec, lay, recompute=NONE, pp_batch=8, **kwargs):
    return step_time(spec, lay, PCIE, "alltoall", None, 2, pp_batch, FP32, recompute=recompute,
                     **kwargs)


@pytest.mark.parametrize("tp", [1, 2])
def test_full_recompute_of_every_layer_costs_one_more_forward_of_the_layer_stack(tp):
    lay = Layout(tp, 2, 1, nodes=2, ranks_per_node=2)
    none = _step(SMALL, lay)
    b, s, h, experts = 2, 256, 768, 8
    tokens = b * s
    # one layer's forward, by hand: QKV, scores, context, projection, router; the MoE layer
    # (its dispatcher's forward stages and the experts); the AG before QKV and the RS after
    # the projection; a third of the layer's framework time
    gemms = (_gemm(2 * tokens * h * 3 * h / tp) + 2 * _gemm(2 * b * s * s * h / tp)
             + _gemm(2 * tokens * h * h / tp) + _gemm(2 * tokens // tp * h * experts))
    collectives = _tp_forward(lay, tokens // tp * h * 4) if tp > 1 else 0.0
    layer = gemms + collectives + none.moe_layer.forward_s + PCIE.layer_overhead / 3
    assert none.recompute_s == 0.0
    for count in (1, 2, 4):  # however the layers are grouped, each is recomputed once
        full = _step(SMALL, lay, Recompute("full", "uniform", count))
        assert full.recompute_s == pytest.approx(SMALL.num_layers * layer, rel=1e-12)
        assert full.step_s - none.step_s == pytest.approx(
            full.num_microbatches * SMALL.num_layers * layer, rel=1e-12)
    for count in (1, 3):  # block: the first `count` layers only
        block = _step(SMALL, lay, Recompute("full", "block", count))
        assert block.recompute_s == pytest.approx(count * layer, rel=1e-12)
    assert _step(SMALL, lay, Recompute("full", "block", 4)) == _step(SMALL, lay, FULL_1)


def test_selective_recompute_charges_the_named_modules_forward():
    lay = Layout(2, 2, 1, nodes=2, ranks_per_node=2)
    none = _step(SMALL, lay)
    b, s, h, experts = 2, 256, 768, 8

    def extra(*modules):
        return _step(SMALL, lay, Recompute("selective", modules=modules)).recompute_s

    scores_and_context = 2 * _gemm(2 * b * s * s * h / 2)
    router_and_layer = _gemm(2 * (b * s // 2) * h * experts) + none.moe_layer.forward_s
    assert extra("core_attn") == pytest.approx(4 * scores_and_context, rel=1e-12)
    assert extra("moe") == pytest.approx(4 * router_and_layer, rel=1e-12)
    assert extra("core_attn", "moe") == pytest.approx(
        4 * (scores_and_context + router_and_layer), rel=1e-12)
    # element-wise only (not charged), or modules this model does not have
    for module in ("layernorm", "moe_act", "mlp", "shared_experts"):
        assert extra(module) == 0.0, module
    assert extra("core_attn", "moe") < _step(SMALL, lay, FULL_1).recompute_s


def test_recompute_of_dense_layers_and_shared_experts():
    spec = dataclasses.replace(SMALL, moe_layer_freq=(0, 1, 1, 1), ffn_hidden_size=1536,
                               shared_expert_size=1024)
    lay = Layout(2, 2, 1, nodes=2, ranks_per_node=2)
    none = _step(spec, lay)
    tokens, h = 2 * 256, 768
    tp_forward = _tp_forward(lay, tokens // 2 * h * 4)
    mlp = _gemm(2 * tokens * h * 1536 / 2) + _gemm(2 * tokens * 1536 * h / 2) + tp_forward
    shared = _gemm(2 * tokens * h * 1024 / 2) + _gemm(2 * tokens * 1024 * h / 2) + tp_forward
    router_and_layer = _gemm(2 * (tokens // 2) * h * 8) + none.moe_layer.forward_s

    def extra(*modules):
        return _step(spec, lay, Recompute("selective", modules=modules)).recompute_s

    assert extra("mlp") == pytest.approx(mlp, rel=1e-12)  # the one dense layer
    assert extra("shared_experts") == pytest.approx(3 * shared, rel=1e-12)
    assert extra("moe") == pytest.approx(3 * (router_and_layer + shared), rel=1e-12)
    # nested checkpoints: moe's recomputation runs the shared experts' checkpoint again
    assert extra("moe", "shared_experts") == pytest.approx(
        3 * (router_and_layer + 2 * shared), rel=1e-12)


def test_pipeline_stages_recompute_their_own_layers():
    lay = Layout(1, 1, 1, nodes=1, ranks_per_node=2, pp=2)
    none, full = (_step(SMALL, lay, choice, pp_batch=16) for choice in (NONE, FULL_1))
    per_stage = [stage["recompute_s"] for stage in stage_times(
        SMALL, lay, PCIE, full.moe_layer, 2, FP32, recompute=FULL_1)]
    one_stage = _step(dataclasses.replace(SMALL, num_layers=2), Layout(
        1, 1, 1, nodes=1, ranks_per_node=1), FULL_1, pp_batch=16).recompute_s
    assert per_stage == pytest.approx([one_stage, one_stage], rel=1e-12)
    assert full.recompute_s == pytest.approx(one_stage, rel=1e-12)
    # the slowest stage's micro-batches and the bubble both grow by a stage's recomputation
    assert full.step_s - none.step_s == pytest.approx(
        (full.num_microbatches + 1) * one_stage, rel=1e-9)
    # interleaved, block recomputes the first layers of each model chunk
    block = _step(SMALL, lay, Recompute("full", "block", 1), pp_batch=16, vpp=2)
    assert block.recompute_s == pytest.approx(one_stage, rel=1e-12)


def test_plan_ranks_by_step_time_with_the_recomputation_charged():
    profile = load_profile("nvlink_ib_estimate")
    need = min(candidate.memory.total for candidate in _small_plan(80).candidates)
    result = _small_plan(need / GIB * 1.05)
    fitting = result.fitting
    steps = [candidate.step.step_s for candidate in fitting]
    assert steps == sorted(steps)
    recomputing = [candidate.recompute != NONE for candidate in fitting]
    # fastest first, recomputing or not: one that recomputes is ahead of one that does not
    assert recomputing[0] and not all(recomputing)
    for candidate in fitting:
        args = (SMALL, candidate.layout, profile, candidate.dispatcher, candidate.num_chunks,
                2, 8, FP32, False, candidate.vpp)
        assert candidate.step == step_time(*args, recompute=candidate.recompute)
        if candidate.recompute == NONE:
            continue
        assert candidate.step.recompute_s > 0
        # the fastest choice that fits (search_choices' order on equal times)
        per_chunk = SMALL.num_layers // candidate.layout.pp // (candidate.vpp or 1)
        for choice in search_choices(per_chunk):
            memory = memory_per_rank(SMALL, candidate.layout, 2, FP32, False,
                                     candidate.dispatcher, candidate.step.num_microbatches,
                                     candidate.vpp, choice)
            if memory.total <= candidate.gpu_memory_bytes:
                assert step_time(*args, recompute=choice).step_s >= candidate.step.step_s


def test_recompute_time_report_reads_turns_against_the_same_turns_none(tmp_path):
    """tools/recompute_time.py's report from a record (no launch): each choice's steps over
    the same turn's none's, and the planner's ratio for the same model and layout."""
    turns = 6
    record = {"load": [1.0] * turns}
    for name, scale, losses in (("none", 1.0, [9.0, 8.5]), ("full uniform 1", 1.25, [9.0, 8.5]),
                                ("selective moe", 1.1, [9.0, 8.6])):
        seconds = [scale * (1 + turn) for turn in range(turns)]  # the load doubles each turn
        record[name] = {"seconds": seconds, "cpu_seconds": [value / 2 for value in seconds],
                        "losses": losses}
    saved = {"meta": {"date": "today", "machine": "here", "command": "c",
                      "config": "configs/bench/planner_small_gpt2_moe.yaml", "ep": 2,
                      "profile": "emulated_pcie_measured", "iterations": turns, "warmup": 1},
             "record": record}
    path = tmp_path / "record.json"
    path.write_text(json.dumps(saved))
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "recompute_time.py"),
                           "--from-json", str(path), "--output", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in proc.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| ---")}
    assert rows["full uniform 1"][2] == "1.250 (1.250-1.250; 1.250-1.250)"
    assert rows["selective moe"][4] == "1.100 (1.100-1.100; 1.100-1.100)"
    predicted = [float(rows[name][6]) for name in ("full uniform 1", "selective moe")]
    assert predicted[0] > predicted[1] > 1.0
    assert [row[-1] for row in rows.values()][1:] == ["yes |", "yes |", "no |"]
