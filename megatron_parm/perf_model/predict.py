"""Predicted time of one MoE layer (forward + backward) and the automatic choice of schedule.

Time of one stage (see volumes.py for the stages and profile.py for the numbers):
    collective: the intra part  alpha[K][intra] + beta[K][intra] * intra_bytes  and the inter
                part  alpha[K][inter] + beta[K][inter] * inter_bytes  run in parallel on their
                own links, so the stage takes the max of the parts that have peers
    compute:    alpha_c + beta_c * flops

Unchunked schedules (ds_baseline, parm_s1, alltoall, allgather): the stages run one after
another: T = sum of stage times.

Chunked schedules (the catalog's `chunked`, e.g. parm_s2) with c chunks: every stage moves
1/c of the bytes and flops (alpha is paid for every chunk). The forward and the backward pass
have their own chunk counts (--parm-num-chunks, --parm-bwd-num-chunks): each pass below is
modelled with its own c. The stages share three resources: the inter-node link (the A2A(EP)s, and anything else
whose peers are off-node), the intra-node link (AG/RS(ESP), on-node A2A peers, AG(TP)) and the
compute units. A chunk occupies each resource for the sum of its stage parts on it, so
    T(c) = sum over stages of stage_time(chunk) + (c - 1) * max(inter, intra, compute busy
           time per chunk)
i.e. one chunk goes through the whole pipeline (fill + drain) and the other c-1 follow at the
rate of the busiest resource. That is the ideal overlap; the cluster may deliver less of it
(on CPUs the ranks' compute and the collectives' copies share cores), so with the profile's
overlap_efficiency e the chunks take
    e * T_pipelined(c) + (1 - e) * c * (sum of stage_time(chunk))    (no overlap at all),
plus what cutting the layer into more chunks costs beyond its stages (whose alphas every
chunk pays, and whose bytes and flops follow the rows per chunk), half of it in each pass
(chunk_costs):
    (c - 1) * o + (c_x - 1) * o_x * L_seq
                       o = chunk_overhead, o_x = chunk_expert_overhead,
                       L_seq = local experts E / e with SequentialMLP (each local expert's
                       GEMMs run again per chunk), 0 with grouped experts (one grouped GEMM
                       per linear per chunk),
                       c_x = lcm(forward c, backward c): the expert graphs are built per
                       sub-chunk, the finer cut both passes share (dispatchers/parm_s2.py),
                       so c = 4 forward and 8 backward runs the experts 8 times each way.
With c = 1 this is exactly the sequential sum of parm_s1. The backward pass is modelled the
same way with its own stages and chunk count.

Every dispatcher's stage sum is multiplied by the profile's layer_scale: the stage terms are
measured one collective at a time, and inside the layer the same work takes longer.
"""

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple, Union

from megatron_parm import schedules
from megatron_parm.perf_model.layout import Layout
from megatron_parm.perf_model.profile import Profile
from megatron_parm.perf_model.shape import LayerShape
from megatron_parm.perf_model.volumes import Step, build_plan

RESOURCES = ("inter", "intra", "compute")
# A schedule name, or (name, forward chunks, backward chunks) for a chunked one.
Schedule = Union[str, Tuple[str, int, int]]


def schedule_label(schedule: Schedule) -> str:
    """'parm_s1', 'parm_s2(c=4)' (both passes at 4 chunks) or 'parm_s2(c=8/4)' (forward/backward)."""
    if isinstance(schedule, str):
        return schedule
    name, forward, backward = schedule
    return f"{name}(c={forward})" if forward == backward else f"{name}(c={forward}/{backward})"


@dataclass(frozen=True)
class StageTime:
    """One stage of the prediction. `seconds` is the time of one chunk of it."""

    direction: str
    name: str
    kind: str
    group: Optional[str]
    seconds: float
    intra_seconds: float  # part on the intra-node link (or compute time for compute stages)
    inter_seconds: float
    intra_bytes: float  # whole layer, not per chunk
    inter_bytes: float
    flops: float


@dataclass(frozen=True)
class Prediction:
    dispatcher: str
    num_chunks: int  # forward chunks
    total_s: float
    forward_s: float
    backward_s: float
    stages: Tuple[StageTime, ...]
    # direction -> resource ("inter", "intra", "compute") -> busy seconds per chunk
    resources: Dict[str, Dict[str, float]]
    bwd_num_chunks: int = 1
    # direction -> seconds of that pass the compute units wait on the layer's collectives (the
    # pass less its compute, both as the layer runs them, before the chunks' own costs): the
    # collective stages' sum unchunked; what work on another stream can fill (step_time.py)
    comm_wait_s: Dict[str, float] = field(default_factory=dict)

    def chunks(self, direction: str) -> int:
        return self.num_chunks if direction == "forward" else self.bwd_num_chunks

    def stage_seconds(self) -> Dict[str, float]:
        """{"forward/dispatch_a2a": seconds summed over all chunks, ...}"""
        return {f"{stage.direction}/{stage.name}": stage.seconds * self.chunks(stage.direction)
                for stage in self.stages}


class ScheduleFields:
    """What a chosen ``schedule`` (a name, or (name, forward c, backward c)) says: its
    dispatcher, chunk counts and label. Shared by Choice and tuning.ParmChoice."""

    schedule: Schedule

    @property
    def dispatcher(self) -> str:
        return self.schedule if isinstance(self.schedule, str) else self.schedule[0]

    @property
    def num_chunks(self) -> int:
        """Forward chunks (1 for an unchunked schedule)."""
        return 1 if isinstance(self.schedule, str) else self.schedule[1]

    @property
    def bwd_num_chunks(self) -> int:
        return 1 if isinstance(self.schedule, str) else self.schedule[2]

    @property
    def label(self) -> str:
        return schedule_label(self.schedule)


@dataclass(frozen=True)
class Choice(ScheduleFields):
    schedule: Schedule  # a schedule name, or (name, forward c, backward c) for a chunked one
    times: Dict[Schedule, float]  # predicted total seconds of every candidate considered
    predictions: Dict[Schedule, Prediction]
    reason: str = ""  # why nothing was predicted (times empty), e.g. nothing to overlap

    def describe(self) -> str:
        if not self.times:
            return f"{self.label} ({self.reason})"
        listed = ", ".join(f"{schedule_label(key)} {seconds * 1e3:.3f} ms"  # fastest first
                           for key, seconds in sorted(self.times.items(), key=lambda kv: kv[1]))
        return f"{self.label} (predicted: {listed})"


def stage_time(step: Step, profile: Profile, num_chunks: int) -> StageTime:
    """One placed step's time when the layer is cut into num_chunks (compute and bytes divided)."""
    if step.kind == "compute":
        seconds = profile.compute_time(step.flops / num_chunks)
        return StageTime(step.direction, step.name, step.kind, step.group, seconds,
                         intra_seconds=seconds, inter_seconds=0.0, intra_bytes=0.0,
                         inter_bytes=0.0, flops=step.flops)
    intra = (profile.collective_time(step.kind, "intra", step.intra_bytes / num_chunks)
             if step.intra_peers else 0.0)
    inter = (profile.collective_time(step.kind, "inter", step.inter_bytes / num_chunks)
             if step.inter_peers else 0.0)
    return StageTime(step.direction, step.name, step.kind, step.group, max(intra, inter),
                     intra_seconds=intra, inter_seconds=inter, intra_bytes=step.intra_bytes,
                     inter_bytes=step.inter_bytes, flops=0.0)


def chunk_costs(shape: LayerShape, layout: Layout, profile: Profile,
                chunks: Dict[str, int]) -> Dict[str, float]:
    """Seconds per pass that its chunks cost beyond their stages (module docstring): chunks
    {"forward": c, "backward": c'} -> {"forward": s, "backward": s'}."""
    per_expert_gemms = 0 if shape.grouped_experts else shape.num_experts // layout.ep
    expert_calls = math.lcm(chunks["forward"], chunks["backward"])  # sub-chunks, both passes
    expert_part = (expert_calls - 1) * profile.chunk_expert_overhead * per_expert_gemms / 2
    # a chunk's cost covers forward and backward together: half each
    return {direction: (count - 1) * profile.chunk_overhead / 2 + expert_part
            for direction, count in chunks.items()}


def predict(dispatcher: str, shape: LayerShape, layout: Layout, profile: Profile,
            num_chunks: Optional[int] = None, sequence_parallel: bool = True,
            bwd_num_chunks: Optional[int] = None) -> Prediction:
    """Predicted forward + backward time of one MoE layer on one rank.

    num_chunks: required for a chunked schedule (the catalog's `chunked`), else None or 1;
    bwd_num_chunks: the backward pass's chunks (default: num_chunks).
    """
    chunked = schedules.get(dispatcher).chunked if dispatcher in schedules.names() else False
    if chunked:
        if num_chunks is None:
            raise ValueError(f"predict: {dispatcher} needs num_chunks")
        schedules.check_num_chunks(num_chunks, "num_chunks")
        if bwd_num_chunks is not None:
            schedules.check_num_chunks(bwd_num_chunks, "bwd_num_chunks")
            if schedules.get(dispatcher).pair(num_chunks, bwd_num_chunks) != (num_chunks,
                                                                              bwd_num_chunks):
                raise ValueError(f"predict: {dispatcher} runs its backward in its forward "
                                 f"chunk count; got {num_chunks} / {bwd_num_chunks}")
    elif num_chunks not in (None, 1) or bwd_num_chunks not in (None, 1):
        raise ValueError(f"num_chunks applies to chunked schedules only; {dispatcher} got "
                         f"{num_chunks!r} / {bwd_num_chunks!r}")
    chunks = {"forward": num_chunks or 1, "backward": bwd_num_chunks or num_chunks or 1}

    stages = tuple(stage_time(step, profile, chunks[step.direction])
                   for step in build_plan(dispatcher, shape, layout, sequence_parallel))
    totals, resources, waits = {}, {}, {}
    extra = chunk_costs(shape, layout, profile, chunks)
    for direction in ("forward", "backward"):
        count = chunks[direction]
        mine = [stage for stage in stages if stage.direction == direction]
        busy = {resource: 0.0 for resource in RESOURCES}
        for stage in mine:
            if stage.kind == "compute":
                busy["compute"] += stage.seconds
            else:
                busy["intra"] += stage.intra_seconds
                busy["inter"] += stage.inter_seconds
        resources[direction] = busy
        one_chunk = sum(stage.seconds for stage in mine)
        pipelined = one_chunk + (count - 1) * max(busy.values())
        efficiency = profile.overlap_efficiency
        overlapped = efficiency * pipelined + (1.0 - efficiency) * count * one_chunk
        totals[direction] = profile.layer_scale * overlapped + extra[direction]
        waits[direction] = profile.layer_scale * max(0.0, overlapped - count * busy["compute"])
    return Prediction(dispatcher=dispatcher, num_chunks=chunks["forward"],
                      total_s=totals["forward"] + totals["backward"],
                      forward_s=totals["forward"], backward_s=totals["backward"],
                      stages=stages, resources=resources, bwd_num_chunks=chunks["backward"],
                      comm_wait_s=waits)


def _chunk_pairs(schedule, chunk_candidates, extra_chunks) -> Tuple[Tuple[int, int], ...]:
    """(forward, backward) chunk counts to try: the catalog's pairs (or every pair of
    chunk_candidates), plus the extra ones (an int c is (c, c)), each as the schedule runs
    it (a schedule without a backward count of its own: (F, F))."""
    extra = tuple((c, c) if isinstance(c, int) else tuple(c) for c in extra_chunks)
    if chunk_candidates is None:
        return schedule.chunk_pairs(extra)
    pairs = {(c, b) for c in chunk_candidates for b in chunk_candidates} | set(extra)
    return tuple(sorted({schedule.pair(*pair) for pair in pairs}))


def choose_schedule(shape: LayerShape, layout: Layout, profile: Profile,
                    chunk_candidates: Optional[Sequence[int]] = None,
                    sequence_parallel: bool = True, min_gain: float = 0.0,
                    extra_chunks: Sequence[Union[int, Tuple[int, int]]] = ()) -> Choice:
    """The fastest of the catalog's candidate schedules that support the layout.

    Chunked candidates are tried at each (forward, backward) pair of chunk counts: by default
    the schedule's own (``Schedule.chunk_pairs``: chunk_candidates x bwd_chunk_candidates),
    with ``chunk_candidates`` every pair of those counts, plus ``extra_chunks`` (a count c,
    e.g. a --parm-num-chunks, is (c, c); or a pair); counts larger than the number of
    tokens per rank are skipped (a chunk needs a token). Deterministic in its inputs (ties
    go to the earlier candidate in schedules.candidates' order, parm_s1 first, then to fewer
    forward, then backward chunks), so every rank that evaluates it with the same shapes and
    profile picks the same schedule. A schedule other than the first candidate wins only if
    it is faster than the first by more than the fraction `min_gain`.
    """
    for count in tuple(chunk_candidates or ()) + tuple(
            c for pair in extra_chunks for c in ((pair,) if isinstance(pair, int) else pair)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 2:
            raise ValueError(f"chunk_candidates must be integers >= 2, got {count!r}")
    if not 0.0 <= min_gain < 1.0:
        raise ValueError(f"min_gain must be in [0, 1), got {min_gain!r}")
    runnable = schedules.supported_candidates(layout.tp, layout.ep, layout.etp)
    if not runnable:
        raise ValueError(f"no candidate schedule supports tp={layout.tp}, ep={layout.ep}, "
                         f"etp={layout.etp}")

    predictions: Dict[Schedule, Prediction] = {}
    for schedule in runnable:
        if not schedule.chunked:
            predictions[schedule.name] = predict(schedule.name, shape, layout, profile, None,
                                                 sequence_parallel)
            continue
        for forward, backward in _chunk_pairs(schedule, chunk_candidates, extra_chunks):
            if max(forward, backward) <= shape.num_tokens:
                predictions[(schedule.name, forward, backward)] = predict(
                    schedule.name, shape, layout, profile, forward, sequence_parallel, backward)
    times = {key: prediction.total_s for key, prediction in predictions.items()}

    first = next(iter(times))
    best: Schedule = first
    threshold = times[first] * (1.0 - min_gain)
    for key, seconds in times.items():
        if key != first and seconds < threshold and seconds < times[best]:
            best = key
    return Choice(schedule=best, times=times, predictions=predictions)
