"""Hugging Face GPT-2 weights (a local directory) -> a dense checkpoint of this project.

    read_hf_gpt2(path)                (config dict, {HF name: tensor})
    hf_gpt2_to_full(path)             FullCheckpoint: Megatron-Core GPTModel names, iteration 0

The directory is what `save_pretrained` writes: config.json and model.safetensors or
pytorch_model.bin (vocab.json and merges.txt, the GPT-2 tokenizer, when present, are named in
the checkpoint's flags). Nothing is downloaded; no `transformers` needed.

How GPT-2 maps onto Megatron's GPT (local spec, learned absolute positions, tied embeddings):

    wte [V, H]            -> embedding.word_embeddings.weight [Vp, H]   zero rows up to Vp
    wpe [P, H]            -> embedding.position_embeddings.weight
    h.i.ln_1              -> decoder.layers.self_attention.linear_qkv.layer_norm_{weight,bias}
    h.i.attn.c_attn       -> decoder.layers.self_attention.linear_qkv.{weight,bias}
    h.i.attn.c_proj       -> decoder.layers.self_attention.linear_proj.{weight,bias}
    h.i.ln_2              -> decoder.layers.mlp.linear_fc1.layer_norm_{weight,bias}
    h.i.mlp.c_fc / c_proj -> decoder.layers.mlp.linear_fc1 / linear_fc2
    ln_f                  -> decoder.final_layernorm

GPT-2's Conv1D stores weights as [in, out]; Megatron's linears as [out, in]: transposed.
c_attn's outputs are [all queries | all keys | all values]; Megatron's fused QKV is laid out
per head: [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]: regrouped. Layers are stacked on a leading axis
(the checkpoint's global tensors). GPT-2's activation is GELU's tanh form (--openai-gelu).

The vocabulary is padded as Megatron-LM pads it (a multiple of 128 x TP) with zero rows; as in
Megatron-LM, the padded entries take part in the softmax (logit 0), so the loss differs from
Hugging Face's by that much while the logits of real tokens are the same.
"""

from __future__ import annotations

import os
import re
from typing import Dict, Tuple

import torch

from megatron_parm.checkpointing.errors import CheckpointError
from megatron_parm.checkpointing.full import FullCheckpoint
from megatron_parm.checkpointing.hf_files import read_config, read_weights
from megatron_parm.checkpointing.state import CHECKPOINT_VERSION
from megatron_parm.data.vocab import MAKE_VOCAB_SIZE_DIVISIBLE_BY, padded_vocab_size
from megatron_parm.wording import plural

# GPT-2's activation names: the tanh approximation (Megatron's --openai-gelu) or erf GELU.
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
_LAYER = re.compile(r"^h\.(\d+)\.(.+)$")


def read_hf_gpt2(path: str) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """(config, weights) of a GPT-2 directory; names without the 'transformer.' prefix."""
    config = read_config(path)
    if config.get("model_type") != "gpt2":
        raise CheckpointError(f"{os.path.join(path, 'config.json')}: model_type "
                              f"{config.get('model_type')!r}; only 'gpt2' can be converted")
    weights = read_weights(path)
    weights = {(key[len("transformer."):] if key.startswith("transformer.") else key): value
               for key, value in weights.items()}
    return config, weights


def _model_flags(config: dict, path: str) -> dict:
    """The flags (as the trainer names them) of the model CONFIG describes; refuses what
    Megatron's GPT cannot compute."""
    for key, wanted in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                        ("add_cross_attention", False)):
        if config.get(key, wanted) != wanted:
            raise CheckpointError(f"{path}/config.json: {key}={config[key]} has no Megatron "
                                  f"equivalent")
    activation = config.get("activation_function", "gelu_new")
    if activation not in TANH_GELU + ("gelu",):
        raise CheckpointError(f"{path}/config.json: activation_function {activation!r}; "
                              f"supported: {', '.join(TANH_GELU + ('gelu',))}")
    hidden = config["n_embd"]
    flags = dict(model_type="gpt", num_layers=config["n_layer"], hidden_size=hidden,
                 ffn_hidden_size=config.get("n_inner") or 4 * hidden,
                 num_attention_heads=config["n_head"],
                 max_position_embeddings=config["n_positions"],
                 seq_length=config["n_positions"], disable_bias_linear=False,
                 untie_embeddings_and_output_weights=False, num_experts=None,
                 openai_gelu=activation in TANH_GELU,
                 norm_epsilon=config.get("layer_norm_epsilon", 1e-5))
    vocab = os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt")
    if all(os.path.isfile(f) for f in vocab):
        flags.update(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab[0], merge_file=vocab[1])
    return flags


def _qkv_per_head(tensor_out_first: torch.Tensor, heads: int) -> torch.Tensor:
    """[3H, ...] as [q | k | v] -> [3H, ...] as [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]."""
    rest = tensor_out_first.shape[1:]
    head_dim = tensor_out_first.shape[0] // (3 * heads)
    grouped = tensor_out_first.reshape(3, heads, head_dim, *rest).transpose(0, 1)
    return grouped.reshape(3 * heads * head_dim, *rest)


def hf_gpt2_to_full(path: str, make_vocab_size_divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY
                    ) -> FullCheckpoint:
    """The dense checkpoint (model only, iteration 0) of the GPT-2 in directory PATH."""
    config, weights = read_hf_gpt2(path)
    flags = _model_flags(config, path)
    layers, heads = flags["num_layers"], flags["num_attention_heads"]

    def take(name: str) -> torch.Tensor:
        if name not in weights:
            raise CheckpointError(f"{path}: weight {name!r} missing (config.json says "
                                  f"{plural(layers, 'layer')})")
        return weights[name].to(torch.float32)

    def stacked(name: str, transform=lambda t: t) -> torch.Tensor:
        return torch.stack([transform(take(f"h.{i}.{name}")) for i in range(layers)])

    indices = {int(m.group(1)) for m in map(_LAYER.match, weights) if m}
    extra = sorted(indices - set(range(layers)))
    if extra:
        raise CheckpointError(f"{path}: weights for layers {extra} but config.json says "
                              f"n_layer={layers}")
    wte = take("wte.weight")
    if "lm_head.weight" in weights and not torch.equal(weights["lm_head.weight"].float(), wte):
        raise CheckpointError(f"{path}: lm_head.weight differs from wte.weight; GPT-2 ties them "
                              f"and so does this conversion")
    vocab = wte.shape[0]
    padded = padded_vocab_size(vocab, 1, make_vocab_size_divisible_by)  # loads under any TP
    # that divides it (data/vocab.py); recorded with the flags, as a trained checkpoint's
    flags["make_vocab_size_divisible_by"] = make_vocab_size_divisible_by
    word_embeddings = torch.zeros(padded, wte.shape[1])
    word_embeddings[:vocab] = wte
    qkv = "decoder.layers.self_attention.linear_qkv"
    fc1 = "decoder.layers.mlp.linear_fc1"
    tensors = {
        "embedding.word_embeddings.weight": word_embeddings,
        "embedding.position_embeddings.weight": take("wpe.weight"),
        f"{qkv}.layer_norm_weight": stacked("ln_1.weight"),
        f"{qkv}.layer_norm_bias": stacked("ln_1.bias"),
        f"{qkv}.weight": stacked("attn.c_attn.weight", lambda t: _qkv_per_head(t.t(), heads)),
        f"{qkv}.bias": stacked("attn.c_attn.bias", lambda t: _qkv_per_head(t, heads)),
        "decoder.layers.self_attention.linear_proj.weight": stacked("attn.c_proj.weight", torch.t),
        "decoder.layers.self_attention.linear_proj.bias": stacked("attn.c_proj.bias"),
        f"{fc1}.layer_norm_weight": stacked("ln_2.weight"),
        f"{fc1}.layer_norm_bias": stacked("ln_2.bias"),
        f"{fc1}.weight": stacked("mlp.c_fc.weight", torch.t),
        f"{fc1}.bias": stacked("mlp.c_fc.bias"),
        "decoder.layers.mlp.linear_fc2.weight": stacked("mlp.c_proj.weight", torch.t),
        "decoder.layers.mlp.linear_fc2.bias": stacked("mlp.c_proj.bias"),
        "decoder.final_layernorm.weight": take("ln_f.weight"),
        "decoder.final_layernorm.bias": take("ln_f.bias"),
    }
    tensors = {key: value.contiguous() for key, value in tensors.items()}
    # Megatron's local linears carry an (empty) _extra_state per layer; the loader expects it.
    objects = {f"decoder.layers.{module}._extra_state/shard_{i}_{layers}": [None]
               for module in ("self_attention.linear_qkv", "self_attention.linear_proj",
                              "mlp.linear_fc1", "mlp.linear_fc2") for i in range(layers)}
    common = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": 0, "consumed_samples": 0,
              "args": flags, "model_info": {"padded_vocab_size": padded},
              "layout": None, "converted_from": {"huggingface_gpt2": os.path.abspath(path),
                                                 "vocab_size": vocab}}
    return FullCheckpoint(tensors, objects, common)
