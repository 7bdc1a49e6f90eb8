"""The pretraining loop: Megatron-Core's model, DDP, optimizer and schedules, in one function.

    pretrain(args)   args from megatron_parm.training.arguments.parse_args

Each iteration runs --global-batch-size samples as num_microbatches micro-batches per
data-parallel rank (gradients accumulate in DDP's buffers, Megatron's schedule scales the
loss and the MoE auxiliary loss), then one optimizer step with gradient clipping and the
learning-rate schedule. Works on GPUs with NCCL and on CPUs with gloo.

With --pipeline-model-parallel-size > 1 the model is this rank's stage (a list of chunks, one
per virtual stage), Megatron-Core's 1F1B or interleaved schedule runs the micro-batches with
its p2p transfers, finalize_model_grads also sums the tied embedding's gradient over the first
and last stage, and the losses, computed on the last stage, are sent to every rank.
"""

from __future__ import annotations

import math
import os
import random
import signal
import time
from typing import Optional

import numpy
import torch

from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

from megatron_parm import device, faults, mcore_compat
from megatron_parm.tuning import CHUNK_NOTATION
from megatron_parm.cli import optional_packages_note
from megatron_parm.checkpointing import (
    check_model_flags,
    find_checkpoint,
    load_checkpoint,
    read_checkpoint_info,
    save_checkpoint,
)
from megatron_parm.data.datasets import (
    build_data_iterator,
    build_datasets_from_args,
    train_valid_test_num_samples,
)
from megatron_parm.data.tokenizers import build_tokenizer
from megatron_parm.parallel import group_timeout, initialize_model_parallel, set_group_timeout
from megatron_parm.training.log import (
    Progress,
    TensorBoard,
    expert_load_line,
    iteration_line,
    print_rank_0,
    validation_block,
)
from megatron_parm.training import ddp, mixed_precision, timing
from megatron_parm.training.model import (
    FORWARD_STEPS, build_config, build_model_chunks, expert_module_name, moe_layers, unwrap)


def initialize_distributed(timeout_minutes: Optional[float] = None) -> None:
    """Join the job's process group (env:// from torchrun, srun + torchrun or the emulator;
    without RANK, as with plain `python script.py`, a group of one process) with
    --distributed-timeout-minutes (parallel.group_timeout(), set first where given), and apply
    the CPU redirects when there is no GPU. Safe to call more than once. Processes the rank
    forks from here on (checkpoint writers) die with it."""
    faults.die_with_parent()
    if timeout_minutes is not None:
        set_group_timeout(timeout_minutes)
    if not torch.distributed.is_initialized():
        if "RANK" not in os.environ:
            store = dict(store=torch.distributed.HashStore(), rank=0, world_size=1)
        else:
            store = _attempt_store()
        device.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(device.backend(), timeout=group_timeout(),
                                             **store)
    mcore_compat.setup()


def _attempt_store() -> dict:
    """Under torchrun, the agent's store with a prefix for this attempt (--max-restarts):
    torchrun keeps one store for every attempt (its static rendezvous, --master-port), so
    without one a restarted rank reads the dead ranks' addresses and cannot connect. Empty
    (env:// as it is) elsewhere."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    world_size = int(os.environ["WORLD_SIZE"])
    agent_store = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
        is_master=False, timeout=group_timeout())
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dict(store=torch.distributed.PrefixStore(f"megatron_parm/attempt_{attempt}",
                                                    agent_store),
                rank=int(os.environ["RANK"]), world_size=world_size)


def set_seed(seed: int) -> None:
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


class ExpertLoad:
    """Counts the tokens each expert receives, per MoE layer, from the routers' outputs.

    model: this rank's chunks; num_layers, num_experts: the whole model's (a pipeline stage
    holds some of the layers: the counts are indexed by global layer number)."""

    def __init__(self, model, num_layers: int, num_experts: Optional[int]):
        self.layers = moe_layers(model)  # none in a dense model
        self.num_layers, self.num_experts = num_layers, num_experts
        # On the device: counting adds no host sync; shares() reads them once per log line.
        self.counts = [torch.zeros(layer.config.num_moe_experts, device=device.current())
                       for layer in self.layers]
        for index, layer in enumerate(self.layers):
            layer.router.register_forward_hook(self._hook(index))

    def _hook(self, index):
        def count(router, inputs, outputs):
            if router.training:
                _, routing_map = outputs  # [tokens, E] bool
                self.counts[index] += routing_map.sum(dim=0).float()
        return count

    def shares(self):
        """[(layer number, the share of all routed tokens (every rank's) each expert got)] for
        every MoE layer of the model, on every rank; resets. Collective."""
        if self.num_experts is None:
            return []
        # A row per global layer, and a last column marking the layers this rank holds.
        total = torch.zeros(self.num_layers, self.num_experts + 1, device=device.current())
        for layer, count in zip(self.layers, self.counts):
            total[layer.layer_number - 1, :-1] = count
            total[layer.layer_number - 1, -1] = 1
            count.zero_()
        torch.distributed.all_reduce(total)
        counts = total[:, :-1]
        shares = (counts / counts.sum(dim=1, keepdim=True).clamp(min=1)).tolist()
        return [(number, shares[number - 1]) for number in range(1, self.num_layers + 1)
                if total[number - 1, -1] > 0]


def from_last_stage(values) -> dict:
    """VALUES as the last pipeline stage has them (the losses: Megatron's schedules compute
    them there), on every rank; VALUES itself without pipelining. Collective."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return values
    box = [values if parallel_state.is_pipeline_last_stage() else None]
    torch.distributed.broadcast_object_list(
        box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(), device=device.current())
    return box[0]


def mean_over_data_parallel(values: dict) -> dict:
    """Average loss values over the data-parallel group (gloo has no AVG: sum and divide)."""
    if not values:
        return {}
    names = sorted(values)
    stacked = torch.tensor([float(values[name]) for name in names], device=device.current())
    torch.distributed.all_reduce(stacked, group=parallel_state.get_data_parallel_group())
    stacked /= parallel_state.get_data_parallel_world_size()
    return dict(zip(names, stacked.tolist()))


def average_microbatch_losses(losses_reduced) -> dict:
    """[{'lm loss': t, ...} per micro-batch] -> {'lm loss': mean, ...}."""
    totals = {}
    for losses in losses_reduced:
        for name, value in losses.items():
            totals[name] = totals.get(name, 0.0) + float(value)
    return {name: total / len(losses_reduced) for name, total in totals.items()}


def load_balancing_loss(num_steps: int) -> float:
    """Mean over MoE layers of the aux loss (before its coefficient) per micro-batch since the
    last call, reduced as Megatron-LM does: summed over the router's reduce group (the TP
    ranks that share the token counts), averaged over the others."""
    tracker = get_moe_layer_wise_logging_tracker()
    if "load_balancing_loss" not in tracker:
        return float("nan")
    entry = tracker["load_balancing_loss"]
    values = entry["values"].detach().float().clone()  # on the device: NCCL reduces it
    entry["values"].zero_()
    if entry.get("reduce_group") is not None:
        torch.distributed.all_reduce(values, group=entry["reduce_group"])
    torch.distributed.all_reduce(values)
    # A layer's values are on the ranks of its pipeline stage only.
    ranks_per_stage = (torch.distributed.get_world_size()
                       // parallel_state.get_pipeline_model_parallel_world_size())
    values = values.cpu() / (ranks_per_stage * max(num_steps, 1))
    moe = values[values != 0]
    return moe.mean().item() if moe.numel() else 0.0


def describe_choice(choice) -> str:
    """One line for a dispatcher's choice, whole (its describe() where it has one)."""
    return choice.describe() if hasattr(choice, "describe") else str(choice)


def dispatcher_choices(model) -> list:
    """The schedule each MoE layer of this rank's chunks chose (dispatchers that choose expose
    `choice`); None for the others, and for one still measuring (`tuning`)."""
    return [None if getattr(layer.token_dispatcher, "tuning", False)
            else getattr(layer.token_dispatcher, "choice", None) for layer in moe_layers(model)]


def pipeline_text(args) -> str:
    """'pp=2, ' (with ' x 2 virtual' when interleaved) for the start-up line; '' without."""
    if args.pipeline_model_parallel_size == 1:
        return ""
    vpp = args.virtual_pipeline_model_parallel_size
    return (f"pp={args.pipeline_model_parallel_size}"
            + (f" x {vpp} virtual" if vpp else "") + ", ")


def print_stage_0(message: str) -> None:
    """Print on the first rank of each pipeline stage (rank 0 without pipelining): what only
    that stage knows, such as its layers' dispatcher choices."""
    group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    if torch.distributed.get_rank(group) == 0:
        print(message, flush=True)


def evaluate(forward_step, data_iterator, model, args) -> dict:
    """Mean losses over --eval-iters batches (model: this rank's chunks; data_iterator: one
    per chunk), on every rank."""
    for chunk in model:
        chunk.eval()
    forward_backward = get_forward_backward_func()
    totals, num_batches = {}, 0
    with torch.no_grad():
        for _ in range(args.eval_iters):
            losses_reduced = forward_backward(
                forward_step_func=forward_step, data_iterator=data_iterator, model=model,
                num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, forward_only=True)
            for name, value in average_microbatch_losses(losses_reduced).items():
                totals[name] = totals.get(name, 0.0) + value
            num_batches += 1
    # Evaluation also went through the routers: drop its aux losses from the training log.
    get_moe_layer_wise_logging_tracker().get("load_balancing_loss", {}).get(
        "values", torch.zeros(0)).zero_()
    for chunk in model:
        chunk.train()
    if parallel_state.is_pipeline_last_stage():
        totals = mean_over_data_parallel({k: v / max(num_batches, 1) for k, v in totals.items()})
    return from_last_stage(totals)


def build_model_and_optimizer(args, vocab_size: int, padded_vocab_size=None):
    """This rank's model chunks (one per virtual pipeline stage; one without interleaving),
    each in Megatron's DDP, their Adam and the learning-rate schedule."""
    chunks = build_model_chunks(args, vocab_size, padded_vocab_size)
    config = chunks[0].config
    ddp_config = ddp.ddp_config(args)
    # As Megatron-LM: only the first chunk's gradients are bucketed (the others' reductions
    # wait for the end of the step anyway).
    model = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=index > 0)
             for index, chunk in enumerate(chunks)]
    # With --bf16 / --fp16: Megatron-Core's mixed-precision optimizer (fp32 main parameters).
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, use_distributed_optimizer=args.use_distributed_optimizer,
        **mixed_precision.optimizer_fields(args)), model)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * args.global_batch_size,
        lr_decay_steps=args.lr_decay_iters * args.global_batch_size,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=args.train_iters * args.global_batch_size,
        wd_incr_style="constant",
        # On resume (Megatron-LM's rules, checked in checkpointing.scheduler): the command
        # line's schedule, the checkpoint's, or (neither flag) refuse a difference.
        override_opt_param_scheduler=getattr(args, "override_opt_param_scheduler", False),
        use_checkpoint_opt_param_scheduler=getattr(args, "use_checkpoint_opt_param_scheduler",
                                                   False))
    # Megatron's schedule: no grad sync until the last micro-batch, then finalize grads.
    ddp.set_sync_funcs(config, model, args)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return model, optimizer, scheduler


class ExitSignal:
    """--exit-signal-handler: remember a SIGTERM (Slurm's time limit, preemption, or the sbatch
    script's trap) and let every rank agree at the end of an iteration to save and stop."""

    def __init__(self, enabled: bool):
        self.received = False
        self.enabled = enabled
        if enabled:
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def any_rank(self) -> bool:
        if not self.enabled:
            return False
        flag = torch.tensor([1.0 if self.received else 0.0], device=device.current())
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        if self.enabled:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def pretrain(args) -> dict:
    """Train args.model_type ('gpt' or 'bert') as the flags say; returns a summary:
    {'losses': [lm loss per iteration], 'eval': [...], 'checkpoint': path or None, ...}."""
    faults.record_progress(None, "starting", args.save)
    initialize_distributed(args.distributed_timeout_minutes)
    initialize_model_parallel(args.tensor_model_parallel_size, args.expert_model_parallel_size,
                              args.expert_tensor_parallel_size, args.num_experts,
                              args.moe_token_dispatcher_type, args.distributed_timeout_minutes,
                              pp=args.pipeline_model_parallel_size,
                              vpp=args.virtual_pipeline_model_parallel_size)
    set_seed(args.seed)
    get_moe_layer_wise_logging_tracker().clear()  # a previous pretrain() in this process
    rank = torch.distributed.get_rank()
    world_size = torch.distributed.get_world_size()
    print_rank_0(f"> {args.model_type.upper()} MoE pretraining: {world_size} ranks "
                 f"(tp={args.tensor_model_parallel_size}, ep={args.expert_model_parallel_size}, "
                 f"etp={args.expert_tensor_parallel_size}, {pipeline_text(args)}"
                 f"dp={args.data_parallel_size}), "
                 f"dispatcher {args.moe_token_dispatcher_type}, experts {expert_module_name(build_config(args))}, "
                 f"{device.current().type}/{torch.distributed.get_backend()}")
    if optional_packages_note():  # Megatron-Core's own warnings about them are hidden
        print_rank_0(f"> {optional_packages_note()}")
    print_rank_0(f"> checkpoints: {args.save or '(not saved: no --save)'}; "
                 f"TensorBoard: {args.tensorboard_dir or '(off: no --tensorboard-dir)'}")
    # The checks below fail on every rank alike, and the first to fail prints the error: wait
    # for rank 0's banner, so that in a shared log (Slurm's) the error comes after it.
    torch.distributed.barrier()

    # The checkpoint to resume from, if any, is checked before the model is built: its flags
    # must describe the same model, and its padded vocabulary is kept (it depends on the TP
    # size it was saved with).
    checkpoint = find_checkpoint(args.load, args.save)
    padded_vocab = None
    if checkpoint is not None:
        info = read_checkpoint_info(checkpoint[0])
        check_model_flags(info.get("args"), args, checkpoint[0])
        padded_vocab = (info.get("model_info") or {}).get("padded_vocab_size")
    elif args.load:
        print_rank_0(f"> no checkpoint in {args.load} yet (it is also --save): starting from "
                     f"scratch, later runs resume from it")

    tokenizer = build_tokenizer(args)
    model, optimizer, scheduler = build_model_and_optimizer(args, tokenizer.vocab_size,
                                                            padded_vocab)
    num_params = sum(p.numel() for chunk in model for p in chunk.parameters())
    print_rank_0(f"> parameters on rank 0: {num_params:,}; vocabulary "
                 f"{tokenizer.vocab_size} padded to {unwrap(model[0]).vocab_size}; "
                 f"{args.num_microbatches} micro-batches of {args.micro_batch_size} per "
                 f"data-parallel rank per iteration")

    iteration, consumed_samples = 0, 0
    if checkpoint is not None:
        # --skip-train only evaluates: the learning-rate schedule is neither needed nor checked.
        loaded = load_checkpoint(checkpoint[0], model, optimizer,
                                 None if args.skip_train else scheduler, args)
        iteration, consumed_samples = loaded["iteration"], loaded["consumed_samples"]
        print_rank_0(f"> loaded checkpoint {checkpoint[0]} at iteration {iteration} "
                     f"(consumed samples {consumed_samples}, RNG states "
                     f"{'restored' if loaded['rng_restored'] else 'not restored'})")
        for note in loaded["notes"]:
            print_rank_0(f"> note: {note}")

    # Data: every rank reads the samples of its data-parallel rank (TP peers read the same).
    num_samples = train_valid_test_num_samples(args.train_iters, args.global_batch_size,
                                               args.eval_interval, args.eval_iters)
    train_ds, valid_ds, _ = build_datasets_from_args(args, tokenizer, args.model_type, num_samples)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), args.data_parallel_size
    # One iterator per model chunk: the interleaved schedule draws a micro-batch for each
    # chunk's forward step, and every chunk must see the same samples.
    train_iter = [build_data_iterator(train_ds, args.micro_batch_size, consumed_samples,
                                      dp_rank, dp_size, args.num_workers, cyclic=True)
                  for _ in model]
    valid_iter = [build_data_iterator(valid_ds, args.micro_batch_size, 0, dp_rank, dp_size,
                                      args.num_workers, cyclic=True) for _ in model]

    forward_step = FORWARD_STEPS[args.model_type]
    forward_backward = get_forward_backward_func()
    if args.skip_train:
        # Evaluate the loaded model and stop (Megatron-LM's --skip-train).
        summary = {"losses": [], "eval": [], "checkpoint": None, "iteration": iteration}
        if args.eval_iters > 0:
            eval_losses = evaluate(forward_step, valid_iter, model, args)
            summary["eval"].append((iteration, eval_losses))
            print_rank_0(validation_block(f"iteration {iteration}", eval_losses))
        return summary
    expert_load = ExpertLoad(model, args.num_layers, args.num_experts)
    tensorboard = TensorBoard(args.tensorboard_dir, rank == 0)
    if tensorboard.notice:
        print_rank_0(f"> {tensorboard.notice}")
    progress = Progress(args.train_iters, iteration, enabled=rank == 0)
    summary = {"losses": [], "eval": [], "checkpoint": None, "iteration_times": []}
    interval_losses, interval_steps, interval_start = {}, 0, time.time()
    interval_skipped = interval_nan = 0  # Megatron-LM's skipped (overflow) and nan iterations
    choices = None
    exit_signal = ExitSignal(args.exit_signal_handler)
    start_iteration, saved_at = iteration, None
    for chunk in model:
        chunk.train()
    print_rank_0(f"> training for {args.train_iters - iteration} iterations")
    timer = timing.StepTimer.install(model, optimizer, unwrap(model[0]).config, args)
    # --overlap-param-gather: no forward pre-hooks in the first step (Megatron-LM's order)
    param_gather = ddp.ParamGather(model, unwrap(model[0]).config, args)
    param_gather.disable(param_sync=False)

    while iteration < args.train_iters:
        faults.record_progress(iteration + 1, "training", args.save)  # for the launcher's line
        step_start = time.time()
        timer.step_start()
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses_reduced = forward_backward(
            forward_step_func=forward_step, data_iterator=train_iter, model=model,
            num_microbatches=args.num_microbatches, seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, forward_only=False)
        update_successful, grad_norm, _ = optimizer.step()
        param_gather.enable()
        if update_successful:
            scheduler.step(increment=args.global_batch_size)
        else:
            interval_skipped += 1  # fp16: gradients overflowed, the loss scale was lowered
        iteration += 1
        consumed_samples += args.global_batch_size
        summary["iteration_times"].append(time.time() - step_start)

        losses = from_last_stage(mean_over_data_parallel(average_microbatch_losses(
            losses_reduced)) if parallel_state.is_pipeline_last_stage() else None)
        summary["losses"].append(losses["lm loss"])
        timer.step_end(iteration, losses)
        interval_nan += any(not math.isfinite(value) for value in losses.values())
        for name, value in losses.items():
            interval_losses[name] = interval_losses.get(name, 0.0) + value
        interval_steps += 1
        progress.update(iteration)

        if choices is None or None in choices or iteration % args.log_interval == 0:
            # Each layer's choice once (again only if it changes), as soon as it is made.
            new_choices = dispatcher_choices(model)
            previous = choices or [None] * len(new_choices)
            changed = [(layer.layer_number, choice) for layer, old, choice
                       in zip(moe_layers(model), previous, new_choices)
                       if choice is not None and choice != old]
            if changed:  # a pipeline stage's choices are printed by its first rank
                progress.clear()
                if not any(previous) and any("c=" in describe_choice(c) for _, c in changed):
                    print_stage_0(f"> schedules: {CHUNK_NOTATION}")
                for layer_number, choice in changed:
                    print_stage_0(f"> MoE layer {layer_number}: {args.moe_token_dispatcher_type} "
                                  f"chose {describe_choice(choice)}")
            choices = new_choices

        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            elapsed = (time.time() - interval_start) / interval_steps
            learning_rate = optimizer.param_groups[0]["lr"]
            logged = {name: value / interval_steps for name, value in interval_losses.items()}
            logged["load balancing loss"] = load_balancing_loss(
                interval_steps * args.num_microbatches)
            tokens_per_second = args.global_batch_size * args.seq_length / elapsed
            shares = expert_load.shares()
            progress.clear()
            loss_scale = optimizer.get_loss_scale().item()
            print_rank_0(iteration_line(iteration, args.train_iters, consumed_samples,
                                        elapsed * 1000.0, learning_rate, args.global_batch_size,
                                        logged, tokens_per_second, grad_norm,
                                        skipped=interval_skipped, loss_scale=loss_scale,
                                        nan_iterations=interval_nan))
            summary.setdefault("loss_scales", []).append((iteration, loss_scale))
            summary["skipped_iterations"] = summary.get("skipped_iterations", 0) + interval_skipped
            for layer_number, fractions in shares:
                print_rank_0(expert_load_line(layer_number, fractions))
            timer.log(iteration)
            tensorboard.scalars({**{f"train/{k}": v for k, v in logged.items()},
                                 "train/learning-rate": learning_rate,
                                 "train/tokens-per-second": tokens_per_second,
                                 "train/grad-norm": grad_norm or 0.0,
                                 "train/loss-scale": loss_scale,
                                 **{f"expert-load/layer-{l}-max-over-mean": max(f) * len(f)
                                    for l, f in shares}},
                                iteration)
            interval_losses, interval_steps, interval_start = {}, 0, time.time()
            interval_skipped = interval_nan = 0

        if args.eval_iters > 0 and (iteration % args.eval_interval == 0
                                    or iteration == args.train_iters):
            faults.record_progress(iteration, "evaluating", args.save)
            param_gather.disable()  # parameters gathered, no hooks (as Megatron-LM)
            eval_losses = evaluate(forward_step, valid_iter, model, args)
            param_gather.enable()
            summary["eval"].append((iteration, eval_losses))
            progress.clear()
            print_rank_0(validation_block(f"iteration {iteration}", eval_losses))
            tensorboard.scalars({f"valid/{k}": v for k, v in eval_losses.items()}, iteration)
            interval_start = time.time()  # evaluation time is not training time

        if args.save and args.save_interval and iteration % args.save_interval == 0 \
                and iteration < args.train_iters:
            faults.record_progress(iteration, "saving a checkpoint", args.save)
            path = save_checkpoint(args.save, iteration, model, optimizer, scheduler,
                                   consumed_samples, args)
            saved_at = iteration
            print_rank_0(f"> saved checkpoint at iteration {iteration} to {path}")
            interval_start = time.time()

        if exit_signal.any_rank():
            print_rank_0(f"> exit signal received: stopping after iteration {iteration}")
            summary["exit_reason"] = "signal"
            break
        if args.exit_interval and iteration % args.exit_interval == 0 \
                and iteration < args.train_iters:
            print_rank_0(f"> --exit-interval {args.exit_interval}: stopping after iteration "
                         f"{iteration}")
            summary["exit_reason"] = "exit-interval"
            break

    summary["iteration"] = iteration
    if args.save and iteration > start_iteration and saved_at != iteration:
        faults.record_progress(iteration, "saving a checkpoint", args.save)
        summary["checkpoint"] = save_checkpoint(args.save, iteration, model, optimizer,
                                                scheduler, consumed_samples, args)
        print_rank_0(f"> saved checkpoint at iteration {iteration} to {summary['checkpoint']}")
    elif args.save and saved_at == iteration:
        summary["checkpoint"] = os.path.join(args.save, f"iter_{iteration:07d}")
    exit_signal.close()  # after the save: a second SIGTERM must not cut it short
    faults.record_progress(iteration, "done", args.save)
    tensorboard.close()
    timer.close()
    print_rank_0(f"> done: {iteration} iterations, final lm loss {summary['losses'][-1]:.4f}"
                 if summary["losses"] else f"> done: nothing to train at iteration {iteration}")
    print_rank_0(f"> checkpoint: {summary['checkpoint'] or '(none: no --save)'}")
    print_rank_0(f"> TensorBoard logs: "
                 f"{args.tensorboard_dir if tensorboard.writer else '(none)'}"
                 + (f"  (tensorboard --logdir {args.tensorboard_dir})" if tensorboard.writer else ""))
    summary["dispatcher_choices"] = choices
    return summary
