"""Megatron-LM's logging flags, in one process: the model FLOPs of --log-throughput against
torch's FLOP counter, --log-params-norm against the parameters, --log-num-zeros-in-grad against
the gradients, the timers of each --timing-log-level, what TensorBoard and W&B receive (read
back from the event files; W&B through a stand-in module), --logging-level, progress.txt and
the memory line. Their multi-rank checks (each shard counted once, over tp=2, ep=2) are in
tests/e2e/test_pretrain.py's launch."""

from __future__ import annotations

import logging
import math
import re
import sys
import types
import warnings

import pytest
import torch

from launch import REPO
from megatron_parm.training.arguments import parse_args

TINY_GPT = ["--config", str(REPO / "configs/gpt2_tiny_moe.yaml")]
VOCAB = 1000


def tiny_args(*flags):
    return parse_args(TINY_GPT + list(flags), world_size=1, reads_data=False)


def build(args):
    """The trainer's model chunks and optimizer for ARGS (Megatron's DDP, its optimizer)."""
    from megatron_parm.training.trainer import build_model_and_optimizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, _ = build_model_and_optimizer(args, VOCAB)
    return model, optimizer


def event_values(log_dir) -> dict:
    """{tag: [(step, value)]} of every scalar TensorBoard wrote under LOG_DIR."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


# ---------------------------------------------------------------------------------------------
# --log-throughput: the model FLOPs
# ---------------------------------------------------------------------------------------------

MODERN = ["--swiglu", "--group-query-attention", "--num-query-groups", "2",
          "--moe-shared-expert-intermediate-size", "64", "--moe-layer-freq", "[0,1]",
          "--kv-channels", "32", "--moe-ffn-hidden-size", "96", "--normalization", "RMSNorm"]


MTP = ["--position-embedding-type", "rope", "--mtp-num-layers", "2"]


@pytest.mark.parametrize("flags", [[], MODERN, MTP], ids=["gpt2_tiny", "swiglu_gqa_shared_dense",
                                                          "mtp"])
def test_flops_are_megatron_lm_s_count_of_the_model_s_gemms(megatron_world, flags):
    """torch's FLOP counter over one forward and backward of the model the trainer builds
    (every GEMM, 2 per multiply-add) minus what Megatron-LM's count leaves out: the routers'
    GEMMs and the masked half of QK^T and of its product with V; plus what it counts that is
    no GEMM: 3h per token for each multi-token prediction layer's norms."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_parm.training import flops
    from megatron_parm.training.model import build_model

    args = tiny_args(*flags)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_model(args, VOCAB)
    batch, seq = 2, args.seq_length
    tokens = torch.randint(0, VOCAB, (batch, seq))
    positions = torch.arange(seq).expand(batch, seq)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1).expand(batch, 1, seq, seq)
    # the routers' loss tracker is sized by the first model that logs to it (MTP adds layers)
    get_moe_layer_wise_logging_tracker().clear()
    with FlopCounterMode(display=False) as counter:
        model(tokens, positions, mask, labels=tokens).sum().backward()
    mtp = args.mtp_num_layers or 0
    pattern = flops.moe_layer_pattern(args)
    num_moe_layers = sum(pattern) + pattern[-1] * mtp
    router = 3 * 2 * batch * seq * args.hidden_size * args.num_experts * num_moe_layers
    query = (args.kv_channels or args.hidden_size // args.num_attention_heads) \
        * args.num_attention_heads
    masked_half = 3 * 2 * batch * seq * seq * query * (args.num_layers + mtp)
    mtp_norms = 3 * 2 * batch * seq * mtp * 3 * args.hidden_size
    expected = counter.get_total_flops() - router - masked_half + mtp_norms
    assert flops.num_floating_point_operations(args, batch, model.vocab_size) == expected
    # linear in the batch: one sample's count times the samples
    assert flops.num_floating_point_operations(args, 1, model.vocab_size) * batch == expected


def test_throughput_is_tflops_per_rank():
    from megatron_parm.training.flops import throughput

    assert throughput(8e12, 2.0, 4) == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------
# --log-params-norm, --log-num-zeros-in-grad
# ---------------------------------------------------------------------------------------------

def test_params_norm_is_the_norm_of_every_parameter(megatron_world):
    from megatron_parm.training.params_norm import params_norm

    model, _ = build(tiny_args())
    parameters = [p for chunk in model for p in chunk.parameters()]  # the tied embedding once
    plain = math.sqrt(sum(float((p.detach().double() ** 2).sum()) for p in parameters))
    assert params_norm(model) == pytest.approx(plain, rel=1e-6)
    with torch.no_grad():
        parameters[0].mul_(2.0)
    assert params_norm(model) > plain


def test_params_norm_in_bf16_is_the_main_params_norm(megatron_world):
    """With --bf16, Megatron-LM's norm is that of the fp32 main parameters Megatron-Core's
    mixed-precision optimizer keeps on each parameter."""
    from megatron_parm.training.params_norm import params_norm

    model, _ = build(tiny_args("--bf16"))
    parameters = [p for chunk in model for p in chunk.parameters()]
    assert all(p.dtype == torch.bfloat16 and p.main_param.dtype == torch.float32
               for p in parameters)
    with torch.no_grad():
        for param in parameters:  # main parameters apart from their bf16 copies
            param.main_param.add_(1e-3)
    plain = math.sqrt(sum(float((p.main_param.double() ** 2).sum()) for p in parameters))
    assert params_norm(model, bf16=True) == pytest.approx(plain, rel=1e-6)


def test_num_zeros_counts_the_gradients_zeros(megatron_world):
    """Megatron-Core's optimizer counts them when --log-num-zeros-in-grad reaches its config:
    the gradients' zeros, after clipping (which keeps them), and nothing without the flag."""
    model, optimizer = build(tiny_args("--log-num-zeros-in-grad"))
    generator = torch.Generator().manual_seed(0)
    expected = 0
    for chunk in model:
        for param in chunk.parameters():
            grad = torch.randn(param.shape, generator=generator)
            grad[torch.rand(param.shape, generator=generator) < 0.3] = 0.0
            param.main_grad.copy_(grad)
            expected += int((grad == 0).sum())
    _, grad_norm, num_zeros = optimizer.step()
    assert grad_norm > 1.0  # clipped at --clip-grad 1.0
    assert num_zeros == expected > 0
    _, plain_optimizer = build(tiny_args())
    assert plain_optimizer.step()[2] is None


# ---------------------------------------------------------------------------------------------
# --timing-log-level, --timing-log-option, --no-barrier-with-level-1-timing
# ---------------------------------------------------------------------------------------------

def test_timer_names_per_level_are_megatron_lm_s():
    from megatron_parm.training.timers import timer_names

    assert timer_names(0) == []
    assert timer_names(1)[0] == "forward-backward" and timer_names(1)[-1] == "optimizer"
    assert len(timer_names(1)) == 12 and len(timer_names(2)) == 24
    assert timer_names(2)[12:15] == ["batch-generator", "forward-compute", "backward-compute"]


@pytest.mark.parametrize("level,option,heading", [
    (1, "minmax", "(min, max) time across ranks (ms):"),
    (2, "max", "max time across ranks (ms):"),
    (2, "all", "times across ranks (ms):")])
def test_timers_log_their_level_on_the_configs(megatron_world, capsys, level, option, heading):
    from megatron_parm.training.timers import Timers

    args = tiny_args("--timing-log-level", str(level), "--timing-log-option", option,
                     "--no-barrier-with-level-1-timing")
    configs = [types.SimpleNamespace(timers=None, barrier_with_L1_time=True) for _ in range(2)]
    timers = Timers(args, configs)
    assert all(c.timers is timers.timers and c.barrier_with_L1_time is False for c in configs)
    with timers.paused():
        assert all(c.timers is None for c in configs)
    assert all(c.timers is timers.timers for c in configs)
    with timers.region("optimizer", log_level=1):
        pass
    timers("forward-compute", log_level=2).start()
    timers("forward-compute", log_level=2).stop()
    capsys.readouterr()
    timers.log(normalizer=2)
    out = capsys.readouterr().out
    names = re.findall(r"^ +(optimizer|forward-compute)\b", out, re.M)
    assert out.startswith(heading)
    assert names == ["optimizer", "forward-compute"] if level == 2 else ["optimizer"], out
    timers.log(normalizer=2)  # reset: nothing timed since
    assert capsys.readouterr().out == ""


def test_timing_log_level_takes_megatron_lm_s_ints(capsys):
    assert tiny_args("--timing-log-level", "2").timing_log_level == 2
    with pytest.raises(SystemExit):
        tiny_args("--timing-log-level", "3")
    assert "--timing-log-level: invalid choice: 3 (choose from 0, 1, 2)" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# TensorBoard and W&B
# ---------------------------------------------------------------------------------------------

def training_log(args):
    from megatron_parm.training.log import TrainingLog

    return TrainingLog(args, True, 0, "", VOCAB)


def values(**overrides):
    from megatron_parm.training.log import IterationValues

    fields = dict(losses={"lm loss": 2.5}, learning_rate=1e-3, loss_scale=1.0, grad_norm=0.5,
                  num_zeros=None, params_norm=None, router={"load_balancing_loss": [1.0, 3.0]},
                  seconds_per_step=None)
    return IterationValues(**{**fields, **overrides})


def test_tensorboard_gets_megatron_lm_s_tags_where_the_flags_say(megatron_world, tmp_path):
    log = training_log(tiny_args("--tensorboard-dir", str(tmp_path / "a"),
                                 "--tensorboard-log-interval", "2",
                                 "--log-world-size-to-tensorboard", "--moe-per-layer-logging",
                                 "--log-memory-to-tensorboard", "--tensorboard-queue-size", "7"))
    assert log.writers.tensorboard.writer.max_queue == 7
    for iteration in (1, 2):
        log.interval.add({"lm loss": 2.5}, True, 16, 1)  # as the trainer does before record
        log.record(iteration, 16 * iteration, values(num_zeros=12.0, params_norm=3.5))
    log.validation(2, 32, {"lm loss": 2.0})
    log.writers.close()
    written = event_values(tmp_path / "a")
    assert written["lm loss"] == [(2, 2.5)] and written["lm loss vs samples"] == [(32, 2.5)]
    assert written["learning-rate"] == [(2, pytest.approx(1e-3))]
    assert written["batch-size"] == [(2, 16)] and written["world-size"] == [(2, 1)]
    assert written["loss-scale"] == [(2, 1.0)] and written["grad-norm"] == [(2, 0.5)]
    assert written["num-zeros"] == [(2, 12.0)] and written["params-norm"] == [(2, 3.5)]
    assert written["load_balancing_loss"] == [(2, 2.0)]  # the mean over the MoE layers
    assert written["moe/load_balancing_loss_layer_1"] == [(2, 3.0)]
    assert written["mem-resident-bytes"][0][1] > 1e7  # CPU: the process's resident memory
    assert written["mem-max-resident-bytes"][0][1] >= written["mem-resident-bytes"][0][1]
    assert written["lm loss validation"] == [(2, 2.0)]
    assert written["lm loss validation vs samples"] == [(32, 2.0)]
    assert "lm loss validation ppl" not in written

    log = training_log(tiny_args("--tensorboard-dir", str(tmp_path / "b"),
                                 "--no-log-loss-scale-to-tensorboard",
                                 "--log-validation-ppl-to-tensorboard"))
    log.record(1, 16, values(grad_norm=None))
    log.validation(1, 16, {"lm loss": 2.0})
    log.writers.close()
    written = event_values(tmp_path / "b")
    assert {"loss-scale", "grad-norm", "world-size", "num-zeros", "params-norm",
            "moe/load_balancing_loss_layer_0", "mem-resident-bytes"}.isdisjoint(written)
    assert written["lm loss validation ppl"] == [(1, pytest.approx(math.exp(2.0)))]


class FakeWandB(types.ModuleType):
    """A stand-in for the wandb package: records init, log and finish."""

    def __init__(self):
        super().__init__("wandb")
        self.calls = []

    def init(self, **options):
        self.calls.append(("init", options))

    def log(self, values, step=None):
        self.calls.append(("log", dict(values), step))

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_runs_offline_and_gets_what_tensorboard_gets(megatron_world, tmp_path,
                                                           monkeypatch):
    fake = FakeWandB()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    args = tiny_args("--wandb-project", "proj", "--wandb-exp-name", "run1", "--wandb-entity",
                     "team", "--save", str(tmp_path / "ckpt"))
    log = training_log(args)
    assert log.writers.notices == [] and log.writers.configured
    (kind, options), = fake.calls
    assert kind == "init" and options["mode"] == "offline"
    assert options["dir"] == str(tmp_path / "ckpt" / "wandb") and (tmp_path / "ckpt/wandb").is_dir()
    assert (options["project"], options["name"], options["entity"]) == ("proj", "run1", "team")
    assert options["config"]["wandb_project"] == "proj"
    log.record(1, 16, values())
    log.validation(1, 16, {"lm loss": 2.0})
    log.writers.close()
    logged = {}
    for call in fake.calls[1:-1]:
        assert call[0] == "log" and call[2] == 1
        logged.update(call[1])
    assert logged["lm loss"] == 2.5 and logged["learning-rate"] == 1e-3
    assert logged["samples vs steps"] == 16 and logged["lm loss validation"] == 2.0
    assert not any(name.endswith("vs samples") for name in logged)
    assert fake.calls[-1] == ("finish",)
    # only rank 0 writes
    from megatron_parm.training.writers import WandB

    fake.calls.clear()
    WandB(args, is_rank_0=False).log({"x": 1.0}, 1)
    assert fake.calls == []


def test_wandb_without_the_package_is_one_line_and_the_run_goes_on(megatron_world, tmp_path,
                                                                   monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    log = training_log(tiny_args("--wandb-project", "proj", "--wandb-save-dir", str(tmp_path)))
    out = capsys.readouterr().out
    assert out.count("W&B") == 1 and "'wandb' package is not installed" in out
    assert "--wandb-project proj" in out and "megatron-parm[wandb]" in out
    log.record(1, 16, values())  # nothing to write to, nothing fails
    log.writers.close()


@pytest.mark.parametrize("flags,message", [
    (["--wandb-project", "p"], "--wandb-project needs --wandb-save-dir or --save"),
    (["--wandb-project", "p", "--save", "x", "--wandb-exp-name", ""], "--wandb-exp-name")])
def test_wandb_flag_mistakes_name_the_flag(flags, message):
    with pytest.raises(ValueError, match=message):
        tiny_args(*flags)


# ---------------------------------------------------------------------------------------------
# the console: the iteration line, --logging-level, the memory line, progress.txt
# ---------------------------------------------------------------------------------------------

def test_iteration_line_adds_throughput_num_zeros_and_params_norm_as_megatron_lm():
    from megatron_parm.training.log import iteration_line

    line = iteration_line(10, 100, 640, 123.44, 1e-4, 64, {"lm loss": 6.1}, 2048.0, 0.5,
                          throughput=12.345, num_zeros=17.0, params_norm=250.1234)
    assert " elapsed time per iteration (ms): 123.4 | throughput per GPU (TFLOP/s/GPU): 12.3 |" \
           " learning rate:" in line
    assert " grad norm: 0.500 | num zeros: 17.0 | params norm: 250.123 | number of skipped" in line
    plain = iteration_line(10, 100, 640, 123.44, 1e-4, 64, {"lm loss": 6.1}, 2048.0, 0.5)
    assert "throughput" not in plain and "num zeros" not in plain and "params norm" not in plain


def test_logging_level_prints_every_logger_to_stdout_and_is_undone(capsys):
    from megatron_parm.training.log import setup_logging

    root = logging.getLogger()
    before = (root.level, list(root.handlers))
    setup_logging(10)
    try:
        assert root.level == 10
        logging.getLogger("megatron.core.timers").debug("a debug record")
        logging.getLogger("torch.distributed.elastic").warning("left out")
        out = capsys.readouterr().out
        assert "Setting logging level to 10" in out and "a debug record" in out
        assert "left out" not in out
    finally:
        setup_logging(None)
    assert (root.level, list(root.handlers)) == before


def test_memory_line_on_cpu_is_the_process_s_resident_memory():
    from megatron_parm.training.memory import memory_line

    line = memory_line("(after 10 iterations)", device_memory_used=True)
    fields = dict(part.split(": ") for part in line.split(" | ")[1:])
    assert line.startswith("(after 10 iterations) memory (MB) | resident: ")
    assert 10 < float(fields["resident"]) <= float(fields["max resident"])
    assert float(fields["total host memory used"]) > float(fields["resident"])


def test_progress_log_finds_the_first_job_of_this_world_size():
    from megatron_parm.training.progress_log import cumulative_start

    def line(when, ranks, event):
        return f"2025-01-01 {when}\tJob ID: 7\t# GPUs: {ranks}\t{event}\n"

    saved = "Saved checkpoint\tIteration: {}\tJob throughput: 1.0 TFLOP/s/GPU\tCumulative " \
            "throughput: 1.0 TFLOP/s/GPU\tFloating-point operations: {:.2e}\tTokens (in " \
            "billions): 0.00"
    lines = [line("00:00:00", 4, "Starting job"), line("01:00:00", 4, saved.format(10, 1e15)),
             line("02:00:00", 8, "Starting job"), line("03:00:00", 8, saved.format(20, 3e15)),
             line("04:00:00", 8, "Starting job")]
    when, flops = cumulative_start(lines, 8)
    assert str(when) == "2025-01-01 02:00:00" and flops == 1e15
    assert cumulative_start(lines, 2) is None
    lines.append(line("05:00:00", 4, "Starting job"))
    when, flops = cumulative_start(lines, 4)
    assert str(when) == "2025-01-01 05:00:00" and flops == 3e15
