"""Hugging Face DeepSeek-V2 / -V3 models (a local directory) <-> whole checkpoints of this project.

    hf_to_full(path, make_vocab_size_divisible_by, mtp_num_layers)
                                        FullCheckpoint (model only, iteration 0) and its flags
    full_to_hf(full, flags, path, max_shard)
                                        config.json + safetensors in PATH (V3, or V2 where the
                                        router is a softmax)
    hf_flags(config, family, path, mtp_num_layers)
                                        the trainer's flags of a DeepSeek config.json

The families are hf_llama.FAMILIES' entries with mla=True; hf_llama.py holds the helpers both
mappings share (reading and writing the directory, the vocabulary's padding, the checkpoint's
common state). Megatron-Core's GPT with multi-latent attention on the local spec (the names
Megatron-Bridge maps to). A model whose layers differ (--moe-layer-freq a list, which an import
always records) saves layer i under decoder.layers.i. without a layer axis; experts add an
axis [E, ...]. Within HF layer i (model.layers.i.) and our decoder.layers.i.:

    input_layernorm                      -> input_layernorm.weight
    self_attn.q_a_proj                   -> self_attention.linear_q_down_proj.weight
    self_attn.q_a_layernorm              -> self_attention.q_layernorm.weight
    self_attn.q_b_proj                   -> self_attention.linear_q_up_proj.weight
    self_attn.q_proj (q_lora_rank null)  -> self_attention.linear_q_proj.weight
    self_attn.kv_a_proj_with_mqa         -> self_attention.linear_kv_down_proj.weight
    self_attn.kv_a_layernorm             -> self_attention.kv_layernorm.weight
    self_attn.kv_b_proj                  -> self_attention.linear_kv_up_proj.weight
    self_attn.o_proj                     -> self_attention.linear_proj.weight
    post_attention_layernorm             -> pre_mlp_layernorm.weight
    dense (i < first_k_dense_replace): mlp.{gate,up,down}_proj -> mlp.linear_fc{1,2}.weight
    MoE: mlp.gate.weight                 -> mlp.router.weight
         mlp.gate.e_score_correction_bias (V3)
                                         -> mlp.router.expert_bias
         mlp.experts.e.{gate,up,down}_proj
                                         -> mlp.experts.experts.linear_fc{1,2}.weight [E, ...]
         mlp.shared_experts.*            -> mlp.shared_experts.linear_fc{1,2}.weight
    MTP (--mtp-num-layers d): HF layer num_hidden_layers + j, j < d, which transformers does not
    build or run; its decoder layer -> mtp.layers.j.transformer_layer.*, and
         enorm, hnorm, eh_proj           -> mtp.layers.j.{enorm,hnorm,eh_proj}.weight
         shared_head.norm                -> mtp.layers.j.final_layernorm.weight
         embed_tokens, shared_head.head  copies of the model's embedding and output layer
                                         (checked equal on import, written on export)

fc1 is [gate; up] as in hf_llama. Rotary positions: DeepSeek rotates the qk_rope_head_dim
channels in interleaved pairs (2i, 2i+1) at frequency i (V2's complex product; V3 with
rope_interleave true); Megatron-Core's MLA takes the even channels, then the odd ones, and
rotates the halves: the same pairs, so the weights carry over unchanged and
--rotary-interleaved stays off. A V3 with rope_interleave false rotates channel i with
i + d/2: its rotary rows of q_b_proj (q_proj) and kv_a_proj_with_mqa are interleaved at import
(interleaved_rope_rows), and the export is rope_interleave true. YaRN (rope_type yarn): factor -> --rotary-scaling-factor,
mscale and mscale_all_dim -> --mscale, --mscale-all-dim (both scale the cosines and sines by
their ratio; mscale_all_dim also the softmax), original_max_position_embeddings, beta_fast and
beta_slow must be Megatron-Core's fixed 4096, 32 and 1 (no Megatron-LM flag sets them).

Routing. V3: sigmoid scores (--moe-router-score-function sigmoid), e_score_correction_bias
chooses the experts and not their weights (--moe-router-enable-expert-bias), n_group groups
of which topk_group are kept by the sum of each group's best two scores
(--moe-router-num-groups, --moe-router-group-topk: Megatron-Core sums the best
topk / group_topk, so topk = 2 topk_group), the kept scores renormalised (Megatron-Core always
does, norm_topk_prob true) and times routed_scaling_factor
(--moe-router-topk-scaling-factor). V2 (transformers): the softmax over all experts, no
renormalisation (--moe-router-pre-softmax), topk_method greedy or group_limited_greedy
(groups ranked by their best score: topk = topk_group), times routed_scaling_factor.
n_shared_experts shared experts are one MLP of n_shared_experts x moe_intermediate_size
(--moe-shared-expert-intermediate-size), without a gate.
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, Optional, Tuple

import torch

from megatron_parm.checkpointing.errors import CheckpointError
from megatron_parm.checkpointing.full import FullCheckpoint
from megatron_parm.checkpointing.hf_files import read_config
from megatron_parm.checkpointing.hf_llama import (
    FAMILIES,
    HFTensors,
    _rope_theta,
    config_keys,
    export_vocab,
    family_of,
    imported_common,
    outer_tensors,
    padded_rows,
    padded_vocab,
    require_flags,
    tokenizer_flags,
    write_hf,
)
from megatron_parm.data.vocab import MAKE_VOCAB_SIZE_DIVISIBLE_BY
from megatron_parm.layout_rules import moe_layer_pattern

V2, V3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"
GLU = ("gate_proj", "up_proj", "down_proj")
# MLATransformerConfig's YaRN settings that no Megatron-LM flag sets (and HF's defaults)
MEGATRON_YARN = {"original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}
# The MTP layer's own tensors: ours (in mtp.layers.j.) <- theirs (in model.layers.N+j.)
MTP_OWN = (("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"),
           ("eh_proj.weight", "eh_proj.weight"),
           ("final_layernorm.weight", "shared_head.norm.weight"))
# ... and its copies of the model's tensors: theirs -> ours
MTP_COPIES = (("embed_tokens.weight", "embedding.word_embeddings.weight"),
              ("shared_head.head.weight", "output_layer.weight"))


def _problem(where: str, key: str, value, why: str) -> CheckpointError:
    return CheckpointError(f"{where}: {key}={value!r}: {why}")


# ---------------------------------------------------------------------------------------------
# config.json <-> the trainer's flags
# ---------------------------------------------------------------------------------------------

def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale (the same function in transformers and Megatron-Core)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_flags(config: dict, where: str) -> dict:
    """The rotary flags of CONFIG: plain rope or YaRN, refusing what Megatron-Core's MLA
    computes otherwise."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    flags = dict(position_embedding_type="rope", rotary_base=int(_rope_theta(config)),
                 rotary_percent=1.0)
    if kind == "default":
        return {**flags, "rope_type": "rope"}
    if kind != "yarn":
        raise _problem(where, "rope_type", kind, "multi-latent attention here takes default "
                       "or yarn rotary positions")
    for key, wanted in MEGATRON_YARN.items():
        value = rope.get(key, config.get("max_position_embeddings")
                         if key == "original_max_position_embeddings" else wanted)
        if value != wanted:
            raise _problem(where, f"rope_parameters {key}", value, f"Megatron-Core's multi-latent "
                           f"attention fixes it at {wanted} (no Megatron-LM flag sets it)")
    if rope.get("truncate", True) is not True:
        raise _problem(where, "rope_parameters truncate", rope["truncate"],
                       "Megatron-Core's YaRN truncates its correction range")
    factor = rope.get("factor") or config["max_position_embeddings"] / MEGATRON_YARN[
        "original_max_position_embeddings"]
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    # transformers: the ratio of the two where both are given, else the plain YaRN scale
    theirs = rope.get("attention_factor") or (
        yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim) if mscale and all_dim
        else yarn_mscale(factor))
    ours = dict(mscale=float(mscale) if mscale and all_dim else 1.0,
                mscale_all_dim=float(all_dim or 0.0))
    if abs(yarn_mscale(factor, ours["mscale"]) / yarn_mscale(factor, ours["mscale_all_dim"])
           - theirs) > 1e-12:
        raise _problem(where, "rope_parameters mscale, mscale_all_dim, attention_factor",
                       (mscale, all_dim, rope.get("attention_factor")),
                       "YaRN's scale of the cosines and sines then differs from any that "
                       "--mscale and --mscale-all-dim give")
    return {**flags, "rope_type": "yarn", "rotary_scaling_factor": float(factor), **ours}


def router_flags(config: dict, architecture: str, where: str) -> dict:
    """The router's flags of CONFIG (V3: sigmoid with an expert bias; V2: softmax)."""
    topk, groups = config["num_experts_per_tok"], config.get("n_group") or 1
    group_topk = config.get("topk_group") or 1
    scaling = config.get("routed_scaling_factor", 1.0)
    flags = dict(moe_router_topk=topk, moe_router_dtype="fp32",
                 moe_router_topk_scaling_factor=float(scaling) if scaling != 1.0 else None,
                 moe_router_num_groups=groups if groups > 1 else None,
                 moe_router_group_topk=group_topk if groups > 1 else None)
    if architecture == V3:
        if bool(config.get("norm_topk_prob", True)) != (topk > 1):
            raise _problem(where, "norm_topk_prob", config.get("norm_topk_prob"),
                           "Megatron-Core renormalises sigmoid scores exactly where top-k > 1")
        if groups > 1 and topk != 2 * group_topk:
            raise _problem(where, "topk_group", group_topk, f"DeepSeek-V3 ranks groups by "
                           f"their best 2 scores, Megatron-Core by their best top-k / "
                           f"topk_group ({topk} // {group_topk}): num_experts_per_tok must be "
                           f"2 x topk_group")
        return {**flags, "moe_router_score_function": "sigmoid",
                "moe_router_enable_expert_bias": True}
    method = config.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise _problem(where, "topk_method", method, "DeepseekV2ForCausalLM takes greedy or "
                       "group_limited_greedy")
    if config.get("norm_topk_prob"):
        raise _problem(where, "norm_topk_prob", True, "transformers' DeepseekV2ForCausalLM "
                       "ignores it (no renormalised top-k); the model it describes is ambiguous")
    if method == "greedy":
        flags.update(moe_router_num_groups=None, moe_router_group_topk=None)
    elif groups > 1 and topk != group_topk:
        raise _problem(where, "topk_group", group_topk, f"group_limited_greedy ranks groups by "
                       f"their best score, Megatron-Core by their best top-k / topk_group "
                       f"({topk} // {group_topk}): num_experts_per_tok must equal topk_group")
    return {**flags, "moe_router_score_function": "softmax", "moe_router_pre_softmax": True}


def _refuse_unsupported(config: dict, where: str) -> None:
    heads = config["num_attention_heads"]
    problems = (
        ("hidden_act", config.get("hidden_act", "silu") != "silu", "SiLU-gated MLPs only"),
        ("attention_bias", bool(config.get("attention_bias")), "the attention has no biases here"),
        ("mlp_bias", bool(config.get("mlp_bias")), "the MLPs have no biases here"),
        ("num_key_value_heads", config.get("num_key_value_heads") not in (None, heads),
         f"multi-latent attention has a key and value per head ({heads})"),
        ("moe_layer_freq", config.get("moe_layer_freq", 1) != 1,
         "transformers makes every layer from first_k_dense_replace on MoE"),
        ("n_routed_experts", not config.get("n_routed_experts"), "a DeepSeek model here is MoE"),
    )
    for key, bad, why in problems:
        if bad:
            raise _problem(where, key, config.get(key), why)


def hf_flags(config: dict, family, path: str, mtp_num_layers: Optional[int] = None) -> dict:
    """The trainer's flags of the DeepSeek model CONFIG describes (refusing what it cannot
    compute); MTP_NUM_LAYERS: the MTP layers to import with it (--mtp-num-layers)."""
    where = os.path.join(path, "config.json")
    with config_keys(where, family.architecture):
        _refuse_unsupported(config, where)
        layers, dense = config["num_hidden_layers"], config.get("first_k_dense_replace") or 0
        shared = config.get("n_shared_experts") or 0
        flags = dict(
            model_type="gpt", num_layers=layers, hidden_size=config["hidden_size"],
            ffn_hidden_size=config["intermediate_size"],
            num_attention_heads=config["num_attention_heads"], multi_latent_attention=True,
            q_lora_rank=config.get("q_lora_rank"), kv_lora_rank=config["kv_lora_rank"],
            qk_head_dim=config["qk_nope_head_dim"],
            qk_pos_emb_head_dim=config["qk_rope_head_dim"], v_head_dim=config["v_head_dim"],
            qk_layernorm=True, max_position_embeddings=config["max_position_embeddings"],
            seq_length=min(config["max_position_embeddings"], 4096),
            **rope_flags(config, where),
            normalization="RMSNorm", norm_epsilon=config.get("rms_norm_eps", 1e-6),
            swiglu=True, disable_bias_linear=True, add_qkv_bias=False,
            untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
            hidden_dropout=0.0, attention_dropout=float(config.get("attention_dropout") or 0.0),
            init_method_std=config.get("initializer_range", 0.02),
            num_experts=config["n_routed_experts"],
            moe_ffn_hidden_size=config["moe_intermediate_size"],
            moe_layer_freq=[0] * dense + [1] * (layers - dense),
            moe_shared_expert_intermediate_size=shared * config["moe_intermediate_size"] or None,
            **router_flags(config, family.architecture, where))
        if config.get("aux_loss_alpha"):
            flags.update(moe_aux_loss_coeff=config["aux_loss_alpha"],
                         moe_router_load_balancing_type="seq_aux_loss"
                         if config.get("seq_aux", True) else "aux_loss")
        if mtp_num_layers:
            available = config.get("num_nextn_predict_layers") or 0
            if mtp_num_layers > available:
                raise CheckpointError(f"--mtp-num-layers {mtp_num_layers}: {where} has "
                                      f"num_nextn_predict_layers={available}")
            if dense >= layers:
                raise CheckpointError(f"--mtp-num-layers: {where} has no MoE layer "
                                      f"(first_k_dense_replace={dense}), which the MTP "
                                      f"layer's kind follows")
            flags["mtp_num_layers"] = mtp_num_layers
    return {**flags, **tokenizer_flags(path)}


def export_architecture(flags: dict) -> str:
    """V3 or V2, the architecture whose model FLAGS (an MLA checkpoint's) describe."""
    require_flags(flags, {
        "swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope",
        "disable_bias_linear": True, "rotary_percent": 1.0, "model_type": "gpt",
        "qk_layernorm": True, "rotary_interleaved": False, "add_qkv_bias": False,
        "moe_shared_expert_gate": False}, "DeepSeek-V2/V3")
    if not flags.get("num_experts"):
        raise CheckpointError("--to-hf: the checkpoint has multi-latent attention and no "
                              "--num-experts; DeepSeek-V2/V3 are MoE models")
    pattern = moe_layer_pattern(flags.get("moe_layer_freq", 1), flags["num_layers"])
    dense = pattern.index(1) if 1 in pattern else len(pattern)
    shared, ffn = flags.get("moe_shared_expert_intermediate_size"), flags["moe_ffn_hidden_size"]
    topk, groups = flags["moe_router_topk"], flags.get("moe_router_num_groups") or 1
    group_topk = flags.get("moe_router_group_topk") or 1
    sigmoid = flags.get("moe_router_score_function", "softmax") == "sigmoid"
    mismatch = (
        ("--moe-layer-freq", pattern != [0] * dense + [1] * (len(pattern) - dense),
         "dense layers first, then MoE layers"),
        ("--moe-shared-expert-intermediate-size", bool(shared) and shared % ffn != 0,
         "a multiple of --moe-ffn-hidden-size"),
        ("--moe-router-group-topk", groups > 1 and topk != (2 if sigmoid else 1) * group_topk,
         f"--moe-router-topk {'2 x' if sigmoid else 'equal to'} it"),
        ("--moe-router-pre-softmax", not sigmoid and topk > 1
         and not flags.get("moe_router_pre_softmax"),
         "set with a softmax router (DeepSeek-V2 does not renormalise the top-k)"),
        ("--moe-router-enable-expert-bias", not sigmoid
         and flags.get("moe_router_enable_expert_bias"), "a sigmoid router (DeepSeek-V3)"),
    )
    for flag, bad, needs in mismatch:
        if bad:
            raise CheckpointError(f"--to-hf: the checkpoint's {flag} does not fit DeepSeek-V2/V3, "
                                  f"which need {needs}")
    return V3 if sigmoid else V2


def hf_config(flags: dict, architecture: str, vocab: int, dtype: torch.dtype) -> dict:
    """config.json of the exported model."""
    layers, heads = flags["num_layers"], flags["num_attention_heads"]
    pattern = moe_layer_pattern(flags.get("moe_layer_freq", 1), layers)
    groups = flags.get("moe_router_num_groups") or 1
    rope = {"rope_type": "default", "rope_theta": float(flags["rotary_base"])}
    if (flags.get("rope_type") or "yarn") == "yarn":  # MLA's default
        rope.update(rope_type="yarn", factor=flags["rotary_scaling_factor"],
                    mscale=flags["mscale"], mscale_all_dim=flags["mscale_all_dim"],
                    **MEGATRON_YARN)
    config = {
        "architectures": [architecture], "model_type": FAMILIES[architecture].model_type,
        "vocab_size": vocab, "hidden_size": flags["hidden_size"],
        "intermediate_size": flags["ffn_hidden_size"], "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads,
        "q_lora_rank": flags.get("q_lora_rank"), "kv_lora_rank": flags["kv_lora_rank"],
        "qk_nope_head_dim": flags["qk_head_dim"], "qk_rope_head_dim": flags["qk_pos_emb_head_dim"],
        "v_head_dim": flags["v_head_dim"],
        "max_position_embeddings": flags.get("max_position_embeddings") or flags["seq_length"],
        "rms_norm_eps": flags["norm_epsilon"], "hidden_act": "silu",
        "rope_theta": float(flags["rotary_base"]), "rope_parameters": rope,
        "tie_word_embeddings": not flags.get("untie_embeddings_and_output_weights"),
        "attention_bias": False, "attention_dropout": flags.get("attention_dropout") or 0.0,
        "initializer_range": flags.get("init_method_std", 0.02),
        "n_routed_experts": flags["num_experts"], "num_experts_per_tok": flags["moe_router_topk"],
        "moe_intermediate_size": flags["moe_ffn_hidden_size"],
        "n_shared_experts": (flags.get("moe_shared_expert_intermediate_size") or 0)
        // flags["moe_ffn_hidden_size"],
        "first_k_dense_replace": pattern.index(1) if 1 in pattern else layers,
        "routed_scaling_factor": flags.get("moe_router_topk_scaling_factor") or 1.0,
        "n_group": groups, "topk_group": flags.get("moe_router_group_topk") or 1,
        "num_nextn_predict_layers": flags.get("mtp_num_layers") or 0,
        "dtype": str(dtype).replace("torch.", ""), "use_cache": True,
    }
    if architecture == V3:
        config.update(norm_topk_prob=flags["moe_router_topk"] > 1, rope_interleave=True)
    else:
        config.update(norm_topk_prob=False,
                      topk_method="group_limited_greedy" if groups > 1 else "greedy")
    if flags.get("moe_aux_loss_coeff"):
        config.update(aux_loss_alpha=flags["moe_aux_loss_coeff"],
                      seq_aux=flags.get("moe_router_load_balancing_type") == "seq_aux_loss")
    return config


# ---------------------------------------------------------------------------------------------
# per-layer tensors: one table serves both directions
# ---------------------------------------------------------------------------------------------

def _glu(ours: str, theirs: str, expert=None) -> list:
    gate, up, down = GLU
    return [(f"{ours}.linear_fc1.weight", (f"{theirs}.{gate}.weight", f"{theirs}.{up}.weight"),
             expert), (f"{ours}.linear_fc2.weight", (f"{theirs}.{down}.weight",), expert)]


def layer_table(flags: dict, moe: bool) -> List[Tuple[str, Tuple[str, ...], Optional[int]]]:
    """(our name within a layer, its Hugging Face names within a layer, expert or None) for
    every tensor of a (MOE or dense) layer; two HF names (gate, up): fc1 = [gate; up]."""
    attention = "self_attention"
    query = ([(f"{attention}.linear_q_down_proj.weight", ("self_attn.q_a_proj.weight",)),
              (f"{attention}.q_layernorm.weight", ("self_attn.q_a_layernorm.weight",)),
              (f"{attention}.linear_q_up_proj.weight", ("self_attn.q_b_proj.weight",))]
             if flags.get("q_lora_rank") else
             [(f"{attention}.linear_q_proj.weight", ("self_attn.q_proj.weight",))])
    table = [(ours, theirs, None) for ours, theirs in (
        ("input_layernorm.weight", ("input_layernorm.weight",)), *query,
        (f"{attention}.linear_kv_down_proj.weight", ("self_attn.kv_a_proj_with_mqa.weight",)),
        (f"{attention}.kv_layernorm.weight", ("self_attn.kv_a_layernorm.weight",)),
        (f"{attention}.linear_kv_up_proj.weight", ("self_attn.kv_b_proj.weight",)),
        (f"{attention}.linear_proj.weight", ("self_attn.o_proj.weight",)),
        ("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",)))]
    if not moe:
        return table + _glu("mlp", "mlp")
    table.append(("mlp.router.weight", ("mlp.gate.weight",), None))
    if flags.get("moe_router_enable_expert_bias"):
        table.append(("mlp.router.expert_bias", ("mlp.gate.e_score_correction_bias",), None))
    for expert in range(flags["num_experts"]):
        table += _glu("mlp.experts.experts", f"mlp.experts.{expert}", expert)
    if flags.get("moe_shared_expert_intermediate_size"):
        table += _glu("mlp.shared_experts", "mlp.shared_experts")
    return table


def _shapes(flags: dict, vocab: int) -> Dict[str, tuple]:
    """The shape of every Hugging Face tensor (a layer's by its name within the layer)."""
    hidden, heads = flags["hidden_size"], flags["num_attention_heads"]
    nope, rope, value = flags["qk_head_dim"], flags["qk_pos_emb_head_dim"], flags["v_head_dim"]
    q_lora, kv_lora = flags.get("q_lora_rank"), flags["kv_lora_rank"]
    shapes = {"embed_tokens.weight": (vocab, hidden), "norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden), "input_layernorm.weight": (hidden,),
              "post_attention_layernorm.weight": (hidden,),
              "self_attn.q_a_proj.weight": (q_lora, hidden), "self_attn.q_a_layernorm.weight":
              (q_lora,), "self_attn.q_b_proj.weight": (heads * (nope + rope), q_lora),
              "self_attn.q_proj.weight": (heads * (nope + rope), hidden),
              "self_attn.kv_a_proj_with_mqa.weight": (kv_lora + rope, hidden),
              "self_attn.kv_a_layernorm.weight": (kv_lora,),
              "self_attn.kv_b_proj.weight": (heads * (nope + value), kv_lora),
              "self_attn.o_proj.weight": (hidden, heads * value),
              "mlp.gate.weight": (flags["num_experts"], hidden),
              "mlp.gate.e_score_correction_bias": (flags["num_experts"],),
              "enorm.weight": (hidden,), "hnorm.weight": (hidden,),
              "eh_proj.weight": (hidden, 2 * hidden), "shared_head.norm.weight": (hidden,),
              "shared_head.head.weight": (vocab, hidden)}

    def glu(prefix: str, ffn: int):
        gate, up, down = GLU
        shapes.update({f"{prefix}.{gate}.weight": (ffn, hidden),
                       f"{prefix}.{up}.weight": (ffn, hidden),
                       f"{prefix}.{down}.weight": (hidden, ffn)})

    glu("mlp", flags["ffn_hidden_size"])
    for expert in range(flags["num_experts"]):
        glu(f"mlp.experts.{expert}", flags["moe_ffn_hidden_size"])
    if flags.get("moe_shared_expert_intermediate_size"):
        glu("mlp.shared_experts", flags["moe_shared_expert_intermediate_size"])
    return shapes


# The projections whose output rows hold rotary channels: per query head, after the
# qk_head_dim others; of the key, after the kv_lora_rank latent
ROTARY_ROWS = ("self_attn.q_b_proj.weight", "self_attn.q_proj.weight",
               "self_attn.kv_a_proj_with_mqa.weight")


def interleaved_rope_rows(weight: torch.Tensor, name: str, flags: dict) -> torch.Tensor:
    """WEIGHT (the projection NAME of ROTARY_ROWS) with its rotary rows reordered from
    DeepSeek-V3's rope_interleave false layout, which rotates channel i with channel i + d/2, to
    the interleaved one Megatron-Core's multi-latent attention rotates (2i with 2i + 1)."""
    rope = flags["qk_pos_emb_head_dim"]
    if name == "self_attn.kv_a_proj_with_mqa.weight":
        rows = weight.view(1, -1, weight.shape[-1])
    else:
        rows = weight.view(flags["num_attention_heads"], -1, weight.shape[-1])
    halves = rows[:, -rope:].reshape(rows.shape[0], 2, rope // 2, -1)
    rotary = halves.transpose(1, 2).reshape(rows.shape[0], rope, -1)
    return torch.cat([rows[:, :-rope], rotary], dim=1).reshape(weight.shape)


def _layers(flags: dict):
    """(our prefix, HF layer index, MoE or not) of every transformer layer, MTP's last."""
    layers = flags["num_layers"]
    pattern = moe_layer_pattern(flags.get("moe_layer_freq", 1), layers)
    for layer in range(layers):
        yield f"decoder.layers.{layer}.", layer, bool(pattern[layer])
    for depth in range(flags.get("mtp_num_layers") or 0):
        yield f"mtp.layers.{depth}.transformer_layer.", layers + depth, True


def _objects(tensors: Dict[str, torch.Tensor], num_experts: int) -> Dict[str, list]:
    """The (empty) _extra_state of every local linear layer, which the loader expects."""
    objects = {}
    for key in tensors:
        module = key.rpartition(".")[0]
        if not module.rpartition(".")[2].startswith(("linear_", "eh_proj")):
            continue
        shards = num_experts if ".experts.experts." in key else 1
        objects.update({f"{module}._extra_state/shard_{i}_{shards}": [None]
                        for i in range(shards)})
    return objects


# ---------------------------------------------------------------------------------------------
# import and export
# ---------------------------------------------------------------------------------------------

def hf_to_full(path: str, make_vocab_size_divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY,
               mtp_num_layers: Optional[int] = None) -> FullCheckpoint:
    """The checkpoint (model only, iteration 0; its flags in common['args']) of the DeepSeek
    model in directory PATH, with its first MTP_NUM_LAYERS MTP layers (none: left out)."""
    config = read_config(path)
    family = family_of(config, path)
    flags = hf_flags(config, family, path, mtp_num_layers)
    vocab, layers = config["vocab_size"], flags["num_layers"]
    hf = HFTensors(path, _shapes(flags, vocab), f"{layers} layers of {family.architecture}"
                   + (f" and {mtp_num_layers} MTP layers" if mtp_num_layers else ""))
    padded = padded_vocab(flags, vocab, make_vocab_size_divisible_by)
    tensors = outer_tensors(hf, flags, padded)
    interleave = config.get("rope_interleave", True) is False  # V3's halves
    for prefix, layer, moe in _layers(flags):
        stacked: Dict[str, list] = {}
        for ours, names, expert in layer_table(flags, moe):
            parts = [hf.take(f"layers.{layer}.{name}") for name in names]
            if interleave and names[0] in ROTARY_ROWS:
                parts = [interleaved_rope_rows(parts[0], names[0], flags)]
            stacked.setdefault(ours, []).append(torch.cat(parts) if len(parts) > 1 else parts[0])
        tensors.update({prefix + ours: torch.stack(values) if ".experts.experts." in ours
                        else values[0] for ours, values in stacked.items()})
    for depth in range(mtp_num_layers or 0):
        layer = layers + depth
        for ours, theirs in MTP_OWN:
            tensors[f"mtp.layers.{depth}.{ours}"] = hf.take(f"layers.{layer}.{theirs}")
        for theirs, ours in MTP_COPIES:
            name = f"layers.{layer}.{theirs}"
            if name not in hf.weights:
                continue
            model = tensors.get(ours, tensors["embedding.word_embeddings.weight"])  # tied
            if not torch.equal(padded_rows(hf.take(name), padded), model):
                raise CheckpointError(f"{path}: tensor model.{name} differs from the model's "
                                      f"own; Megatron-Core's MTP layers share them")
    hf.check_all_used(left_out=lambda name: name.startswith("layers.") and int(
        name.split(".")[1]) >= layers + (mtp_num_layers or 0))
    common = imported_common(flags, padded, vocab, path, family.architecture)
    left_out = sorted({int(name.split(".")[1]) for name in hf.weights
                       if name.startswith("layers.") and name not in hf.used})
    if left_out:
        common["converted_from"]["mtp_layers_left_out"] = len(left_out)
    return FullCheckpoint(tensors, _objects(tensors, flags["num_experts"]), common)


def _ours(full: FullCheckpoint, prefix: str, name: str, layer: int) -> torch.Tensor:
    """Our tensor NAME of the layer at PREFIX: saved per layer, or (a checkpoint whose layers
    are all alike) on the layer axis of decoder.layers.NAME."""
    if prefix + name in full.tensors:
        return full.tensors[prefix + name]
    return full.tensors[f"decoder.layers.{name}"][layer]


def full_to_hf(full: FullCheckpoint, flags: dict, path: str, max_shard_bytes: int):
    """Write FULL (a checkpoint whose flags are FLAGS) as a Hugging Face directory PATH;
    returns (the config, the tensors) written."""
    architecture = export_architecture(flags)
    vocab = export_vocab(full)
    embedding = full.tensors["embedding.word_embeddings.weight"]
    config = hf_config(flags, architecture, vocab, embedding.dtype)
    output = full.tensors.get("output_layer.weight", embedding)[:vocab]
    tensors = {"model.embed_tokens.weight": embedding[:vocab]}
    for prefix, layer, moe in _layers(flags):
        theirs = f"model.layers.{layer}."
        for ours, names, expert in layer_table(flags, moe):
            tensor = _ours(full, prefix, ours, layer)
            tensor = tensor if expert is None else tensor[expert]
            parts = tensor.chunk(2) if len(names) == 2 else (tensor,)
            tensors.update({theirs + name: part for name, part in zip(names, parts)})
        if moe and architecture == V3 and not flags.get("moe_router_enable_expert_bias"):
            tensors[theirs + "mlp.gate.e_score_correction_bias"] = torch.zeros(
                flags["num_experts"], dtype=torch.float32)
        if prefix.startswith("mtp."):
            depth = layer - flags["num_layers"]
            tensors[theirs + "embed_tokens.weight"] = embedding[:vocab]
            tensors.update({theirs + name: full.tensors[f"mtp.layers.{depth}.{ours}"]
                            for ours, name in MTP_OWN})
            tensors[theirs + "shared_head.head.weight"] = output
    tensors["model.norm.weight"] = full.tensors["decoder.final_layernorm.weight"]
    if flags.get("untie_embeddings_and_output_weights"):
        tensors["lm_head.weight"] = output
    return config, write_hf(path, config, tensors, max_shard_bytes)
