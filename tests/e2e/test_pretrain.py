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
  * GPT-2 MoE for 4 iterations with activation recompute, full and selective (recompute_runs);
  * GPT-2 MoE for 4 iterations on Megatron-Core's mock data with the NullTokenizer (MOCK);
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
  * each data-parallel flag, the timing breakdown, activation recompute and the data flags
    that change no sample (2 DataLoader workers per rank, no attention mask in the batch, no
    mmap) leave the losses as they are, and the breakdown has the parts each run must have;
  * mock data trains, its vocabulary padded as --make-vocab-size-divisible-by says;
  * every rank stops at the same iteration when one alone finds the duration passed, collects
    garbage at the same points, and refuses parameters that differ across data-parallel
    replicas.
"""

from __future__ import annotations

import json
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
    results["ddp"] = {name: pretrain(parse_args(ddp_argv(name, run_dir)))["losses"]
                      for name in DDP_RUNS}
    results["recompute"] = recompute_runs()
    results["mock"] = pretrain(parse_args(TINY_GPT + LAYOUT + SHORT + DDP_ITERS + MOCK))["losses"]
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
    # with the schedule in samples (DDP_SAMPLES), and with Megatron-LM's data flags that change
    # no sample: 2 DataLoader worker processes per rank (its default; the tiny configs set 0), no
    # attention mask in the batch (the model's causal mask), file reads instead of mmap
    "distributed_optimizer": lambda d: ["--use-distributed-optimizer", "--num-workers", "2",
                                        "--no-create-attention-mask-in-dataloader",
                                        "--no-mmap-bin-files"],
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
}


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


# Tuning at 1 timed call per candidate: the tiny layer's 4 candidates x 2 calls, decided at
# the 9th iteration.
TUNE = ["--moe-token-dispatcher-type", "parm", "--parm-tune-steps", "1", "--train-iters", "10",
        "--lr-decay-iters", str(NUM_ITERS)]  # the 20-iteration runs' learning rates


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
    assert measured == ["1", "2"], stdout[-4000:]
    cached = re.findall(r"^> MoE layer (\d): parm chose parm_s1 \(cached in "
                        + re.escape(str(cache)), stdout, re.M)
    assert cached == ["1", "2"], stdout[-4000:]
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
