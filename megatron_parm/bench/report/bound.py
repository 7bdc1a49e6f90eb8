"""The bound of a configuration and dispatcher (see the package docstring), efficiency and
the time shares of compute, inter- and intra-node links."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple
from megatron_parm.bench.report.records import Bound, ConfigResult, REFERENCE, UNSHAPED


def link_rates(label: str) -> Optional[Tuple[float, float]]:
    """(inter-node, intra-node) bytes per second of the emulator preset a label names, or None
    (not a preset; a link left unshaped has no rate)."""
    from megatron_parm.emulator import cluster

    if label not in cluster.PRESETS:
        return None
    inter, intra = cluster.resolve_shapes(label, None, None)
    if inter.bits_per_s is None or intra.bits_per_s is None:
        return None
    return inter.bits_per_s / 8.0, intra.bits_per_s / 8.0


def compute_ms(unshaped: Optional[ConfigResult]) -> Optional[float]:
    """The configuration's compute: its fastest dispatcher with unshaped links."""
    if unshaped is None or not unshaped.median_ms:
        return None
    return min(unshaped.median_ms.values())


_SHAPE_FIELDS = ("seq_length", "micro_batch_size", "hidden_size", "ffn_hidden_size", "num_experts",
                 "topk", "capacity_factor", "pad_to_capacity", "tp", "ep", "etp",
                 "sequence_parallel", "world_size", "local_world_size", "expert_impl", "dtype")


def shape_key(r: ConfigResult) -> tuple:
    """What makes two runs' configurations the same layer on the same cluster (labels
    differ only in links), whatever their index in their grids."""
    return tuple(r.fields.get(k) for k in _SHAPE_FIELDS)


def unshaped_runs(results: List[ConfigResult]) -> Dict[tuple, ConfigResult]:
    return {shape_key(r): r for r in results if r.label == UNSHAPED}


def attach_bounds(results: List[ConfigResult]) -> None:
    unshaped = unshaped_runs(results)
    for r in results:
        rates = link_rates(r.label)
        if rates is None:
            continue
        compute = compute_ms(unshaped.get(shape_key(r)))
        for name, (intra, inter) in r.node_bytes.items():
            r.bounds[name] = Bound(1e3 * inter / rates[0], 1e3 * intra / rates[1], compute)


def efficiency(r: ConfigResult, dispatcher: str) -> Optional[float]:
    """bound / measured (1: at the bound)."""
    bound, measured = r.bounds.get(dispatcher), r.median_ms.get(dispatcher)
    return bound.ms / measured if bound and measured else None


def time_shares(r: ConfigResult, dispatcher: str = REFERENCE) -> Optional[Tuple[float, float, float]]:
    """(compute, inter-node, intra-node) time of a dispatcher's step, the link times at the
    preset's rates: the ratio compute : inter : intra the issue asks per preset."""
    bound = r.bounds.get(dispatcher)
    if bound is None or bound.compute_ms is None:
        return None
    return bound.compute_ms, bound.inter_ms, bound.intra_ms


def comm_share(shaped: ConfigResult, unshaped: ConfigResult, dispatcher: str = REFERENCE) -> Optional[float]:
    """Share of a dispatcher's layer time that the shaped links add: 1 - T(unshaped) / T(shaped)."""
    if dispatcher not in shaped.median_ms or dispatcher not in unshaped.median_ms:
        return None
    return 1.0 - unshaped.median_ms[dispatcher] / shaped.median_ms[dispatcher]
