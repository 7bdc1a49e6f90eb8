"""Stages c and d of tools/gpu_check.py: one MoE layer at GPT-2-small-MoE shapes, world size
1: every dispatcher timed (c), and its host synchronisations counted (d)."""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

from megatron_parm import schedules


def _init_single_rank():
    import torch.distributed as dist

    from megatron_parm import device, mcore_compat

    device.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(device.backend())
    mcore_compat.setup()


def check_layer_spec(quick: bool):
    import torch

    from megatron_parm.bench.moe_layer import MoELayerSpec

    if quick:
        return MoELayerSpec(seq_length=64, micro_batch_size=2, hidden_size=64, ffn_hidden_size=128,
                            num_experts=8, topk=2, params_dtype=torch.bfloat16, num_chunks=4)
    return MoELayerSpec(seq_length=1024, micro_batch_size=8, hidden_size=768, ffn_hidden_size=3072,
                        num_experts=8, topk=2, params_dtype=torch.bfloat16, num_chunks=4)


def _layer_setup(quick: bool):
    _init_single_rank()
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_parm.parallel import initialize_model_parallel

    spec = check_layer_spec(quick)
    initialize_model_parallel(1, 1, 1, num_experts=spec.num_experts)
    model_parallel_cuda_manual_seed(1234)
    return spec


def worker_layer(out: Path, quick: bool) -> dict:
    """Stage c: every dispatcher's forward+backward time on one layer, ratios to alltoall."""
    import dataclasses

    from megatron_parm.bench.moe_layer import max_output_diff, time_dispatchers
    from megatron_parm import device

    spec = _layer_setup(quick)
    device.reset_peak_memory_stats()
    timings = time_dispatchers(spec, list(schedules.names()), warmup=1 if quick else 3,
                               iters=3 if quick else 10)
    diffs = max_output_diff(spec, list(schedules.names()))
    base = timings["alltoall"].median_ms
    per_dispatcher = {
        name: {"median_ms": round(t.median_ms, 3), "times_ms": [round(v, 3) for v in t.times_ms],
               "alltoall_over_this": round(base / t.median_ms, 3), "choice": t.choice,
               "max_abs_diff_vs_alltoall": diffs.get(name)}
        for name, t in timings.items()}
    finite = all(math.isfinite(d["median_ms"]) and d["median_ms"] > 0 for d in per_dispatcher.values())
    shape = {k: v for k, v in dataclasses.asdict(spec).items() if k not in ("extra", "params_dtype")}
    return {"status": "passed" if finite else "failed",
            "reason": None if finite else "a dispatcher has no valid time",
            "timer": "CUDA events" if device.is_cuda() else "perf_counter (CPU)",
            "shape": dict(shape, dtype=str(spec.params_dtype)), "dispatchers": per_dispatcher,
            "peak_memory_bytes": device.max_memory_allocated()}


def worker_syncs(out: Path, quick: bool) -> dict:
    """Stage d: host synchronisations in one layer call per dispatcher (forward, backward)."""
    import collections
    import warnings

    from megatron_parm.bench.moe_layer import _inputs, build_layer
    from megatron_parm import device

    spec = _layer_setup(quick)
    per_dispatcher = {}
    for name in schedules.names():
        layer = build_layer(spec, name)
        x, grad = _inputs(spec, 7, 2)
        for counting in (False, True):  # a warm-up call first (parm decides on its first)
            inputs = x.detach().requires_grad_()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with device.sync_debug_mode("warn") if counting else contextlib.nullcontext():
                    out, _ = layer(inputs)
                    forward = len(caught)
                    out.backward(grad)
            layer.zero_grad(set_to_none=True)
        syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
        sites = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
        per_dispatcher[name] = {
            "forward": sum(1 for w in caught[:forward] if "synchroniz" in str(w.message).lower()),
            "backward": sum(1 for w in caught[forward:] if "synchroniz" in str(w.message).lower()),
            "sites": dict(sites.most_common(10))}
    result = {"status": "passed", "dispatchers": per_dispatcher,
              "counted_with": "torch.cuda.set_sync_debug_mode('warn')"}
    if not device.is_cuda():
        result["note"] = ("no CUDA: the sync debug mode does nothing, so nothing is counted "
                          "(a dry run of the stage's code)")
    return result
