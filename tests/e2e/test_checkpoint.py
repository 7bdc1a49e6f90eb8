"""Checkpoints that survive faults and move between layouts (GPT-2 MoE tiny, CPU/gloo).

Three torchrun launches (this file run as a script) and a few converter runs, shared by the
tests through one module fixture:
  crash (4 ranks)  trains with --save-interval 2 and a global non-persistent save every 3; rank 1
                   SIGKILLs itself at iteration 4, after writing its shards and before the
                   checkpoint is published.
  main  (4 ranks)  (2,2,2): 10 iterations uninterrupted (saved at 5 and 10); the same run stopped
                   at 5 by --exit-interval in Megatron-LM's per-rank files (--ckpt-format torch)
                   and resumed, saving without the fully parallel save; the crashed run resumed
                   (from its newer non-persistent save, with the fully parallel load, a save
                   every 2 kept every 4 and the cached structure); the iteration-10 checkpoint
                   evaluated at (2,2,2), (1,4,1), (4,1,4), (2,2,1) with other dispatchers (one
                   through --auto-detect-ckpt-format); what a load takes (--no-load-optim with
                   --ckpt-step, --no-load-rng, --pretrained-checkpoint) and a save writes
                   (--no-save-optim, --no-save-rng); the error cases; a dense model trained and
                   evaluated.
  converters       to another layout (1,4,1), to one file and back, dense -> MoE upcycling.
  wide  (8 ranks)  (2,4,2) evaluates the checkpoint, its converted copies and the upcycled one.
Dropout is on (0.1), so a bitwise resume needs every rank's RNG states back.

The tests of checkpoints between expert implementations (`-k grouped`) have their own launch,
through megatron_parm.launch as a user starts one:
  grouped (4 ranks)  a run with SequentialMLP experts, resumed with --moe-grouped-gemm
                     (TorchGroupedMLP) in another layout, and that one's checkpoint resumed
                     with SequentialMLP and with TorchGroupedMLP in two more (dropout off, so
                     that the losses of different layouts agree); a checkpoint with an expert
                     tensor of another shape; a checkpoint lacking a tensor and holding another
                     loaded with three --dist-ckpt-strictness values; last, --moe-grouped-gemm
                     with a width the grouped GEMM cannot take, which ends the launch with
                     status 2.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from launch import convert_checkpoint as convert, free_port, pids_with_marker, torchrun  # noqa: E402

BASE = ["--config", "configs/gpt2_tiny_moe.yaml", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "10", "--lr-warmup-iters", "1",
        "--log-interval", "5", "--eval-interval", "1000", "--eval-iters", "2",
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
EVAL_LAYOUTS = [((2, 2, 2), "alltoall"), ((1, 4, 1), "parm"), ((4, 1, 4), "ds_baseline"),
                ((2, 2, 1), "parm_s1")]
# The first evaluation loads the torch_dist checkpoint with --ckpt-format torch.
AUTO_DETECT = ["--ckpt-format", "torch", "--auto-detect-ckpt-format"]
NON_PERSISTENT = ["--non-persistent-ckpt-type", "global", "--non-persistent-save-interval", "3"]
# The crashed run resumed: saves at 4, 6, 8, 10 (every 4 kept), non-persistent at 9.
AFTER_CRASH = [*NON_PERSISTENT, "--save-interval", "2", "--save-retain-interval", "4",
               "--ckpt-assume-constant-structure", "--ckpt-fully-parallel-load"]


def layout_flags(tp, ep, etp, dispatcher):
    flags = ["--tensor-model-parallel-size", str(tp), "--expert-model-parallel-size", str(ep),
             "--expert-tensor-parallel-size", str(etp), "--moe-token-dispatcher-type", dispatcher]
    return flags + (["--sequence-parallel"] if tp > 1 else [])


def dense_config(out_dir: Path) -> str:
    """The tiny config without experts: the dense model that upcycling starts from."""
    import yaml

    values = yaml.safe_load((REPO / "configs/gpt2_tiny_moe.yaml").read_text())
    for key in list(values):
        if key == "num_experts" or key.startswith("moe_router") or key == "moe_aux_loss_coeff":
            values.pop(key)
    # Every rank writes it: each to its own file, renamed into place, so that no rank reads
    # the file half-written by another.
    path = out_dir / "gpt2_tiny_dense.yaml"
    staged = out_dir / f"gpt2_tiny_dense.yaml.{os.getpid()}"
    staged.write_text(yaml.safe_dump(values))
    os.replace(staged, path)
    return str(path)


def eval_loss(summary):
    return summary["eval"][-1][1]["lm loss"]


GROUPED = ["--moe-grouped-gemm"]
# Runs whose losses are compared with another layout's: a run loaded in another layout (or at
# another data-parallel size) reseeds its generators, so dropout's masks differ.
NO_DROPOUT = ["--hidden-dropout", "0.0", "--attention-dropout", "0.0"]
# Every run of the grouped launch: no dropout, iterations 1-6, a checkpoint every 2.
GROUPED_RUN = [*NO_DROPOUT, "--train-iters", "6", "--save-interval", "2"]
FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
FC2_MOMENT = "optimizer.state.exp_avg_sq.decoder.layers.mlp.experts.experts.linear_fc2.weight"
# Rows of 66 fp32 values: not on the 16-byte boundary PyTorch's grouped GEMM needs.
BAD_WIDTH = ["--moe-ffn-hidden-size", "66"]
# A checkpoint without this tensor and with EXTRA, loaded with each --dist-ckpt-strictness.
FINAL_NORM, EXTRA = "decoder.final_layernorm.weight", "extra.weight"
STRICTNESS = ("assume_ok_unexpected", "raise_all", "log_all")


def grouped_worker(run: Path, train) -> dict:
    """The grouped launch's runs (see the module docstring); returns the results."""
    import torch

    from megatron_parm.checkpointing.full import read_full, write_full

    rank = torch.distributed.get_rank()
    results = {}
    # sequential (2,2,2): iterations 1-6, saved at 2, 4, 6
    results["sequential"] = train(*layout_flags(2, 2, 2, "alltoall"), *GROUPED_RUN,
                                  "--save", f"{run}/sequential")["losses"]
    # its iteration 2 with TorchGroupedMLP (1,4,1), S2's chunks: iterations 3-6, saved at 4, 6
    results["to_grouped"] = train(*layout_flags(1, 4, 1, "parm_s2"), *GROUPED, *GROUPED_RUN,
                                  "--load", f"{run}/sequential/iter_0000002",
                                  "--save", f"{run}/grouped")["losses"]
    # the grouped iteration 4 back with SequentialMLP (4,1,4), and grouped with ETP 2 (2,2,2)
    results["back"] = train(*layout_flags(4, 1, 4, "ds_baseline"), *GROUPED_RUN,
                            "--load", f"{run}/grouped/iter_0000004")["losses"]
    results["grouped_etp"] = train(*layout_flags(2, 2, 2, "parm_s1"), *GROUPED, *GROUPED_RUN,
                                   "--load", f"{run}/grouped/iter_0000004")["losses"]
    if rank == 0:  # a copy with one expert fewer in fc1 and another FFN width in a moment of fc2
        full = read_full(f"{run}/sequential/iter_0000002")
        full.tensors[FC1] = full.tensors[FC1][:, :3].clone()
        full.tensors[FC2_MOMENT] = full.tensors[FC2_MOMENT][..., :128].clone()
        write_full(f"{run}/bad", 2, full)
    torch.distributed.barrier()
    try:
        train(*layout_flags(1, 4, 1, "alltoall"), *GROUPED, *GROUPED_RUN, "--load", f"{run}/bad")
        results["bad_checkpoint"] = None
    except ValueError as err:  # CheckpointError is a ValueError
        results["bad_checkpoint"] = str(err)
    if rank == 0:  # iteration 2 without the final norm's weight (and its moments), with another
        full = read_full(f"{run}/sequential/iter_0000002")
        for key in [key for key in full.tensors if key.endswith(FINAL_NORM)]:
            del full.tensors[key]
        full.tensors[EXTRA] = torch.zeros(3)
        write_full(f"{run}/partial", 2, full)
    torch.distributed.barrier()
    for strictness in STRICTNESS:  # iteration 3 of each
        try:
            results[f"strict {strictness}"] = train(
                *layout_flags(2, 2, 2, "alltoall"), *GROUPED_RUN, "--exit-interval", "3",
                "--load", f"{run}/partial", "--dist-ckpt-strictness", strictness)["losses"]
        except ValueError as err:
            results[f"strict {strictness}"] = str(err)
    return results


# ---------------------------------------------------------------------------------------------
# The distributed optimizer's checkpoints: three launches (4, 2 and 8 ranks), `-k distopt`
# ---------------------------------------------------------------------------------------------

DIST = ["--use-distributed-optimizer"]
FULLY = DIST + ["--dist-ckpt-optim-fully-reshardable"]
# Every run: iterations 1-4, dropout on, a checkpoint every 2.
DIST_RUN = ["--train-iters", "4", "--save-interval", "2", "--eval-iters", "0"]
# Each dispatcher resumes once, at (2,2,2) dp-reshardable or at (1,4,1) fully reshardable;
# the pp=2 runs of the 8-rank launch take parm_s2 and parm to the other layout.
DP_RESHARDABLE, FULLY_RESHARDABLE = ((2, 2, 2), DIST), ((1, 4, 1), FULLY)
DISPATCHERS = {"alltoall": DP_RESHARDABLE, "parm_s1": FULLY_RESHARDABLE,
               "parm_s2": FULLY_RESHARDABLE, "parm_hier": DP_RESHARDABLE, "parm": DP_RESHARDABLE}
MOMENTS = ("optimizer.state.exp_avg.", "optimizer.state.exp_avg_sq.")
# alltoall at (2,2,2) saves Megatron-LM's per-rank files, distrib_optim.pt included
TORCH_FORMAT = ["--ckpt-format", "torch"]


# Context parallelism at (2,2,2) on 4 ranks: tp=2 x cp=2, dp=1 (dropout off: these compare
# losses and weights across layouts), the distributed optimizer sharded over dp x cp.
CP2 = ["--context-parallel-size", "2", "--cp-comm-type", "all_gather"]
CP_RUN = [*DIST, *DIST_RUN, *NO_DROPOUT]
CP_FORMATS = {"torch_dist": [], "torch": TORCH_FORMAT}


def context_parallel_runs(run: Path, train) -> dict:
    """Per checkpoint format, parm at (2,2,2) with cp=2 saved at 2 and 4, resumed from 2 at
    cp=2 and loaded at cp=1 (dp=2); and cp=1 trained from the start (its weights at 4)."""
    results = {}
    layout = [*layout_flags(2, 2, 2, "parm"), *dispatcher_flags("parm")]
    for name, ckpt_format in CP_FORMATS.items():
        saved = f"{run}/cp2 {name}"
        results[f"cp2 {name}"] = train(*layout, *CP2, *CP_RUN, *ckpt_format,
                                       "--save", saved)["losses"]
        results[f"cp2 {name} resumed"] = train(*layout, *CP2, *CP_RUN, *ckpt_format, "--load",
                                               f"{saved}/iter_0000002")["losses"]
        results[f"cp2 {name} at cp1"] = train(*layout, *CP_RUN, *ckpt_format, "--load",
                                              f"{saved}/iter_0000002")["losses"]
    results["cp1"] = train(*layout, *CP_RUN, "--save", f"{run}/cp1")["losses"]
    return results


def dispatcher_flags(dispatcher: str) -> list:
    """parm with its model's choice: a run resumed while parm still tunes tunes again, and its
    candidates' values differ in the last bits (Megatron's allgather sums a token's experts in
    another order than Parm's schedules), so only a made choice resumes bitwise."""
    return {"parm_hier": ["--parm-ranks-per-node", "2"], "parm": ["--no-parm-tune"]}.get(
        dispatcher, [])


def reload_and_save(flags, load: str, save: str) -> None:
    """Build the model and optimizer FLAGS describe, load LOAD into them and save them to SAVE
    at once: the saved optimizer state is what the load put in the optimizer."""
    from megatron_parm.checkpointing import save_checkpoint
    from megatron_parm.data.tokenizers import build_tokenizer
    from megatron_parm.training.arguments import parse_args
    from megatron_parm.training.trainer import (
        build_model_and_optimizer, checkpoint_to_resume, initialize, resume)

    args = parse_args(list(BASE) + list(flags) + DIST_RUN + ["--load", load])
    initialize(args)
    checkpoint, padded_vocab = checkpoint_to_resume(args)
    model, optimizer, scheduler = build_model_and_optimizer(
        args, build_tokenizer(args).vocab_size, padded_vocab)
    iteration, consumed = resume(checkpoint, model, optimizer, scheduler, args)
    save_checkpoint(save, iteration, model, optimizer, scheduler, consumed, args)


def distopt_worker(mode: str, run: Path, train) -> dict:
    """The distributed optimizer's runs (see test_distopt_*); returns the results."""
    results = {}
    if mode == "distopt":  # 4 ranks
        for dispatcher, ((tp, ep, etp), optim) in DISPATCHERS.items():
            flags = [*layout_flags(tp, ep, etp, dispatcher), *dispatcher_flags(dispatcher),
                     *optim, *DIST_RUN, *(TORCH_FORMAT if dispatcher == "alltoall" else [])]
            name = f"{tp},{ep},{etp} {dispatcher}"
            saved = f"{run}/dist {name.replace(' ', '_')}"
            results[f"{name} reference"] = train(*flags, "--save", saved)["losses"]
            results[f"{name} resumed"] = train(*flags, "--load", f"{saved}/iter_0000002",
                                               "--save", f"{saved}-resumed")["losses"]
        # dp=2 (2,1,2), saved dp-reshardable, for the narrow and wide launches; and fully
        # reshardable, resumed at (4,1,4) and at (1,4,1) without the distributed optimizer
        # (without dropout: these compare losses across layouts)
        base = [*layout_flags(2, 1, 2, "alltoall"), *DIST_RUN, *NO_DROPOUT]
        results["dp2"] = train(*base, *DIST, "--save", f"{run}/dp2")["losses"]
        results["fully"] = train(*base, *FULLY, "--save", f"{run}/fully")["losses"]
        results["fully at 4,1,4"] = train(*layout_flags(4, 1, 4, "parm_s2"), *DIST_RUN, *DIST,
                                          *NO_DROPOUT, "--load",
                                          f"{run}/fully/iter_0000002")["losses"]
        results["fully plain 1,4,1"] = train(*layout_flags(1, 4, 1, "parm"), *DIST_RUN,
                                             *NO_DROPOUT, "--load",
                                             f"{run}/fully/iter_0000002")["losses"]
        # the moments through each pair: distributed -> plain -> distributed (both formats)
        reload_and_save(layout_flags(1, 4, 1, "alltoall"), f"{run}/fully/iter_0000002",
                        f"{run}/as_plain")
        reload_and_save([*layout_flags(2, 2, 2, "alltoall"), *DIST], f"{run}/as_plain",
                        f"{run}/plain_as_dist")
        reload_and_save([*layout_flags(4, 1, 4, "alltoall"), *FULLY], f"{run}/as_plain",
                        f"{run}/plain_as_fully")
        errors = {}
        for name, flags in (("other tp", [*layout_flags(1, 2, 1, "alltoall"), *DIST]),
                            ("plain", layout_flags(2, 1, 2, "alltoall"))):
            try:
                train(*flags, *DIST_RUN, "--load", f"{run}/dp2/iter_0000002")
                errors[name] = None
            except ValueError as err:
                errors[name] = str(err)
        results["errors"] = errors
        results["context_parallel"] = context_parallel_runs(run, train)
    elif mode in ("distopt_narrow", "distopt_wide"):  # 2 ranks: dp=1; 8 ranks: dp=4
        results["dp"] = train(*layout_flags(2, 1, 2, "alltoall"), *DIST_RUN, *DIST,
                              *NO_DROPOUT, "--load", f"{run}/dp2/iter_0000002")["losses"]
    if mode == "distopt_wide":  # pp=2, (2,2,2) and (1,4,1), bitwise resume
        for (tp, ep, etp), dispatcher in (((2, 2, 2), "parm_s2"), ((1, 4, 1), "parm")):
            # at least 2 micro-batches per step (pp=2) at dp=4 too
            flags = [*layout_flags(tp, ep, etp, dispatcher), *dispatcher_flags(dispatcher),
                     "--pipeline-model-parallel-size",
                     "2", "--global-batch-size", "16", *DIST, *DIST_RUN]
            saved = f"{run}/pp2 {tp},{ep},{etp}"
            results[f"pp2 {tp},{ep},{etp} reference"] = train(*flags, "--save", saved)["losses"]
            results[f"pp2 {tp},{ep},{etp} resumed"] = train(
                *flags, "--load", f"{saved}/iter_0000002")["losses"]
    return results


def load_and_save_content(run: Path, train, layout: list) -> dict:
    """The main launch's runs of what a load takes and a save writes (see
    test_loads_take_and_saves_write_what_the_flags_say); their losses."""
    no_epochs = ["--eval-iters", "0"]
    return {
        # iteration 5 of ref (its tracker names 10) without the optimizer's state: iterations 6
        # and 7, saved without optimizer state and RNG states
        "no_load_optim": train(*layout, "--load", f"{run}/ref", "--ckpt-step", "5",
                               "--no-load-optim", "--train-iters", "7", "--save",
                               f"{run}/no_optim", "--no-save-optim", "--no-save-rng",
                               *no_epochs)["losses"],
        # iteration 5 without its RNG states: iteration 6
        "no_load_rng": train(*layout, "--load", f"{run}/ref/iter_0000005", "--no-load-rng",
                             "--exit-interval", "6", *no_epochs)["losses"],
        # --load holds nothing yet: ref's latest (10) as --finetune loads it, 2 iterations
        "finetuned": train(*layout, "--load", f"{run}/finetuned", "--save", f"{run}/finetuned",
                           "--pretrained-checkpoint", f"{run}/ref", "--train-iters", "2",
                           *no_epochs)["losses"],
    }


def worker(mode: str, run_dir: str) -> None:
    sys.path.insert(0, str(REPO))
    from megatron_parm import cli

    cli.setup_warnings()  # as the pretraining scripts do: the grouped launch shows what a user sees
    import torch

    from megatron_parm import checkpointing
    from megatron_parm.training.arguments import parse_args
    from megatron_parm.training.trainer import initialize_distributed, pretrain

    initialize_distributed()
    run = Path(run_dir)
    L222 = layout_flags(2, 2, 2, "alltoall")
    results = {}

    threads = []  # this rank's threads after each run (Linux)

    def train(*flags, config=None):
        argv = list(BASE) + list(flags)
        if config:
            argv[1] = config
        try:
            return pretrain(parse_args(argv))
        finally:
            threads.append(len(os.listdir("/proc/self/task")))

    if mode == "crash":
        def kill_rank_1(stage, iteration):
            if stage == "written" and iteration == 4 and torch.distributed.get_rank() == 1:
                os.kill(os.getpid(), 9)  # SIGKILL: no handler, no cleanup
        checkpointing.set_fault_hook(kill_rank_1)
        train(*L222, "--save", f"{run}/crash", "--save-interval", "2", *NON_PERSISTENT)
        return  # not reached

    if mode == "main":
        rank = torch.distributed.get_rank()
        results["reference"] = train(*L222, "--save", f"{run}/ref", "--save-interval", "5")["losses"]
        # stopped at 5 in Megatron-LM's per-rank files; resumed from them (the default format
        # loads either) and saved at 10 without the fully parallel save
        first = train(*L222, "--save", f"{run}/stop", "--exit-interval", "5", "--ckpt-format",
                      "torch")
        results["first_half"] = first["losses"]
        results["resumed"] = train(*L222, "--save", f"{run}/stop", "--load", f"{run}/stop",
                                   "--no-ckpt-fully-parallel-save")["losses"]
        results["after_crash"] = train(*L222, "--save", f"{run}/crash", "--load", f"{run}/crash",
                                       *AFTER_CRASH)["losses"]
        results["eval"] = {}
        for (tp, ep, etp), dispatcher in EVAL_LAYOUTS:
            summary = train(*layout_flags(tp, ep, etp, dispatcher), "--load",
                            f"{run}/ref/iter_0000010", "--skip-train",
                            *(AUTO_DETECT if dispatcher == "alltoall" else []))
            results["eval"][f"{tp},{ep},{etp} {dispatcher}"] = eval_loss(summary)
        results.update(load_and_save_content(run, train, L222))

        errors = {}
        if rank == 0:  # a copy of the checkpoint with a truncated data file
            shutil.copytree(f"{run}/ref/iter_0000010", f"{run}/truncated/iter_0000010")
            Path(f"{run}/truncated/latest_checkpointed_iteration.txt").write_text("10")
            data_file = sorted(Path(f"{run}/truncated/iter_0000010").glob("*.distcp"))[-1]
            os.truncate(data_file, data_file.stat().st_size // 2)
        torch.distributed.barrier()
        for name, flags in (("nowhere", ["--load", f"{run}/does-not-exist", "--ckpt-step", "5"]),
                            ("other_shape", ["--load", f"{run}/ref", "--ffn-hidden-size", "128"]),
                            ("truncated", ["--load", f"{run}/truncated"]),
                            ("no_checkpoint", ["--load", f"{run}/ref/../empty_dir_that_exists"]),
                            ("torch_needs_detect", ["--load", f"{run}/ref", "--ckpt-format",
                                                    "torch"]),
                            ("torch_other_layout", [*layout_flags(1, 4, 1, "alltoall"), "--load",
                                                    f"{run}/stop/iter_0000005"]),
                            ("ckpt_step", ["--load", f"{run}/ref", "--ckpt-step", "7"]),
                            ("exit_on_missing", ["--load", f"{run}/fresh", "--save",
                                                 f"{run}/fresh", "--exit-on-missing-checkpoint"])):
            if name == "no_checkpoint" and rank == 0:
                # no tracker, only an incomplete folder: an error (an empty one is a fresh start)
                os.makedirs(f"{run}/empty_dir_that_exists/iter_0000003", exist_ok=True)
            torch.distributed.barrier()
            try:
                train(*L222, *flags)
                errors[name] = None
            except ValueError as err:  # CheckpointError is a ValueError
                errors[name] = f"{type(err).__name__}: {err}"
        results["errors"] = errors

        dense, dense_layout = dense_config(run), layout_flags(2, 1, 2, "alltoall")
        train(*dense_layout, "--save", f"{run}/dense", "--train-iters", "3", config=dense)
        results["dense_eval"] = eval_loss(train(*dense_layout, "--load", f"{run}/dense",
                                                "--skip-train", "--train-iters", "3", config=dense))

        # --data-parallel-random-init at (2,1,2): 2 data-parallel ranks, over which the experts
        # are replicated too: rank 0's weights everywhere, each rank's own dropout
        short = [*dense_layout, "--train-iters", "2", "--eval-iters", "0"]
        results["dp_random_init"] = {
            "no_dropout": train(*short, *NO_DROPOUT, "--data-parallel-random-init")["losses"],
            "no_dropout_without": train(*short, *NO_DROPOUT)["losses"],
            "dropout": train(*short, "--data-parallel-random-init")["losses"],
            "dropout_without": train(*short)["losses"]}

    if mode == "grouped":
        results = grouped_worker(run, train)

    if mode.startswith("distopt"):
        results = distopt_worker(mode, run, train)
        results["threads"] = threads

    if mode == "wide":
        flags = layout_flags(2, 4, 2, "parm_s2")
        # --moe-use-upcycling of the dense checkpoint against its offline upcycled copy: the
        # same first loss (each MoE layer computes its dense MLP)
        short = [*flags, *NO_DROPOUT, "--eval-iters", "0"]
        results["upcycling"] = {
            "in_run": train(*short, "--moe-use-upcycling", "--load", f"{run}/dense", "--save",
                            f"{run}/upcycling", "--train-iters", "2")["losses"],
            "offline": train(*short, "--load", f"{run}/upcycled", "--train-iters", "1",
                             "--lr-warmup-iters", "0")["losses"],
            "saved": sorted(path.name for path in (run / "upcycling").iterdir())}
        results["eval"] = {name: eval_loss(train(*flags, "--load", path, "--skip-train"))
                           for name, path in (("ref", f"{run}/ref/iter_0000010"),
                                              ("relayout", f"{run}/relayout"),
                                              ("from_file", f"{run}/from_file"),
                                              ("upcycled", f"{run}/upcycled"))}

    if torch.distributed.get_rank() == 0:
        (run / f"{mode}.json").write_text(json.dumps(results))
    torch.distributed.barrier()
    if mode == "grouped":  # the pretraining entry point, as a launch runs it: ends with status 2
        sys.path.insert(0, str(REPO / "pretrain_scripts"))
        from megatron_parm import cli
        from pretrain_gpt2_moe import main

        cli.run(main, BASE + layout_flags(1, 4, 1, "alltoall") + GROUPED + BAD_WIDTH)


def crash_launch(script: str, run: Path) -> str:
    """The crash run. The killed rank leaves the helper process of Megatron's checkpoint writer
    (a multiprocessing Manager) orphaned and holding its output open: the log goes to a file,
    not a pipe, and afterwards every process carrying this launch's marker is ended."""
    import signal
    import uuid


    marker = uuid.uuid4().hex
    log_path = run / "crash.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
             "--master-addr", "127.0.0.1", "--master-port", str(free_port()), script,
             "worker", "crash", str(run)],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                     PARM_TEST_LAUNCH=marker))
        try:
            returncode = proc.wait(timeout=600)
        finally:
            for pid in pids_with_marker(f"PARM_TEST_LAUNCH={marker}"):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    assert returncode != 0, "the crash run should have failed"
    return log_path.read_text()[-20000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, prepared_data):
    run = tmp_path_factory.mktemp("checkpoints")
    script = str(Path(__file__).relative_to(REPO))
    crash_state = {"log": crash_launch(script, run),
                   "tracker": (run / "crash/latest_checkpointed_iteration.txt").read_text(),
                   "dirs": sorted(p.name for p in (run / "crash").iterdir())}
    main = torchrun(script, 4, "worker", "main", str(run), timeout=900)
    conversions = {
        "relayout": convert("--load", f"{run}/ref", "--save", f"{run}/relayout",
                            "--target-tensor-parallel-size", "1", "--target-expert-parallel-size",
                            "4", "--target-expert-tensor-parallel-size", "1"),
        "to_file": convert("--load", f"{run}/ref", "--to-single-file", f"{run}/ref.pt"),
        "from_file": convert("--from-single-file", f"{run}/ref.pt", "--save", f"{run}/from_file"),
        "upcycle": convert("--upcycle", "--load", f"{run}/dense", "--save", f"{run}/upcycled",
                           "--num-experts", "4", "--moe-router-topk", "2"),
    }
    for name, proc in conversions.items():
        assert proc.returncode == 0, f"{name}:\n{proc.stdout}\n{proc.stderr[-5000:]}"
    torchrun(script, 8, "worker", "wide", str(run), timeout=900)
    results = {mode: json.loads((run / f"{mode}.json").read_text()) for mode in ("main", "wide")}
    results["main_log"] = main.stdout + main.stderr
    return run, results, crash_state, conversions


def test_resume_reproduces_uninterrupted_run_bitwise(runs):
    """Stopped at 5 in Megatron-LM's per-rank files (--ckpt-format torch), resumed by a run of
    the default format (which loads either, as Megatron-LM's does): iterations 6-10 bitwise."""
    run, results, _, _ = runs
    main = results["main"]
    reference = main["reference"]
    assert len(reference) == 10
    assert main["first_half"] == reference[:5]
    assert main["resumed"] == reference[5:], (main["resumed"], reference[5:])
    saved = run / "stop/iter_0000005"
    assert sorted(p.name for p in saved.iterdir()) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001",
        "parm_manifest.json"]  # tp 2 x ep 2, etp 2: every rank writes its own file
    assert (saved / "mp_rank_01_001/model_optim_rng.pt").is_file()
    assert "> loaded torch checkpoint " in results["main_log"]


def _tensors(path: Path) -> dict:
    from megatron_parm.checkpointing.full import read_full

    return read_full(str(path)).tensors


def _bytes_per_rank(path: Path) -> dict:
    """The bytes each rank wrote into a torch_dist folder (its __RANK_N.distcp files)."""
    written = {}
    for data_file in path.glob("__*.distcp"):
        rank = int(data_file.name.split("_")[2])
        written[rank] = written.get(rank, 0) + data_file.stat().st_size
    return written


def test_fully_parallel_save_writes_the_same_tensors_from_more_ranks(runs):
    """Iteration 10 saved with Megatron-LM's default fully parallel save (ref) and with
    --no-ckpt-fully-parallel-save (the resumed run, bitwise the same run): the same tensors,
    every one equal; the replicated ones written by their first data-parallel replica only
    without it, by both replicas with it."""
    import torch

    run = runs[0]
    parallel, single = run / "ref/iter_0000010", run / "stop/iter_0000010"
    expected, got = _tensors(parallel), _tensors(single)
    assert sorted(expected) == sorted(got) and len(expected) > 20
    for key, tensor in expected.items():
        assert torch.equal(tensor, got[key]), key
    # (2,2,2) on 4 ranks: ranks 0, 1 are the first data-parallel replica of 2, 3
    spread, first_only = _bytes_per_rank(parallel), _bytes_per_rank(single)
    assert spread[2] > first_only[2] and spread[0] < first_only[0], (spread, first_only)


def test_sigkill_during_save_keeps_previous_checkpoint(runs):
    run, results, crash, _ = runs
    assert "Signal 9" in crash["log"] or "SIGKILL" in crash["log"], crash["log"]
    # Killed while saving iteration 4: the tracker still names 2, iteration 4 never published.
    assert crash["tracker"].strip() == "2"
    assert "iter_0000004" not in crash["dirs"] and "iter_0000004.partial" in crash["dirs"]
    # The resumed run loaded the newer non-persistent save (3) and reproduces 4-10 exactly,
    # with --ckpt-fully-parallel-load.
    assert results["main"]["after_crash"] == results["main"]["reference"][3:]
    assert (run / "crash/latest_checkpointed_iteration.txt").read_text().strip() == "10"
    assert not (run / "crash/iter_0000004.partial").exists()


def test_retention_and_non_persistent_saves_keep_what_they_should(runs):
    """The resumed crashed run saved at 4, 6, 8 and 10 with --save-retain-interval 4 (each save
    deletes the one before it unless a multiple of 4: the crash's 2 at 4, 6 at 8), and
    non-persistently at 9 (that folder keeps its latest only: 3 went)."""
    run, results, _, _ = runs
    assert sorted(p.name for p in (run / "crash").glob("iter_*")) == [
        "iter_0000004", "iter_0000008", "iter_0000010"]
    assert sorted(p.name for p in (run / "crash/non_persistent").glob("iter_*")) == [
        "iter_0000009"]
    log = results["main_log"]
    for iteration in (2, 6):
        assert f"> deleted checkpoint {run}/crash/iter_{iteration:07d} (--save-retain-interval " \
               f"4)" in log, log[-3000:]
    assert f"> deleted checkpoint {run}/crash/non_persistent/iter_0000003 (non-persistent)" in log
    assert "> saved non-persistent checkpoint at iteration 9 " in log


def test_cached_structure_saves_the_same_tensors(runs):
    """--ckpt-assume-constant-structure: once the saves at 4 and 6 agreed, those at 8, 9 and 10
    reused their plan (said on the console); iteration 10 holds the reference's tensors."""
    import torch

    run, results, _, _ = runs
    log = results["main_log"]
    reused = [line for line in log.splitlines() if "(the structure of the saves before it "
              "reused)" in line]
    assert [line.split(" at iteration ")[1].split()[0] for line in reused] == ["8", "9", "10"], \
        reused
    expected, got = _tensors(run / "ref/iter_0000010"), _tensors(run / "crash/iter_0000010")
    assert sorted(expected) == sorted(got)
    for key, tensor in expected.items():
        assert torch.equal(tensor, got[key]), key


def test_loads_take_and_saves_write_what_the_flags_say(runs):
    """--ckpt-step 5 --no-load-optim: iteration 6 is the reference's (weights, data position and
    RNG states loaded), 7 is not (Adam starts fresh). --no-load-rng: iteration 6 is not (dropout
    draws from the seed). --pretrained-checkpoint (as --finetune): iterations 1 and 2 from
    iteration 10's weights, with a fresh optimizer and schedule and the data from its start.
    --no-save-optim --no-save-rng: neither in the saved checkpoint."""
    from megatron_parm.checkpointing.full import read_full

    run, results, _, _ = runs
    main = results["main"]
    reference = main["reference"]
    assert main["no_load_optim"][0] == reference[5] and main["no_load_optim"][1] != reference[6]
    assert len(main["no_load_rng"]) == 1 and main["no_load_rng"][0] != reference[5]
    finetuned = main["finetuned"]
    assert len(finetuned) == 2 and finetuned[0] < reference[0] - 0.1, (finetuned, reference)
    saved = read_full(str(run / "finetuned/iter_0000002"))
    assert (saved.common["iteration"], saved.common["consumed_samples"]) == (2, 16)
    assert int(saved.common["optimizer_step"]) == 2
    assert saved.common["opt_param_scheduler"]["num_steps"] == 16
    bare = read_full(str(run / "no_optim/iter_0000007"))
    assert bare.common["iteration"] == 7
    assert not {"optimizer_step", "opt_param_scheduler", "rng_state"} & set(bare.common)
    assert not [key for key in bare.tensors if key.startswith("optimizer.")]
    assert f"finetuning from --pretrained-checkpoint {run}/ref/iter_0000010" in results["main_log"]


def test_use_checkpoint_args_takes_the_model_flags(runs, monkeypatch):
    """--use-checkpoint-args (and the parallel sizes with --use-mp-args-from-checkpoint-args):
    the model's flags come from ref's checkpoint, the forced ones over the command line's, the
    others where it left them unset; the tokenizer too unless told not to."""
    from megatron_parm.training.arguments import parse_args

    run = runs[0]
    monkeypatch.chdir(REPO)
    argv = ["--use-checkpoint-args", "--load", str(run / "ref"), "--seq-length", "64",
            "--micro-batch-size", "2", "--train-iters", "4", "--lr", "0.001", "--num-experts",
            "8", "--hidden-size", "64", "--num-attention-heads", "4",
            "--use-mp-args-from-checkpoint-args", "--sequence-parallel"]
    args = parse_args(argv, world_size=4, reads_data=False)
    assert (args.num_layers, args.num_experts, args.moe_router_topk) == (2, 4, 2)
    assert args.disable_bias_linear  # Megatron-LM's add_bias_linear, forced
    assert (args.tensor_model_parallel_size, args.expert_model_parallel_size) == (2, 2)
    assert (args.tokenizer_type, args.ffn_hidden_size) == ("SentencePieceTokenizer", 256)
    assert args.checkpoint_args_note.startswith(f"--use-checkpoint-args: from {run}/ref/"
                                                f"iter_0000010: --num-layers 2, ")
    args = parse_args(argv + ["--no-use-tokenizer-model-from-checkpoint-args", "--tokenizer-type",
                              "GPT2BPETokenizer"], world_size=4, reads_data=False)
    assert args.tokenizer_type == "GPT2BPETokenizer"


def test_eval_loss_identical_in_every_layout(runs):
    _, results, _, _ = runs
    losses = dict(results["main"]["eval"])
    reference = losses["2,2,2 alltoall"]
    losses.update({f"2,4,2 parm_s2 ({name})": value
                   for name, value in results["wide"]["eval"].items() if name != "upcycled"})
    assert len(losses) == 7
    for name, value in losses.items():
        assert abs(value - reference) <= 1e-6, (name, value, reference, losses)


def test_clear_errors_never_a_silent_fresh_start(runs):
    run, results, _, _ = runs
    errors = results["main"]["errors"]
    assert f"--load {run}/does-not-exist: no such directory" in errors["nowhere"], errors
    assert "--ffn-hidden-size" in errors["other_shape"], errors
    assert "truncated" in errors["truncated"] and ".weight" in errors["truncated"], errors
    assert "no checkpoint found" in errors["no_checkpoint"] and \
        "incomplete checkpoint folders: iter_0000003" in errors["no_checkpoint"], errors
    assert f"--ckpt-format torch: {run}/ref/iter_0000010 holds a torch_dist checkpoint; give " \
           f"--auto-detect-ckpt-format" in errors["torch_needs_detect"], errors
    assert f"--ckpt-format torch: {run}/stop/iter_0000005 loads only at the layout it was saved " \
           f"at (tp, pp, vpp, ep and etp): it was saved at tp=2 ep=2 etp=2, this run has tp=1 " \
           f"ep=4 etp=1" in errors["torch_other_layout"], errors
    assert f"--ckpt-step 7: {run}/ref/iter_0000007 does not exist (complete iterations in " \
           f"{run}/ref: 5, 10)" in errors["ckpt_step"], errors
    assert f"--exit-on-missing-checkpoint: --load {run}/fresh holds no checkpoint yet" in \
        errors["exit_on_missing"], errors


def test_single_file_round_trip_is_bitwise(runs):
    import torch

    from megatron_parm.checkpointing.full import read_full

    run, _, _, conversions = runs
    assert "all checksums equal" in conversions["to_file"].stdout
    source, back = read_full(str(run / "ref/iter_0000010")), read_full(str(run / "from_file/iter_0000010"))
    assert sorted(source.tensors) == sorted(back.tensors)
    for key, tensor in source.tensors.items():
        assert tensor.dtype == back.tensors[key].dtype and torch.equal(tensor, back.tensors[key]), key
    assert source.objects == back.objects
    relayout = read_full(str(run / "relayout/iter_0000010"))
    for key, tensor in source.tensors.items():
        assert torch.equal(tensor, relayout.tensors[key]), key
    assert "6 expert tensors holding 48 [layer, expert] slices" in conversions["relayout"].stdout


def test_upcycled_model_starts_at_the_dense_loss(runs):
    _, results, _, conversions = runs
    assert "4 experts per layer" in conversions["upcycle"].stdout
    dense, upcycled = results["main"]["dense_eval"], results["wide"]["eval"]["upcycled"]
    assert abs(dense - upcycled) <= 1e-5, (dense, upcycled)


def test_moe_use_upcycling_starts_at_the_dense_model(runs):
    _, results, _, _ = runs
    upcycling = results["wide"]["upcycling"]
    # iteration 1 is the upcycled checkpoint (Megatron-LM's); the run trains iteration 2 on the
    # first batch, which the offline copy (iteration 0) trains as its iteration 1
    assert "iter_0000001" in upcycling["saved"] and "iter_0000002" in upcycling["saved"]
    assert len(upcycling["in_run"]) == 1
    assert abs(upcycling["in_run"][0] - upcycling["offline"][0]) <= 1e-5, upcycling


def test_data_parallel_random_init_copies_rank_0_weights(runs):
    _, results, _, _ = runs
    runs_ = results["main"]["dp_random_init"]
    # the same weights on both data-parallel ranks (rank 0's, which the default seed gives)
    assert runs_["no_dropout"] == runs_["no_dropout_without"], runs_
    # the second rank's dropout masks come from its own seed: the first loss (before any update)
    # is not the default run's
    assert runs_["dropout"][0] != runs_["dropout_without"][0], runs_


def _copy(run: Path, tmp_path: Path) -> Path:
    target = tmp_path / "ckpt/iter_0000010"
    shutil.copytree(run / "ref/iter_0000010", target)
    (tmp_path / "ckpt/latest_checkpointed_iteration.txt").write_text("10")
    return target


def test_missing_expert_chunk_refused_naming_it(runs, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    run = runs[0]
    path = _copy(run, tmp_path)
    metadata = FileSystemReader(str(path)).read_metadata()
    key = "decoder.layers.mlp.experts.experts.linear_fc2.weight"
    entry = metadata.state_dict_metadata[key]
    entry.chunks = [c for c in entry.chunks if tuple(c.offsets[:2]) != (1, 3)]
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    proc = convert("--load", str(tmp_path / "ckpt"), "--to-single-file", str(tmp_path / "x.pt"))
    assert proc.returncode == 2
    assert key in proc.stderr and "layer 1 expert 3" in proc.stderr, proc.stderr


def test_truncated_expert_tensor_refused_naming_it(runs, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    run = runs[0]
    path = _copy(run, tmp_path)
    metadata = FileSystemReader(str(path)).read_metadata()
    key = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == key)
    os.truncate(path / info.relative_path, info.offset + info.length // 2)
    proc = convert("--load", str(tmp_path / "ckpt"), "--to-single-file", str(tmp_path / "x.pt"))
    assert proc.returncode == 2 and key in proc.stderr and "truncated" in proc.stderr, proc.stderr


def test_single_file_with_damaged_expert_refused_naming_it(runs, tmp_path):
    import torch

    run = runs[0]
    data = torch.load(run / "ref.pt", weights_only=False)
    key = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    data["tensors"][key] = data["tensors"][key][:, :3].clone()  # one expert fewer
    removed = "optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc2.weight"
    del data["tensors"][removed]
    torch.save(data, tmp_path / "bad.pt")
    proc = convert("--from-single-file", str(tmp_path / "bad.pt"), "--save", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stdout
    assert f"{key}: float32(2, 3, 256, 64), expected float32(2, 4, 256, 64)" in proc.stderr, proc.stderr
    assert f"{removed}: missing" in proc.stderr, proc.stderr
    assert not (tmp_path / "out/latest_checkpointed_iteration.txt").exists()


def test_inspect_lists_iterations_layout_and_tensors(runs):
    run = runs[0]
    proc = subprocess.run([sys.executable, "tools/inspect_checkpoint.py", str(run / "ref")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "2 checkpoints, tracker -> 10" in proc.stdout
    assert "saved on 4 ranks: tp=2 ep=2 etp=2" in proc.stdout
    assert "decoder.layers.mlp.experts.experts.linear_fc1.weight" in proc.stdout


# ---------------------------------------------------------------------------------------------
# Between expert implementations: the grouped launch
# ---------------------------------------------------------------------------------------------

# Relative: a sum in another order is an ulp or two of the loss (at a loss of 8.6 one float32
# ulp is 9.5e-7, seen at ETP 2); a lost optimizer state moves it by far more.
CROSS_LAYOUT_TOL = 1e-6


@pytest.fixture(scope="module")
def grouped_runs(tmp_path_factory, prepared_data):
    """The grouped launch (module docstring), through megatron_parm.launch: (run folder,
    rank 0's results, the launch's exit status and output)."""
    run = tmp_path_factory.mktemp("grouped")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONWARNINGS", None)  # the output a user sees
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_parm.launch", "--nproc-per-node", "4", "--master-addr",
         "127.0.0.1", "--master-port", str(free_port()), str(Path(__file__).relative_to(REPO)),
         "worker", "grouped", str(run)],
        cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    output = proc.stdout + proc.stderr
    assert (run / "grouped.json").is_file(), output[-6000:]
    return run, json.loads((run / "grouped.json").read_text()), proc.returncode, output


def _close(losses, reference):
    return len(losses) == len(reference) and all(
        abs(a - b) <= CROSS_LAYOUT_TOL * max(1.0, abs(b)) for a, b in zip(losses, reference))


def test_grouped_experts_resume_a_sequential_checkpoint_and_back(grouped_runs):
    """SequentialMLP (2,2,2) -> TorchGroupedMLP (1,4,1) -> SequentialMLP (4,1,4) and
    TorchGroupedMLP (2,2,2): each resumed run repeats the losses of the run it resumed. The
    second iteration after each load steps with the loaded Adam moments (fresh ones give
    another loss there)."""
    _, results, _, output = grouped_runs
    sequential = results["sequential"]
    assert len(sequential) == 6
    assert _close(results["to_grouped"], sequential[2:]), (results["to_grouped"], sequential)
    for name in ("back", "grouped_etp"):
        assert _close(results[name], results["to_grouped"][2:]), (name, results[name], results)
    # The start-up lines: 2 runs with each implementation, the refused checkpoint's, and the
    # three of --dist-ckpt-strictness (SequentialMLP).
    assert output.count(", experts SequentialMLP,") == 5, output[-6000:]
    assert output.count(", experts TorchGroupedMLP,") == 3, output[-6000:]


def test_grouped_checkpoint_of_other_expert_shapes_names_the_tensor(grouped_runs):
    """One expert fewer in fc1 and another FFN width in an Adam moment of fc2, loaded with
    TorchGroupedMLP experts: the error's own line names the first tensor with both shapes."""
    _, results, _, _ = grouped_runs
    message = results["bad_checkpoint"]
    assert message is not None, "the damaged checkpoint loaded"
    first, *others = message.splitlines()
    assert first.endswith(f"does not fit this model: {FC1}: shape (2, 3, 256, 64) in the "
                          f"checkpoint, (2, 4, 256, 64) in this model"), message
    assert [line.strip() for line in others] == [
        f"{FC2_MOMENT}: shape (2, 4, 64, 128) in the checkpoint, (2, 4, 64, 256) in this model"], message


def test_strictness_decides_what_lacking_and_extra_tensors_do(grouped_runs):
    """A checkpoint without the final norm's weight (nor its moments) and with a tensor the
    model lacks: by default the load stops naming the first; raise_all names both (every rank
    alike); log_all loads the rest, says what it left out and what it did not load, and the
    norm keeps its initial weight (iteration 3's loss moves a little from the full load's)."""
    _, results, _, output = grouped_runs
    default = results["strict assume_ok_unexpected"]
    assert f"does not fit this model: {FINAL_NORM}: not in the checkpoint" in default, default
    moments = [f"optimizer.state.{name}.{FINAL_NORM}" for name in ("exp_avg", "exp_avg_sq")]
    assert results["strict raise_all"] == (
        f"--dist-ckpt-strictness raise_all: not in the checkpoint: {FINAL_NORM}, "
        f"{', '.join(moments)}; in the checkpoint, not in this model: {EXTRA}"), results
    logged, full = results["strict log_all"], results["sequential"][2]
    assert len(logged) == 1 and logged[0] != full and abs(logged[0] - full) < 0.05, (logged, full)
    assert f"> note: --dist-ckpt-strictness log_all: not in the checkpoint: {FINAL_NORM}" in output
    assert f"> note: --dist-ckpt-strictness log_all: in the checkpoint, not in this model: " \
           f"{EXTRA} (not loaded)" in output


def test_runs_that_load_checkpoints_print_no_warning(grouped_runs):
    """The grouped launch as a user sees it (megatron_parm.launch, no PYTHONWARNINGS): four
    runs that --load and three refused ones, and not one warning line (Megatron-Core's loader
    raised three FutureWarnings of torch's own deprecations on every load, before they were
    silenced where it is called)."""
    _, _, _, output = grouped_runs
    assert output.count("> loaded torch_dist checkpoint ") == 4, output[-6000:]
    warned = [line for line in output.splitlines() if "warning" in line.lower()]
    assert warned == [], warned


def test_grouped_gemm_width_refused_by_the_launcher_in_one_line(grouped_runs):
    """--moe-grouped-gemm with rows the grouped GEMM cannot take: status 2, one line naming
    the flags, no traceback and no torchrun report."""
    _, _, status, output = grouped_runs
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert status == 2, output[-6000:]
    assert errors == [
        "error: --moe-grouped-gemm: --moe-ffn-hidden-size / --expert-tensor-parallel-size gives "
        "rows of 66 fp32 values (264 bytes); the grouped GEMM needs a multiple of 4 values "
        "(16 bytes): change --moe-ffn-hidden-size / --expert-tensor-parallel-size, or drop "
        "--moe-grouped-gemm"], output[-6000:]
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-6000:]


@pytest.fixture(scope="module")
def distopt_runs(tmp_path_factory, prepared_data):
    """The distributed optimizer's launches: 4 ranks (saves every checkpoint the others
    load), then 2 and 8; then the pretraining script refusing one through the launcher.
    (run folder, {mode: rank 0's results}, the refused launch, the folder before it)."""
    run = tmp_path_factory.mktemp("distopt")
    script = str(Path(__file__).relative_to(REPO))
    results = {}
    for mode, nproc in (("distopt", 4), ("distopt_narrow", 2), ("distopt_wide", 8)):
        torchrun(script, nproc, "worker", mode, str(run), timeout=1500)
        results[mode] = json.loads((run / f"{mode}.json").read_text())
    before = _snapshot(run / "dp2")
    refused = subprocess.run(
        [sys.executable, "-m", "megatron_parm.launch", "--nproc-per-node", "2", "--master-addr",
         "127.0.0.1", "--master-port", str(free_port()), "pretrain_scripts/pretrain_gpt2_moe.py",
         *BASE, *layout_flags(1, 2, 1, "alltoall"), *DIST, *DIST_RUN, "--load", f"{run}/dp2",
         "--save", f"{run}/dp2"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    return run, results, refused, before


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


def test_distopt_resume_is_bitwise_for_every_dispatcher(distopt_runs):
    """Each dispatcher at (2,2,2) (dp-reshardable) or (1,4,1) (fully reshardable), and with
    pp=2 on 8 ranks: the resumed iterations 3-4 print the uninterrupted run's losses."""
    _, results, _, _ = distopt_runs
    runs = {**results["distopt"], **results["distopt_wide"]}
    names = [key[:-len(" reference")] for key in runs if key.endswith(" reference")]
    assert len(names) == len(DISPATCHERS) + 2, names
    for name in names:
        reference = runs[f"{name} reference"]
        assert len(reference) == 4 and runs[f"{name} resumed"] == reference[2:], (name, runs)
    # alltoall at (2,2,2) saved Megatron-LM's per-rank files (--ckpt-format torch), with the
    # distributed optimizer's parameter state gathered on each data-parallel group's first rank
    saved = distopt_runs[0] / "dist 2,2,2_alltoall/iter_0000002"
    assert sorted(p.name for p in (saved / "mp_rank_00_000").iterdir()) == [
        "distrib_optim.pt", "model_optim_rng.pt"]


def test_finished_runs_leave_no_threads_behind(distopt_runs):
    """A run's process groups go when the next layout's are made: under gloo each group keeps
    I/O threads, which a finished run's model (through Megatron-Core's DDP hooks) and a cache
    of the collectives kept alive (before: 6 to 54 more threads per run; 1,312 per rank seen
    midway through this launch). parm_hier's node groups are kept on purpose."""
    _, results, _, _ = distopt_runs
    threads = results["distopt"]["threads"]
    assert len(threads) > 12 and max(threads) - threads[0] < 30, threads


def test_distopt_loads_at_another_data_parallel_size_and_layout(distopt_runs):
    """Saved at dp=2 (dp-reshardable): dp=1 and dp=4 continue with the same losses (1e-5);
    fully reshardable: at (4,1,4) with it and at (1,4,1) without it. (Dropout off in these
    runs: another layout's generators are reseeded, not restored.)"""
    _, results, _, _ = distopt_runs
    main = results["distopt"]
    for name, losses, reference in (
            ("dp=1", results["distopt_narrow"]["dp"], main["dp2"]),
            ("dp=4", results["distopt_wide"]["dp"], main["dp2"]),
            ("4,1,4", main["fully at 4,1,4"], main["fully"]),
            ("plain 1,4,1", main["fully plain 1,4,1"], main["fully"])):
        assert len(losses) == 2 and all(abs(a - b) <= 1e-5 for a, b in zip(losses, reference[2:])), \
            (name, losses, reference)


def test_context_parallel_checkpoints_resume_bitwise_and_load_at_cp_1(distopt_runs):
    """cp=2 (tp=2, dp=1, the distributed optimizer over dp x cp), in both formats: resumed
    from iteration 2 at cp=2 it prints iterations 3-4 of the uninterrupted run bitwise; loaded
    at cp=1 (dp=2) it continues with the same losses (1e-5); and cp=1 trained from the start
    ends with cp=2's weights (1e-5) and losses."""
    import torch

    from megatron_parm.checkpointing.full import read_full

    run, results, _, _ = distopt_runs
    cp = results["distopt"]["context_parallel"]
    for name in CP_FORMATS:
        reference = cp[f"cp2 {name}"]
        assert len(reference) == 4 and cp[f"cp2 {name} resumed"] == reference[2:], (name, cp)
        at_cp1 = cp[f"cp2 {name} at cp1"]
        assert len(at_cp1) == 2 and max(abs(a - b) for a, b in zip(at_cp1, reference[2:])) \
            <= 1e-5, (name, cp)
    assert max(abs(a - b) for a, b in zip(cp["cp1"], cp["cp2 torch_dist"])) <= 1e-5, cp
    cp2 = read_full(str(run / "cp2 torch_dist/iter_0000004")).tensors
    cp1 = read_full(str(run / "cp1/iter_0000004")).tensors
    weights = [key for key in cp1 if not key.startswith("optimizer.")]
    assert len(weights) > 20 and set(weights) <= set(cp2), sorted(cp1)
    for key in weights:
        assert torch.allclose(cp2[key].float(), cp1[key].float(), rtol=0, atol=1e-5), key


def test_distopt_moments_carry_over_with_and_without_it(distopt_runs):
    """Fully reshardable -> plain optimizer (1,4,1) -> distributed (2,2,2), dp-reshardable, and
    (4,1,4), fully reshardable: every Adam moment of every parameter, and the step, arrive
    bitwise (each checkpoint saved right after its load)."""
    import torch

    from megatron_parm.checkpointing.full import read_full

    run = distopt_runs[0]
    source = read_full(str(run / "fully/iter_0000002"))
    moments = {k: v for k, v in source.tensors.items() if k.startswith(MOMENTS)}
    assert len(moments) > 20, sorted(source.tensors)
    as_plain = read_full(str(run / "as_plain/iter_0000002"))
    for key, tensor in moments.items():
        assert torch.equal(as_plain.tensors[key], tensor), key
    assert as_plain.common["optimizer_step"] == source.common["optimizer_step"] == 2
    back = read_full(str(run / "plain_as_fully/iter_0000002"))
    for key, tensor in moments.items():
        assert torch.equal(back.tensors[key], tensor), key
    # the dp-reshardable copy holds the moments in Megatron's buckets: its resumed losses
    # (test above) and its byte count of moments tell; here, that it is that format
    dp = read_full(str(run / "plain_as_dist/iter_0000002"))
    assert dp.common["content_metadata"]["distrib_optim_sharding_type"] == "dp_reshardable"
    assert any(".bucket_idx_0.exp_avg_sq" in key for key in dp.tensors), sorted(dp.tensors)


def test_distopt_dp_reshardable_elsewhere_refused_naming_the_flag(distopt_runs):
    run, results, refused, before = distopt_runs
    errors = results["distopt"]["errors"]
    for name in ("other tp", "plain"):
        assert errors[name] is not None and "--dist-ckpt-optim-fully-reshardable" in errors[name], errors
    assert "this run has tp=1 ep=2 etp=1" in errors["other tp"], errors
    assert "this run has no --use-distributed-optimizer" in errors["plain"], errors
    output = refused.stdout + refused.stderr
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert refused.returncode == 2 and len(lines) == 1, output[-4000:]
    assert "--dist-ckpt-optim-fully-reshardable" in lines[0] and "Traceback" not in output
    assert _snapshot(run / "dp2") == before


def test_distopt_damaged_shards_named_by_inspect_and_converter(distopt_runs, tmp_path):
    """A missing or truncated optimizer shard file of a dp-reshardable checkpoint: the tools
    exit 2 naming the file and the tensor; a whole one verifies, and converts to one file."""
    from torch.distributed.checkpoint import FileSystemReader

    run = distopt_runs[0]
    good = run / "dp2/iter_0000002"
    proc = subprocess.run([sys.executable, "tools/inspect_checkpoint.py", str(good), "--verify",
                           "--no-tensors"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "distributed optimizer: dp_reshardable" in proc.stdout, \
        proc.stdout + proc.stderr
    assert ".bucket_idx_0.exp_avg " in proc.stdout, proc.stdout
    to_file = convert("--load", str(good), "--to-single-file", str(tmp_path / "x.pt"))
    assert to_file.returncode == 0, to_file.stdout + to_file.stderr
    # another layout: refused in one line before any rank process starts, in the tool's flags
    relayout = convert("--load", str(good), "--save", str(tmp_path / "relayout"),
                       "--target-tensor-parallel-size", "1", "--target-expert-parallel-size", "2")
    assert relayout.returncode == 2 and relayout.stderr.startswith(f"error: --load {good}: "), \
        relayout.stdout + relayout.stderr
    assert len(relayout.stderr.splitlines()) == 1 and "resharding" not in relayout.stdout, \
        relayout.stdout + relayout.stderr
    assert "--dist-ckpt-optim-fully-reshardable" in relayout.stderr, relayout.stderr
    assert not (tmp_path / "relayout").exists()
    metadata = FileSystemReader(str(good)).read_metadata()
    index, info = next((i, v) for i, v in metadata.storage_data.items()
                       if i.fqn.endswith(".exp_avg_sq") and "bucket_idx" in i.fqn)
    for damage in ("truncated", "missing"):
        copy = tmp_path / damage / "iter_0000002"
        shutil.copytree(good, copy)
        if damage == "truncated":
            os.truncate(copy / info.relative_path, info.offset + info.length // 2)
        else:
            os.remove(copy / info.relative_path)
        proc = subprocess.run([sys.executable, "tools/inspect_checkpoint.py", str(copy),
                               "--verify"], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert info.relative_path in proc.stderr and damage in proc.stderr, proc.stderr
        if damage == "truncated":
            assert index.fqn in proc.stderr, proc.stderr
        else:  # one line for the file, naming the tensors it held first
            held = [i.fqn for i, v in metadata.storage_data.items()
                    if v.relative_path == info.relative_path and i.offset is not None]
            assert any(fqn in proc.stderr for fqn in held), proc.stderr


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "worker":
        sys.exit("usage: torchrun --nproc-per-node N tests/e2e/test_checkpoint.py worker "
                 "{crash,main,wide,grouped,distopt,distopt_narrow,distopt_wide} RUN_DIR")
    worker(sys.argv[2], sys.argv[3])
