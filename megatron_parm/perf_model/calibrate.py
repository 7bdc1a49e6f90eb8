"""Calibration: fit a cluster's alpha-beta profile to measurements of its real process groups.

tools/calibrate.py is the entry point. This module is its pure half (size parsing, link
classes, fitting, tables; no torch, no process group); the measuring half, which times
collectives and expert compute on the process groups, is megatron_parm/bench/calibrate.py.

Notation:
    g     ranks in the group being timed
    S     a message size from --sizes: bytes of the whole tensor of one rank, i.e. the A2A
          input, the AG output (each rank contributes S/g), the RS input, the AR tensor
    x     bytes one rank sends, by the project's accounting convention (comm/accounting.py,
          perf_model/volumes.py): A2A, AG, RS: S*(g-1)/g; AR: 2*S*(g-1)/g. This is the x of
          every fit, read from the accounting itself, so it is exactly the model's bytes.
    rows  rows through one expert (compute), M hidden size, H FFN hidden size over ETP

How a number is measured (the same for collectives and compute):
    every rank runs the operation at once on its own group (all groups of a kind together,
    as in a layer, so links are shared as they are there), after a world barrier; each
    repetition's time is the slowest rank's; a point's time is the median repetition.
    Fits are perf_model.fit_alpha_beta (least squares on the medians) per (kind, link).

Link class of a group kind (the model's rule, perf_model.Layout): rank r is on node
r // ranks_per_node; "intra" when no rank has a peer on another node, "inter" when no rank
has a peer on its own node, "mixed" otherwise. Mixed groups are not timed: their time is the
max of two links, which has no single x axis. Where a layout has no group of a link class,
its entries are copied from the other link class, per kind, and the note says so (a
one-node cluster's profile never reads its inter entries); with neither, it is an error.
"""

from __future__ import annotations

import datetime
import re
import shlex
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_parm.perf_model.layout import Layout
from megatron_parm.perf_model.profile import LINKS, Profile, fit_alpha_beta
from megatron_parm.schedules import COLLECTIVE_KINDS
from megatron_parm.wording import plural

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1024 ** 2, "mb": 1024 ** 2,
          "mib": 1024 ** 2, "g": 1024 ** 3, "gb": 1024 ** 3, "gib": 1024 ** 3}


# ----------------------------------------------------------------------------------------
# pure: flags, layout, fitting, tables
# ----------------------------------------------------------------------------------------


def parse_bytes(text: str, flag: str) -> int:
    """'16KiB' -> 16384 (K/KB/KiB are all 1024; plain numbers are bytes)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{flag}: cannot read {text!r} as a size (e.g. 4096, 16KiB, 8MiB)")
    value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value < 1:
        raise ValueError(f"{flag}: sizes must be at least 1 byte, got {text!r}")
    return value


def parse_range(text: str, flag: str, parse=None) -> List[int]:
    """'LO..HI' (doubling), 'LO..HI:N' (N points, geometric) or 'A,B,C' -> sorted values."""
    parse = parse or (lambda item: parse_bytes(item, flag))
    text = text.strip()
    if ".." in text:
        points = None
        if ":" in text:
            text, count = text.rsplit(":", 1)
            if not count.strip().isdigit() or int(count) < 2:
                raise ValueError(f"{flag}: the point count after ':' must be an integer >= 2, "
                                 f"got {count!r}")
            points = int(count)
        low_text, high_text = text.split("..", 1)
        low, high = parse(low_text), parse(high_text)
        if high <= low:
            raise ValueError(f"{flag}: range {low_text}..{high_text} must go up")
        if points is None:
            values, value = [], low
            while value < high:
                values.append(value)
                value *= 2
            values.append(high)
        else:
            ratio = (high / low) ** (1.0 / (points - 1))
            values = [int(round(low * ratio ** i)) for i in range(points)]
    else:
        values = [parse(item) for item in text.split(",") if item.strip()]
    values = sorted(set(values))
    if len(values) < 2:
        raise ValueError(f"{flag}: need at least two different values to fit a line, got {text!r}")
    return values


def parse_int(text: str, flag: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"{flag}: expected a positive integer, got {text!r}")
    return int(text)


def default_layout_sizes(world_size: int, ranks_per_node: int) -> Tuple[int, int, int]:
    """(tp, ep, etp) with TP = ETP = one node and EP across nodes: one intra and one inter group."""
    if ranks_per_node < 1 or world_size % ranks_per_node != 0:
        return 1, world_size, 1
    return ranks_per_node, world_size // ranks_per_node, ranks_per_node


def link_class(layout: Layout, group_name: str) -> str:
    """'intra', 'inter', 'mixed' (peers on both), or 'none' (a group of one rank)."""
    if layout.group_size(group_name) == 1:
        return "none"
    counts = [layout.peer_counts(group_name, rank) for rank in range(layout.world_size)]
    if all(inter == 0 for _, inter in counts):
        return "intra"
    if all(intra == 0 for intra, _ in counts):
        return "inter"
    return "mixed"


def groups_to_time(layout: Layout) -> List[Tuple[str, str]]:
    """[(group name, link class)] of the group kinds worth timing: distinct rank sets only
    (TP and ETP are the same groups when tp == etp), mixed and one-rank groups left out."""
    chosen, seen = [], set()
    for name in ("expt_tp", "tp", "ep"):
        link = link_class(layout, name)
        if link not in LINKS:
            continue
        ranks = tuple(tuple(layout.group_ranks(name, rank)) for rank in range(layout.world_size))
        if ranks in seen:
            continue
        seen.add(ranks)
        chosen.append((name, link))
    return chosen


@dataclass
class Point:
    """One measured point: a collective (or compute) at one size, over its repetitions."""

    kind: str  # a collective kind or "compute"
    link: str  # "intra", "inter"; "" for compute
    group: str  # group name ("ep", ...) or a compute label ("forward", "backward")
    size: int  # S (collectives) or rows (compute)
    x: float  # bytes sent per rank, or flops
    times: List[float] = field(default_factory=list)  # slowest rank's seconds, per repetition

    @property
    def seconds(self) -> float:
        return statistics.median(self.times)


@dataclass
class Fit:
    kind: str
    link: str
    alpha: float
    beta: float
    points: List[Point]
    copied_from: Optional[str] = None  # link class the numbers were copied from

    def predict(self, x: float) -> float:
        return self.alpha + self.beta * x

    def residuals(self) -> List[float]:
        """(predicted - measured) / measured per point."""
        return [(self.predict(p.x) - p.seconds) / p.seconds for p in self.points]


def fit_points(points: Sequence[Point]) -> Dict[Tuple[str, str], Fit]:
    """One least-squares fit per (kind, link) over the points' medians; compute under
    ("compute", "")."""
    grouped: Dict[Tuple[str, str], List[Point]] = {}
    for point in points:
        grouped.setdefault((point.kind, point.link), []).append(point)
    fits = {}
    for key, members in grouped.items():
        alpha, beta = fit_alpha_beta((p.x, p.seconds) for p in members)
        fits[key] = Fit(key[0], key[1], alpha, beta, list(members))
    return fits


def fill_missing(fits: Dict[Tuple[str, str], Fit], base: Optional[Profile] = None) -> List[str]:
    """Copy each kind's missing link class from the other one; returns what was copied.
    A kind measured on neither link class (one rank: no group) is copied from `base`
    (--base-profile) where given, else a ValueError.
    """
    copied = []
    for kind in COLLECTIVE_KINDS:
        have = [link for link in LINKS if (kind, link) in fits]
        if not have and base is not None:
            for link in LINKS:
                fits[(kind, link)] = Fit(kind, link, base.alpha[kind][link],
                                         base.beta[kind][link], [],
                                         copied_from=f"--base-profile {base.name}")
                copied.append(f"{kind}.{link} <- {base.name}")
            continue
        if not have:
            raise ValueError(
                f"no {kind} measurement on any link class: every group of the layout has one "
                f"rank (or mixes intra- and inter-node peers); choose "
                f"--tensor-model-parallel-size / --expert-model-parallel-size / "
                f"--expert-tensor-parallel-size so a group spans 2+ ranks of one node or of "
                f"different nodes")
        for link in LINKS:
            if (kind, link) not in fits:
                source = fits[(kind, have[0])]
                fits[(kind, link)] = Fit(kind, link, source.alpha, source.beta, [],
                                         copied_from=have[0])
                copied.append(f"{kind}.{link} <- {kind}.{have[0]}")
    if ("compute", "") not in fits:
        raise ValueError("no compute measurement")
    return copied


def build_profile(fits: Dict[Tuple[str, str], Fit], name: str, note: str,
                  base: Optional[Profile] = None) -> Profile:
    """The fitted alpha-beta terms; the other TERMS are base's (--base-profile), else missing
    until fit_layer_terms / fit_framework_terms fit them. Collective terms copied from an
    estimate base leave the profile an estimate."""
    from megatron_parm.perf_model.profile import TERMS

    from_base = any(fit.copied_from and fit.copied_from.startswith("--base-profile")
                    for fit in fits.values())
    terms = ({term: getattr(base, term) for term in TERMS} if base is not None else {})
    return Profile(
        name=name,
        provenance=base.provenance if from_base else "measured",
        note=note,
        **terms,
        missing_terms=base.missing_terms if base is not None else tuple(TERMS),
        alpha={kind: {link: fits[(kind, link)].alpha for link in LINKS}
               for kind in COLLECTIVE_KINDS},
        beta={kind: {link: fits[(kind, link)].beta for link in LINKS}
              for kind in COLLECTIVE_KINDS},
        compute_alpha=fits[("compute", "")].alpha,
        compute_beta=fits[("compute", "")].beta,
    )


def layer_shape(layer_spec) -> "LayerShape":
    """The performance model's shape of a benchmark MoELayerSpec (shape.layer_shape: the
    tokens per rank are S / t * B with or without sequence parallelism)."""
    from megatron_parm.perf_model.shape import layer_shape as shape_of_layer

    return shape_of_layer(seq_length=layer_spec.seq_length,
                          micro_batch_size=layer_spec.micro_batch_size, tp=layer_spec.tp,
                          hidden_size=layer_spec.hidden_size,
                          ffn_hidden_size=layer_spec.ffn_hidden_size,
                          num_experts=layer_spec.num_experts, topk=layer_spec.topk,
                          capacity_factor=layer_spec.capacity_factor,
                          pad_to_capacity=layer_spec.pad_to_capacity, dtype_bytes=4)


def layer_fit_schedules() -> Tuple[str, str]:
    """The schedules the in-layer terms are fitted on: the catalog's first unchunked and first
    chunked candidate (parm_s1, parm_s2). A measurement at 1 chunk is of the first, at c >= 2
    of the second at c chunks."""
    from megatron_parm import schedules

    sequential = next(s.name for s in schedules.candidates() if not s.chunked)
    chunked = next(s.name for s in schedules.candidates() if s.chunked)
    return sequential, chunked


def spec_layout(spec, layout: Layout) -> Layout:
    """The layout a measured layer ran on: the spec's (tp, ep, etp) where it has them, on the
    calibrated cluster's nodes (layout's nodes and ranks per node)."""
    sizes = {name: getattr(spec, name, None) or getattr(layout, name) for name in ("tp", "ep", "etp")}
    if all(sizes[name] == getattr(layout, name) for name in sizes):
        return layout
    return Layout(nodes=layout.nodes, ranks_per_node=layout.ranks_per_node, **sizes)


def grouped_experts(spec) -> bool:
    """Whether a measured layer ran grouped experts (its expert_impl is not SequentialMLP)."""
    return getattr(spec, "expert_impl", "SequentialMLP") != "SequentialMLP"


def _measured_shape(spec) -> "LayerShape":
    import dataclasses

    return dataclasses.replace(layer_shape(spec), grouped_experts=grouped_experts(spec))


def fit_nonnegative(rows: Sequence[Sequence[float]], targets: Sequence[float],
                    weights: Optional[Sequence[float]] = None) -> Tuple[List[float], float]:
    """x >= 0 minimising sum(w * (row . x - target)^2), and that sum; weights default to
    1 / target^2 (relative least squares). Small problems only: every subset of free unknowns
    is solved exactly (normal equations) and the best feasible kept; an unknown no row
    varies stays 0."""
    import itertools

    count = len(rows[0]) if rows else 0
    if weights is None:
        weights = [1.0 / max(abs(t), 1e-12) ** 2 for t in targets]

    def error(x):
        return sum(w * (sum(a * b for a, b in zip(row, x)) - t) ** 2
                   for row, t, w in zip(rows, targets, weights))

    best = ([0.0] * count, error([0.0] * count))
    for size in range(1, count + 1):
        for free in itertools.combinations(range(count), size):
            matrix = [[sum(w * row[i] * row[j] for row, w in zip(rows, weights)) for j in free]
                      for i in free]
            vector = [sum(w * row[i] * t for row, t, w in zip(rows, targets, weights)) for i in free]
            solution = _solve(matrix, vector)
            if solution is None or min(solution) < 0:
                continue
            x = [0.0] * count
            for index, value in zip(free, solution):
                x[index] = value
            candidate = error(x)
            if candidate < best[1] * (1 - 1e-12):
                best = (x, candidate)
    return best


def _solve(matrix: List[List[float]], vector: List[float]) -> Optional[List[float]]:
    """Gaussian elimination with partial pivoting; None where the system is singular."""
    size = len(vector)
    rows = [list(matrix[i]) + [vector[i]] for i in range(size)]
    scale = max((abs(v) for row in matrix for v in row), default=0.0)
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) <= 1e-12 * max(scale, 1e-300):
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(size):
            if r != col:
                factor = rows[r][col] / rows[col][col]
                rows[r] = [a - factor * b for a, b in zip(rows[r], rows[col])]
    return [rows[i][size] / rows[i][i] for i in range(size)]


# The in-layer terms fit_layer_terms fits (perf_model.profile.TERMS says what each stands for)
LAYER_FIT_TERMS = ("layer_scale", "overlap_efficiency", "chunk_overhead", "chunk_expert_overhead")
FRAMEWORK_FIT_TERMS = ("microbatch_overhead", "layer_overhead")


def fit_layer_terms(profile: Profile, layout: Layout,
                    measured: Sequence[Tuple[object, int, float]]) -> Profile:
    """The profile plus its in-layer terms, fitted to the real MoE layer.

    measured: (layer_spec, chunks, seconds) with chunks 1 for parm_s1 and c >= 2 for parm_s2
    at c chunks; each spec on its own (tp, ep, etp) (spec_layout; the calibrated cluster's
    nodes) and expert module (grouped_experts). A prediction is linear in the terms but e
    (predict.py):
        parm_s1:     T = s * S
        parm_s2(c):  T = s * (e * P(c) + (1 - e) * Q(c)) + (c - 1) * (o + o_x * L_seq)
    with S, P(c), Q(c) the stage sums (sequential, ideally pipelined, chunked without
    overlap) and L_seq the local experts with SequentialMLP, 0 with grouped experts. For
    each e on a 1% grid, layer_scale s, chunk_overhead o and chunk_expert_overhead o_x >= 0
    minimise the squared relative errors of all points together (fit_nonnegative); the best
    e wins. A term the points cannot tell apart keeps the profile's value: e where nothing
    overlaps (world size 1: P = Q), o_x where every chunked point has the same L_seq, o and
    o_x without parm_s2 points.
    """
    import dataclasses

    from megatron_parm.perf_model.predict import predict

    sequential, chunked = layer_fit_schedules()
    base = dataclasses.replace(profile, chunk_overhead=0.0, chunk_expert_overhead=0.0,
                               layer_scale=1.0, overlap_efficiency=1.0)
    no_overlap = dataclasses.replace(base, overlap_efficiency=0.0)
    points = []  # (P, Q, c, L_seq, T); at c = 1 P = Q = S
    for spec, chunks, seconds in measured:
        shape, where = _measured_shape(spec), spec_layout(spec, layout)
        if chunks == 1:
            total = predict(sequential, shape, where, base).total_s
            points.append((total, total, 1, 0, seconds))
        else:
            local = 0 if shape.grouped_experts else shape.num_experts // where.ep
            points.append((predict(chunked, shape, where, base, chunks).total_s,
                           predict(chunked, shape, where, no_overlap, chunks).total_s,
                           chunks, local, seconds))
    if not any(c == 1 for _, _, c, _, _ in points):
        raise ValueError(f"fit_layer_terms needs at least one {sequential} measurement")
    chunked_points = [p for p in points if p[2] > 1]
    overlaps = any(abs(P - Q) > 1e-9 * Q for P, Q, c, _, _ in chunked_points)
    expert_counts = {local for _, _, _, local, _ in chunked_points}
    fit_expert = len(expert_counts) > 1
    grid = [step / 100 for step in range(101)] if overlaps else [profile.overlap_efficiency]

    best = None
    for efficiency in grid:
        rows = [[efficiency * P + (1 - efficiency) * Q, c - 1,
                 (c - 1) * local if fit_expert else 0.0] for P, Q, c, local, _ in points]
        x, error = fit_nonnegative(rows, [T for *_, T in points])
        if best is None or error < best[0] - 1e-15:
            best = (error, efficiency, x)
    _, efficiency, (scale, overhead, per_expert) = best
    terms = dict(layer_scale=scale, overlap_efficiency=efficiency)
    if chunked_points:
        terms["chunk_overhead"] = overhead
        if fit_expert:
            terms["chunk_expert_overhead"] = per_expert
    return dataclasses.replace(profile, **terms,
                               missing_terms=tuple(t for t in profile.missing_terms
                                                   if t not in terms))


def format_layer_fit(profile: Profile, layout: Layout,
                     measured: Sequence[Tuple[object, int, float]]) -> str:
    """One line per measured layer: layout, measured, predicted with the fitted terms, error;
    then the largest and median absolute error."""
    import statistics as stats

    from megatron_parm.perf_model.predict import predict

    sequential, chunked = layer_fit_schedules()
    lines, errors = [], []
    for spec, chunks, seconds in measured:
        shape, where = _measured_shape(spec), spec_layout(spec, layout)
        if chunks == 1:
            label, predicted = sequential, predict(sequential, shape, where, profile).total_s
        else:
            label, predicted = f"{chunked} c={chunks}", predict(chunked, shape, where, profile,
                                                                chunks).total_s
        error = (predicted - seconds) / seconds
        errors.append(abs(error))
        experts = "grouped" if shape.grouped_experts else "seq"
        lines.append(f"  ({where.tp},{where.ep},{where.etp}) {shape.num_tokens:>6} tokens "
                     f"{shape.num_experts:>3} experts {experts:<7} {label:<12} "
                     f"measured {1e3 * seconds:8.1f} ms  model {1e3 * predicted:8.1f} ms  "
                     f"{100 * error:+6.1f}%")
    if errors:
        lines.append(f"  layer fit: |error| median {100 * stats.median(errors):.1f}%, max "
                     f"{100 * max(errors):.1f}% over {plural(len(errors), 'layer')}")
    return "\n".join(lines)


def fit_framework_terms(profile: Profile, measured: Sequence[Tuple[object, Layout, int, int, float]],
                        precision=None) -> Profile:
    """The profile plus microbatch_overhead and layer_overhead, fitted to whole-model steps.

    measured: (ModelSpec, layout, micro_batch_size, micro-batches, seconds of their forward +
    backward). The step-time model without framework terms predicts W per micro-batch
    (step_time.py, the profile's other terms); the rest, T - m * W, is
    m * (microbatch_overhead + num_layers * layer_overhead), fitted >= 0 by relative least
    squares (fit_nonnegative). With a single layer count layer_overhead keeps the profile's
    value and microbatch_overhead takes it all.
    """
    import dataclasses

    from megatron_parm.perf_model.memory import Precision
    from megatron_parm.perf_model.step_time import step_time

    precision = precision or Precision("fp32")
    bare = dataclasses.replace(profile, microbatch_overhead=0.0, layer_overhead=0.0)
    sequential, _ = layer_fit_schedules()
    rows, targets = [], []
    for spec, where, micro_batch, count, seconds in measured:
        data_parallel = where.world_size // where.tp
        step = step_time(spec, where, bare, sequential, None, micro_batch,
                         micro_batch * data_parallel * count, precision)
        rows.append([count, count * spec.num_layers])
        targets.append(seconds - count * step.microbatch_s)
    if not rows:
        raise ValueError("fit_framework_terms needs at least one measured step")
    vary_layers = len({spec.num_layers for spec, *_ in measured}) > 1
    if not vary_layers:
        rows = [row[:1] for row in rows]
    # relative to the measured step (the rest itself may be near 0 or negative)
    x, _ = fit_nonnegative(rows, targets, [1.0 / seconds ** 2 for *_, seconds in measured])
    terms = {"microbatch_overhead": x[0]}
    if vary_layers:
        terms["layer_overhead"] = x[1]
    return dataclasses.replace(profile, **terms,
                               missing_terms=tuple(t for t in profile.missing_terms
                                                   if t not in terms))


def format_framework_fit(profile: Profile,
                         measured: Sequence[Tuple[object, Layout, int, int, float]]) -> str:
    """One line per timed model step: measured, the step-time model with the fitted terms."""
    from megatron_parm.perf_model.memory import Precision
    from megatron_parm.perf_model.step_time import step_time

    sequential, _ = layer_fit_schedules()
    lines = []
    for spec, where, micro_batch, count, seconds in measured:
        step = step_time(spec, where, profile, sequential, None, micro_batch,
                         micro_batch * (where.world_size // where.tp) * count, Precision("fp32"))
        predicted = count * step.microbatch_s
        lines.append(f"  {plural(spec.num_layers, 'layer')} x {plural(count, 'micro-batch')}: "
                     f"measured "
                     f"{1e3 * seconds:8.1f} ms  model {1e3 * predicted:8.1f} ms "
                     f"(framework {1e3 * count * step.framework_s:.1f} ms)  "
                     f"{100 * (predicted - seconds) / seconds:+6.1f}%")
    return "\n".join(lines)


def _human_bytes(value: float) -> str:
    for unit, scale in (("MiB", 1024 ** 2), ("KiB", 1024)):
        if value >= scale:
            return f"{value / scale:.4g} {unit}"
    return f"{value:.0f} B"


def format_fit_table(fits: Dict[Tuple[str, str], Fit]) -> str:
    """The fitted numbers, one line per (kind, link), with the effective per-rank bandwidth."""
    lines = [f"{'kind':<15} {'link':<6} {'alpha (ms)':>10} {'beta (s/B)':>11} "
             f"{'per-rank Mbit/s':>15} {'max |resid|':>11}  source"]
    for kind in COLLECTIVE_KINDS:
        for link in LINKS:
            fit = fits[(kind, link)]
            rate = 8.0 / fit.beta / 1e6 if fit.beta > 0 else float("inf")
            if fit.copied_from:
                worst, source = f"{'-':>11}", f"copied from {fit.copied_from}"
            else:
                worst = f"{max(abs(r) for r in fit.residuals()):>10.1%}"
                source = f"{len(fit.points)} sizes"
            lines.append(f"{kind:<15} {link:<6} {fit.alpha * 1e3:>10.3f} {fit.beta:>11.3e} "
                         f"{rate:>15.1f} {worst}  {source}")
    fit = fits[("compute", "")]
    worst = max(abs(r) for r in fit.residuals())  # compute is always measured
    gflops = 1e-9 / fit.beta if fit.beta > 0 else float("inf")
    lines.append(f"{'compute':<15} {'':<6} {fit.alpha * 1e3:>10.3f} {fit.beta:>11.3e} "
                 f"{'':>15} {worst:>10.1%}  s/flop = {gflops:.2f} GFLOP/s, "
                 f"{len(fit.points)} points")
    # The model has one compute line for both directions; show how far apart they are.
    for label in ("forward", "backward"):
        members = [p for p in fit.points if p.group == label]
        if len({p.x for p in members}) >= 2:
            alpha, beta = fit_alpha_beta((p.x, p.seconds) for p in members)
            lines.append(f"{'  ' + label + ' only':<22} {alpha * 1e3:>10.3f} {beta:>11.3e}"
                         f"{'':>28}  (for comparison; not written)")
    return "\n".join(lines)


def format_residual_table(fits: Dict[Tuple[str, str], Fit]) -> str:
    """Every measured point against its fit: (predicted - measured) / measured."""
    lines = [f"{'kind':<15} {'link':<6} {'group':<8} {'size':>10} {'x':>12} "
             f"{'measured ms':>11} {'fit ms':>9} {'resid':>7}"]
    for key in sorted(fits, key=lambda k: (k[0] == "compute", k)):
        fit = fits[key]
        for point, resid in zip(fit.points, fit.residuals()):
            if point.kind == "compute":
                size, x = f"{point.size} rows", f"{point.x / 1e6:.4g} MFLOP"
            else:
                size, x = _human_bytes(point.size), _human_bytes(point.x)
            lines.append(f"{point.kind:<15} {point.link:<6} {point.group:<8} {size:>10} "
                         f"{x:>12} {point.seconds * 1e3:>11.3f} {fit.predict(point.x) * 1e3:>9.3f} "
                         f"{resid:>+7.1%}")
    return "\n".join(lines)


def describe_run(argv: Sequence[str], layout: Layout, timed: Sequence[Tuple[str, str]],
                 copied: Sequence[str], rates: Dict[str, str], extra: str,
                 compute_shape: str) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    groups = ", ".join(f"{name}={layout.group_size(name)} ({link})" for name, link in timed)
    parts = [
        f"Measured by tools/calibrate.py on {now}.",
        f"World {layout.world_size} = {plural(layout.nodes, 'node')} x "
        f"{plural(layout.ranks_per_node, 'rank')}; "
        f"tp={layout.tp} ep={layout.ep} etp={layout.etp}; timed groups: {groups}.",
    ]
    if rates:
        parts.append("tc rate limits seen on rank 0: "
                     + ", ".join(f"{dev} {rate}" for dev, rate in rates.items()) + ".")
    if copied:
        parts.append("NOT measured (no group of that link class on this layout), copied: "
                     + "; ".join(copied) + ".")
    parts.append(f"Compute: {compute_shape}.")
    if extra:
        parts.append(extra.rstrip(".") + ".")
    parts.append("Command: " + shlex.join(argv))
    return " ".join(parts)


def expert_flops(rows: int, hidden: int, ffn_local: int) -> float:
    """Forward flops of `rows` rows through fc1 [M, H_local] and fc2 [H_local, M], as
    LayerShape.expert_flops_per_row counts them (2 per multiply-add; the activation is free).
    The backward is twice this (grads of input and of both weights)."""
    return rows * (2.0 * hidden * ffn_local + 2.0 * ffn_local * hidden)


def fit_chunk_costs(per_chunk: Sequence[Tuple[int, float]]) -> Tuple[float, float, float]:
    """(chunk_overhead, chunk_expert_overhead, largest relative error) fitted to measured
    costs of one extra chunk, (local experts with SequentialMLP, seconds), where nothing
    overlaps (world size 1: e.g. tools/gpu_check.py stage e's per_extra_chunk_ms)."""
    rows = [[1.0, float(local)] for local, _ in per_chunk]
    targets = [seconds for _, seconds in per_chunk]
    (overhead, per_expert), _ = fit_nonnegative(rows, targets)
    worst = max(abs(overhead + per_expert * row[1] - t) / t for row, t in zip(rows, targets))
    return overhead, per_expert, worst
