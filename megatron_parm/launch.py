"""torchrun, with a user's mistake reported once, a dead rank reported in one line, the job ended
in bounded time, and a requested stop ending in status 0.

    python -m megatron_parm.launch --nproc-per-node 4 pretrain_scripts/pretrain_gpt2_moe.py ...

Same flags and behaviour as `torchrun` (torch.distributed.run, which this calls), except:

* When the first rank to fail exited with status 2 (a user's mistake, already reported in one
  line by that rank: see megatron_parm.cli), the launcher exits 2 without torchrun's
  ChildFailedError report and its traceback.
* Any other failure (a rank killed by a signal, a crash, a hung rank) is one line instead of
  torchrun's report: the rank, host, pid, signal or exit status, the iteration and phase it was
  at, where the other ranks' errors are (errors.log: the survivors' "connection reset" and
  timeouts go there, not to the terminal), the last complete checkpoint and the command that
  resumes from it. The exit status is 128 + the signal, or the rank's status. With
  --max-restarts the same line, ending "restarting (k of n restarts) from it", comes before each
  restart (the ranks resume where --load names the --save folder).
* After a failure the other ranks get SIGTERM and STOP_GRACE_S later SIGKILL (torchrun: 30 s;
  --shutdown-timeout sets it); then every process left below the launcher (a dead rank's
  forked checkpoint writers, which it adopts as a child subreaper) is ended the same way, and
  the launcher exits. docs/faults.md gives the bound for each fault.
* The first SIGTERM or SIGINT (Ctrl-C), or the training script's --exit-signal, is passed on
  to the ranks as the signal they stop on (--exit-signal with --exit-signal-handler, else
  SIGTERM) and the launcher keeps waiting for them: with --exit-signal-handler they finish the
  iteration, save and exit 0, and so does the launcher. torchrun itself would raise, stop the
  ranks, kill those still saving after 30 s and exit 1. A second signal falls back to
  torchrun's handling. Ranks that the signal ends (no --exit-signal-handler) give status
  128 + its number, without a traceback.
* Without OMP_NUM_THREADS in the environment, the ranks get torchrun's default (1 with several
  ranks per node) without torchrun's banner about it.

The launcher tells the ranks a folder for their progress and follow-on errors (a new temporary
folder, named to them in megatron_parm.faults.LAUNCH_DIR_ENV; removed after a success).
It changes three things inside torchrun's agent, all in _patch_torchrun: the grace before
SIGKILL, a note of the ranks it stopped, and the line before a restart.

The pretraining launchers (run_local.sh, the sbatch scripts) use it; plain torchrun works too,
with torchrun's own failure report after the rank's one line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import time
from typing import Dict, List, Optional

from megatron_parm import faults, settings
from megatron_parm.cli import USER_ERROR, argparse_errors_raise
from megatron_parm.wording import plural


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
    """Replaces torchrun's termination handler: the first SIGTERM/SIGINT (or FORWARD, the
    ranks' --exit-signal) is forwarded to the ranks as FORWARD; any later signal gets
    torchrun's own handler."""

    def __init__(self, torchrun_handler, forward: signal.Signals = signal.SIGTERM):
        self.torchrun_handler = torchrun_handler
        self.forward = forward
        self.requested: Optional[signal.Signals] = None

    def __call__(self, signum, frame):
        if self.requested is not None or \
                signum not in (signal.SIGTERM, signal.SIGINT, self.forward):
            return self.torchrun_handler(signum, frame)
        self.requested = signal.Signals(signum)
        ranks = child_pids()
        for pid in ranks:
            try:
                os.kill(pid, self.forward)
            except ProcessLookupError:
                pass
        print(f"launch: {self.requested.name} received: passed to {plural(len(ranks), 'rank')} as "
              f"{self.forward.name}; waiting for them to stop (send it again to end them now)",
              file=sys.stderr, flush=True)

    def install(self) -> None:
        """Catch FORWARD too where torchrun does not (it catches SIGTERM, SIGINT, SIGHUP and
        SIGQUIT, with this object once it replaces its handler)."""
        if self.forward not in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(self.forward, self)


class _QuietFailures(logging.Filter):
    """Drops torchrun's log lines about a failed rank and about stopping the others: the
    rank said why in one line (USER_ERROR), or the launcher's line does."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(part in text for part in ("failed (exitcode: ", "closing signal",
                                                 "Unable to shutdown process"))


# After a rank fails, the others get SIGTERM and, this many seconds later, SIGKILL (torchrun's
# --shutdown-timeout where given; torchrun itself waits 30 s). They cannot save anything once a
# peer is gone, so a short grace loses nothing.
STOP_GRACE_S = 10


class _FaultReport:
    """The one line about a failed attempt: which rank ended it, how, where it was, and the
    checkpoint to resume from (megatron_parm.faults has the ranks' side)."""

    def __init__(self, folder: str, argv: List[str], save_hint: Optional[str]):
        self.folder = folder
        self.argv = argv
        self.save_hint = save_hint
        self.stopped_pids = set()  # ranks torchrun stopped after the failure: not the cause

    def cause(self, exitcodes: Dict[int, int], pids: Dict[int, int],
              stop_signal: Optional[int] = None):
        """The rank whose failure the others followed: killed by a signal (not the stop the
        user asked for) first, then one that failed on its own, then any."""
        progress = faults.read_progress(self.folder)

        def order(rank):
            code, record = exitcodes[rank], progress.get(rank, {})
            follow_on = record.get("error") == "communication"
            if pids.get(rank) in self.stopped_pids:
                kind = 3 if follow_on else 2  # stopped: hung, if the others timed out on it
            elif code < 0 and -code != stop_signal:
                kind = 0
            else:
                kind = 4 if follow_on else 1
            return kind, rank

        rank = min(exitcodes, key=order)
        return rank, progress.get(rank, {}), progress

    def line(self, exitcodes: Dict[int, int], pids: Dict[int, int],
             stop_signal: Optional[int] = None, restart: Optional[str] = None) -> str:
        rank, record, progress = self.cause(exitcodes, pids, stop_signal)
        code = exitcodes[rank]
        how = (f"was killed by {signal.Signals(-code).name}" if code < 0 else
               f"failed with exit status {code}")
        if pids.get(rank) in self.stopped_pids:
            how = "did not end when the others failed (hung?) and was stopped"
        if record.get("error") == "communication":
            how += f" (a collective failed: {record.get('message', '')[:120]})"
        host = record.get("host") or socket.gethostname()
        where = ""
        if record.get("iteration") is not None:
            where = f" at iteration {record['iteration']} ({record['phase']})"
        elif record.get("phase"):
            where = f" while {record['phase']}"
        text = f"launch: rank {rank} (host {host}, pid {pids.get(rank, '?')}) {how}{where}"
        others = len(exitcodes) - 1 if len(exitcodes) > 1 else len(progress) - 1
        errors = os.path.join(self.folder, faults.ERRORS_LOG)
        if os.path.isfile(errors):
            text += f"; the other ranks' errors are in {errors}"
        elif others > 0:
            text += "; the other ranks were stopped"
        recorded = [record] + [r for r in progress.values() if r.get("save")]
        save = next((r["save"] for r in recorded if r.get("save")), self.save_hint)
        tracker = next((r["tracker"] for r in recorded if r.get("tracker")), None)
        latest = faults.last_checkpoint(tracker)
        if not save:
            text += "; no checkpoint (no --save)"
        elif tracker is None:
            text += f"; checkpoints (if any) in {save}"
        elif latest is None:
            text += f"; no complete checkpoint in {save} yet"
        else:
            text += f"; last complete checkpoint: iteration {latest} in {save}"
        if restart:
            return text + f"; {restart}"
        if save and latest is not None:
            text += f"; resume with: {self.resume_command(save)}"
        return text

    def resume_command(self, save: str) -> str:
        """This launch's command with --load SAVE (replacing another --load)."""
        args, replaced, skip = [], False, False
        for arg in self.argv:
            if skip:
                args.append(save)
                skip, replaced = False, True
            elif arg == "--load":
                args.append(arg)
                skip = True
            elif arg.startswith("--load="):
                args.append(f"--load={save}")
                replaced = True
            else:
                args.append(arg)
        if not replaced:
            args += ["--load", save]
        return "python -m megatron_parm.launch " + shlex.join(args)


def descendants(pid: int) -> List[int]:
    """Every process below PID (children, their children, ...), from /proc."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(child) for child in f.read().split()]
            except OSError:
                continue
            found += children
            queue += children
    return found


def stop_descendants(grace_s: float) -> List[int]:
    """SIGTERM every process left below the launcher, SIGKILL those still there after
    GRACE_S, and reap them; returns their pids. They are orphans of a dead rank (a forked
    checkpoint writer) adopted by the launcher (a child subreaper), or ranks torchrun gave up
    on."""
    left = descendants(os.getpid())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            for pid in list(left):
                try:
                    if os.waitpid(pid, os.WNOHANG)[0] == pid:
                        left.remove(pid)
                except ChildProcessError:  # not our child (a grandchild): see if it is gone
                    if not os.path.exists(f"/proc/{pid}"):
                        left.remove(pid)
            if not left:
                return []
            time.sleep(0.05)
    return left


def _become_subreaper() -> None:
    """Orphans below this process (a rank's forked writers, once the rank dies) are adopted by
    it instead of PID 1, so stop_descendants finds them (Linux PR_SET_CHILD_SUBREAPER)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _patch_torchrun(grace_s: float, report: _FaultReport) -> None:
    """The launcher's only changes to torchrun's agent (see the module docstring): the grace
    before SIGKILL capped at GRACE_S, the ranks it stops remembered (they are not the cause),
    and a line before each restart (--max-restarts)."""
    from torch.distributed.elastic.agent.server import api as agent_api
    from torch.distributed.elastic.agent.server import local_elastic_agent
    from torch.distributed.elastic.multiprocessing import api as multiprocessing_api

    close = multiprocessing_api.SubprocessContext._close
    monitor = local_elastic_agent.LocalElasticAgent._monitor_workers
    restart = agent_api.SimpleElasticAgent._restart_workers

    def close_within_grace(self, death_sig, timeout=30):
        report.stopped_pids.update(handler.proc.pid for handler in
                                   self.subprocess_handlers.values() if handler.proc.poll() is None)
        return close(self, death_sig, min(timeout, grace_s))

    def monitor_and_keep(self, worker_group):
        result = monitor(self, worker_group)
        if result.failures:
            self._parm_failures = result.failures
        return result

    def restart_with_line(self, worker_group):
        failures = getattr(self, "_parm_failures", None)
        if failures:
            max_restarts = worker_group.spec.max_restarts
            print(report.line({r: f.exitcode for r, f in failures.items()},
                              {r: f.pid for r, f in failures.items()},
                              restart=f"restarting ({max_restarts - self._remaining_restarts} "
                                      f"of {max_restarts} restarts) from it"),
                  file=sys.stderr, flush=True)
            self._parm_failures = None
        report.stopped_pids.clear()
        return restart(self, worker_group)

    multiprocessing_api.SubprocessContext._close = close_within_grace
    local_elastic_agent.LocalElasticAgent._monitor_workers = monitor_and_keep
    agent_api.SimpleElasticAgent._restart_workers = restart_with_line


def main(argv: Optional[List[str]] = None) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import api as multiprocessing_api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    argv = list(sys.argv[1:] if argv is None else argv)
    parsed = torchrun.get_args_parser().parse_args(argv)
    problem, script_args = script_flags(parsed.training_script, parsed.training_script_args,
                                        parsed.nnodes, _nproc(torchrun, parsed.nproc_per_node))
    if problem:  # before any rank starts (a rank would find it after ~20-60 s)
        print(f"error: {problem}", file=sys.stderr)
        return USER_ERROR
    grace_s = STOP_GRACE_S if parsed.shutdown_timeout is None else parsed.shutdown_timeout
    if "OMP_NUM_THREADS" not in os.environ and \
            torchrun.determine_local_world_size(parsed.nproc_per_node) > 1:
        # torchrun's own default for several ranks per node, set here so that it does not
        # print its 4-line banner about it
        os.environ["OMP_NUM_THREADS"] = "1"
    folder = tempfile.mkdtemp(prefix="megatron_parm-launch-")
    os.environ[faults.LAUNCH_DIR_ENV] = folder  # the ranks inherit it
    report = _FaultReport(folder, argv, _flag_value(parsed.training_script_args, "--save"))
    _become_subreaper()
    _patch_torchrun(grace_s, report)
    logging.getLogger(multiprocessing_api.__name__).addFilter(_QuietFailures())
    stop = _GracefulStop(multiprocessing_api._terminate_process_handler,
                         exit_signal(script_args))
    # torchrun installs this function as its signal handler when it starts the ranks.
    multiprocessing_api._terminate_process_handler = stop
    stop.install()
    status = 0
    try:
        torchrun.main(argv)
    except ChildFailedError as error:
        _, first = error.get_first_failure()
        exitcodes = {rank: failure.exitcode for rank, failure in error.failures.items()}
        if first.exitcode == USER_ERROR:
            status = USER_ERROR  # the rank printed the one line
        elif stop.requested is not None and all(
                code == -stop.forward for code in exitcodes.values()):
            print(f"launch: the ranks ended on {stop.forward.name} (run without "
                  f"--exit-signal-handler)", file=sys.stderr)
            status = 128 + stop.forward
        else:
            stop_signal = stop.forward if stop.requested is not None else None
            pids = {rank: failure.pid for rank, failure in error.failures.items()}
            print(report.line(exitcodes, pids, stop_signal), file=sys.stderr, flush=True)
            rank, _, _ = report.cause(exitcodes, pids, stop_signal)
            code = exitcodes[rank]
            status = 128 - code if code < 0 else code
    finally:
        stop_descendants(grace_s)
    if status in (0, USER_ERROR) or not os.listdir(folder):
        shutil.rmtree(folder, ignore_errors=True)  # nothing to look at
    return status


def script_flags_problem(script: str, script_args: List[str],
                         nnodes: str = "1", nproc_per_node: Optional[int] = None) -> Optional[str]:
    """For the pretraining scripts (megatron_parm.settings.TRAINING_SCRIPTS): one line naming
    what their argv and --config file ask for that cannot run: a flag training does not know
    (with the closest valid ones), a bad value, or a flag refused here (settings.read); then,
    where the world size is known (NNODES fixed, NPROC_PER_NODE given), every rule between the
    flags and the layout (training.arguments.validate, the same message a rank would print)
    but Megatron-Core's own TransformerConfig checks and the data files, which the ranks check
    (importing Megatron-Core would take longer than the check saves). None for a clean argv or
    another script."""
    return script_flags(script, script_args, nnodes, nproc_per_node)[0]


def script_flags(script: str, script_args: List[str], nnodes: str = "1",
                 nproc_per_node: Optional[int] = None):
    """(script_flags_problem's line or None, the flags a pretraining script reads or None)."""
    model_type = settings.TRAINING_SCRIPTS.get(os.path.basename(script))
    if model_type is None or {"-h", "--help"} & set(script_args):
        return None, None
    try:
        with argparse_errors_raise():
            args = settings.read(settings.training_parser(), script_args)
        nodes = _fixed_nodes(nnodes)
        if nproc_per_node is None or nodes is None:
            return None, args  # an elastic or unknown world: the ranks check the layout
        args.model_type = model_type
        world_size = nodes * nproc_per_node
        from megatron_parm.training.arguments import validate

        with _local_world_size(nproc_per_node):  # the ranks' LOCAL_WORLD_SIZE (node size)
            validate(args, world_size, reads_data=False, megatron_core=False)
        return None, args
    except ValueError as error:  # cli.UsageError included
        return str(error), None


def exit_signal(script_args) -> signal.Signals:
    """The signal the ranks stop on: the training script's --exit-signal with
    --exit-signal-handler, else SIGTERM (which ends them)."""
    if script_args is not None and script_args.exit_signal_handler:
        return signal.Signals[script_args.exit_signal]
    return signal.SIGTERM


@contextlib.contextmanager
def _local_world_size(nproc_per_node: int):
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(nproc_per_node)
    try:
        yield
    finally:
        if saved is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved


def _fixed_nodes(nnodes: str) -> Optional[int]:
    """torchrun's --nnodes (N, or MIN:MAX; default 1:1) where it fixes the number of nodes."""
    parts = str(nnodes).split(":")
    try:
        low, high = int(parts[0]), int(parts[-1])
    except ValueError:
        return None
    return low if low == high and len(parts) <= 2 else None


def _nproc(torchrun, nproc_per_node: str) -> Optional[int]:
    """Ranks per node as torchrun counts them (a number, or 'cpu', 'gpu', 'auto'), or None."""
    try:
        return torchrun.determine_local_world_size(nproc_per_node)
    except ValueError:
        return None  # torchrun says why when it starts


def _flag_value(args: List[str], flag: str) -> Optional[str]:
    value = None
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


if __name__ == "__main__":
    # End at once, whatever threads torchrun left (a launcher once stayed running after its
    # last line, the ranks gone).
    status = main()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)
