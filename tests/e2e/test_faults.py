"""A rank dies; the job ends in bounded time, says what happened, and restarts with nothing lost.

Two launches of `python -m megatron_parm.launch` (GPT-2 MoE tiny, 4 ranks, (2,2,2), parm_s2,
dropout on, the distributed optimizer over dp = 2, a checkpoint every 2 iterations: its
sharded optimizer state is saved, published and resumed under faults as the plain optimizer's,
which test_checkpoint's crash runs cover), shared by the tests through one module fixture:
  reference  10 iterations, uninterrupted.
  faults     --max-restarts 5, --load = --save: each attempt kills one rank with SIGKILL at
             one point (this file is the training script; the attempt number,
             TORCHELASTIC_RESTART_COUNT, picks the fault):
               0  rank 1 inside a forward pass, iteration 3
               1  rank 2 just before a dispatcher all-to-all (the others wait inside it), it. 5
               2  rank 3 during a save, the folder staged, iteration 6
               3  rank 0 during a save, every shard written, not yet published, iteration 8
               4  rank 1 inside a backward pass, iteration 9
               5  rank 1 killed by its own checkpoint writer (a forked process that then lives
                  on, as an orphan, unless something ends it), iteration 10's save; no
                  restarts are left: the job ends.
A poller records when each attempt's last process (a rank or anything it forked) is gone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from launch import free_port, pids_with_marker, process_environ  # noqa: E402

# The job ends this long after a rank dies, at most (docs/faults.md): torchrun notices within
# 0.1 s, the survivors' collectives fail at once (or SIGKILL after the launcher's 10 s grace),
# then the launcher ends what is left and exits.
END_BOUND_S = 20
TRAIN_ITERS = 10
FLAGS = ["--config", "configs/gpt2_tiny_moe.yaml", "--tensor-model-parallel-size", "2",
         "--expert-model-parallel-size", "2", "--sequence-parallel",
         "--moe-token-dispatcher-type", "parm_s2", "--train-iters", str(TRAIN_ITERS),
         "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0",
         "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--use-distributed-optimizer"]
# attempt -> (fault, rank, iteration)
FAULTS = {0: ("forward", 1, 3), 1: ("all_to_all", 2, 5), 2: ("staged", 3, 6),
          3: ("written", 0, 8), 4: ("backward", 1, 9), 5: ("writer", 1, 10)}
# tools/fault_loop.py: each fault alone, and a rank that hangs (SIGSTOP) instead of dying
ONE_FAULT = {**{fault: (fault, rank, iteration) for fault, rank, iteration in FAULTS.values()},
             "stop": ("stop", 1, 3)}


# ---------------------------------------------------------------------------------------------
# the training script (run by the launcher)
# ---------------------------------------------------------------------------------------------

def worker(run_dir: str, mode: str, argv) -> None:
    sys.path.insert(0, str(REPO))
    from megatron_parm import cli

    cli.setup_warnings()
    import torch

    from megatron_parm import checkpointing, faults
    from megatron_parm.training.arguments import parse_args
    from megatron_parm.training.trainer import pretrain

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if mode == "faults":
        fault, fault_rank, fault_iteration = FAULTS[attempt]
    elif mode == "reference":
        fault, fault_rank, fault_iteration = (None,) * 3
    else:  # one fault at every attempt (tools/fault_loop.py); "stop": a hung rank
        fault, fault_rank, fault_iteration = ONE_FAULT[mode]
    rank = int(os.environ["RANK"])
    at = {"iteration": None, "phase": None}
    record_progress = faults.record_progress

    def tracking(iteration, phase, *args, **kwargs):
        at.update(iteration=iteration, phase=phase)
        record_progress(iteration, phase, *args, **kwargs)

    faults.record_progress = tracking  # the trainer calls it through the module

    def kill(target_pid=None):
        Path(run_dir, f"kill-{attempt}.json").write_text(json.dumps(
            {"time": time.time(), "fault": fault, "rank": rank}))
        os.kill(target_pid or os.getpid(), signal.SIGSTOP if fault == "stop" else signal.SIGKILL)

    def due(phase="training") -> bool:
        return rank == fault_rank and at["iteration"] == fault_iteration and at["phase"] == phase

    if fault in ("forward", "stop"):
        torch.nn.modules.module.register_module_forward_pre_hook(
            lambda module, inputs: kill() if due() else None)
    elif fault == "backward":
        def die_in_backward(module, inputs, output):
            if due() and isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: kill())
        torch.nn.modules.module.register_module_forward_hook(die_in_backward)
    elif fault == "all_to_all":
        all_to_all_single = torch.distributed.all_to_all_single

        def all_to_all_then_die(*args, **kwargs):
            if due():
                kill()
            return all_to_all_single(*args, **kwargs)

        torch.distributed.all_to_all_single = all_to_all_then_die
    elif fault in ("staged", "written"):
        checkpointing.set_fault_hook(
            lambda stage, iteration: kill() if stage == fault and due("saving a checkpoint")
            else None)
    elif fault == "writer":
        from megatron.core.dist_checkpointing.strategies.filesystem_async import (
            FileSystemWriterAsync)

        write = FileSystemWriterAsync.write_preloaded_data

        def write_and_kill_the_rank(*args, **kwargs):  # runs in the forked writer
            if due("saving a checkpoint"):
                kill(os.getppid())
                time.sleep(120)  # an orphan now: only something outside can end it
            return write(*args, **kwargs)

        FileSystemWriterAsync.write_preloaded_data = staticmethod(write_and_kill_the_rank)

    def main():
        pretrain(parse_args(list(argv)))

    cli.run(main)


# ---------------------------------------------------------------------------------------------
# the launches
# ---------------------------------------------------------------------------------------------

def launch(run: Path, name: str, *extra: str, mode: str = None, train_flags=(),
           timeout: int = 900) -> dict:
    """Run the launcher (EXTRA: its flags) on this file in MODE (default NAME), saving to
    RUN/NAME; returns its status, output, end time, the processes that outlived it, and per
    attempt the last time any of its processes was seen."""
    marker = uuid.uuid4().hex
    log_path = run / f"{name}.log"
    last_seen, done = {}, threading.Event()

    def poll():
        while not done.is_set():
            now = time.time()
            for pid in pids_with_marker(f"PARM_TEST_LAUNCH={marker}"):
                attempt = process_environ(pid).get("TORCHELASTIC_RESTART_COUNT")
                if attempt is not None:
                    last_seen[int(attempt)] = now
            time.sleep(0.1)

    poller = threading.Thread(target=poll, daemon=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_parm.launch", "--nproc-per-node", "4",
             "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *extra,
             str(Path(__file__).relative_to(REPO)), "worker", str(run), mode or name, *FLAGS,
             "--save", str(run / name), "--load", str(run / name), "--save-interval", "2",
             *train_flags],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                     PARM_TEST_LAUNCH=marker))
        poller.start()
        try:
            status = proc.wait(timeout=timeout)
            ended = time.time()
        finally:
            done.set()
            poller.join()
            survivors = pids_with_marker(f"PARM_TEST_LAUNCH={marker}")
            for pid in survivors:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    return {"status": status, "ended": ended, "output": log_path.read_text(),
            "last_seen": last_seen, "survivors": survivors}


def losses(output: str) -> dict:
    """{iteration: printed lm loss}; an iteration printed again after a restart must agree."""
    found = {}
    for iteration, loss in re.findall(r" iteration +(\d+)/ *\d+ \|.*?\| lm loss: (\S+) \|", output):
        assert found.setdefault(int(iteration), loss) == loss, (iteration, found[int(iteration)], loss)
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory, prepared_data):
    run = tmp_path_factory.mktemp("faults")
    reference = launch(run, "reference")
    assert reference["status"] == 0, reference["output"][-4000:]
    faulty = launch(run, "faults", "--max-restarts", str(len(FAULTS) - 1))
    kills = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in run.glob("kill-*.json")}
    return run, reference, faulty, kills


def test_every_fault_ends_its_attempt_within_the_bound(runs):
    _, _, faulty, kills = runs
    assert sorted(kills) == sorted(FAULTS), (kills, faulty["output"][-4000:])
    end_times = {}
    for attempt, kill in kills.items():
        # The last attempt ends with the launcher; the others when their last process is gone.
        gone = faulty["ended"] if attempt == max(FAULTS) else faulty["last_seen"][attempt]
        end_times[FAULTS[attempt][0]] = round(gone - kill["time"], 2)
    assert all(took <= END_BOUND_S for took in end_times.values()), end_times
    print("seconds from the kill to the end of the attempt:", end_times)


def test_the_job_ends_with_one_line_and_no_survivor(runs):
    run, _, faulty, _ = runs
    output = faulty["output"]
    assert faulty["status"] == 128 + signal.SIGKILL, output[-4000:]
    assert faulty["survivors"] == [], faulty["survivors"]  # the orphaned writer included
    lines = [line for line in output.splitlines() if line.startswith("launch: rank")]
    assert len(lines) == len(FAULTS), lines  # one before each restart, one at the end
    for attempt, line in enumerate(lines):
        fault, rank, iteration = FAULTS[attempt]
        phase = "saving a checkpoint" if fault in ("staged", "written", "writer") else "training"
        assert f"launch: rank {rank} (host " in line and "was killed by SIGKILL" in line, line
        assert f"({phase})" in line, line
    final = lines[-1]
    errors = re.search(r"the other ranks' errors are in (\S+errors\.log)", final).group(1)
    assert "Connection" in Path(errors).read_text()
    assert f"last complete checkpoint: iteration 8 in {run / 'faults'}" in final, final
    assert final.endswith(f"--load {run / 'faults'} --save-interval 2"), final
    assert "resume with: python -m megatron_parm.launch" in final and "restarting" not in final
    assert "restarting (1 of 5 restarts) from it" in lines[0], lines[0]
    # Nothing but the launcher's lines about the faults: no traceback, no torchrun report.
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-6000:]
    assert "exitcode" not in output and "Connection reset" not in output, output[-6000:]


def test_restarts_continue_from_the_last_checkpoint_with_the_same_losses(runs):
    run, reference, faulty, _ = runs
    expected, got = losses(reference["output"]), losses(faulty["output"])
    assert sorted(expected) == list(range(1, TRAIN_ITERS + 1))
    assert sorted(got) == list(range(1, TRAIN_ITERS + 1)), got  # iteration 10 ran, unsaved
    assert got == expected
    loaded = re.findall(r"> loaded \w+ checkpoint \S+ at iteration (\d+)", faulty["output"])
    assert loaded == ["2", "4", "4", "6", "8"], loaded
    assert (run / "faults/latest_checkpointed_iteration.txt").read_text().strip() == "8"
    assert not (run / "faults/iter_0000010").exists()


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[1] != "worker":
        sys.exit("usage: python -m megatron_parm.launch --nproc-per-node 4 "
                 "tests/e2e/test_faults.py worker RUN_DIR reference|faults TRAINING_FLAGS...")
    worker(sys.argv[2], sys.argv[3], sys.argv[4:])
