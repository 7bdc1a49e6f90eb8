"""Multi-rank worker: every dispatcher vs Megatron's alltoall and a single-process reference.

Launched once per world size by tests/distributed/test_dispatchers.py (torchrun, gloo):

    torchrun --nproc-per-node 4 tests/distributed/moe_equivalence_worker.py OUT.json 2,2,2@2 1,4,1

For each layout (tp, ep, etp) and routing case it builds ParmMoELayer with each dispatcher
from the same weights and input, runs forward + backward and compares, on rank 0:
output, input grad, router grad and every expert weight grad (each summed over the ranks
that hold a part of it). It also checks the bytes each Parm dispatcher recorded against
the design's formulas, computed here from the routing. Records go to OUT.json.

A layout may end in @P: the ranks count as P to a node (--parm-ranks-per-node, for the
dispatchers, the performance model and the byte accounting), so that one launch on one
machine has the several nodes parm_hier splits its dispatch by; without it, one node.

Every dispatcher also runs phase by phase (drive_phases: router, then the six phases with
the experts between them, as Megatron-Core's callers do) in PHASE_CASES, forward + backward,
against itself in the layer and alltoall; after each layer run, phase by phase with identity
experts (identity_and_capacity); and, on a launch's first layout, with its phases out of
order (phase_order_errors).

Every schedule also runs once more under tests/device_sim.py's simulated device (placement
errors, host syncs). On GROUPED_LAYOUTS every dispatcher runs with grouped experts too:
Megatron's GroupedMLP (bf16, on a stand-in of grouped_gemm) and megatron_parm.experts'
TorchGroupedMLP (float32, and bf16 for some), against SequentialMLP.

Everything runs on megatron_parm.device.current(): the CPU here; on a machine with
one GPU (tools/gpu_check.sh, stage a) every rank puts its tensors on that GPU and gloo moves
them, so the same comparisons check the CUDA path with the same tolerances.

Notation: D data-parallel replicas, S sequence, B micro-batch, M hidden, F expert FFN
hidden, E experts, k top-k.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_parm import mcore_compat  # noqa: E402
from megatron_parm import device  # noqa: E402

S, B, M, F, E = 8, 2, 16, 32, 8
NUM_CHUNKS = 3  # --parm-num-chunks of every layer (S2; parm also weighs S2 at 3 chunks)
# Bytes are checked against formulas written out in expected_bytes for these.
BYTE_FORMULAS = ("alltoall", "allgather", "ds_baseline", "parm_s1", "parm_s2", "parm_hier",
                 "parm_hier_s2")


def dispatchers(tp, ep, etp, sequence_parallel=True):
    """alltoall (the reference) and every non-native schedule of the catalog that runs the layout."""
    from megatron_parm import schedules

    others = [name for name in schedules.names(schedules.BASELINE, schedules.PARM, schedules.AUTO)
              if schedules.get(name).unsupported(tp, ep, etp, sequence_parallel) is None]
    return ["alltoall"] + others if sequence_parallel or tp == 1 else others
# name -> (top-k, capacity factor, pad to capacity, aux-loss coefficient); top-1 routing
# takes the softmax over all experts before top-k (Megatron requires that for k = 1).
CASES = {
    "dropless": (2, None, False, 0.0),
    "drop": (2, 1.0, False, 1e-2),
    "pad": (2, 1.0, True, 1e-2),
    "top1": (1, None, False, 1e-2),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = max(b.abs().max().item(), 1e-12)
    return (a - b).abs().max().item() / scale


def global_tensors(seed: int, num_replicas: int):
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        "x": torch.randn(num_replicas, S, B, M, generator=gen),
        "dy": torch.randn(num_replicas, S, B, M, generator=gen),
        "router": torch.randn(E, M, generator=gen) * 0.5,
        "fc1": torch.randn(E, F, M, generator=gen) * 0.2,
        "fc2": torch.randn(E, M, F, generator=gen) * 0.2,
    }
    return {name: tensor.to(device.current()) for name, tensor in tensors.items()}


def latency_free_profile(path: str) -> str:
    """The emulated profile with every alpha zeroed: pipelining always pays, so parm picks S2."""
    import dataclasses

    from megatron_parm.dispatchers.parm_auto import default_profile_path
    from megatron_parm.perf_model import load_profile, save_profile

    base = load_profile(default_profile_path())
    zero = {kind: {link: 0.0 for link in links} for kind, links in base.alpha.items()}
    save_profile(dataclasses.replace(base, alpha=zero, compute_alpha=0.0, name="latency-free"), path)
    return path


# Backward chunks of the chunked schedules per case (forward: 3), so that backward pipelines
# finer, coarser and as fine as the forward one (sub-chunks of lcm(3, b)) are all checked.
BWD_CHUNKS = {"dropless": None, "drop": 2, "pad": 6, "top1": 1}

# Profiles parm decides with, per case: the default estimate (tiny layers: S1) or a
# latency-free one (S2), so that both of its branches run.
PARM_PROFILE = {"dropless": None, "drop": "latency-free", "pad": "latency-free", "top1": None}


def run_layer(dispatcher, case, tp, ep, etp, sequence_parallel, data, track=False, profile=None,
              per_node=None, num_chunks=NUM_CHUNKS, simulate=None, grouped=False, bf16=False,
              bwd_chunks=None, torch_grouped=False, phases=False, inspect=None, plain=False,
              prepare=None):
    """Forward + backward on this rank; returns full-size tensors holding this rank's part.

    phases: drive the dispatcher through its six phases one by one (drive_phases), as a
    Megatron-Core caller does, instead of calling ParmMoELayer. inspect: a function
    (layer, x) run after the backward; what it returns is in the result's "inspect".
    plain: a plain TransformerConfig (no parm_* field: each dispatcher takes its defaults).
    prepare: a function (layer, x) run before the forward (force_parm).

    simulate: a device_sim.SimulatedDevice to run the layer call under (forward and backward).
    grouped: Megatron's GroupedMLP experts (--moe-grouped-gemm) on tests/fake_grouped_gemm.py,
    in bf16 as GroupedMLP requires. torch_grouped: megatron_parm.experts.TorchGroupedMLP
    experts (PyTorch's grouped_mm), in float32 or bf16. bf16: the layer in bf16. Results come
    back in float32.
    bwd_chunks: --parm-bwd-num-chunks (the chunked schedules' backward pipeline).
    """
    bf16 = bf16 or grouped
    from megatron.core import parallel_state as ps

    from megatron_parm.bench.native_accounting import account_native_dispatchers
    from megatron_parm.comm.accounting import track_comm
    from megatron_parm.config import ParmTransformerConfig
    from megatron_parm.layer import ParmMoELayer
    from megatron_parm.specs import get_gpt_layer_parm_spec

    from megatron.core.transformer.transformer_config import TransformerConfig

    topk, capacity, pad, aux = case
    parm_fields = dict(parm_num_chunks=num_chunks, parm_bwd_num_chunks=bwd_chunks,
                       parm_profile=profile, parm_ranks_per_node=per_node)
    cfg = (TransformerConfig if plain else ParmTransformerConfig)(
        num_layers=1, hidden_size=M, num_attention_heads=4, ffn_hidden_size=F, moe_ffn_hidden_size=F,
        num_moe_experts=E, moe_router_topk=topk, moe_token_dispatcher_type=dispatcher,
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        sequence_parallel=sequence_parallel, moe_aux_loss_coeff=aux, moe_expert_capacity_factor=capacity,
        moe_pad_expert_input_to_capacity=pad, moe_router_pre_softmax=(topk == 1),
        use_cpu_initialization=True, add_bias_linear=False,
        params_dtype=torch.bfloat16 if bf16 else torch.float32, bf16=bf16,
        moe_grouped_gemm=grouped or torch_grouped, **({} if plain else parm_fields))
    if bf16:
        data = {name: tensor.to(torch.bfloat16) for name, tensor in data.items()}
    spec = get_gpt_layer_parm_spec(num_experts=E, moe_grouped_gemm=grouped or torch_grouped,
                                   expert_impl="TorchGroupedMLP" if torch_grouped else None)
    layer = ParmMoELayer(cfg, spec.submodules.mlp.submodules).to(device.current())
    layer.train()

    tp_rank, dp_rank = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
    ep_rank, etp_rank = ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
    num_local = E // ep
    fs = F // etp
    with torch.no_grad():
        layer.router.weight.copy_(data["router"])
        for l, (fc1, fc2) in enumerate(expert_weights(layer, num_local)):
            e = ep_rank * num_local + l
            fc1.copy_(data["fc1"][e, etp_rank * fs:(etp_rank + 1) * fs])
            fc2.copy_(data["fc2"][e, :, etp_rank * fs:(etp_rank + 1) * fs])

    rows = S // tp
    shard = slice(tp_rank * rows, (tp_rank + 1) * rows)
    if sequence_parallel or tp == 1:
        x = data["x"][dp_rank, shard].clone().requires_grad_()
        dy = data["dy"][dp_rank, shard]
    else:  # replicated over TP
        x = data["x"][dp_rank].clone().requires_grad_()
        dy = data["dy"][dp_rank]

    if prepare is not None:
        prepare(layer, x)
    if simulate is not None:
        from device_sim import covering_backward, mark_device, mark_module, parm_autograd_functions

        mark_module(layer)
        mark_device(x, dy)
        with simulate, covering_backward(simulate, parm_autograd_functions()):
            out, _ = layer(x)
            simulate.forward_syncs = len(simulate.syncs)
            out.backward(dy)
        stats = None
    else:
        with track_comm(per_node) as stats, account_native_dispatchers():
            out = drive_phases(layer, x) if phases else layer(x)[0]
            out.backward(dy)
    # Collected and summed in float32 (also in a bf16 run).
    full = {k: torch.zeros_like(data[k], dtype=torch.float32) for k in ("x", "router", "fc1", "fc2")}
    full["y"] = torch.zeros_like(data["x"], dtype=torch.float32)
    # A part replicated over TP is contributed by TP rank 0 only.
    if sequence_parallel or tp == 1:
        full["y"][dp_rank, shard] = out.detach()
        full["x"][dp_rank, shard] = x.grad
    elif tp_rank == 0:
        full["y"][dp_rank] = out.detach()
        full["x"][dp_rank] = x.grad
    # Replicated over TP, every TP rank holds its replica's router grad (the layer sums the
    # shards' parts over TP, as training needs): TP rank 0's only.
    if sequence_parallel or tp == 1 or tp_rank == 0:
        full["router"] += layer.router.weight.grad
    for l, (fc1, fc2) in enumerate(expert_weights(layer, num_local, grads=True)):
        e = ep_rank * num_local + l
        full["fc1"][e, etp_rank * fs:(etp_rank + 1) * fs] = fc1
        full["fc2"][e, :, etp_rank * fs:(etp_rank + 1) * fs] = fc2
    for t in full.values():
        dist.all_reduce(t)
    totals = stats.totals() if track else None
    choice = getattr(layer.token_dispatcher, "choice", None)
    full["choice"] = str(choice.schedule) if choice is not None else None
    if inspect is not None:
        full["inspect"] = inspect(layer, x.detach())
    return full, totals, x.detach()


def drive_phases(layer, x, experts=None, seen=None):
    """The layer's router, then its dispatcher's six phases one by one with the experts
    between them, as Megatron-Core's callers (its 1F1B A2A overlap, its dispatcher tests)
    drive any dispatcher. experts: in place of the layer's; seen: a dict that receives the
    tokens per local expert the dispatcher handed over."""
    dispatcher = layer.token_dispatcher
    probs, routing_map = layer.router(x)
    rows, probs = dispatcher.dispatch_preprocess(x, routing_map, probs)
    rows, probs = dispatcher.token_dispatch(rows, probs)
    rows, tokens_per_expert, probs = dispatcher.dispatch_postprocess(rows, probs)
    if seen is not None:
        seen["tokens_per_expert"] = [int(v) for v in torch.as_tensor(tokens_per_expert).tolist()]
    out, bias = (experts or layer.experts)(rows, tokens_per_expert, probs)
    assert bias is None
    out = dispatcher.combine_preprocess(out)
    out = dispatcher.token_combine(out)
    return dispatcher.combine_postprocess(out)


def identity_and_capacity(case, tp, ep, etp):
    """An inspect function for run_layer: the same layer with identity experts, phase by phase
    and without gradients. Each rank's output must be its input times the summed
    probabilities of the (token, expert) pairs its routing kept (the experts' partial sums
    over ESP each contribute 1/s). The tokens per local expert must be, padded to capacity,
    exactly C per source routing that feeds the expert, and at most that with capacity alone,
    C = ceil(k * n / E * f) for the n tokens one routing sees."""
    topk, capacity, pad, _ = case

    def inspect(layer, x):
        name = layer.config.moe_token_dispatcher_type

        def identity(rows, tokens_per_expert, probs):
            return rows * probs.unsqueeze(-1).to(rows.dtype) / etp, None

        seen = {}
        with torch.no_grad():
            probs, routing_map = layer.router(x)
            kept = (probs * routing_map).sum(dim=-1).view(*x.shape[:-1], 1)
            out = drive_phases(layer, x, experts=identity, seen=seen)
        result = {"identity_err": rel_err(out, x * kept)}
        if capacity is not None:
            n = x.numel() // x.shape[-1]
            # ds_baseline routes the t*n tokens of its TP group (t routings of n, each capped
            # to C) and has no ESP gather; the others route n tokens per rank, gathered over ESP.
            sources = ep * (tp if name == "ds_baseline" else etp)
            limit = sources * math.ceil(topk * n / E * capacity)
            counts = seen["tokens_per_expert"]
            result["capacity_ok"] = all(c == limit for c in counts) if pad else \
                all(c <= limit for c in counts)
            result["tokens_per_expert"], result["capacity_limit"] = counts, limit
        return result

    return inspect


def expert_weights(layer, num_local, grads=False):
    """Per local expert, its fc1 [F/s, M] and fc2 [M, F/s] weights (or their grads) as views
    into the layer's parameters: SequentialMLP's linears, or (Torch)GroupedMLP's weight1 /
    weight2 ([L, M, F/s] and [L, F/s, M] for its grouped GEMMs, transposed here)."""
    experts = layer.experts
    if hasattr(experts, "weight1"):
        w1 = experts.weight1.grad if grads else experts.weight1
        w2 = experts.weight2.grad if grads else experts.weight2
        w1, w2 = w1.view(num_local, M, -1), w2.view(num_local, -1, M)
        return [(w1[l].t(), w2[l].t()) for l in range(num_local)]
    pick = (lambda linear: linear.weight.grad) if grads else (lambda linear: linear.weight)
    return [(pick(expert.linear_fc1), pick(expert.linear_fc2)) for expert in experts.local_experts]


def reference(case, data, tp):
    """Single-process forward/backward over all replicas; routing shards = TP shards."""
    from reference_moe import moe_forward

    topk, capacity, pad, _ = case
    leaves = {k: data[k].clone().requires_grad_() for k in ("x", "router", "fc1", "fc2")}
    ys = []
    for d in range(data["x"].shape[0]):
        tokens = leaves["x"][d].reshape(S * B, M)
        y = moe_forward(tokens, leaves["router"], leaves["fc1"], leaves["fc2"], topk, capacity, pad,
                        num_shards=tp)
        ys.append(y.view(S, B, M))
    y = torch.stack(ys)
    (y * data["dy"]).sum().backward()
    out = {k: v.grad for k, v in leaves.items()}
    out["y"] = y.detach()
    return out


def expected_bytes(dispatcher, counts, me, tp, ep, etp, n_tokens):
    """Bytes this rank sends in one forward+backward, by the design's formulas.

    counts: [W, E] rows each rank routes to each expert (dropless: from its own routing).
    """
    from megatron.core import parallel_state as ps

    b = 4  # float32
    row, prob = M * b, b
    ep_group = dist.get_process_group_ranks(ps.get_expert_model_parallel_group())
    etp_group = dist.get_process_group_ranks(ps.get_expert_tensor_parallel_group())
    tp_group = dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())
    num_local = E // ep

    def experts_of(rank):
        j = ep_group.index(rank) if rank in ep_group else None
        return slice(j * num_local, (j + 1) * num_local)

    out = {}
    if dispatcher in ("parm_s1", "parm_s2", "alltoall"):
        sent = sum(int(counts[me, experts_of(p)].sum()) for p in ep_group if p != me)
        my_ep = ep_group.index(me)
        local = slice(my_ep * num_local, (my_ep + 1) * num_local)
        recv = sum(int(counts[p, local].sum()) for p in ep_group if p != me)
        if ep > 1:
            out[("all_to_all", "ep")] = (sent + recv) * (2 * row + prob)
        if etp * ep > 1:  # the routing counts (Megatron's alltoall gathers them on tp_ep)
            out[("all_gather", "tp_ep" if dispatcher == "alltoall" else "tp_ep_counts")] = (etp * ep - 1) * E * 8
        if etp > 1:
            def held(rank):  # rows an ESP peer holds after its A2A
                grp = [r for r in range(dist.get_world_size())
                       if r % etp == rank % etp and r // (etp * ep) == rank // (etp * ep)]
                return sum(int(counts[p, local].sum()) for p in grp)
            mine = held(me)
            others = sum(held(q) for q in etp_group if q != me)
            out[("all_gather", "expt_tp")] = (etp - 1) * mine * (2 * row + prob)
            out[("reduce_scatter", "expt_tp")] = others * (2 * row + prob)
    elif dispatcher == "allgather":
        # Megatron's, run by parm: AG [ESP x EP] of the routing map (bools, no gradient), the
        # probabilities [n, E] and the rows; RS back in the probabilities' dtype. Backward: AG
        # of the output's gradient, RS of the rows' and the probabilities' gradients.
        peers = etp * ep - 1
        if peers:
            out[("all_gather", "tp_ep")] = peers * n_tokens * (E + E * prob + row + M * prob)
            out[("reduce_scatter", "tp_ep")] = peers * n_tokens * (M * prob + row + E * prob)
    elif dispatcher == "ds_baseline":
        # Every TP rank dispatches the N tokens of its whole TP group.
        dup = counts[tp_group].sum(dim=0)
        sent = sum(int(dup[experts_of(p)].sum()) for p in ep_group if p != me)
        my_ep = ep_group.index(me)
        local = slice(my_ep * num_local, (my_ep + 1) * num_local)
        recv = 0
        for p in ep_group:
            if p != me:
                p_tp = [r for r in range(dist.get_world_size()) if r // tp == p // tp]
                recv += int(counts[p_tp, local].sum())
        if ep > 1:
            out[("all_to_all", "ep")] = (sent + recv) * (2 * row + prob)
            out[("all_gather", "ep_counts")] = (ep - 1) * E * 8
        if tp > 1:
            out[("all_gather", "tp")] = (tp - 1) * n_tokens * (row + E * prob)
            out[("reduce_scatter", "tp")] = (tp - 1) * n_tokens * (row + E * prob)
            out[("all_gather", "tp_routing")] = (tp - 1) * n_tokens * E
        if etp > 1:
            held_rows = sum(int(counts[[r for r in range(dist.get_world_size()) if r // tp == p // tp], local].sum())
                            for p in ep_group)
            out[("all_reduce", "expt_tp")] = 2 * (2 * (held_rows * row) // etp) * (etp - 1)
    return out


def node_split(ep_ranks, per_node):
    """An EP group's ranks by node, written out here apart from the dispatcher's own rule
    (the suite's layouts split evenly)."""
    blocks = {}
    for rank in ep_ranks:
        blocks.setdefault(rank // per_node, []).append(rank)
    return list(blocks.values())


def hier_traffic(maps, ep_ranks, per_node):
    """What parm_hier moves between the ranks of one EP group, from the routing maps.

    Returns the node blocks, rows[src, b] (tokens of src with an expert on node b),
    pairs[src, b] (its pairs to node b) and to_rank[src, dst] (its pairs to EP rank dst).
    """
    blocks = node_split(ep_ranks, per_node)
    per_rank = E // len(ep_ranks)
    rows, pairs, to_rank = {}, {}, {}
    for src in ep_ranks:
        for b, members in enumerate(blocks):
            lo = ep_ranks.index(members[0]) * per_rank
            on_node = maps[src][:, lo:lo + per_rank * len(members)]
            rows[src, b] = int(on_node.any(dim=1).sum())
            pairs[src, b] = int(on_node.sum())
        for j, dst in enumerate(ep_ranks):
            to_rank[src, dst] = int(maps[src][:, j * per_rank:(j + 1) * per_rank].sum())
    return blocks, rows, pairs, to_rank


def expected_hier_bytes(maps, me, ep, etp, per_node, parts=1):
    """parm_hier's bytes by the design's formulas, from every rank's routing map [W, n, E].

    Between nodes (ep_inter): a row per (token, node) with its probability, a secondary pair
    as (probability, row index), both fp32; the dispatch and its backward, then the combine
    (rows only) and its backward. Inside a node (ep_intra): one row per pair with its
    probability, as S1. AG/RS(ESP) as S1; counts: 2E integers per rank over ESP x EP, per
    part (parm_hier_s2: per chunk, ``parts`` of them; a token's rows are those of its
    chunk, each (token, node) once, so the token bytes are parm_hier's).
    """
    from megatron.core import parallel_state as ps

    b = 4  # float32
    row, prob, secondary = M * b, b, 2 * b
    ep_ranks = dist.get_process_group_ranks(ps.get_expert_model_parallel_group())
    etp_group = dist.get_process_group_ranks(ps.get_expert_tensor_parallel_group())
    blocks, rows, pairs, to_rank = hier_traffic(maps, ep_ranks, per_node)
    node = next(i for i, members in enumerate(blocks) if me in members)
    position = blocks[node].index(me)
    relays = [members[position] for members in blocks]  # my ep_inter group
    out = {}
    if len(blocks) > 1:
        rows_moved = sum(rows[me, i] + rows[src, node] for i, src in enumerate(relays) if src != me)
        secondaries = sum(pairs[me, i] - rows[me, i] + pairs[src, node] - rows[src, node]
                          for i, src in enumerate(relays) if src != me)
        out[("all_to_all", "ep_inter")] = rows_moved * (2 * row + prob) + secondaries * secondary
    if len(blocks[node]) > 1:
        # the relay forwards its sources' pairs to each member; each relay sends me mine
        fanned = sum(to_rank[src, member] for src in relays for member in blocks[node] if member != me)
        fanned += sum(to_rank[members[p], me] for members in blocks for p in range(len(members))
                      if blocks[node][p] != me)
        out[("all_to_all", "ep_intra")] = fanned * (2 * row + prob)
    if etp * ep > 1:
        out[("all_gather", "tp_ep_counts")] = (etp * ep - 1) * 2 * E * 8 * parts
    if etp > 1:
        def held(rank):  # pairs an ESP peer holds after the intra-node stage
            group = [r for r in range(dist.get_world_size())
                     if r % etp == rank % etp and r // (etp * ep) == rank // (etp * ep)]
            j = group.index(rank)
            return sum(int(maps[p][:, j * (E // ep):(j + 1) * (E // ep)].sum()) for p in group)
        others = sum(held(q) for q in etp_group if q != me)
        out[("all_gather", "expt_tp")] = (etp - 1) * held(me) * (2 * row + prob)
        out[("reduce_scatter", "expt_tp")] = others * (2 * row + prob)
    return out


def shares_a_remote_node(maps, ep, per_node):
    """Whether a token of this rank picks two experts on one node other than its own."""
    from megatron.core import parallel_state as ps

    me = dist.get_rank()
    ep_ranks = dist.get_process_group_ranks(ps.get_expert_model_parallel_group())
    per_rank = E // ep
    for members in node_split(ep_ranks, per_node):
        if members[0] // per_node == me // per_node:
            continue
        lo = ep_ranks.index(members[0]) * per_rank
        if bool((maps[me][:, lo:lo + per_rank * len(members)].sum(dim=1) > 1).any()):
            return True
    return False


# The groups Megatron made for the current layout. Its destroy_model_parallel only forgets
# them, and under gloo each keeps I/O threads; the launch runs several layouts, so each one's
# groups are closed before the next (test hygiene only: the layers never depend on it).
# parm_hier's node groups are kept, as megatron_parm.parallel keeps them for a layout met again.
_LAYOUT_GROUPS: list = []


def _close_groups_of_previous_layout():
    if _LAYOUT_GROUPS:
        dist.barrier()
    for group in _LAYOUT_GROUPS:
        if group in distributed_c10d._world.pg_map:
            dist.destroy_process_group(group)
    _LAYOUT_GROUPS.clear()


def init_layout(tp, ep, etp):
    """Megatron-Core's own initialization of (tp, ep, etp), as its test utilities make it
    (nothing of megatron_parm.parallel): parm_hier makes its node groups when its layers are
    built. The previous layout's groups are closed first."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.destroy_model_parallel()
    _close_groups_of_previous_layout()
    before = set(distributed_c10d._world.pg_map)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp)
    _LAYOUT_GROUPS[:] = [g for g in distributed_c10d._world.pg_map if g not in before]
    model_parallel_cuda_manual_seed(1234)


def check_layout(tp, ep, etp, per_node, records):
    init_layout(tp, ep, etp)
    rank = dist.get_rank()
    num_replicas = dist.get_world_size() // tp
    layout = f"{tp},{ep},{etp}"
    per_node = per_node or dist.get_world_size()
    for case_name, case in CASES.items():
        data = global_tensors(7 + len(records), num_replicas)
        results = {}
        names = dispatchers(tp, ep, etp)
        for name in names:
            profile = PROFILE_PATHS.get(PARM_PROFILE[case_name]) if name == "parm" else None
            results[name], totals, x_local = run_layer(name, case, tp, ep, etp, tp > 1, data,
                                                       track=(case_name == "dropless"), profile=profile,
                                                       per_node=per_node,
                                                       bwd_chunks=BWD_CHUNKS[case_name],
                                                       inspect=identity_and_capacity(case, tp, ep, etp))
            if name == "parm":
                records.append(dict(layout=layout, case=case_name, dispatcher="parm", against="choice",
                                    quantity="schedule", choice=results[name].pop("choice")))
            else:
                results[name].pop("choice")
            records.append(dict(layout=layout, case=case_name, dispatcher=name, against="identity",
                                **results[name].pop("inspect")))
            if totals is not None and name in BYTE_FORMULAS:
                check_bytes(name, totals, x_local, data, tp, ep, etp, per_node, layout, records)
        if case_name in PHASE_CASES:
            phases_match(case_name, case, names[1:], tp, ep, etp, per_node, data, results, layout,
                         records)
        ref = reference(case, data, tp)
        if case_name in FORCED_CASES:
            parm_forced(case_name, case, tp, ep, etp, per_node, data, results, ref, layout,
                        records)
        if case_name == "dropless":
            plain_config(case, names[1:], tp, ep, etp, data, results, layout, records)
        for name in names[1:]:
            for key in ("y", "x", "router", "fc1", "fc2"):
                records.append(dict(layout=layout, case=case_name, dispatcher=name, against="alltoall",
                                    quantity=key, err=rel_err(results[name][key], results["alltoall"][key])))
        # The reference has no aux loss: its gradients are compared where the aux loss is 0.
        keys = ("y", "x", "router", "fc1", "fc2") if case[3] == 0 else ("y",)
        for name in names:
            for key in keys:
                records.append(dict(layout=layout, case=case_name, dispatcher=name, against="reference",
                                    quantity=key, err=rel_err(results[name][key], ref[key])))
    # S1/S2 where the input is replicated over TP (no sequence parallelism), and parm forced
    # onto allgather there: reference only.
    if tp > 1:
        case = CASES["dropless"]
        data = global_tensors(99, num_replicas)
        ref = reference(case, data, tp)
        for name in dispatchers(tp, ep, etp, sequence_parallel=False):
            if name == "parm":
                continue
            full, _, _ = run_layer(name, case, tp, ep, etp, False, data, per_node=per_node)
            full.pop("choice")
            for key in ("y", "x", "router", "fc1", "fc2"):
                records.append(dict(layout=layout, case="dropless-no-sp", dispatcher=name,
                                    against="reference", quantity=key, err=rel_err(full[key], ref[key])))
        parm_forced_without_sequence_parallel(tp, ep, etp, per_node, data, ref, layout, records)
    simulated_device(tp, ep, etp, per_node, layout, records)
    node_groups_kept(tp, ep, etp, per_node, layout, records)
    if layout in GROUPED_LAYOUTS.get(dist.get_world_size(), ()):
        grouped_experts(tp, ep, etp, per_node, layout, records)
        torch_grouped_experts(tp, ep, etp, per_node, layout, records)
    if rank == 0:
        print(f"layout {layout}: done", flush=True)


# Routing cases whose layer calls also run phase by phase: dropless, capacity, padded.
PHASE_CASES = ("dropless", "drop", "pad")


def phases_match(case_name, case, names, tp, ep, etp, per_node, data, results, layout, records):
    """Each non-native dispatcher driven through its six phases one by one (drive_phases),
    forward and backward, against the same dispatcher through ParmMoELayer (for S2: the
    pipelined call, at NUM_CHUNKS forward chunks) and against alltoall. parm decides as in
    the layer run (PARM_PROFILE: S2 where the profile is latency-free), so that it takes S2
    phase by phase too."""
    for name in names:
        profile = PROFILE_PATHS.get(PARM_PROFILE[case_name]) if name == "parm" else None
        full, _, _ = run_layer(name, case, tp, ep, etp, tp > 1, data, profile=profile,
                               per_node=per_node, bwd_chunks=BWD_CHUNKS[case_name], phases=True)
        choice = full.pop("choice")
        if name == "parm":
            records.append(dict(layout=layout, case=f"{case_name}-phases", dispatcher="parm",
                                against="phases-choice", quantity="schedule", choice=choice))
        for against in ("layer", "alltoall"):
            reference = results[name if against == "layer" else "alltoall"]
            for key in ("y", "x", "router", "fc1", "fc2"):
                records.append(dict(layout=layout, case=f"{case_name}-phases", dispatcher=name,
                                    against=against, quantity=key,
                                    err=rel_err(full[key], reference[key])))


# Routing cases in which parm runs forced onto each of its candidate schedules.
FORCED_CASES = ("dropless", "drop")


def force_parm(schedule):
    """A prepare function for run_layer: parm runs SCHEDULE (a name, or (name, forward chunks,
    backward chunks)) at the call's token count, as if it had chosen it."""
    from megatron_parm import tuning
    from megatron_parm.perf_model import Choice

    def prepare(layer, x):
        dispatcher = layer.token_dispatcher
        tokens = x.numel() // x.shape[-1]
        if not layer.config.sequence_parallel:  # the layer routes its shard of a replicated input
            tokens //= layer.attn_tp_group.size()
        dispatcher.choices[tokens] = tuning.ParmChoice(
            schedule, "model", Choice(schedule, {}, {}, reason="forced by the test"))
    return prepare


def parm_forced(case_name, case, tp, ep, etp, per_node, data, results, ref, layout, records):
    """parm forced onto each of its candidate schedules that run the layout (S2 at NUM_CHUNKS
    and the case's backward chunks), through ParmMoELayer and phase by phase, against
    alltoall and the single-process reference (its gradients where the case has no aux
    loss): output and every gradient. A candidate the suite runs only through parm
    (Megatron's allgather) also has its bytes checked, in the dropless case."""
    from megatron_parm import schedules

    bwd = BWD_CHUNKS[case_name] or NUM_CHUNKS
    direct = dispatchers(tp, ep, etp)
    keys = ("y", "x", "router", "fc1", "fc2") if case[3] == 0 else ("y",)
    for candidate in schedules.supported_candidates(tp, ep, etp):
        schedule = forced_schedule(candidate, bwd)
        for phases in (False, True):
            track = case_name == "dropless" and not phases and candidate.name not in direct
            full, totals, x_local = run_layer("parm", case, tp, ep, etp, tp > 1, data,
                                              per_node=per_node, bwd_chunks=bwd, phases=phases,
                                              prepare=force_parm(schedule), track=track)
            assert full.pop("choice") == str(schedule), (full, schedule)
            if track:
                check_bytes(candidate.name, totals, x_local, data, tp, ep, etp, per_node, layout,
                            records)
            row = dict(layout=layout, case=f"{case_name}-forced", dispatcher="parm",
                       schedule=candidate.name, phases=phases)
            for key in ("y", "x", "router", "fc1", "fc2"):
                records.append(dict(row, against="alltoall", quantity=key,
                                    err=rel_err(full[key], results["alltoall"][key])))
            for key in keys:
                records.append(dict(row, against="reference", quantity=key,
                                    err=rel_err(full[key], ref[key])))


def forced_schedule(candidate, bwd=NUM_CHUNKS):
    """What force_parm makes parm run of a candidate: its name, or for a chunked one (name,
    NUM_CHUNKS forward, bwd backward: NUM_CHUNKS for one that runs its backward in its
    forward's chunks)."""
    return (candidate.name, *candidate.pair(NUM_CHUNKS, bwd)) if candidate.chunked else candidate.name


def parm_forced_without_sequence_parallel(tp, ep, etp, per_node, data, ref, layout, records):
    """TP > 1, the input replicated over TP: parm forced onto each candidate that Megatron's
    MoELayer refuses there (allgather needs --sequence-parallel under MoELayer), which parm
    runs on the shard ParmMoELayer hands it; against the reference."""
    from megatron_parm import schedules

    for candidate in schedules.supported_candidates(tp, ep, etp):
        if candidate.unsupported(tp, ep, etp, sequence_parallel=False) is None:
            continue  # it runs without sequence parallelism on its own: check_layout's runs
        schedule = forced_schedule(candidate)
        full, _, _ = run_layer("parm", CASES["dropless"], tp, ep, etp, False, data,
                               per_node=per_node, prepare=force_parm(schedule))
        assert full.pop("choice") == str(schedule), (full, schedule)
        for key in ("y", "x", "router", "fc1", "fc2"):
            records.append(dict(layout=layout, case="dropless-no-sp-forced", dispatcher="parm",
                                schedule=candidate.name, against="reference", quantity=key,
                                err=rel_err(full[key], ref[key])))


def node_groups_kept(tp, ep, etp, per_node, layout, records):
    """Building parm_hier (and parm, which builds it as a candidate) again on a layout whose
    layers already ran makes no process group: the node groups are kept by their ranks."""
    from megatron_parm import schedules

    if schedules.get("parm_hier").unsupported(tp, ep, etp) is not None:
        return
    before = len(distributed_c10d._world.pg_map)
    data = global_tensors(3, dist.get_world_size() // tp)
    for name in ("parm_hier", "parm"):
        run_layer(name, CASES["dropless"], tp, ep, etp, tp > 1, data, per_node=per_node)
    records.append(dict(layout=layout, case="node-groups", dispatcher="parm_hier",
                        against="groups", quantity="made",
                        made=len(distributed_c10d._world.pg_map) - before))


def plain_config(case, names, tp, ep, etp, data, results, layout, records):
    """Every non-native dispatcher built from a plain TransformerConfig (no parm_* field, so
    each takes ParmTransformerConfig's defaults), against alltoall."""
    for name in names:
        full, _, _ = run_layer(name, case, tp, ep, etp, tp > 1, data, plain=True)
        full.pop("choice")
        for key in ("y", "x", "router", "fc1", "fc2"):
            records.append(dict(layout=layout, case="dropless-plain-config", dispatcher=name,
                                against="alltoall", quantity=key,
                                err=rel_err(full[key], results["alltoall"][key])))


def phase_order_errors(tp, ep, etp, per_node, layout, records):
    """Phases run out of order on each non-native dispatcher: every misuse must raise one
    RuntimeError naming the phase (before any collective, so every rank raises alike), and
    the dispatcher must still compute right afterwards. Records each misuse's message."""
    case = CASES["dropless"]
    data = global_tensors(5, dist.get_world_size() // tp)

    def misuse(layer, x):
        dispatcher = layer.token_dispatcher
        probs, routing_map = layer.router(x)
        tokens = x.view(-1, M)
        seen = {}

        def attempt(label, call):
            try:
                call()
            except RuntimeError as err:
                seen[label] = str(err)
            else:
                seen[label] = None

        with torch.no_grad():
            # nothing dispatched yet: no dispatch or combine phase may run
            attempt("token_dispatch", lambda: dispatcher.token_dispatch(tokens, probs))
            attempt("combine_preprocess", lambda: dispatcher.combine_preprocess(tokens))
            attempt("token_combine", lambda: dispatcher.token_combine(tokens))
            attempt("combine_postprocess", lambda: dispatcher.combine_postprocess(tokens))
            rows, row_probs = dispatcher.dispatch_preprocess(x, routing_map, probs)
            attempt("dispatch_postprocess", lambda: dispatcher.dispatch_postprocess(rows, row_probs))
            attempt("combine_preprocess:open", lambda: dispatcher.combine_preprocess(rows))
            attempt("dispatch_preprocess", lambda: dispatcher.dispatch_preprocess(x, routing_map, probs))
            # the open call goes on as if nothing had happened
            rows, row_probs = dispatcher.token_dispatch(rows, row_probs)
            if hasattr(dispatcher, "dispatch_compute_combine"):
                attempt("dispatch_compute_combine",
                        lambda: dispatcher.dispatch_compute_combine(rows, row_probs, layer.experts))
            rows, tokens_per_expert, row_probs = dispatcher.dispatch_postprocess(rows, row_probs)
            out, _ = layer.experts(rows, tokens_per_expert, row_probs)
            out = dispatcher.token_combine(dispatcher.combine_preprocess(out))
            attempt("token_combine:twice", lambda: dispatcher.token_combine(out))
            out = dispatcher.combine_postprocess(out)
            attempt("combine_postprocess:twice", lambda: dispatcher.combine_postprocess(out))
        return {"messages": seen, "after": out}

    for name in dispatchers(tp, ep, etp)[1:]:
        full, _, _ = run_layer(name, case, tp, ep, etp, tp > 1, data, per_node=per_node,
                               inspect=misuse)
        found = full.pop("inspect")
        # after the misuse the call completes with what the layer's own call computed
        records.append(dict(layout=layout, case="phase-order", dispatcher=name,
                            against="errors", messages=found["messages"],
                            err=rel_err(found["after"].float(), layer_output_shard(full, tp))))


def layer_output_shard(full, tp):
    """This rank's part of the all-reduced layer output "y" (sequence shard of its replica)."""
    from megatron.core import parallel_state as ps

    rows = S // tp
    tp_rank, dp_rank = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
    return full["y"][dp_rank, tp_rank * rows:(tp_rank + 1) * rows]


# World size -> layouts where the grouped experts (GroupedMLP, TorchGroupedMLP) run (bf16 on
# CPU is slow): ETP 2 with 4 and with 2 local experts, EP 4 without ETP.
GROUPED_LAYOUTS = {4: ("2,2,2", "1,4,1"), 8: ("2,4,2",)}
# Dispatchers that also run TorchGroupedMLP in bf16 (float32: all of them): Megatron's and the
# pipelined ones, whose chunks each call the experts.
TORCH_GROUPED_BF16 = ("alltoall", "parm_s2", "parm_hier_s2")


def torch_grouped_experts(tp, ep, etp, per_node, layout, records):
    """Every dispatcher with megatron_parm.experts.TorchGroupedMLP experts (PyTorch's grouped_mm)
    against alltoall with SequentialMLP: in float32 (the suite's tolerance) for all of them, in
    bf16 for TORCH_GROUPED_BF16. S2 runs with NUM_CHUNKS chunks and a backward pipeline of
    another size (BWD_CHUNKS["drop"]), so that every per-chunk expert call of both passes
    goes through the grouped GEMM. parm decides with the latency-free profile (S2)."""
    data = global_tensors(321, dist.get_world_size() // tp)
    case = CASES["dropless"]
    for dtype, names in (("fp32", dispatchers(tp, ep, etp)), ("bf16", TORCH_GROUPED_BF16)):
        bf16 = dtype == "bf16"
        sequential, _, _ = run_layer("alltoall", case, tp, ep, etp, tp > 1, data, bf16=bf16,
                                     per_node=per_node)
        for name in names:
            grouped, _, _ = run_layer(name, case, tp, ep, etp, tp > 1, data, torch_grouped=True,
                                      bf16=bf16, per_node=per_node, bwd_chunks=BWD_CHUNKS["drop"],
                                      profile=PROFILE_PATHS["latency-free"] if name == "parm" else None)
            for key in ("y", "x", "router", "fc1", "fc2"):
                records.append(dict(layout=layout, case=f"torch-grouped-{dtype}", dispatcher=name,
                                    against="sequential", quantity=key,
                                    err=rel_err(grouped[key], sequential[key])))
            if name == "parm":
                records.append(dict(layout=layout, case=f"torch-grouped-{dtype}", dispatcher=name,
                                    against="schedule", quantity="schedule",
                                    choice=grouped["choice"]))


def grouped_experts(tp, ep, etp, per_node, layout, records):
    """Every dispatcher with Megatron's GroupedMLP experts (on tests/fake_grouped_gemm.py)
    against alltoall with SequentialMLP, both in bf16 (so both route alike).
    Parm's dispatchers run under the simulated device, so that batch sizes left on the device
    are refused as on a GPU; Megatron's alltoall moves them to the host only from a real GPU
    (maybe_move_tensor_to_cpu), so it runs without."""
    import fake_grouped_gemm
    from device_sim import SimulatedDevice

    data = global_tensors(321, dist.get_world_size() // tp)
    sequential, _, _ = run_layer("alltoall", CASES["dropless"], tp, ep, etp, tp > 1, data, bf16=True,
                                 per_node=per_node)
    fake_grouped_gemm.install()
    try:
        for name in dispatchers(tp, ep, etp):
            sim = SimulatedDevice(raise_on_mixing=False)
            del fake_grouped_gemm.violations[:]
            error = None
            try:
                grouped, _, _ = run_layer(name, CASES["dropless"], tp, ep, etp, tp > 1, data,
                                          grouped=True, per_node=per_node,
                                          simulate=None if name == "alltoall" else sim)
            except RuntimeError as err:  # a refusal of the fake package: recorded below
                error, grouped = str(err), None
            for key in ("y", "x", "router", "fc1", "fc2"):
                err = rel_err(grouped[key], sequential[key]) if grouped is not None else float("inf")
                records.append(dict(layout=layout, case="grouped-gemm", dispatcher=name,
                                    against="sequential", quantity=key, err=err))
            records.append(dict(layout=layout, case="grouped-gemm-calls", dispatcher=name,
                                against="grouped_gemm", error=error, mixing=sim.mixing,
                                violations=list(fake_grouped_gemm.violations)))
    finally:
        fake_grouped_gemm.uninstall()


def simulated_device(tp, ep, etp, per_node, layout, records):
    """Each non-native schedule's layer call (forward and backward) under the simulated device,
    the pipelined ones also with one chunk ("parm_s2:1", "parm_hier_s2:1") and parm forced onto
    Megatron's allgather ("parm:allgather"): any host tensor meeting a device tensor, every
    host sync with its call site, and what parm ran."""
    from device_sim import SimulatedDevice

    data = global_tensors(123, dist.get_world_size() // tp)
    names = dispatchers(tp, ep, etp)[1:]
    runs = [(name, name, NUM_CHUNKS, None) for name in names] + [
        (f"{name}:1", name, 1, None) for name in ("parm_s2", "parm_hier_s2") if name in names] + [
        ("parm:allgather", "parm", NUM_CHUNKS, force_parm("allgather"))]
    for case_name in ("dropless", "pad"):
        for label, name, chunks, prepare in runs:
            sim = SimulatedDevice(raise_on_mixing=False)
            full, _, _ = run_layer(name, CASES[case_name], tp, ep, etp, tp > 1, data,
                                   num_chunks=chunks, simulate=sim, per_node=per_node,
                                   prepare=prepare)
            records.append(dict(layout=layout, case=f"device-sim-{case_name}", dispatcher=label,
                                against="simulated-device", mixing=sim.mixing,
                                syncs_forward=sim.syncs[:sim.forward_syncs],
                                syncs_backward=sim.syncs[sim.forward_syncs:],
                                choice=full["choice"]))


def check_bytes(name, totals, x_local, data, tp, ep, etp, per_node, layout, records):
    """Recorded bytes vs formulas from the routing (recomputed here)."""
    from reference_moe import route

    tokens = x_local.reshape(-1, M)
    routed = (route(tokens, data["router"], CASES["dropless"][0]) > 0).to(torch.uint8)
    maps = [torch.zeros_like(routed) for _ in range(dist.get_world_size())]
    dist.all_gather(maps, routed)
    maps = torch.stack(maps).bool()  # [W, n, E]
    if name in ("parm_hier", "parm_hier_s2"):
        parts = NUM_CHUNKS if name == "parm_hier_s2" else 1
        expected = expected_hier_bytes(maps, dist.get_rank(), ep, etp, per_node, parts)
    else:
        expected = expected_bytes(name, maps.sum(dim=1).long(), dist.get_rank(), tp, ep, etp,
                                  tokens.shape[0])
    measured = {k: v["intra"] + v["inter"] for k, v in
                ((tuple(k), v) for k, v in totals.items())}
    mismatch = {f"{k[0]}/{k[1]}": (measured.get(k, 0), expected.get(k, 0))
                for k in set(measured) | set(expected) if measured.get(k, 0) != expected.get(k, 0)}
    # Sum the A2A(EP) bytes over the world: ds_baseline's duplication shows as a factor t.
    a2a = torch.tensor([float(measured.get(("all_to_all", "ep"), 0))])
    dist.all_reduce(a2a)
    from megatron_parm.bench.report import is_metadata

    # Token payload sent between nodes (routing counts are metadata, as in the report).
    inter = torch.tensor([float(sum(v["inter"] for k, v in totals.items()
                                    if not is_metadata(name, "/".join(k))))])
    dist.all_reduce(inter)
    records.append(dict(layout=layout, case="bytes", dispatcher=name, against="formula",
                        quantity="bytes", mismatch=mismatch, a2a_world=a2a.item(),
                        inter_world=inter.item(),
                        shared_remote_node=shares_a_remote_node(maps, ep, per_node),
                        plan_mismatch=cost_plan_mismatch(name, totals, tokens.shape[0], tp, ep,
                                                         etp, per_node)))


def cost_plan_mismatch(name, totals, n_tokens, tp, ep, etp, per_node):
    """For a schedule whose bytes do not depend on the routing (allgather), the catalog's cost
    plan against the recorded bytes, intra- and inter-node per (kind, group): the
    mismatches ({} where they agree; None for the others)."""
    if name != "allgather":
        return None
    from megatron_parm.perf_model import LayerShape, Layout, comm_volumes

    shape = LayerShape(num_tokens=n_tokens, hidden_size=M, ffn_hidden_size=F, num_experts=E,
                       topk=CASES["dropless"][0], dtype_bytes=4, prob_bytes=4)
    world = dist.get_world_size()
    plan = comm_volumes(name, shape, Layout(tp, ep, etp, world // per_node, per_node))
    recorded = {tuple(k): v for k, v in totals.items()}
    return {"/".join(k): (recorded.get(k), plan.get(k)) for k in set(plan) | set(recorded)
            if recorded.get(k) != plan.get(k)}


PROFILE_PATHS = {}


def main():
    args = sys.argv[1:]
    if "--with-toy" in args:  # the catalog test's toy schedule runs like every other
        from toy_schedule import register_toy

        args.remove("--with-toy")
        register_toy()
    out_path, layouts = args[0], args[1:]
    if device.is_cuda():  # every rank on the one GPU (or spread over several)
        device.set_device(int(os.environ.get("LOCAL_RANK", "0")) % device.device_count())
    dist.init_process_group("gloo")
    mcore_compat.setup()
    PROFILE_PATHS["latency-free"] = latency_free_profile(out_path + f".rank{dist.get_rank()}.profile.yaml")
    torch.manual_seed(0)
    records = []
    for index, spec in enumerate(layouts):
        sizes, _, per_node = spec.partition("@")
        tp, ep, etp = (int(v) for v in sizes.split(","))
        check_layout(tp, ep, etp, int(per_node) if per_node else None, records)
        if index == 0:  # one layout per launch: the misuse runs no collective of its own
            phase_order_errors(tp, ep, etp, int(per_node) if per_node else dist.get_world_size(),
                               sizes, records)
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(records, gathered, dst=0)
    if dist.get_rank() == 0:
        # Numeric records are identical on all ranks (all-reduced); byte and simulated-device
        # records are per rank.
        def per_rank(record):
            return record["case"] in ("bytes", "grouped-gemm-calls", "phase-order") or \
                record["case"].startswith("device-sim")

        merged = [r for r in records if not per_rank(r)]
        for rank, recs in enumerate(gathered):
            merged += [dict(r, rank=rank) for r in recs if per_rank(r)]
        with open(out_path, "w") as f:
            json.dump(merged, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
