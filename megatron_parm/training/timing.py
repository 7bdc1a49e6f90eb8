"""Where a training step's time goes (--parm-timing-breakdown, --parm-timing-file; declared in
megatron_parm.settings): host timers over exclusive regions of the step, forward and
backward, with the device synchronised at every boundary.

    StepTimer.install(model, optimizer, config, args)   the timer (a no-op one without the flags)
      .step_start() / .step_end(iteration, losses)      around one training iteration
      .log(iteration)                   the logged iterations' mean breakdown: one line on rank 0,
                                        a JSON line with --parm-timing-file (its "tuning": a
                                        dispatcher measured candidates in these iterations)
      .close()                          hooks removed, Megatron-Core's functions restored

Categories (ms per iteration, mean over ranks; they add up to the step):
  moe_dispatch, moe_experts, moe_combine   each MoE layer: the router and the dispatcher's
      phases up to the experts, the experts' module, the phases after it; forward and backward.
      A pipelined schedule (parm_s2) interleaves its phases with the experts' chunks: its
      non-expert time is moe_dispatch_combine.
  moe_comm_wait      --overlap-moe-expert-parallel-comm on the CPU: the compute thread waiting
                     for the communication stream's nodes (their part that the other
                     micro-batch's work did not hide). The layers' other work runs in
                     Megatron-Core's schedule nodes, not in the modules' forward: attention and
                     the dispatcher's local phases count as rest there, the experts as before.
  attention_dense    the rest of each transformer layer: layer norms, attention, a dense MLP,
                     residuals (their TP/SP collectives excluded)
  tp_sp              Megatron-Core's tensor- and sequence-parallel collectives outside the MoE
                     layers (all-gathers and reduce-scatters of SP, TP all-reduces; an
                     asynchronous one from its start to the end of its wait)
  dp_grad_reduce     finalize_model_grads: the data-parallel (and expert-data-parallel)
                     gradient reduction, or what is left of it to wait for with
                     --overlap-grad-reduce
  optimizer          optimizer.step(): gradient norm and clipping, Adam, the distributed
                     optimizer's parameter all-gather
  rest               everything else: data, embedding, loss, the loss reduction

With --overlap-moe-expert-parallel-comm on the CPU each logged record also has "comm_stream":
per kind of communication node (the MoE dispatch and combine, forward and backward), ms per
iteration it ran on its thread (busy), ms the compute thread waited for it (waited), and the
share hidden, 1 - waited / busy (mcore_compat.comm_stream measures them).

Where the host is Linux each logged record also has, over the steps, mean over ranks:
  host_cpu_busy   the share of the host's cores busy (anything but idle and iowait, every
                  process; /proc/stat). On the emulated cluster every rank shares this
                  machine's cores: with the same CPU work a step cannot drop below busy x step,
                  so an overlap's speed-up is at most 1 / busy.
  net_tx_bytes    bytes per iteration sent by the rank's network namespace (/proc/net/dev):
                  "loopback" (lo) and "network" (every other interface). On the emulated
                  cluster a node's ranks share one namespace, so these are the node's: its
                  intra-node traffic leaves through lo, its inter-node traffic through eth0,
                  each shaped at its preset's rate (bench/e2e.py turns them into link busy
                  shares). NCCL's NVLink and InfiniBand traffic does not pass these counters.

How: a module's forward is bracketed by its forward pre-hook and hook, its backward by an
identity autograd function on its input and output (its output's gradient arrives first, its
input's last). Time between two boundaries goes to the innermost open region. TP/SP
collectives are timed by wrapping Megatron-Core's collective functions (tensor_parallel's
mappings and layers modules) while the timer is installed; they are restored by close().
Every boundary calls device.synchronize(): on a GPU the breakdown serialises streams that
would overlap (and so costs some throughput); on CPU it is free. Backward boundaries depend on
autograd's order: work that autograd runs between a layer's output and input gradients is
counted in that layer.
"""

from __future__ import annotations

import json
import time
from typing import Optional

import torch

from megatron_parm import device
from megatron_parm.backward_hook import on_backward
from megatron_parm.mcore_compat import comm_stream

CATEGORIES = ("moe_dispatch", "moe_experts", "moe_combine", "moe_dispatch_combine",
              "moe_comm_wait", "attention_dense", "tp_sp", "dp_grad_reduce", "optimizer", "rest")
SHORT_NAMES = {"moe_dispatch": "dispatch", "moe_experts": "experts", "moe_combine": "combine",
               "moe_dispatch_combine": "dispatch+combine", "moe_comm_wait": "comm wait",
               "attention_dense": "attn+dense", "tp_sp": "tp/sp comm",
               "dp_grad_reduce": "dp grad reduce", "optimizer": "optimizer", "rest": "rest"}
# The combined 1F1B's communication nodes, as the breakdown names them (comm_stream's names).
COMM_NODES = {"moe_dispatch forward": "dispatch fwd", "moe_combine forward": "combine fwd",
              "moe_combine backward": "combine bwd", "moe_dispatch backward": "dispatch bwd"}


HOST_COUNTERS = ("cpu_busy", "cpu_total", "loopback", "network")


def host_counters() -> Optional[list]:
    """[busy, total] clock ticks of all the host's cores since boot (/proc/stat's "cpu" line;
    idle and iowait are not busy) + [loopback, network] bytes sent by this process's network
    namespace (/proc/net/dev), as HOST_COUNTERS names them; None without /proc (not Linux)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        sent = [0, 0]
        with open("/proc/net/dev") as f:
            for line in f.readlines()[2:]:
                name, counters = line.split(":", 1)
                sent[name.strip() != "lo"] += int(counters.split()[8])  # transmitted bytes
    except (OSError, ValueError, IndexError):
        return None
    idle = sum(ticks[3:5])  # idle, iowait
    total = sum(ticks[:8])  # user nice system idle iowait irq softirq steal (guest: in user)
    return [total - idle, total] + sent


def _mark(value, callback):
    """value (a tensor, or a tuple / list whose first item is one) with a backward boundary
    on its tensor; unchanged where no gradient flows."""
    if torch.is_tensor(value):
        return on_backward(value, lambda grad: callback())
    if isinstance(value, (tuple, list)) and value and torch.is_tensor(value[0]):
        return type(value)([_mark(value[0], callback), *value[1:]])
    return value


class _TimedWork:
    """An asynchronous collective's handle whose wait() is timed as the collective."""

    def __init__(self, work, timer: "StepTimer", category: str):
        self._work, self._timer, self._category = work, timer, category

    def wait(self, *args, **kwargs):
        self._timer.push(self._category, outside_moe=True)
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._timer.pop()

    def __getattr__(self, name):
        return getattr(self._work, name)


class NullTimer:
    """What StepTimer.install returns without the flags: every call does nothing."""

    enabled = False

    def step_start(self) -> None:
        pass

    def step_end(self, iteration: int, losses: Optional[dict] = None) -> None:
        pass

    def log(self, iteration: int) -> None:
        pass

    def close(self) -> None:
        pass


class StepTimer:
    """The exclusive-region timer of one pretrain() run (see the module docstring)."""

    enabled = True

    @classmethod
    def install(cls, model, optimizer, config, args):
        if not (args.parm_timing_breakdown or args.parm_timing_file):
            return NullTimer()
        return cls(model, optimizer, config, args)

    def __init__(self, model, optimizer, config, args):
        from megatron.core.transformer.transformer_layer import TransformerLayer

        from megatron_parm.training.model import moe_layers

        self.path = args.parm_timing_file
        self.dispatcher = args.moe_token_dispatcher_type
        self.tokens_per_iteration = args.global_batch_size * args.seq_length
        self.stack: list = []
        self.totals = dict.fromkeys(CATEGORIES, 0.0)
        self.interval = dict.fromkeys(CATEGORIES, 0.0)
        self.interval_steps, self.interval_losses = 0, {}
        self.in_step, self.last = False, 0.0
        self.host_start = None  # host_counters() at the step's start
        self.host = [0] * len(HOST_COUNTERS)  # the interval's increments over its steps
        self.interval_tuning = False  # a layer's dispatcher measured candidates (parm's tuning)
        self.handles, self.restore = [], []
        self.stream = comm_stream.worker_stream() if config.overlap_moe_expert_parallel_comm \
            else None
        self.comm = {}  # the interval's comm_stream stats, summed over its steps
        if self.stream is not None:
            self.stream.take_stats()  # from this run's first step on
            self.restore.append(comm_stream.observe_waits(lambda: self.region("moe_comm_wait")))

        for chunk in model:
            for module in chunk.modules():
                if isinstance(module, TransformerLayer):
                    self._bracket(module, lambda: ("attention_dense",))
        self.moe = moe_layers(model)
        for layer in self.moe:
            pipelined = bool(getattr(layer.token_dispatcher, "pipelined", False))
            first = "moe_dispatch_combine" if pipelined else "moe_dispatch"
            last = "moe_dispatch_combine" if pipelined else "moe_combine"
            # forward: dispatch -> experts -> combine; backward: combine -> experts -> dispatch
            self._bracket(layer, lambda first=first: (first,), lambda last=last: (last,))
            self._bracket(layer.experts, lambda: ("moe_experts",),
                          after_forward=lambda last=last: self._rename_top(last),
                          after_backward=lambda first=first: self._rename_top(first))
        self._wrap_collectives()
        finalize = config.finalize_model_grads_func
        if finalize is not None:
            def timed_finalize(*a, **k):
                with self.region("dp_grad_reduce"):
                    return finalize(*a, **k)
            config.finalize_model_grads_func = timed_finalize
            self.restore.append(lambda: setattr(config, "finalize_model_grads_func", finalize))
        step = optimizer.step

        def timed_step(*a, **k):
            with self.region("optimizer"):
                return step(*a, **k)
        optimizer.step = timed_step
        self.restore.append(lambda: setattr(optimizer, "step", step))

    # -- the region stack ---------------------------------------------------------------

    def _advance(self) -> None:
        device.synchronize()
        now = time.perf_counter()
        self.interval[self.stack[-1] if self.stack else "rest"] += now - self.last
        self.last = now

    def push(self, category: str, outside_moe: bool = False) -> None:
        """Open a region; with outside_moe, count it only where no MoE region is open (a TP
        collective inside an MoE layer is that layer's dispatch or combine)."""
        if not self.in_step or comm_stream.on_worker():  # the compute thread's time only
            return
        if outside_moe and any(c.startswith("moe_") for c in self.stack):
            self.stack.append(self.stack[-1])  # keep counting where we are
            return
        self._advance()
        self.stack.append(category)

    def pop(self) -> None:
        if not self.in_step or not self.stack or comm_stream.on_worker():
            return
        self._advance()
        self.stack.pop()

    def _rename_top(self, category: str) -> None:
        """Leave the innermost region and continue in `category` at the same depth."""
        if self.in_step and self.stack and not comm_stream.on_worker():
            self._advance()
            self.stack[-1] = category

    def region(self, category: str, outside_moe: bool = False):
        timer = self

        class _Region:
            def __enter__(self):
                timer.push(category, outside_moe)

            def __exit__(self, *exc):
                timer.pop()
        return _Region()

    # -- hooks ----------------------------------------------------------------------------

    def _bracket(self, module, forward_category, backward_category=None,
                 after_forward=None, after_backward=None) -> None:
        """Open forward_category()[0] from the module's forward pre-hook to its forward
        hook, and backward_category()[0] (default the same) from its output's gradient to its
        input's. after_forward / after_backward replace the closing pop (they rename the
        enclosing region instead)."""
        backward_category = backward_category or forward_category
        close_forward = after_forward or (lambda: None)
        close_backward = after_backward or (lambda: None)

        def pre(module, args, kwargs):
            self.push(forward_category()[0])
            # the input's gradient closes the backward region
            callback = self._closer(close_backward)
            if args:
                return (_mark(args[0], callback), *args[1:]), kwargs
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": _mark(kwargs["hidden_states"], callback)}
            return None

        def post(module, args, output):
            self.pop()
            close_forward()
            return _mark(output, lambda: self.push(backward_category()[0]))

        self.handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        self.handles.append(module.register_forward_hook(post))

    def _closer(self, after):
        def close():
            self.pop()
            after()
        return close

    def _wrap_collectives(self) -> None:
        from megatron.core.tensor_parallel import layers, mappings

        def wrap(module, name):
            original = getattr(module, name)

            def timed(*args, **kwargs):
                self.push("tp_sp", outside_moe=True)
                try:
                    result = original(*args, **kwargs)
                finally:
                    self.pop()
                if kwargs.get("async_op") and result is not None:
                    return _TimedWork(result, self, "tp_sp")
                return result
            setattr(module, name, timed)
            self.restore.append(lambda: setattr(module, name, original))

        for name in ("_reduce", "_gather_along_first_dim", "_reduce_scatter_along_first_dim",
                     "_gather_along_last_dim", "_reduce_scatter_along_last_dim"):
            wrap(mappings, name)
        for name in ("dist_all_gather_func", "dist_reduce_scatter_func"):
            if hasattr(layers, name):
                wrap(layers, name)

    # -- steps and reports ------------------------------------------------------------------

    def _tuning(self) -> bool:
        from megatron_parm.training.model import still_tuning

        return still_tuning(self.moe)

    def step_start(self) -> None:
        self.interval_tuning |= self._tuning()
        self.stack = []
        self.in_step = True
        device.synchronize()
        self.last = time.perf_counter()
        self.host_start = host_counters()

    def step_end(self, iteration: int, losses: Optional[dict] = None) -> None:
        self._advance()
        self.in_step, self.stack = False, []
        self.interval_steps += 1
        now = host_counters()
        if now is not None and self.host_start is not None:
            self.host = [sum_ + end - start
                         for sum_, end, start in zip(self.host, now, self.host_start)]
        self.interval_tuning |= self._tuning()
        for name, value in (losses or {}).items():
            self.interval_losses[name] = self.interval_losses.get(name, 0.0) + value
        if self.stream is not None:
            for name, stats in self.stream.take_stats().items():
                summed = self.comm.setdefault(name, {"busy_s": 0.0, "waited_s": 0.0})
                summed["busy_s"] += stats["busy_s"]
                summed["waited_s"] += stats["waited_s"]

    def summary(self) -> dict:
        """The interval's mean ms per iteration per category, averaged over the ranks, and
        the slowest rank's step; resets the interval. Collective."""
        steps = max(self.interval_steps, 1)
        values = [self.interval[c] * 1e3 / steps for c in CATEGORIES]
        step_ms = sum(values)
        comm = [self.comm.get(name, {}).get(key, 0.0) * 1e3 / steps
                for name in COMM_NODES for key in ("busy_s", "waited_s")]
        mean = torch.tensor(values + [step_ms] + comm + self.host, dtype=torch.float64,
                            device=device.current())
        slowest = torch.tensor([step_ms], dtype=torch.float64, device=device.current())
        torch.distributed.all_reduce(mean)
        torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
        mean = (device.to_host(mean) / torch.distributed.get_world_size()).tolist()
        n = len(CATEGORIES)
        record = {"ms": dict(zip(CATEGORIES, mean[:n])), "step_ms": mean[n],
                  "slowest_rank_step_ms": device.to_host(slowest).item(),
                  "iterations": self.interval_steps, "tuning": self.interval_tuning,
                  "losses": {k: v / steps for k, v in self.interval_losses.items()}}
        node_ms, host = mean[n + 1:-len(HOST_COUNTERS)], mean[-len(HOST_COUNTERS):]
        host = dict(zip(HOST_COUNTERS, host))
        if host["cpu_total"] > 0:
            record["host_cpu_busy"] = host["cpu_busy"] / host["cpu_total"]
            record["net_tx_bytes"] = {name: host[name] / steps for name in HOST_COUNTERS[2:]}
        if self.stream is not None:
            record["comm_stream"] = {
                name: {"busy_ms": busy, "waited_ms": waited,
                       "hidden": 1.0 - waited / busy if busy > 0 else None}
                for name, busy, waited in zip(COMM_NODES, node_ms[0::2], node_ms[1::2])}
        self.comm, self.host = {}, [0] * len(HOST_COUNTERS)
        for category in CATEGORIES:
            self.totals[category] += self.interval[category]
        self.interval = dict.fromkeys(CATEGORIES, 0.0)
        self.interval_steps, self.interval_losses = 0, {}
        self.interval_tuning = False
        return record

    def log(self, iteration: int) -> None:
        """One line on rank 0 (and a JSON line with --parm-timing-file) for the iterations
        since the last call. Collective."""
        record = self.summary()
        if torch.distributed.get_rank() != 0:
            return
        print(breakdown_line(record), flush=True)
        if self.path:
            record.update(iteration=iteration, dispatcher=self.dispatcher,
                          tokens_per_iteration=self.tokens_per_iteration)
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        for restore in reversed(self.restore):
            restore()
        self.handles, self.restore = [], []


def breakdown_line(record: dict) -> str:
    """' time breakdown (ms/iteration, mean over ranks): dispatch 1.2 | ... | step 20.0'"""
    parts = [f"{SHORT_NAMES[c]} {record['ms'][c]:.1f}" for c in CATEGORIES
             if record["ms"][c] > 0 or c in ("attention_dense", "rest")]
    line = (f" time breakdown (ms/iteration, mean over ranks): {' | '.join(parts)} | "
            f"step {record['step_ms']:.1f} (slowest rank {record['slowest_rank_step_ms']:.1f})")
    if "host_cpu_busy" in record:
        line += f", host CPU {100 * record['host_cpu_busy']:.0f}% busy"
    nodes = [f"{COMM_NODES[name]} {stats['busy_ms']:.1f} ({100 * stats['hidden']:.0f}% hidden)"
             for name, stats in record.get("comm_stream", {}).items() if stats["hidden"] is not None]
    if nodes:
        line += f"\n comm stream (ms/iteration, share hidden): {' | '.join(nodes)}"
    return line
