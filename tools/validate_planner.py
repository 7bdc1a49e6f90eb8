#!/usr/bin/env python
"""Check tools/plan_layout.py against training runs on the emulated cluster (root only).

    sudo .venv/bin/python tools/validate_planner.py                        # writes docs/planner/
    sudo .venv/bin/python tools/validate_planner.py --preset nvlink --output /tmp/check \
        --note "quiet machine"

For each config (default: the tiny GPT-2 MoE and the small one of configs/bench/), the planner
ranks every candidate for 2 nodes x 2 ranks with the measured profile of the emulator preset
(the shipped emulated_<preset>_measured profile); then its top --top candidates, --others
more, spread evenly over the rest of the ranking, and --pipeline-runs pipelined ones (pp > 1:
the best of them, then a spread of the others) where those are not picked already, each train
--iterations iterations through
tools/emulate_cluster.py and pretrain_scripts/pretrain_gpt2_moe.py with the planner's flags.
A run's measured step time is the median of its iteration times after the first --warmup.

Written to --output: validation.json (everything, raw iteration times included),
validation.md (a table per config: predicted and measured step time and tokens/s, the
planner's first choice against the best measured, Spearman's rank correlation of predicted and
measured tokens/s) and validation.png (predicted vs measured tokens/s). Timings depend on what
else the machine runs: the report records the load average before and after each run; give
--note to label the run (e.g. "busy machine").
"""

import argparse
import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import textwrap
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ("configs/gpt2_tiny_moe.yaml", "configs/bench/planner_small_gpt2_moe.yaml")
DATA_PATH = "data/cache/gpt_text_document"
NNODES, NPROC_PER_NODE = 2, 2
_ITERATION_MS = re.compile(r"^ iteration\s+\d+/\s*\d+ \|.*elapsed time per iteration \(ms\): "
                           r"([0-9.]+)")


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


# ---------------------------------------------------------------------------------------------
# pure helpers (unit-tested)
# ---------------------------------------------------------------------------------------------

def pick_runs(num_candidates: int, top: int, others: int):
    """Indices into a ranking: the first `top`, then `others` spread evenly over the rest
    (at 1/(others+1), 2/(others+1), ... of it: the slowest tail, long to train, is left out)."""
    chosen = list(range(min(top, num_candidates)))
    rest = list(range(len(chosen), num_candidates))
    for i in range(1, others + 1):
        if rest:
            index = rest[min(len(rest) - 1, (i * len(rest)) // (others + 1))]
            if index not in chosen:
                chosen.append(index)
    return chosen


def pick_pipelined(pipeline_sizes, chosen, count: int):
    """Indices into a ranking whose pipeline_sizes[i] > 1, not in `chosen`: the best of them,
    then count - 1 spread over the others as pick_runs spreads (pipelined layouts in every
    validation, wherever the planner ranks them)."""
    pipelined = [index for index, size in enumerate(pipeline_sizes)
                 if size > 1 and index not in chosen]
    if count < 1:
        return []
    return [pipelined[i] for i in pick_runs(len(pipelined), 1, count - 1)]


def _ranks(values):
    """1-based ranks, ties get the mean of their ranks."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            ranks[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def spearman(xs, ys):
    """Spearman's rank correlation (Pearson's on the ranks); None for fewer than 3 points."""
    if len(xs) != len(ys):
        raise ValueError("spearman: the two lists differ in length")
    if len(xs) < 3:
        return None
    rx, ry = _ranks(list(xs)), _ranks(list(ys))
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else None


def iteration_times_ms(log: str):
    """Elapsed milliseconds of each iteration line of a training log (Megatron's format)."""
    return [float(match.group(1)) for match in map(_ITERATION_MS.match, log.splitlines())
            if match]


# ---------------------------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------------------------

def run_planner(config, profile):
    cmd = [sys.executable, "tools/plan_layout.py", "--config", config, "--nnodes", str(NNODES),
           "--nproc-per-node", str(NPROC_PER_NODE), "--parm-profile", profile,
           "--gpu-memory-gb", "8", "--json"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        fail(f"plan_layout.py for {config}: {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def train(config, flags, args):
    """One training run on the emulated cluster: (iteration times in ms, error or None)."""
    cmd = [sys.executable, "tools/emulate_cluster.py", "--nnodes", str(NNODES),
           "--nproc-per-node", str(NPROC_PER_NODE), "--preset", args.preset,
           "--timeout", str(args.run_timeout), "--", sys.executable,
           "pretrain_scripts/pretrain_gpt2_moe.py", "--config", config, "--data-path", DATA_PATH,
           *flags, "--train-iters", str(args.iterations), "--lr-warmup-iters", "1",
           "--log-interval", "1", "--eval-iters", "0"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, env=env,
                          timeout=args.run_timeout + 60)
    times = iteration_times_ms(proc.stdout)
    if proc.returncode != 0 or len(times) < args.iterations:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return times, f"exit {proc.returncode}: {tail}"
    return times, None


def validate_config(config, args, profile):
    report = run_planner(config, profile)
    ranking = [c for c in report["candidates"] if c["fits"]]
    picked = pick_runs(len(ranking), args.top, args.others)
    picked = sorted(picked + pick_pipelined([c.get("pp", 1) for c in ranking], picked,
                                            args.pipeline_runs))
    tokens_per_step = report["global_batch_size"] * report["model"]["seq_length"]
    rows = []
    for index in picked:
        candidate = ranking[index]
        label = candidate["label"]  # the planner's describe(): layout, vpp, schedule
        print(f"[{config}] #{index + 1} {label} ...", flush=True)
        load_before = os.getloadavg()[0]
        started = time.time()
        times, error = train(config, candidate["flags"], args)
        row = {"rank": index + 1, "label": label, "flags": candidate["flags"],
               "pp": candidate.get("pp", 1), "vpp": candidate.get("vpp"),
               "predicted_bubble_share": candidate["step"].get("bubble_share", 0.0),
               "predicted_step_s": candidate["step"]["step_s"],
               "predicted_tokens_per_s": candidate["step"]["tokens_per_s"],
               "iteration_ms": times, "error": error, "wall_s": time.time() - started,
               "load_before": load_before, "load_after": os.getloadavg()[0]}
        timed = times[args.warmup:]
        if error is None and timed:
            step_s = statistics.median(timed) / 1e3
            row.update(measured_step_s=step_s, measured_tokens_per_s=tokens_per_step / step_s,
                       measured_min_s=min(timed) / 1e3, measured_max_s=max(timed) / 1e3)
        print(f"    {row.get('measured_tokens_per_s', float('nan')):.0f} tokens/s measured, "
              f"{row['predicted_tokens_per_s']:.0f} predicted"
              + (f"  ({error})" if error else ""), flush=True)
        rows.append(row)
    measured = [row for row in rows if "measured_tokens_per_s" in row]
    summary = {"config": config, "profile": report["profile"]["name"],
               "num_candidates": len(ranking), "runs": rows}
    if measured:
        best = max(row["measured_tokens_per_s"] for row in measured)
        first = next((row for row in measured if row["rank"] == 1), None)
        summary["first_choice_vs_best"] = (first["measured_tokens_per_s"] / best
                                           if first else None)
        summary["spearman"] = spearman([row["predicted_tokens_per_s"] for row in measured],
                                       [row["measured_tokens_per_s"] for row in measured])
    return summary


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

def render_markdown(results, meta):
    lines = [f"# Planner validation ({meta['date']})", "",
             f"Emulated cluster {NNODES} nodes x {NPROC_PER_NODE} ranks, preset "
             f"`{meta['preset']}`, {meta['iterations']} iterations per run, measured step = "
             f"median of the iterations after the first {meta['warmup']}; machine: "
             f"{meta['cpus']} CPUs. {meta['note']}".rstrip(), ""]
    for result in results:
        lines += [f"## `{result['config']}` (profile `{result['profile']}`, "
                  f"{result['num_candidates']} candidates that fit)", "",
                  "| planner rank | layout and dispatcher | predicted step ms | measured step ms "
                  "(min-max) | predicted tokens/s | measured tokens/s | measured / predicted "
                  "| predicted bubble | load avg before/after |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for row in result["runs"]:
            if "measured_step_s" in row:
                measured = (f"{row['measured_step_s'] * 1e3:.0f} "
                            f"({row['measured_min_s'] * 1e3:.0f}-{row['measured_max_s'] * 1e3:.0f})")
                tokens = f"{row['measured_tokens_per_s']:.0f}"
                ratio = f"{row['measured_tokens_per_s'] / row['predicted_tokens_per_s']:.2f}"
            else:
                measured, tokens, ratio = f"failed: {row['error']}", "-", "-"
            lines.append(f"| {row['rank']} | {row['label']} | {row['predicted_step_s'] * 1e3:.0f} "
                         f"| {measured} | {row['predicted_tokens_per_s']:.0f} | {tokens} | "
                         f"{ratio} | {row.get('predicted_bubble_share', 0.0):.0%} | "
                         f"{row['load_before']:.1f} / {row['load_after']:.1f} |")
        lines.append("")
        ratio = result.get("first_choice_vs_best")
        rho = result.get("spearman")
        lines.append(f"Planner's first choice: {ratio * 100:.0f}% of the best measured tokens/s "
                     f"(target >= 90%). " if ratio is not None else
                     "Planner's first choice: not measured. ")
        lines[-1] += (f"Spearman rank correlation, predicted vs measured tokens/s: {rho:.2f}."
                      if rho is not None else "Spearman: fewer than 3 runs measured.")
        lines.append("")
    lines.append("![predicted vs measured tokens/s](validation.png)")
    return "\n".join(lines) + "\n"


def plot(results, meta, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.8), squeeze=False)
    for axis, result in zip(axes[0], results):
        rows = [row for row in result["runs"] if "measured_tokens_per_s" in row]
        xs = [row["predicted_tokens_per_s"] for row in rows]
        ys = [row["measured_tokens_per_s"] for row in rows]
        axis.scatter(xs, ys, color=["tab:red" if row["rank"] == 1 else "tab:blue"
                                    for row in rows])
        for row, x, y in zip(rows, xs, ys):  # the planner's rank; the table says the rest
            axis.annotate(f"#{row['rank']}", (x, y), fontsize=8, xytext=(4, 2),
                          textcoords="offset points")
        if xs:
            low, high = min(xs + ys) * 0.8, max(xs + ys) * 1.2
            axis.plot([low, high], [low, high], color="gray", linestyle=":", linewidth=1)
        rho = result.get("spearman")
        axis.set_title(f"{os.path.basename(result['config'])}"
                       + (f"  (Spearman {rho:.2f})" if rho is not None else ""), fontsize=9)
        axis.set_xlabel("predicted tokens/s")
        axis.set_ylabel("measured tokens/s (red: the planner's first choice)")
    figure.suptitle(textwrap.fill(f"{meta['date']}, preset {meta['preset']}. {meta['note']}",
                                  140), fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="comma-separated GPT MoE configs (default: tiny and small)")
    parser.add_argument("--preset", choices=("pcie", "nvlink"), default="pcie")
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--others", type=int, default=3)
    parser.add_argument("--pipeline-runs", type=int, default=2,
                        help="pipelined candidates (pp > 1) to train besides those picked "
                             "(default 2)")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2,
                        help="iterations left out of the median (default 2)")
    parser.add_argument("--run-timeout", type=int, default=240,
                        help="seconds one training run may take (default 240)")
    parser.add_argument("--output", default="docs/planner")
    parser.add_argument("--note", default="", help="a line for the report (machine state)")
    parser.add_argument("--from-json", default=None,
                        help="no runs: rewrite validation.md and .png from this "
                             "validation.json (into --output)")
    args = parser.parse_args(argv)
    output = os.path.join(REPO_ROOT, args.output)
    if args.from_json:
        try:
            with open(args.from_json) as handle:
                saved = json.load(handle)
        except (OSError, ValueError) as error:
            fail(f"--from-json {args.from_json}: {error}")
        write_report(saved["results"], saved["meta"], output, with_json=False)
        return 0
    if os.geteuid() != 0:
        fail("the emulated cluster needs root (network namespaces): run with sudo")
    if args.iterations <= args.warmup:
        fail(f"--iterations ({args.iterations}) must exceed --warmup ({args.warmup})")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for config in configs:
        if not os.path.isfile(os.path.join(REPO_ROOT, config)):
            fail(f"--configs: file not found: {config}")
    profile = f"emulated_{args.preset}_measured"
    subprocess.run(["bash", "pretrain_scripts/prepare_data.sh"], cwd=REPO_ROOT, check=True,
                   env=dict(os.environ, PYTHON=sys.executable))
    started = time.time()
    results = [validate_config(config, args, profile) for config in configs]
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "preset": args.preset, "iterations": args.iterations, "warmup": args.warmup,
            "cpus": os.cpu_count(), "note": args.note, "wall_s": time.time() - started,
            "command": shlex.join(["tools/validate_planner.py"] + list(argv or sys.argv[1:]))}
    write_report(results, meta, output, with_json=True)
    print(f"wrote {output}/validation.{{json,md,png}} in {meta['wall_s'] / 60:.1f} min")
    return 0


def write_report(results, meta, output, with_json):
    os.makedirs(output, exist_ok=True)
    if with_json:
        with open(os.path.join(output, "validation.json"), "w") as handle:
            json.dump({"meta": meta, "results": results}, handle, indent=1)
    with open(os.path.join(output, "validation.md"), "w") as handle:
        handle.write(render_markdown(results, meta))
    plot(results, meta, os.path.join(output, "validation.png"))


if __name__ == "__main__":
    sys.path.insert(0, REPO_ROOT)
    from megatron_parm import cli

    cli.run(main)
