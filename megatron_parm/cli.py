"""Entry points of the scripts and tools: one clean line per user mistake, warnings once.

    setup_warnings()     first thing in a script, before Megatron-Core is imported
    run(main)            `if __name__ == "__main__": cli.run(main)`: calls main(), exits with its
                         status; destroys the process groups main left behind
    call(main, argv)     the same, returning the status instead of exiting (tests run several
                         entry points in one process)
    optional_packages_note()   one line naming the optional packages that are not installed

A closed output (`tool | head`) ends the tool quietly with status 141, as SIGPIPE ends a Unix
tool. A user's mistake is an argparse error, or a ValueError (CheckpointError is one) that this
project's code raises (a `raise` statement in it, not a library's or Python's own): it is
printed as one line `error: <message>` by the first rank that sees it (ranks claim the report
in torchrun's store; without one, rank 0 prints), with exit status 2 and no traceback. Anything else is a bug: the first failing rank prints its traceback, exit status 1.
Ranks that fail after another one has reported stay silent (their failure is almost always the
consequence: a peer left a collective). Under megatron_parm.launch, a failed collective (a peer
died or hung: connection reset, timeout) is not printed at all: its traceback goes to the
launcher's errors.log, and the launcher's one line names the rank that died (megatron_parm.faults).
MEGATRON_PARM_DEBUG=1 prints every rank's traceback.

Warnings: rank 0 shows each once, in one line; other ranks show none. Megatron-Core's fallback
warnings for missing optional packages (Transformer Engine, Apex), and warnings about its own
defaults or its use of deprecated torch calls, which a user cannot act on, are not shown, each
filtered by its message and the module it comes from (HIDDEN_WARNINGS); the trainer prints
optional_packages_note() once instead. hide_library_warnings() (megatron_parm's, opt-in) does
the same for a script of one's own that uses the library.

This module imports nothing heavy (torch only when an error is reported), so scripts can
import it before Megatron-Core.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import sys
import traceback
import warnings
from typing import Callable, NamedTuple, Optional, Sequence

from megatron_parm import faults

USER_ERROR = 2   # exit status of a user's mistake (argparse's own)
BUG = 1
BROKEN_PIPE = 128 + 13  # the reader of the output went away (SIGPIPE's status)
DEBUG_ENV = "MEGATRON_PARM_DEBUG"
PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Optional packages Megatron-Core falls back from, as (import name, what users call it).
OPTIONAL_PACKAGES = (("transformer_engine", "Transformer Engine"), ("apex", "Apex"))



class Hidden(NamedTuple):
    """A warning nobody using this project can act on, hidden where it arises: its message (a
    regular expression matched at the start) from its module (matched whole)."""
    message: str
    module: str
    why: str
    library: bool  # hidden by hide_library_warnings() too (Megatron-Core's or torch's own)


# The warnings the scripts and tools hide (setup_warnings), and why.
HIDDEN_WARNINGS = (
    Hidden(r"(Transformer Engine|Apex)( and Apex)? (is|are) not installed", r"megatron\.core\..*",
           "Megatron-Core's fallbacks from optional packages: optional_packages_note() says "
           "it once", library=True),
    Hidden(r"full scope is deprecated", r"megatron\.core\.transformer\.transformer_config",
           "Megatron-Core's own default for cuda_graph_scope", library=True),
    Hidden(r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
           r"torch\.distributed\.c10d_logger", "Megatron-Core's calls, not the user's",
           library=True),
    Hidden(r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
           r"megatron\.core\.optimizer\.optimizer", "Megatron-Core's zero_grad on the "
           "distributed optimizer's shard views (--use-distributed-optimizer)", library=True),
    Hidden(r"moe_ffn_hidden_size is not set", r"megatron\.core\.transformer\.transformer_config",
           "--moe-ffn-hidden-size defaults to --ffn-hidden-size (documented in --help)",
           library=False),
    Hidden(r"torch\.distributed is .*assuming the intent is to (load|save) in a single process",
           r"torch\.distributed\.checkpoint\.utils",
           "the tools read and write whole checkpoints in one process on purpose", library=False),
)
# Shown only where they apply.
_CUDA_ONLY_WARNING = re.compile(r"CUDA_DEVICE_MAX_CONNECTIONS")

_entry_calls = 0  # entry points called in this process: one error report each


class UsageError(ValueError):
    """A command-line mistake argparse found (unknown flag, invalid choice, bad value)."""


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


# ---------------------------------------------------------------------------------------------
# warnings
# ---------------------------------------------------------------------------------------------

def setup_warnings() -> None:
    """Rank 0 shows each warning once in one line; other ranks none; hide HIDDEN_WARNINGS.

    Filters given with -W or PYTHONWARNINGS are kept and take precedence."""
    if rank() != 0:
        warnings.simplefilter("ignore")
        return
    _hide(HIDDEN_WARNINGS)
    warnings.showwarning = _show_warning


def hide_library_warnings() -> None:
    """For Megatron-Core with Parm's dispatchers in a script of one's own (README, "Using it in
    Megatron-Core"): hide the warnings of HIDDEN_WARNINGS that Megatron-Core 0.16.1 and torch
    print about their own internals, each where it arises, and say once (on rank 0) which
    optional packages are missing. Opt in: call it before importing Megatron-Core. Nothing else
    changes (each is an ordinary warnings filter; -W and PYTHONWARNINGS still win)."""
    _hide([hidden for hidden in HIDDEN_WARNINGS if hidden.library])
    note = optional_packages_note()
    if note and rank() == 0:
        warnings.warn(note, stacklevel=2)


def _hide(entries) -> None:
    if sys.warnoptions:  # filters given with -W or PYTHONWARNINGS take precedence
        return
    for hidden in entries:
        warnings.filterwarnings("ignore", message=hidden.message, module=hidden.module + r"\Z")


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    text = " ".join(str(message).split())
    if _CUDA_ONLY_WARNING.search(text) and not _has_cuda():
        return
    where = os.path.relpath(filename, PROJECT_ROOT) if filename.startswith(PROJECT_ROOT) else \
        filename.rsplit("site-packages/", 1)[-1]
    stream = file or sys.stderr
    try:
        stream.write(f"warning: {text} [{category.__name__}, {where}:{lineno}]\n")
    except OSError:
        pass


def _has_cuda() -> bool:
    if "torch" not in sys.modules:  # this module never imports torch itself
        return False
    from megatron_parm import device

    return device.is_cuda()


def optional_packages_note() -> Optional[str]:
    """'optional packages not installed: ...' or None when all are there."""
    missing = [name for module, name in OPTIONAL_PACKAGES if importlib.util.find_spec(module) is None]
    if not missing:
        return None
    return (f"optional packages not installed: {', '.join(missing)} (Megatron-Core falls back "
            f"to its PyTorch implementations)")


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------

def is_user_error(error: BaseException) -> bool:
    """An argparse error, or a ValueError that a `raise` statement of this project's code
    raised: not one from a library, nor one Python raised inside our code (`a, b = [1]`)."""
    if isinstance(error, UsageError):
        return True
    if not isinstance(error, ValueError):
        return False
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and _is_project_file(frames[-1].filename) and \
        (frames[-1].line or "").lstrip().startswith("raise")


def _is_project_file(filename: str) -> bool:
    path = os.path.abspath(filename)
    if "site-packages" in path.split(os.sep) or os.sep + ".venv" + os.sep in path:
        return f"{os.sep}megatron_parm{os.sep}" in path  # a non-editable install of this package
    return path.startswith(PROJECT_ROOT + os.sep)


@contextlib.contextmanager
def argparse_errors_raise():
    """While active, argparse's error() raises UsageError instead of printing its usage and
    exiting, so the entry point reports it like any other mistake (--help still works)."""
    original = argparse.ArgumentParser.error

    def error(parser, message):
        raise UsageError(message)

    argparse.ArgumentParser.error = error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = original


def call(main: Callable, argv: Optional[Sequence[str]] = None) -> int:
    """Run main(argv) (main() when argv is None) and return its exit status; report an
    exception as described in the module docstring instead of raising it."""
    global _entry_calls
    _entry_calls += 1
    try:
        with argparse_errors_raise():
            status = main() if argv is None else main(list(argv))
        return int(status or 0)
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        return _report(exit_, str(exit_.code), USER_ERROR)  # sys.exit("message")
    except KeyboardInterrupt as interrupt:
        return _report(interrupt, "interrupted", 130)
    except BaseException as error:  # noqa: BLE001 - this is the top of the program
        if isinstance(error, BrokenPipeError) and _stdout_closed():
            # The reader went away (`tool | head`): stop quietly, with the status a Unix
            # tool that SIGPIPE ends has; whatever is still buffered goes nowhere.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return BROKEN_PIPE
        if is_user_error(error):
            return _report(error, str(error), USER_ERROR)
        if faults.is_communication_error(error) and faults.log_follow_on(error) \
                and os.environ.get(DEBUG_ENV, "") in ("", "0"):
            return BUG  # a peer died or hung: the launcher's line says which, this is in its log
        return _report(error, None, BUG)


def _stdout_closed() -> bool:
    """Whether standard output is a pipe nobody reads any more (not a socket of a peer)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & select.POLLERR for _, event in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll, no file descriptor
        return False


def _report(error: BaseException, message: Optional[str], status: int) -> int:
    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
    if debug:
        traceback.print_exception(error, file=sys.stderr)
    else:
        with _report_once() as first:
            if first and message is None:
                traceback.print_exception(error, file=sys.stderr)
            elif first:
                print(f"error: {message}", file=sys.stderr, flush=True)
    sys.stderr.flush()
    return status


@contextlib.contextmanager
def _report_once():
    """Yields True on the first rank of the job to report an error from this entry point:
    ranks add to a counter in torchrun's store (the agent's: it outlives the ranks), else in
    the default process group's; without either, rank 0 is the one. The others wait (up to
    10 s) until it has printed, so that torchrun, which stops all ranks once one has exited,
    does not stop it half-way."""
    if world_size() <= 1:
        yield True
        return
    key = (f"megatron_parm/error-report/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
           f"{_entry_calls}")
    try:
        store = _store()
        first = store.add(key, 1) == 1 if store is not None else rank() == 0
    except Exception:  # noqa: BLE001 - a store that cannot be reached: fall back to rank 0
        store, first = None, rank() == 0
    yield first
    if store is None:
        return
    from datetime import timedelta

    try:
        if first:
            store.set(key + "/printed", "1")
        else:
            store.wait([key + "/printed"], timedelta(seconds=10))
    except Exception:  # noqa: BLE001 - the first rank died before printing: nothing to wait for
        pass


def _store():
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_PORT" in os.environ:
        from datetime import timedelta

        from torch.distributed import TCPStore

        return TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]),
                        is_master=False, timeout=timedelta(seconds=10))
    distributed = getattr(sys.modules.get("torch"), "distributed", None)
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return distributed.distributed_c10d._get_default_store()
    return None


def run(main: Callable, argv: Optional[Sequence[str]] = None) -> None:
    """call(main, argv), then end the process with its status, promptly: after success the
    process groups main created are destroyed; then the exit handlers run (log files, TensorBoard,
    multiprocessing helpers) and the process ends without tearing down its modules one by one,
    which takes seconds with torch and Megatron-Core loaded (a rank stopped by SIGTERM must be
    gone well inside torchrun's 30 s)."""
    status = call(main, argv)
    if status == 0:
        destroy_process_groups()
    exit_now(status)


def exit_now(status: int) -> None:
    """Run the exit handlers, flush the standard streams and end the process. A failed run
    leaves its process groups as they are (a collective stuck on a dead peer would hold their
    destruction until its timeout)."""
    import atexit

    if status != 0:
        atexit.unregister(destroy_process_groups)
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(status)


def destroy_process_groups() -> None:
    """Megatron's model-parallel groups and torch.distributed's default group, if they exist."""
    distributed = getattr(sys.modules.get("torch"), "distributed", None)
    if distributed is None or not distributed.is_available() or not distributed.is_initialized():
        return
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None:
        parallel_state.destroy_model_parallel()
    distributed.destroy_process_group()
