#!/usr/bin/env python3
"""The end-to-end benchmark: GPT-2 MoE and BERT MoE pretraining iterations per dispatcher on
the emulated cluster, tokens/s, where each step's time goes, and the losses.

    # root: the emulated 2 x 2 cluster (network namespaces); the reduced grid, ~25 min
    sudo .venv/bin/python tools/bench_e2e.py --config configs/bench/e2e_reduced.yaml --output docs/bench/e2e
    # the whole grid (both presets, three layouts)
    sudo .venv/bin/python tools/bench_e2e.py --config configs/bench/e2e.yaml --output docs/bench/e2e
    # Megatron-Core's combined 1F1B (--overlap-moe-expert-parallel-comm) beside the plain
    # schedule, bf16, 2 micro-batches per iteration: (2,2,2) on both presets, 1-2 h (estimated)
    sudo .venv/bin/python tools/bench_e2e.py --config configs/bench/e2e_moe_overlap_reduced.yaml --output docs/bench/e2e_moe_overlap
    # SMOKE: tiny models on plain loopback (no root, no emulator), about a minute
    .venv/bin/python tools/bench_e2e.py --config configs/bench/e2e_smoke.yaml --output /tmp/e2e
    # the report again from what OUTPUT holds
    .venv/bin/python tools/bench_e2e.py --config configs/bench/e2e.yaml --output docs/bench/e2e --report-only

For each pass, model, preset and layout of the config (megatron_parm/bench/e2e.py) one launch
trains the model with every dispatcher under every variant in turn (same seed, data and
schedule; a dispatcher's variants one after the other, which one first alternating), under
tools/emulate_cluster.py (preset pcie or nvlink) or torchrun (preset loopback), with
--parm-timing-file; rank 0 appends one JSON line per run to OUTPUT/e2e.jsonl, so an
interrupted benchmark resumes where it stopped (the runs already there are skipped; delete the
file to start afresh). Each launch's output goes to OUTPUT/logs/. Then the report:
OUTPUT/e2e_table.md, OUTPUT/e2e_summary.json, OUTPUT/e2e_tokens.png.

A config's training_flags (say Megatron-LM's --overlap-grad-reduce) are added to every run,
a variant's flags to its runs; the report reads only the runs made with the config's flags,
micro-batches per iteration and variants. A config naming an unknown dispatcher, model or
preset, a layout that cannot run, or training or variant flags the trainer refuses with a
model, layout and dispatcher of the config, is one line and exit status 2, before anything
runs; so is an emulated preset without root.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_parm import cli  # noqa: E402

cli.setup_warnings()  # before Megatron-Core is imported

from megatron_parm.bench import e2e  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench_e2e.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="benchmark config (configs/bench/e2e*.yaml)")
    parser.add_argument("--output", default="docs/bench/e2e", help="output folder (default %(default)s)")
    parser.add_argument("--report-only", action="store_true",
                        help="write the report from OUTPUT/e2e.jsonl, run nothing")
    parser.add_argument("--timeout", type=float, default=3600,
                        help="seconds one launch may take (default %(default)s)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a launch's cell (JSON)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    config = e2e.load_config(args.config)
    if any(p != e2e.LOOPBACK for p in config["presets"]) and not args.report_only \
            and os.geteuid() != 0:
        raise ValueError(f"--config: {args.config}: presets "
                         f"{', '.join(p for p in config['presets'] if p != e2e.LOOPBACK)} run "
                         f"on the emulated cluster, which needs root (sudo); preset "
                         f"{e2e.LOOPBACK} runs without")
    os.makedirs(os.path.join(args.output, "logs"), exist_ok=True)
    results = os.path.join(args.output, "e2e.jsonl")
    if not args.report_only and not run_cells(config, args, results):
        return 1
    records = [r for r in e2e.read_records(results) if e2e.in_config(r, config)]
    if not records:
        raise ValueError(f"--output: {results} holds no runs of this config")
    summary = e2e.summarize(records, config)
    summary["config"] = {k: config[k] for k in ("name", "models", "presets", "layouts",
                                                "dispatchers", "warmup", "iterations", "passes",
                                                "micro_batches", "training_flags", "variants")}
    with open(os.path.join(args.output, "e2e_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    table = e2e.markdown(summary)
    with open(os.path.join(args.output, "e2e_table.md"), "w") as f:
        f.write(table)
    e2e.plot(summary, os.path.join(args.output, "e2e_tokens.png"))
    print(table)
    print(f"bench_e2e: {len(records)} runs; {args.output}/e2e_table.md, e2e_summary.json, "
          f"e2e_tokens.png")
    return 0 if summary["losses_equal"] else 1


def run_cells(config: dict, args, results: str) -> bool:
    """One launch per (pass, model, preset, layout) that still lacks runs; False when one
    failed (the runs before it are kept)."""
    subprocess.run(["bash", "pretrain_scripts/prepare_data.sh"], cwd=REPO, check=True,
                   env=dict(os.environ, PYTHON=sys.executable))
    done = e2e.done_keys([r for r in e2e.read_records(results) if e2e.in_config(r, config)])
    world_size = config["nodes"] * config["ranks_per_node"]
    todo = e2e.cells(config)
    for index, (run, model, preset, layout) in enumerate(todo, start=1):
        missing = [(d, v) for d, v in e2e.run_order(config, run)
                   if (run, model, preset, layout, d, v) not in done]
        if not missing:
            continue
        cell = {"pass": run, "model": model, "preset": preset, "layout": layout,
                "runs": missing, "warmup": config["warmup"],
                "iterations": config["iterations"], "results": os.path.abspath(results),
                "training_flags": config["training_flags"],
                "variant_flags": {v["name"]: v["flags"] for v in config["variants"]},
                "micro_batches": config["micro_batches"],
                "tune_dir": os.path.abspath(os.path.join(args.output, "tuning"))}
        name = f"pass{run}_{model}_{preset}_{layout.replace(',', '')}"
        log = os.path.join(args.output, "logs", f"{name}.log")
        command = [sys.executable, os.path.join(REPO, "tools/bench_e2e.py"), "--config",
                   args.config, "--worker", json.dumps(cell)]
        if preset == e2e.LOOPBACK:
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                       str(world_size), "--master-addr", "127.0.0.1", "--master-port",
                       str(_free_port())] + command[1:]
        else:
            command = [sys.executable, os.path.join(REPO, "tools/emulate_cluster.py"),
                       "--nnodes", str(config["nodes"]), "--nproc-per-node",
                       str(config["ranks_per_node"]), "--preset", preset, "--timeout",
                       str(args.timeout), "--"] + command
        start = time.time()
        print(f"[{time.strftime('%H:%M:%S')}] {index}/{len(todo)} {name}: "
              f"{', '.join(d + (f' [{v}]' if v else '') for d, v in missing)}", flush=True)
        with open(log, "a") as out:
            status = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                    env=dict(os.environ, OMP_NUM_THREADS="1",
                                             PYTHONWARNINGS="ignore"),
                                    timeout=args.timeout + 60).returncode
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {time.time() - start:.0f} s, exit "
              f"{status}", flush=True)
        if status != 0:
            print(f"bench_e2e: error: launch {name} failed (exit {status}); see {log}; the "
                  f"runs before it are kept in {results} (run again to resume)", file=sys.stderr)
            return False
    return True


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker(cell: dict) -> int:
    """On every rank of one launch: train the cell's model with each dispatcher under each
    variant; rank 0 appends a JSON line per run."""
    import torch

    model = e2e.MODELS[cell["model"]]
    os.makedirs(cell["tune_dir"], exist_ok=True)
    for dispatcher, variant in cell["runs"]:
        record = train(cell, model, dispatcher, variant)
        if record is not None:
            with open(cell["results"], "a") as f:
                f.write(json.dumps(record) + "\n")
        torch.distributed.barrier()
    return 0


def train(cell: dict, model, dispatcher: str, variant: str):
    """One run of the cell's model: the record on rank 0, None on the others."""
    import torch

    from megatron_parm.training import mixed_precision
    from megatron_parm.training.arguments import parse_args
    from megatron_parm.training.trainer import describe_choice, pretrain

    world_size = int(os.environ["WORLD_SIZE"])
    suffix = f"_{variant}" if variant else ""
    timing_file = f"{cell['results']}.{cell['model']}.{dispatcher}{suffix}.tmp"
    flags = cell["training_flags"] + cell["variant_flags"][variant] + [
        "--moe-token-dispatcher-type", dispatcher, "--parm-timing-file", timing_file]
    train_iters = cell["warmup"] + cell["iterations"]
    if dispatcher == e2e.AUTO:
        # a file per variant: a variant without a choice yet (the combined 1F1B's is cached
        # under a key of its own) gets the room for its tuning iterations
        cache = os.path.join(cell["tune_dir"], f"{cell['model']}_{cell['preset']}_"
                             f"{cell['layout'].replace(',', '')}{suffix}.json")
        flags += ["--parm-tune-cache", cache]
        if not os.path.isfile(cache):  # room for the tuning iterations, left out later
            from megatron_parm import tuning

            calls = tuning.most_calls(tuning.DEFAULT_MAX_CANDIDATES, tuning.DEFAULT_STEPS)
            train_iters += -(-calls // cell["micro_batches"])  # a call per micro-batch
    if int(os.environ.get("RANK", "0")) == 0 and os.path.exists(timing_file):
        os.remove(timing_file)  # left by a launch that was stopped
    args = parse_args(e2e.model_flags(model, cell["layout"], world_size, train_iters,
                                      cell["micro_batches"]) + flags,
                      model_type=model.model_type)
    summary = pretrain(args)
    if torch.distributed.get_rank() != 0:
        return None
    with open(timing_file) as f:
        iterations = [json.loads(line) for line in f]
    os.remove(timing_file)
    keys = ("iteration", "step_ms", "ms", "slowest_rank_step_ms", "tuning", "comm_stream",
            "host_cpu_busy", "net_tx_bytes")
    return {"pass": cell["pass"], "model": cell["model"], "preset": cell["preset"],
            "layout": cell["layout"], "dispatcher": dispatcher, "variant": variant,
            "world_size": world_size, "training_flags": cell["training_flags"],
            "variant_flags": cell["variant_flags"][variant],
            "micro_batches": cell["micro_batches"], "dtype": mixed_precision.dtype_name(args),
            "tokens_per_iteration": args.global_batch_size * args.seq_length,
            "losses": summary["losses"],
            # the schedules parm chose (rank 0's layers), without the reasons
            "choices": sorted({describe_choice(c).split(" ")[0] for c in
                               summary.get("dispatcher_choices") or [] if c}),
            "iterations": [{k: it[k] for k in keys if k in it} for it in iterations],
            "load": list(os.getloadavg()), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


if __name__ == "__main__":
    cli.run(main)
