"""GPT-2 MoE and BERT MoE pretraining on 4 gloo ranks (tp=2, ep=2, sequence parallel).

One torchrun launch (this file run as a script) trains, in one process per rank:
  * GPT-2 MoE (tiny) for 20 iterations with each dispatcher in turn, from the same seed;
  * BERT MoE (tiny) for 20 iterations with a Parm dispatcher, saving a checkpoint.
  * GPT-2 MoE with parm without tuning (--no-parm-tune; the loop's parm tunes by default);
  * parm tuning with candidates that fail (S2 at 2 forward chunks and Megatron's allgather out
    of memory, parm_hier refused), kept in a cache file, then a run that finds it there;
  * GPT-2 MoE for 4 iterations with Megatron-LM's data-parallel flags (DDP_RUNS; the
    distributed optimizer's with the schedule in samples and Megatron-LM's data flags), and with
    the step's time breakdown written (alltoall, parm_s2);
  * GPT-2 MoE for 4 iterations with Megatron-FSDP (--use-megatron-fsdp, ZeRO-3), with alltoall
    (a DDP run) and with parm_s2 and grouped-GEMM experts, next to the same with Megatron's DDP
    (FSDP_PARM);
  * GPT-2 MoE for 4 iterations with activation recompute, full and selective (recompute_runs);
  * GPT-2 MoE for 4 iterations on Megatron-Core's mock data with the NullTokenizer (MOCK);
  * GPT-2 MoE (output layer untied) for 4 iterations with Megatron-LM's logging flags
    (logging_run), then its last gradients saved as a checkpoint in the weights' place.
  * GPT-2 MoE with Megatron-LM's run-control flags (run_control_runs): --manual-gc,
    --deterministic-mode, the weight-hash check, the timeout after the first iteration, and
    --exit-duration-in-mins passed on one rank only; then a weight-hash check that finds one
    rank's parameters changed.
The tests then check, from the recorded summaries and the console output:
  * the loss falls for both models;
  * every dispatcher's GPT loss curve matches alltoall's to 1e-4;
  * parm's losses are the same tuned and untuned, and with failing candidates (skipped, one
    warning each); the choice is logged once per layer, measured, then cached;
  * the checkpoint is in Megatron-LM's layout and the console lines are in its format;
  * Megatron-FSDP's losses and gradient norms are DDP's (with the distributed optimizer);
  * each data-parallel flag, the timing breakdown, activation recompute and the data flags
    that change no sample (2 DataLoader workers per rank, no attention mask in the batch, no
    mmap) leave the losses as they are, and the breakdown has the parts each run must have;
  * mock data trains, its vocabulary padded as --make-vocab-size-divisible-by says;
  * the logging flags: the params norm is the norm of the saved weights and the zeros count
    that of the saved gradients (each shard once over tp=2, ep=2), TensorBoard's tags and
    values read back from the event files, the timers of --timing-log-level 1 and 2, the
    memory lines, progress.txt and W&B's one line where the package is missing.
  * every rank stops at the same iteration when one alone finds the duration passed, collects
    garbage at the same points, and refuses parameters that differ across data-parallel
    replicas.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY_GPT = ["--config", "configs/gpt2_tiny_moe.yaml"]
TINY_BERT = ["--config", "configs/bert_tiny_moe.yaml"]
LAYOUT = ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
          "--sequence-parallel"]
# One micro-batch of 4 per data-parallel rank: the cheapest iteration that still uses DP.
SHORT = ["--train-iters", "20", "--micro-batch-size", "4", "--global-batch-size", "8",
         "--log-interval", "10", "--eval-interval", "20", "--eval-iters", "1"]
NUM_ITERS = 20


def dispatchers_to_compare():
    from megatron_parm import schedules

    return [name for name in schedules.names() if name != "allgather"]


def worker(out_path: str, run_dir: str) -> None:
    """Runs on every rank under torchrun; rank 0 writes the summaries to out_path."""
    sys.path.insert(0, str(REPO))
    import torch

    from megatron_parm.training.arguments import parse_args
    from megatron_parm.training.trainer import pretrain

    results = {"gpt": {}, "bert": None}
    for name in dispatchers_to_compare():
        args = parse_args(TINY_GPT + LAYOUT + SHORT + ["--moe-token-dispatcher-type", name])
        results["gpt"][name] = pretrain(args)["losses"]
    args = parse_args(TINY_GPT + LAYOUT + SHORT + ["--moe-token-dispatcher-type", "parm",
                                                   "--no-parm-tune"])
    results["parm_no_tune"] = pretrain(args)["losses"]
    results["tune_fail"], results["tune_fail_warnings"] = tune_with_failures(run_dir)
    ddp_runs = {name: pretrain(parse_args(ddp_argv(name, run_dir))) for name in DDP_RUNS}
    results["ddp"] = {name: summary["losses"] for name, summary in ddp_runs.items()}
    results["ddp_grad_norms"] = {name: summary["grad_norms"] for name, summary in ddp_runs.items()}
    results["fsdp_parm"] = {name: fsdp_parm_run(flags) for name, flags in FSDP_PARM.items()}
    results["recompute"] = recompute_runs()
    results["mock"] = pretrain(parse_args(TINY_GPT + LAYOUT + SHORT + DDP_ITERS + MOCK))["losses"]
    results["logging"] = logging_run(run_dir)
    results["run_control"] = run_control_runs()
    bert_dispatcher = "parm" if "parm" in dispatchers_to_compare() else "parm_s2"
    args = parse_args(TINY_BERT + LAYOUT + SHORT + [
        "--moe-token-dispatcher-type", bert_dispatcher, "--save", f"{run_dir}/checkpoints",
        "--tensorboard-dir", f"{run_dir}/tensorboard"], model_type="bert")
    summary = pretrain(args)
    results["bert"] = {"losses": summary["losses"], "checkpoint": summary["checkpoint"],
                       "eval": summary["eval"]}
    if torch.distributed.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    torch.distributed.barrier()


# Each of Megatron-LM's data-parallel flags (several gradient buckets of the tiny model; the
# distributed optimizer; both overlaps, with an evaluation between steps), and the timing
# breakdown, on 4 iterations of the 20-iteration runs' schedule: name -> flags(run_dir).
DDP_ITERS = ["--train-iters", "4", "--lr-decay-iters", str(NUM_ITERS), "--log-interval", "2"]
# The same schedule counted in samples (8 per iteration; the config's warmup of 4 iterations).
DDP_SAMPLES = ["--train-samples", "32", "--lr-decay-samples", str(NUM_ITERS * 8),
               "--lr-warmup-samples", "32", "--log-interval", "2"]
DDP_RUNS = {
    "overlap_grad_reduce": lambda d: ["--overlap-grad-reduce", "--ddp-bucket-size", "20000",
                                      "--parm-timing-file", f"{d}/timing_alltoall.jsonl"],
    # with the schedule in samples (DDP_SAMPLES), Megatron-LM's data flags that change no
    # sample (2 DataLoader worker processes per rank, its default: the tiny configs set 0; no
    # attention mask in the batch, the model's causal mask; file reads instead of mmap) and
    # Megatron-Core's level-1 timers (the distributed optimizer's params-all-gather)
    "distributed_optimizer": lambda d: ["--use-distributed-optimizer", "--num-workers", "2",
                                        "--no-create-attention-mask-in-dataloader",
                                        "--no-mmap-bin-files", "--timing-log-level", "1",
                                        "--timing-log-option", "max",
                                        "--no-barrier-with-level-1-timing"],
    "overlap_param_gather": lambda d: ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                       "--overlap-param-gather", "--ddp-bucket-size", "20000",
                                       "--eval-interval", "2"],
    "timing_parm_s2": lambda d: ["--moe-token-dispatcher-type", "parm_s2",
                                 "--parm-timing-file", f"{d}/timing_parm_s2.jsonl"],
    # parm tuning (another schedule in each step) under --overlap-grad-reduce, through its
    # decision: Megatron-Core's hook counts are learnt again in those steps
    # (ddp.GradReadyCounts; without it, the second step asserts "Communication call has not
    # been issued")
    "overlap_grad_reduce_parm": lambda d: TUNE + ["--overlap-grad-reduce", "--ddp-bucket-size",
                                                  "20000", "--log-interval", "2"],
    # S2 alone: its experts' hooks fire once per chunk that routed them tokens, a count that
    # changes with the routing (without GradReadyCounts: an assertion in the third step)
    "overlap_grad_reduce_parm_s2": lambda d: ["--moe-token-dispatcher-type", "parm_s2",
                                              "--overlap-grad-reduce", "--ddp-bucket-size",
                                              "20000"],
    # Megatron-FSDP sharding parameters, gradients and optimizer state (ZeRO-3), as Megatron-LM's
    # functional test gpt3_mcore_te_tp2_zp_z3_* runs it (tp2, ep2): expert DP is 1 here, whose
    # gradient buffers Megatron-FSDP 0.16.1 doubled (mcore_compat's megatron_fsdp_one_rank_grads)
    "megatron_fsdp": lambda d: MEGATRON_FSDP,
}
MEGATRON_FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                 "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"]
# Parm's pipelined schedule (parm_s2: the experts' backward in chunks; parm's tuning would pick
# schedules by their timings, another in each run) with Megatron-FSDP and with Megatron's DDP:
# grouped-GEMM experts, whose weight gradients come once per backward (with SequentialMLP a
# pipelined schedule is refused under ZeRO-2 / ZeRO-3: arguments._validate_fsdp)
FSDP_PARM = {name: ["--moe-token-dispatcher-type", "parm_s2", "--moe-grouped-gemm"] + flags
             for name, flags in (("ddp", ["--use-distributed-optimizer"]),
                                 ("megatron_fsdp", MEGATRON_FSDP))}


def fsdp_parm_run(flags: list) -> dict:
    """One FSDP_PARM run on DDP_ITERS: its losses and gradient norms."""
    from megatron_parm.training.arguments import parse_args
    from megatron_parm.training.trainer import pretrain

    summary = pretrain(parse_args(TINY_GPT + LAYOUT + SHORT + DDP_ITERS + flags))
    return {"losses": summary["losses"], "grad_norms": summary["grad_norms"]}


def ddp_argv(name: str, run_dir: str) -> list:
    """A DDP run's flags: DDP_ITERS' schedule, or for distributed_optimizer DDP_SAMPLES' (SHORT's
    --train-iters left out)."""
    if name != "distributed_optimizer":
        return TINY_GPT + LAYOUT + SHORT + DDP_ITERS + DDP_RUNS[name](run_dir)
    short = SHORT[2:] if SHORT[:1] == ["--train-iters"] else SHORT
    return TINY_GPT + LAYOUT + short + DDP_SAMPLES + DDP_RUNS[name](run_dir)


# Megatron-Core's mock GPT dataset with Megatron-LM's NullTokenizer (no files), a vocabulary
# padded to multiples of 64 x TP, in a random order each epoch.
MOCK = ["--mock-data", "--data-path", "", "--tokenizer-type", "NullTokenizer", "--tokenizer-model",
        "", "--vocab-size", "1100", "--make-vocab-size-divisible-by", "64", "--dataloader-type",
        "cyclic"]


# Megatron-LM's activation-recompute flags, each dispatcher under full recompute and the
# pipelined ones under selective recompute of the MoE layer (with attention and layernorms),
# on DDP_ITERS: name -> (dispatcher, flags).
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1"]
SELECTIVE = ["--recompute-granularity", "selective", "--recompute-modules", "moe", "core_attn",
             "layernorm"]


def recompute_cases():
    cases = {f"full_{name}": (name, FULL) for name in dispatchers_to_compare()}
    cases.update({f"selective_{name}": (name, SELECTIVE) for name in ("parm_s2", "parm")})
    return cases


def recompute_runs():
    """Each recompute case's losses and how many times its MoE layers routed (their router's
    forward), against the same count without recompute (the recomputed forward routes again)."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_parm.training.arguments import parse_args
    from megatron_parm.training.trainer import pretrain

    calls = [0]
    forward = TopKRouter.forward

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return forward(self, *args, **kwargs)

    base = TINY_GPT + LAYOUT + SHORT + DDP_ITERS + ["--eval-interval", "100"]
    TopKRouter.forward = counted
    try:
        out = {}
        for name, (dispatcher, flags) in {"none": ("alltoall", []), **recompute_cases()}.items():
            calls[0] = 0
            losses = pretrain(parse_args(base + ["--moe-token-dispatcher-type", dispatcher]
                                         + flags))["losses"]
            out[name] = {"losses": losses, "forwards": calls[0]}
        return out
    finally:
        TopKRouter.forward = forward


# Megatron-LM's logging flags on a short GPT run whose output layer is untied: the word
# embedding's rows of the tokens a batch lacks get zero gradients, which the zeros count sees.
LOGGING_ITERS = 4
LOGGING = ["--untie-embeddings-and-output-weights", "--train-iters", str(LOGGING_ITERS),
           "--lr-decay-iters", str(NUM_ITERS), "--log-interval", "2", "--eval-interval", str(LOGGING_ITERS),
           "--tensorboard-log-interval", "2", "--log-params-norm", "--log-num-zeros-in-grad",
           "--log-throughput", "--log-timers-to-tensorboard", "--log-memory-to-tensorboard",
           "--log-memory-interval", "2", "--log-device-memory-used",
           "--log-validation-ppl-to-tensorboard", "--log-world-size-to-tensorboard",
           "--timing-log-level", "2", "--moe-per-layer-logging", "--log-progress"]


def logging_run(run_dir: str) -> list:
    """The LOGGING run (TensorBoard in RUN_DIR/logging/tensorboard, its checkpoint and
    progress.txt in RUN_DIR/logging/checkpoints, W&B asked for), then its last step's gradients
    (the main grads Megatron-Core's optimizer counted the zeros of) saved as a checkpoint in
    place of the weights, RUN_DIR/logging/grads. Returns its losses."""
    from megatron_parm.checkpointing import save_checkpoint
    from megatron_parm.training import trainer
    from megatron_parm.training.arguments import parse_args

    out = f"{run_dir}/logging"
    args = parse_args(TINY_GPT + LAYOUT + SHORT + LOGGING + [
        "--moe-token-dispatcher-type", "parm_s1", "--tensorboard-dir", f"{out}/tensorboard",
        "--save", f"{out}/checkpoints", "--wandb-project", "parm",
        "--wandb-save-dir", f"{out}/wandb"])
    built, build = [], trainer.build_model_and_optimizer

    def keep(*a, **k):
        built.append(build(*a, **k))
        return built[-1]
    trainer.build_model_and_optimizer = keep
    try:
        losses = trainer.pretrain(args)["losses"]
    finally:
        trainer.build_model_and_optimizer = build
    model = built[0][0]
    for chunk in model:
        for param in chunk.parameters():
            param.data = param.main_grad.view_as(param)
    save_checkpoint(f"{out}/grads", LOGGING_ITERS, model, None, None, 0, args)
    return losses


# Megatron-LM's run-control flags on DDP_ITERS (dp = 2): none changes the losses.
RUN_CONTROL = ["--manual-gc", "--manual-gc-interval", "2", "--deterministic-mode",
               "--check-weight-hash-across-dp-replicas-interval", "2",
               "--distributed-timeout-seconds-after-init", "300", "--exit-duration-in-mins", "1"]


def run_control_runs():
    """Per rank, from a DDP_ITERS run with RUN_CONTROL where rank 1's clock alone jumps past
    --exit-duration-in-mins after iteration 3: (iteration, exit reason, losses, run_control's
    gc.collect generations, every group's timeout); then, per rank, the error of a run whose
    rank 0 changed a parameter before the weight-hash check."""
    import datetime
    import gc
    import time

    import torch
    from torch.distributed import distributed_c10d

    from megatron_parm.training import run_control, trainer
    from megatron_parm.training.arguments import parse_args

    rank = torch.distributed.get_rank()
    collections = []

    class Clock:  # time.time() is called once per iteration (no evaluation before the 4th)
        calls = 0

        def time(self):
            self.calls += 1
            return time.time() + (120 if rank == 1 and self.calls >= 3 else 0)

    class CountedGC:
        def collect(self, generation=2):
            collections.append(generation)
            return gc.collect(generation)

        def __getattr__(self, name):
            return getattr(gc, name)

    flags = TINY_GPT + LAYOUT + SHORT + DDP_ITERS
    run_control.time, run_control.gc = Clock(), CountedGC()
    try:
        summary = trainer.pretrain(parse_args(flags + RUN_CONTROL))
    finally:
        run_control.time, run_control.gc = time, gc
    timeouts = sorted({group._get_backend(torch.device("cpu")).options._timeout
                       / datetime.timedelta(seconds=1)
                       for group in distributed_c10d._world.pg_map})
    record = {"iteration": summary["iteration"], "reason": summary.get("exit_reason"),
              "losses": summary["losses"], "collections": collections, "timeouts": timeouts}

    build = trainer.build_model_and_optimizer

    def changed_on_rank_0(*args, **kwargs):
        model, optimizer, scheduler = build(*args, **kwargs)
        if rank == 0:
            with torch.no_grad():
                next(model[0].parameters()).add_(1e-3)
        return model, optimizer, scheduler

    trainer.build_model_and_optimizer = changed_on_rank_0
    try:
        trainer.pretrain(parse_args(flags + ["--check-weight-hash-across-dp-replicas-interval",
                                             "1"]))
        record["mismatch"] = None
    except ValueError as error:
        record["mismatch"] = str(error)
    finally:
        trainer.build_model_and_optimizer = build
    records = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(records, record)
    return records


# Tuning at 1 timed call per candidate: the tiny layer's 4 best-predicted candidates
# (allgather, S1, parm_hier, S2 at 2 chunks; the default shortlist of 5 would not decide
# within the run) x 2 calls, decided at the 9th iteration.
TUNE = ["--moe-token-dispatcher-type", "parm", "--parm-tune-steps", "1", "--parm-tune-candidates",
        "4", "--train-iters", "10", "--lr-decay-iters", str(NUM_ITERS)]  # the 20-iteration runs' lrs


def tune_with_failures(run_dir: str):
    """parm tuning where S2 at 2 forward chunks runs out of memory (in its pipeline: that call
    finishes in one chunk), allgather too (in Megatron's gather: that call starts again with
    the next candidate) and parm_hier refuses its input (in its first phase), so that S1 wins
    whatever the timings; then a 2-iteration run that finds the result in the cache. Returns
    the first run's losses and the distinct warnings rank 0 saw."""
    import warnings

    import torch

    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from megatron_parm.dispatchers.parm_hier import ParmHierTokenDispatcher
    from megatron_parm.dispatchers.parm_s2 import ParmS2TokenDispatcher
    from megatron_parm.training.arguments import parse_args
    from megatron_parm.training.trainer import pretrain

    pipeline, preprocess, gather = (ParmS2TokenDispatcher.dispatch_compute_combine,
                                    ParmHierTokenDispatcher.dispatch_preprocess,
                                    MoEAllGatherTokenDispatcher.token_dispatch)

    def out_of_memory(self, *args):
        if self.num_chunks == 2:
            raise torch.OutOfMemoryError("injected: out of memory at 2 chunks")
        return pipeline(self, *args)

    def refused(self, *args):
        raise ValueError("injected: parm_hier refuses this input")

    def gather_out_of_memory(self, *args):
        raise torch.OutOfMemoryError("injected: out of memory gathering the group's tokens")

    flags = TINY_GPT + LAYOUT + SHORT + TUNE + ["--parm-tune-cache", f"{run_dir}/tune.json"]
    ParmS2TokenDispatcher.dispatch_compute_combine = out_of_memory
    ParmHierTokenDispatcher.dispatch_preprocess = refused
    MoEAllGatherTokenDispatcher.token_dispatch = gather_out_of_memory
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            losses = pretrain(parse_args(flags))["losses"]
    finally:
        ParmS2TokenDispatcher.dispatch_compute_combine = pipeline
        ParmHierTokenDispatcher.dispatch_preprocess = preprocess
        MoEAllGatherTokenDispatcher.token_dispatch = gather
    pretrain(parse_args(flags + ["--train-iters", "2"]))
    return losses, sorted({str(w.message) for w in seen if "tuning" in str(w.message)})


@pytest.fixture(scope="module")
def run(tmp_path_factory, prepared_data):
    from launch import run_worker_module

    run_dir = tmp_path_factory.mktemp("pretrain")
    return (*run_worker_module(__file__, 4, run_dir, timeout=1200), run_dir)


def test_gpt_loss_falls(run):
    results, _, _ = run
    losses = results["gpt"]["alltoall"]
    assert len(losses) == NUM_ITERS
    assert losses[-1] < losses[0] - 0.5, losses


def test_dispatchers_agree_over_20_iterations(run):
    results, _, _ = run
    reference = results["gpt"]["alltoall"]
    for name, losses in results["gpt"].items():
        worst = max(abs(a - b) for a, b in zip(losses, reference))
        assert len(losses) == NUM_ITERS and worst <= 1e-4, (name, worst, losses, reference)


def test_parm_tuning_changes_no_loss(run):
    """Tuned (the loop's parm, no --parm-profile), untuned, and with failing candidates: the
    same losses, to the dispatchers' tolerance."""
    results, _, _ = run
    tuned, untuned = results["gpt"]["parm"], results["parm_no_tune"]
    assert len(untuned) == NUM_ITERS
    assert max(abs(a - b) for a, b in zip(tuned, untuned)) <= 1e-4, (tuned, untuned)
    failing = results["tune_fail"]
    assert len(failing) == 10
    assert max(abs(a - b) for a, b in zip(failing, untuned)) <= 1e-4, (failing, untuned)


def test_parm_tuning_skips_failures_and_logs_once_then_caches(run):
    results, stdout, run_dir = run
    assert results["tune_fail_warnings"] == [
        "parm: candidate allgather failed while tuning and is skipped (OutOfMemoryError: "
        "injected: out of memory gathering the group's tokens)",
        "parm: candidate parm_hier failed while tuning and is skipped (ValueError: injected: "
        "parm_hier refuses this input)",
        "parm: candidate parm_s2(c=2) failed while tuning and is skipped (OutOfMemoryError: "
        "injected: out of memory at 2 chunks)"], results["tune_fail_warnings"]
    cache = run_dir / "tune.json"
    measured = re.findall(r"^> MoE layer (\d): parm chose parm_s1 \(measured, median of 1 "
                          r"calls.*runners-up .*parm_s2\(c=2\) failed.*; kept in "
                          + re.escape(str(cache)) + "$", stdout, re.M)
    choices = "\n".join(line for line in stdout.splitlines() if "parm chose" in line)
    assert measured == ["1", "2"], choices
    cached = re.findall(r"^> MoE layer (\d): parm chose parm_s1 \(cached in "
                        + re.escape(str(cache)), stdout, re.M)
    assert cached == ["1", "2"], choices
    assert stdout.count("> schedules: c=F/B: F pipeline chunks forward") >= 1
    assert json.loads(cache.read_text())["entries"][0]["winner"] == "parm_s1"


def test_bert_loss_falls_and_checkpoint_saved(run):
    results, _, run_dir = run
    losses = results["bert"]["losses"]
    assert losses[-1] < losses[0] - 0.3, losses
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(NUM_ITERS)
    assert (ckpt / f"iter_{NUM_ITERS:07d}" / "metadata.json").is_file()
    assert results["bert"]["checkpoint"] == str(ckpt / f"iter_{NUM_ITERS:07d}")


def test_data_parallel_flags_and_timing_leave_the_losses(run):
    results, _, _ = run
    for name, losses in results["ddp"].items():
        dispatcher = next((d for d in ("parm_s2", "parm") if name.endswith(d)), "alltoall")
        # parm: the candidates it ran differ from the 20-iteration run's (1 timed call each
        # here), so the dispatchers' tolerance
        tolerance = 1e-4 if dispatcher == "parm" else 1e-5
        reference = results["gpt"][dispatcher]
        assert losses == pytest.approx(reference[:len(losses)], abs=tolerance), name
    assert len(results["ddp"]["overlap_grad_reduce_parm"]) == 10  # past parm's decision
    # --train-samples 32 at global batch 8: the iteration-based run's 4 iterations (and, by
    # the losses above, its learning rates)
    assert len(results["ddp"]["distributed_optimizer"]) == 4


def test_megatron_fsdp_trains_as_ddp(run):
    """Megatron-FSDP (ZeRO-3) with alltoall and with parm_s2: the losses of Megatron's DDP with
    the distributed optimizer to 1e-5, its gradient norms to 1e-4 (the shards' sums in another
    order: 3e-6 apart at 2 ranks; Megatron-FSDP 0.16.1's doubled gradients were 30% off)."""
    results, _, _ = run
    norms = results["ddp_grad_norms"]
    assert norms["megatron_fsdp"] == pytest.approx(norms["distributed_optimizer"], rel=1e-4)
    ddp, fsdp = results["fsdp_parm"]["ddp"], results["fsdp_parm"]["megatron_fsdp"]
    assert len(fsdp["losses"]) == 4
    assert fsdp["losses"] == pytest.approx(ddp["losses"], abs=1e-5)
    assert fsdp["grad_norms"] == pytest.approx(ddp["grad_norms"], rel=1e-4)


def test_mock_data_with_null_tokenizer_trains(run):
    """--mock-data, --tokenizer-type NullTokenizer --vocab-size 1100 (ids 0..1099, the end of
    a document 1100), --make-vocab-size-divisible-by 64 at TP 2: 1101 padded to 1152 (the
    default 128 would give 1280)."""
    results, stdout, _ = run
    losses = results["mock"]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert "; vocabulary 1101 padded to 1152;" in stdout


def test_activation_recompute_leaves_the_losses(run):
    """--recompute-granularity full (every dispatcher) and selective with the MoE layer
    (parm_s2 pipelined, parm): each step routes once more per layer, and the losses are
    those without recompute (1e-6, fp32; parm within the dispatchers' tolerance, as it tunes)."""
    results, _, _ = run
    runs = results["recompute"]
    assert set(runs) == {"none", *recompute_cases()}
    # each training step routes again once per layer and micro-batch (the evaluation at the
    # end runs without gradients: not recomputed)
    recomputed = 4 * 2 * 1  # DDP_ITERS' iterations x the tiny config's layers x micro-batches
    for name, (dispatcher, _) in recompute_cases().items():
        extra = runs[name]["forwards"] - runs["none"]["forwards"]
        assert extra == recomputed, (name, runs[name], runs["none"])
        tolerance = 1e-4 if dispatcher == "parm" else 1e-6
        reference = results["gpt"][dispatcher][:len(runs[name]["losses"])]
        assert runs[name]["losses"] == pytest.approx(reference, abs=tolerance), name


def test_run_control_on_every_rank(run):
    """Megatron-LM's run-control flags on 4 ranks: one rank past --exit-duration-in-mins stops
    them all after the same iteration (saved state aside, the losses those without the flags:
    deterministic kernels round alike to 1e-5); --manual-gc collects at the start and after
    iterations 2 on every rank; the group timeouts are 300 s after the first iteration; the
    weight hashes match, and a parameter changed on rank 0 alone stops every rank."""
    results, stdout, _ = run
    records = results["run_control"]
    reference = results["gpt"]["alltoall"]
    for rank, record in enumerate(records):
        assert (record["iteration"], record["reason"]) == (3, "exit-duration-in-mins"), rank
        assert record["losses"] == pytest.approx(reference[:3], abs=1e-5), rank
        assert record["collections"] == [2, 2], (rank, record["collections"])
        assert record["timeouts"] == [300.0], (rank, record["timeouts"])
        assert record["mismatch"].startswith("--check-weight-hash-across-dp-replicas-interval: "
                                             "after iteration 0 parameters differ across "
                                             "data-parallel replicas: "), (rank, record)
    # rank 0 and its data-parallel peer (rank 2) name the parameter, the others do not
    assert [record["mismatch"].endswith(f"module.embedding.word_embeddings.weight on rank "
                                        f"{rank}") for rank, record in enumerate(records)] == \
        [True, False, True, False]
    assert stdout.count(">>> Weight hashes match after 2 iterations...") == 1
    assert "(--exit-duration-in-mins 1): stopping after iteration 3" in stdout


def test_timing_breakdown_has_each_part(run):
    _, stdout, run_dir = run
    assert stdout.count(" time breakdown (ms/iteration, mean over ranks): ") == 4
    for dispatcher in ("alltoall", "parm_s2"):
        records = [json.loads(line) for line in
                   (run_dir / f"timing_{dispatcher}.jsonl").read_text().splitlines()]
        assert [r["iteration"] for r in records] == [2, 4]
        for r in records:
            ms = r["ms"]
            assert r["dispatcher"] == dispatcher and r["iterations"] == 2
            assert r["step_ms"] == pytest.approx(sum(ms.values()))
            assert r["step_ms"] <= r["slowest_rank_step_ms"] + 1e-6
            assert 0 <= r["host_cpu_busy"] <= 1  # Linux: /proc/stat
            assert r["net_tx_bytes"]["loopback"] > 0  # gloo on this machine
            # tp=2 with SP: TP/SP collectives; dp=2: a gradient reduction; every part timed
            for part in ("moe_experts", "attention_dense", "tp_sp", "dp_grad_reduce",
                         "optimizer", "rest"):
                assert ms[part] > 0, (dispatcher, part, ms)
            if dispatcher == "parm_s2":  # pipelined: dispatch and combine interleave
                assert ms["moe_dispatch_combine"] > 0 and ms["moe_dispatch"] == 0
            else:
                assert ms["moe_dispatch"] > 0 and ms["moe_combine"] > 0
                assert ms["moe_dispatch_combine"] == 0


def tensorboard_scalars(log_dir) -> dict:
    """{tag: {step: value}} of every scalar TensorBoard wrote under LOG_DIR."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def model_tensors(path) -> dict:
    """The model's tensors of a checkpoint, whole (every shard of tp=2, ep=2 once)."""
    from megatron_parm.checkpointing.full import read_full

    return {key: tensor for key, tensor in read_full(str(path)).tensors.items()
            if not key.startswith("optimizer")}


def test_params_norm_and_zeros_count_each_shard_once(run):
    """The last iteration's params norm is the norm of the weights saved after it, and its
    zeros count the zeros of its gradients saved in their place (the untied word embedding's
    rows of the tokens the batch lacks): Megatron-LM's sums over tp=2, ep=2 without
    duplicates, on the line and in TensorBoard."""
    _, stdout, run_dir = run
    weights = model_tensors(run_dir / "logging/checkpoints" / f"iter_{LOGGING_ITERS:07d}")
    grads = model_tensors(run_dir / "logging/grads" / f"iter_{LOGGING_ITERS:07d}")
    assert weights.keys() == grads.keys() and "output_layer.weight" in weights
    norm = sum(float((t.double() ** 2).sum()) for t in weights.values()) ** 0.5
    zeros = sum(int((t == 0).sum()) for t in grads.values())
    assert zeros > 0
    written = tensorboard_scalars(run_dir / "logging/tensorboard")
    assert written["params-norm"][LOGGING_ITERS] == pytest.approx(norm, rel=1e-6)
    assert written["num-zeros"][LOGGING_ITERS] == zeros
    line = re.search(rf"^ iteration +{LOGGING_ITERS}/ +{LOGGING_ITERS} \|.* num zeros: .*$",
                     stdout, re.M)[0]  # the logging run's last line
    assert f" num zeros: {float(zeros)} | params norm: {norm:.3f} |" in line


def test_logging_flags_write_megatron_lm_s_tensorboard_tags(run):
    results, _, run_dir = run
    written = tensorboard_scalars(run_dir / "logging/tensorboard")
    losses = results["logging"]
    # every --tensorboard-log-interval (2): the iteration's own values, also vs samples
    assert written["lm loss"] == {2: pytest.approx(losses[1]), 4: pytest.approx(losses[3])}
    assert written["lm loss vs samples"] == {16: pytest.approx(losses[1]),
                                             32: pytest.approx(losses[3])}
    assert written["world-size"] == {2: 4, 4: 4} and written["batch-size"] == {2: 8, 4: 8}
    assert set(written["loss-scale"]) == set(written["grad-norm"]) == {2, 4}
    assert set(written["mem-resident-bytes"]) == {2, 4}  # CPU: the process's resident memory
    for step in (2, 4):  # the router loss: the mean of its layers (both MoE)
        layers = [written[f"moe/load_balancing_loss_layer_{i}"][step] for i in (0, 1)]
        assert written["load_balancing_loss"][step] == pytest.approx(sum(layers) / 2)
    # every --log-interval: the iteration time, the throughput, the timers (slowest rank)
    from megatron_parm.training import timers

    for step in (2, 4):
        seconds = written["iteration-time"][step]
        assert written["forward-backward-time"][step] < seconds
        assert written["throughput"][step] > 0
    logged = {tag[:-len("-time")] for tag in written if tag.endswith("-time")} - {"iteration"}
    assert {"forward-backward", "all-grads-sync", "optimizer", "optimizer-inner-step",
            "batch-generator", "forward-compute", "backward-compute"} <= logged
    assert logged <= set(timers.timer_names(2))
    validation = written["lm loss validation"][LOGGING_ITERS]
    assert written["lm loss validation ppl"] == {LOGGING_ITERS: pytest.approx(math.exp(validation))}
    # the BERT run: Megatron-LM's tags for its losses
    bert = tensorboard_scalars(run_dir / "tensorboard")
    assert {"lm loss", "sop loss", "learning-rate", "loss-scale", "grad-norm",
            "lm loss validation"} <= set(bert)
    assert "world-size" not in bert and "params-norm" not in bert


def timer_blocks(stdout: str, option: str) -> list:
    """The timer names of each block Megatron-Core's Timers printed with --timing-log-option
    OPTION's heading ('(min, max)' or 'max')."""
    blocks = stdout.split(f"\n{option} time across ranks (ms):\n")[1:]
    pattern = r"    ([a-z-]+) \.+: (\([\d.]+, [\d.]+\)|[\d.]+)"
    return [[re.fullmatch(pattern, line)[1]
             for line in itertools.takewhile(lambda line: line.startswith("    "),
                                             block.split("\n"))] for block in blocks]


def test_logging_flags_console_timers_memory_progress_and_wandb(run):
    from megatron_parm.training import timers

    _, stdout, run_dir = run
    lines = re.findall(r"^ iteration +(\d+)/ +4 \|.* throughput per GPU \(TFLOP/s/GPU\): "
                       r"[\d.]+ \|.* num zeros: \d+\.0 \| params norm: [\d.]+ \|", stdout, re.M)
    assert lines == ["2", "4"]
    # --timing-log-level 2, minmax (the logging run), 1, max (the distributed-optimizer run):
    # a block after each line, the timers of the level that ran
    minmax, slowest = timer_blocks(stdout, "(min, max)"), timer_blocks(stdout, "max")
    assert len(minmax) == len(slowest) == 2
    for names in minmax:
        assert {"forward-backward", "optimizer", "batch-generator", "forward-compute",
                "backward-compute"} <= set(names), names
    for names in slowest:
        assert {"forward-backward", "optimizer", "params-all-gather"} <= set(names), names
        assert not set(names) & set(timers.TIMER_NAMES[2]), names
    # --log-memory-interval 2: the ranks of data-parallel rank 0 (tp ranks 0 and 1)
    memory = re.findall(r"^\[Rank (\d)\] \(after (\d) iterations\) memory \(MB\) \| resident: "
                        r"[\d.]+ \| max resident: [\d.]+ \| total host memory used: [\d.]+$",
                        stdout, re.M)
    assert sorted(memory) == [("0", "2"), ("0", "4"), ("1", "2"), ("1", "4")]
    # --log-progress: Megatron-LM's progress.txt
    from megatron_parm.training import flops
    from megatron_parm.training.arguments import parse_args

    progress = (run_dir / "logging/checkpoints/progress.txt").read_text().splitlines()
    assert [line.split("\t")[2:4] for line in progress] == [["# GPUs: 4", "Starting job"],
                                                              ["# GPUs: 4", "Saved checkpoint"]]
    args = parse_args(["--config", str(REPO / TINY_GPT[1])] + LAYOUT + SHORT + LOGGING,
                      world_size=4, reads_data=False)
    samples = LOGGING_ITERS * 8
    fields = progress[1].split("\t")[4:]
    assert fields[0] == f"Iteration: {LOGGING_ITERS}"
    assert re.fullmatch(r"Job throughput: [\d.]+ TFLOP/s/GPU", fields[1])
    assert re.fullmatch(r"Cumulative throughput: [\d.]+ TFLOP/s/GPU", fields[2])
    assert fields[3] == (f"Floating-point operations: "
                         f"{samples * flops.num_floating_point_operations(args, 1, 8192):.2e}")
    assert fields[4] == "Tokens (in billions): 0.00"
    # W&B asked for without its package: one line, and the run went on
    assert stdout.count("> W&B: the 'wandb' package is not installed") == 1


def test_console_lines_in_megatron_format(run):
    _, stdout, run_dir = run
    line = re.compile(r"^ iteration +\d+/ +\d+ \| consumed samples: +\d+ \| elapsed time per "
                      r"iteration \(ms\): [\d.]+ \| learning rate: \d\.\d{6}E[+-]\d\d \| global "
                      r"batch size: +\d+ \| lm loss: \d\.\d{6}E[+-]\d\d \|.* load balancing "
                      r"loss: .* tokens per second: [\d.]+ \|$", re.M)
    assert len(line.findall(stdout)) >= 2 * (len(dispatchers_to_compare()) + 1), stdout[-3000:]
    assert "validation loss at iteration 20 | lm loss value:" in stdout
    assert "expert load, layer  1:" in stdout
    assert f"> checkpoint: {run_dir}/checkpoints/iter_0000020" in stdout
    assert "TensorBoard" in stdout


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "worker":
        sys.exit("usage: torchrun --nproc-per-node 4 tests/e2e/test_pretrain.py worker OUT.json RUN_DIR")
    worker(sys.argv[2], sys.argv[3])
