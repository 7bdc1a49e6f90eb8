"""Count what one forward+backward of one MoE layer runs, per dispatcher and expert module.

    # world size 1 (one process; S2 still cuts its rows into chunks, without collectives)
    python tools/count_ops.py
    # 2 ranks, EP 2: S2's per-chunk A2As and sorts (CPU/gloo or GPUs/NCCL)
    torchrun --nproc-per-node 2 tools/count_ops.py --expert-model-parallel-size 2
    # the operators one more chunk adds, by name; and step times (medians of passes)
    python tools/count_ops.py --dispatchers parm_s2@1,parm_s2@2 --by-op
    python tools/count_ops.py --time --seq-length 1024 --hidden-size 512 --moe-ffn-hidden-size 512

Per configuration: operators in all, the device's (each a kernel on a GPU), GEMMs,
collectives this rank issues, the host plan's operators, views and allocations
(megatron_parm/bench/op_count.py says what each is), and for parm_s2@C what each chunk beyond
the first adds. On a GPU also the kernels that ran and the host's launch calls (profiler).
Counts are per rank, the largest over the ranks. --output appends one JSON line per
configuration (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_parm import cli  # noqa: E402
from megatron_parm.wording import plural  # noqa: E402

cli.setup_warnings()  # before Megatron-Core is imported

import torch.distributed as dist  # noqa: E402


def parse_args(argv=None):
    from megatron_parm.bench.moe_layer import add_layer_args
    from megatron_parm.bench.op_count import DEFAULT_DISPATCHERS, EXPERT_MODULES

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_layer_args(p, seq_length=128, hidden_size=64, moe_ffn_hidden_size=128)
    p.add_argument("--dispatchers", default=",".join(DEFAULT_DISPATCHERS),
                   help="comma-separated dispatchers; a chunked one as NAME@C or NAME@C/B "
                        "(C chunks forward, B backward)")
    p.add_argument("--experts", default=",".join(EXPERT_MODULES),
                   help=f"comma-separated expert modules, from {', '.join(EXPERT_MODULES)}")
    p.add_argument("--by-op", action="store_true",
                   help="also list, per expert module, the operators each extra chunk of "
                        "every NAME@C adds over NAME@1, by kind and name")
    p.add_argument("--time", action="store_true",
                   help="also time each configuration (interleaved; --passes medians of --iters "
                        "steps) and S2's chunk plan on the host")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu (CPU only): time this process's CPU time, which a shared machine's "
                        "other processes do not inflate; with --threads 1 the step's own work")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--output", default=None, help="append JSON lines here (rank 0)")
    args = p.parse_args(argv)
    from megatron_parm.bench.moe_layer import parse_variant

    args.dispatchers = [d.strip() for d in args.dispatchers.split(",") if d.strip()]
    args.experts = [e.strip() for e in args.experts.split(",") if e.strip()]
    for entry in args.dispatchers:
        try:
            parse_variant(entry)
        except ValueError as err:
            p.error(f"--dispatchers: {err}")
    for name in args.experts:
        if name not in EXPERT_MODULES:
            p.error(f"--experts: {name!r} is not one of {', '.join(EXPERT_MODULES)}")
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    if min(args.passes, args.iters) < 1 or args.warmup < 0:
        p.error("--passes and --iters must be >= 1, --warmup >= 0")
    return args


def spec_from_args(args):
    from megatron_parm.bench.moe_layer import MoELayerSpec

    return MoELayerSpec(
        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, hidden_size=args.hidden_size,
        ffn_hidden_size=args.moe_ffn_hidden_size, num_experts=args.num_experts, topk=args.moe_router_topk,
        capacity_factor=args.moe_expert_capacity_factor, pad_to_capacity=args.moe_pad_expert_input_to_capacity,
        tp=args.tensor_model_parallel_size, ep=args.expert_model_parallel_size,
        etp=args.expert_tensor_parallel_size, sequence_parallel=args.sequence_parallel)


def format_counts(spec, counts) -> str:
    from megatron_parm.bench.op_count import per_chunk

    gpu = any(c.kernels is not None for by_variant in counts.values() for c in by_variant.values())
    columns = ["ops", "device", "gemms", "collectives", "host", "view", "alloc"]
    columns += ["kernels", "launches"] if gpu else []
    short = {"collectives": "coll"}
    head = "".join(f"{short.get(c, c):>8}" for c in columns)
    lines = [f"MoE layer: S={spec.seq_length} B={spec.micro_batch_size} M={spec.hidden_size} "
             f"F={spec.ffn_hidden_size} E={spec.num_experts} k={spec.topk} | tp={spec.tp} "
             f"ep={spec.ep} etp={spec.etp} | world={dist.get_world_size()} | one forward+backward, "
             f"per rank (largest)",
             f"{'experts':<16} {'dispatcher':<12}{head}   per extra chunk: ops/device/gemms/coll"
             + ("/kernels" if gpu else "")]
    for impl, by_variant in counts.items():
        for variant, c in by_variant.items():
            row = c.row()
            cells = "".join(f"{row[col] if row[col] is not None else '-':>8}" for col in columns)
            extra = [per_chunk(by_variant, variant, q)
                     for q in ["ops", "device", "gemms", "collectives"] + (["kernels"] if gpu else [])]
            tail = "   " + " / ".join(f"{v:.1f}" for v in extra) if extra[0] is not None else ""
            lines.append(f"{impl:<16} {variant:<12}{cells}{tail}")
    return "\n".join(lines)


def format_by_op(counts) -> str:
    """Per expert module and NAME@C: the operators each chunk beyond the first adds."""
    from megatron_parm.bench.moe_layer import parse_variant

    lines = []
    for impl, by_variant in counts.items():
        for variant, c in by_variant.items():
            name, chunks, _ = parse_variant(variant)
            one = by_variant.get(f"{name}@1")
            if not chunks or chunks == 1 or one is None:
                continue
            keys = sorted(set(c.by_op) | set(one.by_op))
            diff = {k: (c.by_op.get(k, 0) - one.by_op.get(k, 0)) / (chunks - 1) for k in keys}
            shown = ", ".join(f"{k} {v:g}" for k, v in sorted(diff.items(), key=lambda kv: (-kv[1], kv[0]))
                              if v)
            lines.append(f"{impl} {variant}, per extra chunk: {shown}")
    return "\n".join(lines)


def format_times(spec, medians, plan_seconds, clock="wall") -> str:
    from megatron_parm.bench.moe_layer import parse_variant

    lines = [f"step time ({clock} clock), forward+backward: median of {len(next(iter(medians.values())))} pass "
             f"medians (min-max of the pass medians)"]
    for key, values in medians.items():
        impl, variant = key.split("/", 1)
        mid = statistics.median(values)
        cell = f"{impl:<16} {variant:<12} {1e3 * mid:9.2f} ms ({1e3 * min(values):.2f}-{1e3 * max(values):.2f})"
        name, chunks, _ = parse_variant(variant)
        one = medians.get(f"{impl}/{name}@1")
        if chunks and chunks > 1 and one is not None:
            base = statistics.median(one)
            cell += f"   per extra chunk {1e3 * (mid - base) / (chunks - 1):+.2f} ms = " \
                    f"{100 * (mid - base) / (chunks - 1) / base:+.1f}% of @1"
        lines.append(cell)
    if plan_seconds:
        lines.append("S2's chunk plan on the host (ChunkPlan, median CPU time): " + ", ".join(
            f"{plural(c, 'chunk')} {1e6 * s:.0f} us" for c, s in plan_seconds.items()))
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    from megatron_parm.training.trainer import initialize_distributed

    initialize_distributed()  # torchrun's group, or without RANK (plain python) one process
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_parm.bench.moe_layer import parse_variant
    from megatron_parm.bench.op_count import chunk_plan_seconds, count_all, time_layers
    from megatron_parm.parallel import initialize_model_parallel

    spec = spec_from_args(args)
    for name in {parse_variant(v)[0] for v in args.dispatchers}:
        initialize_model_parallel(spec.tp, spec.ep, spec.etp, num_experts=spec.num_experts,
                                  dispatcher=name)
    model_parallel_cuda_manual_seed(1234)
    counts = count_all(spec, args.dispatchers, args.experts)
    medians = plan = None
    if args.time:
        medians = time_layers(spec, args.dispatchers, args.experts, args.passes, args.iters,
                              args.warmup, args.clock)
        chunk_counts = sorted({parse_variant(v)[1] for v in args.dispatchers if parse_variant(v)[1]})
        if chunk_counts and dist.get_world_size() == 1:
            plan = chunk_plan_seconds(spec, chunk_counts)
    if dist.get_rank() != 0:
        return
    print(format_counts(spec, counts), flush=True)
    if args.by_op:
        print(format_by_op(counts), flush=True)
    if medians is not None:
        print(format_times(spec, medians, plan, args.clock), flush=True)
    if args.output:
        with open(args.output, "a") as f:
            for impl, by_variant in counts.items():
                for variant, c in by_variant.items():
                    record = dict(c.row(), by_op=c.by_op, world_size=dist.get_world_size(),
                                  step_s=medians.get(f"{impl}/{variant}") if medians else None)
                    record.update({k: v for k, v in vars(spec).items()
                                   if k not in ("extra", "params_dtype", "layout")})
                    f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    cli.run(main)
