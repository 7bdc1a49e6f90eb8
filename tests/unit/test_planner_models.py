"""The planner's parameter counts against the model Megatron-Core builds, in one process (world
size 1, Megatron-Core's own process groups): today's architectures (SwiGLU, grouped-query
attention, --kv-channels, q/k norms, RMSNorm, rope, dense layers among MoE layers, shared
experts and their gate, untied output, multi-latent attention) and the three real-size configs
at full depth.

The models are built as the trainer builds them (training/model.py: parse_args, build_model,
GPTModel with Megatron-Core's decoder-block spec and ParmMoELayer) on the meta device: their
parameters take no memory, so Mixtral-8x7B's 46.7B are counted in about a second, and the
real-size models are checked whole rather than at reduced depth and scaled. World size 1
means tp = ep = etp = 1; the per-rank shards of other layouts are checked by
tests/distributed/test_planner_memory.py (one 4-rank launch).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_parm import planner_inputs
from megatron_parm.perf_model.transformer import parameter_counts
from megatron_parm.training import model as model_module
from megatron_parm.training.arguments import parse_args

# (config, the embedding's vocabulary: the Hugging Face config.json's vocab_size, which
# Megatron-Core keeps unpadded at tp = 1; Megatron-Core's parameters; the HF model's)
REAL_SIZE = [
    ("configs/mixtral_8x7b.yaml", 32000, 46_702_792_704, 46_702_792_704),
    ("configs/qwen3_30b_a3b.yaml", 151936, 30_532_122_624, 30_532_122_624),
    # multi-latent attention: per layer q 2048 x 3072, kv_a 2048 x 576, its norm 512, kv_b
    # 512 x 4096, o 2048 x 2048 = 13,763,072
    ("configs/deepseek_v2_lite.yaml", 102400, 15_706_484_224, 15_706_484_224),
]
TINY = "configs/gpt2_tiny_moe.yaml"
BIASES = "biases"  # the tiny config with linear biases (it disables them; no flag turns them on)
MODERN = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope"]
# multi-latent attention: heads of 16 + 8 rotary channels, values of 12, a key/value latent of
# 24 (DeepSeek-V2-Lite's form), and a query latent of 20 too (DeepSeek-V3's)
MLA = ["--multi-latent-attention", "--kv-lora-rank", "24", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12"]
# Each architecture flag alone and together, on the tiny GPT (hidden 64, 4 heads, 4 experts)
VARIANTS = [
    [],
    MODERN,
    MODERN + ["--group-query-attention", "--num-query-groups", "2"],
    MODERN + ["--kv-channels", "32", "--qk-layernorm"],
    ["--qk-layernorm"],  # LayerNorm q/k norms: weight and bias
    ["--position-embedding-type", "none"],
    ["--no-position-embedding"],
    ["--untie-embeddings-and-output-weights"],
    [BIASES],  # biases: QKV, projection, MLPs and the router's
    ["--num-layers", "4", "--moe-layer-freq", "2", "--ffn-hidden-size", "96"],
    MODERN + ["--num-layers", "3", "--moe-layer-freq", "[0]*1+[1]*2", "--ffn-hidden-size", "192",
              "--moe-ffn-hidden-size", "48", "--moe-shared-expert-intermediate-size", "96"],
    MODERN + ["--moe-shared-expert-intermediate-size", "128", "--moe-shared-expert-gate",
              "--group-query-attention", "--num-query-groups", "1",
              "--untie-embeddings-and-output-weights"],
    MODERN + MLA,
    MODERN + MLA + ["--qk-layernorm", "--q-lora-rank", "20"],
    MLA + ["--qk-layernorm", BIASES],  # LayerNorm latent norms; only the projection's bias
]


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    from launch import REPO

    monkeypatch.chdir(REPO)  # the configs' paths are relative to the repository root


def megatron_parameters(argv, vocab_size: int) -> int:
    """Parameters of the model the trainer builds from these flags, built on the meta device."""
    args = parse_args(argv, world_size=1, reads_data=False)
    config = model_module.build_config(args)
    config.perform_initialization = False  # nothing to initialise on the meta device
    original = model_module.build_config
    model_module.build_config = lambda _: config
    try:
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            model = model_module.build_model(args, vocab_size)
    finally:
        model_module.build_config = original
    return sum(parameter.numel() for parameter in model.parameters())


def planner_parameters(argv, vocab_size: int) -> int:
    """The planner's count for the same flags (tools/plan_layout.py's reading of them)."""
    parser = planner_inputs.build_parser()
    _, settings, _ = planner_inputs.resolve_settings(
        parser, [*argv, "--vocab-size", str(vocab_size), "--nproc-per-node", "1",
                 "--parm-profile", "nvlink_ib_estimate"])
    return parameter_counts(planner_inputs.build_spec(settings, "gpt"), 1, 1, 1).total


@pytest.mark.parametrize("config,vocab_size,megatron,hugging_face", REAL_SIZE,
                         ids=[case[0].split("/")[1][:-5] for case in REAL_SIZE])
def test_real_size_configs_count_exactly_what_megatron_builds(megatron_world, config, vocab_size,
                                                              megatron, hugging_face):
    argv = ["--config", config]
    assert megatron_parameters(argv, vocab_size) == megatron
    assert planner_parameters(argv, vocab_size) == megatron == hugging_face


# DeepSeek-V2-Lite's published config.json (deepseek-ai/DeepSeek-V2-Lite), as transformers reads it
DEEPSEEK_V2_LITE = dict(
    architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400,
    hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
    num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
    routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
    v_head_dim=128, qk_nope_head_dim=128, topk_method="greedy", n_group=1, topk_group=1,
    num_experts_per_tok=6, first_k_dense_replace=1, norm_topk_prob=False, hidden_act="silu",
    max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
    aux_loss_alpha=0.001, seq_aux=True, rope_theta=10000,
    rope_scaling=dict(type="yarn", factor=40, mscale=0.707, mscale_all_dim=0.707,
                      original_max_position_embeddings=4096, beta_fast=32, beta_slow=1))


def test_deepseek_v2_lite_config_is_the_hugging_face_model():
    """configs/deepseek_v2_lite.yaml has the flags --from-hf gives DeepSeek-V2-Lite's
    config.json, and the HF model (built by transformers on the meta device) has the parameters
    the table above says Megatron-Core builds from the config."""
    transformers = pytest.importorskip("transformers")
    import yaml

    from megatron_parm.checkpointing import hf_deepseek
    from megatron_parm.checkpointing.hf_llama import FAMILIES
    from megatron_parm.settings import layer_pattern

    flags = hf_deepseek.hf_flags(DEEPSEEK_V2_LITE, FAMILIES["DeepseekV2ForCausalLM"], "hf")
    with open("configs/deepseek_v2_lite.yaml") as handle:
        ours = yaml.safe_load(handle)
    ours["moe_layer_freq"] = layer_pattern(ours["moe_layer_freq"])
    differ = {key: (value, ours[key]) for key, value in flags.items()
              if key in ours and ours[key] != value}
    assert not differ and len(set(flags) & set(ours)) >= 30, differ
    config = transformers.DeepseekV2Config(**{key: value for key, value in DEEPSEEK_V2_LITE.items()
                                              if key not in ("architectures", "model_type")})
    with torch.device("meta"):
        model = transformers.DeepseekV2ForCausalLM(config)
    counted = sum(parameter.numel() for parameter in model.parameters())
    (megatron,) = [case[2] for case in REAL_SIZE if case[0] == "configs/deepseek_v2_lite.yaml"]
    assert counted == megatron


@pytest.mark.parametrize("flags", VARIANTS, ids=[" ".join(flags) or "gpt2" for flags in VARIANTS])
def test_every_architecture_flag_counts_exactly(megatron_world, tmp_path, flags):
    config = TINY
    if BIASES in flags:
        config = tmp_path / "biases.yaml"
        with open(TINY) as handle:
            config.write_text(handle.read().replace("disable_bias_linear: true",
                                                    "disable_bias_linear: false"))
        flags = [flag for flag in flags if flag != BIASES]
    argv = ["--config", str(config), *flags]
    assert planner_parameters(argv, 8000) == megatron_parameters(argv, 8000)


# Activations of one micro-batch: the planner's terms for each architecture flag against the
# peak of the bytes of the storages autograd holds in one forward on CPU (the measurement of
# tests/distributed/test_planner_memory.py, here at world size 1). Measured 2026-12-04 for
# every case below: the estimate 76 bytes under the measurement (0.99999-1.00000: the aux
# loss's per-expert counts and the loss's scalar are not modelled); the test allows 0.01%,
# less than the q/k norms' statistics (0.03%) or one int64 per routed row.
ACTIVATION_VARIANTS = [
    [],
    ["--swiglu"],
    ["--normalization", "RMSNorm"],
    ["--position-embedding-type", "rope"],
    MODERN + ["--group-query-attention", "--num-query-groups", "2"],
    MODERN + ["--kv-channels", "32", "--qk-layernorm"],
    MODERN + ["--num-layers", "6", "--moe-layer-freq", "[0]*4+[1]*2", "--ffn-hidden-size", "192"],
    MODERN + ["--num-layers", "3", "--moe-layer-freq", "[0]*1+[1]*2", "--ffn-hidden-size", "192",
              "--moe-ffn-hidden-size", "48", "--moe-shared-expert-intermediate-size", "96"],
    MODERN + ["--moe-shared-expert-intermediate-size", "128", "--moe-shared-expert-gate"],
    MODERN + ["--moe-shared-expert-intermediate-size", "128", "--moe-shared-expert-overlap"],
    MODERN + ["--group-query-attention", "--num-query-groups", "2", "--qk-layernorm"],
    ["--moe-router-pre-softmax"],
    MODERN + MLA,
    MODERN + MLA + ["--qk-layernorm", "--q-lora-rank", "20"],
    MLA + ["--qk-layernorm", "--q-lora-rank", "20"],  # LayerNorm latent norms
]


@pytest.mark.parametrize("flags", ACTIVATION_VARIANTS,
                         ids=[" ".join(flags) or "gpt2" for flags in ACTIVATION_VARIANTS])
def test_activations_of_every_architecture_flag(megatron_world, flags):
    import os
    import sys

    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    from launch import REPO
    from megatron_parm.perf_model.layout import Layout
    from megatron_parm.perf_model.memory import Precision, activation_bytes

    sys.path.insert(0, os.path.join(REPO, "tests", "distributed"))
    from planner_memory_worker import saved_activation_bytes, synthetic_batch

    argv = ["--config", TINY, *flags]
    args = parse_args(argv, world_size=1, reads_data=False)
    model_parallel_cuda_manual_seed(1234)
    get_moe_layer_wise_logging_tracker().clear()  # sized by the previous case's layers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model_module.build_model(args, 8000)
        model.train()
        _, measured = saved_activation_bytes(model, args, synthetic_batch(args, 8000))
    parser = planner_inputs.build_parser()
    _, settings, _ = planner_inputs.resolve_settings(
        parser, [*argv, "--vocab-size", "8000", "--nproc-per-node", "1",
                 "--parm-profile", "nvlink_ib_estimate"])
    spec = planner_inputs.build_spec(settings, "gpt")
    precision = Precision("fp32")
    # CPU torch: p-byte dropout masks, RMSNorm unfused (it keeps its normalised input too)
    estimate = activation_bytes(spec, Layout(1, 1, 1, nodes=1, ranks_per_node=1),
                                args.micro_batch_size, precision, "alltoall",
                                dropout_mask_bytes=precision.activation_bytes, fused_norms=False)
    assert estimate / measured == pytest.approx(1.0, abs=1e-4), (estimate, measured)
