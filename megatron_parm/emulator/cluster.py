"""An emulated multi-node cluster on one Linux machine: network namespaces + tc shaping.

Standard library only (no torch), so it can be imported by the launcher and unit tests anywhere.
The command-line entry point is ``tools/emulate_cluster.py``; see its docstring for usage.

Topology (N nodes, G ranks per node)::

    <prefix><pid>-hub                 one namespace holding bridge br0 (the "switch")
        br0 -- p0 -- p1 -- ... -- p{N-1}        hub ends of the veth pairs, egress shaped
    <prefix><pid>-n{i}                one namespace per node i
        eth0  10.77.0.{i+1}/24       node end of the veth pair, egress shaped  (inter-node)
        lo    127.0.0.1, mtu = --mtu            egress shaped                   (intra-node)

Every rank of node i binds gloo to eth0 (GLOO_SOCKET_IFNAME=eth0), so all its sockets carry
the address 10.77.0.{i+1}. A connection to a rank of another node leaves through eth0, crosses
the bridge and enters the peer's eth0: it passes two token buckets at the inter-node rate
(sender NIC out, receiver NIC in), like a full-duplex NIC on a switch. A connection to a rank
of the same node targets the node's own address, which Linux delivers through ``lo``; ``lo``
is shaped at the intra-node rate. The host's own namespace is never touched: the veth pairs
are created inside the namespaces and the bridge lives in the hub namespace.

Latency (--*-latency) needs the ``sch_netem`` qdisc; it is added as a root netem with the token
bucket (``sch_tbf``) as its child. With latency 0 (the default) only tbf is used.

Notation: N = num_nodes, G = num_procs_per_node, rank = node * G + local_rank (node-major,
as torchrun/Slurm number ranks, so consecutive ranks share a node).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List, Mapping, Optional, Sequence

from megatron_parm.wording import plural

DEFAULT_PREFIX = "parmemu"
DEFAULT_MASTER_PORT = 29500
# Jumbo frames on the veth links and loopback: a GPU cluster's NICs and NVLink move data
# without the processors, while here every packet is segmented, shaped and copied by the same
# cores that run the ranks. At MTU 1500 a 4 MB collective is ~2800 packets per hop; at 65535
# ~65, which frees the cores for the ranks' compute (docs/benchmark.md measures the effect).
# --mtu 1500 is the Ethernet default, for those who want to study it.
DEFAULT_MTU = 65535
SUBNET = "10.77.0"  # node i gets SUBNET.{i+1}; private, and only ever inside our namespaces
NODE_IFNAME = "eth0"
BRIDGE_NAME = "br0"
MAX_NODES = 250

# Intra/inter bandwidth pairs. Real clusters range from ~1-2x (PCIe servers, the paper's
# testbed) to ~9-18x (NVLink + InfiniBand). Absolute values are scaled down for a CPU-only
# machine: both presets share the inter-node rate, 500mbit, at which communication is 30-70%
# of an MoE layer's time on 2 cores (docs/benchmark.md).
PRESETS: Dict[str, Dict[str, str]] = {
    "pcie": {"inter_node_bandwidth": "500mbit", "intra_node_bandwidth": "1gbit"},
    "nvlink": {"inter_node_bandwidth": "500mbit", "intra_node_bandwidth": "6gbit"},
}
DEFAULT_PRESET = "pcie"

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_TIME_UNITS = {"s": 1e6, "ms": 1e3, "us": 1.0}
_NO_LIMIT_WORDS = ("none", "unlimited", "off")


class ClusterError(RuntimeError):
    """The emulated cluster cannot be set up (not root, missing tool or qdisc, ...)."""


def parse_rate(text: str, flag: str) -> Optional[int]:
    """'500mbit' -> 500_000_000 bits/s; 'none' -> None (link left unshaped).

    Only tc's bit-based units are accepted (tc's 'mbps' means megaBYTES/s, a classic trap).
    """
    value = str(text).strip().lower()
    if value in _NO_LIMIT_WORDS:
        return None
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]+)", value)
    if match is None or match.group(2) not in _RATE_UNITS:
        raise ValueError(
            f"{flag}: cannot parse bandwidth {text!r}; use a number with a unit from "
            f"{sorted(_RATE_UNITS, key=_RATE_UNITS.get)} (e.g. 500mbit, 2gbit) or 'none'"
        )
    bits_per_s = int(round(float(match.group(1)) * _RATE_UNITS[match.group(2)]))
    if bits_per_s < 8000:
        raise ValueError(f"{flag}: bandwidth {text!r} is below 8kbit, which TCP cannot use")
    return bits_per_s


def parse_latency(text: str, flag: str) -> float:
    """'50us' -> 50.0, '1.5ms' -> 1500.0, '0' -> 0.0 (one-way latency in microseconds)."""
    value = str(text).strip().lower()
    if value in ("0",) + _NO_LIMIT_WORDS:
        return 0.0
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]+)", value)
    if match is None or match.group(2) not in _TIME_UNITS:
        raise ValueError(
            f"{flag}: cannot parse latency {text!r}; use a number with a unit from "
            f"{list(_TIME_UNITS)} (e.g. 50us, 1ms) or 0"
        )
    return float(match.group(1)) * _TIME_UNITS[match.group(2)]


def format_rate(bits_per_s: Optional[int]) -> str:
    if bits_per_s is None:
        return "unshaped"
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bits_per_s >= _RATE_UNITS[unit]:
            return f"{bits_per_s / _RATE_UNITS[unit]:g}{unit}"
    return f"{bits_per_s}bit"


@dataclasses.dataclass(frozen=True)
class LinkShape:
    """Egress shaping of one interface. bits_per_s None = no rate limit."""

    bits_per_s: Optional[int]
    latency_us: float = 0.0

    @property
    def is_shaped(self) -> bool:
        return self.bits_per_s is not None or self.latency_us > 0


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    num_nodes: int
    num_procs_per_node: int
    inter_node: LinkShape
    intra_node: LinkShape
    master_port: int = DEFAULT_MASTER_PORT
    mtu: int = DEFAULT_MTU
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self):
        if not 1 <= self.num_nodes <= MAX_NODES:
            raise ValueError(f"--nnodes must be in [1, {MAX_NODES}], got {self.num_nodes}")
        if self.num_procs_per_node < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {self.num_procs_per_node}")
        if not 1 <= self.master_port <= 65535:
            raise ValueError(f"--master-port must be in [1, 65535], got {self.master_port}")
        if not 576 <= self.mtu <= 65535:
            raise ValueError(f"--mtu must be in [576, 65535], got {self.mtu}")
        # Namespace names end up as file names under /run/netns; interface-name limits do not
        # apply to them, but keep the prefix a plain identifier so --cleanup-stale can parse it.
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]{0,23}", self.prefix):
            raise ValueError(f"--ns-prefix must be a letter then [A-Za-z0-9_] (<=24), got {self.prefix!r}")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_procs_per_node


def resolve_shapes(
    preset: Optional[str],
    inter_node_bandwidth: Optional[str],
    intra_node_bandwidth: Optional[str],
    inter_node_latency: str = "0",
    intra_node_latency: str = "0",
):
    """Flags override the preset; a missing preset means DEFAULT_PRESET. Returns (inter, intra)."""
    preset_name = DEFAULT_PRESET if preset is None else preset
    if preset_name not in PRESETS:
        raise ValueError(f"--preset must be one of {sorted(PRESETS)}, got {preset!r}")
    values = PRESETS[preset_name]
    inter_bw = values["inter_node_bandwidth"] if inter_node_bandwidth is None else inter_node_bandwidth
    intra_bw = values["intra_node_bandwidth"] if intra_node_bandwidth is None else intra_node_bandwidth
    inter = LinkShape(
        parse_rate(inter_bw, "--inter-node-bandwidth"),
        parse_latency(inter_node_latency, "--inter-node-latency"),
    )
    intra = LinkShape(
        parse_rate(intra_bw, "--intra-node-bandwidth"),
        parse_latency(intra_node_latency, "--intra-node-latency"),
    )
    return inter, intra


# ---------------------------------------------------------------------------------------------
# Pure planning: names, addresses, tc/ip command lines, rank environments.
# ---------------------------------------------------------------------------------------------


def namespace_names(prefix: str, run_id: int, num_nodes: int):
    """(hub namespace, [node namespaces]) for one launcher invocation (run_id = launcher pid)."""
    base = f"{prefix}{run_id}"
    return f"{base}-hub", [f"{base}-n{node}" for node in range(num_nodes)]


def node_address(node: int) -> str:
    return f"{SUBNET}.{node + 1}"


def tbf_params(bits_per_s: int, mtu: int) -> List[str]:
    """Token bucket arguments for tc.

    The bucket must hold at least one packet as the qdisc sees it (an MTU frame, or a GSO
    super-packet that tbf will segment) or the packet is dropped forever and TCP stalls; that
    is the loopback-MTU-64k trap: the bucket holds four frames of the MTU (with headers), 256
    KiB at the default jumbo MTU. About 1 ms of traffic keeps timer overhead low at Gbit rates
    while a burst stays negligible against multi-MB collectives. The queue limit (~100 ms) is
    generous so that many concurrent gloo sockets are paced, not dropped.
    """
    bytes_per_s = bits_per_s / 8
    burst = max(int(bytes_per_s * 1e-3), 4 * (mtu + 64), 16 * 1024)
    limit = max(int(bytes_per_s * 0.1), 4 * burst, 1 << 20)
    return ["rate", f"{bits_per_s}bit", "burst", str(burst), "limit", str(limit)]


def shape_commands(namespace: str, ifname: str, shape: LinkShape, mtu: int) -> List[List[str]]:
    """tc commands shaping the egress of one interface. Empty when the shape is a no-op."""
    tc = ["tc", "-n", namespace, "qdisc", "add", "dev", ifname]
    if shape.latency_us > 0:
        cmds = [tc + ["root", "handle", "1:", "netem", "delay", f"{shape.latency_us:g}us", "limit", "100000"]]
        if shape.bits_per_s is not None:
            cmds.append(tc + ["parent", "1:1", "handle", "10:", "tbf"] + tbf_params(shape.bits_per_s, mtu))
        return cmds
    if shape.bits_per_s is not None:
        return [tc + ["root", "handle", "1:", "tbf"] + tbf_params(shape.bits_per_s, mtu)]
    return []


def _disable_ipv6(namespace: str) -> List[str]:
    # Gloo picks the first address of GLOO_SOCKET_IFNAME; an IPv6 link-local one would win
    # on some versions and break the rendezvous, so the namespaces are IPv4 only.
    return ["ip", "netns", "exec", namespace, "sysctl", "-q", "-w",
            "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"]


def setup_commands(spec: ClusterSpec, run_id: int) -> List[List[str]]:
    """Every ip/tc command that builds the cluster, in order (pure: nothing is run here)."""
    hub, nodes = namespace_names(spec.prefix, run_id, spec.num_nodes)
    cmds = [
        ["ip", "netns", "add", hub],
        _disable_ipv6(hub),
        ["ip", "-n", hub, "link", "set", "lo", "up"],
        ["ip", "-n", hub, "link", "add", BRIDGE_NAME, "type", "bridge"],
        ["ip", "-n", hub, "link", "set", BRIDGE_NAME, "up"],
    ]
    for node, namespace in enumerate(nodes):
        hub_port = f"p{node}"
        cmds += [
            ["ip", "netns", "add", namespace],
            _disable_ipv6(namespace),
            ["ip", "-n", namespace, "link", "set", "lo", "mtu", str(spec.mtu), "up"],
            # Created inside the node namespace, peer moved straight to the hub: the host's
            # namespace never sees either end.
            ["ip", "-n", namespace, "link", "add", NODE_IFNAME, "mtu", str(spec.mtu), "type", "veth",
             "peer", "name", hub_port, "netns", hub],
            ["ip", "-n", namespace, "addr", "add", f"{node_address(node)}/24", "dev", NODE_IFNAME],
            ["ip", "-n", namespace, "link", "set", NODE_IFNAME, "up"],
            ["ip", "-n", hub, "link", "set", hub_port, "master", BRIDGE_NAME],
            ["ip", "-n", hub, "link", "set", hub_port, "mtu", str(spec.mtu), "up"],
        ]
        cmds += shape_commands(namespace, NODE_IFNAME, spec.inter_node, spec.mtu)
        # Receive side of the node's NIC: the hub port's egress. No extra latency here, so the
        # one-way inter-node latency is exactly --inter-node-latency.
        cmds += shape_commands(hub, hub_port, LinkShape(spec.inter_node.bits_per_s), spec.mtu)
        cmds += shape_commands(namespace, "lo", spec.intra_node, spec.mtu)
    return cmds


def rank_env(spec: ClusterSpec, node: int, local_rank: int, base_env: Mapping[str, str]) -> Dict[str, str]:
    """Environment of one rank: what torchrun would export, plus gloo's interface."""
    env = dict(base_env)
    env.update(
        RANK=str(node * spec.num_procs_per_node + local_rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(spec.num_procs_per_node),
        NODE_RANK=str(node),
        GROUP_RANK=str(node),
        GROUP_WORLD_SIZE=str(spec.num_nodes),
        ROLE_RANK=str(node * spec.num_procs_per_node + local_rank),
        ROLE_WORLD_SIZE=str(spec.world_size),
        MASTER_ADDR=node_address(0),
        MASTER_PORT=str(spec.master_port),
        GLOO_SOCKET_IFNAME=NODE_IFNAME,
    )
    # Like torchrun: several ranks share the CPUs, so do not let each spawn a thread per core.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def describe(spec: ClusterSpec) -> str:
    def shape_text(shape: LinkShape) -> str:
        text = format_rate(shape.bits_per_s)
        return text + (f" +{shape.latency_us:g}us" if shape.latency_us > 0 else "")

    return (
        f"{plural(spec.num_nodes, 'node')} x {plural(spec.num_procs_per_node, 'rank')}, "
        f"inter-node {shape_text(spec.inter_node)}, intra-node {shape_text(spec.intra_node)}, "
        f"mtu {spec.mtu}, master {node_address(0)}:{spec.master_port}"
    )


# ---------------------------------------------------------------------------------------------
# Side effects: checks, setup/teardown, launching ranks.
# ---------------------------------------------------------------------------------------------


def _run(cmd: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def check_host(spec: ClusterSpec) -> None:
    """Refuse early, with a reason, where the emulator cannot work."""
    if not sys.platform.startswith("linux"):
        raise ClusterError("the emulated cluster needs Linux network namespaces")
    if os.geteuid() != 0:
        raise ClusterError("the emulated cluster needs root (it creates network namespaces)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(f"missing tool(s) {missing}; install iproute2")


def list_namespaces() -> List[str]:
    result = _run(["ip", "netns", "list"])
    # Lines look like "name" or "name (id: 3)".
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def _kill_namespace_processes(namespace: str) -> None:
    result = _run(["ip", "netns", "pids", namespace])
    for pid_text in result.stdout.split():
        try:
            os.kill(int(pid_text), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def delete_namespaces(namespaces: Sequence[str]) -> List[str]:
    """Kill whatever still runs in them and delete them (veths go with them). Returns errors."""
    errors = []
    for namespace in namespaces:
        _kill_namespace_processes(namespace)
        result = _run(["ip", "netns", "del", namespace])
        if result.returncode != 0 and namespace in list_namespaces():
            errors.append(f"ip netns del {namespace}: {result.stderr.strip()}")
    return errors


def _stale_owner_alive(name: str, prefix: str) -> bool:
    match = re.fullmatch(re.escape(prefix) + r"(\d+)-(hub|n\d+)", name)
    if match is None:
        return False
    try:
        os.kill(int(match.group(1)), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(prefix: str, include_live: bool = False) -> List[str]:
    """Delete namespaces left by launchers that died (e.g. SIGKILL). Returns the names removed.

    Namespaces whose launcher pid is still alive belong to a concurrent run and are kept,
    unless include_live.
    """
    pattern = re.compile(re.escape(prefix) + r"\d+-(hub|n\d+)")
    stale = [
        name for name in list_namespaces()
        if pattern.fullmatch(name) and (include_live or not _stale_owner_alive(name, prefix))
    ]
    # Nodes first, hub last, so each veth disappears with the first end deleted.
    stale.sort(key=lambda name: name.endswith("-hub"))
    errors = delete_namespaces(stale)
    if errors:
        raise ClusterError("; ".join(errors))
    return stale


class _Terminated(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_terminated(signum, _frame):
    raise _Terminated(signum)


def _exit_code(returncode: int) -> int:
    # Shell convention for a child killed by a signal.
    return 128 - returncode if returncode < 0 else returncode


class EmulatedCluster:
    """Build the namespaces, run one command per rank, tear everything down.

    Use as a context manager, or call ``run_command`` which does all of it.
    """

    def __init__(self, spec: ClusterSpec, run_id: Optional[int] = None, log=None):
        self.spec = spec
        self.run_id = os.getpid() if run_id is None else run_id
        self.hub, self.nodes = namespace_names(spec.prefix, self.run_id, spec.num_nodes)
        self._log = log if log is not None else (lambda msg: print(f"[emulate_cluster] {msg}", file=sys.stderr, flush=True))
        self._created: List[str] = []
        # Filled as ranks start, so an interrupted launch still knows what to stop.
        self.procs: List[subprocess.Popen] = []

    # -- setup / teardown -------------------------------------------------------------------

    def setup(self) -> None:
        check_host(self.spec)
        for cmd in setup_commands(self.spec, self.run_id):
            result = _run(cmd)
            if cmd[:3] == ["ip", "netns", "add"] and result.returncode == 0:
                self._created.append(cmd[3])
            if result.returncode != 0:
                raise ClusterError(self._explain_failure(cmd, result.stderr.strip()))

    def _explain_failure(self, cmd: Sequence[str], stderr: str) -> str:
        text = f"command failed: {' '.join(cmd)}: {stderr}"
        if cmd[0] == "tc" and "unknown" in stderr.lower():
            kind = "netem" if "netem" in cmd else "tbf"
            hint = (" (latency needs sch_netem; use --inter-node-latency 0 --intra-node-latency 0 "
                    "on kernels without it)") if kind == "netem" else ""
            text += f"\nthe kernel cannot create the {kind} qdisc (module sch_{kind} missing?){hint}"
        return text

    def teardown(self) -> None:
        # Every planned name that exists, not only those recorded as created: a signal may land
        # between `ip netns add` and the bookkeeping. Nodes first, hub last.
        existing = set(list_namespaces()) | set(self._created)
        errors = delete_namespaces([name for name in self.nodes + [self.hub] if name in existing])
        self._created = []
        for error in errors:
            self._log(f"teardown: {error}")

    def __enter__(self):
        try:
            self.setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc):
        self.teardown()
        return False

    # -- ranks ------------------------------------------------------------------------------

    def launch(self, command: Sequence[str], base_env: Optional[Mapping[str, str]] = None) -> List[subprocess.Popen]:
        base_env = os.environ if base_env is None else base_env
        procs = self.procs
        for node, namespace in enumerate(self.nodes):
            for local_rank in range(self.spec.num_procs_per_node):
                env = rank_env(self.spec, node, local_rank, base_env)
                # Own session: Ctrl-C reaches only the launcher, which then stops every rank
                # (and its children) through the process group.
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", namespace] + list(command), env=env, start_new_session=True
                ))
        return procs

    @staticmethod
    def stop(procs: Sequence[subprocess.Popen], grace_s: float = 5.0) -> None:
        running = [proc for proc in procs if proc.poll() is None]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in running:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
            while running and time.monotonic() < deadline:
                running = [proc for proc in running if proc.poll() is None]
                time.sleep(0.02)
            if not running:
                return

    def wait(self, procs: Sequence[subprocess.Popen], timeout_s: Optional[float] = None) -> int:
        """0 when every rank exits 0; else the first failure's code, after stopping the rest."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            codes = [proc.poll() for proc in procs]
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                rank, code = failed[0]
                self._log(f"rank {rank} exited with {code}; stopping the other ranks")
                self.stop(procs)
                return _exit_code(code)
            if all(code == 0 for code in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                self._log(f"timeout after {timeout_s:g}s; stopping all ranks")
                self.stop(procs)
                return 124
            time.sleep(0.05)


def run_command(spec: ClusterSpec, command: Sequence[str], timeout_s: Optional[float] = None, log=None) -> int:
    """Set up, run `command` on every rank, tear down. Returns the launcher's exit code.

    SIGINT/SIGTERM/SIGHUP stop the ranks and tear down before returning 128+signal.
    """
    if not command:
        raise ValueError("no command given; put it after '--'")
    cluster = EmulatedCluster(spec, log=log)
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, _raise_terminated) for sig in handled}
    try:
        try:
            cluster.setup()
            cluster._log(f"up: {describe(spec)}; namespaces {cluster.hub}, {', '.join(cluster.nodes)}")
            cluster.launch(command)
            return cluster.wait(cluster.procs, timeout_s)
        except _Terminated as terminated:
            cluster._log(f"got {terminated}; stopping ranks and cleaning up")
            return 128 + terminated.signum
        except KeyboardInterrupt:
            return 128 + signal.SIGINT
        finally:
            # A second Ctrl-C must not leave namespaces behind: ignore signals while cleaning.
            for sig in handled:
                signal.signal(sig, signal.SIG_IGN)
            cluster.stop(cluster.procs)
            cluster.teardown()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
