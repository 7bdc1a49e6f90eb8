"""Every dispatcher on fine-grained modern MoE layers against Megatron's alltoall and a
single-process reference (tests/reference_modern_moe.py).

One torchrun launch per world size runs every layout and case (see modern_moe_worker); the
tests below read its records. The layers: 64 experts, top-8, SwiGLU experts (FFN 8, on
TorchGroupedMLP; SequentialMLP behind alltoall once per case), hidden 16, the router in fp32.
Cases: softmax top-k; with a gated shared expert; sigmoid scores with a non-zero expert bias
(it changes the experts chosen) and a top-k scaling factor, with an ungated shared expert;
group-limited routing (8 groups, 4 chosen, softmax over all experts first). Tolerance: 1e-5
relative (max abs error / max abs value), float32, as tests/distributed/test_dispatchers.py,
for the output, input grad, router grad, every routed expert's fc1 / fc2 grads and the
shared expert's fc1, fc2 and gate grads. Sequence parallelism where tp > 1; the layout in
NO_SP_LAYOUTS also runs with the input replicated over TP (no sequence parallelism).

    4 ranks, 2 per node: 2,2,2 (parm_hier over 2 nodes, ETP 2), 1,4,1 (2 nodes x 2 EP ranks)
    8 ranks, 4 per node: 2,4,2 (2 nodes x 2 EP ranks, ETP 2), 1,8,1 (2 nodes x 4 EP ranks)
"""

from __future__ import annotations


import pytest

from launch import WorkerRecords
from megatron_parm import schedules
from modern_moe_worker import CASES, NO_SP_LAYOUTS, OVERLAP_CASES, SHARED_CASES, quantities

TOL = 1e-5
LAYOUTS = {4: ["2,2,2", "1,4,1"], 8: ["2,4,2", "1,8,1"]}
RANKS_PER_NODE = {4: 2, 8: 4}
PARM = list(schedules.names(schedules.BASELINE, schedules.PARM, schedules.AUTO))


def _worker_argv(world, out):
    return [out, *(f"{layout}@{RANKS_PER_NODE[world]}" for layout in LAYOUTS[world])]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return WorkerRecords(tmp_path_factory, "tests/distributed/modern_moe_worker.py", _worker_argv)


def _params(layouts=None):
    for world, names in (layouts or LAYOUTS).items():
        for layout in names:
            yield pytest.param(world, layout, id=f"w{world}-tp,ep,etp={layout}")


def _rows(records, world, layout, sequence_parallel=None, **match):
    tp = int(layout.split(",")[0])
    sp = tp > 1 if sequence_parallel is None else sequence_parallel
    rows = [r for r in records[world] if r["layout"] == layout and r["sp"] == sp
            and all(r.get(k) == v for k, v in match.items())]
    assert rows, f"no records for world {world} layout {layout} {match}"
    return rows


def _skip_unless_supported(dispatcher, layout, sequence_parallel=None):
    tp, ep, etp = (int(v) for v in layout.split(","))
    sp = tp > 1 if sequence_parallel is None else sequence_parallel
    why = schedules.get(dispatcher).unsupported(tp, ep, etp, sp)
    if why:
        pytest.skip(why)


def _check(rows, case, what):
    assert {r["quantity"] for r in rows} == set(quantities(CASES[case])), rows
    bad = {(r["against"], r.get("schedule"), r["phases"], r["quantity"]): r["err"] for r in rows
           if not r["err"] <= TOL}
    assert not bad, f"{what} differs: {bad}"


@pytest.mark.parametrize("world,layout", list(_params()))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dispatcher", PARM)
def test_matches_megatron_alltoall(records, world, layout, case, dispatcher):
    _skip_unless_supported(dispatcher, layout)
    rows = _rows(records, world, layout, case=case, dispatcher=dispatcher, against="alltoall",
                 overlap=False, phases=False)
    rows = [r for r in rows if "schedule" not in r]  # parm forced: below
    _check(rows, case, dispatcher)


@pytest.mark.parametrize("world,layout", list(_params()))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dispatcher", ["alltoall", "alltoall:sequential"] + PARM)
def test_matches_single_process_reference(records, world, layout, case, dispatcher):
    """alltoall:sequential is Megatron's SequentialMLP behind alltoall (TorchGroupedMLP
    everywhere else)."""
    _skip_unless_supported(dispatcher.partition(":")[0], layout)
    rows = _rows(records, world, layout, case=case, dispatcher=dispatcher, against="reference")
    _check(rows, case, f"{dispatcher} against the single-process MoE")


@pytest.mark.parametrize("world,layout", list(_params()))
@pytest.mark.parametrize("case", list(CASES))
def test_parm_forced_onto_each_schedule_matches_alltoall(records, world, layout, case):
    """parm made to run each of its candidate schedules (S2 at 3 forward and 2 backward
    chunks, Megatron's allgather included), through ParmMoELayer and phase by phase (with
    shared experts: overlapped, the only way the phases run them), against alltoall and the
    single-process reference."""
    tp, ep, etp = (int(v) for v in layout.split(","))
    rows = [r for r in _rows(records, world, layout, case=case, dispatcher="parm")
            if "schedule" in r]
    expected = {s.name for s in schedules.supported_candidates(tp, ep, etp)}
    assert "allgather" in expected
    assert {(r["schedule"], r["phases"], r["against"]) for r in rows} == \
        {(name, phases, against) for name in expected for phases in (False, True)
         for against in ("alltoall", "reference")}
    assert all(r["overlap"] == (r["phases"] and CASES[case].shared) for r in rows)
    _check(rows, case, "parm forced onto a schedule")


@pytest.mark.parametrize("world,layout", list(_params()))
@pytest.mark.parametrize("case", OVERLAP_CASES)
@pytest.mark.parametrize("dispatcher", ["alltoall"] + PARM)
def test_shared_expert_overlap_changes_nothing(records, world, layout, case, dispatcher):
    """--moe-shared-expert-overlap: the shared expert's steps inside the dispatcher's phases
    (Megatron's alltoall points), through the layer and phase by phase (drive_phases), give
    the output and every gradient of the same dispatcher without overlap, and alltoall's."""
    _skip_unless_supported(dispatcher, layout)
    rows = _rows(records, world, layout, case=case, dispatcher=dispatcher, overlap=True)
    rows = [r for r in rows if "schedule" not in r]
    assert {(r["against"], r["phases"]) for r in rows} == \
        {(against, phases) for against in ("no-overlap", "alltoall") for phases in (False, True)}
    _check(rows, case, f"{dispatcher} with the shared expert overlapped")


@pytest.mark.parametrize("world,layout", list(_params(NO_SP_LAYOUTS)))
@pytest.mark.parametrize("case", SHARED_CASES)
@pytest.mark.parametrize("dispatcher", PARM)
def test_replicated_input_without_sequence_parallel(records, world, layout, case, dispatcher):
    """TP > 1 without sequence parallelism: the shared expert takes the replicated input
    whole, the routed experts this rank's shard (ParmMoELayer), against the reference."""
    _skip_unless_supported(dispatcher, layout, sequence_parallel=False)
    rows = _rows(records, world, layout, sequence_parallel=False, case=case,
                 dispatcher=dispatcher, against="reference")
    _check(rows, case, f"{dispatcher} without sequence parallelism")


@pytest.mark.parametrize("world,layout", list(_params(NO_SP_LAYOUTS)))
def test_overlap_refused_without_sequence_parallel(records, world, layout):
    (row,) = _rows(records, world, layout, sequence_parallel=False, against="refusal")
    assert row["message"] and "--sequence-parallel" in row["message"], row


@pytest.mark.parametrize("world,layout", list(_params()))
@pytest.mark.parametrize("case", ["sigmoid-bias", "group-limited"])
def test_router_options_change_the_experts_chosen(records, world, layout, case):
    """The expert bias and the group limit each pick other experts than plain top-k for some
    tokens of the case's data, so the cases check them."""
    (row,) = _rows(records, world, layout, case=case, against="routing")
    assert row["changed"] > 0, row
