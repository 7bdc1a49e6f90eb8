#!/usr/bin/env python
"""The performance model's view of the end-to-end speedup: Parm's schedules over Megatron's
dispatchers (and ds_baseline) for whole training steps of the shipped configs on real
clusters, with the term that limits the Parm step.

    python tools/predict_e2e.py                              # both tables (Markdown) on stdout
    python tools/predict_e2e.py --update docs/benchmark.md   # replace both tables there
    python tools/predict_e2e.py --table clusters --models Qwen3-30B-A3B --clusters h100_roce \
        --nnodes 4                                           # some rows of one table

Pure Python, no cluster: tools/plan_layout.py's planner (megatron_parm.perf_model) ranks every
layout and schedule on the nodes x 8 GPUs of a cluster kind's profile in bf16 with the
config's batch sizes and optimizer; a row takes each dispatcher's fastest candidate that fits
in the kind's GPU memory. Two tables:

  dgx       GPT-2-small/medium-MoE and BERT-base-MoE on nvlink_ib_estimate (2 and 4 nodes of
            8 GPUs with 80 GiB): alltoall, ds_baseline and the best Parm schedule (S1, S2 at
            any chunk count, parm_hier or parm_hier_s2, as parm's model would choose), over
            every layout, with the experts over 8 ranks (--expert-model-parallel-size 8), and
            in Parm's setting (TP = ETP = 4 inside a node, EP across the nodes);
  clusters  the modern real-size configs (Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V2-Lite) and
            GPT-2/BERT on 2, 4 and 16 nodes of each cluster kind (CLUSTERS: 8 H100 per node
            with 2 x 200 Gbit/s RoCE, 8 L40S-class PCIe GPUs per node with 100 Gbit/s
            Ethernet; each profile's numbers name their sources): alltoall, allgather and the
            best Parm schedule, over every layout and over the layouts whose EP group spans
            nodes, with the best Parm schedule over the faster of Megatron's two.

The limiting term is the largest part of the Parm step: the MoE layers (named by their
busiest resource: the inter-node link, the intra-node link or the experts' compute), the dense
GEMMs, TP collectives, the framework terms, the pipeline (sends and bubble) or the gradient
reduction. --update rewrites the lines between the markers <!-- predict_e2e: begin --> and
<!-- predict_e2e: end --> (dgx) and <!-- predict_e2e clusters: begin --> and
<!-- predict_e2e clusters: end --> (clusters) of a Markdown file.
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

# (name, config, model type, flags the config needs beside it: the vocabulary where the
# config names tokenizer files this repository does not ship)
GPT_BERT = (("GPT-2-small-MoE", "configs/gpt2_small_moe.yaml", "gpt", ()),
            ("GPT-2-medium-MoE", "configs/gpt2_medium_moe.yaml", "gpt", ()),
            ("BERT-base-MoE", "configs/bert_base_moe.yaml", "bert", ()))
MODERN = (("Mixtral-8x7B", "configs/mixtral_8x7b.yaml", "gpt", ("--vocab-size", "32000")),
          ("Qwen3-30B-A3B", "configs/qwen3_30b_a3b.yaml", "gpt", ("--vocab-size", "151936")),
          ("DeepSeek-V2-Lite", "configs/deepseek_v2_lite.yaml", "gpt", ("--vocab-size", "102400")))
MODELS = MODERN + GPT_BERT
PARM = ("parm_s1", "parm_s2", "parm_hier", "parm_hier_s2")  # Parm's schedules
FAMILIES = {"alltoall": ("alltoall",), "allgather": ("allgather",),
            "ds_baseline": ("ds_baseline",), "parm": PARM}
GPUS_PER_NODE = 8
# cluster kind -> (what it is, its profile, GPU memory in GiB)
CLUSTERS = {
    "dgx_ib": ("8 H100-class GPUs per node (NVLink), one 400 Gbit/s IB NIC per GPU",
               "nvlink_ib_estimate", 80.0),
    "h100_roce": ("8 H100 SXM per node (NVLink), 2 x 200 Gbit/s RoCE per node",
                  "h100_roce_estimate", 80.0),
    "l40s_ethernet": ("8 L40S-class PCIe GPUs per node, 100 Gbit/s Ethernet per node",
                      "l40s_ethernet_estimate", 48.0),
}
TABLES = {"dgx": dict(models=GPT_BERT, clusters=("dgx_ib",), nnodes=(2, 4)),
          "clusters": dict(models=MODELS, clusters=("h100_roce", "l40s_ethernet"),
                           nnodes=(2, 4, 16))}
SPREAD_EP = 8  # the experts over 8 ranks: the second row of each model and size
PARM_TP = 4  # Parm's setting: TP = ETP inside a node (4 divides the configs' 12 and 16 heads)
MARKERS = {"dgx": ("<!-- predict_e2e: begin -->", "<!-- predict_e2e: end -->"),
           "clusters": ("<!-- predict_e2e clusters: begin -->",
                        "<!-- predict_e2e clusters: end -->")}
RESOURCES = {"inter": "MoE: inter-node link", "intra": "MoE: intra-node link",
             "compute": "MoE: expert compute"}


def dgx_restrictions(nodes: int, ranks_per_node: int):
    """(label, candidate filter) of the dgx table's rows of one model and cluster size: every
    layout; the experts over 8 ranks; Parm's setting (TP = ETP = 4 inside a node, EP over the
    TP groups of every node, at most 8)."""
    ep = min(SPREAD_EP, nodes * ranks_per_node // PARM_TP)
    return (("any layout", lambda layout: True),
            (f"EP {SPREAD_EP}", lambda layout: layout.ep == SPREAD_EP),
            (f"TP=ETP {PARM_TP}, EP {ep}",
             lambda layout: (layout.tp, layout.etp, layout.ep) == (PARM_TP, PARM_TP, ep)))


def cluster_restrictions(nodes: int, ranks_per_node: int):
    """The clusters table's rows: every layout; the layouts whose EP group spans nodes."""
    return (("any layout", lambda layout: True),
            ("EP across nodes", lambda layout: layout.group_size("ep_inter") > 1))


def build_parser():
    parser = argparse.ArgumentParser(prog="predict_e2e.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", choices=sorted(TABLES), default=None,
                        help="one table (default: both)")
    parser.add_argument("--models", default=None,
                        help="models, comma-separated (default: the table's; names as in the "
                             "table's first column)")
    parser.add_argument("--clusters", default=None,
                        help=f"cluster kinds, comma-separated (default: the table's; "
                             f"{', '.join(CLUSTERS)})")
    parser.add_argument("--nnodes", default=None,
                        help="node counts, comma-separated (default: the table's)")
    parser.add_argument("--update", default=None, metavar="MARKDOWN",
                        help="replace the tables between their markers of this file")
    return parser


def best(candidates, family, keep=lambda layout: True):
    """(the fastest fitting candidate of a dispatcher family on a layout ``keep`` accepts, the
    family's schedule it stands for: a candidate stands for the dispatchers predicted exactly
    as fast on its layout too), or None."""
    names = FAMILIES[family]
    for candidate in candidates:  # ranked: fitting ones first, fastest first
        if not candidate.fits or not keep(candidate.layout):
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


def plan_model(model, kind: str, nodes: int):
    """The planner's ranked candidates of one model on `nodes` nodes of a cluster kind."""
    _, config, model_type, extra = model
    _, profile_name, memory_gb = CLUSTERS[kind]
    profile = load_profile(profile_name, require_terms=True)
    argv = [*extra, "--config", config, "--model-type", model_type, "--nnodes", str(nodes),
            "--nproc-per-node", str(GPUS_PER_NODE), "--bf16", "--parm-profile", profile_name]
    with contextlib.redirect_stderr(io.StringIO()):  # its note on the config's keys
        _, settings, _ = planner_inputs.resolve_settings(planner_inputs.build_parser(), argv)
    spec = planner_inputs.build_spec(settings, model_type)
    cluster = Cluster(nodes, GPUS_PER_NODE, memory_gb * GIB)
    return plan(spec, cluster, profile, settings["micro_batch_size"],
                settings["global_batch_size"], Precision("bf16"),
                settings["use_distributed_optimizer"]).candidates


def _pick(chosen) -> str:
    if chosen is None:
        return "none fits"
    candidate, name = chosen
    return (f"{layout_text(candidate)} {schedule_text(candidate, name)}: "
            f"{candidate.step.tokens_per_s / 1e3:,.0f}k")


def _ratio(parm, other) -> str:
    if parm is None or other is None:
        return "-"
    return f"{parm[0].step.tokens_per_s / other[0].step.tokens_per_s:.2f}x"


def dgx_row(candidates, keep) -> str:
    """The cells after the model, cluster and restriction of one dgx row."""
    picks = {family: best(candidates, family, keep) for family in FAMILIES}
    parm = picks["parm"]
    return (f"{_pick(picks['alltoall'])} | {_pick(picks['ds_baseline'])} | {_pick(parm)} "
            f"| {_ratio(parm, picks['alltoall'])} | {_ratio(parm, picks['ds_baseline'])} | "
            f"{limiting_term(parm[0].step) if parm else '-'} |")


def clusters_row(candidates, keep) -> str:
    """The cells after the model, cluster and restriction of one clusters row."""
    picks = {family: best(candidates, family, keep) for family in FAMILIES}
    parm = picks["parm"]
    megatron = [pick for pick in (picks["alltoall"], picks["allgather"]) if pick is not None]
    faster = max(megatron, key=lambda pick: pick[0].step.tokens_per_s) if megatron else None
    return (f"{_pick(picks['alltoall'])} | {_pick(picks['allgather'])} | {_pick(parm)} | "
            f"{_ratio(parm, faster)} | {limiting_term(parm[0].step) if parm else '-'} |")


HEADERS = {
    "dgx": ["| model | nodes x GPUs | experts | alltoall | ds_baseline | parm (best Parm "
            "schedule) | parm / alltoall | parm / ds_baseline | limits parm's step |",
            "|---|---|---|---|---|---|---:|---:|---|"],
    "clusters": ["| model | cluster | nodes x GPUs | layouts | alltoall | allgather | best "
                 "Parm schedule | Parm / faster of alltoall, allgather | limits the Parm "
                 "step |", "|---|---|---|---|---|---|---|---:|---|"],
}


def rows(table: str, models, kinds, node_counts):
    lines = []
    restrictions = dgx_restrictions if table == "dgx" else cluster_restrictions
    cells = dgx_row if table == "dgx" else clusters_row
    for model in models:
        for kind in kinds:
            for nodes in node_counts:
                where = f"{nodes} x {GPUS_PER_NODE}" if table == "dgx" else                     f"{kind} | {nodes} x {GPUS_PER_NODE}"
                try:
                    candidates = plan_model(model, kind, nodes)
                except PlanError as error:
                    lines.append(f"| {model[0]} | {where} | any layout | "
                                 f"{' '.join(str(error).split())} |" + " |" * (
                                     5 if table == "dgx" else 4))
                    continue
                for label, keep in restrictions(nodes, GPUS_PER_NODE):
                    lines.append(f"| {model[0]} | {where} | {label} | "
                                 + cells(candidates, keep))
    return lines


def intro(table: str, kinds) -> str:
    if table == "dgx":
        profile = load_profile(CLUSTERS["dgx_ib"][1], require_terms=True)
        return (f"Predicted by `.venv/bin/python tools/predict_e2e.py` (profile {profile.name}: "
                f"{profile.provenance}; bf16, {CLUSTERS['dgx_ib'][2]:g} GiB per GPU, each "
                f"config's micro- and global batch; tokens/s of the whole step, each "
                f"dispatcher at its fastest fitting layout; layout (tp,ep,etp), with ppN vppV "
                f"where pipelined and interleaved):")
    kinds_text = "; ".join(f"{kind}: {CLUSTERS[kind][0]}, profile {CLUSTERS[kind][1]}, "
                           f"{CLUSTERS[kind][2]:g} GiB per GPU" for kind in kinds)
    return (f"Predicted by `.venv/bin/python tools/predict_e2e.py --table clusters` ({kinds_text}; every "
            f"profile an estimate whose numbers name their sources; bf16, each config's micro- "
            f"and global batch and optimizer; tokens/s of the whole step, each dispatcher at its "
            f"fastest fitting layout, over every layout and over those whose EP group spans "
            f"nodes; layout (tp,ep,etp), with ppN vppV where pipelined and interleaved):")


def table_text(table: str, models, kinds, node_counts) -> str:
    return "\n".join([intro(table, kinds), "", *HEADERS[table],
                      *rows(table, models, kinds, node_counts)]) + "\n"


def update(path: str, texts) -> None:
    if not os.path.isfile(path):
        raise ValueError(f"--update: file not found: {path}")
    with open(path) as f:
        content = f.read()
    for table, text in texts.items():
        begin, end = MARKERS[table]
        if content.count(begin) != 1 or content.count(end) != 1 \
                or content.index(begin) > content.index(end):
            raise ValueError(f"--update: {path} needs one '{begin}' line and one '{end}' "
                             f"line after it")
        start = content.index(begin) + len(begin)
        content = content[:start] + "\n" + text + content[content.index(end):]
    with open(path, "w") as f:
        f.write(content)


def _chosen(value, known, flag):
    """The names of a comma-separated flag (None: every one of ``known``)."""
    if value is None:
        return None
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise ValueError(f"{flag}: unknown {', '.join(unknown) or 'empty list'}; expected "
                         f"some of {', '.join(known)}")
    return names


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.nnodes is not None and not all(
            n.strip().isdigit() and int(n) > 0 for n in args.nnodes.split(",")):
        raise ValueError(f"--nnodes must be positive integers separated by commas, got "
                         f"{args.nnodes!r}")
    models = _chosen(args.models, [m[0] for m in MODELS], "--models")
    kinds = _chosen(args.clusters, list(CLUSTERS), "--clusters")
    texts = {}
    for table in ([args.table] if args.table else list(TABLES)):
        own = TABLES[table]
        texts[table] = table_text(
            table, [m for m in own["models"] if models is None or m[0] in models],
            [k for k in (kinds or own["clusters"])],
            [int(n) for n in args.nnodes.split(",")] if args.nnodes else own["nnodes"])
    if args.update:
        update(args.update, texts)
        print(f"predict_e2e: {', '.join(texts)} updated in {args.update}")
    else:
        print("\n".join(texts.values()), end="")
    return 0


if __name__ == "__main__":
    cli.run(main)
