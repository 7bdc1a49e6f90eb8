"""parm's measured choice, its pure parts: flags, shortlist, call plan, decision, cache, log line."""

from __future__ import annotations

import json

import pytest

import megatron_parm
from megatron_parm import tuning
from megatron_parm.perf_model import LayerShape, Layout

S2 = "parm_s2"
TIMES = {"parm_s1": 0.365, (S2, 2, 2): 0.308, (S2, 2, 4): 0.3055, (S2, 4, 4): 0.316,
         "parm_hier": 0.3655, (S2, 8, 8): 0.39}


def test_shortlist_puts_distinct_schedules_before_chunk_variants():
    """make layer-demo's default estimate: S1 and parm_hier predicted 19% slower than S2's
    first variant are timed before its other chunk counts (S1 won by 1.7x there)."""
    assert tuning.shortlist(TIMES, 0.5, 4) == [(S2, 2, 4), "parm_s1", "parm_hier", (S2, 2, 2)]
    assert tuning.shortlist(TIMES, 0.05, 4) == [(S2, 2, 4), (S2, 2, 2), (S2, 4, 4)]
    assert tuning.shortlist(TIMES, 0.5, 1) == [(S2, 2, 4)]


def test_shortlist_times_every_schedule_before_near_ties_of_one():
    """The fine-grained (1,4,1) layers with NVLink-class links and no profile (docs/benchmark.md,
    Fine-grained layers): the estimate put S2's variants first and parm_hier 1.3-1.4x behind;
    S2's chunk variants took every slot and parm ran 1.24-1.32x the fastest, parm_hier. Now
    each distinct schedule within the margin, parm_hier's pipelined form and Megatron's
    allgather included, is timed before a second chunk count of any (S2's variants within
    1% of each other measured at most 14% apart on the grid)."""
    H2 = "parm_hier_s2"
    times = {(S2, 4, 8): 0.9706, (S2, 8, 8): 0.9748, (S2, 4, 4): 0.9790, (S2, 8, 4): 0.9833,
             (H2, 4, 4): 1.10, (H2, 8, 8): 1.12, "allgather": 1.2, "parm_s1": 1.2698,
             "parm_hier": 1.3713}
    assert tuning.shortlist(times, 0.5, 5) == [(S2, 4, 8), (H2, 4, 4), "allgather", "parm_s1",
                                               "parm_hier"]
    # then the other chunk counts, in predicted order
    assert tuning.shortlist(times, 0.5, 8)[5:] == [(S2, 8, 8), (S2, 4, 4), (S2, 8, 4)]
    # the margin still bounds them all
    assert tuning.shortlist(times, 0.2, 8) == [(S2, 4, 8), (H2, 4, 4), (S2, 8, 8), (S2, 4, 4),
                                               (S2, 8, 4), (H2, 8, 8)]
    assert tuning.DEFAULT_MAX_CANDIDATES == 5  # one slot per distinct candidate schedule


def test_shortlist_always_times_the_unchunked_schedule():
    """End to end at (2,2,1) without a profile, the estimate put four S2 variants first and S1
    outside the margin: parm ran S2 where S1 was faster. S1 is now timed besides them (in
    the last place instead, it pushed out S2 at 4 chunks, the fastest there), and is not
    added twice."""
    times = {(S2, 8, 8): 0.30, (S2, 4, 8): 0.305, (S2, 8, 4): 0.31, (S2, 4, 4): 0.32,
             "parm_s1": 0.50, "parm_hier": 0.52}
    assert tuning.shortlist(times, 0.5, 4) == [(S2, 8, 8), (S2, 4, 8), (S2, 8, 4), (S2, 4, 4)]
    assert tuning.shortlist(times, 0.5, 4, always="parm_s1") == [
        (S2, 8, 8), (S2, 4, 8), (S2, 8, 4), (S2, 4, 4), "parm_s1"]
    assert tuning.shortlist(times, 0.02, 4, always="parm_s1") == [(S2, 8, 8), (S2, 4, 8),
                                                                  "parm_s1"]
    assert tuning.shortlist(TIMES, 0.5, 4, always="parm_s1") == tuning.shortlist(TIMES, 0.5, 4)
    assert tuning.shortlist(times, 0.5, 1, always="parm_hier") == [(S2, 8, 8), "parm_hier"]
    plan = tuning.CallPlan(tuple(tuning.shortlist(times, 0.5, 4, always="parm_s1")), steps=1)
    assert plan.num_calls == tuning.most_calls(4, 1) == 10


def test_plan_takes_turns_and_the_lowest_median_wins_skipping_failures():
    plan = tuning.CallPlan(("a", "b", "c"), steps=3)
    assert plan.num_calls == 12 and [plan.candidate(i) for i in range(12)] == [0, 1, 2] * 4
    assert [plan.timed(i) for i in range(12)] == [False] * 3 + [True] * 9
    # a: warm-up 5, then 2, 4, 3 (median 3); b failed on some rank;
    # c: warm-up 9, then 1.5, 2.5, 2 (median 2)
    measured = tuning.decide(plan, [5, 1, 9, 2, tuning.FAILED, 1.5, 4, 1, 2.5, 3, 1, 2])
    assert measured.winner == "c" and measured.seconds == {"a": 3, "b": tuning.FAILED, "c": 2}
    # cost: every call's time beyond the winner's (failed calls count no time)
    assert measured.cost_s == pytest.approx(3 + 0 + 7 + 0 + 0 + 0 + 2 + 0 + 0.5 + 1 + 0 + 0)
    with pytest.raises(RuntimeError, match="every candidate schedule failed"):
        tuning.decide(tuning.CallPlan(("a",), 1), [tuning.FAILED, tuning.FAILED])


def test_one_lucky_call_does_not_beat_a_steady_candidate():
    """A spread-out candidate's single fast call (its other calls slow) loses to one that is
    steadily faster: the decision is by the median, not the fastest call."""
    plan = tuning.CallPlan(("steady", "spread"), steps=3)
    measured = tuning.decide(plan, [2, 2, 1.0, 0.6, 1.0, 1.4, 1.0, 1.5])
    assert measured.winner == "steady" and measured.seconds == {"steady": 1.0, "spread": 1.4}


@pytest.mark.parametrize("steps,margin,count,cache,message", [
    (0, 0.5, 4, None, "--parm-tune-steps must be a positive integer, got 0"),
    (-2, 0.5, 4, None, "--parm-tune-steps must be a positive integer, got -2"),
    (3, 0.0, 4, None, "--parm-tune-margin must be a positive number, got 0.0"),
    (3, -0.1, 4, None, "--parm-tune-margin must be a positive number, got -0.1"),
    (3, float("nan"), 4, None, "--parm-tune-margin must be a positive number, got nan"),
    (3, 0.5, 0, None, "--parm-tune-candidates must be a positive integer, got 0"),
    (3, 0.5, 4, "/tmp", "--parm-tune-cache must name a file, got the directory /tmp"),
])
def test_bad_tuning_flags_name_the_flag(steps, margin, count, cache, message):
    with pytest.raises(ValueError) as err:
        tuning.check_args(steps, margin, count, cache)
    assert str(err.value) == message


def test_tuning_is_the_default_without_a_profile_and_a_flag_turns_it_either_way():
    assert tuning.enabled(None, None) and not tuning.enabled(None, "nvlink_ib_estimate")
    assert tuning.enabled(True, "nvlink_ib_estimate") and not tuning.enabled(False, None)
    assert tuning.default_cache(None, "runs/x") == "runs/x/parm_tuning.json"
    assert tuning.default_cache(None, None) is None and tuning.default_cache("c.json", "x") == "c.json"


def test_training_flags(tmp_path, prepared_data):
    from megatron_parm.training.arguments import parse_args

    base = ["--config", "configs/gpt2_tiny_moe.yaml", "--moe-token-dispatcher-type", "parm"]
    args = parse_args(base + ["--save", str(tmp_path)], world_size=1)
    assert args.parm_tune is None and args.parm_tune_steps == tuning.DEFAULT_STEPS
    assert args.parm_tune_cache == str(tmp_path / tuning.CACHE_NAME)
    assert parse_args(base + ["--no-parm-tune"], world_size=1).parm_tune is False
    with pytest.raises(ValueError, match="--parm-tune-margin must be a positive number"):
        parse_args(base + ["--parm-tune-margin", "0"], world_size=1)


CANDIDATES = ("parm_s1", "parm_s2", "parm_hier", "allgather")


def _key(num_tokens=128, device="cpu", layer=None, candidates=CANDIDATES):
    shape = LayerShape(num_tokens=num_tokens, hidden_size=64, ffn_hidden_size=256, num_experts=4,
                       topk=2, dtype_bytes=4)
    return tuning.cache_key(shape, Layout(2, 2, 2, 1, 4), True,
                            {"device": device, "backend": "gloo", "world_size": 4}, "p:abc", layer,
                            candidates)


def test_cache_keeps_each_layer_of_one_shape(tmp_path):
    """Two layers of one shape may measure different winners: each keeps its own, also when
    both caches were read before either stored (the layers of one run)."""
    path = str(tmp_path / "tune.json")
    first, second = tuning.TuningCache(path), tuning.TuningCache(path)
    key1, key2 = _key(layer=1), _key(layer=2)
    assert first.lookup(key1) == tuning.Lookup() and second.lookup(key2) == tuning.Lookup()
    first.store(key1, tuning.Measured("parm_s1", {"parm_s1": 0.1, (S2, 2, 2): 0.2}, 0.0, 4))
    second.store(key2, tuning.Measured((S2, 2, 2), {"parm_s1": 0.2, (S2, 2, 2): 0.1}, 0.0, 4))
    assert tuning.TuningCache(path).lookup(key1).measured.winner == "parm_s1"
    assert tuning.TuningCache(path).lookup(key2).measured.winner == (S2, 2, 2)
    assert "differs in layer" in tuning.TuningCache(path).lookup(_key(layer=3)).warning


def test_cache_round_trip_and_misses(tmp_path):
    path = tmp_path / "sub" / "tune.json"
    cache = tuning.TuningCache(str(path))
    assert cache.lookup(_key()) == tuning.Lookup()  # no file: tune, no warning
    measured = tuning.Measured((S2, 2, 4), {(S2, 2, 4): 0.1, "parm_s1": 0.2}, 0.05, 8)
    cache.store(_key(), measured)
    found = tuning.TuningCache(str(path)).lookup(_key()).measured
    assert found.winner == (S2, 2, 4) and found.seconds == measured.seconds
    assert json.loads(path.read_text())["megatron_parm_version"] == megatron_parm.__version__
    # another shape, another cluster: a warning naming what differs, and tuning again
    other = tuning.TuningCache(str(path)).lookup(_key(num_tokens=256))
    assert other.measured is None and other.writable
    assert "differs in shape.num_tokens)" in other.warning and other.warning.startswith(
        f"parm: --parm-tune-cache {path} holds results for another shape")
    assert "cluster.device" in tuning.TuningCache(str(path)).lookup(_key(device="gpu")).warning
    # measured among other candidates (before allgather was one): not reused
    fewer = tuning.TuningCache(str(path)).lookup(_key(candidates=CANDIDATES[:3]))
    assert fewer.measured is None and "differs in candidates)" in fewer.warning


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": "x"}), json.dumps(
    {"format": tuning.CACHE_FORMAT, "version": tuning.CACHE_VERSION, "entries": [{"k": 1}]})])
def test_unreadable_cache_warns_and_is_left_as_it_is(tmp_path, content):
    path = tmp_path / "tune.json"
    path.write_text(content)
    lookup = tuning.TuningCache(str(path)).lookup(_key())
    assert lookup.measured is None and not lookup.writable
    assert lookup.warning.startswith(f"parm: --parm-tune-cache {path} is unreadable (")
    assert lookup.warning.endswith("tuning again; the file is left as it is")
    assert path.read_text() == content


def test_choice_line_is_whole_and_names_how():
    seconds = {"parm_s1": 0.079, (S2, 2, 4): 0.122, "parm_hier": 0.081, (S2, 2, 2): tuning.FAILED}
    line = tuning.ParmChoice("parm_s1", "measured", seconds=seconds, cost_s=0.2, steps=3,
                             cache="c.json").describe()
    assert line == ("parm_s1 (measured, median of 3 calls, slowest rank, forward+backward: "
                    "parm_s1 79.0 ms; runners-up parm_hier 81.0 ms, parm_s2(c=2/4) 122.0 ms, "
                    "parm_s2(c=2) failed); tuning cost 200.0 ms; kept in c.json")
    cached = tuning.ParmChoice("parm_s1", "cached", seconds=seconds, cache="c.json").describe()
    assert cached.startswith("parm_s1 (cached in c.json: parm_s1 79.0 ms; runners-up")
