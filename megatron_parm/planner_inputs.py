"""The layout planner's inputs: its flags, the settings they resolve to, the ModelSpec.

    build_parser(parser_class)        plan_layout's flags (declared in megatron_parm.settings)
    resolve_settings(parser, argv)    flags over --config over the defaults, checked: (args,
                                      their dict, the keys given on the command line)
    build_spec(settings, model_type)  perf_model.transformer.ModelSpec of those settings
    vocab_size_of(settings)           --vocab-size, else the tokenizer files' size
    model_overrides(given)            the model flags of the command line, for a launch line
    recompute_of(settings)            the activation recomputation the flags fix, or None

tools/plan_layout.py and tools/predict_e2e.py read their model here (no tool imports another).
"""

import json
import os
import sys
from typing import Optional

import megatron_parm.settings as declared
from megatron_parm.data.tokenizer_files import huggingface_tokenizer_file
from megatron_parm.settings.data import SENTENCEPIECE_TYPES
from megatron_parm.layout_rules import (default_ffn_hidden_size, precision_problem,
                                        pre_softmax_routing)
from megatron_parm.perf_model.profile import shipped_profiles
from megatron_parm.perf_model.recompute import Recompute
from megatron_parm.perf_model.transformer import MODEL_TYPES, ModelSpec

# The model and training flags the planner reads (declared in megatron_parm.settings).
MODEL_FLAGS = (
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--moe-ffn-hidden-size",
    "--num-attention-heads", "--seq-length", "--max-position-embeddings", "--num-experts",
    "--moe-router-topk", "--micro-batch-size", "--global-batch-size", "--vocab-size",
    "--moe-expert-capacity-factor", "--hidden-dropout", "--attention-dropout",
    "--moe-pad-expert-input-to-capacity", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--bf16", "--fp16", "--use-distributed-optimizer",
    "--tokenizer-type", "--tokenizer-model", "--vocab-file", "--bert-no-binary-head",
    # today's architectures (docs/planner.md, "Today's MoE models")
    "--swiglu", "--group-query-attention", "--num-query-groups", "--kv-channels",
    "--qk-layernorm", "--normalization", "--position-embedding-type", "--no-position-embedding",
    "--moe-layer-freq", "--moe-shared-expert-intermediate-size", "--moe-shared-expert-gate",
    "--moe-shared-expert-overlap", "--moe-router-pre-softmax", "--multi-latent-attention",
    "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim",
    # activation recomputation: plan with this choice (default: none, or what fits)
    "--recompute-granularity", "--recompute-method", "--recompute-num-layers",
    "--recompute-modules")
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "num_experts",
            "micro_batch_size", "global_batch_size")
# Sizes that restrict the search; the command line's only (a config's are the planner's to
# choose, listed in the note).
LAYOUT_FLAGS = {"tp": "--tensor-model-parallel-size", "ep": "--expert-model-parallel-size",
                "etp": "--expert-tensor-parallel-size", "pp": "--pipeline-model-parallel-size",
                "cp": "--context-parallel-size"}
# The flags of the launch line that are each candidate's (or the planner's own), not copied
# from the command line.
CANDIDATE_KEYS = {"vocab_size", "micro_batch_size", "global_batch_size", "bf16", "fp16",
                  "use_distributed_optimizer", "recompute_granularity", "recompute_method",
                  "recompute_num_layers", "recompute_modules", "moe_shared_expert_overlap"}


def profiles_help() -> str:
    return ("shipped profiles (--parm-profile NAME): " + ", ".join(shipped_profiles())
            + "; or a profile file (tools/calibrate.py measures one)")


def build_parser(parser_class=declared.Parser):
    """plan_layout's flags (parser_class: its own one-line errors)."""
    parser = parser_class(description="Rank every TP/EP/ETP/DP layout, dispatcher and chunk count "
                                 "of an MoE model on a cluster by predicted step time and "
                                 "memory per rank.", epilog=profiles_help())
    declared.add_flags(parser, ["--config"])
    parser.add_argument("--model-type", choices=MODEL_TYPES, default="gpt",
                        help="gpt (pretrain_gpt2_moe.py) or bert (pretrain_bert_moe.py)")
    group = parser.add_argument_group("cluster")
    declared.add_flags(group, ["--nnodes", "--nproc-per-node", "--gpu-memory-gb", "--parm-profile"],
                       required=["--nproc-per-node", "--parm-profile"])
    declared.add_flags(parser.add_argument_group("model and training (override --config)"),
                       MODEL_FLAGS)
    group = parser.add_argument_group("search (default: everything)")
    declared.add_flags(group, LAYOUT_FLAGS.values(),
                       defaults={declared.FLAGS[flag].key: None for flag in LAYOUT_FLAGS.values()})
    # the training flag's name, here a list to search (training's takes one schedule)
    group.add_argument("--moe-token-dispatcher-type", dest="dispatchers", default=None,
                       help="only these dispatchers (comma-separated)")
    declared.add_flags(group, ["--parm-chunk-candidates"])
    group = parser.add_argument_group("output")
    group.add_argument("--top", type=int, default=15,
                       help="rows of the table (default 15; 0 = all)")
    group.add_argument("--show-flags", type=int, default=3,
                       help="print the flags of this many best layouts (default 3)")
    group.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def resolve_settings(parser, argv):
    """The planner's settings (flags over --config over the defaults, each value checked;
    errors name the flag) as a dict, and the keys given on the command line."""
    args = declared.read(parser, argv, strict=False, reader="by the planner",
                         command_line_only=[declared.FLAGS[f].key for f in LAYOUT_FLAGS.values()])
    declared.require(args, REQUIRED)
    problem = precision_problem(args.bf16, args.fp16)
    if problem:
        raise ValueError(problem)
    return args, vars(args), declared.given(parser, sys.argv[1:] if argv is None else argv)


def vocab_size_of(settings):
    """--vocab-size, else the size of the tokenizer the config names (as the trainer's)."""
    kind = settings.get("tokenizer_type")
    if settings.get("vocab_size"):  # NullTokenizer's end of document is one more id
        return settings["vocab_size"] + (1 if kind == "NullTokenizer" else 0)
    if kind in SENTENCEPIECE_TYPES:
        path = settings.get("tokenizer_model")
        if not path or not os.path.isfile(path):
            raise ValueError(f"--tokenizer-model: file not found: {path} (or give --vocab-size)")
        import sentencepiece

        return sentencepiece.SentencePieceProcessor(model_file=path).get_piece_size()
    if kind == "HuggingFaceTokenizer":
        try:
            path = huggingface_tokenizer_file(settings.get("tokenizer_model"))
        except ValueError as error:
            raise ValueError(f"{error} (or give --vocab-size)") from None
        import tokenizers

        return tokenizers.Tokenizer.from_file(path).get_vocab_size(with_added_tokens=True)
    if kind in ("GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase"):
        path = settings.get("vocab_file")
        if not path or not os.path.isfile(path):
            raise ValueError(f"--vocab-file: file not found: {path} (or give --vocab-size)")
        with open(path, encoding="utf-8") as handle:
            if kind == "GPT2BPETokenizer":
                return len(json.load(handle))
            return len({line.strip() for line in handle if line.strip()})
    raise ValueError("--vocab-size is required (or a --tokenizer-type with its "
                     "--tokenizer-model / --vocab-file)")


def build_spec(settings, model_type):
    ffn = settings.get("ffn_hidden_size") or default_ffn_hidden_size(settings["hidden_size"],
                                                                     settings["swiglu"])
    position = (settings["position_embedding_type"] if settings["add_position_embedding"]
                else "none")
    return ModelSpec(
        model_type=model_type,
        num_layers=settings["num_layers"],
        hidden_size=settings["hidden_size"],
        num_attention_heads=settings["num_attention_heads"],
        seq_length=settings["seq_length"],
        vocab_size=vocab_size_of(settings),
        num_experts=settings["num_experts"],
        moe_ffn_hidden_size=settings.get("moe_ffn_hidden_size") or ffn,
        topk=settings["moe_router_topk"],
        max_position_embeddings=settings.get("max_position_embeddings"),
        capacity_factor=settings.get("moe_expert_capacity_factor"),
        pad_to_capacity=settings["moe_pad_expert_input_to_capacity"],
        add_bias_linear=not settings["disable_bias_linear"],
        untie_embeddings_and_output_weights=settings["untie_embeddings_and_output_weights"],
        hidden_dropout=float(settings["hidden_dropout"]),
        attention_dropout=float(settings["attention_dropout"]),
        bert_binary_head=settings["bert_binary_head"],
        ffn_hidden_size=ffn,
        swiglu=settings["swiglu"],
        num_query_groups=(settings["num_query_groups"] if settings["group_query_attention"]
                          else None),
        kv_channels=settings.get("kv_channels"),
        qk_layernorm=settings["qk_layernorm"],
        normalization=settings["normalization"],
        position_embedding_type=position,
        moe_layer_freq=settings["moe_layer_freq"],
        shared_expert_size=settings.get("moe_shared_expert_intermediate_size"),
        shared_expert_gate=settings["moe_shared_expert_gate"],
        shared_expert_overlap=settings["moe_shared_expert_overlap"],
        router_pre_softmax=pre_softmax_routing(settings["moe_router_pre_softmax"],
                                               settings["moe_router_topk"]),
        multi_latent_attention=settings["multi_latent_attention"],
        q_lora_rank=settings["q_lora_rank"], kv_lora_rank=settings["kv_lora_rank"],
        qk_head_dim=settings["qk_head_dim"], qk_pos_emb_head_dim=settings["qk_pos_emb_head_dim"],
        v_head_dim=settings["v_head_dim"],
    )


def recompute_of(settings) -> Optional[Recompute]:
    """The recomputation the flags fix (None: the planner's to choose); ValueError naming the
    flag where Megatron-Core would refuse it."""
    if settings.get("recompute_granularity") is None:
        for key in ("recompute_method", "recompute_num_layers", "recompute_modules"):
            if settings.get(key) is not None:
                raise ValueError(f"--{key.replace('_', '-')} needs --recompute-granularity")
        return None
    return Recompute(settings["recompute_granularity"], settings.get("recompute_method"),
                     settings.get("recompute_num_layers"),
                     tuple(settings.get("recompute_modules") or ()))


def model_overrides(given):
    """The model and tokenizer flags given on the command line (given: their keys, with their
    values), for the printed launch line; the batch, precision and optimizer flags are the
    candidate's, --vocab-size the planner's own."""
    flags = []
    for name in MODEL_FLAGS:
        flag = declared.FLAGS[name]
        if flag.key not in given or flag.key in CANDIDATE_KEYS:
            continue
        value = given[flag.key]
        if flag.kind == "value":
            flags += [name, str(value)]
        elif value != flag.inverted:  # a switch the command line turned on
            flags.append(name)
    return flags
