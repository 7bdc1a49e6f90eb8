"""Write a tiny random Hugging Face model of one family, to try --from-hf / --to-hf without a
download (and the model the conversion tests compare with). Needs `transformers` (the test
extra: pip install 'megatron-parm[test]').

    python tools/tiny_hf_model.py mixtral runs/hf/mixtral
    python tools/tiny_hf_model.py qwen3_moe runs/hf/qwen3_moe --max-shard-size 200KB

Families: mixtral (8 experts, top-2), qwen2_moe (8 experts, top-4, a gated shared expert, q/k/v
biases, no renormalised top-k), qwen3_moe (16 experts, top-4, q/k norms, heads wider than
hidden / heads), llama (dense). Each has 2 layers of width 64, grouped-query attention (4 heads,
2 key/value heads) and the shipped tokenizer's vocabulary (8000) padded to 8064, so it trains
on the shipped corpus.
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
    config = getattr(transformers, config_class)(**COMMON, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    # The routers' default initialisation is all but uniform: spread it so top-k matters.
    for name, param in model.named_parameters():
        if name.endswith(("gate.weight", "shared_expert_gate.weight")):
            torch.nn.init.normal_(param, std=0.5)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    return folder


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
