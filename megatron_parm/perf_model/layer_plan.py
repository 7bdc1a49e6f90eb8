"""One MoE layer of a model on a cluster: its layout and shape from the flags' values, and the
report of what every modelled dispatcher would take there (tools/plan_schedule.py prints it;
tools/bench_report.py asks for the layer of a model config).

    layer_model(values)        (Layout, LayerShape, MoE layers) from Megatron-named values
                               (an argparse.Namespace of the flags in settings.LAYER_MODEL_FLAGS)
    parse_chunks(text)         --parm-chunk-candidates as a tuple of chunk counts
    references(...)            predictions of the modelled dispatchers parm does not choose from
    render(...)                the table plan_schedule prints

Pure Python like the rest of the model: the checks are layout_rules', the shape is
shape.layer_shape's.
"""

from typing import Tuple

from megatron_parm import schedules
from megatron_parm.layout_rules import (capacity_problem, layout_problem, moe_layer_pattern,
                                        precision_problem, routing_problem)
from megatron_parm.perf_model.layout import Layout
from megatron_parm.perf_model.predict import predict, schedule_label
from megatron_parm.wording import plural
from megatron_parm.perf_model.shape import LayerShape, layer_shape
from megatron_parm.perf_model.volumes import comm_volumes, modelled_dispatchers


def layer_model(values) -> Tuple[Layout, LayerShape, int]:
    """The layout, the MoE layer's shape and the number of MoE layers of a model; ValueError
    naming the flag for what does not fit (the same messages as training's)."""
    tp = values.tensor_model_parallel_size
    ep = values.expert_model_parallel_size
    etp = values.expert_tensor_parallel_size or tp  # Megatron's default: ETP = TP
    if values.nproc_per_node is None:
        raise ValueError("--nproc-per-node is required (on the command line or in --config)")
    ffn = values.moe_ffn_hidden_size or values.ffn_hidden_size
    if ffn is None:
        raise ValueError("--moe-ffn-hidden-size (or --ffn-hidden-size) is required")
    world = values.nnodes * values.nproc_per_node
    problem = layout_problem(world, tp, ep, etp, values.num_experts)
    if problem:
        raise ValueError(f"{problem}; the world is --nnodes x --nproc-per-node "
                         f"({values.nnodes} x {values.nproc_per_node})")
    problem = (routing_problem(values.num_experts, values.moe_router_topk)
               or capacity_problem(values.moe_expert_capacity_factor,
                                   values.moe_pad_expert_input_to_capacity)
               or precision_problem(values.bf16, values.fp16))
    if problem:
        raise ValueError(problem)
    layout = Layout(tp=tp, ep=ep, etp=etp, nodes=values.nnodes,
                    ranks_per_node=values.nproc_per_node)
    shape = layer_shape(
        seq_length=values.seq_length, micro_batch_size=values.micro_batch_size, tp=tp,
        hidden_size=values.hidden_size, ffn_hidden_size=ffn, num_experts=values.num_experts,
        topk=values.moe_router_topk, capacity_factor=values.moe_expert_capacity_factor,
        pad_to_capacity=values.moe_pad_expert_input_to_capacity,
        dtype_bytes=2 if (values.bf16 or values.fp16) else 4,
        gated_linear_unit=values.swiglu)
    num_moe_layers = sum(moe_layer_pattern(values.moe_layer_freq, values.num_layers))
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
        f"layout: tp={layout.tp} ep={layout.ep} etp={layout.etp} on {plural(layout.nodes, 'node')} "
        f"x {plural(layout.ranks_per_node, 'rank')}" + (f"; {placement}" if placement else ""))
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
             else f"{choice.dispatcher} with {plural(choice.num_chunks, 'chunk')}"
             + ("" if choice.bwd_num_chunks == choice.num_chunks
                else f" forward, {choice.bwd_num_chunks} backward"))
    lines.append(f"choice: {label}" + (f"  (speedups over {base_name})" if base_name else ""))
    per_step = [f"{name} {p.total_s * num_moe_layers * 1e3:.1f} ms" for name, p in others.items()]
    lines.append(
        f"per step ({plural(num_moe_layers, 'MoE layer')}, forward + backward): "
        + ", ".join(per_step + [f"choice {chosen.total_s * num_moe_layers * 1e3:.1f} ms"]))
    if profile.provenance != "measured":
        lines.append("note: the profile is an estimate; calibrate it on the cluster to trust "
                     "these numbers")
    return "\n".join(lines)
