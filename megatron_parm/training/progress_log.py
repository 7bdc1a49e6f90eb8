"""SAVE/progress.txt (--log-progress with --save), as Megatron-LM writes it: one tab-separated line
per event, appended by rank 0.

    ProgressLog(args, flops_per_sample)
      .start()                              'Starting job' (at the start of pretraining)
      .saved(iteration, consumed_samples)   'Saved checkpoint' with the job's and the cumulative
                                            throughput, the FLOPs and tokens so far
    cumulative_start(lines, world_size)     (start time, FLOPs at that start) of the earliest
                                            job of this world size since the world size last
                                            changed

A line: '<date time>\tJob ID: <SLURM_JOB_ID>\t# GPUs: <world size>\t<event>...'; '# GPUs' is the
number of ranks (processes on CPU). Throughputs are TFLOP/s per rank (training/flops.py):
the job's since this process started pretraining, the cumulative one since the first job of
this world size started. FLOPs so far are the consumed samples times one sample's FLOPs
(Megatron-LM counts them per iteration and stores the sum in its checkpoints: the same number
while the model and the sequence length stay, which a resume requires).
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from typing import List, Optional, Tuple

from megatron_parm.training.flops import throughput

FILE_NAME = "progress.txt"
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def _field(token: str, kind):
    """The value of a 'Name: value' token."""
    return kind(token.split(": ")[1])


def cumulative_start(lines: List[str], world_size: int) -> Optional[Tuple[datetime, float]]:
    """(when, FLOPs done by then) of the first 'Starting job' with WORLD_SIZE ranks after the
    last line of another world size (Megatron-LM's rule); None where there is none."""
    start_time, start_flops, latest_flops = None, None, 0.0
    for line in lines:
        tokens = line.strip().split("\t")
        if len(tokens) < 4:
            continue
        if tokens[3] == "Saved checkpoint":
            latest_flops = _field(tokens[7], float)
        if _field(tokens[2], int) != world_size:
            start_time, start_flops = None, None
            continue
        if tokens[3] == "Starting job" and start_time is None:
            start_time, start_flops = tokens[0], latest_flops
    if start_time is None:
        return None
    return datetime.strptime(start_time, TIME_FORMAT), start_flops


class ProgressLog:
    """The run's progress.txt (see the module docstring); does nothing without --log-progress
    or --save."""

    def __init__(self, args, flops_per_sample: float):
        import torch

        self.path = os.path.join(args.save, FILE_NAME) if args.log_progress and args.save \
            else None
        self.flops_per_sample = flops_per_sample
        self.seq_length = args.seq_length
        self.world_size = torch.distributed.get_world_size()
        self.started = time.time()
        self.start_flops = 0.0

    def _append(self, event) -> None:
        """The line of EVENT() (its text, computed on rank 0 only) appended by rank 0, after
        every rank got here. Collective."""
        import torch

        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            text = event()
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(self.path, "a") as handle:
                handle.write(f"{datetime.now().strftime(TIME_FORMAT)}\t"
                             f"Job ID: {os.environ.get('SLURM_JOB_ID', '')}\t"
                             f"# GPUs: {self.world_size}\t{text}\n")

    def start(self, consumed_samples: int) -> None:
        """'Starting job', from CONSUMED_SAMPLES on (those of the checkpoint resumed).
        Collective."""
        if self.path is None:
            return
        self.started = time.time()
        self.start_flops = consumed_samples * self.flops_per_sample
        self._append(lambda: "Starting job")

    def saved(self, iteration: int, consumed_samples: int) -> None:
        """'Saved checkpoint' of ITERATION. Collective."""
        if self.path is not None:
            self._append(lambda: self._saved_event(iteration, consumed_samples))

    def _saved_event(self, iteration: int, consumed_samples: int) -> str:
        flops = consumed_samples * self.flops_per_sample
        job = throughput(flops - self.start_flops, time.time() - self.started, self.world_size)
        first = None
        if os.path.isfile(self.path):
            with open(self.path) as handle:
                first = cumulative_start(handle.readlines(), self.world_size)
        start_time, start_flops = first or (datetime.fromtimestamp(self.started),
                                            self.start_flops)
        elapsed = max((datetime.now() - start_time).total_seconds(), 1e-9)
        cumulative = throughput(flops - start_flops, elapsed, self.world_size)
        tokens = consumed_samples * self.seq_length
        return (f"Saved checkpoint\tIteration: {iteration}\t"
                f"Job throughput: {job:.1f} TFLOP/s/GPU\t"
                f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\t"
                f"Floating-point operations: {flops:.2e}\t"
                f"Tokens (in billions): {tokens / 10**9:.2f}")
