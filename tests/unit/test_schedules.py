"""The schedule catalog: one place for every schedule's facts, and a toy schedule added in a test.

The toy (tests/toy_schedule.py: one dispatcher class and one catalog entry) must be accepted
by the arguments, checked by the layout rules, modelled and considered by the automatic
choice, and listed by the benchmark report, with no other file edited. The 4-rank
equivalence launch (tests/distributed/test_dispatchers.py) runs it like the built-in ones.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from launch import REPO
from megatron_parm import schedules
from megatron_parm.dispatchers.base import PHASES
from megatron_parm.perf_model import LayerShape, Layout, choose_schedule, comm_volumes, predict
from megatron_parm.perf_model.profile import load_profile
from toy_schedule import TOY, register_toy

SHAPE = LayerShape(num_tokens=512, hidden_size=256, ffn_hidden_size=512, num_experts=8, topk=2,
                   dtype_bytes=4)
LAYOUT = Layout(tp=2, ep=2, etp=2, nodes=2, ranks_per_node=2)


@pytest.fixture
def toy():
    register_toy()
    yield TOY
    schedules.unregister(TOY.name)


def test_every_entry_names_a_dispatcher_class_or_is_megatrons():
    """Megatron's own have no class of ours, except one parm weighs (allgather): the class
    parm runs it through. Every candidate has a class and a cost plan."""
    from megatron_parm.dispatchers import ParmTokenDispatcher, dispatcher_class

    for name in schedules.names():
        schedule = schedules.get(name)
        if schedule.kind == schedules.NATIVE and not schedule.candidate:
            assert schedule.dispatcher is None
            with pytest.raises(ValueError, match="Megatron-Core's own"):
                dispatcher_class(name)
        else:
            assert issubclass(dispatcher_class(name), ParmTokenDispatcher)
    assert schedules.get("allgather").candidate
    with pytest.raises(ValueError, match="needs its dispatcher class and a cost plan"):
        schedules.Schedule("x", schedules.NATIVE, "x", candidate=True)


def test_parm_s1_leads_the_candidates():
    """Parm's own schedules come first whatever the catalog order (allgather's entry leads
    it): S1 is the unchunked schedule tuning always times, and ties go to it
    (test_perf_model's tie test checks the choice)."""
    names = [s.name for s in schedules.candidates()]
    assert names[0] == "parm_s1" and names[-1] == "allgather"
    assert schedules.names()[0] == "allgather"


def test_unknown_names_list_the_catalog():
    with pytest.raises(ValueError, match="--moe-token-dispatcher-type: unknown dispatcher 'nope'") as err:
        schedules.get("nope")
    for name in schedules.names():
        assert name in str(err.value)


def test_layout_rules_name_the_flags():
    assert "--expert-tensor-parallel-size (2) to divide --tensor-model-parallel-size (1)" in \
        schedules.get("ds_baseline").unsupported(1, 2, 2)
    assert schedules.get("ds_baseline").unsupported(2, 2, 1) is None
    assert "needs --sequence-parallel" in schedules.get("alltoall").unsupported(2, 2, 2, False)
    assert "needs --sequence-parallel" in schedules.get("allgather").unsupported(2, 2, 2, False)
    assert schedules.get("parm_s1").unsupported(2, 2, 2, False) is None
    # ParmMoELayer hands parm's candidates a sequence shard: allgather is one without it too
    assert "allgather" in [s.name for s in schedules.supported_candidates(2, 2, 2)]
    assert schedules.get("parm").unsupported(2, 2, 2, False) is None
    # The automatic choice runs wherever one of its candidates does.
    assert schedules.get("parm").unsupported(1, 2, 2) is None


def test_chunk_counts_are_checked_in_one_place():
    from megatron_parm.config import ParmTransformerConfig

    s2 = schedules.get("parm_s2")
    assert s2.num_chunks() == s2.default_chunks and s2.num_chunks(3) == 3
    assert schedules.get("parm_s1").num_chunks(3) == 1  # unchunked: always one
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="--parm-num-chunks must be an integer >= 1"):
            s2.num_chunks(bad)
    with pytest.raises(ValueError, match="--parm-num-chunks must be an integer >= 1"):
        ParmTransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, parm_num_chunks=0)
    # the backward pass: its own flag, defaulting to the forward count
    assert s2.chunk_counts() == (s2.default_chunks,) * 2
    assert s2.chunk_counts(8) == (8, 8) and s2.chunk_counts(8, 2) == (8, 2)
    assert s2.chunk_counts(None, 2) == (s2.default_chunks, 2)
    assert schedules.get("parm_s1").chunk_counts(8, 2) == (1, 1)
    with pytest.raises(ValueError, match="--parm-bwd-num-chunks must be an integer >= 1"):
        s2.chunk_counts(4, 0)
    with pytest.raises(ValueError, match="--parm-bwd-num-chunks must be an integer >= 1"):
        ParmTransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                              parm_bwd_num_chunks=-2)
    # what the automatic choice tries: every (forward, backward) pair of the candidates
    pairs = s2.chunk_pairs()
    assert pairs == tuple(sorted((c, b) for c in s2.chunk_candidates for b in s2.bwd_chunk_candidates))
    assert (3, 5) in s2.chunk_pairs(((3, 5),))
    # parm_hier_s2 runs its backward in its forward's chunks: --parm-bwd-num-chunks and a
    # requested pair become (F, F)
    hier = schedules.get("parm_hier_s2")
    assert not hier.separate_backward_chunks and hier.chunk_counts(8, 2) == (8, 8)
    assert hier.chunk_pairs(((3, 5),)) == ((2, 2), (3, 3), (4, 4), (8, 8))
    with pytest.raises(ValueError, match="bwd_chunk_candidates need separate_backward_chunks"):
        schedules.Schedule("x", schedules.PARM, "x", dispatcher="m:C", pipelined=True,
                           chunked=True, bwd_chunk_candidates=(2,),
                           separate_backward_chunks=False)
    with pytest.raises(ValueError, match="runs its backward in its forward chunk count"):
        predict("parm_hier_s2", SHAPE, LAYOUT, load_profile("emulated_pcie"), 4,
                bwd_num_chunks=2)


def test_the_pipelined_call_is_a_declared_capability():
    """ParmMoELayer runs a schedule's fused dispatch_compute_combine only where its catalog
    entry declares ``pipelined`` (S2); chunks run inside that call, so a chunked schedule is
    a pipelined one, and Megatron's own dispatchers have none."""
    from megatron_parm.dispatchers import ParmTokenDispatcher, dispatcher_class

    assert [n for n in schedules.names() if schedules.get(n).pipelined] == ["parm_s2",
                                                                            "parm_hier_s2"]
    for name in schedules.names(schedules.BASELINE, schedules.PARM, schedules.AUTO):
        cls = dispatcher_class(name)
        # every dispatcher runs the six phases on its own; pipelined ones also the fused call
        assert all(getattr(cls, phase).phase_checked for phase in PHASES)
        assert hasattr(cls, "dispatch_compute_combine") == (
            schedules.get(name).pipelined or schedules.get(name).kind == schedules.AUTO)
    # a dispatcher built from its class alone, without its catalog entry, runs phase by phase
    assert ParmTokenDispatcher.schedule is None
    with pytest.raises(ValueError, match="a chunked schedule must be pipelined"):
        schedules.Schedule("x", schedules.PARM, "x", dispatcher="m:C", chunked=True,
                           default_chunks=2)
    with pytest.raises(ValueError, match="no pipelined call"):
        schedules.Schedule("x", schedules.NATIVE, "x", pipelined=True)


def test_cost_plans_move_what_the_dataflows_say():
    s1 = comm_volumes("parm_s1", SHAPE, LAYOUT)
    assert comm_volumes("alltoall", SHAPE, LAYOUT) == s1  # Megatron's alltoall moves S1's data
    assert comm_volumes("parm_s2", SHAPE, LAYOUT) == s1  # the same data, in chunks
    # parm_hier's pipelined form: parm_hier's rows, chunk by chunk
    assert comm_volumes("parm_hier_s2", SHAPE, LAYOUT) == comm_volumes("parm_hier", SHAPE, LAYOUT)
    ds = comm_volumes("ds_baseline", SHAPE, LAYOUT)
    assert ds[("all_to_all", "ep")]["inter"] == LAYOUT.tp * s1[("all_to_all", "ep")]["inter"]
    # Every forward collective has its dual in the backward pass, with the same bytes.
    stages = schedules.deduplicated_cost(SHAPE, LAYOUT)
    forward = [s for s in stages if s.direction == schedules.FORWARD and s.kind != schedules.COMPUTE]
    backward = [s for s in stages if s.direction == schedules.BACKWARD and s.kind != schedules.COMPUTE]
    assert [(schedules.DUAL[s.kind], s.group, s.bytes_per_peer) for s in reversed(forward)] == \
        [(s.kind, s.group, s.bytes_per_peer) for s in backward]


def test_allgathers_cost_plan_moves_every_token_to_its_esp_x_ep_group():
    """Megatron's allgather, per rank and peer of its ESP x EP group (4 ranks here: one on
    this node, two on the other): AG of the routing map (E bools), the probabilities (E of 4
    bytes) and the row, and in the backward the output's gradient (M of the probabilities'
    4 bytes); RS of the output, and in the backward of the row's and the probabilities'
    gradients. Experts as S1's. Without sequence parallelism, AG(TP) of the output as S1."""
    n, M, E = SHAPE.num_tokens, SHAPE.hidden_size, SHAPE.num_experts
    gathered = n * (E + E * 4 + M * 4 + M * 4)
    scattered = n * (M * 4 + M * 4 + E * 4)
    assert comm_volumes("allgather", SHAPE, LAYOUT) == {
        ("all_gather", "tp_ep"): {"intra": gathered, "inter": 2 * gathered},
        ("reduce_scatter", "tp_ep"): {"intra": scattered, "inter": 2 * scattered}}
    replicated = comm_volumes("allgather", SHAPE, LAYOUT, sequence_parallel=False)
    assert replicated[("all_gather", "tp")] == comm_volumes(
        "parm_s1", SHAPE, LAYOUT, sequence_parallel=False)[("all_gather", "tp")]

    def flops(name):
        return sum(stage.flops for stage in schedules.get(name).cost_plan(SHAPE, LAYOUT))

    assert flops("allgather") == flops("parm_s1") > 0
    # attention TP alone: its ESP x EP group has one rank, nothing moves
    assert comm_volumes("allgather", SHAPE, Layout(tp=4, ep=1, etp=1, nodes=2,
                                                   ranks_per_node=2)) == {}


def test_a_registered_schedule_is_everywhere(toy):
    from megatron_parm.bench.report import parm_schedules
    from megatron_parm.parallel import validate_layout
    from megatron_parm.training.arguments import build_parser

    assert toy.name in schedules.names()
    choices = next(a for a in build_parser()._actions if a.dest == "moe_token_dispatcher_type").choices
    assert toy.name in choices
    validate_layout(4, 2, 2, 2, 8, toy.name)
    with pytest.raises(ValueError, match="toy_s1 needs --expert-model-parallel-size > 1"):
        validate_layout(4, 4, 1, 4, 8, toy.name)
    assert predict(toy.name, SHAPE, LAYOUT, load_profile("emulated_pcie")).total_s > 0
    choice = choose_schedule(SHAPE, LAYOUT, load_profile("emulated_pcie"))
    assert toy.name in choice.times  # a candidate: the automatic choice weighs it
    assert toy.name in parm_schedules()
    # Where its layout rule says no, the automatic choice leaves it out.
    no_ep = Layout(tp=2, ep=1, etp=2, nodes=2, ranks_per_node=2)
    assert toy.name not in choose_schedule(SHAPE, no_ep, load_profile("emulated_pcie")).times


def test_register_refuses_duplicates_and_builtins_stay(toy):
    with pytest.raises(ValueError, match="already in the catalog"):
        schedules.register(toy)
    with pytest.raises(ValueError, match="built in"):
        schedules.unregister("parm_s1")


def test_the_choice_considers_every_candidate():
    choice = choose_schedule(SHAPE, LAYOUT, load_profile("emulated_pcie"))
    considered = {key if isinstance(key, str) else key[0] for key in choice.times}
    assert considered == {s.name for s in schedules.candidates()}
    chunked = [key for key in choice.times if not isinstance(key, str)]
    assert {(c, b) for _, c, b in chunked} == set(schedules.get("parm_s2").chunk_pairs())


def test_catalog_and_perf_model_import_no_torch():
    code = ("import sys; import megatron_parm.schedules, megatron_parm.perf_model, "
            "megatron_parm.perf_model.calibrate; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "import megatron_parm.schedules as s; "
            "assert not [m for m in sys.modules if m.startswith('megatron_parm.') and m not in "
            "('megatron_parm.schedules', 'megatron_parm.wording') "
            "and not m.startswith('megatron_parm.perf_model')], 'imports'")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_non_editable_install_ships_the_default_profiles(tmp_path):
    """The automatic dispatcher's default profiles are package data, not files of the repo."""
    from launch import build_wheel

    wheel = build_wheel(tmp_path)
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run(pip + ["install", "--no-deps", "--target", str(tmp_path / "site"), str(wheel)],
                   check=True, capture_output=True)
    code = ("from megatron_parm.dispatchers.parm_auto import DEFAULT_PROFILES; "
            "from megatron_parm.perf_model import load_profile; "
            "print(*[load_profile(n).source for n in DEFAULT_PROFILES.values()])")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                            text=True, env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    sources = result.stdout.split()
    assert len(sources) == 2 and all(s.startswith(str(tmp_path / "site")) for s in sources), sources
