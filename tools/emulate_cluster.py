#!/usr/bin/env python3
"""Run a command on an emulated multi-node cluster (one Linux machine, root only).

Each node is a network namespace; nodes are joined by veth links to a bridge that lives in a
namespace of its own, so the host's network is left alone. Links are shaped with tc: every
node's NIC at --inter-node-bandwidth (both directions), and every node's loopback, which
carries traffic between ranks of that node, at --intra-node-bandwidth. Ranks are numbered
node-major like torchrun/Slurm (rank = node * nproc_per_node + local_rank) and get RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, GROUP_RANK, MASTER_ADDR, MASTER_PORT and
GLOO_SOCKET_IFNAME=eth0, so torch.distributed.init_process_group("gloo") with the default
env:// init works unchanged.

    # 2 nodes x 2 ranks, default preset (pcie: inter 500mbit, intra 1gbit)
    sudo python tools/emulate_cluster.py --nnodes 2 --nproc-per-node 2 -- python train.py --args

    # explicit shaping; latency needs the kernel's sch_netem
    sudo python tools/emulate_cluster.py --nnodes 2 --nproc-per-node 4 \\
        --inter-node-bandwidth 500mbit --inter-node-latency 50us \\
        --intra-node-bandwidth 1gbit -- python bench.py

    # NVLink-like ratio (intra 12x inter)
    sudo python tools/emulate_cluster.py --nnodes 2 --nproc-per-node 2 --preset nvlink -- ...

    # remove namespaces left by a launcher that was SIGKILLed
    sudo python tools/emulate_cluster.py --cleanup-stale

Presets (flags override them):
    pcie    inter 500mbit, intra 1gbit  (intra/inter 2x: PCIe servers, the paper's testbed)
    nvlink  inter 500mbit, intra 6gbit  (12x: NVLink inside a node + InfiniBand between nodes)
Default: preset pcie, latency 0 (no netem), mtu 65535 (jumbo frames: the least work for the
processors per byte moved) on veth and loopback, master port 29500.
Bandwidths take tc bit units (kbit, mbit, gbit) or 'none' for an unshaped link.

Everything created is removed on exit, on a failed rank (the others are stopped; the exit code
is that rank's), and on SIGINT/SIGTERM (exit 128+signal). The rank commands' output goes
straight to this terminal.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_parm import cli  # noqa: E402
from megatron_parm.wording import plural  # noqa: E402

cli.setup_warnings()  # before Megatron-Core is imported

from megatron_parm.emulator import cluster as ec  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="emulate_cluster.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nnodes", type=int, default=2, help="number of emulated nodes (default 2)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node (default 1)")
    parser.add_argument("--preset", choices=sorted(ec.PRESETS), default=None,
                        help=f"bandwidth pair to start from (default {ec.DEFAULT_PRESET})")
    parser.add_argument("--inter-node-bandwidth", default=None,
                        help="rate of each node's NIC, each direction, e.g. 500mbit (default: preset's)")
    parser.add_argument("--inter-node-latency", default="0",
                        help="one-way node-to-node latency, e.g. 50us; needs sch_netem (default 0)")
    parser.add_argument("--intra-node-bandwidth", default=None,
                        help="rate of each node's loopback (rank-to-rank inside a node), e.g. 2gbit "
                             "(default: preset's; 'none' = unshaped, ~20 Gbit/s)")
    parser.add_argument("--intra-node-latency", default="0",
                        help="one-way latency on each node's loopback; needs sch_netem (default 0)")
    parser.add_argument("--mtu", type=int, default=ec.DEFAULT_MTU,
                        help=f"MTU of the veth links and of loopback (default {ec.DEFAULT_MTU}; "
                             "1500 is Ethernet's, which costs the cores more per byte)")
    parser.add_argument("--master-port", type=int, default=ec.DEFAULT_MASTER_PORT,
                        help=f"MASTER_PORT on node 0 (default {ec.DEFAULT_MASTER_PORT}; namespaces "
                             "are private per run, so concurrent runs do not collide)")
    parser.add_argument("--ns-prefix", default=ec.DEFAULT_PREFIX,
                        help=f"namespace name prefix; names are <prefix><pid>-hub/-n<i> "
                             f"(default {ec.DEFAULT_PREFIX})")
    parser.add_argument("--timeout", type=float, default=None,
                        help="stop all ranks after this many seconds (exit 124); default none")
    parser.add_argument("--cleanup-stale", action="store_true",
                        help="delete namespaces with --ns-prefix whose launcher is gone, then exit")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- command and its arguments")
    return parser


def spec_from_args(args: argparse.Namespace) -> ec.ClusterSpec:
    """Raises ValueError naming the flag for anything malformed."""
    inter, intra = ec.resolve_shapes(
        args.preset, args.inter_node_bandwidth, args.intra_node_bandwidth,
        args.inter_node_latency, args.intra_node_latency,
    )
    return ec.ClusterSpec(
        num_nodes=args.nnodes, num_procs_per_node=args.nproc_per_node,
        inter_node=inter, intra_node=intra,
        master_port=args.master_port, mtu=args.mtu, prefix=args.ns_prefix,
    )


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        spec = spec_from_args(args)
        if args.timeout is not None and args.timeout <= 0:
            raise ValueError(f"--timeout must be > 0, got {args.timeout}")
        if args.cleanup_stale:
            if command:
                raise ValueError("--cleanup-stale takes no command")
            ec.check_host(spec)
            removed = ec.cleanup_stale(spec.prefix)
            print(f"removed {plural(len(removed), 'stale namespace')}" + (f": {' '.join(removed)}" if removed else ""))
            return 0
        if not command:
            raise ValueError("no command given: put it after '--', e.g. -- python script.py")
    except ValueError as error:
        parser.error(str(error))  # exits 2 with usage
    try:
        return ec.run_command(spec, command, timeout_s=args.timeout)
    except ec.ClusterError as error:
        print(f"emulate_cluster: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    cli.run(main)
