"""Per-label summaries of the grid (ratios, spreads, parm's choice, memory, expert
implementations) and the goals they are checked against."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Dict, List, Optional

from megatron_parm.bench.report.records import (
    AT_LEAST, BASELINE, ConfigResult, MEMORY, REFERENCE, SEQUENTIAL, SHARE_OF, TARGETS, UNSHAPED,
    base_name, choice_variant, is_auto, is_parm, ordered_dispatchers)
from megatron_parm.bench.report.bound import (
    comm_share, efficiency, link_rates, shape_key, time_shares, unshaped_runs)
from megatron_parm.training.implementation import EXPERT_IMPLS


def _stats(values: List[float]) -> Optional[dict]:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _timing_summary(label: str, rows: List[ConfigResult], unshaped: Dict[tuple, ConfigResult]) -> dict:
    best_vs_a2a = [1 / r.ratio(REFERENCE) for r in rows if r.ratio(REFERENCE)]
    best_vs_ds = [1 / r.ratio(BASELINE) for r in rows if r.ratio(BASELINE)]
    slower = [r.config for r in rows if r.ratio(REFERENCE) and
              r.ratio(REFERENCE) < 1.0 - max(r.spread(REFERENCE) or r.step_spread(REFERENCE) or 0, 0.05)]
    payload = [r.payload_inter_bytes for r in rows]
    bytes_ok = all(b[d] <= b[REFERENCE] and b[d] * r.fields["tp"] <= b[BASELINE]
                   for r, b in zip(rows, payload) for d in b
                   if is_parm(d) and REFERENCE in b and BASELINE in b)
    out = dict(
        configs=len({r.config for r in rows}),  # rows: one per config and expert implementation
        median_best_parm_vs_ds_baseline=statistics.median([1 / v for v in best_vs_ds]) if best_vs_ds else None,
        median_best_parm_vs_alltoall=statistics.median([1 / v for v in best_vs_a2a]) if best_vs_a2a else None,
        best_parm_time_vs_alltoall=_stats(best_vs_a2a),
        best_parm_time_vs_ds_baseline=_stats(best_vs_ds),
        slower_than_alltoall_beyond_noise=slower,
        inter_bytes_within_targets=bytes_ok,
    )
    shares = [comm_share(r, unshaped[shape_key(r)]) for r in rows
              if shape_key(r) in unshaped and label != UNSHAPED]
    if any(s is not None for s in shares):
        stats = _stats(shares)
        out["alltoall_comm_share_min_median_max"] = [stats["min"], stats["median"], stats["max"]]
    for auto in sorted({d for r in rows for d in r.median_ms if is_auto(d)}):
        # parm's pick is right if it runs within 5% of the fastest Parm schedule as measured;
        # a mode of parm (parm:model, parm:measured) gets keys of its own (..._measured)
        choices = [r for r in rows if auto in r.median_ms and any(is_parm(d) for d in r.median_ms)]
        if choices:
            mode = auto.partition(":")[2]
            suffix = f"_{mode}" if mode else ""
            out["parm_within_5pct_of_best" + suffix] = sum(
                r.median_ms[auto] <= 1.05 * r.best_parm[1] for r in choices) / len(choices)
            out["parm_time_vs_best_parm" + suffix] = _stats(
                [r.median_ms[auto] / r.best_parm[1] for r in choices])
            # the choice judged by its own fixed schedule's time in the same run (free of the
            # noise of parm's own column; a choice no fixed variant ran is not judged)
            judged = [r.median_ms[v] / r.best_parm[1] for r in choices
                      for v in [choice_variant(r.parm_choices.get(auto, ""))] if v in r.median_ms]
            if judged:
                out["parm_choice_vs_best_parm" + suffix] = dict(
                    _stats(judged), judged=len(judged), of=len(choices),
                    within_5pct=sum(q <= 1.05 for q in judged) / len(judged))
    spreads = [r.spread(d) for r in rows for d in r.median_ms]
    spreads = [s for s in spreads if s is not None]
    if spreads:
        out["medians_run_to_run_spread"] = dict(
            runs=max(len(m) for r in rows for m in r.run_medians.values()),
            median=statistics.median(spreads), max=max(spreads),
            share_below_5pct=sum(s < 0.05 for s in spreads) / len(spreads))
    bounded = [r for r in rows if r.bounds]
    if bounded:
        out["best_parm_time_vs_bound"] = _stats(
            [r.best_parm[1] / r.bounds[r.best_parm[0]].ms for r in bounded
             if any(is_parm(d) for d in r.median_ms) and r.best_parm[0] in r.bounds])
        out["efficiency_median"] = {d: statistics.median(e) for d in ordered_dispatchers(bounded)
                                    for e in [[efficiency(r, d) for r in bounded if efficiency(r, d)]] if e}
        shares = [time_shares(r) for r in bounded]
        shares = [s for s in shares if s]
        if shares:
            compute, inter, intra = (statistics.median(s[i] / s[0] for s in shares) for i in range(3))
            out["alltoall_compute_inter_intra"] = [compute, inter, intra]
    return out


def _memory_summary(rows: List[ConfigResult]) -> dict:
    """Per Parm schedule (every variant and parm), its peak over alltoall's, worst config."""
    out = {}
    for kind, table in (("peak", "peak_bytes"), ("step", "step_peak_bytes")):
        ratios = {}
        for r in rows:
            values = getattr(r, table)
            if REFERENCE not in values:
                continue
            for d, v in values.items():
                if is_parm(d) or base_name(d) == "parm":
                    ratios.setdefault(d, []).append(v / values[REFERENCE])
        out[f"{kind}_vs_alltoall_max"] = {d: max(v) for d, v in ratios.items()}
    worst = out["peak_vs_alltoall_max"]
    out["parm_memory_vs_alltoall_max"] = max(worst.values()) if worst else None
    return out


def several_expert_impls(results: List[ConfigResult]) -> bool:
    """Whether the results differ in their expert implementation."""
    return len({r.expert_impl for r in results}) > 1


def expert_impl_times(rows: List[ConfigResult]) -> Dict[str, Dict[str, dict]]:
    """Per expert implementation other than SequentialMLP, per dispatcher: its time over
    SequentialMLP's in the same label and configuration (min / median / max over configs;
    < 1: faster)."""
    sequential = {(r.label, r.config): r for r in rows if r.expert_impl == SEQUENTIAL}
    ratios: Dict[str, Dict[str, List[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        base = sequential.get((r.label, r.config))
        if r.expert_impl == SEQUENTIAL or base is None:
            continue
        for d, t in r.median_ms.items():
            if base.median_ms.get(d):
                ratios[r.expert_impl][d].append(t / base.median_ms[d])
    return {impl: {d: _stats(v) for d, v in per.items()} for impl, per in ratios.items()}


def summarize(results: List[ConfigResult]) -> Dict[str, dict]:
    """Per label: medians of the best Parm schedule's ratios, bounds, spreads, memory, and
    the targets (``targets``: one entry per target with its value, limit and whether met).
    Where a label's rows differ in expert implementation, ``expert_impls`` lists them and
    ``time_vs_sequential_experts`` compares their times (expert_impl_times)."""
    by_label: Dict[str, List[ConfigResult]] = defaultdict(list)
    for res in results:
        by_label[res.label].append(res)
    unshaped = unshaped_runs(results)
    summary = {}
    for label, rows in by_label.items():
        if label == MEMORY:
            summary[label] = dict(configs=len(rows), **_memory_summary(rows))
        else:
            summary[label] = _timing_summary(label, rows, unshaped)
            if all(r.fields.get("world_size") == 1 for r in rows):
                summary[label]["world_size_1_time_vs_alltoall"] = {
                    d: _stats([r.median_ms[d] / r.median_ms[REFERENCE] for r in rows
                               if d in r.median_ms and REFERENCE in r.median_ms])
                    for d in ("parm", "parm_s1")}
        if several_expert_impls(rows):
            summary[label]["expert_impls"] = sorted({r.expert_impl for r in rows},
                                                    key=EXPERT_IMPLS.index)
            if label != MEMORY:
                summary[label]["time_vs_sequential_experts"] = expert_impl_times(rows)
        summary[label]["targets"] = check_targets(label, summary[label])
    return summary


def _value(label: str, summary: dict, target: str) -> Optional[float]:
    def pick(entry, key):
        return entry.get(key) if isinstance(entry, dict) else None

    if target == "best_parm_time_vs_alltoall_median":
        return pick(summary.get("best_parm_time_vs_alltoall"), "median")
    if target == "best_parm_time_vs_ds_baseline_median":
        return pick(summary.get("best_parm_time_vs_ds_baseline"), "median")
    if target == "best_parm_time_vs_alltoall_max":
        return pick(summary.get("best_parm_time_vs_alltoall"), "max")
    if target == "best_parm_time_vs_bound_median":
        return pick(summary.get("best_parm_time_vs_bound"), "median")
    if target in SHARE_OF:  # parm, parm_model, parm_measured
        return summary.get(SHARE_OF[target])
    if target == "medians_run_to_run_spread_median":
        return pick(summary.get("medians_run_to_run_spread"), "median")
    if target == "world_size_1_time_vs_alltoall_max":
        ratios = summary.get("world_size_1_time_vs_alltoall") or {}
        values = [v["max"] for v in ratios.values() if v]
        return max(values) if values else None
    if target == "parm_memory_vs_alltoall_max":
        return summary.get("parm_memory_vs_alltoall_max")
    raise KeyError(target)


def _applies(scope: str, label: str, summary: dict) -> bool:
    if scope == "preset":
        return link_rates(label) is not None
    if scope == "world1":
        return "world_size_1_time_vs_alltoall" in summary
    if scope == "memory":
        return label == MEMORY
    return label != MEMORY


def check_targets(label: str, summary: dict) -> List[dict]:
    """The targets that apply to a label's summary (those with a value), each checked;
    ``by``: how far a missed one is from its limit."""
    out = []
    for target, (scope, limits) in TARGETS.items():
        if not _applies(scope, label, summary):
            continue
        limit = limits.get(label, limits.get(None))
        value = _value(label, summary, target)
        if limit is None or value is None:
            continue
        met = value >= limit if target in AT_LEAST else value <= limit
        out.append(dict(target=target, value=value, limit=limit, met=met,
                        by=None if met else (limit - value if target in AT_LEAST else value - limit)))
    return out
