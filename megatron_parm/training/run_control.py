"""What a training run does around its iterations besides training them, as Megatron-LM's
training.py does it: when to stop, what to check, how to collect garbage.

    RunControl(args, model, started)   one run's controls; the trainer's loop calls
        .passes(train_iter)          the forward-backward passes of an iteration: one, or two
                                     when Megatron-Core's rerun engine runs it again
        .rerun_stop()                after them: the rerun engine's decision to stop, or None
        .skips(iteration) / .skip(train_iter)    --iterations-to-skip
        .after_step(iteration)       the timeout after the first iteration, the weight-hash
                                     check, manual garbage collection
        .evaluation()                around an evaluation: garbage collection, no rerun engine
        .time_up()                   --exit-duration-in-mins reached (every rank agrees)
        .stop_reason(iteration)      the exit signal, the duration, --exit-interval
        .close()                     everything the run changed, put back
    checked_forward_step(step, args) a forward step whose loss the rerun engine validates
    ResultRejected                   the one-line error a rejected result stops a run with

Flags (megatron_parm/settings/run_control.py; the exits: settings/checkpoints.py):
  --exit-signal-handler / --exit-signal   the signal caught on every rank, then agreed on at
                                     the end of an iteration (any rank's counts); the data
                                     loader's workers ignore it (data.datasets)
  --exit-duration-in-mins           minutes since the earliest rank started, checked after
                                     every iteration and evaluation step (the largest rank's
                                     counts)
  --manual-gc, --manual-gc-interval, --no-manual-gc-eval   gc.disable() for the run;
                                     gc.collect() at the start, every interval iterations
                                     (every rank at the same iteration) and before an
                                     evaluation, gc.collect(generation=0) after it
  --no-check-for-nan-in-loss-and-grad, --check-for-spiky-loss, --check-for-large-grads,
  --rerun-mode, --error-injection-rate, --error-injection-type,
  --result-rejected-tracker-filename   Megatron-Core's RerunStateMachine, set up as Megatron-LM
                                     sets it up: the loss (here) and the gradient buckets (its
                                     DDP) are validated; a rejected result in validate_results
                                     mode runs the iteration again in place, then stops the run
                                     with its exit status (16: reproduced, 17: not)
  --deterministic-mode              torch.use_deterministic_algorithms(True) for the run (the
                                     config's deterministic_mode: training.model)
  --check-weight-hash-across-dp-replicas-interval   SHA-1 of every parameter, all-gathered
                                     over its data-parallel group (the expert-data-parallel
                                     group for experts)
  --distributed-timeout-seconds-after-init   parallel.update_group_timeout after the first
                                     iteration
  --iterations-to-skip              the step's batches drawn and dropped
  --phase-transition-iterations     a stop (data.loaders says where a phase ends)
"""

from __future__ import annotations

import array
import contextlib
import gc
import hashlib
import logging
import signal
import sys
import time
from functools import partial
from typing import List, Optional

import torch

from megatron.core import parallel_state
from megatron.core import rerun_state_machine as rerun
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from megatron_parm import device
from megatron_parm.data.loaders import phase_transition_at
from megatron_parm.parallel import update_group_timeout
from megatron_parm.training.log import print_rank_0

SPIKY_LOSS_FACTOR = 10  # Megatron-LM's pretrain_gpt.py: a loss 10x the largest seen is spiky
# Megatron-Core's exit statuses after a rejected result in validate_results mode.
EXIT_REPRODUCED = rerun.EXIT_CODE_RESUME_TO_DISAMBIGUATE  # 16
EXIT_NOT_REPRODUCED = rerun.EXIT_CODE_FAILED_ON_RESULT_VALIDATION  # 17
# The rerun engine's lines a run need not see: set-up and mode changes (at every evaluation).
_RERUN_CHATTER = ("RerunStateMachine initialized", "Setting RerunStateMachine mode",
                  "Result validation enabled", "Implicit initialization")


class ResultRejected(ValueError):
    """Megatron-Core's rerun engine rejected a result (a NaN or infinite loss or gradient) with
    the engine disabled (--rerun-mode disabled): the run stops at once, in one line."""


# ---------------------------------------------------------------------------------------------
# stops: the exit signal, the duration
# ---------------------------------------------------------------------------------------------

class ExitSignal:
    """--exit-signal-handler: remember --exit-signal (SIGTERM by default: Slurm's time limit,
    preemption, or the sbatch script's trap) and let every rank agree at the end of an
    iteration to save and stop. The handler it replaces comes back at close()."""

    def __init__(self, enabled: bool, name: str = "SIGTERM"):
        self.received = False
        self.enabled = enabled
        self.signum = signal.Signals[name]
        if enabled:
            self.previous = signal.signal(self.signum, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def any_rank(self) -> bool:
        if not self.enabled:
            return False
        return any_rank(self.received)

    def close(self) -> None:
        if self.enabled:
            signal.signal(self.signum, self.previous)
            self.enabled = False


def any_rank(flag: bool) -> bool:
    """Whether FLAG holds on any rank. Collective over every rank."""
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device.current())
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


class RunClock:
    """--exit-duration-in-mins: minutes since the run started on its earliest rank (Megatron-LM
    starts the clock when training.py is imported, and takes the earliest rank's)."""

    def __init__(self, minutes: Optional[int], started: float):
        self.minutes = minutes
        self.started = started
        if minutes:  # collective: every rank takes the earliest start
            start = torch.tensor([started], dtype=torch.float64, device=device.current())
            torch.distributed.all_reduce(start, op=torch.distributed.ReduceOp.MIN)
            self.started = start.item()

    def elapsed_minutes(self) -> float:
        return (time.time() - self.started) / 60.0

    def time_up(self) -> bool:
        """Whether the run has lasted longer than --exit-duration-in-mins on any rank.
        Collective (only with the flag)."""
        return bool(self.minutes) and any_rank(self.elapsed_minutes() > self.minutes)


# ---------------------------------------------------------------------------------------------
# garbage collection, determinism
# ---------------------------------------------------------------------------------------------

class ManualGC:
    """--manual-gc: Python's automatic collection off for the run, so that no rank pauses for
    it at a time of its own (a collective then waits for the slowest); collections at set
    points instead, the same on every rank."""

    def __init__(self, args):
        self.enabled, self.interval = args.manual_gc, args.manual_gc_interval
        self.around_eval = args.manual_gc_eval
        self.was_enabled = gc.isenabled()
        if self.enabled:
            gc.disable()
            gc.collect()

    def after_iteration(self, iteration: int) -> None:
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def evaluation(self):
        """Collect everything before an evaluation and its own young objects after it."""
        if self.enabled and self.around_eval:
            gc.collect()
        yield
        if self.enabled and self.around_eval:
            gc.collect(generation=0)

    def close(self) -> None:
        if self.enabled and self.was_enabled:
            gc.enable()


class Deterministic:
    """--deterministic-mode: torch.use_deterministic_algorithms(True) while the run trains (an
    operation without a deterministic implementation raises), put back at close()."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.previous = torch.are_deterministic_algorithms_enabled()
        if enabled:
            torch.use_deterministic_algorithms(True)

    def close(self) -> None:
        if self.enabled:
            torch.use_deterministic_algorithms(self.previous)


# ---------------------------------------------------------------------------------------------
# weight hashes across data-parallel replicas
# ---------------------------------------------------------------------------------------------

def _sha1(param: torch.Tensor) -> torch.Tensor:
    """[20] uint8: the SHA-1 of a parameter's values as fp32 (Megatron-Core's hash)."""
    values = param.detach().to("cpu").float().numpy(force=True)
    return torch.frombuffer(array.array("B", hashlib.sha1(values).digest()), dtype=torch.uint8)


def differing(local: torch.Tensor, replicas: List[torch.Tensor]) -> List[int]:
    """The rows (parameters) of LOCAL [P, 20] that differ in any replica's [P, 20]."""
    return sorted({index for replica in replicas
                   for index in torch.nonzero((replica != local).any(dim=1)).flatten().tolist()})


def weight_hash_mismatches(model) -> List[str]:
    """The names of this rank's parameters whose hash differs on one of their data-parallel
    replicas (dense parameters: the data-parallel group; experts: the expert-data-parallel
    group). Collective over both groups."""
    params = {True: [], False: []}  # replicated over the data-parallel group or not (experts)
    for index, chunk in enumerate(model):
        for name, param in chunk.named_parameters():
            prefix = f"chunk {index}: " if len(model) > 1 else ""
            params[getattr(param, "allreduce", True)].append((prefix + name, param))
    found = []
    for dense, group in ((True, parallel_state.get_data_parallel_group()),
                         (False, parallel_state.get_expert_data_parallel_group())):
        if not params[dense]:
            continue
        local = torch.stack([_sha1(param) for _, param in params[dense]]).to(device.current())
        replicas = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(replicas, local, group=group)
        found += [params[dense][index][0] for index in differing(local, replicas)]
    return found


def check_weight_hashes(model, iteration: int) -> None:
    """--check-weight-hash-across-dp-replicas-interval: ValueError (every rank) naming the
    parameters that differ across data-parallel replicas; Megatron-LM's line when none does.
    Collective over every rank."""
    mismatches = weight_hash_mismatches(model)
    if any_rank(bool(mismatches)):
        where = (f"{', '.join(mismatches[:4])}{' ...' if len(mismatches) > 4 else ''} on rank "
                 f"{torch.distributed.get_rank()}" if mismatches else "on other ranks")
        raise ValueError(f"--check-weight-hash-across-dp-replicas-interval: after iteration "
                         f"{iteration} parameters differ across data-parallel replicas: {where}")
    print_rank_0(f">>> Weight hashes match after {iteration} iterations...")


# ---------------------------------------------------------------------------------------------
# Megatron-Core's rerun engine
# ---------------------------------------------------------------------------------------------

class _Chatter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_RERUN_CHATTER)


def _show_rerun_log() -> None:
    """The rerun engine's diagnostics (its errors, its warnings, report_stats' statistics at
    INFO) on stdout, once per process, without its set-up lines."""
    logger = logging.getLogger(rerun.__name__)
    if getattr(logger, "_parm_shown", False):
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("> rerun engine: %(message)s"))
    handler.addFilter(_Chatter())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger._parm_shown = True


class Rerun:
    """Megatron-Core's RerunStateMachine for one run, set up as Megatron-LM's initialize.py sets
    it up (--rerun-mode, the error injector, the tracker file; the RNG tracker's states saved
    and restored around a rerun), its iteration counter at the run's start."""

    def __init__(self, args, iteration: int):
        _show_rerun_log()
        rerun.destroy_rerun_state_machine()  # a previous run's, in this process
        rerun.initialize_rerun_state_machine(
            state_save_func=lambda: {"rng_tracker_states": get_cuda_rng_tracker().get_states()},
            state_restore_func=lambda state: get_cuda_rng_tracker().set_states(
                state["rng_tracker_states"]),
            mode=rerun.RerunMode(args.rerun_mode),
            error_injector=rerun.RerunErrorInjector(
                error_injection_rate=args.error_injection_rate,
                error_injection_type=rerun.RerunDiagnostic(args.error_injection_type)),
            result_rejected_tracker_filename=args.result_rejected_tracker_filename)
        self.machine = rerun.get_rerun_state_machine()
        self.machine.current_iteration = iteration

    def passes(self, train_iter):
        """Yields once per forward-backward pass of an iteration (twice when it is rerun)."""
        while self.machine.should_run_forward_backward(train_iter):
            yield

    def stop(self):
        """(exit status, what happened) when the engine stops the run after this iteration's
        passes (the optimizer does not step), else None."""
        _, should_exit, code = self.machine.should_checkpoint_and_exit()
        if not should_exit:
            return None
        if code == EXIT_REPRODUCED:
            return code, ("the rejected result reproduced on a rerun of the iteration (Megatron-"
                          "LM resumes from the checkpoint on another GPU to tell a hardware "
                          "fault from the model's own; that second rerun is not built here)")
        return code, "the rejected result did not reproduce on a rerun: a transient fault"

    @contextlib.contextmanager
    def disabled(self):
        """No reruns inside (evaluation: Megatron-LM's), a rejected fatal result raises."""
        mode = self.machine.get_mode()
        self.machine.set_mode(rerun.RerunMode.DISABLED)
        try:
            yield
        finally:
            self.machine.set_mode(mode)

    @staticmethod
    def close() -> None:
        rerun.destroy_rerun_state_machine()


def wrap_iterators(iterators: list) -> list:
    """The training iterators (one per model chunk) with the rerun engine's replay."""
    return [rerun.RerunDataIterator(iterator) for iterator in iterators]


def _validated_loss(loss_func, args, *output):
    """LOSS_FUNC's result, its loss validated by the rerun engine as Megatron-LM's
    pretrain_gpt.py validates it (before the data-parallel reduction): NaN and Inf are fatal,
    a spiky loss is not. A detached copy is validated: the schedule scales the loss in place."""
    result = loss_func(*output)
    loss = result[0].detach().clone()
    machine = rerun.get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        machine.validate_result(result=loss, rejection_func=torch.isnan,
                                message="found NaN in local forward loss calculation",
                                tolerance=0.0, fatal=True)
        machine.validate_result(result=loss, rejection_func=torch.isinf,
                                message="found Inf in local forward loss calculation",
                                tolerance=0.0, fatal=True)
    if args.check_for_spiky_loss:
        machine.validate_result(
            result=loss, rejection_func=partial(machine.is_unexpectedly_large,
                                                threshold=SPIKY_LOSS_FACTOR, context="loss"),
            message="Spiky loss", tolerance=0.0, fatal=False)
    return result


def checked_forward_step(forward_step, args):
    """FORWARD_STEP (training.model's) whose loss function validates its loss, where a check is
    on (--check-for-nan-in-loss-and-grad by default, --check-for-spiky-loss); FORWARD_STEP
    itself otherwise."""
    if not (args.check_for_nan_in_loss_and_grad or args.check_for_spiky_loss):
        return forward_step

    def step(data_iterator, model, *rest, **options):
        output, loss_func = forward_step(data_iterator, model, *rest, **options)
        return output, partial(_validated_loss, loss_func, args)

    return step


@contextlib.contextmanager
def rejected_results_stop():
    """A result the disabled rerun engine rejects (Megatron-Core raises RuntimeError 'Unexpected
    result ...') stops the run in one line, naming what to do."""
    try:
        yield
    except RuntimeError as error:
        if "Unexpected result" not in str(error):
            raise
        raise ResultRejected(f"{error}: the run stops (--rerun-mode disabled; "
                             f"--no-check-for-nan-in-loss-and-grad lets it go on)") from error


# ---------------------------------------------------------------------------------------------
# one run's controls
# ---------------------------------------------------------------------------------------------

class RunControl:
    """One run's controls, in the order Megatron-LM's training loop applies them. Collective
    where noted: every rank calls every method at the same point."""

    def __init__(self, args, model, iteration: int, started: float):
        self.args, self.model = args, model
        self.start_iteration = iteration
        if args.check_weight_hash_across_dp_replicas_interval:  # at the start too (Megatron-LM)
            check_weight_hashes(model, iteration)
        self.exit_signal = ExitSignal(args.exit_signal_handler, args.exit_signal)
        self.clock = RunClock(args.exit_duration_in_mins, started)
        self.gc = ManualGC(args)
        self.deterministic = Deterministic(args.deterministic_mode)
        self.rerun = Rerun(args, iteration)

    def passes(self, train_iter):
        return self.rerun.passes(train_iter)

    def rerun_stop(self):
        return self.rerun.stop()

    def skips(self, iteration: int) -> bool:
        return iteration in self.args.iterations_to_skip

    def skip(self, train_iter, num_microbatches: int) -> None:
        """Draw and drop the iteration's micro-batches, as Megatron-LM's dummy_train_step."""
        for _ in self.passes(train_iter):
            for iterator in train_iter:
                for _ in range(num_microbatches):
                    next(iterator)

    def after_step(self, iteration: int) -> None:
        """After an iteration's step and its log line and evaluation. Collective."""
        seconds = self.args.distributed_timeout_seconds_after_init
        if seconds and iteration == self.start_iteration + 1:
            update_group_timeout(seconds)
        interval = self.args.check_weight_hash_across_dp_replicas_interval
        if interval and iteration % interval == 0:
            check_weight_hashes(self.model, iteration)
        self.gc.after_iteration(iteration)

    @contextlib.contextmanager
    def evaluation(self):
        with self.gc.evaluation(), self.rerun.disabled():
            yield

    def time_up(self) -> bool:
        return self.clock.time_up()

    def stop_reason(self, iteration: int) -> Optional[str]:
        """'signal', 'exit-duration-in-mins', 'phase-transition' or 'exit-interval' when the
        loop stops after ITERATION (said on the console); None to go on. Collective."""
        args = self.args
        if self.exit_signal.any_rank():
            print_rank_0(f"> exit signal received ({args.exit_signal}): stopping after "
                         f"iteration {iteration}")
            return "signal"
        if self.time_up():
            print_rank_0(f"> exiting program after {self.clock.elapsed_minutes():.2f} minutes "
                         f"(--exit-duration-in-mins {args.exit_duration_in_mins}): stopping "
                         f"after iteration {iteration}")
            return "exit-duration-in-mins"
        if phase_transition_at(iteration, args):
            print_rank_0(f"> --phase-transition-iterations: a phase ends at iteration "
                         f"{iteration}: stopping (the next launch reads the next phase's data "
                         f"from its start)")
            return "phase-transition"
        if args.exit_interval and iteration % args.exit_interval == 0 \
                and iteration < args.train_iters:
            print_rank_0(f"> --exit-interval {args.exit_interval}: stopping after iteration "
                         f"{iteration}")
            return "exit-interval"
        return None

    def close(self) -> None:
        """After the last save (a second exit signal must not cut it short)."""
        self.exit_signal.close()
        self.gc.close()
        self.deterministic.close()
        self.rerun.close()
