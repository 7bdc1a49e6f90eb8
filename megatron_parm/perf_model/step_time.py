"""Predicted time of one training step of the whole model on one rank.

Notation: see transformer.py and memory.py (L, h, a, s, b, n = s b / t, V, p, t, e, x, E);
    m  micro-batches per step per data-parallel rank = global batch / (b * W / t)

One micro-batch, forward + backward (pipeline parallel size 1, sequence parallel when t > 1):
    MoE layers    L * predict(dispatcher, its chunks) (predict.py, the catalog's cost plan): the
                  dispatcher's collectives and the expert GEMMs, with the profile's in-layer terms
    dense GEMMs   per layer QKV 2 s b h 3h / t, scores and context 2 * 2 b s^2 h / t, projection
                  2 s b h h / t, router 2 n h E; head: output layer 2 s b h V / t (BERT also its
                  lm_head dense 2 n h h); backward twice the forward flops. Each GEMM costs the
                  profile's compute alpha once forward and twice backward (input and weight
                  gradients), plus compute beta per flop
    TP collectives (t > 1) per layer, bytes n h p per peer: forward AG before QKV and RS after
                  the projection; backward the duals plus the AG that re-gathers QKV's input for
                  its weight gradient (Megatron keeps only the shard). Embedding: RS forward, AG
                  backward; output layer: AG forward, AG + RS backward; the vocab-parallel
                  cross entropy: three AR of s b fp32 values
    framework     the profile's microbatch_overhead + L * layer_overhead: the time of a
                  micro-batch that no GEMM or collective above accounts for (Python, autograd,
                  element-wise kernels, Megatron's schedule), fitted by tools/calibrate.py on
                  the real model
Per step:
    m * (one micro-batch)
    + gradient reduction: AR of the dense gradients over "dp" (W / t ranks) and of the expert
      gradients over "expt_dp" (W / (e x) ranks); with --use-distributed-optimizer an RS of the
      gradients and an AG of the updated weights instead; with t > 1 an AR over TP of the
      LayerNorm and router gradients (replicated under sequence parallelism)
Not modelled: the optimizer step itself, overlap of the gradient reduction with the backward pass (the trainer reduces
after the last micro-batch), data loading.
"""

from dataclasses import dataclass
from typing import Dict, Optional

from megatron_parm.data.vocab import padded_vocab_size
from megatron_parm.layout_rules import batch_problem
from megatron_parm.perf_model.layout import Layout
from megatron_parm.perf_model.memory import Precision, layer_shape
from megatron_parm.perf_model.predict import Prediction, stage_time, predict
from megatron_parm.perf_model.profile import Profile
from megatron_parm.perf_model.transformer import ModelSpec, parameter_counts, replicated_over_tp
from megatron_parm.perf_model.volumes import place_stage
from megatron_parm.schedules import FORWARD, Stage


@dataclass(frozen=True)
class StepTime:
    """Seconds on one rank; the micro-batch terms are forward + backward of one micro-batch."""

    moe_s: float
    dense_compute_s: float
    tp_comm_s: float
    framework_s: float  # the profile's framework terms, one micro-batch
    num_microbatches: int
    grad_reduce_s: float
    tokens_per_step: int
    moe_layer: Prediction  # one MoE layer, for the breakdown

    @property
    def microbatch_s(self) -> float:
        return self.moe_s + self.dense_compute_s + self.tp_comm_s + self.framework_s

    @property
    def step_s(self) -> float:
        return self.num_microbatches * self.microbatch_s + self.grad_reduce_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    def as_dict(self) -> Dict[str, float]:
        return {"moe_s": self.moe_s, "dense_compute_s": self.dense_compute_s,
                "tp_comm_s": self.tp_comm_s, "framework_s": self.framework_s,
                "microbatch_s": self.microbatch_s,
                "num_microbatches": self.num_microbatches, "grad_reduce_s": self.grad_reduce_s,
                "step_s": self.step_s, "tokens_per_s": self.tokens_per_s}


def collective_seconds(profile: Profile, layout: Layout, kind: str, group: str,
                       bytes_per_peer: float) -> float:
    """One collective on `group` ("tp", or the data-parallel "dp" / "expt_dp"), placed and
    timed as the performance model places and times a dispatcher's stages (volumes.py,
    predict.py); 0 for a group of one rank."""
    stage = Stage(FORWARD, kind, kind, group, bytes_per_peer=bytes_per_peer)
    return sum(stage_time(step, profile, 1).seconds for step in place_stage(stage, layout))


def _gemms_seconds(profile: Profile, forward_flops) -> float:
    """Forward + backward of GEMMs with these forward flops (backward: two GEMMs, 2x flops)."""
    return sum(3 * profile.compute_alpha + 3 * flops * profile.compute_beta
               for flops in forward_flops)


def dense_compute_seconds(spec: ModelSpec, layout: Layout, micro_batch_size: int,
                          profile: Profile) -> float:
    t, h, s = layout.tp, spec.hidden_size, spec.seq_length
    tokens = s * micro_batch_size  # the whole sequence: attention GEMMs see it all under SP
    local = tokens // t
    per_layer = (2 * tokens * h * 3 * h / t, 2 * micro_batch_size * s * s * h / t,
                 2 * micro_batch_size * s * s * h / t, 2 * tokens * h * h / t,
                 2 * local * h * spec.num_experts)
    head = [2 * tokens * h * padded_vocab_size(spec.vocab_size, t) / t]
    if spec.model_type == "bert":
        head.append(2 * local * h * h)
    return spec.num_layers * _gemms_seconds(profile, per_layer) + _gemms_seconds(profile, head)


def tp_comm_seconds(spec: ModelSpec, layout: Layout, micro_batch_size: int, profile: Profile,
                    precision: Precision) -> float:
    t = layout.tp
    if t == 1:
        return 0.0
    tokens = spec.seq_length * micro_batch_size
    shard = tokens // t * spec.hidden_size * precision.activation_bytes

    def collective(kind, bytes_per_peer):
        return collective_seconds(profile, layout, kind, "tp", bytes_per_peer)

    all_gather, reduce_scatter = collective("all_gather", shard), collective("reduce_scatter", shard)
    per_layer = 3 * all_gather + 2 * reduce_scatter
    embedding = reduce_scatter + all_gather
    output_layer = 2 * all_gather + reduce_scatter
    cross_entropy = 3 * collective("all_reduce", 2.0 * tokens * 4 / t)
    return spec.num_layers * per_layer + embedding + output_layer + cross_entropy


def grad_reduce_seconds(spec: ModelSpec, layout: Layout, profile: Profile,
                        precision: Precision, distributed_optimizer: bool) -> float:
    counts = parameter_counts(spec, layout.tp, layout.ep, layout.etp)
    seconds = 0.0
    for group, params in (("dp", counts.embedding + counts.dense), ("expt_dp", counts.expert)):
        size = layout.group_size(group)
        grads = params * precision.grad_bytes
        if distributed_optimizer:
            seconds += collective_seconds(profile, layout, "reduce_scatter", group, grads / size)
            seconds += collective_seconds(profile, layout, "all_gather", group,
                                          params * precision.weight_bytes / size)
        else:
            seconds += collective_seconds(profile, layout, "all_reduce", group,
                                          2.0 * grads / size)
    if layout.tp > 1:
        replicated = replicated_over_tp(spec) * precision.grad_bytes
        seconds += collective_seconds(profile, layout, "all_reduce", "tp",
                                      2.0 * replicated / layout.tp)
    return seconds


def framework_seconds(spec: ModelSpec, profile: Profile) -> float:
    """The profile's framework time of one micro-batch (forward + backward)."""
    return profile.microbatch_overhead + spec.num_layers * profile.layer_overhead


def step_time(spec: ModelSpec, layout: Layout, profile: Profile, dispatcher: str,
              num_chunks: Optional[int], micro_batch_size: int, global_batch_size: int,
              precision: Precision, distributed_optimizer: bool = False) -> StepTime:
    """Predicted step of `spec` on `layout` with `dispatcher` (a schedule with a cost plan in
    the catalog; num_chunks for a chunked one)."""
    data_parallel = layout.world_size // layout.tp
    per_step = micro_batch_size * data_parallel
    problem = batch_problem(global_batch_size, micro_batch_size, data_parallel)
    if problem:
        raise ValueError(problem)
    shape = layer_shape(spec, layout, micro_batch_size, precision)
    moe_layer = predict(dispatcher, shape, layout, profile, num_chunks, sequence_parallel=True)
    return StepTime(
        moe_s=spec.num_layers * moe_layer.total_s,
        dense_compute_s=dense_compute_seconds(spec, layout, micro_batch_size, profile),
        tp_comm_s=tp_comm_seconds(spec, layout, micro_batch_size, profile, precision),
        framework_s=framework_seconds(spec, profile),
        num_microbatches=global_batch_size // per_step,
        grad_reduce_s=grad_reduce_seconds(spec, layout, profile, precision,
                                          distributed_optimizer),
        tokens_per_step=global_batch_size * spec.seq_length,
        moe_layer=moe_layer,
    )
