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

from megatron_parm import settings
from megatron_parm.wording import plural


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


# ---------------------------------------------------------------------------------------------
# The training loop's console: start-up lines, the interval line, dispatcher choices, the end
# ---------------------------------------------------------------------------------------------


def print_stage_0(message: str) -> None:
    """Print on the first rank of each pipeline stage (rank 0 without pipelining): what only
    that stage knows, such as its layers' dispatcher choices."""
    import torch
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    if torch.distributed.get_rank(group) == 0:
        print(message, flush=True)


def pipeline_text(args) -> str:
    """'pp=2, ' (with ' x 2 virtual' when interleaved) for the start-up line; '' without."""
    if args.pipeline_model_parallel_size == 1:
        return ""
    vpp = args.virtual_pipeline_model_parallel_size
    return (f"pp={args.pipeline_model_parallel_size}"
            + (f" x {vpp} virtual" if vpp else "") + ", ")


def describe_choice(choice) -> str:
    """One line for a dispatcher's choice, whole (its describe() where it has one)."""
    return choice.describe() if hasattr(choice, "describe") else str(choice)


def start_lines(args, experts: str, device_type: str, optional_note: Optional[str]) -> None:
    """The start-up banner on rank 0: layout, dispatcher, experts, device, where output goes."""
    import torch

    print_rank_0(f"> {args.model_type.upper()} MoE pretraining: "
                 f"{plural(torch.distributed.get_world_size(), 'rank')} "
                 f"(tp={args.tensor_model_parallel_size}, "
                 f"ep={args.expert_model_parallel_size}, "
                 f"etp={args.expert_tensor_parallel_size}, {pipeline_text(args)}"
                 f"dp={args.data_parallel_size}), "
                 f"dispatcher {args.moe_token_dispatcher_type}, experts {experts}, "
                 f"{device_type}/{torch.distributed.get_backend()}")
    if optional_note:  # Megatron-Core's own warnings about the packages are hidden
        print_rank_0(f"> {optional_note}")
    no_effect = settings.no_effect_note(args)  # Megatron-LM's flags that change nothing here
    if no_effect:
        print_rank_0(f"> {no_effect}")
    print_rank_0(f"> checkpoints: {args.save or '(not saved: no --save)'}; "
                 f"TensorBoard: {args.tensorboard_dir or '(off: no --tensorboard-dir)'}")


class Interval:
    """What one iteration line averages: the iterations since the previous line."""

    def __init__(self):
        self.restart()

    def restart(self) -> None:
        self.losses: Dict[str, float] = {}
        self.steps = 0
        self.skipped = 0  # Megatron-LM's skipped iterations (fp16: gradients overflowed)
        self.nan = 0  # iterations whose loss was inf or nan
        self.restart_clock()

    def restart_clock(self) -> None:
        """Evaluation and checkpoint saves are not training time."""
        self.start = time.time()

    def add(self, losses: Dict[str, float], updated: bool) -> None:
        self.steps += 1
        self.skipped += not updated
        self.nan += any(not math.isfinite(value) for value in losses.values())
        for name, value in losses.items():
            self.losses[name] = self.losses.get(name, 0.0) + value

    def mean_losses(self) -> Dict[str, float]:
        return {name: value / self.steps for name, value in self.losses.items()}

    def seconds_per_step(self) -> float:
        return (time.time() - self.start) / self.steps


class ChoiceLog:
    """Each MoE layer's dispatcher choice, printed once by its stage's first rank as soon as it
    is made, and again only if it changes."""

    def __init__(self, dispatcher: str, chunk_notation: str):
        self.dispatcher, self.chunk_notation = dispatcher, chunk_notation
        self.choices = None

    def due(self, iteration: int, log_interval: int) -> bool:
        return self.choices is None or None in self.choices or iteration % log_interval == 0

    def update(self, layer_numbers: Sequence[int], choices: list, progress: "Progress") -> None:
        previous = self.choices or [None] * len(choices)
        changed = [(number, choice) for number, old, choice in zip(layer_numbers, previous, choices)
                   if choice is not None and choice != old]
        if changed:
            progress.clear()
            if not any(previous) and any("c=" in describe_choice(c) for _, c in changed):
                print_stage_0(f"> schedules: {self.chunk_notation}")
            for number, choice in changed:
                print_stage_0(f"> MoE layer {number}: {self.dispatcher} "
                              f"chose {describe_choice(choice)}")
        self.choices = choices


class TrainingLog:
    """The training loop's console and TensorBoard: the progress bar, the iteration line of
    each --log-interval (losses averaged over the interval), validation blocks, the end."""

    def __init__(self, args, is_rank_0: bool, start_iteration: int, chunk_notation: str):
        self.args = args
        self.tensorboard = TensorBoard(args.tensorboard_dir, is_rank_0)
        if self.tensorboard.notice:
            print_rank_0(f"> {self.tensorboard.notice}")
        self.progress = Progress(args.train_iters, start_iteration, enabled=is_rank_0)
        self.interval = Interval()
        self.choices = ChoiceLog(args.moe_token_dispatcher_type, chunk_notation)

    def line_due(self, iteration: int) -> bool:
        return iteration % self.args.log_interval == 0 or iteration == self.args.train_iters

    def iteration(self, iteration: int, consumed_samples: int, elapsed: float, optimizer,
                  grad_norm, router_losses: dict, shares, summary: dict) -> None:
        """Print the interval's line (ELAPSED: seconds per iteration) and each MoE layer's
        expert load, record the summary's loss scales and skipped iterations, then start the
        next interval."""
        args, interval = self.args, self.interval
        learning_rate = optimizer.param_groups[0]["lr"]
        logged = {**interval.mean_losses(), **router_losses}
        tokens_per_second = args.global_batch_size * args.seq_length / elapsed
        self.progress.clear()
        loss_scale = optimizer.get_loss_scale().item()
        print_rank_0(iteration_line(iteration, args.train_iters, consumed_samples,
                                    elapsed * 1000.0, learning_rate, args.global_batch_size,
                                    logged, tokens_per_second, grad_norm,
                                    skipped=interval.skipped, loss_scale=loss_scale,
                                    nan_iterations=interval.nan))
        summary.setdefault("loss_scales", []).append((iteration, loss_scale))
        summary["skipped_iterations"] = summary.get("skipped_iterations", 0) + interval.skipped
        for layer_number, fractions in shares:
            print_rank_0(expert_load_line(layer_number, fractions))
        self.tensorboard.scalars({**{f"train/{k}": v for k, v in logged.items()},
                                  "train/learning-rate": learning_rate,
                                  "train/tokens-per-second": tokens_per_second,
                                  "train/grad-norm": grad_norm or 0.0,
                                  "train/loss-scale": loss_scale,
                                  **{f"expert-load/layer-{n}-max-over-mean": max(f) * len(f)
                                     for n, f in shares}},
                                 iteration)
        interval.restart()

    def validation(self, iteration: int, losses: Dict[str, float]) -> None:
        self.progress.clear()
        print_rank_0(validation_block(f"iteration {iteration}", losses))
        self.tensorboard.scalars({f"valid/{k}": v for k, v in losses.items()}, iteration)

    def done(self, iteration: int, summary: dict) -> None:
        self.tensorboard.close()
        # One iteration's loss, labelled so: the iteration lines average --log-interval's.
        print_rank_0(f"> done: {plural(iteration, 'iteration')}; lm loss of iteration "
                     f"{iteration}: {summary['losses'][-1]:.6E} (an iteration line's lm loss is "
                     f"its interval's mean, --log-interval {self.args.log_interval})"
                     if summary["losses"] else f"> done: nothing to train at iteration {iteration}")
        print_rank_0(f"> checkpoint: {summary['checkpoint'] or '(none: no --save)'}")
        logdir = self.args.tensorboard_dir
        print_rank_0("> TensorBoard logs: " + (f"{logdir}  (tensorboard --logdir {logdir})"
                                               if self.tensorboard.writer else "(none)"))
