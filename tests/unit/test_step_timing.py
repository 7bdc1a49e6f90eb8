"""The training loop's time breakdown (training/timing.py) and Megatron-LM's data-parallel
flags (training/ddp.py): their pure parts, on CPU without process groups."""

from __future__ import annotations

import argparse
import time

import pytest
import torch

from megatron_parm.training import arguments, ddp, timing

SLEEP = 0.05


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        time.sleep(SLEEP)
        return grad * 2


class Inner(torch.nn.Module):
    """Sleeps SLEEP forward and SLEEP backward."""

    def forward(self, x):
        time.sleep(SLEEP)
        return _SlowBackward.apply(x)


class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        return self.inner(x) + 1


def bare_timer():
    """A StepTimer with no hooks yet (its constructor needs Megatron's modules)."""
    timer = timing.StepTimer.__new__(timing.StepTimer)
    timer.stack, timer.handles, timer.restore, timer.moe = [], [], [], []
    timer.interval = dict.fromkeys(timing.CATEGORIES, 0.0)
    timer.interval_steps, timer.interval_losses, timer.interval_tuning = 0, {}, False
    timer.in_step, timer.last = False, 0.0
    timer.stream, timer.comm = None, {}
    timer.host_start, timer.host = None, [0] * len(timing.HOST_COUNTERS)
    return timer


def test_regions_take_forward_and_backward_time_of_the_innermost_module():
    model, timer = Outer(), bare_timer()
    timer._bracket(model, lambda: ("attention_dense",))
    timer._bracket(model.inner, lambda: ("moe_experts",))
    x = torch.ones(4, requires_grad=True)
    timer.step_start()
    model(x).sum().backward()
    time.sleep(SLEEP)  # after the model: the rest of the step
    timer.step_end(1, {"lm loss": 1.0})
    ms = timer.interval
    assert ms["moe_experts"] >= 2 * SLEEP, ms  # forward and backward
    assert ms["attention_dense"] < SLEEP and ms["rest"] >= SLEEP, ms
    assert sum(ms.values()) == pytest.approx(ms["moe_experts"] + ms["attention_dense"]
                                             + ms["rest"])
    assert x.grad.tolist() == [2.0] * 4  # the boundaries pass the gradient through
    for handle in timer.handles:
        handle.remove()


def test_outside_moe_regions_count_as_the_moe_phase_they_occur_in():
    timer = bare_timer()
    timer.step_start()
    timer.push("moe_dispatch")
    with timer.region("tp_sp", outside_moe=True):
        time.sleep(SLEEP)
    timer.pop()
    assert timer.interval["moe_dispatch"] >= SLEEP and timer.interval["tp_sp"] == 0
    with timer.region("tp_sp", outside_moe=True):
        time.sleep(SLEEP)
    timer.step_end(1)
    assert timer.interval["tp_sp"] >= SLEEP


def test_host_counters_see_this_process_busy_a_sleep_idle_and_bytes_sent():
    """The host's busy ticks grow while this process computes; a sleep adds total ticks (the
    other core may be busy with anything else: only the bounds are asserted); a message to
    this machine's loopback counts as loopback bytes."""
    import socket

    start = timing.host_counters()
    assert start is not None and 0 <= start[0] <= start[1]  # Linux has /proc
    deadline = time.perf_counter() + 0.3
    while time.perf_counter() < deadline:
        pass
    busy = timing.host_counters()
    assert busy[0] - start[0] >= 20  # 0.3 s on one core at 100 ticks per second, with slack
    time.sleep(0.3)
    end = timing.host_counters()
    assert end[1] - busy[1] >= 40 and end[0] - busy[0] <= end[1] - busy[1]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.sendto(b"x" * 10000, ("127.0.0.1", 9))  # discard port: nobody needs to listen
    assert timing.host_counters()[2] - end[2] >= 10000
    line = timing.breakdown_line({"ms": dict.fromkeys(timing.CATEGORIES, 1.0), "step_ms": 10.0,
                                  "slowest_rank_step_ms": 11.0, "host_cpu_busy": 0.5})
    assert line.endswith("step 10.0 (slowest rank 11.0), host CPU 50% busy")


def test_without_the_flags_the_timer_does_nothing():
    args = argparse.Namespace(parm_timing_breakdown=False, parm_timing_file=None)
    assert isinstance(timing.StepTimer.install([], None, None, args), timing.NullTimer)


def flags(**given):
    values = dict(overlap_grad_reduce=False, overlap_param_gather=False,
                  use_distributed_optimizer=False, ddp_bucket_size=None,
                  ddp_average_in_collective=False, save=None, load=None, bf16=False,
                  fp16=False, accumulate_allreduce_grads_in_fp32=False,
                  num_distributed_optimizer_instances=1, ddp_num_buckets=None,
                  ddp_reduce_scatter_with_fp32_accumulation=False, use_megatron_fsdp=False,
                  data_parallel_sharding_strategy="no_shard")
    values.update(given)
    return argparse.Namespace(**values)


def test_ddp_config_carries_the_flags_as_megatron_lm_does():
    config = ddp.ddp_config(flags(overlap_grad_reduce=True, overlap_param_gather=True,
                                  use_distributed_optimizer=True, ddp_bucket_size=1000))
    assert (config.overlap_grad_reduce, config.overlap_param_gather, config.align_param_gather,
            config.use_distributed_optimizer, config.bucket_size,
            config.average_in_collective) == (True, True, True, True, 1000, False)
    plain = ddp.ddp_config(flags())
    assert not (plain.overlap_grad_reduce or plain.use_distributed_optimizer) \
        and plain.bucket_size is None
    fsdp = ddp.ddp_config(flags(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                data_parallel_sharding_strategy="optim_grads_params"))
    assert (fsdp.use_megatron_fsdp, fsdp.data_parallel_sharding_strategy) == (
        True, "optim_grads_params")


@pytest.mark.parametrize("given, cuda, message", [
    (dict(overlap_param_gather=True, overlap_grad_reduce=True), False,
     "--overlap-param-gather needs --use-distributed-optimizer"),
    (dict(overlap_param_gather=True, use_distributed_optimizer=True), False,
     "--overlap-param-gather needs --overlap-grad-reduce"),
    (dict(ddp_average_in_collective=True), False, "--ddp-average-in-collective needs NCCL"),
    (dict(ddp_num_buckets=4, ddp_bucket_size=10), False,
     "--ddp-num-buckets and --ddp-bucket-size both size the gradient buckets"),
    (dict(ddp_reduce_scatter_with_fp32_accumulation=True), False,
     "--ddp-reduce-scatter-with-fp32-accumulation needs --use-distributed-optimizer"),
])
def test_ddp_flags_megatron_core_cannot_run_here_are_refused(given, cuda, message):
    with pytest.raises(ValueError, match=message):
        arguments._validate_ddp(flags(**given), cuda)


def test_ddp_flags_it_runs_pass():
    arguments._validate_ddp(flags(ddp_average_in_collective=True), cuda=True)
    arguments._validate_ddp(flags(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                  overlap_param_gather=True, ddp_bucket_size=10), cuda=False)
    # its checkpoints are Megatron-Core's sharded state (tests/e2e/test_checkpoint.py -k distopt)
    arguments._validate_ddp(flags(use_distributed_optimizer=True, save="ckpt", load="ckpt"),
                            cuda=False)


class FakeChunk:
    def __init__(self, log):
        self.log = log

    def no_sync(self):
        pass

    def start_grad_sync(self):
        pass

    def start_param_sync(self):
        pass

    def disable_forward_pre_hook(self, param_sync=True):
        self.log.append(("disable", param_sync))

    def enable_forward_pre_hook(self):
        self.log.append(("enable",))


def test_param_gather_hooks_switch_as_megatron_lm_switches_them():
    log = []
    model, config = [FakeChunk(log)], argparse.Namespace()
    args = flags(use_distributed_optimizer=True, overlap_grad_reduce=True,
                 overlap_param_gather=True)
    ddp.set_sync_funcs(config, model, args)
    assert config.param_sync_func == model[0].start_param_sync
    assert config.grad_sync_func == model[0].start_grad_sync
    gather = ddp.ParamGather(model, config, args)
    gather.disable(param_sync=False)  # the first step: no hooks, no sync
    assert config.param_sync_func is None
    gather.enable()
    gather.enable()  # once only
    gather.disable()  # evaluation: gathered, hooks off
    gather.enable()
    assert log == [("disable", False), ("enable",), ("disable", True), ("enable",)]
    assert config.param_sync_func == model[0].start_param_sync
    idle = ddp.ParamGather(model, config, flags())
    idle.disable()
    idle.enable()
    assert len(log) == 4  # without --overlap-param-gather nothing switches
