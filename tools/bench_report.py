"""Turn benchmark JSON lines into a table, a summary against Parm's targets and a plot.

    python tools/bench_report.py docs/bench/small_pcie.jsonl docs/bench/small_nvlink.jsonl \\
        --markdown docs/bench/table.md --plot docs/bench/speedup.png

No process groups needed: it reads what tools/bench_moe_layer.py wrote.
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
                                        ordered_dispatchers, plot_speedups, summarize)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("inputs", nargs="+", help="JSON-lines files from bench_moe_layer.py --output")
    p.add_argument("--markdown", help="write the per-configuration table here")
    p.add_argument("--plot", help="write the speedup plot (PNG) here")
    p.add_argument("--summary", help="write the summary (JSON) here")
    p.add_argument("--parm-profile", action="append", default=[], metavar="[LABEL=]PATH",
                   help="also compare the performance model's predictions with the measured "
                        "times, with this profile (for the runs of LABEL; repeatable)")
    args = p.parse_args(argv)
    for path in args.inputs:
        if not os.path.exists(path):
            p.error(f"input not found: {path}")
    results = group_results(load_records(args.inputs))
    dispatchers = ordered_dispatchers(results)
    table = markdown_table(results, dispatchers)
    summary = summarize(results)
    for spec in args.parm_profile:
        from megatron_parm.bench.report import model_accuracy
        from megatron_parm.perf_model import load_profile

        label, _, path = spec.rpartition("=")
        rows = [r for r in results if not label or r.label == label]
        if not rows:
            p.error(f"--parm-profile {spec}: no runs labelled {label!r}")
        for name, entry in model_accuracy(rows, load_profile(path)).items():
            summary.setdefault(name, {})["model_profile"] = path
            summary[name]["model_within_25pct"] = entry["within_25pct"]
            summary[name]["model_pairs"] = entry["pairs"]
    print(table)
    print(json.dumps(summary, indent=2))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(summary, f, indent=2)
    if args.plot:
        plot_speedups(results, args.plot)


if __name__ == "__main__":
    cli.run(main)
