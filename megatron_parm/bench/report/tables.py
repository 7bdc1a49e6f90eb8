"""The report's Markdown tables and the speedup plot."""

from __future__ import annotations

from typing import List, Optional
from megatron_parm.bench.report.records import (
    BASELINE, ConfigResult, REFERENCE, base_name, is_parm, parm_schedules)
from megatron_parm.bench.report.bound import efficiency
from megatron_parm.bench.report.summary import several_expert_impls


def _fmt(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_table(results: List[ConfigResult], dispatchers: List[str]) -> str:
    """One row per (label, configuration): every dispatcher's median, the best Parm schedule,
    its time over alltoall's and ds_baseline's, its bound and efficiency (and alltoall's),
    parm's choice, the largest run-to-run spread of the row's medians and the inter-node
    bytes of alltoall / S1 / ds_baseline."""
    timed = [d for d in dispatchers if any(d in r.median_ms for r in results)]
    experts = several_expert_impls([r for r in results if r.median_ms])
    head = ["label", "config"] + (["experts"] if experts else []) + ["shape | tp,ep,etp"] + [
        f"{d} ms" for d in timed] + [
        "best Parm", "best / alltoall", "best / ds_baseline", "bound ms", "eff. best",
        "eff. alltoall", "parm chose", "spread", "inter MB a2a/S1/ds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if not r.median_ms:
            continue
        has_parm = any(is_parm(d) for d in r.median_ms)
        best = r.best_parm[0] if has_parm else None
        bound = r.bounds.get(best) if best else None
        spreads = [s for s in (r.spread(d) for d in r.median_ms) if s is not None]
        inter = "/".join(f"{r.inter_bytes.get(d, 0) / 1e6:.1f}" for d in (REFERENCE, "parm_s1", BASELINE))
        cells = [r.label, str(r.config)] + ([r.expert_impl] if experts else []) + [r.shape()] + [
            f"{r.median_ms[d]:.0f}" if d in r.median_ms else "-" for d in timed] + [
            best or "-", _fmt(1 / r.ratio(REFERENCE) if r.ratio(REFERENCE) else None),
            _fmt(1 / r.ratio(BASELINE) if r.ratio(BASELINE) else None),
            f"{bound.ms:.0f}" if bound else "-", _fmt(efficiency(r, best) if best else None),
            _fmt(efficiency(r, REFERENCE)),
            "; ".join(c if d == "parm" else f"{d.partition(':')[2]}: {c}"
                      for d, c in r.parm_choices.items()) or "-",
            f"{100 * max(spreads):.0f}%" if spreads else "-", inter]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def memory_table(results: List[ConfigResult], dispatchers: List[str]) -> str:
    """Peak memory per rank (MB) of every dispatcher per configuration, and the step's rise."""
    rows = [r for r in results if r.peak_bytes]
    if not rows:
        return ""
    measured = [d for d in dispatchers if any(d in r.peak_bytes for r in rows)]
    experts = several_expert_impls(rows)
    head = ["config"] + (["experts"] if experts else []) + ["shape | tp,ep,etp"] + [
        f"{d} MB (step)" for d in measured] + [
        "worst Parm / alltoall", "(step)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        parm = [d for d in r.peak_bytes if is_parm(d) or base_name(d) == "parm"]
        ref, ref_step = r.peak_bytes.get(REFERENCE), r.step_peak_bytes.get(REFERENCE)
        worst = max((r.peak_bytes[d] / ref for d in parm), default=None) if ref else None
        worst_step = max((r.step_peak_bytes[d] / ref_step for d in parm), default=None) if ref_step else None
        cells = [str(r.config)] + ([r.expert_impl] if experts else []) + [r.shape()] + [
            f"{r.peak_bytes[d] / 1e6:.0f} ({r.step_peak_bytes[d] / 1e6:.0f})" if d in r.peak_bytes else "-"
            for d in measured] + [_fmt(worst), _fmt(worst_step)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_series(r: ConfigResult) -> List[str]:
    """What the plot shows per configuration: alltoall, every Parm schedule at its fastest
    timed chunk count, and parm."""
    names = [REFERENCE] + list(parm_schedules()) + ["parm"]
    return [d for d in (r.best_of(n) for n in names) if d]


def plot_speedups(results: List[ConfigResult], path: str) -> None:
    """Per label: speedup over ds_baseline of alltoall, each Parm schedule and parm, with the
    speedup the bound allows (ds_baseline's time / the best Parm schedule's bound)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({r.label for r in results if r.median_ms and BASELINE in r.median_ms})
    if not labels:
        return
    width_configs = max(len([r for r in results if r.label == label]) for label in labels)
    fig, axes = plt.subplots(len(labels), 1, figsize=(max(8, 0.6 * width_configs) + 3, 3.4 * len(labels)),
                             squeeze=False)
    for ax, label in zip(axes[:, 0], labels):
        rows = [r for r in results if r.label == label and BASELINE in r.median_ms]
        xs = range(len(rows))
        series = []
        for r in rows:
            for d in plot_series(r):
                if base_name(d) not in series:
                    series.append(base_name(d))
        width = 0.8 / max(len(series), 1)
        for offset, name in enumerate(series):
            ys = [r.ratio(BASELINE, r.best_of(name)) or 0 if r.best_of(name) else 0 for r in rows]
            ax.bar([x + (offset - (len(series) - 1) / 2) * width for x in xs], ys, width=width,
                   color="#8c8c8c" if name == REFERENCE else None, label=f"{name} vs {BASELINE}")
        bound = [r.median_ms[BASELINE] / r.bounds[r.best_parm[0]].ms
                 if any(is_parm(d) for d in r.median_ms) and r.best_parm[0] in r.bounds else None
                 for r in rows]
        if any(b is not None for b in bound):
            ax.scatter([x for x, b in zip(xs, bound) if b is not None], [b for b in bound if b is not None],
                       marker="_", s=400, color="black", zorder=3, label="at the bound (best Parm)")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(list(xs))
        experts = several_expert_impls(rows)
        ax.set_xticklabels([f"{r.config} {r.expert_impl}" if experts else str(r.config) for r in rows],
                           rotation=90 if experts else 0, fontsize=7 if experts else None)
        ax.set_ylabel(f"speedup over {BASELINE}")
        ax.set_title(f"{label}: forward+backward of one MoE layer, per configuration")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    axes[-1, 0].set_xlabel("configuration (see the table)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
