"""The records pooled into one ``ConfigResult`` per (label, configuration, expert
implementation), with the bytes per node and the bound attached."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

from megatron_parm.bench.report.bound import attach_bounds
from megatron_parm.bench.report.records import RECORD_DEFAULTS, ConfigResult, is_metadata


_NOT_FIELDS = ("dispatcher", "median_ms", "times_ms", "bytes", "rank_bytes", "max_diff_vs_alltoall",
               "label", "run", "config", "choice", "peak_bytes", "step_peak_bytes", "memory_kind")


def _node_bytes(record: dict) -> Optional[Tuple[int, int]]:
    """(intra, inter) bytes sent by the busiest node's ranks in one step."""
    per_rank = record.get("rank_bytes")
    if not per_rank:
        return None
    per_node = record.get("local_world_size") or len(per_rank)
    nodes: Dict[int, List[int]] = defaultdict(lambda: [0, 0])
    for rank, sent in enumerate(per_rank):
        nodes[rank // per_node][0] += sent["intra"]
        nodes[rank // per_node][1] += sent["inter"]
    return max(v[0] for v in nodes.values()), max(v[1] for v in nodes.values())


def group_results(records: List[dict]) -> List[ConfigResult]:
    """One ConfigResult per (label, config, expert_impl), sorted so."""
    grouped: Dict[Tuple[str, int, str], ConfigResult] = {}
    times: Dict[Tuple[str, int, str, str, str], List[float]] = defaultdict(list)
    for r in records:
        r = dict(RECORD_DEFAULTS, **{k: v for k, v in r.items() if v is not None or k not in RECORD_DEFAULTS})
        key = (r.get("label", ""), r["config"], r["expert_impl"])
        if key not in grouped:
            grouped[key] = ConfigResult(key[0], key[1], {k: v for k, v in r.items() if k not in _NOT_FIELDS})
        res = grouped[key]
        name = r["dispatcher"]
        if r.get("times_ms"):
            times[key + (name, str(r.get("run", "")))].extend(r["times_ms"])
        if r.get("peak_bytes") is not None:
            res.peak_bytes[name] = r["peak_bytes"]
            res.step_peak_bytes[name] = r["step_peak_bytes"]
        res.inter_bytes[name] = sum(v["inter"] for v in r["bytes"].values())
        res.intra_bytes[name] = sum(v["intra"] for v in r["bytes"].values())
        res.payload_inter_bytes[name] = sum(v["inter"] for k, v in r["bytes"].items() if not is_metadata(name, k))
        node = _node_bytes(r)
        if node is not None:
            res.node_bytes[name] = node
        if r.get("choice"):
            res.parm_choices[name] = r["choice"]
    for (label, config, impl, name, run), steps in times.items():
        res = grouped[(label, config, impl)]
        res.times_ms.setdefault(name, []).extend(steps)
        res.run_medians.setdefault(name, {})[run] = statistics.median(steps)
    for res in grouped.values():
        res.median_ms = {d: statistics.median(t) for d, t in res.times_ms.items()}
    results = [grouped[k] for k in sorted(grouped)]
    attach_bounds(results)
    return results
