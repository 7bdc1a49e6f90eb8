"""Stage e of tools/gpu_check.py: what an S2 chunk costs where nothing is to overlap, and one
profiled step."""

from __future__ import annotations

import math
from pathlib import Path

from megatron_parm.bench.gpu_check.layer import _layer_setup


CHUNK_COUNTS = (1, 2, 4, 8)
FEWER_LOCAL_EXPERTS = (4, 2)
LAUNCH_EVENTS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def profile_step(layer, spec, row_limit: int = 25, warmup: int = 2):
    """(kernel launches, table of the top operators) of one profiled forward+backward of
    layer, after `warmup` unprofiled ones; no launches without CUDA."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_parm.bench.moe_layer import _inputs, step
    from megatron_parm import device

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.is_cuda() else [])
    sort_by = "self_cuda_time_total" if device.is_cuda() else "self_cpu_time_total"
    x, grad = _inputs(spec, 5, 2)
    for _ in range(warmup):
        step(layer, x, grad)
    device.synchronize()
    with profile(activities=activities) as prof:
        step(layer, x, grad)
        device.synchronize()
    layer.zero_grad(set_to_none=True)
    averages = prof.key_averages()
    launches = sum(e.count for e in averages if e.key in LAUNCH_EVENTS)
    return launches, averages.table(sort_by=sort_by, row_limit=row_limit)


def worker_chunks(out: Path, quick: bool) -> dict:
    """Stage e: parm_s2's time per extra chunk where nothing is to overlap, and where it goes."""
    import dataclasses

    from megatron_parm.bench.moe_layer import build_layer
    from megatron_parm import device

    spec = _layer_setup(quick)
    variants = (["alltoall", "parm_s1"] + [f"parm_s2@{c}" for c in CHUNK_COUNTS]
                + [f"parm_s2@{CHUNK_COUNTS[2]}/1"])
    per_variant = _chunk_costs(spec, variants, quick)
    # fewer local experts (as with EP > 1): how much of a chunk's cost is per expert
    few = {str(experts): _chunk_costs(dataclasses.replace(spec, num_experts=experts),
                                      ["alltoall"] + [f"parm_s2@{c}" for c in CHUNK_COUNTS], quick)
           for experts in FEWER_LOCAL_EXPERTS}

    launches, tables = {}, []
    for name in ("alltoall", f"parm_s2@{CHUNK_COUNTS[2]}"):
        launches[name], table = profile_step(build_layer(spec, name), spec)
        tables.append(f"== {name}: one forward+backward, {launches[name]} kernel launches ==\n"
                      + table)
    (out / "e_profile.txt").write_text("\n\n".join(tables) + "\n")
    finite = all(math.isfinite(v["median_ms"]) and v["median_ms"] > 0
                 for table in [per_variant, *few.values()] for v in table.values())
    return {"status": "passed" if finite else "failed",
            "reason": None if finite else "a variant has no valid time",
            "timer": "CUDA events" if device.is_cuda() else "perf_counter (CPU)",
            "local_experts": spec.num_experts, "variants": per_variant,
            "variants_by_local_experts": few, "kernel_launches_per_step": launches,
            "profile": "e_profile.txt"}


def _chunk_costs(spec, variants, quick: bool) -> dict:
    """Medians of `variants` on one layer, and S2's cost per chunk beyond the first."""
    from megatron_parm.bench.moe_layer import time_dispatchers

    return chunk_cost_table(time_dispatchers(spec, variants, warmup=1 if quick else 3,
                                             iters=3 if quick else 20))


def chunk_cost_table(timings) -> dict:
    """{variant: median, spread, alltoall over it} of timings (alltoall and parm_s2 at each of
    CHUNK_COUNTS among them), and at c > 1 chunks S2's cost per chunk beyond the first, in ms
    and in % of the one-chunk step."""
    one = timings["parm_s2@1"].median_ms
    table = {name: {"median_ms": round(t.median_ms, 3),
                    "spread_ms": round(max(t.times_ms) - min(t.times_ms), 3),
                    "alltoall_over_this": round(timings["alltoall"].median_ms / t.median_ms, 3)}
             for name, t in timings.items()}
    for c in CHUNK_COUNTS[1:]:  # the cost of each chunk beyond the first, in % of one chunk's step
        extra = (timings[f"parm_s2@{c}"].median_ms - one) / (c - 1)
        table[f"parm_s2@{c}"]["per_extra_chunk_ms"] = round(extra, 3)
        table[f"parm_s2@{c}"]["per_extra_chunk_pct_of_one_chunk"] = round(100 * extra / one, 2)
    return table
