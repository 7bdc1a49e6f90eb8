"""The pieces of fault handling that need no job: the timeout on every group, which error is a
follow-on, the launcher's line. The faults themselves: tests/e2e/test_faults.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_parm import faults
from megatron_parm.launch import _FaultReport

REPO = Path(__file__).resolve().parents[2]


def test_every_process_group_gets_the_distributed_timeout():
    """Megatron's groups (one of which Megatron-Core 0.16.1 makes without the timeout it is
    given), parm_hier's node split (made there too; at world size 1 it is the EP group) and the
    default group, on one gloo rank in a fresh process."""
    code = """
import os
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=os.environ["PORT"])
import torch
from torch.distributed import distributed_c10d
from megatron_parm.training.trainer import initialize_distributed
from megatron_parm.parallel import initialize_model_parallel
initialize_distributed(7)
initialize_model_parallel(1, 1, 1, timeout_minutes=7)
for group in distributed_c10d._world.pg_map:
    print(distributed_c10d._world.pg_names[group],
          group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
"""
    from launch import free_port

    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PORT=str(free_port()),
                                                PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    timeouts = dict(line.split() for line in proc.stdout.splitlines())
    assert len(timeouts) >= 10, timeouts  # the default group and Megatron's
    assert set(timeouts.values()) == {"420.0"}, timeouts


def test_distributed_timeout_flag_is_checked(prepared_data):
    from megatron_parm.training.arguments import parse_args

    args = parse_args(["--config", "configs/gpt2_tiny_moe.yaml"])
    assert args.distributed_timeout_minutes == 10  # Megatron-LM's default
    with pytest.raises(ValueError, match="--distributed-timeout-minutes must be a positive number, got 0"):
        parse_args(["--config", "configs/gpt2_tiny_moe.yaml", "--distributed-timeout-minutes", "0"])


@pytest.mark.parametrize("message, follow_on", [
    ("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:43663: Connection reset by peer", True),
    ("[pair.cc:553] Connection closed by peer [127.0.0.1]:47246", True),
    ("Timed out waiting 600000ms for recv operation to complete", True),
    ("CUDA out of memory. Tried to allocate 2.00 GiB", False),
    ("mat1 and mat2 shapes cannot be multiplied (4x64 and 32x64)", False),
])
def test_which_errors_follow_a_peer(message, follow_on):
    assert faults.is_communication_error(RuntimeError(message)) is follow_on
    assert not faults.is_communication_error(ValueError(message))  # a user's mistake never


def _record(monkeypatch, folder, rank, iteration, phase, save, **extra):
    monkeypatch.setenv(faults.LAUNCH_DIR_ENV, str(folder))
    monkeypatch.setenv("RANK", str(rank))
    faults.record_progress(iteration, phase, save, **extra)


def test_the_line_names_the_dead_rank_its_iteration_and_the_checkpoint(tmp_path, monkeypatch):
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("10")
    _record(monkeypatch, tmp_path, 0, 13, "training", str(save), error="communication",
            message="Connection reset by peer")
    _record(monkeypatch, tmp_path, 1, 12, "saving a checkpoint", str(save))
    (tmp_path / faults.ERRORS_LOG).write_text("rank 0: ...")
    argv = ["--nproc-per-node", "2", "train.py", "--save", str(save), "--load", "elsewhere"]
    report = _FaultReport(str(tmp_path), argv, None)
    # Rank 0 failed in a collective (exit 1), rank 1 was killed: rank 1 is the cause.
    line = report.line({0: 1, 1: -9}, {0: 100, 1: 101})
    assert line.startswith("launch: rank 1 (host ") and ", pid 101) was killed by SIGKILL at " \
        in line, line
    assert "at iteration 12 (saving a checkpoint)" in line
    assert f"errors are in {tmp_path / faults.ERRORS_LOG}" in line
    assert f"last complete checkpoint: iteration 10 in {save}" in line
    assert line.endswith(f"resume with: python -m megatron_parm.launch --nproc-per-node 2 "
                         f"train.py --save {save} --load {save}"), line
    assert "\n" not in line
    # Rank 1 was stopped by the launcher: the others' collectives timed out waiting for it
    # (they failed after it: hung), unless one failed on its own.
    report.stopped_pids.add(101)
    line = report.line({0: 1, 1: -9}, {0: 100, 1: 101})
    assert line.startswith("launch: rank 1 (host ") and "did not end when the others failed " \
        "(hung?) and was stopped at iteration 12" in line, line
    _record(monkeypatch, tmp_path, 0, 13, "training", str(save))
    assert report.line({0: 1, 1: -15}, {0: 100, 1: 101}).startswith(
        "launch: rank 0 (host ")


def test_the_line_without_a_checkpoint(tmp_path, monkeypatch):
    _record(monkeypatch, tmp_path, 0, 2, "training", str(tmp_path / "empty"))
    line = _FaultReport(str(tmp_path), ["x.py"], None).line({0: -9}, {0: 5})
    assert f"no complete checkpoint in {tmp_path / 'empty'} yet" in line
    assert "resume with" not in line
    _record(monkeypatch, tmp_path, 0, 2, "training", None)
    line = _FaultReport(str(tmp_path), ["x.py"], None).line({0: 1}, {0: 5})
    assert "failed with exit status 1 at iteration 2" in line and "no checkpoint (no --save)" in line
