"""Reading benchmark JSON lines: per-configuration ratios, grid summaries, model accuracy.

A record is one (label, config, dispatcher) line written by tools/bench_moe_layer.py. Pure
Python (matplotlib only for the plot), so reports can be made anywhere.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

from megatron_parm import schedules


def parm_schedules() -> Tuple[str, ...]:
    """Parm's own schedules (the catalog's kind "parm"): "best Parm" is the fastest of these."""
    return schedules.names(schedules.PARM)


def ordered_dispatchers(results: List["ConfigResult"]) -> List[str]:
    """The dispatchers that appear in results, in catalog order."""
    return [d for d in schedules.names() if any(d in r.median_ms for r in results)]


def is_metadata(dispatcher: str, key: str) -> bool:
    """Routing metadata (counts, ds_baseline's routing map), not token payload."""
    group = key.split("/", 1)[1]
    return group.endswith("_counts") or group == "tp_routing" or (dispatcher == "alltoall" and key == "all_gather/tp_ep")


def load_records(paths: Iterable[str]) -> List[dict]:
    records = []
    for path in paths:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{path}:{number}: not a JSON line ({err})") from err
    if not records:
        raise ValueError(f"no records in {', '.join(paths)}")
    return records


@dataclass
class ConfigResult:
    label: str
    config: int
    fields: dict
    median_ms: Dict[str, float] = field(default_factory=dict)
    spread: Dict[str, float] = field(default_factory=dict)  # (max - min) / median of a dispatcher's steps
    inter_bytes: Dict[str, int] = field(default_factory=dict)
    intra_bytes: Dict[str, int] = field(default_factory=dict)
    payload_inter_bytes: Dict[str, int] = field(default_factory=dict)  # without routing metadata
    parm_choice: Optional[str] = None

    @property
    def best_parm(self) -> Tuple[str, float]:
        times = {d: self.median_ms[d] for d in parm_schedules() if d in self.median_ms}
        name = min(times, key=times.get)
        return name, times[name]

    def ratio(self, baseline: str, dispatcher: Optional[str] = None) -> Optional[float]:
        """baseline time / dispatcher time (> 1: dispatcher faster); None if either is missing."""
        if baseline not in self.median_ms:
            return None
        mine = self.best_parm[1] if dispatcher is None else self.median_ms.get(dispatcher)
        return None if mine is None else self.median_ms[baseline] / mine

    def shape(self) -> str:
        f = self.fields
        cap = f.get("capacity_factor")
        return (f"S{f['seq_length']} B{f['micro_batch_size']} M{f['hidden_size']} F{f['ffn_hidden_size']} "
                f"E{f['num_experts']} k{f['topk']}" + (f" cf{cap:g}" if cap else "")
                + f" | {f['tp']},{f['ep']},{f['etp']}")


def group_results(records: List[dict]) -> List[ConfigResult]:
    grouped: Dict[Tuple[str, int], ConfigResult] = {}
    for r in records:
        key = (r.get("label", ""), r["config"])
        if key not in grouped:
            fields = {k: v for k, v in r.items() if k not in (
                "dispatcher", "median_ms", "times_ms", "bytes", "max_diff_vs_alltoall", "label", "config", "choice")}
            grouped[key] = ConfigResult(key[0], key[1], fields)
        res = grouped[key]
        name = r["dispatcher"]
        res.median_ms[name] = r["median_ms"]
        times = r["times_ms"]
        res.spread[name] = (max(times) - min(times)) / statistics.median(times)
        res.inter_bytes[name] = sum(v["inter"] for v in r["bytes"].values())
        res.intra_bytes[name] = sum(v["intra"] for v in r["bytes"].values())
        if r.get("choice"):
            res.parm_choice = r["choice"]
        res.payload_inter_bytes[name] = sum(v["inter"] for k, v in r["bytes"].items() if not is_metadata(name, k))
    return [grouped[k] for k in sorted(grouped)]


def comm_share(shaped: ConfigResult, unshaped: ConfigResult, dispatcher: str = "alltoall") -> Optional[float]:
    """Share of a dispatcher's layer time that the shaped links add: 1 - T(unshaped) / T(shaped)."""
    if dispatcher not in shaped.median_ms or dispatcher not in unshaped.median_ms:
        return None
    return 1.0 - unshaped.median_ms[dispatcher] / shaped.median_ms[dispatcher]


UNSHAPED = "unshaped"


def summarize(results: List[ConfigResult]) -> Dict[str, dict]:
    """Per label: medians of the best Parm schedule's speedups and the targets' checks.

    A run labelled "unshaped" (same grid, links not shaped) gives each other label the
    share of alltoall's time spent on communication.
    """
    by_label: Dict[str, List[ConfigResult]] = defaultdict(list)
    for res in results:
        by_label[res.label].append(res)
    baseline = {r.config: r for r in by_label.get(UNSHAPED, [])}
    summary = {}
    for label, rows in by_label.items():
        vs_ds = [r.ratio("ds_baseline") for r in rows if r.ratio("ds_baseline")]
        vs_a2a = [r.ratio("alltoall") for r in rows if r.ratio("alltoall")]
        slower = [r.config for r in rows if r.ratio("alltoall") and
                  r.ratio("alltoall") < 1.0 - max(r.spread.get("alltoall", 0), 0.05)]
        payload = [r.payload_inter_bytes for r in rows]
        bytes_ok = all(b[d] <= b["alltoall"] and b[d] * r.fields["tp"] <= b["ds_baseline"]
                       for r, b in zip(rows, payload) for d in parm_schedules()
                       if d in b and "alltoall" in b and "ds_baseline" in b)
        summary[label] = dict(
            configs=len(rows),
            median_best_parm_vs_ds_baseline=statistics.median(vs_ds) if vs_ds else None,
            median_best_parm_vs_alltoall=statistics.median(vs_a2a) if vs_a2a else None,
            slower_than_alltoall_beyond_noise=slower,
            inter_bytes_within_targets=bytes_ok,
        )
        shares = [comm_share(r, baseline[r.config]) for r in rows if r.config in baseline and label != UNSHAPED]
        shares = [x for x in shares if x is not None]
        if shares:
            summary[label]["alltoall_comm_share_min_median_max"] = [
                min(shares), statistics.median(shares), max(shares)]
        choices = [r for r in rows if "parm" in r.median_ms]
        if choices:
            # parm's pick is right if it runs within 5% of the fastest Parm schedule as measured
            summary[label]["parm_within_5pct_of_best"] = sum(
                r.median_ms["parm"] <= 1.05 * r.best_parm[1] for r in choices) / len(choices)
    return summary


def markdown_table(results: List[ConfigResult], dispatchers: List[str]) -> str:
    head = ["label", "config", "shape | tp,ep,etp"] + [f"{d} ms" for d in dispatchers] + [
        "best Parm", "x ds_baseline", "x alltoall", "parm chose", "inter MB a2a/S1/ds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        best, _ = r.best_parm
        inter = "/".join(f"{r.inter_bytes.get(d, 0) / 1e6:.1f}" for d in ("alltoall", "parm_s1", "ds_baseline"))
        cells = [r.label, str(r.config), r.shape()] + [
            f"{r.median_ms[d]:.0f}" if d in r.median_ms else "-" for d in dispatchers] + [
            best, _fmt(r.ratio("ds_baseline")), _fmt(r.ratio("alltoall")), r.parm_choice or "-", inter]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def plot_speedups(results: List[ConfigResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({r.label for r in results})
    fig, axes = plt.subplots(len(labels), 1, figsize=(max(8, 0.5 * len(results)), 3.2 * len(labels)),
                             squeeze=False)
    for ax, label in zip(axes[:, 0], labels):
        rows = [r for r in results if r.label == label]
        xs = range(len(rows))
        series = [d for d in (*parm_schedules(), "alltoall") if any(d in r.median_ms for r in rows)]
        width = 0.8 / max(len(series), 1)
        for offset, name in enumerate(series):
            ys = [r.ratio("ds_baseline", name) or 0 for r in rows]
            ax.bar([x + (offset - (len(series) - 1) / 2) * width for x in xs], ys, width=width,
                   color="#8c8c8c" if name == "alltoall" else None, label=f"{name} vs ds_baseline")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([str(r.config) for r in rows])
        ax.set_ylabel("speedup over ds_baseline")
        ax.set_title(f"{label}: forward+backward of one MoE layer, per configuration")
        ax.legend(loc="upper left", fontsize=8)
    axes[-1, 0].set_xlabel("configuration (see the table)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def model_accuracy(results: List[ConfigResult], profile) -> Dict[str, dict]:
    """Predicted vs measured times per label, for the dispatchers the model covers.

    Returns per label: the share of (config, dispatcher) pairs predicted within 25%, and
    per config the predicted/measured pairs, so a report can say where the model is wrong.
    """
    from types import SimpleNamespace

    from megatron_parm.perf_model import Layout, modelled_dispatchers, predict
    from megatron_parm.perf_model.calibrate import layer_shape

    out: Dict[str, dict] = {}
    for r in results:
        if r.label == UNSHAPED:
            continue
        f = r.fields
        per_node = f.get("local_world_size") or f["world_size"]
        layout = Layout(tp=f["tp"], ep=f["ep"], etp=f["etp"], nodes=f["world_size"] // per_node,
                        ranks_per_node=per_node)
        sp = f.get("sequence_parallel", True) and f["tp"] > 1
        shape = layer_shape(SimpleNamespace(**{"sequence_parallel": True, "capacity_factor": None,
                                               "pad_to_capacity": False, **f}))
        entry = out.setdefault(r.label, {"pairs": [], "within_25pct": 0.0})
        for name in modelled_dispatchers():
            if name not in r.median_ms:
                continue
            chunks = schedules.get(name).num_chunks(f.get("num_chunks"))
            predicted = 1e3 * predict(name, shape, layout, profile, chunks, sp).total_s
            entry["pairs"].append(dict(config=r.config, dispatcher=name, predicted_ms=predicted,
                                       measured_ms=r.median_ms[name],
                                       rel_err=abs(predicted - r.median_ms[name]) / r.median_ms[name]))
    for entry in out.values():
        pairs = entry["pairs"]
        entry["within_25pct"] = sum(p["rel_err"] <= 0.25 for p in pairs) / len(pairs) if pairs else 0.0
    return out
