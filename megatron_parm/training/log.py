"""Console lines in Megatron-LM's format, the training loop's log (console, TensorBoard and W&B
through training/writers.py), and a progress bar.

The console lines keep Megatron-LM's spelling and number formats so that log parsers written
for Megatron-LM (`iteration N/ M |`, `lm loss: X.XXXXXXE+00 |`, `validation loss at ...`)
read these logs too. TrainingLog is Megatron-LM's training_log and evaluate_and_print_results:
    every iteration        the router losses reduced (where a writer is configured)
    every --tensorboard-log-interval   the iteration's values to TensorBoard / W&B (learning-rate,
                           batch-size, each loss, loss-scale, world-size, grad-norm, num-zeros,
                           params-norm, memory, the router losses and per layer, 'mtp_k loss'
                           with --mtp-num-layers), each also
                           '<tag> vs samples' where Megatron-LM writes that
    every --log-interval   the iteration line (throughput, num zeros, params norm by the flags),
                           the expert load, the memory line (--log-memory-interval), the timers
                           (--timing-log-level; to TensorBoard with --log-timers-to-tensorboard,
                           with iteration-time and throughput)
    each evaluation        the validation block, '<loss> validation' (and its ppl) to TensorBoard
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_parm import settings
from megatron_parm.training import flops as model_flops
from megatron_parm.training.memory import memory_scalars, report_memory
from megatron_parm.training.writers import Writers
from megatron_parm.wording import plural


def print_rank_0(message: str = "") -> None:
    import torch

    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)


class _StdoutHandler(logging.StreamHandler):
    """Megatron-LM's log handler: every logger's records on stdout, torch.distributed's left
    out."""

    def __init__(self):
        super().__init__(stream=sys.stdout)

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith("torch.distributed") and super().filter(record)


_LOGGING: dict = {"handler": None, "level": logging.WARNING}  # what setup_logging changed


def setup_logging(level: Optional[int]) -> None:
    """--logging-level: Python's root logger at LEVEL, printing to stdout through Megatron-LM's
    handler; without the flag, Python's default (warnings and errors on stderr). A previous
    call's change is undone first (several runs in one process)."""
    import torch

    root = logging.getLogger()
    if _LOGGING["handler"] is not None:
        root.removeHandler(_LOGGING["handler"])
        root.setLevel(_LOGGING["level"])
        _LOGGING["handler"] = None
    if level is None:
        return
    _LOGGING.update(handler=_StdoutHandler(), level=root.level)
    root.addHandler(_LOGGING["handler"])
    root.setLevel(level)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        logging.getLogger(__name__).info(f"Setting logging level to {level}")


def iteration_line(iteration: int, train_iters: int, consumed_samples: int,
                   elapsed_ms: float, learning_rate: float, global_batch_size: int,
                   losses: Dict[str, float], tokens_per_second: float,
                   grad_norm: Optional[float] = None, skipped: int = 0,
                   loss_scale: float = 1.0, nan_iterations: int = 0,
                   throughput: Optional[float] = None, num_zeros: Optional[float] = None,
                   params_norm: Optional[float] = None, skipped_samples: int = 0) -> str:
    """skipped: iterations of the interval whose update was skipped (fp16 overflow);
    nan_iterations: those whose loss was inf or nan; loss_scale: the current loss scale
    (1.0 without --fp16 / --loss-scale); throughput (TFLOP/s per rank), num_zeros, params_norm:
    where --log-throughput, --log-num-zeros-in-grad, --log-params-norm ask for them;
    skipped_samples: the samples of global batches left out so far
    (--decrease-batch-size-if-needed), shown where there are any."""
    line = f" iteration {iteration:8d}/{train_iters:8d} |"
    line += f" consumed samples: {consumed_samples:12d} |"
    if skipped_samples > 0:
        line += f" skipped samples: {skipped_samples:12d} |"
    line += f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
    if throughput is not None:
        line += f" throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |"
    line += f" learning rate: {learning_rate:.6E} |"
    line += f" global batch size: {global_batch_size:5d} |"
    for name, value in losses.items():
        line += f" {name}: {value:.6E} |"
    line += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    if num_zeros is not None:
        line += f" num zeros: {num_zeros} |"
    if params_norm is not None:
        line += f" params norm: {params_norm:.3f} |"
    line += f" number of skipped iterations: {skipped:3d} |"
    line += f" number of nan iterations: {nan_iterations:3d} |"
    line += f" tokens per second: {tokens_per_second:.1f} |"
    return line


def perplexity(loss: float) -> float:
    """exp(loss), capped at exp(20) as Megatron-LM caps it."""
    return math.exp(min(20.0, loss))


def validation_block(where: str, losses: Dict[str, float]) -> str:
    """Megatron-LM's evaluation block: a line of values framed by dashes."""
    line = f" validation loss at {where} | "
    for name, value in losses.items():
        line += f"{name} value: {value:.6E} | "
        line += f"{name} PPL: {perplexity(value):.6E} | "
    rule = "-" * (len(line) + 1)
    return f"{rule}\n{line}\n{rule}"


def expert_load_line(layer_number: int, fractions: Sequence[float]) -> str:
    """Share of routed tokens each expert of one MoE layer received (1/E each = balanced)."""
    shares = " ".join(f"{f:.3f}" for f in fractions)
    return f"  expert load, layer {layer_number:2d}: [{shares}] | max/mean: " \
           f"{max(fractions) * len(fractions):.2f}"


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


def context_text(args) -> str:
    """'cp=N (all_gather), ' with context parallelism, else ''."""
    cp = getattr(args, "context_parallel_size", 1)
    return f"cp={cp} ({' '.join(args.cp_comm_type)}), " if cp > 1 else ""


def start_lines(args, experts: str, device_type: str, optional_note: Optional[str]) -> None:
    """The start-up banner on rank 0: layout, dispatcher, experts, device, where output goes."""
    import torch

    print_rank_0(f"> {args.model_type.upper()} MoE pretraining: "
                 f"{plural(torch.distributed.get_world_size(), 'rank')} "
                 f"(tp={args.tensor_model_parallel_size}, {context_text(args)}"
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
        self.router: Dict[str, float] = {}  # the router losses' means, summed per iteration
        self.steps = 0
        self.samples = self.microbatches = 0  # summed over the interval's iterations
        self.batch_size = self.microbatches_last = 0  # the last iteration's, as it ran
        self.skipped = 0  # Megatron-LM's skipped iterations (fp16: gradients overflowed)
        self.nan = 0  # iterations whose loss was inf or nan
        self.restart_clock()

    def restart_clock(self) -> None:
        """Evaluation and checkpoint saves are not training time."""
        self.start = time.time()

    def add(self, losses: Dict[str, float], updated: bool, batch_size: int,
            microbatches: int) -> None:
        """One iteration: its losses, whether the optimizer stepped, the samples it ran and
        its micro-batches per data-parallel rank (both grow with --rampup-batch-size)."""
        self.steps += 1
        self.samples += batch_size
        self.microbatches += microbatches
        self.microbatches_last = microbatches
        self.batch_size = batch_size
        self.skipped += not updated
        self.nan += any(not math.isfinite(value) for value in losses.values())
        for name, value in losses.items():
            self.losses[name] = self.losses.get(name, 0.0) + value

    def add_router(self, means: Dict[str, float], num_steps: int) -> None:
        """Router losses per iteration over NUM_STEPS iterations (by their console names)."""
        for name, value in means.items():
            self.router[name] = self.router.get(name, 0.0) + value * num_steps

    def mean_losses(self) -> Dict[str, float]:
        return {**{name: value / self.steps for name, value in self.losses.items()},
                **{name: value / self.steps for name, value in self.router.items()}}

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


def logged_learning_rate(optimizer) -> float:
    """Megatron-LM's: the learning rate of the first parameter group on the default schedule
    (--decoupled-lr's group has its own)."""
    from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

    learning_rate = get_canonical_lr_for_logging(optimizer.param_groups)
    return optimizer.param_groups[0]["lr"] if learning_rate is None else learning_rate


@dataclass
class IterationValues:
    """One iteration's values for the log (Megatron-LM's training_log arguments)."""

    losses: Dict[str, float]           # the iteration's, averaged over data-parallel ranks
    learning_rate: float
    loss_scale: float
    grad_norm: Optional[float]         # None where the update was skipped (fp16 overflow)
    num_zeros: Optional[float]         # --log-num-zeros-in-grad
    params_norm: Optional[float]       # --log-params-norm
    router: Dict[str, List[float]]     # per tracked router loss, per layer ({} where not taken)
    seconds_per_step: Optional[float]  # the interval's, where the line is due
    mtp: Dict[str, float] = field(default_factory=dict)  # 'mtp_k loss' ({} where not taken)


class TrainingLog:
    """The training loop's console, TensorBoard and W&B (the module docstring says what and
    when): the progress bar, the iteration line of each --log-interval (losses averaged over
    the interval), validation blocks, the end."""

    def __init__(self, args, is_rank_0: bool, start_iteration: int, chunk_notation: str,
                 padded_vocab_size: int):
        from megatron_parm.training.moe_log import RouterLosses
        from megatron_parm.training.mtp import MtpLosses

        self.args = args
        self.writers = Writers(args, is_rank_0)
        for notice in self.writers.notices:
            print_rank_0(f"> {notice}")
        self.progress = Progress(args.train_iters, start_iteration, enabled=is_rank_0)
        self.interval = Interval()
        self.choices = ChoiceLog(args.moe_token_dispatcher_type, chunk_notation)
        self.router_losses = RouterLosses(args)
        self.mtp_losses = MtpLosses(args.mtp_num_layers)  # taken with the router losses
        self.router_steps = 0  # iterations since the router losses were last taken
        self.router_microbatches = 0  # and their micro-batches (--rampup-batch-size varies them)
        self.flops_per_sample = model_flops.num_floating_point_operations(args, 1,
                                                                          padded_vocab_size)

    def line_due(self, iteration: int) -> bool:
        return iteration % self.args.log_interval == 0 or iteration == self.args.train_iters

    def writes_due(self, iteration: int) -> bool:
        return self.writers.configured and iteration % self.args.tensorboard_log_interval == 0

    def collect(self, iteration: int, model, optimizer, grad_norm, num_zeros,
                losses: Dict[str, float]) -> Optional[IterationValues]:
        """The values of the iteration just run where the writers or the line want them (None
        elsewhere). The router losses are taken every iteration where a writer is configured
        (Megatron-LM reduces them each iteration), else at the line. Collective."""
        from megatron_parm.training.moe_log import console_name
        from megatron_parm.training.params_norm import params_norm

        args = self.args
        line, writes = self.line_due(iteration), self.writes_due(iteration)
        seconds = self.interval.seconds_per_step() if line else None
        self.router_steps += 1
        self.router_microbatches += self.interval.microbatches_last
        router, mtp = {}, {}
        if line or self.writers.configured:
            router = self.router_losses.take(self.router_steps, self.router_microbatches)
            mtp = self.mtp_losses.take(self.router_microbatches)
            self.interval.add_router({**{console_name(name): value for name, value in
                                         self.router_losses.means(router).items()}, **mtp},
                                     self.router_steps)
            self.router_steps = self.router_microbatches = 0
        if not (line or writes):
            return None
        return IterationValues(
            losses=losses, learning_rate=logged_learning_rate(optimizer),
            loss_scale=optimizer.get_loss_scale().item(), grad_norm=grad_norm,
            num_zeros=num_zeros if args.log_num_zeros_in_grad else None,
            params_norm=params_norm(model, args.bf16) if args.log_params_norm else None,
            router=router, mtp=mtp, seconds_per_step=seconds)

    def record(self, iteration: int, consumed_samples: int, values: IterationValues) -> None:
        """The iteration's values to TensorBoard / W&B (every --tensorboard-log-interval)."""
        import torch

        args = self.args
        if not self.writes_due(iteration):
            return
        scalars = {"learning-rate": values.learning_rate,
                   "batch-size": self.interval.batch_size, **values.losses}
        if args.log_loss_scale_to_tensorboard:
            scalars["loss-scale"] = values.loss_scale
        if args.log_world_size_to_tensorboard:
            scalars["world-size"] = torch.distributed.get_world_size()
        for tag, value in (("grad-norm", values.grad_norm), ("num-zeros", values.num_zeros),
                           ("params-norm", values.params_norm)):
            if value is not None:
                scalars[tag] = value
        self.writers.scalars(scalars, iteration, samples=consumed_samples)
        self.writers.wandb.log({"samples vs steps": consumed_samples}, iteration)
        self.writers.scalars({**self.router_losses.scalars(values.router,
                                                           args.moe_per_layer_logging),
                              **values.mtp}, iteration)
        if args.log_memory_to_tensorboard:
            self.writers.scalars(memory_scalars(), iteration)

    def iteration(self, iteration: int, samples: Tuple[int, int], values: IterationValues,
                  shares, summary: dict, timers) -> None:
        """Print the interval's line (SAMPLES: consumed and skipped so far) and each MoE
        layer's expert load, record the summary's learning rates, batch sizes, loss scales and
        skipped iterations, the memory line, the timers; then start the next interval.
        Collective (the timers)."""
        import torch

        args, interval, elapsed = self.args, self.interval, values.seconds_per_step
        world_size = torch.distributed.get_world_size()
        samples_per_step = interval.samples / interval.steps  # grows with --rampup-batch-size
        throughput = model_flops.throughput(self.flops_per_sample * samples_per_step,
                                            elapsed, world_size) if args.log_throughput else None
        tokens_per_second = samples_per_step * args.seq_length / elapsed
        self.progress.clear()
        print_rank_0(iteration_line(iteration, args.train_iters, samples[0],
                                    elapsed * 1000.0, values.learning_rate,
                                    interval.batch_size, interval.mean_losses(),
                                    tokens_per_second, values.grad_norm,
                                    skipped=interval.skipped, loss_scale=values.loss_scale,
                                    nan_iterations=interval.nan, throughput=throughput,
                                    num_zeros=values.num_zeros, params_norm=values.params_norm,
                                    skipped_samples=samples[1]))
        summary.setdefault("learning_rates", []).append((iteration, values.learning_rate))
        summary.setdefault("batch_sizes", []).append((iteration, interval.batch_size))
        summary.setdefault("loss_scales", []).append((iteration, values.loss_scale))
        summary["skipped_iterations"] = summary.get("skipped_iterations", 0) + interval.skipped
        for layer_number, fractions in shares:
            print_rank_0(expert_load_line(layer_number, fractions))
        scalars = {"tokens-per-second": tokens_per_second,
                   **{f"expert-load/layer-{n}-max-over-mean": max(f) * len(f) for n, f in shares}}
        if args.log_timers_to_tensorboard:
            scalars["iteration-time"] = elapsed
            if throughput is not None:
                scalars["throughput"] = throughput
        self.writers.scalars(scalars, iteration)
        if args.log_memory_interval and iteration % args.log_memory_interval == 0:
            report_memory(f"(after {iteration} iterations)", args.log_device_memory_used)
        if args.log_timers_to_tensorboard:
            timers.write(self.writers, iteration, normalizer=interval.steps)
        timers.log(normalizer=interval.steps)
        interval.restart()

    def validation(self, iteration: int, consumed_samples: int,
                   losses: Dict[str, float]) -> None:
        """The validation block; '<loss> validation' (and with --log-validation-ppl-to-
        tensorboard its ppl) to TensorBoard, each also vs samples; the loss to W&B."""
        self.progress.clear()
        print_rank_0(validation_block(f"iteration {iteration}", losses))
        self.writers.scalars({f"{key} validation": value for key, value in losses.items()},
                             iteration, samples=consumed_samples)
        if self.args.log_validation_ppl_to_tensorboard:
            self.writers.scalars({f"{key} validation ppl": perplexity(value)
                                  for key, value in losses.items()},
                                 iteration, samples=consumed_samples, wandb=False)

    def done(self, iteration: int, summary: dict) -> None:
        self.writers.close()
        # One iteration's loss, labelled so: the iteration lines average --log-interval's.
        print_rank_0(f"> done: {plural(iteration, 'iteration')}; lm loss of iteration "
                     f"{iteration}: {summary['losses'][-1]:.6E} (an iteration line's lm loss is "
                     f"its interval's mean, --log-interval {self.args.log_interval})"
                     if summary["losses"] else f"> done: nothing to train at iteration {iteration}")
        print_rank_0(f"> checkpoint: {summary['checkpoint'] or '(none: no --save)'}")
        logdir = self.args.tensorboard_dir
        print_rank_0("> TensorBoard logs: " + (f"{logdir}  (tensorboard --logdir {logdir})"
                                               if self.writers.tensorboard.writer else "(none)"))
        if self.writers.wandb.save_dir:
            print_rank_0(f"> W&B logs (offline): {self.writers.wandb.save_dir}  (upload them "
                         f"with wandb sync)")
