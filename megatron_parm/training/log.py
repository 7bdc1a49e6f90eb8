"""Console lines in Megatron-LM's format, TensorBoard, and a progress bar.

The console lines keep Megatron-LM's spelling and number formats so that log parsers written
for Megatron-LM (`iteration N/ M |`, `lm loss: X.XXXXXXE+00 |`, `validation loss at ...`)
read these logs too.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from typing import Dict, Optional, Sequence


def print_rank_0(message: str = "") -> None:
    import torch

    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)


def iteration_line(iteration: int, train_iters: int, consumed_samples: int,
                   elapsed_ms: float, learning_rate: float, global_batch_size: int,
                   losses: Dict[str, float], tokens_per_second: float,
                   grad_norm: Optional[float] = None, skipped: int = 0,
                   loss_scale: float = 1.0, nan_iterations: int = 0) -> str:
    """skipped: iterations of the interval whose update was skipped (fp16 overflow);
    nan_iterations: those whose loss was inf or nan; loss_scale: the current loss scale
    (1.0 without --fp16 / --loss-scale)."""
    line = f" iteration {iteration:8d}/{train_iters:8d} |"
    line += f" consumed samples: {consumed_samples:12d} |"
    line += f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
    line += f" learning rate: {learning_rate:.6E} |"
    line += f" global batch size: {global_batch_size:5d} |"
    for name, value in losses.items():
        line += f" {name}: {value:.6E} |"
    line += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    line += f" number of skipped iterations: {skipped:3d} |"
    line += f" number of nan iterations: {nan_iterations:3d} |"
    line += f" tokens per second: {tokens_per_second:.1f} |"
    return line


def validation_block(where: str, losses: Dict[str, float]) -> str:
    """Megatron-LM's evaluation block: a line of values framed by dashes."""
    line = f" validation loss at {where} | "
    for name, value in losses.items():
        line += f"{name} value: {value:.6E} | "
        line += f"{name} PPL: {math.exp(min(20.0, value)):.6E} | "
    rule = "-" * (len(line) + 1)
    return f"{rule}\n{line}\n{rule}"


def expert_load_line(layer_number: int, fractions: Sequence[float]) -> str:
    """Share of routed tokens each expert of one MoE layer received (1/E each = balanced)."""
    shares = " ".join(f"{f:.3f}" for f in fractions)
    return f"  expert load, layer {layer_number:2d}: [{shares}] | max/mean: " \
           f"{max(fractions) * len(fractions):.2f}"


class TensorBoard:
    """torch.utils.tensorboard on rank 0 when --tensorboard-dir is given and tensorboard is
    installed; otherwise every call does nothing."""

    def __init__(self, log_dir: Optional[str], is_rank_0: bool):
        self.writer = None
        self.notice = None
        if log_dir is None or not is_rank_0:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            self.notice = (f"TensorBoard: the 'tensorboard' package is not installed, so nothing "
                           f"is written to {log_dir} (pip install tensorboard to enable it)")
            return
        self.writer = SummaryWriter(log_dir=log_dir, max_queue=1000)

    def scalars(self, values: Dict[str, float], step: int) -> None:
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Progress:
    """A one-line progress bar with ETA, redrawn in place; only on a terminal (log files,
    Slurm output and pytest get the iteration lines alone). unit: what is counted ('it',
    'documents', 'tensors', ...)."""

    def __init__(self, total: int, start: int = 0, enabled: bool = True, unit: str = "it"):
        self.total, self.start, self.unit = max(total, 1), start, unit
        self.enabled = enabled and sys.stdout.isatty()
        self.t0 = time.time()

    def update(self, iteration: int) -> None:
        if not self.enabled:
            return
        done = iteration - self.start
        rate = done / max(time.time() - self.t0, 1e-9)
        eta = (self.total - iteration) / rate if rate > 0 else 0.0
        width = 30
        filled = min(width, int(width * iteration / self.total))
        bar = "#" * filled + "." * (width - filled)
        sys.stdout.write(f"\r [{bar}] {iteration}/{self.total} "
                         f"{rate:.2f} {self.unit}/s ETA "
                         f"{time.strftime('%H:%M:%S', time.gmtime(eta))}  ")
        sys.stdout.flush()

    def clear(self) -> None:
        """Erase the bar before a full line is printed."""
        if self.enabled:
            sys.stdout.write("\r" + " " * 79 + "\r")
            sys.stdout.flush()


@contextlib.contextmanager
def stage(description: str):
    """Print 'DESCRIPTION ...' when a stage of a tool starts and '  done in X s' when it ends:
    one line each, on a terminal or in a log."""
    print(f"{description} ...", flush=True)
    start = time.time()
    yield
    print(f"  done in {time.time() - start:.1f} s", flush=True)
