"""The CPU's communication stream of Megatron-Core's combined 1F1B schedule
(megatron_parm.mcore_compat.comm_stream) and --delay-wgrad-compute's deferred expert weight
gradients: on one process, without process groups."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_parm import mcore_compat
from megatron_parm.mcore_compat import comm_stream
from megatron_parm.mcore_compat.comm_stream import Promise, WorkerStream

SLEEP = 0.2


def test_nodes_run_in_order_on_their_thread_while_the_caller_goes_on():
    stream, ran = WorkerStream(), []

    def node(name):
        def run():
            time.sleep(SLEEP)
            ran.append((name, threading.current_thread().name))
            return name
        return run

    start = time.perf_counter()
    first, second = stream.submit(node("a"), "a"), stream.submit(node("b"), "b")
    submitted = time.perf_counter() - start
    time.sleep(SLEEP)  # the caller's own work, while the stream runs
    assert (first.value(), second.value()) == ("a", "b")
    total = time.perf_counter() - start
    assert submitted < SLEEP / 4  # submitting does not wait
    assert total < 2.6 * SLEEP  # 2 nodes + the caller's work: not run one after the other
    assert [name for name, _ in ran] == ["a", "b"]
    assert {thread for _, thread in ran} == {"parm-comm-stream"}
    stats = stream.take_stats()
    assert stats["a"]["nodes"] == 1 and stats["a"]["busy_s"] >= SLEEP
    # the caller waited for the first node's remaining time only, not for its whole run
    assert stats["a"]["waited_s"] < SLEEP / 2, stats
    assert stream.take_stats() == {}


def test_an_error_in_a_node_is_raised_where_its_promise_is_resolved():
    stream = WorkerStream()

    def fail():
        raise ValueError("bad node")

    promise = stream.submit(fail)
    with pytest.raises(ValueError, match="bad node"):
        promise.value()
    assert stream.submit(lambda: 3).value() == 3  # the stream goes on


def test_compute_thread_calls_run_in_submission_order_when_a_later_node_is_resolved():
    """Work a node hands to the compute thread runs there, at the resolution of that node or
    of any later one, in the order the nodes were submitted: a point of the compute thread's
    program, the same on every rank."""
    stream, calls = WorkerStream(), []

    def node(name):
        def run():
            comm_stream.on_compute_thread(lambda: calls.append((name, threading.current_thread())))
            return name
        return run

    first = stream.submit(node("a"))
    second = stream.submit(node("b"))
    time.sleep(SLEEP)  # both have run on the worker; their calls wait for the compute thread
    assert calls == []
    assert second.value() == "b"  # resolving the later node settles the earlier one first
    assert calls == [("a", threading.current_thread()), ("b", threading.current_thread())]
    assert first.value() == "a" and len(calls) == 2  # settled once
    comm_stream.on_compute_thread(lambda: calls.append("now"))  # off the worker: at once
    assert calls[-1] == "now"


def test_resolved_args_waits_for_promises_and_spreads_a_promised_tuple():
    stream = WorkerStream()
    single = stream.submit(lambda: torch.ones(2))
    pair = stream.submit(lambda: (torch.zeros(1), torch.ones(1)))
    (tensor,) = comm_stream.resolved_args((single,))
    assert torch.equal(tensor, torch.ones(2))
    assert [t.tolist() for t in comm_stream.resolved_args((pair,))] == [[0.0], [1.0]]
    assert comm_stream.resolved_args((1, 2)) == (1, 2)
    assert not isinstance(comm_stream.resolved(single), Promise)


def test_a_forward_node_on_the_worker_excludes_recompute_rng_swaps():
    """While the worker runs a forward node (its dropout draws), activation recompute cannot
    swap the generators' states (Megatron's _fork_rng, taken by setup()): both hold RNG_LOCK."""
    mcore_compat.setup()
    if torch.cuda.is_available():
        pytest.skip("the CPU's communication stream only")
    from megatron.core.tensor_parallel import random as mrandom

    inside, order = threading.Event(), []

    def forward_node():
        with comm_stream.RNG_LOCK:
            inside.set()
            time.sleep(SLEEP)
            order.append("node")

    stream = WorkerStream()
    promise = stream.submit(forward_node)
    inside.wait()
    with mrandom._fork_rng():
        order.append("recompute")
    promise.value()
    assert order == ["node", "recompute"]


def test_a_forward_node_lets_recompute_in_while_it_waits_for_its_peers():
    """A forward node on the worker that waits in a collective lets RNG_LOCK go meanwhile: a
    recompute on the compute thread (which a peer may need, in a tensor-parallel collective,
    before it can join this one) runs then, and the node goes on after it."""
    mcore_compat.setup()
    if torch.cuda.is_available():
        pytest.skip("the CPU's communication stream only")
    from megatron.core.tensor_parallel import random as mrandom

    from megatron_parm.comm.collectives import Pending

    waiting, peers_done, order = threading.Event(), threading.Event(), []

    class PeersWork:  # a collective whose peers join once this process has recomputed
        def wait(self):
            waiting.set()
            peers_done.wait(10)

    def forward_node():
        with comm_stream.RNG_LOCK:
            Pending(PeersWork(), lambda: torch.zeros(1)).wait()
            order.append("node")

    promise = WorkerStream().submit(forward_node)
    assert waiting.wait(10)

    def recompute():
        with mrandom._fork_rng():
            order.append("recompute")
        peers_done.set()

    compute = threading.Thread(target=recompute, daemon=True)
    compute.start()
    compute.join(5)
    assert not compute.is_alive(), "the recompute waited for a node that waits for its peers"
    promise.value()
    assert order == ["recompute", "node"]


def _node_graph(stream_of_middle):
    """A three-node chain as Megatron's schedule runs one: compute -> (stream) -> compute,
    forward then backward through ScheduleNode; returns the output and the input's gradient."""
    from megatron.core.pipeline_parallel.utils import ScheduleNode

    compute = torch.cuda.current_stream()
    weight = torch.full((3,), 2.0, requires_grad=True)
    first = ScheduleNode(lambda x: x * weight, compute, torch.cuda.Event(), name="first")
    middle = ScheduleNode(lambda x: x.sin() + 1, stream_of_middle, torch.cuda.Event(),
                          name="moe_dispatch")
    last = ScheduleNode(lambda x: x * x, compute, torch.cuda.Event(), name="last")
    x = torch.tensor([0.1, 0.2, 0.3], requires_grad=True)
    out = last.forward(middle.forward(first.forward(x)))
    grad = first.backward(middle.backward(last.backward(torch.ones(3))))
    return out.detach(), grad, weight.grad


def test_megatron_schedule_nodes_on_the_worker_compute_what_they_compute_inline():
    """ScheduleNode._forward / _backward as setup() leaves them: a node on a WorkerStream runs
    there (a Promise comes back) and the next node waits for it; values and gradients equal
    those of the same nodes run in order on one thread."""
    mcore_compat.setup()
    if torch.cuda.is_available():
        pytest.skip("the CPU's communication stream only")
    worker = WorkerStream()
    inline = _node_graph(torch.cuda.current_stream())
    threaded = _node_graph(worker)
    for a, b in zip(inline, threaded):
        assert torch.equal(a, b)
    stats = worker.take_stats()
    assert stats["moe_dispatch forward"]["nodes"] == 1
    assert stats["moe_dispatch backward"]["nodes"] == 1


def test_delayed_expert_weight_gradients_wait_for_backward_dw():
    """--delay-wgrad-compute: TorchGroupedMLP's training calls leave their weight gradients
    to backward_dw(), oldest call first (a micro-batch's forward may come before the previous
    one's backward_dw), equal to the gradients computed at once."""
    from types import SimpleNamespace

    from megatron_parm.experts import TorchGroupedMLP

    def run(delay):
        torch.manual_seed(0)
        experts = object.__new__(TorchGroupedMLP)
        torch.nn.Module.__init__(experts)
        config = SimpleNamespace(hidden_size=8, moe_apply_probs_on_input=False,
                                 delay_wgrad_compute=delay)
        experts.config, experts.num_local_experts = config, 2
        experts.weight1 = torch.nn.Parameter(torch.randn(8, 2 * 8))
        experts.weight2 = torch.nn.Parameter(torch.randn(2 * 8, 8))
        experts.activation_recompute, experts._deferred = False, None
        experts.defer_weight_grads, experts._delayed = True, []
        experts._gmm = torch.nn.functional.grouped_mm if hasattr(
            torch.nn.functional, "grouped_mm") else torch._grouped_mm
        experts.activation_func_with_probs = lambda h, p: torch.relu(h) * p
        tokens = torch.tensor([3, 2])
        grads = []
        for _ in range(2):  # two micro-batches: both forwards before the first backward_dw
            rows = torch.randn(5, 8, requires_grad=True)
            out, _ = experts(rows, tokens, torch.rand(5))
            grads.append((rows, out))
        for rows, out in grads:
            before = experts.weight1.grad
            before = None if before is None else before.clone()
            out.sum().backward()
            if delay:  # the backward left the weights alone; backward_dw adds this call's
                after = experts.weight1.grad
                assert (after is None) if before is None else torch.equal(after, before)
                experts.backward_dw()
                assert experts.weight1.grad is not None
                assert before is None or not torch.equal(experts.weight1.grad, before)
        assert experts._delayed == []
        return experts.weight1.grad.clone(), experts.weight2.grad.clone(), \
            [rows.grad for rows, _ in grads]

    at_once, delayed = run(False), run(True)
    assert torch.allclose(at_once[0], delayed[0], atol=1e-5)
    assert torch.allclose(at_once[1], delayed[1], atol=1e-5)
    for a, b in zip(at_once[2], delayed[2]):
        assert torch.equal(a, b)
