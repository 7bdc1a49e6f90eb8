"""The MoE-layer benchmark end to end on one tiny grid (4 ranks, plain loopback), at world
size 1 (timing and memory), and its report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from launch import REPO, torchrun
from megatron_parm import schedules

# Every schedule of the catalog that runs tp=ep=etp=2 ('all'), the chunked ones (parm_s2,
# parm_hier_s2) at two chunk counts instead of their default, and parm's two modes beside
# plain parm.
CHUNK_VARIANTS = (2, 4)
MODES = ["parm:model", "parm:measured"]


def expected_dispatchers(tp, ep, etp):
    names = [name for name in schedules.names()
             if schedules.get(name).unsupported(tp, ep, etp) is None]
    return sorted(MODES + [d for name in names for d in (
        [f"{name}@{c}" for c in CHUNK_VARIANTS] if schedules.get(name).chunked else [name])])


@pytest.fixture(scope="module")
def bench_output(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    grid = tmp / "tiny.yaml"
    grid.write_text(
        "fixed: {layout: '2,2,2', sequence_parallel: true, topk: 2, hidden_size: 32,\n"
        "        ffn_hidden_size: 64, micro_batch_size: 2, num_experts: 4}\n"
        "grid: {tokens_per_rank: [8, 16]}\n")
    out = tmp / "bench.jsonl"
    proc = torchrun("tools/bench_moe_layer.py", 4, "--grid", str(grid), "--output", str(out),
                    "--label", "loopback", "--run-id", "a", "--iters", "2", "--warmup", "0",
                    "--chunk-variants", "2,4", "--dispatchers", "all," + ",".join(MODES),
                    "--parm-tune-margin", "100", timeout=600)
    return tmp, out, proc.stdout


@pytest.fixture(scope="module")
def world1_output(tmp_path_factory):
    """World size 1: times, then peak memory (a --memory pass), same tiny layer."""
    tmp = tmp_path_factory.mktemp("world1")
    out = tmp / "world1.jsonl"
    flags = ["--seq-length", "32", "--hidden-size", "32", "--moe-ffn-hidden-size", "64",
             "--num-experts", "4", "--dispatchers", "alltoall,parm_s1,parm_s2@2,parm", "--no-check",
             "--output", str(out)]
    torchrun("tools/bench_moe_layer.py", 1, *flags, "--label", "world1", "--iters", "2", timeout=600)
    torchrun("tools/bench_moe_layer.py", 1, *flags, "--label", "memory", "--memory", timeout=600)
    return tmp, out


def test_bench_writes_a_line_per_config_and_dispatcher(bench_output):
    _, out, stdout = bench_output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["config"], r["dispatcher"]) for r in records) == sorted(
        (c, d) for c in (0, 1) for d in expected_dispatchers(2, 2, 2))
    for r in records:
        assert r["label"] == "loopback" and r["run"] == "a"
        assert len(r["times_ms"]) == 2 and r["median_ms"] > 0
        assert r["max_diff_vs_alltoall"] < 1e-5
        assert r["bytes"], f"{r['dispatcher']} recorded no bytes"
        # per rank: what the four ranks sent, summing to the totals
        assert len(r["rank_bytes"]) == 4
        assert sum(b["intra"] for b in r["rank_bytes"]) == sum(v["intra"] for v in r["bytes"].values())
        assert (r["tp"], r["ep"], r["etp"], r["seq_length"]) == (2, 2, 2, 8 * (r["config"] + 1))
    assert "[2/2] MoE layer" in stdout and "parm_s2@4" in stdout
    choices = {r["dispatcher"]: r["choice"] for r in records if r["config"] == 1}
    assert all(choices[d] for d in ["parm"] + MODES)  # each mode logs the schedule it chose
    # parm measured its candidates (every one within --parm-tune-margin 100) before its timed
    # calls, which are its choice's: its line says measured, not the model's prediction
    lines = [line for line in stdout.splitlines()
             if line.startswith(("parm chose ", "parm:measured chose "))]
    assert len(lines) == 4 and all(" (measured, median of " in line for line in lines), stdout
    for r in records:  # parm's bytes are its choice's (its tuning calls are not accounted)
        if r["dispatcher"] in ["parm"] + MODES:
            chosen = r["choice"].split("(")[0]
            same = [o for o in records if o["config"] == r["config"]
                    and o["dispatcher"].split("@")[0] == chosen]
            assert same and r["bytes"] == same[0]["bytes"], (r["dispatcher"], r["choice"])


def test_world_size_1_runs_parm_as_s1_without_communication(world1_output):
    _, out = world1_output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    timed = {r["dispatcher"]: r for r in records if r["label"] == "world1"}
    assert set(timed) == {"alltoall", "parm_s1", "parm_s2@2", "parm"}
    assert timed["parm"]["choice"] == "parm_s1"  # nothing to hide: no model, no other ranks
    assert all(v["intra"] == v["inter"] == 0 for r in timed.values() for v in r["bytes"].values())
    memory = {r["dispatcher"]: r for r in records if r["label"] == "memory"}
    assert set(memory) == set(timed) and all(not r["times_ms"] for r in memory.values())
    if sys.platform.startswith("linux"):
        for r in memory.values():
            assert r["memory_kind"] == "cpu_resident" and r["peak_bytes"] > r["step_peak_bytes"] > 0


def test_expert_implementations_side_by_side(tmp_path):
    """--expert-impls: both implementations timed in one run, same weights (outputs equal to
    alltoall with SequentialMLP), each JSON line naming its experts; the report compares them."""
    out = tmp_path / "experts.jsonl"
    torchrun("tools/bench_moe_layer.py", 1, "--seq-length", "32", "--hidden-size", "32",
             "--moe-ffn-hidden-size", "64", "--num-experts", "4", "--dispatchers",
             "alltoall,parm_s2@2", "--expert-impls", "SequentialMLP,TorchGroupedMLP", "--iters", "2",
             "--warmup", "0", "--label", "experts", "--output", str(out), timeout=600)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["expert_impl"], r["dispatcher"]) for r in records) == [
        (impl, d) for impl in ("SequentialMLP", "TorchGroupedMLP") for d in ("alltoall", "parm_s2@2")]
    assert all(r["dtype"] == "fp32" and r["median_ms"] > 0 for r in records)
    assert all(r["max_diff_vs_alltoall"] < 1e-5 for r in records)
    summary = tmp_path / "summary.json"
    subprocess.run([sys.executable, "tools/bench_report.py", str(out), "--summary", str(summary)],
                   cwd=REPO, check=True, capture_output=True)
    compared = json.loads(summary.read_text())["experts"]["time_vs_sequential_experts"]
    assert set(compared) == {"TorchGroupedMLP"} and set(compared["TorchGroupedMLP"]) == {
        "alltoall", "parm_s2@2"}


def test_moe_grouped_gemm_flag_picks_the_grouped_experts():
    """--moe-grouped-gemm: Megatron-LM's meaning where its packages are there, else
    TorchGroupedMLP; refused with --expert-impls (one line naming both flags)."""
    proc = subprocess.run([sys.executable, "-c", (
        "import sys; sys.path.insert(0, 'tools'); import bench_moe_layer as b;"
        "from megatron_parm.training.implementation import expert_implementation as e;"
        "from megatron_parm import device;"
        "spec = b.spec_from_args(b.parse_args(['--moe-grouped-gemm', '--bf16']));"
        "assert spec.expert_impl == e('local', True, cuda=device.is_cuda(), bf16=True), spec;"
        "assert b.spec_from_args(b.parse_args([])).expert_impl == 'SequentialMLP';"
        "b.parse_args(['--moe-grouped-gemm', '--expert-impls', 'all'])")],
        cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "--moe-grouped-gemm and --expert-impls: give one of them" in proc.stderr


def test_report_makes_tables_summary_and_plot(bench_output, world1_output):
    tmp, out, _ = bench_output
    _, world1 = world1_output
    md, png, summary = tmp / "table.md", tmp / "plot.png", tmp / "summary.json"
    subprocess.run([sys.executable, "tools/bench_report.py", str(out), str(world1), "--markdown",
                    str(md), "--plot", str(png), "--summary", str(summary)], cwd=REPO, check=True,
                   capture_output=True)
    text = md.read_text()
    assert text.count("\n| loopback |") == 2 and text.count("\n| world1 |") == 1
    assert "parm_s2@4 ms" in text and "Peak memory per rank" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(summary.read_text())
    loopback = data["loopback"]
    assert loopback["configs"] == 2 and loopback["inter_bytes_within_targets"] is True
    assert loopback["median_best_parm_vs_ds_baseline"] > 0
    assert [t["target"] for t in data["world1"]["targets"]] == ["world_size_1_time_vs_alltoall_max"]
    assert [t["target"] for t in data["memory"]["targets"]] == ["parm_memory_vs_alltoall_max"]


def test_bad_grid_is_refused(tmp_path):
    grid = tmp_path / "bad.yaml"
    grid.write_text("grid: {sequence_length: [16]}\n")
    proc = subprocess.run([sys.executable, "-c", (
        "import sys; sys.path.insert(0, 'tools'); import bench_moe_layer as b;"
        f"args = b.parse_args(['--grid', '{grid}']);"
        "[b.spec_from_args(args, **c) for c in b.load_grid(args.grid)]")],
        cwd=REPO, capture_output=True, text=True)
    assert proc.returncode != 0 and "--grid: unknown field 'sequence_length'" in proc.stderr


# ---------------------------------------------------------------------------------------------
# The end-to-end benchmark (tools/bench_e2e.py): one launch of its smoke on plain loopback
# ---------------------------------------------------------------------------------------------

# bf16 and 2 micro-batches per iteration: what Megatron-Core's combined 1F1B
# (--overlap-moe-expert-parallel-comm) needs to overlap anything; every dispatcher runs with
# it and without.
E2E_SMOKE = ("models: [gpt2_tiny_moe]\npresets: [loopback]\nlayouts: ['2,2,2']\n"
             "dispatchers: [alltoall, parm_s1, parm]\nwarmup: 1\niterations: 2\npasses: 1\n"
             "micro_batches: 2\n"
             "training_flags: [--overlap-grad-reduce, --ddp-bucket-size, '20000', --bf16]\n"
             "variants: [{name: base, flags: []}, "
             "{name: overlap, flags: [--overlap-moe-expert-parallel-comm]}]\n")
E2E_FLAGS = ["--overlap-grad-reduce", "--ddp-bucket-size", "20000", "--bf16"]


def bench_e2e(*args):
    return subprocess.run([sys.executable, "tools/bench_e2e.py", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)


def test_e2e_benchmark_smoke_runs_reports_and_resumes(tmp_path, prepared_data):
    config, out = tmp_path / "e2e.yaml", tmp_path / "out"
    config.write_text(E2E_SMOKE)
    proc = bench_e2e("--config", config, "--output", out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # a dispatcher's variants one after the other, which one first alternating
    order = [("alltoall", "base"), ("alltoall", "overlap"), ("parm_s1", "overlap"),
             ("parm_s1", "base"), ("parm", "base"), ("parm", "overlap")]
    assert ("1/1 pass1_gpt2_tiny_moe_loopback_222: "
            + ", ".join(f"{d} [{v}]" for d, v in order)) in proc.stdout
    records = [json.loads(line) for line in (out / "e2e.jsonl").read_text().splitlines()]
    assert [(r["dispatcher"], r["variant"]) for r in records] == order
    # the config's training flags went into every run, a variant's into its runs
    for r in records:
        assert r["training_flags"] == E2E_FLAGS and r["dtype"] == "bf16"
        assert r["variant_flags"] == (["--overlap-moe-expert-parallel-comm"]
                                      if r["variant"] == "overlap" else [])
        # 2 micro-batches of 2 sequences of 64 tokens per data-parallel rank (DP 2)
        assert r["micro_batches"] == 2 and r["tokens_per_iteration"] == 2 * 2 * 64 * 2
        # parm measured its candidates first: more iterations, the tuning ones marked
        assert len(r["iterations"]) == len(r["losses"]) >= 3
        assert any(it["tuning"] for it in r["iterations"]) == (r["dispatcher"] == "parm")
        assert all(("comm_stream" in it) == (r["variant"] == "overlap") for it in r["iterations"])
        # what was busy (Linux): the host's cores, and bytes the loopback sent
        assert all(0 <= it["host_cpu_busy"] <= 1 and it["net_tx_bytes"]["loopback"] > 0
                   for it in r["iterations"])
    summary = json.loads((out / "e2e_summary.json").read_text())
    assert summary["losses_equal"] is True
    rows = {(r["dispatcher"], r["variant"]): r for r in summary["rows"]}
    assert set(rows) == set(order)
    for (dispatcher, variant), row in rows.items():
        assert row["tokens_per_s"] > 0 and row["timed"] >= 2 and row["max_loss_diff"] <= 1e-4
        assert row["breakdown_ms"]["moe_experts"] > 0 and row["breakdown_ms"]["tp_sp"] > 0
        assert set(row["busy"]) == {"cpu"}  # loopback: no link rates
        if variant == "overlap":  # the communication nodes ran on their thread
            assert set(row["comm_stream"]) == {"moe_dispatch forward", "moe_combine forward",
                                               "moe_combine backward", "moe_dispatch backward"}
            assert all(s["busy_ms"] > 0 for s in row["comm_stream"].values())
            assert row["breakdown_ms"]["moe_comm_wait"] > 0
        else:
            assert row["comm_stream"] == {} and row["breakdown_ms"]["moe_comm_wait"] == 0
    assert rows[("parm", "base")]["choices"] and rows[("parm", "overlap")]["choices"]
    assert rows[("alltoall", "overlap")]["vs"]["alltoall"] == 1.0
    table = (out / "e2e_table.md").read_text()
    assert "| gpt2_tiny_moe | loopback | (2,2,2) | parm_s1 | overlap |" in table
    assert "| gpt2_tiny_moe | loopback | (2,2,2) | parm_s1 | base |" in table
    assert "| comm wait |" in table and "| dispatch fwd | combine fwd | combine bwd |" in table
    assert "% hidden) |" in table and "| step | CPU busy |" in table
    for goal in ("best Parm [overlap] >= 1.3x alltoall [base], gpt2_tiny_moe loopback (2,2,2)",
                 "best Parm [overlap] >= 1.15x alltoall [overlap], gpt2_tiny_moe loopback"):
        assert f"- {goal}" in table
    assert (out / "e2e_tokens.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a second run finds every run in its output: nothing launched, the same report
    again = bench_e2e("--config", config, "--output", out)
    assert again.returncode == 0 and "pass1_gpt2" not in again.stdout, again.stderr[-2000:]
    assert len((out / "e2e.jsonl").read_text().splitlines()) == 6


@pytest.mark.parametrize("line, message", [
    ("dispatchers: [alltoall, parm_s3]", "unknown dispatcher 'parm_s3'"),
    ("models: [gpt3_moe]", "unknown model 'gpt3_moe'"),
    ("presets: [infiniband]", "unknown preset 'infiniband'"),
    ("training_flags: [--overlap-grad-reducee]", "training_flags: unknown flag "
     "'--overlap-grad-reducee'"),
    ("training_flags: [--train-iters, '9']", "--train-iters is set by the benchmark itself"),
    # an overlap flag Megatron-Core cannot run without its companions: which one to drop
    ("training_flags: [--overlap-param-gather]", "training_flags with gpt2_tiny_moe (2,2,2) and "
     "alltoall: --overlap-param-gather needs --use-distributed-optimizer"),
    # a variant's flag the trainer refuses with the config's other flags
    ("training_flags: []", "variant overlap with gpt2_tiny_moe (2,2,2) and alltoall: "
     "--overlap-moe-expert-parallel-comm needs --bf16 or --fp16"),
])
def test_e2e_config_naming_something_unknown_is_one_line(tmp_path, line, message):
    key = line.split(":")[0]
    text = "\n".join(l for l in E2E_SMOKE.splitlines() if not l.startswith(key + ":"))
    config = tmp_path / "bad.yaml"
    config.write_text(f"{text}\n{line}\n")
    proc = bench_e2e("--config", config, "--output", tmp_path / "out")
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("lines, message", [
    (["micro_batches: 1"], "variants[1] (overlap): --overlap-moe-expert-parallel-comm overlaps "
     "one micro-batch's communication with another's compute: set micro_batches to 2 or more"),
    (["variants: [{name: a, flags: [--bf17]}]"], "variant a: unknown flag '--bf17'"),
    (["variants: [{name: a, flags: [--micro-batch-size, '4']}]"],
     "variant a: --micro-batch-size is set by the benchmark itself"),
    (["variants: [{name: a, flags: []}, {name: a, flags: [--bf16]}]"],
     "variants[1]: name 'a' is given twice"),
    (["variants: [{name: '', flags: []}, {name: b, flags: []}]"],
     "variants[0]: name '' is not a word (letters, digits, '_', '-'); variants need names"),
    (["variants: [{name: a, flag: []}]"], "variants[0] must be {name: NAME, flags: [FLAG, ...]}"),
    (["variants: [{name: base, flags: []}, {name: 1f1b, flags: [--delay-wgrad-compute]}]"],
     "variant 1f1b with gpt2_tiny_moe (2,2,2) and alltoall: --delay-wgrad-compute needs "
     "--overlap-moe-expert-parallel-comm"),
])
def test_e2e_config_variants_are_checked(tmp_path, lines, message):
    """The variants and micro_batches fields, checked in this process (the exit status and
    one line of a refused config: the test above)."""
    from megatron_parm.bench import e2e

    keys = [line.split(":")[0] for line in lines]
    text = "\n".join(l for l in E2E_SMOKE.splitlines() if l.split(":")[0] not in keys)
    config = tmp_path / "bad.yaml"
    config.write_text(text + "\n" + "\n".join(lines) + "\n")
    with pytest.raises(ValueError) as error:
        e2e.load_config(str(config))
    assert str(error.value).startswith(f"--config: {config}: ") and message in str(error.value)


def test_the_predicted_tables_in_benchmark_md_are_the_tools_output():
    """docs/benchmark.md's predicted end-to-end tables are what tools/predict_e2e.py writes now:
    the dgx table whole, the clusters table's rows of one model, cluster kind and size (each
    row is planned alone; the whole table takes half an hour). Regenerate both with --update
    docs/benchmark.md after a model or profile change."""
    doc = (REPO / "docs/benchmark.md").read_text()

    def predicted(*flags):
        proc = subprocess.run([sys.executable, "tools/predict_e2e.py", *flags], cwd=REPO,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout

    def block(table):
        begin, end = (f"<!-- predict_e2e{table}: begin -->\n", f"<!-- predict_e2e{table}: end -->")
        return doc[doc.index(begin) + len(begin):doc.index(end)]

    dgx = predicted("--table", "dgx")
    assert block("") == dgx
    assert "| GPT-2-medium-MoE | 4 x 8 | TP=ETP 4, EP 8 |" in dgx
    rows = [line for line in predicted("--table", "clusters", "--models", "Qwen3-30B-A3B",
                                       "--clusters", "h100_roce", "--nnodes", "2").splitlines()
            if line.startswith("| Qwen3-30B-A3B | h100_roce | 2 x 8 |")]
    assert len(rows) == 2 and all(f"{row}\n" in block(" clusters") for row in rows), rows
