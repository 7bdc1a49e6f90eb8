"""Multi-rank worker: every dispatcher on fine-grained modern MoE layers (64 experts, top-8,
SwiGLU experts, shared experts, sigmoid / group-limited routing) vs Megatron's alltoall and
a single-process reference (tests/reference_modern_moe.py).

Launched once per world size by tests/distributed/test_modern_moe.py (torchrun, gloo):

    torchrun --nproc-per-node 4 tests/distributed/modern_moe_worker.py OUT.json 2,2,2@2 1,4,1@2

A layout (tp, ep, etp) may end in @P, the ranks per node (--parm-ranks-per-node), as in
moe_equivalence_worker, whose helpers this worker reuses. Sequence parallelism is on where
tp > 1. For each layout and case (CASES) every dispatcher runs ParmMoELayer forward +
backward from the same weights and input; rank 0 records the relative error of the output,
input grad, router grad, every routed expert's fc1 / fc2 grads and the shared expert's fc1,
fc2 and gate grads (each summed over the ranks that hold a part of it), against alltoall and
against the reference. The routed experts are megatron_parm.experts.TorchGroupedMLP (one
grouped GEMM for all local experts: SequentialMLP's loop over 8-16 of them costs ten times
the CPU time), and once per case Megatron's SequentialMLP behind alltoall, against the
reference. parm also runs forced onto each of its candidate schedules, through
the layer and phase by phase (drive_phases; with shared experts overlapped, the only way
the phases run them). In OVERLAP_CASES every dispatcher runs again with
--moe-shared-expert-overlap, through the layer and phase by phase, against itself without
overlap and alltoall. On NO_SP_LAYOUTS the cases with shared
experts also run without sequence parallelism (the input replicated over TP), against the
reference, and the overlap is checked to be refused there.

Notation: D data-parallel replicas, S sequence, B micro-batch, M hidden, F expert FFN hidden,
FS shared-expert FFN hidden, E experts, k top-k.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_parm import device, mcore_compat  # noqa: E402
import moe_equivalence_worker  # noqa: E402
from moe_equivalence_worker import (  # noqa: E402
    dispatchers, drive_phases, expert_weights, force_parm, init_layout, rel_err)
from reference_modern_moe import Routing, moe_forward, route, top_experts  # noqa: E402

S, B, M, F_EXPERT, FS, E, TOPK = 8, 2, 16, 8, 16, 64, 8
assert M == moe_equivalence_worker.M  # expert_weights views grouped weights with its M
NUM_CHUNKS, BWD_CHUNKS = 3, 2  # S2's forward and backward pipelines (different on purpose)
# World size -> layouts that also run without sequence parallelism (replicated input).
NO_SP_LAYOUTS = {4: ("2,2,2",)}


@dataclass(frozen=True)
class Case:
    routing: Routing
    shared: bool = False  # a shared expert (moe_shared_expert_intermediate_size FS)
    gate: bool = False  # ... with its sigmoid gate (moe_shared_expert_gate)
    expert_bias: bool = False  # moe_router_enable_expert_bias, the buffer set non-zero


CASES = {
    "softmax": Case(Routing(TOPK)),
    "shared": Case(Routing(TOPK), shared=True, gate=True),
    "sigmoid-bias": Case(Routing(TOPK, "sigmoid", scaling_factor=2.5), shared=True,
                         expert_bias=True),
    "group-limited": Case(Routing(TOPK, pre_softmax=True, num_groups=8, group_topk=4)),
}
SHARED_CASES = tuple(name for name, case in CASES.items() if case.shared)
# Cases whose every dispatcher runs again with the shared expert overlapped (the gated one:
# its gate score is computed in the overlap's first step); parm forced onto each candidate
# runs phase by phase overlapped in every case with shared experts.
OVERLAP_CASES = ("shared",)


def quantities(case: Case):
    """The compared tensors: output, input grad, router grad, expert grads, shared grads."""
    keys = ("y", "x", "router", "fc1", "fc2")
    if case.shared:
        keys += ("shared_fc1", "shared_fc2") + (("shared_gate",) if case.gate else ())
    return keys


def global_tensors(seed: int, num_replicas: int):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    tensors = {
        "x": randn(num_replicas, S, B, M), "dy": randn(num_replicas, S, B, M),
        "router": randn(E, M, scale=0.5),
        "fc1": randn(E, 2 * F_EXPERT, M, scale=0.3),  # [gate; up] per expert
        "fc2": randn(E, M, F_EXPERT, scale=0.3),
        "expert_bias": randn(E, scale=0.2),
        "shared_fc1": randn(2 * FS, M, scale=0.3), "shared_fc2": randn(M, FS, scale=0.3),
        "shared_gate": randn(1, M, scale=0.3),
    }
    return {name: tensor.to(device.current()) for name, tensor in tensors.items()}


@functools.lru_cache(maxsize=None)
def glu_rows(size: int, rank: int, ffn: int) -> torch.Tensor:
    """Rows of a [gate; up] fc1 weight [2 ffn, M] that TP rank RANK of SIZE holds: its shard
    of the gate, then its shard of the up projection (Megatron's ColumnParallelLinear holds
    rows of the stacked weight; its GLU chunks the local output in two)."""
    shard = ffn // size
    gate = torch.arange(rank * shard, (rank + 1) * shard)
    return torch.cat([gate, gate + ffn])


def cols(size: int, rank: int, ffn: int) -> slice:
    shard = ffn // size
    return slice(rank * shard, (rank + 1) * shard)


def make_config(name, case, tp, ep, etp, sequence_parallel, per_node, overlap, profile,
                grouped=True):
    from megatron_parm.config import ParmTransformerConfig

    routing = case.routing
    return ParmTransformerConfig(
        num_layers=1, hidden_size=M, num_attention_heads=4, ffn_hidden_size=4 * M,
        moe_ffn_hidden_size=F_EXPERT, num_moe_experts=E, moe_router_topk=routing.topk,
        moe_token_dispatcher_type=name, tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        sequence_parallel=sequence_parallel, moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none", use_cpu_initialization=True,
        add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
        moe_grouped_gemm=grouped, perform_initialization=False,
        moe_router_score_function=routing.score_function,
        moe_router_pre_softmax=routing.pre_softmax, moe_router_num_groups=routing.num_groups,
        moe_router_group_topk=routing.group_topk,
        moe_router_topk_scaling_factor=routing.scaling_factor,
        moe_router_enable_expert_bias=case.expert_bias, moe_router_dtype="fp32",
        moe_shared_expert_intermediate_size=FS if case.shared else None,
        moe_shared_expert_gate=case.gate, moe_shared_expert_overlap=overlap,
        parm_num_chunks=NUM_CHUNKS, parm_bwd_num_chunks=BWD_CHUNKS, parm_profile=profile,
        parm_ranks_per_node=per_node)


def build_layer(name, case, tp, ep, etp, sequence_parallel, data, per_node, overlap=False,
                profile=None, grouped=True):
    """ParmMoELayer with the global weights' parts this rank holds."""
    from megatron.core import parallel_state as ps

    from megatron_parm.layer import ParmMoELayer
    from megatron_parm.specs import get_gpt_layer_parm_spec

    cfg = make_config(name, case, tp, ep, etp, sequence_parallel, per_node, overlap, profile,
                      grouped)
    spec = get_gpt_layer_parm_spec(num_experts=E, moe_grouped_gemm=grouped,
                                   expert_impl="TorchGroupedMLP" if grouped else None)
    layer = ParmMoELayer(cfg, spec.submodules.mlp.submodules).to(device.current())
    layer.train()
    ep_rank, etp_rank = ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
    tp_rank, num_local = ps.get_tensor_model_parallel_rank(), E // ep
    with torch.no_grad():
        layer.router.weight.copy_(data["router"])
        if case.expert_bias:
            layer.router.expert_bias.copy_(data["expert_bias"])
        for local, (fc1, fc2) in enumerate(expert_weights(layer, num_local)):
            e = ep_rank * num_local + local
            fc1.copy_(data["fc1"][e, glu_rows(etp, etp_rank, F_EXPERT)])
            fc2.copy_(data["fc2"][e, :, cols(etp, etp_rank, F_EXPERT)])
        if case.shared:
            shared = layer.shared_experts
            shared.linear_fc1.weight.copy_(data["shared_fc1"][glu_rows(tp, tp_rank, FS)])
            shared.linear_fc2.weight.copy_(data["shared_fc2"][:, cols(tp, tp_rank, FS)])
            if case.gate:
                shared.gate_weight.copy_(data["shared_gate"])
    return layer


def run_layer(name, case, tp, ep, etp, sequence_parallel, data, per_node, overlap=False,
              phases=False, prepare=None, profile=None, grouped=True):
    """Forward + backward on this rank; returns full-size tensors (all-reduced over the world)
    holding every rank's part, and parm's choice. phases: drive the dispatcher's six phases
    one by one (drive_phases) instead of calling the layer, which leaves out the shared
    expert unless it overlaps (then the phases run it)."""
    from megatron.core import parallel_state as ps

    assert not (phases and case.shared and not overlap), \
        "the phases run a shared expert only overlapped"
    layer = build_layer(name, case, tp, ep, etp, sequence_parallel, data, per_node, overlap,
                        profile, grouped)
    tp_rank, dp_rank = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
    rows = S // tp
    shard = slice(tp_rank * rows, (tp_rank + 1) * rows)
    split = sequence_parallel or tp == 1
    x = (data["x"][dp_rank, shard] if split else data["x"][dp_rank]).clone().requires_grad_()
    dy = data["dy"][dp_rank, shard] if split else data["dy"][dp_rank]
    if prepare is not None:
        prepare(layer, x)
    out = drive_phases(layer, x) if phases else layer(x)[0]
    out.backward(dy)
    return collect(layer, case, x, out, tp, ep, etp, split, data), parm_choice(layer)


def collect(layer, case, x, out, tp, ep, etp, split, data):
    """Every compared tensor at full size, this rank's part in place, summed over the world.
    A part replicated over TP counts from TP rank 0 only: without sequence parallelism the
    output and input grad, the shared gate's grad (computed from the whole input) and the
    router's (ParmMoELayer sums its shards' parts over TP), as training then uses them."""
    from megatron.core import parallel_state as ps

    tp_rank, dp_rank = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
    ep_rank, etp_rank = ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
    full = {key: torch.zeros_like(data["dy" if key == "y" else key]) for key in quantities(case)}
    rows = S // tp
    if split:
        full["y"][dp_rank, tp_rank * rows:(tp_rank + 1) * rows] = out.detach()
        full["x"][dp_rank, tp_rank * rows:(tp_rank + 1) * rows] = x.grad
    elif tp_rank == 0:
        full["y"][dp_rank], full["x"][dp_rank] = out.detach(), x.grad
    if split or tp_rank == 0:
        full["router"] += layer.router.weight.grad
    num_local = E // ep
    for local, (fc1, fc2) in enumerate(expert_weights(layer, num_local, grads=True)):
        e = ep_rank * num_local + local
        full["fc1"][e, glu_rows(etp, etp_rank, F_EXPERT)] = fc1
        full["fc2"][e, :, cols(etp, etp_rank, F_EXPERT)] = fc2
    if case.shared:
        shared = layer.shared_experts
        full["shared_fc1"][glu_rows(tp, tp_rank, FS)] = shared.linear_fc1.weight.grad
        full["shared_fc2"][:, cols(tp, tp_rank, FS)] = shared.linear_fc2.weight.grad
        if case.gate and (split or tp_rank == 0):
            full["shared_gate"] += shared.gate_weight.grad
    for tensor in full.values():
        dist.all_reduce(tensor)
    return full


def parm_choice(layer):
    choice = getattr(layer.token_dispatcher, "choice", None)
    return str(choice.schedule) if choice is not None else None


def reference(case, data):
    """The single-process layer over all replicas: output and every gradient."""
    names = ["x", "router", "fc1", "fc2"] + (["shared_fc1", "shared_fc2"] if case.shared else [])
    names += ["shared_gate"] if case.gate else []
    leaves = {k: data[k].clone().requires_grad_() for k in names}
    tokens = leaves["x"].reshape(-1, M)
    y = moe_forward(tokens, leaves["router"], leaves["fc1"], leaves["fc2"], case.routing,
                    expert_bias=data["expert_bias"] if case.expert_bias else None,
                    shared_fc1=leaves.get("shared_fc1"), shared_fc2=leaves.get("shared_fc2"),
                    shared_gate=leaves.get("shared_gate")).view_as(data["x"])
    (y * data["dy"]).sum().backward()
    out = {k: v.grad for k, v in leaves.items()}
    out["y"] = y.detach()
    return out


def choices_changed(case, data) -> int:
    """Tokens whose chosen experts the case's expert bias or group limit changes (against
    plain top-k of the same scores): each case must route differently from softmax top-k."""
    routing = case.routing
    logits = data["x"].reshape(-1, M) @ data["router"].t()
    with_options = route(logits, routing, data["expert_bias"] if case.expert_bias else None) > 0
    scores = torch.sigmoid(logits) if routing.score_function == "sigmoid" else logits
    plain = torch.zeros_like(with_options).scatter(
        1, top_experts(scores, Routing(routing.topk)), True)
    return int((with_options != plain).any(dim=1).sum())


def compare(records, base, full, against_name, against, case):
    for key in quantities(case):
        records.append(dict(base, against=against_name, quantity=key,
                            err=rel_err(full[key], against[key])))


def check_case(case_name, tp, ep, etp, per_node, layout, records):
    """Every dispatcher against alltoall and the reference; parm forced onto each candidate
    (Megatron's allgather included), against both;
    in OVERLAP_CASES, each dispatcher again with the shared expert overlapped."""
    from megatron_parm import schedules

    case = CASES[case_name]
    data = global_tensors(11 + len(records), dist.get_world_size() // tp)
    ref = reference(case, data)
    base = dict(layout=layout, sp=tp > 1, case=case_name, overlap=False, phases=False)
    records.append(dict(base, dispatcher="reference", against="routing", quantity="changed",
                        changed=choices_changed(case, data)))
    # Megatron's SequentialMLP (one MLP per expert) behind alltoall, once: the other runs use
    # TorchGroupedMLP, which computes the same (checked here) at a tenth of the CPU time.
    sequential, _ = run_layer("alltoall", case, tp, ep, etp, tp > 1, data, per_node, grouped=False)
    compare(records, dict(base, dispatcher="alltoall:sequential"), sequential, "reference", ref,
            case)
    results = {}
    for name in dispatchers(tp, ep, etp):
        results[name], choice = run_layer(name, case, tp, ep, etp, tp > 1, data, per_node)
        row = dict(base, dispatcher=name)
        if name == "parm":
            records.append(dict(row, against="choice", quantity="schedule", choice=choice))
        compare(records, row, results[name], "reference", ref, case)
        if name != "alltoall":
            compare(records, row, results[name], "alltoall", results["alltoall"], case)
    for candidate in schedules.supported_candidates(tp, ep, etp):
        schedule = ((candidate.name, *candidate.pair(NUM_CHUNKS, BWD_CHUNKS)) if candidate.chunked
                    else candidate.name)
        for phases in (False, True):
            overlap = phases and case.shared  # the phases run the shared expert only overlapped
            full, choice = run_layer("parm", case, tp, ep, etp, tp > 1, data, per_node, overlap,
                                     phases, prepare=force_parm(schedule))
            assert choice == str(schedule), (choice, schedule)
            row = dict(base, dispatcher="parm", schedule=candidate.name, phases=phases,
                       overlap=overlap)
            compare(records, row, full, "alltoall", results["alltoall"], case)
            compare(records, row, full, "reference", ref, case)
    if case_name in OVERLAP_CASES:
        for name in results:
            for phases in (False, True):
                full, _ = run_layer(name, case, tp, ep, etp, tp > 1, data, per_node, True, phases)
                row = dict(base, dispatcher=name, overlap=True, phases=phases)
                compare(records, row, full, "no-overlap", results[name], case)
                compare(records, row, full, "alltoall", results["alltoall"], case)


def check_replicated(tp, ep, etp, per_node, layout, records):
    """Without sequence parallelism (the input replicated over TP), the cases with shared
    experts: every dispatcher that runs it against the reference; the overlap refused."""
    for case_name in SHARED_CASES:
        case = CASES[case_name]
        data = global_tensors(71 + len(records), dist.get_world_size() // tp)
        ref = reference(case, data)
        for name in dispatchers(tp, ep, etp, sequence_parallel=False):
            full, _ = run_layer(name, case, tp, ep, etp, False, data, per_node)
            row = dict(layout=layout, sp=False, case=case_name, dispatcher=name, overlap=False,
                       phases=False)
            compare(records, row, full, "reference", ref, case)
    try:
        build_layer("parm_s1", CASES["shared"], tp, ep, etp, False, data, per_node, overlap=True)
    except ValueError as err:
        refusal = str(err)
    else:
        refusal = None
    records.append(dict(layout=layout, sp=False, case="shared", dispatcher="parm_s1",
                        overlap=True, against="refusal", quantity="message", message=refusal))


def main():
    out_path, layouts = sys.argv[1], sys.argv[2:]
    if device.is_cuda():
        device.set_device(int(os.environ.get("LOCAL_RANK", "0")) % device.device_count())
    dist.init_process_group("gloo")
    mcore_compat.setup()
    torch.manual_seed(0)
    records = []
    for spec in layouts:
        sizes, _, per_node = spec.partition("@")
        tp, ep, etp = (int(v) for v in sizes.split(","))
        per_node = int(per_node) if per_node else dist.get_world_size()
        init_layout(tp, ep, etp)
        for case_name in CASES:
            check_case(case_name, tp, ep, etp, per_node, sizes, records)
        if sizes in NO_SP_LAYOUTS.get(dist.get_world_size(), ()):
            check_replicated(tp, ep, etp, per_node, sizes, records)
        if dist.get_rank() == 0:
            print(f"layout {sizes}: done", flush=True)
    if dist.get_rank() == 0:  # every record is the same on all ranks (all-reduced)
        with open(out_path, "w") as f:
            json.dump(records, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
