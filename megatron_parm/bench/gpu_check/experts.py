"""Stage f of tools/gpu_check.py: the expert implementations side by side, with their goals."""

from __future__ import annotations

import math
from pathlib import Path

from megatron_parm.bench.gpu_check.chunks import CHUNK_COUNTS, chunk_cost_table, profile_step
from megatron_parm.bench.gpu_check.layer import _layer_setup, check_layer_spec


# The goals for the grouped experts: each extra S2 chunk costs at most this % of the
# one-chunk step, per layer; and a grouped implementation's time over SequentialMLP's (each
# variant) is at most GROUPED_OVER_SEQUENTIAL_MAX.
EXPERT_TARGETS = {"gpt2_small_moe": 10.0, "large": 3.0}
GROUPED_OVER_SEQUENTIAL_MAX = 1.0
PROFILED_VARIANT = f"parm_s2@{CHUNK_COUNTS[2]}"  # its profile goes to f_profile.txt


def expert_layer_specs(quick: bool) -> dict:
    """Stage f's layers by name: stage c's (GPT-2-small-MoE) and a larger one (hidden 2048,
    FFN 8192, 8 experts, top-2, 8192 tokens), both bf16; small stand-ins with --quick."""
    import dataclasses

    small = check_layer_spec(quick)
    if quick:
        large = dataclasses.replace(small, hidden_size=128, ffn_hidden_size=256)
    else:
        large = dataclasses.replace(small, seq_length=1024, micro_batch_size=8, hidden_size=2048,
                                    ffn_hidden_size=8192)
    assert set(EXPERT_TARGETS) == {"gpt2_small_moe", "large"}
    return {"gpt2_small_moe": small, "large": large}


def worker_experts(out: Path, quick: bool) -> dict:
    """Stage f: each dispatcher and chunk count with each expert implementation this machine
    has, on two layers: times, per-chunk cost, kernel launches, the targets."""
    import dataclasses

    from megatron_parm.bench.moe_layer import build_expert_layers, by_expert_impl, time_layers
    from megatron_parm import device
    from megatron_parm.training.implementation import EXPERT_IMPLS

    _layer_setup(quick)
    variants = ["alltoall", "parm_s1"] + [f"parm_s2@{c}" for c in CHUNK_COUNTS]
    sequential = EXPERT_IMPLS[0]
    layers_out, targets, tables = {}, [], []
    for layer_name, spec in expert_layer_specs(quick).items():
        problems = {impl: dataclasses.replace(spec, expert_impl=impl).expert_problem()
                    for impl in EXPERT_IMPLS}
        impls = [impl for impl, problem in problems.items() if problem is None]
        layers = build_expert_layers(spec, variants, impls)
        timings = by_expert_impl(time_layers(layers, spec, warmup=1 if quick else 3,
                                             iters=3 if quick else 20, seed=1234))
        per_impl = {}
        for impl in impls:
            table = chunk_cost_table(timings[impl])
            launches = {}
            for name in variants:
                # warmed up by the timing already
                launches[name], profile_table = profile_step(layers[(impl, name)], spec,
                                                             row_limit=15, warmup=1)
                if name == PROFILED_VARIANT:
                    tables.append(f"== {layer_name}, {impl}, {name}: one forward+backward, "
                                  f"{launches[name]} kernel launches ==\n{profile_table}")
            for name in variants:
                table[name]["kernel_launches"] = launches[name]
                if impl != sequential and sequential in timings:
                    table[name]["over_sequential"] = round(
                        timings[impl][name].median_ms / timings[sequential][name].median_ms, 3)
            for c in CHUNK_COUNTS[1:]:
                table[f"parm_s2@{c}"]["kernel_launches_per_extra_chunk"] = round(
                    (launches[f"parm_s2@{c}"] - launches["parm_s2@1"]) / (c - 1), 1)
            per_impl[impl] = table
        del layers
        targets += expert_targets(layer_name, per_impl, sequential)
        layers_out[layer_name] = {
            "shape": {"tokens": spec.seq_length * spec.micro_batch_size, "hidden": spec.hidden_size,
                      "ffn": spec.ffn_hidden_size, "experts": spec.num_experts, "topk": spec.topk,
                      "dtype": str(spec.params_dtype)},
            "expert_impls": per_impl,
            "not_run": {impl: problem for impl, problem in problems.items() if problem}}
    (out / "f_profile.txt").write_text("\n\n".join(tables) + "\n")
    finite = all(math.isfinite(v["median_ms"]) and v["median_ms"] > 0
                 for layer in layers_out.values() for table in layer["expert_impls"].values()
                 for v in table.values())
    ran = all(len(layer["expert_impls"]) >= 2 for layer in layers_out.values())
    result = {"status": "passed" if finite and ran else "failed",
              "reason": None if finite and ran else
              "a variant has no valid time" if not finite else
              "fewer than two expert implementations ran",
              "timer": "CUDA events" if device.is_cuda() else "perf_counter (CPU)",
              "layers": layers_out, "targets": targets,
              "targets_met": f"{sum(t['met'] for t in targets)} of {len(targets)}",
              "profile": "f_profile.txt"}
    if not device.is_cuda():
        result["note"] = ("no CUDA: no kernel launches counted, CPU times (a dry run of the "
                          "stage's code; the targets are the GPU's)")
    print_expert_results(result)
    return result


def expert_targets(layer_name: str, per_impl: dict, sequential: str) -> list:
    """The grouped experts' targets on one layer for every grouped implementation that ran: the largest
    cost of an extra S2 chunk (over 2, 4, 8 chunks) in % of the one-chunk step, and the largest
    time over SequentialMLP's (over the variants); each with value, limit and met."""
    out = []
    for impl, table in per_impl.items():
        if impl == sequential:
            continue
        chunk_pct = max(table[f"parm_s2@{c}"]["per_extra_chunk_pct_of_one_chunk"]
                        for c in CHUNK_COUNTS[1:])
        out.append({"target": "per_extra_chunk_pct_max", "layer": layer_name, "expert_impl": impl,
                    "value": chunk_pct, "limit": EXPERT_TARGETS[layer_name],
                    "met": chunk_pct <= EXPERT_TARGETS[layer_name]})
        if sequential in per_impl:
            worst = max(v["over_sequential"] for v in table.values())
            out.append({"target": "time_over_sequential_max", "layer": layer_name,
                        "expert_impl": impl, "value": worst, "limit": GROUPED_OVER_SEQUENTIAL_MAX,
                        "met": worst <= GROUPED_OVER_SEQUENTIAL_MAX})
    return out


def print_expert_results(result: dict) -> None:
    """Stage f's results as lines for the log."""
    for layer_name, layer in result["layers"].items():
        shape = layer["shape"]
        print(f"stage f: {layer_name} (M{shape['hidden']} F{shape['ffn']} E{shape['experts']} "
              f"k{shape['topk']}, {shape['tokens']} tokens, {shape['dtype']}); not run: "
              f"{', '.join(layer['not_run']) or 'none'}", flush=True)
        for impl, table in layer["expert_impls"].items():
            cells = []
            for name, v in table.items():
                extra = (f" (+{v['per_extra_chunk_ms']} ms = {v['per_extra_chunk_pct_of_one_chunk']}%"
                         f" per chunk)" if "per_extra_chunk_ms" in v else "")
                ratio = f" x{v['over_sequential']} of SequentialMLP" if "over_sequential" in v else ""
                cells.append(f"{name} {v['median_ms']} ms{extra}{ratio}, "
                             f"{v['kernel_launches']} launches")
            print(f"  {impl}: " + "; ".join(cells), flush=True)
    for t in result["targets"]:
        print(f"  target {t['target']} ({t['layer']}, {t['expert_impl']}): {t['value']} vs "
              f"{t['limit']}: {'met' if t['met'] else 'MISSED'}", flush=True)
