"""Sample-based schedules, batch-size ramp-up, WSD and weight-decay schedules (training/schedule.py):
per iteration, the global batch, its micro-batches, the learning rate and the weight decay the
flags give, against a plain reference of Megatron-LM's semantics written here (its
update_train_iters, its rampup calculator, its OptimizerParamScheduler formulas); Megatron-LM's
rules between the flags; and a sample-based, ramped schedule resumed from its state."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_parm.checkpointing.errors import CheckpointError
from megatron_parm.checkpointing.scheduler import check_schedule
from megatron_parm.training import schedule
from megatron_parm.training.arguments import parse_args

REPO = Path(__file__).resolve().parents[2]
# lr 3e-3, min 3e-4, cosine, warmup 4 iterations, weight decay 0.01, micro-batch 4, global 16
TINY_GPT = ["--config", str(REPO / "configs/gpt2_tiny_moe.yaml")]
WORLD = 2  # data-parallel size 2: a step is 8 samples


def args_of(flags):
    return parse_args(TINY_GPT + flags, world_size=WORLD, reads_data=False)


# ---------------------------------------------------------------------------------------------
# the reference: Megatron-LM's semantics, written out
# ---------------------------------------------------------------------------------------------

def ramp_batch(consumed, start, increment, ramp_samples, final):
    """The global batch after CONSUMED samples: START, growing by INCREMENT in equal shares of
    RAMP_SAMPLES up to FINAL."""
    if consumed > ramp_samples:
        return final
    per_increment = ramp_samples / ((final - start) // increment)
    return start + int(consumed / per_increment) * increment


def reference_iterations(train_samples, final, ramp):
    if ramp is None:
        return train_samples // final
    iterations = consumed = 0
    while consumed <= ramp[2] and consumed <= train_samples:
        consumed += ramp_batch(consumed, *ramp, final)
        iterations += 1
    return iterations + max(train_samples - consumed, 0) // final


def reference_lr(n, init, peak, low, warmup, decay, style, wsd=None, wsd_style=None):
    if warmup > 0 and n <= warmup:
        return init + (peak - init) * n / warmup
    if style == "constant":
        return peak
    if n > decay:
        return low
    if style == "inverse-square-root":
        return max(low, peak * math.sqrt(max(warmup, 1) / max(n, 1)))
    ratio = (n - warmup) / (decay - warmup)
    if style == "linear":
        share = 1 - ratio
    elif style == "cosine":
        share = (1 + math.cos(math.pi * ratio)) / 2
    else:  # WSD: stable, then the last `wsd` samples decay
        anneal = (n - (decay - wsd)) / wsd
        share = 1.0 if anneal <= 0 else {
            "linear": 1 - anneal, "cosine": (1 + math.cos(math.pi * anneal)) / 2,
            "exponential": 2 * 0.5 ** anneal - 1, "minus_sqrt": 1 - math.sqrt(anneal)}[wsd_style]
    return low + share * (peak - low)


def reference_wd(n, start, end, total, style):
    if n > total or style == "constant":
        return end
    ratio = n / total
    share = ratio if style == "linear" else (1 - math.cos(math.pi * ratio)) / 2
    return start + share * (end - start)


def reference_run(train_samples, final, ramp, decrease, lr, wd):
    """[(global batch, micro-batches, lr, weight decay)] per iteration; lr / wd: the reference
    functions' other arguments, lengths in samples."""
    per_step = 4 * WORLD
    rows, consumed = [], 0
    for _ in range(reference_iterations(train_samples, final, ramp)):
        batch = final if ramp is None else ramp_batch(consumed, *ramp, final)
        running = batch // per_step * per_step if decrease else batch
        rows.append((batch, running // per_step, reference_lr(consumed, **lr),
                     reference_wd(consumed, **wd)))
        consumed += running
    return rows


def run(args):
    """What the trainer's loop does with the flags (training/trainer.py Run), per iteration:
    (global batch, micro-batches, lr, weight decay) as each iteration runs them."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = schedule.build_scheduler(args, optimizer)
    batches = schedule.BatchSchedule(args, rank=-1)
    rows, consumed = [], 0
    for _ in range(args.train_iters):
        batches.update(consumed)
        group = optimizer.param_groups[0]
        rows.append((batches.global_batch_size, batches.num_microbatches, group["lr"],
                     group["weight_decay"]))
        scheduler.step(increment=batches.running)
        consumed += batches.running
    return rows


LR = dict(init=0.0, peak=3e-3, low=3e-4)
CASES = {
    # iterations: lengths x 16 samples; warmup from --lr-warmup-init; past the decay: min lr
    "iterations cosine": (
        ["--train-iters", "12", "--lr-decay-iters", "10", "--lr-warmup-init", "1e-4"],
        (12 * 16, 16, None, False),
        dict(LR, init=1e-4, warmup=64, decay=160, style="cosine"),
        dict(start=0.01, end=0.01, total=192, style="constant")),
    "samples linear": (
        ["--train-samples", "400", "--lr-warmup-samples", "48", "--lr-decay-samples", "320",
         "--lr-decay-style", "linear", "--lr-warmup-init", "3e-4"],
        (400, 16, None, False),
        dict(LR, init=3e-4, warmup=48, decay=320, style="linear"),
        dict(start=0.01, end=0.01, total=400, style="constant")),
    "samples ramp-up, WSD, weight decay linear": (
        ["--train-samples", "640", "--global-batch-size", "32", "--rampup-batch-size", "8", "8",
         "128", "--lr-warmup-fraction", "0.1", "--lr-decay-style", "WSD",
         "--lr-wsd-decay-style", "minus_sqrt", "--lr-wsd-decay-samples", "200",
         "--weight-decay-incr-style", "linear", "--start-weight-decay", "0.0",
         "--end-weight-decay", "0.1"],
        (640, 32, (8, 8, 128), False),
        dict(LR, warmup=64, decay=640, style="WSD", wsd=200, wsd_style="minus_sqrt"),
        dict(start=0.0, end=0.1, total=640, style="linear")),
    "iterations WSD, weight decay cosine": (
        ["--train-iters", "12", "--lr-warmup-fraction", "0.2", "--lr-decay-style", "WSD",
         "--lr-wsd-decay-iters", "4", "--weight-decay-incr-style", "cosine",
         "--start-weight-decay", "0.01", "--end-weight-decay", "0.05"],
        (192, 16, None, False),
        dict(LR, warmup=0.2 * 192, decay=192, style="WSD", wsd=64, wsd_style="exponential"),
        dict(start=0.01, end=0.05, total=192, style="cosine")),
    "samples ramp-up decreased to whole steps, inverse square root": (
        ["--train-samples", "400", "--global-batch-size", "20", "--rampup-batch-size", "12",
         "4", "96", "--decrease-batch-size-if-needed", "--lr-warmup-samples", "32",
         "--lr-decay-style", "inverse-square-root"],
        (400, 20, (12, 4, 96), True),
        dict(LR, warmup=32, decay=400, style="inverse-square-root"),
        dict(start=0.01, end=0.01, total=400, style="constant")),
}


@pytest.mark.parametrize("name", CASES)
def test_each_iteration_s_batch_lr_and_weight_decay_are_megatron_lm_s(name):
    flags, (samples, final, ramp, decrease), lr, wd = CASES[name]
    args = args_of(flags)
    expected = reference_run(samples, final, ramp, decrease, lr, wd)
    assert args.train_iters == len(expected)
    got = run(args)
    assert [row[:2] for row in got] == [row[:2] for row in expected]
    for index in (2, 3):  # the learning rate, the weight decay
        assert [row[index] for row in got] == pytest.approx([row[index] for row in expected],
                                                             rel=1e-12, abs=1e-15)
    if ramp is not None:  # the batch grew, and the lr moved with the samples, not iterations
        assert len({row[0] for row in got}) > 2


def test_train_samples_count_megatron_lm_s_iterations():
    # the ramp's own batch sizes (8, 16, 24) while it lasts, then whole batches of 32; a partial
    # last batch is dropped
    args = args_of(["--train-samples", "1000", "--global-batch-size", "32",
                    "--rampup-batch-size", "8", "8", "96", "--lr-warmup-samples", "0"])
    assert args.train_iters == reference_iterations(1000, 32, (8, 8, 96)) == 35
    assert schedule.scheduler_lengths(args) == dict(lr_decay_steps=1000, wd_incr_steps=1000,
                                                    wsd_decay_steps=None, lr_warmup_steps=0)


def test_a_resumed_ramped_sample_schedule_continues_where_it_stopped():
    """Megatron-LM's resume: the scheduler's state (lengths in samples, the samples it advanced
    by) and the consumed samples, from which the ramp's batch comes back."""
    flags = ["--train-samples", "640", "--global-batch-size", "32", "--rampup-batch-size", "8",
             "8", "128", "--lr-warmup-samples", "64", "--lr-decay-style", "linear"]
    args = args_of(flags)
    whole = run(args)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler, batches = schedule.build_scheduler(args, optimizer), schedule.BatchSchedule(args)
    consumed = 0
    for _ in range(7):
        batches.update(consumed)
        scheduler.step(increment=batches.running)
        consumed += batches.running
    saved = scheduler.state_dict()

    resumed = args_of(flags)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler, batches = schedule.build_scheduler(resumed, optimizer), schedule.BatchSchedule(resumed)
    check_schedule("ckpt", saved, scheduler, None, None, sample_based=True)
    scheduler.load_state_dict(saved)
    rows = []
    for _ in range(7, resumed.train_iters):
        batches.update(consumed)
        rows.append((batches.global_batch_size, batches.num_microbatches,
                     optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["weight_decay"]))
        scheduler.step(increment=batches.running)
        consumed += batches.running
    assert rows == whole[7:]
    assert whole[7][0] < 32  # stopped mid-ramp

    # another decay length: refused without a flag, naming it in samples; then either schedule
    longer = args_of(flags + ["--lr-decay-samples", "800"])
    with pytest.raises(CheckpointError) as info:
        check_schedule("ckpt", saved, schedule.build_scheduler(longer, optimizer), None, None,
                       sample_based=True)
    assert ("--lr-decay-samples (default: --train-samples): 640 samples in the checkpoint, 800 "
            "samples on the command line") in str(info.value)
    for flag, decay in (("--override-opt_param-scheduler", 800),
                        ("--use-checkpoint-opt_param-scheduler", 640)):
        kept = schedule.build_scheduler(args_of(flags + ["--lr-decay-samples", "800", flag]),
                                        optimizer)
        kept.load_state_dict(saved)
        assert kept.lr_decay_steps == decay and kept.num_steps == saved["num_steps"]


@pytest.mark.parametrize("flags, message", [
    (["--train-samples", "400"],  # the config's warmup is in iterations
     "--lr-warmup-iters does not go with --train-samples: give --lr-warmup-samples"),
    (["--lr-decay-samples", "100"],
     "--lr-decay-samples does not go with --train-iters: give --lr-decay-iters"),
    (["--train-iters", "10", "--train-samples", "400"],
     "--train-iters and --train-samples exclude each other"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"],
     "--lr-warmup-fraction and --lr-warmup-iters exclude each other"),
    (["--rampup-batch-size", "8", "8", "64"], "--rampup-batch-size needs sample-based training"),
    (["--train-samples", "400", "--lr-warmup-samples", "0", "--rampup-batch-size", "4", "8",
      "64"], "the start must be below --global-batch-size (16) and the difference a multiple"),
    (["--train-samples", "400", "--lr-warmup-samples", "0", "--rampup-batch-size", "4", "4",
      "64"], "--rampup-batch-size: at global batch size 4: global batch size 4 must be divisible "
             "by --micro-batch-size x data-parallel size (8) (or give "
             "--decrease-batch-size-if-needed)"),
    (["--train-samples", "10", "--lr-warmup-samples", "0"],
     "--train-samples (10) is less than one global batch (16)"),
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (["--lr-warmup-iters", "40"], "--lr-warmup-iters must give a warmup shorter than "
                                  "--lr-decay-iters"),
    (["--weight-decay-incr-style", "linear"],
     "--weight-decay-incr-style linear needs --start-weight-decay and --end-weight-decay"),
    (["--start-weight-decay", "0.1"], "--start-weight-decay and --end-weight-decay need "
                                      "--weight-decay-incr-style linear or cosine"),
    (["--weight-decay-incr-style", "cosine", "--start-weight-decay", "0.1",
      "--end-weight-decay", "0.01"], "--end-weight-decay (0.01) must be at least"),
    (["--lr-warmup-init", "0.1"], "--lr-warmup-init (0.1) must not exceed --lr"),
    (["--decoupled-min-lr", "1e-5"], "--decoupled-min-lr needs --decoupled-lr"),
    (["--num-distributed-optimizer-instances", "2"],
     "--num-distributed-optimizer-instances needs --use-distributed-optimizer"),
    (["--num-distributed-optimizer-instances", "4", "--use-distributed-optimizer"],
     "--num-distributed-optimizer-instances (4) must divide the data-parallel size (2)"),
    (["--optimizer", "muon"], "not available here: --optimizer muon: Megatron-Core 0.16.1's Muon "
                              "needs the emerging_optimizers package"),
])
def test_megatron_lm_s_rules_are_one_line_naming_the_flag(flags, message):
    with pytest.raises(ValueError) as info:
        args_of(flags)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_the_command_line_s_unit_replaces_the_config_s():
    """The tiny config trains 40 iterations with 4 of warmup: --train-samples and
    --lr-warmup-samples on the command line replace both (a config file's value never stands
    against the command line)."""
    args = args_of(["--train-samples", "320", "--lr-warmup-samples", "32"])
    assert (args.train_iters, args.lr_warmup_iters, args.lr_decay_samples) == (20, 0, 320)
