#!/usr/bin/env python
"""Activation memory per recompute choice: measured on CPU against the planner's prediction.

    .venv/bin/python tools/recompute_memory.py                  # writes docs/planner/recompute*
    .venv/bin/python tools/recompute_memory.py --from-json docs/planner/recompute_memory.json

For each activation-recompute choice (none; full uniform 1; full block; selective core_attn,
Megatron's default; selective moe) at pp = 1 and pp = 2, 2 ranks (tp = ep = etp = 1) train one
step of --config (default GPT-2-small-MoE's layers: hidden 768, 12 heads, 8 experts of 3072
top-2, dropout 0.1) cut to --num-layers layers and --seq-length tokens so that it runs on a
few CPU cores; pp = 1 one micro-batch per rank, pp = 2 four (1F1B). Each case is its own
launch of tests/distributed/planner_memory_worker.py (the planner memory test's accounting):
per rank the peak, over the step, of the bytes of the storages autograd holds for backward,
the backward's recomputation included, and the step's peak resident set and its rise
(megatron_parm/bench/memory.py's exact CPU accounting). The prediction is
perf_model.memory.stage_activation_bytes with that choice (fp32, CPU's 4-byte dropout masks).
Written to --output: recompute_memory.json (the worker's records) and recompute_memory.md.
"""

import argparse
import contextlib
import io
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from megatron_parm import cli, planner_inputs  # noqa: E402
from megatron_parm.bench.saved import record_and_report, utc_stamp  # noqa: E402
from megatron_parm.perf_model.layout import Layout  # noqa: E402
from megatron_parm.perf_model.memory import Precision, stage_activation_bytes  # noqa: E402
from megatron_parm.perf_model.recompute import NONE  # noqa: E402

WORLD = 2
MIB = 2 ** 20
NUM_MICROBATCHES = {1: 1, 2: 4}  # per rank, per step


def choices(pp: int, num_layers: int):
    """(name, flags) of the recompute choices measured at pipeline size pp."""
    block = max(num_layers // pp // 2, 1)  # half a stage's layers
    return [("none", []),
            ("full uniform 1", ["--recompute-granularity", "full", "--recompute-method",
                                "uniform", "--recompute-num-layers", "1"]),
            (f"full block {block}", ["--recompute-granularity", "full", "--recompute-method",
                                     "block", "--recompute-num-layers", str(block)]),
            ("selective core_attn", ["--recompute-granularity", "selective"]),
            ("selective moe", ["--recompute-granularity", "selective", "--recompute-modules",
                               "moe"])]


def cases(args):
    model = ["--num-layers", str(args.num_layers), "--seq-length", str(args.seq_length),
             "--max-position-embeddings", str(args.seq_length),
             "--micro-batch-size", str(args.micro_batch_size)]
    found = []
    for pp in (1, 2):
        batch = args.micro_batch_size * (WORLD // pp) * NUM_MICROBATCHES[pp]
        for name, flags in choices(pp, args.num_layers):
            found.append({"config": args.config, "model_type": "gpt", "tp": 1, "ep": 1,
                          "etp": 1, "pp": pp, "dispatcher": "alltoall", "step": True,
                          "rss": True, "name": name,
                          "flags": model + ["--global-batch-size", str(batch)] + flags})
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(case, timeout):
    """One launch of the worker on WORLD ranks: its record."""
    with tempfile.TemporaryDirectory() as folder:
        cases_path, out_path = os.path.join(folder, "case.json"), os.path.join(folder, "out.json")
        with open(cases_path, "w") as handle:
            json.dump([case], handle)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
               "--master-port", str(_free_port()), "tests/distributed/planner_memory_worker.py",
               cases_path,
               out_path]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, env=env,
                              timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{case['name']} pp={case['pp']}: "
                               + (proc.stderr.strip().splitlines() or ["no output"])[-1])
        with open(out_path) as handle:
            return json.load(handle)[0]


def predicted(record):
    """(spec, recompute choice, {stage: predicted activation bytes}) of a record."""
    parser = planner_inputs.build_parser()
    argv = ["--config", record["config"], *record["flags"], "--nproc-per-node", str(WORLD),
            "--parm-profile", "nvlink_ib_estimate"]
    with contextlib.redirect_stderr(io.StringIO()):  # the config's unused keys: not news here
        _, settings, _ = planner_inputs.resolve_settings(parser, argv)
    spec = planner_inputs.build_spec(settings, "gpt")
    recompute = planner_inputs.recompute_of(settings) or NONE
    layout = Layout(1, 1, 1, nodes=1, ranks_per_node=WORLD, pp=record["pp"])
    per_stage = {stage: stage_activation_bytes(
        spec, layout, settings["micro_batch_size"], Precision("fp32"), stage,
        NUM_MICROBATCHES[record["pp"]], dropout_mask_bytes=4, recompute=recompute)[0]
        for stage in range(record["pp"])}
    return spec, recompute, per_stage


def rows(records):
    """One row per (record, stage): measured (mean over the stage's ranks) and predicted."""
    found = []
    for record in records:
        _, recompute, per_stage = predicted(record)
        stages = [stage or 0 for stage in record["stage"]]
        for stage, estimate in per_stage.items():
            ranks = [index for index, value in enumerate(stages) if value == stage]
            mean = (lambda key: sum(record[key][i] for i in ranks) / len(ranks)
                    if all(record[key][i] is not None for i in ranks) else None)
            found.append({"pp": record["pp"], "stage": stage, "name": record["name"],
                          "flags": recompute.flags(), "measured": mean("peak_bytes"),
                          "predicted": estimate, "rss_step": mean("rss_step_bytes"),
                          "rss_peak": mean("rss_peak_bytes")})
    for row in found:
        none = next(other for other in found if other["pp"] == row["pp"]
                    and other["stage"] == row["stage"] and other["name"] == "none")
        row["none_over_this"] = none["measured"] / row["measured"]
    return found


def render(records, meta):
    lines = [f"Measured {meta['date']}, {meta['machine']}; `{meta['command']}`.", "",
             "| pp | stage | recompute | measured peak saved MiB | predicted MiB | predicted / "
             "measured | none / this (measured) | RSS step rise MiB | RSS peak MiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows(records):
        rss = (f"{row['rss_step'] / MIB:.1f} | {row['rss_peak'] / MIB:.0f}"
               if row["rss_step"] is not None else "- | -")
        lines.append(f"| {row['pp']} | {row['stage']} | {row['name']} "
                     f"| {row['measured'] / MIB:.1f} | {row['predicted'] / MIB:.1f} "
                     f"| {row['predicted'] / row['measured']:.3f} "
                     f"| {row['none_over_this']:.2f} | {rss} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/gpt2_small_moe.yaml")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    parser.add_argument("--output", default="docs/planner")
    parser.add_argument("--from-json", default=None,
                        help="no runs: rewrite recompute_memory.md from this json")
    args = parser.parse_args(argv)
    def measure_all():
        found = cases(args)
        for case in found:  # the flags of every case resolve (one line if not) before a launch
            predicted(case)
        records = [measure(case, args.timeout) for case in found]
        return {"meta": {"date": utc_stamp(),
                         "machine": f"{os.cpu_count()}-core CPU, {WORLD} gloo ranks",
                         "command": shlex.join(["tools/recompute_memory.py"]
                                               + list(argv or sys.argv[1:]))},
                "records": records}

    record_and_report(os.path.join(REPO_ROOT, args.output), "recompute_memory", args.from_json,
                      measure_all, lambda saved: render(saved["records"], saved["meta"]))
    return 0


if __name__ == "__main__":
    cli.run(main)
