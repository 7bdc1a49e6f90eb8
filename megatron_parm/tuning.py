"""Measured confirmation of `parm`'s choice: the flags, the shortlist, the call plan, the
decision and the cache (torch-free; the dispatcher `parm` runs it, dispatchers/parm_auto.py).

Without a calibrated profile the performance model can rank a slower schedule first
(docs/benchmark.md, "How well parm chooses"). With tuning on, `parm` times the few candidates
the model ranks best on the real layer, with the run's own tokens, and keeps the fastest:

    shortlist(choice, margin, max_candidates, always)
        of the candidates predicted within (1 + margin) x the model's first: each distinct
        schedule's fastest predicted variant, in predicted order (the model's first first),
        then the other chunk variants in predicted order (the model errs more between two
        schedules than between two chunk counts of one), at most max_candidates in all; then
        ``always`` (the unchunked schedule, S1: alltoall's bytes in one pass) if they left it
        out, so that a model that misjudges every chunked variant cannot make parm run slower
        than S1
    most_calls(max_candidates, steps)
        the most training calls tuning one layer takes
    CallPlan(candidates, steps)
        the layer's training calls 0, 1, ...: the candidates take turns (round-robin), a first
        round of warm-up calls, then `steps` timed rounds
    decide(plan, seconds)
        seconds[i] is call i's forward + backward time of the dispatcher's part of the layer
        (dispatch, experts, combine), the slowest rank's; a candidate's time is the median of
        its timed calls; a failed candidate has FAILED; the fastest wins (ties: the earlier)
    TuningCache(path)
        results keyed by the layer's shape, layout, cluster and profile, in one JSON file

Notation: "c=F/B" is a chunked schedule run in F pipeline chunks forward and B backward
("c=F" both ways), e.g. parm_s2(c=2/4).

The defaults of the tuning flags live here (the flags themselves in megatron_parm.settings),
and check_args, their cross-checks, so that training and the layer benchmark share them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_parm import __version__
from megatron_parm.perf_model.predict import ScheduleFields

DEFAULT_STEPS = 5  # timed calls per candidate (after one warm-up call)
DEFAULT_MARGIN = 0.5  # candidates predicted within (1 + margin) x the model's first
# The catalog's five distinct candidates (S1, S2, parm_hier, parm_hier_s2, allgather) each get
# a slot where the model puts them within the margin.
DEFAULT_MAX_CANDIDATES = 5
CACHE_NAME = "parm_tuning.json"  # the default cache file, inside --save
CACHE_FORMAT = "megatron-parm tuning cache"
CACHE_VERSION = 1
FAILED = 1e30  # a failed candidate's seconds (large enough to lose every MAX and comparison)
CHUNK_NOTATION = 'c=F/B: F pipeline chunks forward, B backward ("c=F": both)'


# -- flags -------------------------------------------------------------------------------

def check_args(steps, margin, max_candidates, cache: Optional[str]) -> None:
    """ValueError naming the flag for a value a user got wrong (the one check of these flags)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"--parm-tune-steps must be a positive integer, got {steps!r}")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin > 0 \
            or not math.isfinite(margin):
        raise ValueError(f"--parm-tune-margin must be a positive number, got {margin!r}")
    if isinstance(max_candidates, bool) or not isinstance(max_candidates, int) or max_candidates < 1:
        raise ValueError(f"--parm-tune-candidates must be a positive integer, got {max_candidates!r}")
    if cache is not None and os.path.isdir(cache):
        raise ValueError(f"--parm-tune-cache must name a file, got the directory {cache}")


def enabled(tune: Optional[bool], profile: Optional[str]) -> bool:
    """On where asked; by default where no calibrated profile is given (no --parm-profile)."""
    return (not profile) if tune is None else bool(tune)


def default_cache(cache: Optional[str], save: Optional[str]) -> Optional[str]:
    return cache if cache is not None else (os.path.join(save, CACHE_NAME) if save else None)


# -- candidates ----------------------------------------------------------------------------

def label(schedule) -> str:
    """'parm_s1' or 'parm_s2(c=F/B)' (perf_model's notation)."""
    from megatron_parm.perf_model.predict import schedule_label

    return schedule_label(schedule)


def _name(schedule) -> str:
    return schedule if isinstance(schedule, str) else schedule[0]


def shortlist(times: Dict, margin: float, max_candidates: int, always=None) -> List:
    """The candidates to time, the model's first first (see the module docstring).

    times: {schedule: predicted seconds} (perf_model.Choice.times); always: a schedule timed
    whatever its prediction (None: none). Distinct schedules come before chunk variants of
    one of them: without a calibrated profile the shipped estimate misjudged schedules
    against each other by up to 1.4x (parm_hier predicted 1.3-1.4x slower than S2 measured
    1.6-1.8x faster, and S2's chunk variants took every slot: docs/benchmark.md,
    Fine-grained layers), where the chunk variants of one schedule that it ranks close
    measured at most 14% apart. S1 is timed whatever the model says: end to end at (2,2,1)
    the estimate put S1 outside the margin and parm's MoE layers took up to 1.5x as long as
    S1's (docs/benchmark.md, End to end)."""
    order = list(times)
    ranked = sorted(times, key=lambda key: (times[key], order.index(key)))
    limit = times[ranked[0]] * (1.0 + margin)
    within = [key for key in ranked if times[key] <= limit]
    leaders, seen = [], set()  # each schedule's fastest predicted variant
    for key in within:
        if _name(key) not in seen:
            seen.add(_name(key))
            leaders.append(key)
    picked = (leaders + [key for key in within if key not in leaders])[:max_candidates]
    # Besides the others, not instead of the last.
    return picked + [always] if always in times and always not in picked else picked


def most_calls(max_candidates: int, steps: int) -> int:
    """The most training calls tuning one layer takes: max_candidates and the one always
    timed, one warm-up call and ``steps`` timed calls each (CallPlan)."""
    return (max_candidates + 1) * (1 + steps)


@dataclass(frozen=True)
class CallPlan:
    """Which candidate runs the layer's n-th training call while tuning."""

    candidates: Tuple
    steps: int

    @property
    def calls_per_candidate(self) -> int:
        return 1 + self.steps

    @property
    def num_calls(self) -> int:
        return len(self.candidates) * self.calls_per_candidate

    def candidate(self, call: int) -> int:
        """Round-robin, so that drift in the machine's load hits every candidate alike."""
        return call % len(self.candidates)

    def timed(self, call: int) -> bool:
        return call >= len(self.candidates)  # the first round is the warm-up


@dataclass(frozen=True)
class Measured:
    """The outcome of tuning one layer: the winner and every candidate's time."""

    winner: object  # a schedule (name, or (name, F, B))
    seconds: Dict  # schedule -> the median seconds of its timed calls (FAILED: it failed)
    cost_s: float  # what tuning cost: the calls' time beyond the winner's time, summed
    num_calls: int


def decide(plan: CallPlan, seconds: Sequence[float]) -> Measured:
    """The fastest candidate from every call's (slowest-rank) seconds."""
    assert len(seconds) == plan.num_calls, (len(seconds), plan.num_calls)
    best = {}
    for index, candidate in enumerate(plan.candidates):
        calls = [seconds[i] for i in range(plan.num_calls) if plan.candidate(i) == index]
        # The median, not the fastest call: on shared links a schedule's call-to-call spread
        # is its own (how its messages meet the other ranks'), and one lucky call of a
        # spread-out schedule must not beat a steady one (docs/benchmark.md, How well parm chooses).
        best[candidate] = FAILED if max(calls) >= FAILED else statistics.median(calls[1:])
    winner = min(plan.candidates, key=lambda key: (best[key], plan.candidates.index(key)))
    if best[winner] >= FAILED:
        raise RuntimeError("parm: every candidate schedule failed while tuning "
                           "(the warnings above say why)")
    cost = sum(max(0.0, s - best[winner]) for s in seconds if s < FAILED)
    return Measured(winner, best, cost, plan.num_calls)


# -- the log line -------------------------------------------------------------------------

def describe(how: str, winner, seconds: Dict, cost_s: Optional[float] = None,
             steps: Optional[int] = None, cache: Optional[str] = None) -> str:
    """'parm_s1 (measured ...: parm_s1 79.1 ms; runners-up parm_s2(c=2/4) 122.0 ms, ...)'."""
    def shown(value):
        return "failed" if value >= FAILED else f"{value * 1e3:.1f} ms"

    others = ", ".join(f"{label(key)} {shown(value)}"
                       for key, value in sorted(seconds.items(), key=lambda kv: kv[1])
                       if key != winner)
    source = (f"measured, median of {steps} calls, slowest rank, forward+backward"
              if how == "measured" else f"cached in {cache}")
    text = f"{label(winner)} ({source}: {label(winner)} {shown(seconds[winner])}"
    text += f"; runners-up {others})" if others else ")"
    if cost_s is not None:
        text += f"; tuning cost {cost_s * 1e3:.1f} ms"
    if how == "measured":
        text += f"; kept in {cache}" if cache else "; not kept (no --parm-tune-cache or --save)"
    return text


# -- the cache ----------------------------------------------------------------------------

def profile_identity(profile) -> str:
    """The profile's name and a digest of its numbers."""
    text = json.dumps(profile.to_dict(), sort_keys=True, default=str)
    return f"{profile.name}:{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def cache_key(shape, layout, sequence_parallel: bool, cluster: Dict, profile: str,
              layer: Optional[int] = None, candidates: Sequence[str] = (),
              combined_1f1b: bool = False) -> Dict:
    """What a cached result must match: the layer (its number: layers of one shape may measure
    different winners, and a resumed run must run each layer's own), its shape, its layout,
    the cluster, the profile, the candidate schedules parm could run (a result measured
    without one, e.g. before Megatron's allgather was a candidate, did not time it), and
    whether Megatron-Core's combined 1F1B schedule runs the layer
    (--overlap-moe-expert-parallel-comm: measured so, a schedule's time is another)."""
    from dataclasses import asdict

    key = {"layer": layer, "shape": asdict(shape),
           "layout": {**asdict(layout), "sequence_parallel": bool(sequence_parallel)},
           "cluster": dict(cluster), "profile": profile, "candidates": list(candidates)}
    if combined_1f1b:  # (absent otherwise: the other keys stay as they were)
        key["schedule"] = "combined 1F1B"
    return key


def _encode(schedule):
    return schedule if isinstance(schedule, str) else list(schedule)


def _decode(value):
    return value if isinstance(value, str) else tuple(value)


@dataclass
class Lookup:
    """A cache read: the matching result, or why there is none (a warning to show)."""

    measured: Optional[Measured] = None
    warning: Optional[str] = None
    writable: bool = True  # False: the file is unreadable and is left as it is


@dataclass
class TuningCache:
    """One JSON file: {"format", "version", "megatron_parm_version" (the package that wrote
    it, for the reader; entries are reused across versions), "entries": [{"key": ...,
    "winner", "seconds"}]}."""

    path: str
    entries: List[Dict] = field(default_factory=list)

    def lookup(self, key: Dict) -> Lookup:
        if not os.path.exists(self.path):
            return Lookup()
        try:
            with open(self.path) as f:
                data = json.load(f)
            if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT \
                    or data.get("version") != CACHE_VERSION or not isinstance(data.get("entries"), list):
                raise ValueError(f"not a {CACHE_FORMAT} of version {CACHE_VERSION}")
            entries = data["entries"]
            for entry in entries:
                if entry["key"] == key:
                    seconds = {_decode(s): float(t) for s, t in entry["seconds"]}
                    winner = _decode(entry["winner"])
                    if winner not in seconds:
                        raise ValueError("an entry's winner is not among its candidates")
                    return Lookup(Measured(winner, seconds, 0.0, 0))
        except (OSError, ValueError, KeyError, TypeError) as err:
            return Lookup(warning=f"parm: --parm-tune-cache {self.path} is unreadable "
                                  f"({type(err).__name__}: {err}): tuning again; the file is "
                                  f"left as it is", writable=False)
        self.entries = entries
        if not entries:
            return Lookup()
        differs = sorted({part if name is None else f"{part}.{name}" for entry in entries
                          for part in key
                          for name in _differences(entry["key"].get(part), key[part])})
        return Lookup(warning=f"parm: --parm-tune-cache {self.path} holds results for another "
                              f"shape, layout, cluster, profile or set of candidates (differs in "
                              f"{', '.join(differs) or 'its keys'}): tuning again")

    def store(self, key: Dict, measured: Measured) -> None:
        """Add (or replace) this key's result; written atomically (rank 0 of a stage only).
        Other layers (and other stages' ranks) store into the same file: under a lock, the
        entries on disk are read again and this key's is replaced, so none is lost."""
        import fcntl

        entry = {"key": key, "winner": _encode(measured.winner),
                 "seconds": [[_encode(s), t] for s, t in measured.seconds.items()]}
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        with open(f"{self.path}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries = [e for e in self._entries_on_disk(self.entries) if e.get("key") != key]
            entries.append(entry)
            temporary = f"{self.path}.tmp{os.getpid()}"
            with open(temporary, "w") as f:
                json.dump({"format": CACHE_FORMAT, "version": CACHE_VERSION,
                           "megatron_parm_version": __version__, "entries": entries}, f,
                          indent=1)
            os.replace(temporary, self.path)
        self.entries = entries

    def _entries_on_disk(self, fallback: List[Dict]) -> List[Dict]:
        try:
            with open(self.path) as f:
                data = json.load(f)
            if isinstance(data, dict) and data.get("format") == CACHE_FORMAT \
                    and data.get("version") == CACHE_VERSION and isinstance(data.get("entries"), list):
                return [e for e in data["entries"] if isinstance(e, dict)]
        except (OSError, ValueError):
            pass
        return list(fallback)


def _differences(theirs, ours) -> List[Optional[str]]:
    """The fields in which two key parts differ (None: the part itself, not a dict)."""
    if not isinstance(theirs, dict) or not isinstance(ours, dict):
        return [] if theirs == ours else [None]
    return [name for name in sorted(set(theirs) | set(ours)) if theirs.get(name) != ours.get(name)]


# -- the choice a layer runs --------------------------------------------------------------

@dataclass(frozen=True)
class ParmChoice(ScheduleFields):
    """What `parm` runs for a layer and how it was chosen: "model" (predicted only),
    "measured" (tuned in this run) or "cached" (tuned by an earlier run)."""

    schedule: object  # a schedule name, or (name, forward chunks, backward chunks)
    how: str
    model: object = None  # the perf_model.Choice the candidates came from
    seconds: Dict = field(default_factory=dict)  # measured / cached: schedule -> seconds
    cost_s: Optional[float] = None
    steps: Optional[int] = None
    cache: Optional[str] = None
    profile: str = ""  # the profile the model used, as the log names it

    @property
    def times(self) -> Dict:
        """The model's predicted seconds per candidate."""
        return self.model.times if self.model is not None else {}

    def describe(self) -> str:
        if self.how != "model":
            return describe(self.how, self.schedule, self.seconds, self.cost_s, self.steps,
                            self.cache)
        if not self.times:
            return f"{self.label} ({self.model.reason})"
        listed = ", ".join(f"{label(key)} {seconds * 1e3:.3f} ms"
                           for key, seconds in sorted(self.times.items(), key=lambda kv: kv[1]))
        return f"{self.label} (model, {self.profile}; predicted: {listed})"
