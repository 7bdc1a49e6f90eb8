"""Hugging Face Llama-style models (a local directory) <-> whole checkpoints of this project.

    FAMILIES                            architectures value -> Family
    hf_to_full(path)                    FullCheckpoint (model only, iteration 0) and its flags
    full_to_hf(full, flags, path, max_shard)
                                        config.json + safetensors (shards and index) in PATH
    export_family(flags)                the Family a checkpoint's flags fit, or why none does

Families: Mixtral, Qwen2-MoE (a shared expert with its sigmoid gate, q/k/v biases), Qwen3-MoE
(q/k norms, no renormalised top-k by default) in and out; Llama (dense, for --upcycle) in;
DeepSeek-V2 and -V3 (multi-latent attention: their mapping is hf_deepseek.py's, with the
helpers below). Every one here is rotary positions, RMSNorm and SwiGLU, and maps onto Megatron-Core's GPT as:

    embed_tokens [V, H]               -> embedding.word_embeddings.weight [Vp, H]   zero rows
    lm_head [V, H] (untied)           -> output_layer.weight [Vp, H]                up to Vp
    norm                              -> decoder.final_layernorm.weight
    layers.i.input_layernorm          -> decoder.layers.self_attention.linear_qkv.layer_norm_weight
    layers.i.self_attn.{q,k,v}_proj   -> decoder.layers.self_attention.linear_qkv.{weight,bias}
    layers.i.self_attn.o_proj         -> decoder.layers.self_attention.linear_proj.weight
    layers.i.self_attn.{q,k}_norm     -> decoder.layers.self_attention.{q,k}_layernorm.weight
    layers.i.post_attention_layernorm -> decoder.layers.mlp.linear_fc1.layer_norm_weight
    dense: mlp.{gate,up,down}_proj    -> decoder.layers.mlp.linear_fc{1,2}.weight
    MoE:   <moe>.gate (router)        -> decoder.layers.mlp.router.weight [L, E, H]
           <moe>.experts.e.<gate, up, down>
                                      -> decoder.layers.mlp.experts.experts.linear_fc{1,2}.weight
                                         [L, E, ...]
           mlp.shared_expert.*        -> decoder.layers.mlp.shared_experts.linear_fc{1,2}.weight
           mlp.shared_expert_gate     -> decoder.layers.mlp.shared_experts.gate_weight

Megatron's SwiGLU fc1 is [gate; up] (its first half goes through SiLU). Its fused QKV is laid
out per key/value group: for each group, that group's query heads, then its key head, then its
value head. The layer axis leads (the checkpoint's global tensors; experts add an axis after
it). The vocabulary is padded to a multiple of 128 with zero rows (Megatron-LM's padding) and
the export trims it back to the tokenizer's size recorded in the checkpoint.

Routing: Mixtral takes the softmax over all experts, keeps the top k and renormalises them,
which is Megatron's default (softmax over the top-k logits); the Qwen families renormalise
only with norm_topk_prob, otherwise they are Megatron's --moe-router-pre-softmax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Dict, List, Optional, Tuple

import torch

from megatron_parm.checkpointing.errors import CheckpointError
from megatron_parm.checkpointing.full import FullCheckpoint
from megatron_parm.checkpointing.hf_files import read_config, read_weights, write_weights
from megatron_parm.checkpointing.state import CHECKPOINT_VERSION
from megatron_parm.data.vocab import MAKE_VOCAB_SIZE_DIVISIBLE_BY, padded_vocab_size

QKV = "decoder.layers.self_attention.linear_qkv"
MLP = "decoder.layers.mlp"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclasses.dataclass(frozen=True)
class Family:
    architecture: str          # config.json's "architectures"
    model_type: str
    moe: Optional[str]         # the MoE block's name in a layer; None: a dense model
    glu: Tuple[str, str, str]  # names of an MLP's gate, up and down projections
    experts_keys: Tuple[str, ...] = ()   # config keys of the number of experts (first found)
    moe_ffn_key: str = "moe_intermediate_size"
    shared_expert: bool = False
    qk_norm: bool = False
    qkv_bias_key: Optional[str] = None   # config key saying q/k/v have biases
    qkv_bias_default: bool = False
    always_renormalizes: bool = False    # top-k probabilities renormalised whatever the config
    mla: bool = False          # multi-latent attention: the DeepSeek families (hf_deepseek.py)


FAMILIES = {family.architecture: family for family in (
    Family("MixtralForCausalLM", "mixtral", "block_sparse_moe", ("w1", "w3", "w2"),
           ("num_local_experts", "num_experts"), "intermediate_size", always_renormalizes=True),
    Family("Qwen2MoeForCausalLM", "qwen2_moe", "mlp", ("gate_proj", "up_proj", "down_proj"),
           ("num_experts", "num_local_experts"), shared_expert=True, qkv_bias_key="qkv_bias",
           qkv_bias_default=True),
    Family("Qwen3MoeForCausalLM", "qwen3_moe", "mlp", ("gate_proj", "up_proj", "down_proj"),
           ("num_experts", "num_local_experts"), qk_norm=True, qkv_bias_key="attention_bias"),
    Family("LlamaForCausalLM", "llama", None, ("gate_proj", "up_proj", "down_proj"),
           qkv_bias_key="attention_bias"),
    Family("DeepseekV2ForCausalLM", "deepseek_v2", "mlp", ("gate_proj", "up_proj", "down_proj"),
           ("n_routed_experts",), shared_expert=True, mla=True),
    Family("DeepseekV3ForCausalLM", "deepseek_v3", "mlp", ("gate_proj", "up_proj", "down_proj"),
           ("n_routed_experts",), shared_expert=True, mla=True),
)}


# ---------------------------------------------------------------------------------------------
# config.json <-> the trainer's flags
# ---------------------------------------------------------------------------------------------

def family_of(config: dict, path: str) -> Family:
    architecture = (config.get("architectures") or [None])[0]
    if architecture not in FAMILIES:
        raise CheckpointError(f"{os.path.join(path, 'config.json')}: architectures "
                              f"{architecture!r} (model_type {config.get('model_type')!r}); "
                              f"supported: GPT2LMHeadModel, {', '.join(FAMILIES)}")
    return FAMILIES[architecture]


def _refuse_unsupported(config: dict, family: Family, where: str) -> None:
    """One error naming the first config.json setting Megatron's GPT here cannot compute."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    problems = {
        "hidden_act": config.get("hidden_act", "silu") != "silu",
        "rope_type": (rope.get("rope_type") or rope.get("type") or "default") != "default",
        "sliding_window": config.get("use_sliding_window", config.get("sliding_window")
                                     is not None) and (config.get("sliding_window") or 0)
        < config.get("max_position_embeddings", 0),
        "mlp_bias": bool(config.get("mlp_bias")),
        "mlp_only_layers": bool(config.get("mlp_only_layers")),
        "decoder_sparse_step": config.get("decoder_sparse_step", 1) != 1,
        "router_jitter_noise": bool(config.get("router_jitter_noise")),
    }
    for key, bad in problems.items():
        if bad:
            value = rope if key == "rope_type" else config.get(key)
            raise CheckpointError(f"{where}: {key}={value!r} has no equivalent in this "
                                  f"project's GPT (rotary with default scaling, SiLU-gated "
                                  f"MLPs, full attention, every layer MoE)")


def _rope_theta(config: dict) -> float:
    rope = config.get("rope_parameters") or {}
    return rope.get("rope_theta", config.get("rope_theta", 10000.0))


def hf_flags(config: dict, family: Family, path: str) -> dict:
    """The trainer's flags of the model CONFIG describes (refusing what it cannot compute)."""
    where = os.path.join(path, "config.json")
    _refuse_unsupported(config, family, where)
    with config_keys(where, family.architecture):
        heads, hidden = config["num_attention_heads"], config["hidden_size"]
        groups = config.get("num_key_value_heads") or heads
        flags = dict(
            model_type="gpt", num_layers=config["num_hidden_layers"], hidden_size=hidden,
            ffn_hidden_size=config["intermediate_size"], num_attention_heads=heads,
            group_query_attention=groups != heads, num_query_groups=groups,
            kv_channels=config.get("head_dim") or hidden // heads,
            max_position_embeddings=config["max_position_embeddings"],
            seq_length=min(config["max_position_embeddings"], 4096),
            position_embedding_type="rope", rotary_base=int(_rope_theta(config)),
            rotary_percent=float(config.get("partial_rotary_factor", 1.0)),
            normalization="RMSNorm", norm_epsilon=config.get("rms_norm_eps", 1e-6),
            swiglu=True, disable_bias_linear=True,
            add_qkv_bias=bool(config.get(family.qkv_bias_key, family.qkv_bias_default))
            if family.qkv_bias_key else False,
            qk_layernorm=family.qk_norm,
            untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
            hidden_dropout=0.0, attention_dropout=float(config.get("attention_dropout", 0.0)),
            init_method_std=config.get("initializer_range", 0.02), num_experts=None)
        if family.moe:
            experts = next((config[key] for key in family.experts_keys if config.get(key)), None)
            if experts is None:
                raise KeyError(family.experts_keys[0])
            flags.update(
                num_experts=experts, moe_router_topk=config["num_experts_per_tok"],
                moe_ffn_hidden_size=config[family.moe_ffn_key],
                moe_router_pre_softmax=not (family.always_renormalizes
                                            or config.get("norm_topk_prob", False)),
                moe_aux_loss_coeff=config.get("router_aux_loss_coef", 0.0))
            if family.shared_expert:
                flags.update(moe_shared_expert_intermediate_size=config[
                    "shared_expert_intermediate_size"], moe_shared_expert_gate=True)
    return {**flags, **tokenizer_flags(path)}


@contextlib.contextmanager
def config_keys(where: str, architecture: str):
    """A config.json key missing in the block is one CheckpointError naming it."""
    try:
        yield
    except KeyError as err:
        raise CheckpointError(f"{where}: {err.args[0]} missing (a {architecture} config needs "
                              f"it)") from None


def tokenizer_flags(path: str) -> dict:
    """The tokenizer flags of a directory with a tokenizer.json (none without)."""
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=os.path.abspath(path))
    return {}


def require_flags(flags: dict, required: dict, families: str) -> None:
    """One CheckpointError for the first flag of REQUIRED ({key: value}) FLAGS set otherwise."""
    for key, wanted in required.items():
        if flags.get(key, wanted) != wanted:
            raise CheckpointError(f"--to-hf: the checkpoint has --{key.replace('_', '-')} "
                                  f"{flags.get(key)!r}; {families} need {wanted!r}")


def export_family(flags: dict) -> Family:
    """The exportable family whose architecture FLAGS (a checkpoint's) describe."""
    require_flags(flags, {
        "swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope",
        "disable_bias_linear": True, "rotary_percent": 1.0, "moe_layer_freq": 1,
        "moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False,
        "moe_router_num_groups": None, "moe_router_topk_scaling_factor": None,
        "model_type": "gpt"}, "Mixtral, Qwen2-MoE and Qwen3-MoE")
    if not flags.get("num_experts"):
        raise CheckpointError("--to-hf: the checkpoint is dense (no --num-experts); it exports "
                              "Mixtral, Qwen2-MoE and Qwen3-MoE models")
    shared = bool(flags.get("moe_shared_expert_intermediate_size"))
    name = ("Qwen2MoeForCausalLM" if shared else "Qwen3MoeForCausalLM"
            if flags.get("qk_layernorm") else "MixtralForCausalLM")
    family = FAMILIES[name]
    mismatch = {"--moe-shared-expert-gate": shared and not flags.get("moe_shared_expert_gate"),
                "--qk-layernorm": shared and flags.get("qk_layernorm"),
                "--add-qkv-bias": name == "MixtralForCausalLM" and flags.get("add_qkv_bias"),
                "--moe-router-pre-softmax": family.always_renormalizes
                and flags.get("moe_router_pre_softmax") and flags.get("moe_router_topk", 2) > 1}
    for flag, bad in mismatch.items():
        if bad:
            raise CheckpointError(f"--to-hf: {flag} does not fit {name}, the family the "
                                  f"checkpoint's other flags describe")
    return family


def hf_config(flags: dict, family: Family, vocab: int, dtype: torch.dtype) -> dict:
    """config.json of the exported model."""
    heads = flags["num_attention_heads"]
    config = {
        "architectures": [family.architecture], "model_type": family.model_type,
        "vocab_size": vocab, "hidden_size": flags["hidden_size"],
        "intermediate_size": flags["ffn_hidden_size"],
        "num_hidden_layers": flags["num_layers"], "num_attention_heads": heads,
        "num_key_value_heads": flags["num_query_groups"] if flags.get("group_query_attention")
        else heads,
        "head_dim": flags.get("kv_channels") or flags["hidden_size"] // heads,
        "max_position_embeddings": flags.get("max_position_embeddings") or flags["seq_length"],
        "rms_norm_eps": flags["norm_epsilon"], "hidden_act": "silu",
        "rope_theta": float(flags["rotary_base"]),
        "rope_parameters": {"rope_theta": float(flags["rotary_base"]), "rope_type": "default"},
        "tie_word_embeddings": not flags.get("untie_embeddings_and_output_weights"),
        "attention_dropout": 0.0, "initializer_range": flags.get("init_method_std", 0.02),
        "num_experts_per_tok": flags["moe_router_topk"],
        "router_aux_loss_coef": flags.get("moe_aux_loss_coeff") or 0.0,
        family.experts_keys[0]: flags["num_experts"],
        family.moe_ffn_key: flags.get("moe_ffn_hidden_size") or flags["ffn_hidden_size"],
        "dtype": str(dtype).replace("torch.", ""), "torch_dtype": str(dtype).replace("torch.", ""),
        "use_cache": True,
    }
    if not family.always_renormalizes:
        config.update(norm_topk_prob=not flags.get("moe_router_pre_softmax"),
                      decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False)
    if family.qkv_bias_key:
        config[family.qkv_bias_key] = bool(flags.get("add_qkv_bias"))
    if family.shared_expert:
        config["shared_expert_intermediate_size"] = flags["moe_shared_expert_intermediate_size"]
    return config


# ---------------------------------------------------------------------------------------------
# per-layer tensors: one table serves both directions
# ---------------------------------------------------------------------------------------------

def _layer_table(family: Family, flags: dict) -> List[Tuple[str, Tuple[str, ...], Optional[int]]]:
    """(our key, its Hugging Face names within a layer, expert or None) for every tensor of a
    layer. One HF name: the same tensor; two (gate, up): fc1 = [gate; up]; q, k, v: the fused
    QKV."""
    gate, up, down = family.glu
    attention = "decoder.layers.self_attention"
    table = [(f"{QKV}.layer_norm_weight", ("input_layernorm.weight",), None),
             (f"{QKV}.weight", tuple(f"self_attn.{p}_proj.weight" for p in "qkv"), None),
             (f"{attention}.linear_proj.weight", ("self_attn.o_proj.weight",), None),
             (f"{MLP}.linear_fc1.layer_norm_weight", ("post_attention_layernorm.weight",), None)]
    if flags.get("add_qkv_bias"):
        table.append((f"{QKV}.bias", tuple(f"self_attn.{p}_proj.bias" for p in "qkv"), None))
    if flags.get("qk_layernorm"):
        table += [(f"{attention}.q_layernorm.weight", ("self_attn.q_norm.weight",), None),
                  (f"{attention}.k_layernorm.weight", ("self_attn.k_norm.weight",), None)]

    def glu(ours: str, theirs: str, expert=None):
        return [(f"{ours}.linear_fc1.weight", (f"{theirs}.{gate}.weight", f"{theirs}.{up}.weight"),
                 expert), (f"{ours}.linear_fc2.weight", (f"{theirs}.{down}.weight",), expert)]

    if not flags.get("num_experts"):
        return table + glu(MLP, "mlp")
    table.append((f"{MLP}.router.weight", (f"{family.moe}.gate.weight",), None))
    for expert in range(flags["num_experts"]):
        table += glu(f"{MLP}.experts.experts", f"{family.moe}.experts.{expert}", expert)
    if flags.get("moe_shared_expert_intermediate_size"):
        table += glu(f"{MLP}.shared_experts", "mlp.shared_expert")
        table.append((f"{MLP}.shared_experts.gate_weight", ("mlp.shared_expert_gate.weight",),
                      None))
    return table


def _heads(flags: dict) -> Tuple[int, int, int]:
    heads = flags["num_attention_heads"]
    groups = flags["num_query_groups"] if flags.get("group_query_attention") else heads
    return heads, groups, flags.get("kv_channels") or flags["hidden_size"] // heads


def _fuse(parts: List[torch.Tensor], flags: dict) -> torch.Tensor:
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:  # SwiGLU fc1: [gate; up]
        return torch.cat(parts)
    heads, groups, d = _heads(flags)  # q, k, v -> per group [q heads of the group, k, v]
    q, k, v = (t.reshape(groups, -1, d, *t.shape[1:]) for t in parts)
    return torch.cat([q, k, v], dim=1).reshape(-1, *parts[0].shape[1:])


def _split(tensor: torch.Tensor, count: int, flags: dict) -> List[torch.Tensor]:
    if count == 1:
        return [tensor]
    if count == 2:
        return list(tensor.chunk(2))
    heads, groups, d = _heads(flags)
    grouped = tensor.reshape(groups, heads // groups + 2, d, *tensor.shape[1:])
    q, k, v = grouped.split([heads // groups, 1, 1], dim=1)
    return [t.reshape(-1, *tensor.shape[1:]).contiguous() for t in (q, k, v)]


def _shapes(flags: dict, family: Family, vocab: int) -> Dict[str, tuple]:
    """The shape of every Hugging Face tensor CONFIG's model has (layer 0's names for all)."""
    hidden, (heads, groups, d) = flags["hidden_size"], _heads(flags)
    shapes = {"embed_tokens.weight": (vocab, hidden), "norm.weight": (hidden,),
              "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
              "self_attn.q_proj.weight": (heads * d, hidden),
              "self_attn.k_proj.weight": (groups * d, hidden),
              "self_attn.v_proj.weight": (groups * d, hidden),
              "self_attn.q_proj.bias": (heads * d,), "self_attn.k_proj.bias": (groups * d,),
              "self_attn.v_proj.bias": (groups * d,), "self_attn.o_proj.weight": (hidden, heads * d),
              "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
    if flags["untie_embeddings_and_output_weights"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    gate, up, down = family.glu

    def glu(prefix: str, ffn: int):
        shapes.update({f"{prefix}.{gate}.weight": (ffn, hidden), f"{prefix}.{up}.weight": (ffn, hidden),
                       f"{prefix}.{down}.weight": (hidden, ffn)})

    if not flags.get("num_experts"):
        glu("mlp", flags["ffn_hidden_size"])
        return shapes
    shapes[f"{family.moe}.gate.weight"] = (flags["num_experts"], hidden)
    for expert in range(flags["num_experts"]):
        glu(f"{family.moe}.experts.{expert}", flags["moe_ffn_hidden_size"])
    if flags.get("moe_shared_expert_intermediate_size"):
        glu("mlp.shared_expert", flags["moe_shared_expert_intermediate_size"])
        shapes["mlp.shared_expert_gate.weight"] = (1, hidden)
    return shapes


def _objects(flags: dict) -> Dict[str, list]:
    """The (empty) _extra_state of every local linear layer, which the loader expects."""
    layers, experts = flags["num_layers"], flags.get("num_experts")
    modules = ["self_attention.linear_qkv", "self_attention.linear_proj"]
    if not experts:
        modules += ["mlp.linear_fc1", "mlp.linear_fc2"]
    elif flags.get("moe_shared_expert_intermediate_size"):
        modules += ["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"]
    objects = {f"decoder.layers.{module}._extra_state/shard_{i}_{layers}": [None]
               for module in modules for i in range(layers)}
    for fc in ("linear_fc1", "linear_fc2") if experts else ():
        objects.update({f"{MLP}.experts.experts.{fc}._extra_state/shard_{i}.{e}_{layers}."
                        f"{experts}": [None] for i in range(layers) for e in range(experts)})
    return objects


# ---------------------------------------------------------------------------------------------
# import and export
# ---------------------------------------------------------------------------------------------

class HFTensors:
    """The tensors of a Hugging Face directory (names without 'model.'), each taken once as
    float32 with its shape checked against SHAPES (keyed by the name within a layer for a
    layer's tensors); DESCRIBED says what config.json declares, for the errors."""

    def __init__(self, path: str, shapes: Dict[str, tuple], described: str):
        self.path, self.shapes, self.described = path, shapes, described
        self.weights = {(key[len("model."):] if key.startswith("model.") else key): value
                        for key, value in read_weights(path).items()}
        self.used = set()

    def take(self, name: str) -> torch.Tensor:
        short = name.split(".", 2)[2] if name.startswith("layers.") else name
        if name not in self.weights:
            raise CheckpointError(f"{self.path}: tensor {name} missing (config.json says "
                                  f"{self.described})")
        tensor = self.weights[name]
        if tuple(tensor.shape) != self.shapes[short]:
            raise CheckpointError(f"{self.path}: tensor {name} has shape {tuple(tensor.shape)}; "
                                  f"config.json gives {self.shapes[short]}")
        self.used.add(name)
        return tensor.to(torch.float32)

    def check_all_used(self, left_out=lambda name: False) -> None:
        """Every tensor was taken, but lm_head (tied), rotary caches and those LEFT_OUT."""
        unused = sorted(name for name in set(self.weights) - self.used - {"lm_head.weight"}
                        if not name.endswith("rotary_emb.inv_freq") and not left_out(name))
        if unused:
            raise CheckpointError(f"{self.path}: tensor {unused[0]} does not belong to the model "
                                  f"config.json describes ({len(unused)} such)")


def padded_vocab(flags: dict, vocab: int, make_vocab_size_divisible_by: int) -> int:
    """The padded vocabulary of an import (it loads under any TP that divides it:
    data/vocab.py), recorded with the flags as a trained checkpoint's."""
    flags["make_vocab_size_divisible_by"] = make_vocab_size_divisible_by
    return padded_vocab_size(vocab, 1, make_vocab_size_divisible_by)


def padded_rows(tensor: torch.Tensor, padded: int) -> torch.Tensor:
    return torch.cat([tensor, tensor.new_zeros(padded - tensor.shape[0], tensor.shape[1])])


def outer_tensors(hf: HFTensors, flags: dict, padded: int) -> Dict[str, torch.Tensor]:
    """The embedding, the final norm and (untied) the output layer, their vocabulary PADDED."""
    tensors = {"embedding.word_embeddings.weight": padded_rows(hf.take("embed_tokens.weight"),
                                                               padded),
               "decoder.final_layernorm.weight": hf.take("norm.weight")}
    if flags["untie_embeddings_and_output_weights"]:
        tensors["output_layer.weight"] = padded_rows(hf.take("lm_head.weight"), padded)
    return tensors


def imported_common(flags: dict, padded: int, vocab: int, path: str, architecture: str) -> dict:
    """The common state of a checkpoint imported from the Hugging Face directory PATH."""
    return {"checkpoint_version": CHECKPOINT_VERSION, "iteration": 0, "consumed_samples": 0,
            "args": flags, "model_info": {"padded_vocab_size": padded, "vocab_size": vocab},
            "layout": None, "converted_from": {"huggingface": os.path.abspath(path),
                                               "architecture": architecture,
                                               "vocab_size": vocab}}


def hf_to_full(path: str, make_vocab_size_divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY
               ) -> FullCheckpoint:
    """The checkpoint (model only, iteration 0; its flags in common['args']) of the Hugging
    Face model in directory PATH."""
    config = read_config(path)
    family = family_of(config, path)
    flags = hf_flags(config, family, path)
    vocab, layers = config["vocab_size"], flags["num_layers"]
    hf = HFTensors(path, _shapes(flags, family, vocab), f"{layers} layers of "
                   f"{family.architecture}")
    padded = padded_vocab(flags, vocab, make_vocab_size_divisible_by)
    tensors = outer_tensors(hf, flags, padded)
    per_layer: Dict[str, list] = {}
    for layer in range(layers):
        for key, names, expert in _layer_table(family, flags):
            fused = _fuse([hf.take(f"layers.{layer}.{name}") for name in names], flags)
            per_layer.setdefault(key, []).append(fused)
    experts = flags.get("num_experts") or 0
    for key, values in per_layer.items():
        if ".experts.experts." in key:  # [L * E] in layer-major order -> [L, E, ...]
            values = [torch.stack(values[i * experts:(i + 1) * experts]) for i in range(layers)]
        tensors[key] = torch.stack(values).contiguous()
    hf.check_all_used()
    common = imported_common(flags, padded, vocab, path, family.architecture)
    return FullCheckpoint(tensors, _objects(flags), common)


def export_vocab(full: FullCheckpoint) -> int:
    """The vocabulary the exported model has: the tokenizer's the checkpoint records."""
    info = full.common.get("model_info") or {}
    return (info.get("vocab_size") or (full.common.get("converted_from") or {}).get("vocab_size")
            or info["padded_vocab_size"])


def full_to_hf(full: FullCheckpoint, flags: dict, path: str, max_shard_bytes: int):
    """Write FULL (a checkpoint whose flags are FLAGS) as a Hugging Face directory PATH;
    returns (the config, the tensors) written."""
    family = export_family(flags)
    vocab = export_vocab(full)
    layers = flags["num_layers"]
    embedding = full.tensors["embedding.word_embeddings.weight"]
    dtype = embedding.dtype
    config = hf_config(flags, family, vocab, dtype)
    tensors = {"model.embed_tokens.weight": embedding[:vocab]}
    for layer in range(layers):
        for key, names, expert in _layer_table(family, flags):
            ours = full.tensors[key][layer]
            ours = ours if expert is None else ours[expert]
            for name, part in zip(names, _split(ours, len(names), flags)):
                tensors[f"model.layers.{layer}.{name}"] = part.contiguous()
    tensors["model.norm.weight"] = full.tensors["decoder.final_layernorm.weight"]
    if flags.get("untie_embeddings_and_output_weights"):
        tensors["lm_head.weight"] = full.tensors["output_layer.weight"][:vocab]
    return config, write_hf(path, config, tensors, max_shard_bytes)


def write_hf(path: str, config: dict, tensors: Dict[str, torch.Tensor],
             max_shard_bytes: int) -> Dict[str, torch.Tensor]:
    """config.json and the safetensors of TENSORS in PATH; returns the tensors written."""
    os.makedirs(path, exist_ok=True)
    tensors = {name: tensor.contiguous() for name, tensor in tensors.items()}
    write_weights(path, tensors, max_shard_bytes)
    with open(os.path.join(path, "config.json"), "w") as handle:
        json.dump(config, handle, indent=2)
    return tensors
