"""Parm's automatic dispatcher: the performance model ranks the candidate schedules (and
chunks); the fastest predicted runs, or, with tuning (megatron_parm/tuning.py), the fastest
measured of the best few."""

from __future__ import annotations

import logging
import platform
import time
import warnings
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import utils

from megatron_parm import schedules, tuning
from megatron_parm.comm.accounting import ranks_per_node
from megatron_parm.config import parm_setting
from megatron_parm.dispatchers.base import ParmTokenDispatcher
from megatron_parm.mcore_compat import comm_stream
from megatron_parm.parallel import stage_group
from megatron_parm.perf_model import Choice, LayerShape, Layout, choose_schedule, load_profile
from megatron_parm.perf_model.profile import resolve_profile
from megatron_parm import device

logger = logging.getLogger(__name__)

# Used where no --parm-profile is given: the shipped estimate for the machine kind.
DEFAULT_PROFILES = {"cuda": "nvlink_ib_estimate", "cpu": "emulated_pcie"}


def default_profile_path() -> str:
    return resolve_profile(DEFAULT_PROFILES["cuda" if device.is_cuda() else "cpu"])


def _is_failure(error: Exception) -> bool:
    """A candidate that cannot run here (out of memory, a refused layout or size), as opposed
    to a bug: skipped while tuning."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError, ValueError, NotImplementedError)):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("out of memory" in text
                                                or "can't allocate memory" in text)


def _stamp():
    """Now, on the device's clock (read at the decision)."""
    return device.stamp()


def _seconds(start, end) -> float:
    if start is None or end is None:
        return 0.0
    return device.seconds_between(start, end)


class _Mark(torch.autograd.Function):
    """Identity; its backward stamps ``record[slot]`` once the gradients of all its tensors
    have arrived (the start of the dispatcher's backward at its output, the end at its inputs)."""

    @staticmethod
    def forward(ctx, record, slot, *tensors):
        ctx.record, ctx.slot = record, slot
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.record[ctx.slot] = _stamp()
        return (None, None, *grads)


class _Tuning:
    """One layer's tuning at one token count: the call plan, each call's stamps, failures."""

    def __init__(self, model: Choice, plan: tuning.CallPlan, key: Dict, cache, writable: bool):
        self.model, self.plan, self.key = model, plan, key
        self.cache, self.writable = cache, writable
        self.calls: List[Dict] = []  # per issued training call: stamps, or {"failed": True}
        self.failed = set()

    @property
    def issued_all(self) -> bool:
        return len(self.calls) >= self.plan.num_calls

    def call_seconds(self, index: int) -> float:
        record = self.calls[index]
        if record.get("failed") or self.plan.candidates[self.plan.candidate(index)] in self.failed:
            return tuning.FAILED
        if "critical_s" in record:  # the combined 1F1B on the CPU (ParmAutoTokenDispatcher)
            return record["critical_s"]
        return (_seconds(record.get("fwd_start"), record.get("fwd_end"))
                + _seconds(record.get("bwd_start"), record.get("bwd_end")))


class ParmAutoTokenDispatcher(ParmTokenDispatcher):
    """parm: per layer, the performance model predicts every candidate schedule of the
    catalog (parm_s1, parm_s2 and parm_hier_s2 at several chunk counts, parm_hier, Megatron's
    allgather); the
    fastest predicted one runs, or, with tuning (--parm-tune; the default without
    --parm-profile), the fastest measured of the model's best few.

    Workflow: at the first dispatch of a token count n (known only then), build the layer's
    shape (n, M, F, E, k, capacity, dtype) and layout (t, e, s, nodes from
    --parm-ranks-per-node or LOCAL_WORLD_SIZE),
    ask ``choose_schedule`` with the profile of --parm-profile (or the shipped estimate) for
    the schedule and, for a chunked one, its forward and backward chunk counts; check that
    every rank chose the same. Without tuning, run that schedule's workflow (see its
    dispatcher's docstring) from then on. With tuning:
      1. a result of an earlier run in --parm-tune-cache for the same shape, layout, cluster
         and profile, read by every rank and agreed by one MIN/MAX all-reduce, is run as it is;
      2. else the shortlist (tuning.shortlist: of those within --parm-tune-margin of the
         model's first, each distinct schedule's best variant, then other chunk variants, at
         most --parm-tune-candidates, the first unchunked schedule, S1, always among them)
         takes turns on the layer's training calls
         (round-robin): one warm-up round, then --parm-tune-steps timed rounds.
         A call's time is its forward from dispatch_preprocess to combine_postprocess and its
         backward from the gradient's arrival at the output to its arrival at the inputs
         (_Mark), i.e. dispatch, experts and combine, where the schedules differ; CUDA events
         on GPUs, perf_counter on CPU;
      3. at the next call after the last, one all-reduce MAX over the world gives every
         call's slowest-rank time; the candidate with the lowest median wins on every rank
         (tuning.decide), rank 0 writes the cache, and the winner runs from then on.
    Every candidate computes the same values, so tuning changes no result. Calls without
    gradients (evaluation) run the current candidate and are not timed. A candidate whose
    dispatcher cannot be built, or whose forward fails (out of memory, a refused size) the
    same way on every rank, is skipped with one warning.
    Where the EP and ESP groups both have one rank (e.g. world size 1) there is nothing to
    overlap or deduplicate: it runs the first unchunked candidate (parm_s1, which then only
    permutes, computes and unpermutes) without asking the model or the other ranks.
    """

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
        super().__init__(num_local_experts, local_expert_indices, config, pg_collection)
        from megatron_parm.dispatchers import build_dispatcher

        self.attn_tp_size = utils.get_pg_size(self.attn_tp_group)
        self.etp_size = utils.get_pg_size(self.etp_group)
        runnable = schedules.supported_candidates(self.attn_tp_size, self.ep_size, self.etp_size)
        if self.comm_nodes:
            # Megatron-Core 0.16.1 runs its combined 1F1B with alltoall and flex only: its
            # allgather is no candidate there (nor does this project run it so).
            runnable = tuple(s for s in runnable if s.kind != schedules.NATIVE)
        # Agreement and tuning collectives: this pipeline stage's ranks (the world without
        # pipelining); the other stages run other layers meanwhile.
        self.stage_group = stage_group()
        # One dispatcher per candidate schedule that can run this layout.
        self.schedules: Dict[str, ParmTokenDispatcher] = {}
        for schedule in runnable:
            try:
                self.schedules[schedule.name] = build_dispatcher(
                    schedule.name, num_local_experts, local_expert_indices, config, pg_collection)
            except ValueError as err:  # a layout this schedule refuses: not a candidate
                if dist.get_rank(self.stage_group) == 0:  # the same on every rank: one line
                    logger.warning(f"parm: candidate {schedule.name} left out: {err}")
        if not self.schedules:
            raise ValueError(f"parm: no candidate schedule could be built for tp="
                             f"{self.attn_tp_size}, ep={self.ep_size}, etp={self.etp_size}")
        self.active: ParmTokenDispatcher = next(iter(self.schedules.values()))
        # Nothing to hide: every group this dispatcher communicates on has one rank.
        self.nothing_to_hide = self.ep_size == 1 and self.etp_size == 1
        self.sequential = next((s.name for s in runnable if not s.chunked
                                and s.name in self.schedules), None)
        self.layer_number: Optional[int] = None
        self.choices: Dict[int, tuning.ParmChoice] = {}  # tokens per rank -> final choice
        self.tunings: Dict[int, _Tuning] = {}  # tokens per rank -> tuning under way
        self.tune = tuning.enabled(parm_setting(config, "parm_tune"),
                                   parm_setting(config, "parm_profile"))
        self.profile = self._load_profile(parm_setting(config, "parm_profile"), self.tune)
        self._record: Optional[Dict] = None  # the stamps of the timed call under way

    @staticmethod
    def _load_profile(path: Optional[str], tune: bool):
        if path:
            # a bad or missing file, or one fitted before the current terms, is an error
            # naming the path and what is wrong
            return load_profile(path, require_terms=True)
        default = default_profile_path()
        # Without a profile parm ranks the schedules with the shipped estimate and measures the
        # best few (--parm-tune, the default then): its choice line says so; nothing to warn of.
        if not tune:
            warnings.warn(f"--parm-profile not given and --no-parm-tune: parm runs what the "
                          f"shipped estimate {default} predicts fastest, untested on this "
                          f"machine (it can be 1.3x slower than the best schedule: "
                          f"docs/benchmark.md); drop --no-parm-tune to measure, or run "
                          f"tools/calibrate.py")
        return load_profile(default)

    @property
    def pipelined(self) -> bool:
        """Whether the chosen schedule runs pipelined (ParmMoELayer then calls
        dispatch_compute_combine); called phase by phase, parm runs the chosen schedule's
        phases, S2's included."""
        return self.active.pipelined

    @property
    def choice(self):
        """The latest choice (tuning.ParmChoice; while tuning, the model's), or None before
        the first call."""
        if not self.choices and not self.tunings:
            return None
        if self._last_tokens in self.choices:
            return self.choices[self._last_tokens]
        return self._model_choice(self.tunings[self._last_tokens].model)

    @property
    def tuning(self) -> bool:
        """Tuning is under way: more calls decide the schedule (trainer and bench wait)."""
        return any(tokens not in self.choices for tokens in self.tunings)

    def _layout(self) -> Layout:
        """The layout of this rank's pipeline stage (the whole world without pipelining): the
        ranks its groups are made of, and how they sit on nodes."""
        world = dist.get_world_size()
        per_node = ranks_per_node(world, parm_setting(self.config, "parm_ranks_per_node"))
        stage = dist.get_world_size(self.stage_group)  # consecutive ranks (Megatron's order)
        nodes, per_node = ((stage // per_node, per_node) if stage % per_node == 0
                           else (1, stage))  # a stage inside one node (or not node-aligned)
        return Layout(tp=self.attn_tp_size, ep=self.ep_size, etp=self.etp_size,
                      nodes=nodes, ranks_per_node=per_node)

    def _shape(self, num_tokens: int, dtype: torch.dtype) -> LayerShape:
        cfg = self.config
        return LayerShape(
            num_tokens=num_tokens, hidden_size=cfg.hidden_size,
            ffn_hidden_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
            num_experts=self.num_experts, topk=self.topk,
            capacity_factor=cfg.moe_expert_capacity_factor, pad_to_capacity=self.drop_and_pad,
            dtype_bytes=dtype.itemsize, gated_linear_unit=bool(cfg.gated_linear_unit),
            grouped_experts=bool(getattr(cfg, "moe_grouped_gemm", False)))

    def _profile_text(self) -> str:
        provenance = getattr(self.profile, "provenance", "")
        given = "--parm-profile" if parm_setting(self.config, "parm_profile") else "default"
        return f"profile {self.profile.name} ({provenance}, {given})"

    def _model_choice(self, model: Choice) -> tuning.ParmChoice:
        return tuning.ParmChoice(model.schedule, "model", model, profile=self._profile_text())

    def _predict(self, num_tokens: int, dtype: torch.dtype) -> Choice:
        cfg = self.config
        requested = parm_setting(cfg, "parm_num_chunks")
        requested_bwd = parm_setting(cfg, "parm_bwd_num_chunks")
        extra = ()
        if (requested or 0) > 1 or (requested_bwd or 0) > 1:  # the flags' pair is tried too
            pair = (requested or requested_bwd, requested_bwd or requested)
            extra = (pair,) if min(pair) > 1 else ()
        choice = choose_schedule(self._shape(num_tokens, dtype), self._layout(), self.profile,
                                 sequence_parallel=bool(cfg.sequence_parallel),
                                 extra_chunks=extra)
        # As the combined 1F1B's nodes a chunked schedule runs phase by phase, in one chunk:
        # its chunk counts are not candidates there.
        built = {key: t for key, t in choice.times.items() if tuning._name(key) in self.schedules
                 and not (self.comm_nodes and not isinstance(key, str))}
        if len(built) == len(choice.times):
            return choice
        # a candidate was left out: neither chosen nor timed
        best = choice.schedule if choice.schedule in built else \
            min(built, key=lambda key: (built[key], list(built).index(key)))
        return Choice(best, built, choice.predictions)

    def _choose(self, num_tokens: int, dtype: torch.dtype, where: torch.device,
                timed: bool) -> None:
        self._last_tokens = num_tokens
        self._record = None
        if num_tokens in self.choices:
            return self._run(self.choices[num_tokens].schedule)
        if num_tokens in self.tunings:
            return self._tuning_call(self.tunings[num_tokens], where, timed)
        if self.nothing_to_hide and self.sequential:
            choice = Choice(self.sequential, {}, {}, reason="every EP and ESP group has one "
                                                            "rank: nothing to overlap")
            self.choices[num_tokens] = self._model_choice(choice)
            return self._run(choice.schedule)
        model = self._predict(num_tokens, dtype)
        self._check_agreement(model.schedule, where)
        if not self.tune:
            self.choices[num_tokens] = self._model_choice(model)
            return self._run(model.schedule)
        self._start_tuning(num_tokens, dtype, model, where)
        return self._choose(num_tokens, dtype, where, timed)

    def _run(self, schedule) -> None:
        self.active = self.schedules[tuning._name(schedule)]
        if self.active.pipelined:
            self.active.num_chunks, self.active.bwd_num_chunks = (
                (1, 1) if isinstance(schedule, str) else (schedule[1], schedule[2]))

    def _check_agreement(self, schedule, where: torch.device) -> None:
        """Every rank chose the same (on ``where``, the rows' device, as NCCL needs; the
        comparison below is a host sync, paid on the first call only)."""
        code = self._code(schedule, where)
        low, high = code.clone(), code.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.stage_group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.stage_group)
        if not torch.equal(low, high):
            raise RuntimeError("parm: ranks chose different schedules; the performance model's "
                               "inputs (profile, shapes, ranks per node) must be the same on all ranks")

    def _code(self, schedule, where: torch.device) -> torch.Tensor:
        """A schedule as three integers (its place among the built ones, and its chunks);
        None as -1s."""
        if schedule is None or tuning._name(schedule) not in self.schedules:
            values = [-1, -1, -1]
        else:
            chunks = (1, 1) if isinstance(schedule, str) else schedule[1:]
            values = [list(self.schedules).index(tuning._name(schedule)), *chunks]
        return torch.tensor(values, dtype=torch.long, device=where)

    # -- tuning ------------------------------------------------------------------------------

    def _cluster(self) -> Dict:
        kind = (device.device_name() if device.is_cuda()
                else f"cpu {platform.machine()} x{torch.get_num_threads()} threads")
        return {"device": kind, "backend": str(dist.get_backend()),
                "world_size": dist.get_world_size()}

    def _start_tuning(self, num_tokens: int, dtype: torch.dtype, model: Choice,
                      where: torch.device) -> None:
        cfg = self.config
        key = tuning.cache_key(self._shape(num_tokens, dtype), self._layout(),
                               bool(cfg.sequence_parallel), self._cluster(),
                               tuning.profile_identity(self.profile), self.layer_number,
                               list(self.schedules), combined_1f1b=self.comm_nodes)
        path = parm_setting(cfg, "parm_tune_cache")
        cache = tuning.TuningCache(path) if path else None
        lookup = cache.lookup(key) if cache else tuning.Lookup()
        cached = lookup.measured
        if cached is not None and tuning._name(cached.winner) not in self.schedules:
            cached = None
        # Every rank must have read the same winner (a file on one node only is not trusted).
        code = self._code(cached.winner if cached else None, where)
        low, high = code.clone(), code.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.stage_group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.stage_group)
        if cached is not None and torch.equal(low, high):
            self.choices[num_tokens] = tuning.ParmChoice(
                cached.winner, "cached", model, seconds=cached.seconds, cache=path,
                profile=self._profile_text())
            return
        if lookup.warning:
            warnings.warn(lookup.warning)
        candidates = tuning.shortlist(model.times, parm_setting(cfg, "parm_tune_margin"),
                                      parm_setting(cfg, "parm_tune_candidates"), always=self.sequential)
        if len(candidates) < 2:  # nothing to compare: the model's first runs
            self.choices[num_tokens] = self._model_choice(model)
            return
        plan = tuning.CallPlan(tuple(candidates), parm_setting(cfg, "parm_tune_steps"))
        self.tunings[num_tokens] = _Tuning(model, plan, key, cache, lookup.writable)

    def _tuning_call(self, state: _Tuning, where: torch.device, timed: bool) -> None:
        if state.issued_all:
            return self._finish(state, where)
        plan = state.plan
        if not timed:  # no backward to time (evaluation): the current candidate, not counted
            return None
        candidate = plan.candidates[plan.candidate(len(state.calls))]
        self._record = {"candidate": candidate}
        state.calls.append(self._record)
        self._run(self._fallback(state) if candidate in state.failed else candidate)

    def _fallback(self, state: _Tuning):
        return next(c for c in state.plan.candidates if c not in state.failed)

    def _fail(self, state: _Tuning, error: Exception) -> None:
        """Skip the current candidate: one warning, and the next unfailed one runs instead."""
        candidate = self._record["candidate"]
        state.failed.add(candidate)
        self._record["failed"] = True
        warnings.warn(f"parm: candidate {tuning.label(candidate)} failed while tuning and is "
                      f"skipped ({type(error).__name__}: {' '.join(str(error).split())[:200]})")
        device.empty_cache()
        if all(c in state.failed for c in state.plan.candidates):
            raise error
        self._run(self._fallback(state))

    def _finish(self, state: _Tuning, where: torch.device) -> None:
        """The one collective: every call's slowest-rank time; then the same winner everywhere."""
        seconds = torch.tensor([state.call_seconds(i) for i in range(state.plan.num_calls)],
                               dtype=torch.float64, device=where)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=self.stage_group)
        measured = tuning.decide(state.plan, seconds.tolist())
        path = state.cache.path if state.cache is not None and state.writable else None
        if path and dist.get_rank(self.stage_group) == 0:  # each stage's first rank
            try:
                state.cache.store(state.key, measured)
            except OSError as err:
                warnings.warn(f"parm: --parm-tune-cache {path} could not be written ({err})")
                path = None
        self.choices[self._last_tokens] = tuning.ParmChoice(
            measured.winner, "measured", state.model, seconds=measured.seconds,
            cost_s=measured.cost_s, steps=state.plan.steps, cache=path,
            profile=self._profile_text())
        self._run(measured.winner)

    def _guarded(self, call, retry=None):
        """A tuning call's phase, ``call()`` on the current candidate, with a failing candidate
        skipped: then ``retry()`` (default: ``call()`` again) runs the next one."""
        try:
            return call()
        except Exception as error:  # noqa: BLE001 -- only _is_failure's kinds are kept
            if not _is_failure(error):
                raise
            self._fail(self.tunings[self._last_tokens], error)
            return (retry or call)()

    # -- the six phases (and S2's pipeline) of the chosen schedule ------------------------

    # -- timing a call as the combined 1F1B runs it (CPU) -------------------------------
    # There the phases run in the schedule's nodes, interleaved with another micro-batch's
    # work, and the communication ones on their own thread (mcore_compat.comm_stream): a
    # call's cost is what it leaves on the compute thread's path, its local phases there
    # (forward) and the compute thread's waits for its communication nodes, forward and
    # backward. Elsewhere (and on a GPU) a call is timed from its first phase to its last.

    def _critical(self) -> bool:
        return self._record is not None and "critical_s" in self._record

    def _on_compute_thread(self, call, *args):
        if not self._critical():
            return call(*args)
        start = time.perf_counter()
        try:
            return call(*args)
        finally:
            self._record["critical_s"] += time.perf_counter() - start

    def _charge_waits(self) -> None:
        if self._critical():
            record = self._record
            comm_stream.charge_waits(
                lambda seconds: record.__setitem__("critical_s", record["critical_s"] + seconds))

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        timed = torch.is_grad_enabled() and (hidden_states.requires_grad or probs.requires_grad)
        self._choose(hidden_states.numel() // hidden_states.shape[-1], hidden_states.dtype,
                     hidden_states.device, timed)
        if self._record is None:
            return self.active.dispatch_preprocess(hidden_states, routing_map, probs)
        if self.comm_nodes and comm_stream.worker_stream() is not None:
            self._record["critical_s"] = 0.0
            return self._on_compute_thread(self._guarded, lambda: self.active.dispatch_preprocess(
                hidden_states, routing_map, probs))
        self._record["fwd_start"] = _stamp()
        hidden_states, probs = _Mark.apply(self._record, "bwd_end", hidden_states, probs)
        self._record["inputs"] = (hidden_states, routing_map, probs)  # until token_dispatch
        return self._guarded(lambda: self.active.dispatch_preprocess(hidden_states, routing_map,
                                                                     probs))

    def token_dispatch(self, hidden_states, probs):
        if self._record is None:
            return self.active.token_dispatch(hidden_states, probs)
        if self._critical():  # the combined 1F1B's communication node (allgather is no
            self._charge_waits()  # candidate there, and a restart would need the compute thread)
            return self.active.token_dispatch(hidden_states, probs)
        inputs = self._record.pop("inputs")
        # Megatron's allgather gathers its group's g * n tokens here, its likeliest out of
        # memory: the call then starts again from the layer's inputs with the next candidate.
        return self._guarded(lambda: self.active.token_dispatch(hidden_states, probs),
                             lambda: self.active.token_dispatch(
                                 *self.active.dispatch_preprocess(*inputs)))

    def dispatch_postprocess(self, hidden_states, probs):
        return self._on_compute_thread(self.active.dispatch_postprocess, hidden_states, probs)

    def combine_preprocess(self, hidden_states):
        return self._on_compute_thread(self.active.combine_preprocess, hidden_states)

    def token_combine(self, hidden_states):
        self._charge_waits()
        return self.active.token_combine(hidden_states)

    def combine_postprocess(self, hidden_states):
        output = self.active.combine_postprocess(hidden_states)
        if self._record is None or self._critical():
            return output
        (output,) = _Mark.apply(self._record, "bwd_start", output)
        self._record["fwd_end"] = _stamp()
        return output

    def dispatch_compute_combine(self, rows, row_probs, expert_fn):
        if self._record is None:
            return self.active.dispatch_compute_combine(rows, row_probs, expert_fn)
        self._record.pop("inputs")
        try:
            return self.active.dispatch_compute_combine(rows, row_probs, expert_fn)
        except Exception as error:  # noqa: BLE001 -- only _is_failure's kinds are kept
            if not _is_failure(error):
                raise
            # The rows are already S1's (S2 shares its preprocess): this call finishes in
            # one chunk each way; later calls of the failed candidate run the fallback.
            self._fail(self.tunings[self._last_tokens], error)
            self.active = self._record_owner_one_chunk()
            return self.active.dispatch_compute_combine(rows, row_probs, expert_fn)

    def _record_owner_one_chunk(self):
        owner = self.schedules[tuning._name(self._record["candidate"])]
        owner.num_chunks = owner.bwd_num_chunks = 1
        return owner
