"""Rank program for tests/e2e/test_emulated_cluster.py, run by tools/emulate_cluster.py.

    python tools/emulate_cluster.py --nnodes 2 --nproc-per-node 2 -- \\
        python tests/e2e/_allreduce_worker.py MODE OUT_DIR [--num-bytes N] [--iters K]

Modes:
    allreduce  one gloo all_reduce, checked against the closed form
    pipeline   allreduce, then Megatron-Core's process groups at pp=2, ep=2 (its rank order:
               each rank's groups and pipeline stage), and one p2p send of N bytes from every
               stage-0 rank to its next stage as Megatron's schedules send (batch_isend_irecv
               over the pipeline group), with the qdisc byte counters around it
    transfer   rank 0 sends N bytes to rank 1 (same node) and to rank G (next node), timed
    bench      all_reduce and all_to_all of N bytes per rank over all ranks, then all_reduce
               within each node and across nodes only; median of K iterations
    fail       rank 1 exits with code 3 at once, the others block in a barrier
Each rank writes OUT_DIR/rank{RANK}.json; local rank 0 of every node also records its
namespace's `tc -s qdisc` byte counters (before and after), keyed by interface.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def qdisc_bytes() -> dict:
    """Bytes sent by the root qdisc of each interface of this namespace, e.g. {'lo': 123}."""
    text = subprocess.run(["tc", "-s", "qdisc", "show"], capture_output=True, text=True).stdout
    sent = {}
    for block in re.split(r"\n(?=qdisc )", text):
        match = re.match(r"qdisc \S+ \S+ dev (\S+) root.*?Sent (\d+) bytes", block, re.S)
        if match:
            sent[match.group(1)] = int(match.group(2))
    return sent


def timed(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def pipeline_stages(num_elems: int, count_bytes: bool) -> dict:
    """Megatron-Core's groups at pp=2, ep=2 (tp=1) for this rank, and the bytes this node's
    interfaces sent while each stage-0 rank sent num_elems floats to its next stage."""
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(pipeline_model_parallel_size=2, expert_model_parallel_size=2)
    pipeline = mpu.get_pipeline_model_parallel_group()
    groups = {"tp": mpu.get_tensor_model_parallel_group(), "ep": mpu.get_expert_model_parallel_group(),
              "dp": mpu.get_data_parallel_group(), "expt_dp": mpu.get_expert_data_parallel_group(),
              "pp": pipeline, "embedding": mpu.get_embedding_group()}
    stage = mpu.get_pipeline_model_parallel_rank()
    found = {"stage": stage,
             "groups": {name: dist.get_process_group_ranks(group) for name, group in groups.items()}}
    members = found["groups"]["pp"]
    payload = torch.ones(num_elems) if stage == 0 else torch.empty(num_elems)
    peer = members[1 - stage]
    dist.barrier()
    before = qdisc_bytes() if count_bytes else None
    dist.barrier()  # no rank of the node sends before its counters are read
    op = dist.isend if stage == 0 else dist.irecv
    for request in dist.batch_isend_irecv([dist.P2POp(op, payload, peer, group=pipeline)]):
        request.wait()
    dist.barrier()
    if count_bytes:
        after = qdisc_bytes()
        found["p2p_sent"] = {dev: after[dev] - before.get(dev, 0) for dev in after}
    found["p2p_ok"] = bool(torch.all(payload == 1))
    mpu.destroy_model_parallel()
    return found


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["allreduce", "pipeline", "transfer", "bench", "fail"])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--num-bytes", type=int, default=4 << 20)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    if args.mode == "fail" and rank == 1:
        return 3
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    record = {"rank": rank, "node": int(os.environ["NODE_RANK"]), "local_rank": int(os.environ["LOCAL_RANK"])}
    if record["local_rank"] == 0:
        record["tc_before"] = qdisc_bytes()
    num_elems = args.num_bytes // 4

    if args.mode == "fail":
        dist.barrier()  # never completes: rank 1 is gone; the launcher must stop us
    elif args.mode in ("allreduce", "pipeline"):
        tensor = torch.full((1024,), float(rank + 1))
        dist.all_reduce(tensor)
        record["ok"] = bool(torch.all(tensor == world_size * (world_size + 1) / 2))
        if args.mode == "pipeline":
            record.update(pipeline_stages(num_elems, record["local_rank"] == 0))
    elif args.mode == "transfer":
        payload = torch.ones(num_elems)
        next_node_rank = local_world_size  # first rank of node 1
        for name, peer in (("intra_s", 1), ("inter_s", next_node_rank)):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(payload, peer)
                dist.recv(torch.empty(1), peer)  # ack: the bytes have all arrived
            elif rank == peer:
                dist.recv(payload, 0)
                dist.send(torch.zeros(1), 0)
            record[name] = time.perf_counter() - start
    elif args.mode == "bench":
        data = torch.ones(num_elems)
        out = torch.empty(num_elems)
        num_nodes = world_size // local_world_size
        # Every rank must create every group, in the same order.
        node_groups = [dist.new_group(list(range(node * local_world_size, (node + 1) * local_world_size)))
                       for node in range(num_nodes)]
        peer_groups = [dist.new_group(list(range(local, world_size, local_world_size)))
                       for local in range(local_world_size)]
        node_group = node_groups[record["node"]]
        peer_group = peer_groups[record["local_rank"]]
        dist.all_reduce(data)  # connect every pair before timing
        dist.all_to_all_single(out, data)
        record["all_reduce_s"] = timed(lambda: dist.all_reduce(data), args.iters)
        record["all_to_all_s"] = timed(lambda: dist.all_to_all_single(out, data), args.iters)
        # One collective per node (intra-node only) and one per local rank (inter-node only).
        record["intra_all_reduce_s"] = timed(lambda: dist.all_reduce(data, group=node_group), args.iters)
        record["inter_all_reduce_s"] = timed(lambda: dist.all_reduce(data, group=peer_group), args.iters)

    dist.barrier()
    if record["local_rank"] == 0:
        record["tc_after"] = qdisc_bytes()
    (args.out_dir / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
