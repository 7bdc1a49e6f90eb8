"""Cluster profiles: the alpha-beta numbers of the performance model.

A collective of kind K on link class L that sends `bytes` per rank takes
    alpha[K][L] + beta[K][L] * bytes            seconds
and expert compute of `flops` takes
    compute.alpha + compute.beta * flops         seconds.
K is one of all_to_all, all_gather, reduce_scatter, all_reduce; L is intra (all peers on the
rank's node) or inter (peers on other nodes). Units: seconds, seconds/byte, seconds/flop.
beta is an *effective per-rank* number: measure it with every rank of a node sending at once.

File format (YAML, or JSON with the same structure):

    name: emulated_pcie
    provenance: estimate          # "measured" or "estimate"
    note: free text: where the numbers come from
    alpha:
      all_to_all: {intra: 2.0e-4, inter: 5.0e-4}
      all_gather: {intra: ..., inter: ...}
      reduce_scatter: {intra: ..., inter: ...}
      all_reduce: {intra: ..., inter: ...}
    beta:
      (same keys as alpha)
    compute: {alpha: 1.0e-4, beta: 5.0e-11}
    # the in-layer and framework terms (TERMS below: names, defaults, meaning), fitted by
    # tools/calibrate.py on the real MoE layer and model:
    layer_scale: 1.3              # in-layer time / sum of the stage terms
    overlap_efficiency: 0.5       # share of parm_s2's ideal overlap achieved
    chunk_overhead: 0.01          # seconds per extra chunk, fwd + bwd, any expert module
    chunk_expert_overhead: 0.002  # seconds per extra chunk and local expert (SequentialMLP)
    microbatch_overhead: 0.003    # framework seconds per micro-batch, fwd + bwd
    layer_overhead: 0.001         # framework seconds per transformer layer and micro-batch
    sources:                      # optional: where each number comes from, by its path
      beta.all_to_all.inter: "2 x 200 Gbit/s per node (the cluster's NICs) ..."

The stage terms are measured one collective at a time; inside the layer the same work runs
slower (routing, permutation and autograd between the collectives, links that do not idle
between them), which layer_scale carries. overlap_efficiency says how much of the
concurrency parm_s2's pipeline assumes the cluster delivers (1: all; 0: the chunks run one
after another); see predict.py.

The project's profiles ship inside the package (megatron_parm/perf_model/profiles/: estimates
and the emulated cluster's measurements); wherever a profile is asked for, a path or the name
of a shipped one (``nvlink_ib_estimate``) is accepted.
"""

import json
import math
import os
from dataclasses import dataclass, field
from typing import Dict, Iterable, Tuple

from megatron_parm.schedules import COLLECTIVE_KINDS

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
LINKS = ("intra", "inter")
PROVENANCES = ("measured", "estimate")

# The terms beyond alpha-beta: name -> (value where a file lacks it, what it stands for).
# The one place of their names and defaults; predict.py and step_time.py use them,
# perf_model/calibrate.py fits them, docs/design.md ("The cost model") explains them.
TERMS = {
    "layer_scale": (1.0, "in-layer time over the sum of the stage terms"),
    "overlap_efficiency": (1.0, "share of a chunked schedule's ideal overlap the cluster delivers"),
    "chunk_overhead": (0.0, "seconds each extra chunk costs (forward + backward) beyond its "
                            "stages, whatever the expert module"),
    "chunk_expert_overhead": (0.0, "seconds each extra chunk costs per local expert (forward + "
                                   "backward) where each expert runs its own GEMMs "
                                   "(SequentialMLP); grouped experts do not pay it"),
    "microbatch_overhead": (0.0, "framework seconds per micro-batch (forward + backward) that "
                                 "no GEMM or collective accounts for"),
    "layer_overhead": (0.0, "framework seconds per transformer layer and micro-batch (forward "
                            "+ backward) that no GEMM or collective accounts for"),
}
# Added with parm's measured choice (0.1.0): a profile fitted before them lacks them (missing_terms, require_terms).
ISSUE17_TERMS = ("chunk_expert_overhead", "microbatch_overhead", "layer_overhead")
RECALIBRATE_HINT = ("recalibrate with tools/calibrate.py (docs/design.md, 'The cost model'; "
                    "on one GPU: tools/gpu_check.sh stage g)")
_TOP_FIELDS = ("name", "provenance", "note", "alpha", "beta", "compute", "units",
               "sources") + tuple(TERMS)


@dataclass(frozen=True)
class Profile:
    name: str
    alpha: Dict[str, Dict[str, float]]  # alpha[kind][link], seconds
    beta: Dict[str, Dict[str, float]]  # beta[kind][link], seconds per byte
    compute_alpha: float  # seconds
    compute_beta: float  # seconds per flop
    provenance: str = "estimate"
    note: str = ""
    # TERMS (their meaning and defaults are there)
    chunk_overhead: float = TERMS["chunk_overhead"][0]
    layer_scale: float = TERMS["layer_scale"][0]
    overlap_efficiency: float = TERMS["overlap_efficiency"][0]
    chunk_expert_overhead: float = TERMS["chunk_expert_overhead"][0]
    microbatch_overhead: float = TERMS["microbatch_overhead"][0]
    layer_overhead: float = TERMS["layer_overhead"][0]
    source: str = field(default="<in memory>", compare=False)
    # where each number of an estimate comes from: {"beta.all_to_all.inter": "a datasheet, a
    # published measurement", "compute.beta": ..., "chunk_overhead": ...} (``numbers``' paths)
    sources: Dict[str, str] = field(default_factory=dict, compare=False)
    # TERMS the file did not have (their defaults stand in); require_terms refuses them
    missing_terms: Tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self):
        for table in ("alpha", "beta"):
            if not isinstance(getattr(self, table), dict):
                _fail(self.source, f"field {table} must be a mapping")
        _check_profile_dict(self.to_dict(), self.source)

    def collective_time(self, kind: str, link: str, num_bytes: float) -> float:
        return self.alpha[kind][link] + self.beta[kind][link] * num_bytes

    def compute_time(self, flops: float) -> float:
        return self.compute_alpha + self.compute_beta * flops

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "provenance": self.provenance,
            "note": self.note,
            "units": {"alpha": "s", "beta": "s/byte", "compute.alpha": "s",
                      "compute.beta": "s/flop"},
            "alpha": {kind: _copy(links) for kind, links in self.alpha.items()},
            "beta": {kind: _copy(links) for kind, links in self.beta.items()},
            "compute": {"alpha": self.compute_alpha, "beta": self.compute_beta},
            # a term the profile lacks stays out of the file (load_profile notes it missing)
            **{term: getattr(self, term) for term in TERMS if term not in self.missing_terms},
            **({"sources": dict(self.sources)} if self.sources else {}),
        }

    def numbers(self) -> Dict[str, float]:
        """Every number of the profile by its path ("alpha.all_to_all.intra", "compute.beta",
        "layer_scale", ...): what ``sources`` names a source for."""
        out = {f"{table}.{kind}.{link}": getattr(self, table)[kind][link]
               for table in ("alpha", "beta") for kind in COLLECTIVE_KINDS for link in LINKS}
        out.update({"compute.alpha": self.compute_alpha, "compute.beta": self.compute_beta})
        out.update({term: getattr(self, term) for term in TERMS if term not in self.missing_terms})
        return out

    @classmethod
    def from_dict(cls, data, source: str = "<in memory>") -> "Profile":
        _check_profile_dict(data, source)
        return cls(
            name=data["name"],
            provenance=data["provenance"],
            note=data.get("note", "") or "",
            alpha={kind: {link: float(data["alpha"][kind][link]) for link in LINKS}
                   for kind in COLLECTIVE_KINDS},
            beta={kind: {link: float(data["beta"][kind][link]) for link in LINKS}
                  for kind in COLLECTIVE_KINDS},
            compute_alpha=float(data["compute"]["alpha"]),
            compute_beta=float(data["compute"]["beta"]),
            **{term: float(data.get(term, default)) for term, (default, _) in TERMS.items()},
            source=source,
            missing_terms=tuple(term for term in TERMS if term not in data),
            sources=dict(data.get("sources") or {}),
        )

    def require_terms(self, terms: Iterable[str] = ISSUE17_TERMS) -> "Profile":
        """This profile, or a ValueError (one line) naming the terms its file lacks and how to
        recalibrate: for profiles a user passes (--parm-profile, the tools)."""
        lacking = [term for term in terms if term in self.missing_terms]
        if lacking:
            _fail(self.source, f"lacks the cost model's terms {', '.join(lacking)} (fitted "
                               f"since 0.1.0's measured choice); {RECALIBRATE_HINT}")
        return self


def _copy(value):
    return dict(value) if isinstance(value, dict) else value


def _fail(source: str, message: str):
    raise ValueError(f"profile {source}: {message}")


def _check_number(source: str, path: str, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(source, f"field {path} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        _fail(source, f"field {path} must be a finite non-negative number, got {value!r}")


def _check_mapping(source: str, path: str, value, keys: Iterable[str]):
    if not isinstance(value, dict):
        _fail(source, f"field {path} must be a mapping, got {value!r}")
    keys = tuple(keys)
    for key in keys:
        if key not in value:
            _fail(source, f"field {path}.{key} missing")
    for key in value:
        if key not in keys:
            _fail(source, f"field {path}.{key} unknown; expected one of {', '.join(keys)}")


def _check_profile_dict(data, source: str):
    if not isinstance(data, dict):
        _fail(source, f"expected a mapping at the top level, got {type(data).__name__}")
    for key in data:
        if key not in _TOP_FIELDS:
            _fail(source, f"field {key} unknown; expected one of {', '.join(_TOP_FIELDS)}")
    for key in ("name", "provenance", "alpha", "beta", "compute"):
        if key not in data:
            _fail(source, f"field {key} missing")
    if not isinstance(data["name"], str) or not data["name"]:
        _fail(source, f"field name must be a non-empty string, got {data['name']!r}")
    if data["provenance"] not in PROVENANCES:
        _fail(source, f"field provenance must be one of {', '.join(PROVENANCES)}, "
                      f"got {data['provenance']!r}")
    for table in ("alpha", "beta"):
        _check_mapping(source, table, data[table], COLLECTIVE_KINDS)
        for kind in COLLECTIVE_KINDS:
            _check_mapping(source, f"{table}.{kind}", data[table][kind], LINKS)
            for link in LINKS:
                _check_number(source, f"{table}.{kind}.{link}", data[table][kind][link])
    _check_mapping(source, "compute", data["compute"], ("alpha", "beta"))
    for key in ("alpha", "beta"):
        _check_number(source, f"compute.{key}", data["compute"][key])
    for term in TERMS:
        if term in data:
            _check_number(source, term, data[term])
    if "sources" in data:
        sources = data["sources"]
        if not isinstance(sources, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and v.strip() for k, v in sources.items()):
            _fail(source, "field sources must map a number's path (e.g. beta.all_to_all.inter) "
                          "to a non-empty text")
        paths = {f"{table}.{kind}.{link}" for table in ("alpha", "beta")
                 for kind in COLLECTIVE_KINDS for link in LINKS}
        paths |= {"compute.alpha", "compute.beta", *TERMS}
        unknown = sorted(set(sources) - paths)
        if unknown:
            _fail(source, f"field sources names no number of a profile: {', '.join(unknown)}")
    if "layer_scale" in data:
        if data["layer_scale"] <= 0:
            _fail(source, f"field layer_scale must be positive, got {data['layer_scale']!r}")
    if "overlap_efficiency" in data:
        if data["overlap_efficiency"] > 1:
            _fail(source, f"field overlap_efficiency must be in [0, 1], "
                          f"got {data['overlap_efficiency']!r}")


def _is_json(path: str) -> bool:
    return os.path.splitext(path)[1].lower() == ".json"


def shipped_profiles() -> Tuple[str, ...]:
    """Names of the profiles that ship with the package."""
    return tuple(sorted(os.path.splitext(f)[0] for f in os.listdir(PROFILE_DIR)
                        if f.endswith((".yaml", ".yml", ".json"))))


def resolve_profile(value) -> str:
    """A profile's file: `value` itself where it exists, else the shipped profile of that name."""
    path = os.fspath(value)
    if os.path.exists(path):
        return path
    for suffix in ("", ".yaml", ".yml", ".json"):
        candidate = os.path.join(PROFILE_DIR, path + suffix)
        if os.path.basename(path) == path and os.path.isfile(candidate):
            return candidate
    raise ValueError(f"profile {path}: no such file, and no shipped profile of that name "
                     f"(shipped: {', '.join(shipped_profiles())})")


def load_profile(path, require_terms: bool = False) -> Profile:
    """Read and validate a profile: a file (.yaml/.yml, or .json) or a shipped profile's name.

    A file without some of TERMS loads with their defaults (Profile.missing_terms lists them);
    require_terms=True (a profile a user passes) refuses one without those terms."""
    path = resolve_profile(path)
    try:
        with open(path, "r", encoding="utf-8") as handle:
            text = handle.read()
    except OSError as error:
        raise ValueError(f"profile {path}: cannot read: {error.strerror}") from error
    try:
        if _is_json(path):
            data = json.loads(text)
        else:
            import yaml  # lazy: only profile files need it

            data = yaml.safe_load(text)
    except Exception as error:  # json.JSONDecodeError or yaml.YAMLError (imported lazily)
        if _is_json(path) and isinstance(error, ValueError):
            raise ValueError(f"profile {path}: not valid JSON: {error}") from error
        if type(error).__module__.startswith("yaml"):
            raise ValueError(f"profile {path}: not valid YAML: {error}") from error
        raise
    profile = Profile.from_dict(data, source=path)
    return profile.require_terms() if require_terms else profile


def save_profile(profile: Profile, path) -> None:
    path = os.fspath(path)
    data = profile.to_dict()
    with open(path, "w", encoding="utf-8") as handle:
        if _is_json(path):
            json.dump(data, handle, indent=2)
            handle.write("\n")
        else:
            import yaml

            yaml.safe_dump(data, handle, sort_keys=False)


def fit_alpha_beta(samples: Iterable[Tuple[float, float]], relative: bool = True) -> Tuple[float, float]:
    """Least-squares (alpha, beta) of time = alpha + beta * size from (size, seconds) samples.

    relative=True minimises the squared *relative* residuals (weights 1/time^2): message sizes
    span orders of magnitude, and plain least squares lets the largest sizes decide alone,
    which leaves alpha (the cost S2 pays per chunk) to noise. Negative results are clipped to
    zero (a negative latency or bandwidth cost is noise).
    """
    points = [(float(size), float(seconds)) for size, seconds in samples]
    if len(points) < 2:
        raise ValueError("fit_alpha_beta needs at least two (size, seconds) samples")
    weights = [1.0 / max(seconds, 1e-12) ** 2 if relative else 1.0 for _, seconds in points]
    total = sum(weights)
    mean_size = sum(w * size for w, (size, _) in zip(weights, points)) / total
    mean_time = sum(w * seconds for w, (_, seconds) in zip(weights, points)) / total
    spread = sum(w * (size - mean_size) ** 2 for w, (size, _) in zip(weights, points))
    if spread == 0:
        raise ValueError("fit_alpha_beta needs samples of at least two different sizes")
    beta = sum(w * (size - mean_size) * (seconds - mean_time)
               for w, (size, seconds) in zip(weights, points)) / spread
    beta = max(beta, 0.0)
    alpha = max(mean_time - beta * mean_size, 0.0)
    return alpha, beta
