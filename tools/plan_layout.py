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

import json
import os
import shlex
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from megatron_parm import cli  # noqa: E402

cli.setup_warnings()

import megatron_parm.settings as declared  # noqa: E402
from megatron_parm.layout_rules import precision_problem  # noqa: E402
from megatron_parm.perf_model import load_profile  # noqa: E402
from megatron_parm.perf_model.layer_plan import parse_chunks  # noqa: E402
from megatron_parm.perf_model.memory import GIB, Precision  # noqa: E402
from megatron_parm.perf_model.planner import Cluster, plan  # noqa: E402
from megatron_parm.perf_model.profile import shipped_profiles  # noqa: E402
from megatron_parm.perf_model.transformer import MODEL_TYPES, ModelSpec  # noqa: E402

# The model and training flags the planner reads (declared in megatron_parm.settings).
MODEL_FLAGS = (
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--moe-ffn-hidden-size",
    "--num-attention-heads", "--seq-length", "--max-position-embeddings", "--num-experts",
    "--moe-router-topk", "--micro-batch-size", "--global-batch-size", "--vocab-size",
    "--moe-expert-capacity-factor", "--hidden-dropout", "--attention-dropout",
    "--moe-pad-expert-input-to-capacity", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--bf16", "--fp16", "--use-distributed-optimizer",
    "--tokenizer-type", "--tokenizer-model", "--vocab-file", "--bert-no-binary-head")
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "num_experts",
            "micro_batch_size", "global_batch_size")
# Sizes that restrict the search; the command line's only (a config's are the planner's to
# choose, listed in the note).
LAYOUT_FLAGS = {"tp": "--tensor-model-parallel-size", "ep": "--expert-model-parallel-size",
                "etp": "--expert-tensor-parallel-size", "pp": "--pipeline-model-parallel-size"}
# The flags of the launch line that are each candidate's (or the planner's own), not copied
# from the command line.
CANDIDATE_KEYS = {"vocab_size", "micro_batch_size", "global_batch_size", "bf16", "fp16",
                  "use_distributed_optimizer"}


def profiles_help() -> str:
    return ("shipped profiles (--parm-profile NAME): " + ", ".join(shipped_profiles())
            + "; or a profile file (tools/calibrate.py measures one)")


class _Parser(declared.Parser):
    """argparse whose errors are one line, `error: ...`, exit status 2."""

    def error(self, message):
        if "--parm-profile" in message and "required" in message:
            message += f"; {profiles_help()}"
        fail(message)


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def build_parser():
    parser = _Parser(description="Rank every TP/EP/ETP/DP layout, dispatcher and chunk count "
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
            model_overrides(args.command_line) + candidate.flags()
        lines.append("  " + shlex.join(command))
    if profile.provenance != "measured":
        lines.append("")
        lines.append("note: the profile is an estimate; calibrate it on the cluster "
                     "(tools/calibrate.py) to trust these times")
    return "\n".join(lines)


def main(argv=None):
    parser = build_parser()
    try:
        args, settings, given = resolve_settings(parser, argv)
        args.command_line = {key: settings[key] for key in given}
        spec = build_spec(settings, args.model_type)
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
                      fixed={key: settings[declared.FLAGS[flag].key]
                             for key, flag in LAYOUT_FLAGS.items()},
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
