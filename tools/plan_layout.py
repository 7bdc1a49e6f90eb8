#!/usr/bin/env python
"""Which TP / EP / ETP / PP / DP, dispatcher and chunk count to run a model with on a cluster.

Pure Python (no torch, no cluster): for every layout Megatron can run (sequence parallel where
TP > 1), every dispatcher that runs there and Parm S2's chunk counts, the performance model
(megatron_parm.perf_model) predicts the step time and the memory per rank; the table ranks the
candidates that fit in --gpu-memory-gb, fastest first, then those that do not (and by how much),
and ends with the exact flags of the best ones.

    python tools/plan_layout.py --config configs/gpt2_small_moe.yaml \
        --nnodes 4 --nproc-per-node 8 --gpu-memory-gb 80 --bf16 \
        --parm-profile nvlink_ib_estimate

    python tools/plan_layout.py --config configs/bert_base_moe.yaml --model-type bert \
        --nnodes 2 --nproc-per-node 2 --parm-profile emulated_pcie_measured --json

The model comes from --config (a training config: YAML with Megatron-LM's flag names in
snake_case; the keys the planner does not use, like data or learning-rate settings, and the
layout and dispatcher, which it chooses, are listed in a note on stderr) and/or the usual
flags, which override it. The vocabulary size is --vocab-size or is read from the tokenizer
files of the config (--tokenizer-model, --vocab-file). --tensor-model-parallel-size,
--expert-model-parallel-size, --expert-tensor-parallel-size, --pipeline-model-parallel-size and
--moe-token-dispatcher-type on the command line restrict the search. Bad input prints one line `error: ...` and exits 2.
"""

import argparse
import json
import os
import shlex
import sys

TOOLS = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TOOLS)
for path in (REPO_ROOT, TOOLS):
    if path not in sys.path:
        sys.path.insert(0, path)

from megatron_parm import cli  # noqa: E402

cli.setup_warnings()

from megatron_parm.perf_model import load_profile  # noqa: E402
from megatron_parm.perf_model.memory import GIB, Precision  # noqa: E402
from megatron_parm.perf_model.planner import Cluster, plan  # noqa: E402
from megatron_parm.perf_model.transformer import MODEL_TYPES, ModelSpec  # noqa: E402
from plan_schedule import parse_chunks, read_config_file  # noqa: E402

# config key -> flag; Megatron-LM's names
_INT_OPTIONS = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size",
    "ffn_hidden_size": "--ffn-hidden-size", "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
    "num_attention_heads": "--num-attention-heads", "seq_length": "--seq-length",
    "max_position_embeddings": "--max-position-embeddings", "num_experts": "--num-experts",
    "moe_router_topk": "--moe-router-topk", "micro_batch_size": "--micro-batch-size",
    "global_batch_size": "--global-batch-size", "vocab_size": "--vocab-size",
}
_FLOAT_OPTIONS = {"moe_expert_capacity_factor": "--moe-expert-capacity-factor",
                  "hidden_dropout": "--hidden-dropout", "attention_dropout": "--attention-dropout"}
_BOOL_OPTIONS = {
    "moe_pad_expert_input_to_capacity": "--moe-pad-expert-input-to-capacity",
    "disable_bias_linear": "--disable-bias-linear",
    "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "bf16": "--bf16", "fp16": "--fp16",
    "use_distributed_optimizer": "--use-distributed-optimizer",
}
_STR_OPTIONS = {"tokenizer_type": "--tokenizer-type", "tokenizer_model": "--tokenizer-model",
                "vocab_file": "--vocab-file"}
_DEFAULTS = {"moe_router_topk": 2, "hidden_dropout": 0.1, "attention_dropout": 0.1,
             "bert_binary_head": True}
_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "num_experts",
             "micro_batch_size", "global_batch_size")
_LAYOUT_FLAGS = {"tp": "--tensor-model-parallel-size", "ep": "--expert-model-parallel-size",
                 "etp": "--expert-tensor-parallel-size", "pp": "--pipeline-model-parallel-size"}


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, `error: ...`, exit status 2."""

    def error(self, message):
        fail(message)


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def build_parser():
    parser = _Parser(description="Rank every TP/EP/ETP/DP layout, dispatcher and chunk count "
                                 "of an MoE model on a cluster by predicted step time and "
                                 "memory per rank.", allow_abbrev=False)
    parser.add_argument("--config", help="training config (YAML or JSON, Megatron flag names)")
    parser.add_argument("--model-type", choices=MODEL_TYPES, default="gpt",
                        help="gpt (pretrain_gpt2_moe.py) or bert (pretrain_bert_moe.py)")
    group = parser.add_argument_group("cluster")
    group.add_argument("--nnodes", type=int, default=1)
    group.add_argument("--nproc-per-node", type=int, required=True)
    group.add_argument("--gpu-memory-gb", type=float, default=80.0,
                       help="memory per rank the plan may use, GiB (default 80)")
    group.add_argument("--parm-profile", required=True,
                       help="cluster profile: a path or the name of a shipped profile "
                            "(tools/calibrate.py measures one)")
    group = parser.add_argument_group("model and training (override --config)")
    for key, flag in _INT_OPTIONS.items():
        group.add_argument(flag, dest=key, type=int, default=None)
    for key, flag in _FLOAT_OPTIONS.items():
        group.add_argument(flag, dest=key, type=float, default=None)
    for key, flag in _BOOL_OPTIONS.items():
        group.add_argument(flag, dest=key, action="store_true", default=None)
    for key, flag in _STR_OPTIONS.items():
        group.add_argument(flag, dest=key, default=None)
    group.add_argument("--bert-no-binary-head", dest="bert_binary_head", action="store_false",
                       default=None)
    group = parser.add_argument_group("search (default: everything)")
    for key, flag in _LAYOUT_FLAGS.items():
        group.add_argument(flag, dest=key, type=int, default=None)
    group.add_argument("--moe-token-dispatcher-type", dest="dispatchers", default=None,
                       help="only these dispatchers (comma-separated)")
    group.add_argument("--parm-chunk-candidates", default=None,
                       help="chunk counts of the chunked schedules (default: each one's own "
                            "from the schedule catalog)")
    group = parser.add_argument_group("output")
    group.add_argument("--top", type=int, default=15,
                       help="rows of the table (default 15; 0 = all)")
    group.add_argument("--show-flags", type=int, default=3,
                       help="print the flags of this many best layouts (default 3)")
    group.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def _read_config(path):
    data = read_config_file(path)
    known = set(_INT_OPTIONS) | set(_FLOAT_OPTIONS) | set(_BOOL_OPTIONS) | set(_STR_OPTIONS)
    settings, unused = {}, []
    for key, value in data.items():
        key = str(key).replace("-", "_")
        if key in known:
            settings[key] = value
        elif key == "bert_no_binary_head":
            settings["bert_binary_head"] = not value
        else:
            unused.append(key)
    if unused:  # training settings, and the layout and dispatcher the planner chooses
        print(f"note: --config {path}: not used by the planner: {', '.join(sorted(unused))}",
              file=sys.stderr)
    return settings


def _flag(key):
    for table in (_INT_OPTIONS, _FLOAT_OPTIONS, _BOOL_OPTIONS, _STR_OPTIONS):
        if key in table:
            return table[key]
    return f"--{key.replace('_', '-')}"


def resolve_settings(args):
    """Defaults < --config < flags, each value checked; errors name the flag."""
    settings = dict(_DEFAULTS)
    if args.config:
        settings.update(_read_config(args.config))
    for key in list(_INT_OPTIONS) + list(_FLOAT_OPTIONS) + list(_BOOL_OPTIONS) + \
            list(_STR_OPTIONS) + ["bert_binary_head"]:
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    for key in _REQUIRED:
        if settings.get(key) is None:
            raise ValueError(f"{_flag(key)} is required (flag or --config key {key})")
    for key in _INT_OPTIONS:
        value = settings.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{_flag(key)} must be a positive integer, got {value!r}")
    for key in _FLOAT_OPTIONS:
        value = settings.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{_flag(key)} must be a number, got {value!r}")
    for key in list(_BOOL_OPTIONS) + ["bert_binary_head"]:
        if settings.get(key) is None:
            settings[key] = key == "bert_binary_head"
        if not isinstance(settings[key], bool):
            raise ValueError(f"{_flag(key)} must be true or false, got {settings[key]!r}")
    if settings["bf16"] and settings["fp16"]:
        raise ValueError("--bf16 and --fp16 are mutually exclusive")
    return settings


def vocab_size_of(settings):
    """--vocab-size, else the size of the tokenizer the config names (as the trainer's)."""
    if settings.get("vocab_size"):
        return settings["vocab_size"]
    kind = settings.get("tokenizer_type")
    if kind == "SentencePieceTokenizer":
        path = settings.get("tokenizer_model")
        if not path or not os.path.isfile(path):
            raise ValueError(f"--tokenizer-model: file not found: {path} (or give --vocab-size)")
        import sentencepiece

        return sentencepiece.SentencePieceProcessor(model_file=path).get_piece_size()
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
    ffn = settings.get("ffn_hidden_size") or 4 * settings["hidden_size"]
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
    )


def model_overrides(args):
    """The model and tokenizer flags given on the command line, for the printed launch line
    (the batch, precision and optimizer flags are the candidate's; --vocab-size is the
    planner's own)."""
    own = {"vocab_size", "micro_batch_size", "global_batch_size", "bf16", "fp16",
           "use_distributed_optimizer"}
    flags = []
    for table in (_INT_OPTIONS, _FLOAT_OPTIONS, _STR_OPTIONS):
        flags += [item for key, flag in table.items() if key not in own
                  and getattr(args, key) is not None for item in (flag, str(getattr(args, key)))]
    flags += [flag for key, flag in _BOOL_OPTIONS.items() if key not in own and getattr(args, key)]
    if args.bert_binary_head is False:
        flags.append("--bert-no-binary-head")
    return flags


def _gib(num_bytes):
    return num_bytes / GIB


def _size(num_bytes):
    return f"{_gib(num_bytes):.2f} GiB" if num_bytes >= GIB / 10 else \
        f"{num_bytes / 2 ** 20:.1f} MiB"


def render(result, spec, cluster, profile, precision, args):
    lines = [
        f"model: {spec.model_type.upper()} MoE, {spec.num_layers} layers, hidden "
        f"{spec.hidden_size}, {spec.num_experts} experts top-{spec.topk}, sequence "
        f"{spec.seq_length}, vocabulary {spec.vocab_size}; {precision.name}"
        + (", distributed optimizer" if result.candidates[0].distributed_optimizer else ""),
        f"cluster: {cluster.describe()}, {_gib(cluster.gpu_memory_bytes):g} GiB per rank; "
        f"profile {profile.name} ({profile.provenance})",
        f"global batch {result.candidates[0].global_batch_size} x {spec.seq_length} tokens, "
        f"micro-batch {result.candidates[0].micro_batch_size}; "
        f"{len(result.fitting)} of {len(result.candidates)} candidates fit",
        "",
    ]
    shown = result.candidates if args.top == 0 else result.candidates[:args.top]
    width = max(len("dispatcher"), *(len(c.schedule_label()) for c in shown)) + 2
    header = (f"{'#':>3} {'tp':>3} {'ep':>3} {'etp':>3} {'pp':>3} {'dp':>3}  {'dispatcher':<{width}}"
              f"{'mb':>3} {'step ms':>10} {'tokens/s':>10} {'MoE ms':>9} {'dense ms':>9}"
              f" {'TP ms':>8} {'bubble':>7} {'grad ms':>8} {'memory/rank':>12}  fits")
    lines += [header, "-" * len(header)]
    for index, candidate in enumerate(shown, start=1):
        step, layout = candidate.step, candidate.layout
        m = step.num_microbatches
        fits = "yes" if candidate.fits else f"no, over by {_size(-candidate.spare_bytes)}"
        lines.append(
            f"{index:>3} {layout.tp:>3} {layout.ep:>3} {layout.etp:>3} {layout.pp:>3} "
            f"{candidate.dp:>3}  "
            f"{candidate.schedule_label():<{width}}{m:>3} {step.step_s * 1e3:>10.1f} "
            f"{step.tokens_per_s:>10.0f} {m * step.moe_s * 1e3:>9.1f} "
            f"{m * step.dense_compute_s * 1e3:>9.1f} {m * step.tp_comm_s * 1e3:>8.1f} "
            f"{step.bubble_share:>7.0%} "
            f"{step.grad_reduce_s * 1e3:>8.1f} {_size(candidate.memory.total):>12}  {fits}")
    if len(shown) < len(result.candidates):
        lines.append(f"... {len(result.candidates) - len(shown)} more (--top 0 shows all)")
    lines.append("")
    lines.append("mb: micro-batches per step; MoE / dense / TP ms: their share of the step "
                 "(all micro-batches; with pp, the slowest stage's); bubble: the pipeline "
                 "bubble's share of the micro-batches' time; grad ms: the data-parallel "
                 "gradient reduction")
    script = f"pretrain_scripts/pretrain_{'gpt2' if spec.model_type == 'gpt' else 'bert'}_moe.py"
    for index, candidate in enumerate(result.fitting[:args.show_flags], start=1):
        memory = candidate.memory
        lines.append("")
        lines.append(f"#{index}: {candidate.step.step_s * 1e3:.1f} ms per step, "
                     f"{candidate.step.tokens_per_s:.0f} tokens/s; per rank "
                     f"{_size(memory.weights)} weights, {_size(memory.gradients)} gradients, "
                     f"{_size(memory.optimizer)} optimizer state, {_size(memory.activations)} "
                     f"activations")
        command = [script] + (["--config", args.config] if args.config else []) + \
            model_overrides(args) + candidate.flags()
        lines.append("  " + shlex.join(command))
    if profile.provenance != "measured":
        lines.append("")
        lines.append("note: the profile is an estimate; calibrate it on the cluster "
                     "(tools/calibrate.py) to trust these times")
    return "\n".join(lines)


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        settings = resolve_settings(args)
        spec = build_spec(settings, args.model_type)
        if args.nnodes < 1 or args.nproc_per_node < 1:
            raise ValueError("--nnodes and --nproc-per-node must be positive")
        if not args.gpu_memory_gb > 0:
            raise ValueError(f"--gpu-memory-gb must be positive, got {args.gpu_memory_gb}")
        try:
            profile = load_profile(args.parm_profile, require_terms=True)
        except ValueError as error:
            raise ValueError(f"--parm-profile: {error}") from error
        chunks = parse_chunks(args.parm_chunk_candidates)
        dispatchers = (None if args.dispatchers is None else
                       [name.strip() for name in args.dispatchers.split(",") if name.strip()])
        precision = Precision("bf16" if settings["bf16"] else
                              "fp16" if settings["fp16"] else "fp32")
        cluster = Cluster(args.nnodes, args.nproc_per_node, args.gpu_memory_gb * GIB)
        result = plan(spec, cluster, profile, settings["micro_batch_size"],
                      settings["global_batch_size"], precision,
                      settings["use_distributed_optimizer"], chunks,
                      fixed={key: getattr(args, key) for key in _LAYOUT_FLAGS},
                      dispatchers=dispatchers)
    except ValueError as error:  # PlanError included
        fail(str(error))
    try:
        emit(args, result, spec, cluster, profile, precision, settings)
    except BrokenPipeError:  # e.g. piped into head
        sys.stderr.close()
    return 0


def emit(args, result, spec, cluster, profile, precision, settings):
    if args.json:
        print(json.dumps({
            "model": {key: value for key, value in vars(spec).items()},
            "cluster": {"nnodes": cluster.nodes, "nproc_per_node": cluster.ranks_per_node,
                        "gpu_memory_bytes": cluster.gpu_memory_bytes},
            "profile": {"name": profile.name, "provenance": profile.provenance,
                        "source": profile.source},
            "precision": precision.name,
            "micro_batch_size": settings["micro_batch_size"],
            "global_batch_size": settings["global_batch_size"],
            "candidates": [candidate.as_dict() for candidate in result.candidates],
            "skipped": [{"tp": tp, "ep": ep, "etp": etp, "pp": pp, "reason": reason}
                        for (tp, ep, etp, pp), reason in sorted(result.skipped.items())],
        }, indent=1))
    else:
        print(render(result, spec, cluster, profile, precision, args))


if __name__ == "__main__":
    cli.run(main)
