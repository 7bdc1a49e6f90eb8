#!/usr/bin/env python
"""Which TP / EP / ETP / PP / DP, dispatcher and chunk count to run a model with on a cluster.

Pure Python (no torch, no cluster): for every layout Megatron can run (sequence parallel where
TP > 1; pipelines plain and interleaved, --num-layers-per-virtual-pipeline-stage), every
dispatcher that runs there and Parm S2's chunk counts, the performance model
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
--moe-token-dispatcher-type on the command line restrict the search. Activation
recomputation: with --recompute-granularity (and --recompute-method, --recompute-num-layers,
--recompute-modules, Megatron-LM's flags) every candidate is planned with that choice;
without, a candidate that does not fit is planned with the fastest recomputation that makes
it fit (perf_model/recompute.py), shown in the `fits` column with what it adds to the step
(the forward work it runs again, perf_model/step_time.py: included in `step ms`, and so in
the ranking) and in its flags. Bad input prints one line `error: ...` and exits 2.
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
from megatron_parm import planner_inputs  # noqa: E402
from megatron_parm.perf_model import load_profile  # noqa: E402
from megatron_parm.perf_model.layer_plan import parse_chunks  # noqa: E402
from megatron_parm.perf_model.memory import GIB, Precision  # noqa: E402
from megatron_parm.perf_model.planner import Cluster, plan  # noqa: E402
from megatron_parm.wording import plural  # noqa: E402
from megatron_parm.planner_inputs import (LAYOUT_FLAGS, build_spec, model_overrides,  # noqa: E402
                                          profiles_help, recompute_of, resolve_settings)

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
    return planner_inputs.build_parser(_Parser)


def _gib(num_bytes):
    return num_bytes / GIB


def _size(num_bytes):
    return f"{_gib(num_bytes):.2f} GiB" if num_bytes >= GIB / 10 else \
        f"{num_bytes / 2 ** 20:.1f} MiB"


def architecture(spec):
    """What the model line says of today's architectures (nothing for GPT-2's)."""
    parts = []
    if spec.num_moe_layers < spec.num_layers:
        parts.append(plural(spec.num_layers - spec.num_moe_layers, "dense layer"))
    if spec.shared_expert_size:
        parts.append(f"shared experts {spec.shared_expert_size}"
                     + (" gated" if spec.shared_expert_gate else ""))
    if spec.query_groups != spec.num_attention_heads:
        parts.append(f"{spec.query_groups} KV heads")
    parts += [name for name, on in (("SwiGLU", spec.swiglu), ("qk-norm", spec.qk_layernorm),
                                    ("RMSNorm", spec.normalization == "RMSNorm"),
                                    ("rope", spec.position_embedding_type == "rope"),
                                    ("untied", not spec.tied_output)) if on]
    return parts


def render(result, spec, cluster, profile, precision, args):
    lines = [
        f"model: {spec.model_type.upper()} MoE, {spec.num_layers} layers, hidden "
        f"{spec.hidden_size}, {spec.num_experts} experts top-{spec.topk}, sequence "
        f"{spec.seq_length}, vocabulary {spec.vocab_size}"
        + "".join(f", {part}" for part in architecture(spec)) + f"; {precision.name}"
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
    header = (f"{'#':>3} {'tp':>3} {'ep':>3} {'etp':>3} {'pp':>3} {'vpp':>3} {'dp':>3}  "
              f"{'dispatcher':<{width}}"
              f"{'mb':>3} {'step ms':>10} {'tokens/s':>10} {'MoE ms':>9} {'dense ms':>9}"
              f" {'TP ms':>8} {'bubble':>7} {'grad ms':>8} {'memory/rank':>12}  fits")
    lines += [header, "-" * len(header)]
    for index, candidate in enumerate(shown, start=1):
        step, layout = candidate.step, candidate.layout
        m = step.num_microbatches
        fits = "yes" if candidate.fits else f"no, over by {_size(-candidate.spare_bytes)}"
        if candidate.recompute.granularity:
            fits += (f", recompute {candidate.recompute.label()} "
                     f"(+{m * step.recompute_s * 1e3:.1f} ms)")
        lines.append(
            f"{index:>3} {layout.tp:>3} {layout.ep:>3} {layout.etp:>3} {layout.pp:>3} "
            f"{candidate.vpp or '-':>3} {candidate.dp:>3}  "
            f"{candidate.schedule_label():<{width}}{m:>3} {step.step_s * 1e3:>10.1f} "
            f"{step.tokens_per_s:>10.0f} {m * step.moe_s * 1e3:>9.1f} "
            f"{m * step.dense_compute_s * 1e3:>9.1f} "
            f"{m * (step.tp_comm_s + step.cp_comm_s) * 1e3:>8.1f} "
            f"{step.bubble_share:>7.0%} "
            f"{step.grad_reduce_s * 1e3:>8.1f} {_size(candidate.memory.total):>12}  {fits}")
    if len(shown) < len(result.candidates):
        lines.append(f"... {len(result.candidates) - len(shown)} more (--top 0 shows all)")
    lines.append("")
    lines.append("vpp: virtual pipeline stages per rank (interleaved 1F1B; -: not "
                 "interleaved); mb: micro-batches per step; MoE / dense / TP ms: their share "
                 "of the step (all micro-batches; with pp, the slowest stage's); bubble: the "
                 "pipeline bubble's share of the micro-batches' time; grad ms: the data-parallel "
                 "gradient reduction; recompute (+ ms): the forward work activation "
                 "recomputation runs again (all micro-batches; with pp, the slowest stage's, "
                 "which also lengthens the bubble), included in step ms")
    cp = result.candidates[0].layout.cp if result.candidates else 1
    if cp > 1:
        lines.append(f"cp: every layout runs --context-parallel-size {cp} (--cp-comm-type "
                     f"all_gather); dp is the data-parallel size that splits the batch, and TP "
                     f"ms includes the gathers of the keys and values over the CP ranks")
    script = f"pretrain_scripts/pretrain_{'gpt2' if spec.model_type == 'gpt' else 'bert'}_moe.py"
    for index, candidate in enumerate(result.fitting[:args.show_flags], start=1):
        memory = candidate.memory
        lines.append("")
        lines.append(f"#{index} {candidate.describe()}: "
                     f"{candidate.step.step_s * 1e3:.1f} ms per step, "
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
                      dispatchers=dispatchers, recompute=recompute_of(settings))
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
