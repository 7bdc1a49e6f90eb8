"""The pretraining loop: Megatron-Core's model, DDP, optimizer and schedules, in one function.

    pretrain(args)   args from megatron_parm.training.arguments.parse_args

Each iteration runs --global-batch-size samples (with --rampup-batch-size, the batch of the
samples consumed so far: training/schedule.py) as micro-batches per data-parallel rank
(gradients accumulate in DDP's buffers, Megatron's schedule scales the loss and the MoE
auxiliary loss), then one optimizer step (training/optimizer.py) with gradient clipping and
the learning-rate and weight-decay schedule. Works on GPUs with NCCL and on CPUs with gloo.

With --pipeline-model-parallel-size > 1 the model is this rank's stage (a list of chunks, one
per virtual stage), Megatron-Core's 1F1B or interleaved schedule runs the micro-batches with
its p2p transfers, finalize_model_grads also sums the tied embedding's gradient over the first
and last stage, and the losses, computed on the last stage, are sent to every rank.
"""

from __future__ import annotations

import atexit
import os
import random
import time
from typing import Optional

import numpy
import torch

from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    get_moe_layer_wise_logging_tracker,
)

from megatron_parm import device, faults, mcore_compat
from megatron_parm.tuning import CHUNK_NOTATION
from megatron_parm.wording import plural
from megatron_parm.cli import destroy_process_groups, optional_packages_note
from megatron_parm.checkpointing import (
    CheckpointingContext,
    LoadOptions,
    check_model_flags,
    check_save_format,
    find_checkpoint,
    fresh_start_line,
    load_checkpoint,
    read_checkpoint_info,
    save_checkpoint,
)
from megatron_parm.checkpointing.intervals import PERSISTENT, non_persistent_root, save_due
from megatron_parm.data.loaders import build_iterators, check_phase_resume, shut_down
from megatron_parm.data.tokenizers import build_tokenizer
from megatron_parm.data.vocab import model_vocab_sizes
from megatron_parm.parallel import group_timeout, initialize_model_parallel, set_group_timeout
from megatron_parm.training.log import (  # noqa: F401 (describe_choice: the tools' too)
    TrainingLog,
    describe_choice,
    print_rank_0,
    setup_logging,
    start_lines,
    validation_block,
)
from megatron_parm.training import ddp, mixed_precision, mtp, run_control, timing, upcycling
from megatron_parm.training.optimizer import build_optimizer
from megatron_parm.training.progress_log import ProgressLog
from megatron_parm.training.schedule import BatchSchedule, build_scheduler
from megatron_parm.training.timers import Timers
from megatron_parm.training.model import (
    FORWARD_STEPS, build_config, build_model_chunks, expert_module_name, moe_layers,
    runs_pipelined, still_tuning, unwrap)


def initialize_distributed(timeout_minutes: Optional[float] = None,
                           backend: Optional[str] = None) -> None:
    """Join the job's process group (env:// from torchrun, srun + torchrun or the emulator;
    without RANK, as with plain `python script.py`, a group of one process) with
    --distributed-timeout-minutes (parallel.group_timeout(), set first where given), and apply
    the CPU redirects when there is no GPU. BACKEND (--distributed-backend) picks NCCL or gloo
    on a GPU; without one it is gloo. Safe to call more than once. Processes the rank forks
    from here on (checkpoint writers) die with it; the groups are destroyed at exit."""
    faults.die_with_parent()
    if timeout_minutes is not None:
        set_group_timeout(timeout_minutes)
    if not torch.distributed.is_initialized():
        if "RANK" not in os.environ:
            store = dict(store=torch.distributed.HashStore(), rank=0, world_size=1)
        else:
            store = _attempt_store()
        device.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(
            backend if backend and device.is_cuda() else device.backend(),
            timeout=group_timeout(), **store)
        # Groups left to the interpreter's teardown are destroyed in no set order, and under
        # load that has aborted a process at exit ("terminate called without an active
        # exception"): a script that trains and just returns destroys them first, as
        # megatron_parm.cli.run does.
        atexit.register(destroy_process_groups)
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


def set_seed(seed: int, data_parallel_random_init: bool = False) -> None:
    """Seed every generator; with --data-parallel-random-init each data-parallel rank with
    seed + 10 x its rank (Megatron-LM's)."""
    if data_parallel_random_init:
        seed += 10 * parallel_state.get_data_parallel_rank()
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


def add_losses(losses_reduced, totals: Optional[dict] = None) -> dict:
    """{name: [sum, count]} over the micro-batches' reported losses, added to TOTALS: a value
    reported as [summed loss, tokens] (--calculate-per-token-loss) adds both, a plain value
    (a micro-batch's mean) adds itself and 1."""
    totals = {} if totals is None else totals
    for losses in losses_reduced:
        for name, value in losses.items():
            value = value.detach().view(-1).tolist() if torch.is_tensor(value) else [value]
            total = totals.setdefault(name, [0.0, 0.0])
            total[0] += float(value[0])
            total[1] += float(value[1]) if len(value) == 2 else 1.0
    return totals


def reduce_losses(totals: dict) -> dict:
    """{name: sum / count} of TOTALS (add_losses') over the data-parallel group, as Megatron-LM
    reduces them: the mean over every micro-batch of every data-parallel rank, or over every
    token of the global batch for [summed loss, tokens] values. Collective over the group."""
    if not totals:
        return {}
    names = sorted(totals)
    stacked = torch.tensor([totals[name] for name in names], dtype=torch.float64,
                           device=device.current())
    # Over data x context parallel ranks, as Megatron-LM: each CP rank reports its micro-batch's
    # whole-sequence mean, or its part's [summed loss, tokens].
    torch.distributed.all_reduce(stacked, group=parallel_state.get_data_parallel_group(
        with_context_parallel=True))
    return {name: (total / max(count, 1e-30)) for name, (total, count)
            in zip(names, stacked.tolist())}


def dispatcher_choices(model) -> list:
    """The schedule each MoE layer of this rank's chunks chose (dispatchers that choose expose
    `choice`); None for the others, and for one still measuring (`tuning`)."""
    return [None if still_tuning([layer]) else getattr(layer.token_dispatcher, "choice", None)
            for layer in moe_layers(model)]


def evaluate(forward_step, data_iterator, model, args, time_up=None) -> Optional[dict]:
    """Mean losses over --eval-iters batches (model: this rank's chunks; data_iterator: one
    per chunk), on every rank; None when TIME_UP() (collective) says that
    --exit-duration-in-mins has passed before the last batch (Megatron-LM's)."""
    for chunk in model:
        chunk.eval()
    forward_backward = get_forward_backward_func()
    totals = {}
    with torch.no_grad():
        for _ in range(args.eval_iters):
            losses_reduced = forward_backward(
                forward_step_func=forward_step, data_iterator=data_iterator, model=model,
                num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, forward_only=True)
            add_losses(losses_reduced, totals)
            if time_up is not None and time_up():
                print_rank_0("> exiting during evaluation: --exit-duration-in-mins reached")
                totals = None
                break
    # Evaluation also went through the routers: drop its aux losses from the training log.
    for entry in get_moe_layer_wise_logging_tracker().values():
        entry["values"].zero_()
    for chunk in model:
        chunk.train()
    if totals is None:
        return None
    if parallel_state.is_pipeline_last_stage():
        totals = reduce_losses(totals)
    return from_last_stage(totals)


def build_model_and_optimizer(args, vocab_size: int, padded_vocab_size=None):
    """This rank's model chunks (one per virtual pipeline stage; one without interleaving),
    each in Megatron's DDP (or Megatron-FSDP), their optimizer and the learning-rate and
    weight-decay schedule."""
    chunks = build_model_chunks(args, vocab_size, padded_vocab_size)
    config = chunks[0].config
    ddp_config = ddp.ddp_config(args, chunks)
    model = [ddp.wrap(config, ddp_config, chunk, index) for index, chunk in enumerate(chunks)]
    ddp.broadcast_params(model, args)
    # With --bf16 / --fp16: Megatron-Core's mixed-precision optimizer (fp32 main parameters).
    optimizer = build_optimizer(args, model)
    scheduler = build_scheduler(args, optimizer)
    # Megatron's schedule: no grad sync until the last micro-batch, then finalize grads.
    ddp.set_sync_funcs(config, model, args)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return model, optimizer, scheduler


def main(model_type: str, argv=None) -> int:
    """The pretraining scripts' entry (pretrain_scripts/pretrain_{gpt2,bert}_moe.py): every flag
    parsed and checked before any process group starts, then pretrain(); the exit status (the
    rerun engine's, after a rejected result; else 0)."""
    from megatron_parm.training.arguments import parse_args

    return pretrain(parse_args(argv, model_type=model_type)).get("exit_code", 0)


def pretrain(args) -> dict:
    """Train args.model_type ('gpt' or 'bert') as the flags say; returns a summary:
    {'losses': [lm loss per iteration], 'eval': [...], 'checkpoint': path or None, ...}."""
    started = time.time()  # --exit-duration-in-mins counts from here
    faults.record_progress(None, "starting", args.save)
    initialize(args)
    start_lines(args, expert_module_name(build_config(args)), device.current().type,
                optional_packages_note())
    # The checks below fail on every rank alike, and the first to fail prints the error: wait
    # for rank 0's banner, so that in a shared log (Slurm's) the error comes after it.
    torch.distributed.barrier()
    check_save_format(args)
    checkpoint, padded_vocab = checkpoint_to_resume(args)
    tokenizer = build_tokenizer(args)
    vocab, padded_vocab = model_vocab_sizes(tokenizer.vocab_size, args, padded_vocab)
    model, optimizer, scheduler = build_model_and_optimizer(args, vocab, padded_vocab)
    num_params = sum(p.numel() for chunk in model for p in chunk.parameters())
    print_rank_0(f"> parameters on rank 0: {num_params:,}; vocabulary "
                 f"{vocab} padded to {unwrap(model[0]).vocab_size}; "
                 f"{plural(args.num_microbatches, 'micro-batch')} of {args.micro_batch_size} per "
                 f"data-parallel rank per iteration")
    iteration, consumed_samples = resume(checkpoint, model, optimizer, scheduler, args)
    train_iter, valid_iter = build_iterators(args, tokenizer, len(model), consumed_samples,
                                             iteration)
    forward_step = FORWARD_STEPS[args.model_type]
    if args.skip_train:  # evaluate the loaded model and stop (Megatron-LM's --skip-train)
        summary = {"losses": [], "eval": [], "checkpoint": None, "iteration": iteration}
        if valid_iter is not None:
            summary["eval"].append((iteration, evaluate(forward_step, valid_iter, model, args)))
            print_rank_0(validation_block(f"iteration {iteration}", summary["eval"][-1][1]))
        return summary

    run = Run(args, model, optimizer, scheduler, forward_step, train_iter, valid_iter,
              iteration, consumed_samples, started)
    print_rank_0(f"> training for {plural(args.train_iters - iteration, 'iteration')}")
    try:
        train(run, args)
    except BaseException:
        run.close()
        raise
    return run.finish()


def train(run: "Run", args) -> None:
    """The loop: an iteration, its log line, evaluation, checkpoint, and the stops."""
    while run.iteration < args.train_iters:
        run.next_batch()
        faults.record_progress(run.iteration + 1, "training", args.save)  # the launcher's line
        if run.control.skips(run.iteration):  # --iterations-to-skip
            run.skip()
            continue
        grad_norm = run.step()
        if run.summary.get("exit_code"):  # the rerun engine stops the run
            break
        run.log.progress.update(run.iteration)
        if run.log.choices.due(run.iteration, args.log_interval):
            run.log.choices.update([layer.layer_number for layer in moe_layers(run.model)],
                                   dispatcher_choices(run.model), run.log.progress)
        run.log_iteration(grad_norm)  # TensorBoard / W&B and the iteration line where due
        if args.eval_iters > 0 and ((args.eval_interval and run.iteration % args.eval_interval == 0)
                                    or run.iteration == args.train_iters):
            run.evaluate()
        run.control.after_step(run.iteration)
        due = save_due(run.iteration, args)  # --save-interval, --non-persistent-save-interval
        if due:
            run.save(due)
        reason = run.control.stop_reason(run.iteration)
        if reason:
            run.summary["exit_reason"] = reason
            break


def initialize(args) -> None:
    """Process groups (the job's, then Megatron's for the layout), seeds, a clean MoE logging
    tracker and no aux-loss scale (a previous pretrain() in this process leaves its values
    there; its scale, a tensor of another shape with --calculate-per-token-loss, would refuse
    this run's)."""
    initialize_distributed(args.distributed_timeout_minutes, args.distributed_backend)
    setup_logging(args.logging_level)
    initialize_model_parallel(args.tensor_model_parallel_size, args.expert_model_parallel_size,
                              args.expert_tensor_parallel_size, args.num_experts,
                              args.moe_token_dispatcher_type, args.distributed_timeout_minutes,
                              pp=args.pipeline_model_parallel_size,
                              vpp=args.virtual_pipeline_model_parallel_size,
                              ranks_per_node=args.parm_ranks_per_node,
                              num_distributed_optimizer_instances=(
                                  args.num_distributed_optimizer_instances),
                              get_embedding_ranks=mtp.embedding_ranks(args),
                              cp=args.context_parallel_size,
                              tp_pp_dp=args.use_tp_pp_dp_mapping)
    set_seed(args.seed, getattr(args, "data_parallel_random_init", False))
    get_moe_layer_wise_logging_tracker().clear()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None


def checkpoint_to_resume(args):
    """(the checkpoint to resume from or None: checkpointing.Found, its padded vocabulary or
    None), checked before the model is built: its flags must describe the same model, and its
    padded vocabulary is kept (it depends on the TP size it was saved with)."""
    if getattr(args, "moe_use_upcycling", False):
        return upcycling.source(args)  # the dense checkpoint: its model is not this run's
    if getattr(args, "checkpoint_args_note", None):  # --use-checkpoint-args
        print_rank_0(f"> {args.checkpoint_args_note}")
    checkpoint = find_checkpoint(args.load, args.ckpt_step, args.pretrained_checkpoint,
                                 args.exit_on_missing_checkpoint,
                                 non_persistent_root(args, args.load))
    if checkpoint is None:
        if args.load:
            print_rank_0(fresh_start_line(args.load, args.save))
        return None, None
    if checkpoint.pretrained:
        print_rank_0(f"> no checkpoint in --load {args.load} yet: finetuning from "
                     f"--pretrained-checkpoint {checkpoint.path}")
    info = read_checkpoint_info(checkpoint.path)
    check_model_flags(info.get("args"), args, checkpoint.path)
    finetune = checkpoint.pretrained or args.finetune  # Megatron-LM reads no args then
    saved_args = None if finetune else info.get("args")
    # Megatron-LM's count of the samples --decrease-batch-size-if-needed left out, carried on
    args.skipped_train_samples = (saved_args or {}).get("skipped_train_samples", 0)
    check_phase_resume(saved_args, args)
    return checkpoint, (info.get("model_info") or {}).get("padded_vocab_size")


def resume(checkpoint, model, optimizer, scheduler, args):
    """(iteration, consumed samples): the checkpoint's, loaded into the model, optimizer and
    schedule as the checkpoint flags say; (0, 0) without one or with --finetune."""
    if checkpoint is None:
        return 0, 0
    if getattr(args, "moe_use_upcycling", False):
        print_rank_0(f"> upcycling the dense checkpoint {checkpoint.path} (iteration "
                     f"{checkpoint.iteration}) to {args.num_experts} experts per MoE layer")
        iteration, consumed_samples = upcycling.upcycle(checkpoint, model, optimizer, scheduler,
                                                        args)
        print_rank_0(f"> upcycled checkpoint saved to {args.save}: training from iteration "
                     f"{iteration}")
        return iteration, consumed_samples
    options = LoadOptions.from_args(args)
    loaded = load_checkpoint(checkpoint.path, model, optimizer, scheduler, args,
                             options.finetuning() if checkpoint.pretrained else options)
    print_rank_0(f"> loaded {loaded['ckpt_format']} checkpoint {checkpoint.path} at iteration "
                 f"{loaded['iteration']} (consumed samples {loaded['consumed_samples']}, "
                 f"optimizer state {'loaded' if loaded['optimizer_loaded'] else 'not loaded'}, "
                 f"RNG states {'restored' if loaded['rng_restored'] else 'not restored'})")
    for note in loaded["notes"]:
        print_rank_0(f"> note: {note}")
    return loaded["iteration"], loaded["consumed_samples"]


class Run:
    """One training run's state between iterations: the model, optimizer and schedule, the
    data, the position (iteration, consumed samples), the log, timers and the summary."""

    def __init__(self, args, model, optimizer, scheduler, forward_step, train_iter, valid_iter,
                 iteration: int, consumed_samples: int, started: float):
        self.args, self.model, self.optimizer, self.scheduler = args, model, optimizer, scheduler
        # the rerun engine validates the loss and may replay an iteration's batches
        self.control = run_control.RunControl(args, model, iteration, started)
        self.forward_step = run_control.checked_forward_step(forward_step, args)
        self.train_iter = run_control.wrap_iterators(train_iter)
        self.valid_iter = valid_iter
        self.data = [*train_iter, *(valid_iter or [])]
        self.iteration, self.consumed_samples = iteration, consumed_samples
        self.skipped_samples = getattr(args, "skipped_train_samples", 0)  # of a resumed run
        self.start_iteration, self.saved_at = iteration, None
        self.checkpointing = CheckpointingContext()  # what the run's saves share
        self.batches = BatchSchedule(args, torch.distributed.get_rank())
        self.batches.update(consumed_samples)  # a resumed run's batch (--rampup-batch-size)
        self.forward_backward = get_forward_backward_func()
        self.expert_load = ExpertLoad(model, mtp.model_layers(args), args.num_experts)
        self.log = TrainingLog(args, torch.distributed.get_rank() == 0, iteration, CHUNK_NOTATION,
                               unwrap(model[0]).vocab_size)
        self.timers = Timers.install(args, model, optimizer)  # Megatron-Core's, --timing-log-*
        self.progress_log = ProgressLog(args, self.log.flops_per_sample)
        self.progress_log.start(consumed_samples)
        self.num_zeros, self.last_losses = None, {}
        self.summary = {"losses": [], "eval": [], "checkpoint": None, "iteration_times": [],
                        "grad_norms": []}
        for chunk in model:
            chunk.train()
        config = unwrap(model[0]).config
        self.timer = timing.StepTimer.install(model, self.optimizer, config, args)
        # --overlap-param-gather: no forward pre-hooks in the first step (Megatron-LM's order)
        self.param_gather = ddp.ParamGather(model, config, args)
        self.param_gather.disable(param_sync=False)
        self.grad_ready = ddp.GradReadyCounts(model, args)

    def next_batch(self) -> None:
        """The next iteration's global batch, from the samples consumed (--rampup-batch-size);
        where its micro-batches change, with --save, a checkpoint first (Megatron-LM's)."""
        if self.batches.update(self.consumed_samples) and self.args.save \
                and self.saved_at != self.iteration:
            self.save()

    def step(self):
        """One iteration: forward and backward over the micro-batches (again, when the rerun
        engine reruns it), the optimizer step and the schedule's; the losses (averaged over
        data-parallel ranks) go to the summary and the log's interval. Returns the gradient
        norm; None when the rerun engine stops the run (summary's exit_code), before the
        optimizer steps."""
        args, batches, step_start = self.args, self.batches, time.time()
        self.timer.step_start()
        for _ in self.control.passes(self.train_iter):
            for chunk in self.model:
                chunk.zero_grad_buffer()
            layers = self.expert_load.layers
            self.grad_ready.before_step(still_tuning(layers), runs_pipelined(layers))
            self.optimizer.zero_grad()
            with run_control.rejected_results_stop():
                losses_reduced = self.forward_backward(
                    forward_step_func=self.forward_step, data_iterator=self.train_iter,
                    model=self.model, num_microbatches=batches.num_microbatches,
                    seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                    forward_only=False)
            self.grad_ready.after_backward()
        stop = self.control.rerun_stop()
        if stop:
            self.summary["exit_code"], self.summary["exit_reason"] = stop
            print_rank_0(f"> rerun engine: iteration {self.iteration + 1}: {stop[1]}: stopping "
                         f"with exit status {stop[0]}")
            return None
        with self.timers.region("optimizer", log_level=1):
            update_successful, grad_norm, self.num_zeros = self.optimizer.step()
        self.param_gather.enable()
        if update_successful:  # else fp16: gradients overflowed, the loss scale was lowered
            self.scheduler.step(increment=batches.running)
        self.iteration += 1
        self.consumed_samples += batches.running
        self.skipped_samples += batches.skipped
        self.args.skipped_train_samples = self.skipped_samples  # saved with the args
        self.summary["iteration_times"].append(time.time() - step_start)
        losses = from_last_stage(reduce_losses(add_losses(losses_reduced))
                                 if parallel_state.is_pipeline_last_stage() else None)
        self.summary["losses"].append(losses["lm loss"])
        self.summary["grad_norms"].append(None if grad_norm is None else float(grad_norm))
        self.timer.step_end(self.iteration, losses)
        self.log.interval.add(losses, update_successful, batches.running,
                              batches.num_microbatches)
        self.last_losses = losses
        return grad_norm

    def log_iteration(self, grad_norm) -> None:
        """Megatron-LM's training_log of the iteration just run (training/log.py): its values
        to TensorBoard / W&B every --tensorboard-log-interval; every --log-interval the line of
        the interval (with the router losses and the expert load, reduced over the ranks), the
        timers and the step-time breakdown's. Collective where either is due."""
        values = self.log.collect(self.iteration, self.model, self.optimizer, grad_norm,
                                  self.num_zeros, self.last_losses)
        if values is None:
            return
        self.log.record(self.iteration, self.consumed_samples, values)
        if self.log.line_due(self.iteration):
            self.log.iteration(self.iteration, (self.consumed_samples, self.skipped_samples),
                               values, self.expert_load.shares(), self.summary, self.timers)
            self.timer.log(self.iteration)

    def skip(self) -> None:
        """--iterations-to-skip: the iteration's batches drawn and dropped (counted as consumed
        and skipped samples, as Megatron-LM counts them); no step, no log."""
        self.control.skip(self.train_iter, self.batches.num_microbatches)
        self.iteration += 1
        self.consumed_samples += self.batches.running
        self.skipped_samples += self.batches.running
        self.args.skipped_train_samples = self.skipped_samples  # saved with the args
        print_rank_0(f"> --iterations-to-skip: skipped iteration {self.iteration}")

    def evaluate(self) -> None:
        if self.valid_iter is None:  # no validation data (Megatron-LM: no evaluation)
            return
        faults.record_progress(self.iteration, "evaluating", self.args.save)
        self.param_gather.disable()  # parameters gathered, no hooks (as Megatron-LM)
        with self.timers.paused(), self.control.evaluation(), \
                run_control.rejected_results_stop():  # Megatron-LM times training steps only
            losses = evaluate(self.forward_step, self.valid_iter, self.model, self.args,
                              self.control.time_up if self.args.exit_duration_in_mins else None)
        self.param_gather.enable()
        if losses is not None:  # else --exit-duration-in-mins ended it
            self.summary["eval"].append((self.iteration, losses))
            self.log.validation(self.iteration, self.consumed_samples, losses)
        self.log.interval.restart_clock()

    def save(self, kind: str = PERSISTENT) -> str:
        """A persistent save into --save, or a non-persistent one."""
        faults.record_progress(self.iteration, "saving a checkpoint", self.args.save)
        persistent, notes = kind == PERSISTENT, []
        root = self.args.save if persistent else non_persistent_root(self.args, self.args.save)
        # --ckpt-assume-constant-structure: two saves agreed, the next ones reuse their plan
        reused = " (the structure of the saves before it reused)" \
            if self.checkpointing.structure_reused() else ""
        # --overlap-param-gather: the last step's parameters gathered before they are saved
        with self.param_gather.disabled():
            path = save_checkpoint(root, self.iteration, self.model, self.optimizer,
                                   self.scheduler, self.consumed_samples, self.args,
                                   context=self.checkpointing, non_persistent=not persistent,
                                   notes=notes)
        if persistent:
            self.saved_at = self.iteration
            self.progress_log.saved(self.iteration, self.consumed_samples)
        print_rank_0(f"> saved {'' if persistent else 'non-persistent '}checkpoint at "
                     f"iteration {self.iteration} to {path}{reused}")
        for note in notes:
            print_rank_0(f"> {note}")
        self.log.interval.restart_clock()
        return path

    def close(self) -> None:
        """What the run changed put back (run_control's), its data loaders' workers ended."""
        self.control.close()
        for iterator in self.data:
            shut_down(iterator)

    def finish(self) -> dict:
        """Save where the last save is older than the last iteration, close, say where the
        results are; returns the summary."""
        args, iteration, summary = self.args, self.iteration, self.summary
        summary["iteration"] = iteration
        if args.save and iteration > self.start_iteration and self.saved_at != iteration:
            summary["checkpoint"] = self.save()
        elif args.save and self.saved_at == iteration:
            summary["checkpoint"] = os.path.join(args.save, f"iter_{iteration:07d}")
        self.close()  # after the save: a second exit signal must not cut it short
        faults.record_progress(iteration, "done", args.save)
        self.timer.close()
        self.log.done(iteration, summary)
        summary["dispatcher_choices"] = self.log.choices.choices
        return summary
