"""The GPT-2 MoE sbatch script on a real, one-machine Slurm (tools/slurm/local_slurm.sh).

Starts slurmctld + slurmd on localhost (installing Debian's Slurm packages if needed, as
root), submits pretrain_scripts/gpt2_moe.sbatch with the tiny config and 4 ranks (one srun
task running torchrun with 4 processes, gloo on CPU), waits for it, and checks that the job
completed, its log shows a falling loss, and the checkpoint exists. Slurm is stopped in a
finally. Skipped, with the reason, where Slurm is absent and cannot be installed.

Faults (docs/faults.md): a rank of the running job step is killed with SIGKILL; the batch
script requeues the job, whose next start resumes from the last complete checkpoint and prints
the same losses for the iterations it runs again. The requeue's bound (MAX_REQUEUES) and its
user error run the sbatch script without Slurm, with stand-ins for srun and scontrol.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from launch import process_environ

REPO = Path(__file__).resolve().parents[2]
HELPER = REPO / "tools/slurm/local_slurm.sh"
NUM_ITERS = 20
LAUNCH_DIR_ENV = "MEGATRON_PARM_LAUNCH_DIR"  # megatron_parm.faults: where ranks note progress


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
    finds the checkpoints it wrote and continues from the latest one to the end. Pipelined
    (PP=2: a layer per stage, ep=2 in each), so the pipeline flags and a pipelined resume
    pass through the sbatch script too; with the distributed optimizer (dp = 2 per stage), whose
    sharded state the preempted job saves and the requeued one loads."""
    run_dir = tmp_path / "run"
    env = dict(local_slurm, RUN_DIR=str(run_dir), TP="1", EP="2", PP="2", SAVE_INTERVAL="5")
    job_id = submit(env, tmp_path, "--train-iters", "60", "--log-interval", "5",
                    "--eval-iters", "1", "--eval-interval", "1000", "--use-distributed-optimizer")
    tracker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    deadline = time.time() + 300
    while not tracker.exists() and time.time() < deadline:
        time.sleep(0.5)
    assert tracker.exists(), "no checkpoint before the requeue"
    requeue = subprocess.run(["scontrol", "requeue", job_id], env=env, capture_output=True, text=True)
    assert requeue.returncode == 0, requeue.stderr
    log = wait_for_job(env, tmp_path, job_id)
    assert "(start 1)" in log and "(start 2)" in log, log[-3000:]
    assert "tp=1 ep=2 pp=2, dispatcher" in log and "pp=2, dp=2" in log, log[-3000:]
    resumed = re.findall(r"> loaded \w+ checkpoint .* at iteration (\d+)", log)
    assert resumed and int(resumed[-1]) >= 5, log[-3000:]
    assert (run_dir / "checkpoints" / "iter_0000060").is_dir()
    assert re.search(r"^ iteration +60/ +60 \|", log, re.M), log[-3000:]


def rank_progress(job_id: str, rank: int):
    """What RANK of the job's running step last noted (megatron_parm.faults.record_progress:
    its pid, iteration, phase), found through the launcher's folder in a rank's environment."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        env = process_environ(int(entry))
        if env.get("SLURM_JOB_ID") == job_id and env.get("RANK") == str(rank) \
                and LAUNCH_DIR_ENV in env:
            try:
                return json.loads(Path(env[LAUNCH_DIR_ENV], "progress", f"rank{rank}.json").read_text())
            except (OSError, ValueError):
                return None
    return None


def printed_losses(log: str) -> dict:
    """{iteration: lm loss}; an iteration printed again (after the resume) must agree."""
    found = {}
    for iteration, loss in re.findall(r"^ iteration +(\d+)/ *\d+ \|.*?\| lm loss: (\S+) \|", log, re.M):
        assert found.setdefault(int(iteration), loss) == loss, (iteration, found[int(iteration)], loss)
    return found


def test_job_requeued_after_a_rank_dies_resumes_with_the_same_losses(local_slurm, tmp_path):
    """SIGKILL to rank 1 of the job step after the iteration-5 checkpoint; the batch script
    requeues the job (the launcher's line names the checkpoint), the second start loads it and
    runs iterations 6.. again with the losses the first start printed, then to the end."""
    run_dir, train_iters = tmp_path / "run", 15
    # parm_s2, not parm: parm's measured choice per layer may differ after a resume (its cache
    # keeps one choice per layer shape), and schedules agree to rounding, not bit for bit.
    env = dict(local_slurm, RUN_DIR=str(run_dir), TP="2", EP="2", SAVE_INTERVAL="5",
               DISPATCHER="parm_s2")
    job_id = submit(env, tmp_path, "--train-iters", str(train_iters), "--log-interval", "1",
                    "--eval-iters", "0")
    killed = None
    deadline = time.time() + 300
    while killed is None and time.time() < deadline:
        progress = rank_progress(job_id, rank=1)
        # iteration 8 in progress: the checkpoint of 5 is complete, 6 and 7 printed.
        if progress and progress["phase"] == "training" and (progress["iteration"] or 0) >= 8:
            os.kill(progress["pid"], signal.SIGKILL)
            killed = progress
        time.sleep(0.05)
    assert killed, f"rank 1 never reached iteration 8: {rank_progress(job_id, 1)}"
    log = wait_for_job(env, tmp_path, job_id)

    first, _, second = log.partition("(start 2)")
    assert second, log[-4000:]
    line = re.search(r"^launch: rank 1 \(host .*was killed by SIGKILL at iteration (\d+) .*"
                     r"last complete checkpoint: iteration (\d+) in (\S+);", first, re.M)
    assert line, first[-4000:]
    assert int(line.group(1)) == killed["iteration"], (line.group(0), killed)
    checkpoint = int(line.group(2))
    assert checkpoint in (5, 10) and checkpoint < killed["iteration"], line.group(0)
    assert line.group(3) == str(run_dir / "checkpoints"), line.group(0)
    assert "requeued after a fault (1 of MAX_REQUEUES=3)" in first, first[-3000:]
    assert "Traceback" not in log, log[-6000:]
    assert len((run_dir / "requeues.log").read_text().splitlines()) == 1

    loaded = re.findall(r"> loaded \w+ checkpoint .* at iteration (\d+)", second)
    assert loaded == [str(checkpoint)], second[-3000:]
    before, after = printed_losses(first), printed_losses(second)
    rerun = sorted(set(before) & set(after))
    assert rerun and rerun[0] == checkpoint + 1, (before, after)
    assert {i: after[i] for i in rerun} == {i: before[i] for i in rerun}
    assert sorted(after) == list(range(checkpoint + 1, train_iters + 1)), after
    state = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True,
                           text=True).stdout
    assert "Restarts=1" in state, state
    assert (run_dir / "checkpoints/latest_checkpointed_iteration.txt").read_text().strip() \
        == str(train_iters)


# ---------------------------------------------------------------------------------------------
# the requeue's bound and its user error: the sbatch script alone, srun and scontrol stood in
# ---------------------------------------------------------------------------------------------

def run_batch_script(tmp_path, srun_status: int, script="gpt2_moe.sbatch", **env):
    """Run SCRIPT (pretrain_scripts/) as Slurm would (job 42, start 1), with an srun that
    notes its arguments in tmp_path/srun.calls and exits SRUN_STATUS and an scontrol that notes
    its arguments; returns (result, scontrol's calls)."""
    stubs = tmp_path / "bin"
    stubs.mkdir(parents=True, exist_ok=True)
    calls = tmp_path / "scontrol.calls"
    (stubs / "srun").write_text(
        f'#!/bin/sh\necho "$*" >> {tmp_path / "srun.calls"}\nexit {srun_status}\n')
    (stubs / "scontrol").write_text(
        f'#!/bin/sh\necho "$*" >> {calls}\n[ "$1" = show ] && echo localhost\nexit 0\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    job_env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}", SLURM_JOB_ID="42",
                   SLURM_JOB_NAME="gpt2_moe", SLURM_JOB_NODELIST="localhost", SLURM_NNODES="1",
                   SLURM_CPUS_PER_TASK="4", SLURM_SUBMIT_DIR=str(REPO),
                   RUN_DIR=str(tmp_path / "run"))
    job_env.update(env)
    result = subprocess.run(["bash", f"pretrain_scripts/{script}", "--train-iters", "9"],
                            cwd=REPO, env=job_env, capture_output=True, text=True, timeout=120)
    requeues = [c for c in calls.read_text().splitlines() if c.startswith("requeue")] \
        if calls.exists() else []
    return result, requeues


def test_fault_requeues_are_bounded_by_max_requeues(tmp_path, prepared_data):
    for start in (1, 2):  # MAX_REQUEUES=2: the first two faults requeue
        result, requeues = run_batch_script(tmp_path, 137, MAX_REQUEUES="2")
        assert result.returncode == 0 and requeues == ["requeue 42"] * start, result
        assert f"requeued after a fault ({start} of MAX_REQUEUES=2)" in result.stdout
    result, requeues = run_batch_script(tmp_path, 137, MAX_REQUEUES="2")
    assert result.returncode == 137 and len(requeues) == 2, result
    assert result.stderr.strip().endswith(
        "job 42: the training failed (exit status 137); not requeueing: requeued 2 times "
        f"already (MAX_REQUEUES=2); resume with: RUN_DIR={tmp_path / 'run'} "
        "sbatch pretrain_scripts/gpt2_moe.sbatch --train-iters 9"), result.stderr
    # Another job in the same run folder has its own count; a user's mistake is not requeued.
    result, requeues = run_batch_script(tmp_path, 137, MAX_REQUEUES="2", SLURM_JOB_ID="43")
    assert result.returncode == 0 and requeues[-1] == "requeue 43", result
    for status in (0, 2):
        result, requeues = run_batch_script(tmp_path / f"status{status}", status)
        assert result.returncode == status and requeues == [], result
        assert "requeued after a fault" not in result.stdout, result


@pytest.mark.parametrize("value", ["-1", "three", "1.5"])
def test_invalid_max_requeues_is_one_line(tmp_path, value):
    result, requeues = run_batch_script(tmp_path, 137, MAX_REQUEUES=value)
    assert result.returncode == 2 and requeues == [] and result.stdout == "", result
    assert result.stderr == ("error: MAX_REQUEUES must be a whole number of requeues (0 or more), "
                             f"got '{value}'\n"), result.stderr


def test_layout_environment_becomes_megatrons_flags(tmp_path, prepared_data):
    """TP, EP, PP and VPP of either sbatch script reach the training script as Megatron-LM's
    flags (sequence parallelism only with TP > 1); a size that is no whole number is one line."""
    for script in ("gpt2_moe.sbatch", "bert_moe.sbatch"):
        folder = tmp_path / script
        result, _ = run_batch_script(folder, 0, script=script, TP="1", EP="2", PP="2", VPP="2")
        assert result.returncode == 0, result.stderr
        srun = (folder / "srun.calls").read_text()
        assert ("--tensor-model-parallel-size 1 --expert-model-parallel-size 2 "
                "--pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2") \
            in srun and "--sequence-parallel" not in srun, srun
        assert "tp=1 ep=2 pp=2 x 2 virtual" in result.stdout
        assert "pretrain_" + script.split("_")[0] in srun
    # the defaults: 4 ranks, no pipeline: tp=2 ep=2 pp=1; PP=2 leaves tp=2 ep=1 in a stage of 2
    result, _ = run_batch_script(tmp_path / "defaults", 0)
    assert "tp=2 ep=2 pp=1," in result.stdout, result.stdout
    result, _ = run_batch_script(tmp_path / "pp2", 0, PP="2")
    assert "tp=2 ep=1 pp=2," in result.stdout, result.stdout
    for name, value in (("PP", "two"), ("VPP", "0")):
        result, _ = run_batch_script(tmp_path / name, 0, **{name: value})
        assert result.returncode == 2 and not (tmp_path / name / "srun.calls").exists()
        assert result.stderr == f"error: {name} must be a positive whole number, got '{value}'\n"
