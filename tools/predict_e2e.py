#!/usr/bin/env python
"""The performance model's view of the end-to-end speedup: parm over alltoall and
ds_baseline for whole training steps of the shipped GPT-2-small-MoE, GPT-2-medium-MoE and
BERT-base-MoE configs on a real cluster, with the term that limits parm's step.

    python tools/predict_e2e.py                         # the table (Markdown) on stdout
    python tools/predict_e2e.py --update docs/benchmark.md   # replace the table there

Pure Python, no cluster: tools/plan_layout.py's planner (megatron_parm.perf_model) ranks every
layout and schedule on --nnodes x --nproc-per-node ranks of --parm-profile in bf16 with the
config's batch sizes; a row takes each dispatcher's fastest candidate that fits in
--gpu-memory-gb (parm: the best Parm schedule, S1, S2 at any chunk count or parm_hier, as
parm's model would choose), over every layout, with the experts spread over 8 ranks
(--expert-model-parallel-size 8), and in Parm's setting (TP = ETP = 4 inside a node, EP across
the nodes). The
limiting term is the largest part of parm's predicted step: the MoE layers (named by their
busiest resource: the inter-node link, the intra-node link or the experts' compute), the dense
GEMMs, TP collectives, the framework terms, the pipeline (sends and bubble) or the gradient
reduction. --update rewrites the lines between the markers
<!-- predict_e2e: begin --> and <!-- predict_e2e: end --> of a Markdown file.
"""

import argparse
import contextlib
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_parm import cli  # noqa: E402

cli.setup_warnings()

from megatron_parm import planner_inputs  # noqa: E402
from megatron_parm.perf_model import load_profile  # noqa: E402
from megatron_parm.perf_model.memory import GIB, Precision  # noqa: E402
from megatron_parm.perf_model.planner import Cluster, PlanError, plan  # noqa: E402

MODELS = (("GPT-2-small-MoE", "configs/gpt2_small_moe.yaml", "gpt"),
          ("GPT-2-medium-MoE", "configs/gpt2_medium_moe.yaml", "gpt"),
          ("BERT-base-MoE", "configs/bert_base_moe.yaml", "bert"))
FAMILIES = {"alltoall": ("alltoall",), "ds_baseline": ("ds_baseline",),
            "parm": ("parm_s1", "parm_s2", "parm_hier")}
SPREAD_EP = 8  # the experts over 8 ranks: the second row of each model and size


PARM_TP = 4  # Parm's setting: TP = ETP inside a node (4 divides the configs' 12 and 16 heads)


def restrictions(nodes: int, ranks_per_node: int):
    """(label, fixed layout sizes) of the rows of one model and cluster size: every layout;
    the experts over 8 ranks; Parm's setting (TP = ETP = 4 inside a node, EP over the
    TP groups of every node, at most 8)."""
    ep = min(SPREAD_EP, nodes * ranks_per_node // PARM_TP)
    return (("any layout", None), (f"EP {SPREAD_EP}", {"ep": SPREAD_EP}),
            (f"TP=ETP {PARM_TP}, EP {ep}", {"tp": PARM_TP, "etp": PARM_TP, "ep": ep}))
BEGIN, END = "<!-- predict_e2e: begin -->", "<!-- predict_e2e: end -->"
RESOURCES = {"inter": "MoE: inter-node link", "intra": "MoE: intra-node link",
             "compute": "MoE: expert compute"}


def build_parser():
    parser = argparse.ArgumentParser(prog="predict_e2e.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parm-profile", default="nvlink_ib_estimate",
                        help="profile of the cluster (default %(default)s)")
    parser.add_argument("--nnodes", default="2,4",
                        help="node counts, comma-separated (default %(default)s)")
    parser.add_argument("--nproc-per-node", type=int, default=8)
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0)
    parser.add_argument("--update", default=None, metavar="MARKDOWN",
                        help="replace the table between the markers of this file")
    return parser


def best(candidates, family):
    """(the fastest fitting candidate of a dispatcher family, the family's schedule it
    stands for: a candidate stands for the dispatchers predicted exactly as fast on its
    layout too), or None."""
    names = FAMILIES[family]
    for candidate in candidates:  # ranked: fitting ones first, fastest first
        if not candidate.fits:
            continue
        for name in (candidate.dispatcher, *candidate.equivalents):
            if name in names:
                return candidate, name
    return None


def limiting_term(step) -> str:
    """The largest part of a predicted step, with its share."""
    m = step.num_microbatches
    parts = {"MoE": m * step.moe_s, "dense GEMMs": m * step.dense_compute_s,
             "TP collectives": m * step.tp_comm_s, "framework": m * step.framework_s,
             "pipeline (sends, bubble)": m * step.p2p_s + step.bubble_s,
             "gradient reduction": step.grad_reduce_s}
    name = max(parts, key=parts.get)
    if name == "MoE":
        layer = step.moe_layer
        busy = {}
        for direction, resources in layer.resources.items():
            for resource, seconds in resources.items():
                busy[resource] = busy.get(resource, 0.0) + seconds * layer.chunks(direction)
        name = RESOURCES.get(max(busy, key=busy.get), "MoE")
    return f"{name} ({100 * max(parts.values()) / step.step_s:.0f}%)"


def layout_text(candidate) -> str:
    tp, ep, etp, pp = (candidate.layout.tp, candidate.layout.ep, candidate.layout.etp,
                       candidate.layout.pp)
    return (f"({tp},{ep},{etp})" + (f" pp{pp}" if pp > 1 else "")
            + (f" vpp{candidate.vpp}" if candidate.vpp else ""))


def schedule_text(candidate, name) -> str:
    if name != candidate.dispatcher:  # predicted as fast as the candidate's own dispatcher
        return f"{name} (= {candidate.dispatcher})"
    return name + (f"@{candidate.num_chunks}" if candidate.num_chunks else "")


def rows(args):
    profile = load_profile(args.parm_profile, require_terms=True)
    lines = []
    for name, config, model_type in MODELS:
        for nodes in [int(n) for n in args.nnodes.split(",")]:
            argv = ["--config", config, "--model-type", model_type, "--nnodes", str(nodes),
                    "--nproc-per-node", str(args.nproc_per_node), "--bf16",
                    "--parm-profile", args.parm_profile]
            with contextlib.redirect_stderr(io.StringIO()):  # its note on the config's keys
                _, settings, _ = planner_inputs.resolve_settings(planner_inputs.build_parser(),
                                                                 argv)
            spec = planner_inputs.build_spec(settings, model_type)
            cluster = Cluster(nodes, args.nproc_per_node, args.gpu_memory_gb * GIB)
            for label, fixed in restrictions(nodes, args.nproc_per_node):
                first = f"| {name} | {nodes} x {args.nproc_per_node} | {label} | "
                try:
                    result = plan(spec, cluster, profile, settings["micro_batch_size"],
                                  settings["global_batch_size"], Precision("bf16"),
                                  fixed=fixed)
                except PlanError as error:
                    lines.append(first + f"{' '.join(str(error).split())} | | | | | |")
                    continue
                picks = {family: best(result.candidates, family) for family in FAMILIES}
                lines.append(first + _cells(picks))
    return lines


def _cells(picks) -> str:
    """The cells after the model, cluster and restriction of one row."""
    def pick(chosen):
        if chosen is None:
            return "none fits"
        candidate, name = chosen
        return (f"{layout_text(candidate)} {schedule_text(candidate, name)}: "
                f"{candidate.step.tokens_per_s / 1e3:,.0f}k")

    parm = picks["parm"][0] if picks["parm"] else None

    def ratio(family):
        if parm is None or picks[family] is None:
            return "-"
        return f"{parm.step.tokens_per_s / picks[family][0].step.tokens_per_s:.2f}x"
    return (f"{pick(picks['alltoall'])} | {pick(picks['ds_baseline'])} | {pick(picks['parm'])} "
            f"| {ratio('alltoall')} | {ratio('ds_baseline')} | "
            f"{limiting_term(parm.step) if parm else '-'} |")


def table(args) -> str:
    profile = load_profile(args.parm_profile, require_terms=True)
    header = [f"Predicted by `.venv/bin/python tools/predict_e2e.py` (profile {profile.name}: "
              f"{profile.provenance}; bf16, {args.gpu_memory_gb:g} GiB per GPU, each config's "
              f"micro- and global batch; tokens/s of the whole step, each dispatcher at its "
              f"fastest fitting layout; layout (tp,ep,etp), with ppN vppV where pipelined and "
              f"interleaved):", "",
              "| model | nodes x GPUs | experts | alltoall | ds_baseline | parm (best Parm "
              "schedule) | parm / alltoall | parm / ds_baseline | limits parm's step |",
              "|---|---|---|---|---|---|---:|---:|---|"]
    return "\n".join(header + rows(args)) + "\n"


def update(path: str, text: str) -> None:
    if not os.path.isfile(path):
        raise ValueError(f"--update: file not found: {path}")
    with open(path) as f:
        content = f.read()
    if content.count(BEGIN) != 1 or content.count(END) != 1 \
            or content.index(BEGIN) > content.index(END):
        raise ValueError(f"--update: {path} needs one '{BEGIN}' line and one '{END}' line "
                         f"after it")
    start = content.index(BEGIN) + len(BEGIN)
    with open(path, "w") as f:
        f.write(content[:start] + "\n" + text + content[content.index(END):])


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        load_profile(args.parm_profile, require_terms=True)
    except ValueError as error:
        raise ValueError(f"--parm-profile: {error}") from None
    if not all(n.strip().isdigit() and int(n) > 0 for n in args.nnodes.split(",")):
        raise ValueError(f"--nnodes must be positive integers separated by commas, got "
                         f"{args.nnodes!r}")
    text = table(args)
    if args.update:
        update(args.update, text)
        print(f"predict_e2e: table updated in {args.update}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    cli.run(main)
