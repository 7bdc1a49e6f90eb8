"""Megatron-LM's run-control flags (megatron_parm/training/run_control.py) by their effect, in one
process: tiny GPT-2 MoE runs of a few iterations on a world of one rank (pretrain makes it),
whose forward step is recorded and, where a test says so, given a NaN; the per-token loss
against a plain reference (GPT and BERT); the launcher's stop with the chosen signal; the data
loader's workers under the exit signal. What several ranks must agree on (the exit duration,
the weight hashes, manual collections at the same iterations) is asserted in
tests/e2e/test_pretrain.py's launch."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
TINY = ["--config", "configs/gpt2_tiny_moe.yaml", "--train-iters", "4", "--lr-warmup-iters", "1",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1",
        "--eval-iters", "0"]
MICRO_BATCHES = 2  # per iteration: TINY's global batch over its micro-batch


@pytest.fixture(scope="module")
def world():
    """pretrain() makes a process group of one rank (no RANK in the environment) and Megatron's
    groups on it; they are closed when the module is done."""
    from megatron_parm import cli

    yield
    cli.destroy_process_groups()


@pytest.fixture
def in_repo(world, monkeypatch, prepared_data):
    monkeypatch.chdir(REPO)  # the configs name data and tokenizer paths from the repository


class Steps:
    """The GPT forward step, recorded (per call: training or not, the first token, whether
    garbage collection and deterministic algorithms were on, the config's deterministic_mode);
    inject(call, output) may change a training call's output (call: 1-based over the run)."""

    def __init__(self, inject=None):
        self.inject, self.calls = inject, []

    def __enter__(self):
        from megatron_parm.training import model as model_module

        self.module, self.step = model_module, model_module.FORWARD_STEPS["gpt"]

        def step(data_iterator, model, *rest, **options):
            output, loss_func = self.step(data_iterator, model, *rest, **options)
            config = model_module.unwrap(model).config
            self.calls.append(dict(training=model.training, gc=gc.isenabled(),
                                   deterministic=torch.are_deterministic_algorithms_enabled(),
                                   deterministic_mode=config.deterministic_mode))
            if model.training and self.inject is not None:
                output = self.inject(len(self.training), output)
            return output, loss_func

        model_module.FORWARD_STEPS["gpt"] = step
        return self

    def __exit__(self, *exc):
        self.module.FORWARD_STEPS["gpt"] = self.step

    @property
    def training(self):
        return [call for call in self.calls if call["training"]]


def train(flags, inject=None):
    """(summary, Steps) of a TINY run with FLAGS."""
    from megatron_parm.training.arguments import parse_args
    from megatron_parm.training.trainer import pretrain

    with Steps(inject) as steps:
        summary = pretrain(parse_args(TINY + list(flags)))
    return summary, steps


def nan_from(first, last=10 ** 6):
    """An injection: the training calls FIRST..LAST return NaN losses."""
    return lambda call, output: output * float("nan") if first <= call <= last else output


class NanGrad(torch.autograd.Function):
    """Identity forward, NaN gradients: a finite loss whose gradients are NaN."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


# ---------------------------------------------------------------------------------------------
# NaN and the rerun engine
# ---------------------------------------------------------------------------------------------

def test_nan_loss_reproduced_on_a_rerun_stops_with_16_after_saving(in_repo, tmp_path, capsys):
    """Megatron-LM's default (--rerun-mode validate_results): a NaN loss from iteration 2 on
    (the first iteration is not validated) reruns the iteration, whose NaN reproduces: the run
    saves the last iteration it completed and stops with exit status 16; the optimizer never
    stepped on the NaN."""
    tracker = tmp_path / "rejected.txt"
    summary, steps = train(["--save", str(tmp_path / "ckpt"), "--result-rejected-tracker-filename",
                            str(tracker)], nan_from(MICRO_BATCHES + 1))
    assert summary["exit_code"] == 16 and len(summary["losses"]) == 1
    assert len(steps.training) == 3 * MICRO_BATCHES  # iteration 1, iteration 2 and its rerun
    assert (tmp_path / "ckpt/latest_checkpointed_iteration.txt").read_text() == "1"
    lines = tracker.read_text().splitlines()
    assert [line.split(" status=")[1].split(" ")[0] for line in lines] == [
        "RerunValidationStatus.INITIAL_RUN", "RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE"]
    assert all(" rank=0 iteration=2 " in line and "found NaN in local forward loss" in line
               for line in lines)
    out = capsys.readouterr().out
    assert "> rerun engine: iteration 2: the rejected result reproduced on a rerun" in out
    assert "stopping with exit status 16" in out
    assert "RerunStateMachine initialized" not in out  # its set-up chatter is not shown


def test_transient_nan_stops_with_17(in_repo):
    """A NaN in iteration 2's first pass only: the rerun's loss is finite, a transient fault
    (Megatron-Core's exit status 17)."""
    summary, steps = train([], nan_from(MICRO_BATCHES + 1, 2 * MICRO_BATCHES))
    assert summary["exit_code"] == 17 and len(summary["losses"]) == 1
    assert len(steps.training) == 3 * MICRO_BATCHES


def test_error_injection_exercises_the_rerun(in_repo):
    """An injected 'persistent' error (every check rejected at rate 1) reproduces on the rerun;
    a transient one would not (as the NaN above)."""
    summary, _ = train(["--error-injection-rate", "1", "--error-injection-type",
                        "persistent_error"])
    assert summary["exit_code"] == 16 and len(summary["losses"]) == 1


def test_rerun_mode_disabled_stops_at_once_naming_the_flags(in_repo):
    from megatron_parm.training.run_control import ResultRejected

    with pytest.raises(ResultRejected) as error:  # a ValueError: one line, no traceback
        train(["--rerun-mode", "disabled", "--train-iters", "2"], nan_from(MICRO_BATCHES + 1))
    assert str(error.value).startswith("Rank 0, node ")
    assert "iteration 2: Unexpected result nan (message='found NaN in local forward loss " \
           "calculation'): the run stops (--rerun-mode disabled; " \
           "--no-check-for-nan-in-loss-and-grad lets it go on)" in str(error.value)
    # a finite loss whose gradients are NaN: Megatron-Core's DDP checks each bucket
    with pytest.raises(ResultRejected, match="found NaN in local grad norm for bucket #0 in "
                                             "backward pass"):
        train(["--rerun-mode", "disabled", "--train-iters", "2"],
              lambda call, output: NanGrad.apply(output) if call > MICRO_BATCHES else output)
    assert gc.isenabled() and not torch.are_deterministic_algorithms_enabled()


def test_without_the_check_the_run_goes_on_counting_nan_iterations(in_repo, capsys):
    summary, _ = train(["--no-check-for-nan-in-loss-and-grad", "--train-iters", "3"],
                       nan_from(MICRO_BATCHES + 1))
    assert "exit_code" not in summary and len(summary["losses"]) == 3
    assert summary["losses"][0] == summary["losses"][0] and summary["losses"][1] != \
        summary["losses"][1]  # finite, then NaN
    out = capsys.readouterr().out
    assert out.count("number of nan iterations:   1 |") == 2, out[-2000:]


# ---------------------------------------------------------------------------------------------
# determinism, skipped iterations, collections, the duration, timeouts, hashes, signals
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain_run(world, prepared_data):
    """A run of 6 iterations without run-control flags: its losses and training calls."""
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        return train(["--train-iters", "6"])
    finally:
        os.chdir(cwd)


def test_deterministic_mode_gives_bitwise_equal_runs(in_repo, plain_run):
    runs = [train(["--train-iters", "6", "--deterministic-mode", "--exit-interval", "3"])
            for _ in range(2)]
    assert runs[0][0]["losses"] == runs[1][0]["losses"]  # bitwise
    for _, steps in runs:
        assert all(call["deterministic"] and call["deterministic_mode"] for call in steps.calls)
    assert not any(call["deterministic"] or call["deterministic_mode"]
                   for call in plain_run[1].calls)
    assert not torch.are_deterministic_algorithms_enabled()  # put back after the run
    # other kernels (deterministic ones), the same losses to rounding
    assert runs[0][0]["losses"] == pytest.approx(plain_run[0]["losses"][:3], rel=1e-6)


class Clock:
    """run_control's time: real time plus an offset."""

    def __init__(self):
        self.offset = 0.0

    def time(self):
        return time.time() + self.offset


class CountedGC:
    """run_control's gc: the real one, its collect() calls recorded (their generations)."""

    def __init__(self, collections):
        self.collections = collections

    def collect(self, generation=2):
        self.collections.append(generation)
        return gc.collect(generation)

    def __getattr__(self, name):
        return getattr(gc, name)


def test_skip_collections_duration_timeout_and_hashes(in_repo, plain_run, tmp_path, monkeypatch,
                                                      capsys):
    """One run of --iterations-to-skip 2, --manual-gc (interval 2), an evaluation every 2
    iterations, --exit-duration-in-mins 1 reached during iteration 4,
    --distributed-timeout-seconds-after-init 42 and a weight-hash check every 2 iterations."""
    from torch.distributed import distributed_c10d

    from megatron_parm.training import run_control

    clock, collections = Clock(), []
    monkeypatch.setattr(run_control, "time", clock)
    monkeypatch.setattr(run_control, "gc", CountedGC(collections))

    def jump_in_iteration_4(call, output):  # iterations 1, 2, 4 run: calls 5-6 are the 4th's
        if call == 5:
            clock.offset = 61.0
        return output

    summary, steps = train(["--train-iters", "6", "--iterations-to-skip", "2", "--manual-gc",
                            "--manual-gc-interval", "2", "--eval-iters", "1", "--eval-interval",
                            "2", "--exit-duration-in-mins", "1",
                            "--distributed-timeout-seconds-after-init", "42",
                            "--check-weight-hash-across-dp-replicas-interval", "2",
                            "--save", str(tmp_path / "ckpt")], jump_in_iteration_4)
    out = capsys.readouterr().out
    # the step after iteration 2 (Megatron-LM's numbering) was skipped: its batches drawn, not
    # learnt from
    assert len(summary["losses"]) == 3 and summary["iteration"] == 4
    assert summary["losses"][:2] == plain_run[0]["losses"][:2]
    assert summary["losses"][2] != plain_run[0]["losses"][3]  # other weights, same batches
    assert "> --iterations-to-skip: skipped iteration 3" in out
    assert " iteration        3/" not in out and " iteration        4/" in out
    # stopped after iteration 4, saved; its evaluation ended early, unprinted
    assert summary["exit_reason"] == "exit-duration-in-mins"
    assert (tmp_path / "ckpt/latest_checkpointed_iteration.txt").read_text() == "4"
    assert "> exiting during evaluation: --exit-duration-in-mins reached" in out
    assert "(--exit-duration-in-mins 1): stopping after iteration 4" in out
    assert [iteration for iteration, _ in summary["eval"]] == [2]
    # garbage collection: off while training, at the start, before (2) and after (0) each
    # evaluation, after iterations 2 and 4; on again after the run
    assert not any(call["gc"] for call in steps.calls) and gc.isenabled()
    assert collections == [2, 2, 0, 2, 2, 0, 2], collections
    # every group's timeout is 42 s after the first iteration
    groups = list(distributed_c10d._world.pg_map)
    assert len(groups) > 3 and {group._get_backend(torch.device("cpu")).options._timeout
                                for group in groups} == {__import__("datetime").timedelta(
                                    seconds=42)}
    for iteration in (0, 2, 4):
        assert f">>> Weight hashes match after {iteration} iterations..." in out


def test_the_weight_hash_check_names_what_differs(in_repo, plain_run, monkeypatch):
    """A replica whose parameters differ (the all-gather's answer changed: one rank here)."""
    from megatron_parm.training import run_control

    local = torch.zeros(3, 20, dtype=torch.uint8)
    other = local.clone()
    other[1, 5] = 1
    assert run_control.differing(local, [local.clone(), other]) == [1]
    all_gather = torch.distributed.all_gather

    def other_replica(replicas, local, group=None):
        all_gather(replicas, local, group=group)
        replicas[0][0] += 1  # the first parameter's hash

    monkeypatch.setattr(torch.distributed, "all_gather", other_replica)
    with pytest.raises(ValueError, match=r"^--check-weight-hash-across-dp-replicas-interval: "
                                         r"after iteration 0 parameters differ across "
                                         r"data-parallel replicas: module\.embedding\."):
        train(["--check-weight-hash-across-dp-replicas-interval", "5"])


def test_exit_signal_is_the_chosen_one(in_repo, capsys):
    def signal_in_iteration_2(call, output):
        if call == MICRO_BATCHES + 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        return output

    summary, _ = train(["--exit-signal-handler", "--exit-signal", "SIGUSR1"], signal_in_iteration_2)
    assert summary["exit_reason"] == "signal" and summary["iteration"] == 2
    assert "> exit signal received (SIGUSR1): stopping after iteration 2" in \
        capsys.readouterr().out
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # put back


def test_test_mode_runs_megatron_cores_realtime_tests(in_repo, monkeypatch):
    from megatron.core.transformer.attention import SelfAttention

    calls = []
    check = SelfAttention.run_realtime_tests
    monkeypatch.setattr(SelfAttention, "run_realtime_tests",
                        lambda self: calls.append(1) or check(self))
    train(["--train-iters", "1", "--lr-warmup-iters", "0", "--qk-layernorm", "--test-mode"])
    assert len(calls) == 2 * MICRO_BATCHES  # each layer's attention, each micro-batch


# ---------------------------------------------------------------------------------------------
# the per-token loss against a plain reference
# ---------------------------------------------------------------------------------------------

def _model(argv, model_type):
    from megatron_parm.data.loaders import build_iterators
    from megatron_parm.data.tokenizers import build_tokenizer
    from megatron_parm.training import trainer
    from megatron_parm.training.arguments import parse_args

    args = parse_args(argv, model_type=model_type)
    trainer.initialize(args)
    tokenizer = build_tokenizer(args)
    model, _, _ = trainer.build_model_and_optimizer(args, tokenizer.vocab_size)
    train_iter, _ = build_iterators(args, tokenizer, len(model), 0)
    return args, model, train_iter[0]


def _gradients(model):
    return [param.main_grad.clone() for chunk in model for param in chunk.parameters()]


def _reference_gradients(model, objective):
    for chunk in model:
        chunk.zero_grad_buffer()
    loss = objective()
    loss.backward()  # DDP's hooks add each gradient to its main_grad, unscaled (one rank)
    return loss.item(), _gradients(model)


def _megatron_gradients(model, forward_step, batches, per_token):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_parm.training.model import unwrap
    from megatron_parm.training.trainer import add_losses, reduce_losses

    unwrap(model[0]).config.calculate_per_token_loss = per_token
    for chunk in model:
        chunk.zero_grad_buffer()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches), model=model,
        num_microbatches=len(batches), seq_length=batches[0]["labels"].shape[1],
        micro_batch_size=batches[0]["labels"].shape[0], forward_only=False)
    return reduce_losses(add_losses(losses)), _gradients(model)


def _close(ours, reference):
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("model_type", ["gpt", "bert"])
def test_per_token_loss_matches_a_plain_reference(in_repo, model_type):
    """Two micro-batches with different token counts: with --calculate-per-token-loss the
    gradients are those of the loss summed over every token and divided by their number (BERT:
    plus the sentence-order loss, each micro-batch's weighted by its tokens), and the reported
    loss is that per-token mean; without it, those of the mean of the micro-batches' means.
    The router's losses are off (Megatron-Core's own scaling)."""
    from megatron_parm.training.model import FORWARD_STEPS

    config = {"gpt": "configs/gpt2_tiny_moe.yaml", "bert": "configs/bert_tiny_moe.yaml"}
    args, model, data = _model(["--config", config[model_type], "--micro-batch-size", "2",
                                "--global-batch-size", "4", "--moe-aux-loss-coeff", "0"],
                               model_type)
    batches = [next(data), next(data)]
    if model_type == "gpt":  # BERT's masks differ already
        batches[1]["loss_mask"][:, 20:] = 0
    counts = [batch["loss_mask"].sum() for batch in batches]
    assert counts[0] != counts[1]
    module = model[0].module

    def lm_and_sop(batch):
        if model_type == "gpt":
            return module(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                          labels=batch["labels"]), None
        losses, logits = module(batch["text"], batch["padding_mask"],
                                tokentype_ids=batch["types"], lm_labels=batch["labels"])
        return losses, torch.nn.functional.cross_entropy(logits.view(-1, 2).float(),
                                                         batch["is_random"].view(-1))

    def objective(per_token):
        terms = []
        for batch, count in zip(batches, counts):
            losses, sop = lm_and_sop(batch)
            lm = (losses.float() * batch["loss_mask"]).sum()
            terms.append((lm, sop if sop is not None else 0.0, count))
        if per_token:
            return sum(lm + sop * count for lm, sop, count in terms) / sum(counts)
        return sum(lm / count + sop for lm, sop, count in terms) / len(terms)

    for per_token in (True, False):
        loss, reference = _reference_gradients(model, lambda: objective(per_token))
        reported, ours = _megatron_gradients(model, FORWARD_STEPS[model_type], batches, per_token)
        _close(ours, reference)
        if model_type == "gpt":  # one loss: the reported one is the objective
            assert reported["lm loss"] == pytest.approx(loss, rel=1e-6)
        if per_token:
            per_token_gradients = ours
    with pytest.raises(AssertionError):  # the two losses differ here
        _close(per_token_gradients, ours)


# ---------------------------------------------------------------------------------------------
# the exit signal outside the ranks: the data loader's workers and the launcher
# ---------------------------------------------------------------------------------------------

class Pids(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        return {"pid": os.getpid()}


def test_data_loader_workers_ignore_the_exit_signal_and_end_with_their_iterator():
    from megatron_parm.data.loaders import build_data_iterator, shut_down

    batches = build_data_iterator(Pids(), 1, num_workers=1, cyclic=True, exit_signal="SIGUSR1")
    worker = int(next(batches)["pid"])
    assert worker != os.getpid()
    os.kill(worker, signal.SIGUSR1)  # without the handler: the default action ends it
    time.sleep(0.5)
    # past the batches it had prefetched: it went on after the signal
    assert [int(next(batches)["pid"]) for _ in range(8)] == [worker] * 8
    shut_down(batches)  # the trainer's, at the end of a run
    assert not os.path.exists(f"/proc/{worker}")


CHILD = """
import signal, sys, time
signal.signal(signal.SIGUSR1, lambda *_: (print("USR1", flush=True), sys.exit(0)))
signal.signal(signal.SIGTERM, lambda *_: (print("TERM", flush=True), sys.exit(0)))
print("ready", flush=True)
time.sleep(60)
"""


def test_the_launcher_passes_the_ranks_their_exit_signal():
    """The launcher's first SIGTERM is passed to the ranks as their --exit-signal (with
    --exit-signal-handler), SIGTERM otherwise; a second signal is torchrun's."""
    from megatron_parm import launch
    from megatron_parm.settings import read, training_parser

    def script(*flags):
        return launch.exit_signal(read(training_parser(), ["--config",
                                                           str(REPO / "configs/gpt2_tiny_moe.yaml"),
                                                           *flags]))

    assert script() == signal.SIGTERM
    assert script("--exit-signal", "SIGUSR1") == signal.SIGTERM  # no handler: SIGTERM ends them
    forward = script("--exit-signal-handler", "--exit-signal", "SIGUSR1")
    assert forward == signal.SIGUSR1
    torchrun_calls = []
    stop = launch._GracefulStop(lambda signum, frame: torchrun_calls.append(signum), forward)
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        stop(signal.SIGTERM, None)
        assert child.wait(timeout=30) == 0 and child.stdout.read().strip() == "USR1"
        stop(signal.SIGTERM, None)
        assert torchrun_calls == [signal.SIGTERM]
    finally:
        child.kill()
