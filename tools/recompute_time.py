#!/usr/bin/env python
"""Step time per recompute choice: measured on CPU against the planner's step-time model.

    .venv/bin/python tools/recompute_time.py                  # writes docs/planner/recompute_time*
    .venv/bin/python tools/recompute_time.py --from-json docs/planner/recompute_time.json

One launch of 2 ranks (tp = 1, ep = 2, alltoall) builds --config (default
configs/bench/planner_small_gpt2_moe.yaml: 4 layers, hidden 256, 8 experts top-2, sequence 256,
global batch 8 of micro-batches of 2) three times, from the same seed, once per
activation-recompute choice (none; full uniform 1; selective moe), and trains them in turn, one
iteration each, --iterations times: the three steps of a turn run within seconds of each other,
so the load of a shared machine falls on each alike (a launch per choice, minutes apart, did
not: on a machine at load 8-33 one choice's launch measured 0.4x and another's 2.5x the same
round's launch of none). A step is timed from a barrier to the end of its optimizer step,
wall-clock on the slowest rank and in CPU time (user + system, the ranks' mean: what the
step's own work takes, whatever else holds the cores). Per choice, for each of the two: the
median step over the turns after the first --warmup, its interquartile range and min-max,
and the same of each turn's step over that turn's none. The prediction is perf_model.step_time with the choice on --parm-profile (the
planner's; default emulated_pcie_measured, whose compute and framework terms were measured on
this project's 2-core machine). The lm losses of every choice are compared with none's
(recomputation must not change them). Written to --output: recompute_time.json (every step's
time and loss, the load average of each turn) and recompute_time.md.
"""

import argparse
import contextlib
import io
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import megatron_parm.settings as declared  # noqa: E402
from megatron_parm import cli, planner_inputs  # noqa: E402
from megatron_parm.bench.saved import record_and_report, utc_stamp  # noqa: E402
from megatron_parm.perf_model import load_profile  # noqa: E402
from megatron_parm.perf_model.layout import Layout  # noqa: E402
from megatron_parm.perf_model.memory import Precision  # noqa: E402
from megatron_parm.perf_model.recompute import NONE  # noqa: E402
from megatron_parm.perf_model.step_time import step_time  # noqa: E402

WORLD = 2
DISPATCHER = "alltoall"
DATA_PATH = "data/cache/gpt_text_document"
CHOICES = (("none", []),
           ("full uniform 1", ["--recompute-granularity", "full", "--recompute-method",
                               "uniform", "--recompute-num-layers", "1"]),
           ("selective moe", ["--recompute-granularity", "selective", "--recompute-modules",
                              "moe"]))


def training_flags(args, flags):
    """The trainer's flags of one choice."""
    return ["--config", args.config, "--data-path", DATA_PATH, "--expert-model-parallel-size",
            str(args.expert_model_parallel_size), "--moe-token-dispatcher-type", DISPATCHER,
            "--train-iters", str(args.iterations), "--lr-warmup-iters", "1",
            "--log-interval", str(args.iterations), "--eval-iters", "0", *flags]


def worker(args):
    """On every rank (torchrun): the three runs, trained in turn; rank 0 writes args.worker:
    {choice: {"seconds": [the slowest rank's step], "cpu_seconds": [the ranks' mean CPU time
    of a step], "losses": [...]}, "load": [per turn]}."""
    import torch

    from megatron_parm.data.loaders import build_iterators
    from megatron_parm.data.tokenizers import build_tokenizer
    from megatron_parm.training.arguments import parse_args
    from megatron_parm.training.model import FORWARD_STEPS
    from megatron_parm.training.trainer import (Run, build_model_and_optimizer, initialize,
                                                set_seed)

    runs = {}
    for name, flags in CHOICES:
        settings = parse_args(training_flags(args, flags))
        if not runs:
            initialize(settings)  # the process groups, once: every run has the same layout
        set_seed(settings.seed)  # the same weights and data for each choice
        tokenizer = build_tokenizer(settings)
        model, optimizer, scheduler = build_model_and_optimizer(settings, tokenizer.vocab_size)
        train_iter, valid_iter = build_iterators(settings, tokenizer, len(model), 0)
        runs[name] = Run(settings, model, optimizer, scheduler, FORWARD_STEPS["gpt"],
                         train_iter, valid_iter, 0, 0)
    load, cpu = [], {name: [] for name in runs}
    for _ in range(args.iterations):
        load.append(os.getloadavg()[0])
        for name, run in runs.items():
            torch.distributed.barrier()
            began = time.process_time()
            run.step()
            cpu[name].append(time.process_time() - began)
    record = {"load": load}
    for name, run in runs.items():
        seconds = torch.tensor(run.summary["iteration_times"], dtype=torch.float64)
        torch.distributed.all_reduce(seconds, op=torch.distributed.ReduceOp.MAX)
        cpu_seconds = torch.tensor(cpu[name], dtype=torch.float64)
        torch.distributed.all_reduce(cpu_seconds)
        record[name] = {"seconds": seconds.tolist(),
                        "cpu_seconds": (cpu_seconds / WORLD).tolist(),
                        "losses": run.summary["losses"]}
    if torch.distributed.get_rank() == 0:
        with open(args.worker, "w") as handle:
            json.dump(record, handle)
    for run in runs.values():
        run.finish()
    return 0


def launch(args):
    """The worker's launch on WORLD ranks: its record."""
    out = os.path.join(tempfile.mkdtemp(prefix="recompute_time"), "record.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(WORLD), "tools/recompute_time.py", "--worker", out,
           "--config", args.config, "--expert-model-parallel-size",
           str(args.expert_model_parallel_size), "--iterations", str(args.iterations)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, env=env,
                          timeout=args.timeout)
    if proc.returncode != 0 or not os.path.isfile(out):
        raise RuntimeError(f"the launch failed (exit {proc.returncode}): "
                           + (proc.stderr.strip().splitlines() or ["no output"])[-1])
    with open(out) as handle:
        return json.load(handle)


def predicted(meta):
    """{choice name: predicted step seconds} on the measured layout."""
    profile = load_profile(meta["profile"], require_terms=True)
    found = {}
    for name, flags in CHOICES:
        argv = ["--config", meta["config"], *flags, "--nproc-per-node", str(WORLD),
                "--parm-profile", meta["profile"]]
        with contextlib.redirect_stderr(io.StringIO()):  # the config's unused keys
            _, settings, _ = planner_inputs.resolve_settings(planner_inputs.build_parser(),
                                                             argv)
        spec = planner_inputs.build_spec(settings, "gpt")
        layout = Layout(1, meta["ep"], 1, nodes=1, ranks_per_node=WORLD)
        found[name] = step_time(spec, layout, profile, DISPATCHER, None,
                                settings["micro_batch_size"], settings["global_batch_size"],
                                Precision("fp32"),
                                recompute=planner_inputs.recompute_of(settings) or NONE).step_s
    return found


def _quartiles(values):
    """(median, first and third quartile, min, max)."""
    ordered = sorted(values)
    first, median, third = statistics.quantiles(ordered, n=4)
    return median, first, third, ordered[0], ordered[-1]


def summarize(saved):
    """One row per choice: for the wall-clock step and its CPU time, the median, IQR and
    min-max, and those of the turns' step over the same turn's none's; the predicted step and
    ratio; its losses against none's."""
    warmup, record = saved["meta"]["warmup"], saved["record"]
    steps = predicted(saved["meta"])
    rows = []
    for name, _ in CHOICES:
        row = {"name": name, "samples": len(record[name]["seconds"]) - warmup,
               "predicted_ms": steps[name] * 1e3,
               "predicted_ratio": steps[name] / steps["none"],
               "losses_equal": record[name]["losses"] == record["none"]["losses"]}
        for key in ("seconds", "cpu_seconds"):
            mine, none = record[name][key][warmup:], record["none"][key][warmup:]
            row[key] = [value * 1e3 for value in _quartiles(mine)]
            row[key + "_ratio"] = _quartiles([a / b for a, b in zip(mine, none)])
        rows.append(row)
    return rows


def render(saved):
    meta, load = saved["meta"], saved["record"]["load"]
    lines = [f"Measured {meta['date']}, {meta['machine']}, load average (1 min) "
             f"{min(load):.1f}-{max(load):.1f} over the turns; `{meta['command']}`; "
             f"predicted on profile {meta['profile']}. Per choice "
             f"{len(saved['record']['none']['seconds']) - meta['warmup']} turns; "
             f"median (IQR; min-max).", "",
             "| recompute | step ms | step / the turn's none | CPU ms per step | CPU / the "
             "turn's none | predicted step ms | predicted / none | predicted ratio / measured "
             "(step; CPU) | lm losses = none's |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def spread(values, digits):
        return (f"{values[0]:.{digits}f} ({values[1]:.{digits}f}-{values[2]:.{digits}f}; "
                f"{values[3]:.{digits}f}-{values[4]:.{digits}f})")

    for row in summarize(saved):
        lines.append(
            f"| {row['name']} | {spread(row['seconds'], 0)} | {spread(row['seconds_ratio'], 3)} "
            f"| {spread(row['cpu_seconds'], 0)} | {spread(row['cpu_seconds_ratio'], 3)} "
            f"| {row['predicted_ms']:.1f} | {row['predicted_ratio']:.3f} "
            f"| {row['predicted_ratio'] / row['seconds_ratio'][0]:.3f}; "
            f"{row['predicted_ratio'] / row['cpu_seconds_ratio'][0]:.3f} "
            f"| {'yes' if row['losses_equal'] else 'no'} |")
    return "\n".join(lines) + "\n"


def measure(args, argv):
    """The launch: the saved record."""
    meta = {"date": utc_stamp(),
            "machine": f"{os.cpu_count()}-core CPU, {WORLD} gloo ranks, tp=1 "
                       f"ep={args.expert_model_parallel_size} etp=1, {DISPATCHER}, fp32",
            "command": shlex.join(["tools/recompute_time.py"] + list(argv)),
            "config": args.config, "ep": args.expert_model_parallel_size,
            "profile": args.parm_profile, "iterations": args.iterations,
            "warmup": args.warmup}
    predicted(meta)  # the flags resolve (one line if not) before the launch
    if not os.path.isfile(os.path.join(REPO_ROOT, DATA_PATH + ".idx")):
        subprocess.run(["bash", "pretrain_scripts/prepare_data.sh"], cwd=REPO_ROOT, check=True,
                       env=dict(os.environ, PYTHON=sys.executable))
    return {"meta": meta, "record": launch(args)}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = declared.Parser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/bench/planner_small_gpt2_moe.yaml")
    parser.add_argument("--iterations", type=int, default=30,
                        help="turns: iterations of each choice")
    parser.add_argument("--warmup", type=int, default=3, help="turns left out")
    declared.add_flags(parser, ["--expert-model-parallel-size", "--parm-profile"],
                       defaults={"expert_model_parallel_size": 2,
                                 "parm_profile": "emulated_pcie_measured"},
                       helps={"expert_model_parallel_size": "of the 2 ranks (default 2)",
                              "parm_profile": "the planner's profile for the prediction "
                                              "(default: emulated_pcie_measured)"})
    parser.add_argument("--timeout", type=int, default=1800, help="seconds for the launch")
    parser.add_argument("--output", default="docs/planner")
    parser.add_argument("--from-json", default=None,
                        help="no runs: rewrite recompute_time.md from this json")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.warmup >= args.iterations:
        raise ValueError(f"--warmup ({args.warmup}) must be below --iterations "
                         f"({args.iterations})")
    record_and_report(os.path.join(REPO_ROOT, args.output), "recompute_time", args.from_json,
                      lambda: measure(args, argv), render)
    return 0


if __name__ == "__main__":
    cli.run(main)
