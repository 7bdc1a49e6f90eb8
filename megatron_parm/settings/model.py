"""The model's flags: sizes, attention, positions, normalization, initialization, layer modules."""

from __future__ import annotations

from typing import List

from megatron_parm.settings.flag import Flag, fraction, positive_int

GROUP = "model"
# Values of flags whose implementation modules import torch or Megatron-Core (they import
# these from here).
TRANSFORMER_IMPLS = ("local", "transformer_engine")


def _impl_unavailable(value: str):
    """Why a --transformer-impl value cannot run on this machine (a GPU is checked in
    training, which imports torch)."""
    import importlib.util

    if value == "transformer_engine" and importlib.util.find_spec("transformer_engine") is None:
        return ("needs Transformer Engine, which is not installed here (the transformer-engine "
                "package)")
    return None
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")


def flags() -> List[Flag]:
    return [
        Flag("--num-layers", GROUP, check=positive_int),
        Flag("--hidden-size", GROUP, check=positive_int),
        Flag("--ffn-hidden-size", GROUP, help="Default: 4 x --hidden-size.",
             check=positive_int),
        Flag("--num-attention-heads", GROUP, check=positive_int),
        Flag("--seq-length", GROUP, check=positive_int),
        Flag("--max-position-embeddings", GROUP, help="Default: --seq-length.",
             check=positive_int),
        Flag("--hidden-dropout", GROUP),
        Flag("--attention-dropout", GROUP),
        Flag("--disable-bias-linear", GROUP, kind="switch", inverted=False, default=False,
             dest="disable_bias_linear", differs="stored as disable_bias_linear, the key of this "
             "project's checkpoints (the same flag on the command line and in --config)",
             help="No bias in linear layers (with MoE, biases need "
                  "--expert-tensor-parallel-size 1 on Megatron-Core 0.16.1)."),
        Flag("--add-qkv-bias", GROUP,
             help="A bias on the query, key and value projections only (as Qwen2), also with "
                  "--disable-bias-linear."),
        Flag("--openai-gelu", GROUP,
             help="GELU's tanh approximation, as GPT-2 (Hugging Face 'gelu_new')."),
        Flag("--swiglu", GROUP, help="SwiGLU MLPs, dense and experts (SiLU-gated fc1 of 2 x the "
             "FFN width); default --ffn-hidden-size then 8/3 x --hidden-size rounded down to a "
             "multiple of 64, as Megatron-LM."),
        Flag("--position-embedding-type", GROUP, supported=POSITION_EMBEDDINGS,
             unsupported="not built here: learned_absolute, rope and none are",
             help="GPT: learned absolute positions (GPT-2), rotary (rope: Llama, Mixtral, Qwen, "
                  "DeepSeek) or none."),
        Flag("--no-position-embedding", GROUP,
             help="No position embedding (Megatron-LM's older spelling of "
                  "--position-embedding-type none)."),
        Flag("--rotary-base", GROUP, check=positive_int,
             help="With rope: the base of the rotary frequencies (theta)."),
        Flag("--rotary-percent", GROUP, check=fraction,
             help="With rope: the share of each head's channels that rotate."),
        Flag("--normalization", GROUP),
        Flag("--norm-epsilon", GROUP, dest="norm_epsilon",
             help="Epsilon of every LayerNorm / RMSNorm."),
        Flag("--group-query-attention", GROUP,
             help="Grouped-query attention: --num-query-groups key/value heads."),
        Flag("--num-query-groups", GROUP, check=positive_int,
             help="With --group-query-attention: the key/value heads (default %(default)s)."),
        Flag("--kv-channels", GROUP, check=positive_int,
             help="Channels per attention head (default: --hidden-size / "
                  "--num-attention-heads)."),
        Flag("--qk-layernorm", GROUP,
             help="Normalize queries and keys per head (--normalization's kind), as Qwen3."),
        Flag("--untie-embeddings-and-output-weights", GROUP),
        Flag("--init-method-std", GROUP),
        Flag("--transformer-impl", GROUP, default="local", supported=TRANSFORMER_IMPLS,
             unsupported="not built here: local and transformer_engine are",
             unavailable=_impl_unavailable,
             differs="Transformer Engine is optional here: its modules only where asked for",
             help="Layer modules: Megatron-Core's own (local, the default here) or Transformer "
                  "Engine's (needs transformer-engine and a GPU)."),
    ]
