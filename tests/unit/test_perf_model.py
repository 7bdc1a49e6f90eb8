"""Unit tests of the alpha-beta performance model (pure Python, no process groups).

Small case used throughout (hand-computed below): tp = ep = etp = 2 on 2 nodes x 2 ranks
(TP/ETP inside a node, EP across), n = 8 tokens per rank, M = 4, H = 8, E = 4, k = 2, fp32.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from megatron_parm.perf_model import (COLLECTIVE_KINDS, LayerShape, Layout, Profile,  # noqa
                                      build_plan, choose_schedule, comm_volumes,
                                      fit_alpha_beta, load_profile, predict, save_profile)

from megatron_parm.perf_model.profile import shipped_profiles  # noqa: E402
from megatron_parm import schedules  # noqa: E402

PROFILE_DIR = os.path.join(REPO_ROOT, "megatron_parm", "perf_model", "profiles")
SHIPPED_PROFILES = ("emulated_pcie.yaml", "emulated_nvlink.yaml", "nvlink_ib_estimate.yaml")
PLAN_SCHEDULE = os.path.join(REPO_ROOT, "tools", "plan_schedule.py")

SMALL_LAYOUT = Layout(tp=2, ep=2, etp=2, nodes=2, ranks_per_node=2)


def small_shape(**overrides):
    fields = dict(num_tokens=8, hidden_size=4, ffn_hidden_size=8, num_experts=4, topk=2,
                  dtype_bytes=4, prob_bytes=0)
    fields.update(overrides)
    return LayerShape(**fields)


def uniform_profile(alpha_intra=1e-3, alpha_inter=1e-3, beta_intra=1e-6, beta_inter=2e-6,
                    compute_alpha=0.0, compute_beta=1e-9, name="test"):
    return Profile(
        name=name,
        alpha={kind: {"intra": alpha_intra, "inter": alpha_inter} for kind in COLLECTIVE_KINDS},
        beta={kind: {"intra": beta_intra, "inter": beta_inter} for kind in COLLECTIVE_KINDS},
        compute_alpha=compute_alpha, compute_beta=compute_beta, provenance="estimate")


def profile_dict():
    return uniform_profile().to_dict()


# ---------------------------------------------------------------- layout


def test_groups_follow_megatron_rank_order():
    layout = Layout(tp=2, ep=4, etp=2, nodes=2, ranks_per_node=8)
    assert layout.group_ranks("tp", 5) == [4, 5]
    assert layout.group_ranks("expt_tp", 5) == [4, 5]
    # rank = edp_idx * ep * etp + ep_idx * etp + etp_idx: EP strides by etp
    assert layout.group_ranks("ep", 5) == [1, 3, 5, 7]
    assert layout.group_ranks("ep", 10) == [8, 10, 12, 14]
    assert layout.is_intra("ep") and layout.is_intra("tp")


def test_peer_counts_and_worst_rank():
    layout = Layout(tp=1, ep=4, etp=1, nodes=2, ranks_per_node=2)
    assert layout.peer_counts("ep", 0) == (1, 2)
    assert layout.peer_counts("ep") == (1, 2)
    assert not layout.is_intra("ep")
    # groups that straddle a node boundary for some ranks only: the worst rank counts
    straddling = Layout(tp=2, ep=1, etp=1, nodes=2, ranks_per_node=3)
    assert straddling.peer_counts("tp", 0) == (1, 0)
    assert straddling.peer_counts("tp", 2) == (0, 1)
    assert straddling.peer_counts("tp") == (0, 1)


def test_layout_rejects_bad_sizes():
    with pytest.raises(ValueError, match="tp"):
        Layout(tp=3, ep=1, etp=1, nodes=1, ranks_per_node=4)
    with pytest.raises(ValueError, match="ep \\* etp"):
        Layout(tp=1, ep=4, etp=2, nodes=1, ranks_per_node=4)
    with pytest.raises(ValueError, match="ranks_per_node"):
        Layout(tp=1, ep=1, etp=1, nodes=1, ranks_per_node=0)


# ---------------------------------------------------------------- volumes


def test_hand_computed_volumes_small_case():
    # Row = M*b = 16 B. S1: rows per expert k*n/E = 4, rows to the EP peer 4 * 2 = 8 -> 128 B
    # per A2A; 4 A2As (dispatch, combine, both directions) -> 512 B, all inter-node.
    # R = E * 4 = 16 rows received; AG(ESP) 16 * 16 = 256 B to the one ESP peer, forward AG
    # plus backward AG (dual of RS) = 512 B; RS likewise.
    assert comm_volumes("parm_s1", small_shape(), SMALL_LAYOUT) == {
        ("all_to_all", "ep"): {"intra": 0.0, "inter": 512.0},
        ("all_gather", "expt_tp"): {"intra": 512.0, "inter": 0.0},
        ("reduce_scatter", "expt_tp"): {"intra": 512.0, "inter": 0.0},
    }
    assert comm_volumes("parm_s2", small_shape(), SMALL_LAYOUT) == comm_volumes(
        "parm_s1", small_shape(), SMALL_LAYOUT)
    # ds_baseline: AG(TP) of n*M*b = 128 B, backward RS 128 B. The gate sees N = 16 tokens:
    # rows per expert 8, to the peer 16 rows = 256 B per A2A -> 1024 B. R = 32 rows,
    # AR(ESP) of 32 * 16 = 512 B: 2 * (2-1)/2 * 512 = 512 B, forward and backward -> 1024 B.
    assert comm_volumes("ds_baseline", small_shape(), SMALL_LAYOUT) == {
        ("all_gather", "tp"): {"intra": 128.0, "inter": 0.0},
        ("all_to_all", "ep"): {"intra": 0.0, "inter": 1024.0},
        ("all_reduce", "expt_tp"): {"intra": 1024.0, "inter": 0.0},
        ("reduce_scatter", "tp"): {"intra": 128.0, "inter": 0.0},
    }


def test_probabilities_travel_on_the_dispatch_path():
    shape = small_shape(prob_bytes=4)
    volumes = comm_volumes("parm_s1", shape, SMALL_LAYOUT)
    # dispatch A2A rows carry 4 more bytes (both directions), combine A2A does not:
    # 2 * 8 * 20 + 2 * 8 * 16 = 576
    assert volumes[("all_to_all", "ep")] == {"intra": 0.0, "inter": 576.0}
    # forward AG of 16 rows * 20 B + backward AG (grad of RS) of 16 rows * 16 B
    assert volumes[("all_gather", "expt_tp")] == {"intra": 576.0, "inter": 0.0}
    assert volumes[("reduce_scatter", "expt_tp")] == {"intra": 576.0, "inter": 0.0}


def test_restore_without_sequence_parallel():
    s1 = comm_volumes("parm_s1", small_shape(), SMALL_LAYOUT, sequence_parallel=False)
    assert s1[("all_gather", "tp")] == {"intra": 128.0, "inter": 0.0}  # n*M*b, forward only
    s2 = comm_volumes("parm_s2", small_shape(prob_bytes=4), SMALL_LAYOUT,
                      sequence_parallel=False)
    assert s2[("all_gather", "tp")] == {"intra": 16 * 20.0, "inter": 0.0}  # R rows + probs
    ds = comm_volumes("ds_baseline", small_shape(), SMALL_LAYOUT, sequence_parallel=False)
    assert ("all_gather", "tp") not in ds and ("reduce_scatter", "tp") not in ds


def test_mixed_ep_group_splits_bytes_per_peer():
    layout = Layout(tp=1, ep=4, etp=1, nodes=2, ranks_per_node=2)
    # k*n/E = 4 rows per expert, 1 expert per EP rank -> 4 rows = 64 B per peer per A2A;
    # 1 peer on the node, 2 off it; 4 A2As.
    volumes = comm_volumes("parm_s1", small_shape(), layout)
    assert volumes == {("all_to_all", "ep"): {"intra": 4 * 64.0, "inter": 4 * 2 * 64.0}}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("nodes", [2, 4])
def test_ds_baseline_inter_a2a_is_t_times_s1(tp, nodes):
    layout = Layout(tp=tp, ep=nodes, etp=tp, nodes=nodes, ranks_per_node=tp)
    shape = LayerShape(num_tokens=64, hidden_size=32, ffn_hidden_size=16, num_experts=8,
                       topk=2, dtype_bytes=2)
    ds = comm_volumes("ds_baseline", shape, layout)[("all_to_all", "ep")]
    s1 = comm_volumes("parm_s1", shape, layout)[("all_to_all", "ep")]
    assert s1["inter"] > 0
    assert ds["inter"] == tp * s1["inter"]
    assert ds["intra"] == tp * s1["intra"]


def test_capacity_factor():
    shape = small_shape(capacity_factor=0.5)
    assert shape.capacity(8) == 2  # ceil(2 * 8 * 0.5 / 4)
    assert shape.rows_per_expert(8) == 2.0  # dropped from 4
    assert small_shape(capacity_factor=1.1).capacity(8) == 5  # ceil(4.4)
    assert small_shape(capacity_factor=1.0).capacity(8) == 4  # no float round-up
    assert small_shape(capacity_factor=1.1).rows_per_expert(8) == 4.0  # no drop, no pad
    assert small_shape(capacity_factor=1.1, pad_to_capacity=True).rows_per_expert(8) == 5.0
    padded = comm_volumes("parm_s1", small_shape(capacity_factor=1.1, pad_to_capacity=True),
                          SMALL_LAYOUT)
    assert padded[("all_to_all", "ep")]["inter"] == 4 * (5 * 2) * 16.0
    with pytest.raises(ValueError, match="pad_to_capacity"):
        small_shape(pad_to_capacity=True)


def test_expert_flops_match_between_s1_and_ds_when_etp_equals_tp():
    def flops(dispatcher):
        return sum(step.flops for step in build_plan(dispatcher, small_shape(), SMALL_LAYOUT))

    # S1: s * R rows with H/s; ds: t * R rows (duplicated over TP) with H/s
    per_row = 2 * 4 * (8 / 2) * 2  # fc1 + fc2, H split over etp = 2
    assert flops("parm_s1") == 3 * 2 * 16 * per_row  # forward + 2x backward
    assert flops("ds_baseline") == flops("parm_s1")
    assert small_shape(gated_linear_unit=True).expert_flops_per_row(2) == 1.5 * per_row


def test_unknown_dispatcher_and_bad_experts():
    for name in ("parm", "parm_s3"):  # no cost plan in the catalog; not in it
        with pytest.raises(ValueError, match="unknown dispatcher"):
            comm_volumes(name, small_shape(), SMALL_LAYOUT)
    with pytest.raises(ValueError, match="num_experts"):
        comm_volumes("parm_s1", small_shape(num_experts=3, topk=2), SMALL_LAYOUT)


# ---------------------------------------------------------------- timing


def test_s1_time_hand_computed():
    profile = uniform_profile()
    a2a = 1e-3 + 2e-6 * 128  # inter
    gather = 1e-3 + 1e-6 * 256  # intra (AG and RS alike)
    compute = 1e-9 * 2 * 16 * 64  # s * R rows, 4*M*H/s = 64 flops per row
    prediction = predict("parm_s1", small_shape(), SMALL_LAYOUT, profile)
    assert prediction.forward_s == pytest.approx(2 * a2a + 2 * gather + compute)
    assert prediction.backward_s == pytest.approx(2 * a2a + 2 * gather + 2 * compute)
    assert prediction.total_s == pytest.approx(prediction.forward_s + prediction.backward_s)
    assert sum(prediction.stage_seconds().values()) == pytest.approx(prediction.total_s)
    assert [stage.name for stage in prediction.stages if stage.direction == "forward"] == [
        "dispatch_a2a", "dispatch_ag", "experts", "combine_rs", "combine_a2a"]


def test_s2_time_hand_computed():
    profile = uniform_profile()
    a2a = 1e-3 + 2e-6 * 64  # half the bytes per chunk, full alpha
    gather = 1e-3 + 1e-6 * 128
    compute = 1e-9 * 2 * 16 * 64 / 2
    prediction = predict("parm_s2", small_shape(), SMALL_LAYOUT, profile, num_chunks=2)
    one_chunk = 2 * a2a + 2 * gather + compute
    busiest = max(2 * a2a, 2 * gather, compute)
    assert prediction.forward_s == pytest.approx(one_chunk + busiest)
    assert prediction.resources["forward"]["inter"] == pytest.approx(2 * a2a)
    assert prediction.resources["forward"]["intra"] == pytest.approx(2 * gather)


@pytest.mark.parametrize("profile_file", SHIPPED_PROFILES)
@pytest.mark.parametrize("num_tokens", [4, 256, 4096])
def test_s2_with_one_chunk_equals_s1(profile_file, num_tokens):
    profile = load_profile(os.path.join(PROFILE_DIR, profile_file))
    shape = small_shape(num_tokens=num_tokens, hidden_size=256, ffn_hidden_size=512,
                        prob_bytes=4)
    s1 = predict("parm_s1", shape, SMALL_LAYOUT, profile)
    s2 = predict("parm_s2", shape, SMALL_LAYOUT, profile, num_chunks=1)
    assert s2.total_s == s1.total_s
    assert s2.forward_s == s1.forward_s and s2.backward_s == s1.backward_s


def test_s2_with_one_chunk_differs_from_s1_only_by_restore():
    profile = uniform_profile()
    s1 = predict("parm_s1", small_shape(), SMALL_LAYOUT, profile, sequence_parallel=False)
    s2 = predict("parm_s2", small_shape(), SMALL_LAYOUT, profile, num_chunks=1,
                 sequence_parallel=False)

    def restore(prediction):
        return sum(stage.seconds for stage in prediction.stages if stage.name == "restore_ag")

    assert restore(s1) == pytest.approx(1e-3 + 1e-6 * 128)
    assert restore(s2) == pytest.approx(1e-3 + 1e-6 * 256)
    assert s2.total_s - restore(s2) == pytest.approx(s1.total_s - restore(s1))


@pytest.mark.parametrize("dispatcher,num_chunks",
                         [("ds_baseline", None), ("parm_s1", None), ("parm_s2", 4)])
@pytest.mark.parametrize("field", ["num_tokens", "hidden_size", "ffn_hidden_size"])
def test_time_is_monotonic_in_message_size(dispatcher, num_chunks, field):
    profile = load_profile(os.path.join(PROFILE_DIR, "emulated_pcie.yaml"))
    times = []
    for value in (8, 16, 64, 256, 1024):
        shape = small_shape(**{field: value})
        times.append(predict(dispatcher, shape, SMALL_LAYOUT, profile, num_chunks).total_s)
    assert all(later > earlier for earlier, later in zip(times, times[1:]))


def test_s2_is_bounded_below_by_its_busiest_resource():
    profile = load_profile(os.path.join(PROFILE_DIR, "emulated_nvlink.yaml"))
    shape = small_shape(num_tokens=1024, hidden_size=512, ffn_hidden_size=256)
    for chunks in (2, 4, 8, 16):
        prediction = predict("parm_s2", shape, SMALL_LAYOUT, profile, num_chunks=chunks)
        for direction, busy in prediction.resources.items():
            seconds = prediction.forward_s if direction == "forward" else prediction.backward_s
            assert seconds >= chunks * max(busy.values()) - 1e-12


def test_predict_checks_num_chunks():
    with pytest.raises(ValueError, match="num_chunks"):
        predict("parm_s2", small_shape(), SMALL_LAYOUT, uniform_profile())
    with pytest.raises(ValueError, match="num_chunks"):
        predict("parm_s1", small_shape(), SMALL_LAYOUT, uniform_profile(), num_chunks=4)


def test_single_rank_groups_cost_nothing():
    layout = Layout(tp=1, ep=1, etp=1, nodes=1, ranks_per_node=1)
    assert comm_volumes("parm_s1", small_shape(), layout) == {}
    prediction = predict("parm_s1", small_shape(), layout, uniform_profile())
    assert [stage.kind for stage in prediction.stages] == ["compute", "compute"]


# ---------------------------------------------------------------- choice


def test_choice_prefers_s1_for_tiny_layers_and_s2_for_large_ones():
    profile = load_profile(os.path.join(PROFILE_DIR, "emulated_pcie.yaml"))
    tiny = small_shape(num_tokens=8, hidden_size=16, ffn_hidden_size=16)
    choice = choose_schedule(tiny, SMALL_LAYOUT, profile)
    assert choice.schedule == "parm_s1"
    assert choice.dispatcher == "parm_s1" and choice.num_chunks == 1
    assert set(choice.times) == {"parm_s1", "parm_hier", "allgather"} | {
        ("parm_s2", c, b) for c in (2, 4, 8) for b in (2, 4, 8)} | {
        ("parm_hier_s2", c, c) for c in (2, 4, 8)}  # one chunk count for both passes

    large = small_shape(num_tokens=4096, hidden_size=1024, ffn_hidden_size=1024)
    choice = choose_schedule(large, SMALL_LAYOUT, profile)
    # a pipelined schedule: S2, or parm_hier's pipelined form where its rows pay too
    assert schedules.get(choice.dispatcher).chunked and choice.num_chunks in (2, 4, 8)
    assert choice.times[choice.schedule] == min(choice.times.values())
    assert choice.times[choice.schedule] < min(choice.times["parm_s1"], choice.times["parm_hier"])


def test_choice_matches_the_prototype_direction_on_gpu_estimates():
    profile = load_profile(os.path.join(PROFILE_DIR, "nvlink_ib_estimate.yaml"))
    layout = Layout(tp=8, ep=4, etp=8, nodes=4, ranks_per_node=8)
    shape = LayerShape(num_tokens=4096, hidden_size=4096, ffn_hidden_size=14336,
                       num_experts=8, topk=2, dtype_bytes=2)
    assert choose_schedule(shape, layout, profile).dispatcher == "parm_s2"
    tiny = LayerShape(num_tokens=2, hidden_size=64, ffn_hidden_size=64, num_experts=8,
                      topk=2, dtype_bytes=2)
    assert choose_schedule(tiny, layout, profile).schedule == "parm_s1"


def test_choice_is_deterministic_and_breaks_ties_towards_s1():
    profile = load_profile(os.path.join(PROFILE_DIR, "emulated_nvlink.yaml"))
    shape = small_shape(num_tokens=512, hidden_size=256, ffn_hidden_size=256)
    first = choose_schedule(shape, SMALL_LAYOUT, profile, chunk_candidates=(8, 2, 4, 4))
    second = choose_schedule(shape, SMALL_LAYOUT, profile, chunk_candidates=(2, 4, 8))
    assert first.schedule == second.schedule and first.times == second.times
    free = uniform_profile(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    assert choose_schedule(shape, SMALL_LAYOUT, free).schedule == "parm_s1"
    # min_gain: S2 must beat S1 by more than that fraction
    best = first.times[first.schedule] / first.times["parm_s1"]
    assert choose_schedule(shape, SMALL_LAYOUT, profile,
                           min_gain=1.0 - best + 0.01).schedule == "parm_s1"


def test_choice_skips_chunk_counts_above_token_count_and_rejects_bad_ones():
    choice = choose_schedule(small_shape(num_tokens=4), SMALL_LAYOUT, uniform_profile())
    assert set(choice.times) == {"parm_s1", "parm_hier", "allgather"} | {
        ("parm_s2", c, b) for c in (2, 4) for b in (2, 4)} | {("parm_hier_s2", c, c) for c in (2, 4)}
    with pytest.raises(ValueError, match="chunk_candidates"):
        choose_schedule(small_shape(), SMALL_LAYOUT, uniform_profile(), chunk_candidates=(1,))


def test_forward_and_backward_chunks_are_modelled_apart():
    profile = load_profile(os.path.join(PROFILE_DIR, "emulated_pcie.yaml"))
    shape = small_shape(num_tokens=2048, hidden_size=512, ffn_hidden_size=512)
    same = predict("parm_s2", shape, SMALL_LAYOUT, profile, 4)
    assert same.bwd_num_chunks == 4 and same == predict("parm_s2", shape, SMALL_LAYOUT, profile, 4,
                                                         bwd_num_chunks=4)
    mixed = predict("parm_s2", shape, SMALL_LAYOUT, profile, 4, bwd_num_chunks=2)
    # the forward pass is the same; the backward is the one at 2 chunks
    assert mixed.forward_s == same.forward_s
    assert mixed.backward_s == predict("parm_s2", shape, SMALL_LAYOUT, profile, 2).backward_s
    assert mixed.stage_seconds()["backward/grad_experts"] == pytest.approx(
        same.stage_seconds()["backward/grad_experts"], rel=0.2)
    with pytest.raises(ValueError, match="bwd_num_chunks"):
        predict("parm_s2", shape, SMALL_LAYOUT, profile, 4, bwd_num_chunks=0)
    with pytest.raises(ValueError, match="num_chunks"):
        predict("parm_s1", shape, SMALL_LAYOUT, profile, bwd_num_chunks=2)


def test_choice_picks_forward_and_backward_chunks_separately():
    # every term fixed here, near the emulated pcie preset's (a recalibration moves the shipped
    # profiles, which changed this choice twice): 12 / 6 ns per byte inter / intra, 62 GFLOP/s,
    # and chunks that cost 13.6 ms each
    profile = dataclasses.replace(
        uniform_profile(alpha_intra=1.3e-3, alpha_inter=0.3e-3, beta_intra=6e-9, beta_inter=1.2e-8,
                        compute_alpha=1e-4, compute_beta=1.6e-11),
        chunk_overhead=0.0136, chunk_expert_overhead=0.0, overlap_efficiency=0.67,
        layer_scale=1.17)
    shape = small_shape(num_tokens=4096, hidden_size=512, ffn_hidden_size=512)
    choice = choose_schedule(shape, SMALL_LAYOUT, profile)
    assert choice.schedule == min(choice.times, key=choice.times.get)
    # the backward pass has twice the compute per chunk: here it pays to cut S2's finer
    s2 = {key: t for key, t in choice.times.items() if key[0] == "parm_s2"}
    _, forward, backward = min(s2, key=s2.get)
    assert backward > forward
    for (name, forward, backward), seconds in ((k, v) for k, v in choice.times.items()
                                               if not isinstance(k, str)):
        assert seconds == predict(name, shape, SMALL_LAYOUT, profile, forward,
                                  bwd_num_chunks=backward).total_s
    # the pair given by the flags is tried too
    extra = choose_schedule(shape, SMALL_LAYOUT, profile, extra_chunks=((3, 5), 6))
    assert ("parm_s2", 3, 5) in extra.times and ("parm_s2", 6, 6) in extra.times


def test_choice_labels():
    from megatron_parm.perf_model import schedule_label

    assert schedule_label("parm_s1") == "parm_s1"
    assert schedule_label(("parm_s2", 4, 4)) == "parm_s2(c=4)"
    assert schedule_label(("parm_s2", 8, 4)) == "parm_s2(c=8/4)"


# ---------------------------------------------------------------- profiles


@pytest.mark.parametrize("profile_file", SHIPPED_PROFILES)
def test_shipped_profiles_load(profile_file):
    profile = load_profile(os.path.join(PROFILE_DIR, profile_file))
    assert profile.provenance == "estimate"
    assert "estimate" in profile.note.lower()
    for kind in COLLECTIVE_KINDS:
        # intra-node links are faster than inter-node ones in every shipped profile
        assert profile.beta[kind]["intra"] < profile.beta[kind]["inter"]


# the cluster kinds beyond one DGX (docs/benchmark.md, "Predicted on a real cluster"): every
# number names its source
SOURCED_ESTIMATES = ("h100_roce_estimate", "l40s_ethernet_estimate")


@pytest.mark.parametrize("name", SOURCED_ESTIMATES)
def test_cluster_estimates_name_a_source_for_every_number(name):
    profile = load_profile(name, require_terms=True)
    assert profile.sources and set(profile.sources) == set(profile.numbers())
    # each from a datasheet or a published measurement, or saying that none was found
    for path, text in profile.sources.items():
        assert any(word in text.lower() for word in ("datasheet", "measured", "fitted",
                                                     "published", "no published", "cluster kind",
                                                     "not measured")), (path, text)
    # the links these kinds stand for: the inter-node link per GPU well below one NIC per GPU
    dgx = load_profile("nvlink_ib_estimate")
    assert profile.beta["all_to_all"]["inter"] > 4 * dgx.beta["all_to_all"]["inter"]


def test_profile_sources_name_numbers_of_a_profile(tmp_path):
    data = profile_dict()
    data["sources"] = {"beta.all_to_all.inter": "a datasheet"}
    assert load_profile(_write(tmp_path, data, "ok.yaml")).sources == data["sources"]
    data["sources"] = {"beta.all_to_all.wan": "a datasheet"}
    with pytest.raises(ValueError, match="field sources names no number of a profile: "
                                         "beta.all_to_all.wan"):
        load_profile(_write(tmp_path, data))
    data["sources"] = {"compute.beta": ""}
    with pytest.raises(ValueError, match="field sources must map"):
        load_profile(_write(tmp_path, data))


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_profile_round_trip(tmp_path, suffix):
    profile = load_profile(os.path.join(PROFILE_DIR, "emulated_pcie.yaml"))
    path = tmp_path / f"copy{suffix}"
    save_profile(profile, path)
    assert load_profile(path) == profile


def _write(tmp_path, data, name="bad.yaml"):
    path = tmp_path / name
    if name.endswith(".json"):
        path.write_text(json.dumps(data))
    else:
        import yaml

        path.write_text(yaml.safe_dump(data))
    return str(path)


def test_profile_missing_field_names_path_and_field(tmp_path):
    data = profile_dict()
    del data["alpha"]["all_to_all"]["inter"]
    path = _write(tmp_path, data)
    with pytest.raises(ValueError) as error:
        load_profile(path)
    assert str(error.value) == f"profile {path}: field alpha.all_to_all.inter missing"


@pytest.mark.parametrize("mutate,field", [
    (lambda data: data["beta"]["all_gather"].update(intra=-1.0), "beta.all_gather.intra"),
    (lambda data: data["beta"]["all_gather"].update(intra="fast"), "beta.all_gather.intra"),
    (lambda data: data["compute"].pop("beta"), "compute.beta"),
    (lambda data: data.pop("alpha"), "alpha"),
    (lambda data: data["alpha"].update(broadcast={"intra": 1, "inter": 1}), "alpha.broadcast"),
    (lambda data: data.update(provenance="guess"), "provenance"),
    (lambda data: data.update(bandwidth=1), "bandwidth"),
    (lambda data: data.update(overlap_efficiency=1.5), "overlap_efficiency"),
    (lambda data: data.update(layer_scale=0), "layer_scale"),
])
@pytest.mark.parametrize("name", ["bad.yaml", "bad.json"])
def test_profile_errors_name_path_and_field(tmp_path, mutate, field, name):
    data = profile_dict()
    mutate(data)
    path = _write(tmp_path, data, name)
    with pytest.raises(ValueError) as error:
        load_profile(path)
    message = str(error.value)
    assert message.startswith(f"profile {path}: field {field}")


def test_profile_unreadable_or_malformed(tmp_path):
    with pytest.raises(ValueError, match="profile .*missing.yaml: no such file, and no shipped profile"):
        load_profile(tmp_path / "missing.yaml")
    path = tmp_path / "broken.yaml"
    path.write_text("alpha: [unclosed\n")
    with pytest.raises(ValueError, match=f"profile {path}: not valid YAML"):
        load_profile(path)


def test_fit_alpha_beta_recovers_a_line():
    samples = [(size, 2e-4 + 3e-9 * size) for size in (1e3, 1e5, 1e6, 4e6)]
    alpha, beta = fit_alpha_beta(samples)
    assert alpha == pytest.approx(2e-4)
    assert beta == pytest.approx(3e-9)
    with pytest.raises(ValueError):
        fit_alpha_beta([(1.0, 1.0)])


# ---------------------------------------------------------------- in-layer terms

def test_layer_scale_multiplies_every_schedule_and_overlap_interpolates():
    import dataclasses

    profile, shape = uniform_profile(), small_shape(num_tokens=64, hidden_size=64)
    scaled = dataclasses.replace(profile, layer_scale=1.5)
    for name, chunks in (("ds_baseline", None), ("parm_s1", None), ("parm_s2", 4)):
        assert predict(name, shape, SMALL_LAYOUT, scaled, chunks).total_s == pytest.approx(
            1.5 * predict(name, shape, SMALL_LAYOUT, profile, chunks).total_s)
    ideal = predict("parm_s2", shape, SMALL_LAYOUT, profile, 4)
    serial = predict("parm_s2", shape, SMALL_LAYOUT,
                     dataclasses.replace(profile, overlap_efficiency=0.0), 4)
    # no overlap at all: the 4 chunks' stage sums one after another
    one_chunk = sum(stage.seconds for stage in ideal.stages)
    assert serial.total_s == pytest.approx(4 * one_chunk) and serial.total_s > ideal.total_s
    half = predict("parm_s2", shape, SMALL_LAYOUT,
                   dataclasses.replace(profile, overlap_efficiency=0.5), 4)
    assert half.total_s == pytest.approx((ideal.total_s + serial.total_s) / 2)
    # one chunk has nothing to overlap: the efficiency does not matter
    assert predict("parm_s2", shape, SMALL_LAYOUT,
                   dataclasses.replace(profile, overlap_efficiency=0.0), 1).total_s == \
        pytest.approx(predict("parm_s2", shape, SMALL_LAYOUT, profile, 1).total_s)


def test_fit_layer_terms_recovers_known_terms():
    import dataclasses
    from types import SimpleNamespace

    from megatron_parm.perf_model.calibrate import fit_layer_terms, layer_shape

    profile = uniform_profile(alpha_intra=2e-4, alpha_inter=5e-4, beta_intra=2e-9,
                              beta_inter=8e-9, compute_beta=2e-11)
    truth = dataclasses.replace(profile, layer_scale=1.4, overlap_efficiency=0.35,
                                chunk_overhead=0.004)
    measured = []
    for tokens in (192, 768):
        spec = SimpleNamespace(seq_length=tokens, micro_batch_size=2, tp=2, sequence_parallel=True,
                               hidden_size=512, ffn_hidden_size=256, num_experts=4, topk=2,
                               capacity_factor=None, pad_to_capacity=False)
        for chunks in (1, 2, 8):
            name = "parm_s1" if chunks == 1 else "parm_s2"
            seconds = predict(name, layer_shape(spec), SMALL_LAYOUT, truth,
                              None if chunks == 1 else chunks).total_s
            measured.append((spec, chunks, seconds))
    fitted = fit_layer_terms(profile, SMALL_LAYOUT, measured)
    assert fitted.layer_scale == pytest.approx(1.4)
    assert fitted.overlap_efficiency == pytest.approx(0.35)
    assert fitted.chunk_overhead == pytest.approx(0.004, rel=1e-6)
    assert fitted.alpha == profile.alpha  # the stage terms stay as measured


def _layer_spec(tokens, experts, layout, expert_impl="SequentialMLP"):
    from types import SimpleNamespace

    tp, ep, etp = layout
    return SimpleNamespace(seq_length=tokens * tp // 2, micro_batch_size=2, tp=tp, ep=ep, etp=etp,
                           sequence_parallel=True, hidden_size=384, ffn_hidden_size=512,
                           num_experts=experts, topk=2, capacity_factor=None,
                           pad_to_capacity=False, expert_impl=expert_impl)


def _synthetic_layers(truth, cluster, layouts, experts=(4, 8), impls=("SequentialMLP",)):
    """(spec, chunks, seconds) as calibrate.py measures them, generated from known terms."""
    from megatron_parm.perf_model.calibrate import _measured_shape, spec_layout

    measured = []
    for layout in layouts:
        for tokens in (192, 768):
            for count in experts:
                for impl in impls:
                    spec = _layer_spec(tokens, count, layout, impl)
                    where = spec_layout(spec, cluster)
                    for chunks in (1, 2, 8):
                        name = "parm_s1" if chunks == 1 else "parm_s2"
                        seconds = predict(name, _measured_shape(spec), where, truth,
                                          None if chunks == 1 else chunks).total_s
                        measured.append((spec, chunks, seconds))
    return measured


def test_chunk_cost_per_local_expert_only_without_grouped_experts():
    import dataclasses

    profile = dataclasses.replace(uniform_profile(), chunk_overhead=0.002,
                                  chunk_expert_overhead=0.001)
    sequential, grouped = small_shape(num_tokens=64), small_shape(num_tokens=64,
                                                                  grouped_experts=True)
    one = predict("parm_s2", sequential, SMALL_LAYOUT, profile, 1).total_s
    # 4 experts over ep 2: 2 local experts; 3 extra chunks
    assert predict("parm_s2", sequential, SMALL_LAYOUT, profile, 4).total_s == pytest.approx(
        predict("parm_s2", sequential, SMALL_LAYOUT, dataclasses.replace(
            profile, chunk_overhead=0, chunk_expert_overhead=0), 4).total_s + 3 * (0.002 + 2 * 0.001))
    assert predict("parm_s2", grouped, SMALL_LAYOUT, profile, 4).total_s == pytest.approx(
        predict("parm_s2", sequential, SMALL_LAYOUT, profile, 4).total_s - 3 * 2 * 0.001)
    assert predict("parm_s2", grouped, SMALL_LAYOUT, profile, 1).total_s == pytest.approx(one)
    # so the choice can differ with the expert module: S2 wins only where chunks are cheap
    costly = dataclasses.replace(profile, chunk_overhead=0.0, chunk_expert_overhead=1.0)
    assert not isinstance(choose_schedule(sequential, SMALL_LAYOUT, costly).schedule, tuple)
    cheap_for_grouped = choose_schedule(grouped, SMALL_LAYOUT, costly)
    assert cheap_for_grouped.times[("parm_s2", 4, 4)] < choose_schedule(
        sequential, SMALL_LAYOUT, costly).times[("parm_s2", 4, 4)]


def test_forward_and_backward_chunk_counts_that_differ_run_the_experts_at_the_finer_cut():
    """S2 builds its expert graphs per sub-chunk, lcm(forward, backward) of them, in both
    passes (dispatchers/parm_s2.py): 4 chunks forward and 8 backward call each local expert 8
    times each way, so the per-expert chunk cost is 8's, while the per-chunk collectives'
    cost follows each pass's own count."""
    import dataclasses

    profile = dataclasses.replace(uniform_profile(), chunk_overhead=0.002,
                                  chunk_expert_overhead=0.001)
    free = dataclasses.replace(profile, chunk_overhead=0, chunk_expert_overhead=0)
    shape = small_shape(num_tokens=64)  # 2 local experts

    def extra(forward, backward):
        return (predict("parm_s2", shape, SMALL_LAYOUT, profile, forward, bwd_num_chunks=backward).total_s
                - predict("parm_s2", shape, SMALL_LAYOUT, free, forward, bwd_num_chunks=backward).total_s)

    assert extra(4, 8) == pytest.approx((3 + 7) / 2 * 0.002 + 7 * 2 * 0.001)
    assert extra(2, 4) == pytest.approx((1 + 3) / 2 * 0.002 + 3 * 2 * 0.001)
    # against 8 both ways, the pair saves only its forward's 4 fewer chunks' collectives
    assert extra(8, 8) - extra(4, 8) == pytest.approx(4 * 0.002 / 2)
    assert extra(4, 4) == pytest.approx(3 * (0.002 + 2 * 0.001))


def test_fit_layer_terms_over_layouts_recovers_the_chunk_terms():
    """Synthetic points from known terms on (2,2,2), (2,2,1) and (1,4,1): every term back."""
    import dataclasses

    from megatron_parm.perf_model.calibrate import fit_layer_terms, format_layer_fit

    profile = uniform_profile(alpha_intra=2e-4, alpha_inter=5e-4, beta_intra=2e-9,
                              beta_inter=8e-9, compute_beta=2e-11)
    truth = dataclasses.replace(profile, layer_scale=1.3, overlap_efficiency=0.6,
                                chunk_overhead=0.003, chunk_expert_overhead=0.0015)
    measured = _synthetic_layers(truth, SMALL_LAYOUT, [(2, 2, 2), (2, 2, 1), (1, 4, 1)])
    fitted = fit_layer_terms(profile, SMALL_LAYOUT, measured)
    assert fitted.layer_scale == pytest.approx(1.3, rel=1e-6)
    assert fitted.overlap_efficiency == pytest.approx(0.6)
    assert fitted.chunk_overhead == pytest.approx(0.003, rel=1e-5)
    assert fitted.chunk_expert_overhead == pytest.approx(0.0015, rel=1e-5)
    report = format_layer_fit(fitted, SMALL_LAYOUT, measured)
    assert "(1,4,1)" in report and "(2,2,1)" in report and "max 0.0%" in report
    # grouped experts' points pay no per-expert part: fitted together, the same terms
    mixed = _synthetic_layers(truth, SMALL_LAYOUT, [(2, 2, 2), (1, 4, 1)],
                              impls=("SequentialMLP", "TorchGroupedMLP"))
    both = fit_layer_terms(profile, SMALL_LAYOUT, mixed)
    assert both.chunk_expert_overhead == pytest.approx(0.0015, rel=1e-5)
    assert both.chunk_overhead == pytest.approx(0.003, rel=1e-5)
    # noise of +-3% still lands near the truth
    noisy = [(spec, c, t * (1.03 if i % 2 else 0.97)) for i, (spec, c, t) in enumerate(measured)]
    rough = fit_layer_terms(profile, SMALL_LAYOUT, noisy)
    assert rough.chunk_expert_overhead == pytest.approx(0.0015, rel=0.3)
    assert rough.layer_scale == pytest.approx(1.3, rel=0.05)


def test_fit_layer_terms_at_world_size_one_fits_the_chunk_cost_alone():
    """One GPU: no collective, nothing overlaps; the chunk terms come from the expert counts
    and overlap_efficiency keeps the profile's value."""
    import dataclasses

    from megatron_parm.perf_model.calibrate import fit_layer_terms

    one = Layout(tp=1, ep=1, etp=1, nodes=1, ranks_per_node=1)
    profile = dataclasses.replace(uniform_profile(compute_alpha=2e-5, compute_beta=3e-15),
                                  overlap_efficiency=0.8)
    truth = dataclasses.replace(profile, layer_scale=1.6, chunk_overhead=1.5e-3,
                                chunk_expert_overhead=6e-4)
    measured = _synthetic_layers(truth, one, [(1, 1, 1)], experts=(2, 4, 8))
    fitted = fit_layer_terms(profile, one, measured)
    assert fitted.overlap_efficiency == 0.8
    assert fitted.layer_scale == pytest.approx(1.6, rel=1e-6)
    assert fitted.chunk_overhead == pytest.approx(1.5e-3, rel=1e-5)
    assert fitted.chunk_expert_overhead == pytest.approx(6e-4, rel=1e-5)
    assert fitted.missing_terms == ()


def test_fit_framework_terms_recovers_per_microbatch_and_per_layer_time():
    import dataclasses

    from megatron_parm.perf_model.calibrate import fit_framework_terms
    from megatron_parm.perf_model.memory import Precision
    from megatron_parm.perf_model.step_time import step_time
    from megatron_parm.perf_model.transformer import ModelSpec

    profile = uniform_profile(alpha_intra=2e-4, alpha_inter=5e-4, beta_intra=2e-9,
                              beta_inter=8e-9, compute_alpha=1e-4, compute_beta=2e-11)
    truth = dataclasses.replace(profile, microbatch_overhead=0.012, layer_overhead=0.004)
    measured = []
    for layers in (1, 2):
        spec = ModelSpec(model_type="gpt", num_layers=layers, hidden_size=64,
                         num_attention_heads=4, seq_length=64, vocab_size=8000, num_experts=4,
                         moe_ffn_hidden_size=256)
        for count in (1, 2):
            step = step_time(spec, SMALL_LAYOUT, truth, "parm_s1", None, 4, 4 * 2 * count,
                             Precision("fp32"))
            measured.append((spec, SMALL_LAYOUT, 4, count, count * step.microbatch_s))
            assert step.framework_s == pytest.approx(0.012 + layers * 0.004)
    fitted = fit_framework_terms(profile, measured)
    assert fitted.microbatch_overhead == pytest.approx(0.012, rel=1e-6)
    assert fitted.layer_overhead == pytest.approx(0.004, rel=1e-6)
    # one layer count: the per-micro-batch term takes it all, layer_overhead is not fitted
    single = fit_framework_terms(profile, [m for m in measured if m[0].num_layers == 2])
    assert single.microbatch_overhead == pytest.approx(0.012 + 2 * 0.004, rel=1e-6)
    assert single.layer_overhead == profile.layer_overhead


def test_profile_without_the_new_terms_loads_but_is_refused_where_passed(tmp_path):
    from megatron_parm.perf_model.profile import ISSUE17_TERMS

    data = profile_dict()
    for term in ISSUE17_TERMS:
        data.pop(term)
    path = _write(tmp_path, data)
    profile = load_profile(path)  # loadable: the defaults stand in
    assert profile.missing_terms == ISSUE17_TERMS and profile.chunk_expert_overhead == 0.0
    with pytest.raises(ValueError) as error:
        load_profile(path, require_terms=True)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"profile {path}: lacks")
    assert all(term in message for term in ISSUE17_TERMS) and "tools/calibrate.py" in message
    # every shipped profile has them
    for name in shipped_profiles():
        assert not set(load_profile(name, require_terms=True).missing_terms) & set(
            ISSUE17_TERMS), name


def test_tools_refuse_a_profile_without_the_new_terms(tmp_path):
    data = profile_dict()
    data.pop("layer_overhead")
    path = _write(tmp_path, data)
    for tool, flags in (("tools/plan_schedule.py", _PLAN_FLAGS),
                        ("tools/plan_layout.py", ["--config", "configs/gpt2_tiny_moe.yaml",
                                                  "--nnodes", "2", "--nproc-per-node", "2"])):
        proc = subprocess.run([sys.executable, tool, *flags, "--parm-profile", path],
                              cwd=REPO_ROOT, capture_output=True, text=True)
        assert proc.returncode == 2, (tool, proc.stderr)
        assert proc.stderr.count("\n") <= 3 and "lacks the cost model's terms layer_overhead" \
            in proc.stderr and "tools/calibrate.py" in proc.stderr, (tool, proc.stderr)


def test_package_imports_without_torch_or_megatron():
    code = ("import sys; import megatron_parm.perf_model; "
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'megatron', 'yaml', 'numpy')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)


# ---------------------------------------------------------------- tools/plan_schedule.py

_PLAN_FLAGS = [
    "--hidden-size", "512", "--moe-ffn-hidden-size", "256", "--num-experts", "4",
    "--moe-router-topk", "2", "--seq-length", "2048", "--micro-batch-size", "1",
    "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
    "--expert-tensor-parallel-size", "2", "--sequence-parallel", "--nnodes", "2",
    "--nproc-per-node", "2",
]


def _plan(*args):
    return subprocess.run([sys.executable, PLAN_SCHEDULE, *args], capture_output=True,
                          text=True, timeout=60)


def test_plan_schedule_prints_a_table():
    result = _plan("--parm-profile", os.path.join(PROFILE_DIR, "emulated_pcie.yaml"),
                   *_PLAN_FLAGS)
    assert result.returncode == 0, result.stderr
    for label in ("ds_baseline", "parm_s1", "parm_s2(c=2)", "parm_s2(c=4)", "parm_s2(c=8)",
                  "choice:", "<- choice"):
        assert label in result.stdout


def test_plan_schedule_reads_a_config(tmp_path):
    config = tmp_path / "model.yaml"
    config.write_text(
        "num_layers: 4\nhidden_size: 64\nmoe_ffn_hidden_size: 64\nnum_experts: 8\n"
        "moe_router_topk: 2\nseq_length: 8\nmicro_batch_size: 1\ntp: 2\nep: 2\netp: 2\n"
        "sequence_parallel: true\nnodes: 2\nranks_per_node: 2\nlr: 1.0e-4\n")
    result = _plan("--config", str(config), "--parm-profile", "emulated_pcie", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["choice"] == "parm_s1"  # 4 tokens per rank: latency-bound
    assert report["num_moe_layers"] == 4
    assert set(report["times_s"]) == {"alltoall", "ds_baseline", "parm_s1", "parm_s2(c=2)",
                                      "parm_s2(c=4)", "parm_s2(c=2/4)", "parm_s2(c=4/2)", "parm_hier",
                                      "parm_hier_s2(c=2)", "parm_hier_s2(c=4)", "allgather"}
    assert "lr" in result.stderr  # unused keys are reported, not silently dropped


@pytest.mark.parametrize("args,flag", [
    (["--hidden-size", "x"], "--hidden-size"),
    (["--num-experts", "3"], "--num-experts"),
    (["--moe-expert-capacity-factor", "-1"], "--moe-expert-capacity-factor"),
    (["--parm-chunk-candidates", "1,2"], "--parm-chunk-candidates"),
    (["--nproc-per-node", "3"], "--nproc-per-node"),
])
def test_plan_schedule_bad_flags_name_the_flag(args, flag):
    result = _plan("--parm-profile", "emulated_pcie", *_PLAN_FLAGS, *args)
    assert result.returncode == 2
    assert flag in result.stderr.splitlines()[-1]


def test_plan_schedule_bad_profile_names_the_flag(tmp_path):
    result = _plan("--parm-profile", str(tmp_path / "none.yaml"), *_PLAN_FLAGS)
    assert result.returncode == 2
    assert "--parm-profile" in result.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nprovenance: measured\n")
    result = _plan("--parm-profile", str(bad), *_PLAN_FLAGS)
    assert result.returncode == 2
    assert f"profile {bad}: field alpha missing" in result.stderr
