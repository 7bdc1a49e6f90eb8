"""Megatron-LM's data-parallel flags, mapped onto Megatron-Core 0.16.1 as Megatron-LM's
training maps them.

    (the flags --overlap-grad-reduce, --overlap-param-gather, --use-distributed-optimizer,
    --ddp-bucket-size, --ddp-num-buckets, --ddp-reduce-scatter-with-fp32-accumulation and
    --ddp-average-in-collective are declared in megatron_parm.settings;
    the distributed optimizer's checkpoints, --dist-ckpt-optim-fully-reshardable:
    checkpointing/optimizer_state.py)
    (what Megatron-Core cannot run here, naming the flag, why and which flag to drop:
    layout_rules.ddp_problem, checked with the other flags by training/arguments.py)
    ddp_config(args, chunks)         the DistributedDataParallelConfig (chunks: this rank's
                                     model chunks, whose parameters --ddp-num-buckets divides)
    broadcast_params(model, args)    --data-parallel-random-init: the first data-parallel
                                     rank's weights on every one
    WeakHookDDP(config, ddp_config, module)   Megatron-Core's DDP, freed when a run ends
    wrap(config, ddp_config, chunk, index)    a model chunk in that DDP, or with
                                     --use-megatron-fsdp in Megatron-FSDP
    set_sync_funcs(config, model, args)   the schedule's no_sync / grad_sync / param_sync hooks
    GradReadyCounts(model, args)     --overlap-grad-reduce's hook counts, learnt again where
                                     S2's chunks or parm's tuning change them
    ParamGather(model, config, args)      --overlap-param-gather's forward pre-hooks, switched off
                                     for the first step, evaluation and checkpoints

What each flag does (Megatron-Core's DistributedDataParallel and DistributedOptimizer do the
work; nothing here reduces a gradient):
  --overlap-grad-reduce        the gradients' all-reduce (reduce-scatter with the distributed
                               optimizer) starts per bucket during the last micro-batch's
                               backward, as soon as a bucket's gradients are complete, instead
                               of once after it (finalize_model_grads waits for them);
  --ddp-bucket-size N          parameters per bucket (default max(4e7, 1e6 x DP size));
                               Megatron-Core uses one bucket without --overlap-grad-reduce, so
                               the size matters only with it;
  --ddp-num-buckets N          the same, as the rank's parameters (every chunk's) divided by N;
  --ddp-reduce-scatter-with-fp32-accumulation
                               the distributed optimizer's reduce-scatter done as an all-to-all
                               of the gradients and a sum of them in fp32 on each rank
                               (Megatron-Core's; one bucket with --overlap-grad-reduce);
  --use-distributed-optimizer  the optimizer state and fp32 main parameters sharded over the
                               data-parallel ranks (ZeRO-1): gradients reduce-scattered, each
                               rank updates its shard, parameters all-gathered after the step;
  --overlap-param-gather       that all-gather started after the step and waited for by each
                               module's forward pre-hook in the next forward (needs both flags
                               above, as in Megatron-LM);
  --ddp-average-in-collective  the gradients averaged by the collective (ReduceOp.AVG) instead
                               of scaled by 1/DP before a summing one;
  --num-distributed-optimizer-instances N   the distributed optimizer sharded within groups of
                               DP / N ranks (reduce-scatter there, then an all-reduce of each
                               shard across the N groups), N copies of its state.
  --use-megatron-fsdp          the chunks in Megatron-Core's FullyShardedDataParallel
                               (Megatron-FSDP) instead of its DDP, sharding what
                               --data-parallel-sharding-strategy says over the data-parallel
                               ranks (expert parameters over the expert data-parallel ones): optim (ZeRO-1), optim_grads (ZeRO-2:
                               gradients reduce-scattered after each micro-batch's backward),
                               optim_grads_params (ZeRO-3: each transformer layer's parameters
                               all-gathered before its forward and backward, freed after);
                               get_megatron_optimizer then builds Megatron-Core's optimizer over
                               its shards. What it cannot run here: arguments._validate_fsdp.
"""

from __future__ import annotations

import contextlib
import weakref

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import param_and_grad_buffer

from megatron_parm.mcore_compat.comm_stream import on_compute_thread
from megatron_parm.training import mixed_precision


# The reduce-scatter Megatron-Core's buffers call: its DDP swaps in the fp32-accumulating one
# (a module global) when a config asks for it and never back, so a later run of the same process
# without the flag puts it back.
_REDUCE_SCATTER = param_and_grad_buffer.dist_reduce_scatter_func


def ddp_config(args, chunks=()) -> DistributedDataParallelConfig:
    """The DistributedDataParallelConfig Megatron-LM's training builds from the same flags
    (grad_reduce_in_fp32 from the precision flags; align_param_gather on, its default; each
    gradient bucket checked for NaN and Inf before its reduction unless
    --no-check-for-nan-in-loss-and-grad, and for large norms with --check-for-large-grads:
    Megatron-Core's rerun engine, training.run_control); --ddp-num-buckets divides the
    parameters of CHUNKS (this rank's model chunks)."""
    bucket_size = args.ddp_bucket_size
    if getattr(args, "ddp_num_buckets", None) is not None:
        num_params = sum(param.nelement() for chunk in chunks for param in chunk.parameters())
        bucket_size = num_params // args.ddp_num_buckets
    fp32_accumulation = bool(getattr(args, "ddp_reduce_scatter_with_fp32_accumulation", False))
    if not fp32_accumulation:
        param_and_grad_buffer.dist_reduce_scatter_func = _REDUCE_SCATTER
    return DistributedDataParallelConfig(
        check_for_nan_in_grad=getattr(args, "check_for_nan_in_loss_and_grad", False),
        check_for_large_grads=getattr(args, "check_for_large_grads", False),
        grad_reduce_in_fp32=mixed_precision.grad_reduce_in_fp32(args),
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        align_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        bucket_size=bucket_size,
        reduce_scatter_with_fp32_accumulation=fp32_accumulation,
        average_in_collective=args.ddp_average_in_collective,
        use_megatron_fsdp=args.use_megatron_fsdp,
        data_parallel_sharding_strategy=args.data_parallel_sharding_strategy)


def broadcast_params(model, args) -> None:
    """--data-parallel-random-init: every data-parallel rank starts from the first one's
    weights (each was seeded differently: trainer.set_seed), as Megatron-LM does after wrapping
    the model in DDP. Collective."""
    if getattr(args, "data_parallel_random_init", False):
        for chunk in model:
            chunk.broadcast_params()


class WeakHookDDP(DistributedDataParallel):
    """Megatron-Core's DistributedDataParallel whose gradient hooks hold it weakly.

    Megatron-Core's hooks sit on each parameter's gradient accumulator and hold the DDP
    wrapper, hence the model, its optimizer's views and its process groups. Tensors that a
    module keeps from its last forward (the token dispatcher's probabilities, the distributed
    optimizer's shard views) hold that accumulator through their autograd graph, which the
    garbage collector cannot see: a finished run stayed alive, and under gloo each of its
    destroyed groups kept its I/O threads (a launch of a few dozen runs reached a thousand
    threads per rank and spent most of its CPU in the kernel). Here a hook reaches the
    wrapper through a weak reference, and the run's objects go with its last reference."""

    def _make_backward_post_hook(self, param):
        wrapper = weakref.ref(self)
        make = DistributedDataParallel._make_backward_post_hook

        def hook(*unused):
            ddp = wrapper()
            if ddp is not None:
                # A gradient of the combined 1F1B's communication nodes (on the CPU, a thread of
                # their own) may complete a bucket, whose reduction must keep the compute
                # thread's order on every rank.
                on_compute_thread(lambda: make(ddp, param)(*unused))

        return hook


def wrap(config, ddp_config, chunk, index: int):
    """Model chunk INDEX in Megatron-Core's DDP, or with --use-megatron-fsdp in its
    FullyShardedDataParallel, as Megatron-LM's get_model wraps it: only the first chunk's
    gradients are bucketed (the others' reductions wait for the end of the step anyway)."""
    if ddp_config.use_megatron_fsdp:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        return FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                        disable_bucketing=index > 0)
    return WeakHookDDP(config, ddp_config, chunk, disable_bucketing=index > 0)


def _per_chunk(functions):
    return functions[0] if len(functions) == 1 else functions


def set_sync_funcs(config, model, args) -> None:
    """The hooks Megatron-Core's schedules call, set as Megatron-LM's training sets them:
    no_sync (no reduction before the last micro-batch), grad_sync with --overlap-grad-reduce
    (start each chunk's reduction when its backward ends: aligned across pipeline stages) and
    param_sync with --overlap-param-gather (start each chunk's all-gather before its forward)."""
    config.no_sync_func = _per_chunk([chunk.no_sync for chunk in model])
    if args.overlap_grad_reduce:
        config.grad_sync_func = _per_chunk([chunk.start_grad_sync for chunk in model])
    if args.overlap_param_gather:
        config.param_sync_func = _per_chunk([chunk.start_param_sync for chunk in model])


class GradReadyCounts:
    """--overlap-grad-reduce's per-parameter hook counts, learnt again wherever they may change.

    Megatron-Core 0.16.1 counts in the first step how often each parameter's gradient hook
    fires, and from the second step on starts a bucket's reduction as soon as every parameter
    of the bucket has reached its count. parm_s2 runs the experts' backward once per backward
    chunk (one autograd call each, over every sub-chunk's graph, empty ones too), so with
    experts that do not defer their weight gradients (SequentialMLP) an expert's weight hooks
    fire once per backward chunk: a count that changes with the schedule's chunking (parm
    may choose another; it changed with the routing too while S2 skipped the backward of a
    rank's empty sub-chunks). A count that grows would start the reduction with part of the
    gradients (the later chunks' added to a buffer already being reduced); one that shrinks
    never starts it (Megatron's assertion "Communication call has not been issued", seen on the
    emulated cluster at (2,2,1)); a hook that never fired in the first step fails Megatron's
    check when the counts are recorded. So:
      * in a step where a pipelined schedule may run (parm_s2, or parm having chosen it), the
        expert-parallel bucket groups run as in a first step: their reduction starts after
        the backward (not overlapped) on the whole buffer; the dense buckets' reduction stays
        overlapped (their hooks fire once per step);
      * while parm measures its candidates (another schedule in each step), and in the step
        after its decision, every bucket group does;
      * counts that miss a parameter (a hook that never fired) are not recorded: that group
        stays in first-step mode.
    Without --overlap-grad-reduce it does nothing."""

    def __init__(self, model, args):
        self.model = model
        self.active = args.overlap_grad_reduce
        self.changing = True  # the first step learns them anyway

    def _groups(self, every: bool):
        for chunk in self.model:
            yield from (chunk.bucket_groups if every else [])
            yield from chunk.expert_parallel_bucket_groups

    def before_step(self, tuning: bool, pipelined: bool) -> None:
        """Call after the step's zero_grad_buffer (which records the last step's counts).
        tuning: a dispatcher may run another schedule in this step than in the last;
        pipelined: a dispatcher runs a pipelined schedule."""
        if self.active and (tuning or self.changing or pipelined):
            for group in self._groups(every=tuning or self.changing):
                group.is_first_batch = True
                group.golden_per_param_grad_ready_counts = {}
        self.changing = tuning

    def after_backward(self) -> None:
        """Call after the step's gradient reduction: drop the counts that miss a parameter,
        so that the next zero_grad_buffer records none."""
        if self.active:
            for group in self._groups(every=True):
                if group.is_first_batch and \
                        len(group.per_param_grad_ready_counts) != len(group.params):
                    group.per_param_grad_ready_counts = {}


class ParamGather:
    """--overlap-param-gather's forward pre-hooks (they wait for a module's parameters'
    all-gather), switched as Megatron-LM switches them: off for the first training step (a
    checkpoint or initialisation error must not reach every rank in the first all-gather), and
    off with the parameters gathered synchronously around evaluation and checkpoint saves.
    Without the flag every method does nothing."""

    def __init__(self, model, config, args):
        self.model, self.config = model, config
        self.active = args.use_distributed_optimizer and args.overlap_param_gather
        self.enabled = self.active
        self._param_sync_func = getattr(config, "param_sync_func", None)

    def disable(self, param_sync: bool = True) -> None:
        if self.enabled:
            for chunk in self.model:
                chunk.disable_forward_pre_hook(param_sync=param_sync)
            self.config.param_sync_func = None
            self.enabled = False

    def enable(self) -> None:
        if self.active and not self.enabled:
            for chunk in self.model:
                chunk.enable_forward_pre_hook()
            self.config.param_sync_func = self._param_sync_func
            self.enabled = True

    @contextlib.contextmanager
    def disabled(self):
        """Parameters gathered and hooks off inside (evaluation, a checkpoint save); back on
        after, if they were on."""
        was_enabled = self.enabled
        self.disable()
        try:
            yield
        finally:
            if was_enabled:
                self.enable()
