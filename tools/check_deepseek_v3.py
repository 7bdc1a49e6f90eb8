"""DeepSeek-V3's model features under every dispatcher: the tiny DeepSeek-V3-like model
(configs/deepseek_v3_tiny_moe.yaml: multi-latent attention with a query latent, one MTP layer, a
dense first layer, a shared expert, 32 experts top-8 with group-limited sigmoid routing and the
expert bias) trained on gloo ranks at each (tp, cp, ep, etp, pp) layout, with each dispatcher
(`parm` and each of its schedules forced by name), from the same seed and data.

    python tools/check_deepseek_v3.py                         # 3 layouts x 8 dispatchers, 20 its
    python tools/check_deepseek_v3.py --layouts 2,1,2,1,1 --dispatchers alltoall,parm --iters 4

Checks, per layout: every dispatcher's lm losses follow `alltoall`'s to --tolerance (fp32); at a
layout with cp > 1, `alltoall` at cp = 1 (the same ranks as data-parallel ones, the same global
batch) gives the same losses to the same tolerance. Prints one line per run and a table
(--report writes it as markdown); exit status 1 when a check fails, 2 for a bad flag.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIG = "configs/deepseek_v3_tiny_moe.yaml"
# (tp, cp, ep, etp, pp) -> ranks: tp*cp*pp*dp with ep*etp dividing tp*cp*dp (dp = 2 here)
LAYOUTS = {(2, 1, 2, 1, 1): 4, (1, 2, 2, 1, 1): 4, (1, 1, 4, 1, 2): 8}
# 3 decoder layers and the MTP layer over 2 stages
PIPELINE_LAYOUT = "Et|ttmL"
REFERENCE = "alltoall"
TOLERANCE = 1e-4
RANKS_PER_NODE = 2  # parm_hier's emulated nodes


def layout_flags(tp: int, cp: int, ep: int, etp: int, pp: int) -> List[str]:
    flags = ["--tensor-model-parallel-size", str(tp), "--context-parallel-size", str(cp),
             "--expert-model-parallel-size", str(ep), "--expert-tensor-parallel-size", str(etp),
             "--pipeline-model-parallel-size", str(pp), "--parm-ranks-per-node",
             str(RANKS_PER_NODE)]
    if tp > 1:
        flags.append("--sequence-parallel")
    if cp > 1:  # Megatron-LM's default, p2p, needs Transformer Engine
        flags += ["--cp-comm-type", "all_gather"]
    if pp > 1:
        flags += ["--pipeline-model-parallel-layout", PIPELINE_LAYOUT]
    return flags


def run_flags(iters: int) -> List[str]:
    # micro-batches of 2: at pp = 2 (dp = 4) the global batch of 16 still makes 2 of them
    return ["--config", CONFIG, "--train-iters", str(iters), "--lr-warmup-iters", "1",
            "--micro-batch-size", "2", "--log-interval", "1", "--eval-iters", "0"]


def runs_of(layout: Tuple[int, ...], dispatchers: List[str]) -> Dict[str, List[str]]:
    """name -> the flags of one run at LAYOUT: each dispatcher, and at cp > 1 alltoall at
    cp = 1 on the same ranks."""
    runs = {name: [*layout_flags(*layout), "--moe-token-dispatcher-type", name]
            for name in dispatchers}
    tp, cp, ep, etp, pp = layout
    if cp > 1:
        runs["alltoall cp=1"] = [*layout_flags(tp, 1, ep, etp, pp),
                                 "--moe-token-dispatcher-type", REFERENCE]
    return runs


def worker(out: str, iters: int, runs: Dict[str, List[str]]) -> None:
    """Each run in turn in this process (one rank of the launch); rank 0 writes the losses."""
    import torch

    from megatron_parm.training.arguments import parse_args
    from megatron_parm.training.trainer import initialize_distributed, pretrain

    initialize_distributed()
    losses = {}
    for name, flags in runs.items():
        losses[name] = pretrain(parse_args([*run_flags(iters), *flags]))["losses"]
        if torch.distributed.get_rank() == 0:
            print(f"{name}: {losses[name]}", flush=True)
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump(losses, handle)
    torch.distributed.barrier()


def launch(layout: Tuple[int, ...], ranks: int, dispatchers: List[str], iters: int,
           timeout: int) -> Dict[str, List[float]]:
    """One torchrun launch of the runs at LAYOUT: {run: lm losses}."""
    out = os.path.join(tempfile.mkdtemp(prefix="check_deepseek_v3"), "losses.json")
    spec = json.dumps(runs_of(layout, dispatchers))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(ranks), "tools/check_deepseek_v3.py", "--worker", out, "--iters", str(iters),
           "--runs", spec]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=timeout)
    if proc.returncode != 0 or not os.path.isfile(out):
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        first = next((line for line in lines if "Error: " in line), (lines or ["no output"])[-1])
        raise RuntimeError(f"the launch at {layout} failed (exit {proc.returncode}): {first}")
    with open(out) as handle:
        return json.load(handle)


def worst_gap(losses: List[float], reference: List[float]) -> float:
    if len(losses) != len(reference) or not losses:
        return float("inf")
    return max(abs(a - b) for a, b in zip(losses, reference))


def rows_of(layout: Tuple[int, ...], losses: Dict[str, List[float]],
            tolerance: float) -> List[dict]:
    """One row per run: its worst gap to its reference (alltoall at the layout; for the cp = 1
    run, alltoall at cp > 1) and whether it is within TOLERANCE."""
    rows = []
    for name, values in losses.items():
        if name == REFERENCE:
            continue
        gap = worst_gap(values, losses[REFERENCE])
        rows.append({"layout": ",".join(map(str, layout)), "run": name, "iterations":
                     len(values), "first": values[0] if values else None,
                     "last": values[-1] if values else None, "worst_gap": gap,
                     "ok": gap <= tolerance})
    return rows


def table(rows: List[dict], tolerance: float) -> str:
    lines = [f"| (tp, cp, ep, etp, pp) | run | iterations | lm loss first -> last | worst "
             f"gap to alltoall | within {tolerance:g} |", "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| ({row['layout']}) | {row['run']} | {row['iterations']} | "
                     f"{row['first']:.6f} -> {row['last']:.6f} | {row['worst_gap']:.2e} | "
                     f"{'yes' if row['ok'] else 'NO'} |")
    return "\n".join(lines)


def _layout(text: str) -> Tuple[int, ...]:
    values = tuple(int(v) for v in text.split(","))
    if values not in LAYOUTS:
        raise argparse.ArgumentTypeError(
            f"{text} is not one of {', '.join(','.join(map(str, k)) for k in LAYOUTS)}")
    return values


def main(argv=None) -> int:
    from megatron_parm import cli, schedules

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=";".join(",".join(map(str, k)) for k in LAYOUTS),
                        help="';'-separated (tp,cp,ep,etp,pp) layouts, from the default")
    parser.add_argument("--dispatchers", default=",".join(schedules.names()),
                        help="comma-separated dispatchers (alltoall is always run)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tolerance", type=float, default=TOLERANCE)
    parser.add_argument("--report", help="write the table here as markdown")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per launch")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--runs", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.iters, json.loads(args.runs))
        return 0
    try:
        layouts = [_layout(text) for text in args.layouts.split(";")]
    except argparse.ArgumentTypeError as err:
        parser.error(f"--layouts: {err}")
    dispatchers = [name.strip() for name in args.dispatchers.split(",") if name.strip()]
    unknown = [name for name in dispatchers if name not in schedules.names()]
    if unknown:
        parser.error(f"--dispatchers: unknown dispatcher {unknown[0]!r} (known: "
                     f"{', '.join(schedules.names())})")
    dispatchers = [REFERENCE] + [name for name in dispatchers if name != REFERENCE]
    cli.setup_warnings()
    rows = []
    for layout in layouts:
        losses = launch(layout, LAYOUTS[layout], dispatchers, args.iters, args.timeout)
        rows += rows_of(layout, losses, args.tolerance)
    text = table(rows, args.tolerance)
    print(text)
    if args.report:
        with open(args.report, "w") as handle:
            handle.write(text + "\n")
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    from megatron_parm import cli

    cli.run(main)  # a mistake in the arguments: one error line, status 2
