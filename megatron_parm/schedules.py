"""The schedule catalog: every value of --moe-token-dispatcher-type and what is known of it.

One entry per schedule holds all of its facts that code outside its dispatcher needs:
its name, what kind it is (Megatron's own, the DeepSpeed baseline, a Parm schedule, the
automatic choice), where its dispatcher class lives, the layouts it supports (and the message
for those it does not), its chunking defaults, whether the automatic choice considers it,
and its cost plan for the performance model. Arguments, layout checks, ParmMoELayer, the
automatic choice, the performance model, calibration and the benchmark report all read it.
Adding a schedule is one dispatcher file and one entry here (``register`` adds one at run
time, as the catalog test does).

This module imports nothing of the package and no torch, so every layer may use it.

Cost plans. ``cost_plan(shape, layout, sequence_parallel)`` returns the ordered ``Stage``s of
one forward + backward of the layer on one rank: forward stages first, the backward ones
after (each the dual of a forward stage, in reverse). ``shape`` is a perf_model.LayerShape and
``layout`` a perf_model.Layout (read by attribute only). A collective stage gives the bytes
this rank sends to each peer of its group; the performance model drops stages on groups of
one rank and splits the rest into intra- and inter-node parts. docs/design.md derives every
formula below. Notation (as there):
    n    tokens per rank entering the layer    t, e, s   TP, EP, ETP (ESP) sizes
    r    rows this rank sends to each expert   (shape.rows_per_expert(tokens routed))
    L    local experts, E / e                  R         rows an ESP rank receives, E * r
    row  M * b bytes                           row_p     row + the routing probability
    p    bytes of one probability              "tp_ep"   the ESP x EP group (Megatron's)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

NATIVE = "native"  # Megatron-Core's own dispatcher, run by MoELayer unchanged
BASELINE = "baseline"  # DeepSpeed-MoE's dataflow, the paper's baseline
PARM = "parm"  # one of Parm's schedules
AUTO = "auto"  # the performance model picks one of the candidate schedules per layer
KINDS = (NATIVE, BASELINE, PARM, AUTO)

FORWARD, BACKWARD = "forward", "backward"
COMPUTE = "compute"
EXPERTS = "experts"  # the compute stage of the experts (other compute stages are local passes)
COLLECTIVE_KINDS = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce")
# The dual of each collective: what the backward pass of a forward collective runs.
DUAL = {"all_to_all": "all_to_all", "all_gather": "reduce_scatter",
        "reduce_scatter": "all_gather", "all_reduce": "all_reduce"}

CHUNKS_FLAG = "--parm-num-chunks"  # the forward pipeline's chunks
BWD_CHUNKS_FLAG = "--parm-bwd-num-chunks"  # the backward pipeline's (default: the forward's)


@dataclass(frozen=True)
class Stage:
    """One stage of a schedule on one rank, for the whole layer (not per chunk)."""

    direction: str  # FORWARD or BACKWARD
    name: str
    kind: str  # one of COLLECTIVE_KINDS, or COMPUTE
    group: Optional[str] = None  # "tp", "ep", "expt_tp"; None for compute
    bytes_per_peer: float = 0.0
    flops: float = 0.0


LayoutRule = Callable[[int, int, int], Optional[str]]
CostPlan = Callable[..., List[Stage]]


@dataclass(frozen=True)
class Schedule:
    """Everything outside its dispatcher file that is known of one schedule."""

    name: str
    kind: str
    summary: str  # one line, for --help, docs and reports
    # "module:Class" of its MoETokenDispatcher subclass. Megatron's own are built by MoELayer
    # when the flag names them; for one that `parm` weighs (``candidate``) this is the
    # ParmTokenDispatcher through which parm runs Megatron's class (None where parm does not).
    dispatcher: Optional[str] = None
    # Its dispatcher offers dispatch_compute_combine(rows, probs, experts): token_dispatch
    # through token_combine, experts included, as one pipelined call, which ParmMoELayer runs
    # in their place. Every dispatcher also runs the six phases one by one (Megatron-Core's
    # callers, tests); a pipelined one then runs unpipelined (docs/design.md).
    pipelined: bool = False
    # Cut into pipeline chunks (--parm-num-chunks) inside that call, and the performance
    # model pipelines its stages; needs ``pipelined``.
    chunked: bool = False
    default_chunks: int = 1
    chunk_candidates: Tuple[int, ...] = ()  # forward chunk counts the automatic choice tries
    # backward chunk counts it tries with each forward count (empty: the forward count only)
    bwd_chunk_candidates: Tuple[int, ...] = ()
    # Its backward pipeline takes a chunk count of its own (--parm-bwd-num-chunks); False: it
    # runs the forward's (every pair (F, B) becomes (F, F)).
    separate_backward_chunks: bool = True
    # Its dispatcher splits every EP group by node (parm_hier's "ep_inter" / "ep_intra"):
    # each node an EP group spans must hold as many of its ranks (layout.node_split_problem).
    splits_ep_by_node: bool = False
    candidate: bool = False  # the automatic choice considers it
    # Megatron's MoELayer takes the layer input sharded over TP, i.e. sequence parallelism,
    # when the flag names one of its dispatchers. Not a rule for parm's candidates:
    # ParmMoELayer hands them this rank's sequence shard either way (``supported_candidates``).
    needs_sequence_parallel: bool = False
    # (tp, ep, etp) -> None where supported, else why not (names the flags).
    layout_rule: Optional[LayoutRule] = None
    cost_plan: Optional[CostPlan] = field(default=None, compare=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"schedule {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind != NATIVE and not self.dispatcher:
            raise ValueError(f"schedule {self.name!r}: a {self.kind} schedule needs its dispatcher class")
        if self.candidate and not (self.dispatcher and self.cost_plan):
            raise ValueError(f"schedule {self.name!r}: a candidate of the automatic choice needs "
                             f"its dispatcher class and a cost plan")
        if self.pipelined and self.kind == NATIVE:
            raise ValueError(f"schedule {self.name!r}: Megatron's own dispatchers have no pipelined call")
        if self.chunked and not self.pipelined:
            raise ValueError(f"schedule {self.name!r}: chunks run inside the pipelined call; "
                             f"a chunked schedule must be pipelined")
        if self.bwd_chunk_candidates and not self.separate_backward_chunks:
            raise ValueError(f"schedule {self.name!r}: bwd_chunk_candidates need "
                             f"separate_backward_chunks")
        if self.chunked and not (self.default_chunks >= 1 and all(
                c >= 2 for c in self.chunk_candidates + self.bwd_chunk_candidates)):
            raise ValueError(f"schedule {self.name!r}: default_chunks must be >= 1 and "
                             f"chunk_candidates and bwd_chunk_candidates >= 2")

    def unsupported(self, tp: int, ep: int, etp: int, sequence_parallel: bool = True) -> Optional[str]:
        """Why this schedule cannot run the layout (a message naming the flags), or None."""
        if self.needs_sequence_parallel and tp > 1 and not sequence_parallel:
            return (f"--moe-token-dispatcher-type {self.name} with --tensor-model-parallel-size "
                    f"{tp} needs --sequence-parallel")
        if self.kind == AUTO:
            if not supported_candidates(tp, ep, etp):
                return (f"--moe-token-dispatcher-type {self.name}: none of its candidate "
                        f"schedules supports tp={tp}, ep={ep}, etp={etp}")
            return None
        return self.layout_rule(tp, ep, etp) if self.layout_rule else None

    def check_layout(self, tp: int, ep: int, etp: int, sequence_parallel: bool = True) -> None:
        message = self.unsupported(tp, ep, etp, sequence_parallel)
        if message:
            raise ValueError(message)

    def num_chunks(self, requested: Optional[int] = None) -> int:
        """The forward chunk count to run: --parm-num-chunks where given, else this schedule's
        default."""
        if requested is None:
            return self.default_chunks if self.chunked else 1
        check_num_chunks(requested)
        return int(requested) if self.chunked else 1

    def chunk_counts(self, requested: Optional[int] = None,
                     requested_bwd: Optional[int] = None) -> Tuple[int, int]:
        """(forward, backward) chunk counts to run: --parm-num-chunks and --parm-bwd-num-chunks
        where given; the backward defaults to the forward count (and is the forward count for
        a schedule without ``separate_backward_chunks``)."""
        forward = self.num_chunks(requested)
        if requested_bwd is None:
            return forward, forward
        check_num_chunks(requested_bwd, BWD_CHUNKS_FLAG)
        if not self.chunked:
            return forward, 1
        return forward, int(requested_bwd) if self.separate_backward_chunks else forward

    def pair(self, forward: int, backward: int) -> Tuple[int, int]:
        """The (forward, backward) chunk counts this schedule runs for a requested pair."""
        return (forward, backward) if self.separate_backward_chunks else (forward, forward)

    def chunk_pairs(self, extra: Tuple[Tuple[int, int], ...] = ()) -> Tuple[Tuple[int, int], ...]:
        """(forward, backward) chunk counts the automatic choice tries, plus ``extra`` (each
        as this schedule runs it: ``pair``)."""
        pairs = [(c, b) for c in self.chunk_candidates for b in (self.bwd_chunk_candidates or (c,))]
        return tuple(sorted({self.pair(*p) for p in pairs} | {self.pair(*p) for p in extra}))


def check_num_chunks(value, flag: str = CHUNKS_FLAG) -> None:
    """Chunk counts are integers >= 1 (1: the schedule's volumes in one chunk)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{flag} must be an integer >= 1, got {value!r}")


# ---------------------------------------------------------------------------------------
# cost plans (docs/design.md derives each)
# ---------------------------------------------------------------------------------------


def _duals(forward: List[Stage], backward_compute_factor: float = 2.0) -> List[Stage]:
    """The backward stages of a forward dataflow: each stage's dual, in reverse order.

    The backward of an expert pass costs twice its forward flops (input and weight grads);
    a collective's dual moves the same bytes per peer, except that probabilities travel
    only on the dispatch side (their gradients do too, so bytes are unchanged).
    """
    stages = []
    for stage in reversed(forward):
        if stage.kind == COMPUTE:
            stages.append(Stage(BACKWARD, f"grad_{stage.name}", COMPUTE,
                                flops=backward_compute_factor * stage.flops))
        else:
            stages.append(Stage(BACKWARD, f"grad_{stage.name}", DUAL[stage.kind], stage.group,
                                bytes_per_peer=stage.bytes_per_peer))
    return stages


def _with_duals(forward: List[Stage], shape, layout, row: float, sequence_parallel: bool
                ) -> List[Stage]:
    """forward + its duals, for a schedule that routes only this rank's n tokens: without
    sequence parallelism the output is all-gathered back over TP in the forward pass (after
    the duals are taken: its backward is a slice, free)."""
    backward = _duals(forward)
    if not sequence_parallel and layout.tp > 1:
        forward.append(Stage(FORWARD, "restore_ag", "all_gather", "tp", shape.num_tokens * row))
    return forward + backward


def _sizes(shape, layout, tokens_routed: float):
    """(row, row_p, rows to each EP peer, R, flops per row) for one routing of tokens_routed."""
    row = shape.hidden_size * shape.dtype_bytes
    row_p = row + shape.prob_bytes
    rows_per_expert = shape.rows_per_expert(tokens_routed)
    local_experts = shape.num_experts // layout.ep
    return (row, row_p, rows_per_expert * local_experts, rows_per_expert * shape.num_experts,
            shape.expert_flops_per_row(layout.etp))


def deduplicated_cost(shape, layout, sequence_parallel: bool = True) -> List[Stage]:
    """parm_s1 (and Megatron's alltoall, which moves the same data): each rank routes its own
    n tokens. A2A(EP) k*n rows -> AG(ESP) -> experts on s*R rows, H/s each -> RS(ESP) ->
    A2A(EP) back; without sequence parallelism (t > 1) one AG(TP) of the n*M combined output
    restores the replicated output (its backward is a slice: no stage)."""
    row, row_p, to_peer, received, flops_per_row = _sizes(shape, layout, shape.num_tokens)
    forward = [
        Stage(FORWARD, "dispatch_a2a", "all_to_all", "ep", to_peer * row_p),
        Stage(FORWARD, "dispatch_ag", "all_gather", "expt_tp", received * row_p),
        Stage(FORWARD, EXPERTS, COMPUTE, flops=layout.etp * received * flops_per_row),
        Stage(FORWARD, "combine_rs", "reduce_scatter", "expt_tp", received * row),
        Stage(FORWARD, "combine_a2a", "all_to_all", "ep", to_peer * row),
    ]
    return _with_duals(forward, shape, layout, row, sequence_parallel)


def pipelined_cost(shape, layout, sequence_parallel: bool = True) -> List[Stage]:
    """parm_s2: parm_s1's stages, cut into chunks by the model. Without sequence parallelism
    (t > 1) it restores the replicated output by AG(TP) of the R received expert-output rows
    (with probabilities) before combine, overlapped with the return A2A."""
    stages = deduplicated_cost(shape, layout, sequence_parallel=True)
    if not sequence_parallel and layout.tp > 1:
        _, row_p, _, received, _ = _sizes(shape, layout, shape.num_tokens)
        at = next(i for i, s in enumerate(stages) if s.direction == BACKWARD)
        stages.insert(at, Stage(FORWARD, "restore_ag", "all_gather", "tp", received * row_p))
    return stages


def node_row_share(num_experts: int, node_experts: int, topk: int) -> float:
    """Rows per pair that a rank sends to one node under uniform top-k routing (without
    replacement): P(a token picks one of the node's G experts) / (expected pairs to it),
    (1 - C(E - G, k) / C(E, k)) / (k * G / E); 1 where no two pairs can share the node."""
    miss = math.comb(num_experts - node_experts, topk) / math.comb(num_experts, topk)
    return (1.0 - miss) / (topk * node_experts / num_experts)


def hierarchical_cost(shape, layout, sequence_parallel: bool = True) -> List[Stage]:
    """parm_hier: the EP group spans K nodes with g ranks on each (layout groups "ep_inter",
    K ranks, and "ep_intra", g ranks), G = g * L experts per node. To each other node a rank
    sends r*G pairs as u = r*G*node_row_share rows of row_p plus r*G - u secondary pairs of
    2*max(p, 4) bytes (probability, row index); the relay sends each node member the K*r*L
    pairs of its experts (row_p each). Then S1's AG(ESP), experts, RS(ESP); the node-local
    sums go back K*r*L rows to each member and u rows to each node. The relay's expansion of
    its K*r*G pairs and their sum on the way back are local passes beyond S1's, one operation
    per element (compute stages). Capacity caps r, and the share of rows per pair is taken as
    under dropless routing."""
    row, row_p, _, received, flops_per_row = _sizes(shape, layout, shape.num_tokens)
    nodes = layout.group_size("ep_inter")
    local_experts = shape.num_experts // layout.ep
    node_experts = layout.ep // nodes * local_experts
    r = shape.rows_per_expert(shape.num_tokens)
    pairs = r * node_experts
    rows = pairs * node_row_share(shape.num_experts, node_experts, shape.topk)
    secondary = 2 * max(shape.prob_bytes, 4) if shape.prob_bytes else 0
    fanned_out = nodes * r * local_experts
    relay_pass = nodes * pairs * shape.hidden_size
    forward = [
        Stage(FORWARD, "dispatch_inter_a2a", "all_to_all", "ep_inter",
              rows * row_p + (pairs - rows) * secondary),
        Stage(FORWARD, "relay_expand", COMPUTE, flops=relay_pass),
        Stage(FORWARD, "dispatch_intra_a2a", "all_to_all", "ep_intra", fanned_out * row_p),
        Stage(FORWARD, "dispatch_ag", "all_gather", "expt_tp", received * row_p),
        Stage(FORWARD, EXPERTS, COMPUTE, flops=layout.etp * received * flops_per_row),
        Stage(FORWARD, "combine_rs", "reduce_scatter", "expt_tp", received * row),
        Stage(FORWARD, "combine_intra_a2a", "all_to_all", "ep_intra", fanned_out * row),
        Stage(FORWARD, "relay_sum", COMPUTE, flops=relay_pass),
        Stage(FORWARD, "combine_inter_a2a", "all_to_all", "ep_inter", rows * row),
    ]
    return _with_duals(forward, shape, layout, row, sequence_parallel)


def gathered_cost(shape, layout, sequence_parallel: bool = True) -> List[Stage]:
    """Megatron's allgather: AG over the ESP x EP group ("tp_ep", s*e ranks) of the routing map
    (n*E bools, no gradient), the probabilities (n*E of p bytes) and the rows (n*M); the local
    experts on the s*e*n gathered tokens' pairs with them (s*R rows, H/s each, as S1's); RS
    over ESP x EP of the unpermuted [s*e*n, M] partial sums, in the probabilities' dtype
    (Megatron casts to it; p = 0 counts activations only: the rows' dtype). Without sequence
    parallelism (t > 1) ParmMoELayer hands it this rank's shard and restores the output with
    one AG(TP), as for S1."""
    row, _, _, received, flops_per_row = _sizes(shape, layout, shape.num_tokens)
    tokens, experts = shape.num_tokens, shape.num_experts
    combined_row = shape.hidden_size * (shape.prob_bytes or shape.dtype_bytes)
    forward = [
        Stage(FORWARD, "probs_ag", "all_gather", "tp_ep", tokens * experts * shape.prob_bytes),
        Stage(FORWARD, "dispatch_ag", "all_gather", "tp_ep", tokens * row),
        Stage(FORWARD, EXPERTS, COMPUTE, flops=layout.etp * received * flops_per_row),
        Stage(FORWARD, "combine_rs", "reduce_scatter", "tp_ep", tokens * combined_row),
    ]
    stages = _with_duals(forward, shape, layout, row, sequence_parallel)
    # gathered first, under no_grad: no dual
    stages.insert(0, Stage(FORWARD, "routing_map_ag", "all_gather", "tp_ep", tokens * experts))
    return stages


def baseline_cost(shape, layout, sequence_parallel: bool = True) -> List[Stage]:
    """ds_baseline: every TP rank routes all N = t*n tokens of its TP group. [AG(TP) of the
    n*M input, sequence parallel only] -> A2A(EP) of k*N rows -> experts on R rows (fc1/fc2
    split over s) -> AR(ESP) of R*M -> A2A(EP) back."""
    row, row_p, to_peer, received, flops_per_row = _sizes(shape, layout,
                                                          layout.tp * shape.num_tokens)
    forward = []
    if sequence_parallel and layout.tp > 1:
        forward.append(Stage(FORWARD, "input_ag", "all_gather", "tp", shape.num_tokens * row))
    forward += [
        Stage(FORWARD, "dispatch_a2a", "all_to_all", "ep", to_peer * row_p),
        Stage(FORWARD, EXPERTS, COMPUTE, flops=received * flops_per_row),
        Stage(FORWARD, "expert_ar", "all_reduce", "expt_tp", 2.0 * received * row / layout.etp),
        Stage(FORWARD, "combine_a2a", "all_to_all", "ep", to_peer * row),
    ]
    return forward + _duals(forward)


# ---------------------------------------------------------------------------------------
# layout rules
# ---------------------------------------------------------------------------------------


def _etp_divides_tp(tp: int, ep: int, etp: int) -> Optional[str]:
    if tp % etp == 0:
        return None
    return (f"--moe-token-dispatcher-type ds_baseline needs --expert-tensor-parallel-size ({etp}) "
            f"to divide --tensor-model-parallel-size ({tp}): DeepSpeed's ESP experts are split "
            f"inside the tensor-parallel group")


# ---------------------------------------------------------------------------------------
# the catalog
# ---------------------------------------------------------------------------------------

_DISPATCHERS = "megatron_parm.dispatchers"

_BUILTIN = (
    Schedule("allgather", NATIVE, "Megatron-Core's all-gather dispatcher: AG [ETP x EP] of every "
             "token, local experts, RS back",
             dispatcher=f"{_DISPATCHERS}.megatron_allgather:MegatronAllGatherTokenDispatcher",
             candidate=True, needs_sequence_parallel=True, cost_plan=gathered_cost),
    Schedule("alltoall", NATIVE, "Megatron-Core's all-to-all dispatcher: A2A [EP] -> AG [ETP] -> "
             "experts -> RS [ETP] -> A2A [EP]", needs_sequence_parallel=True,
             cost_plan=deduplicated_cost),
    Schedule("ds_baseline", BASELINE, "DeepSpeed-MoE's flow, the paper's baseline: AG [TP] so every "
             "TP rank holds all N tokens, A2A [EP] of the duplicated tokens, experts closed by "
             "AR [ESP], A2A back, keep the own shard",
             dispatcher=f"{_DISPATCHERS}.ds_baseline:DSBaselineTokenDispatcher",
             layout_rule=_etp_divides_tp, cost_plan=baseline_cost),
    Schedule("parm_s1", PARM, "Parm S1: each rank routes only its own tokens: A2A [EP] -> AG [ESP] "
             "-> experts -> RS [ESP] -> A2A [EP]",
             dispatcher=f"{_DISPATCHERS}.parm_s1:ParmS1TokenDispatcher", candidate=True,
             cost_plan=deduplicated_cost),
    Schedule("parm_s2", PARM, "Parm S2: S1's data in --parm-num-chunks chunks (backward: "
             "--parm-bwd-num-chunks) through a pipeline that overlaps the A2A [EP] with the "
             "AG/RS [ESP] and the experts",
             dispatcher=f"{_DISPATCHERS}.parm_s2:ParmS2TokenDispatcher", pipelined=True,
             chunked=True,
             default_chunks=4, chunk_candidates=(2, 4, 8), bwd_chunk_candidates=(2, 4, 8),
             candidate=True,
             cost_plan=pipelined_cost),
    Schedule("parm_hier", PARM, "deduplicated per node: one row per (token, node) over the "
             "inter-node A2A [ep_inter], fan-out to the experts inside the node A2A [ep_intra] "
             "-> AG [ESP] -> experts -> RS [ESP] -> node-local sum -> back the same way",
             dispatcher=f"{_DISPATCHERS}.parm_hier:ParmHierTokenDispatcher", candidate=True,
             splits_ep_by_node=True, cost_plan=hierarchical_cost),
    # parm_hier's dataflow on chunks of the tokens (each chunk deduplicated by itself, so its
    # bytes are parm_hier's); one chunk count for both passes: a backward cut of its own would
    # need each forward chunk's relay plan split again.
    Schedule("parm_hier_s2", PARM, "parm_hier pipelined: the tokens in --parm-num-chunks "
             "chunks; the inter-node A2A [ep_inter] of chunk i+1 and the return of chunk i-1 "
             "run while chunk i fans out A2A [ep_intra], AG [ESP], is computed, RS [ESP] and "
             "summed per node",
             dispatcher=f"{_DISPATCHERS}.parm_hier_s2:ParmHierS2TokenDispatcher",
             pipelined=True, chunked=True, default_chunks=4, chunk_candidates=(2, 4, 8),
             separate_backward_chunks=False, candidate=True, splits_ep_by_node=True,
             cost_plan=hierarchical_cost),
    Schedule("parm", AUTO, "per layer, the performance model (--parm-profile) predicts every "
             "candidate schedule and runs the fastest",
             dispatcher=f"{_DISPATCHERS}.parm_auto:ParmAutoTokenDispatcher"),
)

_CATALOG: Dict[str, Schedule] = {schedule.name: schedule for schedule in _BUILTIN}


def register(schedule: Schedule) -> Schedule:
    """Add a schedule (a plug-in's, or a test's); its name must be new."""
    if schedule.name in _CATALOG:
        raise ValueError(f"schedule {schedule.name!r} is already in the catalog")
    _CATALOG[schedule.name] = schedule
    return schedule


def unregister(name: str) -> None:
    """Remove a schedule added by ``register`` (the built-in ones stay)."""
    if any(schedule.name == name for schedule in _BUILTIN):
        raise ValueError(f"schedule {name!r} is built in")
    _CATALOG.pop(name, None)


def names(*kinds: str) -> Tuple[str, ...]:
    """Schedule names in catalog order, of the given kinds (all without)."""
    return tuple(s.name for s in _CATALOG.values() if not kinds or s.kind in kinds)


def get(name: str) -> Schedule:
    """The catalog entry of a --moe-token-dispatcher-type value (ValueError naming the flag)."""
    schedule = _CATALOG.get(name)
    if schedule is None:
        raise ValueError(f"--moe-token-dispatcher-type: unknown dispatcher {name!r}; valid names "
                         f"are {', '.join(_CATALOG)}")
    return schedule


def candidates() -> Tuple[Schedule, ...]:
    """The schedules the automatic choice considers: Parm's own in catalog order, then the
    others (Megatron's allgather). So its first unchunked candidate, the one tuning always
    times and ties go to, is parm_s1 (alltoall's bytes in one pass), wherever the others
    stand in the catalog."""
    considered = [s for s in _CATALOG.values() if s.candidate]
    return tuple(sorted(considered, key=lambda s: s.kind != PARM))  # a stable sort


def supported_candidates(tp: int, ep: int, etp: int) -> Tuple[Schedule, ...]:
    """The candidates whose layout rule allows (tp, ep, etp), with or without sequence
    parallelism: ParmMoELayer hands the dispatcher this rank's sequence shard either way (a
    TP-replicated input is sharded before routing and the output gathered after), so a
    candidate of Megatron's that needs --sequence-parallel under MoELayer runs without it
    under parm."""
    return tuple(s for s in candidates() if s.unsupported(tp, ep, etp) is None)


def is_native(name: str) -> bool:
    return get(name).kind == NATIVE
