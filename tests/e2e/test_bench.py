"""The MoE-layer benchmark end to end on one tiny grid (4 ranks, plain loopback), and its report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from launch import REPO, torchrun

DISPATCHERS = ["alltoall", "allgather", "ds_baseline", "parm_s1", "parm_s2", "parm"]


@pytest.fixture(scope="module")
def bench_output(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    grid = tmp / "tiny.yaml"
    grid.write_text(
        "fixed: {tp: 2, ep: 2, etp: 2, sequence_parallel: true, topk: 2, hidden_size: 32,\n"
        "        ffn_hidden_size: 64, micro_batch_size: 2, num_experts: 4}\n"
        "grid: {seq_length: [16, 32]}\n")
    out = tmp / "bench.jsonl"
    proc = torchrun("tools/bench_moe_layer.py", 4, "--grid", str(grid), "--output", str(out),
                    "--label", "loopback", "--iters", "2", "--warmup", "0",
                    "--dispatchers", ",".join(DISPATCHERS), timeout=600)
    return tmp, out, proc.stdout


def test_bench_writes_a_line_per_config_and_dispatcher(bench_output):
    _, out, stdout = bench_output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["config"], r["dispatcher"]) for r in records) == sorted(
        (c, d) for c in (0, 1) for d in DISPATCHERS)
    for r in records:
        assert r["label"] == "loopback" and len(r["times_ms"]) == 2 and r["median_ms"] > 0
        assert r["max_diff_vs_alltoall"] < 1e-5
        assert r["bytes"], f"{r['dispatcher']} recorded no bytes"
    assert "[2/2] MoE layer" in stdout and "parm_s2" in stdout


def test_report_makes_table_summary_and_plot(bench_output):
    tmp, out, _ = bench_output
    md, png, summary = tmp / "table.md", tmp / "plot.png", tmp / "summary.json"
    subprocess.run([sys.executable, "tools/bench_report.py", str(out), "--markdown", str(md),
                    "--plot", str(png), "--summary", str(summary)], cwd=REPO, check=True,
                   capture_output=True)
    assert md.read_text().count("\n| loopback |") == 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(summary.read_text())["loopback"]
    assert data["configs"] == 2 and data["inter_bytes_within_targets"] is True
    assert data["median_best_parm_vs_ds_baseline"] > 0


def test_bad_grid_is_refused(tmp_path):
    grid = tmp_path / "bad.yaml"
    grid.write_text("grid: {sequence_length: [16]}\n")
    proc = subprocess.run([sys.executable, "-c", (
        "import sys; sys.path.insert(0, 'tools'); import bench_moe_layer as b;"
        f"args = b.parse_args(['--grid', '{grid}']);"
        "[b.spec_from_args(args, **c) for c in b.load_grid(args.grid)]")],
        cwd=REPO, capture_output=True, text=True)
    assert proc.returncode != 0 and "--grid: unknown field 'sequence_length'" in proc.stderr
