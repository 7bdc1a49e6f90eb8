"""The performance model against the measurements: its accuracy per label and its
predicted time shares."""

from __future__ import annotations

from typing import Dict, List, Tuple

from megatron_parm import schedules
from megatron_parm.bench.report.records import (
    ConfigResult, MEMORY, REFERENCE, UNSHAPED, base_name, chunks_of)


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
        if r.label in (UNSHAPED, MEMORY) or not r.median_ms:
            continue
        f = r.fields
        per_node = f.get("local_world_size") or f["world_size"]
        layout = Layout(tp=f["tp"], ep=f["ep"], etp=f["etp"], nodes=f["world_size"] // per_node,
                        ranks_per_node=per_node)
        sp = f.get("sequence_parallel", True) and f["tp"] > 1
        shape = layer_shape(SimpleNamespace(**{"capacity_factor": None, "pad_to_capacity": False,
                                               **f}))
        entry = out.setdefault(r.label, {"pairs": [], "within_25pct": 0.0})
        for name in r.median_ms:
            if base_name(name) not in modelled_dispatchers():
                continue
            forward, backward = chunks_of(name, f)
            predicted = 1e3 * predict(base_name(name), shape, layout, profile, forward, sp,
                                      bwd_num_chunks=backward).total_s
            entry["pairs"].append(dict(config=r.config, dispatcher=name, predicted_ms=predicted,
                                       measured_ms=r.median_ms[name],
                                       rel_err=abs(predicted - r.median_ms[name]) / r.median_ms[name]))
    for entry in out.values():
        pairs = entry["pairs"]
        entry["within_25pct"] = sum(p["rel_err"] <= 0.25 for p in pairs) / len(pairs) if pairs else 0.0
    return out


def model_time_shares(shape, layout, profile, dispatcher: str = REFERENCE) -> Tuple[float, float, float]:
    """(compute, inter-node, intra-node) seconds of one layer step as the model predicts them
    (each stage's time on its resource, forward + backward, without overlap)."""
    from megatron_parm.perf_model import predict

    prediction = predict(dispatcher, shape, layout, profile)
    totals = [0.0, 0.0, 0.0]
    for stage in prediction.stages:
        if stage.kind == schedules.COMPUTE:
            totals[0] += stage.seconds
        else:
            totals[1] += stage.inter_seconds
            totals[2] += stage.intra_seconds
    return tuple(totals)
