"""Measure this cluster's alpha-beta profile for the performance model; write a profile file.

    # one node, 4 ranks (only intra-node groups: inter entries are copied, see below)
    torchrun --nproc-per-node 4 tools/calibrate.py --output mine.yaml
    # the emulated cluster, 2 nodes x 2 ranks
    python tools/emulate_cluster.py --nnodes 2 --nproc-per-node 2 --preset pcie -- \\
        python tools/calibrate.py --output megatron_parm/perf_model/profiles/emulated_pcie_measured.yaml
    # Slurm, several nodes (one torchrun per node)
    srun --ntasks-per-node 1 torchrun --nnodes $SLURM_NNODES --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 tools/calibrate.py --output prof.yaml

Times all_to_all, all_gather, reduce_scatter and all_reduce over --sizes on the real groups
of the layout (Megatron's TP, EP and ETP groups; by default TP = ETP = one node, EP across
nodes, so there is one intra-node and one inter-node group), and expert-like matmuls
forward and backward for the compute term; fits alpha + beta * x per (kind, link) by least
squares, prints the fit and every point's residual, and writes the profile (provenance:
measured). Method, link classes and what is done when a link class cannot be measured:
megatron_parm/perf_model/calibrate.py (fits) and megatron_parm/bench/calibrate.py (timing).
Then it times the real MoE layer with the schedules of perf_model.calibrate.layer_fit_schedules
(parm_s1, and parm_s2 at 2 and 8 chunks; --layer-* flags) on every layout of --layer-layouts
(default: those of (2,2,2), (2,2,1), (1,4,1) the world runs, the layouts the model chooses
between) and fits the profile's in-layer terms to all of them at once (layer_scale,
overlap_efficiency, chunk_overhead, chunk_expert_overhead; perf_model/profile.py TERMS),
printing each layer's measured and modelled time and the fit's error; then it times the
forward + backward of micro-batches of a GPT MoE model (--step-config, at --step-layers
layers) and fits the framework terms (microbatch_overhead, layer_overhead).

On one rank (one GPU) there is no group to time: the collective terms come from
--base-profile and the rest (compute, the chunk cost, the framework terms) is measured:

    torchrun --nproc-per-node 1 tools/calibrate.py --base-profile nvlink_ib_estimate --output h200.yaml

A default run takes about 5 minutes on the emulated cluster (2 nodes x 2 ranks, either
preset, 2 cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_parm import cli  # noqa: E402
from megatron_parm.wording import plural  # noqa: E402

cli.setup_warnings()  # before Megatron-Core is imported

from megatron_parm import settings  # noqa: E402
from megatron_parm.layout_rules import expert_split_problem  # noqa: E402
from megatron_parm.perf_model import Layout, save_profile  # noqa: E402
from megatron_parm.perf_model import calibrate as cal  # noqa: E402

DEFAULT_SIZES = "16KiB..8MiB"
DEFAULT_COMPUTE_ROWS = "64..2048"
DEFAULT_LAYER_TOKENS = "192,768"
DEFAULT_LAYER_EXPERTS = "4,8"
LAYER_CHUNKS = (1, 2, 8)  # 1: parm_s1; c: parm_s2 at c chunks
# The layouts the in-layer terms are fitted over by default (those the world runs): the
# grid's, where S2's chunks cost differently (local experts, ETP)
DEFAULT_LAYER_LAYOUTS = ((2, 2, 2), (2, 2, 1), (1, 4, 1))
LAYOUT_FLAGS = ("--tensor-model-parallel-size", "--expert-model-parallel-size",
                "--expert-tensor-parallel-size")
LAYOUT_KEYS = tuple(settings.FLAGS[name].key for name in LAYOUT_FLAGS)
DEFAULT_STEP_CONFIG = "configs/gpt2_tiny_moe.yaml"
DEFAULT_STEP_LAYERS = "1,2"


def build_parser() -> argparse.ArgumentParser:
    parser = settings.Parser(
        prog="calibrate.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    settings.add_flags(parser, LAYOUT_FLAGS, defaults=dict.fromkeys(LAYOUT_KEYS), helps={
        "tensor_model_parallel_size": "default: ranks per node (TP groups inside a node)",
        "expert_model_parallel_size": "default: number of nodes (EP groups across nodes)",
        "expert_tensor_parallel_size": "default: the tensor-parallel size, as in Megatron"})
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        help="message sizes S (bytes of one rank's whole tensor): LO..HI "
                             "(doubling), LO..HI:N (N geometric points) or a comma list; "
                             f"units B, KiB, MiB (default {DEFAULT_SIZES})")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed repetitions per point (default 2)")
    parser.add_argument("--reps", type=int, default=10,
                        help="timed repetitions per point; the median is fitted (default 10)")
    settings.add_flags(parser, ["--hidden-size", "--moe-ffn-hidden-size"],
                       defaults={"hidden_size": 512, "moe_ffn_hidden_size": 256}, helps={
                           "hidden_size": "M of the timed expert matmuls (default 512)",
                           "moe_ffn_hidden_size": "H of the timed expert matmuls, split over "
                                                  "ETP (default 256)"})
    parser.add_argument("--compute-rows", default=DEFAULT_COMPUTE_ROWS,
                        help=f"rows through the timed expert, same forms as --sizes "
                             f"(default {DEFAULT_COMPUTE_ROWS})")
    parser.add_argument("--layer-tokens", default=DEFAULT_LAYER_TOKENS,
                        help="tokens per rank of the real MoE layers timed with parm_s1 and "
                             "parm_s2 (2 and 8 chunks) to fit the in-layer terms (layer_scale, "
                             "overlap_efficiency, chunk_overhead); a comma list, 0 skips them "
                             f"(default {DEFAULT_LAYER_TOKENS})")
    parser.add_argument("--layer-hidden-size", type=int, default=384,
                        help="hidden size of those layers (default 384); time layers like the "
                             "ones the model will run: the in-layer terms depend on the shape")
    parser.add_argument("--layer-ffn-hidden-size", type=int, default=512,
                        help="expert FFN hidden size of those layers (default 512)")
    parser.add_argument("--layer-num-experts", default=DEFAULT_LAYER_EXPERTS,
                        help=f"expert counts of those layers, a comma list of multiples of the "
                             f"expert-parallel size (default {DEFAULT_LAYER_EXPERTS})")
    parser.add_argument("--layer-layouts", nargs="+", default=None, metavar="TP,EP,ETP",
                        help="layouts the MoE layers are timed on (default: those of "
                             + " ".join(",".join(map(str, x)) for x in DEFAULT_LAYER_LAYOUTS)
                             + " the world runs, else the calibrated layout)")
    parser.add_argument("--layer-expert-impls", default="SequentialMLP",
                        help="expert modules of those layers, a comma list (SequentialMLP, "
                             "TorchGroupedMLP, ...; default SequentialMLP): with both, the fit "
                             "tells a chunk's per-local-expert cost from its constant")
    parser.add_argument("--step-config", default=DEFAULT_STEP_CONFIG,
                        help=f"GPT MoE config whose micro-batches are timed for the framework "
                             f"terms (default {DEFAULT_STEP_CONFIG})")
    parser.add_argument("--step-layers", default=DEFAULT_STEP_LAYERS,
                        help=f"layer counts of that model, a comma list; 0 skips the framework "
                             f"terms (default {DEFAULT_STEP_LAYERS})")
    parser.add_argument("--base-profile", default=None,
                        help="a profile (path or shipped name) whose collective terms are kept "
                             "where the layout has no group to time (one rank); required then")
    settings.add_flags(parser, ["--parm-ranks-per-node"],
                       aliases={"--parm-ranks-per-node": ["--ranks-per-node"]})
    parser.add_argument("--output", default="calibrated_profile.yaml",
                        help="profile file to write, .yaml or .json (default "
                             "calibrated_profile.yaml)")
    parser.add_argument("--name", default=None,
                        help="profile name (default: the output file's name without suffix)")
    parser.add_argument("--note", default="",
                        help="free text for the profile's note, e.g. the links' bandwidths")
    return parser


def _int_list(text, flag: str) -> list:
    try:
        return [int(item) for item in str(text).split(",") if item.strip()]
    except ValueError:
        raise ValueError(f"{flag}: expected a comma list of integers, got {text!r}") from None


def check_args(args: argparse.Namespace, world_size: int) -> Layout:
    """Raise ValueError naming the flag; returns the layout to calibrate."""
    args.sizes = cal.parse_range(args.sizes, "--sizes")
    args.compute_rows = cal.parse_range(args.compute_rows, "--compute-rows",
                                        parse=lambda item: cal.parse_int(item, "--compute-rows"))
    tokens = [t for t in _int_list(args.layer_tokens, "--layer-tokens") if t != 0]
    bad = [t for t in tokens if t < max(LAYER_CHUNKS) or t % 2]
    if bad:
        raise ValueError(f"--layer-tokens: token counts must be even and >= {max(LAYER_CHUNKS)} "
                         f"(parm_s2's largest chunk count), got {bad}")
    args.layer_tokens = tokens
    args.layer_num_experts = _int_list(args.layer_num_experts, "--layer-num-experts")
    if tokens and not args.layer_num_experts:
        raise ValueError("--layer-num-experts: give at least one expert count")
    for flag in ("--warmup", "--reps", "--layer-hidden-size", "--layer-ffn-hidden-size"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value < (0 if flag == "--warmup" else 1):
            raise ValueError(f"{flag} must be >= {0 if flag == '--warmup' else 1}, got {value}")
    if os.path.splitext(args.output)[1].lower() not in (".yaml", ".yml", ".json"):
        raise ValueError(f"--output must end in .yaml, .yml or .json, got {args.output!r}")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise ValueError(f"--output: no such directory: {os.path.dirname(args.output)}")
    from megatron_parm.comm.accounting import launcher_ranks_per_node, ranks_per_node as node_rule

    if args.parm_ranks_per_node is None and launcher_ranks_per_node() is None:
        raise ValueError("--parm-ranks-per-node not given and LOCAL_WORLD_SIZE not set; launch "
                         "with torchrun or give --parm-ranks-per-node")
    ranks_per_node = node_rule(world_size, args.parm_ranks_per_node)
    tp, ep, etp = cal.default_layout_sizes(world_size, ranks_per_node)
    tp = args.tensor_model_parallel_size or tp
    etp = args.expert_tensor_parallel_size or (tp if args.tensor_model_parallel_size else etp)
    ep = args.expert_model_parallel_size or ep
    if args.expert_model_parallel_size is None and world_size % (ep * etp) != 0:
        ep = world_size // etp if world_size % etp == 0 else 1
    from megatron_parm.parallel import validate_layout

    validate_layout(world_size, tp, ep, etp)
    problem = expert_split_problem(args.moe_ffn_hidden_size, etp)
    if problem:
        raise ValueError(problem)
    args.parm_ranks_per_node = ranks_per_node
    layout = Layout(tp=tp, ep=ep, etp=etp, nodes=world_size // ranks_per_node,
                    ranks_per_node=ranks_per_node)
    args.layer_layouts = _layer_layouts(args.layer_layouts, world_size, layout)
    for l_tp, l_ep, l_etp in args.layer_layouts if args.layer_tokens else ():
        bad = [e for e in args.layer_num_experts if e < l_ep or e % l_ep]
        if bad:
            raise ValueError(f"--layer-num-experts {bad}: each must be a multiple of the "
                             f"expert-parallel size ({l_ep}) of --layer-layouts "
                             f"{l_tp},{l_ep},{l_etp}")
        if args.layer_ffn_hidden_size % l_etp or args.layer_hidden_size % l_tp:
            raise ValueError(f"--layer-ffn-hidden-size ({args.layer_ffn_hidden_size}) must be "
                             f"divisible by the expert-tensor-parallel size ({l_etp}) and "
                             f"--layer-hidden-size ({args.layer_hidden_size}) by the "
                             f"tensor-parallel size ({l_tp}) of --layer-layouts "
                             f"{l_tp},{l_ep},{l_etp}")
    from megatron_parm.training.implementation import EXPERT_IMPLS

    args.layer_expert_impls = [x.strip() for x in args.layer_expert_impls.split(",") if x.strip()]
    bad = [x for x in args.layer_expert_impls if x not in EXPERT_IMPLS]
    if bad or not args.layer_expert_impls:
        raise ValueError(f"--layer-expert-impls: unknown {bad or 'empty'}; choose from "
                         f"{', '.join(EXPERT_IMPLS)}")
    args.step_layers = [n for n in _int_list(args.step_layers, "--step-layers") if n != 0]
    if any(n < 0 for n in args.step_layers):
        raise ValueError(f"--step-layers: layer counts must be positive, got {args.step_layers}")
    if args.step_layers and not os.path.isfile(args.step_config):
        raise ValueError(f"--step-config: file not found: {args.step_config}")
    from megatron_parm.bench.calibrate import step_args

    for num_layers in args.step_layers:  # the step timing's model, checked before any timing
        try:
            step_args(args.step_config, tp, ep, etp, num_layers, world_size, num_microbatches=2)
        except ValueError as error:
            raise ValueError(f"--step-config {args.step_config} at --step-layers {num_layers}: "
                             f"{error}") from None
    if args.base_profile is not None:
        from megatron_parm.perf_model import load_profile

        try:
            args.base_profile = load_profile(args.base_profile)
        except ValueError as error:
            raise ValueError(f"--base-profile: {error}") from None
    if not cal.groups_to_time(layout) and args.base_profile is None:
        raise ValueError(
            f"nothing to time with tp={tp} ep={ep} etp={etp} on {plural(layout.nodes, 'node')} x "
            f"{plural(ranks_per_node, 'rank')}: every group has one rank or mixes intra- and inter-node "
            f"peers; choose --tensor-model-parallel-size / --expert-model-parallel-size / "
            f"--expert-tensor-parallel-size so a group spans 2+ ranks of one node, or one rank "
            f"on each of 2+ nodes; or give --base-profile for the collective terms (one GPU)")
    return layout


def _layer_layouts(values, world_size: int, layout: Layout) -> list:
    """(tp, ep, etp) of the timed MoE layers: the flag's, else the defaults the world runs."""
    from megatron_parm.parallel import validate_layout

    if values is None:
        chosen = []
        for sizes in DEFAULT_LAYER_LAYOUTS:
            try:
                validate_layout(world_size, *sizes)
            except ValueError:
                continue
            chosen.append(sizes)
        return chosen or [(layout.tp, layout.ep, layout.etp)]
    chosen = []
    for value in values:
        try:
            sizes = tuple(int(v) for v in value.split(","))
            if len(sizes) != 3:
                raise ValueError
        except ValueError:
            raise ValueError(f"--layer-layouts: expected TP,EP,ETP, got {value!r}") from None
        try:
            validate_layout(world_size, *sizes)
        except ValueError as error:
            raise ValueError(f"--layer-layouts {value}: {error}") from None
        chosen.append(sizes)
    return chosen


def skip_reason(layout: Layout, name: str) -> str:
    link = cal.link_class(layout, name)
    if link == "none":
        return "one rank"
    if link == "mixed":
        return "mixes intra- and inter-node peers"
    return f"{link}, same ranks as a timed group"


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = settings.read(parser, argv)  # each flag's declared check
        layout = check_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as error:
        parser.error(str(error))  # every rank exits 2 with the same message, before any group

    import torch.distributed as dist

    from megatron_parm import mcore_compat
    from megatron_parm.bench import calibrate as measure
    from megatron_parm.parallel import initialize_model_parallel

    from megatron_parm import device as seam

    seam.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(seam.backend())
    mcore_compat.setup()
    device = seam.current()
    initialize_model_parallel(layout.tp, layout.ep, layout.etp)
    from megatron.core import parallel_state

    groups = {"tp": parallel_state.get_tensor_model_parallel_group(),
              "ep": parallel_state.get_expert_model_parallel_group(),
              "expt_tp": parallel_state.get_expert_tensor_parallel_group()}
    rank = dist.get_rank()
    for name, group in groups.items():  # the model's rank rule must describe the real groups
        assert dist.get_process_group_ranks(group) == layout.group_ranks(name, rank), name
    timed = cal.groups_to_time(layout)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"calibrate: world {layout.world_size} = {layout.nodes} nodes x {layout.ranks_per_node}; "
        f"tp={layout.tp} ep={layout.ep} etp={layout.etp}; timing "
        + (", ".join(f"{n} ({link})" for n, link in timed) or "no group")
        + "; not timed: " + (", ".join(f"{n} ({skip_reason(layout, n)})"
                                       for n in ("tp", "ep", "expt_tp")
                                       if n not in dict(timed)) or "none"), flush=True)

    points = []
    for name, link in timed:
        for kind in cal.COLLECTIVE_KINDS:
            for size in args.sizes:
                points.append(measure.time_collective(
                    kind, groups[name], name, link, size, warmup=args.warmup, reps=args.reps,
                    ranks_per_node=layout.ranks_per_node, device=device))
            say(f"  timed {kind} on {name} ({link}) at {len(args.sizes)} sizes", flush=True)
    ffn_local = args.moe_ffn_hidden_size // layout.etp
    points += measure.time_compute(args.compute_rows, args.hidden_size, ffn_local,
                               warmup=args.warmup, reps=args.reps, device=device)
    say(f"  timed expert matmuls at {len(args.compute_rows)} row counts", flush=True)
    layer_times = []  # (layer spec, chunks, seconds)
    if args.layer_tokens:
        # The real layer with parm_s1 and parm_s2 on every layout the model chooses between:
        # what the stage terms measured one at a time miss inside the layer becomes the
        # profile's in-layer terms.
        import dataclasses

        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        from megatron_parm.bench.moe_layer import MoELayerSpec, time_schedules

        for tp, ep, etp in args.layer_layouts:
            initialize_model_parallel(tp, ep, etp)
            model_parallel_cuda_manual_seed(1234)
            for tokens in args.layer_tokens:
                for experts in args.layer_num_experts:
                    for impl in args.layer_expert_impls:
                        spec = MoELayerSpec(hidden_size=args.layer_hidden_size,
                                            ffn_hidden_size=args.layer_ffn_hidden_size,
                                            num_experts=experts, topk=2, tp=tp, ep=ep, etp=etp,
                                            micro_batch_size=2, tokens_per_rank=tokens,
                                            expert_impl=impl).resolved()
                        problem = spec.expert_problem()
                        if problem:
                            say(f"  skipped {impl} at ({tp},{ep},{etp}): {problem}", flush=True)
                            continue
                        timings = time_schedules(spec, list(LAYER_CHUNKS), warmup=1,
                                                 iters=max(3, args.reps // 2))
                        layer_times += [(dataclasses.replace(spec), chunks,
                                         timing.median_ms / 1e3)
                                        for chunks, timing in timings.items()]
                say(f"  timed the MoE layer on ({tp},{ep},{etp}) at {tokens} tokens per rank, "
                    f"experts {args.layer_num_experts}, with parm_s1 and parm_s2 (c = "
                    f"{', '.join(map(str, LAYER_CHUNKS[1:]))})", flush=True)
    step_times = []  # (model spec, layout, micro-batch size, micro-batches, seconds)
    if args.step_layers:
        # Whole micro-batches of a GPT MoE model: what no GEMM or collective accounts for
        # becomes the framework terms.
        from megatron_parm.perf_model.transformer import ModelSpec

        vocab_size = 8000  # the step config's tokens are random: any vocabulary will do
        initialize_model_parallel(layout.tp, layout.ep, layout.etp)
        for num_layers in args.step_layers:
            for count in (1, 2):
                step_args, seconds = measure.time_model_steps(
                    args.step_config, layout.tp, layout.ep, layout.etp, num_layers, count,
                    warmup=1, reps=max(3, args.reps // 2), vocab_size=vocab_size,
                    device=device)
                spec = ModelSpec(
                    model_type="gpt", num_layers=num_layers, hidden_size=step_args.hidden_size,
                    num_attention_heads=step_args.num_attention_heads,
                    seq_length=step_args.seq_length, vocab_size=vocab_size,
                    num_experts=step_args.num_experts,
                    moe_ffn_hidden_size=step_args.moe_ffn_hidden_size or step_args.ffn_hidden_size,
                    topk=step_args.moe_router_topk,
                    add_bias_linear=not step_args.disable_bias_linear)
                step_times.append((spec, layout, step_args.micro_batch_size, count,
                                   statistics.median(seconds)))
            say(f"  timed {args.step_config} with {plural(num_layers, 'layer')}, 1 and 2 micro-batches",
                flush=True)

    status = 0
    if rank == 0:
        fits = cal.fit_points(points)
        base = args.base_profile
        try:
            copied = cal.fill_missing(fits, base)
        except ValueError as error:
            print(f"calibrate.py: error: {error}", file=sys.stderr)
            copied, status = None, 2
        if copied is not None:
            rates = measure.shaped_rates([os.environ.get("GLOO_SOCKET_IFNAME", "eth0"), "lo"])
            compute_shape = (f"fp32 x[rows, {args.hidden_size}] @ [{args.hidden_size}, "
                             f"{ffn_local}] -> GeLU -> @ [{ffn_local}, {args.hidden_size}], "
                             f"forward F and backward 2F flops, {device.type}")
            extra = args.note
            if layer_times:
                extra = (extra.rstrip(".") + ". " if extra else "") + (
                    "In-layer terms fitted on layouts "
                    + " ".join(",".join(map(str, x)) for x in args.layer_layouts)
                    + f", {'/'.join(args.layer_expert_impls)}")
            if step_times:
                extra = (extra.rstrip(".") + ". " if extra else "") + (
                    f"Framework terms fitted on {args.step_config} at "
                    f"{'/'.join(map(str, args.step_layers))} layers")
            note = cal.describe_run(["tools/calibrate.py"] + list(sys.argv[1:] if argv is None
                                                                  else argv),
                                    layout, timed, copied, rates, extra, compute_shape)
            name = args.name or os.path.splitext(os.path.basename(args.output))[0]
            profile = cal.build_profile(fits, name, note, base)
            if layer_times:
                profile = cal.fit_layer_terms(profile, layout, layer_times)
                print(f"in-layer terms: layer_scale {profile.layer_scale:.3f}, "
                      f"overlap_efficiency {profile.overlap_efficiency:.2f}, chunk_overhead "
                      f"{1e3 * profile.chunk_overhead:.2f} ms per extra chunk + "
                      f"chunk_expert_overhead {1e3 * profile.chunk_expert_overhead:.2f} ms per "
                      f"local expert (SequentialMLP)")
                print(cal.format_layer_fit(profile, layout, layer_times))
            if step_times:
                profile = cal.fit_framework_terms(profile, step_times)
                print(f"framework terms: microbatch_overhead {1e3 * profile.microbatch_overhead:.2f}"
                      f" ms, layer_overhead {1e3 * profile.layer_overhead:.2f} ms")
                print(cal.format_framework_fit(profile, step_times))
            save_profile(profile, args.output)
            if fits:
                print("\nresiduals ((fit - measured) / measured; median of "
                      f"{args.reps} repetitions, slowest rank):")
                print(cal.format_residual_table(fits))
                print("\nfit (T = alpha + beta * bytes sent per rank; compute: per flop):")
                print(cal.format_fit_table(fits))
            if copied:
                print("WARNING: not measured on this layout, copied: " + "; ".join(copied))
            print(f"\nwrote {args.output}", flush=True)
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    cli.run(main)
