"""torchrun, with a user's mistake reported once and a requested stop ending in status 0.

    python -m megatron_parm.launch --nproc-per-node 4 pretrain_scripts/pretrain_gpt2_moe.py ...

Same flags and behaviour as `torchrun` (torch.distributed.run, which this calls), except:

* When the first rank to fail exited with status 2 (a user's mistake, already reported in one
  line by that rank: see megatron_parm.cli), the launcher exits 2 without torchrun's
  ChildFailedError report and its traceback. Other failures (bugs, crashes) keep torchrun's
  full report.
* The first SIGTERM or SIGINT (Ctrl-C) is passed on to the ranks as SIGTERM and the launcher
  keeps waiting for them: with --exit-signal-handler they finish the iteration, save and exit
  0, and so does the launcher. torchrun itself would raise, stop the ranks, kill those still
  saving after 30 s and exit 1. A second signal falls back to torchrun's handling. Ranks
  that SIGTERM ends (no --exit-signal-handler) give status 128 + 15, without a traceback.

The pretraining launchers (run_local.sh, the sbatch scripts) use it; plain torchrun works too,
with torchrun's own failure report after the rank's one line.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import List, Optional

from megatron_parm.cli import USER_ERROR


def child_pids() -> List[int]:
    """The processes this one started (the ranks), from /proc."""
    pids = []
    task_dir = f"/proc/{os.getpid()}/task"
    for task in os.listdir(task_dir):
        try:
            with open(os.path.join(task_dir, task, "children")) as f:
                pids.extend(int(pid) for pid in f.read().split())
        except OSError:
            pass
    return pids


class _GracefulStop:
    """Replaces torchrun's termination handler: the first SIGTERM/SIGINT is forwarded to the
    ranks as SIGTERM; any later signal gets torchrun's own handler."""

    def __init__(self, torchrun_handler):
        self.torchrun_handler = torchrun_handler
        self.requested: Optional[signal.Signals] = None

    def __call__(self, signum, frame):
        if self.requested is not None or signum not in (signal.SIGTERM, signal.SIGINT):
            return self.torchrun_handler(signum, frame)
        self.requested = signal.Signals(signum)
        ranks = child_pids()
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        print(f"launch: {self.requested.name} received: passed to {len(ranks)} rank(s) as "
              f"SIGTERM; waiting for them to stop (send it again to end them now)",
              file=sys.stderr, flush=True)


class _QuietAfterUserError(logging.Filter):
    """Drops torchrun's log lines about a rank that exited with USER_ERROR (it said why in
    one line) and about stopping the others."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return f"(exitcode: {USER_ERROR})" not in text and "closing signal SIGTERM" not in text


def main(argv: Optional[List[str]] = None) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import api as multiprocessing_api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    logging.getLogger(multiprocessing_api.__name__).addFilter(_QuietAfterUserError())
    stop = _GracefulStop(multiprocessing_api._terminate_process_handler)
    # torchrun installs this function as its signal handler when it starts the ranks.
    multiprocessing_api._terminate_process_handler = stop
    try:
        torchrun.main(argv)
    except ChildFailedError as error:
        _, first = error.get_first_failure()
        if first.exitcode == USER_ERROR:
            return USER_ERROR  # the rank printed the one line
        if stop.requested is not None and first.exitcode == -signal.SIGTERM:
            print(f"launch: the ranks ended on SIGTERM (run without --exit-signal-handler)",
                  file=sys.stderr)
            return 128 + signal.SIGTERM
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
