"""Every non-native schedule of the catalog against Megatron's alltoall and a single-process MoE.

One torchrun launch per world size runs every layout and case (see moe_equivalence_worker);
the tests below read its records. The 4-rank launch also registers the catalog test's toy
schedule (tests/toy_schedule.py), which must then run like every built-in one. A world size
is launched when a test first asks for it, so `-k w4` runs the 4-rank launch only
(tools/gpu_check.sh, stage a, does that on one GPU). Tolerance: 1e-5 relative (max abs error / max abs value),
float32, for the layer output, input grad, router grad and every expert weight grad.
Every dispatcher runs through ParmMoELayer and, as Megatron-Core's callers drive one, through
its six phases one by one (dropless, capacity, padded): against itself in the layer and
against alltoall, with identity experts (and the capacity's row counts), and with its phases
out of order (one error naming the phase). parm also runs forced onto each of its candidate
schedules (S2 and Megatron's allgather included), in the layer and phase by phase, against
alltoall and the reference (allgather also without sequence parallelism, and its bytes
against the design's formula and its cost plan), and every dispatcher runs from a plain
TransformerConfig. Each layout's process groups are Megatron-Core's own
(parallel_state.initialize_model_parallel, as its test utilities make them): nothing of
megatron_parm.parallel is called first.

A launch is one machine; each layout runs with a ranks-per-node setting (RANKS_PER_NODE,
--parm-ranks-per-node) that gives parm_hier several nodes to split its EP groups by. Its
EP groups then span K nodes with g EP ranks on each:
    4 ranks, 2 per node: 2,2,2 K=2 g=1 (ETP 2); 1,4,1 K=2 g=2; 2,2,1 and 1,2,1 K=1 g=2;
                         4,1,4 no EP
    8 ranks:             2,4,2 at 4 per node K=2 g=2 (ETP 2); 2,2,2 at 4 per node K=1 g=2
                         (ETP 2); 1,4,1 at 1 per node K=4 g=1
"""

from __future__ import annotations


import pytest

from launch import WorkerRecords
from megatron_parm import schedules
from moe_equivalence_worker import CASES as CASE_SPECS
from moe_equivalence_worker import FORCED_CASES, GROUPED_LAYOUTS, PHASE_CASES, TORCH_GROUPED_BF16
from toy_schedule import TOY

TOL = 1e-5
LAYOUTS = {4: ["2,2,2", "1,4,1", "2,2,1", "4,1,4", "1,2,1"], 8: ["2,4,2", "2,2,2", "1,4,1"]}
RANKS_PER_NODE = {4: {layout: 2 for layout in LAYOUTS[4]}, 8: {"2,4,2": 4, "2,2,2": 4, "1,4,1": 1}}
CASES = ["dropless", "drop", "pad", "top1"]
PARM = list(schedules.names(schedules.BASELINE, schedules.PARM, schedules.AUTO))
TOY_WORLD = 4  # the launch that also runs the toy schedule


def _worker_argv(world, out):
    toy = ["--with-toy"] if world == TOY_WORLD else []
    return [*toy, out, *(f"{layout}@{RANKS_PER_NODE[world][layout]}" for layout in LAYOUTS[world])]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return WorkerRecords(tmp_path_factory, "tests/distributed/moe_equivalence_worker.py",
                         _worker_argv)


def _select(records, world, layout, **match):
    rows = [r for r in records[world] if r["layout"] == layout
            and all(r.get(k) == v for k, v in match.items())]
    assert rows, f"no records for world {world} layout {layout} {match}"
    return rows


def _skip_unless_supported(dispatcher, layout, sequence_parallel=True):
    tp, ep, etp = (int(v) for v in layout.split(","))
    why = schedules.get(dispatcher).unsupported(tp, ep, etp, sequence_parallel)
    if why:
        pytest.skip(why)


def _params():
    for world, layouts in LAYOUTS.items():
        for layout in layouts:
            yield pytest.param(world, layout, id=f"w{world}-tp,ep,etp={layout}")


@pytest.mark.parametrize("world,layout", list(_params()))
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dispatcher", PARM)
def test_matches_megatron_alltoall(records, world, layout, case, dispatcher):
    _skip_unless_supported(dispatcher, layout)
    rows = _select(records, world, layout, case=case, dispatcher=dispatcher, against="alltoall")
    assert {r["quantity"] for r in rows} == {"y", "x", "router", "fc1", "fc2"}
    bad = {r["quantity"]: r["err"] for r in rows if not r["err"] <= TOL}
    assert not bad, f"{dispatcher} differs from alltoall: {bad}"


@pytest.mark.parametrize("world,layout", list(_params()))
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dispatcher", ["alltoall"] + PARM)
def test_matches_single_process_reference(records, world, layout, case, dispatcher):
    _skip_unless_supported(dispatcher, layout)
    rows = _select(records, world, layout, case=case, dispatcher=dispatcher, against="reference")
    bad = {r["quantity"]: r["err"] for r in rows if not r["err"] <= TOL}
    assert not bad, f"{dispatcher} differs from the single-process MoE: {bad}"


@pytest.mark.parametrize("world,layout", list(_params()))
@pytest.mark.parametrize("case", PHASE_CASES)
@pytest.mark.parametrize("dispatcher", PARM)
def test_phase_by_phase_matches_the_layer_and_alltoall(records, world, layout, case, dispatcher):
    """Driven through its six phases one by one with the experts between them (router ->
    dispatch_preprocess -> token_dispatch -> dispatch_postprocess -> experts ->
    combine_preprocess -> token_combine -> combine_postprocess, as Megatron-Core's callers
    do), every dispatcher computes what it computes inside ParmMoELayer (S2: its pipelined
    call at 3 forward chunks) and what alltoall computes: output and every gradient."""
    _skip_unless_supported(dispatcher, layout)
    rows = [r for r in _select(records, world, layout, case=f"{case}-phases", dispatcher=dispatcher)
            if r["against"] != "phases-choice"]
    assert {(r["against"], r["quantity"]) for r in rows} == \
        {(a, q) for a in ("layer", "alltoall") for q in ("y", "x", "router", "fc1", "fc2")}
    bad = {(r["against"], r["quantity"]): r["err"] for r in rows if not r["err"] <= TOL}
    assert not bad, f"{dispatcher} phase by phase differs: {bad}"


@pytest.mark.parametrize("world,layout", list(_params()))
@pytest.mark.parametrize("case", FORCED_CASES)
def test_parm_forced_onto_each_schedule_matches_alltoall(records, world, layout, case):
    """parm made to run each of its candidate schedules that can run the layout (S2 at 3
    forward chunks, Megatron's allgather included), through ParmMoELayer and phase by phase:
    output and every gradient as alltoall's and the single-process reference's (the output
    only where the case has an aux loss, which the reference lacks)."""
    tp, ep, etp = (int(v) for v in layout.split(","))
    rows = _select(records, world, layout, case=f"{case}-forced")
    expected = {s.name for s in schedules.supported_candidates(tp, ep, etp)}
    assert "allgather" in expected
    if world == TOY_WORLD and TOY.unsupported(tp, ep, etp) is None:  # registered there too
        expected.add(TOY.name)
    assert {(r["schedule"], r["phases"]) for r in rows} == \
        {(name, phases) for name in expected for phases in (False, True)}
    quantities = {"y", "x", "router", "fc1", "fc2"}
    with_reference = quantities if CASE_SPECS[case][3] == 0 else {"y"}
    for name in expected:
        for phases in (False, True):
            got = {(r["against"], r["quantity"]) for r in rows
                   if (r["schedule"], r["phases"]) == (name, phases)}
            assert got == {("alltoall", q) for q in quantities} | \
                {("reference", q) for q in with_reference}, (name, phases)
    bad = {(r["schedule"], r["phases"], r["against"], r["quantity"]): r["err"] for r in rows
           if not r["err"] <= TOL}
    assert not bad, f"parm forced onto a schedule differs: {bad}"


@pytest.mark.parametrize("world,layout", [p for p in _params() if p.values[1][0] != "1"])
def test_parm_runs_allgather_without_sequence_parallel(records, world, layout):
    """TP > 1 with the input replicated over TP: Megatron's MoELayer refuses its allgather
    dispatcher there, but parm runs it on the sequence shard ParmMoELayer hands it, and
    computes the reference's output and gradients."""
    tp, ep, etp = (int(v) for v in layout.split(","))
    assert schedules.get("allgather").unsupported(tp, ep, etp, sequence_parallel=False)
    rows = _select(records, world, layout, case="dropless-no-sp-forced")
    assert {(r["schedule"], r["quantity"]) for r in rows} == \
        {("allgather", q) for q in ("y", "x", "router", "fc1", "fc2")}
    bad = {r["quantity"]: r["err"] for r in rows if not r["err"] <= TOL}
    assert not bad, f"parm forced onto allgather without sequence parallelism differs: {bad}"


@pytest.mark.parametrize("world,layout", list(_params()))
def test_node_groups_are_made_once_per_layout(records, world, layout):
    """parm_hier's node groups are made when its first layer of a layout is built (after
    Megatron-Core's own initialization) and kept: more layers make no process group."""
    _skip_unless_supported("parm_hier", layout)
    (row,) = _select(records, world, layout, case="node-groups")
    assert row["made"] == 0, row


@pytest.mark.parametrize("world,layout", list(_params()))
@pytest.mark.parametrize("dispatcher", PARM)
def test_plain_transformer_config_matches_alltoall(records, world, layout, dispatcher):
    """Built from Megatron's own TransformerConfig (no parm_* field), every dispatcher takes
    ParmTransformerConfig's defaults and computes what alltoall computes."""
    _skip_unless_supported(dispatcher, layout)
    rows = _select(records, world, layout, case="dropless-plain-config", dispatcher=dispatcher)
    assert {r["quantity"] for r in rows} == {"y", "x", "router", "fc1", "fc2"}
    bad = {r["quantity"]: r["err"] for r in rows if not r["err"] <= TOL}
    assert not bad, f"{dispatcher} from a plain TransformerConfig differs: {bad}"


@pytest.mark.parametrize("world", sorted(LAYOUTS), ids=lambda world: f"w{world}")
def test_parm_takes_s2_phase_by_phase(records, world):
    """parm called phase by phase runs the schedule it chose, S2 and parm_hier_s2 included
    (unpipelined: one chunk)."""
    chosen = {(r["layout"], r["case"]): r["choice"] for r in records[world]
              if r["against"] == "choice"}
    phased = {(r["layout"], r["case"][:-len("-phases")]): r["choice"] for r in records[world]
              if r["against"] == "phases-choice"}
    assert phased
    for key, choice in phased.items():
        assert choice == chosen[key], key
    assert any(choice.startswith("('parm_s2'") for choice in phased.values()), phased
    assert any(choice.startswith("('parm_hier_s2'") for choice in phased.values()), phased


@pytest.mark.parametrize("world,layout", list(_params()))
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dispatcher", ["alltoall"] + PARM)
def test_identity_experts_and_capacity(records, world, layout, case, dispatcher):
    """With identity experts, phase by phase, every token comes back as itself times the
    summed probabilities of its kept experts; with a capacity, each local expert receives
    at most C rows per routing that feeds it, and exactly that many when padded."""
    _skip_unless_supported(dispatcher, layout)
    (row,) = _select(records, world, layout, case=case, dispatcher=dispatcher, against="identity")
    assert row["identity_err"] <= TOL, row
    if CASE_SPECS[case][1] is not None:
        assert row["capacity_ok"], row
        if CASE_SPECS[case][2]:  # padded: every expert full
            assert set(row["tokens_per_expert"]) == {row["capacity_limit"]}, row


@pytest.mark.parametrize("world", sorted(LAYOUTS), ids=lambda world: f"w{world}")
def test_phases_out_of_order_raise_naming_the_phase(records, world):
    """A phase out of order, a combine without its dispatch, a second dispatch of an open
    call, the pipelined call after token_dispatch, a combine twice: one RuntimeError each,
    naming the phase; the open call then completes with the layer's own output."""
    rows = [r for r in records[world] if r["case"] == "phase-order"]
    layout = rows[0]["layout"]
    tp, ep, etp = (int(v) for v in layout.split(","))
    names = {r["dispatcher"] for r in rows}  # the 4-rank launch adds the toy schedule
    assert {name for name in PARM if schedules.get(name).unsupported(tp, ep, etp) is None} <= names
    assert len(rows) == world * len(names)
    for r in rows:
        messages = r["messages"]
        assert len(messages) >= 9, messages
        for label, message in messages.items():
            phase = label.partition(":")[0]
            assert message is not None, f"{r['dispatcher']}: {label} did not raise"
            assert message.startswith(f"{r['dispatcher']}: {phase} called "), message
        assert "still open" in messages["dispatch_preprocess"]
        assert "no dispatch open" in messages["combine_preprocess"]
        assert r["err"] <= TOL, r


@pytest.mark.parametrize("world,layout", [p for p in _params() if p.values[1][0] != "1"])
@pytest.mark.parametrize("dispatcher", PARM)
def test_replicated_input_without_sequence_parallel(records, world, layout, dispatcher):
    if dispatcher == "parm":
        pytest.skip("parm runs one of the others")
    _skip_unless_supported(dispatcher, layout, sequence_parallel=False)
    rows = _select(records, world, layout, case="dropless-no-sp", dispatcher=dispatcher)
    assert {r["quantity"] for r in rows} == {"y", "x", "router", "fc1", "fc2"}
    bad = {r["quantity"]: r["err"] for r in rows if not r["err"] <= TOL}
    assert not bad, f"{dispatcher} without sequence parallelism differs: {bad}"


@pytest.mark.parametrize("world,layout", list(_params()))
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather", "ds_baseline", "parm_s1",
                                        "parm_s2", "parm_hier", "parm_hier_s2"])
def test_bytes_match_design_formulas(records, world, layout, dispatcher):
    """Every rank's recorded bytes per (kind, group) against the design's formulas, computed
    from the routing (allgather: run by parm, forced onto it; its bytes do not depend on the
    routing, so its catalog cost plan must match them too, intra- and inter-node;
    parm_hier_s2: parm_hier's, in 3 chunks of the tokens, with the counts of each chunk)."""
    rows = _select(records, world, layout, case="bytes", dispatcher=dispatcher)
    assert len(rows) == world
    bad = {r["rank"]: r["mismatch"] for r in rows if r["mismatch"]}
    assert not bad, f"recorded bytes (measured, expected) differ per rank: {bad}"
    if dispatcher == "allgather":
        bad = {r["rank"]: r["plan_mismatch"] for r in rows if r["plan_mismatch"] != {}}
        assert not bad, f"recorded bytes (measured, cost plan) differ per rank: {bad}"


@pytest.mark.parametrize("world,layout", list(_params()))
def test_ds_baseline_sends_t_times_the_alltoall_bytes(records, world, layout):
    """Over the world, ds_baseline's A2A(EP) carries t times S1's bytes when each EP group
    meets a TP group in one rank (ETP = TP, or TP = 1); where EP peers share a TP group
    (ETP < TP), each rank sends the copies it holds of its TP peers' tokens too, so
    ds_baseline still sends more, by a factor that depends on the routing."""
    tp, _, etp = (int(v) for v in layout.split(","))
    ds = _select(records, world, layout, case="bytes", dispatcher="ds_baseline")[0]["a2a_world"]
    s1 = _select(records, world, layout, case="bytes", dispatcher="parm_s1")[0]["a2a_world"]
    s2 = _select(records, world, layout, case="bytes", dispatcher="parm_s2")[0]["a2a_world"]
    native = _select(records, world, layout, case="bytes", dispatcher="alltoall")[0]["a2a_world"]
    assert s1 == s2 == native  # S1/S2 move exactly what Megatron's alltoall moves
    if etp == tp:
        assert ds == tp * s1
    else:
        assert ds > s1


@pytest.mark.parametrize("world,layout", list(_params()))
def test_parm_hier_sends_fewer_inter_node_bytes(records, world, layout):
    """Over the world, parm_hier's (and parm_hier_s2's: the same) inter-node token bytes are
    at most S1's, and fewer when a
    token picks two experts on one node other than its own (top-2 routing here), which
    happens on every layout whose EP groups span several nodes with several experts on each.
    (Routing counts are metadata: parm_hier exchanges 2E integers per rank, S1 E.)"""
    from megatron_parm.perf_model import Layout

    hier = _select(records, world, layout, case="bytes", dispatcher="parm_hier")
    s1 = _select(records, world, layout, case="bytes", dispatcher="parm_s1")[0]["inter_world"]
    shared = any(r["shared_remote_node"] for r in hier)
    tp, ep, etp = (int(v) for v in layout.split(","))
    per_node = RANKS_PER_NODE[world][layout]
    spans_nodes = Layout(tp, ep, etp, world // per_node, per_node).group_size("ep_inter") > 1
    assert shared == spans_nodes  # the routing of this suite puts two experts on a node there
    if shared:
        assert hier[0]["inter_world"] < s1
    else:
        assert hier[0]["inter_world"] <= s1
    # its pipelined form sends each (token, node) row once too, chunk by chunk
    pipelined = _select(records, world, layout, case="bytes", dispatcher="parm_hier_s2")
    assert pipelined[0]["inter_world"] == hier[0]["inter_world"]


@pytest.mark.parametrize("world", sorted(LAYOUTS), ids=lambda world: f"w{world}")
def test_parm_runs_the_models_choice(records, world, tmp_path):
    """parm runs what the performance model picks for the layer, with the profile the worker
    gave it: the default estimate (tiny layers: an unchunked schedule, S1 or parm_hier) or a
    latency-free one (pipelining pays: mostly S2). Both kinds run in every launch."""
    from megatron_parm.dispatchers.parm_auto import default_profile_path
    from megatron_parm.perf_model import LayerShape, Layout, choose_schedule, load_profile
    import moe_equivalence_worker as worker

    profiles = {None: load_profile(default_profile_path()),
                "latency-free": load_profile(worker.latency_free_profile(str(tmp_path / "p.yaml")))}
    chosen = {(r["layout"], r["case"]): r["choice"] for r in records[world] if r["against"] == "choice"}
    assert chosen, "parm recorded no choice"
    for (layout, case), choice in chosen.items():
        tp, ep, etp = (int(v) for v in layout.split(","))
        per_node = RANKS_PER_NODE[world][layout]
        topk, capacity, pad, _ = worker.CASES[case]
        shape = LayerShape(num_tokens=worker.S * worker.B // tp, hidden_size=worker.M,
                           ffn_hidden_size=worker.F, num_experts=worker.E, topk=topk,
                           capacity_factor=capacity, pad_to_capacity=pad, dtype_bytes=4)
        model = choose_schedule(shape, Layout(tp, ep, etp, world // per_node, per_node),
                                profiles[worker.PARM_PROFILE[case]],
                                extra_chunks=(worker.NUM_CHUNKS,))
        assert choice == str(model.schedule), (layout, case, model.describe())
    assert "parm_s1" in chosen.values()
    assert any(choice.startswith("('parm_s2'") for choice in chosen.values())


@pytest.mark.parametrize("layout", LAYOUTS[TOY_WORLD])
@pytest.mark.parametrize("case", CASES)
def test_toy_schedule_runs_where_its_rule_allows(records, layout, case):
    """A schedule registered at run time (one dispatcher file, one catalog entry) is built by
    ParmMoELayer, matches alltoall and the reference, passes the identity-expert check phase
    by phase, and is skipped where its layout rule says no."""
    tp, ep, etp = (int(v) for v in layout.split(","))
    rows = [r for r in records[TOY_WORLD] if r["layout"] == layout and r["case"] == case
            and r["dispatcher"] == TOY.name]
    if TOY.unsupported(tp, ep, etp) is not None:
        assert not rows, f"{TOY.name} ran on {layout}, which its layout rule refuses"
        return
    against = {r["against"] for r in rows}
    assert against == {"alltoall", "reference", "identity"}, against
    bad = {(r["against"], r.get("quantity")): r.get("err", r.get("identity_err")) for r in rows
           if not r.get("err", r.get("identity_err")) <= TOL}
    assert not bad, f"{TOY.name} differs: {bad}"


# Host syncs a Parm layer call may make (call sites, as device_sim records them): the one
# device -> host copy of the gathered routing counts, and Megatron's permute, whose two
# masked_selects Megatron's alltoall pays as well; parm's agreement check on its first call.
OWN_SYNC = ("to", "megatron_parm.device.to_host")
PERMUTE_SYNC = ("masked_select", "megatron.core.transformer.moe.moe_utils.permute")
FIRST_CALL_SYNC = ("equal", "megatron_parm.dispatchers.parm_auto._check_agreement")
# Where parm runs Megatron's allgather, allgather's own instead of OWN_SYNC: its
# dispatch_postprocess copies the tokens per local expert to the host and masked_selects the
# local experts' probabilities (as under MoELayer).
ALLGATHER_SYNCS = {("cpu", "megatron.core.transformer.moe.token_dispatcher.dispatch_postprocess"),
                   ("masked_select",
                    "megatron.core.transformer.moe.token_dispatcher.dispatch_postprocess")}


def _simulated(records, world, layout, case):
    """Every rank's record of each non-native schedule the layout runs, of parm_s2 with one
    chunk ("parm_s2:1") and of parm forced onto allgather ("parm:allgather")."""
    rows = _select(records, world, layout, case=f"device-sim-{case}")
    tp, ep, etp = (int(v) for v in layout.split(","))
    expected = [name for name in PARM if schedules.get(name).unsupported(tp, ep, etp) is None]
    for name in expected + ["parm_s2:1", "parm_hier_s2:1", "parm:allgather"]:
        assert sum(r["dispatcher"] == name for r in rows) == world, (name, rows)
    assert {r["choice"] for r in rows if r["dispatcher"] == "parm:allgather"} == {"allgather"}
    return rows


@pytest.mark.parametrize("world,layout", list(_params()))
@pytest.mark.parametrize("case", ["dropless", "pad"])
def test_no_host_tensor_meets_device_rows(records, world, layout, case):
    """Every tensor a dispatcher makes and uses with the rows is made on their device."""
    bad = {(r["dispatcher"], r["rank"]): r["mixing"] for r in _simulated(records, world, layout, case)
           if r["mixing"]}
    assert not bad, f"host tensors used with device tensors: {bad}"


@pytest.mark.parametrize("world,layout", list(_params()))
@pytest.mark.parametrize("case", ["dropless", "pad"])
def test_host_syncs_per_layer_call(records, world, layout, case):
    """One device -> host copy per layer call (the gathered counts; S1, S2 and ds_baseline
    skip it when padding to capacity, where the counts are known), none in the backward, none
    per chunk of S2 or parm_hier_s2. parm running Megatron's allgather pays allgather's own
    syncs instead, in its dispatch_postprocess, and none in the backward either."""
    for r in _simulated(records, world, layout, case):
        forward = [tuple(s) for s in r["syncs_forward"]]
        assert r["syncs_backward"] == [], (r["dispatcher"], r["syncs_backward"])
        own = forward.count(OWN_SYNC)
        ran_allgather = r["choice"] == "allgather"
        if case == "dropless":
            assert own == (0 if ran_allgather else 1), (r["dispatcher"], forward)
        else:
            known = r["dispatcher"] in ("ds_baseline", "parm_s1", "parm_s2", "parm_s2:1")
            assert own == 0 if known else own <= 1, (r["dispatcher"], forward)
        allowed = {OWN_SYNC, PERMUTE_SYNC} | ({FIRST_CALL_SYNC} if r["dispatcher"] == "parm" else set())
        if ran_allgather:
            allowed = (allowed - {OWN_SYNC}) | ALLGATHER_SYNCS
            assert ALLGATHER_SYNCS <= set(forward), (r["dispatcher"], forward)
        assert set(forward) <= allowed, (r["dispatcher"], forward)
    by_name = {(r["dispatcher"], r["rank"]): r["syncs_forward"]
               for r in _simulated(records, world, layout, case)}
    for rank in range(world):
        for name in ("parm_s2", "parm_hier_s2"):  # c = 3 vs c = 1
            assert by_name[(name, rank)] == by_name[(f"{name}:1", rank)], name


GROUPED_TOL = 3e-2  # GroupedMLP vs SequentialMLP, both in bf16 (different summation orders)
GROUPED = [p for p in _params() if p.values[1] in GROUPED_LAYOUTS.get(p.values[0], ())]


@pytest.mark.parametrize("world,layout", GROUPED)
@pytest.mark.parametrize("dispatcher", ["alltoall"] + PARM)
def test_grouped_gemm_experts_compute_the_same(records, world, layout, dispatcher):
    """--moe-grouped-gemm: Megatron's GroupedMLP behind every dispatcher (S2's per-chunk expert
    calls included) gives the output and gradients of SequentialMLP behind alltoall, to bf16
    precision."""
    _skip_unless_supported(dispatcher, layout)
    rows = _select(records, world, layout, case="grouped-gemm", dispatcher=dispatcher)
    assert {r["quantity"] for r in rows} == {"y", "x", "router", "fc1", "fc2"}
    bad = {r["quantity"]: r["err"] for r in rows if not r["err"] <= GROUPED_TOL}
    assert not bad, f"{dispatcher} with GroupedMLP differs from SequentialMLP: {bad}"


@pytest.mark.parametrize("world,layout", GROUPED)
def test_grouped_gemm_called_as_the_package_requires(records, world, layout):
    """Batch sizes on the host as int64, rows contiguous bf16 (grouped_gemm's checks)."""
    rows = _select(records, world, layout, case="grouped-gemm-calls")
    tp, ep, etp = (int(v) for v in layout.split(","))
    runs = 1 + sum(schedules.get(name).unsupported(tp, ep, etp) is None for name in PARM)
    assert sum(r["dispatcher"] in ["alltoall"] + PARM for r in rows) == world * runs
    bad = {(r["dispatcher"], r["rank"]): (r["error"], r["violations"], r["mixing"]) for r in rows
           if r["error"] or r["violations"] or r["mixing"]}
    assert not bad, bad


def _torch_grouped(records, world, layout, dtype, dispatcher):
    rows = _select(records, world, layout, case=f"torch-grouped-{dtype}", dispatcher=dispatcher,
                   against="sequential")
    assert {r["quantity"] for r in rows} == {"y", "x", "router", "fc1", "fc2"}
    return rows


@pytest.mark.parametrize("world,layout", GROUPED)
@pytest.mark.parametrize("dispatcher", ["alltoall"] + PARM)
def test_torch_grouped_experts_compute_the_same(records, world, layout, dispatcher):
    """--moe-grouped-gemm without grouped_gemm: TorchGroupedMLP (PyTorch's grouped_mm) behind
    every dispatcher gives the output and gradients of SequentialMLP behind alltoall, in
    float32 to the suite's tolerance. S2 runs 3 forward and 2 backward chunks (parm_hier_s2 3
    both ways), and parm picks a pipelined schedule here (a latency-free profile: S2, or
    parm_hier_s2 where the EP group spans nodes), so that per-chunk expert calls run the
    grouped GEMM."""
    _skip_unless_supported(dispatcher, layout)
    rows = _torch_grouped(records, world, layout, "fp32", dispatcher)
    bad = {r["quantity"]: r["err"] for r in rows if not r["err"] <= TOL}
    assert not bad, f"{dispatcher} with TorchGroupedMLP differs from SequentialMLP: {bad}"
    if dispatcher == "parm":
        choice, = _select(records, world, layout, case="torch-grouped-fp32", dispatcher="parm",
                          against="schedule")
        assert choice["choice"].startswith(("('parm_s2'", "('parm_hier_s2'")), choice


@pytest.mark.parametrize("world,layout", GROUPED)
@pytest.mark.parametrize("dispatcher", TORCH_GROUPED_BF16)
def test_torch_grouped_experts_in_bf16(records, world, layout, dispatcher):
    """TorchGroupedMLP in bf16 (its grouped GEMM on 16-byte rows) against SequentialMLP in
    bf16 behind alltoall, to bf16 precision."""
    rows = _torch_grouped(records, world, layout, "bf16", dispatcher)
    bad = {r["quantity"]: r["err"] for r in rows if not r["err"] <= GROUPED_TOL}
    assert not bad, f"{dispatcher} with TorchGroupedMLP in bf16 differs from SequentialMLP: {bad}"
