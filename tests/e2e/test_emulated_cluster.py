"""tools/emulate_cluster.py: pure parsing/planning checks, then real runs (root + iproute2 only).

    .venv/bin/python -m pytest tests/e2e/test_emulated_cluster.py -q

Each real run uses its own namespace prefix, so the leftover checks see only that run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import emulate_cluster  # noqa: E402
from megatron_parm.emulator import cluster as ec  # noqa: E402

TOOL = REPO / "tools" / "emulate_cluster.py"
WORKER = Path(__file__).resolve().parent / "_allreduce_worker.py"

_MISSING = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
needs_netns = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0 or bool(_MISSING),
    reason="emulated cluster needs Linux, root and iproute2 (ip, tc)"
    + (f"; missing {_MISSING}" if _MISSING else "")
    + ("" if sys.platform.startswith("linux") and os.geteuid() == 0 else "; not root"),
)


# ---------------------------------------------------------------------------------------------
# Pure logic: no root needed.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, bits", [
    ("500mbit", 500_000_000), ("2gbit", 2_000_000_000), ("1.5Gbit", 1_500_000_000),
    ("64kbit", 64_000), ("none", None), ("unlimited", None),
])
def test_parse_rate(text, bits):
    assert ec.parse_rate(text, "--x") == bits


@pytest.mark.parametrize("text", ["fast", "500", "500mbps", "mbit", "-1gbit", "1bit"])
def test_parse_rate_rejects_and_names_flag(text):
    with pytest.raises(ValueError, match="--intra-node-bandwidth"):
        ec.parse_rate(text, "--intra-node-bandwidth")


@pytest.mark.parametrize("text, micros", [("50us", 50.0), ("1.5ms", 1500.0), ("0", 0.0), ("2s", 2e6)])
def test_parse_latency(text, micros):
    assert ec.parse_latency(text, "--x") == micros


def test_parse_latency_rejects_bare_number():
    with pytest.raises(ValueError, match="--inter-node-latency"):
        ec.parse_latency("50", "--inter-node-latency")


def test_presets_ratios_and_overrides():
    inter, intra = ec.resolve_shapes("pcie", None, None)
    assert intra.bits_per_s == 2 * inter.bits_per_s
    inter, intra = ec.resolve_shapes("nvlink", None, None)
    assert intra.bits_per_s == 12 * inter.bits_per_s
    default_inter, _ = ec.resolve_shapes(None, None, None)
    assert default_inter == ec.resolve_shapes(ec.DEFAULT_PRESET, None, None)[0]
    inter, intra = ec.resolve_shapes("nvlink", "100mbit", None, "20us")
    assert inter == ec.LinkShape(100_000_000, 20.0)
    assert intra.bits_per_s == ec.parse_rate(ec.PRESETS["nvlink"]["intra_node_bandwidth"], "x")


def _args(*argv):
    return emulate_cluster.build_parser().parse_args(list(argv))


def test_cli_bad_flag_value_exits_with_flag_name(capsys):
    with pytest.raises(SystemExit) as exit_info:
        emulate_cluster.main(["--inter-node-bandwidth", "fast", "--", "true"])
    assert exit_info.value.code == 2
    assert "--inter-node-bandwidth" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        emulate_cluster.main(["--nnodes", "0", "--", "true"])
    assert "--nnodes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        emulate_cluster.main(["--nnodes", "2"])  # no command
    assert "--" in capsys.readouterr().err


def test_cli_keeps_command_arguments():
    args = _args("--nnodes", "3", "--nproc-per-node", "2", "--preset", "nvlink", "--",
                 "python", "x.py", "--nnodes", "7")
    spec = emulate_cluster.spec_from_args(args)
    assert (spec.num_nodes, spec.num_procs_per_node, spec.world_size) == (3, 2, 6)
    assert args.command[1:] == ["python", "x.py", "--nnodes", "7"]


def test_rank_env_is_node_major():
    spec = emulate_cluster.spec_from_args(_args("--nnodes", "2", "--nproc-per-node", "3", "--", "x"))
    env = ec.rank_env(spec, node=1, local_rank=2, base_env={"PATH": "/bin", "OMP_NUM_THREADS": "4"})
    assert env["RANK"] == "5" and env["WORLD_SIZE"] == "6"
    assert env["LOCAL_RANK"] == "2" and env["LOCAL_WORLD_SIZE"] == "3"
    assert env["NODE_RANK"] == env["GROUP_RANK"] == "1" and env["GROUP_WORLD_SIZE"] == "2"
    assert env["MASTER_ADDR"] == ec.node_address(0) and env["MASTER_PORT"] == str(ec.DEFAULT_MASTER_PORT)
    assert env["GLOO_SOCKET_IFNAME"] == ec.NODE_IFNAME
    assert env["PATH"] == "/bin" and env["OMP_NUM_THREADS"] == "4"


def test_setup_plan_stays_in_own_namespaces():
    spec = emulate_cluster.spec_from_args(_args("--nnodes", "3", "--inter-node-latency", "10us", "--", "x"))
    hub, nodes = ec.namespace_names(spec.prefix, 1234, spec.num_nodes)
    ours = {hub, *nodes}
    commands = ec.setup_commands(spec, 1234)
    for cmd in commands:
        # Every command names one of our namespaces: nothing runs in the host's namespace.
        if cmd[:3] in (["ip", "netns", "add"], ["ip", "netns", "exec"]):
            assert cmd[3] in ours, cmd
        else:
            assert cmd[1] == "-n" and cmd[2] in ours, cmd
    text = [" ".join(cmd) for cmd in commands]
    for namespace in nodes:
        assert any(f"-n {namespace} link set lo mtu {spec.mtu}" in line for line in text)
        assert any(f"tc -n {namespace} qdisc add dev lo root handle 1: tbf" in line for line in text)
        assert any(f"tc -n {namespace} qdisc add dev eth0 root handle 1: netem delay 10us" in line for line in text)
    assert sum(f"tc -n {hub} qdisc add dev p" in line for line in text) == spec.num_nodes


def test_tbf_bucket_holds_a_packet():
    assert ec.DEFAULT_MTU == 65535  # jumbo frames by default
    for mtu in (1500, 9000, ec.DEFAULT_MTU):
        for bits in (64_000, 50_000_000, 10_000_000_000):
            params = ec.tbf_params(bits, mtu)
            burst, limit = int(params[params.index("burst") + 1]), int(params[params.index("limit") + 1])
            assert burst >= mtu + 64 and limit >= burst


def test_check_host_refuses_non_root(monkeypatch):
    spec = emulate_cluster.spec_from_args(_args("--", "x"))
    monkeypatch.setattr(ec.os, "geteuid", lambda: 1000)
    with pytest.raises(ec.ClusterError, match="root"):
        ec.check_host(spec)
    monkeypatch.setattr(ec.os, "geteuid", lambda: 0)
    monkeypatch.setattr(ec.shutil, "which", lambda tool: None if tool == "tc" else "/sbin/ip")
    with pytest.raises(ec.ClusterError, match="tc"):
        ec.check_host(spec)


# ---------------------------------------------------------------------------------------------
# Real runs.
# ---------------------------------------------------------------------------------------------


def _prefix() -> str:
    return "pt" + uuid.uuid4().hex[:8]


def _our_namespaces(prefix: str):
    return [name for name in ec.list_namespaces() if name.startswith(prefix)]


def _launch(prefix, out_dir, mode, *flags, worker_args=(), timeout=90):
    cmd = [sys.executable, str(TOOL), "--ns-prefix", prefix, "--nnodes", "2", "--nproc-per-node", "2",
           "--timeout", str(timeout - 30), *flags, "--", sys.executable, str(WORKER), mode, str(out_dir), *worker_args]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def _records(out_dir):
    return {record["rank"]: record for record in
            (json.loads(path.read_text()) for path in Path(out_dir).glob("rank*.json"))}


@needs_netns
def test_allreduce_and_pipeline_stages_across_two_nodes_and_cleanup(tmp_path):
    """An all-reduce over both nodes; then Megatron-Core's groups at pp=2, ep=2: a stage per
    node, the groups the performance model's Layout names (docs/design.md), and the p2p sends
    between stages on the inter-node link only, each stage-0 rank's bytes once."""
    from megatron_parm.perf_model.layout import Layout
    from megatron_parm.perf_model.step_time import pipeline_link

    num_bytes = 2 << 20
    prefix = _prefix()
    proc = _launch(prefix, tmp_path, "pipeline", worker_args=("--num-bytes", str(num_bytes)),
                   timeout=180)  # Megatron-Core's import, 4 ranks on a loaded machine
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = _records(tmp_path)
    assert sorted(records) == [0, 1, 2, 3]
    assert all(record["ok"] and record["p2p_ok"] for record in records.values())
    assert [(records[r]["node"], records[r]["local_rank"]) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    layout = Layout(tp=1, ep=2, etp=1, nodes=2, ranks_per_node=2, pp=2)
    for rank, record in records.items():
        assert record["stage"] == layout.stage_of(rank) == record["node"], record
        for name in ("tp", "ep", "dp", "expt_dp", "pp"):
            assert record["groups"][name] == layout.group_ranks(name, rank), (name, record)
        assert record["groups"]["embedding"] == layout.group_ranks("pp", rank)
    assert all(layout.is_intra(name) for name in ("tp", "ep", "dp", "expt_dp"))
    assert pipeline_link(layout) == "inter"
    # node 0's two stage-0 ranks sent their bytes out of eth0, nothing through lo; node 1 only
    # received (TCP acknowledgements)
    sent = {records[rank]["node"]: records[rank]["p2p_sent"] for rank in (0, 2)}
    assert 2 * num_bytes < sent[0]["eth0"] < 1.3 * 2 * num_bytes + (256 << 10), sent
    assert sent[0]["lo"] < (256 << 10) and sent[1]["eth0"] < (256 << 10), sent
    assert _our_namespaces(prefix) == []


@needs_netns
@pytest.mark.parametrize("mtu", [None, "1500"], ids=["default-mtu", "mtu-1500"])
def test_shaping_is_real_and_intra_node_uses_loopback(tmp_path, mtu):
    """The shaped rates hold at the default jumbo MTU as at Ethernet's."""
    num_bytes = 2 << 20
    inter_bits, intra_bits = 50_000_000, 1_000_000_000
    prefix = _prefix()
    proc = _launch(prefix, tmp_path, "transfer", "--inter-node-bandwidth", "50mbit",
                   "--intra-node-bandwidth", "1gbit", *(("--mtu", mtu) if mtu else ()),
                   worker_args=("--num-bytes", str(num_bytes)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    sender = _records(tmp_path)[0]
    expected_inter_s = num_bytes * 8 / inter_bits  # 0.34 s
    expected_intra_s = num_bytes * 8 / intra_bits  # 17 ms
    assert 0.5 * expected_inter_s < sender["inter_s"] < 3 * expected_inter_s + 1.0, sender
    assert 0.5 * expected_intra_s < sender["intra_s"] < sender["inter_s"] / 4, sender
    # On node 0, the send to rank 1 went through lo and the send to rank 2 through eth0, once each.
    sent = {dev: sender["tc_after"][dev] - sender["tc_before"].get(dev, 0) for dev in ("lo", "eth0")}
    for dev in ("lo", "eth0"):
        assert num_bytes < sent[dev] < 1.3 * num_bytes + (256 << 10), sent
    assert _our_namespaces(prefix) == []


@needs_netns
def test_failing_rank_stops_run_and_cleans_up(tmp_path):
    prefix = _prefix()
    start = time.monotonic()
    proc = _launch(prefix, tmp_path, "fail")
    assert proc.returncode == 3, proc.stderr[-4000:]
    assert "rank 1 exited with 3" in proc.stderr
    assert time.monotonic() - start < 45  # the blocked ranks were stopped, not waited for
    assert _our_namespaces(prefix) == []


@needs_netns
def test_sigint_tears_down():
    prefix = _prefix()
    launcher = subprocess.Popen([sys.executable, str(TOOL), "--ns-prefix", prefix, "--nnodes", "2",
                                 "--", "sleep", "60"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while len(_our_namespaces(prefix)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_our_namespaces(prefix)) == 3
        time.sleep(0.3)  # let the ranks start
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=20) == 128 + signal.SIGINT
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert _our_namespaces(prefix) == []


@needs_netns
def test_latency_uses_netem_or_refuses_clearly():
    prefix = _prefix()
    proc = subprocess.run([sys.executable, str(TOOL), "--ns-prefix", prefix, "--inter-node-latency", "50us",
                           "--", "true"], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:  # kernel without sch_netem
        assert proc.returncode == 1 and "netem" in proc.stderr, proc.stderr
    assert _our_namespaces(prefix) == []


@needs_netns
def test_cleanup_stale_keeps_live_runs():
    prefix = _prefix()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = f"{prefix}{dead.pid}-n0", f"{prefix}{os.getpid()}-hub"
    for name in (stale, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        proc = subprocess.run([sys.executable, str(TOOL), "--ns-prefix", prefix, "--cleanup-stale"],
                              capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        assert _our_namespaces(prefix) == [live]
    finally:
        for name in _our_namespaces(prefix):
            subprocess.run(["ip", "netns", "del", name])
