"""Turn benchmark JSON lines into tables, a summary against Parm's targets and a plot.

    python tools/bench_report.py OUT/unshaped.jsonl OUT/pcie.jsonl \\
        OUT/nvlink.jsonl OUT/memory.jsonl OUT/ws1.jsonl \\
        --markdown OUT/table.md --plot OUT/speedup.png --summary OUT/summary.json \\
        --model-config configs/gpt2_small_moe.yaml --model-config configs/gpt2_medium_moe.yaml

No process groups needed: it reads what tools/bench_moe_layer.py wrote (labels: a link
preset, ``unshaped``, ``memory``, or any other; see megatron_parm/bench/report.py). The
table gives every configuration's medians, the best Parm schedule's time over alltoall's and
ds_baseline's, its bound and efficiency, and the run-to-run spread; a memory table follows
where a ``memory`` run is given. --model-config adds, per GPT-2 MoE config, the ratio
compute : inter-node : intra-node time of alltoall's step that the performance model
predicts on --model-profile, at each layout of the grid on the emulated cluster's node
count, in bf16: a reader compares it with each preset's measured ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_parm import cli  # noqa: E402

cli.setup_warnings()  # before Megatron-Core is imported

from megatron_parm.bench.report import (group_results, load_records, markdown_table,  # noqa: E402
                                        memory_table, ordered_dispatchers, plot_speedups, summarize)

DEFAULT_MODEL_PROFILE = "nvlink_ib_estimate"


def model_ratios(config_paths, profile_name, results):
    """{config file: {layout: [compute, inter, intra] relative to compute}} predicted for
    alltoall, at each layout (and node count) the grid ran, bf16."""
    from megatron_parm import settings
    from megatron_parm.bench.report import model_time_shares
    from megatron_parm.perf_model import load_profile
    from megatron_parm.perf_model.layer_plan import layer_model

    profile = load_profile(profile_name)
    layouts = sorted({(r.fields["tp"], r.fields["ep"], r.fields["etp"], r.fields["world_size"],
                       r.fields.get("local_world_size") or r.fields["world_size"])
                      for r in results if r.fields.get("world_size", 1) > 1})
    out = {}
    for path in config_paths:
        entry = out.setdefault(path, {})
        for tp, ep, etp, world, per_node in layouts:
            layout, shape, _ = layer_model(settings.layer_model_values(
                path, bf16=True, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                expert_tensor_parallel_size=etp, nnodes=world // per_node,
                nproc_per_node=per_node))
            compute, inter, intra = model_time_shares(shape, layout, profile)
            entry[f"{tp},{ep},{etp}"] = dict(tokens_per_rank=shape.num_tokens,
                                              ratio=[1.0, inter / compute, intra / compute],
                                              ms=[1e3 * compute, 1e3 * inter, 1e3 * intra])
    return {"profile": profile_name, "dispatcher": "alltoall", "configs": out}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("inputs", nargs="+", help="JSON-lines files from bench_moe_layer.py --output")
    p.add_argument("--markdown", help="write the per-configuration tables here")
    p.add_argument("--plot", help="write the speedup plot (PNG) here")
    p.add_argument("--summary", help="write the summary (JSON) here")
    p.add_argument("--parm-profile", action="append", default=[], metavar="[LABEL=]PATH",
                   help="also compare the performance model's predictions with the measured "
                        "times, with this profile (for the runs of LABEL; repeatable)")
    p.add_argument("--model-config", action="append", default=[], metavar="CONFIG",
                   help="a model config (configs/*.yaml) whose alltoall time ratio compute : "
                        "inter : intra the model predicts on --model-profile (repeatable)")
    p.add_argument("--model-profile", default=DEFAULT_MODEL_PROFILE,
                   help=f"profile for --model-config (default {DEFAULT_MODEL_PROFILE})")
    args = p.parse_args(argv)
    for path in args.inputs + args.model_config:
        if not os.path.exists(path):
            p.error(f"input not found: {path}")
    try:
        results = group_results(load_records(args.inputs))
    except (ValueError, KeyError) as err:
        p.error(f"cannot read the records: {err}")
    dispatchers = ordered_dispatchers(results)
    table = markdown_table(results, dispatchers)
    memory = memory_table(results, dispatchers)
    summary = summarize(results)
    for spec in args.parm_profile:
        from megatron_parm.bench.report import model_accuracy
        from megatron_parm.perf_model import load_profile

        label, _, path = spec.rpartition("=")
        rows = [r for r in results if not label or r.label == label]
        if not rows:
            p.error(f"--parm-profile {spec}: no runs labelled {label!r}")
        try:
            profile = load_profile(path, require_terms=True)
        except ValueError as err:
            p.error(f"--parm-profile: {err}")
        for name, entry in model_accuracy(rows, profile).items():
            summary.setdefault(name, {})["model_profile"] = path
            summary[name]["model_within_25pct"] = entry["within_25pct"]
            summary[name]["model_pairs"] = entry["pairs"]
    if args.model_config:
        try:
            summary["model_time_ratios"] = model_ratios(args.model_config, args.model_profile, results)
        except ValueError as err:
            p.error(f"--model-config: {err}")
    text = table + ("\n\nPeak memory per rank, MB (the step's rise in brackets):\n\n" + memory
                    if memory else "")
    print(text)
    print(json.dumps({k: v for k, v in summary.items()}, indent=2, default=str)[:20000])
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(summary, f, indent=2)
    if args.plot:
        plot_speedups(results, args.plot)


if __name__ == "__main__":
    cli.run(main)
