"""The layout planner: every (tp, ep, etp, pp, dp), dispatcher and chunk count, ranked.

    from megatron_parm.perf_model.planner import Cluster, plan
    result = plan(spec, Cluster(nodes=2, ranks_per_node=8, gpu_memory_bytes=80 * 2**30),
                  profile, micro_batch_size=4, global_batch_size=256, precision=Precision("bf16"))
    best = result.candidates[0]      # fastest layout that fits; best.flags() for the launch

For a model (transformer.ModelSpec) on a cluster it enumerates every layout Megatron can run
with sequence parallelism where tp > 1 (pp divides the world and the layers, into W / pp ranks
per stage; tp divides the stage, the heads and the sequence; ep divides the experts; ep * etp
divides the stage; the global batch splits into micro-batches on dp = W / (tp pp) ranks, at
least pp of them; at pp > 1 also interleaved, at each count of virtual stages per rank
that splits the stage's layers evenly and whose micro-batches fill groups of pp) and every
dispatcher of the schedule catalog that runs there (chunked schedules at each of their chunk
counts), and estimates per rank the memory (memory.py) and the step time (step_time.py).
A candidate that does not fit without activation recomputation is planned with the fastest
recompute choice that makes it fit (recompute.search_choices; ties to the least recomputation),
its step time charged with the forward work that choice runs again. Candidates that fit in
memory come first, fastest first, recomputing or not; those that do not follow, with by how
much. Equal step times keep the order of enumeration (pp, tp, ep, etp; the catalog's order;
chunk counts; virtual stages), so the ranking is deterministic.

Bad input raises PlanError (a ValueError) with one line naming what to change.
"""

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_parm import schedules
from megatron_parm.layout_rules import (batch_problem, context_parallel_problem,
                                        experts_problem, microbatch_problem,
                                        pipeline_stage_layers, shared_expert_recompute_problem,
                                        size_problem)
from megatron_parm.perf_model.layout import Layout
from megatron_parm.wording import plural
from megatron_parm.perf_model.memory import GIB, MemoryEstimate, Precision, memory_per_rank
from megatron_parm.perf_model.predict import schedule_label
from megatron_parm.perf_model.recompute import NONE, Recompute, search_choices
from megatron_parm.perf_model.profile import Profile
from megatron_parm.perf_model.step_time import StepTime, step_time
from megatron_parm.perf_model.transformer import ModelSpec, check_layout


class PlanError(ValueError):
    """The cluster or model cannot be planned; the message names what to change."""


def _dispatchers_for(layout: Layout, sequence_parallel: bool = True
                     ) -> Tuple[List[schedules.Schedule], Dict[str, str]]:
    """(the catalog's schedules that run on `layout` and that the planner plans,
    {name: why not} for the others).

    The one place the planner learns which dispatchers exist and where they run: the schedule
    catalog (megatron_parm/schedules.py), with each entry's layout rule. The automatic choice
    is no row of its own (it runs what the fastest of its candidates' rows shows), and a
    schedule without a cost plan cannot be predicted.
    """
    allowed, refused = [], {}
    for name in schedules.names():
        schedule = schedules.get(name)
        reason = schedule.unsupported(layout.tp, layout.ep, layout.etp, sequence_parallel)
        if schedule.kind == schedules.AUTO:
            reason = (f"--moe-token-dispatcher-type {name} chooses per layer among "
                      f"{', '.join(s.name for s in schedules.candidates())}: see their rows")
        elif schedule.cost_plan is None:
            reason = f"--moe-token-dispatcher-type {name} has no cost plan in the catalog"
        if reason is None:
            allowed.append(schedule)
        else:
            refused[name] = reason
    return allowed, refused


@dataclass(frozen=True)
class Cluster:
    nodes: int
    ranks_per_node: int
    gpu_memory_bytes: float

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def describe(self) -> str:
        return (f"{plural(self.world_size, 'rank')} (--nnodes {self.nodes} x --nproc-per-node "
                f"{self.ranks_per_node})")


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    dispatcher: str
    num_chunks: Optional[int]  # chunked schedules only
    micro_batch_size: int
    global_batch_size: int
    precision: Precision
    distributed_optimizer: bool
    memory: MemoryEstimate
    step: StepTime
    gpu_memory_bytes: float
    shared_expert_overlap: bool = False  # --moe-shared-expert-overlap
    # dispatchers predicted exactly as fast, with the same memory, on this layout (listed
    # here instead of as rows of their own: alltoall and parm_s1 share a cost plan, and at
    # tp = 1 ds_baseline moves what S1 moves)
    equivalents: Tuple[str, ...] = ()
    # interleaving: the transformer layers of one virtual stage (None: the plain 1F1B
    # schedule); the virtual stages per rank are step.vpp
    layers_per_virtual_stage: Optional[int] = None
    recompute: Recompute = NONE  # activation recomputation (its memory, and in step its time)

    @property
    def dp(self) -> int:
        return self.layout.data_parallel_size

    @property
    def vpp(self) -> Optional[int]:
        """Virtual stages per pipeline rank (None: not interleaved)."""
        return self.step.vpp

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.gpu_memory_bytes

    @property
    def spare_bytes(self) -> float:
        """Memory left on a rank (negative: by how much it does not fit)."""
        return self.gpu_memory_bytes - self.memory.total

    def schedule(self) -> str:
        """The dispatcher of its flags with its chunk count, e.g. `parm_s2(c=2)` (the notation
        of predict.schedule_label, one count both ways)."""
        count = self.num_chunks
        return schedule_label((self.dispatcher, count, count) if count else self.dispatcher)

    def schedule_label(self) -> str:
        return self.schedule() + "".join(f"={name}" for name in self.equivalents)

    def layout_label(self) -> str:
        """`tp=1 ep=4 etp=1`, with ` pp=2` and ` vpp=3` where pipelined and interleaved."""
        layout = self.layout
        return (f"tp={layout.tp} ep={layout.ep} etp={layout.etp}"
                + (f" cp={layout.cp}" if layout.cp > 1 else "")
                + (f" pp={layout.pp}" if layout.pp > 1 else "")
                + (f" vpp={self.vpp}" if self.vpp else ""))

    def describe(self) -> str:
        """The layout and the schedule this candidate runs, e.g. `tp=1 ep=4 etp=1 pp=2 vpp=2
        parm_s2(c=2)` (the dispatcher of its flags, without its equivalents)."""
        return (f"{self.layout_label()} {self.schedule()}"
                + (" shared-expert-overlap" if self.shared_expert_overlap else "")
                + (f" recompute {self.recompute.label()}" if self.recompute.granularity else ""))

    def flags(self) -> List[str]:
        """The command-line flags (Megatron-LM's names) that run this candidate."""
        layout = self.layout
        flags = ["--tensor-model-parallel-size", str(layout.tp),
                 "--expert-model-parallel-size", str(layout.ep),
                 "--expert-tensor-parallel-size", str(layout.etp)]
        if layout.cp > 1:
            flags += ["--context-parallel-size", str(layout.cp), "--cp-comm-type", "all_gather"]
        if layout.pp > 1:
            flags += ["--pipeline-model-parallel-size", str(layout.pp)]
        if self.layers_per_virtual_stage:
            flags += ["--num-layers-per-virtual-pipeline-stage",
                      str(self.layers_per_virtual_stage)]
        if layout.tp > 1:
            flags.append("--sequence-parallel")
        flags += ["--moe-token-dispatcher-type", self.dispatcher]
        if self.num_chunks:
            flags += [schedules.CHUNKS_FLAG, str(self.num_chunks)]
        if self.shared_expert_overlap:
            flags.append("--moe-shared-expert-overlap")
        flags += ["--micro-batch-size", str(self.micro_batch_size),
                  "--global-batch-size", str(self.global_batch_size)]
        if self.precision.mixed:
            flags.append(f"--{self.precision.name}")
        if self.distributed_optimizer:
            flags.append("--use-distributed-optimizer")
        return flags + self.recompute.flags()

    def as_dict(self) -> dict:
        return {"tp": self.layout.tp, "ep": self.layout.ep, "etp": self.layout.etp,
                "pp": self.layout.pp, "cp": self.layout.cp, "vpp": self.vpp,
                "num_layers_per_virtual_pipeline_stage": self.layers_per_virtual_stage,
                "dp": self.dp, "dispatcher": self.dispatcher, "num_chunks": self.num_chunks,
                "equivalent_dispatchers": list(self.equivalents), "label": self.describe(),
                "step": self.step.as_dict(), "memory_bytes": self.memory.as_dict(),
                "fits": self.fits, "spare_bytes": self.spare_bytes,
                "recompute": self.recompute.label(),
                "shared_expert_overlap": self.shared_expert_overlap, "flags": self.flags()}


@dataclass(frozen=True)
class PlanResult:
    candidates: Tuple[Candidate, ...]  # fitting ones first, fastest first
    skipped: Dict[Tuple[int, int, int, int], str] = field(default_factory=dict)  # (tp, ep, etp, pp) -> why

    @property
    def fitting(self) -> Tuple[Candidate, ...]:
        return tuple(candidate for candidate in self.candidates if candidate.fits)


def _divisors(number: int) -> List[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def enumerate_layouts(spec: ModelSpec, cluster: Cluster, micro_batch_size: int,
                      global_batch_size: int, fixed: Optional[Dict[str, int]] = None
                      ) -> Tuple[List[Layout], Dict[Tuple[int, int, int, int], str]]:
    """Layouts that run `spec`, and {(tp, ep, etp, pp): why not} for the others.

    fixed: {"tp": .., "ep": .., "etp": .., "pp": .., "cp": ..} sizes the user fixed (checked
    against the world); the context-parallel size is not searched: the one given, else 1.
    """
    world = cluster.world_size
    fixed = {key: value for key, value in (fixed or {}).items() if value is not None}
    flags = {"tp": "--tensor-model-parallel-size", "ep": "--expert-model-parallel-size",
             "etp": "--expert-tensor-parallel-size", "pp": "--pipeline-model-parallel-size",
             "cp": "--context-parallel-size"}
    for key, value in fixed.items():
        problem = size_problem(flags[key], value, world)
        if problem:
            raise PlanError(f"{problem}: {cluster.describe()}")
    if "ep" in fixed and experts_problem(spec.num_experts, fixed["ep"]):
        raise PlanError(experts_problem(spec.num_experts, fixed["ep"]))
    layouts, skipped = [], {}
    cp = fixed.pop("cp", 1)
    problem = context_parallel_problem(
        cp, model_type=spec.model_type, seq_length=spec.seq_length, tp=1,
        sequence_parallel=False, moe=False, comm_types=["all_gather"],
        num_layers=spec.num_layers, transformer_impl="local",
        num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_query_groups)
    if problem:
        raise PlanError(problem)
    for pp in _divisors(world):
        stage = world // pp
        for tp in (d for d in _divisors(stage) if stage % (d * cp) == 0):
            for ep in _divisors(stage):
                for etp in _divisors(stage // ep):
                    sizes = {"tp": tp, "ep": ep, "etp": etp, "pp": pp}
                    if any(sizes[key] != value for key, value in fixed.items()):
                        continue
                    layout = Layout(tp=tp, ep=ep, etp=etp, nodes=cluster.nodes,
                                    ranks_per_node=cluster.ranks_per_node, pp=pp, cp=cp)
                    reason = _layout_problem(spec, layout, micro_batch_size, global_batch_size)
                    if reason is None:
                        layouts.append(layout)
                    else:
                        skipped[(tp, ep, etp, pp)] = reason
    if not layouts:
        if not skipped:
            raise PlanError(f"no (tp, ep, etp, pp) with ep * etp dividing {cluster.describe()}")
        # the simplest layout's reason is the one to fix first
        (tp, ep, etp, pp), reason = min(skipped.items(), key=lambda item: sum(item[0]))
        raise PlanError(f"no layout of {cluster.describe()} runs this model; e.g. tp={tp} "
                        f"ep={ep} etp={etp}" + (f" pp={pp}" if pp > 1 else "") + f": {reason}")
    return layouts, skipped


def _layout_problem(spec: ModelSpec, layout: Layout, micro_batch_size: int,
                    global_batch_size: int) -> Optional[str]:
    """Why the layout cannot run the model at this batch (one line naming the flags), or None."""
    reason = check_layout(spec, layout)
    if reason is None and layout.pp > 1:
        layers = pipeline_stage_layers(spec.num_layers, layout.pp)
        reason = layers if isinstance(layers, str) else None
    if reason is None and layout.cp > 1 and (spec.seq_length // layout.cp) % layout.tp:
        reason = (f"--seq-length / --context-parallel-size ({spec.seq_length} / {layout.cp}) "
                  f"must be divisible by --tensor-model-parallel-size ({layout.tp})")
    data_parallel = layout.data_parallel_size
    if reason is None:
        reason = batch_problem(global_batch_size, micro_batch_size, data_parallel)
    if reason is None:
        num_microbatches = global_batch_size // (micro_batch_size * data_parallel)
        reason = microbatch_problem(num_microbatches, layout.pp, None)
    return reason


def plan(spec: ModelSpec, cluster: Cluster, profile: Profile, micro_batch_size: int,
         global_batch_size: int, precision: Precision, distributed_optimizer: bool = False,
         chunk_candidates: Optional[Sequence[int]] = None,
         fixed: Optional[Dict[str, int]] = None,
         dispatchers: Optional[Sequence[str]] = None,
         recompute: Optional[Recompute] = None) -> PlanResult:
    """Every candidate, ranked; raises PlanError when none runs or none fits in memory.

    chunk_candidates: the chunk counts of chunked schedules (default: each one's own, from the
    catalog). dispatchers: only these names (default: every one _dispatchers_for allows).
    recompute: plan every candidate with this activation recomputation; None: none, and
    where a candidate does not fit so, the fastest of recompute.search_choices that fit.
    """
    if micro_batch_size < 1 or global_batch_size < 1:
        raise PlanError("--micro-batch-size and --global-batch-size must be positive")
    for name in dispatchers or ():
        schedules.get(name)  # an unknown name: ValueError listing the valid ones
    problem = recompute and shared_expert_recompute_problem(
        recompute.modules if recompute.granularity == "selective" else (),
        spec.shared_expert_overlap)
    if problem:
        raise PlanError(problem)
    layouts, skipped = enumerate_layouts(spec, cluster, micro_batch_size, global_batch_size,
                                         fixed)
    candidates = []
    for layout in layouts:
        allowed, refused = _dispatchers_for(layout)
        for schedule in allowed:
            if dispatchers is None or schedule.name in dispatchers:
                candidates += _schedule_candidates(
                    spec, layout, schedule, profile, cluster, micro_batch_size,
                    global_batch_size, precision, distributed_optimizer, chunk_candidates,
                    recompute)
        if dispatchers is not None and not any(s.name in dispatchers for s in allowed):
            skipped[(layout.tp, layout.ep, layout.etp, layout.pp)] = "; ".join(
                refused.get(name, f"--moe-token-dispatcher-type {name} is not planned")
                for name in dispatchers)
    if not candidates:
        raise PlanError(f"no layout of {cluster.describe()} runs --moe-token-dispatcher-type "
                        f"{','.join(dispatchers or [])}: "
                        + next(iter(skipped.values()), "no dispatcher allowed"))
    candidates = _merge_equivalents(candidates)
    # stable: equal step times keep the order of enumeration
    candidates.sort(key=lambda c: (not c.fits, c.step.step_s))
    if not candidates[0].fits:
        raise PlanError(_nothing_fits(spec, cluster, candidates, micro_batch_size, precision,
                                      distributed_optimizer))
    return PlanResult(tuple(candidates), skipped)


def virtual_stage_counts(spec: ModelSpec, pp: int, num_microbatches: int
                         ) -> List[Optional[int]]:
    """The schedules the planner tries at pipeline size pp: None (plain 1F1B), and at pp > 1
    each v >= 2 virtual stages per rank (interleaving) that Megatron-Core 0.16.1 accepts for
    this model and batch (layout_rules: the layers split evenly into pp x v virtual stages, the
    micro-batches fill groups of pp); v at most the layers of a stage (one layer a virtual
    stage)."""
    counts: List[Optional[int]] = [None]
    if pp == 1:
        return counts
    for vpp in range(2, spec.num_layers // pp + 1):
        if isinstance(pipeline_stage_layers(spec.num_layers, pp, vpp), str):
            continue
        if microbatch_problem(num_microbatches, pp, vpp) is None:
            counts.append(vpp)
    return counts


def _schedule_candidates(spec, layout, schedule, profile, cluster, micro_batch_size,
                         global_batch_size, precision, distributed_optimizer,
                         chunk_candidates, recompute=None) -> List[Candidate]:
    """One schedule's candidates on a layout: at each of its chunk counts (chunked schedules)
    and each virtual-stage count (virtual_stage_counts), with `recompute` (plan's); for a
    model with shared experts whose flags leave --moe-shared-expert-overlap off, each with the
    overlap where it helps (_overlap_choice, _rank_key)."""
    def planned(overlap: bool) -> List[Candidate]:
        return [replace(candidate, shared_expert_overlap=overlap) for candidate in
                _planned_candidates(replace(spec, shared_expert_overlap=overlap), layout,
                                    schedule, profile, cluster, micro_batch_size,
                                    global_batch_size, precision, distributed_optimizer,
                                    chunk_candidates, recompute)]

    if not _overlap_choice(spec, recompute):
        return planned(spec.shared_expert_overlap)
    return [min(plain, other, key=_rank_key)
            for plain, other in zip(planned(False), planned(True))]


def _overlap_choice(spec: ModelSpec, recompute: Optional[Recompute]) -> bool:
    """Whether the planner may add --moe-shared-expert-overlap: the model has shared experts,
    its flags leave the overlap off, and no fixed recomputation of the shared experts
    (Megatron-Core refuses the two together)."""
    return bool(spec.shared_expert_size and not spec.shared_expert_overlap
                and not (recompute and recompute.selects("shared_experts")))


def _rank_key(candidate: Candidate) -> tuple:
    """The planner's order (plan's sort: fitting first, fastest first), then less memory."""
    return (not candidate.fits, candidate.step.step_s, candidate.memory.total)


def _planned_candidates(spec, layout, schedule, profile, cluster, micro_batch_size,
                        global_batch_size, precision, distributed_optimizer,
                        chunk_candidates, recompute=None) -> List[Candidate]:
    """_schedule_candidates for the model as `spec` has it."""
    tokens_per_rank = spec.seq_length * micro_batch_size // (layout.tp * layout.cp)
    num_microbatches = global_batch_size // (micro_batch_size * layout.data_parallel_size)
    counts = schedule.chunk_candidates if chunk_candidates is None else chunk_candidates
    chunk_counts = (sorted({count for count in counts if count <= tokens_per_rank})
                    if schedule.chunked else [None])
    candidates = []
    for vpp in virtual_stage_counts(spec, layout.pp, num_microbatches):
        virtual_stage = spec.num_layers // (layout.pp * vpp) if vpp else None
        options = _recompute_options(
            recompute, virtual_stage or spec.num_layers // layout.pp, cluster.gpu_memory_bytes,
            lambda option: memory_per_rank(spec, layout, micro_batch_size, precision,
                                           distributed_optimizer, schedule.name,
                                           num_microbatches, vpp, option))
        for count in chunk_counts:
            # the fastest option; min keeps the first of equals (the least recomputation)
            step, choice, memory = min(
                ((step_time(spec, layout, profile, schedule.name, count, micro_batch_size,
                            global_batch_size, precision, distributed_optimizer, vpp, choice),
                  choice, memory) for choice, memory in options),
                key=lambda option: option[0].step_s)
            candidates.append(Candidate(layout, schedule.name, count, micro_batch_size,
                                        global_batch_size, precision, distributed_optimizer,
                                        memory, step, cluster.gpu_memory_bytes,
                                        layers_per_virtual_stage=virtual_stage,
                                        recompute=choice))
    return candidates


def _recompute_options(recompute: Optional[Recompute], layers_per_chunk: int,
                       gpu_memory_bytes: float, memory_of
                       ) -> List[Tuple[Recompute, MemoryEstimate]]:
    """The recomputation choices a candidate may run, with their memory: the fixed one; else
    none where that fits (recomputing only adds time); else every one of search_choices that
    fits, in its order (or none, which does not fit)."""
    if recompute is not None:
        return [(recompute, memory_of(recompute))]
    memory = memory_of(NONE)
    if memory.total <= gpu_memory_bytes:
        return [(NONE, memory)]
    fitting = [(choice, option) for choice, option in
               ((choice, memory_of(choice)) for choice in search_choices(layers_per_chunk))
               if option.total <= gpu_memory_bytes]
    return fitting or [(NONE, memory)]


def _merge_equivalents(candidates: List[Candidate]) -> List[Candidate]:
    """One candidate per (layout, virtual stages, predicted step, memory): the first
    dispatcher in catalog order (Megatron's own first) keeps the row, the others are named."""
    merged: Dict[tuple, Candidate] = {}
    for candidate in candidates:
        layout = candidate.layout
        key = (layout.tp, layout.ep, layout.etp, layout.pp, candidate.vpp,
               candidate.num_chunks, round(candidate.step.step_s, 12),
               round(candidate.memory.total), candidate.recompute,
               candidate.shared_expert_overlap)
        if key in merged:
            kept = merged[key]
            merged[key] = replace(kept, equivalents=kept.equivalents + (candidate.dispatcher,))
        else:
            merged[key] = candidate
    return list(merged.values())


def _nothing_fits(spec: ModelSpec, cluster: Cluster, candidates: Sequence[Candidate],
                  micro_batch_size: int, precision: Precision,
                  distributed_optimizer: bool) -> str:
    smallest = min(candidates, key=lambda c: c.memory.total)
    need = smallest.memory.total / GIB
    text = (f"no layout fits in --gpu-memory-gb {cluster.gpu_memory_bytes / GIB:g} on "
            f"{cluster.describe()}: the smallest ({smallest.layout_label()}) needs "
            f"{need:.3g} GiB per rank; ")
    remedies = []
    if not distributed_optimizer:
        sharded = min(memory_per_rank(spec, c.layout, micro_batch_size, precision, True,
                                      c.dispatcher, c.step.num_microbatches, c.vpp,
                                      c.recompute).total
                      for c in candidates)
        if sharded < smallest.memory.total:
            remedies.append(f"--use-distributed-optimizer (then {sharded / GIB:.3g} GiB)")
    if micro_batch_size > 1:
        remedies.append("a smaller --micro-batch-size")
    remedies.append("more ranks (--nnodes)")
    return text + "try " + ", ".join(remedies)
