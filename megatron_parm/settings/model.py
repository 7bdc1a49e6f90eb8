"""The model's flags: sizes, attention, positions, normalization, activations, initialization,
layer modules. Most set the TransformerConfig field of the same name, as Megatron-LM's
core_transformer_config_from_args copies them (training/model.py)."""

from __future__ import annotations

from typing import List

from megatron_parm.settings.flag import (
    Flag, fraction, layer_pattern_check, positive_int, positive_number)

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
        Flag("--encoder-num-layers", GROUP, check=positive_int,
             help="Megatron-LM's other name of --num-layers for GPT and BERT (give one of the "
                  "two)."),
        *_attention_flags(), *_position_flags(), *_activation_flags(), *_init_flags(),
        *mla_flags(),
    ]


def _window_size(flag: str, value) -> None:
    if not (isinstance(value, tuple) and len(value) == 2
            and all(type(side) is int and side >= -1 for side in value)):
        raise ValueError(f"{flag} takes two integers (left, right; -1 unbounded), e.g. "
                         f"'(4096, 0)', got {value!r}")


def _attention_flags() -> List[Flag]:
    """Attention: softmax, scaling, q/k norms, its output gate, windows, the backend."""
    return [
        Flag("--attention-softmax-in-fp32", GROUP,
             help="With --bf16 / --fp16: compute the attention softmax in fp32 (Megatron-LM's "
                  "default computes it in the model's precision)."),
        Flag("--apply-query-key-layer-scaling", GROUP,
             help="Divide the attention scores by the layer number before the softmax and "
                  "multiply them back in it (in fp32: implies --attention-softmax-in-fp32)."),
        Flag("--qk-l2-norm", GROUP,
             help="GPT: L2-normalize queries and keys per head (Llama-4 style)."),
        Flag("--attention-output-gate", GROUP,
             help="Gate the attention output by a sigmoid of an extra query-sized projection "
                  "(the QKV projection grows by it)."),
        Flag("--softmax-type", GROUP,
             help="The attention softmax: vanilla, off-by-one (an extra zero logit per head) or "
                  "learnable (a learned logit offset per head)."),
        Flag("--window-size", GROUP, check=_window_size,
             help="GPT: sliding-window attention, (left, right) tokens, e.g. '(4096, 0)'."),
        Flag("--window-attn-skip-freq", GROUP, check=layer_pattern_check("1 (full attention) or "
                                                                          "0 (window)"),
             help="With --window-size: every N-th layer attends fully, or a list of 1 (full) "
                  "and 0 (window) per layer."),
        Flag("--attention-backend", GROUP,
             help="Transformer Engine's attention kernels (with --transformer-impl "
                  "transformer_engine); local modules build Megatron-Core's DotProductAttention "
                  "whatever the value, and BERT's takes only local or auto (as Megatron-Core)."),
    ]


def _position_flags() -> List[Flag]:
    """Rotary position embeddings beyond --rotary-base and --rotary-percent (GPT)."""
    return [
        Flag("--use-rotary-position-embeddings", GROUP,
             help="Megatron-LM's older spelling of --position-embedding-type rope."),
        Flag("--rotary-interleaved", GROUP,
             help="With rope: rotate interleaved channel pairs (GPT-J) instead of the two "
                  "halves (GPT-NeoX)."),
        Flag("--use-rope-scaling", GROUP,
             help="With rope: Llama-3.1's frequency scaling (Megatron-Core's factor 8)."),
        Flag("--no-rope-freq", GROUP, check=layer_pattern_check("1 (no rope) or 0 (rope)"),
             help="With rope: every N-th layer without rotary embeddings, or a list of 1 (no "
                  "rope) and 0 (rope) per layer."),
    ]


def _activation_flags() -> List[Flag]:
    """MLP activations beyond --swiglu and --openai-gelu, and the LayerNorm's gamma."""
    return [
        Flag("--squared-relu", GROUP, help="Squared ReLU MLPs (dense and experts)."),
        Flag("--quick-geglu", GROUP,
             help="Quick-GELU-gated MLPs (x * sigmoid(1.702 x) gating a linear half; fc1 of 2 x "
                  "the FFN width)."),
        Flag("--glu-linear-offset", GROUP,
             help="Gated MLPs: add this to the linear half before the gate multiplies it."),
        Flag("--activation-func-clamp-value", GROUP, check=positive_number,
             help="Gated MLPs: clamp the gate's input to at most this and the linear half to "
                  "[-this, this]."),
        Flag("--apply-layernorm-1p", GROUP,
             help="Zero-centered LayerNorm / RMSNorm gamma: weights start at 0 and scale by "
                  "1 + weight."),
    ]


def _init_flags() -> List[Flag]:
    """Initialization of the weights."""
    return [
        Flag("--embedding-init-method-std", GROUP, check=positive_number,
             help="Std of the embeddings' normal initialization (default --init-method-std)."),
        Flag("--init-method-xavier-uniform", GROUP,
             help="Xavier-uniform initialization of every weight the normal one would take, "
                  "the output layers' included (Megatron-LM 0.16.1 passes those under a name "
                  "its TransformerConfig no longer has, and stops)."),
        Flag("--no-initialization", GROUP,
             help="Leave the weights uninitialized (a checkpoint loads them)."),
        Flag("--use-cpu-initialization", GROUP,
             help="Initialize the weights on the CPU, the whole matrix then this rank's shard "
                  "(the same weights at any TP size; always so without a GPU)."),
        Flag("--data-parallel-random-init", GROUP,
             help="Seed each data-parallel rank differently (--seed + 10 x its rank), then "
                  "copy the first one's weights to the others."),
    ]




def mla_flags() -> List[Flag]:
    """Multi-latent attention (DeepSeek-V2/V3): Megatron-Core's MLASelfAttention."""
    return [
        Flag("--multi-latent-attention", GROUP,
             help="Multi-latent attention (DeepSeek-V2/V3): queries, keys and values through "
                  "low-rank latents, Megatron-Core's MLASelfAttention (GPT only)."),
        Flag("--q-lora-rank", GROUP, check=positive_int,
             help="With MLA: the queries' latent width (default none: one query projection)."),
        Flag("--kv-lora-rank", GROUP, check=positive_int,
             help="With MLA: the keys' and values' latent width (default %(default)s)."),
        Flag("--qk-head-dim", GROUP, check=positive_int,
             help="With MLA: the channels per query / key head without rotary positions "
                  "(default %(default)s)."),
        Flag("--qk-pos-emb-head-dim", GROUP, check=positive_int,
             help="With MLA: the rotary channels per query / key head (default %(default)s)."),
        Flag("--v-head-dim", GROUP, check=positive_int,
             help="With MLA: the channels per value head (default %(default)s)."),
        Flag("--rope-type", GROUP,
             help="rope or yarn (YaRN-scaled rotary, --rotary-scaling-factor and the mscales); "
                  "default: yarn with MLA, rope without (which takes rope only)."),
        Flag("--rotary-scaling-factor", GROUP, check=positive_number,
             help="With MLA and yarn: the YaRN scaling factor of the rotary positions."),
        Flag("--mscale", GROUP, help="With MLA and yarn: YaRN's mscale."),
        Flag("--mscale-all-dim", GROUP, help="With MLA and yarn: YaRN's mscale_all_dim (it also "
             "scales the softmax)."),
    ]
