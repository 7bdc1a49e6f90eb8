"""Write a tiny random Hugging Face model of one family, to try --from-hf / --to-hf without a
download (and the model the conversion tests compare with). Needs `transformers` (the test
extra: pip install 'megatron-parm[test]').

    python tools/tiny_hf_model.py mixtral runs/hf/mixtral
    python tools/tiny_hf_model.py qwen3_moe runs/hf/qwen3_moe --max-shard-size 200KB

Families: mixtral (8 experts, top-2), qwen2_moe (8 experts, top-4, a gated shared expert, q/k/v
biases, no renormalised top-k), qwen3_moe (16 experts, top-4, q/k norms, heads wider than
hidden / heads), llama (dense), deepseek_v3 (3 layers, the first dense, multi-latent attention
with a query latent, YaRN, 16 experts in 4 groups of which 2 are kept, top-4, a sigmoid router
with its expert bias, a shared expert, and one MTP layer, which transformers does not build:
written beside the model), deepseek_v2 (2 layers, the first dense, multi-latent attention
without a query latent, 8 experts top-2 from 2 of 4 groups, 2 shared experts). Each has
layers of width 64, 4 heads (the others: grouped-query attention with 2 key/value heads) and
the shipped tokenizer's vocabulary (8000) padded to 8064, so it trains on the shipped corpus.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_parm import cli  # noqa: E402
from megatron_parm.checkpointing import hf_files  # noqa: E402

COMMON = dict(vocab_size=8064, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              tie_word_embeddings=False)
# DeepSeek: multi-latent attention (one key/value per head), YaRN rotary positions
MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=16, moe_intermediate_size=16)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,
            original_max_position_embeddings=4096, beta_fast=32, beta_slow=1)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=16,
                       head_dim=32, norm_topk_prob=True)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(MLA, num_hidden_layers=3, first_k_dense_replace=1, q_lora_rank=32,
                         n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                         n_shared_experts=1, routed_scaling_factor=2.5,
                         num_nextn_predict_layers=1,
                         rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=0.8))),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(MLA, q_lora_rank=None, first_k_dense_replace=1, n_routed_experts=8,
                         num_experts_per_tok=2, topk_method="group_limited_greedy", n_group=4,
                         topk_group=2, n_shared_experts=2, routed_scaling_factor=2.0,
                         rope_parameters=dict(YARN, mscale=0.707, mscale_all_dim=0.707))),
}


def write(family: str, folder: str, max_shard_size: str = "5GB", seed: int = 11) -> str:
    """Save a random tiny FAMILY model in FOLDER (as save_pretrained writes it)."""
    hf_files.parse_size(max_shard_size)  # one line naming the flag, not transformers' error
    try:
        import torch
        import transformers
    except ImportError:
        raise ValueError("tools/tiny_hf_model.py needs transformers: pip install "
                         "'megatron-parm[test]'") from None
    config_class, model_class, extra = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    # The routers' default initialisation is all but uniform: spread it so top-k matters
    # (and DeepSeek-V3's expert bias, zero at first, so that it changes the choice).
    for name, param in model.named_parameters():
        if name.endswith(("gate.weight", "shared_expert_gate.weight")):
            torch.nn.init.normal_(param, std=0.5)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            torch.nn.init.normal_(buffer, std=0.1)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    if getattr(config, "num_nextn_predict_layers", 0):
        add_mtp_layers(folder, config.num_hidden_layers, config.num_nextn_predict_layers,
                       max_shard_size)
    return folder


def add_mtp_layers(folder: str, layers: int, depth: int, max_shard_size: str) -> None:
    """Add DeepSeek-V3's MTP layers (model.layers.LAYERS + j, which transformers neither builds
    nor saves) to the model in FOLDER: a random copy of the last layer's shapes, its own norms
    and eh_proj, and copies of the embedding and output layer, as DeepSeek ships them."""
    import torch

    weights = hf_files.read_weights(folder)
    for name in os.listdir(folder):
        if name.endswith(".safetensors") or name == hf_files.SAFETENSORS_INDEX:
            os.remove(os.path.join(folder, name))
    last = f"model.layers.{layers - 1}."
    hidden = weights["model.norm.weight"].shape[0]
    for j in range(depth):
        layer = f"model.layers.{layers + j}."
        weights.update({layer + name[len(last):]: torch.randn_like(tensor) * 0.1
                        + (1.0 if name.endswith("norm.weight") else 0.0)
                        for name, tensor in list(weights.items()) if name.startswith(last)})
        weights.update({layer + "enorm.weight": 1.0 + 0.1 * torch.randn(hidden),
                        layer + "hnorm.weight": 1.0 + 0.1 * torch.randn(hidden),
                        layer + "eh_proj.weight": 0.05 * torch.randn(hidden, 2 * hidden),
                        layer + "shared_head.norm.weight": 1.0 + 0.1 * torch.randn(hidden),
                        layer + "embed_tokens.weight": weights["model.embed_tokens.weight"],
                        layer + "shared_head.head.weight": weights["lm_head.weight"]})
    hf_files.write_weights(folder, weights, hf_files.parse_size(max_shard_size))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("output", help="The directory to write.")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="save_pretrained's largest shard (default %(default)s).")
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args(argv)
    write(args.family, args.output, args.max_shard_size, args.seed)
    print(f"wrote a tiny random {FAMILIES[args.family][1]} in {args.output}")
    return 0


if __name__ == "__main__":
    cli.run(main)
