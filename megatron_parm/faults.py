"""What a rank leaves behind for the launcher when the job ends badly, and the launcher's reading.

    python -m megatron_parm.launch ...   makes a folder for the job and names it to the ranks in
                                         LAUNCH_DIR_ENV (plain torchrun: none, nothing written)

A rank, through the trainer and megatron_parm.cli:
    record_progress(iteration, phase, save)   where it is: progress/rank<R>.json, replaced
                                               atomically at each iteration and phase
    log_follow_on(error)                       a peer left a collective (connection reset,
                                               timeout): its traceback goes to errors.log,
                                               not the terminal
    die_with_parent()                          processes it forks (Megatron's checkpoint writers)
                                               get SIGKILL when it dies, instead of living on

The launcher:
    read_progress(folder)                      {rank: {"iteration", "phase", "save", ...}}
    last_checkpoint(tracker)                   the iteration latest_checkpointed_iteration.txt names

torch-free: the launcher reads these without a process group.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
import traceback
from typing import Dict, Optional

LAUNCH_DIR_ENV = "MEGATRON_PARM_LAUNCH_DIR"
ERRORS_LOG = "errors.log"
PROGRESS_DIR = "progress"

# Messages of a collective whose peer is gone or stuck: gloo's and NCCL's, torch's timeouts.
# On a surviving rank these follow another rank's death; they are not the cause.
COMMUNICATION_ERRORS = re.compile(
    r"Connection reset by peer|Connection closed by peer|Connection refused|Broken pipe|"
    r"Socket Timeout|Timed out waiting|timed out|timeout|ECONNRESET|EPIPE|"
    r"NCCL communicator was aborted|remote process exited|DistNetworkError|DistBackendError|"
    r"DistStoreError|Read error|Write error|Receive timed out", re.IGNORECASE)

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_fork_hook_registered = False


def launch_dir() -> Optional[str]:
    """The folder the launcher made for this job, or None (plain torchrun, one process)."""
    path = os.environ.get(LAUNCH_DIR_ENV)
    return path if path and os.path.isdir(path) else None


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _progress_path(folder: str) -> str:
    return os.path.join(folder, PROGRESS_DIR, f"rank{_rank()}.json")


def record_progress(iteration: Optional[int], phase: str, save: Optional[str] = None,
                    **extra) -> None:
    """Note that this rank is at ITERATION (the one in progress, 1-based) doing PHASE
    ('starting', 'training', 'evaluating', 'saving a checkpoint', 'done'). A no-op without the
    launcher's folder; never raises (a full disk must not stop training)."""
    folder = launch_dir()
    if folder is None:
        return
    tracker = None
    if save:
        from megatron_parm.checkpointing.paths import TRACKER_FILE  # loaded in a rank already

        tracker = os.path.join(os.path.abspath(save), TRACKER_FILE)
    record = {"iteration": iteration, "phase": phase, "save": save and os.path.abspath(save),
              "tracker": tracker, "pid": os.getpid(), "host": socket.gethostname(),
              "time": time.time(), **extra}
    path = _progress_path(folder)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        staged = f"{path}.{os.getpid()}"
        with open(staged, "w") as f:
            json.dump(record, f)
        os.replace(staged, path)  # the launcher never reads half a record
    except OSError:
        pass


def _add_to_progress(**fields) -> None:
    folder = launch_dir()
    try:
        with open(_progress_path(folder)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        record = {"iteration": None, "phase": "starting", "save": None}
    record.update(fields)
    record_progress(**{k: v for k, v in record.items()
                       if k not in ("pid", "host", "time", "tracker")})


def is_communication_error(error: BaseException) -> bool:
    """A collective failed because a peer died, hung or closed its connection."""
    names = {cls.__name__ for cls in type(error).__mro__}
    if names & {"DistNetworkError", "DistBackendError", "DistStoreError"}:
        return True
    return isinstance(error, RuntimeError) and bool(COMMUNICATION_ERRORS.search(str(error)))


def log_follow_on(error: BaseException) -> bool:
    """Under the launcher, append ERROR's traceback to errors.log and mark this rank's
    progress as a follow-on failure; True when done (the caller prints nothing)."""
    folder = launch_dir()
    if folder is None:
        return False
    text = "".join(traceback.format_exception(error))
    header = (f"=== rank {_rank()} (host {socket.gethostname()}, pid {os.getpid()}), "
              f"{time.strftime('%Y-%m-%d %H:%M:%S')}: a collective failed\n")
    try:
        # One write with O_APPEND: the ranks' reports do not interleave.
        fd = os.open(os.path.join(folder, ERRORS_LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                     0o644)
        try:
            os.write(fd, (header + text + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        return False
    _add_to_progress(error="communication", message=" ".join(str(error).split())[:300])
    return True


def die_with_parent() -> None:
    """Every process this one forks from now on gets SIGKILL when this one dies (Linux
    PR_SET_PDEATHSIG). Megatron-Core's checkpoint writer forks writer processes during a save;
    a rank killed meanwhile would leave them running, orphaned, holding its files (and on a
    GPU node, memory). Linux sends the signal when the forking *thread* ends: the writers and
    data-loader workers are forked by the main thread, which lives as long as the rank.
    Idempotent; a no-op elsewhere than Linux."""
    global _fork_hook_registered
    if _fork_hook_registered or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)

    def in_child():
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)

    os.register_at_fork(after_in_child=in_child)
    _fork_hook_registered = True


def read_progress(folder: str) -> Dict[int, dict]:
    """Every rank's last record in FOLDER (the launcher's), by global rank."""
    records = {}
    progress = os.path.join(folder, PROGRESS_DIR)
    for name in os.listdir(progress) if os.path.isdir(progress) else ():
        match = re.fullmatch(r"rank(\d+)\.json", name)
        if match:
            try:
                with open(os.path.join(progress, name)) as f:
                    records[int(match.group(1))] = json.load(f)
            except (OSError, ValueError):
                pass
    return records


def last_checkpoint(tracker: Optional[str]) -> Optional[int]:
    """The iteration the tracker file (SAVE/latest_checkpointed_iteration.txt, whose path the
    ranks record: the launcher never imports the checkpointing code, seconds of imports)
    names, or None. It is written only once a checkpoint is complete."""
    try:
        with open(tracker) as f:
            return int(f.read().strip())
    except (OSError, TypeError, ValueError):  # none yet, no --save, or a corrupted tracker
        return None
