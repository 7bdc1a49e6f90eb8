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
plus the short aliases tp, ep, etp, nodes, ranks_per_node. Command-line flags override it.
--parm-profile takes a path or the name of a shipped profile (megatron_parm/perf_model/profiles/).
"""

import argparse
import json
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from megatron_parm import cli  # noqa: E402

cli.setup_warnings()  # before Megatron-Core is imported

from megatron_parm import schedules  # noqa: E402
from megatron_parm.perf_model import (LayerShape, Layout, choose_schedule, schedule_label,  # noqa: E402
                                      comm_volumes, load_profile, modelled_dispatchers, predict)

# config key -> (flag, type); the flag names are Megatron-LM's
_INT_OPTIONS = {
    "num_layers": "--num-layers",
    "hidden_size": "--hidden-size",
    "ffn_hidden_size": "--ffn-hidden-size",
    "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
    "num_experts": "--num-experts",
    "moe_router_topk": "--moe-router-topk",
    "seq_length": "--seq-length",
    "micro_batch_size": "--micro-batch-size",
    "tensor_model_parallel_size": "--tensor-model-parallel-size",
    "expert_model_parallel_size": "--expert-model-parallel-size",
    "expert_tensor_parallel_size": "--expert-tensor-parallel-size",
    "nnodes": "--nnodes",
    "nproc_per_node": "--nproc-per-node",
    "moe_layer_freq": "--moe-layer-freq",
}
_FLOAT_OPTIONS = {"moe_expert_capacity_factor": "--moe-expert-capacity-factor"}
_BOOL_OPTIONS = {
    "sequence_parallel": "--sequence-parallel",
    "moe_pad_expert_input_to_capacity": "--moe-pad-expert-input-to-capacity",
    "bf16": "--bf16",
    "fp16": "--fp16",
    "swiglu": "--swiglu",
}
_ALIASES = {
    "tp": "tensor_model_parallel_size",
    "ep": "expert_model_parallel_size",
    "etp": "expert_tensor_parallel_size",
    "nodes": "nnodes",
    "ranks_per_node": "nproc_per_node",
}
_DEFAULTS = {
    "num_layers": 1, "tensor_model_parallel_size": 1, "expert_model_parallel_size": 1,
    "expert_tensor_parallel_size": None, "nnodes": 1, "nproc_per_node": None,
    "micro_batch_size": 1, "moe_router_topk": 2, "moe_layer_freq": 1,
    "moe_expert_capacity_factor": None, "sequence_parallel": False,
    "moe_pad_expert_input_to_capacity": False, "bf16": False, "fp16": False, "swiglu": False,
    "ffn_hidden_size": None, "moe_ffn_hidden_size": None,
}
_REQUIRED = ("hidden_size", "num_experts", "seq_length")


def _flag_of(key):
    for table in (_INT_OPTIONS, _FLOAT_OPTIONS, _BOOL_OPTIONS):
        if key in table:
            return table[key]
    return key


def build_parser():
    parser = argparse.ArgumentParser(
        description="Predict per-MoE-layer times of every modelled dispatcher (ds_baseline, "
                    "alltoall, parm_s1, parm_s2(c), ...) and the schedule the automatic Parm "
                    "dispatcher would pick.")
    parser.add_argument("--config", help="model config (YAML or JSON, Megatron names)")
    parser.add_argument("--parm-profile", required=True,
                        help="cluster profile: a path or the name of a shipped profile")
    parser.add_argument("--parm-chunk-candidates", default=None,
                        help="comma-separated chunk counts to consider for the chunked schedules, "
                             "forward and backward (every pair) "
                             "(default: each one's own, "
                             + "; ".join(f"{s.name} {','.join(map(str, s.chunk_candidates))}"
                                         for s in schedules.candidates() if s.chunked) + ")")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    for key, flag in _INT_OPTIONS.items():
        parser.add_argument(flag, dest=key, type=int, default=None)
    for key, flag in _FLOAT_OPTIONS.items():
        parser.add_argument(flag, dest=key, type=float, default=None)
    for key, flag in _BOOL_OPTIONS.items():
        parser.add_argument(flag, dest=key, action="store_true", default=None)
    parser.add_argument("--no-sequence-parallel", dest="sequence_parallel",
                        action="store_false")
    return parser


def read_config_file(path):
    """The mapping of a --config file (YAML, or JSON by its suffix); ValueError naming it."""
    try:
        with open(path, "r", encoding="utf-8") as handle:
            text = handle.read()
    except OSError as error:
        raise ValueError(f"--config {path}: cannot read: {error.strerror}") from error
    try:
        if path.lower().endswith(".json"):
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as error:  # json.JSONDecodeError or yaml.YAMLError (imported lazily)
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"--config {path}: not valid YAML/JSON: {first_line}") from error
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of Megatron argument names")
    return data


def _read_config(path):
    data = read_config_file(path)
    settings, ignored = {}, []
    for key, value in data.items():
        key = _ALIASES.get(key, key.replace("-", "_"))
        if key in _INT_OPTIONS or key in _FLOAT_OPTIONS or key in _BOOL_OPTIONS:
            settings[key] = value
        else:
            ignored.append(key)
    if ignored:
        print(f"note: --config {path}: not used by the planner: {', '.join(sorted(ignored))}",
              file=sys.stderr)
    return settings


def resolve_settings(args):
    """Defaults < config file < flags; every value checked, errors name the flag."""
    settings = dict(_DEFAULTS)
    if args.config:
        settings.update(_read_config(args.config))
    for key in list(_INT_OPTIONS) + list(_FLOAT_OPTIONS) + list(_BOOL_OPTIONS):
        value = getattr(args, key)
        if value is not None:
            settings[key] = value
    for key in _REQUIRED:
        if settings.get(key) is None:
            raise ValueError(f"{_flag_of(key)} is required (flag or config key {key})")
    for key in _INT_OPTIONS:
        value = settings.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{_flag_of(key)} must be a positive integer, got {value!r}")
    factor = settings["moe_expert_capacity_factor"]
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                               or factor <= 0):
        raise ValueError(f"--moe-expert-capacity-factor must be positive, got {factor!r}")
    for key in _BOOL_OPTIONS:
        if not isinstance(settings[key], bool):
            raise ValueError(f"{_flag_of(key)} must be true or false, got {settings[key]!r}")
    if settings["bf16"] and settings["fp16"]:
        raise ValueError("--bf16 and --fp16 are mutually exclusive")
    return settings


def build_model(settings):
    tp = settings["tensor_model_parallel_size"]
    ep = settings["expert_model_parallel_size"]
    etp = settings["expert_tensor_parallel_size"] or tp  # Megatron's default: ETP = TP
    nodes = settings["nnodes"]
    ranks_per_node = settings["nproc_per_node"]
    if ranks_per_node is None:
        raise ValueError("--nproc-per-node is required (flag or config key nproc_per_node)")
    ffn = settings["moe_ffn_hidden_size"] or settings["ffn_hidden_size"]
    if ffn is None:
        raise ValueError("--moe-ffn-hidden-size (or --ffn-hidden-size) is required")
    tokens = settings["seq_length"] * settings["micro_batch_size"]
    if tokens % tp != 0:
        raise ValueError(
            f"--seq-length * --micro-batch-size = {tokens} is not divisible by "
            f"--tensor-model-parallel-size {tp}")
    world = nodes * ranks_per_node
    if world % tp != 0:
        raise ValueError(f"--tensor-model-parallel-size {tp} does not divide the world size "
                         f"{world} (--nnodes * --nproc-per-node)")
    if world % (ep * etp) != 0:
        raise ValueError(
            f"--expert-model-parallel-size * --expert-tensor-parallel-size = {ep * etp} does "
            f"not divide the world size {world} (--nnodes * --nproc-per-node)")
    if settings["num_experts"] % ep != 0:
        raise ValueError(f"--num-experts {settings['num_experts']} is not divisible by "
                         f"--expert-model-parallel-size {ep}")
    if settings["moe_router_topk"] > settings["num_experts"]:
        raise ValueError(f"--moe-router-topk {settings['moe_router_topk']} exceeds "
                         f"--num-experts {settings['num_experts']}")
    if settings["moe_pad_expert_input_to_capacity"] and \
            settings["moe_expert_capacity_factor"] is None:
        raise ValueError("--moe-pad-expert-input-to-capacity needs "
                         "--moe-expert-capacity-factor")
    layout = Layout(tp=tp, ep=ep, etp=etp, nodes=nodes, ranks_per_node=ranks_per_node)
    shape = LayerShape(
        num_tokens=tokens // tp,
        hidden_size=settings["hidden_size"],
        ffn_hidden_size=ffn,
        num_experts=settings["num_experts"],
        topk=settings["moe_router_topk"],
        capacity_factor=settings["moe_expert_capacity_factor"],
        pad_to_capacity=settings["moe_pad_expert_input_to_capacity"],
        dtype_bytes=2 if (settings["bf16"] or settings["fp16"]) else 4,
        gated_linear_unit=settings["swiglu"],
    )
    num_moe_layers = -(-settings["num_layers"] // settings["moe_layer_freq"])
    return layout, shape, num_moe_layers


def parse_chunks(text):
    if text is None:
        return None
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise ValueError(f"--parm-chunk-candidates must be comma-separated integers, "
                         f"got {text!r}") from error
    if not counts or any(count < 2 for count in counts):
        raise ValueError(f"--parm-chunk-candidates must be integers >= 2, got {text!r}")
    return tuple(counts)


def _mib(num_bytes):
    return num_bytes / 2 ** 20


def references(shape, layout, profile, sequence_parallel):
    """Predictions of the modelled dispatchers parm does not choose from (ds_baseline,
    Megatron's alltoall), where they support the layout: what the choice is compared to."""
    out = {}
    for name in modelled_dispatchers():
        schedule = schedules.get(name)
        if schedule.candidate or schedule.unsupported(layout.tp, layout.ep, layout.etp,
                                                      sequence_parallel):
            continue
        out[name] = predict(name, shape, layout, profile, None, sequence_parallel)
    return out


def render(layout, shape, num_moe_layers, profile, choice, others, sequence_parallel):
    def ms(seconds):
        return f"{seconds * 1e3:10.3f}"

    lines = []
    routing = ("dropless" if shape.capacity_factor is None else
               f"capacity factor {shape.capacity_factor}"
               + (", padded" if shape.pad_to_capacity else ""))
    lines.append(
        f"MoE layer: n={shape.num_tokens} tokens/rank (N={layout.tp * shape.num_tokens}), "
        f"hidden {shape.hidden_size}, expert FFN {shape.ffn_hidden_size}, "
        f"{shape.num_experts} experts, top-{shape.topk}, {routing}, "
        f"{shape.dtype_bytes}-byte activations, sequence parallel {sequence_parallel}")
    placement = ", ".join(
        f"{name} {'intra' if layout.is_intra(group) else 'inter'}-node"
        for name, group in (("TP", "tp"), ("EP", "ep"), ("ETP", "expt_tp"))
        if layout.group_size(group) > 1)
    lines.append(
        f"layout: tp={layout.tp} ep={layout.ep} etp={layout.etp} on {layout.nodes} node(s) x "
        f"{layout.ranks_per_node} ranks" + (f"; {placement}" if placement else ""))
    lines.append(f"profile: {profile.name} ({profile.provenance}) from {profile.source}")
    lines.append("")
    header = (f"{'schedule':<16}{'fwd ms':>10}{'bwd ms':>10}{'total ms':>10}"
              f"{'inter MiB':>11}{'intra MiB':>11}{'speedup':>9}")
    lines.append(header)
    lines.append("-" * len(header))
    rows = list(others.items()) + [(schedule_label(key), p) for key, p in choice.predictions.items()]
    # Speedups are over the first reference (ds_baseline where it supports the layout).
    base_name, baseline = next(iter(others.items()), (None, None))
    for label, prediction in rows:
        volumes = comm_volumes(prediction.dispatcher, shape, layout, sequence_parallel)
        inter = sum(entry["inter"] for entry in volumes.values())
        intra = sum(entry["intra"] for entry in volumes.values())
        speedup = baseline.total_s / prediction.total_s if baseline and prediction.total_s else float("nan")
        marker = "  <- choice" if prediction is choice.predictions[choice.schedule] else ""
        lines.append(f"{label:<16}{ms(prediction.forward_s)}{ms(prediction.backward_s)}"
                     f"{ms(prediction.total_s)}{_mib(inter):11.2f}{_mib(intra):11.2f}"
                     f"{speedup:8.2f}x{marker}")
    lines.append("")
    chosen = choice.predictions[choice.schedule]
    label = (choice.schedule if isinstance(choice.schedule, str)
             else f"{choice.dispatcher} with {choice.num_chunks} chunks"
             + ("" if choice.bwd_num_chunks == choice.num_chunks
                else f" forward, {choice.bwd_num_chunks} backward"))
    lines.append(f"choice: {label}" + (f"  (speedups over {base_name})" if base_name else ""))
    per_step = [f"{name} {p.total_s * num_moe_layers * 1e3:.1f} ms" for name, p in others.items()]
    lines.append(
        f"per step ({num_moe_layers} MoE layer(s), forward + backward): "
        + ", ".join(per_step + [f"choice {chosen.total_s * num_moe_layers * 1e3:.1f} ms"]))
    if profile.provenance != "measured":
        lines.append("note: the profile is an estimate; calibrate it on the cluster to trust "
                     "these numbers")
    return "\n".join(lines)


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = resolve_settings(args)
        layout, shape, num_moe_layers = build_model(settings)
        try:
            profile = load_profile(args.parm_profile, require_terms=True)
        except ValueError as error:
            raise ValueError(f"--parm-profile: {error}") from error
        chunks = parse_chunks(args.parm_chunk_candidates)
        sequence_parallel = settings["sequence_parallel"] or layout.tp == 1
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
