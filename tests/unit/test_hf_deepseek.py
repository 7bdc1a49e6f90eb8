"""DeepSeek-V2/V3 config.json <-> the trainer's flags (checkpointing/hf_deepseek.py), in one
process: the mapping both ways, and each config Megatron-Core would compute differently refused
in one message naming the field; the MTP layer imported only when asked for. The logits and
the round trips: tests/e2e/test_hf_moe.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_parm.checkpointing import hf_deepseek
from megatron_parm.checkpointing.errors import CheckpointError
from megatron_parm.checkpointing.hf_llama import FAMILIES

V3 = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=8064,
          hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=3,
          num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=16,
          routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8,
          v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=4,
          first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=64,
          rms_norm_eps=1e-6, tie_word_embeddings=False, num_nextn_predict_layers=1,
          rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=1.0,
                               mscale_all_dim=0.8, original_max_position_embeddings=4096,
                               beta_fast=32, beta_slow=1))
V2 = dict(V3, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", q_lora_rank=None,
          n_routed_experts=8, num_experts_per_tok=2, topk_method="group_limited_greedy",
          norm_topk_prob=False, routed_scaling_factor=1.0, rope_parameters=None, rope_theta=1e4)


def flags_of(config, mtp_num_layers=None) -> dict:
    return hf_deepseek.hf_flags(config, FAMILIES[config["architectures"][0]], "hf",
                                mtp_num_layers)


def test_v3_maps_onto_megatrons_router_mla_and_yarn():
    flags = flags_of(V3, mtp_num_layers=1)
    assert flags["moe_layer_freq"] == [0, 1, 1] and flags["mtp_num_layers"] == 1
    assert (flags["moe_router_score_function"], flags["moe_router_enable_expert_bias"],
            flags["moe_router_num_groups"], flags["moe_router_group_topk"],
            flags["moe_router_topk_scaling_factor"]) == ("sigmoid", True, 4, 2, 2.5)
    assert (flags["q_lora_rank"], flags["qk_head_dim"], flags["qk_pos_emb_head_dim"],
            flags["moe_shared_expert_intermediate_size"]) == (32, 16, 8, 16)
    assert (flags["rope_type"], flags["rotary_scaling_factor"], flags["mscale"],
            flags["mscale_all_dim"]) == ("yarn", 40.0, 1.0, 0.8)


def test_v2_maps_onto_a_softmax_router_without_renormalisation():
    flags = flags_of(V2)
    assert (flags["moe_router_score_function"], flags["moe_router_pre_softmax"],
            flags["moe_router_num_groups"], flags["moe_router_group_topk"],
            flags["moe_router_topk_scaling_factor"], flags["rope_type"],
            flags["q_lora_rank"]) == ("softmax", True, 4, 2, None, "rope", None)


@pytest.mark.parametrize("config", [V3, V2], ids=["v3", "v2"])
def test_export_config_gives_back_the_flags(config):
    flags = {**flags_of(config), "rotary_interleaved": False}
    architecture = hf_deepseek.export_architecture(flags)
    assert architecture == config["architectures"][0]
    exported = hf_deepseek.hf_config(flags, architecture, 8064, torch.float32)
    again = flags_of(exported)
    assert {key: again[key] for key in flags if key != "rotary_interleaved"} == {
        key: value for key, value in flags.items() if key != "rotary_interleaved"}


@pytest.mark.parametrize("config, changes, expected", [
    (V2, dict(topk_method="noaux_tc"), "topk_method='noaux_tc': DeepseekV2ForCausalLM takes"),
    (V2, dict(norm_topk_prob=True), "norm_topk_prob=True: transformers' DeepseekV2ForCausalLM"),
    (V2, dict(num_experts_per_tok=4), "topk_group=2: group_limited_greedy ranks groups"),
    (V3, dict(norm_topk_prob=False), "norm_topk_prob=False: Megatron-Core renormalises"),
    (V3, dict(num_experts_per_tok=6), "num_experts_per_tok must be 2 x topk_group"),
    (V3, dict(attention_bias=True), "attention_bias=True"),
    (V3, dict(num_key_value_heads=2), "num_key_value_heads=2"),
    (V3, dict(rope_parameters=dict(V3["rope_parameters"], beta_fast=16)),
     "rope_parameters beta_fast=16: Megatron-Core's multi-latent attention fixes it at 32"),
    (V3, dict(rope_parameters=dict(V3["rope_parameters"], mscale=None)),
     "YaRN's scale of the cosines and sines then differs"),
    (V3, dict(rope_parameters=dict(V3["rope_parameters"], rope_type="longrope")),
     "rope_type='longrope'"),
])
def test_a_config_megatron_computes_differently_is_one_error(config, changes, expected):
    with pytest.raises(CheckpointError) as error:
        flags_of({**config, **changes})
    message = str(error.value)
    assert expected in message and "\n" not in message and message.startswith("hf/config.json")


def test_more_mtp_layers_than_the_checkpoint_has_is_refused():
    with pytest.raises(CheckpointError, match="--mtp-num-layers 2: .* num_nextn_predict_layers=1"):
        flags_of(V3, mtp_num_layers=2)


@pytest.mark.parametrize("change, expected", [
    (dict(moe_router_score_function="softmax", moe_router_pre_softmax=False,
          moe_router_num_groups=None), "--moe-router-pre-softmax"),
    (dict(moe_layer_freq=[1, 0, 1]), "--moe-layer-freq"),
    (dict(moe_shared_expert_intermediate_size=24), "--moe-shared-expert-intermediate-size"),
    (dict(moe_router_group_topk=1), "--moe-router-group-topk"),
    (dict(qk_layernorm=False), "--qk-layernorm"),
])
def test_export_of_a_model_deepseek_cannot_hold_is_refused(change, expected):
    flags = {**flags_of(V3), "rotary_interleaved": False, **change}
    with pytest.raises(CheckpointError, match=f"--to-hf: the checkpoint('s| has) {expected}"):
        hf_deepseek.export_architecture(flags)


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory):
    """tools/tiny_hf_model.py's DeepSeek-V3, with its MTP layer (model.layers.3)."""
    pytest.importorskip("transformers")
    from launch import load_tool

    folder = tmp_path_factory.mktemp("hf") / "deepseek_v3"
    return load_tool("tiny_hf_model").write("deepseek_v3", str(folder))


def test_the_mtp_layer_is_left_out_unless_asked_for(tiny_v3):
    without = hf_deepseek.hf_to_full(tiny_v3)
    assert without.common["converted_from"]["mtp_layers_left_out"] == 1
    assert not any(key.startswith("mtp.") for key in without.tensors)
    assert "mtp_num_layers" not in without.common["args"]
    with_mtp = hf_deepseek.hf_to_full(tiny_v3, mtp_num_layers=1)
    assert "mtp_layers_left_out" not in with_mtp.common["converted_from"]
    mtp = {key for key in with_mtp.tensors if key.startswith("mtp.layers.0.")}
    assert set(with_mtp.tensors) - mtp == set(without.tensors)
    assert {"mtp.layers.0.eh_proj.weight", "mtp.layers.0.final_layernorm.weight",
            "mtp.layers.0.transformer_layer.mlp.router.expert_bias"} <= mtp
    assert "mtp.layers.0.eh_proj._extra_state/shard_0_1" in with_mtp.objects


def test_an_mtp_layer_with_its_own_embedding_is_refused(tiny_v3, tmp_path):
    from megatron_parm.checkpointing import hf_files

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text((Path(tiny_v3) / "config.json").read_text())
    weights = hf_files.read_weights(tiny_v3)
    weights["model.layers.3.embed_tokens.weight"] = weights["model.layers.3.embed_tokens.weight"] * 2
    hf_files.write_weights(str(folder), weights, 1 << 30)
    with pytest.raises(CheckpointError, match="model.layers.3.embed_tokens.weight differs from "
                                              "the model's own"):
        hf_deepseek.hf_to_full(str(folder), mtp_num_layers=1)


def test_an_expert_tensor_saved_per_layer_is_checked_expert_by_expert():
    """A model whose layers differ (an import's --moe-layer-freq list) saves each layer's experts
    as one [E, ...] tensor: the conversions' checksums take its first axis as the experts."""
    from megatron_parm.checkpointing.verify import compare_checksums, count_experts, tensor_checksums

    key = "decoder.layers.2.mlp.experts.experts.linear_fc1.weight"
    experts = torch.randn(4, 6, 5)
    sums = tensor_checksums({key: experts})
    assert count_experts(sums) == 4
    changed = experts.clone()
    changed[3, 0, 0] += 1
    assert compare_checksums(sums, tensor_checksums({key: changed})) == [
        f"{key}: checksum differs (expert 3)"]


def test_rotary_channels_in_halves_are_interleaved_at_import(tiny_v3, tmp_path):
    """A DeepSeek-V3 with rope_interleave false (channel i rotates with i + d/2) imports with its
    rotary rows interleaved, the layout Megatron-Core's MLA (and rope_interleave true) rotates:
    its export, rope_interleave true, computes the logits the original computes."""
    import shutil

    import transformers

    halves = tmp_path / "halves"
    shutil.copytree(tiny_v3, halves)
    config = json.loads((halves / "config.json").read_text())
    (halves / "config.json").write_text(json.dumps({**config, "rope_interleave": False}))
    full = hf_deepseek.hf_to_full(str(halves), mtp_num_layers=1)
    exported, _ = hf_deepseek.full_to_hf(full, full.common["args"], str(tmp_path / "out"), 1 << 30)
    assert exported["rope_interleave"] is True

    def logits(folder):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        with torch.no_grad():
            return model.eval()(torch.arange(24).view(2, 12) * 97 % 8000).logits

    original = logits(halves)
    torch.testing.assert_close(logits(tmp_path / "out"), original, rtol=0, atol=1e-5)
    assert (logits(tiny_v3) - original).abs().max() > 1e-2  # the layouts differ
