"""tools/gpu_check.sh and tools/gpu_check.py, dry-run on CPU.

What can be checked without a GPU: the wrapper's argument handling and wheel-install step
(a wheel built here, installed with pip --no-index --no-deps --target and importable by the
stages), its refusal without megatron-core, the Python tool's refusals, and every stage's
code on CPU (--allow-cpu --quick): stage a's pytest run and report, stage b's bf16/fp16
training with checkpoint save, load and resume, stage c's layer timing of every dispatcher,
stage d's sync counting (which counts nothing without CUDA, and says so), stage e's chunk
costs and profile, stage f's expert implementations with their targets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from launch import REPO

from megatron_parm import schedules

SCRIPT = str(REPO / "tools/gpu_check.sh")
TOOL = str(REPO / "tools/gpu_check.py")


def run(cmd, env=None, timeout=600):
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))


def wrapper(*args, **env):
    return run([SCRIPT, *map(str, args)], env=dict({"PYTHON": sys.executable}, **env))


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def test_wrapper_arguments():
    assert "OUT_DIR is required" in one_line(wrapper().stderr)
    assert wrapper().returncode == 2
    assert "must be OUT_DIR" in one_line(wrapper("--stages", "a").stderr)
    helped = wrapper("--help")
    assert helped.returncode == 0
    assert "pip download" in helped.stdout and "--python-version 3.12" in helped.stdout
    assert "--no-index --no-deps --target" in helped.stdout


def test_wrapper_refuses_bad_wheel_folders(tmp_path):
    proc = wrapper(tmp_path / "out", WHEELS=str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and "WHEELS=" in one_line(proc.stderr)
    (tmp_path / "empty").mkdir()
    proc = wrapper(tmp_path / "out", WHEELS=str(tmp_path / "empty"))
    assert proc.returncode == 2 and "no .whl" in one_line(proc.stderr)


def fake_wheel(folder: Path) -> Path:
    """A pure-Python wheel of a package `gpucheck_probe` (VALUE = 42), built by hand."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "gpucheck_probe-1.0-py3-none-any.whl"
    info = "gpucheck_probe-1.0.dist-info"
    files = {
        "gpucheck_probe/__init__.py": "VALUE = 42\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: gpucheck-probe\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
        archive.writestr(f"{info}/RECORD", record)
    return path


def test_wrapper_installs_wheels_for_the_stages(tmp_path):
    """The wheel goes in with pip --no-index --no-deps --target, and stage a's pytest imports it."""
    wheels = fake_wheel(tmp_path / "wheels").parent
    probe = tmp_path / "probe" / "test_probe.py"
    probe.parent.mkdir()
    probe.write_text("import gpucheck_probe\n\n\ndef test_probe():\n    assert gpucheck_probe.VALUE == 42\n")
    out = tmp_path / "out"
    proc = wrapper(out, "--allow-cpu", "--stages", "a", "--pytest-args", str(probe),
                   WHEELS=str(wheels))
    log = (out / "gpu_check.log").read_text()
    assert proc.returncode == 0, proc.stdout + proc.stderr + log
    assert "installing 1 wheel(s)" in log
    summary = json.loads((out / "summary.json").read_text())
    stage = summary["stages"]["a"]
    assert stage["status"] == "passed" and stage["tests"] == 1, stage
    assert summary["environment"]["megatron_core"].startswith("0.16")


def test_wrapper_without_megatron_core_says_how_to_get_it(tmp_path):
    bare = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "python3"
    if run([bare, "-c", "import megatron.core"]).returncode == 0:
        pytest.skip(f"{bare} has megatron-core")
    proc = run([SCRIPT, str(tmp_path / "out")], env={"PYTHON": bare})
    assert proc.returncode == 2
    assert "megatron-core is not importable" in one_line(proc.stderr) and "WHEELS=" in proc.stderr


def test_tool_refusals(tmp_path):
    from megatron_parm import device

    proc = run([sys.executable, TOOL, "--out", str(tmp_path), "--stages", "a,x"])
    assert proc.returncode == 2 and "--stages: unknown stage 'x'" in proc.stderr
    if not device.is_cuda():
        proc = run([sys.executable, TOOL, "--out", str(tmp_path)])
        assert proc.returncode == 2 and "no CUDA device" in one_line(proc.stderr)
        assert "--allow-cpu" in proc.stderr


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory, prepared_data):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = run([sys.executable, TOOL, "--out", str(out), "--allow-cpu", "--quick", "--stages",
                "b,c,d,e,f,h,i", "--budget", "1700"], timeout=1800)
    summary = json.loads((out / "summary.json").read_text())
    return proc, summary, out


def test_dry_run_passes_every_stage(dry_run):
    proc, summary, out = dry_run
    assert proc.returncode == 0, (proc.stdout, (out / "gpu_check.log").read_text()[-5000:])
    assert {stage: result["status"] for stage, result in summary["stages"].items()} == \
        {"b": "passed", "c": "passed", "d": "passed", "e": "passed", "f": "passed",
         "h": "passed", "i": "passed"}
    assert "stage b: passed" in (out / "gpu_check.log").read_text()


def test_dry_run_training_stage(dry_run):
    stage = dry_run[1]["stages"]["b"]
    assert all(stage["checks"].values()), stage["checks"]
    assert stage["eval_after_loading"] == pytest.approx(stage["eval_after_training"], rel=1e-3)
    assert stage["backend"] == "gloo" and stage["fp16_skipped_iterations"] >= 1


def test_dry_run_combined_1f1b_stage(dry_run):
    stage = dry_run[1]["stages"]["i"]
    assert all(stage["checks"].values()) and len(stage["checks"]) == 3, stage["checks"]
    assert stage["backend"] == "gloo"
    assert set(stage["losses"]) == {"parm", "parm_s1", "parm_s1_delay"}


def test_dry_run_modern_models_stage(dry_run):
    stage = dry_run[1]["stages"]["h"]
    assert all(stage["checks"].values()), stage["checks"]
    assert set(stage["losses"]) == {"qwen3_tiny_moe", "deepseek_v2_lite_tiny_moe", "v3_router",
                                    "shared_expert_overlap"}


def test_dry_run_layer_and_sync_stages(dry_run):
    layer, syncs = dry_run[1]["stages"]["c"], dry_run[1]["stages"]["d"]
    dispatchers = set(schedules.names())  # every schedule of the catalog
    assert set(layer["dispatchers"]) == dispatchers and layer["shape"]["dtype"] == "torch.bfloat16"
    assert layer["dispatchers"]["alltoall"]["alltoall_over_this"] == 1.0
    assert all(d["median_ms"] > 0 and d["max_abs_diff_vs_alltoall"] is not None
               for d in layer["dispatchers"].values())
    assert set(syncs["dispatchers"]) == dispatchers
    assert "no CUDA" in syncs["note"]  # on CPU nothing is counted, and the summary says so


def test_dry_run_chunk_stage(dry_run):
    """Stage e: S2 at each chunk count beside alltoall, the cost per extra chunk, a profile."""
    proc, summary, out = dry_run
    chunks = summary["stages"]["e"]
    assert {"alltoall", "parm_s1", "parm_s2@1", "parm_s2@8", "parm_s2@4/1"} <= set(chunks["variants"])
    assert all(v["median_ms"] > 0 for v in chunks["variants"].values())
    assert "per_extra_chunk_pct_of_one_chunk" in chunks["variants"]["parm_s2@4"]
    assert set(chunks["variants_by_local_experts"]) == {"4", "2"}
    assert all("per_extra_chunk_ms" in table["parm_s2@8"]
               for table in chunks["variants_by_local_experts"].values())
    profile = (out / chunks["profile"]).read_text()
    assert "== alltoall:" in profile and "== parm_s2@4:" in profile


def test_dry_run_expert_stage(dry_run):
    """Stage f: both layers, SequentialMLP and TorchGroupedMLP (the others only where their
    packages are), every variant's time, chunk cost and launches, the targets as data."""
    proc, summary, out = dry_run
    stage = summary["stages"]["f"]
    assert set(stage["layers"]) == {"gpt2_small_moe", "large"}
    variants = {"alltoall", "parm_s1", "parm_s2@1", "parm_s2@2", "parm_s2@4", "parm_s2@8"}
    for layer in stage["layers"].values():
        impls = layer["expert_impls"]
        assert {"SequentialMLP", "TorchGroupedMLP"} <= set(impls)
        assert set(impls) | set(layer["not_run"]) == {"SequentialMLP", "TorchGroupedMLP",
                                                        "GroupedMLP", "TEGroupedMLP"}
        assert layer["shape"]["dtype"] == "torch.bfloat16" and layer["shape"]["experts"] == 8
        for impl, table in impls.items():
            assert set(table) == variants and all(v["median_ms"] > 0 for v in table.values())
            assert all(isinstance(v["kernel_launches"], int) for v in table.values())
            for c in (2, 4, 8):
                assert {"per_extra_chunk_ms", "per_extra_chunk_pct_of_one_chunk",
                        "kernel_launches_per_extra_chunk"} <= set(table[f"parm_s2@{c}"])
        assert all(v["over_sequential"] > 0 for v in impls["TorchGroupedMLP"].values())
    # two targets per layer and grouped implementation, reported, not failing the stage
    targets = {(t["target"], t["layer"]): t for t in stage["targets"]
               if t["expert_impl"] == "TorchGroupedMLP"}
    assert set(targets) == {(target, layer) for target in ("per_extra_chunk_pct_max",
                                                          "time_over_sequential_max")
                            for layer in ("gpt2_small_moe", "large")}
    assert targets[("per_extra_chunk_pct_max", "large")]["limit"] == 3.0
    assert targets[("per_extra_chunk_pct_max", "gpt2_small_moe")]["limit"] == 10.0
    assert all(isinstance(t["met"], bool) for t in stage["targets"])
    assert "no CUDA" in stage["note"]
    log = (out / "gpu_check.log").read_text()
    assert "target per_extra_chunk_pct_max (large, TorchGroupedMLP)" in log
    profile = (out / stage["profile"]).read_text()
    assert "== large, TorchGroupedMLP, parm_s2@4:" in profile


def test_dry_run_calibration_stage(tmp_path):
    """Stage g on CPU (--quick): tools/calibrate.py at world size 1 with the estimate's
    collective terms writes a profile with every term, the chunk cost fitted by itself."""
    proc = run([sys.executable, TOOL, "--out", str(tmp_path), "--allow-cpu", "--quick",
                "--stages", "g", "--budget", "900"], timeout=1000)
    summary = json.loads((tmp_path / "summary.json").read_text())
    stage = summary["stages"]["g"]
    assert proc.returncode == 0 and stage["status"] == "passed", (
        stage, (tmp_path / "gpu_check.log").read_text()[-4000:])
    assert (tmp_path / "g_profile.yaml").is_file() and stage["provenance"] == "estimate"
    assert set(stage["terms"]) >= {"chunk_overhead", "chunk_expert_overhead",
                                   "microbatch_overhead", "layer_overhead"}
    assert all(value >= 0 for value in stage["terms"].values())
    assert stage["layer_fit"].startswith("layer fit: |error| median")
    log = (tmp_path / "g_calibrate.log").read_text()
    layers = [line for line in log.splitlines() if " experts " in line and "measured" in line]
    assert any(" grouped " in line for line in layers) and any(" seq " in line for line in layers)
    assert "framework terms: microbatch_overhead" in log
