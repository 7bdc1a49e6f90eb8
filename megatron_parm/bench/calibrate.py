"""Calibration's measuring half: time collectives and expert compute on the real process groups.

tools/calibrate.py runs these on every rank at once; the numbers are fitted by the pure half,
megatron_parm/perf_model/calibrate.py (whose docstring says how a number is measured).
Tensors live on the given device and times come from the device seam's Timer (CUDA events on
GPUs, perf_counter on CPU).
"""

from __future__ import annotations

import math
import re
import subprocess
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist

from megatron_parm.comm import collectives
from megatron_parm.comm.accounting import track_comm
from megatron_parm.perf_model.calibrate import Point, expert_flops
from megatron_parm import device as seam


def shaped_rates(interfaces: Sequence[str]) -> Dict[str, str]:
    """Best effort, for the profile's note: the tc rate limit on each interface, if any
    (the emulated cluster shapes eth0 and lo with tbf). Empty where tc is unavailable."""
    rates = {}
    for interface in interfaces:
        try:
            result = subprocess.run(["tc", "qdisc", "show", "dev", interface],
                                    capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            continue
        match = re.search(r"\brate (\S+)", result.stdout)
        if result.returncode == 0 and match:
            rates[interface] = match.group(1)
    return rates



def _sync(device) -> None:
    if device.type != "cpu":
        seam.synchronize()


def _timer() -> "seam.Timer":
    """The device seam's timer, started: CUDA events on GPUs, perf_counter on CPU."""
    return seam.Timer().start()


def _slowest(local_times: List[float], device) -> List[float]:
    """Per repetition, the largest time over all ranks of the world."""
    tensor = torch.tensor(local_times, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.cpu().tolist()


def _start(kind: str, tensor, group, name: str):
    size = group.size()
    if kind == "all_to_all":
        rows = tensor.shape[0] // size
        return collectives.start_all_to_all(tensor, group, name, [rows] * size, [rows] * size)
    if kind == "all_gather":
        return collectives.start_all_gather(tensor, group, name)
    if kind == "reduce_scatter":
        return collectives.start_reduce_scatter(tensor, group, name)
    if kind == "all_reduce":
        return collectives.start_all_reduce(tensor, group, name)
    raise ValueError(f"unknown collective kind {kind!r}")


def time_collective(kind: str, group, group_name: str, link: str, size: int, *, warmup: int,
                    reps: int, ranks_per_node: int, device, row_elems: int = 64) -> Point:
    """Time one collective of message size `size` (see S in the notation) on this rank's
    `group`, every rank at once. Bytes sent come from the accounting of the timed calls."""
    g = group.size()
    row_bytes = row_elems * 4
    rows = max(1, round(size / (g * row_bytes))) * g  # whole tensor: rows divisible by g
    input_rows = rows // g if kind == "all_gather" else rows
    tensor = torch.ones(input_rows, row_elems, dtype=torch.float32, device=device)
    local, sent = [], set()
    for rep in range(warmup + reps):
        _sync(device)
        dist.barrier()
        with track_comm(ranks_per_node) as stats:
            timer = _timer()
            _start(kind, tensor, group, group_name).wait()
            elapsed = timer.stop()
            bytes_sent = stats.sum(kind=kind, group=group_name)
        if rep >= warmup:
            local.append(elapsed)
            sent.add(bytes_sent.intra if link == "intra" else bytes_sent.inter)
        other = bytes_sent.inter if link == "intra" else bytes_sent.intra
        assert other == 0, f"{kind} on {group_name} ({link}) sent {other} bytes on the other link"
    assert len(sent) == 1, f"{kind} on {group_name}: bytes differ between repetitions: {sent}"
    return Point(kind, link, group_name, rows * row_bytes, float(sent.pop()),
                 _slowest(local, device))


def time_compute(rows_list: Sequence[int], hidden: int, ffn_local: int, *, warmup: int,
                 reps: int, device) -> List[Point]:
    """Forward and backward of an expert-like MLP (fc1, GeLU, fc2) on every rank at once:
    points (flops, seconds) with x = F forward and 2F backward."""
    generator = torch.Generator(device="cpu").manual_seed(1234)
    fc1 = (torch.randn(hidden, ffn_local, generator=generator) / math.sqrt(hidden)).to(device)
    fc2 = (torch.randn(ffn_local, hidden, generator=generator) / math.sqrt(ffn_local)).to(device)
    fc1.requires_grad_(True)
    fc2.requires_grad_(True)
    points = []
    for rows in rows_list:
        x = torch.randn(rows, hidden, generator=generator).to(device).requires_grad_(True)
        grad_out = torch.randn(rows, hidden, generator=generator).to(device)
        forward, backward = [], []
        for rep in range(warmup + reps):
            x.grad = fc1.grad = fc2.grad = None
            _sync(device)
            dist.barrier()
            timer = _timer()
            out = torch.nn.functional.gelu(x @ fc1) @ fc2
            forward_time = timer.stop()
            dist.barrier()  # the backward, too, starts on every rank at once
            timer = _timer()
            out.backward(grad_out)
            backward_time = timer.stop()
            if rep >= warmup:
                forward.append(forward_time)
                backward.append(backward_time)
        flops = expert_flops(rows, hidden, ffn_local)
        points.append(Point("compute", "", "forward", rows, flops, _slowest(forward, device)))
        points.append(Point("compute", "", "backward", rows, 2 * flops,
                            _slowest(backward, device)))
    return points


def step_args(config: str, tp: int, ep: int, etp: int, num_layers: int, world_size: int,
              num_microbatches: int = 1):
    """The trainer's flags for time_model_steps: the config's GPT MoE model cut to num_layers,
    on the layout, with parm_s1; its data flags are not read (the tokens are random).
    Raises ValueError naming the flag (tools/calibrate.py checks this before timing)."""
    from megatron_parm.perf_model.calibrate import layer_fit_schedules
    from megatron_parm.training.arguments import parse_args

    argv = ["--config", config, "--num-layers", str(num_layers),
            "--tensor-model-parallel-size", str(tp), "--expert-model-parallel-size", str(ep),
            "--expert-tensor-parallel-size", str(etp),
            "--moe-token-dispatcher-type", layer_fit_schedules()[0]]
    args = parse_args(argv + (["--sequence-parallel"] if tp > 1 else []),
                      world_size=world_size, reads_data=False)
    args.global_batch_size = args.micro_batch_size * (world_size // tp) * num_microbatches
    return args


def time_model_steps(config: str, tp: int, ep: int, etp: int, num_layers: int,
                     num_microbatches: int, *, warmup: int, reps: int, vocab_size: int,
                     device) -> tuple:
    """Forward + backward of `num_microbatches` micro-batches of the config's GPT MoE model cut
    to `num_layers` layers, as the trainer runs them (its model in Megatron's DDP, Megatron's
    schedule, the gradient reduction at the end; parm_s1; random tokens), every rank at once:
    (the parsed args, per repetition the slowest rank's seconds). The framework terms are
    fitted to these (perf_model.calibrate.fit_framework_terms)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_parm.training.model import gpt_forward_step
    from megatron_parm.training.trainer import build_model_and_optimizer

    args = step_args(config, tp, ep, etp, num_layers, dist.get_world_size(), num_microbatches)
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()  # sized by the layers of the model before
    model, _, _ = build_model_and_optimizer(args, vocab_size)
    chunks = model if isinstance(model, list) else [model]  # virtual pipeline chunks, if any
    generator = torch.Generator().manual_seed(1234 + dist.get_rank())
    shape = (args.micro_batch_size, args.seq_length)
    batch = {"tokens": torch.randint(0, vocab_size, shape, generator=generator),
             "labels": torch.randint(0, vocab_size, shape, generator=generator),
             "loss_mask": torch.ones(shape),
             "position_ids": torch.arange(args.seq_length).expand(shape).contiguous(),
             "attention_mask": torch.triu(torch.ones(args.seq_length, args.seq_length,
                                                     dtype=torch.bool), 1).expand(
                 args.micro_batch_size, 1, args.seq_length, args.seq_length)}
    forward_backward = get_forward_backward_func()
    local = []
    for rep in range(warmup + reps):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        _sync(device)
        dist.barrier()
        timer = _timer()
        forward_backward(forward_step_func=gpt_forward_step,
                         data_iterator=iter([batch] * num_microbatches), model=chunks,
                         num_microbatches=num_microbatches, seq_length=args.seq_length,
                         micro_batch_size=args.micro_batch_size, forward_only=False)
        elapsed = timer.stop()
        if rep >= warmup:
            local.append(elapsed)
    return args, _slowest(local, device)
