"""Megatron-Core's combined 1F1B schedule on the CPU: a communication stream that is a thread.

Megatron-Core 0.16.1's combined 1F1B (``--overlap-moe-expert-parallel-comm``) cuts each
transformer layer of two micro-batches into schedule nodes (attention, MoE dispatch, experts,
MoE combine) and interleaves one micro-batch's forward with another's backward, the dispatch
and combine nodes on a second CUDA stream: one micro-batch's all-to-alls run while the other
computes. Where streams do nothing (the CPU: mcore_compat's ``streams`` redirect) every node
runs in turn on the one thread, and nothing overlaps.

Here the communication stream is a thread (``WorkerStream``). A node on it is submitted, not
run: its caller gets a ``Promise`` of the node's result and goes on with the next node on
the compute stream (the calling thread), as a host enqueues kernels. A node that is handed a
Promise waits for it first, where the result is first needed, as the CUDA event a node waits
on would make it. Everything Megatron's schedule code sees outside the nodes is resolved:
``TransformerModelChunkSchedulePlan.run`` returns, and calls its pipeline callbacks with,
tensors (``run_chunk``).

What keeps it exact and free of deadlocks:
  * one worker per process runs the nodes in the order they were submitted (a stream); its
    nodes only wait for their peers' workers (their collectives), never for this process's
    compute thread, whose results they receive as tensors;
  * a process group is used from one thread: the dispatch and combine nodes' collectives (EP,
    expert-TP, parm_hier's node groups) on the worker, everything else on the compute thread,
    so every group's collectives are issued in the same order on every rank;
  * random numbers: the nodes that draw them (dropout in the combine node, on the worker;
    attention's on the compute thread) are ordered by their data, and activation recompute's
    swap of the generator states (Megatron's ``_fork_rng``) excludes the worker's forward
    nodes (``RNG_LOCK``), so every dropout mask is the one the plain schedule draws; the
    worker lets the lock go while it waits for its peers in a collective
    (``rng_lock_released``): held there, it stopped a peer whose compute thread recomputed
    under the lock, in a tensor-parallel collective with this rank's compute thread, which
    waited for the lock (a deadlock of 8 ranks, MLA's selective recompute at TP 2);
  * work that must keep the compute thread's order across ranks (a gradient hook that may
    start a data-parallel reduction, ``on_compute_thread``) is queued by the worker and run
    by the compute thread when it resolves that node's Promise, a point of its program that
    is the same on every rank.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Optional

import torch

# Held by the worker while it runs a forward node and by activation recompute while it swaps
# the random generators' states (re-entrant: the compute thread may nest recomputations).
RNG_LOCK = threading.RLock()

_WORKER = threading.local()  # .task: the task the worker thread is running
# Context-manager factories entered around every wait of the compute thread for the worker
# (the step-time breakdown's: observe_waits).
_WAIT_OBSERVERS: List[Callable[[], Any]] = []


class _Task:
    """One node submitted to the worker: its result and the compute-thread calls it queued."""

    def __init__(self, run: Callable[[], Any], name: str, node=None):
        self.run, self.name, self.node = run, name, node
        # who is told how long the compute thread waited for it (charge_waits); a node's
        # backward inherits its forward's
        self.account: Optional[Callable[[float], None]] = getattr(node, "wait_account", None)
        self.future: Future = Future()
        self.deferred: List[Callable[[], None]] = []
        self.settled = False  # its deferred calls have run on the compute thread


class WorkerStream:
    """A stream whose work is a thread: nodes run one after the other, in submission order.

    Quacks like the do-nothing host stream where Megatron's code handles streams (events,
    ``torch.cuda.stream``, ``record_stream`` are the ``streams`` redirect's no-ops). The
    thread is a daemon started on the first submission: a node stuck in a collective with a
    dead peer does not hold the process's exit.
    """

    def __init__(self, *args, **kwargs):
        self._queue: "queue.SimpleQueue[Optional[_Task]]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._open: List[_Task] = []  # submitted, not yet settled, in submission order
        # per node name: seconds the worker ran such nodes, seconds the compute thread waited
        # for them (the part of their time it did not hide), and how many ran
        self.busy: Dict[str, float] = {}
        self.waited: Dict[str, float] = {}
        self.count: Dict[str, int] = {}

    # -- the stream protocol of the streams redirect's host stream --------------------------
    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event

    def query(self) -> bool:
        return all(task.future.done() for task in self._open)

    def synchronize(self) -> None:
        self.settle_all()

    # -- work ---------------------------------------------------------------------------
    def submit(self, run: Callable[[], Any], name: str = "node", node=None) -> "Promise":
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="parm-comm-stream",
                                            daemon=True)
            self._thread.start()
        task = _Task(run, name, node)
        self._open.append(task)
        self._queue.put(task)
        return Promise(self, task)

    def _serve(self) -> None:
        while True:
            # The task runs in a call of its own: nothing of it (its node, its result) stays
            # referenced by this loop while the worker waits for the next one. A loop variable
            # kept the last task of a run alive into the next run, and with it the collectives'
            # work and the destroyed process groups of the previous run: their gloo threads (48
            # on 4 ranks) ran on beside the next run's work.
            self._run(self._queue.get())

    def _run(self, task: _Task) -> None:
        _WORKER.task = task
        start = time.perf_counter()
        try:
            result = task.run()
        except BaseException as error:  # raised again where the Promise is resolved
            task.future.set_exception(error)
        else:
            self.busy[task.name] = self.busy.get(task.name, 0.0) + time.perf_counter() - start
            task.future.set_result(result)
        finally:
            _WORKER.task = None

    def settle(self, task: _Task) -> None:
        """Wait for TASK and every task submitted before it; run their queued compute-thread
        calls in submission order (the same point of the program on every rank)."""
        while self._open:
            first = self._open[0]
            with contextlib.ExitStack() as observers:
                for observer in _WAIT_OBSERVERS:
                    observers.enter_context(observer())
                start = time.perf_counter()
                first.future.exception()  # waits; an error is raised by its own Promise
                waited = time.perf_counter() - start
            self.waited[first.name] = self.waited.get(first.name, 0.0) + waited
            if first.account is not None:
                first.account(waited)
            self.count[first.name] = self.count.get(first.name, 0) + 1
            self._open.pop(0)
            first.settled = True
            for call in first.deferred:
                call()
            if first is task:
                return

    def settle_all(self) -> None:
        if self._open:
            self.settle(self._open[-1])

    def take_stats(self) -> Dict[str, Dict[str, float]]:
        """Per node name since the last call: nodes run, seconds on the worker, seconds the
        compute thread waited for them; then zero."""
        self.settle_all()
        stats = {name: {"nodes": self.count[name], "busy_s": self.busy.get(name, 0.0),
                        "waited_s": self.waited.get(name, 0.0)} for name in self.count}
        self.busy, self.waited, self.count = {}, {}, {}
        return stats


class Promise:
    """The result of a node submitted to a WorkerStream (``value()`` waits for it)."""

    def __init__(self, stream: WorkerStream, task: _Task):
        self.stream, self.task = stream, task

    def value(self):
        if not self.task.settled:
            self.stream.settle(self.task)
        return self.task.future.result()


def resolved(value):
    """VALUE, or what it promises (waiting for it)."""
    return value.value() if isinstance(value, Promise) else value


def resolved_args(args: tuple) -> tuple:
    """A node's arguments with promises waited for; a single promised tuple is spread, as
    ScheduleNode.forward/backward spread a tuple they are given."""
    args = tuple(resolved(arg) for arg in args)
    if len(args) == 1 and isinstance(args[0], tuple):
        return args[0]
    return args


def on_worker() -> bool:
    return getattr(_WORKER, "task", None) is not None


def observe_waits(observer: Callable[[], Any]) -> Callable[[], None]:
    """Enter OBSERVER() (a context manager) around every wait of the compute thread for the
    worker from now on; returns the function that stops it."""
    _WAIT_OBSERVERS.append(observer)
    return lambda: _WAIT_OBSERVERS.remove(observer)


def worker_stream() -> Optional[WorkerStream]:
    """The combined 1F1B's communication stream where it is a WorkerStream (else None)."""
    from megatron.core.pipeline_parallel.utils import get_comm_stream

    stream = get_comm_stream()
    return stream if isinstance(stream, WorkerStream) else None


def charge_waits(account: Callable[[float], None]) -> None:
    """On the worker, inside a node: ACCOUNT(seconds) is told every wait of the compute
    thread for this node, and later for its backward (parm's tuning times so what a schedule
    leaves on the compute thread's path). Elsewhere nothing happens."""
    task = getattr(_WORKER, "task", None)
    if task is not None:
        task.account = account
        if task.node is not None:
            task.node.wait_account = account


@contextlib.contextmanager
def rng_lock_released():
    """On the worker, RNG_LOCK let go for the block (a wait for peers: no random number is
    drawn in it) and taken back after; elsewhere nothing. A recompute that runs meanwhile
    restores the generator states before it lets the lock go, so the worker's next draws are
    the ones it would have made."""
    if not on_worker() or not RNG_LOCK._is_owned():
        yield
        return
    state = RNG_LOCK._release_save()
    try:
        yield
    finally:
        RNG_LOCK._acquire_restore(state)


def on_compute_thread(call: Callable[[], None]) -> None:
    """Run CALL now, or, on the worker, when the compute thread resolves the running node."""
    task = getattr(_WORKER, "task", None)
    if task is None:
        call()
    else:
        task.deferred.append(call)


# ---------------------------------------------------------------------------------------------
# the patches (mcore_compat's ``combined_1f1b_streams`` redirect applies them on the CPU)
# ---------------------------------------------------------------------------------------------


def _node_call(original: Callable, forward: bool) -> Callable:
    """ScheduleNode._forward / _backward: submitted where the node's stream is a worker,
    else run on this thread once its promised arguments are there."""

    def call(node, *args):
        if isinstance(node.stream, WorkerStream):
            grad_enabled = torch.is_grad_enabled()

            def run():
                with torch.set_grad_enabled(grad_enabled), \
                        (RNG_LOCK if forward else contextlib.nullcontext()):
                    return original(node, *resolved_args(args))

            return node.stream.submit(run, f"{node.name} {'forward' if forward else 'backward'}",
                                      node)
        return original(node, *resolved_args(args))

    return call


def _chunk_run(original: Callable) -> Callable:
    """TransformerModelChunkSchedulePlan.run with its pipeline callbacks and its result
    resolved: no Promise leaves a model chunk's step."""

    def run(f_schedule_plan, b_schedule_plan, b_grad=None, pre_forward=None, pre_backward=None,
            post_forward=None, post_backward=None):
        def resolving(callback):
            if callback is None:
                return None
            return lambda tensor, *rest: callback(resolved(tensor), *rest)

        out = original(f_schedule_plan, b_schedule_plan, b_grad=b_grad, pre_forward=pre_forward,
                       pre_backward=pre_backward, post_forward=resolving(post_forward),
                       post_backward=resolving(post_backward))
        out = resolved(out)
        stream = worker_stream()
        if stream is not None:
            stream.settle_all()
        return out

    return run


def _locked(context_manager: Callable) -> Callable:
    @contextlib.contextmanager
    def locked(*args, **kwargs):
        with RNG_LOCK, context_manager(*args, **kwargs):
            yield

    return locked


def patch(compute_stream) -> None:
    """Make Megatron's combined 1F1B communication stream a WorkerStream (COMPUTE_STREAM: the
    streams redirect's host stream), its nodes submitted there, and recompute's generator
    swaps exclusive with the worker's forward nodes."""
    from megatron.core.models.common import model_chunk_schedule_plan as plans
    from megatron.core.pipeline_parallel import utils
    from megatron.core.tensor_parallel import random as mrandom

    from megatron_parm.comm import collectives

    utils.ScheduleNode._forward = _node_call(utils.ScheduleNode._forward, forward=True)
    utils.ScheduleNode._backward = _node_call(utils.ScheduleNode._backward, forward=False)
    chunk = plans.TransformerModelChunkSchedulePlan
    chunk.run = staticmethod(_chunk_run(chunk.run))
    mrandom._fork_rng = _locked(mrandom._fork_rng)
    if rng_lock_released not in collectives.WAIT_CONTEXTS:
        collectives.WAIT_CONTEXTS.append(rng_lock_released)
    # Megatron's own set_streams with both streams given; its later calls keep them.
    utils.set_streams(comp_stream=compute_stream, comm_stream=WorkerStream())
