#!/usr/bin/env python
"""Predict every modelled dispatcher's time per MoE layer, and the schedule Parm picks.

Pure Python, no cluster and no torch needed: it runs the alpha-beta model of
megatron_parm.perf_model on a model config and a cluster profile.

    python tools/plan_schedule.py --parm-profile emulated_pcie \
        --hidden-size 512 --moe-ffn-hidden-size 256 --num-experts 4 --moe-router-topk 2 \
        --seq-length 2048 --micro-batch-size 1 --tensor-model-parallel-size 2 \
        --expert-model-parallel-size 2 --expert-tensor-parallel-size 2 --sequence-parallel \
        --nnodes 2 --nproc-per-node 2

    python tools/plan_schedule.py --config my_model.yaml --parm-profile nvlink_ib_estimate

A config is YAML (or JSON) with Megatron-LM's argument names in snake_case (num_layers,
hidden_size, ffn_hidden_size, moe_ffn_hidden_size, num_experts, moe_router_topk, seq_length,
micro_batch_size, tensor_model_parallel_size, expert_model_parallel_size,
expert_tensor_parallel_size, sequence_parallel, moe_expert_capacity_factor,
moe_pad_expert_input_to_capacity, bf16, fp16, swiglu, nnodes, nproc_per_node, moe_layer_freq)
plus the short aliases tp, ep, etp, nodes, ranks_per_node; a training config works too (its
other keys are listed in a note). Command-line flags override it. The flags are declared in
megatron_parm.settings, the model in megatron_parm.perf_model.layer_plan.
--parm-profile takes a path or the name of a shipped profile (megatron_parm/perf_model/profiles/).
"""

import json
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from megatron_parm import cli  # noqa: E402

cli.setup_warnings()  # before Megatron-Core is imported

from megatron_parm import settings  # noqa: E402
from megatron_parm.perf_model import choose_schedule, load_profile, schedule_label  # noqa: E402
from megatron_parm.perf_model.layer_plan import (layer_model, parse_chunks,  # noqa: E402
                                                 references, render)


def build_parser():
    parser = settings.Parser(
        description="Predict per-MoE-layer times of every modelled dispatcher (ds_baseline, "
                    "alltoall, parm_s1, parm_s2(c), ...) and the schedule the automatic Parm "
                    "dispatcher would pick.")
    settings.add_flags(parser, ["--config", "--parm-profile", "--parm-chunk-candidates"],
                       required=["--parm-profile"])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    settings.add_flags(parser, settings.LAYER_MODEL_FLAGS, defaults=settings.LAYER_MODEL_DEFAULTS)
    return parser


def main(argv=None):
    parser = build_parser()
    try:
        args = settings.read(parser, argv, aliases=settings.LAYER_MODEL_ALIASES, strict=False,
                             reader="by the planner")
        settings.require(args, ("hidden_size", "num_experts", "seq_length"))
        layout, shape, num_moe_layers = layer_model(args)
        try:
            profile = load_profile(args.parm_profile, require_terms=True)
        except ValueError as error:
            raise ValueError(f"--parm-profile: {error}") from error
        chunks = parse_chunks(args.parm_chunk_candidates)
        sequence_parallel = args.sequence_parallel or layout.tp == 1
        choice = choose_schedule(shape, layout, profile, chunks, sequence_parallel)
    except ValueError as error:
        parser.error(str(error))
    others = references(shape, layout, profile, sequence_parallel)
    if args.json:
        report = {
            "choice": choice.schedule if isinstance(choice.schedule, str)
            else list(choice.schedule),
            "num_moe_layers": num_moe_layers,
            "profile": profile.name,
            "times_s": {**{name: p.total_s for name, p in others.items()},
                        **{schedule_label(key): seconds for key, seconds in choice.times.items()}},
        }
        print(json.dumps(report, indent=2))
    else:
        print(render(layout, shape, num_moe_layers, profile, choice, others, sequence_parallel))
    return 0


if __name__ == "__main__":
    cli.run(main)
