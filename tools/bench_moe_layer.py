"""Time forward+backward of one MoE layer with each dispatcher, side by side.

    # 4 ranks on one machine (CPU/gloo or GPUs/NCCL)
    torchrun --nproc-per-node 4 tools/bench_moe_layer.py \\
        --tensor-model-parallel-size 2 --expert-model-parallel-size 2 \\
        --expert-tensor-parallel-size 2 --sequence-parallel
    # on the emulated cluster (2 nodes x 2 ranks, shaped links)
    python tools/emulate_cluster.py --nnodes 2 --nproc-per-node 2 --preset pcie -- \\
        python tools/bench_moe_layer.py ...

Dispatchers run interleaved (each iteration runs all of them once), so machine drift hits
all alike; each step's time is the slowest rank's, and the table shows medians, ratios to
ds_baseline and alltoall, the bytes sent intra- and inter-node per step (summed over ranks,
from the byte accounting, which covers Megatron's own dispatchers too), the peak memory per
rank (--memory) and the largest output difference to alltoall. --output appends one JSON
line per dispatcher (and expert implementation). By default every schedule of the catalog
that runs the configuration's layout is timed; a chunked one at its default chunks, or at each of --chunk-variants
(``parm_s2@2``, ...; a variant can also be named in --dispatchers, e.g. ``parm_s2@8/4``:
8 chunks forward, 4 backward).

The experts are Megatron's SequentialMLP unless asked otherwise: --moe-grouped-gemm picks
the module Megatron-LM's flag builds here (GroupedMLP with grouped_gemm on a GPU in --bf16,
else TorchGroupedMLP, PyTorch's grouped_mm), and --expert-impls runs several side by side,
interleaved with the same weights (``all``: every one this machine can build). Every JSON
line names its ``expert_impl`` (and ``dtype``); ratios compare dispatchers with the same
experts, and the output difference is to alltoall with the first implementation.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_parm import cli  # noqa: E402

cli.setup_warnings()  # before Megatron-Core is imported

import torch.distributed as dist  # noqa: E402

from megatron_parm import schedules, settings  # noqa: E402
from megatron_parm import tuning  # noqa: E402
from megatron_parm.training.implementation import EXPERT_IMPLS  # noqa: E402
from megatron_parm import device  # noqa: E402

ALL = "all"  # every schedule of the catalog that runs the layout (--dispatchers), every
# expert implementation this machine can build (--expert-impls)


def parse_args(argv=None):
    from megatron_parm.bench.moe_layer import add_layer_args

    p = settings.Parser(description=__doc__.split("\n")[0])
    add_layer_args(p, seq_length=256, hidden_size=256, moe_ffn_hidden_size=512)
    settings.add_flags(p, ["--parm-num-chunks", "--parm-bwd-num-chunks", "--parm-profile",
                           "--parm-tune", "--parm-tune-steps", "--parm-tune-margin",
                           "--parm-tune-candidates", "--parm-tune-cache", "--bf16",
                           "--moe-grouped-gemm"], helps={  # as in training, except:
        "bf16": "parameters and inputs in bfloat16",
        "moe_grouped_gemm": "grouped experts, as Megatron-LM's flag builds them here: GroupedMLP "
                            "where the grouped_gemm package, a GPU and --bf16 are there, else "
                            "TorchGroupedMLP (PyTorch's grouped_mm)"})
    p.add_argument("--dispatchers", default=ALL,
                   help=f"comma-separated, from {', '.join(schedules.names())} (a chunked one "
                        f"also as NAME@C or NAME@C/B: C chunks forward, B backward); default "
                        f"'{ALL}': every schedule of the catalog that runs the layout")
    p.add_argument("--chunk-variants", default=None,
                   help="comma-separated chunk counts: time each chunked schedule at each of "
                        "them (NAME@C) instead of at its default")
    p.add_argument("--expert-impls", default=None,
                   help=f"comma-separated expert implementations to time side by side, from "
                        f"{', '.join(EXPERT_IMPLS)}, or '{ALL}' (every one this machine can "
                        f"build); default: SequentialMLP (or the grid's expert_impl)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--memory", action="store_true",
                   help="measure each dispatcher's peak memory per rank (one warm-up and one "
                        "measured step) instead of timing it: the exact memory accounting this "
                        "needs on CPUs slows allocation, so memory and time come from separate runs")
    p.add_argument("--run-id", default="", help="tag of this pass, written into every JSON line "
                                              "(repeated passes give the run-to-run spread)")
    p.add_argument("--output", default=None, help="append JSON lines here (rank 0)")
    p.add_argument("--grid", default=None,
                   help="YAML grid of configurations (configs/bench/*.yaml); flags give the defaults")
    p.add_argument("--label", default="", help="tag written into every JSON line (e.g. the link class)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the output comparison with alltoall (saves a step per dispatcher)")
    try:
        args = settings.read(p, argv)  # each flag's declared check
    except ValueError as err:
        p.error(str(err))
    from megatron_parm.bench.moe_layer import parse_variant

    args.dispatchers = [d.strip() for d in args.dispatchers.split(",") if d.strip()]
    for entry in args.dispatchers:
        if entry == ALL:
            continue
        try:
            parse_variant(entry)
        except ValueError as err:
            p.error(f"--dispatchers: {err}")
    try:
        args.chunk_variants = [int(c) for c in (args.chunk_variants or "").split(",") if c.strip()]
        for count in args.chunk_variants:
            schedules.check_num_chunks(count, "--chunk-variants")
    except ValueError as err:
        p.error(str(err) if "--chunk-variants" in str(err) else
                f"--chunk-variants: expected comma-separated integers, got {args.chunk_variants!r}")
    if args.expert_impls is not None and args.moe_grouped_gemm:
        p.error("--moe-grouped-gemm and --expert-impls: give one of them (--expert-impls "
                "SequentialMLP,TorchGroupedMLP times both)")
    if args.expert_impls is not None:
        args.expert_impls = [i.strip() for i in args.expert_impls.split(",") if i.strip()]
        unknown = [i for i in args.expert_impls if i not in EXPERT_IMPLS + (ALL,)]
        if unknown or not args.expert_impls:
            p.error(f"--expert-impls: unknown implementation {unknown[0]!r} (one of "
                    f"{', '.join(EXPERT_IMPLS)}, or {ALL})" if unknown else
                    "--expert-impls: none given")
    try:
        tuning.check_args(args.parm_tune_steps, args.parm_tune_margin, args.parm_tune_candidates,
                          args.parm_tune_cache)
    except ValueError as err:
        p.error(str(err))
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    if args.iters < 1 and not args.memory:
        p.error("--iters must be >= 1")
    return args


def spec_from_args(args, **overrides):
    import torch

    from megatron_parm.bench.moe_layer import MoELayerSpec

    spec = MoELayerSpec(
        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, hidden_size=args.hidden_size,
        ffn_hidden_size=args.moe_ffn_hidden_size, num_experts=args.num_experts, topk=args.moe_router_topk,
        capacity_factor=args.moe_expert_capacity_factor, pad_to_capacity=args.moe_pad_expert_input_to_capacity,
        tp=args.tensor_model_parallel_size, ep=args.expert_model_parallel_size,
        etp=args.expert_tensor_parallel_size, sequence_parallel=args.sequence_parallel,
        num_chunks=args.parm_num_chunks, bwd_num_chunks=args.parm_bwd_num_chunks,
        parm_profile=args.parm_profile, params_dtype=torch.bfloat16 if args.bf16 else torch.float32)
    spec.extra.update(parm_tune=args.parm_tune, parm_tune_steps=args.parm_tune_steps,
                      parm_tune_margin=args.parm_tune_margin,
                      parm_tune_candidates=args.parm_tune_candidates,
                      parm_tune_cache=args.parm_tune_cache)
    if args.moe_grouped_gemm:
        from megatron_parm.training.implementation import expert_implementation

        spec.expert_impl = expert_implementation("local", True, cuda=device.is_cuda(), bf16=args.bf16)
    for key, value in overrides.items():
        if not hasattr(spec, key):
            raise ValueError(f"--grid: unknown field {key!r} (fields of MoELayerSpec: "
                             f"{', '.join(f for f in vars(spec) if f != 'extra')})")
        setattr(spec, key, value)
    return spec.resolved()


def load_grid(path):
    """Configurations of a grid file: the cartesian product of `grid`, each with `fixed` on top,
    less those `exclude_if` matches.

    File: {fixed: {field: value}, grid: {field: [values]}, exclude_if: [rule, ...]}; fields are
    those of MoELayerSpec. A configuration is left out when it meets every condition of any
    rule; a condition is `field: value` (equal) or `field: {op: value}` with op one of
    GRID_OPERATORS. Nothing in the file is evaluated as code.
    """
    import itertools

    data = settings.read_config_file(path, "--grid")
    unknown = set(data) - {"name", "description", "fixed", "grid", "exclude_if"}
    if unknown:
        raise ValueError(f"--grid {path}: unknown keys {sorted(unknown)}")
    rules = _exclusion_rules(data.get("exclude_if"), path)
    grid = data.get("grid") or {}
    keys = list(grid)
    configs = []
    for values in itertools.product(*(grid[k] for k in keys)):
        config = dict(data.get("fixed") or {})
        config.update(zip(keys, values))
        if any(_meets(config, rule, path) for rule in rules):
            continue
        configs.append(config)
    if not configs:
        raise ValueError(f"--grid {path}: no configuration left")
    return configs


GRID_OPERATORS = {"eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
                  "lt": lambda a, b: a < b, "le": lambda a, b: a <= b,
                  "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b,
                  "in": lambda a, b: a in b, "not_in": lambda a, b: a not in b}


def _exclusion_rules(rules, path):
    """exclude_if as a list of {field: (operator, value)} rules; refuses anything else."""
    if rules is None:
        return []
    example = "e.g. [{capacity_factor: {ne: null}, seq_length: {lt: 1024}}]"
    if not isinstance(rules, list) or not all(isinstance(rule, dict) and rule for rule in rules):
        raise ValueError(f"--grid {path}: exclude_if must be a list of rules, each a mapping of "
                         f"fields to conditions ({example}); expressions are not evaluated")
    parsed = []
    for rule in rules:
        conditions = {}
        for field, condition in rule.items():
            if isinstance(condition, dict):
                if len(condition) != 1 or next(iter(condition)) not in GRID_OPERATORS:
                    raise ValueError(f"--grid {path}: exclude_if: {field}: {condition!r} is not "
                                     f"one of {', '.join(GRID_OPERATORS)} with a value")
                conditions[field] = next(iter(condition.items()))
            else:
                conditions[field] = ("eq", condition)
        parsed.append(conditions)
    return parsed


def _meets(config, rule, path) -> bool:
    try:
        return all(GRID_OPERATORS[op](config.get(field), value)
                   for field, (op, value) in rule.items())
    except TypeError as err:
        raise ValueError(f"--grid {path}: exclude_if cannot compare {rule} with {config}: {err}") from err


def dispatchers_for(spec, entries, chunk_variants):
    """The dispatchers (and variants) to time on spec's layout: ``all`` expands to every
    schedule of the catalog that runs it; chunked schedules are expanded to chunk_variants."""
    from megatron_parm.bench.moe_layer import parse_variant, variant

    out = []
    for entry in entries:
        names = list(schedules.names()) if entry == ALL else [entry]
        for name in names:
            base, chunks, _ = parse_variant(name)
            schedule = schedules.get(base)
            if schedule.unsupported(spec.tp, spec.ep, spec.etp, spec.sequence_parallel or spec.tp == 1):
                if entry != ALL:
                    print(f"skipping {name}: {schedule.unsupported(spec.tp, spec.ep, spec.etp)}",
                          flush=True)
                continue
            if schedule.chunked and chunks is None and chunk_variants:
                out += [variant(base, c) for c in chunk_variants]
            else:
                out.append(name)
    return list(dict.fromkeys(out))


def expert_impls_for(spec, entries):
    """The expert implementations to time on spec: ``entries`` (None: the spec's own), ``all``
    expanded to every one this machine can build; those it cannot are skipped with a line."""
    import dataclasses

    out = []
    for entry in entries or [spec.expert_impl]:
        for impl in EXPERT_IMPLS if entry == ALL else [entry]:
            problem = dataclasses.replace(spec, expert_impl=impl).expert_problem()
            if problem is None:
                out.append(impl)
            else:
                print(f"skipping expert implementation {impl}: {problem}", flush=True)
    return list(dict.fromkeys(out))


def format_table(spec, by_impl, diffs) -> str:
    """by_impl: {expert_impl: {dispatcher: Timing}}; diffs: {expert_impl: {dispatcher: diff}}.
    Ratios are to ds_baseline and alltoall with the same experts."""
    several = len(by_impl) > 1
    lines = [
        f"MoE layer: S={spec.seq_length} B={spec.micro_batch_size} M={spec.hidden_size} "
        f"F={spec.ffn_hidden_size} E={spec.num_experts} k={spec.topk} | tp={spec.tp} ep={spec.ep} "
        f"etp={spec.etp} sp={spec.sequence_parallel} | world={dist.get_world_size()} | "
        f"{str(spec.params_dtype).replace('torch.', '')}"
        + ("" if several else f" | experts {next(iter(by_impl), spec.expert_impl)}"),
        (f"{'experts':<16} " if several else "")
        + f"{'dispatcher':<14} {'median ms':>10} {'x ds_base':>10} {'x alltoall':>11} "
          f"{'intra MB':>9} {'inter MB':>9} {'peak MB':>8} {'max |diff|':>11}",
    ]
    for impl, results in by_impl.items():
        lines += _table_rows(results, diffs.get(impl, {}), f"{impl:<16} " if several else "")
    return "\n".join(lines)


def _table_rows(results, diffs, prefix):
    base = results.get("ds_baseline")
    a2a = results.get("alltoall")
    lines = []
    for name, timing in results.items():
        intra = sum(v["intra"] for v in timing.bytes.values()) / 1e6
        inter = sum(v["inter"] for v in timing.bytes.values()) / 1e6
        timed = timing.median_ms is not None
        vs_base = f"{base.median_ms / timing.median_ms:.2f}" if base and timed else "-"
        vs_a2a = f"{a2a.median_ms / timing.median_ms:.2f}" if a2a and timed else "-"
        peak = f"{timing.peak_bytes / 1e6:.0f}" if timing.peak_bytes is not None else "-"
        median = f"{timing.median_ms:>10.1f}" if timed else f"{'-':>10}"
        lines.append(
            f"{prefix}{name:<14} {median} {vs_base:>10} {vs_a2a:>11} "
            f"{intra:>9.2f} {inter:>9.2f} {peak:>8} "
            f"{diffs.get(name, float('nan')):>11.2e}" + (f"  chose {timing.choice}" if timing.choice else ""))
    return lines


def main(argv=None):
    args = parse_args(argv)
    from megatron_parm.training.trainer import initialize_distributed

    initialize_distributed()  # torchrun's group, or without RANK (plain python) one process
    if args.memory:
        from megatron_parm.bench.memory import exact_cpu_accounting

        exact_cpu_accounting()
        args.warmup, args.iters = 0, 0
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_parm.bench.moe_layer import (dtype_name, max_output_diff_by_experts, parse_variant,
                                            time_experts)
    from megatron_parm.comm.accounting import launcher_ranks_per_node
    from megatron_parm.parallel import initialize_model_parallel, validate_layout

    configs = load_grid(args.grid) if args.grid else [{}]
    specs = [spec_from_args(args, **overrides) for overrides in configs]
    layout = None
    for index, spec in enumerate(specs):
        if (spec.tp, spec.ep, spec.etp) != layout:
            for name in dispatchers_for(spec, args.dispatchers, []):
                validate_layout(dist.get_world_size(), spec.tp, spec.ep, spec.etp,
                                spec.num_experts, parse_variant(name)[0])
            initialize_model_parallel(spec.tp, spec.ep, spec.etp, num_experts=spec.num_experts)
            model_parallel_cuda_manual_seed(1234)
            layout = (spec.tp, spec.ep, spec.etp)
        names = dispatchers_for(spec, args.dispatchers, args.chunk_variants)
        impls = expert_impls_for(spec, args.expert_impls)
        if not impls:
            raise ValueError(f"--expert-impls: none of {', '.join(args.expert_impls)} can run "
                             f"configuration {index} here (the lines above say why)")
        by_impl = time_experts(spec, names, impls, warmup=args.warmup, iters=args.iters,
                               memory=args.memory)
        diffs = {} if args.no_check else max_output_diff_by_experts(spec, names, impls)
        if dist.get_rank() != 0:
            continue
        print(f"[{index + 1}/{len(specs)}] " + format_table(spec, by_impl, diffs), flush=True)
        chosen = [f"{name} chose {t.choice_line}" for r in by_impl.values()
                  for name, t in r.items() if t.choice_line]
        if chosen:
            print("\n".join(chosen + [f"({tuning.CHUNK_NOTATION})"]), flush=True)
        if args.output:
            with open(args.output, "a") as f:
                for impl, name, timing in ((i, n, t) for i, r in by_impl.items() for n, t in r.items()):
                    record = dict(label=args.label, run=args.run_id, config=index, dispatcher=name,
                                  median_ms=timing.median_ms, times_ms=timing.times_ms, choice=timing.choice,
                                  choice_line=timing.choice_line,
                                  bytes=timing.bytes, rank_bytes=timing.rank_bytes,
                                  peak_bytes=timing.peak_bytes, step_peak_bytes=timing.step_peak_bytes,
                                  memory_kind=timing.memory_kind,
                                  max_diff_vs_alltoall=diffs.get(impl, {}).get(name),
                                  world_size=dist.get_world_size(),
                                  local_world_size=launcher_ranks_per_node() or 0)
                    record.update({k: v for k, v in vars(spec).items()
                                   if k not in ("extra", "params_dtype", "layout")})
                    record.update(expert_impl=impl, dtype=dtype_name(spec.params_dtype))
                    f.write(json.dumps(record) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    cli.run(main)
