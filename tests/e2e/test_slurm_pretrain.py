"""The GPT-2 MoE sbatch script on a real, one-machine Slurm (tools/slurm/local_slurm.sh).

Starts slurmctld + slurmd on localhost (installing Debian's Slurm packages if needed, as
root), submits pretrain_scripts/gpt2_moe.sbatch with the tiny config and 4 ranks (one srun
task running torchrun with 4 processes, gloo on CPU), waits for it, and checks that the job
completed, its log shows a falling loss, and the checkpoint exists. Slurm is stopped in a
finally. Skipped, with the reason, where Slurm is absent and cannot be installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HELPER = REPO / "tools/slurm/local_slurm.sh"
NUM_ITERS = 20


def slurm_unavailable_reason():
    if all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "sbatch")):
        return None
    if os.geteuid() != 0:
        return "Slurm is not installed and installing it needs root"
    if not shutil.which("apt-get"):
        return "Slurm is not installed and there is no apt-get to install it"
    return None


@pytest.fixture
def local_slurm(tmp_path):
    reason = slurm_unavailable_reason()
    if reason:
        pytest.skip(reason)
    env = dict(os.environ, SLURM_LOCAL_DIR=str(tmp_path / "slurm"), CPUS="4")
    start = subprocess.run(["bash", str(HELPER), "start"], env=env, capture_output=True,
                           text=True, timeout=600)
    if start.returncode != 0 and "installing it needs root" in start.stderr:
        pytest.skip(start.stderr.strip())
    try:
        assert start.returncode == 0, f"{start.stdout}\n{start.stderr}"
        env["SLURM_CONF"] = str(tmp_path / "slurm/slurm.conf")
        yield env
    finally:
        subprocess.run(["bash", str(HELPER), "stop"], env=env, capture_output=True, timeout=60)


def submit(env, tmp_path, *args) -> str:
    proc = subprocess.run(
        ["sbatch", "--parsable", "--cpus-per-task", "4", "--output", str(tmp_path / "%x-%j.out"),
         "pretrain_scripts/gpt2_moe.sbatch", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def wait_for_job(env, tmp_path, job_id, timeout=600) -> str:
    """Wait until the job leaves the queue; assert it COMPLETED; return its log."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        queued = subprocess.run(["squeue", "-h", "-j", job_id], env=env, capture_output=True,
                                text=True)
        if not queued.stdout.strip():
            break
        time.sleep(1)
    log_path = tmp_path / f"gpt2_moe-{job_id}.out"
    log = log_path.read_text() if log_path.exists() else "(no job log)"
    state = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True,
                           text=True).stdout
    assert "JobState=COMPLETED" in state, f"{state}\n{log[-5000:]}\n" + subprocess.run(
        ["bash", str(HELPER), "logs"], env=env, capture_output=True, text=True).stdout
    return log


def test_gpt2_moe_sbatch_on_local_slurm(local_slurm, tmp_path):
    env = dict(local_slurm, RUN_DIR=str(tmp_path / "run"), TP="2", EP="2")
    job_id = submit(env, tmp_path, "--train-iters", str(NUM_ITERS), "--log-interval", "5",
                    "--eval-iters", "1")
    log = wait_for_job(env, tmp_path, job_id)

    losses = [float(x) for x in re.findall(r"^ iteration .*?\| lm loss: (\S+) \|", log, re.M)]
    assert len(losses) == NUM_ITERS // 5, log[-3000:]
    assert losses[-1] < losses[0] - 0.5, losses
    assert "4 ranks (tp=2, ep=2" in log
    ckpt = tmp_path / "run/checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(NUM_ITERS)
    assert (ckpt / f"iter_{NUM_ITERS:07d}/metadata.json").is_file()


def test_requeued_job_resumes_from_its_latest_checkpoint(local_slurm, tmp_path):
    """scontrol requeue mid-run (as a preemption would): the job restarts under the same id,
    finds the checkpoints it wrote and continues from the latest one to the end."""
    run_dir = tmp_path / "run"
    env = dict(local_slurm, RUN_DIR=str(run_dir), TP="2", EP="2", SAVE_INTERVAL="5")
    job_id = submit(env, tmp_path, "--train-iters", "60", "--log-interval", "5",
                    "--eval-iters", "1", "--eval-interval", "1000")
    tracker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    deadline = time.time() + 300
    while not tracker.exists() and time.time() < deadline:
        time.sleep(0.5)
    assert tracker.exists(), "no checkpoint before the requeue"
    requeue = subprocess.run(["scontrol", "requeue", job_id], env=env, capture_output=True, text=True)
    assert requeue.returncode == 0, requeue.stderr
    log = wait_for_job(env, tmp_path, job_id)
    assert "(start 1)" in log and "(start 2)" in log, log[-3000:]
    resumed = re.findall(r"> loaded checkpoint .* at iteration (\d+)", log)
    assert resumed and int(resumed[-1]) >= 5, log[-3000:]
    assert (run_dir / "checkpoints" / "iter_0000060").is_dir()
    assert re.search(r"^ iteration +60/ +60 \|", log, re.M), log[-3000:]
